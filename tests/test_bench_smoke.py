"""Every benchmark script runs to the end in a tiny mode, so a broken bench is a red check (the
figures they print are for `make bench`; here only that they run and print what they promise).
The runs are marked `bench`: `make bench-smoke` runs them (CI does, after `make test`), `make test`
leaves them out to stay under 15 minutes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

BENCH = ROOT / "bench"
SMOKE = {
    "cost_accuracy.py": ([], "MAPE"),
    "cost_speed.py": ([], "uncached ms/call"),
    "long_context.py": (["--smoke"], "equal to the reference"),
    "predict_vs_measure.py": (["--repeats", "1", "--steps", "2", "--calibration",
                               str(ROOT / "cost_models" / "data" / "cpu.json")], "predicted"),
    "real_job.py": (["--steps", "2"], "transformers reloads the trained actor"),
    "realloc.py": (["--repeats", "1", "--cases", "1"], "moved/min"),
    "rlhf_calls.py": ([], "published"),
    "rlhf_learning.py": (["--steps", "2", "--no-spread", str(ROOT / "plans" / "tiny_ppo.json")], "tiny_ppo"),
    "runtime.py": (["--steps", "1", "--batch", "2", "--seq", "16", "--gen-batch", "2", "--prompt", "4",
                    "--gen-len", "4"], "generation"),
    "runtime_vs_peers.py": (["--quick"], "ops per decode step"),
    "gpu_check.py": (["--device", "cpu", "--quick", "--repeats", "1", "--out", "report.json"],
                     "ratios runtime/transformers"),
    "kernel_check.py": (["--device", "cpu", "--quick", "--repeats", "1", "--out", "report.json"],
                        "measured / predicted by kind"),
    "seesaw.py": (["--smoke"], "split decode wins"),
    "search.py": (["--only", "grpo-qwen7b", "--time-limit", "1", "--node-ranges"], "node ranges"),
    "zero_memory.py": (["--only", "dp4 z1", "--only", "cp2 z1"], "within 10% of the allocator's peak: 2 of 2"),
}


def test_every_bench_script_has_a_smoke_run() -> None:
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(SMOKE)


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_bench_runs_to_the_end(script: str, tmp_path: Path) -> None:
    args, expect = SMOKE[script]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert expect in out.stdout, out.stdout[-3000:]


def test_the_hand_placed_plans_of_the_learning_bench_are_runnable() -> None:
    import runpy

    from plans.plan import load_plan
    from plans.runnable import runtime_problems

    bench = runpy.run_path(str(BENCH / "rlhf_learning.py"), run_name="bench")
    for name in ("tiny_ppo", "tiny_grpo"):
        plan = bench["spread_plan"](load_plan(ROOT / "plans" / f"{name}.json"), name)
        assert runtime_problems(plan) == [], name
