"""Video equals transformers 5.23: Glm5NextVideoProcessor (frames decoded by its PyAV loader) and
Glm5NextModel.get_video_features in float32, on clips written here with PyAV.

The processor imports torchvision, which does not import beside the test environment's torch, so
the oracle runs in its own venv (torch 2.14.1 + torchvision 0.29.1 + transformers 5.23.0, see
README.md, Tests): tests/video_oracle.py in a subprocess with that venv's python, named by
GLMVIT_VIDEO_ORACLE (.ci/run sets it); without it the parity tests skip, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit, GlmVitError
from glmvit_cupy.processor.video import VideoConfig, open_video, sample_frames, video_config, video_frames
from glmvit_cupy.tower.synthetic import photo_like, write_checkpoint
from helpers import TINY_TEXT, rel_err

av = pytest.importorskip("av", reason="PyAV (the [video] extra) is not installed")

ORACLE = os.environ.get("GLMVIT_VIDEO_ORACLE")
needs_oracle = pytest.mark.skipif(
    not ORACLE or not Path(ORACLE).is_file(),
    reason="no video oracle: set GLMVIT_VIDEO_ORACLE to the python of a venv with transformers==5.23.0, "
           "torch==2.14.1, torchvision==0.29.1 and av (.ci/run builds one)")
PADDED, SCALED = 1e-4, 1e-3  # frames only padded; frames the budget scales (up or down)


def write_clip(path: Path, frames: int, rate, height: int, width: int, codec: str, seed: int = 0,
               options: dict | None = None) -> Path:
    """A clip panning across a photo-like picture, `frames` frames at `rate` frames per second."""
    scene = photo_like(height, width + 2 * frames, seed)
    with av.open(str(path), "w", options=options or {}) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(scene[:, 2 * i:2 * i + width]), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def write_audio_only(path: Path) -> Path:
    """A Matroska file of 0.1 s of silence and no video stream."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    return path


# name: (file, frames, rate, height, width, codec, checkpoint); the checkpoints' configs below
CLIPS = {
    "mp4_2997": ("a.mp4", 75, Fraction(30000, 1001), 120, 160, "libx264", "plain"),  # 5 sampled, padded to 6
    "mkv_portrait": ("b.mkv", 96, 24, 160, 96, "libx264", "fps3"),  # no frame count in the header
    "webm_25": ("c.webm", 75, 25, 96, 128, "libvpx", "videofile"),  # 60 tokens: exactly the budget
    "mov_60": ("d.mov", 90, 60, 96, 112, "mpeg4", "plain"),  # 3 sampled (linspace), padded to 4
    "avi_scaled_down": ("e.avi", 90, 30, 240, 320, "mjpeg", "small"),  # over the budget
    "mp4_enlarged": ("f.mp4", 30, 30, 24, 32, "libx264", "plain"),  # under the minimum budget
    "mkv_every_frame": ("g.mkv", 9, 30, 64, 80, "libx264", "unsampled"),  # 9 frames: round(4.5) frames' budget
    "mp4_1fps": ("h.mp4", 4, 1, 96, 112, "libx264", "plain"),  # fewer frames than 2 a second: duplicates dropped
}
SCALED_CASES = {"avi_scaled_down", "mp4_enlarged"}
CONFIGS = {
    "plain": {},  # no processor config: the video processor's defaults
    # processor_config.json's video_processor wins over the image processor's file beside it
    "fps3": {"processor_config.json": {"video_processor": {"fps": 3, "max_frames": 9}},
             "preprocessor_config.json": {"max_image_tokens": 20}},
    # video_preprocessor_config.json wins over the image processor's file
    "videofile": {"video_preprocessor_config.json": {"max_image_tokens": 60},
                  "preprocessor_config.json": {"max_image_tokens": 20}},
    # only the image processor's file: it applies to video too (a 40-token budget, 2 s of the clip)
    "small": {"preprocessor_config.json": {"max_image_tokens": 40, "max_duration": 2}},
    "unsampled": {"video_preprocessor_config.json": {"do_sample_frames": False}},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=1)
    dirs = {}
    for name, files in CONFIGS.items():
        directory = tmp_path_factory.mktemp("ckpt") / name
        shutil.copytree(base, directory)
        for file, content in files.items():
            (directory / file).write_text(json.dumps(content))
        dirs[name] = directory
    return dirs


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    directory = tmp_path_factory.mktemp("clips")
    return {name: write_clip(directory / file, n, rate, h, w, codec, seed=i)
            for i, (name, (file, n, rate, h, w, codec, _)) in enumerate(CLIPS.items())}


@pytest.fixture(scope="module")
def given_frames(tmp_path_factory):
    """Five frames a caller decoded (an odd count), with their timestamps."""
    frames = np.stack([photo_like(70, 90, seed=20 + i) for i in range(5)])
    path = tmp_path_factory.mktemp("frames") / "frames.npy"
    np.save(path, frames)
    return path, frames, [0.0, 0.4, 0.8, 1.2, 1.6]


@pytest.fixture(scope="module")
def oracle(checkpoints, clips, given_frames, tmp_path_factory):
    """transformers' outputs for every clip, one subprocess for all (torch imports once)."""
    out = tmp_path_factory.mktemp("oracle")
    cases = [dict(name=name, path=str(clips[name]), model=str(checkpoints[CLIPS[name][-1]])) for name in CLIPS]
    cases.append(dict(name="given_frames", frames=str(given_frames[0]), model=str(checkpoints["plain"])))
    job = out / "job.json"
    job.write_text(json.dumps(dict(text_config=TINY_TEXT, cases=cases)))
    script = Path(__file__).with_name("video_oracle.py")
    run = subprocess.run([ORACLE, str(script), str(job), str(out)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"the video oracle failed:\n{run.stderr[-3000:]}"
    return {case["name"]: dict(np.load(out / f"{case['name']}.npz")) for case in cases}


def engine(checkpoint: Path, **options) -> GlmVit:
    """A NumPy engine whose forward calls hold any group of these clips: by default the budget
    follows the image processor's max_image_tokens, 20 in fps3's preprocessor_config.json."""
    return GlmVit.from_pretrained(checkpoint, backend="numpy", **{"max_pixels": 14 * 14 * 2048, **options})


def assert_embeddings(out, ref: dict, bound: float) -> None:
    assert out.pooler_output.shape == ref["pooler_output"].shape
    assert rel_err(out.pooler_output, ref["pooler_output"]) < bound
    assert rel_err(out.last_hidden_state, ref["last_hidden_state"]) < bound


@needs_oracle
@pytest.mark.parametrize("name", list(CLIPS))
def test_clip_equals_transformers(name, checkpoints, clips, oracle):
    ref = oracle[name]
    config, _ = video_config(checkpoints[CLIPS[name][-1]])
    frames = open_video(clips[name], config)
    pixels = frames.pixel_values()
    assert np.array_equal(frames.grid_thw, ref["video_grid_thw"])
    assert frames.fps == float(ref["fps"]) and frames.frame_count == int(ref["total_num_frames"])
    # torchvision's uint8 resize is reproduced integer for integer, so scaled frames match bit for bit too
    assert pixels.shape == ref["pixel_values_videos"].shape
    assert np.array_equal(pixels.view(np.uint32), ref["pixel_values_videos"].view(np.uint32))
    out = engine(checkpoints[CLIPS[name][-1]]).encode_video(clips[name])  # the checkpoint's own config
    assert np.array_equal(out.grid_thw, ref["video_grid_thw"])
    assert np.array_equal(out.timestamps, ref["timestamps"])  # exact: frame index / fps, as the processor
    assert out.frames == len(ref["frames_indices"]) and out.fps == float(ref["fps"])
    assert_embeddings(out, ref, SCALED if name in SCALED_CASES else PADDED)


@needs_oracle
def test_sampling_equals_transformers(checkpoints, clips, oracle):
    """Our sampler's indices from the header's numbers are the processor's, for every clip; and
    they show the quirks: the issue's example (2.5 s at 29.97 fps: frames 0, 11, 22, 33, 45, the odd
    count padded), the evenly spaced fallbacks, max_duration, every frame when not sampling."""
    for name in CLIPS:
        config, _ = video_config(checkpoints[CLIPS[name][-1]])
        ref = oracle[name]
        total, fps = int(ref["total_num_frames"]), float(ref["fps"])
        ours = sample_frames(total, fps, total / fps, config) if config.do_sample_frames else list(range(total))
        assert ours == ref["frames_indices"].tolist(), name
    assert oracle["mp4_2997"]["frames_indices"].tolist() == [0, 11, 22, 33, 45, 45]
    assert oracle["mov_60"]["frames_indices"].tolist() == [0, 15, 30, 30]
    assert oracle["mkv_portrait"]["frames_indices"].tolist() == [0, 11, 23, 35, 47, 59, 71, 83, 95, 95]
    assert oracle["avi_scaled_down"]["frames_indices"].tolist() == [0, 29, 59, 89]  # max_duration 2 of 3 s
    assert oracle["mkv_every_frame"]["frames_indices"].tolist() == list(range(9))
    assert oracle["mp4_1fps"]["frames_indices"].tolist() == [0, 1, 2, 3]
    assert open_video(clips["avi_scaled_down"], video_config(checkpoints["small"])[0]).frames[0].shape == (105, 140, 3)


@needs_oracle
def test_split_across_forward_calls(checkpoints, clips, oracle):
    """A budget of one temporal group a forward call: three calls, reassembled in order."""
    vit = engine(checkpoints["plain"], max_pixels=14 * 14 * 120)
    out = vit.encode_video(clips["mp4_2997"])
    assert vit.p_max == 120 and out.grid_thw.tolist() == [[3, 10, 12]]  # 120 patches a group
    assert_embeddings(out, oracle["mp4_2997"], PADDED)


def test_a_group_over_one_forward_call_is_refused(checkpoints, clips):
    vit = engine(checkpoints["plain"], max_pixels=14 * 14 * 116)
    with pytest.raises(GlmVitError, match=r"a.mp4: one temporal group is 120 patches, over the 116 of one forward call"):
        vit.encode_video(clips["mp4_2997"])


# (source h, w) -> (out h, w): both axes of float32 sums (1080p to the budget of clip-005 of the
# benchmark), both of float64 (scaled down ~2.6x: the 10-minute clip's), one of each, enlarged,
# one pixel, and 4K scaled down 5x.
RESIZES = [((1080, 1920), (1008, 1792)), ((1080, 1920), (420, 728)), ((64, 80), (13, 300)), ((24, 32), (56, 84)),
           ((100, 100), (1, 1)), ((2160, 3840), (420, 728))]
TORCHVISION_RESIZE = """import sys, numpy as np, torch
from torchvision.transforms.v2 import InterpolationMode, functional
inputs, out = np.load(sys.argv[1]), {}
for name in inputs.files:  # HxWx3 uint8 named h_w_outh_outw
    image = torch.from_numpy(inputs[name]).permute(2, 0, 1)
    size = [int(v) for v in name.split("_")[2:]]
    out[name] = functional.resize(image, size, InterpolationMode.BICUBIC, antialias=True).permute(1, 2, 0).numpy()
np.savez(sys.argv[2], **out)
"""


@needs_oracle
def test_resize_equals_torchvision_byte_for_byte(tmp_path):
    """video.resize_uint8 against torchvision's own uint8 resize (the processor's), on sizes whose
    sums take the float32 products, the float64 ones, and one of each."""
    from glmvit_cupy.processor.video import _bands, resize_uint8

    assert {_bands(a, b)[0][0][4].dtype.name for (h, w), (oh, ow) in RESIZES
            for a, b in ((h, oh), (w, ow)) if a != b} == {"float32", "float64"}
    images = {f"{h}_{w}_{oh}_{ow}": photo_like(h, w, seed=h + w) for (h, w), (oh, ow) in RESIZES}
    np.savez(tmp_path / "in.npz", **images)
    run = subprocess.run([ORACLE, "-c", TORCHVISION_RESIZE, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    want = np.load(tmp_path / "out.npz")
    for name, image in images.items():
        oh, ow = map(int, name.split("_")[2:])
        got = resize_uint8(image, oh, ow)
        assert got.shape == want[name].shape and np.array_equal(got, want[name]), \
            f"{name}: {np.count_nonzero(got != want[name])} values differ"


def test_only_sampled_frames_are_kept(tmp_path):
    """20 s of 320x240 frames (138 MB raw) at a budget that scales them to 168x126: decoding holds
    the 40 sampled frames, scaled as they come (2.5 MB), not the clip. Measured as the growth of
    the peak RSS of a fresh process (decoded frames live in FFmpeg's buffers, which tracemalloc
    does not see), after a short clip has loaded the decoder. The peak is VmHWM, not ru_maxrss,
    which the child inherits from this process (pytest's, larger: the growth would read 0)."""
    warm = write_clip(tmp_path / "warm.mp4", 30, 30, 240, 320, "libx264")
    clip = write_clip(tmp_path / "long.mp4", 600, 30, 240, 320, "libx264")
    code = ("from glmvit_cupy.processor.video import VideoConfig, open_video\n"
            "def peak(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])\n"
            f"open_video({str(warm)!r})\n"
            "before = peak()\n"
            f"frames = open_video({str(clip)!r}, VideoConfig(max_image_tokens=600))\n"
            "grown = peak() - before\n"
            "print(len(frames.frames), frames.frames[0].shape, grown >> 10)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("40 (126, 168, 3)"), run.stdout
    grown_mib = int(run.stdout.split()[-1])
    assert grown_mib < 20, f"decoding grew the peak RSS by {grown_mib} MiB"


@needs_oracle
def test_frames_given_by_the_caller(checkpoints, given_frames, oracle):
    _, frames, timestamps = given_frames
    ref = oracle["given_frames"]
    out = engine(checkpoints["plain"]).encode_video((list(frames), timestamps))
    assert np.array_equal(out.grid_thw, ref["video_grid_thw"])
    assert out.timestamps.tolist() == [0.0, 0.8, 1.6] and out.frames == 5 and out.fps is None
    assert_embeddings(out, ref, PADDED)


def test_bytes_and_file_objects_equal_the_path(checkpoints, clips):
    vit = engine(checkpoints["plain"])
    path = clips["mov_60"]
    by_path = vit.encode_video(path)
    with open(path, "rb") as file:
        by_file = vit.encode_video(file)
    by_bytes = vit.encode_video(path.read_bytes())
    for out in (by_file, by_bytes):
        assert np.array_equal(out.pooler_output, by_path.pooler_output)
        assert np.array_equal(out.timestamps, by_path.timestamps)


def test_config_sources(checkpoints):
    config, sources = video_config(checkpoints["fps3"])
    assert (config.fps, config.max_frames, config.max_image_tokens) == (3.0, 9, 240_000)
    assert sources["fps"] == "processor_config.json video_processor" and sources["max_image_tokens"] == "default"
    config, sources = video_config(checkpoints["videofile"])
    assert (config.max_image_tokens, sources["max_image_tokens"]) == (60, "video_preprocessor_config.json")
    config, sources = video_config(checkpoints["small"], min_image_tokens=8)
    assert (config.max_image_tokens, sources["max_image_tokens"]) == (40, "preprocessor_config.json")
    assert (config.min_image_tokens, sources["min_image_tokens"]) == (8, "option")
    assert video_config(checkpoints["plain"])[0] == VideoConfig()


def _patched(source: Path, target: Path, edit) -> Path:
    data = bytearray(source.read_bytes())
    edit(data)
    target.write_bytes(bytes(data))
    return target


def test_bad_videos_are_one_line_naming_the_file(tmp_path):
    def refused(path, reason):
        with pytest.raises(GlmVitError, match=f"^{path}: {reason}") as caught:
            open_video(path)
        assert "\n" not in str(caught.value)

    refused(tmp_path / "nope.mp4", "no such video file")
    (tmp_path / "junk.mp4").write_bytes(b"not a video at all" * 10)
    refused(tmp_path / "junk.mp4", "not a video PyAV can open")
    plain = write_clip(tmp_path / "plain.mp4", 60, 30, 64, 80, "libx264")  # its index (moov) at the end
    (tmp_path / "cut.mp4").write_bytes(plain.read_bytes()[:plain.stat().st_size // 2])
    refused(tmp_path / "cut.mp4", r"not a video PyAV can open \(a truncated file")
    faststart = write_clip(tmp_path / "fast.mp4", 60, 30, 64, 80, "libx264", options={"movflags": "faststart"})
    (tmp_path / "fast_cut.mp4").write_bytes(faststart.read_bytes()[:faststart.stat().st_size * 6 // 10])
    refused(tmp_path / "fast_cut.mp4", r"truncated: the header counts 60 frames, only 7 decode \(frame 15 was to be "
                                       r"sampled\)")  # on frame threads the cut ends the decode without an error
    mid = bytearray(write_clip(tmp_path / "mid.mp4", 90, 30, 120, 160, "libx264", options={"movflags": "faststart"})
                    .read_bytes())
    mid[len(mid) // 2:len(mid) // 2 + 200] = np.random.default_rng(1).integers(0, 256, 200, dtype=np.uint8).tobytes()
    (tmp_path / "corrupt.mp4").write_bytes(bytes(mid))  # 200 bytes of noise half way through the frames
    refused(tmp_path / "corrupt.mp4", r"cannot decode frame \d+ \(a truncated or corrupt file")
    mkv = write_clip(tmp_path / "full.mkv", 60, 30, 64, 80, "libx264")
    data = mkv.read_bytes()
    (tmp_path / "no_frames.mkv").write_bytes(data[:data.find(b"\x1f\x43\xb6\x75") + 8])  # up to the first cluster
    refused(tmp_path / "no_frames.mkv", "the video stream has no frames")
    refused(write_audio_only(tmp_path / "audio.mkv"), "has no video stream")
    one = write_clip(tmp_path / "one.mp4", 1, 30, 64, 80, "libx264")  # its one sample made 0 s long
    refused(_patched(one, tmp_path / "no_rate.mp4", lambda b: b.__setitem__(slice(b.find(b"stts") + 16, b.find(b"stts") + 20), bytes(4))),
            "the container gives no frame rate")
    mjpeg = write_clip(tmp_path / "m.avi", 20, 30, 64, 80, "mjpeg")
    refused(_patched(mjpeg, tmp_path / "unknown.avi", lambda b: b.__setitem__(slice(None), b.replace(b"MJPG", b"QQQQ"))),
            "its video codec has no decoder")
    raw = write_clip(tmp_path / "raw.avi", 4, 30, 64, 80, "rawvideo")

    def no_size(b):  # the main header's and the stream format's width and height set to 0
        main, fmt = b.find(b"avih") + 8, b.find(b"strf") + 12
        b[main + 32:main + 40] = bytes(8)
        b[fmt:fmt + 8] = bytes(8)
    refused(_patched(raw, tmp_path / "zero.avi", no_size), "the video stream is 0x0 pixels")
    short = write_clip(tmp_path / "short.mp4", 10, 30, 64, 80, "libx264")
    refused(short, r"0.33 s at 30 fps is too short to sample a frame at 2 fps")


def test_bad_frames():
    frames = [photo_like(30, 40, seed=i) for i in range(3)]
    with pytest.raises(GlmVitError, match="3 frames but 2 timestamps"):
        video_frames(frames, [0.0, 0.5])
    with pytest.raises(GlmVitError, match=r"frame 1 is 20x30, frame 0 40x30"):
        video_frames([frames[0], frames[1][:, :20]], [0.0, 0.5])
    with pytest.raises(GlmVitError, match=r"frame 0 has shape \[30, 40\] and dtype float64"):
        video_frames([np.zeros((30, 40))], [0.0])


def test_without_pyav_a_video_is_one_line_naming_the_extra(clips):
    code = ("import sys; sys.modules['av'] = None\n"  # PyAV not importable, as where the extra is not installed
            "from glmvit_cupy.processor.video import open_video\n"
            f"open_video({str(clips['mov_60'])!r})\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode != 0 and 'GlmVitError: videos need PyAV, the [video] extra: pip install -e ".[video]"' in run.stderr


def test_cli_encodes_videos_into_an_npz(tmp_path, checkpoints, clips):
    """`glmvit-cupy encode a.mov b.mp4 --out emb.npz`: each video's rows, grid and timestamps,
    as encode_video gives them; a mistake is one line."""
    def cli(*args):
        return subprocess.run([sys.executable, "-c", "import cli; cli.main()", "encode", *map(str, args),
                               "--model", str(checkpoints["plain"]), "--backend", "numpy"],
                              capture_output=True, text=True)

    names = ["mov_60", "mp4_2997"]
    run = cli(*[clips[n] for n in names], "--out", tmp_path / "emb.npz", "--output", "both")
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip().endswith("2 video(s), 5 temporal groups, 122 tokens x 256 (pooler_output, "
                                       "last_hidden_state), backend numpy")
    saved = np.load(tmp_path / "emb.npz")
    vit = engine(checkpoints["plain"])
    outs = [vit.encode_video(clips[n]) for n in names]
    for name in ("pooler_output", "last_hidden_state"):
        assert np.array_equal(saved[name], np.concatenate([getattr(o, name) for o in outs]))
    assert saved["grid_thw"].tolist() == [o.grid_thw[0].tolist() for o in outs]
    assert saved["offsets"].tolist() == [0, len(outs[0].pooler_output), 122]
    assert np.array_equal(saved["timestamps"], np.concatenate([o.timestamps for o in outs]))
    assert saved["frames"].tolist() == [4, 6] and saved["fps"].tolist() == [60.0, 30000 / 1001]
    one = tmp_path / "dir"  # a directory (or a tar shard) of videos: the same, found by the expansion
    one.mkdir()
    shutil.copy(clips["mov_60"], one / "clip.mov")
    run = cli(one, "--out", tmp_path / "dir.npz")
    assert run.returncode == 0, run.stderr
    assert np.array_equal(np.load(tmp_path / "dir.npz")["pooler_output"], outs[0].pooler_output)
    image = tmp_path / "x.png"
    Image.fromarray(photo_like(30, 40, seed=1)).save(image)
    for args, words in (((clips["mov_60"], "--out", tmp_path / "emb.npy"), "videos go into a float32 .npz"),
                        ((clips["mov_60"], image, "--out", tmp_path / "x.npz"), "--out takes images or videos, not both"),
                        ((tmp_path / "missing.mp4", "--out", tmp_path / "x.npz"), "missing.mp4: no such file")):
        run = cli(*args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1 and words in lines[0], run.stderr


def test_info_shows_the_video_processor_and_its_sources(checkpoints):
    """`glmvit-cupy info` lists the video processor's settings as it does the image processor's,
    each with where it came from (the budget options set both, as encode does)."""
    run = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "info", "--model", str(checkpoints["fps3"]),
                          "--min-image-tokens", "8"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()]
    video = next(i for i, row in enumerate(rows) if row[:2] == ["video", "processor"])
    assert rows[video][2:] == [str(checkpoints["fps3"] / "processor_config.json"), "(its", "video_processor)"]
    settings = {row[0]: row[1:] for row in rows[video + 1:]}
    assert settings["fps"] == ["3.0", "[processor_config.json", "video_processor]"]
    assert settings["max_frames"] == ["9", "[processor_config.json", "video_processor]"]
    assert settings["max_image_tokens"] == ["240000", "[default]"]
    assert settings["min_image_tokens"] == ["8", "[option]"]
    assert len(settings) == len(VideoConfig.__dataclass_fields__)
    plain = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "info", "--model", str(checkpoints["plain"])],
                           capture_output=True, text=True)
    assert ("video processor no processor_config.json, video_preprocessor_config.json or preprocessor_config.json: "
            "transformers' defaults") in " ".join(plain.stdout.split())


@pytest.mark.parametrize("settings, message", [
    ({"resample": 2}, r"resample 2: only bicubic \(3\)"),
    ({"fps": 0}, "fps 0.0 must be positive"),
    ({"max_frames": 0}, "max_frames 0 must be a positive integer"),
    ({"do_sample_frames": "no"}, "do_sample_frames 'no' must be true or false"),
    ({"max_image_tokens": None, "min_image_tokens": 300000}, r"image token budget \[300000, 240000\] is empty"),
])
def test_bad_settings_name_the_file(tmp_path, settings, message):
    file = {k: v for k, v in settings.items() if v is not None}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(file))
    with pytest.raises(GlmVitError, match=f"^{tmp_path / 'video_preprocessor_config.json'}: video processor: {message}"):
        video_config(tmp_path)
    with pytest.raises(GlmVitError, match=f"^options: video processor: {message}"):
        video_config(None, **file)
