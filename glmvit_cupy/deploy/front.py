"""An HTTP front process of `glmvit-cupy serve` (serve.py starts --http-workers of them):

    POST /v1/embeddings   OpenAI-shaped JSON: images as data:image/...;base64, URLs in, embeddings out
    POST /embed           an image file's bytes in, a safetensors file (or .npy) out
    GET  /health          200 once a warm-up encode has run; 503 while starting, draining or broken
    GET  /info            model, fingerprint, geometry, processor settings, limits
    GET  /metrics         Prometheus text: every front's requests, the engine's batches and cache

Every front runs uvicorn on the engine process's one listener (each accepts from its backlog) and
does all of a request's Python: HTTP, JSON, the data URL's decode, the image's sha256, its decode
and resize, the answer's building and writes. The engine process (serve.py) holds the engines,
their batchers and the encoder cache; per image the front asks it `lookup` over its socket pair
and the answer lands in a slot of the front's shared memory (handoff.py): a hit at once, else the
engine says `decode`, the front decodes the image into the slot's canvas, and the engine's batcher
reads it from there. Separate from serve.py so that the process whose GIL the engine needs does
none of this, and the decode pool is the fronts themselves.

Every failure is one status and one line (`HttpError`), and one bad request fails alone. A front
holds at most its share of the server's held requests (2 x --max-queue an engine), arrival to
response sent; past it 429 at once (`Front.admit`). A client that disconnects has its work
cancelled. Fronts ignore SIGINT and SIGTERM: the engine drains them (a terminal's Ctrl-C or a
service manager's SIGTERM to the group reaches it too), and they die with it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import io
import itertools
import json
import logging
import os
import re
import signal
import socket
import sys
import time
import traceback
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import numpy as np
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..collection.pipeline import DEFAULT_OUTPUT, OUTPUTS, prepare
from ..collection.staging import DEFAULT_DTYPE, DTYPES
from ..processor.preprocess import EncodedImage, ProcessorConfig
from ..tower.writer import flat_bytes, safetensors_chunks
from .encoder_cache import HIT, image_digest
from .handoff import BASE64, SlotLayout, board_bytes, log_through_thread, mapped, read_arrays, receive, send

log = logging.getLogger(__name__)

B64_SLICE = 3 * 2**18  # bytes of an embedding base64-encoded at a time (host base64): 1 MiB of base64
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never sent
ACCEPT_DEFER_S = 0.002  # how long a front leaves a connection to a front with fewer (_FrontServer)
# An idle keep-alive connection is closed after this long. uvicorn's 5 s equals httpx's pool expiry:
# a client sending on a connection as the server closes it gets a reset, and a POST is not retried.
# Longer than the clients people use keep theirs (httpx 5 s, aiohttp 15 s), as nginx's 75 s.
KEEP_ALIVE_S = 75
WARM_SLOTS = 4  # free slots a front lets keep their pages (_Slots): a slot's first use faults in its pages
TIME_BUCKETS = (.001, .002, .005, .01, .02, .05, .1, .2, .5, 1, 2, 5, 10, 30, 60)
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64"}
MEDIA_SAFETENSORS, MEDIA_NPY = "application/octet-stream", "application/x-npy"
# The engine's failures of an image, by the kind its reply names: the status, and whether the message
# starts with the input's name.
_ENGINE_ERRORS = {"overloaded": (429, False), "timeout": (504, True), "input": (422, True), "engine": (500, True),
                  "internal": (500, True)}
_DATA_URL = re.compile(r"data:image/[\w.+-]+(?:;[\w.+-]+=[^;,]*)*;base64,(.*)", re.S)
_B64_VALUES = np.full(256, 255, dtype=np.uint8)  # a base64 character's 6 bits; 255: not base64
_B64_VALUES[np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", np.uint8)] = np.arange(64)
_EMBEDDINGS_FIELDS = {"input", "model", "encoding_format", "output", "dtype"}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server admits; the batcher's options are passed to `GlmVit.batcher` as they are."""

    max_queue: int
    max_wait_ms: float
    timeout_s: float
    payload_limit: int  # bytes of a request body (and of a file read through allow_files)
    cache_bytes: int
    allow_files: Path | None  # the directory path inputs must lie under; None: no paths


@dataclasses.dataclass(frozen=True)
class FrontSettings:
    """What the engine tells a front it starts (pickled to it)."""

    index: int
    model: str
    info: dict[str, Any]  # the /info body
    limits: Limits
    max_requests: int  # this front's share of the held requests: its slots
    fronts: int  # how many there are: the board's entries
    layout: SlotLayout
    processor: ProcessorConfig


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

    def add(self, queue_s: float, decode_s: float, inference_s: float) -> None:
        self.queue_s = max(self.queue_s, queue_s)
        self.decode_s = max(self.decode_s, decode_s)
        self.inference_s = max(self.inference_s, inference_s)


@dataclasses.dataclass
class _Answer:
    """One image's answer, its arrays views of its slot (base64 text where the engine made it)."""

    arrays: dict[str, np.ndarray]
    shapes: dict[str, list[int]]
    grid_thw: list[int]
    cache: str  # HIT, MISS or SHARED
    text: bool  # the arrays are the engine's base64 text (uint8)


@dataclasses.dataclass
class _Image:
    """An image the engine knows by its id: its bytes (the engine may ask any requester of a key to
    decode), its slot, and the engine's last word on it (the slot is free once it has come)."""

    data: bytes
    slot: int
    final: asyncio.Future
    asked: bool = False  # its lookup sent: the slot is the engine's until `final`


class _Slots:
    """A front's slots: a request takes all it needs at once, in arrival order (no request holds some
    while waiting for more, so none waits for ever). The last given back is the first taken, so a
    steady load keeps reusing the same few; past WARM_SLOTS free ones, the least recently used slot
    that holds pages gives them back (`release`), one a give: after a burst the front's memory
    returns to what its load uses, not every slot's largest image."""

    def __init__(self, count: int, release: Callable[[int], None]) -> None:
        self.count, self.release = count, release
        self.free = list(range(count))
        self.dirty: set[int] = set()  # slots whose pages were written since they were last released
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()

    def _pop(self, n: int) -> list[int]:
        taken = [self.free.pop() for _ in range(n)]
        self.dirty.update(taken)
        return taken

    async def take(self, n: int) -> list[int]:
        if n > self.count:
            raise HttpError(429, f"overloaded: a request of {n} images is more than a front holds at once "
                                 f"({self.count}): send fewer a request")
        if not self.waiting and len(self.free) >= n:
            return self._pop(n)
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((n, future))
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # slots given as it was cancelled
                for slot in future.result():
                    self.give(slot)
            raise

    def give(self, slot: int) -> None:
        self.free.append(slot)
        while self.waiting and (self.waiting[0][1].done() or len(self.free) >= self.waiting[0][0]):
            n, future = self.waiting.popleft()
            if not future.done():
                future.set_result(self._pop(n))
        cold = next((s for s in self.free[:len(self.free) - WARM_SLOTS] if s in self.dirty), None)
        if cold is not None:
            self.dirty.discard(cold)
            self.release(cold)


class Front:
    """A front's state and routes: its end of the engine's socket pair, its slots, its metrics."""

    def __init__(self, settings: FrontSettings, memory: np.ndarray, channel: socket.socket) -> None:
        self.settings, self.memory, self.channel = settings, memory, channel
        self.limits, self.layout = settings.limits, settings.layout
        self.status = "starting"  # the engine's, pushed to every front as it changes
        self.active = 0  # work requests held, arrival to response sent
        self.slots = _Slots(settings.max_requests, functools.partial(self.layout.release, memory))
        self.images: dict[int, _Image] = {}
        self.metrics_replies: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        # Every front's counts in files of the engine's PROMETHEUS_MULTIPROC_DIR, summed at each scrape.
        self.requests = Counter("glmvit_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=None)
        self.request_seconds = Histogram("glmvit_request_duration_seconds", "Whole HTTP request, body read to "
                                         "response built", ["route"], buckets=TIME_BUCKETS, registry=None)
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry)
        self.writer: asyncio.StreamWriter | None = None

    # -- the engine's socket pair -----------------------------------------------------------------

    async def connect(self) -> None:
        reader, self.writer = await asyncio.open_connection(sock=self.channel)
        self._pump = asyncio.ensure_future(self._listen(reader))

    async def _listen(self, reader: asyncio.StreamReader) -> None:
        """The engine's messages: replies by id, status pushes, requests to decode."""
        while True:
            try:
                message = await receive(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                sys.stderr.write(f"glmvit-cupy: HTTP front {self.settings.index}: the engine process is gone; "
                                 "exiting\n")
                os._exit(1)  # its requests cannot be answered: their connections close with the process
            op = message["op"]
            if op == "status":
                self.status = message["status"]
                if self.status == "draining":
                    send(self.writer, {"op": "held", "active": self.active})
            elif op == "decode":
                asyncio.ensure_future(self._decode(message["id"]))
            elif op == "metrics":
                self.metrics_replies.pop(message["id"]).set_result(message["text"])
            else:  # an image's answer or failure: its last word
                self.images.pop(message["id"]).final.set_result(message)

    async def _decode(self, image_id: int) -> None:
        """The image decoded and resized into its slot's canvas, as a decode worker would (PIL, off the GIL)."""
        image = self.images.get(image_id)
        if image is None:  # gone: its last word has come
            return

        def into_slot() -> dict[str, Any]:
            prep = prepare(EncodedImage("image", image.data), self.settings.processor)
            if prep.error is not None:
                return {"error": prep.error}
            try:
                self.layout.canvas(self.memory, image.slot, prep.canvas.shape)[...] = prep.canvas
            except ValueError as exc:  # larger than the processor's budget makes: a bug, the image's failure
                log.error("glmvit-cupy: %s", exc)
                return {"error": f"image: {exc}"}
            return {"shape": list(prep.canvas.shape), "decode_s": prep.decode_s}

        send(self.writer, {"op": "canvas", "id": image_id, **await asyncio.to_thread(into_slot)})

    async def _engine_metrics(self) -> str:
        reply_id = next(self.ids)
        future = self.metrics_replies[reply_id] = asyncio.get_running_loop().create_future()
        send(self.writer, {"op": "metrics", "id": reply_id})
        return await future

    # -- routes -----------------------------------------------------------------------------------

    async def embeddings(self, request: Request, timing: _Timing) -> Response:
        body = await _read_body(request, self.limits.payload_limit)
        inputs, output, dtype, encoding = _parse_embeddings(body, self.settings.model)
        images = await asyncio.gather(*(self._input_bytes(i, item) for i, item in enumerate(inputs)))
        answers = await _unless_disconnected(request, self._encode_all(request, images, output, dtype,
                                                                       encoding == "base64", timing))
        # Off the event loop: a real tower's image is megabytes of embedding to encode
        parts = await asyncio.to_thread(_embeddings_parts, answers, output, encoding, self.settings.model)
        return _PartsResponse(parts, {"x-cache": ",".join(a.cache for a in answers)})

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
        (one,) = await _unless_disconnected(request, self._encode_all(request, [("body", body)], output, dtype,
                                                                      False, timing))
        headers = {"x-cache": one.cache}
        if media == MEDIA_NPY:
            return Response(_npy(next(iter(one.arrays.values()))), media_type=MEDIA_NPY, headers=headers)
        tensors = {**one.arrays, "grid_thw": np.array([one.grid_thw], dtype=np.int64)}
        specs = [(name, SAFETENSORS_DTYPES[a.dtype.name], list(a.shape)) for name, a in tensors.items()]
        data = (flat_bytes(a).data for a in tensors.values())
        return _PartsResponse(list(safetensors_chunks(specs, data, "/embed")), headers, MEDIA_SAFETENSORS)

    async def health(self, request: Request, timing: _Timing) -> Response:
        return JSONResponse({"status": self.status}, status_code=200 if self.status == "ok" else 503)

    async def info(self, request: Request, timing: _Timing) -> Response:
        return JSONResponse(self.settings.info)

    async def prometheus(self, request: Request, timing: _Timing) -> Response:
        engine = await self._engine_metrics()
        return Response(generate_latest(self.registry) + engine.encode(), media_type=CONTENT_TYPE_LATEST)

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

    async def _encode_all(self, request: Request, images: list[tuple[str, bytes]], output: str, dtype: str,
                          text: bool, timing: _Timing) -> list[_Answer]:
        """Every image of a request at once, each in a slot the request holds until its response is sent;
        the first failure fails the request and cancels the rest."""
        slots = await self.slots.take(len(images))
        request.scope["glmvit.images"] = held = [_Image(data, slot, asyncio.get_running_loop().create_future())
                                                 for (_, data), slot in zip(images, slots)]
        tasks = [asyncio.ensure_future(self._encode_one(where, image, output, dtype, text))
                 for (where, _), image in zip(images, held)]
        try:
            answers = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        for reply, answer in answers:
            if answer.cache != HIT:  # a hit did no queue, decode or forward
                timing.add(*reply["timing"])
        return [answer for _, answer in answers]

    async def _encode_one(self, where: str, image: _Image, output: str, dtype: str,
                          text: bool) -> tuple[dict[str, Any], _Answer]:
        image_id = next(self.ids)
        self.images[image_id] = image
        image.asked = True
        send(self.writer, {"op": "lookup", "id": image_id, "digest": image_digest(image.data), "output": output,
                           "dtype": dtype, "slot": image.slot, "base64": text})
        try:
            reply = await asyncio.shield(image.final)  # not cancelled with us: the slot waits for it
        except asyncio.CancelledError:
            if not image.final.done():
                send(self.writer, {"op": "cancel", "id": image_id})
            raise
        if reply["op"] == "error":
            status, named = _ENGINE_ERRORS[reply["kind"]]
            raise HttpError(status, f"{where}: {reply['message']}" if named else reply["message"])
        arrays = read_arrays(self.layout.answer(self.memory, image.slot), reply["arrays"])
        shapes = {name: shape for name, _, shape, _, _ in reply["arrays"]}
        text = any(dtype == BASE64 for _, dtype, _, _, _ in reply["arrays"])
        return reply, _Answer(arrays, shapes, reply["grid_thw"], reply["cache"], text)

    # -- the app ----------------------------------------------------------------------------------

    def route(self, path: str, handler: Callable[[Request, _Timing], Awaitable[Response]], method: str,
              work: bool) -> Route:
        """`handler` with what every response gets: errors as one line and a status, timing headers, the
        request counted and logged. `work`: an embedding route (refused while draining; `admit` counts it)."""
        async def endpoint(request: Request) -> Response:
            t0, timing = time.perf_counter(), _Timing()
            try:
                if work and (self.status == "draining" or self.status.startswith("failed")):
                    raise HttpError(503, f"{self.status}: the server is shutting down; send to another replica")
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
        """`app` holding at most its share of the server's work requests, counted from their arrival until
        their response is sent (so the ones whose responses are being built or written count); past it 429
        at once, before the body is read: the HTTP layer, not only the batcher's queue, is bounded (TEI's
        --max-concurrent-requests). Draining, they pass to the route's 503. A request's slots are free
        once its response is sent and the engine's last word on each image has come."""
        async def admitted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] not in work_paths:
                return await app(scope, receive, send)
            limit = self.settings.max_requests
            if self.active >= limit and self.status != "draining":
                request, message = Request(scope, receive), (f"overloaded: the server holds {self.active} requests "
                                                              f"(max {limit}): retry later")
                response = self.finish(request, scope["path"], _error(429, message), time.perf_counter(), _Timing(),
                                       message)
                return await response(scope, receive, send)
            self.active += 1
            try:
                await app(scope, receive, send)
            finally:
                self.active -= 1
                for image in scope.get("glmvit.images", ()):
                    if image.asked:
                        image.final.add_done_callback(lambda _, slot=image.slot: self.slots.give(slot))
                    else:
                        self.slots.give(image.slot)

        return admitted

    def finish(self, request: Request, route: str, response: Response, t0: float, timing: _Timing,
               note: str) -> Response:
        """Timing headers on `response`; the request counted (by `route`, a path the server has) and logged."""
        total = time.perf_counter() - t0
        response.headers.update({"x-total-time": _ms(total), "x-queue-time": _ms(timing.queue_s),
                                 "x-decode-time": _ms(timing.decode_s), "x-inference-time": _ms(timing.inference_s)})
        self.requests.labels(route, str(response.status_code)).inc()
        self.request_seconds.labels(route).observe(total)
        client = f"{request.client.host}:{request.client.port}" if request.client else "-"
        log.info("%s %s %s %d %.1fms%s", client, request.method, request.url.path, response.status_code,
                 1000 * total, f" {note}" if note else "")
        return response


def create_app(front: Front) -> Starlette:
    """The ASGI app of one front."""
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        await front.connect()
        yield

    work_paths = {"/v1/embeddings", "/embed"}
    routes = [front.route(path, handler, method, work=path in work_paths) for path, handler, method in (
        ("/v1/embeddings", front.embeddings, "POST"), ("/embed", front.embed, "POST"),
        ("/health", front.health, "GET"), ("/info", front.info, "GET"), ("/metrics", front.prometheus, "GET"))]
    known = ", ".join(f"{next(iter(r.methods - {'HEAD'}))} {r.path}" for r in routes)

    async def no_route(request: Request, exc: HTTPException) -> Response:
        """404 and 405 (Starlette's routing) in the server's error shape, with headers and a log line."""
        message = f"no route {request.method} {request.url.path} (routes: {known})"
        response = _error(exc.status_code, message)
        response.headers.update(exc.headers or {})
        return front.finish(request, "other", response, time.perf_counter(), _Timing(), message)

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: no_route},
                     middleware=[Middleware(front.admit, work_paths=work_paths)])


class _FrontServer(uvicorn.Server):
    """uvicorn's server on the engine's listener, accepting one connection at a time, and stopped by the
    engine only: once it says draining and nothing is held, or failed (uvicorn's graceful shutdown still
    answers the requests held).

    uvloop's own server accepts every connection waiting each time the listener is readable, and the
    front the kernel wakes first took every connection of a burst (32 of 32 in test_serve_fronts):
    with keep-alive clients one front would carry the load while the others idle. So the fronts
    share a board (handoff.py: each front's open connections), and a front leaves a connection to
    one with fewer, for up to ACCEPT_DEFER_S (it may be busy, or dead)."""

    def __init__(self, config: uvicorn.Config, front: Front, listener: socket.socket, board: np.ndarray) -> None:
        super().__init__(config)
        self.front, self.listener, self.board = front, listener, board

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the app's lifespan; no server of uvicorn's
        self._accepting = asyncio.ensure_future(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        protocol = functools.partial(self.config.http_protocol_class, config=self.config,
                                     server_state=self.server_state, app_state=self.lifespan.state)
        index, deferred_since = self.front.settings.index, None
        while True:
            readable = loop.create_future()
            loop.add_reader(self.listener, readable.set_result, None)
            try:
                await readable
            finally:
                loop.remove_reader(self.listener)
            self.board[index] = mine = len(self.server_state.connections)
            now = time.monotonic()
            if mine > self.board.min() and (deferred_since is None or now - deferred_since < ACCEPT_DEFER_S):
                deferred_since = deferred_since or now
                await asyncio.sleep(ACCEPT_DEFER_S / 10)
                continue
            deferred_since = None
            try:
                connection, _ = self.listener.accept()
            except BlockingIOError:  # another front took it
                continue
            except OSError as exc:  # out of file descriptors, a connection reset before its accept
                log.error("glmvit-cupy: accepting a connection: %s", exc)
                await asyncio.sleep(ACCEPT_DEFER_S)
                continue
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.connect_accepted_socket(protocol, connection)
            self.board[index] = len(self.server_state.connections)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._accepting.cancel()
        self.listener.close()
        await super().shutdown(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        pass  # the engine process drains the fronts (a signal to the group reaches it too)

    async def on_tick(self, counter: int) -> bool:
        status = self.front.status
        if (status == "draining" and self.front.active == 0) or status.startswith("failed"):
            self.should_exit = True
        return await super().on_tick(counter)


def main(settings: FrontSettings, conn: Any) -> None:
    """A front process (workers.Child's target): the listener and the memfd come over `conn`'s socket."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    channel = socket.socket(fileno=os.dup(conn.fileno()))
    _, (listener_fd, memory_fd, board_fd), _, _ = socket.recv_fds(channel, 1, 3)
    memory = mapped(memory_fd, settings.layout.size)
    board = mapped(board_fd, board_bytes(settings.fronts)).view(np.int64)
    os.close(memory_fd)
    os.close(board_fd)
    listener = socket.socket(fileno=listener_fd)
    listener.setblocking(False)
    lines = log_through_thread(log, f"front {settings.index}: ")
    try:
        front = Front(settings, memory, channel)
        # uvicorn's own lines (startup banners, its access log) off: ours say it in one line each.
        config = uvicorn.Config(create_app(front), log_config=None, log_level="warning", access_log=False,
                                lifespan="on", timeout_keep_alive=KEEP_ALIVE_S)
        _FrontServer(config, front, listener, board).run()
    finally:
        lines.stop()  # the lines queued are written first


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


def _embeddings_parts(answers: list[_Answer], output: str, encoding: str, model: str) -> list[Any]:
    """The /v1/embeddings response as JSON, in parts to send in order, never joined: a real tower's base64
    answer is megabytes, and each join or concatenation of it is a copy of it as long as the base64
    itself takes (benchmarks/NOTES.md). An embedding is nested lists [tokens][dim] (float) or the
    row-major bytes of the array in its dtype (base64; little-endian, as every host we run on), spliced in
    as they are: base64 needs no JSON escaping, and json.dumps would scan megabytes for it. Where the
    engine made the base64 (a GPU server) its text is spliced in from the slot."""
    parts, tokens = [b'{"object": "list", "data": ['], 0
    for i, answer in enumerate(answers):
        shape = next(iter(answer.shapes.values()))
        tokens += shape[0]
        head = json.dumps({"object": "embedding", "index": i, "shape": shape, "grid_thw": answer.grid_thw})
        opening = b"{" if output == "both" else b""
        parts.append((b", " if i else b"") + head[:-1].encode() + b', "embedding": ' + opening)
        for j, (name, a) in enumerate(answer.arrays.items()):
            if output == "both":
                parts.append((b"," if j else b"") + json.dumps(name).encode() + b":")
            if encoding == "base64":
                parts += [b'"', *([a.data] if answer.text else _base64_parts(a)), b'"']
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
