"""The graph-building API, graph validation and the algorithm library."""

from __future__ import annotations

import pytest

from planner import Graph
from planner.algorithms import dpo, grpo, ppo, remax, rloo, sft
from plans.errors import PlannerError
from plans.graph import Call, ModelDecl
from plans.graph import Graph as GraphSpec
from plans.model import PRESETS


def test_shapes_flow_from_the_data():
    g = Graph("t", batch=8, prompt_len=16, gen_len=32)
    actor = g.model("actor", "tiny-llama", trainable=True)
    critic = g.model("critic", "tiny-llama", trainable=True, head="value")
    samples = actor.generate(g.input("prompts"), samples_per_prompt=4)
    values = critic.inference(samples)
    stats = actor.train(samples, values, loss="ppo_policy", minibatches=2)
    spec = g.build()
    gen, inf, train = spec.calls
    assert (gen.seqs, gen.seq_len, gen.gen_len, gen.prompt_len) == (32, 48, 32, 16)
    assert inf.returns == "values" and (inf.seqs, inf.seq_len) == (32, 48)
    assert train.inputs == [samples.name, values.name] and stats.name == "actor_train.stats"
    assert spec.edges() == [("actor_generate", "critic_inference", "actor_generate.samples"),
                            ("actor_generate", "actor_train", "actor_generate.samples"),
                            ("critic_inference", "actor_train", "critic_inference.values")]


def test_frozen_model_cannot_train():
    g = Graph("t", batch=4, seq_len=8)
    ref = g.model("ref", "tiny-llama")
    ref.train(g.input("tokens"), loss="sft")
    with pytest.raises(PlannerError, match="trains model 'ref', which is frozen"):
        g.build()


def test_input_nobody_provides():
    g = Graph("t", batch=4, seq_len=8)
    m = g.model("m", "tiny-llama", trainable=True)
    m.inference(g.input("tokens"))
    m.train("tokens", "rewards", loss="sft")
    with pytest.raises(PlannerError, match="reads 'rewards', which no call writes and the batch does not provide"):
        g.build()


def _call(name, model, inputs, outputs, kind="inference"):
    extra = {"returns": "logprobs"} if kind == "inference" else {"loss": "sft"}
    return Call(name=name, model=model, kind=kind, inputs=inputs, outputs=outputs, seqs=4, seq_len=8, **extra)


def test_cycle_is_named():
    models = {"m": ModelDecl(spec=PRESETS["tiny-llama"])}
    calls = [_call("a", "m", ["b.out"], ["a.out"]), _call("b", "m", ["a.out"], ["b.out"])]
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        GraphSpec(name="g", models=models, calls=calls)


def test_unknown_model_and_head_mismatch():
    models = {"m": ModelDecl(spec=PRESETS["tiny-llama"], head="value")}
    with pytest.raises(ValueError, match="runs on unknown model 'nope'"):
        GraphSpec(name="g", models=models, calls=[_call("a", "nope", [], ["x"])])
    with pytest.raises(ValueError, match="asks log-probs of 'm', which has a value head"):
        GraphSpec(name="g", models=models, calls=[_call("a", "m", [], ["x"])])


def test_duplicate_model_and_missing_lengths():
    g = Graph("t", batch=4)
    g.model("m", "tiny-llama")
    with pytest.raises(PlannerError, match="declared twice"):
        g.model("m", "tiny-llama")
    with pytest.raises(PlannerError, match="give seq_len="):
        g.input("x")


ALGOS = {
    "sft": (sft("tiny-llama", batch=8, seq_len=64), ["model_train"]),
    "dpo": (dpo("tiny-llama", batch=8, seq_len=64), ["ref_inference", "actor_train"]),
    "ppo": (ppo("tiny-llama", batch=8, prompt_len=16, gen_len=16),
            ["actor_generate", "reward_inference", "ref_inference", "critic_inference", "actor_train", "critic_train"]),
    "grpo": (grpo("tiny-llama", reward="tiny-llama", batch=8, prompt_len=16, gen_len=16, samples_per_prompt=4),
             ["actor_generate", "reward_inference", "ref_inference", "actor_train"]),
    "remax": (remax("tiny-llama", batch=8, prompt_len=16, gen_len=16),
              ["actor_generate", "actor_generate_greedy", "reward_inference", "reward_inference_greedy",
               "ref_inference", "actor_train"]),
    "rloo": (rloo("tiny-llama", reward_fn="m:f", batch=8, prompt_len=16, gen_len=16),
             ["actor_generate", "ref_inference", "actor_train"]),
}


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_algorithm_graphs(name):
    graph, calls = ALGOS[name]
    assert [c.name for c in graph.calls] == calls
    assert graph.algorithm.name == name
    assert graph.topo_order() == calls
    trains = [c for c in graph.calls if c.kind == "train"]
    assert trains and all(graph.models[c.model].trainable for c in trains)


def test_algorithm_specifics():
    g, _ = ALGOS["grpo"]
    assert g.call("actor_generate").samples_per_prompt == 4 and g.call("actor_train").seqs == 32
    g, _ = ALGOS["dpo"]
    assert g.call("actor_train").seqs == 16  # chosen + rejected
    g, _ = ALGOS["remax"]
    assert g.call("actor_generate_greedy").temperature == 0.0
    g, _ = ALGOS["ppo"]
    assert g.models["critic"].head == "value" and g.models["reward"].head == "value"
    assert g.call("actor_train").minibatches == 4
    with pytest.raises(PlannerError, match="samples-per-prompt of at least 2"):
        grpo("tiny-llama", reward_fn="m:f", batch=8, prompt_len=16, gen_len=16, samples_per_prompt=1)
