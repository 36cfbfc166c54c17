"""Tiny GRPO on 4 CPU ranks: group-normalised advantages and a Python reward function.

A tiny Llama actor samples 4 responses to each of 8 prompts; `runtime.tasks:pattern_reward`
scores them (no reward model); a frozen reference gives the KL term of the loss. Compiled for a
`cpu:1x4` cluster, the plan runs every call data-parallel on ranks 0-1 (two ranks fill the
machine's 2 cores), so the actor generates from the very slices it trains (no reallocation). The calls form one chain (generate ->
reference -> train -> next generate), so no call can run beside another and the compiler keeps
them on one mesh.

The reward rises from 0.25 to about 1.0 in 30 steps; Adam's epsilon and one optimizer step per
call keep the 4-rank run within float tolerance of the single-process reference for all of them
(see `examples/tiny_ppo.py`).

    planner compile examples/tiny_grpo.py -o plans/tiny_grpo.json
    torchrun --nproc-per-node 4 -m runtime plans/tiny_grpo.json --steps 30
"""

from planner.algorithms import grpo

CLUSTER = "cpu:1x4"

graph = grpo(
    "tiny-llama",
    reward_fn="runtime.tasks:pattern_reward",
    batch=8,
    samples_per_prompt=4,
    prompt_len=8,
    gen_len=8,
    ppo_minibatches=1,
    name="tiny_grpo",
    task="pattern",
    lr=1e-2,
    adam_eps=1e-5,
    kl_coef=0.01,
)
