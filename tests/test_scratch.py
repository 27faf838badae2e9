"""The scratch plan (pure arithmetic, no GPU): what the default budget costs, and that every
buffer a phase puts on a shared slab fits there without touching a buffer still live."""

from __future__ import annotations

import numpy as np
import pytest

from glmvit_cupy.geometry import REAL, GlmVitGeometry, patch_budget
from glmvit_cupy.layout import FLASH_BN, MAX_PIECE_GROUPS, MAX_PIECE_ROUNDS, flash_work_list, tail_pieces
from glmvit_cupy.scratch import CUBLAS_WORKSPACE, scratch_plan

MIB = 2 ** 20
TRANSFORMERS_2044_MIB = 1019  # SPEC.md: what transformers allocates at 2044x2044


def test_default_budget_census():
    plan = scratch_plan(GlmVitGeometry(**REAL), patch_budget(GlmVitGeometry(**REAL)))
    assert plan.p_max == 32000
    assert set(plan.slabs) == {"resid", "normed", "qkv", "rope", "index", "workspace"}  # no MLP slab
    assert plan.slabs["workspace"] == CUBLAS_WORKSPACE
    assert round(plan.total_bytes / MIB, 1) == 417.1
    assert plan.total_bytes < TRANSFORMERS_2044_MIB * MIB / 2
    assert plan.naive_bytes == 32000 * 32000 * 6  # the [P, P] scores + probs, naive path only


@pytest.mark.parametrize("patches", [4, 1024, 5476, 21316, 32000, 32768])
@pytest.mark.parametrize("geometry", ["real", "small"])
def test_every_phase_fits_its_slab(patches, geometry):
    geo = GlmVitGeometry(**REAL)
    if geometry == "small":  # a narrow tower: the merger's shapes outgrow the block's
        geo = GlmVitGeometry(**{**REAL, "hidden_size": 64, "num_heads": 2, "intermediate_size": 128,
                                "out_hidden_size": 256, "projection_intermediate_size": 512})
    plan = scratch_plan(geo, patches)
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
    at = plan.offsets
    assert at["last_hidden_bf16"] >= 4 * m * o and at["merge_mlp"] >= 4 * m * o
    assert at["merge_mlp"] + plan.merger_rows * 2 * geo.projection_intermediate_size * 2 <= slab["qkv"]
    # rope: cos, then sin; index: positions, the flash work list, three TMA descriptors (qkv,
    # normed, merge_y), the flash pieces' counters
    assert at["rope_sin"] >= 4 * p * geo.head_dim // 2 and at["rope_sin"] * 2 <= slab["rope"]
    assert at["tiles"] >= 4 * 2 * p and at["maps"] >= at["tiles"] + 16 * plan.max_tiles
    assert at["piece_counters"] >= at["maps"] + 3 * 128
    assert at["piece_counters"] + 4 * MAX_PIECE_GROUPS <= slab["index"]


H200_SLOTS = {256: 132, 128: 264, 64: 528}  # flash CTAs a round (Kernels.flash_slots) on 132 SMs


def key_range(seg_len: int, w: int) -> range:
    """The key tiles an entry covers, as flash_attention_sm90.cu computes them."""
    pieces, piece, tiles = w >> 16, (w >> 8) & 0xFF, -(-seg_len // FLASH_BN)
    return range(tiles * piece // pieces, tiles * (piece + 1) // pieces) if pieces else range(tiles)


@pytest.mark.parametrize("bm", [256, 128, 64])
@pytest.mark.parametrize("keys", [21316, 5476])
def test_flash_work_list_cuts_one_segments_last_round_into_pieces(bm, keys):
    heads, slots = 16, H200_SLOTS[bm]
    work = flash_work_list(np.array([[0, keys]]), bm, heads, slots)
    n_q = -(-keys // bm)
    full, rem = divmod(n_q * heads, slots)
    assert work.bm == bm and work.first_piece == full * slots and work.pieces >= 2
    # The pieces fill at most MAX_PIECE_ROUNDS rounds, 90% busy, faster than the uncut tail.
    rounds = -(-rem * work.pieces // slots)
    assert rounds <= MAX_PIECE_ROUNDS and rounds < work.pieces and 10 * rem * work.pieces >= 9 * rounds * slots
    covered = {}  # (q0, head) -> key tiles, over whole entries and pieces
    for start, length, q0, w in work.tiles.tolist():
        assert (start, length) == (0, keys)
        covered.setdefault((q0, w & 0xFF), []).extend(key_range(length, w))
    assert sorted(covered) == sorted((q0, h) for h in range(heads) for q0 in range(0, keys, bm))
    assert all(tiles == list(range(-(-keys // FLASH_BN))) for tiles in covered.values())
    # Whole entries go head by head; the pieces are the tail's.
    heads_in_order = [w & 0xFF for w in work.tiles[:work.first_piece, 3].tolist()]
    assert heads_in_order == sorted(heads_in_order) and not (work.tiles[:work.first_piece, 3] >> 8).any()


def test_tail_pieces_fill_whole_rounds():
    assert tail_pieces(24, 132, 16) == 5  # 2044x2044 at 256 queries: 120 pieces of 132 slots
    assert tail_pieces(88, 132, 3) == 3  # 1036x1036: 264 pieces, two full rounds of a third each
    assert tail_pieces(1, 132, 16) == 16  # nothing reaches 90%: the fastest cut
    assert tail_pieces(124, 132, 2) == 0  # two rounds of halves take as long as the uncut tail


def test_piece_rows_fit_the_cublas_workspace():
    # A round is SMs x 256 query rows at every tile size (4, 2, 1 CTAs of 64, 128, 256 an SM);
    # each row leaves HD float32 values, its maximum and its sum.
    assert all(bm * slots == 132 * 256 for bm, slots in H200_SLOTS.items())
    assert MAX_PIECE_ROUNDS * 132 * 256 * (64 + 2) * 4 <= CUBLAS_WORKSPACE


def test_flash_work_list_leaves_batches_and_single_rounds_whole():
    segments = np.array([[0, 21316], [21316, 5476]])  # two images: their order must not change bits
    assert flash_work_list(segments, 256, 16, 132).pieces == 0
    assert flash_work_list(np.array([[0, 1024]]), 64, 16, 528).pieces == 0  # no whole round before the tail
    assert flash_work_list(np.array([[0, 21316]]), 256, 16, 0).pieces == 0  # a kernel without pieces


@pytest.mark.parametrize("lengths", [[32000], [5476], [2000], [4] * 8000, [1024] * 31 + [256]])
def test_flash_work_list_fits_the_index_slab(lengths):
    plan = scratch_plan(GlmVitGeometry(**REAL), patch_budget(GlmVitGeometry(**REAL)))
    segments = np.stack([np.cumsum([0] + lengths[:-1]), lengths], axis=-1)
    for bm, slots in H200_SLOTS.items():
        assert len(flash_work_list(segments, bm, 16, slots).tiles) <= plan.max_tiles