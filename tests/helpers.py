"""Test helpers: photo-like images, tolerances, and the transformers oracle (test-only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PREFIX = "model.visual."


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


def rel_err(a, b) -> float:
    """Relative Frobenius error |a - b| / |b|, in float64."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


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
