"""Algorithm glue, losses, sampling and the toy task, against hand-written definitions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from plans import AlgorithmConfig, DataInput
from runtime.algorithms import gae, group_advantages, whiten
from runtime.generate import gumbel_noise
from runtime.losses import make_loss
from runtime.tasks import PATTERN_MODULUS, make_inputs, pattern_reward


def _gae_loop(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    """GAE of one episode, straight from Schulman et al. (2016), eq. 16."""
    out, running = [0.0] * len(r), 0.0
    for t in reversed(range(len(r))):
        nxt = v[t + 1] if t + 1 < len(r) else 0.0
        running = r[t] + gamma * nxt - v[t] + gamma * lam * running
        out[t] = running
    return out


def test_gae_matches_the_definition_per_episode() -> None:
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False  # an episode that stopped early
    mask[2, :2] = False  # a prompt before the response
    adv = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for b in range(3):
        idx = mask[b].nonzero()[:, 0].tolist()
        want = _gae_loop(rewards[b, idx].tolist(), values[b, idx].tolist(), 0.9, 0.8)
        assert torch.allclose(adv[b, idx], torch.tensor(want), atol=1e-6)
        assert (adv[b][~mask[b]] == 0).all()


def test_group_advantages() -> None:
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0])
    grpo = group_advantages(scores, kind="grpo", group=2)
    assert torch.allclose(grpo[:2], torch.tensor([0.5, -0.5]) / math.sqrt(0.5), atol=1e-4)  # unbiased std
    assert torch.allclose(grpo[2:4], torch.zeros(2))
    rloo = group_advantages(scores, kind="rloo", group=3)
    assert torch.allclose(rloo, torch.tensor([0.75, -0.75, 0.0, -2.5, -0.25, 2.75]))
    remax = group_advantages(scores, kind="remax", group=1, baseline=torch.ones(6))
    assert torch.equal(remax, scores - 1)
    w = whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[True, True, True, False]]))
    assert abs(w[0, :3].mean().item()) < 1e-6 and w[0, 3] == 0


def test_losses_reduce_to_their_textbook_forms() -> None:
    algo = AlgorithmConfig(clip_eps=0.2, dpo_beta=0.5)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5, 7, generator=g)
    tokens = torch.randint(0, 7, (4, 6), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    mask = torch.ones(4, 5, dtype=torch.bool)
    loss, _ = make_loss("sft", algo)(lp, {"tokens": tokens, "mask": mask}, float(mask.sum()))
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 7), tokens[:, 1:].reshape(-1)))
    adv = torch.randn(4, 5, generator=g)
    rows = {"tokens": tokens, "mask": mask, "old_logprobs": lp, "advantages": adv, "ref_logprobs": lp}
    loss, stats = make_loss("ppo_policy", algo)(lp, rows, 20.0)
    assert torch.allclose(loss, -adv.mean()) and stats["clip_frac"] == 0
    loss, _ = make_loss("ppo_policy", algo)(lp + 1.0, rows, 20.0)  # ratio e > 1 + eps: clipped where adv > 0
    want = torch.maximum(-adv * math.e, -adv * 1.2).mean()
    assert torch.allclose(loss, want)
    loss, _ = make_loss("dpo", algo)(lp, rows, 2.0)  # policy == reference: -log sigmoid(0)
    assert torch.allclose(loss, torch.tensor(math.log(2.0)))


def test_gumbel_max_samples_follow_the_softmax() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0], dtype=torch.float64)
    n = 40000
    noise = gumbel_noise(1234, torch.arange(n), 5, (0, 4))
    picks = (logits[None] + noise).argmax(-1)
    freq = torch.bincount(picks, minlength=4).double() / n
    assert (freq - torch.softmax(logits, 0)).abs().max() < 0.01
    assert torch.equal(noise, gumbel_noise(1234, torch.arange(n), 5, (0, 4)))  # a pure function
    assert not torch.equal(noise[:10], gumbel_noise(1234, torch.arange(n), 6, (0, 4))[:10])


def test_pattern_task_is_seeded_and_its_reward_checkable() -> None:
    inputs = [DataInput(name="prompts", seqs=8, seq_len=5), DataInput(name="pairs", seqs=8, seq_len=10),
              DataInput(name="tokens", seqs=4, seq_len=10)]
    a = make_inputs("pattern", inputs, vocab_size=256, seed=3, step=1)
    b = make_inputs("pattern", inputs, vocab_size=256, seed=3, step=1)
    c = make_inputs("pattern", inputs, vocab_size=256, seed=3, step=2)
    assert torch.equal(a["prompts"]["tokens"], b["prompts"]["tokens"])
    assert not torch.equal(a["prompts"]["tokens"], c["prompts"]["tokens"])
    pairs = a["pairs"]["tokens"]
    assert torch.equal(pairs[0::2, :5], pairs[1::2, :5])  # chosen and rejected share the prompt
    assert (pattern_reward(pairs[0::2, :5], pairs[0::2, 5:]) == 1).all()
    assert (a["tokens"]["tokens"][:, 5:] % PATTERN_MODULUS == 0).all()
    assert a["tokens"]["mask"].shape == (4, 9) and a["tokens"]["mask"][:, 4:].all() and not a["tokens"]["mask"][:, :4].any()
    responses = torch.tensor([[0, 4, 8, 1], [1, 2, 3, 5]])
    assert torch.equal(pattern_reward(torch.zeros(2, 3), responses), torch.tensor([0.75, 0.0]))


def test_recomputed_policy_logprobs_are_the_ratios_old_logprobs() -> None:
    """With an `actor_logprobs` call (verl's and OpenRLHF's way), the PPO ratio and the KL term
    take the actor's recomputed log-probs over the response, not generation's; the reference's
    stay the reference's. Without it, generation's."""
    from planner.algorithms import ppo
    from planner.compile import compile_graph
    from plans.cluster import parse_cluster
    from runtime.algorithms import Glue, aligned

    b, prompt, gen = 4, 5, 3
    s = prompt + gen
    g = torch.Generator().manual_seed(0)
    samples = {"tokens": torch.randint(0, 50, (b, s), generator=g), "mask": torch.ones(b, gen, dtype=torch.bool),
               "logprobs": -torch.rand(b, gen, generator=g)}
    samples["mask"][0, -1] = False  # a response that ended early
    recomputed = {"logprobs": -torch.rand(b, s - 1, generator=g)}
    ref = {"logprobs": -torch.rand(b, s - 1, generator=g)}
    values = {"values": torch.rand(b, s, generator=g)}
    for on in (True, False):
        graph = ppo("tiny-llama", reward_fn="runtime.tasks:pattern_reward", batch=b, prompt_len=prompt, gen_len=gen,
                    ppo_minibatches=1, policy_logprobs=on)
        plan = compile_graph(graph, parse_cluster("cpu:1x1"), time_limit_s=0)
        store = {plan.call("actor_generate").outputs[0]: samples, plan.call("ref_inference").outputs[0]: ref,
                 plan.call("critic_inference").outputs[0]: values}
        if on:
            store[plan.call("actor_logprobs").outputs[0]] = recomputed
        glue = Glue(plan, reward_fn=pattern_reward)
        for name in ("actor_train", "critic_train"):
            rows = glue.train_batch(plan.call(name), store).rows
            mask = rows["mask"].bool()
            if on:  # the response's positions, zero elsewhere as generation's are
                assert torch.equal(rows["old_logprobs"][mask], recomputed["logprobs"][mask])
                assert torch.equal(rows["old_logprobs"][~mask], torch.zeros(int((~mask).sum())))
            else:
                assert torch.equal(rows["old_logprobs"], aligned(samples, "logprobs"))
            assert torch.equal(rows["ref_logprobs"], ref["logprobs"])
