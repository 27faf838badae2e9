"""`glmvit-cupy serve` as processes: two HTTP fronts over the one engine process (NumPy backend, tiny
checkpoint, loopback). A killed front is replaced while the other answers; /metrics counts every
front's requests; concurrent distinct images come back bit for bit as `encode` makes them, whichever
front took them; a computation outlives the request that started it, and keeps its slot; a request
of more images than a front has slots is 429; a burst's slot pages go back under a lighter load;
nothing is left in /dev/shm or the temporary directory after exit; the fronts die with the engine.
The drain with two fronts is test_serve.py's SIGTERM test."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest

httpx = pytest.importorskip("httpx", reason="the [serve] extra is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")

from glmvit_cupy import GlmVit  # noqa: E402
from glmvit_cupy.deploy.front import WARM_SLOTS  # noqa: E402
from helpers import assert_same_rows  # noqa: E402
from serving import ServerProcess, alive  # noqa: E402
from test_serve import data_url, error_of, occupy_engine, png, safetensors_arrays, until  # noqa: E402

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
        rounds = []
        for _ in range(10):  # which front accepts a connection is the kernel's choice: all 32 may go to one
            rounds.append(asyncio.run(post_all(f"{server.url}/embed?output=both&dtype=float32", images)))
            served = fronts_that_served(server, "POST /embed 200")
            if served == {"0", "1"}:
                break
    assert served == {"0", "1"}
    for answers in rounds:
        assert [r.status_code for r in answers] == [200] * 32
    for data, r in zip(images * len(rounds), [r for answers in rounds for r in answers]):
        want = vit.encode(data, output="both", dtype="float32")[0]
        got = safetensors_arrays(r.content)
        assert_same_rows(got["pooler_output"], want.pooler_output)
        assert_same_rows(got["last_hidden_state"], want.last_hidden_state)
        assert got["grid_thw"].tolist() == want.grid_thw.tolist()


def test_a_computation_outlives_the_request_that_started_it_and_keeps_its_slot(tiny_ckpt, vit):
    """Three requests of one image while the engine is busy: the first (its front decoded the image into
    that request's slot) gives up while the canvas waits in the batcher; the two that share its
    computation still get the image's embedding, and a request arriving meanwhile does not take the
    departed one's slot from under the batcher (the slot stays the engine's until the batcher has
    read the canvas). One front: its slots are handed out last freed first."""
    image, other = png(64, seed=400), png(64, seed=401)

    async def main(server: ServerProcess):
        embed = f"{server.url}/embed?dtype=float32"
        shared_before = await asyncio.to_thread(server.metric, "glmvit_cache_requests_total", result="shared")
        async with httpx.AsyncClient(timeout=60) as client:
            busy = await occupy_engine(client, server, seed=402)
            first = asyncio.ensure_future(client.post(embed, content=image, timeout=0.6))
            await until(lambda: server.metric("glmvit_queue_size", engine="0") == 1)
            sharing = [asyncio.ensure_future(client.post(embed, content=image)) for _ in range(2)]
            await until(lambda: server.metric("glmvit_cache_requests_total", result="shared") == shared_before + 2)
            with pytest.raises(httpx.TimeoutException):  # gives up: its canvas is still queued
                await first
            await asyncio.to_thread(server.wait_for, r"POST /embed 499 ", 10)
            late = await client.post(embed, content=other)
            return await busy, await asyncio.gather(*sharing), late

    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--http-workers", "1") as server:
        busy, sharing, late = asyncio.run(main(server))
    assert busy.status_code == 200 and [r.status_code for r in sharing] == [200, 200] and late.status_code == 200
    for r, data in [*((r, image) for r in sharing), (late, other)]:
        got = safetensors_arrays(r.content)["pooler_output"]
        assert_same_rows(got, vit.encode(data, dtype="float32")[0].pooler_output)


def slots_resident_bytes(pid: int) -> int:
    """Bytes of a front's slots memfd (its larger memfd mapping) resident in the process, from smaps."""
    mappings, current = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                current = [int(head.group(2), 16) - int(head.group(1), 16), 0] if "memfd:glmvit-front" in line else None
                if current:
                    mappings.append(current)
            elif current is not None and line.startswith("Rss:"):
                current[1] = int(line.split()[1]) * 1024
    return max(mappings)[1]


def test_a_burst_s_slot_pages_go_back_under_a_lighter_load(tiny_ckpt):
    """Sixteen images queued at once behind a busy engine fill sixteen slots of the one front; as their
    answers and later ones, one at a time, are sent, each gives back the pages of a cold slot, down to
    the few a load of one keeps warm."""
    async def burst(server: ServerProcess, front: int) -> tuple[list[httpx.Response], int]:
        async with httpx.AsyncClient(timeout=120) as client:
            busy = await occupy_engine(client, server, seed=500)
            queued = [asyncio.ensure_future(client.post(f"{server.url}/embed", content=png(448, seed=501 + i)))
                      for i in range(16)]
            await until(lambda: server.metric("glmvit_queue_size", engine="0") == 16)
            resident = slots_resident_bytes(front)
            return [await busy, *await asyncio.gather(*queued)], resident

    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--http-workers", "1") as server:
        front = server.front_pids()[0]
        answers, during = asyncio.run(burst(server, front))
        assert [r.status_code for r in answers] == [200] * 17
        for i in range(16):
            assert httpx.post(f"{server.url}/embed", content=png(448, seed=520 + i)).status_code == 200
        after = slots_resident_bytes(front)
    canvas = 448 * 448 * 3
    assert during > 16 * canvas and after < (WARM_SLOTS + 2) * canvas, (during, after)


def test_a_request_of_more_images_than_a_front_holds_is_429(tiny_ckpt):
    """2 x --max-queue 1 = 2 held requests, one a front: a front has one slot, and a request of two
    images (each needs its slot at once) is refused, not left waiting for a slot that never comes."""
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--max-queue", "1", *TWO_FRONTS) as server:
        two = [data_url(png(40, seed=i)) for i in (1, 2)]
        r = httpx.post(f"{server.url}/v1/embeddings", json={"input": two}, timeout=30)
        assert r.status_code == 429 and error_of(r) == ("overloaded: a request of 2 images is more than a front "
                                                        "holds at once (1): send fewer a request")
        assert httpx.post(f"{server.url}/v1/embeddings", json={"input": two[:1]}).status_code == 200


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
    """... however it dies. SIGKILL leaves its metrics directory behind (in TMPDIR), which the next
    server started there removes (its pid is gone); a live server's is kept."""
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
    (left,) = tmp_path.iterdir()
    assert left.name == f"glmvit-serve-metrics-{server.proc.pid}-" + left.name.rsplit("-", 1)[1]
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy") as live:
        (own,) = tmp_path.iterdir()
        assert own.name.startswith(f"glmvit-serve-metrics-{live.proc.pid}-")
        with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy"):
            assert len(list(tmp_path.iterdir())) == 2 and own.exists()  # the live server's kept
    assert list(tmp_path.iterdir()) == []
