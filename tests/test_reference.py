"""The float32 NumPy reference equals transformers' Glm5NextVisionModel run in float32."""

from __future__ import annotations

import numpy as np
import pytest

from glmvit_cupy import GlmVit, GlmVitError, preprocess
from helpers import photo_like, rel_err, run_transformers, transformers_tower

pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

TOL = 1e-5  # float32 against float32: only summation order differs


def check_parity(ckpt, pixels, grid):
    ours = GlmVit.from_pretrained(ckpt, backend="numpy").forward(pixels, grid)
    theirs = run_transformers(transformers_tower(ckpt), pixels, grid)
    for name, ref in zip(("last_hidden_state", "pooler_output"), theirs):
        got = getattr(ours, name)
        assert got.dtype == np.float32 and got.shape == ref.shape
        assert rel_err(got, ref) <= TOL, (name, rel_err(got, ref))


def test_tiny_three_images_and_a_two_frame_grid(tiny_ckpt):
    """Three photo-like images of different sizes plus a t=2 grid (attention per frame)."""
    pixels, grid = preprocess([photo_like(130, 200, 1), photo_like(64, 64, 2), photo_like(300, 90, 3)])
    video = np.random.default_rng(4).standard_normal((2 * 6 * 4, pixels.shape[1])).astype(np.float32)
    check_parity(tiny_ckpt, np.concatenate([pixels, video]), np.concatenate([grid, [[2, 6, 4]]]))


def test_real_width_depth_two_on_a_448_image(real_width_ckpt):
    pixels, grid = preprocess(photo_like(448, 448, 5))
    assert grid.tolist() == [[1, 32, 32]]
    check_parity(real_width_ckpt, pixels, grid)


def test_encode_returns_one_result_per_image(tiny_ckpt):
    vit = GlmVit.from_pretrained(tiny_ckpt, backend="numpy")
    images = [photo_like(100, 60, 6), photo_like(28, 28, 7)]
    results = vit.encode(images, output="both", dtype="float32")
    pixels, grid = preprocess(images)
    whole = vit.forward(pixels, grid)
    tokens = (grid.prod(axis=1) // 4).tolist()
    assert [r.pooler_output.shape for r in results] == [(n, 256) for n in tokens]
    assert np.array_equal(np.concatenate([r.pooler_output for r in results]), whole.pooler_output)
    assert whole.offsets.tolist() == [0, tokens[0], sum(tokens)]


def test_forward_refuses_mismatched_inputs(tiny_ckpt):
    vit = GlmVit.from_pretrained(tiny_ckpt, backend="numpy")
    with pytest.raises(GlmVitError, match=r"pixel_values has shape \[10, 1176\]; grid_thw needs \[16, 1176\]"):
        vit.forward(np.zeros((10, 1176), np.float32), np.array([[1, 4, 4]]))
    with pytest.raises(GlmVitError, match=r"grid_thw row 0 is \(1, 3, 4\)"):
        vit.forward(np.zeros((12, 1176), np.float32), np.array([[1, 3, 4]]))
