"""Elastic re-planning: the same iteration graph compiled for a different cluster.

When a job is resized (GPUs lost, a node preempted, more capacity granted) the models and calls
stay the same; only the placement changes. `replan` recompiles a plan's graph (`Plan.graph()`)
for the new cluster under the same search rule (the old plan's baseline, if it was one) and
returns both plans side by side. The new plan has the same graph fingerprint
(`plans.checkpoint.graph_fingerprint`), which is what lets the runtime resume a checkpoint written
under the old plan by resharding it to the new layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.baselines import BASELINES
from planner.candidates import SearchSpace
from planner.compile import Progress, compile_graph
from plans.checkpoint import graph_fingerprint
from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.plan import Plan


@dataclass(frozen=True)
class Replanned:
    """An old plan and the plan of the same graph for a new cluster."""

    old: Plan
    new: Plan

    @property
    def speedup(self) -> float | None:
        """Old iteration time over new (above 1: the new plan is faster); None when either is 0."""
        old_s, new_s = self.old.estimate.iteration_s, self.new.estimate.iteration_s
        return old_s / new_s if old_s > 0 and new_s > 0 else None

    def moved_models(self) -> list[str]:
        """Models whose parameters sit differently at rest (home call mesh or degrees changed), so
        a checkpoint of the old plan must be resharded to resume under the new one."""
        out = []
        for model in self.old.models:
            old, new = _home(self.old, model), _home(self.new, model)
            if old is None or new is None:
                continue
            if (old.mesh.ranks, old.layout) != (new.mesh.ranks, new.layout):
                out.append(model)
        return out

    def to_json(self) -> dict:
        """Both plans' headline figures, per-call placements, and what a resume must reshard."""
        def side(p: Plan) -> dict:
            return {"cluster": p.cluster.short(), "gpus": p.cluster.world_size, "iteration_s": p.estimate.iteration_s,
                    "tokens_per_s": p.estimate.tokens_per_s, "mfu": p.estimate.mfu,
                    "peak_mem_bytes": p.estimate.peak_mem_bytes, "method": p.search.method}
        calls = [{"call": c.name, "old_mesh": self.old.call(c.name).mesh.short(),
                  "old_layout": self.old.call(c.name).layout.short(), "new_mesh": c.mesh.short(),
                  "new_layout": c.layout.short()} for c in self.new.calls]
        return {"name": self.new.name, "graph_fingerprint": graph_fingerprint(self.new.graph()),
                "old": side(self.old), "new": side(self.new), "speedup": self.speedup,
                "reshard_models": self.moved_models(), "calls": calls}


def _home(plan: Plan, model: str):  # noqa: ANN202 - PlanCall | None
    """The call holding `model`'s parameters between iterations: its last train call, else its first."""
    calls = [c for c in plan.calls if c.model == model]
    trains = [c for c in calls if c.kind == "train"]
    return trains[-1] if trains else (calls[0] if calls else None)


def baseline_of(plan: Plan) -> str | None:
    """The baseline rule a plan was compiled under (its search method names it), or None."""
    name = plan.search.method.split(" ", 1)[0]
    return name if name in BASELINES else None


def replan(plan: Plan, cluster: ClusterSpec, *, time_limit_s: float = 10.0, baseline: str | None = "same",
           calibration=None, progress: Progress | None = None) -> Replanned:  # noqa: ANN001
    """Compile `plan`'s graph for `cluster`.

    `baseline` is "same" (the old plan's rule: a baseline if it was compiled as one, else the full
    search), None (the full search), or a baseline name. A graph that cannot run on the new cluster
    is a `PlannerError` that names both clusters and what does not fit."""
    rule = baseline_of(plan) if baseline == "same" else baseline
    # A plan that trains with GaLore keeps it on offer (the same rank and interval) for the new cluster.
    galore = plan.galore_call()
    space = SearchSpace(galore=galore.layout.galore) if galore is not None and rule is None else None
    try:
        new = compile_graph(plan.graph(), cluster, time_limit_s=time_limit_s, baseline=rule, space=space,
                            calibration=calibration, progress=progress, framework=plan.estimate.framework or "torch")
    except PlannerError as e:
        raise PlannerError(
            f"plan {plan.name!r} (on {plan.cluster.short()}) cannot be re-planned for {cluster.short()}: {e.message}",
            hint=e.hint or "choose a cluster with more or larger GPUs",
        ) from None
    return Replanned(old=plan, new=new)
