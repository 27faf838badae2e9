"""The processes the package starts (workers.py): none re-runs the caller's script, and none
outlives the process that started it, however that process dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import live_processes
from test_pipeline import make_images

REPO = Path(__file__).resolve().parents[1]


def session_processes(sid: int) -> list[int]:
    """Live processes of session `sid`."""
    return [pid for pid, fields, _ in live_processes() if int(fields[3]) == sid]


def wait_for(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_usable_cpus_follow_the_affinity_mask():
    code = "import os; os.sched_setaffinity(0, {0}); from glmvit_cupy.workers import usable_cpus; print(usable_cpus())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_a_script_without_a_main_guard_runs_once(tmp_path, tiny_ckpt):
    """Top-level code, no `if __name__ == "__main__":`: the decode workers start from the
    package, so the script's own lines run once (multiprocessing's spawn and forkserver ran
    them again in every worker, a second engine each)."""
    images = make_images(tmp_path / "img", 4, seed=2)
    script = tmp_path / "service.py"
    script.write_text(textwrap.dedent(f"""\
        print("top-level code ran", flush=True)
        from glmvit_cupy import GlmVit
        vit = GlmVit.from_pretrained({str(tiny_ckpt)!r}, backend="numpy")
        outs = vit.encode({[str(p) for p in images]!r}, workers=2)
        with vit.batcher(workers=2) as batcher:
            outs.append(batcher.submit({str(images[0])!r}).result(timeout=60))
        print("encoded", len(outs), flush=True)
        """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["top-level code ran", "encoded 5"]


@pytest.mark.parametrize("how", ["cli", "cli --devices", "library batcher"])
def test_sigkill_leaves_no_process_behind(tmp_path, tiny_ckpt, how):
    """SIGKILL of the CLI (decode workers; with --devices, engine processes too) or of a
    library user's process (a batcher's workers) mid-run: within a few seconds no process of
    its session is left, and its stderr pipe closes (a caller waiting on it returns)."""
    images = make_images(tmp_path / "img", 48, seed=3)
    if how.startswith("cli"):
        args = [sys.executable, "-c", "import cli; cli.main()", "encode", str(tmp_path / "img"), "--model",
                str(tiny_ckpt), "--out-dir", str(tmp_path / "out"), "--backend", "numpy", "--workers", "2", "-q"]
        args += ["--devices", "0,1"] if how.endswith("--devices") else []
        expected = 2 + (2 if how.endswith("--devices") else 0)
    else:
        code = textwrap.dedent(f"""\
            from glmvit_cupy import GlmVit
            vit = GlmVit.from_pretrained({str(tiny_ckpt)!r}, backend="numpy")
            with vit.batcher(workers=2) as batcher:
                while True:
                    [f.result() for f in [batcher.submit(p) for p in {[str(p) for p in images]!r}]]
            """)
        args, expected = [sys.executable, "-c", code], 2
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for(lambda: len(session_processes(proc.pid)) > expected, 60, f"{expected} child processes")
        children = [p for p in session_processes(proc.pid) if p != proc.pid]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not session_processes(proc.pid), 5, f"the children {children} to exit")
        start = time.monotonic()
        proc.communicate(timeout=5)  # returns once every holder of its pipes is gone
        assert time.monotonic() - start < 5
    finally:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
