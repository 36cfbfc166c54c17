"""verl PPO trainer settings (Hydra overrides of ``verl.trainer.main_ppo``) for an RLHF plan.

Target: verl 0.9.x (key names and defaults read in the verl 0.9.1 wheel from PyPI):
``verl/trainer/config/ppo_trainer.yaml`` with its ``dp_*`` actor/critic/ref groups (FSDP workers)
and ``ppo_megatron_trainer.yaml`` (``--config-name ppo_megatron_trainer``: Megatron workers, the
``megatron`` engine block of ``engine/megatron.yaml``); the reward model is a served model under
``reward.reward_model.*`` (``reward/reward.yaml``: ``enable``, ``model_path``, its own
``rollout.*`` and optional resource pool); ``verl/utils/config.py: validate_config`` and the
worker configs' ``validate`` are what ``main_ppo`` checks before it starts Ray. ``make
test-engines`` composes every export with verl's own Hydra configs and runs that validation.

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
    engine_micro_batch,
    memory_fraction,
    micro_batch_per_gpu,
    model_path,
    nodes_and_gpus,
    optimizer_batch,
    placeholder_paths,
    prompts,
    role_calls,
    roles,
)
from plans.layout import Layout, Mesh
from plans.plan import Plan, PlanCall

VERSION = "verl 0.9.x"
SOURCE = ("verl 0.9.1 verl/trainer/config/{ppo_trainer,ppo_megatron_trainer}.yaml, reward/reward.yaml, "
          "verl/utils/config.py validate_config")
PROGRAM = "python3 -m verl.trainer.main_ppo"
MEGATRON_CONFIG = "ppo_megatron_trainer"
ESTIMATOR = {"ppo": "gae", "grpo": "grpo", "rloo": "rloo", "remax": "remax"}


def _megatron(lay: Layout, *, trained: bool) -> dict[str, Any]:
    """The `megatron` engine block of a worker (engine/megatron.yaml)."""
    block: dict[str, Any] = {"tensor_model_parallel_size": lay.tp, "pipeline_model_parallel_size": lay.pp,
                             "virtual_pipeline_model_parallel_size": lay.interleave if lay.interleave > 1 else None,
                             "context_parallel_size": lay.cp,
                             "expert_model_parallel_size": lay.ep, "expert_tensor_parallel_size": lay.etp,
                             # verl's default is True; the plan says whether activations shard over tp.
                             "sequence_parallel": lay.sequence_parallel and lay.tp > 1,
                             "param_offload": lay.offload == "weights"}
    if trained:
        block.update(use_distributed_optimizer=lay.zero in (1, 2), use_megatron_fsdp=lay.zero == 3,
                     optimizer_offload=lay.offload == "optimizer",
                     # verl builds Megatron's DDP with overlap_grad_reduce off unless overridden
                     # (utils/megatron_utils.py); the rlhf-engine stack the plan is costed for
                     # reduces gradients in buckets under the last backward.
                     override_ddp_config={"overlap_grad_reduce": True})
    return block


def _rollout_experts(lay: Layout, name: str, limits: list[str]) -> dict[str, Any]:
    """vLLM's expert parallel for a decode layout: an engine of tp x dp ranks whose experts split
    over all of them (verl checks expert_parallel_size == tp * dp). The plan's ep group spans
    ep * etp ranks, so that many ranks form one engine; experts also split over tp (etp > 1) has
    no vLLM form."""
    if lay.ep == 1:
        return {}
    span = lay.ep * lay.etp
    if lay.etp > 1:
        limits.append(f"{name}: experts split over both tp and ep (etp={lay.etp}, ep={lay.ep}); vLLM's expert "
                      f"parallel splits whole experts over all {span} ranks of an engine")
    return {"data_parallel_size": span // lay.tp, "expert_parallel_size": span}


# verl's config nodes that are empty dicts to be filled (`override_ddp_config: {}`): Hydra's struct
# mode takes a new key under them only as an append, `+key=value`.
APPENDED = ("override_ddp_config",)


def _flatten(prefix: str, tree: dict[str, Any], out: list[tuple[str, Any]]) -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _flatten(f"{prefix}{k}.", v, out)
        else:
            out.append((f"{prefix}{k}", v))


def overrides(settings: dict[str, Any]) -> list[str]:
    """The settings as Hydra override strings (`key=value`, `+key=value` under `APPENDED` nodes)."""
    flat: list[tuple[str, Any]] = []
    _flatten("", settings, flat)
    return [f"{'+' if any(f'.{a}.' in f'.{k}' for a in APPENDED) else ''}{k}={_value(v)}" for k, v in flat]


def _layout_limits(r: Roles, strategy: str, paged: bool) -> list[str]:
    """Per-role layouts verl cannot give: a role's calls with different degrees, pipelined
    generation, generation in static waves (`paged`: the plan's stack costed the waves as the KV
    budget vLLM's scheduler runs in, which gpu_memory_utilization sets), and ZeRO stages the worker
    does not have."""
    out = []
    workers: tuple[tuple[str, list[PlanCall | None]], ...] = (("actor", [r.actor_train, r.actor_inference]),
                                                              ("critic", [r.critic_train, r.critic_inference]))
    for role, maybe in workers:
        calls = [c for c in maybe if c is not None]
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
    if max(gen.layout.cp, dec.cp) > 1:
        out.append(f"{gen.name}: context-parallel prefill / KV-parallel decode (cp={max(gen.layout.cp, dec.cp)}); "
                   "vLLM rollout keeps each sequence on one tensor-parallel group")
    if gen.layout.micro_batches > 1 and not paged:
        out.append(f"{gen.name}: generation in {gen.layout.micro_batches} waves per replica; vLLM schedules "
                   "sequences itself (max_num_seqs)")
    for c in (r.actor_inference, r.ref_inference, r.critic_inference):
        if c is not None and strategy == "fsdp" and c.layout.dp > 1 and c.layout.zero != 3:
            out.append(f"{c.name}: parameters replicated over dp={c.layout.dp}; verl's FSDP workers shard them "
                       "(ZeRO-3) and gather them for each forward")
    for c in (r.actor_train, r.critic_train):
        if c is None:
            continue
        if strategy == "fsdp" and c.layout.zero != 3:
            out.append(f"{c.name}: ZeRO-{c.layout.zero}; verl's FSDP workers shard parameters, gradients and "
                       "optimizer states (ZeRO-3)")
        if strategy == "megatron" and c.layout.zero == 2:
            out.append(f"{c.name}: ZeRO-2; Megatron's distributed optimizer shards optimizer states and "
                       "reduce-scatters gradients but keeps a full gradient buffer per rank (ZeRO-1 memory)")
    if r.critic_inference is not None and strategy == "megatron":
        out.append(f"{r.critic_inference.name}: its own micro-batch; verl's Megatron critic computes values with "
                   "its ppo_micro_batch_size_per_gpu")
    return out


def _engine_dp(pool: int, lay: Layout, strategy: str) -> int:
    """Data-parallel size of a worker on the whole pool (what verl's batch checks divide by)."""
    if strategy == "megatron":
        return max(1, pool // (lay.tp * lay.pp * lay.cp))
    return max(1, pool // lay.cp)


def _micro(call: PlanCall, pool: int, strategy: str, notes: list[str]) -> int:
    """The call's per-GPU micro-batch on verl's data-parallel size, noted when it differs."""
    rows = optimizer_batch(call) if call.kind == "train" else call.seqs
    dp = _engine_dp(pool, call.layout, strategy)
    plan_micro = micro_batch_per_gpu(call)
    micro = engine_micro_batch(rows, dp, plan_micro)
    if dp != call.layout.dp or micro != plan_micro:
        notes.append(f"{call.name}: {micro} sequences per GPU per micro-batch on verl's data-parallel size {dp} "
                     f"(the plan: {plan_micro} on dp={call.layout.dp})")
    return micro


def export(plan: Plan, *, call: str | None = None) -> Export:  # noqa: ARG001 - one config covers all calls
    """Hydra overrides for verl's PPO trainer."""
    r = roles(plan, target="verl")
    gpn = plan.cluster.gpus_per_node
    algo = plan.algorithm
    trained = [c for c in (r.actor_train, r.critic_train) if c is not None]
    forward = [c for c in (r.actor_inference, r.ref_inference, r.critic_inference) if c is not None]
    # Tensor, pipeline or expert parallel need Megatron workers (verl's FSDP workers have none).
    strategy = "megatron" if any(c.layout.tp > 1 or c.layout.pp > 1 or c.layout.ep > 1
                                 for c in trained + forward) else "fsdp"
    limits = common_limits(plan, "verl")
    notes: list[str] = []
    reward_pool: Mesh | None = None
    if r.reward_inference is not None:
        # verl gives the reward model a pool of its own (after the global one) when asked; the
        # global pool must then still be a whole number of equal nodes.
        rm = r.reward_inference.mesh
        rest = plan.cluster.world_size - rm.size
        if all(not set(rm.ranks) & set(c.mesh.ranks) for c in role_calls(r) if c is not r.reward_inference) \
                and rest > 0 and (rest <= gpn or rest % gpn == 0):
            reward_pool = rm
    pool_gpus = plan.cluster.world_size - (reward_pool.size if reward_pool else 0)
    for c in role_calls(r):
        if c is r.reward_inference and reward_pool is not None:
            continue
        if c.mesh.size != pool_gpus:
            limits.append(f"{c.name} runs on GPUs {c.mesh.short()} only; verl runs every role on its whole resource "
                          f"pool of {pool_gpus} GPUs, one role after another")
    from cost_models.framework import resolve_framework  # the cost model is heavy to import

    stack = resolve_framework(plan.estimate.framework or "torch")
    limits += _layout_limits(r, strategy, stack.paged_kv)
    if r.extra_calls:
        limits.append(f"calls {', '.join(r.extra_calls)}: verl's PPO trainer has no role for them")
    n = r.generate.samples_per_prompt
    at = r.actor_train
    actor: dict[str, Any] = {
        "strategy": strategy,
        "ppo_mini_batch_size": optimizer_batch(at) // n,
        "ppo_micro_batch_size_per_gpu": _micro(at, pool_gpus, strategy, notes),
        "ppo_epochs": 1,
        "clip_ratio": algo.clip_eps,
        "optim": {"lr": at.lr or algo.lr},
    }
    if optimizer_batch(at) % n:
        limits.append(f"{at.name}: {optimizer_batch(at)} sequences per optimizer step is not a whole number of "
                      f"prompts with {n} samples each; verl counts ppo_mini_batch_size in prompts")
    if strategy == "fsdp":
        actor["ulysses_sequence_parallel_size"] = at.layout.cp
        actor["fsdp_config"] = {"fsdp_size": -1, "param_offload": False,
                                "optimizer_offload": at.layout.offload == "optimizer"}
    else:
        actor["megatron"] = _megatron(at.layout, trained=True)
    actor.update(use_kl_loss=algo.name in ("grpo", "rloo", "remax"))
    if actor["use_kl_loss"]:
        actor.update(kl_loss_coef=algo.kl_coef, kl_loss_type="low_var_kl")
    gen = r.generate
    rollout: dict[str, Any] = {
        "name": "vllm", "n": n, "temperature": gen.temperature,
        "tensor_model_parallel_size": decode_layout(gen).tp,
        **_rollout_experts(decode_layout(gen), gen.name, limits),
        "gpu_memory_utilization": memory_fraction(plan, gen),
        **({"max_num_seqs": stack.max_num_seqs} if stack.paged_kv and stack.max_num_seqs else {}),
        "free_cache_engine": True,
        # The actor worker's forward over the samples (verl's old log-probs), on either strategy.
        "log_prob_micro_batch_size_per_gpu": (_micro(r.actor_inference, pool_gpus, strategy, notes)
                                              if r.actor_inference is not None else actor["ppo_micro_batch_size_per_gpu"]),
    }
    notes.append(f"{gen.name}: rollout.gpu_memory_utilization {rollout['gpu_memory_utilization']} is the share of "
                 "GPU memory the plan costed generation with (weights, KV cache, activations); free_cache_engine "
                 "releases the KV cache between calls")
    if r.actor_inference is None:
        notes.append("verl recomputes the actor's log-probs of the samples in a forward pass (sized by "
                     "rollout.log_prob_micro_batch_size_per_gpu), which the plan does not have: it takes them from "
                     "generation, as algorithm.rollout_correction.bypass_mode=true would (compile with "
                     "--policy-logprobs to cost verl's way)")
    model: dict[str, Any] = {"path": model_path(plan, r.actor),
                             "enable_gradient_checkpointing": at.layout.recompute != "none"}
    if at.layout.recompute == "selective":
        notes.append(f"{at.name}: selective recompute maps to gradient checkpointing of whole layers")
    aro: dict[str, Any] = {"model": model, "actor": actor, "rollout": rollout}
    ref_on = r.ref_inference is not None
    if ref_on:
        ri = r.ref_inference
        assert ri is not None
        ref: dict[str, Any] = {"log_prob_micro_batch_size_per_gpu": _micro(ri, pool_gpus, strategy, notes)}
        if strategy == "megatron":
            ref["megatron"] = _megatron(ri.layout, trained=False)
        else:
            ref["fsdp_config"] = {"param_offload": ri.layout.offload == "weights"}
        aro["ref"] = ref
        if r.ref is not None and plan.models[r.ref].spec != plan.models[r.actor].spec:
            limits.append(f"reference model {r.ref!r} differs from the actor; verl's reference is the actor's "
                          "initial checkpoint")
    settings: dict[str, Any] = {
        "data": {"train_batch_size": prompts(r), "max_prompt_length": gen.prompt_len,
                 "max_response_length": gen.gen_len},
        "actor_rollout_ref": aro,
        "algorithm": {"adv_estimator": ESTIMATOR.get(algo.name, "gae"), "gamma": algo.gamma, "lam": algo.lam},
    }
    if algo.name not in ESTIMATOR:
        limits.append(f"algorithm {algo.name!r}: no verl advantage estimator of that name")
    if algo.name == "ppo":
        settings["algorithm"].update(use_kl_in_reward=ref_on, kl_ctrl={"type": "fixed", "kl_coef": algo.kl_coef})
    elif not ref_on and actor["use_kl_loss"]:
        actor["use_kl_loss"] = False  # no reference model in the plan: no KL term either
        for k in ("kl_loss_coef", "kl_loss_type"):
            actor.pop(k)
    if r.critic_train is not None:
        ct = r.critic_train
        critic: dict[str, Any] = {
            "enable": True, "strategy": strategy,
            "ppo_micro_batch_size_per_gpu": _micro(ct, pool_gpus, strategy, notes),
            "cliprange_value": algo.value_clip_eps, "optim": {"lr": ct.lr or algo.lr},
            "model": {"path": model_path(plan, ct.model),
                      "enable_gradient_checkpointing": ct.layout.recompute != "none"},
        }
        if strategy == "fsdp":
            if r.critic_inference is not None:  # exists for the FSDP critic only (dp_critic.yaml)
                critic["forward_micro_batch_size_per_gpu"] = _micro(r.critic_inference, pool_gpus, strategy, notes)
            critic["ulysses_sequence_parallel_size"] = ct.layout.cp
            if ct.layout.offload == "optimizer":
                critic["fsdp"] = {"optimizer_offload": True}
        else:
            critic["megatron"] = _megatron(ct.layout, trained=True)
        settings["critic"] = critic
    else:
        settings["critic"] = {"enable": False}
    reward: dict[str, Any] = {}
    if r.reward_inference is not None:
        ri = r.reward_inference
        rw: dict[str, Any] = {"enable": True, "model_path": model_path(plan, ri.model),
                              "rollout": {"name": "vllm", "tensor_model_parallel_size": ri.layout.tp,
                                          "gpu_memory_utilization": memory_fraction(plan, ri)}}
        if ri.layout.pp > 1:
            limits.append(f"{ri.name}: pipeline parallel pp={ri.layout.pp}; verl serves the reward model with a "
                          "tensor-parallel size only")
        if ri.layout.offload == "weights":
            limits.append(f"{ri.name}: its weights wait in host memory between calls; verl's served reward model "
                          "keeps them on the GPU")
        if ri.layout.zero:
            limits.append(f"{ri.name}: {ri.layout.short()}; verl serves the reward model with vLLM, a full copy per "
                          "tensor-parallel group")
        elif ri.layout.micro_batches > 1:
            notes.append(f"{ri.name}: the plan scores in {ri.layout.micro_batches} micro-batches per replica; verl's "
                         "served reward model schedules sequences itself (max_num_batched_tokens)")
        if reward_pool is not None:
            nodes, per = nodes_and_gpus(reward_pool, gpn)
            rw.update(enable_resource_pool=True, nnodes=nodes, n_gpus_per_node=per)
            notes.append(f"{ri.name}: its own resource pool on GPUs {reward_pool.short()}; verl allocates that pool "
                         "from whole nodes or node slices after the global pool")
        else:
            rw["enable_resource_pool"] = False
            if ri.mesh.size != pool_gpus:
                limits.append(f"{ri.name} runs on GPUs {ri.mesh.short()} only; verl serves the reward model on the "
                              f"global pool of {pool_gpus} GPUs")
        reward["reward_model"] = rw
    elif algo.reward_fn:
        module, _, fn = algo.reward_fn.partition(":")
        reward["custom_reward_function"] = {"path": module.replace(".", "/") + ".py", "name": fn}
        notes.append(f"reward.custom_reward_function.path is a file: {algo.reward_fn!r} assumed at "
                     f"{reward['custom_reward_function']['path']}")
    if reward:
        settings["reward"] = reward
    nodes, per = (plan.cluster.nodes, gpn) if reward_pool is None else (max(1, pool_gpus // gpn), min(pool_gpus, gpn))
    settings["trainer"] = {"nnodes": nodes, "n_gpus_per_node": per}
    notes += placeholder_paths(plan, [r.actor, r.critic, r.reward_inference.model if r.reward_inference else None])
    exp = Export("verl", "", settings, limits, notes, SOURCE, VERSION)
    head = [PROGRAM] + (["--config-name", MEGATRON_CONFIG] if strategy == "megatron" else [])
    body = " \\\n    ".join([" ".join(head)] + overrides(settings))
    exp.text = comment_block(exp) + "\n\n" + body + "\n"
    return exp


def config_name(exp: Export) -> str:
    """The Hydra config an export composes with (ppo_trainer or ppo_megatron_trainer)."""
    return MEGATRON_CONFIG if exp.data["actor_rollout_ref"]["actor"]["strategy"] == "megatron" else "ppo_trainer"


def _value(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    return str(v)
