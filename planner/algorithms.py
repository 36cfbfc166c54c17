"""The standard graphs of LLM post-training and training algorithms.

Each builder returns a validated `plans.Graph` with the calls the algorithm makes per iteration:

=========  =========================================================================================
sft        train(tokens)
dpo        ref inference(pairs) ; actor train(pairs)                    (pairs = chosen + rejected)
ppo        actor generate ; reward, ref, critic inference ; actor train ; critic train
grpo       actor generate (n per prompt) ; reward, ref inference ; actor train   (group baseline)
remax      actor generate (sampled) and generate (greedy baseline) ; reward on both ; ref ; train
rloo       like grpo, with the leave-one-out baseline
=========  =========================================================================================

With ``policy_logprobs=True`` the RL algorithms also run the actor over its own samples before
training (``actor_logprobs``, an inference call): the log-probs of the PPO ratio and the KL term
come from that forward pass, as verl and OpenRLHF compute them, not from generation (what the
planner's runtime does without it). ``planner compile`` turns it on for the stacks that work so
(`cost_models.framework.EngineLayouts.policy_logprobs`), and adds the same call to a graph file's
graph that lacks it (`with_policy_logprobs`).

Rewards come from a reward model (value head, scored at the last token) or, with ``reward_fn``,
from a Python function of the generated tokens (no reward-model call), or of their text when the
prompts come from a dataset (``data={"data": "train.jsonl", "key": "prompt", ...}``: the keyword
arguments of `planner.graph.Graph.input`).
"""

from __future__ import annotations

from typing import Any

from planner.graph import Data, Graph, ModelHandle
from plans.base import validated
from plans.errors import PlannerError
from plans.graph import AlgorithmConfig, Call, Loss
from plans.graph import Graph as GraphSpec
from plans.model import ModelSpec

Spec = str | ModelSpec


def _algo(name: str, reward_fn: str | None, overrides: dict[str, Any]) -> AlgorithmConfig:
    return validated(AlgorithmConfig, {**overrides, "name": name, "reward_fn": reward_fn},
                     source=f"{name} hyperparameters")


def sft(model: Spec, *, batch: int, seq_len: int, minibatches: int = 1, name: str = "sft",
        data: dict[str, Any] | None = None, **algo: Any) -> GraphSpec:
    """Supervised fine-tuning (or pretraining): one train call on `batch` sequences."""
    g = Graph(name, batch=batch, seq_len=seq_len, algorithm=_algo("sft", None, algo))
    m = g.model("model", model, trainable=True)
    m.train(g.input("tokens", **(data or {})), loss="sft", minibatches=minibatches, name="model_train")
    return g.build()


def dpo(actor: Spec, *, ref: Spec | None = None, batch: int, seq_len: int, minibatches: int = 1,
        name: str = "dpo", data: dict[str, Any] | None = None, **algo: Any) -> GraphSpec:
    """Direct preference optimisation: `batch` pairs, the reference scoring both sides."""
    g = Graph(name, batch=batch, seq_len=seq_len, algorithm=_algo("dpo", None, algo))
    a = g.model("actor", actor, trainable=True)
    r = g.model("ref", ref or actor)
    pairs = g.input("pairs", seqs=2 * batch, **(data or {}))
    ref_lp = r.inference(pairs, name="ref_inference")
    a.train(pairs, ref_lp, loss="dpo", minibatches=minibatches, name="actor_train")
    return g.build()


def _reward(g: Graph, reward: Spec | None, reward_fn: str | None, samples: Data, *, name: str = "reward_inference") -> list[Data]:
    if reward_fn is not None:
        return []
    if reward is None:
        raise PlannerError("the algorithm needs a reward model (--reward SPEC) or a reward function (--reward-fn module:fn)")
    rm = g.model("reward", reward, head="value") if "reward" not in g._models else ModelHandle(g, "reward")
    return [rm.inference(samples, returns="scores", name=name)]


def _policy_logprobs(a: ModelHandle, samples: Data, on: bool) -> list[Data]:
    """The actor's own log-probs of its samples, recomputed before training (``policy_logprobs``)."""
    return [a.inference(samples, name="actor_logprobs")] if on else []


RL_LOSSES: frozenset[Loss] = frozenset({"ppo_policy", "grpo", "rloo", "remax"})


def rl_trains(graph: GraphSpec) -> list[tuple[Call, Call]]:
    """(train call, generate call) pairs of `graph`: a train call with an RL loss whose first input
    is the samples its own model generated."""
    writers = {out: c for c in graph.calls for out in c.outputs}
    pairs = []
    for train in graph.calls:
        gen = writers.get(train.inputs[0]) if train.kind == "train" and train.inputs else None
        if train.loss in RL_LOSSES and gen is not None and gen.kind == "generate" and gen.model == train.model:
            pairs.append((train, gen))
    return pairs


def with_policy_logprobs(graph: GraphSpec) -> tuple[GraphSpec, list[str]]:
    """`graph` with each generating model's log-probs of its samples recomputed before it trains,
    as ``policy_logprobs=True`` builds the algorithms above, and the names of the calls added.

    For every train call with an RL loss whose first input is the samples of a generate call of
    its own model, and no inference call of that model already reading them: an inference call
    ``<model>_logprobs`` after the model's last generate call before the train call, its output
    passed to every train call whose first input is those samples (an algorithm's graph built
    without the flag becomes the one built with it, call for call)."""
    calls = list(graph.calls)
    names = {c.name for c in calls}
    handles = {out for c in calls for out in c.outputs} | {i.name for i in graph.inputs}
    added: list[str] = []
    for train, gen in rl_trains(graph):
        samples = train.inputs[0]
        if any(c.kind == "inference" and c.model == train.model and c.returns == "logprobs" and samples in c.inputs
               for c in calls):
            continue
        name, n = f"{train.model}_logprobs", 2
        while name in names or f"{name}.logprobs" in handles:
            name, n = f"{train.model}_logprobs_{n}", n + 1
        out = f"{name}.logprobs"
        call = validated(Call, dict(name=name, model=train.model, kind="inference", inputs=[samples], outputs=[out],
                                    seqs=gen.seqs, seq_len=gen.seq_len, returns="logprobs"), source=f"call {name!r}")
        order = [c.name for c in calls]
        at = max((i for i, c in enumerate(calls[:order.index(train.name)]) if c.kind == "generate"
                  and c.model == train.model), default=order.index(gen.name))
        calls.insert(at + 1, call)
        calls = [c.model_copy(update={"inputs": [*c.inputs, out]}) if c.kind == "train" and c.inputs[:1] == [samples]
                 else c for c in calls]
        names.add(name)
        handles.add(out)
        added.append(name)
    if not added:
        return graph, []
    return validated(GraphSpec, {**graph.model_dump(), "calls": [c.model_dump() for c in calls]},
                     source=f"graph {graph.name!r}"), added


def ppo(actor: Spec, *, critic: Spec | None = None, ref: Spec | None = None, reward: Spec | None = None,
        reward_fn: str | None = None, batch: int, prompt_len: int, gen_len: int, ppo_minibatches: int = 4,
        name: str = "ppo", data: dict[str, Any] | None = None, policy_logprobs: bool = False,
        **algo: Any) -> GraphSpec:
    """PPO with a critic (InstructGPT/ReaLHF's six calls, seven with `policy_logprobs`). `critic`
    and `reward` default to `actor`'s spec."""
    g = Graph(name, batch=batch, prompt_len=prompt_len, gen_len=gen_len, algorithm=_algo("ppo", reward_fn, algo))
    a = g.model("actor", actor, trainable=True)
    c = g.model("critic", critic or actor, trainable=True, head="value")
    r = g.model("ref", ref or actor)
    samples = a.generate(g.input("prompts", **(data or {})), name="actor_generate")
    old = _policy_logprobs(a, samples, policy_logprobs)
    rewards = _reward(g, reward or critic or actor, reward_fn, samples)
    ref_lp = r.inference(samples, name="ref_inference")
    values = c.inference(samples, name="critic_inference")
    a.train(samples, *rewards, ref_lp, values, *old, loss="ppo_policy", minibatches=ppo_minibatches, name="actor_train")
    c.train(samples, *rewards, ref_lp, values, *old, loss="ppo_value", minibatches=ppo_minibatches, name="critic_train")
    return g.build()


def _group(kind: Loss, actor: Spec, *, ref: Spec | None, reward: Spec | None, reward_fn: str | None, batch: int,
           prompt_len: int, gen_len: int, samples_per_prompt: int, ppo_minibatches: int, name: str,
           data: dict[str, Any] | None, policy_logprobs: bool, algo: dict[str, Any]) -> GraphSpec:
    if samples_per_prompt < 2:
        raise PlannerError(f"{kind} needs --samples-per-prompt of at least 2 (the baseline is the group), got {samples_per_prompt}")
    g = Graph(name, batch=batch, prompt_len=prompt_len, gen_len=gen_len, algorithm=_algo(kind, reward_fn, algo))
    a = g.model("actor", actor, trainable=True)
    r = g.model("ref", ref or actor)
    samples = a.generate(g.input("prompts", **(data or {})), samples_per_prompt=samples_per_prompt,
                         name="actor_generate")
    old = _policy_logprobs(a, samples, policy_logprobs)
    rewards = _reward(g, reward or actor, reward_fn, samples)
    ref_lp = r.inference(samples, name="ref_inference")
    a.train(samples, *rewards, ref_lp, *old, loss=kind, minibatches=ppo_minibatches, name="actor_train")
    return g.build()


def grpo(actor: Spec, *, ref: Spec | None = None, reward: Spec | None = None, reward_fn: str | None = None,
         batch: int, prompt_len: int, gen_len: int, samples_per_prompt: int = 8, ppo_minibatches: int = 1,
         name: str = "grpo", data: dict[str, Any] | None = None, policy_logprobs: bool = False,
         **algo: Any) -> GraphSpec:
    """GRPO: group-normalised advantages over `samples_per_prompt` samples, no critic."""
    return _group("grpo", actor, ref=ref, reward=reward, reward_fn=reward_fn, batch=batch, prompt_len=prompt_len,
                  gen_len=gen_len, samples_per_prompt=samples_per_prompt, ppo_minibatches=ppo_minibatches,
                  name=name, data=data, policy_logprobs=policy_logprobs, algo=algo)


def rloo(actor: Spec, *, ref: Spec | None = None, reward: Spec | None = None, reward_fn: str | None = None,
         batch: int, prompt_len: int, gen_len: int, samples_per_prompt: int = 4, ppo_minibatches: int = 1,
         name: str = "rloo", data: dict[str, Any] | None = None, policy_logprobs: bool = False,
         **algo: Any) -> GraphSpec:
    """REINFORCE leave-one-out: each sample's baseline is the mean reward of its siblings."""
    return _group("rloo", actor, ref=ref, reward=reward, reward_fn=reward_fn, batch=batch, prompt_len=prompt_len,
                  gen_len=gen_len, samples_per_prompt=samples_per_prompt, ppo_minibatches=ppo_minibatches,
                  name=name, data=data, policy_logprobs=policy_logprobs, algo=algo)


def remax(actor: Spec, *, ref: Spec | None = None, reward: Spec | None = None, reward_fn: str | None = None,
          batch: int, prompt_len: int, gen_len: int, ppo_minibatches: int = 1, name: str = "remax",
          data: dict[str, Any] | None = None, policy_logprobs: bool = False, **algo: Any) -> GraphSpec:
    """ReMax: REINFORCE with the reward of a greedy generation as the baseline."""
    g = Graph(name, batch=batch, prompt_len=prompt_len, gen_len=gen_len, algorithm=_algo("remax", reward_fn, algo))
    a = g.model("actor", actor, trainable=True)
    r = g.model("ref", ref or actor)
    prompts = g.input("prompts", **(data or {}))
    samples = a.generate(prompts, name="actor_generate")
    greedy = a.generate(prompts, temperature=0.0, name="actor_generate_greedy")
    old = _policy_logprobs(a, samples, policy_logprobs)
    rewards = _reward(g, reward or actor, reward_fn, samples)
    base = _reward(g, reward or actor, reward_fn, greedy, name="reward_inference_greedy")
    ref_lp = r.inference(samples, name="ref_inference")
    a.train(samples, greedy, *rewards, *base, ref_lp, *old, loss="remax", minibatches=ppo_minibatches,
            name="actor_train")
    return g.build()


ALGORITHMS = {"sft": sft, "dpo": dpo, "ppo": ppo, "grpo": grpo, "remax": remax, "rloo": rloo}
