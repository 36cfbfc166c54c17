"""States in host memory between calls (`Layout.offload`): what the cost model charges, which
plans may say it, and that the search takes it where memory binds. The runtime's side (a plan
with offloaded optimizers and weights equal to the single-process reference on 4 gloo ranks) is
`tests/test_runtime_executor.py`'s ``ppo_offload``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_models import CostModel
from cost_models.api import HOST_COPY_EFFICIENCY
from planner.algorithms import ppo
from planner.candidates import SearchSpace, offload_kind
from planner.compile import compile_graph
from plans.cluster import parse_cluster
from plans.layout import Layout, Mesh
from plans.plan import Plan, parse_plan, plan_to_json

TINY_PPO = Path(__file__).resolve().parents[1] / "plans" / "tiny_ppo.json"


def _ppo_8b():
    return ppo("llama-3-8b", batch=512, prompt_len=1024, gen_len=1024)


def test_offload_keeps_states_on_the_host_for_the_time_of_the_copies() -> None:
    cluster = parse_cluster("h100-sxm:1x8")
    cm, graph, mesh = CostModel(cluster), _ppo_8b(), Mesh.block(0, 8)
    rate = cluster.sheet.host_gbps * 1e9 / 8 * HOST_COPY_EFFICIENCY  # bytes per second per GPU
    for name, base, kind, trips, kept in (
            ("actor_train", Layout(dp=8, zero=1, micro_batches=4), "optimizer", 2, "optimizer"),
            ("ref_inference", Layout(dp=8, micro_batches=4), "weights", 1, "params")):
        call = graph.call(name)
        decl = graph.models[call.model]
        plain = cm.call_cost(call, decl, mesh, base)
        off = cm.call_cost(call, decl, mesh, base.model_copy(update={"offload": kind}))
        assert off.host_mem_bytes == plain.mem_breakdown_bytes[kept] > 0
        assert off.state_mem_bytes == plain.state_mem_bytes - off.host_mem_bytes  # off the GPU between calls
        assert off.peak_mem_bytes == plain.peak_mem_bytes  # on it while the call runs
        assert off.breakdown_s["offload"] == pytest.approx(trips * off.host_mem_bytes / rate)
        assert off.time_s == pytest.approx(plain.time_s + off.breakdown_s["offload"])


def test_what_a_home_call_may_offload() -> None:
    graph = _ppo_8b()
    assert offload_kind(graph.call("actor_train"), graph) == "optimizer"
    assert offload_kind(graph.call("ref_inference"), graph) == "weights"  # a frozen model's only call
    assert offload_kind(graph.call("critic_inference"), graph) is None  # the critic's home is its train call
    assert offload_kind(graph.call("actor_generate"), graph) is None


def _tiny(**layouts: dict) -> dict:
    data = json.loads(TINY_PPO.read_text())
    for c in data["calls"]:
        for key, value in layouts.get(c["name"], {}).items():
            c[key] = value
    return data


@pytest.mark.parametrize(("call", "change", "says"), [
    ("actor_generate", {"layout": {"offload": "optimizer"}}, "only a train call"),
    ("critic_inference", {"layout": {"offload": "weights"}}, "keeps its states with its home call 'critic_train'"),
    ("actor_train", {"layout": {"offload": "weights"}}, "but it is trainable"),
    ("actor_generate", {"decode_layout": {"offload": "optimizer"}}, "belongs to the layout the call starts with"),
])
def test_a_plan_offloading_what_is_not_there_is_refused(call: str, change: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Plan.model_validate(_tiny(**{call: change}))


def test_plan_json_states_offload_only_where_a_call_uses_it() -> None:
    text = TINY_PPO.read_text()
    assert "offload" not in plan_to_json(parse_plan(text))  # plans without offload keep their bytes
    plan = Plan.model_validate(_tiny(critic_train={"layout": {"offload": "optimizer"}},
                                     ref_inference={"layout": {"offload": "weights"}}))
    again = parse_plan(plan_to_json(plan))
    assert again.call("critic_train").layout.offload == "optimizer"
    assert again.call("ref_inference").layout.offload == "weights"
    assert plan_to_json(again).count('"offload"') == 2


@pytest.mark.slow
def test_the_search_offloads_where_memory_binds() -> None:
    """PPO of an 8B model on one node of 80 GiB GPUs: every model's states resident beside the
    generation's KV cache leave it short of memory; the reference and reward weights and the
    trainable models' optimizer states on the host make the iteration faster."""
    graph, cluster = _ppo_8b(), parse_cluster("h100-sxm:1x8")
    plain = compile_graph(graph, cluster, space=SearchSpace(offload=False))
    plan = compile_graph(graph, cluster)
    assert all(c.layout.offload == "none" for c in plain.calls)
    offloaded = {c.name: c.layout.offload for c in plan.calls if c.layout.offload != "none"}
    assert offloaded, "the search offloaded nothing"
    assert plan.estimate.iteration_s < 0.95 * plain.estimate.iteration_s  # 1.07x (README, Offload)


def test_explain_counts_offloaded_states_while_their_call_runs() -> None:
    """A call whose states wait in host memory needs them back while it runs: explain's memory
    windows list them and add up to the plan's peaks."""
    from planner.explain import explain_plan
    from tests.observe_fixtures import ppo_7b

    plan = ppo_7b()
    offloaded = {c.name for c in plan.calls if c.layout.offload != "none"}
    assert offloaded, "the plan offloads nothing"
    ex = explain_plan(plan)
    for c in plan.calls:
        totals = [w.total_bytes for g in ex.memory for w in g.windows if w.running == c.name]
        assert max(totals) == c.est_peak_mem_bytes, c.name
        if c.name in offloaded:
            assert any("(from host memory)" in k for g in ex.memory for w in g.windows if w.running == c.name
                       for k in w.transient)
    assert max(g.peak_bytes for g in ex.memory) == plan.estimate.peak_mem_bytes


def test_compile_no_offload_keeps_every_state_on_the_gpu(cli) -> None:  # noqa: ANN001
    args = ("compile", "dpo", "--actor", "llama-2-7b", "--cluster", "a100-80gb:1x8", "--batch", "128", "--seq-len",
            "2048", "--time-limit", "0", "--json")
    with_offload = cli(*args)
    assert with_offload.code == 0, with_offload.err
    assert '"offload": "weights"' in with_offload.out  # the reference's weights wait in host memory
    without = cli(*args, "--no-offload")
    assert without.code == 0, without.err
    assert '"offload"' not in without.out


@pytest.mark.slow
def test_offloaded_states_stay_within_the_host_memory(monkeypatch) -> None:  # noqa: ANN001
    """The states every home call on a GPU offloads share its host memory: with none to spare,
    neither CP-SAT nor the simulator accepts an offloaded plan."""
    from cost_models import CostModel
    from planner.cpsat import solve_cpsat
    from planner.problem import Problem, build_problem

    graph, cluster = _ppo_8b(), parse_cluster("h100-sxm:1x8")
    problem = build_problem(graph, CostModel(cluster), SearchSpace())
    assert any(op.host_bytes for ops in problem.ops for op in ops)
    free = solve_cpsat(problem, hint=None, time_limit_s=30, work_budget=1.0)
    assert free.choice is not None and max(problem.host_bytes(free.choice)) > 0  # offloads when it may
    monkeypatch.setattr(Problem, "host_cap_bytes", property(lambda self: 2**30))  # 1 GiB per GPU
    assert not problem.fits(free.choice)
    tight = solve_cpsat(problem, hint=None, time_limit_s=30, work_budget=1.0)
    assert tight.choice is not None and max(problem.host_bytes(tight.choice)) <= 2**30
    plan = compile_graph(graph, cluster, time_limit_s=1)  # each model's offload alone exceeds 1 GiB per GPU
    assert all(c.layout.offload == "none" for c in plan.calls)
