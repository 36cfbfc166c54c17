"""Checks of a plan beyond its schema (`planner validate`): does every call fit in memory under the
cost model, can this runtime run it (`plans.runnable`), does it run as it was costed, what code does
it name, and what would an engine it is exported to not take."""

from __future__ import annotations

from dataclasses import dataclass, field

from cost_models import CostModel
from cost_models.framework import engine_layout_problems, resolve_framework
from planner.candidates import costed_view
from plans.errors import PlannerError
from plans.graph import NamedCode, named_code
from plans.hardware import GIB
from plans.plan import Plan
from plans.runnable import runtime_problems, split_problems


@dataclass
class PlanCheck:
    """What `planner validate` reports. `problems`: the plan cannot run as it is (memory, or the
    runtime refuses it); `mismatches`: it runs, but not as its estimates assume; `export`: per
    engine asked about, the plan's choices it cannot take; `code`: the code the plan names."""

    problems: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    export: dict[str, list[str]] = field(default_factory=dict)
    code: list[NamedCode] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.problems or self.mismatches or any(self.export.values()))


def export_limits(plan: Plan, target: str) -> list[str]:
    """What `target` cannot take of `plan`: the exporter's own list, per train call for the
    engines that configure one model (Megatron-LM, DeepSpeed), or why it cannot export at all."""
    from planner.exports import export_plan

    per_call = target in ("megatron", "deepspeed")
    calls = [c.name for c in plan.calls if c.kind == "train"] if per_call else [None]
    out = []
    for name in calls:
        try:
            exp = export_plan(plan, target, call=name)
        except PlannerError as e:
            out.append((f"call {name!r}: " if name else "") + f"cannot export: {e.message}")
            continue
        out += [(f"call {name!r}: " if name else "") + x for x in exp.cannot_express]
    return out


def check_plan(plan: Plan, *, targets: tuple[str, ...] = ()) -> PlanCheck:
    """Every check of `planner validate` on `plan`, with `targets` the engines to check exports for."""
    return PlanCheck(problems=memory_problems(plan) + runtime_problems(plan) + stack_problems(plan),
                     mismatches=split_problems(plan), export={t: export_limits(plan, t) for t in targets},
                     code=named_code(plan.graph()))


def stack_problems(plan: Plan) -> list[str]:
    """Calls the engines of the stack the plan was costed for do not run as placed
    (`cost_models.framework.engine_layout_problems`, `EngineLayouts.whole_pool`): a plan compiled
    for that stack has none; an edited one may."""
    fw = resolve_framework(plan.estimate.framework or "torch")
    world = plan.cluster.world_size
    out = []
    for c in plan.calls:
        out += [f"call {c.name!r}: {why}" for why in
                engine_layout_problems(fw, c.kind, c.layout, c.decode_layout, returns=c.returns)]
        if fw.layouts.whole_pool and c.mesh.size != world:
            out.append(f"call {c.name!r} runs on GPUs {c.mesh.short()} only: {fw.layouts.engines} run every call on "
                       f"all {world} GPUs")
    return out


def memory_problems(plan: Plan) -> list[str]:
    """Calls whose estimated peak memory (as stated, and as re-estimated) exceeds a GPU."""
    cap = plan.cluster.usable_mem_bytes
    cm = CostModel(plan.cluster, framework=plan.estimate.framework or "torch")
    out = []
    for c in plan.calls:
        cost = cm.call_cost(c, costed_view(c, plan.models[c.model]), c.mesh, c.layout)
        peak = max(c.est_peak_mem_bytes, cost.peak_mem_bytes)
        if peak > cap:
            out.append(f"call {c.name!r} needs {peak / GIB:.1f} GiB per GPU, more than the {cap / GIB:.1f} GiB a plan may use of a {plan.cluster.gpu} "
                       f"({plan.cluster.mem_bytes / GIB:.0f} GiB less a headroom of {plan.cluster.headroom_bytes / GIB:.1f} GiB)")
    return out
