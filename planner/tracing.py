"""Tracing a training loop: run it once with placeholder models and data, record what it does.

`trace_loop` calls the user's function with a `TracedModel` per model argument and a
`TracedData` per data argument. A model method (`generate`, `inference`, `train`) records a call
on a `planner.Graph` and returns the `TracedData` of its output, so the data edges come from the
data, as with the graph API. A `@planner.host` function (`HostFunction`) called on traced data
records a host step (its qualified name, a hash of its source, the handles it reads) and
returns the handles of its outputs without running.

A placeholder has no value, so Python in the loop that looks at data (arithmetic, comparisons,
`if`/`while` on it, indexing, iteration, `len`, torch functions, attributes such as `.shape`)
raises a `PlannerError` naming the user's file and line: this is how a data-dependent branch
around model calls, which no plan can express, is found. Computations on data belong in host
steps, which run on real tensors at run time.

Handles and host functions meet through a small protocol shared with `runtime.session` (which
re-executes the loop with live handles): a handle names its owner (a `Tracer` here, a runtime
iteration there) in its ``__planner_owner__`` attribute, and a host function called with any
handle among its arguments (also inside lists, tuples and dicts) hands itself to
``owner.host_step(host_function, args, kwargs)``. A host function exposes ``fn`` (the Python
function), ``name`` (its step name before de-duplication), ``function`` (its qualified name) and
``outputs`` (its output names).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import linecache
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from planner.graph import Data, ModelHandle
from planner.graph import Graph as GraphBuilder
from plans.errors import PlannerError

_PLANNER_DIR = str(Path(__file__).resolve().parent)
_TORCH_DIR = "/torch/"
NO_VALUE_HINT = ("the loop is traced once with placeholders, before any data exists, so its Python cannot look at "
                 "data, and model calls cannot depend on data values; compute on data inside a @planner.host "
                 "function, which runs on real tensors at run time")


# Where in the user's code --------------------------------------------------------------------

def user_location() -> str:
    """``file:line (`source line`)`` of the innermost frame outside planner and torch."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = str(Path(frame.f_code.co_filename).resolve())
        if not path.startswith(_PLANNER_DIR) and _TORCH_DIR not in path:
            text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return f"{frame.f_code.co_filename}:{frame.f_lineno}" + (f" (`{text}`)" if text else "")
        frame = frame.f_back
    return "(unknown location)"


def traceback_location(err: BaseException, *, filename: str) -> str:
    """``file:line`` of the innermost frame of `err`'s traceback in `filename` (else its last frame)."""
    frames = [(tb.tb_frame.f_code.co_filename, tb.tb_lineno) for tb in _tb_walk(err.__traceback__)]
    mine = [f for f in frames if f[0] == filename]
    file, line = (mine or frames or [(filename, 0)])[-1]
    return f"{file}:{line}"


def _tb_walk(tb: Any) -> Iterator[Any]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


# Argument trees --------------------------------------------------------------------------------

def leaves(obj: Any) -> Iterator[Any]:
    """The leaves of nested lists, tuples and dicts (dict values), depth first."""
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from leaves(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from leaves(x)
    else:
        yield obj


def _owner_of(args: tuple, kwargs: dict) -> Any:
    """The owner of the handles among the arguments (None when there is none); a `PlannerError`
    when handles of two owners (a trace and a run, or two iterations) are mixed."""
    owners = {id(o): o for x in leaves((args, kwargs)) if (o := getattr(x, "__planner_owner__", None)) is not None}
    if len(owners) > 1:
        raise PlannerError(f"{user_location()}: a host step gets data handles of different iterations or traces",
                           hint="use the handles of the current iteration only")
    return next(iter(owners.values()), None)


def source_sha256(fn: Callable) -> str:
    """SHA-256 of a function's source text (dedented), or of its bytecode and constants when the
    source is not available (a function defined in an interactive session)."""
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):  # no source file: the bytecode still changes when the function does
        code = getattr(fn, "__code__", None)
        if code is None:
            raise PlannerError(f"host step {getattr(fn, '__qualname__', fn)!r} is not a Python function",
                               hint="decorate a `def` function with @planner.host") from None
        text = code.co_code.hex() + repr(code.co_consts)
    return hashlib.sha256(text.encode()).hexdigest()


# Host steps ------------------------------------------------------------------------------------

class HostFunction:
    """A function of the loop that runs on the host (`planner.host`): plain Python when called
    on plain values; a recorded host step when called on traced data; run on real values, on
    every rank, when called on the live data of a run (`runtime.session`)."""

    def __init__(self, fn: Callable, *, outputs: tuple[str, ...] = ("out",)) -> None:
        if not callable(fn):
            raise PlannerError(f"@planner.host decorates a function, not a {type(fn).__name__}")
        if not outputs or len(set(outputs)) != len(outputs):
            raise PlannerError(f"@planner.host on {fn.__qualname__}: outputs must be distinct names, got {outputs!r}")
        self.fn = fn
        self.outputs = tuple(outputs)
        self.function = fn.__qualname__
        name = re.sub(r"[^A-Za-z0-9_]", "_", getattr(fn, "__name__", "host"))
        self.name = name if re.match(r"[A-Za-z_]", name) else f"_{name}"
        self.source_sha256 = source_sha256(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = _owner_of(args, kwargs)
        if owner is None:
            return self.fn(*args, **kwargs)
        return owner.host_step(self, args, kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method: bound to `obj` like a plain function (its identity stays the function's)."""
        return self if obj is None else functools.partial(self.__call__, obj)

    def __repr__(self) -> str:
        return f"<planner.host {self.function}>"


def host(fn: Callable | None = None, *, outputs: tuple[str, ...] | list[str] | None = None) -> Any:
    """Mark a function of a training loop as a host step: ``@planner.host`` (one output) or
    ``@planner.host(outputs=("batch", "stats"))`` (it returns a tuple of that many values)."""
    names = tuple(outputs) if outputs is not None else ("out",)
    if fn is None:
        return lambda f: HostFunction(f, outputs=names)
    return HostFunction(fn, outputs=names)


# Placeholders ----------------------------------------------------------------------------------

_MISUSE = {
    "__bool__": "takes the truth value of", "__len__": "takes len() of", "__iter__": "iterates over",
    "__contains__": "searches", "__getitem__": "indexes", "__setitem__": "assigns into",
    "__float__": "converts to float", "__int__": "converts to int", "__index__": "uses as an index",
    "__complex__": "converts to complex", "__round__": "rounds", "__array__": "converts to an array",
    "__lt__": "compares (<)", "__le__": "compares (<=)", "__gt__": "compares (>)", "__ge__": "compares (>=)",
    "__eq__": "compares (==)", "__ne__": "compares (!=)", "__neg__": "negates", "__pos__": "applies unary + to",
    "__abs__": "takes abs() of", "__invert__": "inverts",
    **{f"__{r}{op}__": f"does arithmetic ({sym}) on" for op, sym in (
        ("add", "+"), ("sub", "-"), ("mul", "*"), ("truediv", "/"), ("floordiv", "//"), ("mod", "%"),
        ("pow", "**"), ("matmul", "@"), ("and", "&"), ("or", "|"), ("xor", "^"), ("lshift", "<<"),
        ("rshift", ">>")) for r in ("", "r", "i")},
}


class TracedData:
    """A data handle while the loop is traced: a name and a shape, no value."""

    __hash__ = object.__hash__

    def __init__(self, tracer: Tracer, data: Data, *, producer_kind: str | None) -> None:
        self.__planner_owner__ = tracer
        self.data = data
        self.producer_kind = producer_kind  # the kind of call that wrote it, "host", or None for inputs

    @property
    def name(self) -> str:
        return self.data.name

    def _refuse(self, what: str) -> None:
        raise PlannerError(f"{user_location()} {what} data handle {self.name!r}, which has no value while the loop "
                           "is traced", hint=NO_VALUE_HINT)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse(f"reads `.{attr}` of")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        handle = next(x for x in leaves((args, kwargs or {})) if isinstance(x, TracedData))
        handle._refuse(f"calls torch `{getattr(func, '__name__', func)}` on")

    def __repr__(self) -> str:
        return f"<traced data {self.name!r}: {self.data.seqs} x {self.data.seq_len}>"


def _refusing(dunder: str, what: str) -> Callable:
    def refuse(self: TracedData, *args: Any, **kwargs: Any) -> Any:
        self._refuse(what)

    refuse.__name__ = dunder
    return refuse


def _install_refusals() -> None:
    for dunder, what in _MISUSE.items():
        setattr(TracedData, dunder, _refusing(dunder, what))


_install_refusals()


class TracedModel:
    """A model argument while the loop is traced: its calls are recorded."""

    def __init__(self, tracer: Tracer, handle: ModelHandle) -> None:
        self._tracer, self._handle = tracer, handle

    @property
    def name(self) -> str:
        return self._handle.name

    def generate(self, prompts: TracedData, **kwargs: Any) -> TracedData:
        """Record a generate call (keywords as `planner.graph.ModelHandle.generate`)."""
        return self._tracer.call(self, "generate", (prompts,), kwargs)

    def inference(self, *inputs: TracedData, **kwargs: Any) -> TracedData:
        """Record an inference call (keywords as `planner.graph.ModelHandle.inference`)."""
        return self._tracer.call(self, "inference", inputs, kwargs)

    def train(self, *inputs: TracedData, **kwargs: Any) -> TracedData:
        """Record a train call (keywords as `planner.graph.ModelHandle.train`)."""
        return self._tracer.call(self, "train", inputs, kwargs)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise PlannerError(f"{user_location()} uses `.{attr}` of model {self.name!r}",
                           hint="a model argument of a traced loop offers generate, inference and train")

    def __repr__(self) -> str:
        return f"<traced model {self.name!r}>"


class Tracer:
    """Records one run of a loop into a graph builder."""

    def __init__(self, builder: GraphBuilder) -> None:
        self.builder = builder
        self.open = True

    def _data(self, value: Any, *, what: str) -> Data:
        if not isinstance(value, TracedData):
            raise PlannerError(f"{user_location()} {what} gets a {type(value).__name__}, not a data handle",
                               hint="pass the handles that model calls, host steps and the loop's data arguments return")
        if value.__planner_owner__ is not self or not self.open:
            which = "another trace" if value.__planner_owner__ is not self else "a finished trace"
            raise PlannerError(f"{user_location()} {what} gets data handle {value.name!r} of {which}",
                               hint="use a loop's handles only inside the loop, while it runs")
        return value.data

    def call(self, model: TracedModel, kind: str, inputs: tuple, kwargs: dict[str, Any]) -> TracedData:
        """Record `model.kind(*inputs, **kwargs)`; the handle of its output."""
        what = f"{model.name}.{kind}()"
        data = [self._data(x, what=what) for x in inputs]
        if not data:
            raise PlannerError(f"{user_location()} {what} reads no data handle")
        hosted = [x.name for x in inputs if x.producer_kind == "host"]
        if kind == "train" and hosted and inputs[0].producer_kind != "host":
            raise PlannerError(f"{user_location()} {what} reads host step output {hosted[0]!r} after "
                               f"{inputs[0].name!r}; a train call trains on the host step output it reads first",
                               hint="pass the batch your host step computed as the first argument")
        method = getattr(model._handle, kind)
        try:
            out = method(*data, **kwargs)
        except PlannerError as e:
            raise PlannerError(f"{user_location()} {what}: {e.message}", hint=e.hint) from None
        except TypeError as e:  # an unknown or missing keyword: the user's mistake, shown at their line
            raise PlannerError(f"{user_location()} {what}: {e}",
                               hint=f"see planner.graph.ModelHandle.{kind} for its arguments") from None
        return TracedData(self, out, producer_kind=kind)

    def host_step(self, step: HostFunction, args: tuple, kwargs: dict) -> Any:
        """Record host step `step` called on `args`; the handles of its outputs."""
        where = f"{user_location()} host step {step.function}"
        if not self.open:
            raise PlannerError(f"{where} gets data handles of a finished trace")
        try:
            bound = inspect.signature(step.fn).bind(*args, **kwargs)
        except TypeError as e:
            raise PlannerError(f"{where}: {e}") from None
        inputs: list[Data] = []
        for value in bound.arguments.values():
            handles = [x for x in leaves(value) if isinstance(x, TracedData)]
            if any(isinstance(x, TracedModel) for x in leaves(value)):
                raise PlannerError(f"{where} gets a model", hint="call models in the loop; host steps get data")
            for h in handles:
                if h.producer_kind == "train":
                    raise PlannerError(f"{where} reads {h.name!r}, the statistics of a train call, which exist only "
                                       "after the iteration (on rank 0)",
                                       hint="return them from the loop instead; the call returns them as a dict")
                inputs.append(self._data(h, what=f"host step {step.function}"))
        made = self.builder.host_step(step.name, function=step.function, source_sha256=step.source_sha256,
                                      inputs=inputs, outputs=list(step.outputs))
        out = [TracedData(self, d, producer_kind="host") for d in made]
        return out[0] if len(out) == 1 else tuple(out)
