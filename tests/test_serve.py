"""`glmvit-cupy serve` as a client sees it: real server processes on loopback (NumPy backend, tiny
checkpoint, tests/serving.py), every route and status, results equal to `encode`, the cache's single
flight, disconnects, overload and timeouts, 50 bad images in a row, and the drain on SIGTERM. CI
installs the [serve] extra; a machine without it skips this file."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

httpx = pytest.importorskip("httpx", reason="the [serve] extra is not installed")
pytest.importorskip("starlette", reason="the [serve] extra is not installed")

import glmvit_cupy  # noqa: E402
from glmvit_cupy import GlmVit  # noqa: E402
from glmvit_cupy.tower.checkpoint import locate_tower  # noqa: E402
from glmvit_cupy.tower.synthetic import write_checkpoint  # noqa: E402
from glmvit_cupy.deploy.front import b64decode  # noqa: E402
from glmvit_cupy.deploy.serve import SEND_BUFFER_BYTES, SWITCH_INTERVAL_S, listen  # noqa: E402
from helpers import TOLERANCE, bomb_png, photo_like, rel_err  # noqa: E402
from serving import ServerProcess, alive  # noqa: E402
from test_cli import assert_clean_failure, run  # noqa: E402

PAYLOAD_LIMIT = 4 * 2**20
HUGE = 1344  # a side whose forward takes ~1.7 s on this tower on this CPU: the engine stays busy a while


def png(side: int | tuple[int, int], seed: int) -> bytes:
    h, w = (side, side) if isinstance(side, int) else side
    out = io.BytesIO()
    Image.fromarray(photo_like(h, w, seed=seed)).save(out, "PNG")
    return out.getvalue()


def jpeg(side: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(photo_like(side, side, seed=seed)).save(out, "JPEG", quality=90)
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def error_of(r: httpx.Response) -> str:
    message = r.json()["error"]["message"]
    assert "\n" not in message and r.json()["error"]["code"] == r.status_code
    return message


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    (root / "a.png").write_bytes(png((120, 90), seed=1))
    return root


@pytest.fixture(scope="module")
def server(tiny_ckpt, files):
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--allow-files", str(files),
                       "--payload-limit", str(PAYLOAD_LIMIT)) as s:
        yield s


@pytest.fixture(scope="module")
def vit(tiny_ckpt):
    return GlmVit.from_pretrained(tiny_ckpt, backend="numpy")


def safetensors_arrays(body: bytes) -> dict[str, np.ndarray]:
    import safetensors

    kinds = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "BF16": np.uint16}
    return {name: np.frombuffer(t["data"], kinds[t["dtype"]]).reshape(t["shape"])
            for name, t in safetensors.deserialize(body)}


def widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_embed_equals_encode_in_every_format_and_a_repeat_is_a_cache_hit(server, vit, files):
    data = (files / "a.png").read_bytes()
    want = vit.encode(files / "a.png", output="both", dtype="float32")[0]
    r = httpx.post(f"{server.url}/embed", content=data)  # the library's defaults: pooler, bfloat16
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert r.headers["x-cache"] == "miss" and float(r.headers["x-inference-time"]) > 0
    got = safetensors_arrays(r.content)
    assert sorted(got) == ["grid_thw", "pooler_output"] and got["pooler_output"].dtype == np.uint16
    assert got["grid_thw"].tolist() == want.grid_thw.tolist()
    assert rel_err(widen(got["pooler_output"]), want.pooler_output) < 1e-2  # bfloat16's rounding
    r = httpx.post(f"{server.url}/embed?dtype=float32", content=data)
    assert r.headers["x-cache"] == "miss"  # another dtype: another key
    assert rel_err(safetensors_arrays(r.content)["pooler_output"], want.pooler_output) < TOLERANCE
    again = httpx.post(f"{server.url}/embed?dtype=float32", content=data)
    assert again.headers["x-cache"] == "hit" and again.content == r.content
    assert all(float(again.headers[h]) == 0 for h in ("x-queue-time", "x-decode-time", "x-inference-time"))
    both = safetensors_arrays(httpx.post(f"{server.url}/embed?output=both&dtype=float16", content=data).content)
    assert both["pooler_output"].dtype == np.float16 and both["last_hidden_state"].shape == want.last_hidden_state.shape
    assert rel_err(both["last_hidden_state"], want.last_hidden_state) < 1e-3  # float16's rounding
    npy = httpx.post(f"{server.url}/embed?output=last_hidden&dtype=float32", content=data,
                     headers={"accept": "application/x-npy"})
    assert npy.headers["content-type"] == "application/x-npy"
    assert rel_err(np.load(io.BytesIO(npy.content)), want.last_hidden_state) < TOLERANCE


def test_v1_embeddings_float_and_base64_equal_encode(server, vit, files):
    images = [(files / "a.png").read_bytes(), png((60, 200), seed=2)]
    want = vit.encode(images, output="both", dtype="float32")
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": [data_url(d) for d in images], "model": server.model,
                                                        "dtype": "float32"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.model
    tokens = sum(len(w.pooler_output) for w in want)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    for i, (item, w) in enumerate(zip(body["data"], want)):
        assert item["object"] == "embedding" and item["index"] == i and item["grid_thw"] == w.grid_thw[0].tolist()
        assert item["shape"] == list(w.pooler_output.shape)
        assert rel_err(np.array(item["embedding"], np.float32), w.pooler_output) < TOLERANCE
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": data_url(images[1]), "encoding_format": "base64",
                                                        "output": "both", "dtype": "bfloat16"})
    item = r.json()["data"][0]
    assert r.headers["x-cache"] == "miss"  # another output and dtype: another key
    for name in ("pooler_output", "last_hidden_state"):
        bits = np.frombuffer(base64.b64decode(item["embedding"][name]), np.uint16).reshape(item["shape"])
        assert rel_err(widen(bits), getattr(want[1], name)) < 1e-2  # bfloat16's rounding


def test_paths_only_under_allow_files(server, vit, files):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a.png", f"file://{files / 'a.png'}"]})
    assert r.status_code == 200 and r.headers["x-cache"] in ("hit,hit", "miss,shared", "miss,hit")
    for path in ("../a.png", "/etc/hostname", f"{files}/../x.png"):
        r = httpx.post(f"{server.url}/v1/embeddings", json={"input": [path]})
        assert r.status_code == 403 and "outside --allow-files" in error_of(r), path
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["https://example.com/a.png"]})
    assert r.status_code == 400 and "fetches no https:// URLs" in error_of(r)
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["missing.png"]})
    assert r.status_code == 422 and error_of(r).startswith("input 0: missing.png: cannot read")


def test_health_info_and_metrics(server, vit):
    r = httpx.get(f"{server.url}/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"}) and "x-total-time" in r.headers
    info = httpx.get(f"{server.url}/info").json()
    assert info["fingerprint"] == vit.fingerprint and info["backend"] == "numpy" and info["engines"] == 1
    assert info["geometry"]["out_hidden_size"] == vit.geometry.out_hidden_size
    assert info["processor"]["max_image_tokens"] == vit.processor.max_image_tokens
    assert info["limits"]["payload_limit"] == PAYLOAD_LIMIT and info["limits"]["p_max"] == vit.p_max
    metrics = server.metrics()
    assert metrics[("glmvit_ready", ())] == 1
    assert metrics[("glmvit_engine_info", (("backend", "numpy"), ("engines", "1"), ("fingerprint", vit.fingerprint),
                                           ("model", server.model), ("version", glmvit_cupy.__version__)))] == 1
    for name in ("glmvit_queue_size", "glmvit_engine_busy_ratio", "glmvit_engine_images_total"):
        assert (name, (("engine", "0"),)) in metrics, name
    assert metrics[("glmvit_requests_total", (("route", "/health"), ("status", "200")))] >= 1


def test_client_errors_are_one_line_each(server):
    url = server.url
    cases = [
        (httpx.post(f"{url}/v1/embeddings", content=b"{not json"), 400, "not JSON"),
        (httpx.post(f"{url}/v1/embeddings", json=["x"]), 400, "expected an object"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": []}), 400, "non-empty list"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": "x", "dimensions": 3}), 400, "unknown field(s) dimensions"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": "data:image/png;base64,@@"}), 400, "base64"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": "data:image/png;base64,QUJ\u00e9"}), 400, "base64"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": "data:text/plain;base64,QQ=="}), 400, "data:image/"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": "x", "model": "other"}), 400, "this server serves"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": "x", "encoding_format": "hex"}), 400, "encoding_format"),
        (httpx.post(f"{url}/embed?dtype=int8", content=b"x"), 400, "dtype 'int8'"),
        (httpx.post(f"{url}/embed", content=b""), 400, "empty body"),
        (httpx.post(f"{url}/embed?output=both", content=b"x", headers={"accept": "application/x-npy"}), 400, ".npy"),
        (httpx.post(f"{url}/embed", content=b"x", headers={"accept": "text/html"}), 406, "application/x-npy"),
        (httpx.post(f"{url}/embed", content=b"\0" * (PAYLOAD_LIMIT + 1)), 413, "payload limit"),
        (httpx.post(f"{url}/embed", content=iter([b"\0" * PAYLOAD_LIMIT, b"\0"])), 413, "payload limit"),  # chunked
        (httpx.post(f"{url}/v1/embeddings", json={"input": "x" * PAYLOAD_LIMIT}), 413, "payload limit"),
        (httpx.post(f"{url}/v1/embeddings", json={"input": [data_url(png(40, 3)), data_url(b"GIF89a")]}), 422,
         "input 1: "),
        (httpx.post(f"{url}/embed", content=b"not an image"), 422, "body: "),
        (httpx.get(f"{url}/nope"), 404, "no route GET /nope"),
        (httpx.get(f"{url}/embed"), 405, "no route GET /embed"),
    ]
    for r, status, words in cases:
        assert r.status_code == status and words in error_of(r), (status, words, r.status_code, r.text)
        assert "x-total-time" in r.headers and "x-inference-time" in r.headers
    assert "Traceback" not in server.log()


def test_fifty_bad_images_in_a_row_leave_the_server_healthy_and_serving(server, tmp_path):
    good = png(64, seed=9)
    bad = [b"\x89PNG\r\n\x1a\n", good[: len(good) // 2], bomb_png(tmp_path / "bomb.png", 30000, 30000).read_bytes(),
           b"GIF89a" + bytes(range(256))]
    before = server.metric("glmvit_requests_total", route="/embed", status="422")
    for i in range(50):
        r = httpx.post(f"{server.url}/embed", content=bad[i % len(bad)] + i.to_bytes(2, "little"))  # distinct
        assert r.status_code == 422 and error_of(r).startswith("body: "), r.text
    assert server.metric("glmvit_requests_total", route="/embed", status="422") - before == 50
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/embed", content=good)
    assert r.status_code == 200 and safetensors_arrays(r.content)["pooler_output"].shape[1] == 256


async def occupy_engine(client: httpx.AsyncClient, server: ServerProcess, seed: int, engine: str = "0"):
    """A HUGE image's request, returned once its forward has started: on the NumPy backend the forward
    runs in the batcher's dispatcher, so nothing else reaches that engine for its ~1.7 s (longer on a
    loaded machine). The metrics say when: the engine took one more request and none waits."""
    before = await asyncio.to_thread(server.metric, "glmvit_engine_requests_total", engine=engine)
    task = asyncio.ensure_future(client.post(f"{server.url}/embed", content=jpeg(HUGE, seed)))
    while not (await asyncio.to_thread(server.metric, "glmvit_engine_requests_total", engine=engine) == before + 1
               and await asyncio.to_thread(server.metric, "glmvit_queue_size", engine=engine) == 0):
        await asyncio.sleep(0.01)
    return task


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_identical_concurrent_requests_are_computed_once(server):
    image = png(64, seed=21)  # a new image
    names = ("hit", "miss", "shared")
    before = {k: server.metric("glmvit_cache_requests_total", result=k) for k in names}
    engine = server.metric("glmvit_engine_requests_total", engine="0")

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            busy = await occupy_engine(client, server, seed=20)  # so all 8 arrive while the first is queued
            same = await asyncio.gather(*(client.post(f"{server.url}/embed", content=image) for _ in range(8)))
            return same, await busy
    responses, busy = asyncio.run(main())
    assert busy.status_code == 200 and [r.status_code for r in responses] == [200] * 8
    assert len({r.content for r in responses}) == 1
    after = {k: server.metric("glmvit_cache_requests_total", result=k) - before[k] for k in names}
    assert after == {"hit": 0, "miss": 2, "shared": 7}, after  # the busy image's miss, then the 8
    assert server.metric("glmvit_engine_requests_total", engine="0") - engine == 2
    assert sorted(r.headers["x-cache"] for r in responses) == ["miss"] + ["shared"] * 7


def test_a_client_that_disconnects_has_its_queued_work_dropped(server):
    requests, images = (server.metric(name, engine="0") for name in ("glmvit_engine_requests_total",
                                                                      "glmvit_engine_images_total"))

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            busy = await occupy_engine(client, server, seed=30)
            with pytest.raises(httpx.TimeoutException):  # gives up while queued: httpx closes the connection
                await client.post(f"{server.url}/embed", content=png(64, seed=31), timeout=0.3)
            return await busy
    assert asyncio.run(main()).status_code == 200
    server.wait_for(r"POST /embed 499 .* client disconnected", 10)
    assert server.metric("glmvit_requests_total", route="/embed", status="499") == 1
    assert server.metric("glmvit_engine_requests_total", engine="0") - requests == 2  # it was queued...
    time.sleep(0.5)  # time enough for its forward, had it been kept
    assert server.metric("glmvit_engine_images_total", engine="0") - images == 1  # ...and never computed
    assert server.metric("glmvit_queue_size", engine="0") == 0


def test_overload_is_429_at_once_and_a_late_image_504(tiny_ckpt):
    async def main(server):
        async with httpx.AsyncClient(timeout=60) as client:
            busy = await occupy_engine(client, server, seed=40)
            queued = [asyncio.ensure_future(client.post(f"{server.url}/embed", content=png(64, seed=41 + i)))
                      for i in range(2)]
            await until(lambda: server.metric("glmvit_queue_size", engine="0") == 2)
            t0 = time.perf_counter()
            refused = await client.post(f"{server.url}/embed", content=png(64, seed=43))
            return refused, time.perf_counter() - t0, await asyncio.gather(*queued), await busy
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--max-queue", "2",
                       "--timeout", "0.6") as server:
        refused, refused_s, late, busy = asyncio.run(main(server))
        assert httpx.get(f"{server.url}/health").status_code == 200
    assert refused.status_code == 429 and error_of(refused).startswith("overloaded: 2 requests are already waiting")
    assert refused_s < 0.5  # at once, not after a wait
    for r in late:
        assert r.status_code == 504 and error_of(r).startswith("body: ") and "0.6 s" in error_of(r), r.text
    assert busy.status_code == 200


def test_a_flood_past_the_held_requests_cap_is_answered_200_or_429_at_once(tiny_ckpt):
    """48 requests of one image while the engine is busy: they share one computation, so the batcher's
    queue holds one image and only the cap on held requests (2 x --max-queue 2 x 1 engine = 4, the
    busy one included) can refuse them. One HTTP front: the cap is split between the fronts."""
    flood, cap = 48, 4

    async def timed(client: httpx.AsyncClient, url: str, body: bytes):
        try:
            r = await client.post(url, content=body)
        except httpx.HTTPError as exc:  # a reset or hung connection: counted, then failed below
            return type(exc).__name__, time.perf_counter(), None
        return r.status_code, time.perf_counter(), r

    async def main(server):
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=flood)) as client:
            busy = await occupy_engine(client, server, seed=70)
            busy_done: list[float] = []
            busy.add_done_callback(lambda _: busy_done.append(time.perf_counter()))
            image = png(64, seed=71)
            answers = await asyncio.gather(*(timed(client, f"{server.url}/embed", image) for _ in range(flood)))
            busy_answer = await busy
            return answers, busy_answer, busy_done[0]
    with ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--max-queue", "2",
                       "--http-workers", "1") as server:
        assert httpx.get(f"{server.url}/info").json()["limits"]["max_requests"] == cap
        answers, busy, busy_answered = asyncio.run(main(server))
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert server.metric("glmvit_requests_total", route="/embed", status="429") == flood - (cap - 1)
    statuses = [status for status, _, _ in answers]
    assert sorted(set(statuses), key=str) == [200, 429], statuses
    assert statuses.count(200) == cap - 1 and busy.status_code == 200  # the cap, the busy request included
    for status, answered, r in answers:
        if status == 429:  # at once: before the busy forward (~1.7 s, longer on a loaded machine) ends
            assert answered < busy_answered and error_of(r).startswith("overloaded: the server holds 4 requests (max 4)")
    assert len({r.content for status, _, r in answers if status == 200}) == 1


def test_an_idle_keep_alive_connection_outlives_the_clients_pool_expiry(server):
    """A connection idle 6 s (past httpx's 5 s pool expiry, which equalled uvicorn's own idle
    timeout: a POST sent as the server closed it was reset) still answers."""
    host, port = httpx.URL(server.url).host, httpx.URL(server.url).port

    def health(sock: socket.socket) -> bytes:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: glmvit\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                re.search(rb"content-length: (\d+)", data, re.I).group(1)):
            chunk = sock.recv(65536)
            if not chunk:
                return data  # closed by the server
            data += chunk
        return data

    with socket.create_connection((host, port), timeout=10) as sock:
        assert health(sock).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        assert health(sock).startswith(b"HTTP/1.1 200")


def test_accepted_connections_send_through_the_servers_send_buffer():
    """uvloop writes as much of an answer as the kernel takes while holding the GIL: the listener's
    SO_SNDBUF bounds it, and what the server accepts inherits it (Linux doubles the value set)."""
    with listen("127.0.0.1", 0) as sock, socket.create_connection(sock.getsockname()[:2]):
        accepted, _ = sock.accept()
        with accepted:
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * SEND_BUFFER_BYTES


def test_the_data_url_decode_is_base64_b64decode_refusing_what_it_refuses():
    """front.b64decode (NumPy, off the GIL) against the standard library's strict decode."""
    rng = np.random.default_rng(0)
    for n in [*range(40), 3 * 2**16 + 1, 700_002]:
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert b64decode(base64.b64encode(data).decode()) == data
    for bad in ["A", "AB=", "ABC=D", "A===", "AB=A", "A=B=", "====", "AB==AB==", "AB\nC", "ABC@", "ABC\u00e9",
                " ABC", "QUJD-A=="]:
        with pytest.raises(ValueError):  # binascii.Error, or (not ASCII) ValueError
            base64.b64decode(bad, validate=True)
        with pytest.raises(ValueError, match="base64|multiple of 4|padding"):
            b64decode(bad)


@pytest.mark.parametrize("fronts", [1, 2])
def test_sigterm_drains_queued_work_then_exits_0(tiny_ckpt, fronts):
    """... and the process ran at the server's GIL switch interval, its log lines (written by a thread)
    all out before it exited. With two HTTP fronts the requests are held by both, and the engine
    process exits once both have answered theirs and exited."""
    at_exit = "import atexit, sys; atexit.register(lambda: print('switch interval', sys.getswitchinterval(), " \
              "file=sys.stderr))"
    server = ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--devices", "0,1", "--http-workers",
                           str(fronts), prelude=at_exit)
    try:
        pids = server.front_pids()
        assert {server.metric("glmvit_engine_images_total", engine=e) for e in ("0", "1")} == {1}  # the warm-ups

        def taken() -> float:
            return sum(server.metric("glmvit_engine_requests_total", engine=e) for e in ("0", "1"))

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                work = []
                for i in range(4):  # a connection at a time: each meets the fronts' accept balance on its own
                    # (a burst of four once found a busy host's second front asleep, and all went to the first)
                    work.append(asyncio.ensure_future(client.post(f"{server.url}/embed",
                                                                  content=jpeg(HUGE, seed=60 + i))))
                    await asyncio.sleep(0.05)
                await until(lambda: taken() == 2 + 4)  # all four taken: none done (a forward takes ~1.7 s)
                server.proc.send_signal(15)
                await asyncio.to_thread(server.wait_for, "draining: 4 request", 10)
                health = await client.get(f"{server.url}/health")
                late = await client.post(f"{server.url}/embed", content=png(64, seed=1))
                return health, late, await asyncio.gather(*work)
        health, late, done = asyncio.run(main())
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        assert late.status_code == 503 and "draining" in error_of(late)
        assert [r.status_code for r in done] == [200] * 4
        assert server.proc.wait(30) == 0
        server.stop()  # its stderr read to the end
        assert "Traceback" not in server.log()
        assert len(re.findall(r"POST /embed 200 ", server.log())) == 4
        assert set(re.findall(r"front (\d): .*POST /embed 200 ", server.log())) == {str(i) for i in range(fronts)}
        assert server.lines[-1] == f"switch interval {SWITCH_INTERVAL_S}"
        assert not any(alive(pid) for pid in pids)
    finally:
        server.stop()


def test_over_the_budget_or_non_finite_is_422_and_the_server_serves_on(tmp_path):
    """A server whose forward call holds 160 patches (it warms up within them) answers 422 naming the
    input for an image over them, and for an image whose embedding overflows: one weight set so large
    (the patch embedding's red tap, as test_api's overflow test) that only a pure white pixel overflows
    float32, the warm-up photograph's brightest (252) does not. Good images around them get 200."""
    ckpt = write_checkpoint(tmp_path / "c", "tiny", seed=13, export="vision-only")
    entry = locate_tower(ckpt).entries["patch_embed.proj.weight"]
    with open(entry.shard, "r+b") as f:
        f.seek(entry.offset)
        f.write(np.uint16(0x7F06).tobytes())  # 1.78e38: x (255 normalised: 1.93) overflows, x (252: 1.89) not
    white = io.BytesIO()
    Image.new("RGB", (56, 84), "white").save(white, "PNG")
    with ServerProcess("--model", str(ckpt), "--backend", "numpy", "--max-pixels", str(28 * 28 * 40)) as server:
        url = server.url
        r = httpx.post(f"{url}/v1/embeddings", json={"input": [data_url(png(56, 1)), data_url(png(28 * 20, 2))]})
        assert r.status_code == 422 and error_of(r).startswith("input 1: ") and "exceed p_max 160" in error_of(r)
        r = httpx.post(f"{url}/embed", content=white.getvalue())
        assert r.status_code == 422 and error_of(r) == "body: image: the embedding has non-finite values (NaN or Inf)"
        assert httpx.post(f"{url}/embed", content=png(56, 3)).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        assert server.metric("glmvit_requests_total", route="/embed", status="422") == 1
    assert "Traceback" not in server.log() and "Warning" not in server.log()  # the 422's line says it all


# In the server process: a GPU fault (the error faults.synchronize raises) in the forward of any batch
# holding a 56 x 560 image; everything else computes.
_FAULT_ON_56X560 = """
import glmvit_cupy.collection.staging as staging
from glmvit_cupy.errors import GlmVitError
real = staging.NumpyStager.submit
def submit(self, canvases, *rest):
    if any(c.shape[:2] == (56, 560) for c in canvases):
        raise GlmVitError("the GPU failed in the forward: an illegal memory access was encountered; restart the process")
    return real(self, canvases, *rest)
staging.NumpyStager.submit = submit
"""


def test_an_engine_failure_is_500_then_health_503_and_the_server_exits_1(tiny_ckpt):
    """The engine's own failure (a GPU fault leaves the process's CUDA context unusable) is no client's
    mistake: 500 naming it, /health stops saying 200, and the process exits 1 for its supervisor to
    restart it, instead of answering every later request with the same fault. It exits as a drain does,
    once the requests it holds are answered: behind the failing image (a batch of its own: the budget
    holds one HUGE image and little more) a HUGE image still computes, and gets its 200."""
    async def main(server: ServerProcess) -> tuple:
        async with httpx.AsyncClient(timeout=60) as client:
            busy = await occupy_engine(client, server, seed=80)
            failing = asyncio.ensure_future(client.post(f"{server.url}/embed", content=png((56, 560), 81)))
            await until(lambda: server.metric("glmvit_queue_size", engine="0") == 1)
            behind = asyncio.ensure_future(client.post(f"{server.url}/embed", content=jpeg(HUGE, 82)))
            return await busy, await failing, await behind

    server = ServerProcess("--model", str(tiny_ckpt), "--backend", "numpy", "--max-pixels",
                           str(HUGE * HUGE + 28 * 28 * 10), prelude=_FAULT_ON_56X560)
    try:
        busy, r, behind = asyncio.run(main(server))
        assert busy.status_code == 200 and behind.status_code == 200, (busy.text, behind.text)
        assert r.status_code == 500, r.text
        assert error_of(r).startswith("body: the engine failed: the GPU failed in the forward: an illegal memory")
        try:
            health = httpx.get(f"{server.url}/health")
            assert health.status_code == 503 and health.json()["status"].startswith("failed: the engine failed")
        except (httpx.ConnectError, httpx.RemoteProtocolError):  # already gone, or going while it was asked
            pass
        assert server.proc.wait(30) == 1
    finally:
        server.stop()
    assert "error: the engine failed: the GPU failed in the forward" in server.log()
    assert "Traceback" not in server.log()


def test_port_in_use_and_missing_extra_are_one_line(tiny_ckpt):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert_clean_failure(run("serve", "--model", str(tiny_ckpt), "--port", port), f"127.0.0.1:{port}")
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['uvicorn'] = None; import cli; cli.main()",
                           "serve", "--model", str(tiny_ckpt)], capture_output=True, text=True)
    assert_clean_failure(proc, "uvicorn", 'pip install -e ".[serve]"')


def test_nothing_else_imports_the_server():
    code = ("import sys, cli, glmvit_cupy, glmvit_cupy.collection.pipeline, glmvit_cupy.deploy.devices, "
            "glmvit_cupy.deploy.encoder_cache; print(json.dumps(sorted(m for m in ('glmvit_cupy.deploy.serve', "
            "'glmvit_cupy.deploy.front', 'starlette', 'uvicorn', 'prometheus_client') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
