"""Compile progress: candidates, best plan so far and the bound, reported without changing the plan."""

from __future__ import annotations

import json

from planner.algorithms import ppo
from planner.compile import SearchProgress, compile_graph
from plans.cluster import parse_cluster
from plans.plan import plan_to_json


def _plan_text(plan) -> str:  # noqa: ANN001 - the plan without its (unreproducible) wall time
    data = json.loads(plan_to_json(plan))
    data["search"]["wall_s"] = None
    return json.dumps(data, sort_keys=True)


def test_progress_reports_the_search_and_does_not_change_it() -> None:
    graph = ppo("tiny-llama", critic="tiny-llama", reward_fn="runtime.tasks:pattern_reward", batch=16, prompt_len=8,
                gen_len=8, ppo_minibatches=2, name="tiny_ppo")
    cluster = parse_cluster("cpu:1x4")
    # A time limit far above what CP-SAT's work budget needs here, so the wall clock never decides.
    events: list[SearchProgress] = []
    plan = compile_graph(graph, cluster, time_limit_s=20, progress=events.append)
    assert _plan_text(plan) == _plan_text(compile_graph(graph, cluster, time_limit_s=20))
    phases = [e.phase for e in events]
    costing = phases.index("beam")
    assert costing >= 1 and set(phases[:costing]) == {"costing"} and "costing" not in phases[costing:]
    assert "cpsat" in phases
    assert phases.index("beam") < phases.index("cpsat")
    searching = [e for e in events if e.phase != "costing"]
    assert all(e.candidates == plan.search.candidates for e in searching)
    bounds = [e.bound_s for e in searching if e.phase == "cpsat"]
    assert bounds == sorted(bounds)  # a proven bound only rises
    assert max(bounds) <= plan.search.lower_bound_s + 1e-9 <= plan.estimate.iteration_s + 1e-9
    cp = [e for e in events if e.phase == "cpsat"]
    assert any(e.solver_s is not None for e in cp)  # CP-SAT's incumbents are heard while it runs
    best = [e.best_s for e in cp]
    assert all(b is not None and b >= plan.estimate.iteration_s - 1e-12 for b in best)
    assert best == sorted(best, reverse=True)  # the best plan so far only improves
    line = str(cp[-1])
    assert line.startswith("CP-SAT round") and "candidates" in line and "bound" in line and "best" in line
