"""Flash attention's host side (no GPU): the work list covers every (query tile, head) with
every key tile exactly once, its tail cut into pieces that fill whole rounds; the launch sizes
agree with the CUDA sources, and a source that disagrees is refused."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from glmvit_cupy.errors import InternalError
from glmvit_cupy.gpu import flash
from glmvit_cupy.gpu.kernel_source import constants, cuda_source_dir

H200_SLOTS = {256: 132, 128: 264, 64: 528}  # flash CTAs a round (Kernels.flash_slots) on 132 SMs


def key_range(seg_len: int, w: int) -> range:
    """The key tiles an entry covers, as flash_attention_sm90.cu computes them."""
    pieces, piece, tiles = w >> 16, (w >> 8) & 0xFF, -(-seg_len // flash.BN)
    return range(tiles * piece // pieces, tiles * (piece + 1) // pieces) if pieces else range(tiles)


@pytest.mark.parametrize("bm", [256, 128, 64])
@pytest.mark.parametrize("keys", [21316, 5476])
def test_flash_work_list_cuts_one_segments_last_round_into_pieces(bm, keys):
    heads, slots = 16, H200_SLOTS[bm]
    work = flash.flash_work_list(np.array([[0, keys]]), bm, heads, slots)
    n_q = -(-keys // bm)
    full, rem = divmod(n_q * heads, slots)
    assert work.bm == bm and work.first_piece == full * slots and work.pieces >= 2
    # The pieces fill at most MAX_PIECE_ROUNDS rounds, 90% busy, faster than the uncut tail.
    rounds = -(-rem * work.pieces // slots)
    assert rounds <= flash.MAX_PIECE_ROUNDS and rounds < work.pieces and 10 * rem * work.pieces >= 9 * rounds * slots
    covered = {}  # (q0, head) -> key tiles, over whole entries and pieces
    for start, length, q0, w in work.tiles.tolist():
        assert (start, length) == (0, keys)
        covered.setdefault((q0, w & 0xFF), []).extend(key_range(length, w))
    assert sorted(covered) == sorted((q0, h) for h in range(heads) for q0 in range(0, keys, bm))
    assert all(tiles == list(range(-(-keys // flash.BN))) for tiles in covered.values())
    # Whole entries go head by head; the pieces are the tail's.
    heads_in_order = [w & 0xFF for w in work.tiles[:work.first_piece, 3].tolist()]
    assert heads_in_order == sorted(heads_in_order) and not (work.tiles[:work.first_piece, 3] >> 8).any()


def test_tail_pieces_fill_whole_rounds():
    assert flash.tail_pieces(24, 132, 16) == 5  # 2044x2044 at 256 queries: 120 pieces of 132 slots
    assert flash.tail_pieces(88, 132, 3) == 3  # 1036x1036: 264 pieces, two full rounds of a third each
    assert flash.tail_pieces(1, 132, 16) == 16  # nothing reaches 90%: the fastest cut
    assert flash.tail_pieces(124, 132, 2) == 0  # two rounds of halves take as long as the uncut tail


def test_flash_work_list_leaves_batches_and_single_rounds_whole():
    segments = np.array([[0, 21316], [21316, 5476]])  # two images: their order must not change bits
    assert flash.flash_work_list(segments, 256, 16, 132).pieces == 0
    assert flash.flash_work_list(np.array([[0, 1024]]), 64, 16, 528).pieces == 0  # no whole round before the tail
    assert flash.flash_work_list(np.array([[0, 21316]]), 256, 16, 0).pieces == 0  # a kernel without pieces


def test_choose_bm_takes_the_widest_tile_that_fills_the_sms():
    bms = flash.BMS[flash.SM90]
    assert [flash.choose_bm(bms, n, 16, 132) for n in ([1024], [5476], [21316], [1024] * 8, [4])] == \
        [64, 256, 256, 256, 64]


def test_launch_sizes_are_the_ones_the_sources_state():
    """Hand counts from the kernels' own comments: mma.sync (BM + 4 BN) x HD x 2 bytes = 48 KiB;
    wgmma 1 KiB of slack, 3 K and 3 V tiles of 8 KiB, and with several warpgroups a Q tile each."""
    assert flash.launch(flash.GENERIC, 128) == (128, 48 << 10)
    assert [flash.launch(flash.SM90, bm) for bm in (64, 128, 256)] == \
        [(128, 1024 + 48 * 1024), (256, 1024 + 64 * 1024), (512, 1024 + 80 * 1024)]
    # Every launch fits the dynamic shared memory of the smallest target (sm_86/89: 99 KiB a block).
    assert all(flash.launch(module, bm)[1] <= 99 << 10 for module, bms in flash.BMS.items() for bm in bms)


def test_the_sources_agree_with_flash_py():
    flash.check_sources(cuda_source_dir())
    # What kernels.py reads from the other sources at load.
    assert "ROWS" in constants((cuda_source_dir() / "norms.cu").read_text())
    assert constants("constexpr int BM = 128, BN = 128, BK = 64;  // x\nconstexpr int T = BM * 2;") == \
        {"BM": 128, "BN": 128, "BK": 64}


@pytest.mark.parametrize("file, old, new, match", [
    ("flash_attention_sm90.cu", "constexpr int BN = 64;", "constexpr int BN = 128;", "BN is 128 there, 64 here"),
    ("flash_attention_sm90.cu", "constexpr int STAGES = 3;", "constexpr int STAGES = 4;", "STAGES is 4 there"),
    ("flash_attention.cu", "constexpr int BM = 128;", "constexpr int BM = 64;", "BM is 64 there, 128 here"),
    ("flash_attention_sm90.cu", "FLASH_SM90(flash_attention_sm90_hd64_wg2, 2)\n", "", "instantiates"),
])
def test_a_source_that_disagrees_is_refused(tmp_path, file, old, new, match):
    shutil.copytree(cuda_source_dir(), tmp_path / "cuda_src")
    path = tmp_path / "cuda_src" / file
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    with pytest.raises(InternalError, match=match):
        flash.check_sources(tmp_path / "cuda_src")
