"""Tiny PPO on 4 CPU ranks: the plan the runtime runs in tests and in `bench/`.

Tiny Llama actor and critic (a value head), a frozen reference, and a rule-based reward on the
generated tokens (the toy task in `runtime/tasks.py`), on a `cpu:1x4` cluster. The compiled plan
(with the shipped CPU calibration) runs every call on rank 0 but the critic's training, which
runs on rank 1 beside the actor's, the critic's weights reallocated to rank 0 for its inference:
at most two calls at a time on the machine's 2 cores (ranks 2 and 3 stay idle), as on 4 ranks
sharing 2 cores a third or fourth busy rank only slows the other two, and a call spread wider
pays more host work than it saves (`bench/predict_vs_measure.py` measures it). Tests and `bench/rlhf_learning.py` place calls by hand where a model must move.

Hyperparameters: the reward rises from 0.25 (random) to about 0.8 in 30 steps, with a light KL
penalty (0.05 held the reward near 0.6). RL training amplifies float rounding (sampling is
discrete; Adam normalises gradients that are mostly noise), so two runs whose weights differ by
rounding, such as a parallel run and the single-process reference, eventually part; the
settings keep them within 1e-5 for 30 steps (`bench/rlhf_learning.py` measures it): Adam's
epsilon 1e-5 as in common PPO implementations (with 1e-8 they part within 5 steps), one
optimizer step per call, and a learning rate of 5e-3 (1e-2 learns faster, to 0.97, but the runs
part at step 17, as does a single-process run whose weights are perturbed by 1e-7).

    planner compile examples/tiny_ppo.py -o plans/tiny_ppo.json
    torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 30
"""

from planner.algorithms import ppo

CLUSTER = "cpu:1x4"

# Everything but the actor and the name (`examples/tiny_ppo_moe.py` reuses it with an MoE actor).
SETTINGS = dict(
    critic="tiny-llama",
    reward_fn="runtime.tasks:pattern_reward",
    batch=16,
    prompt_len=8,
    gen_len=8,
    ppo_minibatches=1,
    task="pattern",
    lr=5e-3,
    adam_eps=1e-5,
    kl_coef=0.01,
)

graph = ppo("tiny-llama", name="tiny_ppo", **SETTINGS)
