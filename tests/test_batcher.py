"""The batcher (batcher.py) on the NumPy backend: many callers, one engine, each result the one
`encode` gives for that image alone; overload, timeouts, cancellation, bad images, a killed
decode worker. GPU runs of the same are in test_gpu_service.py."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit
from glmvit_cupy.errors import GlmVitError, InputError, Overloaded, RequestTimeout
from glmvit_cupy.synthetic import photo_like

SIZES = [(28, 28), (56, 84), (112, 56), (70, 140), (28, 224), (98, 98), (140, 42), (56, 56)]


def png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vit(tiny_ckpt):
    with GlmVit.from_pretrained(tiny_ckpt, backend="numpy") as vit:
        yield vit


@pytest.fixture(scope="module")
def images():
    return [photo_like(*SIZES[i % len(SIZES)], seed=i) for i in range(24)]


@pytest.fixture(scope="module")
def alone(vit, images):
    """Each image encoded alone (a forward of its own), float32 pooler and last hidden."""
    return [vit.encode(image, output="both", dtype="float32", workers=0)[0] for image in images]


def close_to(got: np.ndarray, want: np.ndarray) -> bool:
    """Within float32 BLAS reassociation: a batch's GEMMs block rows differently from one image's."""
    got = np.asarray(got, np.float32)
    return got.shape == want.shape and np.abs(got - want).max() <= 1e-4 * (np.abs(want).max() + 1)


def test_sixteen_threads_get_each_their_own_result(vit, images, alone):
    """16 threads submit mixed images as bytes, arrays and BytesIO; every result is that image's
    (float32, both outputs) and batches formed (fewer forwards than requests)."""
    forms = [png, lambda a: a, lambda a: io.BytesIO(png(a))]
    with vit.batcher(workers=2) as batcher:
        def call(i: int):
            image = images[i % len(images)]
            return i, batcher.submit(forms[i % 3](image), output="both", dtype="float32").result(timeout=120)

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(call, range(64)))
        stats = batcher.stats()
    for i, out in results:
        want = alone[i % len(images)]
        assert close_to(out.pooler_output, want.pooler_output), i
        assert close_to(out.last_hidden_state, want.last_hidden_state), i
        assert np.array_equal(out.grid_thw, want.grid_thw)
        assert out.timing.total_s >= out.timing.inference_s > 0 and out.timing.decode_s > 0
    assert stats.requests == 64 and stats.images == 64 and stats.batches < 64 and stats.queue_depth == 0


def test_two_hundred_coroutines_with_output_and_dtype_of_their_own(vit, images, alone):
    """200 asyncio tasks, each asking its own output and dtype: BF16 comes back as
    ml_dtypes.bfloat16 values, the output not asked for as None."""
    import ml_dtypes

    options = [("pooler", "float32"), ("last_hidden", "float16"), ("both", "bfloat16")]

    async def main():
        with vit.batcher(workers=2) as batcher:
            return await asyncio.gather(*[batcher.aencode(png(images[i % len(images)]), output=options[i % 3][0],
                                                          dtype=options[i % 3][1]) for i in range(200)])

    results = asyncio.run(main())
    for i, out in enumerate(results):
        want, (output, dtype) = alone[i % len(images)], options[i % 3]
        expected = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
        for name, asked in (("pooler_output", output != "last_hidden"), ("last_hidden_state", output != "pooler")):
            got = getattr(out, name)
            if not asked:
                assert got is None
                continue
            assert got.dtype == expected
            tol = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
            ref = getattr(want, name)
            assert np.abs(got.astype(np.float32) - ref).max() <= tol * (np.abs(ref).max() + 1), (i, name)


def test_a_bad_image_fails_alone(tiny_ckpt, images, alone):
    """Undecodable bytes, an empty file object and an image over the budget each fail with their
    own InputError; the good requests around them, batched with them, get their results."""
    big = photo_like(28 * 60, 28 * 60, seed=3)
    with GlmVit.from_pretrained(tiny_ckpt, backend="numpy", max_pixels=28 * 28 * 40) as small, \
            small.batcher(workers=2) as batcher:
        futures = [batcher.submit(png(images[0]), dtype="float32"), batcher.submit(b"not an image"),
                   batcher.submit(io.BytesIO(b"")), batcher.submit(big), batcher.submit(png(images[1]), dtype="float32")]
        outcomes = [f.exception(timeout=120) or f.result() for f in futures]
    assert close_to(outcomes[0].pooler_output, alone[0].pooler_output)
    assert close_to(outcomes[4].pooler_output, alone[1].pooler_output)
    assert isinstance(outcomes[1], InputError) and "not an image PIL can decode" in str(outcomes[1])
    assert isinstance(outcomes[2], InputError)
    assert isinstance(outcomes[3], InputError) and "p_max" in str(outcomes[3])


def test_overload_is_refused_at_once_and_nothing_is_lost(vit, images):
    """Past max_queue waiting requests, submit raises Overloaded immediately; every request it
    took is answered."""
    with vit.batcher(workers=1, max_queue=4) as batcher:
        taken, refused = [], 0
        start = time.perf_counter()
        for i in range(40):
            try:
                taken.append(batcher.submit(images[i % len(images)]))
            except Overloaded as exc:
                refused += 1
                assert "max_queue 4" in str(exc)
        assert time.perf_counter() - start < 5  # refusals do not wait
        assert all(f.result(timeout=120).pooler_output is not None for f in taken)
    assert refused > 0 and len(taken) + refused == 40 and len(taken) >= 4


def test_a_request_past_its_timeout_fails_and_the_rest_go_on(vit, images):
    """With a timeout shorter than one decode of a large image, a request times out (in the
    decode pool or the queue); later requests with time to spare are answered."""
    huge = photo_like(28 * 80, 28 * 90, seed=9)
    with vit.batcher(workers=1, timeout_s=0.05) as batcher:
        late = batcher.submit(huge)
        with pytest.raises(RequestTimeout, match=r"not answered within 0.05 s"):
            late.result(timeout=60)
    with vit.batcher(workers=1, timeout_s=60) as batcher:
        assert batcher.submit(images[0]).result(timeout=60).pooler_output is not None


def test_cancelled_requests_cost_nothing(vit, images):
    """A request cancelled before its batch starts is never decoded or computed: with one worker
    busy on a large image, requests cancelled behind it never reach an engine batch."""
    huge = photo_like(28 * 60, 28 * 60, seed=4)
    with vit.batcher(workers=1) as batcher:
        first = batcher.submit(huge)
        behind = [batcher.submit(images[i]) for i in range(6)]
        assert all(f.cancel() for f in behind)
        first.result(timeout=120)
        last = batcher.submit(images[7]).result(timeout=120)
        stats = batcher.stats()
    assert last.pooler_output is not None
    assert stats.images == 2 and stats.queue_depth == 0  # the six never reached the engine


def test_a_cancelled_coroutine_cancels_its_request(vit, images):
    async def main():
        with vit.batcher(workers=1) as batcher:
            blocker = asyncio.ensure_future(batcher.aencode(photo_like(28 * 60, 28 * 60, seed=5)))
            task = asyncio.ensure_future(batcher.aencode(images[2]))
            await asyncio.sleep(0)
            task.cancel()
            await blocker
            with pytest.raises(asyncio.CancelledError):
                await task
            return batcher.stats()

    assert asyncio.run(main()).images == 1


def test_a_killed_decode_worker_is_replaced(vit, images, alone):
    """SIGKILL of a decode worker (the OOM killer): the batcher keeps answering, the worker's
    input is retried on its replacement, and the GlmVit stays usable."""
    with vit.batcher(workers=1) as batcher:
        batcher.submit(images[0]).result(timeout=60)
        worker = _decode_children(os.getpid())
        assert len(worker) == 1
        os.kill(worker[0], signal.SIGKILL)
        results = [batcher.submit(images[i], dtype="float32") for i in range(4)]
        outs = [f.result(timeout=120) for f in results]
        assert _decode_children(os.getpid()) and _decode_children(os.getpid()) != worker
    assert all(close_to(o.pooler_output, alone[i].pooler_output) for i, o in enumerate(outs))


def test_closed_batcher_refuses_in_one_line(vit, images):
    batcher = vit.batcher(workers=1)
    batcher.close()
    with pytest.raises(GlmVitError, match=r"the batcher is closed"):
        batcher.submit(images[0])
    with pytest.raises(GlmVitError, match=r"workers 0"):
        vit.batcher(workers=0)


def _decode_children(parent: int) -> list[int]:
    """Live decode worker processes of `parent` (workers.Child runs them under `python -c`)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and b"child_main" in cmdline:
            found.append(int(entry))
    return sorted(found)
