"""Token bookkeeping shared by both backends: positions, attention segments, RoPE frequencies.

These depend only on `grid_thw` and the geometry, never on weights, so they are computed on
the host in NumPy for both engines (the GPU engine uploads the results). Keeping one copy is
what makes the two backends agree on which token sits where.

Token order is block-major: within each image the patches of every 2x2 merge block are
consecutive, ((h/2, 2, w/2, 2) -> swap axes 1 and 2 -> flatten), repeated for each of the t
frames. The preprocessor emits pixel rows in the same order, and the downsample relies on it
(each run of 4 consecutive tokens is one merged token).
"""

from __future__ import annotations

import numpy as np

from ..errors import GlmVitError
from .geometry import GlmVitGeometry


def check_grid(grid_thw: np.ndarray, geo: GlmVitGeometry) -> np.ndarray:
    """Validate `grid_thw` ([N, 3] of positive t, h, w with h, w divisible by the merge)."""
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise GlmVitError(f"grid_thw has shape {list(grid.shape)}, expected [images, 3]")
    if not np.issubdtype(grid.dtype, np.integer):
        raise GlmVitError(f"grid_thw has dtype {grid.dtype}, expected integers")
    m = geo.spatial_merge_size
    for i, (t, h, w) in enumerate(grid.tolist()):
        if t <= 0 or h <= 0 or w <= 0 or h % m or w % m:
            raise GlmVitError(f"grid_thw row {i} is ({t}, {h}, {w}): t, h, w must be positive and "
                              f"h, w multiples of spatial_merge_size {m}")
    return grid.astype(np.int64)


def num_patches(grid_thw: np.ndarray) -> int:
    return int(np.prod(grid_thw, axis=1).sum())


def block_major_positions(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """Per-token (h_id, w_id), int32 [P, 2], in the block-major order described above."""
    out = []
    for t, h, w in grid_thw.tolist():
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        ww = ww.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hh, ww], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int32)


def frame_segments(grid_thw: np.ndarray) -> np.ndarray:
    """Attention segments, int64 [S, 2] of (start, length): one per (image, frame)."""
    lengths = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.stack([starts, lengths], axis=-1).astype(np.int64)


def merged_offsets(grid_thw: np.ndarray, merge_unit: int) -> np.ndarray:
    """Per-image offsets into the merged-token outputs, int64 [N + 1]."""
    return np.concatenate([[0], np.cumsum(np.prod(grid_thw, axis=1) // merge_unit)]).astype(np.int64)


def rope_inv_freq(geo: GlmVitGeometry) -> np.ndarray:
    """inv_freq[k] = theta^(-2k / (head_dim/2)), k < head_dim/4, in float32 like the oracle."""
    spatial = geo.head_dim // 2
    exponent = np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)
    return (np.float32(1.0) / np.float32(geo.rope_theta) ** exponent).astype(np.float32)
