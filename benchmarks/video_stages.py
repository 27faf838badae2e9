"""Where a video's end-to-end time goes on the host, stage by stage, one clip at a time.

Issue 26: the collection run reached 0.39x of the forward alone on the H200. This times, on
one core per clip as a decode worker has it, every host stage a video passes through:

- `open`: VideoReader (container, header, the sampling and canvas plan; a WebM's packet count)
- `demux`: reading every packet up to the last sampled frame's, nothing decoded
- `decode`: FFmpeg's decode of every frame up to the last sampled one, one thread
  (`decode_auto`: FFmpeg's frame and slice threads on every usable core, as a worker runs it)
- `rgb`: the sampled frames converted to RGB (swscale), `resize`: scaled to the content size
  (video.resize_uint8; 0 when the video is within its token budget), `canvas`: padded onto it
- `handoff`: each frame through a pipe into the main process's array (the pipeline's pixel
  messages), `patchify`: the NumPy stager's float32 pixel_values of them
  (the GPU stager does this on the device; its host side is a copy into the pinned slot,
  `stage_copy`)

BLAS runs on one thread, as in a decode worker. A Markdown table on stdout (seconds per clip
and stage, and frames/s of the decode).

    python benchmarks/video_stages.py /tmp/glmvit-video-clips-6-0-120
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from multiprocessing import Pipe
from pathlib import Path

os.environ.update(dict.fromkeys(("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"), "1"))  # a worker's
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from glmvit_cupy.collection.pipeline import _recv_pixels, _send_pixels  # noqa: E402
from glmvit_cupy.processor.video import VIDEO_EXTENSIONS, VideoReader, _scaled, on_canvas, patchify_frames  # noqa: E402


def _decode_s(path: Path, last: int, threads: bool) -> float:
    """Seconds to decode frames 0..last (nothing converted), on one thread or FFmpeg's AUTO threads."""
    with VideoReader(path) as reader:
        stream = reader.stream
        if threads:
            stream.thread_type = "AUTO"
        else:
            stream.thread_type = "SLICE"
            stream.codec_context.thread_count = 1
        t0 = time.perf_counter()
        for index, _ in enumerate(reader.container.decode(stream)):
            if index == last:
                break
        return time.perf_counter() - t0


def stages(path: Path) -> dict:
    t0 = time.perf_counter()
    reader = VideoReader(path)
    times = dict(open=time.perf_counter() - t0)
    with reader:
        unique = sorted(set(reader.indices))
        last = unique[-1]
        t0 = time.perf_counter()
        for count, _ in enumerate(reader.container.demux(reader.stream)):
            if count >= last:
                break
        times["demux"] = time.perf_counter() - t0
    times["decode"] = _decode_s(path, last, threads=False)
    times["decode_auto"] = _decode_s(path, last, threads=True)
    with VideoReader(path) as reader:
        wanted, kept = set(unique), {}
        for index, frame in enumerate(reader.container.decode(reader.stream)):
            if index in wanted:
                kept[index] = frame
            if index == last:
                break
        raw = [kept[i] for i in reader.indices]  # an odd count's pad repeated, as the pipeline sends it
        t0 = time.perf_counter()
        rgb = [f.to_ndarray(format="rgb24") for f in raw]
        times["rgb"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        scaled = [_scaled(f, reader.content) for f in rgb]
        times["resize"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        canvases = [on_canvas(f, reader.canvas) for f in scaled]
        times["canvas"] = time.perf_counter() - t0
        config, shape = reader.config, (len(canvases), *reader.canvas, 3)
    ours, theirs = Pipe()
    received = np.empty(shape, dtype=np.uint8)

    def receive() -> None:
        for row in received.reshape(len(received), -1):
            _recv_pixels(ours, row)

    t0 = time.perf_counter()
    thread = threading.Thread(target=receive)
    thread.start()
    for frame in canvases:
        _send_pixels(theirs, frame)
    thread.join()
    times["handoff"] = time.perf_counter() - t0
    pinned = np.empty(received.size, dtype=np.uint8)
    t0 = time.perf_counter()
    pinned[:] = received.reshape(-1)
    times["stage_copy"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    for g in range(0, len(received), 32):  # a few groups at a time, as batches take them
        patchify_frames(received[g:g + 32], config)
    times["patchify"] = time.perf_counter() - t0
    return dict(times, frames=last + 1, sampled=len(unique), size=f"{reader.width}x{reader.height}",
                content="x".join(map(str, reader.content[::-1])), codec=reader.stream.codec_context.codec.name)


STAGES = ("open", "demux", "decode", "decode_auto", "rgb", "resize", "canvas", "handoff", "stage_copy", "patchify")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path, help="video files or directories of them")
    args = ap.parse_args()
    files = sorted(p for i in args.inputs for p in ([i] if i.is_file() else i.iterdir())
                   if p.suffix.lower() in VIDEO_EXTENSIONS)
    print("| clip | codec | size -> content | frames decoded / sampled | " + " | ".join(STAGES)
          + " | decode fps (1 thread / auto) |")
    print("| --- " * (len(STAGES) + 5) + "|")
    totals = dict.fromkeys(STAGES, 0.0)
    for path in files:
        r = stages(path)
        for s in STAGES:
            totals[s] += r[s]
        print(f"| {path.name} | {r['codec']} | {r['size']} -> {r['content']} | {r['frames']} / {r['sampled']} | "
              + " | ".join(f"{r[s]:.2f}" for s in STAGES)
              + f" | {r['frames'] / r['decode']:.0f} / {r['frames'] / r['decode_auto']:.0f} |", flush=True)
    print("| all | | | | " + " | ".join(f"{totals[s]:.2f}" for s in STAGES) + " | |")


if __name__ == "__main__":
    main()
