"""The contract between the compiler and the runtime: schemas and the layout algebra.

Pydantic only: no torch, no solver. Everything that crosses a layer boundary is defined here once.
"""

from plans.checkpoint import CheckpointManifest, graph_fingerprint, latest_complete, load_manifest
from plans.cluster import ClusterSpec, parse_cluster, resolve_cluster
from plans.errors import PlannerError
from plans.graph import AlgorithmConfig, Call, DataInput, Graph, HostStep, ModelDecl, parse_graph
from plans.hardware import GpuSpec, gpu_catalog, gpu_spec
from plans.io import check_output, write_bytes_atomic, write_text_atomic
from plans.layout import Coord, GaLore, Layout, Mesh
from plans.model import PRESETS, ModelSpec, resolve_model
from plans.plan import (
    PLAN_VERSION,
    DataTransfer,
    Estimate,
    Plan,
    PlanCall,
    Reallocation,
    SearchInfo,
    load_plan,
    parse_plan,
    plan_to_json,
    save_plan,
)

__all__ = [
    "PLAN_VERSION", "PRESETS", "AlgorithmConfig", "Call", "CheckpointManifest", "ClusterSpec", "Coord", "DataInput",
    "DataTransfer", "Estimate", "GaLore", "GpuSpec", "Graph", "HostStep", "Layout", "Mesh", "ModelDecl", "ModelSpec", "Plan", "PlanCall",
    "PlannerError", "Reallocation", "SearchInfo", "check_output", "gpu_catalog", "gpu_spec", "graph_fingerprint",
    "latest_complete", "load_manifest", "load_plan", "parse_cluster", "parse_graph", "parse_plan", "plan_to_json",
    "resolve_cluster", "resolve_model", "save_plan", "write_bytes_atomic", "write_text_atomic",
]
