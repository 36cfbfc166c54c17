"""A plan whose placements are given, not searched: costed and scheduled like any plan.

`planner import` uses it to price a user's own engine config (verl, OpenRLHF, Megatron-LM,
DeepSpeed) with the same cost model, simulator and plan format the search uses, so `planner
compare imported.json plan.json` and `planner explain` treat both alike.

    plan = pinned_plan(graph, cluster, {"actor_train": (mesh, layout, None), ...}, method="verl config")
"""

from __future__ import annotations

import math

from cost_models import CostModel
from planner.candidates import Candidate, costed_view
from planner.compile import build_plan
from planner.problem import Problem, graph_slots, slot_edges
from planner.simulate import simulate
from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.graph import Call, Graph
from plans.layout import Layout, Mesh
from plans.plan import Plan, SearchInfo
from plans.sharding import layout_problems

Placement = tuple[Mesh, Layout, Layout | None]


def pinned_plan(graph: Graph, cluster: ClusterSpec, placements: dict[str, Placement], *, method: str,
                calibration=None, framework: str = "torch") -> Plan:  # noqa: ANN001 - a Calibration
    """The plan that runs each call of `graph` with its given (mesh, layout, decode layout),
    costed for the stack `framework`."""
    missing = [c.name for c in graph.calls if c.name not in placements]
    if missing:
        raise PlannerError(f"no placement for calls {', '.join(missing)}")
    cm = CostModel(cluster, calibration, framework=framework)

    def candidate(call: Call) -> list[Candidate]:
        mesh, lay, dec = placements[call.name]
        name = call.name
        if mesh.ranks[-1] >= cluster.world_size:
            raise PlannerError(f"{name}: GPUs {mesh.short()} are beyond the cluster's {cluster.world_size}",
                               hint="give the cluster the config runs on with --cluster")
        if lay.size != mesh.size:
            raise PlannerError(f"{name}: layout {lay.short()} needs {lay.size} GPUs, the config gives it {mesh.size}")
        decl = graph.models[call.model]
        bad = layout_problems(decl.spec, lay)
        if bad:
            raise PlannerError(f"{name}: layout {lay.short()} cannot shard {call.model}: {bad[0]}")
        view = costed_view(call, decl)
        return [Candidate(mesh, lay, cm.call_cost(call, view, mesh, lay, decode_layout=dec), dec)]

    slots, index = graph_slots(graph, candidate)
    edges = slot_edges(graph, index)
    # Atoms must tile every mesh, wherever it starts.
    cuts = {cluster.world_size} | {x for s in slots for c in s.cands for x in (c.mesh.first, c.mesh.size) if x}
    problem = Problem(graph, cm, slots, edges, atom_size=math.gcd(*cuts), unroll=2, symmetric=False)
    choice = [0] * len(slots)
    sched = simulate(problem, choice)
    info = SearchInfo(method=method, wall_s=None, lower_bound_s=None, gap=None, candidates=len(slots),
                      status="fits" if sched.mem_ok else "exceeds GPU memory")
    return build_plan(problem, choice, sched, info)
