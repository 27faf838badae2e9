"""Shared fixtures: synthetic checkpoints in the released form, written once per session."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from glmvit_cupy.tower.geometry import REAL, GlmVitGeometry
from glmvit_cupy.tower.synthetic import write_checkpoint


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests where CuPy or a CUDA device is missing (CI has neither)."""
    from glmvit_cupy.model import gpu_available

    ok, why = gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=1)


@pytest.fixture(scope="session")
def real_ckpt(tmp_path_factory):
    """`make-checkpoint --geometry real`: 24 blocks, 347 tensors, 1.05 GiB (GPU tests; the device
    check makes it once and names it in GLMVIT_REAL_CKPT)."""
    path = os.environ.get("GLMVIT_REAL_CKPT")
    if path:
        return Path(path)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "real", "real", seed=0)


@pytest.fixture(scope="session")
def real_width_ckpt(tmp_path_factory):
    """The real tower's widths (hidden 1024, 16 heads, out 4096, projection 10240) at depth 2."""
    geo = dataclasses.replace(GlmVitGeometry(**REAL), depth=2)
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "real_d2", geo, seed=2)
