"""OpenRLHF ``train_ppo_ray`` flags for an RLHF plan: placement, vLLM engines, DeepSpeed layout.

Flag names are those of ``openrlhf/cli/train_ppo_ray.py`` (OpenRLHF/OpenRLHF, read at commit
021d1b09641902f7f06dc42331c75b37793ca950). OpenRLHF gives each role (actor, reference, critic,
reward) a number of nodes and GPUs per node as Ray actors, generation its own vLLM engines, and
every DeepSpeed model the same ZeRO stage, tensor-parallel and ring-attention sizes.
"""

from __future__ import annotations

from typing import Any

from planner.exports.common import (
    Export,
    comment_block,
    common_limits,
    decode_layout,
    flags_dict,
    micro_batch_per_gpu,
    nodes_and_gpus,
    optimizer_batch,
    prompts,
    role_calls,
    roles,
    shell_command,
)
from plans.plan import Plan, PlanCall

SOURCE = "OpenRLHF/OpenRLHF openrlhf/cli/train_ppo_ray.py"
PROGRAM = "python3 -m openrlhf.cli.train_ppo_ray"
ESTIMATOR = {"ppo": "gae", "grpo": "group_norm", "rloo": "rloo"}


def _one_value(calls: list[PlanCall], what: str, get, limits: list[str]) -> Any:  # noqa: ANN001
    """The value every call shares for a setting OpenRLHF has once; the first call's, with a
    limit noted, when they differ."""
    values = {c.name: get(c) for c in calls}
    if len(set(values.values())) > 1:
        limits.append(f"one {what} for every model, but the plan uses " +
                      ", ".join(f"{v} for {k}" for k, v in values.items()))
    return values[calls[0].name]


def export(plan: Plan, *, call: str | None = None) -> Export:  # noqa: ARG001 - one command covers all calls
    """One train_ppo_ray command for the plan."""
    r = roles(plan, target="openrlhf")
    gpn = plan.cluster.gpus_per_node
    algo = plan.algorithm
    limits = common_limits(plan, "OpenRLHF")
    notes: list[str] = []
    flags: list[tuple[str, Any]] = []
    placed = [("actor", r.actor_train), ("ref", r.ref_inference), ("critic", r.critic_train),
              ("reward", r.reward_inference)]
    for role, c in placed:
        if c is None:
            continue
        nodes, per = nodes_and_gpus(c.mesh, gpn)
        flags += [(f"--{role}_num_nodes", nodes), (f"--{role}_num_gpus_per_node", per)]
    gen, dec = r.generate, decode_layout(r.generate)
    flags += [("--vllm_num_engines", gen.mesh.size // dec.tp), ("--vllm_tensor_parallel_size", dec.tp)]
    meshes = {c.name: c.mesh for c in role_calls(r)}
    if len(set(meshes.values())) == 1:
        flags.append(("--colocate_all_models", None))
    else:
        if r.ref_inference is not None and r.ref_inference.mesh == r.actor_train.mesh:
            flags.append(("--colocate_actor_ref", None))
        if r.critic_train is not None and r.reward_inference is not None and \
                r.critic_train.mesh == r.reward_inference.mesh:
            flags.append(("--colocate_critic_reward", None))
        limits.append("GPU placement of each role: OpenRLHF's Ray scheduler picks the GPUs (only the colocation "
                      "flags share them), the plan puts " + ", ".join(f"{k} on {m.short()}" for k, m in meshes.items()))
    if r.critic_inference is not None and r.critic_train is not None and \
            r.critic_inference.mesh != r.critic_train.mesh:
        limits.append(f"{r.critic_inference.name} on {r.critic_inference.mesh.short()} apart from "
                      f"{r.critic_train.name} on {r.critic_train.mesh.short()}: one critic group does both")
    deepspeed = [c for c in (r.actor_train, r.critic_train, r.ref_inference, r.critic_inference, r.reward_inference)
                 if c is not None]
    trained = [c for c in (r.actor_train, r.critic_train) if c is not None]
    flags.append(("--zero_stage", _one_value(trained, "ZeRO stage", lambda c: c.layout.zero, limits)))
    tp = _one_value(deepspeed, "DeepSpeed tensor-parallel size", lambda c: c.layout.tp, limits)
    if tp > 1:
        flags.append(("--ds_tensor_parallel_size", tp))
    cp = _one_value(deepspeed, "ring-attention size", lambda c: c.layout.cp, limits)
    if cp > 1:
        flags += [("--ring_attn_size", cp), ("--packing_samples", None)]
    for c in deepspeed:
        if c.layout.pp > 1:
            limits.append(f"{c.name}: pipeline parallel pp={c.layout.pp}; OpenRLHF's DeepSpeed models have none")
    if gen.layout.pp > 1 or gen.layout.micro_batches > 1 or gen.decode_layout not in (None, gen.layout):
        limits.append(f"{gen.name}: {gen.layout.short()}" + (f" / decode {dec.short()}" if gen.decode_layout else "") +
                      "; vLLM engines take a tensor-parallel size and schedule sequences themselves")
    recompute = {c.layout.recompute for c in trained}
    if recompute != {"none"}:
        flags.append(("--gradient_checkpointing", None))
        if recompute != {"full"}:
            notes.append("gradient checkpointing recomputes whole layers; the plan recomputes " +
                         ", ".join(f"{c.name}: {c.layout.recompute}" for c in trained))
    flags += [("--bf16", None),
              ("--micro_train_batch_size", _one_value(trained, "micro_train_batch_size", micro_batch_per_gpu, limits)),
              ("--train_batch_size", optimizer_batch(r.actor_train))]
    forward = [c for c in (r.ref_inference, r.critic_inference, r.reward_inference) if c is not None]
    if forward:
        flags.append(("--micro_rollout_batch_size",
                      _one_value(forward, "micro_rollout_batch_size", micro_batch_per_gpu, limits)))
    flags += [("--rollout_batch_size", prompts(r)), ("--n_samples_per_prompt", gen.samples_per_prompt),
              ("--prompt_max_len", gen.prompt_len), ("--generate_max_len", gen.gen_len),
              ("--temperature", gen.temperature), ("--max_epochs", 1),
              ("--actor_learning_rate", r.actor_train.lr or algo.lr)]
    if r.critic_train is not None:
        flags += [("--critic_learning_rate", r.critic_train.lr or algo.lr), ("--value_clip", algo.value_clip_eps)]
    flags += [("--eps_clip", algo.clip_eps), ("--gamma", algo.gamma), ("--lambd", algo.lam),
              ("--init_kl_coef", algo.kl_coef if r.ref_inference is not None else 0.0)]
    if algo.name in ("grpo", "rloo", "remax"):
        flags += [("--use_kl_loss", None), ("--kl_estimator", "k3")]
    if algo.name in ESTIMATOR:
        flags.append(("--advantage_estimator", ESTIMATOR[algo.name]))
    else:
        limits.append(f"algorithm {algo.name!r}: OpenRLHF has no advantage estimator of that name")
    if r.reward_inference is None and algo.reward_fn:
        notes.append(f"rewards come from {algo.reward_fn!r}: serve it behind --remote_rm_url")
    if r.extra_calls:
        limits.append(f"calls {', '.join(r.extra_calls)}: OpenRLHF's PPO trainer has no role for them")
    notes.append("set the checkpoints: --pretrain (actor), --critic_pretrain, --reward_pretrain, and --prompt_data")
    exp = Export("openrlhf", "", flags_dict(flags), limits, notes, SOURCE)
    exp.text = comment_block(exp) + "\n\n" + shell_command(PROGRAM, flags) + "\n"
    return exp
