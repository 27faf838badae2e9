"""glmvit_cupy.ray on a local Ray cluster (NumPy backend, tiny checkpoint): rows of bytes and of
paths come back with what `encode` writes, and examples/ray_embed.py, joining the cluster as a
second host would, writes parts that read as one collection equal to `encode`'s output directory
and resumes; on a GPU (marked `gpu`), actors sharing it cap CuPy's pool at their share and give
the engine's bits. CI installs the [ray] extra; a machine without it skips this file."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")

from glmvit_cupy.model import gpu_available  # noqa: E402
from glmvit_cupy.ray import GlmVitEmbedder, parts  # noqa: E402
from glmvit_cupy.shards import read_embeddings, read_records, record_key  # noqa: E402
from helpers import rel_err  # noqa: E402
from test_pipeline import make_images, run  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ray_embed.py"
TOLERANCE = 1e-5  # float32 outputs of other batches of the same images (test_pipeline's batched vs alone)


@pytest.fixture(scope="module")
def cluster():
    gpus = 1 if gpu_available()[0] else 0  # GPU actors share one GPU (the gpu test below)
    ray.init(num_cpus=2 + 2 * gpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def encoded(images: list[str], model: Path, out: Path) -> dict[str, tuple[dict, dict]]:
    proc = run("encode", *images, "--model", str(model), "--out-dir", str(out), "--backend", "numpy",
               "--dtype", "float32", "--workers", "1", "--quiet")
    assert proc.returncode in (0, 1), proc.stderr  # 1: an input failed, as some tests mean
    return {record_key(r): (r, a) for r, a in read_embeddings(out)}


def same_record(ours: dict, theirs: dict) -> bool:
    return {k: v for k, v in ours.items() if k != "rows"} == {k: v for k, v in theirs.items() if k != "rows"}


def test_rows_of_bytes_come_back_as_encode_writes_them(tmp_path, tiny_ckpt, cluster):
    paths = make_images(tmp_path / "img", 6, seed=10)
    ds = ray.data.read_binary_files(str(tmp_path / "img"), include_paths=True)  # rows: bytes, path
    rows = ds.map_batches(GlmVitEmbedder, fn_constructor_kwargs={"model": str(tiny_ckpt), "backend": "numpy",
                                                                 "dtype": "float32"},
                          compute=ray.data.ActorPoolStrategy(size=1), batch_size=4).take_all()
    want = encoded([str(p) for p in paths], tiny_ckpt, tmp_path / "out")
    assert sorted(r["path"] for r in rows) == sorted(want)
    for row in rows:
        record, arrays = want[row["path"]]
        assert row["error"] == "" and row["sha256"] == record["sha256"] and row["nbytes"] == record["bytes"]
        assert row["grid_thw"].tolist() == record["grid_thw"] and row["member"] is None
        assert row["pooler_output"].dtype == np.float32
        assert rel_err(row["pooler_output"], arrays["pooler_output"]) <= TOLERANCE


def test_example_writes_one_collection_and_resumes(tmp_path, tiny_ckpt, cluster):
    folder = make_images(tmp_path / "img", 7, seed=11)
    shard = tmp_path / "data-000.tar"
    with tarfile.open(shard, "w") as tar:
        for i, path in enumerate(make_images(tmp_path / "tar", 5, seed=12)):
            tar.add(path, arcname=f"sample{i}/image{path.suffix}")
    (tmp_path / "img" / "junk.png").write_bytes(b"not an image")
    out = tmp_path / "embs"
    base = [sys.executable, str(EXAMPLE), "--model", str(tiny_ckpt), "--out-dir", str(out), "--address", cluster,
            "--gpus-per-actor", "0", "--backend", "numpy", "--dtype", "float32", "--shard-size", "4",
            "--batch-size", "3"]
    first = subprocess.run([*base, str(folder[0]), str(folder[1])], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "ray_embed: embedded 2 of 2" in first.stderr
    second = subprocess.run([*base, "--workers", "2", str(tmp_path / "img"), str(shard)], capture_output=True,
                            text=True)
    assert second.returncode == 0, second.stderr
    assert "Traceback" not in second.stderr, second.stderr  # decode pools closed before Ray ends the actors
    assert "ray_embed: 11 to embed, 2 already in" in second.stderr and "embedded 10 of 11" in second.stderr
    failures = [p / "failures.jsonl" for p in parts(out) if (p / "failures.jsonl").exists()]
    assert len(failures) == 1 and "junk.png: not an image PIL can decode" in failures[0].read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # parts appear whole

    want = encoded([str(tmp_path / "img"), str(shard)], tiny_ckpt, tmp_path / "encoded")
    got = {record_key(r): (r, a) for r, a in read_embeddings(parts(out))}
    assert sorted(got) == sorted(want) and len(list(read_records(parts(out)))) == 12  # one record each
    for key, (record, arrays) in got.items():
        assert same_record(record, want[key][0])
        assert rel_err(arrays["pooler_output"], want[key][1]["pooler_output"]) <= TOLERANCE


class _PoolProbe(GlmVitEmbedder):
    """GlmVitEmbedder adding, to each row, the actor's process and CuPy pool limit as a fraction
    of its GPU."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict:
        import cupy

        rows = super().__call__(batch)
        limit = cupy.get_default_memory_pool().get_limit() / cupy.cuda.Device().mem_info[1]
        rows["pid"], rows["pool_fraction"] = [os.getpid()] * len(rows["path"]), [limit] * len(rows["path"])
        return rows


@pytest.mark.gpu
def test_gpu_actors_sharing_a_gpu_get_half_its_pool_and_the_engines_bits(tmp_path, real_ckpt, cluster):
    """Two actors on one GPU (num_gpus=0.5 each) cap CuPy's pool at half of it and give, a row a
    batch, the bits of the engine in this process encoding each image alone."""
    from glmvit_cupy import GlmVit

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _PoolProbe lives in this test module
    paths = make_images(tmp_path / "img", 8, seed=13)
    ds = ray.data.read_binary_files(str(tmp_path / "img"), include_paths=True)
    rows = ds.map_batches(_PoolProbe, fn_constructor_kwargs={"model": str(real_ckpt), "backend": "cupy", "dtype": "float32"},
                          compute=ray.data.ActorPoolStrategy(size=2), num_gpus=0.5, batch_size=1).take_all()
    assert sorted(r["path"] for r in rows) == sorted(map(str, paths)) and all(r["error"] == "" for r in rows)
    assert {round(r["pool_fraction"], 6) for r in rows} == {0.5}
    print(f"ray: {len(rows)} rows from {len({r['pid'] for r in rows})} actor(s) sharing the GPU")
    vit = GlmVit.from_pretrained(real_ckpt, backend="cupy")
    try:
        for row in rows:
            want = vit.encode(row["path"], dtype="float32")[0].pooler_output
            assert np.array_equal(row["pooler_output"], want), (row["path"], rel_err(row["pooler_output"], want))
    finally:
        vit.close()
