"""Commands that show a plan: timeline, explain, export."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plans.errors import PlannerError

TIMELINE_HELP = """Draw a plan's timeline: a Gantt chart (PNG) and a Chrome trace (JSON).

Rows are GPU groups (consecutive GPUs that run the same calls), bars are calls coloured by model,
hatched bars parameter reallocations. With --measured TRACE (written by the runtime's
--trace-out), the measured step is drawn under the prediction on the same time axis, per-call
predicted and measured times are printed, and the Chrome trace holds both.

Examples:

  planner timeline plans/ppo_llama7b.json -o ppo.png --trace ppo.trace.json

  planner timeline plans/tiny_ppo.json --measured run.trace.json -o vs.png
"""


class Target(str, Enum):
    megatron = "megatron"
    deepspeed = "deepspeed"
    verl = "verl"
    openrlhf = "openrlhf"


def _out(as_json: bool) -> Console:
    from planner.render import make_console

    return make_console(stderr=as_json)


# ---- timeline --------------------------------------------------------------------------------

def timeline(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON file.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Chart to write (.png), or a Chrome trace (.json) [default: PLAN.timeline.png].")] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Also write the Chrome trace (Perfetto / chrome://tracing) here.")] = None,
    measured: Annotated[Optional[list[Path]], typer.Option("--measured", help="Measured trace from the runtime (--trace-out); repeat for one file per rank.")] = None,
    step: Annotated[Optional[int], typer.Option("--step", min=0, help="Measured step to draw [default: the step of median length].")] = None,
    skip_steps: Annotated[int, typer.Option("--skip-steps", min=0, help="Warm-up steps left out of measured per-call times.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was written (and the comparison) as JSON.")] = False,
) -> None:
    from planner.timeline import (
        chrome_trace,
        compare_calls,
        figure_png,
        gpu_groups,
        mean_abs_error,
        merged_trace,
        timeline_figure,
    )
    from plans.io import check_output, write_bytes_atomic
    from plans.plan import load_plan
    from plans.trace import load_trace, write_trace

    plan = load_plan(plan_file)
    meas = load_trace(measured) if measured else None
    if meas is not None and meas["otherData"].get("plan") not in (None, "", plan.name):
        raise PlannerError(f"the measured trace is of plan {meas['otherData']['plan']!r}, not {plan.name!r}")
    output = output or plan_file.with_suffix(".timeline.png")
    if output.suffix not in (".png", ".json"):
        raise PlannerError(f"cannot write a timeline as {output.suffix or 'a file without suffix'!r}",
                           hint="use -o FILE.png for the chart or -o FILE.json for a Chrome trace")
    for path in (output, trace):
        if path is not None:
            check_output(path)  # before drawing
    doc = merged_trace(plan, meas, step=step) if meas is not None else chrome_trace(plan)
    written: list[str] = []
    if output.suffix == ".png":
        write_bytes_atomic(output, figure_png(timeline_figure(plan, measured=meas, step=step)))
        written.append(str(output))
    for path in {p for p in (trace, output if output.suffix == ".json" else None) if p is not None}:
        write_trace(path, doc)
        written.append(str(path))
    rows = compare_calls(plan, meas, skip_steps=skip_steps) if meas is not None else []
    mae = mean_abs_error(rows) if rows else None
    if as_json:
        typer.echo(json.dumps({"written": written, "groups": [g.label for g in gpu_groups(plan)],
                               "comparison": [{"cat": r.cat, "call": r.call, "model": r.model,
                                               "predicted_s": r.predicted_s, "measured_s": r.measured_s,
                                               "error": r.error} for r in rows],
                               "mean_abs_error": mae}, indent=2))
        return
    console = _out(False)
    if rows:
        console.print(_comparison_table(rows, mae))
    for name in written:
        console.print(f"wrote {name}", highlight=False)


def _comparison_table(rows, mae: float | None) -> Table:  # noqa: ANN001
    from planner.render import fmt_s

    t = Table(title="predicted vs measured (mean over steps, from a call's last rank starting to its last ending)",
              title_justify="left")
    for col in ("call", "model", "predicted", "measured", "error vs measured"):
        t.add_column(col, justify="left" if col in ("call", "model") else "right")
    for r in rows:
        name = r.call if r.cat == "call" else f"realloc for {r.call}"
        err = "" if r.error is None else f"{r.error * 100:+.0f}%"
        t.add_row(name, r.model, fmt_s(r.predicted_s), "not measured" if r.measured_s is None else fmt_s(r.measured_s),
                  err)
    if mae is not None:
        t.caption = f"mean |error| over calls: {mae * 100:.1f}%"
    return t


# ---- explain ---------------------------------------------------------------------------------

def explain(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON file.")],
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="The calibration the plan was compiled with, if any.")] = None,
    top: Annotated[int, typer.Option("--top", min=0, help="Alternatives shown per call.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the explanation as JSON.")] = False,
) -> None:
    """Explain a plan: critical path, bottleneck call, memory per GPU over time, gap to the lower
    bound, and why each call's layout beat the next-best candidates (their times and memory, and
    the iteration time the plan would have with each)."""
    from cost_models import CostModel
    from planner.explain import explain_plan
    from plans.plan import load_plan

    plan = load_plan(plan_file)
    cm = None
    if calibration is not None:
        from cost_models import load_calibration

        cm = CostModel(plan.cluster, calibration=load_calibration(calibration),
                       framework=plan.estimate.framework or "torch")
    err = Console(stderr=True)
    with err.status("re-costing candidates", spinner="dots"):
        ex = explain_plan(plan, cm=cm, top=top)
    if as_json:
        typer.echo(json.dumps(ex.to_json(), indent=2))
        return
    _render_explanation(ex, _out(False))


def _render_explanation(ex, console: Console) -> None:  # noqa: ANN001, C901 - one screen, top to bottom
    from planner.render import fmt_bytes, fmt_s

    head = f"plan {ex.plan!r} on {ex.cluster}: iteration {fmt_s(ex.iteration_s)}"
    if ex.iteration0_s > ex.iteration_s * 1.001:
        head += f" (iterations overlap: one takes {fmt_s(ex.iteration0_s)} end to end)"
    console.print(head, highlight=False)
    if ex.lower_bound_s is not None:
        work = "core time over the cores" if ex.shared_cores else "GPU time over the cluster"
        console.print(f"lower bound {fmt_s(ex.lower_bound_s)}, gap {(ex.gap or 0) * 100:.1f}%  (dependency chain at "
                      f"the fastest layouts {fmt_s(ex.chain_bound_s)}; all calls' least {work} "
                      f"{fmt_s(ex.work_bound_s)})", highlight=False)
    for note in ex.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    t = Table(title="critical path (iteration 0)", title_justify="left")
    for col in ("step", "start", "time", "waits for"):
        t.add_column(col, justify="right" if col in ("start", "time") else "left")
    for p in ex.critical_path:
        name = p.call if p.kind == "call" else f"realloc {p.model} for {p.call}"
        t.add_row(name, fmt_s(p.start_s), fmt_s(p.time_s), p.waits_for)
    console.print(t)
    if ex.bottleneck is not None:
        b = ex.bottleneck
        breakdown: dict[str, float] = next((c.breakdown_s for c in ex.calls if c.call == b.call), {})
        split = ", ".join(f"{k} {fmt_s(v)}" for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1]))
        share = b.time_s / ex.iteration0_s * 100
        console.print(f"bottleneck: [bold]{b.call}[/] {fmt_s(b.time_s)}, {share:.0f}% of the iteration ({escape(split)})")
    for g in ex.memory:
        if not g.windows:
            console.print(f"memory per GPU on {g.label}: nothing runs there", highlight=False)
            continue
        t = Table(title=f"memory per GPU on {g.label}: resident " +
                  (", ".join(f"{m} {fmt_bytes(v)}" for m, v in g.resident.items()) or "nothing") +
                  f"; peak {fmt_bytes(g.peak_bytes)} of {fmt_bytes(ex.capacity_bytes)} usable", title_justify="left")
        for col in ("from", "to", "running", "transient", "total"):
            t.add_column(col, justify="right" if col in ("from", "to", "total") else "left")
        for w in g.windows:
            parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in w.transient.items())
            total = fmt_bytes(w.total_bytes) + (" (peak)" if w.total_bytes == g.peak_bytes else "")
            t.add_row(fmt_s(w.start_s), fmt_s(w.end_s), w.running, parts, total)
        console.print(t)
    for c in ex.calls:
        t = Table(title=f"{c.call} ({c.model}): chosen {c.chosen.mesh} {c.chosen.layout}", title_justify="left")
        for col in ("GPUs", "layout", "call time", "peak mem", "iteration", "verdict"):
            t.add_column(col, justify="right" if col in ("GPUs", "call time", "peak mem", "iteration") else "left")
        for o in [c.chosen, *c.alternatives]:
            style = "bold" if o is c.chosen else None
            t.add_row(str(o.mesh_size), o.layout, fmt_s(o.time_s), fmt_bytes(o.peak_mem_bytes),
                      fmt_s(o.iteration_s) if o.iteration_s is not None else "-",
                      o.verdict + (" (not a search candidate)" if o.fits and not o.in_space else ""), style=style)
        console.print(t)


# ---- export ----------------------------------------------------------------------------------

def export(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON file.")],
    to: Annotated[Target, typer.Option("--to", help="Target engine: megatron, deepspeed, verl, openrlhf.")],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the command or config here instead of stdout.")] = None,
    call: Annotated[Optional[str], typer.Option("--call", help="The train call to export (megatron, deepspeed).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print settings and limits as one JSON object.")] = False,
    target_version: Annotated[Optional[str], typer.Option("--target-version", help="Check the engine release: megatron core_v0.19.0, deepspeed 0.19, verl 0.9, openrlhf 0.11.")] = None,
) -> None:
    """Export a plan to another engine, for the release each exporter targets: Megatron-LM
    core_v0.19.0 pretrain_gpt.py flags, a DeepSpeed 0.19 config, verl 0.9 PPO trainer overrides,
    or OpenRLHF 0.11 train_ppo_ray flags; with what the engine cannot express of the plan.

    Batch sizes are recomputed for the engine's own data-parallel size, GPUs requested add up to
    the cluster (colocation and sleep flags where the plan shares GPUs), vLLM's
    gpu_memory_utilization is the KV budget the plan was costed with. A plan the engine cannot
    run is refused (exit 2) with the reason. `planner import` goes the other way."""
    from planner.exports import export_plan
    from plans.io import check_output, write_text_atomic
    from plans.plan import load_plan

    if output is not None:
        check_output(output)
    exp = export_plan(load_plan(plan_file), to.value, call=call, version=target_version)
    if as_json:
        typer.echo(json.dumps(exp.to_json(), indent=2, sort_keys=True))
        if output is not None:
            write_text_atomic(output, exp.text)
        return
    if output is None:
        typer.echo(exp.text, nl=False)
        if to is Target.deepspeed:  # stdout stays a valid config; the release and caveats go beside it
            err = Console(stderr=True, highlight=False)
            err.print(f"for {exp.version}; names and defaults from {exp.source}")
            _caveats(exp, err)
        return
    write_text_atomic(output, exp.text)
    console = _out(False)
    _caveats(exp, console)
    console.print(f"wrote {output}", highlight=False)


def _caveats(exp, console: Console) -> None:  # noqa: ANN001
    if exp.cannot_express:
        console.print(f"[bold]{exp.target} cannot express:[/]")
        for x in exp.cannot_express:
            console.print(f"  - {escape(x)}")
    if exp.notes:
        console.print("[bold]notes:[/]")
        for x in exp.notes:
            console.print(f"  - {escape(x)}")


def register(app: typer.Typer) -> None:
    app.command("timeline", help=TIMELINE_HELP)(timeline)
    app.command()(explain)
    app.command()(export)
