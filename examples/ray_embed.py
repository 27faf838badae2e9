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

import argparse
import sys
import time

import ray

from glmvit_cupy.collection.pipeline import DEFAULT_OUTPUT, OUTPUTS
from glmvit_cupy.collection.shards import DEFAULT_SHARD_SIZE, FAILURES, read_records, record_key
from glmvit_cupy.collection.sources import IMAGE_EXTENSIONS, expand_inputs
from glmvit_cupy.collection.staging import DEFAULT_DTYPE, DTYPES
from glmvit_cupy.deploy.ray import DEFAULT_BATCH_SIZE, ShardSink, cluster_plan, embed, parts, rows_of
from glmvit_cupy.errors import GlmVitError
from glmvit_cupy.model import KERNELS

EXAMPLES = """examples:
  python examples/ray_embed.py ~/photos --model ckpt --out-dir embs/
  python examples/ray_embed.py /shared/photos /shared/data-000.tar --model /shared/ckpt \\
      --out-dir /shared/embs --address auto                # the cluster `ray start` made, all its GPUs
  python examples/ray_embed.py photos/ --model ckpt --out-dir embs/ --actors 2 --gpus-per-actor 0.5

Exit status 0 when every input was embedded (or already was); 1 when an input failed (each is
listed with its reason in OUT/failures.jsonl, as encode lists them) or on an error."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="*", metavar="INPUT",
                    help="image files, directories, quoted glob patterns, uncompressed .tar shards")
    ap.add_argument("--files-from", metavar="LIST", default=None,
                    help="read more inputs from LIST, one a line ('-': standard input)")
    ap.add_argument("--model", required=True, help="checkpoint directory or cached repo id, readable on every node")
    ap.add_argument("--out-dir", required=True, help="where the part directories go (shared by every node)")
    ap.add_argument("--address", default=None,
                    help="Ray cluster to join ('auto': the one `ray start` made on this host) [default: start a "
                         "local one on this machine]")
    ap.add_argument("--actors", type=int, default=None,
                    help="engine actors, one engine each [default: one a GPU of the cluster at --gpus-per-actor "
                         "each; 1 on a cluster without GPUs]")
    ap.add_argument("--gpus-per-actor", type=float, default=None,
                    help="GPUs an actor holds; 0: CPU actors on the NumPy backend [default: 1 where the cluster "
                         "has GPUs, else 0]")
    ap.add_argument("--decode-tasks", type=int, default=None,
                    help="decode tasks at a time, one CPU each [default: the cluster's CPUs less one an actor and "
                         "one for the write tasks]")
    ap.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE,
                    help=f"images an actor call [default: {DEFAULT_BATCH_SIZE}]")
    ap.add_argument("--backend", choices=["auto", "numpy", "cupy"], default="auto",
                    help="the actors' backend; auto: cupy when they hold GPUs, else numpy [default: auto]")
    ap.add_argument("--output", choices=list(OUTPUTS), default=DEFAULT_OUTPUT,
                    help="pooler: the merger's output (what the LM splices in); last_hidden: the downsample's "
                         f"output; both [default: {DEFAULT_OUTPUT}]")
    ap.add_argument("--dtype", choices=list(DTYPES), default=DEFAULT_DTYPE,
                    help=f"dtype of the shards' embeddings [default: {DEFAULT_DTYPE}, as encode's]")
    ap.add_argument("--kernels", choices=list(KERNELS), default="auto",
                    help="the GPU engines' kernels, as encode's --kernels [default: auto]")
    ap.add_argument("--max-pixels", type=int, default=None,
                    help="pixel budget of one forward call, as encode's [default: one image at the processor's "
                         "max_image_tokens]")
    ap.add_argument("--min-image-tokens", type=int, default=None,
                    help="smaller images are enlarged to at least this many merged tokens [default: the "
                         "checkpoint's preprocessor_config.json]")
    ap.add_argument("--max-image-tokens", type=int, default=None,
                    help="larger images are shrunk to at most this many merged tokens [default: the checkpoint's "
                         "preprocessor_config.json]")
    ap.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
                    help=f"images a shard (a write task writes at least one shard) [default: {DEFAULT_SHARD_SIZE}]")
    return ap


def main() -> None:
    args = parser().parse_args()
    if not args.inputs and args.files_from is None:
        raise GlmVitError("no inputs: name image files, directories, patterns or .tar shards, or --files-from")

    done = {record_key(r) for r in read_records(parts(args.out_dir))}
    sources = expand_inputs(args.inputs, args.files_from)
    if not sources:
        raise GlmVitError("the inputs name no image (directories are searched for "
                          f"{', '.join(sorted(IMAGE_EXTENSIONS))})")
    todo = [s for s in sources if s.key not in done]
    print(f"ray_embed: {len(todo)} to embed, {len(sources) - len(todo)} already in {args.out_dir}", file=sys.stderr)
    if not todo:
        return
    ray.init(address=args.address, include_dashboard=False)
    plan = cluster_plan(args.actors, args.gpus_per_actor, args.backend, args.decode_tasks)
    print(f"ray_embed: {plan}" + ("" if plan.gpus_per_actor else " (the cluster has no GPU for them: slow)"),
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    ds = embed(ray.data.from_items(rows_of(todo)), args.model, plan=plan, batch_size=args.batch_size,
               output=args.output, dtype=args.dtype, kernels=args.kernels, max_pixels=args.max_pixels,
               min_image_tokens=args.min_image_tokens, max_image_tokens=args.max_image_tokens)
    sink = ShardSink(args.out_dir, args.shard_size)
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
