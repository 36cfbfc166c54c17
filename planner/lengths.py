"""Response lengths for costing generate calls: a user's mean, or the mean a previous run measured.

`gen_len` caps a response; how long responses really are decides what generation costs
(`cost_models.lengths`). ``planner compile --response-len-mean M`` gives the mean, and
``--response-len-from METRICS.jsonl`` takes it from a run's metrics (``--metrics-out`` of the
runtime, whose every step records the mean ``response_len`` of its rollouts): the mean over its
last `RECENT_STEPS` steps, since RL moves the lengths as it trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from plans.base import validated
from plans.errors import PlannerError
from plans.graph import Graph, ResponseLengths

RECENT_STEPS = 10
MAX_METRICS_BYTES = 1 << 30


def from_metrics(path: Path, *, steps: int = RECENT_STEPS) -> ResponseLengths:
    """The mean response length over the last `steps` steps of a runtime metrics file."""
    try:
        if path.stat().st_size > MAX_METRICS_BYTES:
            raise PlannerError(f"{str(path)!r} is larger than {MAX_METRICS_BYTES >> 30} GiB; not a metrics file")
        text = path.read_text()
    except OSError as e:
        raise PlannerError(f"cannot read the metrics file {str(path)!r}: {e.strerror or e}",
                           hint="give the --metrics-out file of a previous run") from None
    except UnicodeDecodeError:
        raise PlannerError(f"{str(path)!r} is not a text (JSONL) metrics file") from None
    values = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise PlannerError(f"{str(path)!r} line {n} is not JSON; a metrics file has one JSON object per step") \
                from None
        value = row.get("response_len") if isinstance(row, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 1:
            values.append(float(value))
    if not values:
        raise PlannerError(f"{str(path)!r} has no step with a response_len of at least 1",
                           hint="the runtime writes it with --metrics-out for plans that generate (ppo, grpo, rloo, remax)")
    recent = values[-steps:]
    return ResponseLengths(mean=sum(recent) / len(recent),
                           source=f"{path.name}: mean response_len of its last {len(recent)} steps")


def with_response_len(graph: Graph, lengths: ResponseLengths) -> Graph:
    """The graph with every generate call costed at `lengths` (each keeps its own gen_len cap)."""
    gens = [c for c in graph.calls if c.kind == "generate"]
    if not gens:
        raise PlannerError("--response-len-mean and --response-len-from describe generate calls; this graph has none")
    calls = []
    for c in graph.calls:
        if c.kind == "generate":
            c = validated(type(c), {**c.model_dump(), "response_len": lengths.model_dump()},
                          source=f"generate call {c.name!r}")
        calls.append(c)
    return graph.model_copy(update={"calls": calls})
