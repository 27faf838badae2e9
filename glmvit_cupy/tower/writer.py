"""Writing outputs atomically: safetensors files, small files, whole directories, and the
CLI's output files (write_atomic).

`checkpoint` only reads; what writes a checkpoint (`extract`, a real tower; `synthetic`, random
weights) shares this. A directory appears at its destination whole or not at all: it is built
in a temporary directory beside the destination, every file fsynced, then renamed into place;
on any failure (a full disk included) the temporary directory and all in it are removed. A
single file is written the same way: a temporary beside it, fsynced, renamed over it.
Temporaries are created with mode 0666 / 0777 for the kernel to apply the umask, as a plain
open() / mkdir() would (tempfile's 0600 would survive the rename and make every output private).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import secrets
import shutil
import stat
import struct
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator, Sequence

import numpy as np
from safetensors import SafetensorError, TensorSpec, serialize_file

from ..errors import GlmVitError, InternalError

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}  # the dtypes of our outputs, as safetensors spells them
FORMAT_PT = {"format": "pt"}  # the metadata transformers' loader asks of a safetensors file
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error ends the library's message


def fsync_dir(path: Path) -> None:
    """Make a rename in the directory `path` durable (or, given a file, its contents)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> int:
    """One whole safetensors file, written by the safetensors library from `tensors` (each array
    C-contiguous, in a dtype whose NumPy name the library knows: uint8, bfloat16 and float8_e4m3fn
    from ml_dtypes, ...). Not atomic by itself: it is meant for a file inside an atomic_directory.
    Returns its size. An I/O failure is raised as the OSError it was."""
    specs = {}
    for name, array in tensors.items():
        if not array.flags.c_contiguous:
            raise InternalError(f"{path}: {name} is not C-contiguous")
        specs[name] = TensorSpec(dtype=array.dtype.name, shape=list(array.shape), data_ptr=array.ctypes.data,
                                 data_len=array.nbytes)
    # The library renames a 0600 temporary into place: the file gets the mode an open() here
    # gives (0666 less the umask), read off a file made first.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    try:
        serialize_file(specs, path, FORMAT_PT)  # `tensors` keeps every data_ptr alive until it returns
    except SafetensorError as exc:
        found = _OS_ERROR.search(str(exc))
        if found is None:
            raise InternalError(f"{path}: the safetensors library refused to write it: {exc}") from None
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None
    os.chmod(path, mode)
    return path.stat().st_size


def safetensors_header(tensors: Iterable[tuple[str, str, Sequence[int], int]], metadata: dict[str, str]) -> bytes:
    """The JSON header of a safetensors file whose tensors (name, dtype, shape, bytes) follow it
    back to back in this order; unpadded. For what writes a file as it goes, which the library
    cannot (it serialises whole files from memory): the server's responses, in parts
    (safetensors_chunks), and a collection's shards, whose header is written last."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return json.dumps(header, separators=(",", ":")).encode()


def flat_bytes(array: np.ndarray) -> np.ndarray:
    """An array's row-major bytes as a flat uint8 view (a copy only when it is not contiguous):
    bfloat16 (ml_dtypes) has no buffer format, and a part sent or written must have len() = bytes."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def safetensors_chunks(specs: list[tuple[str, str, list[int]]], data: Iterator[bytes], what: str) -> Iterator[bytes]:
    """A safetensors file as chunks (the server's responses, sent in parts with no copy joining
    the tensors): the padded header, then the tensors' bytes. `what` names the file in the error
    for a tensor whose bytes disagree with its shape."""
    sizes = [math.prod(shape) * ITEMSIZE[dtype] for _, dtype, shape in specs]
    blob = safetensors_header(((name, dtype, shape, n) for (name, dtype, shape), n in zip(specs, sizes)),
                              FORMAT_PT)
    blob += b" " * (-len(blob) % 8)

    yield struct.pack("<Q", len(blob)) + blob
    for (name, _, _), n, chunk in zip(specs, sizes, data):
        if memoryview(chunk).nbytes != n:  # the header would lie about the bytes that follow
            raise InternalError(f"{what}: {name} has {memoryview(chunk).nbytes} bytes of data, its header entry {n}")
        yield chunk


def _fsync_files(directory: Path) -> None:
    """fsync every file under `directory`, then the directories themselves, deepest first."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            fsync_dir(Path(root) / name)
        fsync_dir(Path(root))


@contextlib.contextmanager
def atomic_directory(destination: Path, replace: bool = False) -> Iterator[Path]:
    """A new empty directory beside `destination` (absent, or an empty directory, which the
    rename replaces; with `replace`, any directory, moved aside and removed once the new one is
    in place) to fill with plain writes; every file in it fsynced and the directory renamed to
    `destination` when the block completes, removed with its contents when it raises. An
    OSError (ENOSPC, EIO, ...) becomes a one-line GlmVitError."""
    occupied = destination.exists() and (not destination.is_dir() or any(destination.iterdir()))
    if destination.is_symlink() or (occupied and not (replace and destination.is_dir())):
        raise GlmVitError(f"{destination}: exists; refusing to write over it")
    parent = destination.parent
    if not parent.is_dir():
        raise GlmVitError(f"{destination}: directory {parent} does not exist")
    remove_stale_temps(parent, destination.name)
    tmp = _temp_path(parent, destination.name)
    try:
        os.mkdir(tmp)  # mode 0o777 less the umask: a checkpoint others may read
    except OSError as exc:
        raise GlmVitError(f"{destination}: cannot write there: {exc.strerror}") from None
    try:
        yield tmp
        _fsync_files(tmp)
        old = _temp_path(parent, destination.name) if occupied else None
        if old is not None:  # a temporary name: remove_stale_temps clears it if we die now
            os.rename(destination, old)
        try:
            os.rename(tmp, destination)
        except OSError:
            if old is not None:  # the old directory goes back where it was
                os.rename(old, destination)
            raise
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GlmVitError(f"{destination}: writing failed ({exc.strerror or exc}); nothing was left "
                          "behind") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_failure(target: Path, exc: OSError) -> GlmVitError:
    """A failed write as one line, with what to do about a full disk. (NumPy's tofile reports a
    short write without an errno: "N requested and M written".)"""
    reason = exc.strerror or f"{exc} (a short write: the disk is full or a file size limit was hit)"
    hint = (": free some space there or write elsewhere"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, None) else "")
    return GlmVitError(f"{target}: cannot write: {reason}{hint}")


def _temp_path(directory: Path, name: str) -> Path:
    """`.NAME.PID-HEX.tmp`: hidden, and naming the process that writes it (remove_stale_temps)."""
    return directory / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def remove_stale_temps(directory: Path, name: str) -> None:
    """Remove the temporaries of `name` whose writer process is gone (SIGKILL, a crash, a power
    cut: nothing ran to remove them); a live writer's are left alone."""
    prefix = f".{name}."
    try:
        entries = [e for e in directory.iterdir() if e.name.startswith(prefix) and is_temp(e.name)]
    except OSError:
        return
    for entry in entries:
        pid = entry.name[len(prefix):-len(".tmp")].split("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def create_temp(directory: Path, name: str) -> tuple[int, Path]:
    """A fresh hidden temporary file for `name` in `directory` (O_EXCL, mode 0666 less the umask),
    open for reading and writing, which `is_temp` recognises; stale ones of `name` go first."""
    remove_stale_temps(directory, name)
    for _ in range(100):
        tmp = _temp_path(directory, name)
        try:
            return os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise GlmVitError(f"{directory / name}: cannot write there: {exc.strerror}") from None
    raise GlmVitError(f"{directory / name}: cannot find a free temporary name beside it")


def is_temp(name: str) -> bool:
    """Whether a file name is one of create_temp's (what an interrupted writer leaves)."""
    return name.startswith(".") and name.endswith(".tmp")


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write` into a fresh temporary file beside `path` (create_temp), fsync, then rename it
    over `path`; on failure nothing is left and `path` is as it was."""
    path = Path(path)
    fd, tmp = create_temp(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_failure(path, exc) from None
        raise
