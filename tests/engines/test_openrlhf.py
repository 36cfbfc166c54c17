"""OpenRLHF 0.11.2 accepts every export: its own `train_ppo_ray.py` runs on the exported flags (its
argparse parser with the dotted names, every post-parse check of its `__main__` block, and `train()`
up to where Ray would start the actors), and the GPUs its groups and vLLM engines take add up to
no more than the cluster.

Stubbed, because they need a Ray cluster or GPUs (each records what OpenRLHF asks of it):
- `ray` (init, get, remote) and `ray.util.placement_group.placement_group` (bundles of 1 GPU);
- `openrlhf.trainer.ray.create_vllm_engines` (vLLM engines: GPUs, or a share of the placement group);
- `openrlhf.trainer.ray.launcher.RayActorGroup` and the actor classes it places;
- `openrlhf.trainer.ray.ppo_actor` / `ppo_critic` (model actors, imported for their classes only);
- `openrlhf.utils.get_strategy` (DeepSpeed strategy; its batch config is checked separately below,
  by `get_train_ds_config` and DeepSpeed's own `DeepSpeedConfig`);
- `openrlhf.trainer.ppo_trainer.PPOTrainer.remote`, where the stub stops the run.
"""

from __future__ import annotations

import runpy
import sys
import types
from pathlib import Path

import openrlhf
import pytest
from conftest import DataParallelWorld, exports, ids, load, plan_of, planner, planner_table, words

EXPORTS = exports("openrlhf")
pytestmark = pytest.mark.usefixtures("deepspeed_process_group")
SCRIPT = Path(openrlhf.__file__).parent / "cli" / "train_ppo_ray.py"


class Stop(Exception):
    """Raised where OpenRLHF would hand the work to Ray."""


class Seen:
    def __init__(self) -> None:
        self.args = None
        self.groups: list[dict] = []
        self.engines: dict | None = None
        self.pgs: list[int] = []


def _stubs(seen: Seen) -> dict[str, types.ModuleType]:
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    ray.init = lambda **_: None
    ray.get = lambda x: x
    ray.remote = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
    util = types.ModuleType("ray.util")
    pgmod = types.ModuleType("ray.util.placement_group")

    class PG:
        def __init__(self, bundles) -> None:  # noqa: ANN001
            seen.pgs.append(sum(b.get("GPU", 0) for b in bundles))
            self.bundle_count = len(bundles)

        def ready(self) -> None:
            return None

    pgmod.placement_group = lambda bundles, strategy="PACK": PG(bundles)
    util.placement_group = pgmod
    ray.util = util
    trainer_ray = types.ModuleType("openrlhf.trainer.ray")

    def create_vllm_engines(num_engines, tensor_parallel_size, pretrain, seed, full_determinism, prefix, eager,  # noqa: ANN001
                            max_len, shared_pg, gpu_memory_utilization, vllm_enable_sleep, *a, **k):  # noqa: ANN001, ANN002, ANN003
        seen.engines = {"num": num_engines, "tp": tensor_parallel_size, "pg": shared_pg is not None,
                        "gpu_memory_utilization": gpu_memory_utilization, "sleep": vllm_enable_sleep}
        return ["engine"] * num_engines

    trainer_ray.create_vllm_engines = create_vllm_engines
    launcher = types.ModuleType("openrlhf.trainer.ray.launcher")

    class RayActorGroup:
        def __init__(self, num_nodes, num_gpus_per_node, cls, pg=None, num_gpus_per_actor=1, duplicate_actors=1):  # noqa: ANN001
            seen.groups.append({"cls": cls, "gpus": num_nodes * num_gpus_per_node, "pg": pg is not None,
                                "share": num_gpus_per_actor})

    launcher.RayActorGroup = RayActorGroup
    launcher.ReferenceModelActor = "ref"
    launcher.RewardModelActor = "reward"
    actor = types.ModuleType("openrlhf.trainer.ray.ppo_actor")
    actor.PolicyModelActor = "actor"
    critic = types.ModuleType("openrlhf.trainer.ray.ppo_critic")
    critic.CriticModelActor = "critic"
    utils = types.ModuleType("openrlhf.utils")
    utils.__path__ = [str(Path(openrlhf.__file__).parent / "utils")]

    class Strategy:
        def print(self, *_a) -> None:  # noqa: ANN002
            return None

    def get_strategy(args):  # noqa: ANN001, ANN202
        seen.args = args
        return Strategy()

    utils.get_strategy = get_strategy
    ppo_trainer = types.ModuleType("openrlhf.trainer.ppo_trainer")

    class PPOTrainer:
        @staticmethod
        def remote(*_a, **_k) -> None:  # noqa: ANN002, ANN003
            raise Stop

    ppo_trainer.PPOTrainer = PPOTrainer
    return {"ray": ray, "ray.util": util, "ray.util.placement_group": pgmod, "openrlhf.trainer.ray": trainer_ray,
            "openrlhf.trainer.ray.launcher": launcher, "openrlhf.trainer.ray.ppo_actor": actor,
            "openrlhf.trainer.ray.ppo_critic": critic, "openrlhf.utils": utils,
            "openrlhf.trainer.ppo_trainer": ppo_trainer}


def run_script(argv: list[str], monkeypatch) -> Seen:  # noqa: ANN001
    """OpenRLHF's script on `argv`, to the point where it would start Ray actors."""
    seen = Seen()
    for name, mod in _stubs(seen).items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *argv])
    with pytest.raises(Stop):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    return seen


def gpus_taken(seen: Seen) -> int:
    """GPUs Ray must find: placement groups, groups outside them, and engines outside them."""
    total = sum(seen.pgs)
    total += sum(g["gpus"] for g in seen.groups if not g["pg"])
    if seen.engines and not seen.engines["pg"]:
        total += seen.engines["num"] * seen.engines["tp"]
    return total


def ds_batch_ok(args, gpus: int) -> None:  # noqa: ANN001
    """The DeepSpeed config OpenRLHF builds for a trained model of `gpus` processes passes DeepSpeed's
    batch assertion (its `get_train_ds_config`, then the two batch keys `get_ds_train_config` sets)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    get_train_ds_config = _module("openrlhf/utils/deepspeed/deepspeed_utils.py").get_train_ds_config
    cfg = get_train_ds_config(offload=False, adam_offload=args.ds.adam_offload, stage=args.ds.zero_stage,
                              param_dtype=args.ds.param_dtype, tensor_parallel_size=args.ds.tensor_parallel_size,
                              overlap_comm=args.ds.overlap_comm)
    cfg["train_micro_batch_size_per_gpu"] = args.train.micro_batch_size
    cfg["train_batch_size"] = args.train.batch_size * args.ds.ring_attn_size * args.ds.tensor_parallel_size
    for k in [k for k, v in cfg["zero_optimization"].items() if v == "auto"]:
        del cfg["zero_optimization"][k]  # "auto" is filled by HF's integration; DeepSpeed itself needs numbers
    ds = DeepSpeedConfig(cfg, mpu=DataParallelWorld(gpus))
    if ds.zero_optimization_stage >= 1:  # the plan prices the gradient reduction under the backward
        assert ds.zero_config.overlap_comm is True


def _module(relative: str) -> types.ModuleType:
    """One OpenRLHF source file loaded alone (its package __init__ imports flash-attn, a GPU build)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(relative.replace("/", "_"), Path(openrlhf.__file__).parent.parent / relative)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("path", EXPORTS, ids=ids(EXPORTS))
def test_openrlhf_runs_each_export_to_the_ray_launch(path, monkeypatch) -> None:  # noqa: ANN001
    doc = load(path)
    plan = plan_of(path)
    if "refused" in doc:
        assert all(c["kind"] != "generate" for c in plan["calls"]), f"an RLHF plan was refused: {doc['refused']}"
        return
    argv = words(doc["text"])
    assert argv[:3] == ["python3", "-m", "openrlhf.cli.train_ppo_ray"]
    seen = run_script(argv[3:], monkeypatch)
    world = plan["cluster"]["nodes"] * plan["cluster"]["gpus_per_node"]
    assert gpus_taken(seen) <= world, f"asks Ray for {gpus_taken(seen)} GPUs on a cluster of {world}"
    args = seen.args
    actor_gpus = args.actor.num_nodes * args.actor.num_gpus_per_node
    # DeepSpeed is initialised without an mpu: its world is the group's processes.
    ds_batch_ok(args, actor_gpus)
    if args.critic.model_name_or_path:
        ds_batch_ok(args, args.critic.num_nodes * args.critic.num_gpus_per_node)
    calls = {c["kind"] for c in plan["calls"]}
    assert "generate" in calls
    has_ref = any(c["kind"] == "inference" and c["returns"] == "logprobs" and not plan["models"][c["model"]]["trainable"]
                  for c in plan["calls"])
    assert (args.algo.kl.init_coef > 0) == has_ref
    assert seen.engines is not None and seen.engines["gpu_memory_utilization"] < 1


# The flags of OpenRLHF's examples/scripts/train_ppo_ray_hybrid_engine.sh (OpenRLHF v0.11.0; the
# scripts are not in the wheel), model and data names as there.
EXAMPLE = """
   --ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
   --critic.num_nodes 1 --critic.num_gpus_per_node 8 --actor.num_nodes 1 --actor.num_gpus_per_node 8
   --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.gpu_memory_utilization 0.5
   --actor.model_name_or_path OpenRLHF/Llama-3-8b-sft-mixture --reward.model_name_or_path OpenRLHF/Llama-3-8b-rm-700k
   --ckpt.output_dir /openrlhf/examples/test_scripts/final/llama3-8b-rlhf
   --ckpt.path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf --ckpt.save_hf
   --train.batch_size 128 --rollout.batch_size 1024 --rollout.n_samples_per_prompt 1 --train.max_epochs 1
   --data.max_len 2048 --data.max_samples 100000 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7
   --critic.adam.lr 9e-6 --algo.kl.init_coef 0.01 --data.prompt_dataset OpenRLHF/prompt-collection-v0.1
   --data.input_key context_messages --data.apply_chat_template --reward.normalize_enable
   --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager
   --vllm.enable_sleep --ds.enable_sleep --train.dynamic_batch_enable --train.max_tokens_per_gpu 16384
"""


def test_openrlhfs_example_script_imports_into_a_valid_plan(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    import json

    argv = EXAMPLE.split()
    seen = run_script(argv, monkeypatch)  # OpenRLHF 0.11.2 takes these flags
    assert gpus_taken(seen) == 8
    out = tmp_path / "example.json"
    r = planner("import", "--from", "openrlhf", " ".join(argv), "--model", "actor=llama-3-8b",
                "--model", "reward=llama-3-8b", "--cluster", "a100-80gb:1x8", "-o", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    said = " ".join(r.stdout.split())  # the console wraps long notes
    assert "not costed:" in said and "--ds.packing_samples" in said and "--train.dynamic_batch_enable" in said
    r = planner("validate", str(out))
    assert "not executable" not in r.stdout + r.stderr, r.stdout + r.stderr
    calls = {c["name"]: c for c in json.loads(out.read_text())["calls"]}
    args = seen.args
    gen = calls["actor_generate"]
    assert (gen["layout"]["dp"], gen["layout"]["tp"]) == (args.vllm.num_engines, args.vllm.tensor_parallel_size)
    assert gen["seqs"] == args.rollout.batch_size * args.rollout.n_samples_per_prompt
    train = calls["actor_train"]
    assert train["layout"]["zero"] == args.ds.zero_stage and len(train["mesh"]["ranks"]) == 8
    assert train["minibatches"] == args.rollout.batch_size // args.train.batch_size
    # and the actor's forward over its samples that the experience maker runs, on the actor's GPUs
    assert set(calls) == {"actor_generate", "actor_logprobs", "reward_inference", "ref_inference", "critic_inference",
                          "actor_train", "critic_train"}
    assert calls["actor_logprobs"]["mesh"] == train["mesh"]
    per = len(train["mesh"]["ranks"]) // (args.ds.ring_attn_size * args.ds.tensor_parallel_size)
    lp = calls["actor_logprobs"]["layout"]
    assert gen["seqs"] // (lp["dp"] * lp["micro_batches"]) == args.rollout.micro_batch_size and lp["dp"] == per


def test_the_importers_openrlhf_defaults_are_openrlhfs(monkeypatch) -> None:  # noqa: ANN001
    """Each default `planner import --from openrlhf` assumes for a flag left out is the one
    OpenRLHF 0.11.2's own parser gives it."""
    defaults = planner_table("OPENRLHF_DEFAULTS")
    seen = run_script(["--vllm.num_engines", "1", "--reward.remote_url", "r.py", "--algo.advantage.estimator",
                       "group_norm", "--rollout.n_samples_per_prompt", "2"], monkeypatch)
    given = {"vllm.num_engines": 1, "reward.remote_url": ["r.py"], "algo.advantage.estimator": "group_norm",
             "rollout.n_samples_per_prompt": 2}  # set here: group_norm needs more than one sample
    for key, want in defaults.items():
        if key in given:
            continue
        got = seen.args
        for part in key.split("."):
            got = getattr(got, part)
        assert got == want, f"--{key}: OpenRLHF's default is {got!r}, the importer assumes {want!r}"
