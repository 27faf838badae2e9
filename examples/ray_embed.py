"""Embed an image folder or tar shards on a Ray cluster and write our shard format.

    python examples/ray_embed.py ~/photos data-000.tar --model ckpt --out-dir embs/ --actors 8
    python examples/ray_embed.py ... --address auto            # an existing cluster (`ray start`)

Every node must see the inputs, the model and OUT at the same paths (a shared file system):
the driver lists the inputs (glmvit_cupy.sources.expand_inputs, as `glmvit-cupy encode` does),
the actors read and embed them (one engine an actor, `--gpus-per-actor` of a GPU each; 0 on a
machine without one), and each write task adds a finished part directory under OUT. Run it
again and only what is missing is embedded. Read the result as one collection:

    from glmvit_cupy import read_embeddings
    from glmvit_cupy.ray import parts
    for record, arrays in read_embeddings(parts("embs/")): ...
"""

from __future__ import annotations

import argparse
import sys
import time

import ray

from glmvit_cupy.errors import GlmVitError
from glmvit_cupy.model import KERNELS
from glmvit_cupy.pipeline import DEFAULT_OUTPUT, OUTPUTS
from glmvit_cupy.ray import GlmVitEmbedder, ShardSink, parts, rows_of
from glmvit_cupy.shards import DEFAULT_SHARD_SIZE, read_records, record_key
from glmvit_cupy.sources import expand_inputs
from glmvit_cupy.staging import DEFAULT_DTYPE, DTYPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="image files, directories, quoted patterns, .tar shards")
    ap.add_argument("--model", required=True, help="checkpoint directory or cached repo id, on every node")
    ap.add_argument("--out-dir", required=True, help="where the part directories go (shared by every node)")
    ap.add_argument("--address", default=None, help="Ray cluster to join ('auto': the one `ray start` made); "
                                                    "default: a local one")
    ap.add_argument("--actors", type=int, default=1, help="engines (one an actor)")
    ap.add_argument("--gpus-per-actor", type=float, default=1.0, help="0: the NumPy backend on the CPU")
    ap.add_argument("--batch-size", type=int, default=64, help="images an actor call")
    ap.add_argument("--workers", type=int, default=0,
                    help="decode threads an actor (0: in the actor's own thread); each actor reserves as many CPUs")
    ap.add_argument("--backend", choices=["auto", "numpy", "cupy"], default="auto")
    ap.add_argument("--output", choices=list(OUTPUTS), default=DEFAULT_OUTPUT)
    ap.add_argument("--dtype", choices=list(DTYPES), default=DEFAULT_DTYPE)
    ap.add_argument("--kernels", choices=list(KERNELS), default="auto", help="the GPU engines' kernel set")
    ap.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE)
    args = ap.parse_args()

    done = {record_key(r) for r in read_records(parts(args.out_dir))}
    todo = [s for s in expand_inputs(args.inputs) if s.key not in done]
    print(f"ray_embed: {len(todo)} to embed, {len(done)} already in {args.out_dir}", file=sys.stderr)
    if not todo:
        return
    start = time.perf_counter()
    ray.init(address=args.address, include_dashboard=False)
    ds = ray.data.from_items(rows_of(todo))
    ds = ds.map_batches(GlmVitEmbedder,
                        fn_constructor_kwargs={"model": args.model, "backend": args.backend, "output": args.output,
                                               "dtype": args.dtype, "kernels": args.kernels,
                                               "workers": args.workers},
                        compute=ray.data.ActorPoolStrategy(size=args.actors), num_gpus=args.gpus_per_actor,
                        num_cpus=max(1, args.workers), batch_size=args.batch_size)
    ds.write_datasink(ShardSink(args.out_dir, args.shard_size))
    written = sum(1 for _ in read_records(parts(args.out_dir))) - len(done)
    print(f"ray_embed: embedded {written} of {len(todo)} in {time.perf_counter() - start:.1f}s "
          f"({len(todo) - written} failed: see failures.jsonl in the parts)", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except GlmVitError as exc:
        sys.exit(f"ray_embed: error: {exc}")
