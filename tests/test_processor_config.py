"""A preprocessor_config.json beside the weights is honoured field by field, as transformers'
Glm5NextImageProcessorPil.from_pretrained reads it; options override it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit, GlmVitError, preprocess
from glmvit_cupy.processor.preprocess import FIELDS, PREPROCESSOR_FILE, ProcessorConfig, processor_config
from helpers import photo_like, rel_err, run_transformers, save_with_transformers

oracle_module = pytest.importorskip("transformers.models.glm5_next.image_processing_pil_glm5_next")


def images():
    return [Image.fromarray(photo_like(45, 70, 1)), Image.fromarray(photo_like(300, 190, 2)).convert("RGBA")]


def oracle(model_dir, imgs):
    processor = oracle_module.Glm5NextImageProcessorPil.from_pretrained(model_dir)
    out = processor(images=imgs, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


SETTINGS = [
    *({"resample": r} for r in range(6)),
    {"image_mean": 0.5, "image_std": 0.25},
    {"image_mean": [0.1, 0.2, 0.3], "image_std": [0.9, 0.8, 0.7]},
    {"do_rescale": False},
    {"do_normalize": False},
    {"do_rescale": False, "do_normalize": False},
    {"rescale_factor": 0.005},
    {"min_image_tokens": 64, "max_image_tokens": 90},
    {"do_resize": None, "do_normalize": None, "max_image_tokens": 20},  # a null flag is false
    {"patch_size": 16, "temporal_patch_size": 1},
    {"patch_size": 7, "merge_size": 4, "temporal_patch_size": 3},
    {"do_convert_rgb": False, "size": {"shortest_edge": 3136}, "patch_expand_factor": 2,
     "image_processor_type": "Glm5NextImageProcessorPil"},  # fields its resize never reads
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_each_field_as_transformers_reads_it(tmp_path, settings):
    (tmp_path / PREPROCESSOR_FILE).write_text(json.dumps(settings))
    config, sources = processor_config(tmp_path)
    assert {k for k, v in sources.items() if v == PREPROCESSOR_FILE} == {k for k in settings if k in FIELDS}
    imgs = images() if settings.get("do_resize", True) else [Image.fromarray(photo_like(56, 84, 3))]
    if settings.get("do_convert_rgb") is False:
        imgs = [imgs[0]]  # the tower takes RGB only: an RGBA image is refused (below)
        with pytest.raises(GlmVitError, match="RGBA image with do_convert_rgb false"):
            preprocess(images()[1], config)
    ref_pixels, ref_grid = oracle(tmp_path, imgs)
    pixels, grid = preprocess(imgs, config)
    assert np.array_equal(grid, ref_grid) and pixels.shape == ref_pixels.shape
    assert np.array_equal(pixels.view(np.uint32), ref_pixels.view(np.uint32))  # bit for bit


def test_do_resize_false_takes_an_aligned_image_as_it_is(tmp_path):
    (tmp_path / PREPROCESSOR_FILE).write_text(json.dumps({"do_resize": False}))
    config, _ = processor_config(tmp_path)
    aligned = Image.fromarray(photo_like(56, 84, 3))
    ref_pixels, ref_grid = oracle(tmp_path, [aligned])
    pixels, grid = preprocess(aligned, config)
    assert grid.tolist() == ref_grid.tolist() == [[1, 4, 6]] and np.array_equal(pixels, ref_pixels)
    with pytest.raises(GlmVitError, match="45x70 image with do_resize false"):
        preprocess(Image.fromarray(photo_like(70, 45, 3)), config)


def test_options_override_the_file_and_say_so(tmp_path):
    (tmp_path / PREPROCESSOR_FILE).write_text(json.dumps({"min_image_tokens": 4, "max_image_tokens": 50}))
    config, sources = processor_config(tmp_path, max_image_tokens=70, min_image_tokens=None)
    assert (config.min_image_tokens, config.max_image_tokens) == (4, 70)
    assert sources["min_image_tokens"] == PREPROCESSOR_FILE and sources["max_image_tokens"] == "option"
    assert sources["resample"] == "default"
    assert processor_config(tmp_path / "nowhere") == (ProcessorConfig(), dict.fromkeys(FIELDS, "default"))


@pytest.mark.parametrize("settings, message", [
    ({"resample": 9}, "resample 9 is not a PIL resampling filter"),
    ({"image_mean": [0.5, 0.5]}, r"image_mean \(0.5, 0.5\) must be 3 floats"),
    ({"min_image_tokens": 50, "max_image_tokens": 10}, r"image token budget \[50, 10\] is empty"),
    ({"patch_size": "14"}, "patch_size '14' must be a positive integer"),
])
def test_bad_fields_are_one_line_naming_the_file(tmp_path, settings, message):
    (tmp_path / PREPROCESSOR_FILE).write_text(json.dumps(settings))
    with pytest.raises(GlmVitError, match=f"{PREPROCESSOR_FILE}: processor: {message}"):
        processor_config(tmp_path)


def test_a_null_setting_is_refused_as_transformers_fails_on_it(tmp_path):
    (tmp_path / PREPROCESSOR_FILE).write_text(json.dumps({"image_std": None}))
    with pytest.raises(GlmVitError, match=f"{PREPROCESSOR_FILE}: image_std is null, on which transformers'"):
        processor_config(tmp_path)
    with pytest.raises(ValueError, match="image_mean` and `image_std` must both be specified"):
        oracle(tmp_path, images())


def test_a_model_with_its_own_processor_gives_transformers_result(tmp_path):
    """Tower and processor both off the defaults (16-pixel patches, one temporal slice, a small
    budget, other mean/std and filter): encode equals transformers' processor from the file,
    then transformers' tower."""
    model = tmp_path / "m"
    tower = save_with_transformers(model, "vision", seed=5, vision=dict(patch_size=16, temporal_patch_size=1))
    custom = {"patch_size": 16, "temporal_patch_size": 1, "merge_size": 2, "min_image_tokens": 6,
              "max_image_tokens": 40, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.25],
              "resample": 1, "rescale_factor": 0.0041}
    (model / PREPROCESSOR_FILE).write_text(json.dumps(custom))
    imgs = images()
    ref_pixels, ref_grid = oracle(model, imgs)
    vit = GlmVit.from_pretrained(model, backend="numpy")
    assert vit.processor == processor_config(model)[0] and vit.processor.resample == 1
    results = vit.encode(imgs, output="both", dtype="float32")
    assert np.array_equal(np.concatenate([r.grid_thw for r in results]), ref_grid)
    _, ref_pooler = run_transformers(tower, ref_pixels, ref_grid)
    assert rel_err(np.concatenate([r.pooler_output for r in results]), ref_pooler) <= 1e-5
    # An option overrides the file for the engine too; a processor cutting other patches than the
    # tower embeds is refused up front.
    assert GlmVit.from_pretrained(model, backend="numpy", max_image_tokens=10).processor.max_image_tokens == 10
    with pytest.raises(GlmVitError, match="processor patch_size 14 disagrees with the tower's patch_size 16"):
        GlmVit.from_pretrained(model, backend="numpy", patch_size=14)


def test_info_and_encode_use_the_file_and_the_options(tmp_path):
    from glmvit_cupy.tower.synthetic import write_checkpoint
    from test_cli import run

    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=13, export="vision-only")
    (ckpt / PREPROCESSOR_FILE).write_text(json.dumps({"min_image_tokens": 30, "max_image_tokens": 40, "resample": 0}))
    proc = run("info", "--model", str(ckpt), "--max-image-tokens", "36")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split(None, 1)[1] for line in proc.stdout.splitlines() if line.startswith("  ")}
    assert rows["min_image_tokens"] == "30  [preprocessor_config.json]"
    assert rows["max_image_tokens"] == "36  [option]" and rows["resample"] == "0 (nearest)  [preprocessor_config.json]"
    assert rows["image_std"].endswith("[default]")
    # the image processor's file applies to video too, whose resize is only ever bicubic: said, not fatal
    assert rows["refused"] == (f"{ckpt / PREPROCESSOR_FILE}: video processor: resample 0: only bicubic (3), the "
                               "processor's default, is reproduced for video (images are unaffected; videos are refused)")
    Image.fromarray(photo_like(200, 100, 4)).save(tmp_path / "a.png")
    out = tmp_path / "a.npz"
    proc = run("encode", str(tmp_path / "a.png"), "--model", str(ckpt), "--out", str(out), "--backend", "numpy",
               "--max-image-tokens", "36")
    assert proc.returncode == 0, proc.stderr
    expected = GlmVit.from_pretrained(ckpt, backend="numpy", max_image_tokens=36).encode(tmp_path / "a.png", output="both", dtype="float32")[0]
    assert 30 <= len(expected.pooler_output) <= 36
    assert np.array_equal(np.load(out)["pooler_output"], expected.pooler_output)
