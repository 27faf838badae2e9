"""The streaming pipeline: images in, embeddings out, at the speed of the engine.

    sources -> decode workers -> packer -> engine (stager) -> in-order results -> sink
              (N processes:      (token     (upload of k+1     (placeholders      (shards, or
               read, decode,      budget)    while k computes)  filled per batch)   the caller)
               resize, pad)

Every stage is bounded: at most `window` images are being decoded or wait decoded, two
batches are on the engine, and results leave in input order as soon as the images before
them are done, so memory does not grow with the collection. Workers hand over the uint8
canvas (preprocess.canvas); the engine patchifies it itself (staging.py). Workers are
processes (workers.Child: fresh interpreters that die with their parent): the decode is
CPU-bound Python/PIL, and a fork of a process that holds a CUDA context is not safe.
`GlmVit.encode_iter` and the CLI's collection runs (`encode_collection`) are both built on
`stream`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import queue
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .errors import GlmVitError
from .geometry import GlmVitGeometry, check_patch_budget, patch_budget
from .preprocess import EncodedImage, ProcessorConfig, canvas, canvas_grid, check_processor
from .shards import FORMAT, BackgroundWriter, OutputDir, ShardWriter
from .sources import Source
from .staging import OUTPUT_NAMES, check_dtype, make_stager
from .workers import Child, usable_cpus

DEFAULT_WORKERS = max(1, usable_cpus() - 1)  # all usable cores but one: the engine's host thread
OUTPUTS = {"pooler": ("pooler_output",), "last_hidden": ("last_hidden_state",), "both": OUTPUT_NAMES}
DEFAULT_OUTPUT = "pooler"  # the merger's output: what the LM splices in


@dataclasses.dataclass
class Prepared:
    """What a worker sends back for one input: its canvas, or why there is none."""

    canvas: np.ndarray | None
    error: str | None
    nbytes: int | None = None  # of the file (sources only)
    sha256: str | None = None
    decode_s: float = 0.0


def prepare(item: Any, processor: ProcessorConfig) -> Prepared:
    """Read (sources), decode and resize one input in a worker, timed. Every failure is a reason."""
    start = time.perf_counter()
    prepared = _prepare(item, processor)
    prepared.decode_s = time.perf_counter() - start
    return prepared


def _prepare(item: Any, processor: ProcessorConfig) -> Prepared:
    nbytes = sha = None
    try:
        if isinstance(item, Source):
            try:
                data = item.read()
            except OSError as exc:
                return Prepared(None, f"{item.name}: cannot read: {exc.strerror or exc}")
            nbytes, sha = len(data), hashlib.sha256(data).hexdigest()
            item = EncodedImage(item.name, data)
        return Prepared(canvas(item, processor), None, nbytes, sha)
    except GlmVitError as exc:
        return Prepared(None, str(exc), nbytes, sha)
    except MemoryError:
        return Prepared(None, f"{getattr(item, 'name', 'image')}: out of memory while decoding", nbytes, sha)


def _decode_worker(conn: Any) -> None:
    """A decode worker process (workers.Child): (input, processor) in, Prepared out, until the
    parent closes the connection. The canvas travels as its raw bytes after the rest (a pickled
    array costs two more copies of it: a third of a lone request's time)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    while True:
        try:
            item, processor = conn.recv()
        except EOFError:
            return
        prepared = prepare(item, processor)
        canvas_ = prepared.canvas
        prepared.canvas = None
        conn.send((prepared, None if canvas_ is None else canvas_.shape))
        if canvas_ is not None:
            conn.send_bytes(memoryview(np.ascontiguousarray(canvas_)).cast("B"))


def _receive_prepared(conn: Any) -> Prepared:
    """What _decode_worker sends, the canvas read straight into its array."""
    prepared, shape = conn.recv()
    if shape is not None:
        prepared.canvas = np.empty(shape, dtype=np.uint8)
        conn.recv_bytes_into(prepared.canvas.reshape(-1))  # flat: a 3-D view's len() is its height
    return prepared


def item_name(item: Any) -> str:
    """How messages name an input."""
    return str(item) if isinstance(item, (str, Path)) else getattr(item, "name", f"a {type(item).__name__}")


def _decode_child() -> Child:
    return Child(_decode_worker, (), "glmvit-cupy decode")


class DecodePool:
    """`workers` decode processes (workers.Child), each fed by a thread of its own that sends it
    one input at a time. A worker that dies (the OOM killer, a crash in a decoder) is replaced
    and its input tried once more on the new one; if that one dies too, the input fails alone.
    A future cancelled before its input reaches a worker costs nothing."""

    def __init__(self, workers: int) -> None:
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._feed, daemon=True, name=f"glmvit-decode-{i}")
                        for i in range(workers)]
        for thread in self.threads:
            thread.start()

    def submit(self, item: Any, processor: ProcessorConfig) -> Future:
        future: Future = Future()
        self.tasks.put((future, item, processor))
        return future

    def _feed(self) -> None:
        child = _decode_child()  # started now: up before the first input
        try:
            while (task := self.tasks.get()) is not None:
                future, item, processor = task
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result, child = self._decode(child, item, processor)
                except Exception as exc:  # a bug, not the input: this input's error; the worker is made anew
                    future.set_exception(exc)
                    child.close(0)
                    child = _decode_child()
                    continue
                future.set_result(result)
        finally:
            child.close()

    @staticmethod
    def _decode(child: Child, item: Any, processor: ProcessorConfig) -> tuple[Prepared, Child]:
        """One input on `child`, and once more on a new worker if that one dies under it; the
        result and the worker to go on with."""
        for _ in range(2):
            try:
                child.conn.send((item, processor))
                return _receive_prepared(child.conn), child
            except (EOFError, OSError):  # the worker died under this input
                child.close(0)
                child = _decode_child()
        return Prepared(None, f"{item_name(item)}: its decode worker process died twice (killed, or out of memory "
                              "while decoding it)"), child

    def close(self) -> None:
        """Cancel what no worker has taken, then stop the workers once their inputs are done."""
        while True:
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task[0].cancel()
        for _ in self.threads:
            self.tasks.put(None)
        for thread in self.threads:
            thread.join()


class Decoder:
    """Decode of inputs by `workers` processes (DecodePool; 0: in the calling thread), one at a
    time (`submit`) or in order over an iterable with at most `window` in flight (`map`).
    threads=True: by `workers` threads instead, for a host that kills its child processes before
    it lets them be closed (a Ray actor); PIL decodes and resizes without the GIL, so threads
    scale too. `processor` is the default of each input's settings."""

    def __init__(self, workers: int, processor: ProcessorConfig, threads: bool = False) -> None:
        if workers < 0:
            raise GlmVitError(f"workers {workers}: expected 0 (decode in this process) or more")
        self.processor, self.workers = processor, workers
        self.window = 4 * workers + 8  # a few images a worker queued: none waits for the main thread
        self.pool: ThreadPoolExecutor | DecodePool | None = None
        if workers and threads:
            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="glmvit-decode")
        elif workers:
            self.pool = DecodePool(workers)

    def submit(self, item: Any, processor: ProcessorConfig | None = None) -> Future:
        """A future of the input's Prepared."""
        processor = processor or self.processor
        if isinstance(self.pool, DecodePool):
            return self.pool.submit(item, processor)
        if self.pool is not None:
            return self.pool.submit(prepare, item, processor)
        future: Future = Future()
        future.set_result(prepare(item, processor))
        return future

    def map(self, items: Iterable[Any], processor: ProcessorConfig | None = None) -> Iterator[Prepared]:
        queue_: deque[Future] = deque()
        try:
            for item in items:
                queue_.append(self.submit(item, processor))
                if len(queue_) >= self.window:
                    yield queue_.popleft().result()
            while queue_:
                yield queue_.popleft().result()
        finally:
            for future in queue_:
                future.cancel()

    def close(self) -> None:
        if isinstance(self.pool, ThreadPoolExecutor):
            self.pool.shutdown(wait=True, cancel_futures=True)
        elif self.pool is not None:
            self.pool.close()
        self.pool = None


def check_collection_settings(geo: GlmVitGeometry, processor: ProcessorConfig, max_pixels: int | None) -> None:
    """Before a collection run starts (encode, Ray): the processor must cut the tower's patches,
    and every image it makes, up to its max_image_tokens, must fit one forward call."""
    check_processor(processor, geo)
    if processor.do_resize:
        check_patch_budget(geo, processor.max_image_tokens * geo.merge_unit,
                           patch_budget(geo, max_pixels, processor.max_image_tokens),
                           f"one image at the processor's max_image_tokens {processor.max_image_tokens} "
                           "(--max-image-tokens lowers it)")


def plan_batches(patch_counts: Sequence[int], p_max: int) -> list[range]:
    """The packer's rule, for anyone who needs the same batches (benchmarks): consecutive
    images, a new batch whenever the next one would take the batch past p_max patches."""
    batches, start, total = [], 0, 0
    for i, n in enumerate(patch_counts):
        if i > start and total + n > p_max:
            batches.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(patch_counts):
        batches.append(range(start, len(patch_counts)))
    return batches


@dataclasses.dataclass
class Encoded:
    """One input's outcome, in input order: its rows of each output (in the asked dtype) and
    grid, or the reason it failed."""

    item: Any
    arrays: dict[str, np.ndarray] | None
    grid_thw: np.ndarray | None  # int64 [3]
    error: str | None
    nbytes: int | None = None
    sha256: str | None = None
    batch: int | None = None  # which of the stream's forward batches computed it (0, 1, ...)


class StreamTurn:
    """One stream at a time over `lock`, for an engine's owner (GlmVit, devices.EngineGroup) whose
    stream_turn it is: its decode pool and engine buffers serve one stream. A stream, or a call
    that waits for one, from inside a stream of the same thread is refused in one line naming
    `inside` (it would wait for itself)."""

    def __init__(self, lock: Any, inside: str) -> None:
        self.lock, self.inside = lock, inside
        self.thread: int | None = None  # the thread running a stream

    def held_here(self) -> bool:
        return self.thread == threading.get_ident()

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        if self.held_here():
            raise GlmVitError(f"{what} called inside {self.inside}: finish or close that loop first")
        with self.lock:
            self.thread = threading.get_ident()
            try:
                yield
            finally:
                self.thread = None


@dataclasses.dataclass
class StreamStats:
    tokens: int = 0
    batches: int = 0
    gpu_ms: dict[int, float] = dataclasses.field(default_factory=dict)  # per engine of the stager


def stream(vit, items: Iterable[Any], **options: Any) -> Iterator[Encoded]:
    """Encode `items` (sources, paths, PIL images or arrays) through `vit`, yielding one Encoded
    per item in input order, holding vit's stream turn (threads sharing vit take turns). An
    output with a non-finite value is a failure of that image. Options: stream_in_turn's."""
    with vit.stream_turn():
        yield from stream_in_turn(vit, items, **options)


def stream_in_turn(vit, items: Iterable[Any], *, outputs: Sequence[str] = OUTPUT_NAMES, dtype: str = "float32",
                   workers: int = DEFAULT_WORKERS, processor: ProcessorConfig | None = None,
                   stats: StreamStats | None = None, decoder: Decoder | None = None,
                   stager: Any = None) -> Iterator[Encoded]:
    """stream, for a caller that holds vit.stream_turn(). `decoder` and `stager`
    (staging.make_stager for this processor) may be kept by the caller across streams; by
    default each stream makes its own (devices.EngineGroup is the stager of its engine
    processes)."""
    processor = processor or vit.processor
    own = decoder is None
    decoder = decoder or Decoder(workers, processor)
    try:
        mine, theirs = itertools.tee(items)  # the decoder runs at most its window ahead of us
        yield from encode_prepared(vit, zip(mine, decoder.map(theirs, processor)), outputs=outputs, dtype=dtype,
                                   processor=processor, stats=stats, stager=stager)
    finally:
        if own:
            decoder.close()


def encode_prepared(vit, prepared: Iterable[tuple[Any, Prepared]], *, outputs: Sequence[str] = OUTPUT_NAMES,
                    dtype: str = "float32", processor: ProcessorConfig | None = None,
                    stats: StreamStats | None = None, stager: Any = None) -> Iterator[Encoded]:
    """The engine's half of a stream: inputs already decoded ((input, its Prepared), in input
    order) packed into forward batches of at most vit.p_max patches (plan_batches' rule), two
    on the stager at a time, and yielded as Encoded in input order. The Ray actors run it on
    the canvases of their decode stage."""
    processor = processor or vit.processor
    check_processor(processor, vit.geometry)
    check_dtype(dtype)
    stats = stats if stats is not None else StreamStats()
    stager = stager or make_stager(vit, processor)
    for engine in range(stager.engines):
        stats.gpu_ms.setdefault(engine, 0.0)
    order: deque[list] = deque()  # [item, Encoded or None] per input, in input order
    batch: list[tuple[list, Prepared]] = []
    patches = 0
    in_flight: deque[tuple[Any, list]] = deque()

    def submit() -> None:
        nonlocal batch, patches
        grid = np.array([canvas_grid(p.canvas.shape, processor) for _, p in batch], dtype=np.int64)
        in_flight.append((stager.submit([p.canvas for _, p in batch], grid, outputs, dtype), batch))
        batch, patches = [], 0

    def collect() -> None:
        pending, members = in_flight.popleft()
        arrays = pending.result()
        number = stats.batches
        stats.batches += 1
        stats.gpu_ms[pending.engine] += pending.gpu_ms
        ok = pending.finite
        for i, (slot, prep) in enumerate(members):
            a, b = int(pending.offsets[i]), int(pending.offsets[i + 1])
            if not ok[a:b].all():
                slot[1] = Encoded(slot[0], None, None, f"{item_name(slot[0])}: the embedding has non-finite values "
                                  "(NaN or Inf)", prep.nbytes, prep.sha256)
                continue
            stats.tokens += b - a
            slot[1] = Encoded(slot[0], {name: arr[a:b] for name, arr in arrays.items()}, pending.grid_thw[i],
                              None, prep.nbytes, prep.sha256, number)

    def ready() -> Iterator[Encoded]:
        while order and order[0][1] is not None:
            yield order.popleft()[1]

    for item, prep in prepared:
        slot = [item, None]
        order.append(slot)
        if prep.error is None:
            n = int(np.prod(canvas_grid(prep.canvas.shape, processor)))
            try:  # an image no forward call holds is its own failure, not the run's
                check_patch_budget(vit.geometry, n, vit.p_max, item_name(item))
            except GlmVitError as exc:
                prep = Prepared(None, str(exc), prep.nbytes, prep.sha256)
        if prep.error is not None:
            slot[1] = Encoded(item, None, None, prep.error, prep.nbytes, prep.sha256)
        else:
            if batch and patches + n > vit.p_max:
                submit()
                while len(in_flight) >= stager.depth:  # one engine: k+1 uploads while k computes
                    collect()
            batch.append((slot, prep))
            patches += n
        yield from ready()
    if batch:
        submit()
    while in_flight:
        collect()
        yield from ready()


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What a collection run did."""

    encoded: int
    skipped: int  # already done in the output directory
    failed: int
    tokens: int
    wall_s: float
    gpu_busy_s: tuple[float, ...] | None  # each engine stream's busy time (None on the NumPy backend)

    @property
    def images_per_s(self) -> float:
        return self.encoded / self.wall_s if self.wall_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def gpu_busy(self) -> tuple[float, ...] | None:
        """Each engine's busy fraction of the run."""
        return None if self.gpu_busy_s is None or not self.wall_s else tuple(b / self.wall_s for b in self.gpu_busy_s)


def encode_collection(vit, sources: Sequence[Source], out_dir: str | Path, *, workers: int = DEFAULT_WORKERS,
                      shard_size: int, output: str = "pooler", dtype: str = "bfloat16",
                      processor: ProcessorConfig | None = None, fail_fast: bool = False,
                      progress: Any = None, decoder: Decoder | None = None, stager: Any = None) -> RunSummary:
    """Encode `sources` into shards in `out_dir`, skipping those already there (resume).
    `progress` (progress.Progress) hears `start(inputs to do)`, then `(Encoded, stats)` per input.
    `stager`: as stream's (devices.EngineGroup spreads the batches over engine processes)."""
    outputs = OUTPUTS[output]
    processor = processor or vit.processor
    metadata = shard_metadata(vit, outputs, dtype, processor)
    start = time.perf_counter()
    directory = OutputDir(Path(out_dir), metadata)
    try:
        todo = [s for s in sources if s.key not in directory.done]
        writer = BackgroundWriter(ShardWriter(directory.directory, outputs, dtype, vit.geometry.out_hidden_size,
                                              shard_size, directory.next_index, metadata))
        stats, failures, encoded = StreamStats(), [], 0
        if progress is not None:
            progress.start(len(todo))
        try:
            for result in stream(vit, todo, outputs=outputs, dtype=dtype, workers=workers, processor=processor,
                                 stats=stats, decoder=decoder, stager=stager):
                if result.error is not None:
                    failures.append({**result.item.record(), "error": result.error})
                    directory.write_failures(failures)
                    if fail_fast:
                        raise GlmVitError(f"{result.error} (--fail-fast: stopped at the first failure)")
                else:
                    record = {**result.item.record(), "bytes": result.nbytes, "sha256": result.sha256}
                    writer.add(record, result.arrays, result.grid_thw)
                    encoded += 1
                if progress is not None:
                    progress(result, stats)
            writer.finish()
        except KeyboardInterrupt:
            writer.finish()  # the images already done are kept; the rest is for the next run
            raise
        except BaseException:
            writer.discard()
            raise
        finally:
            directory.write_failures(failures)
        busy = tuple(ms / 1000 for _, ms in sorted(stats.gpu_ms.items())) if vit.backend == "cupy" else None
        return RunSummary(encoded, len(sources) - len(todo), len(failures), stats.tokens,
                          time.perf_counter() - start, busy)
    finally:
        directory.close()


def shard_metadata(vit, outputs: Sequence[str], dtype: str, processor: ProcessorConfig) -> dict[str, str]:
    """What every shard's header records of the settings that made it (a resume, or a reader of
    several directories, refuses shards made otherwise)."""
    return {"format": FORMAT, "tower": vit.fingerprint, "outputs": ",".join(outputs), "dtype": dtype,
            "processor": json.dumps(dataclasses.asdict(processor), sort_keys=True)}
