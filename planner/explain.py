"""Why a plan is what it is: its critical path, bottleneck, memory over time, distance from the
lower bound, and, for every call, how its layout compares with the next-best candidates.

    ex = explain_plan(plan)            # re-costs with the shipped calibration
    ex = explain_plan(plan, cm=CostModel(plan.cluster, calibration=cal, framework=plan.estimate.framework or "torch"))

The critical path and memory windows use the plan's own numbers (iteration 0 of its schedule)
over the dependency graph of `planner.lowering`. The comparison of candidates re-costs every
layout of every mesh size the search considers, then, for the strongest alternatives, puts each
in the plan in place of the chosen one (at every aligned position) and re-simulates the whole
iteration with `planner.simulate`: an alternative loses by the iteration time it would give, or
because it does not fit, alone or beside the states that stay resident.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cost_models import CallCost, CostModel
from cost_models.api import OFFLOADED
from cost_models.generation import paged_rollout
from cost_models.lengths import length_dist
from cost_models.memory import state_bytes
from cost_models.training import stage_param_counts
from planner.baselines import Restriction
from planner.candidates import (
    Candidate,
    SearchSpace,
    costed_view,
    expert_degrees,
    graph_candidates,
    mesh_positions,
    mesh_sizes,
    runnable_layouts,
    stack_space,
)
from planner.compile import engine_rule, lower_bound_parts
from planner.lowering import augmented_graph
from planner.problem import Problem, build_problem
from planner.simulate import Op, Schedule, default_order, simulate
from planner.timeline import gpu_groups
from plans.graph import ModelDecl
from plans.layout import Layout, Mesh
from plans.plan import Plan, PlanCall

STATE_PARTS = ("params", "grads", "optimizer")  # resident between calls, unless offloaded (`OFFLOADED`)
PER_SIZE = 2  # alternatives kept per mesh size (its fastest, and its fastest that fits) before the cut
TIE = 1e-4  # relative iteration-time difference below which two options tie


# ---- result types ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PathStep:
    """One call or reallocation on the critical path of iteration 0."""

    kind: str  # "call" or "realloc"
    call: str
    model: str
    start_s: float
    time_s: float
    waits_for: str  # what this step started after


@dataclass(frozen=True)
class MemWindow:
    """Memory on one GPU group while one call or reallocation runs there (bytes per GPU)."""

    start_s: float
    end_s: float
    running: str
    transient: dict[str, int]
    total_bytes: int


@dataclass(frozen=True)
class GroupMemory:
    """Memory per GPU of one GPU group over the iteration."""

    label: str
    ranks: tuple[int, int]
    resident: dict[str, int]  # model -> bytes held between calls (home placements)
    windows: list[MemWindow]
    peak_bytes: int


@dataclass(frozen=True)
class Option:
    """One layout of a call on a mesh size, as the cost model sees it."""

    mesh_size: int
    layout: str
    time_s: float
    peak_mem_bytes: int
    fits: bool  # alone, within a GPU's memory
    in_space: bool  # among the candidates the search chose from
    iteration_s: float | None = None  # of the whole plan with this option in place, best position
    mesh: str | None = None  # that best position
    verdict: str = ""


@dataclass(frozen=True)
class CallChoice:
    call: str
    model: str
    chosen: Option
    alternatives: list[Option]
    breakdown_s: dict[str, float]


@dataclass
class Explanation:
    plan: str
    cluster: str
    iteration_s: float
    iteration0_s: float  # end of iteration 0 (longer than iteration_s when iterations overlap)
    replay_iteration_s: float  # the plan re-simulated here: the base the alternatives compare with
    lower_bound_s: float | None
    gap: float | None
    chain_bound_s: float
    work_bound_s: float  # GPU-seconds over the GPUs, or core-seconds over the cores (`shared_cores`)
    critical_path: list[PathStep]
    bottleneck: PathStep | None
    capacity_bytes: int  # what a plan may use per GPU: the memory less the cluster's headroom
    memory: list[GroupMemory]
    calls: list[CallChoice]
    notes: list[str] = field(default_factory=list)
    shared_cores: bool = False  # CPU ranks time-share the cores (`CostModel.shares_cores`)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- replaying the plan through the search problem -------------------------------------------


def expert_note(plan: Plan, pc: PlanCall, cm: CostModel) -> str | None:
    """Why a mixture-of-experts call splits its experts as it does: the all-to-all time its expert
    parallelism costs against the expert memory it saves, beside the same layout at ep 1."""
    decl = _view(plan, pc.name)
    spec = decl.spec
    if not spec.moe_layers:
        return None
    lay = pc.layout

    def expert_gib(layout: Layout) -> float:
        experts = max(e for _, e in stage_param_counts(spec, decl.head, layout))
        return sum(state_bytes(0.0, cm.framework, layout=layout, trainable=decl.trainable,
                               expert_params=experts).values()) / 2**30

    cost = cm.call_cost(pc, decl, pc.mesh, lay, decode_layout=pc.decode_layout)
    a2a = cost.breakdown_s.get("ep_comm", 0.0)
    text = (f"{pc.name}: experts split ep{lay.ep} etp{lay.etp}: all-to-all {a2a:.3g} s of the call's {cost.time_s:.3g} s; "
            f"routed experts {expert_gib(lay):.1f} GiB per GPU")
    # Beside it: the same degrees with the experts whole on every rank (ep 1), or, when that is the
    # choice, spread as far as the stage allows.
    stage = lay.tp * lay.cp * lay.dp
    other_ep = 1 if lay.ep > 1 else max(e for e, t in expert_degrees(spec, tp=lay.tp, stage=stage) if t == lay.etp)
    if other_ep == lay.ep:
        return text
    other = lay.model_copy(update={"ep": other_ep})
    dec = None if pc.decode_layout is None else pc.decode_layout.model_copy(update={"ep": other_ep})
    alt = cm.call_cost(pc, decl, pc.mesh, other, decode_layout=dec)
    fits = alt.peak_mem_bytes <= plan.cluster.usable_mem_bytes
    return text + (f"; at ep{other_ep} ({other.short()}) {expert_gib(other):.1f} GiB, all-to-all "
                   f"{alt.breakdown_s.get('ep_comm', 0.0):.3g} s, the call {alt.time_s:.3g} s and peak "
                   f"{alt.peak_mem_bytes / 2**30:.1f} GiB" + ("" if fits else " (does not fit)"))

def rollout_note(plan: Plan, pc: PlanCall, cm: CostModel) -> str | None:
    """How a paged engine (vLLM) runs a generate call, as costed: its KV budget, the rows running
    at once, the decode steps and the preemptions (`cost_models.lengths.paged_schedule`)."""
    if pc.kind != "generate":
        return None
    dec = pc.decode_layout or pc.layout
    fw = cm.framework.for_rollouts()
    sched = paged_rollout(fw, dec, seqs=pc.seqs, prompt_len=pc.prompt_len, gen_len=pc.gen_len,
                          lengths=length_dist(pc.response_len, pc.gen_len))
    if sched is None:
        return None
    rows = -(-pc.seqs // dec.dp)
    budget = -(-pc.seqs // (dec.dp * dec.micro_batches))
    text = (f"{pc.name}: {dec.dp} vLLM engine{'s' if dec.dp > 1 else ''} of {rows} rows each, in a KV budget of "
            f"{budget} rows at the {pc.seq_len}-token cap ({sched.peak_tokens:,} tokens held at most): at most "
            f"{sched.peak_rows} running at once (max_num_seqs {fw.max_num_seqs}), {sched.steps:,} decode steps")
    if sched.preemptions:
        text += (f", {sched.preemptions:,} preemptions ({sched.recomputed_tokens:,} tokens prefilled again; a larger "
                 "budget, fewer waves, avoids them)")
    return text


def _view(plan: Plan, call_name: str) -> ModelDecl:
    c = plan.call(call_name)
    return costed_view(c, plan.models[c.model])


def _find(cands: list[Candidate], mesh: Mesh, layout: Layout, decode: Layout | None) -> int | None:
    for k, c in enumerate(cands):
        if c.mesh == mesh and c.layout == layout and c.decode_layout == decode:
            return k
    return None


def _add(problem: Problem, slot: int, mesh: Mesh, layout: Layout, decode: Layout | None, cost: CallCost) -> int:
    """Index of (mesh, layout) among the slot's candidates, appending it when missing."""
    k = _find(problem.slots[slot].cands, mesh, layout, decode)
    return problem.add_candidate(slot, Candidate(mesh, layout, cost, decode)) if k is None else k


def replay(plan: Plan, cm: CostModel, space: SearchSpace) -> tuple[Problem, list[int]]:
    """The search problem of the plan's graph and the plan's assignment in it (calls placed
    outside the candidate space, e.g. by a baseline, are added)."""
    graph = plan.graph()
    problem = build_problem(graph, cm, space, candidates=graph_candidates(graph, cm, space))
    choice = []
    for s in problem.slots:
        pc = plan.call(s.call.name)
        cost = cm.call_cost(s.call, _view(plan, pc.name), pc.mesh, pc.layout, decode_layout=pc.decode_layout)
        choice.append(_add(problem, s.index, pc.mesh, pc.layout, pc.decode_layout, cost))
    return problem, choice


def _plan_order(problem: Problem, plan: Plan) -> list[Op]:
    start = {c.name: c.est_start_s for c in plan.calls}
    slots = sorted(problem.slots, key=lambda s: (start[s.call.name], s.index))
    return [(u, s.index) for u in range(problem.unroll) for s in slots]


def _best_schedule(problem: Problem, choice: list[int], orders: list[list[Op]]) -> Schedule:
    """The shorter of the schedules of `choice` under the given priority orders."""
    scheds = [simulate(problem, choice, order) for order in orders]
    return min(scheds, key=lambda s: s.makespan_s)


# ---- critical path ---------------------------------------------------------------------------

def critical_path(plan: Plan) -> list[PathStep]:
    """The chain of calls and reallocations that ends iteration 0 last, each with what it waited
    for: a data handle or parameter version (`planner.lowering`'s dependency edges), GPUs held by
    an earlier call, or nothing (it starts the iteration)."""
    calls = {c.name: c for c in plan.calls}
    realloc = {r.to_call: r for r in plan.reallocations}
    transfer = {(t.from_call, t.to_call): t.est_time_s for t in plan.transfers}
    aug = augmented_graph(plan.graph(), unroll=1)
    preds: dict[str, list[tuple[str, str]]] = {}
    for (ka, _, a), (kb, _, b), data in aug.edges(data=True):
        if ka == kb == "call":
            preds.setdefault(b, []).append((a, data.get("handle") or "the parameters it updates"))
    order = {c.name: i for i, c in enumerate(plan.calls)}

    def span(op: tuple[str, str]) -> tuple[float, float]:
        kind, name = op
        if kind == "realloc":
            r = realloc[name]
            return r.est_start_s, r.est_start_s + r.est_time_s
        c = calls[name]
        return c.est_start_s, c.est_start_s + c.est_time_s

    def ranks(op: tuple[str, str]) -> set[int]:
        kind, name = op
        out = set(calls[name].mesh.ranks)
        if kind == "realloc":
            out |= set(calls[realloc[name].from_call].mesh.ranks)
        return out

    ops = [("call", n) for n in calls] + [("realloc", n) for n in realloc]
    end_all = max(span(op)[1] for op in ops)
    tol = 1e-9 + 1e-6 * end_all
    current = max((("call", n) for n in calls), key=lambda op: (span(op)[1], order[op[1]]))
    path: list[PathStep] = []
    seen = set()
    while current not in seen:
        seen.add(current)
        kind, name = current
        start, end = span(current)
        if kind == "call" and name in realloc:
            why, nxt = "its parameter reallocation", ("realloc", name)
        elif start <= tol:
            why, nxt = "nothing (starts the iteration)", None
        else:
            why, nxt = "GPUs busy with the next iteration's calls (overlapping iterations)", None
            for p, handle in sorted(preds.get(name, []), key=lambda ph: (-span(("call", ph[0]))[1], ph[0])):
                delay = transfer.get((p, name), 0.0)
                if abs(span(("call", p))[1] + delay - start) <= tol:
                    moved = f", moved in {delay * 1e3:.3g} ms" if delay > 0 else ""
                    why, nxt = f"{p} ({handle}{moved})", ("call", p)
                    break
            else:
                mine = ranks(current)
                held = [op for op in ops if op != current and abs(span(op)[1] - start) <= tol and ranks(op) & mine]
                if held:
                    op = max(held, key=lambda o: (span(o)[0], o))
                    shared = sorted(ranks(op) & mine)
                    what = op[1] if op[0] == "call" else f"the reallocation for {op[1]}"
                    why, nxt = f"GPUs {shared[0]}-{shared[-1]} held by {what}", op
        path.append(PathStep(kind, name, calls[name].model, start, end - start, why))
        if nxt is None:
            break
        current = nxt
    return path[::-1]


# ---- memory ----------------------------------------------------------------------------------

def memory_over_time(plan: Plan, problem: Problem, choice: list[int]) -> list[GroupMemory]:
    """Per GPU group: the states resident between calls, and each call's transient need while it
    runs (`CallCost.mem_breakdown_bytes` beyond the state, plus the transient copy of parameters a
    non-home call receives), as the simulator and `build_plan` count them."""
    slot_of = {s.call.name: s.index for s in problem.slots}
    realloc = {r.to_call: r for r in plan.reallocations}
    out = []
    for g in gpu_groups(plan):
        r0 = g.first
        resident: dict[str, int] = {}
        for s in problem.slots:
            op = problem.ops[s.index][choice[s.index]]
            if op.resident_bytes and r0 in s.cands[choice[s.index]].mesh.ranks:
                resident[s.call.model] = resident.get(s.call.model, 0) + op.resident_bytes
        base = sum(resident.values())
        windows = []
        for c in plan.calls:
            s = problem.slots[slot_of[c.name]]
            cand = s.cands[choice[s.index]]
            op = problem.ops[s.index][choice[s.index]]
            copy = op.copies(problem.home_choice(s.index, choice))
            if c.name in realloc and r0 in cand.mesh.ranks:
                r = realloc[c.name]
                arriving = {"params (arriving copy)": op.copy_bytes,
                            "reserve": cand.cost.mem_breakdown_bytes.get("reserve", 0)}
                windows.append(MemWindow(r.est_start_s, r.est_start_s + r.est_time_s, f"reallocation for {c.name}",
                                         arriving, base + sum(arriving.values())))
            if r0 not in c.mesh.ranks:
                continue
            parts = {k: v for k, v in cand.cost.mem_breakdown_bytes.items() if k not in STATE_PARTS and v}
            if cand.cost.host_mem_bytes:  # states that wait in host memory, back on the GPU for the call
                kept = OFFLOADED[cand.layout.offload][0]
                parts = {f"{kept} (from host memory)": cand.cost.host_mem_bytes, **parts}
            if copy:
                parts = {"params (transient copy)": op.copy_bytes, **parts}
            windows.append(MemWindow(c.est_start_s, c.est_start_s + c.est_time_s, c.name, parts,
                                     base + sum(parts.values())))
        windows.sort(key=lambda w: (w.start_s, w.running))
        out.append(GroupMemory(g.label, (g.first, g.last), resident, windows,
                               max([base] + [w.total_bytes for w in windows])))
    return out


# ---- alternatives ----------------------------------------------------------------------------

def _options(plan: Plan, problem: Problem, slot: int, cm: CostModel, space: SearchSpace
             ) -> dict[tuple[int, Layout, Layout | None], CallCost]:
    """Every layout of every mesh size the search considers for the call, costed (fitting or not)."""
    s = problem.slots[slot]
    cluster = cm.cluster
    decl = plan.models[s.call.model]
    view = _view(plan, s.call.name)
    out: dict[tuple[int, Layout, Layout | None], CallCost] = {}
    for size in mesh_sizes(cluster, space):
        for lay in runnable_layouts(s.call, decl, size, cm):  # those the plan's stack runs
            out[(size, lay, None)] = cm.call_cost(s.call, view, Mesh.block(0, size), lay)
    for c in s.cands:
        out.setdefault((c.mesh.size, c.layout, c.decode_layout), c.cost)
    return out


def _describe(layout: Layout, decode: Layout | None) -> str:
    return layout.short() + (f" / decode {decode.short()}" if decode is not None else "")


def _allowed(plan: Plan, problem: Problem, slot: int, key: tuple[int, Layout, Layout | None],
             rule: Restriction | None) -> bool:
    """Whether the stack's rule over calls together (`planner.compile.engine_rule`) lets the call
    take `key` beside the plan's other choices: a tied call keeps its home call's degrees."""
    s = problem.slots[slot]
    if rule is None or s.home is None or not rule.ties(problem, slot):
        return True
    home = plan.call(problem.slots[s.home].call.name)
    size, lay, _ = key
    return (size, lay.dp * lay.cp, lay.tp, lay.pp) == (home.mesh.size, home.layout.dp * home.layout.cp,
                                                        home.layout.tp, home.layout.pp)


def alternatives(plan: Plan, problem: Problem, choice: list[int], cm: CostModel, space: SearchSpace, *,
                 base: Schedule, orders: list[list[Op]], top: int, rule: Restriction | None = None) -> list[CallChoice]:
    """For each call, the chosen option and the `top` strongest others (the fastest of each mesh
    size), each tried in the plan in place of the chosen one."""
    cap = cm.cluster.usable_mem_bytes
    in_space = {s.index: {(c.mesh.size, c.layout, c.decode_layout) for c in s.cands} for s in problem.slots}
    costed = {s.index: _options(plan, problem, s.index, cm, space) for s in problem.slots}
    out = []
    for s in problem.slots:
        pc = plan.call(s.call.name)
        chosen_key = (pc.mesh.size, pc.layout, pc.decode_layout)
        opts = costed[s.index]
        ranked = sorted((k for k in opts if k != chosen_key and _allowed(plan, problem, s.index, k, rule)),
                        key=lambda k: (opts[k].time_s, opts[k].peak_mem_bytes, k[0], _describe(k[1], k[2])))
        picked: list[tuple[int, Layout, Layout | None]] = []
        for size in sorted({k[0] for k in ranked}):
            # The fastest on this mesh size (fitting or not), then the fastest ones that fit alone.
            mine = [k for k in ranked if k[0] == size]
            fitting = [k for k in mine if opts[k].peak_mem_bytes <= cap]
            for k in [*mine[:1], *fitting]:
                if k not in picked and len([x for x in picked if x[0] == size]) < PER_SIZE:
                    picked.append(k)
        picked = sorted(picked, key=ranked.index)[:top]
        rows = []
        for key in picked:
            size, lay, dec = key
            cost = opts[key]
            fits = cost.peak_mem_bytes <= cap
            opt = Option(size, _describe(lay, dec), cost.time_s, cost.peak_mem_bytes, fits, key in in_space[s.index])
            rows.append(_try(problem, choice, s.index, opt, lay, dec, cost, base=base, orders=orders, cap=cap)
                        if fits else _with(opt, verdict=f"does not fit: needs {_gib(cost.peak_mem_bytes)} of "
                                                         f"{_gib(cap)} per GPU"))
        cand = s.cands[choice[s.index]]
        chosen = Option(pc.mesh.size, _describe(pc.layout, pc.decode_layout), cand.time_s, cand.cost.peak_mem_bytes,
                        cand.cost.peak_mem_bytes <= cap, chosen_key in in_space[s.index], base.iteration_s,
                        pc.mesh.short(), "chosen")
        # On time-shared cores the call runs for its scheduled time, not its priced one: its parts
        # in proportion.
        scale = base.run_s[(0, s.index)] / cand.time_s if cand.time_s > 0 else 1.0
        parts = {k: v * scale for k, v in cand.cost.breakdown_s.items()} if cm.shares_cores else dict(cand.cost.breakdown_s)
        out.append(CallChoice(s.call.name, s.call.model, chosen, rows, parts))
    return out


def _with(opt: Option, **changes: Any) -> Option:
    return Option(**{**asdict(opt), **changes})


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _try(problem: Problem, choice: list[int], slot: int, opt: Option, lay: Layout, dec: Layout | None,
         cost: CallCost, *, base: Schedule, orders: list[list[Op]], cap: int) -> Option:
    """Put an option in the plan at each aligned position; keep the position with the shortest
    iteration that fits in memory."""
    best: tuple[float, str] | None = None
    lean: int | None = None
    for mesh in mesh_positions(problem.cluster, opt.mesh_size):
        k = _add(problem, slot, mesh, lay, dec, cost)
        trial = list(choice)
        trial[slot] = k
        sched = _best_schedule(problem, trial, orders)
        if sched.mem_ok:
            if best is None or sched.iteration_s < best[0]:
                best = (sched.iteration_s, mesh.short())
        else:
            lean = max(sched.peak_bytes) if lean is None else min(lean, max(sched.peak_bytes))
    if best is None:
        assert lean is not None
        return _with(opt, verdict=f"does not fit beside the resident states: {_gib(lean)} of {_gib(cap)} on "
                                  "the fullest GPU")
    it, where = best
    delta = (it - base.iteration_s) / base.iteration_s if base.iteration_s > 0 else 0.0
    if delta > TIE:
        verdict = f"iteration {delta * 100:+.1f}%"
    elif delta < -TIE:
        verdict = f"iteration {delta * 100:+.1f}%: " + ("the search missed it" if opt.in_space else
                                                         "pruned from the search's candidates")
    else:
        verdict = "as fast (a tie)"
    return _with(opt, iteration_s=it, mesh=where, verdict=verdict)


# ---- the whole explanation -------------------------------------------------------------------

def explain_plan(plan: Plan, *, cm: CostModel | None = None, space: SearchSpace | None = None,
                 top: int = 5) -> Explanation:
    """Explain `plan` with cost model `cm` (default: the shipped calibration for its GPU)."""
    cm = cm or CostModel(plan.cluster, framework=plan.estimate.framework or "torch")
    space = stack_space(space or SearchSpace(), cm)
    problem, choice = replay(plan, cm, space)
    chain_s, work_s = lower_bound_parts(problem)
    orders = [default_order(problem), _plan_order(problem, plan)]
    base = _best_schedule(problem, choice, orders)
    notes = []
    if cm.shares_cores:
        notes.append(f"the {plan.cluster.gpus_per_node} ranks of a node time-share its cores: call times in the tables "
                     "are priced with all of them at work, and the schedule runs a call faster while fewer are")
    for s in problem.slots:
        pc = plan.call(s.call.name)
        t = base.run_s[(0, s.index)]
        if abs(t - pc.est_time_s) > 1e-6 * max(t, 1e-12):
            notes.append(f"{pc.name}: the plan states {pc.est_time_s:.4g} s but this cost model gives {t:.4g} s "
                         "(was it compiled with --calibration?)")
    notes += [n for pc in plan.calls if (n := expert_note(plan, pc, cm))]
    notes += [n for pc in plan.calls if (n := rollout_note(plan, pc, cm))]
    path = critical_path(plan)
    calls_on_path = [p for p in path if p.kind == "call"]
    bottleneck = max(calls_on_path, key=lambda p: p.time_s) if calls_on_path else None
    return Explanation(
        plan=plan.name, cluster=plan.cluster.short(), iteration_s=plan.estimate.iteration_s,
        iteration0_s=max(c.est_start_s + c.est_time_s for c in plan.calls), replay_iteration_s=base.iteration_s,
        lower_bound_s=plan.search.lower_bound_s, gap=plan.search.gap, chain_bound_s=chain_s, work_bound_s=work_s,
        critical_path=path, bottleneck=bottleneck, capacity_bytes=plan.cluster.usable_mem_bytes,
        memory=memory_over_time(plan, problem, choice),
        calls=alternatives(plan, problem, choice, cm, space, base=base, orders=orders, top=top,
                           rule=engine_rule(plan.graph(), cm, space)), notes=notes,
        shared_cores=cm.shares_cores)
