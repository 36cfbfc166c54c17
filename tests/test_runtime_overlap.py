"""Communication overlaps computation (issue: a fast runtime), on 2 gloo ranks.

- Data parallel: gradient buckets start their reduction during the backward pass, as soon as
  each is complete (ZeRO 0 and 2), and the step equals the single-process one.
- ZeRO-3: after the first forward, each layer's gather is already under way when the layer
  comes (prefetch), in forward and in the recomputed forward of backward; gradients are
  reduce-scattered while backward goes on; the step equals the single-process one.
- Pipeline generation: with two stages and two groups, the first stage runs the second group's
  prefill before it waits for the first group's token (both groups in flight), and the tokens
  are those of one group.
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

from plans import PRESETS, AlgorithmConfig, Layout, Mesh
from plans.sharding import parameters, shard_box
from runtime.data_parallel import AdamConfig, DataParallel
from runtime.engine import ModelRunner
from runtime.groups import Groups, solo_groups
from runtime.losses import make_loss
from runtime.model import init_tensor

WORLD = 2
SPEC = PRESETS["tiny-llama"]
ADAM = AdamConfig(eps=1e-6)
CPU = torch.device("cpu")


def _state(p):  # noqa: ANN001, ANN202
    return init_tensor(p, seed=3)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (8, 12), generator=g)
    return {"tokens": tokens, "mask": torch.ones(8, 11, dtype=torch.bool)}


def _train(runner: ModelRunner) -> dict[str, torch.Tensor]:
    loss = make_loss("sft", AlgorithmConfig())
    batch = _batch()
    runner.train(batch, loss=loss, denoms=[float(batch["mask"].sum())], lr=1e-3)
    return runner.local_parameters()


def _max_diff(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], layout: Layout, local: int) -> float:
    catalog = {p.name: p for p in parameters(SPEC, head="lm")}
    worst = 0.0
    for name, mine in got.items():
        box = shard_box(catalog[name], SPEC, layout, local)
        worst = max(worst, (ref[name][tuple(slice(a, b) for a, b in box)] - mine).abs().max().item())
    return worst


def _worker(rank: int, port: int, out_dir: str) -> None:
    import runtime.data_parallel as dpm
    import runtime.generate as gen

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups, mesh = Groups(distributed=True), Mesh.block(0, WORLD)
    report: dict[str, object] = {}
    ref = _train(ModelRunner(SPEC, head="lm", trainable=True, groups=solo_groups(Layout()), state=_state, device=CPU,
                             adam=ADAM))

    # Buckets started inside backward (autograd's graph task is running) vs after it.
    dpm.BUCKET_BYTES = 8192
    started: list[bool] = []
    start = DataParallel._start

    def recording(self, bucket):  # noqa: ANN001, ANN202
        started.append(torch._C._current_graph_task_id() != -1)
        return start(self, bucket)

    DataParallel._start = recording  # type: ignore[method-assign]
    for zero in (0, 2):
        layout = Layout(dp=2, zero=zero, micro_batches=2)
        runner = ModelRunner(SPEC, head="lm", trainable=True, groups=groups.build(mesh, layout, rank=rank, tied=False),
                             state=_state, device=CPU, adam=ADAM)
        started.clear()
        got = _train(runner)
        report[f"zero{zero}"] = {"in_backward": sum(started), "after": len(started) - sum(started),
                                 "buckets": len(runner.dp._buckets), "diff": _max_diff(ref, got, layout, rank)}
    DataParallel._start = start  # type: ignore[method-assign]

    # ZeRO-3 prefetch: forward, then a train step with full recompute (forward, recomputed forward).
    layout = Layout(dp=2, zero=3, recompute="full")
    runner = ModelRunner(SPEC, head="lm", trainable=True, groups=groups.build(mesh, layout, rank=rank, tied=False),
                         state=_state, device=CPU, adam=ADAM)
    runner.forward(_batch()["tokens"], what="logprobs")  # the first forward learns the order of the uses
    before = runner.shard.gather.served_ahead
    in_flight: list[int] = []
    reduce = runner.dp.reduce_gradients

    def counting() -> None:
        in_flight.append(len(runner.shard.gather._scattering))  # reduce-scatters still under way
        reduce()

    runner.dp.reduce_gradients = counting  # type: ignore[method-assign]
    got = _train(runner)
    report["zero3"] = {"served_ahead": runner.shard.gather.served_ahead - before, "in_flight": in_flight,
                       "layers": SPEC.num_hidden_layers, "diff": _max_diff(ref, got, layout, rank)}

    # Pipelined generation: what the first stage does, in order.
    prompts = _batch()["tokens"][:, :5]
    outs = {}
    for m in (1, 2):
        layout = Layout(pp=2, micro_batches=m)
        runner = ModelRunner(SPEC, head="lm", trainable=False, groups=groups.build(mesh, layout, rank=rank, tied=False),
                             state=_state, device=CPU)
        events: list[str] = []
        forward, recv = gen.stage_forward, runner.pipe.recv

        def fwd(shard, x, events=events, forward=forward, **kw):  # noqa: ANN001, ANN003, ANN202
            events.append(f"forward {x.shape[0]}x{x.shape[1]}")
            return forward(shard, x, **kw)

        def rcv(shape, src, events=events, recv=recv, **kw):  # noqa: ANN001, ANN003, ANN202
            events.append("recv")
            return recv(shape, src, **kw)

        gen.stage_forward, runner.pipe.recv = fwd, rcv  # type: ignore[method-assign]
        out = runner.generate(prompts, gen_len=4, temperature=1.0, seed=7)
        gen.stage_forward = forward
        outs[m] = None if out is None else out["tokens"].tolist()
        report[f"pp_m{m}"] = {"events": events[:4], "tokens": outs[m]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("overlap")
    mp.spawn(_worker, args=(_free_port(), str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_gradient_buckets_are_reduced_during_backward(reports: list[dict]) -> None:
    for rep in reports:
        for zero in (0, 2):
            got = rep[f"zero{zero}"]
            assert got["buckets"] > 2, got
            assert got["in_backward"] == got["buckets"] and got["after"] == 0, got  # none waited for the end
            assert got["diff"] < 1e-5, got


@pytest.mark.slow
def test_zero3_gathers_the_next_use_ahead_and_reduces_gradients_while_backward_goes_on(
        reports: list[dict]) -> None:
    for rep in reports:
        got = rep["zero3"]
        # forward and the recomputed forward of backward: every layer but the first of each pass
        assert got["served_ahead"] >= 2 * (got["layers"] - 1), got
        assert got["in_flight"] and all(n > 0 for n in got["in_flight"]), got  # backward did not wait for them
        assert got["diff"] < 1e-5, got


@pytest.mark.slow
def test_pipeline_generation_keeps_both_groups_in_flight(reports: list[dict]) -> None:
    first = reports[0]
    # one group: prefill, then wait for its token; two: both prefills before the first wait
    assert first["pp_m1"]["events"][:2] == ["forward 8x5", "recv"], first["pp_m1"]
    assert first["pp_m2"]["events"][:3] == ["forward 4x5", "forward 4x5", "recv"], first["pp_m2"]
    assert reports[1]["pp_m2"]["tokens"] == reports[1]["pp_m1"]["tokens"] is not None
