"""`GlmVitGeometry`: the tower's shape, read from config.json and validated once.

Everything the engines need that is not a weight lives here, with the derived sizes
(head_dim, patch_dim) computed once. The patch budget of one forward call is not the
model's shape but an engine's choice (`patch_budget`): several engines with different
budgets can share one bound checkpoint. The constructor refuses a geometry the math or the
kernels cannot run, and each refusal names the numbers.

config.json comes in two forms: the full GLM-5.3-Flash model (`model_type` glm5_next,
the tower under a nested `vision_config`) and a vision-only export (`model_type`
glm5_next_vision). A field the file leaves out takes the released checkpoint's value,
NOT transformers' `Glm5NextVisionConfig()` default: that class says out_hidden 1536 where
the released tower (and NeMo) use 4096.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import GlmVitError

# The released GLM-5.3-Flash tower (`model.visual.*`): the fallback for absent fields.
REAL: dict[str, Any] = dict(
    depth=24,
    hidden_size=1024,
    num_heads=16,
    intermediate_size=4096,
    in_channels=3,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=4096,
    projection_intermediate_size=10240,
    rms_norm_eps=1e-5,
    swiglu_limit=10.0,
    rope_theta=10000.0,
)

CONFIG_FILE = "config.json"

# The processor's default token budget (merged tokens per image); a preprocessor_config.json or an
# option overrides it, and the default patch budget (patch_budget) follows the processor in force.
MIN_IMAGE_TOKENS = 16
MAX_IMAGE_TOKENS = 8000

# config.json spellings transformers maps onto the vision config's own names.
_ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth"}


@dataclasses.dataclass(frozen=True)
class GlmVitGeometry:
    """The tower's shape (the fields of a vision config.json); validated on construction."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    projection_intermediate_size: int
    rms_norm_eps: float
    swiglu_limit: float
    rope_theta: float

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "in_channels",
                     "out_hidden_size", "projection_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise GlmVitError(f"geometry: {name} {value!r} must be a positive integer")
        if self.num_heads <= 0 or self.hidden_size % self.num_heads:
            raise GlmVitError(
                f"geometry: hidden_size {self.hidden_size} is not divisible by num_heads "
                f"{self.num_heads}")
        if self.head_dim % 4:
            raise GlmVitError(
                f"geometry: head_dim {self.head_dim} (hidden_size {self.hidden_size} / num_heads "
                f"{self.num_heads}) must be a multiple of 4: the axial RoPE splits it into an h "
                "half and a w half, and rotate-half then halves each")
        if self.spatial_merge_size != 2:
            raise GlmVitError(
                f"geometry: spatial_merge_size {self.spatial_merge_size}: the 2x2 conv downsample "
                "and its im2col are written for 2 and only 2")
        if self.patch_size <= 0 or self.temporal_patch_size <= 0:
            raise GlmVitError(
                f"geometry: patch_size {self.patch_size} and temporal_patch_size "
                f"{self.temporal_patch_size} must be non-zero")
        for name in ("rms_norm_eps", "swiglu_limit", "rope_theta"):
            if not getattr(self, name) > 0:
                raise GlmVitError(f"geometry: {name} {getattr(self, name)!r} must be positive")

    # Derived sizes, computed from the fields, never stored twice.
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """C x T x patch^2: 1176 for GLM (3 x 2 x 14^2), the width of one pixel_values row."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per merged token (4: one 2x2 block)."""
        return self.spatial_merge_size ** 2


def patch_budget(geo: GlmVitGeometry, max_pixels: int | None = None,
                 max_image_tokens: int = MAX_IMAGE_TOKENS) -> int:
    """Patch rows one forward call of an engine may carry (p_max; every GPU buffer is sized
    for it) for a pixel budget of all images together. Default: one image of the largest size
    the processor in force makes (its max_image_tokens merged tokens)."""
    pixels = max_pixels if max_pixels is not None else max_image_tokens * geo.merge_unit * geo.patch_size ** 2
    patches = pixels // geo.patch_size ** 2
    p_max = patches - patches % geo.merge_unit
    if p_max < geo.merge_unit:
        raise GlmVitError(
            f"max_pixels {max_pixels} admits {p_max} patches of {geo.patch_size}x{geo.patch_size}; "
            f"at least {geo.merge_unit} (one merged token) are needed")
    return p_max


def check_patch_budget(geo: GlmVitGeometry, patches: int, p_max: int, what: str) -> None:
    """The budget refusal, the same for every engine and stager: `what` (an image, a batch) needs
    `patches` patch rows and one forward call carries at most p_max."""
    if patches > p_max:
        px = geo.patch_size ** 2
        raise GlmVitError(
            f"{what}: {patches} patches exceed p_max {p_max} (max_pixels {p_max * px}); raise max_pixels to at "
            f"least {patches * px} (--max-pixels, or GlmVit.from_pretrained(max_pixels=...))")


def _int_field(cfg: dict[str, Any], name: str, where: str) -> Any:
    value = cfg.get(name, REAL[name])
    if isinstance(value, (list, tuple)):  # patch_size may be written [14, 14]
        if len(set(value)) != 1:
            raise GlmVitError(f"{where}: {name} {list(value)} must be square (one size for both axes)")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise GlmVitError(f"{where}: {name} {value!r} is not an integer")
    return int(value)


def geometry_from_vision_config(vision: dict[str, Any], where: str) -> GlmVitGeometry:
    """Build the geometry from a vision config dict (the nested one or a vision-only file)."""
    cfg = dict(vision)
    for alias, name in _ALIASES.items():
        if alias in cfg and name not in cfg:
            cfg[name] = cfg[alias]
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise GlmVitError(f"{where}: hidden_act {act!r}: the tower's clamped SwiGLU is written for silu")
    if cfg.get("attention_bias", True) is not True:
        raise GlmVitError(f"{where}: attention_bias false: GLM-5.3's tower carries qkv/proj/mlp biases")
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise GlmVitError(f"{where}: rope_type {rope.get('rope_type')!r}: the tower uses axial 2D RoPE")
    theta = rope.get("rope_theta", cfg.get("rope_theta", REAL["rope_theta"]))
    ints = {name: _int_field(cfg, name, where) for name in (
        "depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
        "temporal_patch_size", "spatial_merge_size", "out_hidden_size",
        "projection_intermediate_size")}
    try:
        floats = dict(rms_norm_eps=float(cfg.get("rms_norm_eps", REAL["rms_norm_eps"])),
                      swiglu_limit=float(cfg.get("swiglu_limit", REAL["swiglu_limit"])),
                      rope_theta=float(theta))
    except (TypeError, ValueError) as exc:
        raise GlmVitError(f"{where}: a float field does not parse: {exc}") from None
    try:
        return GlmVitGeometry(**ints, **floats)
    except GlmVitError as exc:
        raise GlmVitError(f"{where}: {exc}") from None


def vision_config(geo: GlmVitGeometry) -> dict:
    """The geometry as a vision-only config.json (model_type glm5_next_vision), every field
    spelled out: a reader's own defaults never apply (transformers' out_hidden_size is not the
    released tower's)."""
    return {
        "model_type": "glm5_next_vision", "depth": geo.depth, "hidden_size": geo.hidden_size,
        "num_heads": geo.num_heads, "intermediate_size": geo.intermediate_size,
        "in_channels": geo.in_channels, "patch_size": geo.patch_size,
        "temporal_patch_size": geo.temporal_patch_size,
        "spatial_merge_size": geo.spatial_merge_size, "out_hidden_size": geo.out_hidden_size,
        "projection_intermediate_size": geo.projection_intermediate_size,
        "rms_norm_eps": geo.rms_norm_eps, "swiglu_limit": geo.swiglu_limit,
        "rope_parameters": {"rope_type": "axial", "rope_theta": geo.rope_theta},
        "hidden_act": "silu", "attention_bias": True, "attention_dropout": 0.0,
        "image_size": 448, "initializer_range": 0.02,
    }


def load_geometry(model_dir: str | Path) -> GlmVitGeometry:
    """Read `model_dir/config.json` in either form; refuse text-only and foreign configs."""
    path = Path(model_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise GlmVitError(f"{path}: no config.json (is {model_dir} a checkpoint directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GlmVitError(f"{path}: cannot read config.json: {exc}") from None
    if not isinstance(config, dict):
        raise GlmVitError(f"{path}: config.json holds a {type(config).__name__}, not an object")
    model_type = config.get("model_type")
    if model_type == "glm5_next_vision":
        return geometry_from_vision_config(config, str(path))
    vision = config.get("vision_config")
    if isinstance(vision, dict):
        return geometry_from_vision_config(vision, f"{path} (vision_config)")
    if model_type in ("glm5_next", "glm5_next_text"):
        raise GlmVitError(
            f"{path}: a text-only GLM-5.3 checkpoint (model_type {model_type}, no vision_config): "
            "it has no vision tower to encode images with")
    raise GlmVitError(
        f"{path}: model_type {model_type!r} is not a GLM-5.3 model with a vision tower "
        "(expected glm5_next with a vision_config, or glm5_next_vision)")
