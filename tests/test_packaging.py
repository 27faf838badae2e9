"""The kernels ship with the package: an installed (non-editable) copy must find every
cuda_src/ file the loader pastes together, headers included."""

from __future__ import annotations

import fnmatch
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")
def test_package_data_covers_every_kernel_file():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["glmvit_cupy.cuda_src"] == "cuda_src"
    patterns = config["package-data"]["glmvit_cupy.cuda_src"]
    files = sorted(p.name for p in (ROOT / "cuda_src").iterdir())
    assert any(f.endswith(".cuh") for f in files) and any(f.endswith(".cu") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not missing, f"not shipped in the wheel: {missing}"
