"""What a run shows while it goes and leaves behind: a progress line per step, the measured trace.

Rank 0 prints one plain line per step (it already holds every call's time in the step's metrics):

    step 3/10  61.2 ms | actor_generate 20.1 ms, critic_inference 4.2 ms (+ realloc 3.6 ms), ... | reward_mean 0.31

The measured timeline is every rank's spans (`PlanRunner.recorder`, one time origin shared by all
ranks), gathered on rank 0 and written as one planner trace (`plans.trace`), which
`planner timeline PLAN --measured TRACE` lays under the prediction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from plans.plan import Plan
from plans.trace import trace_document, write_trace

STATS_SHOWN = ("reward_mean", "kl_mean")  # besides each train call's loss


def fmt_s(seconds: float) -> str:
    """A duration for people: milliseconds below a second."""
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.1f} ms"


def progress_line(metrics: dict[str, Any], *, plan: Plan, steps: int) -> str:
    """One step's time, each call's time (and its reallocation's) and the main statistics."""
    calls = []
    for c in plan.calls:
        t = metrics.get(f"{c.name}.time_s")
        if t is None:
            continue
        move = metrics.get(f"{c.name}.realloc_time_s")
        calls.append(f"{c.name} {fmt_s(t)}" + (f" (+ realloc {fmt_s(move)})" if move else ""))
    stats = [f"{k} {metrics[k]:.4g}" for k in STATS_SHOWN if k in metrics]
    stats += [f"{c.name}.loss {metrics[f'{c.name}.loss']:.4g}" for c in plan.calls if f"{c.name}.loss" in metrics]
    parts = [f"step {metrics['step']}/{steps}  {fmt_s(metrics['time_s'])}", ", ".join(calls), "  ".join(stats)]
    return " | ".join(p for p in parts if p)


def gather_events(events: list[dict[str, Any]], *, distributed: bool, rank: int,
                  world_size: int) -> list[dict[str, Any]] | None:
    """Every rank's trace events on rank 0 (None on the other ranks); a collective of all ranks."""
    if not distributed:
        return list(events)
    parts: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(list(events), parts, dst=0)
    if parts is None:
        return None
    return [e for part in parts for e in part]


def write_measured_trace(path: str | Path, events: list[dict[str, Any]], *, plan: Plan, world_size: int,
                         steps: int, reference: bool) -> None:
    """Write the gathered events as one planner trace (atomically)."""
    doc = trace_document(events, source="measured", plan=plan.name, world_size=world_size,
                         extra={"steps": steps, "reference": reference})
    write_trace(path, doc)
