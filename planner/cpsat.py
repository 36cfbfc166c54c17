"""CP-SAT model of the whole search: the chosen candidate per call and the schedule, jointly.

Built in named steps, as Alpa builds its ILP: variables, hint, one function per constraint
family, objective; always a time limit and a checked status; the answer is re-simulated after
decoding. The model has exactly the simulator's semantics (`planner.simulate`), so:

- its proven objective bound is a lower bound on any plan in the candidate space, and
- decoding its schedule as a priority order and simulating it never gives a longer makespan.

Times are integers in ticks (durations rounded up); memory in bytes. The objective is the
makespan in steps of `OBJECTIVE_STEP` ticks (0.1% of the horizon).

Variables, per slot i and candidate k: ``x[i][k]`` (chosen). Per unrolled op (u, i): start
``S``, end ``E``; per slot: length ``L = delay + sum_k dur_k x_k`` where ``delay`` is the
reallocation time from the home placement, equal to its table's entry for the chosen pair
(`Problem.realloc_groups`: one row per group of home candidates that cost alike, one literal per
group of the call's). Each candidate contributes an optional interval ``[S, E)`` on the atoms of
its mesh, and each home candidate an optional interval ``[S, S + delay)`` on the atoms of the home
mesh the call does not itself occupy (the sending side of the reallocation). One NoOverlap per
atom. Reallocations not yet costed exactly enter at `Problem.realloc_s`'s lower bound, so the
model's optimum bounds every plan; the search re-solves once the chosen ones are costed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ortools.sat.python import cp_model

from planner.beam import assignment_order, symmetric_cluster
from planner.problem import Problem
from planner.simulate import Op, Schedule, precedences, simulate

CpsatProgress = Callable[[float | None, float], None]  # (incumbent iteration_s or None, bound on it)
HORIZON_TICKS = 100_000  # the horizon (the hint's makespan) in integer time steps
OBJECTIVE_STEP = 100  # ticks per step of the objective: 0.1% of the horizon


def time_grid(horizon_s: float, n_ops: int) -> tuple[float, int]:
    """(seconds per tick, the horizon in ticks) of a model whose schedules end by `horizon_s`:
    `HORIZON_TICKS` over the horizon, plus room for each op's durations rounded up."""
    tick_s = max(horizon_s, 1e-9) / HORIZON_TICKS
    return tick_s, int(math.ceil(horizon_s / tick_s)) + 4 * n_ops + 1


def steps_bound_s(best_steps: float, *, n_ops: int, tick_s: float, unroll: int) -> float:
    """A solver's bound on the objective (whole steps of `OBJECTIVE_STEP` ticks) as a bound on
    the exact iteration time: a makespan in step B may be one step short of B steps, and
    durations were rounded up, each op on a chain by up to three ticks (duration, reallocation
    delay, transfer lag)."""
    return max(0.0, (best_steps - 1) * OBJECTIVE_STEP - 3 * n_ops) * tick_s / unroll


class _Incumbents(cp_model.CpSolverSolutionCallback):
    """Reports each solution CP-SAT finds (its objective and bound, in seconds per iteration)."""

    def __init__(self, report: CpsatProgress, *, scale: float, slack: int) -> None:
        super().__init__()
        self._report, self._scale, self._slack = report, scale, slack

    def on_solution_callback(self) -> None:
        self._report(self.objective_value * OBJECTIVE_STEP * self._scale,
                     max(0.0, (self.best_objective_bound - 1) * OBJECTIVE_STEP - self._slack) * self._scale)


@dataclass
class CpsatResult:
    choice: list[int] | None
    order: list[Op] | None
    status: str
    lower_bound_s: float  # on iteration_s (makespan / unroll)
    objective_s: float | None


def _weighted(coeffs: list[int], xs: list[cp_model.IntVar]) -> cp_model.LinearExprT:
    """sum(c * x) over the nonzero coefficients: the same constraint terms, in the same order, as
    the Python sum, built in one call (large pairwise tables make the sum the slow part)."""
    keep = [k for k, c in enumerate(coeffs) if c]
    return cp_model.LinearExpr.weighted_sum([xs[k] for k in keep], [coeffs[k] for k in keep])


class _Model:
    """The CP-SAT model of one problem; `solve` returns a `CpsatResult`."""

    def __init__(self, problem: Problem, *, horizon_s: float, allowed=None) -> None:  # noqa: ANN001
        self.p = problem
        self.allowed = allowed
        self.hinted = False  # `hint` gave a schedule of this model
        self.n_ops = len(problem.slots) * problem.unroll  # operations of the unrolled iterations
        self.tick_s, self.horizon = time_grid(horizon_s, self.n_ops)
        self.m = cp_model.CpModel()
        self._variables()
        self._choice_constraints()
        self._realloc_delays()
        self._intervals()
        self._precedence()
        self._memory()
        self._objective()

    def ticks(self, seconds: float) -> int:
        return int(math.ceil(seconds / self.tick_s - 1e-9))

    # Steps ------------------------------------------------------------------------------------

    def _variables(self) -> None:
        p, m = self.p, self.m
        self.x = [[m.new_bool_var(f"x_{i}_{k}") for k in range(len(s.cands))] for i, s in enumerate(p.slots)]
        self.S = {(u, i): m.new_int_var(0, self.horizon, f"S_{u}_{i}") for u in range(p.unroll) for i in range(len(p.slots))}
        self.E = {(u, i): m.new_int_var(0, self.horizon, f"E_{u}_{i}") for u in range(p.unroll) for i in range(len(p.slots))}
        self.delay: dict[int, tuple[cp_model.IntVar, int]] = {}  # slot -> (delay, its largest value)
        self.src_lit: dict[tuple[int, int], cp_model.IntVar] = {}
        self.L = [m.new_int_var(0, self.horizon, f"L_{i}") for i in range(len(p.slots))]

    def _choice_constraints(self) -> None:
        p, m = self.p, self.m
        first_home = assignment_order(p)[0]
        for s in p.slots:
            m.add_exactly_one(self.x[s.index])
            for k, cand in enumerate(s.cands):
                if self.allowed is not None and not self.allowed.static(p, s.index, k):
                    m.add(self.x[s.index][k] == 0)
                if (self.allowed is None and s.index == first_home and symmetric_cluster(p)
                        and cand.mesh.first != 0):
                    m.add(self.x[s.index][k] == 0)  # mirror symmetry of aligned blocks
        if self.allowed is not None:
            self.allowed.add_joint(self, p)

    def _group_lits(self, slot: int, groups: list[int]) -> list[cp_model.IntVar]:
        """One literal per group of `slot`'s candidates: whether the chosen one is in it (its x
        itself for a group of one)."""
        key = (slot, tuple(groups))
        if key not in self._lits:
            members: list[list[int]] = [[] for _ in range(max(groups, default=-1) + 1)]
            for k, g in enumerate(groups):
                members[g].append(k)
            lits = []
            for g, ks in enumerate(members):
                if len(ks) == 1:
                    lits.append(self.x[slot][ks[0]])
                    continue
                lit = self.m.new_bool_var(f"g_{slot}_{len(self._lits)}_{g}")
                self.m.add(lit == sum(self.x[slot][k] for k in ks))
                lits.append(lit)
            self._lits[key] = lits
        return self._lits[key]

    def _realloc_delays(self) -> None:
        """Each call's reallocation delay, pinned to the table's entry for the chosen home and
        own candidates: by groups of candidates that cost alike (`Problem.realloc_groups`), a
        home group's literal enforcing the delay as a sum over the call's group literals."""
        p, m = self.p, self.m
        self._lits: dict[tuple, list[cp_model.IntVar]] = {}
        for s in p.slots:
            dur = sum(self.ticks(p.fastest_s(s.index, k)) * self.x[s.index][k] for k in range(len(s.cands)))
            if s.home is None:
                m.add(self.L[s.index] == dur)
                continue
            hg, kg, reps = p.realloc_groups(s.index)
            n_k = max(kg) + 1
            table = [[self.ticks(p.realloc_s(s.index, h, k)) for h, k in reps[row * n_k:(row + 1) * n_k]]
                     for row in range(len(reps) // n_k)]
            top = max((max(row) for row in table), default=0)
            d = m.new_int_var(0, top, f"delay_{s.index}")
            self.delay[s.index] = (d, top)
            if top:
                home_lits, own_lits = self._group_lits(s.home, hg), self._group_lits(s.index, kg)
                for row, lit in zip(table, home_lits):  # pinned, not just bounded: no slack to shave
                    m.add(d == _weighted(row, own_lits)).only_enforce_if(lit)
            m.add(self.L[s.index] == d + dur)

    def _intervals(self) -> None:
        """One optional interval per (op, atom), present when the chosen candidate covers the atom,
        and one per (op, atom) for the sending side of the reallocation: atoms of the home mesh
        the call itself does not cover."""
        p, m = self.p, self.m
        self.cov: list[dict[int, cp_model.IntVar]] = []
        for s in p.slots:
            cover: dict[int, list] = {}
            for k, op in enumerate(p.ops[s.index]):
                for a in op.atoms:
                    cover.setdefault(a, []).append(self.x[s.index][k])
            lits = {}
            for a, xs in cover.items():
                lit = m.new_bool_var(f"cov_{s.index}_{a}")
                m.add(lit == sum(xs))
                lits[a] = lit
            self.cov.append(lits)
        per_atom: list[list] = [[] for _ in range(p.n_atoms)]
        for u in range(p.unroll):
            for s in p.slots:
                i = s.index
                m.add(self.E[u, i] == self.S[u, i] + self.L[i])
                for a, lit in self.cov[i].items():
                    per_atom[a].append(m.new_optional_interval_var(self.S[u, i], self.L[i], self.E[u, i], lit, f"I_{u}_{i}_{a}"))
                if i not in self.delay:
                    continue
                d, top = self.delay[i]
                if not top:
                    continue
                R = m.new_int_var(0, self.horizon, f"R_{u}_{i}")
                m.add(R == self.S[u, i] + d)
                assert s.home is not None  # a slot with a reallocation delay has a home elsewhere
                for a, home_lit in self.cov[s.home].items():
                    key = (i, a)
                    if key not in self.src_lit:
                        lit = m.new_bool_var(f"src_{i}_{a}")
                        own = self.cov[i].get(a, 0)
                        m.add(lit >= home_lit - own)
                        self.src_lit[key] = lit
                    per_atom[a].append(m.new_optional_interval_var(self.S[u, i], d, R, self.src_lit[key], f"R_{u}_{i}_{a}"))
        for ivs in per_atom:
            if len(ivs) > 1:
                m.add_no_overlap(ivs)

    def _precedence(self) -> None:
        p, m = self.p, self.m
        self.T: dict[int, cp_model.IntVar] = {}
        for e, (i, j, _) in enumerate(p.edges):
            pg, cg, seconds = p.transfer_groups(e)  # producer group x consumer group
            table = [[self.ticks(t) for t in row] for row in seconds]
            top = max((max(row) for row in table), default=0)
            if top == 0:
                continue
            t = m.new_int_var(0, top, f"T_{e}")
            cons = self._group_lits(j, cg)
            for row, lit in zip(table, self._group_lits(i, pg)):
                m.add(t == _weighted(row, cons)).only_enforce_if(lit)
            self.T[e] = t
        for a, b, edge in precedences(p):
            lag = self.T.get(edge, 0) if edge is not None else 0
            m.add(self.S[b] >= self.E[a] + lag)

    def _memory(self) -> None:
        """Per atom: resident state of the models homed on it plus the chosen op's need (with a
        parameter copy unless its home runs a twin) fits in the GPU: `Problem.memory`'s rule,
        read from the same op-semantics table."""
        p, m = self.p, self.m
        cap = p.cluster.usable_mem_bytes
        resident: list[list] = [[] for _ in range(p.n_atoms)]
        for s in p.slots:
            for k, op in enumerate(p.ops[s.index]):
                if op.resident_bytes:
                    for a in op.atoms:
                        resident[a].append(op.resident_bytes * self.x[s.index][k])
        self.y: dict[tuple[int, int], cp_model.IntVar] = {}
        for s in p.slots:
            need: dict[int, list] = {}
            for k, op in enumerate(p.ops[s.index]):
                term = (op.work_bytes + op.copy_bytes) * self.x[s.index][k]
                if op.copy_bytes and op.twins:  # no copy when the home holds the very same slices
                    assert s.home is not None  # only a call with a home elsewhere copies
                    y = m.new_bool_var(f"twin_{s.index}_{k}")
                    m.add_implication(y, self.x[s.index][k])
                    m.add(y <= sum(self.x[s.home][h] for h in sorted(op.twins)))
                    self.y[s.index, k] = y
                    term = term - op.copy_bytes * y
                for a in op.atoms:
                    need.setdefault(a, []).append(term)
            for a, terms in need.items():
                m.add(sum(resident[a]) + sum(terms) <= cap)
        host: list[list] = [[] for _ in range(p.n_atoms)]  # offloaded states within the host memory
        for s in p.slots:
            for k, op in enumerate(p.ops[s.index]):
                if op.host_bytes:
                    for a in op.atoms:
                        host[a].append(op.host_bytes * self.x[s.index][k])
        for terms in host:
            if terms:
                m.add(sum(terms) <= p.host_cap_bytes)

    def _objective(self) -> None:
        p, m = self.p, self.m
        self.makespan = m.new_int_var(0, self.horizon, "makespan")
        m.add_max_equality(self.makespan, list(self.E.values()))
        # Redundant energy cuts: every atom runs all its ops one after another. Implied by the
        # no-overlap constraints, but linear, so they tighten the bound CP-SAT can prove.
        for a in range(p.n_atoms):
            work = [self.ticks(p.fastest_s(s.index, k)) * self.x[s.index][k] for s in p.slots
                    for k, op in enumerate(p.ops[s.index]) if a in op.atoms]
            if work:
                m.add(p.unroll * sum(work) <= self.makespan)
        # The objective counts whole steps of OBJECTIVE_STEP ticks: a schedule one tick shorter is
        # no better, so the search never spends its budget shaving ticks one solution at a time
        # (the bound loses at most one step).
        self.steps = m.new_int_var(0, -(-self.horizon // OBJECTIVE_STEP), "makespan_steps")
        m.add(self.makespan <= OBJECTIVE_STEP * self.steps)
        m.minimize(self.steps)

    def start_from(self, bound_s: float) -> None:
        """No makespan below a proven bound: every schedule of the model, its durations rounded
        up, is at least as long as the exact plan it stands for, which the bound bounds."""
        floor = int(math.floor(bound_s * self.p.unroll / self.tick_s))
        if 0 < floor <= self.horizon:
            self.m.add(self.makespan >= floor)

    # Hint and solve -------------------------------------------------------------------------

    def hint(self, choice: list[int], sched: Schedule) -> None:
        p, m = self.p, self.m
        self.hinted = True
        for i, ks in enumerate(self.x):
            for k, var in enumerate(ks):
                m.add_hint(var, int(choice[i] == k))
        for (i, k), y in self.y.items():
            m.add_hint(y, int(choice[i] == k and p.shares_params(i, k, p.home_choice(i, choice))))
        for op, t in sched.start.items():
            m.add_hint(self.S[op], min(self.horizon, self.ticks(t)))
        for i, lits in enumerate(self.cov):
            chosen = set(p.ops[i][choice[i]].atoms)
            for a, lit in lits.items():
                m.add_hint(lit, int(a in chosen))

    def solve(self, *, time_limit_s: float, work_budget: float, workers: int,
              on_progress: CpsatProgress | None = None) -> CpsatResult:
        solver, status = self._run(time_limit_s=time_limit_s, work_budget=work_budget, workers=workers,
                                   on_progress=on_progress, presolve=True)
        if status == cp_model.INFEASIBLE and self.hinted:
            # The hint is a schedule of this very model (its horizon is the hint's makespan), so
            # INFEASIBLE is the presolve's error, not the model's: CP-SAT 9.15's presolve has
            # declared such models infeasible (PPO 13B+7B on six nodes' aligned meshes: "empty
            # domain" in an exactly-one of a call's candidates; google/or-tools#5293 is alike).
            # Solved again without it, the same budget.
            solver, status = self._run(time_limit_s=time_limit_s, work_budget=work_budget, workers=workers,
                                       on_progress=on_progress, presolve=False)
        return self._result(solver, status)

    def _run(self, *, time_limit_s: float, work_budget: float, workers: int, on_progress: CpsatProgress | None,
             presolve: bool) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus]:
        solver = cp_model.CpSolver()
        prm = solver.parameters
        prm.max_time_in_seconds = time_limit_s
        # Deterministic: a work budget rather than wall time decides where the search stops.
        prm.max_deterministic_time = max(0.05, work_budget)
        prm.num_workers = workers
        prm.interleave_search = workers > 1
        prm.random_seed = 0
        prm.relative_gap_limit = 1e-4
        # No LP relaxation: the enforced reallocation and transfer tables and the optional
        # intervals relax to almost nothing, and propagation with the energy cuts proves these
        # bounds sooner (bench/search.py: every instance OPTIMAL, in a half to a third of the time).
        prm.linearization_level = 0
        # No presolve probing. With probing level 1 (a tenth less work than the default) CP-SAT
        # 9.15 proved 98.09 s OPTIMAL for PPO 13B+7B on three nodes' node-range meshes, where a
        # 97.70 s schedule of the model exists (found without presolve: the wrong-optimum family of
        # google/or-tools#5293); without probing every instance of `tests/test_search.py` ends at
        # the presolve-free optimum, and bench/search.py's instances stay OPTIMAL within 0.1%.
        prm.cp_model_probing_level = 0
        prm.log_search_progress = bool(__import__('os').environ.get('PLANNER_CPSAT_LOG'))
        prm.cp_model_presolve = presolve
        if on_progress is None:
            status = solver.solve(self.m)
        else:
            # Observers only: they read incumbents and bounds and never steer the search.
            scale, slack = self.tick_s / self.p.unroll, 3 * self.n_ops
            solver.best_bound_callback = lambda b: on_progress(None, max(0.0, (b - 1) * OBJECTIVE_STEP - slack) * scale)
            status = solver.solve(self.m, _Incumbents(on_progress, scale=scale, slack=slack))
        return solver, status

    def _result(self, solver: cp_model.CpSolver, status: cp_model.CpSolverStatus) -> CpsatResult:
        name = solver.status_name(status)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            bound = 0.0
            if status == cp_model.UNKNOWN:
                bound = self._bound_s(solver.best_objective_bound)
            return CpsatResult(None, None, name, bound, None)
        choice = [next(k for k, v in enumerate(ks) if solver.value(v)) for ks in self.x]
        starts = {op: solver.value(v) for op, v in self.S.items()}
        default = {op: n for n, op in enumerate(sorted(starts, key=lambda o: (o[0], o[1])))}
        order = sorted(starts, key=lambda op: (starts[op], default[op]))
        # Durations were rounded up to ticks: each op on a chain may add up to three ticks
        # (duration, reallocation delay, transfer lag), so the bound on the exact problem is lower.
        bound = self._bound_s(solver.best_objective_bound)
        return CpsatResult(choice, order, name, bound, solver.value(self.makespan) * self.tick_s / self.p.unroll)

    def _bound_s(self, best_steps: float) -> float:
        return steps_bound_s(best_steps, n_ops=self.n_ops, tick_s=self.tick_s, unroll=self.p.unroll)


def solve_cpsat(problem: Problem, *, hint: list[int] | None, time_limit_s: float, work_budget: float | None = None,
                workers: int = 1, allowed=None, on_progress: CpsatProgress | None = None,  # noqa: ANN001
                known_bound_s: float = 0.0) -> CpsatResult:
    """Optimise jointly, from the `hint` assignment when there is one; the result's order
    re-simulates to at most the CP-SAT objective (reallocations it knew exactly).

    `work_budget` (CP-SAT deterministic time) decides where the search stops, so results repeat;
    `time_limit_s` is a wall-clock safety net only. `on_progress(incumbent_s, bound_s)` hears of
    every solution found and bound proven (iteration seconds, durations rounded to ticks).
    `known_bound_s` is a lower bound on the iteration time proven before (a trivial bound, or an
    earlier round's, whose reallocation times were at most these): the model starts from it
    instead of proving it again."""
    if hint is not None:
        sched = simulate(problem, hint, exact=False)
        horizon = sched.makespan_s * 1.0001 + 1e-9
    else:  # no plan to start from: everything one after another bounds any sensible schedule
        horizon = problem.serial_makespan_s() * 1.0001 + 1e-9
    model = _Model(problem, horizon_s=horizon, allowed=allowed)
    model.start_from(known_bound_s)
    if hint is not None:
        model.hint(hint, sched)
    budget = work_budget if work_budget is not None else time_limit_s * 0.5
    return model.solve(time_limit_s=time_limit_s, work_budget=budget, workers=workers, on_progress=on_progress)
