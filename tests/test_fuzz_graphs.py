"""Property tests (hypothesis) over graphs: compile gives a valid plan that fits, or a `PlannerError`.

Graphs come from random programs against the `planner.Graph` builder (`graph_recipes`) and from
mutated `plans.Graph` dicts; they compile on small clusters with beam search only (CP-SAT has its
own tests), so each example takes a fraction of a second. Every plan returned must re-validate
from its JSON and fit in memory by the cost model. Pathological sizes must end fast, with a
plan or a clear error.
"""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from planner.algorithms import ppo, sft
from planner.check import memory_problems
from planner.compile import compile_graph
from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.graph import parse_graph
from plans.plan import parse_plan, plan_to_json
from tests.strategies import TINY_CLUSTERS, build_recipe, fuzz_settings, graph_recipes, mutated

HANG_GUARD_S = 60  # far above what any case here takes; only a hang reaches it


@contextmanager
def no_hang(seconds: int = HANG_GUARD_S):
    """Fail (instead of blocking CI) if the body runs for `seconds`."""
    def stop(*_):  # noqa: ANN002
        raise AssertionError(f"still running after {seconds} s: the search did not bound its work")
    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def check_plan(plan, graph, cluster) -> None:  # noqa: ANN001
    """The invariants of every plan the planner returns."""
    again = parse_plan(plan_to_json(plan))
    assert again == plan
    assert memory_problems(again) == []
    assert plan.estimate.peak_mem_bytes <= cluster.mem_bytes
    assert all(c.est_peak_mem_bytes <= cluster.mem_bytes for c in plan.calls)
    assert plan.cluster == cluster
    # The plan places exactly the graph it was given (calls in execution order).
    placed = plan.graph()
    assert placed.models == graph.models and placed.inputs == graph.inputs and placed.algorithm == graph.algorithm
    assert sorted(placed.calls, key=lambda c: c.name) == sorted(graph.calls, key=lambda c: c.name)


def compile_or_error(graph, cluster_text: str, *, record: bool = False):  # noqa: ANN001, ANN201
    """The plan (checked) or None after a `PlannerError`; `record` counts outcomes as hypothesis events."""
    cluster = parse_cluster(cluster_text)
    try:
        with no_hang():
            plan = compile_graph(graph, cluster, time_limit_s=0)
    except PlannerError as e:
        assert str(e)
        if record:
            event("compile: error")
        return None
    if record:
        event("compile: plan")
    check_plan(plan, graph, cluster)
    return plan


@fuzz_settings(300)
@given(recipe=graph_recipes(broken_share=0.5))
def test_builder_programs_build_a_valid_graph_or_raise_planner_error(recipe):
    try:
        graph = build_recipe(recipe)
    except PlannerError as e:
        assert str(e)
        event(f"build: error ({recipe['broken']} broken)")
        return
    event("build: graph")
    assert parse_graph(graph.model_dump(mode="json")) == graph  # what the builder returns re-validates


@fuzz_settings(40)
@given(recipe=graph_recipes(), cluster=st.sampled_from(TINY_CLUSTERS))
def test_builder_programs_compile_to_valid_plans_or_raise_planner_error(recipe, cluster):
    try:
        graph = build_recipe(recipe)
    except PlannerError as e:
        assert str(e)
        event("build: error")
        return
    compile_or_error(graph, cluster, record=True)


def _base_graph() -> dict:
    return sft("tiny-llama", batch=8, seq_len=16).model_dump(mode="json")


def _ppo_graph() -> dict:
    return ppo("tiny-gpt", reward_fn="m:f", batch=4, prompt_len=8, gen_len=8, ppo_minibatches=2).model_dump(mode="json")


@fuzz_settings(60)
@given(data=st.one_of(mutated(_base_graph()), mutated(_ppo_graph())), cluster=st.sampled_from(TINY_CLUSTERS[:5]))
def test_mutated_graph_dicts_validate_and_compile_or_raise_planner_error(data, cluster):
    try:
        graph = parse_graph(json.loads(json.dumps(data)))
    except PlannerError as e:
        assert str(e)
        event("parse: error")
        return
    compile_or_error(graph, cluster, record=True)


# Pathological requests: each ends fast with a plan or a clear error -----------------------------

def _many_calls(n: int):  # noqa: ANN202
    from planner import Graph

    g = Graph("many", batch=4, prompt_len=4, gen_len=4)
    actor = g.model("actor", "tiny-llama", trainable=True)
    h = g.input("prompts")
    for _ in range(n):
        actor.train(actor.generate(h), loss="grpo")
    return g.build()


def test_huge_batch_compiles_without_enumerating_its_divisors():
    # Scanning the 2**24 sequences for divisors took half a minute here; the fix takes under one.
    with no_hang(20):
        plan = compile_or_error(ppo("tiny-llama", reward_fn="m:f", batch=2**24, prompt_len=8, gen_len=8,
                                    ppo_minibatches=2), "cpu:1x4,mem_gib=16")  # 4 GiB: fp32 activations do not fit
    assert plan is not None and plan.calls[0].seqs == 2**24


@pytest.mark.parametrize("make, cluster, message", [
    (lambda: sft("tiny-llama", batch=1, seq_len=8), "a100-80gb:4096x16", "no valid layout on meshes of 8192 to 65536"),
    (lambda: ppo("tiny-llama", reward_fn="m:f", batch=1, prompt_len=8, gen_len=2**24 - 8, ppo_minibatches=1),
     "cpu:1x4", "does not fit"),
    (lambda: sft("llama-3-405b", batch=1, seq_len=8), "a100-80gb:1x1", "does not fit"),
    (lambda: _many_calls(40), "cpu:1x2", "at most 64"),
])
def test_unreasonable_requests_end_with_a_clear_error(make, cluster, message):
    with no_hang():
        with pytest.raises(PlannerError, match=message):
            compile_graph(make(), parse_cluster(cluster), time_limit_s=1)


def test_layout_evaluation_cap_refuses_before_costing():
    from planner.candidates import SearchSpace

    graph = ppo("tiny-llama", reward_fn="m:f", batch=8, prompt_len=8, gen_len=8, ppo_minibatches=2)
    with pytest.raises(PlannerError, match="layout evaluations"):
        compile_graph(graph, parse_cluster("cpu:1x4"), time_limit_s=0, space=SearchSpace(max_layout_evals=10))


def test_reallocation_work_budget_ends_the_search_with_an_error(monkeypatch):
    import planner.problem

    monkeypatch.setattr(planner.problem, "REALLOC_WORK_LIMIT", 1)
    graph = ppo("tiny-llama", reward_fn="m:f", batch=8, prompt_len=8, gen_len=8, ppo_minibatches=2)
    with pytest.raises(PlannerError, match="work budget costing parameter reallocations"):
        compile_graph(graph, parse_cluster("cpu:2x4"), time_limit_s=0)


def test_oversized_cpsat_model_is_skipped_and_the_plan_says_so(monkeypatch):
    import planner.compile

    monkeypatch.setattr(planner.compile, "CPSAT_TABLE_LIMIT", 0)
    plan = compile_graph(ppo("tiny-llama", reward_fn="m:f", batch=8, prompt_len=8, gen_len=8, ppo_minibatches=2),
                         parse_cluster("cpu:1x4"), time_limit_s=1)
    assert plan.search.method == "beam"
    assert plan.search.status is not None and plan.search.status.startswith("NOT_RUN")
    check_plan(plan, plan.graph(), parse_cluster("cpu:1x4"))


def test_beam_narrows_deterministically_on_large_problems(monkeypatch):
    import planner.beam
    from cost_models import CostModel
    from planner.candidates import SearchSpace
    from planner.problem import build_problem

    graph = ppo("tiny-llama", reward_fn="m:f", batch=8, prompt_len=8, gen_len=8, ppo_minibatches=2)
    problem = build_problem(graph, CostModel(parse_cluster("cpu:1x4")), SearchSpace())
    assert planner.beam.beam_width_for(problem, 16) == 16
    monkeypatch.setattr(planner.beam, "BEAM_WORK_LIMIT", 1)
    assert planner.beam.beam_width_for(problem, 16) == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"time_limit_s": float("inf")}, "time limit"), ({"time_limit_s": float("nan")}, "time limit"),
    ({"time_limit_s": -1.0}, "time limit"), ({"beam_width": 0}, "beam width"), ({"workers": 0}, "workers"),
])
def test_search_settings_are_checked(kwargs, message):
    graph = sft("tiny-llama", batch=4, seq_len=8)
    with pytest.raises(PlannerError, match=message):
        compile_graph(graph, parse_cluster("cpu:1x2"), **{"time_limit_s": 0.0, **kwargs})
