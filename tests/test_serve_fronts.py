"""`glmvit-cupy serve` as processes: two HTTP fronts over the one engine process (NumPy backend, tiny
checkpoint, loopback). A killed front is replaced while the other answers; /metrics counts every
front's requests; concurrent distinct images come back bit for bit as `encode` makes them, whichever
front took them; nothing is left in /dev/shm or the temporary directory after exit; the fronts die
with the engine. The drain with two fronts is test_serve.py's SIGTERM test."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="the [serve] extra is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")

from glmvit_cupy import GlmVit  # noqa: E402
from serving import ServerProcess, alive  # noqa: E402
from test_serve import png, safetensors_arrays, until  # noqa: E402

TWO_FRONTS = ("--http-workers", "2")


def fronts_that_served(server: ServerProcess, pattern: str) -> set[str]:
    return {m.group(1) for m in (re.search(r"front (\d): .*" + pattern, line) for line in server.lines) if m}


async def post_all(url: str, bodies: list[bytes]) -> list[httpx.Response]:
    """Every body at once, each on a connection of its own (so the fronts share them)."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        return await asyncio.gather(*(client.post(url, content=body) for body in bodies))


@pytest.fixture(scope="module")
def vit(tiny_ckpt):
    return GlmVit.from_pretrained(tiny_ckpt, backend="numpy")


def test_a_killed_front_is_replaced_while_the_other_answers(tiny_ckpt):
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", *TWO_FRONTS) as server:
        killed = server.front_pids()[0]
        os.kill(killed, signal.SIGKILL)
        answers = asyncio.run(post_all(f"{server.url}/embed", [png(64, seed=100 + i) for i in range(8)]))
        assert [r.status_code for r in answers] == [200] * 8  # the backlog is one: the other front takes it all
        server.wait_for(rf"HTTP front 0 \(pid {killed}\) died \(killed by signal 9\); starting another", 10)
        asyncio.run(until(lambda: server.metric("glmvit_http_fronts") == 2))
        replacement = server.front_pids()[0]
        assert replacement != killed and alive(replacement)
        assert httpx.get(f"{server.url}/health").status_code == 200
        answers = asyncio.run(post_all(f"{server.url}/embed", [png(64, seed=110 + i) for i in range(8)]))
        assert [r.status_code for r in answers] == [200] * 8
    assert server.proc.returncode == 0 and "Traceback" not in server.log()


def test_metrics_count_the_requests_of_every_front(tiny_ckpt):
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", *TWO_FRONTS) as server:
        before = server.metric("glmvit_requests_total", route="/embed", status="200")
        sent = 0
        for round_ in range(10):  # which front accepts a connection is the kernel's choice
            answers = asyncio.run(post_all(f"{server.url}/embed", [png(32, seed=7)] * 16))
            assert {r.status_code for r in answers} == {200}
            sent += len(answers)
            if fronts_that_served(server, "POST /embed 200") == {"0", "1"}:
                break
        assert fronts_that_served(server, "POST /embed 200") == {"0", "1"}
        assert server.metric("glmvit_requests_total", route="/embed", status="200") - before == sent
        assert server.metric("glmvit_cache_requests_total", result="miss") == 1  # one engine, one cache


def test_concurrent_distinct_images_over_two_fronts_equal_encode_bit_for_bit(tiny_ckpt, vit):
    """32 images at once: each answer is its own image's (a slot mixed up or reused too early would
    hand one request another's canvas or answer), bit for bit what `encode` makes of it alone."""
    images = [png((40 + 4 * (i % 8), 64 + 8 * (i // 8)), seed=300 + i) for i in range(32)]
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", *TWO_FRONTS) as server:
        answers = asyncio.run(post_all(f"{server.url}/embed?output=both&dtype=float32", images))
        served = fronts_that_served(server, "POST /embed 200")
    assert [r.status_code for r in answers] == [200] * 32
    assert served == {"0", "1"}
    for data, r in zip(images, answers):
        want = vit.encode(data, output="both", dtype="float32")[0]
        got = safetensors_arrays(r.content)
        assert np.array_equal(got["pooler_output"], want.pooler_output)
        assert np.array_equal(got["last_hidden_state"], want.last_hidden_state)
        assert got["grid_thw"].tolist() == want.grid_thw.tolist()


def test_nothing_is_left_in_dev_shm_or_the_temporary_directory(tiny_ckpt, tmp_path, monkeypatch):
    """The fronts' metrics directory is the engine's to remove; the slots are memfds, which have no name."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    shm = set(os.listdir("/dev/shm"))
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", *TWO_FRONTS) as server:
        assert [p.name.startswith("glmvit-serve-metrics-") for p in tmp_path.iterdir()] == [True]
        assert httpx.post(f"{server.url}/embed", content=png(64, seed=5)).status_code == 200
        assert server.metric("glmvit_requests_total", route="/embed", status="200") == 1
    assert server.proc.returncode == 0
    assert list(tmp_path.iterdir()) == [] and set(os.listdir("/dev/shm")) == shm


def test_the_fronts_die_with_the_engine(tiny_ckpt, tmp_path, monkeypatch):
    """... however it dies: SIGKILL leaves its metrics directory behind (in TMPDIR), nothing else."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    server = ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", *TWO_FRONTS)
    pids = server.front_pids()
    server.proc.kill()
    server.proc.wait()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a front outlived the engine"
        time.sleep(0.05)
    server.stop()
