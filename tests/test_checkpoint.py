"""Binding: each export, prefix probe, census, dtype/shape guards, and reading only the tower."""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors import safe_open

from glmvit_cupy import GlmVitError
from glmvit_cupy.tower.checkpoint import bind_checkpoint, locate_tower, read_header
from glmvit_cupy.tower.synthetic import GEOMETRIES, write_checkpoint
from glmvit_cupy.tower.weights import parameter_count, tensor_count, tower_shapes
from glmvit_cupy.tower.writer import write_safetensors


def read_all(path: Path) -> list[tuple[str, str, list[int], bytes]]:
    """Every tensor of one safetensors file as (name, dtype, shape, bytes)."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    items = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    return [(k, v["dtype"], v["shape"], blob[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in items]


# The dtypes these tests write, as safetensors spells them -> NumPy's (ml_dtypes') dtype.
NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
                "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8}


def rewrite(path: Path, edit) -> None:
    """Rewrite a single-file checkpoint through `edit(name, dtype, shape, data) -> tuple | None`."""
    items = [t for t in (edit(*item) for item in read_all(path)) if t is not None]
    path.unlink()
    write_safetensors(path, {n: np.frombuffer(b, NUMPY_DTYPES[d]).reshape(s) for n, d, s, b in items})


@pytest.mark.parametrize("export, prefix", [("full", "model.visual"),
                                            ("nested", "model.language_model.visual"),
                                            ("vision-only", "visual")])
def test_three_exports_bind_with_the_right_prefix(tmp_path, export, prefix):
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=3, export=export)
    weights = bind_checkpoint(ckpt)
    loc = weights.location
    assert loc.prefix == prefix
    assert len(loc.entries) == tensor_count(loc.geometry) == 39
    assert weights.bytes_read == loc.tower_bytes == 2 * parameter_count(loc.geometry)


def test_binding_agrees_with_the_official_safetensors_parser(tiny_ckpt):
    """The byte ranges read_tower preads vs safetensors' own reader, tensor by tensor."""
    import torch
    from safetensors.torch import load_file

    weights = bind_checkpoint(tiny_ckpt)
    loaded = {}
    for shard in tiny_ckpt.glob("*.safetensors"):
        with safe_open(shard, "numpy") as f:
            for name in f.keys():
                loaded[name] = (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
        for name, tensor in load_file(shard).items():
            if name.startswith("model.visual."):
                short = name[len("model.visual."):]
                bits = weights.raw(short)
                assert tensor.dtype == torch.bfloat16
                assert np.array_equal(tensor.view(torch.int16).numpy().view(np.uint16).reshape(bits.shape), bits)
    tower = {k: v for k, v in loaded.items() if k.startswith("model.visual.")}
    assert len(tower) == 39 and all(dtype == "BF16" for dtype, _ in tower.values())
    assert tower["model.visual.patch_embed.proj.weight"][1] == [128, 3, 2, 14, 14]
    assert tower["model.visual.downsample.weight"][1] == [256, 128, 2, 2]


def test_fused_gate_up_is_a_view_of_both_tensors(tiny_ckpt):
    w = bind_checkpoint(tiny_ckpt)
    fused = w.fused("blocks.1.mlp.gate_proj.weight", "blocks.1.mlp.up_proj.weight")
    assert fused.shape == (512, 128) and np.shares_memory(fused, w.arena)
    assert np.array_equal(fused[:256], w.raw("blocks.1.mlp.gate_proj.weight"))
    assert np.array_equal(fused[256:], w.raw("blocks.1.mlp.up_proj.weight"))


def test_census_of_the_real_geometry_is_347():
    shapes = tower_shapes(GEOMETRIES["real"])
    assert len(shapes) == 347 == 24 * 14 + 11
    assert shapes["patch_embed.proj.weight"] == (1024, 1176)
    assert shapes["downsample.weight"] == (4096, 4096)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def test_only_the_towers_bytes_are_read(tmp_path):
    """Beside large U8 / F8_E4M3 / BF16 text-stack tensors, the bytes read (the kernel's
    count, /proc/self/io rchar) are the tower's plus headers, and the shard holding only
    text-stack tensors is never opened (it is deleted here)."""
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=4, decoy_bytes=48 << 20)
    decoy_total = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    (ckpt / "model-00003-of-00003.safetensors").unlink()
    before = _rchar()
    weights = bind_checkpoint(ckpt)
    read = _rchar() - before
    tower = weights.location.tower_bytes
    assert decoy_total > 50 * tower  # the decoys dwarf the tower
    assert tower <= read < tower + (1 << 20), (read, tower)


def test_text_only_checkpoint_is_refused(tmp_path):
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=5, export="nested")
    rewrite(ckpt / "model.safetensors", lambda n, d, s, b: None if ".visual." in n else (n, d, s, b))
    with pytest.raises(GlmVitError, match="no vision tower in the checkpoint.*text-only"):
        locate_tower(ckpt)


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=6, export="vision-only")
    path = ckpt / "model.safetensors"
    rewrite(path, lambda n, d, s, b: None if n == "visual.blocks.1.attn.k_norm.weight" else (n, d, s, b))
    with pytest.raises(GlmVitError, match=r"1 missing \(visual\.blocks\.1\.attn\.k_norm\.weight\)"):
        locate_tower(ckpt)
    rewrite(path, lambda n, d, s, b: (n, d, s, b) if n != "visual.blocks.1.norm1.weight"
            else (n.replace("blocks.1", "blocks.2"), d, s, b))
    with pytest.raises(GlmVitError, match=r"unexpected \(visual\.blocks\.2\.norm1\.weight\)"):
        locate_tower(ckpt)


@pytest.mark.parametrize("dtype, itemsize", [("F32", 4), ("F16", 2), ("F8_E4M3", 1), ("U8", 1)])
def test_non_bf16_tower_tensor_is_refused_by_name(tmp_path, dtype, itemsize):
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=7, export="vision-only")
    target = "visual.blocks.0.attn.qkv.weight"
    rewrite(ckpt / "model.safetensors", lambda n, d, s, b: (n, dtype, s, bytes(math.prod(s) * itemsize))
            if n == target else (n, d, s, b))
    with pytest.raises(GlmVitError, match=rf"{target} is {dtype}, expected BF16"):
        locate_tower(ckpt)


@pytest.mark.parametrize("target, shape", [
    ("visual.patch_embed.proj.weight", [128, 3, 2, 16, 16]),  # another element count
    ("visual.blocks.0.mlp.down_proj.weight", [256, 128]),  # transposed: the right count, the wrong axes
    ("visual.blocks.1.mlp.gate_proj.weight", [256, 8, 16]),  # a 2-D weight stored 3-D
    ("visual.patch_embed.proj.weight", [128, 3, 2, 196]),  # neither the conv's axes nor flat
    ("visual.downsample.weight", [256, 512]),  # the Conv2d weight flattened: not an alias
    ("visual.blocks.0.norm1.weight", [1, 128]),
])
def test_a_shape_other_than_the_stored_one_is_refused(tmp_path, target, shape):
    """Each tensor's header shape must be the one transformers stores (or the patch embedding's
    flattened alias, weights.stored_shapes): the same element count in other axes is refused."""
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=8, export="vision-only")
    rewrite(ckpt / "model.safetensors", lambda n, d, s, b: (n, d, shape, bytes(math.prod(shape) * 2))
            if n == target else (n, d, s, b))
    want = {"visual.patch_embed.proj.weight": "[128, 3, 2, 14, 14] or [128, 1176]",
            "visual.blocks.0.mlp.down_proj.weight": "[128, 256]", "visual.blocks.1.mlp.gate_proj.weight": "[256, 128]",
            "visual.downsample.weight": "[256, 128, 2, 2]", "visual.blocks.0.norm1.weight": "[128]"}[target]
    with pytest.raises(GlmVitError) as info:
        locate_tower(ckpt)
    assert str(info.value) == (f"{ckpt / 'model.safetensors'}: {target} has shape {shape}; config.json's geometry "
                               f"expects {want}")


def test_the_flattened_patch_embedding_is_the_same_tower(tmp_path):
    """The one alias: the patch embedding's [h, C x T x p x p] form binds to the same bits."""
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=8, export="vision-only")
    conv = bind_checkpoint(ckpt)
    rewrite(ckpt / "model.safetensors", lambda n, d, s, b: (n, d, [128, 1176], b)
            if n == "visual.patch_embed.proj.weight" else (n, d, s, b))
    flat = bind_checkpoint(ckpt)
    assert np.array_equal(flat.arena, conv.arena)
    assert flat.location.entries["patch_embed.proj.weight"].stored_shape == (128, 1176)


def library_refusal(path: Path) -> str:
    with pytest.raises(safetensors.SafetensorError) as info:
        safe_open(path, "numpy")
    return str(info.value)


def test_truncated_and_corrupt_shards(tmp_path):
    """A shard the safetensors library refuses is refused in one line naming the shard, the
    library's release and its reason."""
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=9, export="vision-only")
    path = ckpt / "model.safetensors"
    blob = path.read_bytes()
    for broken in (blob[:len(blob) - 1000], b"\xff" * 8 + blob[8:100], b""):
        path.write_bytes(broken)
        with pytest.raises(GlmVitError) as info:
            locate_tower(ckpt)
        assert str(info.value) == (f"{path}: not a safetensors file that safetensors {safetensors.__version__} "
                                   f"reads: {library_refusal(path)}")


def test_read_header_of_what_is_not_a_readable_file(tmp_path):
    """read_header's cold paths, each one line naming the path and why."""
    with pytest.raises(GlmVitError, match=rf"^{tmp_path}/gone.safetensors: no such file$"):
        read_header(tmp_path / "gone.safetensors")
    with pytest.raises(GlmVitError, match=rf"^{tmp_path}: cannot read: .*[Ii]s a directory"):
        read_header(tmp_path)


def test_missing_shard_and_empty_directory(tmp_path):
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=10)
    (ckpt / "model-00002-of-00003.safetensors").unlink()
    missing = "model-00002-of-00003.safetensors: shard listed in the checkpoint is missing"
    with pytest.raises(GlmVitError, match=missing):
        locate_tower(ckpt)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "glm5_next_vision"}')
    with pytest.raises(GlmVitError, match="no safetensors checkpoint"):
        locate_tower(tmp_path / "empty")


def test_make_checkpoint_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    with pytest.raises(GlmVitError, match="not an empty directory"):
        write_checkpoint(tmp_path, "tiny")
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_same_seed_same_bytes_and_realistic_values(tmp_path):
    a = bind_checkpoint(write_checkpoint(tmp_path / "a", "tiny", seed=11))
    b = bind_checkpoint(write_checkpoint(tmp_path / "b", "tiny", seed=11))
    assert np.array_equal(a.arena, b.arena)
    from glmvit_cupy.bf16 import bf16_to_f32
    w = bf16_to_f32(a.raw("blocks.0.attn.qkv.weight"))
    bias = bf16_to_f32(a.raw("blocks.0.attn.qkv.bias"))
    norm = bf16_to_f32(a.raw("blocks.0.norm1.weight"))
    assert abs(w.std() - 0.02) < 0.002 and abs(bias.std() - 0.02) < 0.005
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15
    assert os.path.getsize(next((tmp_path / "a").glob("model-00003*"))) > 0


@pytest.mark.parametrize("pattern", [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x7F81, 0xFFFF])
def test_a_non_finite_weight_is_refused_by_tensor_name(tmp_path, pattern):
    """One NaN or Inf (any sign, any payload) anywhere in the tower, and the bind says where;
    BF16 0x7F7F (the largest finite value) is not refused."""
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=12)
    loc = locate_tower(ckpt)

    def poke(name: str, index: int, bits: int) -> None:
        entry = loc.entries[name]
        with open(entry.shard, "r+b") as f:
            f.seek(entry.offset + 2 * index)
            f.write(struct.pack("<H", bits))

    poke("merger.down_proj.weight", 7, 0x7F7F)
    assert bind_checkpoint(ckpt).raw("merger.down_proj.weight").reshape(-1)[7] == 0x7F7F
    poke("blocks.1.mlp.down_proj.weight", 12345, pattern)
    poke("patch_embed.proj.weight", 999, pattern)
    with pytest.raises(GlmVitError, match=r"model-00002-of-00003.safetensors: model\.visual\.blocks\.1\.mlp\.down_proj"
                                          r"\.weight holds 1 NaN/Inf value\(s\) \(the first at flat index 12345\); "
                                          r"so do 1 more tensor\(s\): model\.visual\.patch_embed\.proj\.weight:"):
        bind_checkpoint(ckpt)


def test_a_non_finite_weight_under_bare_names_is_named_as_the_checkpoint_names_it(tmp_path, tiny_ckpt):
    """Glm5NextVisionModel.save_pretrained's bare names (what extract writes) carry no prefix:
    the tensor is named `blocks.0.norm1.weight`, not `.blocks.0.norm1.weight`."""
    from glmvit_cupy.extract import extract_tower

    bare = extract_tower(tiny_ckpt, tmp_path / "bare").destination
    loc = locate_tower(bare)
    assert loc.prefix == ""
    entry = loc.entries["blocks.0.norm1.weight"]
    with open(entry.shard, "r+b") as f:
        f.seek(entry.offset + 2 * 3)
        f.write(struct.pack("<H", 0x7FC0))
    with pytest.raises(GlmVitError) as info:
        bind_checkpoint(bare)
    assert str(info.value).startswith(f"{bare / 'model.safetensors'}: blocks.0.norm1.weight holds 1 NaN/Inf value(s) "
                                      "(the first at flat index 3): ")
