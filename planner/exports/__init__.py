"""A plan in the terms of the engines people already run: Megatron-LM, DeepSpeed, verl, OpenRLHF.

Each exporter targets one release of its engine (`TARGETS`: Megatron-LM core_v0.19.0, DeepSpeed
0.19, verl 0.9, OpenRLHF 0.11), maps what it can express (parallel degrees, batch sizes on the
engine's own data-parallel size, placement and colocation, ZeRO, recompute, the KV budget) with
that release's key names and defaults (cited in each module), lists every choice of the plan it
cannot express, and refuses a plan it cannot run at all. `make test-engines` feeds every export
of a plan matrix to the engines' own parsers and validators.

    exp = export_plan(plan, "verl")
    print(exp.text)            # what to run
    exp.cannot_express         # where the run will differ from the plan
"""

from __future__ import annotations

from collections.abc import Callable

from planner.exports import deepspeed, megatron, openrlhf, verl
from planner.exports.common import Export
from plans.errors import PlannerError
from plans.plan import Plan

EXPORTERS: dict[str, Callable[..., Export]] = {
    "megatron": megatron.export,
    "deepspeed": deepspeed.export,
    "verl": verl.export,
    "openrlhf": openrlhf.export,
}
# The release each exporter targets (names, defaults and checks come from it), and the versions
# `--target-version` accepts for it (a release or a prefix of one).
TARGETS: dict[str, str] = {"megatron": megatron.VERSION, "deepspeed": deepspeed.VERSION, "verl": verl.VERSION,
                           "openrlhf": openrlhf.VERSION}
VERSIONS: dict[str, tuple[str, ...]] = {"megatron": ("core_v0.19.0", "0.19"), "deepspeed": ("0.19",),
                                        "verl": ("0.9",), "openrlhf": ("0.11",)}


def check_version(target: str, version: str) -> None:
    """A `PlannerError` unless `version` is a release of `target` the exporter supports."""
    v = version.strip().removeprefix("v")
    if not any(v == ok or v.startswith(ok + ".") or v == ok.removeprefix("core_v") for ok in VERSIONS[target]):
        raise PlannerError(f"--target-version {version!r}: the {target} exporter targets {TARGETS[target]} only",
                           hint=f"supported: {', '.join(VERSIONS[target])}; other releases rename keys and flags")


def export_plan(plan: Plan, target: str, *, call: str | None = None, version: str | None = None) -> Export:
    """Export `plan` to `target` (one of `EXPORTERS`); `call` picks one train call where the
    target configures a single model (megatron, deepspeed); `version` checks the release asked
    for is the one the exporter targets."""
    if target not in EXPORTERS:
        raise PlannerError(f"unknown export target {target!r}", hint=f"targets: {', '.join(EXPORTERS)}")
    if version is not None:
        check_version(target, version)
    galore = plan.galore_call()
    if galore is not None and galore.layout.galore is not None:  # no engine has it: its config would train with AdamW
        raise PlannerError(f"call {galore.name!r} trains with a GaLore optimizer ({galore.layout.galore.short()}), "
                           f"which {TARGETS[target]} does not have; its config would train with AdamW, in memory the "
                           "plan did not count",
                           hint="run the plan with the planner's runtime (python -m runtime PLAN), or compile it again "
                                "without --galore-rank to export it")
    exp = EXPORTERS[target](plan, call=call)
    note = stack_note(plan, target)
    if note:
        exp.notes.insert(0, note)
    return exp


# The framework presets (`cost_models.framework`) that cost each target's engines (verl: its
# Megatron workers, or its FSDP workers).
STACKS: dict[str, tuple[str, ...]] = {"megatron": ("megatron-core", "megatron"),
                                      "deepspeed": ("megatron-core", "rlhf-engine-hf"),
                                      "verl": ("rlhf-engine", "verl-fsdp"), "openrlhf": ("rlhf-engine-hf",)}


def stack_note(plan: Plan, target: str) -> str | None:
    """What to say when `plan` was costed for a stack other than `target`'s engines: its times,
    memory and layouts are those of another software stack."""
    fw = plan.estimate.framework or "torch"
    ok = STACKS[target]
    if fw in ok:
        return None
    alt = " or ".join(f"--framework {x}" for x in ok)
    return (f"the plan was costed for framework {fw}, not for {TARGETS[target]}'s stack: its times, memory and "
            f"layouts are those of {fw}'s kernels and engines; compile it with {alt} to cost it as the target runs "
            "and keep it to layouts the target runs")


__all__ = ["EXPORTERS", "STACKS", "TARGETS", "VERSIONS", "Export", "check_version", "export_plan"]
