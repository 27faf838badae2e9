"""Videos -> (pixel_values, grid_thw, timestamps), exactly as transformers' `Glm5NextVideoProcessor`
(transformers 5.23) makes them from frames that PyAV decodes, quirks included.

A module of its own because video is a different contract from an image, not an image with
more frames: the settings come from another file and have other defaults (a 240,000-token
budget for the whole video, fps 2, at most 2048 frames), frames are picked by the processor's
own sampler from the stream header, they are scaled with torchvision's uint8 resize rather
than PIL's, and normalised with the fused arithmetic of transformers' torchvision backend.
PyAV is the optional `[video]` extra, imported here and only when a video is opened.

- `video_config`: the video processor's settings, read from the files transformers reads for
  it, in its order: processor_config.json's "video_processor", video_preprocessor_config.json,
  else the image processor's preprocessor_config.json (its fields, the video defaults for the
  rest).
- `sample_frames`: the processor's sampler, from the header's frame count and rate (the first
  frame at or after each 1/fps boundary up to int(duration), evenly spaced indices when that
  gives too few or too many, duplicates dropped, an odd count padded with the last frame).
- `VideoReader` opens a file, bytes or file-like, plans the sampling and the canvas from the
  stream header, and decodes only up to the last sampled frame, yielding each sampled frame
  scaled as it is decoded (a collection's decode worker streams them to the main process one
  at a time: clips.py). `open_video` keeps them; `video_frames` takes frames the caller
  decoded, with their timestamps. Both give a `VideoFrames`: one canvas size for the whole
  video (`smart_resize` over all its frames), the content scaled down (or up) with
  `resize_uint8` only when over (or under) the budget, zero-padded at the bottom and right on
  raw pixels (`on_canvas`).
- `patchify_frames` turns frames on their canvas into pixel_values: pairs of frames, each patch
  laid out (C, T, 14, 14), block-major. `VideoFrames.pixel_values(first, stop)` does it for
  temporal groups [first, stop), so a long video is embedded a few groups at a time without
  its whole float32 pixel_values in memory; the collection pipeline's NumPy stager calls it
  on the groups of a batch.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence, Union

import numpy as np

from ..errors import GlmVitError
from ..tower.geometry import MIN_IMAGE_TOKENS, REAL, GlmVitGeometry
from ..workers import usable_cpus
from .preprocess import (CLIP_MEAN, CLIP_STD, PREPROCESSOR_FILE, check_shared_fields, content_size, read_json_object,
                         settings_from, smart_resize)
from .preprocess import _field_value as image_field_value

VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".mov", ".avi")
PROCESSOR_FILE = "processor_config.json"  # its "video_processor" object, when it has one
VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"
MAX_VIDEO_TOKENS = 240_000  # Glm5NextVideoProcessor.max_image_tokens: the whole video's budget
BICUBIC = 3  # PIL's number for it, as the config files write `resample`
INSTALL = 'pip install -e ".[video]"'

VideoSource = Union[str, Path, bytes, bytearray, BinaryIO]


@dataclasses.dataclass(frozen=True)
class VideoConfig:
    """The video processor's settings: every field of Glm5NextVideoProcessor that changes what
    it makes, with its class defaults. (`size`, `max_image_size`, `num_frames`, `do_center_crop`
    and `do_pad` are accepted by it too, and ignored by its sampler, resize and patchify.)"""

    patch_size: int = REAL["patch_size"]
    temporal_patch_size: int = REAL["temporal_patch_size"]
    merge_size: int = REAL["spatial_merge_size"]
    patch_expand_factor: int = 1  # multiplies the canvas alignment (patch_size x merge_size)
    min_image_tokens: int = MIN_IMAGE_TOKENS
    max_image_tokens: int = MAX_VIDEO_TOKENS
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    resample: int = BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool = True  # frames are decoded to RGB (or given as RGB): nothing to convert
    do_sample_frames: bool = True  # False: every frame of the file
    fps: float = 2.0  # frames sampled per second
    max_frames: int = 2048
    max_duration: float = 0.0  # seconds of the clip sampled; 0: all of it

    def __post_init__(self) -> None:
        check_shared_fields(self, "video processor", ("patch_size", "temporal_patch_size", "merge_size",
                                                      "patch_expand_factor", "min_image_tokens", "max_image_tokens",
                                                      "max_frames"),
                            ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_sample_frames"))
        if self.resample != BICUBIC or isinstance(self.resample, bool):
            raise GlmVitError(f"video processor: resample {self.resample!r}: only bicubic ({BICUBIC}), the "
                              "processor's default, is reproduced for video")
        for name in ("rescale_factor", "fps", "max_duration"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, float) or not math.isfinite(value):
                raise GlmVitError(f"video processor: {name} {value!r} must be a number")
        if self.fps <= 0:
            raise GlmVitError(f"video processor: fps {self.fps!r} must be positive")

    @property
    def factor(self) -> int:
        """Canvas sides are multiples of this (28 by default)."""
        return self.patch_size * self.merge_size * self.patch_expand_factor


VIDEO_FIELDS = tuple(f.name for f in dataclasses.fields(VideoConfig))


def _video_field(name: str, value: Any) -> Any:
    """A config value in VideoConfig's type (integers written as floats and back, as JSON allows)."""
    if name in ("fps", "max_duration") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if name in ("patch_expand_factor", "max_frames") and isinstance(value, float) and value.is_integer():
        return int(value)
    return image_field_value(name, value)


def video_config_file(model_dir: str | Path | None) -> tuple[dict, str | None]:
    """(settings, where they came from) as transformers finds the video processor's config:
    processor_config.json's "video_processor" object, else video_preprocessor_config.json, else
    the image processor's preprocessor_config.json; ({}, None) when the directory has none."""
    if model_dir is None:
        return {}, None
    directory = Path(model_dir)
    if (directory / PROCESSOR_FILE).is_file():
        combined = read_json_object(directory / PROCESSOR_FILE)
        if "video_processor" in combined:
            section = combined["video_processor"]
            if not isinstance(section, dict):
                raise GlmVitError(f"{directory / PROCESSOR_FILE}: video_processor is a {type(section).__name__}, "
                                  "not an object")
            return section, f"{PROCESSOR_FILE} video_processor"
    for name in (VIDEO_PROCESSOR_FILE, PREPROCESSOR_FILE):
        if (directory / name).is_file():
            return read_json_object(directory / name), name
    return {}, None


def video_config(model_dir: str | Path | None = None, **overrides: Any) -> tuple[VideoConfig, dict[str, str]]:
    """The video processor's settings for the model in `model_dir`, then each override that is
    not None. Returns (config, field -> "default" | the file it came from | "option")."""
    unknown = sorted(set(overrides) - set(VIDEO_FIELDS))
    if unknown:
        raise GlmVitError(f"video processor: unknown setting(s) {', '.join(unknown)} (known: {', '.join(VIDEO_FIELDS)})")
    file, where = video_config_file(model_dir)
    path = Path(model_dir) / where.split()[0] if where is not None else None
    values, sources = settings_from(file, where, path, VIDEO_FIELDS, _video_field, overrides)
    try:
        return VideoConfig(**values), sources
    except GlmVitError as exc:
        raise GlmVitError(f"{path if where in sources.values() else 'options'}: {exc}") from None


def check_video_config(config: VideoConfig, geo: GlmVitGeometry) -> None:
    """The video processor must cut the patches the tower embeds."""
    for mine, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                         ("merge_size", "spatial_merge_size")):
        if getattr(config, mine) != getattr(geo, theirs):
            raise GlmVitError(f"video processor {mine} {getattr(config, mine)} disagrees with the tower's "
                              f"{theirs} {getattr(geo, theirs)} (config.json)")


def sample_frames(total_frames: int, fps: float, duration: float, config: VideoConfig = VideoConfig()) -> list[int]:
    """Glm5NextVideoProcessor.sample_frames, line for line: the indices of the frames kept, from
    the header's frame count, rate (frames per second) and duration (seconds; 0: unknown)."""
    max_frame_idx = total_frames - 1
    duration = duration or round(max_frame_idx / fps) + 1
    max_seconds = int(duration)  # the cap is the clip's own, before max_duration shortens it
    duration = duration if config.max_duration <= 0 else min(duration, config.max_duration)
    extract_t = min(int(duration * config.fps), config.max_frames)
    duration_per_frame = 1 / fps  # timestamps are i x (1 / fps), as the processor computes them
    if total_frames < extract_t:
        indices = np.linspace(0, total_frames - 1, extract_t, dtype=int).tolist()
    else:
        indices, current_second, step = [], 0.0, 1 / config.fps
        for index in range(total_frames):
            if index * duration_per_frame >= current_second:
                current_second += step
                indices.append(index)
                if current_second >= max_seconds:
                    break  # so the last 0.5-1 s of a clip is never sampled
    if len(indices) < extract_t:
        start, end = (indices[0], indices[-1]) if indices else (0, max(total_frames - 1, 0))
        indices = np.linspace(start, end, extract_t, dtype=int).tolist()
    elif len(indices) > extract_t:
        indices = np.linspace(0, total_frames - 1, extract_t, dtype=int).tolist()
    unique = list(dict.fromkeys(indices))
    if len(unique) % 2:
        unique.append(unique[-1])
    return unique


# torchvision's uint8 bicubic antialias resize (ATen's separable uint8 kernels, a port of
# Pillow-SIMD's): weights computed in double, rounded to int16 at the largest precision that
# keeps them in int16, integer sums, horizontal pass then vertical, each rounded and clipped to
# uint8. Reproduced integer for integer: the integer sums are computed as matrix products of
# bands of the weights, which BLAS does ~7x faster than a loop over taps. Every product and
# partial sum is an integer of magnitude at most 255 x sum |weights| of an output, so a float
# holds each exactly, in any order, while that bound (plus the rounding bias) is below 2^24 for
# float32 (an axis scaled down by up to ~2x; twice as fast as float64) or 2^53 for float64.

RESIZE_BAND = 32  # output pixels a band: its weights are a dense [inputs it reads, 32] block, mostly
# zeros beyond each output's taps (7 of ~38 inputs at 1920 -> 1792); bands of 64 did twice that
# zero work and took ~1.3x the time at 1080p (to 1792 or 728 wide), bands of 16 about the same.
# Kept frames converted to RGB and scaled at once, beside the decode (swscale and NumPy leave the GIL).
SCALE_THREADS = min(8, usable_cpus())


def _cubic(x: float) -> float:
    """ATen's antialias bicubic filter (a = -0.5, as PIL), its expressions in its order."""
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2) * x - (a + 3)) * x * x + 1
    if x < 2.0:
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return 0.0


@functools.lru_cache(maxsize=64)
def _int16_weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(source index [out, k] int64, weights [out, k] int32, precision bits) for one axis."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    weights = np.zeros((out_size, taps), dtype=np.float64)
    starts = np.zeros(out_size, dtype=np.int64)
    for i in range(out_size):
        center = scale * (i + 0.5)
        start = max(int(center - support + 0.5), 0)
        size = min(int(center + support + 0.5), in_size) - start
        row = [_cubic((j + start - center + 0.5) * invscale) for j in range(size)]
        total = 0.0
        for w in row:
            total += w
        weights[i, :size] = [w / total for w in row] if total != 0.0 else row
        starts[i] = start
    w_max = weights.max()
    precision = 0
    while precision < 22 and int(0.5 + w_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    fixed = np.trunc(np.where(weights < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    index = np.minimum(starts[:, None] + np.arange(taps), in_size - 1)  # taps past the end weigh 0
    return index, fixed, precision


@functools.lru_cache(maxsize=64)
def _bands(in_size: int, out_size: int) -> tuple[list[tuple[int, int, int, int, np.ndarray]], type]:
    """([(first output, stop, first input, stop, weights [inputs, outputs])], their dtype) for one
    axis: the int16 weights over 2^precision as dense blocks of RESIZE_BAND outputs each, float32
    where every sum they make (the rounding's half included) is a float32 exactly, else float64.
    A power of two only moves the exponent, so the sums are ATen's integer sums over 2^precision."""
    index, fixed, precision = _int16_weights(in_size, out_size)
    largest = 255 * int(np.abs(fixed).sum(axis=1).max()) + (1 << (precision - 1))
    dtype = np.float32 if largest < 2**24 else np.float64
    bands = []
    for o0 in range(0, out_size, RESIZE_BAND):
        o1 = min(o0 + RESIZE_BAND, out_size)
        taps = index[o0:o1]
        i0, i1 = int(taps.min()), int(taps.max()) + 1
        weights = np.zeros((i1 - i0, o1 - o0), dtype=np.float64)
        np.add.at(weights, (taps - i0, np.arange(o1 - o0)[:, None]), fixed[o0:o1])  # taps past the end weigh 0
        bands.append((o0, o1, i0, i1, (weights / (1 << precision)).astype(dtype)))
    return bands, dtype


def _resample(src: np.ndarray, rows: tuple[int, int], axis: int, out_size: int, shape: tuple[int, ...],
               order: tuple[int, ...]) -> np.ndarray:
    """One pass of the uint8 resize: `src` (uint8, any view) read as a 2-D `rows` array, resampled
    along `axis` (0: down its columns, 1: along its rows) to `out_size`, the uint8 result reshaped
    to `shape` with its axes put in `order`. Each copy is also a conversion: the uint8 view into
    floats, the rounded floats into uint8 in the final layout."""
    bands, dtype = _bands(rows[axis], out_size)
    values = np.empty(rows, dtype=dtype)
    values.reshape(src.shape)[...] = src
    if axis == 1:
        acc = np.empty((rows[0], out_size), dtype=dtype)
        for o0, o1, i0, i1, weights in bands:
            np.matmul(values[:, i0:i1], weights, out=acc[:, o0:o1])
    else:
        acc = np.empty((out_size, rows[1]), dtype=dtype)
        for o0, o1, i0, i1, weights in bands:
            np.matmul(weights.T, values[i0:i1], out=acc[o0:o1])
    acc += 0.5  # ATen rounds (sum + 2^(precision-1)) >> precision: a floor, here the cast's truncation
    acc = acc.reshape(shape).transpose(order)
    out = np.empty(acc.shape, dtype=np.uint8)
    np.clip(acc, 0, 255, out=out, casting="unsafe")  # clipped first, so the truncation is the floor
    return out


def resize_uint8(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """[H, W, C] uint8 -> [height, width, C] uint8, as torchvision's resize(antialias=True,
    BICUBIC) of a uint8 tensor on the CPU: the width, then the height. Between the passes the
    frame is [H, C, width]: the first pass's products want each channel's row contiguous, and the
    second resamples whole rows in any order."""
    h, w, c = image.shape
    if w != width:
        columns = image.transpose(0, 2, 1)
        if h == height:
            return _resample(columns, (h * c, w), 1, width, (h, c, width), (0, 2, 1))
        image = _resample(columns, (h * c, w), 1, width, (h, c * width), (0, 1))
        return _resample(image, (h, c * width), 0, height, (height, c, width), (0, 2, 1))
    if h != height:
        return _resample(image, (h, w * c), 0, height, (height, w, c), (0, 1, 2))
    return image


@functools.lru_cache(maxsize=8)
def video_pixel_table(config: VideoConfig = VideoConfig()) -> np.ndarray:
    """float32 [3, 256]: each uint8 value's normalised value, with the video processor's
    arithmetic: rescale folded into the mean and std (mean x (1 / rescale_factor) in float32),
    then (v - mean) / std in float32."""
    values = np.repeat(np.arange(256, dtype=np.float32)[None, :], 3, axis=0)
    mean = np.array(config.image_mean, dtype=np.float32)[:, None]
    std = np.array(config.image_std, dtype=np.float32)[:, None]
    if config.do_normalize:
        if config.do_rescale:
            inverse = np.float32(1.0 / config.rescale_factor)
            mean, std = mean * inverse, std * inverse
        table = (values - mean) / std
    elif config.do_rescale:
        table = values * np.float32(config.rescale_factor)
    else:
        table = values
    table.flags.writeable = False
    return table


@dataclasses.dataclass
class VideoFrames:
    """A video's sampled frames, scaled onto one canvas: what the processor would patchify.

    `frames`: uint8 [h, w, 3] content (at most canvas-sized; duplicates share an array), in time
    order; `canvas`: (H, W), multiples of the config's factor; `timestamps`: seconds of each
    frame; `fps` and `frame_count`: of the source (None where the caller gave frames)."""

    name: str
    frames: list[np.ndarray]
    canvas: tuple[int, int]
    timestamps: list[float]
    config: VideoConfig
    fps: float | None = None
    frame_count: int | None = None

    @property
    def groups(self) -> int:
        """Temporal groups (T / temporal_patch_size, an odd count padded with the last frame)."""
        return -(-len(self.frames) // self.config.temporal_patch_size)

    @property
    def grid_thw(self) -> np.ndarray:
        """int64 [[T/2, H/14, W/14]]."""
        patch = self.config.patch_size
        return np.array([[self.groups, self.canvas[0] // patch, self.canvas[1] // patch]], dtype=np.int64)

    @property
    def patches_per_group(self) -> int:
        return int(self.grid_thw[0, 1] * self.grid_thw[0, 2])

    @property
    def group_timestamps(self) -> list[float]:
        """Seconds of each temporal group's first frame (the `{t:.1f} seconds` after its tokens)."""
        return self.timestamps[::self.config.temporal_patch_size]

    def pixel_values(self, first: int = 0, stop: int | None = None) -> np.ndarray:
        """float32 [(stop - first) x H/14 x W/14, C x T x 14 x 14] for temporal groups [first, stop)."""
        stop = self.groups if stop is None else stop
        temporal = self.config.temporal_patch_size
        last = len(self.frames) - 1
        canvases = np.zeros(((stop - first) * temporal, *self.canvas, 3), dtype=np.uint8)
        for k in range(len(canvases)):
            frame = self.frames[min(first * temporal + k, last)]  # the odd count's pad repeats the last
            canvases[k, :frame.shape[0], :frame.shape[1]] = frame
        return patchify_frames(canvases, self.config)


def patchify_frames(canvases: np.ndarray, config: VideoConfig = VideoConfig()) -> np.ndarray:
    """uint8 [T, H, W, 3] frames on their canvas, T a multiple of temporal_patch_size -> float32
    pixel_values [(T / tp) x H/14 x W/14, C x tp x 14 x 14]: temporal groups of tp consecutive
    frames, each group's patches block-major, as the video processor lays them out."""
    temporal, patch, merge = config.temporal_patch_size, config.patch_size, config.merge_size
    frames, height, width, _ = canvases.shape
    groups, gh, gw = frames // temporal, height // patch, width // patch
    values = video_pixel_table(config)[np.arange(3), canvases]  # [frames, H, W, C] float32
    blocks = values.reshape(groups, temporal, gh // merge, merge, patch, gw // merge, merge, patch, 3)
    blocks = blocks.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # (t, h/m, w/m, m, m, C, T, p, p)
    return np.ascontiguousarray(blocks).reshape(groups * gh * gw, 3 * temporal * patch * patch)


def on_canvas(frame: np.ndarray, canvas: tuple[int, int]) -> np.ndarray:
    """A scaled frame zero-padded at the bottom and right onto its canvas: uint8 [H, W, 3]."""
    out = np.zeros((*canvas, 3), dtype=np.uint8)
    out[:frame.shape[0], :frame.shape[1]] = frame
    return out


def _plan(name: str, frames: int, height: int, width: int, config: VideoConfig) -> tuple[tuple[int, int], tuple[int, int]]:
    """(canvas, content size) of every frame: the processor's resize for the whole video."""
    if not config.do_resize:
        if height % config.factor or width % config.factor:
            raise GlmVitError(f"{name}: {width}x{height} frames with do_resize false: both sides must be "
                              f"multiples of {config.factor}")
        return (height, width), (height, width)
    canvas = smart_resize(height, width, factor=config.factor, temporal_factor=config.temporal_patch_size,
                          min_image_tokens=config.min_image_tokens, max_image_tokens=config.max_image_tokens,
                          frames=frames)
    pixels_per_token = config.temporal_patch_size * config.factor ** 2
    content = content_size(height, width, *canvas,
                           enlarge=frames * height * width < pixels_per_token * config.min_image_tokens)
    return canvas, content


def _scaled(frame: np.ndarray, content: tuple[int, int]) -> np.ndarray:
    return frame if frame.shape[:2] == content else resize_uint8(frame, *content)


def video_frames(frames: Sequence[np.ndarray] | np.ndarray, timestamps: Sequence[float],
                 config: VideoConfig = VideoConfig(), name: str = "video frames") -> VideoFrames:
    """Frames the caller decoded (HxWx3 uint8 each, one size, in time order; or one [T, H, W, 3]
    array) with the timestamp in seconds of each, processed as the video processor processes
    frames it is given with do_sample_frames false: all of them, an odd count padded."""
    if isinstance(frames, np.ndarray) and frames.ndim == 4:
        frames = list(frames)
    if not isinstance(frames, (list, tuple)) or not frames:
        raise GlmVitError(f"{name}: expected a non-empty list of HxWx3 uint8 frames or a [T, H, W, 3] uint8 array")
    try:
        times = [float(t) for t in timestamps]
    except (TypeError, ValueError):
        raise GlmVitError(f"{name}: timestamps must be numbers (seconds), one a frame") from None
    if len(times) != len(frames):
        raise GlmVitError(f"{name}: {len(frames)} frames but {len(times)} timestamps")
    first = frames[0]
    for i, frame in enumerate(frames):
        if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            what = f"shape {list(frame.shape)} and dtype {frame.dtype}" if isinstance(frame, np.ndarray) else \
                f"a {type(frame).__name__}"
            raise GlmVitError(f"{name}: frame {i} has {what}, expected HxWx3 uint8")
        if frame.shape != first.shape:
            raise GlmVitError(f"{name}: frame {i} is {frame.shape[1]}x{frame.shape[0]}, frame 0 "
                              f"{first.shape[1]}x{first.shape[0]}: one video has one size")
    if 0 in first.shape[:2]:
        raise GlmVitError(f"{name}: frames of {first.shape[1]}x{first.shape[0]} pixels")
    canvas, content = _plan(name, len(frames), first.shape[0], first.shape[1], config)
    return VideoFrames(name, [_scaled(f, content) for f in frames], canvas, times, config)


def _import_av() -> Any:
    try:
        import av
    except ImportError:
        raise GlmVitError(f"videos need PyAV, the [video] extra: {INSTALL}") from None
    return av


def _describe(source: VideoSource) -> str:
    if isinstance(source, (str, Path)):
        return str(source)
    if isinstance(source, (bytes, bytearray)):
        return f"video bytes ({len(source):,} B)"
    return str(getattr(source, "name", None) or f"a {type(source).__name__}")


def open_video(source: VideoSource, config: VideoConfig = VideoConfig(), name: str | None = None) -> VideoFrames:
    """Decode a video file (a path, its bytes, or a binary file-like) with PyAV as transformers'
    load_video(backend="pyav") does, keep the frames the processor samples (scaled as they are
    decoded, so memory holds only those), and return them on their canvas."""
    with VideoReader(source, config, name) as reader:
        return VideoFrames(reader.name, list(reader.frames()), reader.canvas, reader.timestamps, config,
                           fps=reader.fps, frame_count=reader.frame_count)


class VideoReader:
    """A video opened with PyAV, its sampling planned from the stream header as the processor
    plans it: `indices` (the frames kept, an odd count's pad included), `canvas` and `content`
    (the sizes of every frame on and within it), `fps` and `frame_count` (the header's),
    `timestamps` (seconds of each kept frame). `frames()` then decodes up to the last kept frame
    and yields each kept one scaled as it is decoded, so memory holds one frame at a time. Every
    fault is a GlmVitError naming the video. A context manager: it closes the container."""

    def __init__(self, source: VideoSource, config: VideoConfig = VideoConfig(), name: str | None = None) -> None:
        self.av = av = _import_av()
        self.config = config
        self.name = name or _describe(source)
        if isinstance(source, (str, Path)) and not Path(source).is_file():
            raise GlmVitError(f"{self.name}: no such video file")
        opened = io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray)) else \
            str(source) if isinstance(source, Path) else source
        try:
            self.container = av.open(opened)
        except (av.FFmpegError, OSError, ValueError) as exc:
            raise GlmVitError(f"{self.name}: not a video PyAV can open (a truncated file or another format?): "
                              f"{exc}") from None
        try:
            self._plan()
        except BaseException:
            self.container.close()
            raise

    def _plan(self) -> None:
        container, name, config = self.container, self.name, self.config
        if not container.streams.video:
            raise GlmVitError(f"{name}: has no video stream")
        stream = self.stream = container.streams.video[0]
        # FFmpeg's frame and slice threads, one a core: a long video's decode is not one core's
        # work. A valid stream gives the same pictures as on one thread (FFmpeg's frame threads are
        # bit-exact); a corrupt one may be concealed otherwise before it fails, and a truncated
        # one ends without an error (the count of frames decoded says so).
        stream.thread_type = "AUTO"
        if stream.codec_context is None or not stream.codec_context.codec.name:
            raise GlmVitError(f"{name}: its video codec has no decoder in PyAV's FFmpeg")
        self.width, self.height = stream.codec_context.width, stream.codec_context.height
        if self.width == 0 or self.height == 0:
            raise GlmVitError(f"{name}: the video stream is {self.width}x{self.height} pixels")
        rate: Fraction | None = stream.average_rate
        if not rate:
            raise GlmVitError(f"{name}: the container gives no frame rate for its video stream")
        total = stream.frames
        if total == 0:
            # Matroska/WebM headers carry no frame count: count the stream's packets (demuxing, no decoding)
            total = self._count_packets()
        self.frame_count = total
        self.fps, duration = float(rate), float(total / rate)  # as load_video's VideoMetadata has them
        if config.do_sample_frames:
            self.indices = sample_frames(total, self.fps, duration, config)
            if not self.indices:
                raise GlmVitError(f"{name}: {duration:.2f} s at {self.fps:g} fps is too short to sample a frame at "
                                  f"{config.fps:g} fps")
        else:
            self.indices = list(range(total))
        self.canvas, self.content = _plan(name, len(self.indices), self.height, self.width, config)
        self.timestamps = [i / self.fps for i in self.indices]

    def _count_packets(self) -> int:
        try:
            count = sum(1 for packet in self.container.demux(self.stream) if packet.size)
            if count == 0:
                raise GlmVitError(f"{self.name}: the video stream has no frames")
            self.container.seek(0)  # back to the start, for decoding
        except self.av.FFmpegError as exc:
            raise GlmVitError(f"{self.name}: cannot read the video stream: {exc}") from None
        return count

    def frames(self) -> Iterator[np.ndarray]:
        """Each kept frame in order, uint8 [content h, content w, 3] (a repeated index yields the
        same array again), decoding no further than the last one. FFmpeg decodes on its own
        threads (frame and slice threads: the same pictures as one thread); the RGB conversion
        and the scaling of kept frames run on SCALE_THREADS threads, at most SCALE_THREADS + 1
        frames ahead of the one yielded."""
        indices, name = self.indices, self.name
        unique = sorted(set(indices))  # the kept frames in decoding order (indices ascend)
        k = u = 0  # indices yielded, unique frames submitted
        index = -1
        pending: deque[tuple[int, Future]] = deque()
        with ThreadPoolExecutor(SCALE_THREADS, thread_name_prefix="glmvit-video-scale") as pool:
            try:
                for index, frame in enumerate(self.container.decode(self.stream)):
                    if index == unique[u]:
                        pending.append((index, pool.submit(self._rgb, frame, index)))
                        u += 1
                    while pending and (len(pending) > SCALE_THREADS or u == len(unique)):
                        done, future = pending.popleft()
                        scaled = future.result()
                        while k < len(indices) and indices[k] == done:
                            yield scaled
                            k += 1
                    if u == len(unique):
                        return
            except self.av.FFmpegError as exc:
                raise GlmVitError(f"{name}: cannot decode frame {index + 1} (a truncated or corrupt file?): {exc}") \
                    from None
            finally:
                for _, future in pending:
                    future.cancel()
        raise GlmVitError(f"{name}: truncated: the header counts {self.frame_count} frames, only {index + 1} "
                          f"decode (frame {unique[u]} was to be sampled)")

    def _rgb(self, frame: Any, index: int) -> np.ndarray:
        """A decoded frame as RGB, scaled to the content size."""
        rgb = frame.to_ndarray(format="rgb24")
        if rgb.shape[:2] != (self.height, self.width):
            raise GlmVitError(f"{self.name}: frame {index} is {rgb.shape[1]}x{rgb.shape[0]}, the stream header "
                              f"says {self.width}x{self.height}")
        return _scaled(rgb, self.content)

    def close(self) -> None:
        self.container.close()

    def __enter__(self) -> VideoReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def preprocess_video(video: VideoSource | tuple, config: VideoConfig = VideoConfig()) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """One video -> (pixel_values_videos float32 [sum (T/2)(H/14)(W/14), 1176], video_grid_thw int64
    [[T/2, H/14, W/14]], the seconds of each temporal group's first frame): the processor's
    outputs and the timestamps its prompt writes. `video`: as `load` takes it."""
    frames = load(video, config)
    return frames.pixel_values(), frames.grid_thw, frames.group_timestamps


def load(video: VideoSource | tuple, config: VideoConfig = VideoConfig()) -> VideoFrames:
    """A path, bytes or binary file-like (decoded with PyAV), or (frames, timestamps) the caller
    decoded, as VideoFrames."""
    if isinstance(video, tuple):
        if len(video) != 2:
            raise GlmVitError(f"a video as a tuple is (frames, timestamps), not {len(video)} items")
        return video_frames(video[0], video[1], config)
    if isinstance(video, (str, Path, bytes, bytearray)) or hasattr(video, "read"):
        return open_video(video, config)
    raise GlmVitError(f"cannot read a {type(video).__name__} as a video: pass a path, bytes, a binary file, "
                      "or (frames, timestamps)")


@dataclasses.dataclass(frozen=True)
class VideoOutput:
    """One video's embeddings: `pooler_output` (what the LM splices in) and `last_hidden_state`,
    float32 [tokens, out_hidden] in time order, (h/2)(w/2) rows a temporal group; `grid_thw`
    [[T/2, h, w]]; `timestamps`: float64 [T/2], seconds of each group's first frame; `frames`:
    frames sampled (an odd count's pad included); `fps`: the source's rate (None for frames the
    caller gave)."""

    last_hidden_state: np.ndarray
    pooler_output: np.ndarray
    grid_thw: np.ndarray
    timestamps: np.ndarray
    frames: int
    fps: float | None


def with_video_settings(config: VideoConfig, **settings: Any) -> VideoConfig:
    """`config` with each setting that is not None in its place."""
    return dataclasses.replace(config, **{k: _video_field(k, v) for k, v in settings.items() if v is not None})
