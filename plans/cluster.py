"""The GPU cluster a plan runs on: accelerator type, nodes, GPUs per node, link bandwidths.

Global rank ``r`` sits on node ``r // gpus_per_node``. Bandwidths default to the accelerator's
datasheet (`plans.hardware`) and may be overridden per cluster, e.g. a slower network:
``a100-80gb:64x8,inter_node_gbps=800``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from plans.base import Strict, validated
from plans.errors import PlannerError
from plans.hardware import GIB, GpuSpec, gpu_catalog, gpu_spec


class ClusterSpec(Strict):
    """A homogeneous cluster of `nodes` x `gpus_per_node` accelerators."""

    gpu: str = Field(description="Accelerator preset name (see `plans/data/gpus.json`).")
    nodes: int = Field(ge=1, le=4096, description="Number of nodes.")
    gpus_per_node: int = Field(ge=1, le=16, description="GPUs per node.")
    # Bounds keep every time and size derived from these finite: 1 Mbit/s to 1 Pbit/s of bandwidth,
    # 1 MiB to 1 PiB of memory per GPU.
    intra_node_gbps: float | None = Field(
        None, ge=1e-3, le=1e6, description="Intra-node link bandwidth per GPU, one direction, Gbit/s (default: datasheet)."
    )
    inter_node_gbps: float | None = Field(
        None, ge=1e-3, le=1e6, description="Network bandwidth per node, one direction, Gbit/s (default: datasheet)."
    )
    mem_gib: float | None = Field(
        None, ge=2**-10, le=2**20, description="Memory per GPU, GiB (default: datasheet)."
    )
    mem_headroom_gib: float | None = Field(
        None, ge=0, le=2**20,
        description="Memory per GPU every plan leaves free, GiB: a margin for what the cost model does not count "
        "(default: 1 GiB + 2.5% of the memory; see `default_headroom_gib`).",
    )

    @field_validator("gpu")
    @classmethod
    def check_gpu_known(cls, name: str) -> str:
        if name not in gpu_catalog():
            raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(gpu_catalog())}")
        return name

    @model_validator(mode="after")
    def fill_datasheet_defaults(self) -> ClusterSpec:
        sheet = gpu_spec(self.gpu)
        # Frozen model: defaults are resolved once so every plan states the figures it used.
        if self.intra_node_gbps is None:
            object.__setattr__(self, "intra_node_gbps", sheet.nvlink_gbps)
        if self.inter_node_gbps is None:
            object.__setattr__(self, "inter_node_gbps", sheet.nic_gbps_per_node)
        if self.mem_gib is None:
            object.__setattr__(self, "mem_gib", sheet.mem_gib)
        assert self.mem_gib is not None
        if self.mem_headroom_gib is None:
            object.__setattr__(self, "mem_headroom_gib", default_headroom_gib(self.mem_gib))
        elif self.mem_headroom_gib >= self.mem_gib:
            raise ValueError(f"mem_headroom_gib {self.mem_headroom_gib:g} leaves nothing of the {self.mem_gib:g} GiB "
                             "per GPU; give a headroom below the memory (0 packs plans to the edge)")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def sheet(self) -> GpuSpec:
        return gpu_spec(self.gpu)

    @property
    def mem_bytes(self) -> int:
        """Device memory per GPU."""
        assert self.mem_gib is not None
        return int(self.mem_gib * GIB)

    @property
    def host_mem_bytes(self) -> int:
        """Host memory per GPU (the node's over its GPUs, `GpuSpec.host_mem_gib`): what states
        offloaded between calls may take."""
        return int(self.sheet.host_mem_gib * GIB)

    @property
    def headroom_bytes(self) -> int:
        assert self.mem_headroom_gib is not None
        return int(self.mem_headroom_gib * GIB)

    @property
    def usable_mem_bytes(self) -> int:
        """What a plan may use per GPU: the memory less the headroom. Every fit is checked against this."""
        return self.mem_bytes - self.headroom_bytes

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def short(self) -> str:
        """The CLI shorthand that rebuilds this cluster."""
        text = f"{self.gpu}:{self.nodes}x{self.gpus_per_node}"
        sheet = self.sheet
        for key, default in (
            ("intra_node_gbps", sheet.nvlink_gbps),
            ("inter_node_gbps", sheet.nic_gbps_per_node),
            ("mem_gib", sheet.mem_gib),
            ("mem_headroom_gib", default_headroom_gib(self.mem_gib or sheet.mem_gib)),
        ):
            value = getattr(self, key)
            if value != default:
                short = f"{value:g}"
                # Exact, so the shorthand rebuilds this very cluster (":g" keeps 6 digits only).
                text += f",{key}={short if float(short) == value else repr(value)}"
        return text


_SHORTHAND = re.compile(r"^(?P<gpu>[A-Za-z0-9_.\-]+):(?P<nodes>\d{1,9})x(?P<per>\d{1,9})$")
_OVERRIDES = ("intra_node_gbps", "inter_node_gbps", "mem_gib", "mem_headroom_gib")

# The default headroom. What the cost model counts per GPU (`cost_models.memory`: the CUDA context
# and workspaces, the NCCL buffers of the call's communicators, the caching allocator's
# fragmentation) still leaves out communicators other calls created on the same GPU, transient
# spikes inside kernels and library versions that allocate more. A fixed part and a share of the
# capacity, as inference engines keep (vLLM's default gpu_memory_utilization 0.9 leaves 10%; a
# training step's working set is more regular, so less): 3 GiB of an 80 GiB GPU, 4.5 of an H200.
HEADROOM_FIXED_GIB = 1.0
HEADROOM_SHARE = 0.025


def default_headroom_gib(mem_gib: float) -> float:
    """The headroom a cluster keeps unless it says otherwise (bounded by half of a small memory)."""
    return min(HEADROOM_FIXED_GIB + HEADROOM_SHARE * mem_gib, 0.5 * mem_gib)


def _validated(data: dict[str, Any], *, source: str) -> ClusterSpec:
    return validated(ClusterSpec, data, source=source)


def parse_cluster(text: str) -> ClusterSpec:
    """Parse ``GPU:NODESxPER_NODE[,key=value...]`` or a YAML/JSON file path."""
    if not isinstance(text, str):
        raise PlannerError(f"a cluster must be a string like 'a100-80gb:2x8' or a file path, got a {type(text).__name__}")
    text = text.strip()
    path = Path(text)
    if path.suffix.lower() in (".json", ".yaml", ".yml"):
        return load_cluster_file(path)
    head, *overrides = text.split(",")
    m = _SHORTHAND.match(head)
    if not m:
        raise PlannerError(
            f"malformed cluster {text!r}",
            hint="write GPU:NODESxGPUS_PER_NODE, e.g. h100-sxm:2x8 or a100-80gb:64x8,inter_node_gbps=800, "
            "or give a .yaml/.json file",
        )
    data: dict[str, Any] = {"gpu": m["gpu"], "nodes": int(m["nodes"]), "gpus_per_node": int(m["per"])}
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _OVERRIDES:
            raise PlannerError(
                f"cluster {text!r}: cannot read override {item!r}",
                hint=f"overrides are key=value with key in {', '.join(_OVERRIDES)}",
            )
        try:
            data[key] = float(value)
        except ValueError:
            raise PlannerError(f"cluster {text!r}: {key} must be a number, got {value!r}") from None
    if m["gpu"] not in gpu_catalog():
        raise PlannerError(f"unknown GPU {m['gpu']!r} in cluster {text!r}", hint=f"known GPUs: {', '.join(gpu_catalog())}")
    return _validated(data, source=f"cluster {text!r}")


def load_cluster_file(path: Path) -> ClusterSpec:
    """Read a cluster from YAML or JSON (the fields of `ClusterSpec`)."""
    where = repr(str(path)[:200])
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError) as e:  # a name too long for the file system, or with a NUL byte
        raise PlannerError(f"cluster file {where} is not a usable path: {e}") from None
    if is_dir:
        raise PlannerError(f"cluster file {where} is a directory", hint="give the .yaml/.json file itself")
    if not is_file:
        raise PlannerError(f"cluster file {where} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            data = json.loads(raw)
        else:
            import yaml

            data = yaml.safe_load(raw)
    except Exception as e:  # I/O, encoding, JSON or YAML syntax: the user's file is unreadable
        raise PlannerError(f"cluster file {where} is not readable: {e}") from None
    if not isinstance(data, dict):
        raise PlannerError(f"cluster file {where} must hold a mapping of ClusterSpec fields",
                           hint="e.g. {gpu: a100-80gb, nodes: 2, gpus_per_node: 8}")
    return _validated(data, source=f"cluster file {where}")


def with_headroom(cluster: ClusterSpec, gib: float | None) -> ClusterSpec:
    """`cluster` keeping `gib` GiB per GPU free (None: as it is)."""
    if gib is None:
        return cluster
    return _validated({**cluster.model_dump(), "mem_headroom_gib": gib}, source=f"--mem-headroom {gib:g}")


def resolve_cluster(cluster: str | ClusterSpec | dict[str, Any]) -> ClusterSpec:
    """Accept a shorthand string, a file path, a dict or a spec."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, dict):
        return _validated(cluster, source="cluster")
    return parse_cluster(cluster)  # raises a PlannerError for anything but a string
