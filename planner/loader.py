"""Load a graph from a Python file: a module-level `graph`, a `build()` that returns one, or a
training loop decorated with `@planner.auto` (traced into its graph).

The file may also set `CLUSTER` (a cluster string) as the default for `--cluster`; a decorated
loop brings its own cluster and plan path.

A graph file is Python code and runs as such (compile only files you trust); while it runs, its
``print()`` output goes to stderr, so ``--json`` output on stdout stays valid, and whatever way
it ends (an exception, ``sys.exit``, ``os._exit``, a `BaseException`) is a `PlannerError` naming
the file, not a silent exit or a traceback. Ctrl-C still interrupts.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.auto import AutoFunction
from planner.graph import Graph as GraphBuilder
from plans.cluster import ClusterSpec
from plans.errors import PlannerError, brief
from plans.graph import Graph as GraphSpec


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


def _user_error(e: BaseException, path: Path, what: str) -> PlannerError:
    """The user's code failed: say where, in their file."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == str(path)]
    where = f"{path}:{frames[-1].lineno}" if frames else str(path)
    return PlannerError(f"{where}: {what} raised {type(e).__name__}: {e}")


class _ExitCalled(BaseException):
    """`os._exit` called by a graph file (raised instead of ending the process)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _no_exit(code: int) -> None:
    raise _ExitCalled(code)


@contextlib.contextmanager
def _guarded(path: Path, what: str) -> Iterator[None]:
    """Run the user's code of `path` with stdout sent to stderr and `os._exit` made an exception;
    any way the code ends but returning or Ctrl-C becomes a `PlannerError` naming the file."""
    real_exit = os._exit
    os._exit = _no_exit  # type: ignore[assignment]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    except _ExitCalled as e:
        raise PlannerError(f"{path}: {what} called os._exit({e.code}) instead of defining a graph") from None
    except SystemExit as e:  # sys.exit() in a graph file ends the file, not the planner
        raise PlannerError(f"{path}: {what} called sys.exit({e.code!r}) instead of defining a graph") from None
    except (PlannerError, KeyboardInterrupt):
        raise
    except SyntaxError as e:  # also a file that is not Python text (bad encoding, NUL bytes)
        where = f"{e.filename or path}:{e.lineno}" if e.lineno else str(e.filename or path)
        raise PlannerError(f"{where}: syntax error: {e.msg}", hint=(e.text or "").strip() or None) from None
    except BaseException as e:  # an Exception, or a class derived from BaseException: the file's failure
        raise _user_error(e, path, what) from None
    finally:
        os._exit = real_exit


def _run_file(path: Path) -> dict[str, Any]:
    with _guarded(path, "the graph file"):
        return runpy.run_path(str(path), run_name="__planner_graph__")


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
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError) as e:  # a name too long for the file system, a NUL byte
        raise PlannerError(f"graph file {brief(str(path))} is not a usable path: {e}") from None
    if is_dir:
        raise PlannerError(f"graph file {brief(str(path))} is a directory", hint="give the .py file that defines `graph`")
    if not is_file:
        raise PlannerError(f"graph file {brief(str(path))} does not exist")
    ns = _run_file(path)
    cluster = ns.get("CLUSTER")
    if cluster is not None and not isinstance(cluster, (str, dict)):
        raise PlannerError(f"{path}: CLUSTER is a {type(cluster).__name__}",
                           hint="set CLUSTER to a string like 'a100-80gb:2x8' or a dict of ClusterSpec fields")
    if function is None and "graph" in ns:
        return LoadedGraph(_as_graph(ns["graph"], str(path)), cluster)
    if function is None and callable(ns.get("build")) and not isinstance(ns.get("build"), AutoFunction):
        with _guarded(path, "build()"):
            built = ns["build"]()
        return LoadedGraph(_as_graph(built, str(path)), cluster)
    loop = _pick_loop(ns, path, function)
    if loop is None:
        raise PlannerError(f"{path} defines neither `graph` nor `build()`, and no @planner.auto function",
                           hint="end the file with `graph = ...` (a Graph), define `def build(): return ...`, "
                           "or decorate a training loop with @planner.auto(...)")
    with _guarded(path, f"tracing {loop.fn.__qualname__}()"):
        traced = loop.trace()
    return LoadedGraph(traced, loop.cluster_arg, loop)


def load_graph_file(path: str | Path) -> tuple[GraphSpec, str | dict[str, Any] | None]:
    """(graph, default cluster: a string, a dict of ClusterSpec fields, or None) from a graph file."""
    loaded = load_target(path)
    cluster = loaded.cluster
    if isinstance(cluster, ClusterSpec):
        cluster = cluster.model_dump()
    return loaded.graph, cluster
