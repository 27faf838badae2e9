"""One GPU GlmVit behind a service (marked `gpu`): built in one thread, called first from
fresh threads with grids it has never seen (forward, encode, encode_iter, the batcher), on both
kernel sets; the batcher's results against encode alone."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from glmvit_cupy import GlmVit, preprocess
from glmvit_cupy.tower.synthetic import photo_like

from helpers import KERNEL_SETS, rel_err, skip_unless_available

pytestmark = pytest.mark.gpu
BATCH_FACTOR = 1.5  # a batched result's error against the float32 reference, over the image alone's
ALONE_SPREAD = 3e-2  # relative difference of a batched result from the image alone (both BF16 engines)


def in_fresh_thread(call):
    """call() in a new thread (no CUDA context current there yet); its result or its exception."""
    box = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as exc:  # re-raised in the test's thread, with the engine's message
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_first_calls_from_fresh_threads_on_new_grids(real_ckpt, kernels):
    """Each entry point, first called from a thread that never touched CUDA, on a grid the engine
    has never met (a new grid needs a TMA descriptor on Hopper: a driver call through ctypes,
    which failed with CUDA_ERROR_INVALID_CONTEXT); then the same inputs from the building thread,
    bit for bit."""
    skip_unless_available(kernels)
    vit = GlmVit.from_pretrained(real_ckpt, backend="cupy", kernels=kernels)
    sizes = iter([(224, 336), (308, 196), (140, 448), (420, 280)])
    try:
        image = photo_like(*next(sizes), seed=1)
        got = in_fresh_thread(lambda: vit.forward(*preprocess(image)).pooler_output.get())
        assert np.array_equal(got, vit.forward(*preprocess(image)).pooler_output.get())

        image = photo_like(*next(sizes), seed=2)
        got = in_fresh_thread(lambda: vit.encode(image, dtype="float32", workers=1)[0].pooler_output)
        assert np.array_equal(got, vit.encode(image, dtype="float32", workers=1)[0].pooler_output)

        image = photo_like(*next(sizes), seed=3)
        got = in_fresh_thread(lambda: next(vit.encode_iter([image], dtype="float32", workers=1))[1].pooler_output)
        assert np.array_equal(got, vit.encode(image, dtype="float32", workers=1)[0].pooler_output)

        image = photo_like(*next(sizes), seed=4)
        with in_fresh_thread(lambda: vit.batcher(workers=1)) as batcher:  # its threads are new too
            got = in_fresh_thread(lambda: batcher.submit(image, dtype="float32").result(timeout=120)).pooler_output
        assert np.array_equal(got, vit.encode(image, dtype="float32", workers=1)[0].pooler_output)
    finally:
        vit.close()


def test_batcher_results_are_as_accurate_as_encode_alone(real_ckpt):
    """32 threads through one batcher, photos of many sizes as PNG bytes, the requests sharing
    forward calls. A batch's results are not the bits of the image alone (its GEMMs and the
    flash work list tile other row counts, and BF16 activations carry the difference through
    24 blocks), so each is held to the float32 reference as the image alone is: at most
    BATCH_FACTOR x the error of encode alone (checked on three images: the reference is slow),
    and within ALONE_SPREAD of encode alone for every image."""
    import io

    from PIL import Image

    vit = GlmVit.from_pretrained(real_ckpt, backend="cupy")
    sizes = [(320 + 37 * i, 1024 - 41 * i) for i in range(12)]
    images = [photo_like(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    blobs = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        blobs.append(buf.getvalue())
    try:
        alone = [vit.encode(image, dtype="float32", workers=1)[0].pooler_output for image in images]
        with vit.batcher(workers=4) as batcher, ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda i: batcher.submit(blobs[i % 12], dtype="float32").result(timeout=300),
                                    range(96)))
            stats = batcher.stats()
        for i, out in enumerate(results):
            assert rel_err(out.pooler_output, alone[i % 12]) < ALONE_SPREAD, i
        with GlmVit.from_pretrained(real_ckpt, backend="numpy") as reference:
            for i, ref in enumerate(reference.encode(images[:3], dtype="float32", workers=1)):
                err_alone = rel_err(alone[i], ref.pooler_output)
                worst = max(rel_err(out.pooler_output, ref.pooler_output) for out in results[i::12])
                print(f"batcher: image {i}: error {worst:.2e} in batches, {err_alone:.2e} alone")
                assert worst <= BATCH_FACTOR * err_alone, i
        assert stats.batches < 96 and stats.gpu_busy_s > 0
        print(f"batcher: 96 requests in {stats.batches} batches, GPU busy {stats.gpu_busy_s:.2f} s")
    finally:
        vit.close()


def test_device_base64_is_pythons_base64(tiny_ckpt):
    """The server's GPU base64 (device_base64.py) against Python's base64.b64encode: every length
    mod 3 near 0, lengths across chunk boundaries (a 3,000-byte chunk here), a BF16 [rows, dim]
    array as the server hands it over, a first call from a fresh thread on another engine's device
    context, and the text written into a slot's answer area (`out`)."""
    import base64

    from glmvit_cupy.gpu.device_base64 import DeviceBase64

    vit = GlmVit.from_pretrained(tiny_ckpt, backend="cupy")
    rng = np.random.default_rng(0)
    small = DeviceBase64(vit.tower.current, chunk=3000)
    for n in [*range(0, 10), 2999, 3000, 3001, 5999, 6000, 6001, 12345]:
        data = rng.integers(0, 256, n, dtype=np.uint8)
        assert small.encode(data).tobytes() == base64.b64encode(data.tobytes()), n
    rows = rng.standard_normal((173, 256)).astype(np.float32)
    bf16 = (rows.view(np.uint32) >> 16).astype(np.uint16)  # BF16 as the server holds it: its bits
    whole = DeviceBase64(vit.tower.current)
    assert in_fresh_thread(lambda: whole.encode(bf16)).tobytes() == base64.b64encode(bf16.tobytes())
    assert whole.encode(rows).tobytes() == base64.b64encode(rows.tobytes())
    slot = np.full(8000, 0xFF, np.uint8)  # an answer area of the server's (handoff.py): the text at its start
    text = small.encode(rows[:5], out=slot)  # 5,120 bytes: two chunks
    assert np.shares_memory(text, slot) and text.tobytes() == base64.b64encode(rows[:5].tobytes())
    assert (slot[text.size:] == 0xFF).all()


def test_device_base64_lanes_encode_at_once_each_answer_its_own(tiny_ckpt):
    """64 answers of different lengths from 16 threads on 2 lanes (a 3,000-byte chunk: several round
    trips each, the lanes taken and given back many times): every text is its own array's, none mixed
    with another's; no lane is refused in one line."""
    import base64

    from glmvit_cupy.gpu.device_base64 import DeviceBase64

    vit = GlmVit.from_pretrained(tiny_ckpt, backend="cupy")
    with pytest.raises(ValueError, match="lanes 0: must be at least 1"):
        DeviceBase64(vit.tower.current, lanes=0)
    encoder = DeviceBase64(vit.tower.current, chunk=3000, lanes=2)
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1, 20_000, 64)]
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(encoder.encode, arrays))
    for i, (array, text) in enumerate(zip(arrays, texts)):
        assert text.tobytes() == base64.b64encode(array.tobytes()), i


def test_a_gpu_servers_base64_answer_is_its_raw_answer(tiny_ckpt):
    """`glmvit-cupy serve` on the GPU: the base64 in a /v1/embeddings answer (made by device_base64)
    decodes to the bytes /embed answers for the same image (safetensors, the same engine and grid)."""
    import base64
    import io

    httpx = pytest.importorskip("httpx", reason="the [serve] extra is not installed")
    pytest.importorskip("starlette", reason="the [serve] extra is not installed")
    import safetensors
    from PIL import Image

    from serving import ServerProcess

    out = io.BytesIO()
    Image.fromarray(photo_like(200, 300, seed=5)).save(out, "PNG")
    image = out.getvalue()
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "cupy", "--cache-bytes", "0", ready_s=300) as server:
        body = {"input": ["data:image/png;base64," + base64.b64encode(image).decode()], "encoding_format": "base64",
                "output": "both", "dtype": "float32"}
        got = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=120).json()["data"][0]
        raw = dict(safetensors.deserialize(httpx.post(f"{server.url}/embed?output=both&dtype=float32", content=image,
                                                      timeout=120).content))
    for name in ("pooler_output", "last_hidden_state"):
        assert base64.b64decode(got["embedding"][name]) == bytes(raw[name]["data"]), name
    assert "Traceback" not in server.log()
