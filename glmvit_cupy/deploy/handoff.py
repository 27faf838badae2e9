"""What the server's engine process and its HTTP front processes share (serve.py, front.py): the
messages on a front's socket pair, the slots of a front's shared memory, how an answer's arrays
lie in a slot, and the board where the fronts say how many connections each holds.

A message is a 4-byte length and a JSON object with an "op"; bulk bytes never cross the socket.
A front's shared memory is one memfd, made by the engine and passed to the front (SCM_RIGHTS),
mapped by both: `slots` slots, each a canvas area (the largest canvas one image decodes to) and
an answer area (the largest answer of one image: both outputs, in float32, as base64 text). A
memfd has no name in /dev/shm, so no death, SIGKILL included, leaves a segment behind, and its
pages are allocated when first written: a slot costs its high-water mark, not its size.

Separate from both processes' modules because it is their contract (the engine imports the front only
to start it and to share its settings' types).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import logging.handlers
import mmap
import os
import queue
import struct
from typing import Any

import numpy as np

from ..bf16 import bf16_array
from ..processor.preprocess import ProcessorConfig
from ..tower.geometry import GlmVitGeometry
from ..tower.writer import flat_bytes
from ..workers import usable_cpus

# serve --http-workers: half the usable cores, at most 8 (the rest: the engine process's threads, and
# the fronts' own decode threads, which PIL runs without the GIL).
DEFAULT_HTTP_WORKERS = max(1, min(8, usable_cpus() // 2))
HEADER = struct.Struct("<I")  # a message: its JSON's length, then the JSON
ALIGN = 64  # bytes: where each array of an answer starts in its area
BASE64 = "base64"  # an answer array's dtype when the engine wrote it as base64 text (a GPU's)


def send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    """Queued on the writer at once (messages are small: nothing to wait for)."""
    body = json.dumps(message).encode()
    writer.write(HEADER.pack(len(body)) + body)


async def receive(reader: asyncio.StreamReader) -> dict[str, Any]:
    """The next message; asyncio.IncompleteReadError once the other end has closed."""
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return json.loads(await reader.readexactly(n))


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where a front's slots lie in its memfd."""

    canvas_bytes: int
    answer_bytes: int
    slots: int

    @classmethod
    def of(cls, processor: ProcessorConfig, geometry: GlmVitGeometry, slots: int) -> SlotLayout:
        """Slots for the largest image the processor makes: max_image_tokens merged tokens, a canvas
        of (patch x merge)^2 pixels a token; an answer of both outputs in float32, as base64 text."""
        tokens = processor.max_image_tokens
        side = processor.patch_size * processor.merge_size
        array = tokens * geometry.out_hidden_size * 4
        return cls(_aligned(3 * side * side * tokens), 2 * _aligned(4 * -(-array // 3)), slots)

    @property
    def slot_bytes(self) -> int:
        return self.canvas_bytes + self.answer_bytes

    @property
    def size(self) -> int:
        return self.slots * self.slot_bytes

    def canvas(self, memory: np.ndarray, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        """The uint8 canvas of `shape` in `slot`'s canvas area."""
        n = int(np.prod(shape))
        if n > self.canvas_bytes:
            raise ValueError(f"a canvas of shape {tuple(shape)} is larger than a slot's {self.canvas_bytes:,} bytes")
        start = slot * self.slot_bytes
        return memory[start:start + n].reshape(shape)

    def release(self, memory: np.ndarray, slot: int) -> None:
        """`slot`'s pages back to the kernel: a free slot otherwise keeps the largest image it held."""
        release(memory, slot * self.slot_bytes, (slot + 1) * self.slot_bytes)

    def answer(self, memory: np.ndarray, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes + self.canvas_bytes
        return memory[start:start + self.answer_bytes]


def board_bytes(fronts: int) -> int:
    """The fronts' board: a memfd of one int64 a front, its open connections (front.py's accepts)."""
    return 8 * fronts


def memfd(size: int) -> int:
    """A new memfd of `size` bytes (its pages allocated as they are written)."""
    fd = os.memfd_create("glmvit-front", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def mapped(fd: int, size: int) -> np.ndarray:
    """The memfd's bytes as a uint8 array, shared with every process that maps it. The mapping
    stays while any view of it lives (a canvas the batcher still reads), whatever happens to
    the process at the other end."""
    return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)


def release(memory: np.ndarray, start: int, stop: int) -> None:
    """Give the pages wholly inside bytes [start, stop) of a `mapped` memfd back to the kernel (for
    every process mapping it: they read as zeros after)."""
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, stop // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        buffer = memory.base  # the mmap, or (NumPy >= 2) a memoryview of it
        (buffer.obj if isinstance(buffer, memoryview) else buffer).madvise(mmap.MADV_REMOVE, first, last - first)


def write_arrays(area: np.ndarray, arrays: dict[str, np.ndarray], encode: Any = None) -> list[list]:
    """The arrays' bytes into an answer area, each at an ALIGN boundary; with `encode`
    (DeviceBase64.encode) as base64 text. Their specs for `read_arrays`."""
    specs, at = [], 0
    for name, array in arrays.items():
        if encode is None:
            flat = flat_bytes(array)
            area[at:at + flat.size] = flat
            n, dtype = flat.size, array.dtype.name
        else:
            n, dtype = encode(array, out=area[at:]).size, BASE64
        specs.append([name, dtype, list(array.shape), at, n])
        at = _aligned(at + n)
    return specs


def read_arrays(area: np.ndarray, specs: list[list]) -> dict[str, np.ndarray]:
    """The arrays `write_arrays` wrote, as views of the area (base64 text: a uint8 array of it)."""
    arrays = {}
    for name, dtype, shape, at, n in specs:
        raw = area[at:at + n]
        if dtype == BASE64:
            arrays[name] = raw
        elif dtype == "bfloat16":
            arrays[name] = bf16_array(raw.view(np.uint16)).reshape(shape)
        else:
            arrays[name] = raw.view(np.dtype(dtype)).reshape(shape)
    return arrays


def log_through_thread(logger: logging.Logger, prefix: str = "") -> logging.handlers.QueueListener:
    """`logger`'s lines (INFO and up) written to stderr by a thread of its own, started; stop it to
    write what is queued. A write to stderr (a pipe a supervisor reads) would stop the event loop,
    and under load wait for the GIL back after it."""
    writer = logging.StreamHandler()
    writer.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(message)s", "%Y-%m-%dT%H:%M:%S"))
    lines: queue.SimpleQueue = queue.SimpleQueue()
    logger.addHandler(logging.handlers.QueueHandler(lines))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    listener = logging.handlers.QueueListener(lines, writer)
    listener.start()
    return listener
