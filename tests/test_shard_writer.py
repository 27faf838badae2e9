"""The shard writer's reserved inputs (reserve, write_rows, complete, abandon): rows written in any
order, across inputs and within one, make byte for byte the shards that adding the completed inputs
in order makes; inputs that fail or never complete leave nothing, whatever was written after them."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from glmvit_cupy.collection.shards import FORMAT, ShardWriter

WIDTH = 8
OUTPUTS = ["pooler_output", "last_hidden_state"]  # the second in a side file until sealing


def _writer(directory: Path, shard_size: int) -> ShardWriter:
    directory.mkdir()
    return ShardWriter(directory, OUTPUTS, "float32", WIDTH, shard_size, 0, {"format": FORMAT})


def _input(i: int, rows: int) -> dict[str, np.ndarray]:
    return {name: np.arange(rows * WIDTH, dtype=np.float32).reshape(rows, WIDTH) + 1000 * i + 0.5 * k
            for k, name in enumerate(OUTPUTS)}


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _in_any_order(writer: ShardWriter, inputs: list, rng: random.Random, stop_after: int | None) -> None:
    """Reserve the inputs in order, at most four unresolved at a time, write each one's rows in
    pieces in a random order among all reserved inputs' pieces, resolve (complete, or abandon a
    failing one, some of whose pieces may be written) in order; `stop_after`: finish (as a stopped
    run does) once that many inputs are resolved."""
    reserved, pieces, resolved, nxt = [], [], 0, 0
    while resolved < len(inputs):
        if stop_after is not None and resolved == stop_after:
            break
        choices = []
        if nxt < len(inputs) and len(reserved) < 4:
            choices.append("reserve")
        if pieces:
            choices.append("write")
        head = reserved[0] if reserved else None
        if head is not None and (inputs[head[0]][2] or not any(p[0] is head[1] for p in pieces)):
            choices.append("resolve")
        what = rng.choice(choices)
        if what == "reserve":
            rows, arrays, _ = inputs[nxt]
            handle = writer.reserve(rows)
            cuts = sorted(rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 3)))) if rows > 1 else []
            for a, b in zip([0] + cuts, cuts + [rows]):
                pieces.append((handle, a, {name: arr[a:b] for name, arr in arrays.items()}))
            reserved.append((nxt, handle))
            nxt += 1
        elif what == "write":
            handle, first, arrays = pieces.pop(rng.randrange(len(pieces)))
            writer.write_rows(handle, first, arrays)
        else:
            i, handle = reserved.pop(0)
            if inputs[i][2]:  # it fails: its pieces not yet written never are
                pieces = [p for p in pieces if p[0] is not handle]
                writer.abandon(handle)
            else:
                writer.complete(handle, {"path": f"in-{i}"}, (1, inputs[i][0], 1))
            resolved += 1
    writer.finish()
    writer.close()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shard_size", [1, 3, 100])
@pytest.mark.parametrize("stopped", [False, True])
def test_reserved_inputs_in_any_order_make_the_shards_of_adds_in_order(tmp_path, seed, shard_size, stopped):
    rng = random.Random(seed)
    inputs = []
    for i in range(14):
        rows = rng.randint(1, 40)
        inputs.append((rows, _input(i, rows), rng.random() < 0.3))
    stop_after = rng.randint(1, len(inputs) - 1) if stopped else None
    ours = _writer(tmp_path / "ours", shard_size)
    _in_any_order(ours, inputs, rng, stop_after)
    want = _writer(tmp_path / "want", shard_size)
    for i, (rows, arrays, fails) in enumerate(inputs[:stop_after]):
        if not fails:
            want.add({"path": f"in-{i}"}, arrays, (1, rows, 1))
    want.finish()
    want.close()
    assert _files(tmp_path / "ours") == _files(tmp_path / "want")


def test_an_input_out_of_order_is_refused(tmp_path):
    writer = _writer(tmp_path / "out", 10)
    first, second = writer.reserve(2), writer.reserve(3)
    writer.write_rows(second, 0, _input(1, 3))
    with pytest.raises(Exception, match="out of input order"):
        writer.complete(second, {"path": "b"}, (1, 3, 1))
    with pytest.raises(Exception, match="rows 1-3 of an input reserved 2 rows"):
        writer.write_rows(first, 1, _input(0, 2))
    writer.discard()
