"""The HTTP server under load (issue 25, item 6): `glmvit-cupy serve` driven on loopback by an asyncio
httpx load generator, beside the forward-only rate of the same images, in one run.

1. Images: e2e.py's collection of real photographs (benchmarks/photos.py), those of long side at most
   1,024 px (the collection's long sides are 320-1,600 px; about 55% of its --images photos qualify).
   Every request is `POST /v1/embeddings` with one image as a data:image/...;base64, URL and
   "encoding_format": "base64" (pooler output, the server's default dtype), and every request's image
   bytes are distinct (9 bytes after the image's end, which decoders ignore), so nothing is a cache hit
   unless step 8 means it. The load comes from --clients processes (an asyncio httpx client each,
   sharing each step's concurrency or rate): one Python client reading hundreds of MB/s of answers
   would measure itself, not the server.
2. Forward only: e2e.forward_only on the same files in this process (pipeline packing, pixels on the
   device, back to back), and the forward of the lone request's 448x448 grid alone; freed before step 3.
3. The server (tests/serving.py): `glmvit-cupy serve --model M --backend B --max-queue Q`, healthy.
4. Lone: --lone requests of a 448x448 photo, one at a time from a blocking httpx client (through
   /v1/embeddings, then as many through /embed, the file's bytes in): p50 / p99 latency, against the forward, and
   where it goes: the medians of the server's timing headers and of the client's time beyond them. After
   each route, one request body --lone + 1 times: its cache hits cost what a request costs beside its decode
   and forward (HTTP, the hops, the answer's transfer), the floor under the lone request's latency.
   Then each photo once, alone, one at a time (the load's asyncio client): step 6's baseline.
5. Saturation: --concurrency clients in a closed loop, every image once: images/s, against the forward;
   the CPU the server's busiest thread (its event loop) and its whole process tree used meanwhile.
6. Poisson arrivals at --rates x saturation (25, 50, 75 %), --rate-s seconds each: p50 / p99 latency,
   each stage's, and of each request's latency over its photo's alone (the photos' answers are ~1-11 MB
   of base64, the lone request's 2.8 MB: the tail is the largest photos' even with no queue).
7. Overload: Poisson at 2x saturation for --duration seconds: every request answered 200 or 429, none
   lost or hung (client timeout REQUEST_TIMEOUT_S), the 429s' p99 (at once: the server holds at most
   /info's max_requests, and this client opens more connections than that), /health 200 afterwards.
8. Cache: one image (fixed bytes) --cache-requests times by --concurrency clients: rate, p50, every hit's
   x-inference-time 0, and the server's glmvit_cache_requests counting them.
9. Soak: Poisson at 50 % of saturation for --soak-minutes: the server's process-tree RSS and the GPU's
   memory every SAMPLE_S, flat as soak.py judges it (after its warm-up), 0 errors.

A Markdown table on stdout; a JSON record (and the table) under benchmarks/results/.

    python benchmarks/serve.py --model /tmp/glmvit-real                                  # the H200 run
    python benchmarks/serve.py --model /tmp/glmvit-tiny --backend numpy --images 24 --concurrency 4 \\
        --rate-s 4 --duration 5 --lone 5 --cache-requests 20 --soak-minutes 0.1         # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import itertools
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from e2e import benchmark_main, environment, forward_only, load_collection, save  # puts the repo on sys.path
from proctree import thread_cpu, tree_memory, tree_rss_kinds
from soak import flatness, gpu_used_mib

import httpx  # the [serve] extra
from httpcore._async.http11 import AsyncHTTP11Connection
from serving import ServerProcess, die_with_parent  # tests/, on sys.path through e2e

from glmvit_cupy import GlmVit, preprocess
from glmvit_cupy.processor.preprocess import ProcessorConfig

LONG_SIDE_MAX = 1024
LONE_SIDE = 448
REQUEST_TIMEOUT_S = 300.0  # a request unanswered this long is lost
SAMPLE_S = 5.0
HEADER_STAGES = ("queue", "decode", "inference", "total")  # the server's x-<stage>-time headers, ms
CLIENT_READ_BYTES = 2**20  # an answer's read a time in the asyncio clients (_client_start)
CONTENT_TYPES = {"/v1/embeddings": "application/json", "/embed": "application/octet-stream"}
SOAK_FLAT = {"server_tree_rss_mib": (0.05, 64), "gpu_used_mib": (0.02, 0)}  # soak.py's rules for these series
TARGETS = {"saturation_over_forward": 0.8, "lone_p50_over_forward_ms": 3.0, "p99_at_half_over_lone": 3.0}


class Bodies:
    """Request bodies of one image with distinct bytes each: the image padded to a multiple of 3 bytes,
    so its base64 is computed once and a nonce's base64 appended (the process id in it: client processes
    never repeat each other's bytes; the count is the process's, so two steps' Bodies of one image never
    repeat each other's either: the lone step's /embed requests were cache hits of its JSON requests)."""

    _counts = itertools.count(1)

    def __init__(self, data: bytes, media: str) -> None:
        padded = self.padded = data + b"\0" * (-len(data) % 3)
        self.head = '{"encoding_format": "base64", "input": ["data:' + media + ';base64,' \
            + base64.b64encode(padded).decode()

    def _nonce(self) -> bytes:
        return (os.getpid() << 40 | next(self._counts)).to_bytes(9, "little")

    def next(self) -> bytes:
        return (self.head + base64.b64encode(self._nonce()).decode() + '"]}').encode()

    def next_file(self) -> bytes:
        """The image's own bytes with a nonce after them, as `POST /embed` takes them."""
        return self.padded + self._nonce()


def media_of(path: str) -> str:
    return "image/png" if path.endswith(".png") else "image/jpeg"


def small_photos(files: list[str]) -> list[str]:
    kept = [f for f in files if max(Image.open(f).size) <= LONG_SIDE_MAX]
    if not kept:
        raise SystemExit(f"serve: error: no photo of the collection has a long side of at most {LONG_SIDE_MAX} px")
    return kept


def lone_image(path: str) -> bytes:
    """A 448x448 JPEG: the centre square of a photo, resized."""
    image = Image.open(path).convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    image = image.crop((left, top, left + side, top + side)).resize((LONE_SIDE, LONE_SIDE), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


def forward_ms(vit: GlmVit, data: bytes) -> float:
    """The forward of this image's grid alone, median ms (CUDA events on the GPU)."""
    pixels, grid = preprocess(Image.open(io.BytesIO(data)), vit.processor)
    if vit.backend == "cupy":
        import cupy

        from glmvit_cupy.gpu.benchmark import time_engine
        return time_engine(vit, cupy.asarray(pixels), grid).median_ms
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        vit.forward(pixels, grid)
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


async def post(client: httpx.AsyncClient, url: str, body: bytes, gate: asyncio.Semaphore | None = None,
               route: str = "/v1/embeddings") -> dict:
    """One request: its status (or the exception that lost it), latency and timing headers. With `gate`
    (open loops), it waits there for one of the client's connections, and its latency counts the wait.
    `route`: /v1/embeddings (a JSON body) or /embed (an image file's bytes, a safetensors answer)."""
    t0 = time.perf_counter()
    async with gate or contextlib.nullcontext():
        sent = time.perf_counter()
        try:
            r = await client.post(f"{url}{route}", content=body, headers={"content-type": CONTENT_TYPES[route]})
        except httpx.HTTPError as exc:
            return dict(status=f"lost ({type(exc).__name__})", latency_s=time.perf_counter() - t0, wait_s=sent - t0)
    return outcome(r, t0, sent)


def post_lone(client: httpx.Client, url: str, body: bytes, route: str) -> dict:
    """One request of the lone step, through a blocking client: one request at a time needs no event
    loop, and httpx's asyncio client reads an answer 64 KiB an await (a 4 MiB answer: ~3 ms more than
    its blocking client on this project's CPU, benchmarks/NOTES.md), the client's cost, not the server's."""
    t0 = time.perf_counter()
    r = client.post(f"{url}{route}", content=body, headers={"content-type": CONTENT_TYPES[route]})
    return outcome(r, t0, t0)


def outcome(r: httpx.Response, t0: float, sent: float) -> dict:
    """A request's record: its status, latency (from t0), wait for a connection and timing headers."""
    server = {stage: float(r.headers.get(f"x-{stage}-time", "nan")) for stage in HEADER_STAGES}
    return dict(status=r.status_code, latency_s=time.perf_counter() - t0, wait_s=sent - t0,
                cache=r.headers.get("x-cache"), inference_ms=server["inference"], server_ms=server)


def latency(results: list[dict]) -> dict:
    ok = [r["latency_s"] for r in results if r["status"] == 200]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    return dict(requests=len(results), statuses=statuses,
                p50_ms=round(1000 * float(np.percentile(ok, 50)), 2) if ok else None,
                p99_ms=round(1000 * float(np.percentile(ok, 99)), 2) if ok else None)


def slowdown(results: list[dict], alone_s: dict[int, float]) -> dict:
    """p50 and p99 over the answered requests of each one's latency over its image's latency alone: what
    the load added, whatever the image's size (the photos' answers are ~1-11 MB of base64, the lone
    request's 2.8 MB)."""
    ratios = [r["latency_s"] / alone_s[r["source"]] for r in results if r["status"] == 200]
    return {f"p{q}": round(float(np.percentile(ratios, q)), 2) for q in (50, 99)} if ratios else {}


def stage_split(results: list[dict], q: float = 50) -> dict:
    """The q-th percentile over the answered requests of each of the server's timing headers (ms) and
    of what the client saw beyond the server's total: the request's read before the front's clock
    starts, the answer's write and transfer, the client's own parse."""
    ok = [r for r in results if r["status"] == 200]
    if not ok:
        return {}
    split = {stage: round(float(np.percentile([r["server_ms"][stage] for r in ok], q)), 2) for stage in HEADER_STAGES}
    split["outside_server"] = round(float(np.percentile([1000 * r["latency_s"] - r["server_ms"]["total"]
                                                         for r in ok], q)), 2)
    return split


async def closed_loop(client: httpx.AsyncClient, url: str, bodies: list[bytes], concurrency: int) -> list[dict]:
    """`concurrency` clients, each sending the next body as soon as its last is answered."""
    todo = iter(bodies)
    results: list[dict] = []

    async def worker() -> None:
        for body in todo:
            results.append(await post(client, url, body))
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def poisson(client: httpx.AsyncClient, url: str, sources: list[Bodies], rate: float, seconds: float,
                  rng: np.random.Generator, connections: int) -> list[dict]:
    """Open loop: arrivals at `rate` a second (exponential gaps) for `seconds`, each a random image's next
    body; waits for every answer. Arrivals beyond the client's connections wait in a semaphore, not in
    httpx's pool, whose every hand-over scans all its waiting requests: under overload that scan, not
    the server, set the pace (2026-12-02 H200 run, NOTES)."""
    gate = asyncio.Semaphore(connections)
    tasks, picks, t0, at = [], [], time.perf_counter(), 0.0
    while at < seconds:
        now = time.perf_counter() - t0
        if at > now:
            await asyncio.sleep(at - now)
            continue
        picks.append(int(rng.integers(len(sources))))
        tasks.append(asyncio.ensure_future(post(client, url, sources[picks[-1]].next(), gate)))
        at += rng.exponential(1 / rate)
    return [dict(r, source=i) for r, i in zip(await asyncio.gather(*tasks), picks)]


_client: dict = {}  # a client process's state (`_client_start`)


def _client_start(url: str, files: list[str], connections: int, seed: int) -> None:
    """A client process: dies with the benchmark, keeps every image's request bodies ready, and reads
    answers 1 MiB an await: httpcore's asyncio connection reads 64 KiB at a time, and a 15 MB answer
    took 26.8 ms to read that way against 12.2 ms at 1 MiB (as its blocking client) from a
    bare uvicorn on this project's CPU (benchmarks/NOTES.md): the load generator measured itself."""
    die_with_parent()
    if not hasattr(AsyncHTTP11Connection, "READ_NUM_BYTES"):
        raise SystemExit("serve: error: httpcore's AsyncHTTP11Connection has no READ_NUM_BYTES to set; check its "
                         "read size by hand")
    AsyncHTTP11Connection.READ_NUM_BYTES = CLIENT_READ_BYTES
    _client.update(url=url, connections=connections, sources=[Bodies(Path(f).read_bytes(), media_of(f)) for f in files],
                   rng=np.random.default_rng([seed, os.getpid()]))


def _client_step(step: str, args: tuple) -> list[dict]:
    """One client process's part of a step: "lone" (image, requests, route) one at a time; "alone"
    (indices into the files): each file once, one at a time; "each" (indices, clients): each file once;
    "repeat" (body, requests, clients); "poisson" (rate, seconds)."""
    url = _client["url"]
    if step == "lone":
        image, requests, route, same = args  # same: one body every time (a miss, then hits)
        lone = Bodies(image, "image/jpeg")
        body = lone.next if route == "/v1/embeddings" else lone.next_file
        if same:
            fixed = body()
            body = lambda: fixed  # noqa: E731
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            return [post_lone(client, url, body(), route) for _ in range(requests)]

    async def go() -> list[dict]:
        limits = httpx.Limits(max_connections=_client["connections"], max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT_S) as client:
            sources = _client["sources"]
            if step == "alone":
                (indices,) = args
                return [dict(await post(client, url, sources[i].next()), source=i) for i in indices]
            if step == "each":
                indices, clients = args
                return await closed_loop(client, url, [sources[i].next() for i in indices], clients)
            if step == "repeat":
                body, requests, clients = args
                return await closed_loop(client, url, [body] * requests, clients)
            rate, seconds = args
            return await poisson(client, url, sources, rate, seconds, _client["rng"], _client["connections"])
    return asyncio.run(go())


def _shares(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


class Load:
    """The load generator: `procs` client processes (spawned: the benchmark process holds a CUDA context),
    each step split among them and their results joined."""

    def __init__(self, url: str, files: list[str], procs: int, connections: int, seed: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs = procs
        self.pool = ProcessPoolExecutor(procs, mp_context=ctx, initializer=_client_start,
                                        initargs=(url, files, max(1, connections // procs) + 4, seed))
        list(self.pool.map(time.sleep, [0.5] * procs))  # every process started before the first step

    def cpu(self) -> float:
        """CPU seconds the client processes have used."""
        return sum(thread_cpu(pid)["tree"] for pid in self.pool._processes)

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    def one(self, step: str, args: tuple) -> list[dict]:
        return self.pool.submit(_client_step, step, args).result()

    def split(self, step: str, parts: list[tuple]) -> tuple[list[dict], float]:
        """(every result, wall seconds) of one part a process, all started at once."""
        t0 = time.perf_counter()
        futures = [self.pool.submit(_client_step, step, args) for args in parts]
        results = [r for future in futures for r in future.result()]
        return results, time.perf_counter() - t0

    def each(self, files: int, concurrency: int) -> tuple[list[dict], float]:
        """Every one of `files` files once, by `concurrency` clients."""
        k = self.procs
        return self.split("each", [(list(range(i, files, k)), c) for i, c in enumerate(_shares(concurrency, k))])

    def repeat(self, body: bytes, requests: int, concurrency: int) -> tuple[list[dict], float]:
        """One body `requests` times, by `concurrency` clients."""
        k = self.procs
        return self.split("repeat", [(body, n, c) for n, c in zip(_shares(requests, k), _shares(concurrency, k))])

    def poisson(self, rate: float, seconds: float) -> list[dict]:
        return self.split("poisson", [(rate / self.procs, seconds)] * self.procs)[0]


def server_options(args: argparse.Namespace) -> list[str]:
    """The `glmvit-cupy serve` options a benchmark passes on."""
    fronts = ["--http-workers", str(args.http_workers)] if args.http_workers else []
    return ["--model", str(args.model), "--backend", args.backend, "--max-queue", str(args.max_queue), *fronts]


def benchmark_server_options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-queue", type=int, default=256, help="the server's --max-queue")
    ap.add_argument("--http-workers", type=int, default=0, help="the server's --http-workers [default: its own]")


def _busy(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """The server's CPU over `wall` seconds: its three busiest threads' shares of a core (`main` runs the
    engine's event loop), its process's and its tree's (the HTTP fronts') cores."""
    threads = {name: after[name] - before.get(name, 0.0) for name in after if name != "tree"}
    top = sorted(threads, key=threads.__getitem__, reverse=True)[:3]
    return dict(threads={name: round(threads[name] / wall, 3) for name in top},
                process_cores=round(sum(threads.values()) / wall, 2),
                tree_cores=round((after["tree"] - before["tree"]) / wall, 2))


STAGES = ("queue", "decode", "inference", "request")  # the glmvit_<stage>_duration_seconds histograms
BATCH = ("images", "tokens")  # the glmvit_batch_* histograms: a forward batch's images and merged tokens


def _stage_seconds(server: ServerProcess) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of the server's duration histograms and batch histograms, the engine's busy
    seconds."""
    m = server.metrics()

    def histogram(name: str) -> tuple[float, float]:
        return (sum(v for (n, _), v in m.items() if n == f"{name}_sum"),
                sum(v for (n, _), v in m.items() if n == f"{name}_count"))
    out = {stage: histogram(f"glmvit_{stage}_duration_seconds") for stage in STAGES}
    out |= {f"batch_{what}": histogram(f"glmvit_batch_{what}") for what in BATCH}
    out["engine_busy"] = (sum(v for (name, _), v in m.items() if name == "glmvit_engine_busy_seconds_total"), 1.0)
    return out


def _stage_means(before: dict, after: dict) -> dict[str, float]:
    """Mean ms of each stage between two readings (engine_busy: seconds in total), and a forward batch's
    mean images and merged tokens (their budget is /info's p_max patches over the merge unit)."""
    out = {}
    for stage in STAGES:
        n = after[stage][1] - before[stage][1]
        out[stage] = round(1000 * (after[stage][0] - before[stage][0]) / n, 2) if n else None
    out["engine_busy_s"] = round(after["engine_busy"][0] - before["engine_busy"][0], 2)
    for what in BATCH:
        key = f"batch_{what}"
        n = after[key][1] - before[key][1]
        out[f"batch_{what}_mean"] = round((after[key][0] - before[key][0]) / n, 1) if n else None
    return out


def drive(args: argparse.Namespace, server: ServerProcess, files: list[str], lone: bytes) -> dict:
    url = server.url
    # More connections than the server holds requests, so that overload meets its 429s, not a pool's queue
    info = httpx.get(f"{url}/info").json()
    held = info["limits"]["max_requests"]
    load = Load(url, files, args.clients, held + 4 * args.concurrency, args.seed)
    try:
        geo = info["geometry"]
        record: dict = {"clients": args.clients,
                        "batch_tokens_max": info["limits"]["p_max"] // geo["spatial_merge_size"] ** 2}
        for key, route in (("lone", "/v1/embeddings"), ("lone_embed", "/embed")):
            results = load.one("lone", (lone, args.lone, route, False))
            computed = [r for r in results if r.get("cache") == "miss"]
            if len(computed) < len(results):  # a hit is no lone computation: the step measured nothing
                raise SystemExit(f"serve: error: {len(results) - len(computed)} of the lone requests through {route} "
                                 "were not computed (cache hits or failures)")
            record[key] = dict(latency(results), median_ms=stage_split(results))
            print(f"lone {LONE_SIDE}x{LONE_SIDE} through {route}: {record[key]}", flush=True)
            # The same request's answer from the cache: no decode, no forward, what the rest costs
            results = load.one("lone", (lone + b"hit", args.lone + 1, route, True))[1:]
            hits = [r for r in results if r.get("cache") == "hit"]
            if len(hits) < len(results):
                raise SystemExit(f"serve: error: {len(results) - len(hits)} of the repeated lone requests through "
                                 f"{route} were not cache hits")
            record[f"{key}_hit"] = dict(latency(results), median_ms=stage_split(results))
            print(f"lone {LONE_SIDE}x{LONE_SIDE} cache hits through {route}: {record[f'{key}_hit']}", flush=True)

        results = load.one("alone", (list(range(len(files))),))
        if any(r["status"] != 200 for r in results):
            raise SystemExit(f"serve: error: photos alone: {latency(results)['statuses']}")
        alone_s = {r["source"]: r["latency_s"] for r in results}
        record["alone"] = latency(results)
        print(f"each photo alone: {record['alone']}", flush=True)

        cpu, clients, stages = thread_cpu(server.proc.pid), load.cpu(), _stage_seconds(server)
        results, wall = load.each(len(files), args.concurrency)
        sat = len(files) / wall
        record["saturation"] = dict(latency(results), wall_s=round(wall, 2), images_per_s=round(sat, 2),
                                    concurrency=args.concurrency,
                                    server_cpu=_busy(cpu, thread_cpu(server.proc.pid), wall),
                                    client_cores=round((load.cpu() - clients) / wall, 2),
                                    stage_mean_ms=_stage_means(stages, _stage_seconds(server)))
        print(f"saturation: {record['saturation']}", flush=True)

        record["poisson"] = []
        for share in args.rates:
            results = load.poisson(share * sat, args.rate_s)
            record["poisson"].append(dict(latency(results), share=share, rate=round(share * sat, 2),
                                          slowdown=slowdown(results, alone_s),
                                          p50_ms_split=stage_split(results), p99_ms_split=stage_split(results, 99)))
            print(f"poisson {share:.0%}: {record['poisson'][-1]}", flush=True)

        results = load.poisson(2 * sat, args.duration)
        health = httpx.get(f"{url}/health").status_code
        refused = [r["latency_s"] for r in results if r["status"] == 429]
        record["overload"] = dict(latency(results), rate=round(2 * sat, 2), seconds=args.duration, health_after=health,
                                  lost_or_other=sum(r["status"] not in (200, 429) for r in results),
                                  refused_p99_ms=round(1000 * float(np.percentile(refused, 99)), 2) if refused
                                  else None,
                                  client_wait_p99_ms=round(1000 * float(np.percentile([r["wait_s"] for r in results],
                                                                                      99)), 2))
        print(f"overload: {record['overload']}", flush=True)

        before = {k: server.metric("glmvit_cache_requests_total", result=k) for k in ("hit", "miss", "shared")}
        same = Bodies(lone + b"cache", "image/jpeg").next()  # bytes no earlier request sent
        results, wall = load.repeat(same, args.cache_requests, args.concurrency)
        after = {k: server.metric("glmvit_cache_requests_total", result=k) - before[k] for k in before}
        hits = [r for r in results if r.get("cache") == "hit"]
        record["cache"] = dict(latency(results), requests_per_s=round(len(results) / wall, 2), hits=len(hits),
                               hit_inference_ms_max=max((r["inference_ms"] for r in hits), default=None),
                               metrics=after)
        print(f"cache: {record['cache']}", flush=True)

        samples: list[dict] = []
        pid, seconds, t0 = server.proc.pid, 60 * args.soak_minutes, time.perf_counter()
        stop = threading.Event()

        def sample() -> None:
            while True:
                kinds = tree_rss_kinds(pid)  # which memory moves, if the sum does
                samples.append(dict(t=round(time.perf_counter() - t0, 1),
                                    server_tree_rss_mib=round(tree_memory(pid)[0] / 1024, 1),
                                    **{f"server_tree_{k}_mib": round(v / 1024, 1) for k, v in kinds.items()},
                                    gpu_used_mib=gpu_used_mib()))
                if stop.wait(SAMPLE_S):
                    return
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            results = load.poisson(0.5 * sat, seconds)
        finally:
            stop.set()
            sampler.join()
        record["soak"] = dict(latency(results), minutes=args.soak_minutes, rate=round(0.5 * sat, 2),
                              errors=sum(r["status"] != 200 for r in results), samples=samples,
                              flat={s: flatness(samples, s, seconds, rule) for s, rule in SOAK_FLAT.items()})
        print(f"soak: { {k: v for k, v in record['soak'].items() if k != 'samples'} }", flush=True)
    finally:
        load.close()
    return record


def markdown(r: dict) -> str:
    fwd, env, lone, embed, sat = r["forward_only"], r["env"], r["lone"], r["lone_embed"], r["saturation"]
    cpu = sat["server_cpu"]
    half = next((p for p in r["poisson"] if p["share"] == 0.5), None)
    over, cache, soak = r["overload"], r["cache"], r["soak"]
    flat = ", ".join(f"{s} {'flat' if f['flat'] else 'GROWS'} ({f['first_minute_max']:.0f} -> "
                     f"{f['last_minute_max']:.0f})" if f else f"{s} n/a (too short)" for s, f in soak["flat"].items())
    kinds = ", ".join(f"{k} {soak['samples'][0][f'server_tree_{k}_mib']:.0f} -> {soak['samples'][-1][f'server_tree_{k}_mib']:.0f}"
                      for k in ("anon", "shmem", "file")) if soak["samples"] else "n/a"
    lines = [f"{env['date']}, {env['device']}, {env['cpus']} CPUs, backend {r['backend']}; {r['images']} photos of "
             f"long side <= {LONG_SIDE_MAX} px, base64 responses, --max-queue {r['max_queue']}, {r['clients']} client "
             "processes", "",
             "| measure | value | target |", "| --- | --- | --- |",
             f"| forward only, images/s | {fwd['images_per_s']:.1f} | |",
             f"| saturation ({sat['concurrency']} clients), images/s | {sat['images_per_s']:.1f} | |",
             f"| saturation / forward only | {r['saturation_over_forward']:.2f}x | "
             f">= {TARGETS['saturation_over_forward']}x |",
             f"| meanwhile the server's busiest threads (shares of a core; main: the event loop); its process "
             f"and its tree (decode workers included), cores | "
             f"{', '.join(f'{t} {c:.2f}' for t, c in cpu['threads'].items())}; {cpu['process_cores']:.2f}; "
             f"{cpu['tree_cores']:.2f} | |",
             f"| meanwhile the client processes, cores; the server's mean ms of queue, decode, inference, whole "
             f"request; the engine busy, s; a batch's mean images and merged tokens (budget {r['batch_tokens_max']}) | "
             f"{sat['client_cores']:.2f}; {sat['stage_mean_ms']} | |",
             f"| lone {LONE_SIDE}x{LONE_SIDE}: p50 / p99 ms (its forward {r['lone_forward_ms']:.2f} ms) | "
             f"{lone['p50_ms']} / {lone['p99_ms']} | p50 <= forward + {TARGETS['lone_p50_over_forward_ms']:.0f} ms |",
             f"| lone {LONE_SIDE}x{LONE_SIDE}, medians ms: the server's queue, decode, inference, total headers; "
             f"the client's latency beyond the server's total | {lone['median_ms']} | |",
             f"| the same through `POST /embed` (the file's bytes in, a safetensors file of the pooler out): p50 / "
             f"p99 ms; medians as above | {embed['p50_ms']} / {embed['p99_ms']}; {embed['median_ms']} | |",
             *[f"| the same request repeated, a cache hit (no decode, no forward: the HTTP, the hops and the answer's "
               f"transfer) through {route}: p50 / p99 ms; medians as above | {h['p50_ms']} / {h['p99_ms']}; "
               f"{h['median_ms']} | |" for route, h in (("/v1/embeddings", r["lone_hit"]), ("/embed", r["lone_embed_hit"]))],
             *[row for p in r["poisson"] for row in (
                 f"| Poisson at {p['share']:.0%} ({p['rate']:.1f}/s): p50 / p99 ms, statuses | {p['p50_ms']} / "
                 f"{p['p99_ms']}, {p['statuses']} | " + (f"p99 <= {TARGETS['p99_at_half_over_lone']:.0f}x lone p50"
                                                        if p is half else "") + " |",
                 f"| the same, each stage's p50; p99 ms (as the lone row) | {p['p50_ms_split']}; "
                 f"{p['p99_ms_split']} | |",
                 f"| the same, a request's latency over its photo's alone (p50 {r['alone']['p50_ms']} ms): p50; "
                 f"p99 | {p['slowdown'].get('p50')}; {p['slowdown'].get('p99')} | |")],
             f"| overload 2x ({over['rate']:.1f}/s) for {over['seconds']:.0f} s: statuses; lost or other; "
             f"/health after; 429s' p99 ms; p99 ms a request waited for a client connection | {over['statuses']}; "
             f"{over['lost_or_other']}; {over['health_after']}; {over['refused_p99_ms']}; {over['client_wait_p99_ms']} | "
             "only 200/429, none lost, 200; 429 at once |",
             f"| cache: one image x {cache['requests']}: requests/s, p50 ms, hits (max x-inference-time ms); "
             f"server's counts | {cache['requests_per_s']:.1f}, {cache['p50_ms']}, {cache['hits']} "
             f"({cache['hit_inference_ms_max']}); {cache['metrics']} | hits at 0 ms |",
             f"| soak at 50 % for {soak['minutes']:g} min: errors; memory | {soak['errors']}; {flat} | 0; flat |",
             f"| the soak's tree RSS by kind, MiB, first sample -> last (shmem: the fronts' slots, counted once per "
             f"process mapping them) | {kinds} | |",
             f"| the server's exit status after SIGTERM (drained) | {r['server_exit']} | 0 |"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, collection: Path, out: Path) -> None:
    t0 = time.perf_counter()
    _, everything = load_collection(args, collection)
    files = small_photos(everything)
    lone = lone_image(files[0])
    vit = GlmVit.from_pretrained(args.model, backend=args.backend)
    geo = vit.geometry
    config = ProcessorConfig(patch_size=geo.patch_size, temporal_patch_size=geo.temporal_patch_size,
                             merge_size=geo.spatial_merge_size)
    fwd, _ = forward_only(vit, files, config, args.workers)
    lone_forward = forward_ms(vit, lone)
    print(f"forward only: {fwd}; lone {LONE_SIDE}x{LONE_SIDE} forward {lone_forward:.2f} ms", flush=True)
    del vit
    if args.backend == "cupy":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()

    with ServerProcess(*server_options(args), ready_s=600) as server:
        record = drive(args, server, files, lone)
        status = server.stop(timeout_s=REQUEST_TIMEOUT_S)
    record.update(backend=args.backend, images=len(files), max_queue=args.max_queue,
                  http_workers=args.http_workers or "the server's default", forward_only=fwd,
                  lone_forward_ms=round(lone_forward, 3), server_exit=status,
                  saturation_over_forward=round(record["saturation"]["images_per_s"] / fwd["images_per_s"], 3),
                  env=environment(args.backend), benchmark_wall_s=round(time.perf_counter() - t0, 1))
    save(record, markdown(record), out)


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--concurrency", type=int, default=64, help="clients of the closed loops (saturation, cache)")
    ap.add_argument("--clients", type=int, default=4, help="client processes sharing the load [default: 4]")
    benchmark_server_options(ap)
    ap.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75],
                    help="Poisson rates as shares of saturation [default: 0.25,0.5,0.75]")
    ap.add_argument("--rate-s", type=float, default=30.0, help="seconds at each Poisson rate")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of overload at 2x saturation")
    ap.add_argument("--lone", type=int, default=200, help="lone 448x448 requests, one at a time")
    ap.add_argument("--cache-requests", type=int, default=2000, help="requests of the one cached image")
    ap.add_argument("--soak-minutes", type=float, default=10.0, help="minutes of Poisson at 50 %% of saturation")


if __name__ == "__main__":
    benchmark_main(__doc__, run, ("h200-serve.json", "cpu-serve.json"), options)
