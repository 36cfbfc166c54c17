"""Exports to Megatron-LM, DeepSpeed, verl and OpenRLHF against each target's documented names.

The name lists below are copied from the targets' own sources (path and commit given with each);
a test fails when an export emits a name that is not in them, so a misspelt flag or key cannot
pass. Commands are parsed with an argparse parser built from the same lists, which also checks
that switches take no value and options take one from their documented choices.
"""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from planner.exports import export_plan
from plans.errors import PlannerError
from plans.layout import Layout
from tests.observe_fixtures import ppo_7b, sft_70b, tiny_ppo, tiny_ppo_rm, with_layout, with_placement

# NVIDIA/Megatron-LM megatron/training/arguments.py @ 000c4ac24f61159c138b0975def722c65245983c
# (name -> None for store_true switches, a tuple of choices, or the type).
MEGATRON_FLAGS: dict[str, object] = {
    "--num-layers": int, "--hidden-size": int, "--ffn-hidden-size": int, "--num-attention-heads": int,
    "--group-query-attention": None, "--num-query-groups": int, "--seq-length": int,
    "--max-position-embeddings": int, "--vocab-size": int, "--normalization": ("LayerNorm", "RMSNorm"),
    "--norm-epsilon": float, "--swiglu": None,
    "--position-embedding-type": ("learned_absolute", "rope", "mrope", "relative", "none"),
    "--rotary-base": int, "--disable-bias-linear": None, "--add-qkv-bias": None,
    "--untie-embeddings-and-output-weights": None, "--tensor-model-parallel-size": int,
    "--pipeline-model-parallel-size": int, "--context-parallel-size": int, "--sequence-parallel": None,
    "--num-layers-per-virtual-pipeline-stage": int, "--num-virtual-stages-per-pipeline-rank": int,
    "--decoder-first-pipeline-num-layers": int, "--decoder-last-pipeline-num-layers": int,
    "--micro-batch-size": int, "--global-batch-size": int, "--use-distributed-optimizer": None,
    "--use-megatron-fsdp": None,
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "--recompute-granularity": ("full", "selective"), "--recompute-method": ("uniform", "block"),
    "--recompute-num-layers": int, "--bf16": None, "--fp16": None, "--lr": float, "--overlap-grad-reduce": None,
}

# deepspeedai/DeepSpeed docs/_pages/config-json.md @ 00376da49967bc6a15d70a550200ac67277b1fb4 (key paths;
# optimizer.params are the torch optimizer's constructor arguments).
DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer.type",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.type", "fp16.enabled", "bf16.enabled", "gradient_clipping", "zero_optimization.stage",
    "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients", "zero_optimization.reduce_scatter",
    "tensor_parallel.autotp_size", "tensor_parallel.preset_model", "activation_checkpointing.partition_activations",
    "steps_per_print", "wall_clock_breakdown",
}

# volcengine/verl verl/trainer/config/ppo_trainer.yaml @ 008db456bf612da5543c9bb6e26fe654029ad5b8,
# ppo_megatron_trainer.yaml @ 028af31be124b2a8d6d9c3b9ddd9cbdd64a281df (the megatron.* blocks), and
# verl/trainer/main_ppo.py @ 006cebf8572873571fd28541de4f12124174b8ed (reward_model resource pool).
_MEGATRON_BLOCK = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                   "context_parallel_size", "sequence_parallel", "use_distributed_optimizer", "param_offload")
VERL_KEYS = {
    "data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
    "actor_rollout_ref.hybrid_engine", "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing",
    "actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size", "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "actor_rollout_ref.ref.fsdp_config.param_offload",
    "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "critic.strategy", "critic.ppo_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu",
    "critic.ulysses_sequence_parallel_size", "critic.cliprange_value", "critic.optim.lr",
    "critic.model.enable_gradient_checkpointing",
    "reward_model.enable", "reward_model.strategy", "reward_model.micro_batch_size_per_gpu",
    "reward_model.enable_resource_pool", "reward_model.n_gpus_per_node", "reward_model.nnodes",
    "custom_reward_function.path", "custom_reward_function.name",
    "algorithm.adv_estimator", "algorithm.gamma", "algorithm.lam", "algorithm.use_kl_in_reward",
    "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef",
    "trainer.nnodes", "trainer.n_gpus_per_node",
} | {f"{role}.megatron.{k}" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")
     for k in _MEGATRON_BLOCK}
# verl/trainer/ppo/core_algos.py AdvantageEstimator values; strategies from the yaml comments.
VERL_CHOICES = {"algorithm.adv_estimator": {"gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                            "remax", "rloo", "opo", "grpo_passk", "gpg"},
                "actor_rollout_ref.actor.strategy": {"fsdp", "fsdp2", "megatron"},
                "critic.strategy": {"fsdp", "fsdp2", "megatron"}, "actor_rollout_ref.rollout.name": {"vllm", "sglang"}}

# OpenRLHF/OpenRLHF openrlhf/cli/train_ppo_ray.py @ 021d1b09641902f7f06dc42331c75b37793ca950
OPENRLHF_FLAGS: dict[str, object] = {
    "--ref_num_nodes": int, "--ref_num_gpus_per_node": int, "--reward_num_nodes": int,
    "--reward_num_gpus_per_node": int, "--colocate_actor_ref": None, "--actor_num_nodes": int,
    "--actor_num_gpus_per_node": int, "--critic_num_nodes": int, "--critic_num_gpus_per_node": int,
    "--colocate_critic_reward": None, "--colocate_all_models": None, "--vllm_num_engines": int,
    "--vllm_tensor_parallel_size": int, "--vllm_gpu_memory_utilization": float, "--zero_stage": int,
    "--gradient_checkpointing": None, "--bf16": None, "--ds_tensor_parallel_size": int, "--packing_samples": None,
    "--rollout_batch_size": int, "--micro_rollout_batch_size": int, "--max_epochs": int, "--prompt_max_len": int,
    "--generate_max_len": int, "--eps_clip": float, "--value_clip": float, "--lambd": float, "--gamma": float,
    "--micro_train_batch_size": int, "--train_batch_size": int, "--temperature": float,
    "--n_samples_per_prompt": int, "--actor_learning_rate": float, "--critic_learning_rate": float,
    "--init_kl_coef": float, "--kl_estimator": ("k1", "k2", "k3"),
    "--advantage_estimator": ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo"),
    "--use_kl_loss": None, "--ring_attn_size": int, "--pretrain": str, "--remote_rm_url": str,
}


def _parser(flags: dict[str, object]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for name, kind in flags.items():
        if kind is None:
            p.add_argument(name, action="store_true")
        elif isinstance(kind, tuple):
            p.add_argument(name, choices=kind)
        else:
            p.add_argument(name, type=kind)
    return p


def _argv(command: str, program: str) -> list[str]:
    words = shlex.split(command.replace("\\\n", " "))
    prog = shlex.split(program)
    assert words[:len(prog)] == prog
    return words[len(prog):]


def _commands(text: str) -> list[str]:
    """Shell commands of an export's text (comment lines dropped, one command per blank-line block)."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return [block.strip() for block in body.split("\n\n") if block.strip()]


def _paths(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in tree.items():
        out |= _paths(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
    return out


def _sft_with(layout: Layout):  # noqa: ANN202
    return lambda: with_layout(sft_70b(), "model_train", layout)


# Plans covering each export branch, built when a test asks (compiles are cached per session).
VARIANTS = {
    "sft_70b": sft_70b,
    "sft_pp_interleave_full": _sft_with(Layout(dp=4, tp=8, pp=2, interleave=5, zero=1, micro_batches=128,
                                               recompute="full", sequence_parallel=True)),
    "sft_cp_selective_z2": _sft_with(Layout(dp=8, tp=4, cp=2, zero=2, micro_batches=64, recompute="selective",
                                            sequence_parallel=True)),
    "sft_uneven_pp": _sft_with(Layout(tp=2, pp=32, micro_batches=64, sequence_parallel=True)),  # 80 layers / 32
    "ppo_7b": ppo_7b,
    "tiny_ppo": tiny_ppo,
    "tiny_ppo_rm": tiny_ppo_rm,
    "tiny_ppo_rm_pools": lambda: with_placement(tiny_ppo_rm(), {
        "reward_inference": (4, Layout(dp=4)), "ref_inference": (2, Layout(dp=2)), "critic_inference": (1, Layout())}),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_megatron_flags_are_documented(name) -> None:  # noqa: ANN001
    plan = VARIANTS[name]()
    exp = export_plan(plan, "megatron")
    parser = _parser(MEGATRON_FLAGS)
    commands = _commands(exp.text)
    trains = [c for c in plan.calls if c.kind == "train"]
    assert len(commands) == len(trains) == len(exp.data["jobs"])
    for cmd, call in zip(commands, trains):
        args = parser.parse_args(_argv(cmd, "torchrun $DISTRIBUTED_ARGS pretrain_gpt.py"))
        lay = call.layout
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size) == \
            (lay.tp, lay.pp, lay.cp)
        dp = lay.dp
        assert args.global_batch_size == call.seqs // call.minibatches
        assert args.micro_batch_size * dp * lay.micro_batches == args.global_batch_size
        assert args.sequence_parallel == lay.sequence_parallel
        assert args.use_distributed_optimizer == (lay.zero in (1, 2)) and args.use_megatron_fsdp == (lay.zero == 3)
        assert args.recompute_granularity == {"none": None, "full": "full", "selective": "selective"}[lay.recompute]
        spec = plan.models[call.model].spec
        assert (args.num_layers, args.hidden_size, args.num_attention_heads) == \
            (spec.num_hidden_layers, spec.hidden_size, spec.num_attention_heads)
        if lay.interleave > 1:
            assert args.num_layers_per_virtual_pipeline_stage * lay.pp * lay.interleave == spec.num_hidden_layers


def test_megatron_states_what_it_cannot_express() -> None:
    exp = export_plan(VARIANTS["sft_uneven_pp"](), "megatron")  # stages of 2 and 3 layers
    assert any("pipeline stages of [2, 3, 3," in x for x in exp.cannot_express)
    assert not export_plan(sft_70b(), "megatron").cannot_express
    exp = export_plan(ppo_7b(), "megatron")
    assert any("generate/inference" in x for x in exp.cannot_express)
    assert any("ppo_value" in x for x in exp.cannot_express)
    for x in exp.cannot_express:
        assert f"#   - {x}" in exp.text  # the output itself says it
    with pytest.raises(PlannerError, match="no train call 'nope'"):
        export_plan(ppo_7b(), "megatron", call="nope")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deepspeed_keys_are_documented(name) -> None:  # noqa: ANN001
    plan = VARIANTS[name]()
    trains = [c for c in plan.calls if c.kind == "train"]
    for call in trains:
        exp = export_plan(plan, "deepspeed", call=call.name)
        cfg = json.loads(exp.text)
        assert cfg == exp.data and _paths(cfg) <= DEEPSPEED_KEYS, _paths(cfg) - DEEPSPEED_KEYS
        lay = call.layout
        assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * \
            cfg["gradient_accumulation_steps"] * lay.dp
        assert cfg["zero_optimization"]["stage"] == lay.zero
        assert cfg.get("tensor_parallel", {}).get("autotp_size", 1) == lay.tp
        if lay.pp > 1:
            assert any("PipelineModule" in x for x in exp.cannot_express)
        if lay.recompute != "none":
            assert any("gradient checkpointing" in x for x in exp.cannot_express)
    if len(trains) > 1:
        with pytest.raises(PlannerError, match="pick one with --call"):
            export_plan(plan, "deepspeed")


@pytest.mark.parametrize("name", ["ppo_7b", "tiny_ppo", "tiny_ppo_rm", "tiny_ppo_rm_pools"])
def test_verl_keys_are_documented(name) -> None:  # noqa: ANN001
    plan = VARIANTS[name]()
    exp = export_plan(plan, "verl")
    (cmd,) = _commands(exp.text)
    overrides = dict(w.split("=", 1) for w in _argv(cmd, "python3 -m verl.trainer.main_ppo"))
    assert set(overrides) <= VERL_KEYS, set(overrides) - VERL_KEYS
    assert _paths(exp.data) == set(overrides)
    for key, allowed in VERL_CHOICES.items():
        if key in overrides:
            assert overrides[key] in allowed
    gen = next(c for c in plan.calls if c.kind == "generate")
    assert int(overrides["actor_rollout_ref.rollout.tensor_model_parallel_size"]) == gen.layout.tp
    assert int(overrides["data.train_batch_size"]) == gen.seqs // gen.samples_per_prompt
    assert int(overrides["trainer.nnodes"]) * int(overrides["trainer.n_gpus_per_node"]) + \
        int(overrides.get("reward_model.nnodes", 0)) * int(overrides.get("reward_model.n_gpus_per_node", 0)) \
        == plan.cluster.world_size


def test_verl_states_per_role_placements() -> None:
    exp = export_plan(tiny_ppo(), "verl")  # ref on [2-3], critic train on [1], actor on [0]
    assert any("ref_inference runs on GPUs [2-3] only" in x for x in exp.cannot_express)
    assert any("ZeRO-0" in x for x in exp.cannot_express)  # FSDP shards everything
    rm = export_plan(tiny_ppo_rm(), "verl")  # the reward model alone on GPU 4, but 7 GPUs left are not whole nodes
    assert "enable_resource_pool" not in rm.data["reward_model"]
    assert any("reward_inference runs on GPUs [4] only" in x for x in rm.cannot_express)
    pool = export_plan(VARIANTS["tiny_ppo_rm_pools"](), "verl")  # everything on node 0, the reward model on node 1
    assert pool.data["reward_model"] | pool.data["trainer"] == {
        "enable": True, "strategy": "fsdp", "micro_batch_size_per_gpu": 4, "enable_resource_pool": True,
        "nnodes": 1, "n_gpus_per_node": 4}
    assert not any("runs on GPUs" in x for x in pool.cannot_express if "reward" in x)
    with pytest.raises(PlannerError, match="no generate call"):
        export_plan(sft_70b(), "verl")


@pytest.mark.parametrize("name", ["ppo_7b", "tiny_ppo", "tiny_ppo_rm", "tiny_ppo_rm_pools"])
def test_openrlhf_flags_are_documented(name) -> None:  # noqa: ANN001
    plan = VARIANTS[name]()
    exp = export_plan(plan, "openrlhf")
    (cmd,) = _commands(exp.text)
    args = _parser(OPENRLHF_FLAGS).parse_args(_argv(cmd, "python3 -m openrlhf.cli.train_ppo_ray"))
    gen = next(c for c in plan.calls if c.kind == "generate")
    train = next(c for c in plan.calls if c.kind == "train" and c.model == gen.model)
    assert args.vllm_num_engines * args.vllm_tensor_parallel_size == gen.mesh.size
    assert args.actor_num_nodes * args.actor_num_gpus_per_node == train.mesh.size
    assert args.zero_stage == train.layout.zero
    assert args.train_batch_size == train.seqs // train.minibatches
    assert args.rollout_batch_size * args.n_samples_per_prompt == gen.seqs
    assert args.colocate_all_models == (len({c.mesh for c in plan.calls}) == 1)


def test_openrlhf_states_what_it_cannot_express() -> None:
    exp = export_plan(tiny_ppo(), "openrlhf")
    assert any("GPU placement of each role" in x for x in exp.cannot_express)
    pp = with_layout(ppo_7b(), "critic_train", Layout(dp=2, pp=4, zero=1, micro_batches=8))  # on 8 GPUs
    exp = export_plan(pp, "openrlhf")
    assert any("critic_train: pipeline parallel pp=4" in x for x in exp.cannot_express)
    assert any("one ZeRO stage for every model" in x for x in exp.cannot_express)


def test_export_cli(cli, tmp_path) -> None:  # noqa: ANN001
    from plans.plan import save_plan

    path = tmp_path / "sft.json"
    save_plan(sft_70b(), path)
    r = cli("export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "ds.json"))
    assert r.code == 0, r.err
    stage = json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]["stage"]
    assert stage == sft_70b().calls[0].layout.zero
    r = cli("export", str(path), "--to", "megatron", "--json")
    data = json.loads(r.out)
    assert r.code == 0 and set(data) == {"target", "settings", "cannot_express", "notes", "source"}
    save_plan(ppo_7b(), tmp_path / "ppo.json")
    r = cli("export", str(tmp_path / "ppo.json"), "--to", "verl")
    assert r.code == 0 and r.out.startswith("# exported by `planner export --to verl`")
    r = cli("export", str(tmp_path / "ppo.json"), "--to", "deepspeed")
    assert r.code == 2 and "pick one with --call" in r.err
    r = cli("export", str(tmp_path / "ppo.json"), "--to", "deepspeed", "--call", "actor_train")
    assert r.code == 0 and json.loads(r.out)["zero_optimization"] and "cannot express" in r.err
