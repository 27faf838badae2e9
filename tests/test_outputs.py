"""Outputs: all or nothing on a full disk, and the permissions the umask gives (not 0600)."""

from __future__ import annotations

import errno
import os
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVitError
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from glmvit_cupy.tower.synthetic import write_checkpoint
from glmvit_cupy.tower.writer import write_atomic
from helpers import photo_like


def cli(*args: str, umask: int = 0o022, file_limit: int | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh process under `umask`, optionally with files limited to `file_limit`
    bytes (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with EFBIG, as on a full disk)."""
    def limits() -> None:
        if file_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))
    return subprocess.run([sys.executable, "-B", "-c", "import cli; cli.main()", *args], capture_output=True,
                          text=True, umask=umask, preexec_fn=limits)


def one_line_failure(proc: subprocess.CompletedProcess, *words: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("glmvit-cupy: error: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("existing", [False, True])
def test_make_checkpoint_on_a_full_disk_leaves_nothing(tmp_path, existing):
    """The disk fills up in the middle of the second shard: one line, and no partial
    checkpoint (an empty target directory stays as it was)."""
    target = tmp_path / "ckpt"
    if existing:
        target.mkdir()
    proc = cli("make-checkpoint", str(target), "--geometry", "tiny", "--seed", "1",
               file_limit=1_500_000)  # the first shard is ~1.2 MB
    one_line_failure(proc, "ckpt: writing failed (File too large); nothing was left behind")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["ckpt"] if existing else [])
    assert not existing or not any(target.iterdir())
    write_checkpoint(target, "tiny", seed=1)
    assert bind_checkpoint(target).location.geometry.depth == 2


def test_a_made_checkpoint_is_fsynced_file_by_file_before_its_rename(tmp_path, monkeypatch):
    """Durable once it is there: every file of the temporary directory, and the directory, are
    fsynced before the rename (then the parent, which holds the rename)."""
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(Path(os.readlink(f"/proc/self/fd/{fd}"))), fsync(fd)))
    target = write_checkpoint(tmp_path / "ckpt", "tiny", seed=1)
    temp = synced[0].parent
    assert temp.parent == tmp_path and temp.name.startswith(".ckpt.") and not temp.exists()
    files = sorted(temp / p.name for p in target.iterdir())
    assert len(files) == 5 and sorted(synced[:-2]) == files and synced[-2:] == [temp, tmp_path]


def test_write_atomic_on_a_full_disk_keeps_the_old_file(tmp_path):
    out = tmp_path / "emb.npy"
    out.write_bytes(b"precious")

    def half_then_full(f) -> None:
        f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(GlmVitError, match=r"emb\.npy: cannot write: No space left on device"):
        write_atomic(out, half_then_full)
    assert out.read_bytes() == b"precious" and [p.name for p in tmp_path.iterdir()] == ["emb.npy"]


@pytest.fixture(scope="module")
def png(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("img") / "a.png"
    Image.fromarray(photo_like(56, 84, 1)).save(path)
    return path


def test_cli_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, tiny_ckpt, png):
    out = tmp_path / "emb.npy"
    proc = cli("encode", str(png), "--model", str(tiny_ckpt), "--out", str(out), "--backend", "numpy",
               file_limit=4096)  # the embedding is 24 KB
    one_line_failure(proc, "emb.npy: cannot write: ", "file size limit", "free some space there")
    proc = cli("make-checkpoint", str(tmp_path / "ck"), "--geometry", "tiny", file_limit=256 << 10)
    one_line_failure(proc, "ck: writing failed (File too large)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o007])
def test_outputs_get_the_umasks_permissions(tmp_path, tiny_ckpt, png, umask):
    """New and replaced embeddings, and a made checkpoint, as open()/mkdir() would create them."""
    out = tmp_path / "emb.npy"
    proc = cli("encode", str(png), "--model", str(tiny_ckpt), "--out", str(out), "--backend", "numpy", umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert mode(out) == 0o666 & ~umask
    out.chmod(0o600)
    first = np.load(out)
    assert cli("encode", str(png), "--model", str(tiny_ckpt), "--out", str(out), "--backend", "numpy",
               umask=umask).returncode == 0
    assert mode(out) == 0o666 & ~umask and np.array_equal(np.load(out), first)
    ckpt = tmp_path / "ck"
    proc = cli("make-checkpoint", str(ckpt), "--geometry", "tiny", umask=umask)
    assert proc.returncode == 0, proc.stderr
    assert mode(ckpt) == 0o777 & ~umask
    assert {mode(p) for p in ckpt.iterdir()} == {0o666 & ~umask}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "emb.npy"]


def test_killed_writers_leave_nothing_a_rerun_does_not_remove(tmp_path):
    """SIGTERM unwinds (the writer removes its temporary directory); what a SIGKILL leaves (a
    dead process's temporary) is removed by the next write of the same output."""
    import signal
    import subprocess
    import sys
    import time

    cli = [sys.executable, "-c", "import cli; cli.main()"]
    proc = subprocess.Popen([*cli, "make-checkpoint", str(tmp_path / "ckpt"), "--geometry", "real"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60

    def writing() -> bool:  # tensor bytes on disk: mid-write, past the imports (a signal that lands
        # inside an extension module's import can be lost there, which is not what this tests)
        return any(f.stat().st_size > 1 << 20 for d in tmp_path.glob(".ckpt.*.tmp") for f in d.glob("*.safetensors*"))

    while not writing() and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".ckpt.{int(gone.stdout)}-0badf00d.tmp"  # a SIGKILLed writer's, its process gone
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".ckpt.{sleeper.pid}-0badf00d.tmp"  # a writer still at work: not ours to remove
        live.mkdir()
        made = subprocess.run([*cli, "make-checkpoint", str(tmp_path / "ckpt"), "--geometry", "tiny"],
                              capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "ckpt"])
    finally:
        sleeper.kill()
