"""Parameter reallocation on 4 gloo ranks: bit for bit, and exactly the bytes the plan charges.

One launch of 4 processes reallocates tiny models between every ordered pair of the layouts
(dp, tp, pp) in {(4,1,1), (1,4,1), (1,1,4), (2,2,1), (2,1,2), (1,2,2)} on the same 4 ranks, between
disjoint meshes ([0-1] <-> [2-3]), between nested meshes ([0-3] <-> [0-1] or [2-3]), from and to
ZeRO-3 (whose rows the reallocation gathers or splits) and from an interleaved pipeline, over
three model shapes (tiny-llama with an LM head or a value head, tiny-gpt with biases and a tied
embedding held by the first and last stages). Each rank checks every slice it receives against
the whole tensor, bit for bit, and reports the elements it put on the wire per receiver; the
test compares them with `plans.sharding.transfer_plan`/`transfer_volume` (pair by pair), with
the cost model's per-rank volumes (`cost_models.transfer.rank_volumes`) and with the bytes the
cost model charges (`CostModel.realloc_cost`, at its parameter width; the runtime moves fp32).
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

from cost_models.api import CostModel
from cost_models.transfer import rank_volumes
from plans import PRESETS, Layout, Mesh, parse_cluster
from plans.graph import ModelDecl
from plans.sharding import parameters, shard_box, transfer_plan, transfer_volume
from runtime.model import init_tensor
from runtime.realloc import rank_plan, reallocate

WORLD = 4
GPN = 4
SIX = [(4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1), (2, 1, 2), (1, 2, 2)]
TWO = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
MODELS = [("tiny-llama", "lm"), ("tiny-llama", "value"), ("tiny-gpt", "lm")]
W, A, B = Mesh.block(0, 4), Mesh.block(0, 2), Mesh.block(2, 2)


def L(dp: int, tp: int, pp: int, **extra) -> Layout:
    return Layout(dp=dp, tp=tp, pp=pp, **extra)


def cases() -> list[tuple[str, str, tuple[Mesh, Layout], tuple[Mesh, Layout]]]:
    out = []
    k = 0

    def add(src, dst):
        nonlocal k
        model, head = MODELS[k % len(MODELS)]
        k += 1
        out.append((model, head, src, dst))

    for s in SIX:  # every ordered pair on one mesh, identity included (all local copies)
        for d in SIX:
            add((W, L(*s)), (W, L(*d)))
    for s in TWO:  # disjoint meshes, both ways
        for d in TWO:
            add((A, L(*s)), (B, L(*d)))
            add((B, L(*s)), (A, L(*d)))
    for i, s in enumerate(SIX):  # nested meshes, both ways
        add((W, L(*s)), (B if i % 2 else A, L(*TWO[i % 3])))
        add((A if i % 2 else B, L(*TWO[(i + 1) % 3])), (W, L(*s)))
    zero3 = [
        ((W, L(2, 2, 1, zero=3)), (W, L(1, 4, 1))),
        ((W, L(4, 1, 1, zero=3)), (W, L(4, 1, 1))),  # the same degrees: gather the rows
        ((W, L(2, 1, 2, zero=3)), (B, L(1, 2, 1))),
        ((A, L(1, 1, 2)), (W, L(2, 2, 1, zero=3))),
        ((A, L(2, 1, 1, zero=3)), (W, L(2, 1, 2, zero=3))),
        ((W, L(2, 1, 2, interleave=2)), (W, L(1, 4, 1))),
    ]
    for src, dst in zero3:
        for model, head in MODELS:
            out.append((model, head, src, dst))
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    problems, results = [], []
    for i, (model, head, src, dst) in enumerate(cases()):
        spec = PRESETS[model]
        whole = {p.name: init_tensor(p, seed=i) for p in parameters(spec, head=head)}
        held = {}
        if rank in src[0].ranks:
            local = src[0].ranks.index(rank)
            for p in parameters(spec, head=head):
                box = shard_box(p, spec, src[1], local)
                if box is not None:
                    held[p.name] = whole[p.name][tuple(slice(*b) for b in box)].clone()
        plan = rank_plan(spec, head=head, src=src, dst=dst, rank=rank, gpus_per_node=GPN)
        got, traffic = reallocate(plan, held, device=torch.device("cpu"))
        want = {}
        if rank in dst[0].ranks:
            local = dst[0].ranks.index(rank)
            for p in parameters(spec, head=head):
                box = shard_box(p, spec, dst[1], local)
                if box is not None:
                    want[p.name] = whole[p.name][tuple(slice(*b) for b in box)]
        if set(got) != set(want):
            problems.append(f"case {i}: rank {rank} holds {sorted(set(got) ^ set(want))} wrongly")
        for name, t in want.items():
            if name in got and (got[name].shape != t.shape or not torch.equal(_bits(got[name]), _bits(t))):
                problems.append(f"case {i} ({model} {head} {src[1].short()} -> {dst[1].short()}): {name} differs")
        results.append({"sent": traffic.sent, "received": traffic.received, "local": traffic.local_numel,
                        "element_bytes": traffic.element_bytes})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems, "results": results}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def traffic(tmp_path_factory) -> list[list[dict]]:
    """Per case, per rank: what the reallocation sent, received and copied."""
    out = tmp_path_factory.mktemp("realloc")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(out)), nprocs=WORLD, join=True)
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    problems = [p for r in per_rank for p in r["problems"]]
    assert not problems, "\n".join(problems[:20])
    return [[per_rank[r]["results"][i] for r in range(WORLD)] for i in range(len(cases()))]


@pytest.mark.slow
def test_every_parameter_arrives_bit_for_bit(traffic) -> None:
    assert len(traffic) == len(cases()) >= 36 + 18 + 12 + 18


@pytest.mark.slow
def test_bytes_sent_equal_the_transfer_plan_and_the_cost_model(traffic) -> None:
    cm = CostModel(parse_cluster("cpu:1x4"))
    moved_any = 0
    for i, (model, head, src, dst) in enumerate(cases()):
        spec = PRESETS[model]
        sent = {(r, int(d)): n for r, res in enumerate(traffic[i]) for d, n in res["sent"].items()}
        received = {(int(s), r): n for r, res in enumerate(traffic[i]) for s, n in res["received"].items()}
        assert sent == received, f"case {i}: sends and receives disagree"
        vol = transfer_volume(spec, head=head, src=src, dst=dst, gpus_per_node=GPN)
        assert sent == vol.by_pair, f"case {i}: {sent} != transfer plan {vol.by_pair}"
        plan = transfer_plan(spec, head=head, src=src, dst=dst, gpus_per_node=GPN)
        assert sum(n for n in sent.values()) == sum(t.numel for t in plan if t.src != t.dst)
        assert sum(res["local"] for res in traffic[i]) == vol.local_numel
        rv = rank_volumes(spec, head=head, src=src, dst=dst, gpus_per_node=GPN)
        for r in range(WORLD):
            k = r - rv.first
            on = 0 <= k < len(rv.send_intra)
            assert sum(traffic[i][r]["sent"].values()) == (int(rv.send_intra[k] + rv.send_inter[k]) if on else 0)
            assert sum(traffic[i][r]["received"].values()) == (int(rv.recv_intra[k] + rv.recv_inter[k]) if on else 0)
        element = traffic[i][0]["element_bytes"]
        assert element == 4  # fp32 parameters move as they are (bit-exact)
        charged = cm.realloc_cost(ModelDecl(spec=spec, head=head), src, dst).bytes
        assert sum(sent.values()) * cm.framework.param_bytes == charged
        moved_any += sum(sent.values()) > 0
    assert moved_any > len(cases()) // 2  # most cases move something (identity pairs move nothing)
