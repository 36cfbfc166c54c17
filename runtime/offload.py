"""States that wait in host memory between calls (`plans.layout.Layout.offload`).

A model's home call may keep what only it uses off the GPU while the other calls run:

- ``optimizer``: a train call's Adam moments (`runtime.data_parallel.DataParallel.m` and ``v``)
  are copied to the GPU before the call and back to host memory after it, as DeepSpeed's
  ``offload_optimizer`` and verl's ``optimizer_offload`` keep them. The update itself runs on the
  GPU, so the math is the math of a run without offload, bit for bit.
- ``weights``: a frozen model's only call copies its weights in before it runs and drops them
  after (the host copy stays valid: nothing changes them), as OpenRLHF's ``--ref.offload``.

Host copies are pinned on a CUDA device (so the copies run at the host link's DMA rate); on a CPU
run the "host" and the device are the same memory, and the copies still happen (the device
tensors are released and new ones made), so a CPU run exercises every step a GPU run takes.
The cost model prices the copies (`cost_models.api.HOST_COPY_EFFICIENCY`) as exposed time of the
call; here they are blocking copies inside the call's span.
"""

from __future__ import annotations

import torch
from torch import Tensor

HOST = torch.device("cpu")


def to_host(t: Tensor) -> Tensor:
    """A host copy of `t` (pinned when `t` is on a CUDA device)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=t.device.type == "cuda")
    out.copy_(t)
    return out


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A new copy of host tensor `t` on `device` (a copy even when `device` is the host)."""
    return t.to(device, copy=True)


def released(t: Tensor) -> Tensor:
    """An empty tensor of `t`'s dtype and device: what stands in for states that are on the host."""
    return torch.empty(0, dtype=t.dtype, device=t.device)
