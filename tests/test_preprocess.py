"""Preprocessing equals transformers' Glm5NextImageProcessorPil (the oracle) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVitError, preprocess
from helpers import photo_like

oracle_module = pytest.importorskip("transformers.models.glm5_next.image_processing_pil_glm5_next")


def oracle(images, **kwargs):
    out = oracle_module.Glm5NextImageProcessorPil()(images=images, return_tensors="np", **kwargs)
    return out["pixel_values"], out["image_grid_thw"]


def assert_matches(images, **kwargs):
    ref_pixels, ref_grid = oracle(images, **kwargs)
    pixels, grid = preprocess(images, **kwargs)
    assert pixels.dtype == np.float32 and grid.dtype == np.int64
    assert pixels.shape == ref_pixels.shape and np.array_equal(grid, ref_grid)
    assert np.array_equal(pixels.view(np.uint32), ref_pixels.view(np.uint32))  # bit for bit


def rgb(h, w, seed=0):
    return Image.fromarray(photo_like(h, w, seed))


@pytest.mark.parametrize("h, w", [
    (5, 7),            # below min_image_tokens: the enlarging path
    (28, 28),          # exactly one aligned block
    (448, 448),
    (1, 2000), (2000, 7),   # extreme aspect ratios
    (3000, 2500),      # beyond the 8000-token budget: the binary search
    (333, 517),        # content smaller than the canvas: zero padding
])
def test_sizes(h, w):
    assert_matches([rgb(h, w, seed=h + w)])


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L", "CMYK", "I;16", "P+transparency"])
def test_modes(mode):
    base = rgb(61, 83, seed=3)
    if mode == "I;16":
        image = Image.fromarray(np.random.default_rng(0).integers(0, 65535, (61, 83), dtype=np.uint16))
        assert image.mode == "I;16"
    elif mode == "P+transparency":
        image = base.convert("P")
        image.info["transparency"] = 7
    elif mode in ("RGBA", "LA"):
        image = base.convert(mode)
        alpha = np.random.default_rng(1).integers(0, 256, (61, 83), dtype=np.uint8)
        image.putalpha(Image.fromarray(alpha))
    else:
        image = base.convert(mode)
    assert_matches([image])


def test_several_images_in_one_call():
    assert_matches([rgb(448, 448, 1), rgb(20, 300, 2), rgb(1000, 800, 3), rgb(3, 3, 4)])


@pytest.mark.parametrize("tokens", [dict(min_image_tokens=64), dict(max_image_tokens=256),
                                    dict(min_image_tokens=4, max_image_tokens=100)])
def test_token_budget_parameters(tokens):
    assert_matches([rgb(640, 480, 5), rgb(9, 11, 6)], **tokens)


def test_array_input_equals_pil_input():
    arr = photo_like(120, 90, seed=9)
    a, ga = preprocess(arr)
    b, gb = preprocess(Image.fromarray(arr))
    assert np.array_equal(a, b) and np.array_equal(ga, gb)


def test_file_input(tmp_path):
    arr = photo_like(100, 150, seed=10)
    Image.fromarray(arr).save(tmp_path / "x.png")
    a, _ = preprocess(tmp_path / "x.png")
    b, _ = preprocess(arr)
    assert np.array_equal(a, b)


def test_bad_inputs_name_the_culprit(tmp_path):
    with pytest.raises(GlmVitError, match="nope.png: no such image file"):
        preprocess(tmp_path / "nope.png")
    (tmp_path / "junk.png").write_bytes(b"this is not an image")
    with pytest.raises(GlmVitError, match="junk.png: not an image PIL can decode"):
        preprocess(tmp_path / "junk.png")
    Image.fromarray(photo_like(200, 200)).save(tmp_path / "full.png")
    blob = (tmp_path / "full.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(blob[:len(blob) // 2])
    with pytest.raises(GlmVitError, match="cut.png: cannot decode image"):
        preprocess(tmp_path / "cut.png")
    with pytest.raises(GlmVitError, match=r"shape \[4, 4\] and dtype float64"):
        preprocess(np.zeros((4, 4)))
    with pytest.raises(GlmVitError, match="no images"):
        preprocess([])
