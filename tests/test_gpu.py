"""The CuPy engine on a real GPU (marked `gpu`; skipped where there is none).

Accuracy is held to a derived bound, not a constant (flash-attention's "k x a same-precision
baseline"): the engine's relative Frobenius error against the float32 NumPy reference may be at
most BASELINE_FACTOR x the error of the same reference with every GEMM's activation operand
rounded to BF16 (`NumpyTower(gemm_inputs=bf16_round)`: the engine's precision, float32 residual
and accumulation), on the same weights and inputs. Both kernel sets run (KERNEL_SETS): the
Hopper ones and the generic ones every other GPU runs, forced on the H200 with kernels="generic".
Kernel-against-kernel checks (flash vs naive, fused vs cuBLAS) keep ERROR_FACTOR x the error of
the path they replace or of transformers' bf16 tower.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from glmvit_cupy import GlmVit, GlmVitError, load_geometry, preprocess
from glmvit_cupy.bf16 import bf16_round, bf16_to_f32, f32_to_bf16_bits
from glmvit_cupy.gpu.benchmark import forward_flops
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry
from glmvit_cupy.tower.reference import NumpyTower
from glmvit_cupy.tower.synthetic import write_checkpoint
from glmvit_cupy.tower.weights import parameter_count
from helpers import (KERNEL_SETS, available_kernel_sets, photo_like, rel_err, run_transformers, skip_unless_available,
                     sm90, transformers_tower)

pytestmark = pytest.mark.gpu
ERROR_FACTOR = 1.25
# Derived from the last H200 figures (BENCHMARKS.md "Accuracy in the same run": ours against the
# float32 reference, last_hidden 5.5e-3 to 6.0e-3, pooler 9.6e-3 to 1.01e-2) over the BF16-input
# baseline on the same checkpoint and cases (measured on the CPU: last_hidden 4.6e-3, 5.0e-3 and
# 5.0e-3 at 448, 1036 and batch3; pooler 8.0e-3, 8.3e-3 and 8.4e-3): 1.10x to 1.30x, the engine's extra roundings (the QKV and gate|up products stored in
# BF16, the flash kernel's BF16 P). 1.5 leaves 15% over the worst ratio; transformers' bf16 tower,
# which keeps a BF16 residual, is at ~2.9x.
BASELINE_FACTOR = 1.5

# Photo-like inputs at the real geometry: one 448x448, one 1036x1036, a batch of three sizes.
CASES = {
    "448": [(448, 448)],
    "1036": [(1036, 1036)],
    "batch3": [(448, 336), (700, 520), (224, 896)],
}


@pytest.fixture(scope="module")
def inputs():
    out = {}
    for name, sizes in CASES.items():
        out[name] = preprocess([photo_like(h, w, seed=i + len(name)) for i, (h, w) in enumerate(sizes)])
    return out


@pytest.fixture(scope="module")
def references(real_ckpt, inputs):
    """Per case: the float32 NumPy reference, the same-precision baseline (BF16 GEMM inputs) and
    transformers bf16 (sdpa, on the GPU; printed for comparison with BENCHMARKS.md)."""
    ref = GlmVit.from_pretrained(real_ckpt, backend="numpy")
    baseline = NumpyTower(bind_checkpoint(real_ckpt), ref.p_max, gemm_inputs=bf16_round)
    model = transformers_tower(real_ckpt, dtype="bfloat16", device="cuda")
    out = {}
    for name, (pixels, grid) in inputs.items():
        r = ref.forward(pixels, grid)
        out[name] = ((r.last_hidden_state, r.pooler_output), baseline.forward(pixels, grid),
                     run_transformers(model, pixels, grid))
    del model
    return out


@pytest.fixture(scope="module")
def engine(real_ckpt):
    """engine(kernels, attention): one GlmVit each, made on first use (skips 'hopper' off sm_90)."""
    made = {}

    def get(kernels: str, attention: str = "flash") -> GlmVit:
        skip_unless_available(kernels)
        if (kernels, attention) not in made:
            made[kernels, attention] = GlmVit.from_pretrained(real_ckpt, backend="cupy", attention=attention,
                                                              kernels=kernels)
        return made[kernels, attention]
    return get


@pytest.fixture(scope="module")
def vit(engine):
    """The engine as `auto` makes it on this GPU."""
    return engine("hopper" if sm90() else "generic")


@pytest.fixture(scope="module")
def naive_vit(engine):
    return engine("hopper" if sm90() else "generic", "naive")


def poison(vit) -> None:
    """Fill every scratch slab with 0xFF (NaN in float32 and BF16) before a run; not the cuBLAS
    workspace, nor the index slab, where the engine keeps the tables it uploads once per grid."""
    for name, slab in vit.tower._scratch().slabs.items():
        if name not in ("workspace", "index"):
            slab.fill(255)


def to_np(x):
    return x.get()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attention", ["flash", "naive"])
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_accuracy_against_the_float32_reference(inputs, references, case, attention, kernels, engine,
                                                record_property):
    vit = engine(kernels, attention)
    assert vit.tower.k.hopper == (kernels == "hopper") and vit.tower.fused_mlp == (kernels == "hopper")
    pixels, grid = inputs[case]
    poison(vit)
    out = vit.forward(pixels, grid)
    (ref_lh, ref_pool), (base_lh, base_pool), (hf_lh, hf_pool) = references[case]
    for name, got, ref, base, hf in (("last_hidden_state", out.last_hidden_state, ref_lh, base_lh, hf_lh),
                                     ("pooler_output", out.pooler_output, ref_pool, base_pool, hf_pool)):
        got = to_np(got)
        assert got.dtype == np.float32 and got.shape == ref.shape
        assert np.isfinite(got).all(), f"{name}: NaN/Inf (an element not written?)"
        ours, floor, theirs = rel_err(got, ref), rel_err(base, ref), rel_err(hf, ref)
        record_property(f"{case}-{attention}-{kernels}-{name}",
                        f"ours {ours:.3e} bf16-input baseline {floor:.3e} transformers-bf16 {theirs:.3e}")
        print(f"{case} {attention} {kernels} {name}: ours {ours:.3e} = {ours / floor:.2f}x the bf16-input "
              f"baseline {floor:.3e} (bound {BASELINE_FACTOR}x); transformers bf16 {theirs:.3e}")
        assert ours <= BASELINE_FACTOR * floor, (name, ours, floor, ours / floor)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_eager_captured_and_replayed_forwards_are_bit_identical(real_ckpt, kernels, inputs):
    """A fresh engine (so the first call is eager whatever ran before): call 1 runs eagerly,
    call 2 captures a CUDA graph and launches it, call 3 replays that graph; all three give the
    same bits, with the scratch poisoned before each. Then the same images in another order give
    every image's rows bit for bit, and the first grid's graph replays with its tables uploaded
    again."""
    skip_unless_available(kernels)
    vit = GlmVit.from_pretrained(real_ckpt, backend="cupy", kernels=kernels)
    graphs = vit.tower.graphs
    pixels, grid = inputs["batch3"]
    runs = []
    for kind in ("eager", "captured", "replayed"):
        poison(vit)
        runs.append(vit.forward(pixels, grid))
        assert len(graphs) == (0 if kind == "eager" else 1), (kind, len(graphs))
        if kind == "captured":
            graph = next(iter(graphs.values()))
        if kind == "replayed":
            assert next(iter(graphs.values())) is graph  # replayed, not captured again
    for kind, r in zip(("captured", "replayed"), runs[1:]):
        for name in ("pooler_output", "last_hidden_state"):
            a, b = to_np(getattr(r, name)), to_np(getattr(runs[0], name))
            assert np.array_equal(a, b), (f"{kind} differs from eager in {name}: {np.sum(a != b)} of {a.size} "
                                          f"elements, max |diff| {np.nanmax(np.abs(a - b))}")
    # The same images in another order: every image's rows are bit-identical.
    parts = runs[0].split()
    order = [2, 0, 1]
    offsets = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
    shuffled = np.concatenate([pixels[offsets[i]:offsets[i + 1]] for i in order])
    other = vit.forward(shuffled, grid[order]).split()
    for new_pos, old in enumerate(order):
        assert np.array_equal(to_np(other[new_pos].pooler_output), to_np(parts[old].pooler_output)), old
        assert np.array_equal(to_np(other[new_pos].last_hidden_state), to_np(parts[old].last_hidden_state)), old
    # Back to the first grid: its graph replays with its own tables uploaded again.
    poison(vit)
    again = vit.forward(pixels, grid)
    assert len(graphs) == 1 and next(iter(graphs.values())) is graph  # the shuffled grid ran eagerly
    assert np.array_equal(to_np(again.pooler_output), to_np(runs[0].pooler_output))


def test_flash_equals_naive_attention_kernel_at_long_segments(engine, naive_vit):
    """The attention kernels alone at the real head count and dim, one segment of 1024, 5476,
    21316 and 32000 tokens and a multi-segment batch: each flash kernel (mma.sync, and on sm_90
    wgmma in every query tile it comes in, past 1024 with its last round in pieces) vs the
    materialised path, both against a float32 reference on 256 sampled query rows per head."""
    import cupy

    from glmvit_cupy.gpu.flash import flash_work_list
    towers = {kernels: engine(kernels).tower for kernels in available_kernel_sets()}
    geo = naive_vit.tower.geo
    h, hd, heads = geo.hidden_size, geo.head_dim, geo.num_heads
    rng = np.random.default_rng(0)
    for lengths in ([1024], [5476], [21316], [32000], [1024, 700, 4096, 64, 5476]):
        p = sum(lengths)
        segments = np.stack([np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths], axis=-1)
        qkv = cupy.asarray(rng.standard_normal((p, 3 * h), dtype=np.float32) * 1.5).astype(cupy.float32)
        qkv_bf16 = f32_to_bf16_bits(qkv)
        # Our own work lists and TMA descriptors, not the scratch's: the engine keeps its tables there
        # between calls.
        works = {}
        for kernels, tower in towers.items():
            qkv_map = cupy.asarray(tower.k.qkv_map(qkv_bf16)) if tower.k.hopper else None
            for bm in tower.k.flash_bms:
                works[f"{kernels} flash bm {bm}"] = (tower, qkv_map,
                                                     flash_work_list(segments, bm, heads, tower.k.flash_slots(bm)))
        works["naive"] = (naive_vit.tower, None, flash_work_list(segments, 64, heads))
        if len(lengths) == 1 and lengths[0] > 5000 and "hopper" in towers:
            assert all(w.pieces >= 2 for name, (_, _, w) in works.items() if name.startswith("hopper")), lengths
        outs = {}
        for name, (tower, qkv_map, work) in works.items():
            out = outs[name] = cupy.full((p, h), 0xFFFF, dtype=cupy.uint16)  # NaN: unwritten rows show
            tiles = cupy.asarray(work.tiles)
            tower._scratch()
            cupy.cuda.runtime.deviceSynchronize()
            with tower.stream:
                tower._attention(qkv_bf16, qkv_map, out, segments, tiles, work)
            tower.stream.synchronize()
            assert not tower.scratch.piece_counters.any(), (lengths, name)  # left at zero for the next launch
        q32 = bf16_to_f32(qkv_bf16)
        errs = {name: [] for name in outs}
        for start, length in segments.tolist():
            rows = rng.choice(length, size=min(256, length), replace=False) + start
            for head in range(heads):
                q = q32[rows, head * hd:(head + 1) * hd]
                k = q32[start:start + length, h + head * hd:h + (head + 1) * hd]
                v = q32[start:start + length, 2 * h + head * hd:2 * h + (head + 1) * hd]
                sc = (q @ k.T) * hd ** -0.5
                pr = cupy.exp(sc - sc.max(axis=1, keepdims=True))
                ref = (pr / pr.sum(axis=1, keepdims=True)) @ v
                for name, arr in outs.items():
                    got = bf16_to_f32(arr[rows, head * hd:(head + 1) * hd])
                    errs[name].append(float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref)))
        n = max(errs.pop("naive"))
        for name, e in errs.items():
            assert bool(cupy.isfinite(bf16_to_f32(outs[name])).all()), (lengths, name)
            print(f"attention {lengths}: {name} {max(e):.2e}, naive {n:.2e}")
            assert max(e) <= ERROR_FACTOR * n, (lengths, name, max(e), n)


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_flash_tile_is_the_widest_that_gives_every_sm_a_cta(engine, kernels):
    """Kernels.flash_bm: 448x448 keeps 64-query tiles (4 warpgroups would leave half the H200's
    132 SMs idle); 1036x1036, 2044x2044 and batches of 448x448 take the widest. The mma.sync
    kernel comes in one tile and takes no pieces."""
    k, heads = engine(kernels).tower.k, engine(kernels).tower.geo.num_heads
    if kernels == "generic":
        assert k.flash_bms == (128,) and k.flash_slots(128) == 0
    for lengths in ([1024], [5476], [21316], [1024] * 8, [1850, 1024, 1152], [64], [100000]):
        bm = k.flash_bm(lengths, heads)
        ctas = {b: sum(-(-n // b) for n in lengths) * heads for b in k.flash_bms}
        assert bm in k.flash_bms and (ctas[bm] >= k._sms or bm == min(k.flash_bms)), (lengths, bm)
        assert all(ctas[b] < k._sms for b in k.flash_bms if b > bm), (lengths, bm)
    if k.hopper and k._sms == 132:
        assert [k.flash_bm(n, heads) for n in ([1024], [5476], [21316], [1024] * 8)] == [64, 256, 256, 256]
        # CTAs a round, from the driver's occupancy: what tests/test_scratch.py's work lists assume
        assert {bm: k.flash_slots(bm) for bm in k.flash_bms} == {256: 132, 128: 264, 64: 528}


def test_fused_gate_up_swiglu_equals_cublas_then_swiglu(vit):
    """gemm_swiglu_sm90 (Hopper's fused gate|up GEMM + clamped SwiGLU) against the path it
    replaces, cuBLAS + swiglu_clamp, both against float32: at the block's shape (K 1024, inter
    4096, with bias) and the merger's (4096, 10240, none), row counts off the 128-row tile and
    chunks that start past row 0. Gate and up reach past the clamp (|v| > 10 for ~1%)."""
    import cupy

    tower = vit.tower
    k, limit = tower.k, tower.geo.swiglu_limit
    if not k.hopper:
        pytest.skip("the fused gate|up kernel is sm_90a only")
    rng = np.random.default_rng(1)

    def bf16(shape, scale):
        return f32_to_bf16_bits(cupy.asarray(rng.standard_normal(shape, dtype=np.float32) * scale))

    for depth, inter, with_bias in ((1024, 4096, True), (4096, 10240, False)):
        x_all = bf16((3000, depth), 1.0)
        w = bf16((2 * inter, depth), 4 * depth ** -0.5)
        bias = bf16((2 * inter,), 1.0) if with_bias else None
        x_map, w_map = cupy.asarray(k.gate_up_map(x_all)), cupy.asarray(k.gate_up_map(w))
        for row0, rows in ((0, 1), (0, 200), (1000, 2000), (2900, 100)):
            x = x_all[row0:row0 + rows]
            pre = bf16_to_f32(x) @ bf16_to_f32(w).T + (bf16_to_f32(bias) if with_bias else 0)
            g, u = pre[:, :inter], pre[:, inter:]
            g = cupy.minimum(g, limit)
            want = g / (1 + cupy.exp(-g)) * cupy.clip(u, -limit, limit)
            fused = cupy.full((rows + 3, 2 * inter), 0xFFFF, dtype=cupy.uint16)  # NaN: writes outside show
            unfused = cupy.empty((rows, 2 * inter), dtype=cupy.uint16)
            cupy.cuda.runtime.deviceSynchronize()  # the engine's stream does not wait on the default one
            with tower.stream:
                k.gemm_swiglu(x_map, w_map, bias, fused[:rows, :inter], row0, depth, limit)
                tower.blas.linear(unfused, x, w)
                k.swiglu_clamp(unfused, bias, limit)
            tower.stream.synchronize()
            got = bf16_to_f32(fused)
            assert bool(cupy.isnan(got[:, inter:]).all() and cupy.isnan(got[rows:]).all()), (depth, row0, rows)
            err_f = rel_err(cupy.asnumpy(got[:rows, :inter]), cupy.asnumpy(want))
            err_c = rel_err(cupy.asnumpy(bf16_to_f32(unfused[:, :inter])), cupy.asnumpy(want))
            print(f"gate|up+swiglu K {depth} rows {row0}+{rows}: fused {err_f:.2e}, cuBLAS + swiglu {err_c:.2e}")
            assert err_f <= ERROR_FACTOR * err_c, (depth, row0, rows, err_f, err_c)


def test_flash_equals_naive_forward_on_large_images(real_ckpt, engine, naive_vit):
    """Whole forward, flash (each kernel set) vs naive, at 21316 patches (2044x2044) and the ~32k
    budget maximum (no float32 reference is affordable there): flash may differ from the naive
    path by at most ERROR_FACTOR x what transformers' bf16 tower differs from it."""
    model = transformers_tower(real_ckpt, dtype="bfloat16", device="cuda")
    for size in ((2044, 2044), (3000, 2500)):
        pixels, grid = preprocess(photo_like(*size, seed=size[0]))
        b = naive_vit.forward(pixels, grid)
        hf = run_transformers(model, pixels, grid)
        for kernels in available_kernel_sets():
            a = engine(kernels).forward(pixels, grid)
            for i, name in enumerate(("last_hidden_state", "pooler_output")):
                x, y = to_np(getattr(a, name)), to_np(getattr(b, name))
                assert np.isfinite(x).all(), (kernels, name)
                print(f"{size} {len(pixels)} patches, {kernels} {name}: flash vs naive {rel_err(x, y):.2e}, "
                      f"transformers bf16 vs naive {rel_err(hf[i], y):.2e}")
                assert rel_err(x, y) <= ERROR_FACTOR * rel_err(hf[i], y), (kernels, name)


def test_scratch_is_lazy_sized_and_refuses_too_large_inputs(real_ckpt):
    import cupy

    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    vit = GlmVit.from_pretrained(real_ckpt, backend="cupy", max_pixels=448 * 448)
    loaded = pool.used_bytes() - before
    assert vit.tower.scratch is None  # nothing allocated at load
    assert loaded < 1.06 * parameter_count(vit.geometry) * 2  # the BF16 weights, no float32 copy
    assert vit.scratch_bytes == vit.tower.plan.total_bytes
    pixels, grid = preprocess(photo_like(448, 448))
    vit.forward(pixels, grid)
    assert pool.used_bytes() - before - loaded >= vit.scratch_bytes
    big, big_grid = preprocess(photo_like(600, 600))
    with pytest.raises(GlmVitError, match=r"^this forward call: \d+ patches exceed p_max 1024 .*--max-pixels"):
        vit.forward(big, big_grid)
    default = GlmVit.from_pretrained(real_ckpt, backend="cupy")
    assert default.p_max == 32000
    assert default.scratch_bytes / 2 ** 20 < 510  # under half transformers' 1019 MiB at 2044x2044


def test_a_fresh_process_binds_the_tower(real_ckpt):
    """Process start to a bound real tower, with the page cache and kernel cache warm: printed,
    not asserted (a wall-clock bound would fail on a busy machine, not on a regression)."""
    code = ("import time; t = time.perf_counter(); from glmvit_cupy import GlmVit; "
            f"v = GlmVit.from_pretrained({str(real_ckpt)!r}, backend='cupy'); print(time.perf_counter() - t)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)  # warm both caches
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    print(f"ready in {elapsed:.2f} s (in-process {float(proc.stdout):.2f} s)")


def test_cli_auto_uses_the_gpu(tmp_path, real_ckpt):
    from PIL import Image

    Image.fromarray(photo_like(300, 400, 1)).save(tmp_path / "a.png")
    proc = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "encode", str(tmp_path / "a.png"),
                           "--model", str(real_ckpt), "--out", str(tmp_path / "a.npy")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "backend cupy" in proc.stderr
    emb = np.load(tmp_path / "a.npy")
    pixels, grid = preprocess(tmp_path / "a.png")
    assert emb.shape == (grid.prod() // 4, 4096) and np.isfinite(emb).all()


def test_cli_bench_reports_time_flops_peaks_and_stages(real_ckpt):
    """`glmvit-cupy bench`: its TFLOP/s is the FLOP count over its own median, its percentages
    are of the two cuBLAS peaks it printed, and every stage of the forward has a time."""
    proc = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "bench", "--model", str(real_ckpt),
                           "--image-size", "448", "--batch", "2", "--iters", "5"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout.strip())
    burst, sustained = map(float, re.search(r"peak (\d+) TFLOP/s in a burst, (\d+) sustained", proc.stdout).groups())
    line = re.search(r"2 x 448x448 \((\d+) patches\): ([\d.]+) ms, (\d+) TFLOP/s \((\d+)% / (\d+)% .*"
                     r"eager stages ms: (.*)", proc.stdout)
    patches, ms, tflops, pct_burst, pct_sustained = (float(x) for x in line.groups()[:5])
    flops = forward_flops(load_geometry(real_ckpt), np.array([[1, 32, 32]] * 2))
    assert patches == 2048 and abs(tflops - flops / ms / 1e9) <= 0.01 * tflops + 1
    assert abs(pct_burst - 100 * tflops / burst) <= 1 and abs(pct_sustained - 100 * tflops / sustained) <= 1
    stages = dict(item.split(" ") for item in line.group(6).split(", "))
    assert list(stages) == ["patch_embed", "attention_sublayer", "mlp_sublayer", "merger"]
    assert all(float(v) > 0 for v in stages.values())


@pytest.mark.parametrize("hidden, heads", [(128, 2), (128, 4), (256, 2), (96, 3), (128, 8), (256, 1)])
def test_small_geometry_runs_too(tmp_path, hidden, heads):
    """Non-real geometries (head_dim 64, 32, 128, 16, 256: every one README promises, the
    engine's QKNORM_HEAD_DIMS) through both kernel sets; flash only at 64.
    Held to transformers' error, as the BF16-input baseline's ratio was measured only at the
    real geometry. Hidden 96 is not a whole number of the fused gate|up kernel's 64-wide K tiles: its MLPs
    take the cuBLAS + swiglu_clamp path on Hopper too."""
    geo = dataclasses.replace(GlmVitGeometry(**REAL), depth=2, hidden_size=hidden, num_heads=heads,
                              intermediate_size=256, out_hidden_size=256, projection_intermediate_size=512)
    ckpt = write_checkpoint(tmp_path / "t", geo, seed=3)
    pixels, grid = preprocess([photo_like(200, 120, 1), photo_like(60, 90, 2)])
    video = np.random.default_rng(5).standard_normal((2 * 4 * 6, 1176)).astype(np.float32)
    pixels, grid = np.concatenate([pixels, video]), np.concatenate([grid, [[2, 4, 6]]])
    ref = GlmVit.from_pretrained(ckpt, backend="numpy").forward(pixels, grid)
    hf = run_transformers(transformers_tower(ckpt, dtype="bfloat16", device="cuda"), pixels, grid)
    for kernels in available_kernel_sets():
        for attention in ("flash", "naive") if geo.head_dim == 64 else ("naive",):
            vit = GlmVit.from_pretrained(ckpt, backend="cupy", attention=attention, kernels=kernels)
            assert vit.tower.fused_mlp == (kernels == "hopper" and hidden % 64 == 0)
            out = vit.forward(pixels, grid)
            for got, want, base in ((out.last_hidden_state, ref.last_hidden_state, hf[0]),
                                    (out.pooler_output, ref.pooler_output, hf[1])):
                ours, theirs = rel_err(to_np(got), want), rel_err(base, want)
                assert ours <= ERROR_FACTOR * theirs, (kernels, attention, ours, theirs)
