"""Context parallelism: the ranks of a cp group share every sequence of a micro-batch.

Causal load balancing (Megatron-LM's, Liu et al. 2023's striped variant aside): the padded
sequence of S slots is cut into ``2 * cp`` equal chunks and rank r holds chunks r and
``2cp - 1 - r``, so under the causal mask every rank has as many early (cheap) queries as late
(expensive) ones. Norms, projections, the MLP and the residual stream are per token and run on
the rank's own slots; only attention mixes positions:

- each rank's keys and values (after RoPE) are all-gathered over the group and put back in slot
  order (`gather_kv`); its queries attend to all of them under the causal mask of their own
  slots (plus the sliding window and left padding, as without cp). The backward reduce-scatters
  the keys' and values' gradients, so every query's contribution reaches the rank that made the
  key. This is the all-gather form of context parallelism (Llama 3's, Grattafiori et al. 2024,
  section 3.3.2), and the cost model prices it as such for this runtime (`Framework.cp_comm`).
- the head's per-position outputs (log-probs, values) are all-gathered in slot order
  (`gather_positions`), so every rank of the group holds its replica's whole rows and computes
  the same loss; the backward keeps each rank's own positions' gradients (the loss is the same
  function on every rank, so its gradient at those positions is too).

A parameter's gradient on one rank is then its share over that rank's positions;
`runtime.data_parallel` sums the shares over the group (cp ranks hold the same slices, exactly
like data-parallel ones). Every function is the plain single-process operation when the group
has one rank.

Generation under cp (`runtime.generate`): the prompt's prefill runs as above and every rank keeps
the whole gathered cache; decoding is then KV-parallel (`runtime.model.kv_parallel_core`): each
rank keeps its contiguous share of the prefilled positions and every cp-th new one, and the
shares' attention is combined over the group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from runtime.groups import all_gather_into, reduce_scatter_into


@dataclass(frozen=True)
class ContextParallel:
    """A rank's context-parallel group; `size == 1` means the rank holds whole sequences."""

    group: Any = None
    size: int = 1
    rank: int = 0
    _orders: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def multiple(self) -> int:
        """Sequence lengths must be a multiple of this (2 * cp chunks)."""
        return 2 * self.size if self.size > 1 else 1

    def slots(self, s: int, device: torch.device, rank: int | None = None) -> Tensor:
        """The slots of a padded sequence of `s` this rank (or `rank`) holds, ascending: chunks
        r and 2cp-1-r of 2cp."""
        r = self.rank if rank is None else rank
        if self.size == 1:
            return torch.arange(s, device=device)
        if s % self.multiple:
            raise ValueError(f"context parallel over {self.size} ranks needs a length divisible by {self.multiple}, "
                             f"got {s}")
        c = s // self.multiple
        lo, hi = r * c, (self.multiple - 1 - r) * c
        return torch.cat([torch.arange(lo, lo + c, device=device), torch.arange(hi, hi + c, device=device)])

    def order(self, s: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(gathered, inverse): slot of each row of an all-gather over the group (rank order), and
        for each slot its row there."""
        key = (s, str(device))
        got = self._orders.get(key)
        if got is None:
            gathered = torch.cat([self.slots(s, device, r) for r in range(self.size)])
            got = self._orders[key] = (gathered, torch.argsort(gathered))
        return got


def _gather_dim0(x: Tensor, cp: ContextParallel) -> Tensor:
    out = torch.empty((x.shape[0] * cp.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_into(out, x.contiguous(), group=cp.group)
    return out


class _GatherKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp = cp
        xs = x.permute(2, 0, 1, 3)  # [s/cp, b, heads, d]: collectives split dim 0
        s = xs.shape[0] * cp.size
        _, inverse = cp.order(s, x.device)
        return _gather_dim0(xs, cp).index_select(0, inverse).permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        cp = ctx.cp
        gs = g.permute(2, 0, 1, 3)  # [s, b, heads, d] in slot order
        gathered, _ = cp.order(gs.shape[0], g.device)
        send = gs.index_select(0, gathered).contiguous()  # rank order, as the forward gathered
        out = torch.empty((gs.shape[0] // cp.size, *gs.shape[1:]), dtype=g.dtype, device=g.device)
        reduce_scatter_into(out, send, group=cp.group)
        return out.permute(1, 2, 0, 3), None


def gather_kv(x: Tensor, cp: ContextParallel) -> Tensor:
    """Keys or values [b, heads, s/cp, d] of this rank's slots -> [b, heads, s, d] of every slot,
    in slot order; backward: the gradients summed onto the ranks that made them."""
    if cp.size == 1:
        return x
    return _GatherKV.apply(x, cp)


class _GatherPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cp: ContextParallel) -> Tensor:
        ctx.cp = cp
        xs = x.transpose(0, 1)  # [s/cp, b]
        s = xs.shape[0] * cp.size
        _, inverse = cp.order(s, x.device)
        return _gather_dim0(xs, cp).index_select(0, inverse).transpose(0, 1)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        cp = ctx.cp
        return g.index_select(1, cp.slots(g.shape[1], g.device)), None


def gather_positions(x: Tensor, cp: ContextParallel) -> Tensor:
    """Per-position outputs [b, s/cp] of this rank's slots -> [b, s] in slot order on every rank
    of the group; backward keeps this rank's slots' gradients."""
    if cp.size == 1:
        return x
    return _GatherPositions.apply(x, cp)
