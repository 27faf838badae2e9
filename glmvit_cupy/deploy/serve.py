"""`glmvit-cupy serve`: the HTTP embedding server's engine process (the optional [serve] extra: Starlette,
uvicorn, prometheus-client; imported by nothing else in the package).

The process the command runs holds what must be one: the GlmVit engines (one batcher each,
`GlmVit.batcher`), the encoder cache with its single flight (encoder_cache.py), the GPU's base64,
the warm-up and the engine's metrics; and it binds the one listener. The HTTP is --http-workers
front processes' (front.py: the routes, and all of a request's Python), started here with
workers.Child (they die with this process), each handed the listener and a memfd of slots over
its socket pair (handoff.py). Per image a front asks `lookup`: a cached result is written into the
front's slot at once; otherwise the cache's single flight asks one requester of the key to
`decode` the image into its slot's canvas (another one if it leaves first) and hands the canvas
to the batcher of the engine with the fewest images outstanding; the result is written into every
requester's slot. This process runs no HTTP: its GIL is the engines' launches' and the batchers'.

The first SIGTERM or SIGINT drains: the fronts answer 503 to /health and new work while the
requests they hold finish, then exit, and so does this process (status 0); a second signal exits
at once. A front that dies is replaced (`FRONT_DEATHS` within `FRONT_DEATHS_S`: the server fails).
An engine that cannot serve (the warm-up, a GPU fault) fails the server: /health says why, the
requests held are answered, and the process exits 1 for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from .. import __version__
from ..collection.pipeline import OUTPUTS, prepare
from ..collection.staging import DTYPES
from ..errors import GlmVitError, InputError, Overloaded, RequestTimeout
from ..processor.preprocess import image_input
from ..tower.synthetic import photo_like
from ..workers import Child
from .encoder_cache import EncoderCache
from .front import TIME_BUCKETS, FrontSettings, Limits
from .front import main as front_main
from .handoff import SlotLayout, board_bytes, log_through_thread, mapped, memfd, receive, send, write_arrays

log = logging.getLogger(__name__)

WARMUP_SIDE = 448  # pixels of the warm-up photograph's sides, unless the budget (--max-pixels) is smaller
WARMUP_S = 120.0  # a warm-up past --timeout is tried again for this long
METRICS_PREFIX = "glmvit-serve-metrics-"  # + the server's pid: the fronts' metrics directory in the temp dir
FRONT_DEATHS, FRONT_DEATHS_S = 5, 60.0  # fronts dying this often fail the server: a restart loop helps nobody
# The server process's GIL switch interval (Python's default: 5 ms). A thread that releases the GIL
# for a moment (each CUDA launch and cuBLAS call of the engine's dispatcher, a socket read) waits
# up to one interval to take it back whenever another thread is running Python: at 5 ms a forward's
# hundreds of launches stretch the engine's work (the convoy; benchmarks/NOTES.md, serve-scale).
SWITCH_INTERVAL_S = 0.00025
# A connection's kernel send buffer (Linux doubles it; accepted connections take the listener's). uvloop
# writes a response's first part from the event loop holding the GIL: as much as the buffer takes, up
# to 4 MB under the kernel's autotuning (~0.5-0.7 ms a 9 MB answer); the rest goes out from libuv's
# loop without the GIL. 512 KiB: ~0.1 ms, loopback as fast, and 1 GB/s a connection at a 1 ms round trip.
SEND_BUFFER_BYTES = 2**19


class Metrics:
    """The engine's Prometheus metrics (the fronts count the requests; front.py): a front's /metrics
    appends this registry's text to theirs."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_seconds = Histogram("glmvit_queue_duration_seconds", "An image computed: submit to its batch "
                                       "reaching the engine", buckets=TIME_BUCKETS, registry=r)
        self.decode_seconds = Histogram("glmvit_decode_duration_seconds", "An image computed: its decode and resize",
                                        buckets=TIME_BUCKETS, registry=r)
        self.inference_seconds = Histogram("glmvit_inference_duration_seconds", "An image computed: its batch's "
                                           "forward and transfers", buckets=TIME_BUCKETS, registry=r)
        self.batch_images = Histogram("glmvit_batch_images", "Images of a forward batch",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_tokens = Histogram("glmvit_batch_tokens", "Merged tokens of a forward batch",
                                      buckets=tuple(2 ** k for k in range(4, 16)), registry=r)
        r.register(_StateCollector(engine))

    def on_batch(self, images: int, tokens: int, inference_s: float) -> None:
        """The batchers' per-batch callback (from an engine thread: prometheus-client is thread-safe)."""
        self.batch_images.observe(images)
        self.batch_tokens.observe(tokens)

    def computed(self, timing: Any) -> None:
        self.queue_seconds.observe(timing.queue_s)
        self.decode_seconds.observe(timing.decode_s)
        self.inference_seconds.observe(timing.inference_s)


class _StateCollector:
    """Read at each scrape: the batchers' stats (one `engine` label each), the cache and the model."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine
        gauges = {"queue_size": "Requests waiting or decoding", "batches_in_flight": "Batches on the engine",
                  "engine_busy_ratio": "Engine (GPU) busy fraction since start"}
        counters = {"engine_requests": "Requests submitted to the engine", "engine_batches": "Forward batches",
                    "engine_images": "Images through a forward", "engine_tokens": "Merged tokens through a forward",
                    "engine_busy_seconds": "Seconds the engine (GPU) computed"}
        families = {name: GaugeMetricFamily(f"glmvit_{name}", doc, labels=["engine"]) for name, doc in gauges.items()}
        families |= {name: CounterMetricFamily(f"glmvit_{name}", doc, labels=["engine"])
                     for name, doc in counters.items()}
        for i, batcher in enumerate(s.batchers):
            stats, engine = batcher.stats(), [str(i)]
            values = {"queue_size": stats.queue_depth, "batches_in_flight": stats.in_flight,
                      "engine_busy_ratio": stats.gpu_busy_s / stats.uptime_s if stats.uptime_s > 0 else 0.0,
                      "engine_requests": stats.requests, "engine_batches": stats.batches,
                      "engine_images": stats.images, "engine_tokens": stats.tokens,
                      "engine_busy_seconds": stats.gpu_busy_s}
            for name, value in values.items():
                families[name].add_metric(engine, value)
        yield from families.values()
        cache = CounterMetricFamily("glmvit_cache_requests", "Encoder cache lookups: hit (stored), miss "
                                    "(computed), shared (joined an identical computation in flight)", labels=["result"])
        for result, count in s.cache.counts.items():
            cache.add_metric([result], count)
        yield cache
        yield GaugeMetricFamily("glmvit_cache_bytes", "Bytes of the cached results", value=s.cache.bytes)
        yield GaugeMetricFamily("glmvit_cache_capacity_bytes", "--cache-bytes", value=s.cache.max_bytes)
        yield GaugeMetricFamily("glmvit_cache_entries", "Cached results", value=s.cache.entries)
        yield CounterMetricFamily("glmvit_cache_evictions", "Results evicted (LRU)", value=s.cache.evictions)
        yield GaugeMetricFamily("glmvit_ready", "1 once warmed up and not draining", value=float(s.status() == "ok"))
        yield GaugeMetricFamily("glmvit_http_fronts", "HTTP front processes running", value=s.fronts_alive())
        info = InfoMetricFamily("glmvit_engine", "The model served")
        vit = s.vits[0]
        info.add_metric([], {"model": s.model, "backend": vit.backend, "fingerprint": vit.fingerprint,
                             "engines": str(len(s.vits)), "version": __version__})
        yield info


@dataclasses.dataclass(eq=False)
class _Requester:
    """A front's lookup of a key, in flight. `canvas`: set when the flight asked it to decode (its
    message, or None: it left first); `released`: set once the batcher no longer reads its slot."""

    link: _FrontLink
    id: int
    slot: int
    canvas: asyncio.Future | None = None
    released: asyncio.Future | None = None


@dataclasses.dataclass(eq=False)
class _FrontLink:
    """The engine's end of one front: its process, its slots, its lookups in flight."""

    index: int
    child: Child
    memory: Any  # the memfd's bytes (uint8)
    writer: asyncio.StreamWriter
    tasks: dict[int, asyncio.Task] = dataclasses.field(default_factory=dict)
    requesters: dict[int, _Requester] = dataclasses.field(default_factory=dict)
    held: int | None = None  # the requests it held when told to drain
    closed: bool = False

    def send(self, message: dict[str, Any]) -> None:
        if not self.closed:
            send(self.writer, message)


class Engine:
    """The engine process's state: `vits` (one engine each, one batcher each), the cache, the fronts."""

    def __init__(self, vits: Sequence[Any], model: str, directory: Path, limits: Limits, http_workers: int,
                 sock: socket.socket, metrics_dir: str) -> None:
        self.vits, self.model, self.limits, self.sock = list(vits), model, limits, sock
        self.http_workers, self.metrics_dir = http_workers, metrics_dir
        vit = self.vits[0]
        self.cache = EncoderCache(limits.cache_bytes, vit.fingerprint, vit.processor)
        self.metrics = Metrics(self)
        self.batchers: list[Any] = []
        self.outstanding = [0] * len(self.vits)  # images submitted to each engine's batcher, not yet answered
        self.ready = self.draining = False
        self.failure: str | None = None  # why the engine cannot serve: the server exits (status 1)
        self.max_requests = 2 * limits.max_queue * len(self.vits)  # a queue's worth waiting, as many again answered
        self.layout = SlotLayout.of(vit.processor, vit.geometry, math.ceil(self.max_requests / http_workers))
        self.requesters: dict[str, list[_Requester]] = {}  # by cache key: who could decode its image
        self.links: list[_FrontLink | None] = [None] * http_workers
        self.board = memfd(board_bytes(http_workers))  # the fronts' (front.py), passed to each
        self.connections = mapped(self.board, board_bytes(http_workers)).view(np.int64)
        self.deaths: list[float] = []
        self.done = asyncio.Event()
        self.info = {
            "model": model, "directory": str(directory), "version": __version__, "backend": vit.backend,
            "engines": len(self.vits), "fingerprint": vit.fingerprint,
            "geometry": dataclasses.asdict(vit.geometry), "processor": dataclasses.asdict(vit.processor),
            "outputs": list(OUTPUTS), "dtypes": list(DTYPES),
            "limits": {"max_queue": limits.max_queue, "max_requests": self.max_requests,
                       "max_wait_ms": limits.max_wait_ms, "timeout_s": limits.timeout_s,
                       "payload_limit": limits.payload_limit, "cache_bytes": limits.cache_bytes,
                       "allow_files": None if limits.allow_files is None else str(limits.allow_files),
                       "p_max": vit.p_max, "http_workers": http_workers}}
        self.base64: Any = None  # on a GPU, base64 answers are encoded there (device_base64.py)
        if vit.backend == "cupy":
            from ..gpu.device_base64 import DeviceBase64
            self.base64 = DeviceBase64(vit.tower.current)

    def status(self) -> str:
        if self.failure is not None:
            return f"failed: {self.failure}"
        if self.draining:
            return "draining"
        return "ok" if self.ready else "starting"

    def fronts_alive(self) -> int:
        return sum(link is not None for link in self.links)

    def _tell_fronts(self) -> None:
        for link in self.links:
            if link is not None:
                link.send({"op": "status", "status": self.status()})

    # -- life -------------------------------------------------------------------------------------

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled)
        # No decode workers: the fronts decode.
        self.batchers = [vit.batcher(max_wait_ms=self.limits.max_wait_ms, max_queue=self.limits.max_queue,
                                     timeout_s=self.limits.timeout_s, on_batch=self.metrics.on_batch)
                         for vit in self.vits]
        warmup = asyncio.ensure_future(self._warm_up())
        for index in range(self.http_workers):
            await self._start_front(index)
        await self.done.wait()
        warmup.cancel()
        for link in self.links:  # a second signal: the fronts go at once
            if link is not None:
                link.child.kill()
        await asyncio.gather(*(asyncio.to_thread(b.close) for b in self.batchers))
        return 1 if self.failure is not None else 0

    async def _warm_up(self) -> None:
        """One encode on every engine before /health says 200 (a GPU engine's first call of a grid
        builds its kernels' tables and graph)."""
        t0 = time.perf_counter()
        config = self.vits[0].processor  # the largest square up to WARMUP_SIDE within one forward call's budget
        side = min(WARMUP_SIDE, config.patch_size * config.merge_size * (math.isqrt(self.vits[0].p_max) // config.merge_size))
        prep = await asyncio.to_thread(prepare, image_input(photo_like(side, side), "the warm-up image"), config)
        while True:
            try:
                await asyncio.gather(*(asyncio.wrap_future(b.submit_canvas(prep.canvas, "the warm-up image",
                                                                           prep.decode_s)) for b in self.batchers))
                break
            except RequestTimeout as exc:
                if time.perf_counter() - t0 > WARMUP_S:
                    self.fail(f"the warm-up encode did not succeed within {WARMUP_S:g} s: {exc}")
                    return
                log.info("glmvit-cupy: the warm-up encode timed out (%s); trying again", exc)
            except Exception as exc:
                if not isinstance(exc, GlmVitError):
                    log.error("%s", traceback.format_exc().rstrip())
                self.fail(f"the warm-up encode failed: {exc}")
                return
        self.ready = True
        self._tell_fronts()
        log.info("glmvit-cupy: ready (warm-up encode on %d engine(s) in %.1f s)", len(self.batchers),
                 time.perf_counter() - t0)

    def fail(self, reason: str) -> None:
        """The engine cannot serve: /health says why, and the server exits with status 1 (to be restarted)."""
        if self.failure is None:
            self.failure = reason
            log.error("glmvit-cupy: error: %s; exiting", reason)
            self._tell_fronts()
            self._stop_if_idle()

    def _signalled(self) -> None:
        if self.draining:  # the second signal
            self.done.set()
            return
        self.draining = True
        self._tell_fronts()
        self._stop_if_idle()

    def _stop_if_idle(self) -> None:
        """Once draining or failed, no front is started again, and the process ends when its last front
        has. The listener is the fronts' alone from then: once the last has stopped accepting, a new
        connection is refused, not left in a backlog nobody reads."""
        if self.draining or self.failure is not None:
            self.sock.close()
            if self.fronts_alive() == 0:
                self.done.set()

    # -- the fronts -------------------------------------------------------------------------------

    async def _start_front(self, index: int) -> None:
        if self.draining or self.failure is not None:  # the listener is closed: the fronts only go now
            return
        settings = FrontSettings(index, self.model, self.info, self.limits, self.layout.slots, self.http_workers,
                                 self.layout, self.vits[0].processor)
        child = Child(front_main, (settings,), f"glmvit-cupy HTTP front {index}",
                      env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir})
        channel = socket.socket(fileno=os.dup(child.conn.fileno()))
        child.conn.close()
        fd = memfd(self.layout.size)
        try:
            socket.send_fds(channel, [b"f"], [self.sock.fileno(), fd, self.board])
            memory = mapped(fd, self.layout.size)
        finally:
            os.close(fd)
        reader, writer = await asyncio.open_connection(sock=channel)
        link = self.links[index] = _FrontLink(index, child, memory, writer)
        link.send({"op": "status", "status": self.status()})
        asyncio.ensure_future(self._serve_front(link, reader))
        log.info("glmvit-cupy: HTTP front %d started (pid %d)", index, child.pid)

    async def _serve_front(self, link: _FrontLink, reader: asyncio.StreamReader) -> None:
        """One front's messages until it closes its end (it exited or died)."""
        while True:
            try:
                message = await receive(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            op, key = message["op"], message.get("id")
            if op == "lookup":
                task = link.tasks[key] = asyncio.ensure_future(self._lookup(link, message))
                task.add_done_callback(lambda _, key=key: link.tasks.pop(key, None))
            elif op == "canvas":
                requester = link.requesters.get(key)
                if requester is not None and requester.canvas is not None and not requester.canvas.done():
                    requester.canvas.set_result(message)
            elif op == "cancel":
                if key in link.tasks:
                    link.tasks[key].cancel()
            elif op == "metrics":
                link.send({"op": "metrics", "id": key, "text": generate_latest(self.metrics.registry).decode()})
            elif op == "held":
                link.held = message["active"]
                alive = [other for other in self.links if other is not None]
                if all(other.held is not None for other in alive):
                    log.info("glmvit-cupy: draining: %d request(s) to finish, then exit",
                             sum(other.held for other in alive))
        link.closed = True
        for task in list(link.tasks.values()):
            task.cancel()
        await asyncio.to_thread(link.child.join, 5.0)
        self.links[link.index] = None
        if self.draining or self.failure is not None:
            self._stop_if_idle()
            return
        code = link.child.exitcode
        how = "still running" if code is None else f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < FRONT_DEATHS_S] + [now]
        if len(self.deaths) >= FRONT_DEATHS:
            self.fail(f"the HTTP fronts keep dying: {FRONT_DEATHS} deaths within {FRONT_DEATHS_S:g} s (front "
                      f"{link.index}, pid {link.child.pid}: {how})")
            return
        log.error("glmvit-cupy: HTTP front %d (pid %d) died (%s); starting another", link.index, link.child.pid, how)
        self.connections[link.index] = np.iinfo(np.int64).max  # no front waits for it to accept
        link.child.kill()
        await self._start_front(link.index)

    # -- the work ---------------------------------------------------------------------------------

    async def _lookup(self, link: _FrontLink, message: dict[str, Any]) -> None:
        """One image of a front's request: its result (stored, shared or computed) written into the
        front's slot, or its failure, in the reply."""
        output, dtype = message["output"], message["dtype"]
        key = self.cache.key(message["digest"], output, dtype)
        me = link.requesters[message["id"]] = _Requester(link, message["id"], message["slot"])
        self.requesters.setdefault(key, []).append(me)
        reply: dict[str, Any] = {"op": "error", "id": me.id}
        try:
            try:
                result, outcome = await self.cache.get(key, lambda: self._compute(key, output, dtype))
            finally:
                self._leave(key, me)
                if me.released is not None:  # the batcher may still read the canvas in its slot
                    await asyncio.shield(me.released)
            area = self.layout.answer(link.memory, me.slot)
            arrays = {name: getattr(result, name) for name in OUTPUTS[output]}
            encode = self.base64.encode if self.base64 is not None and message["base64"] else None
            specs = await asyncio.to_thread(write_arrays, area, arrays, encode)
            timing = result.timing
            reply = {"op": "answer", "id": me.id, "cache": outcome, "arrays": specs,
                     "grid_thw": result.grid_thw[0].tolist(),
                     "timing": [timing.queue_s, timing.decode_s, timing.inference_s]}
        except asyncio.CancelledError:
            reply |= {"kind": "gone", "message": "cancelled"}  # the slot is the front's again
            raise
        except Overloaded as exc:
            reply |= {"kind": "overloaded", "message": f"overloaded: {exc}"}
        except RequestTimeout as exc:
            reply |= {"kind": "timeout", "message": str(exc)}
        except InputError as exc:
            reply |= {"kind": "input", "message": str(exc)}
        except GlmVitError as exc:  # the engine's own failure (a GPU fault): the process must be restarted
            self.fail(f"the engine failed: {exc}")
            reply |= {"kind": "engine", "message": f"the engine failed: {exc}"}
        except Exception as exc:
            log.error("glmvit-cupy: internal error on a lookup\n%s", traceback.format_exc().rstrip())
            line = str(exc).splitlines()[0] if str(exc) else ""
            reply |= {"kind": "internal", "message": f"internal error ({type(exc).__name__}: {line})"}
        finally:
            link.send(reply)

    def _leave(self, key: str, me: _Requester) -> None:
        del me.link.requesters[me.id]
        requesters = self.requesters[key]
        requesters.remove(me)
        if not requesters:
            del self.requesters[key]
        if me.canvas is not None and not me.canvas.done():
            me.canvas.set_result(None)  # the flight asks another requester

    async def _compute(self, key: str, output: str, dtype: str) -> Any:
        """The flight of `key`: a requester's canvas (the first still there that was not asked yet),
        through the batcher of the engine with the fewest images outstanding (--devices)."""
        loop = asyncio.get_running_loop()
        while True:
            me = next(r for r in self.requesters[key] if r.canvas is None)  # a flight has a requester until it ends
            me.canvas = loop.create_future()
            me.link.send({"op": "decode", "id": me.id})
            decoded = await me.canvas
            if decoded is not None:
                break
        if "error" in decoded:
            raise InputError(decoded["error"])
        canvas = self.layout.canvas(me.link.memory, me.slot, tuple(decoded["shape"]))
        engine = min(range(len(self.batchers)), key=self.outstanding.__getitem__)
        released = me.released = loop.create_future()
        self.outstanding[engine] += 1
        try:  # named for messages neutrally: a computation may be shared by several requests
            future = self.batchers[engine].submit_canvas(canvas, "image", decoded["decode_s"], output=output,
                                                         dtype=dtype)
        except BaseException:  # refused (Overloaded): the batcher never read the canvas
            self.outstanding[engine] -= 1
            released.set_result(None)
            raise
        # Done (cancelled included: then no batch will read it), the canvas is the front's again.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(_settle, released))
        try:
            result = await asyncio.wrap_future(future)
        finally:
            self.outstanding[engine] -= 1
        self.metrics.computed(result.timing)
        return result


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def listen(host: str, port: int) -> socket.socket:
    """A bound socket (port 0: any free one), so that the start line can name the port before serving;
    the connections it accepts send through SEND_BUFFER_BYTES."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until a front serves them (uvicorn's own default)
    except OSError as exc:
        raise GlmVitError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def _remove_dead_servers_metrics() -> None:
    """The metrics directories of servers that died without removing them (SIGKILL, the OOM killer):
    each is named for its server's pid, and one whose process is gone is no one's."""
    for path in Path(tempfile.gettempdir()).glob(f"{METRICS_PREFIX}*-*"):
        pid = path.name[len(METRICS_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


def run(vits: Sequence[Any], *, model: str, directory: Path, limits: Limits, sock: socket.socket,
        http_workers: int) -> int:
    """Serve until drained (0) or until the engine fails (1); the fronts log a line a request on stderr.
    The fronts' request counts live in a directory of this process's (prometheus-client's multiprocess
    files), removed at exit."""
    lines = log_through_thread(log)
    _remove_dead_servers_metrics()
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
    try:
        return _serve(vits, model, directory, limits, sock, http_workers, metrics_dir)
    finally:
        shutil.rmtree(metrics_dir)
        lines.stop()  # the lines queued are written first


def _serve(vits: Sequence[Any], model: str, directory: Path, limits: Limits, sock: socket.socket,
           http_workers: int, metrics_dir: str) -> int:
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # this process is the server's: no other caller to disturb
    host, port = sock.getsockname()[:2]
    vit = vits[0]
    geo = vit.geometry
    log.info("glmvit-cupy: serving %s (%d-block tower, out %d, fingerprint %s, backend %s x %d) on http://%s:%d; "
             "/health is 200 after a warm-up encode; %d HTTP front(s)", model, geo.depth, geo.out_hidden_size,
             vit.fingerprint[:12], vit.backend, len(vits), f"[{host}]" if ":" in host else host, port, http_workers)

    async def main() -> int:
        return await Engine(vits, model, directory, limits, http_workers, sock, metrics_dir).main()

    try:
        import uvloop  # as uvicorn's fronts run: the engine's loop carries every front's messages
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
