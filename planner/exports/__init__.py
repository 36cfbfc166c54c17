"""A plan in the terms of the engines people already run: Megatron-LM, DeepSpeed, verl, OpenRLHF.

Each exporter maps what the target can express (parallel degrees, batch sizes, placement, ZeRO,
recompute) with its documented flag or key names (cited in each module), and lists every choice
of the plan it cannot express, so nobody mistakes the export for the plan.

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


def export_plan(plan: Plan, target: str, *, call: str | None = None) -> Export:
    """Export `plan` to `target` (one of `EXPORTERS`); `call` picks one train call where the
    target configures a single model (megatron, deepspeed)."""
    if target not in EXPORTERS:
        raise PlannerError(f"unknown export target {target!r}", hint=f"targets: {', '.join(EXPORTERS)}")
    return EXPORTERS[target](plan, call=call)


__all__ = ["EXPORTERS", "Export", "export_plan"]
