"""OpenRLHF ``train_ppo_ray`` flags for an RLHF plan: placement, vLLM engines, DeepSpeed layout.

Target: OpenRLHF 0.11.x (flag names, defaults and checks read in ``openrlhf/cli/train_ppo_ray.py``
of the 0.11.2 wheel from PyPI: the dotted names ``--actor.num_nodes``, ``--vllm.num_engines``,
``--train.batch_size``, ``--rollout.n_samples_per_prompt``, ``--ds.zero_stage``,
``--algo.kl.init_coef``...). OpenRLHF gives each role (actor, reference, critic, reward) a Ray
group of ``num_nodes x num_gpus_per_node`` GPUs, generation its own vLLM engines of
``tensor_parallel_size`` GPUs each, and every DeepSpeed model the same ZeRO stage,
tensor-parallel and ring-attention sizes. GPUs are shared only by its colocation switches:
``--train.colocate_all`` (every model and the engines on the actor's GPUs, with
``--vllm.enable_sleep`` / ``--ds.enable_sleep`` releasing memory between phases),
``--train.colocate_actor_ref`` and ``--train.colocate_critic_reward``.

``make test-engines`` runs the 0.11.2 script itself on every export (its parser, its post-parse
checks and its GPU allocation up to the point where Ray would start the actors).
"""

from __future__ import annotations

from math import gcd
from typing import Any

from planner.exports.common import (
    Export,
    Roles,
    comment_block,
    common_limits,
    decode_layout,
    flags_dict,
    memory_fraction,
    micro_batch_per_gpu,
    model_path,
    nodes_and_gpus,
    optimizer_batch,
    placeholder_paths,
    prompts,
    role_calls,
    roles,
    shell_command,
)
from plans.layout import Mesh
from plans.plan import Plan, PlanCall

VERSION = "OpenRLHF 0.11.x"
SOURCE = "OpenRLHF 0.11.2 openrlhf/cli/train_ppo_ray.py"
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


def _groups(plan: Plan, r) -> tuple[dict[str, Mesh], bool]:  # noqa: ANN001 - Roles
    """GPUs of each OpenRLHF group as the plan places the roles, and whether OpenRLHF can place
    them so (identical meshes only where a colocation switch shares them, the rest disjoint)."""
    groups: dict[str, Mesh] = {"vllm": r.generate.mesh, "actor": r.actor_train.mesh}
    if r.actor_inference is not None and r.actor_inference.mesh != r.actor_train.mesh:
        return groups, False  # the actor group computes the log-probs on its own GPUs
    if r.ref_inference is not None:
        groups["ref"] = r.ref_inference.mesh
    if r.critic_train is not None:
        groups["critic"] = r.critic_train.mesh
        if r.critic_inference is not None and r.critic_inference.mesh != r.critic_train.mesh:
            return groups, False
    if r.reward_inference is not None:
        groups["reward"] = r.reward_inference.mesh
    shared = {("actor", "ref"), ("critic", "reward")}
    names = list(groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ma, mb = set(groups[a].ranks), set(groups[b].ranks)
            if ma == mb and ((a, b) in shared or (b, a) in shared):
                continue
            if ma & mb:
                return groups, False
    return groups, True


def _train_micro(plan_micro: int, rows: int, dps: list[int]) -> int:
    """The largest micro-batch up to the plan's that divides every trained model's per-rank rows
    (OpenRLHF shares one --train.micro_batch_size and DeepSpeed asserts the accumulation is whole)."""
    per = 0
    for dp in dps:
        per = gcd(per, rows // dp) if rows % dp == 0 else 1
    for m in range(min(plan_micro, max(per, 1)), 0, -1):
        if per % m == 0:
            return m
    return 1


def _offload_flags(r: Roles, colocate_all: bool, notes: list[str]) -> list[tuple[str, Any]]:
    """OpenRLHF's offload switches for what the plan keeps in host memory between calls
    (`Layout.offload`): a frozen model's weights (``--ref.offload``, ``--reward.offload``); the
    trained models' optimizer states are offloaded between phases by ``--ds.enable_sleep`` when
    everything is colocated, else by ``--ds.adam_offload``, which also runs Adam on the CPU."""
    flags: list[tuple[str, Any]] = []
    for role, c in (("ref", r.ref_inference), ("reward", r.reward_inference)):
        if c is not None and c.layout.offload == "weights":
            flags.append((f"--{role}.offload", None))
    trained = [c for c in (r.actor_train, r.critic_train) if c is not None and c.layout.offload == "optimizer"]
    if trained and colocate_all:
        notes.append(", ".join(c.name for c in trained) + ": optimizer states in host memory between calls; "
                     "--ds.enable_sleep offloads them (and the weights) while the other phases run")
    elif trained:
        flags.append(("--ds.adam_offload", None))
        notes.append(", ".join(c.name for c in trained) + ": optimizer states in host memory between calls; "
                     "--ds.adam_offload keeps them there and steps Adam on the CPU (DeepSpeedCPUAdam), slower than "
                     "the plan costs (it copies them to the GPU for the step)")
    return flags


def export(plan: Plan, *, call: str | None = None) -> Export:  # noqa: ARG001 - one command covers all calls
    """One train_ppo_ray command for the plan."""
    r = roles(plan, target="openrlhf")
    gpn = plan.cluster.gpus_per_node
    world = plan.cluster.world_size
    algo = plan.algorithm
    limits = common_limits(plan, "OpenRLHF")
    notes: list[str] = []
    flags: list[tuple[str, Any]] = []
    gen, dec = r.generate, decode_layout(r.generate)
    groups, faithful = _groups(plan, r)
    meshes = {c.name: c.mesh for c in role_calls(r)}
    colocate_all = len(set(meshes.values())) == 1
    if not colocate_all and not faithful:
        # OpenRLHF cannot overlap these groups except by colocating everything: run every model
        # and the engines on all GPUs (what the plan costed is listed as not expressed).
        limits.append("GPU placement of each role: OpenRLHF shares GPUs only by its colocation switches; the plan "
                      "puts " + ", ".join(f"{k} on {m.short()}" for k, m in meshes.items()) +
                      f"; the export colocates every role on all {world} GPUs")
        colocate_all = True
        groups = {k: Mesh.block(0, world) for k in groups}
    elif not colocate_all:
        notes.append("OpenRLHF's Ray scheduler picks which GPUs each group gets; the plan puts " +
                     ", ".join(f"{k} on {m.short()}" for k, m in groups.items()))
    for role in ("actor", "ref", "critic", "reward"):
        if role in groups:
            nodes, per = nodes_and_gpus(groups[role], gpn)
            flags += [(f"--{role}.num_nodes", nodes), (f"--{role}.num_gpus_per_node", per)]
    engines = groups["vllm"].size // dec.tp
    flags += [("--vllm.num_engines", engines), ("--vllm.tensor_parallel_size", dec.tp),
              ("--vllm.gpu_memory_utilization", memory_fraction(plan, gen))]
    notes.append(f"{gen.name}: --vllm.gpu_memory_utilization is the share of GPU memory the plan costed generation "
                 "with (weights, KV cache, activations); OpenRLHF's vLLM engines run at most vLLM's default "
                 "max_num_seqs sequences at once (it has no flag for it; it differs by vLLM release and GPU), where "
                 "the vLLM stacks cost 256")
    if colocate_all:
        flags += [("--train.colocate_all", None), ("--vllm.enable_sleep", None), ("--ds.enable_sleep", None)]
    else:
        if "ref" in groups and groups["ref"] == groups["actor"]:
            flags.append(("--train.colocate_actor_ref", None))
        if "reward" in groups and "critic" in groups and groups["reward"] == groups["critic"]:
            flags.append(("--train.colocate_critic_reward", None))
    flags += _offload_flags(r, colocate_all, notes)
    deepspeed = [c for c in (r.actor_train, r.critic_train, r.actor_inference, r.ref_inference, r.critic_inference,
                             r.reward_inference) if c is not None]
    trained = [c for c in (r.actor_train, r.critic_train) if c is not None]
    zero = _one_value(trained, "ZeRO stage", lambda c: c.layout.zero, limits)
    flags.append(("--ds.zero_stage", zero))
    if zero in (1, 2):  # the reduction under the backward, as the plan prices it (DeepSpeed: stage 3 alone by default)
        flags.append(("--ds.overlap_comm", None))
    tp = _one_value(deepspeed, "DeepSpeed tensor-parallel size", lambda c: c.layout.tp, limits)
    if tp > 1:
        flags.append(("--ds.tensor_parallel_size", tp))
    cp = _one_value(deepspeed, "ring-attention size", lambda c: c.layout.cp, limits)
    if cp > 1:
        flags += [("--ds.ring_attn_size", cp), ("--ds.packing_samples", None)]
    for c in (r.actor_inference, r.ref_inference, r.critic_inference, r.reward_inference):
        want = 3 if zero == 3 else 0
        if c is not None and c.layout.dp > 1 and c.layout.zero != want:
            limits.append(f"{c.name}: ZeRO-{c.layout.zero}; OpenRLHF's forward-only models use ZeRO-{want} with "
                          f"--ds.zero_stage {zero}")
    for c in deepspeed:
        if c.layout.sequence_parallel and c.layout.tp > 1:
            limits.append(f"{c.name}: Megatron-style sequence parallelism over tp; DeepSpeed's AutoTP has none")
        if c.layout.pp > 1:
            limits.append(f"{c.name}: pipeline parallel pp={c.layout.pp}; OpenRLHF's DeepSpeed models have none")
    if max(gen.layout.cp, dec.cp) > 1:
        limits.append(f"{gen.name}: context-parallel prefill / KV-parallel decode (cp={max(gen.layout.cp, dec.cp)}); "
                      "vLLM engines keep each sequence on one tensor-parallel group")
    if gen.layout.pp > 1 or gen.layout.micro_batches > 1 or gen.decode_layout not in (None, gen.layout):
        limits.append(f"{gen.name}: {gen.layout.short()}" + (f" / decode {dec.short()}" if gen.decode_layout else "") +
                      "; vLLM engines take a tensor-parallel size and schedule sequences themselves")
    if gen.mesh.size % dec.tp:
        limits.append(f"{gen.name}: {gen.mesh.size} GPUs do not split into engines of tp={dec.tp}")
    recompute = {c.layout.recompute for c in trained}
    if recompute != {"none"}:
        flags.append(("--actor.gradient_checkpointing_enable", None))
        if recompute != {"full"}:
            notes.append("gradient checkpointing recomputes whole layers; the plan recomputes " +
                         ", ".join(f"{c.name}: {c.layout.recompute}" for c in trained))
    # Batch arithmetic on OpenRLHF's own data-parallel sizes (a group's GPUs over ring x tp).
    dp = {role: max(1, groups[role].size // (cp * tp)) for role in ("actor", "critic") if role in groups}
    rows = optimizer_batch(r.actor_train)
    plan_micro = min(micro_batch_per_gpu(c) for c in trained)
    micro = _train_micro(plan_micro, rows, list(dp.values()))
    if any(rows % d for d in dp.values()):
        limits.append(f"{rows} sequences per optimizer step do not split over OpenRLHF's data-parallel sizes "
                      f"{sorted(set(dp.values()))}")
    if micro != plan_micro or dp.get("actor") != r.actor_train.layout.dp:
        notes.append(f"--train.micro_batch_size {micro} on OpenRLHF's data-parallel sizes {dp} (the plan: "
                     + ", ".join(f"{c.name} {micro_batch_per_gpu(c)} on dp={c.layout.dp}" for c in trained) + ")")
    flags += [("--ds.param_dtype", "bf16"), ("--train.micro_batch_size", micro), ("--train.batch_size", rows)]
    if r.critic_train is not None and optimizer_batch(r.critic_train) != rows:
        limits.append(f"one --train.batch_size for actor and critic, but the plan steps the critic every "
                      f"{optimizer_batch(r.critic_train)} sequences")
    samples = gen.seqs
    forward = [c for c in (r.actor_inference, r.ref_inference, r.critic_inference, r.reward_inference)
               if c is not None]
    if r.actor_inference is None:
        notes.append("OpenRLHF's experience maker recomputes the actor's log-probs of the samples on the actor group "
                     "(a forward pass per --rollout.micro_batch_size), which the plan does not have: it takes them "
                     "from generation (compile with --policy-logprobs to cost OpenRLHF's way)")
    if forward:
        want = min(micro_batch_per_gpu(c) for c in forward)
        # OpenRLHF asserts samples // micro >= the actor's data-parallel ranks (each gets a batch).
        roll = max(1, min(want, samples // dp["actor"]))
        if roll != want:
            notes.append(f"--rollout.micro_batch_size {roll}: the plan's inference micro-batch {want} would leave "
                         f"some of OpenRLHF's {dp['actor']} actor ranks without a batch")
        flags.append(("--rollout.micro_batch_size", roll))
    flags += [("--rollout.batch_size", prompts(r)), ("--rollout.n_samples_per_prompt", gen.samples_per_prompt),
              ("--data.max_len", gen.prompt_len + gen.gen_len), ("--rollout.max_new_tokens", gen.gen_len),
              ("--rollout.temperature", gen.temperature), ("--train.max_epochs", 1),
              ("--actor.model_name_or_path", model_path(plan, r.actor)),
              ("--actor.adam.lr", r.actor_train.lr or algo.lr), ("--actor.eps_clip", algo.clip_eps)]
    if r.critic_train is not None:
        flags += [("--critic.model_name_or_path", model_path(plan, r.critic_train.model)),
                  ("--critic.adam.lr", r.critic_train.lr or algo.lr), ("--critic.value_clip", algo.value_clip_eps)]
    if r.reward_inference is not None:
        flags.append(("--reward.model_name_or_path", model_path(plan, r.reward_inference.model)))
    flags += [("--algo.advantage.gamma", algo.gamma), ("--algo.advantage.lambd", algo.lam),
              ("--algo.kl.init_coef", algo.kl_coef if r.ref_inference is not None else 0.0)]
    if algo.name in ("grpo", "rloo", "remax") and r.ref_inference is not None:
        flags += [("--algo.kl.use_loss", None), ("--algo.kl.estimator", "k3")]
    if algo.name in ESTIMATOR:
        flags.append(("--algo.advantage.estimator", ESTIMATOR[algo.name]))
    else:
        limits.append(f"algorithm {algo.name!r}: OpenRLHF has no advantage estimator of that name")
    if r.critic_train is None and ESTIMATOR.get(algo.name) == "gae":
        limits.append("PPO without a critic: OpenRLHF's gae estimator trains one")
    if r.reward_inference is None:
        if algo.reward_fn:
            module = algo.reward_fn.partition(":")[0]
            flags.append(("--reward.remote_url", module.replace(".", "/") + ".py"))
            notes.append(f"rewards come from {algo.reward_fn!r}: OpenRLHF loads `reward_func(queries, prompts, labels)` "
                         "from the .py file given as --reward.remote_url; wrap the function in that signature")
        else:
            limits.append("no reward model and no reward function: OpenRLHF needs one")
    if r.extra_calls:
        limits.append(f"calls {', '.join(r.extra_calls)}: OpenRLHF's PPO trainer has no role for them")
    notes += placeholder_paths(plan, [r.actor, r.critic, r.reward_inference.model if r.reward_inference else None])
    notes.append("set --data.prompt_dataset (and --data.input_key) to your prompts")
    exp = Export("openrlhf", "", flags_dict(flags), limits, notes, SOURCE, VERSION)
    exp.text = comment_block(exp) + "\n\n" + shell_command(PROGRAM, flags) + "\n"
    return exp
