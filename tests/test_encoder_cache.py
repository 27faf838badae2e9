"""The encoder cache alone (asyncio, no server): keys, LRU by bytes, single flight, cancellation.
The server's own test (test_serve.py) checks the same through HTTP and the metrics."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from glmvit_cupy.deploy.encoder_cache import HIT, MISS, SHARED, EncoderCache, image_digest, result_bytes
from glmvit_cupy.processor.preprocess import ProcessorConfig


@dataclasses.dataclass
class Result:
    """The arrays of a GlmVitOutput, which is all the cache reads."""

    pooler_output: np.ndarray
    last_hidden_state: np.ndarray | None = None
    grid_thw: np.ndarray = dataclasses.field(default_factory=lambda: np.ones((1, 3), np.int64))
    offsets: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(2, np.int64))


def result(rows: int) -> Result:
    return Result(np.zeros((rows, 4), np.float32))


SIZE = result_bytes(result(1))  # 16 + 24 + 16 bytes


def compute_counting(calls: list, value, started: asyncio.Event | None = None, release: asyncio.Event | None = None):
    async def compute():
        calls.append(1)
        if started is not None:
            started.set()
        if release is not None:
            await release.wait()
        return value
    return compute


def test_keys_cover_bytes_settings_fingerprint_output_and_dtype():
    cache = EncoderCache(0, "f" * 64, ProcessorConfig())
    key = cache.key(image_digest(b"png"), "pooler", "float32")
    assert key == cache.key(image_digest(b"png"), "pooler", "float32")
    others = {cache.key(image_digest(b"jpg"), "pooler", "float32"), cache.key(image_digest(b"png"), "both", "float32"),
              cache.key(image_digest(b"png"), "pooler", "bfloat16"),
              EncoderCache(0, "e" * 64, ProcessorConfig()).key(image_digest(b"png"), "pooler", "float32"),
              EncoderCache(0, "f" * 64, ProcessorConfig(max_image_tokens=64)).key(image_digest(b"png"), "pooler",
                                                                                  "float32")}
    assert key not in others and len(others) == 5


def test_lru_within_bytes_and_a_result_over_the_bound_is_returned_not_kept():
    async def main():
        cache = EncoderCache(2 * SIZE, "f", ProcessorConfig())
        calls = []
        for key in ("a", "b"):
            assert (await cache.get(key, compute_counting(calls, result(1))))[1] == MISS
        assert (await cache.get("a", compute_counting(calls, result(1))))[1] == HIT  # a is now the most recent
        await cache.get("c", compute_counting(calls, result(1)))  # evicts b, the least recently used
        assert cache.bytes == 2 * SIZE and cache.entries == 2 and cache.evictions == 1
        assert (await cache.get("a", compute_counting(calls, result(1))))[1] == HIT
        assert (await cache.get("b", compute_counting(calls, result(1))))[1] == MISS
        big, outcome = await cache.get("big", compute_counting(calls, result(100)))
        assert outcome == MISS and big.pooler_output.shape == (100, 4) and cache.entries == 2
        hit, _ = await cache.get("a", compute_counting(calls, result(1)))
        with pytest.raises(ValueError):  # every hit hands out the same arrays
            hit.pooler_output[0, 0] = 1
        assert cache.counts == {HIT: 3, MISS: 5, SHARED: 0} and len(calls) == 5
        off = EncoderCache(0, "f", ProcessorConfig())
        for _ in range(2):
            assert (await off.get("a", compute_counting(calls, result(1))))[1] == MISS
        assert off.entries == 0 and off.bytes == 0
    asyncio.run(main())


def test_identical_concurrent_requests_share_one_computation():
    async def main():
        cache = EncoderCache(10 * SIZE, "f", ProcessorConfig())
        calls, release = [], asyncio.Event()
        waiters = [asyncio.ensure_future(cache.get("k", compute_counting(calls, result(1), release=release)))
                   for _ in range(5)]
        await asyncio.sleep(0)
        release.set()
        outcomes = [o for _, o in await asyncio.gather(*waiters)]
        assert len(calls) == 1 and sorted(outcomes) == [MISS] + [SHARED] * 4
        assert (await cache.get("k", compute_counting(calls, result(1))))[1] == HIT
    asyncio.run(main())


def test_a_computation_is_cancelled_only_when_all_its_waiters_left():
    async def main():
        cache = EncoderCache(10 * SIZE, "f", ProcessorConfig())
        calls, started, release = [], asyncio.Event(), asyncio.Event()
        first = asyncio.ensure_future(cache.get("k", compute_counting(calls, result(1), started, release)))
        second = asyncio.ensure_future(cache.get("k", compute_counting(calls, result(1))))
        await started.wait()
        first.cancel()
        await asyncio.sleep(0)
        release.set()
        assert (await second)[1] == SHARED and len(calls) == 1  # the one left still got it
        gone, started, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def abandoned():
            started.set()
            try:
                await release.wait()
            except asyncio.CancelledError:
                gone.set()
                raise
        lone = asyncio.ensure_future(cache.get("j", abandoned))
        await started.wait()
        lone.cancel()
        await asyncio.wait_for(gone.wait(), 1)  # nobody waits any more: the work is dropped
        assert cache.entries == 1
    asyncio.run(main())


def test_failures_reach_every_waiter_and_are_not_kept():
    async def main():
        cache = EncoderCache(10 * SIZE, "f", ProcessorConfig())
        release = asyncio.Event()

        async def fails():
            await release.wait()
            raise ValueError("bad image")
        waiters = [asyncio.ensure_future(cache.get("k", fails)) for _ in range(3)]
        await asyncio.sleep(0)
        release.set()
        for outcome in await asyncio.gather(*waiters, return_exceptions=True):
            assert isinstance(outcome, ValueError)
        calls = []
        assert (await cache.get("k", compute_counting(calls, result(1))))[1] == MISS and calls == [1]
    asyncio.run(main())
