"""Fixtures of the engine tests (`make test-engines`): they run in `.venv-engines`, where the
engines are installed and the planner is not, and read what `python -m tests.engines.matrix`
wrote (ENGINE_MATRIX, default out/engines)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("ENGINE_MATRIX", "out/engines"))


def exports(target: str) -> list[Path]:
    found = sorted((ROOT / "exports").glob(f"*.{target}*.json"))
    if not found:
        raise RuntimeError(f"no exports to {target} under {ROOT}/exports: run `python -m tests.engines.matrix {ROOT}` "
                           "(make test-engines does)")
    return found


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def plan_of(path: Path) -> dict:
    return json.loads((ROOT / "plans" / f"{path.name.split('.')[0]}.json").read_text())


def words(text: str) -> list[str]:
    """The shell words of an export's command (comments dropped, continuations joined)."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return shlex.split(body.replace("\\\n", " "))


def ids(paths: list[Path]) -> list[str]:
    return [p.name[:-len(".json")] for p in paths]


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):  # noqa: ANN001, ANN202
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def planner(*args: str) -> subprocess.CompletedProcess[str]:
    """The project's `planner` CLI (PLANNER: its path in the project's venv; make test-engines sets it)."""
    exe = os.environ.get("PLANNER")
    if not exe:
        raise RuntimeError("PLANNER is not set: run the engine tests with make test-engines")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600)


class DataParallelWorld:
    """An mpu as DeepSpeed reads it: the data-parallel world of a job that is not running here."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


@pytest.fixture(scope="session")
def deepspeed_process_group():  # noqa: ANN201
    """DeepSpeedConfig reads the rank from a process group: one gloo process of world size 1."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("ENGINE_TEST_PORT", "29561"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed.comm as dist

    if not dist.is_initialized():
        dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    return dist


def planner_table(name: str) -> dict:
    """A table of `planner.imports` (the engine defaults the importer assumes), read through the
    project's own Python (the one beside PLANNER)."""
    import json

    exe = os.environ.get("PLANNER")
    if not exe:
        raise RuntimeError("PLANNER is not set: run the engine tests with make test-engines")
    code = f"import json; from planner import imports; print(json.dumps(imports.{name}))"
    out = subprocess.run([str(Path(exe).with_name("python")), "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
