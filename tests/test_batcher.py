"""The batcher (batcher.py) on the NumPy backend: many callers, one engine, each result the one
`encode` gives for that image alone; overload, timeouts, cancellation, bad images, a killed
decode worker. GPU runs of the same are in test_gpu_service.py."""

from __future__ import annotations

import asyncio
import io
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit
from glmvit_cupy.errors import GlmVitError, InputError, Overloaded, RequestTimeout
from glmvit_cupy.processor.preprocess import EncodedImage
from glmvit_cupy.tower.synthetic import photo_like
from helpers import live_processes

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
    assert isinstance(outcomes[2], InputError) and "empty file (0 bytes)" in str(outcomes[2])
    assert isinstance(outcomes[3], InputError) and str(outcomes[3]) == (
        "a ndarray: 14400 patches exceed p_max 160 (max_pixels 31360); raise max_pixels to at least 2822400 "
        "(--max-pixels, or GlmVit.from_pretrained(max_pixels=...))")


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
    assert stats.decoded == 2 and stats.images == 2 and stats.queue_depth == 0  # the six: never decoded


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


class Poison(EncodedImage):
    """An input whose unpickling in a decode worker kills that worker (os._exit, as the OOM
    killer would mid-decode) while fewer than `deaths` files are in `marker` (one more a death),
    then is the image `data`."""

    def __new__(cls, marker, deaths: int, data: bytes):
        self = super().__new__(cls)
        object.__setattr__(self, "args", (str(marker), deaths, data))
        return self

    def __init__(self, marker, deaths: int, data: bytes) -> None:
        super().__init__("poison", data)

    def __reduce__(self):
        marker, deaths, data = self.args
        code = (f"(lambda os, d: os._exit(9) if len(os.listdir(d)) < {deaths} and not "
                f"open(os.path.join(d, str(len(os.listdir(d)))), 'w').close() else "
                f"__import__('glmvit_cupy.processor.preprocess', fromlist=['x']).EncodedImage('poison', {data!r}))"
                f"(__import__('os'), {marker!r})")
        return eval, (code,)


def test_a_worker_that_dies_under_an_input_is_replaced_and_the_input_retried_once(vit, images, alone, tmp_path):
    """A worker dying under an input (killed mid-decode) is replaced and that input retried on the
    new one: once dying, it succeeds; dying twice, it fails alone. The requests around it, the
    batcher and the GlmVit go on; so after an idle worker is SIGKILLed from outside."""
    once, twice = tmp_path / "once", tmp_path / "twice"
    once.mkdir()
    twice.mkdir()
    others = set(_decode_children(os.getpid()))  # pools of earlier tests' GlmVits, still open
    with vit.batcher(workers=1) as batcher:
        futures = [batcher.submit(png(images[0]), dtype="float32"), batcher.submit(Poison(once, 1, png(images[1]))),
                   batcher.submit(png(images[2]), dtype="float32"), batcher.submit(Poison(twice, 2, png(images[3]))),
                   batcher.submit(png(images[4]), dtype="float32")]
        outcomes = [f.exception(timeout=120) or f.result() for f in futures]
        worker = [pid for pid in _decode_children(os.getpid()) if pid not in others]
        assert len(worker) == 1
        os.kill(worker[0], signal.SIGKILL)
        after = batcher.submit(images[5], dtype="float32").result(timeout=120)
        replaced = [pid for pid in _decode_children(os.getpid()) if pid not in others]
        assert replaced and replaced != worker
    assert len(os.listdir(once)) == 1 and len(os.listdir(twice)) == 2  # the deaths happened
    for i in (0, 2, 4):
        assert close_to(outcomes[i].pooler_output, alone[i].pooler_output), i
    assert outcomes[1].pooler_output is not None
    assert isinstance(outcomes[3], InputError) and "died twice" in str(outcomes[3])
    assert close_to(after.pooler_output, alone[5].pooler_output)


def test_closed_batcher_refuses_in_one_line(vit, images):
    batcher = vit.batcher(workers=1)
    batcher.close()
    with pytest.raises(GlmVitError, match=r"the batcher is closed"):
        batcher.submit(images[0])
    with pytest.raises(GlmVitError, match=r"workers 0"):
        vit.batcher(workers=0)


def _decode_children(parent: int) -> list[int]:
    """Live decode worker processes of `parent` (workers.Child runs them under `python -c`)."""
    return sorted(pid for pid, fields, cmdline in live_processes()
                  if int(fields[1]) == parent and b"child_main" in cmdline)


def test_canvases_decoded_elsewhere_are_batched_without_a_decode_pool(vit, images, alone):
    """submit_canvas (the server's fronts decode in their own processes): results as close to each
    image alone as submit's, an over-budget canvas failing alone with its name, and no decode
    process started."""
    from glmvit_cupy.collection.pipeline import prepare

    def children() -> set[str]:
        return {pid for pid, fields, _ in live_processes() if fields[1] == str(os.getpid())}

    canvases = [prepare(image, vit.processor).canvas for image in images[:6]]
    side = vit.processor.patch_size * (math.isqrt(vit.p_max) + 2)  # more patches than p_max
    before = children()
    with vit.batcher(workers=2) as batcher:
        futures = [batcher.submit_canvas(c, f"canvas {i}", 0.0, output="both", dtype="float32")
                   for i, c in enumerate(canvases)]
        huge = batcher.submit_canvas(np.zeros((side, side, 3), np.uint8), "the huge one", 0.0)
        results = [f.result(timeout=120) for f in futures]
        assert children() == before and batcher.decoder is None
        with pytest.raises(InputError, match=r"^the huge one: \d+ patches exceed p_max"):
            huge.result(timeout=120)
    for got, want in zip(results, alone):
        assert close_to(got.pooler_output, want.pooler_output)
        assert close_to(got.last_hidden_state, want.last_hidden_state)
