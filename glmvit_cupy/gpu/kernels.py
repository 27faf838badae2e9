"""Load `cuda_src/*.cu` as CuPy RawModules and launch their kernels with explicit geometry.

One loader for every file (httomolibgpu's pattern): the source text comes from
`kernel_source` (our headers pasted in, so CuPy's on-disk compile cache keys on the full
text, under `#line` directives that make compiler errors point into the right file). NVRTC
compiles for the current device's architecture, or for the one a file names in a
`// requires: sm_90a` line (wgmma needs the "a" target). Flash attention's launch sizes and
tile policy are `flash.py`'s, checked against the sources here at load.
Every module is built once per process, at load (`Kernels()`), so the first image never
waits on a compile; later processes hit CuPy's cache.

Each launcher states its grid, block and shared memory and takes CuPy arrays whose shapes
the engine guarantees; the kernels' own files say why they are shaped the way they are.
The sm_90a kernels (wgmma flash attention, the fused gate|up GEMM + SwiGLU) read their tiles
by TMA, through descriptors the driver API encodes (`TensorMaps`: CuPy has no wrapper for it).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import cupy
import numpy as np

from . import flash
from ..errors import GlmVitError, InternalError
from .faults import Checked
from .gemm_swiglu import read_tiles
from .kernel_source import constants, cuda_source_dir, load_source, required_arch

QKNORM_HEAD_DIMS = (16, 32, 64, 128, 256)  # rope.cu's qknorm_rope: hd / 8 lanes a head, within a warp


def compile_module(src: Path, name: str) -> cupy.RawModule:
    """src/NAME.cu as a RawModule, for the target its `// requires:` line names or the device's own."""
    source = load_source(src / f"{name}.cu")
    arch = required_arch(source)
    options = ("--std=c++17",) + ((f"-arch={arch}",) if arch else ())
    return cupy.RawModule(code=source, options=options)


class TensorMaps:
    """TMA descriptors (CUtensorMap, 128 bytes) from the driver's cuTensorMapEncodeTiled, which
    CuPy does not wrap: called through ctypes on the libcuda CuPy already loaded."""

    _BF16, _SWIZZLE_128B, _L2_256B = 9, 3, 3  # CUtensorMapDataType, CUtensorMapSwizzle, CUtensorMapL2promotion

    def __init__(self) -> None:
        self._encode = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        self._encode.restype = ctypes.c_int
        self._buf = np.zeros(24, dtype=np.uint64)  # 128 bytes at a 64-byte aligned offset inside
        self._at = (-self._buf.ctypes.data % 64) // 8

    def rows(self, array: cupy.ndarray, box_rows: int, box_cols: int) -> np.ndarray:
        """A map of a row-major 2-D BF16 array (rows past its end read as zeros), boxes of
        box_rows x box_cols swizzled 128B (box_cols x 2 = 128 bytes)."""
        if box_cols * 2 != 128 or array.ndim != 2 or array.strides[1] != 2:
            raise InternalError(f"a 128B-swizzled map needs 128-byte box rows over a 2-D BF16 array: box "
                                f"{box_rows}x{box_cols}, strides {array.strides}")
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        dims, strides = (u64 * 2)(array.shape[1], array.shape[0]), (u64 * 1)(array.strides[0])
        box, step = (u32 * 2)(box_cols, box_rows), (u32 * 2)(1, 1)
        out = self._buf[self._at:self._at + 16]
        status = self._encode(ctypes.c_void_p(out.ctypes.data), self._BF16, u32(2), ctypes.c_void_p(array.data.ptr),
                              dims, strides, box, step, 0, self._SWIZZLE_128B, self._L2_256B, 0)
        if status != 0:
            raise GlmVitError(f"the GPU driver refused a TMA descriptor: cuTensorMapEncodeTiled gave CUresult {status} "
                              f"(shape {array.shape}, box {box_rows}x{box_cols})")
        return out.view(np.uint8).copy()


def grid_1d(n: int, block: int, cap: int = 65536) -> tuple[int]:
    """Blocks of `block` threads for n items, at most `cap` (the grid-stride loops do the rest)."""
    return (max(1, min(cap, -(-n // block))),)


class Kernels:
    """Every kernel the engine launches, compiled at construction."""

    def __init__(self, kernels: str = "auto", check_launches: bool = False) -> None:
        # Hopper runs the wgmma flash kernel and the fused gate|up GEMM; every other GPU the
        # mma.sync flash kernel and cuBLAS + swiglu_clamp. kernels="generic" runs the latter on
        # Hopper too (model.KERNELS), so the path of every other GPU is tested on an H200.
        device = cupy.cuda.Device()
        sm90 = device.compute_capability == "90"
        if kernels == "hopper" and not sm90:
            raise GlmVitError(f"kernels 'hopper' need an sm_90 GPU, this one is sm_{device.compute_capability}: "
                              "use 'auto' or 'generic'")
        self.hopper = sm90 and kernels != "generic"
        self._flash_module = flash.SM90 if self.hopper else flash.GENERIC
        src = cuda_source_dir()
        flash.check_sources(src)
        self.flash_bms = flash.BMS[self._flash_module]
        names = {"convert": ("f32_to_bf16", "f32_to_f16"), "patchify": ("patchify_u8",), "norms": ("rmsnorm_bias", "layernorm_gelu"),
                 "rope": ("rope_tables", "qknorm_rope"), "mlp": ("swiglu_clamp",),
                 "merge": ("im2col_2x2", "bias_to_bf16"), "softmax": ("softmax_rows",),
                 self._flash_module: tuple(flash.kernel_name(self._flash_module, bm) for bm in self.flash_bms)}
        if self.hopper:
            names["gemm_swiglu_sm90"] = ("gemm_swiglu_sm90",)
        self._f = {name: compile_module(src, mod).get_function(name) for mod, funcs in names.items() for name in funcs}
        if check_launches:  # faults.py: each launch waits for itself and names itself if it faults
            self._f = {name: Checked(f, f"kernel {name}") for name, f in self._f.items()}
        self._maps = TensorMaps() if self.hopper else None
        self._norm_rows = constants((src / "norms.cu").read_text())["ROWS"]  # a warp each
        self._sms = device.attributes["MultiProcessorCount"]
        self.gemm = read_tiles(src)  # gemm_swiglu_sm90's tiles, as its source declares them
        if self.hopper:
            self._f["gemm_swiglu_sm90"].max_dynamic_shared_size_bytes = self.gemm.smem
        self._flash = {}  # query tile -> (function, threads, dynamic shared memory): flash.launch
        for bm in self.flash_bms:
            f = self._f[flash.kernel_name(self._flash_module, bm)]
            threads, smem = flash.launch(self._flash_module, bm)
            f.max_dynamic_shared_size_bytes = smem
            self._flash[bm] = (f, threads, smem)
        # Asked once, here: the driver's occupancy query needs this thread's CUDA context, and
        # engines are built on other threads than the one that made the kernels.
        self._slots = {bm: self._sms * cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(f.kernel.ptr, t, m)
                       if self.hopper else 0 for bm, (f, t, m) in self._flash.items()}

    def f32_to_bf16(self, src: cupy.ndarray, dst: cupy.ndarray) -> None:
        n4 = src.size // 4
        self._f["f32_to_bf16"](grid_1d(n4, 256), (256,), (src, dst, np.int64(n4)))

    def f32_to_f16(self, src: cupy.ndarray, dst: cupy.ndarray) -> None:
        n4 = src.size // 4
        self._f["f32_to_f16"](grid_1d(n4, 256), (256,), (src, dst, np.int64(n4)))

    def patchify_u8(self, canvases: cupy.ndarray, images: cupy.ndarray, n_images: int, tables: cupy.ndarray,
                    out: cupy.ndarray, patch: int, temporal: int) -> None:
        """out[P, 3 x temporal x patch^2] (BF16) from the uint8 canvases (and videos' frames) of a
        batch; images: int32 [n_images, 4] as patchify.cu describes, tables float32 [2, 3, 256]
        (images', video groups')."""
        if tables.shape != (2, 3, 256):
            raise InternalError(f"patchify_u8 takes tables [2, 3, 256], not {list(tables.shape)}")
        self._f["patchify_u8"](grid_1d(out.shape[0], 1), (128,),
                               (canvases, images, np.int32(n_images), tables, out, np.int32(out.shape[0]),
                                np.int32(patch), np.int32(temporal)))

    def rmsnorm_bias(self, x: cupy.ndarray, deferred_bias: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray,
                     eps: float) -> None:
        """out = rmsnorm(x + deferred_bias) * w, row by row: deferred_bias is one row of
        weights.deferred_bias, x the residual stream without it."""
        rows, n = x.shape
        self._f["rmsnorm_bias"]((-(-rows // self._norm_rows),), (32 * self._norm_rows,),
                                (x, deferred_bias, w, out, np.int32(rows), np.int32(n), np.float32(eps)))

    def layernorm_gelu(self, x: cupy.ndarray, w: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray,
                       eps: float) -> None:
        rows, n = x.shape
        self._f["layernorm_gelu"]((rows,), (256,), (x, w, b, out, np.int32(n), np.float32(eps)))

    def rope_tables(self, pos: cupy.ndarray, inv_freq: cupy.ndarray, cos: cupy.ndarray,
                    sin: cupy.ndarray) -> None:
        p, quarter = pos.shape[0], inv_freq.size
        self._f["rope_tables"](grid_1d(p * quarter, 256, 1 << 30), (256,),
                               (pos, inv_freq, cos, sin, np.int32(p), np.int32(quarter)))

    def qknorm_rope(self, qkv: cupy.ndarray, bias: cupy.ndarray, q_w: cupy.ndarray, k_w: cupy.ndarray,
                    cos: cupy.ndarray, sin: cupy.ndarray, heads: int, eps: float) -> None:
        p, hd = qkv.shape[0], q_w.size
        self._f["qknorm_rope"](grid_1d(p * 2 * heads * hd // 8, 256, 1 << 30), (256,),
                               (qkv, bias, q_w, k_w, cos, sin, np.int32(p), np.int32(heads), np.int32(hd),
                                np.float32(eps)))

    def swiglu_clamp(self, gate_up: cupy.ndarray, bias: cupy.ndarray | None, limit: float) -> None:
        rows, width = gate_up.shape
        inter = width // 2
        self._f["swiglu_clamp"]((-(-inter // (8 * 256)), min(rows, 65535)), (256,),
                                (gate_up, bias if bias is not None else np.uint64(0), np.int32(rows),
                                 np.int32(inter), np.float32(limit)))

    def im2col_2x2(self, x: cupy.ndarray, out: cupy.ndarray) -> None:
        rows, n = x.shape
        self._f["im2col_2x2"](grid_1d(rows // 4 * n, 256), (256,), (x, out, np.int64(rows // 4), np.int32(n)))

    def bias_to_bf16(self, x: cupy.ndarray, bias: cupy.ndarray, out: cupy.ndarray) -> None:
        n4 = x.size // 4
        self._f["bias_to_bf16"](grid_1d(n4, 256), (256,), (x, bias, out, np.int64(n4), np.int32(x.shape[1])))

    def softmax_rows(self, scores: cupy.ndarray, probs: cupy.ndarray, scale: float) -> None:
        rows, n = scores.shape
        self._f["softmax_rows"]((rows,), (256,), (scores, probs, np.int32(n), np.float32(scale)))

    def qkv_map(self, qkv: cupy.ndarray) -> np.ndarray:
        """The TMA descriptor (128 bytes) the wgmma flash kernel reads Q, K and V of the rows
        `qkv` through: rows past qkv's read as zeros, so stale scratch never enters a tile. It
        holds the row count, so it is written per grid, outside any graph. Hopper only."""
        return self._maps.rows(qkv, flash.BN, flash.HD)

    def gate_up_map(self, array: cupy.ndarray) -> np.ndarray:
        """The TMA descriptor gemm_swiglu reads an X or W operand through (128-row boxes).
        Hopper only."""
        return self._maps.rows(array, self.gemm.bm, self.gemm.bk)

    def gemm_swiglu(self, x_map: cupy.ndarray, w_map: cupy.ndarray, bias: cupy.ndarray | None, act: cupy.ndarray,
                    row0: int, k: int, limit: float) -> None:
        """act[r] = swiglu_clamp(X[row0 + r] . W^T + bias) for each row r of act, X and W [2 x
        inter, k] read through their maps (gate_up_map); act may be a strided view (the gate
        half of a gate|up buffer). One persistent CTA per SM at most."""
        rows, inter = act.shape
        tiles = self.gemm.tiles(rows, inter)
        self._f["gemm_swiglu_sm90"]((min(tiles, self._sms),), (self.gemm.threads,),
                                    (x_map, w_map, bias if bias is not None else np.uint64(0), act, np.int32(row0),
                                     np.int32(rows), np.int32(k), np.int32(inter),
                                     np.int64(act.strides[0] // act.itemsize), np.float32(limit)),
                                    shared_mem=self.gemm.smem)

    def flash_bm(self, lengths: list[int], heads: int) -> int:
        """Queries per CTA for segments of these lengths on this GPU (flash.choose_bm)."""
        return flash.choose_bm(self.flash_bms, lengths, heads, self._sms)

    def flash_slots(self, bm: int) -> int:
        """CTAs of a bm-query tile that run at once (a round): the SMs times the CTAs the driver
        fits on one (launch bounds, registers, shared memory). The work list cuts its last round
        into pieces by it; 0 where the kernel takes no pieces (mma.sync)."""
        return self._slots[bm]

    def flash_piece_rows(self) -> int:
        """Rows the flash kernel's pieces leave at most on this GPU (sizes the scratch's pieces)."""
        return flash.piece_rows({bm: self.flash_slots(bm) for bm in self.flash_bms})

    def flash_attention(self, qkv: cupy.ndarray, qkv_map: cupy.ndarray | None, out: cupy.ndarray, tiles: cupy.ndarray,
                        n_tiles: int, heads: int, head_dim: int, bm: int, partial: cupy.ndarray | None = None,
                        counters: cupy.ndarray | None = None, first_piece: int = 0, pieces: int = 0) -> None:
        """tiles: the n_tiles entries of flash.flash_work_list(segments, bm, ...), for one of
        flash_bms; entries from first_piece on are pieces (Hopper), `pieces` a query tile. Their
        rows pass through `partial` (float32, bm x (head_dim + 2) a piece), and `counters` (uint32,
        one per query tile cut, zero between launches) tells the last piece to merge them."""
        if head_dim not in flash.HEAD_DIMS or bm not in self._flash or n_tiles > tiles.shape[0]:
            raise InternalError(f"flash attention: head_dim {head_dim} (compiled: {flash.HEAD_DIMS}), {bm} queries a "
                                f"CTA (compiled: {self.flash_bms}), {n_tiles} entries of a {tiles.shape[0]}-entry list")
        scale_log2 = np.float32(head_dim ** -0.5 * float(np.log2(np.e)))
        f, threads, smem = self._flash[bm]
        if not self.hopper:
            f((n_tiles,), (threads,), (qkv, out, tiles, np.int32(heads), scale_log2), shared_mem=smem)
            return
        if pieces:
            need_rows, need_counters = (n_tiles - first_piece) * bm, (n_tiles - first_piece) // pieces
            if partial is None or partial.size < need_rows * (head_dim + 2) or counters is None or \
                    counters.size < need_counters:
                raise InternalError(f"flash attention: {n_tiles - first_piece} pieces need {need_rows} rows of "
                                    f"{head_dim + 2} float32 and {need_counters} counters; given "
                                    f"{0 if partial is None else partial.size} values, "
                                    f"{0 if counters is None else counters.size} counters")
        f((n_tiles,), (threads,), (qkv_map, out, tiles, np.int32(heads), scale_log2,
                                   partial if pieces else np.uint64(0), counters if pieces else np.uint64(0),
                                   np.int32(first_piece)), shared_mem=smem)
