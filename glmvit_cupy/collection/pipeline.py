"""The streaming pipeline: images and videos in, embeddings out, at the speed of the engine.

    sources -> decode workers -> packer -> engine (stager) -> in-order results -> sink
              (N processes:      (token     (upload of k+1     (placeholders      (shards, or
               read, decode,      budget)    while k computes)  filled per batch)   the caller)
               resize, pad)

Every stage is bounded: at most `window` inputs are being decoded or wait decoded (and at
most clips.FRAME_BYTES_AHEAD of video frames received and not yet staged, but for a group of
the video the packer waits for), two batches are on the engine, and results leave in input
order as soon as the inputs before them are done, so memory does not grow with the collection
nor with a video's length. Workers hand over uint8 pixels: an image's canvas
(preprocess.canvas), or a video's sampled frames on their canvas, streamed a frame at a time
(clips.py); the engine patchifies them itself (staging.py). The packer deals in temporal
groups (an image is one) and takes a video's as they arrive: where a batch fills, the video is
cut between groups and continued in the next (exact: attention never crosses a group). While
the video it is on has no group waiting (one worker decodes a video, often slower than the
engine takes it), it packs the groups of the inputs after it (at most ROW_BYTES_AHEAD of their
rows). An input's pieces' rows are joined again in time order when its turn comes, or, for a
collection's shards, each input is announced as it is admitted (Reserve: the shard writer
takes its rows' place) and its rows leave one batch's at a time as collected (Part), whichever
input is first, to be written at their place. Workers are processes
(workers.Child: fresh interpreters that die with their parent): the decode is CPU-bound
Python/PIL/FFmpeg, and a fork of a process that holds a CUDA context is not safe.
`GlmVit.encode_iter` and the CLI's collection runs (`encode_collection`) are both built on
`stream`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import queue
import signal
import socket
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, Union

import numpy as np

from . import clips
from ..errors import GlmVitError, InternalError
from ..processor.preprocess import EncodedImage, ProcessorConfig, canvas, canvas_grid, check_processor
from ..processor.video import VideoConfig, check_video_config
from ..tower.geometry import GlmVitGeometry, check_patch_budget, patch_budget
from ..workers import Child, usable_cpus
from .clips import ClipInfo, FrameBudget, Groups
from .shards import FORMAT, BackgroundWriter, OutputDir, ShardWriter
from .sources import Source
from .staging import DTYPES, OUTPUT_NAMES, check_dtype, make_stager

DEFAULT_WORKERS = max(1, usable_cpus() - 1)  # all usable cores but one: the engine's host thread
OUTPUTS = {"pooler": ("pooler_output",), "last_hidden": ("last_hidden_state",), "both": OUTPUT_NAMES}
DEFAULT_OUTPUT = "pooler"  # the merger's output: what the LM splices in
# Rows a stream may compute of inputs after the first video whose frames still come: while one
# worker decodes that video slower than the engine takes it, the groups of later inputs keep
# the engine busy, their rows held until their turn, or, in a stream of parts, handed to the
# shard writer, which holds those past its open shard (4 GiB: 524,288 tokens of the bf16 pooler,
# as many bytes as the frames ahead, clips.FRAME_BYTES_AHEAD).
ROW_BYTES_AHEAD = 4 << 30


@dataclasses.dataclass
class Prepared:
    """What a worker sends back for one input: its uint8 pixels (an image's canvas [H, W, 3], a
    video's sampled frames [T, H, W, 3]), or why there are none."""

    canvas: np.ndarray | None
    error: str | None
    nbytes: int | None = None  # of the file (sources only)
    sha256: str | None = None
    decode_s: float = 0.0
    video: ClipInfo | None = None  # a video's timestamps, frames and frame rate
    groups: Groups | None = None  # a DecodePool's video: its frames, a temporal group at a time as they come


Config = Union[ProcessorConfig, VideoConfig]  # an input's settings: the image or the video processor's


def prepare(item: Any, config: Config) -> Prepared:
    """Read (sources), decode and resize one input in this process, timed. Every failure is a reason."""
    start = time.perf_counter()
    steps = _start(item, config)
    prepared, shape = next(steps)
    if shape is not None:  # a video: its frames follow
        frames = np.empty(shape, dtype=np.uint8)
        try:
            for row, frame in zip(frames, steps):
                row[...] = frame
            prepared.canvas = frames
        except (GlmVitError, MemoryError) as exc:
            prepared = Prepared(None, _reason(item, exc), prepared.nbytes, prepared.sha256)
    prepared.decode_s = time.perf_counter() - start
    return prepared


def _reason(item: Any, exc: BaseException) -> str:
    if isinstance(exc, MemoryError):
        return f"{item_name(item)}: out of memory while decoding"
    return str(exc)


def _start(item: Any, config: Config) -> Iterator[Any]:
    """One input's decode as a generator. First (Prepared, None), holding an image's canvas or
    the input's failure; or, for a video, (Prepared without pixels, the frames' shape), then
    its frames one at a time (a fault among them raises GlmVitError)."""
    nbytes = sha = None
    try:
        if isinstance(config, VideoConfig):
            steps = clips.start(item, config)
            nbytes, sha, info, shape = next(steps)
            head = Prepared(None, None, nbytes, sha, video=info), shape
        elif isinstance(item, Source) and item.kind == "video":  # given the image processor's settings
            head = Prepared(None, f"{item.name}: a video; this run takes images only (glmvit-cupy encode --out-dir "
                                  "and GlmVit.encode_video take videos)"), None
        else:
            if isinstance(item, Source):
                data = item.read()
                nbytes, sha = len(data), hashlib.sha256(data).hexdigest()
                item = EncodedImage(item.name, data)
            head = Prepared(canvas(item, config), None, nbytes, sha), None
    except OSError as exc:
        head = Prepared(None, f"{item_name(item)}: cannot read: {exc.strerror or exc}", nbytes, sha), None
    except (GlmVitError, MemoryError) as exc:
        head = Prepared(None, _reason(item, exc), nbytes, sha), None
    yield head
    if head[1] is not None:
        yield from steps  # a fault here is the caller's to catch: the frames before it are gone already


# Pixels cross from a decode worker as raw bytes after the rest (a pickled array costs two more
# copies of it: a third of a lone request's time), in messages of their own: an 8-byte length,
# then the bytes, which the parent reads straight into their array in one recv(MSG_WAITALL),
# without the GIL until the whole message is in. Connection.recv_bytes_into reads a message into
# a BytesIO in chunks and copies it out, holding the GIL for both copies; a read a socket buffer
# at a time takes the GIL back after each, behind whatever Python the main thread runs. A video
# collection moves GBs of frames through the parent (benchmarks/NOTES.md, issue 26).
_PIXELS_HEAD = struct.Struct("!Q")


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _send_pixels(conn: Any, pixels: np.ndarray | bytes) -> None:
    """One pixel message (b"": the empty one, which says decoding failed part way)."""
    data = memoryview(pixels).cast("B")
    _write_all(conn.fileno(), memoryview(_PIXELS_HEAD.pack(len(data))))
    _write_all(conn.fileno(), data)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):  # MSG_WAITALL returns short only at a signal or the end
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError("the decode worker's connection closed inside a message")
        got += n


def _recv_pixels(conn: Any, out: np.ndarray) -> int:
    """One pixel message read into `out` (contiguous uint8), which it must fill; its size in
    bytes (0: the empty message)."""
    sock = socket.socket(fileno=conn.fileno())  # borrowed: detached below, so the connection keeps its fd
    try:
        head = bytearray(_PIXELS_HEAD.size)
        _read_into(sock, memoryview(head))
        (size,) = _PIXELS_HEAD.unpack(head)
        if size and size != out.nbytes:
            raise InternalError(f"a decode worker sent {size} bytes of pixels where {out.nbytes} were expected")
        if size:
            _read_into(sock, memoryview(out).cast("B"))
    finally:
        sock.detach()
    return size


def _decode_worker(conn: Any) -> None:
    """A decode worker process (workers.Child): (input, settings) in, Prepared out, until the
    parent closes the connection. Pixels follow the rest as pixel messages (_send_pixels): an
    image's canvas in one, a video's frames one a message as they are decoded, then an empty
    message and the reason if decoding fails part way."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    while True:
        try:
            item, config = conn.recv()
        except EOFError:
            return
        start = time.perf_counter()
        steps = _start(item, config)
        prepared, shape = next(steps)
        prepared.decode_s = time.perf_counter() - start
        pixels, prepared.canvas = prepared.canvas, None
        conn.send((prepared, shape if pixels is None else pixels.shape))
        if pixels is not None:
            _send_pixels(conn, np.ascontiguousarray(pixels))
        elif shape is not None:
            try:
                for frame in steps:
                    _send_pixels(conn, frame)
            except (GlmVitError, MemoryError) as exc:
                _send_pixels(conn, b"")
                conn.send(_reason(item, exc))


def _receive_prepared(conn: Any, name: str, temporal: int, publish: Any, budget: FrameBudget | None = None,
                      ticket: Any = None) -> Prepared | None:
    """What _decode_worker sends, the pixels read straight into their array. A video's
    Prepared is published (`publish`) at its header, holding its Groups, which its frames
    then fill a temporal group (`temporal` frames) at a time, each once `budget` has room for it
    (`ticket`: its decode's future); None is returned then. A connection lost after that ends
    the video's groups with the reason and raises."""
    prepared, shape = conn.recv()
    if shape is None:
        return prepared
    if prepared.video is None:
        prepared.canvas = np.empty(shape, dtype=np.uint8)
        _recv_pixels(conn, prepared.canvas)
        return prepared
    groups = prepared.groups = Groups(shape, temporal, budget, ticket)
    publish(prepared)
    taken = 0  # bytes taken for the group being received
    try:
        for _ in range(groups.count):
            group = np.empty((temporal, *shape[1:]), dtype=np.uint8)
            groups.take(group.nbytes)
            taken = group.nbytes
            for row in group.reshape(temporal, -1):  # a frame a message
                if _recv_pixels(conn, row) == 0:  # decoding failed part way: the reason follows
                    groups.end(conn.recv(), lost=taken)
                    return None
            groups.received(group)
            taken = 0
        groups.end()
    except BaseException as exc:
        groups.end(f"{name}: its decode worker process died while decoding it (killed, or out of memory)"
                   if isinstance(exc, (EOFError, OSError)) else f"{name}: {exc!r}", lost=taken)
        raise
    return None


def item_name(item: Any) -> str:
    """How messages name an input."""
    return str(item) if isinstance(item, (str, Path)) else getattr(item, "name", f"a {type(item).__name__}")


# A decode worker is one core's work (the pool has one a core): its BLAS (the video resize's
# products) runs on one thread, not on every core in every worker.
_WORKER_THREADS = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def _decode_child() -> Child:
    return Child(_decode_worker, (), "glmvit-cupy decode", env={**os.environ, **_WORKER_THREADS})


class DecodePool:
    """`workers` decode processes (workers.Child), each fed by a thread of its own that sends it
    one input at a time. A worker that dies (the OOM killer, a crash in a decoder) is replaced
    and its input tried once more on the new one (a video only before its header: after it,
    the video fails alone, its groups so far already packed); if that one dies too, the input
    fails alone. A future cancelled before its input reaches a worker costs nothing. `budget`
    bounds the video frames received and not yet staged (clips.FrameBudget)."""

    def __init__(self, workers: int) -> None:
        self.budget = FrameBudget()
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._feed, daemon=True, name=f"glmvit-decode-{i}")
                        for i in range(workers)]
        for thread in self.threads:
            thread.start()

    def submit(self, item: Any, config: Config) -> Future:
        future: Future = Future()
        self.tasks.put((future, item, config))
        return future

    def _feed(self) -> None:
        child = _decode_child()  # started now: up before the first input
        try:
            while (task := self.tasks.get()) is not None:
                future, item, config = task
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result, child = self._decode(child, item, config, future)
                except Exception as exc:  # a bug, not the input: this input's error; the worker is made anew
                    if not future.done():  # else its video's groups ended with it
                        future.set_exception(exc)
                    child.close(0)
                    child = _decode_child()
                    continue
                if result is not None:
                    future.set_result(result)
        finally:
            child.close()

    def _decode(self, child: Child, item: Any, config: Config,
                future: Future) -> tuple[Prepared | None, Child]:
        """One input on `child`, and once more on a new worker if that one dies under it before
        a video's header (after it, the video's groups end with the reason); the result (None: a
        video's, published at its header) and the worker to go on with."""
        for _ in range(2):
            try:
                child.conn.send((item, config))
                return _receive_prepared(child.conn, item_name(item), config.temporal_patch_size, future.set_result,
                                         self.budget, future), child
            except (EOFError, OSError):  # the worker died under this input
                child.close(0)
                child = _decode_child()
                if future.done():
                    return None, child
        return Prepared(None, f"{item_name(item)}: its decode worker process died twice (killed, or out of memory "
                              "while decoding it)"), child

    def close(self) -> None:
        """Cancel what no worker has taken, then stop the workers once their inputs are done."""
        self.budget.release()  # a thread waiting for room goes on: its input is taken to its end
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
    scale too. `processor` is the default of each image's settings; `video` the video
    processor's settings, for video sources (None: a video source fails alone, saying that
    this decoder takes images only)."""

    def __init__(self, workers: int, processor: ProcessorConfig, threads: bool = False,
                 video: VideoConfig | None = None) -> None:
        if workers < 0:
            raise GlmVitError(f"workers {workers}: expected 0 (decode in this process) or more")
        self.processor, self.workers, self.video = processor, workers, video
        self.window = 4 * workers + 8  # a few images a worker queued: none waits for the main thread
        self.pool: ThreadPoolExecutor | DecodePool | None = None
        if workers and threads:
            self.pool = ThreadPoolExecutor(workers, thread_name_prefix="glmvit-decode")
        elif workers:
            self.pool = DecodePool(workers)

    def submit(self, item: Any, processor: ProcessorConfig | None = None) -> Future:
        """A future of the input's Prepared."""
        config: Config = processor or self.processor
        future: Future = Future()
        if isinstance(item, Source) and item.kind == "video" and self.video is not None:
            config = self.video
        if isinstance(self.pool, DecodePool):
            return self.pool.submit(item, config)
        if self.pool is not None:
            return self.pool.submit(prepare, item, config)
        future.set_result(prepare(item, config))
        return future

    def map(self, items: Iterable[Any], processor: ProcessorConfig | None = None) -> Iterator[Prepared]:
        queue_: deque[Future] = deque()
        try:
            for item in items:
                queue_.append(self.submit(item, processor))
                if len(queue_) >= self.window:
                    yield self._take(queue_.popleft())
            while queue_:
                yield self._take(queue_.popleft())
        finally:
            for future in queue_:
                future.cancel()
                future.add_done_callback(_abandon)  # a video's frames received for nobody: room again

    def _take(self, future: Future) -> Prepared:
        """The input the caller is now on: its frames go ahead of the budget when it waits for them."""
        if isinstance(self.pool, DecodePool):
            self.pool.budget.head(future)
        return future.result()

    def close(self) -> None:
        if isinstance(self.pool, ThreadPoolExecutor):
            self.pool.shutdown(wait=True, cancel_futures=True)
        elif self.pool is not None:
            self.pool.close()
        self.pool = None


def _abandon(future: Future) -> None:
    if not future.cancelled() and future.exception() is None and future.result().groups is not None:
        future.result().groups.abandon()


def check_collection_settings(geo: GlmVitGeometry, processor: ProcessorConfig, max_pixels: int | None,
                              images: bool = True) -> None:
    """Before a collection run starts (encode, Ray): the processor must cut the tower's patches,
    and every image it makes, up to its max_image_tokens, must fit one forward call (`images`:
    the run has images; a video is cut between temporal groups instead)."""
    check_processor(processor, geo)
    if processor.do_resize and images:
        check_patch_budget(geo, processor.max_image_tokens * geo.merge_unit,
                           patch_budget(geo, max_pixels, processor.max_image_tokens),
                           f"one image at the processor's max_image_tokens {processor.max_image_tokens} "
                           "(--max-image-tokens lowers it)")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Temporal groups [first, stop) of one input (`owner`) in a batch: an image's one group,
    or a run of a video's."""

    owner: Any
    first: int
    stop: int


class Packer:
    """The packer's rule: the inputs' temporal groups in order (an image is one group of its
    patches; a video has T/2 groups of (H/14)(W/14) patches), a batch closed whenever the next
    group would take it past p_max patches. A video is cut between groups where a batch closes
    and goes on in the next (exact: attention never crosses a group). A group larger than p_max
    goes alone, for the engine to refuse with the numbers at fault."""

    def __init__(self, p_max: int) -> None:
        self.p_max = p_max
        self.batch: list[Piece] = []  # the open batch
        self.patches = 0

    def add(self, owner: Any, groups: int, per_group: int, first: int = 0) -> tuple[list[list[Piece]], int]:
        """Place an input's groups [first, groups) (first > 0: the input's next groups as they
        come, which continue its piece in the open batch): (the batches this closed, in order;
        the pieces it added, those in the open batch included)."""
        closed, pieces = [], 0
        while first < groups:
            fit = min(groups - first, (self.p_max - self.patches) // per_group)
            if fit <= 0 and self.batch:
                closed.append(self.close())
                continue
            fit = max(fit, 1)
            last = self.batch[-1] if self.batch else None
            if last is not None and last.owner is owner and last.stop == first:
                self.batch[-1] = Piece(owner, last.first, first + fit)
            else:
                self.batch.append(Piece(owner, first, first + fit))
                pieces += 1
            self.patches += fit * per_group
            first += fit
        return closed, pieces

    def close(self) -> list[Piece]:
        """The open batch (empty when nothing is open), closed."""
        batch, self.batch, self.patches = self.batch, [], 0
        return batch


def plan_pieces(inputs: Sequence[tuple[int, int]], p_max: int) -> list[list[Piece]]:
    """The packer's batches of inputs of (groups, patches a group), for anyone who needs the
    same batches (benchmarks); each piece's owner is its input's index."""
    packer, batches = Packer(p_max), []
    for i, (groups, per_group) in enumerate(inputs):
        batches += packer.add(i, groups, per_group)[0]
    last = packer.close()
    return batches + [last] if last else batches


def plan_batches(patch_counts: Sequence[int], p_max: int) -> list[range]:
    """plan_pieces for images of these patch counts: each batch as the range of its images."""
    return [range(b[0].owner, b[-1].owner + 1) for b in plan_pieces([(1, n) for n in patch_counts], p_max)]


@dataclasses.dataclass
class Encoded:
    """One input's outcome, in input order: its rows of each output (in the asked dtype; a
    video's in time order; in a stream of parts none: its Parts carried them) and grid, or
    the reason it failed."""

    item: Any
    arrays: dict[str, np.ndarray] | None
    grid_thw: np.ndarray | None  # int64 [3]: (1, h, w) for an image, (T/2, h, w) for a video
    error: str | None
    nbytes: int | None = None
    sha256: str | None = None
    video: ClipInfo | None = None
    batch: int | None = None  # the stream's forward batch that computed it (0, 1, ...; a video's last)
    index: int | None = None  # its place in the stream's input order (0, 1, ...)


@dataclasses.dataclass
class Reserve:
    """In a stream of parts (encode_prepared(parts=True)): an input admitted, in input order,
    whose `rows` rows come as Parts before its Encoded; `index` names it in both (the same
    input may come twice)."""

    item: Any
    rows: int
    index: int


@dataclasses.dataclass
class Part:
    """In a stream of parts: an input's rows of one forward batch, from its row `first` on, as
    soon as the batch is collected, whichever input is first in order; its Encoded holds no
    rows, or says it failed (then its Parts are void)."""

    item: Any
    arrays: dict[str, np.ndarray]
    first: int
    index: int


@dataclasses.dataclass
class _Slot:
    """An input on its way through encode_prepared: its groups taken and not yet staged, its
    pieces as the packer placed them, their rows as they are collected, and, once all are in
    (or it failed), its Encoded."""

    item: Any
    prep: Prepared
    index: int = 0  # in the stream's input order
    grid: tuple[int, int, int] = (0, 0, 0)
    waiting: deque = dataclasses.field(default_factory=deque)  # groups placed, not yet staged
    groups_placed: int = 0
    pieces: int = 0  # placed by the packer
    placed: bool = False  # all of them
    collected: int = 0
    tokens: int = 0
    rows: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    handed: int = 0  # rows gone as Parts
    error: str | None = None
    result: Encoded | None = None

    def fail(self, error: str) -> None:
        prep = self.prep
        self.result = Encoded(self.item, None, None, error, prep.nbytes, prep.sha256, prep.video, index=self.index)

    def finish(self, stats: StreamStats, batch: int | None, parts: bool) -> None:
        """All its pieces are collected (the last in forward batch `batch`): its rows joined in
        time order, or, in a stream of parts, none (they go as Parts)."""
        if self.error is not None:
            self.fail(self.error)
            self.rows = []
        else:
            rows = self.rows
            if parts:
                arrays = {}
            elif len(rows) == 1:
                arrays = rows.pop()
            else:
                arrays = {name: np.concatenate([r[name] for r in rows]) for name in rows[0]}
                self.rows = []
            stats.tokens += self.tokens
            prep = self.prep
            self.result = Encoded(self.item, arrays, np.array(self.grid, dtype=np.int64), None, prep.nbytes,
                                  prep.sha256, prep.video, batch, self.index)


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
    output with a non-finite value is a failure of that input. Options: stream_in_turn's."""
    with vit.stream_turn():
        yield from stream_in_turn(vit, items, **options)


def stream_in_turn(vit, items: Iterable[Any], *, outputs: Sequence[str] = OUTPUT_NAMES, dtype: str = "float32",
                   workers: int = DEFAULT_WORKERS, processor: ProcessorConfig | None = None,
                   stats: StreamStats | None = None, decoder: Decoder | None = None,
                   stager: Any = None, parts: bool = False) -> Iterator[Encoded | Part | Reserve]:
    """stream, for a caller that holds vit.stream_turn(). `decoder` and `stager`
    (staging.make_stager for this processor and the decoder's video settings) may be kept by
    the caller across streams; by default each stream makes its own, for images only
    (devices.EngineGroup is the stager of its engine processes). Video sources need a decoder
    with video settings (Decoder(video=...)) and a stager made with the same."""
    processor = processor or vit.processor
    own = decoder is None
    decoder = decoder or Decoder(workers, processor)
    try:
        mine, theirs = itertools.tee(items)  # the decoder runs at most its window ahead of us
        yield from encode_prepared(vit, zip(mine, decoder.map(theirs, processor)), outputs=outputs, dtype=dtype,
                                   decoders=decoder.workers,
                                   processor=processor, stats=stats, stager=stager, video=decoder.video,
                                   parts=parts)
    finally:
        if own:
            decoder.close()


def encode_prepared(vit, prepared: Iterable[tuple[Any, Prepared]], *, outputs: Sequence[str] = OUTPUT_NAMES,
                    dtype: str = "float32", processor: ProcessorConfig | None = None,
                    stats: StreamStats | None = None, stager: Any = None,
                    video: VideoConfig | None = None, parts: bool = False,
                    decoders: int = 0) -> Iterator[Encoded | Part | Reserve]:
    """The engine's half of a stream: inputs already decoded ((input, its Prepared), in input
    order; a video's with the `video` settings it was decoded with) packed by the Packer into
    forward batches of at most vit.p_max patches, two on the stager at a time, and yielded as
    Encoded in input order. A video's groups are placed as its decode worker sends them (its
    Prepared's Groups), each let go once staged. While the first video still arriving has no
    group waiting, the groups of later inputs are placed (at most ROW_BYTES_AHEAD of their
    rows), so a video decoded slower than the engine runs does not idle it;
    `decoders`: how many inputs the source of `prepared` decodes at once (Decoder.workers), of
    which later inputs are taken only while fewer videos arrive (0: none is taken meanwhile).
    `parts`: each input admitted is announced (Reserve, in input order) and its rows leave as
    Parts as each batch is collected, whichever input is first (a collection's shard writer
    has their place; benchmarks/NOTES.md: rows held until their turn were written after the
    forward). The Ray actors run it on the canvases of their decode stage."""
    processor = processor or vit.processor
    check_processor(processor, vit.geometry)
    check_dtype(dtype)
    if video is not None:
        check_video_config(video, vit.geometry)
    stats = stats if stats is not None else StreamStats()
    stager = stager or make_stager(vit, processor, video)
    for engine in range(stager.engines):
        stats.gpu_ms.setdefault(engine, 0.0)
    temporal, merge = processor.temporal_patch_size, vit.geometry.merge_unit
    rows_ahead = ROW_BYTES_AHEAD // (len(outputs) * vit.geometry.out_hidden_size * np.dtype(DTYPES[dtype][0]).itemsize)
    order: deque[_Slot] = deque()  # in input order
    arriving: list[_Slot] = []  # videos whose groups still come, in input order
    ahead = 0  # merged tokens placed of the inputs after arriving[0] (their rows are held)
    packer = Packer(vit.p_max)
    in_flight: deque[tuple[Any, list[Piece]]] = deque()
    announced: deque[Reserve] = deque()  # inputs admitted, their Reserve not yet yielded
    # The stager's first batch has one-time costs (the engine's scratch, kernels loaded on their
    # first launch, the output slots): a thread pays them while the first inputs decode, and the
    # first submit waits for it. No warm-up outlives the stream (its turn on the engine).
    warmer = ThreadPoolExecutor(1, thread_name_prefix="glmvit-warm-up")
    warming: Future | None = warmer.submit(stager.warm_up, outputs, dtype)

    def warmed() -> None:
        nonlocal warming
        if warming is not None:
            done, warming = warming, None
            done.result()

    def submit(batch: list[Piece]) -> None:
        warmed()
        pixels, grid, staged = [], [], []
        for piece in batch:
            slot = piece.owner
            taken = [slot.waiting.popleft() for _ in range(piece.stop - piece.first)]
            # A video's groups go to the stager one by one (its rows are group-major, so the piece's rows
            # are the same): joined first, every frame was copied once more on this thread, which feeds
            # the engine (~20 % of a video collection's main thread on the H200, benchmarks/NOTES.md).
            pixels += taken
            grid.append((piece.stop - piece.first, *slot.grid[1:]))
            if slot.prep.groups is not None:
                staged.append((slot.prep.groups, sum(g.nbytes for g in taken)))
        in_flight.append((stager.submit(pixels, np.array(grid, dtype=np.int64), outputs, dtype), batch))
        for groups, nbytes in staged:  # the stager has copied them
            groups.staged(nbytes)

    def collect() -> None:
        pending, batch = in_flight.popleft()
        arrays = pending.result()
        number = stats.batches
        stats.batches += 1
        stats.gpu_ms[pending.engine] += pending.gpu_ms
        ok = pending.finite
        for i, piece in enumerate(batch):
            slot = piece.owner
            a, b = int(pending.offsets[i]), int(pending.offsets[i + 1])
            if not ok[a:b].all():
                slot.error = f"{item_name(slot.item)}: the embedding has non-finite values (NaN or Inf)"
            elif slot.error is None:
                slot.rows.append({name: arr[a:b] for name, arr in arrays.items()})
                slot.tokens += b - a
            slot.collected += 1
            if slot.placed and slot.collected == slot.pieces:
                slot.finish(stats, number, parts)

    def place(slot: _Slot, group: np.ndarray) -> None:
        """Pack the input's next group, submitting each batch that closes (k + 1 uploads while
        k computes)."""
        nonlocal ahead
        _, h, w = slot.grid
        slot.waiting.append(group)
        closed, pieces = packer.add(slot, slot.groups_placed + 1, h * w, slot.groups_placed)
        slot.pieces += pieces
        slot.groups_placed += 1
        if arriving and slot.index > arriving[0].index:
            ahead += group_tokens(slot)
        for batch in closed:
            submit(batch)
            while len(in_flight) >= stager.depth:
                collect()

    def ready() -> Iterator[Encoded | Part | Reserve]:
        while announced:
            yield announced.popleft()
        for slot in order if parts else ():
            if slot.error is None:
                for rows in slot.rows:
                    yield Part(slot.item, rows, slot.handed, slot.index)
                    slot.handed += len(next(iter(rows.values())))
                slot.rows = []
        while order and order[0].result is not None:
            yield order.popleft().result

    def placed(slot: _Slot) -> None:
        """All the input's groups are placed (or none will be: it failed)."""
        slot.placed = True
        if slot.collected == slot.pieces:  # none in flight (or none placed: it failed at once)
            slot.finish(stats, stats.batches - 1 if slot.pieces else None, parts)

    def admit(slot: _Slot) -> None:
        """An image is placed; a video joins `arriving`, its groups placed as they come (feed)."""
        nonlocal ahead
        prep = slot.prep
        if prep.error is not None:
            slot.fail(prep.error)
            return
        if prep.video is not None and prep.groups is None:  # decoded whole, in this process
            prep.groups, prep.canvas = Groups.whole(prep.canvas, temporal), None
        slot.grid = canvas_grid(prep.canvas.shape if prep.groups is None else prep.groups.shape, processor)
        _, h, w = slot.grid
        try:  # an image (a video's group) no forward call holds is its own failure, not the run's
            check_patch_budget(vit.geometry, h * w, vit.p_max, item_name(slot.item) if prep.video is None else
                               f"{item_name(slot.item)}: one temporal group")
        except GlmVitError as exc:
            slot.fail(str(exc))
            if prep.groups is not None:
                prep.groups.abandon()
            return
        if parts:
            announced.append(Reserve(slot.item, slot.grid[0] * group_tokens(slot), slot.index))
        if prep.groups is None:
            canvas_, prep.canvas = prep.canvas, None  # the batch holds it
            place(slot, canvas_)
            placed(slot)
        else:
            arriving.append(slot)
            if len(arriving) == 1:  # the first: no input after it is placed yet
                ahead = 0

    def group_tokens(slot: _Slot) -> int:
        return slot.grid[1] * slot.grid[2] // merge

    def room() -> int:
        """Merged tokens that may still be placed for inputs after the first video arriving."""
        return rows_ahead - ahead

    def placeable(slot: _Slot) -> bool:
        """Whether the video's next group may be placed now."""
        return slot is arriving[0] or room() >= group_tokens(slot)

    def feed() -> Iterator[Encoded | Part | Reserve]:
        """Place the groups that have come of the first video arriving, then at most one of a
        later video's (within `rows_ahead`): the first video's groups go first even when they
        come while later ones are placed, since the sooner it is done, the sooner the inputs
        after it may be placed (the rows ahead are bounded) and its own record written. A video
        all of whose groups came leaves `arriving`. Returns whether anything was placed or left."""
        nonlocal ahead
        moved = False
        for slot in list(arriving):
            groups, lead = slot.prep.groups, slot is arriving[0]
            group = groups.pop() if placeable(slot) else None
            while group is not None:
                place(slot, group)
                moved = True
                yield from ready()
                if not lead:
                    return moved
                group = groups.pop()
            if groups.finished:
                arriving.remove(slot)
                slot.error = slot.error or groups.error
                placed(slot)
                moved = True
                if lead and arriving:  # the inputs after the new first are those held ahead now
                    first = arriving[0]
                    ahead = sum(s.groups_placed * group_tokens(s) for s in order if s.index > first.index)
                    first.prep.groups.lead()
        return moved

    try:
        inputs, more = enumerate(prepared), True
        while True:
            moved = yield from feed()
            yield from ready()
            # A later input is taken while videos arrive only if its decode has surely begun (the
            # pool starts inputs in order): else taking it could wait for a worker still busy
            # with a video whose frames, unplaced meanwhile, hold the frame budget.
            if more and (not arriving or (room() > 0 and sum(not s.prep.groups.ended for s in arriving) < decoders)):
                index, (item, prep) = next(inputs, (None, (None, None)))
                if index is None:
                    more = False
                    continue
                slot = _Slot(item, prep, index)
                order.append(slot)
                admit(slot)
                if arriving:  # Decoder.map named the input it handed over; the stream waits for this one
                    arriving[0].prep.groups.lead()
                continue
            if not arriving:
                break
            if not moved:
                clips.wait_for_any([s.prep.groups for s in arriving if placeable(s)])
        if last := packer.close():
            submit(last)
        warmed()  # a warm-up's failure is the run's, whether or not a batch came after it
        while in_flight:
            collect()
            yield from ready()
    finally:
        warmer.shutdown(wait=True)
        for slot in order:  # the stream stopped early: the frames still coming are for nobody
            if slot.prep.groups is not None:
                slot.prep.groups.abandon()


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
                      processor: ProcessorConfig | None = None, video: VideoConfig | None = None,
                      fail_fast: bool = False, progress: Any = None, decoder: Decoder | None = None,
                      stager: Any = None) -> RunSummary:
    """Encode `sources` (images and videos) into shards in `out_dir`, skipping those already
    there (resume). `video`: the video processor's settings of the decoder made here (None:
    video sources fail, images only); a `decoder` given brings its own. `progress`
    (progress.Progress) hears `start(inputs to do)`, then `(Encoded, stats)` per input.
    `stager`: as stream's (devices.EngineGroup spreads the batches over engine processes)."""
    outputs = OUTPUTS[output]
    processor = processor or vit.processor
    own = decoder is None
    decoder = decoder or Decoder(min(workers, len(sources)), processor, video=video)
    metadata = shard_metadata(vit, outputs, dtype, processor, decoder.video)
    start = time.perf_counter()
    try:
        directory = OutputDir(Path(out_dir), metadata)
    except BaseException:
        if own:
            decoder.close()
        raise
    try:
        todo = [s for s in sources if s.key not in directory.done]
        writer = BackgroundWriter(ShardWriter(directory.directory, outputs, dtype, vit.geometry.out_hidden_size,
                                              shard_size, directory.next_index, metadata))
        stats, failures, encoded = StreamStats(), [], 0
        reserved: dict[int, Any] = {}  # an input announced (its index in the stream) -> its reservation
        if progress is not None:
            progress.start(len(todo))
        try:
            for result in stream(vit, todo, outputs=outputs, dtype=dtype, processor=processor, stats=stats,
                                 decoder=decoder, stager=stager, parts=True):
                if isinstance(result, Reserve):  # its rows' place in the shard, taken in input order
                    reserved[result.index] = writer.reserve(result.rows)
                    continue
                if isinstance(result, Part):  # rows go to their place as they come
                    writer.write_rows(reserved[result.index], result.first, result.arrays)
                    continue
                if result.error is not None:
                    if result.index in reserved:  # it failed after its place was taken, or some of its rows
                        writer.abandon(reserved.pop(result.index))
                    failures.append({**result.item.record(), "kind": result.item.kind, "error": result.error})
                    directory.write_failures(failures)
                    if fail_fast:
                        raise GlmVitError(f"{result.error} (--fail-fast: stopped at the first failure)")
                else:
                    kind = {"kind": "image"} if result.video is None else result.video.record()
                    record = {**result.item.record(), **kind, "bytes": result.nbytes, "sha256": result.sha256}
                    writer.complete(reserved.pop(result.index), record, result.grid_thw)
                    encoded += 1
                if progress is not None:
                    progress(result, stats)
            writer.finish()
        except KeyboardInterrupt:
            writer.finish()  # the inputs already done are kept (not a video's rows without its record)
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
        if own:
            decoder.close()


def shard_metadata(vit, outputs: Sequence[str], dtype: str, processor: ProcessorConfig,
                   video: VideoConfig | None = None) -> dict[str, str]:
    """What every shard's header records of the settings that made it (a resume, or a reader of
    several directories, refuses shards made otherwise); the video processor's where the run
    takes videos."""
    metadata = {"format": FORMAT, "tower": vit.fingerprint, "outputs": ",".join(outputs), "dtype": dtype,
                "processor": json.dumps(dataclasses.asdict(processor), sort_keys=True)}
    if video is not None:
        metadata["video_processor"] = json.dumps(dataclasses.asdict(video), sort_keys=True)
    return metadata
