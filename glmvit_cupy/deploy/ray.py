"""Many hosts through Ray Data: decode tasks on CPUs, the tower in GPU actors, our shards as the sink.

    ds = ray.data.from_items(rows_of(expand_inputs(["photos/", "data-000.tar"])))
    ds = embed(ds, "ckpt")                       # decode tasks -> GlmVitEmbedder actors
    ds.write_datasink(ShardSink("embs/"))
    for record, arrays in read_embeddings(parts("embs/")): ...

Ray Data's offline batch inference in the local pipeline's two stages (pipeline.py):
- `decode`, a map_batches function run as CPU tasks: a row's image (`bytes`, or a `path`
  the tasks can read, with `member`, `offset` and `size` for a tar member, as `rows_of` writes
  them) becomes its uint8 canvas (pipeline.prepare: read, decode, resize, pad), the file's
  `nbytes` and `sha256`, or an `error` (a video among the rows fails alone: `glmvit-cupy encode
  --out-dir` takes videos).
- `GlmVitEmbedder`, a callable class run as actors (one engine each, built in the actor: the
  driver never touches CUDA): a call packs its rows' canvases into forward batches as
  `encode` does (pipeline.encode_prepared: batch k+1 uploads while k computes) and yields
  each forward batch's rows as soon as it is done, so that Ray stores them while the next
  batch computes. The rows of one forward batch are views of one array, which Ray 2.60 turns
  into a block without copying it.
A row comes back as its source (`path`, `member`, `key`), `nbytes`, `sha256`, `grid_thw`, the
embeddings (`pooler_output` and/or `last_hidden_state`, [tokens, out_hidden] in `dtype`,
bfloat16 as its uint16 bits), `error` ("" when it encoded; a failed row has no tokens) and
`metadata` (the settings a shard records).

`ShardSink` writes each write task's rows as an output directory of its own, `OUT/part-*`,
appearing whole or not at all (a retried task leaves no half of itself), so several hosts
write into one shared directory without coordinating; the run's failures go to
`OUT/failures.jsonl` as `encode` lists them. `parts(OUT)` lists the parts for
`read_embeddings` and `read_records` (what is done, for a resume). Separate from the rest
because Ray is an optional extra (`pip install -e ".[ray]"`): nothing else imports this module.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import ray
from ray.data.block import BlockAccessor
from ray.data.datasource import Datasink

from ..collection.pipeline import (DEFAULT_OUTPUT, Encoded, Prepared, StreamStats, check_collection_settings,
                                   encode_prepared, prepare, shard_metadata)
from ..collection.shards import DEFAULT_SHARD_SIZE, ShardWriter, write_failures
from ..collection.sources import Source
from ..collection.staging import DEFAULT_DTYPE, DTYPES, make_stager
from ..errors import GlmVitError
from ..processor.preprocess import ProcessorConfig
from ..tower.writer import atomic_directory

PART = "part-"
DEFAULT_BATCH_SIZE = 128  # images an actor call: its last forward batch, partly filled, is one in ~30
DECODE_BATCH_SIZE = 8  # images a decode task: the first canvases reach the actors early
ACTOR_CPUS = 1  # an actor's host thread (the NumPy backend: its BLAS threads)
WRITE_CPUS = 1  # kept free for the write tasks: starved of CPUs, they hold up the whole dataset
_NO_CANVAS = np.zeros((0, 0, 3), np.uint8)  # a failed row's (a tensor column needs an array in every row)


@dataclasses.dataclass(frozen=True)
class _RowBytes(Source):
    """A row's image bytes, named by its path: read from the row, not from a file."""

    data: bytes = b""

    def read(self) -> bytes:
        return self.data


def rows_of(sources: Iterable[Source]) -> list[dict[str, Any]]:
    """Rows for `ray.data.from_items` naming each source (sources.expand_inputs), to be read
    by the decode tasks: the paths must be readable where they run (a shared file system)."""
    return [{"path": s.path, "member": s.member, "offset": s.offset, "size": s.size} for s in sources]


def _member(value: Any) -> str | None:
    return value if isinstance(value, str) else None  # Arrow's nulls come back as None (or NaN)


def _items(batch: dict[str, np.ndarray]) -> list[Source]:
    n = len(next(iter(batch.values())))
    column = {name: batch.get(name, [None] * n) for name in ("path", "member", "offset", "size", "bytes")}
    items: list[Source] = []
    for i in range(n):
        path, member, data = column["path"][i], _member(column["member"][i]), column["bytes"][i]
        if data is not None:
            items.append(_RowBytes(str(path if path is not None else f"row {i}"), member, data=bytes(data)))
        elif path is None:
            raise GlmVitError("a row has neither 'bytes' nor 'path': give the image's bytes or a path to read")
        else:
            offset, size = column["offset"][i], column["size"][i]
            items.append(Source(str(path), member, int(offset or 0), -1 if size is None else int(size)))
    return items


def decode(batch: dict[str, np.ndarray], processor: ProcessorConfig) -> dict[str, Any]:
    """The decode stage (`map_batches(decode, fn_kwargs={"processor": ...})`, CPU tasks): each
    row's image read, decoded and resized into its uint8 canvas by the local pipeline's own
    `prepare`; a row that fails keeps its reason in `error` and an empty canvas."""
    rows: dict[str, list] = {name: [] for name in ("path", "member", "nbytes", "sha256", "canvas", "error")}
    for item in _items(batch):
        prepared = prepare(item, processor)
        rows["path"].append(item.path)
        rows["member"].append(item.member)
        rows["nbytes"].append(prepared.nbytes or 0)
        rows["sha256"].append(prepared.sha256 or "")
        rows["canvas"].append(_NO_CANVAS if prepared.canvas is None else prepared.canvas)
        rows["error"].append(prepared.error or "")
    return rows


class GlmVitEmbedder:
    """The callable class for `Dataset.map_batches` over `decode`'s rows: one engine an actor.

    `model` is anything `GlmVit.from_pretrained` takes, readable on every node; `processor`
    the settings `decode` was given (default: the checkpoint's). `output` ("pooler",
    "last_hidden", "both"), `dtype` (bfloat16, as uint16 bits; float16; float32), `kernels`
    and `max_pixels` are the CLI's options of those names. `gpu_memory_fraction` caps CuPy's
    memory pool (default: the GPU share Ray gave this actor, so actors with num_gpus=0.5 each
    get half). Per-launch checks follow the actor's own GLMVIT_CHECK_LAUNCHES (a cluster's
    workers get it through Ray's runtime_env env_vars, not from the driver's shell). `stats`
    adds up the actor's work (batches, tokens, engine milliseconds) across its calls."""

    def __init__(self, model: str, processor: ProcessorConfig | None = None, *, backend: str = "auto",
                 output: str = DEFAULT_OUTPUT, dtype: str = DEFAULT_DTYPE, max_pixels: int | None = None,
                 kernels: str = "auto", gpu_memory_fraction: float | None = None) -> None:
        from ..model import GlmVit, gpu_available
        from ..outputs import check_output_options

        outputs = check_output_options(output, dtype)
        if backend != "numpy" and gpu_available()[0]:
            import cupy

            share = ray.get_runtime_context().get_assigned_resources().get("GPU", 1.0)
            fraction = share if gpu_memory_fraction is None else gpu_memory_fraction
            cupy.get_default_memory_pool().set_limit(fraction=min(1.0, fraction))  # before the engine allocates
        settings = {} if processor is None else dataclasses.asdict(processor)  # exactly decode's settings
        self.vit = GlmVit.from_pretrained(model, backend=backend, max_pixels=max_pixels, kernels=kernels, **settings)
        self.outputs, self.dtype, self.processor = outputs, dtype, self.vit.processor
        self.stager = make_stager(self.vit, self.processor)
        self.stats = StreamStats()
        self.metadata = json.dumps(shard_metadata(self.vit, outputs, dtype, self.processor), sort_keys=True)
        self.empty = np.zeros((0, self.vit.geometry.out_hidden_size), dtype=DTYPES[dtype][0])

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[dict[str, Any]]:
        prepared = []
        for i in range(len(batch["path"])):
            error = str(batch["error"][i]) or None
            canvas = None if error else batch["canvas"][i]
            prepared.append((Source(str(batch["path"][i]), _member(batch["member"][i])),
                             Prepared(canvas, error, int(batch["nbytes"][i]), str(batch["sha256"][i]) or None)))
        group: list[Encoded] = []
        for result in encode_prepared(self.vit, prepared, outputs=self.outputs, dtype=self.dtype,
                                      processor=self.processor, stats=self.stats, stager=self.stager):
            if result.batch is not None and any(r.batch not in (None, result.batch) for r in group):
                yield self._rows(group)  # a forward batch's rows (and failures among them): one block
                group = []
            group.append(result)
        if group:
            yield self._rows(group)

    def _rows(self, results: list[Encoded]) -> dict[str, Any]:
        """The rows of consecutive results, their embeddings views of one forward batch's arrays
        (a failed row's an empty view of them) so that Ray keeps them as they are."""
        arrays = next((r.arrays for r in results if r.arrays is not None), None)
        empty = {name: self.empty if arrays is None else arrays[name][:0] for name in self.outputs}
        rows: dict[str, Any] = {name: [] for name in ("path", "member", "key", "nbytes", "sha256", *self.outputs,
                                                       "error")}
        for result in results:
            record = result.item.record()
            rows["path"].append(record["path"])
            rows["member"].append(record.get("member"))
            rows["key"].append(record.get("key"))
            rows["nbytes"].append(result.nbytes or 0)
            rows["sha256"].append(result.sha256 or "")
            for name in self.outputs:
                rows[name].append(empty[name] if result.error else result.arrays[name])
            rows["error"].append(result.error or "")
        rows["grid_thw"] = np.stack([np.zeros(3, np.int64) if r.error else r.grid_thw for r in results])
        rows["metadata"] = [self.metadata] * len(results)
        return rows


@dataclasses.dataclass(frozen=True)
class Plan:
    """How `embed` spreads the work over the cluster: `actors` engines of `gpus_per_actor`
    GPUs each on `backend`, and at most `decode_tasks` decode tasks at a time."""

    actors: int
    gpus_per_actor: float
    backend: str
    decode_tasks: int

    def __str__(self) -> str:
        where = f"{self.gpus_per_actor:g} GPU each" if self.gpus_per_actor else "on the CPU"
        return (f"{self.actors} engine actor(s) {where} ({self.backend} backend), {self.decode_tasks} decode "
                f"task(s) at a time")


def cluster_plan(actors: int | None = None, gpus_per_actor: float | None = None, backend: str = "auto",
         decode_tasks: int | None = None) -> Plan:
    """The work's shape on the cluster `ray` is connected to, refused in one line where it
    cannot run there (Ray would wait for ever for the resources). Defaults: one GPU an actor
    where the cluster has GPUs, else CPU actors on the NumPy backend; one actor a GPU (one on a
    cluster without); the CPUs the actors and one write task leave for decoding."""
    resources = ray.cluster_resources()
    gpus, cpus = resources.get("GPU", 0.0), int(resources.get("CPU", 0.0))
    share = (1.0 if gpus >= 1 else 0.0) if gpus_per_actor is None else gpus_per_actor
    if share < 0:
        raise GlmVitError(f"gpus_per_actor {share:g}: expected 0 (CPU actors) or more")
    if actors is None:
        actors = max(1, int(gpus // share)) if share else 1
    if actors < 1:
        raise GlmVitError(f"actors {actors}: expected 1 or more")
    if actors * share > gpus:
        raise GlmVitError(f"the cluster has {gpus:g} GPU(s), and {actors} actor(s) of {share:g} GPU need "
                          f"{actors * share:g}: use fewer actors, or 0 GPUs an actor (CPU actors, NumPy backend)")
    if backend == "auto":
        backend = "cupy" if share else "numpy"
    elif backend == "cupy" and not share:
        raise GlmVitError("backend 'cupy' with 0 GPUs an actor: give the actors a GPU share, or the numpy backend")
    if decode_tasks is not None and decode_tasks < 1:
        raise GlmVitError(f"decode_tasks {decode_tasks}: expected 1 or more")
    if cpus < actors * ACTOR_CPUS + 1:
        raise GlmVitError(f"the cluster has {cpus} CPU(s): {actors} actor(s) take {actors * ACTOR_CPUS}, and decoding "
                          "needs at least one more")
    decode_tasks = decode_tasks or max(1, cpus - actors * ACTOR_CPUS - WRITE_CPUS)
    return Plan(actors, share, backend, decode_tasks)


def embed(ds: ray.data.Dataset, model: str, *, plan: Plan | None = None, batch_size: int = DEFAULT_BATCH_SIZE,
          output: str = DEFAULT_OUTPUT, dtype: str = DEFAULT_DTYPE, kernels: str = "auto",
          max_pixels: int | None = None, min_image_tokens: int | None = None, max_image_tokens: int | None = None,
          embedder: type[GlmVitEmbedder] = GlmVitEmbedder) -> ray.data.Dataset:
    """`ds`'s rows (as `decode` takes them) embedded: `decode` as CPU tasks, then `embedder`
    (GlmVitEmbedder or a subclass) as `plan`'s actors (default: `cluster_plan()`), `batch_size`
    images a call. The settings are checked here, once, in one line each: the processor's
    are read from `model` (readable on the driver too) and given to both stages. (Ray fuses
    the decode tasks into the actors where both hold one CPU and no GPU and are as many: CPU
    actors then decode their own rows.)"""
    from ..hub import resolve_model
    from ..model import KERNELS
    from ..outputs import check_output_options
    from ..processor.preprocess import processor_config
    from ..tower.geometry import load_geometry

    if batch_size < 1:
        raise GlmVitError(f"batch_size {batch_size}: expected 1 or more")
    check_output_options(output, dtype)  # here, in one line, not as a failure inside every actor
    if kernels not in KERNELS:
        raise GlmVitError(f"kernels {kernels!r}: expected one of {', '.join(KERNELS)}")
    directory = resolve_model(model)
    processor, _ = processor_config(directory, min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens)
    check_collection_settings(load_geometry(directory), processor, max_pixels)
    plan = plan or cluster_plan()
    ds = ds.map_batches(decode, fn_kwargs={"processor": processor}, batch_size=DECODE_BATCH_SIZE, num_cpus=1,
                        compute=ray.data.TaskPoolStrategy(size=plan.decode_tasks))
    return ds.map_batches(embedder, fn_constructor_args=(model, processor),
                          fn_constructor_kwargs={"backend": plan.backend, "output": output, "dtype": dtype,
                                                 "kernels": kernels, "max_pixels": max_pixels},
                          compute=ray.data.ActorPoolStrategy(size=plan.actors), batch_size=batch_size,
                          num_cpus=ACTOR_CPUS, num_gpus=plan.gpus_per_actor or None)


class ShardSink(Datasink):
    """`Dataset.write_datasink` target for GlmVitEmbedder's rows: each write task's encoded
    rows become one output directory `out_dir/part-<task>-<random>` of `shard_size`-image
    shards, renamed into place once whole. Once every task is done (on the driver), the
    failed rows go to `out_dir/failures.jsonl` as `encode` writes it, and `written` and
    `failures` hold the run's counts."""

    def __init__(self, out_dir: str | Path, shard_size: int = DEFAULT_SHARD_SIZE) -> None:
        self.out_dir, self.shard_size = Path(out_dir), shard_size
        self.written, self.failures = 0, []

    @property
    def min_rows_per_write(self) -> int:
        return self.shard_size  # a part holds whole shards, not one per batch

    def on_write_start(self, schema: Any = None) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def write(self, blocks: Iterable[Any], ctx: Any) -> tuple[int, list[dict]]:
        """One write task: its encoded rows into a new part (none when every row failed); returns
        (rows written, the failed rows' records with their `error`)."""
        failures: list[dict] = []

        def encoded() -> Iterator[tuple[dict, dict]]:
            for block in blocks:
                batch = BlockAccessor.for_block(block).to_batch_format("numpy")
                for i in range(len(batch["path"])):
                    row = {name: column[i] for name, column in batch.items()}
                    record, member = {"path": str(row["path"])}, _member(row["member"])
                    if member is not None:
                        record.update(member=member, key=row["key"])
                    record["kind"] = Source(record["path"], member).kind  # an image: a video fails here
                    if row["error"]:
                        failures.append({**record, "error": str(row["error"])})
                    else:
                        yield record, row

        rows = encoded()
        first = next(rows, None)
        if first is None:
            return 0, failures
        settings = first[1]["metadata"]
        metadata = json.loads(settings)
        outputs: Sequence[str] = metadata["outputs"].split(",")
        written = 0
        with atomic_directory(self.out_dir / f"{PART}{ctx.task_idx:05d}-{secrets.token_hex(4)}") as tmp:
            writer = ShardWriter(tmp, outputs, metadata["dtype"], first[1][outputs[0]].shape[1], self.shard_size, 0,
                                 metadata)
            try:
                for record, row in itertools.chain([first], rows):
                    if row["metadata"] != settings:
                        raise GlmVitError(f"{row['path']}: embedded with other settings than {first[0]['path']} "
                                          "(another model, output, dtype or processor): not one collection")
                    writer.add({**record, "bytes": int(row["nbytes"]), "sha256": str(row["sha256"])},
                               {name: row[name] for name in outputs}, row["grid_thw"])
                    written += 1
                writer.finish()
                writer.close()
            except BaseException:
                writer.discard()
                raise
        return written, failures

    def on_write_complete(self, write_result: Any) -> None:
        self.written = sum(written for written, _ in write_result.write_returns)
        self.failures = [f for _, failures in write_result.write_returns for f in failures]
        write_failures(self.out_dir, self.failures)


def parts(out_dir: str | Path) -> list[Path]:
    """The finished part directories ShardSink wrote into `out_dir` (from every host), sorted:
    one collection for read_embeddings / read_records."""
    out_dir = Path(out_dir)
    return sorted(p for p in out_dir.iterdir() if p.is_dir() and p.name.startswith(PART)) if out_dir.is_dir() else []
