"""Token bookkeeping shared by both backends: positions, attention segments, RoPE frequencies;
and, for the GPU engine, the flash kernel's work list.

These depend only on `grid_thw` and the geometry, never on weights, so they are computed on
the host in NumPy for both engines (the GPU engine uploads the results). Keeping one copy is
what makes the two backends agree on which token sits where.

Token order is block-major: within each image the patches of every 2x2 merge block are
consecutive, ((h/2, 2, w/2, 2) -> swap axes 1 and 2 -> flatten), repeated for each of the t
frames. The preprocessor emits pixel rows in the same order, and the downsample relies on it
(each run of 4 consecutive tokens is one merged token).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .errors import GlmVitError
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


# ---- the GPU engine's flash-attention work list (host side, uploaded once per grid) ----

FLASH_BN = 64  # keys per K/V tile of both flash kernels
MIN_PIECE_TILES = 4  # key tiles a piece has at least (a shorter one would be mostly set-up)
MAX_PIECES = 16  # pieces a query tile is cut into at most
MAX_PIECE_ROUNDS = 2  # rounds of pieces at most: their rows pass through cuBLAS's workspace (scratch.py)
MAX_PIECE_GROUPS = 1024  # query tiles cut at once at most (a counter each in the index slab; 24-88 here)


class FlashWork(NamedTuple):
    """What the flash kernel of one grid runs: see flash_work_list."""

    bm: int  # queries per CTA
    tiles: np.ndarray  # int32 [n, 4], one entry per CTA
    first_piece: int  # entries from here on are pieces (== n: none)
    pieces: int  # pieces a query tile (0: none)


def tail_pieces(rem: int, slots: int, most: int) -> int:
    """Pieces each of a tail's `rem` CTAs is cut into: rem x p pieces take ceil(rem x p / slots)
    rounds of 1/p each. The fewest that keep 90% of those rounds' slots busy (2044x2044: 24 x 5
    = 120 of 132; 1036x1036: 88 x 3 = two rounds of 132); failing that, the p that finishes
    soonest; 0 where no cut beats the whole round the tail takes uncut."""
    best, best_time = 0, 1.0
    for p in range(2, most + 1):
        rounds = -(-rem * p // slots)
        if rounds >= p:  # no faster than uncut
            continue
        if 10 * rem * p >= 9 * rounds * slots:
            return p
        if rounds / p < best_time:
            best, best_time = p, rounds / p
    return best


def flash_work_list(segments: np.ndarray, bm: int, heads: int, slots: int = 0) -> FlashWork:
    """One int4 {segment start, length, first query, head | piece << 8 | pieces << 16} per bm-query
    tile and head, head by head (the CTAs in flight then share one head's K/V in L2).

    With one segment and `slots` CTAs a round (Kernels.flash_slots), the entries past the last
    whole round are cut into pieces, each over a range of the keys (tail_pieces says how many);
    the last piece of a query tile to finish merges them. With one CTA an SM, 2044x2044's last
    24 CTAs of 1344 took as long as a whole round. Pieces never outnumber the entries, so the
    list at most doubles (the index slab holds that: scratch.py). Only for one segment: with
    several, which images' tiles form the tail would depend on their order, and so would the
    last bits of their results."""
    entries = [(start, length, q0, head) for head in range(heads) for start, length in segments.tolist()
               for q0 in range(0, length, bm)]
    full, rem = divmod(len(entries), slots) if slots else (0, 0)
    pieces = 0
    if len(segments) == 1 and full and 0 < rem <= MAX_PIECE_GROUPS:
        seg_tiles = -(-int(segments[0, 1]) // FLASH_BN)
        pieces = tail_pieces(rem, slots, min(MAX_PIECES, seg_tiles // MIN_PIECE_TILES,
                                             MAX_PIECE_ROUNDS * slots // rem, len(entries) // rem))
    if pieces < 2:
        return FlashWork(bm, np.array(entries, dtype=np.int32), len(entries), 0)
    first = len(entries) - rem
    cut = [(s, n, q0, head | i << 8 | pieces << 16) for s, n, q0, head in entries[first:] for i in range(pieces)]
    return FlashWork(bm, np.array(entries[:first] + cut, dtype=np.int32), first, pieces)
