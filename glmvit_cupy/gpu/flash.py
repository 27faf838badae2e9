"""Flash attention's host side, in one place: the kernels' tiles and launch sizes, the choice
of query tile, the work list the kernels walk (one int4 entry a CTA, the tail of one segment
cut into pieces) and the sizes of the buffers that list and those pieces need.

CuPy-free, so the CPU tests import it and the scratch plan is pure arithmetic. The numbers the
CUDA side hard-codes (keys per tile, stages, queries per CTA, threads, the instantiated
kernels) are written here once more, of necessity; `check_sources` compares the two at load
(kernels.Kernels) and in a CPU test, so they cannot drift apart silently.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import InternalError
from .kernel_source import constants

HEAD_DIMS = (64,)  # head dims the flash kernels are instantiated for
HD = 64
BN = 64  # keys per K/V tile of both kernels
GENERIC, SM90 = "flash_attention", "flash_attention_sm90"  # mma.sync (any GPU from sm_80); wgmma (Hopper)
# Queries per CTA each kernel comes in: mma.sync one; wgmma 64 per warpgroup, 1, 2 or 4 a CTA
# sharing every K/V tile (kernel names: _hd64, _hd64_wg2, _hd64_wg4), widest first (choose_bm).
BMS = {GENERIC: (128,), SM90: (256, 128, 64)}
MIN_BM = min(min(bms) for bms in BMS.values())  # sizes the work list (max_entries)
GENERIC_THREADS = 128  # 4 warps of 32 query rows
SM90_STAGES = 3  # K/V shared-memory stages of the wgmma kernel
SWIZZLE_SLACK = 1024  # the wgmma kernel aligns its tiles to the 1024-byte swizzle atom itself

MIN_PIECE_TILES = 4  # key tiles a piece has at least (a shorter one would be mostly set-up)
MAX_PIECES = 16  # pieces a query tile is cut into at most
MAX_PIECE_ROUNDS = 2  # rounds of pieces at most: bounds the pieces' buffer (piece_rows)
MAX_PIECE_GROUPS = 1024  # query tiles cut at once at most (a counter each in the index slab)
PIECE_ROW_BYTES = 4 * (HD + 2)  # a piece's row: HD float32 values, its running maximum and sum


def kernel_name(module: str, bm: int) -> str:
    return f"{module}_hd{HD}" + (f"_wg{bm // 64}" if module == SM90 and bm > 64 else "")


def launch(module: str, bm: int) -> tuple[int, int]:
    """(threads, dynamic shared-memory bytes) of a bm-query CTA. mma.sync: the Q tile and two
    K and V stages. wgmma: a warpgroup a 64 queries; SM90_STAGES K and V stages, and with more
    than one warpgroup their Q tiles (one warpgroup stages its Q in a K stage)."""
    tile = BN * HD * 2
    if module == SM90:
        wgs = bm // 64
        return 128 * wgs, (2 * SM90_STAGES + (wgs if wgs > 1 else 0)) * tile + SWIZZLE_SLACK
    return GENERIC_THREADS, bm * HD * 2 + 2 * 2 * tile


def choose_bm(bms: tuple[int, ...], lengths: list[int], heads: int, sms: int) -> int:
    """Queries per CTA for segments of these lengths: the widest tile that still gives every SM
    a CTA. Warpgroups that share K/V tiles read them from L2 once for all, which on a
    power-capped GPU buys clock; a grid too small to fill the SMs loses more than that."""
    for bm in bms:
        if sum(-(-n // bm) for n in lengths) * heads >= sms:
            return bm
    return bms[-1]


def piece_rows(slots: dict[int, int]) -> int:
    """Rows the pieces leave at most, for `slots` CTAs a round at each query tile (0: a kernel
    without pieces): a tail is cut into at most MAX_PIECE_ROUNDS rounds of pieces."""
    return MAX_PIECE_ROUNDS * max((bm * n for bm, n in slots.items()), default=0)


def max_entries(p: int, heads: int, segments: int) -> int:
    """Work-list entries at most for p patches in at most `segments` segments: one per query
    tile and head at the smallest tile, each segment adding one partial tile; pieces (only ever
    one segment's) at most double the list (flash_work_list)."""
    return max(p // MIN_BM + segments, 2 * -(-p // MIN_BM)) * heads


class FlashWork(NamedTuple):
    """What the flash kernel of one grid runs: see flash_work_list."""

    bm: int  # queries per CTA
    tiles: np.ndarray  # int32 [n, 4], one entry per CTA
    first_piece: int  # entries from here on are pieces (== n: none)
    pieces: int  # pieces a query tile (0: none)


def tail_pieces(rem: int, slots: int, most: int) -> int:
    """Pieces each of a tail's `rem` CTAs is cut into: rem x p pieces take ceil(rem x p / slots)
    rounds of 1/p each. The fewest that keep 90% of those rounds' slots busy (24 CTAs left on
    132 slots: 5 pieces each, 120 busy); failing that, the p that finishes soonest; 0 where no
    cut beats the whole round the tail takes uncut."""
    best, best_time = 0, 1.0
    for p in range(2, most + 1):
        rounds = -(-rem * p // slots)
        if rounds >= p:  # no faster than uncut
            continue
        if 10 * rem * p >= 9 * rounds * slots:
            return p
        if rounds / p < best_time:
            best, best_time = p, rounds / p
    return best


def flash_work_list(segments: np.ndarray, bm: int, heads: int, slots: int = 0) -> FlashWork:
    """One int4 {segment start, length, first query, head | piece << 8 | pieces << 16} per bm-query
    tile and head, head by head (the CTAs in flight then share one head's K/V in L2).

    With one segment and `slots` CTAs a round (Kernels.flash_slots), the entries past the last
    whole round are cut into pieces, each over a range of the keys (tail_pieces says how many);
    the last piece of a query tile to finish merges them: uncut, a tail of a few CTAs takes as
    long as a whole round. Pieces never outnumber the entries, so the list at most doubles
    (max_entries). Only for one segment: with several, which images' tiles form the tail would
    depend on their order, and so would the last bits of their results."""
    entries = [(start, length, q0, head) for head in range(heads) for start, length in segments.tolist()
               for q0 in range(0, length, bm)]
    full, rem = divmod(len(entries), slots) if slots else (0, 0)
    pieces = 0
    if len(segments) == 1 and full and 0 < rem <= MAX_PIECE_GROUPS:
        seg_tiles = -(-int(segments[0, 1]) // BN)
        pieces = tail_pieces(rem, slots, min(MAX_PIECES, seg_tiles // MIN_PIECE_TILES,
                                             MAX_PIECE_ROUNDS * slots // rem, len(entries) // rem))
    if pieces < 2:
        return FlashWork(bm, np.array(entries, dtype=np.int32), len(entries), 0)
    first = len(entries) - rem
    cut = [(s, n, q0, head | i << 8 | pieces << 16) for s, n, q0, head in entries[first:] for i in range(pieces)]
    return FlashWork(bm, np.array(entries[:first] + cut, dtype=np.int32), first, pieces)


_SM90_KERNEL = re.compile(r"^FLASH_SM90\((\w+), (\d+)\)$", re.M)
_GENERIC_KERNEL = re.compile(r"^(flash_attention_hd\d+)\(", re.M)


def check_sources(directory: Path) -> None:
    """Refuse (InternalError) CUDA sources whose tile constants or instantiated kernels differ
    from this module's: the launch sizes above would then be wrong, and wrong shared-memory
    sizes or work lists read and write out of bounds."""
    generic = (directory / f"{GENERIC}.cu").read_text()
    sm90 = (directory / f"{SM90}.cu").read_text()
    want = {GENERIC: {"BM": BMS[GENERIC][0], "BN": BN, "THREADS": GENERIC_THREADS},
            SM90: {"HD": HD, "BN": BN, "STAGES": SM90_STAGES}}
    for module, text in ((GENERIC, generic), (SM90, sm90)):
        found = constants(text)
        wrong = {name: (value, found.get(name)) for name, value in want[module].items() if found.get(name) != value}
        if wrong:
            raise InternalError(f"{module}.cu disagrees with flash.py: " + ", ".join(
                f"{name} is {got} there, {value} here" for name, (value, got) in wrong.items()))
    kernels = {GENERIC: {name: BMS[GENERIC][0] for name in _GENERIC_KERNEL.findall(generic)},
               SM90: {name: 64 * int(wgs) for name, wgs in _SM90_KERNEL.findall(sm90)}}
    for module, found in kernels.items():
        expected = {kernel_name(module, bm): bm for bm in BMS[module]}
        if found != expected:
            raise InternalError(f"{module}.cu instantiates {sorted(found)} (queries a CTA {sorted(found.values())}); "
                                f"flash.py launches {sorted(expected)} ({sorted(expected.values())})")
