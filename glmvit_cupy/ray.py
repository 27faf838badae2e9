"""Many hosts through Ray Data: the tower as a `map_batches` actor, and our shard format as a sink.

    ds = ray.data.from_items(rows_of(expand_inputs(["photos/", "data-000.tar"])))
    ds = ds.map_batches(GlmVitEmbedder, fn_constructor_kwargs={"model": "ckpt"},
                        compute=ray.data.ActorPoolStrategy(size=8), num_gpus=1, batch_size=256)
    ds.write_datasink(ShardSink("embs/"))
    for record, arrays in read_embeddings(parts("embs/")): ...

A row carries an image (a video among the rows fails alone: `glmvit-cupy encode --out-dir` takes
videos): `bytes` (the file's contents; `path` then only names it) or a `path`
the actors can read (with `member`, `offset` and `size` for a tar member, as `rows_of` writes
them). It comes back as its source (`path`, `member`, `key`), `nbytes`, `sha256`, `grid_thw`, the
embeddings (`pooler_output` and/or `last_hidden_state`, [tokens, out_hidden] in `dtype`; bfloat16
as its uint16 bits), `error` ("" when it encoded; a failed row has no tokens) and `metadata` (the
settings a shard records). Each actor builds its engine itself (the driver never touches CUDA),
with CuPy's memory pool capped at the actor's share of its GPU.

`ShardSink` writes each write task's rows as an output directory of its own, `OUT/part-*`,
appearing whole or not at all (a retried task leaves no half of itself), so several hosts write
into one shared directory without coordinating; `parts(OUT)` lists them for `read_embeddings`
and `read_records` (what is done, for a resume). Separate from the rest because Ray is an
optional extra (`pip install -e ".[ray]"`): nothing else imports this module.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import ray
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink

from .errors import GlmVitError
from .pipeline import DEFAULT_OUTPUT, Decoder, shard_metadata, stream
from .shards import DEFAULT_SHARD_SIZE, FAILURES, ShardWriter
from .sources import Source
from .staging import DEFAULT_DTYPE, DTYPES, make_stager
from .writer import atomic_directory, write_atomic

PART = "part-"


@dataclasses.dataclass(frozen=True)
class _RowBytes(Source):
    """A row's image bytes, named by its path: read from the row, not from a file."""

    data: bytes = b""

    def read(self) -> bytes:
        return self.data


def rows_of(sources: Iterable[Source]) -> list[dict[str, Any]]:
    """Rows for `ray.data.from_items` naming each source (sources.expand_inputs), to be read
    by the actors: the paths must be readable where they run (a shared file system)."""
    return [{"path": s.path, "member": s.member, "offset": s.offset, "size": s.size} for s in sources]


def _items(batch: dict[str, np.ndarray]) -> list[Source]:
    n = len(next(iter(batch.values())))
    column = {name: batch.get(name, [None] * n) for name in ("path", "member", "offset", "size", "bytes")}
    items: list[Source] = []
    for i in range(n):
        path, member, data = column["path"][i], column["member"][i], column["bytes"][i]
        member = member if isinstance(member, str) else None
        if data is not None:
            items.append(_RowBytes(str(path if path is not None else f"row {i}"), member, data=bytes(data)))
        elif path is None:
            raise GlmVitError("a row has neither 'bytes' nor 'path': give the image's bytes or a path to read")
        else:
            offset, size = column["offset"][i], column["size"][i]
            items.append(Source(str(path), member, int(offset or 0), -1 if size is None else int(size)))
    return items


class GlmVitEmbedder:
    """The callable class for `Dataset.map_batches`: one engine an actor, built in the actor.

    `model` is anything `GlmVit.from_pretrained` takes, readable on every node. `output`
    ("pooler", "last_hidden", "both") and `dtype` (float32, float16, bfloat16 as uint16 bits)
    are the CLI's --output and --dtype, `kernels` its --kernels. `gpu_memory_fraction` caps
    CuPy's memory pool (default: the GPU share Ray gave this actor, so actors with num_gpus=0.5
    each get half). `workers`: decode threads inside the actor (default 0: in the actor's own
    thread; give map_batches num_cpus to match when raising it). Per-launch checks follow the
    actor's own GLMVIT_CHECK_LAUNCHES (a cluster's workers get it through Ray's runtime_env
    env_vars, not from the driver's shell)."""

    def __init__(self, model: str, *, backend: str = "auto", output: str = DEFAULT_OUTPUT, dtype: str = DEFAULT_DTYPE,
                 max_pixels: int | None = None, kernels: str = "auto", gpu_memory_fraction: float | None = None,
                 workers: int = 0, min_image_tokens: int | None = None, max_image_tokens: int | None = None) -> None:
        from .model import GlmVit, check_output_options, gpu_available

        outputs = check_output_options(output, dtype)
        if backend != "numpy" and gpu_available()[0]:
            import cupy

            share = ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0)
            fraction = share if gpu_memory_fraction is None else gpu_memory_fraction
            cupy.get_default_memory_pool().set_limit(fraction=min(1.0, fraction))  # before the engine allocates
        self.vit = GlmVit.from_pretrained(model, backend=backend, max_pixels=max_pixels, kernels=kernels,
                                          min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens)
        self.outputs, self.dtype = outputs, dtype
        processor = self.vit.processor
        # threads: Ray kills an actor's child processes before its shutdown hook runs, so a
        # process pool could not be closed, and its semaphores' cleanup printed tracebacks
        self.decoder = Decoder(workers, processor, threads=True)
        self.stager = make_stager(self.vit, processor)
        self.metadata = json.dumps(shard_metadata(self.vit, self.outputs, dtype, processor), sort_keys=True)
        self.empty = np.zeros((0, self.vit.geometry.out_hidden_size), dtype=DTYPES[dtype][0])

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        rows: dict[str, list] = {name: [] for name in ("path", "member", "key", "nbytes", "sha256", "grid_thw",
                                                        *self.outputs, "error", "metadata")}
        for result in stream(self.vit, _items(batch), outputs=self.outputs, dtype=self.dtype,
                             decoder=self.decoder, stager=self.stager):
            record = result.item.record()
            rows["path"].append(record["path"])
            rows["member"].append(record.get("member"))
            rows["key"].append(record.get("key"))
            rows["nbytes"].append(result.nbytes)
            rows["sha256"].append(result.sha256)
            rows["grid_thw"].append(np.zeros(3, np.int64) if result.error else result.grid_thw)
            for name in self.outputs:
                rows[name].append(self.empty if result.error else result.arrays[name])
            rows["error"].append(result.error or "")
            rows["metadata"].append(self.metadata)
        rows["grid_thw"] = np.stack(rows["grid_thw"]) if rows["grid_thw"] else np.zeros((0, 3), np.int64)
        return rows

    def __del__(self) -> None:
        decoder = getattr(self, "decoder", None)
        if decoder is not None:
            decoder.close()


class ShardSink(Datasink):
    """`Dataset.write_datasink` target: each write task's rows (GlmVitEmbedder's) become one
    output directory `out_dir/part-<task>-<random>` of `shard_size`-image shards, with its
    failed rows in its failures.jsonl; renamed into place once whole."""

    def __init__(self, out_dir: str | Path, shard_size: int = DEFAULT_SHARD_SIZE) -> None:
        self.out_dir, self.shard_size = Path(out_dir), shard_size

    @property
    def min_rows_per_write(self) -> int:
        return self.shard_size  # a part holds whole shards, not one per batch

    def on_write_start(self, schema: Any = None) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def write(self, blocks: Iterable[Any], ctx: Any) -> int:
        rows = (row for block in blocks for row in BlockAccessor.for_block(block).iter_rows(public_row_format=False))
        first = next(rows, None)
        if first is None:
            return 0
        metadata = json.loads(first["metadata"])
        outputs: Sequence[str] = metadata["outputs"].split(",")
        written, failures = 0, []
        with atomic_directory(self.out_dir / f"{PART}{ctx.task_idx:05d}-{secrets.token_hex(4)}") as tmp:
            width = np.asarray(first[outputs[0]]).shape[1]  # a failed row's is [0, out_hidden]
            writer = ShardWriter(tmp, outputs, metadata["dtype"], width, self.shard_size, 0, metadata)
            try:
                for row in itertools.chain([first], rows):
                    if row["metadata"] != first["metadata"]:
                        raise GlmVitError(f"{row['path']}: embedded with other settings than {first['path']} "
                                          "(another model, output, dtype or processor): not one collection")
                    record = {"path": row["path"]}
                    if row["member"] is not None:
                        record.update(member=row["member"], key=row["key"])
                    record["kind"] = Source(row["path"], row["member"]).kind  # an image: a video fails here
                    if row["error"]:
                        failures.append({**record, "error": row["error"]})
                        continue
                    writer.add({**record, "bytes": row["nbytes"], "sha256": row["sha256"]},
                               {name: row[name] for name in outputs}, row["grid_thw"])
                    written += 1
                writer.finish()
                writer.close()
            except BaseException:
                writer.discard()
                raise
            if failures:
                lines = "".join(json.dumps(f, separators=(",", ":")) + "\n" for f in failures)
                write_atomic(tmp / FAILURES, lambda f: f.write(lines.encode()))
        return written


def parts(out_dir: str | Path) -> list[Path]:
    """The finished part directories ShardSink wrote into `out_dir` (from every host), sorted:
    one collection for read_embeddings / read_records."""
    out_dir = Path(out_dir)
    return sorted(p for p in out_dir.iterdir() if p.is_dir() and p.name.startswith(PART)) if out_dir.is_dir() else []
