"""The package as installed and as built: an installed (non-editable) copy must find every
cuda_src/ file the loader pastes together, headers included; the version is written once; no
module imports one that imports it back."""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")
def test_package_data_covers_every_kernel_file():
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["glmvit_cupy.cuda_src"] == "cuda_src"
    patterns = config["package-data"]["glmvit_cupy.cuda_src"]
    files = sorted(p.name for p in (ROOT / "cuda_src").iterdir())
    assert any(f.endswith(".cuh") for f in files) and any(f.endswith(".cu") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pattern) for pattern in patterns)]
    assert not missing, f"not shipped in the wheel: {missing}"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")
def test_the_version_is_written_once():
    """pyproject.toml takes it from glmvit_cupy.__version__, as setuptools reads it when it builds."""
    import tomllib

    from setuptools.config.pyprojecttoml import read_configuration

    import glmvit_cupy

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert read_configuration(ROOT / "pyproject.toml")["project"]["version"] == glmvit_cupy.__version__


def module_imports(path: Path) -> set[str]:
    """The package modules a module imports anywhere in it: at its top level, in `if TYPE_CHECKING:`
    blocks, and inside functions (made when they run, but a circle all the same: the layers are
    read from the imports, wherever they stand)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("glmvit_cupy."):
            found.add(node.module.split(".")[1])
    return found - {path.stem}


def test_the_package_has_no_import_circle():
    graph = {path.stem: module_imports(path) for path in (ROOT / "glmvit_cupy").glob("*.py")}
    assert "weights" in graph["checkpoint"]
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + [module]))
        if module not in done:
            for imported in sorted(graph.get(module, ())):
                visit(imported, path + [module])
            done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_package_docstring_lists_every_module_once():
    """glmvit_cupy/__init__.py's map of modules names each module of the package, and nothing else."""
    import glmvit_cupy

    listed = re.findall(r"^  (\w+) ", glmvit_cupy.__doc__, re.M)
    modules = sorted(path.stem for path in (ROOT / "glmvit_cupy").glob("*.py") if path.stem != "__init__")
    assert sorted(listed) == modules


def test_the_readme_layout_is_the_package_docstrings_map():
    """README.md's Layout shows glmvit_cupy/ as the package docstring's map, line for line, so
    the two cannot disagree."""
    import glmvit_cupy

    doc = glmvit_cupy.__doc__
    docstring_map = doc[doc.index("The model and its checkpoints"):].rstrip("\n")
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    block = re.search(r"```text\n(.*?)\n```", layout, re.S)
    assert block is not None and block.group(1) == docstring_map
