"""`python -m runtime`: the compiled tiny examples on 4 gloo ranks against `--reference`, and errors.

`examples/tiny_ppo.py` and `examples/tiny_grpo.py` are compiled here (as `planner compile` does)
and run for a few steps under torchrun: the PPO plan spreads its calls over several meshes and
reallocates parameters from a training layout to a generation or inference one every step (the
GRPO plan may keep one layout: on the profiled `cpu` preset its calls all run best on dp4), the
metrics must equal the single-process reference step by step, and the reward must rise. Launch and plan
errors use plans placed by hand.
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
from plans.plan import load_plan

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
STEPS = {"tiny_ppo": 15, "tiny_grpo": 12}  # enough for the reward to rise; `bench/rlhf_learning.py` runs 30
EXAMPLES = list(STEPS)
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


def _run(args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """`python ARGS` in the repository, with `env` on top of this environment less launch and
    fault-injection variables."""
    dropped = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RUNTIME_TEST_KILL_AT", "RUNTIME_TEST_HANG_AT")
    base = {k: v for k, v in os.environ.items() if k not in dropped}
    base["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout_s)


def _torchrun(n: int, *args: str, restarts: int = 0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _run(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", f"--max-restarts={restarts}",
                 "-m", "runtime", *args], env=env)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, Path]:
    """The tiny examples compiled now (what `planner compile examples/NAME.py` writes)."""
    from planner.compile import compile_graph
    from plans import parse_cluster as cluster_of

    out = tmp_path_factory.mktemp("compiled")
    paths = {}
    for name in EXAMPLES:
        example = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
        plan = compile_graph(example["graph"], cluster_of(example["CLUSTER"]), time_limit_s=2)
        paths[name] = out / f"{name}.json"
        save_plan(plan, paths[name])
    return paths


def test_tiny_examples_compile_to_plans_whose_reallocations_move_something(compiled: dict[str, Path]) -> None:
    # Whether a plan reallocates is the search's choice (on 4 ranks sharing 2 cores, a move's host
    # work usually outweighs it); every move it lists changes the placement and moves bytes.
    for path in compiled.values():
        plan = load_plan(path)
        for r in plan.reallocations:
            src, dst = plan.call(r.from_call), plan.call(r.to_call)
            assert (src.mesh, src.layout) != (dst.mesh, dst.layout) and r.bytes > 0
    ppo = load_plan(compiled["tiny_ppo"])
    assert len({c.mesh for c in ppo.calls}) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("name", EXAMPLES)
def test_tiny_example_on_four_ranks_matches_the_reference_and_learns(compiled: dict[str, Path], tmp_path: Path,
                                                                     name: str) -> None:
    plan_path, steps = compiled[name], STEPS[name]
    par = _torchrun(4, str(plan_path), "--steps", str(steps), "--metrics-out", str(tmp_path / "par.jsonl"))
    assert par.returncode == 0, par.stderr[-3000:]
    ref = _run(["-m", "runtime", str(plan_path), "--reference", "--steps", str(steps),
                "--metrics-out", str(tmp_path / "ref.jsonl")])
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = _metrics(tmp_path / "par.jsonl"), _metrics(tmp_path / "ref.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, steps + 1))
    moved = {r.to_call for r in load_plan(plan_path).reallocations}
    for g, w in zip(got, want):
        assert set(g) == set(w)
        assert {"actor_train.loss", "reward_mean", "time_s", "actor_generate.time_s"} <= set(g)
        assert {f"{c}.realloc_time_s" for c in moved} <= set(g)
        for key, value in w.items():
            if not key.endswith("time_s"):
                assert abs(g[key] - value) <= TOL, (g["step"], key, g[key], value)
    reward = [m["reward_mean"] for m in want]
    first, last = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert first < 0.35 and last > first + 0.1, reward  # random is 0.25; the policy learns the pattern


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


def test_plans_whose_reallocations_do_not_match_their_placements_are_refused(tmp_path: Path) -> None:
    moved = tiny_ppo_plan(LAYOUTS, per_call={"actor_generate": Layout(dp=4)})  # other slices, no move listed
    save_plan(moved, tmp_path / "moved.json")
    out = _run(["-m", "runtime", str(tmp_path / "moved.json"), "--reference"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "call 'actor_generate' runs 'actor' on [0-3] dp4 tp1 pp1, which does not hold the slices of its home " \
           "'actor_train'" in out.stderr and "lists no reallocation" in out.stderr
    listed = tiny_ppo_plan(LAYOUTS).model_copy(update={"reallocations": [
        Reallocation(model="actor", from_call="actor_generate", to_call="actor_train", bytes=0, est_time_s=0)]})
    save_plan(listed, tmp_path / "listed.json")
    out = _run(["-m", "runtime", str(tmp_path / "listed.json"), "--reference"])
    assert out.returncode == 2 and "reallocates 'actor' from 'actor_generate'" in out.stderr
    assert "home call 'actor_train'" in out.stderr


def test_bad_plan_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    out = _run(["-m", "runtime", str(tmp_path / "bad.json"), "--reference"])
    assert out.returncode == 2 and "is not valid JSON" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_plan_of_another_schema_version_is_refused_on_every_rank(tmp_path: Path) -> None:
    data = json.loads((ROOT / "plans" / "tiny_ppo.json").read_text())
    data["version"] = 99
    (tmp_path / "v99.json").write_text(json.dumps(data))
    out = _torchrun(4, str(tmp_path / "v99.json"))
    assert out.returncode != 0
    for rank in range(4):
        assert f"error (rank {rank}): {tmp_path / 'v99.json'} has plan version 99; this planner reads version 1" \
            in out.stderr
    assert str(ROOT / "runtime") not in out.stderr


def test_a_plan_costed_for_another_stack_runs_with_a_note_saying_so(tmp_path: Path) -> None:
    plan = tiny_ppo_plan(LAYOUTS)
    other = plan.model_copy(update={"estimate": plan.estimate.model_copy(update={"framework": "rlhf-engine-hf"})})
    save_plan(other, tmp_path / "other.json")
    out = _run(["-m", "runtime", str(tmp_path / "other.json"), "--reference", "--steps", "1"])
    assert out.returncode == 0, out.stderr
    assert "was costed for framework rlhf-engine-hf, another stack" in out.stdout
    save_plan(plan, tmp_path / "own.json")
    own = _run(["-m", "runtime", str(tmp_path / "own.json"), "--reference", "--steps", "1"])
    assert own.returncode == 0 and "costed for framework" not in own.stdout
