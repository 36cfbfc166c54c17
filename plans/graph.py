"""The dataflow graph of one training iteration: models, the calls made on them, data edges.

A call reads named data handles and writes new ones; an edge runs from the call that writes a
handle to every call that reads it. Handles no call writes must be graph inputs (what the data
loader provides, e.g. ``prompts``). The graph is built with `planner.Graph` or an algorithm from
`planner.algorithms`, or traced from a training loop by `planner.auto`; this module only holds
its validated, serialisable form.

A traced loop also has *host steps*: Python functions of the loop (advantages, rewards, logging)
that read handles and write new ones between calls. They are dataflow glue, not search calls: a
call reading a host step's output depends on the calls that wrote the step's inputs (`edges`
resolves through host steps), and the runtime runs them as written, on every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, model_validator

from plans.base import Strict, validated
from plans.model import MAX_POSITIONS, Head, ModelSpec

CallKind = Literal["generate", "inference", "train"]
Loss = Literal["sft", "dpo", "ppo_policy", "ppo_value", "grpo", "rloo", "remax"]
Returns = Literal["logprobs", "values", "scores"]
AlgorithmName = Literal["sft", "dpo", "ppo", "grpo", "remax", "rloo", "custom"]

# Reward functions built into the runtime (`runtime.trusted`): a plan may name them without the
# launch naming them too, as they are part of the runtime, looked up, never imported by name.
BUILTIN_REWARDS = ("runtime.tasks:pattern_reward",)

# Far beyond any real iteration (2**24 sequences of 2**24 tokens); keeps every count the cost model
# derives finite and every enumeration over divisors short.
MAX_SEQS = 2**24

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{kind} name {name!r} must start with a letter or '_' and use letters, digits, '_', '.', '-'")
    return name


def unique_name(base: str, taken: set[str] | list[str]) -> str:
    """`base`, or `base_2`, `base_3`, ... : the first not in `taken` (how calls and host steps
    without an explicit name are named, by the graph builder and again by the runtime)."""
    if base not in taken:
        return base
    k = 2
    while f"{base}_{k}" in taken:
        k += 1
    return f"{base}_{k}"


class ModelDecl(Strict):
    """A model of the graph: its architecture, whether it trains, and its output head."""

    spec: ModelSpec
    trainable: bool = Field(False, description="Holds optimizer state and may be the target of a train call.")
    head: Head = Field("lm", description="'lm' (next-token logits) or 'value' (one scalar per token).")
    weights: str | None = Field(None, max_length=4096, description="Absolute path of a local HF model directory "
                                "whose safetensors hold the initial weights (a value head it lacks starts fresh); "
                                "None: seeded random initialisation.")
    expert_load_cv: float = Field(0.0, ge=0.0, le=10.0, description="Mixture-of-experts models: how unevenly the "
                                  "router loads its experts beyond chance, as the coefficient of variation of one "
                                  "expert's share (0: only the binomial spread of tokens; measure it from a run's "
                                  "routing counts). The busiest expert-parallel rank bounds each sparse layer.")


MAX_LENGTH_SAMPLES = 4096


class ResponseLengths(Strict):
    """How long a generate call's responses really are, for its cost: `gen_len` is only the cap.
    Either the `mean` (lengths are then taken as geometric, a constant chance of stopping at each
    token, capped at gen_len) or measured `samples` (one length per response, e.g. from a previous
    run). The longest response of a batch sets how many decode steps it takes."""

    mean: float | None = Field(None, ge=1, le=MAX_POSITIONS, description="Mean generated tokens per response.")
    samples: tuple[int, ...] = Field((), max_length=MAX_LENGTH_SAMPLES,
                                     description="Measured generated tokens of responses (each 1..gen_len).")
    source: str | None = Field(None, max_length=4096, description="Where the figures came from (display only).")

    @model_validator(mode="after")
    def check_one(self) -> ResponseLengths:
        if (self.mean is None) == (not self.samples):
            raise ValueError("give either mean or samples of the response lengths")
        if any(n < 1 for n in self.samples):
            raise ValueError(f"response length samples must be at least 1 token, got {min(self.samples)}")
        return self


class Call(Strict):
    """One generate, inference or train call on a model, with the work it does per iteration."""

    name: str = Field(description="Unique call name.")
    model: str = Field(description="Name of the model the call runs on.")
    kind: CallKind
    inputs: list[str] = Field(default_factory=list, description="Data handles read.")
    outputs: list[str] = Field(default_factory=list, description="Data handles written.")
    seqs: int = Field(ge=1, le=MAX_SEQS, description="Sequences processed per iteration.")
    seq_len: int = Field(ge=1, le=MAX_POSITIONS, description="Tokens per sequence (prompt + generated for generate).")
    gen_len: int = Field(0, ge=0, le=MAX_POSITIONS, description="generate: new tokens per sequence.")
    samples_per_prompt: int = Field(1, ge=1, le=MAX_SEQS, description="generate: samples drawn per prompt (seqs counts samples).")
    temperature: float = Field(1.0, ge=0, description="generate: sampling temperature; 0 is greedy.")
    response_len: ResponseLengths | None = Field(None, description="generate: how long responses really are "
                                                 "(None: every response runs to gen_len).")
    returns: Returns | None = Field(None, description="inference: per-token logprobs, per-token values, or one score per sequence.")
    loss: Loss | None = Field(None, description="train: the loss optimised.")
    minibatches: int = Field(1, ge=1, le=MAX_SEQS, description="train: optimizer steps per call (the batch splits evenly).")
    lr: float | None = Field(None, gt=0, description="train: learning rate (default: the algorithm's).")

    @model_validator(mode="after")
    def check_names(self) -> Call:
        check_name("call", self.name)
        for h in (*self.inputs, *self.outputs):
            check_name("data handle", h)
        return self

    @model_validator(mode="after")
    def check_generate_fields(self) -> Call:
        if self.kind == "generate":
            if not 0 < self.gen_len < self.seq_len:
                raise ValueError(f"call {self.name!r}: generate needs 0 < gen_len < seq_len")
            if self.seqs % self.samples_per_prompt:
                raise ValueError(f"call {self.name!r}: seqs {self.seqs} is not a multiple of samples_per_prompt")
            r = self.response_len
            longest = (max(r.samples) if r.samples else r.mean or 0) if r is not None else 0
            if longest > self.gen_len:
                raise ValueError(f"call {self.name!r}: response lengths up to {longest:g} exceed gen_len "
                                 f"{self.gen_len}, the most a response can have")
        elif self.gen_len or self.samples_per_prompt != 1 or self.response_len is not None:
            raise ValueError(f"call {self.name!r}: gen_len, samples_per_prompt and response_len apply to generate "
                             "calls only")
        return self

    @model_validator(mode="after")
    def check_train_fields(self) -> Call:
        if self.kind == "train":
            if self.loss is None:
                raise ValueError(f"call {self.name!r}: a train call needs a loss")
            if self.seqs % self.minibatches:
                raise ValueError(f"call {self.name!r}: seqs {self.seqs} does not split into {self.minibatches} minibatches")
        elif self.loss is not None or self.minibatches != 1 or self.lr is not None:
            raise ValueError(f"call {self.name!r}: loss, minibatches and lr apply to train calls only")
        return self

    @model_validator(mode="after")
    def check_returns_on_inference(self) -> Call:
        if (self.returns is None) != (self.kind != "inference"):
            raise ValueError(f"call {self.name!r}: 'returns' is required on inference calls and only there")
        return self

    @property
    def prompt_len(self) -> int:
        return self.seq_len - self.gen_len

    @property
    def step_seqs(self) -> int:
        """Sequences processed together: one optimizer step's share of a train call (`seqs` over
        `minibatches`), all of a generate or inference call. Data-parallel ranks and micro-batches
        split this number, so every layout's degrees must divide it."""
        return self.seqs // self.minibatches if self.kind == "train" else self.seqs

    @property
    def tokens(self) -> int:
        """Tokens per iteration (prompt and generated)."""
        return self.seqs * self.seq_len


class HostStep(Strict):
    """A Python function a traced training loop runs on the host between calls (`planner.host`).

    Its identity is the function's qualified name and the hash of its source, so an edited
    function is a different step (and a new plan). Arguments that are not data handles are not
    part of it: they may change from one iteration to the next (a step number, a coefficient)."""

    name: str = Field(description="Unique step name (distinct from call names).")
    function: str = Field(description="The function's qualified name (Python `__qualname__`).")
    source_sha256: str = Field(description="SHA-256 of the function's source text.")
    inputs: list[str] = Field(min_length=1, description="Data handles read, in argument order.")
    outputs: list[str] = Field(min_length=1, description="Data handles written.")

    @model_validator(mode="after")
    def check_names(self) -> HostStep:
        check_name("host step", self.name)
        for h in (*self.inputs, *self.outputs):
            check_name("data handle", h)
        return self


class AlgorithmConfig(Strict):
    """Which algorithm the graph implements and the hyperparameters of its host-side glue."""

    name: AlgorithmName = "custom"
    lr: float = Field(1e-5, gt=0, description="Default learning rate of train calls.")
    adam_eps: float = Field(1e-8, gt=0, description="Adam epsilon of train calls (PPO implementations commonly use 1e-5).")
    kl_coef: float = Field(0.05, ge=0, description="PPO/GRPO: weight of the KL penalty to the reference.")
    clip_eps: float = Field(0.2, gt=0, description="PPO/GRPO: policy ratio clip.")
    value_clip_eps: float = Field(0.2, gt=0, description="PPO: value clip.")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount.")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda.")
    dpo_beta: float = Field(0.1, gt=0, description="DPO: inverse temperature.")
    reward_fn: str | None = Field(None, max_length=300, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
                                  description="'module:function' scoring generated tokens instead of a reward model; "
                                  "the runtime runs it only when the launch names it too (--reward-fn).")
    task: str | None = Field(None, description="Runtime data source, e.g. a toy task name; None is random prompts.")
    stop: list[str] = Field(default_factory=list, max_length=16,
                            description="generate, on a dataset's prompts: a response also ends at the first of "
                            "these strings (kept in it), as it does at EOS.")


DATA_KINDS = ("prompts", "tokens", "pairs")  # what an input of each name holds (see DataSource)


class DataSource(Strict):
    """A dataset file an input is drawn from, and how its rows become tokens.

    What a row becomes depends on the input's name: ``prompts`` (RL: the `prompt_key` text, chat
    template applied, left-padded to the input's length), ``tokens`` (SFT: prompt then
    `response_key`, right-padded, the response tokens and EOS masked in), ``pairs`` (DPO: the prompt
    then `chosen_key`, and then `rejected_key`, as two consecutive sequences). Rows are drawn in a
    seeded random order per epoch, a pure function of (seed, step), so every rank, the reference
    and a resumed run draw the same rows."""

    path: str = Field(max_length=4096, description="Absolute path of a .jsonl or .parquet file.")
    format: Literal["jsonl", "parquet"]
    tokenizer: str = Field(max_length=4096, description="HF model directory whose tokenizer.json tokenizes the rows.")
    prompt_key: str = Field("prompt", min_length=1, max_length=200)
    response_key: str | None = Field(None, max_length=200, description="SFT: the response column.")
    chosen_key: str | None = Field(None, max_length=200, description="DPO: the preferred response column.")
    rejected_key: str | None = Field(None, max_length=200, description="DPO: the other response column.")
    extra_keys: list[str] = Field(default_factory=list, max_length=64,
                                  description="Columns passed to the reward function (e.g. ground_truth).")
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template to prompts when it has one.")
    shuffle: bool = Field(True, description="A new seeded order every epoch (else the file's order).")
    truncation: Literal["error", "left"] = Field(
        "error", description="A row longer than the input: an error naming it, or keep its last tokens.")
    rows: int = Field(ge=1, description="Rows in the file when the plan was compiled (checked at run time).")


class DataInput(Strict):
    """A handle the data loader provides each iteration."""

    name: str
    seqs: int = Field(ge=1, le=MAX_SEQS, description="Sequences per iteration.")
    seq_len: int = Field(ge=1, le=MAX_POSITIONS, description="Tokens per sequence.")
    data: DataSource | None = Field(None, description="The dataset it is drawn from (None: the algorithm's task).")

    @model_validator(mode="after")
    def check_data_kind(self) -> DataInput:
        if self.data is None:
            return self
        if self.name not in DATA_KINDS:
            raise ValueError(f"input {self.name!r}: a dataset feeds an input named {', '.join(DATA_KINDS)} "
                             "(prompts for RL, tokens for SFT, pairs for DPO)")
        needs = {"tokens": ("response_key",), "pairs": ("chosen_key", "rejected_key")}.get(self.name, ())
        missing = [k for k in needs if getattr(self.data, k) is None]
        if missing:
            raise ValueError(f"input {self.name!r}: its dataset needs {', '.join(missing)}")
        return self


class Graph(Strict):
    """A validated dataflow graph of one iteration."""

    name: str
    models: dict[str, ModelDecl]
    inputs: list[DataInput] = Field(default_factory=list)
    calls: list[Call] = Field(min_length=1)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    host_steps: list[HostStep] = Field(default_factory=list,
                                       description="Python steps of a traced loop between calls, in program order.")

    @model_validator(mode="after")
    def check_dataflow(self) -> Graph:
        problems = graph_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def call(self, name: str) -> Call:
        for c in self.calls:
            if c.name == name:
                return c
        raise KeyError(name)

    def producers(self) -> dict[str, str]:
        """Handle -> name of the call that writes it."""
        return {h: c.name for c in self.calls for h in c.outputs}

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer call, consumer call, handle) for every data edge, in call order. A call
        reading a host step's output gets an edge from each call whose output the step reads,
        directly or through earlier steps, carrying that call's handle."""
        prod = self.producers()
        out: list[tuple[str, str, str]] = []
        for c in self.calls:
            derived: list[tuple[str, str, str]] = []
            for h in c.inputs:
                if h in prod:
                    out.append((prod[h], c.name, h))
                for src in self.host_sources(h):
                    if (prod[src], c.name, src) not in derived:
                        derived.append((prod[src], c.name, src))
            out.extend(e for e in derived if e not in out)
        return out

    def host_sources(self, handle: str) -> list[str]:
        """The call outputs a host step's output `handle` is computed from (through earlier host
        steps); [] for a handle no host step writes."""
        steps = {h: s for s in self.host_steps for h in s.outputs}
        if handle not in steps:
            return []
        calls_out = self.producers()
        found: list[str] = []
        todo, seen = [handle], {handle}
        while todo:
            for h in steps[todo.pop(0)].inputs:
                if h in calls_out and h not in found:
                    found.append(h)
                elif h in steps and h not in seen:
                    seen.add(h)
                    todo.append(h)
        return found

    def home_calls(self) -> dict[str, str]:
        """Model -> its *home* call, whose placement holds the model's parameters (and optimizer
        state) between iterations: its last train call, else its first call, in dependency order.
        Every other call on the model works on a transient copy reallocated from the home, unless
        its placement holds the very same slices. Compiler and runtime both follow this rule."""
        home: dict[str, str] = {}
        for name in self.topo_order():
            c = self.call(name)
            if c.kind == "train" or c.model not in home:
                home[c.model] = name
        return home

    def topo_order(self) -> list[str]:
        """Call names in a dependency order; ties keep the declared order."""
        return _topo_order(self) or []


@dataclass(frozen=True)
class NamedCode:
    """A piece of code a graph (or plan) names, and what it takes for it to run."""

    kind: str  # "reward function" or "host step"
    name: str
    runs: str

    def line(self) -> str:
        return f"{self.kind} {self.name}: {self.runs}"


def named_code(g: Graph) -> list[NamedCode]:
    """Every piece of code a graph names (what `planner validate` and `planner show` list). A plan
    never makes the runtime import code by itself: a reward function runs only when the launch
    names it too (`runtime.trusted`), a host step only inside the loop that traced it."""
    out = []
    fn = g.algorithm.reward_fn
    if fn is not None:
        runs = "built into the runtime" if fn in BUILTIN_REWARDS else \
            f"imported and run on every rank only when the launch names it: python -m runtime ... --reward-fn {fn}"
        out.append(NamedCode("reward function", fn, runs))
    for s in g.host_steps:
        out.append(NamedCode("host step", s.name, f"Python function {s.function} (source SHA-256 {s.source_sha256[:12]}...) "
                             "of the traced loop; runs only in that loop's own program, never from the plan"))
    return out


def parse_graph(data: Any, *, source: str = "graph") -> Graph:
    """Validate a graph given as plain data (a dict, e.g. loaded from JSON), turning any problem
    into a `PlannerError` naming `source`."""
    return validated(Graph, data, source=source)


def _topo_order(g: Graph) -> list[str] | None:
    """Kahn's algorithm with declared-order tie breaks; None if there is a cycle."""
    names = [c.name for c in g.calls]
    preds: dict[str, set[str]] = {n: set() for n in names}
    for src, dst, _ in g.edges():
        preds[dst].add(src)
    done: list[str] = []
    remaining = list(names)
    while remaining:
        ready = next((n for n in remaining if preds[n] <= set(done)), None)
        if ready is None:
            return None
        done.append(ready)
        remaining.remove(ready)
    return done


def graph_problems(g: Graph) -> list[str]:
    """Every rule the graph breaks, as messages naming the call, model or handle involved."""
    problems: list[str] = []
    check_name("graph", g.name)
    seen: set[str] = set()
    for c in g.calls:
        if c.name in seen:
            problems.append(f"two calls are named {c.name!r}")
        seen.add(c.name)
    for name in g.models:
        check_name("model", name)
    for c in g.calls:
        if c.model not in g.models:
            problems.append(f"call {c.name!r} runs on unknown model {c.model!r} (models: {', '.join(g.models) or 'none'})")
            continue
        decl = g.models[c.model]
        if c.kind == "train" and not decl.trainable:
            problems.append(f"call {c.name!r} trains model {c.model!r}, which is frozen (declare it trainable=True)")
        if c.kind == "generate" and decl.head != "lm":
            problems.append(f"call {c.name!r} generates with model {c.model!r}, which has a value head, not an LM head")
        if c.returns == "logprobs" and decl.head != "lm":
            problems.append(f"call {c.name!r} asks log-probs of {c.model!r}, which has a value head")
        if c.returns in ("values", "scores") and decl.head != "value":
            problems.append(f"call {c.name!r} asks {c.returns} of {c.model!r}, which has an LM head")
    writers: dict[str, str] = {}
    input_names = {i.name for i in g.inputs}
    for c in g.calls:
        for h in c.outputs:
            if h in writers or h in input_names:
                problems.append(f"data handle {h!r} is written twice ({writers.get(h, 'graph input')!r} and {c.name!r})")
            writers[h] = c.name
    problems += _host_step_problems(g, writers, input_names)
    for c in g.calls:
        for h in c.inputs:
            if h not in writers and h not in input_names:
                problems.append(
                    f"call {c.name!r} reads {h!r}, which no call writes and the batch does not provide "
                    f"(inputs: {', '.join(sorted(input_names)) or 'none'})"
                )
    if not problems and _topo_order(g) is None:
        problems.append("the calls form a cycle: " + _cycle_text(g))
    return problems


def _host_step_problems(g: Graph, writers: dict[str, str], input_names: set[str]) -> list[str]:
    """Host steps: unique names apart from the calls', each reading handles that a call, the
    batch or an earlier step writes (steps are in program order, so they cannot form a cycle
    among themselves), and writing handles nothing else writes. Adds their outputs to `writers`."""
    problems: list[str] = []
    calls = {c.name for c in g.calls}
    seen: set[str] = set()
    for s in g.host_steps:
        if s.name in seen or s.name in calls:
            problems.append(f"host step {s.name!r}: another {'call' if s.name in calls else 'host step'} has that name")
        seen.add(s.name)
        for h in s.inputs:
            if h not in writers and h not in input_names:
                later = next((t.name for t in g.host_steps if h in t.outputs), None)
                why = f"written by the later host step {later!r} (steps are in program order)" if later else \
                    "which no call or earlier host step writes and the batch does not provide"
                problems.append(f"host step {s.name!r} reads {h!r}, {why}")
        for h in s.outputs:
            if h in writers or h in input_names:
                problems.append(f"data handle {h!r} is written twice ({writers.get(h, 'graph input')!r} and {s.name!r})")
            writers[h] = s.name
    return problems


def _cycle_text(g: Graph) -> str:
    succ: dict[str, list[str]] = {c.name: [] for c in g.calls}
    for src, dst, _ in g.edges():
        succ[src].append(dst)
    state: dict[str, int] = {}  # 1 on the DFS stack, 2 finished
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in succ[node]:
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (loop := visit(nxt)):
                return loop
        stack.pop()
        state[node] = 2
        return None

    for name in succ:
        if name not in state and (loop := visit(name)):
            return " -> ".join(loop)
    return "(not found)"
