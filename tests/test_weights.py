"""The weight tree (no GPU): every tensor named once, the counts of the real tower, and
`deferred_bias`, the GPU engine's way of keeping biases out of its residual stream, held to the
NumPy reference's forward."""

from __future__ import annotations

import dataclasses

import numpy as np

from glmvit_cupy.bf16 import bf16_to_f32
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry
from glmvit_cupy.tower.layout import block_major_positions, frame_segments
from glmvit_cupy.tower.reference import NumpyTower, rmsnorm, rope_tables
from glmvit_cupy.tower.weights import (BLOCK_TENSORS, FUSED_PAIRS, NON_BLOCK_TENSORS, deferred_bias, parameter_count,
                                       tensor_count, tower_shapes)
from helpers import rel_err


def test_every_tensor_named_once_and_each_pair_adjacent():
    geo = GlmVitGeometry(**REAL)
    names = list(tower_shapes(geo))
    assert len(names) == len(set(names)) == tensor_count(geo) == 347 == 24 * 14 + 11
    assert (len(BLOCK_TENSORS), len(NON_BLOCK_TENSORS)) == (14, 11)
    assert parameter_count(geo) == 563_627_008  # the released tower's
    for first, second in FUSED_PAIRS.items():  # the arena stores each pair back to back
        for prefix in ("blocks.0.", ""):
            if prefix + first in names:
                assert names.index(prefix + second) == names.index(prefix + first) + 1


def test_the_deferred_bias_stands_for_every_bias_the_stream_leaves_out(tiny_ckpt):
    """The engine's residual stream: patch embed, proj and down GEMMs without their biases, v
    without its bias, each norm reading the stream plus its row of deferred_bias. Plus the last row,
    it is the reference's residual stream (float32 both: only summation order differs)."""
    weights = bind_checkpoint(tiny_ckpt)
    tower = NumpyTower(weights, p_max=1024)
    geo, w, h = tower.geo, tower.w, tower.geo.hidden_size
    grid = np.array([[1, 6, 8], [2, 4, 4]])
    p = int(grid.prod(axis=1).sum())
    pixels = np.random.default_rng(0).standard_normal((p, geo.patch_dim)).astype(np.float32)
    cos, sin = rope_tables(block_major_positions(grid, geo.spatial_merge_size), tower.inv_freq)
    segments = frame_segments(grid)

    x = pixels @ w.patch_embed_w.T + w.patch_embed_b  # the reference's stream
    stream = pixels @ w.patch_embed_w.T  # the engine's
    deferred = deferred_bias(weights.structure(lambda raw: raw))
    for i, blk in enumerate(w.blocks):
        no_v = blk.qkv_b.copy()
        no_v[2 * h:] = 0
        free = dataclasses.replace(blk, qkv_b=no_v, proj_b=np.zeros_like(blk.proj_b), down_b=np.zeros_like(blk.down_b))
        x = x + tower.attention(rmsnorm(x, blk.norm1_w, geo.rms_norm_eps), blk, cos, sin, segments)
        stream = stream + tower.attention(rmsnorm(stream + deferred[2 * i], blk.norm1_w, geo.rms_norm_eps), free,
                                          cos, sin, segments)
        x = x + tower.mlp(rmsnorm(x, blk.norm2_w, geo.rms_norm_eps), blk)
        stream = stream + tower.mlp(rmsnorm(stream + deferred[2 * i + 1], blk.norm2_w, geo.rms_norm_eps), free)
    assert deferred.shape == (2 * geo.depth + 1, h) and deferred.dtype == np.float32
    assert np.abs(bf16_to_f32(weights.raw("blocks.0.attn.qkv.bias"))[2 * h:]).max() > 0  # a v bias to fold
    assert rel_err(stream + deferred[-1], x) < 1e-5
