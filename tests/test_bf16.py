"""BF16 narrowing, bit for bit: f32_to_bf16_bits against torch's float32 -> bfloat16 conversion
(an independent round to nearest, ties to even), on every kind of float32."""

from __future__ import annotations

import numpy as np
import pytest

from glmvit_cupy.bf16 import bf16_to_f32, f32_to_bf16_bits

torch = pytest.importorskip("torch")


def float32_cases() -> np.ndarray:
    """Random bit patterns (every exponent, both signs), and the patterns rounding decides on:
    exact ties below an even and an odd BF16, one ulp either side of them, the largest finite
    values (which round up to Inf), subnormals, zeros, Infs and NaNs."""
    rng = np.random.default_rng(0)
    random = rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32)
    highs = rng.integers(0, 1 << 16, 2_000, dtype=np.uint64).astype(np.uint32) << 16
    around_ties = (highs[:, None] + np.array([0x7FFF, 0x8000, 0x8001, 0x18000, 0x17FFF, 0x0001, 0xFFFF],
                                             np.uint32)).reshape(-1)
    special = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7FFFFF, 0x00000001, 0x00008000, 0x00018000,
                        0x007FFFFF, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
                        0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FBFFFFF, 0xFF80FFFF], np.uint32)
    return np.concatenate([random, around_ties, special]).view(np.float32)


def test_narrowing_rounds_to_nearest_even_bit_for_bit():
    x = float32_cases()
    got = f32_to_bf16_bits(x)
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert got.dtype == np.uint16
    mismatched = np.flatnonzero((got != want) & ~nan)
    assert mismatched.size == 0, [(hex(x[i:i + 1].view(np.uint32)[0]), hex(got[i]), hex(want[i]))
                                  for i in mismatched[:5]]
    # torch returns one canonical NaN; ours keeps the sign. Either way a NaN stays a NaN.
    assert np.isnan(bf16_to_f32(got[nan])).all()
    assert np.array_equal(got[nan] >> 15, x[nan].view(np.uint32) >> 31)
