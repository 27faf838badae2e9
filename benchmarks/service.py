"""One GlmVit behind a service: the batcher against `encode` and the forward alone, in one process.

Issue 23's targets, on the e2e collection's photos (benchmarks/photos.py) of long side at most
1024 px, each request a file's bytes in and the pooler (bf16) out, as a web handler would ask:

1. `vit.encode(all paths)` on the same photos (pooler, bf16): the rate callers are held to.
2. The batcher, closed loop: 1, 8 and 32 caller threads, each submitting the next photo's
   bytes and waiting for its result: images/s, failed requests, p50/p99 latency.
3. Open loop at half the best closed-loop rate, Poisson arrivals: p50/p99 latency from the
   arrival, against a lone request's.
4. A lone 448x448 PNG request (bytes in, pooler out), p50 of 50 one after the other, against
   `vit.forward` of its grid (pixel_values on the device).
5. `vit.encode` of the whole collection (pooler, bf16) against the forward alone on the same
   grids (e2e.forward_only: the pipeline's batches, pixel_values on the device).

    python benchmarks/service.py --model /tmp/glmvit-real                               # the H200 run
    python benchmarks/service.py --model /tmp/glmvit-tiny --backend numpy --images 24 --requests 24
"""

from __future__ import annotations

import io
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import benchmark_main, environment, forward_only, load_collection, save  # noqa: E402

from glmvit_cupy import GlmVit  # noqa: E402
from glmvit_cupy.processor.preprocess import preprocess  # noqa: E402
from glmvit_cupy.tower.synthetic import photo_like  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def closed_loop(batcher, blobs: list[bytes], callers: int) -> dict:
    """`callers` threads, each submitting the next blob and waiting for it, until all are done."""
    latencies, failures, lock, cursor = [], [], threading.Lock(), iter(range(len(blobs)))

    def caller() -> None:
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                batcher.submit(blobs[i]).result()
                latencies.append(time.perf_counter() - t0)
            except Exception as exc:  # counted and reported: the target is none
                failures.append(f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return dict(callers=callers, images_per_s=round(len(latencies) / wall, 2), failed=len(failures),
                first_failure=failures[0] if failures else None, p50_ms=round(1000 * percentile(latencies, 50), 1),
                p99_ms=round(1000 * percentile(latencies, 99), 1))


def open_loop(batcher, blobs: list[bytes], rate: float, seed: int = 0) -> dict:
    """Poisson arrivals at `rate` a second over the blobs; latency from each arrival."""
    rng = random.Random(seed)
    done, start = [], time.perf_counter()
    at = start
    futures = []
    for blob in blobs:
        at += rng.expovariate(rate)
        time.sleep(max(0.0, at - time.perf_counter()))
        arrival = time.perf_counter()
        future = batcher.submit(blob)
        future.add_done_callback(lambda f, a=arrival: done.append(time.perf_counter() - a))
        futures.append(future)
    failed = sum(f.exception() is not None for f in futures)
    return dict(rate=round(rate, 2), requests=len(blobs), failed=failed, p50_ms=round(1000 * percentile(done, 50), 1),
                p99_ms=round(1000 * percentile(done, 99), 1))


def lone_request(vit, batcher, repeats: int = 50) -> dict:
    """A 448x448 photo's file bytes (PNG, then JPEG) through the batcher, one request at a time,
    against the forward of its grid with pixel_values already on the device; the medians of
    each request's Timing say where the rest goes."""
    image = photo_like(448, 448, seed=7)
    pixels, grid = preprocess(image, vit.processor)
    sync = lambda: None  # noqa: E731
    if vit.backend == "cupy":
        import cupy
        pixels, sync = cupy.asarray(pixels), cupy.cuda.Device().synchronize
    forward = []
    for i in range(repeats + 3):  # the first three warm the tables and capture the graph
        sync()
        t0 = time.perf_counter()
        vit.forward(pixels, grid)
        sync()
        forward.append(time.perf_counter() - t0)
    f50 = percentile(forward[3:], 50)
    record = dict(forward_p50_ms=round(1000 * f50, 2))
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        blob = buf.getvalue()
        served = []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            out = batcher.submit(blob).result()
            served.append((time.perf_counter() - t0, out.timing))
        served = served[3:]
        p50 = percentile([t for t, _ in served], 50)
        record[fmt.lower()] = dict(
            bytes=len(blob), request_p50_ms=round(1000 * p50, 2), ratio=round(p50 / f50, 2),
            **{f"{name}_p50_ms": round(1000 * percentile([getattr(t, name) for _, t in served], 50), 2)
               for name in ("decode_s", "queue_s", "inference_s")})
    return record


def markdown(r: dict) -> str:
    lines = [f"# Service benchmark ({r['environment']['device']})", "",
             f"{r['requests']} photos of long side <= 1024 px; `vit.encode(all paths)`, pooler bf16: "
             f"**{r['encode_rate']} images/s**", "",
             "| callers | images/s | vs encode(all) | failed | p50 ms | p99 ms |", "| --- | --- | --- | --- | --- | --- |"]
    for c in r["closed_loop"]:
        lines.append(f"| {c['callers']} | {c['images_per_s']} | {c['images_per_s'] / r['encode_rate']:.2f}x | "
                     f"{c['failed']} | {c['p50_ms']} | {c['p99_ms']} |")
    o, lone, col, alone = r["open_loop"], r["lone"], r["collection"], r["closed_loop"][0]
    lines += ["", f"Poisson arrivals at {o['rate']}/s (half the best closed-loop rate): p50 {o['p50_ms']} ms, "
              f"p99 {o['p99_ms']} ms; {o['failed']} failed. The same photos one at a time (1 caller): p50 "
              f"{alone['p50_ms']} ms, p99 {alone['p99_ms']} ms (p99 under load / p99 alone: "
              f"{o['p99_ms'] / alone['p99_ms']:.2f}x; / p50 alone: {o['p99_ms'] / alone['p50_ms']:.2f}x).", ""]
    lines += [f"Lone 448x448 request, file bytes in, pooler out, against {lone['forward_p50_ms']} ms for the "
              "forward of its grid (p50s):", "",
              "| file | bytes | request ms | x forward | decode ms | submit to engine ms | batch on engine ms |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for fmt in ("png", "jpeg"):
        x = lone[fmt]
        lines.append(f"| {fmt.upper()} | {x['bytes']:,} | {x['request_p50_ms']} | {x['ratio']}x | {x['decode_s_p50_ms']} | "
                     f"{x['queue_s_p50_ms']} | {x['inference_s_p50_ms']} |")
    lines += ["",
              f"`vit.encode` of all {col['images']} photos (pooler, bf16): {col['encode_rate']} images/s against "
              f"{col['forward_rate']} for the forward alone ({col['ratio']}x).", ""]
    return "\n".join(lines)


def run(args, collection: Path, out: Path) -> None:
    _, files = load_collection(args, collection)
    small = [f for f in files if max(Image.open(f).size) <= 1024][:args.requests]
    blobs = [Path(f).read_bytes() for f in small]
    vit = GlmVit.from_pretrained(args.model, backend=args.backend)
    vit.encode(small[:16], workers=args.workers)  # warm: the decode pool, the stager, the kernels
    t0 = time.perf_counter()
    vit.encode(small, output="pooler", dtype="bfloat16", workers=args.workers)
    encode_rate = round(len(small) / (time.perf_counter() - t0), 2)
    print(f"encode(all {len(small)}): {encode_rate} images/s", file=sys.stderr, flush=True)
    with vit.batcher(workers=args.workers) as batcher:
        closed_loop(batcher, blobs[:32], 8)  # warm
        loops = [closed_loop(batcher, blobs, callers) for callers in (1, 8, 32)]
        for c in loops:
            print(f"closed loop: {c}", file=sys.stderr, flush=True)
        lone = lone_request(vit, batcher)
        best = max(c["images_per_s"] for c in loops)
        poisson = open_loop(batcher, blobs, best / 2)
    t0 = time.perf_counter()
    vit.encode(files, output="pooler", dtype="bfloat16", workers=args.workers)
    encode_all = len(files) / (time.perf_counter() - t0)
    fwd, _ = forward_only(vit, files, vit.processor, args.workers)
    collection_record = dict(images=len(files), encode_rate=round(encode_all, 2), forward_rate=fwd["images_per_s"],
                             ratio=round(encode_all / fwd["images_per_s"], 3))
    vit.close()
    record = dict(environment=environment(args.backend), requests=len(small), encode_rate=encode_rate,
                  closed_loop=loops, open_loop=poisson, lone=lone, collection=collection_record)
    save(record, markdown(record), out)


def more(ap) -> None:
    ap.add_argument("--requests", type=int, default=400, help="photos (long side <= 1024 px) sent as requests")


if __name__ == "__main__":
    benchmark_main(__doc__.splitlines()[0], run, ("h200-service.json", "cpu-service.json"), more)
