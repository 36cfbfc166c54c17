"""A plan costed for an export stack keeps to the layouts that stack's engines run.

`--framework rlhf-engine-hf` stands for OpenRLHF (DeepSpeed) and `verl-fsdp` for verl's FSDP
workers, which hold each HF model's layers whole on every rank (ZeRO-3 shards them) and start
vLLM engines with a tensor-parallel size only; `rlhf-engine` for verl's Megatron workers, which
train with any Megatron-Core layout but have no ZeRO-2; verl runs every call on its one pool.
Before the search knew this, the PPO below compiled for the HF stack trained the actor at tp 2
with sequence parallelism and decoded generation on a pipeline-parallel layout of its own, which
neither engine runs.
"""

from __future__ import annotations

import pytest

from cost_models.framework import FRAMEWORKS, engine_layout_problems
from planner.algorithms import grpo, ppo, sft
from planner.compile import compile_graph
from planner.exports import STACKS, export_plan
from plans.cluster import parse_cluster
from plans.layout import Layout
from tests.conftest import ROOT


@pytest.fixture(scope="module")
def hf_plan():
    graph = ppo("llama-3-8b", batch=512, prompt_len=1024, gen_len=1024, name="ppo_hf")
    return compile_graph(graph, parse_cluster("h100-sxm:2x8"), time_limit_s=5, framework="rlhf-engine-hf")


def test_the_hf_engines_train_and_score_with_whole_layers_sharded_by_zero3() -> None:
    fw = FRAMEWORKS["rlhf-engine-hf"]
    ok = Layout(dp=8, zero=3, micro_batches=4)
    assert engine_layout_problems(fw, "train", ok) == []
    assert engine_layout_problems(fw, "train", Layout(dp=2, cp=4, zero=3)) == []  # ring attention / Ulysses
    assert engine_layout_problems(fw, "train", Layout(tp=1)) == []  # one rank: nothing to shard
    tp2 = engine_layout_problems(fw, "train", Layout(dp=4, tp=2, zero=3, sequence_parallel=True))
    assert len(tp2) == 1 and "tensor, pipeline or expert parallel (dp4 tp2" in tp2[0] and "OpenRLHF" in tp2[0]
    assert engine_layout_problems(fw, "train", Layout(dp=4, pp=2, zero=3))
    z1 = engine_layout_problems(fw, "train", Layout(dp=8, zero=1))
    assert len(z1) == 1 and z1[0].startswith("ZeRO-1 over 8 ranks") and "ZeRO-3" in z1[0]
    replicated = engine_layout_problems(fw, "inference", Layout(dp=8))
    assert len(replicated) == 1 and replicated[0].startswith("weights replicated (ZeRO-0) over 8 ranks")


def test_rollout_engines_take_a_tensor_parallel_size_and_decode_where_they_prefill() -> None:
    for name in ("rlhf-engine", "rlhf-engine-hf"):
        fw = FRAMEWORKS[name]
        assert engine_layout_problems(fw, "generate", Layout(dp=2, tp=4, micro_batches=2)) == []
        assert "pipeline-parallel generation (pp=2)" in engine_layout_problems(fw, "generate", Layout(dp=4, pp=2))[0]
        assert "cp=2" in engine_layout_problems(fw, "generate", Layout(dp=4, cp=2))[0]
        split = engine_layout_problems(fw, "generate", Layout(dp=8), Layout(dp=2, tp=4))
        assert len(split) == 1 and "decode layout (dp2 tp4" in split[0]
    # vLLM's expert parallel splits whole experts over an engine: verl asks for it, OpenRLHF cannot.
    ep = Layout(dp=8, ep=8)
    assert engine_layout_problems(FRAMEWORKS["rlhf-engine"], "generate", ep) == []
    assert engine_layout_problems(FRAMEWORKS["rlhf-engine"], "generate", Layout(dp=4, tp=2, ep=4, etp=2))
    assert engine_layout_problems(FRAMEWORKS["rlhf-engine-hf"], "generate", ep)
    # verl's Megatron workers: any Megatron layout, but no ZeRO-2.
    verl = FRAMEWORKS["rlhf-engine"]
    assert engine_layout_problems(verl, "train", Layout(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True)) == []
    assert "ZeRO-2 over 8 ranks" in engine_layout_problems(verl, "train", Layout(dp=8, zero=2))[0]
    # The stacks whose plans the planner's runtime or Megatron-LM runs are not restricted here.
    for name in ("torch", "megatron-core", "megatron"):
        fw = FRAMEWORKS[name]
        assert engine_layout_problems(fw, "train", Layout(dp=2, tp=2, pp=2, zero=2)) == []
        assert engine_layout_problems(fw, "generate", Layout(dp=4, pp=2), Layout(dp=2, tp=4)) == []


def test_a_plan_for_the_hf_engines_holds_only_layouts_they_run(hf_plan) -> None:
    fw = FRAMEWORKS["rlhf-engine-hf"]
    for c in hf_plan.calls:
        assert engine_layout_problems(fw, c.kind, c.layout, c.decode_layout) == [], (c.name, c.layout.short())
        if c.kind != "generate":
            assert c.layout.tp == c.layout.pp == 1 and c.layout.zero == 3, (c.name, c.layout.short())
    assert any(c.kind == "inference" and c.layout.dp > 1 for c in hf_plan.calls)  # sharded scoring, not replicas


def test_its_export_to_openrlhf_runs_as_planned(hf_plan) -> None:
    openrlhf = export_plan(hf_plan, "openrlhf")
    assert openrlhf.cannot_express == []
    assert not any("costed for framework" in n for n in openrlhf.notes)


def test_a_plan_for_verls_fsdp_workers_runs_on_its_pool_as_planned() -> None:
    """verl takes a `verl-fsdp` plan as it is: its FSDP workers hold every model but the reward
    model, which its rollout engine serves (whole weights on each replica, vLLM's kernels), every
    call on all GPUs."""
    graph = ppo("llama-3-8b", batch=512, prompt_len=1024, gen_len=1024, name="ppo_verl_fsdp")
    plan = compile_graph(graph, parse_cluster("h100-sxm:2x8"), time_limit_s=5, framework="verl-fsdp")
    fw = FRAMEWORKS["verl-fsdp"]
    assert {c.mesh.size for c in plan.calls} == {16}
    for c in plan.calls:
        assert engine_layout_problems(fw, c.kind, c.layout, c.decode_layout, returns=c.returns) == []
    reward = plan.call("reward_inference")
    assert reward.layout.zero == 0 and reward.layout.offload == "none"
    assert engine_layout_problems(fw, "inference", Layout(dp=16, zero=3), returns="scores")
    assert engine_layout_problems(fw, "inference", Layout(dp=16, zero=3), returns="values") == []
    verl = export_plan(plan, "verl")
    assert verl.data["actor_rollout_ref"]["actor"]["strategy"] == "fsdp"
    assert verl.cannot_express == []
    assert not any("costed for framework" in n for n in verl.notes)
    # `planner explain` weighs only what verl runs: every alternative on all GPUs, no tensor parallel
    # in training.
    from planner.explain import explain_plan

    why = explain_plan(plan, top=8)
    options = [o for c in why.calls for o in (c.chosen, *c.alternatives)]
    assert options and {o.mesh_size for o in options} == {16}
    assert not any("tp" in o.layout and " tp1 " not in o.layout for c in why.calls if c.call.endswith("_train")
                   for o in (c.chosen, *c.alternatives))
    # Scored on vLLM's fused kernels, the same forward is faster than the FSDP workers' eager one.
    from cost_models import CostModel
    from planner.candidates import costed_view

    cm = CostModel(plan.cluster, framework="verl-fsdp")
    decl = costed_view(reward, plan.models[reward.model])
    values = plan.graph().call(reward.name).model_copy(update={"returns": "values"})
    served = cm.call_cost(plan.graph().call(reward.name), decl, reward.mesh, reward.layout).time_s
    assert served < 0.9 * cm.call_cost(values, decl, reward.mesh, reward.layout).time_s


def test_an_export_says_when_the_plan_was_costed_for_another_stack(hf_plan) -> None:
    data = hf_plan.model_dump(mode="json")
    data["estimate"]["framework"] = "torch"
    from plans.plan import Plan

    exp = export_plan(Plan.model_validate(data), "openrlhf")
    assert exp.notes[0].startswith("the plan was costed for framework torch, not for OpenRLHF")
    assert "--framework rlhf-engine-hf" in exp.notes[0]
    assert all(fw in FRAMEWORKS for stacks in STACKS.values() for fw in stacks)


def test_a_plan_for_verls_megatron_workers_runs_every_call_on_the_whole_pool() -> None:
    """verl runs every role on its one resource pool, one after another: a plan for its stack
    places no call on part of the cluster (before the rule, this PPO trained the actor on 8 GPUs
    beside the critic on the other 8, which verl's export could only list)."""
    graph = ppo("llama-2-13b", batch=512, prompt_len=1024, gen_len=1024, name="ppo_verl")
    plan = compile_graph(graph, parse_cluster("h100-sxm:2x8"), time_limit_s=5, framework="rlhf-engine")
    assert {c.mesh.size for c in plan.calls} == {16}
    for c in plan.calls:
        assert engine_layout_problems(FRAMEWORKS["rlhf-engine"], c.kind, c.layout, c.decode_layout) == []
    exp = export_plan(plan, "verl")
    assert exp.data["actor_rollout_ref"]["actor"]["strategy"] == "megatron"
    assert not any("resource pool" in x or "one layout" in x for x in exp.cannot_express), exp.cannot_express
    assert not FRAMEWORKS["rlhf-engine-hf"].layouts.whole_pool  # OpenRLHF places its groups apart


def test_validate_reports_calls_the_plans_own_stack_does_not_run(hf_plan) -> None:
    from planner.check import stack_problems
    from plans.plan import Plan

    assert stack_problems(hf_plan) == []
    data = hf_plan.model_dump(mode="json")
    for c in data["calls"]:
        if c["name"] == "actor_train":
            c["layout"].update(tp=2, dp=c["layout"]["dp"] // 2, sequence_parallel=True)
    edited = Plan.model_validate(data)
    found = stack_problems(edited)
    assert len(found) == 1 and found[0].startswith("call 'actor_train': tensor, pipeline or expert parallel")
    data["estimate"]["framework"] = "torch"  # the runtime's stack runs it
    assert stack_problems(Plan.model_validate(data)) == []


def test_verls_critic_worker_runs_its_training_and_its_values_on_one_layout() -> None:
    """verl builds one critic model per worker: a plan for its stacks gives the critic's value
    pass the tp/pp/cp of its training (this PPO's value pass had taken tp 8 x pp 8 beside
    training at dp 64, which verl's export could only list)."""
    from planner.candidates import SearchSpace
    from planner.compile import engine_rule

    graph = ppo("llama-3-70b", critic="llama-3-8b", batch=512, prompt_len=1024, gen_len=1024, name="ppo_critic")
    plan = compile_graph(graph, parse_cluster("h100-sxm:8x8"), time_limit_s=3, framework="rlhf-engine")
    train, values = plan.call("critic_train").layout, plan.call("critic_inference").layout
    assert (train.tp, train.pp, train.cp) == (values.tp, values.pp, values.cp)
    assert not any("one layout" in x for x in export_plan(plan, "verl").cannot_express)
    from planner.explain import explain_plan  # and explain offers the value pass no other degrees

    (values_choice,) = [c for c in explain_plan(plan, top=8).calls if c.call == "critic_inference"]
    assert values_choice.alternatives
    assert all(f"tp{train.tp} pp{train.pp}" in o.layout for o in values_choice.alternatives)
    from cost_models import CostModel

    cluster = parse_cluster("h100-sxm:8x8")
    rule = engine_rule(plan.graph(), CostModel(cluster, framework="verl-fsdp"), SearchSpace())
    assert rule is not None and rule.tied == frozenset({"critic"})
    hf_rule = engine_rule(plan.graph(), CostModel(cluster, framework="rlhf-engine-hf"), SearchSpace())
    assert hf_rule is not None and hf_rule.tied == frozenset({"critic"})  # OpenRLHF: the critic's engine
    assert engine_rule(plan.graph(), CostModel(cluster, framework="megatron-core"), SearchSpace()) is None


def test_the_engines_recompute_the_actors_logprobs_and_their_plans_cost_it(cli, tmp_path) -> None:
    """verl (`_compute_old_log_prob`) and OpenRLHF (the experience maker's actor forward) run the
    actor over its samples before training: `planner compile` for their stacks adds that call
    (`actor_logprobs`), costed and exported where the engine takes its micro-batch; the planner's
    runtime takes the log-probs from generation unless asked."""
    from plans.plan import load_plan

    common = ["compile", "ppo", "--actor", "llama-3-8b", "--cluster", "h100-sxm:1x8", "--batch", "128",
              "--prompt-len", "512", "--gen-len", "512", "--time-limit", "0"]
    names = {}
    for flags in (["--framework", "verl-fsdp"], ["--framework", "rlhf-engine-hf"], [],
                  ["--framework", "verl-fsdp", "--no-policy-logprobs"], ["--policy-logprobs"]):
        out = tmp_path / f"{len(names)}.json"
        r = cli(*common, *flags, "-o", str(out))
        assert r.code == 0, r.err
        names[" ".join(flags)] = load_plan(out)
    has = {k: any(c.name == "actor_logprobs" for c in p.calls) for k, p in names.items()}
    assert has == {"--framework verl-fsdp": True, "--framework rlhf-engine-hf": True, "": False,
                   "--framework verl-fsdp --no-policy-logprobs": False, "--policy-logprobs": True}
    with_lp, without = names["--framework verl-fsdp"], names["--framework verl-fsdp --no-policy-logprobs"]
    lp = with_lp.call("actor_logprobs")
    assert lp.kind == "inference" and lp.returns == "logprobs" and lp.est_time_s > 0
    assert with_lp.estimate.iteration_s > without.estimate.iteration_s
    # The actor worker's one layout, and verl's key for that forward's micro-batch.
    train = with_lp.call("actor_train").layout
    assert (lp.layout.tp, lp.layout.pp, lp.layout.cp) == (train.tp, train.pp, train.cp)
    verl = export_plan(with_lp, "verl")
    assert verl.cannot_express == []
    micro = with_lp.call("actor_logprobs").seqs // (lp.layout.dp * lp.layout.micro_batches)
    assert verl.data["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"] == micro
    assert not any("recomputes the actor's log-probs" in n for n in verl.notes)
    old = export_plan(without, "verl")  # a plan without the call says what verl does instead
    assert any("recomputes the actor's log-probs" in n and "bypass_mode" in n for n in old.notes)
    assert any("recomputes the actor's log-probs" in n for n in export_plan(names[""], "openrlhf").notes)
    hf_plan_lp = names["--framework rlhf-engine-hf"]
    hf = export_plan(hf_plan_lp, "openrlhf")
    assert hf.cannot_express == [] and not any("recomputes the actor's log-probs" in n for n in hf.notes)
    # OpenRLHF's actor group computes them on its own GPUs, with its training engine's degrees
    assert hf_plan_lp.call("actor_logprobs").mesh == hf_plan_lp.call("actor_train").mesh
    # A built-in algorithm without generation has no such switch.
    r = cli("compile", "sft", "--actor", "llama-3-8b", "--cluster", "h100-sxm:1x8", "--policy-logprobs")
    assert r.code == 2 and "generates nothing" in r.err


def test_a_graph_files_plan_for_an_engine_stack_costs_the_log_prob_pass(cli, tmp_path) -> None:
    """A graph file declares its calls; compiled for a stack that recomputes the actor's log-probs
    it gets the call the built-in algorithm would have (with_policy_logprobs), and says so: the
    same plan as `planner compile ppo` with the same models, batch and lengths."""
    from plans.plan import load_plan

    example = str(ROOT / "examples" / "ppo_llama7b.py")
    builtin = ["ppo", "--actor", "llama-2-7b", "--critic", "llama-2-7b", "--ref", "llama-2-7b", "--reward",
               "llama-2-7b", "--batch", "512", "--prompt-len", "1024", "--gen-len", "1024", "--ppo-minibatches", "4",
               "--cluster", "a100-80gb:2x8"]
    plans, outs = {}, {}
    for key, args in (("file", [example]), ("builtin", builtin), ("file off", [example, "--no-policy-logprobs"]),
                      ("file torch", [example, "--framework", "torch"])):
        out = tmp_path / f"{len(plans)}.json"
        flags = args + (["--framework", "verl-fsdp"] if "--framework" not in args else [])
        r = cli("compile", *flags, "--time-limit", "0", "-o", str(out))
        assert r.code == 0, r.err
        plans[key], outs[key] = load_plan(out), r.out
    assert "added actor_logprobs" in outs["file"] and "verl-fsdp recomputes" in outs["file"]
    assert "added" not in outs["builtin"] and "added" not in outs["file off"] and "added" not in outs["file torch"]
    file, builtin_plan = plans["file"], plans["builtin"]
    assert [c.name for c in file.calls] == [c.name for c in builtin_plan.calls]
    assert file.call("actor_train").inputs[-1] == "actor_logprobs.logprobs"
    for c in file.calls:
        b = builtin_plan.call(c.name)
        assert (c.mesh, c.layout, c.inputs, c.est_time_s) == (b.mesh, b.layout, b.inputs, b.est_time_s), c.name
    assert file.estimate.iteration_s == builtin_plan.estimate.iteration_s
    assert not any(c.name == "actor_logprobs" for p in (plans["file off"], plans["file torch"]) for c in p.calls)
    r = cli("compile", example, "--policy-logprobs", "--time-limit", "0", "-o", str(tmp_path / "x.json"))
    assert r.code == 0 and "asked for by --policy-logprobs" in r.out, r.err
    assert any(c.name == "actor_logprobs" for c in load_plan(tmp_path / "x.json").calls)
    # Nothing to recompute in an SFT graph file; a traced loop's calls are the loop's own.
    r = cli("compile", str(ROOT / "examples" / "sft_llama3_70b.py"), "--policy-logprobs", "-o", str(tmp_path / "y.json"))
    assert r.code == 2 and "no train call" in r.err and not (tmp_path / "y.json").exists()
    r = cli("compile", str(ROOT / "examples" / "train_loop_ppo.py"), "--policy-logprobs", "-o", str(tmp_path / "z.json"))
    assert r.code == 2 and "@planner.auto loop" in r.err and not (tmp_path / "z.json").exists()


def test_with_policy_logprobs_builds_what_the_algorithms_build_with_the_flag() -> None:
    """Every RL algorithm built without the pass and given it equals the one built with it, byte
    for byte; a graph that has the pass, or trains on no samples of its own, is left alone."""
    from planner.algorithms import remax, rloo, with_policy_logprobs

    common = dict(batch=32, prompt_len=64, gen_len=64)
    for build, kw in ((ppo, {}), (grpo, {"reward_fn": "math:verify"}), (rloo, {}), (remax, {})):
        plain, flagged = build("llama-2-7b", **common, **kw), build("llama-2-7b", **common, **kw, policy_logprobs=True)
        added_graph, added = with_policy_logprobs(plain)
        assert added == ["actor_logprobs"], build.__name__
        assert added_graph.model_dump_json() == flagged.model_dump_json(), build.__name__
        assert with_policy_logprobs(flagged) == (flagged, [])
    sft_graph = sft("llama-2-7b", batch=8, seq_len=128)
    assert with_policy_logprobs(sft_graph) == (sft_graph, [])


def test_verls_actor_worker_runs_its_log_probs_on_its_training_layout() -> None:
    """With the log-prob pass, verl's actor worker holds one engine for training and that
    forward: a plan for its stacks ties their degrees, while generation keeps vLLM's own."""
    from cost_models import CostModel
    from planner.candidates import SearchSpace
    from planner.compile import engine_rule

    graph = ppo("llama-3-70b", critic="llama-3-8b", batch=512, prompt_len=1024, gen_len=1024, name="ppo_lp",
                policy_logprobs=True)
    plan = compile_graph(graph, parse_cluster("h100-sxm:8x8"), time_limit_s=3, framework="rlhf-engine")
    train, lp, gen = (plan.call(n).layout for n in ("actor_train", "actor_logprobs", "actor_generate"))
    assert (train.tp, train.pp, train.cp) == (lp.tp, lp.pp, lp.cp)
    assert (gen.tp, gen.pp) != (train.tp, train.pp)  # the rollout is not tied to the worker's layout
    rule = engine_rule(plan.graph(), CostModel(plan.cluster, framework="rlhf-engine"), SearchSpace())
    assert rule is not None and rule.tied == frozenset({"actor", "critic"})
    assert not any("one layout" in x for x in export_plan(plan, "verl").cannot_express)


def test_verl_takes_a_paged_rollouts_waves_as_its_kv_budget() -> None:
    """A plan costed for verl's stacks prices the rollout's waves as the KV budget vLLM's scheduler
    runs in, which rollout.gpu_memory_utilization sets, so the export expresses it (and the rows
    vLLM runs at once, max_num_seqs); a plan costed for the planner's runtime ran static waves,
    which verl cannot."""
    graph = ppo("llama-3-8b", batch=256, prompt_len=512, gen_len=2048, name="ppo_waves", policy_logprobs=True)
    plan = compile_graph(graph, parse_cluster("h100-sxm:1x8"), time_limit_s=1, framework="verl-fsdp")
    gen = plan.call("actor_generate")
    waves = plan.model_copy(update={"calls": [c.model_copy(update={"layout": c.layout.model_copy(
        update={"micro_batches": 2})}) if c.name == gen.name else c for c in plan.calls]})
    paged = export_plan(waves, "verl")
    assert not any("waves" in x for x in paged.cannot_express)
    assert paged.data["actor_rollout_ref"]["rollout"]["max_num_seqs"] == FRAMEWORKS["verl-fsdp"].max_num_seqs
    as_runtime = waves.model_copy(update={"estimate": waves.estimate.model_copy(update={"framework": None})})
    assert any("2 waves" in x for x in export_plan(as_runtime, "verl").cannot_express)
