"""What every export shares: the result type, the roles of an RLHF graph, batch arithmetic."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from plans.errors import PlannerError
from plans.layout import Layout, Mesh
from plans.plan import Plan, PlanCall


@dataclass
class Export:
    """A plan in another engine's terms, and what that engine cannot express of it.

    `text` is what a user runs or loads (a shell command, a JSON config); `data` the same settings
    as a JSON object; `cannot_express` every choice of the plan the engine has no setting for (the
    run will differ there); `notes` mappings that hold only approximately or need a manual step."""

    target: str
    text: str
    data: dict[str, Any]
    cannot_express: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    source: str = ""
    version: str = ""  # the release of the target the names and defaults come from
    env: dict[str, str] = field(default_factory=dict)  # environment variables the launch needs

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "version": self.version, "settings": self.data,
                "cannot_express": self.cannot_express, "notes": self.notes, "source": self.source, "env": self.env}


def comment_block(exp: Export, *, prefix: str = "# ") -> str:
    """The caveats of an export as comment lines (for shell and YAML outputs)."""
    lines = [f"{prefix}exported by `planner export --to {exp.target}` for {exp.version}; names and defaults from "
             f"{exp.source}"]
    if exp.cannot_express:
        lines.append(f"{prefix}{exp.target} cannot express these choices of the plan:")
        lines += [f"{prefix}  - {x}" for x in exp.cannot_express]
    if exp.notes:
        lines.append(f"{prefix}notes:")
        lines += [f"{prefix}  - {x}" for x in exp.notes]
    return "\n".join(lines)


def shell_command(program: str, flags: list[tuple[str, Any]]) -> str:
    """`program --flag value ...` with one flag per line; a value of None is a bare switch."""
    parts = [program]
    for name, value in flags:
        parts.append(name if value is None else f"{name} {shlex.quote(_text(value))}")
    return " \\\n    ".join(parts)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def flags_dict(flags: list[tuple[str, Any]]) -> dict[str, Any]:
    """Flags as a JSON object: switches are true."""
    return {name: (True if value is None else value) for name, value in flags}


def json_text(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


# ---- batch arithmetic ------------------------------------------------------------------------

def optimizer_batch(call: PlanCall) -> int:
    """Sequences per optimizer step of a train call."""
    assert call.kind == "train"
    return call.step_seqs


def micro_batch_per_gpu(call: PlanCall, layout: Layout | None = None) -> int:
    """Sequences one data-parallel rank processes at once (context-parallel ranks share them)."""
    lay = layout or call.layout
    rows = call.step_seqs
    return max(1, rows // lay.dp // lay.micro_batches)


def nodes_and_gpus(mesh: Mesh, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, GPUs per node) of an aligned mesh."""
    if mesh.size <= gpus_per_node:
        return 1, mesh.size
    return mesh.size // gpus_per_node, gpus_per_node


# ---- roles of an RLHF graph ------------------------------------------------------------------

@dataclass(frozen=True)
class Roles:
    """Which model plays which part in a PPO-style graph, and the calls of each part."""

    actor: str
    generate: PlanCall
    actor_train: PlanCall
    actor_inference: PlanCall | None  # the actor's own log-probs of its samples, recomputed before training
    critic: str | None
    critic_train: PlanCall | None
    critic_inference: PlanCall | None
    ref: str | None
    ref_inference: PlanCall | None
    reward: str | None
    reward_inference: PlanCall | None
    extra_calls: tuple[str, ...]  # calls no role covers (e.g. a second generate)


def roles(plan: Plan, *, target: str) -> Roles:
    """Find actor, critic, reference and reward by what their calls do (names are free)."""
    gens = [c for c in plan.calls if c.kind == "generate"]
    if not gens:
        raise PlannerError(f"plan {plan.name!r} has no generate call; {target} exports RLHF (PPO-style) plans",
                           hint="export a training-only plan with --to megatron or --to deepspeed")
    gen = gens[0]
    actor = gen.model

    def first(pred) -> PlanCall | None:  # noqa: ANN001
        return next((c for c in plan.calls if pred(c)), None)

    actor_train = first(lambda c: c.kind == "train" and c.model == actor)
    if actor_train is None:
        raise PlannerError(f"plan {plan.name!r} generates with {actor!r} but never trains it; "
                           f"{target} trains the actor")
    critic_train = first(lambda c: c.kind == "train" and plan.models[c.model].head == "value")
    critic = critic_train.model if critic_train else None
    critic_inf = first(lambda c: c.kind == "inference" and c.model == critic) if critic else None
    ref_inf = first(lambda c: c.kind == "inference" and c.returns == "logprobs" and not plan.models[c.model].trainable)
    reward_inf = first(lambda c: c.kind == "inference" and c.returns == "scores")
    actor_inf = first(lambda c: c.kind == "inference" and c.returns == "logprobs" and c.model == actor)
    used = {gen.name, actor_train.name} | {c.name for c in (actor_inf, critic_train, critic_inf, ref_inf, reward_inf) if c}
    return Roles(actor, gen, actor_train, actor_inf, critic, critic_train, critic_inf, ref_inf.model if ref_inf else None,
                 ref_inf, reward_inf.model if reward_inf else None, reward_inf,
                 tuple(c.name for c in plan.calls if c.name not in used))


def decode_layout(call: PlanCall) -> Layout:
    return call.decode_layout or call.layout


def samples_per_prompt(r: Roles) -> int:
    return r.generate.samples_per_prompt


def prompts(r: Roles) -> int:
    return r.generate.seqs // r.generate.samples_per_prompt


def role_calls(r: Roles) -> list[PlanCall]:
    return [c for c in (r.generate, r.actor_inference, r.actor_train, r.critic_inference, r.critic_train,
                        r.ref_inference, r.reward_inference) if c is not None]


def overlapping_iterations(plan: Plan) -> bool:
    """Whether the plan starts calls of the next iteration before this one ends."""
    end = max(c.est_start_s + c.est_time_s for c in plan.calls)
    return end > plan.estimate.iteration_s * (1 + 1e-6)


EXPERT_PARALLEL_TARGETS = ("Megatron-LM", "verl")  # the targets with an expert-parallel setting


def common_limits(plan: Plan, target: str) -> list[str]:
    """What no engine here expresses: overlapped iterations; and, for the targets without expert
    parallelism (DeepSpeed, OpenRLHF's DeepSpeed workers), experts split over ranks (other than a
    vLLM engine's tensor parallel, which splits every expert over its ranks as the plan's etp = tp)."""
    out = []
    if overlapping_iterations(plan):
        end = max(c.est_start_s + c.est_time_s for c in plan.calls)
        early_s = end - plan.estimate.iteration_s
        out.append(f"the plan overlaps iterations (the next starts {early_s:.3g} s before this one ends; steady "
                   f"state {plan.estimate.iteration_s:.3g} s): {target} runs iterations one after another")
    if target not in EXPERT_PARALLEL_TARGETS:
        for c in plan.calls:
            if c.kind == "generate" and c.layout.ep == 1:
                continue  # experts split over tp alone (etp = tp): vLLM's tensor-parallel fused MoE
            if c.layout.ep > 1 or c.layout.etp > 1:
                out.append(f"{c.name}: experts split over {c.layout.ep} expert-parallel x {c.layout.etp} tensor-parallel "
                           f"ranks; {target} holds every expert whole on each rank (ZeRO shards them like any weight)")
    return out


# ---- what every target needs from the plan beyond layouts -------------------------------------

def model_path(plan: Plan, model: str) -> str:
    """The checkpoint a role loads: the model's HF directory, else its preset name (a hub id or
    a local path the user substitutes; the notes say so)."""
    decl = plan.models[model]
    return decl.weights or decl.spec.name or model


def placeholder_paths(plan: Plan, models: list[str | None]) -> list[str]:
    """Notes for the models whose path in the export is a name, not a directory."""
    out = []
    for m in dict.fromkeys(x for x in models if x is not None):
        if plan.models[m].weights is None:
            out.append(f"{m}: the export names it {model_path(plan, m)!r}; set the path of your checkpoint")
    return out


def own_peak_bytes(plan: Plan, call: PlanCall) -> int:
    """Per-GPU bytes the call itself needs at its peak (its weights, KV cache or activations),
    without what other models keep resident on the same GPUs: what an engine that runs this call
    in its own memory pool (vLLM) must be allowed to take."""
    from cost_models import CostModel  # the cost model is heavy to import; exports of training-only plans skip it
    from planner.candidates import costed_view

    view = costed_view(call, plan.models[call.model])
    cost = CostModel(plan.cluster, framework=plan.estimate.framework or "torch").call_cost(call, view, call.mesh, call.layout, decode_layout=call.decode_layout)
    return int(cost.peak_mem_bytes)


def memory_fraction(plan: Plan, call: PlanCall) -> float:
    """vLLM's `gpu_memory_utilization` for a generate call: the share of a GPU's memory the plan
    gave it (weights, KV cache and activations as costed), rounded up to the next 0.01 so the
    engine's KV budget is at least the plan's."""
    share = own_peak_bytes(plan, call) / plan.cluster.mem_bytes
    return min(0.99, max(0.01, -(-round(share * 1e6) // 10_000) / 100))


def engine_micro_batch(rows: int, engine_dp: int, plan_micro: int) -> int:
    """Sequences per GPU per micro-batch for an engine whose data-parallel size is `engine_dp`:
    the plan's micro-batch when it divides the rows each engine rank gets, else the largest
    divisor of those rows below it (never more activation memory than the plan costed)."""
    per_rank = max(1, rows // engine_dp)
    for m in range(min(plan_micro, per_rank), 0, -1):
        if per_rank % m == 0:
            return m
    return 1


def refuse(target: str, plan: Plan, why: str, hint: str | None = None) -> PlannerError:
    """The error for a plan the target cannot run at all (nothing is emitted)."""
    return PlannerError(f"{target} cannot run plan {plan.name!r}: {why}", hint=hint)
