"""Megatron-LM command lines for the train calls of a plan.

Target: Megatron-LM core_v0.19.0 (commit 5be9626709af2722333bf54797c954c09edeada3): flag names,
defaults and checks of ``megatron/training/arguments.py`` (``parse_args``, ``validate_args``,
``core_transformer_config_from_args``) at that tag, and the ``TransformerConfig`` /
``ModelParallelConfig`` checks of the megatron-core package. Megatron-LM trains one model with
one layout per job with the language-modelling loss, so each SFT train call of the plan becomes
one ``pretrain_gpt.py`` command; plans with other losses are refused (verl runs RLHF on Megatron
workers: ``--to verl``). ``make test-engines`` runs megatron-core's config checks on every export,
and Megatron-LM's own ``parse_args`` + ``validate_args`` when ``MEGATRON_LM_SRC`` names a source
tree at that tag.
"""

from __future__ import annotations

from typing import Any

from planner.exports.common import (
    Export,
    comment_block,
    common_limits,
    flags_dict,
    micro_batch_per_gpu,
    optimizer_batch,
    refuse,
    shell_command,
)
from plans.errors import PlannerError
from plans.model import ModelSpec
from plans.plan import Plan, PlanCall
from plans.sharding import stage_layers

VERSION = "Megatron-LM core_v0.19.0"
SOURCE = "NVIDIA/Megatron-LM megatron/training/arguments.py at core_v0.19.0 (5be9626709af2722333bf54797c954c09edeada3)"
PROGRAM = "torchrun $DISTRIBUTED_ARGS pretrain_gpt.py"


def model_flags(plan: Plan, call: PlanCall) -> list[tuple[str, Any]]:
    """The architecture of the call's model (HF config fields to Megatron's names)."""
    spec = plan.models[call.model].spec
    flags: list[tuple[str, Any]] = [
        ("--num-layers", spec.num_hidden_layers),
        ("--hidden-size", spec.hidden_size),
        ("--ffn-hidden-size", spec.intermediate_size),
        ("--num-attention-heads", spec.num_attention_heads),
    ]
    kv = spec.num_key_value_heads or spec.num_attention_heads
    if kv != spec.num_attention_heads:
        flags += [("--group-query-attention", None), ("--num-query-groups", kv)]
    flags += [("--seq-length", call.seq_len), ("--max-position-embeddings", spec.max_position_embeddings),
              ("--vocab-size", spec.vocab_size)]
    if spec.model_type == "llama":
        flags += [("--normalization", "RMSNorm"), ("--norm-epsilon", spec.rms_norm_eps), ("--swiglu", None),
                  ("--position-embedding-type", "rope"), ("--rotary-base", int(spec.rope_theta)),
                  ("--disable-bias-linear", None)]
        if spec.attention_bias:
            flags.append(("--add-qkv-bias", None))
        flags += position_flags(spec)
    else:
        flags += [("--normalization", "LayerNorm"), ("--norm-epsilon", spec.layer_norm_epsilon),
                  ("--position-embedding-type", "learned_absolute")]
    if spec.model_type == "llama" and spec.d_head * spec.num_attention_heads != spec.hidden_size:
        flags.append(("--kv-channels", spec.d_head))
    if spec.qk_norm == "head":  # Megatron's q/k layernorm normalises each head, as Qwen3's
        flags.append(("--qk-layernorm", None))
    flags += moe_flags(spec)
    if not spec.tied:
        flags.append(("--untie-embeddings-and-output-weights", None))
    # The planner's models train without dropout (as TRL, verl and OpenRLHF fine-tune); Megatron's
    # default is 0.1 for both.
    flags += [("--attention-dropout", 0.0), ("--hidden-dropout", 0.0)]
    return flags


# Megatron-Core's llama3 RoPE scaling takes only the factor; the rest is fixed in
# `RotaryEmbedding._apply_scaling` (megatron/core/models/common/embeddings/rotary_pos_embedding.py).
MEGATRON_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def position_flags(spec: ModelSpec) -> list[tuple[str, Any]]:
    """RoPE scaling and the sliding window in Megatron's terms (what they cannot say:
    `position_limits`). Llama 3.1's scaling is ``--use-rope-scaling``; linear scaling by a whole
    factor is ``--rotary-seq-len-interpolation-factor`` (positions divided by it, the same as
    dividing the frequencies); a window of W positions (itself included) is Transformer Engine's
    ``--window-size W-1,0`` (W-1 keys back, none ahead)."""
    flags = _rope_flags(spec)[0]
    if spec.sliding_window is not None:
        flags.append(("--window-size", f"{spec.sliding_window - 1},0"))
    return flags


def _rope_flags(spec: ModelSpec) -> tuple[list[tuple[str, Any]], str | None]:
    """The flags of the spec's RoPE scaling, or why Megatron-LM has none for it."""
    r = spec.rope_scaling
    if r is None:
        return [], None
    if r.rope_type == "llama3":
        fixed = (r.low_freq_factor, r.high_freq_factor, spec.rope_original_positions)
        if fixed == tuple(MEGATRON_LLAMA3.values()):
            return [("--use-rope-scaling", None), ("--rope-scaling-factor", r.factor)], None
        return [], (f"llama3 RoPE scaling with low_freq_factor {r.low_freq_factor}, high_freq_factor "
                    f"{r.high_freq_factor}, original context {spec.rope_original_positions}; Megatron-Core fixes "
                    "them at 1, 4 and 8192 (only --rope-scaling-factor is a flag)")
    if r.rope_type == "linear":
        if float(r.factor).is_integer():  # type: ignore[arg-type]
            return [("--rotary-seq-len-interpolation-factor", int(r.factor))], None  # type: ignore[arg-type]
        return [], f"linear RoPE scaling by {r.factor}; --rotary-seq-len-interpolation-factor takes whole numbers"
    return [], ("YaRN RoPE scaling is not exported (Megatron-LM's --position-embedding-type yarn was not checked "
                "against transformers' YaRN); set its --yarn-* flags by hand")


def position_limits(plan: Plan) -> list[str]:
    """RoPE scalings Megatron-LM's flags cannot express, per model."""
    return [f"{name}: {why}" for name, decl in plan.models.items() if (why := _rope_flags(decl.spec)[1])]


def moe_flags(spec: ModelSpec) -> list[tuple[str, Any]]:
    """A mixture of experts in Megatron-Core's terms: experts, top-k, expert width, which layers
    are sparse (`--moe-layer-freq` as a list pattern), the shared expert and its gate, and the
    router's normalisation (`--moe-router-pre-softmax`: softmax over all experts, then top-k,
    not renormalised, as Qwen-MoE and OLMoE with norm_topk_prob false; Megatron's default, softmax
    over the top-k logits, is the renormalised form of Mixtral and Qwen3). Tokens travel by
    all-to-all (the planner's cost model and runtime) through grouped GEMMs."""
    if not spec.is_moe:
        return []
    pattern = [int(spec.is_moe_layer(i)) for i in range(spec.num_hidden_layers)]
    flags: list[tuple[str, Any]] = [("--num-experts", spec.experts), ("--moe-router-topk", spec.num_experts_per_tok),
                                    ("--moe-ffn-hidden-size", spec.expert_ffn)]
    if not all(pattern):
        flags.append(("--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"))
    if spec.shared_expert_intermediate_size:
        flags.append(("--moe-shared-expert-intermediate-size", spec.shared_expert_intermediate_size))
        if spec.shared_expert_gate:
            flags.append(("--moe-shared-expert-gate", None))
    if not spec.norm_topk_prob:
        flags.append(("--moe-router-pre-softmax", None))
    flags += [("--moe-token-dispatcher-type", "alltoall"), ("--moe-grouped-gemm", None)]
    return flags


def parallel_flags(plan: Plan, call: PlanCall, limits: list[str], notes: list[str]) -> list[tuple[str, Any]]:
    """Parallel degrees, batch sizes, ZeRO and recompute of a train call."""
    lay = call.layout
    spec = plan.models[call.model].spec
    flags: list[tuple[str, Any]] = [
        ("--tensor-model-parallel-size", lay.tp),
        ("--pipeline-model-parallel-size", lay.pp),
        ("--context-parallel-size", lay.cp),
    ]
    if lay.sequence_parallel:
        flags.append(("--sequence-parallel", None))
    if spec.is_moe:
        flags += [("--expert-model-parallel-size", lay.ep), ("--expert-tensor-parallel-size", lay.etp)]
    layers = spec.num_hidden_layers
    if lay.interleave > 1:
        if layers % (lay.pp * lay.interleave):
            raise refuse("Megatron-LM", plan, f"{call.name}: {layers} layers do not split evenly into "
                         f"{lay.pp} x {lay.interleave} virtual pipeline stages, which Megatron-LM requires",
                         hint="pick a layout whose virtual stages divide the layers")
        flags.append(("--num-layers-per-virtual-pipeline-stage", layers // (lay.pp * lay.interleave)))
    elif layers % lay.pp:
        sizes = [len(s) for s in stage_layers(layers, lay.pp)]
        if len(set(sizes[1:])) == 1:  # only the first stage differs
            flags.append(("--decoder-first-pipeline-num-layers", sizes[0]))
        elif len(sizes) > 2 and len(set(sizes[1:-1])) == 1:  # the first and the last differ
            flags += [("--decoder-first-pipeline-num-layers", sizes[0]),
                      ("--decoder-last-pipeline-num-layers", sizes[-1])]
        else:
            raise refuse("Megatron-LM", plan, f"{call.name}: pipeline stages of {sizes} layers; Megatron-LM sets "
                         "only the first and the last stage apart from an even split",
                         hint="pick a pipeline size that divides the layers, or one where only the end stages differ")
    flags += [("--micro-batch-size", micro_batch_per_gpu(call)), ("--global-batch-size", optimizer_batch(call))]
    # The megatron-core stack the plan was costed for reduces gradients in buckets under the last
    # backward; Megatron-LM does so only when told.
    flags.append(("--overlap-grad-reduce", None))
    if lay.zero in (1, 2):
        flags.append(("--use-distributed-optimizer", None))
        if lay.zero == 2:
            limits.append(f"{call.name}: ZeRO-2; Megatron-LM's distributed optimizer shards optimizer states and "
                          "reduce-scatters gradients but keeps a full gradient buffer per rank (ZeRO-1 memory)")
    elif lay.zero == 3:
        # Megatron FSDP checkpoints only in its own format (validate_args).
        flags += [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params"),
                  ("--ckpt-format", "fsdp_dtensor")]
    if lay.offload == "optimizer":
        if lay.zero in (1, 2):  # Megatron-core's HybridDeviceOptimizer sits on the distributed optimizer
            flags.append(("--optimizer-cpu-offload", None))
            notes.append(f"{call.name}: optimizer states in host memory; --optimizer-cpu-offload keeps them there and "
                         "steps them on the CPU, slower than the plan costs (it copies them to the GPU for the step)")
        else:
            limits.append(f"{call.name}: optimizer states in host memory between calls with ZeRO-{lay.zero}; "
                          "Megatron-LM offloads only the distributed optimizer's states (ZeRO-1/2)")
    if lay.recompute == "full":
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    elif lay.recompute == "selective":
        flags.append(("--recompute-granularity", "selective"))
    # The runtime keeps the learning rate constant; Megatron's default decay is linear.
    flags += [("--bf16", None), ("--lr", call.lr or plan.algorithm.lr), ("--lr-decay-style", "constant")]
    return flags


def launch_env(lay) -> dict[str, str]:  # noqa: ANN001 - a Layout
    """Environment the job needs: Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or
    context parallelism on GPUs before Blackwell, and that it is not 1 under Megatron FSDP."""
    if (lay.tp > 1 or lay.cp > 1) and lay.zero != 3:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def export(plan: Plan, *, call: str | None = None) -> Export:
    """One pretrain_gpt.py command per train call (or for the named one)."""
    trains = [c for c in plan.calls if c.kind == "train" and (call is None or c.name == call)]
    if not trains:
        names = ", ".join(c.name for c in plan.calls if c.kind == "train") or "none"
        raise PlannerError(f"plan {plan.name!r} has no train call {call!r}" if call else
                           f"plan {plan.name!r} has no train call to export", hint=f"train calls: {names}")
    for c in trains:
        decl = plan.models[c.model]
        if c.loss != "sft" or decl.head != "lm":
            raise refuse("Megatron-LM", plan, f"{c.name} optimises the {c.loss} loss on a {decl.head} head; "
                         "pretrain_gpt.py trains the language-modelling loss only",
                         hint="export RLHF plans with --to verl (Megatron workers) or --to openrlhf; "
                              "DPO with --to deepspeed")
    limits = common_limits(plan, "Megatron-LM")
    notes: list[str] = []
    for c in trains:
        spec = plan.models[c.model].spec
        if spec.qk_norm == "proj":
            limits.append(f"{c.name}: q/k norms over the whole projection (OLMoE); Megatron-LM's --qk-layernorm "
                          "normalises each head")
        if spec.is_moe:
            notes.append(f"{c.name}: no load-balancing loss, as the plan was costed (Megatron-LM's default "
                         "--moe-aux-loss-coeff is 0); set one to train the router toward balance")
    others = [c.name for c in plan.calls if c.kind != "train"]
    if others:
        limits.append(f"calls {', '.join(others)} (generate/inference) and the data they pass to training: "
                      "Megatron-LM's training script runs one training job (export RLHF plans with --to verl or "
                      "--to openrlhf)")
    limits += position_limits(plan)
    if plan.reallocations:
        limits.append("parameter reallocations between calls (" +
                      ", ".join(f"{r.model}: {r.from_call} -> {r.to_call}" for r in plan.reallocations) + ")")
    jobs: dict[str, Any] = {}
    commands = []
    world = plan.cluster.world_size
    env: dict[str, str] = {}
    for c in trains:
        if c.mesh.size != world:
            notes.append(f"{c.name}: runs on GPUs {c.mesh.short()} of {world}; launch this job on those "
                         f"{c.mesh.size} GPUs only (torchrun --nproc-per-node / hostfile)")
        if c.minibatches > 1:
            notes.append(f"{c.name}: {c.minibatches} optimizer steps per iteration (one per "
                         f"--global-batch-size {optimizer_batch(c)} sequences)")
        flags = model_flags(plan, c) + parallel_flags(plan, c, limits, notes)
        job_env = launch_env(c.layout)
        env.update(job_env)
        jobs[c.name] = {"world_size": c.mesh.size, "ranks": [c.mesh.first, c.mesh.ranks[-1]],
                        "flags": flags_dict(flags), "env": job_env}
        prefix = " ".join(f"{k}={v}" for k, v in job_env.items())
        commands.append(f"# {c.name}: {c.model} on GPUs {c.mesh.short()} ({c.mesh.size} processes)\n"
                        + shell_command(f"{prefix} {PROGRAM}".strip(), flags))
    notes.append("add your data and tokenizer flags (--data-path, --tokenizer-type, --tokenizer-model) and the "
                 "length of the run (--train-iters)")
    exp = Export("megatron", "", {"jobs": jobs}, limits, notes, SOURCE, VERSION, env)
    exp.text = comment_block(exp) + "\n\n" + "\n\n".join(commands) + "\n"
    return exp
