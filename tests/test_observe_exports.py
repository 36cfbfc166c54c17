"""Exports to Megatron-LM, DeepSpeed, verl and OpenRLHF: what each carries of the plan, and a test
for each defect found by feeding exports to the engines' current releases.

That the engines accept the exports (their own parsers and validators: Hydra + `validate_config`,
OpenRLHF's script, `DeepSpeedConfig`, megatron-core and Megatron-LM's `validate_args`) is checked
by `make test-engines` (tests/engines/), in an environment with the engines installed; these
tests pin the mapping itself and run everywhere.
"""

from __future__ import annotations

import json
import shlex

import pytest

from planner.exports import EXPORTERS, TARGETS, export_plan
from plans.errors import PlannerError
from plans.layout import Layout
from tests.observe_fixtures import (
    filling,
    ppo_7b,
    sft_70b,
    sft_70b_tp2_pp4,
    tiny_ppo,
    tiny_ppo_rm,
    with_layout,
    with_placement,
)


def _words(text: str) -> list[str]:
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    return shlex.split(body.replace("\\\n", " "))


def _flags(text: str) -> dict[str, object]:
    words = _words(text)
    out: dict[str, object] = {}
    i = next(i for i, w in enumerate(words) if w.startswith("--"))
    while i < len(words):
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            out[words[i]] = words[i + 1]
            i += 2
        else:
            out[words[i]] = True
            i += 1
    return out


def _overrides(text: str) -> dict[str, str]:
    return dict(w.split("=", 1) for w in _words(text) if "=" in w and not w.startswith("CUDA"))


def _gpus(flags: dict[str, object], role: str) -> int:
    return int(flags[f"--{role}.num_nodes"]) * int(flags[f"--{role}.num_gpus_per_node"])


def _colocated(plan, layout: Layout):  # noqa: ANN001, ANN202
    world = plan.cluster.world_size
    return with_placement(plan, {c.name: (0, layout if c.kind == "train" else
                                          Layout(dp=layout.dp, tp=layout.tp, pp=layout.pp)) for c in plan.calls}) \
        if layout.size == world else None


def test_every_export_names_its_target_release() -> None:
    plans = {"megatron": sft_70b(), "verl": ppo_7b(), "openrlhf": ppo_7b(),
             "deepspeed": with_layout(sft_70b(), "model_train", Layout(dp=64, zero=3, micro_batches=8))}
    for target in EXPORTERS:
        exp = export_plan(plans[target], target)
        assert exp.version == TARGETS[target] and exp.to_json()["version"] == TARGETS[target]
        if target != "deepspeed":  # a JSON config has no comments; --json and the CLI's stderr carry it
            assert exp.text.startswith(f"# exported by `planner export --to {target}` for {TARGETS[target]}")


# ---- OpenRLHF 0.11: dotted flags, GPUs that add up, batch checks it asserts ---------------------

def test_openrlhf_uses_the_dotted_flags_of_0_11() -> None:
    flags = _flags(export_plan(ppo_7b(), "openrlhf").text)
    assert all("." in f for f in flags), [f for f in flags if "." not in f]
    assert {"--actor.num_nodes", "--vllm.num_engines", "--train.batch_size", "--rollout.n_samples_per_prompt",
            "--ds.zero_stage", "--algo.kl.init_coef"} <= set(flags)


@pytest.mark.parametrize("plan", [ppo_7b, tiny_ppo, tiny_ppo_rm], ids=["ppo_7b", "tiny_ppo", "tiny_ppo_rm"])
def test_openrlhf_never_asks_for_more_gpus_than_the_cluster(plan) -> None:  # noqa: ANN001
    """The defect: vLLM engines without GPUs of their own and no colocation (32 GPUs asked on 16)."""
    p = plan()
    flags = _flags(export_plan(p, "openrlhf").text)
    engines = int(flags["--vllm.num_engines"]) * int(flags["--vllm.tensor_parallel_size"])
    if "--train.colocate_all" in flags:
        assert _gpus(flags, "actor") == engines <= p.cluster.world_size
        assert "--vllm.enable_sleep" in flags and "--ds.enable_sleep" in flags
        return
    total = engines + _gpus(flags, "actor")
    total += 0 if "--train.colocate_actor_ref" in flags else _gpus(flags, "ref")
    if "--critic.model_name_or_path" in flags:
        total += _gpus(flags, "critic")
    if "--reward.model_name_or_path" in flags and "--train.colocate_critic_reward" not in flags:
        total += _gpus(flags, "reward")
    assert total <= p.cluster.world_size


def test_openrlhf_rollout_micro_batch_keeps_every_actor_rank_busy() -> None:
    """The defect: --micro_rollout_batch_size from a tp8 inference layout broke OpenRLHF's
    assertion samples // micro >= actor GPUs // ring // tp (a plan of the space without offload,
    whose inference calls run tp8)."""
    plan = ppo_7b(offload=False)
    assert any(c.layout.tp == 8 for c in plan.calls if c.kind == "inference")
    flags = _flags(export_plan(plan, "openrlhf").text)
    samples = int(flags["--rollout.batch_size"]) * int(flags["--rollout.n_samples_per_prompt"])
    tp = int(flags.get("--ds.tensor_parallel_size", 1))
    assert samples // int(flags["--rollout.micro_batch_size"]) >= _gpus(flags, "actor") // tp
    assert int(flags["--train.batch_size"]) % (int(flags["--train.micro_batch_size"]) * _gpus(flags, "actor") // tp) == 0


def test_openrlhf_states_what_it_cannot_express() -> None:
    exp = export_plan(tiny_ppo(), "openrlhf")
    assert any("GPU placement of each role" in x for x in exp.cannot_express)
    base = ppo_7b()
    pp = with_layout(with_layout(base, "critic_train", filling(base, "critic_train", pp=4, zero=1, micro_batches=8)),
                     "actor_train", filling(base, "actor_train", tp=2, zero=2, micro_batches=4, sequence_parallel=True))
    exp = export_plan(pp, "openrlhf")
    assert any("critic_train: pipeline parallel pp=4" in x for x in exp.cannot_express)
    assert any("one ZeRO stage for every model" in x for x in exp.cannot_express)


# ---- verl 0.9: current keys, the Megatron trainer config, ZeRO-3 kept ---------------------------

def test_verl_reward_model_goes_under_reward_reward_model() -> None:
    """The defect: legacy reward_model.* keys (rejected by Hydra; without them main_ppo silently
    trained with no reward model)."""
    o = _overrides(export_plan(ppo_7b(), "verl").text)
    assert not any(k.startswith("reward_model.") for k in o)
    assert o["reward.reward_model.enable"] == "True" and o["reward.reward_model.rollout.name"] == "vllm"
    assert o["reward.reward_model.model_path"] == "llama-2-7b"


def test_verl_megatron_strategy_uses_the_megatron_trainer_config() -> None:
    exp = export_plan(_colocated(ppo_7b(), Layout(dp=8, tp=2, zero=1, micro_batches=4)), "verl")  # tp2: Megatron
    words = _words(exp.text)
    assert words[:5] == ["python3", "-m", "verl.trainer.main_ppo", "--config-name", "ppo_megatron_trainer"]
    o = _overrides(exp.text)
    assert o["actor_rollout_ref.actor.strategy"] == "megatron"
    # forward_micro_batch_size_per_gpu exists for the FSDP critic only
    assert "critic.forward_micro_batch_size_per_gpu" not in o
    assert any("critic_inference: its own micro-batch" in x for x in exp.cannot_express)


def test_verl_zero3_is_megatron_fsdp_not_the_distributed_optimizer() -> None:
    """The defect: ZeRO-3 mapped silently to use_distributed_optimizer (ZeRO-1)."""
    plan = _colocated(ppo_7b(), Layout(dp=8, tp=2, zero=3, micro_batches=4, sequence_parallel=True))
    o = _overrides(export_plan(plan, "verl").text)
    assert o["actor_rollout_ref.actor.megatron.use_megatron_fsdp"] == "True"
    assert o["actor_rollout_ref.actor.megatron.use_distributed_optimizer"] == "False"
    z2 = export_plan(_colocated(ppo_7b(), Layout(dp=8, tp=2, zero=2, micro_batches=4)), "verl")
    assert any("ZeRO-2" in x for x in z2.cannot_express)


def test_verl_fsdp_critic_gets_its_forward_micro_batch() -> None:
    plan = _colocated(ppo_7b(), Layout(dp=16, zero=3, micro_batches=4))
    exp = export_plan(plan, "verl")
    o = _overrides(exp.text)
    assert _words(exp.text)[3:5] != ["--config-name", "ppo_megatron_trainer"]
    assert int(o["critic.forward_micro_batch_size_per_gpu"]) >= 1
    # FSDP shards the critic's and the reference's parameters for their forwards; the plan replicated them.
    assert any("critic_inference: parameters replicated" in x for x in exp.cannot_express)


def test_verl_states_per_role_placements() -> None:
    exp = export_plan(tiny_ppo(), "verl")  # ref on [2-3], critic train on [1], actor on [0]
    assert any("ref_inference runs on GPUs [2-3] only" in x for x in exp.cannot_express)
    assert any("ZeRO-0" in x for x in exp.cannot_express)  # FSDP shards everything
    # the reward model alone on GPU 4, but 7 GPUs left are not whole nodes
    rm = export_plan(with_placement(tiny_ppo_rm(), {"reward_inference": (4, Layout())}), "verl")
    assert rm.data["reward"]["reward_model"]["enable_resource_pool"] is False
    assert any("reward_inference runs on GPUs [4] only" in x for x in rm.cannot_express)
    pool = export_plan(with_placement(tiny_ppo_rm(), {
        "reward_inference": (4, Layout(dp=4)), "ref_inference": (2, Layout(dp=2)),
        "critic_inference": (1, Layout()), "critic_train": (1, Layout())}), "verl")  # everything on node 0,
    # the reward model on node 1
    rw = pool.data["reward"]["reward_model"]
    assert (rw["enable_resource_pool"], rw["nnodes"], rw["n_gpus_per_node"]) == (True, 1, 4)
    assert pool.data["trainer"] == {"nnodes": 1, "n_gpus_per_node": 4}
    with pytest.raises(PlannerError, match="no generate call"):
        export_plan(sft_70b(), "verl")


# ---- both RLHF targets carry the plan's memory decisions ----------------------------------------

def test_rlhf_exports_carry_the_kv_budget_the_plan_was_costed_with() -> None:
    from planner.exports.common import own_peak_bytes

    plan = ppo_7b()
    gen = next(c for c in plan.calls if c.kind == "generate")
    share = own_peak_bytes(plan, gen) / plan.cluster.mem_bytes
    verl = float(_overrides(export_plan(plan, "verl").text)["actor_rollout_ref.rollout.gpu_memory_utilization"])
    orl = float(_flags(export_plan(plan, "openrlhf").text)["--vllm.gpu_memory_utilization"])
    assert verl == orl and share <= verl <= share + 0.01 + 1e-9


# ---- Megatron-LM core_v0.19.0 --------------------------------------------------------------------

def test_megatron_sets_what_its_validate_args_requires() -> None:
    """The defects: tp/cp > 1 without CUDA_DEVICE_MAX_CONNECTIONS=1, Megatron FSDP without its
    checkpoint format, dropout left at Megatron's 0.1, --lr without a decay style."""
    exp = export_plan(sft_70b_tp2_pp4(), "megatron")
    assert _words(exp.text)[0] == "CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert exp.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    f = _flags(exp.text)
    assert f["--attention-dropout"] == f["--hidden-dropout"] == "0.0"
    assert f["--lr-decay-style"] == "constant"
    assert any("ZeRO-2" in x for x in exp.cannot_express)  # the distributed optimizer is ZeRO-1 memory
    fsdp = export_plan(with_layout(sft_70b(), "model_train", Layout(dp=16, tp=4, zero=3, micro_batches=32)),
                       "megatron")
    f = _flags(fsdp.text)
    assert f["--use-megatron-fsdp"] is True and f["--ckpt-format"] == "fsdp_dtensor"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in fsdp.text  # Megatron FSDP asserts it is not 1


def test_megatron_refuses_what_pretrain_gpt_cannot_run() -> None:
    with pytest.raises(PlannerError, match="optimises the ppo_(policy|value) loss"):
        export_plan(ppo_7b(), "megatron")
    uneven = with_layout(sft_70b(), "model_train", Layout(tp=2, pp=32, micro_batches=64, sequence_parallel=True))
    with pytest.raises(PlannerError, match=r"pipeline stages of \[2, 3, 3"):
        export_plan(uneven, "megatron")
    with pytest.raises(PlannerError, match="no train call 'nope'"):
        export_plan(sft_70b(), "megatron", call="nope")


@pytest.mark.parametrize("layout", [Layout(dp=4, tp=8, pp=2, interleave=5, zero=1, micro_batches=128,
                                           recompute="full", sequence_parallel=True),
                                    Layout(dp=8, tp=4, cp=2, zero=1, micro_batches=64, recompute="selective",
                                           sequence_parallel=True)], ids=["interleaved", "cp2"])
def test_megatron_flags_carry_the_layout(layout: Layout) -> None:
    plan = with_layout(sft_70b(), "model_train", layout)
    f = _flags(export_plan(plan, "megatron").text)
    call = plan.calls[0]
    assert (int(f["--tensor-model-parallel-size"]), int(f["--pipeline-model-parallel-size"]),
            int(f["--context-parallel-size"])) == (layout.tp, layout.pp, layout.cp)
    assert int(f["--global-batch-size"]) == call.seqs // call.minibatches
    assert int(f["--micro-batch-size"]) * layout.dp * layout.micro_batches == int(f["--global-batch-size"])
    assert f.get("--recompute-granularity") == layout.recompute
    if layout.interleave > 1:
        assert int(f["--num-layers-per-virtual-pipeline-stage"]) * layout.pp * layout.interleave == \
            plan.models["model"].spec.num_hidden_layers


# ---- DeepSpeed 0.19: the batch check on the engine's own world -----------------------------------

@pytest.mark.parametrize("layout", [Layout(dp=8, tp=1, pp=8, zero=1, micro_batches=64),
                                    Layout(dp=8, tp=8, zero=1, micro_batches=64),
                                    Layout(dp=16, cp=4, zero=3, micro_batches=32)], ids=["pp8", "autotp8", "ulysses4"])
def test_deepspeed_batch_holds_for_the_world_deepspeed_sees(layout: Layout) -> None:
    """The defect: train_batch_size and accumulation copied from a pipelined layout failed
    DeepSpeed's train_batch == micro * gas * world (1024 != 2 * 64 * 64)."""
    plan = with_layout(sft_70b(), "model_train", layout)
    cfg = json.loads(export_plan(plan, "deepspeed").text)
    world = 64 // layout.pp // layout.tp if layout.pp > 1 else 64 // layout.cp  # grid dp / processes over Ulysses
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * world
    assert cfg["zero_optimization"]["stage"] == layout.zero
    # what the plan priced: the reduction under the backward (DeepSpeed's default only at stage 3)
    assert cfg["zero_optimization"].get("overlap_comm", layout.zero == 3) is True
    assert cfg.get("sequence_parallel_size", 1) == layout.cp


def test_deepspeed_refuses_layouts_its_config_cannot_build() -> None:
    with pytest.raises(PlannerError, match="PipelineModule takes neither AutoTP"):
        export_plan(sft_70b_tp2_pp4(), "deepspeed")
    with pytest.raises(PlannerError, match="pick one with --call"):
        export_plan(ppo_7b(), "deepspeed")


def test_export_cli(cli, tmp_path) -> None:  # noqa: ANN001
    from plans.plan import save_plan

    z3 = with_layout(sft_70b(), "model_train", Layout(dp=64, zero=3, micro_batches=8))
    path = tmp_path / "sft.json"
    save_plan(z3, path)
    r = cli("export", str(path), "--to", "deepspeed", "-o", str(tmp_path / "ds.json"))
    assert r.code == 0, r.err
    assert json.loads((tmp_path / "ds.json").read_text())["zero_optimization"]["stage"] == 3
    r = cli("export", str(path), "--to", "megatron", "--json")
    data = json.loads(r.out)
    assert r.code == 0 and set(data) == {"target", "version", "settings", "cannot_express", "notes", "source", "env"}
    r = cli("export", str(path), "--to", "megatron", "--target-version", "core_v0.18.0")
    assert r.code == 2 and "core_v0.19.0" in r.err
    save_plan(ppo_7b(), tmp_path / "ppo.json")
    r = cli("export", str(tmp_path / "ppo.json"), "--to", "verl")
    assert r.code == 0 and r.out.startswith("# exported by `planner export --to verl` for verl 0.9.x")
    r = cli("export", str(tmp_path / "ppo.json"), "--to", "megatron")
    assert r.code == 2 and "Megatron-LM cannot run plan" in r.err
    r = cli("export", str(tmp_path / "ppo.json"), "--to", "deepspeed", "--call", "actor_train")
    assert r.code == 0 and json.loads(r.out)["zero_optimization"] and "cannot express" in r.err
