"""One GPU against every GPU of the host: the same photo collection, one command (issue 18, item 1).

Builds (or reuses) e2e.py's collection of real photographs, then runs `glmvit-cupy encode
COLLECTION --out-dir OUT --quiet` three times into fresh directories, each after a warm-up run
on 16 of the files (e2e.end_to_end): the engine in the CLI's own process (no --devices), one
engine process (`--devices 0`) and one a device (`--devices DEVICES`), all with `--kernels
KERNELS` (default auto: the Hopper ones on an H200). Rates, per-device GPU busy (CUDA events
on each engine's stream) and peak RSS are the CLI's own summary line and e2e.py's process-tree
sampling. The speedup is the many-device rate over the better one-GPU
rate; the target is 0.95x the device count (1.9x on two GPUs).

    python benchmarks/devices.py --model /tmp/glmvit-real                   # the 2-GPU machine
    python benchmarks/devices.py --model /tmp/glmvit-tiny --backend numpy --images 24 --devices 0,1  # CPU smoke

A Markdown table on stdout; a JSON record (and the table) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

from e2e import benchmark_main, end_to_end, load_collection, save  # puts the repository on sys.path

from glmvit_cupy.model import KERNELS

TARGET_PER_DEVICE = 0.95


def gpus() -> list[str]:
    """The GPUs nvidia-smi lists (this process stays off CUDA, as the CLI's main process does)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def markdown(r: dict) -> str:
    col = r["collection"]
    lines = [f"{r['date']}, {', '.join(r['gpus']) or 'no GPU'}, {r['cpus']} CPUs, backend {r['backend']} "
             f"(kernels {r['kernels']}), "
             f"{r['workers']} workers; {col['count']} photos ({col['jpeg']} JPEG, {col['png']} PNG)", "",
             "| run | images/s | tokens/s | pipeline / process wall s | GPU busy | peak RSS tree MiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, run in r["runs"].items():
        busy = " / ".join(f"{100 * b:.0f}%" for b in run["gpu_busy_each"]) or "-"
        lines.append(f"| {name} | {run['images_per_s']:.1f} | {run['tokens_per_s']:,.0f} | "
                     f"{run['pipeline_wall_s']:.1f} / {run['process_wall_s']:.1f} | {busy} | "
                     f"{run['rss_tree_sampled_mib']:.0f} |")
    lines += ["", f"speedup over the better one-GPU run: {r['speedup']:.2f}x on {r['device_count']} device(s) "
                  f"(target >= {TARGET_PER_DEVICE * r['device_count']:.2f}x)"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, collection: Path, out: Path) -> None:
    t0 = time.perf_counter()
    manifest, files = load_collection(args, collection)
    kernels = ["--kernels", args.kernels]
    runs = {}
    plan = [("one engine, in the CLI's process", []), ("--devices 0", ["--devices", "0"])]
    if args.devices != "0":  # on one GPU, `--devices 0` is the many-device run too
        plan.append((f"--devices {args.devices}", ["--devices", args.devices]))
    for label, extra in plan:
        runs[label] = end_to_end(files, collection, args.model, args.workers, args.backend, extra + kernels)
        print(f"{label}: {runs[label]['summary_line']}", file=sys.stderr, flush=True)
    one = max(r["images_per_s"] for r in list(runs.values())[:2])
    last = list(runs.values())[-1]
    record = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  gpus=gpus(), cpus=os.cpu_count(), backend=args.backend, kernels=args.kernels, workers=args.workers,
                  collection=dict(path=str(collection), **{k: v for k, v in manifest.items() if k != "files"}),
                  runs=runs, device_count=max(1, len(last["gpu_busy_each"]) or len(args.devices.split(","))),
                  speedup=round(last["images_per_s"] / one, 3), benchmark_wall_s=round(time.perf_counter() - t0, 1))
    save(record, markdown(record), out)


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--devices", default="all", help="the many-device run's --devices [default: all]")
    ap.add_argument("--kernels", choices=list(KERNELS), default="auto", help="every run's --kernels [default: auto]")


if __name__ == "__main__":
    benchmark_main(__doc__, run, ("devices-e2e.json", "cpu-devices-e2e.json"), options)
