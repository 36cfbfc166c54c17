"""`python -m runtime --trace-out`: the measured timeline, and the progress lines on rank 0.

The tiny PPO example is placed by hand on `cpu:1x4` (calls on several meshes, a model
reallocated every step) and run for a few steps on 4 gloo ranks: the trace must be a
planner trace (`plans.trace.load_trace`) with exactly one span per call, step and rank of the
call's mesh, one per reallocation, step and rank taking part in it, all on one time axis; and
`planner timeline PLAN --measured TRACE` must render it next to the prediction.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from plans.plan import load_plan, save_plan
from plans.trace import load_trace, spans
from runtime.dataflow import leader

ROOT = Path(__file__).resolve().parents[1]
STEPS = 3


def _run(args: list[str], *, timeout_s: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    """The tiny PPO example placed by hand so that a model moves every step (the search, costing
    the reallocation's host work on shared cores, now keeps the actor's generation on its home)."""
    from planner.pinned import pinned_plan
    from plans import Layout, Mesh, parse_cluster

    example = runpy.run_path(str(ROOT / "examples" / "tiny_ppo.py"))
    two, other, four = Mesh.block(0, 2), Mesh.block(2, 2), Mesh.block(0, 4)
    places = {"actor_generate": (four, Layout(dp=4), None), "ref_inference": (two, Layout(dp=2), None),
              "critic_inference": (other, Layout(dp=2), None), "actor_train": (two, Layout(dp=2, zero=3), None),
              "critic_train": (other, Layout(dp=2, zero=2), None)}
    path = tmp_path_factory.mktemp("plan") / "tiny_ppo.json"
    save_plan(pinned_plan(example["graph"], parse_cluster(example["CLUSTER"]), places, method="placed by hand"), path)
    return path


@pytest.mark.slow
def test_four_rank_run_writes_a_trace_the_timeline_renders(plan_path: Path, tmp_path: Path, cli) -> None:
    trace_path, metrics_path = tmp_path / "run.trace.json", tmp_path / "m.jsonl"
    out = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "runtime", str(plan_path),
                "--steps", str(STEPS), "--trace-out", str(trace_path), "--metrics-out", str(metrics_path)])
    assert out.returncode == 0, out.stderr[-3000:]
    plan = load_plan(plan_path)
    assert plan.reallocations, "the compiled example moves no parameters: the test would not cover reallocations"

    # Progress: one line per step from rank 0 only, with every call's time.
    progress = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == [f"{s}/{STEPS}" for s in range(1, STEPS + 1)]
    for line in progress:
        assert all(f"{c.name} " in line for c in plan.calls) and "ms" in line

    doc = load_trace(trace_path)
    assert doc["otherData"]["world_size"] == 4 and doc["otherData"]["plan"] == plan.name
    items = spans(doc)
    calls = Counter((s.step, s.call, s.rank) for s in items if s.cat == "call")
    want = Counter((step, c.name, r) for step in range(1, STEPS + 1) for c in plan.calls for r in c.mesh.ranks)
    assert calls == want
    for r in plan.reallocations:
        src, dst = plan.call(r.from_call).mesh.ranks, plan.call(r.to_call).mesh.ranks
        moved = [s for s in items if s.cat == "realloc" and s.call == r.to_call]
        assert {s.step for s in moved} == set(range(1, STEPS + 1))
        assert {s.rank for s in moved} <= set(src) | set(dst) and set(dst) <= {s.rank for s in moved}
        assert all(s.from_call == r.from_call and s.model == r.model for s in moved)

    # One time axis: on each rank, spans follow each other (a rank runs one thing at a time) and
    # steps come in order; a call's span on its leader is the call's time in the metrics.
    for rank in range(4):
        mine = sorted((s for s in items if s.rank == rank), key=lambda s: s.start_s)
        assert all(a.end_s <= b.start_s + 1e-6 for a, b in zip(mine, mine[1:]))
        assert [s.step for s in mine] == sorted(s.step for s in mine)
    metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    for c in plan.calls:
        head = leader(c.mesh, c.layout)
        for m in metrics:
            (span,) = [s for s in items if s.key == ("call", c.name) and s.step == m["step"] and s.rank == head]
            assert m[f"{c.name}.time_s"] == pytest.approx(span.dur_s, abs=2e-6)

    res = cli("timeline", str(plan_path), "--measured", str(trace_path), "-o", str(tmp_path / "vs.png"), "--json")
    assert res.code == 0, res.err
    report = json.loads(res.out)
    assert report["written"] == [str(tmp_path / "vs.png")] and (tmp_path / "vs.png").stat().st_size > 10_000
    measured = {(r["cat"], r["call"]): r["measured_s"] for r in report["comparison"]}
    assert all(v is not None and v > 0 for v in measured.values()) and report["mean_abs_error"] is not None


def test_reference_run_writes_a_one_rank_trace_and_quiet_prints_nothing(plan_path: Path, tmp_path: Path) -> None:
    trace_path = tmp_path / "ref.trace.json"
    out = _run(["-m", "runtime", str(plan_path), "--reference", "--steps", "2", "--trace-out", str(trace_path),
                "--quiet", "--metrics-out", str(tmp_path / "m.jsonl")])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == ""
    doc = load_trace(trace_path)
    assert doc["otherData"]["world_size"] == 1 and doc["otherData"]["reference"] is True
    plan = load_plan(plan_path)
    items = spans(doc)
    # The reference runs every call in its one process and moves nothing.
    assert Counter((s.step, s.call) for s in items) == Counter((k, c.name) for k in (1, 2) for c in plan.calls)
    assert {s.rank for s in items} == {0} and all(s.cat == "call" for s in items)
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_the_memory_meter_reports_the_cpu_allocators_peak_over_the_run_and_per_call() -> None:
    """`--memory-out` on a CPU: the CPU allocator's running total of allocated bytes, as the
    profiler reports it, at its peak over the run and inside each call's range."""
    import torch

    from runtime.executor import CALL_MARK
    from runtime.observe import MemoryMeter

    mib = 1 << 20
    with MemoryMeter(torch.device("cpu")) as meter:
        keep = torch.zeros(mib // 4)  # 1 MiB held throughout
        with torch.profiler.record_function(CALL_MARK + "big"):
            big = torch.zeros(mib)  # 4 MiB for the call only
            del big
        with torch.profiler.record_function(CALL_MARK + "small"):
            small = torch.zeros(mib // 8)
            del small
        del keep
    got = meter.peaks()
    assert 5 * mib <= got["peak"] < 6 * mib
    assert 5 * mib <= got["calls"]["big"] < 6 * mib
    assert 1 * mib <= got["calls"]["small"] < 2 * mib and 1 * mib <= got["starts"]["small"] < 2 * mib
