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

Each projected matrix has one owner in the data-parallel group (`owners`): contiguous runs of
the shard's parameters of about equal size, one per rank. The owner alone computes the SVD. Under
ZeRO-0 it sends the projector to the group, and every rank keeps the moments and updates every
matrix (as plain data parallelism updates every parameter); under ZeRO-1 the owner alone keeps
the moments and projector and updates the matrix, which the flat buffer's all-gather then shares
(`runtime.data_parallel.DataParallel` lays the buffer out so a rank's partition is exactly the
parameters it owns). A projection needs the matrix's whole gradient, so tp = 1 and ZeRO <= 1
(`plans.layout.Layout.check_galore_whole_gradients`).
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


@dataclass
class Projected:
    """One projected matrix's state: projector and Adam's moments of its projection."""

    left: bool  # P^T G (m <= n) or G Q (m > n)
    m: Tensor  # first moment of the projection
    v: Tensor  # second moment
    p: Tensor | None = None  # P (m x r) or Q (n x r); None before the first refresh


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

    def __init__(self, cfg: GaLore, shapes: dict[str, tuple[int, int]], owner: dict[str, int], *, dp: Axis, zero: int,
                 device: torch.device) -> None:
        self.cfg, self.dp, self.zero, self.owner = cfg, dp, zero, owner
        self.names = list(shapes)  # every projected matrix of the shard, in buffer order
        self.state: dict[str, Projected] = {}
        for n, (rows, cols) in shapes.items():
            if zero == 1 and owner[n] != dp.index:
                continue
            left = rows <= cols
            shape = (cfg.rank, cols) if left else (rows, cfg.rank)
            self.state[n] = Projected(left, torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def step(self, params: dict[str, Tensor], grads: dict[str, Tensor], *, step: int, lr: float, beta1: float,
             beta2: float, eps: float, weight_decay: float) -> None:
        """Update this rank's projected matrices in place (`params`, `grads`: views by name)."""
        cfg = self.cfg
        if (step - 1) % cfg.update_interval == 0:
            self._refresh(grads)
        step_size = lr * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        for n, st in self.state.items():
            w, g, p = params[n], grads[n], st.p
            assert p is not None
            r = p.T @ g if st.left else g @ p
            st.m.mul_(beta1).add_(r, alpha=1 - beta1)
            st.v.mul_(beta2).addcmul_(r, r, value=1 - beta2)
            norm = st.m / st.v.sqrt().add_(eps)
            w.add_(p @ norm if st.left else norm @ p.T, alpha=-step_size * cfg.scale)
            if weight_decay:
                w.add_(w, alpha=-lr * weight_decay)

    def _refresh(self, grads: dict[str, Tensor]) -> None:
        """New projectors from the gradients' SVDs: each on its owner; under ZeRO-0 sent from the
        owner to the group (every rank then holds the owner's, bit for bit)."""
        rank = self.cfg.rank
        for n in self.names:
            mine = self.owner[n] == self.dp.index
            if mine:
                st = self.state[n]
                st.p = projector(grads[n], rank, left=st.left)
            if self.zero == 0 and self.dp.size > 1:
                st = self.state[n]
                rows, cols = grads[n].shape
                if not mine:
                    st.p = torch.empty((rows if st.left else cols, rank), device=grads[n].device)
                assert st.p is not None
                dist.broadcast(st.p, src=self.dp.ranks[self.owner[n]], group=self.dp.group)

    def to_host(self) -> None:
        for st in self.state.values():
            st.m, st.v = to_host(st.m), to_host(st.v)
            st.p = None if st.p is None else to_host(st.p)

    def to_device(self, device: torch.device) -> None:
        for st in self.state.values():
            st.m, st.v = to_device(st.m, device), to_device(st.v, device)
            st.p = None if st.p is None else to_device(st.p, device)
