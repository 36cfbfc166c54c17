"""Tiny PPO with a mixture-of-experts actor on 4 CPU ranks: `examples/tiny_ppo.py` with the actor
(and its frozen reference) a tiny Mixtral (4 layers of 4 experts, top 2), to check the cost
model's pricing of the runtime's MoE layers against their measured times.

    planner compile examples/tiny_ppo_moe.py -o plans/tiny_ppo_moe.json
    torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo_moe.json --steps 20
    python bench/predict_vs_measure.py --example examples/tiny_ppo_moe.py
"""

import runpy
from pathlib import Path

from planner.algorithms import ppo

CLUSTER = "cpu:1x4"

SETTINGS = runpy.run_path(str(Path(__file__).with_name("tiny_ppo.py")))["SETTINGS"]

graph = ppo("tiny-mixtral", name="tiny_ppo_moe", **SETTINGS)
