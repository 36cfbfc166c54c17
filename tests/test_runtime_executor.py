"""Whole plans of every algorithm on 4 gloo ranks against the single-process reference.

One launch of 4 processes runs SFT (also under context parallel), DPO, GRPO, RLOO, ReMax and PPO
plans (and GRPO and PPO of mixtures of experts, with expert parallel) (built with
`planner.algorithms` and placed by hand) for two steps; rank 0 compares every metric with
`PlanRunner(reference=True)`. Some plans keep each model on one mesh and layout; others move
parameters the way compiled plans do: a train call's placement is the model's home, and other
calls run on reallocated copies (across disjoint or nested meshes, from a ZeRO-3 home, to a
pipeline) or share the home's slices under another layout. One GRPO plan takes its rewards from
a reward model on a third mesh; another trains on three consecutive ranks that are no aligned block.
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
from plans import Estimate, GaLore, Layout, Mesh, Plan, PlanCall, Reallocation, SearchInfo, parse_cluster
from plans.errors import PlannerError
from plans.sharding import slices_key, transfer_volume
from runtime.executor import PlanRunner
from tests.machine import facts

WORLD = 4
TOL = 1e-5
REWARD = "runtime.tasks:pattern_reward"


def _slices(mesh: Mesh, lay: Layout) -> tuple:
    """Placements with equal keys hold the same parameter slices on the same ranks."""
    return slices_key(mesh, lay)


def place(graph, layouts: dict[str, tuple[Mesh, Layout]], *, reallocations: bool = True,
          cluster: str = "cpu:1x4") -> Plan:
    """A plan from a graph with each model, or call, on a given (mesh, layout) (call names take
    precedence), listing the reallocations a compiled plan would list."""
    where = {c.name: layouts.get(c.name, layouts.get(c.model)) for c in graph.calls}
    calls = [PlanCall(**c.model_dump(), mesh=where[c.name][0], layout=where[c.name][1], est_start_s=0,
                      est_time_s=0, est_peak_mem_bytes=0) for c in graph.calls]
    moves = []
    homes = graph.home_calls()
    cl = parse_cluster(cluster)
    for c in graph.calls:
        home = homes[c.model]
        if reallocations and _slices(*where[c.name]) != _slices(*where[home]):
            decl = graph.models[c.model]
            vol = transfer_volume(decl.spec, head=decl.head, src=where[home], dst=where[c.name],
                                  gpus_per_node=cl.gpus_per_node)
            moves.append(Reallocation(model=c.model, from_call=home, to_call=c.name, bytes=vol.moved_numel * 2,
                                      est_time_s=0))
    return Plan(name=graph.name, cluster=cl, models=graph.models, inputs=graph.inputs,
                algorithm=graph.algorithm, calls=calls, reallocations=moves, search=SearchInfo(method="test"),
                estimate=Estimate(iteration_s=0, tokens_per_s=0, mfu=0, peak_mem_bytes=0))


GALORE = GaLore(rank=8, update_interval=1)


def _plans() -> dict[str, Plan]:
    all4, low, high = Mesh.block(0, 4), Mesh.block(0, 2), Mesh.block(2, 2)
    common = {"task": "pattern", "lr": 1e-4}
    return {
        "sft": place(algorithms.sft("tiny-gpt", batch=8, seq_len=12, minibatches=2, **common),
                     {"model": (all4, Layout(dp=2, pp=2, micro_batches=2, zero=3))}),
        # Context parallel in whole plans: cp 4 alone, and cp 2 with a pipeline (micro-batches)
        "sft_cp4": place(algorithms.sft("tiny-llama", batch=4, seq_len=13, minibatches=2, **common),
                         {"model": (all4, Layout(cp=4))}),
        "sft_cp_pp": place(algorithms.sft("tiny-gpt", batch=4, seq_len=13, minibatches=2, **common),
                           {"model": (all4, Layout(cp=2, pp=2, micro_batches=2))}),
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
        # Three meshes, a reward model, the actor reallocated from [0-1] to [0-3] every step.
        "grpo_rm": place(algorithms.grpo("tiny-llama", reward="tiny-gpt", batch=4, prompt_len=6, gen_len=5,
                                         samples_per_prompt=2, ppo_minibatches=2, **common),
                         {"actor_train": (low, Layout(tp=2, micro_batches=2, sequence_parallel=True)),
                          "actor_generate": (all4, Layout(dp=2, tp=2)), "reward": (high, Layout(pp=2, micro_batches=2)),
                          "ref": (low, Layout(dp=2))}),
        # From a ZeRO-3 pipeline home to tensor parallel on a nested mesh; the critic's inference
        # shares its home's slices under another layout (no reallocation).
        "ppo_z3": place(algorithms.ppo("tiny-llama", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5,
                                       ppo_minibatches=2, **common),
                        {"actor_train": (all4, Layout(dp=2, pp=2, zero=3, micro_batches=2)),
                         "actor_generate": (high, Layout(tp=2)),
                         "critic": (all4, Layout(dp=2, tp=2, zero=1, micro_batches=2, sequence_parallel=True)),
                         "critic_inference": (all4, Layout(dp=2, tp=2)), "ref": (low, Layout(tp=2))}),
        # The actor's log-probs recomputed before training (verl's and OpenRLHF's way): a
        # pipelined copy on two ranks, reallocated from a tensor-parallel home.
        "ppo_policy_lp": place(algorithms.ppo("tiny-llama", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5,
                                              ppo_minibatches=2, policy_logprobs=True, **common),
                               {"actor_train": (all4, Layout(dp=2, tp=2)), "actor_generate": (all4, Layout(dp=4)),
                                "actor_logprobs": (high, Layout(pp=2)), "critic": (low, Layout(dp=2)),
                                "ref": (low, Layout(tp=2))}),
        # A run of three consecutive ranks that is no aligned block (the search's node ranges on a
        # cluster of four one-GPU nodes): the actor trains data-parallel over ranks 1-3 and
        # generates on all four, the reference sits on rank 0 alone.
        "grpo_range": place(algorithms.grpo("tiny-llama", reward_fn=REWARD, batch=6, prompt_len=6, gen_len=5,
                                            samples_per_prompt=2, ppo_minibatches=2, **common),
                            {"actor_train": (Mesh.block(1, 3), Layout(dp=3, zero=1)),
                             "actor_generate": (all4, Layout(dp=4)), "ref": (Mesh.block(0, 1), Layout())},
                            cluster="cpu:4x1"),
        # States in host memory between calls (`Layout.offload`): the actor's and the critic's Adam
        # moments (ZeRO-1 partitions, ZeRO-3 slices), the reward model's and the reference's weights.
        "ppo_offload": place(algorithms.ppo("tiny-llama", reward="tiny-gpt", batch=8, prompt_len=6, gen_len=5,
                                            ppo_minibatches=2, **common),
                             {"actor": (all4, Layout(dp=4, zero=1, offload="optimizer")),
                              "actor_generate": (all4, Layout(dp=2, tp=2)),
                              "critic": (low, Layout(dp=2, zero=3, offload="optimizer")),
                              "critic_inference": (low, Layout(dp=2)),
                              "ref": (high, Layout(tp=2, offload="weights")),
                              "reward": (all4, Layout(pp=2, dp=2, offload="weights"))}),
        # A GaLore optimizer (`Layout.galore`): the actor's under ZeRO-1 with a pipeline, the
        # critic's under ZeRO-0 (projectors sent from their owners), refreshed every step.
        "ppo_galore": place(algorithms.ppo("tiny-llama", reward_fn=REWARD, batch=8, prompt_len=6, gen_len=5,
                                           ppo_minibatches=2, **common),
                            {"actor_train": (all4, Layout(dp=2, pp=2, zero=1, micro_batches=2, galore=GALORE)),
                             "actor_generate": (all4, Layout(dp=2, tp=2)),
                             "critic_train": (low, Layout(dp=2, galore=GALORE)),
                             "critic_inference": (low, Layout(dp=2)), "ref": (high, Layout(tp=2))}),
        # Mixtures of experts: GRPO trained with expert parallel over all four ranks, generating with
        # experts split over tp and ep (a reallocation moves them), the reference on two ranks at ep 2;
        # PPO of a Qwen-MoE-style actor (shared expert, a dense layer) trained with ep x tp, its
        # critic at ep 4.
        "grpo_moe": place(algorithms.grpo("tiny-mixtral", reward_fn=REWARD, batch=4, prompt_len=6, gen_len=5,
                                          samples_per_prompt=2, ppo_minibatches=2, **common),
                          {"actor_train": (all4, Layout(dp=4, ep=4)),
                           "actor_generate": (all4, Layout(dp=2, tp=2, ep=2, etp=2)),
                           "ref": (low, Layout(dp=2, ep=2))}),
        "ppo_moe": place(algorithms.ppo("tiny-qwen-moe", reward_fn=REWARD, batch=8, prompt_len=6, gen_len=5,
                                        ppo_minibatches=2, **common),
                         {"actor": (all4, Layout(dp=2, tp=2, ep=2, etp=2, sequence_parallel=True)),
                          "critic": (all4, Layout(dp=4, ep=4)), "ref": (high, Layout(tp=2, etp=2))}),
    }


def run_against_reference(name: str, plan: Plan, *, rank: int, steps: int = 2) -> tuple[PlanRunner, list[str], int]:
    """Run `steps` steps of `plan` on this rank of WORLD; rank 0 also runs the single-process
    reference and compares every metric: (this rank's runner, problems, metrics compared)."""
    cpu = torch.device("cpu")
    par = PlanRunner(plan, rank=rank, world_size=WORLD, reference=False, seed=2, dtype=torch.float32, device=cpu)
    problems, compared = [], 0
    if rank != 0:  # metrics are complete on rank 0 only
        for step in range(1, steps + 1):
            par.step(step)
        return par, problems, compared
    ref = PlanRunner(plan, rank=0, world_size=1, reference=True, seed=2, dtype=torch.float32, device=cpu)
    for step in range(1, steps + 1):
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
    return par, problems, compared


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    problems, compared = [], 0
    for name, plan in _plans().items():
        runner, p, c = run_against_reference(name, plan, rank=rank)
        problems += p
        compared += c
        for model, where, held in runner.resident():  # offloaded states wait on the host between steps
            if held is not None and where.layout.offload != "none" and not held.offloaded:
                problems.append(f"{name}: rank {rank} holds {model}'s offloaded states on the device between steps")
    if rank == 0:
        Path(out_dir, "rank0.json").write_text(json.dumps({"problems": problems, "compared": compared}))
    dist.destroy_process_group()


@pytest.mark.heavy
@pytest.mark.slow
def test_every_algorithm_plan_matches_the_reference(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert not result["problems"], "\n".join(result["problems"][:30]) + "\n" + facts()
    assert result["compared"] >= 10 * 2 * 2


def test_a_batch_too_small_for_the_layout_is_refused_before_running() -> None:
    plan = place(algorithms.sft("tiny-gpt", batch=4, seq_len=8, minibatches=4, task="pattern"),
                 {"model": (Mesh.block(0, 4), Layout(dp=4))})
    with pytest.raises(PlannerError, match="each minibatch of 1 sequences cannot split over dp=4"):
        PlanRunner(plan, rank=0, world_size=4, reference=False, seed=0, dtype=torch.float32, device=torch.device("cpu"))
