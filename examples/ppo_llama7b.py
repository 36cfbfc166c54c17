"""PPO with four Llama-2-7B models (actor, critic, reference, reward) on two 8-GPU A100 nodes.

    planner compile examples/ppo_llama7b.py
"""

from planner.algorithms import ppo

CLUSTER = "a100-80gb:2x8"

graph = ppo(
    "llama-2-7b",
    critic="llama-2-7b",
    ref="llama-2-7b",
    reward="llama-2-7b",
    batch=512,
    prompt_len=1024,
    gen_len=1024,
    ppo_minibatches=4,
    name="ppo_llama7b",
)
