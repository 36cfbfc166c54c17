"""Response lengths in generation costs: the longest response of a batch sets its decode steps,
and an engine that drops finished rows runs them at the rows still going (`cost_models.lengths`).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from cost_models import CostModel
from cost_models.lengths import decode_segments, empirical, geometric, length_dist, paged_schedule, quantile_lengths
from planner.graph import Graph
from plans import Layout, Mesh, parse_cluster, resolve_model
from plans.checkpoint import graph_fingerprint
from plans.errors import PlannerError
from plans.graph import Call, ModelDecl, ResponseLengths

GEN = 1024


def test_expected_longest_of_a_batch_is_exact_for_measured_lengths() -> None:
    samples = (3, 7, 7, 12, 20)
    dist = empirical(samples, 32)
    for rows in (1, 2, 3):
        brute = np.mean([max(t) for t in itertools.product(samples, repeat=rows)])
        assert dist.expected_max(rows) == pytest.approx(brute)
    assert dist.mean == pytest.approx(np.mean(samples))


def test_a_mean_alone_is_geometric_capped_at_gen_len() -> None:
    dist = geometric(300.0, GEN)
    assert dist.mean == pytest.approx(300.0, rel=1e-9)
    rng = np.random.default_rng(0)
    draws = np.minimum(rng.geometric(dist.cdf[1], size=(40_000, 64)), GEN)  # P(L = 1) is p itself
    assert dist.expected_max(64) == pytest.approx(draws.max(axis=1).mean(), rel=0.01)
    # The long tail: 64 responses of mean 300 take nearly the whole 1024 steps.
    assert dist.expected_max(64) > 0.95 * GEN
    assert geometric(2000.0, GEN).expected_max(8) == GEN  # a mean at or above the cap: every response runs to it


def test_segments_without_lengths_are_the_old_single_stretch() -> None:
    assert decode_segments(None, cap=GEN, rows=64, drops_finished=True) == [(GEN - 1.0, (GEN + 1) / 2, 64)]
    full = length_dist(ResponseLengths(samples=(GEN,) * 8), GEN)
    assert decode_segments(full, cap=GEN, rows=64, drops_finished=False) == [(GEN - 1.0, (GEN + 1) / 2, 64)]
    segs = decode_segments(geometric(100.0, GEN), cap=GEN, rows=64, drops_finished=True)
    running = [r for _, _, r in segs]
    assert running == sorted(running, reverse=True) and running[0] <= 64 and running[-1] >= 1


def _generate_cost(framework: str, lengths: ResponseLengths | None):
    spec = resolve_model("llama-3-8b")
    cm = CostModel(parse_cluster("h100-sxm:1x8"), framework=framework)
    call = Call(name="gen", model="m", kind="generate", seqs=512, seq_len=1024 + GEN, gen_len=GEN, response_len=lengths)
    layout = Layout(dp=8, micro_batches=1)
    return cm.call_cost(call, ModelDecl(spec=spec), Mesh.block(0, 8), layout)


def test_shorter_responses_cost_less_where_the_engine_drops_finished_rows() -> None:
    short = ResponseLengths(mean=200.0)
    vllm_full, vllm_short = _generate_cost("vllm", None), _generate_cost("vllm", short)
    torch_full, torch_short = _generate_cost("torch", None), _generate_cost("torch", short)
    # The runtime decodes every row until the batch's longest ends, and the call until its slowest
    # replica's: 64 rows of mean 200 take 881 steps of the 1024 (expected longest of 64 geometric
    # lengths), but one of the 8 replicas holds the longest of all 512 (1,022 expected), so it saves
    # almost nothing...
    saved = torch_short.breakdown_s["decode"] / torch_full.breakdown_s["decode"]
    assert 881 / 1024 < saved < 1.0
    # ...while vLLM runs the later steps at the few rows still going.
    assert vllm_short.breakdown_s["decode"] < 0.6 * vllm_full.breakdown_s["decode"]
    # ...and the useful FLOPs are the tokens really generated, whoever runs them.
    assert vllm_short.model_flops == torch_short.model_flops < 0.62 * torch_full.model_flops  # (1024 + 200) / 2048 tokens
    # Lengths that all reach the cap cost what no lengths cost.
    capped = ResponseLengths(samples=(GEN,) * 4)
    assert _generate_cost("torch", capped).time_s == pytest.approx(torch_full.time_s, rel=1e-12)
    assert _generate_cost("vllm", capped).time_s == pytest.approx(vllm_full.time_s, rel=0.01)


def test_a_paged_cache_runs_the_rows_whose_tokens_fit_and_preempts_the_newest() -> None:
    """vLLM's scheduler (`paged_schedule`): every token is made once, by a prefill or a decode
    step; the cache never holds more than its budget; rows wait for max_num_seqs; a budget that
    cannot hold every row at once preempts and recomputes, and takes more steps than one that can."""
    dist = geometric(300.0, 2048)
    lengths = quantile_lengths(dist, cap=2048, rows=200)
    assert 1 <= min(lengths) and max(lengths) <= 2048 and abs(np.mean(lengths) - 300) < 15  # the distribution's quantiles
    assert lengths[:3] != sorted(lengths)[:3]  # mixed, as independent draws come
    runs = {budget: paged_schedule(dist, cap=2048, rows=200, prompt=256, kv_tokens=budget, max_seqs=128)
            for budget in (10**9, 16 * 2048, 4 * 2048)}
    for budget, run in runs.items():
        # A row's first token comes from its prefill, a resumed row's next one from its prefill again.
        assert run.row_steps + 200 + run.preemptions == sum(lengths)
        assert run.peak_tokens <= budget
        assert sum(n for n, _, _ in run.segments) == pytest.approx(run.steps)
    ample, tight, tighter = runs.values()
    assert ample.preemptions == ample.recomputed_tokens == 0
    assert ample.steps < tight.steps < tighter.steps and 0 < tight.preemptions <= tighter.preemptions
    assert tight.recomputed_tokens >= tight.preemptions * 256  # a resumed row prefills its prompt and more
    # Rows beyond max_num_seqs wait for a slot: 1024 rows of 512 tokens run 256 at a time.
    assert paged_schedule(None, cap=512, rows=1024, prompt=64, kv_tokens=10**9, max_seqs=256).steps == 4 * 511
    # With room for every row and no limit on rows, the steps are the longest response's (as for
    # an engine that drops finished rows), and the rows still running fall step by step.
    one = paged_schedule(dist, cap=2048, rows=64, prompt=256, kv_tokens=10**9, max_seqs=None)
    assert one.steps == max(quantile_lengths(dist, cap=2048, rows=64)) - 1
    assert abs(one.steps - (dist.expected_max(64) - 1)) < 0.1 * one.steps
    running = [r for _, _, r in one.segments]
    assert running == sorted(running, reverse=True) and running[0] <= 64
    # Every row at the cap in a budget of a quarter of them at the cap: fewer steps than four static
    # waves, as rows start small and the newest wait when the cache fills.
    static = 4 * 511
    quarter = paged_schedule(None, cap=512, rows=64, prompt=512, kv_tokens=16 * 1024, max_seqs=256)
    assert quarter.steps < static and quarter.preemptions > 0


def test_a_call_lasts_as_long_as_its_slowest_engine() -> None:
    """Engines decode their own rows; the call ends when the one that drew the longest response of
    all ends, so more engines with the same rows each take more steps (geometric lengths: about
    ln(engines) / p more), paged or not."""
    dist = geometric(200.0, 8192)
    alone = paged_schedule(dist, cap=8192, rows=64, prompt=128, kv_tokens=10**9, max_seqs=256)
    slowest = paged_schedule(dist, cap=8192, rows=64, prompt=128, kv_tokens=10**9, max_seqs=256, longest_of=512)
    assert slowest.steps - alone.steps == pytest.approx(200 * np.log(8), rel=0.1)
    assert slowest.row_steps - alone.row_steps == slowest.steps - alone.steps  # one row runs longer
    static = decode_segments(dist, cap=8192, rows=64, drops_finished=False, longest_of=512)
    assert static[0][0] == pytest.approx(dist.expected_max(512) - 1)
    spec = resolve_model("llama-3-8b")

    def decode_s(framework: str, engines: int) -> float:
        call = Call(name="gen", model="m", kind="generate", seqs=64 * engines, seq_len=128 + 8192, gen_len=8192,
                    response_len=ResponseLengths(mean=200.0))
        cm = CostModel(parse_cluster(f"h100-sxm:1x{engines}"), framework=framework)
        return cm.call_cost(call, ModelDecl(spec=spec), Mesh.block(0, engines), Layout(dp=engines)).breakdown_s["decode"]

    for framework in ("vllm", "torch"):
        assert decode_s(framework, 8) > 1.15 * decode_s(framework, 1), framework


def test_a_paged_engines_rollout_costs_its_schedule_not_static_waves() -> None:
    """The vLLM stacks cost a generate call's waves as the KV budget its scheduler runs in: a long
    cap with short responses in two waves' budget costs what one wave costs (every row's tokens fit
    at once) where static waves would take more steps; the planner's runtime keeps its waves."""
    import dataclasses

    from cost_models.framework import resolve_framework

    spec = resolve_model("llama-3-8b")
    call = Call(name="gen", model="m", kind="generate", seqs=512, seq_len=512 + 4096, gen_len=4096,
                response_len=ResponseLengths(mean=500.0))
    static_vllm = dataclasses.replace(resolve_framework("vllm"), paged_kv=False, max_num_seqs=None)

    def cost(framework, waves: int):  # noqa: ANN001, ANN202
        cm = CostModel(parse_cluster("h100-sxm:1x8"), framework=framework)
        return cm.call_cost(call, ModelDecl(spec=spec), Mesh.block(0, 8), Layout(dp=8, micro_batches=waves))

    paged_one, paged_two = cost("vllm", 1), cost("vllm", 2)
    static_one, static_two = cost(static_vllm, 1), cost(static_vllm, 2)
    assert paged_two.time_s == pytest.approx(paged_one.time_s, rel=0.01)
    assert paged_two.peak_mem_bytes < paged_one.peak_mem_bytes  # the smaller budget is what it holds
    assert static_two.breakdown_s["decode"] > 1.3 * paged_two.breakdown_s["decode"]
    # With room for every row and 64 rows per engine (under max_num_seqs), paging changes nothing.
    assert paged_one.breakdown_s["decode"] == pytest.approx(static_one.breakdown_s["decode"], rel=0.05)
    assert not resolve_framework("torch").paged_kv  # the runtime generates in static waves


def test_response_lengths_are_checked_and_do_not_change_the_fingerprint() -> None:
    g = Graph("g", batch=4, prompt_len=8, gen_len=16)
    a = g.model("actor", "tiny-llama", trainable=True)
    a.generate(g.input("prompts"), response_len=[3, 9, 16], name="gen")
    spec = g.build()
    assert spec.calls[0].response_len == ResponseLengths(samples=(3, 9, 16))
    plain = spec.model_copy(update={"calls": [spec.calls[0].model_copy(update={"response_len": None})]})
    assert graph_fingerprint(spec) == graph_fingerprint(plain)  # a costing figure: checkpoints still resume
    g2 = Graph("g", batch=4, prompt_len=8, gen_len=16)
    actor, prompts = g2.model("actor", "tiny-llama"), g2.input("prompts")
    for bad, message in ((20.0, "exceed gen_len 16"), ([], "either mean or samples"),
                         ("long", "a mean .* or measured lengths"), ([0, 4], "at least 1 token")):
        with pytest.raises(PlannerError, match=message):
            actor.generate(prompts, response_len=bad)


GRPO = ["compile", "grpo", "--actor", "tiny-llama", "--reward-fn", "m:f", "--cluster", "cpu:1x4", "--batch", "8",
        "--prompt-len", "8", "--gen-len", "8", "--samples-per-prompt", "4", "--json", "--time-limit", "0"]


def test_compile_takes_the_mean_or_a_previous_runs_metrics(cli, tmp_path: Path) -> None:
    r = cli(*GRPO, "--response-len-mean", "5")
    assert r.code == 0, r.err
    (gen,) = [c for c in json.loads(r.out)["calls"] if c["kind"] == "generate"]
    assert gen["response_len"]["mean"] == 5.0
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "response_len": float(v)}) + "\n"
                               for i, v in enumerate([8] * 5 + [2] * 6 + [6] * 10, 1)))
    r = cli(*GRPO, "--response-len-from", str(metrics))
    assert r.code == 0, r.err
    (gen,) = [c for c in json.loads(r.out)["calls"] if c["kind"] == "generate"]
    assert gen["response_len"]["mean"] == 6.0 and "last 10 steps" in gen["response_len"]["source"]
    shown = cli(*[a for a in GRPO if a != "--json"], "--response-len-from", str(metrics), "-o", str(tmp_path / "p.json"))
    assert shown.code == 0 and "actor_generate: costed at responses of mean 6 tokens (geometric) under the 8-token " \
        "cap, from m.jsonl: mean response_len of its last 10 steps" in shown.out, shown.out


@pytest.mark.parametrize(("args", "message"), [
    (["--response-len-mean", "9"], "exceed gen_len 8"),
    (["--response-len-mean", "4", "--response-len-from", "m.jsonl"], "not both"),
    (["--response-len-from", "missing.jsonl"], "cannot read the metrics file"),
    (["--response-len-from", "{empty}"], "has no step with a response_len"),
])
def test_bad_response_lengths_are_one_clear_error(cli, tmp_path: Path, args: list[str], message: str) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"step": 1, "reward_mean": 0.5}\n')
    r = cli(*GRPO, *[a.replace("{empty}", str(empty)) for a in args], cwd=tmp_path)
    assert r.code == 2 and message in r.err, r.err
