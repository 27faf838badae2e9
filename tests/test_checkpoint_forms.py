"""Every form transformers saves a checkpoint in binds, and gives transformers' own result: the vision model
saved alone (bare names), the full model (model.visual.*), the bare Glm5NextModel (visual.*),
each in one file or sharded, with a vision-only or a full-model config.json."""

from __future__ import annotations

import json

import pytest

from glmvit_cupy import GlmVit, preprocess
from glmvit_cupy.tower.checkpoint import INDEX_FILE, SINGLE_FILE, locate_tower
from glmvit_cupy.tower.weights import tensor_count
from helpers import photo_like, rel_err, run_transformers, save_with_transformers

pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

PREFIX = {"vision": "", "full": "model.visual", "model": "visual"}
MODEL_TYPE = {"vision": "glm5_next_vision", "full": "glm5_next", "model": "glm5_next"}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("kind", ["vision", "full", "model"])
def test_saved_by_transformers_binds_and_matches(tmp_path, kind, sharded):
    oracle = save_with_transformers(tmp_path / "m", kind, sharded, seed=len(kind) + sharded)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == MODEL_TYPE[kind]
    assert (tmp_path / "m" / (INDEX_FILE if sharded else SINGLE_FILE)).is_file()
    loc = locate_tower(tmp_path / "m")
    assert loc.prefix == PREFIX[kind] and len(loc.entries) == tensor_count(loc.geometry)
    if sharded:
        assert len(loc.shards) > 1
    pixels, grid = preprocess([photo_like(90, 130, 1), photo_like(40, 40, 2)])
    ours = GlmVit.from_pretrained(tmp_path / "m", backend="numpy").forward(pixels, grid)
    for name, ref in zip(("last_hidden_state", "pooler_output"), run_transformers(oracle, pixels, grid)):
        assert rel_err(getattr(ours, name), ref) <= 1e-5, (name, rel_err(getattr(ours, name), ref))
