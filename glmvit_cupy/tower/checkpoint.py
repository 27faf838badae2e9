"""Bind the vision tower's 347 BF16 tensors out of a safetensors checkpoint, reading nothing else.

A full GLM-5.3-Flash checkpoint is hundreds of GB, almost all of it the text/MoE stack
(NVFP4 U8-packed weights and F8_E4M3 scales in the quantised export). The tower is 1.05 GiB
of BF16 under one of three prefixes, or under none: `Glm5NextVisionModel.save_pretrained`
writes the bare names (`blocks.0.attn.qkv.weight`). So binding is two steps:

1. `locate_tower` reads config.json, the shard index and the headers of the shards that
   hold tower tensors (never a byte of tensor data), probes the prefix, takes the census
   (every name `weights.tower_shapes` lists, missing and unexpected ones named) and checks
   every tower tensor's dtype (BF16 only; anything else is refused by name, never
   reinterpreted) and its header shape, exactly one of those `weights.stored_shapes` lists
   (read flattened to the `[rows, cols]` the engines take).
2. `read_tower` preads exactly those byte ranges into one host arena of raw 16-bit patterns.

The safetensors library judges each header (`read_header`); the rest is ours because its
Python API cannot do it: it gives no byte offsets, and it reads a tensor into an array of its
own (its numpy backend has no bfloat16), where the arena needs the bytes in place, several
tensors at a time, in memory that devices.py may share between processes.

The arena's order is chosen for the GPU: each block's gate and up projections (weights, and
biases) are adjacent, so the engine runs them as ONE GEMM against a `[2 x intermediate, h]`
view, and the whole arena goes to the device in one copy.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, TypeVar

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors import __version__ as SAFETENSORS_VERSION

from ..errors import GlmVitError, InternalError
from .geometry import GlmVitGeometry, load_geometry
from .weights import (BLOCK_NAMES, EMBED_NAMES, FUSED_PAIRS, MERGER_NAMES, GlmVitBlock, GlmVitMerger, GlmVitTensors,
                      stored_shapes, tower_shapes)

A = TypeVar("A")

# Probed in this order; "" is the bare names of a saved Glm5NextVisionModel, last because
# only a vision-only file has a top-level patch_embed.
TOWER_PREFIXES = ("model.visual", "model.language_model.visual", "visual", "")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

ARENA_ALIGN = 256  # bytes; cuBLAS and the 16-byte vector loads want aligned operands


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    shard: Path
    offset: int  # absolute byte offset in the shard
    nbytes: int
    shape: tuple[int, ...]  # as read (flattened)
    stored_shape: tuple[int, ...]  # as the header has it (the convolutions keep their kernel axes)


@dataclasses.dataclass(frozen=True)
class TowerLocation:
    """What `locate_tower` found: where each tower tensor's bytes are. No data read yet."""

    geometry: GlmVitGeometry
    prefix: str
    entries: dict[str, TensorEntry]  # short name (no prefix) -> entry, in arena order

    def name(self, short: str) -> str:
        """A tower tensor's full name in this checkpoint."""
        return tensor_name(self.prefix, short)

    @property
    def shards(self) -> list[Path]:
        return sorted({e.shard for e in self.entries.values()})

    @property
    def tower_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


@dataclasses.dataclass(frozen=True)
class TowerWeights:
    """The tower's raw BF16 bit patterns: one uint16 arena and named views into it."""

    location: TowerLocation
    arena: np.ndarray  # uint16, all tensors, ARENA_ALIGN-aligned groups
    offsets: dict[str, int]  # short name -> element offset in the arena
    bytes_read: int

    def fingerprint(self) -> str:
        """A short hash of a strided sample of the tower's bytes: tells two towers apart (an
        output directory records it) without reading the whole arena again."""
        return hashlib.sha256(np.ascontiguousarray(self.arena[::997]).tobytes()).hexdigest()[:16]

    def raw(self, name: str) -> np.ndarray:
        """The BF16 bits of one tensor as uint16, in its read shape (a view, no copy)."""
        shape = self.location.entries[name].shape
        start = self.offsets[name]
        return self.arena[start:start + math.prod(shape)].reshape(shape)

    def structure(self, convert: Callable[[np.ndarray], A]) -> GlmVitTensors[A]:
        """The tensors arranged as blocks + merger; `convert` turns each raw view (`raw`, or a
        gate|up pair's `fused`) into the backend's array (widened float32 for NumPy, a device
        view of the uploaded arena for CuPy; the raw views themselves for deferred_bias)."""
        def fields(names: dict[str, str | tuple[str, str]], prefix: str = "") -> dict[str, A]:
            return {field: convert(self.raw(prefix + n) if isinstance(n, str) else
                                   self.fused(prefix + n[0], prefix + n[1]))
                    for field, n in names.items()}

        blocks = [GlmVitBlock(**fields(BLOCK_NAMES, f"blocks.{i}.")) for i in range(self.location.geometry.depth)]
        return GlmVitTensors(**fields(EMBED_NAMES), blocks=blocks, merger=GlmVitMerger(**fields(MERGER_NAMES)))

    def fused(self, first: str, second: str) -> np.ndarray:
        """A FUSED_PAIRS pair as one tensor (first's rows, then second's): a view, no copy."""
        a, b = self.raw(first), self.raw(second)
        start = self.offsets[first]
        if self.offsets[second] != start + a.size:
            raise InternalError(f"{second} does not follow {first} in the arena: at element {self.offsets[second]}, "
                                f"not {start + a.size}")
        return self.arena[start:start + a.size + b.size].reshape((a.shape[0] + b.shape[0],) + a.shape[1:])


def tensor_name(prefix: str, short: str) -> str:
    """`prefix.short`, or `short` alone under the bare names (prefix "")."""
    return f"{prefix}.{short}" if prefix else short


def tower_tensor_names(names: Iterable[str], prefix: str) -> list[str]:
    """The names under `prefix` (every name, for the bare names: a vision-only file)."""
    return [n for n in names if not prefix or n.startswith(prefix + ".")]


@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: its bytes are [begin, end) of the file."""

    dtype: str  # as the format spells it: BF16, U8, F8_E4M3, ...
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """The tensors of a safetensors file (name -> entry, at absolute byte offsets) and its
    __metadata__, in a file the safetensors library accepts.

    The library judges the whole header (its JSON, every dtype, shapes against byte ranges, the
    data section covered exactly with nothing after it). Its Python API does not give the byte
    offsets, which reading only the tower's bytes needs (read_tower), so they are read from the
    header it has just accepted: 8 bytes of little-endian length, then the JSON."""
    try:
        with open(path, "rb") as f:  # first, so that a directory or a file we may not read is said so
            with safe_open(path, framework="numpy"):
                pass
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise GlmVitError(f"{path}: no such file") from None
    except SafetensorError as exc:
        reason = " ".join(str(exc).split())
        raise GlmVitError(f"{path}: not a safetensors file that safetensors {SAFETENSORS_VERSION} reads: "
                          f"{reason}") from None
    except OSError as exc:
        raise GlmVitError(f"{path}: cannot read: {exc.strerror}") from None
    metadata = header.pop("__metadata__", None) or {}
    data = 8 + n
    entries = {name: HeaderEntry(meta["dtype"], tuple(meta["shape"]), data + meta["data_offsets"][0],
                                 data + meta["data_offsets"][1]) for name, meta in header.items()}
    return entries, metadata


def tensor_names(directory: Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint -> its shard, from the index or the single file."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise GlmVitError(f"{index}: cannot read the shard index: {exc!r}") from None
        if not isinstance(weight_map, dict):
            raise GlmVitError(f"{index}: weight_map is a {type(weight_map).__name__}, expected "
                              "{tensor name: shard file name}")
        for name, shard in weight_map.items():
            # A plain file name in this directory: an index cannot send the reader elsewhere.
            if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
                raise GlmVitError(f"{index}: weight_map places {name} in {shard!r}, not a file name in "
                                  f"{directory}")
        return {name: directory / shard for name, shard in weight_map.items()}
    single = directory / SINGLE_FILE
    if single.is_file():
        header, _ = read_header(single)
        return {name: single for name in header}
    raise GlmVitError(f"{directory}: no safetensors checkpoint (expected {INDEX_FILE} or {SINGLE_FILE})")


def probe_prefix(names: Iterable[str], directory: Path) -> str:
    """The prefix the tower's tensors carry (TOWER_PREFIXES), from the names alone."""
    names = set(names)
    for prefix in TOWER_PREFIXES:
        if tensor_name(prefix, "patch_embed.proj.weight") in names:
            return prefix
    raise GlmVitError(
        f"{directory}: no vision tower in the checkpoint (no patch_embed.proj.weight under "
        f"{', '.join(p or '(no prefix)' for p in TOWER_PREFIXES)}): a text-only export cannot "
        "encode images")


def _census(names: dict[str, Path], prefix: str, expected: dict[str, tuple[int, ...]],
            directory: Path) -> None:
    skip = len(prefix) + 1 if prefix else 0
    present = {n[skip:] for n in tower_tensor_names(names, prefix)}
    missing = [n for n in expected if n not in present]
    unexpected = sorted(present - expected.keys())
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing ({', '.join(tensor_name(prefix, n) for n in missing[:4])}"
                         f"{', ...' if len(missing) > 4 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected ({', '.join(tensor_name(prefix, n) for n in unexpected[:4])}"
                         f"{', ...' if len(unexpected) > 4 else ''})")
        raise GlmVitError(
            f"{directory}: tower census failed: config.json's geometry needs {len(expected)} tensors "
            f"under {prefix or '(no prefix)'}, found {len(present)}: {'; '.join(parts)}")


def locate_tower(model_dir: str | Path) -> TowerLocation:
    """Geometry, prefix, census, dtype and shape checks, from headers alone."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise GlmVitError(f"{directory}: not a directory")
    geo = load_geometry(directory)
    names = tensor_names(directory)
    prefix = probe_prefix(names, directory)
    expected, stored = tower_shapes(geo), stored_shapes(geo)
    _census(names, prefix, expected, directory)

    headers: dict[Path, dict[str, HeaderEntry]] = {}
    entries: dict[str, TensorEntry] = {}
    for short, want in expected.items():
        name = tensor_name(prefix, short)
        shard = names[name]
        if shard not in headers:
            if not shard.is_file():
                raise GlmVitError(f"{shard}: shard listed in the checkpoint is missing")
            headers[shard] = read_header(shard)[0]
        meta = headers[shard].get(name)
        if meta is None:
            raise GlmVitError(f"{shard}: the index places {name} in this shard, but its header lacks it")
        if meta.dtype != "BF16":
            raise GlmVitError(
                f"{shard}: {name} is {meta.dtype}, expected BF16: the GLM-5.3 tower is BF16 throughout "
                "(347/347 tensors in the released exports); a quantised tower needs a dequant path, "
                "not a reinterpretation of its bytes")
        if meta.shape not in stored[short]:
            raise GlmVitError(
                f"{shard}: {name} has shape {list(meta.shape)}; config.json's geometry expects "
                f"{' or '.join(str(list(s)) for s in stored[short])}")
        # The library has checked the offsets against the shape and the file (read_header).
        entries[short] = TensorEntry(shard, meta.begin, meta.end - meta.begin, want, meta.shape)
    return TowerLocation(geo, prefix, entries)


def _arena_offsets(location: TowerLocation) -> tuple[dict[str, int], int]:
    """Element offset of each tensor in the arena; FUSED_PAIRS partners follow with no gap."""
    offsets: dict[str, int] = {}
    cursor = 0  # bytes
    follows_partner = set(FUSED_PAIRS.values())
    for name, entry in location.entries.items():
        if name.split(".", 2)[-1] not in follows_partner and name not in follows_partner:
            cursor = -(-cursor // ARENA_ALIGN) * ARENA_ALIGN
        offsets[name] = cursor // 2
        cursor += entry.nbytes
    return offsets, cursor


BF16_EXPONENT = 0x7F80  # all ones: Inf (mantissa zero) or NaN
_SCAN_CHUNK = 1 << 18  # values per step of the finiteness scan (its temporaries stay in cache)


def nonfinite_values(bits: np.ndarray) -> tuple[int, int]:
    """(count, flat index of the first) of the NaN / Inf patterns among raw BF16 bits (-1: none)."""
    count, first = 0, -1
    flat = bits.reshape(-1)
    for start in range(0, flat.size, _SCAN_CHUNK):
        bad = (flat[start:start + _SCAN_CHUNK] & BF16_EXPONENT) == BF16_EXPONENT
        n = int(np.count_nonzero(bad))
        if n and first < 0:
            first = start + int(np.argmax(bad))
        count += n
    return count, first


def zeroed_arena(elements: int) -> np.ndarray:
    """A private host arena: calloc'd, so the alignment padding between groups is deterministic,
    not whatever the heap held (pages are zeroed on first touch, which the reads do anyway)."""
    return np.zeros(elements, dtype=np.uint16)


def read_tower(location: TowerLocation, allocate: Callable[[int], np.ndarray] = zeroed_arena) -> TowerWeights:
    """pread exactly the tower's byte ranges into one uint16 arena, several tensors at a time:
    one thread's copy from the page cache is what binding waits for, and preadv releases the GIL.

    Each tensor is scanned for NaN / Inf as it lands (one NaN weight makes every embedding
    NaN) and the tower is refused by tensor name if any has one. Both backends start from this
    arena (the GPU engine uploads it as is), so this one host check covers both. `allocate`
    returns the zeroed uint16 arena of a given length (devices.py's lives in shared memory)."""
    offsets, total = _arena_offsets(location)
    arena = allocate(-(-total // ARENA_ALIGN) * ARENA_ALIGN // 2)
    as_bytes = memoryview(arena).cast("B")
    fds: dict[Path, int] = {}

    def read(name: str) -> tuple[int, tuple[int, int]]:
        entry = location.entries[name]
        dst = as_bytes[offsets[name] * 2: offsets[name] * 2 + entry.nbytes]
        done = 0
        while done < entry.nbytes:
            try:
                n = os.preadv(fds[entry.shard], [dst[done:]], entry.offset + done)
            except OSError as exc:
                raise GlmVitError(f"{entry.shard}: read failed: {exc.strerror}") from None
            if n <= 0:
                raise GlmVitError(f"{entry.shard}: {location.name(name)} ends early (shard truncated "
                                  f"after {entry.offset + done} bytes)")
            done += n
        return done, nonfinite_values(np.frombuffer(dst, dtype=np.uint16))

    try:
        for shard in location.shards:
            try:
                fds[shard] = os.open(shard, os.O_RDONLY)
            except OSError as exc:
                raise GlmVitError(f"{shard}: cannot open shard: {exc.strerror}") from None
        # Largest first, so the pool's last task is a small one.
        names = sorted(location.entries, key=lambda n: -location.entries[n].nbytes)
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            results = dict(zip(names, pool.map(read, names)))
    finally:
        for fd in fds.values():
            os.close(fd)
    bad = [(name, results[name][1]) for name in location.entries if results[name][1][0]]
    if bad:
        (name, (count, first)), rest = bad[0], [location.name(n) for n, _ in bad[1:]]
        more = (f"; so do {len(rest)} more tensor(s): {', '.join(rest[:3])}{', ...' if len(rest) > 3 else ''}"
                if rest else "")
        raise GlmVitError(
            f"{location.entries[name].shard}: {location.name(name)} holds {count} NaN/Inf value(s) "
            f"(the first at flat index {first}){more}: a tower with a non-finite weight makes every "
            "embedding NaN, so it is refused")
    return TowerWeights(location, arena, offsets, sum(n for n, _ in results.values()))


def bind_checkpoint(model_dir: str | Path) -> TowerWeights:
    """locate + read: the tower's weights, ready for either backend (and any number of engines)."""
    return read_tower(locate_tower(model_dir))

