"""Data parallelism: gradient reduction over the data-parallel group and ZeRO 1/2/3.

A shard's parameters are views into one flat fp32 buffer and their gradients views into a
second one, so reductions and the optimizer work on a few large tensors:

- ZeRO 0: all-reduce the gradients; every rank updates every parameter.
- ZeRO 1: all-reduce gradients; each rank keeps Adam state for, and updates, one contiguous
  1/dp of the flat buffer, then the buffer is all-gathered (Rajbhandari et al. 2020).
- ZeRO 2: as 1, but each rank receives only the sum of its part (a reduce to its owner).
- ZeRO 3: parameters are split further along dim 0 across the group (the boxes of
  `plans.sharding.shard_box`); `Zero3Gather` all-gathers a layer's parameters when it runs and
  reduce-scatters their gradients in backward (asynchronously: backward goes on while a layer's
  sums travel, and they are added to the slices' gradients before the step), so each rank
  stores only its own slices at rest (and gradients and optimizer state for them). As FSDP's
  forward prefetch, while a use runs, the gather of the next one (in the order the uses came the
  first time, either way along it: the recomputed forward of backward goes back) is already
  under way. Autograd keeps a gathered weight until its layer's backward unless recompute is
  ``full`` (the gather is then inside the checkpointed layer and redone in backward, as FSDP
  does); generation gathers a stage once per call.

As in DDP (Li et al. 2020), the reduction overlaps the backward pass: the buffer is cut into
buckets of about BUCKET_BYTES of consecutive parameters, and during the backward of a
minibatch's last micro-batch a bucket's collective starts, asynchronously, as soon as the last
of its parameters' gradients has been accumulated (a post-accumulate-grad hook); the step waits
for them all. Parameters whose gradients need another reduction first (replicated parameters
under sequence parallel, summed over the tensor-parallel group; a tied embedding shared by two
stages) are reduced after the backward, in that order. Under context parallel every gradient is
a share over the rank's positions, so ZeRO 0-2 treat the data-parallel and context-parallel
ranks as one group (`RankGroups.dpcp`, as Megatron-core's distributed optimizer does): one
reduction sums both, bucketed as above, and ZeRO 1/2 partition the buffer over all of them.
ZeRO-3's slices are the data-parallel axis's (`plans.sharding`), the cp ranks holding the same
ones: their gradients are reduce-scattered over dp in backward, then the slices summed over the
cp group after it. Buckets fire in the order autograd reaches them, the same on every rank of
the group.

With a GaLore optimizer (`runtime.galore`, `Layout.galore`) the projected matrices leave Adam's
runs of the buffer and get their low-rank step instead; under ZeRO-1 the buffer's partitions
then fall on parameter boundaries (each rank's owned run of parameters padded to one chunk
size), so a rank updates whole matrices and the all-gather shares them.

Gradients are sums, not means: losses are normalised by the global token (or sequence) count
of the minibatch, so the summed gradient over ranks and micro-batches equals the gradient of the
single-process loss. Adam is elementwise, so any partition of the buffer gives the same update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plans.errors import PlannerError
from plans.layout import GaLore, Layout
from plans.sharding import Param, galore_projected, parameters, shard_box, split_range
from runtime.galore import GaLoreStep, Matrix
from runtime.galore import owners as galore_owners
from runtime.groups import Axis, RankGroups, all_gather_into, reduce_scatter_into
from runtime.model import Shard
from runtime.offload import to_device, to_host

BUCKET_BYTES = 25 * 2**20  # gradient bucket size (DDP's default bucket_cap_mb)
ALIGN_ELEMENTS = 16  # parameters start at 64-byte boundaries of the flat buffer
SCATTERS_IN_FLIGHT = 2  # ZeRO-3 gradient reduce-scatters running while backward goes on


@dataclass(frozen=True)
class AdamConfig:
    """AdamW hyperparameters (Loshchilov & Hutter 2019); the learning rate comes per call."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


def adam_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, *, step: int, lr: float, cfg: AdamConfig) -> None:
    """One AdamW step on flat tensors, in place (torch.optim.AdamW's formula), with torch's fused
    kernel (one pass over the four tensors, as ``AdamW(fused=True)``) where it has one, else as
    plain tensor ops (eight passes and a temporary)."""
    fused = getattr(torch, "_fused_adamw_", None)
    if fused is not None and p.device.type in ("cpu", "cuda") and p.dtype == torch.float32:
        fused([p], [g], [m], [v], [], [torch.full((), float(step), device=p.device)], lr=lr, beta1=cfg.beta1,
              beta2=cfg.beta2, weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False)
        return
    m.mul_(cfg.beta1).add_(g, alpha=1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(g, g, value=1 - cfg.beta2)
    bias1 = 1 - cfg.beta1 ** step
    bias2 = 1 - cfg.beta2 ** step
    denom = (v.sqrt() / math.sqrt(bias2)).add_(cfg.eps)
    if cfg.weight_decay:
        p.mul_(1 - lr * cfg.weight_decay)
    p.addcdiv_(m, denom, value=-lr / bias1)


class Zero3Gather:
    """All-gathers dim-0 slices of parameters (dim 1 of stacked experts) over the data-parallel group for one use; its
    backward reduce-scatters the gradients back to the slices (summed over the group)."""

    def __init__(self, shard: Shard, *, dp: Axis, layout: Layout, local: int) -> None:
        self.shard, self.dp = shard, dp
        whole = layout.model_copy(update={"zero": 0})
        # name -> (rows per dp rank [(start, stop)], shape of the tensor-parallel slice); the rows
        # lie along dim 0, or dim 1 of stacked experts (`plans.sharding.shard_box`)
        self.rows: dict[str, tuple[list[tuple[int, int]], tuple[int, ...]]] = {}
        self.dim: dict[str, int] = {}
        for p in parameters(shard.spec, head=shard.head):
            box = shard_box(p, shard.spec, whole, local)
            if box is None:
                continue
            shape = tuple(hi - lo for lo, hi in box)
            d = self.dim[p.name] = 1 if p.expert_dim is not None else 0
            self.rows[p.name] = ([split_range(shape[d], dp.size, r) for r in range(dp.size)], shape)
        self._order: dict[tuple[str, ...], int] = {}  # the uses, numbered in the order first seen
        self._uses: list[tuple[str, ...]] = []
        self._last = -1
        self._ahead: _Ahead | None = None
        self.served_ahead = 0  # uses whose gather was already under way when they came
        self._scattering: list[tuple[Any, Tensor, Tensor, list[str], list[int]]] = []  # reduce-scatters under way

    def __call__(self, names: list[str]) -> list[Tensor]:
        return list(_GatherRows.apply(self, names, *[self.shard.params[n] for n in names]))

    def drop(self) -> None:
        """Discard a gather started ahead (the parameters are about to change)."""
        if self._ahead is not None:
            self._ahead.work.wait()  # the collective still completes on every rank
            self._ahead = None

    def _start(self, names: tuple[str, ...], slices: tuple[Tensor, ...]) -> _Ahead:
        offsets, longest = self._layout(list(names))
        ref = slices[0]
        mine = torch.zeros(longest, dtype=ref.dtype, device=ref.device)
        for off, t in zip(offsets[self.dp.index], slices):
            mine[off:off + t.numel()] = t.reshape(-1)
        out = torch.empty(self.dp.size * longest, dtype=ref.dtype, device=ref.device)
        work = all_gather_into(out, mine, group=self.dp.group, async_op=True)
        return _Ahead(names, tuple((t.data_ptr(), t._version) for t in slices), work, out.view(self.dp.size, longest),
                      offsets)

    def _prefetch_after(self, key: tuple[str, ...]) -> None:
        """Start the gather of the use after `key` in the direction the uses are going."""
        at = self._order.setdefault(key, len(self._order))
        if at == len(self._uses):
            self._uses.append(key)
        step, self._last = (1 if at == 0 else at - self._last), at
        if step in (1, -1) and 0 <= at + step < len(self._uses):
            nxt = self._uses[at + step]
            self._ahead = self._start(nxt, tuple(self.shard.params[n].detach() for n in nxt))

    def _layout(self, names: list[str]) -> tuple[list[list[int]], int]:
        """Per dp rank, the element offsets of each name's slice in that rank's packed chunk."""
        offsets, longest = [], 0
        for r in range(self.dp.size):
            off, mine = 0, []
            for n in names:
                (lo, hi), shape = self.rows[n][0][r], self.rows[n][1]
                mine.append(off)
                off += (hi - lo) * math.prod(shape) // shape[self.dim[n]] if shape[self.dim[n]] else 0
            offsets.append(mine)
            longest = max(longest, off)
        return offsets, longest

    def all_gather(self, names: list[str], slices: tuple[Tensor, ...]) -> list[Tensor]:
        key = tuple(names)
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.names != key or ahead.stamp != tuple((t.data_ptr(), t._version) for t in slices):
            if ahead is not None:
                ahead.work.wait()  # a guess that missed (every rank guesses alike): discarded
            ahead = self._start(key, slices)
        else:
            self.served_ahead += 1
        ahead.work.wait()
        self._prefetch_after(key)
        out, offsets = ahead.out, ahead.offsets
        whole = []
        for i, n in enumerate(names):
            bounds, shape = self.rows[n]
            d = self.dim[n]
            row = math.prod(shape) // shape[d] if shape[d] else 0
            parts = [out[r, offsets[r][i]:offsets[r][i] + (hi - lo) * row].view(
                *shape[:d], hi - lo, *shape[d + 1:]) for r, (lo, hi) in enumerate(bounds)]
            whole.append(torch.cat(parts, dim=d))
        return whole

    def reduce_scatter(self, names: list[str], grads: tuple[Tensor | None, ...]) -> None:
        """Start summing the gathered gradients over the group into each rank's slices; backward
        goes on meanwhile (`finish` adds them to the slices' gradients). At most
        SCATTERS_IN_FLIGHT run at once, so their buffers stay a layer or two."""
        offsets, longest = self._layout(names)
        ref = self.shard.params[names[0]]
        send = torch.zeros(self.dp.size, longest, dtype=ref.dtype, device=ref.device)
        for i, (n, g) in enumerate(zip(names, grads)):
            if g is None:
                continue
            bounds, shape = self.rows[n]
            d = self.dim[n]
            row = math.prod(shape) // shape[d] if shape[d] else 0
            for r, (lo, hi) in enumerate(bounds):
                send[r, offsets[r][i]:offsets[r][i] + (hi - lo) * row] = g.narrow(d, lo, hi - lo).reshape(-1)
        recv = torch.empty(longest, dtype=ref.dtype, device=ref.device)
        work = reduce_scatter_into(recv, send.view(-1), group=self.dp.group, async_op=True)
        self._scattering.append((work, send, recv, names, offsets[self.dp.index]))
        while len(self._scattering) > SCATTERS_IN_FLIGHT:
            self._land(self._scattering.pop(0))

    def finish(self) -> None:
        """Wait for every reduce-scatter started in backward and add its sums to the gradients."""
        while self._scattering:
            self._land(self._scattering.pop(0))

    def _land(self, item: tuple[Any, Tensor, Tensor, list[str], list[int]]) -> None:
        work, _send, recv, names, offsets = item
        work.wait()
        for n, off in zip(names, offsets):
            p = self.shard.params[n]
            got = recv[off:off + p.numel()].view(p.shape)
            if p.grad is None:
                p.grad = got.clone()
            else:
                p.grad.add_(got)


@dataclass
class _Ahead:
    """An all-gather under way: the uses' names, the (address, version) of the slices it read
    (a changed slice makes it stale), its work handle, its output [dp, longest], the offsets."""

    names: tuple[str, ...]
    stamp: tuple[tuple[int, int], ...]
    work: Any
    out: Tensor
    offsets: list[list[int]]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, z: Zero3Gather, names: list[str], *slices: Tensor) -> tuple[Tensor, ...]:
        ctx.z, ctx.names = z, names
        return tuple(z.all_gather(names, slices))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        # The slices' gradients arrive by reduce-scatter after backward has gone on (`finish`):
        # autograd gets none for them here.
        ctx.z.reduce_scatter(ctx.names, grads)
        return (None, None, *([None] * len(ctx.names)))


class DataParallel:
    """Flat buffers, gradient reduction and the optimizer step of one trainable shard."""

    def __init__(self, shard: Shard, *, groups: RankGroups, zero: int, adam: AdamConfig,
                 galore: GaLore | None = None) -> None:
        self.shard, self.groups, self.zero, self.adam = shard, groups, zero, adam
        # ZeRO 0-2 reduce (and partition) over the data-parallel and context-parallel ranks
        # together; ZeRO-3's slices are the dp axis's, the cp ranks holding the same ones.
        dp = self.dp = groups.dpcp if groups.dpcp is not None and zero != 3 else groups.dp
        names = list(shard.params)
        # Each parameter starts at a multiple of ALIGN_ELEMENTS (64 bytes): matmul kernels run
        # slower on weights at an arbitrary offset than on separately allocated ones.
        sizes = [-(-shard.params[n].numel() // ALIGN_ELEMENTS) * ALIGN_ELEMENTS for n in names]
        starts, numel = {}, 0
        for n, size in zip(names, sizes):
            starts[n] = numel
            numel += size
        padded = numel if zero not in (1, 2) else math.ceil(numel / dp.size) * dp.size
        catalog = {p.name: p for p in parameters(shard.spec, head=shard.head)}
        owner = dict(zip(names, galore_owners([_nominal(catalog[n], shard.params[n].shape, groups.tp.size)
                                               for n in names], dp.size))) if galore is not None else {}
        if galore is not None and zero == 1:
            # A rank's partition is exactly the parameters it owns (`runtime.galore`): each
            # rank's run of parameters starts its own chunk of the buffer, all chunks one size.
            chunk = max(sum(size for n, size in zip(names, sizes) if owner[n] == r) for r in range(dp.size))
            chunk = max(ALIGN_ELEMENTS, chunk)
            fill = [0] * dp.size
            for n, size in zip(names, sizes):
                starts[n] = owner[n] * chunk + fill[owner[n]]
                fill[owner[n]] += size
            padded = chunk * dp.size
        ref = next(iter(shard.params.values()))
        self.flat = torch.zeros(padded, dtype=torch.float32, device=ref.device)
        self.grad = torch.zeros_like(self.flat)
        self.views: dict[str, tuple[int, int]] = {}
        for n in names:
            p, off = shard.params[n], starts[n]
            self.flat[off:off + p.numel()] = p.detach().reshape(-1)
            self.views[n] = (off, off + p.numel())
            new = torch.nn.Parameter(self.flat[off:off + p.numel()].view(p.shape))
            new.grad = self.grad[off:off + p.numel()].view(p.shape)
            shard.params[n] = new
        # The part of the flat buffer this rank updates (and keeps Adam state for).
        self.owned = (0, padded) if zero not in (1, 2) else split_range(padded, dp.size, dp.index)
        lo, hi = self.owned
        # Where AdamW runs: the owned part, less the matrices GaLore projects (runs of the buffer
        # between them; gaps of alignment padding hold zeros and stay zero).
        self.adam_runs = [(lo, hi)]
        self.galore: GaLoreStep | None = None
        if galore is not None:
            projected = {n: _matrix(catalog[n], groups.tp.size) for n in names if galore_projected(catalog[n], galore.rank)}
            self.galore = GaLoreStep(galore, projected, owner, dp=dp, tp=groups.tp, zero=zero, device=ref.device)
            self.adam_runs = _runs_between(lo, hi, sorted(self.views[n] for n in projected))
        size = sum(b - a for a, b in self.adam_runs)
        self.m = torch.zeros(size, dtype=torch.float32, device=ref.device)
        self.v = torch.zeros_like(self.m)
        self.on_host = False  # Adam's moments wait in host memory (`optimizer_to_host`)
        self.steps = 0
        self.replicated = [n for n in names if _replicated_under_tp(shard, n)]
        expert_names = {p.name for p in parameters(shard.spec, head=shard.head) if p.expert_dim is not None}
        self._experts = [n for n in names if n in expert_names]
        # Per-head q/k norms (Qwen3) are whole on every tensor-parallel rank but each rank uses
        # them on its own heads: their gradients are partial sums over the group, with or
        # without sequence parallel.
        self.partial = [n for n in names if shard.spec.qk_norm == "head" and n.endswith(("q_norm.weight", "k_norm.weight"))]
        self.embed = "model.embed_tokens.weight" if "model.embed_tokens.weight" in shard.params else None
        self._late = self._late_names(names)
        self._buckets = self._make_buckets(names) if dp.size > 1 and self.zero != 3 else []
        self._armed = False
        self._waiting: list[Any] = []
        for b, bucket in enumerate(self._buckets):
            for n in bucket.names:
                shard.params[n].register_post_accumulate_grad_hook(partial(self._accumulated, b, n))

    def _late_names(self, names: list[str]) -> set[str]:
        """Parameters reduced after the backward: those needing a tensor-parallel or tied-stage
        sum before the data-parallel one, and a tied embedding used twice by one stage (its
        gradient is accumulated twice, so no single accumulation says it is complete)."""
        late = set(self._tp_summed())
        # Routed experts a rank's tokens miss get no gradient, so their buckets would fill in a
        # different order on different ranks: they are reduced after the backward, in order.
        late |= set(self._experts)
        if self.embed is not None and self.shard.spec.tied:
            late.add(self.embed)
        return late

    def _tp_summed(self) -> list[str]:
        """Parameters whose gradients are summed over the tensor-parallel group before anything else."""
        if self.groups.tp.size == 1:
            return []
        summed = self.replicated if self.shard.tp.sequence_parallel else []
        return list(dict.fromkeys([*summed, *self.partial]))

    def _make_buckets(self, names: list[str]) -> list[_Bucket]:
        """Runs of consecutive non-late parameters, last first (the order backward reaches them),
        cut at about BUCKET_BYTES."""
        buckets: list[_Bucket] = []
        run: list[str] = []

        def close() -> None:
            if run:
                lo, hi = self.views[run[-1]][0], self.views[run[0]][1]
                buckets.append(_Bucket(names=tuple(run), lo=lo, hi=hi))
                run.clear()

        for n in reversed(names):
            if n in self._late:
                close()
                continue
            run.append(n)
            if (self.views[run[0]][1] - self.views[run[-1]][0]) * self.grad.element_size() >= BUCKET_BYTES:
                close()
        close()
        return buckets

    def arm(self) -> None:
        """The next backward is the minibatch's last: start each bucket's reduction when it is complete."""
        self._armed = bool(self._buckets)
        for bucket in self._buckets:
            bucket.pending = set(bucket.names)
            bucket.started = False

    def _accumulated(self, b: int, name: str, p: Tensor) -> None:
        if not self._armed:
            return
        self._fold(name)
        bucket = self._buckets[b]
        bucket.pending.discard(name)
        if not bucket.pending and not bucket.started:
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        bucket.started = True
        self._waiting.extend(self._reduce_range(bucket.lo, bucket.hi))

    def _reduce_range(self, lo: int, hi: int, axis: Axis | None = None) -> list[Any]:
        """Start summing gradients [lo, hi) of the flat buffer over the data-parallel group (or
        `axis`): everywhere (ZeRO 0/1), or on the rank whose partition holds them (ZeRO 2); the
        work handles to wait on."""
        dp = axis if axis is not None else self.dp
        if dp.size == 1:
            return []
        if self.zero in (0, 1):
            return [dist.all_reduce(self.grad[lo:hi], group=dp.group, async_op=True)]
        works = []
        for r in range(dp.size):
            a, b = split_range(self.flat.numel(), dp.size, r)
            a, b = max(a, lo), min(b, hi)
            if a < b:
                works.append(dist.reduce(self.grad[a:b], dst=dp.ranks[r], group=dp.group, async_op=True))
        return works

    def zero_grad(self) -> None:
        self.grad.zero_()
        for n, (lo, hi) in self.views.items():  # autograd may have replaced a .grad; re-bind the views
            p = self.shard.params[n]
            if p.grad is None or p.grad.data_ptr() != self.grad[lo:hi].data_ptr():
                p.grad = self.grad[lo:hi].view(p.shape)

    def reduce_gradients(self) -> None:
        """Finish the sums: wait for the buckets started during backward (and start any that
        did not fill), then sum the late parameters over the tensor-parallel group (replicated
        ones under sequence parallel), across the stages sharing a tied embedding, and over the
        data-parallel group."""
        if isinstance(self.shard.gather, Zero3Gather):
            self.shard.gather.finish()
        self._check_grads_in_buffer()
        if self._buckets:
            self._finish_buckets()
        cp = self.groups.cp
        if cp.size > 1 and self.zero == 3:  # each rank's slices' gradients are its positions' share
            dist.all_reduce(self.grad, group=cp.group)
        tp = self.groups.tp
        summed = self._tp_summed()
        if summed:
            parts = [self.grad[slice(*self.views[n])] for n in summed]
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
        if self.dp.size == 1 or self.zero == 3:  # ZeRO-3 gradients were reduce-scattered in backward
            return
        experts = set(self._experts)
        works = [w for n in sorted(self._late, key=lambda n: self.views[n][0])
                 for w in self._reduce_range(*self.views[n], self.groups.expert_dp if n in experts else None)]
        for work in works:  # issued together, waited once
            work.wait()

    def _finish_buckets(self) -> None:
        if not self._armed:  # a backward that was not armed (a caller outside `train`): reduce now
            self.arm()
        for bucket in self._buckets:
            if not bucket.started:  # some parameter had no gradient this minibatch
                self._start(bucket)
        for work in self._waiting:
            work.wait()
        self._waiting.clear()
        self._armed = False

    def step(self, *, lr: float) -> None:
        """Adam on this rank's part of the buffer; ZeRO 1/2 then share the updated parameters."""
        self.steps += 1
        if isinstance(self.shard.gather, Zero3Gather):
            self.shard.gather.drop()
        lo, hi = self.owned
        if self.on_host:
            raise RuntimeError("the optimizer step ran while Adam's moments were in host memory (optimizer_to_device first)")
        with torch.no_grad():
            at = 0
            for a, b in self.adam_runs:
                adam_update(self.flat[a:b], self.grad[a:b], self.m[at:at + b - a], self.v[at:at + b - a],
                            step=self.steps, lr=lr, cfg=self.adam)
                at += b - a
            if self.galore is not None:
                views = {n: self.views[n] for n in self.galore.names}
                cfg = self.adam
                self.galore.step({n: self.shard.params[n].data for n in views},
                                 {n: self.grad[a:b].view(self.shard.params[n].shape) for n, (a, b) in views.items()},
                                 step=self.steps, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
            if self.zero in (1, 2) and self.dp.size > 1:
                all_gather_into(self.flat, self.flat[lo:hi].clone(), group=self.dp.group)

    def optimizer_to_host(self) -> None:
        """Move Adam's moments to host memory (`Layout.offload` ``optimizer``), releasing the
        device's copies; `optimizer_to_device` brings them back before the next step."""
        if not self.on_host:
            self.m, self.v = to_host(self.m), to_host(self.v)
            if self.galore is not None:
                self.galore.to_host()
            self.on_host = True

    def optimizer_to_device(self) -> None:
        if self.on_host:
            self.m, self.v = to_device(self.m, self.flat.device), to_device(self.v, self.flat.device)
            if self.galore is not None:
                self.galore.to_device(self.flat.device)
            self.on_host = False

    def moments(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Adam's (exp_avg, exp_avg_sq) of every parameter of the shard, shaped like it (views).
        Under ZeRO 1/2 the partitions are all-gathered over the data-parallel group first, so
        every rank of the group must call it; Adam is elementwise, so the gathered moments are
        the parameters' own."""
        if self.galore is not None:
            raise PlannerError("checkpoints do not hold a GaLore optimizer's low-rank states yet",
                               hint="run this plan without --checkpoint-dir, or compile it without --galore-rank")
        m, v = self.m, self.v
        if self.on_host:  # gathered on the device (NCCL sends device tensors), as a step would use them
            m, v = to_device(m, self.flat.device), to_device(v, self.flat.device)
        if self.zero in (1, 2) and self.dp.size > 1:
            both = torch.empty(self.dp.size * 2, m.numel(), dtype=m.dtype, device=m.device)
            all_gather_into(both, torch.stack([m, v]), group=self.dp.group)
            m, v = both[0::2].reshape(-1), both[1::2].reshape(-1)  # rank r's pair sits at rows 2r, 2r+1
        return {n: (m[lo:hi].view(self.shard.params[n].shape), v[lo:hi].view(self.shard.params[n].shape))
                for n, (lo, hi) in self.views.items()}

    def load_moments(self, moments: dict[str, tuple[Tensor, Tensor]], *, steps: int) -> None:
        """Set Adam's state from whole-shard moments (as `moments` returns them) and its step
        count; each rank keeps its own partition."""
        if self.galore is not None:
            raise PlannerError("checkpoints do not hold a GaLore optimizer's low-rank states yet",
                               hint="resume with a plan compiled without --galore-rank")
        whole_m, whole_v = torch.zeros_like(self.flat), torch.zeros_like(self.flat)
        for n, (lo, hi) in self.views.items():
            m, v = moments[n]
            whole_m[lo:hi] = m.reshape(-1)
            whole_v[lo:hi] = v.reshape(-1)
        lo, hi = self.owned
        self.m.copy_(whole_m[lo:hi])  # on the host or the device, wherever the moments are
        self.v.copy_(whole_v[lo:hi])
        self.steps = steps

    def _check_grads_in_buffer(self) -> None:
        for n in self.views:
            self._fold(n)

    def _fold(self, name: str) -> None:
        """Keep `name`'s gradient in the flat buffer: if autograd allocated a new tensor, add it in."""
        lo, hi = self.views[name]
        p = self.shard.params[name]
        if p.grad is not None and p.grad.data_ptr() != self.grad[lo:hi].data_ptr():
            self.grad[lo:hi] += p.grad.reshape(-1)
            p.grad = self.grad[lo:hi].view(p.shape)


def _matrix(param: Param, tp: int) -> Matrix:
    """A projected matrix as the `tp` ranks of a tensor-parallel group hold it (`plans.sharding`)."""
    m, n = param.shape
    d = param.tp_dim
    if tp == 1 or d is None:
        return Matrix((m, n), None, ())
    return Matrix((m, n), d, tuple(split_range(param.shape[d], tp, i) for i in range(tp)))


def _nominal(param: Param, local: torch.Size, tp: int) -> int:
    """The size a GaLore owner is chosen by (`runtime.galore.owners`): the slice's elements, with
    a tensor-parallel split counted as its largest part, so every rank of the group sizes the
    shard's parameters alike and gives a matrix's slices owners of one data-parallel index."""
    n, d = math.prod(local), param.tp_dim
    if tp == 1 or d is None or local[d] == 0:
        return n
    return n // local[d] * -(-param.shape[d] // tp)


def _runs_between(lo: int, hi: int, holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty runs of [lo, hi) outside the sorted ranges `holes`."""
    out, at = [], lo
    for a, b in holes:
        if b <= lo or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


@dataclass
class _Bucket:
    """Consecutive parameters whose gradients [lo, hi) of the flat buffer are reduced together."""

    names: tuple[str, ...]
    lo: int
    hi: int
    pending: set[str] = field(default_factory=set)
    started: bool = False


def _replicated_under_tp(shard: Shard, name: str) -> bool:
    for p in parameters(shard.spec, head=shard.head):
        if p.name == name:
            return p.tp_dim is None
    raise KeyError(name)


def apply_data_parallel(shard: Shard, *, groups: RankGroups, zero: int, trainable: bool,
                        adam: AdamConfig | None = None, galore: GaLore | None = None) -> DataParallel | None:
    """Split parameters for ZeRO-3 (the gather runs on use) and, for a trainable shard, set up the
    flat buffers, gradient reduction and optimizer partition of ZeRO `zero`."""
    if zero == 3 and groups.dp.size > 1:
        shard.gather = Zero3Gather(shard, dp=groups.dp, layout=groups.layout, local=groups.local)
    if not trainable:
        return None
    return DataParallel(shard, groups=groups, zero=zero if groups.dp.size > 1 else 0, adam=adam or AdamConfig(),
                        galore=galore)
