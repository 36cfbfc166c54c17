"""Activation recompute: keep fewer activations in the forward pass and recompute them in backward.

``full`` checkpoints each decoder layer (only its input is kept; under ZeRO-3 the layer's
parameter gather is recomputed too, so gathered weights are freed between forward and backward);
``selective`` checkpoints the attention core, softmax(q k^T) v, whose activations grow with the
square of the sequence (Korthikanti et al. 2022). Recompute never changes the math: the same
operations run again on the same inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Literal

import torch
from torch.utils.checkpoint import checkpoint

Recompute = Literal["none", "selective", "full"]


def checkpointed(fn: Callable[..., Any], *args: Any, enabled: bool) -> Any:
    """`fn(*args)`, recomputed in backward instead of keeping its activations when `enabled`
    (and gradients are being recorded)."""
    if not enabled or not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def apply_recompute(shard: Any, *, mode: Recompute) -> None:
    """Set the recompute mode of a model shard (`runtime.model.Shard`)."""
    if mode not in ("none", "selective", "full"):
        raise ValueError(f"unknown recompute mode {mode!r}")
    shard.recompute = mode
