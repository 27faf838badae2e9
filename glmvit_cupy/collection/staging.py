"""Batches of uint8 canvases (and videos' frames) in, embeddings out, with the transfers off the engine's path.

The collection pipeline hands an engine one packed batch at a time (`submit`) and collects
it later (`Pending.result`), so that batch k+1's upload runs while batch k computes:

  host            upload stream           engine stream                 download stream
  canvases of k+1 -> pinned slot (k+1) % 2
                  H2D slot -> staging,
                  once the engine has
                  read batch k's
                                          patchify (uint8 -> BF16
                                          pixels), tables into the
                                          index slab, the forward, the
                                          outputs cast to the asked dtype
                                                                        D2H -> pinned output slot
  result(k): wait, copy out of the slot

Every host<->device copy is from pinned memory on a copy stream: a copy from pageable memory
can synchronise with the engine's stream and stall the host for a whole forward. Uploads and
downloads have a stream each: on one, batch k+1's upload would queue behind batch k's
download, which waits for the end of k's forward, and the engine would idle between them.
One staging buffer and one device output buffer suffice (each is read early in, or written
late in, a forward); the host side has two slots of each so that filling one never waits.
The NumPy backend has the same interface and does the work in `submit`.

A batch's pixels are a list, in the order of the grid's rows: an image's canvas [H, W, 3] (grid
row (1, h, w): its one frame stands for both of a patch's temporal frames, as the image processor
repeats it), or a video's frames on their canvas [2k, H, W, 3], k temporal groups of two frames
(a grid row (g, h, w) may come as several such arrays, whose k add up to g: the pipeline passes a
video's groups as they were received, never joined). Each kind is normalised with its own processor's table: the image processor's
(preprocess.pixel_table) and the video processor's (video.video_pixel_table), whose arithmetic
differs in the last bits. The stager of a run that takes videos is made with the video
settings, and holds room for two frames a patch.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from ..bf16 import f32_to_bf16_bits
from ..errors import GlmVitError, InternalError
from ..processor.preprocess import ProcessorConfig, patchify, pixel_table
from ..processor.video import VideoConfig, patchify_frames, video_pixel_table
from ..tower.layout import merged_offsets
from ..tower.writer import flat_bytes

DTYPES = {"bfloat16": (np.uint16, "BF16"), "float16": (np.float16, "F16"), "float32": (np.float32, "F32")}
DEFAULT_DTYPE = "bfloat16"  # of every output the package makes: shards, the library, Ray (what the LM consumes)
OUTPUT_NAMES = ("pooler_output", "last_hidden_state")
_ALIGN = 256


def check_dtype(dtype: object) -> None:
    """Refuse, in one line, an output dtype not among DTYPES."""
    if dtype not in DTYPES:
        raise GlmVitError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")


def host_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the output dtype on the host (BF16 as its uint16 bits, rounded to nearest even)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    return x.astype(DTYPES[dtype][0], copy=False)


def finite_rows(array, dtype: str):
    """Per row of an output in `dtype` (NumPy or CuPy): True where it holds no NaN or Inf (BF16
    as its bits: the exponent all ones). A float16 output that overflowed is not finite either.
    The array module's own functions, not operators: a CuPy array's `&` or `!=` with a Python
    int goes through NumPy's ufunc and CuPy's __array_ufunc__, whose first call imports
    cupyx.scipy.special (with it scipy.sparse and numpy.f2py: ~1.2 s of a run's first batch on
    the H200, benchmarks/NOTES.md)."""
    if isinstance(array, np.ndarray):
        xp = np
    else:
        import cupy as xp
    if dtype == "bfloat16":
        return xp.not_equal(xp.bitwise_and(array, 0x7F80), 0x7F80).all(axis=1)
    return xp.isfinite(array).all(axis=1)


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Pending:
    """One submitted batch: `result()` waits for it and returns {output name: host array
    [merged tokens, out_hidden]} in the asked dtype; then `finite` (bool per row: no NaN or Inf
    in any output), `grid_thw` and `offsets` describe it."""

    def __init__(self, grid_thw: np.ndarray, offsets: np.ndarray, arrays: dict | None = None,
                 finite: np.ndarray | None = None, collect=None, engine: int = 0) -> None:
        self.grid_thw, self.offsets = grid_thw, offsets
        self._arrays, self.finite, self._collect = arrays, finite, collect
        self.engine = engine  # which of the stager's engines ran it (devices.EngineGroup has several)
        self.gpu_ms = 0.0  # the engine stream's time on this batch (CUDA events), 0 on the CPU

    def result(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays, self.finite, self.gpu_ms = self._collect()
            self._collect = None
        return self._arrays


def _no_video(pixels: np.ndarray) -> None:
    if pixels.ndim == 4:
        raise InternalError("a video's frames reached a stager made without video settings")


class NumpyStager:
    """The NumPy backend's side of the interface: patchify with the same tables, forward, cast."""

    depth = 2  # batches a stream keeps submitted (the CUDA stager's; here submit does the work)
    engines = 1

    def __init__(self, tower, processor: ProcessorConfig, video: VideoConfig | None = None) -> None:
        self.tower, self.processor, self.video = tower, processor, video

    def _pixel_values(self, pixels: np.ndarray) -> np.ndarray:
        if pixels.ndim == 3:
            return patchify(pixels, self.processor)
        if self.video is None:
            _no_video(pixels)
        return patchify_frames(pixels, self.video)

    def warm_up(self, outputs: Sequence[str], dtype: str) -> None:
        """Nothing: the CPU's first batch costs what the others do."""

    def submit(self, canvases: Sequence[np.ndarray], grid_thw: np.ndarray, outputs: Sequence[str],
               dtype: str) -> Pending:
        pixels = np.concatenate([self._pixel_values(c) for c in canvases])
        last_hidden, pooler = self.tower.forward(pixels, grid_thw)
        produced = {"pooler_output": pooler, "last_hidden_state": last_hidden}
        arrays = {name: host_cast(produced[name], dtype) for name in outputs}
        finite = np.logical_and.reduce([finite_rows(a, dtype) for a in arrays.values()])
        return Pending(grid_thw, merged_offsets(grid_thw, self.tower.geo.merge_unit), arrays, finite)


class CupyStager:
    """Pinned slots, the upload and download streams and the device buffers around one CupyTower.
    Each batch names its outputs and dtype; their buffers are made when first asked for (and
    remade larger for a wider dtype), so a run of BF16 poolers holds no float32 copies."""

    depth = 2  # batches a stream keeps submitted: k + 1 uploads while k computes (two slots)
    engines = 1

    def __init__(self, tower, processor: ProcessorConfig, video: VideoConfig | None = None) -> None:
        import cupy

        self.cupy, self.tower, self.video = cupy, tower, video
        geo, p_max = tower.geo, tower.p_max
        self.m_max, self.width = p_max // geo.merge_unit, geo.out_hidden_size
        self.patch, self.temporal = processor.patch_size, processor.temporal_patch_size
        canvas_bytes = check_pixel_bytes(p_max, processor, video)
        # staging: canvases | images [n, 4] | positions [P, 2] | work list [tiles, 4] | QKV map
        # (a table entry is an image or a video's temporal group: each is at least one merged token)
        self.capacity = (_up(canvas_bytes) + _up(16 * self.m_max) + _up(8 * p_max)
                         + _up(16 * tower.plan.max_tiles) + _ALIGN)
        with tower.current():
            self.up_stream = cupy.cuda.Stream(non_blocking=True)
            self.down_stream = cupy.cuda.Stream(non_blocking=True)
            self.staging = cupy.empty(self.capacity, dtype=cupy.uint8)
            # patchify.cu's tables: [0] images', [1] video groups' (the images' again where there are none)
            self.table = cupy.asarray(np.stack([pixel_table(processor),
                                                pixel_table(processor) if video is None else video_pixel_table(video)]))
            self.pinned_in = [self._pinned(self.capacity) for _ in range(2)]
            self.device_finite = cupy.empty(self.m_max, dtype=cupy.bool_)
            self.pinned_finite = [self._pinned(self.m_max).view(np.bool_) for _ in range(2)]
        self.device_out: dict[str, object] = {}  # output name -> raw device bytes
        self.pinned_out: list[dict[str, np.ndarray]] = [{}, {}]  # per slot: output name -> raw pinned bytes
        self.uploaded_events = [None, None]  # per input slot: its H2D, before the host refills it
        self.slot_pending: list[Pending | None] = [None, None]  # per output slot: who must collect first
        self.consumed = None  # the engine has read the staging buffer (the last batch's)
        self.downloaded = None  # the device output buffer has reached the host (the last batch's)
        self.batches = 0

    def _pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def _output_buffers(self, slot: int, outputs: Sequence[str], dtype: str) -> None:
        """Make (or enlarge) the device and slot buffers of these outputs for dtype. The slot's
        last batch has been collected; the device buffer's last download is waited for."""
        from ..gpu.faults import synchronize
        nbytes = self.m_max * self.width * np.dtype(DTYPES[dtype][0]).itemsize
        for name in outputs:
            if name not in self.device_out or self.device_out[name].nbytes < nbytes:
                if self.downloaded is not None:
                    synchronize(self.downloaded, "the download of the pipeline's outputs")
                self.device_out[name] = self.cupy.empty(nbytes, dtype=self.cupy.uint8)
            if name not in self.pinned_out[slot] or self.pinned_out[slot][name].nbytes < nbytes:
                self.pinned_out[slot][name] = self._pinned(nbytes)

    def warm_up(self, outputs: Sequence[str], dtype: str) -> None:
        """Pay what this stager's first batch of `outputs` in `dtype` would pay once, now (a
        stream does it on a thread while its first inputs decode): the engine's warm-up, both
        slots' output buffers, and the first call of the finite check's CuPy kernels at their
        size (~0.2 s in all on the H200, benchmarks/NOTES.md). Not while a submit runs."""
        from ..gpu.faults import synchronize
        outputs = tuple(outputs)
        with self.tower.current():
            self.tower.warm_up()
            for slot in range(2):
                if self.slot_pending[slot] is not None:  # _output_buffers' rule, as in _submit
                    self.slot_pending[slot].result()
                self._output_buffers(slot, outputs, dtype)
            with self.tower.stream:
                for name in outputs:
                    finite_rows(self._view(self.device_out[name], self.m_max, dtype), dtype)
            synchronize(self.tower.stream, "the stager's warm-up")

    def submit(self, canvases: Sequence[np.ndarray], grid_thw: np.ndarray, outputs: Sequence[str],
               dtype: str) -> Pending:
        with self.tower.current():
            return self._submit(canvases, grid_thw, tuple(outputs), dtype)

    def _submit(self, canvases, grid_thw: np.ndarray, outputs: tuple[str, ...], dtype: str) -> Pending:
        from ..gpu.faults import synchronize
        cupy, tower = self.cupy, self.tower
        tables = tower.prepare(grid_thw)
        p = tables.patches
        m = p // tower.geo.merge_unit
        slot = self.batches % 2
        self.batches += 1
        if self.slot_pending[slot] is not None:  # its output slot is about to be overwritten
            self.slot_pending[slot].result()
        if self.uploaded_events[slot] is not None:
            synchronize(self.uploaded_events[slot], "an upload of the pipeline's input slot")
        self._output_buffers(slot, outputs, dtype)

        # Host: pack the slot (canvases back to back, then the index slab's tables if it needs them).
        # patchify.cu's entries: an image, or a video's temporal group (its frame stride in bytes).
        buf = self.pinned_in[slot]
        entries = []
        cursor, row = 0, 0
        for c in canvases:
            per_frame = (c.shape[-3] // self.patch) * (c.shape[-2] // self.patch)
            if c.ndim == 3:
                entries.append((row, cursor, c.shape[1] // self.patch, 0))
                row += per_frame
            else:
                if self.video is None:
                    _no_video(c)
                stride = c[0].size
                for g in range(len(c) // self.temporal):
                    entries.append((row, cursor + g * self.temporal * stride, c.shape[2] // self.patch, stride))
                    row += per_frame
            buf[cursor:cursor + c.size] = c.reshape(-1)
            cursor += c.size
        images = np.array(entries, dtype=np.int32)
        if row != p:  # canvases not on the patch grid would misplace every row after them
            raise GlmVitError(f"the batch's canvases hold {row} patches, its grid_thw {p}")
        placed = []  # (offset in staging, bytes, device destination or None for the image table)
        for array, destination in [(images, None)] + tower.slab_uploads(tables):
            cursor = _up(cursor)
            raw = flat_bytes(array)
            buf[cursor:cursor + raw.size] = raw
            placed.append((cursor, raw.size, destination))
            cursor += raw.size

        # Upload stream: once the engine has read the previous batch's staging.
        up, down, stream = self.up_stream, self.down_stream, tower.stream
        if self.consumed is not None:
            up.wait_event(self.consumed)
        self.staging.data.copy_from_host_async(ctypes.c_void_p(buf.ctypes.data), cursor, up)
        uploaded = self.uploaded_events[slot] = up.record()

        # Engine stream: patchify, tables, forward, outputs.
        stream.wait_event(uploaded)
        start = stream.record()
        with stream:
            img_at = placed[0][0]
            tower.k.patchify_u8(self.staging, self.staging[img_at:].view(cupy.int32), len(images), self.table,
                                tower.pixels(p), self.patch, self.temporal)
            for offset, nbytes, destination in placed[1:]:
                destination.data.copy_from_device_async(self.staging.data + offset, nbytes, stream)
            self.consumed = stream.record()
            tower.run(tables)
            if self.downloaded is not None:
                stream.wait_event(self.downloaded)
            last_hidden, pooler = tower.outputs(m)
            produced = {"pooler_output": pooler, "last_hidden_state": last_hidden}
            finite = self.device_finite[:m]
            finite.fill(True)
            device_out = {}
            for name in outputs:
                dst = device_out[name] = self._view(self.device_out[name], m, dtype)
                self._cast(produced[name], dst, dtype, stream)
                finite &= finite_rows(dst, dtype)
            computed = stream.record()

        # Download stream: the outputs to the host slot.
        down.wait_event(computed)
        out = {name: self._view(self.pinned_out[slot][name], m, dtype) for name in outputs}
        for name in outputs:
            device_out[name].data.copy_to_host_async(ctypes.c_void_p(out[name].ctypes.data), out[name].nbytes, down)
        flags = self.pinned_finite[slot]
        finite.data.copy_to_host_async(ctypes.c_void_p(flags.ctypes.data), m, down)
        downloaded = self.downloaded = down.record()

        def collect():
            synchronize(downloaded, "a forward of the pipeline (or the download of its outputs)")
            return ({name: array.copy() for name, array in out.items()}, flags[:m].copy(),
                    cupy.cuda.get_elapsed_time(start, computed))

        pending = Pending(grid_thw, merged_offsets(grid_thw, tower.geo.merge_unit), collect=collect)
        self.slot_pending[slot] = pending
        return pending

    def _view(self, raw, m: int, dtype: str):
        """The first m rows of a raw output buffer, as dtype [m, out_hidden]."""
        dt = DTYPES[dtype][0]
        return raw[:m * self.width * np.dtype(dt).itemsize].view(dt).reshape(m, self.width)

    def _cast(self, src, dst, dtype: str, stream) -> None:
        if dtype == "bfloat16":
            self.tower.k.f32_to_bf16(src, dst)
        elif dtype == "float16":
            self.tower.k.f32_to_f16(src, dst)
        else:
            dst.data.copy_from_device_async(src.data, src.nbytes, stream)


def pixel_bytes(p_max: int, processor: ProcessorConfig, video: VideoConfig | None) -> int:
    """Bytes of uint8 pixels one batch of p_max patches may bring: 3 x patch^2 a patch (every
    canvas pixel belongs to one patch), times the temporal frames where videos come."""
    return p_max * 3 * processor.patch_size ** 2 * (1 if video is None else processor.temporal_patch_size)


def check_pixel_bytes(p_max: int, processor: ProcessorConfig, video: VideoConfig | None) -> int:
    """pixel_bytes, refused in one line past what patchify.cu's int32 byte offsets address."""
    nbytes = pixel_bytes(p_max, processor, video)
    if nbytes > 2**31 - 1:
        raise GlmVitError(f"a forward call of {p_max} patches brings {nbytes:,} bytes of uint8 pixels"
                          f"{' (two frames a video patch)' if video is not None else ''}, over the 2 GiB the GPU's "
                          "patchify addresses: lower --max-pixels (GlmVit.from_pretrained(max_pixels=...))")
    return nbytes


def make_stager(vit, processor: ProcessorConfig, video: VideoConfig | None = None):
    """The stager for a GlmVit's backend; `video`: the video processor's settings, where the
    batches may hold videos' frames."""
    cls = CupyStager if vit.backend == "cupy" else NumpyStager
    return cls(vit.tower, processor, video)
