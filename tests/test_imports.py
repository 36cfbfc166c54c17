"""`planner import`: an engine config becomes the plan it amounts to; export then import gives back
the plan's layouts for every target wherever the export expressed them; bad configs are clear
errors. (That the engines accept the exports is `make test-engines`.)"""

from __future__ import annotations

import json
import shlex
from functools import cache

import pytest

from planner import imports
from planner.exports import export_plan
from planner.pinned import pinned_plan
from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.plan import Plan, save_plan
from tests.engines.matrix import plans as matrix_plans
from tests.observe_fixtures import filling, with_layout


@cache
def matrix() -> dict[str, Plan]:
    return matrix_plans()


def _overrides(text: str) -> list[str]:
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return [w for w in shlex.split(body.replace("\\\n", " ")) if "=" in w]


def imported(plan: Plan, target: str, call: str | None, models: dict[str, str]) -> Plan:
    exp = export_plan(plan, target, call=call)
    if target == "verl":
        got = imports.from_verl(imports.verl_config(None, _overrides(exp.text)), plan.cluster, models)
    elif target == "openrlhf":
        got = imports.from_openrlhf(imports.command_words(exp.text), plan.cluster, models)
    elif target == "megatron":
        c = next(x for x in plan.calls if x.name == call)
        got = imports.from_megatron(imports.command_words(exp.text), plan.cluster, models, world=c.mesh.size)
    else:
        c = next(x for x in plan.calls if x.name == call)
        got = imports.from_deepspeed(exp.data, plan.cluster, models, world=c.mesh.size, seq_len=c.seq_len,
                                     pp=c.layout.pp)
    return pinned_plan(got.graph, plan.cluster, got.placements, method=f"imported from {target}")


# Plans each target expresses whole (an empty cannot_express), from the engine-test matrix; the
# last three compiled for the engines' stacks, with the actor's log-probs recomputed as they do.
EXPRESSED = [("grpo_7b_z3", "openrlhf", None), ("ppo_7b_colocated_z3", "openrlhf", None),
             ("ppo_7b_verl_fsdp", "verl", None), ("ppo_7b_hf", "openrlhf", None), ("grpo_mixtral_hf", "openrlhf", None),
             ("grpo_7b_z3", "verl", None), ("grpo_7b_tp2_z1", "verl", None), ("grpo_7b_z3_offload", "verl", None),
             ("sft_70b_pp_interleave", "megatron", "model_train"), ("sft_7b_tp2_sp_z1", "megatron", "model_train"),
             ("sft_7b_z3_full", "megatron", "model_train"), ("sft_7b_dp_z1", "deepspeed", "model_train")]


@pytest.mark.parametrize(("name", "target", "call"), EXPRESSED, ids=[f"{n}-{t}" for n, t, _ in EXPRESSED])
def test_export_then_import_gives_back_the_layouts(name, target, call) -> None:  # noqa: ANN001
    plan = matrix()[name]
    exp = export_plan(plan, target, call=call)
    assert exp.cannot_express == [], exp.cannot_express
    models = {role: plan.models[m].spec.name for role, m in
              (("actor", "actor"), ("critic", "critic"), ("reward", "reward"), ("model", "model")) if m in plan.models}
    if target in ("megatron", "deepspeed"):
        models = {"model": plan.models[next(c for c in plan.calls if c.name == call).model].spec.name}
    back = imported(plan, target, call, models)
    want = {c.name: (c.mesh.size, c.layout) for c in plan.calls if call is None or c.name == call}
    got = {c.name: (c.mesh.size, c.layout) for c in back.calls}
    if call is not None:  # a one-job target imports as a training job
        (got_layout,) = got.values()
        assert got_layout == want[call]
    else:
        if "actor_logprobs" not in want:  # the engines recompute the log-probs the plan took from generation
            assert got.pop("actor_logprobs")[0] == want["actor_train"][0]
        assert got == want
    assert back.estimate.iteration_s > 0 and back.search.method == f"imported from {target}"


def test_a_partial_export_imports_as_what_the_engine_would_run() -> None:
    """Where the export differs from the plan (its cannot_express), the import is the engine's
    layout: the ZeRO stage verl's FSDP workers use, not the plan's."""
    base = matrix()["ppo_7b"]
    plan = with_layout(base, "actor_train", filling(base, "actor_train", tp=2, zero=2, micro_batches=4,
                                                    sequence_parallel=True))
    exp = export_plan(plan, "verl")
    assert any("ZeRO-2" in x for x in exp.cannot_express)
    back = imported(plan, "verl", None, {"actor": "llama-2-7b", "critic": "llama-2-7b", "reward": "llama-2-7b"})
    assert {c.layout.zero for c in back.calls if c.kind == "train"} <= {1, 3}


def test_import_cli_costs_a_verl_config_from_its_defaults(cli, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "mine.json"
    r = cli("import", "--from", "verl", "-", "actor_rollout_ref.model.path=llama-2-7b", "critic.model.path=llama-2-7b",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "algorithm.use_kl_in_reward=True",
            "--cluster", "a100-80gb:1x8", "-o", str(out))
    assert r.code == 0, r.err
    plan = json.loads(out.read_text())
    # Costed for verl's own stack, not the runtime: its default FSDP workers train HF models.
    assert plan["estimate"]["framework"] == "verl-fsdp"
    calls = {c["name"]: c for c in plan["calls"]}
    # verl 0.9.1 defaults: 1024 prompts, mini-batches of 256, rollout tp 2, FSDP (ZeRO-3) on 8 GPUs.
    assert calls["actor_generate"]["seqs"] == 1024 and calls["actor_train"]["minibatches"] == 4
    assert calls["actor_generate"]["layout"]["tp"] == 2 and calls["actor_train"]["layout"]["zero"] == 3
    assert calls["actor_train"]["layout"]["recompute"] == "full"  # verl checkpoints gradients by default
    r = cli("validate", str(out))
    assert r.code == 0, r.out + r.err
    other = tmp_path / "plan.json"
    save_plan(matrix()["ppo_7b"], other)
    r = cli("compare", str(out), str(other), "--json")
    assert r.code == 0 and len(json.loads(r.out)) == 2


@pytest.mark.parametrize(("argv", "message"), [
    (["--from", "openrlhf", "--actor_num_nodes 1 --vllm_num_engines 2"], "OpenRLHF 0.11 has no flags --actor_num_nodes"),
    (["--from", "openrlhf", "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --rollout.max_new_tokens 512 "
      "--actor.model_name_or_path llama-2-7b --reward.model_name_or_path llama-2-7b"], "ask Ray for 40 GPUs"),
    (["--from", "verl", "-", "actor_rollout_ref.model.path=meta-llama/Llama-2-7b-hf"], "--model actor="),
    (["--from", "verl", "-", "actor_rollout_ref.model.path=llama-2-7b", "critic.model.path=llama-2-7b"],
     "does not set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    (["--from", "megatron", "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --vocab-size 32000 "
      "--seq-length 4096 --tensor-model-parallel-size 3"], "does not split evenly"),
    (["--from", "deepspeed", "MISSING.json"], "cannot read DeepSpeed config"),
])
def test_import_errors_say_what_is_wrong(cli, argv, message) -> None:  # noqa: ANN001
    r = cli("import", *argv, "--cluster", "a100-80gb:2x8")
    assert r.code == 2 and message in r.err, r.err


def test_importers_read_engine_defaults_not_guesses() -> None:
    cluster = parse_cluster("h100-sxm:1x8")
    got = imports.from_openrlhf(imports.command_words(
        "python3 -m openrlhf.cli.train_ppo_ray --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all "
        "--actor.model_name_or_path llama-3-8b --reward.model_name_or_path llama-3-8b --rollout.max_new_tokens 1024"),
        cluster, {})
    gen = got.placements["actor_generate"][1]
    train = got.placements["actor_train"][1]
    # OpenRLHF 0.11.2 defaults: ZeRO-2, --train.batch_size 128 of --rollout.batch_size 1024, micro-batch 1.
    assert (gen.dp, gen.tp) == (4, 2) and train.zero == 2 and train.micro_batches == 128 // 8
    assert got.graph.call("actor_train").minibatches == 1024 // 128
    with pytest.raises(PlannerError, match="colocate_all with 4 engines x tp 2 on 16"):
        imports.from_openrlhf(imports.command_words(
            "--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --actor.num_nodes 2 "
            "--actor.model_name_or_path llama-3-8b --reward.model_name_or_path llama-3-8b"), parse_cluster("h100-sxm:2x8"), {})


def test_openrlhf_offload_flags_import_as_states_in_host_memory() -> None:
    flags = ("--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --actor.model_name_or_path "
             "llama-3-8b --reward.model_name_or_path llama-3-8b --rollout.max_new_tokens 1024")
    plain = imports.from_openrlhf(imports.command_words(flags), parse_cluster("h100-sxm:1x8"), {})
    assert {p[1].offload for p in plain.placements.values()} == {"none"}
    got = imports.from_openrlhf(imports.command_words(flags + " --ref.offload --reward.offload --ds.adam_offload"),
                                parse_cluster("h100-sxm:1x8"), {})
    offload = {name: p[1].offload for name, p in got.placements.items()}
    assert offload["ref_inference"] == offload["reward_inference"] == "weights"
    assert offload["actor_train"] == offload["critic_train"] == "optimizer"
    assert offload["actor_generate"] == offload["critic_inference"] == "none"
    assert any("--ds.adam_offload" in n and "CPU" in n for n in got.notes)


def test_imports_are_costed_for_the_layers_their_engine_trains() -> None:
    """OpenRLHF (DeepSpeed) and verl's FSDP workers train HF transformers models, whose eager layers
    keep more for backward than Megatron's fused ones (`rlhf-engine-hf`); verl's Megatron workers
    do not (`rlhf-engine`). Without gradient checkpointing (OpenRLHF's default) an 8B actor's
    activations are costed as HF keeps them, and a checkpointed one keeps each layer's input alone."""
    from cost_models import CostModel

    assert imports.FRAMEWORK_OF["openrlhf"] == "rlhf-engine-hf"
    fsdp = base = matrix()["ppo_7b"]
    for name in ("actor_train", "critic_train"):  # verl's FSDP workers: no tensor parallelism anywhere
        fsdp = with_layout(fsdp, name, filling(base, name, zero=3, micro_batches=4))
    fsdp = with_layout(fsdp, "critic_inference", filling(base, "critic_inference", micro_batches=4))
    megatron = with_layout(base, "actor_train", filling(base, "actor_train", tp=2, zero=1, micro_batches=4,
                                                        sequence_parallel=True))
    models = {"actor": "llama-2-7b", "critic": "llama-2-7b", "reward": "llama-2-7b"}
    for plan, want in ((fsdp, "verl-fsdp"), (megatron, "rlhf-engine")):
        exp = export_plan(plan, "verl")
        got = imports.from_verl(imports.verl_config(None, _overrides(exp.text)), plan.cluster, models)
        assert got.framework == want, exp.text[:300]

    cluster = parse_cluster("h100-sxm:1x8")
    flags = ("--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --actor.model_name_or_path "
             "llama-3-8b --reward.model_name_or_path llama-3-8b --rollout.max_new_tokens 1024 --ds.zero_stage 3")
    acts = {}
    for extra in ("", " --actor.gradient_checkpointing_enable"):
        got = imports.from_openrlhf(imports.command_words(flags + extra), cluster, {})
        mesh, layout, _ = got.placements["actor_train"]
        call, decl = got.graph.call("actor_train"), got.graph.models["actor"]
        for fw in ("rlhf-engine", "rlhf-engine-hf"):
            mem = CostModel(cluster, framework=fw).call_cost(call, decl, mesh, layout).mem_breakdown_bytes
            acts[extra != "", fw] = mem["activations"]
    assert acts[False, "rlhf-engine-hf"] > 1.3 * acts[False, "rlhf-engine"]  # 8B at 8k tokens: 1.6 GB a layer, fused 1.1
    assert acts[True, "rlhf-engine-hf"] < acts[False, "rlhf-engine"] / 5  # checkpointed: the layers' bf16 inputs


def test_import_cli_takes_engine_flags_unquoted_and_says_when_a_config_does_not_fit(cli, tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "o.json"
    r = cli("import", "--from", "openrlhf", "--vllm.num_engines", "4", "--vllm.tensor_parallel_size", "2",
            "--train.colocate_all", "--actor.model_name_or_path", "llama-3-8b", "--reward.model_name_or_path",
            "llama-3-8b", "--rollout.max_new_tokens", "1024", "--cluster", "h100-sxm:1x8", "-o", str(out))
    assert r.code == 0, r.err
    # OpenRLHF's default ZeRO-2 with four 8B models on each GPU: the cost model finds it does not fit.
    assert "exceeds GPU memory" in r.out
    assert json.loads(out.read_text())["search"]["status"] == "exceeds GPU memory"


@pytest.mark.parametrize("name", ["sft_llama31", "sft_mistral"])
def test_megatron_flags_carry_rope_scaling_and_the_window_back(name) -> None:  # noqa: ANN001
    """The model read back from an export's flags alone (no --model) has the plan's RoPE scaling and window."""
    from plans.model import resolve_model

    plan = matrix()[name]
    exp = export_plan(plan, "megatron", call="model_train")
    spec = resolve_model(imports._megatron_spec(imports.flag_values(imports.command_words(exp.text))))
    want = plan.models["model"].spec
    assert (spec.rope_scaling, spec.sliding_window, spec.rope_theta) == (want.rope_scaling, want.sliding_window,
                                                                         want.rope_theta)
    assert spec.num_params() == want.num_params()


@pytest.mark.parametrize(("window", "message"), [("4095,1", "only causal windows"), ("x", "is not two integers")])
def test_megatron_windows_that_are_not_causal_are_refused(window: str, message: str) -> None:
    flags = {"num-layers": "2", "hidden-size": "64", "num-attention-heads": "4", "vocab-size": "128",
             "normalization": "RMSNorm", "swiglu": True, "window-size": window}
    with pytest.raises(PlannerError, match=message):
        imports._megatron_spec(flags)


def test_megatron_imports_say_where_the_command_runs_unlike_its_costing() -> None:
    """A Megatron-LM command is costed with the megatron-core stack (gradient reduction overlapped,
    fp32 gradients, weight gather and tp collectives not overlapped); where its flags say
    otherwise, the import says which way the job differs. The export's own command has no note:
    it sets --overlap-grad-reduce."""
    from plans.cluster import parse_cluster

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "128",
            "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
    cluster = parse_cluster("a100-80gb:1x8")
    got = imports.from_megatron(base, cluster, {}, world=8)
    assert len(got.notes) == 1 and "--overlap-grad-reduce is not set" in got.notes[0]
    got = imports.from_megatron(base + ["--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
                                        "--grad-reduce-in-bf16"], cluster, {}, world=8)
    assert [n.split(":")[0] for n in got.notes] == ["--grad-reduce-in-bf16", "--overlap-param-gather",
                                                  "--tp-comm-overlap"]
    assert imports.from_megatron(base, cluster, {}, world=2).notes == []  # tp 2 on 2 GPUs: no data parallel
    # Megatron-LM fuses the weight-gradient accumulation by default, as megatron-core prices it.
    got = imports.from_megatron(base + ["--no-gradient-accumulation-fusion"], cluster, {}, world=2)
    assert len(got.notes) == 1 and "slower than costed" in got.notes[0]
    assert got.notes[0].startswith("--no-gradient-accumulation-fusion")
    # Megatron's loss is unfused unless told, as megatron-core prices it.
    got = imports.from_megatron(base + ["--cross-entropy-loss-fusion"], cluster, {}, world=2)
    assert len(got.notes) == 1 and got.notes[0].startswith("--cross-entropy-loss-fusion")
    assert "faster than costed" in got.notes[0]
    plan = matrix()["sft_mistral"]  # dp 2
    exp = export_plan(plan, "megatron", call="model_train")
    c = next(x for x in plan.calls if x.name == "model_train")
    assert c.layout.dp > 1 and "--overlap-grad-reduce" in exp.text
    words = imports.command_words(exp.text)
    assert not any("overlap-grad-reduce" in n for n in imports.from_megatron(
        words, plan.cluster, {}, world=c.mesh.size).notes)


def test_an_moe_rollout_splits_its_experts_over_vllm_tensor_parallelism() -> None:
    """vLLM's tensor parallelism shards every expert as it shards the dense MLP (unless
    --enable-expert-parallel), so an imported MoE rollout holds 1/tp of each expert per GPU, not
    every expert whole: the rollout's weights fit where whole experts would not."""
    flags = ("--vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --actor.model_name_or_path "
             "qwen3-30b-a3b --reward.model_name_or_path qwen3-30b-a3b --rollout.max_new_tokens 1024 "
             "--ds.zero_stage 3 --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 4")
    got = imports.from_openrlhf(imports.command_words(flags), parse_cluster("h100-sxm:1x8"), {})
    gen = got.placements["actor_generate"][1]
    assert (gen.tp, gen.etp, gen.ep) == (2, 2, 1)
    assert not any("not even one sequence" in n for n in got.notes)
    dense = imports.from_openrlhf(imports.command_words(flags.replace("qwen3-30b-a3b", "llama-3-8b")),
                                  parse_cluster("h100-sxm:1x8"), {})
    assert dense.placements["actor_generate"][1].etp == 1


def test_deepspeed_imports_say_when_the_reduction_runs_after_the_backward() -> None:
    """`megatron-core` prices the gradient reduction under the backward. DeepSpeed overlaps it only
    at ZeRO-3 unless `overlap_comm` is set, and never without ZeRO: the import says so; the
    export sets `overlap_comm` at ZeRO-1/2, so its own config has no such note."""
    from plans.cluster import parse_cluster

    cluster = parse_cluster("a100-80gb:1x8")
    models = {"model": "llama-2-7b"}

    def notes(zero_optimization: dict) -> list[str]:
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
               "zero_optimization": zero_optimization}
        got = imports.from_deepspeed(cfg, cluster, models, world=8, seq_len=1024, pp=1)
        return [n for n in got.notes if "gradient reduction" in n]

    assert len(notes({"stage": 1})) == 1 and "overlap_comm" in notes({"stage": 2})[0]
    assert "without ZeRO" in notes({"stage": 0})[0]
    assert notes({"stage": 1, "overlap_comm": True}) == [] and notes({"stage": 3}) == []
    plan = matrix()["sft_7b_dp_z1"]
    exp = export_plan(plan, "deepspeed", call="model_train")
    c = next(x for x in plan.calls if x.name == "model_train")
    got = imports.from_deepspeed(exp.data, plan.cluster, {"model": "llama-2-7b"}, world=c.mesh.size,
                                 seq_len=c.seq_len, pp=c.layout.pp)
    assert not any("gradient reduction" in n for n in got.notes)
    # megatron-core's weight-gradient GEMMs accumulate themselves; DeepSpeed's do not. The import
    # says so, and so does the export of a plan costed for megatron-core (not one for the runtime).
    assert any("kernels of their own" in n for n in got.notes)
    assert not any("kernels of their own" in n for n in exp.notes)
    core = plan.model_copy(update={"estimate": plan.estimate.model_copy(update={"framework": "megatron-core"})})
    assert any("kernels of their own" in n for n in export_plan(core, "deepspeed", call="model_train").notes)


def test_a_verl_config_without_the_log_prob_micro_batch_costs_the_pass_at_the_training_one() -> None:
    """verl sizes its old-log-prob pass by rollout.log_prob_micro_batch_size_per_gpu (required
    unless batches are sized by tokens); without it the import takes the actor's training
    micro-batch and says so; with bypass_mode there is no pass."""
    base = ["data.train_batch_size=64", "actor_rollout_ref.model.path=llama-2-7b", "critic.model.path=llama-2-7b",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
    cluster = parse_cluster("a100-80gb:1x8")
    got = imports.from_verl(imports.verl_config(None, base), cluster, {})
    lp = got.placements["actor_logprobs"][1]
    assert 64 // (lp.dp * lp.micro_batches) == 2
    assert any("log_prob_micro_batch_size_per_gpu is not set" in n for n in got.notes)
    got = imports.from_verl(imports.verl_config(None, base + ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]),
                            cluster, {})
    lp = got.placements["actor_logprobs"][1]
    assert 64 // (lp.dp * lp.micro_batches) == 4 and not any("is not set" in n for n in got.notes)
    got = imports.from_verl(imports.verl_config(None, base + ["algorithm.rollout_correction.bypass_mode=true"]), cluster, {})
    assert "actor_logprobs" not in got.placements and all(c.name != "actor_logprobs" for c in got.graph.calls)
    assert any("bypass_mode" in n for n in got.notes)


def test_a_vllm_rollout_imports_as_the_kv_budget_its_scheduler_runs_in() -> None:
    """An engine's rows beyond max_num_seqs wait in vLLM's scheduler, not in waves of their own:
    a rollout whose every row fits gpu_memory_utilization at the cap is one budget even with more
    rows than max_num_seqs; a config whose max_num_seqs is not the costed one says so."""
    base = ["data.train_batch_size=2048", "actor_rollout_ref.model.path=llama-2-7b", "critic.model.path=llama-2-7b",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=8", "data.max_prompt_length=64",
            "data.max_response_length=64"]
    cluster = parse_cluster("h100-sxm:1x8")
    got = imports.from_verl(imports.verl_config(None, base), cluster, {})
    gen = got.placements["actor_generate"][1]
    assert gen.dp == 1 and gen.micro_batches == 1  # 2,048 rows on one engine, one budget: no waves of 256
    assert not any("max_num_seqs" in n for n in got.notes)
    got = imports.from_verl(imports.verl_config(None, base + ["actor_rollout_ref.rollout.max_num_seqs=1024"]), cluster, {})
    assert any("max_num_seqs" in n and "1024" in n for n in got.notes)
