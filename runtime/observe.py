"""What a run shows while it goes and leaves behind: a progress line per step, the measured trace.

Rank 0 prints one plain line per step (it already holds every call's time in the step's metrics):

    step 3/10  61.2 ms | actor_generate 20.1 ms, critic_inference 4.2 ms (+ realloc 3.6 ms), ... | reward_mean 0.31

The measured timeline is every rank's spans (`PlanRunner.recorder`, one time origin shared by all
ranks), gathered on rank 0 and written as one planner trace (`plans.trace`), which
`planner timeline PLAN --measured TRACE` lays under the prediction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plans.io import write_text_atomic
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


class MemoryMeter:
    """The most bytes this rank's tensor allocator held over the run (``--memory-out``).

    On CUDA, the caching allocator's own peak of allocated bytes (`torch.cuda.max_memory_allocated`).
    On a CPU, the CPU allocator reports each allocation and free to the profiler with its running
    total of allocated bytes; the meter profiles memory only (no shapes, no stacks) from before the
    plan's models are built to the end of the run and keeps that total's peak. Both count tensor
    bytes, not the process's other memory (interpreter, libraries, gloo's own buffers).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._prof: Any = None

    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)

    def peaks(self) -> dict[str, Any]:
        """{"peak": bytes over the run, "calls": {call: the most bytes while it ran on this rank}}
        (calls only on a CPU: from the profiler's ranges around each call, `executor.CALL_MARK`)."""
        if self.device.type == "cuda":
            return {"peak": int(torch.cuda.max_memory_allocated(self.device)), "calls": {}}
        from runtime.executor import CALL_MARK

        assert self._prof is not None, "the meter has not run"
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            self._prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text()).get("traceEvents", [])
        mem = sorted((e["ts"], e["args"].get("Total Allocated", 0)) for e in events
                     if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0)
        calls: dict[str, int] = {}
        starts: dict[str, int] = {}  # held when the call began: the states resident on the rank
        for e in events:
            name = e.get("name", "")
            if e.get("ph") != "X" or not name.startswith(CALL_MARK):
                continue
            lo, hi = e["ts"], e["ts"] + e.get("dur", 0)
            before = [t for ts, t in mem if ts < lo][-1:]  # what was held when the call began
            inside = [t for ts, t in mem if lo <= ts <= hi]
            call = name[len(CALL_MARK):]
            calls[call] = max(calls.get(call, 0), *before, *inside, 0)
            starts[call] = max(starts.get(call, 0), *before, 0)
        return {"peak": int(max((t for _, t in mem), default=0)), "calls": calls, "starts": starts}


def write_memory(path: str | Path, ranks: list[dict[str, Any]], *, plan: Plan, device: str) -> None:
    """Every rank's peak allocated bytes (over the run, and per call) beside the plan's estimates
    (atomically)."""
    calls: dict[str, int] = {}
    starts: dict[str, int] = {}
    for r in ranks:
        for name, b in r["calls"].items():
            calls[name] = max(calls.get(name, 0), b)
            starts[name] = max(starts.get(name, 0), r.get("starts", {}).get(name, 0))
    doc = {"format": "planner-memory/1", "plan": plan.name, "device": device,
           "peak_allocated_bytes": [r["peak"] for r in ranks], "estimated_peak_mem_bytes": plan.estimate.peak_mem_bytes,
           "calls": {c.name: {"measured_bytes": calls.get(c.name), "measured_at_start_bytes": starts.get(c.name),
                              "estimated_bytes": c.est_peak_mem_bytes} for c in plan.calls}}
    write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
