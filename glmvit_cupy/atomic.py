"""Writing outputs atomically, with the permissions the umask gives.

Every output (the CLI's embeddings, a synthetic checkpoint, each of its shards) is written
under a temporary name beside its target, flushed to disk, and renamed onto the target only
once complete: a failed run (a full disk, an exception) leaves the target as it was and no
temporary behind. Temporaries are created with mode 0666 (files) or 0777 (directories) for the
kernel to apply the umask to, exactly as a plain open() or mkdir() would: tempfile's 0600 and
0700 would survive the rename and make every output private. A write that fails on the disk
(ENOSPC, EFBIG, EIO, ...) is one GlmVitError line naming the target.

Separate from the CLI because the synthetic checkpoint writer, a library function, needs the
same guarantees.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import IO, Callable, Iterator

from .errors import GlmVitError

_NAME_TRIES = 100


def _temporary(target: Path, create: Callable[[Path], None]) -> Path:
    """Create (O_EXCL semantics) a fresh hidden name beside `target` through `create`."""
    for _ in range(_NAME_TRIES):
        candidate = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            create(candidate)
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            raise GlmVitError(f"{target}: cannot write there: {exc.strerror}") from None
    raise GlmVitError(f"{target}: cannot find a free temporary name beside it")


def write_failure(target: Path, exc: OSError) -> GlmVitError:
    """A failed write as one line, with what to do about a full disk. (NumPy's tofile reports a
    short write without an errno: "N requested and M written".)"""
    reason = exc.strerror or f"{exc} (a short write: the disk is full or a file size limit was hit)"
    hint = (": free some space there or write elsewhere"
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, None) else "")
    return GlmVitError(f"{target}: cannot write: {reason}{hint}")


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """`write` into a temporary file beside `path`, fsync, then rename it over `path`."""
    path = Path(path)
    fds: list[int] = []
    tmp = _temporary(path, lambda p: fds.append(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                                         0o666)))
    try:
        with os.fdopen(fds[0], "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise write_failure(path, exc) from None
        raise


@contextlib.contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """A fresh directory beside `target` to fill; renamed onto `target` (absent, or an empty
    directory) when the block completes, removed with its contents if anything fails."""
    target = Path(target)
    tmp = _temporary(target, lambda p: os.mkdir(p, 0o777))
    try:
        yield tmp
        os.replace(tmp, target)  # rename(2) replaces an empty directory
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself, on disk
        finally:
            os.close(directory)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise write_failure(target, exc) from None
        raise
