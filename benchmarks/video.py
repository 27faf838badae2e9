"""Videos end to end: a collection of clips, files in, shards on disk, against the forward alone
and transformers; and the host memory of one long 1080p clip. Issue 26, item 5, in one command.

1. The clips (`footage.py`): --clips (default 8) panned and zoomed views of the photographs
   scikit-image bundles, 10 to --max-seconds (120) s long, 24-60 fps (29.97 included), 480p to
   1080p (one portrait size), H.264 and VP9 in .mp4, made offline before anything is timed in
   --collection (default a directory in the temp dir named by its recipe) and reused when there;
   beside them, in parallel, the memory run's clip: 1080p, 24 fps, --long-minutes (10) long.
2. Ours end to end: `glmvit-cupy encode CLIPS --out-dir OUT --workers N --quiet`, after a warm-up
   run on the shortest clip (e2e.end_to_end, e2e.run_cli): the CLI's summary line's clock, from
   the first file read to the last shard renamed. The rate compared is tokens/s.
3. Forward only on the same grids: every clip decoded, sampled and scaled by our own
   video.open_video (a process pool, untimed), packed by the pipeline's own plan_pieces under
   the same p_max (a video cut between temporal groups where a batch fills, as the packer cuts
   it), each batch's float32 pixel_values uploaded before the clock starts; then vit.forward
   over the batches back to back, twice, the faster pass kept (e2e.forward_passes).
4. transformers: Glm5NextVideoProcessor on the frames its PyAV loader decodes
   (`load_video(backend="pyav")` with the processor's own sampler; given a path the processor
   would decode with torchcodec), then Glm5NextModel.get_video_features with the checkpoint's
   tower (bf16, sdpa; tests/helpers.transformers_tower, as e2e.py builds it), pooler_output
   brought to the host, one clip a call, on --hf-clips (3) clips spread over the collection,
   after an untimed warm-up on the shortest clip. Its grids must equal ours. A transformers
   without the glm5_next video processor is one line, and the rest is measured.
5. Memory: `glmvit-cupy encode LONG --out-dir OUT --workers 1` on the long clip and on a 10 s
   clip of the same recipe: peak RSS of the CLI's process and of its decode worker (each its
   VmHWM: the kernel's high-water mark of the pages the process has resident, its own
   address space's since exec, exact; pinned host memory counts, device memory does not) and
   of the tree (sampled sum), as e2e.run_cli reads them. The clip's own cost is the main
   process's peak over the 10 s clip's run (what the CUDA libraries, the tower and the pinned
   slots cost, the same for both, is not counted; what the long clip adds is: its sampled
   frames received and not yet staged, at most the frame budget's (clips.FRAME_BYTES_AHEAD)
   and a few batches', and the rows of the batches not yet in the shard), plus the worker's
   peak; the target is held to that. The rows' bytes are reported beside it (the shard's
   size: 234,000 bf16 rows of 4,096 for the 10-minute clip, ~1.8 GiB, written a batch at a
   time).
6. A Markdown table on stdout; a JSON record (and the table) under benchmarks/results/.

    python benchmarks/video.py --model /tmp/glmvit-real                     # the H200 run, ~6 min
    python benchmarks/video.py --model /tmp/glmvit-real --clips 4 --long-minutes 5 --hf-clips 2   # shorter
    setsid python benchmarks/video.py --model /tmp/glmvit-real --prepare-only &          # the clips, ahead
    python benchmarks/video.py --model /tmp/glmvit-tiny --backend numpy --clips 2 --max-seconds 12 \\
        --long-minutes 0.5 --hf-clips 1                                      # CPU smoke run

On --backend numpy (no GPU) every part runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the code beside this script, and the oracle helpers

from e2e import (check_same_work, collection_options, end_to_end, environment, forward_passes,  # noqa: E402
                 free_device_memory, run_cli, save)
from footage import build_clips, long_clip  # noqa: E402

from glmvit_cupy import GlmVit  # noqa: E402
from glmvit_cupy.collection.pipeline import plan_pieces  # noqa: E402
from glmvit_cupy.errors import GlmVitError  # noqa: E402
from glmvit_cupy.processor.video import VideoConfig, open_video, patchify_frames, video_config  # noqa: E402

TARGET_FORWARD_RATIO = 0.9
TARGET_TRANSFORMERS_RATIO = 5.0
TARGET_RSS_MIB = 2048
SHORT_MINUTES = 10 / 60  # the memory run's baseline clip


def canvases(path: str, config: VideoConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A clip's sampled frames on their canvas, uint8 [T, H, W, 3], and its grid (in a pool worker)."""
    frames = open_video(path, config)
    out = np.zeros((len(frames.frames), *frames.canvas, 3), dtype=np.uint8)
    for row, frame in zip(out, frames.frames):
        row[:frame.shape[0], :frame.shape[1]] = frame
    return out, tuple(int(v) for v in frames.grid_thw[0])


def prepare_clips(files: list[str], config: VideoConfig, workers: int) -> list[tuple[np.ndarray, tuple]]:
    """Every clip's frames on their canvas and its grid (a process pool; spawned, so no CUDA state is forked)."""
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        return list(pool.map(canvases, files, [config] * len(files)))


def video_batches(clips: list[tuple[np.ndarray, tuple]], config: VideoConfig, p_max: int, workers: int):
    """The pipeline's batches of these clips: [(pixel_values float32, grid_thw)] on the host."""
    temporal = config.temporal_patch_size
    batches = plan_pieces([(t, h * w) for _, (t, h, w) in clips], p_max)
    with ThreadPoolExecutor(workers) as threads:
        for batch in batches:
            parts = [clips[p.owner][0][p.first * temporal:p.stop * temporal] for p in batch]
            pixels = np.concatenate(list(threads.map(lambda frames: patchify_frames(frames, config), parts)))
            grid = np.array([(p.stop - p.first, *clips[p.owner][1][1:]) for p in batch], dtype=np.int64)
            yield pixels, grid


def transformers_rate(model: Path, files: list[str], warmup: str, device: str, our_grids: dict[str, list]) -> dict:
    """transformers' video processor + get_video_features over `files`, one clip a call; None
    fields and a `missing` line where this transformers has no glm5_next video processor."""
    try:
        import torch
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextModel
        from transformers.video_utils import load_video
        from video_oracle import processor_for  # imports the glm5_next video processor
    except ImportError as exc:
        line = f"transformers here has no glm5_next video processor ({exc}): its side is not measured"
        print(line, file=sys.stderr, flush=True)
        return dict(missing=line)
    import json

    from helpers import TINY_TEXT, transformers_tower

    processor = processor_for(model)
    vision = json.loads((model / "config.json").read_text())
    model_ = Glm5NextModel(Glm5NextConfig(text_config=TINY_TEXT, vision_config=vision.get("vision_config", vision)))
    model_.visual = transformers_tower(model, dtype="bfloat16", device=device)  # what get_video_features runs

    def run(path: str) -> tuple[list, int]:
        video, metadata = load_video(path, backend="pyav",
                                     sample_indices_fn=lambda metadata, **_: processor.sample_frames(metadata))
        indices = [int(i) for i in metadata.frames_indices]
        kept = sorted(set(indices))  # the loader keeps a repeated index (the odd count's pad) once
        video = video[[kept.index(i) for i in indices]]
        features = processor(videos=[video], video_metadata=[metadata], do_sample_frames=False, return_tensors="pt")
        grid = features["video_grid_thw"]
        with torch.no_grad():
            out = model_.get_video_features(features["pixel_values_videos"].to(device), grid.to(device))
        return grid[0].tolist(), len(torch.cat(out.pooler_output).float().cpu())

    run(warmup)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    tokens = 0
    sync()
    t0 = time.perf_counter()
    for path in files:
        grid, rows = run(path)
        if grid != our_grids[path]:
            raise GlmVitError(f"transformers' video processor gives {path} the grid {grid}, ours {our_grids[path]}")
        tokens += rows
    sync()
    wall = time.perf_counter() - t0
    return dict(clips=len(files), tokens=tokens, wall_s=round(wall, 2), tokens_per_s=round(tokens / wall, 1))


def memory_run(path: Path, model: Path, backend: str) -> dict:
    """One clip through the CLI with one decode worker: its summary, peaks and grid."""
    scratch = Path(tempfile.mkdtemp(prefix="glmvit-video-rss-"))
    try:
        result = run_cli([str(path)], model, scratch / "out", 1, backend)
        records = [json.loads(line) for f in sorted((scratch / "out").glob("shard-*.jsonl"))
                   for line in f.read_text().splitlines()]
        rows = sum(f.stat().st_size for f in (scratch / "out").glob("shard-*.safetensors"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if result["encoded"] != 1:
        raise GlmVitError(f"{path}: the memory run encoded none ({result['summary_line']})")
    t, h, w = records[0]["grid_thw"]
    return dict(result, grid_thw=[t, h, w], frames=records[0]["frames"], tokens=records[0]["tokens"],
                frames_mib=round(2 * t * h * w * 14 * 14 * 3 / 2**20, 1), rows_mib=round(rows / 2**20, 1))


def markdown(r: dict) -> str:
    e2e, fwd, hf, env, col = r["ours_e2e"], r["forward_only"], r["transformers"], r["env"], r["collection"]
    long, short = r["memory"]["long"], r["memory"]["short"]
    busy = "-" if e2e["gpu_busy"] is None else f"{100 * e2e['gpu_busy']:.0f}%"
    hf_rate = "not measured" if "missing" in hf else f"{hf['tokens_per_s']:,.0f} ({hf['clips']} clips)"
    hf_ratio = "-" if "missing" in hf else f"{r['ratio_ours_transformers']:.1f}x"
    lines = [f"{env['date']}, {env['device']}, {env['cpus']} CPUs, backend {r['backend']}, {r['workers']} workers; "
             f"{col['count']} clips ({col['h264']} H.264, {col['vp9']} VP9, {col['total_seconds']} s, "
             f"{col['total_bytes'] / 2**20:.0f} MiB), {fwd['patches']:,} patches, {fwd['tokens']:,} tokens, "
             f"{fwd['batches']} forward calls of at most {r['p_max']} patches", "",
             "| measure | value | target |", "| --- | --- | --- |",
             f"| ours end to end, tokens/s (clips/s) | {e2e['tokens_per_s']:,.0f} ({e2e['images_per_s']:.2f}) | |",
             f"| ours end to end, pipeline wall / process wall s | {e2e['pipeline_wall_s']:.1f} / "
             f"{e2e['process_wall_s']:.1f} | |",
             f"| forward only, tokens/s (best of {len(fwd['pass_s'])} passes) | {fwd['tokens_per_s']:,.0f} | |",
             f"| end to end / forward only | {r['ratio_e2e_forward']:.2f}x | >= {TARGET_FORWARD_RATIO}x |",
             f"| GPU busy during the end-to-end run | {busy} | |",
             f"| peak RSS MiB of the collection run: main / largest worker / tree (sampled sum) | "
             f"{e2e['rss_main_mib']:.0f} / {e2e['rss_largest_worker_mib']:.0f} / {e2e['rss_tree_sampled_mib']:.0f} | |",
             f"| transformers video processor + get_video_features (bf16, sdpa), tokens/s | {hf_rate} | |",
             f"| ours end to end / transformers (tokens/s) | {hf_ratio} | >= {TARGET_TRANSFORMERS_RATIO:.0f}x |",
             f"| {r['long_minutes']:g}-minute 1080p clip ({long['frames']} frames sampled, grid "
             f"{'x'.join(map(str, long['grid_thw']))}, {long['frames_mib']:.0f} MiB of them, "
             f"{long['rows_mib']:.0f} MiB of rows), peak RSS MiB (VmHWM): main / worker / tree | "
             f"{long['rss_main_mib']:.0f} / {long['rss_largest_worker_mib']:.0f} / "
             f"{long['rss_tree_sampled_mib']:.0f} | |",
             f"| 10 s 1080p clip, peak RSS MiB: main / worker | {short['rss_main_mib']:.0f} / "
             f"{short['rss_largest_worker_mib']:.0f} | |",
             f"| the long clip's own peak RSS MiB: main's over the 10 s clip's main + its worker's | "
             f"{r['long_clip_rss_mib']:.0f} | "
             f"< {TARGET_RSS_MIB} |",
             f"| the long clip end to end, pipeline wall s | {long['pipeline_wall_s']:.1f} | |"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    backend = args.backend
    collection = clip_collection(args)
    beside = collection.with_name(f"{collection.name}-long")  # not in the collection, which the CLI walks
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as alongside:  # the long clips meanwhile
        long_path = alongside.submit(long_clip, beside, args.long_minutes, args.seed)
        short_path = alongside.submit(long_clip, beside, SHORT_MINUTES, args.seed)
        manifest = build_clips(collection, args.clips, args.seed, args.max_seconds,
                               workers=max(1, (os.cpu_count() or 2) - 1))
        print(f"collection {collection}: {args.clips} clips, {manifest['total_seconds']} s, ready in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        long_path, short_path = long_path.result(), short_path.result()
    print(f"long clip {long_path} ready at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.prepare_only:
        return
    files = [str(collection / e["name"]) for e in manifest["clips"]]
    shortest = min(manifest["clips"], key=lambda e: e["frames"] * e["width"] * e["height"])["name"]
    warmup = str(collection / shortest)

    ours = end_to_end(files, collection, args.model, args.workers, backend, warmup=[warmup])
    print(f"ours end to end: {ours['summary_line']} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    vit = GlmVit.from_pretrained(args.model, backend=backend)  # the CLI's default budget, so its p_max
    config, _ = video_config(args.model)
    clips = prepare_clips(files, config, args.workers)
    our_grids = {path: list(grid) for path, (_, grid) in zip(files, clips)}
    fwd, _ = forward_passes(vit, video_batches(clips, config, vit.p_max, args.workers), len(files))
    del clips
    print(f"forward only: {fwd} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    check_same_work(ours, fwd)
    p_max = vit.p_max
    del vit
    free_device_memory(backend)

    picks = sorted({files[int(i)] for i in np.linspace(0, len(files) - 1, min(args.hf_clips, len(files)))})
    hf = transformers_rate(args.model, picks, warmup, "cuda" if backend == "cupy" else "cpu", our_grids)
    print(f"transformers: {hf} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    memory = dict(long=memory_run(long_path, args.model, backend), short=memory_run(short_path, args.model, backend))
    print(f"memory: {memory} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    long, short = memory["long"], memory["short"]
    hf_ratio = None if "missing" in hf else round(ours["tokens_per_s"] / hf["tokens_per_s"], 2)
    clip_rss = long["rss_main_mib"] - short["rss_main_mib"] + long["rss_largest_worker_mib"]
    record = dict(backend=backend, workers=args.workers, p_max=p_max, long_minutes=args.long_minutes,
                  collection=dict(manifest, path=str(collection)), ours_e2e=ours, forward_only=fwd, transformers=hf,
                  memory=memory, ratio_e2e_forward=round(ours["tokens_per_s"] / fwd["tokens_per_s"], 3),
                  ratio_ours_transformers=hf_ratio, long_clip_rss_mib=round(clip_rss, 1),
                  env=environment(backend), benchmark_wall_s=round(time.perf_counter() - t0, 1))
    save(record, markdown(record), args.out or REPO / "benchmarks" / "results" / (
        "h200-video.json" if backend == "cupy" else "cpu-video.json"))


def clip_collection(args: argparse.Namespace) -> Path:
    """Where the clips are made or reused: --collection, or a directory in the temp dir named by the recipe."""
    return args.collection or Path(tempfile.gettempdir()) / (
        f"glmvit-video-clips-{args.clips}-{args.seed}-{args.max_seconds}")


def clip_main(description: str, results: tuple[str, str], run: Callable[[argparse.Namespace], None],
              more: Callable[[argparse.ArgumentParser], None] = lambda ap: None) -> None:
    """The command line of a benchmark of the clip collection (this one, video_order.py): e2e's
    collection options, the options naming the clips, `more`, then `run(args)`; a GlmVitError is
    one line and exit status 1."""
    ap = collection_options(description, results)
    ap.add_argument("--clips", type=int, default=8, help="clips in the collection")
    ap.add_argument("--max-seconds", type=int, default=120, help="the longest a clip may be (at least 10)")
    more(ap)
    try:
        run(ap.parse_args())
    except GlmVitError as exc:
        sys.exit(f"{Path(sys.argv[0]).stem}: error: {exc}")


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--long-minutes", type=float, default=10.0, help="length of the memory run's 1080p clip")
    ap.add_argument("--hf-clips", type=int, default=3, help="clips transformers runs on, spread over the collection")
    ap.add_argument("--prepare-only", action="store_true",
                    help="make the clips (step 1) and stop: a later run reuses them, so a device session can make "
                         "them in the background while its GPU does other work")


if __name__ == "__main__":
    clip_main(__doc__, ("h200-video.json", "cpu-video.json"), run, options)
