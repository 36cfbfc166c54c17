"""GaLore: Adam in a low-rank projection of each decoder matrix's gradient (`plans.layout.GaLore`).

For a projected matrix W of m x n (`plans.sharding.galore_projected`) with gradient G, at step t
(Zhao et al. 2024, algorithm 1; the orientation of Su et al. 2025, GaLore 2):

- every `update_interval` steps (t = 1, 1 + T, ...) the projector is refreshed from the thin SVD
  G = U S V^T: P = U[:, :r] when m <= n (left), else Q = V[:, :r] (right);
- R = P^T G (r x n) or G Q (m x r); Adam's moments of R: M = b1 M + (1 - b1) R,
  V = b2 V + (1 - b2) R^2 (kept across refreshes, as GaLore keeps them);
- N = M / (sqrt(V) + eps), the step size lr * sqrt(1 - b2^t) / (1 - b1^t) (GaLore's Adam);
- W -= step_size * scale * (P N or N Q^T), then W -= lr * weight_decay * W (decoupled decay).

Every other parameter keeps the data-parallel shard's fused AdamW.

Tensor parallel: a rank holds a slice of W and of G (rows of a column-parallel matrix, columns of
a row-parallel one) and keeps the projector's rows that meet it, so each step is the whole
matrix's restricted to the slice. Where the slice cuts the side the projection keeps (n for P^T G,
m for G Q), the slice's R is its part of the whole R, and its moments are that part; where it cuts
the side the projection sums over, each slice's R is a partial sum, all-reduced over the
tensor-parallel group, and every rank keeps the whole moments. An SVD needs the whole gradient:
the slices are all-gathered over the group, the first rank of it computes the SVD and sends the
projector to the others.

Each projected matrix has one owner in the data-parallel group (`owners`): contiguous runs of
the shard's parameters of about equal size, one per rank (sized alike on every tensor-parallel
rank, so a matrix's slices have owners of one data-parallel index). The owner alone computes the
SVD. Under ZeRO-0 it sends the projector to the group, and every rank keeps the moments and
updates every matrix (as plain data parallelism updates every parameter); under ZeRO-1 the owner
alone keeps the moments and projector and updates the matrix, which the flat buffer's all-gather
then shares (`runtime.data_parallel.DataParallel` lays the buffer out so a rank's partition is
exactly the parameters it owns). ZeRO-2/3 split a matrix's gradient over the data-parallel group,
which the projection would need gathered (`plans.layout.Layout.check_galore_whole_gradients`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from plans.layout import GaLore
from runtime.groups import Axis
from runtime.offload import to_device, to_host


def owners(sizes: list[int], parts: int) -> list[int]:
    """The owner of each of a run of tensors of `sizes` elements: `parts` contiguous groups, each
    closed once its running total reaches its share of the whole."""
    total = sum(sizes)
    out, rank, seen = [], 0, 0
    for n in sizes:
        out.append(rank)
        seen += n
        while rank < parts - 1 and seen >= total * (rank + 1) / parts:
            rank += 1
    return out


@dataclass(frozen=True)
class Matrix:
    """A projected matrix as the ranks of a tensor-parallel group hold it."""

    shape: tuple[int, int]  # the whole matrix, m x n
    split: int | None  # the dim tensor parallel cuts (None: every rank holds it whole)
    parts: tuple[tuple[int, int], ...]  # each tensor-parallel rank's [start, stop) along `split`

    @property
    def left(self) -> bool:
        """P^T G (m <= n), else G Q."""
        return self.shape[0] <= self.shape[1]

    @property
    def summed(self) -> bool:
        """Whether the split runs along the side the projection sums over (slices give partial sums)."""
        return self.split is not None and self.split == (0 if self.left else 1)

    def local_shape(self, tp_index: int) -> tuple[int, int]:
        rows, cols = self.shape
        if self.split is None:
            return rows, cols
        a, b = self.parts[tp_index]
        return (b - a, cols) if self.split == 0 else (rows, b - a)


@dataclass
class Projected:
    """One projected matrix's state on this rank: projector (its rows that meet the rank's slice)
    and Adam's moments of the slice's projection (of the whole one where it is summed)."""

    m: Tensor  # first moment of the projection
    v: Tensor  # second moment
    p: Tensor | None = None  # P (m x r) or Q (n x r), or its rows; None before the first refresh


def projector(g: Tensor, rank: int, *, left: bool) -> Tensor:
    """The top `rank` left (m x r) or right (n x r) singular vectors of `g`, each signed so that
    its largest entry is positive. A singular vector's sign is arbitrary; left to the solver it
    can flip between two nearly equal gradients, and Adam's moments, kept across a refresh, would
    then add in the opposite direction (scikit-learn's svd_flip makes SVDs deterministic so)."""
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    p = u[:, :rank] if left else vh[:rank, :].T
    pick = p.abs().argmax(dim=0, keepdim=True)
    return (p * torch.sign(p.gather(0, pick))).contiguous()


class GaLoreStep:
    """The projected matrices of one shard that this rank updates (all of them under ZeRO-0)."""

    def __init__(self, cfg: GaLore, mats: dict[str, Matrix], owner: dict[str, int], *, dp: Axis, tp: Axis,
                 zero: int, device: torch.device) -> None:
        self.cfg, self.dp, self.tp, self.zero, self.owner = cfg, dp, tp, zero, owner
        self.mats = mats
        self.names = list(mats)  # every projected matrix of the shard, in buffer order
        self.state: dict[str, Projected] = {}
        for n, mat in mats.items():
            if zero == 1 and owner[n] != dp.index:
                continue
            rows, cols = mat.local_shape(tp.index)
            if mat.summed:  # the projection is the whole matrix's, summed over the group
                rows, cols = mat.shape
            shape = (cfg.rank, cols) if mat.left else (rows, cfg.rank)
            self.state[n] = Projected(torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def step(self, params: dict[str, Tensor], grads: dict[str, Tensor], *, step: int, lr: float, beta1: float,
             beta2: float, eps: float, weight_decay: float) -> None:
        """Update this rank's projected matrices in place (`params`, `grads`: views by name)."""
        cfg = self.cfg
        if (step - 1) % cfg.update_interval == 0:
            self._refresh(grads)
        step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        for n, st in self.state.items():
            mat, w, g, p = self.mats[n], params[n], grads[n], st.p
            assert p is not None
            r = p.T @ g if mat.left else g @ p
            if mat.summed and self.tp.size > 1:
                dist.all_reduce(r, group=self.tp.group)
            st.m.mul_(beta1).add_(r, alpha=1 - beta1)
            st.v.mul_(beta2).addcmul_(r, r, value=1 - beta2)
            norm = st.m / st.v.sqrt().add_(eps)
            w.add_(p @ norm if mat.left else norm @ p.T, alpha=-step_size * cfg.scale)
            if weight_decay:
                w.add_(w, alpha=-lr * weight_decay)

    def _refresh(self, grads: dict[str, Tensor]) -> None:
        """New projectors from the gradients' SVDs: each on its owner (the first rank of its
        tensor-parallel group, from the gathered slices); under ZeRO-0 sent from the owner to the
        data-parallel group (every rank then holds the owner's, bit for bit)."""
        rank, tp = self.cfg.rank, self.tp
        for n in self.names:
            mat = self.mats[n]
            mine = self.owner[n] == self.dp.index
            if mine:
                whole = self._whole(grads[n], mat)
                p = projector(whole, rank, left=mat.left) if tp.index == 0 else \
                    torch.empty((mat.shape[0] if mat.left else mat.shape[1], rank), device=grads[n].device)
                if tp.size > 1:
                    dist.broadcast(p, src=tp.ranks[0], group=tp.group)
                if mat.summed:  # this slice's rows of the projector
                    a, b = mat.parts[tp.index]
                    p = p[a:b].contiguous()
                self.state[n].p = p
            if self.zero == 0 and self.dp.size > 1:
                st = self.state[n]
                if not mine:
                    rows, cols = mat.local_shape(tp.index)
                    st.p = torch.empty(((rows if mat.summed else mat.shape[0]) if mat.left
                                        else (cols if mat.summed else mat.shape[1]), rank), device=grads[n].device)
                assert st.p is not None
                dist.broadcast(st.p, src=self.dp.ranks[self.owner[n]], group=self.dp.group)

    def _whole(self, g: Tensor, mat: Matrix) -> Tensor:
        """The whole gradient from the tensor-parallel group's slices (`g` where it is whole)."""
        tp = self.tp
        if mat.split is None or tp.size == 1:
            return g
        d = mat.split
        most = max(b - a for a, b in mat.parts)
        pad = list(g.shape)
        pad[d] = most
        mine = torch.zeros(pad, dtype=g.dtype, device=g.device)
        mine.narrow(d, 0, g.shape[d]).copy_(g)
        got = [torch.empty_like(mine) for _ in range(tp.size)]
        dist.all_gather(got, mine, group=tp.group)
        return torch.cat([t.narrow(d, 0, b - a) for t, (a, b) in zip(got, mat.parts)], dim=d)

    def to_host(self) -> None:
        for st in self.state.values():
            st.m, st.v = to_host(st.m), to_host(st.v)
            st.p = None if st.p is None else to_host(st.p)

    def to_device(self, device: torch.device) -> None:
        for st in self.state.values():
            st.m, st.v = to_device(st.m, device), to_device(st.v, device)
            st.p = None if st.p is None else to_device(st.p, device)
