"""`glmvit-cupy serve`: the HTTP embedding server (the optional [serve] extra: Starlette, uvicorn,
prometheus-client; imported by nothing else in the package).

    POST /v1/embeddings   OpenAI-shaped JSON: images as data:image/...;base64, URLs in, embeddings out
    POST /embed           an image file's bytes in, a safetensors file (or .npy) out
    GET  /health          200 once a warm-up encode has run; 503 while starting, draining or broken
    GET  /info            model, fingerprint, geometry, processor settings, limits
    GET  /metrics         Prometheus text

A thin layer over the library's batcher (one per engine, `GlmVit.batcher`): requests from every
connection are decoded on its workers and packed into shared forward calls; results go through the
encoder cache (encoder_cache.py). Every failure is one status and one line (`HttpError`), and one bad
request fails alone. At most 2 x --max-queue requests per engine are held, arrival to response sent;
past it 429 at once (`Service.admit`). A client that disconnects has its queued work cancelled. The
first SIGTERM or SIGINT drains: /health and new work answer 503 while the accepted requests finish,
then uvicorn shuts down and the process exits 0 (`DrainingServer`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import logging
import logging.handlers
import math
import queue
import re
import socket
import sys
import time
import traceback
import urllib.parse
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import numpy as np
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from ..collection.pipeline import DEFAULT_OUTPUT, DEFAULT_WORKERS, OUTPUTS
from ..collection.staging import DEFAULT_DTYPE, DTYPES
from ..errors import GlmVitError, InputError, Overloaded, RequestTimeout
from ..processor.preprocess import EncodedImage
from ..tower.synthetic import photo_like
from ..tower.writer import flat_bytes, safetensors_chunks
from .encoder_cache import HIT, EncoderCache, image_digest

log = logging.getLogger(__name__)

WARMUP_SIDE = 448  # pixels of the warm-up photograph's sides, unless the budget (--max-pixels) is smaller
WARMUP_S = 120.0  # a warm-up past --timeout is tried again for this long: the first also waits for the workers
B64_SLICE = 3 * 2**18  # bytes of an embedding base64-encoded at a time (host base64): 1 MiB of base64
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never sent
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
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64"}
MEDIA_SAFETENSORS, MEDIA_NPY = "application/octet-stream", "application/x-npy"
_DATA_URL = re.compile(r"data:image/[\w.+-]+(?:;[\w.+-]+=[^;,]*)*;base64,(.*)", re.S)
_B64_VALUES = np.full(256, 255, dtype=np.uint8)  # a base64 character's 6 bits; 255: not base64
_B64_VALUES[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", np.uint8)] = np.arange(64)
_EMBEDDINGS_FIELDS = {"input", "model", "encoding_format", "output", "dtype"}
_TIME_BUCKETS = (.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30, 60)


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server admits; the batcher's options are passed to `GlmVit.batcher` as they are."""

    max_queue: int
    max_wait_ms: float
    timeout_s: float
    payload_limit: int  # bytes of a request body (and of a file read through allow_files)
    cache_bytes: int
    allow_files: Path | None  # the directory path inputs must lie under; None: no paths


class HttpError(Exception):
    """A request's failure: its status and one line for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _ClientGone(Exception):
    """The client disconnected before its response."""


@dataclasses.dataclass
class _Timing:
    """A response's timing headers, seconds: its images' slowest queue, decode and inference."""

    queue_s: float = 0.0
    decode_s: float = 0.0
    inference_s: float = 0.0

    def add(self, timing: Any) -> None:
        self.queue_s = max(self.queue_s, timing.queue_s)
        self.decode_s = max(self.decode_s, timing.decode_s)
        self.inference_s = max(self.inference_s, timing.inference_s)


@dataclasses.dataclass
class _Encoded:
    output: Any  # GlmVitOutput
    cache: str  # HIT, MISS or SHARED


class Metrics:
    """The Prometheus metrics of one app (its own registry, so several apps never collide)."""

    def __init__(self, service: Service) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("glmvit_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.request_seconds = Histogram("glmvit_request_duration_seconds", "Whole HTTP request, body read to "
                                         "response built", ["route"], buckets=_TIME_BUCKETS, registry=r)
        self.queue_seconds = Histogram("glmvit_queue_duration_seconds", "An image computed: submit to its batch "
                                       "reaching the engine (decode included)", buckets=_TIME_BUCKETS, registry=r)
        self.decode_seconds = Histogram("glmvit_decode_duration_seconds", "An image computed: its decode and resize",
                                        buckets=_TIME_BUCKETS, registry=r)
        self.inference_seconds = Histogram("glmvit_inference_duration_seconds", "An image computed: its batch's "
                                           "forward and transfers", buckets=_TIME_BUCKETS, registry=r)
        self.batch_images = Histogram("glmvit_batch_images", "Images of a forward batch",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_tokens = Histogram("glmvit_batch_tokens", "Merged tokens of a forward batch",
                                      buckets=tuple(2 ** k for k in range(4, 16)), registry=r)
        r.register(_StateCollector(service))

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

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self):
        s = self.service
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
        info = InfoMetricFamily("glmvit_engine", "The model served")
        vit = s.vits[0]
        info.add_metric([], {"model": s.model, "backend": vit.backend, "fingerprint": vit.fingerprint,
                             "engines": str(len(s.vits)), "version": __version__})
        yield info


class Service:
    """The server's state and routes over `vits` (one engine each, one batcher each)."""

    def __init__(self, vits: Sequence[Any], model: str, directory: Path, limits: Limits) -> None:
        self.vits, self.model, self.directory, self.limits = list(vits), model, directory, limits
        self.cache = EncoderCache(limits.cache_bytes, self.vits[0].fingerprint, self.vits[0].processor)
        self.metrics = Metrics(self)
        self.batchers: list[Any] = []
        self.outstanding = [0] * len(self.vits)  # images submitted to each engine's batcher, not yet answered
        self.ready = self.draining = False
        self.failure: str | None = None  # why the engine cannot serve: the server exits (status 1)
        self.max_requests = 2 * limits.max_queue * len(self.vits)  # a queue's worth waiting, as many again answered
        self.active = 0  # work requests held, arrival to response sent: the drain waits for them, 429 past max_requests
        self.base64: Any = None  # on a GPU, base64 answers are encoded there (device_base64.py)
        if self.vits[0].backend == "cupy":
            from ..gpu.device_base64 import DeviceBase64
            self.base64 = DeviceBase64(self.vits[0].tower.current)

    def status(self) -> str:
        if self.failure is not None:
            return f"failed: {self.failure}"
        if self.draining:
            return "draining"
        return "ok" if self.ready else "starting"

    # -- life -------------------------------------------------------------------------------------

    async def start(self) -> None:
        workers = max(1, DEFAULT_WORKERS // len(self.vits))  # the host's decode cores, shared by the engines
        self.batchers = [vit.batcher(max_wait_ms=self.limits.max_wait_ms, max_queue=self.limits.max_queue,
                                     timeout_s=self.limits.timeout_s, workers=workers, on_batch=self.metrics.on_batch)
                         for vit in self.vits]
        self._warmup = asyncio.ensure_future(self._warm_up())

    async def _warm_up(self) -> None:
        """One encode on every engine before /health says 200 (a GPU engine's first call of a grid
        builds its kernels' tables and graph)."""
        t0 = time.perf_counter()
        config = self.vits[0].processor  # the largest square up to WARMUP_SIDE within one forward call's budget
        side = min(WARMUP_SIDE, config.patch_size * config.merge_size * (math.isqrt(self.vits[0].p_max) // config.merge_size))
        image = photo_like(side, side)
        while True:
            try:
                await asyncio.gather(*(b.aencode(image) for b in self.batchers))
                break
            except RequestTimeout as exc:  # the first encode also waits for the decode workers to start
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
        log.info("glmvit-cupy: ready (warm-up encode on %d engine(s) in %.1f s)", len(self.batchers),
                 time.perf_counter() - t0)

    def fail(self, reason: str) -> None:
        """The engine cannot serve: /health says why, and the server exits with status 1 (to be restarted)."""
        if self.failure is None:
            self.failure = reason
            log.error("glmvit-cupy: error: %s; exiting", reason)

    async def stop(self) -> None:
        """Close the batchers (each finishes its queued and in-flight work) from a thread."""
        self._warmup.cancel()
        await asyncio.gather(*(asyncio.to_thread(b.close) for b in self.batchers))

    # -- routes -----------------------------------------------------------------------------------

    async def embeddings(self, request: Request, timing: _Timing) -> Response:
        body = await _read_body(request, self.limits.payload_limit)
        inputs, output, dtype, encoding = _parse_embeddings(body, self.model)
        images = await asyncio.gather(*(self._input_bytes(i, item) for i, item in enumerate(inputs)))
        encoded = await _unless_disconnected(request, self._encode_all(images, output, dtype, timing))
        # Off the event loop: a real tower's image is megabytes of embedding to encode
        parts = await asyncio.to_thread(_embeddings_parts, [e.output for e in encoded], output, encoding, self.model,
                                        self.base64)
        return _PartsResponse(parts, {"x-cache": ",".join(e.cache for e in encoded)})

    async def embed(self, request: Request, timing: _Timing) -> Response:
        output = request.query_params.get("output", DEFAULT_OUTPUT)
        dtype = request.query_params.get("dtype", DEFAULT_DTYPE)
        _check_choice("output", output, OUTPUTS)
        _check_choice("dtype", dtype, DTYPES)
        media = _media_type(request.headers.get("accept"))
        if media == MEDIA_NPY and (output == "both" or dtype == "bfloat16"):
            raise HttpError(400, "a .npy holds one array in a NumPy dtype: ask for output pooler or last_hidden "
                                 "in float32 or float16, or for safetensors (Accept: application/octet-stream)")
        body = await _read_body(request, self.limits.payload_limit)
        if not body:
            raise HttpError(400, "empty body: send the image file's bytes")
        (one,) = await _unless_disconnected(request, self._encode_all([("body", body)], output, dtype, timing))
        arrays = _arrays(one.output, output)
        headers = {"x-cache": one.cache}
        if media == MEDIA_NPY:
            return Response(_npy(next(iter(arrays.values()))), media_type=MEDIA_NPY, headers=headers)
        tensors = {**arrays, "grid_thw": one.output.grid_thw}
        specs = [(name, SAFETENSORS_DTYPES[a.dtype.name], list(a.shape)) for name, a in tensors.items()]
        data = (flat_bytes(a).data for a in tensors.values())
        return _PartsResponse(list(safetensors_chunks(specs, data, "/embed")), headers, MEDIA_SAFETENSORS)

    async def health(self, request: Request, timing: _Timing) -> Response:
        status = self.status()
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    async def info(self, request: Request, timing: _Timing) -> Response:
        vit, limits = self.vits[0], self.limits
        return JSONResponse({
            "model": self.model, "directory": str(self.directory), "version": __version__, "backend": vit.backend,
            "engines": len(self.vits), "fingerprint": vit.fingerprint,
            "geometry": dataclasses.asdict(vit.geometry), "processor": dataclasses.asdict(vit.processor),
            "outputs": list(OUTPUTS), "dtypes": list(DTYPES),
            "limits": {"max_queue": limits.max_queue, "max_requests": self.max_requests,
                       "max_wait_ms": limits.max_wait_ms, "timeout_s": limits.timeout_s,
                       "payload_limit": limits.payload_limit, "cache_bytes": limits.cache_bytes,
                       "allow_files": None if limits.allow_files is None else str(limits.allow_files),
                       "p_max": vit.p_max}})

    async def prometheus(self, request: Request, timing: _Timing) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # -- the work ---------------------------------------------------------------------------------

    async def _input_bytes(self, index: int, item: str) -> tuple[str, bytes]:
        """(its name in messages, the image file's bytes) of one /v1/embeddings input."""
        where = f"input {index}"
        found = _DATA_URL.fullmatch(item)
        if found is not None:
            try:  # off the event loop, and mostly without the GIL (b64decode's C loop holds it)
                return where, await asyncio.to_thread(b64decode, found.group(1))
            except ValueError as exc:
                raise HttpError(400, f"{where}: the data URL's base64 does not decode: {exc}") from None
        if item.startswith("data:"):
            raise HttpError(400, f"{where}: a data URL must read data:image/<type>;base64,<bytes>")
        return where, await self._file_bytes(where, item)

    async def _file_bytes(self, where: str, item: str) -> bytes:
        """A path (or file:// URL) under --allow-files: no client reads the rest of the server's disk."""
        scheme = urllib.parse.urlsplit(item).scheme
        if scheme not in ("", "file"):
            raise HttpError(400, f"{where}: the server fetches no {scheme}:// URLs: send the image as a "
                                 "data:image/...;base64, URL")
        root = self.limits.allow_files
        if root is None:
            raise HttpError(403, f"{where}: the server reads no files (start it with --allow-files DIR to allow "
                                 "paths under DIR): send the image as a data:image/...;base64, URL")
        path = (root / urllib.parse.unquote(urllib.parse.urlsplit(item).path if scheme else item)).resolve()
        if not path.is_relative_to(root):
            raise HttpError(403, f"{where}: {item} lies outside --allow-files {root}")
        try:
            size = path.stat().st_size
            if size > self.limits.payload_limit:
                raise HttpError(413, f"{where}: {item} holds {size:,} bytes, over the payload limit of "
                                     f"{self.limits.payload_limit:,}")
            return await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            raise HttpError(422, f"{where}: {item}: cannot read: {exc.strerror or exc}") from None

    async def _encode_all(self, images: list[tuple[str, bytes]], output: str, dtype: str,
                          timing: _Timing) -> list[_Encoded]:
        """Every image of a request at once; the first failure fails the request and cancels the rest."""
        tasks = [asyncio.ensure_future(self._encode_one(where, data, output, dtype)) for where, data in images]
        try:
            encoded = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        for one in encoded:
            if one.cache != HIT:  # a hit did no queue, decode or forward
                timing.add(one.output.timing)
        return encoded

    async def _encode_one(self, where: str, data: bytes, output: str, dtype: str) -> _Encoded:
        key = self.cache.key(image_digest(data), output, dtype)
        try:
            result, outcome = await self.cache.get(key, lambda: self._compute(data, output, dtype))
        except Overloaded as exc:
            raise HttpError(429, f"overloaded: {exc}") from None
        except RequestTimeout as exc:
            raise HttpError(504, f"{where}: {exc}") from None
        except InputError as exc:
            raise HttpError(422, f"{where}: {exc}") from None
        except GlmVitError as exc:  # the engine's own failure (a GPU fault): the process must be restarted
            self.fail(f"the engine failed: {exc}")
            raise HttpError(500, f"{where}: the engine failed: {exc}") from None
        return _Encoded(result, outcome)

    async def _compute(self, data: bytes, output: str, dtype: str) -> Any:
        """One image through the batcher of the engine with the fewest images outstanding (--devices)."""
        engine = min(range(len(self.batchers)), key=self.outstanding.__getitem__)
        self.outstanding[engine] += 1
        try:  # named for messages neutrally: a computation may be shared by several requests
            result = await self.batchers[engine].aencode(EncodedImage("image", data), output=output, dtype=dtype)
        finally:
            self.outstanding[engine] -= 1
        self.metrics.computed(result.timing)
        return result

    # -- the app ----------------------------------------------------------------------------------

    def route(self, path: str, handler: Callable[[Request, _Timing], Awaitable[Response]], method: str,
              work: bool) -> Route:
        """`handler` with what every response gets: errors as one line and a status, timing headers, the
        request counted and logged. `work`: an embedding route (refused while draining; `admit` counts it)."""
        async def endpoint(request: Request) -> Response:
            t0, timing = time.perf_counter(), _Timing()
            try:
                if work and self.draining:
                    raise HttpError(503, "draining: the server is shutting down; send to another replica")
                response = await handler(request, timing)
                note = response.headers.get("x-cache", "")
            except HttpError as exc:
                response, note = _error(exc.status, str(exc)), str(exc)
            except (_ClientGone, ClientDisconnect):
                response, note = Response(status_code=CLIENT_GONE), "client disconnected: its work dropped"
            except Exception as exc:
                log.error("glmvit-cupy: internal error on %s %s\n%s", method, path, traceback.format_exc().rstrip())
                line = str(exc).splitlines()[0] if str(exc) else ""
                response, note = _error(500, f"internal error ({type(exc).__name__}: {line})"), "internal error"
            return self.finish(request, path, response, t0, timing, note)

        return Route(path, endpoint, methods=[method])

    def admit(self, app: ASGIApp, work_paths: set[str]) -> ASGIApp:
        """`app` holding at most max_requests work requests, counted from their arrival until their response
        is sent (so the ones whose responses are being built or written count); past it 429 at once, before
        the body is read: the HTTP layer, not only the batcher's queue, is bounded (TEI's
        --max-concurrent-requests). Draining, they pass to the route's 503."""
        async def admitted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] not in work_paths:
                return await app(scope, receive, send)
            if self.active >= self.max_requests and not self.draining:
                request, message = Request(scope, receive), (f"overloaded: the server holds {self.active} requests "
                                                              f"(max {self.max_requests}): retry later")
                response = self.finish(request, scope["path"], _error(429, message), time.perf_counter(), _Timing(),
                                       message)
                return await response(scope, receive, send)
            self.active += 1
            try:
                await app(scope, receive, send)
            finally:
                self.active -= 1

        return admitted

    def finish(self, request: Request, route: str, response: Response, t0: float, timing: _Timing,
               note: str) -> Response:
        """Timing headers on `response`; the request counted (by `route`, a path the server has) and logged."""
        total = time.perf_counter() - t0
        response.headers.update({"x-total-time": _ms(total), "x-queue-time": _ms(timing.queue_s),
                                 "x-decode-time": _ms(timing.decode_s), "x-inference-time": _ms(timing.inference_s)})
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        self.metrics.request_seconds.labels(route).observe(total)
        client = f"{request.client.host}:{request.client.port}" if request.client else "-"
        log.info("%s %s %s %d %.1fms%s", client, request.method, request.url.path, response.status_code,
                 1000 * total, f" {note}" if note else "")
        return response


def create_app(vits: Sequence[Any], *, model: str, directory: Path, limits: Limits) -> Starlette:
    """The ASGI app serving `vits` (GlmVit engines, one batcher each): `app.state.service` is its state."""
    service = Service(vits, model, directory, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await service.start()
        yield
        await service.stop()

    work_paths = {"/v1/embeddings", "/embed"}
    routes = [service.route(path, handler, method, work=path in work_paths) for path, handler, method in (
        ("/v1/embeddings", service.embeddings, "POST"), ("/embed", service.embed, "POST"),
        ("/health", service.health, "GET"), ("/info", service.info, "GET"), ("/metrics", service.prometheus, "GET"))]
    known = ", ".join(f"{next(iter(r.methods - {'HEAD'}))} {r.path}" for r in routes)

    async def no_route(request: Request, exc: HTTPException) -> Response:
        """404 and 405 (Starlette's routing) in the server's error shape, with headers and a log line."""
        message = f"no route {request.method} {request.url.path} (routes: {known})"
        response = _error(exc.status_code, message)
        response.headers.update(exc.headers or {})
        return service.finish(request, "other", response, time.perf_counter(), _Timing(), message)

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: no_route},
                    middleware=[Middleware(service.admit, work_paths=work_paths)])
    app.state.service = service
    return app


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its shutdown. The first SIGTERM/SIGINT makes /health and new
    work answer 503 (a load balancer takes the replica out) while the accepted requests finish; once none
    is left, uvicorn's own graceful shutdown runs (listener closed, the batchers closed). A second signal
    exits at once. An engine that cannot serve (`service.failure`: the warm-up or a GPU fault) ends the
    server too, with status 1, for its supervisor to restart it."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self._announced = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Not uvicorn's: it records the signal and raises it again once the server has stopped, which
        # would make the drained exit a death by signal instead of status 0.
        if self.service.draining:
            self.should_exit = self.force_exit = True
        self.service.draining = True

    async def on_tick(self, counter: int) -> bool:
        service = self.service
        if service.draining and not self._announced:  # logged here: a signal handler must not log
            self._announced = True
            log.info("glmvit-cupy: draining: %d request(s) to finish, then exit", service.active)
        if (service.draining and service.active == 0) or service.failure is not None:
            self.should_exit = True
        return await super().on_tick(counter)


def listen(host: str, port: int) -> socket.socket:
    """A bound socket (port 0: any free one), so that the start line can name the port before serving;
    the connections it accepts send through SEND_BUFFER_BYTES."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn serves them (uvicorn's own default)
    except OSError as exc:
        raise GlmVitError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run(vits: Sequence[Any], *, model: str, directory: Path, limits: Limits, sock: socket.socket) -> int:
    """Serve until drained (0) or until the warm-up fails (1); logs a line a request on stderr. The
    lines are written by a thread of their own: a write to stderr (a pipe a supervisor reads) would
    stop the event loop, and under load wait for the GIL back after it."""
    writer = logging.StreamHandler()
    writer.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    lines: queue.SimpleQueue = queue.SimpleQueue()
    log.addHandler(logging.handlers.QueueHandler(lines))
    log.setLevel(logging.INFO)
    log.propagate = False
    listener = logging.handlers.QueueListener(lines, writer)
    listener.start()
    try:
        return _serve(vits, model, directory, limits, sock)
    finally:
        listener.stop()  # the lines queued are written first


def _serve(vits: Sequence[Any], model: str, directory: Path, limits: Limits, sock: socket.socket) -> int:
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # this process is the server's: no other caller to disturb
    app = create_app(vits, model=model, directory=directory, limits=limits)
    service = app.state.service
    # uvicorn's own lines (startup banners, its access log) off: ours say it in one line each.
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False, lifespan="on")
    host, port = sock.getsockname()[:2]
    vit = vits[0]
    geo = vit.geometry
    log.info("glmvit-cupy: serving %s (%d-block tower, out %d, fingerprint %s, backend %s x %d) on http://%s:%d; "
             "/health is 200 after a warm-up encode", model, geo.depth, geo.out_hidden_size, vit.fingerprint[:12],
             vit.backend, len(vits), f"[{host}]" if ":" in host else host, port)
    DrainingServer(config, service).run(sockets=[sock])
    return 1 if service.failure is not None else 0


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"the body of {int(declared):,} bytes is over the payload limit of {limit:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"the body is over the payload limit of {limit:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or _ClientGone (the work cancelled: queued images leave the batcher) when the
    client disconnects first. Call once the body is read: from then on receive() only reports the end."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        task.cancel()  # a no-op once it is done
    if not task.done():
        raise _ClientGone
    return task.result()


def _parse_embeddings(body: bytes, model: str) -> tuple[list[str], str, str, str]:
    """(inputs, output, dtype, encoding_format) of a /v1/embeddings body; HttpError 400 for anything else."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HttpError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise HttpError(400, f"the body is a JSON {type(request).__name__}, expected an object with \"input\"")
    unknown = sorted(set(request) - _EMBEDDINGS_FIELDS)
    if unknown:
        raise HttpError(400, f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(_EMBEDDINGS_FIELDS))})")
    inputs = request.get("input")
    inputs = [inputs] if isinstance(inputs, str) else inputs
    if not isinstance(inputs, list) or not inputs or not all(isinstance(i, str) for i in inputs):
        raise HttpError(400, "\"input\" must be an image (a data:image/...;base64, URL) or a non-empty list of them")
    if request.get("model", model) != model:
        raise HttpError(400, f"model {request['model']!r}: this server serves {model!r}")
    encoding = request.get("encoding_format", "float")
    _check_choice("encoding_format", encoding, ("float", "base64"))
    output, dtype = request.get("output", DEFAULT_OUTPUT), request.get("dtype", DEFAULT_DTYPE)
    _check_choice("output", output, OUTPUTS)
    _check_choice("dtype", dtype, DTYPES)
    return inputs, output, dtype, encoding


def b64decode(text: str) -> bytes:
    """`base64.b64decode(text, validate=True)` in NumPy, whose array operations release the GIL:
    binascii holds it for the whole decode (a 700 KB photo's data URL: ~3 ms, at a few hundred MB/s)
    while the server's other threads wait. ValueError, in one line, for what b64decode refuses:
    a character outside the alphabet, a length that is not a multiple of 4, misplaced padding."""
    if not text.isascii():
        raise ValueError("a character outside the base64 alphabet")
    raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    if raw.size % 4:
        raise ValueError(f"{raw.size} characters: not a multiple of 4")
    pad = 0 if not text.endswith("=") else 2 if text.endswith("==") else 1
    values = _B64_VALUES.take(raw)
    values[values.size - pad:] = 0  # the padding's place: zero bits, cut off below
    if (values == 255).any():
        at = int(np.argmax(values == 255))
        raise ValueError(f"character {at} ({text[at]!r}) is not base64" if text[at] != "=" else
                         f"padding '=' at character {at}, before the end")
    quads = values.reshape(-1, 4)
    out = np.empty((len(quads), 3), dtype=np.uint8)
    np.bitwise_or(quads[:, 0] << 2, quads[:, 1] >> 4, out=out[:, 0])
    np.bitwise_or(quads[:, 1] << 4, quads[:, 2] >> 2, out=out[:, 1])
    np.bitwise_or(quads[:, 2] << 6, quads[:, 3], out=out[:, 2])
    return out.reshape(-1)[:out.size - pad].tobytes()


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise HttpError(400, f"{name} {value!r}: expected one of {', '.join(choices)}")


def _media_type(accept: str | None) -> str:
    """The /embed response's media type from the Accept header (safetensors unless .npy is asked for)."""
    if accept is None:
        return MEDIA_SAFETENSORS
    types = [part.split(";")[0].strip() for part in accept.split(",")]
    for media in types:
        if media in (MEDIA_SAFETENSORS, MEDIA_NPY):
            return media
        if media in ("*/*", "application/*"):
            return MEDIA_SAFETENSORS
    raise HttpError(406, f"Accept {accept!r}: /embed answers {MEDIA_SAFETENSORS} (safetensors) or {MEDIA_NPY}")


def _arrays(result: Any, output: str) -> dict[str, np.ndarray]:
    """The outputs asked for, by their library names."""
    return {name: getattr(result, name) for name in OUTPUTS[output]}


def _embeddings_parts(results: list[Any], output: str, encoding: str, model: str, device_base64: Any = None) -> list[Any]:
    """The /v1/embeddings response as JSON, in parts to send in order, never joined: a real tower's base64
    answer is megabytes, and each join or concatenation of it is a copy of it as long as the base64
    itself takes (benchmarks/NOTES.md). An embedding is nested lists [tokens][dim] (float) or the
    row-major bytes of the array in its dtype (base64; little-endian, as every host we run on), spliced in
    as they are: base64 needs no JSON escaping, and json.dumps would scan megabytes for it. With
    `device_base64` (a GPU server) the base64 is made on the GPU, in one part."""
    parts, tokens = [b'{"object": "list", "data": ['], 0
    for i, result in enumerate(results):
        arrays = _arrays(result, output)
        first = next(iter(arrays.values()))
        tokens += first.shape[0]
        head = json.dumps({"object": "embedding", "index": i, "shape": list(first.shape),
                           "grid_thw": result.grid_thw[0].tolist()})
        opening = b"{" if output == "both" else b""
        parts.append((b", " if i else b"") + head[:-1].encode() + b', "embedding": ' + opening)
        for j, (name, a) in enumerate(arrays.items()):
            if output == "both":
                parts.append((b"," if j else b"") + json.dumps(name).encode() + b":")
            if encoding == "base64":
                parts += [b'"', *(_base64_parts(a) if device_base64 is None else [device_base64.encode(a).data]), b'"']
            else:
                parts.append(json.dumps(a.astype(np.float32).tolist()).encode())
        parts.append(b"}}" if output == "both" else b"}")
    tail = json.dumps({"model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    return [*parts, b"], " + tail[1:].encode()]


def _base64_parts(array: np.ndarray) -> list[bytes]:
    """The base64 of the array's bytes, read in place (no copy of a contiguous array) in slices of
    B64_SLICE bytes: a multiple of 3, so the parts are the whole's base64. Between slices the event loop
    can take the GIL, which base64 holds, and 1 MiB results reuse freed memory where one of 22 MB is
    page-faulted in afresh."""
    flat = flat_bytes(array)
    return [base64.b64encode(flat[i:i + B64_SLICE]) for i in range(0, flat.size, B64_SLICE)]


class _PartsResponse(Response):
    """A body sent as its parts, never joined (a real tower's answer is megabytes: each join a copy of
    it), its length declared up front."""

    def __init__(self, parts: list[Any], headers: dict[str, str], media_type: str = "application/json") -> None:
        super().__init__(None, headers={**headers, "content-length": str(sum(len(p) for p in parts))},
                         media_type=media_type)
        self.parts = parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for part in self.parts:
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _error(status: int, message: str) -> JSONResponse:
    """The error body every route answers with (OpenAI's shape): one line."""
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.3f}"
