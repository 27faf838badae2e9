"""Measuring the GPU engine: FLOP counts, CUDA-event timings, cuBLAS ceilings, stage times.

Used by `glmvit-cupy bench` (our engine alone), benchmarks/compare_transformers.py (both
engines in one process) and benchmarks/gemm_floor.py (the forward's GEMMs alone). Timings
are medians of CUDA-event intervals after warm-up, around `forward` on inputs already on the
device (preprocessing and the pixel upload excluded).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from ..tower.geometry import GlmVitGeometry
from ..tower.layout import frame_segments


def attention_flops(geo: GlmVitGeometry, grid_thw: np.ndarray) -> float:
    """Multiply-adds x 2 of every block's QK^T and PV (each segment attends within itself)."""
    return geo.depth * 4.0 * geo.hidden_size * float((frame_segments(grid_thw)[:, 1].astype(np.float64) ** 2).sum())


def forward_flops(geo: GlmVitGeometry, grid_thw: np.ndarray) -> float:
    """Multiply-adds x 2 of one forward, with the exact segments: the attention, and the GEMMs
    (patch embed, the blocks' linears, the merger's); tests/test_flops.py holds it to the
    matmuls the NumPy reference runs."""
    p = float(np.prod(grid_thw, axis=1).sum())
    m = p / geo.merge_unit
    h, i, o, pi = geo.hidden_size, geo.intermediate_size, geo.out_hidden_size, geo.projection_intermediate_size
    gemms = geo.depth * p * (8 * h * h + 6 * h * i) + 2 * p * geo.patch_dim * h \
        + 2 * m * geo.merge_unit * h * o + 2 * m * (o * o + 3 * o * pi)
    return gemms + attention_flops(geo, grid_thw)


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


def sustained_ms(run: Callable[[], object], stream, seconds: float, iters: int = 20) -> float:
    """median_ms after `seconds` of back-to-back calls, at the clock the board's power cap holds
    under that load, below the one a short burst runs at (benchmarks/NOTES.md)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        run()
        stream.synchronize()
    return median_ms(run, stream, warmup=0, iters=iters)


@dataclasses.dataclass
class CublasPeak:
    """TFLOP/s of a BF16 n^3 GEMM (FP32 accumulate) through the engine's cuBLAS wrapper."""

    burst: float  # 20 GEMMs after 5 warm-ups: what the GPU gives before its power cap engages
    sustained: float  # 20 more after `seconds` of back-to-back GEMMs: what it keeps up


def cublas_peak(n: int = 8192, seconds: float = 3.0) -> CublasPeak:
    """The ceilings an engine's TFLOP/s is a percentage of (see CublasPeak)."""
    import cupy

    from ..bf16 import f32_to_bf16_bits
    from .cublas import Cublas

    stream = cupy.cuda.Stream(non_blocking=True)
    blas = Cublas(stream)
    with stream:
        workspace = cupy.empty(32 << 20, dtype=cupy.uint8)
        blas.set_workspace(workspace)
        rng = cupy.random.default_rng(0)
        a, b = (f32_to_bf16_bits(rng.standard_normal((n, n), dtype=cupy.float32)) for _ in range(2))
        c = cupy.empty((n, n), dtype=cupy.uint16)

    def gemm() -> None:
        blas.linear(c, a, b)

    burst = median_ms(gemm, stream, warmup=5, iters=20)
    sustained = sustained_ms(gemm, stream, seconds)
    return CublasPeak(2.0 * n ** 3 / burst / 1e9, 2.0 * n ** 3 / sustained / 1e9)


@dataclasses.dataclass
class EngineTiming:
    first_call_ms: float  # a new shape, cold: eager, host tables built (and the scratch on the very first image)
    median_ms: float  # after warm-up: the captured graph replayed
    tflops: float
    # eager run with an event after every stage, summed per stage over the blocks: patch_embed (and
    # the RoPE tables), attention_sublayer (norm1 through the proj GEMM), mlp_sublayer (norm2
    # through the down GEMM), merger
    stages_ms: dict[str, float]


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
