"""The video benchmark's clips: panned and zoomed views of real photographs, made offline.

The benchmark machine has no network, so no video data set can be fetched there; like the photo
collection (`photos.py`), the clips are derived from the photographs scikit-image bundles. Clip i
of a collection is a function of (seed, i): a colour photograph, a frame size (854x480, 960x540,
1280x720, 1920x1080, or 720x1280 portrait), a length of 10 to `max_seconds` s (120 by default),
a frame rate among 24, 25, 29.97, 30, 50 and 60, and a codec: H.264 (libx264, preset veryfast:
CABAC, B-frames, the decode cost of a camera's file) two times in three, else VP9 (libvpx-vp9,
realtime), both in .mp4, whose header counts the frames (transformers' PyAV loader needs that).
The picture is the photograph scaled to cover the frame at ZOOMS levels (a zoom in steps, each
held for an equal part of the clip), panned across its margin in 2-pixel steps over the level's
frames: low motion, which encodes quickly. Frames are cut from the levels' YUV planes, so making
one is a copy.

`long_clip` is the memory run's clip: 1920x1080, 24 fps, `minutes` long (10 by default), one
photograph panned slowly, H.264 at preset ultrafast (it is made in well under a minute).

A collection directory holds `clip-NNN.mp4` and `collection.json` (its manifest, written last):
a directory whose manifest matches is reused as it is.
"""

from __future__ import annotations

import json
import math
import os
from concurrent.futures import ProcessPoolExecutor
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from glmvit_cupy.errors import GlmVitError
from photos import available_sources, load_source, write_atomic

RECIPE = 1  # bump when the derivation changes: an older collection is then rebuilt, not reused
MANIFEST = "collection.json"
SIZES = ((854, 480), (960, 540), (1280, 720), (1920, 1080), (720, 1280))  # width, height
RATES = (Fraction(24), Fraction(25), Fraction(30000, 1001), Fraction(30), Fraction(50), Fraction(60))
MIN_SECONDS = 10
H264_SHARE = 2 / 3
ZOOMS = 4  # zoom levels a clip steps through: the photo covers 1.15x, 1.25x, ... the frame
# A collection's clips are encoded one a process, each on one thread; the long clip alone, on all.
CODECS = {"h264": ("libx264", {"preset": "veryfast", "threads": "1"}),
          "vp9": ("libvpx-vp9", {"deadline": "realtime", "cpu-used": "8", "crf": "32", "b": "0", "threads": "1"}),
          "h264-fast": ("libx264", {"preset": "ultrafast"})}
LONG_SIZE, LONG_RATE = (1920, 1080), Fraction(24)


def recipe(index: int, seed: int, max_seconds: int, colour: tuple[str, ...]) -> dict:
    """Clip `index`'s parameters: a function of (seed, index, max_seconds) alone."""
    rng = np.random.default_rng([seed, index])
    width, height = SIZES[rng.integers(len(SIZES))]
    rate = RATES[rng.integers(len(RATES))]
    seconds = int(rng.integers(MIN_SECONDS, max(MIN_SECONDS, max_seconds) + 1))
    return dict(name=f"clip-{index:03d}.mp4", source=colour[rng.integers(len(colour))], width=width, height=height,
                rate=str(rate), frames=int(seconds * rate), seconds=seconds,
                codec="h264" if rng.random() < H264_SHARE else "vp9", pan_seed=int(rng.integers(1 << 31)))


def _planes(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Y, U, V) planes of an RGB picture (sides multiples of 4: the planes pack in whole rows) as
    FFmpeg converts it."""
    import av

    h, w = rgb.shape[:2]
    yuv = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24").reformat(format="yuv420p").to_ndarray()
    return yuv[:h], yuv[h:h + h // 4].reshape(h // 2, w // 2), yuv[h + h // 4:].reshape(h // 2, w // 2)


def _levels(source: str, width: int, height: int, zooms: int) -> list[tuple[np.ndarray, ...]]:
    """The photograph scaled to cover the frame at each zoom level, as YUV planes."""
    photo = Image.fromarray(load_source(source))
    levels = []
    for z in range(zooms):
        cover = (1.15 + 0.1 * z) * max(width / photo.width, height / photo.height)
        size = (4 * math.ceil(photo.width * cover / 4), 4 * math.ceil(photo.height * cover / 4))
        levels.append(_planes(np.asarray(photo.resize(size, Image.BICUBIC))))
    return levels


def write_clip(path: Path, source: str, width: int, height: int, rate: Fraction, frames: int, codec: str,
               zooms: int, pan_seed: int) -> None:
    """Encode the clip into `path` (a temporary name beside it first: a killed build leaves no clip)."""
    import av

    levels = _levels(source, width, height, zooms)
    rng = np.random.default_rng(pan_seed)
    name, options = CODECS[codec]
    tmp = path.with_name(f".{path.name}.tmp.mp4")
    frame = np.empty((height * 3 // 2, width), dtype=np.uint8)
    per_level = -(-frames // zooms)
    try:
        with av.open(str(tmp), "w") as out:
            stream = out.add_stream(name, rate=rate, options=options)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for i in range(frames):
                y, u, v = levels[min(i // per_level, zooms - 1)]
                if i % per_level == 0:  # a new level: the pan crosses its room once over the level's frames
                    room = np.array([y.shape[1] - width, y.shape[0] - height]) // 2  # in 2-pixel steps
                    start = rng.integers(0, room + 1)
                    step = np.where(start > room // 2, -1, 1)
                    every = max(1, per_level // max(1, int(room.max())))
                x, t = np.clip(start + step * ((i % per_level) // every), 0, room) * 2  # even: whole chroma samples
                frame[:height] = y[t:t + height, x:x + width]
                frame[height:height + height // 4] = u[t // 2:t // 2 + height // 2, x // 2:x // 2 + width // 2].reshape(
                    height // 4, width)
                frame[height + height // 4:] = v[t // 2:t // 2 + height // 2, x // 2:x // 2 + width // 2].reshape(
                    height // 4, width)
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="yuv420p")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write(directory: str, entry: dict) -> dict:
    path = Path(directory) / entry["name"]
    write_clip(path, entry["source"], entry["width"], entry["height"], Fraction(entry["rate"]), entry["frames"],
               entry["codec"], ZOOMS, entry["pan_seed"])
    return dict(entry, bytes=path.stat().st_size)


def build_clips(directory: Path, count: int, seed: int, max_seconds: int, workers: int | None = None) -> dict:
    """Make (or reuse) the collection of `count` clips in `directory`; returns its manifest."""
    manifest_path = directory / MANIFEST
    wanted = dict(recipe=RECIPE, count=count, seed=seed, max_seconds=max_seconds)
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        missing = [e["name"] for e in manifest.get("clips", [])
                   if not (directory / e["name"]).is_file() or (directory / e["name"]).stat().st_size != e["bytes"]]
        if {k: manifest.get(k) for k in wanted} == wanted and not missing:
            return manifest
        raise GlmVitError(f"{directory}: holds another collection ({json.dumps({k: manifest.get(k) for k in wanted})}"
                          f"{f', {len(missing)} clips missing or changed' if missing else ''}); give another "
                          "--collection or remove it")
    directory.mkdir(parents=True, exist_ok=True)
    colour, _ = available_sources()
    entries = [recipe(i, seed, max_seconds, colour) for i in range(count)]
    order = sorted(entries, key=lambda e: -e["frames"] * e["width"] * e["height"])  # the longest start first
    with ProcessPoolExecutor(max_workers=min(len(entries), workers or os.cpu_count() or 1)) as pool:
        done = {e["name"]: e for e in pool.map(_write, [str(directory)] * len(order), order)}
    manifest = dict(wanted, clips=[done[e["name"]] for e in entries],
                    total_bytes=sum(e["bytes"] for e in done.values()),
                    total_seconds=sum(e["seconds"] for e in entries),
                    h264=sum(e["codec"] == "h264" for e in entries), vp9=sum(e["codec"] == "vp9" for e in entries))
    write_atomic(manifest_path, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest


def long_clip(directory: Path, minutes: float, seed: int = 0) -> Path:
    """The memory run's 1080p clip of `minutes` (made once, then reused)."""
    frames = int(minutes * 60 * LONG_RATE)
    path = directory / f"long-{LONG_SIZE[1]}p-{frames}f-{seed}.mp4"
    if not path.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        colour, _ = available_sources()
        part = path.with_name(f".{path.stem}-{os.getpid()}.mp4")  # renamed once whole: a reader never takes half a clip
        write_clip(part, colour[seed % len(colour)], *LONG_SIZE, LONG_RATE, frames, "h264-fast", 1, seed)
        os.replace(part, path)
    return path
