"""A DeepSpeed config (the JSON passed to ``deepspeed.initialize``) for a train call of a plan.

Target: DeepSpeed 0.19.x (key names, defaults and checks of ``deepspeed/runtime/config.py`` in the
0.19.8 wheel from PyPI): the batch keys, ``optimizer``, ``bf16``, ``zero_optimization.stage``,
``tensor_parallel.autotp_size`` (AutoTP training) and ``sequence_parallel_size`` (Ulysses).

DeepSpeed checks ``train_batch_size == micro * gradient_accumulation_steps * world``, and its
``world`` depends on how the job sets up model parallelism, so the batch keys are written for the
job the export describes: with a ``PipelineModule`` (pp > 1) the world is the pipeline grid's
data-parallel size; with AutoTP (no mpu) every process counts, tensor-parallel ranks included, so
``train_batch_size`` is the plan's batch times tp (the tp ranks of a replica see the same
sequences); with Ulysses, the processes over ``sequence_parallel_size``. Pipeline stages and
activation checkpointing are chosen in model code, which the notes say. ``make test-engines``
runs DeepSpeed's ``DeepSpeedConfig`` on every export with the world of that job.
"""

from __future__ import annotations

from typing import Any

from planner.exports.common import Export, common_limits, json_text, micro_batch_per_gpu, optimizer_batch, refuse
from plans.errors import PlannerError
from plans.plan import Plan, PlanCall

# Where a DeepSpeed job runs unlike the `megatron-core` stack it is costed with (export and import).
UNFUSED_ACCUMULATION = ("costed for megatron-core, whose weight-gradient GEMMs add each micro-batch's gradients into "
                        "the buffer themselves; DeepSpeed adds them by kernels of their own, so it runs somewhat slower "
                        "than costed")

VERSION = "DeepSpeed 0.19.x"
SOURCE = "DeepSpeed 0.19.8 deepspeed/runtime/config.py, docs/_pages/config-json.md"


def config(plan: Plan, call: PlanCall, limits: list[str], notes: list[str]) -> dict[str, Any]:
    """The DeepSpeed config of one train call; what it cannot say goes to `limits`."""
    lay = call.layout
    micro = micro_batch_per_gpu(call)
    if optimizer_batch(call) != micro * lay.micro_batches * lay.dp:
        raise refuse("DeepSpeed", plan, f"{call.name}: {optimizer_batch(call)} sequences per optimizer step do not "
                     f"split into {lay.dp} data-parallel ranks x {lay.micro_batches} micro-batches of whole sequences")
    if lay.pp > 1 and (lay.tp > 1 or lay.cp > 1):
        raise refuse("DeepSpeed", plan, f"{call.name}: pipeline parallel with tp={lay.tp}, cp={lay.cp}; DeepSpeed's "
                     "PipelineModule takes neither AutoTP nor Ulysses from the config",
                     hint="export it with --to megatron")
    if lay.tp > 1 and lay.cp > 1:
        raise refuse("DeepSpeed", plan, f"{call.name}: AutoTP (tp={lay.tp}) with Ulysses (cp={lay.cp}); DeepSpeed "
                     "builds one model-parallel group from the config", hint="export it with --to megatron")
    # DeepSpeed's world for the batch check (see the module docstring).
    batch = optimizer_batch(call) * (lay.tp if lay.pp == 1 else 1)
    cfg: dict[str, Any] = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": lay.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": call.lr or plan.algorithm.lr}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": lay.zero},
    }
    if lay.zero in (1, 2):
        # The plan prices the gradient reduction overlapped with the backward; DeepSpeed does that
        # under ZeRO-1/2 only when asked (`overlap_comm` defaults to stage 3 alone,
        # `DeepSpeedZeroConfig.overlap_comm_valid`).
        cfg["zero_optimization"]["overlap_comm"] = True
    elif lay.zero == 0 and lay.dp * lay.cp > 1:
        notes.append(f"{call.name}: without ZeRO DeepSpeed all-reduces the gradients after the backward, not under "
                     "it as the plan costs them; ZeRO-1 (--zero 1 in the plan) overlaps them (overlap_comm)")
    if plan.estimate.framework == "megatron-core":
        notes.append(f"{call.name}: {UNFUSED_ACCUMULATION}")
    if lay.offload == "optimizer":
        if lay.zero:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            notes.append(f"{call.name}: optimizer states in host memory; ZeRO-Offload keeps them there and steps Adam "
                         "on the CPU (DeepSpeedCPUAdam), slower than the plan costs (it copies them to the GPU)")
        else:
            limits.append(f"{call.name}: optimizer states in host memory without ZeRO; DeepSpeed offloads them only "
                          "under ZeRO stage 1-3")
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
        notes.append(f"{call.name}: AutoTP training; train_batch_size counts every process (tp={lay.tp} ranks of a "
                     f"replica read the same {micro * lay.micro_batches * lay.dp} sequences per step)")
    if lay.cp > 1:
        cfg["sequence_parallel_size"] = lay.cp
        notes.append(f"{call.name}: Ulysses sequence parallelism over {lay.cp} ranks: build the model with DeepSpeed's "
                     "DistributedAttention")
    if lay.pp > 1:
        notes.append(f"{call.name}: build the model as a PipelineModule(num_stages={lay.pp}); DeepSpeed takes the "
                     "data-parallel size from its grid")
        if lay.interleave > 1:
            limits.append(f"{call.name}: interleaved pipeline stages (x{lay.interleave}); DeepSpeed's pipeline "
                          "schedule is not interleaved")
    if lay.sequence_parallel:
        limits.append(f"{call.name}: Megatron-style sequence parallelism of norm/dropout activations over tp")
    if lay.recompute != "none":
        limits.append(f"{call.name}: activation recompute ({lay.recompute}): enable gradient checkpointing in model "
                      "code; the config's activation_checkpointing section only tunes it")
    return cfg


def export(plan: Plan, *, call: str | None = None) -> Export:
    """The DeepSpeed config of the train call (the named one when the plan has several)."""
    trains = [c for c in plan.calls if c.kind == "train"]
    names = ", ".join(c.name for c in trains) or "none"
    if call is not None:
        trains = [c for c in trains if c.name == call]
    if not trains:
        raise PlannerError(f"plan {plan.name!r} has no train call {call!r}" if call else
                           f"plan {plan.name!r} has no train call to export", hint=f"train calls: {names}")
    if len(trains) > 1:
        raise PlannerError(f"plan {plan.name!r} trains {len(trains)} models ({names}); a DeepSpeed config is per model",
                           hint="pick one with --call NAME")
    c = trains[0]
    limits = common_limits(plan, "DeepSpeed")
    notes: list[str] = []
    others = [x.name for x in plan.calls if x.name != c.name]
    if others:
        limits.append(f"calls {', '.join(others)} beside {c.name}: a DeepSpeed config describes one model's training")
    if c.mesh.size != plan.cluster.world_size:
        notes.append(f"{c.name}: runs on GPUs {c.mesh.short()}; launch on those {c.mesh.size} GPUs "
                     "(deepspeed --include / hostfile)")
    if c.minibatches > 1:
        notes.append(f"{c.name}: {c.minibatches} optimizer steps per iteration of train_batch_size sequences each")
    cfg = config(plan, c, limits, notes)
    return Export("deepspeed", json_text(cfg), cfg, limits, notes, SOURCE, VERSION)
