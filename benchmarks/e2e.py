"""End to end on a photo collection: files in, shards on disk, against the forward alone and transformers.

Issue 14, item 8, in one process and one command:

1. The collection: COUNT (default 1,000) distinct real photographs, JPEG and PNG, long side
   320-1600 px, varied aspect ratios, derived offline from the photographs scikit-image
   bundles (`benchmarks/photos.py` says how and why). Built under --collection (default a
   directory in the temp dir named by count and seed), reused when it is already there.
2. Ours end to end: `glmvit-cupy encode COLLECTION --model M --out-dir OUT --workers N --quiet`
   as a subprocess, into a fresh output directory, after one warm-up run of the same command
   on 16 of the files (CuPy's on-disk kernel cache then holds the kernels, as on any run after
   the first). images/s, tokens/s and GPU busy are the CLI's own final summary line (the
   pipeline's clock: from the first file read to the last shard renamed; binding the
   checkpoint is outside it); the whole process's wall time is reported beside it, and the
   records in the shards' .jsonl are counted (one per photo, or the run fails). Peak host
   RSS: `main` is the CLI process's own peak (VmHWM of /proc/self/status, read by a short
   wrapper when the CLI is done: kept by the kernel, exact; not getrusage's ru_maxrss, which
   a process started by fork (or vfork) and exec inherits from its parent: the benchmark's
   own peak, 23 GB once, read as the CLI's); `largest worker` the highest
   peak (VmHWM) of any of its descendants (the decode workers, started by workers.Child), and
   `tree` the peak of the RSS summed over the process and all its descendants, both read
   from /proc every 0.1 s (the workers' VmHWM is kept by the kernel too, so only growth in a
   worker's last 0.1 s could be missed; the sum counts shared pages once per process, so it
   overstates).
3. Forward only on the same grids: the same files preprocessed by our own `canvas` (in a
   process pool, untimed), packed by the pipeline's own `plan_batches` under the same
   p_max, each batch's float32 pixel_values uploaded before the clock starts; then
   `vit.forward` on every batch back to back, wall clock between two device
   synchronisations. Two passes; the ratio uses the faster (the stricter target). Both meet
   each batch's grid as the pipeline does, for the first time as far as the engine can tell:
   it keeps CUDA graphs for its last 16 grids only, and a mixed collection has a new grid in
   every batch.
4. transformers: `Glm5NextImageProcessorPil` on 16 files, then `Glm5NextVisionModel` (our
   checkpoint's tower, bf16, sdpa) on the batch, pooler_output brought to the host (not
   written to disk, as ours is), over all files, after one untimed warm-up batch. The processor's grids must equal ours (the same
   work is compared).
5. A Markdown table on stdout; a JSON record (and the table) under benchmarks/results/.

    python benchmarks/e2e.py --model /tmp/glmvit-real                               # the H200 run
    python benchmarks/e2e.py --model /tmp/glmvit-tiny --backend numpy --images 12   # CPU smoke run

On --backend numpy (no GPU) every part runs on the CPU: the CLI and the forward with the
NumPy backend, transformers on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the code beside this script, and the oracle helper

from photos import build_collection  # noqa: E402
from proctree import tree_memory  # noqa: E402

from glmvit_cupy import GlmVit  # noqa: E402
from glmvit_cupy.collection.pipeline import plan_batches  # noqa: E402
from glmvit_cupy.collection.sources import expand_inputs  # noqa: E402
from glmvit_cupy.errors import GlmVitError  # noqa: E402
from glmvit_cupy.processor.preprocess import ProcessorConfig, canvas, canvas_grid, patchify  # noqa: E402

WARMUP_FILES = 16
FORWARD_PASSES = 2
GRAPH_BATCHES = 16  # the engine keeps graphs for its last 16 grids (engine.GRIDS_KEPT)
TRANSFORMERS_BATCH = 16
TARGET_FORWARD_RATIO = 0.9
TARGET_TRANSFORMERS_RATIO = 7.0
SAMPLE_S = 0.1

# Runs the CLI exactly as the `glmvit-cupy` entry point does (cli:main), then writes its own
# peak RSS in KiB (VmHWM: this process's address space's, which exec started afresh) to the
# file named by argv[1]; its exit status is the CLI's.
CLI_WRAPPER = """import sys
from glmvit_cupy.cli import main
report, sys.argv = sys.argv[1], ["glmvit-cupy"] + sys.argv[2:]
try:
    main()
    code = 0
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
with open(report, "w") as f:
    f.write(open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
sys.exit(code)
"""

SUMMARY = re.compile(r"encoded (\d+), skipped (\d+), failed (\d+) in ([\d.]+)s: [\d.,]+ (?:images|inputs)/s, "
                     r"[\d.,]+ tokens/s, GPU busy (.+)$")


class TreeRss(threading.Thread):
    """Peaks of a process's descendants, sampled from /proc every SAMPLE_S: the highest VmHWM of
    any of them and the highest RSS summed over the process and all of them."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.largest_kib, self.total_kib, self.most_processes = pid, 0, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            total, largest, alive = tree_memory(self.pid)
            self.total_kib = max(self.total_kib, total)
            self.largest_kib = max(self.largest_kib, largest)
            self.most_processes = max(self.most_processes, alive)
            self.done.wait(SAMPLE_S)


def run_cli(inputs: list[str], model: Path, out_dir: Path, workers: int, backend: str,
            extra: Sequence[str] = ()) -> dict:
    """One `glmvit-cupy encode` subprocess (`extra`: more of its options): its parsed summary,
    wall time and peak RSS. `gpu_busy` is the mean over the devices, `gpu_busy_each` one each."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        report = Path(f.name)
    command = [sys.executable, "-c", CLI_WRAPPER, str(report), "encode", *inputs, "--model", str(model),
               "--out-dir", str(out_dir), "--workers", str(workers), "--backend", backend, "--quiet", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = TreeRss(proc.pid)
    sampler.start()
    _, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    sampler.done.set()
    sampler.join()
    lines = stderr.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise GlmVitError(f"glmvit-cupy encode exited {proc.returncode}: {(lines or ['no output'])[-1]}"
                          + (f" (stderr: {' | '.join(lines[-5:])})" if len(lines) > 1 else ""))
    match = SUMMARY.search(lines[-1])
    if match is None:
        raise GlmVitError(f"glmvit-cupy encode: cannot read its summary line {lines[-1]!r}")
    encoded, skipped, failed = (int(match.group(i)) for i in (1, 2, 3))
    busy = [float(b) / 100 for b in re.findall(r"(\d+)%", match.group(5))]  # "n/a" on the NumPy backend
    main_kib = int(report.read_text())
    report.unlink()
    return dict(encoded=encoded, skipped=skipped, failed=failed, pipeline_wall_s=float(match.group(4)),
                gpu_busy=sum(busy) / len(busy) if busy else None, gpu_busy_each=busy,
                process_wall_s=round(wall, 2), summary_line=lines[-1],
                rss_main_mib=round(main_kib / 1024, 1), rss_largest_worker_mib=round(sampler.largest_kib / 1024, 1),
                rss_tree_sampled_mib=round(sampler.total_kib / 1024, 1),
                processes=sampler.most_processes)


def read_records(out_dir: Path) -> tuple[int, int, int]:
    """(records, tokens, bytes on disk) of the shards in out_dir."""
    records = tokens = 0
    for jsonl in sorted(out_dir.glob("shard-*.jsonl")):
        for line in jsonl.read_text().splitlines():
            records += 1
            tokens += json.loads(line)["tokens"]
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    return records, tokens, size


def end_to_end(files: list[str], collection: Path, model: Path, workers: int, backend: str,
               extra: Sequence[str] = (), out_dir: Path | None = None,
               warmup: Sequence[str] | None = None) -> dict:
    """The warm-up run (on `warmup`, default the first WARMUP_FILES files), then the measured
    run into a fresh directory (removed afterwards, unless it is the `out_dir` given, for the
    caller to read); `extra`: more options of both (devices.py's --devices)."""
    scratch = Path(tempfile.mkdtemp(prefix="glmvit-e2e-"))
    out_dir = out_dir or scratch / "out"
    try:
        run_cli(list(files[:WARMUP_FILES] if warmup is None else warmup), model, scratch / "warmup", workers, backend,
                extra)
        result = run_cli([str(collection)], model, out_dir, workers, backend, extra)
        records, tokens, size = read_records(out_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if result["encoded"] != len(files) or records != len(files) or result["failed"]:
        raise GlmVitError(f"end-to-end run: {result['encoded']} encoded, {result['failed']} failed, "
                          f"{records} records on disk, expected {len(files)} (summary: {result['summary_line']})")
    # rates from the counts and the wall time of the summary (its own rates are printed to 0.1)
    wall = result["pipeline_wall_s"]
    return dict(result, records=records, tokens=tokens, out_mib=round(size / 2**20, 1),
                images_per_s=round(len(files) / wall, 2), tokens_per_s=round(tokens / wall, 1))


def prepare_batches(files: list[str], config: ProcessorConfig, p_max: int, workers: int):
    """Canvases of every file (a process pool; spawned, so no CUDA state is forked), packed by
    the pipeline's plan_batches: [(pixel_values float32, grid_thw)] on the host, one a batch.
    The patchify runs in threads (NumPy's gathers and copies release the GIL): ~20 GB of
    float32 for 1,000 photos, a minute in one thread."""
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        canvases = list(pool.map(canvas, files, [config] * len(files), chunksize=4))
    grids = [canvas_grid(c.shape, config) for c in canvases]
    batches = plan_batches([h * w for _, h, w in grids], p_max)
    with ThreadPoolExecutor(workers) as threads:
        for batch in batches:
            pixels = np.concatenate(list(threads.map(lambda i: patchify(canvases[i], config), batch)))
            for i in batch:
                canvases[i] = None  # host memory: the canvases and one batch of float32, not all of it
            yield pixels, np.array([grids[i] for i in batch], dtype=np.int64)


def forward_only(vit: GlmVit, files: list[str], config: ProcessorConfig, workers: int) -> tuple[dict, np.ndarray]:
    """The forward alone on the pipeline's batches of these files; (result, grids of all files)."""
    return forward_passes(vit, prepare_batches(files, config, vit.p_max, workers), len(files))


def forward_passes(vit: GlmVit, host_batches: Iterable[tuple[np.ndarray, np.ndarray]],
                   inputs: int) -> tuple[dict, np.ndarray]:
    """The forward alone on these (pixel_values, grid_thw) batches of `inputs` inputs, uploaded
    first, FORWARD_PASSES times back to back; (result, the batches' grid rows)."""
    gpu = vit.backend == "cupy"
    batches = []
    if gpu:
        import cupy
        free = cupy.cuda.runtime.memGetInfo()[0]
    for pixels, grid in host_batches:
        if gpu:
            free -= pixels.nbytes
            if free < vit.scratch_bytes + 2**31:
                raise GlmVitError(f"forward-only: the collection's pixel_values do not fit on the device "
                                  f"next to the scratch ({vit.scratch_bytes / 2**30:.1f} GiB); use a smaller collection")
            pixels = cupy.asarray(pixels)
        batches.append((pixels, grid))
    sync = cupy.cuda.Device().synchronize if gpu else (lambda: None)

    def timed_pass(todo: list) -> float:
        """Seconds of vit.forward over `todo` back to back, between two device synchronisations."""
        sync()
        t0 = time.perf_counter()
        for pixels, grid in todo:
            vit.forward(pixels, grid)
        sync()
        return time.perf_counter() - t0

    passes = [timed_pass(batches) for _ in range(FORWARD_PASSES)]
    # CUDA graphs with mixed sizes: the engine captures a grid the second time it meets it. The
    # first GRAPH_BATCHES batches three times over: eager (fresh grids), captured, replayed.
    graph = None
    if gpu:
        few = batches[:GRAPH_BATCHES]
        vit.tower.graphs.clear()
        vit.tower.tables.clear()
        times = [timed_pass(few) for _ in range(3)]
        graph = dict(batches=len(few), eager_s=round(times[0], 4), capture_s=round(times[1], 4),
                     replay_s=round(times[2], 4), replay_over_eager=round(times[2] / times[0], 3))
    grids = np.concatenate([g for _, g in batches])
    patches = int(sum(len(p) for p, _ in batches))
    tokens = patches // vit.geometry.merge_unit
    best = min(passes)
    result = dict(batches=len(batches), patches=patches, tokens=tokens, pass_s=[round(t, 3) for t in passes],
                  images_per_s=round(inputs / best, 2), tokens_per_s=round(tokens / best, 1),
                  first_pass_images_per_s=round(inputs / passes[0], 2), graphs=graph)
    return result, grids


def transformers_rate(model: Path, files: list[str], geo, device: str, our_grids: np.ndarray) -> dict:
    """transformers' processor + model over the files in batches of TRANSFORMERS_BATCH."""
    import torch
    from PIL import Image
    from helpers import transformers_tower
    try:
        from transformers import Glm5NextImageProcessorPil
    except ImportError:
        from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    processor = Glm5NextImageProcessorPil(patch_size=geo.patch_size, temporal_patch_size=geo.temporal_patch_size,
                                          merge_size=geo.spatial_merge_size)
    tower = transformers_tower(model, dtype="bfloat16", device=device)

    def run(paths: list[str]) -> tuple[np.ndarray, int]:
        images = [Image.open(p) for p in paths]
        try:
            features = processor(images=images, return_tensors="pt")
        finally:
            for image in images:
                image.close()
        grid = features["image_grid_thw"]
        with torch.no_grad():
            out = tower(features["pixel_values"].to(device, torch.bfloat16), grid.to(device))
        return grid.numpy(), len(out.pooler_output.float().cpu())

    run(files[:TRANSFORMERS_BATCH])  # warm-up, untimed
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    grids, tokens = [], 0
    sync()
    t0 = time.perf_counter()
    for a in range(0, len(files), TRANSFORMERS_BATCH):
        grid, rows = run(files[a:a + TRANSFORMERS_BATCH])
        grids.append(grid)
        tokens += rows
    sync()
    wall = time.perf_counter() - t0
    grids = np.concatenate(grids)
    if not np.array_equal(grids, our_grids):
        first = int(np.argmax(np.any(grids != our_grids, axis=1))) if grids.shape == our_grids.shape else 0
        raise GlmVitError(f"transformers' processor gives other grids than ours, first at {files[first]}: "
                          f"{grids[first].tolist()} vs {our_grids[first].tolist()}")
    return dict(wall_s=round(wall, 2), images_per_s=round(len(files) / wall, 2), tokens_per_s=round(tokens / wall, 1))


def environment(backend: str) -> dict:
    import torch
    import transformers
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
               transformers=transformers.__version__)
    if backend == "cupy":
        import cupy
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        env.update(device=name.decode() if isinstance(name, bytes) else str(name), cupy=cupy.__version__,
                   driver=cupy.cuda.runtime.driverGetVersion(), cuda_runtime=cupy.cuda.runtime.runtimeGetVersion())
    else:
        env.update(device=f"CPU ({platform.processor() or platform.machine()})")
    return env


def markdown(r: dict) -> str:
    e2e, fwd, hf, env = r["ours_e2e"], r["forward_only"], r["transformers"], r["env"]
    busy = "-" if e2e["gpu_busy"] is None else f"{100 * e2e['gpu_busy']:.0f}%"
    col = r["collection"]
    lines = [f"{env['date']}, {env['device']}, {env['cpus']} CPUs, backend {r['backend']}, {r['workers']} workers; "
             f"{col['count']} photos ({col['jpeg']} JPEG, {col['png']} PNG, {col['total_bytes'] / 2**20:.0f} MiB), "
             f"{fwd['patches']:,} patches, {fwd['tokens']:,} tokens, {fwd['batches']} forward calls of at most "
             f"{r['p_max']} patches", "",
             "| measure | value | target |", "| --- | --- | --- |",
             f"| ours end to end, images/s | {e2e['images_per_s']:.1f} | |",
             f"| ours end to end, tokens/s | {e2e['tokens_per_s']:,.0f} | |",
             f"| ours end to end, pipeline wall / process wall s (shards written: {e2e['out_mib'] / 1024:.1f} GiB) | "
             f"{e2e['pipeline_wall_s']:.1f} / {e2e['process_wall_s']:.1f} | |",
             f"| forward only, images/s (best of {len(fwd['pass_s'])} passes; first pass) | "
             f"{fwd['images_per_s']:.1f} ({fwd['first_pass_images_per_s']:.1f}) | |",
             f"| end to end / forward only | {r['ratio_e2e_forward']:.2f}x | >= {TARGET_FORWARD_RATIO}x |",
             *([f"| CUDA graphs: {g['batches']} batches replayed / eager (first time) | {g['replay_s']:.3f} / "
                f"{g['eager_s']:.3f} s = {g['replay_over_eager']:.3f}x | |"] if (g := fwd.get("graphs")) else []),
             f"| GPU busy during the end-to-end run | {busy} | |",
             f"| peak RSS MiB: main / largest worker / tree (sampled sum) | {e2e['rss_main_mib']:.0f} / "
             f"{e2e['rss_largest_worker_mib']:.0f} / {e2e['rss_tree_sampled_mib']:.0f} | |",
             f"| transformers processor + model (bf16, sdpa, batches of {TRANSFORMERS_BATCH}), images/s | "
             f"{hf['images_per_s']:.1f} | |",
             f"| ours end to end / transformers | {r['ratio_ours_transformers']:.1f}x | "
             f">= {TARGET_TRANSFORMERS_RATIO:.0f}x |"]
    return "\n".join(lines) + "\n"


def check_same_work(ours: dict, fwd: dict) -> None:
    """The end-to-end run and the forward-only batches computed the same tokens (or the ratio means nothing)."""
    if fwd["tokens"] != ours["tokens"]:
        raise GlmVitError(f"the shards hold {ours['tokens']} tokens, the forward-only batches {fwd['tokens']}: "
                          "not the same work")


def free_device_memory(backend: str) -> None:
    """CuPy's pool given back, so that the next measurement (transformers) has the GPU's memory."""
    if backend == "cupy":
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()


def collection_options(description: str, results: tuple[str, str]) -> argparse.ArgumentParser:
    """The options every benchmark of a collection through the CLI has (this one, devices.py, video.py):
    --model, --backend, --seed, --collection, --workers, --out (`results`: its JSON record's name on
    cupy and on numpy)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    ap.add_argument("--backend", choices=["cupy", "numpy"], default="cupy")
    ap.add_argument("--seed", type=int, default=0, help="seed of the collection")
    ap.add_argument("--collection", type=Path, default=None,
                    help="where the collection is built or reused [default: a directory in the temp dir]")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="decode workers of the CLI (and of the untimed preprocessing) [default: cores - 1]")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"JSON record [default: benchmarks/results/{results[0]}, {results[1]} on numpy]")
    return ap


def benchmark_main(description: str, run: Callable, results: tuple[str, str],
                   more: Callable[[argparse.ArgumentParser], None] = lambda ap: None) -> None:
    """The command line of a benchmark of this collection through the CLI (this one, devices.py):
    `run(args, collection, out)`; `results`: its JSON record's name on cupy and on numpy."""
    ap = collection_options(description, results)
    ap.add_argument("--images", type=int, default=1000, help="photos in the collection")
    more(ap)
    args = ap.parse_args()
    collection = args.collection or Path(tempfile.gettempdir()) / f"glmvit-e2e-photos-{args.images}-{args.seed}"
    out = args.out or REPO / "benchmarks" / "results" / results[args.backend != "cupy"]
    try:
        run(args, collection, out)
    except GlmVitError as exc:
        sys.exit(f"{Path(sys.argv[0]).stem}: error: {exc}")


def load_collection(args: argparse.Namespace, collection: Path) -> tuple[dict, list[str]]:
    """Build (or reuse) the collection: its manifest and its files in the CLI's own order."""
    t0 = time.perf_counter()
    manifest = build_collection(collection, args.images, args.seed)
    files = [s.path for s in expand_inputs([str(collection)])]
    if len(files) != args.images:
        raise GlmVitError(f"{collection}: {len(files)} images found, the manifest lists {args.images}")
    print(f"collection {collection}: {len(files)} photos ({manifest['jpeg']} JPEG, {manifest['png']} PNG) "
          f"from {len(manifest['colour_sources']) + len(manifest['grey_sources'])} bundled photographs, "
          f"ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return manifest, files


def save(record: dict, table: str, out: Path) -> None:
    """The JSON record and its table under benchmarks/results/, the table on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(table)


def run(args: argparse.Namespace, collection: Path, out: Path) -> None:
    t0 = time.perf_counter()
    manifest, files = load_collection(args, collection)

    ours = end_to_end(files, collection, args.model, args.workers, args.backend)
    print(f"ours end to end: {ours['summary_line']}", file=sys.stderr, flush=True)

    vit = GlmVit.from_pretrained(args.model, backend=args.backend)  # the CLI's default budget, so its p_max
    geo = vit.geometry
    config = ProcessorConfig(patch_size=geo.patch_size, temporal_patch_size=geo.temporal_patch_size,
                             merge_size=geo.spatial_merge_size)
    fwd, grids = forward_only(vit, files, config, args.workers)
    print(f"forward only: {fwd}", file=sys.stderr, flush=True)
    check_same_work(ours, fwd)
    p_max = vit.p_max
    del vit
    free_device_memory(args.backend)

    hf = transformers_rate(args.model, files, geo, "cuda" if args.backend == "cupy" else "cpu", grids)
    print(f"transformers: {hf}", file=sys.stderr, flush=True)

    record = dict(backend=args.backend, workers=args.workers, p_max=p_max,
                  collection=dict(path=str(collection), **{k: v for k, v in manifest.items() if k != "files"}),
                  ours_e2e=ours, forward_only=fwd, transformers=hf,
                  ratio_e2e_forward=round(ours["images_per_s"] / fwd["images_per_s"], 3),
                  ratio_ours_transformers=round(ours["images_per_s"] / hf["images_per_s"], 2),
                  env=environment(args.backend), benchmark_wall_s=round(time.perf_counter() - t0, 1))
    save(record, markdown(record), out)


if __name__ == "__main__":
    benchmark_main(__doc__, run, ("h200-e2e.json", "cpu-e2e.json"))
