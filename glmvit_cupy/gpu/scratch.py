"""`GlmVitScratch`: every device buffer the engine writes, sized once for p_max patches.

Allocated on the FIRST image, never at load (a process that binds the tower and encodes
nothing pays nothing), then reused by every call; a CUDA graph captured over the forward
bakes these addresses in. Buffers that are never live at the same time share a slab, which is
what keeps the engine's memory under half of transformers' at 2044x2044 (see BENCHMARKS.md).

`scratch_plan` is pure arithmetic (no GPU): a table of views, each a typed window of one slab
with the steps of the forward in which it is live (written, or holding what a later step
reads), and slabs just large enough for their views. Two views live in the same step never
share a byte (tests/test_scratch.py checks it for every view of the table). In short:

  slab      block steps (x depth)                   merger steps (after the last block)
  resid     residual stream, f32 [P, h]             im2col [M, 4h] bf16, then merger proj out,
                                                    then pooler_output, f32 [M, out]
  normed    norm output / attention output, bf16    post-norm output, then LayerNorm+GELU out
  qkv       pixels, then QKV (q, k normed + roped), last_hidden_state f32 + its bf16 copy, then
            then a chunk of MLP rows' gate|up       (over the copy) a chunk of the merger's gate|up
  rope      cos, sin f32 [P, hd/2]                  -
  index     positions, the flash work list, TMA descriptors, the flash pieces' counters: kept
            across calls (uploaded once per grid), so live in every step
  pieces    the flash pieces' partial rows          -
  workspace cuBLAS's workspace, given to the handle for good

P = p_max, M = p_max / 4. The MLPs run in row chunks so their 2 x intermediate-wide product
never needs P rows; the chunk lives in the qkv slab, dead between the attention and the next
block's QKV GEMM (engine._mlp splits the rows into equal chunks of whole 128-row tiles). A
kernel never reads and writes the same slab unless each thread writes only what it read
itself (the in-place swiglu and qknorm_rope): the im2col permutes rows across threads, so its
output cannot sit on its input's slab. The naive attention's [P, P] scores and probs are
allocated beside the slabs, only for attention="naive".
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from . import flash
from ..errors import InternalError
from ..tower.geometry import GlmVitGeometry

MLP_CHUNK = 4096  # rows of the block MLP's gate|up product held at once (benchmarks/NOTES.md)
CUBLAS_WORKSPACE = 32 << 20  # cuBLAS's recommendation for Hopper; fixed, so graphs can capture
ALIGN = 256
TMA_MAP_BYTES = 128  # one CUtensorMap (the sm_90a kernels read qkv, normed and merge_y through one each)
# The forward's steps, in order; a view lists those it is live in.
EMBED, ATTENTION, MLP, POST_NORM, IM2COL, DOWNSAMPLE, PROJ, MERGER_NORM, MERGER_MLP = STEPS = (
    "embed", "attention", "mlp", "post_norm", "im2col", "downsample", "proj", "merger_norm", "merger_mlp")
BLOCK = (EMBED, ATTENTION, MLP)
BF16 = "uint16"  # BF16 travels as its 16-bit pattern; kernels and cuBLAS read it as BF16


@dataclasses.dataclass(frozen=True)
class View:
    """A typed window of one slab: bytes [offset, offset + nbytes), live in `steps`."""

    name: str
    slab: str
    offset: int
    dtype: str  # a NumPy dtype name (CuPy takes the same)
    shape: tuple[int, ...]
    steps: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclasses.dataclass(frozen=True)
class ScratchPlan:
    """Byte sizes of each slab and the views on them, for one geometry (no GPU needed)."""

    p_max: int
    mlp_rows: int  # block MLP chunk
    merger_rows: int  # merger MLP chunk
    max_tiles: int  # flash work-list entries
    slabs: dict[str, int]
    views: dict[str, View]
    naive_bytes: int  # the [P, P] scores + probs, allocated only for attention="naive"

    @property
    def total_bytes(self) -> int:
        return sum(self.slabs.values())


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def scratch_plan(geo: GlmVitGeometry, p_max: int, piece_rows: int = 0) -> ScratchPlan:
    """The views and slabs for p_max patches; piece_rows: rows the flash kernel's pieces leave
    at most (Kernels.flash_piece_rows; 0 where none run, and for an estimate without a GPU)."""
    p, h, o, hd = p_max, geo.hidden_size, geo.out_hidden_size, geo.head_dim
    m = p // geo.merge_unit
    mlp_rows = min(MLP_CHUNK, p)
    # A segment (one frame) holds a merge block at least, so there are at most m of them.
    max_tiles = flash.max_entries(p, geo.num_heads, m)
    views: dict[str, View] = {}

    def add(name: str, slab: str, dtype: str, shape: tuple[int, ...], steps: tuple[str, ...],
            offset: int = 0) -> View:
        view = views[name] = View(name, slab, offset, dtype, shape, steps)
        return view

    def after(view: View) -> int:
        return _round(view.end)

    add("resid", "resid", "float32", (p, h), (EMBED, ATTENTION, MLP, POST_NORM))
    add("normed", "normed", BF16, (p, h), (ATTENTION, MLP, POST_NORM, IM2COL))
    add("pixels", "qkv", BF16, (p, geo.patch_dim), (EMBED,))
    add("qkv", "qkv", BF16, (p, 3 * h), (ATTENTION,))
    add("mlp", "qkv", BF16, (mlp_rows, 2 * geo.intermediate_size), (MLP,))
    cos = add("rope_cos", "rope", "float32", (p, hd // 2), BLOCK)
    add("rope_sin", "rope", "float32", (p, hd // 2), BLOCK, after(cos))
    positions = add("positions", "index", "int32", (p, 2), STEPS)
    tiles = add("tiles", "index", "int32", (max_tiles, 4), STEPS, after(positions))
    at = after(tiles)
    for name in ("qkv_map", "normed_map", "merge_y_map"):
        at = after(add(name, "index", "uint8", (TMA_MAP_BYTES,), STEPS, at))
    add("piece_counters", "index", "uint32", (flash.MAX_PIECE_GROUPS,), STEPS, at)
    add("pieces", "pieces", "float32", (piece_rows, hd + 2), (ATTENTION,))
    add("workspace", "workspace", "uint8", (CUBLAS_WORKSPACE,), STEPS)
    add("merge_a", "resid", BF16, (m, geo.merge_unit * h), (IM2COL, DOWNSAMPLE))
    add("merge_y", "normed", BF16, (m, o), (MERGER_NORM, MERGER_MLP))
    last_hidden = add("last_hidden", "qkv", "float32", (m, o), (DOWNSAMPLE, PROJ, MERGER_NORM, MERGER_MLP))
    copy = add("last_hidden_bf16", "qkv", BF16, (m, o), (DOWNSAMPLE, PROJ), after(last_hidden))
    add("pooler", "resid", "float32", (m, o), (PROJ, MERGER_NORM, MERGER_MLP))

    def slab_sizes() -> dict[str, int]:
        sizes: dict[str, int] = {}
        for v in views.values():
            sizes[v.slab] = max(sizes.get(v.slab, 0), _round(v.end))
        return sizes

    # The merger's gate|up chunk takes what last_hidden_state (f32, an output) leaves of the
    # qkv slab, over the bf16 copy (dead once the merger proj has read it).
    row_bytes = 2 * geo.projection_intermediate_size * 2
    merger_rows = max(1, min(m, (slab_sizes()["qkv"] - copy.offset) // row_bytes))
    add("merge_mlp", "qkv", BF16, (merger_rows, 2 * geo.projection_intermediate_size), (MERGER_MLP,), copy.offset)
    return ScratchPlan(p, mlp_rows, merger_rows, max_tiles, slab_sizes(), views, naive_bytes=p * p * (4 + 2))


class GlmVitScratch:
    """The slabs of `plan` on the device, and the typed views the forward uses."""

    def __init__(self, plan: ScratchPlan, naive: bool) -> None:
        import cupy

        self.plan = plan
        self.slabs = slab = {name: cupy.empty(size, dtype=cupy.uint8) for name, size in plan.slabs.items()}
        # Every view of the plan as an attribute of its name (self.resid, self.qkv, ...).
        for v in plan.views.values():
            if v.end > slab[v.slab].size:
                raise InternalError(f"scratch view {v.name} ends at byte {v.end} of slab {v.slab}, "
                                    f"which holds {slab[v.slab].size}")
            setattr(self, v.name, slab[v.slab][v.offset:v.end].view(v.dtype).reshape(v.shape))
        self.piece_counters.fill(0)  # the flash kernel leaves them at zero after every launch
        p = plan.p_max
        self.scores = cupy.empty(p * p, dtype=cupy.float32) if naive else None
        self.probs = cupy.empty(p * p, dtype=cupy.uint16) if naive else None
