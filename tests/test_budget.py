"""The patch budget (p_max): its default follows the processor in force, a --max-pixels that
cannot hold the processor's largest image is refused before the tower is read, and an image
that no forward call holds is that image's failure on every path (the NumPy backend holds the
GPU engine's budget too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from glmvit_cupy import GlmVit, GlmVitError, preprocess
from glmvit_cupy.collection.shards import read_embeddings
from glmvit_cupy.processor.preprocess import PREPROCESSOR_FILE
from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry, check_patch_budget
from glmvit_cupy.tower.synthetic import write_checkpoint
from helpers import photo_like, rel_err
from test_pipeline import records, run

# 64 patches a forward call: the 280x280 image (400 patches) fits none, the others fit.
SMALL = 64 * 196
SIZES = {"a.png": (56, 56), "b.png": (280, 280), "c.png": (84, 56)}


def refusal(what: str, patches: int, p_max: int) -> str:
    return (f"{what}: {patches} patches exceed p_max {p_max} (max_pixels {p_max * 196}); raise max_pixels to at least "
            f"{patches * 196} (--max-pixels, or GlmVit.from_pretrained(max_pixels=...))")


def unresized_checkpoint(directory: Path) -> Path:
    """A tiny checkpoint whose processor takes images as they come (do_resize false): nothing
    bounds an image's size but the engine's budget."""
    ckpt = write_checkpoint(directory, "tiny", seed=1)
    (ckpt / PREPROCESSOR_FILE).write_text(json.dumps({"do_resize": False}))
    return ckpt


def write_images(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, (name, (h, w)) in enumerate(SIZES.items()):
        Image.fromarray(photo_like(h, w, seed=i)).save(root / name)
    return root


@pytest.fixture(scope="module")
def unresized(tmp_path_factory) -> Path:
    return unresized_checkpoint(tmp_path_factory.mktemp("ckpt") / "c")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_images(tmp_path_factory.mktemp("img"))


def test_the_refusal_names_the_patches_the_budget_and_how_to_raise_it():
    geo = GlmVitGeometry(**REAL)
    check_patch_budget(geo, 1024, 1024, "a.png")  # exactly full: held
    with pytest.raises(GlmVitError) as info:
        check_patch_budget(geo, 1936, 1024, "a.png")
    assert str(info.value) == refusal("a.png", 1936, 1024)


def test_the_default_budget_follows_the_processor_in_force(tmp_path):
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=1)
    assert GlmVit.from_pretrained(ckpt, backend="numpy").p_max == 32000  # the processor's default, 8000 tokens
    (ckpt / PREPROCESSOR_FILE).write_text(json.dumps({"max_image_tokens": 9000}))
    assert GlmVit.from_pretrained(ckpt, backend="numpy").p_max == 36000
    assert GlmVit.from_pretrained(ckpt, backend="numpy", max_image_tokens=100).p_max == 400  # the option's
    info = run("info", "--model", str(ckpt))
    assert info.returncode == 0 and "36000 patches per forward call" in info.stdout, info.stderr


def test_a_max_pixels_below_the_largest_image_is_refused_before_the_tower_is_read(tmp_path, images):
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=1)
    (ckpt / "model-00002-of-00003.safetensors").unlink()  # reading the tower would fail on this
    args = ["encode", str(images), "--model", str(ckpt), "--out-dir", str(tmp_path / "out"), "--backend", "numpy",
            "--max-pixels", str(SMALL)]
    proc = run(*args)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        "glmvit-cupy: error: " + refusal("one image at the processor's max_image_tokens 8000 (--max-image-tokens "
                                         "lowers it)", 32000, 64)]
    assert not (tmp_path / "out").exists()
    lowered = run(*args, "--max-image-tokens", "16")  # 16 tokens fit 64 patches: on to the checkpoint
    assert lowered.returncode == 1 and "shard listed in the checkpoint is missing" in lowered.stderr


def test_the_numpy_backend_holds_the_gpu_engines_budget(unresized, images):
    vit = GlmVit.from_pretrained(unresized, backend="numpy", max_pixels=SMALL)
    pixels, grid = preprocess(str(images / "b.png"), vit.processor)
    with pytest.raises(GlmVitError) as info:
        vit.forward(pixels, grid)
    assert str(info.value) == refusal("this forward call", 400, 64)
    paths = [str(images / name) for name in SIZES]
    results = vit.encode_iter(paths, workers=0)
    assert next(results)[0] == paths[0]  # the image before it is encoded
    with pytest.raises(GlmVitError) as info:
        next(results)
    assert str(info.value) == refusal(paths[1], 400, 64)


@pytest.mark.parametrize("engines", [[], ["--devices", "0,1"]], ids=["one engine", "two engine processes"])
def test_an_image_over_the_budget_is_that_images_failure(tmp_path, unresized, images, engines):
    out = tmp_path / "out"
    proc = run("encode", str(images), "--model", str(unresized), "--out-dir", str(out), "--backend", "numpy",
               "--max-pixels", str(SMALL), "--workers", "1", "--quiet", "--dtype", "float32", *engines)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "encoded 2, skipped 0, failed 1" in proc.stderr
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert failures == [{"path": str(images / "b.png"), "kind": "image",
                         "error": refusal(str(images / "b.png"), 400, 64)}]
    assert [r["path"] for r in records(out)] == [str(images / "a.png"), str(images / "c.png")]
    alone = GlmVit.from_pretrained(unresized, backend="numpy")
    for record, arrays in read_embeddings(out):
        want = alone.encode(record["path"], dtype="float32")[0].pooler_output
        assert rel_err(arrays["pooler_output"], want) <= 1e-5  # batched vs alone


def test_a_few_images_to_one_file_name_the_one_over_the_budget(tmp_path, unresized, images):
    proc = run("encode", str(images / "a.png"), str(images / "b.png"), "--model", str(unresized), "--out",
               str(tmp_path / "e.npz"), "--backend", "numpy", "--max-pixels", str(SMALL))
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["glmvit-cupy: error: " + refusal(str(images / "b.png"), 400, 64)]
    assert not list(tmp_path.iterdir())


def test_a_budget_whose_pixels_the_gpu_patchify_cannot_address_is_one_line():
    """The GPU stager's patchify.cu takes int32 byte offsets into a batch's uint8 pixels: a p_max past
    2 GiB of them is refused before any buffer is made, naming the bytes and --max-pixels; twice
    the bytes a patch where videos come (two frames)."""
    from glmvit_cupy.collection.staging import check_pixel_bytes
    from glmvit_cupy.processor.preprocess import ProcessorConfig
    from glmvit_cupy.processor.video import VideoConfig

    config = ProcessorConfig()
    largest = (2**31 - 1) // (3 * 14 * 14)
    assert check_pixel_bytes(largest, config, None) == largest * 588
    with pytest.raises(GlmVitError, match=r"^a forward call of 3652184 patches brings 2,147,484,192 bytes of uint8 "
                                          r"pixels, over the 2 GiB .* lower --max-pixels"):
        check_pixel_bytes(largest + 1, config, None)
    with pytest.raises(GlmVitError, match=r"two frames a video patch"):
        check_pixel_bytes(largest // 2 + 1, config, VideoConfig())
