"""Beam search: a good assignment fast, scored by the simulator.

Slots are assigned home calls first (so each later choice sees the resident memory it must fit
beside), then the others in topological order. Each beam entry is extended with every allowed
candidate; partial assignments are simulated (unassigned calls left out) and the `width` shortest
makespans survive, ties broken by the candidate indices so results are deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from planner.problem import Problem
from planner.simulate import makespan_s, simulate
from plans.layout import Mesh

Allowed = Callable[[Problem, int, int, Sequence[int | None]], bool]


def assignment_order(problem: Problem) -> list[int]:
    homes = [s.index for s in problem.slots if s.home is None]
    homes.sort(key=lambda i: (-min((c.time_s for c in problem.slots[i].cands), default=0.0), i))
    return homes + [s.index for s in problem.slots if s.home is not None]


def symmetric_cluster(problem: Problem, *, aligned: bool = False) -> bool:
    """Aligned blocks form a binary tree (node size and node count powers of two), so any
    placement can be mirrored to put the first home call at rank 0 (with `aligned`, whether that
    holds of the problem's aligned candidates, even if it has others)."""
    cl = problem.cluster
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    return (problem.symmetric or aligned) and pow2(cl.gpus_per_node) and pow2(cl.nodes)


def is_aligned(mesh: Mesh) -> bool:
    """Whether `mesh` is a block of a power-of-two size at a multiple of its size."""
    return mesh.size & (mesh.size - 1) == 0 and mesh.first % mesh.size == 0


def aligned_only(problem: Problem, slot: int, k: int, choice: Sequence[int | None]) -> bool:
    """A beam restriction to aligned blocks, the first home call at rank 0 (`symmetric_cluster`)."""
    mesh = problem.slots[slot].cands[k].mesh
    first_home = all(c is None for c in choice)
    return is_aligned(mesh) and (not first_home or mesh.first == 0)


# Op placements simulated over a whole beam search (each candidate of each step simulates the
# unrolled ops); a couple of seconds on one core (10-15 us each). Wider beams than this allows are
# narrowed: the beam only seeds CP-SAT, which proves its own bound.
BEAM_WORK_LIMIT = 250_000


def beam_width_for(problem: Problem, width: int) -> int:
    """The widest beam, at most `width`, whose search stays within `BEAM_WORK_LIMIT` (a
    deterministic work bound: it depends on the problem's size only, never on the clock)."""
    ops = len(problem.slots) * problem.unroll
    cands = sum(len(s.cands) for s in problem.slots)
    while width > 1 and width * cands * ops > BEAM_WORK_LIMIT:
        width //= 2
    return width


def beam_search(problem: Problem, *, width: int = 16, allowed: Allowed | None = None, exact: bool = True
                ) -> list[int] | None:
    """The best complete assignment the beam finds, or None if nothing fits in memory.

    With ``exact=False`` partial plans are scored with reallocation lower bounds (cheap) and only
    the final survivors are simulated exactly."""
    order = assignment_order(problem)
    beam: list[list[int | None]] = [[None] * len(problem.slots)]
    for step, i in enumerate(order):
        scored: list[tuple[float, tuple, list[int | None]]] = []
        for choice in beam:
            for k, cand in enumerate(problem.slots[i].cands):
                if step == 0 and allowed is None and symmetric_cluster(problem) and cand.mesh.first != 0:
                    continue
                if allowed is not None and not allowed(problem, i, k, choice):
                    continue
                ext = list(choice)
                ext[i] = k
                if not problem.fits(ext):
                    continue
                scored.append((makespan_s(problem, ext, exact=exact), tuple(-1 if c is None else c for c in ext), ext))
        if not scored:
            return None
        scored.sort(key=lambda t: (t[0], t[1]))
        beam = [ext for _, _, ext in scored[:width]]
    if not exact:  # scored with reallocation lower bounds: pick the survivor that is best exactly
        beam.sort(key=lambda ext: (simulate(problem, ext).makespan_s, tuple(ext)))
    return [int(k) for k in beam[0]]  # type: ignore[arg-type]  # every slot is assigned by now
