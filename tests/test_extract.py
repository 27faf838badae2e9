"""`extract`: the tower as a vision-only checkpoint that transformers loads with the same
outputs as from the source, and we bind too; only the tower's bytes read; nothing half-written
on any failure, a full disk included."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from glmvit_cupy import GlmVit, preprocess
from glmvit_cupy.extract import extract_tower
from glmvit_cupy.processor.preprocess import PREPROCESSOR_FILE
from glmvit_cupy.tower.checkpoint import bind_checkpoint, locate_tower
from glmvit_cupy.tower.synthetic import write_checkpoint
from glmvit_cupy.tower.weights import tensor_count
from helpers import photo_like, run_transformers, save_with_transformers
from test_checkpoint import _rchar
from test_cli import assert_clean_failure, run
from test_outputs import cli, one_line_failure

pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")


def stored(path):
    """name -> (dtype, on-disk shape) of every tensor in a checkpoint directory."""
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, "np") as f:
            out.update({n: (f.get_slice(n).get_dtype(), f.get_slice(n).get_shape()) for n in f.keys()})
    return out


def test_transformers_loads_the_result_with_the_sources_outputs(tmp_path):
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    src, dst = tmp_path / "full", tmp_path / "vision"
    source_tower = save_with_transformers(src, "full", sharded=True, seed=9)
    (src / PREPROCESSOR_FILE).write_text(json.dumps({"max_image_tokens": 77, "resample": 2}))
    done = extract_tower(src, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", PREPROCESSOR_FILE]
    assert done.files == ["config.json", "model.safetensors", PREPROCESSOR_FILE]
    assert json.loads((dst / "config.json").read_text())["model_type"] == "glm5_next_vision"
    assert (dst / PREPROCESSOR_FILE).read_bytes() == (src / PREPROCESSOR_FILE).read_bytes()
    # The bare names, the source's on-disk shapes and dtype.
    source = {k[len("model.visual."):]: v for k, v in stored(src).items() if k.startswith("model.visual.")}
    assert stored(dst) == source and len(source) == tensor_count(locate_tower(dst).geometry)

    pixels, grid = preprocess([photo_like(90, 60, 3), photo_like(30, 50, 4)])
    theirs = run_transformers(Glm5NextVisionModel.from_pretrained(dst).float().eval(), pixels, grid)
    for a, b in zip(theirs, run_transformers(source_tower, pixels, grid)):
        assert np.array_equal(a, b)
    ours, original = (GlmVit.from_pretrained(p, backend="numpy") for p in (dst, src))
    assert ours.processor == original.processor and ours.processor.max_image_tokens == 77
    assert np.array_equal(ours.forward(pixels, grid).pooler_output, original.forward(pixels, grid).pooler_output)
    assert locate_tower(dst).prefix == "" and bind_checkpoint(dst).bytes_read == bind_checkpoint(src).bytes_read


def test_only_the_towers_bytes_are_read(tmp_path):
    src = write_checkpoint(tmp_path / "src", "tiny", seed=12, decoy_bytes=32 << 20)
    (src / "model-00003-of-00003.safetensors").unlink()  # text stack only: never opened
    before = _rchar()
    done = extract_tower(src, tmp_path / "dst")
    read = _rchar() - before
    assert done.bytes_read == done.location.tower_bytes <= read < done.location.tower_bytes + (1 << 20)
    assert not (tmp_path / "dst" / PREPROCESSOR_FILE).exists()


# Bytes a file may hold: config.json fails at its first write; the safetensors file in its header; mid-tower.
@pytest.mark.parametrize("limit", [0, 2048, 512 << 10], ids=["config", "header", "mid-tensors"])
def test_a_full_disk_leaves_nothing_behind(tmp_path, tiny_ckpt, limit):
    proc = cli("extract", str(tiny_ckpt), str(tmp_path / "dst"), file_limit=limit)
    one_line_failure(proc, "dst: writing failed (File too large); nothing was left behind")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_destination_is_refused_untouched(tmp_path, tiny_ckpt):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("precious")
    assert_clean_failure(run("extract", str(tiny_ckpt), str(tmp_path / "dst")), "exists; refusing")
    assert_clean_failure(run("extract", str(tiny_ckpt), str(tmp_path / "no" / "dst")), "does not exist")
    assert [p.name for p in tmp_path.iterdir()] == ["dst"] and (tmp_path / "dst" / "keep.txt").read_text() == "precious"
    proc = run("extract", str(tiny_ckpt), str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    assert "39 BF16 tensors" in proc.stdout
    assert (tmp_path / "out").stat().st_mode & 0o777 == (tmp_path / "dst").stat().st_mode & 0o777


def test_from_a_cached_repo_id(tmp_path, monkeypatch, tiny_ckpt):
    from test_hub import REPO, cache_repo

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    cache_repo(cache, REPO, tiny_ckpt, "c" * 40, files=["config.json", "model.safetensors.index.json",
                                                         "model-00001-of-00003.safetensors",
                                                         "model-00002-of-00003.safetensors"])
    done = extract_tower(REPO, tmp_path / "dst")
    assert done.source == cache / "models--zai-org--GLM-5.3-Flash" / "snapshots" / ("c" * 40)
    a, b = bind_checkpoint(tmp_path / "dst"), bind_checkpoint(tiny_ckpt)
    assert all(np.array_equal(a.raw(n), b.raw(n)) for n in b.location.entries)
