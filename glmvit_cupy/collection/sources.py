"""What a collection run reads: command-line inputs expanded into a list of image and video sources.

An input is an image or video file, a directory (searched recursively for image and video
extensions, sorted), a glob pattern (quoted on the shell, expanded here, `**` included), a
list file (one input a line, `-` for stdin) or an uncompressed tar shard in the webdataset
convention (each member with an image or video extension is one input, its key the member
path without the extension). A source is a video by its extension (video.VIDEO_EXTENSIONS),
else an image. The expansion is separate from decoding: the pipeline's workers read each
source themselves, so the main process never holds more than the sources' names. A tar
member is read by its byte range (found once here), not by scanning the archive for every
input; a video is read as a stream (`open`), never whole into memory.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import os
import sys
import tarfile
from pathlib import Path
from typing import BinaryIO, Iterable, Sequence

from ..errors import GlmVitError
from ..processor.video import VIDEO_EXTENSIONS

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
TAR_EXTENSIONS = (".tar",)
_COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
_GLOB_CHARS = frozenset("*?[")
_CHUNK = 1 << 20  # bytes a read while hashing a streamed file


def resume_key(path: str, member_key: str | None) -> str:
    """An input's identity across runs (a resume skips it when its output directory holds it): its
    path, or its tar shard's path and its member's key (the member's name without the extension,
    as a shard record writes it)."""
    return path if member_key is None else f"{path}::{member_key}"


@dataclasses.dataclass(frozen=True)
class Source:
    """One image or video to encode: a file, or a byte range of a tar shard."""

    path: str  # absolute path of the file or of the tar shard
    member: str | None = None  # the tar member's name
    offset: int = 0  # where the member's bytes start in the shard
    size: int = -1  # the member's size (-1: the whole file)

    @property
    def key(self) -> str:
        """Identity across runs (resume): the path, or the shard path and the member's key."""
        return resume_key(self.path, None if self.member is None else os.path.splitext(self.member)[0])

    @property
    def name(self) -> str:
        """How messages name it."""
        return self.path if self.member is None else f"{self.path}:{self.member}"

    @property
    def kind(self) -> str:
        """"video" for a video extension (of the file, or of the tar member), else "image"."""
        return "video" if is_video_name(self.member or self.path) else "image"

    def record(self) -> dict:
        """The source fields of its metadata line."""
        if self.member is None:
            return {"path": self.path}
        return {"path": self.path, "member": self.member, "key": os.path.splitext(self.member)[0]}

    def read(self) -> bytes:
        """The file's (or member's) bytes; OSError on failure."""
        with open(self.path, "rb") as f:
            if self.member is None:
                return f.read()
            data = os.pread(f.fileno(), self.size, self.offset)
        if len(data) != self.size:
            raise OSError(f"tar member ends early ({len(data)} of {self.size} bytes)")
        return data

    def open(self) -> BinaryIO:
        """A binary file object over the file's (or member's) bytes, read as they are needed; OSError on failure."""
        if self.member is None:
            return open(self.path, "rb")
        return io.BufferedReader(_Window(self.path, self.offset, self.size, self.name))

    def digest(self) -> tuple[int, str]:
        """(bytes, sha256) of the file (or member), read a chunk at a time; OSError on failure."""
        sha, total = hashlib.sha256(), 0
        with self.open() as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
                total += len(chunk)
        if self.member is not None and total != self.size:
            raise OSError(f"tar member ends early ({total} of {self.size} bytes)")
        return total, sha.hexdigest()


class _Window(io.RawIOBase):
    """A seekable read-only view of bytes [offset, offset + size) of a file (a tar member),
    named as messages name the member."""

    def __init__(self, path: str, offset: int, size: int, name: str) -> None:
        self.fd, self.offset, self.size, self.pos = os.open(path, os.O_RDONLY), offset, size, 0
        self.name = name

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        want = max(0, min(len(buffer), self.size - self.pos))
        data = os.pread(self.fd, want, self.offset + self.pos)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if base + pos < 0:
            raise OSError(f"seek to {base + pos}, before the start of the member")
        self.pos = base + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def close(self) -> None:
        if not self.closed:
            os.close(self.fd)
        super().close()


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def is_video_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in VIDEO_EXTENSIONS


def is_input_name(name: str) -> bool:
    """A name a directory walk or a tar shard takes: an image's or a video's extension."""
    return is_image_name(name) or is_video_name(name)


def _tar_members(path: str) -> list[Source]:
    """Every image and video member of an uncompressed tar, with its byte range, in archive order."""
    try:
        with tarfile.open(path, "r:") as tar:
            return [Source(path, m.name, m.offset_data, m.size) for m in tar
                    if m.isfile() and is_input_name(m.name)]
    except tarfile.ReadError as exc:
        raise GlmVitError(f"{path}: not a readable uncompressed tar shard ({exc})") from None
    except OSError as exc:
        raise GlmVitError(f"{path}: cannot read tar shard: {exc.strerror or exc}") from None


def _walk(directory: str) -> list[str]:
    """Image and video files under a directory, recursively, in sorted path order."""
    found = []
    for root, dirs, files in os.walk(directory, onerror=None):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(os.path.join(root, f) for f in files if is_input_name(f) and not f.startswith("."))
    return sorted(found)


def _expand_one(item: str) -> list[Source]:
    if any(c in item for c in _GLOB_CHARS) and not os.path.exists(item):
        matches = sorted(glob.glob(item, recursive=True))
        if not matches:
            raise GlmVitError(f"{item}: the pattern matches no file")
        out: list[Source] = []
        for match in matches:
            if os.path.isdir(match):
                continue  # a pattern names files; a directory it matches is not searched
            out.extend(_expand_one(match))
        return out
    path = os.path.abspath(item)
    if os.path.isdir(path):
        return [Source(f) for f in _walk(path)]
    if not os.path.exists(path):
        raise GlmVitError(f"{item}: no such file or directory")
    lower = path.lower()
    if lower.endswith(_COMPRESSED_TARS):
        raise GlmVitError(f"{item}: a compressed tar cannot be read by byte range; decompress it to .tar first")
    if lower.endswith(TAR_EXTENSIONS):
        return _tar_members(path)
    return [Source(path)]  # a file named explicitly is taken, an image unless its extension is a video's


def read_list(list_file: str) -> list[str]:
    """Inputs from a list file, one a line (blank lines skipped); `-` reads stdin."""
    try:
        text = sys.stdin.read() if list_file == "-" else Path(list_file).read_text()
    except OSError as exc:
        raise GlmVitError(f"{list_file}: cannot read the list of inputs: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise GlmVitError(f"{list_file}: the list of inputs is not text") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def expand_inputs(inputs: Sequence[str], files_from: str | None = None, unique: bool = True) -> list[Source]:
    """All sources named by `inputs` (and the list file), in order: each once, at its first
    mention (a collection: one record a file), or with unique=False once a mention (a file of
    results whose positions match the inputs)."""
    items: Iterable[str] = list(inputs) + (read_list(files_from) if files_from is not None else [])
    seen: set[str] = set()
    out: list[Source] = []
    for item in items:
        for source in _expand_one(str(item)):
            if not unique or source.key not in seen:
                seen.add(source.key)
                out.append(source)
    return out
