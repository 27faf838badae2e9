"""The package as installed and as built: an installed (non-editable) copy must find every
cuda_src/ file the loader pastes together, and every folder; the version is written once; the
package docstring's map names every module in its folder and orders the layers; no import points
up them, and no module imports one that imports it back."""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "glmvit_cupy"


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
def test_the_wheel_ships_every_folder():
    """pyproject.toml names each folder of the package: setuptools leaves one it is not told of out
    of the wheel, and an installed copy then fails on import, where a checkout does not."""
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = [f"glmvit_cupy.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py")]
    assert sorted(packages) == sorted(["glmvit_cupy", "glmvit_cupy.cuda_src", *folders])


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is 3.11+")
def test_the_version_is_written_once():
    """pyproject.toml takes it from glmvit_cupy.__version__, as setuptools reads it when it builds."""
    import tomllib

    from setuptools.config.pyprojecttoml import read_configuration

    import glmvit_cupy

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert read_configuration(ROOT / "pyproject.toml")["project"]["version"] == glmvit_cupy.__version__


def module_name(path: Path) -> str:
    """A file's name inside the package: "tower.checkpoint"; a folder's __init__.py is the folder
    ("tower"); the package's own is "__init__"."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def module_imports(path: Path) -> set[str]:
    """The package modules a module imports anywhere in it: at its top level, in `if TYPE_CHECKING:`
    blocks, and inside functions (made when they run, but a circle all the same: the layers are
    read from the imports, wherever they stand). A name that is no module (`from .. import
    __version__`) is an import of the package or folder that holds it."""
    name = module_name(path)
    folder = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    folder = [] if folder == ["__init__"] else folder
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = folder[:len(folder) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "glmvit_cupy":
            base, names = node.module.split(".")[1:], [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            base, names = [], [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("glmvit_cupy.")]
        else:
            continue
        for imported in names:
            module = ".".join(base + [imported])
            holder = module if module in MODULES else ".".join(base) or "__init__"
            # A stale path is no edge to skip: Python finds no such module, or (beside an editable
            # install of another checkout) imports that checkout's copy.
            where = "glmvit_cupy" + ("" if holder == "__init__" else f".{holder}")
            assert holder == module or imported in defined_names(MODULES.get(holder)), \
                f"glmvit_cupy/{path.relative_to(PACKAGE)} imports {imported} from {where}: no such module or name"
            found.add(holder)
    return found - {name}


@functools.lru_cache(maxsize=None)
def defined_names(path: Path | None) -> set[str]:
    """The names a module binds outside its functions and classes (what `from it import` finds)."""
    if path is None:
        return set()
    names, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        else:
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return names


def test_the_package_has_no_import_circle():
    graph = {name: module_imports(path) for name, path in MODULES.items()}
    assert {"tower.weights", "tower.geometry"} <= graph["tower.checkpoint"] and "__init__" in graph["deploy.serve"]
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


def package_map() -> list[tuple[str, str, str]]:
    """The package docstring's map as (module, the folder it stands in or "", its line's text), in
    its order; a folder's own line is (folder, "", text)."""
    import glmvit_cupy

    doc = glmvit_cupy.__doc__
    entries, folder = [], None
    for indent, name, text in re.findall(r"^( {2}| {4})(\w+/?) +(.*)$", doc[doc.index("glmvit_cupy/\n"):], re.M):
        if len(indent) == 2:
            folder = name[:-1] if name.endswith("/") else None
            entries.append((folder or name, "", text))
        else:
            assert folder is not None, f"{name} is indented under {entries[-1][0]}, which is no folder"
            entries.append((f"{folder}.{name}", folder, text))
    return entries


def test_the_package_map_lists_every_module_once():
    """glmvit_cupy/__init__.py's map names each module and folder of the package, in its folder,
    and nothing else."""
    listed = [module for module, _, _ in package_map()]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(set(MODULES) - {"__init__"})


def test_each_folder_says_in_the_map_what_its_docstring_says():
    """A folder's line in the map is the first line of its __init__.py's docstring (its period
    dropped), so the map cannot tell a folder's purpose otherwise than the folder does."""
    folders = [(module, text) for module, folder, text in package_map() if MODULES[module].name == "__init__.py"]
    assert folders
    for folder, text in folders:
        docstring = ast.get_docstring(ast.parse(MODULES[folder].read_text()))
        assert docstring is not None, f"glmvit_cupy/{folder}/__init__.py opens with no docstring"
        assert docstring.split("\n")[0] == text + ".", f"glmvit_cupy/{folder}/: the map says {text!r}"


def test_the_imports_point_down_the_layers():
    """The map's order is the layers', from the ground up: a root module or a folder imports only what
    stands above it in the map, a module in a folder also its folder's other modules; the package's
    face (__init__.py) stands with the highest of the names it hands on. Function-level imports
    count: a layer that imports up only where a function runs still knows what stands above it."""
    rank, folder_of = {}, {}
    for position, (module, folder, _) in enumerate(package_map()):
        rank[module] = rank[folder] if folder else position
        folder_of[module] = folder
    unplaced = sorted(set(MODULES) - set(rank) - {"__init__"})
    assert not unplaced, f"not in the package docstring's map, so on no layer: {unplaced}"
    imports = {name: module_imports(path) for name, path in MODULES.items()}
    rank["__init__"] = max(rank[module] for module in imports["__init__"])
    wrong = [f"glmvit_cupy/{MODULES[module].relative_to(PACKAGE)} imports glmvit_cupy.{imported}"
             for module, imported_set in sorted(imports.items()) if module != "__init__"
             for imported in sorted(imported_set)
             if not (rank[imported] < rank[module]
                     or folder_of[module] and folder_of[module] == folder_of.get(imported))]
    assert not wrong, "imports up the layers of the package docstring's map: " + "; ".join(wrong)


def test_the_readme_layout_is_the_package_docstrings_map():
    """README.md's Layout shows glmvit_cupy/ as the package docstring's map, line for line, so
    the two cannot disagree."""
    import glmvit_cupy

    doc = glmvit_cupy.__doc__
    docstring_map = doc[doc.index("glmvit_cupy/\n"):].rstrip("\n")
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout"):]
    block = re.search(r"```text\n(.*?)\n```", layout, re.S)
    assert block is not None and block.group(1) == docstring_map
