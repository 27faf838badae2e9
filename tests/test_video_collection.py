"""Videos in collection runs (`encode DIR --out-dir`, clips.py and the pipeline), on the CPU with
the NumPy backend: each video's shard rows, grid and timestamps are exactly what
`GlmVit.encode_video` gives (and each image's what `GlmVit.encode` gives), with videos cut
across forward calls and packed beside images; directories, tar shards and --files-from take
them; a resume skips the videos done; a bad clip fails alone; engine processes (--devices)
write the same bits; the decode pool's frame budget holds."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from glmvit_cupy import GlmVit
from glmvit_cupy.collection import pipeline
from glmvit_cupy.collection.clips import FrameBudget, Groups, wait_for_any
from glmvit_cupy.collection.pipeline import Decoder, Encoded, Part, Reserve, encode_prepared, plan_pieces
from glmvit_cupy.collection.shards import read_embeddings
from glmvit_cupy.collection.sources import Source, expand_inputs
from glmvit_cupy.processor.preprocess import ProcessorConfig
from glmvit_cupy.processor.video import VideoConfig, video_config
from glmvit_cupy.tower.checkpoint import read_header
from glmvit_cupy.tower.synthetic import write_checkpoint
from helpers import assert_same_outputs, assert_same_rows
from test_batcher import _decode_children
from test_pipeline import CLI as CLI_ARGS, make_images, records, run
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


def as_they_come(groups):
    """A video's groups in order, each waited for, as the pipeline takes them (clips.Groups)."""
    while True:
        wait_for_any([groups])
        if (group := groups.pop()) is None:
            return
        yield group


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
            assert_same_rows(arrays[output], getattr(want, output), f"{name} {output}")
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
            assert_same_rows(arrays[output], getattr(want, output), f"{path} {output}")


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
    assert_same_outputs(tmp_path / "two", one)


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
    """Worker processes stream each video's temporal groups into the main process, where at
    most the budget's bytes wait, received and not yet staged; with no room at all, one group
    at a time of the video the pipeline is on. The frames are those decoded in this thread."""
    config = VideoConfig(max_image_tokens=2000)
    items = [Source(str(collection / n)) for n in ("a.mp4", "b.mkv", "c.webm", "d.mov", "zz-cut.mp4")]
    want = list(Decoder(0, ProcessorConfig(), video=config).map(items))
    decoder = Decoder(2, ProcessorConfig(), video=config)
    budget = decoder.pool.budget
    budget.limit = 1
    got = []
    try:
        for prepared in decoder.map(items):
            taken = []
            for group in as_they_come(prepared.groups):
                taken.append(group)
                prepared.groups.staged(group.nbytes)
            got.append((prepared, np.concatenate(taken) if taken else None))
    finally:
        decoder.close()
    assert [g.groups.error for g, _ in got] == [w.error for w in want] and want[-1].error.startswith(
        f"{collection / 'zz-cut.mp4'}: truncated: the header counts")
    for (g, frames), w in zip(got[:-1], want[:-1]):
        assert np.array_equal(frames, w.canvas) and g.video == w.video and g.sha256 == w.sha256
        assert g.groups.shape == w.canvas.shape
    assert budget.held == 0 and budget.peak == max(2 * w.canvas[0].nbytes for w in want[:-1])


def test_the_frame_budget_lets_the_head_through_when_it_is_waited_for():
    budget = FrameBudget(limit=100)
    budget.take("a", 80)
    budget.head("b")
    budget.take("b", 500, waited=lambda: True)  # the input waited for goes ahead, over the limit
    assert (budget.held, budget.peak) == (580, 580)
    budget.give(580)
    budget.take("c", 100)
    assert budget.held == 100
    done = threading.Event()
    threading.Thread(target=lambda: (budget.take("b", 50, waited=lambda: False), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # the head with groups still waiting is held to the limit like any
    budget.give(60)
    assert done.wait(5) and budget.held == 90


def test_an_abandoned_videos_frames_never_wait_for_room():
    """A video the pipeline abandoned (it failed, or the stream stopped) is still decoded to its
    end by its worker: its frames are received and let go without waiting for room in a full
    budget, also when abandoned while waiting, so that worker frees for the inputs behind it."""
    budget = FrameBudget(limit=100)
    budget.take("a", 100)
    gone = Groups((4, 2, 2, 3), 2, budget, "gone")
    gone.abandon()
    done = threading.Event()
    threading.Thread(target=lambda: (gone.take(50), done.set()), daemon=True).start()
    assert done.wait(5) and budget.held == 100 and gone.held == 0
    later = Groups((4, 2, 2, 3), 2, budget, "later")
    done.clear()
    threading.Thread(target=lambda: (later.take(50), done.set()), daemon=True).start()
    assert not done.wait(0.3)  # waits for room
    later.abandon()
    assert done.wait(5) and budget.held == 100 and later.held == 0


def test_an_abandoned_video_gives_its_frames_back(collection):
    """A stream that stops mid-video (its consumer gone) leaves the budget as it found it: the
    groups waiting and those still to come are dropped, their bytes back."""
    decoder = Decoder(1, ProcessorConfig(), video=VideoConfig(max_image_tokens=2000))
    budget = decoder.pool.budget
    try:
        prepared = next(iter(decoder.map([Source(str(collection / "a.mp4"))])))
        first = next(as_they_come(prepared.groups))
        assert budget.held >= first.nbytes
        prepared.groups.abandon()
    finally:
        decoder.close()
    assert budget.held == 0 and prepared.groups.ended and not prepared.groups.waiting


def test_a_streamed_run_writes_what_a_run_decoding_whole_writes(collection, ckpt, encoded, tmp_path):
    """Decode workers streaming each video's groups into the packer (the `encoded` run) and
    videos decoded whole in the main process (--workers 0) give the same shards, byte for byte:
    several videos, odd group counts, one cut over two forward calls, images between them."""
    one, whole = encoded[1], tmp_path / "whole"
    proc = encode(collection, whole, ckpt, "--workers", "0")
    assert proc.returncode == 1 and "encoded 10, skipped 0, failed 4" in proc.stderr, proc.stderr
    assert_same_outputs(whole, one)


def _mid_video_collection(root: Path) -> Path:
    """An image, a 60 s clip (60 temporal groups, 30 forward calls of PATCHES), an image."""
    root.mkdir()
    for i, image in enumerate(make_images(root / "img", 2, seed=41)):
        shutil.move(image, root / f"{2 * i}.jpg")
    shutil.rmtree(root / "img")
    write_clip(root / "1-long.mp4", 1800, 30, 120, 160, "libx264", seed=42)
    return root


def _rows_written(out: Path, shard: int, after: int) -> int:
    """The size of the temp file of `shard` once it is over `after` bytes (0: not yet)."""
    sizes = [p.stat().st_size for p in out.glob(f".shard-{shard:05d}.safetensors*")]
    return max(sizes) if sizes and max(sizes) > after else 0


@pytest.mark.parametrize("sig, shard_size", [(signal.SIGKILL, 1), (signal.SIGINT, 1), (signal.SIGINT, 2)])
def test_interrupted_mid_video_resumes_to_the_same_outputs(ckpt, tmp_path, sig, shard_size):
    """A run stopped while a video's rows stream into its shard (SIGKILL: no clean-up at all;
    Ctrl-C: the writer seals what is whole, the image before the clip in its shard at size 2)
    shows no part of that video; the next run encodes it and ends with a run never stopped's
    embeddings and records (at shard size 1 its very bytes; at 2 the shards are cut elsewhere)."""
    root = _mid_video_collection(tmp_path / "in")
    args = [*CLI_ARGS, "encode", str(root), "--model", str(ckpt), "--backend", "numpy", "--dtype", "float32",
            "--output", "both", "--workers", "1", "--shard-size", str(shard_size), "--quiet", *CALL]
    whole = subprocess.run([*args, "--out-dir", str(tmp_path / "whole")], capture_output=True, text=True)
    assert whole.returncode == 0 and "encoded 3, skipped 0" in whole.stderr, whole.stderr
    out = tmp_path / "out"
    # Ctrl-C's default in the run: a shell starting pytest in the background leaves SIGINT ignored,
    # which children inherit, and Python then never raises KeyboardInterrupt
    proc = subprocess.Popen([*args, "--out-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline, shard, image = time.time() + 120, 1 if shard_size == 1 else 0, 0
    while time.time() < deadline and proc.poll() is None:
        if shard == 1 and (out / "shard-00000.jsonl").exists() and _rows_written(out, 1, 0):
            break  # the clip's first rows are in its shard
        if shard == 0 and image and _rows_written(out, 0, image):
            break  # the clip's first rows are in the shard, after the image's
        if shard == 0 and not image:
            image = _rows_written(out, 0, 0)
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the clip's rows were written"
    os.killpg(proc.pid, sig)
    proc.wait(60)
    kept = [str(root / "0.jpg")] if sig == signal.SIGINT or shard_size == 1 else []
    assert [r["path"] for r in records(out)] == kept  # not the clip, not a part of it
    if sig == signal.SIGINT:
        assert not [p for p in out.iterdir() if p.name.startswith(".")]  # its rows were cut off, not sealed
    resumed = subprocess.run([*args, "--out-dir", str(out)], capture_output=True, text=True)
    assert resumed.returncode == 0 and f"skipped {len(kept)}" in resumed.stderr, resumed.stderr
    if shard_size == 1:
        assert_same_outputs(out, tmp_path / "whole")
    got = {r["path"]: (r, a) for r, a in read_embeddings(out)}
    want = {r["path"]: (r, a) for r, a in read_embeddings(tmp_path / "whole")}
    assert sorted(got) == sorted(want) and len(got) == 3
    for path, (record, arrays) in want.items():
        assert {**got[path][0], "rows": None} == {**record, "rows": None}
        for name, array in arrays.items():
            assert_same_rows(got[path][1][name], array, f"{path} {name}")


def test_a_video_failing_after_rows_were_written_leaves_none(ckpt, tmp_path):
    """A clip cut short fails once its decode runs out of frames, after batches of its groups
    were computed and their rows written into the shard: those rows are cut off again, and the
    image after it in the same shard is what it is alone."""
    root = tmp_path / "in"
    root.mkdir()
    fast = write_clip(tmp_path / "fast.mp4", 1800, 30, 120, 160, "libx264", seed=43, options={"movflags": "faststart"})
    (root / "0-cut.mp4").write_bytes(fast.read_bytes()[:fast.stat().st_size * 6 // 10])
    shutil.move(make_images(tmp_path / "img", 1, seed=44)[0], root / "1.jpg")
    args = ["--model", str(ckpt), "--backend", "numpy", "--dtype", "float32", "--output", "both", "--workers", "1",
            "--shard-size", "5", "--quiet", *CALL]
    both = run("encode", str(root), "--out-dir", str(tmp_path / "both"), *args)
    assert both.returncode == 1 and "encoded 1, skipped 0, failed 1" in both.stderr, both.stderr
    assert "0-cut.mp4: truncated" in (tmp_path / "both" / "failures.jsonl").read_text()
    alone = run("encode", str(root / "1.jpg"), "--out-dir", str(tmp_path / "alone"), *args)
    assert alone.returncode == 0, alone.stderr
    assert records(tmp_path / "both") == records(tmp_path / "alone")  # rows [0, n]: nothing before the image's
    ((_, got),), ((_, want),) = read_embeddings(tmp_path / "both"), read_embeddings(tmp_path / "alone")
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    body = []
    for directory in (tmp_path / "both", tmp_path / "alone"):
        shard = directory / "shard-00000.safetensors"
        read_header(shard)  # the safetensors library's check: the data section covered exactly
        body.append(shard.stat().st_size - 8 - int.from_bytes(shard.read_bytes()[:8], "little"))
    assert body[0] == body[1]  # no rows of the clip left in the file (the headers differ: the video settings)


def test_a_collection_holds_a_bounded_number_of_a_long_clips_frames(ckpt, tmp_path):
    """The main process of a collection run, in a fresh process: a 10 s clip, then a 120 s one
    of the same frames (240 sampled frames, ~60 MB on their canvases, their rows ~1 MB) under a
    frame budget of 4 MiB. The long clip's frames go to the engine a group at a time and its
    rows to the shard a batch at a time, so its peak RSS (VmHWM, the process's own since exec)
    grows by the budget and a few batches, not by the clip: before, the whole clip was held."""
    write_clip(tmp_path / "short.mp4", 300, 30, 240, 320, "libx264", seed=51)
    write_clip(tmp_path / "long.mp4", 3600, 30, 240, 320, "libx264", seed=51)
    budget = 4 << 20
    code = f"""
import numpy as np
from pathlib import Path
from glmvit_cupy import GlmVit
from glmvit_cupy.collection.pipeline import Decoder, encode_collection
from glmvit_cupy.collection.sources import Source
from glmvit_cupy.processor.preprocess import ProcessorConfig
from glmvit_cupy.processor.video import VideoConfig
def peak(): return int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])
vit = GlmVit.from_pretrained({str(ckpt)!r}, backend="numpy", max_pixels={2 * 432 * 14 * 14})  # 2 groups a call
config = VideoConfig(max_image_tokens=60000)
decoder = Decoder(1, ProcessorConfig(), video=config)
decoder.pool.budget.limit = {budget}
for name in ("short", "long"):
    before = peak()
    summary = encode_collection(vit, [Source({str(tmp_path)!r} + "/" + name + ".mp4")], Path({str(tmp_path)!r}) / name,
                                shard_size=1, dtype="bfloat16", decoder=decoder)
    assert summary.encoded == 1, summary
    print(name, peak() - before, decoder.pool.budget.peak)
decoder.close()
"""
    run_ = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run_.returncode == 0, run_.stderr
    lines = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in run_.stdout.splitlines()}
    (record,) = records(tmp_path / "long")
    _, h, w = record["grid_thw"]
    group = 2 * (h * 14) * (w * 14) * 3
    frame_bytes = record["frames"] * group // 2
    grown_kib, budget_peak = lines["long"]
    assert (h, w) == (18, 24) and budget_peak <= budget + group  # the head passes one group over it at most
    print(f"long clip: main's VmHWM grew {grown_kib >> 10} MiB; frames {frame_bytes >> 20} MiB; budget peak "
          f"{budget_peak >> 20} MiB; short: {lines['short']}")
    assert grown_kib << 10 < budget + (16 << 20) < frame_bytes // 2


def test_a_worker_killed_mid_video_fails_that_video_alone(collection, tmp_path):
    """A decode worker SIGKILLed after its video's first groups went to the packer: the video's
    groups end with the reason (it cannot be retried, its groups are packed already), the
    worker is replaced, the next input decodes as in this thread, and the budget is whole."""
    clip = write_clip(tmp_path / "long.mp4", 1800, 30, 120, 160, "libx264", seed=45)
    image = sorted((collection / "img").glob("*"))[0]
    items = [Source(str(clip)), Source(str(image))]
    config = VideoConfig(max_image_tokens=2000)
    others = set(_decode_children(os.getpid()))  # pools of earlier tests, still open
    decoder = Decoder(1, ProcessorConfig(), video=config)
    budget = decoder.pool.budget
    budget.limit = 1  # one group ahead of the packer: the worker is mid-video, not done
    try:
        prepared = decoder.map(items)
        video = next(prepared)
        groups = as_they_come(video.groups)
        first = next(groups)
        video.groups.staged(first.nbytes)
        (worker,) = [pid for pid in _decode_children(os.getpid()) if pid not in others]
        os.kill(worker, signal.SIGKILL)
        rest = list(groups)
        for group in rest:
            video.groups.staged(group.nbytes)
        after = next(prepared)
    finally:
        decoder.close()
    assert 1 + len(rest) < video.groups.count
    assert video.groups.error == f"{clip}: its decode worker process died while decoding it (killed, or out of memory)"
    want = Decoder(0, ProcessorConfig(), video=config).map(items[1:])
    assert after.error is None and np.array_equal(after.canvas, next(want).canvas)
    assert budget.held == 0


def _streamed(prep, budget: FrameBudget, ticket: str):
    """A whole-decoded video's Prepared as a decode pool hands it over: its groups still to come."""
    groups = Groups(prep.canvas.shape, 2, budget, ticket)
    return dataclasses.replace(prep, canvas=None, groups=groups), prep.canvas


def _arrive(groups, frames, end: bool = True) -> None:
    for i in range(0, len(frames), 2):
        groups.take(frames[i:i + 2].nbytes)
        groups.received(frames[i:i + 2])
    if end:
        groups.end()


def _b_come_a_not(collection):
    """a.mp4 and b.mkv as a decode pool hands them over, with all of b's frames come and none of
    a's: (video settings, items, budget, (a, its frames), b)."""
    config = VideoConfig(max_image_tokens=2000)
    items = [Source(str(collection / n)) for n in ("a.mp4", "b.mkv")]
    budget = FrameBudget()
    (a, a_frames), (b, b_frames) = [_streamed(p, budget, n) for p, n in
                                     zip(Decoder(0, ProcessorConfig(), video=config).map(items), "ab")]
    _arrive(b.groups, b_frames)
    return config, items, budget, (a, a_frames), b


@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("ahead_groups", [None, 1])
def test_later_videos_are_packed_while_the_first_ones_frames_are_slow(collection, vit, monkeypatch, ahead_groups,
                                                                      parts):
    """While no frame of the first video has come, the stream places the groups of the video after
    it (whose rows it holds until their turn), at most ROW_BYTES_AHEAD of rows; the results leave in
    input order, each equal to the video encoded alone. In a stream of parts, both are announced
    (Reserve) as they are taken and the later video's rows leave as Parts as they are collected,
    before the first's Encoded (the writer has their place)."""
    config = VideoConfig(max_image_tokens=2000)
    items = [Source(str(collection / n)) for n in ("a.mp4", "b.mkv")]
    decode = lambda: list(Decoder(0, ProcessorConfig(), video=config).map(items))  # noqa: E731
    options = dict(outputs=("pooler_output",), dtype="float32", video=config)
    alone = [list(encode_prepared(vit, [(item, prep)], **options))[0] for item, prep in zip(items, decode())]
    b_groups = alone[1].grid_thw[0]
    if ahead_groups is not None:  # the rows of one of b's groups
        b_rows = alone[1].grid_thw[1] * alone[1].grid_thw[2] // vit.geometry.merge_unit
        monkeypatch.setattr(pipeline, "ROW_BYTES_AHEAD", ahead_groups * b_rows * vit.geometry.out_hidden_size * 4)
    budget = FrameBudget()
    (a, a_frames), (b, b_frames) = [_streamed(p, budget, n) for p, n in zip(decode(), "ab")]
    _arrive(b.groups, b_frames)  # b decoded at once, a not yet begun
    results = []
    stream = threading.Thread(target=lambda: results.extend(
        encode_prepared(vit, zip(items, [a, b]), decoders=2, parts=parts, **options)), daemon=True)
    stream.start()
    want_placed = b_groups if ahead_groups is None else ahead_groups
    deadline = time.monotonic() + 30
    while b_groups - len(b.groups.waiting) < want_placed and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # and no more than that
    assert b_groups - len(b.groups.waiting) == want_placed
    assert not [r for r in results if isinstance(r, Encoded)]  # a's comes first
    assert [r.item for r in results if isinstance(r, Reserve)] == (items if parts else [])  # announced in order
    _arrive(a.groups, a_frames)
    stream.join(60)
    encoded = [r for r in results if isinstance(r, Encoded)]
    assert [r.item for r in encoded] == items and all(r.error is None for r in encoded)
    for got, want, reserve in zip(encoded, alone, [r for r in results if isinstance(r, Reserve)] or alone):
        assert np.array_equal(got.grid_thw, want.grid_thw)
        if parts:  # every row as a Part, each at its place
            assert not got.arrays and reserve.rows == len(want.arrays["pooler_output"])
            rows = np.full_like(want.arrays["pooler_output"], np.nan)
            for part in (r for r in results if isinstance(r, Part) and r.item is got.item):
                rows[part.first:part.first + len(part.arrays["pooler_output"])] = part.arrays["pooler_output"]
            assert_same_rows(rows, want.arrays["pooler_output"])
        else:
            assert_same_rows(got.arrays["pooler_output"], want.arrays["pooler_output"])
    if parts:  # b held ahead: its rows went as they were collected, before a's Encoded
        first_a = next(i for i, r in enumerate(results) if isinstance(r, Encoded))
        assert [r for r in results[:first_a] if isinstance(r, Part) and r.item is items[1]]
    assert budget.held == 0


def test_the_first_videos_groups_go_before_more_of_a_later_ones(collection, vit):
    """Groups of the first video that come while a later video's are being placed go first: the
    sooner the first is done, the sooner its record is written and the inputs after it placed."""
    config, items, budget, (a, a_frames), b = _b_come_a_not(collection)
    _arrive(a.groups, a_frames[:2], end=False)
    pop = b.groups.pop

    def pop_as_a_arrives():  # a's other groups come as b's first is placed
        if not a.groups.ended:
            _arrive(a.groups, a_frames[2:])
        return pop()

    b.groups.pop = pop_as_a_arrives
    results = list(encode_prepared(vit, zip(items, [a, b]), outputs=("pooler_output",), dtype="float32",
                                   video=config, decoders=2))
    assert [r.item for r in results] == items and all(r.error is None for r in results)
    # a's three groups of 120 patches, b's four of 96, 300 a forward call: a1 b1 | a2 a3 | b2 b3 b4
    # (placing b's whole first: a1 b1 | b2 b3 b4 | a2 a3, a done last)
    assert results[0].batch < results[1].batch
    assert budget.held == 0


def test_a_later_input_is_taken_only_once_its_decode_has_surely_begun(collection, vit):
    """With its one decoder busy with the first video, the stream takes the next input only once
    that video's frames have all come: a pool starts inputs in order, so taking it earlier would
    wait for that worker, while the video's frames, unplaced meanwhile, fill the frame budget."""
    config, items, _, (a, a_frames), b = _b_come_a_not(collection)
    asked = []

    def source():
        yield items[0], a
        asked.append(a.groups.ended)
        yield items[1], b

    results = []
    stream = threading.Thread(target=lambda: results.extend(encode_prepared(
        vit, source(), outputs=("pooler_output",), dtype="float32", video=config, decoders=1)), daemon=True)
    stream.start()
    time.sleep(0.3)
    _arrive(a.groups, a_frames)
    stream.join(60)
    assert asked == [True] and [r.item for r in results] == items and all(r.error is None for r in results)
