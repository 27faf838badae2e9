"""Each kernel entry point alone against the NumPy reference (llm.c's dev/cuda checks), on fresh
random inputs: shapes off every tile and block size, element by element with `assert_close`.

The tests marked `gpu` launch through `glmvit_cupy.gpu.kernels.Kernels` on CuPy's current stream.
Tolerances are derived, not tuned (references in float64 where the kernel's own float32 sums
are what is measured):
- BF16 outputs: rounding to nearest is off by at most U / (1 + U) of the value, U = 2^-8 (8
  significant bits). Before it, the kernel's float32 value differs from the reference by F32
  = 2^-18 of its magnitude at most: 32 float32 ulps, more than its roundings in sequence (a row
  sum over 4104 values is a run of 16 adds, a warp tree of 5 and a block sum of 8), rsqrtf's 2
  ulps and __expf's 2 + 1.2|x|. So rtol = U + F32, atol F32 for O(1) values, or F32 times the
  terms' magnitudes where a sum of them can cancel (the RoPE rotation).
- Pure data movement and single IEEE operations (im2col, conversions, the bias add) are exact:
  bit for bit.
- Attention and the fused GEMM get per-element bounds written out at their tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from glmvit_cupy.bf16 import bf16_to_f32, f32_to_bf16_bits
from glmvit_cupy.gpu.flash import flash_work_list
from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry
from glmvit_cupy.tower.layout import block_major_positions, rope_inv_freq
from glmvit_cupy.tower.reference import (LAYERNORM_EPS, gelu_erf, im2col_2x2, layernorm, qknorm_rope, rmsnorm,
                                         rope_tables, segment_attention, silu, swiglu_clamp)
from helpers import KERNEL_SETS, assert_close, skip_unless_available

gpu = pytest.mark.gpu
U = 2.0 ** -8  # BF16's unit roundoff
F32 = 2.0 ** -18  # 32 float32 ulps of 1 (ulp of 1 is 2^-23): see the module docstring
RTOL = U + F32
GEO = GlmVitGeometry(**REAL)


@pytest.fixture(scope="module")
def kernels():
    """kernels(kind): a Kernels for 'auto', 'generic' or 'hopper' (skipping off sm_90), made once;
    with per-launch checks where the process asks for them (the device check does)."""
    from glmvit_cupy.gpu.faults import check_launches
    from glmvit_cupy.gpu.kernels import Kernels

    made = {}

    def get(kind: str = "auto"):
        if kind != "auto":
            skip_unless_available(kind)
        if kind not in made:
            made[kind] = Kernels(kind, check_launches())
        return made[kind]
    return get


def bf16_device(x: np.ndarray):
    """(BF16 bits on the device, the float32 values they hold on the host)."""
    import cupy

    bits = f32_to_bf16_bits(x.astype(np.float32))
    return cupy.asarray(bits), bf16_to_f32(bits)


def unwritten(shape):
    """A BF16 output buffer of NaN bits, so an element a kernel never writes fails the check."""
    import cupy

    return cupy.full(shape, 0xFFFF, dtype=cupy.uint16)


def host_bf16(bits) -> np.ndarray:
    return bf16_to_f32(bits.get())


def test_assert_close_reports_the_first_mismatches_and_the_worst():
    """The helper itself (runs without a GPU): NaN and out-of-bound elements are named."""
    ref = np.linspace(1, 2, 20).reshape(4, 5)
    assert_close(ref * (1 + U / 2), ref, 0, U, "within")
    got = ref.copy()
    got[1, 2] += 0.01
    got[3, 4] = np.nan
    with pytest.raises(AssertionError, match=r"(?s)2 of 20 elements.*at \(1, 2\): got 1\.378.*worst at \(3, 4\): got nan"):
        assert_close(got, ref, 1e-6, U, "demo")


@gpu
@pytest.mark.parametrize("rows, n", [(37, 1024), (5, 4104), (8, 64)])
def test_rmsnorm_bias(kernels, rows, n):
    """rmsnorm_bias: w * v / rms(v) of v = x + deferred_bias (the residual stream plus the biases
    it lacks), BF16 out. n 4104 is one sweep of 1024 and a partial one; 37 rows a partial block."""
    import cupy

    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, n)) * 3 + rng.standard_normal((rows, 1))).astype(np.float32)
    deferred_bias = rng.standard_normal(n).astype(np.float32)
    w_d, w = bf16_device(1 + 0.2 * rng.standard_normal(n))
    out = unwritten((rows, n))
    kernels().rmsnorm_bias(cupy.asarray(x), cupy.asarray(deferred_bias), w_d, out, GEO.rms_norm_eps)
    want = rmsnorm((x + deferred_bias).astype(np.float64), w, GEO.rms_norm_eps)  # the kernel's float32 add
    assert_close(host_bf16(out), want, F32, RTOL, f"rmsnorm_bias {rows}x{n}")


@gpu
@pytest.mark.parametrize("rows, n", [(37, 4096), (3, 1000)])
def test_layernorm_gelu(kernels, rows, n):
    """layernorm_gelu: exact-GELU(LayerNorm(x)), BF16 out; rows with a mean of 3x their spread
    test the two-pass variance. The atol F32 also covers 1 + erff(v / sqrt 2) cancelling in
    float32 for v < -3 (an absolute error of at most |v| x 2^-24 in GELU; |v| < 8 here)."""
    import cupy

    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, n)) + 3 * rng.standard_normal((rows, 1))).astype(np.float32)
    w_d, w = bf16_device(1 + 0.3 * rng.standard_normal(n))
    b_d, b = bf16_device(0.5 * rng.standard_normal(n))
    out = unwritten((rows, n))
    kernels().layernorm_gelu(cupy.asarray(x), w_d, b_d, out, LAYERNORM_EPS)
    want = gelu_erf(layernorm(x.astype(np.float64), w, b, LAYERNORM_EPS))
    assert_close(host_bf16(out), want, F32, RTOL, f"layernorm_gelu {rows}x{n}")


@gpu
def test_rope_tables(kernels):
    """rope_tables: cos and sin of [h * inv_freq, w * inv_freq], float32 out: sincosf (2 ulps)
    against NumPy's float32 cos/sin (a few ulps) of the same float32 angles, within F32."""
    import cupy

    grid = np.array([[1, 32, 32], [2, 4, 6], [1, 120, 200]])
    pos = block_major_positions(grid, GEO.spatial_merge_size)
    inv_freq = rope_inv_freq(GEO)
    p, half = len(pos), 2 * inv_freq.size
    cos, sin = cupy.full((p, half), np.nan, dtype=cupy.float32), cupy.full((p, half), np.nan, dtype=cupy.float32)
    kernels().rope_tables(cupy.asarray(pos), cupy.asarray(inv_freq), cos, sin)
    want_cos, want_sin = rope_tables(pos, inv_freq)
    assert_close(cos.get(), want_cos, F32, 0, "rope_tables cos")
    assert_close(sin.get(), want_sin, F32, 0, "rope_tables sin")


@gpu
@pytest.mark.parametrize("hd, heads", [(64, 16), (16, 3), (32, 5), (128, 2), (256, 1)])
def test_qknorm_rope(kernels, hd, heads):
    """qknorm_rope, in place on the QKV rows: q and k of every head get their bias, per-head
    RMSNorm and rotate-half RoPE (BF16 out); v is left alone, bit for bit. Every head_dim the
    kernel takes (hd / 8 lanes a head within a warp). The rotation n cos + rotate_half(n) sin
    can cancel: its atol is F32 times |n cos| + |rotate_half(n) sin|."""
    import cupy

    rng = np.random.default_rng(hd)
    p, h = 37, heads * hd
    qkv_d, qkv = bf16_device(rng.standard_normal((p, 3 * h)) * 2)
    bias_d, bias = bf16_device(rng.standard_normal(3 * h))
    qw_d, qw = bf16_device(1 + 0.2 * rng.standard_normal(hd))
    kw_d, kw = bf16_device(1 + 0.2 * rng.standard_normal(hd))
    angles = rng.uniform(-100, 100, (p, hd // 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    v_before = qkv_d[:, 2 * h:].copy()
    kernels().qknorm_rope(qkv_d, bias_d, qw_d, kw_d, cupy.asarray(cos), cupy.asarray(sin), heads, GEO.rms_norm_eps)
    x = (qkv + bias).reshape(p, 3, heads, hd).astype(np.float64)  # + bias: one float32 add in both
    got = host_bf16(qkv_d).reshape(p, 3, heads, hd)
    for i, (name, w) in enumerate((("q", qw), ("k", kw))):
        normed = rmsnorm(x[:, i], w, GEO.rms_norm_eps)
        size = rope_magnitude(normed, cos, sin)
        assert_close(got[:, i], qknorm_rope(x[:, i], w, cos, sin, GEO.rms_norm_eps), F32 * size, RTOL,
                     f"{name} of qknorm_rope hd {hd} heads {heads}")
    assert bool((qkv_d[:, 2 * h:] == v_before).all()), "qknorm_rope wrote into v"


def rope_magnitude(normed: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """|n cos| + |rotate_half(n) sin| per element of qknorm_rope's output (n [P, heads, hd])."""
    half = normed.shape[-1] // 2
    rotated = np.concatenate([normed[..., half:], normed[..., :half]], axis=-1)
    return (np.abs(normed) * np.abs(np.concatenate([cos, cos], axis=-1))[:, None]
            + np.abs(rotated) * np.abs(np.concatenate([sin, sin], axis=-1))[:, None])


@gpu
@pytest.mark.parametrize("rows, n", [(4 * 37, 1024), (8, 36)])
def test_im2col_2x2(kernels, rows, n):
    """im2col_2x2: each run of 4 rows to one row in (channel, kh, kw) order; bit for bit."""
    x_d, x = bf16_device(np.random.default_rng(n).standard_normal((rows, n)))
    out = unwritten((rows // 4, 4 * n))
    kernels().im2col_2x2(x_d, out)
    assert np.array_equal(out.get(), f32_to_bf16_bits(im2col_2x2(x))), "im2col_2x2 moved an element wrongly"


@gpu
@pytest.mark.parametrize("rows, cols", [(37, 4096), (3, 1028)])
def test_bias_to_bf16(kernels, rows, cols):
    """bias_to_bf16: x += bias in place (float32, one IEEE add: bit for bit) and its BF16 copy
    (round to nearest even: bit for bit with the reference's rounding)."""
    import cupy

    rng = np.random.default_rng(cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 5
    bias_d, bias = bf16_device(rng.standard_normal(cols))
    x_d, out = cupy.asarray(x), unwritten((rows, cols))
    kernels().bias_to_bf16(x_d, bias_d, out)
    want = x + bias
    assert np.array_equal(x_d.get(), want), "bias_to_bf16: the float32 sum differs"
    assert np.array_equal(out.get(), f32_to_bf16_bits(want)), "bias_to_bf16: the BF16 copy differs"


def conversion_inputs(rng) -> np.ndarray:
    """float32 values that test a conversion's edges: normal values over the whole range, exact
    BF16 ties (low half 0x8000, odd and even), values that overflow float16 and BF16, float16
    subnormals, zeros of both signs, infinities (no NaN: its payload is not specified)."""
    normal = (rng.standard_normal(4000) * 10.0 ** rng.integers(-30, 30, 4000)).astype(np.float32)
    ties = (rng.integers(0, 0x7F7F, 1000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519, 65520, 1e5, -7e4, 3.39e38, -3.4e38,
                      6e-8, -3e-8, 1e-6, 6.1e-5, 1e-40], dtype=np.float32)
    values = np.concatenate([normal, ties, edges])
    return np.concatenate([values, np.zeros(-len(values) % 4, np.float32)])  # the kernels take n % 4 == 0


@gpu
def test_f32_to_bf16_and_f16(kernels):
    """f32_to_bf16 and f32_to_f16: round to nearest even, bit for bit with the reference's
    rounding and NumPy's float16 cast (overflow to infinity, subnormals kept)."""
    import cupy

    x = conversion_inputs(np.random.default_rng(0))
    src = cupy.asarray(x)
    bf, half = unwritten(x.shape), unwritten(x.shape)
    kernels().f32_to_bf16(src, bf)
    kernels().f32_to_f16(src, half)
    with np.errstate(over="ignore"):  # overflow to infinity is what is being checked
        want_half = x.astype(np.float16).view(np.uint16)
    for name, got, want in (("f32_to_bf16", bf.get(), f32_to_bf16_bits(x)), ("f32_to_f16", half.get(), want_half)):
        wrong = np.flatnonzero(got != want)
        assert not len(wrong), (f"{name}: {len(wrong)} of {x.size} differ, first at {wrong[:5].tolist()}: "
                                f"inputs {x[wrong[:5]].tolist()}, got {got[wrong[:5]].tolist()}, "
                                f"want {want[wrong[:5]].tolist()}")


@gpu
@pytest.mark.parametrize("rows, inter, with_bias", [(37, 4096, True), (70000, 136, False), (5, 10240, False)])
def test_swiglu_clamp(kernels, rows, inter, with_bias):
    """swiglu_clamp, in place over the gate half of a gate|up product: silu(min(g + bg, L)) *
    clamp(u + bu, -L, L), BF16 out; the up half is left alone. 70000 rows pass the grid's 65535
    (grid-stride), 136 columns leave a block partly idle; values reach past the clamp."""
    rng = np.random.default_rng(rows)
    gu_d, gu = bf16_device(rng.standard_normal((rows, 2 * inter)) * 6)
    bias_d, bias = bf16_device(rng.standard_normal(2 * inter) * 3) if with_bias else (None, np.float32(0))
    up_before = gu_d[:, inter:].copy()
    kernels().swiglu_clamp(gu_d, bias_d, GEO.swiglu_limit)
    want = swiglu_clamp(gu + bias, GEO.swiglu_limit)
    assert_close(host_bf16(gu_d[:, :inter]), want, F32, RTOL, f"swiglu_clamp {rows}x{inter}")
    assert bool((gu_d[:, inter:] == up_before).all()), "swiglu_clamp wrote into the up half"


def segments_of(lengths: list[int]) -> np.ndarray:
    return np.stack([np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths], axis=-1).astype(np.int64)


def work_with_pieces(segments: np.ndarray, bm: int, heads: int):
    """A work list whose last round is cut into pieces: `slots` is only the cut's round size,
    so any value that makes pieces is as correct as the device's own (the last piece of a
    query tile merges them, whichever order they run in)."""
    return next(w for s in range(2, 256) if (w := flash_work_list(segments, bm, heads, s)).pieces >= 2)


@gpu
@pytest.mark.parametrize("kind", KERNEL_SETS)
@pytest.mark.parametrize("lengths, heads", [([64, 1, 200, 333, 129, 7], 3), ([1000], 2)])
def test_flash_attention(kernels, kind, lengths, heads):
    """Each flash kernel (mma.sync: 'generic'; wgmma, each of its query tiles, with and without
    pieces: 'hopper') against segment_attention on the same BF16 q, k, v, head_dim 64.
    Segments off the 64-key tile (1 and 7 keys, 129, 333) test the masks and the row guards.
    Bound, per element: the kernel rounds the probabilities to BF16 for the P.V product (each
    off by <= U) and normalises by their sum, so out is off by at most 2U x (P |V|), the
    probability-weighted mean of |v| over the row's keys (segment_attention of |v|); plus U of
    the value for the output's own rounding."""
    import cupy

    k = kernels(kind)
    rng = np.random.default_rng(sum(lengths))
    segments, p, hd = segments_of(lengths), sum(lengths), 64
    h = heads * hd
    qkv_d, qkv = bf16_device(rng.standard_normal((p, 3 * h)) * 1.5)
    q, kk, v = (qkv[:, i * h:(i + 1) * h].reshape(p, heads, hd) for i in range(3))
    want = segment_attention(q, kk, v, segments, 128).reshape(p, h)
    scale = segment_attention(q, kk, np.abs(v), segments, 128).reshape(p, h)
    qkv_map = cupy.asarray(k.qkv_map(qkv_d)) if k.hopper else None
    for bm in k.flash_bms:
        works = [flash_work_list(segments, bm, heads)]
        if k.hopper and len(lengths) == 1:
            works.append(work_with_pieces(segments, bm, heads))
        for work in works:
            out = unwritten((p, h))
            cut = len(work.tiles) - work.first_piece
            partial = cupy.full(max(1, cut * bm * (hd + 2)), np.nan, dtype=cupy.float32)
            counters = cupy.zeros(max(1, cut // max(1, work.pieces)), dtype=cupy.uint32)
            k.flash_attention(qkv_d, qkv_map, out, cupy.asarray(work.tiles), len(work.tiles), heads, hd, bm,
                              partial, counters, work.first_piece, work.pieces)
            what = f"{kind} flash bm {bm}, {work.pieces} pieces, segments {lengths}"
            assert_close(host_bf16(out), want, 2 * U * scale, RTOL, what)
            assert not counters.any(), f"{what}: piece counters not left at zero"


@gpu
@pytest.mark.parametrize("depth, inter, with_bias, row0, rows", [(1024, 4096, True, 0, 200),
                                                                 (4096, 10240, False, 1000, 130),
                                                                 (1024, 4096, True, 2999, 1)])
def test_gemm_swiglu_sm90(kernels, depth, inter, with_bias, row0, rows):
    """gemm_swiglu_sm90 (Hopper): act = swiglu_clamp(X[row0:row0 + rows] . W^T + b), act a strided
    view (the gate half of a gate|up buffer), whose other elements stay unwritten. Against the
    float32 product of the same BF16 operands. Bound, per element: the kernel rounds gate and
    up to BF16 before the bias (each off by U of itself) after a float32 sum of `depth` products
    (off by depth x 2^-24 x the sum of their magnitudes); silu' <= 1.1, so act is off by at most
    1.1 dg |clamp(u)| + |silu(g)| du, plus U of the value for the output's own rounding."""
    import cupy

    k = kernels("hopper")
    limit = GEO.swiglu_limit
    rng = np.random.default_rng(depth + row0)
    x_all_d, x_all = bf16_device(rng.standard_normal((3000, depth)))
    w_d, w = bf16_device(rng.standard_normal((2 * inter, depth)) * 4 * depth ** -0.5)
    bias_d, bias = bf16_device(rng.standard_normal(2 * inter)) if with_bias else (None, np.zeros(2 * inter, np.float32))
    x = x_all[row0:row0 + rows]
    pre, mag = x @ w.T, np.abs(x) @ np.abs(w).T
    dpre = U * np.abs(pre) + depth * 2.0 ** -24 * mag
    g, u = pre[:, :inter] + bias[:inter], pre[:, inter:] + bias[inter:]
    want = silu(np.minimum(g, np.float32(limit))) * np.clip(u, -limit, limit)
    bound = 1.1 * dpre[:, :inter] * np.abs(np.clip(u, -limit, limit)) + np.abs(silu(np.minimum(g, limit))) * dpre[:, inter:]
    buf = unwritten((rows + 3, 2 * inter))
    k.gemm_swiglu(cupy.asarray(k.gate_up_map(x_all_d)), cupy.asarray(k.gate_up_map(w_d)), bias_d, buf[:rows, :inter],
                  row0, depth, limit)
    got = buf.get()
    assert (got[:, inter:] == 0xFFFF).all() and (got[rows:] == 0xFFFF).all(), "wrote outside act"
    assert_close(bf16_to_f32(got[:rows, :inter]), want, bound, RTOL, f"gemm_swiglu K {depth} rows {row0}+{rows}")
