"""Checks of a plan beyond its schema: does every call fit in memory under the cost model."""

from __future__ import annotations

from cost_models import CostModel
from plans.hardware import GIB
from plans.plan import Plan


def memory_problems(plan: Plan) -> list[str]:
    """Calls whose estimated peak memory (as stated, and as re-estimated) exceeds a GPU."""
    cap = plan.cluster.mem_bytes
    cm = CostModel(plan.cluster)
    out = []
    for c in plan.calls:
        decl = plan.models[c.model]
        if c.kind != "train":
            decl = decl.model_copy(update={"trainable": False})
        cost = cm.call_cost(c, decl, c.mesh, c.layout)
        peak = max(c.est_peak_mem_bytes, cost.peak_mem_bytes)
        if peak > cap:
            out.append(f"call {c.name!r} needs {peak / GIB:.1f} GiB per GPU, more than the {cap / GIB:.0f} GiB of a {plan.cluster.gpu}")
    return out
