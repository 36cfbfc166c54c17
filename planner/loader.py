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


def _user_error(e: BaseException, path: Path, what: str) -> PlannerError:
    """The user's code failed: say where, in their file."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
    where = f"{path}:{frames[-1].lineno}" if frames else str(path)
    return PlannerError(f"{where}: {what} raised {type(e).__name__}: {e}")


def load_graph_file(path: str | Path) -> tuple[GraphSpec, str | dict[str, Any] | None]:
    """(graph, default cluster: a string, a dict of ClusterSpec fields, or None) from a graph file."""
    path = Path(path)
    if path.is_dir():
        raise PlannerError(f"graph file {str(path)!r} is a directory", hint="give the .py file that defines `graph`")
    if not path.is_file():
        raise PlannerError(f"graph file {str(path)!r} does not exist")
    try:
        ns = runpy.run_path(str(path), run_name="__planner_graph__")
    except SyntaxError as e:  # also a file that is not Python text (bad encoding, NUL bytes)
        where = f"{path}:{e.lineno}" if e.lineno else str(path)
        raise PlannerError(f"{where}: syntax error: {e.msg}", hint=(e.text or "").strip() or None) from None
    except PlannerError:
        raise
    except SystemExit as e:  # sys.exit() in a graph file ends the file, not the planner
        raise PlannerError(f"{path}: the graph file called sys.exit({e.code!r}) instead of defining a graph") from None
    except Exception as e:
        raise _user_error(e, path, "the graph file") from None
    cluster = ns.get("CLUSTER")
    if cluster is not None and not isinstance(cluster, (str, dict)):
        raise PlannerError(f"{path}: CLUSTER is a {type(cluster).__name__}",
                           hint="set CLUSTER to a string like 'a100-80gb:2x8' or a dict of ClusterSpec fields")
    if "graph" in ns:
        return _as_graph(ns["graph"], str(path)), cluster
    if callable(ns.get("build")):
        try:
            built = ns["build"]()
        except PlannerError:
            raise
        except Exception as e:
            raise _user_error(e, path, "build()") from None
        return _as_graph(built, str(path)), cluster
    raise PlannerError(f"{path} defines neither `graph` nor `build()`",
                       hint="end the file with `graph = ...` (a Graph) or define `def build(): return ...`")
