"""`forward_flops` (the TFLOP/s every benchmark reports) against an independent count: the
multiply-adds of every matmul the NumPy reference performs in one forward, counted as it runs."""

from __future__ import annotations

import numpy as np

from glmvit_cupy.gpu.benchmark import forward_flops
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from glmvit_cupy.tower.reference import NumpyTower


class Counted(np.ndarray):
    """An array whose ufunc calls (`@` is np.matmul) run on plain arrays, counting the
    multiply-adds of each matmul; results stay Counted, so the count follows the data."""

    macs = 0

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        plain = [x.view(np.ndarray) if isinstance(x, Counted) else x for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, Counted) else o for o in out)
        if ufunc is np.matmul:
            a, b = plain
            Counted.macs += int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))) * a.shape[-2] * \
                a.shape[-1] * b.shape[-1]
        result = getattr(ufunc, method)(*plain, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return result.view(Counted) if isinstance(result, np.ndarray) else result


def test_forward_flops_counts_the_reference_matmuls(tiny_ckpt):
    tower = NumpyTower(bind_checkpoint(tiny_ckpt), p_max=1024)
    grid = np.array([[1, 8, 12], [2, 4, 6], [1, 2, 2]])  # images of different sizes, a two-frame grid
    p = int(grid.prod(axis=1).sum())
    pixels = np.random.default_rng(0).standard_normal((p, tower.geo.patch_dim)).astype(np.float32)
    Counted.macs = 0
    tower.forward(pixels.view(Counted), grid)
    assert Counted.macs > 0
    assert forward_flops(tower.geo, grid) == 2 * Counted.macs
