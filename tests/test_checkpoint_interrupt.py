"""An interrupt (Ctrl-C, SIGTERM) at any point of a checkpoint save leaves no ``.tmp`` directory.

The process-level test (`tests/test_runtime_process.py`) sends SIGINT at a random moment of a
4-rank run; this one places the interrupt at each point of a save in turn, deterministically, on
the real runner and the real save: while rank 0 prepares the directory (after it is created),
while the shard file is written, and while the manifest is written.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

import runtime.checkpoint as ckpt
from plans.checkpoint import latest_complete
from plans.plan import load_plan
from runtime.executor import PlanRunner
from runtime.process import Interrupted
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def runner() -> PlanRunner:
    plan = load_plan(ROOT / "plans" / "tiny_ppo.json")
    r = PlanRunner(plan, rank=0, world_size=1, reference=True, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    r.step(1)
    return r


def _interrupt_after(real):
    def wrapped(*args, **kwargs):
        real(*args, **kwargs)
        raise Interrupted(signal.SIGINT)
    return wrapped


@pytest.mark.parametrize("where", ["_prepare", "shard file", "manifest"])
def test_an_interrupt_anywhere_in_a_save_leaves_no_partial_directory(runner: PlanRunner, where: str, tmp_path: Path,
                                                                      monkeypatch) -> None:
    root = tmp_path / "ckpt"
    ckpt.save_checkpoint(runner, root, step=1)  # a complete one before: it must survive
    if where == "_prepare":
        monkeypatch.setattr(ckpt, "_prepare", _interrupt_after(ckpt._prepare))
    else:
        real = ckpt.write_new_file

        def write(path, data, **kwargs):
            real(path, data, **kwargs)
            if (path.name == ckpt.MANIFEST_NAME) == (where == "manifest"):
                raise Interrupted(signal.SIGINT)
        monkeypatch.setattr(ckpt, "write_new_file", write)
    with pytest.raises(Interrupted):
        ckpt.save_checkpoint(runner, root, step=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-000000001"]
    assert latest_complete(root)[0] == root / "step-000000001"  # type: ignore[index]
