"""The position-free bound (`planner.relax`) and the search that decomposes on it.

Its optimum must bound every plan of the space: below the brute-force optimum on small instances,
below the placed search's plan where both run, and its reallocation times below the placed
model's wherever the two meshes sit.
"""

from __future__ import annotations

import itertools
import random

import pytest

import planner.compile as compile_mod
from cost_models import CostModel
from planner.candidates import Candidate, SearchSpace, mesh_positions, mesh_sizes
from planner.compile import compile_graph, search, trivial_lower_bound
from planner.exhaustive import exhaustive
from planner.problem import build_problem
from planner.relax import class_bounds_s, classes, relaxed_bound
from planner.render import estimate_lines
from planner.simulate import simulate
from plans.cluster import parse_cluster
from plans.graph import ModelDecl
from plans.layout import Layout, Mesh
from plans.model import PRESETS
from plans.sharding import slicing
from tests.test_search import random_problem, without_presolve


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_is_below_the_brute_force_optimum(seed):
    p = random_problem(random.Random(seed))
    truth = exhaustive(p)
    got = relaxed_bound(p, incumbent_s=None, work_budget=5, time_limit_s=60, known_bound_s=trivial_lower_bound(p))
    if truth is None:
        assert got.status == "INFEASIBLE" or got.choice is None or not p.fits(got.choice)
        return
    assert got.lower_bound_s <= truth[0] * (1 + 1e-9), (got, truth)
    assert got.choice is not None
    # With the optimum as the incumbent, no class it uses is cut, and the bound still holds.
    cut = relaxed_bound(p, incumbent_s=truth[0], work_budget=5, time_limit_s=60, hint=list(truth[1]))
    assert cut.lower_bound_s <= truth[0] * (1 + 1e-9)


def test_class_bounds_bound_every_plan_using_the_class():
    p = random_problem(random.Random(3))
    truth = exhaustive(p)
    assert truth is not None
    bounds = class_bounds_s(p)
    for i, k in enumerate(truth[1]):
        assert bounds[i][classes(p, i).of[k]] <= truth[0] * (1 + 1e-9)


def test_the_reallocation_floor_anywhere_is_below_the_floor_at_every_placement():
    cl = parse_cluster("a100-80gb:4x8")
    cm = CostModel(cl)
    decl = ModelDecl(spec=PRESETS["llama-2-7b"], trainable=True)
    space = SearchSpace(node_ranges=True)
    layouts = {4: [Layout(tp=4), Layout(dp=4, zero=3)], 8: [Layout(tp=8), Layout(dp=2, tp=4), Layout(tp=4, pp=2)],
               16: [Layout(dp=2, tp=8), Layout(tp=8, pp=2)], 24: [Layout(dp=3, tp=8), Layout(tp=8, pp=3)],
               32: [Layout(dp=4, tp=8)]}
    assert set(layouts) <= set(mesh_sizes(cl, space))
    checked = 0
    for (ss, sl), (ds, dl) in itertools.product(layouts.items(), repeat=2):
        for a, b in itertools.product(sl, dl):
            anywhere = cm.realloc_floor_anywhere_s(decl, (ss, a), (ds, b))
            if ss == ds and slicing(a) == slicing(b):
                assert anywhere == 0.0
            for sm, dm in itertools.product(mesh_positions(cl, ss, space), mesh_positions(cl, ds, space)):
                if (sm, slicing(a)) == (dm, slicing(b)):
                    continue
                assert anywhere <= cm.realloc_floor_s(decl, (sm, a), (dm, b)) * (1 + 1e-12), (sm, a, dm, b)
                checked += 1
    assert checked > 500


def test_the_decomposed_search_agrees_with_the_placed_one(monkeypatch):
    """Forced on a small node-range instance: its bound holds below the placed search's plan, its
    plan above the placed search's bound (the two models bound each other's answers)."""
    from planner.algorithms import ppo

    graph = ppo("tiny-llama", batch=16, prompt_len=16, gen_len=16)
    cl = parse_cluster("a100-80gb:4x2")
    space = SearchSpace(node_ranges=True, offload=False)
    placed = compile_graph(graph, cl, time_limit_s=2, space=space)
    monkeypatch.setattr(compile_mod, "DECOMPOSE_TABLE_SIZE", 0)
    split = compile_graph(graph, cl, time_limit_s=2, space=space)
    assert split.search.status.startswith("relaxed")
    assert split.search.lower_bound_s <= placed.estimate.iteration_s * (1 + 1e-9)
    assert split.estimate.iteration_s >= placed.search.lower_bound_s * (1 - 1e-9)
    assert split.search.lower_bound_s <= split.estimate.iteration_s
    assert any("mesh sizes first" in line for line in estimate_lines(split))


@pytest.mark.solver
def test_the_bound_does_not_depend_on_cp_sat_presolve():
    """CP-SAT 9.15's presolve once proved a wrong optimum on this model (PPO 13B + 7B on six nodes:
    above a schedule the model holds); `planner.relax` turns the faulty reduction off. The optimum
    must equal the one found without any presolve."""
    from planner.algorithms import ppo

    graph = ppo("llama-2-13b", critic="llama-2-7b", reward="llama-2-7b", batch=512, prompt_len=1024, gen_len=1024,
                ppo_minibatches=4)
    p = build_problem(graph, CostModel(parse_cluster("a100-80gb:6x8")), SearchSpace(node_ranges=True))
    with_presolve = relaxed_bound(p, incumbent_s=60.0, work_budget=20, time_limit_s=120)
    with without_presolve():
        without = relaxed_bound(p, incumbent_s=60.0, work_budget=20, time_limit_s=120)
    assert with_presolve.status == without.status == "OPTIMAL"
    assert with_presolve.lower_bound_s == pytest.approx(without.lower_bound_s, rel=1e-6)


@pytest.mark.parametrize("seed", range(8))
def test_the_decomposed_search_bounds_the_brute_force_optimum(seed, monkeypatch):
    """Forced on small instances (some with runs of three GPUs, no aligned block among them, so
    the beam over the whole space gives the incumbent): its bound is below the optimum, its plan
    fits and is no better than the optimum."""
    rng = random.Random(seed)
    p = random_problem(rng)
    if seed % 2:  # runs of three of the four GPUs, at either end
        for s in p.slots:
            s.cands = [Candidate(Mesh.block(rng.choice([0, 1]), 3), c.layout, c.cost) for c in s.cands]
    truth = exhaustive(p)
    monkeypatch.setattr(compile_mod, "DECOMPOSE_TABLE_SIZE", -1)
    found = search(p, time_limit_s=2)
    if truth is None:
        assert found is None
        return
    assert found is not None
    choice, sched, bound, status, _ = found
    assert status is not None and status.startswith("relaxed")
    assert bound <= truth[0] * (1 + 1e-9) <= sched.iteration_s * (1 + 2e-9)
    assert simulate(p, choice).mem_ok


@pytest.mark.parametrize("seed", range(8))
def test_the_hint_is_first_scheduled_with_the_models_own_durations(seed, monkeypatch):
    """`relaxed_bound` first schedules the hint's classes alone in the position-free model, so the
    hint CP-SAT starts from has the model's durations: that schedule is no longer than the
    incumbent's (the model's reallocations are floors of the exact ones), the full model starts
    from it, and the bound is the one found without a hint."""
    import planner.relax as relax

    p = random_problem(random.Random(seed))
    truth = exhaustive(p)
    if truth is None:
        return
    incumbent = simulate(p, list(truth[1]))
    solves: list[tuple[int, float | None]] = []
    real = relax._Compact.solve

    def spy(self, **kw):  # noqa: ANN001, ANN003, ANN202
        got = real(self, **kw)
        solves.append((sum(map(len, self.keep)), got.makespan_s))
        return got

    monkeypatch.setattr(relax._Compact, "solve", spy)
    hinted = relaxed_bound(p, incumbent_s=incumbent.iteration_s, work_budget=5, time_limit_s=60, hint=list(truth[1]),
                           hint_starts=incumbent.start)
    assert len(solves) == 2 and solves[0][0] == len(p.slots)  # one class per slot, then the whole model
    assert solves[0][1] is not None and solves[0][1] <= incumbent.makespan_s * 1.01  # ticks round durations up
    plain = relaxed_bound(p, incumbent_s=incumbent.iteration_s, work_budget=5, time_limit_s=60)
    assert hinted.lower_bound_s == pytest.approx(plain.lower_bound_s, rel=1e-9)
