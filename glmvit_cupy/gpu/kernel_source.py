"""The CUDA sources as text: where they are, with our headers pasted in, and the constants
they declare. CuPy-free, so the CPU tests can read what the GPU side compiles.

Kept apart from `kernels.py` (which compiles and launches, and needs CuPy) because the host
code sizes launches from numbers the kernels hard-code (tile widths, shared-memory stages):
`constants` reads those numbers out of the source so the host can compare its own against
them at load, and a CPU test can do the same.
"""

from __future__ import annotations

import re
from pathlib import Path

_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"$', re.M)
_REQUIRES = re.compile(r"^// requires: (sm_\w+)$", re.M)
_CONSTEXPR = re.compile(r"^\s*constexpr int ([^;]+);", re.M)
_LITERAL = re.compile(r"^(\w+) = (\d+)$")


def cuda_source_dir() -> Path:
    """The installed package data (glmvit_cupy/cuda_src/), else the repository's top-level cuda_src/."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "cuda_src", package.parent / "cuda_src"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"cuda_src/ not found beside {package}: the package is installed without its kernels")


def load_source(path: Path, pasted: set[str] | None = None) -> str:
    """The file's text with our headers pasted in (each once), under #line directives."""
    pasted = set() if pasted is None else pasted
    text = path.read_text()

    def paste(match: re.Match) -> str:
        name = match.group(1)
        if name in pasted:
            return ""
        pasted.add(name)
        return f"{load_source(path.parent / name, pasted)}\n#line {text.count(chr(10), 0, match.end()) + 1} \"{path}\""

    return f'#line 1 "{path}"\n' + _INCLUDE.sub(paste, text)


def required_arch(source: str) -> str | None:
    """The target a source demands (`// requires: sm_90a`), or None for the device's own."""
    found = _REQUIRES.search(source)
    return found.group(1) if found else None


def constants(text: str) -> dict[str, int]:
    """Every `constexpr int NAME = <integer literal>` at the start of a line (one or several a
    declaration); those defined by an expression are left out, a later one wins."""
    found: dict[str, int] = {}
    for declaration in _CONSTEXPR.findall(text):
        for part in declaration.split(","):
            literal = _LITERAL.match(part.strip())
            if literal:
                found[literal.group(1)] = int(literal.group(2))
    return found
