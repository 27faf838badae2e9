"""`GlmVit`: the library API over either backend.

    vit = GlmVit.from_pretrained("ckpt/", backend="auto")
    out = vit.forward(pixel_values, grid_thw)      # .last_hidden_state, .pooler_output
    per_image = vit.encode(["a.png", "b.jpg"])     # preprocessing + forward, one result each

`backend="numpy"` runs the float32 reference (`reference.py`) on the CPU; `"cupy"` runs the
GPU engine (`engine.py`); `"auto"` takes the GPU when CuPy sees one. Outputs are float32
arrays of the backend (NumPy or CuPy). CuPy is imported only when the GPU is asked for or
probed, so the package and the whole CPU path work without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .checkpoint import TowerWeights, bind_checkpoint
from .errors import GlmVitError
from .geometry import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS, GlmVitGeometry, patch_budget
from .layout import check_grid, merged_offsets, num_patches
from .preprocess import ImageLike, image_list, preprocess

BACKENDS = ("auto", "numpy", "cupy")


@dataclasses.dataclass(frozen=True)
class GlmVitOutput:
    """`last_hidden_state` (after the downsample) and `pooler_output` (after the merger), both
    float32 [merged tokens, out_hidden]; `grid_thw` [images, 3]; `offsets` [images + 1] into
    the merged-token rows."""

    last_hidden_state: Any
    pooler_output: Any
    grid_thw: np.ndarray
    offsets: np.ndarray

    def split(self) -> list[GlmVitOutput]:
        """One output per image (views of these arrays)."""
        parts = []
        for i in range(len(self.grid_thw)):
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            parts.append(GlmVitOutput(self.last_hidden_state[a:b], self.pooler_output[a:b],
                                      self.grid_thw[i:i + 1], np.array([0, b - a])))
        return parts


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when CuPy imports and sees a CUDA device, else (False, why not)."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return False, "no CUDA device"
        props = cupy.cuda.runtime.getDeviceProperties(0)
        return True, props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as exc:  # driver missing or broken: CuPy raises its own error types
        return False, f"no usable CUDA device ({type(exc).__name__})"


def _choose_backend(backend: str) -> tuple[str, str]:
    """(backend, a note saying why) for a requested backend; 'cupy' must have a GPU."""
    if backend not in BACKENDS:
        raise GlmVitError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if backend == "numpy":
        return "numpy", ""
    ok, why = gpu_available()
    if backend == "auto":
        return ("cupy", f"using the GPU ({why})") if ok else ("numpy", f"{why}: running the NumPy backend on the CPU (slow)")
    if not ok:
        raise GlmVitError(f"backend 'cupy': {why}")
    return "cupy", ""


def _check_type(name: str, value: Any, types: tuple[type, ...], expected: str) -> None:
    """A wrong argument type in the Python API is a user mistake: one line, not a traceback."""
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise GlmVitError(f"{name} is a {type(value).__name__}, expected {expected}")


def _check_options(max_pixels: Any, attention: Any, device: Any) -> None:
    for name, value in (("max_pixels", max_pixels), ("device", device)):
        _check_type(name, value, (int, type(None)), "an int or None")
    _check_type("attention", attention, (str, type(None)), "'flash', 'naive' or None")


def _refuse_nonfinite(out: GlmVitOutput, labels: Sequence[str], xp: Any) -> None:
    """Raise, naming the image, if any output value is NaN or Inf (the weights were checked at
    load, so the cause is the input or an activation beyond float32's range). xp: the outputs'
    array module (NumPy, or CuPy: one reduction on the device, one bool to the host)."""
    if bool(xp.isfinite(out.last_hidden_state).all() & xp.isfinite(out.pooler_output).all()):
        return
    rows = xp.isfinite(out.last_hidden_state).all(axis=1) & xp.isfinite(out.pooler_output).all(axis=1)
    rows = rows.get() if hasattr(rows, "get") else rows  # CuPy -> host
    bad = [i for i in range(len(out.grid_thw)) if not rows[out.offsets[i]:out.offsets[i + 1]].all()]
    t, h, w = out.grid_thw[bad[0]].tolist()
    more = f" (so does the output of {len(bad) - 1} more image(s))" if len(bad) > 1 else ""
    raise GlmVitError(f"{labels[bad[0]]} (grid_thw {t}x{h}x{w}): its embedding holds NaN/Inf{more}; the "
                      "weights are finite (checked at load), so non-finite pixel values or an activation "
                      "beyond float32's range made it")


class GlmVit:
    """The GLM-5.3-Flash vision tower bound to one checkpoint and one backend.

    One GlmVit may be shared by threads (a web service): on the GPU, calls take turns (the
    engine's scratch, CUDA graphs and uploaded tables are per engine); the NumPy backend keeps
    no state between calls, so its calls run concurrently."""

    def __init__(self, tower: Any, backend: str, backend_note: str) -> None:
        self.tower = tower
        self.backend = backend
        self.backend_note = backend_note  # why this backend (for the CLI's one-line notice)
        self.geometry: GlmVitGeometry = tower.geo
        self._turns = threading.Lock() if backend == "cupy" else contextlib.nullcontext()

    @classmethod
    def from_pretrained(cls, path: str | Path, backend: str = "auto", max_pixels: int | None = None,
                        attention: str | None = None, device: int | None = None) -> GlmVit:
        """Bind the tower in `path`. `max_pixels` is the pixel budget of one forward call (all
        images together) and sizes the GPU scratch; `attention` ("flash" or "naive", the
        materialised-score cross-check; default: the engine's choice for the head_dim) and
        `device` (a CUDA device index; default: the current one) apply to the GPU engine."""
        _check_type("path", path, (str, os.PathLike), "a checkpoint directory (str or Path)")
        _check_options(max_pixels, attention, device)  # before the tower is read
        backend, note = _choose_backend(backend)
        if backend == "numpy":
            return cls.from_weights(bind_checkpoint(path), "numpy", max_pixels, note=note)
        from .engine import CupyRuntime
        with ThreadPoolExecutor(max_workers=1) as pool:  # device set-up overlaps the read
            runtime = pool.submit(CupyRuntime, device)
            weights = bind_checkpoint(path)
            return cls.from_weights(weights, "cupy", max_pixels, attention, runtime=runtime.result(), note=note)

    @classmethod
    def from_weights(cls, weights: TowerWeights, backend: str = "auto", max_pixels: int | None = None,
                     attention: str | None = None, device: int | None = None, runtime: Any = None,
                     note: str = "") -> GlmVit:
        """An engine over weights already bound (`checkpoint.bind_checkpoint`): several engines,
        with their own budgets and devices, can share one read of the tower."""
        _check_type("weights", weights, (TowerWeights,), "TowerWeights (checkpoint.bind_checkpoint)")
        _check_options(max_pixels, attention, device)
        backend, auto_note = _choose_backend(backend)
        p_max = patch_budget(weights.location.geometry, max_pixels)
        if backend == "numpy":
            from .reference import NumpyTower
            return cls(NumpyTower(weights, p_max), "numpy", note or auto_note)
        from .engine import CupyTower
        options = {} if attention is None else {"attention": attention}
        return cls(CupyTower(weights, p_max, runtime=runtime, device=device, **options), "cupy", note or auto_note)

    @property
    def p_max(self) -> int:
        """Patch rows one forward call of this engine may carry."""
        return self.tower.p_max

    @property
    def scratch_bytes(self) -> int:
        """Device bytes the scratch takes for p_max patches (0 on the NumPy backend)."""
        return getattr(self.tower, "scratch_bytes", 0)

    def forward(self, pixel_values: Any, grid_thw: Any) -> GlmVitOutput:
        """pixel_values float [P, patch_dim] (NumPy or, on the GPU, CuPy) and grid_thw int [N, 3].
        An output holding NaN or Inf is refused (GlmVitError naming the image), never returned."""
        out = self._forward(pixel_values, grid_thw)
        labels = [f"image {i} of this forward call" for i in range(len(out.grid_thw))]
        _refuse_nonfinite(out, labels, self._xp())
        return out

    def _xp(self) -> Any:
        """The array module of this backend's outputs."""
        if self.backend == "cupy":
            import cupy
            return cupy
        return np

    def _forward(self, pixel_values: Any, grid_thw: Any) -> GlmVitOutput:
        geo = self.geometry
        arrays = (np.ndarray,) if self.backend == "numpy" else (np.ndarray, self._xp().ndarray)
        _check_type("pixel_values", pixel_values, arrays,
                    f"a {'NumPy or CuPy' if len(arrays) > 1 else 'NumPy'} float array [patches, "
                    f"{geo.patch_dim}] (glmvit_cupy.preprocess makes one)")
        if pixel_values.dtype.kind != "f":
            raise GlmVitError(f"pixel_values has dtype {pixel_values.dtype}, expected float32 "
                              "(normalised patches, as glmvit_cupy.preprocess makes them)")
        try:
            grid = np.asarray(grid_thw)
        except (TypeError, ValueError) as exc:
            raise GlmVitError(f"grid_thw is not an integer array [images, 3]: {exc}") from None
        grid = check_grid(grid, geo)
        patches = num_patches(grid)
        if tuple(pixel_values.shape) != (patches, geo.patch_dim):
            raise GlmVitError(f"pixel_values has shape {list(pixel_values.shape)}; grid_thw needs "
                              f"[{patches}, {geo.patch_dim}]")
        with self._turns:
            last_hidden, pooler = self.tower.forward(pixel_values, grid)
        return GlmVitOutput(last_hidden, pooler, grid, merged_offsets(grid, geo.merge_unit))

    def encode(self, images: ImageLike | Sequence[ImageLike],
               min_image_tokens: int = MIN_IMAGE_TOKENS,
               max_image_tokens: int = MAX_IMAGE_TOKENS) -> list[GlmVitOutput]:
        """Preprocess and encode images; one GlmVitOutput per image, in order. Images are packed
        into forward calls of at most p_max patches each. An output holding NaN or Inf is refused
        (GlmVitError naming the image's file or its index), never returned."""
        images = image_list(images)
        geo = self.geometry
        prepared = [preprocess(img, patch_size=geo.patch_size, temporal_patch_size=geo.temporal_patch_size,
                               merge_size=geo.spatial_merge_size, min_image_tokens=min_image_tokens,
                               max_image_tokens=max_image_tokens) for img in images]
        labels = [str(img) if isinstance(img, (str, Path)) else f"image {i}" for i, img in enumerate(images)]
        results: list[GlmVitOutput] = []
        batch: list[int] = []  # indices into prepared
        for i in range(len(prepared) + 1):
            full = batch and i < len(prepared) and sum(len(prepared[j][0]) for j in batch + [i]) > self.p_max
            if batch and (i == len(prepared) or full):
                out = self._forward(np.concatenate([prepared[j][0] for j in batch]),
                                    np.concatenate([prepared[j][1] for j in batch]))
                _refuse_nonfinite(out, [labels[j] for j in batch], self._xp())
                results.extend(out.split())
                batch = []
            if i < len(prepared):
                batch.append(i)
        return results
