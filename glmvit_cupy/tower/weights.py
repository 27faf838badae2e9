"""The tower's weight tree: which tensors it has and their shapes, the blocks + merger a backend
holds them as, and what the GPU engine derives from them at load (`deferred_bias`).

Apart from `checkpoint.py`, which finds and reads the bytes (and imports this, never the other
way round): this module says what the tower IS, one field per weight and the checkpoint name(s)
behind it, written once here; the binder's census, the arena order, the synthetic writer and
both engines all read it from here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Generic, TypeVar

import numpy as np

from ..bf16 import bf16_to_f32
from .geometry import GlmVitGeometry

A = TypeVar("A")


@dataclasses.dataclass(frozen=True)
class GlmVitBlock(Generic[A]):
    """One ViT block's weights, as the backend holds them (NumPy float32 or device BF16)."""

    norm1_w: A
    qkv_w: A  # [3h, h]
    qkv_b: A
    # Per-head RMSNorm on Q and K, [head_dim]: after the QKV split, BEFORE the rotary.
    q_norm_w: A
    k_norm_w: A
    proj_w: A
    proj_b: A
    norm2_w: A
    gate_up_w: A  # [2 x intermediate, h]: gate rows, then up rows (one GEMM)
    gate_up_b: A
    down_w: A
    down_b: A


@dataclasses.dataclass(frozen=True)
class GlmVitMerger(Generic[A]):
    """Everything after the last block: post-norm, 2x2 conv downsample, the merger MLP."""

    post_layernorm_w: A
    downsample_w: A  # [out, 4h], (channel, kh, kw) order: the im2col is a plain reshape
    downsample_b: A
    proj_w: A
    norm_w: A  # LayerNorm (mean-subtracting, biased), unlike every other norm here
    norm_b: A
    gate_up_w: A  # [2 x projection_intermediate, out]
    down_w: A


@dataclasses.dataclass(frozen=True)
class GlmVitTensors(Generic[A]):
    patch_embed_w: A  # [h, patch_dim]
    patch_embed_b: A
    blocks: list[GlmVitBlock[A]]
    merger: GlmVitMerger[A]


# Field -> the checkpoint tensor behind it (short name: after `blocks.{i}.` for a block's), or
# the two stored back to back and read as one (the gate|up pairs). In field order, which is the
# arena's: each pair's halves adjacent, so one GEMM runs both.
BLOCK_NAMES: dict[str, str | tuple[str, str]] = {
    "norm1_w": "norm1.weight", "qkv_w": "attn.qkv.weight", "qkv_b": "attn.qkv.bias",
    "q_norm_w": "attn.q_norm.weight", "k_norm_w": "attn.k_norm.weight",
    "proj_w": "attn.proj.weight", "proj_b": "attn.proj.bias", "norm2_w": "norm2.weight",
    "gate_up_w": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "gate_up_b": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "down_w": "mlp.down_proj.weight", "down_b": "mlp.down_proj.bias",
}
EMBED_NAMES: dict[str, str | tuple[str, str]] = {
    "patch_embed_w": "patch_embed.proj.weight", "patch_embed_b": "patch_embed.proj.bias"}
MERGER_NAMES: dict[str, str | tuple[str, str]] = {
    "post_layernorm_w": "post_layernorm.weight", "downsample_w": "downsample.weight",
    "downsample_b": "downsample.bias", "proj_w": "merger.proj.weight",
    # The only mean-subtracting, biased norm in the tower: its bias is what tells it apart.
    "norm_w": "merger.post_projection_norm.weight", "norm_b": "merger.post_projection_norm.bias",
    "gate_up_w": ("merger.gate_proj.weight", "merger.up_proj.weight"),
    "down_w": "merger.down_proj.weight",
}


def _each(names: str | tuple[str, str]) -> tuple[str, ...]:
    """The checkpoint tensor(s) behind one field."""
    return (names,) if isinstance(names, str) else names


def _names(fields: dict[str, str | tuple[str, str]]) -> tuple[str, ...]:
    return tuple(n for names in fields.values() for n in _each(names))


BLOCK_TENSORS = _names(BLOCK_NAMES)  # per block, in arena order
NON_BLOCK_TENSORS = _names(EMBED_NAMES) + _names(MERGER_NAMES)
# First half of a pair -> second: stored back to back in the arena (no alignment padding).
FUSED_PAIRS = {names[0]: names[1] for fields in (BLOCK_NAMES, MERGER_NAMES) for names in fields.values()
               if not isinstance(names, str)}


def tower_shapes(geo: GlmVitGeometry) -> dict[str, tuple[int, ...]]:
    """Every tower tensor's short name -> the shape the engines read it as (flattened 2-D), in
    arena order: the blocks', then the rest."""
    h, i, o, pi, hd = (geo.hidden_size, geo.intermediate_size, geo.out_hidden_size,
                       geo.projection_intermediate_size, geo.head_dim)
    block = {  # a pair's shape is each half's
        "norm1_w": (h,), "qkv_w": (3 * h, h), "qkv_b": (3 * h,), "q_norm_w": (hd,), "k_norm_w": (hd,),
        "proj_w": (h, h), "proj_b": (h,), "norm2_w": (h,), "gate_up_w": (i, h), "gate_up_b": (i,),
        "down_w": (h, i), "down_b": (h,),
    }
    rest = {
        # Conv3d (h, C, T, p, p): kernel == stride == the patch, so one GEMM over (c, t, py, px).
        "patch_embed_w": (h, geo.patch_dim), "patch_embed_b": (h,), "post_layernorm_w": (h,),
        # Conv2d (out, h, 2, 2) read in (channel, kh, kw) order against the 2x2 im2col.
        "downsample_w": (o, h * geo.merge_unit), "downsample_b": (o,), "proj_w": (o, o),
        "norm_w": (o,), "norm_b": (o,), "gate_up_w": (pi, o), "down_w": (o, pi),
    }

    def named(fields: dict[str, str | tuple[str, str]], shapes: dict[str, tuple[int, ...]],
              prefix: str = "") -> dict[str, tuple[int, ...]]:
        return {prefix + n: shapes[field] for field, names in fields.items() for n in _each(names)}

    out: dict[str, tuple[int, ...]] = {}
    for b in range(geo.depth):
        out.update(named(BLOCK_NAMES, block, f"blocks.{b}."))
    out.update(named(EMBED_NAMES, rest))
    out.update(named(MERGER_NAMES, rest))
    return out


def tensor_count(geo: GlmVitGeometry) -> int:
    """The tower's tensors: depth x 14 in the blocks + 11 others, 347 for the real tower."""
    return geo.depth * len(BLOCK_TENSORS) + len(NON_BLOCK_TENSORS)


def parameter_count(geo: GlmVitGeometry) -> int:
    """The tower's weights and biases, 563,627,008 for the real tower."""
    return sum(math.prod(shape) for shape in tower_shapes(geo).values())


def stored_shapes(geo: GlmVitGeometry) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Every tower tensor's short name -> the header shapes a checkpoint may store it in, the
    first as transformers saves it. Exactly these: a shape with the right element count but
    other axes (a transposed weight) is other data, and refused. The two convolutions keep
    their kernel axes; the patch embedding's flattened [h, patch_dim] form is the one alias,
    the same bytes in the same order (Conv3d's (c, t, py, px) is the patch rows' order)."""
    h, m = geo.hidden_size, geo.spatial_merge_size
    shapes = {name: (shape,) for name, shape in tower_shapes(geo).items()}
    shapes["patch_embed.proj.weight"] = ((h, geo.in_channels, geo.temporal_patch_size, geo.patch_size, geo.patch_size),
                                         (h, geo.patch_dim))
    shapes["downsample.weight"] = ((geo.out_hidden_size, h, m, m),)
    return shapes


def deferred_bias(raw: GlmVitTensors[np.ndarray]) -> np.ndarray:
    """The deferred bias: the biases missing from the GPU engine's residual stream at each norm,
    float32 [2 x depth + 1, h], from the tower's raw BF16 tensors: before block i's norm1 (row
    2i), its norm2 (2i + 1), and the post-layernorm (last). The norm kernel adds a row to the
    stream as it reads it (rmsnorm_bias).

    Besides the GEMM biases this carries the v bias of each block, pushed through its proj:
    softmax rows sum to one, so attention(q, k, v + b_v) = attention(q, k, v) + b_v, and the
    proj turns that into + proj_w . b_v. Nothing on the device then adds b_v to v."""
    h = raw.patch_embed_b.shape[0]
    total = bf16_to_f32(raw.patch_embed_b)
    rows = []
    for blk in raw.blocks:  # only what is read is widened
        rows.append(total.copy())
        total += bf16_to_f32(blk.proj_b) + bf16_to_f32(blk.proj_w) @ bf16_to_f32(blk.qkv_b)[2 * h:]
        rows.append(total.copy())
        total += bf16_to_f32(blk.down_b)
    rows.append(total)
    return np.stack(rows)
