"""glmvit-cupy vs transformers on one GPU, same safetensors, same inputs, one process.

For each case (a named list of photo-like images): our engine's median forward time
(CUDA events, after warm-up, inputs already on the device), transformers'
Glm5NextVisionModel in bf16 with sdpa (eager, and `torch.compile(mode="reduce-overhead")`
where it fits the time budget), each engine's first call of the case's shape (cold for both:
nothing has run that shape before in the process, the earlier cases have), memory beyond
the weights, and each engine's max relative Frobenius error (over both outputs) against a
float32 reference (transformers in float32 with TF32 off, which the CPU tests tie to our
NumPy reference to 1e-5). Writes a JSON list of records and a markdown table.

    python benchmarks/compare_transformers.py --model CKPT --out results/h200-latest.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import photo_like, rel_err, run_transformers, transformers_tower  # noqa: E402

import cupy  # noqa: E402
from glmvit_cupy import GlmVit, preprocess  # noqa: E402
from glmvit_cupy.gpu.benchmark import cublas_peak, forward_flops, time_engine  # noqa: E402
from glmvit_cupy.gpu.scratch import scratch_plan  # noqa: E402

CASES = {
    "448": [(448, 448)],
    "1036": [(1036, 1036)],
    "2044": [(2044, 2044)],
    "8x448": [(448, 448)] * 8,
    "32x448": [(448, 448)] * 32,
}


def torch_median_ms(fn, warmup: int = 3, iters: int = 20) -> tuple[float, float]:
    """(first call ms, median ms) of fn() with torch CUDA events."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return first, float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "h200-latest.json")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--compile-budget-s", type=float, default=120.0,
                    help="stop adding torch.compile measurements once they have taken this long")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref_model = transformers_tower(args.model, dtype="float32", device="cuda")
    hf = transformers_tower(args.model, dtype="bfloat16", device="cuda")
    compiled = torch.compile(hf, mode="reduce-overhead")
    peak = cublas_peak()
    engines: dict[int, GlmVit] = {}
    records, compile_spent = [], 0.0

    for name in args.cases:
        images = [photo_like(h, w, seed=i) for i, (h, w) in enumerate(CASES[name])]
        pixels, grid = preprocess(images)
        p = len(pixels)
        p_max = max(32000, p)
        if p_max not in engines:
            engines[p_max] = GlmVit.from_pretrained(args.model, backend="cupy", max_pixels=p_max * 196)
        vit = engines[p_max]
        pix_dev = cupy.asarray(pixels)
        ours = time_engine(vit, pix_dev, grid)
        out = vit.forward(pix_dev, grid)
        ours_outputs = (out.last_hidden_state.get(), out.pooler_output.get())

        pix_t = torch.from_numpy(pixels).cuda()
        grid_t = torch.from_numpy(grid).cuda()
        with torch.no_grad():
            # transformers' first call of this shape is timed before anything else runs it (the
            # float32 reference included), as ours is: both cold, after the earlier cases.
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            hf_first, hf_ms = torch_median_ms(lambda: hf(pix_t.to(torch.bfloat16), grid_t))
            hf_mem = torch.cuda.max_memory_allocated() - base
            compile_first = compile_ms = None
            if compile_spent < args.compile_budget_s:
                t0 = time.perf_counter()
                try:
                    compile_first, compile_ms = torch_median_ms(
                        lambda: compiled(pix_t.to(torch.bfloat16), grid_t).pooler_output.clone())
                except Exception as exc:  # a compile failure is a result, not a crash of the comparison
                    print(f"{name}: torch.compile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                compile_spent += time.perf_counter() - t0
            ref = run_transformers(ref_model, pixels, grid)
            hf_outputs = run_transformers(hf, pixels, grid)

        err_ours = max(rel_err(a, b) for a, b in zip(ours_outputs, ref))
        err_hf = max(rel_err(a, b) for a, b in zip(hf_outputs, ref))
        record = dict(
            case=name, patches=p, ours_ms=round(ours.median_ms, 3), transformers_ms=round(hf_ms, 3),
            speedup=round(hf_ms / ours.median_ms, 2), ours_tflops=round(ours.tflops, 1),
            ours_pct_of_cublas_peak=round(100 * ours.tflops / peak.burst, 1),
            ours_pct_of_sustained_cublas_peak=round(100 * ours.tflops / peak.sustained, 1),
            transformers_tflops=round(forward_flops(vit.geometry, grid) / hf_ms / 1e9, 1),
            scratch_mib_ours=round(vit.scratch_bytes / 2**20, 1), scratch_mib_transformers=round(hf_mem / 2**20, 1),
            # the scratch of an engine whose max_pixels is exactly this case's pixels
            scratch_mib_ours_sized=round(scratch_plan(vit.geometry, p, vit.tower.k.flash_piece_rows()).total_bytes
                                         / 2**20, 1),
            max_rel_err_ours=float(f"{err_ours:.3e}"), max_rel_err_transformers=float(f"{err_hf:.3e}"),
            ours_first_call_ms=round(ours.first_call_ms, 1), transformers_first_call_ms=round(hf_first, 1),
            compile_ms=None if compile_ms is None else round(compile_ms, 3),
            compile_first_call_ms=None if compile_first is None else round(compile_first, 1),
            ours_stages_ms={k: round(v, 3) for k, v in ours.stages_ms.items()},
        )
        records.append(record)
        print(json.dumps(record), flush=True)

    env = dict(date=datetime.date.today().isoformat(), gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               driver=cupy.cuda.runtime.driverGetVersion(), cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
               cupy=cupy.__version__, torch=torch.__version__,
               transformers=__import__("transformers").__version__, cublas_peak_tflops=round(peak.burst, 1),
               cublas_sustained_peak_tflops=round(peak.sustained, 1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    args.out.with_name(args.out.stem + "-env.json").write_text(json.dumps(env, indent=1) + "\n")
    table = markdown(records, env)
    args.out.with_suffix(".md").write_text(table)
    print(table)


def markdown(records: list[dict], env: dict) -> str:
    lines = [f"{env['date']}, {env['gpu']}, driver {env['driver']}, CUDA runtime {env['cuda_runtime']}, "
             f"cupy {env['cupy']}, torch {env['torch']}, transformers {env['transformers']}; cuBLAS bf16 "
             f"8192^3 peak {env['cublas_peak_tflops']} TFLOP/s in a burst, {env['cublas_sustained_peak_tflops']} "
             "sustained (after 3 s of back-to-back GEMMs)", "",
             "| case | patches | ours ms | transformers ms | speedup | torch.compile ms | ours TFLOP/s "
             "| % of cuBLAS peak, burst / sustained | scratch MiB ours (default / sized) / transformers "
             "| max rel err ours / transformers "
             "| first call of the shape (cold) ms ours / transformers / torch.compile |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        compiled = "-" if r["compile_ms"] is None else f"{r['compile_ms']:.1f}"
        first_compile = "-" if r["compile_first_call_ms"] is None else f"{r['compile_first_call_ms']:.0f}"
        lines.append(f"| {r['case']} | {r['patches']} | {r['ours_ms']:.2f} | {r['transformers_ms']:.1f} | "
                     f"{r['speedup']:.1f}x | {compiled} | {r['ours_tflops']:.0f} | "
                     f"{r['ours_pct_of_cublas_peak']:.0f}% / {r['ours_pct_of_sustained_cublas_peak']:.0f}% | "
                     f"{r['scratch_mib_ours']:.0f} / {r['scratch_mib_ours_sized']:.0f} / "
                     f"{r['scratch_mib_transformers']:.0f} | "
                     f"{r['max_rel_err_ours']:.2e} / {r['max_rel_err_transformers']:.2e} | "
                     f"{r['ours_first_call_ms']:.0f} / {r['transformers_first_call_ms']:.0f} / {first_compile} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
