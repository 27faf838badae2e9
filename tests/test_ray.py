"""glmvit_cupy.deploy.ray and examples/ray_embed.py on a local Ray cluster (NumPy backend, tiny checkpoint).

The cluster is Ray's own test utility (ray.cluster_utils.Cluster): a head raylet with 4 CPUs and
no GPU, as a machine without one is; the several-node test adds two raylets that declare one
GPU each (Ray's logical resources: the NumPy backend computes, and the declared GPUs make Ray
place one actor on each node) and removes them after. Every raylet starts with one BLAS thread
(OPENBLAS_NUM_THREADS=1, what Ray gives a one-CPU worker anyway), and `encode` runs with it where
a test holds Ray's bits to encode's: OpenBLAS sums in another order with another thread count.
On a GPU (marked `gpu`), actors sharing it cap CuPy's pool at their share and give the engine's
bits. CI installs the [ray] extra; a machine without it skips this file."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Iterator

import click
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
from ray.cluster_utils import Cluster  # noqa: E402

from glmvit_cupy.collection.shards import read_embeddings, read_records, record_key  # noqa: E402
from glmvit_cupy.collection.sources import expand_inputs  # noqa: E402
from glmvit_cupy.deploy.ray import GlmVitEmbedder, Plan, ShardSink, cluster_plan, embed, parts, rows_of  # noqa: E402
from glmvit_cupy.errors import GlmVitError  # noqa: E402
from glmvit_cupy.model import gpu_available  # noqa: E402
from helpers import BF16_TOLERANCE, TOLERANCE, assert_same_rows, rel_err  # noqa: E402
from test_pipeline import make_images, run  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ray_embed.py"
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """ONE_THREAD in this process's environment, which the raylets started meanwhile (and so
    their workers) inherit."""
    saved = {name: os.environ.get(name) for name in ONE_THREAD}
    os.environ.update(ONE_THREAD)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def cluster():
    with one_blas_thread():
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 1 if gpu_available()[0] else 0,
                                                              "include_dashboard": False})
    ray.init(address=nodes.address, log_to_driver=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def encoded(inputs: list[str], model: Path, out: Path, *options: str, env: dict | None = None) -> dict:
    """`encode --out-dir` of the inputs: {key: (record, arrays)}."""
    proc = run("encode", *inputs, "--model", str(model), "--out-dir", str(out), "--backend", "numpy",
               "--workers", "1", "--quiet", *options, env=None if env is None else {**os.environ, **env})
    assert proc.returncode in (0, 1), proc.stderr  # 1: an input failed, as some tests mean
    return {record_key(r): (r, a) for r, a in read_embeddings(out)}


def collection(root: Path) -> tuple[list[str], Path]:
    """7 files (one not an image) and a tar shard of 5: the inputs, and the junk file."""
    make_images(root / "img", 6, seed=11)
    with tarfile.open(root / "data-000.tar", "w") as tar:
        for i, path in enumerate(make_images(root / "tar", 5, seed=12)):
            tar.add(path, arcname=f"sample{i}/image{path.suffix}")
    junk = root / "img" / "junk.png"
    junk.write_bytes(b"not an image")
    return [str(root / "img"), str(root / "data-000.tar")], junk


def same_record(ours: dict, theirs: dict) -> bool:
    return {k: v for k, v in ours.items() if k != "rows"} == {k: v for k, v in theirs.items() if k != "rows"}


def example(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout)


def test_the_example_with_its_defaults_on_a_cluster_without_gpus_is_encode(tmp_path, tiny_ckpt, cluster):
    """The example with its defaults for actors, GPUs and backend, on a cluster without GPUs: CPU
    actors on the NumPy backend, said in one line; the junk file listed in OUT/failures.jsonl
    exactly as encode lists it, exit 1; the parts one collection with encode's records and, with
    one BLAS thread on both sides, encode's bits (bfloat16, the default of both); the second run
    embeds only what the first did not."""
    inputs, junk = collection(tmp_path)
    out = tmp_path / "embs"
    base = ["--model", str(tiny_ckpt), "--out-dir", str(out), "--address", cluster.address, "--shard-size", "4"]
    first = example(*base, "--batch-size", "3", str(tmp_path / "img" / "img0000.jpg"))
    assert first.returncode == 0, first.stderr
    assert "1 engine actor(s) on the CPU (numpy backend)" in first.stderr and "no GPU" in first.stderr
    assert "ray_embed: encoded 1, skipped 0, failed 0" in first.stderr
    second = example(*base, "--batch-size", "3", *inputs)
    assert second.returncode == 1, second.stderr
    assert "ray_embed: 11 to embed, 1 already in" in second.stderr
    assert "encoded 10, skipped 1, failed 1" in second.stderr and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines()[-1] == (f"ray_embed: error: 1 input(s) failed; their reasons are in "
                                                      f"{out / 'failures.jsonl'}")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # parts appear whole

    want = encoded(inputs, tiny_ckpt, tmp_path / "encoded", env=ONE_THREAD)
    assert (out / "failures.jsonl").read_text() == (tmp_path / "encoded" / "failures.jsonl").read_text()
    assert str(junk) in (out / "failures.jsonl").read_text()
    got = {record_key(r): (r, a) for r, a in read_embeddings(parts(out))}
    assert sorted(got) == sorted(want) and len(list(read_records(parts(out)))) == 11  # one record each
    for key, (record, arrays) in got.items():
        assert same_record(record, want[key][0])
        assert_same_rows(arrays["pooler_output"], want[key][1]["pooler_output"], key)


def test_other_batches_and_blas_threads_stay_within_the_rounding_bound(tmp_path, tiny_ckpt, cluster):
    """Rows of image bytes (read_binary_files), through `embed` and back to the driver, against
    encode with this machine's default BLAS threads: float32 within TOLERANCE, bfloat16 within
    the bound of rounding such float32 results."""
    paths = make_images(tmp_path / "img", 6, seed=10)
    plan = Plan(actors=1, gpus_per_actor=0, backend="numpy", decode_tasks=2)
    for dtype, bound in (("float32", TOLERANCE), ("bfloat16", BF16_TOLERANCE)):
        ds = embed(ray.data.read_binary_files(str(tmp_path / "img"), include_paths=True), str(tiny_ckpt), plan=plan,
                   batch_size=4, dtype=dtype)
        rows = ds.take_all()
        want = encoded([str(p) for p in paths], tiny_ckpt, tmp_path / dtype, "--dtype", dtype)
        assert sorted(r["path"] for r in rows) == sorted(want)
        for row in rows:
            record, arrays = want[row["path"]]
            assert row["error"] == "" and row["sha256"] == record["sha256"] and row["nbytes"] == record["bytes"]
            assert row["grid_thw"].tolist() == record["grid_thw"] and row["member"] is None
            got = row["pooler_output"]
            assert got.dtype == (np.float32 if dtype == "float32" else np.uint16)
            if dtype == "bfloat16":
                got = (got.astype(np.uint32) << 16).view(np.float32)
            assert rel_err(got, arrays["pooler_output"]) <= bound


def test_gpus_the_cluster_lacks_are_refused_at_once(tmp_path, tiny_ckpt, cluster):
    """Asking for GPUs the cluster does not have ends in one line, not in a wait for ever."""
    with pytest.raises(GlmVitError, match=r"the cluster has 0 GPU\(s\), and 1 actor\(s\) of 1 GPU need 1"):
        cluster_plan(gpus_per_actor=1)
    with pytest.raises(GlmVitError, match="backend 'cupy' with 0 GPUs an actor"):
        cluster_plan(backend="cupy")
    with pytest.raises(GlmVitError, match="the cluster has 4 CPU"):
        cluster_plan(actors=4)
    assert cluster_plan() == Plan(actors=1, gpus_per_actor=0.0, backend="numpy", decode_tasks=2)
    make_images(tmp_path / "img", 1)
    start = time.perf_counter()
    proc = example(str(tmp_path / "img"), "--model", str(tiny_ckpt), "--out-dir", str(tmp_path / "out"),
                   "--address", cluster.address, "--gpus-per-actor", "1", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ray_embed: error: the cluster has 0 GPU(s)")
    print(f"refused in {time.perf_counter() - start:.1f} s")


def test_help_has_examples_and_explains_every_option():
    spec = importlib.util.spec_from_file_location("ray_embed", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    undescribed = [p.name for p in module.main.params if isinstance(p, click.Option) and not p.help]
    assert not undescribed, f"options without help: {undescribed}"
    proc = example("--help", timeout=120)
    assert proc.returncode == 0 and "Examples:" in proc.stdout and "Exit status" in proc.stdout
    assert "--gpus-per-actor" in proc.stdout and "--decode-tasks" in proc.stdout


def killing_probe(marker: str) -> type[GlmVitEmbedder]:
    """GlmVitEmbedder that logs each call's node, process and (when it ends) its yields to
    marker.log and, once (the first call to create `marker`), SIGKILLs its own process after
    yielding its first forward batch's rows: Ray has them then, and the rest of the call is lost
    with the actor. A class made in a
    function is pickled by value: the actors do not import this test module."""

    class Probe(GlmVitEmbedder):
        def __call__(self, batch):
            node = ray.get_runtime_context().get_node_id()
            with open(marker + ".log", "a") as log:
                log.write(json.dumps({"node": node, "pid": os.getpid(), "paths": list(map(str, batch["path"]))}) + "\n")
            yields = 0
            for rows in super().__call__(batch):
                yield rows
                yields += 1
                if yields == 1:
                    try:
                        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
                    except FileExistsError:
                        continue
                    os.kill(os.getpid(), signal.SIGKILL)
            with open(marker + ".log", "a") as log:
                log.write(json.dumps({"done": list(map(str, batch["path"])), "yields": yields}) + "\n")

    return Probe


def test_several_nodes_encode_every_input_once_and_a_killed_actor_is_retried(tmp_path, tiny_ckpt, cluster):
    """Two more raylets, one declared GPU each: two actors, one a node (the pool waits for both
    before its first call), forward batches of one or two images (several yields a call). One actor
    is SIGKILLed after handing Ray its first rows; Ray restarts it and runs the call again. The
    parts hold every input exactly once, read as one collection equal (bit for bit, one BLAS
    thread each side) to encode's."""
    inputs, junk = collection(tmp_path)
    junk.unlink()
    sources = expand_inputs(inputs)
    budget = ["--max-image-tokens", "16", "--max-pixels", str(64 * 14 * 14)]  # one or two images a forward call
    marker = str(tmp_path / "killed")
    context = ray.data.DataContext.get_current()
    with one_blas_thread():
        added = [cluster.add_node(num_cpus=1, num_gpus=1) for _ in range(2)]
    try:
        cluster.wait_for_nodes()
        context.wait_for_min_actors_s = 120  # both actors up before the first call, so that both get calls
        ds = embed(ray.data.from_items(rows_of(sources)), str(tiny_ckpt), max_image_tokens=16,
                   max_pixels=64 * 14 * 14, batch_size=2, embedder=killing_probe(marker),
                   plan=Plan(actors=2, gpus_per_actor=1, backend="numpy", decode_tasks=2))
        sink = ShardSink(tmp_path / "embs", shard_size=4)
        ds.write_datasink(sink)
    finally:
        context.wait_for_min_actors_s = -1  # Ray's default
        for node in added:
            cluster.remove_node(node)
    log = [json.loads(line) for line in Path(marker + ".log").read_text().splitlines()]
    calls, done = [e for e in log if "node" in e], [e for e in log if "done" in e]
    assert any(e["yields"] > 1 for e in done), done  # a yield a forward batch, not one a call
    assert os.path.exists(marker) and len({c["node"] for c in calls}) == 2  # both actors' nodes did work
    killed = [c for c in calls if c["paths"] in [d["paths"] for d in calls if d is not c]]
    assert killed, "no call was run again after the kill"
    print(f"{len(calls)} calls on {len({c['node'] for c in calls})} nodes by {len({c['pid'] for c in calls})} "
          f"processes; the killed call ran again: {killed[0]['paths']}")

    assert sink.written == len(sources) and sink.failures == []
    keys = [record_key(r) for r in read_records(parts(tmp_path / "embs"))]
    assert sorted(keys) == sorted(s.key for s in sources)  # each exactly once: no duplicate from the kill
    want = encoded(inputs, tiny_ckpt, tmp_path / "encoded", *budget, env=ONE_THREAD)
    for record, arrays in read_embeddings(parts(tmp_path / "embs")):
        assert same_record(record, want[record_key(record)][0])
        assert_same_rows(arrays["pooler_output"], want[record_key(record)][1]["pooler_output"], record_key(record))


class _PoolProbe(GlmVitEmbedder):
    """GlmVitEmbedder adding, to each row, the actor's process and CuPy pool limit as a fraction
    of its GPU."""

    def __call__(self, batch):
        import cupy

        limit = cupy.get_default_memory_pool().get_limit() / cupy.cuda.Device().mem_info[1]
        for rows in super().__call__(batch):
            n = len(rows["path"])
            rows["pid"], rows["pool_fraction"] = [os.getpid()] * n, [limit] * n
            yield rows


@pytest.mark.gpu
def test_gpu_actors_sharing_a_gpu_get_half_its_pool_and_the_engines_bits(tmp_path, real_ckpt, cluster):
    """Two actors on one GPU (num_gpus=0.5 each) cap CuPy's pool at half of it. Each call packs
    its images as encode packs them: a call of images that fit one forward batch gives, bit for
    bit, what the engine in this process gives those images in one `encode` call."""
    from glmvit_cupy import GlmVit

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # _PoolProbe lives in this test module
    paths = make_images(tmp_path / "img", 8, seed=13)
    ds = embed(ray.data.from_items(rows_of(expand_inputs([str(tmp_path / "img")]))), str(real_ckpt),
               plan=Plan(actors=2, gpus_per_actor=0.5, backend="cupy", decode_tasks=2), batch_size=4,
               dtype="float32", embedder=_PoolProbe)
    rows = ds.take_all()
    assert sorted(r["path"] for r in rows) == sorted(map(str, paths)) and all(r["error"] == "" for r in rows)
    assert {round(r["pool_fraction"], 6) for r in rows} == {0.5}
    print(f"ray: {len(rows)} rows from {len({r['pid'] for r in rows})} actor(s) sharing the GPU")
    by_path = {r["path"]: r for r in rows}
    vit = GlmVit.from_pretrained(real_ckpt, backend="cupy")
    try:
        for group in (paths[:4], paths[4:]):  # each a Ray call (batch_size 4, rows in order), one forward batch
            assert sum(int(np.prod(by_path[str(p)]["grid_thw"])) for p in group) <= vit.p_max
            for path, want in zip(group, vit.encode(group, dtype="float32")):
                got = by_path[str(path)]["pooler_output"]
                assert np.array_equal(got, want.pooler_output), (path, rel_err(got, want.pooler_output))
    finally:
        vit.close()


def test_the_decode_stage_fails_a_video_alone(tmp_path):
    """A video among Ray's rows (expand_inputs lists videos too) fails alone at the decode stage,
    with the one line every images-only path gives; the image beside it decodes."""
    from glmvit_cupy.deploy.ray import decode
    from glmvit_cupy.processor.preprocess import ProcessorConfig
    from PIL import Image

    clip, image = tmp_path / "a.mp4", tmp_path / "b.png"
    clip.write_bytes(b"never read: the extension makes it a video")
    Image.new("RGB", (56, 56), "gray").save(image)
    rows = decode({"path": np.array([str(clip), str(image)], dtype=object)}, ProcessorConfig())
    assert rows["error"][0] == (f"{clip}: a video; this run takes images only (glmvit-cupy encode --out-dir and "
                                "GlmVit.encode_video take videos)")
    assert rows["error"][1] == "" and rows["canvas"][1].ndim == 3 and rows["canvas"][1].dtype == np.uint8
