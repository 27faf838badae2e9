"""The end-to-end benchmark's photo collection: 1,000+ distinct real photographs, made offline.

The benchmark machine has no network, so no photo data set can be fetched there. What it does
have is scikit-image, whose wheel bundles a handful of real photographs (`skimage.data`: the
astronaut, a cat, coffee, a rocket, the Hubble deep field, a retina, motorcycles, ...; the
ones that need a download are not used). From those we derive the collection: for file i a
generator seeded with (seed, i) picks a photograph (colour four times in five; grey ones stay
one-channel files, as scanned or monochrome photos are), an aspect ratio (log-uniform, 1:2.4 to
2.4:1, either orientation), a crop of 55-100 % of the largest such window at a random place,
a long side of 320-1600 px (uniform, so the mean is ~4,000 patches an image, the mix the issue
measured), a resize to it (Lanczos down, bicubic up), a horizontal flip half the time, and a
format: JPEG two times in three (quality 70-95, 4:2:0 or 4:4:4 chroma, a quarter progressive)
or PNG (PIL's default compression). Every byte thus comes from a camera, and file sizes and
decode costs are those of photographs; files are distinct by construction (the manifest
checks their sha256). The recipe is deterministic, so a collection is rebuilt, not copied.

A collection directory holds `photo-NNNNN.jpg|png` and `collection.json` (the manifest, written
last): a directory with a matching manifest is reused as it is.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from glmvit_cupy.errors import GlmVitError

RECIPE = 1  # bump when the derivation changes: an older collection is then rebuilt, not reused
MANIFEST = "collection.json"
COLOUR = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry",
          "retina", "motorcycle_left", "motorcycle_right")
GREY = ("camera", "coins", "moon", "clock", "page", "text", "brick", "grass", "gravel", "cell")
COLOUR_SHARE = 0.8
LONG_SIDE = (320, 1600)
MAX_ASPECT = 2.4
CROP_SHARE = (0.55, 1.0)
JPEG_SHARE = 2 / 3
JPEG_QUALITY = (70, 95)


@functools.lru_cache(maxsize=None)
def load_source(name: str) -> np.ndarray | None:
    """One bundled photograph as uint8 [H, W, 3] or [H, W]; None when this install lacks it."""
    from skimage import data

    try:
        if name.startswith("motorcycle_"):
            left, right, _ = data.stereo_motorcycle()
            image = left if name == "motorcycle_left" else right
        else:
            image = getattr(data, name)()
    except (AttributeError, ImportError, OSError, ValueError):  # not bundled in this version
        return None
    return np.ascontiguousarray(image)


def available_sources() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(colour, grey) names of the photographs this install bundles."""
    colour = tuple(n for n in COLOUR if load_source(n) is not None)
    grey = tuple(n for n in GREY if load_source(n) is not None)
    if len(colour) < 4:
        raise GlmVitError(f"scikit-image bundles only {len(colour)} of the colour photographs "
                          f"{', '.join(COLOUR)}; at least 4 are needed")
    return colour, grey


def make_photo(index: int, seed: int, colour: tuple[str, ...], grey: tuple[str, ...]) -> tuple[str, bytes]:
    """(file name, file bytes) of photo `index`: a function of (seed, index) alone."""
    rng = np.random.default_rng([seed, index])
    names = colour if not grey or rng.random() < COLOUR_SHARE else grey
    source = names[rng.integers(len(names))]
    image = Image.fromarray(load_source(source))
    aspect = math.exp(rng.uniform(-math.log(MAX_ASPECT), math.log(MAX_ASPECT)))  # width / height
    max_w = min(image.width, image.height * aspect)
    share = rng.uniform(*CROP_SHARE)
    crop_w = max(1, round(max_w * share))
    crop_h = max(1, min(image.height, round(max_w / aspect * share)))
    left = int(rng.integers(image.width - crop_w + 1))
    top = int(rng.integers(image.height - crop_h + 1))
    image = image.crop((left, top, left + crop_w, top + crop_h))
    long_side = int(rng.integers(LONG_SIDE[0], LONG_SIDE[1] + 1))
    scale = long_side / max(crop_w, crop_h)
    size = (max(1, round(crop_w * scale)), max(1, round(crop_h * scale)))
    image = image.resize(size, Image.LANCZOS if scale < 1 else Image.BICUBIC)
    if rng.random() < 0.5:
        image = image.transpose(Image.FLIP_LEFT_RIGHT)
    out = io.BytesIO()
    if rng.random() < JPEG_SHARE:
        image.save(out, "JPEG", quality=int(rng.integers(JPEG_QUALITY[0], JPEG_QUALITY[1] + 1)),
                   subsampling=int(rng.choice([0, 2])), progressive=bool(rng.random() < 0.25))
        suffix = "jpg"
    else:
        image.save(out, "PNG")
        suffix = "png"
    return f"photo-{index:05d}.{suffix}", out.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file beside the target, fsync, rename: a killed build leaves no half file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _build_range(directory: str, indices: range, seed: int, colour: tuple[str, ...],
                 grey: tuple[str, ...]) -> list[dict]:
    """Write photos `indices` into `directory` (one worker's share); their manifest entries."""
    entries = []
    for i in indices:
        name, data = make_photo(i, seed, colour, grey)
        write_atomic(Path(directory) / name, data)
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
        entries.append(dict(name=name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
                            width=width, height=height))
    return entries


def _matches(manifest: dict, count: int, seed: int) -> bool:
    return (manifest.get("recipe") == RECIPE and manifest.get("count") == count and manifest.get("seed") == seed)


def build_collection(directory: Path, count: int, seed: int = 0, workers: int | None = None) -> dict:
    """Make (or reuse) the collection in `directory`; returns its manifest."""
    manifest_path = directory / MANIFEST
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        missing = [e["name"] for e in manifest["files"]
                   if not (directory / e["name"]).is_file() or (directory / e["name"]).stat().st_size != e["bytes"]]
        if _matches(manifest, count, seed) and not missing:
            return manifest
        raise GlmVitError(f"{directory}: holds another collection ({manifest.get('count')} photos, seed "
                          f"{manifest.get('seed')}, recipe {manifest.get('recipe')}"
                          f"{f', {len(missing)} files missing or changed' if missing else ''}); "
                          "give another --collection or remove it")
    directory.mkdir(parents=True, exist_ok=True)
    strangers = [p.name for p in directory.iterdir() if not p.name.startswith(("photo-", ".photo-"))]
    if strangers:  # only a build that was cut short may have left files here
        raise GlmVitError(f"{directory}: not empty ({strangers[0]} and {len(strangers) - 1} more) and no "
                          f"{MANIFEST}; give an empty or new --collection")
    colour, grey = available_sources()
    workers = workers or os.cpu_count() or 1
    step = math.ceil(count / workers)
    ranges = [range(a, min(a + step, count)) for a in range(0, count, step)]
    with ProcessPoolExecutor(max_workers=len(ranges)) as pool:
        parts = pool.map(_build_range, [str(directory)] * len(ranges), ranges, [seed] * len(ranges),
                         [colour] * len(ranges), [grey] * len(ranges))
        files = [e for part in parts for e in part]
    if len({e["sha256"] for e in files}) != len(files):
        raise GlmVitError(f"{directory}: the recipe produced duplicate photos (seed {seed}); this is a bug")
    manifest = dict(recipe=RECIPE, count=count, seed=seed, colour_sources=colour, grey_sources=grey,
                    jpeg=sum(e["name"].endswith(".jpg") for e in files),
                    png=sum(e["name"].endswith(".png") for e in files),
                    total_bytes=sum(e["bytes"] for e in files), files=files)
    write_atomic(manifest_path, (json.dumps(manifest, indent=1) + "\n").encode())
    return manifest
