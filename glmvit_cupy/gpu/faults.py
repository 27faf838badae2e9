"""GPU faults reported as one line, where they happen when asked.

A kernel that faults (an illegal or misaligned address) does not fail its launch: CUDA
reports the fault at the next synchronisation, and from then on every call in the process
fails with the same sticky error (cuBLAS then reports only an opaque status). So:
- every wait the engine and the stager make goes through `synchronize`, which turns a CUDA
  error into a GlmVitError saying what was waited for, what CUDA said, and that the process
  must be restarted;
- with GLMVIT_CHECK_LAUNCHES=1 (the GPU tests set it) every kernel launch and GEMM waits for
  itself outside graph captures (`Checked`), so the error names the launch that faulted, at
  the cost of a host round trip per launch. A captured graph is checked when it is replayed.
Separate from kernels.py and cublas.py because both use it, and the engine's waits too.
"""

from __future__ import annotations

import os
from typing import Any

import cupy

from ..errors import GlmVitError

CHECK_LAUNCHES_ENV = "GLMVIT_CHECK_LAUNCHES"
_CUDA_ERRORS = (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError)


def check_launches() -> bool:
    """Whether this process asked for per-launch checks (read when an engine is built)."""
    return os.environ.get(CHECK_LAUNCHES_ENV, "") not in ("", "0")


def fault(what: str, exc: Exception) -> GlmVitError:
    """The one-line error for a CUDA error met while waiting for (or launching) `what`."""
    hint = "" if check_launches() else f"; run with {CHECK_LAUNCHES_ENV}=1 to name the launch that faulted"
    return GlmVitError(f"the GPU failed in {what}: {exc}; a CUDA fault leaves this process's CUDA context "
                       f"unusable, so restart the process{hint}")


def synchronize(waitable: Any, what: str) -> None:
    """waitable.synchronize() (a stream or an event), with a CUDA error reported as a GlmVitError."""
    try:
        waitable.synchronize()
    except _CUDA_ERRORS as exc:
        raise fault(what, exc) from None


def check_stream(what: str, stream: cupy.cuda.Stream | None = None) -> None:
    """Checked mode's wait for `stream` (default: the current one) after a launch, skipped while
    it is being captured (a capture may not synchronise; its graph is checked when replayed)."""
    stream = stream or cupy.cuda.get_current_stream()
    try:
        if not stream.is_capturing():
            stream.synchronize()
    except _CUDA_ERRORS as exc:
        raise fault(what, exc) from None


class Checked:
    """A kernel function whose launches are followed by check_stream; launch errors (a bad grid,
    too much shared memory) become the same one line. Attributes are the kernel's."""

    def __init__(self, function: Any, what: str) -> None:
        self._function, self._what = function, what

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        try:
            self._function(*args, **kwargs)
        except _CUDA_ERRORS as exc:
            raise fault(self._what, exc) from None
        check_stream(self._what)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._function, name)

    def __setattr__(self, name: str, value: Any) -> None:  # max_dynamic_shared_size_bytes, say
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._function, name, value)
