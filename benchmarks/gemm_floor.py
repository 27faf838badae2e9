"""The floor under each benchmark case: the forward's GEMMs alone, through cuBLAS, on a
power-capped GPU.

An H200 holds tensor-core work at its 700 W cap by lowering the SM clock (1.98 GHz in a
burst, 1.5-1.6 GHz under sustained load), so a cuBLAS peak measured in a burst overstates
what any engine keeps up for a whole forward. This script measures, in one process:
- the cuBLAS BF16 8192^3 peak, in a burst and sustained (benchmark.cublas_peak);
- per case (compare_transformers.py's photo-like images), every GEMM of the forward (patch
  embed; per block qkv, proj, gate|up, down; the merger's downsample, proj, gate|up, down)
  through cuBLAS alone, in forward order, on the engine's own weights, at the engine's own
  shapes (the MLPs' GEMMs in its row chunks) and on each GEMM's own operands, copied at the
  moment of its call during an eager forward of the case (GemmRecorder), captured as one
  CUDA graph; and our whole forward. Each is replayed back-to-back for --sustain-s before its
  CUDA-event timings (benchmark.sustained_ms), in alternating order over rounds.
Our time minus the GEMMs' is everything else the forward does: the attention, every norm,
RoPE, SwiGLU and conversion pass (on Hopper our gate|up is a fused GEMM + SwiGLU; here it is
cuBLAS's plain GEMM over the same rows). The GEMMs' time is a floor no engine built on
cuBLAS-class GEMMs goes under.

    python benchmarks/gemm_floor.py --model CKPT --out benchmarks/results/h200-gemm-floor.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import cupy
import numpy as np

from glmvit_cupy import GlmVit, preprocess
from glmvit_cupy.gpu.benchmark import attention_flops, cublas_peak, forward_flops, sustained_ms
from glmvit_cupy.tower.synthetic import photo_like

CASES = {"448": [(448, 448)], "1036": [(1036, 1036)], "2044": [(2044, 2044)], "8x448": [(448, 448)] * 8,
         "32x448": [(448, 448)] * 32}  # compare_transformers.py's cases, the same photo-like images


class GemmRecorder:
    """Stands in for a tower's cuBLAS wrapper (`blas`) and kernels (`k`) during one eager forward:
    each GEMM's activation operand is copied on the tower's stream at the moment of its call, so
    later passes cannot overwrite it, with its weight, output shape and accumulate flag; then the
    real call runs. The fused gate|up + SwiGLU kernel (Hopper) is recorded as the cuBLAS gate|up
    GEMM over the same rows that it stands for. Every other kernel passes through."""

    def __init__(self, tower) -> None:
        self.tower, self.blas, self.k = tower, tower.blas, tower.k
        self.calls: list[tuple[cupy.ndarray, cupy.ndarray, tuple[int, ...], np.dtype, bool]] = []

    def linear(self, out: cupy.ndarray, x: cupy.ndarray, w: cupy.ndarray, accumulate: bool = False) -> None:
        self.calls.append((copy_rows(x), w, out.shape, out.dtype, accumulate))
        self.blas.linear(out, x, w, accumulate=accumulate)

    def gemm_swiglu(self, x_map, w_map, bias, act, row0: int, k: int, limit: float) -> None:
        tower, s = self.tower, self.tower.scratch
        x = s.normed if x_map.data.ptr == s.normed_map.data.ptr else s.merge_y  # the maps _mlp passes
        weights = [blk.gate_up_w for blk in tower.w.blocks] + [tower.w.merger.gate_up_w]  # gate_up_maps' order
        w = weights[(w_map.data.ptr - tower.gate_up_maps.data.ptr) // tower.gate_up_maps.strides[0]]
        rows, inter = act.shape
        self.calls.append((copy_rows(x[row0:row0 + rows]), w, (rows, 2 * inter), np.dtype(np.uint16), False))
        self.k.gemm_swiglu(x_map, w_map, bias, act, row0, k, limit)

    def __getattr__(self, name: str):
        return getattr(self.k if hasattr(self.k, name) else self.blas, name)


def copy_rows(x: cupy.ndarray) -> cupy.ndarray:
    """A copy of a 2-D operand with its row stride kept (the down GEMM reads the act half of a
    gate|up chunk, rows 2 x inter apart), so the GEMM replays with the engine's leading dimension."""
    ld = x.strides[0] // x.itemsize
    full = cupy.empty((x.shape[0], ld), x.dtype)
    full[:, :x.shape[1]] = x
    return full[:, :x.shape[1]]


def gemm_graph(tower, pixels: cupy.ndarray, grid: np.ndarray) -> tuple[cupy.cuda.graph.Graph, list]:
    """The GEMMs of one forward of these inputs, in forward order at the engine's own shapes (the
    MLPs' in its row chunks), on the operands that forward gave them, captured as one graph on
    the tower's stream; and the buffers it reads and writes (kept alive by the caller). Outputs
    go to one dead buffer per shape: what the GEMMs write is never read."""
    recorder = GemmRecorder(tower)
    tower.blas, tower.k = recorder, recorder
    try:
        tower.forward(pixels, grid, marks=lambda stage: None)  # marks: always eager, so every call is made
    finally:
        tower.blas, tower.k = recorder.blas, recorder.k
    outs: dict[tuple, cupy.ndarray] = {}
    with tower.stream:
        for _, _, shape, dtype, _ in recorder.calls:
            if (shape, dtype) not in outs:
                outs[shape, dtype] = cupy.zeros(shape, dtype)
        tower.stream.begin_capture()
        for x, w, shape, dtype, accumulate in recorder.calls:
            tower.blas.linear(outs[shape, dtype], x, w, accumulate=accumulate)
        graph = tower.stream.end_capture()
    return graph, [recorder.calls, outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "h200-gemm-floor.json")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--sustain-s", type=float, default=1.5, help="back-to-back replays before each timing")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    vit = GlmVit.from_pretrained(args.model, backend="cupy", max_pixels=32768 * 196)
    tower = vit.tower
    peak = cublas_peak()
    records = []
    for name in args.cases:
        host_pixels, grid = preprocess([photo_like(h, w, seed=i) for i, (h, w) in enumerate(CASES[name])])
        p, pixels = len(host_pixels), cupy.asarray(host_pixels)
        for _ in range(3):  # eager, capture, replay
            tower.forward(pixels, grid)
        graph, _keep = gemm_graph(tower, pixels, grid)
        runs = {"gemms": lambda: graph.launch(tower.stream), "ours": lambda: tower.forward(pixels, grid)}
        times: dict[str, list[float]] = {key: [] for key in runs}
        for r in range(args.rounds):
            for key in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                time.sleep(1.0)  # each measurement starts from the same idle board
                times[key].append(sustained_ms(runs[key], tower.stream, args.sustain_s))
        ours, gemms = (float(np.median(times[key])) for key in ("ours", "gemms"))
        total, attention = forward_flops(vit.geometry, grid), attention_flops(vit.geometry, grid)
        gemm_flops = total - attention
        record = dict(case=name, patches=p, ours_ms=round(ours, 3), gemms_ms=round(gemms, 3),
                      ours_tflops=round(total / ours / 1e9, 1), gemms_tflops=round(gemm_flops / gemms / 1e9, 1),
                      gemm_share_of_flops=round(gemm_flops / total, 3), rest_ms=round(ours - gemms, 3),
                      attention_gflop=round(attention / 1e9, 1),
                      rounds_ms={key: [round(t, 3) for t in v] for key, v in times.items()})
        records.append(record)
        print(json.dumps(record), flush=True)

    env = dict(date=datetime.date.today().isoformat(), gpu=cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
               driver=cupy.cuda.runtime.driverGetVersion(), cupy=cupy.__version__, sustain_s=args.sustain_s,
               cublas_peak_burst_tflops=round(peak.burst, 1), cublas_peak_sustained_tflops=round(peak.sustained, 1))
    lines = [f"{env['date']}, {env['gpu']}, driver {env['driver']}, cupy {env['cupy']}; cuBLAS bf16 8192^3 peak "
             f"{env['cublas_peak_burst_tflops']} TFLOP/s in a burst, {env['cublas_peak_sustained_tflops']} "
             f"sustained; every timing after {args.sustain_s} s of back-to-back replays", "",
             "| case | ours ms (TFLOP/s) | GEMMs alone ms (TFLOP/s) | GEMMs' share of FLOPs | GEMMs' share of our time "
             "| ours minus GEMMs, ms: the attention (its GFLOP) and every norm, RoPE, SwiGLU and conversion pass |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['case']} | {r['ours_ms']:.2f} ({r['ours_tflops']:.0f}) | {r['gemms_ms']:.2f} "
                     f"({r['gemms_tflops']:.0f}) | {100 * r['gemm_share_of_flops']:.0f}% | "
                     f"{100 * r['gemms_ms'] / r['ours_ms']:.0f}% | {r['rest_ms']:.2f} (attention {r['attention_gflop']:.0f}) |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(env=env, records=records), indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
