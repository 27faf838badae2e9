"""Collection runs on the CPU (NumPy backend, tiny checkpoint): every input kind, kills and
resumes, failures, flat memory, and shards that safetensors + numpy alone can read."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit, GlmVitError, preprocess
from glmvit_cupy.pipeline import Decoder, plan_batches
from glmvit_cupy.preprocess import ProcessorConfig
from glmvit_cupy.shards import read_embeddings
from glmvit_cupy.sources import expand_inputs
from helpers import photo_like, rel_err

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
    # stderr is a pipe here: plain progress lines, no bar (tests/ cannot fake a terminal cheaply)
    assert "glmvit-cupy: 6/6 images (100%)" in proc.stderr and "\r" not in proc.stderr


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
            "--max-pixels", str(600 * 196)]
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
            "--shard-size", "1000", "--workers", "1", "--quiet", "--max-pixels", str(400 * 196)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(out.glob(".shard-*.tmp")) and time.time() < deadline:
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
    base = [str(tmp_path / "img"), "--model", tiny, "--out-dir", str(tmp_path / "out"),
            "--backend", "numpy", "--workers", "0"]
    assert run("encode", *base).returncode == 0
    proc = run("encode", *base, "--dtype", "float32")
    assert proc.returncode == 1 and "made with dtype 'bfloat16', this run has 'float32'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def peak_rss_kib(tmp_path: Path, tiny: str, n: int) -> int:
    make_images(tmp_path / f"img{n}", n, seed=6, small=True)
    code = ("import resource, sys, cli\n"
            "try:\n    cli.main()\nexcept SystemExit as e:\n    code = e.code\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, "encode", str(tmp_path / f"img{n}"), "--model", tiny,
                           "--out-dir", str(tmp_path / f"out{n}"), "--backend", "numpy", "--workers", "1",
                           "--shard-size", "50", "--quiet", "--max-pixels", str(8 * 64 * 196)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert len(records(tmp_path / f"out{n}")) == n
    return int(proc.stdout.split()[-1])


def test_host_memory_is_flat(tmp_path, tiny):
    """Ten times the images, the same peak RSS: what is held is bounded by the decode window,
    one batch (8 images here: the budget is a fixed cost) and one image's rows per output."""
    small, large = peak_rss_kib(tmp_path, tiny, 40), peak_rss_kib(tmp_path, tiny, 400)
    print(f"peak RSS: 40 images {small} KiB, 400 images {large} KiB")
    assert large <= 1.2 * small


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


FULL_DISK = r'''
import errno, sys
import glmvit_cupy.shards as shards
opened = shards._OpenShard.__init__
count = [0]


class Full:  # the disk fills up in the second shard
    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)


def init(self, *args, **kwargs):
    opened(self, *args, **kwargs)
    count[0] += 1
    if count[0] == 2:
        f, path = self.files[self.outputs[0]]
        self.files[self.outputs[0]] = (Full(f), path)


shards._OpenShard.__init__ = init
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
