"""Images -> (pixel_values, grid_thw), exactly as transformers' `Glm5NextImageProcessorPil`.

Steps, each in the oracle's own arithmetic so the output matches it bit for bit:
convert to RGB (transparency composited onto white) -> `smart_resize` picks a canvas aligned
to 28 px inside the token budget -> PIL bicubic resize of the content, zero padding on the
bottom/right on raw uint8 pixels -> x (1/255) in float64, cast to float32 -> normalise with
the CLIP mean/std in float32 -> patchify block-major, each patch (C, T, 14, 14) with the
single frame repeated T = 2 times. grid_thw = (1, H/14, W/14).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence, Union

import numpy as np
from PIL import Image, UnidentifiedImageError

from .errors import GlmVitError
from .geometry import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

ImageLike = Union[str, Path, Image.Image, np.ndarray]


def smart_resize(height: int, width: int, *, factor: int = 28, temporal_factor: int = 2,
                 min_image_tokens: int = MIN_IMAGE_TOKENS,
                 max_image_tokens: int = MAX_IMAGE_TOKENS) -> tuple[int, int]:
    """The aligned canvas (H, W) for one image, the oracle's binary search included."""
    pixels_per_token = temporal_factor * factor ** 2
    min_pixels = min_image_tokens * pixels_per_token
    max_pixels = max_image_tokens * pixels_per_token
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


def load_rgb(image: ImageLike) -> Image.Image:
    """Any accepted input as an RGB PIL image; file errors become one-line GlmVitErrors."""
    if isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise GlmVitError(f"image array has shape {list(image.shape)} and dtype {image.dtype}, "
                              "expected HxWx3 uint8")
        return Image.fromarray(np.ascontiguousarray(image))
    if isinstance(image, (str, Path)):
        path = Path(image)
        try:
            with Image.open(path) as opened:
                opened.load()  # decode now, so a truncated file fails here, by name
                return _to_rgb(opened)
        except FileNotFoundError:
            raise GlmVitError(f"{path}: no such image file") from None
        except UnidentifiedImageError:
            raise GlmVitError(f"{path}: not an image PIL can decode") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise GlmVitError(f"{path}: cannot decode image: {exc}") from None
    if isinstance(image, Image.Image):
        return _to_rgb(image)
    raise GlmVitError(f"cannot encode a {type(image).__name__}: pass a path, a PIL image or an "
                      "HxWx3 uint8 array")


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: alpha (or a transparency key) is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _canvas(image: Image.Image, factor: int, temporal: int, min_tokens: int,
            max_tokens: int) -> np.ndarray:
    """Resize the content and zero-pad it onto the aligned canvas: uint8 [3, H, W]."""
    width, height = image.size
    target_h, target_w = smart_resize(height, width, factor=factor, temporal_factor=temporal,
                                      min_image_tokens=min_tokens, max_image_tokens=max_tokens)
    scale = min(target_h / height, target_w / width)
    if temporal * height * width >= temporal * factor ** 2 * min_tokens:
        scale = min(1.0, scale)  # only images below the minimum budget are ever enlarged
    content_h = max(1, min(target_h, math.floor(height * scale)))
    content_w = max(1, min(target_w, math.floor(width * scale)))
    if (content_h, content_w) != (height, width):
        image = image.resize((content_w, content_h), resample=Image.BICUBIC)
    pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)
    return np.pad(pixels, ((0, 0), (0, target_h - content_h), (0, target_w - content_w)))


def _patchify(image: np.ndarray, patch: int, merge: int, temporal: int) -> tuple[np.ndarray, int, int]:
    """float32 [C, H, W] -> [gh*gw, C*T*patch*patch] in block-major order."""
    channels, height, width = image.shape
    gh, gw = height // patch, width // patch
    blocks = image.reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], blocks.shape[:5] + (temporal, patch, patch))
    return blocks.reshape(gh * gw, channels * temporal * patch * patch), gh, gw


def preprocess(images: ImageLike | Sequence[ImageLike], *, patch_size: int = 14,
               temporal_patch_size: int = 2, merge_size: int = 2,
               min_image_tokens: int = MIN_IMAGE_TOKENS,
               max_image_tokens: int = MAX_IMAGE_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """One image or a list -> (pixel_values float32 [P, 1176], grid_thw int64 [N, 3])."""
    if isinstance(images, (str, Path, Image.Image, np.ndarray)):
        images = [images]
    if len(images) == 0:
        raise GlmVitError("no images to preprocess")
    if min_image_tokens < 1 or max_image_tokens < min_image_tokens:
        raise GlmVitError(f"image token budget [{min_image_tokens}, {max_image_tokens}] is empty")
    mean = np.array(CLIP_MEAN, dtype=np.float32)[:, None, None]
    std = np.array(CLIP_STD, dtype=np.float32)[:, None, None]
    rows, grids = [], []
    for image in images:
        canvas = _canvas(load_rgb(image), patch_size * merge_size, temporal_patch_size,
                         min_image_tokens, max_image_tokens)
        scaled = (canvas.astype(np.float64) * (1 / 255)).astype(np.float32)
        patches, gh, gw = _patchify((scaled - mean) / std, patch_size, merge_size, temporal_patch_size)
        rows.append(patches)
        grids.append((1, gh, gw))
    return np.concatenate(rows).astype(np.float32, copy=False), np.array(grids, dtype=np.int64)
