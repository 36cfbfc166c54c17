"""Shared fixtures: the repository root, a runner for the `planner` CLI in-process, and
`bench/cost_accuracy.py` imported as a module."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The engine tests run in their own environment (make test-engines), not in this suite.
collect_ignore = ["engines"]


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `planner ARGS...` through its real entry point; returns exit code, stdout, stderr."""
    from planner.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.delenv("PLANNER_DEBUG", raising=False)

    def run(*args: str, cwd: Path | None = None) -> CliResult:
        old = Path.cwd()
        if cwd is not None:
            os.chdir(cwd)
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = int(e.code or 0)
        finally:
            os.chdir(old)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture()
def bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """`bench/cost_accuracy.py` as a module (its tables and functions), unloaded afterwards."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import cost_accuracy

    yield cost_accuracy
    sys.modules.pop("cost_accuracy", None)
