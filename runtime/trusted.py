"""The code a run executes besides the runtime itself: only what the person launching it names.

A plan is data: it may come from anywhere (a colleague, a shared drive, a cache file). It may
*name* code (``algorithm.reward_fn = 'module:function'``), but naming is not enough to run it.
The function runs only when the launch names the same code too: ``--reward-fn module:function``
on the runtime's command line, or the same ``reward_fn`` in a ``@planner.auto`` decorator (the
user's own program). The built-in rewards of `plans.graph.BUILTIN_REWARDS` are part of the
runtime and are looked up, never imported by name.

The import does not search the current directory implicitly (``python -m`` puts it first on
``sys.path``, so a plan naming ``rewards:score`` would otherwise run a stray ``rewards.py``
wherever the run starts). To import from a directory, say so: ``PYTHONPATH=DIR``, or install
the package. `planner validate` and `planner show` list every piece of code a plan names.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from plans.errors import PlannerError
from plans.graph import BUILTIN_REWARDS
from runtime.algorithms import RewardFn
from runtime.tasks import pattern_reward

_BUILTIN: dict[str, RewardFn] = {"runtime.tasks:pattern_reward": pattern_reward}
assert set(_BUILTIN) == set(BUILTIN_REWARDS), "plans.graph.BUILTIN_REWARDS and runtime.trusted disagree"


def _explicit_dirs() -> set[str]:
    return {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}


@contextmanager
def _without_implicit_cwd() -> Iterator[None]:
    """`sys.path` without the entries that stand for the current directory ('' or its absolute
    path, e.g. the one ``python -m`` adds), unless PYTHONPATH names it; restored afterwards."""
    cwd, explicit = os.path.abspath(os.getcwd()), _explicit_dirs()
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if not ((p == "" or os.path.abspath(p) == cwd) and os.path.abspath(p or ".")
                                            not in explicit)]
    try:
        yield
    finally:
        sys.path[:] = saved


def import_function(name: str, *, what: str) -> Callable:
    """The function ``module:function`` names, imported without the implicit current directory."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise PlannerError(f"{what} {name!r} must be written 'package.module:function'")
    try:
        with _without_implicit_cwd():
            fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise PlannerError(f"cannot load {what} {name!r}: {e}",
                           hint="it must be importable on every rank from PYTHONPATH or an installed package; the "
                           "current directory is not searched unless PYTHONPATH names it (e.g. PYTHONPATH=.)") from None
    if not callable(fn):
        raise PlannerError(f"{what} {name!r} is a {type(fn).__name__}, not a function")
    return fn


def reward_function(named_by_plan: str | None, *, named_at_launch: str | None, flag: str = "--reward-fn"
                    ) -> RewardFn | None:
    """The reward function a run may call: None when the plan names none; a built-in one; or the
    function both the plan and the launch name (`flag` is how the launch names it, for messages).
    Anything else is a `PlannerError`, raised before any import."""
    if named_by_plan is None:
        if named_at_launch is not None:
            raise PlannerError(f"{flag} {named_at_launch} was given, but the plan names no reward function "
                               "(algorithm.reward_fn)", hint=f"drop {flag}: this plan scores with its reward model")
        return None
    if named_by_plan in _BUILTIN and named_at_launch in (None, named_by_plan):
        return _BUILTIN[named_by_plan]
    if named_at_launch is None:
        raise PlannerError(f"the plan names reward function {named_by_plan!r} (algorithm.reward_fn); a plan's code runs "
                           "only when the launch names it too",
                           hint=f"if you trust that code, add {flag} {named_by_plan} (`planner validate PLAN` lists the "
                           "code a plan names)")
    if named_at_launch != named_by_plan:
        raise PlannerError(f"{flag} {named_at_launch} does not match the plan's reward function {named_by_plan!r} "
                           "(algorithm.reward_fn)",
                           hint="give the plan's own function, or compile a plan that names yours")
    return import_function(named_by_plan, what="reward function")
