"""Software-stack traits: discrete implementation choices that change which kernels run.

Coefficients (`cost_models.calibration`) say how fast a GPU runs a kernel; a `Framework` says which
kernels a training step launches and which bytes it keeps. Two presets:

- ``megatron``: Megatron-LM GPT pretraining as in the vTrain measurements (Narayanan et al. 2021):
  attention scores materialised (baddbmm, fused scale-mask-softmax, dropout, bmm), hidden and
  attention dropout, fp16 gradients accumulated per micro-batch and all-reduced after the last
  backward (no bucketing, so no overlap with backward), mixed-precision Adam.
- ``torch``: the planner's runtime: fused (flash) causal attention, no dropout, gradients
  reduced in bf16 after backward, the same mixed-precision Adam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plans.errors import PlannerError

AttentionImpl = Literal["flash", "materialized"]


@dataclass(frozen=True)
class Framework:
    """Which kernels a step launches and which bytes it moves and keeps."""

    name: str
    attention: AttentionImpl  # materialized: s x s scores in HBM; flash: one fused kernel, causal half
    dropout: bool  # hidden and attention dropout kernels and their 1-byte masks
    param_bytes: int  # bf16/fp16 weights
    grad_bytes: int  # gradient buffer dtype (also the dtype of the data-parallel reduction)
    optimizer_bytes: int  # fp32 master weights + Adam m and v
    # HBM traffic of one fused Adam step per parameter: inf check and grad norm read the 2-byte
    # gradient (2+2), Adam reads g (2), fp32 p, m, v (12) and writes p, m, v (12) and the 2-byte
    # weight (2), and the gradient buffer is zeroed (2).
    optimizer_step_bytes: int
    # Accumulating one micro-batch's weight gradient into the buffer: read grad, read+write buffer.
    grad_accum_bytes: int
    overlap_grad_reduce: bool  # data-parallel reduction overlaps the last backward (bucketed DDP)
    zero3_prefetch: bool = True  # ZeRO-3 gathers the next weights under the current compute (FSDP, DeepSpeed)
    # Megatron's fused scale-mask-softmax kernel needs batch*heads divisible by 4 and keys <= 2048;
    # otherwise PyTorch runs scale, mask, fp32 cast, softmax and cast back as separate kernels.
    fused_softmax_multiple: int = 1
    fused_softmax_max_keys: int = 1 << 30


FRAMEWORKS: dict[str, Framework] = {
    "megatron": Framework(
        name="megatron", attention="materialized", dropout=True, param_bytes=2, grad_bytes=2, optimizer_bytes=12,
        optimizer_step_bytes=34, grad_accum_bytes=6, overlap_grad_reduce=False,
        fused_softmax_multiple=4, fused_softmax_max_keys=2048,
    ),
    "torch": Framework(
        name="torch", attention="flash", dropout=False, param_bytes=2, grad_bytes=2, optimizer_bytes=12,
        optimizer_step_bytes=34, grad_accum_bytes=6, overlap_grad_reduce=False, zero3_prefetch=False,
    ),
}


def resolve_framework(fw: str | Framework) -> Framework:
    """A preset by name, or the given traits."""
    if isinstance(fw, Framework):
        return fw
    if fw not in FRAMEWORKS:
        raise PlannerError(f"unknown framework {fw!r}", hint=f"known: {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[fw]
