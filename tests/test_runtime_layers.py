"""runtime/ imports only plans/ (and torch): never planner/, cost_models/ or ortools."""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[1] / "runtime"
FORBIDDEN = ("planner", "cost_models", "ortools")


def test_runtime_never_imports_the_compiler_side() -> None:
    offenders = []
    files = sorted(RUNTIME.glob("*.py"))
    assert len(files) > 5
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders
