"""`python -m runtime`: a PPO plan on 4 gloo ranks against `--reference`, and launch errors.

The plan is `examples/tiny_ppo.py`'s graph placed by hand (the compiler's `compile` is not
needed): actor, critic and reference on different meshes and layouts, so call outputs move
between layouts every step.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from plans import Estimate, Layout, Mesh, Plan, PlanCall, Reallocation, SearchInfo, parse_cluster, save_plan

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
LAYOUTS = {
    "actor": (Mesh.block(0, 4), Layout(dp=2, tp=2, zero=1)),
    "critic": (Mesh.block(0, 4), Layout(dp=2, pp=2, micro_batches=2, zero=2)),
    "ref": (Mesh.block(0, 2), Layout(tp=2, sequence_parallel=True)),
}


def tiny_ppo_plan(layouts: dict[str, tuple[Mesh, Layout]], *, per_call: dict[str, Layout] | None = None) -> Plan:
    """The tiny PPO example's graph with each model on the given (mesh, layout)."""
    graph = runpy.run_path(str(ROOT / "examples" / "tiny_ppo.py"))["graph"]
    calls = []
    for c in graph.calls:
        mesh, layout = layouts[c.model]
        layout = (per_call or {}).get(c.name, layout)
        calls.append(PlanCall(**c.model_dump(), mesh=mesh, layout=layout, est_start_s=0, est_time_s=0,
                              est_peak_mem_bytes=0))
    return Plan(name=graph.name, cluster=parse_cluster("cpu:1x4"), models=graph.models, inputs=graph.inputs,
                algorithm=graph.algorithm, calls=calls, search=SearchInfo(method="test"),
                estimate=Estimate(iteration_s=0, tokens_per_s=0, mfu=0, peak_mem_bytes=0))


def _run(args: list[str], *, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def _torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    return _run(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "runtime", *args])


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_ppo_on_four_ranks_matches_the_reference_step_by_step(tmp_path: Path) -> None:
    plan_path = tmp_path / "tiny_ppo.json"
    save_plan(tiny_ppo_plan(LAYOUTS), plan_path)
    par = _torchrun(4, str(plan_path), "--steps", "2", "--seed", "5", "--metrics-out", str(tmp_path / "par.jsonl"))
    assert par.returncode == 0, par.stderr[-3000:]
    ref = _run(["-m", "runtime", str(plan_path), "--reference", "--steps", "2", "--seed", "5",
                "--metrics-out", str(tmp_path / "ref.jsonl")])
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = _metrics(tmp_path / "par.jsonl"), _metrics(tmp_path / "ref.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want] == [1, 2]
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in ("actor_train.loss", "critic_train.loss", "reward_mean", "kl_mean", "actor_train.clip_frac",
                    "time_s", "actor_generate.time_s"):
            assert key in g
        for key, value in w.items():
            if not key.endswith("time_s"):
                assert abs(g[key] - value) <= TOL, (g["step"], key, g[key], value)
    assert 0.0 < want[0]["reward_mean"] < 1.0
    assert got[1]["kl_mean"] != 0.0  # the actor moved away from the reference after one step


@pytest.mark.slow
def test_world_size_mismatch_is_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    plan_path = tmp_path / "tiny_ppo.json"
    save_plan(tiny_ppo_plan(LAYOUTS), plan_path)
    out = _torchrun(2, str(plan_path))
    assert out.returncode != 0
    for rank in (0, 1):
        assert f"error (rank {rank}): plan" in out.stderr and "is for 4 ranks" in out.stderr
    assert str(ROOT / "runtime") not in out.stderr  # torchrun reports the failed children; our code no traceback
    single = _run(["-m", "runtime", str(plan_path)])
    assert single.returncode == 2
    assert "is for 4 ranks (cpu:1x4) but this launch has 1" in single.stderr and "--nproc-per-node 4" in single.stderr
    assert "Traceback" not in single.stderr


def test_plans_that_reallocate_are_refused(tmp_path: Path) -> None:
    moved = tiny_ppo_plan(LAYOUTS, per_call={"actor_train": Layout(dp=4)})
    save_plan(moved, tmp_path / "moved.json")
    out = _run(["-m", "runtime", str(tmp_path / "moved.json"), "--reference"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "model 'actor' runs call 'actor_generate'" in out.stderr and "cannot reallocate" in out.stderr
    assert "--baseline colocate" in out.stderr
    listed = tiny_ppo_plan(LAYOUTS).model_copy(update={"reallocations": [
        Reallocation(model="actor", from_call="actor_generate", to_call="actor_train", bytes=0, est_time_s=0)]})
    save_plan(listed, tmp_path / "listed.json")
    out = _run(["-m", "runtime", str(tmp_path / "listed.json"), "--reference"])
    assert out.returncode == 2 and "reallocates 'actor'" in out.stderr


def test_bad_plan_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    out = _run(["-m", "runtime", str(tmp_path / "bad.json"), "--reference"])
    assert out.returncode == 2 and "is not valid JSON" in out.stderr and "Traceback" not in out.stderr
