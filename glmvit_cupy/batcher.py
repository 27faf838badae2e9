"""`Batcher`: one image a request, from any number of threads or coroutines, packed into shared
forward calls as the requests arrive (continuous batching), each answered as soon as its batch
is done.

    with vit.batcher() as batcher:                     # GlmVit.batcher
        out = batcher.submit(image_bytes).result()     # a concurrent.futures.Future
        out = await batcher.aencode(image_bytes)       # the asyncio form

  submit -> decode pool (processes) -> ready -> dispatcher thread --------> stager -> collector thread
            (never the caller's                  (packs under p_max, at     (k + 1      (answers each
             thread, no lock held)                most `depth` batches on    uploads     request of a
                                                  the engine)                while k     batch, alone)
                                                                             computes)

The dispatcher sends the ready requests as one batch when an engine slot is free and either
the batch is full, the oldest has waited max_wait_ms, or no other request is still decoding
(a lone request never waits). While both slots are busy, requests gather into the next batch,
so batches grow with the load. Requests of one batch share its output and dtype (a batch is
cast as a whole on the device); others wait for the next. `submit_canvas` takes an image
decoded elsewhere (the server's HTTP fronts decode in their own processes): it enters ready at
once, and the decode pool is started only by the first `submit`.

Bounded: at most max_queue requests wait (decoding or ready); the next is refused at once
(`Overloaded`). A request not answered within timeout_s fails with `RequestTimeout`; one
cancelled before its batch starts costs nothing more. A request whose image fails (it does
not decode, exceeds the budget, gives NaN/Inf) fails alone with `InputError`. Separate from
model.py and pipeline.py: a stream serves one caller's ordered iterable, this serves many
callers' single images in arrival order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from .collection.pipeline import DEFAULT_OUTPUT, DEFAULT_WORKERS, Decoder, Prepared, item_name
from .collection.staging import DEFAULT_DTYPE, make_stager
from .errors import GlmVitError, InputError, Overloaded, RequestTimeout
from .outputs import GlmVitOutput, Timing, check_output_options, library_output
from .processor.preprocess import canvas_grid, image_input
from .tower.geometry import check_patch_budget

DEFAULT_MAX_WAIT_MS = 5.0  # under a decode's time: a batch waits for what is about to arrive, not longer
DEFAULT_MAX_QUEUE = 1024
DEFAULT_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class BatcherStats:
    """A snapshot: requests waiting (decoding or ready), batches on the engine, totals since
    start (images decoded, whether or not they reached a batch), and the engine's busy seconds
    (CUDA events; 0 on the NumPy backend)."""

    queue_depth: int
    in_flight: int
    requests: int
    decoded: int
    batches: int
    images: int
    tokens: int
    gpu_busy_s: float
    uptime_s: float


class _Request:
    __slots__ = ("future", "item", "outputs", "dtype", "submitted", "deadline", "state", "decode", "prep",
                 "patches", "ready_at", "decode_s")

    def __init__(self, future: Future, item: Any, outputs: tuple[str, ...], dtype: str, deadline: float) -> None:
        self.future, self.item, self.outputs, self.dtype = future, item, outputs, dtype
        self.submitted, self.deadline = time.perf_counter(), deadline
        self.state = "decoding"  # -> "ready" -> "batched", or "gone" (answered before reaching a batch)
        self.decode: Future | None = None
        self.prep: Prepared | None = None
        self.patches = 0
        self.ready_at = self.decode_s = 0.0


class Batcher:
    """See the module docstring. Made by GlmVit.batcher; `close()` (or leaving a `with` block)
    stops taking requests, answers every one already taken, and stops its threads and workers.
    `on_batch(images, tokens, inference_s)` hears of each batch (from the collector thread)."""

    def __init__(self, vit: Any, *, max_wait_ms: float | None = None, max_queue: int | None = None,
                 timeout_s: float | None = None, workers: int | None = None,
                 on_batch: Callable[[int, int, float], None] | None = None) -> None:
        self.max_wait_s = (DEFAULT_MAX_WAIT_MS if max_wait_ms is None else max_wait_ms) / 1000
        self.max_queue = DEFAULT_MAX_QUEUE if max_queue is None else max_queue
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        workers = DEFAULT_WORKERS if workers is None else workers
        for name, value, low in (("max_wait_ms", self.max_wait_s, 0), ("max_queue", self.max_queue, 1),
                                 ("timeout_s", self.timeout_s, 1e-9), ("workers", workers, 1)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise GlmVitError(f"batcher: {name} {value!r} must be a number of at least {low} (workers: the "
                                  "decode processes, never the caller's thread)")
        self.vit, self.on_batch, self.workers = vit, on_batch, workers
        self.decoder: Decoder | None = None  # started by the first submit (submit_canvas needs none)
        self.stager = make_stager(vit, vit.processor)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._order: deque[_Request] = deque()  # every request not yet batched or gone, in submit order
        self._ready: deque[_Request] = deque()
        self._decoding = 0
        self._in_flight: deque[tuple[Any, list[_Request], float]] = deque()
        self._closed = False
        self._started = time.perf_counter()
        self._totals = {"requests": 0, "decoded": 0, "batches": 0, "images": 0, "tokens": 0, "gpu_ms": 0.0}
        self._threads = [threading.Thread(target=self._dispatch, name="glmvit-batcher-dispatch", daemon=True),
                         threading.Thread(target=self._collect, name="glmvit-batcher-collect", daemon=True)]
        for thread in self._threads:
            thread.start()

    # ---- callers ---------------------------------------------------------------------------

    def submit(self, image: Any, *, output: str = DEFAULT_OUTPUT, dtype: str = DEFAULT_DTYPE) -> Future:
        """A Future of this image's GlmVitOutput (with its Timing). Raises Overloaded at once
        when max_queue requests wait, GlmVitError once closed or for a bad option or type."""
        item = image_input(image, "request")
        request = self._enter(item, output, dtype, None)
        request.decode = self.decoder.submit(item)
        request.decode.add_done_callback(lambda f: self._decoded(request, f))
        return request.future

    def submit_canvas(self, canvas: np.ndarray, name: str, decode_s: float, *, output: str = DEFAULT_OUTPUT,
                      dtype: str = DEFAULT_DTYPE) -> Future:
        """As submit, for an image already decoded and resized (a uint8 canvas [H, W, 3] as `prepare`
        makes it; `name` names it in messages). The canvas is read, not copied, until the request
        is batched or gone: keep it unchanged until the future is done."""
        return self._enter(name, output, dtype, Prepared(canvas, None, decode_s=decode_s)).future

    def _enter(self, item: Any, output: str, dtype: str, prep: Prepared | None) -> _Request:
        """A new request in the queue: decoding, or (`prep`) ready at once."""
        outputs = check_output_options(output, dtype)
        request = _Request(Future(), item, outputs, dtype, time.perf_counter() + self.timeout_s)
        with self._lock:
            if self._closed:
                raise GlmVitError("the batcher is closed: it takes no more requests")
            if len(self._order) >= self.max_queue:
                raise Overloaded(f"{len(self._order)} requests are already waiting (max_queue {self.max_queue}): "
                                 "retry later")
            if prep is None and self.decoder is None:  # under the lock that close() takes: never one it misses
                self.decoder = Decoder(self.workers, self.vit.processor)
            self._order.append(request)
            self._decoding += 1
            self._totals["requests"] += 1
            if prep is not None:
                self._ready_up(request, prep)
            if len(self._order) == 1:
                self._wake.notify_all()  # the dispatcher sleeps without a deadline while nothing waits
        request.future.add_done_callback(lambda f: self._cancelled(request) if f.cancelled() else None)
        return request

    async def aencode(self, image: Any, *, output: str = DEFAULT_OUTPUT, dtype: str = DEFAULT_DTYPE) -> GlmVitOutput:
        """submit, awaited; cancelling the awaiting task cancels the request."""
        return await asyncio.wrap_future(self.submit(image, output=output, dtype=dtype))

    def stats(self) -> BatcherStats:
        with self._lock:
            t = self._totals
            return BatcherStats(len(self._order), len(self._in_flight), t["requests"], t["decoded"], t["batches"],
                                t["images"], t["tokens"], t["gpu_ms"] / 1000, time.perf_counter() - self._started)

    def close(self) -> None:
        """Take no more requests; answer those taken; stop the threads and decode workers."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        for thread in self._threads:
            thread.join()
        if self.decoder is not None:
            self.decoder.close()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- request state (under the lock) -----------------------------------------------------

    def _gone(self, request: _Request) -> None:
        """The request leaves the queue without reaching a batch."""
        if request.state == "decoding":
            self._decoding -= 1
        elif request.state == "ready":
            self._ready.remove(request)
        request.state = "gone"
        self._order.remove(request)
        self._wake.notify_all()

    def _fail(self, request: _Request, error: BaseException) -> None:
        """Answer a request that has not reached a batch with an error (unless cancelled)."""
        if request.state == "gone":
            return
        self._gone(request)
        if request.future.set_running_or_notify_cancel():
            request.future.set_exception(error)

    def _cancelled(self, request: _Request) -> None:
        with self._lock:
            if request.state in ("decoding", "ready"):
                self._gone(request)
        if request.decode is not None:
            request.decode.cancel()  # not started: no worker ever sees it

    def _decoded(self, request: _Request, decode: Future) -> None:
        if decode.cancelled():
            return
        with self._lock:
            self._totals["decoded"] += 1
            if request.state != "decoding":
                return
            if decode.exception() is not None:  # a bug in a decode thread: this request's, not the batcher's
                self._fail(request, decode.exception())
                return
            self._ready_up(request, decode.result())

    def _ready_up(self, request: _Request, prep: Prepared) -> None:
        """A decoded request ready for a batch, or failed alone (its image's failure, over the budget)."""
        if prep.error is not None:
            self._fail(request, InputError(prep.error))
            return
        request.patches = int(np.prod(canvas_grid(prep.canvas.shape, self.vit.processor)))
        try:
            check_patch_budget(self.vit.geometry, request.patches, self.vit.p_max, item_name(request.item))
        except GlmVitError as exc:
            self._fail(request, InputError(str(exc)))
            return
        request.prep, request.state, request.ready_at, request.decode_s = prep, "ready", time.perf_counter(), \
            prep.decode_s
        self._decoding -= 1
        self._ready.append(request)
        self._wake.notify_all()

    def _expire(self, now: float) -> float | None:
        """Fail every request past its deadline; the next deadline, if any request waits."""
        while self._order and self._order[0].deadline <= now:
            request = self._order[0]
            if request.decode is not None:
                request.decode.cancel()
            self._fail(request, RequestTimeout(f"{item_name(request.item)}: not answered within "
                                               f"{self.timeout_s:g} s (timeout_s)"))
        return self._order[0].deadline if self._order else None

    def _take(self, now: float) -> list[_Request] | None:
        """The next batch, if one should go now: the oldest ready request's output and dtype,
        the ready requests of those that fit under p_max, in arrival order."""
        if not self._ready or len(self._in_flight) >= self.stager.depth:
            return None
        first = self._ready[0]
        key = (first.outputs, first.dtype)
        batch, patches, full = [], 0, False
        for request in self._ready:
            if (request.outputs, request.dtype) != key:
                continue
            if patches + request.patches > self.vit.p_max:
                full = True
                break
            batch.append(request)
            patches += request.patches
        if not (full or self._decoding == 0 or now - first.ready_at >= self.max_wait_s or self._closed):
            return None
        for request in batch:
            self._ready.remove(request)
            self._order.remove(request)
            request.state = "batched"
        return batch

    # ---- the two threads ---------------------------------------------------------------------

    def _dispatch(self) -> None:
        with self._lock:
            while True:
                now = time.perf_counter()
                deadline = self._expire(now)
                batch = self._take(now)
                if batch is None:
                    if self._closed and not self._order and not self._in_flight:
                        self._in_flight.append(None)  # tells the collector to stop
                        self._wake.notify_all()
                        return
                    waits = [deadline - now] if deadline is not None else []
                    if self._ready and len(self._in_flight) < self.stager.depth:
                        waits.append(self._ready[0].ready_at + self.max_wait_s - now)
                    self._wake.wait(max(0.0, min(waits)) if waits else None)
                    continue
                batch = [r for r in batch if r.future.set_running_or_notify_cancel()]  # cancelled: dropped
                if not batch:
                    continue
                self._lock.release()
                try:
                    started = time.perf_counter()
                    pending = self._submit(batch)
                finally:
                    self._lock.acquire()
                if pending is not None:
                    self._in_flight.append((pending, batch, started))
                    self._wake.notify_all()

    def _submit(self, batch: list[_Request]) -> Any:
        """The batch onto the engine (outside the lock: packing copies megabytes), or every
        request of it failed with the engine's error."""
        grid = np.array([canvas_grid(r.prep.canvas.shape, self.vit.processor) for r in batch], dtype=np.int64)
        try:
            with self.vit.engine_turn():
                return self.stager.submit([r.prep.canvas for r in batch], grid, batch[0].outputs, batch[0].dtype)
        except BaseException as exc:  # a GPU fault (GlmVitError) or a bug: these requests fail, the batcher lives
            for request in batch:
                request.future.set_exception(exc)
            return None
        finally:
            for request in batch:
                request.prep = None  # the canvas is in the stager's slot now

    def _collect(self) -> None:
        while True:
            with self._lock:
                while not self._in_flight:
                    self._wake.wait()
                if self._in_flight[0] is None:
                    return
                pending, batch, started = self._in_flight[0]
            try:
                arrays = pending.result()
                error = None
            except BaseException as exc:  # the engine failed this batch: its requests, not the batcher
                error = exc
            done = time.perf_counter()
            with self._lock:
                self._in_flight.popleft()
                self._wake.notify_all()
                if error is None:
                    t = self._totals
                    t["batches"] += 1
                    t["images"] += len(batch)
                    t["tokens"] += int(pending.offsets[-1])
                    t["gpu_ms"] += pending.gpu_ms
            if error is not None:
                for request in batch:
                    request.future.set_exception(error)
                continue
            self._answer(batch, pending, arrays, started, done)
            if self.on_batch is not None:
                self.on_batch(len(batch), int(pending.offsets[-1]), done - started)

    def _answer(self, batch: list[_Request], pending: Any, arrays: dict[str, np.ndarray], started: float,
                done: float) -> None:
        for i, request in enumerate(batch):
            a, b = int(pending.offsets[i]), int(pending.offsets[i + 1])
            if not pending.finite[a:b].all():
                request.future.set_exception(InputError(f"{item_name(request.item)}: the embedding has non-finite "
                                                        "values (NaN or Inf)"))
                continue
            timing = Timing(started - request.submitted, request.decode_s, done - started,
                            time.perf_counter() - request.submitted)
            rows = {name: arrays[name][a:b] for name in request.outputs}
            request.future.set_result(library_output(rows, pending.grid_thw[i], request.dtype, timing))
