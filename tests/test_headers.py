"""Safetensors headers: the safetensors library judges them. A header it refuses fails binding
in one line naming the shard and the library's reason (every kind of broken rule below); one it
accepts binds to exactly the bytes it reads for each tower tensor. A fuzz test mutates real
headers at random: a correct bind or a GlmVitError, nothing else."""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, event, given, settings, strategies as st
from safetensors import deserialize

from glmvit_cupy import GlmVitError
from glmvit_cupy.bf16 import bf16_to_f32
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry
from glmvit_cupy.tower.synthetic import write_checkpoint
from glmvit_cupy.tower.weights import tower_shapes

# A one-block tower of 90 KB, so that a fuzzed example costs milliseconds.
GEO = GlmVitGeometry(**{**REAL, "depth": 1, "hidden_size": 32, "num_heads": 1, "intermediate_size": 64,
                        "out_hidden_size": 64, "projection_intermediate_size": 128})
PREFIX = "model.language_model.visual."
TARGET = PREFIX + "blocks.0.attn.qkv.weight"
DECOY = "model.language_model.layers.0.mlp.experts.gate_up_proj.weight"  # U8, read by nobody
LIBRARY_MAX_HEADER = 100_000_000  # bytes: the safetensors library's MAX_HEADER_SIZE
# Bits a value of the format's dtypes the fuzz test reinterprets bytes as (sub-byte ones included).
DTYPE_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8,
              "I16": 16, "F16": 16, "BF16": 16, "F32": 32, "I32": 32, "F64": 64, "I64": 64, "C64": 64}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A single-file checkpoint: the tower between BF16, U8 and F8_E4M3 text-stack decoys."""
    return write_checkpoint(tmp_path_factory.mktemp("hdr") / "c", GEO, seed=21, export="nested",
                            decoy_bytes=1024)


def split(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def join(header: dict | str | bytes, data: bytes, pad: bool = True) -> bytes:
    text = header if isinstance(header, (str, bytes)) else json.dumps(header, separators=(",", ":"))
    raw = text.encode() if isinstance(text, str) else text
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def library_accepts(blob: bytes) -> dict | None:
    """The safetensors library's own verdict: name -> {dtype, shape, data}, or None if it refuses."""
    try:
        return dict(deserialize(blob))
    except Exception:
        return None


def copy_of(base: Path, root: Path) -> Path:
    target = root / "c"
    shutil.copytree(base, target)
    return target


def with_entry(field: str, value):
    def edit(h: dict) -> dict:
        h[TARGET][field] = value
        return h
    return edit


def shift_offsets(delta_begin: int, delta_end: int):
    def edit(h: dict) -> dict:
        b, e = h[TARGET]["data_offsets"]
        h[TARGET]["data_offsets"] = [b + delta_begin, e + delta_end]
        return h
    return edit


def add_entry(name: str, meta):
    def edit(h: dict) -> dict:
        h[name] = meta
        return h
    return edit


def retype(name: str, dtype: str, shape: list):
    def edit(h: dict) -> dict:
        h[name]["dtype"], h[name]["shape"] = dtype, shape
        return h
    return edit


def drop(name: str):
    def edit(h: dict) -> dict:
        del h[name]
        return h
    return edit


def on_text(old: str, new: str):
    """A raw edit of the header text (for what a dict cannot hold: duplicates, NaN, escapes)."""
    def edit(h: dict) -> str:
        text = json.dumps(h, separators=(",", ":"))
        assert old in text
        return text.replace(old, new, 1)
    return edit


def target_offsets(h: dict) -> list[int]:
    return h[TARGET]["data_offsets"]


QKV_BYTES = 3 * 32 * 32 * 2
HEADER_CASES = {
    # name: edit of the parsed header
    "overlapping ranges": lambda h: add_entry("extra.alias", dict(h[TARGET]))(h),
    "range before the data section": shift_offsets(-QKV_BYTES - 10 ** 9, -10 ** 9),
    "offsets shifted by two bytes": shift_offsets(2, 2),
    "offsets as strings": with_entry("data_offsets", ["0", "4"]),
    "offsets negative": with_entry("data_offsets", [-2, QKV_BYTES - 2]),
    "offsets of length 1": with_entry("data_offsets", [0]),
    "offsets of length 3": with_entry("data_offsets", [0, 2, 4]),
    "offsets null": with_entry("data_offsets", None),
    "offsets as floats": with_entry("data_offsets", [0.0, 2.0]),
    "offsets as booleans": with_entry("data_offsets", [False, True]),
    "end before begin": lambda h: with_entry("data_offsets", target_offsets(h)[::-1])(h),
    "offsets past 2^64": with_entry("data_offsets", [0, 1 << 64]),
    "shape negative": with_entry("shape", [-96, -32]),
    "shape of strings": with_entry("shape", ["96", "32"]),
    "shape not a list": with_entry("shape", 3072),
    "shape of floats": with_entry("shape", [96.0, 32.0]),
    "shape overflows 64 bits": with_entry("shape", [1 << 32, 1 << 32]),
    "bytes overflow 64 bits": with_entry("shape", [1 << 31, 1 << 31]),
    "shape vs byte size": with_entry("shape", [96, 33]),
    "dtype vs byte size": retype(DECOY, "F16", [2, 512]),
    "sub-byte dtype not whole bytes": add_entry("extra.f4", {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}),
    "unknown dtype": with_entry("dtype", "bf16"),
    "dtype not a string": with_entry("dtype", 16),
    "entry is a number": add_entry("extra.n", 5),
    "entry is a list": add_entry("extra.l", [0, 4]),
    "entry is null": add_entry("extra.z", None),
    "entry lacks data_offsets": lambda h: (h[TARGET].pop("data_offsets"), h)[1],
    "metadata int value": add_entry("__metadata__", {"format": 1}),
    "metadata a list": add_entry("__metadata__", ["pt"]),
    "metadata a string": add_entry("__metadata__", "pt"),
    "a tensor dropped (gap)": drop(DECOY),
    "NaN in the header": on_text('"format":"pt"', '"format":NaN'),
    "infinite number": on_text('"format":"pt"', '"format":1e999'),
    "lone surrogate escape": on_text('"format":"pt"', '"format":"\\ud800"'),
    "negative zero offset": on_text('"data_offsets":[0,', '"data_offsets":[-0,'),
    "nested 200 levels": on_text('"format":"pt"}', '"format":"pt"},"extra.x":{"dtype":"U8","shape":[0],'
                                 '"data_offsets":[0,0],"deep":' + "[" * 200 + "]" * 200 + "}"),
    "top level a list": lambda h: list(h),
}


def apply(base: Path, root: Path, edit) -> tuple[Path, bytes]:
    ckpt = copy_of(base, root)
    path = ckpt / "model.safetensors"
    header, data = split(path.read_bytes())
    blob = join(edit(header), data)
    path.write_bytes(blob)
    return ckpt, blob


def assert_refused_as_the_library_refuses(ckpt: Path, blob: bytes) -> None:
    """Binding fails in one line: the shard, the library's release, then the library's reason."""
    assert library_accepts(blob) is None, "the safetensors library accepts this; the case tests nothing"
    with pytest.raises(GlmVitError) as info:
        bind_checkpoint(ckpt)
    shard = ckpt / "model.safetensors"
    assert str(info.value).startswith(f"{shard}: not a safetensors file that safetensors {safetensors.__version__} "
                                      "reads: Error while deserializing header: ") and "\n" not in str(info.value)


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_a_header_the_library_refuses_is_one_line_naming_the_shard(base, tmp_path, case):
    ckpt, blob = apply(base, tmp_path, HEADER_CASES[case])
    assert_refused_as_the_library_refuses(ckpt, blob)


FILE_CASES = {
    # name: whole file from (header, data)
    "stray bytes after the data": lambda h, d: join(h, d + b"\0" * 8),
    "data truncated": lambda h, d: join(h, d[:-2]),
    "header length past the file": lambda h, d: struct.pack("<Q", 10 ** 7) + join(h, d)[8:],
    "header length over the format's limit": lambda h, d: struct.pack("<Q", LIBRARY_MAX_HEADER + 1) + b"{}" * 8,
    "header not UTF-8": lambda h, d: join(b"\xff" + json.dumps(h).encode()[1:], d),
    "header with a BOM": lambda h, d: join("\ufeff" + json.dumps(h), d),
    "header not JSON": lambda h, d: join("{", d),
    "empty file": lambda h, d: b"",
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_a_file_the_library_refuses_is_one_line_naming_the_shard(base, tmp_path, case):
    ckpt = copy_of(base, tmp_path)
    path = ckpt / "model.safetensors"
    blob = FILE_CASES[case](*split(path.read_bytes()))
    path.write_bytes(blob)
    assert_refused_as_the_library_refuses(ckpt, blob)


def assert_binds_as_the_library_reads(ckpt: Path, blob: bytes) -> None:
    tensors = library_accepts(blob)
    assert tensors is not None
    weights = bind_checkpoint(ckpt)
    for short in weights.location.entries:
        assert weights.raw(short).tobytes() == tensors[PREFIX + short]["data"], short


def test_valid_unusual_headers_bind(base, tmp_path):
    """What the format allows is allowed: whitespace on either side of the JSON, no metadata,
    entries in any order, extra fields in an entry, zero-size tensors, tensors trading places,
    a name given twice (the last entry counts, in the library and in binding)."""
    def unusual(h: dict) -> str:
        h["__metadata__"] = None
        h[TARGET]["comment"] = [1, {"x": None}]
        h["extra.empty"] = {"dtype": "F32", "shape": [0, 7], "data_offsets": [0, 0]}
        # Two tower tensors of one size trade byte ranges: a consistent header, read as it says.
        a, b = PREFIX + "blocks.0.norm1.weight", PREFIX + "blocks.0.norm2.weight"
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
        own = h.pop(TARGET)
        # TARGET twice: first with another tensor's entry (a wrong shape, were it the one read), then its own
        text = json.dumps(dict(reversed(list(h.items()))))[:-1] + f',"{TARGET}":' + \
            json.dumps(h[PREFIX + "blocks.0.attn.proj.weight"]) + f',"{TARGET}":' + json.dumps(own) + "}"
        return "\n\t " + text + " \r\n"
    ckpt, blob = apply(base, tmp_path, unusual)
    assert_binds_as_the_library_reads(ckpt, blob)


# ---- the fuzz test ----------------------------------------------------------------------

FLAT = {PREFIX + k: list(v) for k, v in tower_shapes(GEO).items()}


def flattened(shape: list) -> list:
    return shape if len(shape) < 2 else [shape[0], math.prod(shape[1:])]


def tower_as_expected(tensors: dict) -> bool:
    """The tower part of a header the library accepted is what config.json asks for, and its
    values are finite (a shifted data section reads other bytes, NaN patterns among them)."""
    names = {n for n in tensors if n.startswith(PREFIX)}
    return names == FLAT.keys() and all(
        tensors[n]["dtype"] == "BF16" and (flattened(tensors[n]["shape"]) == FLAT[n]
                                           if len(FLAT[n]) == 2 else tensors[n]["shape"] == FLAT[n])
        and np.isfinite(bf16_to_f32(np.frombuffer(tensors[n]["data"], np.uint16))).all()
        for n in names)


anything = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 65), 1 << 65) | st.text(max_size=4)
                        | st.floats(allow_nan=False, allow_infinity=False),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=2), max_leaves=6)
small_int = st.integers(-8, 8) | st.sampled_from([1 << 64, (1 << 64) - 1, 1 << 63, 10 ** 9])
# What a JSON array element can be instead of a usize.
element = (small_int | st.integers(0, 1024) | st.none() | st.booleans() | st.text(max_size=2)
           | st.floats(allow_nan=False, allow_infinity=False))


@st.composite
def header_mutation(draw, names: list[str]):
    """One edit of a header dict (or of the file bytes), as a (description, function) pair."""
    kind = draw(st.sampled_from(["offsets", "shift", "swap", "alias", "shape", "dtype", "reinterpret", "field",
                                 "entry", "drop", "add", "metadata", "length", "truncate", "append", "byte"]))
    name = draw(st.sampled_from(names))
    if kind == "offsets":
        value = draw(st.lists(element, max_size=3) | anything)
        return kind, lambda h, b: (h[name].__setitem__("data_offsets", value), (h, b))[1]
    if kind == "shift":
        db, de = draw(small_int), draw(small_int)
        return kind, lambda h, b: (h[name].__setitem__("data_offsets", [h[name]["data_offsets"][0] + db,
                                                                        h[name]["data_offsets"][1] + de]),
                                   (h, b))[1]
    if kind == "swap":
        other = draw(st.sampled_from(names))
        def swap(h, b):
            h[name]["data_offsets"], h[other]["data_offsets"] = h[other]["data_offsets"], h[name]["data_offsets"]
            return h, b
        return kind, swap
    if kind == "shape":
        value = draw(st.lists(element, max_size=5) | anything)
        return kind, lambda h, b: (h[name].__setitem__("shape", value), (h, b))[1]
    if kind == "alias":  # a second name for the same bytes
        new = draw(st.sampled_from(["extra.alias", PREFIX + "blocks.0.extra.weight"]))
        return kind, lambda h, b: (h.__setitem__(new, dict(h[name])), (h, b))[1]
    if kind == "reinterpret":  # the same bytes as another dtype, consistently or not
        dtype = draw(st.sampled_from(["F4", "F6_E2M3", "F6_E3M2"]) | st.sampled_from(sorted(DTYPE_BITS)))
        exact = draw(st.booleans())
        name = draw(st.sampled_from([n for n in names if not n.startswith(PREFIX)]) | st.just(name))

        def reinterpret(h, b):
            begin, end = h[name]["data_offsets"]
            count = (end - begin) * 8 // DTYPE_BITS[dtype] + (0 if exact else 1)
            h[name]["dtype"], h[name]["shape"] = dtype, [count]
            return h, b
        return kind, reinterpret
    if kind == "dtype":
        value = draw(st.sampled_from(sorted(DTYPE_BITS) + ["bf16", "", "F8", "C128"]) | anything)
        return kind, lambda h, b: (h[name].__setitem__("dtype", value), (h, b))[1]
    if kind == "field":
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        if draw(st.booleans()):
            return kind, lambda h, b: (h[name].pop(field, None), (h, b))[1]
        value = draw(anything)
        return kind, lambda h, b: (h[name].__setitem__(field, value), (h, b))[1]
    if kind == "entry":
        value = draw(anything)
        return kind, lambda h, b: (h.__setitem__(name, value), (h, b))[1]
    if kind == "drop":
        return kind, lambda h, b: (h.pop(name), (h, b))[1]
    if kind == "add":
        new = draw(st.sampled_from(["extra.t", PREFIX + "blocks.9.norm1.weight", "__metadata__"]))
        begin = draw(st.integers(0, 1 << 22))
        value = draw(st.fixed_dictionaries({"dtype": st.sampled_from(["U8", "BF16", "F4"]),
                                            "shape": st.lists(st.integers(0, 64), max_size=2),
                                            "data_offsets": st.just([begin, begin + draw(small_int)])}) | anything)
        return kind, lambda h, b: (h.__setitem__(new, value), (h, b))[1]
    if kind == "metadata":
        value = draw(anything | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
        return kind, lambda h, b: (h.__setitem__("__metadata__", value), (h, b))[1]
    if kind == "length":
        delta = draw(small_int)
        return kind, lambda h, b: (h, ("length", delta))
    if kind == "truncate":
        cut = draw(st.integers(1, 64))
        return kind, lambda h, b: (h, ("truncate", cut))
    if kind == "append":
        extra = draw(st.binary(min_size=1, max_size=16))
        return kind, lambda h, b: (h, ("append", extra))
    position, value = draw(st.integers(0, 1 << 16)), draw(st.integers(0, 255))
    return kind, lambda h, b: (h, ("byte", (position, value)))


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_headers_bind_correctly_or_fail_in_one_line(base, tmp_path_factory, data):
    """Random edits of a real header (as written by our synthetic writer): the outcome is a
    GlmVitError, or, exactly when the library accepts the header and the tower in it is the one
    config.json asks for, a bind whose every tensor holds the bytes the library reads for it."""
    header, payload = split((base / "model.safetensors").read_bytes())
    names = sorted(k for k in header if k != "__metadata__")
    edits = data.draw(st.lists(header_mutation(names), min_size=1, max_size=3), label="edits")
    raw_edits = []
    for _, edit in edits:
        try:
            header, raw = edit(header, None)
        except (KeyError, TypeError, AttributeError, IndexError, ValueError):
            continue  # an earlier edit removed what this one edits
        if raw is not None:
            raw_edits.append(raw)
    blob = join(header, payload)
    for op, arg in raw_edits:
        if op == "length":
            (n,) = struct.unpack("<Q", blob[:8])
            blob = struct.pack("<Q", min(max(0, n + arg), (1 << 64) - 1)) + blob[8:]
        elif op == "truncate":
            blob = blob[:-arg]
        elif op == "append":
            blob += arg
        else:
            position, value = arg
            (n,) = struct.unpack("<Q", blob[:8])
            i = 8 + position % max(1, min(n, len(blob) - 8))
            blob = blob[:i] + bytes([value]) + blob[i + 1:]
    ckpt = tmp_path_factory.mktemp("fuzz") / "c"
    ckpt.mkdir()
    shutil.copy(base / "config.json", ckpt / "config.json")
    (ckpt / "model.safetensors").write_bytes(blob)

    tensors = library_accepts(blob)
    event("the library accepts" if tensors is not None else "the library refuses")
    try:
        weights = bind_checkpoint(ckpt)
    except GlmVitError as exc:
        event("GlmVitError")
        assert "\n" not in str(exc)
        assert tensors is None or not tower_as_expected(tensors), f"refused a consistent header: {exc}"
        return
    finally:
        shutil.rmtree(ckpt.parent)
    event("bound")
    assert tensors is not None, "bound a header the safetensors library refuses"
    for short in weights.location.entries:
        assert weights.raw(short).tobytes() == tensors[PREFIX + short]["data"], short


@pytest.mark.parametrize("weight_map, message", [
    ([], r"weight_map is a list, expected \{tensor name: shard file name\}"),
    ({"model.visual.patch_embed.proj.weight": 5}, r"places model\.visual\.patch_embed\.proj\.weight in 5, not a file"),
    ({"model.visual.patch_embed.proj.weight": "../model.safetensors"}, r"in '\.\./model\.safetensors', not a file"),
    ({"model.visual.patch_embed.proj.weight": "/etc/passwd"}, r"in '/etc/passwd', not a file name"),
])
def test_a_broken_shard_index_is_one_line(tmp_path, weight_map, message):
    ckpt = write_checkpoint(tmp_path / "c", GEO, seed=22, decoy_bytes=1024)
    index = ckpt / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(GlmVitError, match=message) as info:
        bind_checkpoint(ckpt)
    assert "\n" not in str(info.value) and str(index) in str(info.value)
