"""A decode worker's pixels received while the main thread runs Python: 1 MB messages from a forked
child over a socket pair, read by a thread into one buffer, (a) a read a socket buffer at a time
(os.readv; the GIL taken back after each partial read, behind the main thread) against (b) one
recv_into(MSG_WAITALL) a message (collection/pipeline.py's _read_into), each with the main thread
idle and with it looping over small NumPy operations (the GIL held most of the time, as the NumPy
engine's glue or a GPU engine's launches). Prints the receive rate and the main thread's loops/s.

    python benchmarks/recv_convoy.py
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable

import numpy as np

FRAME = 1_000_000  # bytes a message: about a 1080p frame scaled by the video budget
MESSAGES = 300


def read_partial(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = os.readv(sock.fileno(), [view[got:]])
        if n == 0:
            raise EOFError
        got += n


def read_waitall(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError
        got += n


def run(read: Callable[[socket.socket, memoryview], None], busy: bool) -> tuple[float, float]:
    """(MiB/s received, the main thread's loops/s meanwhile)."""
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        data = np.random.default_rng(0).integers(0, 256, FRAME, dtype=np.uint8).tobytes()
        for _ in range(MESSAGES):
            theirs.sendall(data)
        os._exit(0)
    theirs.close()
    view, stop, loops = memoryview(bytearray(FRAME)), threading.Event(), [0]

    def python_work() -> None:
        x = np.ones(1000)
        while not stop.is_set():
            for _ in range(100):
                x = x * 1.0001 + 0.5
            loops[0] += 1

    worker = threading.Thread(target=python_work) if busy else None
    if worker:
        worker.start()
    t0 = time.perf_counter()
    for _ in range(MESSAGES):
        read(ours, view)
    seconds = time.perf_counter() - t0
    stop.set()
    if worker:
        worker.join()
    os.waitpid(pid, 0)
    ours.close()
    return MESSAGES * FRAME / seconds / 2**20, loops[0] / seconds


def main() -> None:
    for busy in (False, True):
        for name, read in (("readv, partial reads", read_partial), ("recv_into MSG_WAITALL", read_waitall)):
            rates = [run(read, busy) for _ in range(3)]
            print(f"main thread {'busy' if busy else 'idle'}, {name}: {max(r[0] for r in rates):,.0f} MiB/s, "
                  f"main thread {max(r[1] for r in rates):,.0f} loops/s", flush=True)


if __name__ == "__main__":
    main()
