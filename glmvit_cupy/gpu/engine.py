"""The GPU engine: the tower's forward as cuBLAS BF16 GEMMs and the kernels in cuda_src/.

It computes what `reference.py` states, step for step and under the same names; the
differences are where the data lives and how it is rounded:
- Weights are the checkpoint's BF16 bits, uploaded once as one arena (no float32 copy of
  the tower on the device). GEMM operands are BF16, accumulation FP32.
- The residual stream stays float32. The patch embed, attention proj and MLP down GEMMs
  write or accumulate into it directly (beta = 1), bias-free: the stream holds x minus the
  running sum of those biases, and each norm kernel adds that sum (precomputed at load, one
  float32 vector per norm) as it reads the row. The q, k and gate|up biases are added by the
  kernels that consume those products; the v bias rides in the same running sums
  (weights.deferred_bias).
- Attention is the fused flash kernel (default) or the materialised path (attention="naive":
  f32 score GEMM, softmax_rows, PV GEMM), kept as the cross-check and for other head dims.
- On Hopper the MLPs' gate|up GEMM and clamped SwiGLU are one kernel (gemm_swiglu_sm90.cu)
  reading its operands by TMA; elsewhere (or for dims not in its tiles) cuBLAS + swiglu_clamp.
- Memory is the preallocated `GlmVitScratch`, allocated on the first image (or by `warm_up`).
- A shape seen a second time is captured as a CUDA graph and replayed from then on (a launch
  from Python costs several times a replayed node, and 24 blocks are ~250 launches). The
  first image of a shape runs eagerly, so it never waits on a capture.
Everything runs on the engine's own stream; `forward` returns once the outputs are ready.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections import OrderedDict
from typing import Callable, Iterator

import cupy
import numpy as np

from ..errors import GlmVitError
from ..tower.checkpoint import TowerWeights
from ..tower.geometry import check_patch_budget
from ..tower.layout import block_major_positions, frame_segments, num_patches, rope_inv_freq
from ..tower.reference import LAYERNORM_EPS
from ..tower.weights import GlmVitTensors, deferred_bias
from .cublas import Cublas
from .faults import check_launches, check_stream, synchronize
from .flash import HEAD_DIMS as FLASH_HEAD_DIMS
from .flash import FlashWork, flash_work_list
from .kernels import QKNORM_HEAD_DIMS, Kernels
from .scratch import GlmVitScratch, scratch_plan

ATTENTION = ("auto", "flash", "naive")
GRIDS_KEPT = 16  # grids whose host tables and CUDA graph are kept (a graph: a few hundred nodes, no memory of its own)
WARM_UP_SIDE = 16  # patches a side of warm_up's grid: every kernel of a forward, few FLOPs


@dataclasses.dataclass(frozen=True)
class GridTables:
    """What one grid_thw needs besides the pixels: its attention segments and flash work list,
    the tokens' RoPE positions and (Hopper) the TMA descriptor of its QKV rows. Cached, since
    the GPU would sit idle in front of a graph while they are built."""

    key: bytes  # grid_thw.tobytes()
    seen: bool  # built for an earlier call: a call without a graph captures one
    patches: int
    segments: np.ndarray
    work: FlashWork
    positions: np.ndarray  # int32 [P, 2]
    qkv_map: np.ndarray | None  # 128 bytes


class CupyRuntime:
    """The device-side setup that does not depend on the weights, all on one CUDA device: the
    engine's stream, the compiled kernels and the cuBLAS handle. `GlmVit.from_pretrained`
    builds it on a worker thread while the checkpoint is read, since the CUDA context, module
    loads and cuBLAS's start-up are as slow as reading the tower from the page cache."""

    def __init__(self, device: int | None = None, kernels: str = "auto") -> None:
        self.device = cupy.cuda.Device(device)  # None: the caller's current device
        self.check_launches = check = check_launches()
        with self.current():
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.kernels = Kernels(kernels, check)  # kernels: one of model.KERNELS
            self.blas = Cublas(self.stream, check)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """This device, with its CUDA context current in the calling thread, whichever thread it
        is. CuPy's `with device:` calls cudaSetDevice only when the thread's device index differs,
        and a fresh thread's index is already 0 with no context current: the driver calls made
        through ctypes (TMA descriptors, occupancy) then fail with CUDA_ERROR_INVALID_CONTEXT.
        cudaSetDevice makes the device's primary context current."""
        before = cupy.cuda.runtime.getDevice()
        cupy.cuda.runtime.setDevice(self.device.id)
        try:
            yield
        finally:
            if before != self.device.id:
                cupy.cuda.runtime.setDevice(before)


class CupyTower:
    """The tower on one CUDA device, with a patch budget of its own: p_max patch rows a call
    (`geometry.patch_budget`), which sizes its scratch. Several towers (budgets, devices) can
    share one `TowerWeights`."""

    def __init__(self, weights: TowerWeights, p_max: int, attention: str = "auto",
                 runtime: CupyRuntime | None = None, device: int | None = None, kernels: str = "auto") -> None:
        runtime = runtime or CupyRuntime(device, kernels)
        if device is not None and runtime.device.id != device:
            raise GlmVitError(f"cupy backend: the runtime is on device {runtime.device.id}, not {device}")
        if kernels != "auto" and runtime.kernels.hopper != (kernels == "hopper"):
            raise GlmVitError(f"cupy backend: the runtime's kernels are not the {kernels!r} ones asked for")
        self.device, self.current = runtime.device, runtime.current
        with self.current():
            self._init(weights, p_max, attention, runtime)

    def _init(self, weights: TowerWeights, p_max: int, attention: str, runtime: CupyRuntime) -> None:
        geo = self.geo = weights.location.geometry
        self.p_max = p_max
        for name in ("hidden_size", "intermediate_size", "out_hidden_size", "projection_intermediate_size",
                     "patch_dim"):
            if getattr(geo, name) % 8:
                raise GlmVitError(f"cupy backend: {name} {getattr(geo, name)} must be a multiple of 8 "
                                  "(16-byte aligned GEMM rows and vector loads); use backend='numpy'")
        if geo.head_dim not in QKNORM_HEAD_DIMS:
            raise GlmVitError(f"cupy backend: head_dim {geo.head_dim} is not one of {QKNORM_HEAD_DIMS} (qknorm_rope "
                              "spreads a head over hd / 8 lanes of one warp); use backend='numpy'")
        if attention not in ATTENTION:
            raise GlmVitError(f"attention {attention!r}: expected one of {', '.join(ATTENTION)}")
        if attention == "auto":
            attention = "flash" if geo.head_dim in FLASH_HEAD_DIMS else "naive"
        if attention == "flash" and geo.head_dim not in FLASH_HEAD_DIMS:
            raise GlmVitError(f"flash attention is compiled for head_dim {FLASH_HEAD_DIMS}, this tower has "
                              f"{geo.head_dim}: use attention='naive'")
        self.attention_kind = attention
        self.stream, self.k, self.blas = runtime.stream, runtime.kernels, runtime.blas
        self.check_launches = runtime.check_launches
        self.plan = scratch_plan(geo, p_max, self.k.flash_piece_rows() if attention == "flash" else 0)
        with self.stream:
            self.arena = cupy.asarray(weights.arena)  # the whole tower, one host-to-device copy
            self.inv_freq = cupy.asarray(rope_inv_freq(geo))
        base = weights.arena.ctypes.data

        def on_device(raw: np.ndarray) -> cupy.ndarray:
            start = (raw.ctypes.data - base) // 2
            return self.arena[start:start + raw.size].reshape(raw.shape)

        self.w: GlmVitTensors[cupy.ndarray] = weights.structure(on_device)
        # The fused gate|up kernel needs whole tiles of K and of the intermediate width (the real
        # tower's 1024/4096 and 4096/10240 are). It reads each gate|up weight through a TMA
        # descriptor made here, once; those of its inputs live in the scratch.
        mlps = ((geo.hidden_size, geo.intermediate_size), (geo.out_hidden_size, geo.projection_intermediate_size))
        self.fused_mlp = self.k.hopper and all(self.k.gemm.takes(k, n) for k, n in mlps)
        gate_up_ws = [blk.gate_up_w for blk in self.w.blocks] + [self.w.merger.gate_up_w]
        with self.stream:
            self.deferred_bias = cupy.asarray(deferred_bias(weights.structure(lambda raw: raw)))  # [2 x depth + 1, h]
            self.gate_up_maps = (cupy.asarray(np.stack([self.k.gate_up_map(w) for w in gate_up_ws]))
                                 if self.fused_mlp else None)  # [depth + 1, 128] bytes, the merger's last
        self.scratch: GlmVitScratch | None = None
        self.graphs: OrderedDict[bytes, cupy.cuda.graph.Graph] = OrderedDict()
        # The host tables of the last grids, and which grid's the index slab holds now.
        self.tables: OrderedDict[bytes, GridTables] = OrderedDict()
        self.uploaded: bytes | None = None
        self.warm = False
        self.stream.synchronize()

    @property
    def scratch_bytes(self) -> int:
        """Device bytes of the scratch for p_max patches (allocated or not yet)."""
        return self.plan.total_bytes + (self.plan.naive_bytes if self.attention_kind == "naive" else 0)

    def _scratch(self) -> GlmVitScratch:
        if self.scratch is None:
            with self.current(), self.stream:
                s = self.scratch = GlmVitScratch(self.plan, naive=self.attention_kind == "naive")
                if self.fused_mlp:  # over all p_max rows: rows past a call's p feed only unstored output rows
                    s.normed_map.set(self.k.gate_up_map(s.normed), stream=self.stream)
                    s.merge_y_map.set(self.k.gate_up_map(s.merge_y), stream=self.stream)
            self.blas.set_workspace(self.scratch.workspace)
        return self.scratch

    # ---- the engine's surface: forward, the stager and the batcher all go through these -----
    # prepare(grid) -> slab_uploads(tables) in stream order -> pixels(p) filled -> run(tables)
    # -> outputs(m), everything on self.stream, from a thread inside self.current().

    def prepare(self, grid_thw: np.ndarray) -> GridTables:
        """A grid's tables, refused past this engine's p_max; the scratch exists from here on."""
        self.check_budget(grid_thw)
        self._scratch()
        return self.grid_tables(grid_thw)

    def slab_uploads(self, tables: GridTables) -> list[tuple[np.ndarray, cupy.ndarray]]:
        """The (host array, device destination) copies that put this grid's tables into the index
        slab, which `run` reads; none when the slab holds them already. The caller makes them on
        self.stream (or a stream self.stream waits for) before that run: from here on the slab
        counts as this grid's."""
        if self.uploaded == tables.key:
            return []
        s, p = self.scratch, tables.patches
        copies = [(tables.positions, s.positions[:p]), (tables.work.tiles, s.tiles[:len(tables.work.tiles)])]
        if tables.qkv_map is not None:
            copies.append((tables.qkv_map, s.qkv_map))
        self.uploaded = tables.key
        return copies

    def pixels(self, p: int) -> cupy.ndarray:
        """The BF16 patch rows [p, patch_dim] that run() embeds: the caller writes them first."""
        return self.scratch.pixels[:p]

    def outputs(self, m: int) -> tuple[cupy.ndarray, cupy.ndarray]:
        """(last_hidden_state, pooler_output) float32 [m, out_hidden] of the last run, in the
        scratch: read them (on self.stream) before the next run overwrites them."""
        return self.scratch.last_hidden[:m], self.scratch.pooler[:m]

    def warm_up(self) -> None:
        """Pay the first forward's one-time costs now: the scratch, and our kernels' and cuBLAS's
        modules, which CUDA loads on their first launch (~0.1 s on the H200, where a collection
        pays them while its first inputs decode: benchmarks/NOTES.md). A forward of a small grid
        of zeros; once per tower."""
        if self.warm:
            return
        side = min(WARM_UP_SIDE, math.isqrt(self.p_max)) // self.geo.spatial_merge_size * self.geo.spatial_merge_size
        self.forward(cupy.zeros((side * side, self.geo.patch_dim), dtype=cupy.float32),
                     np.array([[1, side, side]], dtype=np.int64))
        self.warm = True

    # ---- the forward: host bookkeeping, then one flat sequence of launches -------------

    def forward(self, pixel_values, grid_thw: np.ndarray, marks: Callable[[str], None] | None = None):
        with self.current():
            return self._forward(pixel_values, grid_thw, marks)

    def _forward(self, pixel_values, grid_thw: np.ndarray, marks: Callable[[str], None] | None):
        tables = self.prepare(grid_thw)
        p = tables.patches
        caller = cupy.cuda.get_current_stream()
        with self.stream:
            self.stream.wait_event(caller.record())
            pixels = self._pixels(pixel_values)
            # Outside any graph: the input array changes between calls, the tables between grids.
            self.k.f32_to_bf16(pixels, self.pixels(p))
            for host, device in self.slab_uploads(tables):
                device.set(host, stream=self.stream)
            self.run(tables, marks)
            last_hidden, pooler = (out.copy() for out in self.outputs(p // self.geo.merge_unit))
        synchronize(self.stream, "the forward")
        return last_hidden, pooler

    def _pixels(self, pixel_values) -> cupy.ndarray:
        """The caller's pixel_values as f32_to_bf16 reads them: float32, C-contiguous, on this
        device, 16-byte aligned (float4 loads). A view at an odd offset or an array on another
        GPU passes every shape check, and would fault the kernel: those are copied."""
        if isinstance(pixel_values, cupy.ndarray) and pixel_values.device.id != self.device.id:
            return cupy.array(pixel_values, dtype=cupy.float32, order="C")  # a peer copy, onto this device
        pixels = cupy.ascontiguousarray(cupy.asarray(pixel_values, dtype=cupy.float32))
        return pixels if pixels.data.ptr % 16 == 0 else pixels.copy()  # CuPy allocations are 256-byte aligned

    def check_budget(self, grid_thw: np.ndarray) -> int:
        """The patch count of a grid, refused past this engine's p_max."""
        p = num_patches(grid_thw)
        check_patch_budget(self.geo, p, self.p_max, "this forward call")
        return p

    def grid_tables(self, grid_thw: np.ndarray) -> GridTables:
        """The host tables of a grid (cached for the last GRIDS_KEPT grids)."""
        key = grid_thw.tobytes()
        if key in self.tables:
            self.tables.move_to_end(key)
            return dataclasses.replace(self.tables[key], seen=True)
        geo, p = self.geo, num_patches(grid_thw)
        segments = frame_segments(grid_thw)
        bm = self.k.flash_bm(segments[:, 1].tolist(), geo.num_heads)
        tables = GridTables(key, False, p, segments,
                            flash_work_list(segments, bm, geo.num_heads, self.k.flash_slots(bm)),
                            block_major_positions(grid_thw, geo.spatial_merge_size),
                            self.k.qkv_map(self._scratch().qkv[:p]) if self.k.hopper else None)
        self.tables[key] = tables
        if len(self.tables) > GRIDS_KEPT:
            self.tables.popitem(last=False)
        return tables

    def run(self, tables: GridTables, marks: Callable[[str], None] | None = None) -> None:
        """The forward over the scratch's pixels and index slab (both in place), on self.stream:
        replayed from a graph when this grid has one, captured when it was seen before, else
        eager (the first image of a shape never waits on a capture)."""
        key, p = tables.key, tables.patches
        if marks is not None:  # stage timing: always eager
            self._body(p, tables.segments, tables.work, marks)
        elif key in self.graphs or tables.seen:
            graph = self.graphs.get(key)
            if graph is None:
                self.stream.begin_capture()
                self._body(p, tables.segments, tables.work, None)
                graph = self.graphs[key] = self.stream.end_capture()
                if len(self.graphs) > GRIDS_KEPT:
                    self.graphs.popitem(last=False)
            else:
                self.graphs.move_to_end(key)
            graph.launch(self.stream)
            if self.check_launches:
                check_stream("a CUDA graph of the forward", self.stream)
        else:
            self._body(p, tables.segments, tables.work, None)

    def _body(self, p: int, segments: np.ndarray, work: FlashWork, marks) -> None:
        """The forward's steps 1-8, numbered as in reference.py: no allocation, no host sync
        (graph-capturable)."""
        geo, s, k, blas, w = self.geo, self.scratch, self.k, self.blas, self.w
        mark = marks or (lambda stage: None)
        eps = geo.rms_norm_eps
        resid, normed, qkv = s.resid[:p], s.normed[:p], s.qkv[:p]
        cos, sin = s.rope_cos[:p], s.rope_sin[:p]

        k.rope_tables(s.positions[:p], self.inv_freq, cos, sin)  # step 4's angles
        blas.linear(resid, s.pixels[:p], w.patch_embed_w)  # step 1 (bias: in self.deferred_bias)
        mark("patch_embed")
        for i, blk in enumerate(w.blocks):  # step 5
            k.rmsnorm_bias(resid, self.deferred_bias[2 * i], blk.norm1_w, normed, eps)
            blas.linear(qkv, normed, blk.qkv_w)
            k.qknorm_rope(qkv, blk.qkv_b, blk.q_norm_w, blk.k_norm_w, cos, sin, geo.num_heads, eps)
            self._attention(qkv, s.qkv_map, normed, segments, s.tiles, work)  # attention output -> normed
            blas.linear(resid, normed, blk.proj_w, accumulate=True)
            mark("attention_sublayer")
            k.rmsnorm_bias(resid, self.deferred_bias[2 * i + 1], blk.norm2_w, normed, eps)
            self._mlp(normed, resid, blk.gate_up_w, blk.gate_up_b, blk.down_w, s.mlp, accumulate=True,
                      maps=(s.normed_map, self.gate_up_maps[i]) if self.fused_mlp else None)
            mark("mlp_sublayer")
        self._merger(p)
        mark("merger")

    def _attention(self, qkv: cupy.ndarray, qkv_map: cupy.ndarray | None, out: cupy.ndarray, segments: np.ndarray,
                   tiles: cupy.ndarray, work: FlashWork) -> None:
        """tiles: work.tiles on the device. Pieces leave their rows in the scratch's pieces and
        count themselves in its piece_counters."""
        geo, s = self.geo, self.scratch
        if self.attention_kind == "flash":
            self.k.flash_attention(qkv, qkv_map, out, tiles, len(work.tiles), geo.num_heads, geo.head_dim, work.bm,
                                   s.pieces, s.piece_counters, work.first_piece, work.pieces)
            return
        h, hd = geo.hidden_size, geo.head_dim
        for start, length in segments.tolist():  # one (segment, head) at a time
            scores = s.scores[:length * length].reshape(length, length)
            probs = s.probs[:length * length].reshape(length, length)
            rows = qkv[start:start + length]
            for head in range(geo.num_heads):
                q = rows[:, head * hd:(head + 1) * hd]
                kk = rows[:, h + head * hd:h + (head + 1) * hd]
                v = rows[:, 2 * h + head * hd:2 * h + (head + 1) * hd]
                self.blas.linear(scores, q, kk)  # f32 scores, unscaled
                self.k.softmax_rows(scores, probs, hd ** -0.5)
                self.blas.matmul(out[start:start + length, head * hd:(head + 1) * hd], probs, v)

    def _mlp(self, x: cupy.ndarray, out: cupy.ndarray, gate_up_w, gate_up_b, down_w, buf: cupy.ndarray,
             accumulate: bool, maps: tuple[cupy.ndarray, cupy.ndarray] | None) -> None:
        """out (+)= down(swiglu_clamp(x . gate_up^T + b)), in row chunks that fit buf. maps: the
        TMA descriptors of x's buffer and of gate_up_w where the fused kernel runs.

        The fused kernel writes only act [rows, inter], so buf holds twice the rows it does for
        cuBLAS + swiglu_clamp ([rows, 2 x inter], act in place over the gate half). Chunks are
        equal and whole 128-row tiles: a short last chunk runs the down GEMM far below its rate."""
        inter, limit, total = gate_up_w.shape[0] // 2, self.geo.swiglu_limit, x.shape[0]
        width = inter if maps is not None else 2 * inter
        cap = buf.size // width
        chunks = -(-total // cap)
        step = min(cap, -(-total // (chunks * 128)) * 128)
        for r0 in range(0, total, step):
            rows = min(step, total - r0)
            chunk = buf.reshape(-1)[:rows * width].reshape(rows, width)
            if maps is not None:
                self.k.gemm_swiglu(*maps, gate_up_b, chunk, r0, x.shape[1], limit)
            else:
                self.blas.linear(chunk, x[r0:r0 + rows], gate_up_w)
                self.k.swiglu_clamp(chunk, gate_up_b, limit)
            self.blas.linear(out[r0:r0 + rows], chunk[:, :inter], down_w, accumulate=accumulate)

    def _merger(self, p: int) -> None:
        geo, s, k, blas, mw = self.geo, self.scratch, self.k, self.blas, self.w.merger
        m = p // geo.merge_unit
        k.rmsnorm_bias(s.resid[:p], self.deferred_bias[-1], mw.post_layernorm_w, s.normed[:p],  # step 6
                       geo.rms_norm_eps)
        k.im2col_2x2(s.normed[:p], s.merge_a[:m])  # step 7
        blas.linear(s.last_hidden[:m], s.merge_a[:m], mw.downsample_w)
        k.bias_to_bf16(s.last_hidden[:m], mw.downsample_b, s.last_hidden_bf16[:m])
        blas.linear(s.pooler[:m], s.last_hidden_bf16[:m], mw.proj_w)  # step 8
        k.layernorm_gelu(s.pooler[:m], mw.norm_w, mw.norm_b, s.merge_y[:m], LAYERNORM_EPS)
        # pooler still holds the proj output, consumed by layernorm_gelu: overwrite it
        self._mlp(s.merge_y[:m], s.pooler[:m], mw.gate_up_w, None, mw.down_w, s.merge_mlp, accumulate=False,
                  maps=(s.merge_y_map, self.gate_up_maps[-1]) if self.fused_mlp else None)
