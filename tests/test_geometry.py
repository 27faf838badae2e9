"""GlmVitGeometry: config.json in both forms, the real defaults, and the refusals."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from glmvit_cupy import GlmVitError, load_geometry
from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry, patch_budget, vision_config
from glmvit_cupy.tower.layout import block_major_positions, frame_segments, rope_inv_freq


def write_config(tmp_path, config) -> object:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_real_geometry_facts():
    geo = GlmVitGeometry(**REAL)
    assert geo.head_dim == 64
    assert geo.patch_dim == 1176  # 3 x 2 x 14^2
    assert patch_budget(geo) == 32000  # 8000 merged tokens of 2x2 patches


def test_absent_fields_take_the_released_values_not_transformers_defaults(tmp_path):
    geo = load_geometry(write_config(tmp_path, {"model_type": "glm5_next", "vision_config": {}}))
    assert geo == GlmVitGeometry(**REAL)
    assert geo.out_hidden_size == 4096  # transformers' Glm5NextVisionConfig() says 1536


@pytest.mark.parametrize("form", ["full", "vision-only"])
def test_both_config_forms(tmp_path, form):
    geo = dataclasses.replace(GlmVitGeometry(**REAL), depth=3, out_hidden_size=512, rope_theta=500.0)
    vision = vision_config(geo)
    config = vision if form == "vision-only" else {"model_type": "glm5_next", "vision_config": vision}
    assert load_geometry(write_config(tmp_path, config)) == geo


def test_aliases_and_rope_theta_from_rope_parameters(tmp_path):
    config = {"model_type": "glm5_next_vision", "num_hidden_layers": 5, "num_attention_heads": 8,
              "rope_parameters": {"rope_type": "axial", "rope_theta": 1234.0}, "patch_size": [14, 14]}
    geo = load_geometry(write_config(tmp_path, config))
    assert (geo.depth, geo.num_heads, geo.rope_theta, geo.patch_size) == (5, 8, 1234.0, 14)


@pytest.mark.parametrize("change, words", [
    (dict(num_heads=12), ["hidden_size 1024", "num_heads 12"]),
    (dict(num_heads=0), ["num_heads 0"]),
    (dict(hidden_size=1032, num_heads=12), ["head_dim 86", "multiple of 4"]),
    (dict(spatial_merge_size=3), ["spatial_merge_size 3"]),
    (dict(patch_size=0), ["patch_size 0"]),
    (dict(temporal_patch_size=0), ["temporal_patch_size 0"]),
    (dict(depth=0), ["depth 0"]),
])
def test_constructor_refuses_bad_geometry_naming_the_numbers(change, words):
    with pytest.raises(GlmVitError) as err:
        GlmVitGeometry(**{**REAL, **change})
    for word in words:
        assert word in str(err.value)


def test_bad_geometry_in_config_names_the_file(tmp_path):
    path = write_config(tmp_path, {"model_type": "glm5_next_vision", "spatial_merge_size": 4})
    with pytest.raises(GlmVitError, match=r"config\.json.*spatial_merge_size 4"):
        load_geometry(path)


@pytest.mark.parametrize("config, match", [
    ({"model_type": "glm5_next", "hidden_size": 4096}, "text-only"),
    ({"model_type": "glm5_next_text"}, "text-only"),
    ({"model_type": "llama", "hidden_size": 4096}, "'llama' is not a GLM-5.3 model"),
    ({"model_type": "glm5_next_vision", "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "glm5_next_vision", "rope_parameters": {"rope_type": "default"}}, "rope_type 'default'"),
    ([1, 2], "not an object"),
])
def test_refused_configs(tmp_path, config, match):
    with pytest.raises(GlmVitError, match=match):
        load_geometry(write_config(tmp_path, config))


def test_missing_and_corrupt_config(tmp_path):
    with pytest.raises(GlmVitError, match="no config.json"):
        load_geometry(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(GlmVitError, match="cannot read config.json"):
        load_geometry(tmp_path)


def test_max_pixels_sizes_p_max():
    assert patch_budget(GlmVitGeometry(**REAL), 448 * 448 * 32) == 32 * 1024
    assert patch_budget(GlmVitGeometry(**REAL), 5 * 196 + 195) == 4  # whole merged tokens only
    with pytest.raises(GlmVitError, match="max_pixels 500"):
        patch_budget(GlmVitGeometry(**REAL), 500)
    assert patch_budget(GlmVitGeometry(**REAL), None, 9000) == 36000  # the default: the processor's largest image


def test_rope_inv_freq_matches_the_reference_formula():
    f = rope_inv_freq(GlmVitGeometry(**REAL))
    assert f.dtype == np.float32 and len(f) == 16
    assert f[0] == 1.0
    assert abs(f[15] - 10000.0 ** (-30 / 32)) < 1e-9


def test_block_major_positions_and_segments():
    grid = np.array([[1, 2, 4], [2, 2, 2]])
    pos = block_major_positions(grid, 2)
    # image 0: blocks (0,0) then (0,1), each 2x2 block's patches consecutive, row-major inside
    assert pos[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert pos[8:].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]] * 2  # repeated for t = 2
    assert frame_segments(grid).tolist() == [[0, 8], [8, 4], [12, 4]]
