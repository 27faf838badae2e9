"""Bind the vision tower's 347 BF16 tensors out of a safetensors checkpoint, reading nothing else.

A full GLM-5.3-Flash checkpoint is hundreds of GB, almost all of it the text/MoE stack
(NVFP4 U8-packed weights and F8_E4M3 scales in the quantised export). The tower is 1.05 GiB
of BF16 under one of three prefixes, or under none: `Glm5NextVisionModel.save_pretrained`
writes the bare names (`blocks.0.attn.qkv.weight`). So binding is two steps:

1. `locate_tower` reads config.json, the shard index and the JSON headers of the shards
   that hold tower tensors (never a byte of tensor data), probes the prefix, takes the
   census (depth x 14 + 11 names, missing and unexpected ones listed) and checks every
   tower tensor's dtype (BF16 only; anything else is refused by name, never reinterpreted)
   and its header shape, exactly one of those `weights.stored_shapes` lists (read flattened
   to the `[rows, cols]` the engines take).
2. `read_tower` preads exactly those byte ranges into one host arena of raw 16-bit patterns.

The header is parsed here rather than through the `safetensors` package: its numpy backend
cannot hand out BF16 (numpy has no bfloat16) and it does not expose the byte offsets that
reading only the tower needs. The format is 8 bytes of little-endian header length, a JSON
header of `{name: {dtype, shape, data_offsets}}`, then the data.

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
from typing import Any, Callable, Iterable

import numpy as np

from .errors import GlmVitError, InternalError
from .geometry import GlmVitGeometry, load_geometry
from .weights import FUSED_PAIRS, stored_shapes, tower_shapes

# Probed in this order; "" is the bare layout of a saved Glm5NextVisionModel, last because
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

    def fused(self, first: str, second: str) -> np.ndarray:
        """A FUSED_PAIRS pair as one tensor (first's rows, then second's): a view, no copy."""
        a, b = self.raw(first), self.raw(second)
        start = self.offsets[first]
        if self.offsets[second] != start + a.size:
            raise InternalError(f"{second} does not follow {first} in the arena: at element {self.offsets[second]}, "
                                f"not {start + a.size}")
        return self.arena[start:start + a.size + b.size].reshape((a.shape[0] + b.shape[0],) + a.shape[1:])


def tensor_name(prefix: str, short: str) -> str:
    """`prefix.short`, or `short` alone under the bare layout (prefix "")."""
    return f"{prefix}.{short}" if prefix else short


def tower_tensor_names(names: Iterable[str], prefix: str) -> list[str]:
    """The names under `prefix` (every name, for the bare layout: a vision-only file)."""
    return [n for n in names if not prefix or n.startswith(prefix + ".")]


# The header rules of the safetensors library (safetensors/src/tensor.rs: `read_metadata`,
# `Metadata::validate`, `Dtype::bitsize`; serde_json's parser), every one enforced here.
MAX_HEADER_BYTES = 100_000_000  # its MAX_HEADER_SIZE
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
              "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64,
              "I64": 64, "U64": 64}
USIZE_LIMIT = 1 << 64  # shapes, offsets and sizes are usize: every product must fit in 64 bits
JSON_MAX_DEPTH = 128  # serde_json's recursion limit


@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    """One tensor's header entry, validated: its bytes are [begin, end) of the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _json_pairs(pairs: list[tuple[str, Any]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {twice!r} appears twice")
    return dict(pairs)


def _json_int(literal: str) -> int | float:
    # serde_json reads "-0" (JSON's only signed zero integer) as a float, which no usize field
    # accepts; Python would make it the int 0.
    return -0.0 if literal == "-0" else int(literal)


def _json_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise ValueError(f"number {literal} out of range")
    return value


def _json_constant(literal: str) -> None:
    raise ValueError(f"{literal} is not JSON")


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (an object or array counts one level), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def _usize_list(value: Any, length: int | None = None) -> list[int] | None:
    """`value` as a list of usize (JSON non-negative integers below 2^64), else None."""
    if not isinstance(value, list) or (length is not None and len(value) != length):
        return None
    if not all(type(v) is int and 0 <= v < USIZE_LIMIT for v in value):
        return None
    return value


def _header_entry(shard: Path, name: str, meta: Any) -> HeaderEntry:
    """One tensor's {dtype, shape, data_offsets}, typed and self-consistent (size vs offsets)."""
    if not isinstance(meta, dict):
        raise GlmVitError(f"{shard}: {name}: header entry is a {type(meta).__name__}, expected "
                          "{dtype, shape, data_offsets}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in meta]
    if missing:
        raise GlmVitError(f"{shard}: {name}: header entry lacks {', '.join(missing)}")
    dtype, shape, offsets = meta["dtype"], _usize_list(meta["shape"]), _usize_list(meta["data_offsets"], 2)
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise GlmVitError(f"{shard}: {name}: dtype {dtype!r} is not a safetensors dtype")
    if shape is None:
        raise GlmVitError(f"{shard}: {name}: shape {meta['shape']!r} is not a list of non-negative "
                          "64-bit integers")
    if offsets is None:
        raise GlmVitError(f"{shard}: {name}: data_offsets {meta['data_offsets']!r} is not [begin, end] "
                          "of non-negative 64-bit integers")
    begin, end = offsets
    if end < begin:
        raise GlmVitError(f"{shard}: {name}: data_offsets [{begin}, {end}] end before they begin")
    count = 1
    for dim in shape:  # checked at every step, as usize::checked_mul is
        count *= dim
        if count >= USIZE_LIMIT:
            raise GlmVitError(f"{shard}: {name}: shape {shape} overflows 64 bits")
    bits = count * DTYPE_BITS[dtype]
    if bits >= USIZE_LIMIT:
        raise GlmVitError(f"{shard}: {name}: shape {shape} of {dtype} overflows 64 bits")
    if bits % 8:
        raise GlmVitError(f"{shard}: {name}: {count} {dtype} values ({bits} bits) do not fill whole bytes")
    if end - begin != bits // 8:
        raise GlmVitError(f"{shard}: {name}: shape {shape} of {dtype} is {bits // 8} bytes, but "
                          f"data_offsets [{begin}, {end}] hold {end - begin}")
    return HeaderEntry(dtype, tuple(shape), begin, end)


def _read_header(shard: Path) -> tuple[dict[str, HeaderEntry], int, int]:
    """(validated tensor entries, absolute offset of the data section, file size) of one shard.

    As strict as the safetensors library: a header it refuses is refused here, by shard and
    tensor. Beyond it, duplicate keys (which it resolves silently, the last one winning) are
    refused too."""
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise GlmVitError(f"{shard}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise GlmVitError(f"{shard}: corrupt safetensors header (claims {n} bytes; the format's "
                                  f"limit is {MAX_HEADER_BYTES})")
            if n > size - 8:
                raise GlmVitError(f"{shard}: corrupt safetensors header (claims {n} bytes in a "
                                  f"{size}-byte file)")
            text = f.read(n).decode("utf-8")
        header = json.loads(text, object_pairs_hook=_json_pairs, parse_int=_json_int,
                            parse_float=_json_float, parse_constant=_json_constant)
        # A lone surrogate escape ("\ud800") parses in Python, not in serde_json.
        json.dumps(header, ensure_ascii=False).encode("utf-8")
    except FileNotFoundError:
        raise GlmVitError(f"{shard}: shard listed in the checkpoint is missing") from None
    except (OSError, UnicodeError, ValueError, RecursionError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else exc
        raise GlmVitError(f"{shard}: cannot read safetensors header: {reason}") from None
    if not isinstance(header, dict):
        raise GlmVitError(f"{shard}: corrupt safetensors header (not a JSON object)")
    if _depth(header) > JSON_MAX_DEPTH:
        raise GlmVitError(f"{shard}: corrupt safetensors header (nested deeper than {JSON_MAX_DEPTH} levels)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise GlmVitError(f"{shard}: corrupt safetensors header (__metadata__ must map strings to strings)")
    entries = {name: _header_entry(shard, name, meta) for name, meta in header.items()}
    # The data section is the tensors back to back in offset order: from byte 0, no gap, no
    # overlap, and nothing after the last one.
    covered, last = 0, None
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin < covered:
            raise GlmVitError(f"{shard}: {name}: bytes [{e.begin}, {e.end}) overlap {last}'s, which end at "
                              f"{covered}")
        if e.begin > covered:
            raise GlmVitError(f"{shard}: {name}: bytes [{e.begin}, {e.end}) leave [{covered}, {e.begin}) "
                              f"of the data section to no tensor")
        covered, last = e.end, name
    if 8 + n + covered != size:
        raise GlmVitError(f"{shard}: the tensors cover {covered} bytes of data but the file holds "
                          f"{size - 8 - n} after its header: the shard is "
                          f"{'truncated' if 8 + n + covered > size else 'followed by stray bytes'}")
    return entries, 8 + n, size


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
        header, _, _ = _read_header(single)
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

    headers: dict[Path, tuple[dict[str, HeaderEntry], int, int]] = {}
    entries: dict[str, TensorEntry] = {}
    for short, want in expected.items():
        name = tensor_name(prefix, short)
        shard = names[name]
        if shard not in headers:
            headers[shard] = _read_header(shard)
        header, data_start, _ = headers[shard]
        meta = header.get(name)
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
        # The header's offsets agree with its shape and lie inside the file (_read_header).
        nbytes = meta.end - meta.begin
        entries[short] = TensorEntry(shard, data_start + meta.begin, nbytes, want, meta.shape)
    return TowerLocation(geo, prefix, entries)


def _arena_layout(location: TowerLocation) -> tuple[dict[str, int], int]:
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
    """pread exactly the tower's byte ranges into one uint16 arena, several tensors at a time
    (preadv releases the GIL; one thread copies from the page cache at ~5 GB/s, not enough
    for a 1.05 GiB tower to be ready within a second).

    Each tensor is scanned for NaN / Inf as it lands (one NaN weight makes every embedding
    NaN) and the tower is refused by tensor name if any has one. Both backends start from this
    arena (the GPU engine uploads it as is), so this one host check covers both. `allocate`
    returns the zeroed uint16 arena of a given length (devices.py's lives in shared memory)."""
    offsets, total = _arena_layout(location)
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

