"""Every process the package starts: from its own entry point, gone when its parent is.

Decode workers and `--devices` engine processes are started here (`Child`) as a fresh
interpreter that imports this package from where the parent did and runs `child_main`, never
by multiprocessing's spawn or forkserver: those re-import the caller's main script in every
child, so a script, notebook or server module without a `__main__` guard ran again in each
worker (a second engine, a second bound port). The child imports only the package, receives
(target, args) on a socket pair, and calls `target(*args, connection)`.

A child exits within half a second of its parent, however the parent died (SIGKILL
included): a thread in the child watches its parent pid, since a killed parent closes no
pipe that a busy child would notice, and orphans holding the parent's stderr would keep a
job runner waiting for ever. Separate from pipeline.py and devices.py because both start
processes and both need the same guarantees.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

PARENT_POLL_S = 0.25
# What a child runs, as `python -c`. The watch on the parent starts first, before the package
# is imported (seconds on a loaded machine, when the parent may already be gone). sys.path
# starts with the directory this package was imported from (not the caller's working
# directory), so parent and child run the same code.
_BOOT = f"""
import os, sys, threading, time
def watch(parent=int(sys.argv[2])):
    while os.getppid() == parent:
        time.sleep({PARENT_POLL_S})
    os._exit(1)  # the parent is gone: nothing this process does has a reader any more
threading.Thread(target=watch, daemon=True, name="glmvit-parent-watch").start()
sys.path[0] = {str(Path(__file__).resolve().parent.parent)!r}
from glmvit_cupy.workers import child_main
child_main()
"""


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (a container's
    --cpus), not os.cpu_count(), which counts the host's."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    for path, parse in ((Path("/sys/fs/cgroup/cpu.max"), lambda t: t.split()),
                        (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), None)):
        try:
            if parse is not None:
                quota, period = parse(path.read_text())
            else:
                quota, period = path.read_text().strip(), (path.parent / "cpu.cfs_period_us").read_text().strip()
            if quota not in ("max", "-1") and int(period) > 0:
                cpus = min(cpus, max(1, -(-int(quota) // int(period))))
            break
        except (OSError, ValueError):
            continue
    return max(1, cpus)


class Child:
    """A process running `target(*args, connection)` in a fresh interpreter; `conn` is the
    parent's end. `join`, `exitcode`, `is_alive` and `kill` as multiprocessing.Process has."""

    def __init__(self, target: Callable[..., None], args: tuple, name: str, env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair()
        self.name = name
        try:
            self.process = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno()), str(os.getpid())],
                                            pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(pickle.dumps((target, args)))

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()

    def close(self, timeout: float = 10.0) -> None:
        """Close the connection (the child's loop ends on it), wait, and kill what is left."""
        self.conn.close()
        self.join(timeout)
        self.kill()
        self.join()


def child_main() -> None:
    """A Child's process (after _BOOT): argv is (socket fd, parent pid)."""
    conn = Connection(int(sys.argv[1]))
    try:
        target, args = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    target(*args, conn)
