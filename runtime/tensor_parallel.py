"""Tensor parallelism: the collectives a sharded decoder layer needs, as autograd functions.

Megatron-LM's scheme (Shoeybi et al. 2019, and Korthikanti et al. 2022 for sequence parallel).
Column-parallel linears (q/k/v, gate/up) hold a block of output rows, row-parallel linears
(o_proj, down_proj) a block of input columns, so one attention or MLP block needs one
reduction of its output over the tensor-parallel group:

- without sequence parallel the residual stream is replicated: `enter` is identity forward and
  all-reduce backward, `exit` is all-reduce forward and identity backward;
- with sequence parallel the residual stream (norms, residual adds, dropout) is split along the
  sequence: `enter` all-gathers the sequence forward (reduce-scatter backward), `exit`
  reduce-scatters it (all-gather backward). Replicated parameters then see only their rank's
  sequence chunk, so their gradients are summed over the group (`data_parallel` does that).

The vocabulary of the embedding and of the LM head is split across the group (numpy
``array_split`` bounds, as `plans.sharding.split_range`); `vocab_embedding`, `vocab_logprobs`
and `vocab_choose` never gather the full ``[tokens, vocab]`` logits. Every function is the plain
single-process operation when the group has one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plans.sharding import split_range
from runtime.groups import all_gather_into, reduce_scatter_into


@dataclass(frozen=True)
class TensorParallel:
    """A rank's tensor-parallel group; `size == 1` means no tensor parallelism."""

    group: Any = None  # torch.distributed ProcessGroup, None when size == 1
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """The [start, stop) vocabulary rows this rank holds."""
        return split_range(vocab_size, self.size, self.rank)


def apply_tensor_parallel(*, group: Any, size: int, rank: int, sequence_parallel: bool) -> TensorParallel:
    """The tensor-parallel context of a rank (its slices come from `plans.sharding.shard_box`)."""
    if size == 1:
        return TensorParallel()
    return TensorParallel(group=group, size=size, rank=rank, sequence_parallel=sequence_parallel)


# Collectives along the sequence dim (dim 1 of [batch, seq, hidden]) -------------------------


def _all_gather_seq(x: Tensor, tp: TensorParallel) -> Tensor:
    xs = x.transpose(0, 1).contiguous()  # [s/tp, b, h]: collectives split dim 0
    out = torch.empty((xs.shape[0] * tp.size, *xs.shape[1:]), dtype=xs.dtype, device=xs.device)
    all_gather_into(out, xs, group=tp.group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: Tensor, tp: TensorParallel) -> Tensor:
    xs = x.transpose(0, 1).contiguous()  # [s, b, h]
    out = torch.empty((xs.shape[0] // tp.size, *xs.shape[1:]), dtype=xs.dtype, device=xs.device)
    reduce_scatter_into(out, xs, group=tp.group)
    return out.transpose(0, 1).contiguous()


def _all_reduce(x: Tensor, tp: TensorParallel) -> Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=tp.group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(g, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        # `x` is a row-parallel matmul's partial sum, which nothing else reads: reduce it in
        # place (no copy of [b, s, h] per layer and block); autograd is told it changed.
        if x.is_contiguous():
            dist.all_reduce(x, group=tp.group)
            ctx.mark_dirty(x)
            return x
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        ctx.tp = tp
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return _reduce_scatter_seq(g, ctx.tp), None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        ctx.tp = tp
        return _reduce_scatter_seq(x, tp)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return _all_gather_seq(g, ctx.tp), None


class _GatherSeqExact(torch.autograd.Function):
    """All-gather whose backward takes this rank's chunk (the consumer is replicated, not partial)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tp: TensorParallel) -> Tensor:
        ctx.tp = tp
        ctx.chunk = x.shape[1]
        return _all_gather_seq(x, tp)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        lo = ctx.tp.rank * ctx.chunk
        return g[:, lo:lo + ctx.chunk].contiguous(), None


def enter(x: Tensor, tp: TensorParallel, *, sp: bool) -> Tensor:
    """Input of a column-parallel block: [b, s, h] replicated, or [b, s/tp, h] under sequence parallel."""
    if tp.size == 1:
        return x
    return _GatherSeq.apply(x, tp) if sp else _CopyToTP.apply(x, tp)


def exit(x: Tensor, tp: TensorParallel, *, sp: bool) -> Tensor:  # noqa: A001 - pairs with `enter`
    """Output of a row-parallel block (partial sums) reduced over the group."""
    if tp.size == 1:
        return x
    return _ReduceScatterSeq.apply(x, tp) if sp else _ReduceFromTP.apply(x, tp)


def gather_seq(x: Tensor, tp: TensorParallel, *, sp: bool) -> Tensor:
    """The full sequence of a sequence-parallel activation whose consumer is replicated per rank
    (values of a value head); backward keeps this rank's chunk."""
    if tp.size == 1 or not sp:
        return x
    return _GatherSeqExact.apply(x, tp)


def reduce_sum(x: Tensor, tp: TensorParallel) -> Tensor:
    """Sum over the group forward, identity backward (each rank back-props its own part)."""
    if tp.size == 1:
        return x
    return _ReduceFromTP.apply(x, tp)


def gather_ids(ids: Tensor, tp: TensorParallel) -> Tensor:
    """The full sequence [b, s, ...] of integer ids each rank holds a chunk of (no gradient)."""
    return _all_gather_seq(ids, tp)


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over a group, `send` rows to each rank in order; backward sends the
    gradients the other way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, recv: list[int], send: list[int], group: Any) -> Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Any, ...]:
        out = g.new_empty((sum(ctx.send), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, recv: list[int], send: list[int], group: Any) -> Tensor:
    """`x`'s rows split by `send` go to the group's ranks in order; `recv` rows come from each."""
    return _AllToAll.apply(x, recv, send, group)


# Vocabulary-parallel embedding, log-probs and token choice ---------------------------------


def vocab_embedding(tokens: Tensor, weight: Tensor, tp: TensorParallel, *, vocab_size: int, sp: bool) -> Tensor:
    """Rows of the embedding for `tokens` [b, s] -> [b, s, h] (or [b, s/tp, h] under sequence parallel)."""
    if tp.size == 1:
        return torch.nn.functional.embedding(tokens, weight)
    lo, hi = tp.vocab_range(vocab_size)
    outside = (tokens < lo) | (tokens >= hi)
    local = torch.nn.functional.embedding((tokens - lo).masked_fill(outside, 0), weight)
    local = local.masked_fill(outside.unsqueeze(-1), 0.0)
    return exit(local, tp, sp=sp)


def vocab_logprobs(logits: Tensor, targets: Tensor, tp: TensorParallel, *, vocab_size: int) -> Tensor:
    """log softmax(logits)[target] for vocab-sharded `logits` [..., V/tp] and `targets` [...], in
    fp32, without autograd (generation's chosen tokens; training's go through `head_logprobs`)."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    return _chunk_logprobs(flat, targets.reshape(-1), tp, vocab_size)[0].view(targets.shape)


def vocab_choose(scores: Tensor, tp: TensorParallel, *, vocab_size: int) -> Tensor:
    """Global index of the highest score per row for vocab-sharded `scores` [b, V/tp] (ties: lowest index)."""
    best, idx = scores.max(dim=-1)
    if tp.size == 1:
        return idx
    lo, _ = tp.vocab_range(vocab_size)
    pair = torch.stack([best.double(), (idx + lo).double()], dim=-1)  # [b, 2]
    out = torch.empty((tp.size * pair.shape[0], 2), dtype=pair.dtype, device=pair.device)
    all_gather_into(out, pair.contiguous(), group=tp.group)
    out = out.view(tp.size, -1, 2)
    # Ranks hold ascending vocabulary blocks, so the first maximum over ranks is the lowest index.
    winner = out[..., 0].argmax(dim=0)  # [b]
    return out[..., 1].gather(0, winner.unsqueeze(0)).squeeze(0).long()


# The LM head fused with the log-probs of the targets ---------------------------------------


def head_logprobs(h: Tensor, weight: Tensor, targets: Tensor, tp: TensorParallel, *, vocab_size: int,
                  chunk_elements: int) -> Tensor:
    """log softmax(h @ weight^T)[target], fp32 [n], for hidden states `h` [n, hidden] (replicated
    over the group), this rank's vocabulary rows `weight` [V/tp, hidden] and `targets` [n].

    The logits are made a chunk of at most `chunk_elements` (tokens x V/tp) at a time, in the
    compute dtype (autocast's, else `h`'s), and turned into fp32 log-probs there: the full fp32
    ``[n, V]`` logits never exist, nor the ``slice_backward`` and upcast copies autograd would
    keep over them. Backward makes each chunk's logits again (one more head matmul, Liger-style)
    unless all of them fit one chunk: that chunk's log-softmax (with one rank; the logits with
    several) is kept instead, which costs no extra peak memory because a pipeline's last stage
    runs a micro-batch's backward right after its forward. Gradients are those of the unfused
    ops to rounding. The weight is cast to the compute dtype once per call and direction, `h`
    once per direction, whatever the number of chunks.

    Made again, the logits are cut along whichever side is longer, so that the gradient summed
    over chunks (in fp32, one kernel per chunk) is the smaller one: with fewer tokens than
    vocabulary rows on the rank (the usual case), a chunk is a slice of the vocabulary over every
    token, each slice of the weight's gradient is made once by one GEMM, and the chunks add into
    the input's gradient [n, hidden]; otherwise a chunk is a run of tokens and the chunks add
    into the weight's [V/tp, hidden]. The softmax needs no pass over the whole vocabulary there:
    forward kept each token's log-sum-exp."""
    device = h.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    with torch.autocast(device_type=device, enabled=False):
        return _HeadLogprobs.apply(h, weight, targets, tp, vocab_size, dtype, max(1, chunk_elements))


def _chunk_logits(h: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.nn.functional.linear(h.to(dtype), w.to(dtype)).float()


def _chunk_logprobs(logits: Tensor, targets: Tensor, tp: TensorParallel,
                    vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """From vocab-sharded fp32 logits [n, V/tp]: the targets' log-probs [n], the log-sum-exp [n]
    and what backward makes the softmax from: the log-softmax [n, V] itself with one rank (one
    fused pass, which the composite logsumexp is not), else the logits."""
    if tp.size == 1:
        logp = _kept_form(logits, tp)
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return picked, logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - picked, logp
    lo, hi = tp.vocab_range(vocab_size)
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp.group)
    shifted = logits - peak.unsqueeze(-1)
    both = torch.stack([shifted.exp().sum(dim=-1), _picked(shifted, targets, lo, hi)])  # one all-reduce
    dist.all_reduce(both, group=tp.group)
    log_sum = both[0].log()
    return both[1] - log_sum, peak + log_sum, logits


def _kept_form(logits: Tensor, tp: TensorParallel) -> Tensor:
    return torch.log_softmax(logits, dim=-1) if tp.size == 1 else logits


def _softmax_(kept: Tensor, lse: Tensor, tp: TensorParallel) -> Tensor:
    """softmax, in place, from what `_chunk_logprobs` keeps."""
    return kept.exp_() if tp.size == 1 else kept.sub_(lse[:, None]).exp_()


def _picked(logits: Tensor, targets: Tensor, lo: int, hi: int) -> Tensor:
    inside = (targets >= lo) & (targets < hi)
    local = (targets - lo).masked_fill(~inside, 0)
    return logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, w: Tensor, targets: Tensor, tp: TensorParallel, vocab_size: int,
                dtype: torch.dtype, chunk: int) -> Tensor:
        n = h.shape[0]
        rows = max(1, chunk // max(1, w.shape[0]))
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        keep = grads and n <= rows
        out, lses, kept = [], [], None
        wc = w.to(dtype)  # cast once for every chunk
        for lo in range(0, n, rows):
            logits = _chunk_logits(h[lo:lo + rows], wc, dtype)
            lp, lse, rest = _chunk_logprobs(logits, targets[lo:lo + rows], tp, vocab_size)
            out.append(lp)
            lses.append(lse)
            if keep:
                kept = rest
        ctx.tp, ctx.vocab_size, ctx.dtype, ctx.chunk, ctx.kept = tp, vocab_size, dtype, chunk, kept
        if grads:
            ctx.save_for_backward(h, w, targets, torch.cat(lses))
        return torch.cat(out) if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        h, w, targets, lse = ctx.saved_tensors
        tp, dtype, n = ctx.tp, ctx.dtype, h.shape[0]
        lo_v, hi_v = tp.vocab_range(ctx.vocab_size)
        wc = w.to(dtype)
        if ctx.kept is None and n < w.shape[0]:
            dh, dw = _backward_by_vocabulary(h, wc, targets - lo_v, grad, lse, dtype, max(1, ctx.chunk // n))
            return dh, dw.to(w.dtype), None, None, None, None, None
        rows = max(1, ctx.chunk // max(1, w.shape[0]))
        dh = torch.empty_like(h)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for lo in range(0, h.shape[0], rows):
            hc, g = h[lo:lo + rows].to(dtype), grad[lo:lo + rows]  # the chunk cast once, for both GEMMs
            t = targets[lo:lo + rows]
            rest = ctx.kept if ctx.kept is not None else _kept_form(_chunk_logits(hc, wc, dtype), tp)
            # d log p[t] / d logits = onehot(t) - softmax(logits)
            dlogits = _softmax_(rest, lse[lo:lo + rows], tp).mul_(-g[:, None])
            inside = (t >= lo_v) & (t < hi_v)
            dlogits.scatter_add_(-1, (t - lo_v).masked_fill(~inside, 0).unsqueeze(-1),
                                 g.masked_fill(~inside, 0.0).unsqueeze(-1))
            dc = dlogits.to(dtype)
            dh[lo:lo + rows] = dc @ wc
            dw.add_(dc.t() @ hc)  # upcast inside the add: one kernel, the sum the same as an fp32 copy's
        ctx.kept = None
        return dh, dw.to(w.dtype), None, None, None, None, None


def _backward_by_vocabulary(h: Tensor, wc: Tensor, local: Tensor, grad: Tensor, lse: Tensor, dtype: torch.dtype,
                            cols: int) -> tuple[Tensor, Tensor]:
    """The head's gradients (input, weight) with the logits made again `cols` vocabulary rows at a
    time over every token: softmax from the kept log-sum-exp, minus the targets' one-hots (`local`:
    each target's row in this rank's block, outside it where no slice holds it); each slice of the
    weight's gradient written once, the input's summed over the slices in fp32."""
    hc = h.to(dtype)
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    dw = torch.empty(wc.shape, dtype=torch.float32, device=wc.device)
    neg = -grad[:, None]
    for v0 in range(0, wc.shape[0], cols):
        wj = wc[v0:v0 + cols]
        # d log p[t] / d logits = onehot(t) - softmax(logits)
        dlogits = (hc @ wj.t()).float().sub_(lse[:, None]).exp_().mul_(neg)
        mine = (local >= v0) & (local < v0 + wj.shape[0])
        dlogits.scatter_add_(-1, (local - v0).masked_fill(~mine, 0).unsqueeze(-1),
                             grad.masked_fill(~mine, 0.0).unsqueeze(-1))
        dc = dlogits.to(dtype)
        dh.add_(dc @ wj)  # upcast inside the add
        dw[v0:v0 + cols] = dc.t() @ hc
    return dh.to(h.dtype), dw
