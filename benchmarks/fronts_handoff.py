"""What the one engine process would spend an image on the hand-off from HTTP front processes
(issue 25, design (c), benchmarks/NOTES.md "front processes"), measured before building it.

The engine process (this script's main process, an asyncio loop as the server's) serves F front
processes (workers.Child), each over its own socket pair, with the protocol of the design: per image
a `lookup` round trip (the engine answers "compute", a cache miss), then `compute`, naming a slot of
the front's shared memory where the front has put a uint8 canvas; the engine copies the canvas out
(the stager's copy into its pinned slot), writes the answer's bytes into the slot's answer area (the
collector's device-to-host copy, landing there instead of in a fresh array) and answers with their
length. Each front keeps C requests in flight and finds each answer in its slot (the front's own work, HTTP,
decode and base64, is serve_gil.py's to measure).

The segments are memfd_create files, made by the engine and passed to the front over its socket
(SCM_RIGHTS): they have no name in /dev/shm, so no process's death leaves one behind.

Reported: images a second, and the engine's CPU an image split into the protocol's Python (its
event loop: framing, JSON headers, futures) and the two copies (NumPy, which release the GIL).
What bounds a split server is the first figure: it stands beside the ~3.2 ms of GIL an image the
one-process server holds today (NOTES, serve-scale).

    python benchmarks/fronts_handoff.py                                   # the 2-core dev machine
    python benchmarks/fronts_handoff.py --fronts 8 --inflight 16 --seconds 10   # the H200 host
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import socket
import struct
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from glmvit_cupy.workers import Child  # noqa: E402

HEADER = struct.Struct("<I")  # a message: its JSON's length, then the JSON


async def _send(writer: asyncio.StreamWriter, message: dict) -> None:
    body = json.dumps(message).encode()
    writer.write(HEADER.pack(len(body)) + body)


async def _receive(reader: asyncio.StreamReader) -> dict:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return json.loads(await reader.readexactly(n))


def _run(coroutine) -> object:
    """On uvloop when it is installed, as uvicorn runs the server."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _front(canvas_shape: tuple[int, int, int], answer_bytes: int, inflight: int, seconds: float, conn) -> None:
    """A front process: `inflight` requests at a time for `seconds`, then its count and CPU to the engine."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    slot_bytes = int(np.prod(canvas_shape)) + answer_bytes
    memory = memoryview(mmap.mmap(fds[0], inflight * slot_bytes))
    os.close(fds[0])
    for s in range(inflight):  # each slot's canvas written once: the decode itself is the front's, unmeasured
        np.frombuffer(memory, np.uint8, int(np.prod(canvas_shape)), s * slot_bytes)[:] = s % 256

    async def main() -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        waiting: dict[int, asyncio.Future] = {}

        async def pump() -> None:
            while True:
                message = await _receive(reader)
                waiting.pop(message["id"]).set_result(message)

        async def ask(message: dict) -> dict:
            future = waiting[message["id"]] = asyncio.get_running_loop().create_future()
            await _send(writer, message)
            return await future

        pumping = asyncio.ensure_future(pump())
        done, deadline, ids = 0, time.perf_counter() + seconds, iter(range(1 << 62))
        cpu0 = time.process_time()

        async def client(slot: int) -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                assert (await ask({"op": "lookup", "id": next(ids), "key": os.urandom(16).hex()}))["r"] == "compute"
                answer = await ask({"op": "compute", "id": next(ids), "slot": slot, "shape": canvas_shape})
                start = slot * slot_bytes + int(np.prod(canvas_shape))
                assert memory[start:start + answer["nbytes"]][0] == 7  # the answer's bytes, read where they lie
                done += 1

        await asyncio.gather(*(client(s) for s in range(inflight)))
        pumping.cancel()
        await _send(writer, {"op": "done", "id": -1, "images": done, "cpu_s": time.process_time() - cpu0})
        await writer.drain()

    _run(main())


async def _engine(children: list[Child], canvas_shape: tuple[int, int, int], answer_bytes: int,
                  inflight: int) -> dict:
    canvas_n = int(np.prod(canvas_shape))
    slot_bytes = canvas_n + answer_bytes
    answer = np.full(answer_bytes, 7, np.uint8)  # stands for the collector's host copy of a result
    staged = np.empty(canvas_n, np.uint8)  # stands for the stager's pinned slot
    copies_s, results = [0.0], []

    async def serve(child: Child) -> None:
        fd = os.memfd_create("glmvit-front")
        os.ftruncate(fd, inflight * slot_bytes)
        sock = socket.socket(fileno=os.dup(child.conn.fileno()))
        socket.send_fds(sock, [b"m"], [fd])
        views = np.frombuffer(mmap.mmap(fd, inflight * slot_bytes), np.uint8)
        os.close(fd)
        reader, writer = await asyncio.open_connection(sock=sock)
        while True:
            message = await _receive(reader)
            if message["op"] == "lookup":
                await _send(writer, {"id": message["id"], "r": "compute"})
            elif message["op"] == "compute":
                base = message["slot"] * slot_bytes
                t0 = time.thread_time()
                staged[:] = views[base:base + canvas_n]
                views[base + canvas_n:base + slot_bytes] = answer
                copies_s[0] += time.thread_time() - t0
                await _send(writer, {"id": message["id"], "nbytes": answer_bytes})
            else:
                results.append(message)
                return

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(serve(c) for c in children))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    images = sum(r["images"] for r in results)
    return {"images_per_s": images / wall, "engine_protocol_ms": 1000 * (cpu - copies_s[0]) / images,
            "engine_copies_ms": 1000 * copies_s[0] / images,
            "front_cpu_ms": 1000 * sum(r["cpu_s"] for r in results) / images, "images": images}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fronts", type=int, default=2)
    p.add_argument("--inflight", type=int, default=8, help="requests each front keeps in flight")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--canvas", default="896x1008", help="HxW of a canvas (default: a real photo's, 2.7 MB)")
    p.add_argument("--answer-mb", type=float, default=8.0, help="an answer's bytes (8 MB: ~1,000 tokens x 4,096 BF16)")
    args = p.parse_args()
    h, w = (int(v) for v in args.canvas.split("x"))
    shape, answer_bytes = (h, w, 3), int(args.answer_mb * 2**20)
    from benchmarks.fronts_handoff import _front  # by its module's name: a Child imports its target
    children = [Child(_front, (shape, answer_bytes, args.inflight, args.seconds), f"front {i}")
                for i in range(args.fronts)]
    try:
        result = _run(_engine(children, shape, answer_bytes, args.inflight))
    finally:
        for child in children:
            child.close()
    print(json.dumps({**vars(args), **{k: round(v, 3) for k, v in result.items()}}))


if __name__ == "__main__":
    main()
