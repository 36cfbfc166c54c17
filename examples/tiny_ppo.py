"""Tiny PPO on 4 CPU ranks: the plan the runtime runs in tests and in `bench/`.

Tiny Llama actor and critic (a value head), a frozen reference, and a rule-based reward on the
generated tokens (the toy task in `runtime/tasks.py`), on a `cpu:1x4` cluster.

    planner compile examples/tiny_ppo.py -o plans/tiny_ppo.json
    torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 30
"""

from planner.algorithms import ppo

CLUSTER = "cpu:1x4"

graph = ppo(
    "tiny-llama",
    critic="tiny-llama",
    reward_fn="runtime.tasks:pattern_reward",
    batch=16,
    prompt_len=8,
    gen_len=8,
    ppo_minibatches=2,
    name="tiny_ppo",
    task="pattern",
    lr=1e-3,
)
