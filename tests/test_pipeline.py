"""Collection runs on the CPU (NumPy backend, tiny checkpoint): every input kind, kills and
resumes, failures, flat memory, and shards that safetensors + numpy alone can read."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import tarfile
import termios
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit, GlmVitError, preprocess
from glmvit_cupy.collection.pipeline import (Decoder, Reserve, encode_collection, encode_prepared, plan_batches, prepare,
                                             stream)
from glmvit_cupy.collection.shards import FORMAT, BackgroundWriter, ShardWriter, read_embeddings
from glmvit_cupy.collection.sources import expand_inputs
from glmvit_cupy.collection.staging import make_stager
from glmvit_cupy.processor.preprocess import ProcessorConfig
from glmvit_cupy.tower.synthetic import write_checkpoint
from helpers import assert_same_rows, photo_like, rel_err

CLI = [sys.executable, "-c", "import cli; cli.main()"]


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, **kwargs)


def make_images(root: Path, n: int, seed: int = 0, small: bool = False) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        h, w = (28, 28) if small else (int(rng.integers(30, 160)), int(rng.integers(30, 160)))
        path = root / f"img{i:04d}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(photo_like(h, w, seed=seed * 1000 + i)).save(path, quality=90)
        paths.append(path)
    return paths


def records(out_dir: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(out_dir.glob("shard-*.jsonl")) for line in p.read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny(tiny_ckpt) -> str:
    return str(tiny_ckpt)


@pytest.fixture(scope="module")
def vit(tiny_ckpt):
    return GlmVit.from_pretrained(tiny_ckpt, backend="numpy")


def expected(vit, path) -> np.ndarray:
    """The one-image result for a file (what `encode FILE --out x.npy` writes: test_cli)."""
    pixels, grid = preprocess(path)
    return vit.forward(pixels, grid).pooler_output


def test_every_input_kind(tmp_path, tiny):
    a = make_images(tmp_path / "dir" / "a", 2)
    b = make_images(tmp_path / "dir" / "b" / "deep", 2, seed=1)
    (tmp_path / "dir" / "notes.txt").write_text("not an image")
    tar_path = tmp_path / "shard-000.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(a[0], arcname="sample1/x.jpg")
        tar.add(tmp_path / "dir" / "notes.txt", arcname="sample1/x.txt")
        tar.add(b[1], arcname="sample2.png")
    listing = tmp_path / "list.txt"
    listing.write_text(f"{b[0]}\n\n{a[1]}\n")
    found = expand_inputs([str(tmp_path / "dir")])
    assert [s.path for s in found] == [str(p) for p in sorted(a + b)]  # recursive, sorted, images only
    pattern = expand_inputs([str(tmp_path / "dir" / "**" / "*.png")])
    assert [s.path for s in pattern] == sorted(str(p) for p in a + b if p.suffix == ".png")
    members = expand_inputs([str(tar_path)])
    assert [(s.member, s.key.split("::")[1]) for s in members] == [("sample1/x.jpg", "sample1/x"),
                                                                     ("sample2.png", "sample2")]
    assert members[0].read() == a[0].read_bytes() and members[1].read() == b[1].read_bytes()
    listed = expand_inputs([], files_from=str(listing))
    assert [s.path for s in listed] == [str(b[0]), str(a[1])]
    both = expand_inputs([str(a[0]), str(tmp_path / "dir")])  # named twice: once
    assert len(both) == 4 and both[0].path == str(a[0])
    with pytest.raises(GlmVitError, match="matches no file"):
        expand_inputs([str(tmp_path / "*.webp")])
    with pytest.raises(GlmVitError, match="no such file or directory"):
        expand_inputs([str(tmp_path / "gone.png")])

    # Through the CLI, a mix of all of them (the list from stdin): one record per image.
    out = tmp_path / "out"
    proc = run("encode", str(tmp_path / "dir" / "a"), str(tmp_path / "dir" / "b" / "**" / "*.jpg"), str(tar_path),
               "--files-from", "-", "--model", tiny, "--out-dir", str(out), "--backend", "numpy",
               "--workers", "1", input=f"{b[1]}\n")
    assert proc.returncode == 0, proc.stderr
    got = records(out)
    assert [r["path"] for r in got] == [str(a[0]), str(a[1]), str(b[0]), str(tar_path), str(tar_path), str(b[1])]
    assert got[3]["member"] == "sample1/x.jpg" and got[3]["key"] == "sample1/x"
    assert "encoded 6, skipped 0, failed 0" in proc.stderr
    # stderr is a pipe here: plain progress lines, no bar (test_a_terminal_gets_a_live_bar has one)
    assert "glmvit-cupy: 6/6 images (100%)" in proc.stderr and "\r" not in proc.stderr


def test_a_terminal_gets_a_live_bar(tmp_path, tiny):
    """With stderr on a terminal (a pseudo-terminal here) progress is tqdm's bar, redrawn in
    place, counting images and failures, and not the plain lines a log gets."""
    make_images(tmp_path / "img", 6, seed=17)
    (tmp_path / "img" / "junk.png").write_bytes(b"not an image")
    terminal, child_end = os.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal's size
    proc = subprocess.Popen([*CLI, "encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(tmp_path / "out"),
                             "--backend", "numpy", "--workers", "0"], stdout=subprocess.DEVNULL, stderr=child_end)
    os.close(child_end)
    shown = b""
    while True:
        try:
            data = os.read(terminal, 1 << 16)
        except OSError:  # EIO: the run has exited and closed the terminal
            break
        if not data:
            break
        shown += data
    os.close(terminal)
    assert proc.wait(timeout=120) == 1  # the junk file failed
    text = shown.decode()
    bar = [part for part in text.split("\r") if part.startswith("encoding: 100%")]
    assert bar and "7/7 [" in bar[-1] and "image/s, failed=1, tokens_s=" in bar[-1], text
    assert "glmvit-cupy: 7/7 images" not in text and "encoded 6, skipped 0, failed 1" in text


def test_shards_read_with_safetensors_and_numpy_alone(tmp_path, tiny, vit):
    import hashlib

    import safetensors

    paths = make_images(tmp_path / "img", 7)
    out = tmp_path / "out"
    proc = run("encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(out), "--backend", "numpy",
               "--shard-size", "3", "--output", "both", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"shard-0000{i}.{ext}" for i in range(3)
                                                      for ext in ("jsonl", "safetensors")]
    seen = 0
    for shard in sorted(out.glob("shard-*.safetensors")):
        tensors = dict(safetensors.deserialize(shard.read_bytes()))  # the README's recipe
        lines = [json.loads(x) for x in shard.with_suffix(".jsonl").read_text().splitlines()]
        pooler = (np.frombuffer(tensors["pooler_output"]["data"], np.uint16).astype(np.uint32) << 16).view(np.float32)
        pooler = pooler.reshape(tensors["pooler_output"]["shape"])
        offsets = np.frombuffer(tensors["offsets"]["data"], np.int64)
        grid = np.frombuffer(tensors["grid_thw"]["data"], np.int64).reshape(-1, 3)
        assert tensors["pooler_output"]["dtype"] == "BF16" and tensors["last_hidden_state"]["shape"][1] == 256
        assert offsets.tolist() == [0] + [x["rows"][1] for x in lines] and len(grid) == len(lines)
        for i, line in enumerate(lines):
            path = paths[seen]
            assert line["path"] == str(path) and line["bytes"] == path.stat().st_size
            assert line["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
            assert line["grid_thw"] == grid[i].tolist() and line["tokens"] == offsets[i + 1] - offsets[i]
            want = expected(vit, path)
            got = pooler[offsets[i]:offsets[i + 1]]
            assert got.shape == want.shape and rel_err(got, want) < 4e-3  # BF16 rounding only
            seen += 1
    assert seen == len(paths)
    ours = list(read_embeddings(out))
    assert [r["path"] for r, _ in ours] == [str(p) for p in paths]
    assert ours[0][1]["last_hidden_state"].dtype == np.float32


def kill_after_two_shards_then_resume(args: list[str], out: Path, paths: list[Path], shard_size: int) -> None:
    """SIGKILL the whole process group of the command `args` once two shards are done, run it
    again: it skips what is done and ends with exactly one record per input."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    while len(list(out.glob("shard-*.jsonl"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the main process, its decode workers (and any engine processes)
    proc.wait()
    done = records(out)
    assert 2 * shard_size <= len(done) < len(paths), "the kill should land mid-run"
    resumed = subprocess.run(args, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipped {len(done)}" in resumed.stderr
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # the killed run's temp files are gone
    assert sorted(r["path"] for r in records(out)) == sorted(str(p) for p in paths)  # exactly one each


def test_sigkill_then_resume_gives_one_record_per_input(tmp_path, tiny, vit):
    paths = make_images(tmp_path / "img", 60, seed=2)
    out = tmp_path / "out"
    args = [*CLI, "encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(out), "--backend", "numpy",
            "--shard-size", "4", "--dtype", "float32", "--workers", "1", "--quiet",
            "--max-pixels", str(600 * 196), "--max-image-tokens", "150"]  # images of up to 36 tokens: unchanged
    kill_after_two_shards_then_resume(args, out, paths, shard_size=4)
    by_path = {r["path"]: emb for r, emb in read_embeddings(out)}
    for path in paths:
        assert rel_err(by_path[str(path)]["pooler_output"], expected(vit, path)) <= 1e-5
    cli_npy = tmp_path / "one.npy"
    assert run("encode", str(paths[5]), "--model", tiny, "--out", str(cli_npy), "--backend", "numpy").returncode == 0
    assert rel_err(by_path[str(paths[5])]["pooler_output"], np.load(cli_npy)) <= 1e-5


def test_sigterm_finishes_the_shard_in_flight(tmp_path, tiny):
    make_images(tmp_path / "img", 150, seed=3)
    out = tmp_path / "out"
    args = [*CLI, "encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(out), "--backend", "numpy",
            "--shard-size", "1000", "--workers", "1", "--quiet", "--max-pixels", str(400 * 196),
            "--max-image-tokens", "100"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, written = time.time() + 120, []
    while len(set(written)) < 3 and time.time() < deadline:  # a shard open, then rows of two batches:
        written += [p.stat().st_size for p in out.glob(".shard-*.tmp")]  # the first batch's records are in
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "interrupted after" in err and "Traceback" not in err, err
    kept = records(out)
    assert 0 < len(kept) < 150 and sorted(p.name for p in out.iterdir()) == ["shard-00000.jsonl",
                                                                            "shard-00000.safetensors"]
    again = subprocess.run(args, capture_output=True, text=True)
    assert again.returncode == 0 and len(records(out)) == 150


def test_failures_are_listed_and_the_rest_encoded(tmp_path, tiny):
    paths = make_images(tmp_path / "img", 5, seed=4)
    (tmp_path / "img" / "junk.png").write_bytes(b"not an image at all")
    blob = paths[1].read_bytes()
    (tmp_path / "img" / "cut.png").write_bytes(blob[:len(blob) // 3])
    out = tmp_path / "out"
    proc = run("encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(out), "--backend", "numpy",
               "--workers", "1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "encoded 5, skipped 0, failed 2" in proc.stderr and "failures.jsonl" in proc.stderr.splitlines()[-1]
    failures = [json.loads(x) for x in (out / "failures.jsonl").read_text().splitlines()]
    assert [Path(f["path"]).name for f in failures] == ["cut.png", "junk.png"]
    assert all(f["path"] in f["error"] for f in failures)
    assert len(records(out)) == 5
    fast = run("encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(tmp_path / "fast"),
               "--backend", "numpy", "--workers", "1", "--fail-fast")
    assert fast.returncode == 1 and "cut.png" in fast.stderr and "--fail-fast" in fast.stderr


def test_resume_with_other_settings_is_refused(tmp_path, tiny):
    make_images(tmp_path / "img", 3, seed=5)
    base = [str(tmp_path / "img"), "--out-dir", str(tmp_path / "out"), "--backend", "numpy", "--workers", "0"]
    assert run("encode", *base, "--model", tiny).returncode == 0
    proc = run("encode", *base, "--model", tiny, "--dtype", "float32")
    assert proc.returncode == 1 and "made with dtype 'bfloat16', this run has 'float32'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    # Another tower of the same geometry (another seed): its embeddings must not join these.
    other = write_checkpoint(tmp_path / "other", "tiny", seed=2)
    theirs, ours = (GlmVit.from_pretrained(m, backend="numpy").fingerprint for m in (tiny, other))
    proc = run("encode", *base, "--model", str(other))
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"glmvit-cupy: error: {tmp_path / 'out' / 'shard-00000.safetensors'}: made with tower {theirs!r}, this run "
        f"has {ours!r}; use another --out-dir, or the settings it was made with"]


HEAP = r"""
import sys, tracemalloc
from glmvit_cupy import GlmVit
from glmvit_cupy.collection.pipeline import encode_collection
from glmvit_cupy.collection.sources import expand_inputs

model, images, out = sys.argv[1:]
vit = GlmVit.from_pretrained(model, backend="numpy", max_pixels=8 * 64 * 196, max_image_tokens=16)
heap = []


class Probe:  # encode_collection's progress hook: the traced heap (NumPy's buffers too) after each image
    def start(self, total):
        pass

    def __call__(self, result, stats):
        heap.append(tracemalloc.get_traced_memory()[0])


tracemalloc.start()
summary = encode_collection(vit, expand_inputs([images]), out, workers=1, shard_size=50, progress=Probe())
print(summary.encoded, vit.geometry.out_hidden_size, *heap)
"""


def test_host_memory_is_flat(tmp_path, tiny):
    """What the main process holds does not grow with the collection: after a warm-up of two
    shards, 400 more images (a shard in flight, a batch of 8, the decode window) leave the traced
    heap where it was, by less than one shard's rows; keeping each image's result would add its
    rows, 400 times over."""
    n, shard, tokens = 500, 50, 16  # small images: the processor's minimum of 16 merged tokens each
    make_images(tmp_path / "img", n, seed=6, small=True)
    proc = subprocess.run([sys.executable, "-c", HEAP, tiny, str(tmp_path / "img"), str(tmp_path / "out")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    encoded, width, *heap = map(int, proc.stdout.split())
    assert encoded == n == len(heap) and len(records(tmp_path / "out")) == n
    warm, last = max(heap[2 * shard:4 * shard]), max(heap[-2 * shard:])
    rows = tokens * width * 2  # one image's pooler_output, BF16
    print(f"traced heap: {warm} B after warm-up, {last} B at the end; one image's rows {rows} B")
    assert last - warm < shard * rows


def test_encode_iter_is_lazy_ordered_and_equals_forward(tiny):
    vit = GlmVit.from_pretrained(tiny, backend="numpy", max_pixels=5 * 64 * 196)  # 5 small images a call
    pulled = []

    def images():
        for i in range(200):
            pulled.append(i)
            yield photo_like(40 + i % 7, 50, seed=i)

    it = vit.encode_iter(images(), workers=1, output="both", dtype="float32")
    first_image, first = next(it)
    assert len(pulled) <= 12 + 2 * 5 + 1  # bounded: the decode window and two batches, not the input
    pixels, grid = preprocess(first_image)
    assert rel_err(first.pooler_output, vit.forward(pixels, grid).pooler_output) <= 1e-5  # batched vs alone
    rest = list(it)
    assert len(rest) == 199 and len(pulled) == 200
    with pytest.raises(GlmVitError, match="cannot encode a int"):
        vit.encode(5)


def test_the_packer_keeps_two_batches_on_the_engine(tiny):
    """The stager's overlap (staging.py: batch k+1 uploads while k computes) needs the packer to
    submit batch k+1 before it waits for batch k: the first result leaves once the third batch
    begins (two batches of 5 submitted, the 11th image in hand), not after the first batch.
    Decoding in this thread, which reads window - 1 inputs ahead of the packer."""
    vit = GlmVit.from_pretrained(tiny, backend="numpy", max_pixels=5 * 64 * 196)  # 5 images of 64 patches a call
    decoder = Decoder(0, vit.processor)
    pulled = []

    def images():
        for i in range(40):
            pulled.append(i)
            yield photo_like(28, 28, seed=i)  # enlarged to the minimum, 16 tokens: 64 patches

    results = stream(vit, images(), decoder=decoder)
    next(results)
    assert len(pulled) - (decoder.window - 1) == 2 * 5 + 1
    assert sum(1 for _ in results) == 39


class WarmingStager:
    """The NumPy stager with a warm-up that takes `seconds` (or fails with `error`), recording when
    it and each submit ran (what staging.CupyStager.warm_up pays on the GPU)."""

    def __init__(self, vit, seconds: float = 0.0, error: str | None = None) -> None:
        self.inner, self.seconds, self.error = make_stager(vit, vit.processor), seconds, error
        self.depth, self.engines = self.inner.depth, self.inner.engines
        self.started, self.events = threading.Event(), []

    def warm_up(self, outputs, dtype) -> None:
        self.started.set()
        self.events.append("warm-up began")
        time.sleep(self.seconds)
        if self.error:
            raise GlmVitError(self.error)
        self.events.append("warm-up ended")

    def submit(self, *args):
        self.events.append("submit")
        return self.inner.submit(*args)


def assert_no_warm_up_thread() -> None:
    assert not [t for t in threading.enumerate() if t.name.startswith("glmvit-warm-up")]


def prepared_after(stager: WarmingStager, images: list, noted: list) -> Iterator:
    """The decoded inputs as encode_prepared takes them, the first handed over only once the
    stager's warm-up has begun (noting whether it had within 5 s): as a decode pool's first
    input comes while the warm-up runs."""
    noted.append(stager.started.wait(5))
    for image in images:
        yield image, prepare(image, ProcessorConfig())


def test_the_engines_warm_up_runs_while_the_first_inputs_decode(vit):
    """The stager's first-batch costs (CupyStager.warm_up: ~0.2 s on the H200) are paid on a
    thread that starts with the stream, so the first input's decode does not wait for them, and
    the first batch is submitted after them; the results are the same."""
    images = [photo_like(40 + i, 50, seed=i) for i in range(3)]
    stager, noted = WarmingStager(vit, seconds=0.3), []
    got = list(encode_prepared(vit, prepared_after(stager, images, noted), stager=stager))
    assert noted == [True]  # the warm-up had begun before the first input was handed over
    assert stager.events[:3] == ["warm-up began", "warm-up ended", "submit"]
    want = [r.arrays["pooler_output"] for r in stream(vit, images, workers=0)]
    assert [r.error for r in got] == [None] * 3
    for r, w in zip(got, want):
        assert_same_rows(r.arrays["pooler_output"], w)
    assert_no_warm_up_thread()


@pytest.mark.parametrize("inputs", ["images", "all failing"])
def test_a_failed_warm_up_fails_the_stream(vit, inputs):
    """A warm-up that fails (a GPU fault) is the stream's failure with its message, also when no
    batch follows it (every input failed to decode), and no warm-up thread is left running."""
    images = [photo_like(40, 50, seed=1)] if inputs == "images" else [b"not an image", b"nor this"]
    stager = WarmingStager(vit, error="the GPU failed in the warm-up: an illegal memory access")
    with pytest.raises(GlmVitError, match="failed in the warm-up"):
        list(encode_prepared(vit, prepared_after(stager, images, []), stager=stager))
    assert_no_warm_up_thread()


def test_a_stream_closed_early_waits_for_its_warm_up(vit):
    """A stream closed before its first batch ends its warm-up before it returns: a warm-up left
    running would use the engine after the stream's turn on it has passed to another."""
    stager = WarmingStager(vit, seconds=0.5)
    results = encode_prepared(vit, prepared_after(stager, [photo_like(40, 50, seed=2)] * 3, []), stager=stager,
                              parts=True)
    assert isinstance(next(results), Reserve)  # the first input admitted, no batch closed yet
    results.close()
    assert stager.events == ["warm-up began", "warm-up ended"]  # ended before close() returned, nothing submitted
    assert_no_warm_up_thread()


def test_plan_batches_packs_in_order_under_the_budget():
    assert plan_batches([3, 3, 3, 5, 1, 8], 8) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    assert plan_batches([10], 8) == [range(0, 1)]  # the engine refuses it with the number at fault
    assert plan_batches([], 8) == []


@pytest.mark.parametrize("workers, threads", [(2, False), (3, True)])
def test_decoders_give_the_in_thread_canvases_in_order(tmp_path, workers, threads):
    """Worker processes (encode) and threads (a Ray actor, whose child processes Ray kills
    before they can be closed) both yield, in input order, what decoding in this thread does."""
    (tmp_path / "zz-junk.png").write_bytes(b"not an image")
    items = list(expand_inputs([str(p) for p in make_images(tmp_path, 12, seed=5)] + [str(tmp_path / "zz-junk.png")]))
    config = ProcessorConfig()
    want = list(Decoder(0, config).map(items))
    decoder = Decoder(workers, config, threads=threads)
    assert type(decoder.pool).__name__ == ("ThreadPoolExecutor" if threads else "DecodePool")
    try:
        got = list(decoder.map(items))
    finally:
        decoder.close()
    assert [g.error for g in got] == [w.error for w in want] and want[-1].error
    assert all(np.array_equal(g.canvas, w.canvas) and g.sha256 == w.sha256 for g, w in zip(got[:-1], want[:-1]))


def test_pixel_messages_arrive_whole_in_their_array():
    """The worker's pixel messages read straight into their array: a message the socket hands
    over in small pieces, the empty one (decoding failed part way), a size other than the
    array's (a protocol fault, not a picture), and a worker gone inside a message."""
    import socket
    import threading
    from multiprocessing.connection import Connection

    from glmvit_cupy.errors import InternalError
    from glmvit_cupy.collection.pipeline import _PIXELS_HEAD, _recv_pixels, _send_pixels

    frame = np.random.default_rng(0).integers(0, 256, (300, 500, 3), dtype=np.uint8)
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # each message arrives in pieces
    ours, theirs = Connection(a.detach()), Connection(b.detach())
    sender = threading.Thread(target=lambda: [_send_pixels(theirs, m) for m in (frame, b"", frame[:1, :1])])
    sender.start()
    out = np.zeros_like(frame)
    assert _recv_pixels(ours, out) == frame.nbytes and np.array_equal(out, frame)
    assert _recv_pixels(ours, out) == 0
    with pytest.raises(InternalError, match=r"sent 3 bytes of pixels where 450000 were expected"):
        _recv_pixels(ours, out)
    sender.join()
    ours.close(), theirs.close()
    a, b = socket.socketpair()
    ours = Connection(a.detach())
    b.sendall(_PIXELS_HEAD.pack(frame.nbytes) + b"half")
    b.close()
    with pytest.raises(EOFError):
        _recv_pixels(ours, out)
    ours.close()

FULL_DISK = r'''
import errno, os, sys
import glmvit_cupy.collection.shards as shards
opened, pwrite = shards._OpenShard.__init__, os.pwrite
count, full = [0], set()


def init(self, *args, **kwargs):  # the disk fills up in the second shard
    opened(self, *args, **kwargs)
    count[0] += 1
    if count[0] == 2:
        full.add(self.files[self.outputs[0]][0].fileno())


def write(fd, data, offset):
    if fd in full:
        raise OSError(errno.ENOSPC, "No space left on device")
    return pwrite(fd, data, offset)


shards._OpenShard.__init__, os.pwrite = init, write
import cli
cli.main()
'''


def test_a_full_disk_is_one_line_and_leaves_whole_shards(tmp_path, tiny):
    make_images(tmp_path / "img", 12, seed=7)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, "encode", str(tmp_path / "img"), "--model", tiny,
                           "--out-dir", str(out), "--backend", "numpy", "--workers", "1", "--shard-size", "5", "-q"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"glmvit-cupy: error: {out}: writing the embeddings "
                                                           "failed: No space left on device")
    assert sorted(p.name for p in out.iterdir()) == ["shard-00000.jsonl", "shard-00000.safetensors"]
    again = run("encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(out), "--backend", "numpy",
                "--workers", "1", "--shard-size", "5")
    assert again.returncode == 0 and "skipped 5" in again.stderr and len(records(out)) == 12


def test_one_source_given_twice_is_two_inputs(tmp_path, vit):
    """The writer tells a collection's inputs apart by their place in the stream, not by the
    object: the same Source twice is encoded twice, in order."""
    make_images(tmp_path / "img", 1, seed=5)
    (source,) = expand_inputs([str(tmp_path / "img")])
    summary = encode_collection(vit, [source, source], tmp_path / "out", workers=1, shard_size=5, dtype="float32")
    (first, a), (second, b) = read_embeddings(tmp_path / "out")
    assert summary.encoded == 2 and first["path"] == second["path"] == source.key
    assert_same_rows(a["pooler_output"], b["pooler_output"])


def test_the_shard_writers_queue_is_bounded_in_bytes(tmp_path):
    """A disk slower than the engine holds the feeding thread back once the queued rows reach the
    bound (a call larger than it still passes alone), and every row still lands in order."""
    width, rows = 64, 1024  # a call: 1024 rows x 64 float32 = 256 KiB
    writer = ShardWriter(tmp_path, ["pooler_output"], "float32", width, 100, 0, {"format": FORMAT})
    slow_disk = threading.Event()
    write = writer.write_rows
    writer.write_rows = lambda *args: (slow_disk.wait(), write(*args))
    background = BackgroundWriter(writer, max_bytes=3 * rows * width * 4)
    parts = [np.full((rows, width), i, np.float32) for i in range(12)]
    fed = []

    def feed():
        clip = background.reserve(12 * rows + 1)
        for i, part in enumerate(parts):
            background.write_rows(clip, i * rows, {"pooler_output": part})
            fed.append(part)
        background.write_rows(clip, 12 * rows, {"pooler_output": parts[0][:1]})
        background.complete(clip, {"path": "clip"}, [12, 1, 1])

    feeder = threading.Thread(target=feed)
    feeder.start()
    time.sleep(0.5)
    assert len(fed) == 3 and background.queued_bytes == 3 * parts[0].nbytes  # the fourth waits for the disk
    slow_disk.set()
    feeder.join(10)
    assert not feeder.is_alive()
    background.finish()
    assert background.peak_bytes <= background.max_bytes
    ((record, arrays),) = list(read_embeddings(tmp_path))
    assert record["tokens"] == 12 * rows + 1
    np.testing.assert_array_equal(arrays["pooler_output"], np.concatenate(parts + [parts[0][:1]]))

    (tmp_path / "big").mkdir()
    big = BackgroundWriter(ShardWriter(tmp_path / "big", ["pooler_output"], "float32", width, 100, 0,
                                       {"format": FORMAT}), max_bytes=1)
    adder = threading.Thread(target=big.add, args=({"path": "a"}, {"pooler_output": parts[1]}, [1, 32, 32]),
                             daemon=True)
    adder.start()
    adder.join(10)
    assert not adder.is_alive(), "a call over the bound, alone in the queue, waited for ever"
    big.finish()
    assert [r["path"] for r, _ in read_embeddings(tmp_path / "big")] == ["a"]


def test_several_directories_read_as_one_collection(tmp_path, tiny):
    """The output of several hosts is merged by reading their directories together; one made
    with other settings is refused, naming both."""
    a, b = make_images(tmp_path / "a", 2, seed=13), make_images(tmp_path / "b", 2, seed=14)
    for name, images, extra in (("a", "a", []), ("b", "b", []), ("c", "b", ["--dtype", "float32"])):
        proc = run("encode", str(tmp_path / images), "--model", tiny, "--out-dir", str(tmp_path / f"out_{name}"),
                   "--backend", "numpy", "--workers", "0", *extra)
        assert proc.returncode == 0, proc.stderr
    merged = [r["path"] for r, _ in read_embeddings([tmp_path / "out_a", tmp_path / "out_b"])]
    assert merged == [str(p) for p in a + b]
    with pytest.raises(GlmVitError, match=r"made with dtype 'float32', .*shard-00000.safetensors with 'bfloat16': "
                                          "not one collection"):
        list(read_embeddings([tmp_path / "out_a", tmp_path / "out_c"]))


def test_a_directory_without_shards_is_refused_not_read_as_empty(tmp_path, tiny):
    """An image folder, a fresh directory or a Ray ShardSink's output read without parts() is
    one line saying so; a run whose every image failed is an empty collection."""
    make_images(tmp_path / "img", 1, seed=16)
    (tmp_path / "sink" / "part-0").mkdir(parents=True)
    assert run("encode", str(tmp_path / "img"), "--model", tiny, "--out-dir", str(tmp_path / "sink" / "part-0"),
               "--backend", "numpy", "--workers", "0").returncode == 0
    nothing = "holds no finished shard (shard-NNNNN.safetensors and its .jsonl) and no failures.jsonl"
    for directory, why in ((tmp_path / "img", ": not the --out-dir of a run that finished a shard"),
                           (tmp_path / "sink", "; its subdirectories do: a Ray ShardSink's output is read as "
                                               "read_embeddings(glmvit_cupy.deploy.ray.parts(...))")):
        with pytest.raises(GlmVitError) as info:
            next(read_embeddings(directory))
        assert str(info.value) == f"{directory}: {nothing}{why}"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "junk.png").write_bytes(b"junk")
    failed = run("encode", str(tmp_path / "bad"), "--model", tiny, "--out-dir", str(tmp_path / "all_failed"),
                 "--backend", "numpy", "--workers", "0")
    assert failed.returncode == 1 and list(read_embeddings(tmp_path / "all_failed")) == []


def test_an_empty_file_says_so(tmp_path, tiny):
    """A zero-byte file (a failed download) is named as empty, not as an undecodable image: as a
    path, and as the bytes a collection run reads (a file, a tar member)."""
    make_images(tmp_path / "img", 1, seed=15)
    (tmp_path / "img" / "zero.jpg").write_bytes(b"")
    with tarfile.open(tmp_path / "data.tar", "w") as tar:
        tar.add(tmp_path / "img" / "zero.jpg", arcname="member.png")
    with pytest.raises(GlmVitError, match=r"^.*zero\.jpg: empty file \(0 bytes\)$"):
        preprocess(str(tmp_path / "img" / "zero.jpg"))
    out = tmp_path / "out"
    proc = run("encode", str(tmp_path / "img"), str(tmp_path / "data.tar"), "--model", tiny, "--out-dir", str(out),
               "--backend", "numpy", "--workers", "0", "--quiet")
    assert proc.returncode == 1 and "encoded 1, skipped 0, failed 2" in proc.stderr
    errors = [json.loads(line)["error"] for line in (out / "failures.jsonl").read_text().splitlines()]
    assert errors == [f"{tmp_path / 'img' / 'zero.jpg'}: empty file (0 bytes)",
                      f"{tmp_path / 'data.tar'}:member.png: empty file (0 bytes)"]


def test_neither_a_decode_worker_nor_a_collection_run_imports_ml_dtypes(tmp_path, tiny_ckpt):
    """ml_dtypes costs ~1 s of CPU to import (its dtypes registered with NumPy): every decode
    worker's interpreter (it imports the pipeline's module) and every collection run would pay it
    before their first input. Only `bf16_array`, handing out values, imports it."""
    check = "import sys, atexit; atexit.register(lambda: print('ml_dtypes' in sys.modules))\n"
    worker = subprocess.run([sys.executable, "-c", check + "import glmvit_cupy.collection.pipeline"],
                            capture_output=True, text=True)
    assert worker.returncode == 0 and worker.stdout.strip() == "False", worker.stderr
    make_images(tmp_path / "img", 2)
    run = subprocess.run([sys.executable, "-c", check + "import cli; cli.main()", "encode", str(tmp_path / "img"),
                          "--model", str(tiny_ckpt), "--out-dir", str(tmp_path / "out"), "--backend", "numpy",
                          "--dtype", "bfloat16", "--workers", "1", "--quiet"], capture_output=True, text=True)
    assert run.returncode == 0 and "encoded 2" in run.stderr and run.stdout.strip() == "False", run.stderr
