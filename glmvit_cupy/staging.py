"""Batches of uint8 canvases in, embeddings out, with the transfers off the engine's path.

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
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

from .bf16 import f32_to_bf16_bits
from .errors import GlmVitError
from .layout import merged_offsets
from .preprocess import ProcessorConfig, patchify, pixel_table

DTYPES = {"bfloat16": (np.uint16, "BF16"), "float16": (np.float16, "F16"), "float32": (np.float32, "F32")}
OUTPUT_NAMES = ("pooler_output", "last_hidden_state")
_ALIGN = 256


def host_cast(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> the output dtype on the host (BF16 as its uint16 bits, rounded to nearest even)."""
    if dtype == "bfloat16":
        return f32_to_bf16_bits(x)
    return x.astype(DTYPES[dtype][0], copy=False)


def finite_rows(array, dtype: str):
    """Per row of an output in `dtype` (NumPy or CuPy): True where it holds no NaN or Inf (BF16
    as its bits: the exponent all ones). A float16 output that overflowed is not finite either."""
    if dtype == "bfloat16":
        return ((array & 0x7F80) != 0x7F80).all(axis=1)
    if isinstance(array, np.ndarray):
        return np.isfinite(array).all(axis=1)
    import cupy

    return cupy.isfinite(array).all(axis=1)


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


class NumpyStager:
    """The NumPy backend's side of the interface: patchify with the same table, forward, cast."""

    depth = 2  # batches a stream keeps submitted (the CUDA stager's; here submit does the work)
    engines = 1

    def __init__(self, tower, outputs: Sequence[str], dtype: str, processor: ProcessorConfig) -> None:
        self.tower, self.outputs, self.dtype, self.processor = tower, tuple(outputs), dtype, processor

    def submit(self, canvases: Sequence[np.ndarray], grid_thw: np.ndarray) -> Pending:
        pixels = np.concatenate([patchify(c, self.processor) for c in canvases])
        last_hidden, pooler = self.tower.forward(pixels, grid_thw)
        produced = {"pooler_output": pooler, "last_hidden_state": last_hidden}
        arrays = {name: host_cast(produced[name], self.dtype) for name in self.outputs}
        finite = np.logical_and.reduce([finite_rows(a, self.dtype) for a in arrays.values()])
        return Pending(grid_thw, merged_offsets(grid_thw, self.tower.geo.merge_unit), arrays, finite)


class CupyStager:
    """Pinned slots, the upload and download streams and the device buffers around one CupyTower."""

    depth = 2  # batches a stream keeps submitted: k + 1 uploads while k computes (two slots)
    engines = 1

    def __init__(self, tower, outputs: Sequence[str], dtype: str, processor: ProcessorConfig) -> None:
        import cupy

        self.cupy, self.tower, self.outputs, self.dtype = cupy, tower, tuple(outputs), dtype
        geo, p_max = tower.geo, tower.p_max
        m_max = p_max // geo.merge_unit
        self.patch, self.temporal = processor.patch_size, processor.temporal_patch_size
        canvas_bytes = p_max * 3 * self.patch ** 2  # every canvas pixel belongs to one patch
        # staging: canvases | images [n, 4] | positions [P, 2] | work list [tiles, 4] | QKV map
        self.capacity = (_up(canvas_bytes) + _up(16 * m_max) + _up(8 * p_max) + _up(16 * tower.plan.max_tiles)
                         + _ALIGN)
        itemsize = np.dtype(DTYPES[dtype][0]).itemsize
        with tower.device:
            self.up_stream = cupy.cuda.Stream(non_blocking=True)
            self.down_stream = cupy.cuda.Stream(non_blocking=True)
            self.staging = cupy.empty(self.capacity, dtype=cupy.uint8)
            self.table = cupy.asarray(pixel_table(processor))
            self.device_out = {name: cupy.empty((m_max, geo.out_hidden_size), dtype=DTYPES[dtype][0])
                               for name in self.outputs}
            self.pinned_in = [self._pinned(self.capacity) for _ in range(2)]
            self.device_finite = cupy.empty(m_max, dtype=cupy.bool_)
            self.pinned_out = [{name: self._pinned(m_max * geo.out_hidden_size * itemsize).view(DTYPES[dtype][0])
                                for name in self.outputs} for _ in range(2)]
            self.pinned_finite = [self._pinned(m_max).view(np.bool_) for _ in range(2)]
            self.uploaded_events = [None, None]  # per input slot: its H2D, before the host refills it
            self.slot_pending: list[Pending | None] = [None, None]  # per output slot: who must collect first
            self.consumed = None  # the engine has read the staging buffer (the last batch's)
            self.downloaded = None  # the device output buffer has reached the host (the last batch's)
        self.k = 0

    def _pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cupy.cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def submit(self, canvases: Sequence[np.ndarray], grid_thw: np.ndarray) -> Pending:
        cupy, tower = self.cupy, self.tower
        with tower.device:
            return self._submit(cupy, tower, canvases, grid_thw)

    def _submit(self, cupy, tower, canvases, grid_thw: np.ndarray) -> Pending:
        from .faults import synchronize
        p = tower.check_budget(grid_thw)
        s = tower._scratch()
        tables = tower.grid_tables(grid_thw)
        m = p // tower.geo.merge_unit
        slot = self.k % 2
        self.k += 1
        if self.slot_pending[slot] is not None:  # its output slot is about to be overwritten
            self.slot_pending[slot].result()
        if self.uploaded_events[slot] is not None:
            synchronize(self.uploaded_events[slot], "an upload of the pipeline's input slot")

        # Host: pack the slot (canvases back to back, then the tables).
        buf = self.pinned_in[slot]
        images = np.empty((len(canvases), 4), dtype=np.int32)
        cursor, row = 0, 0
        for i, c in enumerate(canvases):
            images[i] = (row, cursor, c.shape[1] // self.patch, 0)
            buf[cursor:cursor + c.size] = c.reshape(-1)
            cursor += c.size
            row += (c.shape[0] // self.patch) * (c.shape[1] // self.patch)
        if row != p:  # canvases not on the patch grid would misplace every row after them
            raise GlmVitError(f"the batch's canvases hold {row} patches, its grid_thw {p}")
        at = {}
        fresh = tower.uploaded != tables.key
        parts = [("images", images)] + ([("positions", tables.positions), ("tiles", tables.work.tiles)]
                                        + ([("qkv_map", tables.qkv_map)] if tables.qkv_map is not None else [])
                                        if fresh else [])
        cursor = _up(cursor)
        for name, array in parts:
            raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
            at[name] = (cursor, raw.size)
            buf[cursor:cursor + raw.size] = raw
            cursor = _up(cursor + raw.size)

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
            img_at, _ = at["images"]
            tower.k.patchify_u8(self.staging, self.staging[img_at:].view(cupy.int32), len(canvases), self.table,
                                s.pixels[:p], self.patch, self.temporal)
            if fresh:
                for name, dst in (("positions", s.positions), ("tiles", s.tiles), ("qkv_map", s.qkv_map)):
                    if name in at:
                        off, n = at[name]
                        dst.data.copy_from_device_async(self.staging.data + off, n, stream)
                tower.uploaded = tables.key
            self.consumed = stream.record()
            tower.run(p, tables)
            if self.downloaded is not None:
                stream.wait_event(self.downloaded)
            produced = {"pooler_output": s.pooler[:m], "last_hidden_state": s.last_hidden[:m]}
            finite = self.device_finite[:m]
            finite.fill(True)
            for name in self.outputs:
                self._cast(produced[name], self.device_out[name][:m], stream)
                finite &= finite_rows(self.device_out[name][:m], self.dtype)
            computed = stream.record()

        # Download stream: the outputs to the host slot.
        down.wait_event(computed)
        out = self.pinned_out[slot]
        for name in self.outputs:
            dev = self.device_out[name][:m]
            dev.data.copy_to_host_async(ctypes.c_void_p(out[name].ctypes.data), dev.nbytes, down)
        flags = self.pinned_finite[slot]
        finite.data.copy_to_host_async(ctypes.c_void_p(flags.ctypes.data), m, down)
        downloaded = self.downloaded = down.record()
        width = tower.geo.out_hidden_size

        def collect():
            synchronize(downloaded, "a forward of the pipeline (or the download of its outputs)")
            arrays = {name: out[name][:m * width].reshape(m, width).copy() for name in self.outputs}
            return arrays, flags[:m].copy(), cupy.cuda.get_elapsed_time(start, computed)

        pending = Pending(grid_thw, merged_offsets(grid_thw, tower.geo.merge_unit), collect=collect)
        self.slot_pending[slot] = pending
        return pending

    def _cast(self, src, dst, stream) -> None:
        if self.dtype == "bfloat16":
            self.tower.k.f32_to_bf16(src, dst)
        elif self.dtype == "float16":
            self.tower.k.f32_to_f16(src, dst)
        else:
            dst.data.copy_from_device_async(src.data, src.nbytes, stream)


def make_stager(vit, outputs: Sequence[str], dtype: str, processor: ProcessorConfig):
    """The stager for a GlmVit's backend."""
    cls = CupyStager if vit.backend == "cupy" else NumpyStager
    return cls(vit.tower, outputs, dtype, processor)

