"""The encoder cache of `glmvit-cupy serve`: an image's embeddings, kept by a hash of all they depend on.

A service sees the same image again (one picture in many posts, a client's retry); computing it again
costs a decode and a forward, a hit costs a dictionary lookup. The key is the sha256 of the image's
bytes, of the processor's settings and the tower's fingerprint (fixed for one cache: hashed once into
its scope), and of the output and dtype asked for. Entries leave least recently used first, bounded by
the bytes of their arrays (what runs out on a host), so memory stays flat under any traffic; a result
larger than the whole bound is returned and not kept, never an error. Identical requests arriving while
the first one computes wait for that computation instead of starting their own (single flight); it is
cancelled only when every request waiting for it has gone away.

Separate from serve.py because it knows nothing of HTTP or metrics: asyncio and arrays only, tested alone.
The cached arrays are made read-only, since every hit hands out the same ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from collections import OrderedDict
from typing import Any, Awaitable, Callable

from ..processor.preprocess import ProcessorConfig

HIT, MISS, SHARED = "hit", "miss", "shared"  # a stored result; a computation started; one joined
DEFAULT_CACHE_BYTES = 256 * 2**20  # serve --cache-bytes: 32 real-tower BF16 pooler outputs of 1,000 tokens


def image_digest(data: bytes) -> str:
    """sha256 of an image file's bytes, hex."""
    return hashlib.sha256(data).hexdigest()


def result_bytes(result: Any) -> int:
    """Bytes of a GlmVitOutput's arrays (the output not asked for is None)."""
    return sum(a.nbytes for a in (result.pooler_output, result.last_hidden_state, result.grid_thw, result.offsets)
               if a is not None)


@dataclasses.dataclass
class _Flight:
    task: asyncio.Future
    waiters: int = 0


class EncoderCache:
    """Results by key, LRU within `max_bytes` (0: none kept; identical concurrent requests still share
    one computation), with single flight. Use from one event loop."""

    def __init__(self, max_bytes: int, fingerprint: str, processor: ProcessorConfig) -> None:
        self.max_bytes = max_bytes
        settings = json.dumps(dataclasses.asdict(processor), sort_keys=True)
        self._scope = hashlib.sha256(f"{fingerprint}\n{settings}\n".encode()).hexdigest()
        self._entries: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._flights: dict[str, _Flight] = {}
        self.bytes = 0
        self.counts = {HIT: 0, MISS: 0, SHARED: 0}
        self.evictions = 0

    def key(self, digest: str, output: str, dtype: str) -> str:
        """The key of the image with this `image_digest` encoded into `output` in `dtype`."""
        return hashlib.sha256(f"{self._scope}\n{digest}\n{output}\n{dtype}".encode()).hexdigest()

    @property
    def entries(self) -> int:
        return len(self._entries)

    async def get(self, key: str, compute: Callable[[], Awaitable[Any]]) -> tuple[Any, str]:
        """(result, HIT | MISS | SHARED): the stored result, else the one computation of `key` in flight,
        else a new one, `compute()`. Its exception is every waiter's; cancelling this call cancels the
        computation only if no other call waits for it."""
        stored = self._entries.get(key)
        if stored is not None:
            self._entries.move_to_end(key)
            self.counts[HIT] += 1
            return stored[0], HIT
        flight = self._flights.get(key)
        outcome = SHARED
        if flight is None:
            flight = self._flights[key] = _Flight(asyncio.ensure_future(compute()))
            flight.task.add_done_callback(lambda task: self._landed(key, task))
            outcome = MISS
        self.counts[outcome] += 1
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task), outcome
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():  # every requester left: drop the work
                flight.task.cancel()

    def _landed(self, key: str, task: asyncio.Future) -> None:
        del self._flights[key]
        if task.cancelled() or task.exception() is not None:  # failures are not kept: each retry is tried
            return
        result = task.result()
        size = result_bytes(result)
        if size > self.max_bytes:
            return
        for array in (result.pooler_output, result.last_hidden_state, result.grid_thw, result.offsets):
            if array is not None:
                array.flags.writeable = False
        self._entries[key] = (result, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
            self.evictions += 1
