"""The NumPy backend's memory bound: attention in blocks of queries and the MLPs in blocks of
rows give the unblocked results (within 1e-6) with intermediates bounded by the block."""

from __future__ import annotations

import tracemalloc

import numpy as np

from glmvit_cupy import GlmVit, preprocess
from glmvit_cupy.tower import reference
from glmvit_cupy.tower.layout import frame_segments
from helpers import photo_like, rel_err


def qkv(length: int, heads: int, hd: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((length, heads, hd), dtype=np.float32) * 2 for _ in range(3)]


def test_blocked_attention_equals_unblocked():
    """Three segments (one shorter than a block, one not a multiple of it), block of 7 queries."""
    q, k, v = qkv(5 + 23 + 16, 3, 16)
    segments = frame_segments(np.array([[1, 1, 5], [1, 23, 1], [2, 2, 4]]))
    whole = reference.segment_attention(q, k, v, segments, block=10 ** 9)
    blocked = reference.segment_attention(q, k, v, segments, block=7)
    assert rel_err(blocked, whole) <= 1e-6
    # ... and the unblocked result is the textbook softmax, segment by segment.
    for start, length in segments.tolist():
        rows = slice(start, start + length)
        for h in range(3):
            s = q[rows, h].astype(np.float64) @ k[rows, h].T.astype(np.float64) / 4
            p = np.exp(s - s.max(axis=1, keepdims=True))
            ref = (p / p.sum(axis=1, keepdims=True)) @ v[rows, h]
            assert rel_err(whole[rows, h], ref) < 1e-6


def test_attention_memory_is_bounded_by_the_block():
    """One 2048-token segment: the scores of 128 queries at a time, not 2048 x 2048 (16 MB)."""
    length, heads, hd, block = 2048, 2, 64, 128
    q, k, v = qkv(length, heads, hd, seed=1)
    segments = np.array([[0, length]])
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        reference.segment_attention(q, k, v, segments, block=block)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    allowed = q.nbytes + 2 * length * hd * 4 + 2 * block * length * 4 + (256 << 10)
    assert peak <= allowed < length * length * 4, (peak, allowed)


def test_forward_in_row_blocks_equals_unblocked(tiny_ckpt, monkeypatch):
    """The whole forward with tiny blocks, against one block: the bound of test_reference
    (float32 against float32, summation order alone differs: BLAS orders a 10-row product
    differently from a 144-row one, ~7e-7 here after the merger's LayerNorm and SwiGLU)."""
    vit = GlmVit.from_pretrained(tiny_ckpt, backend="numpy")
    pixels, grid = preprocess([photo_like(140, 112, 1), photo_like(56, 56, 2)])
    whole = vit.forward(pixels, grid)
    monkeypatch.setattr(reference, "ROW_BLOCK", 24)
    monkeypatch.setattr(reference, "QUERY_BLOCK", 10)
    blocked = vit.forward(pixels, grid)
    for name in ("last_hidden_state", "pooler_output"):
        assert rel_err(getattr(blocked, name), getattr(whole, name)) <= 1e-5, name
