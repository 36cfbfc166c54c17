"""Toy tasks: seeded data sources and rule-based rewards a tiny model can learn in a few steps.

``pattern`` (the task of `examples/tiny_ppo.py`): prompts are random tokens; the reward of a
response is the fraction of its tokens in the target class, the ids divisible by
`PATTERN_MODULUS`. A random model scores about 1 / PATTERN_MODULUS, a model that learned the
rule scores 1, so the mean reward is a direct, checkable learning curve. Supervised (``tokens``)
and preference (``pairs``) inputs of the same task put target-class responses after random
prompts (DPO's rejected side is a uniformly random response).

Without a task (``algorithm.task`` unset) every input is uniformly random tokens.

Inputs are pure functions of (seed, step, input name), so every rank of a run, and the
single-process reference, sees the same batch without communicating.
"""

from __future__ import annotations

import zlib

import torch
from torch import Tensor

from plans.errors import PlannerError
from plans.graph import DataInput

PATTERN_MODULUS = 4
TASKS = ("pattern",)


def pattern_reward(prompts: Tensor, responses: Tensor) -> Tensor:
    """Fraction of each response's tokens [B, G] whose id is a multiple of `PATTERN_MODULUS` -> [B]."""
    del prompts  # the rule does not depend on the prompt
    return (responses % PATTERN_MODULUS == 0).float().mean(dim=1)


def _generator(seed: int, step: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{step}:{name}".encode()))


def _target_tokens(n: int, length: int, vocab_size: int, gen: torch.Generator) -> Tensor:
    classes = max(1, vocab_size // PATTERN_MODULUS)
    return torch.randint(0, classes, (n, length), generator=gen) * PATTERN_MODULUS


def make_inputs(task: str | None, inputs: list[DataInput], *, vocab_size: int, seed: int,
                step: int) -> dict[str, dict[str, Tensor]]:
    """The graph inputs of one step: ``prompts`` -> {tokens}; ``tokens`` (SFT) and ``pairs``
    (DPO, chosen and rejected interleaved) -> {tokens, mask}, the mask [n, s-1] marking the
    predicted tokens that count (the response, the second half of each sequence)."""
    if task is not None and task not in TASKS:
        raise PlannerError(f"unknown task {task!r} in the plan's algorithm", hint=f"known tasks: {', '.join(TASKS)}")
    out: dict[str, dict[str, Tensor]] = {}
    for inp in inputs:
        gen = _generator(seed, step, inp.name)
        n, s = inp.seqs, inp.seq_len
        if inp.name == "prompts":
            out[inp.name] = {"tokens": torch.randint(0, vocab_size, (n, s), generator=gen)}
            continue
        prompt = max(1, s // 2)
        tokens = torch.randint(0, vocab_size, (n, s), generator=gen)
        if task == "pattern":
            good = _target_tokens(n, s - prompt, vocab_size, gen)
            if inp.name == "pairs":
                good = good[0::2].repeat_interleave(2, dim=0)[:n]
                tokens[0::2, prompt:] = good[0::2]  # chosen rows; rejected rows keep random responses
                tokens[1::2, :prompt] = tokens[0::2, :prompt]  # both sides share the prompt
            else:
                tokens[:, prompt:] = good
        mask = torch.zeros(n, s - 1, dtype=torch.bool)
        mask[:, prompt - 1:] = True
        out[inp.name] = {"tokens": tokens, "mask": mask}
    return out
