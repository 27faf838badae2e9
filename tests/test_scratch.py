"""The scratch plan (pure arithmetic, no GPU): no two buffers live in the same step of the
forward share a byte, every buffer fits its slab, and the sharing keeps the default budget
under half of what transformers allocates."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from glmvit_cupy.gpu import flash
from glmvit_cupy.gpu.scratch import STEPS, scratch_plan
from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry, patch_budget

MIB = 2 ** 20
TRANSFORMERS_2044_MIB = 1019  # transformers at 2044x2044, the project's first measurement (BENCHMARKS.md)
H200_SLOTS = {256: 132, 128: 264, 64: 528}  # flash CTAs a round (Kernels.flash_slots) on 132 SMs
REAL_GEO = GlmVitGeometry(**REAL)
# A narrow tower: the merger's shapes outgrow the block's.
SMALL_GEO = GlmVitGeometry(**{**REAL, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
                              "out_hidden_size": 256, "projection_intermediate_size": 512})


def live_overlaps(plan) -> list[str]:
    """Pairs of views on one slab whose bytes intersect, in a step where both are live."""
    found = []
    for a, b in itertools.combinations(plan.views.values(), 2):
        shared = sorted(set(a.steps) & set(b.steps))
        if a.slab == b.slab and shared and a.offset < b.end and b.offset < a.end and a.nbytes and b.nbytes:
            found.append(f"{a.name} [{a.offset}, {a.end}) and {b.name} [{b.offset}, {b.end}) of {a.slab} "
                         f"in {', '.join(shared)}")
    return found


@pytest.mark.parametrize("patches", [4, 1024, 5476, 21316, 32000, 32768])
@pytest.mark.parametrize("geo", [REAL_GEO, SMALL_GEO], ids=["real", "small"])
@pytest.mark.parametrize("piece_rows", [0, flash.piece_rows(H200_SLOTS)])
def test_views_live_in_one_step_never_share_a_byte(patches, geo, piece_rows):
    plan = scratch_plan(geo, patches, piece_rows)
    assert not live_overlaps(plan)
    for v in plan.views.values():
        assert v.end <= plan.slabs[v.slab], v.name
        assert v.steps and set(v.steps) <= set(STEPS), v.name
    # Every slab is shared in time, or holds what lives through every step.
    assert set(plan.slabs) == {v.slab for v in plan.views.values()}


def test_a_view_moved_onto_a_live_one_is_caught():
    plan = scratch_plan(REAL_GEO, 1024)
    views = dict(plan.views)
    # The merger's gate|up chunk over last_hidden_state (an output, live in the merger's MLP)
    views["merge_mlp"] = dataclasses.replace(views["merge_mlp"], offset=0)
    assert live_overlaps(dataclasses.replace(plan, views=views)) == [
        f"last_hidden [0, {views['last_hidden'].end}) and merge_mlp [0, {views['merge_mlp'].end}) of qkv in merger_mlp"]


def test_default_budget_is_under_half_of_transformers():
    plan = scratch_plan(REAL_GEO, patch_budget(REAL_GEO), flash.piece_rows(H200_SLOTS))
    assert plan.p_max == patch_budget(REAL_GEO)
    assert plan.total_bytes < TRANSFORMERS_2044_MIB * MIB / 2
    print(f"scratch at the default budget ({plan.p_max} patches): {plan.total_bytes / MIB:.1f} MiB")


def test_mlp_chunks_need_no_room_of_their_own_at_the_default_budget():
    """The MLPs' gate|up chunks sit in the qkv slab in the steps its other buffers are dead:
    without them it would be as large."""
    plan = scratch_plan(REAL_GEO, patch_budget(REAL_GEO))
    others = max(v.end for v in plan.views.values() if v.slab == "qkv" and v.name not in ("mlp", "merge_mlp"))
    assert plan.slabs["qkv"] == -(-others // 256) * 256
    assert 1 <= plan.mlp_rows <= plan.p_max and 1 <= plan.merger_rows <= plan.p_max // REAL_GEO.merge_unit


@pytest.mark.parametrize("lengths", [[32000], [21316], [5476], [2000], [4] * 8000, [1024] * 31 + [256]])
def test_every_work_list_fits_the_plan(lengths):
    """The work list, its pieces' rows and their counters fit the index slab and the pieces
    buffer, at every query tile and with the H200's rounds."""
    p = sum(lengths)
    plan = scratch_plan(REAL_GEO, p, flash.piece_rows(H200_SLOTS))
    segments = np.stack([np.cumsum([0] + lengths[:-1]), lengths], axis=-1)
    for bm, slots in H200_SLOTS.items():
        work = flash.flash_work_list(segments, bm, REAL_GEO.num_heads, slots)
        assert len(work.tiles) <= plan.views["tiles"].shape[0]
        cut = len(work.tiles) - work.first_piece
        assert cut * bm <= plan.views["pieces"].shape[0], (bm, cut)
        assert not work.pieces or cut // work.pieces <= plan.views["piece_counters"].shape[0]
