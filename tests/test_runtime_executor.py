"""Whole plans of every algorithm on 4 gloo ranks against the single-process reference.

One launch of 4 processes runs SFT, DPO, GRPO, RLOO and ReMax plans (built with
`planner.algorithms`, each model placed on its own mesh and layout) for two steps and compares
every metric with `PlanRunner(reference=True)` computed in the same process.
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

from planner import algorithms
from plans import Estimate, Layout, Mesh, Plan, PlanCall, SearchInfo, parse_cluster
from plans.errors import PlannerError
from runtime.executor import PlanRunner

WORLD = 4
TOL = 1e-5
REWARD = "runtime.tasks:pattern_reward"


def place(graph, layouts: dict[str, tuple[Mesh, Layout]]) -> Plan:
    """A plan from a graph with each model on a given (mesh, layout)."""
    calls = [PlanCall(**c.model_dump(), mesh=layouts[c.model][0], layout=layouts[c.model][1], est_start_s=0,
                      est_time_s=0, est_peak_mem_bytes=0) for c in graph.calls]
    return Plan(name=graph.name, cluster=parse_cluster("cpu:1x4"), models=graph.models, inputs=graph.inputs,
                algorithm=graph.algorithm, calls=calls, search=SearchInfo(method="test"),
                estimate=Estimate(iteration_s=0, tokens_per_s=0, mfu=0, peak_mem_bytes=0))


def _plans() -> dict[str, Plan]:
    all4, low, high = Mesh.block(0, 4), Mesh.block(0, 2), Mesh.block(2, 2)
    common = {"task": "pattern", "lr": 1e-4}
    return {
        "sft": place(algorithms.sft("tiny-gpt", batch=8, seq_len=12, minibatches=2, **common),
                     {"model": (all4, Layout(dp=2, pp=2, micro_batches=2, zero=3))}),
        "dpo": place(algorithms.dpo("tiny-llama", batch=4, seq_len=12, **common),
                     {"actor": (all4, Layout(dp=2, tp=2, zero=2)), "ref": (high, Layout(pp=2))}),
        "grpo": place(algorithms.grpo("tiny-llama", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5,
                                      samples_per_prompt=2, ppo_minibatches=2, **common),
                      {"actor": (all4, Layout(tp=2, pp=2, micro_batches=2)), "ref": (low, Layout(dp=2))}),
        "rloo": place(algorithms.rloo("tiny-gpt", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5,
                                      samples_per_prompt=2, **common),
                      {"actor": (all4, Layout(dp=4, zero=1)), "ref": (all4, Layout(tp=4))}),
        "remax": place(algorithms.remax("tiny-llama", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5, **common),
                       {"actor": (all4, Layout(dp=2, tp=2, sequence_parallel=True)), "ref": (high, Layout(tp=2))}),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    problems, compared = [], 0
    cpu = torch.device("cpu")
    for name, plan in _plans().items():
        ref = PlanRunner(plan, rank=0, world_size=1, reference=True, seed=2, dtype=torch.float32, device=cpu)
        par = PlanRunner(plan, rank=rank, world_size=WORLD, reference=False, seed=2, dtype=torch.float32, device=cpu)
        for step in (1, 2):
            want, got = ref.step(step), par.step(step)
            if set(want) != set(got):
                problems.append(f"{name} step {step}: keys {sorted(set(want) ^ set(got))}")
            for key, value in want.items():
                if key.endswith("time_s") or key not in got:
                    continue
                compared += 1
                if abs(got[key] - value) > TOL:
                    problems.append(f"{name} step {step} {key}: {got[key]} != reference {value}")
            if not any(k.endswith(".loss") for k in want):
                problems.append(f"{name}: no loss reported")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems, "compared": compared}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_algorithm_plan_matches_the_reference(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    problems, compared = [], 0
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        problems += result["problems"]
        compared += result["compared"]
    assert not problems, "\n".join(problems[:30])
    assert compared >= WORLD * 5 * 2 * 2


def test_a_batch_too_small_for_the_layout_is_refused_before_running() -> None:
    plan = place(algorithms.sft("tiny-gpt", batch=4, seq_len=8, minibatches=4, task="pattern"),
                 {"model": (Mesh.block(0, 4), Layout(dp=4))})
    with pytest.raises(PlannerError, match="each minibatch of 1 sequences cannot split over dp=4"):
        PlanRunner(plan, rank=0, world_size=4, reference=False, seed=0, dtype=torch.float32, device=torch.device("cpu"))
