"""BF16 as its 16-bit pattern: NumPy has no bfloat16, so weights, outputs and GPU operands
travel as uint16 bits; these conversions are the only place the bits are computed, and
`bf16_array` the only place they become values for a caller.

BF16 is the top half of a float32, so widening is a shift; narrowing rounds to the nearest
BF16, ties to even, as the GPU's __float2bfloat16 does. Both take NumPy or CuPy arrays (they
use only methods and operators the two share).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def bf16_to_f32(bits: Any) -> Any:
    """Widen raw BF16 bit patterns (uint16) to float32, a new array."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: Any) -> Any:
    """Round float32 to the nearest BF16 (ties to even); returns the uint16 bit patterns. A NaN
    stays a NaN (made quiet, its sign kept): rounding its payload up would carry it into Inf, or
    past the sign bit into a zero, and a NaN output would pass as finite."""
    u = x.astype(np.float32, copy=False).view(np.uint32)
    nan = ((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)).astype(np.uint32)  # 1 where NaN
    u = (u - (u & np.uint32(0xFFFF)) * nan) | (nan << np.uint32(22))  # a NaN: no low half to round, quiet bit set
    return ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)


def bf16_array(bits: np.ndarray) -> np.ndarray:
    """uint16 BF16 bits as an array of ml_dtypes.bfloat16 (the ecosystem's NumPy bfloat16, JAX's
    and TensorFlow's): what the library returns, so a caller computes on values, not bits."""
    # Imported here, at the first value handed out: its import costs ~1 s of CPU (registering its
    # dtypes with NumPy), which every decode worker's start and a collection run would pay for nothing.
    import ml_dtypes

    return bits.view(ml_dtypes.bfloat16)


def bf16_round(x: Any) -> Any:
    """float32 values rounded to the nearest BF16 (ties to even), as float32."""
    return bf16_to_f32(f32_to_bf16_bits(x))
