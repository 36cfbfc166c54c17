"""planner explain: critical path, bottleneck, memory over time, bound, alternatives."""

from __future__ import annotations

import json

import pytest

from cost_models import CostModel
from planner.explain import critical_path, explain_plan
from planner.timeline import gpu_groups
from tests.observe_fixtures import FIXED_CPU, cpu_model, ppo_7b, tiny_ppo


@pytest.fixture(scope="module")
def tiny_ex():  # noqa: ANN201
    return explain_plan(tiny_ppo(), cm=cpu_model(tiny_ppo().cluster))


def test_critical_path_is_a_chain_that_ends_the_iteration(tiny_ex) -> None:  # noqa: ANN001
    plan = tiny_ppo()
    path = tiny_ex.critical_path
    end = max(c.est_start_s + c.est_time_s for c in plan.calls)
    assert path[-1].start_s + path[-1].time_s == pytest.approx(end)
    assert path[0].start_s == pytest.approx(0.0) and "starts the iteration" in path[0].waits_for
    transfers = {(t.from_call, t.to_call): t.est_time_s for t in plan.transfers}
    for prev, step in zip(path, path[1:]):
        gap = step.start_s - (prev.start_s + prev.time_s)
        assert gap == pytest.approx(transfers.get((prev.call, step.call), 0.0), abs=1e-12)
        assert prev.call in step.waits_for or step.waits_for == "its parameter reallocation"
    # tiny_ppo: the actor generates, the critic's parameters move to GPU 0 and it scores the
    # samples, the actor trains on them
    assert [p.call for p in path] == ["actor_generate", "critic_inference", "critic_inference", "actor_train"]
    assert path[2].waits_for == "its parameter reallocation"


def test_critical_path_follows_gpus_when_they_bind() -> None:
    plan = ppo_7b()  # its calls share GPUs: each waits for the GPUs the call before it holds
    path = critical_path(plan)
    kinds = [(p.kind, p.call) for p in path]
    assert kinds[0] == ("realloc", "actor_generate") and kinds[-1][1] == plan.calls[-1].name
    bound = [p for p in path if p.waits_for.startswith("GPUs ") and " held by " in p.waits_for]
    assert bound and all(p.waits_for.split(" held by ")[1] in {q.call for q in path} for p in bound)


def test_bottleneck_is_the_longest_call_on_the_path(tiny_ex) -> None:  # noqa: ANN001
    on_path = [p for p in tiny_ex.critical_path if p.kind == "call"]
    assert tiny_ex.bottleneck == max(on_path, key=lambda p: p.time_s)
    assert tiny_ex.bottleneck.call == "actor_train"


def test_memory_windows_reproduce_each_calls_planned_peak(tiny_ex) -> None:  # noqa: ANN001
    plan = tiny_ppo()
    assert tiny_ex.notes == []  # same cost model as the compile: the numbers must agree
    groups = {g.label: g for g in gpu_groups(plan)}
    for c in plan.calls:
        totals = [w.total_bytes for g in tiny_ex.memory for w in g.windows if w.running == c.name
                  if set(groups[g.label].ranks) & set(c.mesh.ranks)]
        assert max(totals) == c.est_peak_mem_bytes
    assert max(g.peak_bytes for g in tiny_ex.memory) == plan.estimate.peak_mem_bytes
    gpu1 = next(g for g in tiny_ex.memory if g.label == "GPU 1")
    assert set(gpu1.resident) == {"critic"}  # the critic's home (its train call) is GPU 1
    copy = next(w for g in tiny_ex.memory for w in g.windows if w.running == "critic_inference")
    assert "params (transient copy)" in copy.transient  # reallocated from GPU 1 to GPU 0


def test_alternatives_are_tried_in_the_plan(tiny_ex) -> None:  # noqa: ANN001
    base = tiny_ex.replay_iteration_s
    assert base == pytest.approx(tiny_ppo().estimate.iteration_s)
    for c in tiny_ex.calls:
        assert c.chosen.verdict == "chosen" and c.chosen.iteration_s == base
        assert 0 < len(c.alternatives) <= 5
        assert c.chosen.layout not in [a.layout for a in c.alternatives if a.mesh_size == c.chosen.mesh_size]
        for a in c.alternatives:
            if a.iteration_s is None:
                assert a.verdict.startswith("does not fit")
            elif a.iteration_s > base * 1.0001:
                assert a.verdict == f"iteration {(a.iteration_s - base) / base * 100:+.1f}%"
    gen = next(c for c in tiny_ex.calls if c.call == "actor_generate")
    faster = [a for a in gen.alternatives if a.time_s < gen.chosen.time_s]
    assert faster and all(a.iteration_s > base for a in faster)  # faster alone, slower for the plan


def test_alternatives_that_do_not_fit_say_why() -> None:
    ex = explain_plan(ppo_7b(), top=5)
    verdicts = [a.verdict for c in ex.calls for a in c.alternatives]
    assert any(v.startswith("does not fit: needs") for v in verdicts)
    cap = ex.capacity_bytes
    for c in ex.calls:
        for a in c.alternatives:
            assert a.fits == (a.peak_mem_bytes <= cap)
            if not a.fits:
                assert a.iteration_s is None


def test_a_different_calibration_is_flagged() -> None:
    cal = FIXED_CPU
    coef = cal.coefficients
    coef = coef.model_copy(update={"step_overhead_ms": coef.step_overhead_ms + 5})
    slower = cal.model_copy(update={"coefficients": coef})
    ex = explain_plan(tiny_ppo(), cm=CostModel(tiny_ppo().cluster, calibration=slower), top=1)
    assert ex.notes and all("compiled with --calibration" in n for n in ex.notes)
    assert {n.split(":")[0] for n in ex.notes} == {"actor_train", "critic_train"}  # the calls with optimizer steps


def test_explain_cli(cli, tmp_path) -> None:  # noqa: ANN001
    from cost_models.calibration import save_calibration
    from plans.plan import save_plan

    path = tmp_path / "tiny.json"
    save_plan(tiny_ppo(), path)
    save_calibration(FIXED_CPU, tmp_path / "cpu.json")
    r = cli("explain", str(path), "--json", "--top", "2", "--calibration", str(tmp_path / "cpu.json"))
    assert r.code == 0, r.err
    data = json.loads(r.out)
    assert [p["call"] for p in data["critical_path"]] == [p.call for p in explain_plan(
        tiny_ppo(), cm=cpu_model(tiny_ppo().cluster)).critical_path]
    assert all(len(c["alternatives"]) <= 2 for c in data["calls"])
    r = cli("explain", str(path), "--calibration", str(tmp_path / "cpu.json"))
    assert r.code == 0 and "critical path" in r.out and "bottleneck: actor_train" in r.out


def test_a_vllm_rollout_says_how_its_scheduler_runs_it() -> None:
    """For a stack whose rollouts run on vLLM, explain says each engine's rows, KV budget, the rows
    running at once, the decode steps and the preemptions its schedule has; the runtime's plans,
    in static waves, have no such note."""
    from planner.algorithms import grpo
    from planner.compile import compile_graph
    from plans.cluster import parse_cluster
    from plans.graph import ResponseLengths

    graph = grpo("llama-3-8b", reward_fn="math:verify", batch=64, samples_per_prompt=8, prompt_len=256, gen_len=2048,
                 policy_logprobs=True)
    graph = graph.model_copy(update={"calls": [c.model_copy(update={"response_len": ResponseLengths(mean=400.0)})
                                               if c.kind == "generate" else c for c in graph.calls]})
    plan = compile_graph(graph, parse_cluster("h100-sxm:1x8"), time_limit_s=1, framework="rlhf-engine")
    gen = plan.call("actor_generate")
    engines = gen.layout.dp
    notes = [n for n in explain_plan(plan, top=1).notes if n.startswith("actor_generate:")]
    assert len(notes) == 1 and f"{engines} vLLM engine" in notes[0] and f"{512 // engines} rows each" in notes[0]
    assert "decode steps" in notes[0] and "max_num_seqs 256" in notes[0]
    assert not any("vLLM engine" in n for n in explain_plan(tiny_ppo(), cm=cpu_model(tiny_ppo().cluster), top=1).notes)
