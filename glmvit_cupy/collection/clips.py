"""Videos in collection runs: what the pipeline needs to carry a video where it carries an image.

A video source (sources.Source, by its extension) goes through the same decode pool, packer,
stager, in-order results, shards, resume and failure list as an image (pipeline.py); what
only a video needs is here:

- `start`: in a decode worker, the video's size and sha256 (streamed: a two-hour file is
  never read into memory whole), its header (video.VideoReader: the processor's sampling and
  the canvas of every frame), then its sampled frames one at a time, each decoded, scaled and
  padded onto the canvas as it comes. The worker sends each frame on as it is made, so it
  holds one frame; the main process holds the video's sampled frames, uint8 [T, H, W, 3].
- `FrameBudget`: the bytes of such frames the main process may hold ahead of the input the
  pipeline waits for, so that decode workers running ahead on long videos cannot fill memory.
- `ClipInfo`: what a video's shard record says beyond an image's (`"kind": "video"`, frames
  sampled, the source's frame rate, each temporal group's timestamp).

The packer cuts a video's temporal groups across forward calls (pipeline.Packer), which is
exact: attention never crosses a group.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterator

from ..processor.video import VideoConfig, VideoReader, on_canvas
from .sources import Source

# Decoded frames the main process may hold for videos decoded ahead of the one the pipeline
# is on: a 2-minute 720p clip at full size is ~0.7 GB of sampled frames, so this lets several
# workers run ahead on such clips while the engine works.
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
    """Bytes of decoded video frames held in the main process ahead of the pipeline. A decode
    pool's receiving thread takes a video's bytes (`take`) before it receives its frames, and
    waits while the budget is spent, unless the video is the input the pipeline waits for
    (`head`): that one always goes ahead, so the budget can slow decoding ahead, never stop the
    run. The pipeline gives the bytes back (`give`) when it takes the video. `release` lets
    every waiter through (the pool is closing). `peak`: the most ever held."""

    def __init__(self, limit: int = FRAME_BYTES_AHEAD) -> None:
        self.limit, self.held, self.peak = limit, 0, 0
        self._head: Any = None
        self._released = False
        self._changed = threading.Condition()

    def head(self, ticket: Any) -> None:
        """`ticket` (a decode's future) is the input the pipeline now waits for."""
        with self._changed:
            self._head = ticket
            self._changed.notify_all()

    def take(self, ticket: Any, nbytes: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: ticket is self._head or self.held + nbytes <= self.limit or self._released)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def give(self, nbytes: int) -> None:
        with self._changed:
            self.held -= nbytes
            self._changed.notify_all()

    def release(self) -> None:
        with self._changed:
            self._released = True
            self._changed.notify_all()
