"""Real jobs: a model directory's tokenizer and a JSONL dataset in, GRPO/SFT/DPO on 4 ranks equal to
the reference, padded prompts computed exactly as alone, early stop at EOS, text rewards, a resume
mid-epoch; clear errors for every bad input. The assets are `examples/real_grpo/make_assets.py`'s."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner import algorithms
from plans import Layout, Mesh, save_plan
from plans.errors import PlannerError
from plans.graph import DataInput, DataSource
from runtime import generate as gen_module
from runtime.algorithms import text_scores
from runtime.data import Dataset, RowInfo, Tokenizer
from runtime.engine import ModelRunner
from runtime.groups import solo_groups
from runtime.model import load_checkpoint
from tests.conftest import ROOT
from tests.test_runtime_cli import _metrics, _run, _torchrun
from tests.test_runtime_executor import place

EXAMPLE = ROOT / "examples" / "real_grpo"
TOL = 1e-4


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("real")
    made = subprocess.run([sys.executable, str(EXAMPLE / "make_assets.py"), str(out), "--rows", "48"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    return out


def _source(assets: Path, **kw) -> DataSource:  # noqa: ANN003
    return DataSource(path=str(assets / "train.jsonl"), format="jsonl", tokenizer=str(assets / "model"), rows=48,
                      **kw)


def _runner(assets: Path) -> ModelRunner:
    spec, state = load_checkpoint(assets / "model", head="lm")
    return ModelRunner(spec, head="lm", trainable=False, groups=solo_groups(Layout()), state=lambda p: state[p.name],
                       device=torch.device("cpu"))


def test_the_tokenizer_reads_its_ids_and_chat_template_from_the_directory(assets: Path) -> None:
    tok = Tokenizer.load(assets / "model", vocab_size=1000)
    assert tok.eos_id == tok.backend.token_to_id("<eos>") and tok.pad_id == tok.backend.token_to_id("<pad>")
    assert tok.chat("say red") == "<|user|> say red <|assistant|>"
    assert tok.decode(tok.encode_plain("say red now")) == "say red now"
    with pytest.raises(PlannerError, match="more than the model's vocab_size 10"):
        Tokenizer.load(assets / "model", vocab_size=10)


def test_a_dataset_draws_every_row_once_per_epoch_in_a_seeded_order(assets: Path) -> None:
    ds = Dataset(DataInput(name="prompts", seqs=8, seq_len=32, data=_source(assets, extra_keys=["ground_truth"])),
                 vocab_size=1000)
    epoch = [i for step in range(1, 7) for i in ds.indices(step=step, count=8, seed=0)]  # 6 steps of 8 = 48 rows
    assert sorted(epoch) == list(range(48)) and epoch != list(range(48))
    assert ds.indices(step=7, count=8, seed=0) != epoch[:8]  # the next epoch has its own order
    assert ds.indices(step=1, count=8, seed=1) != epoch[:8]  # and another seed another
    rows, infos = ds.batch(step=2, seed=0)
    assert rows["tokens"].shape == (8, 32) and rows["pad"].shape == (8,)
    tok = ds.tok
    for r, info in zip(range(8), infos):
        ids = rows["tokens"][r, rows["pad"][r]:].tolist()
        assert tok.decode(ids) == info.prompt or info.prompt in tok.decode(ids)
        assert (rows["tokens"][r, :rows["pad"][r]] == tok.pad_id).all()
        assert info.extras["ground_truth"] in info.prompt


def test_sft_and_dpo_rows_mask_the_response_and_eos(assets: Path) -> None:
    sft = Dataset(DataInput(name="tokens", seqs=4, seq_len=40, data=_source(assets, response_key="response")),
                  vocab_size=1000)
    rows, _ = sft.batch(step=1, seed=0)
    tok = sft.tok
    for r in range(4):
        predicted = rows["tokens"][r, 1:][rows["mask"][r]].tolist()
        assert predicted[-1] == tok.eos_id and len(tok.decode(predicted[:-1]).split()) == 3
    dpo = Dataset(DataInput(name="pairs", seqs=4, seq_len=40,
                            data=_source(assets, chosen_key="chosen", rejected_key="rejected")), vocab_size=1000)
    pairs, infos = dpo.batch(step=1, seed=0)
    assert pairs["tokens"].shape == (4, 40) and len(infos) == 2
    chosen = tok.decode(pairs["tokens"][0, 1:][pairs["mask"][0]].tolist())
    assert chosen.split()[0] == infos[0].extras.get("ground_truth", chosen.split()[0])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: (d / "train.jsonl").unlink(), "does not exist or is not a file"),
    (lambda d: (d / "train.jsonl").write_text('{"question": "hi"}\n'), "no key 'prompt'"),
    (lambda d: (d / "train.jsonl").write_text('{"prompt": 3}\n'), "'prompt' is a int, not text"),
    (lambda d: (d / "train.jsonl").write_text('{"prompt": ' + json.dumps("red " * 60) + "}\n"), "more than the input's"),
    (lambda d: (d / "train.jsonl").write_text("not json\n"), "is not valid JSON"),
])
def test_bad_datasets_are_clear_errors_naming_the_file_and_row(assets: Path, tmp_path: Path, edit, message) -> None:  # noqa: ANN001
    shutil.copytree(assets, tmp_path / "a")
    edit(tmp_path / "a")
    with pytest.raises(PlannerError, match=message):
        ds = Dataset(DataInput(name="prompts", seqs=1, seq_len=32, data=_source(tmp_path / "a")), vocab_size=1000)
        ds.batch(step=1, seed=0)


def test_padded_prompts_compute_what_each_prompt_computes_alone(assets: Path) -> None:
    runner = _runner(assets)
    ds = Dataset(DataInput(name="prompts", seqs=6, seq_len=32, data=_source(assets)), vocab_size=runner.spec.vocab_size)
    rows, _ = ds.batch(step=1, seed=0)
    tokens, pad = rows["tokens"], rows["pad"]
    assert len(set(pad.tolist())) > 1  # prompts of different lengths
    batch_lp = runner.forward(tokens, what="logprobs", pad=pad)
    greedy = runner.generate(tokens, gen_len=6, temperature=0.0, seed=1, pad=pad)
    sampled = runner.generate(tokens, gen_len=6, temperature=1.0, seed=1, pad=pad)
    for r in range(tokens.shape[0]):
        alone = tokens[r:r + 1, pad[r]:]
        assert (batch_lp[r, pad[r]:] - runner.forward(alone, what="logprobs")[0]).abs().max() < 1e-5
        one = runner.generate(alone, gen_len=6, temperature=0.0, seed=1)
        assert torch.equal(greedy["tokens"][r, 32:], one["tokens"][0, alone.shape[1]:])
        assert (greedy["logprobs"][r] - one["logprobs"][0]).abs().max() < 1e-5
    assert sampled["tokens"].shape == (6, 38)


def test_generation_ends_once_every_row_has_emitted_eos(assets: Path, monkeypatch) -> None:
    runner = _runner(assets)
    eos = Tokenizer.load(assets / "model", vocab_size=runner.spec.vocab_size).eos_id
    logits = gen_module.last_logits

    def eos_first(shard, h):  # noqa: ANN001, ANN202 (a model that always says EOS next)
        out = logits(shard, h)
        out[:, eos] += 1e4
        return out

    monkeypatch.setattr(gen_module, "last_logits", eos_first)
    calls = []
    real = gen_module.stage_forward
    monkeypatch.setattr(gen_module, "stage_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = torch.full((3, 5), 7)
    out = runner.generate(prompts, gen_len=16, temperature=1.0, seed=0, stop_token=eos)
    assert len(calls) == 1  # the prefill, which already chose EOS for every row: no decode step
    assert out["tokens"].shape == (3, 21) and (out["tokens"][:, 5:] == eos).all()
    assert out["mask"][:, 0].all() and not out["mask"][:, 1:].any()
    calls.clear()
    runner.generate(prompts, gen_len=16, temperature=1.0, seed=0, stop_token=None)
    assert len(calls) == 16


def test_reward_functions_on_text_fail_clearly() -> None:
    rows = [RowInfo(index=7, prompt="say red", extras={"ground_truth": "red"})]

    def raises(prompt, response, ground_truth):  # noqa: ANN001, ANN202
        raise KeyError("x")

    with pytest.raises(PlannerError, match=r"raised KeyError: 'x' for dataset row 7 \(prompt 'say red'\)"):
        text_scores(raises, rows, ["red"], name="m:raises")
    with pytest.raises(PlannerError, match="returned 'good', not a finite number"):
        text_scores(lambda **kw: "good", rows, ["red"], name="m:text")
    with pytest.raises(PlannerError, match="returned nan"):
        text_scores(lambda **kw: float("nan"), rows, ["red"], name="m:nan")
    sys.path.insert(0, str(EXAMPLE))
    try:
        from reward import score
    finally:
        sys.path.remove(str(EXAMPLE))
    assert text_scores(score, rows, ["red red"], name="reward:score").tolist() == [1.0]


def _plans(assets: Path, tmp_path: Path) -> dict[str, Path]:
    """GRPO, SFT and DPO on the example's files, each placed by hand on 4 ranks with sharded layouts."""
    model, data = str(assets / "model"), str(assets / "train.jsonl")
    four, low, high = Mesh.block(0, 4), Mesh.block(0, 2), Mesh.block(2, 2)
    graphs = {
        "grpo": (algorithms.grpo(model, reward_fn="reward:score", batch=4, prompt_len=32, gen_len=6,
                                 samples_per_prompt=2, ppo_minibatches=2, lr=2e-3,
                                 data={"data": data, "extra_keys": ["ground_truth"]}),
                 {"actor_train": (four, Layout(dp=2, tp=2, zero=1)), "actor_generate": (four, Layout(tp=2, pp=2)),
                  "ref": (low, Layout(pp=2))}),
        "sft": (algorithms.sft(model, batch=8, seq_len=40, minibatches=2, lr=1e-3,
                               data={"data": data, "response_key": "response"}),
                {"model": (four, Layout(dp=2, pp=2, micro_batches=2, zero=3))}),
        "dpo": (algorithms.dpo(model, batch=4, seq_len=40, lr=1e-3,
                               data={"data": data, "chosen_key": "chosen", "rejected_key": "rejected"}),
                {"actor": (four, Layout(tp=2, dp=2, sequence_parallel=True)), "ref": (high, Layout(tp=2))}),
    }
    out = {}
    for name, (graph, layouts) in graphs.items():
        out[name] = tmp_path / f"{name}.json"
        save_plan(place(graph, layouts), out[name])
    return out


@pytest.mark.heavy
@pytest.mark.slow
def test_grpo_sft_and_dpo_on_the_dataset_match_the_reference_on_four_ranks(assets: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": f"{ROOT}:{EXAMPLE}"}
    for name, plan in _plans(assets, tmp_path).items():
        extra = ["--reward-fn", "reward:score"] if name == "grpo" else []
        got, want = tmp_path / f"{name}.jsonl", tmp_path / f"{name}_ref.jsonl"
        out = _torchrun(4, str(plan), "--steps", "3", "--quiet", "--metrics-out", str(got), *extra, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        ref = _run(["-m", "runtime", str(plan), "--reference", "--steps", "3", "--quiet", "--metrics-out", str(want),
                    *extra], env=env)
        assert ref.returncode == 0, ref.stderr[-3000:]
        for g, w in zip(_metrics(got), _metrics(want)):
            for key, value in w.items():
                if not key.endswith("time_s"):
                    assert abs(g[key] - value) <= TOL, (name, g["step"], key, g[key], value)
        if name == "grpo":
            assert any(m["reward_mean"] > 0 for m in _metrics(want))  # the text reward scored something


@pytest.mark.slow
def test_a_resume_mid_epoch_gives_the_uninterrupted_state_bitwise(assets: Path, tmp_path: Path) -> None:
    plan = _plans(assets, tmp_path)["grpo"]  # 4 prompts a step from 48 rows: step 2 is mid-epoch
    env = {"PYTHONPATH": f"{ROOT}:{EXAMPLE}"}
    base = ["-m", "runtime", str(plan), "--reference", "--quiet", "--reward-fn", "reward:score"]
    whole = _run([*base, "--steps", "4", "--checkpoint-dir", str(tmp_path / "a")], env=env)
    assert whole.returncode == 0, whole.stderr[-2000:]
    first = _run([*base, "--steps", "2", "--checkpoint-dir", str(tmp_path / "b")], env=env)
    assert first.returncode == 0, first.stderr[-2000:]
    rest = _run([*base, "--steps", "4", "--checkpoint-dir", str(tmp_path / "b"), "--resume", "auto"], env=env)
    assert rest.returncode == 0, rest.stderr[-2000:]
    import safetensors.torch

    a = safetensors.torch.load_file(tmp_path / "a" / "step-000000004" / "rank-00000.safetensors")
    b = safetensors.torch.load_file(tmp_path / "b" / "step-000000004" / "rank-00000.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_decorated_loop_takes_models_by_path_a_dataset_and_gets_text_in_host_steps(assets: Path, tmp_path: Path,
                                                                                     monkeypatch) -> None:
    import planner

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen: list[tuple] = []

    @planner.host
    def look(samples):  # noqa: ANN001, ANN202
        seen.append((samples["prompt_text"], samples["response_text"], samples["extras"]))
        return samples["tokens"].shape[0]

    @planner.auto(cluster="cpu:1x2", plan=tmp_path / "gen.json", batch=4, prompt_len=32, gen_len=5, time_limit_s=0,
                  verbose=False, models={"actor": str(assets / "model")},
                  data={"prompts": {"data": str(assets / "train.jsonl"), "extra_keys": ["ground_truth"]}})
    def sample(actor, prompts):  # noqa: ANN001, ANN202
        return look(actor.generate(prompts))

    torch.set_num_threads(1)
    try:
        assert sample() == 4
    finally:
        sample.close()
    prompts, responses, extras = seen[0]
    rows = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()]
    assert all(any(r["prompt"] == p for r in rows) for p in prompts)
    assert len(responses) == 4 and all(isinstance(t, str) for t in responses)
    assert [e["ground_truth"] in p for e, p in zip(extras, prompts)] == [True] * 4


def test_responses_end_at_a_stop_string(assets: Path) -> None:
    from runtime.executor import PlanRunner

    graph = algorithms.grpo(str(assets / "model"), reward_fn="reward:score", batch=4, prompt_len=32, gen_len=8,
                            samples_per_prompt=2, stop=[" "], data={"data": str(assets / "train.jsonl"),
                                                                     "extra_keys": ["ground_truth"]})
    plan = place(graph, {m: (Mesh.block(0, 4), Layout(dp=4)) for m in ("actor", "ref")})
    sys.path.insert(0, str(EXAMPLE))
    try:
        runner = PlanRunner(plan, rank=0, world_size=1, reference=True, seed=0, dtype=torch.float32,
                            device=torch.device("cpu"), reward_fn="reward:score")
    finally:
        sys.path.remove(str(EXAMPLE))
    state = runner.begin_step(1)
    runner.run_call(plan.calls[0], state=state)
    samples = state.get("actor_generate.samples")
    tok = runner.glue.tokenizer
    cut = 0
    for t, m in zip(samples["tokens"][:, -8:], samples["mask"]):
        ids = t[m].tolist()
        text = tok.decode(ids)
        if " " in text:  # ended by the stop string: the last token completed it
            cut += 1
            assert " " not in tok.decode(ids[:-1]) and (t[~m] == tok.eos_id).all()
    assert cut > 0


def test_a_parquet_file_gives_the_rows_of_the_same_jsonl(assets: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (assets / "train.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    inp = DataInput(name="prompts", seqs=8, seq_len=32, data=_source(assets, extra_keys=["ground_truth"]))
    par = inp.model_copy(update={"data": inp.data.model_copy(update={"path": str(tmp_path / "train.parquet"),
                                                                      "format": "parquet"})})
    a, b = Dataset(inp, vocab_size=1000).batch(step=3, seed=0), Dataset(par, vocab_size=1000).batch(step=3, seed=0)
    assert torch.equal(a[0]["tokens"], b[0]["tokens"]) and a[1] == b[1]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    bad = par.model_copy(update={"data": par.data.model_copy(update={"path": str(tmp_path / "bad.parquet")})})
    with pytest.raises(PlannerError, match="is not a readable Parquet file"):
        Dataset(bad, vocab_size=1000)


def test_a_critic_from_the_actors_directory_gets_a_fresh_value_head(assets: Path) -> None:
    from plans.graph import ModelDecl
    from plans.model import resolve_model
    from plans.sharding import parameters
    from runtime.executor import initial_weights
    from runtime.model import init_tensor

    spec = resolve_model(str(assets / "model"))
    critic = ModelDecl(spec=spec, trainable=True, head="value", weights=str(assets / "model"))
    read = initial_weights(critic, seed=3)
    _, lm = load_checkpoint(assets / "model", head="lm")
    for p in parameters(spec, head="value"):
        box = tuple((0, n) for n in p.shape)
        want = init_tensor(p, seed=3) if p.name == "score.weight" else lm[p.name]
        assert torch.equal(read(p, box), want), p.name
