"""Commands for jobs that change under them: replan (a plan's graph for a new cluster)."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

REPLAN_HELP = """Re-plan for a new cluster: compile PLAN's graph (same models and calls) for --cluster.

For a job resized after a failure, a preemption or a new allocation. The old plan's search rule
is kept (a baseline plan is re-planned under the same baseline unless --baseline says otherwise).
Prints old against new: GPUs, iteration time, throughput, MFU, memory, and each call's mesh and
layout; models whose resting placement changes are listed, since resuming a checkpoint of the old
plan reshards them. The new plan keeps the graph fingerprint checkpoints are matched by.

Examples:

  planner replan plans/ppo_llama7b.json --cluster a100-80gb:1x8 -o plans/ppo_llama7b_8gpu.json

  planner replan plans/tiny_ppo.json --cluster cpu:1x2 -o plans/tiny_ppo_2.json --time-limit 2 --json
"""


class BaselineChoice(str, Enum):
    # Upper-case names: a member named `split` would shadow str.split on every member.
    SAME = "same"
    NONE = "none"
    COLOCATE = "colocate"
    SPLIT = "split"
    HEURISTIC = "heuristic"


def replan_cmd(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON file to re-plan.", show_default=False)],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="The new cluster: GPU:NODESxPER_NODE or a .yaml/.json file.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan file to write for the new cluster.")],
    time_limit: Annotated[float, typer.Option("--time-limit", min=0, help="CP-SAT time limit in seconds; 0 keeps the beam-search plan.")] = 10.0,
    baseline: Annotated[BaselineChoice, typer.Option("--baseline", help="Search rule: 'same' as the old plan, 'none' for the full search, or a baseline.")] = BaselineChoice.SAME,
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="Cost-model calibration file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON instead of tables.")] = False,
) -> None:
    from planner.replan import replan
    from plans.cluster import parse_cluster
    from plans.io import check_output
    from plans.plan import load_plan, save_plan

    old = load_plan(plan_file)
    new_cluster = parse_cluster(cluster)
    check_output(output)
    calib = None
    if calibration is not None:
        from cost_models import load_calibration

        calib = load_calibration(calibration)
    rule = {"same": "same", "none": None}.get(baseline.value, baseline.value)
    with Console(stderr=True).status("re-planning", spinner="dots") as status:
        result = replan(old, new_cluster, time_limit_s=time_limit, baseline=rule, calibration=calib,
                        progress=lambda msg: status.update(str(msg)))
    save_plan(result.new, output)
    if as_json:
        typer.echo(json.dumps({**result.to_json(), "plan": str(plan_file), "output": str(output)}, indent=2))
        return
    _print_replanned(result, output)


def _print_replanned(result, output: Path) -> None:  # noqa: ANN001
    from planner.render import fmt_gib, fmt_s, make_console

    old, new = result.old, result.new
    head = Table(title=f"re-planned {new.name!r}", title_justify="left")
    for col in ("", "old", "new"):
        head.add_column(col, justify="left" if not col else "right")
    for label, fmt in (("cluster", lambda p: p.cluster.short()), ("GPUs", lambda p: str(p.cluster.world_size)),
                       ("iteration", lambda p: fmt_s(p.estimate.iteration_s)),
                       ("tokens/s", lambda p: f"{p.estimate.tokens_per_s:,.0f}"),
                       ("MFU", lambda p: f"{p.estimate.mfu * 100:.1f}%"),
                       ("peak mem/GPU", lambda p: fmt_gib(p.estimate.peak_mem_bytes)),
                       ("found by", lambda p: p.search.method)):
        head.add_row(label, fmt(old), fmt(new))
    calls = Table(title="placements", title_justify="left")
    for col in ("call", "old mesh", "old layout", "new mesh", "new layout"):
        calls.add_column(col)
    for c in new.calls:
        o = old.call(c.name)
        calls.add_row(c.name, o.mesh.short(), o.layout.short(), c.mesh.short(), c.layout.short())
    console = make_console()
    console.print(head)
    console.print(calls)
    speed = result.speedup
    change = "n/a" if speed is None else (f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower")
    console.print(f"iteration {fmt_s(old.estimate.iteration_s)} -> {fmt_s(new.estimate.iteration_s)} ({change})",
                  highlight=False)
    moved = result.moved_models()
    console.print("resuming a checkpoint of the old plan reshards: " + (", ".join(moved) if moved else "nothing"),
                  highlight=False)
    console.print(f"wrote {output}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command("replan", help=REPLAN_HELP)(replan_cmd)
