"""Data parallelism: gradient reduction over the data-parallel group and ZeRO 1/2/3.

A shard's parameters are views into one flat fp32 buffer and their gradients views into a
second one, so reductions and the optimizer work on a few large tensors (the bucketing DDP does):

- ZeRO 0: all-reduce the gradient buffer; every rank updates every parameter.
- ZeRO 1: all-reduce gradients; each rank keeps Adam state for, and updates, one contiguous
  1/dp of the flat buffer, then the buffer is all-gathered (Rajbhandari et al. 2020).
- ZeRO 2: as 1, but gradients are reduce-scattered, each rank receiving only its part.
- ZeRO 3: parameters are split further along dim 0 across the group (the boxes of
  `plans.sharding.shard_box`); `Zero3Gather` all-gathers a layer's parameters when it runs and
  reduce-scatters their gradients in backward, so each rank stores only its own slices at rest
  (and gradients and optimizer state for them). Autograd keeps a gathered weight until its
  layer's backward unless recompute is ``full`` (the gather is then inside the checkpointed
  layer and redone in backward, as FSDP does); generation gathers a stage once per call.

Gradients are sums, not means: losses are normalised by the global token (or sequence) count
of the minibatch, so the summed gradient over ranks and micro-batches equals the gradient of the
single-process loss. Adam is elementwise, so any partition of the buffer gives the same update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plans.layout import Layout
from plans.sharding import parameters, shard_box, split_range
from runtime.groups import Axis, RankGroups, all_gather_into, reduce_scatter_into
from runtime.model import Shard


@dataclass(frozen=True)
class AdamConfig:
    """AdamW hyperparameters (Loshchilov & Hutter 2019); the learning rate comes per call."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


def adam_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, step: int, lr: float, cfg: AdamConfig) -> None:
    """One AdamW step on flat tensors, in place (torch.optim.AdamW's formula)."""
    m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
    bias1 = 1 - cfg.beta1 ** step
    bias2 = 1 - cfg.beta2 ** step
    denom = (v.sqrt() / math.sqrt(bias2)).add_(cfg.eps)
    if cfg.weight_decay:
        p.mul_(1 - lr * cfg.weight_decay)
    p.addcdiv_(m, denom, value=-lr / bias1)


class Zero3Gather:
    """All-gathers dim-0 slices of parameters over the data-parallel group for one use; its
    backward reduce-scatters the gradients back to the slices (summed over the group)."""

    def __init__(self, shard: Shard, *, dp: Axis, layout: Layout, local: int) -> None:
        self.shard, self.dp = shard, dp
        whole = layout.model_copy(update={"zero": 0})
        # name -> (rows per dp rank [(start, stop)], shape of the tensor-parallel slice)
        self.rows: dict[str, tuple[list[tuple[int, int]], tuple[int, ...]]] = {}
        for p in parameters(shard.spec, head=shard.head):
            box = shard_box(p, shard.spec, whole, local)
            if box is None:
                continue
            shape = tuple(hi - lo for lo, hi in box)
            self.rows[p.name] = ([split_range(shape[0], dp.size, r) for r in range(dp.size)], shape)

    def __call__(self, names: list[str]) -> list[Tensor]:
        return list(_GatherRows.apply(self, names, *[self.shard.params[n] for n in names]))

    def _layout(self, names: list[str]) -> tuple[list[list[int]], int]:
        """Per dp rank, the element offsets of each name's slice in that rank's packed chunk."""
        offsets, longest = [], 0
        for r in range(self.dp.size):
            off, mine = 0, []
            for n in names:
                (lo, hi), shape = self.rows[n][0][r], self.rows[n][1]
                mine.append(off)
                off += (hi - lo) * math.prod(shape[1:])
            offsets.append(mine)
            longest = max(longest, off)
        return offsets, longest

    def all_gather(self, names: list[str], slices: tuple[Tensor, ...]) -> list[Tensor]:
        offsets, longest = self._layout(names)
        ref = slices[0]
        mine = torch.zeros(longest, dtype=ref.dtype, device=ref.device)
        for _name, off, t in zip(names, offsets[self.dp.index], slices):
            mine[off:off + t.numel()] = t.reshape(-1)
        out = torch.empty(self.dp.size * longest, dtype=ref.dtype, device=ref.device)
        all_gather_into(out, mine, group=self.dp.group)
        out = out.view(self.dp.size, longest)
        whole = []
        for i, n in enumerate(names):
            bounds, shape = self.rows[n]
            row = math.prod(shape[1:])
            parts = [out[r, offsets[r][i]:offsets[r][i] + (hi - lo) * row] for r, (lo, hi) in enumerate(bounds)]
            whole.append(torch.cat(parts).view(shape))
        return whole

    def reduce_scatter(self, names: list[str], grads: tuple[Tensor | None, ...]) -> list[Tensor]:
        offsets, longest = self._layout(names)
        ref = self.shard.params[names[0]]
        send = torch.zeros(self.dp.size, longest, dtype=ref.dtype, device=ref.device)
        for i, (n, g) in enumerate(zip(names, grads)):
            if g is None:
                continue
            bounds, shape = self.rows[n]
            row = math.prod(shape[1:])
            for r, (lo, hi) in enumerate(bounds):
                send[r, offsets[r][i]:offsets[r][i] + (hi - lo) * row] = g[lo:hi].reshape(-1)
        recv = torch.empty(longest, dtype=ref.dtype, device=ref.device)
        reduce_scatter_into(recv, send.view(-1), group=self.dp.group)
        out = []
        for n, off in zip(names, offsets[self.dp.index]):
            p = self.shard.params[n]
            out.append(recv[off:off + p.numel()].view(p.shape))
        return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, z: Zero3Gather, names: list[str], *slices: Tensor) -> tuple[Tensor, ...]:
        ctx.z, ctx.names = z, names
        return tuple(z.all_gather(names, slices))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        return (None, None, *ctx.z.reduce_scatter(ctx.names, grads))


class DataParallel:
    """Flat buffers, gradient reduction and the optimizer step of one trainable shard."""

    def __init__(self, shard: Shard, *, groups: RankGroups, zero: int, adam: AdamConfig) -> None:
        self.shard, self.groups, self.zero, self.adam = shard, groups, zero, adam
        dp = groups.dp
        names = list(shard.params)
        numel = sum(shard.params[n].numel() for n in names)
        padded = numel if zero not in (1, 2) else math.ceil(numel / dp.size) * dp.size
        ref = next(iter(shard.params.values()))
        self.flat = torch.zeros(padded, dtype=torch.float32, device=ref.device)
        self.grad = torch.zeros_like(self.flat)
        self.views: dict[str, tuple[int, int]] = {}
        off = 0
        for n in names:
            p = shard.params[n]
            self.flat[off:off + p.numel()] = p.detach().reshape(-1)
            self.views[n] = (off, off + p.numel())
            new = torch.nn.Parameter(self.flat[off:off + p.numel()].view(p.shape))
            new.grad = self.grad[off:off + p.numel()].view(p.shape)
            shard.params[n] = new
            off += p.numel()
        # The part of the flat buffer this rank updates (and keeps Adam state for).
        self.owned = (0, padded) if zero not in (1, 2) else split_range(padded, dp.size, dp.index)
        size = self.owned[1] - self.owned[0]
        self.m = torch.zeros(size, dtype=torch.float32, device=ref.device)
        self.v = torch.zeros_like(self.m)
        self.steps = 0
        self.replicated = [n for n in names if _replicated_under_tp(shard, n)]
        self.embed = "model.embed_tokens.weight" if "model.embed_tokens.weight" in shard.params else None

    def zero_grad(self) -> None:
        self.grad.zero_()
        for n, (lo, hi) in self.views.items():  # autograd may have replaced a .grad; re-bind the views
            p = self.shard.params[n]
            if p.grad is None or p.grad.data_ptr() != self.grad[lo:hi].data_ptr():
                p.grad = self.grad[lo:hi].view(p.shape)

    def reduce_gradients(self) -> None:
        """Sum gradients: over the tensor-parallel group for replicated parameters under sequence
        parallel, across the stages sharing a tied embedding, and over the data-parallel group."""
        self._check_grads_in_buffer()
        tp = self.groups.tp
        if self.shard.tp.sequence_parallel and tp.size > 1 and self.replicated:
            parts = [self.grad[slice(*self.views[n])] for n in self.replicated]
            packed = torch.cat(parts)
            dist.all_reduce(packed, group=tp.group)
            off = 0
            for part in parts:
                part.copy_(packed[off:off + part.numel()])
                off += part.numel()
        tied = self.groups.tied
        if tied is not None and self.embed is not None:
            g = self.grad[slice(*self.views[self.embed])]
            dist.all_reduce(g, group=tied.group)
        dp = self.groups.dp
        if dp.size == 1 or self.zero == 3:  # ZeRO-3 gradients were reduce-scattered in backward
            return
        if self.zero in (0, 1):
            dist.all_reduce(self.grad, group=dp.group)
        else:
            mine = torch.empty(self.owned[1] - self.owned[0], dtype=self.grad.dtype, device=self.grad.device)
            reduce_scatter_into(mine, self.grad, group=dp.group)
            self.grad[self.owned[0]:self.owned[1]] = mine

    def step(self, *, lr: float) -> None:
        """Adam on this rank's part of the buffer; ZeRO 1/2 then share the updated parameters."""
        self.steps += 1
        lo, hi = self.owned
        with torch.no_grad():
            adam_update(self.flat[lo:hi], self.grad[lo:hi], self.m, self.v, step=self.steps, lr=lr, cfg=self.adam)
            if self.zero in (1, 2) and self.groups.dp.size > 1:
                all_gather_into(self.flat, self.flat[lo:hi].clone(), group=self.groups.dp.group)

    def moments(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Adam's (exp_avg, exp_avg_sq) of every parameter of the shard, shaped like it (views).
        Under ZeRO 1/2 the partitions are all-gathered over the data-parallel group first, so
        every rank of the group must call it; Adam is elementwise, so the gathered moments are
        the parameters' own."""
        m, v = self.m, self.v
        if self.zero in (1, 2) and self.groups.dp.size > 1:
            both = torch.empty(self.groups.dp.size * 2, self.m.numel(), dtype=self.m.dtype, device=self.m.device)
            all_gather_into(both, torch.stack([self.m, self.v]), group=self.groups.dp.group)
            m, v = both[0::2].reshape(-1), both[1::2].reshape(-1)  # rank r's pair sits at rows 2r, 2r+1
        return {n: (m[lo:hi].view(self.shard.params[n].shape), v[lo:hi].view(self.shard.params[n].shape))
                for n, (lo, hi) in self.views.items()}

    def load_moments(self, moments: dict[str, tuple[Tensor, Tensor]], *, steps: int) -> None:
        """Set Adam's state from whole-shard moments (as `moments` returns them) and its step
        count; each rank keeps its own partition."""
        whole_m, whole_v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        for n, (lo, hi) in self.views.items():
            m, v = moments[n]
            whole_m[lo:hi] = m.reshape(-1)
            whole_v[lo:hi] = v.reshape(-1)
        lo, hi = self.owned
        self.m.copy_(whole_m[lo:hi])
        self.v.copy_(whole_v[lo:hi])
        self.steps = steps

    def _check_grads_in_buffer(self) -> None:
        for n, (lo, hi) in self.views.items():
            p = self.shard.params[n]
            if p.grad is not None and p.grad.data_ptr() != self.grad[lo:hi].data_ptr():
                self.grad[lo:hi] += p.grad.reshape(-1)  # autograd allocated a new tensor: fold it in
                p.grad = self.grad[lo:hi].view(p.shape)


def _replicated_under_tp(shard: Shard, name: str) -> bool:
    for p in parameters(shard.spec, head=shard.head):
        if p.name == name:
            return p.tp_dim is None
    raise KeyError(name)


def apply_data_parallel(shard: Shard, *, groups: RankGroups, zero: int, trainable: bool,
                        adam: AdamConfig | None = None) -> DataParallel | None:
    """Split parameters for ZeRO-3 (the gather runs on use) and, for a trainable shard, set up the
    flat buffers, gradient reduction and optimizer partition of ZeRO `zero`."""
    if zero == 3 and groups.dp.size > 1:
        shard.gather = Zero3Gather(shard, dp=groups.dp, layout=groups.layout, local=groups.local)
    if not trainable:
        return None
    return DataParallel(shard, groups=groups, zero=zero if groups.dp.size > 1 else 0, adam=adam or AdamConfig())
