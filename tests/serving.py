"""A `glmvit-cupy serve` process on loopback, for test_serve.py and benchmarks/serve.py: started on a free
port (the server names it in its start line), waited for until /health says 200, its stderr kept, and
stopped by SIGTERM; the kernel kills it if the process that started it dies first."""

from __future__ import annotations

import ctypes
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

_LISTENING = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+);")
_FRONT_STARTED = re.compile(r"HTTP front (\d+) started \(pid (\d+)\)")
_PR_SET_PDEATHSIG = 1


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return " (zombie)" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerProcess:
    """`glmvit-cupy serve --host 127.0.0.1 --port 0 ARGS...`, healthy once the constructor returns."""

    def __init__(self, *args: str, ready_s: float = 60.0, prelude: str = "") -> None:
        """`prelude`: Python run in the server process before the CLI (a test's fault injection)."""
        self.proc = subprocess.Popen([sys.executable, "-c", f"{prelude}\nimport cli; cli.main()", "serve",
                                      "--host", "127.0.0.1", "--port", "0", *args], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     preexec_fn=die_with_parent)
        self.model = args[args.index("--model") + 1]  # as the server names it
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.url = _LISTENING.search(self.wait_for(_LISTENING.pattern, ready_s)).group(1)
            deadline = time.monotonic() + ready_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    if httpx.get(f"{self.url}/health").status_code == 200:
                        break
                except httpx.ConnectError:  # exiting: poll() says so next
                    pass
                time.sleep(0.05)
            else:
                raise RuntimeError(f"the server did not become healthy:\n{self.log()}")
        except BaseException:
            self.proc.kill()
            raise

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float) -> str:
        """The first stderr line matching `pattern`, waiting for it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if re.search(pattern, line):
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise RuntimeError(f"no line matching {pattern!r} from the server:\n{self.log()}")

    def front_pids(self) -> list[int]:
        """The pid of each HTTP front process, the latest started in its place, from the server's lines."""
        pids = {int(m.group(1)): int(m.group(2)) for m in map(_FRONT_STARTED.search, list(self.lines)) if m}
        return [pids[i] for i in sorted(pids)]

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics: (name, sorted label items) -> value."""
        text = httpx.get(f"{self.url}/metrics").text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value (0 when the server has not recorded it yet)."""
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (the server drains), then its exit status; killed if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            self._reader.join(5)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
