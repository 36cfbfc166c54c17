"""A lower bound on every plan of a candidate space, with the meshes' positions left out.

Where meshes may sit on any run of consecutive nodes (`SearchSpace.node_ranges`), a cluster of 16
nodes gives a call a hundred and more positions per layout, and the CP-SAT model of the placed
problem (`planner.cpsat`) grows with the square of them (its reallocation tables) until it can
prove nothing in the time a search has. This module proves a bound on the same plans from a
model that knows only each call's mesh *size* and layout (a *class* of candidates: every position
of one costed layout), and relaxes every rule that needs positions:

- the GPUs the calls occupy: one cumulative resource of the cluster's atoms instead of a no-overlap
  per atom (any placed schedule is one of it);
- a reallocation's time: the least over every placement of the two meshes
  (`CostModel.realloc_floor_anywhere_s`, at most `Problem.realloc_s` of any placed pair); its
  sending side occupies at least as many atoms as the home mesh has beyond the call's;
- a data transfer's time: zero (at least nothing);
- memory: each candidate fits alone (the space holds no other), and with a twin of its home only
  where one of the home's classes holds the same slices on a mesh of the same size.

Durations, precedences, the unrolled iterations and the objective are the placed model's. So the
optimum of this model, and any bound CP-SAT proves on it, bounds every plan of the space, whatever
the placed search finds; `planner.compile.search` reports it as the plan's certified bound when it
is the better one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.beam import assignment_order
from planner.cpsat import OBJECTIVE_STEP, steps_bound_s, time_grid
from planner.problem import Problem
from planner.simulate import precedences
from plans.sharding import slicing

# Of the position-free model's work budget, the most its first solve (the hint's classes alone,
# scheduled: `relaxed_bound`) may take; a handful of classes, it takes a hundredth of it.
HINT_WORK_SHARE = 0.1


@dataclass(frozen=True)
class Classes:
    """A slot's candidates by class (mesh size and everything costed, not the position)."""

    of: list[int]  # class of each candidate
    reps: list[int]  # the first candidate of each class
    size: list[int]  # atoms of each class's mesh


def classes(problem: Problem, slot: int) -> Classes:
    """The classes of `slot`'s candidates, numbered by first appearance (cached)."""
    def make() -> Classes:
        index: dict[tuple, int] = {}
        of: list[int] = []
        reps: list[int] = []
        for k, c in enumerate(problem.slots[slot].cands):
            key = (c.mesh.size, c.layout, c.decode_layout, c.time_s, c.state_bytes, c.work_bytes)
            if key not in index:
                index[key] = len(reps)
                reps.append(k)
            of.append(index[key])
        size = [problem.slots[slot].cands[k].mesh.size // problem.atom_size for k in reps]
        return Classes(of, reps, size)
    return problem.cached(f"classes{slot}", make)


def class_fastest_s(problem: Problem, slot: int) -> list[float]:
    """The least time of each class of `slot` over its positions (`Problem.fastest_s`)."""
    cl = classes(problem, slot)
    out = [math.inf] * len(cl.reps)
    for k, q in enumerate(cl.of):
        out[q] = min(out[q], problem.fastest_s(slot, k))
    return out


def class_realloc_s(problem: Problem, slot: int, home_classes: Sequence[int], own: Sequence[int]) -> list[list[float]]:
    """[home class][class] the least reallocation time of `slot` over every placement of the two
    meshes (`CostModel.realloc_floor_anywhere_s`), for the given classes of its home and its own."""
    s = problem.slots[slot]
    assert s.home is not None
    decl = problem.graph.models[s.call.model]
    hc = [problem.slots[s.home].cands[classes(problem, s.home).reps[g]] for g in home_classes]
    kc = [s.cands[classes(problem, slot).reps[q]] for q in own]
    return [[problem.cm.realloc_floor_anywhere_s(decl, (h.mesh.size, h.layout), (k.mesh.size, k.layout))
             for k in kc] for h in hc]


def class_bounds_s(problem: Problem) -> list[list[float]]:
    """[slot][class] a lower bound on the iteration time of every plan that runs the slot with
    that class: `planner.compile.lower_bound_parts`' chain and work bounds with the slot at the
    class's duration and size, every other slot at its least."""
    fast = [class_fastest_s(problem, s.index) for s in problem.slots]
    sizes = [classes(problem, s.index).size for s in problem.slots]
    least = [min(f) for f in fast]
    work = [min(t * a for t, a in zip(f, z)) for f, z in zip(fast, sizes)]
    total = sum(work)

    def chain(i: int, t: float) -> float:
        finish = [0.0] * len(problem.slots)
        for s in problem.slots:  # slots are in topological order
            ready = max((finish[a] for a, b, _ in problem.edges if b == s.index), default=0.0)
            finish[s.index] = ready + (t if s.index == i else least[s.index])
        return max(finish, default=0.0)

    return [[max(chain(i, t), (total - work[i] + t * a) / problem.n_atoms) for t, a in zip(fast[i], sizes[i])]
            for i in range(len(problem.slots))]


def _twin_classes(problem: Problem, slot: int) -> list[list[int]]:
    """Per class of `slot`: the home classes that may hold its very slices (same mesh size, same
    slicing), so that it runs without a parameter copy."""
    s = problem.slots[slot]
    assert s.home is not None
    home, own = classes(problem, s.home), classes(problem, slot)
    by_key: dict[tuple, list[int]] = {}
    for g, h in enumerate(home.reps):
        c = problem.slots[s.home].cands[h]
        by_key.setdefault((c.mesh.size, slicing(c.layout)), []).append(g)
    return [by_key.get((s.cands[k].mesh.size, slicing(s.cands[k].layout)), []) for k in own.reps]


@dataclass
class RelaxedResult:
    status: str
    lower_bound_s: float  # on iteration_s over every plan of the space
    choice: list[int] | None  # a candidate per slot (the relaxed optimum, placed), when CP-SAT found one
    order: list | None = None  # its ops by start time
    starts_s: dict | None = None  # its ops' starts, seconds
    makespan_s: float | None = None  # its schedule's makespan in the model (all unrolled iterations), seconds


def relaxed_bound(problem: Problem, *, incumbent_s: float | None, work_budget: float, time_limit_s: float,
                  known_bound_s: float = 0.0, hint: list[int] | None = None,
                  hint_starts: dict | None = None) -> RelaxedResult:
    """Solve the position-free model within a deterministic work budget: a bound on the iteration
    time of every plan of `problem`'s space, and its answer placed (a candidate per slot, in the
    order of its starts).

    `incumbent_s` is the iteration time of a plan already found (None: none yet): classes whose
    own bound (`class_bounds_s`) is no shorter cannot be in a faster plan and are left out, and no
    schedule longer is searched; the bound returned is then on every plan faster than it (so the
    smaller of it and the incumbent bounds the space). `known_bound_s` is a bound proven before.
    `hint` (a candidate per slot, with `hint_starts`) starts the search."""
    bounds = class_bounds_s(problem)
    cut = math.inf if incumbent_s is None else incumbent_s
    keep = [[q for q, b in enumerate(row) if b < cut] for row in bounds]
    if hint is not None:  # the incumbent's own classes stay (its bound is at most its time)
        for i, k in enumerate(hint):
            q = classes(problem, i).of[k]
            if q not in keep[i]:
                keep[i] = sorted([*keep[i], q])
    if not all(keep):
        return RelaxedResult("INFEASIBLE", math.inf, None)
    if incumbent_s is not None:
        horizon_s = incumbent_s * problem.unroll * 1.0001 + 1e-9
    else:  # every op one after another at its slowest kept class, after its longest relaxed reallocation
        serial = 0.0
        for s in problem.slots:
            fast = class_fastest_s(problem, s.index)
            serial += max(fast[q] for q in keep[s.index])
            if s.home is not None:
                serial += max(max(row) for row in class_realloc_s(problem, s.index, keep[s.home], keep[s.index]))
        horizon_s = serial * problem.unroll * 1.0001 + 1e-9
    if hint is not None:
        # The hint's own classes alone, scheduled by this model first: the hint's schedule then
        # has the model's durations (its own pays exact reallocations, longer than the model's
        # floors), and CP-SAT starts from that objective, not the incumbent's. It improves on it
        # far sooner: PPO 70B on 11 nodes 1.51 -> 0.48 of CP-SAT's deterministic time, on 16
        # nodes 0.58 -> 0.48; the same bound.
        own = [[classes(problem, i).of[k]] for i, k in enumerate(hint)]
        first = _Compact(problem, own, horizon_s=horizon_s)
        first.hint(hint, hint_starts or {})
        tight = first.solve(work_budget=HINT_WORK_SHARE * work_budget, time_limit_s=time_limit_s, known_bound_s=0.0)
        if tight.choice is not None:
            hint, hint_starts = tight.choice, tight.starts_s
    model = _Compact(problem, keep, horizon_s=horizon_s)
    model.start_from(known_bound_s)
    if hint is not None:
        model.hint(hint, hint_starts or {})
    return model.solve(work_budget=work_budget, time_limit_s=time_limit_s, known_bound_s=known_bound_s)


class _Compact:
    """Per slot: one literal per kept class, the mesh's first atom and size as integers, and a
    literal per atom it covers; the placed model's schedule on them (see the module's docstring)."""

    def __init__(self, problem: Problem, keep: list[list[int]], *, horizon_s: float) -> None:
        p = self.p = problem
        self.m = cp_model.CpModel()
        self.keep = keep
        self.n_ops = len(p.slots) * p.unroll
        self.tick, self.horizon = time_grid(horizon_s, self.n_ops)
        self.cls = [classes(p, s.index) for s in p.slots]
        # The model's atom: the coarsest block every kept class's mesh is made of, wherever it sits
        # (a whole node when no kept class is smaller or starts mid-node): per-atom rules hold alike
        # on the problem's atoms inside one.
        self.unit = math.gcd(p.n_atoms, *(v for i, cl in enumerate(self.cls) for k, q in enumerate(cl.of)
                                          if q in set(keep[i]) for v in (p.ops[i][k].atoms.start, cl.size[q])))
        self.n = p.n_atoms // self.unit
        self.sizes = [[cl.size[q] // self.unit for q in keep] for cl, keep in zip(self.cls, keep)]
        self._choices()
        self._coverage()
        self._lengths()
        self._occupancy()
        self._memory()
        self._objective()

    def ticks(self, seconds: float) -> int:
        return int(math.ceil(seconds / self.tick - 1e-9))

    def _choices(self) -> None:
        """The class literals, size and first atom of each slot's mesh, the first atom among the
        class's positions. Positions are mirror-symmetric when every class's are (runs of whole
        nodes, aligned blocks) and nothing here depends on more than the mesh size, so the first
        home call sits in the cluster's first half."""
        p, m, n, unit = self.p, self.m, self.n, self.unit
        self.x, self.size, self.pos, self.at = [], [], [], []
        mirrored = True
        for i, (cl, keep) in enumerate(zip(self.cls, self.keep)):
            xs = [m.new_bool_var(f"x_{i}_{q}") for q in keep]
            m.add_exactly_one(xs)
            sizes = self.sizes[i]
            size = m.new_int_var(min(sizes), max(sizes), f"size_{i}")
            m.add(size == cp_model.LinearExpr.weighted_sum(xs, sizes))
            pos = m.new_int_var(0, n - 1, f"pos_{i}")
            m.add(pos + size <= n)
            starts: dict[int, set[int]] = {}
            at: dict[tuple[int, int], int] = {}
            for k, q in enumerate(cl.of):
                first = p.ops[i][k].atoms.start // unit
                starts.setdefault(q, set()).add(first)
                at.setdefault((q, first), k)
            for q, lit in zip(keep, xs):
                m.add_linear_expression_in_domain(pos, cp_model.Domain.from_values(sorted(starts[q]))).only_enforce_if(lit)
                mirrored &= all(n - f - cl.size[q] // unit in starts[q] for f in starts[q])
            self.x.append(xs)
            self.size.append(size)
            self.pos.append(pos)
            self.at.append(at)
        self.mirrored = mirrored
        if mirrored:
            first = assignment_order(p)[0]
            m.add(2 * self.pos[first] + self.size[first] <= n)

    def _coverage(self) -> None:
        """cov[i][a]: slot i's mesh covers atom a (its first atom at most a, its end past a)."""
        p, m = self.p, self.m
        self.cov = []
        for i in range(len(p.slots)):
            lits = []
            for a in range(self.n):
                lo, hi, c = m.new_bool_var(""), m.new_bool_var(""), m.new_bool_var(f"cov_{i}_{a}")
                m.add(self.pos[i] <= a).only_enforce_if(lo)
                m.add(self.pos[i] > a).only_enforce_if(~lo)
                m.add(self.pos[i] + self.size[i] > a).only_enforce_if(hi)
                m.add(self.pos[i] + self.size[i] <= a).only_enforce_if(~hi)
                m.add_bool_and([lo, hi]).only_enforce_if(c)
                m.add_bool_or([~lo, ~hi]).only_enforce_if(~c)
                lits.append(c)
            self.cov.append(lits)

    def _lengths(self) -> None:
        """Each slot's length: its reallocation delay, pinned to the position-free table's entry
        for the two classes, plus its duration; the atoms its home mesh sends from beyond its own."""
        p, m = self.p, self.m
        self.dur_t = [[self.ticks(t) for t in class_fastest_s(p, s.index)] for s in p.slots]
        self.L, self.delay, self.send = [], {}, {}
        for s in p.slots:
            i = s.index
            dur = cp_model.LinearExpr.weighted_sum(self.x[i], [self.dur_t[i][q] for q in self.keep[i]])
            length = m.new_int_var(0, self.horizon, f"L_{i}")
            if s.home is None:
                m.add(length == dur)
            else:
                table = [[self.ticks(t) for t in row] for row in class_realloc_s(p, i, self.keep[s.home], self.keep[i])]
                top = max((max(row) for row in table), default=0)
                d = m.new_int_var(0, top, f"delay_{i}")
                for row, lit in zip(table, self.x[s.home]):
                    m.add(d == cp_model.LinearExpr.weighted_sum(self.x[i], row)).only_enforce_if(lit)
                m.add(length == d + dur)
                self.delay[i] = d
                e = m.new_int_var(0, self.n, f"send_{i}")
                m.add(e >= self.size[s.home] - self.size[i])
                self.send[i] = e
            self.L.append(length)

    def _occupancy(self) -> None:
        """Per atom, the placed model's no-overlap of the ops covering it and of the reallocations
        sending from it; over the cluster, the same as one cumulative resource (redundant, it
        propagates sooner); the unrolled graph's precedences, transfers at no cost."""
        p, m = self.p, self.m
        self.S = {(u, s.index): m.new_int_var(0, self.horizon, f"S_{u}_{s.index}") for u in range(p.unroll)
                  for s in p.slots}
        self.E = {(u, s.index): m.new_int_var(0, self.horizon, f"E_{u}_{s.index}") for u in range(p.unroll)
                  for s in p.slots}
        per_atom: list[list] = [[] for _ in range(self.n)]
        whole, demands = [], []
        for (u, i), start in self.S.items():
            m.add(self.E[u, i] == start + self.L[i])
            whole.append(m.new_interval_var(start, self.L[i], self.E[u, i], f"I_{u}_{i}"))
            demands.append(self.size[i])
            for a in range(self.n):
                per_atom[a].append(m.new_optional_interval_var(start, self.L[i], self.E[u, i], self.cov[i][a], ""))
            if i not in self.delay:
                continue
            home = p.slots[i].home
            assert home is not None
            r = m.new_int_var(0, self.horizon, f"R_{u}_{i}")
            m.add(r == start + self.delay[i])
            whole.append(m.new_interval_var(start, self.delay[i], r, f"R_{u}_{i}"))
            demands.append(self.send[i])
            for a in range(self.n):
                lit = m.new_bool_var("")
                m.add(lit >= self.cov[home][a] - self.cov[i][a])
                per_atom[a].append(m.new_optional_interval_var(start, self.delay[i], r, lit, ""))
        for ivs in per_atom:
            m.add_no_overlap(ivs)
        m.add_cumulative(whole, demands, self.n)
        for before, after, _ in precedences(p):
            m.add(self.S[after] >= self.E[before])

    def _memory(self) -> None:
        """`Problem.memory`'s rule per atom: the states homed there plus the need of each op that
        runs there, within the GPU; offloaded states within the host's share. A call runs without a
        parameter copy only as a twin: a home class with its slices on a mesh of its size, placed
        at the same atom.

        A home's state on an atom is a variable at least its class's bytes where the mesh covers
        the atom (it only ever limits, so the bound is the same), the class's bytes one variable
        per slot, and the rule holds off the op's mesh by a big-M term. Written with the class
        literals in every per-atom row (or with enforced equalities), CP-SAT 9.15's presolve of
        at-most-one constraints with linear ones proved optima above schedules the model holds
        (PPO 13B + 7B on six nodes: 52.29 s, or 55.49 s without probing, where a 51.14 s schedule is
        feasible), as google/or-tools#5293 reports; `tests/test_relax.py` checks the optimum
        against CP-SAT without presolve, and `planner.compile._search_decomposed` discards a bound
        above any plan it finds."""
        p, m = self.p, self.m
        cap, ops = p.cluster.usable_mem_bytes, p.ops
        homes = [s.index for s in p.slots if s.home is None]

        def per_atom(slot: int, values: list[int]) -> list | None:
            """Per atom: a variable at least `values` of the slot's class where its mesh covers it."""
            if not any(values):
                return None
            top = int(max(values))
            total = m.new_int_var(min(values), top, "")  # one variable, so the per-atom rows hold no class literal
            m.add(total == cp_model.LinearExpr.weighted_sum(self.x[slot], values))
            out = []
            for a in range(self.n):
                v = m.new_int_var(0, top, "")
                m.add(v >= total - top * (1 - self.cov[slot][a]))
                out.append(v)
            return out

        held: dict[int, list] = {}
        for h in homes:
            got = per_atom(h, [ops[h][self.cls[h].reps[q]].resident_bytes for q in self.keep[h]])
            if got is not None:
                held[h] = got
        for s in p.slots:
            i = s.index
            reps = [self.cls[i].reps[q] for q in self.keep[i]]
            needs = [ops[i][k].work_bytes + ops[i][k].copy_bytes for k in reps]
            need = m.new_int_var(min(needs), max(needs), f"need_{i}")
            m.add(need == cp_model.LinearExpr.weighted_sum(self.x[i], needs))
            saving = self._twin_saving(i) if s.home is not None else None
            expr = need if saving is None else need - saving
            # Off the mesh the need may be anything: big-M, not an enforcement literal (see above).
            big = sum(max(ops[h][k].resident_bytes for k in self.cls[h].reps) for h in held) + max(
                ops[i][k].work_bytes + ops[i][k].copy_bytes for k in reps)
            for a in range(self.n):
                m.add(sum(v[a] for v in held.values()) + expr <= cap + big * (1 - self.cov[i][a]))
        host = [v for v in (per_atom(h, [ops[h][self.cls[h].reps[q]].host_bytes for q in self.keep[h]])
                            for h in homes) if v is not None]
        for a in range(self.n):
            if host:
                m.add(sum(v[a] for v in host) <= p.host_cap_bytes)

    def _twin_saving(self, i: int) -> cp_model.IntVar | None:
        """The parameter copy slot i saves by running as a twin of its home (None when it cannot)."""
        p, m = self.p, self.m
        home = p.slots[i].home
        assert home is not None
        twins = _twin_classes(p, i)
        index = {g: n for n, g in enumerate(self.keep[home])}
        options = [[index[g] for g in twins[q] if g in index] for q in self.keep[i]]
        if not any(options):
            return None
        y = m.new_bool_var(f"twin_{i}")
        for lit, homes in zip(self.x[i], options):
            if homes:
                m.add_bool_or([self.x[home][g] for g in homes]).only_enforce_if([y, lit])
            else:
                m.add_implication(y, ~lit)
        m.add(self.pos[i] == self.pos[home]).only_enforce_if(y)
        copy = [p.ops[i][self.cls[i].reps[q]].copy_bytes for q in self.keep[i]]
        saved = m.new_int_var(0, max(copy), f"saved_{i}")  # at most its own copy, none unless a twin
        m.add(saved <= cp_model.LinearExpr.weighted_sum(self.x[i], copy))
        m.add(saved <= max(copy) * y)
        return saved

    def _objective(self) -> None:
        """The makespan in steps of `OBJECTIVE_STEP` ticks, as the placed model counts it, with
        the cluster's work within atoms x makespan (implied, but linear)."""
        p, m = self.p, self.m
        self.makespan = m.new_int_var(0, self.horizon, "makespan")
        m.add_max_equality(self.makespan, list(self.E.values()))
        work = [lit * (self.dur_t[i][q] * size) for i in range(len(p.slots))
                for q, lit, size in zip(self.keep[i], self.x[i], self.sizes[i])]
        m.add(p.unroll * sum(work) <= self.n * self.makespan)
        self.steps = m.new_int_var(0, -(-self.horizon // OBJECTIVE_STEP), "steps")
        m.add(self.makespan <= OBJECTIVE_STEP * self.steps)
        m.minimize(self.steps)

    def start_from(self, bound_s: float) -> None:
        floor = int(math.floor(bound_s * self.p.unroll / self.tick))
        if 0 < floor <= self.horizon:
            self.m.add(self.makespan >= floor)

    def hint(self, choice: list[int], starts: dict) -> None:
        """Start from `choice` (mirrored when its first home call sits in the second half)."""
        n, ops, unit = self.n, self.p.ops, self.unit
        first = assignment_order(self.p)[0]
        span = ops[first][choice[first]].atoms
        flip = self.mirrored and 2 * span.start // unit + len(span) // unit > n
        for i, k in enumerate(choice):
            q = self.cls[i].of[k]
            for g, var in zip(self.keep[i], self.x[i]):
                self.m.add_hint(var, int(g == q))
            span = ops[i][k].atoms
            first, size = span.start // unit, len(span) // unit
            self.m.add_hint(self.pos[i], n - first - size if flip else first)
        for op, t in starts.items():
            self.m.add_hint(self.S[op], min(self.horizon, self.ticks(t)))

    def solve(self, *, work_budget: float, time_limit_s: float, known_bound_s: float) -> RelaxedResult:
        solver = cp_model.CpSolver()
        prm = solver.parameters
        prm.max_time_in_seconds = time_limit_s
        prm.max_deterministic_time = max(0.05, work_budget)  # the work budget, not the clock, decides
        prm.num_workers = 1
        prm.random_seed = 0
        prm.relative_gap_limit = 1e-4
        prm.linearization_level = 0  # as the placed model (`planner.cpsat`)
        # No presolve probing: the same optimum as with it and as without any presolve on every
        # instance checked (`tests/test_relax.py`), in two thirds of the time.
        prm.cp_model_probing_level = 0
        prm.log_search_progress = bool(os.environ.get("PLANNER_CPSAT_LOG"))
        status = solver.solve(self.m)
        name = solver.status_name(status)
        if status == cp_model.INFEASIBLE:
            return RelaxedResult(name, math.inf, None)
        bound = steps_bound_s(solver.best_objective_bound, n_ops=self.n_ops, tick_s=self.tick, unroll=self.p.unroll)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return RelaxedResult(name, max(bound, known_bound_s), None)
        choice = []
        for i, xs in enumerate(self.x):
            q = next(q for q, v in zip(self.keep[i], xs) if solver.value(v))
            choice.append(self.at[i][q, solver.value(self.pos[i])])  # in the model's atoms
        starts = {op: solver.value(v) for op, v in self.S.items()}
        return RelaxedResult(name, max(bound, known_bound_s), choice, sorted(starts, key=lambda op: (starts[op], op)),
                             {op: t * self.tick for op, t in starts.items()}, solver.value(self.makespan) * self.tick)
