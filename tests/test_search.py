"""The search on problems whose optimum is known: derived by hand, or by brute force.

The solver sees arrays (candidate times and memory, reallocation and transfer times), so these
tests build problems from hand-set costs with a small table-driven cost model.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from cost_models import CallCost, ReallocCost
from planner.beam import beam_search
from planner.candidates import Candidate
from planner.compile import compile_graph, search
from planner.exhaustive import exhaustive
from planner.problem import Problem, Slot
from planner.simulate import simulate
from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.graph import Call, Graph, ModelDecl
from plans.layout import Layout, Mesh
from plans.model import PRESETS
from plans.sharding import slicing

GIB = 1024**3


@dataclass
class TableCosts:
    """Reallocation and transfer times given by hand (seconds); what a CostModel provides."""

    cluster: object
    realloc_s: float = 1.0
    transfer_s: float = 0.0
    shares_cores: bool = False  # ranks with cores of their own: each call runs at its priced time
    drifts: bool = False

    def realloc_cost(self, decl, src, dst) -> ReallocCost:  # noqa: ANN001
        return ReallocCost(1000, self.realloc_s)

    def realloc_floor_s(self, decl, src, dst) -> float:  # noqa: ANN001 - the weakest lower bound, always valid
        return 0.0

    def realloc_floor_anywhere_s(self, decl, src, dst) -> float:  # noqa: ANN001
        """Every non-twin pair costs `realloc_s`; a twin needs the same mesh size and slices."""
        return 0.0 if src[0] == dst[0] and slicing(src[1]) == slicing(dst[1]) else self.realloc_s

    def data_transfer_s(self, nbytes, src, dst, *, after_s=0.0) -> float:  # noqa: ANN001
        return self.transfer_s


def cand(first: int, size: int, time_s: float, *, state_gib: float = 1, work_gib: float = 1, tp: int | None = None) -> Candidate:
    lay = Layout(dp=size // (tp or 1), tp=tp or 1)
    cost = CallCost(time_s, int(state_gib * GIB), int((state_gib + work_gib) * GIB), 1e12)
    return Candidate(Mesh.block(first, size), lay, cost)


def problem(calls: list[tuple[str, str, str, list[str]]], cands: dict[str, list[Candidate]], *, gpus: int = 2,
            realloc_s: float = 1.0, transfer_s: float = 0.0, trainable=()) -> Problem:
    """calls: (name, model, kind, inputs); each call writes '<name>.out'."""
    models = {m: ModelDecl(spec=PRESETS["tiny-llama"], trainable=m in trainable) for _, m, _, _ in calls}
    spec_calls = []
    for name, model, kind, inputs in calls:
        extra = {"loss": "sft"} if kind == "train" else {"returns": "logprobs"}
        spec_calls.append(Call(name=name, model=model, kind=kind, inputs=inputs, outputs=[f"{name}.out"], seqs=4,
                               seq_len=8, **extra))
    graph = Graph(name="t", models=models, calls=spec_calls,
                  inputs=[{"name": "x", "seqs": 4, "seq_len": 8}])
    cluster = parse_cluster(f"cpu:1x{gpus},mem_headroom_gib=0")  # the sizes below are the whole GPU
    order = graph.topo_order()
    home: dict[str, str] = {}
    for n in order:
        c = graph.call(n)
        if c.kind == "train" or c.model not in home:
            home[c.model] = n
    index = {n: i for i, n in enumerate(order)}
    slots = [Slot(index[n], graph.call(n), cands[n], None if home[graph.call(n).model] == n else index[home[graph.call(n).model]])
             for n in order]
    edges = [(index[p], index[c], 100) for p, c, _ in graph.edges()]
    return Problem(graph, TableCosts(cluster, realloc_s, transfer_s), slots, edges, atom_size=1)  # type: ignore[arg-type]


def best_plan_s(p: Problem, *, time_limit_s: float = 5.0) -> tuple[float | None, float, float]:
    """(beam iteration or None, final iteration, lower bound), found as compile_graph finds them."""
    beam = beam_search(p, width=8)
    beam_s = simulate(p, beam).iteration_s if beam is not None else None
    found = search(p, time_limit_s=time_limit_s)
    assert found is not None
    choice, sched, bound, status, _ = found
    assert sched.iteration_s == pytest.approx(simulate(p, choice).iteration_s) or sched.iteration_s <= simulate(p, choice).iteration_s
    return beam_s, sched.iteration_s, bound


def test_independent_calls_run_side_by_side():
    # Two frozen models, one inference each: both on all GPUs take 10 s each, one GPU each 12 s.
    cands = {n: [cand(0, 2, 10.0), cand(0, 1, 12.0), cand(1, 1, 12.0)] for n in ("a", "b")}
    p = problem([("a", "m1", "inference", ["x"]), ("b", "m2", "inference", ["x"])], cands)
    beam_s, final, bound = best_plan_s(p)
    assert final == pytest.approx(12.0)  # side by side, not 20 s one after the other
    assert bound <= final + 1e-9 and (final - bound) / final < 0.01


def test_generate_then_train_shares_the_placement():
    # Actor generate -> train. Sharing the train placement costs no reallocation (twins).
    # The tp=2 generate layout is faster, but a reallocation of 2 s away from the train layout.
    cands = {"gen": [cand(0, 2, 4.0), cand(0, 2, 3.0, tp=2)], "train": [cand(0, 2, 10.0), cand(0, 1, 16.0)]}
    p = problem([("gen", "actor", "inference", ["x"]), ("train", "actor", "train", ["gen.out"])], cands,
                realloc_s=2.0, trainable=("actor",))
    _, final, _ = best_plan_s(p)
    # Options per iteration: twin generate 4 + train 10 = 14; tp=2 generate 3 + realloc 2 + 10 = 15.
    assert final == pytest.approx(14.0)


def test_memory_forces_the_slower_candidate():
    # The fast inference layout needs 3 GiB of work on GPU 0, where the trainable model's 2 GiB
    # stay resident: 5 GiB does not fit the 4 GiB of a cpu GPU, so the 1 GiB layout must be used.
    cands = {"inf": [cand(0, 2, 5.0, state_gib=0.5, work_gib=3), cand(0, 2, 7.0, state_gib=0.5, work_gib=1)],
             "train": [cand(0, 2, 10.0, state_gib=2, work_gib=0.5)]}
    p = problem([("inf", "ref", "inference", ["x"]), ("train", "actor", "train", ["inf.out"])], cands,
                trainable=("actor",))
    _, final, _ = best_plan_s(p)
    assert final == pytest.approx(17.0)


def random_problem(rng: random.Random) -> Problem:
    calls = [("g", "actor", "inference", ["x"]), ("r", "ref", "inference", ["g.out"]),
             ("c", "critic", "inference", ["g.out"]), ("t", "actor", "train", ["g.out", "r.out", "c.out"])]
    calls = calls[: rng.choice([3, 4])]
    if len(calls) == 3:
        calls[2] = ("t", "actor", "train", ["g.out", "r.out"])
    cands = {}
    for name, *_ in calls:
        opts = []
        for _ in range(rng.choice([2, 3])):
            size = rng.choice([1, 2, 4])
            first = rng.choice(range(0, 4, size))
            opts.append(cand(first, size, round(rng.uniform(1, 10) * (4 / size) ** 0.7, 3),
                             state_gib=rng.choice([0.5, 1.0]), work_gib=rng.choice([0.5, 1.0, 2.0])))
        cands[name] = opts
    return problem(calls, cands, gpus=4, realloc_s=round(rng.uniform(0, 2), 3),
                   transfer_s=round(rng.uniform(0, 0.5), 3), trainable=("actor",))


@pytest.mark.parametrize("seed", range(12))
def test_random_small_instances_match_brute_force(seed):
    p = random_problem(random.Random(seed))
    truth = exhaustive(p)
    if truth is None:
        assert search(p, time_limit_s=2) is None
        return
    beam_s, final, bound = best_plan_s(p)
    assert final == pytest.approx(truth[0], rel=1e-3)  # the search finds the optimum
    assert bound <= truth[0] * (1 + 1e-9)  # and its bound is a true lower bound
    assert beam_s is None or final <= beam_s + 1e-9  # never worse than the beam plan it was hinted with


def test_infeasible_memory_is_a_clear_error():
    from planner.algorithms import ppo

    graph = ppo("llama-2-70b", batch=64, prompt_len=512, gen_len=512)
    with pytest.raises(PlannerError, match="'actor_train' .* does not fit: its best layout on 8 GPUs needs .* GiB per "
                                           "GPU, and a a100-40gb has 38.0 GiB \\(40 GiB less a headroom of 2.0 GiB\\)"):
        compile_graph(graph, parse_cluster("a100-40gb:1x8"), time_limit_s=1)


def test_calls_that_fit_alone_but_not_together():
    from planner.algorithms import ppo

    graph = ppo("llama-2-13b", batch=64, prompt_len=512, gen_len=512)
    with pytest.raises(PlannerError, match="each call fits alone, but the models' resident states need at least"):
        compile_graph(graph, parse_cluster("a100-40gb:1x8"), time_limit_s=1)


def test_plan_is_never_slower_than_a_baseline():
    from planner.algorithms import ppo
    from planner.baselines import BASELINES

    graph = ppo("llama-2-7b", batch=128, prompt_len=512, gen_len=512)
    cluster = parse_cluster("a100-80gb:1x8")
    plan = compile_graph(graph, cluster, time_limit_s=2)
    for name in BASELINES:
        try:
            base = compile_graph(graph, cluster, time_limit_s=2, baseline=name)
        except PlannerError:
            continue  # the baseline's rule admits no plan that fits
        assert plan.estimate.iteration_s <= base.estimate.iteration_s * (1 + 1e-9), name


@pytest.mark.parametrize("seed", range(6))
def test_cpsat_and_simulator_agree_on_memory_through_the_table(seed):
    # Both read `Problem.ops`: for every assignment of a random instance, CP-SAT with the choice
    # fixed is feasible exactly when the simulator says it fits (a loose horizon, so only memory
    # can make it infeasible), and every plan peak is the table's resident plus need.
    from itertools import product

    from ortools.sat.python import cp_model

    from planner.cpsat import _Model

    p = random_problem(random.Random(100 + seed))
    cap = p.cluster.usable_mem_bytes
    horizon = 10 * sum(max(c.time_s for c in s.cands) + 5 for s in p.slots) * p.unroll
    fits_seen = set()
    for choice in product(*(range(len(s.cands)) for s in p.slots)):
        resident, peak = p.memory(choice)
        fits = max(peak) <= cap
        fits_seen.add(fits)
        for s in p.slots:
            assert p.call_peak_bytes(resident, s.index, choice) <= max(peak)
        model = _Model(p, horizon_s=horizon)
        for i, k in enumerate(choice):
            model.m.add(model.x[i][k] == 1)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = 20
        status = solver.solve(model.m)
        assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.INFEASIBLE)
        assert (status != cp_model.INFEASIBLE) == fits, (choice, peak, cap)
    assert fits_seen  # at least one assignment was checked


def test_node_ranges_add_runs_of_consecutive_nodes_and_half_nodes():
    from planner.candidates import SearchSpace, mesh_positions, mesh_sizes

    cl = parse_cluster("a100-80gb:4x8")
    assert mesh_sizes(cl, SearchSpace()) == [4, 8, 16, 32]
    wide = SearchSpace(node_ranges=True)
    assert mesh_sizes(cl, wide) == [4, 8, 16, 24, 32]
    assert [m.first for m in mesh_positions(cl, 24, wide)] == [0, 8]  # 3 of 4 nodes, from either end
    assert [m.first for m in mesh_positions(cl, 16, wide)] == [0, 8, 16]  # 2 nodes at any node
    assert [m.first for m in mesh_positions(cl, 16, SearchSpace())] == [0, 16]
    big = parse_cluster("a100-80gb:16x8")
    assert 4 not in mesh_sizes(big, SearchSpace()) and 4 in mesh_sizes(big, SearchSpace(node_ranges=True))


def test_node_ranges_are_on_by_default_where_the_blocks_have_holes(cli, tmp_path):  # noqa: ANN001
    """A node count that is no power of two, up to 12 nodes: the aligned blocks have holes (none
    between one node and all three), so the default space adds the runs; elsewhere the wider space
    is asked for (`--node-ranges`) or not."""
    from planner.candidates import AUTO_NODE_RANGES_MAX_NODES, SearchSpace, mesh_sizes, node_ranges_on

    on = [n for n in range(1, 33) if node_ranges_on(SearchSpace(), parse_cluster(f"a100-80gb:{n}x8"))]
    assert on == [3, 5, 6, 7, 9, 10, 11, 12] and AUTO_NODE_RANGES_MAX_NODES == 12
    three, four = parse_cluster("a100-80gb:3x8"), parse_cluster("a100-80gb:4x8")
    assert node_ranges_on(SearchSpace(), three) and 16 in mesh_sizes(three, SearchSpace())
    assert not node_ranges_on(SearchSpace(), four) and not node_ranges_on(SearchSpace(node_ranges=False), three)
    assert node_ranges_on(SearchSpace(node_ranges=True), four)
    assert 16 not in mesh_sizes(three, SearchSpace(node_ranges=False))
    graph = ["grpo", "--actor", "tiny-llama", "--batch", "8", "--prompt-len", "8", "--gen-len", "8",
             "--samples-per-prompt", "2", "--cluster", "cpu:4x1", "--time-limit", "1", "--json"]
    counts = {}
    for flag in ("--node-ranges", "--aligned-meshes"):
        out = cli("compile", *graph, flag)
        assert out.code == 0, out
        counts[flag] = json.loads(out.out)["search"]["candidates"]
    assert counts["--node-ranges"] > counts["--aligned-meshes"]


def test_node_ranges_search_starts_from_the_aligned_beam():
    # The wider space holds the aligned one, and its search starts from the better beam of both
    # (not a guarantee on the final plan: each search stops within its gap, so the wider space's
    # plan may be a hair slower, as `bench/search.py --node-ranges` shows for ppo-7b: 80.16 s
    # beside 80.12 s, both within 0.1% of their bounds).
    from planner.algorithms import ppo
    from planner.candidates import SearchSpace

    graph = ppo("tiny-llama", batch=16, prompt_len=16, gen_len=16)
    cl = parse_cluster("a100-80gb:4x2")
    # Offload off in both: the comparison is of the mesh spaces alone.
    aligned = compile_graph(graph, cl, time_limit_s=2, space=SearchSpace(offload=False))
    wide = compile_graph(graph, cl, time_limit_s=2, space=SearchSpace(node_ranges=True, offload=False))
    assert wide.estimate.iteration_s <= aligned.estimate.iteration_s * (1 + 1e-9)
    assert wide.search.candidates > aligned.search.candidates


@contextlib.contextmanager
def without_presolve() -> Iterator[None]:
    """Every CP-SAT solve inside runs without presolve (what the solver checks compare against)."""
    from ortools.sat.python import cp_model

    solve = cp_model.CpSolver.solve

    def bare(self, model, *args):  # noqa: ANN001, ANN202
        self.parameters.cp_model_presolve = False
        return solve(self, model, *args)

    cp_model.CpSolver.solve = bare  # type: ignore[method-assign]
    try:
        yield
    finally:
        cp_model.CpSolver.solve = solve  # type: ignore[method-assign]


@pytest.mark.solver
@pytest.mark.parametrize("cluster,node_ranges", [("a100-80gb:2x8", False), ("a100-80gb:4x8", False),
                                                  ("a100-80gb:3x8", True), ("a100-80gb:6x8", False)])
def test_the_placed_optimum_does_not_depend_on_cp_sat_presolve(cluster, node_ranges):
    """The placed model's per-atom memory rows hold candidate literals, the form whose presolve
    CP-SAT 9.15 got wrong in the position-free model (`tests/test_relax.py`): on full-size PPO
    instances its optimum must equal the one found without any presolve. On six nodes' aligned
    meshes CP-SAT 9.15's presolve declares the hinted model INFEASIBLE ("empty domain" in one
    call's exactly-one), so a hinted solve that ends INFEASIBLE is solved again without it."""
    from cost_models import CostModel
    from planner.algorithms import ppo
    from planner.beam import beam_width_for
    from planner.candidates import SearchSpace
    from planner.cpsat import solve_cpsat
    from planner.problem import build_problem

    graph = ppo("llama-2-13b", critic="llama-2-7b", reward="llama-2-7b", batch=512, prompt_len=1024, gen_len=1024,
                ppo_minibatches=4)
    p = build_problem(graph, CostModel(parse_cluster(cluster)), SearchSpace(node_ranges=node_ranges))
    hint = beam_search(p, width=beam_width_for(p, 16))
    with_presolve = solve_cpsat(p, hint=hint, time_limit_s=300, work_budget=60)
    with without_presolve():
        without = solve_cpsat(p, hint=hint, time_limit_s=300, work_budget=60)
    assert with_presolve.status == without.status == "OPTIMAL"
    assert with_presolve.lower_bound_s == pytest.approx(without.lower_bound_s, rel=1e-9)


@pytest.mark.solver
def test_a_hinted_solve_never_ends_infeasible():
    """The placed model holds its hint (the horizon is the hint's makespan), so INFEASIBLE is the
    solver's error: PPO 13B+7B on six nodes' aligned meshes, as `planner compile --aligned-meshes`
    searches it, had CP-SAT 9.15's presolve declare its model infeasible (an "empty domain" in one
    call's exactly-one) and the plan kept the beam's with a 22% gap. Solved again without presolve
    it is OPTIMAL within 0.1%."""
    from planner.algorithms import ppo
    from planner.candidates import SearchSpace

    graph = ppo("llama-2-13b", critic="llama-2-7b", reward="llama-2-7b", batch=512, prompt_len=1024, gen_len=1024,
                ppo_minibatches=4)
    plan = compile_graph(graph, parse_cluster("a100-80gb:6x8"), space=SearchSpace(node_ranges=False))
    assert plan.search.status == "OPTIMAL", plan.search
    assert plan.search.gap < 0.002


@pytest.mark.parametrize("seed", range(20))
def test_fits_is_the_per_atom_memory_rule(seed):
    """`Problem.fits` (a difference array, the beam's hot path) says exactly what `Problem.memory`'s
    per-atom peaks and the host rule say, on partial and complete assignments."""
    rng = random.Random(seed)
    p = random_problem(rng)
    cap = p.cluster.usable_mem_bytes
    for _ in range(30):
        choice = [rng.randrange(len(s.cands)) if rng.random() < 0.7 else None for s in p.slots]
        _, peak = p.memory(choice)
        assert p.fits(choice) == (max(peak) <= cap and p.host_fits(choice))


def test_an_aligned_search_merges_the_baselines_candidates_on_aligned_blocks_only(monkeypatch):
    """The search space holds every baseline's; on six nodes node ranges are on by default, so the
    baselines' candidates must take the searched space's setting, or an aligned search
    (`--aligned-meshes`) would place calls on runs of three nodes."""
    import planner.compile as compile_mod
    from planner.algorithms import ppo
    from planner.beam import is_aligned
    from planner.candidates import SearchSpace

    seen = []
    build = compile_mod.build_problem

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        problem = build(*args, **kwargs)
        seen.append({c.mesh for s in problem.slots for c in s.cands})
        return problem

    monkeypatch.setattr(compile_mod, "build_problem", spy)
    graph = ppo("tiny-llama", batch=64, prompt_len=64, gen_len=64)
    cluster = parse_cluster("a100-80gb:6x8")
    compile_graph(graph, cluster, time_limit_s=1, space=SearchSpace(node_ranges=False))
    assert seen and all(is_aligned(m) or m.size == cluster.world_size for m in seen[-1])
    compile_graph(graph, cluster, time_limit_s=1)  # the default on six nodes: runs of nodes too
    assert any(not is_aligned(m) and m.size < cluster.world_size for m in seen[-1])


def test_a_beam_plan_that_meets_the_bound_is_kept_without_cp_sat(monkeypatch):
    # One train call: its fastest candidate is the optimum and the lower bound at once. The search
    # says so (BOUND_MET) instead of building CP-SAT's model of every position (20 s for SFT 405B on
    # 1,024 GPUs with node ranges), and keeps the plan CP-SAT would have kept.
    import planner.compile
    from planner.algorithms import sft

    graph = sft("llama-2-7b", batch=64, seq_len=2048)
    cluster = parse_cluster("a100-80gb:2x8")
    solved: list[int] = []
    real = planner.compile.solve_cpsat
    monkeypatch.setattr(planner.compile, "solve_cpsat", lambda *a, **k: solved.append(1) or real(*a, **k))
    plan = compile_graph(graph, cluster, time_limit_s=2)
    assert not solved
    assert plan.search.status == "BOUND_MET" and plan.search.method == "beam" and plan.search.gap == 0.0
    # Told the bound is lower, the search runs CP-SAT, and it finds nothing faster.
    monkeypatch.setattr(planner.compile, "trivial_lower_bound", lambda p: 0.0)
    proven = compile_graph(graph, cluster, time_limit_s=2)
    assert solved and proven.search.method == "beam+cpsat"
    assert proven.estimate.iteration_s == plan.estimate.iteration_s
    assert [c.layout for c in proven.calls] == [c.layout for c in plan.calls]
    # Where calls overlap and share GPUs the bound is not met and CP-SAT runs as before.
    solved.clear()
    monkeypatch.undo()
    monkeypatch.setattr(planner.compile, "solve_cpsat", lambda *a, **k: solved.append(1) or real(*a, **k))
    from planner.algorithms import ppo
    ppo_plan = compile_graph(ppo("llama-2-7b", batch=64, prompt_len=256, gen_len=256), cluster, time_limit_s=2)
    assert solved and ppo_plan.search.status != "BOUND_MET"


def test_polish_moves_the_calls_sharing_a_mesh_together():
    """The tiny PPO on 4 CPU ranks time-sharing 2 cores: with generation, the reference's and the
    critic's inference on ranks 2-3 and the two trains on ranks 2 and 3 (where an earlier profile
    left the search), no change of one or two calls helps, but moving the three colocated calls
    onto one rank together removes their weights' trips (`planner.compile._group_moves`). Polish
    from there reaches the plan the whole search finds."""
    import time

    from cost_models import CostModel
    from planner.candidates import SearchSpace, graph_candidates
    from planner.compile import _group_moves, polish
    from planner.loader import load_graph_file
    from planner.problem import build_problem

    graph, _ = load_graph_file("examples/tiny_ppo.py")
    cl = parse_cluster("cpu:1x4")
    cm = CostModel(cl)
    space = SearchSpace()
    p = build_problem(graph, cm, space, candidates=graph_candidates(graph, cm, space))

    def on(name: str, ranks: list[int], dp: int) -> int:
        i = next(s.index for s in p.slots if s.call.name == name)
        return next(k for k, c in enumerate(p.slots[i].cands)
                    if list(c.mesh.ranks) == ranks and c.layout.dp == dp and c.layout.micro_batches == 1
                    and c.decode_layout is None and c.layout.offload == "none")

    where = {"actor_generate": ([2, 3], 2), "ref_inference": ([2, 3], 2), "critic_inference": ([2, 3], 2),
             "actor_train": ([2], 1), "critic_train": ([3], 1)}
    start = [on(s.call.name, *where[s.call.name]) for s in p.slots]
    sched = simulate(p, start)
    moves = _group_moves(p, start)
    assert moves and all(sum(a != b for a, b in zip(m, start)) == 3 for m in moves)
    best_move = min(simulate(p, m).makespan_s for m in moves)
    assert best_move < sched.makespan_s  # the group move alone gains
    choice, polished = polish(p, start, sched, rule=None, deadline=time.perf_counter() + 60)
    whole = compile_graph(graph, cl)
    assert polished.iteration_s == pytest.approx(whole.estimate.iteration_s, rel=1e-9)
    assert polished.makespan_s <= best_move
