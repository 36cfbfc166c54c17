"""planner: compile LLM training and RLHF workloads into execution plans.

    from planner import Graph, compile_graph
    from planner.algorithms import ppo

or trace a training loop written as a function: ``@planner.auto(...)`` with ``@planner.host``
steps (`planner.auto`).

The names below are imported on first use, so `planner --help` and the commands that never
compile start without loading the search and the cost model.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from planner.auto import AutoFunction, auto, model
    from planner.compile import compile_graph
    from planner.graph import Data, Graph, ModelHandle
    from planner.tracing import host

_HOMES = {"AutoFunction": "planner.auto", "auto": "planner.auto", "model": "planner.auto",
          "compile_graph": "planner.compile", "Data": "planner.graph", "Graph": "planner.graph",
          "ModelHandle": "planner.graph", "host": "planner.tracing"}

__all__ = ["AutoFunction", "Data", "Graph", "ModelHandle", "auto", "compile_graph", "host", "model"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """`planner.auto` is the decorator, not the submodule of that name: importing the submodule
    sets the package's attribute to it, which would hide the decorator."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _HOMES.get(name) == value.__name__:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
