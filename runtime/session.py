"""Run a traced training loop on the runtime: the user's function again, with live handles.

`planner.auto` traces a loop into a graph and compiles its plan; each later call of the loop is
one `Session.run`: the function runs once more, on every rank, with a `LiveModel` for each model
argument and a `LiveData` for each data argument. A model call runs the plan's call of that name
right away (`PlanRunner.run_call`: its reallocation first, then the call with its mesh and
layout on the ranks of its mesh, its output sent to the ranks that read it), so the calls run
in the loop's program order, which is the same on every rank. A host step (``planner.host``)
runs its function, as written, on real values on every rank: its inputs are sent to every rank,
its outputs stay where they are computed, and a train call whose first input is a host step's
output trains on that batch (`runtime.algorithms.prepared_batch`).

A call or host step is found in the plan by the name the trace gave it (the same de-duplicated
name, `plans.graph.unique_name`), and must read the same handles with the same settings; a loop
that does something else at run time than when it was traced is an error naming the call.

Values the loop sees: a generate call's output is the runtime's rows {tokens [n, s], logprobs
[n, gen], mask [n, gen]}, an inference call's {logprobs [n, s-1]} or {values [n, s]} or {scores
[n]}, a data argument {tokens [n, s]} (plus {mask} for sft/dpo inputs); a host step gets and
returns whatever Python values it likes. When the loop returns, handles in its return value
(also inside lists, tuples and dicts) become their values on this rank: a train call's handle
the dict of that call's statistics and times (rank 0; {} elsewhere), a call's output the rows
(on the ranks that read it; None elsewhere), a host step's output its value (every rank).

This module implements the other side of the host-step protocol of `planner.tracing` (runtime
never imports planner): a handle's ``__planner_owner__`` is the `_Iteration` it belongs to, and
a host function hands itself to ``_Iteration.host_step``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plans.errors import PlannerError
from plans.graph import HostStep, unique_name
from plans.plan import Plan, PlanCall
from runtime.executor import DEFAULT_TIMEOUT_S, PlanRunner, StepState, rows_on
from runtime.groups import init_default_group


@dataclass
class Launch:
    """This process's place in the run: rank, world, device, and whether torchrun started it."""

    rank: int
    world_size: int
    torchrun: bool  # WORLD_SIZE is set: run the plan's layouts; else the single-process reference
    device: torch.device
    owns_group: bool  # the process group was created here (and is destroyed by `close`)

    @property
    def distributed(self) -> bool:
        return self.torchrun and self.world_size > 1

    def share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (a pickled broadcast)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False


def launch() -> Launch:
    """Join the run torchrun started (creating the default process group unless the program
    already did: gloo on CPU, NCCL on GPUs), or a single process without torchrun."""
    torchrun = "WORLD_SIZE" in os.environ
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    owns = False
    if torchrun and world > 1 and not dist.is_initialized():
        init_default_group("nccl" if cuda else "gloo", timeout_s=DEFAULT_TIMEOUT_S)
        owns = True
    return Launch(rank=rank, world_size=world, torchrun=torchrun, device=device, owns_group=owns)


class Session:
    """A traced loop's plan, ready on this rank: each `run` is one iteration."""

    def __init__(self, plan: Plan, *, launch: Launch, seed: int, dtype: torch.dtype = torch.float32,
                 reward_fn: str | None = None) -> None:
        """`reward_fn`: the reward function the loop's own decorator names (the plan's must match)."""
        if launch.torchrun and launch.world_size != plan.cluster.world_size:
            raise PlannerError(
                f"plan {plan.name!r} is for {plan.cluster.world_size} ranks ({plan.cluster.short()}) but this launch "
                f"has {launch.world_size}",
                hint=f"launch with torchrun --nproc-per-node {plan.cluster.gpus_per_node} --nnodes "
                f"{plan.cluster.nodes}, or run the program without torchrun for the single-process reference")
        self.plan, self.launch = plan, launch
        self.runner = PlanRunner(plan, rank=launch.rank, world_size=launch.world_size, reference=not launch.torchrun,
                                 seed=seed, dtype=dtype, device=launch.device, reward_fn=reward_fn,
                                 reward_flag="@planner.auto(algorithm={'reward_fn': ...})")
        self.steps = 0

    def run(self, invoke: Callable[[dict[str, Any]], Any], *, models: dict[str, str], data_params: list[str],
            data: dict[str, Any]) -> tuple[Any, dict[str, float | int]]:
        """One iteration: `invoke` the loop with live handles for the `models` arguments (argument
        -> model name) and the `data_params`, those in `data` holding the caller's tensors.
        Returns (the loop's return value with handles replaced by values, the metrics)."""
        given = {name: _rows(self.plan, name, value) for name, value in data.items()}
        self.steps += 1
        it = _Iteration(self, self.runner.begin_step(self.steps, inputs=given))
        handles: dict[str, Any] = {p: LiveModel(it, m) for p, m in models.items()}
        handles.update({p: LiveData(it, p) for p in data_params})
        try:
            value = invoke(handles)
            it.check_complete()
            metrics = self.runner.finish_step(it.state)
            return _tree_map(lambda x: it.value(x, metrics) if isinstance(x, LiveData) else x, value), metrics
        finally:
            it.open = False


def _rows(plan: Plan, name: str, value: Any) -> dict[str, Tensor]:
    """The caller's value of data argument `name` as rows: a token tensor [seqs, seq_len], or a dict
    of tensors with ``tokens``."""
    decl = next((i for i in plan.inputs if i.name == name), None)
    rows = {"tokens": value} if isinstance(value, Tensor) else value
    if decl is None or not isinstance(rows, dict) or not isinstance(rows.get("tokens"), Tensor):
        raise PlannerError(f"data argument {name!r} must be a token tensor or a dict of tensors with 'tokens', "
                           f"got a {type(value).__name__}")
    want = (decl.seqs, decl.seq_len)
    if tuple(rows["tokens"].shape) != want:
        raise PlannerError(f"data argument {name!r} has tokens of shape {tuple(rows['tokens'].shape)}, but the loop was "
                           f"planned for {want[0]} sequences of {want[1]} tokens",
                           hint="pass a batch of the planned shape, or change batch/prompt_len/inputs= in @planner.auto")
    return {k: v.cpu() for k, v in rows.items()}


def _check_model_input(plan: Plan, handle: str, value: Any, *, step: HostStep) -> None:
    """A host step output a generate or inference call reads holds rows with ``tokens``, as the
    runtime's own data handles do (a train call checks its batch itself)."""
    readers = [c.name for c in plan.calls if c.kind != "train" and c.inputs and c.inputs[0] == handle]
    if readers and not (isinstance(value, dict) and isinstance(value.get("tokens"), Tensor)):
        raise PlannerError(f"host step {step.function} returned a {type(value).__name__} as {handle!r}, which call "
                           f"{readers[0]!r} reads as its sequences",
                           hint="return a dict of tensors with 'tokens' [n, seq_len] (and 'mask' where the call needs it)")


def _tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    if isinstance(obj, list):
        return [_tree_map(fn, x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_tree_map(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: _tree_map(fn, v) for k, v in obj.items()}
    return fn(obj)


class _Iteration:
    """One run of the loop: the names it has used, its step state, whether it is still running."""

    def __init__(self, session: Session, state: StepState) -> None:
        self.session, self.state, self.plan = session, state, session.plan
        self.calls = {c.name: c for c in self.plan.calls}
        self.host_steps = {s.name: s for s in self.plan.host_steps}
        self.made: list[str] = []  # call and host step names, in program order
        self.open = True

    def _handle(self, x: Any, *, what: str) -> str:
        if not isinstance(x, LiveData):
            raise PlannerError(f"{what} gets a {type(x).__name__}, not a data handle")
        if x.__planner_owner__ is not self or not self.open:
            raise PlannerError(f"{what} gets data handle {x.name!r} of another iteration",
                               hint="use the handles of the current call of the loop only")
        return x.name

    def _differs(self, message: str) -> PlannerError:
        return PlannerError(f"the loop {message}",
                            hint="a loop must make the same calls and host steps on every iteration as when it was "
                            "traced; if a Python value decides them, decorate one function per variant")

    def call(self, model: str, kind: str, inputs: tuple, fields: dict[str, Any]) -> LiveData:
        """Run model call `model.kind(*inputs, **fields)` as the plan's call of the same name."""
        name = fields.pop("name", None) or unique_name(f"{model}_{kind}", self.made)
        fields.pop("output", None)  # the traced output name is the plan's
        what = f"{model}.{kind}()"
        names = [self._handle(x, what=what) for x in inputs]
        call = self.calls.get(name)
        if name in self.made:
            raise self._differs(f"makes call {name!r} more often than when it was traced")
        if call is None:
            raise self._differs(f"makes call {name!r}, which it did not make when it was traced")
        if (call.model, call.kind, call.inputs) != (model, kind, names):
            raise self._differs(f"makes call {name!r} as {model}.{kind}({', '.join(names)}); when traced it was "
                                f"{call.model}.{call.kind}({', '.join(call.inputs)})")
        for key, value in fields.items():
            if value is not None and getattr(call, key, value) != value:
                raise self._differs(f"makes call {name!r} with {key}={value!r}; when traced it had "
                                    f"{key}={getattr(call, key)!r}")
        self.made.append(name)
        self.session.runner.run_call(call, state=self.state)
        return LiveData(self, call.outputs[0], call=call)

    def host_step(self, step: Any, args: tuple, kwargs: dict) -> Any:
        """Run host function `step` on the values of the handles among its arguments, on this rank."""
        name = unique_name(step.name, self.made)
        spec: HostStep | None = self.host_steps.get(name)
        if spec is None or spec.function != step.function:
            raise self._differs(f"runs host step {step.function} (as {name!r}), which it did not run there when it "
                                "was traced")
        found = [self._handle(x, what=f"host step {name!r}") for x in _leaves((args, kwargs)) if isinstance(x, LiveData)]
        if sorted(found) != sorted(spec.inputs):
            raise self._differs(f"passes {', '.join(found)} to host step {name!r}; when traced it passed "
                                f"{', '.join(spec.inputs)}")
        self.made.append(name)
        runner = self.session.runner
        real = _tree_map(lambda x: runner.readable(x.name, self.state.get(x.name), self.state)
                         if isinstance(x, LiveData) else x, (args, kwargs))
        t0 = time.perf_counter()
        result = step.fn(*real[0], **real[1])
        elapsed_s = time.perf_counter() - t0
        outs = [result] if len(spec.outputs) == 1 else result
        if len(spec.outputs) > 1 and (not isinstance(result, (tuple, list)) or len(result) != len(spec.outputs)):
            raise PlannerError(f"host step {spec.function} declares outputs {', '.join(step.outputs)} but returned "
                               f"a {type(result).__name__}" + (f" of {len(result)}" if isinstance(result, (tuple, list))
                                                               else ""),
                               hint=f"return a tuple of {len(spec.outputs)} values")
        for handle, out in zip(spec.outputs, outs):
            _check_model_input(self.plan, handle, out, step=spec)
            self.state.store[handle] = out
        if self.session.launch.rank == 0:
            self.state.reports.append({f"{name}.time_s": elapsed_s})
        live = [LiveData(self, h) for h in spec.outputs]
        return live[0] if len(live) == 1 else tuple(live)

    def check_complete(self) -> None:
        """Every call and host step of the plan ran (each exactly once, checked as they ran)."""
        missing = [n for n in (*self.calls, *self.host_steps) if n not in self.made]
        if missing:
            raise self._differs(f"skipped {', '.join(map(repr, missing))}, which it made when it was traced")

    def value(self, handle: LiveData, metrics: dict[str, float | int]) -> Any:
        """What `handle` holds on this rank once the iteration is over (its tensors on the CPU, as
        the caller's loop gets them whatever device computed them)."""
        if handle.call is not None and handle.call.kind == "train":
            prefix = f"{handle.call.name}."
            return {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
        return rows_on(self.state.get(handle.name), torch.device("cpu"))


def _leaves(obj: Any) -> list[Any]:
    out: list[Any] = []
    _tree_map(out.append, obj)
    return out


class LiveData:
    """A data handle of a running iteration (a model call's output, a host step's, or an input)."""

    def __init__(self, iteration: _Iteration, name: str, *, call: PlanCall | None = None) -> None:
        self.__planner_owner__ = iteration
        self.name, self.call = name, call

    def __repr__(self) -> str:
        return f"<live data {self.name!r}>"


class LiveModel:
    """A model argument of a running iteration: its calls run on the runtime."""

    def __init__(self, iteration: _Iteration, name: str) -> None:
        self._it, self.name = iteration, name

    def generate(self, prompts: LiveData, *, gen_len: int | None = None, samples_per_prompt: int | None = None,
                 temperature: float | None = None, name: str | None = None, output: str | None = None) -> LiveData:
        """Run this iteration's generate call (arguments as when traced)."""
        return self._it.call(self.name, "generate", (prompts,), {
            "gen_len": gen_len, "samples_per_prompt": samples_per_prompt, "temperature": temperature,
            "name": name, "output": output})

    def inference(self, *inputs: LiveData, returns: str | None = None, name: str | None = None,
                  output: str | None = None) -> LiveData:
        """Run this iteration's inference call (arguments as when traced)."""
        return self._it.call(self.name, "inference", inputs, {"returns": returns, "name": name, "output": output})

    def train(self, *inputs: LiveData, loss: str, minibatches: int | None = None, lr: float | None = None,
              name: str | None = None, output: str | None = None) -> LiveData:
        """Run this iteration's train call (arguments as when traced)."""
        return self._it.call(self.name, "train", inputs, {"loss": loss, "minibatches": minibatches, "lr": lr,
                                                           "name": name, "output": output})

    def __repr__(self) -> str:
        return f"<live model {self.name!r}>"
