"""Ray Data beside `glmvit-cupy encode` on the same photo collection, in one run, and where Ray's time goes.

Issue 27: Ray at least 0.85x encode's images/s on one GPU.

1. The collection: e2e.py's COUNT real photographs (benchmarks/photos.py), built or reused.
2. encode: e2e.end_to_end, as e2e.py runs it (`glmvit-cupy encode COLLECTION --out-dir OUT
   --workers N --quiet` after a warm-up run on 16 of the files): its summary clock (first
   file read to last shard renamed; the tower bound before it) and its process wall.
3. Ray: a local cluster on this machine (ray.init, timed apart: a cluster runs before a job
   comes), then glmvit_cupy.deploy.ray.embed + ShardSink, as examples/ray_embed.py runs them, over
   the collection's rows (rows_of), once on 16 files (warm-up) and once on all of them. The
   actors are GlmVitEmbedder with a probe (a subclass defined here) that logs, per actor, when
   its engine was ready and, per call, its start and end, its images and tokens, the engine's
   busy milliseconds (CUDA events; none on the NumPy backend) and the time spent suspended at
   its yields (Ray storing a forward batch's rows). Every record in the parts is counted (one a
   photo, or the run fails), and Ray Data's own per-operator stats go to the log. Then Ray's
   embeddings against encode's, image by image: how many are bit-identical, and how far apart
   the others are (README's "What holds between Ray's output and encode's").
4. Ratios, two clocks:
   - whole: Ray from the dataset's start (actors started and the tower bound inside it) to the
     last part renamed, against encode's process wall (interpreter start and tower bound in it);
   - steady: Ray from its first engine's being ready, against encode's summary clock (neither
     binds the tower inside it; Ray's decode tasks have run from the dataset's start, a head
     start that the record gives).
   The split of Ray's whole clock (one actor; with several, the sums over them): actor start
   (dataset start to the engine ready), waiting for the first batch, the engine busy inside
   calls, the rest of the calls (packing, uploads the engine waited for, Python), storing rows
   at the yields, waiting between calls (the decode stage or Ray's scheduling behind), and the
   tail (last call's end to the last part written).
5. A Markdown table on stdout; a JSON record, the table and the log under benchmarks/results/.

    python benchmarks/ray_data.py --model /tmp/glmvit-real                        # the H200 run (one GPU)
    python benchmarks/ray_data.py --model /tmp/glmvit-tiny --backend numpy --images 60 --decode-tasks 1 \\
        --workers 1                                                               # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from e2e import WARMUP_FILES, benchmark_main, end_to_end, load_collection, save  # puts the repository on sys.path

import numpy as np  # noqa: E402
import ray  # noqa: E402

from glmvit_cupy.collection.shards import read_embeddings, read_records, record_key  # noqa: E402
from glmvit_cupy.collection.sources import expand_inputs  # noqa: E402
from glmvit_cupy.deploy.ray import (DEFAULT_BATCH_SIZE, GlmVitEmbedder, ShardSink, cluster_plan, embed,  # noqa: E402
                                     parts, rows_of)
from glmvit_cupy.errors import GlmVitError  # noqa: E402

TARGET = 0.85


def probe_class(log_dir: str) -> type[GlmVitEmbedder]:
    """GlmVitEmbedder logging its timeline to log_dir/actor-PID.jsonl (a class made here is
    pickled by value, so the actors need not import this script)."""

    class Probe(GlmVitEmbedder):
        def __init__(self, *args, **kwargs) -> None:
            started = time.time()
            super().__init__(*args, **kwargs)
            self.log = open(os.path.join(log_dir, f"actor-{os.getpid()}.jsonl"), "a")
            self._write(kind="ready", started=started, ready=time.time())

        def _write(self, **entry) -> None:
            self.log.write(json.dumps(entry) + "\n")
            self.log.flush()

        def __call__(self, batch):
            start = time.time()
            busy, tokens = sum(self.stats.gpu_ms.values()), self.stats.tokens
            suspended = 0.0
            for rows in super().__call__(batch):
                yielded = time.perf_counter()
                yield rows
                suspended += time.perf_counter() - yielded
            self._write(kind="call", start=start, end=time.time(), images=len(batch["path"]),
                        tokens=self.stats.tokens - tokens, busy_s=(sum(self.stats.gpu_ms.values()) - busy) / 1000,
                        yield_s=suspended)

    return Probe


def split(entries: list[dict], run_start: float, run_end: float) -> dict:
    """Where Ray's whole clock went, from the actors' logs (sums over actors)."""
    ready = [e for e in entries if e["kind"] == "ready"]
    calls = sorted((e for e in entries if e["kind"] == "call"), key=lambda e: e["start"])
    if not calls:
        raise GlmVitError("the Ray run logged no actor call")
    first_ready = min(e["ready"] for e in ready)
    by_actor: dict[int, list[dict]] = {}
    for e in calls:
        by_actor.setdefault(e["pid"], []).append(e)
    gaps = sum(b["start"] - a["end"] for c in by_actor.values() for a, b in zip(c, c[1:]))
    in_calls = sum(e["end"] - e["start"] for e in calls)
    busy = sum(e["busy_s"] for e in calls)
    stored = sum(e["yield_s"] for e in calls)
    return dict(engines_started=len(ready), calls=len(calls),
                actor_start_s=round(first_ready - run_start, 2),
                first_batch_wait_s=round(min(e["start"] for e in calls) - first_ready, 2),
                engine_busy_s=round(busy, 2), calls_other_s=round(in_calls - busy - stored, 2),
                storing_rows_s=round(stored, 2), between_calls_s=round(gaps, 2),
                tail_s=round(run_end - max(e["end"] for e in calls), 2),
                images=sum(e["images"] for e in calls), tokens=sum(e["tokens"] for e in calls),
                first_ready=first_ready)


def ray_run(files: list[str], args: argparse.Namespace, plan, out_dir: Path, log_dir: Path) -> dict:
    """One embed + ShardSink run over `files` into out_dir: its clocks, split and counts."""
    log_dir.mkdir(parents=True)
    for entry in log_dir.iterdir():
        entry.unlink()
    sources = expand_inputs(files)
    run_start = time.time()
    ds = embed(ray.data.from_items(rows_of(sources)), str(args.model), plan=plan, batch_size=args.batch_size,
               embedder=probe_class(str(log_dir)))
    sink = ShardSink(out_dir)
    ds.write_datasink(sink)
    run_end = time.time()
    records = list(read_records(parts(out_dir)))
    if sink.written != len(files) or len(records) != len(files) or sink.failures:
        raise GlmVitError(f"Ray run: {sink.written} written, {len(sink.failures)} failed, {len(records)} records in "
                          f"the parts, expected {len(files)}")
    entries = []
    for log in log_dir.iterdir():
        pid = int(log.stem.split("-")[1])
        entries += [dict(json.loads(line), pid=pid) for line in log.read_text().splitlines()]
    where = split(entries, run_start, run_end)
    whole, steady = run_end - run_start, run_end - where.pop("first_ready")
    tokens = sum(r["tokens"] for r in records)
    return dict(whole_s=round(whole, 2), steady_s=round(steady, 2), images_per_s=round(len(files) / whole, 2),
                steady_images_per_s=round(len(files) / steady, 2), tokens_per_s=round(tokens / whole, 1),
                records=len(records), out_mib=round(sum(f.stat().st_size for p in parts(out_dir)
                                                         for f in p.iterdir()) / 2**20, 1),
                gpu_busy_steady=round(where["engine_busy_s"] / steady / plan.actors, 3), split=where,
                ray_stats=ds.stats())


def equality(encoded: Path, ray_parts: list[Path]) -> dict:
    """Ray's embeddings against encode's, image by image (both BF16, read as float32): how many
    are bit-identical, and the worst relative Frobenius difference of the others."""
    ours = {record_key(r): a["pooler_output"] for r, a in read_embeddings(encoded)}
    same, worst, differing = 0, 0.0, 0
    for record, arrays in read_embeddings(ray_parts):
        want, got = ours.pop(record_key(record)), arrays["pooler_output"]
        if np.array_equal(got, want):
            same += 1
            continue
        diff = got.astype(np.float64) - want
        worst = max(worst, float(np.linalg.norm(diff) / np.linalg.norm(want)))
        differing += int(np.count_nonzero(diff))
    if ours:
        raise GlmVitError(f"{len(ours)} images of encode's output are not in Ray's")
    return dict(bit_identical_images=same, worst_rel_diff=worst, differing_elements=differing)


def markdown(r: dict) -> str:
    e, ray_, s, col, q = r["encode"], r["ray"], r["ray"]["split"], r["collection"], r["ray"]["equality"]
    enc_busy = "-" if e["gpu_busy"] is None else f"{100 * e['gpu_busy']:.0f}%"
    ray_busy = "-" if r["backend"] != "cupy" else f"{100 * ray_['gpu_busy_steady']:.0f}%"
    lines = [f"{r['date']}, {r['device']}, {r['cpus']} CPUs, backend {r['backend']}, Ray {r['ray_version']}; "
             f"{col['count']} photos ({col['jpeg']} JPEG, {col['png']} PNG); encode --workers {r['workers']}; Ray: "
             f"{r['plan']}, {r['batch_size']} images a call; cluster start {r['cluster_start_s']:.1f} s (outside "
             "both clocks)", "",
             "| run | images/s | clock s | GPU busy | output GiB |", "| --- | --- | --- | --- | --- |",
             f"| encode, process wall (tower bound inside) | {e['process_images_per_s']:.1f} | "
             f"{e['process_wall_s']:.1f} | | |",
             f"| encode, its summary clock | {e['images_per_s']:.1f} | {e['pipeline_wall_s']:.1f} | {enc_busy} | "
             f"{e['out_mib'] / 1024:.1f} |",
             f"| Ray, whole (actors started, tower bound inside) | {ray_['images_per_s']:.1f} | {ray_['whole_s']:.1f} "
             f"| | {ray_['out_mib'] / 1024:.1f} |",
             f"| Ray, steady (from the first engine ready) | {ray_['steady_images_per_s']:.1f} | "
             f"{ray_['steady_s']:.1f} | {ray_busy} | |",
             "", f"Ray / encode: whole {r['ratio_whole']:.2f}x, steady {r['ratio_steady']:.2f}x (target >= {TARGET}x)",
             "", "Ray's whole clock, split (seconds; sums over actors):", "",
             "| actor start | first batch wait | engine busy | rest of calls | storing rows | between calls | tail |",
             "| --- | --- | --- | --- | --- | --- | --- |",
             f"| {s['actor_start_s']:.2f} | {s['first_batch_wait_s']:.2f} | {s['engine_busy_s']:.2f} | "
             f"{s['calls_other_s']:.2f} | {s['storing_rows_s']:.2f} | {s['between_calls_s']:.2f} | {s['tail_s']:.2f} |",
             "", f"{s['calls']} calls; {s['engines_started']} engine(s) started", "",
             f"Equality with encode's output (bfloat16): {q['bit_identical_images']} of {col['count']} images "
             f"bit-identical; the others differ in {q['differing_elements']:,} elements, at worst "
             f"{q['worst_rel_diff']:.2e} relative (README's bound: 2 x 2^-8 + 1e-5 = 7.8e-3)"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, collection: Path, out: Path) -> None:
    t0 = time.perf_counter()
    manifest, files = load_collection(args, collection)
    scratch = Path(tempfile.mkdtemp(prefix="glmvit-ray-bench-"))
    try:
        enc = end_to_end(files, collection, args.model, args.workers, args.backend, out_dir=scratch / "encoded")
        enc["process_images_per_s"] = round(len(files) / enc["process_wall_s"], 2)
        print(f"encode: {enc['summary_line']} (process wall {enc['process_wall_s']} s)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        ray.init(include_dashboard=False, log_to_driver=False)
        cluster_start = time.perf_counter() - start
        plan = cluster_plan(args.actors, args.gpus_per_actor, args.backend, args.decode_tasks)
        print(f"ray: cluster up in {cluster_start:.1f} s; {plan}", file=sys.stderr, flush=True)
        ray_run(files[:WARMUP_FILES], args, plan, scratch / "warmup", scratch / "warmup-log")
        result = ray_run(files, args, plan, scratch / "out", scratch / "log")
        result["equality"] = equality(scratch / "encoded", parts(scratch / "out"))
        print(f"ray: equality with encode's output {result['equality']}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        ray.shutdown()
    stats = result.pop("ray_stats")
    print(f"ray: {json.dumps(result)}", file=sys.stderr, flush=True)
    device = "CPU"
    if args.backend == "cupy":
        import subprocess
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True).stdout.strip() or "GPU"
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device=device,
                  cpus=os.cpu_count(), backend=args.backend, workers=args.workers, ray_version=ray.__version__,
                  plan=str(plan), batch_size=args.batch_size, cluster_start_s=round(cluster_start, 2),
                  collection=dict(path=str(collection), **{k: v for k, v in manifest.items() if k != "files"}),
                  encode=enc, ray=result, ratio_whole=round(enc["process_wall_s"] / result["whole_s"], 3),
                  ratio_steady=round(result["steady_images_per_s"] / enc["images_per_s"], 3),
                  benchmark_wall_s=round(time.perf_counter() - t0, 1))
    save(record, markdown(record), out)
    out.with_suffix(".log").write_text(stats + "\n")


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--actors", type=int, default=None, help="Ray's engine actors [default: one a GPU]")
    ap.add_argument("--gpus-per-actor", type=float, default=None, help="[default: 1 with GPUs, else 0]")
    ap.add_argument("--decode-tasks", type=int, default=None,
                    help="Ray's decode tasks at a time [default: the CPUs less one an actor and one for writes]")
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="images an actor call")


if __name__ == "__main__":
    benchmark_main(__doc__, run, ("h200-ray.json", "cpu-ray.json"), options)
