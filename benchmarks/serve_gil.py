"""Where a saturated server's engine process holds the GIL, per image and by stage (issue 25):
`glmvit-cupy serve` driven as benchmarks/serve.py's saturation step drives it, the engine process
sampled meanwhile by py-spy with `--gil` (only the thread holding the GIL is recorded), each sample
put in the stage its stack names; the HTTP fronts' CPU an image beside it.

The engine process is the one of its kind: the hand-off to and from the HTTP fronts, the cache, the
batchers' threads, the answers into the fronts' slots. Whatever of it holds the GIL runs one thread
at a time, so its sum per image bounds the images a second the server can serve (the fronts' work
is spread over --http-workers processes). On the NumPy backend the forward runs in the dispatcher
thread (mostly BLAS, without the GIL); its GIL share is listed apart, as it stands for the GPU's
kernel launches there.

    python benchmarks/serve_gil.py --model /tmp/glmvit-wide --backend numpy --images 48 --py-spy /tmp/pyspy/bin/py-spy
    python benchmarks/serve_gil.py --model CKPT --images 1000 --concurrency 64 --clients 4 --passes 1 \\
        --switch-interval-ms 5                     # the H200: an A/B of the server's GIL switch interval

py-spy is a measuring tool, not a dependency of the package (`pip install --target DIR py-spy`);
without --py-spy the run reports the rate, the threads' CPU and the stage means only.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from PIL import Image

from e2e import benchmark_main, load_collection, save  # puts the repo on sys.path
from proctree import thread_cpu
from serve import (Bodies, Load, _busy, _stage_means, _stage_seconds, benchmark_server_options, media_of,
                   server_options, small_photos)
from serving import ServerProcess

# (stage, markers): a sample is in the stage of the innermost frame its stack shares with a marker
# ("function (path" prefixes, path relative to the package or the site-packages).
STAGES = (
    ("forward (NumPy tower; launches on a GPU)", ("NumpyTower.", "NumpyStager.submit")),
    ("stager: canvases into the slot, launches", ("CupyStager.",)),
    ("request body read + JSON parse", ("_read_body (", "_parse_embeddings (")),
    ("base64 decode of the data URL", ("Front._input_bytes (",)),
    ("hand-off to/from the HTTP fronts, answers into their slots", ("Engine._serve_front (", "Engine._lookup (",
                                                                   "Engine._compute (", "Engine._leave (",
                                                                   "write_arrays (")),
    ("sha256 + cache", ("image_digest (", "EncoderCache.")),
    ("batcher bookkeeping (submit, decoded, dispatch, collect)", ("Batcher.",)),
    ("answer: rows out of the batch, GlmVitOutput", ("Batcher._answer (", "library_output (", "Pending.result (")),
    ("answer: JSON + base64 build", ("_embeddings_parts (", "_base64_parts (", "DeviceBase64.")),
    ("answer: writes to the socket", ("_PartsResponse.__call__ (", "RequestResponseCycle.send (")),
    ("metrics + access log", ("Front.finish (", "Metrics.", "Histogram.", "Counter.", "Logger.")),
)
OTHER = "event loop, HTTP parsing, the rest"


def stage_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        for stage, markers in STAGES:
            if any(frame.startswith(m) for m in markers):
                return stage
    return OTHER


def read_samples(path: Path) -> tuple[Counter, Counter, dict[str, str]]:
    """(samples by stage, samples by thread name, thread name by native id) of py-spy's raw output."""
    stages: Counter = Counter()
    threads: Counter = Counter()
    names: dict[str, str] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        tid, _, name = frames[0].partition(": ")
        name = _thread_kind(name)
        names[tid.removeprefix("thread (").rstrip(")")] = name
        threads[name] += int(count)
        stages[stage_of(frames[1:])] += int(count)
    return stages, threads, names


def _thread_kind(name: str) -> str:
    """A thread's name without its number where a pool has many (to_thread's workers, decode feeders)."""
    for pool in ("uvloop_", "asyncio_", "glmvit-decode-"):
        if name.startswith(pool):
            return pool.rstrip("_-") + " threads"
    return name


def run(args: argparse.Namespace, collection: Path, out: Path) -> None:
    _, everything = load_collection(args, collection)
    files = small_photos(everything)
    prelude = "" if args.switch_interval_ms is None else \
        f"import glmvit_cupy.deploy.serve as s; s.SWITCH_INTERVAL_S = {args.switch_interval_ms / 1000}"
    spy, raw = None, Path(tempfile.mkdtemp()) / "gil.txt"
    with ServerProcess(*server_options(args), ready_s=600, prelude=prelude) as server:
        load = Load(server.url, files, args.clients, args.concurrency + 4, args.seed)
        try:
            load.each(len(files), args.concurrency)  # warm: every grid seen once
            median = sorted(files, key=lambda f: Image.open(f).size[0] * Image.open(f).size[1])[len(files) // 2]
            same = Bodies(Path(median).read_bytes(), media_of(median)).next()
            if args.py_spy:
                spy = subprocess.Popen([args.py_spy, "record", "--pid", str(server.proc.pid), "--gil", "--threads",
                                        "--nonblocking", "-r", str(args.rate), "-f", "raw", "-o", str(raw)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                time.sleep(1.0)  # attached
            cpu, t0, images, stages_before = thread_cpu(server.proc.pid), time.perf_counter(), 0, _stage_seconds(server)
            for _ in range(args.passes):
                if args.repeat:  # one image's bytes every time: cache hits (no decode, no forward)
                    results, _ = load.repeat(same, args.repeat, args.concurrency)
                else:
                    results, _ = load.each(len(files), args.concurrency)
                images += sum(r["status"] == 200 for r in results)
            wall = time.perf_counter() - t0
            after = thread_cpu(server.proc.pid)
            stage_ms = _stage_means(stages_before, _stage_seconds(server))
            busy = _busy(cpu, after, wall)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                spy_log = spy.communicate(timeout=60)[1]
                if not raw.exists():
                    raise SystemExit(f"serve_gil: error: py-spy wrote nothing:\n{spy_log}")
        finally:
            load.close()
    stages, threads, names = read_samples(raw) if spy is not None else (Counter(), Counter(), {})
    cpu_ms: Counter = Counter()  # CPU ms an image (user + system, with the GIL or without) by thread kind
    for thread, seconds in after.items():
        if thread != "tree":
            tid = str(server.proc.pid) if thread == "main" else thread.removeprefix("thread ")
            name = names.get(tid, "main" if thread == "main" else "unnamed (never sampled)")
            cpu_ms[name] += 1000 * (seconds - cpu.get(thread, 0.0)) / images
    scale = 1000 / args.rate / images  # ms of GIL a sample stands for, per image
    total = sum(stages.values())
    record = dict(images=images, kind="cache hits" if args.repeat else "images", wall_s=round(wall, 2),
                  per_s=round(images / wall, 2), concurrency=args.concurrency, backend=args.backend,
                  switch_interval_ms=args.switch_interval_ms, http_workers=args.http_workers or "the server's",
                  server_cpu=busy, fronts_cpu_ms=round(1000 * (busy["tree_cores"] - busy["process_cores"]) * wall
                                                       / images, 2), stage_mean_ms=stage_ms,
                  gil_ms={stage: round(n * scale, 3) for stage, n in stages.most_common()},
                  gil_held_share=round(total / args.rate / (wall + 1.0), 3) if spy is not None else None,
                  thread_ms={t: dict(gil=round(threads[t] * scale, 3), cpu=round(ms, 3))
                             for t, ms in cpu_ms.most_common()})
    interval = "the server's" if args.switch_interval_ms is None else f"{args.switch_interval_ms:g} ms"
    lines = [f"{images} {record['kind']} in {wall:.1f} s ({images / wall:.1f}/s), {args.concurrency} clients, backend "
             f"{args.backend}, switch interval {interval}; server process "
             f"{busy['process_cores']} cores, tree {busy['tree_cores']} (the HTTP fronts: "
             f"{record['fronts_cpu_ms']} CPU ms an image); a thread of the engine process held the GIL "
             f"{record['gil_held_share']} of the time; the server's mean ms of {stage_ms}", ""]
    if spy is not None:
        lines += ["| stage | GIL ms an image | share |", "| --- | --- | --- |"]
        lines += [f"| {stage} | {n * scale:.2f} | {n / total:.0%} |" for stage, n in stages.most_common()]
        lines += [f"| all | {total * scale:.2f} | 100% |", ""]
    lines += ["| thread | GIL ms an image | CPU ms an image |", "| --- | --- | --- |"]
    lines += [f"| {t} | {v['gil']:.2f} | {v['cpu']:.2f} |" for t, v in record["thread_ms"].items()]
    save(record, "\n".join(lines) + "\n", out)


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--concurrency", type=int, default=16, help="clients of the closed loop")
    ap.add_argument("--clients", type=int, default=2, help="client processes sharing the load")
    benchmark_server_options(ap)
    ap.add_argument("--passes", type=int, default=2, help="passes over the photos while py-spy samples")
    ap.add_argument("--repeat", type=int, default=0,
                    help="requests a pass of the median photo's bytes (cache hits) instead of each photo once")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="the server's GIL switch interval, ms [default: serve.SWITCH_INTERVAL_S]")
    ap.add_argument("--rate", type=int, default=1000, help="py-spy's samples a second")
    ap.add_argument("--py-spy", default="", help="the py-spy executable [default: none, no GIL samples]")


if __name__ == "__main__":
    benchmark_main(__doc__, run, ("h200-serve-gil.json", "cpu-serve-gil.json"), options)
