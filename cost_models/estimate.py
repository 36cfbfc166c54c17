"""One training configuration, checked and estimated (what `planner estimate` prints).

`training_layout` turns Megatron-style knobs (degrees, micro-batch size, global batch) into a
`Layout`, with a `PlannerError` for every inconsistent combination; `estimate_training` runs the
cost model on it and reports iteration time, throughput by the 6N+attention convention, MFU and
memory, each broken down by kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from cost_models.api import CostModel
from cost_models.calibration import Calibration
from cost_models.framework import Framework
from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.graph import MAX_SEQS, Call, ModelDecl
from plans.layout import Layout, Mesh
from plans.model import MAX_POSITIONS, ModelSpec
from plans.sharding import layout_problems


def training_layout(spec: ModelSpec, cluster: ClusterSpec, *, tp: int, pp: int, dp: int, cp: int = 1,
                    micro_batch: int, global_batch: int, seq_len: int, recompute: str = "none", zero: int = 0,
                    sequence_parallel: bool = False, interleave: int = 1) -> Layout:
    """The layout of a training run, or a `PlannerError` saying what does not fit together."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp), ("micro batch", micro_batch),
                        ("global batch", global_batch), ("sequence length", seq_len), ("interleave", interleave)):
        if value < 1:
            raise PlannerError(f"{name} must be at least 1, got {value}")
    if global_batch > MAX_SEQS or seq_len > MAX_POSITIONS:
        raise PlannerError(f"global batch {global_batch} x sequence length {seq_len} is beyond what the cost model "
                           f"handles (at most {MAX_SEQS:,} sequences of {MAX_POSITIONS:,} tokens)")
    world = tp * pp * dp * cp
    if world != cluster.world_size:
        raise PlannerError(
            f"tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp} = {world}, but cluster {cluster.short()} has {cluster.world_size} GPUs",
            hint="make the product of the parallel degrees equal the GPU count (e.g. raise --dp)",
        )
    if global_batch % (dp * micro_batch):
        raise PlannerError(
            f"global batch {global_batch} is not divisible by dp x micro batch = {dp} x {micro_batch}",
            hint=f"use a global batch that is a multiple of {dp * micro_batch}",
        )
    if seq_len % cp:
        raise PlannerError(f"sequence length {seq_len} is not divisible by cp={cp}")
    if spec.model_type == "gpt" and seq_len > spec.max_position_embeddings:
        raise PlannerError(
            f"sequence length {seq_len} exceeds max_position_embeddings={spec.max_position_embeddings} of this gpt model",
            hint="gpt models learn one embedding per position: raise max_position_embeddings in the model spec",
        )
    try:
        layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, zero=zero, micro_batches=global_batch // (dp * micro_batch),
                        recompute=recompute, sequence_parallel=sequence_parallel, interleave=interleave)
    except ValidationError as e:
        msgs = "; ".join(str(x.get("msg", "")).removeprefix("Value error, ") for x in e.errors())
        raise PlannerError(f"invalid layout: {msgs}") from None
    problems = layout_problems(spec, layout)
    if problems:
        raise PlannerError(f"layout {layout.short()} cannot shard {spec.display_name()}: " + "; ".join(problems),
                           hint="tp must divide the attention and key/value heads; pp x interleave must not exceed the layers")
    return layout


@dataclass(frozen=True)
class TrainingEstimate:
    """Predicted iteration of one training configuration."""

    iteration_s: float
    model_flops: float
    tokens: int
    gpus: int
    peak_flops: float
    peak_mem_bytes: int
    mem_capacity_bytes: int
    mem_usable_bytes: int  # the capacity less the cluster's headroom: what a plan may use
    time_breakdown_s: dict[str, float]
    mem_breakdown_bytes: dict[str, int]
    costed_for: str  # the stack and what backs its efficiencies (`CostModel.costed_for`)

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / self.iteration_s / self.gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.iteration_s * self.gpus * self.peak_flops)

    @property
    def fits(self) -> bool:
        return self.peak_mem_bytes <= self.mem_usable_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "iteration_s": self.iteration_s,
            "tokens_per_s": self.tokens / self.iteration_s,
            "model_flops": self.model_flops,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "peak_mem_bytes": self.peak_mem_bytes,
            "mem_capacity_bytes": self.mem_capacity_bytes,
            "mem_usable_bytes": self.mem_usable_bytes,
            "fits": self.fits,
            "breakdown": {"time_s": self.time_breakdown_s, "memory_bytes": self.mem_breakdown_bytes},
            "costed_for": self.costed_for,
        }


def estimate_training(spec: ModelSpec, cluster: ClusterSpec, layout: Layout, *, global_batch: int, seq_len: int,
                      calibration: Calibration | None = None, framework: str | Framework = "torch") -> TrainingEstimate:
    """Time, throughput and memory of one optimizer step of `global_batch` sequences."""
    cm = CostModel(cluster, calibration, framework=framework)
    call = Call(name="train", model="model", kind="train", seqs=global_batch, seq_len=seq_len, loss="sft")
    cost = cm.call_cost(call, ModelDecl(spec=spec, trainable=True), Mesh.block(0, layout.size), layout)
    return TrainingEstimate(
        iteration_s=cost.time_s, model_flops=cost.model_flops, tokens=global_batch * seq_len, gpus=layout.size,
        peak_flops=cm.hw.peak_flops, peak_mem_bytes=cost.peak_mem_bytes, mem_capacity_bytes=cluster.mem_bytes,
        mem_usable_bytes=cluster.usable_mem_bytes, time_breakdown_s=cost.breakdown_s, mem_breakdown_bytes=cost.mem_breakdown_bytes,
        costed_for=cm.costed_for(),
    )
