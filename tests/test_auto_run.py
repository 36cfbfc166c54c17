"""`@planner.auto` loops running on the runtime: the single-process reference without torchrun,
4 gloo ranks under torchrun, and loops that do something else at run time than when traced.

The done-when of the decorator: `examples/train_loop_ppo.py` on 4 ranks gives step by step the
metrics of `examples/tiny_ppo.py` compiled and run with ``torchrun -m runtime`` (same seed).
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import planner
from planner.compile import compile_graph
from plans import Estimate, Layout, Mesh, Plan, PlanCall, Reallocation, SearchInfo, parse_cluster, save_plan
from plans.errors import PlannerError
from plans.plan import load_plan
from plans.sharding import transfer_volume
from runtime.executor import PlanRunner
from tests.conftest import ROOT

TOL = 1e-4  # as tests/test_runtime_cli.py: the examples' hyperparameters keep parallel runs this close
STEPS = 3
LOOP = ROOT / "examples" / "train_loop_ppo.py"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run in this process on one thread: on a loaded shared CPU, torch's default
    thread pool makes them two orders of magnitude slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(args: list[str], *, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", *args], cwd=cwd)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _same(got: list[dict], want: list[dict], *, tol: float) -> None:
    """Every metric of `want` but times is in `got` and within `tol`, step by step."""
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, len(want) + 1))
    for g, w in zip(got, want):
        for key, value in w.items():
            if not key.endswith("time_s"):
                assert abs(g[key] - value) <= tol, (w["step"], key, g[key], value)


def _reference_of_tiny_ppo(steps: int) -> list[dict]:
    """`python -m runtime PLAN --reference` of examples/tiny_ppo.py, in this process."""
    graph = runpy.run_path(str(ROOT / "examples" / "tiny_ppo.py"))["graph"]
    plan = compile_graph(graph, parse_cluster("cpu:1x4"), time_limit_s=0)
    runner = PlanRunner(plan, rank=0, world_size=1, reference=True, seed=0, dtype=torch.float32,
                        device=torch.device("cpu"))
    return [runner.step(s) for s in range(1, steps + 1)]


def test_without_torchrun_the_loop_runs_the_reference_of_tiny_ppo(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    example = runpy.run_path(str(LOOP))
    ppo_step = example["ppo_step"]
    try:
        got = []
        for _ in range(2):
            stats = ppo_step()
            assert set(stats) == {"reward_mean", "response_len", "kl_mean"}
            got.append({**ppo_step.last_metrics, **stats})
        # The caller's own batch replaces the data source's (here the same prompts, so the same step).
        from runtime.tasks import make_inputs

        plan = load_plan(tmp_path / "plans" / "train_loop_ppo.json")
        prompts = make_inputs("pattern", plan.inputs, vocab_size=plan.models["actor"].spec.vocab_size, seed=0,
                              step=3)["prompts"]["tokens"]
        stats = ppo_step(prompts=prompts)
        got.append({**ppo_step.last_metrics, **stats})
        with pytest.raises(PlannerError, match=r"has tokens of shape \(16, 5\), but the loop was planned for 16 "
                                               "sequences of 8 tokens"):
            ppo_step(prompts=prompts[:, :5])
    finally:
        ppo_step.close()
    want = _reference_of_tiny_ppo(3)
    for g, w in zip(got, want):  # the very same floats
        assert {k: v for k, v in g.items() if not k.endswith("time_s")} == \
            {k: v for k, v in w.items() if not k.endswith("time_s")}
    assert {"reward.time_s", "ppo_batch.time_s", "actor_train.time_s"} <= set(got[0])


def _shifting_loop(tmp_path: Path, extra: list[int]) -> planner.AutoFunction:
    """A tiny SFT loop whose calls depend on a Python list it closes over."""
    @planner.auto(cluster="cpu:1x2", plan=tmp_path / "shifting.json", batch=4, seq_len=8, time_limit_s=0,
                  verbose=False, models={"policy": planner.model("tiny-gpt", trainable=True)},
                  algorithm={"task": "pattern"})
    def shifting(policy, tokens):
        for _ in extra:
            policy.inference(tokens)
        return policy.train(tokens, loss="sft")

    return shifting


@pytest.mark.parametrize("traced,run,needle", [
    ([], [1], "makes call 'policy_inference', which it did not make when it was traced"),
    ([1], [], "skipped 'policy_inference'"),
    ([1], [1, 1], "makes call 'policy_inference_2', which it did not make"),
])
def test_a_loop_that_makes_other_calls_than_traced_is_an_error(tmp_path, monkeypatch, traced, run, needle):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    extra = list(traced)
    loop = _shifting_loop(tmp_path, extra)
    loop.trace()
    extra[:] = run
    try:
        with pytest.raises(PlannerError) as err:
            loop()
    finally:
        loop.close()
    assert needle in str(err.value), str(err.value)


def test_plain_arguments_may_change_between_iterations(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = []

    @planner.host
    def note(tokens, step):
        seen.append((step, tuple(tokens["tokens"].shape)))
        return tokens

    @planner.auto(cluster="cpu:1x2", plan=tmp_path / "sft.json", batch=4, seq_len=8, time_limit_s=0, verbose=False,
                  models={"policy": planner.model("tiny-gpt", trainable=True)}, algorithm={"task": "pattern"})
    def sft_step(policy, tokens, step=0):
        return {"train": policy.train(note(tokens, step), loss="sft")}

    try:
        out = [sft_step(step=s) for s in (1, 2)]
    finally:
        sft_step.close()
    assert seen == [(1, (4, 8)), (2, (4, 8))]
    assert set(out[1]["train"]) == {"loss", "time_s"} and 0 < out[1]["train"]["loss"] != out[0]["train"]["loss"]


@pytest.mark.parametrize("returned,needle", [
    ("{'tokens': tokens['tokens']}", "trains on host step 'shape_of''s 'shape_of.out', which lacks mask"),
    ("{**tokens, 'extra': tokens['mask'][:2]}", "but the batch has tokens (4, 8) and extra (2, 7)"),
    ("tokens['tokens']", "returned a Tensor, not a dict of tensors"),
])
def test_a_batch_a_host_step_gets_wrong_is_a_clear_error(tmp_path, monkeypatch, returned, needle):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "loop.py"
    path.write_text(f"""
import planner

@planner.host
def shape_of(tokens):
    return {returned}

@planner.auto(cluster="cpu:1x2", plan={str(tmp_path / 'p.json')!r}, batch=4, seq_len=8, time_limit_s=0,
              verbose=False, models={{"policy": planner.model("tiny-gpt", trainable=True)}}, algorithm={{"task": "pattern"}})
def step(policy, tokens):
    return policy.train(shape_of(tokens), loss="sft")
""")
    loop = runpy.run_path(str(path))["step"]
    try:
        with pytest.raises(PlannerError) as err:
            loop()
    finally:
        loop.close()
    assert needle in str(err.value), str(err.value)


def test_prompts_a_host_step_prepares_must_be_rows_with_tokens(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for as_rows in (True, False):
        @planner.host
        def flip(prompts):
            tokens = prompts["tokens"].flip(0)
            return {"tokens": tokens} if as_rows else tokens  # noqa: B023 (traced and run in this iteration)

        @planner.auto(cluster="cpu:1x2", plan=tmp_path / "gen.json", batch=4, prompt_len=4, gen_len=3,
                      time_limit_s=0, verbose=False, models={"actor": "tiny-llama"})
        def sample(actor, prompts):
            return actor.generate(flip(prompts))

        try:
            if as_rows:
                assert sample()["tokens"].shape == (4, 7)
            else:
                with pytest.raises(PlannerError, match="returned a Tensor as 'flip.out', which call 'actor_generate' "
                                                       "reads as its sequences"):
                    sample()
        finally:
            sample.close()


def test_a_launch_of_the_wrong_size_is_a_clear_error(tmp_path):
    from runtime.session import Launch, Session

    loop = runpy.run_path(str(LOOP))["ppo_step"]
    plan = compile_graph(loop.trace(), loop.cluster(), time_limit_s=0)
    two = Launch(rank=0, world_size=2, torchrun=True, device=torch.device("cpu"), owns_group=False)
    with pytest.raises(PlannerError, match=r"is for 4 ranks \(cpu:1x4\) but this launch has 2") as err:
        Session(plan, launch=two, seed=0)
    assert "--nproc-per-node 4" in (err.value.hint or "")


def test_the_runtime_refuses_to_walk_a_plan_with_host_steps(tmp_path):
    loop = runpy.run_path(str(LOOP))["ppo_step"]
    plan = compile_graph(loop.trace(), loop.cluster(), time_limit_s=0)
    runner = PlanRunner(plan, rank=0, world_size=1, reference=True, seed=0, dtype=torch.float32,
                        device=torch.device("cpu"))
    with pytest.raises(PlannerError, match=r"has host steps \(reward, ppo_batch\)") as err:
        runner.step(1)
    assert "call the @planner.auto function" in (err.value.hint or "")


@pytest.mark.slow
def test_the_ppo_loop_on_four_ranks_matches_tiny_ppo_compiled_and_run_with_python_m_runtime(tmp_path):
    graph_plan = tmp_path / "tiny_ppo.json"
    tiny = runpy.run_path(str(ROOT / "examples" / "tiny_ppo.py"))
    save_plan(compile_graph(tiny["graph"], parse_cluster(tiny["CLUSTER"]), time_limit_s=2), graph_plan)
    ran = _torchrun("-m", "runtime", str(graph_plan), "--steps", str(STEPS), "--metrics-out", "graph.jsonl",
                    cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    loop = _torchrun(str(LOOP), "--steps", str(STEPS), "--metrics-out", "loop.jsonl", cwd=tmp_path)
    assert loop.returncode == 0, loop.stderr[-3000:]
    # Rank 0 traced and compiled the loop's plan under torchrun and sent it to the other ranks.
    assert loop.stderr.count("planner: compiling 'ppo_step' for cpu:1x4") == 1, loop.stderr[-3000:]
    plan = load_plan(tmp_path / "plans" / "train_loop_ppo.json")
    assert plan.source_hash == runpy.run_path(str(LOOP))["ppo_step"].source_hash()
    want, got = _metrics(tmp_path / "graph.jsonl"), _metrics(tmp_path / "loop.jsonl")
    assert {"actor_train.loss", "critic_train.loss", "reward_mean", "kl_mean"} <= set(want[0])
    _same(got, want, tol=TOL)


@pytest.mark.slow
def test_the_ppo_loop_on_hand_placed_layouts_matches_its_reference(tmp_path, monkeypatch):
    """Tensor, pipeline and data parallel with ZeRO, and reallocations before generation and the
    critic's inference: the plan file carries the loop's hash, so the run reuses it."""
    loop = runpy.run_path(str(LOOP))["ppo_step"]
    graph = loop.trace()
    all4 = Mesh.block(0, 4)
    where = {"actor_generate": (all4, Layout(dp=4)), "actor_train": (all4, Layout(dp=2, tp=2, zero=1)),
             "ref_inference": (Mesh.block(0, 2), Layout(tp=2, sequence_parallel=True)),
             "critic_inference": (Mesh.block(2, 2), Layout(tp=2)),
             "critic_train": (all4, Layout(dp=2, pp=2, micro_batches=2, zero=2))}
    moves = []
    for dst, src in (("actor_generate", "actor_train"), ("critic_inference", "critic_train")):
        decl = graph.models[graph.call(dst).model]
        vol = transfer_volume(decl.spec, head=decl.head, src=where[src], dst=where[dst], gpus_per_node=4)
        moves.append(Reallocation(model=graph.call(dst).model, from_call=src, to_call=dst, bytes=vol.moved_numel * 4,
                                  est_time_s=0))
    calls = [PlanCall(**c.model_dump(), mesh=where[c.name][0], layout=where[c.name][1], est_start_s=0, est_time_s=0,
                      est_peak_mem_bytes=0) for c in graph.calls]
    plan = Plan(name=graph.name, cluster=loop.cluster(), models=graph.models, inputs=graph.inputs,
                algorithm=graph.algorithm, calls=calls, reallocations=moves, host_steps=graph.host_steps,
                source_hash=loop.source_hash(graph), search=SearchInfo(method="by hand"),
                estimate=Estimate(iteration_s=0, tokens_per_s=0, mfu=0, peak_mem_bytes=0))
    save_plan(plan, tmp_path / "plans" / "train_loop_ppo.json")
    assert {r.to_call for r in load_plan(tmp_path / "plans" / "train_loop_ppo.json").reallocations} == \
        {"actor_generate", "critic_inference"}
    ran = _torchrun(str(LOOP), "--steps", str(STEPS), "--metrics-out", "loop.jsonl", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "planner: reusing plans/train_loop_ppo.json" in ran.stderr and "compiling" not in ran.stderr
    got = _metrics(tmp_path / "loop.jsonl")
    assert {"actor_generate.realloc_time_s", "critic_inference.realloc_time_s"} <= set(got[0])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        want = []
        for _ in range(STEPS):
            stats = loop()
            want.append({**loop.last_metrics, **stats})
    finally:
        loop.close()
    _same(got, want, tol=TOL)
