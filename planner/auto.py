"""`@planner.auto`: plan and run a training loop written as a plain Python function.

    @planner.host(outputs=("batch", "stats"))
    def advantages(samples, scores, ref, values): ...       # Python on real tensors, every rank

    @planner.auto(cluster="cpu:1x4", plan="plans/ppo.json", batch=16, prompt_len=8, gen_len=8,
                  models={"actor": planner.model("tiny-llama", trainable=True), "ref": "tiny-llama", ...})
    def ppo_step(actor, critic, ref, prompts):
        samples = actor.generate(prompts)
        ...
        return {"actor": actor.train(batch, loss="ppo_policy"), "stats": stats}

    ppo_step()      # one iteration: under torchrun on the plan's layouts, else the reference

The function's arguments named in `models` are models; the others without a default are data
the batch provides each iteration (drawn from `algorithm.task`'s data source unless the caller
passes tensors); arguments with a default are plain Python values.

1. **Trace.** The first call runs the function once with placeholders (`planner.tracing`),
   recording its model calls, data edges and host steps into a graph.
2. **Plan.** The graph is hashed with the cluster, the models, the compile options that
   change the plan and the planner's own code (`plan_hash`); the plan file at `plan` is reused when it carries that hash,
   else the graph is compiled and the plan written there (atomically) with it. The search's
   time budget is not hashed: a longer search finds a better plan for the same problem.
   `planner compile FILE.py` compiles a file's decorated function the same way.
3. **Run.** Under torchrun (WORLD_SIZE set) rank 0 makes the plan and sends it to the others;
   every rank then runs the function again with live handles (`runtime.session`): each model
   call runs with its mesh and layout (parameters reallocated as the plan says), host steps
   run as written on every rank. Without torchrun it runs the single-process reference. Each
   later call is one more iteration. The call returns what the function returns, with handles
   replaced by their values; `last_metrics` holds the iteration's metrics (the same keys as
   ``python -m runtime --metrics-out``, complete on rank 0).
"""

from __future__ import annotations

import atexit
import hashlib
import inspect
import json
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from planner.graph import Graph as GraphBuilder
from planner.tracing import TracedData, TracedModel, Tracer, traceback_location
from plans.cluster import ClusterSpec, resolve_cluster
from plans.errors import PlannerError
from plans.graph import AlgorithmConfig, Head, ModelDecl
from plans.graph import Graph as GraphSpec
from plans.layout import GaLore
from plans.model import ModelSpec, resolve_model, weights_directory
from plans.plan import PLAN_VERSION, Plan, load_plan, parse_plan, plan_to_json, save_plan

ModelArg = str | ModelSpec | ModelDecl | dict[str, Any]


def model(spec: str | ModelSpec | dict[str, Any], *, trainable: bool = False, head: Head = "lm") -> ModelDecl:
    """A model of a traced loop: `spec` as in `Graph.model`, whether it trains, its head."""
    if head not in ("lm", "value"):
        raise PlannerError(f"model head must be 'lm' or 'value', got {head!r}")
    return ModelDecl(spec=resolve_model(spec), trainable=trainable, head=head, weights=weights_directory(spec))


PLANNING_PACKAGES = ("plans", "cost_models", "planner")  # the code a plan is compiled by (not the runtime)


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """SHA-256 over the planner's own code and data that make a plan: every .py and .json file of
    `PLANNING_PACKAGES`, by path, so a plan cached by another version of the cost model or the
    search is compiled again (a few milliseconds, once per process)."""
    import importlib

    digest = hashlib.sha256()
    for name in PLANNING_PACKAGES:
        root = Path(importlib.import_module(name).__file__ or "").parent
        for f in sorted(root.rglob("*")):
            if f.suffix in (".py", ".json") and "__pycache__" not in f.parts and f.is_file():
                digest.update(f.relative_to(root.parent).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def plan_hash(graph: GraphSpec, *, cluster: ClusterSpec, baseline: str | None = None,
              calibration_sha256: str | None = None, offload: bool = True, galore: GaLore | None = None,
              node_ranges: bool | None = None) -> str:
    """SHA-256 of canonical JSON of what a plan is compiled from: the graph (models, calls, data
    edges, host steps with their source hashes, algorithm), the cluster, the options that change
    the plan, and the planner's own code (`code_fingerprint`)."""
    payload = {"plan_version": PLAN_VERSION, "code": code_fingerprint(), "graph": graph.model_dump(mode="json"),
               "cluster": cluster.model_dump(mode="json"), "baseline": baseline,
               "calibration_sha256": calibration_sha256}
    if not offload:  # a plan searched with every state on the GPU (`planner compile --no-offload`)
        payload["offload"] = False
    if galore is not None:  # train calls may use a GaLore optimizer (`planner compile --galore-rank`)
        payload["galore"] = galore.model_dump(mode="json")
    if node_ranges is not None:  # the mesh space chosen (`planner compile --node-ranges/--aligned-meshes`)
        payload["node_ranges"] = node_ranges
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def ensure_plan(graph: GraphSpec, *, cluster: ClusterSpec, path: Path, digest: str, time_limit_s: float,
                baseline: str | None = None, calibration: Path | None = None, galore: GaLore | None = None,
                say: Callable[[str], None] = lambda _m: None) -> tuple[Plan, bool]:
    """(the plan at `path` if it carries `digest`, else a new one compiled and written there;
    whether it was compiled)."""
    from planner.compile import compile_graph

    if path.is_file():
        try:
            cached = load_plan(path)
        except PlannerError as e:  # a cache that cannot be read is replaced, and the user told why
            why = f"the file there is not a usable plan: {e.message.splitlines()[0]}"
        else:
            if cached.source_hash == digest:
                say(f"planner: reusing {path} (the loop, cluster and models are unchanged)")
                return cached, False
            why = "it was compiled from a graph file" if cached.source_hash is None else \
                "it was compiled from another version of the loop, cluster or models, or by another version of planner"
    else:
        why = "no plan there yet"
    say(f"planner: compiling {graph.name!r} for {cluster.short()} into {path} ({why})")
    calib = None
    if calibration is not None:
        from cost_models import load_calibration

        calib = load_calibration(calibration)
    from planner.candidates import SearchSpace

    space = SearchSpace(galore=galore) if galore is not None else None
    plan = compile_graph(graph, cluster, time_limit_s=time_limit_s, baseline=baseline, calibration=calib, space=space)
    plan = plan.model_copy(update={"source_hash": digest})
    save_plan(plan, path)
    return plan, True


def _galore_option(value: GaLore | dict[str, Any] | None, *, where: str) -> GaLore | None:
    """The decorator's `galore=` option: a `GaLore`, its fields as a dict, or None (AdamW only)."""
    if value is None or isinstance(value, GaLore):
        return value
    if not isinstance(value, dict):
        raise PlannerError(f"{where}: galore= must be a dict of GaLore fields (rank, update_interval, scale), got "
                           f"{type(value).__name__}", hint="e.g. galore={'rank': 128}")
    try:
        return GaLore.model_validate(value)
    except ValidationError as e:
        raise PlannerError(f"{where}: galore={value!r}: " + "; ".join(err["msg"] for err in e.errors()),
                           hint="e.g. galore={'rank': 128, 'update_interval': 200}") from None


def file_sha256(path: Path | None) -> str | None:
    """SHA-256 of a file's bytes (None for no file): how a calibration file enters `plan_hash`."""
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as e:
        raise PlannerError(f"cannot read calibration file {str(path)!r}: {e.strerror}") from None


class AutoFunction:
    """A training-loop function decorated with `planner.auto` (see the module docstring)."""

    def __init__(self, fn: Callable, *, cluster: str | ClusterSpec | dict[str, Any], models: dict[str, ModelArg],
                 plan: str | Path | None = None, name: str | None = None, batch: int, prompt_len: int | None = None,
                 gen_len: int | None = None, seq_len: int | None = None,
                 inputs: dict[str, tuple[int, int]] | None = None, data: dict[str, dict[str, Any]] | None = None,
                 algorithm: AlgorithmConfig | dict[str, Any] | None = None, seed: int = 0,
                 time_limit_s: float = 10.0, baseline: str | None = None, calibration: str | Path | None = None,
                 galore: GaLore | dict[str, Any] | None = None, verbose: bool = True) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.cluster_arg = cluster
        self.plan_path = Path(plan) if plan is not None else Path("plans") / f"{self.name}.json"
        self.shape = {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "seq_len": seq_len}
        self.input_shapes = dict(inputs or {})
        self.data = dict(data or {})  # data argument -> the dataset it is drawn from (`Graph.input` keywords)
        self.algorithm = algorithm
        self.seed, self.time_limit_s, self.baseline, self.verbose = seed, time_limit_s, baseline, verbose
        self.calibration = Path(calibration) if calibration is not None else None
        self.galore = _galore_option(galore, where=f"@planner.auto on {fn.__qualname__}")
        self.signature = inspect.signature(fn)
        # in the order of the function's arguments (the graph's model order)
        order = [p for p in self.signature.parameters if p in models] + [m for m in models if m not in
                                                                            self.signature.parameters]
        self.models: dict[str, ModelDecl] = {}
        for k in order:
            given = models[k]
            self.models[k] = given if isinstance(given, ModelDecl) else model(given)
        self.data_params: list[str] = []
        self.defaults: dict[str, Any] = {}
        self._classify_parameters()
        self._traced: GraphSpec | None = None
        self._launch: Any = None  # runtime.session.Launch once a call started the runtime
        self._session: Any = None  # runtime.session.Session
        self._metrics: dict[str, float | int] = {}
        self._exit_hook = False

    def _classify_parameters(self) -> None:
        where = f"@planner.auto on {self.fn.__qualname__}"
        for p in self.signature.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise PlannerError(f"{where}: *{p.name} arguments cannot be traced", hint="name every argument")
            if p.name in self.models:
                continue
            if p.default is p.empty:
                self.data_params.append(p.name)
            else:
                self.defaults[p.name] = p.default
        unknown = sorted(set(self.models) - set(self.signature.parameters))
        if unknown:
            raise PlannerError(f"{where}: models {', '.join(map(repr, unknown))} are not arguments of the function",
                               hint=f"its arguments: {', '.join(self.signature.parameters)}")
        if not self.models:
            raise PlannerError(f"{where}: no model arguments", hint="name the models in models={'actor': ...}")
        bad = sorted((set(self.input_shapes) | set(self.data)) - set(self.data_params))
        if bad:
            raise PlannerError(f"{where}: inputs= or data= names {', '.join(map(repr, bad))}, which are not data "
                               "arguments",
                               hint=f"data arguments: {', '.join(self.data_params) or 'none'}")

    # Tracing ----------------------------------------------------------------------------------

    def _invoke(self, values: dict[str, Any]) -> Any:
        """Call the user's function with every argument given by name in `values`."""
        args, kwargs = [], {}
        for p in self.signature.parameters.values():
            if p.kind == p.POSITIONAL_ONLY:
                args.append(values[p.name])
            else:
                kwargs[p.name] = values[p.name]
        return self.fn(*args, **kwargs)

    def trace(self, constants: dict[str, Any] | None = None) -> GraphSpec:
        """The graph of one iteration, traced once, with the plain arguments `constants` of the
        first call (default: the function's defaults). Later iterations must make the same calls
        and host steps, whatever their plain arguments (`runtime.session` checks it)."""
        if self._traced is not None:
            return self._traced
        constants = {**self.defaults, **(constants or {})}
        g = GraphBuilder(self.name, algorithm=self.algorithm, **self.shape)  # type: ignore[arg-type]
        tracer = Tracer(g)
        values: dict[str, Any] = dict(constants)
        for param, decl in self.models.items():
            values[param] = TracedModel(tracer, g.model(param, decl.spec, trainable=decl.trainable, head=decl.head,
                                                        weights=decl.weights))
        for param in self.data_params:
            seqs, seq_len = self.input_shapes.get(param, (None, None))
            values[param] = TracedData(tracer, g.input(param, seqs=seqs, seq_len=seq_len, **self.data.get(param, {})),
                                       producer_kind=None)
        filename = self.fn.__code__.co_filename
        try:
            self._invoke(values)
        except PlannerError:
            raise
        except Exception as e:  # the loop's own code failed while traced: show where, in the user's file
            raise PlannerError(f"{traceback_location(e, filename=filename)}: the loop {self.fn.__qualname__} raised "
                               f"{type(e).__name__} while traced: {e}") from None
        finally:
            tracer.open = False
        self._traced = g.build()
        return self._traced

    def cluster(self) -> ClusterSpec:
        """The cluster the loop is planned for."""
        return resolve_cluster(self.cluster_arg)

    def source_hash(self, graph: GraphSpec | None = None) -> str:
        """`plan_hash` of the traced loop (or `graph`) with this decorator's cluster and options."""
        return plan_hash(graph or self.trace(), cluster=self.cluster(), baseline=self.baseline,
                         calibration_sha256=file_sha256(self.calibration), galore=self.galore)

    def compile(self) -> tuple[Plan, bool]:
        """(the loop's plan, reused or compiled and written; whether it was compiled), in this process."""
        graph = self.trace()
        return ensure_plan(graph, cluster=self.cluster(), path=self.plan_path, digest=self.source_hash(graph),
                           time_limit_s=self.time_limit_s, baseline=self.baseline, calibration=self.calibration,
                           galore=self.galore, say=self._say)

    def _say(self, message: str) -> None:
        if self.verbose:
            print(message, file=sys.stderr, flush=True)

    # Running ----------------------------------------------------------------------------------

    def _bind(self, args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """(plain arguments, data given by the caller) of one call."""
        try:
            bound = self.signature.bind_partial(*args, **kwargs)
        except TypeError as e:
            raise PlannerError(f"{self.fn.__qualname__}(): {e}") from None
        given = [k for k in bound.arguments if k in self.models]
        if given:
            raise PlannerError(f"{self.fn.__qualname__}(): models {', '.join(map(repr, given))} are given by "
                               "@planner.auto, not by the caller", hint="call it without its model arguments")
        constants = {k: v for k, v in bound.arguments.items() if k in self.defaults}
        data = {k: v for k, v in bound.arguments.items() if k in self.data_params}
        return constants, data

    def _plan_everywhere(self, graph: GraphSpec) -> Plan:
        """The plan on every rank: rank 0 reuses or compiles it and sends it to the others (which
        may not share its file system); an error there is raised on every rank."""
        launch = self._launch
        if not launch.distributed:
            return self.compile()[0]
        if launch.rank == 0:
            outcome: tuple[str, str, str | None, str] = ("error", "rank 0 stopped while making the plan", None,
                                                         code_fingerprint())
            try:
                plan, _ = self.compile()
                outcome = ("ok", plan_to_json(plan), None, code_fingerprint())
            except PlannerError as e:
                outcome = ("error", e.message, e.hint, code_fingerprint())
                raise
            finally:
                launch.share(outcome)
            return plan
        status, text, hint, code = launch.share(None)
        if status != "ok":
            raise PlannerError(f"rank 0 could not make the plan: {text}", hint=hint)
        plan = parse_plan(text, source=f"the plan rank 0 sent ({self.plan_path})")
        if code != code_fingerprint():
            raise PlannerError(f"rank {launch.rank} runs another version of planner than rank 0 (its plans/, "
                               f"cost_models/ and planner/ hash to {code_fingerprint()[:12]}, rank 0's to {code[:12]})",
                               hint="install the same planner on every node")
        if plan.source_hash != self.source_hash(graph):
            raise PlannerError(f"rank {launch.rank} traced another loop than rank 0",
                               hint="every rank must run the same program with the same arguments")
        return plan

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run one iteration of the loop on its plan (see the module docstring)."""
        constants, data = self._bind(args, kwargs)
        graph = self.trace(constants)
        if self._session is None:
            from runtime.session import Session, launch

            if self._launch is None:
                self._launch = launch()
                if not self._exit_hook:
                    atexit.register(self.close)
                    self._exit_hook = True
            plan = self._plan_everywhere(graph)
            # The loop's own decorator names the reward function: a plan file naming another is refused.
            self._session = Session(plan, launch=self._launch, seed=self.seed, reward_fn=graph.algorithm.reward_fn)
        values = {**self.defaults, **constants}
        value, self._metrics = self._session.run(lambda handles: self._invoke({**values, **handles}),
                                                 models={p: p for p in self.models}, data_params=self.data_params,
                                                 data=data)
        return value

    @property
    def last_metrics(self) -> dict[str, float | int]:
        """The last iteration's metrics (complete on rank 0; empty before the first call)."""
        return dict(self._metrics)

    def close(self) -> None:
        """Release the runtime: models, and the process group if the first call created it."""
        self._session = None
        if self._launch is not None:
            self._launch.close()
            self._launch = None

    def __repr__(self) -> str:
        return f"<planner.auto {self.fn.__qualname__} -> {self.plan_path}>"


def auto(*, cluster: str | ClusterSpec | dict[str, Any], models: dict[str, ModelArg], plan: str | Path | None = None,
         batch: int, **options: Any) -> Callable[[Callable], AutoFunction]:
    """Decorate a training-loop function to trace, plan and run it (see the module docstring).

    Args:
        cluster: where it runs (``"a100-80gb:2x8"``, a cluster file, or a spec).
        models: argument name -> model: a spec (a frozen LM) or `planner.model(spec, trainable=...,
            head=...)`; a spec that is an HF model directory starts from its weights.
        plan: the plan file, reused while the loop is unchanged [default: plans/<name>.json,
            relative to the working directory].
        batch: prompts (or sequences) per iteration; with `prompt_len`, `gen_len` or `seq_len` as
            in `planner.Graph`, and `inputs={"name": (seqs, seq_len)}` for other data shapes;
            `data={"prompts": {"data": "train.jsonl", "key": "prompt", ...}}` draws a data argument
            from a dataset (the keywords of `planner.Graph.input`).
        options: `name`, `prompt_len`, `gen_len`, `seq_len`, `inputs`, `data`, `algorithm` (the runtime's
            hyperparameters and data `task`, as `AlgorithmConfig`), `seed` (weights, data and
            sampling; default 0), `time_limit_s` (search budget; default 10), `baseline`,
            `calibration`, `galore` (let train calls use a GaLore optimizer where memory binds, e.g.
            ``{"rank": 128}``; as ``planner compile --galore-rank``), `verbose` (say on stderr whether the
            plan was reused or compiled).
    """
    def wrap(fn: Callable) -> AutoFunction:
        return AutoFunction(fn, cluster=cluster, models=models, plan=plan, batch=batch, **options)

    return wrap
