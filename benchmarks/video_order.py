"""Which clip holds a video collection's end-to-end rate (issue 26): the collection of video.py
through `glmvit-cupy encode`, whole and in parts, each beside the forward alone on its own grids.

The H200 run of 2026-12-02 was 0.58x the forward with the GPU busy 63 %, and two readings fit it:
(a) the GPU waits for clips queued, decoded, behind a slower clip at the head (the packer takes
clips in input order), or (b) it waits at the end for the heaviest clip's own decode, which no
order helps. So, on video.py's collection (reused where it is), after one warm-up run:
1. all clips (the video.py run again);
2. the heaviest clip alone (most tokens);
3. the other clips;
4. all clips with --few-workers decode workers (fewer clips decoding at once: each gets more of
   the host).
Each is `glmvit-cupy encode FILES --out-dir OUT --quiet` (e2e.run_cli: the summary line's clock
and GPU busy), beside the forward alone on the same clips' batches (video.py's forward-only,
best of two passes). Under (b) the heaviest clip alone takes about as long as all of them.

    python benchmarks/video_order.py --model /tmp/glmvit-real --clips 6          # the H200 run
    python benchmarks/video_order.py --model /tmp/glmvit-tiny --backend numpy --clips 2 --max-seconds 12
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from video import (REPO, clip_collection, clip_main, prepare_clips,  # puts the repo and tests/ on sys.path
                   video_batches)

from e2e import check_same_work, environment, forward_passes, read_records, run_cli, save
from footage import build_clips

from glmvit_cupy import GlmVit
from glmvit_cupy.processor.video import video_config


def encode(files: list[str], args, workers: int) -> dict:
    """One CLI run over `files` into a fresh directory: its summary, tokens and GPU busy."""
    out = Path(tempfile.mkdtemp(prefix="glmvit-video-order-"))
    try:
        result = run_cli(files, args.model, out / "out", workers, args.backend)
        _, tokens, _ = read_records(out / "out")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return dict(result, tokens=tokens)


def run(args) -> None:
    t0 = time.perf_counter()
    collection = clip_collection(args)
    manifest = build_clips(collection, args.clips, args.seed, args.max_seconds, workers=args.workers)
    files = [str(collection / e["name"]) for e in manifest["clips"]]
    config, _ = video_config(args.model)
    clips = prepare_clips(files, config, args.workers)
    tokens = [t * h * w // config.merge_size ** 2 for _, (t, h, w) in clips]
    heaviest = max(range(len(files)), key=tokens.__getitem__)
    others = [i for i in range(len(files)) if i != heaviest]
    shortest = min(range(len(files)), key=tokens.__getitem__)
    encode([files[shortest]], args, args.workers)  # the warm-up

    parts = [("all", list(range(len(files))), args.workers),
             (f"{Path(files[heaviest]).name} alone", [heaviest], args.workers),
             ("the others", others, args.workers),
             (f"all, {args.few_workers} workers", list(range(len(files))), args.few_workers)]
    runs = []
    for name, picks, workers in parts:
        ours = encode([files[i] for i in picks], args, workers)
        print(f"{name}: {ours['summary_line']} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        runs.append(dict(name=name, clips=[Path(files[i]).name for i in picks], workers=workers, ours=ours))

    vit = GlmVit.from_pretrained(args.model, backend=args.backend)
    forwards: dict[tuple[int, ...], dict] = {}
    for entry, (_, picks, _) in zip(runs, parts):
        if tuple(picks) not in forwards:
            picked = [clips[i] for i in picks]
            forwards[tuple(picks)], _ = forward_passes(vit, video_batches(picked, config, vit.p_max, args.workers),
                                                       len(picked))
        fwd = forwards[tuple(picks)]
        check_same_work(entry["ours"], fwd)
        entry["forward_s"] = min(fwd["pass_s"])
        entry["ratio"] = round(entry["forward_s"] / entry["ours"]["pipeline_wall_s"], 3)
    record = dict(backend=args.backend, clips=[dict(name=Path(f).name, tokens=t) for f, t in zip(files, tokens)],
                  runs=runs, env=environment(args.backend), benchmark_wall_s=round(time.perf_counter() - t0, 1))
    save(record, markdown(record), args.out or REPO / "benchmarks" / "results" / (
        "h200-video-order.json" if args.backend == "cupy" else "cpu-video-order.json"))


def markdown(r: dict) -> str:
    env = r["env"]
    clips = ", ".join(f"{c['name']} {c['tokens']:,}" for c in r["clips"])
    lines = [f"{env['date']}, {env['device']}, {env['cpus']} CPUs, backend {r['backend']}; clips (merged tokens): "
             f"{clips}", "",
             "| run | decode workers | pipeline wall s | forward alone s | forward / wall | GPU busy |",
             "| --- | --- | --- | --- | --- | --- |"]
    for entry in r["runs"]:
        ours, busy = entry["ours"], entry["ours"].get("gpu_busy")
        lines.append(f"| {entry['name']} | {entry['workers']} | {ours['pipeline_wall_s']:.1f} | {entry['forward_s']:.2f} "
                     f"| {entry['ratio']:.2f}x | {'-' if busy is None else f'{busy:.0%}'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    clip_main(__doc__, ("h200-video-order.json", "cpu-video-order.json"), run,
              lambda ap: ap.add_argument("--few-workers", type=int, default=4, help="decode workers of run 4 [default: 4]"))
