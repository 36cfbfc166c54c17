"""Load a graph from a Python file: a module-level `graph`, or a `build()` that returns one.

The file may also set `CLUSTER` (a cluster string) as the default for `--cluster`.
"""

from __future__ import annotations

import runpy
import traceback
from pathlib import Path
from typing import Any

from plans.errors import PlannerError
from plans.graph import Graph as GraphSpec
from planner.graph import Graph as GraphBuilder


def _as_graph(obj: Any, path: str) -> GraphSpec:
    if isinstance(obj, GraphBuilder):
        return obj.build()
    if isinstance(obj, GraphSpec):
        return obj
    raise PlannerError(f"{path}: `graph` is a {type(obj).__name__}, not a planner Graph",
                       hint="assign the result of an algorithm (e.g. planner.algorithms.ppo(...)) or Graph(...).build()")


def load_graph_file(path: str | Path) -> tuple[GraphSpec, str | None]:
    """(graph, default cluster string or None) from a graph file."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"graph file {str(path)!r} does not exist")
    try:
        ns = runpy.run_path(str(path), run_name="__planner_graph__")
    except SyntaxError as e:
        raise PlannerError(f"{e.filename}:{e.lineno}: syntax error: {e.msg}",
                           hint=(e.text or "").strip() or None) from None
    except PlannerError:
        raise
    except Exception as e:  # the user's code failed: show where, in their file
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise PlannerError(f"{where}: the graph file raised {type(e).__name__}: {e}") from None
    cluster = ns.get("CLUSTER")
    if "graph" in ns:
        return _as_graph(ns["graph"], str(path)), cluster
    if callable(ns.get("build")):
        return _as_graph(ns["build"](), str(path)), cluster
    raise PlannerError(f"{path} defines neither `graph` nor `build()`",
                       hint="end the file with `graph = ...` (a Graph) or define `def build(): return ...`")
