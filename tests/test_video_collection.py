"""Videos in collection runs (`encode DIR --out-dir`, clips.py and the pipeline), on the CPU with
the NumPy backend: each video's shard rows, grid and timestamps are exactly what
`GlmVit.encode_video` gives (and each image's what `GlmVit.encode` gives), with videos cut
across forward calls and packed beside images; directories, tar shards and --files-from take
them; a resume skips the videos done; a bad clip fails alone; engine processes (--devices)
write the same bits; the decode pool's frame budget holds."""

from __future__ import annotations

import json
import shutil
import tarfile
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from glmvit_cupy import GlmVit
from glmvit_cupy.collection.clips import FrameBudget
from glmvit_cupy.collection.pipeline import Decoder, plan_pieces
from glmvit_cupy.collection.shards import read_embeddings
from glmvit_cupy.collection.sources import Source, expand_inputs
from glmvit_cupy.processor.preprocess import ProcessorConfig
from glmvit_cupy.processor.video import VideoConfig, video_config
from glmvit_cupy.tower.synthetic import write_checkpoint
from test_pipeline import make_images, records, run
from test_video import write_audio_only, write_clip

PATCHES = 300  # a forward call's budget: two or three temporal groups of these clips, beside images
CALL = ["--max-pixels", str(PATCHES * 14 * 14)]

# name: (frames, rate, height, width, codec); groups of 120, 96, 80, 72 and 432 patches
CLIPS = {
    "a.mp4": (75, Fraction(30000, 1001), 120, 160, "libx264"),  # 3 groups: cut over two calls
    "b.mkv": (96, 24, 160, 96, "libx264"),  # no frame count in the header; 4 groups
    "c.webm": (100, 25, 96, 128, "libvpx-vp9"),  # 2 groups
    "d.mov": (130, 60, 96, 112, "mpeg4"),  # 2 groups
    "big.mp4": (30, 30, 240, 320, "libx264"),  # one group of 432 patches: over the call, fails alone
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """Images budgeted to fit the small calls (75 tokens), videos by their own file (2000 tokens)."""
    directory = write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=1)
    (directory / "preprocessor_config.json").write_text(json.dumps({"max_image_tokens": 75}))
    (directory / "video_preprocessor_config.json").write_text(json.dumps({"max_image_tokens": 2000}))
    return directory


@pytest.fixture(scope="module")
def collection(tmp_path_factory) -> Path:
    """Clips, images, a tar shard of both, and bad clips, in one directory."""
    root = tmp_path_factory.mktemp("collection")
    for i, (name, (frames, rate, h, w, codec)) in enumerate(CLIPS.items()):
        write_clip(root / name, frames, rate, h, w, codec, seed=i)
    make_images(root / "img", 4, seed=31)
    shard = tmp_path_factory.mktemp("tar")
    write_clip(shard / "e.mp4", 60, 30, 64, 80, "libx264", seed=9)
    make_images(shard / "img", 1, seed=32)
    with tarfile.open(root / "data.tar", "w") as tar:
        tar.add(shard / "e.mp4", arcname="s1/clip.mp4")
        tar.add(shard / "img" / "img0000.jpg", arcname="s1/photo.jpg")
    (root / "zz-junk.mp4").write_bytes(b"not a video" * 50)
    fast = write_clip(shard / "fast.mp4", 60, 30, 64, 80, "libx264", options={"movflags": "faststart"})
    (root / "zz-cut.mp4").write_bytes(fast.read_bytes()[:fast.stat().st_size * 6 // 10])
    write_audio_only(root / "zz-audio.mkv")
    return root


@pytest.fixture(scope="module")
def vit(ckpt):
    return GlmVit.from_pretrained(ckpt, backend="numpy", max_pixels=PATCHES * 14 * 14)


def encode(collection: Path, out: Path, ckpt: Path, *extra: str):
    """The directory and its tar shard (a walk takes only image and video files)."""
    return run("encode", str(collection), str(collection / "data.tar"), "--model", str(ckpt), "--out-dir", str(out),
               "--backend", "numpy",
               "--dtype", "float32", "--output", "both", "--workers", "2", "--shard-size", "3", "--quiet", *CALL,
               *extra)


@pytest.fixture(scope="module")
def encoded(collection, ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "embs"
    return encode(collection, out, ckpt), out


def test_clips_and_images_equal_encode_video_and_encode(collection, ckpt, vit, encoded):
    proc, out = encoded
    assert proc.returncode == 1 and "encoded 10, skipped 0, failed 4" in proc.stderr, proc.stderr
    assert " inputs/s, " in proc.stderr and "images/s" not in proc.stderr  # clips are not images
    config, _ = video_config(ckpt)
    got = {(r["path"], r.get("member")): (r, a) for r, a in read_embeddings(out)}
    assert len(got) == 10
    tar = str(collection / "data.tar")
    for name in ("a.mp4", "b.mkv", "c.webm", "d.mov", "data.tar:s1/clip.mp4"):
        if name.startswith("data.tar"):
            record, arrays = got[tar, "s1/clip.mp4"]
            with tarfile.open(tar) as t:
                want = vit.encode_video(t.extractfile("s1/clip.mp4").read(), config=config)
            assert record["key"] == "s1/clip"
        else:
            record, arrays = got[str(collection / name), None]
            want = vit.encode_video(collection / name, config=config)
        for output in ("pooler_output", "last_hidden_state"):  # exact: the same rows, cut elsewhere
            assert np.array_equal(arrays[output], getattr(want, output)), (name, output)
        assert np.array_equal(arrays["grid_thw"], want.grid_thw[0]) and record["grid_thw"] == want.grid_thw[0].tolist()
        assert np.array_equal(arrays["timestamps"], want.timestamps) and arrays["timestamps"].dtype == np.float64
        assert record["kind"] == "video" and record["frames"] == want.frames and record["fps"] == want.fps
        assert record["tokens"] == len(want.pooler_output)
    assert got[str(collection / "a.mp4"), None][0]["grid_thw"] == [3, 10, 12]  # over two forward calls
    assert got[str(collection / "b.mkv"), None][0]["fps"] == 24.0
    images = sorted((collection / "img").glob("*")) + [None]
    for path in images:
        if path is None:
            record, arrays = got[tar, "s1/photo.jpg"]
            with tarfile.open(tar) as t:
                data = t.extractfile("s1/photo.jpg").read()
            want = vit.encode(data, output="both", dtype="float32", workers=0)[0]
        else:
            record, arrays = got[str(path), None]
            want = vit.encode(path, output="both", dtype="float32", workers=0)[0]
        assert record["kind"] == "image" and "timestamps" not in arrays
        for output in ("pooler_output", "last_hidden_state"):
            assert np.array_equal(arrays[output], getattr(want, output)), (path, output)


def test_a_bad_clip_fails_alone_as_one_line(collection, encoded):
    _, out = encoded
    failures = {Path(f["path"]).name: f for f in map(json.loads, (out / "failures.jsonl").read_text().splitlines())}
    assert sorted(failures) == ["big.mp4", "zz-audio.mkv", "zz-cut.mp4", "zz-junk.mp4"]
    reasons = {"big.mp4": "one temporal group: 432 patches exceed p_max 300",
               "zz-audio.mkv": "has no video stream",
               "zz-cut.mp4": "truncated: the header counts",
               "zz-junk.mp4": "not a video PyAV can open"}
    for name, failure in failures.items():
        assert failure["kind"] == "video" and "\n" not in failure["error"]
        assert failure["error"].startswith(f"{collection / name}: {reasons[name]}"), failure["error"]


def test_the_records_of_a_video_and_an_image(collection, encoded):
    _, out = encoded
    lines = {Path(r["path"]).name: r for r in records(out) if r.get("member") is None}
    video, image = lines["a.mp4"], lines["img0000.jpg"]
    assert list(video) == ["path", "kind", "frames", "fps", "timestamps", "bytes", "sha256", "grid_thw", "tokens",
                           "rows"]
    assert video["frames"] == 6 and video["fps"] == 30000 / 1001  # frames 0, 11, 22, 33, 45, 45: groups at 0, 22, 45
    assert video["timestamps"] == [i / (30000 / 1001) for i in (0, 22, 45)]
    assert video["bytes"] == (collection / "a.mp4").stat().st_size
    assert list(image) == ["path", "kind", "bytes", "sha256", "grid_thw", "tokens", "rows"]
    assert image["kind"] == "image"


def test_engine_processes_write_what_one_engine_writes(collection, ckpt, encoded, tmp_path):
    _, one = encoded
    proc = encode(collection, tmp_path / "two", ckpt, "--devices", "0,1")
    assert proc.returncode == 1 and "encoded 10, skipped 0, failed 4" in proc.stderr, proc.stderr
    assert " inputs/s, " in proc.stderr and "images/s" not in proc.stderr  # clips are not images
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (one / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_a_resume_skips_the_videos_done(collection, ckpt, tmp_path):
    """Half the inputs (--files-from), then the whole set: the videos done are not read again (a
    done clip replaced by junk is not noticed), the rest are encoded, one record an input. A
    resume with other video settings is refused; one of images only is not (no video is made)."""
    source = tmp_path / "clips"
    source.mkdir()
    for name in ("a.mp4", "b.mkv", "c.webm", "d.mov"):
        shutil.copy(collection / name, source / name)
    make_images(source / "img", 2, seed=33)
    listing = tmp_path / "first.txt"
    listing.write_text(f"{source / 'a.mp4'}\n{source / 'c.webm'}\n{source / 'img' / 'img0000.jpg'}\n")
    out = tmp_path / "out"
    first = run("encode", "--files-from", str(listing), "--model", str(ckpt), "--out-dir", str(out), "--backend",
                "numpy", "--workers", "1", "--quiet", *CALL)
    assert first.returncode == 0 and "encoded 3, skipped 0, failed 0" in first.stderr, first.stderr
    done = records(out)
    (source / "a.mp4").write_bytes(b"junk")
    again = run("encode", str(source), "--model", str(ckpt), "--out-dir", str(out), "--backend", "numpy",
                "--workers", "1", "--quiet", *CALL)
    assert again.returncode == 0 and "encoded 3, skipped 3, failed 0" in again.stderr, again.stderr
    final = records(out)
    assert final[:3] == done and sorted(r["path"] for r in final) == sorted(
        str(p) for p in [*source.glob("*.*"), *(source / "img").glob("*")])
    other = tmp_path / "ckpt"
    shutil.copytree(ckpt, other)
    (other / "video_preprocessor_config.json").write_text(json.dumps({"max_image_tokens": 2000, "fps": 1}))
    refused = run("encode", str(source), "--model", str(other), "--out-dir", str(out), "--backend", "numpy",
                  "--workers", "1", "--quiet", *CALL)
    assert refused.returncode == 1 and "made with video_processor" in refused.stderr, refused.stderr
    images_only = run("encode", str(source / "img"), "--model", str(other), "--out-dir", str(out), "--backend",
                      "numpy", "--workers", "1", "--quiet", *CALL)
    assert images_only.returncode == 0 and "encoded 0, skipped 2" in images_only.stderr, images_only.stderr


def test_sources_pick_up_videos(collection):
    """Directories, globs and tar shards take the video extensions; a source's kind is its extension's."""
    found = expand_inputs([str(collection), str(collection / "data.tar")])
    kinds = {Path(s.member or s.path).name: s.kind for s in found}
    assert kinds["a.mp4"] == kinds["b.mkv"] == kinds["c.webm"] == kinds["d.mov"] == kinds["clip.mp4"] == "video"
    assert kinds["img0000.jpg"] == kinds["photo.jpg"] == "image"
    assert [s.path for s in expand_inputs([str(collection / "*.m??")])] == [
        str(collection / n) for n in ("a.mp4", "b.mkv", "big.mp4", "d.mov", "zz-audio.mkv", "zz-cut.mp4",
                                      "zz-junk.mp4")]
    member = next(s for s in found if s.member == "s1/clip.mp4")
    with member.open() as f, tarfile.open(member.path) as tar:
        assert f.read() == tar.extractfile("s1/clip.mp4").read() and f.name == f"{member.path}:s1/clip.mp4"


def test_a_decoder_without_video_settings_refuses_a_video_alone(collection):
    """The library's encode_iter and the Ray embedder take images only: a video among their
    inputs fails alone, saying where videos go."""
    items = [Source(str(collection / "a.mp4")), Source(str(collection / "img" / "img0000.jpg"))]
    video, image = Decoder(0, ProcessorConfig()).map(items)
    assert video.error == (f"{collection / 'a.mp4'}: a video; this run takes images only (glmvit-cupy encode "
                           "--out-dir and GlmVit.encode_video take videos)")
    assert image.error is None


def test_the_packer_cuts_videos_between_groups():
    """Inputs of (groups, patches a group): a video's groups fill what a batch has left and go
    on in the next; an image is one group; a group over the budget goes alone."""
    batches = plan_pieces([(1, 100), (5, 120), (1, 50), (2, 400), (1, 10)], 300)
    assert [[(p.owner, p.first, p.stop) for p in b] for b in batches] == [
        [(0, 0, 1), (1, 0, 1)], [(1, 1, 3)], [(1, 3, 5), (2, 0, 1)], [(3, 0, 1)], [(3, 1, 2)], [(4, 0, 1)]]


def test_the_frame_budget_holds_back_videos_decoded_ahead(collection):
    """Worker processes stream each video's frames into the main process, where at most the
    budget's bytes wait beyond the video the pipeline is on; with no room at all, one video at a
    time. The frames are those decoded in this thread."""
    config = VideoConfig(max_image_tokens=2000)
    items = [Source(str(collection / n)) for n in ("a.mp4", "b.mkv", "c.webm", "d.mov", "zz-cut.mp4")]
    want = list(Decoder(0, ProcessorConfig(), video=config).map(items))
    decoder = Decoder(2, ProcessorConfig(), video=config)
    budget = decoder.pool.budget
    budget.limit = 1
    try:
        got = list(decoder.map(items))
    finally:
        decoder.close()
    assert [g.error for g in got] == [w.error for w in want] and want[-1].error.startswith(
        f"{collection / 'zz-cut.mp4'}: truncated: the header counts")
    for g, w in zip(got[:-1], want[:-1]):
        assert np.array_equal(g.canvas, w.canvas) and g.video == w.video and g.sha256 == w.sha256
    assert budget.held == 0 and budget.peak == max(w.canvas.nbytes for w in want[:-1])


def test_the_frame_budget_lets_the_head_through():
    budget = FrameBudget(limit=100)
    budget.take("a", 80)
    budget.head("b")
    budget.take("b", 500)  # the input waited for goes ahead, over the limit
    assert (budget.held, budget.peak) == (580, 580)
    budget.give(580)
    budget.take("c", 100)
    assert budget.held == 100
