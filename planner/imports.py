"""The plan a user's own engine config amounts to: `planner import`.

Each importer reads a config in its engine's own terms, at the release its exporter targets, and
returns the graph and the placement (mesh and layout of every call) the engine would run, which
`planner.pinned.pinned_plan` costs like any plan:

- ``verl``: a verl 0.9 config (a YAML file, e.g. what ``main_ppo --cfg job`` prints, and/or Hydra
  overrides ``key=value``); keys it lacks take verl 0.9.1's defaults (`VERL_DEFAULTS`);
- ``openrlhf``: ``train_ppo_ray`` flags of OpenRLHF 0.11 (a string, or a script that runs it);
- ``megatron``: ``pretrain_gpt.py`` flags of Megatron-LM core_v0.19.0;
- ``deepspeed``: a DeepSpeed JSON config, with the model, sequence length and pipeline stages its
  job sets in code (``--model``, ``--seq-len``, ``--pp``).

Export then import gives back the plan's layouts wherever the export expressed them (its
`cannot_express` is empty); `tests/test_imports.py` checks that round trip for every target.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.algorithms import grpo, ppo, remax, rloo, sft
from planner.exports.deepspeed import UNFUSED_ACCUMULATION
from planner.pinned import Placement
from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.graph import Graph
from plans.layout import Layout, Mesh

SOURCES = ("verl", "openrlhf", "megatron", "deepspeed")


@dataclass
class Imported:
    """What an engine config amounts to: the graph, each call's placement, and what was assumed."""

    graph: Graph
    placements: dict[str, Placement]
    notes: list[str] = field(default_factory=list)
    framework: str | None = None  # the stack its training runs on, where the source's default is not it


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise PlannerError(f"{where} must be a whole number, got {value!r}")
    try:
        out = int(value)
        if float(value) != out:
            raise ValueError
    except (TypeError, ValueError):
        raise PlannerError(f"{where} must be a whole number, got {value!r}") from None
    return out


def _div(a: int, b: int, what: str) -> int:
    if b <= 0 or a % b:
        raise PlannerError(f"{what}: {a} does not split evenly by {b}",
                           hint="the engine would reject this config too; fix the batch or parallel sizes")
    return a // b


def _model(role: str, path: str | None, models: dict[str, str], where: str) -> str:
    """The model spec of a role: a --model ROLE=SPEC override, else the config's path when it is a
    preset or a local HF directory."""
    from plans.model import PRESETS

    if role in models:
        return models[role]
    if path and (path in PRESETS or Path(path).expanduser().joinpath("config.json").is_file()):
        return str(Path(path).expanduser()) if path not in PRESETS else path
    raise PlannerError(f"{where} names {path!r} for the {role}, which is neither a preset nor a local HF directory",
                       hint=f"give the model with --model {role}=PRESET_OR_DIRECTORY (e.g. --model {role}=llama-2-7b)")


def _zero(zero: int, dp: int) -> int:
    """`zero`, or 0 where `dp` (the data-parallel ranks times the context-parallel ones) is 1."""
    return zero if dp > 1 else 0


# The stack each source's config runs on, and so what its import is costed for (`Imported.framework`
# where the config says otherwise: verl's FSDP workers train HF models, its Megatron workers do not).
FRAMEWORK_OF = {"verl": "rlhf-engine", "openrlhf": "rlhf-engine-hf", "megatron": "megatron-core",
                "deepspeed": "megatron-core"}


def vllm_waves(graph: Graph, cluster: ClusterSpec, call: str, mesh: Mesh, layout: Layout, *, memory_share: float,
               max_num_seqs: int | None) -> tuple[Layout, str | None]:
    """The generate layout of a vLLM rollout: the fewest waves whose KV cache at the length cap fits
    vLLM's budget (`gpu_memory_utilization` of each GPU), the budget its scheduler then runs the
    engine's rows in (`cost_models.lengths.paged_schedule`, at most the stack's max_num_seqs at
    once); a note when even one sequence at a time does not fit, or when the config's
    `max_num_seqs` is not the one costed. vLLM's tensor parallelism splits every expert of a
    mixture of experts as it splits the dense MLP (its fused MoE layer shards the experts'
    intermediate dimension unless `--enable-expert-parallel`), so an MoE rollout's experts are
    split over tp (etp = tp)."""
    from cost_models import CostModel
    from planner.candidates import costed_view

    c = graph.call(call)
    if graph.models[c.model].spec.is_moe and layout.ep == 1:
        layout = layout.model_copy(update={"etp": layout.tp})
    view = costed_view(c, graph.models[c.model])
    cm = CostModel(cluster, framework="vllm")
    costed = cm.framework.max_num_seqs
    other = (f"{call}: costed with vLLM running at most {costed} sequences at once (max_num_seqs), where the config "
             f"sets {max_num_seqs}") if max_num_seqs is not None and max_num_seqs != costed else None
    per = c.seqs // layout.dp
    budget = memory_share * cluster.mem_bytes
    for mb in (m for m in range(1, per + 1) if per % m == 0):
        lay = layout.model_copy(update={"micro_batches": mb})
        if cm.call_cost(c, view, mesh, lay).peak_mem_bytes <= budget:
            return lay, other
    lay = layout.model_copy(update={"micro_batches": per})
    return lay, "; ".join(x for x in (f"{call}: not even one sequence per engine fits gpu_memory_utilization "
                                        f"{memory_share} as costed; costed one at a time", other) if x)


# ---- verl ------------------------------------------------------------------------------------

# verl 0.9.1's defaults for the keys the importer reads (verl/trainer/config/_generated_ppo_trainer.yaml
# and _generated_ppo_megatron_trainer.yaml of the PyPI wheel); None: verl requires the key.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024, "data.max_prompt_length": 512, "data.max_response_length": 512,
    "trainer.nnodes": 1, "trainer.n_gpus_per_node": 8,
    "actor_rollout_ref.model.path": None, "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.actor.strategy": "fsdp", "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1, "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.clip_ratio": 0.2, "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.temperature": 1.0, "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.max_num_seqs": 256,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None,
    "critic.enable": None, "critic.model.path": None, "critic.ppo_micro_batch_size_per_gpu": None,
    "critic.forward_micro_batch_size_per_gpu": None, "critic.optim.lr": 1e-5, "critic.cliprange_value": 0.5,
    "critic.ulysses_sequence_parallel_size": 1, "critic.model.enable_gradient_checkpointing": True,
    "algorithm.adv_estimator": "gae", "algorithm.gamma": 1.0, "algorithm.lam": 1.0,
    "algorithm.use_kl_in_reward": False, "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.rollout_correction.bypass_mode": False,
    "reward.reward_model.enable": False, "reward.reward_model.model_path": None,
    "reward.reward_model.enable_resource_pool": False, "reward.reward_model.nnodes": 0,
    "reward.reward_model.n_gpus_per_node": 8, "reward.reward_model.rollout.tensor_model_parallel_size": 2,
    "reward.custom_reward_function.path": None, "reward.custom_reward_function.name": "compute_score",
}
# The megatron engine block (engine/megatron.yaml), per role.
VERL_MEGATRON = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                 "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1, "sequence_parallel": True,
                 "use_distributed_optimizer": True, "use_megatron_fsdp": False, "param_offload": False,
                 "optimizer_offload": False}
VERL_ALGOS = {"gae": "ppo", "grpo": "grpo", "rloo": "rloo", "remax": "remax"}


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    node[parts[-1]] = value


def _get(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return _MISSING
        node = node[p]
    if isinstance(node, str) and ("${" in node or node == "???"):
        return _MISSING  # an unresolved interpolation or a required value: as if unset
    return node


_MISSING = object()


def verl_config(path: Path | None, overrides: list[str]) -> dict[str, Any]:
    """A verl config tree from a YAML file and Hydra-style overrides (``key=value``, ``+key=value``)."""
    import yaml

    tree: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as e:
            raise PlannerError(f"cannot read verl config {path}: {e}") from None
        if not isinstance(loaded, dict):
            raise PlannerError(f"verl config {path} is not a mapping of keys")
        tree = loaded
    for o in overrides:
        key, eq, text = o.lstrip("+~").partition("=")
        if not eq or not key:
            raise PlannerError(f"verl override {o!r} is not key=value", hint="e.g. trainer.n_gpus_per_node=8")
        _set(tree, key, yaml.safe_load(text) if text else None)
    return tree


def from_verl(tree: dict[str, Any], cluster: ClusterSpec, models: dict[str, str]) -> Imported:
    notes: list[str] = []

    def get(key: str, *, required: bool = False) -> Any:
        v = _get(tree, key)
        if v is _MISSING:
            v = VERL_DEFAULTS.get(key)
        if v is None and required:
            raise PlannerError(f"the verl config does not set {key}, which verl requires",
                               hint=f"add {key}=VALUE")
        return v

    def block(role: str) -> dict[str, Any]:
        out = dict(VERL_MEGATRON)
        for k in out:
            v = _get(tree, f"{role}.megatron.{k}")
            if v is not _MISSING:
                out[k] = v
        return out

    strategy = get("actor_rollout_ref.actor.strategy")
    if strategy not in ("fsdp", "fsdp2", "megatron"):
        raise PlannerError(f"actor_rollout_ref.actor.strategy {strategy!r}: the importer reads fsdp, fsdp2 and megatron")
    pool = _int(get("trainer.nnodes"), "trainer.nnodes") * _int(get("trainer.n_gpus_per_node"), "trainer.n_gpus_per_node")
    rm_on = bool(get("reward.reward_model.enable"))
    rm_pool = None
    if rm_on and get("reward.reward_model.enable_resource_pool"):
        size = _int(get("reward.reward_model.nnodes"), "reward.reward_model.nnodes") * \
            _int(get("reward.reward_model.n_gpus_per_node"), "reward.reward_model.n_gpus_per_node")
        rm_pool = Mesh.block(pool, size)
    need = pool + (rm_pool.size if rm_pool else 0)
    if need > cluster.world_size:
        raise PlannerError(f"the verl config asks for {need} GPUs; the cluster has {cluster.world_size}",
                           hint="give the cluster it runs on with --cluster")
    prompts = _int(get("data.train_batch_size"), "data.train_batch_size")
    n = _int(get("actor_rollout_ref.rollout.n"), "actor_rollout_ref.rollout.n")
    adv = get("algorithm.adv_estimator")
    if adv not in VERL_ALGOS:
        raise PlannerError(f"algorithm.adv_estimator {adv!r}: the planner costs {', '.join(VERL_ALGOS)}")
    algo = VERL_ALGOS[adv]
    critic_on = get("critic.enable")
    critic_on = (adv == "gae") if critic_on is None else bool(critic_on)
    if critic_on != (algo == "ppo"):
        raise PlannerError(f"a critic {'with' if critic_on else 'without'} adv_estimator {adv!r}: the planner's "
                           f"{algo} graph {'has' if algo == 'ppo' else 'has no'} critic")
    use_kl_loss = bool(get("actor_rollout_ref.actor.use_kl_loss"))
    ref_on = bool(get("algorithm.use_kl_in_reward")) or use_kl_loss
    if not ref_on:
        notes.append("the config has no reference model (no KL term); the planner's graph computes reference "
                     "log-probs, so they are costed")
    mini = _int(get("actor_rollout_ref.actor.ppo_mini_batch_size"), "actor_rollout_ref.actor.ppo_mini_batch_size")
    minibatches = _div(prompts, mini, "data.train_batch_size over actor.ppo_mini_batch_size")
    epochs = _int(get("actor_rollout_ref.actor.ppo_epochs"), "actor_rollout_ref.actor.ppo_epochs")
    if epochs != 1:
        notes.append(f"ppo_epochs={epochs}: the planner costs one pass over each mini-batch")
    actor = _model("actor", get("actor_rollout_ref.model.path"), models, "actor_rollout_ref.model.path")
    # verl recomputes the actor's log-probs before training (ray_trainer's _compute_old_log_prob)
    # unless bypass mode takes the rollout's.
    recompute = not get("algorithm.rollout_correction.bypass_mode")
    kw: dict[str, Any] = dict(batch=prompts if algo != "ppo" else prompts * n, policy_logprobs=recompute,
                              prompt_len=_int(get("data.max_prompt_length"), "data.max_prompt_length"),
                              gen_len=_int(get("data.max_response_length"), "data.max_response_length"),
                              ppo_minibatches=minibatches, name="verl_import", clip_eps=float(get(
                                  "actor_rollout_ref.actor.clip_ratio")),
                              lr=float(get("actor_rollout_ref.actor.optim.lr")), gamma=float(get("algorithm.gamma")),
                              lam=float(get("algorithm.lam")))
    if rm_on:
        kw["reward"] = _model("reward", get("reward.reward_model.model_path"), models, "reward.reward_model.model_path")
    else:
        fpath = get("reward.custom_reward_function.path")
        fname = get("reward.custom_reward_function.name") or "compute_score"
        module = (str(fpath)[:-3] if str(fpath).endswith(".py") else str(fpath)).strip("/").replace("/", ".") \
            if fpath else "verl.utils.reward_score"
        kw["reward_fn"] = f"{module}:{fname if fpath else 'default_compute_score'}"
    if algo == "ppo":
        if n != 1:
            raise PlannerError(f"actor_rollout_ref.rollout.n={n} with gae: the planner's PPO draws one sample per prompt")
        kw["critic"] = _model("critic", get("critic.model.path"), models, "critic.model.path")
        kw["value_clip_eps"] = float(get("critic.cliprange_value"))
        kw["kl_coef"] = float(get("algorithm.kl_ctrl.kl_coef"))
        graph = ppo(actor, **kw)
    else:
        kw["kl_coef"] = float(get("actor_rollout_ref.actor.kl_loss_coef") if use_kl_loss else
                              get("algorithm.kl_ctrl.kl_coef"))
        if algo == "remax":
            graph = remax(actor, **kw)
        else:
            graph = (grpo if algo == "grpo" else rloo)(actor, samples_per_prompt=n, **kw)
    mesh = Mesh.block(0, pool)
    rows = prompts * n

    def offloads(role: str, what: str) -> bool:
        """Whether a worker keeps `what` (``optimizer`` or ``param``) in host memory between calls."""
        if strategy == "megatron":
            return bool(block(role)[f"{what}_offload"])
        engine = "fsdp" if role == "critic" else "fsdp_config"  # verl 0.9's keys of the FSDP workers
        return _get(tree, f"{role}.{engine}.{what}_offload") is True

    def train_layout(role: str, micro_key: str, gc_key: str) -> Layout:
        micro = _int(get(micro_key, required=True), micro_key)
        rc = "full" if get(gc_key) else "none"
        off = "optimizer" if offloads(role, "optimizer") else "none"
        if strategy == "megatron":
            b = block(role)
            tp, pp, cp = (_int(b[k], f"{role}.megatron.{k}") for k in
                          ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
            dp = _div(pool, tp * pp * cp, f"{role}: {pool} GPUs over tp x pp x cp")
            zero = 3 if b["use_megatron_fsdp"] else (1 if b["use_distributed_optimizer"] else 0)
            vpp = b["virtual_pipeline_model_parallel_size"]
            return Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=_zero(zero, dp * cp), interleave=_int(vpp, "vpp") if vpp else 1,
                          micro_batches=_div(rows // minibatches, dp * micro, f"{role} mini-batch over dp x micro"),
                          recompute=rc, sequence_parallel=bool(b["sequence_parallel"]) and tp > 1, offload=off)
        sp = _int(get(f"{role}.ulysses_sequence_parallel_size"), f"{role}.ulysses_sequence_parallel_size")
        dp = _div(pool, sp, f"{role}: {pool} GPUs over the Ulysses size")
        return Layout(dp=dp, cp=sp, zero=_zero(3, dp * sp), recompute=rc, offload=off,
                      micro_batches=_div(rows // minibatches, dp * micro, f"{role} mini-batch over dp x micro"))

    def forward_layout(role: str, micro: int, on: Mesh, cp: int = 1) -> Layout:
        """A forward-only call's layout: the worker's tp and pp (Megatron) or its FSDP sharding,
        over `cp` context-parallel ranks (the actor worker's own, for its log-probs)."""
        if strategy == "megatron":
            b = block(role)
            tp, pp = _int(b["tensor_model_parallel_size"], "tp"), _int(b["pipeline_model_parallel_size"], "pp")
        else:
            tp = pp = 1
        dp = _div(on.size, tp * pp * cp, f"{role}: {on.size} GPUs over tp x pp x cp")
        # verl's FSDP workers shard every model they hold, the reference included (ZeRO-3).
        zero = _zero(3, dp * cp) if strategy != "megatron" else 0
        return Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero,
                      micro_batches=_div(rows, dp * micro, f"{role} batch over dp x micro"))

    rtp = _int(get("actor_rollout_ref.rollout.tensor_model_parallel_size"), "rollout.tensor_model_parallel_size")
    gen, why = vllm_waves(graph, cluster, "actor_generate", mesh, Layout(dp=_div(pool, rtp, "rollout GPUs over its tp"),
                                                                        tp=rtp),
                          memory_share=float(get("actor_rollout_ref.rollout.gpu_memory_utilization")),
                          max_num_seqs=_int(get("actor_rollout_ref.rollout.max_num_seqs"), "rollout.max_num_seqs"))
    notes += [why] if why else []
    placements: dict[str, Placement] = {
        "actor_generate": (mesh, gen, None),
        "actor_train": (mesh, train_layout("actor_rollout_ref.actor", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                                           "actor_rollout_ref.model.enable_gradient_checkpointing"), None),
    }
    if recompute:  # on the actor worker: its tp, pp and cp (verl builds one engine for both)
        at = placements["actor_train"][1]
        lp_key = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
        lp_micro = get(lp_key)
        if lp_micro is None:  # verl requires it unless batches are sized by tokens (use_dynamic_bsz)
            lp_micro = get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", required=True)
            notes.append(f"{lp_key} is not set: the actor's log-prob pass is costed at the training micro-batch")
        placements["actor_logprobs"] = (mesh, forward_layout("actor_rollout_ref.actor", _int(lp_micro, lp_key), mesh,
                                                             cp=at.cp), None)
    else:
        notes.append("algorithm.rollout_correction.bypass_mode: the rollout's log-probs are the PPO ratio's, so "
                     "the actor runs no forward pass over the samples")
    ref_micro = get("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu") if ref_on else None
    if ref_micro is None:
        ref_micro = get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", required=True)
    ref_layout = forward_layout("actor_rollout_ref.ref", _int(ref_micro, "ref micro"), mesh)
    if offloads("actor_rollout_ref.ref", "param"):
        ref_layout = ref_layout.model_copy(update={"offload": "weights"})
    placements["ref_inference"] = (mesh, ref_layout, None)
    if algo == "ppo":
        placements["critic_train"] = (mesh, train_layout("critic", "critic.ppo_micro_batch_size_per_gpu",
                                                         "critic.model.enable_gradient_checkpointing"), None)
        fwd = get("critic.forward_micro_batch_size_per_gpu") if strategy != "megatron" else None
        fwd = fwd if fwd is not None else get("critic.ppo_micro_batch_size_per_gpu", required=True)
        placements["critic_inference"] = (mesh, forward_layout("critic", _int(fwd, "critic forward micro"), mesh), None)
    if rm_on:
        on = rm_pool or mesh
        rtp_rm = _int(get("reward.reward_model.rollout.tensor_model_parallel_size"), "reward rollout tp")
        placements["reward_inference"] = (on, Layout(dp=_div(on.size, rtp_rm, "reward GPUs over its tp"), tp=rtp_rm),
                                          None)
    return Imported(graph, placements, notes, framework="rlhf-engine" if strategy == "megatron" else "verl-fsdp")


# ---- OpenRLHF --------------------------------------------------------------------------------

# OpenRLHF 0.11.2 train_ppo_ray flags the importer reads, with their defaults (openrlhf/cli/train_ppo_ray.py).
OPENRLHF_DEFAULTS: dict[str, Any] = {
    "actor.num_nodes": 1, "actor.num_gpus_per_node": 8, "ref.num_nodes": 1, "ref.num_gpus_per_node": 8,
    "critic.num_nodes": 1, "critic.num_gpus_per_node": 8, "reward.num_nodes": 1, "reward.num_gpus_per_node": 8,
    "vllm.num_engines": None, "vllm.tensor_parallel_size": 1, "train.colocate_all": False,
    "train.colocate_actor_ref": False, "train.colocate_critic_reward": False, "ds.zero_stage": 2, "ds.overlap_comm": False,
    "ds.tensor_parallel_size": 1, "ds.ring_attn_size": 1, "actor.gradient_checkpointing_enable": False,
    "train.micro_batch_size": 1, "train.batch_size": 128, "rollout.micro_batch_size": 1, "rollout.batch_size": 1024,
    "rollout.n_samples_per_prompt": 1, "data.max_len": 2048, "rollout.max_new_tokens": None,
    "rollout.temperature": 1.0, "actor.model_name_or_path": None, "critic.model_name_or_path": None,
    "reward.model_name_or_path": None, "reward.remote_url": None, "actor.adam.lr": 1e-6, "critic.adam.lr": 9e-6,
    "actor.eps_clip": 0.2, "critic.value_clip": 0.5, "algo.advantage.gamma": 1.0, "algo.advantage.lambd": 1.0,
    "algo.kl.init_coef": 0.01, "algo.advantage.estimator": "gae", "ds.enable_sleep": False,
    "vllm.enable_sleep": False, "vllm.gpu_memory_utilization": 0.95, "ds.adam_offload": False, "ref.offload": False,
    "reward.offload": False,
}
OPENRLHF_ALGOS = {"gae": "ppo", "group_norm": "grpo", "rloo": "rloo"}
# Flags that change time or memory in ways the import does not model.
OPENRLHF_UNCOSTED = ("train.dynamic_batch_enable", "ds.packing_samples", "train.async_enable", "ds.lora.rank",
                     "ds.enable_sleep")


def command_words(source: str) -> list[str]:
    """Words of a command given inline or as a script file (comments dropped, continuations
    joined, everything before the first ``--flag`` (program, environment) left out)."""
    text = source
    try:
        is_file = "\n" not in source and not source.lstrip().startswith("-") and Path(source).is_file()
    except (OSError, ValueError):  # flags too long for a file name: not a file
        is_file = False
    if is_file:
        try:
            text = Path(source).read_text()
        except OSError as e:
            raise PlannerError(f"cannot read {source}: {e}") from None
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    try:
        words = shlex.split(body.replace("\\\n", " "))
    except ValueError as e:
        raise PlannerError(f"cannot split the command into words: {e}") from None
    first = next((i for i, w in enumerate(words) if w.startswith("--")), len(words))
    return words[first:]


def flag_values(words: list[str]) -> dict[str, Any]:
    """``--name value`` pairs (a name with no value is a switch: True; several values: a list)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("--"):
            raise PlannerError(f"unexpected word {w!r} in the flags", hint="quote the command as one string")
        name, eq, inline = w[2:].partition("=")
        vals = [inline] if eq else []
        i += 1
        while not eq and i < len(words) and not (words[i].startswith("--") and len(words[i]) > 2):
            vals.append(words[i])
            i += 1
        out[name] = True if not vals else (vals[0] if len(vals) == 1 else vals)
    return out


def from_openrlhf(words: list[str], cluster: ClusterSpec, models: dict[str, str], *,
                  prompt_len: int | None = None) -> Imported:
    given = flag_values(words)
    unknown = sorted(k for k in given if k not in OPENRLHF_DEFAULTS and "." not in k)
    if unknown:
        raise PlannerError(f"OpenRLHF 0.11 has no flags {', '.join('--' + u for u in unknown)} (its flags are dotted: "
                           "--actor.num_nodes, --train.batch_size, ...)",
                           hint="flags from OpenRLHF before 0.11 were renamed; see openrlhf/cli/train_ppo_ray.py")
    notes: list[str] = []

    def get(key: str) -> Any:
        return given.get(key, OPENRLHF_DEFAULTS[key])

    def gpus(role: str) -> int:
        return _int(get(f"{role}.num_nodes"), f"--{role}.num_nodes") * \
            _int(get(f"{role}.num_gpus_per_node"), f"--{role}.num_gpus_per_node")

    uncosted = [f"--{k}" for k in OPENRLHF_UNCOSTED if given.get(k)]
    if uncosted:
        notes.append(f"not costed: {', '.join(uncosted)} (the plan costs fixed micro-batches, no packing, LoRA or "
                     "sleep between phases)")
    est = get("algo.advantage.estimator")
    if est not in OPENRLHF_ALGOS:
        raise PlannerError(f"--algo.advantage.estimator {est}: the planner costs {', '.join(OPENRLHF_ALGOS)}")
    algo = OPENRLHF_ALGOS[est]
    kl = float(get("algo.kl.init_coef"))
    if kl <= 0:
        notes.append("--algo.kl.init_coef 0: OpenRLHF runs no reference model; the planner's graph costs one")
    engines = get("vllm.num_engines")
    if engines in (None, 0, "0"):
        raise PlannerError("--vllm.num_engines is not set: OpenRLHF then generates with the DeepSpeed actor, which "
                           "the importer does not cost", hint="set --vllm.num_engines and --vllm.tensor_parallel_size")
    vtp = _int(get("vllm.tensor_parallel_size"), "--vllm.tensor_parallel_size")
    n_eng = _int(engines, "--vllm.num_engines")
    colocate = bool(get("train.colocate_all"))
    a = gpus("actor")
    groups: dict[str, Mesh] = {}
    if colocate:
        for role in ("actor", "ref", "critic", "reward", "vllm"):
            groups[role] = Mesh.block(0, a)
        if n_eng * vtp != a:
            raise PlannerError(f"--train.colocate_all with {n_eng} engines x tp {vtp} on {a} actor GPUs: OpenRLHF "
                               "asserts they are equal")
    else:
        nxt = 0

        def take(size: int) -> Mesh:
            nonlocal nxt
            m = Mesh.block(nxt, size)
            nxt += size
            return m

        groups["actor"] = take(a)
        groups["ref"] = groups["actor"] if get("train.colocate_actor_ref") else take(gpus("ref"))
        if algo == "ppo":
            groups["critic"] = take(gpus("critic"))
        has_rm = get("reward.model_name_or_path") is not None
        if has_rm:
            groups["reward"] = groups["critic"] if get("train.colocate_critic_reward") and "critic" in groups \
                else take(gpus("reward"))
        groups["vllm"] = take(n_eng * vtp)
        if nxt > cluster.world_size:
            raise PlannerError(f"the OpenRLHF flags ask Ray for {nxt} GPUs; the cluster has {cluster.world_size}",
                               hint="give the cluster it runs on with --cluster, or colocate (--train.colocate_all)")
        notes.append("GPU positions of the groups are Ray's choice; the import places them one after another")
    tp, ring = _int(get("ds.tensor_parallel_size"), "--ds.tensor_parallel_size"), \
        _int(get("ds.ring_attn_size"), "--ds.ring_attn_size")
    samples_per = _int(get("rollout.n_samples_per_prompt"), "--rollout.n_samples_per_prompt")
    prompts = _int(get("rollout.batch_size"), "--rollout.batch_size")
    rows = prompts * samples_per
    train_batch = _int(get("train.batch_size"), "--train.batch_size")
    minibatches = _div(rows, train_batch, "rollout samples over --train.batch_size")
    max_len = _int(get("data.max_len"), "--data.max_len")
    max_new = get("rollout.max_new_tokens")
    if max_new is None:
        # OpenRLHF then generates up to --data.max_len after each prompt.
        prompt_len = prompt_len or max_len // 2
        notes.append(f"--rollout.max_new_tokens is not set: responses fill --data.max_len {max_len} after the prompt; "
                     f"costed with prompts of {prompt_len} tokens (--prompt-len)")
        gen_len = max_len - prompt_len
    else:
        gen_len = _int(max_new, "--rollout.max_new_tokens")
        prompt_len = max_len - gen_len
    if prompt_len < 1 or gen_len < 1:
        raise PlannerError(f"--data.max_len {max_len} leaves no room for prompts and responses",
                           hint="set --rollout.max_new_tokens below --data.max_len")
    actor = _model("actor", get("actor.model_name_or_path"), models, "--actor.model_name_or_path")
    # The experience maker runs the actor over the samples for their log-probs (always, in 0.11).
    kw: dict[str, Any] = dict(prompt_len=prompt_len, gen_len=gen_len, ppo_minibatches=minibatches, policy_logprobs=True,
                              name="openrlhf_import", lr=float(get("actor.adam.lr")), clip_eps=float(get("actor.eps_clip")),
                              gamma=float(get("algo.advantage.gamma")), lam=float(get("algo.advantage.lambd")),
                              kl_coef=kl)
    if get("reward.model_name_or_path") is not None:
        kw["reward"] = _model("reward", get("reward.model_name_or_path"), models, "--reward.model_name_or_path")
    else:
        url = get("reward.remote_url")
        if not url:
            raise PlannerError("no --reward.model_name_or_path and no --reward.remote_url: OpenRLHF needs one")
        module = str(url)[:-3].strip("/").replace("/", ".") if str(url).endswith(".py") else "openrlhf_remote_rm"
        kw["reward_fn"] = f"{module}:reward_func"
    if algo == "ppo":
        if samples_per != 1:
            raise PlannerError(f"--rollout.n_samples_per_prompt {samples_per} with gae: the planner's PPO draws one sample")
        # OpenRLHF's default critic: the reward model's checkpoint (the actor's with a remote reward).
        path = get("critic.model_name_or_path")
        source = "critic"
        if path is None:
            source = "actor" if get("reward.remote_url") else "reward"
            path = get(f"{source}.model_name_or_path")
        if "critic" not in models and source in models:
            models = {**models, "critic": models[source]}
        kw["critic"] = _model("critic", path, models, "--critic.model_name_or_path")
        kw["value_clip_eps"] = float(get("critic.value_clip"))
        graph = ppo(actor, batch=rows, **kw)
    else:
        graph = (grpo if algo == "grpo" else rloo)(actor, batch=prompts, samples_per_prompt=samples_per, **kw)
    micro = _int(get("train.micro_batch_size"), "--train.micro_batch_size")
    roll = _int(get("rollout.micro_batch_size"), "--rollout.micro_batch_size")
    rc = "full" if get("actor.gradient_checkpointing_enable") else "none"
    zero = _int(get("ds.zero_stage"), "--ds.zero_stage")
    if zero in (1, 2) and not get("ds.overlap_comm"):
        notes.append("--ds.overlap_comm is not set: DeepSpeed then reduces the gradients after the backward at ZeRO "
                     f"{zero} (it overlaps them by default at stage 3 alone), where the plan costs them under it: "
                     "this command trains slower than costed. Add --ds.overlap_comm (planner export sets it)")

    # Optimizer states in host memory between calls (DeepSpeed also steps Adam on the CPU, which
    # the plan does not cost).
    opt_offload = bool(get("ds.adam_offload"))
    if opt_offload:
        notes.append("--ds.adam_offload: costed as optimizer states in host memory copied to the GPU for each "
                     "call; DeepSpeed steps Adam on the CPU instead (slower than costed)")

    def train(role: str) -> Layout:
        m = groups[role]
        dp = _div(m.size, tp * ring, f"{role}: {m.size} GPUs over ds tp x ring")
        return Layout(dp=dp, tp=tp, cp=ring, zero=_zero(zero, dp * ring), recompute=rc,
                      micro_batches=_div(train_batch, dp * micro, f"{role}: --train.batch_size over dp x micro"),
                      offload="optimizer" if opt_offload else "none")

    def forward(role: str, *, offload: bool = False) -> Layout:
        m = groups[role]
        dp = _div(m.size, tp, f"{role}: {m.size} GPUs over ds tp")
        # OpenRLHF's forward-only models take ZeRO-3 when training does, else none (get_ds_eval_config).
        return Layout(dp=dp, tp=tp, zero=_zero(3 if zero == 3 else 0, dp),
                      micro_batches=_div(rows, dp * roll, f"{role}: samples over dp x --rollout.micro_batch_size"),
                      offload="weights" if offload else "none")

    gen, why = vllm_waves(graph, cluster, "actor_generate", groups["vllm"], Layout(dp=n_eng, tp=vtp),
                          memory_share=float(get("vllm.gpu_memory_utilization")), max_num_seqs=None)
    notes += [why] if why else []
    # The actor's log-probs: its training engine (tp, ring, the weights sharded at ZeRO-3 only) in
    # --rollout.micro_batch_size batches.
    at = train("actor")
    lp = at.model_copy(update={"recompute": "none", "offload": "none", "zero": 3 if at.zero == 3 else 0, "micro_batches": _div(
        rows, at.dp * roll, "actor: samples over dp x --rollout.micro_batch_size")})
    placements: dict[str, Placement] = {
        "actor_generate": (groups["vllm"], gen, None),
        "actor_logprobs": (groups["actor"], lp, None),
        "actor_train": (groups["actor"], at, None),
        "ref_inference": (groups["ref"], forward("ref", offload=bool(get("ref.offload"))), None),
    }
    if algo == "ppo":
        placements["critic_train"] = (groups["critic"], train("critic"), None)
        placements["critic_inference"] = (groups["critic"], forward("critic"), None)
    if "reward" in kw:
        placements["reward_inference"] = (groups["reward"], forward("reward", offload=bool(get("reward.offload"))), None)
    return Imported(graph, placements, notes)


# ---- Megatron-LM and DeepSpeed (one training job) ----------------------------------------------

def _megatron_spec(f: dict[str, Any]) -> dict[str, Any]:
    need = ("num-layers", "hidden-size", "num-attention-heads", "vocab-size")
    missing = [k for k in need if k not in f]
    if missing:
        raise PlannerError(f"the Megatron-LM flags lack {', '.join('--' + k for k in missing)} to describe the model",
                           hint="give the model with --model model=PRESET_OR_DIRECTORY")
    heads = _int(f["num-attention-heads"], "--num-attention-heads")
    llama = f.get("normalization") == "RMSNorm" and f.get("swiglu") is True
    spec: dict[str, Any] = {
        "model_type": "llama" if llama else "gpt", "hidden_size": _int(f["hidden-size"], "--hidden-size"),
        "num_hidden_layers": _int(f["num-layers"], "--num-layers"), "num_attention_heads": heads,
        "vocab_size": _int(f["vocab-size"], "--vocab-size"),
        "tie_word_embeddings": "untie-embeddings-and-output-weights" not in f,
    }
    if "ffn-hidden-size" in f:
        spec["intermediate_size"] = _int(f["ffn-hidden-size"], "--ffn-hidden-size")
    if "max-position-embeddings" in f:
        spec["max_position_embeddings"] = _int(f["max-position-embeddings"], "--max-position-embeddings")
    if f.get("group-query-attention"):
        spec["num_key_value_heads"] = _int(f.get("num-query-groups", heads), "--num-query-groups")
    if llama:
        spec["rms_norm_eps"] = float(f.get("norm-epsilon", 1e-5))
        spec["rope_theta"] = float(f.get("rotary-base", 10000))
        spec["attention_bias"] = bool(f.get("add-qkv-bias", False))
        spec.update(_megatron_positions(f))
    else:
        spec["layer_norm_epsilon"] = float(f.get("norm-epsilon", 1e-5))
    return spec


def _megatron_positions(f: dict[str, Any]) -> dict[str, Any]:
    """RoPE scaling and the sliding window of Megatron-LM's flags (the inverse of
    `planner.exports.megatron.position_flags`)."""
    from planner.exports.megatron import MEGATRON_LLAMA3

    out: dict[str, Any] = {}
    if f.get("use-rope-scaling"):
        factor = float(f.get("rope-scaling-factor", 8.0))
        out["rope_scaling"] = {"rope_type": "llama3", "factor": factor, **MEGATRON_LLAMA3}
    elif "rotary-seq-len-interpolation-factor" in f:
        factor = _int(f["rotary-seq-len-interpolation-factor"], "--rotary-seq-len-interpolation-factor")
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    if f.get("position-embedding-type") == "yarn":
        raise PlannerError("--position-embedding-type yarn is not imported (YaRN from Megatron-LM's flags)",
                           hint="give the model with --model model=DIRECTORY (its config.json's rope_scaling)")
    if "window-size" in f:
        parts = str(f["window-size"]).strip("()").split(",")
        if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise PlannerError(f"--window-size {f['window-size']!r} is not two integers (left,right)")
        left, right = (int(p) for p in parts)
        if right != 0 or left < 0:
            raise PlannerError(f"--window-size {f['window-size']!r}: only causal windows (left,0) are supported",
                               hint="a window of W positions, itself included, is --window-size W-1,0")
        out["sliding_window"] = left + 1
    return out


def from_megatron(words: list[str], cluster: ClusterSpec, models: dict[str, str], *, world: int | None) -> Imported:
    from plans.model import resolve_model

    f = flag_values(words)
    size = world or cluster.world_size
    model = resolve_model(models["model"]) if "model" in models else resolve_model(_megatron_spec(f))
    tp, pp, cp = (_int(f.get(k, 1), "--" + k) for k in
                  ("tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size"))
    dp = _div(size, tp * pp * cp, f"{size} GPUs over tp x pp x cp")
    gbs = _int(f.get("global-batch-size", dp * _int(f.get("micro-batch-size", 1), "--micro-batch-size")),
               "--global-batch-size")
    micro = _int(f.get("micro-batch-size", 1), "--micro-batch-size")
    seq = _int(f.get("seq-length", 0), "--seq-length")
    if seq < 1:
        raise PlannerError("the Megatron-LM flags lack --seq-length")
    layers = model.num_hidden_layers
    interleave = 1
    if "num-layers-per-virtual-pipeline-stage" in f:
        interleave = _div(layers, pp * _int(f["num-layers-per-virtual-pipeline-stage"], "vpp layers"),
                          "layers over pp x layers per virtual stage")
    elif "num-virtual-stages-per-pipeline-rank" in f:
        interleave = _int(f["num-virtual-stages-per-pipeline-rank"], "--num-virtual-stages-per-pipeline-rank")
    zero = 3 if f.get("use-megatron-fsdp") else (1 if f.get("use-distributed-optimizer") else 0)
    rc = {"full": "full", "selective": "selective"}.get(str(f.get("recompute-granularity", "")), "none")
    lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=_zero(zero, dp * cp), interleave=interleave, recompute=rc,
                 sequence_parallel=bool(f.get("sequence-parallel")) and tp > 1,
                 micro_batches=_div(gbs, dp * micro, "--global-batch-size over dp x --micro-batch-size"))
    graph = sft(model, batch=gbs, seq_len=seq, name="megatron_import", lr=float(f.get("lr", 1e-5)))
    return Imported(graph, {"model_train": (Mesh.block(0, size), lay, None)}, _megatron_costing_notes(f, dp=dp, tp=tp))


def _megatron_costing_notes(f: dict[str, Any], *, dp: int, tp: int) -> list[str]:
    """Where the command's flags run differently from the `megatron-core` stack it is costed with:
    that stack reduces fp32 gradients in buckets under the backward, leaves the weight gather and
    the tensor-parallel collectives unoverlapped and runs Megatron's unfused cross entropy
    (`cost_models.framework`)."""
    notes = []
    if dp > 1 and not f.get("overlap-grad-reduce"):
        notes.append("--overlap-grad-reduce is not set: Megatron-LM then reduces the gradients after the backward, "
                     "exposed, while the plan costs that reduction overlapped with it (the megatron-core stack); "
                     "this command runs slower than costed. Add --overlap-grad-reduce (planner export sets it)")
    if dp > 1 and f.get("grad-reduce-in-bf16"):
        notes.append("--grad-reduce-in-bf16: costed with fp32 gradients (Megatron-LM's default under --bf16); "
                     "this command reduces half the bytes and holds 2 fewer bytes per weight")
    if dp > 1 and f.get("overlap-param-gather") and f.get("use-distributed-optimizer"):
        notes.append("--overlap-param-gather: costed with the distributed optimizer's weight gather after the step, "
                     "not under the next forward; this command runs faster than costed")
    if f.get("no-gradient-accumulation-fusion"):
        notes.append("--no-gradient-accumulation-fusion: costed with each micro-batch's weight gradients added by "
                     "their GEMMs into the fp32 buffer (Megatron-LM's default); this command adds them by kernels of "
                     "their own and runs slower than costed")
    if tp > 1 and f.get("tp-comm-overlap"):
        notes.append("--tp-comm-overlap: costed with the tensor-parallel collectives beside their GEMMs, not "
                     "pipelined with them; this command runs faster than costed")
    if f.get("cross-entropy-loss-fusion"):
        notes.append("--cross-entropy-loss-fusion: costed with Megatron's unfused vocab-parallel cross entropy (its "
                     "default: six passes over the fp32 logits forward, two backward); this command fuses them and "
                     "runs faster than costed")
    return notes


def from_deepspeed(cfg: dict[str, Any], cluster: ClusterSpec, models: dict[str, str], *, world: int | None,
                   seq_len: int | None, pp: int) -> Imported:
    if "model" not in models or seq_len is None:
        raise PlannerError("a DeepSpeed config does not describe the model or the sequences",
                           hint="give them with --model model=PRESET_OR_DIRECTORY and --seq-len N")
    size = world or cluster.world_size
    tp = _int(cfg.get("tensor_parallel", {}).get("autotp_size", 1) or 1, "tensor_parallel.autotp_size")
    cp = _int(cfg.get("sequence_parallel_size", 1), "sequence_parallel_size")
    dp = _div(size, tp * pp * cp, f"{size} GPUs over tp x pp x cp")
    micro = _int(cfg.get("train_micro_batch_size_per_gpu", 1), "train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps")
    batch = cfg.get("train_batch_size")
    counted = dp * (tp if pp == 1 else 1)  # DeepSpeed's world for the batch check (see planner.exports.deepspeed)
    if batch is None:
        batch = micro * _int(gas or 1, "gradient_accumulation_steps") * counted
    batch = _int(batch, "train_batch_size")
    gas = _int(gas, "gradient_accumulation_steps") if gas is not None else _div(batch, micro * counted, "train_batch_size")
    if batch != micro * gas * counted:
        raise PlannerError(f"train_batch_size {batch} != micro {micro} x accumulation {gas} x world {counted}: "
                           "DeepSpeed rejects this config")
    seqs = micro * gas * dp
    zero = _int(cfg.get("zero_optimization", {}).get("stage", 0), "zero_optimization.stage")
    lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=_zero(zero, dp * cp), micro_batches=gas)
    graph = sft(models["model"], batch=seqs, seq_len=seq_len, name="deepspeed_import",
                lr=float(cfg.get("optimizer", {}).get("params", {}).get("lr", 1e-5)))
    notes = ["activation checkpointing is set in model code: costed without it", UNFUSED_ACCUMULATION]
    overlap = cfg.get("zero_optimization", {}).get("overlap_comm")
    if dp * cp > 1 and (lay.zero == 0 or (lay.zero in (1, 2) and overlap is not True)):
        # `megatron-core` prices the reduction under the backward; DeepSpeed overlaps it only at
        # stage 3 unless told (`DeepSpeedZeroConfig.overlap_comm_valid`), and never without ZeRO.
        notes.append("the gradient reduction is costed under the backward, but DeepSpeed runs it after the backward "
                     + ("without ZeRO" if lay.zero == 0 else "unless zero_optimization.overlap_comm is true")
                     + ": this config runs slower than costed"
                     + ("" if lay.zero == 0 else ". Set overlap_comm (planner export does)"))
    return Imported(graph, {"model_train": (Mesh.block(0, size), lay, None)}, notes)


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlannerError(f"cannot read DeepSpeed config {path}: {e}") from None
    if not isinstance(data, dict):
        raise PlannerError(f"DeepSpeed config {path} is not a JSON object")
    return data
