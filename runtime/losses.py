"""Train-call losses over per-token model outputs, normalised so sharding never changes them.

Every loss takes the model output of one micro-batch (log-probs [b, s-1] of the tokens after
each position, or values [b, s]), the micro-batch's rows (``tokens`` and the per-token tensors
the algorithm glue prepared, aligned to the s-1 predicted positions, with ``mask`` marking the
tokens that count), and the *global* normaliser of its minibatch (token count, or pair count
for DPO). It returns sum(per-token loss) / normaliser, so the sum over micro-batches and data-
parallel ranks is exactly the single-process minibatch mean, and statistics normalised the same
way (they sum to minibatch means).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from plans.graph import AlgorithmConfig, Loss

Stats = dict[str, Tensor]
LossFn = Callable[[Tensor, dict[str, Tensor], float], tuple[Tensor, Stats]]


def sft(logprobs: Tensor, rows: dict[str, Tensor], denom: float) -> tuple[Tensor, Stats]:
    """Cross entropy of the masked tokens (next-token prediction)."""
    mask = rows["mask"].float()
    return -(logprobs * mask).sum() / denom, {}


def clipped_policy(logprobs: Tensor, rows: dict[str, Tensor], denom: float, *, clip_eps: float,
                   kl_coef: float) -> tuple[Tensor, Stats]:
    """PPO's clipped surrogate (Schulman et al. 2017) with advantages per token, plus, when
    `kl_coef` > 0, the k3 estimate of KL(policy || reference) as in GRPO (Shao et al. 2024)."""
    mask = rows["mask"].float()
    ratio = torch.exp(logprobs - rows["old_logprobs"])
    adv = rows["advantages"]
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    per_token = surrogate
    stats: Stats = {}
    if kl_coef > 0:
        log_r = rows["ref_logprobs"] - logprobs
        kl = torch.exp(log_r) - log_r - 1
        per_token = per_token + kl_coef * kl
        stats["kl"] = (kl * mask).sum().detach() / denom
    clipped = ((ratio - 1).abs() > clip_eps).float()
    stats["clip_frac"] = (clipped * mask).sum().detach() / denom
    stats["ratio"] = (ratio * mask).sum().detach() / denom
    return (per_token * mask).sum() / denom, stats


def clipped_value(values: Tensor, rows: dict[str, Tensor], denom: float, *, clip_eps: float) -> tuple[Tensor, Stats]:
    """PPO's clipped value loss, 0.5 max((v - R)^2, (v_clip - R)^2); `values` [b, s] are read at
    the position before each token (the state the token is chosen in)."""
    mask = rows["mask"].float()
    v = values[:, :-1]
    old = rows["old_values"]
    v_clip = old + (v - old).clamp(-clip_eps, clip_eps)
    ret = rows["returns"]
    per_token = 0.5 * torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)
    return (per_token * mask).sum() / denom, {"value_mean": (v * mask).sum().detach() / denom}


TIE_RTOL = 1e-5  # relative size of a DPO margin below which it is float rounding, a tie


def dpo(logprobs: Tensor, rows: dict[str, Tensor], denom: float, *, beta: float) -> tuple[Tensor, Stats]:
    """DPO (Rafailov et al. 2023) on consecutive (chosen, rejected) rows; `denom` counts pairs."""
    mask = rows["mask"].float()
    policy = (logprobs * mask).sum(-1)
    ref = (rows["ref_logprobs"] * mask).sum(-1)
    margin = beta * ((policy[0::2] - ref[0::2]) - (policy[1::2] - ref[1::2]))
    loss = -F.logsigmoid(margin).sum() / denom
    # A pair is won when its margin is positive beyond float rounding: while the policy equals the
    # reference (the first step) the margin is 0 in exact arithmetic, and the order in which a
    # layout sums the log-probs would otherwise decide its sign.
    tie = TIE_RTOL * beta * (policy[0::2].abs() + ref[0::2].abs() + policy[1::2].abs() + ref[1::2].abs())
    return loss, {"accuracy": (margin > tie).float().sum().detach() / denom}


def make_loss(kind: Loss, algo: AlgorithmConfig) -> LossFn:
    """The loss of a train call, with the algorithm's hyperparameters bound."""
    if kind == "sft":
        return sft
    if kind == "ppo_policy":  # the KL penalty is in PPO's reward, not its loss
        return lambda out, rows, d: clipped_policy(out, rows, d, clip_eps=algo.clip_eps, kl_coef=0.0)
    if kind in ("grpo", "rloo", "remax"):
        return lambda out, rows, d: clipped_policy(out, rows, d, clip_eps=algo.clip_eps, kl_coef=algo.kl_coef)
    if kind == "ppo_value":
        return lambda out, rows, d: clipped_value(out, rows, d, clip_eps=algo.value_clip_eps)
    if kind == "dpo":
        return lambda out, rows, d: dpo(out, rows, d, beta=algo.dpo_beta)
    raise ValueError(f"unknown loss {kind!r}")
