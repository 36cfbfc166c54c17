"""The plan: the only contract between the compiler and the runtime.

A plan is the graph (models, calls, inputs, algorithm) plus, for every call, the mesh and layout it
runs with and its estimated start, duration and peak memory per rank; the parameter reallocations
between consecutive calls on a model; whole-iteration estimates; and how the plan was found. A
plan compiled from a traced loop (`planner.auto`) also lists the loop's host steps and the hash
of what it was compiled from (`source_hash`), so the loop reuses it while it is unchanged.
`PLAN_VERSION` changes whenever a reader of an older plan would misread a newer one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from plans.base import Strict, loads_json, validated
from plans.cluster import ClusterSpec
from plans.errors import PlannerError, brief
from plans.graph import AlgorithmConfig, Call, DataInput, Graph, HostStep, ModelDecl
from plans.io import write_text_atomic
from plans.layout import GaLore, Layout, Mesh
from plans.sharding import layout_problems

# The cost model's framework presets (`cost_models.framework.FRAMEWORKS`, which a test keeps equal).
FrameworkName = Literal["megatron", "megatron-core", "rlhf-engine", "rlhf-engine-hf", "verl-fsdp", "vllm", "torch"]

PLAN_VERSION = 1


class PlanCall(Call):
    """A call with its placement and estimates."""

    mesh: Mesh
    layout: Layout
    decode_layout: Layout | None = Field(
        None, description="generate: layout for the decode phase when it differs from prefill (same mesh)."
    )
    est_start_s: float = Field(ge=0, description="Estimated start within the steady-state iteration, s.")
    est_time_s: float = Field(ge=0, description="Estimated duration, s.")
    est_peak_mem_bytes: int = Field(ge=0, description="Estimated peak memory per rank during the call, bytes.")

    @model_validator(mode="after")
    def check_layout_fills_mesh(self) -> PlanCall:
        if self.layout.size != self.mesh.size:
            raise ValueError(
                f"call {self.name!r}: dp*tp*pp*cp = {self.layout.size} but the mesh has {self.mesh.size} ranks"
            )
        if self.decode_layout is not None:
            if self.kind != "generate":
                raise ValueError(f"call {self.name!r}: decode_layout applies to generate calls only")
            if self.decode_layout.size != self.mesh.size:
                raise ValueError(f"call {self.name!r}: decode_layout does not fill the mesh")
        return self


class Reallocation(Strict):
    """Parameters of `model` moving from the layout of `from_call` to that of `to_call`."""

    model: str
    from_call: str
    to_call: str
    bytes: int = Field(ge=0, description="Bytes sent between distinct ranks (local copies excluded).")
    est_start_s: float = Field(0.0, ge=0)
    est_time_s: float = Field(ge=0)


class DataTransfer(Strict):
    """A data handle moving from the call that writes it to one that reads it."""

    handle: str
    from_call: str
    to_call: str
    bytes: int = Field(ge=0)
    est_time_s: float = Field(ge=0)


class Estimate(Strict):
    """Whole-iteration estimates of the plan."""

    iteration_s: float = Field(ge=0, description="Steady-state time of one iteration, s.")
    tokens_per_s: float = Field(ge=0, description="Tokens processed by all calls per second.")
    mfu: float = Field(ge=0, description="Model FLOPs utilisation over the cluster (6N+attention convention).")
    peak_mem_bytes: int = Field(ge=0, description="Highest estimated memory on any rank, bytes.")
    costed_for: str | None = Field(None, description="The software stack the times are costed for, and what it was "
                                   "calibrated on.")
    framework: FrameworkName | None = Field(None, description="The cost model's framework preset "
                                            "(`cost_models.framework`) the estimates used; None: torch, the "
                                            "planner's runtime.")


# `SearchInfo.status` of a search whose beam-search plan already met its proven lower bound:
# optimal, and CP-SAT was not run (`planner.compile.search`).
BOUND_MET = "BOUND_MET"


class SearchInfo(Strict):
    """How the plan was found."""

    method: str = Field(description="Search method or baseline name.")
    wall_s: float | None = Field(None, ge=0, description="Search wall time, s (not reproducible; excluded from comparisons).")
    lower_bound_s: float | None = Field(None, ge=0, description="Proven lower bound on iteration_s, when known.")
    gap: float | None = Field(None, ge=0, description="(iteration_s - lower_bound_s) / iteration_s, when known.")
    candidates: int | None = Field(None, ge=0, description="(call, candidate) pairs considered.")
    status: str | None = Field(None, description="Solver status, e.g. OPTIMAL or FEASIBLE; \"relaxed S, placed S\" "
                               "when the search placed mesh sizes first, then positions; BOUND_MET when the beam "
                               "search's plan already met the lower bound (optimal; CP-SAT not run).")


class Plan(Strict):
    """A compiled execution plan."""

    version: int = Field(PLAN_VERSION, strict=True,
                         description=f"Schema version; this planner reads and writes {PLAN_VERSION}.")
    name: str
    cluster: ClusterSpec
    models: dict[str, ModelDecl]
    inputs: list[DataInput] = Field(default_factory=list)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    calls: list[PlanCall] = Field(min_length=1, description="Calls in execution order.")
    reallocations: list[Reallocation] = Field(default_factory=list)
    transfers: list[DataTransfer] = Field(default_factory=list)
    estimate: Estimate
    search: SearchInfo
    host_steps: list[HostStep] = Field(default_factory=list,
                                       description="A traced loop's Python steps between calls, in program order.")
    source_hash: str | None = Field(None, description="SHA-256 of the traced loop, cluster, models and compile "
                                    "options this plan was compiled from (`planner.auto`); None for graph files.")

    @field_validator("version")
    @classmethod
    def check_version(cls, v: int) -> int:
        if v != PLAN_VERSION:
            raise ValueError(f"plan version {v} is not supported (this planner reads version {PLAN_VERSION}); recompile it")
        return v

    @model_validator(mode="after")
    def check_graph(self) -> Plan:
        self.graph()  # raises with the graph's own messages
        return self

    @model_validator(mode="after")
    def check_placements(self) -> Plan:
        problems = placement_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def graph(self) -> Graph:
        """The dataflow graph this plan places."""
        calls = [Call(**{k: getattr(c, k) for k in Call.model_fields}) for c in self.calls]
        return Graph(name=self.name, models=self.models, inputs=self.inputs, calls=calls, algorithm=self.algorithm,
                     host_steps=self.host_steps)

    def call(self, name: str) -> PlanCall:
        for c in self.calls:
            if c.name == name:
                return c
        raise KeyError(name)

    def galore_call(self) -> PlanCall | None:
        """The first call that trains with a GaLore optimizer (`Layout.galore`), or None."""
        return next((c for c in self.calls if c.layout.galore is not None), None)


def placement_problems(plan: Plan) -> list[str]:
    """Placement rules a plan breaks: ranks outside the cluster, misaligned meshes, layouts that
    do not shard the model, tensor parallel across nodes, dangling reallocations."""
    problems = []
    cl = plan.cluster
    calls = {c.name: c for c in plan.calls}
    for c in plan.calls:
        if c.mesh.ranks[-1] >= cl.world_size:
            problems.append(f"call {c.name!r}: mesh {c.mesh.short()} exceeds the cluster's {cl.world_size} GPUs")
        if (why := c.mesh.alignment_error(cl.gpus_per_node)) is not None:
            problems.append(f"call {c.name!r}: mesh {c.mesh.short()} is not aligned: {why}")
        for lay in (c.layout, c.decode_layout):
            if lay is None:
                continue
            if cl.gpus_per_node % lay.tp:
                problems.append(f"call {c.name!r}: tp={lay.tp} does not fit inside a node of {cl.gpus_per_node} GPUs")
            if c.model in plan.models:
                for p in layout_problems(plan.models[c.model].spec, lay):
                    problems.append(f"call {c.name!r}: {p}")
    problems += offload_problems(plan)
    problems += galore_problems(plan)
    for r in plan.reallocations:
        for end in (r.from_call, r.to_call):
            if end not in calls:
                problems.append(f"reallocation of {r.model!r} names unknown call {end!r}")
            elif calls[end].model != r.model:
                problems.append(f"reallocation of {r.model!r} names call {end!r}, which runs on {calls[end].model!r}")
    return problems


def galore_problems(plan: Plan) -> list[str]:
    """Where a plan names a GaLore optimizer that no step would use, or two for one model: only a
    train call of a trainable model steps an optimizer, and every train call of a model steps
    the same one."""
    problems = []
    seen: dict[str, tuple[str, GaLore | None]] = {}
    for c in plan.calls:
        if c.decode_layout is not None and c.decode_layout.galore is not None:
            problems.append(f"call {c.name!r}: its decode layout names a GaLore optimizer; only a train call's layout may")
        g = c.layout.galore
        decl = plan.models.get(c.model)
        if c.kind != "train" or decl is None or not decl.trainable:
            if g is not None:
                problems.append(f"call {c.name!r} ({c.kind}) names a GaLore optimizer, which only a train call of a "
                                "trainable model steps; drop layout.galore")
            continue
        if c.model in seen and seen[c.model][1] != g:
            problems.append(f"calls {seen[c.model][0]!r} and {c.name!r} train {c.model!r} with different optimizers "
                            f"({_optimizer_name(seen[c.model][1])} and {_optimizer_name(g)}); give both the same "
                            "layout.galore")
        seen.setdefault(c.model, (c.name, g))
    return problems


def _optimizer_name(g: GaLore | None) -> str:
    return "AdamW" if g is None else g.short()


def offload_problems(plan: Plan) -> list[str]:
    """Where a plan offloads what is not there to offload: states wait in host memory between
    calls only for the call that keeps them (the model's home call); a train call's optimizer
    states, or the weights of a frozen model that no other call reads."""
    problems = []
    homes = plan.graph().home_calls()
    for c in plan.calls:
        if c.decode_layout is not None and c.decode_layout.offload != "none":
            problems.append(f"call {c.name!r}: its decode layout says offload={c.decode_layout.offload!r}; offload "
                            "belongs to the layout the call starts with")
        off = c.layout.offload
        if off == "none" or c.model not in plan.models:
            continue
        decl, home = plan.models[c.model], homes.get(c.model)
        if off == "optimizer" and (c.kind != "train" or not decl.trainable):
            problems.append(f"call {c.name!r} ({c.kind}) offloads optimizer states, which only a train call of a "
                            "trainable model has; use offload='none' (or 'weights' for a frozen model's only call)")
        elif home is not None and c.name != home and c.kind != "train":
            problems.append(f"call {c.name!r} offloads {off}, but {c.model!r} keeps its states with its home call "
                            f"{home!r}; only that call's layout may say offload")
        elif off == "weights":
            others = [o.name for o in plan.calls if o.model == c.model and o.name != c.name]
            if decl.trainable or others:
                why = "it is trainable" if decl.trainable else f"calls {', '.join(map(repr, others))} read them too"
                problems.append(f"call {c.name!r} offloads the weights of {c.model!r}, but {why}; weights offload "
                                "is for a frozen model's only call (offload a trainable model's optimizer instead)")
    return problems


def plan_to_json(plan: Plan) -> str:
    """Canonical JSON text of a plan (stable key order, two-space indent, trailing newline)."""
    return json.dumps(plan.model_dump(mode="json"), indent=2) + "\n"


def parse_plan(text: str, *, source: str = "plan") -> Plan:
    """Validate plan JSON text, turning any problem into a `PlannerError` naming `source`."""
    if not text.strip():
        raise PlannerError(f"{source} is empty", hint="compile a plan with `planner compile`")
    data: Any = loads_json(text, source=source)
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(data, dict) and "version" in data and (type(version) is not int or version != PLAN_VERSION):
        raise PlannerError(
            f"{source} has plan version {brief(version)}; this planner reads version {PLAN_VERSION}",
            hint="recompile the plan with this version of planner",
        )
    return validated(Plan, data, source=source)


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file."""
    where = brief(str(path))
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlannerError(f"cannot read plan {where}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise PlannerError(f"plan {where} is not a text (UTF-8) file: {e.reason} at byte {e.start}",
                           hint="a plan is the JSON file `planner compile` writes") from None
    except ValueError as e:  # e.g. a NUL byte in the path
        raise PlannerError(f"cannot read plan {where}: {e}") from None
    return parse_plan(text, source=str(path)[:200])


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write a plan atomically as canonical JSON."""
    write_text_atomic(path, plan_to_json(plan))
