"""Synthetic checkpoints in the exact form of the released exports, with random weights from a seed.

No real GLM-5.3 weights can be downloaded where this project is built and tested, so the
tests, the benchmarks and a newcomer's first run use checkpoints written here: the same
config.json, shard index, tensor names, on-disk shapes (5-D patch-embed conv, 4-D downsample
conv) and BF16 dtype as the real export, plus decoy text-stack tensors (NVFP4-style U8 packed
weights, F8_E4M3 scales, BF16 embeddings) that the binder must never read.

Weights look like a trained-from-init model rather than zeros: linear weights and biases
N(0, 0.02) (transformers' initializer_range), norm weights 1 + N(0, 0.1). `photo_like` makes
the matching inputs: images with a photo's statistics, for the tests and `glmvit-cupy bench`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

from ..bf16 import bf16_array, f32_to_bf16_bits
from ..errors import GlmVitError
from .checkpoint import INDEX_FILE, SINGLE_FILE
from .geometry import CONFIG_FILE, REAL, GlmVitGeometry, vision_config
from .weights import BLOCK_TENSORS, stored_shapes, tower_shapes
from .writer import atomic_directory, write_safetensors

GEOMETRIES = {
    "real": GlmVitGeometry(**REAL),
    # Small enough for CI's CPU, shaped like the real tower (head_dim 64, every width a
    # multiple of 8 so the GPU engine runs it too).
    "tiny": GlmVitGeometry(**{**REAL, "depth": 2, "hidden_size": 128, "num_heads": 2, "intermediate_size": 256,
                              "out_hidden_size": 256, "projection_intermediate_size": 512}),
}
EXPORTS = {  # what a released checkpoint may be an export of
    # name: (tensor prefix, config model_type, sharded, decoys)
    "full": ("model.visual", "glm5_next", True, True),
    "nested": ("model.language_model.visual", "glm5_next", False, True),
    "vision-only": ("visual", "glm5_next_vision", False, False),
}
_NORMS = ("norm1.weight", "norm2.weight", "q_norm.weight", "k_norm.weight",
          "post_layernorm.weight", "post_projection_norm.weight")


def _tower_values(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]],
                  stored: dict[str, tuple[tuple[int, ...], ...]]) -> Iterator[np.ndarray]:
    """Each tower tensor's BF16 values in `shapes`' order, in the shape transformers stores."""
    for name, shape in shapes.items():
        noise = rng.standard_normal(math.prod(shape), dtype=np.float32)
        values = 1.0 + 0.1 * noise if name.endswith(_NORMS) else 0.02 * noise
        yield bf16_array(f32_to_bf16_bits(values)).reshape(stored[name][0])


def _decoys(decoy_bytes: int) -> list[tuple[str, np.dtype, tuple[int, int]]]:
    """Text-stack tensors of an NVFP4 export: U8-packed weights, F8_E4M3 scales, BF16 embeds."""
    cols = 512
    rows = max(1, decoy_bytes // cols)
    u8, f8, bf16 = np.dtype(np.uint8), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.bfloat16)
    return [
        ("model.language_model.embed_tokens.weight", bf16, (rows // 2, cols)),
        ("model.language_model.layers.0.mlp.experts.gate_up_proj.weight", u8, (rows, cols)),
        ("model.language_model.layers.0.mlp.experts.gate_up_proj.weight_scale", f8, (rows, cols // 16)),
        ("model.language_model.layers.1.mlp.experts.down_proj.weight", u8, (rows, cols)),
        ("model.language_model.layers.1.mlp.experts.down_proj.weight_scale", f8, (rows, cols // 16)),
        ("lm_head.weight", bf16, (rows // 2, cols)),
    ]


def write_checkpoint(out_dir: str | Path, geometry: str | GlmVitGeometry = "real", seed: int = 0,
                     export: str = "full", decoy_bytes: int | None = None, replace: bool = False) -> Path:
    """Write a checkpoint for `geometry`, in the form of an EXPORTS export, into the new (or
    empty) directory `out_dir`, or with
    `replace` over a checkpoint directory there: all of it or, on any failure (a full disk),
    nothing, the old one left as it was (writer.atomic_directory)."""
    geo = GEOMETRIES[geometry] if isinstance(geometry, str) else geometry
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        is_checkpoint = (out / CONFIG_FILE).is_file() and any((out / f).is_file() for f in (INDEX_FILE, SINGLE_FILE))
        if not is_checkpoint or out.is_symlink():
            raise GlmVitError(f"{out}: exists and is not an empty directory nor a checkpoint; refusing to "
                              "write a checkpoint there")
        if not replace:
            raise GlmVitError(f"{out}: already holds a checkpoint; pass --force to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GlmVitError(f"{out}: cannot create directory {out.parent}: {exc.strerror}") from None
    with atomic_directory(out, replace=replace) as tmp:
        _fill_checkpoint(tmp, geo, seed, export, decoy_bytes)
    return out


def _fill_checkpoint(out: Path, geo: GlmVitGeometry, seed: int, export: str, decoy_bytes: int | None) -> None:
    prefix, model_type, sharded, with_decoys = EXPORTS[export]
    rng = np.random.default_rng(seed)
    shapes = tower_shapes(geo)
    tower = [f"{prefix}.{n}" for n in shapes]
    tower_values = _tower_values(rng, shapes, stored_shapes(geo))
    if decoy_bytes is None:
        decoy_bytes = 32 << 20 if geo.hidden_size >= 1024 else 1 << 20
    decoys = {name: (dtype, shape) for name, dtype, shape in _decoys(decoy_bytes)} if with_decoys else {}

    def tensors(names: list[str]) -> dict[str, np.ndarray]:
        """Each tensor's values, drawn in this order: tower tensors from the one tower stream."""
        arrays = {}
        for name in names:
            if name in decoys:
                dtype, shape = decoys[name]
                raw = rng.integers(0, 256, math.prod(shape) * dtype.itemsize, np.uint8)
                arrays[name] = raw.view(dtype).reshape(shape)
            else:
                arrays[name] = next(tower_values)
        return arrays

    config = vision_config(geo)
    if model_type == "glm5_next":
        config = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                  "text_config": {"model_type": "glm5_next_text", "hidden_size": 4096,
                                  "num_hidden_layers": 2, "vocab_size": 154880},
                  "vision_config": config, "dtype": "bfloat16", "image_token_id": 154854}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    text = list(decoys)
    if not sharded:
        write_safetensors(out / SINGLE_FILE, tensors(text[:3] + tower + text[3:]))
        return

    # Three shards: the tower split across the first two, each beside text-stack decoys, and a
    # third holding only text-stack tensors (the binder must not even open it).
    half = (geo.depth // 2) * len(BLOCK_TENSORS)
    groups = [text[:3] + tower[:half], tower[half:] + text[3:5], text[5:]]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for fname, group in zip(names, groups):
        total += write_safetensors(out / fname, tensors(group))
        weight_map.update({name: fname for name in group})
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": weight_map}, indent=2) + "\n")


def photo_like(height: int, width: int, seed: int = 0) -> np.ndarray:
    """An HxWx3 uint8 image with the statistics of a photo: smooth gradients, soft blobs,
    edges and sensor noise (not uniform noise, which no camera produces)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y /= max(height - 1, 1)
    x /= max(width - 1, 1)
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        a, b, d = rng.uniform(-1, 1, 3)
        img[..., c] = 0.5 + 0.25 * (a * x + b * y) + 0.1 * np.sin(6.28 * (d * x + 2 * y))
    for _ in range(6):
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        blob = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))
        img += blob[..., None] * rng.uniform(-0.4, 0.4, 3)
    img[(x + 0.3 * y) % 0.37 < 0.02] *= 0.3  # a few hard edges
    img += rng.normal(0, 0.02, img.shape)
    return (np.clip(img, 0, 1) * 255).round().astype(np.uint8)
