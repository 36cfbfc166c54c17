"""Megatron-LM command lines for the train calls of a plan.

Flag names are those of ``megatron/training/arguments.py`` (NVIDIA/Megatron-LM, read at commit
000c4ac24f61159c138b0975def722c65245983c): ``_add_network_size_args``, ``_add_training_args``,
``_add_distributed_args``, ``_add_mixed_precision_args``, ``_add_learning_rate_args``,
``_add_data_args`` and ``_add_tokenizer_args``. Megatron-LM trains one model with one layout per
job, so each train call of the plan becomes one ``pretrain_gpt.py`` command.
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
    shell_command,
)
from plans.errors import PlannerError
from plans.plan import Plan, PlanCall
from plans.sharding import stage_layers

SOURCE = "NVIDIA/Megatron-LM megatron/training/arguments.py"
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
    else:
        flags += [("--normalization", "LayerNorm"), ("--norm-epsilon", spec.layer_norm_epsilon),
                  ("--position-embedding-type", "learned_absolute")]
    if not spec.tied:
        flags.append(("--untie-embeddings-and-output-weights", None))
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
    layers = spec.num_hidden_layers
    if lay.interleave > 1:
        if layers % (lay.pp * lay.interleave) == 0:
            flags.append(("--num-layers-per-virtual-pipeline-stage", layers // (lay.pp * lay.interleave)))
        else:
            flags.append(("--num-virtual-stages-per-pipeline-rank", lay.interleave))
            limits.append(f"{call.name}: {layers} layers do not split evenly into {lay.pp * lay.interleave} virtual "
                          "stages; the plan gives chunks after the first one extra layer, Megatron-LM splits evenly")
    elif layers % lay.pp:
        sizes = [len(s) for s in stage_layers(layers, lay.pp)]
        if len(set(sizes[1:])) == 1:  # only the first stage differs: Megatron's uneven-first option
            flags.append(("--decoder-first-pipeline-num-layers", sizes[0]))
        else:
            limits.append(f"{call.name}: pipeline stages of {sizes} layers; Megatron-LM sets only the first and last "
                          "stage apart from an even split")
    flags += [("--micro-batch-size", micro_batch_per_gpu(call)), ("--global-batch-size", optimizer_batch(call))]
    if lay.zero in (1, 2):
        flags.append(("--use-distributed-optimizer", None))
        if lay.zero == 2:
            notes.append(f"{call.name}: ZeRO-2 maps to the distributed optimizer, which shards optimizer states and "
                         "reduce-scatters gradients but keeps a full gradient buffer per rank (ZeRO-1 memory)")
    elif lay.zero == 3:
        flags += [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", "optim_grads_params")]
        notes.append(f"{call.name}: ZeRO-3 maps to Megatron FSDP; check that your Megatron-LM version supports it "
                     f"with tp={lay.tp} and pp={lay.pp}")
    if lay.recompute == "full":
        flags += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"), ("--recompute-num-layers", 1)]
    elif lay.recompute == "selective":
        flags.append(("--recompute-granularity", "selective"))
    flags += [("--bf16", None), ("--lr", call.lr or plan.algorithm.lr)]
    return flags


def export(plan: Plan, *, call: str | None = None) -> Export:
    """One pretrain_gpt.py command per train call (or for the named one)."""
    trains = [c for c in plan.calls if c.kind == "train" and (call is None or c.name == call)]
    if not trains:
        names = ", ".join(c.name for c in plan.calls if c.kind == "train") or "none"
        raise PlannerError(f"plan {plan.name!r} has no train call {call!r}" if call else
                           f"plan {plan.name!r} has no train call to export", hint=f"train calls: {names}")
    limits = common_limits(plan, "Megatron-LM")
    notes: list[str] = []
    others = [c.name for c in plan.calls if c.kind != "train"]
    if others:
        limits.append(f"calls {', '.join(others)} (generate/inference) and the data they pass to training: "
                      "Megatron-LM's training script runs one training job (export RLHF plans with --to verl or "
                      "--to openrlhf)")
    if plan.reallocations:
        limits.append("parameter reallocations between calls (" +
                      ", ".join(f"{r.model}: {r.from_call} -> {r.to_call}" for r in plan.reallocations) + ")")
    jobs: dict[str, Any] = {}
    commands = []
    world = plan.cluster.world_size
    for c in trains:
        decl = plan.models[c.model]
        if c.loss != "sft" or decl.head != "lm":
            limits.append(f"{c.name}: loss {c.loss!r} on a {decl.head} head; pretrain_gpt.py optimises the "
                          "language-modelling loss")
        if c.mesh.size != world:
            notes.append(f"{c.name}: runs on GPUs {c.mesh.short()} of {world}; launch this job on those "
                         f"{c.mesh.size} GPUs only (torchrun --nproc-per-node / hostfile)")
        if c.minibatches > 1:
            notes.append(f"{c.name}: {c.minibatches} optimizer steps per iteration (one per "
                         f"--global-batch-size {optimizer_batch(c)} sequences)")
        flags = model_flags(plan, c) + parallel_flags(plan, c, limits, notes)
        jobs[c.name] = {"world_size": c.mesh.size, "ranks": [c.mesh.first, c.mesh.ranks[-1]],
                        "flags": flags_dict(flags)}
        commands.append(f"# {c.name}: {c.model} on GPUs {c.mesh.short()} ({c.mesh.size} processes)\n"
                        + shell_command(PROGRAM, flags))
    exp = Export("megatron", "", {"jobs": jobs}, limits, notes, SOURCE)
    exp.text = comment_block(exp) + "\n\n" + "\n\n".join(commands) + "\n"
    return exp
