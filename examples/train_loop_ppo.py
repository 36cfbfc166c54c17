"""Tiny PPO written as a plain training loop with `@planner.auto`.

The models, task, hyperparameters and seed of `examples/tiny_ppo.py` (a tiny Llama actor, a tiny
Llama critic with a value head, a frozen reference; the pattern reward of `runtime.tasks`; Adam
with lr 5e-3 and epsilon 1e-5; KL coefficient 0.01), but instead of a graph, the Python of one
iteration: five model calls, and the reward and PPO's advantages as host steps written with the
runtime's own functions (GAE, whitening), so the math is the runtime's and a run gives, step by
step, the metrics `torchrun -m runtime` gives for the compiled graph of tiny_ppo.py.

    torchrun --nproc-per-node 4 examples/train_loop_ppo.py --steps 30   # on the plan's 4 ranks
    python examples/train_loop_ppo.py --steps 30                       # single-process reference
    planner compile examples/train_loop_ppo.py                         # only the plan

The first run traces `ppo_step`, compiles its plan and writes plans/train_loop_ppo.json (relative
to the working directory); later runs reuse it until the loop, the cluster or the models change.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import planner
from plans.errors import PlannerError
from plans.io import write_text_atomic
from runtime.algorithms import aligned, gae, last_index, whiten
from runtime.tasks import pattern_reward

KL_COEF = 0.01  # weight of the per-token KL penalty to the reference in PPO's reward
GAMMA, LAM = 1.0, 0.95  # GAE discount and lambda (the runtime's defaults)


@planner.host
def reward(samples):
    """The pattern task's score of each response [n] (the fraction of its tokens in the class)."""
    gen_len = samples["mask"].shape[1]
    tokens = samples["tokens"]  # [n, prompt + gen]
    return pattern_reward(tokens[:, :-gen_len], tokens[:, -gen_len:]).float()


@planner.host(outputs=("batch", "stats"))
def ppo_batch(samples, scores, ref, values):
    """PPO's training rows (InstructGPT's reward: a KL penalty per token and the score on the last
    response token; GAE advantages, whitened over the batch; returns), and the batch's statistics."""
    mask = aligned(samples, "mask")  # [n, s-1]: the predicted positions that are response tokens
    old_lp = aligned(samples, "logprobs")  # [n, s-1] log-probs of the sampled tokens
    ref_lp = ref["logprobs"]  # [n, s-1]
    old_values = values["values"][:, :-1] * mask  # [n, s-1]: the value before each token
    kl = (old_lp - ref_lp) * mask
    rewards = -KL_COEF * kl
    rewards[torch.arange(rewards.shape[0]), last_index(mask)] += scores
    adv = gae(rewards, old_values, mask, gamma=GAMMA, lam=LAM)
    batch = {"tokens": samples["tokens"], "mask": mask, "old_logprobs": old_lp, "ref_logprobs": ref_lp,
             "advantages": whiten(adv, mask), "returns": (adv + old_values) * mask, "old_values": old_values}
    stats = {"reward_mean": float(scores.mean()), "response_len": float(mask.sum(1).float().mean()),
             "kl_mean": float(kl.sum() / mask.sum().clamp(min=1))}
    return batch, stats


@planner.auto(
    cluster="cpu:1x4",
    plan="plans/train_loop_ppo.json",
    models={
        "actor": planner.model("tiny-llama", trainable=True),
        "critic": planner.model("tiny-llama", trainable=True, head="value"),
        "ref": "tiny-llama",
    },
    batch=16,
    prompt_len=8,
    gen_len=8,
    algorithm={"task": "pattern", "lr": 5e-3, "adam_eps": 1e-5},
    time_limit_s=2,
)
def ppo_step(actor, critic, ref, prompts):
    """One PPO iteration on a batch of prompts (drawn from the pattern task each step)."""
    samples = actor.generate(prompts)
    scores = reward(samples)
    ref_lp = ref.inference(samples)
    values = critic.inference(samples)
    batch, stats = ppo_batch(samples, scores, ref_lp, values)
    actor.train(batch, loss="ppo_policy")
    critic.train(batch, loss="ppo_value")
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Tiny PPO as a plain loop on its compiled plan.")
    ap.add_argument("--steps", type=int, default=30, help="iterations (default 30)")
    ap.add_argument("--metrics-out", help="write one JSON object per step to this .jsonl file (rank 0)")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    lines: list[str] = []
    try:
        for _ in range(args.steps):
            stats = ppo_step()
            if rank == 0:
                lines.append(json.dumps({**ppo_step.last_metrics, **stats}, sort_keys=True))
                print(lines[-1], flush=True)
                if args.metrics_out:
                    write_text_atomic(args.metrics_out, "\n".join(lines) + "\n")
    except PlannerError as e:
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return PlannerError.exit_code
    finally:
        ppo_step.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
