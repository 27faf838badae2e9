"""Base64 on the GPU, for the server's base64 answers (`glmvit-cupy serve`, encoding_format base64).

A real tower's answer is megabytes of embedding. Python's encoder (binascii) runs at a few hundred
MB/s on a server's host cores and holds the GIL while it does, so in the one server process it took
the time the batcher's threads need to keep the GPU fed (benchmarks/NOTES.md). Here the bytes go to
the GPU through pinned memory, `cuda_src/base64.cu` encodes them, and the text comes back: the host
only copies. The result is byte for byte `base64.b64encode`'s (tests/test_gpu_service.py).

Separate from the engine and the stager: an encoding of results that only the server asks for, with
buffers and streams of its own (allocated once, at start), on the first engine's device. A call's
host copies (the answer into pinned memory, the text out of it) take milliseconds for a real answer,
so answers are encoded LANES at a time, each on a lane of its own (stream and buffers): with one
lane every answer waited for the one before, and the server's answers could not pass ~1 / (a call's
time), about the rate the server is meant to reach.
"""

from __future__ import annotations

import contextlib
import queue
from typing import Callable, ContextManager

import cupy
import numpy as np

from ..tower.writer import flat_bytes
from .faults import synchronize
from .kernel_source import cuda_source_dir
from .kernels import compile_module, grid_1d

CHUNK = 3 * 2**22  # input bytes a round trip (12 MiB; a multiple of 3, so the chunks' texts concatenate)
BLOCK = 256
LANES = 4  # answers encoded at once (each lane: 28 MiB pinned and 28 MiB on the device at CHUNK)


def encoded_size(n: int) -> int:
    return 4 * -(-n // 3)


class DeviceBase64:
    """`encode(array)`: base64 of the array's bytes (row-major), as a uint8 NumPy array of the text.
    Thread-safe: up to `lanes` calls run at once (a call is a few copies, outside the GIL), more wait
    for a free lane."""

    def __init__(self, current: Callable[[], ContextManager] = contextlib.nullcontext, chunk: int = CHUNK,
                 lanes: int = LANES) -> None:
        if chunk <= 0 or chunk % 3:
            raise ValueError(f"chunk {chunk}: must be a positive multiple of 3")
        if lanes < 1:
            raise ValueError(f"lanes {lanes}: must be at least 1")
        self.current, self.chunk = current, chunk
        self._free: queue.SimpleQueue[_Lane] = queue.SimpleQueue()
        with current():
            self.kernel = compile_module(cuda_source_dir(), "base64").get_function("base64_encode")
            for _ in range(lanes):
                self._free.put(_Lane(chunk))

    def encode(self, array: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The text, written into the start of `out` (a uint8 array with room for it) if given."""
        flat = flat_bytes(array)
        if out is None:
            out = np.empty(encoded_size(flat.size), dtype=np.uint8)
        out = out[:encoded_size(flat.size)]
        lane = self._free.get()
        try:
            with self.current(), lane.stream:
                for start in range(0, flat.size, self.chunk):
                    piece = flat[start:start + self.chunk]
                    n, m = piece.size, encoded_size(piece.size)
                    lane.pinned_src[:n] = piece  # a copy from pageable memory would make the upload synchronous
                    lane.src[:n].set(lane.pinned_src[:n], stream=lane.stream)
                    self.kernel(grid_1d(-(-n // 3), BLOCK), (BLOCK,), (lane.src, np.int64(n), lane.dst))
                    lane.dst[:m].get(stream=lane.stream, out=lane.pinned_dst[:m])
                    synchronize(lane.stream, "the base64 of an answer")
                    at = start // 3 * 4
                    out[at:at + m] = lane.pinned_dst[:m]
        finally:
            self._free.put(lane)
        return out


class _Lane:
    """One call's stream, device buffers and pinned buffers (made on the current device)."""

    def __init__(self, chunk: int) -> None:
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.src = cupy.empty(chunk, dtype=cupy.uint8)
        self.dst = cupy.empty(encoded_size(chunk), dtype=cupy.uint8)
        self.pinned_src = _pinned(chunk)
        self.pinned_dst = _pinned(encoded_size(chunk))


def _pinned(nbytes: int) -> np.ndarray:
    return np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)
