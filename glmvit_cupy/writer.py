"""Writing checkpoints: safetensors files, small files, and whole directories atomically.

`checkpoint` only reads; what writes a checkpoint (`extract`, a real tower; `synthetic`, random
weights) shares this. A directory appears at its destination whole or not at all: it is built
in a temporary directory beside the destination, every file fsynced, then renamed into place;
on any failure (a full disk included) the temporary directory and all in it are removed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import struct
from pathlib import Path
from typing import Iterable, Iterator

from .errors import GlmVitError

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, chunks: Iterable[bytes]) -> int:
    """Write `chunks` to `path` (a temporary name, fsync, rename); returns the bytes written."""
    tmp = path.with_name(path.name + ".tmp")
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += memoryview(chunk).nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def write_safetensors(path: Path, specs: list[tuple[str, str, list[int]]], data: Iterator[bytes]) -> int:
    """Write one safetensors file: header of (name, dtype, shape) in order, then each tensor's
    bytes as `data` yields them (any buffer of the right length). Returns its size."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        n = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)

    def chunks() -> Iterator[bytes]:
        yield struct.pack("<Q", len(blob)) + blob
        for (name, _, _), chunk in zip(specs, data):
            begin, end = header[name]["data_offsets"]
            assert memoryview(chunk).nbytes == end - begin, name
            yield chunk

    return write_file(path, chunks())


@contextlib.contextmanager
def atomic_directory(destination: Path) -> Iterator[Path]:
    """A new empty directory beside `destination` to fill; renamed to `destination` when the
    block completes, removed with its contents when it raises. An OSError (ENOSPC, EIO, ...)
    becomes a one-line GlmVitError."""
    if destination.exists() or destination.is_symlink():
        raise GlmVitError(f"{destination}: exists; refusing to write over it")
    parent = destination.parent
    if not parent.is_dir():
        raise GlmVitError(f"{destination}: directory {parent} does not exist")
    tmp = parent / f".{destination.name}.{secrets.token_hex(4)}.tmp"
    try:
        os.mkdir(tmp)  # mode 0o777 less the umask: a checkpoint others may read
    except OSError as exc:
        raise GlmVitError(f"{destination}: cannot write there: {exc.strerror}") from None
    try:
        yield tmp
        _fsync_dir(tmp)
        os.rename(tmp, destination)
        _fsync_dir(parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise GlmVitError(f"{destination}: writing failed ({exc.strerror or exc}); nothing was left "
                          "behind") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
