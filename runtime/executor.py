"""Execute a plan's calls, step after step, on this rank.

Every rank walks `plan.calls` (execution order) and takes part in the events whose ranks include
it, so calls on disjoint meshes run at the same time:

1. *Parameters* (the compiler's semantics, `planner.compile.build_plan`). Each model has a *home*
   call, its last train call or else its first call; the home's (mesh, layout) holds the
   parameters, and the optimizer state of a trainable model, for the whole run. Another call on
   the model either holds exactly the home's slices (same mesh, tp, pp and interleave, the home
   not ZeRO-3) and runs on the resident parameters, or runs on a transient copy that
   `runtime.realloc` builds from the home placement just before it (the plan's `reallocations`
   list names it) and that is freed right after it.
2. *Data*. A call's outputs go, point to point, from its last stage to the ranks of the calls that
   read them (`runtime.dataflow`); a rank waits for a handle only when it runs a call reading it.
3. *Metrics*. Each call's leader sends its statistics and times to rank 0; every data-parallel
   replica of a train call sends its share of the loss statistics, which rank 0 sums (no
   collective on the training step's path).
4. *Timeline*. Every rank records a span per call it runs and per reallocation it sends,
   receives or copies in (`plans.trace.TraceRecorder`, one time origin: the exit of the barrier
   that ends `PlanRunner.__init__`, read on one clock per host, `plans.trace.clock_offsets_s`).
   A call's span starts once its inputs have arrived
   (waiting for a producer on other ranks is not the call's time) and ends before its outputs
   are sent; a call's ``time_s`` metric is its leader's span.

``reference=True`` runs the same calls in one process with no parallelism (every layout replaced
by dp = tp = pp = 1 with the home call's optimizer, every call on the model's one copy): the numbers a parallel run must
reproduce.

`step` runs the calls in plan order. A driver that runs them in another (dependency-respecting)
order, the same on every rank, uses the pieces `step` is made of: `begin_step`, `run_call` per
call, `finish_step` (`runtime.session` runs a traced loop's calls in its program order this way,
with the loop's host steps between them).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plans.errors import PlannerError
from plans.graph import ModelDecl
from plans.layout import Layout, Mesh
from plans.plan import Plan, PlanCall
from plans.runnable import runtime_problems
from plans.sharding import Box, Param, slices_key
from plans.trace import US_PER_S, TraceRecorder, clock_offsets_s, host_id
from runtime.algorithms import Glue, Rows, aligned, last_index
from runtime.data import RowInfo, Tokenizer, open_dataset
from runtime.data_parallel import AdamConfig
from runtime.dataflow import SHARES, Incoming, Mailbox, Shapes, StatsInbox, reporters
from runtime.engine import ModelRunner
from runtime.faults import FaultHooks, named
from runtime.groups import Groups, RankGroups, solo_groups
from runtime.losses import make_loss
from runtime.model import init_tensor
from runtime.realloc import RankPlan, Traffic, kv_rank_plan, rank_plan, reallocate
from runtime.tasks import make_inputs
from runtime.trusted import reward_function
from runtime.weights import open_weights

SOLO_MESH = Mesh(ranks=(0,))
DEFAULT_TIMEOUT_S = 600.0  # a hung collective fails after this long instead of blocking forever


@dataclass(frozen=True)
class Placement:
    """Where a call runs."""

    mesh: Mesh
    layout: Layout


@dataclass(frozen=True)
class CallPlan:
    """How one call gets its parameters: ``home`` (it is, or runs exactly like, the model's home
    call), ``shared`` (the home's resident slices under another layout) or ``realloc``."""

    where: Placement
    home: str
    source: str


def call_plans(plan: Plan) -> dict[str, CallPlan]:
    """How every call gets its parameters, for a plan `plans.runnable.runtime_problems` accepts."""
    homes = plan.graph().home_calls()
    listed = {(r.model, r.to_call) for r in plan.reallocations}
    out: dict[str, CallPlan] = {}
    for c in plan.calls:
        home = plan.call(homes[c.model])
        where, home_where = Placement(c.mesh, c.layout), Placement(home.mesh, home.layout)
        if c.name == home.name or where == home_where:
            source = "home"
        elif (c.model, c.name) in listed:
            source = "realloc"
        else:
            # The same rule the search's twins use (`plans.sharding.slices_key`).
            assert slices_key(c.mesh, c.layout) == slices_key(home.mesh, home.layout), f"{c.name}: rejected by runtime_problems"
            source = "shared"
        out[c.name] = CallPlan(where, home.name, source)
    return out


def initial_weights(decl: ModelDecl, *, seed: int) -> Callable[[Param, Box], Tensor]:
    """How a model's resident parameters start, box by box: read from its HF directory (a value
    head the directory lacks starts fresh), or the seeded initialisation of `init_tensor`."""
    def seeded(p: Param, box: Box) -> Tensor:
        return init_tensor(p, seed=seed)[tuple(slice(lo, hi) for lo, hi in box)]

    if decl.weights is None:
        return seeded
    weights = open_weights(decl.weights, spec=decl.spec, head=decl.head)

    def read(p: Param, box: Box) -> Tensor:
        return weights.read(p, box) if p.name != "score.weight" or weights.has(p) else seeded(p, box)

    return read


def check_runnable(plan: Plan, *, reference: bool) -> None:
    """A `PlannerError` listing why this runtime cannot run `plan` (`plans.runnable`), on every
    rank alike, before any collective."""
    problems = runtime_problems(plan, reference=reference)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise PlannerError(f"plan {plan.name!r} cannot run on this runtime: " + "; ".join(problems[:3]) + more,
                           hint="`planner validate PLAN` lists every problem; recompile the plan with this version of "
                           "planner, or use a larger batch, fewer minibatches or a smaller data-parallel degree")


def call_seed(seed: int, step: int, call: str) -> int:
    """Sampling seed of one call in one step: the same on every rank and in the reference."""
    return zlib.crc32(f"{seed}:{step}:{call}".encode())


@dataclass
class StepState:
    """One step in progress on this rank: the data handles (graph inputs, call outputs, values a
    driver adds), the messages in flight, and rank 0's own statistics."""

    step: int
    store: dict[str, Any]  # handle -> Rows, Incoming (receives in flight) or a driver's value
    mail: Mailbox
    inbox: StatsInbox
    reports: list[dict[str, Any]] = field(default_factory=list)  # a call's statistics, and SHARES: its shares
    t0: float = field(default_factory=time.perf_counter)
    rows: dict[str, list[RowInfo]] = field(default_factory=dict)  # dataset input -> what its rows say

    def get(self, handle: str) -> Any:
        """The value of `handle` on this rank, waiting for its receives (None when this rank does
        not read it)."""
        value = self.store.get(handle)
        return value.get() if isinstance(value, Incoming) else value


CALL_MARK = "planner.call:"  # profiler ranges of the calls


class PlanRunner:
    """Runs a plan on this rank (or, with `reference`, all of it in this one process)."""

    def __init__(self, plan: Plan, *, rank: int, world_size: int, reference: bool, seed: int,
                 dtype: torch.dtype, device: torch.device, trace: bool = False,
                 collective_timeout_s: float = DEFAULT_TIMEOUT_S, hooks: FaultHooks | None = None,
                 reward_fn: str | None = None, reward_flag: str = "--reward-fn") -> None:
        """`trace`: keep every step's spans in `recorder.events` (else only the current step's).
        `collective_timeout_s`: the timeout of the process groups created here (the caller gives
        the default group the same); a collective failing is a `PlannerError` naming its call.
        `hooks`: test hooks that kill or stall this rank (`runtime.faults`; none by default).
        `reward_fn`: the reward function the launch names (`reward_flag` says how, for messages);
        the plan's ``algorithm.reward_fn`` runs only if it is the same or built in (`runtime.trusted`)."""
        self.plan, self.rank, self.world, self.seed = plan, rank, world_size, seed
        self.reference, self.device, self.dtype = reference, device, dtype
        self.timeout_s, self.hooks = collective_timeout_s, hooks or FaultHooks(rank)
        check_runnable(plan, reference=reference)
        self.calls = call_plans(plan)
        # Calls that run on a reallocated copy (the reference reports their move as taking 0 s).
        self.moved = {n for n, cp in self.calls.items() if cp.source == "realloc"}
        if reference:  # unsharded, with the optimizer the home call trains with (AdamW or GaLore)
            optimizer = {c.name: c.layout.galore for c in plan.calls}
            self.calls = {n: CallPlan(Placement(SOLO_MESH, Layout(galore=optimizer[cp.home])), cp.home, "home")
                          for n, cp in self.calls.items()}
        self.distributed = not reference and world_size > 1
        self.vocab = min(plan.models[m].spec.vocab_size for m in plan.models)
        tokenizers: dict[str, Tokenizer] = {}
        self.datasets = {i.name: open_dataset(i, vocab_size=self.vocab, tokenizers=tokenizers)
                         for i in plan.inputs if i.data is not None}
        # Handles that carry left-padded rows ("pad"): dataset prompts and what is generated from them.
        self.padded = {n for n, d in self.datasets.items() if n == "prompts"}
        self.padded |= {c.outputs[0] for c in plan.calls if c.kind == "generate" and c.inputs[0] in self.padded}
        self.glue = Glue(plan, reward_fn=reward_function(plan.algorithm.reward_fn, named_at_launch=reward_fn,
                                                         flag=reward_flag),
                         tokenizer=next(iter(tokenizers.values()), None))
        # handle -> the ranks that read it: those of the meshes of the calls taking it as input,
        # and every rank for a handle a host step reads (host steps run on every rank)
        host_read = {h for s in plan.host_steps for h in s.inputs}
        self.readers = {h: tuple(range(world_size)) if h in host_read else
                        tuple(sorted({r for reader in plan.calls if h in reader.inputs
                                      for r in self.calls[reader.name].where.mesh.ranks}))
                        for c in plan.calls for h in c.outputs}
        groups = Groups(distributed=self.distributed, timeout_s=collective_timeout_s)
        self.groups: dict[str, RankGroups | None] = {}
        # Generate calls that decode with another layout than they prefill with (not in the
        # reference): the decode layout's groups, and this rank's part of moving the weights and
        # the prefilled KV cache to it.
        self.decode_groups: dict[str, RankGroups | None] = {}
        self.phase_moves: dict[str, tuple[RankPlan, RankPlan]] = {}
        self.reshard_traffic: dict[str, tuple[Traffic, Traffic]] = {}  # call -> (weights, KV cache) of the last step
        for c in plan.calls:  # plan order: every rank creates the same groups
            where = self.calls[c.name].where
            tied = plan.models[c.model].spec.tied and plan.models[c.model].head == "lm"
            self.groups[c.name] = solo_groups(where.layout) if reference else \
                groups.build(where.mesh, where.layout, rank=rank, tied=tied)
            if not reference and c.decode_layout is not None and c.decode_layout != c.layout:
                decl, gpn = plan.models[c.model], plan.cluster.gpus_per_node
                self.decode_groups[c.name] = groups.build(c.mesh, c.decode_layout, rank=rank, tied=tied)
                src, dst = (c.mesh, c.layout), (c.mesh, c.decode_layout)
                self.phase_moves[c.name] = (
                    rank_plan(decl.spec, head=decl.head, src=src, dst=dst, rank=rank, gpus_per_node=gpn),
                    kv_rank_plan(decl.spec, rows=c.seqs, positions=c.prompt_len - 1, src=src, dst=dst, rank=rank,
                                 gpus_per_node=gpn))
        adam = AdamConfig(eps=plan.algorithm.adam_eps)
        self.homes: dict[str, ModelRunner] = {}  # model -> runner on its resident parameters
        self.views: dict[str, ModelRunner] = {}  # call -> runner sharing the home's parameters
        self.moves: dict[str, RankPlan] = {}  # call -> this rank's part of its reallocation
        for c in plan.calls:
            cp, decl = self.calls[c.name], plan.models[c.model]
            mine = self.groups[c.name]
            if c.name == cp.home and mine is not None:
                self.homes[c.model] = ModelRunner(decl.spec, head=decl.head, trainable=decl.trainable, groups=mine,
                                                  piece=initial_weights(decl, seed=seed), device=device, dtype=dtype,
                                                  adam=adam)
                self.homes[c.model].offload_states()  # between calls from the start (`Layout.offload`)
        for c in plan.calls:
            cp, decl = self.calls[c.name], plan.models[c.model]
            mine = self.groups[c.name]
            if cp.source == "shared" and mine is not None:
                self.views[c.name] = ModelRunner(decl.spec, head=decl.head, trainable=False, groups=mine,
                                                 params=self.homes[c.model].shard.params, device=device, dtype=dtype)
            elif cp.source == "realloc":
                home = self.calls[cp.home].where
                self.moves[c.name] = rank_plan(decl.spec, head=decl.head, src=(home.mesh, home.layout),
                                               dst=(cp.where.mesh, cp.where.layout), rank=rank,
                                               gpus_per_node=plan.cluster.gpus_per_node)
        offset_s = 0.0
        if self.distributed:  # the default group's first collective involves every rank (NCCL p2p needs it)
            with named("setting up the plan's process groups", rank=rank, timeout_s=self.timeout_s):
                dist.barrier()
                reading = (host_id(), time.time())
                readings: list[Any] = [None] * world_size
                dist.all_gather_object(readings, reading)
            # The shared origin is the host's earliest exit: this rank read its clock that long after
            # it (`clock_offsets_s`), and the gather has taken the time since.
            offset_s = clock_offsets_s(readings)[rank] + (time.time() - reading[1])
        # Every rank's spans share one time origin: the barrier's exit, read on one clock per host.
        self.recorder = TraceRecorder(rank, sync=torch.cuda.synchronize if device.type == "cuda" else None,
                                      offset_s=offset_s)
        self.keep_trace = trace

    # Parameters ------------------------------------------------------------------------------

    def _runner(self, call: PlanCall, step: int) -> tuple[ModelRunner | None, float]:
        """The runner this rank uses for `call` (None outside its mesh) and the reallocation time."""
        cp = self.calls[call.name]
        if cp.source == "home":
            return self.homes.get(call.model), 0.0
        if cp.source == "shared":
            return self.views.get(call.name), 0.0
        move = self.moves[call.name]
        if not move.active:
            return None, 0.0
        runner = None
        with self.recorder.realloc(call.name, step=step, model=call.model, from_call=cp.home):
            home = self.homes.get(call.model)
            held = home.local_parameters() if home is not None else {}
            params, _ = reallocate(move, held, device=self.device)
            mine = self.groups[call.name]
            if mine is not None:
                decl = self.plan.models[call.model]
                runner = ModelRunner(decl.spec, head=decl.head, trainable=False, groups=mine, params=params,
                                     device=self.device, dtype=self.dtype)
        return runner, self._last_span_s()

    def _last_span_s(self) -> float:
        return self.recorder.events[-1]["dur"] / US_PER_S

    def resident(self) -> list[tuple[str, Placement, ModelRunner | None]]:
        """Every model's home placement, which holds its parameters and optimizer state between
        steps, with this rank's runner on it (None outside its mesh), in the plan's model order."""
        homes = {c.model: self.calls[c.name].home for c in self.plan.calls}
        return [(m, self.calls[homes[m]].where, self.homes.get(m)) for m in self.plan.models if m in homes]

    @contextmanager
    def states_on_device(self) -> Iterator[None]:
        """States offloaded between calls (`Layout.offload`) back on the device for the block (a
        checkpoint reads and fills them there), and offloaded again after it."""
        held = [r for r in self.homes.values() if r.offloaded]
        for r in held:
            r.reload_states()
        try:
            yield
        finally:
            for r in held:
                r.offload_states()

    def readable(self, handle: str, value: Any, state: StepState) -> Any:
        """`value` of `handle` as a host step gets it: for a dataset's prompts and what is generated
        from them, the rows plus their text (``prompt_text``, ``extras`` of the dataset row and, for
        samples, ``response_text``: the tokens up to EOS, decoded); other values as they are. Host
        steps are host code: their tensors are on the CPU (call outputs stay on the device)."""
        value = rows_on(value, torch.device("cpu"))
        tok = self.glue.tokenizer
        if tok is None or not isinstance(value, dict):
            return value
        if handle in state.rows:
            infos = state.rows[handle]
            return {**value, "prompt_text": [r.prompt for r in infos], "extras": [r.extras for r in infos]}
        samples = self.glue._sample_rows(None, state.rows, handle)
        if samples is None or "mask" not in value:
            return value
        gen_len = value["mask"].shape[1]
        texts = [tok.decode(t[m].tolist()) for t, m in zip(value["tokens"][:, -gen_len:], value["mask"])]
        return {**value, "prompt_text": [r.prompt for r in samples], "extras": [r.extras for r in samples],
                "response_text": texts}

    # Calls -----------------------------------------------------------------------------------

    def _get(self, store: dict[str, Rows | Incoming], handle: str) -> Rows:
        value = store[handle]
        return value.get() if isinstance(value, Incoming) else value

    def _generate(self, call: PlanCall, runner: ModelRunner | None, store: dict, step: int) -> tuple[Rows | None, Shapes]:
        """Samples [seqs, seq_len] with their log-probs and mask [seqs, gen_len] (on the last stage)."""
        g = call.gen_len
        shapes: Shapes = {"tokens": ((call.seq_len,), torch.int64), "logprobs": ((g,), torch.float32),
                          "mask": ((g,), torch.bool)}
        padded = call.inputs[0] in self.padded
        if padded:
            shapes["pad"] = ((), torch.int64)
        if runner is None:  # not in the call's mesh: reads nothing
            return None, shapes
        given = self._get(store, call.inputs[0])
        prompts = given["tokens"].repeat_interleave(call.samples_per_prompt, dim=0)
        _check_shape(call, prompts, (call.seqs, call.prompt_len))
        pad = given["pad"].repeat_interleave(call.samples_per_prompt, dim=0) if padded else None
        prefilled = None
        if call.name in self.phase_moves:  # prefill here, then decode under the decode layout
            runner, prefilled = self._to_decode_layout(call, runner, prompts, pad)
        out = runner.generate(prompts, gen_len=g, temperature=call.temperature, pad=pad,
                              seed=call_seed(self.seed, step, call.name), stop_token=self.glue.eos_id,
                              stopped=self._stop_strings() if padded else None, prefilled=prefilled)
        if out is not None and pad is not None:
            split = runner.split(prompts.shape[0])
            out["pad"] = pad[split.start:split.stop].to(out["tokens"].device)
        return out, shapes

    def _to_decode_layout(self, call: PlanCall, runner: ModelRunner, prompts: Tensor,
                          pad: Tensor | None) -> tuple[ModelRunner, dict[str, Tensor]]:
        """Prefill every prompt position but the last under the call's layout, then move the
        weights and that KV cache to its decode layout, as the plan's cost charges them
        (`plans.sharding.transfer_plan`, `plans.sharding.kv_transfer_plan`): the runner that
        decodes, and this rank's part of the cache."""
        weights, cache = self.phase_moves[call.name]
        kv = runner.prefill(prompts, pad=pad)
        params, moved_w = reallocate(weights, runner.local_parameters(), device=self.device)
        kv_here, moved_kv = reallocate(cache, kv, device=self.device, dtype=self.dtype)
        self.reshard_traffic[call.name] = (moved_w, moved_kv)
        groups = self.decode_groups[call.name]
        assert groups is not None  # the decode layout runs on the call's mesh, which holds this rank
        decl = self.plan.models[call.model]
        return ModelRunner(decl.spec, head=decl.head, trainable=False, groups=groups, params=params, device=self.device,
                           dtype=self.dtype), kv_here

    def _stop_strings(self) -> Callable[[Tensor, Tensor], Tensor] | None:
        """Ends a row whose generated text contains one of ``algorithm.stop`` (None without any)."""
        tok, stops = self.glue.tokenizer, self.plan.algorithm.stop
        if tok is None or not stops:
            return None

        def stopped(generated: Tensor, done: Tensor) -> Tensor:
            out = done.clone()
            for r in (~done).nonzero()[:, 0].tolist():
                text = tok.decode(generated[r].tolist())
                out[r] = any(s in text for s in stops)
            return out

        return stopped

    def _inference(self, call: PlanCall, runner: ModelRunner | None, store: dict) -> tuple[Rows | None, Shapes]:
        """Per-token log-probs [seqs, seq_len-1] or values [seqs, seq_len], or one score per sequence."""
        s = call.seq_len
        what = "logprobs" if call.returns == "logprobs" else "values"
        shapes: Shapes = {"scores": ((), torch.float32)} if call.returns == "scores" else \
            {what: ((s - 1,) if what == "logprobs" else (s,), torch.float32)}
        if runner is None:
            return None, shapes
        data = self._get(store, call.inputs[0])
        tokens = data["tokens"]
        _check_shape(call, tokens, (call.seqs, s))
        pad = data["pad"].to(self.device) if "pad" in data else None
        out = runner.forward(tokens.to(self.device), what=what, pad=pad)
        if out is None:  # not the last stage
            return None, shapes
        if call.returns == "scores":  # the value head at the last real token of each sequence
            split = runner.split(tokens.shape[0])
            mask = aligned(data, "mask") if "logprobs" in data else data.get("mask")  # samples or graph input
            mask = None if mask is None else mask[split.start:split.stop]
            last = torch.full((out.shape[0],), s - 1) if mask is None else last_index(mask) + 1
            return {"scores": out.gather(1, last.to(out.device)[:, None])[:, 0]}, shapes
        return {what: out}, shapes

    def _train(self, call: PlanCall, runner: ModelRunner | None, store: dict,
               rows: dict[str, list[RowInfo]]) -> tuple[dict[str, float], dict[str, float]]:
        """(statistics of the batch, this replica's shares of the loss statistics)."""
        if runner is None:
            return {}, {}
        inputs = {h: rows_on(self._get(store, h), self.device) for h in call.inputs}  # dataset rows come from the host
        batch = self.glue.train_batch(call, inputs, dataset_rows=rows)
        assert call.loss is not None
        on_device = {k: v.to(self.device) for k, v in batch.rows.items()}
        stats = runner.train(on_device, loss=make_loss(call.loss, self.plan.algorithm), denoms=batch.denoms,
                             lr=call.lr or self.plan.algorithm.lr, group=batch.group)
        return dict(batch.stats), stats

    def step(self, step: int) -> dict[str, float | int]:
        """Run every call of the plan once; the step's metrics (complete on rank 0)."""
        if self.plan.host_steps:
            names = ", ".join(s.name for s in self.plan.host_steps)
            raise PlannerError(f"plan {self.plan.name!r} has host steps ({names}): Python functions of the training "
                               "loop it was traced from, which the plan names but does not contain",
                               hint="run the loop itself: call the @planner.auto function, under torchrun "
                               f"--nproc-per-node {self.plan.cluster.gpus_per_node} for the plan's layouts")
        state = self.begin_step(step)
        for call in self.plan.calls:
            self.run_call(call, state=state)
        return self.finish_step(state)

    def begin_step(self, step: int, *, inputs: dict[str, Rows] | None = None) -> StepState:
        """A new step: the graph inputs drawn for it (`runtime.tasks`), except those given in `inputs`."""
        if not self.keep_trace:
            self.recorder.events.clear()
        t0 = time.perf_counter()
        toy = [i for i in self.plan.inputs if i.name not in self.datasets]
        store: dict[str, Any] = dict(make_inputs(self.plan.algorithm.task, toy, vocab_size=self.vocab, seed=self.seed,
                                                 step=step))
        rows: dict[str, list[RowInfo]] = {}
        for name, dataset in self.datasets.items():
            store[name], rows[name] = dataset.batch(step=step, seed=self.seed)
        store.update(inputs or {})
        return StepState(step=step, store=store, mail=Mailbox(self.rank), inbox=StatsInbox(), t0=t0, rows=rows)

    def run_call(self, call: PlanCall, *, state: StepState) -> None:
        """Run one call of the step on this rank (its reallocation first), post its output's
        sends and receives and its statistics. Every rank runs the same calls in the same order.
        A collective or message that fails (a peer died, or timed out) is a `PlannerError` naming
        the call."""
        with named(f"call {call.name!r} of step {state.step}", rank=self.rank, timeout_s=self.timeout_s):
            self._run_call(call, state)

    def _run_call(self, call: PlanCall, state: StepState) -> None:
        cp = self.calls[call.name]
        runner, realloc_s = self._runner(call, state.step)
        store = state.store
        stats: dict[str, float] = {}
        shares: dict[str, float] = {}
        if runner is not None:
            for handle in call.inputs:  # wait for the inputs outside the call's span
                self._get(store, handle)
        span = nullcontext() if runner is None else \
            self.recorder.call(call.name, step=state.step, kind=call.kind, model=call.model)
        # Named for `runtime.observe.MemoryMeter` (nothing happens unless a profiler runs).
        # States a home call keeps in host memory between calls come back for it (`Layout.offload`).
        offloads = runner if runner is not None and cp.source == "home" and cp.where.layout.offload != "none" else None
        with span, torch.profiler.record_function(CALL_MARK + call.name):
            if runner is not None:
                self.hooks.before_call(state.step, kind=call.kind)
            if offloads is not None:
                offloads.reload_states()
            if call.kind == "generate":
                local, shapes = self._generate(call, runner, store, state.step)
            elif call.kind == "inference":
                local, shapes = self._inference(call, runner, store)
            else:
                local, shapes = None, {}
                batch_stats, shares = self._train(call, runner, store, state.rows)
                stats = {(k if k in ("reward_mean", "response_len", "kl_mean") else f"{call.name}.{k}"): v
                         for k, v in batch_stats.items()}  # the same on every rank: the leader's go to rank 0
                shares = {f"{call.name}.{k}": v for k, v in shares.items()}
            if offloads is not None:
                offloads.offload_states()
        if runner is not None:
            stats[f"{call.name}.time_s"] = self._last_span_s()
        if call.kind != "train":  # a train call's output handle orders calls; it carries no tensors
            store[call.outputs[0]] = self._share(call, local, shapes, state.mail)
        del runner  # a reallocated copy is freed here
        if call.name in self.moved:
            stats[f"{call.name}.realloc_time_s"] = realloc_s
        srcs = reporters(cp.where.mesh, cp.where.layout, kind=call.kind)
        for src in srcs:
            if src == self.rank:
                # The leader reports the call; a train call's other replicas only their shares of
                # its loss statistics, which rank 0 sums (`finish_step`).
                report: dict[str, Any] = stats if src == srcs[0] else {}
                if call.kind == "train":
                    report = {**report, SHARES: shares}
                if self.rank == 0:
                    state.reports.append(report)
                else:
                    state.mail.report(report, device=self.device)
            elif self.rank == 0:
                state.inbox.expect(src, device=self.device)

    def finish_step(self, state: StepState) -> dict[str, float | int]:
        """Complete the step's messages; its metrics (complete on rank 0)."""
        with named(f"the end of step {state.step} (its last messages)", rank=self.rank, timeout_s=self.timeout_s):
            for value in state.store.values():  # complete every receive posted, read or not
                if isinstance(value, Incoming):
                    value.get()
            state.mail.flush()
            reports = [*state.reports, *state.inbox.collect()]
        metrics: dict[str, float | int] = {"step": state.step}
        for stats in reports:  # in plan order, then leader first: the same sums on every run
            shares_of: dict[str, float] = stats.pop(SHARES, {})
            for k, v in shares_of.items():
                metrics[k] = metrics.get(k, 0.0) + v
            metrics.update(stats)
        metrics["time_s"] = time.perf_counter() - state.t0
        return metrics

    def _share(self, call: PlanCall, local: Rows | None, shapes: Shapes, mail: Mailbox) -> Rows | Incoming | None:
        """The call's output on this rank, sent to and received from the other ranks that read it."""
        if not self.distributed:
            assert local is not None
            return dict(local)  # stays where it was computed
        where = self.calls[call.name].where
        layout = call.decode_layout if call.name in self.phase_moves and call.decode_layout is not None else where.layout
        return mail.share(local, mesh=where.mesh, layout=layout, rows=call.seqs, shapes=shapes,
                          needers=self.readers[call.outputs[0]], device=self.device)


def rows_on(rows: Any, device: torch.device) -> Any:
    """`rows` with every tensor on `device` (a host step's output may hold other values)."""
    if not isinstance(rows, dict):
        return rows
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rows.items()}


def _check_shape(call: PlanCall, tokens: torch.Tensor, want: tuple[int, int]) -> None:
    if tuple(tokens.shape) != want:
        raise PlannerError(f"call {call.name!r} declares {want[0]} sequences of {want[1]} tokens but reads "
                           f"{tuple(tokens.shape)[0]} of {tuple(tokens.shape)[1]}",
                           hint="the call's seqs and seq_len must match the data it reads")
