"""The NumPy reference: the tower's math in float32, readable top to bottom.

This is the statement of what the GPU engine (`engine.py`) computes, step for step and
under the same names, and what CI checks against transformers' `Glm5NextVisionModel`.
Weights are the checkpoint's BF16 values widened to float32; every activation is float32.
The forward's steps, numbered in the comments below (and in engine.py): 1 the patch embed,
2 block-major positions, 3 attention segments (one per image frame), 4 the axial RoPE tables,
5 the blocks, 6 the post-layernorm, 7 the 2x2 downsample, 8 the merger.
`gemm_inputs=bf16_round` makes it the GPU engine's same-precision baseline: every GEMM's
activation operand rounded to BF16 (the weights already are), residual stream and
accumulation still float32. The GPU tests hold the engine to a multiple of that error.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..bf16 import bf16_to_f32
from .checkpoint import TowerWeights
from .geometry import GlmVitGeometry, check_patch_budget
from .layout import block_major_positions, frame_segments, num_patches, rope_inv_freq
from .weights import GlmVitTensors

LAYERNORM_EPS = 1e-5  # the merger's nn.LayerNorm default, not config's rms_norm_eps


def _exact(x: np.ndarray) -> np.ndarray:
    return x


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    centred = x - x.mean(axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + np.float32(eps)) * w + b


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """Exact GELU, 0.5 x (1 + erf(x / sqrt 2)); erf from erfc's Chebyshev fit (rel. error < 1.2e-7)."""
    z = np.abs(x.astype(np.float64)) / np.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    erf = np.sign(x) * (1.0 - t * np.exp(poly))
    return (0.5 * x * (1.0 + erf)).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def swiglu_clamp(gate_up: np.ndarray, limit: float) -> np.ndarray:
    """silu(min(gate, L)) * clamp(up, -L, L) over a [rows, 2 x inter] gate|up product."""
    gate, up = np.split(gate_up, 2, axis=-1)
    return silu(np.minimum(gate, np.float32(limit))) * np.clip(up, -limit, limit)


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Step 4: (cos, sin) [P, head_dim/2] of the angles [h * inv_freq, w * inv_freq]."""
    pos = positions.astype(np.float32)
    angles = np.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1)
    return np.cos(angles), np.sin(angles)


def qknorm_rope(x: np.ndarray, w: np.ndarray, cos: np.ndarray, sin: np.ndarray, eps: float) -> np.ndarray:
    """Per-head RMSNorm then rotate-half RoPE over the whole head_dim. x: [P, heads, hd]."""
    x = rmsnorm(x, w, eps)
    cos = np.concatenate([cos, cos], axis=-1)[:, None, :]  # the hd/2 angles serve both halves
    sin = np.concatenate([sin, sin], axis=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# Host memory: the forward's widest intermediates are computed a block of rows at a time, never
# as whole [L, L] score matrices (~16 GB at the full token budget; the peak it does reach is in
# benchmarks/NOTES.md).
QUERY_BLOCK = 1024  # query rows of one head's scores: [1024, 32000] float32 is 131 MB
ROW_BLOCK = 4096  # token rows through an MLP: [4096, 2 x 4096] float32 is 134 MB


def segment_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, segments: np.ndarray,
                      block: int, gemm_inputs: Callable[[np.ndarray], np.ndarray] = _exact) -> np.ndarray:
    """softmax(q k^T / sqrt(hd)) v within each segment, head by head and `block` query rows at
    a time (each row's softmax is its own: blocking changes only the GEMMs' summation order).
    q, k, v: [P, heads, hd]; gemm_inputs rounds the probabilities, the P.V GEMM's operand."""
    out = np.empty_like(q)
    scale = np.float32(q.shape[-1] ** -0.5)
    for start, length in segments.tolist():
        end = start + length
        for head in range(q.shape[1]):
            keys_t = np.ascontiguousarray(k[start:end, head].T)
            values = np.ascontiguousarray(v[start:end, head])
            for first in range(start, end, block):
                rows = slice(first, min(first + block, end))
                scores = q[rows, head] @ keys_t
                scores *= scale
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= scores.sum(axis=-1, keepdims=True)
                out[rows, head] = gemm_inputs(scores) @ values
    return out


def by_rows(fn: Callable[[np.ndarray], np.ndarray], x: np.ndarray, block: int) -> np.ndarray:
    """A row-wise `fn` over x, `block` rows at a time: the same rows out, with fn's wide
    intermediates ([rows, 2 x intermediate]) bounded by the block."""
    if len(x) <= block:
        return fn(x)
    return np.concatenate([fn(x[first:first + block]) for first in range(0, len(x), block)])


def im2col_2x2(x: np.ndarray) -> np.ndarray:
    """Step 7: each run of 4 tokens (one 2x2 block) -> one row in (channel, kh, kw) order."""
    return x.reshape(-1, 4, x.shape[-1]).transpose(0, 2, 1).reshape(x.shape[0] // 4, -1)


class NumpyTower:
    """The whole tower in float32 NumPy; `forward` returns (last_hidden_state, pooler_output).
    `gemm_inputs` is applied to every GEMM's activation operand (bf16_round: the engine's
    same-precision baseline; default: left exact)."""

    def __init__(self, weights: TowerWeights, p_max: int,
                 gemm_inputs: Callable[[np.ndarray], np.ndarray] = _exact) -> None:
        self.geo: GlmVitGeometry = weights.location.geometry
        self.p_max = p_max  # the GPU engine's budget, held the same here (the NumPy forward needs no scratch)
        self.w: GlmVitTensors[np.ndarray] = weights.structure(bf16_to_f32)
        self.inv_freq = rope_inv_freq(self.geo)
        self.gemm_inputs = gemm_inputs

    def attention(self, x: np.ndarray, blk, cos, sin, segments) -> np.ndarray:
        geo = self.geo
        r = self.gemm_inputs
        qkv = (r(x) @ blk.qkv_w.T + blk.qkv_b).reshape(len(x), 3, geo.num_heads, geo.head_dim)
        q = qknorm_rope(qkv[:, 0], blk.q_norm_w, cos, sin, geo.rms_norm_eps)
        k = qknorm_rope(qkv[:, 1], blk.k_norm_w, cos, sin, geo.rms_norm_eps)
        o = segment_attention(r(q), r(k), r(qkv[:, 2]), segments, QUERY_BLOCK, r)
        return r(o.reshape(len(x), -1)) @ blk.proj_w.T + blk.proj_b

    def mlp(self, x: np.ndarray, blk) -> np.ndarray:
        r = self.gemm_inputs

        def rows(x: np.ndarray) -> np.ndarray:
            act = swiglu_clamp(r(x) @ blk.gate_up_w.T + blk.gate_up_b, self.geo.swiglu_limit)
            return r(act) @ blk.down_w.T + blk.down_b
        return by_rows(rows, x, ROW_BLOCK)

    def merger(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m, geo, r = self.w.merger, self.geo, self.gemm_inputs
        x = rmsnorm(x, m.post_layernorm_w, geo.rms_norm_eps)  # step 6
        last_hidden = r(im2col_2x2(x)) @ m.downsample_w.T + m.downsample_b  # step 7

        def rows(h: np.ndarray) -> np.ndarray:  # step 8 (gelu_erf works in float64)
            y = gelu_erf(layernorm(r(h) @ m.proj_w.T, m.norm_w, m.norm_b, LAYERNORM_EPS))
            return r(swiglu_clamp(r(y) @ m.gate_up_w.T, geo.swiglu_limit)) @ m.down_w.T
        return last_hidden, by_rows(rows, last_hidden, ROW_BLOCK)

    def forward(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # NumPy's overflow warnings are left out, not the overflow: every caller checks the outputs for
        # NaN/Inf and fails the image in one line naming it; the warnings would add source lines to a log.
        with np.errstate(over="ignore", invalid="ignore"):
            return self._forward(pixel_values, grid_thw)

    def _forward(self, pixel_values: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        geo = self.geo
        check_patch_budget(geo, num_patches(grid_thw), self.p_max, "this forward call")
        cos, sin = rope_tables(block_major_positions(grid_thw, geo.spatial_merge_size), self.inv_freq)
        segments = frame_segments(grid_thw)
        x = self.gemm_inputs(pixel_values.astype(np.float32)) @ self.w.patch_embed_w.T + self.w.patch_embed_b  # step 1
        for blk in self.w.blocks:  # step 5
            x = x + self.attention(rmsnorm(x, blk.norm1_w, geo.rms_norm_eps), blk, cos, sin, segments)
            x = x + self.mlp(rmsnorm(x, blk.norm2_w, geo.rms_norm_eps), blk)
        return self.merger(x)
