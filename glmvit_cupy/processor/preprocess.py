"""Images -> (pixel_values, grid_thw), exactly as transformers' `Glm5NextImageProcessorPil`.

A path (or an `EncodedImage`, a file's bytes) is opened as transformers' `load_image` opens a path:
Pillow's first frame, `ImageOps.exif_transpose`, then `convert("RGB")`, which drops alpha
rather than compositing it. A PIL image or an array goes to the processor as it is.
`ProcessorConfig` holds every setting the processor takes from a `preprocessor_config.json`;
`processor_config` reads that file beside the weights, options overriding it.

Two halves, so that the collection pipeline can run the first in worker processes and the
second on the GPU (`cuda_src/patchify.cu`) from 1 byte a value instead of 4:
- `canvas`: convert to RGB (transparency composited onto white) -> `smart_resize` picks a
  canvas aligned to 28 px inside the token budget -> PIL resize of the content (bicubic unless
  `resample` says otherwise), zero padding on the bottom/right, on raw uint8 pixels: uint8
  [H, W, 3].
- `patchify`: each uint8 value v of channel c becomes `pixel_table()[c, v]`, which is
  (float32(float64(v) x 1/255) - mean[c]) / std[c] in float32, the oracle's own arithmetic
  tabulated (so the result matches it bit for bit) -> block-major patches, each (C, T, 14, 14)
  with the single frame repeated T = 2 times. grid_thw = (1, H/14, W/14).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import re
import threading
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Sequence, Union

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import GlmVitError
from ..tower.geometry import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS, REAL, GlmVitGeometry

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# What encode, submit and preprocess take: a path, a file's bytes (bytes, an open binary file,
# io.BytesIO, an upload), a decoded image, or the bytes named for messages (EncodedImage).
ImageLike = Union[str, Path, bytes, bytearray, memoryview, BinaryIO, Image.Image, np.ndarray, "EncodedImage"]
PREPROCESSOR_FILE = "preprocessor_config.json"  # the processor's settings, beside the weights


@dataclasses.dataclass(frozen=True)
class ProcessorConfig:
    """The image processor's settings: every field Glm5NextImageProcessorPil takes from a
    preprocessor_config.json, with its class defaults. (`size` and `patch_expand_factor` are
    accepted there too, and ignored by its resize and patchify alike.)"""

    patch_size: int = REAL["patch_size"]  # the processor's defaults are the released tower's
    temporal_patch_size: int = REAL["temporal_patch_size"]
    merge_size: int = REAL["spatial_merge_size"]
    min_image_tokens: int = MIN_IMAGE_TOKENS
    max_image_tokens: int = MAX_IMAGE_TOKENS
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    resample: int = int(Image.Resampling.BICUBIC)  # a PIL resampling filter, 0-5
    do_resize: bool = True  # False: the image must already be an aligned canvas
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        check_shared_fields(self, "processor", ("patch_size", "temporal_patch_size", "merge_size", "min_image_tokens",
                                                "max_image_tokens"), ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"))
        if self.resample not in {int(r) for r in Image.Resampling} or isinstance(self.resample, bool):
            raise GlmVitError(f"processor: resample {self.resample!r} is not a PIL resampling filter "
                              f"({', '.join(f'{int(r)} {r.name.lower()}' for r in Image.Resampling)})")
        if not isinstance(self.rescale_factor, float):
            raise GlmVitError(f"processor: rescale_factor {self.rescale_factor!r} must be a number")

    @property
    def factor(self) -> int:
        """Canvas sides are multiples of this (28: a 2x2 block of 14-pixel patches)."""
        return self.patch_size * self.merge_size


FIELDS = tuple(f.name for f in dataclasses.fields(ProcessorConfig))


def check_shared_fields(config: Any, who: str, integers: Sequence[str], flags: Sequence[str]) -> None:
    """The checks the image and the video processor's settings share: positive integers, a token
    budget that is not empty, 3 floats of mean and of std (no zero std), true/false flags."""
    for name in integers:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GlmVitError(f"{who}: {name} {value!r} must be a positive integer")
    if config.max_image_tokens < config.min_image_tokens:
        raise GlmVitError(f"{who}: image token budget [{config.min_image_tokens}, {config.max_image_tokens}] is empty")
    for name in ("image_mean", "image_std"):
        value = getattr(config, name)
        if not (isinstance(value, tuple) and len(value) == 3 and all(isinstance(v, float) for v in value)):
            raise GlmVitError(f"{who}: {name} {value!r} must be 3 floats (one per RGB channel)")
    if 0.0 in config.image_std:
        raise GlmVitError(f"{who}: image_std {list(config.image_std)} has a zero")
    for name in flags:
        if not isinstance(getattr(config, name), bool):
            raise GlmVitError(f"{who}: {name} {getattr(config, name)!r} must be true or false")


def _field_value(name: str, value: Any) -> Any:
    """A preprocessor_config.json value in ProcessorConfig's type, as the processor reads it:
    a single mean/std applies to every channel; numbers may be written as either JSON kind."""
    if name in ("image_mean", "image_std"):
        values = value if isinstance(value, (list, tuple)) else [value] * 3
        return tuple(float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in values)
    if name == "rescale_factor" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if name in ("patch_size", "temporal_patch_size", "merge_size", "min_image_tokens", "max_image_tokens",
                "resample") and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _check_names(settings: dict[str, Any]) -> None:
    unknown = sorted(set(settings) - set(FIELDS))
    if unknown:
        raise GlmVitError(f"processor: unknown setting(s) {', '.join(unknown)} (known: {', '.join(FIELDS)})")


def with_settings(config: ProcessorConfig, **settings: Any) -> ProcessorConfig:
    """`config` with each setting that is not None in its place (written as in the JSON file)."""
    _check_names(settings)
    return dataclasses.replace(config, **{k: _field_value(k, v) for k, v in settings.items() if v is not None})


def processor_config(model_dir: str | Path | None = None,
                     **overrides: Any) -> tuple[ProcessorConfig, dict[str, str]]:
    """The processor's settings for the model in `model_dir`: its preprocessor_config.json where
    there is one, then each override that is not None. Returns (config, field -> "default" | "preprocessor_config.json" |
    "option")."""
    _check_names(overrides)
    path = Path(model_dir) / PREPROCESSOR_FILE if model_dir is not None else None
    file = read_json_object(path) if path is not None and path.is_file() else {}
    values, sources = settings_from(file, PREPROCESSOR_FILE, path, FIELDS, _field_value, overrides)
    try:
        return ProcessorConfig(**values), sources
    except GlmVitError as exc:
        where = path if path is not None and any(s == PREPROCESSOR_FILE for s in sources.values()) else "options"
        raise GlmVitError(f"{where}: {exc}") from None


def read_json_object(path: Path) -> dict:
    """A processor config file's JSON object; anything else is one line naming the file."""
    try:
        file = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GlmVitError(f"{path}: cannot read the processor config: {exc}") from None
    if not isinstance(file, dict):
        raise GlmVitError(f"{path}: holds a {type(file).__name__}, not an object")
    return file


def settings_from(file: dict, where: str, path: Path | None, fields: Sequence[str], convert: Any,
                  overrides: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, field -> "default" | `where` | "option"): each of `fields` the config `file` (read
    from `path`) sets, then each override that is not None, in the config class's types (`convert`)."""
    values: dict[str, Any] = {}
    sources = dict.fromkeys(fields, "default")
    for name in fields:
        if name not in file:
            continue
        if file[name] is None and not name.startswith("do_"):
            raise GlmVitError(f"{path}: {name} is null, on which transformers' processor fails: "
                              "give a value or leave the field out")
        # A null do_ flag is false to transformers (an `if` on None), not the default.
        values[name] = False if file[name] is None else convert(name, file[name])
        sources[name] = where
    for name, value in overrides.items():
        if value is not None:
            values[name] = convert(name, value)
            sources[name] = "option"
    return values, sources


def check_processor(processor: ProcessorConfig, geo: GlmVitGeometry) -> None:
    """The processor must cut the patches the tower embeds (transformers would fail later, on a
    shape mismatch inside the model)."""
    fields = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
              ("merge_size", "spatial_merge_size"))
    for processor_field, geometry_field in fields:
        cut, embedded = getattr(processor, processor_field), getattr(geo, geometry_field)
        if cut != embedded:
            raise GlmVitError(f"processor {processor_field} {cut} disagrees with the tower's {geometry_field} "
                              f"{embedded} (config.json): fix preprocessor_config.json or the option")


def smart_resize(height: int, width: int, *, factor: int, temporal_factor: int,
                 min_image_tokens: int = MIN_IMAGE_TOKENS,
                 max_image_tokens: int = MAX_IMAGE_TOKENS, frames: int | None = None) -> tuple[int, int]:
    """The aligned canvas (H, W) for one image, or for every frame of a video of `frames`
    frames (one budget for the whole video), the oracle's binary search included."""
    pixels_per_token = temporal_factor * factor ** 2
    min_pixels = min_image_tokens * pixels_per_token
    max_pixels = max_image_tokens * pixels_per_token
    if frames is None:
        frames = temporal_factor  # a still image is one frame repeated temporal_factor times

    def align(value: float) -> int:
        return math.ceil(value / factor) * factor

    aligned_frames = max(temporal_factor, round(frames / temporal_factor) * temporal_factor)
    out_h, out_w = align(height), align(width)
    if aligned_frames * out_h * out_w < min_pixels:
        scale = math.sqrt(min_pixels / (frames * height * width))
        out_h = align(max(1, math.ceil(height * scale)))
        out_w = align(max(1, math.ceil(width * scale)))
    if aligned_frames * out_h * out_w > max_pixels:
        if max_pixels < aligned_frames * factor ** 2:
            raise GlmVitError(f"max_image_tokens {max_image_tokens} is below one aligned patch")
        low, high = 1, height
        out_h, out_w = factor, factor
        while low <= high:  # the tallest content height whose aligned canvas fits the budget
            content_h = (low + high) // 2
            content_w = max(1, math.floor(width * content_h / height))
            cand_h, cand_w = align(content_h), align(content_w)
            if aligned_frames * cand_h * cand_w <= max_pixels:
                out_h, out_w = cand_h, cand_w
                low = content_h + 1
            else:
                high = content_h - 1
    return out_h, out_w


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """The bytes of an image file (from a tar shard, a request body), named for messages; read
    exactly as the same file on disk would be."""

    name: str
    data: bytes


def image_input(image: Any, name: str) -> Any:
    """An input as a worker takes it: bytes and file-like objects (read here, in the caller: that
    is I/O, not decoding) become an EncodedImage named `name` (or the file's own name); a path,
    a PIL image or an array is passed as it is. Any other type is refused in one line."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return EncodedImage(name, bytes(image))
    if hasattr(image, "read") and not isinstance(image, Image.Image):
        try:
            data = image.read()
        except (OSError, ValueError) as exc:
            raise GlmVitError(f"{name}: cannot read the file object: {exc}") from None
        if not isinstance(data, (bytes, bytearray)):
            raise GlmVitError(f"{name}: the file object gave {type(data).__name__}, not bytes (open it in 'rb' mode)")
        return EncodedImage(str(getattr(image, "name", name)), bytes(data))
    if not isinstance(image, (str, Path, Image.Image, np.ndarray, EncodedImage)):
        raise GlmVitError(f"{name}: cannot encode a {type(image).__name__}: pass a path, bytes, a file object, "
                          "a PIL image or an HxWx3 uint8 array")
    return image


def load_rgb(image: ImageLike, convert_rgb: bool = True) -> Image.Image:
    """Any accepted input as the RGB PIL image the processor works on; file errors become
    one-line GlmVitErrors. `convert_rgb` is the processor's do_convert_rgb."""
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise GlmVitError(f"image array has shape {list(image.shape)} and dtype {image.dtype}, "
                              "expected HxWx3 uint8")
        return Image.fromarray(np.ascontiguousarray(image))
    if isinstance(image, (str, Path, EncodedImage)):
        image = open_image(image)
    elif not isinstance(image, Image.Image):
        raise GlmVitError(f"cannot encode a {type(image).__name__}: pass a path, a PIL image or an "
                          "HxWx3 uint8 array")
    if convert_rgb:
        return _to_rgb(image)
    if image.mode != "RGB":
        raise GlmVitError(f"a {image.mode} image with do_convert_rgb false: the tower takes 3 channels")
    return image


def open_image(image: str | Path | EncodedImage) -> Image.Image:
    """A file (or its bytes) as transformers' load_image opens it: the first frame of a
    multi-frame file, turned upright by its EXIF orientation, then PIL's own convert("RGB")
    (alpha dropped)."""
    name, file = (image.name, io.BytesIO(image.data)) if isinstance(image, EncodedImage) else (image, Path(image))
    try:
        with _open_guarded(file) as opened:
            upright = ImageOps.exif_transpose(opened)  # decodes now: a truncated file fails here
            return upright.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        found = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{int(found.group(1)):,} pixels" if found else str(exc)
        raise GlmVitError(
            f"{name}: {size}, over PIL's decompression-bomb limit of {Image.MAX_IMAGE_PIXELS:,} "
            "(PIL.Image.MAX_IMAGE_PIXELS): downscale the image, or for a file you trust raise "
            "that limit (None lifts it)") from None
    except FileNotFoundError:
        raise GlmVitError(f"{name}: no such image file") from None
    except UnidentifiedImageError:
        empty = not image.data if isinstance(image, EncodedImage) else _size(Path(image)) == 0
        raise GlmVitError(f"{name}: {'empty file (0 bytes)' if empty else 'not an image PIL can decode'}") from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise GlmVitError(f"{name}: cannot decode image: {exc}") from None


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


_WARNING_FILTERS = threading.Lock()


def _open_guarded(file: Path | io.BytesIO) -> Image.Image:
    """Image.open with PIL's decompression-bomb warning (an image over MAX_IMAGE_PIXELS, which
    PIL would decode anyway) raised as an error; over twice that PIL raises by itself. Opening
    reads only the header. The lock: warnings.catch_warnings swaps process-wide state, so
    two loader threads must not interleave it."""
    with _WARNING_FILTERS, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        return Image.open(file)


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: alpha (or a transparency key) is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def canvas(image: ImageLike, config: ProcessorConfig = ProcessorConfig()) -> np.ndarray:
    """Decode, resize the content and zero-pad it onto the aligned canvas: uint8 [H, W, 3]."""
    image = load_rgb(image, config.do_convert_rgb)
    factor, temporal = config.factor, config.temporal_patch_size
    width, height = image.size
    if not config.do_resize:
        if height % factor or width % factor:
            raise GlmVitError(f"a {width}x{height} image with do_resize false: both sides must be "
                              f"multiples of {factor} (patch_size x merge_size)")
        return np.asarray(image, dtype=np.uint8)
    target_h, target_w = smart_resize(height, width, factor=factor, temporal_factor=temporal,
                                      min_image_tokens=config.min_image_tokens,
                                      max_image_tokens=config.max_image_tokens)
    content_h, content_w = content_size(height, width, target_h, target_w,
                                        enlarge=temporal * height * width < temporal * factor ** 2 * config.min_image_tokens)
    if (content_h, content_w) != (height, width):
        image = image.resize((content_w, content_h), resample=config.resample)
    out = np.zeros((target_h, target_w, 3), dtype=np.uint8)
    out[:content_h, :content_w] = np.asarray(image, dtype=np.uint8)
    return out


def content_size(height: int, width: int, target_h: int, target_w: int, enlarge: bool) -> tuple[int, int]:
    """The content's (height, width) on its aligned canvas: the aspect-keeping scale that fits
    the canvas, never above 1 unless `enlarge` (the input is below the minimum token budget);
    the rest of the canvas is zero padding."""
    scale = min(target_h / height, target_w / width)
    if not enlarge:
        scale = min(1.0, scale)
    return max(1, min(target_h, math.floor(height * scale))), max(1, min(target_w, math.floor(width * scale)))


def canvas_grid(shape: Sequence[int], config: ProcessorConfig = ProcessorConfig()) -> tuple[int, int, int]:
    """grid_thw of a canvas of this [H, W, 3] shape, (1, H / patch, W / patch); or of a video's
    frames on their canvas [T, H, W, 3], (T / temporal_patch_size, H / patch, W / patch)."""
    groups = shape[0] // config.temporal_patch_size if len(shape) == 4 else 1
    return groups, shape[-3] // config.patch_size, shape[-2] // config.patch_size


@functools.lru_cache(maxsize=8)
def pixel_table(config: ProcessorConfig = ProcessorConfig()) -> np.ndarray:
    """float32 [3, 256]: the normalised value of each uint8 value of each channel, computed
    with the oracle's arithmetic (x rescale_factor in float64, cast to float32, then
    (x - mean) / std in float32; each step only where its do_ flag says). The GPU's patchify
    reads the same table."""
    values = np.arange(256)
    if config.do_rescale:
        scaled = (values.astype(np.float64) * config.rescale_factor).astype(np.float32)
    else:
        scaled = values.astype(np.float32)
    table = np.repeat(scaled[None, :], 3, axis=0)
    if config.do_normalize:
        mean = np.array(config.image_mean, dtype=np.float32)[:, None]
        std = np.array(config.image_std, dtype=np.float32)[:, None]
        table = (table - mean) / std
    table.flags.writeable = False
    return table


def patchify(canvas: np.ndarray, config: ProcessorConfig = ProcessorConfig()) -> np.ndarray:
    """uint8 canvas [H, W, 3] -> float32 pixel_values [gh*gw, C*T*patch*patch], block-major."""
    patch, merge, temporal = config.patch_size, config.merge_size, config.temporal_patch_size
    height, width, channels = canvas.shape
    gh, gw = height // patch, width // patch
    values = pixel_table(config)[np.arange(channels), canvas]  # [H, W, C] float32
    blocks = values.reshape(gh // merge, merge, patch, gw // merge, merge, patch, channels)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, m, m, C, p, p)
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (temporal, patch, patch))
    return blocks.reshape(gh * gw, channels * temporal * patch * patch)


def image_list(images: ImageLike | Sequence[ImageLike]) -> list:
    """One image or a sequence of them, as a list (anything else is one item, which load_rgb
    then refuses by type)."""
    if isinstance(images, (str, Path, np.ndarray, bytes, bytearray, memoryview)) or not isinstance(images, Sequence):
        return [images]
    return list(images)


def preprocess(images: ImageLike | Sequence[ImageLike], config: ProcessorConfig | None = None,
               **settings) -> tuple[np.ndarray, np.ndarray]:
    """One image or a list -> (pixel_values float32 [P, 1176], grid_thw int64 [N, 3]).
    `settings` override fields of `config` (default: the processor's defaults)."""
    config = with_settings(config or ProcessorConfig(), **settings)
    images = image_list(images)
    if len(images) == 0:
        raise GlmVitError("no images to preprocess")
    canvases = [canvas(image_input(image, f"image {i}"), config) for i, image in enumerate(images)]
    pixels = np.concatenate([patchify(c, config) for c in canvases])
    return pixels, np.array([canvas_grid(c.shape, config) for c in canvases], dtype=np.int64)
