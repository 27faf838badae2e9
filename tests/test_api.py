"""The Python API under bad input: wrong argument types, decompression bombs, outputs that are
not finite, and one GlmVit shared by threads. Each refusal is one GlmVitError line."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit, GlmVitError, preprocess
from glmvit_cupy.collection.pipeline import stream
from glmvit_cupy.processor.preprocess import load_rgb
from glmvit_cupy.tower.checkpoint import bind_checkpoint, locate_tower
from glmvit_cupy.tower.synthetic import write_checkpoint
from helpers import bomb_png, photo_like


@pytest.fixture(scope="module")
def vit(tiny_ckpt) -> GlmVit:
    return GlmVit.from_pretrained(tiny_ckpt, backend="numpy")


def one_line(info: pytest.ExceptionInfo) -> str:
    text = str(info.value)
    assert text and "\n" not in text
    return text


PIXELS = np.zeros((4, 1176), np.float32)
WRONG_CALLS = {
    # call: message regex
    "encode(5)": (lambda v: v.encode(5), r"cannot encode a int"),
    "encode(None)": (lambda v: v.encode(None), r"cannot encode a NoneType"),
    "encode(b'...')": (lambda v: v.encode(b"\x89PNG"), r"image 0: not an image PIL can decode"),
    "encode([image, 3.5])": (lambda v: v.encode([photo_like(28, 28), 3.5]), r"cannot encode a float"),
    "encode(float image)": (lambda v: v.encode(photo_like(28, 28).astype(np.float32)),
                            r"dtype float32, expected HxWx3 uint8"),
    "encode(min_image_tokens='16')": (lambda v: v.encode(photo_like(28, 28), min_image_tokens="16"),
                                      r"min_image_tokens '16' must be a positive integer"),
    "encode(max_image_tokens=1.5)": (lambda v: v.encode(photo_like(28, 28), max_image_tokens=1.5),
                                     r"max_image_tokens 1\.5 must be a positive integer"),
    "forward(list, grid)": (lambda v: v.forward(PIXELS.tolist(), [[1, 2, 2]]),
                            r"pixel_values is a list, expected a NumPy float array"),
    "forward(None, grid)": (lambda v: v.forward(None, [[1, 2, 2]]), r"pixel_values is a NoneType"),
    "forward(uint8 pixels)": (lambda v: v.forward(PIXELS.astype(np.uint8), [[1, 2, 2]]),
                              r"pixel_values has dtype uint8, expected float32"),
    "forward(object pixels)": (lambda v: v.forward(PIXELS.astype(object), [[1, 2, 2]]), r"dtype object"),
    "forward(pixels, ragged grid)": (lambda v: v.forward(PIXELS, [[1, 2, 2], [1]]),
                                     r"grid_thw is not an integer array"),
    "forward(pixels, float grid)": (lambda v: v.forward(PIXELS, [[1.0, 2.0, 2.0]]), r"grid_thw has dtype float64"),
    "forward(pixels, None)": (lambda v: v.forward(PIXELS, None), r"grid_thw has shape \[\]"),
    "preprocess(5)": (lambda v: preprocess(5), r"cannot encode a int"),
    "preprocess(patch_size='14')": (lambda v: preprocess(photo_like(28, 28), patch_size="14"),
                                    r"patch_size '14' must be a positive integer"),
    "from_pretrained(5)": (lambda v: GlmVit.from_pretrained(5), r"path is a int, expected a checkpoint directory"),
    "from_pretrained(max_pixels='1e6')": (lambda v: GlmVit.from_pretrained("x", max_pixels="1e6"),
                                          r"max_pixels is a str"),
    "from_pretrained(max_pixels=1e6)": (lambda v: GlmVit.from_pretrained("x", max_pixels=1e6),
                                        r"max_pixels is a float"),
    "from_pretrained(device='0')": (lambda v: GlmVit.from_pretrained("x", device="0"), r"device is a str"),
    "from_pretrained(attention=1)": (lambda v: GlmVit.from_pretrained("x", attention=1), r"attention is a int"),
    "from_pretrained(kernels='sm80')": (lambda v: GlmVit.from_pretrained("x", kernels="sm80"),
                                        r"kernels 'sm80': expected one of auto, generic, hopper"),
    "from_weights(path)": (lambda v: GlmVit.from_weights("ckpt/", "numpy"), r"weights is a str, expected TowerWeights"),
}


@pytest.mark.parametrize("call", list(WRONG_CALLS))
def test_a_wrong_argument_type_is_one_line(vit, call):
    run, message = WRONG_CALLS[call]
    with pytest.raises(GlmVitError, match=message) as info:
        run(vit)
    one_line(info)


def test_a_decompression_bomb_is_refused_by_name(tmp_path, monkeypatch):
    """Over twice PIL's MAX_IMAGE_PIXELS PIL raises; over it, PIL only warns and would decode
    ~1 GB: both are one line naming the file, its pixel count and the limit to change."""
    bomb = bomb_png(tmp_path / "bomb.png", 30000, 30000)  # 900 M pixels in 100 bytes
    with pytest.raises(GlmVitError, match=r"bomb\.png: 900,000,000 pixels, over PIL's decompression-bomb "
                                          r"limit of 89,478,485 \(PIL\.Image\.MAX_IMAGE_PIXELS\)") as info:
        load_rgb(bomb)
    one_line(info)
    big = bomb_png(tmp_path / "big.png", 10000, 10000)  # between the limit and twice it: PIL's warning
    with pytest.raises(GlmVitError, match=r"big\.png: 100,000,000 pixels"):
        load_rgb(big)
    # The limit is PIL's own: lowering it refuses a real photo; lifting it (None) lets it through.
    photo = tmp_path / "photo.png"
    Image.fromarray(photo_like(60, 50)).save(photo)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)
    with pytest.raises(GlmVitError, match=r"photo\.png: 3,000 pixels, over PIL's decompression-bomb limit of 2,000"):
        load_rgb(photo)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert load_rgb(photo).size == (50, 60)


def test_a_non_finite_forward_output_is_refused_naming_the_image(vit):
    """Non-finite pixel values in the second image of a call: refused, naming that image."""
    pixels, grid = preprocess([photo_like(56, 56, 1), photo_like(56, 84, 2), photo_like(28, 28, 3)])
    assert grid[1].tolist() == [1, 8, 10]
    assert np.isfinite(vit.forward(pixels, grid).pooler_output).all()
    bad = pixels.copy()
    bad[int(grid[0].prod()) + 5, 100] = np.nan  # a patch of image 1
    with pytest.raises(GlmVitError, match=r"image 1 of this forward call \(grid_thw 1x8x10\): its embedding "
                                          r"holds NaN/Inf;") as info, np.errstate(invalid="ignore"):
        vit.forward(bad, grid)
    one_line(info)
    bad[-1, 0] = np.inf
    with pytest.raises(GlmVitError, match=r"image 1 .* \(so does the output of 1 more image\(s\)\)"), \
            np.errstate(invalid="ignore"):
        vit.forward(bad, grid)


def test_encode_names_the_file_whose_embedding_overflows(tmp_path):
    """Finite weights, but one so large (BF16's largest) that a white image overflows float32 in
    the patch embedding while a mid-grey one (normalised to ~0 there) does not: encode refuses,
    naming the white image's file."""
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=13, export="vision-only")
    entry = locate_tower(ckpt).entries["patch_embed.proj.weight"]
    with open(entry.shard, "r+b") as f:
        f.seek(entry.offset)  # [0, 0]: hidden channel 0 x the red value of each patch's first pixel
        f.write(np.uint16(0x7F7F).tobytes())
    grey, white = tmp_path / "grey.png", tmp_path / "white.png"
    Image.new("RGB", (56, 56), (123, 117, 104)).save(grey)  # ~ the CLIP mean
    Image.new("RGB", (56, 84), "white").save(white)
    vit = GlmVit.from_weights(bind_checkpoint(ckpt), "numpy")
    assert np.isfinite(vit.encode(grey)[0].pooler_output).all()
    with pytest.raises(GlmVitError, match=r"white\.png: the embedding has non-finite values") as info, \
            np.errstate(over="ignore", invalid="ignore"):
        vit.encode([grey, white, grey])
    one_line(info)


def threads_get_their_own_results(vit: GlmVit) -> None:
    """8 threads, each encoding its own mix of sizes through one GlmVit (twice over), half of
    them with a token budget of their own (the decode pool is rebuilt for other settings),
    every result bit-equal to a single-threaded run of the same images; forward calls mixed in."""
    from concurrent.futures import ThreadPoolExecutor

    def pooled(job) -> list[np.ndarray]:
        images, budget = job
        if budget == 0:  # a forward call, not encode
            return [vit.forward(*preprocess(images)).pooler_output]
        return [np.asarray(r.pooler_output.get() if hasattr(r.pooler_output, "get") else r.pooler_output)
                for r in vit.encode(images, max_image_tokens=budget)]

    sizes = [(28, 28), (56, 84), (112, 56), (70, 140), (28, 224), (98, 98), (140, 42), (56, 56)]
    jobs = [([photo_like(*sizes[(t + k) % len(sizes)], seed=10 * t + k) for k in range(1 + t % 3)],
             (8000, 20, 0)[t % 3]) for t in range(8)]
    expected = [pooled(images) for images in jobs]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so that races show
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            got = list(pool.map(pooled, jobs + jobs))
    finally:
        sys.setswitchinterval(interval)
    for t, results in enumerate(got):
        want = expected[t % 8]
        assert len(results) == len(want)
        assert all(np.array_equal(a, b) for a, b in zip(results, want)), f"thread {t} got another's result"


def test_encode_inside_an_encode_iter_loop_is_refused(vit):
    """The same thread cannot wait for its own turn: one line instead of a deadlock."""
    images = [photo_like(28, 28, 1), photo_like(56, 28, 2)]
    loop = vit.encode_iter(images, workers=0)
    next(loop)
    with pytest.raises(GlmVitError, match=r"encode called inside an encode_iter loop of the same GlmVit"):
        vit.encode(images[0], workers=0)
    assert len(list(loop)) == 1 and len(vit.encode(images, workers=0)) == 2  # the turn is free again


def test_a_stream_and_close_from_other_threads_wait_for_the_stream_in_flight(vit):
    """pipeline.stream (the CLI's entry) takes the same turn as encode_iter, and close waits for
    it: without the turn, the second stream interleaves batches on the engine's buffers (GPU) and
    shares the decode pool; without close waiting, the pool is shut down under the stream
    ("cannot schedule new futures after shutdown")."""
    images = [photo_like(28 * (1 + i % 3), 28 * (1 + i % 2), i) for i in range(6)]
    want = [o.pooler_output for o in vit.encode(images, workers=1, dtype="float32")]  # stream's dtype
    loop = vit.encode_iter(images, workers=1, dtype="float32")
    first = next(loop)[1].pooler_output
    got: dict[str, list] = {}
    others = [threading.Thread(target=lambda: got.setdefault("stream", [
                  r.arrays["pooler_output"] for r in stream(vit, images, workers=1)]), daemon=True),
              threading.Thread(target=lambda: got.setdefault("close", [vit.close()]), daemon=True)]
    for t in others:
        t.start()
    time.sleep(0.5)
    try:
        assert not got, f"{', '.join(got)} ran in another thread while this stream held the turn"
    finally:
        rest = [o.pooler_output for _, o in loop]  # finishing the loop frees the turn
    for t in others:
        t.join(timeout=120)
    assert all(np.array_equal(a, b) for a, b in zip([first] + rest, want))
    assert all(np.array_equal(a, b) for a, b in zip(got["stream"], want)) and "close" in got
    loop = vit.encode_iter(images, workers=0)
    next(loop)
    with pytest.raises(GlmVitError, match=r"close called inside an encode_iter loop"):
        vit.close()
    loop.close()


def test_threads_sharing_one_glmvit_get_their_own_results(vit):
    """The NumPy forward keeps nothing between calls, so its calls run concurrently (keeping
    per-call state on the tower, e.g. the RoPE tables, fails this test with shape errors);
    encode streams take turns (without, one thread's rebuild of the decode pool shut down
    another's: "cannot schedule new futures after shutdown")."""
    threads_get_their_own_results(vit)


@pytest.mark.gpu
def test_threads_sharing_one_gpu_glmvit_take_turns(tiny_ckpt):
    threads_get_their_own_results(GlmVit.from_pretrained(tiny_ckpt, backend="cupy"))


@pytest.mark.gpu
def test_the_engines_attention_default_is_not_overridden(tmp_path):
    """head_dim 32 has no flash kernel: with no attention asked for, the engine's own default
    ("auto": naive there) holds, and from_pretrained works with the API's default."""
    import dataclasses

    from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry

    geo = dataclasses.replace(GlmVitGeometry(**REAL), depth=1, hidden_size=128, num_heads=4, intermediate_size=256,
                              out_hidden_size=256, projection_intermediate_size=512)
    vit = GlmVit.from_pretrained(write_checkpoint(tmp_path / "t", geo, seed=3), backend="cupy")
    assert geo.head_dim == 32 and vit.tower.attention_kind == "naive"
    pixels, grid = preprocess(photo_like(56, 84, 1))
    assert np.isfinite(vit.forward(pixels, grid).pooler_output.get()).all()


@pytest.mark.gpu
def test_a_non_finite_gpu_output_is_refused_naming_the_image(tiny_ckpt):
    import cupy

    vit = GlmVit.from_pretrained(tiny_ckpt, backend="cupy")
    pixels, grid = preprocess([photo_like(56, 56, 1), photo_like(56, 84, 2)])
    assert np.isfinite(vit.forward(cupy.asarray(pixels), grid).pooler_output.get()).all()
    pixels[int(grid[0].prod()) + 3, 7] = np.nan
    with pytest.raises(GlmVitError, match=r"image 1 of this forward call \(grid_thw 1x8x10\)"):
        vit.forward(cupy.asarray(pixels), grid)
