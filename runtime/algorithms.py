"""Algorithm glue: from the data handles a train call reads to the rows its loss needs.

Runs on every rank on data every rank holds in full, so it needs no communication and gives
the same numbers under every layout. A train call's inputs are recognised by what produced them:
a generate call's samples, an inference call's log-probs (the frozen reference), values (the
critic) or scores (the reward model), or a graph input (SFT tokens, DPO pairs). With
``algorithm.reward_fn`` the rewards come from that function of the generated tokens instead.

Per-token tensors are aligned to the s-1 predicted positions of a sequence (position t holds
the log-prob of token t+1); ``mask`` marks the response tokens.

- PPO (Ouyang et al. 2022): per-token reward -kl_coef * (log pi_old - log pi_ref), plus the
  sequence score on its last token; GAE (Schulman et al. 2016) with the critic's values;
  advantages whitened over the batch's response tokens; returns = GAE advantages + values.
- GRPO (Shao et al. 2024): advantage of a sample = (score - group mean) / (group std + eps)
  over the samples of its prompt; RLOO: score - mean of the other samples; ReMax: score - the
  greedy sample's score. Their KL to the reference is in the loss (`runtime.losses`).

A train call of a traced loop (`planner.auto`) whose first input is a host step's output trains
on that batch as the loop's own Python computed it (`prepared_batch`): the rows its loss reads
(`LOSS_ROWS`), the minibatch normalisers counted from its mask as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from plans.errors import PlannerError
from plans.plan import Plan, PlanCall
from plans.sharding import split_range
from runtime.data import RowInfo, Tokenizer

Rows = dict[str, Tensor]
RewardFn = Callable[[Tensor, Tensor], Tensor]
ADV_EPS = 1e-6  # keeps whitening and group normalisation finite when all rewards are equal


@dataclass
class TrainBatch:
    """What a train call optimises: rows, the normaliser of each minibatch, the row group size
    that must stay on one rank (2 for DPO pairs), and statistics for the metrics."""

    rows: Rows
    denoms: list[float]
    group: int
    stats: dict[str, float]


# The rows each loss reads (`runtime.losses`), besides any others the batch carries.
LOSS_ROWS: dict[str, tuple[str, ...]] = {
    "sft": ("tokens", "mask"),
    "dpo": ("tokens", "mask", "ref_logprobs"),
    "ppo_policy": ("tokens", "mask", "old_logprobs", "advantages"),
    "ppo_value": ("tokens", "mask", "old_values", "returns"),
    "grpo": ("tokens", "mask", "old_logprobs", "advantages", "ref_logprobs"),
    "rloo": ("tokens", "mask", "old_logprobs", "advantages", "ref_logprobs"),
    "remax": ("tokens", "mask", "old_logprobs", "advantages", "ref_logprobs"),
}


def aligned(samples: Rows, key: str) -> Tensor:
    """A [B, gen_len] generate output placed at the response positions of [B, s-1]."""
    t = samples[key]
    b, s = samples["tokens"].shape
    out = torch.zeros((b, s - 1), dtype=t.dtype, device=t.device)
    out[:, s - 1 - t.shape[1]:] = t
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> Tensor:
    """Generalised advantage estimates [B, T] for per-token rewards and values; the episode ends
    after the last masked-in token (its next value is 0)."""
    b, t_len = rewards.shape
    adv = torch.zeros_like(rewards)
    running = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    end = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    m = mask.to(rewards.dtype)
    for t in reversed(range(t_len)):
        cont = m[:, t + 1] if t + 1 < t_len else end
        next_v = values[:, t + 1] * cont if t + 1 < t_len else end
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        running = delta + gamma * lam * cont * running
        adv[:, t] = running * m[:, t]
    return adv


def whiten(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / n
    return (x - mean) * torch.rsqrt(var + ADV_EPS) * m


def last_index(mask: Tensor) -> Tensor:
    """Index of the last True per row of `mask` [B, T] (0 when none)."""
    t = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask, t, torch.zeros_like(t)).max(dim=1).values


def group_advantages(scores: Tensor, *, kind: str, group: int, baseline: Tensor | None = None) -> Tensor:
    """Per-sequence advantages of GRPO, RLOO or ReMax [B]."""
    if kind == "remax":
        assert baseline is not None
        return scores - baseline
    g = scores.view(-1, group)
    if kind == "grpo":
        return ((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + ADV_EPS)).reshape(-1)
    if kind == "rloo":
        return (g - (g.sum(dim=1, keepdim=True) - g) / (group - 1)).reshape(-1)
    raise ValueError(kind)


def _denoms(counts: Tensor, minibatches: int, group: int) -> list[float]:
    units = counts.shape[0] // group
    out = []
    for k in range(minibatches):
        lo, hi = split_range(units, minibatches, k)
        out.append(max(1.0, float(counts[lo * group:hi * group].sum())))
    return out


def prepared_batch(call: PlanCall, *, batch: object, source: str) -> TrainBatch:
    """The batch of train call `call` as a host step computed it: a dict of tensors, one row per
    sequence, with the rows its loss reads; a `PlannerError` naming `source` otherwise."""
    assert call.loss is not None
    where = f"train call {call.name!r} (loss {call.loss}) trains on {source}"
    if not isinstance(batch, dict) or not all(isinstance(v, Tensor) for v in batch.values()):
        raise PlannerError(f"{where}, which returned a {type(batch).__name__}, not a dict of tensors",
                           hint=f"return a dict with the rows {', '.join(LOSS_ROWS[call.loss])}")
    missing = [k for k in LOSS_ROWS[call.loss] if k not in batch]
    if missing:
        raise PlannerError(f"{where}, which lacks {', '.join(missing)}",
                           hint=f"the {call.loss} loss reads {', '.join(LOSS_ROWS[call.loss])}")
    rows: Rows = dict(batch)
    wrong = [f"{k} {tuple(v.shape)}" for k, v in rows.items() if v.dim() == 0 or v.shape[0] != call.seqs]
    if wrong or tuple(rows["tokens"].shape) != (call.seqs, call.seq_len):
        raise PlannerError(f"{where}; the call reads {call.seqs} sequences of {call.seq_len} tokens, but the batch "
                           f"has tokens {tuple(rows['tokens'].shape)}" + (f" and {', '.join(wrong)}" if wrong else ""),
                           hint="every row of the batch is one sequence (dim 0)")
    if call.loss == "dpo":
        pairs = torch.ones(call.seqs // 2)
        return TrainBatch(rows, _denoms(pairs.repeat_interleave(2) / 2, call.minibatches, 2), 2, {})
    return TrainBatch(rows, _denoms(rows["mask"].sum(1), call.minibatches, 1), 1, {})


class Glue:
    """Builds each train call's batch from the step's data handles."""

    def __init__(self, plan: Plan, *, reward_fn: RewardFn | None, tokenizer: Tokenizer | None = None) -> None:
        """`tokenizer`: of the plan's datasets, when it has some: responses then end at its EOS and
        the reward function scores their text (`text_scores`)."""
        self.plan, self.algo, self.reward_fn = plan, plan.algorithm, reward_fn
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id if tokenizer is not None else None
        self.producer = {h: c for c in plan.calls for h in c.outputs}
        self.host_producer = {h: s.name for s in plan.host_steps for h in s.outputs}
        self.policies = {c.model for c in plan.calls if c.kind == "generate"}

    def _inputs(self, call: PlanCall, store: dict[str, Rows]) -> dict[str, list[Rows]]:
        """The call's inputs by role: samples, logprobs (another model's: the reference's),
        policy_logprobs (a generating model's own, recomputed by an inference call), values,
        scores, data."""
        roles: dict[str, list[Rows]] = {"samples": [], "logprobs": [], "policy_logprobs": [], "values": [],
                                        "scores": [], "data": []}
        for h in call.inputs:
            src = self.producer.get(h)
            if src is None:
                roles["data"].append(store[h])
            elif src.kind == "generate":
                roles["samples"].append(store[h])
            elif src.kind == "inference":
                own = src.returns == "logprobs" and src.model in self.policies
                roles["policy_logprobs" if own else str(src.returns)].append(store[h])
        return roles

    def _scores(self, samples: Rows, given: list[Rows], index: int, rows: list[RowInfo] | None = None) -> Tensor:
        if index < len(given):
            return given[index]["scores"]
        if self.reward_fn is None:
            raise PlannerError("the plan has no reward model call and no algorithm.reward_fn",
                               hint="give the graph a reward model or reward_fn='module:function'")
        tokens, gen_len = samples["tokens"], samples["mask"].shape[1]
        if rows is not None and self.tokenizer is not None:
            responses = [self.tokenizer.decode(t[m].tolist()) for t, m in zip(tokens[:, -gen_len:], samples["mask"])]
            return text_scores(self.reward_fn, rows, responses, name=str(self.algo.reward_fn)).to(tokens.device)
        return self.reward_fn(tokens[:, :-gen_len], tokens[:, -gen_len:]).float().to(tokens.device)

    def _sample_rows(self, call: PlanCall | None, rows: dict[str, list[RowInfo]],
                     handle: str) -> list[RowInfo] | None:
        """What the dataset says of each sample of generate output `handle` (None without a dataset)."""
        gen = self.producer.get(handle)
        if gen is None or gen.kind != "generate" or gen.inputs[0] not in rows:
            return None
        return [r for r in rows[gen.inputs[0]] for _ in range(gen.samples_per_prompt)]

    def train_batch(self, call: PlanCall, store: dict[str, Rows],
                    dataset_rows: dict[str, list[RowInfo]] | None = None) -> TrainBatch:
        """The rows, minibatch normalisers and statistics of train call `call`; `dataset_rows`: what
        the step's dataset rows say (prompt text, extra columns) for a reward function on text."""
        infos = dataset_rows or {}
        kind, algo = call.loss, self.algo
        first = call.inputs[0] if call.inputs else None
        if first in self.host_producer:
            return prepared_batch(call, batch=store[first], source=f"host step {self.host_producer[first]!r}'s {first!r}")
        hosted = [h for h in call.inputs if h in self.host_producer]
        if hosted:  # the glue below would not read it: refuse rather than train on something else
            raise PlannerError(f"train call {call.name!r} reads host step output {hosted[0]!r} after {first!r}",
                               hint="a train call trains on the host step output it reads first")
        roles = self._inputs(call, store)
        rows: Rows
        if kind in ("sft", "dpo"):
            data = roles["data"][0] if roles["data"] else roles["samples"][0]
            rows = {"tokens": data["tokens"], "mask": data["mask"]}
            if kind == "sft":
                return TrainBatch(rows, _denoms(data["mask"].sum(1), call.minibatches, 1), 1, {})
            rows["ref_logprobs"] = roles["logprobs"][0]["logprobs"]
            pairs = torch.ones(data["tokens"].shape[0] // 2)
            return TrainBatch(rows, _denoms(pairs.repeat_interleave(2) / 2, call.minibatches, 2), 2, {})
        samples = roles["samples"][0]
        mask = aligned(samples, "mask")
        # The PPO ratio's and the KL term's log-probs: the policy's recomputed ones where the plan
        # has that call (verl's and OpenRLHF's way), else generation's.
        if roles["policy_logprobs"]:  # [B, s-1] over every position: the response's kept, as generation gives them
            old_lp = torch.where(mask.bool(), roles["policy_logprobs"][0]["logprobs"], 0.0)
        else:
            old_lp = aligned(samples, "logprobs")
        sample_rows = self._sample_rows(call, infos, call.inputs[0])
        scores = self._scores(samples, roles["scores"], 0, sample_rows)
        ref_lp = roles["logprobs"][0]["logprobs"] if roles["logprobs"] else old_lp
        stats = {"reward_mean": float(scores.mean()), "response_len": float(mask.sum(1).float().mean())}
        rows = {"tokens": samples["tokens"], "mask": mask, "old_logprobs": old_lp, "ref_logprobs": ref_lp}
        if "pad" in samples:
            rows["pad"] = samples["pad"]
        if kind in ("ppo_policy", "ppo_value"):
            values = roles["values"][0]["values"][:, :-1] * mask
            kl = (old_lp - ref_lp) * mask
            rewards = -algo.kl_coef * kl
            rewards[torch.arange(rewards.shape[0], device=rewards.device), last_index(mask)] += scores.to(rewards.device)
            adv = gae(rewards, values, mask, gamma=algo.gamma, lam=algo.lam)
            rows.update(advantages=whiten(adv, mask), returns=(adv + values) * mask, old_values=values)
            stats["kl_mean"] = float(kl.sum() / mask.sum().clamp(min=1))
        else:
            gen_call = self.producer[call.inputs[0]]
            second = call.inputs[1] if len(call.inputs) > 1 else call.inputs[0]
            baseline = self._scores(roles["samples"][1], roles["scores"], 1, self._sample_rows(call, infos, second)) \
                if kind == "remax" else None
            adv = group_advantages(scores, kind=str(kind), group=gen_call.samples_per_prompt, baseline=baseline)
            rows["advantages"] = adv[:, None] * mask
        return TrainBatch(rows, _denoms(mask.sum(1), call.minibatches, 1), 1, stats)


def text_scores(fn: Callable[..., Any], rows: list[RowInfo], responses: list[str], *, name: str) -> Tensor:
    """The reward of each response [B]: ``fn(prompt=..., response=..., **extra columns)`` per sample
    (verl's compute_score shape), or one call on lists when ``fn.batched`` is true. An exception or
    a value that is not a finite number is a `PlannerError` naming the dataset row."""
    def failed(i: int, why: str) -> PlannerError:
        return PlannerError(f"reward function {name!r} {why} for dataset row {rows[i].index} "
                            f"(prompt {rows[i].prompt[:60]!r})", hint="fix the function; it must return a number")

    if getattr(fn, "batched", False):
        extras = {k: [r.extras[k] for r in rows] for k in (rows[0].extras if rows else {})}
        try:
            values = list(fn(prompts=[r.prompt for r in rows], responses=responses, **extras))
        except Exception as e:
            raise PlannerError(f"reward function {name!r} raised {type(e).__name__}: {e} on a batch of "
                               f"{len(rows)} responses") from None
        if len(values) != len(rows):
            raise PlannerError(f"reward function {name!r} returned {len(values)} rewards for {len(rows)} responses")
    else:
        values = []
        for i, (r, response) in enumerate(zip(rows, responses)):
            try:
                values.append(fn(prompt=r.prompt, response=response, **r.extras))
            except Exception as e:
                raise failed(i, f"raised {type(e).__name__}: {e}") from None
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise failed(i, f"returned {v!r}, not a finite number")
        out.append(float(v))
    return torch.tensor(out, dtype=torch.float32)
