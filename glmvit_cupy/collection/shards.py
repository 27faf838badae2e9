"""The output directory of a collection run: sharded embeddings that survive interruption.

    DIR/shard-00000.safetensors   pooler_output (and/or last_hidden_state) [tokens, out_hidden]
                                  for every input of the shard (a video's rows in time order),
                                  grid_thw [n, 3] ((1, h, w) an image, (T/2, h, w) a video), offsets [n + 1]
    DIR/shard-00000.jsonl         one line an input, in row order: path (its input key), kind ("image" or
                                  "video"; a video's frames sampled, source fps and the timestamps of its
                                  temporal groups), bytes, sha256, grid_thw, tokens, rows
    DIR/failures.jsonl            the inputs of the last run that did not encode, and why

A shard is written as it fills: its first output goes into a temporary file behind a
header area sized for the largest numbers a header can hold (safetensors allows trailing
spaces in the header), further outputs into side files appended at the end. Each input takes
its rows' place when the pipeline admits it (`reserve`, in input order), and its rows are
written there as each forward batch is collected (`write_rows`), so neither a video's rows
nor those of inputs computed while an earlier video still decodes wait in memory for their
turn; its record (`complete`) comes in input order, and an input whose record never comes (it
failed, or the run stopped) leaves a hole that sealing closes, moving later rows down. Then
fsync and rename: first the .safetensors, then its .jsonl, which is what makes a shard count as done.
A run killed at any moment leaves only whole shards and hidden `.*.tmp` files; the next run
on the directory (holding a lock on it) removes those and any .safetensors without its
.jsonl, and skips every input already done.
Each shard's metadata records the settings it was made with, so a resume with other settings
(model, dtype, outputs, processor) is refused instead of mixing embeddings.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from ..bf16 import bf16_to_f32
from ..errors import GlmVitError, InternalError
from ..tower.checkpoint import HeaderEntry, read_header
from ..tower.writer import create_temp, fsync_dir, is_temp, safetensors_header, write_atomic
from .sources import resume_key
from .staging import DTYPES

SHARD = re.compile(r"^shard-(\d{5,})\.safetensors$")
FORMAT = "glmvit-cupy embeddings 1"
FAILURES = "failures.jsonl"
DEFAULT_SHARD_SIZE = 100  # images a shard: a shard is what a run killed mid-way redoes
# The metadata shards of one collection share. A shard without video_processor holds no video
# (made before videos were taken, or by a run that takes none, such as Ray's): it agrees with any.
SETTINGS = ("format", "tower", "outputs", "dtype", "processor", "video_processor")
_ONLY_WITH_VIDEOS = ("video_processor",)
WRITE_QUEUE_BYTES = 512 * 2**20  # rows waiting for the disk: 64 photos' bf16 poolers, or 8 forward batches of a video
_MAX_INT = 10 ** 20 - 1  # more digits than any int64 a header holds


def conflict(theirs: dict[str, str], ours: dict[str, str]) -> str | None:
    """The first setting two shards' metadata disagree on (None: one collection)."""
    for field in SETTINGS:
        a, b = theirs.get(field), ours.get(field)
        if a != b and not (field in _ONLY_WITH_VIDEOS and (a is None or b is None)):
            return field
    return None


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def _write_error(directory: Path, exc: OSError) -> GlmVitError:
    """An OSError while writing shards (a full disk, a quota, a lost mount) as one line."""
    return GlmVitError(f"{directory}: writing the embeddings failed: {exc.strerror or exc}; only whole shards are "
                       "kept: free some space (or fix the directory) and run the same command again")


class _OpenShard:
    """The shard being filled: its temp files, rows so far and metadata lines."""

    def __init__(self, directory: Path, index: int, outputs: Sequence[str]) -> None:
        self.index, self.outputs = index, tuple(outputs)
        self.files: dict[str, tuple[Any, Path]] = {}
        for i, name in enumerate(self.outputs):
            fd, path = create_temp(directory, f"{shard_name(index)}.{name}" if i else
                                           f"{shard_name(index)}.safetensors")
            self.files[name] = (os.fdopen(fd, "wb+"), path)
        self.records: list[dict] = []
        self.rows = 0  # of its records
        self.starts: list[int] = []  # each record's first row in the files (its rows are [start, start + tokens))
        self.end = 0  # rows placed in the files: records', those still to come, holes
        self.live = 0  # reservations placed here and not yet completed or abandoned

    def remove(self) -> None:
        for f, path in self.files.values():
            f.close()
            path.unlink(missing_ok=True)


@dataclasses.dataclass(eq=False)
class Reservation:
    """An input of ShardWriter.reserve: its `rows`, its first row in the open shard's files once
    placed (`start`), rows come so far, and those come before it was placed."""

    rows: int
    start: int | None = None
    come: int = 0
    buffered: list = dataclasses.field(default_factory=list)  # (first row, arrays)


class ShardWriter:
    """Writes inputs into shards of `shard_size` inputs in `directory`, numbered from
    `first_index`, in input order: each reserved in input order (its rows' place taken), its
    rows written as they come in any order, then completed with its record or abandoned; or
    added whole, in order (add). A shard's records and rows are in input order either way."""

    def __init__(self, directory: Path, outputs: Sequence[str], dtype: str, width: int, shard_size: int,
                 first_index: int, metadata: dict[str, str]) -> None:
        self.directory, self.outputs, self.dtype, self.width = directory, tuple(outputs), dtype, width
        self.shard_size, self.next_index, self.metadata = shard_size, first_index, metadata
        self.st_dtype = DTYPES[dtype][1]
        worst = [(name, self.st_dtype, [_MAX_INT, _MAX_INT], _MAX_INT) for name in self.outputs]
        worst += [("grid_thw", "I64", [_MAX_INT, 3], _MAX_INT), ("offsets", "I64", [_MAX_INT], _MAX_INT)]
        self.reserve_bytes = -(-len(safetensors_header(worst, metadata)) // 8) * 8  # the header area
        self.row_bytes = width * np.dtype(DTYPES[dtype][0]).itemsize
        self.shard: _OpenShard | None = None
        self.reserved: deque[Reservation] = deque()  # not yet completed or abandoned, in input order
        # Sealing (fsync, renames) runs on a thread of its own, in shard order: an fsync of a shard
        # of photos takes up to a second, during which the next shard keeps filling.
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="glmvit-cupy seal")
        self._sealing: list[Future] = []

    def reserve(self, rows: int) -> Reservation:
        """An input of `rows` rows, written (write_rows) before its record (complete) or its
        failure (abandon); inputs are reserved, completed and abandoned in input order. It takes
        its place in the open shard at once if the shard has room for its record, else once a
        shard has; rows written before that wait in memory."""
        return self.take(Reservation(rows))

    def take(self, reservation: Reservation) -> Reservation:
        """`reserve` for a Reservation made by the caller (BackgroundWriter's, on its thread)."""
        self.reserved.append(reservation)
        self._place()
        return reservation

    def write_rows(self, reservation: Reservation, first: int, arrays: dict[str, np.ndarray]) -> None:
        """Rows [first, first + n) of each output of a reserved input."""
        n = len(arrays[self.outputs[0]])
        if first + n > reservation.rows:
            raise InternalError(f"rows {first}-{first + n} of an input reserved {reservation.rows} rows")
        reservation.come += n
        if reservation.start is None:
            reservation.buffered.append((first, arrays))
        else:
            self._write(reservation.start + first, arrays)

    def complete(self, reservation: Reservation, record: dict, grid_thw: Sequence[int]) -> None:
        """The reserved input's metadata line (source fields): all its rows have come."""
        self._check_first(reservation, "completed")
        if reservation.come != reservation.rows:
            raise InternalError(f"an input reserved {reservation.rows} rows completed with {reservation.come}")
        self.reserved.popleft()
        shard, rows = self.shard, reservation.rows
        shard.live -= 1
        shard.records.append({**record, "grid_thw": [int(v) for v in grid_thw], "tokens": rows,
                              "rows": [shard.rows, shard.rows + rows]})
        shard.starts.append(reservation.start)
        shard.rows += rows
        if len(shard.records) >= self.shard_size:
            self._hand_over()
        self._place()

    def abandon(self, reservation: Reservation) -> None:
        """The reserved input failed: its rows go off the shard's files (sealing closes the hole)."""
        self._check_first(reservation, "abandoned")
        self.reserved.popleft()
        if reservation.start is not None:
            self.shard.live -= 1
            if not any(r.start is not None for r in self.reserved):  # the last placed: cut its rows now
                self._truncate(self.shard, reservation.start)
        self._place()

    def add(self, record: dict, arrays: dict[str, np.ndarray], grid_thw: Sequence[int]) -> None:
        """One input whole, in order: its metadata line and its rows of each output."""
        reservation = self.reserve(len(arrays[self.outputs[0]]))
        self.write_rows(reservation, 0, arrays)
        self.complete(reservation, record, grid_thw)

    def _check_first(self, reservation: Reservation, what: str) -> None:
        if not self.reserved or self.reserved[0] is not reservation:
            raise InternalError(f"an input {what} out of input order")

    def _place(self) -> None:
        """Give the reservations not yet placed their rows in the open shard (opening one if none
        is), in order, while it has room for their records; write what they hold."""
        for reservation in self.reserved:
            if reservation.start is not None:
                continue
            shard = self._open()
            if len(shard.records) + shard.live >= self.shard_size:
                return
            reservation.start = shard.end
            shard.end += reservation.rows
            shard.live += 1
            for first, arrays in reservation.buffered:
                self._write(reservation.start + first, arrays)
            reservation.buffered = []

    def _open(self) -> _OpenShard:
        if self.shard is None:
            try:
                self.shard = _OpenShard(self.directory, self.next_index, self.outputs)
            except OSError as exc:
                raise _write_error(self.directory, exc) from None
            self.next_index += 1
        return self.shard

    def _write(self, row: int, arrays: dict[str, np.ndarray]) -> None:
        """Each output's rows into the open shard's files from `row` on."""
        shard = self.shard
        rows = len(arrays[self.outputs[0]])
        try:
            for i, name in enumerate(self.outputs):
                data = np.ascontiguousarray(arrays[name], dtype=DTYPES[self.dtype][0])
                if data.shape != (rows, self.width):
                    raise GlmVitError(f"{name} has shape {list(data.shape)}, expected [{rows}, {self.width}]")
                fd = shard.files[name][0].fileno()
                start = at = self._base(i) + row * self.row_bytes
                view = memoryview(data.view(np.uint8).reshape(-1))
                while view:
                    written = os.pwrite(fd, view, at)
                    view, at = view[written:], at + written
                if i == 0 and hasattr(os, "posix_fadvise"):  # start its writeback now, so that sealing has little left
                    os.posix_fadvise(fd, start, data.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            raise _write_error(self.directory, exc) from None

    def _base(self, output: int) -> int:
        """Where rows start in an output's file: after the header area in the first (the .safetensors)."""
        return 8 + self.reserve_bytes if output == 0 else 0

    def _truncate(self, shard: _OpenShard, rows: int) -> None:
        try:
            for i, name in enumerate(self.outputs):
                shard.files[name][0].truncate(self._base(i) + rows * self.row_bytes)
        except OSError as exc:
            raise _write_error(self.directory, exc) from None
        shard.end = rows

    def finish(self) -> None:
        """Hand the shard in flight (if it holds any input) to the sealer: header, fsync, rename,
        metadata; the rows of inputs reserved and not completed (a stopped run's) are cut off
        first. An error of an earlier seal is raised here."""
        self.reserved.clear()
        self._hand_over()

    def _hand_over(self) -> None:
        shard, self.shard = self.shard, None
        if shard is not None and not shard.records:  # it held only such rows: no shard, nor its number
            shard.remove()
            self.next_index -= 1
        elif shard is not None:
            self._sealing.append(self._sealer.submit(self._seal_or_remove, shard))
        self._reap(wait=False)

    def close(self) -> None:
        """Wait until every shard handed over is sealed; raise the first error."""
        self._reap(wait=True)
        self._sealer.shutdown()

    def _reap(self, wait: bool) -> None:
        while self._sealing and (wait or self._sealing[0].done()):
            self._sealing.pop(0).result()

    def _seal_or_remove(self, shard: _OpenShard) -> None:
        try:
            self._seal(shard)
        except BaseException as exc:
            shard.remove()
            (self.directory / f"{shard_name(shard.index)}.safetensors").unlink(missing_ok=True)  # no .jsonl: not done
            if isinstance(exc, OSError):
                raise _write_error(self.directory, exc) from None
            raise

    def _close_holes(self, shard: _OpenShard) -> None:
        """Move each record's rows down to where its record says (rows of inputs that failed or
        never completed left holes before them), then cut each file after the last."""
        for i, name in enumerate(self.outputs):
            fd, base = shard.files[name][0].fileno(), self._base(i)
            for start, record in zip(shard.starts, shard.records):
                src, dst, left = start * self.row_bytes, record["rows"][0] * self.row_bytes, record["tokens"] * self.row_bytes
                while src != dst and left > 0:  # downwards, front to back: never over what is still to move
                    chunk = os.pread(fd, min(left, 64 << 20), base + src)
                    if not chunk:
                        raise InternalError(f"{name} of shard {shard.index} ends before the rows of {record['path']}")
                    os.pwrite(fd, chunk, base + dst)
                    src, dst, left = src + len(chunk), dst + len(chunk), left - len(chunk)
        self._truncate(shard, shard.rows)

    def _seal(self, shard: _OpenShard) -> None:
        n, rows = len(shard.records), shard.rows
        self._close_holes(shard)
        main, main_path = shard.files[self.outputs[0]]
        tensors = [(name, self.st_dtype, [rows, self.width], rows * self.row_bytes) for name in self.outputs]
        main.seek(self._base(0) + rows * self.row_bytes)
        for name in self.outputs[1:]:  # side files after the first output's rows
            side, _ = shard.files[name]
            side.seek(0)
            while chunk := side.read(64 << 20):
                main.write(chunk)
        grid = np.array([r["grid_thw"] for r in shard.records], dtype=np.int64).reshape(n, 3)
        offsets = np.array([0] + [r["rows"][1] for r in shard.records], dtype=np.int64)
        for name, array in (("grid_thw", grid), ("offsets", offsets)):
            tensors.append((name, "I64", list(array.shape), array.nbytes))
            main.write(array.tobytes())
        header = safetensors_header(tensors, self.metadata)
        main.seek(0)
        main.write(struct.pack("<Q", self.reserve_bytes) + header + b" " * (self.reserve_bytes - len(header)))
        main.flush()
        os.fsync(main.fileno())
        final = self.directory / f"{shard_name(shard.index)}.safetensors"
        os.replace(main_path, final)
        shard.remove()  # closes the files; the side files go, the renamed main is no longer there
        lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in shard.records)
        write_atomic(self.directory / f"{shard_name(shard.index)}.jsonl", lambda f: f.write(lines.encode()))
        fsync_dir(self.directory)

    def discard(self) -> None:
        """Drop the shard in flight (its temp files); shards already handed over are sealed."""
        shard, self.shard = self.shard, None
        if shard is not None:
            shard.remove()
        try:
            self.close()
        except Exception:
            pass  # the run is failing already: its first error is the one to report


class BackgroundWriter:
    """A ShardWriter on its own thread, so that disk writes and fsyncs (a shard of photos is
    ~1 GB) never hold up the thread feeding the engine. Its queue is bounded in bytes, not calls:
    a call is an image's rows or a video's of one forward batch (up to p_max / 4 rows), so a
    bound in calls let a disk slower than the engine queue gigabytes of a long video's rows.
    A call larger than the bound still goes in alone. An error in the thread comes back on the
    next call."""

    def __init__(self, writer: ShardWriter, max_bytes: int = WRITE_QUEUE_BYTES) -> None:
        self.writer, self.error = writer, None
        self.max_bytes, self.queued_bytes, self.peak_bytes = max_bytes, 0, 0
        self.jobs: deque[tuple[int, tuple | None]] = deque()
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="glmvit-cupy shard writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self.jobs:
                    self.changed.wait()
                size, job = self.jobs[0]
            if job is None:
                return
            if self.error is None:
                try:
                    job[0](*job[1:])
                except BaseException as exc:  # kept for the feeding thread, which raises it
                    self.error = exc
            with self.changed:  # the rows stay queued (and counted) until written
                self.jobs.popleft()
                self.queued_bytes -= size
                self.changed.notify_all()

    def _put(self, size: int, job: tuple | None) -> None:
        with self.changed:
            while self.jobs and self.queued_bytes + size > self.max_bytes:
                self.changed.wait()
            self.jobs.append((size, job))
            self.queued_bytes += size
            self.peak_bytes = max(self.peak_bytes, self.queued_bytes)
            self.changed.notify_all()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def add(self, record: dict, arrays: dict[str, np.ndarray], grid_thw: Sequence[int]) -> None:
        self._check()
        self._put(sum(a.nbytes for a in arrays.values()), (self.writer.add, record, arrays, grid_thw))

    def reserve(self, rows: int) -> Reservation:
        self._check()
        reservation = Reservation(rows)
        self._put(0, (self.writer.take, reservation))
        return reservation

    def write_rows(self, reservation: Reservation, first: int, arrays: dict[str, np.ndarray]) -> None:
        self._check()
        self._put(sum(a.nbytes for a in arrays.values()), (self.writer.write_rows, reservation, first, arrays))

    def complete(self, reservation: Reservation, record: dict, grid_thw: Sequence[int]) -> None:
        self._check()
        self._put(0, (self.writer.complete, reservation, record, grid_thw))

    def abandon(self, reservation: Reservation) -> None:
        self._check()
        self._put(0, (self.writer.abandon, reservation))

    def _drain(self) -> None:
        self._put(0, None)
        self.thread.join()

    def finish(self) -> None:
        """Write what is queued, seal the shard in flight, wait for every seal."""
        self._drain()
        self._check()
        self.writer.finish()
        self.writer.close()

    def discard(self) -> None:
        self._drain()
        self.writer.discard()


def complete_shards(directory: Path) -> list[tuple[int, Path, Path]]:
    """(index, .safetensors, .jsonl) of every finished shard, by index."""
    found = []
    for entry in directory.iterdir():
        match = SHARD.match(entry.name)
        if match and entry.with_suffix(".jsonl").is_file():
            found.append((int(match.group(1)), entry, entry.with_suffix(".jsonl")))
    return sorted(found)


def _records(jsonl: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GlmVitError(f"{jsonl}: unreadable shard metadata: {exc}") from None


class OutputDir:
    """An output directory opened for a run: locked, cleaned, its finished work known."""

    def __init__(self, directory: Path, metadata: dict[str, str]) -> None:
        self.directory = directory
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._lock = os.open(directory, os.O_RDONLY)
        except OSError as exc:
            raise GlmVitError(f"{directory}: cannot use as the output directory: {exc.strerror}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise GlmVitError(f"{directory}: another run is writing to this directory") from None
        try:
            self._scan(metadata)
        except BaseException:
            self.close()
            raise

    def _scan(self, metadata: dict[str, str]) -> None:
        """Clean up after an interrupted run, then learn what is done (refusing other settings)."""
        self._clean()
        self.done: dict[str, dict] = {}
        self.next_index = 0
        for index, shard, jsonl in complete_shards(self.directory):
            theirs = read_header(shard)[1]
            field = conflict(theirs, metadata)
            if field is not None:
                raise GlmVitError(
                    f"{shard}: made with {field} {theirs.get(field)!r}, this run has {metadata.get(field)!r}; "
                    "use another --out-dir, or the settings it was made with")
            for record in _records(jsonl):
                self.done[record_key(record)] = record
            self.next_index = index + 1

    def _clean(self) -> None:
        """Remove what an interrupted run left: temp files, shards without their metadata, and
        metadata without its shard."""
        for entry in self.directory.iterdir():
            match = SHARD.match(entry.name)
            orphan = (match and not entry.with_suffix(".jsonl").exists()) or (
                entry.suffix == ".jsonl" and SHARD.match(entry.with_suffix(".safetensors").name)
                and not entry.with_suffix(".safetensors").exists())
            if is_temp(entry.name) or orphan:
                entry.unlink(missing_ok=True)

    def write_failures(self, failures: list[dict]) -> None:
        write_failures(self.directory, failures)

    def close(self) -> None:
        os.close(self._lock)


def write_failures(directory: Path, failures: list[dict]) -> None:
    """DIR/failures.jsonl: one line an input that did not encode (its source fields and
    `error`), written atomically; removed when there are none (a run lists its own failures)."""
    path = directory / FAILURES
    if failures:
        lines = "".join(json.dumps(f, separators=(",", ":")) + "\n" for f in failures)
        write_atomic(path, lambda f: f.write(lines.encode()))
    else:
        path.unlink(missing_ok=True)


def record_key(record: dict) -> str:
    """The resume identity of a metadata line: its source's sources.Source.key."""
    return resume_key(record["path"], None if record.get("member") is None else record["key"])


Directories = str | Path | Iterable[str | Path]


def _shards_of(directories: Directories) -> Iterator[tuple[Path, Path, dict[str, HeaderEntry]]]:
    """(.safetensors, .jsonl, tensor entries) of every finished shard of one or more output directories (one
    collection: each host's, or each Ray write task's, directory), refusing shards whose
    settings differ from the first's."""
    if isinstance(directories, (str, Path)):
        directories = [directories]
    first: tuple[Path, dict] | None = None
    for directory in map(Path, directories):
        if not directory.is_dir():
            raise GlmVitError(f"{directory}: not a directory")
        found = complete_shards(directory)
        if not found and not (directory / FAILURES).is_file():  # a run whose every image failed has failures
            nested = any(p.is_dir() and complete_shards(p) for p in directory.iterdir())
            hint = ("; its subdirectories do: a Ray ShardSink's output is read as "
                    "read_embeddings(glmvit_cupy.deploy.ray.parts(...))" if nested else
                    ": not the --out-dir of a run that finished a shard")
            raise GlmVitError(f"{directory}: holds no finished shard (shard-NNNNN.safetensors and its .jsonl) "
                              f"and no {FAILURES}" + hint)
        for _, shard, jsonl in found:
            entries, theirs = read_header(shard)
            if first is None:
                first = shard, theirs
            field = conflict(theirs, first[1])
            if field is not None:
                raise GlmVitError(f"{shard}: made with {field} {theirs.get(field)!r}, {first[0]} with "
                                  f"{first[1].get(field)!r}: not one collection")
            yield shard, jsonl, entries


def read_records(directories: Directories) -> Iterator[dict]:
    """The metadata line of every image of one or more finished output directories (what is done)."""
    for _, jsonl, _ in _shards_of(directories):
        yield from _records(jsonl)


def read_embeddings(directories: Directories) -> Iterator[tuple[dict, dict[str, np.ndarray]]]:
    """Every input of one or more finished output directories, in directory, shard and row
    order: (its metadata line, {output name: float32 [tokens, out_hidden], "grid_thw": int64 [3]},
    and for a video "timestamps": float64 [T/2], seconds of each temporal group's first frame).
    Shards are memory-mapped, so a collection of any size is read one image at a time. A
    directory with no finished shard (and no failures.jsonl: a run whose every image failed) is
    refused in one line, not read as an empty collection."""
    for shard, jsonl, entries in _shards_of(directories):
        raw = np.memmap(shard, dtype=np.uint8, mode="r")
        views = {}
        for name, entry in entries.items():
            if name in ("grid_thw", "offsets"):
                continue
            kind = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[entry.dtype]
            views[name] = (raw[entry.begin:entry.end].view(kind).reshape(entry.shape), entry.dtype)
        for record in _records(jsonl):
            a, b = record["rows"]
            arrays = {name: (bf16_to_f32(v[a:b]) if dt == "BF16" else v[a:b].astype(np.float32))
                      for name, (v, dt) in views.items()}
            arrays["grid_thw"] = np.array(record["grid_thw"], dtype=np.int64)
            if record.get("kind") == "video":
                arrays["timestamps"] = np.array(record["timestamps"], dtype=np.float64)
            yield record, arrays
