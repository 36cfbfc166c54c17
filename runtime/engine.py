"""One model on one rank: the parallel techniques composed, and train / forward / generate on it.

`parallelize` applies the techniques in one fixed order (torchtitan's):

1. pipeline parallel: the stage's layers (`plans.sharding.stage_layers`);
2. tensor parallel (and the ZeRO-3 row split): each tensor's slice is its
   `plans.sharding.shard_box`, plus the rank's tensor-parallel context (sequence parallel on/off);
3. expert and context parallel: the rank's expert and context-parallel groups
   (`runtime.context_parallel`: a share of each sequence's positions);
4. activation recompute (none, selective, full);
5. data parallel: the ZeRO-3 gather, flat buffers, gradient reduction (summed over the
   context-parallel group first) and optimizer partition.

`ModelRunner` then runs the three call kinds on the rank's data-parallel rows of a batch that
every rank holds in full. Outputs are complete on the last pipeline stage (every tensor-parallel
rank there holds the same values); the plan executor collects them from there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from plans.errors import PlannerError
from plans.layout import Layout
from plans.model import Head, ModelSpec
from plans.runnable import expert_layout_problems, layout_runtime_problems
from plans.sharding import Box, Param, split_range
from runtime import generate as gen
from runtime.context_parallel import ContextParallel
from runtime.data_parallel import AdamConfig, DataParallel, apply_data_parallel
from runtime.groups import RankGroups
from runtime.model import ExpertParallel, Shard, build_shard, stage_forward, token_logprobs, token_values
from runtime.offload import released, to_device, to_host
from runtime.pipeline_parallel import Pipeline, apply_pipeline_parallel, forward_only, train_1f1b
from runtime.recompute import apply_recompute
from runtime.tensor_parallel import apply_tensor_parallel

Rows = dict[str, Tensor]  # per-sequence tensors, all with the batch as dim 0
LossFn = Callable[[Tensor, Rows, float], tuple[Tensor, dict[str, Tensor]]]


def parallelize(spec: ModelSpec, *, head: Head, trainable: bool, groups: RankGroups,
                state: Callable[[Param], Tensor] | None = None, params: Mapping[str, Tensor] | None = None,
                piece: Callable[[Param, Box], Tensor] | None = None, device: torch.device,
                adam: AdamConfig | None = None) -> tuple[Shard, Pipeline, DataParallel | None]:
    """Build this rank's shard of a model under `groups.layout`, in the documented order, from
    whole tensors (`state`), boxes read one by one (`piece`) or this rank's slices, used as they
    are (`params`)."""
    layout, c = groups.layout, groups.coord
    problems = layout_runtime_problems(layout) + expert_layout_problems(spec, layout)
    if problems:
        raise PlannerError(f"layout {layout.short()}: " + "; ".join(problems),
                           hint="compile the plan without these layout dimensions")
    layers, pipe = apply_pipeline_parallel(spec.num_hidden_layers, layout=layout, pp=groups.pp, stage=c.pp)
    shard = build_shard(spec, head=head, layout=layout, local=groups.local, layers=layers, state=state, given=params,
                        piece=piece,
                        device=device)
    shard.tp = apply_tensor_parallel(group=groups.tp.group, size=groups.tp.size, rank=groups.tp.index,
                                     sequence_parallel=layout.sequence_parallel)
    if groups.ep.size > 1:
        shard.ep = ExpertParallel(group=groups.ep.group, size=groups.ep.size, rank=groups.ep.index)
    if groups.cp.size > 1:
        shard.cp = ContextParallel(group=groups.cp.group, size=groups.cp.size, rank=groups.cp.index)
    apply_recompute(shard, mode=layout.recompute)
    dp = apply_data_parallel(shard, groups=groups, zero=layout.zero, trainable=trainable, adam=adam, galore=layout.galore)
    return shard, pipe, dp


@dataclass(frozen=True)
class Split:
    """Rows [start, stop) of the batch this rank's data-parallel replica handles, by micro-batch."""

    start: int
    stop: int
    micro: tuple[tuple[int, int], ...]


def split_rows(rows: int, *, dp: int, dp_index: int, micro_batches: int, group: int = 1) -> Split:
    """Contiguous data-parallel and micro-batch splits of `rows`, never cutting a group of
    `group` rows (a DPO pair, a prompt's samples). Fewer micro-batches are used when the replica
    has fewer groups than `micro_batches` (the math does not depend on the split)."""
    units = rows // group
    if units < dp:
        raise PlannerError(f"a batch of {rows} sequences ({units} groups of {group}) cannot split over dp={dp}",
                           hint="use a larger batch or a smaller data-parallel degree")
    lo, hi = split_range(units, dp, dp_index)
    n = min(micro_batches, hi - lo)
    micro = tuple(((lo + a) * group, (lo + b) * group) for a, b in (split_range(hi - lo, n, k) for k in range(n)))
    return Split(lo * group, hi * group, micro)


class ModelRunner:
    """A model shard on this rank with the calls it can run."""

    def __init__(self, spec: ModelSpec, *, head: Head, trainable: bool, groups: RankGroups,
                 state: Callable[[Param], Tensor] | None = None, params: Mapping[str, Tensor] | None = None,
                 piece: Callable[[Param, Box], Tensor] | None = None, device: torch.device,
                 dtype: torch.dtype = torch.float32, adam: AdamConfig | None = None) -> None:
        self.spec, self.head, self.groups, self.device, self.dtype = spec, head, groups, device, dtype
        self.layout: Layout = groups.layout
        self.shard, self.pipe, self.dp = parallelize(spec, head=head, trainable=trainable, groups=groups,
                                                     state=state, params=params, piece=piece, device=device,
                                                     adam=adam)
        self._host_weights: dict[str, Tensor] | None = None  # a frozen model's weights while offloaded

    # Helpers --------------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def _padded_len(self, s: int) -> int:
        """Sequence length the model runs at: a multiple of tp under sequence parallel, and of
        2 * cp under context parallel (the extra positions are padding after the real ones, so
        causal attention never sees them)."""
        m = self._sp_factor() * self.shard.cp.multiple
        return -(-s // m) * m

    def _run_stage(self, tokens: Tensor, x: Tensor | None, pad: Tensor | None = None) -> Tensor:
        s = self._padded_len(tokens.shape[1])
        slots = self.shard.cp.slots(s, self.device)  # every slot, or this context-parallel rank's
        positions = slots.clamp(max=self.spec.max_position_embeddings - 1)
        if self.pipe.first:
            x = torch.nn.functional.pad(tokens, (0, s - tokens.shape[1]))
            if self.shard.cp.size > 1:
                x = x.index_select(1, slots.to(x.device))
        assert x is not None
        with self._autocast():
            return stage_forward(self.shard, x, positions=positions, pad=pad)

    def _outputs(self, h: Tensor, tokens: Tensor, what: str) -> Tensor:
        s = tokens.shape[1]
        with self._autocast():
            if what == "logprobs":
                padded = torch.nn.functional.pad(tokens, (0, self._padded_len(s) - s))
                return token_logprobs(self.shard, h, padded.to(h.device))[:, :s - 1]
            return token_values(self.shard, h)[:, :s]

    def _sp_factor(self) -> int:
        return self.shard.tp.size if self.shard.tp.sequence_parallel else 1

    def _act_shape(self, b: int, s: int) -> tuple[int, ...]:
        return (b, self._padded_len(s) // self._sp_factor() // self.shard.cp.size, self.spec.hidden_size)

    def _act_shape_of(self, micro: tuple[tuple[int, int], ...], s: int, i: int) -> tuple[int, ...]:
        """The activation shape of micro-batch `i` of rows `micro`."""
        return self._act_shape(micro[i][1] - micro[i][0], s)

    def split(self, rows: int, *, group: int = 1) -> Split:
        return split_rows(rows, dp=self.groups.dp.size, dp_index=self.groups.dp.index,
                          micro_batches=self.layout.micro_batches, group=group)

    # Calls ----------------------------------------------------------------------------------

    def forward(self, tokens: Tensor, *, what: str, pad: Tensor | None = None) -> Tensor | None:
        """Per-token log-probs [b, s-1] (``what="logprobs"``) or values [b, s] of this replica's
        rows of `tokens` [B, s] (left-padded by `pad` [B] tokens, when given); None except on the
        last stage."""
        split = self.split(tokens.shape[0])
        s = tokens.shape[1]

        def fwd(i: int, x: Tensor | None) -> Tensor:
            lo, hi = split.micro[i]
            h = self._run_stage(tokens[lo:hi], x, None if pad is None else pad[lo:hi].to(self.device))
            return self._outputs(h, tokens[lo:hi], what) if self.pipe.last else h

        with torch.no_grad():
            outs = forward_only(self.pipe, len(split.micro), forward=fwd, device=self.device,
                                act_shape=lambda i: self._act_shape(split.micro[i][1] - split.micro[i][0], s))
        return torch.cat(outs) if self.pipe.last else None

    def train(self, batch: Rows, *, loss: LossFn, denoms: list[float], lr: float, group: int = 1) -> dict[str, float]:
        """One optimizer step per minibatch (`len(denoms)` consecutive minibatches of `batch`).

        `loss(out, rows, denom)` turns the per-token output of a micro-batch into its share of
        the minibatch loss (sums divided by the minibatch's global `denom`) and its statistics.
        Returns each statistic averaged over minibatches, as this data-parallel replica's share
        (valid on the last stage): the sum of the replicas' returns is the batch's statistic. No
        collective gathers them; the caller sends the shares to whoever reports them
        (`runtime.executor` sums them on rank 0), off the training step's critical path."""
        if self.dp is None:
            raise PlannerError("a train call ran on a model that is not trainable")
        tokens = batch["tokens"]
        rows, s = tokens.shape
        what = "logprobs" if self.head == "lm" else "values"
        totals: dict[str, Tensor] = {}
        for k, denom in enumerate(denoms):
            mb_lo, mb_hi = (x * group for x in split_range(rows // group, len(denoms), k))
            mb = {name: t[mb_lo:mb_hi] for name, t in batch.items()}
            split = self.split(mb_hi - mb_lo, group=group)
            stats: dict[str, Tensor] = {}

            # The closures run within this iteration (train_1f1b calls them); defaults bind its values.
            def fwd(i: int, x: Tensor | None, split: Split = split, mb: Rows = mb) -> Tensor:
                lo, hi = split.micro[i]
                h = self._run_stage(mb["tokens"][lo:hi], x, mb["pad"][lo:hi] if "pad" in mb else None)
                return self._outputs(h, mb["tokens"][lo:hi], what) if self.pipe.last else h

            def loss_of(i: int, out: Tensor, split: Split = split, mb: Rows = mb, denom: float = denom,
                        stats: dict[str, Tensor] = stats) -> Tensor:
                lo, hi = split.micro[i]
                value, parts = loss(out, {n: t[lo:hi] for n, t in mb.items()}, denom)
                for name, v in {"loss": value, **parts}.items():
                    stats[name] = stats.get(name, 0.0) + v.detach().float()
                return value

            self.dp.zero_grad()
            train_1f1b(self.pipe, len(split.micro), forward=fwd, loss=loss_of, device=self.device,
                       act_shape=partial(self._act_shape_of, split.micro, s), before_last_backward=self.dp.arm)
            self.dp.reduce_gradients()
            self.dp.step(lr=lr)
            if self.pipe.last:
                for n in sorted(stats):
                    totals[n] = totals.get(n, 0.0) + stats[n] / len(denoms)
        return {n: float(v) for n, v in sorted(totals.items())}

    def prefill(self, prompts: Tensor, *, pad: Tensor | None = None) -> dict[str, Tensor]:
        """The KV cache of this replica's rows of `prompts` [B, p], every position but the last,
        for a decode under another layout (`runtime.generate.prefill_cache`), as the named boxes of
        `plans.sharding.kv_box` (``kv.{layer}.k`` / ``.v``) that `runtime.realloc` moves."""
        split = self.split(prompts.shape[0])
        mine = None if pad is None else pad[split.start:split.stop].to(self.device)
        with torch.no_grad(), self._autocast():
            kv = gen.prefill_cache(self.shard, self.pipe, prompts[split.start:split.stop].to(self.device),
                                   device=self.device, pad=mine, groups=self.layout.micro_batches)
        return {f"kv.{i}.{n}": t.contiguous() for i, (k, v) in kv.items() for n, t in (("k", k), ("v", v))}

    def generate(self, prompts: Tensor, *, gen_len: int, temperature: float, seed: int,
                 stop_token: int | None = None, pad: Tensor | None = None,
                 stopped: Callable[[Tensor, Tensor], Tensor] | None = None,
                 prefilled: Mapping[str, Tensor] | None = None) -> dict[str, Tensor] | None:
        """Continue this replica's rows of `prompts` [B, p] (left-padded by `pad` [B] tokens,
        when given) by `gen_len` tokens (see `runtime.generate`); the result (tokens, log-probs,
        mask) is on the last stage. `prefilled`: this rank's boxes of the KV cache of every
        prompt position but the last (`prefill` under another layout, moved to this one)."""
        split = self.split(prompts.shape[0])
        rows = torch.arange(split.start, split.stop, device=self.device)
        mine = None if pad is None else pad[split.start:split.stop].to(self.device)
        with torch.no_grad(), self._autocast():
            kv = None if prefilled is None else {i: (prefilled[f"kv.{i}.k"], prefilled[f"kv.{i}.v"])
                                                 for i in self.shard.layers}
            return gen.generate(self.shard, self.pipe, prompts[split.start:split.stop].to(self.device),
                                seq_ids=rows, gen_len=gen_len, temperature=temperature, seed=seed,
                                stop_token=stop_token, device=self.device, pad=mine, stopped=stopped,
                                groups=self.layout.micro_batches, prefilled=kv)

    def local_parameters(self) -> dict[str, Tensor]:
        """This rank's parameter slices (detached), by HF name (copied back to the device while
        `offload_states` keeps the weights on the host)."""
        if self._host_weights is not None:  # one copy per distinct weight, under each of its names
            back = {id(self.shard.params[n]): to_device(t, self.device) for n, t in self._host_weights.items()}
            return {n: back[id(p)] for n, p in self.shard.params.items()}
        return {n: p.detach() for n, p in self.shard.params.items()}

    # Offload (`Layout.offload`) -------------------------------------------------------------

    def offload_states(self) -> None:
        """After its call, move what `Layout.offload` keeps in host memory there: the optimizer's
        moments, or a frozen model's weights (dropped from the device: the host copy is theirs)."""
        if self.layout.offload == "optimizer":
            assert self.dp is not None, "optimizer offload on a model that is not trainable"
            self.dp.optimizer_to_host()
        elif self.layout.offload == "weights" and self._host_weights is None:
            assert self.dp is None, "weights offload on a trainable model"
            self._host_weights = {n: to_host(p.detach()) for n, p in self._distinct_params().items()}
            for p in self._distinct_params().values():
                p.data = released(p.data)

    def reload_states(self) -> None:
        """Before its call, bring back what `offload_states` moved to host memory."""
        if self.dp is not None:
            self.dp.optimizer_to_device()
        if self._host_weights is not None:
            for n, p in self._distinct_params().items():
                p.data = to_device(self._host_weights[n], self.device)
            self._host_weights = None

    def _distinct_params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by their first name (a tied weight once)."""
        first: dict[int, str] = {}
        for n, p in self.shard.params.items():
            first.setdefault(id(p), n)
        return {n: self.shard.params[n] for n in first.values()}

    @property
    def offloaded(self) -> bool:
        """Whether states of this runner are in host memory now."""
        return self._host_weights is not None or (self.dp is not None and self.dp.on_host)
