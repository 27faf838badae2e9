"""The collection pipeline on a real GPU (marked `gpu`): the device patchify, the staged
(pinned, copy-stream) forward, several engines over one bound checkpoint, and the overlap."""

from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from glmvit_cupy import GlmVit
from glmvit_cupy.collection.pipeline import StreamStats, plan_batches, stream
from glmvit_cupy.collection.staging import CupyStager
from glmvit_cupy.processor.preprocess import ProcessorConfig, canvas, canvas_grid, patchify, pixel_table, preprocess
from glmvit_cupy.tower.checkpoint import bind_checkpoint
from helpers import KERNEL_SETS, photo_like, skip_unless_available

pytestmark = pytest.mark.gpu
SIZES = [(448, 448), (333, 517), (1200, 900), (56, 700), (640, 480), (96, 96), (1600, 1064), (700, 520)]


@pytest.fixture(scope="module")
def vit(real_ckpt):
    return GlmVit.from_pretrained(real_ckpt, backend="cupy")


@pytest.fixture(scope="module")
def canvases():
    return [canvas(photo_like(h, w, seed=i)) for i, (h, w) in enumerate(SIZES)]


def test_device_patchify_is_bit_identical_to_the_cpu_path(vit, canvases):
    """patchify_u8 from uint8 canvases gives the patch-embed GEMM the same BF16 bits as
    f32_to_bf16 of the CPU path's float32 pixel_values."""
    import cupy

    k, processor = vit.tower.k, ProcessorConfig()
    pixels = np.concatenate([patchify(c, processor) for c in canvases])
    want = cupy.empty(pixels.shape, dtype=cupy.uint16)
    k.f32_to_bf16(cupy.asarray(pixels), want)
    flat = np.concatenate([c.reshape(-1) for c in canvases])
    rows = np.cumsum([0] + [int(np.prod(canvas_grid(c.shape))) for c in canvases])
    starts = np.cumsum([0] + [c.size for c in canvases])
    images = np.array([(rows[i], starts[i], c.shape[1] // 14, 0) for i, c in enumerate(canvases)], dtype=np.int32)
    got = cupy.full(pixels.shape, 0xFFFF, dtype=cupy.uint16)
    tables = np.stack([pixel_table(processor), np.full((3, 256), np.nan, np.float32)])  # images read only [0]
    k.patchify_u8(cupy.asarray(flat), cupy.asarray(images), len(canvases), cupy.asarray(tables), got, 14, 2)
    assert np.array_equal(got.get(), want.get())


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_staged_forward_equals_forward_in_every_dtype(real_ckpt, vit, canvases, kernels):
    """Two batches in flight through one stager give, per dtype, the forward's float32 outputs
    cast once (that they overlap: test_the_stager_overlaps_the_next_upload_with_the_forward). On
    both kernel sets."""
    import cupy

    skip_unless_available(kernels)
    if kernels != ("hopper" if vit.tower.k.hopper else "generic"):
        vit = GlmVit.from_pretrained(real_ckpt, backend="cupy", kernels=kernels)

    batches = [canvases[:3], canvases[3:]]
    grids = [np.array([canvas_grid(c.shape) for c in b], dtype=np.int64) for b in batches]
    want = []
    for b, grid in zip(batches, grids):
        pixels = np.concatenate([patchify(c) for c in b])
        out = vit.forward(pixels, grid)
        want.append({"pooler_output": out.pooler_output.get(), "last_hidden_state": out.last_hidden_state.get()})
    stager = CupyStager(vit.tower, ProcessorConfig())  # one for all: a wider dtype enlarges its buffers
    for dtype in ("bfloat16", "float16", "float32"):
        pending = [stager.submit(b, g, ("pooler_output", "last_hidden_state"), dtype) for b, g in zip(batches, grids)]
        for p, w in zip(pending, want):
            got = p.result()
            for name in w:
                if dtype == "float32":
                    expect = w[name]
                elif dtype == "float16":
                    expect = w[name].astype(np.float16)
                else:
                    bits = cupy.empty(w[name].shape, dtype=cupy.uint16)
                    vit.tower.k.f32_to_bf16(cupy.asarray(w[name]), bits)
                    expect = bits.get()
                assert got[name].dtype == expect.dtype and np.array_equal(got[name], expect), (dtype, name)
            assert p.gpu_ms > 0


def test_the_stager_overlaps_the_next_upload_with_the_forward(real_ckpt, canvases, monkeypatch):
    """What staging.py's docstring claims, on the device's clock: submit returns while its batch
    still computes (nothing waits after a submit), and batch k+1's upload is done before batch
    k's outputs are down (it ran while k computed). Per-launch checks make every launch wait for
    itself, so this engine is built without them."""
    import cupy

    from glmvit_cupy.gpu.faults import CHECK_LAUNCHES_ENV

    monkeypatch.delenv(CHECK_LAUNCHES_ENV, raising=False)
    vit = GlmVit.from_pretrained(real_ckpt, backend="cupy")
    assert not vit.tower.check_launches
    stager = CupyStager(vit.tower, ProcessorConfig())
    batches = [canvases[:3], canvases[3:]]
    grids = [np.array([canvas_grid(c.shape) for c in b], dtype=np.int64) for b in batches]
    outputs = ("pooler_output",)
    for _ in range(3):  # eager, captured, replayed: the host's part of a submit is then a graph launch
        for b, g in zip(batches, grids):
            stager.submit(b, g, outputs, "bfloat16")
    stager.downloaded.synchronize()
    first = stager.submit(batches[0], grids[0], outputs, "bfloat16")
    first_down = stager.downloaded
    assert not first_down.done, "submit waited for its batch"
    second = stager.submit(batches[1], grids[1], outputs, "bfloat16")
    second_up = stager.uploaded_events[(stager.batches - 1) % 2]
    first.result(), second.result()
    ahead_ms = cupy.cuda.get_elapsed_time(second_up, first_down)
    print(f"batch k+1 uploaded {ahead_ms:.2f} ms before batch k's outputs were down")
    assert ahead_ms > 0


def test_a_warmed_up_stager_computes_what_a_cold_one_does(real_ckpt, canvases):
    """CupyStager.warm_up (a stream runs it while its first inputs decode) leaves the engine as its
    first batch would: fresh engines given the same batches give the same bits with and without
    it, and it made the scratch and both output slots, so the first batch finds them."""
    batches = [canvases[:3], canvases[3:]]
    grids = [np.array([canvas_grid(c.shape) for c in b], dtype=np.int64) for b in batches]
    outputs = ("pooler_output", "last_hidden_state")
    results = []
    for warm in (False, True):
        vit = GlmVit.from_pretrained(real_ckpt, backend="cupy")
        stager = CupyStager(vit.tower, ProcessorConfig())
        if warm:
            stager.warm_up(outputs, "bfloat16")
            stager.warm_up(outputs, "bfloat16")  # once is enough: a second does no forward
            assert vit.tower.warm and vit.tower.scratch is not None
            assert not vit.tower.graphs  # a second forward of its grid would have been captured
            assert all(set(slot) == set(outputs) for slot in stager.pinned_out)
        else:
            assert vit.tower.scratch is None and not any(stager.pinned_out)
        pending = [stager.submit(b, g, outputs, "bfloat16") for b, g in zip(batches, grids)]
        results.append([{k: v.copy() for k, v in p.result().items()} for p in pending])
    for cold, warmed in zip(*results):
        for name in outputs:
            assert np.array_equal(cold[name], warmed[name]), name


def test_engines_with_their_own_budgets_and_devices_share_one_bound_checkpoint(real_ckpt, vit):
    weights = bind_checkpoint(real_ckpt)
    small = GlmVit.from_weights(weights, "cupy", max_pixels=448 * 448, device=0)
    large = GlmVit.from_weights(weights, "cupy", max_pixels=2 * 448 * 448, device=0)
    assert (small.p_max, large.p_max) == (1024, 2048)
    assert small.tower.device.id == 0 and small.tower.stream is not large.tower.stream
    pixels, grid = preprocess(photo_like(448, 448, 3))
    a, b, c = (v.forward(pixels, grid).pooler_output.get() for v in (small, large, vit))
    assert np.array_equal(a, b) and np.array_equal(a, c)


def test_encode_iter_equals_forward_and_keeps_the_gpu_busy(vit, tmp_path):
    """encode_iter over files in mixed sizes: each result equals forward on the same batch's
    images (the packer's batches), and the GPU-busy fraction is measured, not assumed."""
    paths = []
    for i in range(48):
        h, w = SIZES[i % len(SIZES)]
        paths.append(tmp_path / f"p{i:02d}.{'jpg' if i % 2 else 'png'}")
        Image.fromarray(photo_like(h, w, seed=100 + i)).save(paths[-1], quality=92)
    results = dict(vit.encode_iter(paths, output="both", dtype="float32"))
    assert list(results) == paths
    prepared = [canvas(p) for p in paths]
    counts = [int(np.prod(canvas_grid(c.shape))) for c in prepared]
    for batch in plan_batches(counts, vit.p_max)[:2]:
        pixels = np.concatenate([patchify(prepared[i]) for i in batch])
        grid = np.array([canvas_grid(prepared[i].shape) for i in batch], dtype=np.int64)
        for j, part in zip(batch, vit.forward(pixels, grid).split()):
            assert np.array_equal(results[paths[j]].pooler_output, part.pooler_output.get())
            assert np.array_equal(results[paths[j]].last_hidden_state, part.last_hidden_state.get())
    stats = StreamStats()
    start = time.perf_counter()
    n = sum(1 for _ in stream(vit, paths * 4, outputs=("pooler_output",), dtype="bfloat16", stats=stats))
    wall = time.perf_counter() - start
    busy = stats.gpu_ms[0] / 1000 / wall
    print(f"stream: {n} images in {wall:.2f} s ({n / wall:.1f} images/s, {stats.tokens / wall:,.0f} tokens/s), "
          f"{stats.batches} batches, GPU busy {100 * busy:.0f}%"
          + (" (launches checked one by one: not a speed figure)" if vit.tower.check_launches else ""))
    assert n == 4 * len(paths) and 0 < busy <= 1.0


@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_devices_write_what_one_engine_writes(tmp_path, real_ckpt, kernels):
    """`encode --devices all --kernels K` (engine processes, the tower mapped from /dev/shm)
    writes the same bits as the engine in the CLI's own process with the same kernels: each
    image's batch is the same batch. One GPU exercises the whole path; on more, batches spread
    over them. Each engine process runs the kernel set asked for, with this process's per-launch
    checks (GLMVIT_CHECK_LAUNCHES, inherited)."""
    import subprocess
    import sys

    from glmvit_cupy.deploy.devices import EngineGroup
    from glmvit_cupy.gpu.faults import check_launches
    from glmvit_cupy.processor.preprocess import processor_config

    skip_unless_available(kernels)
    processor, _ = processor_config(real_ckpt)
    group = EngineGroup(real_ckpt, [0], "cupy", None, processor, ("pooler_output",), "bfloat16", kernels)
    try:
        assert group.engine_settings == [("cupy", kernels, check_launches())]
    finally:
        group.close()
    for i, (h, w) in enumerate(SIZES * 3):
        Image.fromarray(photo_like(h, w, seed=i)).save(tmp_path / f"img{i:02d}.png")
    outs = {}
    for name, extra in (("one", []), ("devices", ["--devices", "all"])):
        outs[name] = tmp_path / name
        proc = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "encode", str(tmp_path),
                               "--model", str(real_ckpt), "--out-dir", str(outs[name]), "--backend", "cupy",
                               "--kernels", kernels, "--shard-size", "10", "--workers", "2", "--quiet", *extra],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        print(f"({name}, {kernels}) {proc.stderr.strip().splitlines()[-1]}")
    assert "(devices " in proc.stderr
    names = sorted(p.name for p in outs["one"].iterdir())
    assert names == sorted(p.name for p in outs["devices"].iterdir()) and len(names) == 6
    for name in names:
        assert (outs["one"] / name).read_bytes() == (outs["devices"] / name).read_bytes(), name


@pytest.mark.parametrize("engines", [[], ["--devices", "all"]], ids=["one engine", "engine processes"])
def test_an_image_over_the_gpu_budget_is_that_images_failure(tmp_path, engines):
    """As on the CPU (test_budget.py), on the GPU engine in the CLI's process and in engine
    processes: the image no forward call holds is listed in failures.jsonl, the rest encoded."""
    import json
    import subprocess
    import sys

    from test_budget import SMALL, refusal, unresized_checkpoint, write_images

    ckpt, images, out = unresized_checkpoint(tmp_path / "ckpt"), write_images(tmp_path / "img"), tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", "import cli; cli.main()", "encode", str(images), "--model", str(ckpt),
                           "--out-dir", str(out), "--backend", "cupy", "--max-pixels", str(SMALL), "--workers", "1",
                           "--quiet", *engines], capture_output=True, text=True)
    assert proc.returncode == 1 and "encoded 2, skipped 0, failed 1" in proc.stderr, proc.stderr
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert failures == [{"path": str(images / "b.png"), "kind": "image",
                         "error": refusal(str(images / "b.png"), 400, 64)}]
