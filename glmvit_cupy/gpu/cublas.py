"""BF16 GEMMs through cuBLAS, called so that a CUDA graph can capture them.

Not `cupy.cublas`: CuPy's bindings (`cupy_backends.cuda.libs.cublas`) set
the handle's stream before every call and refuse when that stream is capturing
("calling cuBLAS API during stream capture is currently unsupported"), which rules out
capturing the forward in a graph. cuBLAS itself captures fine once a handle has its own
stream and workspace (cuBLAS docs, "CUDA Graphs Support"). So this module calls the SAME
libcublas CuPy loaded, through ctypes, with a handle of its own bound to the engine's
stream and a fixed workspace from the engine's scratch (no allocation can happen inside a
capture).

Everything is row-major from the caller's side: `linear` computes out[rows, n] (+)=
x[rows, k] . w[n, k]^T (a PyTorch Linear), `matmul` out[rows, n] = a[rows, k] . b[k, n].
Operands are BF16, accumulation FP32, the output BF16 or FP32 (FP32 lets the projections
accumulate straight into the float32 residual stream with beta = 1, and gives the f32-out
score GEMM of the naive attention).
"""

from __future__ import annotations

import ctypes

import cupy

from ..errors import GlmVitError, InternalError
from .faults import check_stream

_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14  # cudaDataType
_COMPUTE_32F = 68  # cublasComputeType_t
_GEMM_DEFAULT = -1


def _libcublas() -> ctypes.CDLL:
    """The libcublas CuPy has loaded (found in /proc/self/maps after CuPy initialises it)."""
    cupy.cuda.device.get_cublas_handle()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if path.rsplit("/", 1)[-1].startswith("libcublas.so"):
                return ctypes.CDLL(path)
    raise GlmVitError("cannot find the libcublas CuPy loaded (not in /proc/self/maps)")


class Cublas:
    """A cuBLAS handle on one stream; graph-capturable GEMMs once `set_workspace` is called."""

    def __init__(self, stream: cupy.cuda.Stream, check_launches: bool = False) -> None:
        lib = _libcublas()
        self._gemm = lib.cublasGemmEx
        self._gemm.restype = ctypes.c_int
        self._gemm.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream.ptr)), "cublasSetStream")
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._stream, self._check_launches = stream, check_launches
        self._set_workspace = lib.cublasSetWorkspace_v2
        self._destroy = lib.cublasDestroy_v2

    def set_workspace(self, workspace: cupy.ndarray) -> None:
        """Hand cuBLAS a workspace it keeps for good (the caller keeps it alive)."""
        self._check(self._set_workspace(self.handle, ctypes.c_void_p(workspace.data.ptr),
                                        ctypes.c_size_t(workspace.nbytes)), "cublasSetWorkspace")

    def __del__(self) -> None:
        if getattr(self, "handle", None):
            self._destroy(self.handle)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise GlmVitError(f"the GPU failed in {what}: cuBLAS status {status} (after a CUDA fault every later call "
                              "fails: restart the process)")

    def _call(self, trans_a: int, m: int, n: int, k: int, a: cupy.ndarray, lda: int, b: cupy.ndarray,
              ldb: int, c: cupy.ndarray, ldc: int, accumulate: bool, trans_b: int = _OP_N) -> None:
        c_type = _R_32F if c.dtype == cupy.float32 else _R_16BF
        self._check(self._gemm(self.handle, trans_a, trans_b, m, n, k, ctypes.byref(self._one),
                               a.data.ptr, _R_16BF, lda, b.data.ptr, _R_16BF, ldb,
                               ctypes.byref(self._one if accumulate else self._zero),
                               c.data.ptr, c_type, ldc, _COMPUTE_32F, _GEMM_DEFAULT), "cublasGemmEx")
        if self._check_launches:
            check_stream(f"cublasGemmEx (m {m}, n {n}, k {k})", self._stream)

    def linear(self, out: cupy.ndarray, x: cupy.ndarray, w: cupy.ndarray, accumulate: bool = False) -> None:
        """out[rows, n] (+)= x[rows, k] . w[n, k]^T. Rows of each operand may be strided (views)."""
        rows, k = x.shape
        n = w.shape[0]
        if w.shape[1] != k or out.shape != (rows, n):
            raise InternalError(f"linear: x {x.shape} . w {w.shape}^T does not fit out {out.shape}")
        # Column-major view: out^T (n x rows) = w (n x k, i.e. w^T stored) . x^T.
        self._call(_OP_T, n, rows, k, w, _ld(w), x, _ld(x), out, _ld(out), accumulate)

    def matmul(self, out: cupy.ndarray, a: cupy.ndarray, b: cupy.ndarray) -> None:
        """out[rows, n] = a[rows, k] . b[k, n]."""
        rows, k = a.shape
        n = b.shape[1]
        if b.shape[0] != k or out.shape != (rows, n):
            raise InternalError(f"matmul: a {a.shape} . b {b.shape} does not fit out {out.shape}")
        self._call(_OP_N, n, rows, k, b, _ld(b), a, _ld(a), out, _ld(out), False)


def _ld(array: cupy.ndarray) -> int:
    """Row stride in elements of a 2-D view whose rows are contiguous."""
    if array.ndim != 2 or array.strides[1] != array.itemsize:
        raise InternalError(f"a GEMM operand must be 2-D with contiguous rows: shape {array.shape}, "
                            f"strides {array.strides}")
    return array.strides[0] // array.itemsize
