"""The floor under each benchmark case: the forward's GEMMs alone, through cuBLAS, on a
power-capped GPU.

An H200 holds tensor-core work at its 700 W cap by lowering the SM clock (1.98 GHz in a
burst, 1.5-1.6 GHz under sustained load), so a cuBLAS peak measured in a burst overstates
what any engine keeps up for a whole forward. This script measures, in one process:
- the cuBLAS BF16 8192^3 peak, in a burst and sustained (benchmark.cublas_peak);
- per case, every GEMM of the forward (patch embed; per block qkv, proj, gate|up, down; the
  merger's downsample, proj, gate|up, down) through cuBLAS alone, in forward order, on the
  engine's own weights and on operands taken from a real forward of that case, captured as
  one CUDA graph; and our whole forward. Each is replayed back-to-back for --sustain-s
  before its CUDA-event timings (benchmark.sustained_ms), in alternating order over rounds.
Our time minus the GEMMs' is what attention, norms and RoPE cost at best (our gate|up is a
fused GEMM + SwiGLU; here it is cuBLAS's plain GEMM), and the GEMMs' time is a floor no
engine built on cuBLAS-class GEMMs goes under.

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

from glmvit_cupy import GlmVit
from glmvit_cupy.benchmark import attention_flops, cublas_peak, forward_flops, sustained_ms

CASES = {"448": [[1, 32, 32]], "1036": [[1, 74, 74]], "2044": [[1, 146, 146]], "8x448": [[1, 32, 32]] * 8,
         "32x448": [[1, 32, 32]] * 32}


def gemm_graph(tower, p: int) -> tuple[cupy.cuda.graph.Graph, list[cupy.ndarray]]:
    """The forward's GEMMs for p patches as one graph on the tower's stream, and the buffers it
    reads and writes (kept alive by the caller). Call after a forward of p patches:
    its scratch holds the operands (normalised rows, the merger's inputs)."""
    geo, s, k, blas, w = tower.geo, tower.scratch, tower.k, tower.blas, tower.w
    h, inter, o, pi = geo.hidden_size, geo.intermediate_size, geo.out_hidden_size, geo.projection_intermediate_size
    m = p // geo.merge_unit
    bf16 = cupy.uint16
    with tower.stream:
        pixels = cupy.empty((p, geo.patch_dim), bf16)
        k.f32_to_bf16(cupy.random.default_rng(0).standard_normal((p, geo.patch_dim), dtype=cupy.float32), pixels)
        x, merge_a, merge_in, merge_y = (a.copy() for a in (s.normed[:p], s.merge_a[:m], s.last_hidden_bf16[:m],
                                                            s.merge_y[:m]))
        resid, qkv = cupy.zeros((p, h), cupy.float32), cupy.empty((p, 3 * h), bf16)
        gate_up, merge_gate_up = cupy.empty((p, 2 * inter), bf16), cupy.empty((m, 2 * pi), bf16)
        last_hidden, pooler = cupy.empty((m, o), cupy.float32), cupy.empty((m, o), cupy.float32)
        # act operands as the forward makes them: a SwiGLU of this gate|up product
        blas.linear(gate_up, x, w.blocks[-1].gate_up_w)
        k.swiglu_clamp(gate_up, w.blocks[-1].gate_up_b, geo.swiglu_limit)
        act = gate_up[:, :inter].copy()
        blas.linear(merge_gate_up, merge_y, w.merger.gate_up_w)
        k.swiglu_clamp(merge_gate_up, None, geo.swiglu_limit)
        merge_act = merge_gate_up[:, :pi].copy()
        tower.stream.begin_capture()
        blas.linear(resid, pixels, w.patch_embed_w)
        for blk in w.blocks:
            blas.linear(qkv, x, blk.qkv_w)
            blas.linear(resid, x, blk.proj_w, accumulate=True)
            blas.linear(gate_up, x, blk.gate_up_w)
            blas.linear(resid, act, blk.down_w, accumulate=True)
        blas.linear(last_hidden, merge_a, w.merger.downsample_w)
        blas.linear(pooler, merge_in, w.merger.proj_w)
        blas.linear(merge_gate_up, merge_y, w.merger.gate_up_w)
        blas.linear(pooler, merge_act, w.merger.down_w)
        graph = tower.stream.end_capture()
    return graph, [pixels, x, merge_a, merge_in, merge_y, resid, qkv, gate_up, merge_gate_up, last_hidden, pooler,
                   act, merge_act]


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
        grid = np.array(CASES[name], dtype=np.int64)
        p = int(grid.prod(axis=1).sum())
        pixels = cupy.asarray(np.random.default_rng(0).standard_normal((p, 1176), dtype=np.float32))
        for _ in range(3):  # eager, capture, replay
            tower.forward(pixels, grid)
        graph, _keep = gemm_graph(tower, p)
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
                      rest_gflop=round(attention / 1e9, 1),
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
             "| ours minus GEMMs: ms for the attention's GFLOP |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r['case']} | {r['ours_ms']:.2f} ({r['ours_tflops']:.0f}) | {r['gemms_ms']:.2f} "
                     f"({r['gemms_tflops']:.0f}) | {100 * r['gemm_share_of_flops']:.0f}% | "
                     f"{100 * r['gemms_ms'] / r['ours_ms']:.0f}% | {r['rest_ms']:.2f} for {r['rest_gflop']:.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(env=env, records=records), indent=1) + "\n")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
