"""The fused gate|up GEMM + clamped SwiGLU's host side (gemm_swiglu_sm90.cu), CuPy-free.

The kernel hard-codes its tile sizes, stages and threads; the launch (grid, block, dynamic
shared memory) and the question "which MLP widths can it take" depend on them. So the host
reads them out of the source (`kernel_source.constants`) instead of writing them again, and the
CPU tests can check what the GPU side would launch. Apart from kernels.py for that reason, as
flash.py is for flash attention.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import InternalError
from .kernel_source import constants

SOURCE = "gemm_swiglu_sm90.cu"
_NAMES = ("BM", "BN", "BK", "STAGES", "SROW_PAD", "ALIGN", "THREADS")


@dataclasses.dataclass(frozen=True)
class GemmSwigluTiles:
    """BM rows of X, BN act columns (gate and up rows of W each) and BK of K a tile."""

    bm: int
    bn: int
    bk: int
    stages: int
    srow_pad: int
    align: int
    threads: int

    @property
    def smem(self) -> int:
        """Dynamic shared memory (bytes), laid out as the kernel does: STAGES stages of an X tile
        and a gate and an up W tile, the BF16 staging tile [BM][2 BN + SROW_PAD], alignment slack."""
        stage = self.bm * self.bk + 2 * self.bn * self.bk
        return 2 * (self.stages * stage + self.bm * (2 * self.bn + self.srow_pad)) + self.align

    def takes(self, k: int, inter: int) -> bool:
        """Whether an MLP of input width k and intermediate width inter comes in whole tiles."""
        return k % self.bk == 0 and inter % self.bn == 0

    def tiles(self, rows: int, inter: int) -> int:
        """Output tiles of a call: its CTAs, before the one-per-SM cap."""
        return inter // self.bn * -(-rows // self.bm)


def read_tiles(directory: Path) -> GemmSwigluTiles:
    """The kernel's constants from its source; InternalError if one is missing or not a literal."""
    found = constants((directory / SOURCE).read_text())
    missing = [name for name in _NAMES if name not in found]
    if missing:
        raise InternalError(f"{SOURCE} declares no literal constexpr int {', '.join(missing)}: the host sizes "
                            "the kernel's launch from them")
    tiles = GemmSwigluTiles(*(found[name] for name in _NAMES))
    if tiles.bm != tiles.bn:
        raise InternalError(f"{SOURCE}: BM {tiles.bm} != BN {tiles.bn}, but one TMA box shape (kernels.gate_up_map) "
                            "serves its X and W operands")
    return tiles
