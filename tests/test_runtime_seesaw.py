"""Generation that prefills with one layout and decodes with another (Seesaw), and KV-parallel
decoding, on 4 gloo ranks.

The prefill layout (here tp x dp, a pipeline, and context parallel) computes the KV cache of
every prompt position but the last; the weights and
that cache move to the decode layout (`plans.sharding.transfer_plan`, `kv_transfer_plan`), which
runs the last prompt position as its first step; a KV-parallel decode layout (cp > 1) keeps a
share of each sequence's positions per rank. Each plan runs two steps, and every metric
equals the single-process reference (which generates in one layout); every rank's messages sum
to exactly the elements the cost model charges (`CostModel.realloc_cost`, `kv_reshard_cost`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_models import CostModel
from cost_models.transfer import KV_BYTES
from planner import algorithms
from plans import Layout, Mesh, Plan
from plans.runnable import runtime_problems
from plans.sharding import transfer_volume
from tests.test_runtime_executor import REWARD, WORLD, place, run_against_reference


def _plans() -> dict[str, tuple[Plan, Layout]]:
    all4, low = Mesh.block(0, 4), Mesh.block(0, 2)
    common = {"task": "pattern", "lr": 1e-4}
    grpo = place(algorithms.grpo("tiny-llama", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5, samples_per_prompt=2,
                                 ppo_minibatches=2, **common),
                 {"actor": (all4, Layout(dp=2, tp=2)), "ref": (low, Layout(dp=2))})
    ppo = place(algorithms.ppo("tiny-gpt", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5, ppo_minibatches=2,
                               **common),
                {"actor_train": (all4, Layout(dp=2, pp=2, micro_batches=2)),
                 "actor_generate": (all4, Layout(dp=2, pp=2, micro_batches=2)),
                 "critic": (all4, Layout(dp=2, tp=2)), "ref": (low, Layout(tp=2))})
    # a context-parallel prefill (the actor trains with cp 2 x tp 2; its rollout prefills so) -> tp 4 decode
    long = place(algorithms.grpo("tiny-gpt", reward_fn=REWARD, batch=2, prompt_len=9, gen_len=4, samples_per_prompt=2,
                                 ppo_minibatches=2, **common),
                 {"actor": (all4, Layout(cp=2, tp=2)), "ref": (low, Layout(cp=2))})
    # tensor x data parallel prefill -> data parallel decode; pipelined prefill -> tensor parallel decode;
    # tensor x data parallel prefill -> KV-parallel decode (each rank a share of every cache)
    # and a generate call under cp with no decode layout of its own: a context-parallel prefill, then
    # each rank keeps its share of the cache it gathered (KV-parallel decode, nothing moves)
    return {"grpo": (grpo, Layout(dp=4)), "ppo": (ppo, Layout(tp=4)), "grpo_cp": (long, Layout(tp=4)),
            "grpo_kvp": (grpo, Layout(cp=2, tp=2)), "ppo_kvp": (ppo, Layout(cp=4)), "grpo_cp_kvp": (long, None)}


def _split(plan: Plan, decode: Layout | None) -> Plan:
    if decode is None:
        return plan
    calls = [c.model_copy(update={"decode_layout": decode}) if c.kind == "generate" else c for c in plan.calls]
    return plan.model_copy(update={"calls": calls})


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    problems, compared = [], 0
    sent: dict[str, list[int]] = {}
    for name, (base, decode) in _plans().items():
        plan = _split(base, decode)
        par, p, c = run_against_reference(name, plan, rank=rank)
        problems += p
        compared += c
        (call,) = [c for c in plan.calls if c.kind == "generate"]
        if decode is not None:
            weights, cache = par.reshard_traffic[call.name]
            sent[name] = [sum(weights.sent.values()), sum(cache.sent.values())]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems, "compared": compared, "sent": sent}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_split_generation_matches_the_reference_and_moves_what_it_is_charged(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert not results[0]["problems"], "\n".join(results[0]["problems"])
    assert results[0]["compared"] > 20
    for name, (base, decode) in _plans().items():
        plan = _split(base, decode)
        assert runtime_problems(plan) == []
        if decode is None:
            continue
        (call,) = [c for c in plan.calls if c.kind == "generate"]
        decl = plan.models[call.model]
        src, dst = (call.mesh, call.layout), (call.mesh, decode)
        weights = transfer_volume(decl.spec, head=decl.head, src=src, dst=dst, gpus_per_node=4).moved_numel
        cm = CostModel(plan.cluster)
        kv = cm.kv_reshard_cost(decl, call, call.mesh, call.layout, decode)
        assert kv.bytes > 0  # (the weights need not move: cp ranks hold replicas like dp ones)
        moved = [sum(r["sent"][name][i] for r in results) for i in (0, 1)]
        assert moved == [weights, kv.bytes // KV_BYTES], name
        assert cm.realloc_cost(decl, src, dst).bytes == weights * cm.framework.param_bytes
        # and the call's cost charges both moves
        cost = cm.call_cost(call, decl, call.mesh, call.layout, decode_layout=decode)
        assert cost.breakdown_s["reshard"] == pytest.approx(cm.realloc_cost(decl, src, dst).time_s + kv.time_s)


@pytest.mark.parametrize("src,dst,rows", [(Layout(dp=2, tp=2), Layout(dp=4), 8), (Layout(dp=2, pp=2), Layout(tp=4), 8),
                                          (Layout(pp=4), Layout(dp=2, pp=2), 7), (Layout(tp=4), Layout(tp=2, pp=2), 8),
                                          (Layout(dp=4), Layout(dp=2, cp=2), 7), (Layout(cp=2, tp=2), Layout(cp=4), 6)])
def test_kv_volumes_are_the_kv_transfer_plans(src: Layout, dst: Layout, rows: int) -> None:
    """The cost model's per-rank KV volumes (vectorised, one layer per stage pair, scaled) equal
    the runtime's transfer plan summed, element for element and slice for slice, on each link; a
    rank keeps what both layouts give it."""
    from cost_models.transfer import kv_volumes
    from plans import resolve_model
    from plans.sharding import kv_transfer_plan

    spec, gpn = resolve_model("tiny-llama"), 2
    for a, b in ((Mesh.block(0, 4), Mesh.block(0, 4)), (Mesh.block(0, 4), Mesh.block(2, 4))):
        plan = kv_transfer_plan(spec, rows=rows, positions=5, src=(a, src), dst=(b, dst), gpus_per_node=gpn)
        vol = kv_volumes(spec, rows=rows, positions=5, src=(a, src), dst=(b, dst), gpus_per_node=gpn)
        ranks = range(vol.first, vol.first + len(vol.send_intra))
        moved = [t for t in plan if t.src != t.dst]
        for got, want in ((vol.send_intra, [sum(t.numel for t in moved if t.src == r and t.dst // gpn == r // gpn) for r in ranks]),
                          (vol.send_inter, [sum(t.numel for t in moved if t.src == r and t.dst // gpn != r // gpn) for r in ranks]),
                          (vol.recv_inter, [sum(t.numel for t in moved if t.dst == r and t.src // gpn != r // gpn) for r in ranks]),
                          (vol.send_pieces, [sum(t.src == r for t in moved) for r in ranks]),
                          (vol.recv_pieces, [sum(t.dst == r for t in moved) for r in ranks]),
                          (vol.local_pieces, [sum(t.dst == r and t.src == r for t in plan) for r in ranks])):
            assert got is not None and [int(x) for x in got] == want
        assert vol.local_numel == sum(t.numel for t in plan if t.src == t.dst)
        assert vol.moved_numel + vol.local_numel == 2 * spec.num_hidden_layers * rows * spec.kv_heads * 5 * spec.d_head


def test_exports_say_they_cannot_split_a_rollout_over_context_parallel_ranks() -> None:
    """verl and OpenRLHF roll out with vLLM, which keeps each sequence on one tensor-parallel
    group: a plan whose generate call prefills context-parallel and decodes KV-parallel says so."""
    from planner.exports import export_plan

    plan, _ = _plans()["grpo_cp_kvp"]
    for target in ("verl", "openrlhf"):
        exp = export_plan(plan, target)
        assert any("KV-parallel decode (cp=2)" in x for x in exp.cannot_express), (target, exp.cannot_express)
