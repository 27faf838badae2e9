"""The package's checks survive `python -O`: none of them is an `assert` statement (which -O
strips), so a guard of memory or input cannot vanish in an optimised run."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_assert_statements_in_the_package():
    found = []
    for path in sorted([*(ROOT / "glmvit_cupy").rglob("*.py"), ROOT / "cli.py"]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"assert statements (stripped by python -O; raise instead): {', '.join(found)}"
