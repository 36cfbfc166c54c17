"""Timelines of a plan: the predicted iteration as a trace, a Gantt chart, and predicted vs measured.

The prediction is written in the planner trace format (`plans.trace`), exactly what the runtime
writes when it measures (``--trace-out``): one event per call and reallocation per rank, from the
plan's own numbers (iteration 0 of the simulated schedule: `PlanCall.est_start_s`,
`Reallocation.est_start_s`). So both sides go through one code path: spans, grouped per *GPU group*
(consecutive ranks that take part in exactly the same calls and reallocations), drawn as bars.

    fig = timeline_figure(plan)                      # predicted only
    fig = timeline_figure(plan, measured=trace)      # predicted above measured, one time axis
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.text import Text

from plans.errors import PlannerError
from plans.plan import Plan
from plans.trace import (
    Span,
    call_times_s,
    complete_event,
    metadata_event,
    realloc_name,
    spans,
    step_window_s,
    steps_of,
    trace_document,
)

ROW_IN = 0.42  # figure height per GPU-group row, inches
PANEL_EXTRA_IN = 0.9  # title and axis per panel
FIG_WIDTH_IN = 14.0
DPI = 150
LABEL_PAD_PX = 4
MIN_BAR_FRACTION = 0.003  # of the time axis: shorter bars are drawn this wide so they stay visible
NEXT_ITERATION_MIN = 0.01  # mark where the next iteration starts when it overlaps this one by more


# ---- the prediction as a trace ---------------------------------------------------------------

def predicted_trace(plan: Plan) -> dict[str, Any]:
    """The plan's iteration as a planner trace (source "predicted", step 0)."""
    calls = {c.name: c for c in plan.calls}
    events = []
    for c in plan.calls:
        for r in c.mesh.ranks:
            events.append(complete_event(c.name, cat="call", start_s=c.est_start_s, dur_s=c.est_time_s, rank=r, step=0,
                                         call=c.name, kind=c.kind, model=c.model))
    for ra in plan.reallocations:
        ranks = set(calls[ra.from_call].mesh.ranks) | set(calls[ra.to_call].mesh.ranks)
        for r in sorted(ranks):
            events.append(complete_event(realloc_name(ra.to_call), cat="realloc", start_s=ra.est_start_s,
                                         dur_s=ra.est_time_s, rank=r, step=0, call=ra.to_call, kind="realloc",
                                         model=ra.model, from_call=ra.from_call))
    return trace_document(events, source="predicted", plan=plan.name, world_size=plan.cluster.world_size,
                          extra={"iteration_s": plan.estimate.iteration_s})


@dataclass(frozen=True)
class GpuGroup:
    """Consecutive ranks that take part in the same calls and reallocations."""

    first: int
    last: int
    keys: tuple[tuple[str, str], ...]

    @property
    def ranks(self) -> range:
        return range(self.first, self.last + 1)

    @property
    def label(self) -> str:
        text = f"GPU {self.first}" if self.first == self.last else f"GPUs {self.first}-{self.last}"
        return text if self.keys else text + " (idle)"


def gpu_groups(plan: Plan) -> list[GpuGroup]:
    """The rows of a timeline: maximal runs of ranks with the same predicted events."""
    keys: dict[int, set[tuple[str, str]]] = {r: set() for r in range(plan.cluster.world_size)}
    for s in spans(predicted_trace(plan)):
        keys[s.rank].add(s.key)
    groups: list[GpuGroup] = []
    for r in range(plan.cluster.world_size):
        sig = tuple(sorted(keys[r]))
        if groups and groups[-1].keys == sig:
            groups[-1] = GpuGroup(groups[-1].first, r, sig)
        else:
            groups.append(GpuGroup(r, r, sig))
    return groups


# ---- bars ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bar:
    """One call or reallocation on one GPU group: from its first rank's start to its last's end."""

    row: int
    cat: str
    call: str
    model: str
    kind: str
    start_s: float
    dur_s: float


def group_bars(items: list[Span], groups: list[GpuGroup], *, step: int, origin_s: float = 0.0) -> list[Bar]:
    """Bars of `step`'s spans per GPU group, times relative to `origin_s`."""
    row_of = {r: i for i, g in enumerate(groups) for r in g.ranks}
    acc: dict[tuple[int, str, str], list] = {}
    for s in items:
        if s.step != step or s.rank not in row_of:
            continue
        k = (row_of[s.rank], s.cat, s.call)
        if k in acc:
            acc[k][0] = min(acc[k][0], s.start_s)
            acc[k][1] = max(acc[k][1], s.end_s)
        else:
            acc[k] = [s.start_s, s.end_s, s.model, s.kind]
    ordered = sorted(acc.items(), key=lambda kv: (kv[0][0], kv[1][0], kv[0]))  # row, then start
    return [Bar(row, cat, call, model, kind, lo - origin_s, hi - lo)
            for (row, cat, call), (lo, hi, model, kind) in ordered]


def default_step(items: list[Span]) -> int:
    """A representative measured step: the one of median length, warm-up step 0 left out when
    there are later steps (ties, to the nanosecond: the earlier step)."""
    steps = steps_of(items)
    if not steps:
        raise PlannerError("the measured trace has no call or reallocation events")
    pool = steps[1:] if len(steps) > 1 else steps
    lengths = sorted((round(step_window_s(items, k)[1] - step_window_s(items, k)[0], 9), k) for k in pool)
    median = lengths[(len(lengths) - 1) // 2][0]
    return min(k for length, k in lengths if length == median)


# ---- the chart -------------------------------------------------------------------------------

def model_colors(plan: Plan) -> dict[str, tuple[float, ...]]:
    """One colour per model, in declaration order (stable across plans of one graph)."""
    cmap = colormaps["tab10"]
    return {m: cmap(i % 10) for i, m in enumerate(plan.models)}


def _time_unit(span_s: float) -> tuple[str, float]:
    if span_s >= 10:
        return "s", 1.0
    if span_s >= 10e-3:
        return "ms", 1e3
    return "µs", 1e6


def _fmt_s(seconds: float) -> str:
    unit, scale = _time_unit(seconds * 10)
    return f"{seconds * scale:.3g} {unit}"


Label = tuple[Text, Rectangle, tuple[str, ...]]  # a bar's label, its bar, the texts to try, longest first


def _draw_panel(ax: Axes, bars: list[Bar], groups: list[GpuGroup], colors: dict, layouts: dict[str, str], *,
                title: str, scale: float, min_width: float) -> list[Label]:
    labels: list[Label] = []
    for b in bars:
        realloc = b.cat == "realloc"
        width = max(b.dur_s * scale, min_width) if b.dur_s > 0 else 0.0
        (rect,) = ax.barh(b.row, width, left=b.start_s * scale, height=0.62 if realloc else 0.8,
                          color=colors.get(b.model, "grey"), alpha=0.55 if realloc else 0.9,
                          hatch="////" if realloc else None, edgecolor="black", linewidth=0.6,
                          zorder=3 if realloc else 2)  # a short reallocation stays visible over its call
        rect.set_gid(f"{b.cat}:{b.call}:{b.row}")
        text = f"↻ {b.model}" if realloc else b.call
        timed = f"{text}\n{_fmt_s(b.dur_s)}"
        full = timed if realloc else f"{text}\n{_fmt_s(b.dur_s)} · {layouts.get(b.call, '')}"
        wrapped = text.replace("_", "_\n")  # narrow bars: the name over several lines
        t = ax.text(b.start_s * scale + width / 2, b.row, full, ha="center", va="center", fontsize=7.5,
                    clip_on=True, gid=f"label:{b.cat}:{b.call}:{b.row}", zorder=4)
        labels.append((t, rect, (full, timed, text, f"{wrapped}\n{_fmt_s(b.dur_s)}", wrapped, "")))
    ax.set_yticks(range(len(groups)), [g.label for g in groups], fontsize=8.5)
    ax.set_ylim(len(groups) - 0.5, -0.5)
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(axis="x", linestyle=":", linewidth=0.6)
    ax.set_axisbelow(True)
    return labels


def _fit_labels(fig: Figure, labels: list[Label]) -> None:
    """Shorten or drop every bar label wider than its bar (measured on the real renderer)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    for t, rect, options in labels:
        room = rect.get_window_extent(renderer).width - LABEL_PAD_PX
        for option in options:
            t.set_text(option)
            if not option or t.get_window_extent(renderer).width <= room:
                break


def timeline_figure(plan: Plan, *, measured: dict[str, Any] | None = None, step: int | None = None) -> Figure:
    """A Gantt chart of the plan (rows: GPU groups; bars: calls, hatched: reallocations; colour:
    model), with the measured step below it on the same time axis when `measured` is given."""
    groups = gpu_groups(plan)
    colors = model_colors(plan)
    pred = group_bars(spans(predicted_trace(plan)), groups, step=0)
    panels = [(pred, f"predicted: {plan.name} on {plan.cluster.short()}, iteration "
                     f"{_fmt_s(plan.estimate.iteration_s)} (steady state)")]
    if measured is not None:
        items = spans(measured)
        k = default_step(items) if step is None else step
        lo, hi = step_window_s(items, k)
        panels.append((group_bars(items, groups, step=k, origin_s=lo),
                       f"measured: step {k} of {len(steps_of(items))}, {_fmt_s(hi - lo)}"))
    end_s = max([b.start_s + b.dur_s for bars, _ in panels for b in bars] + [plan.estimate.iteration_s, 1e-9])
    unit, scale = _time_unit(end_s)
    rows_in = len(groups) * ROW_IN + PANEL_EXTRA_IN
    fig = Figure(figsize=(FIG_WIDTH_IN, rows_in * len(panels) + 0.9), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    layouts = {c.name: f"{c.mesh.short()} {c.layout.short()}" for c in plan.calls}
    labels: list[Label] = []
    for ax, (bars, title) in zip(axes, panels):
        labels += _draw_panel(ax, bars, groups, colors, layouts, title=title, scale=scale,
                              min_width=end_s * scale * MIN_BAR_FRACTION)
    iteration0_s = max((b.start_s + b.dur_s for b in pred), default=0.0)
    if iteration0_s > plan.estimate.iteration_s * (1 + NEXT_ITERATION_MIN):
        # Calls of the next iteration start before this one ends: the steady-state period is shorter.
        x = plan.estimate.iteration_s * scale
        axes[0].axvline(x, color="black", linestyle="--", linewidth=0.8)
        axes[0].text(x, -0.45, "next iteration starts ", fontsize=7.5, ha="right", va="top")
    axes[-1].set_xlim(0, end_s * scale * 1.01)
    axes[-1].set_xlabel(f"time ({unit})")
    handles = [Patch(facecolor=colors[m], edgecolor="black", label=m) for m in plan.models]  # type: ignore[arg-type]
    if plan.reallocations:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", label="parameter reallocation"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8.5, frameon=False)
    _fit_labels(fig, labels)
    return fig


def figure_png(fig: Figure) -> bytes:
    """PNG bytes of a figure (no timestamp in the metadata, so equal figures are equal bytes)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


# ---- predicted vs measured -------------------------------------------------------------------

@dataclass(frozen=True)
class CallComparison:
    """Predicted and measured time of one call or reallocation."""

    cat: str
    call: str
    model: str
    predicted_s: float
    measured_s: float | None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured: negative when the plan is optimistic; None when not
        measured."""
        if self.measured_s is None or self.measured_s <= 0:
            return None
        return (self.predicted_s - self.measured_s) / self.measured_s


def compare_calls(plan: Plan, measured: dict[str, Any], *, skip_steps: int = 1, start: str = "last") -> list[CallComparison]:
    """Per call and reallocation of the plan: its estimated time and its mean measured time, from
    its last rank's start (or its first's, `start="first"`) to its last rank's end
    (`plans.trace.call_times_s` says why the last start is the one a prediction is judged by)."""
    got = call_times_s(spans(measured), skip_steps=skip_steps, start=start)
    rows = [CallComparison("call", c.name, c.model, c.est_time_s, got.get(("call", c.name))) for c in plan.calls]
    rows += [CallComparison("realloc", r.to_call, r.model, r.est_time_s, got.get(("realloc", r.to_call)))
             for r in plan.reallocations]
    return rows


def mean_abs_error(rows: list[CallComparison]) -> float | None:
    """Mean |measured - predicted| / measured over the measured calls (reallocations excluded)."""
    errs = [abs(r.error) for r in rows if r.cat == "call" and r.error is not None]
    return sum(errs) / len(errs) if errs else None


def merged_trace(plan: Plan, measured: dict[str, Any], *, step: int | None = None) -> dict[str, Any]:
    """One Trace Event Format document with the prediction laid over a measured step: each rank
    appears twice, "predicted rank r" right above "measured rank r", the prediction starting
    where that step starts. (Process ids: rank for predicted, world_size + rank for measured.)"""
    world = plan.cluster.world_size
    if measured["otherData"]["world_size"] != world:
        raise PlannerError(f"the trace is of {measured['otherData']['world_size']} ranks but plan {plan.name!r} "
                           f"runs on {world}")
    items = spans(measured)
    k = default_step(items) if step is None else step
    lo, _ = step_window_s(items, k)
    events = []
    for e in predicted_trace(plan)["traceEvents"]:
        if e["ph"] == "X":
            events.append({**e, "ts": round(e["ts"] + lo * 1e6, 3)})
    events += [{**e, "pid": world + e["pid"]} for e in measured["traceEvents"] if e["ph"] == "X"]
    meta = []
    for r in range(world):
        meta += [metadata_event("process_name", pid=r, value=f"predicted rank {r}"),
                 metadata_event("process_sort_index", pid=r, value=2 * r),
                 metadata_event("process_name", pid=world + r, value=f"measured rank {r}"),
                 metadata_event("process_sort_index", pid=world + r, value=2 * r + 1)]
    other = {"format": "planner-trace-comparison", "plan": plan.name, "world_size": world, "measured_step": k}
    return {"traceEvents": meta + sorted(events, key=lambda e: (e["pid"], e["ts"], e["name"])),
            "displayTimeUnit": "ms", "otherData": other}


def chrome_trace(plan: Plan) -> dict[str, Any]:
    """The predicted trace with a thread name per rank, for Perfetto / chrome://tracing."""
    doc = predicted_trace(plan)
    doc["traceEvents"] = [e if e["ph"] != "M" else {**e, "args": {"name": f"predicted rank {e['pid']}"}}
                          for e in doc["traceEvents"]]
    return doc
