"""The `glmvit-cupy` command line: encode images, inspect or make a checkpoint, benchmark.

Every user mistake (missing image, unreadable checkpoint, unwritable output) ends in one
line on stderr naming the culprit and a non-zero exit; outputs are written to a temporary
file beside the target and renamed into place, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable

import click
import numpy as np

from glmvit_cupy.batcher import DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_MS, DEFAULT_TIMEOUT_S
from glmvit_cupy.collection.pipeline import DEFAULT_OUTPUT, DEFAULT_WORKERS, OUTPUTS
from glmvit_cupy.collection.shards import DEFAULT_SHARD_SIZE
from glmvit_cupy.collection.sources import IMAGE_EXTENSIONS
from glmvit_cupy.collection.staging import DEFAULT_DTYPE, DTYPES
from glmvit_cupy.deploy.encoder_cache import DEFAULT_CACHE_BYTES
from glmvit_cupy.deploy.handoff import DEFAULT_HTTP_WORKERS
from glmvit_cupy.errors import GlmVitError
from glmvit_cupy.model import BACKENDS, KERNELS
from glmvit_cupy.processor.video import VIDEO_EXTENSIONS
from glmvit_cupy.tower.geometry import MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS
from glmvit_cupy.tower.weights import BLOCK_TENSORS, NON_BLOCK_TENSORS, parameter_count, tensor_count
from glmvit_cupy.tower.writer import write_atomic

PAYLOAD_LIMIT = 32 * 2**20  # serve --payload-limit: a large photo as base64 JSON, with room
MODEL_HELP = ("Checkpoint directory (config.json + safetensors), or a Hugging Face repo id "
              "org/name[@revision] already in the local cache (never downloaded).")


def fail(message: str, status: int = 1) -> None:
    click.echo(f"glmvit-cupy: error: {message}", err=True)
    sys.exit(status)


def user_errors(command: Callable) -> Callable:
    """Turn GlmVitError (and running out of memory) into one line and exit status 1."""
    @functools.wraps(command)
    def wrapped(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except GlmVitError as exc:
            fail(str(exc))
        except MemoryError as exc:
            if type(exc).__module__.startswith("cupy"):  # CuPy's OutOfMemoryError is a MemoryError
                fail(f"out of GPU memory ({exc}): try a smaller --max-pixels (it sizes the GPU scratch) "
                     "or a device with more free memory")
            fail("out of host memory: try a smaller --max-image-tokens (the CPU backend's working memory "
                 "grows with an image's tokens) or a smaller --max-pixels (fewer images per forward call)")
    return wrapped


def check_writable(path: Path) -> None:
    """Refuse an output path we could not create, before any work is done."""
    if path.is_dir():
        raise GlmVitError(f"{path}: is a directory, expected an output file name")
    parent = path.parent
    if not parent.is_dir():
        raise GlmVitError(f"{path}: directory {parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".probe")
    except OSError as exc:
        raise GlmVitError(f"{path}: cannot write there: {exc.strerror}") from None
    os.close(fd)
    os.unlink(probe)


def to_numpy(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


def processor_options(command: Callable) -> Callable:
    """The processor settings the command line overrides (each command takes them the same way)."""
    options = [
        click.option("--min-image-tokens", type=click.IntRange(min=1), default=None,
                     help="Smaller images are enlarged to at least this many merged tokens. [default: "
                          f"the checkpoint's preprocessor_config.json, else {MIN_IMAGE_TOKENS}]"),
        click.option("--max-image-tokens", type=click.IntRange(min=1), default=None,
                     help="Larger images are shrunk to at most this many merged tokens. [default: "
                          f"the checkpoint's preprocessor_config.json, else {MAX_IMAGE_TOKENS}]"),
    ]
    for option in reversed(options):
        command = option(command)
    return command



# Options several commands (and examples/ray_embed.py) take, each written once.
model_option = click.option("--model", "model_dir", required=True, metavar="DIR|ORG/NAME[@REV]", help=MODEL_HELP)
backend_option = click.option("--backend", type=click.Choice(list(BACKENDS)), default="auto",
                              show_default=True, help="auto takes the GPU when CuPy sees one, else the NumPy backend.")
kernels_option = click.option("--kernels", type=click.Choice(list(KERNELS)), default="auto", show_default=True,
                              help="The GPU engines' kernels: auto takes the Hopper ones on sm_90, else the generic "
                                   "ones; generic or hopper forces a set.")
max_pixels_option = click.option("--max-pixels", type=click.IntRange(min=1), default=None,
                                 help="Pixel budget of one forward call, all images packed into it together (sizes "
                                      "the GPU scratch); it must hold one image at the processor's "
                                      "max_image_tokens. [default: one such image]")
files_from_option = click.option("--files-from", "files_from", metavar="LIST", default=None,
                                 help="Read more inputs from LIST, one a line ('-': standard input).")
output_option = click.option("--output", "which", type=click.Choice(list(OUTPUTS)), default=DEFAULT_OUTPUT,
                             show_default=True, help="pooler: the merger's output (what the LM splices in); "
                                                     "last_hidden: the downsample's output; both.")
shard_size_option = click.option("--shard-size", type=click.IntRange(min=1), default=DEFAULT_SHARD_SIZE,
                                 show_default=True, help="Images per shard (--out-dir).")

@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="glmvit-cupy")
def main() -> None:
    """Run the GLM-5.3-Flash vision tower without a framework.

    Turns images into the embeddings a VLM splices into its language model: on an NVIDIA
    GPU through CuPy + cuBLAS, or on the CPU through the float32 NumPy reference.
    """
    # A kill (SIGTERM) unwinds as Ctrl-C does: writers remove their temporaries, a collection
    # run finishes the shard in flight.
    signal.signal(signal.SIGTERM, _interrupt)


@main.command(epilog="""\b
Examples:
  glmvit-cupy encode photo.jpg --model ckpt --out emb.npy
  glmvit-cupy encode a.png b.png --model ckpt --out embs.npz --output both
  glmvit-cupy encode a.png a.png --model ckpt --out embs.npz     # two results, one a mention
  glmvit-cupy encode ~/photos --model ckpt --out-dir embs/
  glmvit-cupy encode 'shots/**/*.jpg' data-{000..009}.tar --model ckpt --out-dir embs/
  find /data -name '*.png' | glmvit-cupy encode --files-from - --model ckpt --out-dir embs/
  glmvit-cupy encode clip.mp4 --model ckpt --out emb.npz     # videos: .mp4 .mkv .webm .mov .avi
  glmvit-cupy encode ~/clips ~/photos --model ckpt --out-dir embs/    # videos and images together

Re-running the same --out-dir command after an interruption (Ctrl-C, a kill, a crash)
encodes only what is missing.""")
@click.argument("inputs", nargs=-1, type=str)
@files_from_option
@model_option
@click.option("--out", "out_path", type=click.Path(path_type=Path), default=None,
              help="Output file for a few images: .npy (one image, one output) or .npz (float32).")
@click.option("--out-dir", "out_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Output directory for a collection: shards, resumable (see below).")
@backend_option
@output_option
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None,
              help=f"Dtype of the shards' embeddings (--out-dir). [default: {DEFAULT_DTYPE}, what the LM consumes]")
@shard_size_option
@click.option("--workers", type=click.IntRange(min=0), default=DEFAULT_WORKERS,
              help=f"Decode processes (0: decode in the main process). [default: all cores but one, "
                   f"{DEFAULT_WORKERS} here]")
@click.option("--fail-fast", is_flag=True, help="Stop at the first input that fails (default: record it, go on).")
@click.option("--quiet", "-q", is_flag=True, help="No progress; only errors and the final summary line.")
@max_pixels_option
@click.option("--devices", default=None, metavar="all|0,1,...",
              help="One engine process per GPU (--out-dir): the tower read once, one decode pool, one "
                   "output directory. With --backend numpy, CPU engine processes. [default: one engine, "
                   "in this process]")
@kernels_option
@processor_options
@user_errors
def encode(inputs: tuple[str, ...], files_from: str | None, model_dir: str, out_path: Path | None,
           out_dir: Path | None, backend: str, which: str, dtype: str | None, shard_size: int, workers: int,
           fail_fast: bool, quiet: bool, max_pixels: int | None, devices: str | None, kernels: str,
           min_image_tokens: int | None, max_image_tokens: int | None) -> None:
    """Encode images and videos (INPUTS: files, directories, quoted glob patterns, .tar
    shards; videos by their extension, .mp4 .mkv .webm .mov .avi) into embeddings.

    With --out, a few images into one file: .npy holds float32 [tokens, out_hidden] of one
    image; .npz holds pooler_output and/or last_hidden_state (all images' tokens stacked),
    grid_thw [images, 3] and offsets [images + 1] (image i owns rows offsets[i]:offsets[i+1]).
    Videos (all the inputs) go into an .npz with their timestamps, frames and fps too.

    With --out-dir, a collection of any size, streamed: DIR/shard-00000.safetensors holds
    the shard's inputs' rows ([tokens, out_hidden], --dtype; a video's in time order),
    grid_thw and offsets; DIR/shard-00000.jsonl one line an input (source, kind, bytes,
    sha256, grid_thw, tokens, rows; a video's frames sampled, fps and the timestamps of its
    temporal groups). Inputs that fail to decode are listed in DIR/failures.jsonl and make
    the exit status non-zero; the rest are encoded.
    """
    from glmvit_cupy import GlmVit, load_geometry
    from glmvit_cupy.collection.pipeline import Decoder, check_collection_settings
    from glmvit_cupy.collection.sources import expand_inputs
    from glmvit_cupy.hub import resolve_model
    from glmvit_cupy.processor.preprocess import processor_config
    from glmvit_cupy.processor.video import check_video_config, video_config

    if (out_path is None) == (out_dir is None):
        raise GlmVitError("give exactly one of --out FILE (a few images) and --out-dir DIR (a collection)")
    if devices is not None and out_dir is None:
        raise GlmVitError("--devices applies to --out-dir collections; --out encodes a few images on one engine")
    device_list = None
    if devices is not None:
        from glmvit_cupy.deploy.devices import parse_devices
        device_list = parse_devices(devices)
    if not inputs and files_from is None:
        raise GlmVitError("no inputs: name image or video files, directories, patterns or .tar shards, or "
                          "--files-from")
    sources = expand_inputs(inputs, files_from, unique=out_dir is not None)  # --out: one result a mention
    if not sources:
        raise GlmVitError("the inputs name no image or video (directories are searched for "
                          f"{', '.join(sorted(IMAGE_EXTENSIONS | set(VIDEO_EXTENSIONS)))})")
    kinds = {source.kind for source in sources}
    if out_path is not None and "video" in kinds:
        if kinds != {"video"}:
            raise GlmVitError("--out takes images or videos, not both (--out-dir takes both)")
        _encode_videos(sources, model_dir, out_path, backend, which, dtype, max_pixels, kernels, min_image_tokens,
                       max_image_tokens)
        return
    if out_path is not None:
        _check_single_output(out_path, which, dtype, len(sources))

    directory = resolve_model(model_dir)
    budget = dict(min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens)
    processor, _ = processor_config(directory, **budget)
    geo = load_geometry(directory)
    check_collection_settings(geo, processor, max_pixels, images="image" in kinds)
    video = None
    if "video" in kinds:  # the video processor's settings, as encode_video takes them (the budget options too)
        video, _ = video_config(directory, **budget)
        check_video_config(video, geo)
    # its workers start now, while the tower is read
    decoder = Decoder(min(workers, len(sources)), processor, video=video)
    group = None
    try:
        if devices is None:
            vit = GlmVit.from_pretrained(directory, backend=backend, max_pixels=max_pixels, kernels=kernels,
                                         **budget)
        else:
            from glmvit_cupy.deploy.devices import EngineGroup
            vit = group = EngineGroup(directory, device_list, backend, max_pixels, processor, OUTPUTS[which],
                                      dtype or DEFAULT_DTYPE, kernels, video)
        if vit.backend_note and vit.backend == "numpy":
            click.echo(f"glmvit-cupy: {vit.backend_note}", err=True)
        if out_path is not None:
            _encode_to_file(vit, sources, out_path, which, decoder, processor)
        else:
            _encode_to_dir(vit, sources, out_dir, which, dtype or DEFAULT_DTYPE, shard_size, decoder, processor,
                           fail_fast, quiet, group)
    finally:
        if group is not None:
            group.close()
        decoder.close()


def _check_single_output(out_path: Path, which: str, dtype: str | None, images: int) -> None:
    suffix = out_path.suffix.lower()
    if suffix not in (".npy", ".npz"):
        raise GlmVitError(f"{out_path}: output must end in .npy or .npz")
    if suffix == ".npy" and (which == "both" or images > 1):
        raise GlmVitError(f"{out_path}: .npy holds one array; several images or --output both need .npz")
    if dtype is not None:
        raise GlmVitError("--dtype applies to --out-dir shards; .npy and .npz hold float32")
    check_writable(out_path)


def _encode_to_file(vit, sources, out_path: Path, which: str, decoder, processor) -> None:
    """A few images into one .npy/.npz, in memory; the first failure is the error."""
    from glmvit_cupy.collection.pipeline import stream

    results = []
    for result in stream(vit, sources, outputs=OUTPUTS[which], dtype="float32", processor=processor,
                         decoder=decoder):
        if result.error is not None:
            raise GlmVitError(result.error)
        results.append(result)
    arrays = {name: np.concatenate([r.arrays[name] for r in results]) for name in OUTPUTS[which]}
    grid = np.stack([r.grid_thw for r in results])
    counts = [len(r.arrays[OUTPUTS[which][0]]) for r in results]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    if out_path.suffix.lower() == ".npy":
        write_atomic(out_path, lambda f: np.save(f, next(iter(arrays.values()))))
    else:
        write_atomic(out_path, lambda f: np.savez(f, **arrays, grid_thw=grid, offsets=offsets))
    shape = next(iter(arrays.values())).shape
    click.echo(f"{out_path}: {len(results)} image(s), {shape[0]} tokens x {shape[1]} "
               f"({', '.join(arrays)}), backend {vit.backend}", err=True)


def _encode_videos(sources: list, model_dir: str, out_path: Path, backend: str, which: str, dtype: str | None,
                   max_pixels: int | None, kernels: str, min_image_tokens: int | None,
                   max_image_tokens: int | None) -> None:
    """Videos (sources.Source, files or tar members) into one .npz: pooler_output and/or
    last_hidden_state (every video's rows in time order, stacked), grid_thw [videos, 3], offsets
    [videos + 1] into the rows, timestamps (seconds of each temporal group's first frame,
    grid_thw[:, 0] of them a video, stacked), frames and fps [videos] (frames sampled, the
    source's rate). The token budget options set the whole video's."""
    from glmvit_cupy import GlmVit
    from glmvit_cupy.hub import resolve_model
    from glmvit_cupy.processor.video import video_config

    if out_path.suffix.lower() != ".npz" or dtype is not None:
        raise GlmVitError(f"{out_path}: videos go into a float32 .npz (rows, grid_thw and timestamps a video)")
    check_writable(out_path)
    directory = resolve_model(model_dir)
    budget = dict(min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens)
    config, _ = video_config(directory, **budget)
    vit = GlmVit.from_pretrained(directory, backend=backend, max_pixels=max_pixels, kernels=kernels)
    if vit.backend_note and vit.backend == "numpy":
        click.echo(f"glmvit-cupy: {vit.backend_note}", err=True)
    outs = []
    for source in sources:
        if source.member is None:
            outs.append(vit.encode_video(source.path, config=config))
        else:
            with source.open() as member:
                outs.append(vit.encode_video(member, config=config))
    arrays = {name: np.concatenate([getattr(out, name) for out in outs]) for name in OUTPUTS[which]}
    offsets = np.concatenate([[0], np.cumsum([len(out.pooler_output) for out in outs])]).astype(np.int64)
    write_atomic(out_path, lambda f: np.savez(
        f, **arrays, grid_thw=np.concatenate([out.grid_thw for out in outs]), offsets=offsets,
        timestamps=np.concatenate([out.timestamps for out in outs]),
        frames=np.array([out.frames for out in outs], dtype=np.int64),
        fps=np.array([out.fps for out in outs], dtype=np.float64)))
    shape = next(iter(arrays.values())).shape
    click.echo(f"{out_path}: {len(outs)} video(s), {sum(int(out.grid_thw[0, 0]) for out in outs)} temporal groups, "
               f"{shape[0]} tokens x {shape[1]} ({', '.join(arrays)}), backend {vit.backend}", err=True)


def _encode_to_dir(vit, sources, out_dir: Path, which: str, dtype: str, shard_size: int, decoder, processor,
                   fail_fast: bool, quiet: bool, group) -> None:
    """A collection into resumable shards, with progress and a summary line; `group` (--devices)
    is the stager of its engine processes."""
    from glmvit_cupy.collection.pipeline import encode_collection
    from glmvit_cupy.collection.progress import Progress

    unit = "inputs" if any(source.kind == "video" for source in sources) else "images"  # a video is not an image
    progress = Progress(quiet, unit=unit)
    try:
        summary = encode_collection(vit, sources, out_dir, shard_size=shard_size, output=which, dtype=dtype,
                                    processor=processor, fail_fast=fail_fast, progress=progress, decoder=decoder,
                                    stager=group)
    except KeyboardInterrupt:
        progress.close()
        fail(f"interrupted after {progress.done} {unit}; the finished shards are in {out_dir}: "
             "run the same command again to encode the rest", status=130)
    progress.close()
    busy = "n/a (NumPy backend)" if summary.gpu_busy is None else " ".join(f"{100 * b:.0f}%" for b in summary.gpu_busy)
    if group is not None and summary.gpu_busy is not None:
        busy += f" (devices {','.join(map(str, group.devices))})"
    click.echo(f"glmvit-cupy: encoded {summary.encoded}, skipped {summary.skipped}, failed {summary.failed} in "
               f"{summary.wall_s:.1f}s: {summary.images_per_s:.1f} {unit}/s, {summary.tokens_per_s:,.0f} tokens/s, "
               f"GPU busy {busy}", err=True)
    if summary.failed:
        fail(f"{summary.failed} input(s) failed; their reasons are in {out_dir / 'failures.jsonl'}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


@main.command(epilog="""\b
Examples:
  glmvit-cupy info --model ckpt
  glmvit-cupy info --model zai-org/GLM-5.3-Flash@v1.0 --max-image-tokens 2000""")
@model_option
@max_pixels_option
@processor_options
@user_errors
def info(model_dir: str, max_pixels: int | None, min_image_tokens: int | None,
         max_image_tokens: int | None) -> None:
    """Show the tower bound from a checkpoint (headers only; no tensor data is read) and the
    image and video processors' settings in force, each with where it came from (the budget
    options set both, as encode does)."""
    from PIL import Image

    from glmvit_cupy.gpu.scratch import scratch_plan
    from glmvit_cupy.hub import resolve_model
    from glmvit_cupy.processor.preprocess import PREPROCESSOR_FILE, check_processor, processor_config
    from glmvit_cupy.processor.video import check_video_config, video_config, video_config_file
    from glmvit_cupy.tower.checkpoint import locate_tower
    from glmvit_cupy.tower.geometry import patch_budget

    directory = resolve_model(model_dir)
    loc = locate_tower(directory)
    processor, sources = processor_config(directory, min_image_tokens=min_image_tokens,
                                          max_image_tokens=max_image_tokens)
    check_processor(processor, loc.geometry)
    geo = loc.geometry
    p_max = patch_budget(geo, max_pixels, processor.max_image_tokens)
    all_shards = sorted({p.name for p in directory.glob("*.safetensors")})
    read = [s.name for s in loc.shards]
    skipped = len(all_shards) - len(read)
    rows = [
        ("checkpoint", str(directory) + ("" if Path(model_dir) == directory else f" ({model_dir}, cached)")),
        ("prefix", loc.prefix or "none (bare names, as Glm5NextVisionModel.save_pretrained writes them)"),
        ("tensors", f"{len(loc.entries)} BF16 (census of depth x {len(BLOCK_TENSORS)} + {len(NON_BLOCK_TENSORS)} = "
                    f"{tensor_count(geo)} complete)"),
        ("parameters", f"{parameter_count(geo):,}"),
        ("bytes", f"{loc.tower_bytes:,} ({loc.tower_bytes / 2**30:.2f} GiB)"),
        ("shards read", ", ".join(read) + (f" ({skipped} other shard(s) not opened)" if skipped else "")),
        ("geometry", f"depth {geo.depth}, hidden {geo.hidden_size}, heads {geo.num_heads} (head_dim "
                     f"{geo.head_dim}), intermediate {geo.intermediate_size}, patch {geo.patch_size}x"
                     f"{geo.patch_size}x{geo.temporal_patch_size} ({geo.patch_dim} values), merge "
                     f"{geo.spatial_merge_size}, out {geo.out_hidden_size}, projection "
                     f"{geo.projection_intermediate_size}"),
        ("numerics", f"rms_norm_eps {geo.rms_norm_eps:g}, swiglu_limit {geo.swiglu_limit:g}, "
                     f"rope_theta {geo.rope_theta:g}"),
        ("p_max", f"{p_max} patches per forward call"),
        ("gpu scratch", f"{scratch_plan(geo, p_max).total_bytes / 2**20:.0f} MiB at p_max (allocated on the first image; "
                         "Hopper adds the flash pieces' buffer, sized by its SM count)"),
        ("processor", str(directory / PREPROCESSOR_FILE) if (directory / PREPROCESSOR_FILE).is_file()
         else f"no {PREPROCESSOR_FILE}: transformers' defaults"),
    ]
    for name, source in sources.items():
        value = getattr(processor, name)
        shown = f"{value} ({Image.Resampling(value).name.lower()})" if name == "resample" else str(value)
        rows.append((f"  {name}", f"{shown}  [{source}]"))
    where = video_config_file(directory)[1]
    rows.append(("video processor", "no processor_config.json, video_preprocessor_config.json or "
                 f"{PREPROCESSOR_FILE}: transformers' defaults" if where is None else
                 f"{directory / where.split()[0]}" + (" (its video_processor)" if " " in where else "")))
    try:  # settings no video can be encoded with (an image resample other than bicubic): shown, not fatal
        video, video_sources = video_config(directory, min_image_tokens=min_image_tokens,
                                            max_image_tokens=max_image_tokens)
        check_video_config(video, geo)
    except GlmVitError as exc:
        rows.append(("  refused", f"{exc} (images are unaffected; videos are refused)"))
        video_sources = {}
    for name, source in video_sources.items():
        value = getattr(video, name)
        shown = f"{value} (bicubic)" if name == "resample" else str(value)
        rows.append((f"  {name}", f"{shown}  [{source}]"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


@main.command(epilog="""\b
Examples:
  glmvit-cupy extract zai-org/GLM-5.3-Flash glm53-vision
  glmvit-cupy extract /data/GLM-5.3-Flash glm53-vision
  glmvit-cupy encode photo.jpg --model glm53-vision --out emb.npy""")
@click.argument("source", metavar="SRC")
@click.argument("destination", metavar="DST", type=click.Path(path_type=Path))
@user_errors
def extract(source: str, destination: Path) -> None:
    """Write the tower of SRC as a vision-only checkpoint in the new directory DST.

    SRC is anything --model takes (a checkpoint directory in any form, or a repo id in the
    local Hugging Face cache). DST gets config.json (model_type glm5_next_vision),
    model.safetensors (the tower's tensors under the bare names Glm5NextVisionModel's
    save_pretrained writes, bits unchanged) and SRC's preprocessor_config.json when it has one.
    Only the tower's bytes are read; DST appears whole or not at all.
    """
    from glmvit_cupy.extract import extract_tower

    done = extract_tower(source, destination)
    click.echo(f"{done.destination}: {len(done.location.entries)} BF16 tensors ({done.bytes_read / 2**20:.1f} MiB "
               f"read from {len(done.location.shards)} shard(s) of {done.source}); {', '.join(done.files)}")


@main.command("make-checkpoint", epilog="""\b
Examples:
  glmvit-cupy make-checkpoint ckpt --geometry tiny
  glmvit-cupy make-checkpoint ckpt --geometry tiny --seed 3 --force
  glmvit-cupy make-checkpoint real-ckpt --geometry real""")
@click.argument("directory", type=click.Path(path_type=Path, file_okay=False))
@click.option("--geometry", type=click.Choice(["real", "tiny"]), default="real", show_default=True,
              help="real: GLM-5.3-Flash's tower (1.05 GiB); tiny: a 2-block tower for quick runs.")
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed of the weights.")
@click.option("--force", is_flag=True, help="Replace the checkpoint DIRECTORY already holds (never another directory).")
@user_errors
def make_checkpoint(directory: Path, geometry: str, seed: int, force: bool) -> None:
    """Write a checkpoint in the released form with random weights into DIRECTORY.

    Same config.json, shard index, tensor names, shapes and BF16 dtype as the real
    GLM-5.3-Flash export, plus text-stack decoy tensors the binder must skip. For tests,
    benchmarks and first runs where the real weights are not at hand.
    """
    from glmvit_cupy.tower.checkpoint import locate_tower
    from glmvit_cupy.tower.synthetic import write_checkpoint

    out = write_checkpoint(directory, geometry, seed, replace=force)
    loc = locate_tower(out)
    click.echo(f"{out}: {geometry} tower, {len(loc.entries)} BF16 tensors, "
               f"{loc.tower_bytes / 2**20:.1f} MiB, seed {seed}")


@main.command(epilog="""\b
Examples:
  glmvit-cupy serve --model ckpt
  glmvit-cupy serve --model zai-org/GLM-5.3-Flash --host 0.0.0.0 --port 8080 --devices all
  curl -s --data-binary @photo.jpg -H 'Accept: application/x-npy' 'localhost:8000/embed?dtype=float32' -o emb.npy
  curl -s localhost:8000/v1/embeddings -H 'Content-Type: application/json' \\
       -d '{"input": ["data:image/jpeg;base64,'"$(base64 -w0 photo.jpg)"'"], "encoding_format": "base64"}'

SIGTERM or Ctrl-C drains: /health and new requests answer 503, the accepted ones finish,
then the server exits 0 (a second signal exits at once).""")
@model_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; only this host unless told).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Port to listen on (0: any free one; the start line names it).")
@backend_option
@click.option("--max-queue", type=click.IntRange(min=1), default=DEFAULT_MAX_QUEUE, show_default=True,
              help="Per engine: images waiting (or decoding) in its batcher, and half the requests the "
                   "server holds (arrival to response sent, answers being built included); past either a "
                   "request gets 429 at once.")
@click.option("--max-wait-ms", type=click.FloatRange(min=0), default=DEFAULT_MAX_WAIT_MS, show_default=True,
              help="How long a decoded image waits for images still decoding to share its forward call "
                   "(a lone image never waits).")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TIMEOUT_S,
              show_default=True, help="Seconds an image may wait for its result; past it the request gets 504.")
@max_pixels_option
@click.option("--payload-limit", type=click.IntRange(min=1), default=PAYLOAD_LIMIT,
              show_default=f"{PAYLOAD_LIMIT // 2**20} MiB",
              help="Largest request body (and --allow-files file), bytes; past it 413.")
@click.option("--cache-bytes", type=click.IntRange(min=0), default=DEFAULT_CACHE_BYTES, show_default=True,
              help="Encoder cache (results by sha256 of the image bytes), LRU within this many bytes; 0: "
                   "keep none.")
@click.option("--allow-files", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              metavar="DIR", help="Accept paths (and file:// URLs) as /v1/embeddings inputs, only under DIR. "
                                  "[default: refuse every path]")
@click.option("--devices", default=None, metavar="all|0,1,...",
              help="One engine per GPU, one batcher each, requests to the least loaded. With --backend numpy, "
                   "CPU engines. [default: one engine]")
@click.option("--http-workers", type=click.IntRange(min=1), default=DEFAULT_HTTP_WORKERS,
              show_default=f"{DEFAULT_HTTP_WORKERS}: half the usable cores, at most 8",
              help="HTTP front processes: each accepts connections and does a request's HTTP, JSON and image "
                   "decode, handing the images to the one engine process.")
@kernels_option
@processor_options
@user_errors
def serve(model_dir: str, host: str, port: int, backend: str, max_queue: int, max_wait_ms: float, timeout_s: float,
          max_pixels: int | None, payload_limit: int, cache_bytes: int, allow_files: Path | None,
          devices: str | None, http_workers: int, kernels: str, min_image_tokens: int | None,
          max_image_tokens: int | None) -> None:
    """Serve embeddings over HTTP (the [serve] extra).

    POST /v1/embeddings (OpenAI's shape, images as data:image/...;base64, URLs), POST /embed
    (an image file's bytes in, safetensors or .npy out), GET /health, /info and /metrics
    (Prometheus).

    Requests from every client are batched into shared forward calls; results are cached by
    the sha256 of the image bytes. HTTP, JSON and the images' decode run in --http-workers
    front processes, the engines in this one. Each request is one line on stderr.
    """
    try:
        from glmvit_cupy.deploy import serve as server
    except ImportError as exc:
        if exc.name not in ("starlette", "uvicorn", "prometheus_client"):
            raise
        raise GlmVitError(f'serve needs the [serve] extra ({exc.name} is not installed): pip install -e ".[serve]"') \
            from None
    from glmvit_cupy.hub import resolve_model

    directory = resolve_model(model_dir)
    limits = server.Limits(max_queue=max_queue, max_wait_ms=max_wait_ms, timeout_s=timeout_s,
                           payload_limit=payload_limit,
                           cache_bytes=cache_bytes,
                           allow_files=None if allow_files is None else allow_files.resolve())
    sock = server.listen(host, port)  # a port in use is refused before the tower is read
    vits = _engines(directory, backend, devices, max_pixels, kernels, min_image_tokens, max_image_tokens)
    if vits[0].backend_note and vits[0].backend == "numpy":
        click.echo(f"glmvit-cupy: {vits[0].backend_note}", err=True)
    try:
        status = server.run(vits, model=model_dir, directory=directory, limits=limits, sock=sock,
                            http_workers=http_workers)
    finally:
        for vit in vits:
            vit.close()
    sys.exit(status)


def _engines(directory: Path, backend: str, devices: str | None, max_pixels: int | None, kernels: str,
             min_image_tokens: int | None, max_image_tokens: int | None) -> list:
    """One GlmVit, or with --devices one a device over one read of the tower."""
    from glmvit_cupy import GlmVit
    from glmvit_cupy.deploy.devices import all_devices, parse_devices
    from glmvit_cupy.processor.preprocess import processor_config
    from glmvit_cupy.tower.checkpoint import bind_checkpoint

    budget = dict(min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens)
    if devices is None:
        return [GlmVit.from_pretrained(directory, backend=backend, max_pixels=max_pixels, kernels=kernels, **budget)]
    device_list = parse_devices(devices) or all_devices()
    processor, _ = processor_config(directory, **budget)
    weights = bind_checkpoint(directory)
    return [GlmVit.from_weights(weights, backend, max_pixels, device=d, processor=processor, kernels=kernels)
            for d in device_list]


@main.command(epilog="""\b
Examples:
  glmvit-cupy bench --model ckpt
  glmvit-cupy bench --model ckpt --image-size 448 --image-size 1344 --batch 4
  glmvit-cupy bench --model ckpt --kernels generic --attention naive""")
@model_option
@click.option("--image-size", "sizes", multiple=True, type=click.IntRange(min=28), default=(448,), show_default=True,
              help="Square image side in pixels; repeat for several cases.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Images of each size per forward call.")
@click.option("--attention", type=click.Choice(["flash", "naive"]), default=None,
              help="flash: the fused kernel; naive: materialised scores (the cross-check). "
                   "[default: the engine's choice, flash where the head_dim has a flash kernel]")
@kernels_option
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Timed calls per case.")
@user_errors
def bench(model_dir: str, sizes: tuple[int, ...], batch: int, attention: str, kernels: str, iters: int) -> None:
    """Time the GPU engine: median ms, TFLOP/s, % of cuBLAS's peak, scratch, stages.

    Forward only (preprocessing and the pixel upload excluded), median of CUDA-event timings
    after warm-up, on photo-like images (those of benchmarks/compare_transformers.py). The
    ceiling is a BF16 8192^3 GEMM measured in the same process twice: in a burst, and after 3 s
    of back-to-back GEMMs, when the board's power cap has lowered the clock (on an H200 from
    ~1.98 to ~1.5 GHz). The first call is the case's shape cold (eager, no graph yet). Stages
    (an eager run) are whole sublayers, summed over the blocks: patch_embed (with the RoPE
    tables), attention_sublayer (norm, QKV GEMM, QK-norm + RoPE, attention, proj GEMM),
    mlp_sublayer (norm, gate|up GEMM, SwiGLU, down GEMM), merger.
    """
    from glmvit_cupy import GlmVit, load_geometry, preprocess
    from glmvit_cupy.gpu.benchmark import cublas_peak, time_engine
    from glmvit_cupy.hub import resolve_model
    from glmvit_cupy.model import gpu_available
    from glmvit_cupy.processor.preprocess import processor_config
    from glmvit_cupy.tower.geometry import patch_budget
    from glmvit_cupy.tower.synthetic import photo_like

    ok, why = gpu_available()
    if not ok:
        raise GlmVitError(f"bench needs a CUDA GPU: {why}")
    import cupy

    directory = resolve_model(model_dir)
    # The inputs of the committed numbers (benchmarks/compare_transformers.py): photo-like images,
    # seeds 0.. within a batch; uniform noise has none of a photo's statistics.
    cases = [(size, preprocess([photo_like(size, size, seed=i) for i in range(batch)])) for size in sizes]
    geo = load_geometry(directory)
    most = max(len(pixels) for _, (pixels, _) in cases)  # raise the budget only where a case needs it
    default = patch_budget(geo, None, processor_config(directory)[0].max_image_tokens)
    vit = GlmVit.from_pretrained(directory, backend="cupy", attention=attention, kernels=kernels,
                                 max_pixels=max(most, default) * geo.patch_size ** 2)
    peak = cublas_peak()
    click.echo(f"device {why}; cuBLAS bf16 8192^3 peak {peak.burst:.0f} TFLOP/s in a burst, {peak.sustained:.0f} "
               f"sustained; scratch {vit.scratch_bytes / 2**20:.0f} MiB for p_max {vit.p_max}; "
               f"attention {vit.tower.attention_kind}; kernels {'hopper' if vit.tower.k.hopper else 'generic'}")
    for size, (pixels, grid) in cases:
        t = time_engine(vit, cupy.asarray(pixels), grid, iters=iters)
        stages = ", ".join(f"{k} {v:.2f}" for k, v in t.stages_ms.items())
        click.echo(f"{batch} x {size}x{size} ({len(pixels)} patches): {t.median_ms:.2f} ms, {t.tflops:.0f} TFLOP/s "
                   f"({100 * t.tflops / peak.burst:.0f}% / {100 * t.tflops / peak.sustained:.0f}% of the burst / "
                   f"sustained peak); first call {t.first_call_ms:.0f} ms; eager stages ms: {stages}")


if __name__ == "__main__":
    main()
