"""Accelerator datasheets: the physical figures a cluster preset starts from.

Measured efficiencies (what fraction of these peaks a kernel or collective reaches) are fitted
coefficients and live with the cost models; this table holds only what the vendor states. An
unknown accelerator is an error, never a guess.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Literal

from pydantic import Field

from plans.base import Strict
from plans.errors import PlannerError

GIB = 1024**3


class GpuSpec(Strict):
    """One accelerator type, by its datasheet."""

    name: str
    arch: Literal["volta", "ampere", "hopper", "cpu"] = Field(
        description="Architecture: which kernels a stack can run on it (FlashAttention-2 is Ampere-era code; "
        "Hopper's fused attention needs its asynchronous tensor cores)."
    )
    mem_gib: float = Field(gt=0, description="Usable device memory, GiB.")
    peak_tflops: float = Field(gt=0, description="Dense bf16/fp16 tensor throughput, TFLOP/s.")
    hbm_gb_s: float = Field(gt=0, description="Device memory bandwidth, GB/s.")
    nvlink_gbps: float = Field(gt=0, description="Intra-node link bandwidth per GPU, one direction, Gbit/s.")
    nic_gbps_per_node: float = Field(gt=0, description="Network bandwidth per node, all NICs, one direction, Gbit/s.")
    gpus_per_node: int = Field(ge=1, description="GPUs in the vendor's standard node.")
    nvlink_latency_us: float = Field(ge=0, description="Latency of one intra-node collective step, us.")
    net_latency_us: float = Field(ge=0, description="Latency of one inter-node collective step, us.")
    host_gbps: float = Field(gt=0, description="Host link (PCIe) bandwidth per GPU, one direction, Gbit/s, while "
                             "every GPU of the node copies at once (a switch's uplink shared by the GPUs behind it).")
    host_mem_gib: float = Field(gt=0, description="Host (CPU) memory per GPU, GiB: the node's memory over its GPUs.")
    matmul_ceiling: float | None = Field(
        None, gt=0, le=1,
        description="The largest share of the dense peak a bf16 GEMM reaches on it, over all shapes (its maximum "
        "achievable matmul FLOPS, published per GPU); None: not published. A GEMM efficiency fitted on one GPU is "
        "carried to another as the same share of this ceiling.",
    )
    sm_count: int | None = Field(
        None, ge=1, description="Streaming multiprocessors (GEMM tiles run in waves of this many); None: no wave model."
    )

    @property
    def mem_bytes(self) -> int:
        return int(self.mem_gib * GIB)


@cache
def gpu_catalog() -> dict[str, GpuSpec]:
    """All known accelerators, by preset name."""
    raw = json.loads(resources.files("plans").joinpath("data/gpus.json").read_text())
    return {name: GpuSpec(name=name, **fields) for name, fields in raw.items() if not name.startswith("_")}


def gpu_spec(name: str) -> GpuSpec:
    """The datasheet of `name`, or a `PlannerError` listing the known names."""
    catalog = gpu_catalog()
    if name not in catalog:
        raise PlannerError(f"unknown GPU {name!r}", hint=f"known GPUs: {', '.join(catalog)}")
    return catalog[name]
