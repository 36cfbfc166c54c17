"""Rich renderings of plans for people (machines get `--json`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plans.hardware import GIB
from plans.plan import BOUND_MET, Plan, PlanCall


def make_console(*, stderr: bool = False) -> Console:
    """A console that keeps tables on one line when output is piped (rich would assume 80 columns)."""
    probe = Console(stderr=stderr)
    return probe if probe.is_terminal else Console(stderr=stderr, width=160)


def fmt_s(seconds: float) -> str:
    if seconds >= 100:
        return f"{seconds:.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} us"


def fmt_gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def fmt_bytes(nbytes: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def calls_table(plan: Plan) -> Table:
    t = Table(title=f"plan {plan.name!r} on {plan.cluster.short()}", title_justify="left")
    for col, just in (("call", "left"), ("model", "left"), ("kind", "left"), ("mesh", "left"), ("layout", "left"),
                      ("start", "right"), ("time", "right"), ("peak mem/GPU", "right")):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for c in plan.calls:
        layout = c.layout.short() + (f" / decode {c.decode_layout.short()}" if c.decode_layout else "")
        t.add_row(c.name, c.model, c.kind, c.mesh.short(), layout, fmt_s(c.est_start_s), fmt_s(c.est_time_s),
                  fmt_gib(c.est_peak_mem_bytes))
    return t


def reallocs_table(plan: Plan) -> Table:
    t = Table(title="parameter reallocations", title_justify="left")
    for col in ("model", "from", "to", "bytes", "time"):
        t.add_column(col, justify="right" if col in ("bytes", "time") else "left")
    for r in plan.reallocations:
        t.add_row(r.model, r.from_call, r.to_call, fmt_bytes(r.bytes), fmt_s(r.est_time_s))
    return t


def estimate_lines(plan: Plan) -> list[str]:
    e, s = plan.estimate, plan.search
    lines = [
        f"iteration {fmt_s(e.iteration_s)}   {e.tokens_per_s:,.0f} tokens/s   MFU {e.mfu * 100:.1f}%   "
        f"peak {fmt_gib(e.peak_mem_bytes)} of {fmt_gib(plan.cluster.usable_mem_bytes)} usable per GPU"
        f" ({plan.cluster.mem_gib:g} GiB less {plan.cluster.mem_headroom_gib:g} GiB headroom)",
    ]
    if e.costed_for:
        lines.append(f"costed for {e.costed_for}")
    if s.method.startswith("imported"):  # planner import: the config's own placement, costed
        lines.append(f"{s.method}: the config's placement as costed ({s.status or 'fits'})")
        return lines
    found = f"found by {s.method}"
    if s.wall_s is not None:
        found += f" in {s.wall_s:.2f} s"
    if s.candidates is not None:
        found += f" over {s.candidates} candidates"
    if s.lower_bound_s is not None and s.gap is not None:
        found += f"; lower bound {fmt_s(s.lower_bound_s)}, gap {s.gap * 100:.1f}%"
    if s.status == "OPTIMAL" and s.gap is not None and s.gap > 1e-3:
        # CP-SAT solved its model, a relaxation (durations in ticks, reallocations at their least,
        # calls at their fastest on shared cores): the bound is that model's optimum.
        found += " (CP-SAT OPTIMAL: the bound is the optimum of its relaxed model)"
    elif s.status == BOUND_MET:
        found += " (the plan meets the lower bound: optimal, CP-SAT not needed)"
    elif s.status and s.status.startswith("relaxed"):  # `planner.compile._search_decomposed`
        found += f" (mesh sizes first, then positions; the bound is the position-free model's: CP-SAT {s.status})"
    elif s.status:
        found += f" (CP-SAT {s.status})"
    lines.append(found)
    return lines


def print_plan(plan: Plan, console: Console | None = None) -> None:
    console = console or make_console()
    console.print(calls_table(plan))
    if plan.reallocations:
        console.print(reallocs_table(plan))
    if plan.host_steps:
        steps = ", ".join(f"{s.name} ({', '.join(s.inputs)} -> {', '.join(s.outputs)})" for s in plan.host_steps)
        console.print(f"host steps, run as written on every rank: {steps}", highlight=False, soft_wrap=True)
    for c in plan.calls:
        if c.response_len is not None:
            console.print(f"{c.name}: costed at {response_len_text(c)}", highlight=False, soft_wrap=True)
        elif c.kind == "generate":
            console.print(f"{c.name}: every response costed at the {c.gen_len}-token cap (compile with "
                          "--response-len-mean N or --response-len-from METRICS.jsonl to cost how long they really "
                          "are)", highlight=False, soft_wrap=True)
    code_lines(plan, console)
    for line in estimate_lines(plan):
        console.print(line, highlight=False)


def response_len_text(call: PlanCall) -> str:
    """How long a generate call's responses were taken to be, for its cost."""
    r = call.response_len
    assert r is not None
    what = f"responses of mean {r.mean:g} tokens (geometric)" if r.mean is not None else \
        f"{len(r.samples)} measured response lengths (mean {sum(r.samples) / len(r.samples):.0f})"
    src = f", from {escape(r.source)}" if r.source else ""
    return f"{what} under the {call.gen_len}-token cap{src}"


def code_lines(plan: Plan, console: Console) -> None:
    """The code the plan names and what it takes to run (`plans.graph.named_code`)."""
    from plans.graph import named_code

    named = named_code(plan.graph())
    if not named:
        console.print("code: none (the plan names no function to run)", highlight=False)
        return
    console.print("code the plan names:", highlight=False)
    for item in named:
        console.print(f"  {escape(item.line())}", highlight=False, soft_wrap=True)
