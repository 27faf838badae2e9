"""An image given as a path is what transformers makes of the same path (its load_image: the
first frame, EXIF orientation applied, PIL's convert("RGB"); then the processor), for every PIL
mode in every format that stores it, the eight EXIF orientations and a multi-frame GIF."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import preprocess
from helpers import photo_like

oracle_module = pytest.importorskip("transformers.models.glm5_next.image_processing_pil_glm5_next")

# The modes each format writes and reads back as that mode (Pillow converts the others on save).
FORMAT_MODES = {
    "png": ["1", "L", "LA", "P", "P+transparency", "RGB", "RGBA", "I;16"],
    "jpeg": ["L", "RGB", "CMYK"],
    "webp": ["RGB", "RGBA"],
    "tiff": ["1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F"],
    "gif": ["P", "P+transparency"],
}
CASES = [(fmt, mode) for fmt, modes in FORMAT_MODES.items() for mode in modes]


def make(mode: str, h: int = 45, w: int = 70, seed: int = 0) -> Image.Image:
    """A photo-like image in `mode`; alpha and wide-range modes get values that matter."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(photo_like(h, w, seed))
    if mode == "P+transparency":
        return base.convert("P")
    if mode in ("LA", "RGBA"):
        image = base.convert(mode)
        image.putalpha(Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8)))
        return image
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (h, w)).astype(np.uint16))
    if mode == "I":
        return Image.fromarray(rng.integers(-300, 70000, (h, w)).astype(np.int32))
    if mode == "F":
        return Image.fromarray(rng.uniform(-50, 400, (h, w)).astype(np.float32))
    return base.convert(mode)


def save(image: Image.Image, path, mode: str, **options) -> None:
    if mode == "P+transparency":
        options.update(transparency=7, optimize=False)  # optimize would drop an unused index
    if path.suffix == ".webp":
        options["lossless"] = True
    image.save(path, **options)


def oracle(path):
    out = oracle_module.Glm5NextImageProcessorPil()(images=str(path), return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def assert_same_as_transformers(path) -> np.ndarray:
    ref_pixels, ref_grid = oracle(path)
    pixels, grid = preprocess(path)
    assert np.array_equal(grid, ref_grid) and pixels.shape == ref_pixels.shape
    assert np.array_equal(pixels.view(np.uint32), ref_pixels.view(np.uint32))  # bit for bit
    return pixels


@pytest.mark.parametrize("fmt, mode", CASES, ids=[f"{f}-{m}" for f, m in CASES])
def test_every_mode_in_every_format(tmp_path, fmt, mode):
    path = tmp_path / f"x.{fmt}"
    save(make(mode, seed=len(mode)), path, mode)
    with Image.open(path) as stored:
        assert stored.mode == mode.split("+")[0]
        assert ("transparency" in stored.info) == mode.endswith("transparency")
    assert_same_as_transformers(path)


@pytest.mark.parametrize("fmt", ["jpeg", "png", "webp", "tiff"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation(tmp_path, fmt, orientation):
    path = tmp_path / f"x.{fmt}"
    image = make("RGB", 45, 70, seed=orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    save(image, path, "RGB", exif=exif)
    with Image.open(path) as stored:
        assert stored.getexif().get(0x0112) == orientation
    pixels = assert_same_as_transformers(path)
    with Image.open(path) as stored:
        as_stored, _ = preprocess(stored.convert("RGB"))  # the pixels without the orientation applied
    # Pillow drops a TIFF's orientation tag when it decodes the image, so its exif_transpose (and
    # with it transformers) leaves TIFFs as stored; matched all the same above.
    turned = orientation != 1 and fmt != "tiff"
    assert (pixels.shape == as_stored.shape and np.array_equal(pixels, as_stored)) != turned


def test_multi_frame_gif_uses_the_first_frame(tmp_path):
    frames = [make("RGB", 40, 60, seed=s).convert("P") for s in (1, 2, 3)]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=[50, 80, 120], loop=0)
    with Image.open(path) as stored:
        assert stored.n_frames == 3
        stored.seek(1)
        second, _ = preprocess(stored.convert("RGB"))
    pixels = assert_same_as_transformers(path)
    first, _ = preprocess(frames[0])
    assert np.array_equal(pixels, first) and not np.array_equal(pixels, second)
