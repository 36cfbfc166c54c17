"""GRPO with Qwen2.5-7B (8 samples per prompt, a reward model of the same size) on one 8-GPU H100 node.

    planner compile examples/grpo_qwen7b.py
"""

from planner.algorithms import grpo

CLUSTER = "h100-sxm:1x8"

graph = grpo(
    "qwen2.5-7b",
    reward="qwen2.5-7b",
    batch=512,
    prompt_len=1024,
    gen_len=1024,
    samples_per_prompt=8,
    ppo_minibatches=4,
    name="grpo_qwen7b",
)
