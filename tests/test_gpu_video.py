"""Videos on a real GPU (marked `gpu`): the device patchify of video frames, bit for bit; and
`encode_video` and a video collection (`encode --out-dir`, videos cut across forward calls and
packed beside images; `--devices`) through the CuPy engine, held to the float32 NumPy reference
within the image tests' same-precision bound: test_gpu.BASELINE_FACTOR x the error of that
reference with every GEMM's activation operand rounded to BF16, on the same weights and clips."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit
from glmvit_cupy.bf16 import bf16_round
from glmvit_cupy.collection.shards import read_embeddings
from glmvit_cupy.processor.preprocess import ProcessorConfig, canvas, canvas_grid, patchify, pixel_table
from glmvit_cupy.processor.video import VideoConfig, open_video, patchify_frames, video_config, video_pixel_table
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from glmvit_cupy.tower.reference import NumpyTower
from helpers import KERNEL_SETS, photo_like, rel_err, skip_unless_available
from test_gpu import BASELINE_FACTOR
from test_video import write_clip

pytestmark = pytest.mark.gpu
# name: (frames, rate, height, width, codec): groups of 768 and 1196 patches (32x24, 26x46)
CLIPS = {"pan.mp4": (75, Fraction(30000, 1001), 448, 336, "libx264"),  # 3 groups
         "portrait.webm": (50, 25, 640, 360, "libvpx-vp9")}  # 2 groups
CALL_PATCHES = 2000  # the collection's forward calls: two groups of pan.mp4, one of portrait.webm, with images


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clips")
    for i, (name, (frames, rate, h, w, codec)) in enumerate(CLIPS.items()):
        write_clip(directory / name, frames, rate, h, w, codec, seed=40 + i)
    return directory


@pytest.fixture(scope="module")
def ckpt(real_ckpt, tmp_path_factory):
    """The real-geometry tower (its files linked) with images budgeted to fit the collection's
    small calls and videos to keep their size."""
    directory = tmp_path_factory.mktemp("ckpt") / "real"
    directory.mkdir()
    for path in real_ckpt.iterdir():
        if path.name not in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"):
            (directory / path.name).symlink_to(path.resolve())
    (directory / "preprocessor_config.json").write_text(json.dumps({"max_image_tokens": 400}))
    (directory / "video_preprocessor_config.json").write_text(json.dumps({"max_image_tokens": 20000}))
    return directory


@pytest.fixture(scope="module")
def references(ckpt, clips):
    """Per clip: (the float32 reference's VideoOutput, the BF16-input baseline's)."""
    config, _ = video_config(ckpt)
    ref = GlmVit.from_pretrained(ckpt, backend="numpy")
    baseline = GlmVit(NumpyTower(bind_checkpoint(ckpt), ref.p_max, gemm_inputs=bf16_round), "numpy", "",
                      ref.fingerprint, ref.processor, ckpt)
    return {name: (ref.encode_video(clips / name, config=config), baseline.encode_video(clips / name, config=config))
            for name in CLIPS}


def assert_within_bound(got: dict, ref, base, what: str) -> None:
    for output in ("pooler_output", "last_hidden_state"):
        ours, floor = rel_err(got[output], getattr(ref, output)), rel_err(getattr(base, output), getattr(ref, output))
        print(f"{what} {output}: ours {ours:.3e} = {ours / floor:.2f}x the bf16-input baseline {floor:.3e}")
        assert np.isfinite(got[output]).all() and ours <= BASELINE_FACTOR * floor, (what, output, ours, floor)


@pytest.fixture(scope="module")
def vit(ckpt):
    return GlmVit.from_pretrained(ckpt, backend="cupy")


def test_device_patchify_of_video_frames_is_bit_identical_to_the_cpu_path(vit, clips):
    """patchify_u8 over one batch of an image's canvas and a video's groups (their frames a
    stride apart, normalised by the video processor's table) gives the BF16 bits that
    f32_to_bf16 gives of the CPU path's float32 pixel_values."""
    import cupy

    k, processor, config = vit.tower.k, ProcessorConfig(), VideoConfig()
    image = canvas(photo_like(300, 200, seed=5))
    video = open_video(clips / "pan.mp4", config)
    frames = np.zeros((len(video.frames), *video.canvas, 3), dtype=np.uint8)
    for row, frame in zip(frames, video.frames):
        row[:frame.shape[0], :frame.shape[1]] = frame
    pixels = np.concatenate([patchify(image, processor), patchify_frames(frames, config)])
    want = cupy.empty(pixels.shape, dtype=cupy.uint16)
    k.f32_to_bf16(cupy.asarray(pixels), want)
    per_image, per_group = int(np.prod(canvas_grid(image.shape))), video.patches_per_group
    entries = [(0, 0, image.shape[1] // 14, 0)]
    entries += [(per_image + g * per_group, image.size + 2 * g * frames[0].size, frames.shape[2] // 14, frames[0].size)
                for g in range(video.groups)]
    flat = np.concatenate([image.reshape(-1), frames.reshape(-1)])
    tables = np.stack([pixel_table(processor), video_pixel_table(config)])
    got = cupy.full(pixels.shape, 0xFFFF, dtype=cupy.uint16)
    k.patchify_u8(cupy.asarray(flat), cupy.asarray(np.array(entries, dtype=np.int32)), len(entries),
                  cupy.asarray(tables), got, 14, 2)
    assert np.array_equal(got.get(), want.get())


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_encode_video_within_the_same_precision_bound(ckpt, clips, references, kernels):
    """Each clip in one forward call, and cut into one temporal group a call (reassembled in
    order): grid and timestamps exact, the rows within the bound, on both kernel sets."""
    skip_unless_available(kernels)
    config, _ = video_config(ckpt)
    for max_pixels in (3 * 1196 * 14 * 14, 1196 * 14 * 14):
        vit = GlmVit.from_pretrained(ckpt, backend="cupy", kernels=kernels, max_pixels=max_pixels)
        for name in CLIPS:
            out = vit.encode_video(clips / name, config=config)
            ref, base = references[name]
            assert np.array_equal(out.grid_thw, ref.grid_thw) and np.array_equal(out.timestamps, ref.timestamps)
            assert_within_bound({"pooler_output": out.pooler_output, "last_hidden_state": out.last_hidden_state},
                                ref, base, f"{name} {kernels} p_max {vit.p_max}")


def test_a_video_collection_within_the_bound_and_the_same_on_engine_processes(ckpt, clips, references, tmp_path):
    """`encode DIR --out-dir` with the CuPy engine: each video's rows (cut across calls of 2000
    patches, packed beside images) within the bound of the reference's encode_video; `--devices
    all` (engine processes) writes the same bits as the engine in the CLI's process."""
    for i in range(6):
        Image.fromarray(photo_like(200 + 40 * i, 300 - 30 * i, seed=60 + i)).save(clips / f"img{i}.png")
    outs = {}
    for name, extra in (("one", []), ("devices", ["--devices", "all"])):
        outs[name] = tmp_path / name
        proc = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "encode", str(clips), "--model",
                               str(ckpt), "--out-dir", str(outs[name]), "--backend", "cupy", "--dtype", "float32",
                               "--output", "both", "--max-pixels", str(CALL_PATCHES * 14 * 14), "--workers", "2",
                               "--quiet", *extra], capture_output=True, text=True)
        assert proc.returncode == 0 and "encoded 8, skipped 0, failed 0" in proc.stderr, proc.stderr
        print(f"({name}) {proc.stderr.strip().splitlines()[-1]}")
    for record, arrays in read_embeddings(outs["one"]):
        if record["kind"] == "video":
            name = record["path"].rsplit("/", 1)[1]
            ref, base = references[name]
            assert record["grid_thw"] == ref.grid_thw[0].tolist() and np.array_equal(arrays["timestamps"], ref.timestamps)
            assert_within_bound(arrays, ref, base, f"{name} in a collection")
    names = sorted(p.name for p in outs["one"].iterdir())
    assert names == sorted(p.name for p in outs["devices"].iterdir())
    for name in names:
        assert (outs["one"] / name).read_bytes() == (outs["devices"] / name).read_bytes(), name
