"""Execute a plan's calls, step after step, on this rank.

Every rank walks `plan.calls` in order. A call runs on the ranks of its mesh with its layout
(`runtime.engine.ModelRunner`); its outputs are then broadcast from the last pipeline stage of
each data-parallel replica to every rank of the world, so each data handle is held in full
everywhere and the next call, whatever its mesh and layout, slices what it needs. Data handles
are small next to parameters (tokens, per-token floats), which is what makes this simple scheme
affordable; parameters never move in this version.

Constraint of this version: each model keeps one mesh and layout across its calls (as in a plan
compiled with ``--baseline colocate``); plans that reallocate parameters are refused with a
clear message. `placements` is where the executor that reallocates will plug in.

``reference=True`` runs the same calls in one process with no parallelism (every layout replaced
by dp = tp = pp = 1): the numbers a parallel run must reproduce.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from plans.errors import PlannerError
from plans.layout import Coord, Layout, Mesh
from plans.plan import Plan, PlanCall
from runtime.algorithms import Glue, Rows, aligned, last_index, load_reward_fn
from runtime.engine import ModelRunner, split_rows
from runtime.groups import Groups, solo_groups
from runtime.losses import make_loss
from runtime.model import init_tensor
from runtime.tasks import make_inputs

SOLO_MESH = Mesh(ranks=(0,))


@dataclass(frozen=True)
class Placement:
    """Where a model lives for the whole run."""

    mesh: Mesh
    layout: Layout


def placements(plan: Plan, *, reference: bool) -> dict[str, Placement]:
    """Each model's single (mesh, layout); a `PlannerError` when a model changes between calls."""
    out: dict[str, Placement] = {}
    first_call: dict[str, str] = {}
    for c in plan.calls:
        if c.decode_layout is not None and c.decode_layout != c.layout:
            raise PlannerError(f"call {c.name!r} decodes with a layout different from its prefill; "
                               "the runtime does not reallocate between phases yet",
                               hint="compile the plan without a separate decode layout")
        here = Placement(c.mesh, c.layout)
        if c.model in out and out[c.model] != here:
            prev = out[c.model]
            raise PlannerError(
                f"model {c.model!r} runs call {first_call[c.model]!r} on {prev.mesh.short()} with "
                f"{prev.layout.short()} but call {c.name!r} on {c.mesh.short()} with {c.layout.short()}; "
                "this runtime keeps each model in one layout and cannot reallocate parameters yet",
                hint="compile the plan with --baseline colocate (one mesh and layout per model)")
        out.setdefault(c.model, here)
        first_call.setdefault(c.model, c.name)
    if plan.reallocations:
        r = plan.reallocations[0]
        raise PlannerError(f"the plan reallocates {r.model!r} between {r.from_call!r} and {r.to_call!r}; "
                           "parameter reallocation is not supported by this runtime yet",
                           hint="compile the plan with --baseline colocate")
    if reference:
        out = {m: Placement(SOLO_MESH, Layout()) for m in out}
    return out


def call_seed(seed: int, step: int, call: str) -> int:
    """Sampling seed of one call in one step: the same on every rank and in the reference."""
    return zlib.crc32(f"{seed}:{step}:{call}".encode())


class PlanRunner:
    """Runs a plan on this rank (or, with `reference`, all of it in this one process)."""

    def __init__(self, plan: Plan, *, rank: int, world_size: int, reference: bool, seed: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.plan, self.rank, self.world, self.seed = plan, rank, world_size, seed
        self.reference, self.device = reference, device
        self.where = placements(plan, reference=reference)
        _check_batches(plan, self.where)
        self.glue = Glue(plan, reward_fn=load_reward_fn(plan.algorithm))
        groups = Groups(distributed=not reference and world_size > 1)
        self.models: dict[str, ModelRunner] = {}
        for name, place in self.where.items():  # plan order: every rank creates the same groups
            decl = plan.models[name]
            tied = decl.spec.tied and decl.head == "lm"
            mine = solo_groups(place.layout) if reference else groups.build(place.mesh, place.layout, rank=rank, tied=tied)
            if mine is not None:
                self.models[name] = ModelRunner(decl.spec, head=decl.head, trainable=decl.trainable, groups=mine,
                                                state=lambda p: init_tensor(p, seed=seed), device=device, dtype=dtype)
        self.vocab = min(plan.models[m].spec.vocab_size for m in plan.models)

    # Moving call outputs to every rank ------------------------------------------------------

    def _share(self, call: PlanCall, local: Rows | None, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
               rows: int) -> Rows:
        """Assemble a call's output on every rank from the replicas that computed it."""
        if self.reference or self.world == 1:
            assert local is not None
            return {k: v.cpu() for k, v in local.items()}
        place = self.where[call.model]
        lay = place.layout
        out: Rows = {k: torch.empty((rows, *shape), dtype=dtype) for k, (shape, dtype) in shapes.items()}
        for d in range(lay.dp):
            src = place.mesh.ranks[lay.local_rank(Coord(pp=lay.pp - 1, dp=d, cp=0, tp=0))]
            split = split_rows(rows, dp=lay.dp, dp_index=d, micro_batches=1)
            for key in sorted(shapes):
                _, dtype = shapes[key]
                wire = torch.float32 if dtype == torch.float32 else torch.int64
                if self.rank == src:
                    assert local is not None
                    buf = local[key].to(wire).to(self.device).contiguous()
                else:
                    buf = torch.empty((split.stop - split.start, *shapes[key][0]), dtype=wire, device=self.device)
                dist.broadcast(buf, src)
                out[key][split.start:split.stop] = buf.cpu().to(dtype)
        return out

    def _share_stats(self, call: PlanCall, stats: dict[str, float] | None) -> dict[str, float]:
        if self.reference or self.world == 1:
            return stats or {}
        place = self.where[call.model]
        lay = place.layout
        src = place.mesh.ranks[lay.local_rank(Coord(pp=lay.pp - 1, dp=0, cp=0, tp=0))]
        box = [stats if self.rank == src else None]
        dist.broadcast_object_list(box, src, device=self.device)
        return box[0] or {}

    # Calls -----------------------------------------------------------------------------------

    def _generate(self, call: PlanCall, store: dict[str, Rows], step: int) -> Rows:
        prompts = store[call.inputs[0]]["tokens"].repeat_interleave(call.samples_per_prompt, dim=0)
        b, p = prompts.shape
        runner = self.models.get(call.model)
        local = None
        if runner is not None:
            local = runner.generate(prompts, gen_len=call.gen_len, temperature=call.temperature,
                                    seed=call_seed(self.seed, step, call.name))
        g = call.gen_len
        shapes = {"tokens": ((p + g,), torch.int64), "logprobs": ((g,), torch.float32), "mask": ((g,), torch.bool)}
        return self._share(call, local, shapes, b)

    def _inference(self, call: PlanCall, store: dict[str, Rows]) -> Rows:
        data = store[call.inputs[0]]
        tokens = data["tokens"]
        b, s = tokens.shape
        runner = self.models.get(call.model)
        what = "logprobs" if call.returns == "logprobs" else "values"
        out = runner.forward(tokens.to(self.device), what=what) if runner is not None else None
        local = None if out is None else {what: out}
        shape = (s - 1,) if what == "logprobs" else (s,)
        shared = self._share(call, local, {what: (shape, torch.float32)}, b)
        if call.returns == "scores":  # the value head at the last real token of each sequence
            mask = aligned(data, "mask") if "logprobs" in data else data.get("mask")  # samples or graph input
            last = torch.full((b,), s - 1) if mask is None else last_index(mask) + 1
            return {"scores": shared["values"].gather(1, last[:, None])[:, 0]}
        return shared

    def _train(self, call: PlanCall, store: dict[str, Rows]) -> dict[str, float]:
        batch = self.glue.train_batch(call, store)
        runner = self.models.get(call.model)
        stats = None
        if runner is not None:
            assert call.loss is not None
            rows = {k: v.to(self.device) for k, v in batch.rows.items()}
            stats = runner.train(rows, loss=make_loss(call.loss, self.plan.algorithm), denoms=batch.denoms,
                                 lr=call.lr or self.plan.algorithm.lr, group=batch.group)
            stats = stats if runner.pipe.last and runner.groups.coord.dp == 0 and runner.groups.coord.tp == 0 else None
        return {**batch.stats, **self._share_stats(call, stats)}

    def step(self, step: int) -> dict[str, float | int]:
        """Run every call of the plan once; the step's metrics (the same on every rank)."""
        t0 = time.perf_counter()
        store: dict[str, Rows] = make_inputs(self.plan.algorithm.task, self.plan.inputs, vocab_size=self.vocab,
                                             seed=self.seed, step=step)
        metrics: dict[str, float | int] = {"step": step}
        for call in self.plan.calls:
            tc = time.perf_counter()
            if call.kind == "generate":
                store[call.outputs[0]] = self._generate(call, store, step)
            elif call.kind == "inference":
                store[call.outputs[0]] = self._inference(call, store)
            else:
                for k, v in self._train(call, store).items():
                    key = k if k in ("reward_mean", "response_len", "kl_mean") else f"{call.name}.{k}"
                    metrics[key] = v
            metrics[f"{call.name}.time_s"] = time.perf_counter() - tc
        metrics["time_s"] = time.perf_counter() - t0
        return metrics



def _check_batches(plan: Plan, where: dict[str, Placement]) -> None:
    """Every data-parallel replica of every call gets at least one sequence (checked on every
    rank before any collective, so a bad plan fails everywhere instead of hanging)."""
    for c in plan.calls:
        dp = where[c.model].layout.dp
        group = 2 if c.loss == "dpo" else 1
        rows = c.seqs // c.minibatches if c.kind == "train" else c.seqs
        if rows // group < dp:
            what = "each minibatch of" if c.kind == "train" else "the batch of"
            raise PlannerError(f"call {c.name!r}: {what} {rows} sequences cannot split over dp={dp}",
                               hint="use a larger batch, fewer minibatches or a smaller data-parallel degree")
