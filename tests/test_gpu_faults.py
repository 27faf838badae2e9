"""The GPU context survives the caller: inputs that break a kernel's assumptions are copied, and a
fault that does happen is one line naming where. GPU only."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from glmvit_cupy import GlmVit
from glmvit_cupy.processor.preprocess import preprocess

from helpers import photo_like

pytestmark = pytest.mark.gpu
CHECK_LAUNCHES_ENV = "GLMVIT_CHECK_LAUNCHES"  # glmvit_cupy.gpu.faults imports CuPy; checked against it below


@pytest.fixture(scope="module")
def case(tiny_ckpt, tmp_path_factory):
    from PIL import Image

    path = tmp_path_factory.mktemp("img") / "a.png"
    Image.fromarray(photo_like(96, 128, 3)).save(path)
    pixels, grid = preprocess(path)
    vit = GlmVit.from_pretrained(tiny_ckpt, backend="cupy")
    yield vit, pixels, grid
    vit.close()


def test_inputs_that_break_a_kernels_assumptions_are_copied(case):
    """A contiguous view at an odd offset passes every shape and dtype check; f32_to_bf16 reads
    float4s and would fault on it. So would other layouts without the engine's copy."""
    import cupy

    vit, pixels, grid = case
    want = vit.forward(pixels, grid).last_hidden_state.get()
    flat = cupy.zeros(pixels.size + 1, dtype=cupy.float32)
    flat[1:] = cupy.asarray(pixels).reshape(-1)
    odd = flat[1:].reshape(pixels.shape)
    assert odd.flags.c_contiguous and odd.data.ptr % 16 == 4
    transposed = cupy.asfortranarray(cupy.asarray(pixels))
    for name, given in (("misaligned view", odd), ("Fortran order", transposed),
                        ("float16", cupy.asarray(pixels).astype(cupy.float16)),
                        ("float64", cupy.asarray(pixels, dtype=cupy.float64))):
        got = vit.forward(given, grid).last_hidden_state.get()
        tol = 0 if name != "float16" else 2e-2  # float16 input rounds the pixels themselves
        assert np.abs(got - want).max() <= tol * np.abs(want).max(), name
    # The engine still works after all of them (a fault would have killed the context).
    np.testing.assert_array_equal(vit.forward(pixels, grid).last_hidden_state.get(), want)


def _run(code: str, check: bool) -> subprocess.CompletedProcess:
    env = {"PYTHONUNBUFFERED": "1", CHECK_LAUNCHES_ENV: "1" if check else "0"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


# A deliberate fault: f32_to_bf16 on a float32 view 4 bytes past an allocation (float4 loads
# need 16-byte alignment). The launch itself succeeds; the fault shows at the next wait.
_FAULT = """
import cupy
from glmvit_cupy.errors import GlmVitError
from glmvit_cupy.gpu.engine import CupyRuntime
k = CupyRuntime().kernels
src = cupy.zeros(4 * 4096 + 1, dtype=cupy.float32)[1:]
dst = cupy.empty(4 * 4096, dtype=cupy.uint16)
try:
    k.f32_to_bf16(src, dst)
    cupy.cuda.get_current_stream().synchronize()
    print("NO ERROR")
except GlmVitError as exc:
    print("GlmVitError:", exc)
"""


def test_a_fault_is_one_line_naming_the_kernel_in_checked_mode():
    proc = _run(_FAULT, check=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith("GlmVitError: the GPU failed in kernel f32_to_bf16:"), line
    assert "misaligned" in line.lower() and "restart the process" in line, line


def test_a_fault_met_at_the_engines_wait_is_one_line():
    """Unchecked, the fault surfaces at the forward's own wait (faults.synchronize): still one
    line, which says how to find the launch."""
    code = _FAULT.replace("cupy.cuda.get_current_stream().synchronize()",
                          "from glmvit_cupy.gpu.faults import synchronize; "
                          "synchronize(cupy.cuda.get_current_stream(), 'the test wait')")
    proc = _run(code, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip()
    assert line.startswith("GlmVitError: the GPU failed in the test wait:"), line
    assert f"{CHECK_LAUNCHES_ENV}=1" in line, line


def test_checked_mode_gives_the_same_outputs(case, tiny_ckpt, monkeypatch):
    """Checked mode waits after each launch (and checks replayed graphs): results unchanged,
    eager, captured and replayed."""
    from glmvit_cupy.gpu import faults

    assert faults.CHECK_LAUNCHES_ENV == CHECK_LAUNCHES_ENV
    vit, pixels, grid = case
    want = vit.forward(pixels, grid).last_hidden_state.get()
    monkeypatch.setenv(CHECK_LAUNCHES_ENV, "1")
    checked = GlmVit.from_pretrained(tiny_ckpt, backend="cupy")
    try:
        assert checked.tower.check_launches
        for _ in range(3):  # eager, then captured, then replayed
            np.testing.assert_array_equal(checked.forward(pixels, grid).last_hidden_state.get(), want)
    finally:
        checked.close()
