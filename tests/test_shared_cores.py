"""Calls on ranks that time-share a CPU's cores: priced with every rank of the node at work, run
by the schedule at the speed the ranks busy at each moment leave them (`planner.simulate`).

A calibration that says the machine has 2 cores for 4 single-threaded ranks makes a call on 2
ranks twice as fast (over the measured sharing efficiency) while the other 2 are idle."""

from __future__ import annotations

import pytest

from cost_models import CostModel
from cost_models.hardware import core_share
from planner.candidates import Candidate, costed_view
from planner.compile import compile_graph, lower_bound_parts
from planner.graph import Graph
from planner.problem import Problem, graph_slots, slot_edges
from planner.simulate import simulate
from plans import Layout, Mesh, parse_cluster
from tests.observe_fixtures import FIXED_CPU

CPU4 = parse_cluster("cpu:1x4")
SHARED = FIXED_CPU.model_copy(update={"hardware": FIXED_CPU.hardware.model_copy(
    update=dict(cpu_cores=2, rank_threads=1, share_efficiency=0.8, skew_ms_per_sqrt_s=0.5))})


def two_trains(a: str = "tiny-llama", b: str = "tiny-gpt"):
    """Two independent train calls (models `a` and `b`) on the same data."""
    g = Graph("two", batch=8, seq_len=32)
    tokens = g.input("tokens")
    for name, spec in (("a", a), ("b", b)):
        g.model(name, spec, trainable=True).train(tokens, loss="sft", name=f"{name}_train")
    return g.build()


def problem_of(graph, places: dict[str, tuple[Mesh, Layout]], cal=SHARED, unroll: int = 1) -> Problem:
    cm = CostModel(CPU4, cal)
    slots, index = graph_slots(graph, lambda call: [Candidate(
        places[call.name][0], places[call.name][1],
        cm.call_cost(call, costed_view(call, graph.models[call.model]), *places[call.name]))])
    return Problem(graph, cm, slots, slot_edges(graph, index), atom_size=1, unroll=unroll)


def test_share_by_busy_ranks():
    assert core_share(CPU4, SHARED) == pytest.approx(2 / 4 * 0.8)
    # 3 ranks on 2 cores: two thirds of a core each, at the efficiency halfway to time-sharing all 4.
    assert core_share(CPU4, SHARED, busy=3) == pytest.approx(2 / 3 * 0.9)
    assert core_share(CPU4, SHARED, busy=2) == 1.0 and core_share(CPU4, SHARED, busy=1) == 1.0
    assert core_share(CPU4, FIXED_CPU) == 1.0  # no core count: ranks are taken to have cores of their own
    measured = SHARED.model_copy(update={"hardware": SHARED.hardware.model_copy(update=dict(full_efficiency=0.9))})
    assert core_share(CPU4, measured, busy=2) == pytest.approx(0.9)  # a core each, caches and bandwidth shared
    assert core_share(CPU4, measured, busy=3) == pytest.approx(2 / 3 * 0.85)
    assert core_share(CPU4, measured, busy=4) == pytest.approx(2 / 4 * 0.8)
    eight = parse_cluster("cpu:1x8")  # 8 ranks on 2 cores: the time-sharing efficiency once all 8 work
    assert core_share(eight, measured, busy=2) == pytest.approx(0.9)
    assert core_share(eight, measured, busy=8) == pytest.approx(2 / 8 * 0.8)
    cm = CostModel(CPU4, SHARED)
    assert cm.shares_cores and not CostModel(CPU4, FIXED_CPU).shares_cores
    assert cm.at_busy(4) is cm and cm.at_busy(2) is cm.at_busy(2) and cm.at_busy(2) is not cm
    with pytest.raises(ValueError):
        cm.at_busy(2).at_busy(1)


def test_a_call_alone_runs_at_the_speed_of_its_own_ranks():
    g = two_trains()
    p = problem_of(g, {"a_train": (Mesh.block(0, 2), Layout(dp=2)), "b_train": (Mesh.block(0, 2), Layout(dp=2))})
    sched = simulate(p, [0, 0])
    for i in range(2):  # one after the other on the same two ranks: the other two stay idle
        alone, priced = p.busy_time_s(i, 0, 2), p.slots[i].cands[0].time_s
        assert alone < priced / 1.5
        assert sched.end[(0, i)] - sched.run_start[(0, i)] == pytest.approx(alone, rel=1e-12)
        assert p.fastest_s(i, 0) == pytest.approx(alone)


def test_overlapping_calls_share_the_cores_while_they_overlap():
    """a and b start together on disjoint halves: while both run all 4 ranks work, then the longer
    one has the cores to itself: T = T_short(4) + (1 - T_short(4) / T_long(4)) * T_long(2)."""
    g = two_trains()
    p = problem_of(g, {"a_train": (Mesh.block(0, 2), Layout(dp=2)), "b_train": (Mesh.block(2, 2), Layout(dp=2))})
    sched = simulate(p, [0, 0])
    t4 = [p.slots[i].cands[0].time_s for i in range(2)]
    t2 = [p.busy_time_s(i, 0, 2) for i in range(2)]
    short, long_ = sorted(range(2), key=lambda i: t4[i])
    assert sched.start[(0, 0)] == sched.start[(0, 1)] == 0.0
    assert sched.end[(0, short)] == pytest.approx(t4[short], rel=1e-9)
    expect = t4[short] + (1 - t4[short] / t4[long_]) * t2[long_]
    assert sched.end[(0, long_)] == pytest.approx(expect, rel=1e-9)


def test_same_call_twice_at_once_takes_its_priced_time():
    g = two_trains("tiny-llama", "tiny-llama")
    p = problem_of(g, {"a_train": (Mesh.block(0, 2), Layout(dp=2)), "b_train": (Mesh.block(2, 2), Layout(dp=2))})
    sched = simulate(p, [0, 0])
    for i in range(2):
        assert sched.end[(0, i)] == pytest.approx(p.slots[i].cands[0].time_s, rel=1e-9)


def test_without_sharing_the_schedule_uses_the_priced_times():
    g = two_trains()
    p = problem_of(g, {"a_train": (Mesh.block(0, 2), Layout(dp=2)), "b_train": (Mesh.block(2, 2), Layout(dp=2))},
                   cal=FIXED_CPU)
    sched = simulate(p, [0, 0])
    for i in range(2):
        assert sched.end[(0, i)] == p.slots[i].cands[0].time_s
        assert p.fastest_s(i, 0) == p.slots[i].cands[0].time_s


def test_searched_plan_states_its_scheduled_times_and_keeps_its_bound():
    g = two_trains()
    plan = compile_graph(g, CPU4, calibration=SHARED, time_limit_s=5.0)
    assert plan.search.lower_bound_s is not None and plan.search.lower_bound_s <= plan.estimate.iteration_s + 1e-12
    cm = CostModel(CPU4, SHARED)
    for pc in plan.calls:
        decl = costed_view(pc, plan.models[pc.model])
        priced = cm.call_cost(pc, decl, pc.mesh, pc.layout).time_s
        own = cm.at_busy(pc.mesh.size).call_cost(pc, decl, pc.mesh, pc.layout).time_s
        assert own * (1 - 1e-9) <= pc.est_time_s <= priced * (1 + 1e-9)
    again = compile_graph(g, CPU4, calibration=SHARED, time_limit_s=5.0)
    same = {"search": {"wall_s"}}  # the wall clock is all that may differ
    assert again.model_dump(exclude=same) == plan.model_dump(exclude=same)


def test_bounds_assume_the_fastest_speed_and_count_core_seconds():
    """The chain bound takes each call alone on its ranks; the work bound counts core-seconds: a call
    on 2 ranks keeps 2 x share cores busy at any moment, and the node has 2 cores."""
    g = two_trains()
    p = problem_of(g, {"a_train": (Mesh.block(0, 2), Layout(dp=2)), "b_train": (Mesh.block(2, 2), Layout(dp=2))})
    chain, work = lower_bound_parts(p)
    assert chain == pytest.approx(max(p.busy_time_s(i, 0, 2) for i in range(2)))
    core_s = [min(p.busy_time_s(i, 0, b) * 2 * core_share(CPU4, SHARED, busy=b) for b in (2, 3, 4)) for i in range(2)]
    assert work == pytest.approx(sum(core_s) / 2)
    # Two ranks already fill the two cores: side by side, the calls gain only the parts of them
    # that wait rather than compute (gloo's latency), where rank-seconds alone would allow half.
    alone = sum(p.busy_time_s(i, 0, 2) for i in range(2))
    assert work > 0.75 * alone > 0.5 * alone >= sum(2 * p.busy_time_s(i, 0, 2) for i in range(2)) / 4
    assert max(chain, work) <= simulate(p, [0, 0]).iteration_s


def test_explain_states_the_sharing_and_splits_scheduled_times():
    from planner.explain import explain_plan

    plan = compile_graph(two_trains(), CPU4, calibration=SHARED, time_limit_s=5.0)
    ex = explain_plan(plan, cm=CostModel(CPU4, SHARED))
    assert ex.shared_cores and any("time-share its cores" in n for n in ex.notes)
    assert not any("the plan states" in n for n in ex.notes)  # the replayed schedule agrees with the plan
    for c in ex.calls:
        pc = plan.call(c.call)
        assert sum(c.breakdown_s.values()) == pytest.approx(pc.est_time_s, rel=1e-9)
