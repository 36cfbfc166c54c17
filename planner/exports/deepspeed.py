"""A DeepSpeed config (the JSON passed to ``deepspeed.initialize``) for a train call of a plan.

Key names are those of DeepSpeed's configuration reference, ``docs/_pages/config-json.md``
(deepspeedai/DeepSpeed, read at commit 00376da49967bc6a15d70a550200ac67277b1fb4): the batch size
keys, ``optimizer``, ``bf16``, ``zero_optimization.stage`` and ``tensor_parallel.autotp_size``
(AutoTP training). Pipeline parallelism, sequence parallelism and activation checkpointing are
chosen in model code in DeepSpeed, not in this file, so the export lists them as what the config
cannot express.
"""

from __future__ import annotations

from typing import Any

from planner.exports.common import Export, common_limits, json_text, micro_batch_per_gpu, optimizer_batch
from plans.errors import PlannerError
from plans.plan import Plan, PlanCall

SOURCE = "deepspeedai/DeepSpeed docs/_pages/config-json.md"


def config(plan: Plan, call: PlanCall, limits: list[str], notes: list[str]) -> dict[str, Any]:
    """The DeepSpeed config of one train call; what it cannot say goes to `limits`."""
    lay = call.layout
    cfg: dict[str, Any] = {
        "train_batch_size": optimizer_batch(call),
        "train_micro_batch_size_per_gpu": micro_batch_per_gpu(call),
        "gradient_accumulation_steps": lay.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": call.lr or plan.algorithm.lr}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": lay.zero},
    }
    if lay.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
        notes.append(f"{call.name}: tensor_parallel.autotp_size needs a DeepSpeed release with AutoTP training")
    if lay.pp > 1:
        limits.append(f"{call.name}: pipeline parallel pp={lay.pp}" + (f" interleaved x{lay.interleave}" if
                      lay.interleave > 1 else "") + ": DeepSpeed sets it in code (PipelineModule(num_stages=...)), "
                      "not in the config")
    if lay.cp > 1:
        limits.append(f"{call.name}: context parallel cp={lay.cp}: DeepSpeed-Ulysses sequence parallelism is set up in "
                      "model code, not in the config")
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
    return Export("deepspeed", json_text(cfg), cfg, limits, notes, SOURCE)
