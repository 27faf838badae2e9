"""`GlmVit`: the library API over either backend.

    vit = GlmVit.from_pretrained("ckpt/", backend="auto")   # or "org/name" from the HF cache
    out = vit.forward(pixel_values, grid_thw)      # .last_hidden_state, .pooler_output
    per_image = vit.encode(["a.png", "b.jpg"])     # preprocessing + forward, one result each

`vit.processor` is the image processor's settings: the checkpoint's preprocessor_config.json
where it has one, keyword arguments of `from_pretrained` overriding it.

`backend="numpy"` runs the float32 reference (`reference.py`) on the CPU; `"cupy"` runs the
GPU engine (`engine.py`); `"auto"` takes the GPU when CuPy sees one. Outputs are float32
arrays of the backend (NumPy or CuPy). CuPy is imported only when the GPU is asked for or
probed, so the package and the whole CPU path work without it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from PIL import Image

from .collection.pipeline import DEFAULT_OUTPUT, DEFAULT_WORKERS, Decoder, StreamTurn, stream_in_turn
from .collection.staging import DEFAULT_DTYPE, make_stager
from .errors import GlmVitError, InputError
from .hub import resolve_model
from .outputs import GlmVitOutput, check_output_options, failed_output, library_output
from .processor.preprocess import (EncodedImage, ImageLike, ProcessorConfig, check_processor, image_input,
                                   processor_config, with_settings)
from .tower.checkpoint import TowerWeights, bind_checkpoint
from .tower.geometry import GlmVitGeometry, patch_budget
from .tower.layout import check_grid, merged_offsets, num_patches

BACKENDS = ("auto", "numpy", "cupy")
# The GPU engine's kernel sets: auto takes the Hopper ones (wgmma flash attention, the fused
# gate|up GEMM + SwiGLU) on sm_90, else the generic ones (mma.sync flash attention, cuBLAS +
# swiglu_clamp), which run on any GPU from sm_80; naming one forces it (the tests run both).
KERNELS = ("auto", "generic", "hopper")


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


def check_kernels(kernels: Any) -> None:
    """Refuse, in one line, a kernel set not among KERNELS (GlmVit, devices.EngineGroup)."""
    if kernels not in KERNELS:
        raise GlmVitError(f"kernels {kernels!r}: expected one of {', '.join(KERNELS)}")


def _check_options(max_pixels: Any, attention: Any, device: Any, kernels: Any) -> None:
    for name, value in (("max_pixels", max_pixels), ("device", device)):
        _check_type(name, value, (int, type(None)), "an int or None")
    _check_type("attention", attention, (str, type(None)), "'flash', 'naive' or None")
    check_kernels(kernels)


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

    One GlmVit may be shared by threads, each of which may call it first: on the GPU, calls take
    turns (the engine's scratch, CUDA graphs and uploaded tables are per engine); on the NumPy
    backend, which keeps no state between calls, forward calls run concurrently and encode
    streams take turns (they share the decode pool). A service whose requests come one image
    at a time wants `batcher()`, which packs them into shared forward calls. `with GlmVit...`
    closes it (its decode workers) at the end of the block."""

    def __init__(self, tower: Any, backend: str, backend_note: str, fingerprint: str,
                 processor: ProcessorConfig, directory: Path | None = None) -> None:
        self.tower = tower
        self.backend = backend
        self.backend_note = backend_note  # why this backend (for the CLI's one-line notice)
        self.geometry: GlmVitGeometry = tower.geo
        self.fingerprint = fingerprint  # of the tower's bytes: output directories record it
        self.directory = directory  # the checkpoint's: encode_video reads its video processor config there
        check_processor(processor, self.geometry)
        self.processor = processor
        self._pool: Decoder | None = None
        self._stager: tuple[ProcessorConfig, Any] | None = None  # encode_iter's, kept across calls
        self._engine_lock = threading.Lock() if backend == "cupy" else contextlib.nullcontext()  # forward
        # One encode stream at a time: streams share the decode pool (rebuilt for other settings)
        # and, on the GPU, the engine's buffers, which forward uses too (the same lock there).
        self._stream_turn = StreamTurn(self._engine_lock if backend == "cupy" else threading.Lock(),
                                   "an encode_iter loop of the same GlmVit")

    @classmethod
    def from_pretrained(cls, path: str | Path, backend: str = "auto", max_pixels: int | None = None,
                        attention: str | None = None, device: int | None = None, kernels: str = "auto",
                        **processor_settings: Any) -> GlmVit:
        """Bind the tower in `path`: a checkpoint directory, or a Hugging Face repo id
        (`org/name`, `org/name@revision`) in the local cache (`hub.resolve_model`). `max_pixels`
        is the pixel budget of one forward call (all images together) and sizes the GPU
        scratch (default: one image at the processor's max_image_tokens); `attention` ("flash"
        or "naive", the materialised-score cross-check; default: the engine's choice for the
        head_dim), `device` (a CUDA device index; default: the current one) and `kernels` (one
        of KERNELS) apply to the GPU engine. `processor_settings` (ProcessorConfig fields; None
        leaves one alone) override the checkpoint's preprocessor_config.json."""
        _check_type("path", path, (str, os.PathLike), "a checkpoint directory or a repo id (str or Path)")
        _check_options(max_pixels, attention, device, kernels)  # before the tower is read
        backend, note = _choose_backend(backend)
        directory = resolve_model(path)
        processor, _ = processor_config(directory, **processor_settings)
        if backend == "numpy":
            return cls.from_weights(bind_checkpoint(directory), "numpy", max_pixels, note=note, processor=processor)
        from .gpu.engine import CupyRuntime
        with ThreadPoolExecutor(max_workers=1) as pool:  # device set-up overlaps the read
            runtime = pool.submit(CupyRuntime, device, kernels)
            weights = bind_checkpoint(directory)
            return cls.from_weights(weights, "cupy", max_pixels, attention, runtime=runtime.result(), note=note,
                                    processor=processor, kernels=kernels)

    @classmethod
    def from_weights(cls, weights: TowerWeights, backend: str = "auto", max_pixels: int | None = None,
                     attention: str | None = None, device: int | None = None, runtime: Any = None,
                     note: str = "", processor: ProcessorConfig | None = None, kernels: str = "auto") -> GlmVit:
        """An engine over weights already bound (`checkpoint.bind_checkpoint`): several engines,
        with their own budgets and devices, can share one read of the tower. `processor`
        defaults to the settings of the checkpoint's own directory (`processor_config`)."""
        _check_type("weights", weights, (TowerWeights,), "TowerWeights (checkpoint.bind_checkpoint)")
        _check_options(max_pixels, attention, device, kernels)
        backend, auto_note = _choose_backend(backend)
        directory = weights.location.shards[0].parent
        if processor is None:
            processor, _ = processor_config(directory)
        p_max = patch_budget(weights.location.geometry, max_pixels, processor.max_image_tokens)
        fingerprint = weights.fingerprint()
        if backend == "numpy":
            from .tower.reference import NumpyTower
            return cls(NumpyTower(weights, p_max), "numpy", note or auto_note, fingerprint, processor, directory)
        from .gpu.engine import CupyTower
        options = {} if attention is None else {"attention": attention}
        tower = CupyTower(weights, p_max, runtime=runtime, device=device, kernels=kernels, **options)
        return cls(tower, "cupy", note or auto_note, fingerprint, processor, directory)

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
        if self.backend == "cupy" and self._stream_turn.held_here():
            raise GlmVitError("forward called inside an encode_iter loop of the same GPU GlmVit (whose batches "
                              "are staged in the engine's buffers): finish or close that loop first")
        with self._engine_lock:
            last_hidden, pooler = self.tower.forward(pixel_values, grid)
        out = GlmVitOutput(last_hidden, pooler, grid, merged_offsets(grid, geo.merge_unit))
        _refuse_nonfinite(out, [f"image {i} of this forward call" for i in range(len(grid))], self._xp())
        return out

    def _xp(self) -> Any:
        """The array module of this backend's outputs."""
        if self.backend == "cupy":
            import cupy
            return cupy
        return np

    def encode_iter(self, images: Iterable[ImageLike], *, output: str = DEFAULT_OUTPUT, dtype: str = DEFAULT_DTYPE,
                    on_error: str = "raise", workers: int | None = None, min_image_tokens: int | None = None,
                    max_image_tokens: int | None = None) -> Iterator[tuple[Any, GlmVitOutput]]:
        """Yield (image, its GlmVitOutput) for each of `images` (paths, bytes, file objects, PIL
        images, HxWx3 uint8 arrays, or any iterable of them), in order, as they complete:
        decoding runs in `workers` processes (default: the usable cores but one; 0: in this
        thread), images are packed into forward calls of at most p_max patches, and memory stays
        bounded however many images come. `output` ("pooler", "last_hidden" or "both") and
        `dtype` ("bfloat16", as ml_dtypes.bfloat16 arrays, "float16" or "float32") are made on
        the device; outputs are NumPy arrays on every backend. A failing image raises InputError
        naming it, after every image before it was yielded (on_error="raise"), or comes back as
        an output whose `error` says why (on_error="return"). Threads sharing this GlmVit take
        turns (a loop not run to its end holds the turn until it is closed or dropped)."""
        outputs = check_output_options(output, dtype)
        if on_error not in ("raise", "return"):
            raise GlmVitError(f"on_error {on_error!r}: expected 'raise' or 'return'")
        items = (image_input(image, f"image {i}") for i, image in enumerate(images))
        with self.stream_turn():
            processor = self._processor(min_image_tokens, max_image_tokens)
            n = DEFAULT_WORKERS if workers is None else workers
            decoder = self._decoder(n, processor)
            for result in stream_in_turn(self, items, outputs=outputs, dtype=dtype, processor=processor,
                                         decoder=decoder, stager=self._staging(processor)):
                if result.error is None:
                    yield result.item, library_output(result.arrays, result.grid_thw, dtype)
                elif on_error == "return":
                    yield result.item, failed_output(result.error)
                else:
                    raise InputError(result.error)

    def stream_turn(self, what: str = "encode") -> contextlib.AbstractContextManager[None]:
        """This GlmVit's encode-stream turn, held while a stream runs (pipeline.stream and
        encode_iter take it): one stream at a time, since streams share the decode pool and, on
        the GPU, the engine's buffers. A stream inside a stream of the same thread is refused."""
        return self._stream_turn(what)

    def engine_turn(self) -> contextlib.AbstractContextManager[Any]:
        """Held around each use of the engine's buffers outside a stream (a forward, a batcher's
        batch): on the GPU the same lock as the stream turn, so they take turns with streams."""
        return self._engine_lock

    def encode(self, images: ImageLike | Sequence[ImageLike], *, output: str = DEFAULT_OUTPUT,
               dtype: str = DEFAULT_DTYPE, on_error: str = "raise", workers: int | None = None,
               min_image_tokens: int | None = None, max_image_tokens: int | None = None) -> list[GlmVitOutput]:
        """Preprocess and encode images; one GlmVitOutput per image, in order, a repeated image
        once per mention (encode_iter, whose options these are)."""
        if isinstance(images, (str, Path, np.ndarray, Image.Image, EncodedImage, bytes, bytearray, memoryview)) \
                or hasattr(images, "read"):
            images = [images]  # one image (bytes too: not iterated as ints)
        elif not isinstance(images, Iterable):
            raise GlmVitError(f"cannot encode a {type(images).__name__}: pass a path, bytes, a file object, a PIL "
                              "image, an HxWx3 uint8 array, or a list of them")
        return [out for _, out in self.encode_iter(images, output=output, dtype=dtype, on_error=on_error,
                                                    workers=workers, min_image_tokens=min_image_tokens,
                                                    max_image_tokens=max_image_tokens)]

    def encode_video(self, video: Any, *, config: Any = None, min_image_tokens: int | None = None,
                     max_image_tokens: int | None = None) -> Any:
        """Embed one video: a path, its bytes or a binary file-like (decoded with PyAV, the [video]
        extra), or (frames, timestamps) decoded by the caller (HxWx3 uint8 frames, seconds each).
        Preprocessed as transformers' Glm5NextVideoProcessor with `config` (a video.VideoConfig;
        default: the checkpoint's own, `video.video_config(vit.directory)`, as transformers reads
        it) and the token budget given here; embedded as get_video_features embeds
        it. Temporal groups go through forward calls of at most p_max patches, cut at group
        boundaries (attention never crosses a group, so this is exact). Returns a
        video.VideoOutput of float32 NumPy arrays."""
        from .processor.video import (VideoConfig, VideoOutput, check_video_config, load, video_config,
                                      with_video_settings)

        _check_type("config", config, (VideoConfig, type(None)), "a glmvit_cupy.processor.video.VideoConfig or None")
        config = with_video_settings(config or video_config(self.directory)[0], min_image_tokens=min_image_tokens,
                                     max_image_tokens=max_image_tokens)
        check_video_config(config, self.geometry)
        frames = load(video, config)
        per_group = frames.patches_per_group
        if per_group > self.p_max:
            raise GlmVitError(f"{frames.name}: one temporal group is {per_group} patches, over the {self.p_max} "
                              "of one forward call of this engine: raise max_pixels or lower max_image_tokens")
        step = self.p_max // per_group
        _, h, w = frames.grid_thw[0].tolist()
        last_hidden, pooler = [], []
        for first in range(0, frames.groups, step):
            stop = min(first + step, frames.groups)
            try:
                out = self.forward(frames.pixel_values(first, stop), [[stop - first, h, w]])
            except GlmVitError as exc:
                raise GlmVitError(f"{frames.name}, temporal groups {first}-{stop - 1}: {exc}") from None
            for parts, array in ((last_hidden, out.last_hidden_state), (pooler, out.pooler_output)):
                parts.append(array.get() if hasattr(array, "get") else array)  # CuPy -> host
        return VideoOutput(np.concatenate(last_hidden), np.concatenate(pooler), frames.grid_thw,
                           np.array(frames.group_timestamps, dtype=np.float64), len(frames.frames), frames.fps)

    def batcher(self, *, max_wait_ms: float | None = None, max_queue: int | None = None,
                timeout_s: float | None = None, workers: int | None = None, on_batch: Any = None) -> Any:
        """A Batcher (batcher.py): requests from any number of threads or coroutines, one image
        each, packed into shared forward calls as they arrive. None takes batcher.py's defaults."""
        from .batcher import Batcher
        return Batcher(self, max_wait_ms=max_wait_ms, max_queue=max_queue, timeout_s=timeout_s, workers=workers,
                       on_batch=on_batch)

    def _processor(self, min_image_tokens: int | None, max_image_tokens: int | None) -> ProcessorConfig:
        """vit.processor with this call's budget (None: the processor's own)."""
        processor = with_settings(self.processor, min_image_tokens=min_image_tokens,
                                  max_image_tokens=max_image_tokens)
        check_processor(processor, self.geometry)
        return processor

    def _decoder(self, workers: int, processor: ProcessorConfig) -> Decoder:
        """The decode pool, kept across calls (a service encoding a request at a time pays for
        starting the processes once); each input carries its processor settings."""
        if self._pool is None or self._pool.workers != workers:
            self._close_pool()
            self._pool = Decoder(workers, processor)
        return self._pool

    def _staging(self, processor: ProcessorConfig) -> Any:
        """encode_iter's stager, kept across calls like the pool: on the GPU it holds ~200 MB of
        pinned host memory and the device output buffers, too costly to allocate per request."""
        if self._stager is None or self._stager[0] != processor:
            self._stager = (processor, make_stager(self, processor))
        return self._stager[1]

    def close(self) -> None:
        """Stop the decode workers (they also stop when the process exits), once an encode stream
        another thread runs is done."""
        with self.stream_turn("close"):
            self._close_pool()

    def __enter__(self) -> GlmVit:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _close_pool(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
