"""Load `cuda_src/*.cu` as CuPy RawModules and launch their kernels with explicit geometry.

One loader for every file (httomolibgpu's pattern): the source is read from the package
data (or the repository checkout), each `#include "x.cuh"` of ours is pasted in place so
CuPy's on-disk compile cache keys on the full text, and `#line` directives make compiler
errors point into the right file. NVRTC compiles for the current device's architecture,
or for the one a file names in a `// requires: sm_90a` line (wgmma needs the "a" target).
Every module is built once per process, at load (`Kernels()`), so the first image never
waits on a compile; later processes hit CuPy's cache.

Each launcher states its grid, block and shared memory and takes CuPy arrays whose shapes
the engine guarantees; the kernels' own files say why they are shaped the way they are.
The sm_90a kernels (wgmma flash attention, the fused gate|up GEMM + SwiGLU) read their tiles
by TMA, through descriptors the driver API encodes (`TensorMaps`: CuPy has no wrapper for it).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import cupy
import numpy as np

from .errors import GlmVitError
from .faults import Checked
from .layout import FLASH_BN

FLASH_HEAD_DIMS = (64,)  # head dims the flash kernels are instantiated for
# Queries per CTA each flash kernel comes in: mma.sync one; wgmma 64 per warpgroup, 1, 2 or 4 a CTA
# sharing every K/V tile (kernel names: _hd64, _hd64_wg2, _hd64_wg4)
FLASH_BM = {"flash_attention": (128,), "flash_attention_sm90": (256, 128, 64)}
GATE_UP_TILE = (64, 128)  # gemm_swiglu_sm90: K and act columns come in whole tiles of these
QKNORM_HEAD_DIMS = (16, 32, 64, 128, 256)  # rope.cu's qknorm_rope: hd / 8 lanes a head, within a warp
_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"$', re.M)
_REQUIRES = re.compile(r"^// requires: (sm_\w+)$", re.M)


def cuda_source_dir() -> Path:
    """The installed package data, else the repository's top-level cuda_src/."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cuda_src/ not found beside {here}: the package is installed without its kernels")


def load_source(path: Path, pasted: set[str] | None = None) -> str:
    """The file's text with our headers pasted in (each once), under #line directives."""
    pasted = set() if pasted is None else pasted
    text = path.read_text()

    def paste(match: re.Match) -> str:
        name = match.group(1)
        if name in pasted:
            return ""
        pasted.add(name)
        return f"{load_source(path.parent / name, pasted)}\n#line {text.count(chr(10), 0, match.end()) + 1} \"{path}\""

    return f'#line 1 "{path}"\n' + _INCLUDE.sub(paste, text)


def required_arch(source: str) -> str | None:
    """The target a source demands (`// requires: sm_90a`), or None for the device's own."""
    found = _REQUIRES.search(source)
    return found.group(1) if found else None


def _module(name: str) -> cupy.RawModule:
    source = load_source(cuda_source_dir() / f"{name}.cu")
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
        assert box_cols * 2 == 128 and array.strides[1] == 2, "the 128B swizzle needs 128-byte box rows"
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        dims, strides = (u64 * 2)(array.shape[1], array.shape[0]), (u64 * 1)(array.strides[0])
        box, step = (u32 * 2)(box_cols, box_rows), (u32 * 2)(1, 1)
        out = self._buf[self._at:self._at + 16]
        status = self._encode(ctypes.c_void_p(out.ctypes.data), self._BF16, u32(2), ctypes.c_void_p(array.data.ptr),
                              dims, strides, box, step, 0, self._SWIZZLE_128B, self._L2_256B, 0)
        if status != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} "
                               f"(shape {array.shape}, box {box_rows}x{box_cols})")
        return out.view(np.uint8).copy()


def _flash_name(module: str, bm: int) -> str:
    return f"{module}_hd64" + (f"_wg{bm // 64}" if module.endswith("sm90") and bm > 64 else "")


def _grid(n: int, block: int, cap: int = 65536) -> tuple[int]:
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
        flash = "flash_attention_sm90" if self.hopper else "flash_attention"
        names = {"convert": ("f32_to_bf16", "f32_to_f16"), "patchify": ("patchify_u8",), "norms": ("rmsnorm_bias", "layernorm_gelu"),
                 "rope": ("rope_tables", "qknorm_rope"), "mlp": ("swiglu_clamp",),
                 "merge": ("im2col_2x2", "bias_to_bf16"), "softmax": ("softmax_rows",),
                 flash: tuple(_flash_name(flash, bm) for bm in FLASH_BM[flash])}
        if self.hopper:
            names["gemm_swiglu_sm90"] = ("gemm_swiglu_sm90",)
        self._f = {name: _module(mod).get_function(name) for mod, funcs in names.items() for name in funcs}
        if check_launches:  # faults.py: each launch waits for itself and names itself if it faults
            self._f = {name: Checked(f, f"kernel {name}") for name, f in self._f.items()}
        self.flash_bms = FLASH_BM[flash]
        self._maps = TensorMaps() if self.hopper else None
        self._sms = device.attributes["MultiProcessorCount"]
        # 3 stages of a 128-row X box and two 128-row W boxes (64 columns each), the staging tile
        # (128 rows of 2 x 128 + 8 BF16), alignment slack
        self._gemm_smem = 3 * 3 * 128 * 64 * 2 + 128 * 264 * 2 + 1024
        if self.hopper:
            self._f["gemm_swiglu_sm90"].max_dynamic_shared_size_bytes = self._gemm_smem
        # Per query tile: the function, its threads and dynamic shared memory. mma.sync: Q and 2
        # K/V stages, 128 threads. wgmma: a warpgroup per 64 queries; 3 K/V stages, the Q tiles
        # (one warpgroup's passes through a K stage), 1 KiB of slack for the 1024-byte swizzle atom.
        tile = FLASH_BN * 64 * 2
        self._flash = {}
        for bm in self.flash_bms:
            f = self._f[_flash_name(flash, bm)]
            threads, smem = (2 * bm, (6 + (bm // 64 if bm > 64 else 0)) * tile + 1024) if self.hopper else \
                (128, bm * 64 * 2 + 4 * tile)
            f.max_dynamic_shared_size_bytes = smem
            self._flash[bm] = (f, threads, smem)

    def f32_to_bf16(self, src: cupy.ndarray, dst: cupy.ndarray) -> None:
        n4 = src.size // 4
        self._f["f32_to_bf16"](_grid(n4, 256), (256,), (src, dst, np.int64(n4)))

    def f32_to_f16(self, src: cupy.ndarray, dst: cupy.ndarray) -> None:
        n4 = src.size // 4
        self._f["f32_to_f16"](_grid(n4, 256), (256,), (src, dst, np.int64(n4)))

    def patchify_u8(self, canvases: cupy.ndarray, images: cupy.ndarray, n_images: int, table: cupy.ndarray,
                    out: cupy.ndarray, patch: int, temporal: int) -> None:
        """out[P, 3 x temporal x patch^2] (BF16) from the uint8 canvases of a batch; images: int32
        [n_images, 4] as patchify.cu describes, table float32 [3, 256]."""
        self._f["patchify_u8"](_grid(out.shape[0], 1), (128,),
                               (canvases, images, np.int32(n_images), table, out, np.int32(out.shape[0]),
                                np.int32(patch), np.int32(temporal)))

    def rmsnorm_bias(self, x: cupy.ndarray, bias: cupy.ndarray, w: cupy.ndarray, out: cupy.ndarray,
                     eps: float) -> None:
        rows, n = x.shape
        self._f["rmsnorm_bias"]((-(-rows // 8),), (256,), (x, bias, w, out, np.int32(rows), np.int32(n),
                                                           np.float32(eps)))

    def layernorm_gelu(self, x: cupy.ndarray, w: cupy.ndarray, b: cupy.ndarray, out: cupy.ndarray,
                       eps: float) -> None:
        rows, n = x.shape
        self._f["layernorm_gelu"]((rows,), (256,), (x, w, b, out, np.int32(n), np.float32(eps)))

    def rope_tables(self, pos: cupy.ndarray, inv_freq: cupy.ndarray, cos: cupy.ndarray,
                    sin: cupy.ndarray) -> None:
        p, quarter = pos.shape[0], inv_freq.size
        self._f["rope_tables"](_grid(p * quarter, 256, 1 << 30), (256,),
                               (pos, inv_freq, cos, sin, np.int32(p), np.int32(quarter)))

    def qknorm_rope(self, qkv: cupy.ndarray, bias: cupy.ndarray, q_w: cupy.ndarray, k_w: cupy.ndarray,
                    cos: cupy.ndarray, sin: cupy.ndarray, heads: int, eps: float) -> None:
        p, hd = qkv.shape[0], q_w.size
        self._f["qknorm_rope"](_grid(p * 2 * heads * hd // 8, 256, 1 << 30), (256,),
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
        self._f["im2col_2x2"](_grid(rows // 4 * n, 256), (256,), (x, out, np.int64(rows // 4), np.int32(n)))

    def bias_to_bf16(self, x: cupy.ndarray, bias: cupy.ndarray, out: cupy.ndarray) -> None:
        n4 = x.size // 4
        self._f["bias_to_bf16"](_grid(n4, 256), (256,), (x, bias, out, np.int64(n4), np.int32(x.shape[1])))

    def softmax_rows(self, scores: cupy.ndarray, probs: cupy.ndarray, scale: float) -> None:
        rows, n = scores.shape
        self._f["softmax_rows"]((rows,), (256,), (scores, probs, np.int32(n), np.float32(scale)))

    def qkv_map(self, qkv: cupy.ndarray) -> np.ndarray:
        """The TMA descriptor (128 bytes) the wgmma flash kernel reads Q, K and V of the rows
        `qkv` through: rows past qkv's read as zeros, so stale scratch never enters a tile. It
        holds the row count, so it is written per grid, outside any graph. Hopper only."""
        return self._maps.rows(qkv, FLASH_BN, 64)

    def gate_up_map(self, array: cupy.ndarray) -> np.ndarray:
        """The TMA descriptor gemm_swiglu reads an X or W operand through (128-row boxes).
        Hopper only."""
        return self._maps.rows(array, GATE_UP_TILE[1], GATE_UP_TILE[0])

    def gemm_swiglu(self, x_map: cupy.ndarray, w_map: cupy.ndarray, bias: cupy.ndarray | None, act: cupy.ndarray,
                    row0: int, k: int, limit: float) -> None:
        """act[r] = swiglu_clamp(X[row0 + r] . W^T + bias) for each row r of act, X and W [2 x
        inter, k] read through their maps (gate_up_map); act may be a strided view (the gate
        half of a gate|up buffer). One persistent CTA per SM at most."""
        rows, inter = act.shape
        tiles = inter // GATE_UP_TILE[1] * -(-rows // 128)
        self._f["gemm_swiglu_sm90"]((min(tiles, self._sms),), (512,),
                                    (x_map, w_map, bias if bias is not None else np.uint64(0), act, np.int32(row0),
                                     np.int32(rows), np.int32(k), np.int32(inter),
                                     np.int64(act.strides[0] // act.itemsize), np.float32(limit)),
                                    shared_mem=self._gemm_smem)

    def flash_bm(self, lengths: list[int], heads: int) -> int:
        """Queries per CTA for segments of these lengths: the widest tile that still gives every
        SM a CTA. Warpgroups that share K/V tiles read them from L2 once for all: on the
        power-capped H200 (700 W) that traffic costs clock, and in the whole forward 4
        warpgroups a CTA ran 2044x2044 3.3% and 1036x1036 1.7% faster than 1 (alone, in short
        bursts, they are slower: benchmarks/NOTES.md). 448x448 (1024 keys) has 64 CTAs of 256
        queries for 132 SMs and loses 4%, so it keeps 64."""
        for bm in self.flash_bms:
            if sum(-(-n // bm) for n in lengths) * heads >= self._sms:
                return bm
        return self.flash_bms[-1]

    def flash_slots(self, bm: int) -> int:
        """CTAs of a bm-query tile that run at once (a round): the SMs times the CTAs the driver
        fits on one (launch bounds, registers, shared memory). The work list cuts its last round
        into pieces by it; 0 where the kernel takes no pieces (mma.sync)."""
        if not self.hopper:
            return 0
        f, threads, smem = self._flash[bm]
        return self._sms * cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(f.kernel.ptr, threads, smem)

    def flash_attention(self, qkv: cupy.ndarray, qkv_map: cupy.ndarray | None, out: cupy.ndarray, tiles: cupy.ndarray,
                        n_tiles: int, heads: int, head_dim: int, bm: int, partial: cupy.ndarray | None = None,
                        counters: cupy.ndarray | None = None, first_piece: int = 0, pieces: int = 0) -> None:
        """tiles: the n_tiles entries of flash_work_list(segments, bm, ...), for one of
        flash_bms; entries from first_piece on are pieces (Hopper), `pieces` a query tile. Their
        rows pass through `partial` (float32, bm x (head_dim + 2) a piece), and `counters` (uint32,
        one per query tile cut, zero between launches) tells the last piece to merge them."""
        assert head_dim in FLASH_HEAD_DIMS
        scale_log2 = np.float32(head_dim ** -0.5 * float(np.log2(np.e)))
        f, threads, smem = self._flash[bm]
        if not self.hopper:
            f((n_tiles,), (threads,), (qkv, out, tiles, np.int32(heads), scale_log2), shared_mem=smem)
            return
        if pieces:
            assert partial.size >= (n_tiles - first_piece) * bm * (head_dim + 2)
            assert counters.size >= (n_tiles - first_piece) // pieces
        f((n_tiles,), (threads,), (qkv_map, out, tiles, np.int32(heads), scale_log2,
                                   partial if pieces else np.uint64(0), counters if pieces else np.uint64(0),
                                   np.int32(first_piece)), shared_mem=smem)
