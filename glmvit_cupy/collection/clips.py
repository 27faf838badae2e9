"""Videos in collection runs: what the pipeline needs to carry a video where it carries an image.

A video source (sources.Source, by its extension) goes through the same decode pool, packer,
stager, in-order results, shards, resume and failure list as an image (pipeline.py); what
only a video needs is here:

- `start`: in a decode worker, the video's size and sha256 (streamed: a two-hour file is
  never read into memory whole), its header (video.VideoReader: the processor's sampling and
  the canvas of every frame), then its sampled frames one at a time, each decoded, scaled and
  padded onto the canvas as it comes. The worker sends each frame on as it is made, so it
  holds one frame.
- `Groups`: a video's temporal groups in the main process, uint8 [2, H, W, 3] each, from
  their receipt until the packer has staged them: the packer takes them as they arrive, so a
  video is packed while it decodes and no process holds its frames whole.
- `FrameBudget`: the bytes of such groups the main process may hold, received and not yet
  staged, so that decode workers running ahead on long videos cannot fill memory.
- `wait_for_any`: the pipeline's wait when the video it is on has no group yet and none of the
  later videos it may pack meanwhile has one either.
- `ClipInfo`: what a video's shard record says beyond an image's (`"kind": "video"`, frames
  sampled, the source's frame rate, each temporal group's timestamp).

The packer cuts a video's temporal groups across forward calls (pipeline.Packer), which is
exact: attention never crosses a group.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..processor.video import VideoConfig, VideoReader, on_canvas
from .sources import Source

# Decoded frames the main process may hold, received and not yet staged: a 2-minute 720p clip
# at full size is ~0.7 GB of sampled frames, so this lets several workers run ahead on such
# clips while the engine works.
FRAME_BYTES_AHEAD = 4 << 30


@dataclasses.dataclass(frozen=True)
class ClipInfo:
    """A video's record beyond its rows and grid: `timestamps` (seconds of each temporal group's
    first frame, the `{t:.1f} seconds` the processor's prompt writes after the group's tokens),
    `frames` (sampled, an odd count's pad included) and `fps` (the source's, from its header)."""

    timestamps: tuple[float, ...]
    frames: int
    fps: float

    def record(self) -> dict[str, Any]:
        """The fields of its shard record (JSON keeps each float's exact value)."""
        return {"kind": "video", "frames": self.frames, "fps": self.fps, "timestamps": list(self.timestamps)}


def start(source: Source, config: VideoConfig) -> Iterator[Any]:
    """A video source's decode, as a generator: first (bytes, sha256, ClipInfo, frames' shape
    [T, H, W, 3]), then each sampled frame on its canvas, uint8 [H, W, 3], in time order.
    A fault is a GlmVitError naming the video (OSError: the file cannot be read); closing the
    generator early closes the video."""
    nbytes, sha = source.digest()
    file = None if source.member is None else source.open()
    try:
        with VideoReader(source.path if file is None else file, config, source.name) as reader:
            info = ClipInfo(tuple(reader.timestamps[::config.temporal_patch_size]), len(reader.indices), reader.fps)
            yield nbytes, sha, info, (len(reader.indices), *reader.canvas, 3)
            for frame in reader.frames():
                yield on_canvas(frame, reader.canvas)
    finally:
        if file is not None:
            file.close()


class FrameBudget:
    """Bytes of decoded video frames held in the main process, from their receipt until the
    packer stages them. A decode pool's receiving thread takes a group's bytes (`take`) before
    it receives it, and waits while the budget is spent, unless its video is the input the
    pipeline is on (`head`) and none of that video's groups is waiting: the pipeline waits for
    that one, so it always goes ahead and the budget can slow decoding, never stop the run.
    Groups give the bytes back (`give`) when staged. `release` lets every waiter through (the
    pool is closing). `peak`: the most ever held. Its condition is also its Groups' lock."""

    def __init__(self, limit: int = FRAME_BYTES_AHEAD) -> None:
        self.limit, self.held, self.peak = limit, 0, 0
        self._head: Any = None
        self._released = False
        self.changed = threading.Condition()

    def head(self, ticket: Any) -> None:
        """`ticket` (a decode's future) is the input the pipeline waits for first (Decoder.map
        names each input it hands over; the pipeline names again the earliest video whose
        frames still come, when it has taken later inputs)."""
        with self.changed:
            self._head = ticket
            self.changed.notify_all()

    def take(self, ticket: Any, nbytes: int, waited: Callable[[], bool] = lambda: False,
             dropped: Callable[[], bool] = lambda: False) -> bool:
        """Room for `nbytes` of `ticket`'s frames (True); `waited()`: the pipeline waits for them.
        False, without room, once `dropped()`: nobody takes them (an abandoned video, whose frames
        are received and let go), so they never wait, and the worker decoding them never holds up
        the inputs queued behind it."""
        with self.changed:
            self.changed.wait_for(lambda: self.held + nbytes <= self.limit or self._released or dropped()
                                  or (ticket is self._head and waited()))
            if dropped():
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def give(self, nbytes: int) -> None:
        with self.changed:
            self.held -= nbytes
            self.changed.notify_all()

    def release(self) -> None:
        with self.changed:
            self._released = True
            self.changed.notify_all()


class Groups:
    """A video's temporal groups (of its frames' `shape` [T, H, W, 3]), uint8 [temporal, H, W,
    3] each, in time order: put by the receiving thread as its decode worker sends them
    (`received`, then `end`), taken by the packer (`pop`; `wait_for_any` waits for one). Each holds `budget` bytes from its receipt
    until the packer has staged it (`staged`). `abandon`: nobody will take the rest (the
    pipeline stopped): what waits and what still comes gives its bytes back at once."""

    def __init__(self, shape: tuple[int, ...], temporal: int, budget: FrameBudget | None = None,
                 ticket: Any = None) -> None:
        self.shape, self.count, self.budget, self.ticket = tuple(shape), shape[0] // temporal, budget, ticket
        self.lock = budget.changed if budget is not None else threading.Condition()
        self.waiting: deque[np.ndarray] = deque()
        self.ended = self.abandoned = False
        self.error: str | None = None
        self.held = 0  # bytes of the budget its groups hold: received (or being received), not staged

    @classmethod
    def whole(cls, frames: np.ndarray, temporal: int) -> "Groups":
        """A video decoded whole (in the calling thread): its groups as views of its frames."""
        groups = cls(frames.shape, temporal)
        groups.waiting.extend(frames[i:i + temporal] for i in range(0, len(frames), temporal))
        groups.ended = True
        return groups

    def take(self, nbytes: int) -> None:
        """Room in the budget for the next group (the receiving thread, before receiving it)."""
        if self.budget is None or not self.budget.take(self.ticket, nbytes, lambda: not self.waiting,
                                                         lambda: self.abandoned):
            return
        with self.lock:
            if self.abandoned:  # abandoned since: the bytes go back at once
                self.budget.give(nbytes)
            else:
                self.held += nbytes

    def received(self, group: np.ndarray) -> None:
        with self.lock:
            if not self.abandoned:  # an abandoned one's bytes went back with the rest
                self.waiting.append(group)
                self.lock.notify_all()

    def end(self, error: str | None = None, lost: int = 0) -> None:
        """No more groups: all came, or decoding failed part way (`error`: why; `lost`: the bytes
        taken for a group that never came)."""
        with self.lock:
            self.ended, self.error = True, error
            if not self.abandoned:
                self._give(lost)
            self.lock.notify_all()

    def lead(self) -> None:
        """This video is the one the pipeline waits for first: its frames go ahead of the budget."""
        if self.budget is not None:
            self.budget.head(self.ticket)

    def pop(self) -> np.ndarray | None:
        """The next group if it has come (never waits)."""
        with self.lock:
            if not self.waiting:
                return None
            group = self.waiting.popleft()
            self.lock.notify_all()  # none waiting: the receiving thread may go ahead of the budget
            return group

    @property
    def finished(self) -> bool:
        """All groups came (or decoding failed part way) and all were taken."""
        with self.lock:
            return self.ended and not self.waiting

    def staged(self, nbytes: int) -> None:
        """A group taken has been staged: its bytes are free."""
        with self.lock:
            if not self.abandoned:
                self._give(nbytes)

    def abandon(self) -> None:
        with self.lock:
            if not self.abandoned:
                self.abandoned = True
                self._give(self.held)
                self.waiting.clear()
                self.lock.notify_all()  # a receiving thread waiting for room lets its frames go

    def _give(self, nbytes: int) -> None:
        if self.budget is not None and nbytes:
            self.held -= nbytes
            self.budget.give(nbytes)


def wait_for_any(groups: Sequence[Groups]) -> None:
    """Until one of `groups` has a group waiting or has ended. A stream's videos from a decode
    pool share its budget's condition, which every receipt and end notifies; one decoded whole
    (Groups.whole, a condition of its own) has ended already."""
    lock = groups[0].lock
    with lock:
        lock.wait_for(lambda: any(g.waiting or g.ended for g in groups))
