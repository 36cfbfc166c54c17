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

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "settings": self.data, "cannot_express": self.cannot_express,
                "notes": self.notes, "source": self.source}


def comment_block(exp: Export, *, prefix: str = "# ") -> str:
    """The caveats of an export as comment lines (for shell and YAML outputs)."""
    lines = [f"{prefix}exported by `planner export --to {exp.target}`; flag names from {exp.source}"]
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
    return call.seqs // call.minibatches


def micro_batch_per_gpu(call: PlanCall, layout: Layout | None = None) -> int:
    """Sequences one data-parallel rank processes at once (context-parallel ranks share them)."""
    lay = layout or call.layout
    rows = optimizer_batch(call) if call.kind == "train" else call.seqs
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
    used = {gen.name, actor_train.name} | {c.name for c in (critic_train, critic_inf, ref_inf, reward_inf) if c}
    return Roles(actor, gen, actor_train, critic, critic_train, critic_inf, ref_inf.model if ref_inf else None, ref_inf,
                 reward_inf.model if reward_inf else None, reward_inf,
                 tuple(c.name for c in plan.calls if c.name not in used))


def decode_layout(call: PlanCall) -> Layout:
    return call.decode_layout or call.layout


def samples_per_prompt(r: Roles) -> int:
    return r.generate.samples_per_prompt


def prompts(r: Roles) -> int:
    return r.generate.seqs // r.generate.samples_per_prompt


def role_calls(r: Roles) -> list[PlanCall]:
    return [c for c in (r.generate, r.actor_train, r.critic_inference, r.critic_train, r.ref_inference,
                        r.reward_inference) if c is not None]


def overlapping_iterations(plan: Plan) -> bool:
    """Whether the plan starts calls of the next iteration before this one ends."""
    end = max(c.est_start_s + c.est_time_s for c in plan.calls)
    return end > plan.estimate.iteration_s * (1 + 1e-6)


def common_limits(plan: Plan, target: str) -> list[str]:
    """What no engine here expresses: overlapped iterations."""
    if overlapping_iterations(plan):
        end = max(c.est_start_s + c.est_time_s for c in plan.calls)
        early_s = end - plan.estimate.iteration_s
        return [f"the plan overlaps iterations (the next starts {early_s:.3g} s before this one ends; steady "
                f"state {plan.estimate.iteration_s:.3g} s): {target} runs iterations one after another"]
    return []
