"""Brute force over a (small) problem: every assignment, every list-scheduling order.

Any schedule can be turned into a list schedule no longer than it (schedule the ops in its start
order, each as early as possible), so the minimum over all assignments and all topological
orders of the unrolled ops is the true optimum of the candidate space. Used by tests and by
`bench/search.py --exhaustive` to check beam search and CP-SAT.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product

from planner.problem import Problem
from planner.simulate import Op, default_order, precedences, simulate


def topological_orders(problem: Problem) -> Iterator[list[Op]]:
    """Every order of the unrolled ops that respects their precedences."""
    ops = default_order(problem)
    preds: dict[Op, set[Op]] = {op: set() for op in ops}
    for a, b, _ in precedences(problem):
        preds[b].add(a)

    def extend(done: list[Op], left: list[Op]) -> Iterator[list[Op]]:
        if not left:
            yield list(done)
            return
        placed = set(done)
        for n, op in enumerate(left):
            if preds[op] <= placed:
                done.append(op)
                yield from extend(done, left[:n] + left[n + 1:])
                done.pop()

    yield from extend([], ops)


def exhaustive(problem: Problem, *, allowed=None, max_assignments: int = 100_000  # noqa: ANN001
               ) -> tuple[float, list[int], list[Op]] | None:
    """(best iteration_s, assignment, order) over the whole candidate space, or None if nothing
    fits in memory. Raises ValueError when the space is larger than `max_assignments`."""
    sizes = [len(s.cands) for s in problem.slots]
    total = 1
    for n in sizes:
        total *= n
    if total > max_assignments:
        raise ValueError(f"{total} assignments exceed the limit of {max_assignments}")
    orders = list(topological_orders(problem))
    best: tuple[float, list[int], list[Op]] | None = None
    for choice in product(*(range(n) for n in sizes)):
        ch = list(choice)
        if allowed is not None and not all(allowed(problem, i, k, ch) for i, k in enumerate(ch)):
            continue
        if not problem.fits(ch):
            continue
        for order in orders:
            t = simulate(problem, ch, order).iteration_s
            if best is None or t < best[0] - 1e-12:
                best = (t, ch, order)
    return best
