"""`@planner.auto` without running models: tracing, host steps in the graph, errors that name the
user's line, the plan hash, the plan cache, and `planner compile` on a decorated loop."""

from __future__ import annotations

import inspect
import json
import os
import runpy
import textwrap
from pathlib import Path

import pytest
import torch

import planner
from planner.auto import plan_hash
from plans.errors import PlannerError
from plans.graph import Call, DataInput, HostStep, ModelDecl
from plans.graph import Graph as GraphSpec
from plans.model import resolve_model
from plans.plan import load_plan
from tests.conftest import ROOT

MODELS = {"actor": planner.model("tiny-llama", trainable=True),
          "critic": planner.model("tiny-llama", trainable=True, head="value"), "ref": "tiny-llama"}


def _example(name: str) -> dict:
    return runpy.run_path(str(ROOT / "examples" / f"{name}.py"))


def test_the_ppo_loop_traces_to_the_graph_of_tiny_ppo_plus_its_host_steps():
    graph = _example("train_loop_ppo")["ppo_step"].trace()
    tiny = _example("tiny_ppo")["graph"]
    assert [c.name for c in graph.calls] == ["actor_generate", "ref_inference", "critic_inference", "actor_train",
                                             "critic_train"]
    assert {c.name: c.model_dump(exclude={"inputs"}) for c in graph.calls} == \
        {c.name: c.model_dump(exclude={"inputs"}) for c in tiny.calls}
    assert graph.models == tiny.models and graph.inputs == tiny.inputs
    reward, batch = graph.host_steps
    assert (reward.name, reward.function, reward.inputs, reward.outputs) == \
        ("reward", "reward", ["actor_generate.samples"], ["reward.out"])
    assert batch.inputs == ["actor_generate.samples", "reward.out", "ref_inference.logprobs",
                            "critic_inference.values"]
    assert batch.outputs == ["ppo_batch.batch", "ppo_batch.stats"]
    assert graph.call("actor_train").inputs == ["ppo_batch.batch"]
    # Through the host step, the train calls depend on exactly the calls they do in tiny_ppo.
    assert {(s, d) for s, d, _ in graph.edges()} == {(s, d) for s, d, _ in tiny.edges()}


def _steps(*steps: HostStep) -> GraphSpec:
    spec = resolve_model("tiny-llama")
    calls = [Call(name="gen", model="m", kind="generate", inputs=["prompts"], outputs=["gen.out"], seqs=4,
                  seq_len=8, gen_len=4),
             Call(name="train", model="m", kind="train", inputs=["h2.out"], outputs=["train.out"], seqs=4,
                  seq_len=8, loss="sft")]
    return GraphSpec(name="g", models={"m": ModelDecl(spec=spec, trainable=True)},
                     inputs=[DataInput(name="prompts", seqs=4, seq_len=4)], calls=calls, host_steps=list(steps))


def _host(name: str, inputs: list[str], outputs: list[str] | None = None) -> HostStep:
    return HostStep(name=name, function=name, source_sha256="0" * 64, inputs=inputs, outputs=outputs or [f"{name}.out"])


def test_host_steps_in_the_graph_schema_are_validated():
    ok = _steps(_host("h1", ["gen.out"]), _host("h2", ["h1.out", "prompts"]))
    assert ok.edges() == [("gen", "train", "gen.out")] and ok.topo_order() == ["gen", "train"]
    with pytest.raises(ValueError, match="host step 'h1' reads 'nope', which no call or earlier host step writes"):
        _steps(_host("h1", ["nope"]), _host("h2", ["h1.out"]))
    with pytest.raises(ValueError, match="host step 'h1' reads 'h2.out', written by the later host step 'h2'"):
        _steps(_host("h1", ["h2.out"]), _host("h2", ["gen.out"]))
    with pytest.raises(ValueError, match="host step 'gen': another call has that name"):
        _steps(_host("gen", ["prompts"], ["x"]), _host("h2", ["gen.out"]))
    with pytest.raises(ValueError, match="data handle 'gen.out' is written twice"):
        _steps(_host("h2", ["prompts"], ["gen.out", "h2.out"]))
    with pytest.raises(ValueError, match="the calls form a cycle: train -> train"):
        _steps(_host("h2", ["train.out"]))


# Errors name the user's line --------------------------------------------------------------------

def _loop(body, **options):  # noqa: ANN001, ANN202
    return planner.auto(cluster="cpu:1x4", models=MODELS, batch=4, prompt_len=4, gen_len=4, **options)(body)


@planner.host
def score(samples):
    return samples["tokens"].float().mean(dim=1)


def _branch_on_data(actor, critic, ref, prompts):
    samples = actor.generate(prompts)
    if score(samples) > 0.5:  # MARK: branch
        actor.train(samples, loss="ppo_policy")


def _index_data(actor, critic, ref, prompts):
    samples = actor.generate(prompts)
    return samples["tokens"]  # MARK: index


def _torch_on_data(actor, critic, ref, prompts):
    return torch.mean(actor.generate(prompts))  # MARK: torch


def _attribute_of_data(actor, critic, ref, prompts):
    return actor.generate(prompts).shape  # MARK: attribute


def _loop_over_data(actor, critic, ref, prompts):
    return [ref.inference(s) for s in actor.generate(prompts)]  # MARK: iterate


def _line(fn, mark: str) -> int:  # noqa: ANN001
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if f"MARK: {mark}" in text)


@pytest.mark.parametrize("fn,mark,what", [
    (_branch_on_data, "branch", "compares (>) data handle 'score.out'"),
    (_index_data, "index", "indexes data handle 'actor_generate.samples'"),
    (_torch_on_data, "torch", "calls torch `mean` on data handle"),
    (_attribute_of_data, "attribute", "reads `.shape` of data handle"),
    (_loop_over_data, "iterate", "iterates over data handle"),
])
def test_looking_at_data_while_traced_is_an_error_naming_the_line(fn, mark, what):  # noqa: ANN001
    with pytest.raises(PlannerError) as err:
        _loop(fn).trace()
    assert f"{__file__}:{_line(fn, mark)} (`" in err.value.message and what in err.value.message
    assert "@planner.host" in (err.value.hint or "")


def test_other_mistakes_in_a_loop_name_the_line():
    def unknown_keyword(actor, critic, ref, prompts):
        actor.generate(prompts, beams=4)  # MARK: keyword

    def stats_into_host(actor, critic, ref, prompts):
        samples = actor.generate(prompts)
        score(actor.train(samples, loss="ppo_policy"))  # MARK: stats

    def raises(actor, critic, ref, prompts):
        return {}["missing"]  # MARK: raises

    def not_a_handle(actor, critic, ref, prompts):
        ref.inference([prompts])  # MARK: list

    def batch_not_first(actor, critic, ref, prompts):
        samples = actor.generate(prompts)
        actor.train(samples, score(samples), loss="ppo_policy")  # MARK: batch

    for fn, mark, what in ((unknown_keyword, "keyword", "actor.generate(): "),
                           (stats_into_host, "stats", "the statistics of a train call"),
                           (raises, "raises", "raised KeyError while traced"),
                           (not_a_handle, "list", "ref.inference() gets a list, not a data handle"),
                           (batch_not_first, "batch", "reads host step output 'score.out' after")):
        with pytest.raises(PlannerError) as err:
            _loop(fn).trace()
        assert f"{__file__}:{_line(fn, mark)}" in err.value.message and what in err.value.message, err.value.message
    with pytest.raises(PlannerError, match="models 'critc' are not arguments"):
        planner.auto(cluster="cpu:1x4", models={"critc": "tiny-llama"}, batch=4, seq_len=8)(unknown_keyword)


class Scaled:
    def __init__(self, k: float) -> None:
        self.k = k

    @planner.host
    def score(self, samples):  # noqa: ANN001, ANN201
        return samples["tokens"].float().mean(dim=1) * self.k


def test_a_host_function_on_plain_values_is_plain_python_and_methods_bind():
    assert score({"tokens": torch.tensor([[1, 3]])}).tolist() == [2.0]
    assert Scaled(3.0).score({"tokens": torch.tensor([[1, 3]])}).tolist() == [6.0]

    def method_step(actor, critic, ref, prompts):
        return Scaled(2.0).score(actor.generate(prompts))

    (step,) = _loop(method_step).trace().host_steps
    assert (step.name, step.function, step.inputs) == ("score", "Scaled.score", ["actor_generate.samples"])


# Hash and cache -----------------------------------------------------------------------------------

LOOP = '''
import planner

@planner.host
def keep(tokens):
    return tokens  # BODY

@planner.auto(cluster="cpu:1x2", plan=PLAN, batch=4, seq_len=8, time_limit_s=0, verbose=False,
              models={"policy": planner.model("tiny-gpt", trainable=True)}, algorithm={"task": "pattern"})
def sft_step(policy, tokens):
    return policy.train(keep(tokens), loss="sft")  # CALL
'''


def _load(tmp_path: Path, text: str) -> planner.AutoFunction:
    path = tmp_path / "loop.py"
    path.write_text(text.replace("PLAN", repr(str(tmp_path / "plans" / "sft_step.json"))))
    return runpy.run_path(str(path))["sft_step"]


def test_the_hash_covers_calls_host_sources_cluster_and_options(tmp_path):
    loop = _load(tmp_path, LOOP)
    graph, cluster = loop.trace(), loop.cluster()
    digest = loop.source_hash()
    assert digest == _load(tmp_path, LOOP).source_hash() == plan_hash(graph, cluster=cluster)
    edits = [LOOP.replace("# BODY", "# edited"), LOOP.replace('loss="sft")', 'loss="sft", minibatches=2)'),
             LOOP.replace("batch=4", "batch=8"), LOOP.replace("tiny-gpt", "tiny-llama"),
             LOOP.replace('"pattern"}', '"pattern", "lr": 1e-3}')]
    assert len({digest, *(_load(tmp_path, t).source_hash() for t in edits)}) == 1 + len(edits)
    assert plan_hash(graph, cluster=cluster.model_copy(update={"gpus_per_node": 4})) != digest
    assert plan_hash(graph, cluster=cluster, baseline="colocate") != digest


def test_a_plan_cached_by_another_version_of_planner_is_compiled_again(tmp_path, monkeypatch):
    """The cache key covers the planner's own code (`code_fingerprint`: every .py and .json of
    plans/, cost_models/ and planner/), so upgrading the cost model or the search recompiles."""
    import importlib

    auto = importlib.import_module("planner.auto")  # the module (planner.auto is also the decorator)
    fingerprint = auto.code_fingerprint()
    assert len(fingerprint) == 64 and fingerprint == auto.code_fingerprint()
    loop = _load(tmp_path, LOOP)
    _, compiled = loop.compile()
    assert compiled and not _load(tmp_path, LOOP).compile()[1]
    before = loop.source_hash()
    monkeypatch.setattr(auto, "code_fingerprint", lambda: "another version")
    upgraded = _load(tmp_path, LOOP)
    assert upgraded.source_hash() != before
    plan, compiled = upgraded.compile()
    assert compiled and plan.source_hash == upgraded.source_hash()


def _version_worker(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks making a loop's plan; rank 1 runs "another version" of planner."""
    import importlib

    import torch.distributed as dist

    from runtime.session import Launch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        importlib.import_module("planner.auto").code_fingerprint = lambda: "another version"
    loop = _load(Path(out_dir), LOOP)
    loop._launch = Launch(rank=rank, world_size=2, torchrun=True, device=torch.device("cpu"), owns_group=False)
    try:
        loop._plan_everywhere(loop.trace())
        outcome = "ok"
    except PlannerError as e:
        outcome = f"{e.message} | {e.hint}"
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


def test_a_rank_running_another_version_of_planner_is_told_so(tmp_path):
    """Rank 0 makes the plan and sends it with its code's hash; a rank whose planner differs says
    that, not that it traced another loop."""
    import torch.multiprocessing as mp

    from tests.test_runtime_parallel import _free_port

    mp.spawn(_version_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank0.txt").read_text() == "ok"
    told = (tmp_path / "rank1.txt").read_text()
    assert "rank 1 runs another version of planner than rank 0" in told and "same planner on every node" in told


def test_the_same_loop_reuses_its_plan_and_an_edited_loop_recompiles(tmp_path):
    loop = _load(tmp_path, LOOP)
    plan, compiled = loop.compile()
    path = tmp_path / "plans" / "sft_step.json"
    assert compiled and load_plan(path).source_hash == loop.source_hash() == plan.source_hash
    os.utime(path, (1, 1))  # an old mtime: a rewrite would change it
    again, compiled = _load(tmp_path, LOOP).compile()
    assert not compiled and again == plan and path.stat().st_mtime == 1
    for edit in (LOOP.replace("# BODY", "# edited host step"), LOOP.replace('"sft")', '"sft", lr=1e-3)')):
        edited = _load(tmp_path, edit)
        plan, compiled = edited.compile()
        assert compiled and path.stat().st_mtime > 1 and load_plan(path).source_hash == edited.source_hash()
        os.utime(path, (1, 1))
    path.write_text("{not json")
    plan, compiled = edited.compile()
    assert compiled and load_plan(path) == plan


def test_planner_compile_traces_a_decorated_loop_into_the_plan_it_reuses(tmp_path, cli):
    loop_file = tmp_path / "loop.py"
    _load(tmp_path, LOOP)
    r = cli("compile", str(loop_file), "--time-limit", "0")
    assert r.code == 0, r.err
    assert "sft_step() reuses it while the loop, cluster and models are unchanged" in r.out
    assert "host steps, run as written on every rank: keep (tokens -> keep.out)" in r.out
    path = tmp_path / "plans" / "sft_step.json"
    plan = load_plan(path)
    assert plan.host_steps[0].name == "keep" and plan.calls[0].inputs == ["keep.out"]
    _, compiled = runpy.run_path(str(loop_file))["sft_step"].compile()
    assert not compiled
    r = cli("compile", str(loop_file), "--time-limit", "0", "--json")
    assert json.loads(r.out)["source_hash"] == plan.source_hash


def test_planner_compile_asks_which_of_several_loops(tmp_path, cli):
    two = LOOP + textwrap.dedent('''
        @planner.auto(cluster="cpu:1x2", batch=4, seq_len=8, models={"policy": planner.model("tiny-gpt", trainable=True)})
        def other_step(policy, tokens):
            return policy.train(tokens, loss="sft")
        ''')
    _load(tmp_path, two)
    r = cli("compile", str(tmp_path / "loop.py"), "--time-limit", "0")
    assert r.code == 2 and "defines 2 @planner.auto functions (sft_step, other_step)" in r.err
    assert "--function NAME" in r.err
    r = cli("compile", str(tmp_path / "loop.py"), "--time-limit", "0", "--function", "other_step", "--json")
    assert r.code == 0 and json.loads(r.out)["calls"][0]["inputs"] == ["tokens"]
    r = cli("compile", str(tmp_path / "loop.py"), "--function", "nope")
    assert r.code == 2 and "no @planner.auto function named 'nope'" in r.err
