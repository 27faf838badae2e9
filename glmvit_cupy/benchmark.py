"""Measuring the GPU engine: FLOP counts, CUDA-event timings, a cuBLAS ceiling, stage times.

Used by `glmvit-cupy bench` (our engine alone) and benchmarks/compare_transformers.py (both
engines in one process). Timings are medians of CUDA-event intervals after warm-up, around
`forward` on inputs already on the device (preprocessing and the pixel upload excluded).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from .geometry import GlmVitGeometry
from .layout import frame_segments


def forward_flops(geo: GlmVitGeometry, grid_thw: np.ndarray) -> float:
    """Multiply-adds x 2 of one forward (SPEC.md's cost model, with the exact segments)."""
    p = float(np.prod(grid_thw, axis=1).sum())
    m = p / geo.merge_unit
    h, i, o, pi = geo.hidden_size, geo.intermediate_size, geo.out_hidden_size, geo.projection_intermediate_size
    attn = 4.0 * h * float((frame_segments(grid_thw)[:, 1].astype(np.float64) ** 2).sum())
    blocks = geo.depth * (p * (8 * h * h + 6 * h * i) + attn)
    return blocks + 2 * p * geo.patch_dim * h + 2 * m * geo.merge_unit * h * o + 2 * m * (o * o + 3 * o * pi)


def median_ms(run: Callable[[], object], stream, warmup: int = 3, iters: int = 20) -> float:
    """Median CUDA-event time of `run()` on `stream`, after `warmup` untimed calls."""
    import cupy

    for _ in range(warmup):
        run()
    times = []
    for _ in range(iters):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        run()
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def cublas_peak_tflops(n: int = 8192) -> float:
    """The ceiling: a BF16 n^3 GEMM (FP32 accumulate) through the engine's cuBLAS wrapper."""
    import cupy

    from .cublas import Cublas

    stream = cupy.cuda.Stream(non_blocking=True)
    blas = Cublas(stream)
    with stream:
        workspace = cupy.empty(32 << 20, dtype=cupy.uint8)
        blas.set_workspace(workspace)
        rng = cupy.random.default_rng(0)
        a = (rng.standard_normal((n, n), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
        b = (rng.standard_normal((n, n), dtype=cupy.float32).view(cupy.uint32) >> 16).astype(cupy.uint16)
        c = cupy.empty((n, n), dtype=cupy.uint16)
    ms = median_ms(lambda: blas.linear(c, a, b), stream, warmup=5, iters=20)
    return 2.0 * n ** 3 / ms / 1e9


@dataclasses.dataclass
class EngineTiming:
    first_call_ms: float  # warm-up: a new shape (scratch on the very first image, eager run)
    median_ms: float  # after warm-up: the captured graph replayed
    tflops: float
    stages_ms: dict[str, float]  # eager run with an event after every stage, summed per stage


def time_engine(vit, pixels, grid_thw: np.ndarray, iters: int = 20) -> EngineTiming:
    """Time GlmVit(backend="cupy").forward on device-resident pixels."""
    import cupy

    tower = vit.tower
    stream = tower.stream
    t0 = time.perf_counter()
    vit.forward(pixels, grid_thw)
    first = (time.perf_counter() - t0) * 1e3
    ms = median_ms(lambda: vit.forward(pixels, grid_thw), stream, warmup=3, iters=iters)

    events: list[tuple[str, object]] = []

    def mark(stage: str) -> None:
        event = cupy.cuda.Event()
        event.record(stream)
        events.append((stage, event))

    stages: dict[str, float] = {}
    start = cupy.cuda.Event()
    start.record(stream)
    tower.forward(pixels, grid_thw, marks=mark)
    previous = start
    for stage, event in events:
        stages[stage] = stages.get(stage, 0.0) + cupy.cuda.get_elapsed_time(previous, event)
        previous = event
    return EngineTiming(first, ms, forward_flops(vit.geometry, grid_thw) / ms / 1e9, stages)
