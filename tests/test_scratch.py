"""The scratch plan (pure arithmetic, no GPU): what the default budget costs, and that every
buffer a phase puts on a shared slab fits there without touching a buffer still live."""

from __future__ import annotations

import pytest

from glmvit_cupy.geometry import REAL, GlmVitGeometry
from glmvit_cupy.scratch import CUBLAS_WORKSPACE, _round, scratch_plan

MIB = 2 ** 20
TRANSFORMERS_2044_MIB = 1019  # SPEC.md: what transformers allocates at 2044x2044


def test_default_budget_census():
    plan = scratch_plan(GlmVitGeometry(**REAL))
    assert plan.p_max == 32000
    assert set(plan.slabs) == {"resid", "normed", "qkv", "rope", "index", "workspace"}  # no MLP slab
    assert plan.slabs["workspace"] == CUBLAS_WORKSPACE
    assert round(plan.total_bytes / MIB, 1) == 415.2
    assert plan.total_bytes < TRANSFORMERS_2044_MIB * MIB / 2
    assert plan.naive_bytes == 32000 * 32000 * 6  # the [P, P] scores + probs, naive path only


@pytest.mark.parametrize("patches", [4, 1024, 5476, 21316, 32000, 32768])
@pytest.mark.parametrize("geometry", ["real", "small"])
def test_every_phase_fits_its_slab(patches, geometry):
    geo = GlmVitGeometry(**REAL)
    if geometry == "small":  # a narrow tower: the merger's shapes outgrow the block's
        geo = GlmVitGeometry(**{**REAL, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
                                "out_hidden_size": 256, "projection_intermediate_size": 512})
    geo = geo.with_max_pixels(patches * geo.patch_size ** 2)
    plan = scratch_plan(geo)
    p, h, o = plan.p_max, geo.hidden_size, geo.out_hidden_size
    m, slab = p // geo.merge_unit, plan.slabs
    # block phase
    assert slab["resid"] >= 4 * p * h and slab["normed"] >= 2 * p * h
    assert slab["qkv"] >= 2 * p * 3 * h and slab["qkv"] >= 2 * p * geo.patch_dim
    assert 1 <= plan.mlp_rows <= p and slab["qkv"] >= plan.mlp_rows * 2 * geo.intermediate_size * 2
    # merger phase: im2col over the dead residual stream, then the f32 pooler over both
    assert slab["resid"] >= 2 * m * geo.merge_unit * h and slab["resid"] >= 4 * m * o
    # last_hidden_state (f32, an output) and its bf16 copy; the merger's gate|up chunk goes over
    # the copy (dead by then), never over last_hidden_state
    assert slab["qkv"] >= 4 * m * o + 2 * m * o
    assert 1 <= plan.merger_rows <= m
    assert _round(4 * m * o) + plan.merger_rows * 2 * geo.projection_intermediate_size * 2 <= slab["qkv"]
    # index: positions, the flash work list, three TMA descriptors (qkv, normed, merge_y)
    assert slab["index"] >= 4 * 2 * p + 16 * plan.max_tiles + 3 * 128
