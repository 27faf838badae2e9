"""`GlmVitScratch`: every device buffer the engine writes, sized once for p_max patches.

Allocated on the FIRST image, never at load (a process that binds the tower and encodes
nothing pays nothing), then reused by every call; a CUDA graph captured over the forward
bakes these addresses in. The seed's scratch kept one buffer per role; here the roles that
are never live at the same time share a slab, which is what keeps the engine's memory under
half of transformers' at 2044x2044 (see BENCHMARKS.md):

  slab      block phase (x 24)                      merger phase (after the last block)
  resid     residual stream, f32 [P, h]             im2col [M, 4h] bf16 (read by the downsample
                                                    GEMM), then merger proj out, then
                                                    pooler_output, f32 [M, out]
  normed    norm output / attention output, bf16    post-norm output, then LayerNorm+GELU out [M, out]
  qkv       pixels bf16 [P, patch_dim], then QKV    last_hidden_state f32 [M, out] + its bf16 copy,
            bf16 [P, 3h] (q, k normed + roped),     then (over the copy) merger gate|up of a
            then gate|up of a chunk of MLP rows     chunk of rows [merger chunk, 2 x projection]
            [MLP_CHUNK, 2 x inter] (act in place;   (the fused kernel: act of twice the rows)
            the fused kernel on Hopper writes act
            [2 x MLP_CHUNK, inter] instead)
  rope      cos, sin f32 [P, hd/2]                  -
  index     positions int32 [P, 2], flash work list,  -
            TMA descriptors: of the QKV rows (flash
            attention), of normed and merge_y (the
            fused gate|up GEMM's inputs, Hopper), the
            flash pieces' counters
  workspace cuBLAS's workspace (given to the handle);  the same
            between the QKV and proj GEMMs, the
            flash kernel's pieces (engine._attention)

Seed names -> here: buf_f32 -> resid, buf_h1/buf_h2 -> normed, buf_gate/buf_up -> mlp (a
qkv view), buf_qr/buf_kr/buf_vt -> qkv, buf_o_stage -> normed, buf_rope_cos/sin ->
rope_cos/sin, buf_merge_a/b/g/u -> resid/normed/qkv views, buf_out -> pooler.
buf_scores/buf_probs (the [P, P] score matrix) exist only with attention="naive"; the flash
path needs none.
P = p_max, M = p_max / 4. The MLP runs in row chunks so its 2 x intermediate-wide product
never needs P rows; the chunk lives in the qkv slab, dead between the attention and the next
block's QKV GEMM, so it needs no slab of its own (4096-row chunks: 8192 measured the same,
within 2%; engine._mlp splits the rows into equal chunks of whole 128-row tiles). A kernel
never reads and writes the same slab unless each thread writes only what it read itself (the
in-place swiglu and qknorm_rope): the im2col permutes rows across threads, so its output
cannot sit on its input's slab.
"""

from __future__ import annotations

import dataclasses
import math

from .geometry import GlmVitGeometry
from .layout import MAX_PIECE_GROUPS

MLP_CHUNK = 4096  # rows of the block MLP's gate|up product held at once
CUBLAS_WORKSPACE = 32 << 20  # cuBLAS's recommendation for Hopper; fixed, so graphs can capture
ALIGN = 256
TMA_MAP_BYTES = 128  # one CUtensorMap (the sm_90a kernels read qkv, normed and merge_y through one each)
FLASH_MIN_BM = 64  # the smallest query tile in kernels.FLASH_BM (kept in step by tests/test_gpu.py)


@dataclasses.dataclass(frozen=True)
class ScratchPlan:
    """Byte sizes of each slab for one geometry (pure arithmetic: no GPU needed)."""

    p_max: int
    mlp_rows: int  # block MLP chunk
    merger_rows: int  # merger MLP chunk
    max_tiles: int  # flash work-list entries
    slabs: dict[str, int]
    offsets: dict[str, int]  # byte offsets of the views that do not start their slab
    naive_bytes: int  # the [P, P] scores + probs, allocated only for attention="naive"

    @property
    def total_bytes(self) -> int:
        return sum(self.slabs.values())


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def scratch_plan(geo: GlmVitGeometry, p_max: int) -> ScratchPlan:
    p, h, o = p_max, geo.hidden_size, geo.out_hidden_size
    m = p // geo.merge_unit
    mlp_rows = min(MLP_CHUNK, p)
    qkv = _round(max(2 * p * 3 * h, 2 * p * geo.patch_dim, 4 * m * o + 2 * m * o,
                     mlp_rows * 2 * geo.intermediate_size * 2))
    # Flash work-list entries (one per query tile and head) at the smallest query tile: each
    # segment adds one partial tile; pieces (one segment's tail) at most double them (layout.py).
    max_tiles = max(p // FLASH_MIN_BM + p // geo.merge_unit, 2 * -(-p // FLASH_MIN_BM)) * geo.num_heads
    tiles = _round(4 * 2 * p)  # index: positions, the work list, the TMA descriptors, the piece counters
    maps = tiles + _round(16 * max_tiles)
    offsets = {
        "rope_sin": 4 * p * (geo.head_dim // 2),  # rope: cos, then sin
        "tiles": tiles,
        "maps": maps,
        "piece_counters": maps + 3 * TMA_MAP_BYTES,
        "last_hidden_bf16": 4 * m * o,  # qkv (merger phase): last_hidden_state, its copy, then
        "merge_mlp": _round(4 * m * o),  # the gate|up chunk over the copy
    }
    # The merger's gate|up chunk takes what last_hidden_state (f32, an output) leaves of the slab.
    merger_rows = max(1, min(m, (qkv - offsets["merge_mlp"]) // (2 * geo.projection_intermediate_size * 2)))
    slabs = {
        "resid": _round(max(4 * p * h, 4 * m * o, 2 * m * geo.merge_unit * h)),
        "normed": _round(max(2 * p * h, 2 * m * o)),
        "qkv": qkv,
        "rope": _round(2 * offsets["rope_sin"]),
        "index": offsets["piece_counters"] + 4 * MAX_PIECE_GROUPS,
        "workspace": CUBLAS_WORKSPACE,
    }
    return ScratchPlan(p, mlp_rows, merger_rows, max_tiles, slabs, offsets, naive_bytes=p * p * (4 + 2))


class GlmVitScratch:
    """The slabs of `plan` on the device, and the typed views the forward uses."""

    def __init__(self, geo: GlmVitGeometry, plan: ScratchPlan, naive: bool) -> None:
        import cupy

        self.plan = plan
        self.slabs = slab = {name: cupy.empty(size, dtype=cupy.uint8) for name, size in plan.slabs.items()}
        p, h, o, m = plan.p_max, geo.hidden_size, geo.out_hidden_size, plan.p_max // geo.merge_unit
        hd2, at = geo.head_dim // 2, plan.offsets

        def view(name: str, dtype, shape: tuple[int, ...], offset: int = 0):
            n = math.prod(shape) * cupy.dtype(dtype).itemsize
            assert offset + n <= slab[name].size, (name, shape)
            return slab[name][offset:offset + n].view(dtype).reshape(shape)

        bf16 = cupy.uint16  # BF16 travels as its 16-bit pattern; kernels and cuBLAS read it as BF16
        # block phase
        self.resid = view("resid", cupy.float32, (p, h))
        self.normed = view("normed", bf16, (p, h))
        self.pixels = view("qkv", bf16, (p, geo.patch_dim))
        self.qkv = view("qkv", bf16, (p, 3 * h))
        self.mlp = view("qkv", bf16, (plan.mlp_rows, 2 * geo.intermediate_size))
        self.rope_cos = view("rope", cupy.float32, (p, hd2))
        self.rope_sin = view("rope", cupy.float32, (p, hd2), at["rope_sin"])
        self.positions = view("index", cupy.int32, (p, 2))
        self.tiles = view("index", cupy.int32, (plan.max_tiles, 4), at["tiles"])
        maps = view("index", cupy.uint8, (3, TMA_MAP_BYTES), at["maps"])
        self.qkv_map, self.normed_map, self.merge_y_map = maps
        self.piece_counters = view("index", cupy.uint32, (MAX_PIECE_GROUPS,), at["piece_counters"])
        self.piece_counters.fill(0)  # the flash kernel leaves them at zero after every launch
        # merger phase
        self.merge_a = view("resid", bf16, (m, geo.merge_unit * h))
        self.merge_y = view("normed", bf16, (m, o))
        self.last_hidden = view("qkv", cupy.float32, (m, o))
        self.last_hidden_bf16 = view("qkv", bf16, (m, o), at["last_hidden_bf16"])
        self.pooler = view("resid", cupy.float32, (m, o))
        self.merge_mlp = view("qkv", bf16, (plan.merger_rows, 2 * geo.projection_intermediate_size), at["merge_mlp"])
        # naive attention only: one (segment, head) score matrix at a time
        self.workspace = slab["workspace"]
        self.scores = cupy.empty(p * p, dtype=cupy.float32) if naive else None
        self.probs = cupy.empty(p * p, dtype=bf16) if naive else None
