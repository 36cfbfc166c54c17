"""The graph-building API: declare models, make calls on them, and let the data define the edges.

    g = Graph("ppo", batch=512, prompt_len=1024, gen_len=1024)
    actor = g.model("actor", "llama-2-7b", trainable=True)
    ref = g.model("ref", "llama-2-7b")
    prompts = g.input("prompts")
    samples = actor.generate(prompts)              # -> handle "actor_generate.samples"
    ref_lp = ref.inference(samples)                # -> handle "ref_inference.logprobs"
    actor.train(samples, ref_lp, loss="grpo")
    graph = g.build()                              # a validated plans.Graph

Each call takes data handles (or handle names) and returns a new handle; sequence counts and
lengths flow from the inputs (a generate call appends ``gen_len`` tokens and multiplies the
sequences by ``samples_per_prompt``). `build` validates everything and raises a `PlannerError`
that names the call, model or handle at fault.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from plans.datafile import count_rows, data_format
from plans.errors import PlannerError, format_validation_error
from plans.graph import (
    AlgorithmConfig,
    Call,
    CallKind,
    DataInput,
    DataSource,
    Head,
    HostStep,
    Loss,
    ModelDecl,
    Returns,
    unique_name,
)
from plans.graph import Graph as GraphSpec
from plans.model import ModelSpec, resolve_model, weights_directory


@dataclass(frozen=True)
class Data:
    """A named data handle and the shape of what it holds."""

    name: str
    seqs: int
    seq_len: int

    def __str__(self) -> str:
        return self.name


def _check_count(what: str, value: Any) -> None:
    """A positive whole number, or a `PlannerError` naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlannerError(f"{what} must be a whole number, got {value!r}")
    if value < 1:
        raise PlannerError(f"{what} must be at least 1, got {value}")


def _response_len(value: Any) -> dict[str, Any] | None:
    """`generate(response_len=...)`: a mean (a number) or measured lengths (whole numbers)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"mean": float(value)}
    if isinstance(value, (list, tuple)):
        return {"samples": tuple(value)}
    raise PlannerError(f"response_len must be a mean (a number) or measured lengths (a list of whole numbers), "
                       f"got {type(value).__name__}")


def _algorithm(algorithm: Any, *, graph: str) -> AlgorithmConfig:
    if isinstance(algorithm, AlgorithmConfig):
        return algorithm
    if algorithm is not None and not isinstance(algorithm, dict):
        raise PlannerError(f"graph {graph!r}: algorithm must be a dict of AlgorithmConfig fields, got {algorithm!r}")
    try:
        return AlgorithmConfig.model_validate(algorithm or {})
    except ValidationError as e:
        raise PlannerError(format_validation_error(e, source=f"graph {graph!r}: algorithm")) from None


class Graph:
    """Builder of one iteration's dataflow graph."""

    def __init__(self, name: str, *, batch: int, prompt_len: int | None = None, gen_len: int | None = None,
                 seq_len: int | None = None, algorithm: AlgorithmConfig | dict[str, Any] | None = None) -> None:
        if not isinstance(name, str):
            raise PlannerError(f"a graph name must be a string, got a {type(name).__name__}")
        _check_count(f"graph {name!r}: batch", batch)
        for what, value in (("prompt_len", prompt_len), ("gen_len", gen_len), ("seq_len", seq_len)):
            if value is not None:
                _check_count(f"graph {name!r}: {what}", value)
        self.name = name
        self.batch = batch
        self.prompt_len = prompt_len
        self.gen_len = gen_len
        self.seq_len = seq_len
        self.algorithm = _algorithm(algorithm, graph=name)
        self._models: dict[str, ModelDecl] = {}
        self._inputs: dict[str, DataInput] = {}
        self._calls: list[Call] = []
        self._host_steps: list[HostStep] = []
        self._handles: dict[str, Data] = {}

    # Declarations -------------------------------------------------------------------------

    def model(self, name: str, spec: str | ModelSpec | dict[str, Any], *, trainable: bool = False,
              head: Head = "lm", weights: str | None = None) -> ModelHandle:
        """Declare a model; `spec` is a preset name, a config.json path, inline fields or a spec, or
        an HF model directory, whose weights the model then starts from (`plans.model.weights_directory`)."""
        if not isinstance(name, str):
            raise PlannerError(f"graph {self.name!r}: a model name must be a string, got a {type(name).__name__}")
        if name in self._models:
            raise PlannerError(f"graph {self.name!r}: model {name!r} is declared twice")
        if head not in ("lm", "value"):
            raise PlannerError(f"model {name!r}: head must be 'lm' or 'value', got {head!r}")
        if not isinstance(trainable, bool):
            raise PlannerError(f"model {name!r}: trainable must be True or False, got {trainable!r}")
        self._models[name] = ModelDecl(spec=resolve_model(spec), trainable=trainable, head=head,
                                       weights=weights or weights_directory(spec))
        return ModelHandle(self, name)

    def input(self, name: str, *, seqs: int | None = None, seq_len: int | None = None, data: str | None = None,
              key: str = "prompt", response_key: str | None = None, chosen_key: str | None = None,
              rejected_key: str | None = None, extra_keys: list[str] | tuple[str, ...] = (),
              tokenizer: str | None = None, chat_template: bool = True, shuffle: bool = True,
              truncation: str = "error") -> Data:
        """A handle the data loader provides: `seqs` sequences (default: batch) of `seq_len` tokens
        (default: prompt_len, else seq_len).

        With `data` (a .jsonl or .parquet file) the rows come from that dataset (`plans.graph.
        DataSource`): `key` names the prompt column, `response_key` (SFT), `chosen_key` and
        `rejected_key` (DPO) the others, `extra_keys` the columns the reward function gets;
        `tokenizer` is an HF model directory (default: the first model declared from a directory
        with a tokenizer.json)."""
        for what, value in (("seqs", seqs), ("seq_len", seq_len)):
            if value is not None:
                _check_count(f"input {name!r}: {what}", value)
        length = seq_len or self.prompt_len or self.seq_len
        if length is None:
            raise PlannerError(f"input {name!r}: give seq_len= (the graph has neither prompt_len nor seq_len)")
        if name in self._inputs or name in self._handles:
            raise PlannerError(f"graph {self.name!r}: data handle {name!r} is defined twice")
        source = None if data is None else self._data_source(
            name, data, key=key, response_key=response_key, chosen_key=chosen_key, rejected_key=rejected_key,
            extra_keys=list(extra_keys), tokenizer=tokenizer, chat_template=chat_template, shuffle=shuffle,
            truncation=truncation)
        try:
            self._inputs[name] = DataInput(name=name, seqs=seqs or self.batch, seq_len=length, data=source)
        except ValidationError as e:
            raise PlannerError(format_validation_error(e, source=f"input {name!r}")) from None
        handle = Data(name, seqs or self.batch, length)
        self._handles[name] = handle
        return handle

    def _data_source(self, name: str, path: str, *, tokenizer: str | None, **fields: Any) -> DataSource:
        """The dataset of input `name`, with its file's absolute path, format and row count."""
        where = f"input {name!r}"
        if not isinstance(path, str):
            raise PlannerError(f"{where}: data must be a file path, got a {type(path).__name__}")
        if tokenizer is None:
            tokenizer = next((d.weights for d in self._models.values()
                              if d.weights is not None and (Path(d.weights) / "tokenizer.json").is_file()), None)
        if tokenizer is None:
            raise PlannerError(f"{where} reads dataset {path!r}, but no model of the graph comes from a directory with "
                               "a tokenizer.json", hint="declare the models from their HF directories, or give "
                               "tokenizer=DIR")
        tok_dir = Path(tokenizer)
        if not (tok_dir / "tokenizer.json").is_file():
            raise PlannerError(f"{where}: tokenizer directory {tokenizer!r} has no tokenizer.json")
        absolute = str(Path(path).resolve())
        try:
            return DataSource(path=absolute, format=data_format(path), tokenizer=str(tok_dir.resolve()),
                              rows=count_rows(absolute), prompt_key=fields.pop("key"), **fields)
        except ValidationError as e:
            raise PlannerError(format_validation_error(e, source=f"{where}'s dataset")) from None

    def handle(self, name: str) -> Data:
        if name not in self._handles:
            raise PlannerError(f"graph {self.name!r}: no data handle named {name!r} yet")
        return self._handles[name]

    # Calls (used through ModelHandle) ------------------------------------------------------

    def _unique_call_name(self, base: str) -> str:
        return unique_name(base, {c.name for c in self._calls} | {s.name for s in self._host_steps})

    def host_step(self, name: str, *, function: str, source_sha256: str, inputs: list[Data],
                  outputs: list[str]) -> list[Data]:
        """Record a host step (`planner.host`) reading `inputs` and writing one handle per entry of
        `outputs` (named ``<step>.<output>``). The search sees no cost in it; its outputs take the
        shape of its first input, so a call reading one knows its sequence count and length."""
        if not inputs:
            raise PlannerError(f"host step {name!r} reads no data handle")
        step = unique_name(name, {s.name for s in self._host_steps} | {c.name for c in self._calls})
        out_names = [f"{step}.{o}" for o in outputs]
        try:
            spec = HostStep(name=step, function=function, source_sha256=source_sha256,
                            inputs=[d.name for d in inputs], outputs=out_names)
        except ValidationError as e:
            raise PlannerError(format_validation_error(e, source=f"host step {step!r}")) from None
        self._host_steps.append(spec)
        made = [Data(h, inputs[0].seqs, inputs[0].seq_len) for h in out_names]
        self._handles.update({d.name: d for d in made})
        return made

    def _add_call(self, *, model: str, kind: CallKind, inputs: tuple[Data | str, ...], name: str | None,
                  output: str | None, default_output: str, seqs: int | None = None, seq_len: int | None = None,
                  **fields: Any) -> Data:
        call_name = name or self._unique_call_name(f"{model}_{kind}")
        in_names = [str(d) for d in inputs]
        first = next((d for d in inputs if isinstance(d, Data)), None)
        if first is None and in_names and in_names[0] in self._handles:
            first = self._handles[in_names[0]]
        if seqs is None or seq_len is None:
            if first is None:
                raise PlannerError(f"call {call_name!r}: its first input must be a data handle with a known shape")
            seqs = seqs or first.seqs
            seq_len = seq_len or first.seq_len
        out_name = output or f"{call_name}.{default_output}"
        try:
            call = Call(name=call_name, model=model, kind=kind, inputs=in_names, outputs=[out_name],
                        seqs=seqs, seq_len=seq_len, **fields)
        except ValidationError as e:
            raise PlannerError(format_validation_error(e, source=f"call {call_name!r}")) from None
        self._calls.append(call)
        data = Data(out_name, call.seqs if kind != "train" else 1, call.seq_len)
        self._handles[out_name] = data
        return data

    # Result ---------------------------------------------------------------------------------

    def build(self) -> GraphSpec:
        """The validated graph; a `PlannerError` names every problem found."""
        if not self._calls:
            raise PlannerError(f"graph {self.name!r} has no calls")
        try:
            return GraphSpec(name=self.name, models=self._models, inputs=list(self._inputs.values()),
                             calls=self._calls, algorithm=self.algorithm, host_steps=self._host_steps)
        except ValidationError as e:
            raise PlannerError(format_validation_error(e, source=f"graph {self.name!r}")) from None


class ModelHandle:
    """A declared model; its methods record calls on the graph."""

    def __init__(self, graph: Graph, name: str) -> None:
        self.graph = graph
        self.name = name

    @property
    def decl(self) -> ModelDecl:
        return self.graph._models[self.name]

    def generate(self, prompts: Data | str, *, gen_len: int | None = None, samples_per_prompt: int = 1,
                 temperature: float = 1.0, name: str | None = None, output: str | None = None,
                 response_len: float | Sequence[int] | None = None) -> Data:
        """Sample `gen_len` tokens (default: the graph's) for each prompt, `samples_per_prompt` times.

        The output handle holds the full sequences and the log-probs of the sampled tokens.
        `response_len`, for the cost only: the mean tokens a response really has, or measured
        lengths (default: every response runs to gen_len)."""
        g = self.graph
        if gen_len is not None:
            _check_count(f"generate on {self.name!r}: gen_len", gen_len)
        _check_count(f"generate on {self.name!r}: samples_per_prompt", samples_per_prompt)
        gen = gen_len or g.gen_len
        if gen is None:
            raise PlannerError(f"generate on {self.name!r}: give gen_len= (the graph has no gen_len)")
        src = prompts if isinstance(prompts, Data) else g.handle(prompts)
        return g._add_call(model=self.name, kind="generate", inputs=(src,), name=name, output=output,
                           default_output="samples", seqs=src.seqs * samples_per_prompt,
                           seq_len=src.seq_len + gen, gen_len=gen, samples_per_prompt=samples_per_prompt,
                           temperature=temperature, response_len=_response_len(response_len))

    def inference(self, *inputs: Data | str, returns: Returns | None = None, name: str | None = None,
                  output: str | None = None) -> Data:
        """A forward pass over the first input's sequences: per-token log-probs (LM head), values
        (value head) or one score per sequence (``returns="scores"``)."""
        ret: Returns = returns or ("logprobs" if self.decl.head == "lm" else "values")
        return self.graph._add_call(model=self.name, kind="inference", inputs=inputs, name=name, output=output,
                                    default_output=ret, returns=ret)

    def train(self, *inputs: Data | str, loss: Loss, minibatches: int = 1, lr: float | None = None,
              name: str | None = None, output: str | None = None) -> Data:
        """One iteration's optimizer steps (`minibatches` of them) over the first input's sequences."""
        return self.graph._add_call(model=self.name, kind="train", inputs=inputs, name=name, output=output,
                                    default_output="stats", loss=loss, minibatches=minibatches, lr=lr)
