"""Embed images and tar shards on a Ray cluster into our shard format (glmvit_cupy.deploy.ray).

Every node must see the inputs, the model and OUT at the same paths (a shared file system).
The driver lists the inputs (as `glmvit-cupy encode` does); decode tasks read, decode and
resize them on the cluster's CPUs; engine actors embed the canvases (one engine an actor);
each write task adds a finished part directory under OUT. Run the same command again and
only what is missing is embedded. Without GPUs in the cluster the actors run the NumPy
backend on the CPU (slow), and the command says so. Read the result as one collection:

    from glmvit_cupy import read_embeddings
    from glmvit_cupy.deploy.ray import parts
    for record, arrays in read_embeddings(parts("embs/")): ...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
import ray

from glmvit_cupy.cli import (files_from_option, kernels_option, max_pixels_option, model_option, output_option,
                             processor_options, shard_size_option)
from glmvit_cupy.collection.shards import FAILURES, read_records, record_key
from glmvit_cupy.collection.sources import IMAGE_EXTENSIONS, expand_inputs
from glmvit_cupy.collection.staging import DEFAULT_DTYPE, DTYPES
from glmvit_cupy.deploy.ray import DEFAULT_BATCH_SIZE, ShardSink, cluster_plan, embed, parts, rows_of
from glmvit_cupy.errors import GlmVitError

EXAMPLES = """\b
Examples:
  python examples/ray_embed.py ~/photos --model ckpt --out-dir embs/
  python examples/ray_embed.py /shared/photos /shared/data-000.tar --model /shared/ckpt \\
      --out-dir /shared/embs --address auto                # the cluster `ray start` made, all its GPUs
  python examples/ray_embed.py photos/ --model ckpt --out-dir embs/ --actors 2 --gpus-per-actor 0.5

Exit status 0 when every input was embedded (or already was); 1 when an input failed (each is
listed with its reason in OUT/failures.jsonl, as encode lists them) or on an error."""


@click.command(help=__doc__.split("\n")[0], epilog=EXAMPLES, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("inputs", nargs=-1, metavar="[INPUT]...")
@files_from_option
@model_option
@click.option("--out-dir", "out_dir", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Where the part directories go (shared by every node).")
@click.option("--address", default=None,
              help="Ray cluster to join ('auto': the one `ray start` made on this host). [default: start a "
                   "local one on this machine]")
@click.option("--actors", type=click.IntRange(min=1), default=None,
              help="Engine actors, one engine each. [default: one a GPU of the cluster at --gpus-per-actor "
                   "each; 1 on a cluster without GPUs]")
@click.option("--gpus-per-actor", type=click.FloatRange(min=0), default=None,
              help="GPUs an actor holds; 0: CPU actors on the NumPy backend. [default: 1 where the cluster "
                   "has GPUs, else 0]")
@click.option("--decode-tasks", type=click.IntRange(min=1), default=None,
              help="Decode tasks at a time, one CPU each. [default: the cluster's CPUs less one an actor and "
                   "one for the write tasks]")
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH_SIZE, show_default=True,
              help="Images an actor call.")
@click.option("--backend", type=click.Choice(["auto", "numpy", "cupy"]), default="auto", show_default=True,
              help="The actors' backend; auto: cupy when they hold GPUs, else numpy.")
@output_option
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=DEFAULT_DTYPE, show_default=True,
              help="Dtype of the shards' embeddings (encode's default).")
@kernels_option
@max_pixels_option
@processor_options
@shard_size_option
def main(inputs: tuple[str, ...], files_from: str | None, model_dir: str, out_dir: Path, address: str | None,
         actors: int | None, gpus_per_actor: float | None, decode_tasks: int | None, batch_size: int, backend: str,
         which: str, dtype: str, kernels: str, max_pixels: int | None, min_image_tokens: int | None,
         max_image_tokens: int | None, shard_size: int) -> None:
    if not inputs and files_from is None:
        raise GlmVitError("no inputs: name image files, directories, patterns or .tar shards, or --files-from")

    done = {record_key(r) for r in read_records(parts(out_dir))}
    sources = expand_inputs(inputs, files_from)
    if not sources:
        raise GlmVitError("the inputs name no image (directories are searched for "
                          f"{', '.join(sorted(IMAGE_EXTENSIONS))})")
    todo = [s for s in sources if s.key not in done]
    print(f"ray_embed: {len(todo)} to embed, {len(sources) - len(todo)} already in {out_dir}", file=sys.stderr)
    if not todo:
        return
    ray.init(address=address, include_dashboard=False)
    plan = cluster_plan(actors, gpus_per_actor, backend, decode_tasks)
    print(f"ray_embed: {plan}" + ("" if plan.gpus_per_actor else " (the cluster has no GPU for them: slow)"),
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    ds = embed(ray.data.from_items(rows_of(todo)), model_dir, plan=plan, batch_size=batch_size,
               output=which, dtype=dtype, kernels=kernels, max_pixels=max_pixels,
               min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens)
    sink = ShardSink(out_dir, shard_size)
    ds.write_datasink(sink)
    wall = time.perf_counter() - start
    print(f"ray_embed: encoded {sink.written}, skipped {len(sources) - len(todo)}, failed {len(sink.failures)} in "
          f"{wall:.1f}s: {sink.written / wall:.1f} images/s", file=sys.stderr)
    if sink.failures:
        raise GlmVitError(f"{len(sink.failures)} input(s) failed; their reasons are in "
                          f"{sink.out_dir / FAILURES}")


if __name__ == "__main__":
    try:
        main()
    except GlmVitError as exc:
        sys.exit(f"ray_embed: error: {exc}")
