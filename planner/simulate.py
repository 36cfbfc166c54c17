"""List-scheduling simulator: the single source of a plan's estimated times and memory.

The iteration is unrolled `problem.unroll` times. An *op* is one call in one iteration; a call
that is not its model's home first reallocates the parameters from the home placement (occupying
the home mesh and its own), then runs on its own mesh. Ops start, in priority order, as soon as
their predecessors are done (plus data-transfer time) and all GPUs they occupy are free. A GPU runs
one op at a time, so its peak memory is the resident state of the models homed on it plus the
largest transient need of any op it runs (`Problem.memory`, from the op-semantics table).

`iteration_s` is the makespan of the unrolled iterations divided by their number: calls of
iteration i+1 may overlap iteration i where dependencies allow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from planner.lowering import augmented_graph
from planner.problem import Problem

Op = tuple[int, int]  # (iteration, slot)


def precedences(problem: Problem) -> list[tuple[Op, Op, int | None]]:
    """(before, after, data edge index or None) between calls of the unrolled graph
    (`planner.lowering.augmented_graph`); a call's reallocation belongs to its op."""

    def make() -> list[tuple[Op, Op, int | None]]:
        index = {s.call.name: s.index for s in problem.slots}
        edge_of = {(i, j): e for e, (i, j, _) in enumerate(problem.edges)}
        aug = augmented_graph(problem.graph, unroll=problem.unroll)
        out = []
        for (_, ua, a), (_, ub, b), data in aug.edges(data=True):
            i, j = index[a], index[b]
            out.append(((ua, i), (ub, j), edge_of[i, j] if data["kind"] == "data" else None))
        return sorted(out, key=lambda t: (t[1], t[0], -1 if t[2] is None else t[2]))

    return problem.cached("precedences", make)


@dataclass
class Schedule:
    """Times (s) of every op, reallocation phases, and memory per atom."""

    start: dict[Op, float]
    run_start: dict[Op, float]  # after the reallocation phase
    end: dict[Op, float]
    realloc: dict[int, tuple[int, float]]  # slot -> (bytes, seconds) per iteration
    peak_bytes: list[int]  # per atom
    makespan_s: float
    iteration_s: float
    mem_ok: bool
    run_s: dict[Op, float] = field(default_factory=dict)  # how long each op runs: its priced time, unless cores are shared


def _pred_map(problem: Problem) -> dict[Op, list[tuple[Op, int | None]]]:
    preds: dict[Op, list[tuple[Op, int | None]]] = {}
    for a, b, e in precedences(problem):
        preds.setdefault(b, []).append((a, e))
    return preds


def default_order(problem: Problem) -> list[Op]:
    return [(u, s.index) for u in range(problem.unroll) for s in problem.slots]


SHARING_ROUNDS = 8  # fixed-point rounds of the shared-core timing (it settles in 2-4 on the examples)


def simulate(problem: Problem, choice: Sequence[int | None], order: list[Op] | None = None, *,
             exact: bool = True) -> Schedule:
    """Schedule an assignment (candidate index per slot; None leaves a slot out).

    With ``exact=False`` reallocations not yet costed use `Problem.realloc_s`'s lower bound
    (search scoring); plans are always simulated exactly.

    Where a node's ranks time-share its cores (`CostModel.shares_cores`: a CPU with fewer cores
    than ranks), every candidate is priced with all the node's ranks at work, but a call runs
    faster while fewer of them are: each op advances at ``1 / busy_time_s(busy)`` of its work per
    second, `busy` the ranks of its busiest node occupied at that moment (its own included). The
    schedule and those speeds depend on each other, so they are iterated to a fixed point:
    durations from the previous schedule's occupancy, a new schedule from those durations, until
    no end moves (at most `SHARING_ROUNDS` rounds; deterministic either way)."""
    start, run, end, realloc, dur = _schedule(problem, choice, order, exact)
    _, peak = problem.memory(choice)
    makespan = max(end.values(), default=0.0)
    cap = problem.cluster.usable_mem_bytes
    return Schedule(start, run, end, realloc, peak, makespan, makespan / problem.unroll,
                    all(p <= cap for p in peak) and problem.host_fits(choice), dur)


def makespan_s(problem: Problem, choice: Sequence[int | None], *, exact: bool = True) -> float:
    """`simulate(problem, choice, exact=exact).makespan_s`, without the memory it also reports
    (a search that checked `Problem.fits` already)."""
    _, _, end, _, _ = _schedule(problem, choice, None, exact)
    return max(end.values(), default=0.0)


def _schedule(problem: Problem, choice: Sequence[int | None], order: list[Op] | None, exact: bool) -> tuple[
        dict[Op, float], dict[Op, float], dict[Op, float], dict[int, tuple[int, float]], dict[Op, float]]:
    """(start, run start, end, reallocations, durations) of `simulate`."""
    order = order or default_order(problem)
    steps, realloc = _resolve(problem, choice, order, exact)
    dur = {st.op: st.priced_s for st in steps}
    start, run, end = _times(problem, steps, dur)
    if problem.cm.shares_cores and end:
        for _ in range(SHARING_ROUNDS):
            dur = _shared_durations(problem, choice, steps, start, run, end)
            start2, run2, end2 = _times(problem, steps, dur)
            moved = max(abs(end2[op] - end[op]) for op in end)
            start, run, end = start2, run2, end2
            if moved <= 1e-12:
                break
    return start, run, end, realloc, dur


@dataclass(frozen=True)
class _Step:
    """What the schedule needs of one op, whatever its duration: its inputs (predecessor, transfer
    delay), the atoms it runs on, the atoms its reallocation also reads, and that reallocation's time."""

    op: Op
    inputs: tuple[tuple[Op, float], ...]
    atoms: frozenset[int]
    sources: frozenset[int]
    realloc_s: float
    priced_s: float


def _resolve(problem: Problem, choice: Sequence[int | None], order: list[Op],
             exact: bool) -> tuple[list[_Step], dict[int, tuple[int, float]]]:
    """The ops of `order` that run, with their inputs, atoms and reallocations (and the
    reallocation bytes and seconds per slot)."""
    preds = problem.cached("preds", lambda: _pred_map(problem))
    seen: set[Op] = set()
    steps: list[_Step] = []
    realloc: dict[int, tuple[int, float]] = {}
    for op in order:
        u, i = op
        k = choice[i]
        if k is None:
            continue
        slot = problem.slots[i]
        inputs = []
        for p, e in preds.get(op, ()):
            if choice[p[1]] is None:
                continue
            if p not in seen:
                raise ValueError(f"simulation order is not topological: {op} before its predecessor {p}")
            inputs.append((p, problem.transfer(e, choice[p[1]], k) if e is not None else 0.0))
        atoms = frozenset(problem.ops[i][k].atoms)
        r_bytes, r_time, src_atoms = 0, 0.0, frozenset[int]()
        h = choice[slot.home] if slot.home is not None else None
        if slot.home is not None and h is not None:
            if exact:
                r_bytes, r_time = problem.realloc(i, h, k)
            else:
                r_bytes, r_time = -1, problem.realloc_s(i, h, k)
            if r_time > 0:
                src_atoms = frozenset(problem.ops[slot.home][h].atoms) - atoms
        realloc[i] = (r_bytes, r_time)
        steps.append(_Step(op, tuple(inputs), atoms, src_atoms, r_time, problem.ops[i][k].time_s))
        seen.add(op)
    return steps, realloc


def _times(problem: Problem, steps: list[_Step], dur: dict[Op, float]) -> tuple[
        dict[Op, float], dict[Op, float], dict[Op, float]]:
    """(start, run start, end) of every op, in priority order, each as soon as its inputs are in
    and its atoms free; an op runs for `dur[op]`."""
    free = [0.0] * problem.n_atoms
    start: dict[Op, float] = {}
    run: dict[Op, float] = {}
    end: dict[Op, float] = {}
    for st in steps:
        op = st.op
        ready = max((end[p] + delay for p, delay in st.inputs), default=0.0)
        t0 = max([ready] + [free[a] for a in st.atoms | st.sources])
        start[op], run[op], end[op] = t0, t0 + st.realloc_s, t0 + st.realloc_s + dur[op]
        for a in st.atoms:
            free[a] = end[op]
        for a in st.sources:
            free[a] = t0 + st.realloc_s
    return start, run, end


def _shared_durations(problem: Problem, choice: Sequence[int | None], steps: list[_Step], start: dict[Op, float],
                      run: dict[Op, float], end: dict[Op, float]) -> dict[Op, float]:
    """Each op's duration on time-shared cores, given when the other ops of a schedule occupy
    which ranks (`simulate`): its work advanced at the speed the busy ranks of its busiest node
    leave it, over the moments where that count changes."""
    gpn, size = problem.cluster.gpus_per_node, problem.atom_size
    # (op, from, to, node, ranks): each op's ranks while it runs, and its sources while it reallocates
    spans: list[tuple[Op, float, float, int, int]] = []
    own: dict[Op, dict[int, int]] = {}
    for st in steps:
        op = st.op
        k = choice[op[1]]
        assert k is not None
        own[op] = problem.ranks_per_node(problem.slots[op[1]].cands[k])
        for node, n in own[op].items():
            spans.append((op, start[op], end[op], node, n))
        for a in st.sources:
            spans.append((op, start[op], run[op], a * size // gpn, size))
    out: dict[Op, float] = {}
    for st in steps:
        op = st.op
        i, k = op[1], choice[op[1]]
        assert k is not None
        mine, t = own[op], run[op]
        times = problem.busy_times_s(i, k)
        others = [sp for sp in spans if sp[0] != op and sp[3] in mine and sp[2] > t]
        if not others:  # alone on its nodes throughout
            out[op] = times[min(max(mine.values()), gpn)]
            continue
        done = 0.0
        for nxt in [*sorted({x for sp in others for x in sp[1:3] if x > t}), math.inf]:
            # The ranks at work on each of the op's nodes from t on: its own, and the others' by the schedule.
            busy = 0
            for node, n in mine.items():
                for sp in others:
                    if sp[3] == node and sp[1] <= t < sp[2]:
                        n += sp[4]
                busy = max(busy, n)
            rate = 1.0 / times[min(busy, gpn)]
            if done + (nxt - t) * rate >= 1.0:
                out[op] = t + (1.0 - done) / rate - run[op]
                break
            done += (nxt - t) * rate
            t = nxt
    return out
