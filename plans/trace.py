"""Timelines in the Trace Event Format: what the planner predicts and what the runtime measures.

One format serves both sides, so a predicted and a measured timeline compare event by event and
either opens in Perfetto (ui.perfetto.dev) or chrome://tracing. It is the JSON Object Format of
the Trace Event Format (Google, "Trace Event Format",
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU)::

    {"traceEvents": [...], "displayTimeUnit": "ms",
     "otherData": {"format": "planner-trace", "version": 1, "source": "measured", "plan": "tiny_ppo",
                   "world_size": 4}}

Events of a planner trace:

- one ``"X"`` (complete) event per call, per step, per rank of the call's mesh::

      {"name": "actor_train", "cat": "call", "ph": "X", "ts": 10873.2, "dur": 11904.0, "pid": 0, "tid": 0,
       "args": {"step": 3, "call": "actor_train", "kind": "train", "model": "actor"}}

- one ``"X"`` event per parameter reallocation, per step, per rank that sends or receives in it
  (the ranks of both the source and the destination placement), named ``realloc:<to_call>``::

      {"name": "realloc:critic_inference", "cat": "realloc", "ph": "X", ..., "args": {"step": 3,
       "call": "critic_inference", "kind": "realloc", "model": "critic", "from_call": "critic_train"}}

- ``"M"`` (metadata) events naming each process (``process_name``: ``rank 0``, ...).

``ts`` and ``dur`` are microseconds (the format's unit) from one time origin shared by all ranks:
ranks of one host read one clock, so their spans align exactly (`clock_offsets_s`; a barrier's
exit alone is several milliseconds apart on ranks that share cores), and hosts align by the
earliest exit of a barrier on each;
``pid`` is the global rank and ``tid`` 0. A measured trace is written by the runtime
(``--trace-out FILE``): rank 0 gathers every rank's events and writes one file. `TraceRecorder`
records spans on a rank; `trace_document` builds the file; `load_trace` reads and checks one or
more files; `call_times_s` turns spans into per-call times, the figure a prediction is judged by.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plans.base import loads_json
from plans.errors import PlannerError, brief
from plans.io import write_text_atomic

TRACE_FORMAT = "planner-trace"
TRACE_VERSION = 1
US_PER_S = 1e6
# Phases the Trace Event Format defines: duration (B, E), complete (X), instant (i, I), counter (C),
# async (b, n, e), flow (s, t, f), sample (P), object (N, O, D), metadata (M), memory dump (V, v),
# mark (R), clock sync (c), context (parentheses).
PHASES = frozenset("BEXiICbnestfPNODMVvRc()")
METADATA_NAMES = frozenset({"process_name", "process_labels", "process_sort_index", "thread_name",
                            "thread_sort_index"})
DISPLAY_UNITS = frozenset({"ms", "ns"})
CATEGORIES = ("call", "realloc")
KINDS = frozenset({"generate", "inference", "train", "realloc"})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _event_problems(i: int, e: Any) -> list[str]:
    """Rules of the Trace Event Format one event breaks."""
    where = f"traceEvents[{i}]"
    if not isinstance(e, dict):
        return [f"{where} is not an object"]
    ph = e.get("ph")
    if not isinstance(ph, str) or ph not in PHASES:
        return [f"{where}: ph {ph!r} is not a Trace Event Format phase ({''.join(sorted(PHASES))})"]
    out = []
    for key in ("pid", "tid"):
        if key in e and not _is_int(e[key]):
            out.append(f"{where}: {key} must be an integer, got {e[key]!r}")
    if "cat" in e and not isinstance(e["cat"], str):
        out.append(f"{where}: cat must be a string")
    if "args" in e and not isinstance(e["args"], dict):
        out.append(f"{where}: args must be an object")
    if ph == "M":
        if e.get("name") not in METADATA_NAMES:
            out.append(f"{where}: metadata name {e.get('name')!r} is not one of {sorted(METADATA_NAMES)}")
        if not _is_int(e.get("pid")):
            out.append(f"{where}: metadata needs an integer pid")
        return out
    if not isinstance(e.get("name"), str):
        out.append(f"{where}: name must be a string")
    if not _is_number(e.get("ts")):
        out.append(f"{where}: ts must be a number (microseconds), got {e.get('ts')!r}")
    for key in ("pid", "tid"):
        if key not in e:
            out.append(f"{where}: {key} is missing")
    if ph == "X":
        dur = e.get("dur")
        if not _is_number(dur) or float(dur) < 0:  # type: ignore[arg-type]
            out.append(f"{where}: a complete event needs dur >= 0 (microseconds), got {dur!r}")
    return out


def trace_problems(doc: Any) -> list[str]:
    """Every rule of the Trace Event Format (JSON Array or Object Format) that `doc` breaks."""
    events: Any
    if isinstance(doc, list):
        events = doc
    elif isinstance(doc, dict):
        events = doc.get("traceEvents")
        if not isinstance(events, list):
            return ["a JSON Object Format trace needs a traceEvents array"]
        unit = doc.get("displayTimeUnit")
        if unit is not None and unit not in DISPLAY_UNITS:
            return [f"displayTimeUnit {unit!r} must be 'ms' or 'ns'"]
    else:
        return ["a trace is a JSON array of events or an object with traceEvents"]
    return [p for i, e in enumerate(events) for p in _event_problems(i, e)]


def planner_trace_problems(doc: Any) -> list[str]:
    """`trace_problems` plus the rules of a planner trace: the header, and the step, call, kind and
    model every call or reallocation event carries."""
    problems = trace_problems(doc)
    if problems:
        return problems
    if not isinstance(doc, dict):
        return ["a planner trace is a JSON Object Format document (an object with traceEvents)"]
    other = doc.get("otherData")
    if not isinstance(other, dict) or other.get("format") != TRACE_FORMAT:
        return [f"otherData.format must be {TRACE_FORMAT!r} (is this a trace written by the planner or runtime?)"]
    if other.get("version") != TRACE_VERSION:
        return [f"trace version {other.get('version')!r} is not supported (this planner reads {TRACE_VERSION})"]
    if not _is_int(other.get("world_size")) or other["world_size"] < 1:
        problems.append("otherData.world_size must be a positive integer")
    for i, e in enumerate(doc["traceEvents"]):
        if e["ph"] != "X":
            continue
        where = f"traceEvents[{i}] ({e.get('name')!r})"
        args = e.get("args") or {}
        if e.get("cat") not in CATEGORIES:
            problems.append(f"{where}: cat must be one of {CATEGORIES}")
        if not _is_int(args.get("step")) or args["step"] < 0:
            problems.append(f"{where}: args.step must be a non-negative integer")
        for key in ("call", "model"):
            if not isinstance(args.get(key), str):
                problems.append(f"{where}: args.{key} must be a string")
        if args.get("kind") not in KINDS:
            problems.append(f"{where}: args.kind must be one of {sorted(KINDS)}")
        elif (args["kind"] == "realloc") != (e.get("cat") == "realloc"):
            problems.append(f"{where}: kind 'realloc' goes with cat 'realloc' and only there")
        if e.get("cat") == "realloc" and not isinstance(args.get("from_call"), str):
            problems.append(f"{where}: a reallocation needs args.from_call")
        if _is_int(e.get("pid")) and _is_int(other.get("world_size")) and not 0 <= e["pid"] < other["world_size"]:
            problems.append(f"{where}: pid {e['pid']} is not a rank of a world of {other['world_size']}")
    return problems


def complete_event(name: str, *, cat: str, start_s: float, dur_s: float, rank: int, step: int, call: str,
                   kind: str, model: str, from_call: str | None = None) -> dict[str, Any]:
    """One planner ``"X"`` event; times in seconds from the shared origin, written in microseconds."""
    args: dict[str, Any] = {"step": step, "call": call, "kind": kind, "model": model}
    if from_call is not None:
        args["from_call"] = from_call
    return {"name": name, "cat": cat, "ph": "X", "ts": round(start_s * US_PER_S, 3),
            "dur": round(max(dur_s, 0.0) * US_PER_S, 3), "pid": rank, "tid": 0, "args": args}


def realloc_name(to_call: str) -> str:
    """Event name of the reallocation that feeds `to_call`."""
    return f"realloc:{to_call}"


def metadata_event(name: str, *, pid: int, value: str | int, tid: int | None = None) -> dict[str, Any]:
    """A ``"M"`` event: process_name / thread_name take a string, *_sort_index an integer."""
    key = "sort_index" if name.endswith("sort_index") else "name"
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": pid, "args": {key: value}}
    if tid is not None:
        event["tid"] = tid
    return event


def trace_document(events: Iterable[dict[str, Any]], *, source: str, plan: str, world_size: int,
                   extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A planner trace: `events` plus a process name per rank, sorted for stable bytes."""
    xs = sorted(events, key=lambda e: (e["pid"], e["ts"], e["name"]))
    ranks = sorted({e["pid"] for e in xs} | set(range(world_size)))
    meta = [metadata_event("process_name", pid=r, value=f"rank {r}") for r in ranks]
    other: dict[str, Any] = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "source": source, "plan": plan,
                             "world_size": world_size}
    other.update(extra or {})
    return {"traceEvents": meta + xs, "displayTimeUnit": "ms", "otherData": other}


def write_trace(path: str | Path, doc: dict[str, Any]) -> None:
    """Write a trace document atomically (stable key order, so equal traces are equal bytes)."""
    write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def clock_offsets_s(readings: list[tuple[str, float]]) -> list[float]:
    """Each rank's time origin relative to the shared one, from every rank's (host, wall clock read
    right after a barrier). Ranks of one host read the same clock, so their offsets are exact:
    each is its reading minus the host's earliest. Hosts' clocks are not compared (they agree
    only as well as their time service); each host's earliest exit of the barrier is taken as the
    same moment, as close as the barrier's own completion."""
    first: dict[str, float] = {}
    for host, wall in readings:
        first[host] = min(wall, first.get(host, wall))
    return [wall - first[host] for host, wall in readings]


def host_id() -> str:
    """What identifies the clock this process reads: the machine's name and, on Linux, the boot of
    its kernel (two containers of one machine share a clock; two machines named alike do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class TraceRecorder:
    """Records the spans of one rank. Create it right after a barrier on every rank, with
    `offset_s` this rank's origin relative to the shared one (`clock_offsets_s`), so all recorders
    share one time origin; pass ``sync`` (e.g. ``torch.cuda.synchronize``) when work is
    asynchronous, so a span ends when its kernels do, not when they are queued."""

    def __init__(self, rank: int, *, sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, offset_s: float = 0.0) -> None:
        self.rank = rank
        self._sync = sync or (lambda: None)
        self._clock = clock
        self._origin = clock() - offset_s
        self.events: list[dict[str, Any]] = []

    @contextmanager
    def call(self, name: str, *, step: int, kind: str, model: str) -> Iterator[None]:
        """Time the body as call `name` of `step` on this rank."""
        with self._span(name, cat="call", step=step, call=name, kind=kind, model=model):
            yield

    @contextmanager
    def realloc(self, to_call: str, *, step: int, model: str, from_call: str) -> Iterator[None]:
        """Time the body as the reallocation of `model` from `from_call`'s placement to `to_call`'s."""
        with self._span(realloc_name(to_call), cat="realloc", step=step, call=to_call, kind="realloc",
                        model=model, from_call=from_call):
            yield

    @contextmanager
    def _span(self, name: str, **fields: Any) -> Iterator[None]:
        self._sync()
        t0 = self._clock()
        yield
        self._sync()
        t1 = self._clock()
        self.events.append(complete_event(name, start_s=t0 - self._origin, dur_s=t1 - t0, rank=self.rank, **fields))


@dataclass(frozen=True)
class Span:
    """One ``"X"`` event of a planner trace, in seconds."""

    rank: int
    step: int
    cat: str  # "call" or "realloc"
    call: str  # the call (for a reallocation: the call it feeds)
    kind: str
    model: str
    start_s: float
    dur_s: float
    from_call: str | None = None

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s

    @property
    def key(self) -> tuple[str, str]:
        """What a span is an instance of, across ranks and steps: (cat, call)."""
        return (self.cat, self.call)


def spans(doc: Mapping[str, Any]) -> list[Span]:
    """The call and reallocation spans of a (checked) planner trace."""
    out = []
    for e in doc["traceEvents"]:
        if e["ph"] != "X":
            continue
        a = e["args"]
        out.append(Span(rank=e["pid"], step=a["step"], cat=e["cat"], call=a["call"], kind=a["kind"], model=a["model"],
                        start_s=e["ts"] / US_PER_S, dur_s=e["dur"] / US_PER_S, from_call=a.get("from_call")))
    return sorted(out, key=lambda s: (s.step, s.start_s, s.rank, s.key))


def load_trace(paths: str | Path | Iterable[str | Path]) -> dict[str, Any]:
    """Read and check one planner trace, or several (e.g. one per rank) merged into one."""
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    if not paths:
        raise PlannerError("no trace file given")
    docs = []
    for path in paths:
        try:
            raw = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise PlannerError(f"cannot read trace {brief(str(path))}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise PlannerError(f"trace {brief(str(path))} is not a text (UTF-8) file: {e.reason} at byte {e.start}") from None
        doc = loads_json(raw, source=f"trace {brief(str(path))}")
        problems = planner_trace_problems(doc)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise PlannerError(f"trace {str(path)!r} is not a planner trace: " + "; ".join(problems[:5]) + more,
                               hint="measured traces come from `python -m runtime PLAN --trace-out FILE`")
        docs.append(doc)
    head = docs[0]["otherData"]
    for path, doc in zip(paths[1:], docs[1:]):
        other = doc["otherData"]
        if (other.get("plan"), other["world_size"]) != (head.get("plan"), head["world_size"]):
            raise PlannerError(f"trace {str(path)!r} is of plan {other.get('plan')!r} on {other['world_size']} ranks, "
                               f"but {str(paths[0])!r} of {head.get('plan')!r} on {head['world_size']}")
    events = [e for doc in docs for e in doc["traceEvents"] if e["ph"] == "X"]
    return trace_document(events, source=head.get("source", "measured"), plan=head.get("plan", ""),
                          world_size=head["world_size"],
                          extra={k: v for k, v in head.items() if k not in ("format", "version", "source", "plan",
                                                                            "world_size")})


def steps_of(items: Iterable[Span]) -> list[int]:
    """The steps that have spans, ascending."""
    return sorted({s.step for s in items})


def step_window_s(items: Iterable[Span], step: int) -> tuple[float, float]:
    """(first start, last end) of `step`'s spans over all ranks."""
    mine = [s for s in items if s.step == step]
    if not mine:
        raise PlannerError(f"the trace has no spans in step {step}")
    return min(s.start_s for s in mine), max(s.end_s for s in mine)


def call_times_s(items: Iterable[Span], *, skip_steps: int = 1, start: str = "last") -> dict[tuple[str, str], float]:
    """Mean time per (cat, call) over steps: in each step, from its last rank's start to its last
    rank's end (a call is done when its slowest rank is). The first `skip_steps` steps (warm-up:
    allocation, first-touch, lazy initialisation) are left out when later steps exist.

    Why the last start: a prediction times a call from the moment all of its ranks are free and
    its inputs have arrived, and a rank's span begins at exactly that moment for that rank, so the
    call's predicted start is its last rank's start. Ranks that start earlier were free earlier
    because they left the previous calls sooner (or got their inputs sooner); that spread is the
    lateness of the previous calls on the other ranks, already in *their* times, and counting it
    again here would charge every call for its predecessors' stragglers. ``start="first"`` gives
    the first-start-to-last-end span, spread included."""
    if start not in ("last", "first"):
        raise ValueError(f"start must be 'last' or 'first', not {start!r}")
    pick = max if start == "last" else min
    items = list(items)
    steps = steps_of(items)
    kept = set(steps[skip_steps:] if len(steps) > skip_steps else steps)
    per: dict[tuple[str, str], dict[int, tuple[float, float]]] = {}
    for s in items:
        if s.step not in kept:
            continue
        lo, hi = per.setdefault(s.key, {}).get(s.step, (s.start_s, s.end_s))
        per[s.key][s.step] = (pick(lo, s.start_s), max(hi, s.end_s))
    return {key: sum(hi - lo for lo, hi in by_step.values()) / len(by_step) for key, by_step in sorted(per.items())}
