"""Every GPU of a host: one engine process per device, behind the one pipeline of a collection run.

`encode --devices 0,1` keeps everything of a single-engine run in the main process (the decode
pool, the packer, in-order results, the one OutputDir and shard writer, so shards never collide
and one resume state covers every device) and replaces the engine with an `EngineGroup`: the
stager of N engine processes, one a device, each choosing its device (CUDA_VISIBLE_DEVICES)
before it imports CuPy. A packed batch goes to the engine with the fewest batches in flight:

  main process                                   engine process (one a device)
  pixels of batch k   -> input slot k % DEPTH    slot -> its own stager (pinned, H2D, forward)
  (shared memory)        + (slot, grid) on pipe   outputs -> output slot k % DEPTH, reply on pipe
  result(k): copy out of the output slot <------

The tower is read from disk once per host: the main process reads and checks it (the NaN scan)
into a file in /dev/shm that every engine process maps and builds its engine from, so N engines
cost one read. Batch data crosses processes through shared memory (one copy in, one out); the
pipes carry only a few numbers a batch. Engines run in fresh interpreters (workers.Child, which
die with the main process): a fork of a process that may hold CUDA state is unsafe, and the
device must be chosen before CUDA starts.

Separate from pipeline.py and model.py because none of this is needed by one engine: the
pipeline sees one more stager (submit / Pending, `depth`, `engines`), the engine is unchanged.
Videos take the same way: a batch's pixels (canvases, runs of a video's frames) cross as their
shapes and bytes, and each engine's stager is made with the run's video settings.
With `--backend numpy` the same processes run the NumPy engine, which is how CI tests this path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import signal
import tempfile
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..collection.pipeline import StreamTurn
from ..collection.staging import DTYPES, Pending, check_dtype, pixel_bytes
from ..errors import GlmVitError, InternalError
from ..model import check_kernels
from ..processor.preprocess import ProcessorConfig, check_processor
from ..processor.video import VideoConfig
from ..tower.checkpoint import TowerLocation, TowerWeights, locate_tower, read_tower
from ..tower.geometry import check_patch_budget, patch_budget
from ..tower.layout import merged_offsets, num_patches
from ..tower.writer import create_temp
from ..workers import Child

DEPTH = 3  # batches in flight per engine: two in its stager (k + 1 uploads while k computes), one on the pipe
_ALIGN = 64
_SHM = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def parse_devices(spec: str) -> list[int] | None:
    """`all` (None: every CUDA device) or distinct device indices `0,1,...`."""
    if spec.strip() == "all":
        return None
    try:
        devices = [int(part) for part in spec.split(",")]
    except ValueError:
        devices = []
    if not devices or min(devices) < 0 or len(set(devices)) != len(devices):
        raise GlmVitError(f"--devices {spec!r}: expected 'all' or distinct device indices such as 0,1")
    return devices


def _count_devices(conn: Connection) -> None:
    """Send (CUDA devices CuPy sees, why none): run in a process of its own, so that the main
    process never initialises CUDA."""
    from ..model import gpu_available

    ok, why = gpu_available()
    if not ok:
        conn.send((0, why))
        return
    import cupy

    conn.send((cupy.cuda.runtime.getDeviceCount(), ""))


def all_devices() -> list[int]:
    """Every CUDA device of this host (`--devices all`), asked of a process of its own."""
    child = Child(_count_devices, (), "glmvit-cupy device count")
    try:
        count, why = child.conn.recv()
    except EOFError:
        count, why = 0, f"the process counting them died (exit code {child.exitcode})"
    finally:
        child.close()
    if not count:
        raise GlmVitError(f"--devices all: no GPU to run on ({why}); without --devices the NumPy backend runs on "
                          "the CPU")
    return list(range(count))


class _SharedFile:
    """A file in /dev/shm mapped into this process, which other processes map by its path."""

    def __init__(self, name: str, nbytes: int) -> None:
        fd, self.path = create_temp(_SHM, name)  # a dead run's leftovers (SIGKILL) are removed first
        try:
            os.ftruncate(fd, nbytes)  # tmpfs: zero pages, allocated as they are written
            self.map = mmap.mmap(fd, nbytes)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            raise GlmVitError(f"{self.path}: cannot make {nbytes / 2**20:.0f} MiB of shared memory: "
                              f"{exc.strerror}") from None
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Drop the name; the mappings stay until each process lets go of its own."""
        self.path.unlink(missing_ok=True)


def _attach(path: str, nbytes: int) -> mmap.mmap:
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), nbytes)


@dataclasses.dataclass(frozen=True)
class _SlotPlan:
    """Where one engine's DEPTH input and output slots lie in its shared file."""

    outputs: tuple[str, ...]
    itemsize: int
    width: int
    m_max: int
    canvas_bytes: int

    def _up(self, n: int) -> int:
        return -(-n // _ALIGN) * _ALIGN

    @property
    def output_bytes(self) -> int:
        return self._up(self.m_max * self.width * self.itemsize)

    @property
    def slot_bytes(self) -> int:
        return self._up(self.canvas_bytes) + len(self.outputs) * self.output_bytes + self._up(self.m_max)

    @property
    def total(self) -> int:
        return DEPTH * self.slot_bytes

    def canvas_at(self, slot: int) -> int:
        return slot * self.slot_bytes

    def output_at(self, slot: int, i: int) -> int:
        return self.canvas_at(slot) + self._up(self.canvas_bytes) + i * self.output_bytes

    def finite_at(self, slot: int) -> int:
        return self.output_at(slot, len(self.outputs))


@dataclasses.dataclass(frozen=True)
class _EngineSpec:
    """What an engine process needs to build its engine without reading the checkpoint."""

    device: int
    visible: str | None  # its CUDA_VISIBLE_DEVICES (None: the NumPy backend)
    backend: str
    tower_path: str
    tower_elements: int
    location: TowerLocation
    offsets: dict[str, int]
    bytes_read: int
    max_pixels: int | None
    processor: ProcessorConfig
    dtype: str
    kernels: str  # model.KERNELS; GLMVIT_CHECK_LAUNCHES reaches the engine in its inherited environment
    video: VideoConfig | None  # the video processor's settings, where the run takes videos
    slots: _SlotPlan
    slots_path: str


def _engine_main(spec: _EngineSpec, conn: Connection) -> None:
    """An engine process: build the engine over the shared tower, then serve batches in order
    until the main process sends None or goes away."""
    if spec.visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.visible  # before anything imports CuPy
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process decides
    from ..collection.staging import make_stager
    from ..model import GlmVit

    try:
        tower = _attach(spec.tower_path, spec.tower_elements * 2)
        arena = np.frombuffer(tower, dtype=np.uint16, count=spec.tower_elements)
        weights = TowerWeights(spec.location, arena, spec.offsets, spec.bytes_read)
        vit = GlmVit.from_weights(weights, spec.backend, spec.max_pixels, processor=spec.processor,
                                  kernels=spec.kernels)
        stager = make_stager(vit, spec.processor, spec.video)
        slots = _attach(spec.slots_path, spec.slots.total)
    except (GlmVitError, MemoryError) as exc:
        conn.send(("error", str(exc) or type(exc).__name__))
        return
    del weights, arena, tower  # the engine holds its own copy (device or float32): unmap the shared one
    kernels = ("hopper" if vit.tower.k.hopper else "generic") if vit.backend == "cupy" else ""
    conn.send(("ready", vit.backend, kernels, getattr(vit.tower, "check_launches", False)))
    _serve(stager, slots, spec.slots, spec.dtype, conn)


def _serve(stager: Any, slots: mmap.mmap, plan: _SlotPlan, dtype: str, conn: Connection) -> None:
    """Submit each batch as it comes; reply for the oldest once two are in the stager or the pipe
    is empty (so the device always has the next batch queued behind the running one)."""
    pending: list[tuple[int, Pending]] = []
    received = 0
    while True:
        if pending and (len(pending) == 2 or not conn.poll()):
            slot, done = pending.pop(0)
            try:
                arrays = done.result()
            except (GlmVitError, MemoryError) as exc:
                conn.send(("error", str(exc) or type(exc).__name__))
                return
            m = len(done.finite)
            for i, name in enumerate(plan.outputs):
                view = np.frombuffer(slots, DTYPES[dtype][0], m * plan.width, plan.output_at(slot, i))
                view[:] = arrays[name].reshape(-1)
            np.frombuffer(slots, np.bool_, m, plan.finite_at(slot))[:] = done.finite
            conn.send(("done", m, done.gpu_ms))
            continue
        try:
            message = conn.recv()
        except EOFError:  # the main process is gone
            return
        if message is None:
            return
        shapes, grid = message
        slot = received % DEPTH
        received += 1
        canvases, at = [], plan.canvas_at(slot)
        for shape in shapes:
            size = int(np.prod(shape))
            canvases.append(np.frombuffer(slots, np.uint8, size, at).reshape(shape))
            at += size
        try:
            pending.append((slot, stager.submit(canvases, grid, plan.outputs, dtype)))
        except (GlmVitError, MemoryError) as exc:
            conn.send(("error", str(exc) or type(exc).__name__))
            return


class _Engine:
    """The main process's handle on one engine process."""

    def __init__(self, index: int, device: int, process: Any, conn: Connection, slots: _SharedFile) -> None:
        self.index, self.device, self.process, self.conn, self.slots = index, device, process, conn, slots
        self.sent = self.received = 0

    @property
    def in_flight(self) -> int:
        return self.sent - self.received

    def reply(self) -> tuple:
        try:
            message = self.conn.recv()
        except (EOFError, ConnectionResetError):
            self.process.join(5)
            raise GlmVitError(f"the engine process of device {self.device} died (exit code {self.process.exitcode}; "
                              "killed, or out of memory)") from None
        if message[0] == "error":
            raise GlmVitError(f"device {self.device}: {message[1]}")
        return message


class EngineGroup:
    """One engine process per device over one read of the tower, as the stager of a stream
    (pipeline.stream, encode_collection) and as the `vit` it describes (geometry, processor,
    p_max, backend, fingerprint). `backend` "auto" means the GPU here (the devices are GPUs);
    "numpy" runs CPU engine processes (tests). `kernels` (model.KERNELS) is each GPU engine's
    choice; per-launch checks (GLMVIT_CHECK_LAUNCHES=1) are asked for in the environment, which
    the engine processes inherit. `engine_settings`: what each engine process runs,
    (backend, kernel set or "", launches checked), one a device. `video`: the video
    processor's settings, where the run takes videos (the decoder's)."""

    def __init__(self, model_dir: str | Path, devices: Sequence[int] | None, backend: str,
                 max_pixels: int | None, processor: ProcessorConfig, outputs: Sequence[str], dtype: str,
                 kernels: str = "auto", video: VideoConfig | None = None) -> None:
        check_dtype(dtype)
        check_kernels(kernels)
        backend = "cupy" if backend == "auto" else backend
        devices = all_devices() if devices is None else list(devices)
        location = locate_tower(model_dir)
        self.geometry = location.geometry
        check_processor(processor, self.geometry)
        self.processor, self.backend, self.devices, self.dtype = processor, backend, devices, dtype
        self.p_max = patch_budget(self.geometry, max_pixels, processor.max_image_tokens)
        self.depth, self.engines = DEPTH * len(devices), len(devices)
        self.backend_note = ""
        self._stream = StreamTurn(threading.Lock(), "a stream of the same engine group")
        self.engine_settings: list[tuple[str, str, bool]] = []
        self.plan = _SlotPlan(tuple(outputs), np.dtype(DTYPES[dtype][0]).itemsize, self.geometry.out_hidden_size,
                              self.p_max // self.geometry.merge_unit, pixel_bytes(self.p_max, processor, video))
        self._engines: list[_Engine] = []
        shared: list[_SharedFile] = []
        tower: list[_SharedFile] = []
        try:
            def allocate(elements: int) -> np.ndarray:
                tower.append(_SharedFile("glmvit-cupy-tower", elements * 2))
                shared.append(tower[0])
                return np.frombuffer(tower[0].map, dtype=np.uint16, count=elements)

            weights = read_tower(location, allocate)
            self.fingerprint = weights.fingerprint()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible_list = visible.split(",") if visible else None
            for index, device in enumerate(devices):
                if visible_list is not None and device >= len(visible_list):
                    raise GlmVitError(f"--devices: device {device} is not among CUDA_VISIBLE_DEVICES={visible}")
                slots = _SharedFile(f"glmvit-cupy-slots-{index}", self.plan.total)
                shared.append(slots)
                spec = _EngineSpec(
                    device, None if backend == "numpy" else (visible_list[device] if visible_list else str(device)),
                    backend, str(tower[0].path), weights.arena.size, location, weights.offsets, weights.bytes_read,
                    max_pixels, processor, dtype, kernels, video, self.plan, str(slots.path))
                child = Child(_engine_main, (spec,), f"glmvit-cupy engine {device}")
                self._engines.append(_Engine(index, device, child, child.conn, slots))
            del weights, allocate
            for engine in self._engines:  # ("ready", ...settings): its engine is built, the tower mapped
                self.engine_settings.append(tuple(engine.reply()[1:]))
        except BaseException:
            self._stop()
            raise
        finally:
            for file in shared:  # every engine has mapped them (or failed): no name is left behind
                file.unlink()
        # The main process needs no weights: its mapping of the tower goes with `tower`.

    def stream_turn(self, what: str = "encode") -> contextlib.AbstractContextManager[None]:
        """One stream at a time (pipeline.stream takes it, as it takes a GlmVit's): the engines'
        slots serve one; a stream inside a stream of the same thread is refused."""
        return self._stream(what)

    def warm_up(self, outputs: Sequence[str], dtype: str) -> None:
        """Nothing here: each engine process pays its first batch's one-time costs with that batch
        (the stream's warm-up thread cannot reach into them)."""

    def submit(self, canvases: Sequence[np.ndarray], grid_thw: np.ndarray, outputs: Sequence[str],
               dtype: str) -> Pending:
        if (tuple(outputs), dtype) != (self.plan.outputs, self.dtype):  # the shared slots are laid out for those
            raise InternalError(f"an engine group made for {self.plan.outputs} in {self.dtype} was given a batch of "
                                f"{tuple(outputs)} in {dtype}")
        engine = min(self._engines, key=lambda e: e.in_flight)
        slot = engine.sent % DEPTH
        buf = np.frombuffer(engine.slots.map, np.uint8, self.plan.slot_bytes, self.plan.canvas_at(slot))
        check_patch_budget(self.geometry, num_patches(grid_thw), self.p_max, "this batch")  # no slot holds more
        cursor = 0
        for c in canvases:
            buf[cursor:cursor + c.size] = c.reshape(-1)
            cursor += c.size
        engine.conn.send(([c.shape for c in canvases], grid_thw))
        engine.sent += 1
        plan = self.plan

        def collect() -> tuple[dict[str, np.ndarray], np.ndarray, float]:
            _, m, gpu_ms = engine.reply()
            engine.received += 1
            slot_map = engine.slots.map
            arrays = {name: np.frombuffer(slot_map, DTYPES[self.dtype][0], m * plan.width,
                                          plan.output_at(slot, i)).reshape(m, plan.width).copy()
                      for i, name in enumerate(plan.outputs)}
            return arrays, np.frombuffer(slot_map, np.bool_, m, plan.finite_at(slot)).copy(), gpu_ms

        return Pending(grid_thw, merged_offsets(grid_thw, self.geometry.merge_unit), collect=collect,
                       engine=engine.index)

    def close(self) -> None:
        """Stop the engine processes once a stream another thread runs is done (as GlmVit.close
        waits); results not collected are dropped."""
        with self.stream_turn("close"):
            self._stop()

    def _stop(self) -> None:
        for engine in self._engines:
            try:
                engine.conn.send(None)
            except OSError:
                pass  # already gone
        for engine in self._engines:
            engine.process.join(10)
            if engine.process.is_alive():
                engine.process.kill()
                engine.process.join()
            engine.conn.close()
        self._engines = []
