"""Test helpers: tolerances, the kernel sets, the transformers oracle (test-only), and the
processes a test started."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

from glmvit_cupy.tower import synthetic
from glmvit_cupy.tower.checkpoint import read_header

PREFIX = "model.visual."
photo_like = synthetic.photo_like  # the tests' images (and `glmvit-cupy bench`'s)


def rel_err(a, b) -> float:
    """Relative Frobenius error |a - b| / |b|, in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# Rows of the same input from another forward batch: float32 sums in another order, within this
# relative Frobenius error (test_pipeline's batched against alone); a BF16 output is such a result
# rounded to nearest, so an element may land on the neighbouring BF16 value.
TOLERANCE = 1e-5
BF16_TOLERANCE = 2 * 2.0 ** -8 + TOLERANCE


@functools.cache
def blas_rows_stable() -> bool:
    """Whether this NumPy's BLAS gives each row of a float32 product the same bits whatever the
    rows beside it (the tiny tower's shapes). OpenBLAS did on the Intel machines the tests ran on,
    so the NumPy backend's outputs are held bit for bit across batches there; on an AMD EPYC (Zen 3,
    OpenBLAS's Haswell kernels) a row's bits depend on how many rows share the product, with one
    thread too, and they are held within TOLERANCE."""
    rng = np.random.default_rng(0)
    for k, n in ((64, 192), (64, 128), (128, 64), (256, 96)):
        a, w = rng.standard_normal((97, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        whole = a @ w
        if any(not np.array_equal(a[:m] @ w, whole[:m]) for m in (1, 5, 17, 40, 64)):
            return False
    return True


def _bf16(array: np.ndarray) -> bool:
    """BF16 as bits (uint16), as ml_dtypes values, or widened to float32 (read_embeddings: every low half zero)."""
    return (array.dtype == np.uint16 or array.dtype.name == "bfloat16"
            or (array.dtype == np.float32 and not (array.view(np.uint32) & np.uint32(0xFFFF)).any()))


def _values(array: np.ndarray) -> np.ndarray:
    """float64 values of an output array, BF16 bits (or ml_dtypes values) widened."""
    if array.dtype == np.uint16 or array.dtype.name == "bfloat16":
        return (array.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def assert_same_rows(got, want, what: str = "") -> None:
    """Rows of the same inputs computed in other batches: the same bits where the BLAS keeps a
    row's bits in any batch (blas_rows_stable; always for integer arrays), else within TOLERANCE
    (BF16_TOLERANCE for BF16)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    if blas_rows_stable() or not (want.dtype.kind == "f" or _bf16(want)):
        assert np.array_equal(got, want), what
        return
    err = rel_err(_values(got), _values(want)) if want.size else 0.0
    assert err <= (BF16_TOLERANCE if _bf16(want) else TOLERANCE), f"{what}: relative error {err:.3e}"


def assert_same_outputs(got: Path, want: Path) -> None:
    """Two output directories of `encode --out-dir` computed in other batches hold the same files:
    byte for byte where the BLAS keeps a row's bits in any batch; else every file but the shards'
    tensors byte for byte (headers included: names, dtypes, shapes, offsets) and each tensor by
    assert_same_rows."""
    names = sorted(p.name for p in got.iterdir())
    assert names == sorted(p.name for p in want.iterdir()), (names, sorted(p.name for p in want.iterdir()))
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64}
    for name in names:
        raw, want_raw = (got / name).read_bytes(), (want / name).read_bytes()
        if blas_rows_stable() or not name.endswith(".safetensors"):
            assert raw == want_raw, name
            continue
        entries, _ = read_header(got / name)
        start = min(e.begin for e in entries.values())
        assert raw[:start] == want_raw[:start] and len(raw) == len(want_raw), name
        for tensor, e in entries.items():
            rows = [np.frombuffer(r[e.begin:e.end], dtype=dtypes[e.dtype]).reshape(e.shape) for r in (raw, want_raw)]
            assert_same_rows(*rows, what=f"{name} {tensor}")


# The GPU engine's kernel sets the gpu tests run (model.KERNELS but "auto"): the Hopper ones,
# and the generic ones every other GPU runs, forced on an H200 with kernels="generic".
KERNEL_SETS = ("hopper", "generic")


def sm90() -> bool:
    import cupy
    return cupy.cuda.Device().compute_capability == "90"


def available_kernel_sets() -> list[str]:
    return [k for k in KERNEL_SETS if k != "hopper" or sm90()]


def skip_unless_available(kernels: str) -> None:
    """Skip a test of the Hopper kernels off sm_90."""
    import pytest

    if kernels not in available_kernel_sets():
        pytest.skip("the Hopper kernels need sm_90")


def assert_close(got, ref, atol, rtol: float, what: str = "") -> None:
    """Element-wise |got - ref| <= atol + rtol x |ref| (llm.c's check; atol a number or an array
    broadcasting against ref), in float64; NaN in got fails. On failure the message names how
    many elements are out, the first few (index, got, ref), the worst one (by how far past its
    bound) and the whole array's relative Frobenius error."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, expected {ref.shape}"
    bound = atol + rtol * np.abs(ref)
    err = np.abs(got - ref)
    bad = ~(err <= bound)
    if not bad.any():
        return
    at = [tuple(int(i) for i in ix) for ix in np.argwhere(bad)[:5]]
    worst = np.unravel_index(np.argmax(np.where(bad, np.nan_to_num(err - bound, nan=np.inf), -np.inf)), ref.shape)
    worst = tuple(int(i) for i in worst)
    lines = [f"{what}: {int(bad.sum())} of {bad.size} elements outside |got - ref| <= atol + {rtol:.3g} |ref| "
             f"(relative Frobenius error {rel_err(np.nan_to_num(got), ref):.3e})"]
    lines += [f"  at {i}: got {float(got[i])!r}, ref {float(ref[i])!r}, bound {np.broadcast_to(bound, ref.shape)[i]:.3g}"
              for i in at]
    lines.append(f"  worst at {worst}: got {float(got[worst])!r}, ref {float(ref[worst])!r}, "
                 f"bound {np.broadcast_to(bound, ref.shape)[worst]:.3g}")
    raise AssertionError("\n".join(lines))


def transformers_tower(model_dir: Path, dtype: str = "float32", device: str = "cpu"):
    """transformers' Glm5NextVisionModel holding the checkpoint's tower (the oracle)."""
    import torch
    from safetensors.torch import load_file
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    config = json.loads((model_dir / "config.json").read_text())
    vision = Glm5NextVisionConfig(**config.get("vision_config", config))
    vision._attn_implementation = "sdpa"
    model = Glm5NextVisionModel(vision).eval()
    state = {}
    for shard in model_dir.glob("*.safetensors"):
        state.update({k[len(PREFIX):]: v for k, v in load_file(shard).items() if k.startswith(PREFIX)})
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=getattr(torch, dtype))


def run_transformers(model, pixel_values: np.ndarray, grid_thw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(last_hidden_state, pooler_output) of the oracle, as float32 NumPy."""
    import torch

    param = next(model.parameters())
    with torch.no_grad():
        out = model(torch.from_numpy(pixel_values).to(param.device, param.dtype),
                    torch.from_numpy(np.asarray(grid_thw)).to(param.device))
    return (out.last_hidden_state.float().cpu().numpy(), out.pooler_output.float().cpu().numpy())


# A tower small enough to build, save and run through transformers in a fraction of a second.
TINY_VISION = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=96,
                   projection_intermediate_size=160)
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                 kv_lora_rank=16, q_lora_rank=32, v_head_dim=16, qk_nope_head_dim=16, vocab_size=256,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2, index_head_dim=16, index_n_heads=2,
                 linear_head_dim=16, linear_num_heads=2)
# What transformers writes, by the class that saves it: the vision model alone (bare names),
# the full model (model.visual.*) and the bare Glm5NextModel (visual.*).
SAVED_BY = ("vision", "full", "model")


def save_with_transformers(directory: Path, kind: str, sharded: bool = False, seed: int = 0,
                           vision: dict | None = None):
    """Build a tiny `kind` model with random weights, save_pretrained it into `directory` in BF16
    (as the released exports are), and return transformers' own float32 tower loaded back from
    those files with from_pretrained: the oracle for whatever binds them."""
    import torch
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig, Glm5NextVisionConfig
    from transformers.models.glm5_next.modeling_glm5_next import (Glm5NextForConditionalGeneration, Glm5NextModel,
                                                                  Glm5NextVisionModel)

    vision = dict(TINY_VISION, **(vision or {}))
    torch.manual_seed(seed)
    if kind == "vision":
        cls, config = Glm5NextVisionModel, Glm5NextVisionConfig(**vision)
    else:
        cls = {"full": Glm5NextForConditionalGeneration, "model": Glm5NextModel}[kind]
        config = Glm5NextConfig(text_config=TINY_TEXT, vision_config=vision)
    model = cls(config)
    with torch.no_grad():  # trained-looking values: no zero biases, norms near one
        for name, param in model.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2]:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.02 * torch.randn_like(param))
    model.to(torch.bfloat16).save_pretrained(directory, max_shard_size="40KB" if sharded else "50GB")
    loaded = cls.from_pretrained(directory, attn_implementation="sdpa")
    tower = {"vision": lambda m: m, "full": lambda m: m.model.visual, "model": lambda m: m.visual}[kind](loaded)
    return tower.float().eval()


def bomb_png(path: Path, width: int, height: int) -> Path:
    """A valid PNG header declaring width x height 1-bit pixels (a decompression bomb as PIL
    sees it when it opens the file); the image data is a stub, never reached."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1 bit, greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


def live_processes():
    """(pid, its /proc/PID/stat fields after the command name, its command line) of every live
    (not zombie) process: fields[1] is the parent pid, fields[3] the session id."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z":
            yield int(entry), fields, cmdline
