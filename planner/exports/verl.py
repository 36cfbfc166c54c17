"""verl PPO trainer settings (Hydra overrides of ``verl.trainer.main_ppo``) for an RLHF plan.

Key names are those of verl's ``verl/trainer/config/ppo_trainer.yaml`` (FSDP workers, read at
commit 008db456bf612da5543c9bb6e26fe654029ad5b8) and ``ppo_megatron_trainer.yaml`` (Megatron
workers, commit 028af31be124b2a8d6d9c3b9ddd9cbdd64a281df); the reward model's own resource pool
(``reward_model.enable_resource_pool``, ``.n_gpus_per_node``, ``.nnodes``) is read by
``verl/trainer/main_ppo.py`` (commit 006cebf8572873571fd28541de4f12124174b8ed), and advantage
estimator names by ``verl/trainer/ppo/core_algos.py`` (``AdvantageEstimator``).

verl runs actor, rollout, reference and critic as workers of one resource pool (every GPU of
``trainer.nnodes x trainer.n_gpus_per_node``), one role after another; a worker keeps one parallel
layout for all its calls; the rollout (vLLM) has its own tensor-parallel size.
"""

from __future__ import annotations

from typing import Any

from planner.exports.common import (
    Export,
    Roles,
    comment_block,
    common_limits,
    decode_layout,
    micro_batch_per_gpu,
    nodes_and_gpus,
    optimizer_batch,
    prompts,
    role_calls,
    roles,
)
from plans.layout import Layout, Mesh
from plans.plan import Plan

SOURCE = "volcengine/verl verl/trainer/config/ppo_trainer.yaml, ppo_megatron_trainer.yaml, verl/trainer/main_ppo.py"
PROGRAM = "python3 -m verl.trainer.main_ppo"
ESTIMATOR = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo", "remax": "remax"}


def _megatron(lay: Layout) -> dict[str, Any]:
    return {"tensor_model_parallel_size": lay.tp, "pipeline_model_parallel_size": lay.pp,
            "virtual_pipeline_model_parallel_size": lay.interleave if lay.interleave > 1 else None,
            "context_parallel_size": lay.cp, "sequence_parallel": lay.sequence_parallel}


def _flatten(prefix: str, tree: dict[str, Any], out: list[tuple[str, Any]]) -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _flatten(f"{prefix}{k}.", v, out)
        else:
            out.append((f"{prefix}{k}", v))


def _layout_limits(r: Roles, strategy: str) -> list[str]:
    """Per-role layouts verl cannot give: a role's calls with different degrees, pipelined or
    micro-batched generation, and ZeRO stages other than FSDP's full sharding."""
    out = []
    for role, calls in (("actor", [r.actor_train]), ("critic", [r.critic_train, r.critic_inference])):
        calls = [c for c in calls if c is not None]
        degrees = {(c.layout.tp, c.layout.pp, c.layout.cp) for c in calls}
        if len(degrees) > 1:
            out.append(f"the {role} worker keeps one layout, but the plan runs " +
                       ", ".join(f"{c.name} with {c.layout.short()}" for c in calls))
    gen = r.generate
    dec = decode_layout(gen)
    if gen.layout.pp > 1 or dec.pp > 1:
        out.append(f"{gen.name}: pipeline-parallel generation (pp={max(gen.layout.pp, dec.pp)}); vLLM rollout takes "
                   "a tensor-parallel size only")
    if gen.decode_layout is not None and gen.decode_layout != gen.layout:
        out.append(f"{gen.name}: a decode layout ({dec.short()}) different from prefill ({gen.layout.short()})")
    if gen.layout.micro_batches > 1:
        out.append(f"{gen.name}: generation in {gen.layout.micro_batches} waves per replica; vLLM schedules "
                   "sequences itself (max_num_seqs)")
    if strategy == "fsdp":
        for c in (r.actor_train, r.critic_train):
            if c is not None and c.layout.zero != 3:
                out.append(f"{c.name}: ZeRO-{c.layout.zero}; verl's FSDP workers shard parameters, gradients and "
                           "optimizer states (ZeRO-3)")
            if c is not None and c.layout.tp > 1:
                out.append(f"{c.name}: tensor parallel tp={c.layout.tp} in training under FSDP")
    return out


def export(plan: Plan, *, call: str | None = None) -> Export:  # noqa: ARG001 - one config covers all calls
    """Hydra overrides for verl's PPO trainer."""
    r = roles(plan, target="verl")
    gpn = plan.cluster.gpus_per_node
    algo = plan.algorithm
    trained = [c for c in (r.actor_train, r.critic_train) if c is not None]
    forward = [c for c in (r.ref_inference, r.critic_inference, r.reward_inference) if c is not None]
    strategy = "megatron" if any(c.layout.tp > 1 or c.layout.pp > 1 for c in trained + forward) else "fsdp"
    limits = common_limits(plan, "verl")
    notes: list[str] = []
    reward_pool: Mesh | None = None
    if r.reward_inference is not None:
        # verl gives the reward model a pool of its own (after the global one) when asked; the
        # global pool must then still be a whole number of equal nodes.
        rm = r.reward_inference.mesh
        rest = plan.cluster.world_size - rm.size
        if all(not set(rm.ranks) & set(c.mesh.ranks) for c in role_calls(r) if c is not r.reward_inference) \
                and (rest <= gpn or rest % gpn == 0):
            reward_pool = rm
    pool_gpus = plan.cluster.world_size - (reward_pool.size if reward_pool else 0)
    for c in role_calls(r):
        if c is r.reward_inference and reward_pool is not None:
            continue
        if c.mesh.size != pool_gpus:
            limits.append(f"{c.name} runs on GPUs {c.mesh.short()} only; verl runs every role on its whole resource "
                          f"pool of {pool_gpus} GPUs, one role after another")
    limits += _layout_limits(r, strategy)
    if r.extra_calls:
        limits.append(f"calls {', '.join(r.extra_calls)}: verl's PPO trainer has no role for them")
    n = r.generate.samples_per_prompt
    actor: dict[str, Any] = {
        "strategy": strategy,
        "ppo_mini_batch_size": optimizer_batch(r.actor_train) // n,
        "ppo_micro_batch_size_per_gpu": micro_batch_per_gpu(r.actor_train),
        "ppo_epochs": 1,
        "clip_ratio": algo.clip_eps,
        "optim": {"lr": r.actor_train.lr or algo.lr},
    }
    if strategy == "fsdp":
        actor["ulysses_sequence_parallel_size"] = r.actor_train.layout.cp
        actor["fsdp_config"] = {"fsdp_size": -1, "param_offload": False, "optimizer_offload": False}
    else:
        lay = r.actor_train.layout
        actor["megatron"] = {**_megatron(lay), "use_distributed_optimizer": lay.zero > 0}
    if algo.name in ("grpo", "rloo", "remax"):
        actor.update(use_kl_loss=True, kl_loss_coef=algo.kl_coef, kl_loss_type="low_var_kl")
    rollout: dict[str, Any] = {
        "name": "vllm", "n": n, "temperature": r.generate.temperature,
        "tensor_model_parallel_size": decode_layout(r.generate).tp,
        "log_prob_micro_batch_size_per_gpu": micro_batch_per_gpu(r.actor_train),
    }
    notes.append("verl recomputes the actor's log-probs of the samples in a forward pass (sized by "
                 "rollout.log_prob_micro_batch_size_per_gpu); the plan takes them from generation")
    model: dict[str, Any] = {"enable_gradient_checkpointing": r.actor_train.layout.recompute != "none"}
    if r.actor_train.layout.recompute == "selective":
        notes.append(f"{r.actor_train.name}: selective recompute maps to gradient checkpointing of whole layers")
    aro: dict[str, Any] = {"model": model, "actor": actor, "rollout": rollout}
    if r.ref_inference is not None:
        ref: dict[str, Any] = {"log_prob_micro_batch_size_per_gpu": micro_batch_per_gpu(r.ref_inference)}
        if strategy == "megatron":
            ref["megatron"] = _megatron(r.ref_inference.layout)
        aro["ref"] = ref
    settings: dict[str, Any] = {
        "data": {"train_batch_size": prompts(r), "max_prompt_length": r.generate.prompt_len,
                 "max_response_length": r.generate.gen_len},
        "actor_rollout_ref": aro,
        "algorithm": {"adv_estimator": ESTIMATOR.get(algo.name, "gae"), "gamma": algo.gamma, "lam": algo.lam},
        "trainer": {},
    }
    if algo.name not in ESTIMATOR:
        limits.append(f"algorithm {algo.name!r}: no verl advantage estimator of that name")
    if algo.name == "ppo":
        settings["algorithm"].update(use_kl_in_reward=True, kl_ctrl={"type": "fixed", "kl_coef": algo.kl_coef})
    if r.critic_train is not None:
        ct = r.critic_train
        critic: dict[str, Any] = {
            "strategy": strategy, "ppo_micro_batch_size_per_gpu": micro_batch_per_gpu(ct),
            "cliprange_value": algo.value_clip_eps, "optim": {"lr": ct.lr or algo.lr},
            "model": {"enable_gradient_checkpointing": ct.layout.recompute != "none"},
        }
        if r.critic_inference is not None:
            critic["forward_micro_batch_size_per_gpu"] = micro_batch_per_gpu(r.critic_inference)
        if strategy == "fsdp":
            critic["ulysses_sequence_parallel_size"] = ct.layout.cp
        else:
            critic["megatron"] = {**_megatron(ct.layout), "use_distributed_optimizer": ct.layout.zero > 0}
        settings["critic"] = critic
    if r.reward_inference is not None:
        rw: dict[str, Any] = {"enable": True, "strategy": strategy,
                              "micro_batch_size_per_gpu": micro_batch_per_gpu(r.reward_inference)}
        if strategy == "megatron":
            rw["megatron"] = _megatron(r.reward_inference.layout)
        if reward_pool is not None:
            nodes, per = nodes_and_gpus(reward_pool, gpn)
            rw.update(enable_resource_pool=True, nnodes=nodes, n_gpus_per_node=per)
            notes.append(f"{r.reward_inference.name}: its own resource pool on GPUs {reward_pool.short()}; verl "
                         "allocates that pool from whole nodes or node slices after the global pool")
        settings["reward_model"] = rw
    elif algo.reward_fn:
        module, _, fn = algo.reward_fn.partition(":")
        settings["custom_reward_function"] = {"path": module.replace(".", "/") + ".py", "name": fn}
        notes.append(f"custom_reward_function.path is a file: {algo.reward_fn!r} assumed at "
                     f"{settings['custom_reward_function']['path']}")
    nodes, per = (plan.cluster.nodes, gpn) if reward_pool is None else (max(1, pool_gpus // gpn), min(pool_gpus, gpn))
    settings["trainer"] = {"nnodes": nodes, "n_gpus_per_node": per}
    overrides: list[tuple[str, Any]] = []
    _flatten("", settings, overrides)
    exp = Export("verl", "", settings, limits, notes, SOURCE)
    body = " \\\n    ".join([PROGRAM] + [f"{k}={_value(v)}" for k, v in overrides])
    exp.text = comment_block(exp) + "\n\n" + body + "\n"
    return exp


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    return str(v)

