"""The soak: minutes of mixed-size work through the library and the CLI pipeline at once, on one GPU.

Both loads run side by side for the whole time (--minutes, default 10):
- Library: this process holds one GlmVit and LIBRARY_THREADS threads share it, each serving
  requests in a loop. A request is one of REQUESTS templates (1-8 photos of the collection, drawn
  once, at most p_max patches together), picked at random, and sent through `encode` (the
  streaming pipeline with its decode workers) or `forward` (the template's preprocessed batch,
  as NumPy pixels or as CuPy pixels at an odd offset, which the engine must copy first). Every
  repeat of a template through the same call must hash like its first result, bit for bit.
- CLI: one `glmvit-cupy encode --files-from LIST --out-dir OUT` run over up to --passes passes
  of the collection, each pass hard links in a directory of its own (distinct inputs, identical
  bytes) behind a separator image of exactly p_max patches. The separator fills a batch alone,
  so every pass is packed into the same batches, and every copy of a photo must hash alike. A
  consumer thread hashes each sealed shard's records and deletes the shard (a downstream that
  ships shards away: an hour of output would not fit on the disk). At the deadline the CLI gets
  SIGTERM: it finishes the shard in flight and exits 130.
- Every SAMPLE_S: this process's RSS and that of its decode workers, CuPy's device pool (held,
  in use) and pinned pool, the CLI process tree's RSS, and the GPU's memory in use (nvidia-smi,
  all processes: the CLI's device memory is in there).
Flat: after WARMUP_S, each series' maximum over the last minute is within its tolerance (FLAT) of
its maximum over the first minute after warm-up. The script exits 1 if anything is not flat, a
repeat differs, or an error occurs; its JSON record and a Markdown table go to --out.

    python benchmarks/soak.py --model /tmp/glmvit-real --out benchmarks/results/h200-soak.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from photos import build_collection  # noqa: E402
from proctree import tree_memory  # noqa: E402

from glmvit_cupy import GlmVit  # noqa: E402
from glmvit_cupy.collection.sources import expand_inputs  # noqa: E402
from glmvit_cupy.errors import GlmVitError  # noqa: E402
from glmvit_cupy.processor.preprocess import preprocess  # noqa: E402
from glmvit_cupy.tower.checkpoint import read_header  # noqa: E402

REQUESTS = 24  # templates: more than the engine's 16 kept graphs, so graphs are also evicted
LIBRARY_THREADS = 2
LIBRARY_PHOTOS = 64  # the templates draw from the collection's first photos
WARMUP_S = 90.0
SAMPLE_S = 5.0
FLAT = {"lib_rss_mib": (0.05, 64), "lib_tree_rss_mib": (0.05, 64), "cli_tree_rss_mib": (0.05, 64),
        "pool_held_mib": (0.02, 0), "pinned_held_mib": (0.02, 0), "gpu_used_mib": (0.02, 0)}
SHARD_JSONL = re.compile(r"^shard-\d{5}\.jsonl$")


def gpu_used_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return float(out[0]) if out else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


class Soak:
    """The library load: the templates, and what each first gave."""

    def __init__(self, vit: GlmVit, photos: list[str], seed: int) -> None:
        self.vit = vit
        rng = random.Random(seed)
        budget = vit.p_max
        self.templates: list[tuple[list[str], np.ndarray, np.ndarray]] = []
        while len(self.templates) < REQUESTS:
            paths = rng.sample(photos, rng.randint(1, 8))
            pixels, grid = preprocess(paths, vit.processor)
            if len(pixels) <= budget:
                self.templates.append((paths, pixels, grid))
        self.first: dict[tuple[int, str], tuple[str, ...]] = {}
        self.counts = {"encode": 0, "forward_numpy": 0}
        if vit.backend == "cupy":
            self.counts["forward_cupy_odd_offset"] = 0
        self.images = 0
        self.mismatches: list[str] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def _hashes(self, outs) -> tuple[str, ...]:
        to_host = (lambda a: a.get()) if not isinstance(outs[0].pooler_output, np.ndarray) else (lambda a: a)
        return tuple(hashlib.sha256(np.ascontiguousarray(to_host(a)).tobytes()).hexdigest()
                     for o in outs for a in (o.pooler_output, o.last_hidden_state))

    def request(self, rng: random.Random) -> None:
        t = rng.randrange(len(self.templates))
        paths, pixels, grid = self.templates[t]
        kind = rng.choice(list(self.counts))
        if kind == "encode":
            hashes, call = self._hashes(self.vit.encode(paths, workers=4, output="both", dtype="float32")), "encode"
        else:
            if kind == "forward_numpy":
                given = pixels
            else:
                import cupy

                flat = cupy.empty(pixels.size + 1, dtype=cupy.float32)
                flat[1:] = cupy.asarray(pixels).reshape(-1)
                given = flat[1:].reshape(pixels.shape)
            hashes, call = self._hashes([self.vit.forward(given, grid)]), "forward"  # both inputs: one result
        with self.lock:
            self.counts[kind] += 1
            self.images += len(paths)
            want = self.first.setdefault((t, call), hashes)
            if want != hashes and len(self.mismatches) < 20:
                self.mismatches.append(f"template {t} through {kind}: outputs differ from its first result")

    def serve(self, deadline: float, seed: int) -> None:
        rng = random.Random(seed)
        try:
            while time.monotonic() < deadline:
                self.request(rng)
        except Exception as exc:  # recorded and reported: the soak's verdict needs it
            with self.lock:
                self.errors.append(f"library: {type(exc).__name__}: {exc}")


def separator(directory: Path, p_max: int, processor) -> Path:
    """A photo-like PNG of exactly p_max patches, so that it fills a batch alone."""
    from helpers import photo_like
    from PIL import Image

    side = processor.patch_size * processor.merge_size
    rows = int((p_max // processor.merge_size ** 2) ** 0.5)
    while (p_max // processor.merge_size ** 2) % rows:
        rows -= 1
    h, w = rows * side, p_max // processor.merge_size ** 2 // rows * side
    path = directory / "separator.png"
    Image.fromarray(photo_like(h, w, 7)).save(path)
    _, grid = preprocess(path, processor)
    if int(grid.prod()) != p_max:
        raise GlmVitError(f"the separator {w}x{h} has {int(grid.prod())} patches, not p_max {p_max}")
    return path


class Consumer(threading.Thread):
    """Hashes the records of each sealed shard of the CLI's output, then deletes the shard."""

    def __init__(self, out_dir: Path, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.out_dir, self.stop = out_dir, stop
        self.first: dict[str, str] = {}  # photo name -> hash of its first copy
        self.records = self.compared = 0
        self.mismatches: list[str] = []

    def drain(self) -> None:
        for jsonl in sorted(p for p in self.out_dir.iterdir() if SHARD_JSONL.match(p.name)):
            shard = jsonl.with_suffix(".safetensors")
            entries, _ = read_header(shard)
            raw = np.memmap(shard, dtype=np.uint8, mode="r")
            names = sorted(n for n in entries if n not in ("grid_thw", "offsets"))
            for line in jsonl.read_text().splitlines():
                record = json.loads(line)
                digest = hashlib.sha256()
                for name in names:
                    entry = entries[name]
                    row = (entry.end - entry.begin) // entry.shape[0]
                    a, b = record["rows"]
                    digest.update(raw[entry.begin + a * row:entry.begin + b * row])
                photo = Path(record["path"]).name
                want = self.first.setdefault(photo, digest.hexdigest())
                self.records += 1
                if want != digest.hexdigest():
                    if len(self.mismatches) < 20:
                        self.mismatches.append(f"{record['path']}: differs from the first copy of {photo}")
                else:
                    self.compared += 1
            del raw
            shard.unlink()
            jsonl.unlink()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.drain()


def flatness(samples: list[dict], series: str, t_end: float, rule: tuple[float, float] | None = None) -> dict | None:
    """Whether `series` stayed flat: its last minute's maximum within `rule` (relative, absolute slack;
    default FLAT[series]) of its first minute's after WARMUP_S; None when the run was too short."""
    values = [(s["t"], s[series]) for s in samples if s.get(series) is not None]
    early = [v for t, v in values if WARMUP_S <= t < WARMUP_S + 60]
    late = [v for t, v in values if t >= t_end - 60]
    if not early or not late:
        return None
    rel, slack = rule or FLAT[series]
    first, last = max(early), max(late)
    return dict(first_minute_max=round(first, 1), last_minute_max=round(last, 1),
                peak=round(max(v for t, v in values if t >= WARMUP_S), 1),
                growth=round(last - first, 1), flat=last <= first * (1 + rel) + slack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--backend", choices=["cupy", "numpy"], default="cupy",
                    help="numpy: a CPU smoke run of the soak itself (no pool figures)")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--images", type=int, default=1000, help="photos in the collection (the e2e one)")
    ap.add_argument("--passes", type=int, default=60, help="most passes over the collection the CLI gets")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "glmvit-soak")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "h200-soak.json")
    args = ap.parse_args()
    try:
        ok = run(args)
    except GlmVitError as exc:
        sys.exit(f"soak: error: {exc}")
    sys.exit(0 if ok else 1)


def run(args: argparse.Namespace) -> bool:
    collection = Path(tempfile.gettempdir()) / f"glmvit-e2e-photos-{args.images}-0"  # e2e.py's default
    build_collection(collection, args.images, 0)
    photos = [s.path for s in expand_inputs([str(collection)])]
    vit = GlmVit.from_pretrained(args.model, backend=args.backend)
    soak = Soak(vit, photos[:LIBRARY_PHOTOS], seed=1)

    work = args.work
    if work.exists():
        subprocess.run(["rm", "-rf", str(work)], check=True)
    (work / "out").mkdir(parents=True)
    sep = separator(work, vit.p_max, vit.processor)
    listing = []
    for k in range(args.passes):
        d = work / f"pass-{k:03d}"
        d.mkdir()
        os.link(sep, d / "separator.png")
        listing.append(str(d / "separator.png"))
        for p in photos:
            os.link(p, d / Path(p).name)
            listing.append(str(d / Path(p).name))
    (work / "inputs.txt").write_text("\n".join(listing) + "\n")

    stop = threading.Event()
    consumer = Consumer(work / "out", stop)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60
    cli = subprocess.Popen([sys.executable, "-c", "import cli; cli.main()", "encode", "--files-from",
                            str(work / "inputs.txt"), "--model", str(args.model), "--out-dir", str(work / "out"),
                            "--backend", args.backend, "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    consumer.start()
    threads = [threading.Thread(target=soak.serve, args=(deadline, 100 + i), daemon=True)
               for i in range(LIBRARY_THREADS)]
    for t in threads:
        t.start()

    samples, pool, pinned = [], None, None
    if args.backend == "cupy":
        import cupy

        pool, pinned = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()
    while time.monotonic() < deadline and (any(t.is_alive() for t in threads) or cli.poll() is None):
        lib, lib_tree = tree_memory(os.getpid(), own=True), tree_memory(os.getpid())
        cli_tree = tree_memory(cli.pid) if cli.poll() is None else None
        samples.append(dict(t=round(time.monotonic() - t0, 1), lib_rss_mib=lib[0] / 1024,
                            lib_tree_rss_mib=lib_tree[0] / 1024,
                            cli_tree_rss_mib=cli_tree[0] / 1024 if cli_tree else None,
                            pool_held_mib=pool.total_bytes() / 2 ** 20 if pool else None,
                            pool_used_mib=pool.used_bytes() / 2 ** 20 if pool else None,
                            pinned_held_mib=(pinned.total_bytes() / 2 ** 20 if hasattr(pinned, "total_bytes") else None),
                            gpu_used_mib=gpu_used_mib() if pool else None, library_images=soak.images, cli_records=consumer.records))
        time.sleep(SAMPLE_S)
    if cli.poll() is None:
        cli.send_signal(signal.SIGTERM)
    _, cli_err = cli.communicate()
    for t in threads:
        t.join()
    t_end = time.monotonic() - t0
    stop.set()
    consumer.join()
    consumer.drain()

    cli_lines = cli_err.strip().splitlines()
    errors = list(soak.errors)
    if cli.returncode not in (0, 130):
        errors.append(f"CLI exited {cli.returncode}: {cli_lines[-1] if cli_lines else 'no output'}")
    record = dict(
        backend=args.backend, minutes=round(t_end / 60, 2), warmup_s=WARMUP_S, sample_s=SAMPLE_S, p_max=vit.p_max,
        library=dict(threads=LIBRARY_THREADS, templates=REQUESTS, requests=soak.counts, images=soak.images,
                     images_per_s=round(soak.images / t_end, 1), distinct_results=len(soak.first),
                     mismatches=soak.mismatches),
        cli=dict(exit=cli.returncode, last_line=cli_lines[-1] if cli_lines else "", records=consumer.records,
                 records_per_s=round(consumer.records / t_end, 1), identical_copies=consumer.compared,
                 distinct_photos=len(consumer.first), mismatches=consumer.mismatches),
        flat={s: flatness(samples, s, t_end) for s in FLAT}, errors=errors, samples=samples)
    ok = (not errors and not soak.mismatches and not consumer.mismatches
          and all(f is None or f["flat"] for f in record["flat"].values()))
    record["ok"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    table = markdown(record)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return ok


def markdown(r: dict) -> str:
    lib, cli = r["library"], r["cli"]
    lines = [f"soak: {r['minutes']} min, library and CLI side by side on one GPU, p_max {r['p_max']}: "
             f"{'OK' if r['ok'] else 'FAILED'}", "",
             "| load | work | repeats bit-identical |", "| --- | --- | --- |",
             f"| library ({lib['threads']} threads, {lib['templates']} templates) | {lib['images']} images "
             f"({lib['images_per_s']}/s) in {sum(lib['requests'].values())} requests {lib['requests']} | "
             f"{'all' if not lib['mismatches'] else lib['mismatches'][0]} |",
             f"| CLI (`encode --out-dir`, exit {cli['exit']}) | {cli['records']} images ({cli['records_per_s']}/s), "
             f"{cli['distinct_photos']} distinct | {cli['identical_copies']} of {cli['records']} "
             f"{'(all)' if not cli['mismatches'] else '— ' + cli['mismatches'][0]} |", "",
             "| series (MiB) | first minute after warm-up, max | last minute, max | peak | flat |",
             "| --- | --- | --- | --- | --- |"]
    for name, f in r["flat"].items():
        if f:
            lines.append(f"| {name} | {f['first_minute_max']} | {f['last_minute_max']} | {f['peak']} | "
                         f"{'yes' if f['flat'] else 'NO'} |")
    lines += [f"| {name} | not sampled | | | |" for name, f in r["flat"].items() if not f]
    if r["errors"]:
        lines += ["", "errors: " + "; ".join(r["errors"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
