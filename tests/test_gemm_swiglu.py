"""The fused gate|up kernel's host side reads its tiles from the CUDA source (written once there)."""

from __future__ import annotations

import pytest

from glmvit_cupy.errors import InternalError
from glmvit_cupy.gpu.gemm_swiglu import SOURCE, read_tiles
from glmvit_cupy.gpu.kernel_source import cuda_source_dir
from glmvit_cupy.tower.geometry import REAL

SM90_MAX_DYNAMIC_SMEM = 227 << 10  # per block, opted in (H100/H200)


def test_the_real_tower_fits_and_the_launch_fits_an_sm():
    t = read_tiles(cuda_source_dir())
    assert t.smem <= SM90_MAX_DYNAMIC_SMEM
    assert t.takes(REAL["hidden_size"], REAL["intermediate_size"])
    assert t.takes(REAL["out_hidden_size"], REAL["projection_intermediate_size"])
    assert not t.takes(REAL["hidden_size"] + t.bk // 2, REAL["intermediate_size"])
    assert t.tiles(t.bm + 1, 3 * t.bn) == 6


def _source_with(tmp_path, old: str, new: str):
    text = (cuda_source_dir() / SOURCE).read_text()
    assert old in text
    (tmp_path / SOURCE).write_text(text.replace(old, new))
    return tmp_path


def test_the_host_follows_the_kernels_constants(tmp_path):
    """Changing a tile in the .cu changes the launch: nothing is written twice."""
    base = read_tiles(cuda_source_dir())
    changed = read_tiles(_source_with(tmp_path, f"BK = {base.bk},", f"BK = {base.bk // 2},"))
    assert changed.bk == base.bk // 2 and changed.smem < base.smem


def test_a_constant_the_host_needs_must_stay_a_literal(tmp_path):
    with pytest.raises(InternalError, match="no literal constexpr int SROW_PAD"):
        read_tiles(_source_with(tmp_path, "constexpr int SROW_PAD = 8;", "constexpr int SROW_PAD = 4 + 4;"))
    with pytest.raises(InternalError, match="BM 128 != BN 64"):
        read_tiles(_source_with(tmp_path, "BN = 128,", "BN = 64,"))
