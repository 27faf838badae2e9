"""`encode --devices`: engine processes behind one pipeline (glmvit_cupy/deploy/devices.py), tested on the
CPU with NumPy engine processes: the same output directory as one engine, bit for bit; a SIGKILL
and a resume; the mistakes as one line; no shared memory left behind; the engines' settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glmvit_cupy.collection.shards import read_embeddings
from glmvit_cupy.deploy.devices import EngineGroup
from glmvit_cupy.errors import GlmVitError
from glmvit_cupy.model import gpu_available
from glmvit_cupy.processor.preprocess import processor_config
from test_gpu_faults import CHECK_LAUNCHES_ENV  # faults.py's name (it imports CuPy), checked there
from test_pipeline import CLI, kill_after_two_shards_then_resume, make_images, run

SHM = Path("/dev/shm")


def leftovers() -> list[str]:
    return sorted(p.name for p in SHM.glob(".glmvit-cupy-*")) if SHM.is_dir() else []


def encode_args(images: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return ["encode", str(images), "--model", str(model), "--out-dir", str(out), "--backend", "numpy",
            "--workers", "1", "--shard-size", "5", "--max-pixels", str(300 * 196),
            "--max-image-tokens", "75", "--quiet", *extra]  # 300 patches: several batches of these small images


def test_two_engines_write_what_one_writes(tmp_path, tiny_ckpt):
    make_images(tmp_path / "img", 24, seed=8)
    one, two = tmp_path / "one", tmp_path / "two"
    assert run(*encode_args(tmp_path / "img", one, tiny_ckpt, "--output", "both")).returncode == 0
    before = leftovers()
    proc = run(*encode_args(tmp_path / "img", two, tiny_ckpt, "--output", "both", "--devices", "0,1"))
    assert proc.returncode == 0, proc.stderr
    assert "encoded 24, skipped 0, failed 0" in proc.stderr and "GPU busy n/a (NumPy backend)" in proc.stderr
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir()) and len(names) == 10
    for name in names:  # each image's batch is the same batch: the same bits, the same metadata
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    # the tower and the slots in /dev/shm are unlinked once mapped (a SIGKILLed run's, already there
    # before, may be removed meanwhile: create_temp clears stale ones)
    assert not set(leftovers()) - set(before)


def test_sigkill_then_resume_on_two_engines(tmp_path, tiny_ckpt):
    paths = make_images(tmp_path / "img", 40, seed=9)
    out, alone = tmp_path / "out", tmp_path / "alone"
    args = [*CLI, *encode_args(tmp_path / "img", out, tiny_ckpt, "--devices", "0,1", "--dtype", "float32")]
    kill_after_two_shards_then_resume(args, out, paths, shard_size=5)
    assert run(*encode_args(tmp_path / "img", alone, tiny_ckpt, "--dtype", "float32")).returncode == 0
    want = {r["path"]: a["pooler_output"] for r, a in read_embeddings(alone)}
    for record, arrays in read_embeddings(out):
        assert np.array_equal(arrays["pooler_output"], want[record["path"]])


@pytest.mark.parametrize("spec, message", [
    ("0,0", "--devices '0,0': expected 'all' or distinct device indices such as 0,1"),
    ("one", "--devices 'one': expected 'all' or distinct device indices such as 0,1"),
])
def test_device_lists_are_checked(tmp_path, tiny_ckpt, spec, message):
    make_images(tmp_path / "img", 1)
    proc = run(*encode_args(tmp_path / "img", tmp_path / "out", tiny_ckpt, "--devices", spec))
    assert proc.returncode == 1 and proc.stderr.strip() == f"glmvit-cupy: error: {message}"
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(gpu_available()[0], reason="needs a machine without a usable GPU")
def test_devices_without_a_gpu_is_one_line(tmp_path, tiny_ckpt):
    make_images(tmp_path / "img", 1)
    base = ["encode", str(tmp_path / "img"), "--model", str(tiny_ckpt), "--out-dir", str(tmp_path / "out")]
    every = run(*base, "--devices", "all")
    assert every.returncode == 1 and len(every.stderr.strip().splitlines()) == 1
    assert every.stderr.startswith("glmvit-cupy: error: --devices all: no GPU to run on (")
    first = run(*base, "--devices", "0")
    assert first.returncode == 1 and first.stderr.startswith("glmvit-cupy: error: device 0: backend 'cupy': ")
    assert len(first.stderr.strip().splitlines()) == 1 and "Traceback" not in first.stderr
    assert not (tmp_path / "out").exists() and leftovers() == []


def test_engine_processes_get_the_kernels_and_the_launch_checks_asked_for(tiny_ckpt, monkeypatch):
    """The kernel set goes to each engine in its spec (checked before anything starts); the
    per-launch checks in the environment the spawned engines inherit. The group's stream turn
    refuses what its own stream's thread cannot wait for."""
    processor, _ = processor_config(tiny_ckpt)
    args = (tiny_ckpt, [0, 1], "numpy", 300 * 196, processor, ("pooler_output",), "float32")
    with pytest.raises(GlmVitError, match=r"^kernels 'sm80': expected one of auto, generic, hopper$"):
        EngineGroup(*args, kernels="sm80")
    monkeypatch.setenv(CHECK_LAUNCHES_ENV, "1")
    group = EngineGroup(*args, kernels="generic")
    try:
        assert group.engine_settings == [("numpy", "", False)] * 2  # a GPU engine names its set (gpu test)
        for engine in group._engines:
            environ = Path(f"/proc/{engine.process.pid}/environ").read_bytes().split(b"\0")
            assert f"{CHECK_LAUNCHES_ENV}=1".encode() in environ
        with group.stream_turn():
            with pytest.raises(GlmVitError, match="^close called inside a stream of the same engine group: finish or close that loop first$"):
                group.close()
    finally:
        group.close()
    assert group._engines == []


def test_the_main_process_imports_neither_cupy_nor_ray():
    """CuPy starts only in engine processes, once their device is chosen; Ray only where
    glmvit_cupy.deploy.ray is imported (the optional extra)."""
    code = ("import sys, cli, glmvit_cupy, glmvit_cupy.deploy.devices, glmvit_cupy.collection.pipeline, "
            "glmvit_cupy.collection.shards\n"
            "print(sorted(m for m in ('cupy', 'ray') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_a_batch_over_the_engines_budget_is_refused_and_the_group_goes_on(tiny_ckpt):
    """EngineGroup.submit holds its engines' p_max (no slot holds more): over it, the one budget
    refusal (geometry.check_patch_budget) before anything is written; the next batch runs."""
    processor, _ = processor_config(tiny_ckpt)
    group = EngineGroup(tiny_ckpt, [0], "numpy", 64 * 196, processor, ("pooler_output",), "float32")
    try:
        big = np.zeros((280, 280, 3), np.uint8)  # 400 patches
        with pytest.raises(GlmVitError) as info:
            group.submit([big], np.array([[1, 20, 20]]), ("pooler_output",), "float32")
        assert str(info.value) == ("this batch: 400 patches exceed p_max 64 (max_pixels 12544); raise max_pixels to at "
                                   "least 78400 (--max-pixels, or GlmVit.from_pretrained(max_pixels=...))")
        small = np.zeros((112, 112, 3), np.uint8)  # 64 patches: exactly the budget
        done = group.submit([small], np.array([[1, 8, 8]]), ("pooler_output",), "float32")
        assert done.result()["pooler_output"].shape == (16, 256) and done.finite.all()
    finally:
        group.close()
