"""Compile a graph for a cluster: candidates, beam search, CP-SAT, and the plan.

    plan = compile_graph(graph, parse_cluster("a100-80gb:2x8"), time_limit_s=10)

The plan states the simulator's times for the best assignment found, the solver's proven lower
bound over the candidate space and the gap between them. A baseline (`planner.baselines`) is the
same search over a restricted domain.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from cost_models import CostModel
from cost_models.hardware import core_share
from planner.baselines import Restriction, baseline_spaces, restriction
from planner.beam import aligned_only, beam_search, beam_width_for, is_aligned, symmetric_cluster
from planner.candidates import (
    SearchSpace,
    graph_candidates,
    layout_evaluations,
    merge_candidates,
    mesh_sizes,
    min_memory_needed,
    node_ranges_on,
    stack_space,
)
from planner.cpsat import solve_cpsat
from planner.exhaustive import topological_orders
from planner.problem import Problem, build_problem
from planner.relax import classes, relaxed_bound
from planner.simulate import Schedule, simulate
from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.graph import Graph
from plans.hardware import GIB
from plans.plan import (
    BOUND_MET,
    PLAN_VERSION,
    DataTransfer,
    Estimate,
    Plan,
    PlanCall,
    Reallocation,
    SearchInfo,
)


@dataclass(frozen=True)
class SearchProgress:
    """Where the search is, for a progress display; reporting it never changes what is found."""

    phase: str  # "costing", "beam", "relaxed", "cpsat", "polish"
    detail: str = ""
    candidates: int | None = None  # placed (call, candidate) pairs in the search
    best_s: float | None = None  # iteration time of the best plan found so far (exact simulation)
    bound_s: float | None = None  # proven lower bound on the iteration time
    solver_s: float | None = None  # CP-SAT's incumbent (durations rounded up to ticks), not yet re-simulated

    def __str__(self) -> str:
        words = {"costing": "costing layouts", "beam": "beam search", "cpsat": "CP-SAT", "polish": "polishing",
                 "relaxed": "CP-SAT without positions"}
        parts = [words.get(self.phase, self.phase) + (f" {self.detail}" if self.detail else "")]
        if self.candidates is not None:
            parts.append(f"{self.candidates} candidates")
        if self.best_s is not None:
            parts.append(f"best {_fmt_s(self.best_s)}")
        if self.solver_s is not None:
            parts.append(f"incumbent {_fmt_s(self.solver_s)}")
        if self.bound_s is not None:
            gap = f" (gap {(self.best_s - self.bound_s) / self.best_s * 100:.1f}%)" if self.best_s else ""
            parts.append(f"bound {_fmt_s(self.bound_s)}{gap}")
        return " · ".join(parts)


def _fmt_s(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.4g} {unit}"
    return f"{seconds * 1e6:.4g} us"


Progress = Callable[[SearchProgress], None]
MAX_CPSAT_ROUNDS = 3  # re-solves after costing reallocations CP-SAT saw only as lower bounds
CPSAT_WORK_SHARE = (0.3, 0.1, 0.1)  # of --time-limit, as CP-SAT deterministic time, per round
MAX_ORDERS_TRIED = 5000  # list-scheduling orders tried for the final assignment
# Where not every pair of candidate changes can be tried, polishing pairs up the single changes that
# lengthen the schedule least, this many of them (`polish`).
PROMISING_SINGLES = 24
# Polishing runs only while the plan is further than this from the proven bound: closer, it could
# gain no more than this (two steps of CP-SAT's objective, `planner.cpsat.OBJECTIVE_STEP`).
POLISH_GAP = 0.002
# Work budgets, not the clock, decide the plan (same inputs, same plan). The clock only stops a
# search that runs far past its budget, on a machine much slower or busier than expected.
WALL_SAFETY_FACTOR = 3.0
WALL_SAFETY_S = 5.0
MAX_CALLS = 64  # calls per graph; real iterations make fewer than a dozen, and search work grows with the square
MAX_TIME_LIMIT_S = 86_400.0
# Pairwise cost tables CP-SAT builds (reallocation: home x call candidates; transfer: producer x
# consumer candidates). Past this many entries building the model alone takes minutes, so the
# beam-search plan is kept and the plan says CP-SAT did not run.
CPSAT_TABLE_LIMIT = 2_000_000
# Past this many entries in a space with runs of consecutive nodes (where positions multiply: a
# 16-node cluster has 738,000 for a PPO 70B), the search decomposes: mesh sizes first, with a
# bound on the whole space (`planner.relax`), then positions of the chosen sizes
# (`_search_decomposed`). Below it the placed model proves its optimum within the budget.
DECOMPOSE_TABLE_SIZE = 15_000
RELAXED_WORK_SHARE = 0.5  # of --time-limit, as CP-SAT deterministic time for the position-free model


def headroom_words(cl: ClusterSpec) -> str:
    """How the usable memory per GPU comes about, for error messages."""
    return f"{cl.mem_bytes / GIB:.0f} GiB less a headroom of {cl.headroom_bytes / GIB:.1f} GiB"


def _no_fit_error(graph: Graph, cm: CostModel, call_name: str, space: SearchSpace,
                  baseline: str | None) -> PlannerError:
    call = graph.call(call_name)
    decl = graph.models[call.model]
    need, size = min_memory_needed(call, decl, cm, space)
    within = f" (baseline {baseline} allows meshes of up to {size} GPUs)" if baseline else ""
    cl = cm.cluster
    have = cl.usable_mem_bytes / GIB
    spec = decl.spec.display_name()
    if need < 0:
        sizes = mesh_sizes(cl, space)
        meshes = f"{sizes[0]} GPUs" if len(sizes) == 1 else f"{sizes[0]} to {sizes[-1]} GPUs"
        return PlannerError(
            f"call {call_name!r} ({spec}, {call.kind}) has no valid layout on meshes of {meshes} "
            f"(cluster {cl.short()}{within}): its {call.seqs} sequences, the model's {decl.spec.num_attention_heads} "
            f"heads and {decl.spec.num_hidden_layers} layers cannot be split over that many GPUs",
            hint="the batch must split evenly over data-parallel ranks, the heads over tensor parallel and the "
            "layers over pipeline stages; for a small job, use a smaller cluster (the search uses meshes of at "
            f"least 1/{space.max_blocks} of it) or a larger batch",
        )
    return PlannerError(
        f"call {call_name!r} ({spec}, {call.kind}) does not fit: its best layout on {size} GPUs needs "
        f"{need / GIB:.1f} GiB per GPU, and a {cl.gpu} has {have:.1f} GiB{within} ({headroom_words(cl)})",
        hint="use more or larger GPUs, a smaller batch or sequence length, or a smaller model; "
        "--mem-headroom lowers the margin at your own risk",
    )


def _no_joint_fit_error(problem: Problem, baseline: str | None) -> PlannerError:
    """Every call fits alone, but not beside the states that stay resident between calls."""
    cl = problem.cluster
    resident = 0
    for s in problem.slots:  # each home's leanest state on its largest meshes
        if s.home is None:
            top = max(c.mesh.size for c in s.cands)
            resident += min(op.resident_bytes for c, op in zip(s.cands, problem.ops[s.index]) if c.mesh.size == top)
    work = max(min(op.work_bytes + op.copy_bytes for op in problem.ops[s.index]) for s in problem.slots)
    rule = f" under baseline {baseline}" if baseline else ""
    return PlannerError(
        f"graph {problem.graph.name!r} does not fit on {cl.short()}{rule}: each call fits alone, but the models' "
        f"resident states need at least {resident / GIB:.1f} GiB per GPU even spread over the largest meshes, and "
        f"the leanest call needs {work / GIB:.1f} GiB more while it runs, against {cl.usable_mem_bytes / GIB:.1f} GiB per GPU "
        f"({headroom_words(cl)})",
        hint="use more GPUs or GPUs with more memory, a smaller batch or sequence length, or smaller models",
    )


def lower_bound_parts(problem: Problem) -> tuple[float, float]:
    """(chain_s, work_s): the longest dependency chain at each call's fastest candidate, and all
    calls' least GPU-seconds spread over the cluster (per iteration); each bounds every plan.

    Where ranks time-share a CPU's cores, the work is also counted in core-seconds: a call on r
    ranks of a node at speed share s (`cost_models.hardware.core_share`) for t seconds keeps
    ``r * s * threads`` cores busy, whatever else runs, and a node has ``cpu_cores`` of them; the
    least core-seconds of each call over the busy counts it could meet, summed per node, bound
    every plan too (the larger work bound is kept)."""
    fastest = [min(problem.fastest_s(s.index, k) for k in range(len(s.cands))) for s in problem.slots]
    finish = [0.0] * len(problem.slots)
    for s in problem.slots:  # slots are in topological order
        ready = max((finish[i] for i, j, _ in problem.edges if j == s.index), default=0.0)
        finish[s.index] = ready + fastest[s.index]
    chain = max(finish, default=0.0)
    work = sum(min(problem.fastest_s(s.index, k) * c.mesh.size for k, c in enumerate(s.cands))
               for s in problem.slots) / problem.cluster.world_size
    if problem.cm.shares_cores:
        work = max(work, _core_seconds_bound(problem))
    return chain, work


def _core_seconds_bound(problem: Problem) -> float:
    """The busiest node's least core-seconds per iteration over its cores (`lower_bound_parts`).
    A call's ranks may sit on several nodes; each is charged the cheapest split over them."""
    cluster, cal = problem.cluster, problem.cm.calibration
    cores, threads = cal.hardware.cpu_cores, cal.hardware.rank_threads or 1
    assert cores is not None  # shares_cores needs a core count
    gpn, nodes = cluster.gpus_per_node, cluster.world_size // cluster.gpus_per_node

    def core_s(slot: int, k: int, ranks: int) -> float:  # least over the busy counts it could meet
        return min(problem.busy_time_s(slot, k, b) * ranks * core_share(cluster, cal, busy=b) * threads
                   for b in range(ranks, gpn + 1))

    # Per call, its cheapest candidate's core-seconds spread evenly over the nodes (every
    # placement's total is at least that; the busiest node carries at least the mean).
    total = sum(min(sum(core_s(s.index, k, n) for n in problem.ranks_per_node(c).values()) for k, c in enumerate(s.cands))
                for s in problem.slots)
    return total / (nodes * cores)


def trivial_lower_bound(problem: Problem) -> float:
    """A bound every plan respects: the larger of `lower_bound_parts`."""
    return max(lower_bound_parts(problem))


def compile_graph(graph: Graph, cluster: ClusterSpec, *, time_limit_s: float = 10.0, baseline: str | None = None,
                  calibration=None, beam_width: int = 16, workers: int = 1, space: SearchSpace | None = None,  # noqa: ANN001
                  progress: Progress | None = None, framework: str = "torch") -> Plan:
    """The fastest plan found for `graph` on `cluster` (or the best plan of a baseline's rule),
    costed for the software stack `framework` (`cost_models.framework`; default: the planner's
    runtime)."""
    say = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    check_request(graph, time_limit_s=time_limit_s, beam_width=beam_width, workers=workers)
    cm = CostModel(cluster, calibration, framework=framework)
    rule: Restriction | None = restriction(baseline, graph, cm) if baseline else None
    space = rule.space if rule is not None else (space or SearchSpace())
    pool = cm.framework.layouts.whole_pool  # the stack's engines run every call on all GPUs (verl's one pool)
    space = stack_space(space, cm)
    if rule is None:
        rule = engine_rule(graph, cm, space)
    check_search_size(graph, cm, space)
    say(SearchProgress("costing", detail=f"of {len(graph.calls)} calls"))
    per_size = graph_candidates(graph, cm, space,
                                progress=lambda n, name: say(SearchProgress("costing", detail=f"{name} ({n}/{len(graph.calls)})")))
    if baseline is None:
        # The search space holds every baseline's, so a plan is never slower than a baseline; their
        # meshes sit where this space's do (aligned blocks, or runs of nodes too).
        ranges = node_ranges_on(space, cluster)
        for other in baseline_spaces(graph, cm):
            if pool and other.mesh_sizes != space.mesh_sizes:
                continue
            merge_candidates(per_size, graph_candidates(graph, cm, dataclasses.replace(other, node_ranges=ranges)))
    for name, sizes in per_size.items():
        if not sizes:
            raise _no_fit_error(graph, cm, name, space, baseline)
    problem = build_problem(graph, cm, space, candidates=per_size)
    n_cands = sum(len(s.cands) for s in problem.slots)
    # The emergency brake counts from here: costing the candidates is fixed work (a large mixture
    # of experts takes tens of seconds of it), and must not eat the search's margin.
    found = search(problem, rule=rule, time_limit_s=time_limit_s,
                   deadline=time.perf_counter() + WALL_SAFETY_FACTOR * time_limit_s + WALL_SAFETY_S,
                   beam_width=beam_width, workers=workers, say=say)
    if found is None:
        raise _no_joint_fit_error(problem, baseline)
    choice, sched, bound, status, used_cpsat = found
    method = ("beam+cpsat" if used_cpsat else "beam") if baseline is None else \
        f"{baseline} ({'beam+cpsat' if used_cpsat else 'beam'})"
    wall = time.perf_counter() - t0
    search_info = SearchInfo(method=method, wall_s=round(wall, 3), lower_bound_s=bound,
                        gap=(sched.iteration_s - bound) / sched.iteration_s if sched.iteration_s > 0 else 0.0,
                        candidates=n_cands, status=status)
    return build_plan(problem, choice, sched, search_info)


def engine_rule(graph: Graph, cm: CostModel, space: SearchSpace) -> Restriction | None:
    """The stack's own rule over calls together, where its engines have one: a trained model's
    calls other than generation on one layout (`EngineLayouts.one_worker_layout`, verl's actor and
    critic workers); None otherwise."""
    if not cm.framework.layouts.one_worker_layout:
        return None
    workers = frozenset(m for m, d in graph.models.items()
                        if d.trainable and sum(c.model == m and c.kind != "generate" for c in graph.calls) > 1)
    if not workers:
        return None
    return Restriction(f"{cm.framework.name}: one layout per trained model's worker", space, same_degrees=True,
                       tied=workers)


def check_request(graph: Graph, *, time_limit_s: float, beam_width: int, workers: int) -> None:
    """A `PlannerError` for search settings or a graph size the search cannot honour."""
    if not isinstance(time_limit_s, (int, float)) or not 0 <= time_limit_s <= MAX_TIME_LIMIT_S:
        raise PlannerError(f"time limit must be between 0 and {MAX_TIME_LIMIT_S:.0f} seconds, got {time_limit_s!r}",
                           hint="0 keeps the beam-search plan; a few seconds to a minute is typical")
    for what, value in (("beam width", beam_width), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlannerError(f"{what} must be a whole number of at least 1, got {value!r}")
    if len(graph.calls) > MAX_CALLS:
        raise PlannerError(
            f"graph {graph.name!r} has {len(graph.calls)} calls; the search handles at most {MAX_CALLS} per iteration",
            hint="a graph describes one iteration: make its calls once (the runtime repeats the iteration), "
            "or merge repeated calls on one model into one call with more sequences or minibatches",
        )


def check_search_size(graph: Graph, cm: CostModel, space: SearchSpace) -> None:
    """A `PlannerError` when costing the candidate layouts would take more than a few minutes."""
    need = layout_evaluations(graph, cm, space)
    total = sum(need.values())
    if total > space.max_layout_evals:
        worst = sorted(need.items(), key=lambda kv: -kv[1])[:3]
        raise PlannerError(
            f"graph {graph.name!r} on {cm.cluster.short()} needs {total:,} layout evaluations, more than the "
            f"{space.max_layout_evals:,} the search allows (most: "
            + ", ".join(f"{name} {n:,}" for name, n in worst) + ")",
            hint="fewer distinct calls, or a cluster closer to the job's size; a baseline (--baseline heuristic) "
            "searches far fewer layouts",
        )


def cpsat_table_size(problem: Problem) -> int:
    """Entries of the pairwise reallocation and transfer tables the CP-SAT model would build (by
    groups of candidates that cost alike: `Problem.realloc_groups`, `Problem.transfer_groups`)."""
    n = sum(len(problem.realloc_groups(s.index)[2]) for s in problem.slots if s.home is not None)
    return n + sum(len(set(pg)) * len(set(cg)) for pg, cg in (problem.transfer_group_keys(e) for e in range(len(problem.edges))))


def search(problem: Problem, *, rule: Restriction | None = None, time_limit_s: float, deadline: float | None = None,
           beam_width: int = 16, workers: int = 1, say: Progress | None = None
           ) -> tuple[list[int], Schedule, float, str | None, bool] | None:
    """(assignment, its exact schedule, lower bound on iteration_s, CP-SAT status, whether CP-SAT
    ran) for the best plan found by beam search then CP-SAT, or None when nothing fits.

    Every stopping rule is a deterministic work budget derived from `time_limit_s` (CP-SAT's
    deterministic time, counts of evaluations), so the same inputs give the same plan; the
    wall-clock `deadline` is only a safety net, several times the budget."""
    if deadline is None:
        deadline = time.perf_counter() + WALL_SAFETY_FACTOR * time_limit_s + WALL_SAFETY_S
    say = say or (lambda _p: None)
    tables = cpsat_table_size(problem)
    if rule is None and time_limit_s > 0 and not problem.symmetric and tables > DECOMPOSE_TABLE_SIZE:
        return _search_decomposed(problem, time_limit_s=time_limit_s, deadline=deadline, beam_width=beam_width,
                                  workers=workers, say=say)
    use_cpsat = time_limit_s > 0 and tables <= CPSAT_TABLE_LIMIT
    width = beam_width_for(problem, beam_width)
    n_cands = sum(len(s.cands) for s in problem.slots)
    bound, status, rounds = trivial_lower_bound(problem), None, 0
    narrowed = f"(narrowed to width {width} to bound the work)" if width < beam_width else ""
    say(SearchProgress("beam", detail=narrowed, candidates=n_cands, bound_s=bound))
    choice = beam_search(problem, width=width, allowed=rule)
    sched = simulate(problem, choice) if choice is not None else None
    if rule is None and not problem.symmetric and symmetric_cluster(problem, aligned=True):
        # A space with runs of consecutive nodes holds the aligned one, whose mirror symmetry a
        # beam can use: the better of the two beams is where CP-SAT starts (never worse than it).
        aligned = beam_search(problem, width=width, allowed=aligned_only)
        if aligned is not None:
            trial = simulate(problem, aligned)
            if sched is None or (trial.mem_ok and trial.makespan_s < sched.makespan_s):
                choice, sched = aligned, trial
    if time_limit_s > 0 and not use_cpsat:
        status = f"NOT_RUN: {tables:,} pairwise costs exceed the {CPSAT_TABLE_LIMIT:,} it builds"
        say(SearchProgress("cpsat", detail=f"not run: {tables:,} pairwise costs exceed {CPSAT_TABLE_LIMIT:,}"))
    elif use_cpsat and sched is not None and sched.iteration_s <= bound:
        # The beam's plan meets a proven bound (one call at its fastest, as in pre-training): no
        # plan is faster, and CP-SAT would only prove it again (20 s for SFT 405B on 1,024 GPUs
        # with node ranges, whose model holds every position of 27,915 candidates).
        use_cpsat = False
        status = BOUND_MET
        say(SearchProgress("cpsat", detail="not run: the beam's plan meets the lower bound"))
    if use_cpsat:
        choice, sched, bound, status, rounds = _cpsat_rounds(problem, choice, sched, bound, rule=rule,
                                                             time_limit_s=time_limit_s, deadline=deadline,
                                                             workers=workers, say=say)
    if choice is None or sched is None:
        return None
    if rounds and time.perf_counter() < deadline and sched.iteration_s > bound * (1 + POLISH_GAP):
        say(SearchProgress("polish", candidates=n_cands, best_s=sched.iteration_s,
                           bound_s=min(bound, sched.iteration_s)))
        choice, sched = polish(problem, choice, sched, rule=rule, deadline=deadline)
    return choice, sched, min(bound, sched.iteration_s), status, rounds > 0


def _cpsat_rounds(problem: Problem, choice: list[int] | None, sched: Schedule | None, bound: float, *,
                  rule: Restriction | None, time_limit_s: float, deadline: float, workers: int, say: Progress,
                  ) -> tuple[list[int] | None, Schedule | None, float, str | None, int]:
    """CP-SAT from the incumbent, solved again (at most `MAX_CPSAT_ROUNDS` times) while its answer
    leans on reallocations it knew only as lower bounds: (assignment, its exact schedule, the bound
    proven on `problem`, the last status, rounds run)."""
    n_cands = sum(len(s.cands) for s in problem.slots)
    status, rounds = None, 0
    while rounds < MAX_CPSAT_ROUNDS:
        left = deadline - time.perf_counter()
        rounds += 1
        heard = _cpsat_listener(say, detail=f"round {rounds}", candidates=n_cands,
                                best_s=sched.iteration_s if sched else None, bound_s=bound)
        budget = CPSAT_WORK_SHARE[rounds - 1] * time_limit_s
        result = solve_cpsat(problem, hint=choice, time_limit_s=max(left, 0.5), work_budget=budget, workers=workers,
                             allowed=rule, on_progress=heard, known_bound_s=bound)
        status = result.status
        bound = max(bound, result.lower_bound_s)
        if result.choice is None:
            break
        # Reallocations CP-SAT only knew a lower bound for are costed exactly by this simulation;
        # if any was on its chosen path, solve again with the exact figures.
        assumed_exact = all(problem.is_exact(i, result.choice[s.home], result.choice[i])
                            for i, s in enumerate(problem.slots) if s.home is not None)
        cp_sched = simulate(problem, result.choice, result.order)
        if cp_sched.mem_ok and (sched is None or cp_sched.makespan_s < sched.makespan_s):
            choice, sched = result.choice, cp_sched
        if assumed_exact:
            break
    return choice, sched, bound, status, rounds


def _search_decomposed(problem: Problem, *, time_limit_s: float, deadline: float, beam_width: int, workers: int,
                       say: Progress) -> tuple[list[int], Schedule, float, str | None, bool] | None:
    """`search` where meshes sit on runs of consecutive nodes and the placed CP-SAT model would be
    too large to prove anything in time (`DECOMPOSE_TABLE_SIZE`): sizes first, positions second.

    1. A beam over the aligned blocks alone gives an incumbent.
    2. The position-free model (`planner.relax`) proves a bound on every plan of the whole space
       and answers with a mesh size and layout per call, placed.
    3. The placed CP-SAT model, built for those classes (and the incumbent's) at every position,
       finds where they go with exact reallocation costs; a local search polishes that.
    The bound reported is the position-free model's (or the trivial one): it holds for the whole space."""
    n_cands = sum(len(s.cands) for s in problem.slots)
    bound = trivial_lower_bound(problem)
    say(SearchProgress("beam", detail="(aligned blocks)", candidates=n_cands, bound_s=bound))
    aligned = [[k for k, c in enumerate(s.cands) if is_aligned(c.mesh)] for s in problem.slots]
    choice: list[int] | None = None
    sched: Schedule | None = None
    if all(aligned):
        blocks = problem.subset(aligned)
        found = beam_search(blocks, width=beam_width_for(blocks, beam_width))
        problem.realloc_work = blocks.realloc_work
        if found is not None:
            choice = [aligned[i][k] for i, k in enumerate(found)]
    if choice is None:  # nothing fits on the aligned blocks alone: a beam over the whole space
        choice = beam_search(problem, width=beam_width_for(problem, beam_width))
    if choice is not None:
        sched = simulate(problem, choice)
        if sched.iteration_s <= bound:  # no plan is faster (see `search`)
            return choice, sched, sched.iteration_s, BOUND_MET, False
    say(SearchProgress("relaxed", detail="mesh sizes, positions left out", candidates=n_cands,
                       best_s=sched.iteration_s if sched else None, bound_s=bound))
    relaxed = relaxed_bound(problem, incumbent_s=sched.iteration_s if sched is not None else None,
                            work_budget=RELAXED_WORK_SHARE * time_limit_s,
                            time_limit_s=max(deadline - time.perf_counter(), 0.5), known_bound_s=bound,
                            hint=choice, hint_starts=sched.start if sched is not None else None)
    status = f"relaxed {relaxed.status}"
    if relaxed.status == "INFEASIBLE":
        # Nothing shorter than the incumbent (which the model holds, so no plan at all without one).
        if sched is None:
            return None
        bound = sched.iteration_s
    else:
        bound = max(bound, relaxed.lower_bound_s)
    if relaxed.choice is not None:
        trial = simulate(problem, relaxed.choice, relaxed.order)
        if trial.mem_ok and (sched is None or trial.makespan_s < sched.makespan_s):
            choice, sched = relaxed.choice, trial
    if choice is None or sched is None:
        return None
    bound, status = _sane_bound(problem, bound, sched, status)
    if sched.iteration_s > bound * (1 + POLISH_GAP):
        # Where the chosen classes go, with exact reallocation costs: every position of them.
        answers = [choice] + ([relaxed.choice] if relaxed.choice is not None else [])
        wanted = [{classes(problem, i).of[a[i]] for a in answers} for i in range(len(problem.slots))]
        keep = [[k for k, q in enumerate(classes(problem, i).of) if q in wanted[i]] for i in range(len(problem.slots))]
        placed = problem.subset(keep)
        local = [keep[i].index(k) for i, k in enumerate(choice)]
        whole = bound  # the bound on the whole space; CP-SAT's here holds only for these classes

        def placing(pr: SearchProgress) -> None:
            say(dataclasses.replace(pr, detail=f"{pr.detail} (positions)", bound_s=whole))

        got, got_sched, _, cp_status, _ = _cpsat_rounds(placed, local, simulate(placed, local), bound, rule=None,
                                                        time_limit_s=time_limit_s, deadline=deadline, workers=workers,
                                                        say=placing)
        assert got is not None and got_sched is not None  # it starts from a plan
        if time.perf_counter() < deadline and got_sched.iteration_s > bound * (1 + POLISH_GAP):
            say(SearchProgress("polish", candidates=sum(map(len, keep)), best_s=got_sched.iteration_s, bound_s=bound))
            got, got_sched = polish(placed, got, got_sched, rule=None, deadline=deadline)
        problem.realloc_work = placed.realloc_work
        mapped = [keep[i][k] for i, k in enumerate(got)]
        exact = simulate(problem, mapped, sorted(got_sched.start, key=lambda op: (got_sched.start[op], op)))
        if exact.mem_ok and exact.makespan_s < sched.makespan_s:
            choice, sched = mapped, exact
        status = f"{status}, placed {cp_status}"
    bound, status = _sane_bound(problem, bound, sched, status)
    return choice, sched, min(bound, sched.iteration_s), status, True


def _sane_bound(problem: Problem, bound: float, sched: Schedule, status: str) -> tuple[float, str]:
    """The bound and status, unless the bound is above a plan in hand (a solver fault): then the
    trivial bound, and a status that says so."""
    if bound > sched.iteration_s * (1 + 1e-9):
        return trivial_lower_bound(problem), f"{status} (its bound, above a plan found, discarded)"
    return bound, status


def _cpsat_listener(say: Progress, *, detail: str, candidates: int, best_s: float | None,
                    bound_s: float) -> Callable[[float | None, float], None]:
    """Turn CP-SAT's incumbents and bounds into `SearchProgress` reports (display only)."""
    live: dict[str, float | None] = {"bound": bound_s, "solver": None}

    def heard(incumbent_s: float | None, bound_now_s: float) -> None:
        live["bound"] = max(live["bound"] or 0.0, bound_now_s)
        if incumbent_s is not None:
            live["solver"] = incumbent_s
        say(SearchProgress("cpsat", detail=detail, candidates=candidates, best_s=best_s, bound_s=live["bound"],
                           solver_s=live["solver"]))

    heard(None, bound_s)
    return heard


def polish(problem: Problem, choice: list[int], sched: Schedule, *, rule: Restriction | None, deadline: float,
           max_evals: int = 4_000) -> tuple[list[int], Schedule]:
    """Local search on the exact simulator: changes of one call's candidate, then of two calls'
    at once, kept while they shorten the schedule; then the best list-scheduling order of the
    final assignment. CP-SAT works on rounded integer times (and may have seen some
    reallocations only as lower bounds), so its answer can be a hair off the exact optimum.

    Where every pair of changes is too many to try, the pairs tried are those of the
    `PROMISING_SINGLES` single changes that lengthen the schedule least: two calls that only
    gain together (moving both a model's generation and its inference onto the GPUs that hold
    its weights saves two reallocations, where moving one alone saves none) is the local
    optimum that single changes cannot leave. Last, every call sharing a mesh moves to another
    mesh together (`_group_moves`)."""
    evals = 0

    def order_of(s: Schedule) -> list:
        return sorted(s.start, key=lambda op: (s.start[op], op))

    def evaluate(trial: list[int]) -> Schedule | None:
        """The shorter schedule of `trial` under the current order and the default one, if it
        fits and the rule allows it."""
        nonlocal evals
        if rule is not None and not all(rule(problem, j, trial[j], trial) for j in range(len(trial))):
            return None
        best = None
        for ord_ in (order_of(sched), None):
            evals += 1
            cand = simulate(problem, trial, ord_)
            if cand.mem_ok and (best is None or cand.makespan_s < best.makespan_s):
                best = cand
        return best

    def shorter(cand: Schedule | None) -> bool:
        return cand is not None and cand.makespan_s < sched.makespan_s * (1 - 1e-12)

    def out_of_budget() -> bool:
        return evals >= max_evals or time.perf_counter() > deadline

    n = len(problem.slots)
    singles = [(i, k) for i in range(n) for k in range(len(problem.slots[i].cands))]
    sizes = [len(s.cands) for s in problem.slots]
    n_pairs = sum(a * b for i, a in enumerate(sizes) for b in sizes[i + 1:])  # counted: they may be millions
    exhaustive = n_pairs <= max_evals // 4  # every pair where they can all be tried
    improved = True
    while improved and not out_of_budget():
        improved = False
        tried: list[tuple[float, int, int]] = []  # (makespan, slot, candidate) of each single change
        for i, k in singles:
            if k == choice[i] or out_of_budget():
                continue
            trial = choice.copy()
            trial[i] = k
            found = evaluate(trial)
            if shorter(found):
                assert found is not None
                choice, sched, improved = trial, found, True
                break
            if found is not None:
                tried.append((found.makespan_s, i, k))
        if improved:
            continue
        # Every other candidate of each call where the pairs can all be tried, else the most promising.
        pool = [(i, k) for i, k in singles if k != choice[i]] if exhaustive else \
            [(i, k) for _, i, k in sorted(tried)[:PROMISING_SINGLES]]
        moves = [(a, b) for x, a in enumerate(pool) for b in pool[x + 1:] if a[0] != b[0]]
        for (i, k), (j, m) in moves:
            if out_of_budget():
                break
            trial = choice.copy()
            trial[i], trial[j] = k, m
            found = evaluate(trial)
            if shorter(found):
                assert found is not None
                choice, sched, improved = trial, found, True
                break
        if improved:
            continue
        for trial in _group_moves(problem, choice):
            if out_of_budget():
                break
            found = evaluate(trial)
            if shorter(found):
                assert found is not None
                choice, sched, improved = trial, found, True
                break
    for n, ord_ in enumerate(topological_orders(problem)):
        if n >= MAX_ORDERS_TRIED or time.perf_counter() > deadline:
            break
        cand = simulate(problem, choice, ord_)
        if cand.makespan_s < sched.makespan_s * (1 - 1e-12):
            sched = cand
    return choice, sched


def _group_moves(problem: Problem, choice: list[int]) -> list[list[int]]:
    """Assignments that move every call sharing a mesh to another mesh together, each at its
    fastest candidate there: calls colocated to share weights (a generation and the inference
    after it) only gain from moving together, which no change of one or two of them finds."""
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(choice):
        groups.setdefault(problem.slots[i].cands[k].mesh.short(), []).append(i)
    meshes = sorted({c.mesh.short(): c.mesh for s in problem.slots for c in s.cands}.items())
    out = []
    for here, members in sorted(groups.items()):
        if len(members) < 3:  # one or two calls: the single and pair changes try them
            continue
        for there, _ in meshes:
            if there == here:
                continue
            trial = choice.copy()
            for i in members:
                ks = [k for k, c in enumerate(problem.slots[i].cands) if c.mesh.short() == there]
                if not ks:
                    break
                trial[i] = min(ks, key=lambda k: (problem.fastest_s(i, k), k))  # noqa: B023
            else:
                out.append(trial)
    return out


def build_plan(problem: Problem, choice: list[int], sched: Schedule, search: SearchInfo) -> Plan:
    """Turn an assignment and its simulated schedule into a `Plan` (iteration 0's times)."""
    graph, cluster = problem.graph, problem.cluster
    order = sorted(range(len(problem.slots)), key=lambda i: (sched.start[(0, i)], i))
    resident, _ = problem.memory(choice)
    calls, reallocs = [], []
    flops = 0.0
    for i in order:
        s = problem.slots[i]
        cand = s.cands[choice[i]]
        flops += cand.cost.model_flops
        calls.append(PlanCall(**s.call.model_dump(), mesh=cand.mesh, layout=cand.layout,
                              decode_layout=cand.decode_layout, est_start_s=sched.run_start[(0, i)],
                              est_time_s=sched.run_s[(0, i)],
                              est_peak_mem_bytes=problem.call_peak_bytes(resident, i, choice)))
        if problem.ops[i][choice[i]].copies(problem.home_choice(i, choice)):
            assert s.home is not None  # only a call with a home elsewhere copies
            nbytes, t = sched.realloc[i]
            reallocs.append(Reallocation(model=s.call.model, from_call=problem.slots[s.home].call.name,
                                         to_call=s.call.name, bytes=nbytes, est_start_s=sched.start[(0, i)],
                                         est_time_s=t))
    transfers = []
    carried: dict[tuple[str, str], str] = {}  # (producer, consumer) -> the first handle between them
    for src, dst, h in graph.edges():
        carried.setdefault((src, dst), h)
    for e, (i, j, nbytes) in enumerate(problem.edges):
        mi, mj = problem.slots[i].cands[choice[i]].mesh, problem.slots[j].cands[choice[j]].mesh
        if mi != mj:
            handle = carried[problem.slots[i].call.name, problem.slots[j].call.name]
            transfers.append(DataTransfer(handle=handle, from_call=problem.slots[i].call.name,
                                          to_call=problem.slots[j].call.name, bytes=nbytes,
                                          est_time_s=problem.transfer(e, choice[i], choice[j])))
    it = sched.iteration_s
    tokens = max(c.tokens for c in graph.calls)
    peak_flops = cluster.sheet.peak_tflops * 1e12 * cluster.world_size
    estimate = Estimate(iteration_s=it, tokens_per_s=tokens / it if it > 0 else 0.0,
                        mfu=flops / (it * peak_flops) if it > 0 else 0.0, peak_mem_bytes=max(sched.peak_bytes),
                        costed_for=problem.cm.costed_for(),
                        framework=None if problem.cm.framework.name == "torch" else problem.cm.framework.name)
    return Plan(version=PLAN_VERSION, name=graph.name, cluster=cluster, models=graph.models, inputs=graph.inputs,
                algorithm=graph.algorithm, calls=calls, reallocations=reallocs, transfers=transfers,
                estimate=estimate, search=search, host_steps=graph.host_steps)
