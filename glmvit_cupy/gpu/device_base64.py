"""Base64 on the GPU, for the server's base64 answers (`glmvit-cupy serve`, encoding_format base64).

A real tower's answer is megabytes of embedding. Python's encoder (binascii) runs at a few hundred
MB/s on a server's host cores and holds the GIL while it does, so in the one server process it took
the time the batcher's threads need to keep the GPU fed (benchmarks/NOTES.md). Here the bytes go to
the GPU through pinned memory, `cuda_src/base64.cu` encodes them, and the text comes back: the host
only copies. The result is byte for byte `base64.b64encode`'s (tests/test_gpu_service.py).

Separate from the engine and the stager: an encoding of results that only the server asks for, with
buffers and a stream of its own (allocated once, at start), on the first engine's device.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, ContextManager

import cupy
import numpy as np

from ..tower.writer import flat_bytes
from .faults import synchronize
from .kernel_source import cuda_source_dir
from .kernels import compile_module, grid_1d

CHUNK = 3 * 2**22  # input bytes a round trip (12 MiB; a multiple of 3, so the chunks' texts concatenate)
BLOCK = 256


def encoded_size(n: int) -> int:
    return 4 * -(-n // 3)


class DeviceBase64:
    """`encode(array)`: base64 of the array's bytes (row-major), as a uint8 NumPy array of the text.
    Thread-safe (one call at a time: a call is a few copies, mostly outside the GIL)."""

    def __init__(self, current: Callable[[], ContextManager] = contextlib.nullcontext, chunk: int = CHUNK) -> None:
        if chunk <= 0 or chunk % 3:
            raise ValueError(f"chunk {chunk}: must be a positive multiple of 3")
        self.current, self.chunk = current, chunk
        with current():
            self.kernel = compile_module(cuda_source_dir(), "base64").get_function("base64_encode")
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.src = cupy.empty(chunk, dtype=cupy.uint8)
            self.dst = cupy.empty(encoded_size(chunk), dtype=cupy.uint8)
            self.pinned_src = _pinned(chunk)
            self.pinned_dst = _pinned(encoded_size(chunk))
        self._lock = threading.Lock()

    def encode(self, array: np.ndarray) -> np.ndarray:
        flat = flat_bytes(array)
        out = np.empty(encoded_size(flat.size), dtype=np.uint8)
        with self._lock, self.current(), self.stream:
            for start in range(0, flat.size, self.chunk):
                piece = flat[start:start + self.chunk]
                n, m = piece.size, encoded_size(piece.size)
                self.pinned_src[:n] = piece  # a copy from pageable memory would make the upload synchronous
                self.src[:n].set(self.pinned_src[:n], stream=self.stream)
                self.kernel(grid_1d(-(-n // 3), BLOCK), (BLOCK,), (self.src, np.int64(n), self.dst))
                self.dst[:m].get(stream=self.stream, out=self.pinned_dst[:m])
                synchronize(self.stream, "the base64 of an answer")
                at = start // 3 * 4
                out[at:at + m] = self.pinned_dst[:m]
        return out


def _pinned(nbytes: int) -> np.ndarray:
    return np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)
