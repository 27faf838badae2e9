"""What a collection run reads: command-line inputs expanded into a list of image sources.

An input is an image file, a directory (searched recursively for image extensions, sorted),
a glob pattern (quoted on the shell, expanded here, `**` included), a list file (one input a
line, `-` for stdin) or an uncompressed tar shard in the webdataset convention (each member
with an image extension is one image, its key the member path without the extension). The
expansion is separate from decoding: the pipeline's workers read each source's bytes
themselves, so the main process never holds more than the sources' names. A tar member is
read by its byte range (found once here), not by scanning the archive for every image.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
import tarfile
from pathlib import Path
from typing import Iterable, Sequence

from .errors import GlmVitError

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
TAR_EXTENSIONS = (".tar",)
_COMPRESSED_TARS = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
_GLOB_CHARS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class Source:
    """One image to encode: a file, or a byte range of a tar shard."""

    path: str  # absolute path of the file or of the tar shard
    member: str | None = None  # the tar member's name
    offset: int = 0  # where the member's bytes start in the shard
    size: int = -1  # the member's size (-1: the whole file)

    @property
    def key(self) -> str:
        """Identity across runs (resume): the path, or the shard path and the member's key."""
        return self.path if self.member is None else f"{self.path}::{os.path.splitext(self.member)[0]}"

    @property
    def name(self) -> str:
        """How messages name it."""
        return self.path if self.member is None else f"{self.path}:{self.member}"

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


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _tar_members(path: str) -> list[Source]:
    """Every image member of an uncompressed tar, with its byte range, in archive order."""
    try:
        with tarfile.open(path, "r:") as tar:
            return [Source(path, m.name, m.offset_data, m.size) for m in tar
                    if m.isfile() and is_image_name(m.name)]
    except tarfile.ReadError as exc:
        raise GlmVitError(f"{path}: not a readable uncompressed tar shard ({exc})") from None
    except OSError as exc:
        raise GlmVitError(f"{path}: cannot read tar shard: {exc.strerror or exc}") from None


def _walk(directory: str) -> list[str]:
    """Image files under a directory, recursively, in sorted path order."""
    found = []
    for root, dirs, files in os.walk(directory, onerror=None):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(os.path.join(root, f) for f in files if is_image_name(f) and not f.startswith("."))
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
    return [Source(path)]  # a file named explicitly is taken as an image, whatever its extension


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
