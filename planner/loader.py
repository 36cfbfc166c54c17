"""Load a graph from a Python file: a module-level `graph`, a `build()` that returns one, or a
training loop decorated with `@planner.auto` (traced into its graph).

The file may also set `CLUSTER` (a cluster string) as the default for `--cluster`; a decorated
loop brings its own cluster and plan path.
"""

from __future__ import annotations

import runpy
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.graph import Graph as GraphSpec
from planner.auto import AutoFunction
from planner.graph import Graph as GraphBuilder


@dataclass(frozen=True)
class LoadedGraph:
    """What a graph file defines: the graph, its default cluster, and the decorated loop it was
    traced from (None for `graph` / `build()`)."""

    graph: GraphSpec
    cluster: str | ClusterSpec | dict[str, Any] | None
    auto: AutoFunction | None = None


def _as_graph(obj: Any, path: str) -> GraphSpec:
    if isinstance(obj, GraphBuilder):
        return obj.build()
    if isinstance(obj, GraphSpec):
        return obj
    raise PlannerError(f"{path}: `graph` is a {type(obj).__name__}, not a planner Graph",
                       hint="assign the result of an algorithm (e.g. planner.algorithms.ppo(...)) or Graph(...).build()")


def _run_file(path: Path) -> dict[str, Any]:
    try:
        return runpy.run_path(str(path), run_name="__planner_graph__")
    except SyntaxError as e:
        raise PlannerError(f"{e.filename}:{e.lineno}: syntax error: {e.msg}",
                           hint=(e.text or "").strip() or None) from None
    except PlannerError:
        raise
    except Exception as e:  # the user's code failed: show where, in their file
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
        where = f"{path}:{frames[-1].lineno}" if frames else str(path)
        raise PlannerError(f"{where}: the graph file raised {type(e).__name__}: {e}") from None


def _pick_loop(ns: dict[str, Any], path: Path, function: str | None) -> AutoFunction | None:
    loops: dict[str, AutoFunction] = {}
    for name, value in ns.items():
        if isinstance(value, AutoFunction) and all(value is not v for v in loops.values()):
            loops[name] = value
    if function is not None:
        if function not in loops:
            raise PlannerError(f"{path} has no @planner.auto function named {function!r}",
                               hint=f"its decorated functions: {', '.join(loops) or 'none'}")
        return loops[function]
    if len(loops) > 1:
        raise PlannerError(f"{path} defines {len(loops)} @planner.auto functions ({', '.join(loops)})",
                           hint="choose one with --function NAME")
    return next(iter(loops.values()), None)


def load_target(path: str | Path, *, function: str | None = None) -> LoadedGraph:
    """The graph a file defines (`graph`, `build()`, or its one `@planner.auto` loop, or the
    loop named `function`), with its default cluster."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(f"graph file {str(path)!r} does not exist")
    ns = _run_file(path)
    cluster = ns.get("CLUSTER")
    if function is None and "graph" in ns:
        return LoadedGraph(_as_graph(ns["graph"], str(path)), cluster)
    if function is None and callable(ns.get("build")) and not isinstance(ns.get("build"), AutoFunction):
        return LoadedGraph(_as_graph(ns["build"](), str(path)), cluster)
    loop = _pick_loop(ns, path, function)
    if loop is None:
        raise PlannerError(f"{path} defines neither `graph` nor `build()`, and no @planner.auto function",
                           hint="end the file with `graph = ...` (a Graph), define `def build(): return ...`, "
                           "or decorate a training loop with @planner.auto(...)")
    return LoadedGraph(loop.trace(), loop.cluster_arg, loop)


def load_graph_file(path: str | Path) -> tuple[GraphSpec, str | None]:
    """(graph, default cluster string or None) from a graph file."""
    loaded = load_target(path)
    cluster = loaded.cluster
    return loaded.graph, cluster if isinstance(cluster, str) or cluster is None else None
