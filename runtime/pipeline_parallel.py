"""Pipeline parallelism: stages of consecutive layers, 1F1B over micro-batches, p2p between stages.

Stage ``s`` holds the layers `plans.sharding.stage_layers` gives it (stage 0 also the
embeddings, the last stage the final norm and head; a tied embedding lives on both). The
training schedule is 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage ``s`` runs
``pp - s - 1`` warm-up forwards, then alternates one forward and one backward, then drains the
remaining backwards, so at most ``pp - s`` micro-batches keep activations alive.

Activations go forward and their gradients backward with point-to-point messages between
neighbouring stages of the same (dp, cp, tp) coordinates. Sends are non-blocking and waited on
at the end of the schedule, receives block; with the 1F1B order no stage waits on a message its
neighbour has not already queued, so the schedule cannot deadlock. Shapes are not sent: every
stage derives each micro-batch's shape from the batch split, which all ranks know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from plans.layout import Layout
from plans.sharding import stage_layers
from runtime.groups import Axis

P2P_DTYPE = torch.float32  # activations travel in fp32 whatever the compute dtype


@dataclass
class Pipeline:
    """A rank's place in its pipeline; `prev`/`next` are global ranks of the neighbouring stages."""

    stage: int
    stages: int
    ranks: tuple[int, ...]
    pending: list[Any] = field(default_factory=list)  # outstanding sends

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def prev(self) -> int:
        return self.ranks[self.stage - 1]

    @property
    def next(self) -> int:
        return self.ranks[self.stage + 1]

    def send(self, t: Tensor, dst: int) -> None:
        t = t.detach().contiguous()
        self.pending = [(w, x) for w, x in self.pending if not w.is_completed()]  # a long generation sends many
        self.pending.append((dist.isend(t, dst), t))  # keep `t` alive until the send completes

    def recv(self, shape: tuple[int, ...], src: int, *, dtype: torch.dtype = P2P_DTYPE,
             device: torch.device | None = None) -> Tensor:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        return t

    def flush(self) -> None:
        """Wait for every outstanding send."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def apply_pipeline_parallel(num_layers: int, *, layout: Layout, pp: Axis, stage: int) -> tuple[tuple[int, ...], Pipeline]:
    """The layers of `stage` and its pipeline (interleaved schedules are not supported yet)."""
    if layout.interleave != 1:
        raise NotImplementedError("interleaved pipeline schedules")
    return tuple(stage_layers(num_layers, layout.pp)[stage]), Pipeline(stage=stage, stages=layout.pp, ranks=pp.ranks)


def train_1f1b(pipe: Pipeline, n_micro: int, *, forward: Callable[[int, Tensor | None], Tensor],
               loss: Callable[[int, Tensor], Tensor], act_shape: Callable[[int], tuple[int, ...]],
               device: torch.device, before_last_backward: Callable[[], None] | None = None) -> None:
    """Forward and backward of `n_micro` micro-batches in 1F1B order, accumulating gradients.

    `forward(i, x)` runs this stage on micro-batch `i` (`x` is None on the first stage, the
    received activation otherwise); on the last stage `loss(i, out)` gives the scalar to back-prop.
    `before_last_backward()` runs before the backward that completes the gradients (data
    parallelism starts its reductions during that one).
    """
    inputs: dict[int, Tensor | None] = {}
    outputs: dict[int, Tensor] = {}

    def fwd(i: int) -> None:
        x = None
        if not pipe.first:
            x = pipe.recv(act_shape(i), pipe.prev, device=device).requires_grad_()
        out = forward(i, x)
        if pipe.last:
            out = loss(i, out)
        else:
            pipe.send(out.to(P2P_DTYPE), pipe.next)
        inputs[i], outputs[i] = x, out

    def bwd(i: int) -> None:
        x, out = inputs.pop(i), outputs.pop(i)
        if i == n_micro - 1 and before_last_backward is not None:
            before_last_backward()
        if pipe.last:
            out.backward()
        else:
            grad = pipe.recv(act_shape(i), pipe.next, device=device)
            torch.autograd.backward(out, grad.to(out.dtype))
        if not pipe.first:
            assert x is not None and x.grad is not None
            pipe.send(x.grad, pipe.prev)

    warmup = min(pipe.stages - pipe.stage - 1, n_micro)
    for i in range(warmup):
        fwd(i)
    for i in range(n_micro - warmup):
        fwd(warmup + i)
        bwd(i)
    for i in range(n_micro - warmup, n_micro):
        bwd(i)
    pipe.flush()


def forward_only(pipe: Pipeline, n_micro: int, *, forward: Callable[[int, Tensor | None], Tensor],
                 act_shape: Callable[[int], tuple[int, ...]], device: torch.device) -> list[Tensor]:
    """Forward of `n_micro` micro-batches through the pipeline; the last stage returns the outputs."""
    outs = []
    for i in range(n_micro):
        x = None if pipe.first else pipe.recv(act_shape(i), pipe.prev, device=device)
        out = forward(i, x)
        if pipe.last:
            outs.append(out)
        else:
            pipe.send(out.to(P2P_DTYPE), pipe.next)
    pipe.flush()
    return outs
