"""What the library hands back: `GlmVitOutput` (an image's or a forward call's embeddings, grid and
offsets), `Timing` (where a batcher request's time went), and the checks and conversions every
path that returns them shares (`GlmVit.encode`, `encode_iter`, the batcher, Ray's options).

Separate from model.py so that the batcher, which makes these results, does not import the class
that makes batchers (model.GlmVit.batcher): the results are a floor below both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .bf16 import bf16_array
from .collection.pipeline import OUTPUTS
from .collection.staging import check_dtype
from .errors import GlmVitError


@dataclasses.dataclass(frozen=True)
class Timing:
    """Where a batcher request's time went, in seconds: `queue_s` from submit until its batch
    reached the engine (its decode included), `decode_s` the decode itself, `inference_s` its
    batch's forward and transfers, `total_s` from submit to the result."""

    queue_s: float
    decode_s: float
    inference_s: float
    total_s: float


@dataclasses.dataclass(frozen=True)
class GlmVitOutput:
    """`last_hidden_state` (after the downsample) and `pooler_output` (after the merger), [merged
    tokens, out_hidden] each (None where that output was not asked for); `grid_thw` [images, 3];
    `offsets` [images + 1] into the merged-token rows. `error`: with on_error="return", why this
    image has no embedding (its arrays are None). `timing`: a batcher's result's Timing."""

    last_hidden_state: Any
    pooler_output: Any
    grid_thw: np.ndarray
    offsets: np.ndarray
    error: str | None = None
    timing: Timing | None = None

    def split(self) -> list[GlmVitOutput]:
        """One output per image (views of these arrays)."""
        parts = []
        for i in range(len(self.grid_thw)):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            rows = [None if x is None else x[a:b] for x in (self.last_hidden_state, self.pooler_output)]
            parts.append(GlmVitOutput(*rows, self.grid_thw[i:i + 1], np.array([0, b - a])))
        return parts


def check_output_options(output: Any, dtype: Any) -> tuple[str, ...]:
    """The output names an `output` option asks for, once it and `dtype` are checked."""
    if output not in OUTPUTS:
        raise GlmVitError(f"output {output!r}: expected one of {', '.join(OUTPUTS)}")
    check_dtype(dtype)
    return OUTPUTS[output]


def library_output(arrays: dict[str, np.ndarray], grid_thw: np.ndarray, dtype: str,
                   timing: Timing | None = None) -> GlmVitOutput:
    """One image's rows as the library returns them: BF16 as ml_dtypes.bfloat16 values."""
    def value(name: str) -> np.ndarray | None:
        array = arrays.get(name)
        return bf16_array(array) if array is not None and dtype == "bfloat16" else array

    rows = len(next(iter(arrays.values())))
    return GlmVitOutput(value("last_hidden_state"), value("pooler_output"), np.asarray(grid_thw).reshape(1, 3),
                        np.array([0, rows]), timing=timing)


def failed_output(error: str) -> GlmVitOutput:
    """An image's result under on_error="return" when it failed."""
    return GlmVitOutput(None, None, np.zeros((1, 3), np.int64), np.zeros(2, np.int64), error=error)
