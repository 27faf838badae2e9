"""`extract`: the tower out of any checkpoint we bind, as a vision-only checkpoint that
transformers (`Glm5NextVisionModel.from_pretrained`) and glmvit-cupy both load.

Its own module because it is the one path that turns a checkpoint into another: binding reads
only the tower (`locate_tower`, then `read_tower`: headers and the tower's byte ranges, never
the text stack's hundreds of GB), and the result is what `save_pretrained` of the vision model
writes: config.json (model_type glm5_next_vision, the geometry spelled out), model.safetensors
(the bare names, the source's on-disk shapes and BF16 bits, unchanged), and the source's
preprocessor_config.json when it has one. The destination appears whole or not at all
(`writer.atomic_directory`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from .bf16 import bf16_array
from .errors import GlmVitError
from .hub import resolve_model
from .processor.preprocess import PREPROCESSOR_FILE
from .tower.checkpoint import SINGLE_FILE, TowerLocation, locate_tower, read_tower
from .tower.geometry import CONFIG_FILE, vision_config
from .tower.writer import atomic_directory, write_safetensors


@dataclasses.dataclass(frozen=True)
class Extracted:
    source: Path  # the directory read (a cache snapshot for a repo id)
    destination: Path
    location: TowerLocation
    bytes_read: int
    files: list[str]


def extract_tower(source: str | os.PathLike, destination: str | os.PathLike) -> Extracted:
    """Write the tower of `source` (a directory or a cached repo id) into the new directory
    `destination`."""
    src = resolve_model(source)
    dst = Path(destination)
    if dst.exists() or dst.is_symlink():  # before reading a GiB, not only at the rename
        raise GlmVitError(f"{dst}: exists; refusing to write over it")
    location = locate_tower(src)
    weights = read_tower(location)
    config = {"architectures": ["Glm5NextVisionModel"], **vision_config(location.geometry), "dtype": "bfloat16"}
    files = [CONFIG_FILE, SINGLE_FILE]
    with atomic_directory(dst) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        write_safetensors(tmp / SINGLE_FILE, {
            short: bf16_array(weights.raw(short)).reshape(entry.stored_shape)
            for short, entry in location.entries.items()})
        processor = src / PREPROCESSOR_FILE
        if processor.is_file():
            try:
                content = processor.read_bytes()
            except OSError as exc:
                raise GlmVitError(f"{processor}: cannot read: {exc.strerror}") from None
            (tmp / PREPROCESSOR_FILE).write_bytes(content)
            files.append(PREPROCESSOR_FILE)
    return Extracted(src, dst, location, weights.bytes_read, files)
