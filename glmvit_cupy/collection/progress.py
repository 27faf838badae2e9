"""Progress of a collection run, for a person watching: a live tqdm bar on a terminal, a plain
line every PLAIN_EVERY_S seconds when stderr is a file or a pipe (logs, CI, nohup), nothing
with --quiet. Separate from the pipeline, which only reports each finished input."""

from __future__ import annotations

import sys
import time
from typing import IO

from .pipeline import Encoded, StreamStats

PLAIN_EVERY_S = 10.0


class Progress:
    """`start(total)` once the inputs left to do are known, then a call per finished input."""

    def __init__(self, quiet: bool = False, stream: IO[str] | None = None, unit: str = "images") -> None:
        self.quiet, self.out, self.unit = quiet, stream or sys.stderr, unit  # "inputs" where videos come too
        self.total = self.done = self.failed = 0
        self.bar = None

    def start(self, total: int) -> None:
        self.total = total
        self.start_time = self.last = time.perf_counter()
        if not self.quiet and self.out.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=self.unit[:-1], file=self.out, dynamic_ncols=True, smoothing=0.1,
                            desc="encoding")

    def __call__(self, result: Encoded, stats: StreamStats) -> None:
        self.done += 1
        self.failed += result.error is not None
        if self.quiet:
            return
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(tokens_s=f"{stats.tokens / elapsed:,.0f}", failed=self.failed, refresh=False)
            return
        now = time.perf_counter()
        if now - self.last >= PLAIN_EVERY_S or self.done == self.total:
            self.last = now
            rate = self.done / elapsed
            eta = (self.total - self.done) / rate if rate else float("inf")
            print(f"glmvit-cupy: {self.done}/{self.total} {self.unit} ({100 * self.done / max(self.total, 1):.0f}%), "
                  f"{rate:.1f} {self.unit}/s, {stats.tokens / elapsed:,.0f} tokens/s, {self.failed} failed, "
                  f"ETA {_clock(eta)}", file=self.out, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
