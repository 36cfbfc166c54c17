"""Calibration: the few fitted coefficients of the cost model, and measured hardware figures.

A calibration file is what `planner calibrate` (fit to measured runs) and `planner profile`
(micro-benchmarks on the local devices) write, and what `--calibration FILE` reads. It holds:

- `coefficients`: achieved fractions of the datasheet peaks and fixed overheads. Each one is a
  physical quantity (a fraction of peak FLOP/s, of HBM or link bandwidth, a time per kernel or
  per step), so coefficients fitted on one GPU transfer to another through its datasheet.
- `hardware`: optional measured figures that replace the datasheet's (a profile on a CPU or on a
  GPU whose clocks differ from the datasheet).

The shipped default (`cost_models/data/calibration.json`) is the fit to the vTrain measurements
(A100, Megatron-LM); see `bench/cost_accuracy.py` for the command that reproduces it and its error.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

from pydantic import Field

from plans.base import Strict, loads_json, validated
from plans.errors import PlannerError
from plans.io import write_text_atomic

CALIBRATION_FORMAT = "planner-calibration/1"


class Coefficients(Strict):
    """Fitted efficiencies and overheads (dimensionless fractions, or times in their units)."""

    gemm_efficiency: float = Field(gt=0, le=1, description="Fraction of peak dense FLOP/s a large GEMM reaches (before wave-quantisation losses).")
    attention_efficiency: float = Field(gt=0, le=1, description="Fused (flash) attention throughput relative to gemm_efficiency.")
    hbm_efficiency: float = Field(gt=0, le=1, description="Fraction of datasheet HBM bandwidth a streaming kernel reaches.")
    elementwise_efficiency: float = Field(1.0, gt=0, le=1, description="Bytes the cost model counts for a layer's memory-bound kernels (norms, activations, residual adds, rotary embedding) over the time they take, as a fraction of the streaming bandwidth: 1 for fused kernels, below 1 for eager PyTorch (several float32 passes per kernel, each with its own setup).")
    nvlink_efficiency: float = Field(gt=0, le=1, description="Collective bus bandwidth over the intra-node link bandwidth per GPU.")
    network_efficiency: float = Field(gt=0, le=1, description="Collective bus bandwidth over the network bandwidth available to the group.")
    kernel_latency_us: float = Field(ge=0, description="GPU time floor per kernel launch, us.")
    host_kernel_us: float = Field(ge=0, description="Host (framework + launch) time to issue one kernel, us.")
    host_backward_kernel_us: float | None = Field(None, ge=0, description="Host time per kernel of a layer's backward (its gradient accumulation included), us: autograd runs each backward op as a node of its engine, with the views' and accumulations' nodes beside it (1.5 times a forward kernel's on a 2-core CPU, `planner.runtime_profile`). None: host_kernel_us.")
    host_decode_kernel_us: float | None = Field(None, ge=0, description="Host time per kernel of a layer's decode step (one token per sequence), us: the step also writes each layer's keys and values into the cache and reads it through views (`planner.runtime_profile`). None: host_kernel_us.")
    host_collective_us: float = Field(ge=0, description="Host time to issue one collective, per level of its ranks' rendezvous tree (x log2 of the group), us.")
    host_overlap: float = Field(ge=0, le=1, description="Fraction of the shorter of host and device time hidden under the longer.")
    microbatch_overhead_ms: float = Field(ge=0, description="Host time per micro-batch per pipeline stage outside the layers (batch, loss, schedule), ms.")
    step_overhead_ms: float = Field(ge=0, description="Fixed time per optimizer step (loss-scale checks, logging, scheduling), ms.")
    decode_step_overhead_ms: float = Field(0.0, ge=0, description="Host time per generated token outside the layers (sampling, cache bookkeeping), ms.")
    attention_head_us: float = Field(0.0, ge=0, description="Fused attention time per (sequence, head) not hidden under its matmuls (a CPU core's setup of each tile), us; 0 on GPUs.")
    attention_score_ns: float = Field(0.0, ge=0, description="Fused attention time per score not hidden under its matmuls (the exponential on a CPU core), ns; 0 on GPUs.")


class HardwareOverrides(Strict):
    """Measured figures replacing the datasheet's; None keeps the datasheet value."""

    peak_tflops: float | None = Field(None, gt=0, description="Dense matmul throughput, TFLOP/s.")
    hbm_gb_s: float | None = Field(None, gt=0, description="Device memory bandwidth, GB/s.")
    intra_node_gbps: float | None = Field(None, gt=0, description="Intra-node link bandwidth per GPU, Gbit/s.")
    inter_node_gbps: float | None = Field(None, gt=0, description="Network bandwidth per node, Gbit/s.")
    intra_latency_us: float | None = Field(None, ge=0, description="Intra-node collective step latency, us.")
    inter_latency_us: float | None = Field(None, ge=0, description="Inter-node collective step latency, us.")
    cpu_cores: int | None = Field(None, ge=1, description="CPU: cores one node's ranks share (None: each rank has a device of its own).")
    rank_threads: int | None = Field(None, ge=1, description="CPU: threads each rank computes with (what the figures were measured with).")
    skew_ms_per_sqrt_s: float | None = Field(None, ge=0, description="CPU: how ranks sharing cores drift apart between collectives: the standard deviation of one rank's lag after one second of work, ms (the lag grows as the square root of the work, as a random walk of time slices; None: ranks do not drift).")
    share_efficiency: float | None = Field(None, gt=0, le=1, description="CPU: the speed a rank keeps while all ranks run the runtime's calls on shared cores, relative to an equal share of the cores (measured: switching and shared caches cost more than the share; None: 1).")
    full_efficiency: float | None = Field(None, gt=0, le=1, description="CPU: the speed a rank keeps while as many single-thread ranks as there are cores run the runtime's calls, relative to one alone (no time-sharing, but shared caches, memory bandwidth and the processes' own threads; None: 1).")
    skew_slice_ms: float | None = Field(None, gt=0, description="CPU: the work below which the lag grows linearly instead (about one scheduler time slice), ms.")


class Calibration(Strict):
    """A calibration file: coefficients, optional measured hardware, and where they came from."""

    format: str = Field(CALIBRATION_FORMAT, description="File format tag.")
    gpu: str | None = Field(None, description="Accelerator the figures were measured on; None: any (fractions of the datasheet).")
    framework: str = Field("megatron", description="Software stack the coefficients were measured with (see cost_models.framework).")
    fitted_on: str | None = Field(
        None, description="Accelerator whose runs the coefficients were fitted on: on another GPU the GEMM efficiency "
        "becomes the same share of that GPU's matmul ceiling (`GpuSpec.matmul_ceiling`); None: the same share of "
        "every GPU's peak.")
    source: str = Field("", description="How the file was produced (command, data, date-free).")
    coefficients: Coefficients
    hardware: HardwareOverrides = Field(default_factory=HardwareOverrides)
    fit: dict[str, float] = Field(default_factory=dict, description="Fit quality, e.g. mape over the measured rows.")


def parse_calibration(text: str, *, source: str) -> Calibration:
    """Parse a calibration document, or raise a `PlannerError` naming `source`."""
    data = loads_json(text, source=f"calibration {source}")
    if not isinstance(data, dict):
        raise PlannerError(f"calibration {source} must hold a JSON object")
    if data.get("format") != CALIBRATION_FORMAT:
        raise PlannerError(
            f"calibration {source} has format {data.get('format')!r}, expected {CALIBRATION_FORMAT!r}",
            hint="write one with `planner calibrate` or `planner profile`",
        )
    return validated(Calibration, data, source=f"calibration {source}")


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file (what `--calibration FILE` takes)."""
    p = Path(path)
    if p.is_dir():
        raise PlannerError(f"calibration file {str(p)!r} is a directory", hint="give the calibration .json file itself")
    if not p.is_file():
        raise PlannerError(f"calibration file {str(p)!r} does not exist", hint="write one with `planner calibrate` or `planner profile`")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PlannerError(f"calibration file {str(p)!r} is not a UTF-8 text (JSON) file: {e.reason} at byte {e.start}") from None
    except OSError as e:
        raise PlannerError(f"cannot read calibration file {str(p)!r}: {e.strerror or e}") from None
    return parse_calibration(text, source=repr(str(p)))


def save_calibration(cal: Calibration, path: str | Path) -> None:
    """Write a calibration file atomically, keys sorted (same calibration, same bytes)."""
    text = json.dumps(cal.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"
    write_text_atomic(Path(path), text)


@cache
def _shipped(name: str) -> Calibration:
    text = resources.files("cost_models").joinpath(f"data/{name}").read_text()
    return parse_calibration(text, source=f"cost_models/data/{name}")


def default_calibration(gpu: str | None = None) -> Calibration:
    """The shipped calibration for `gpu`: a measured local profile for ``cpu``, the vTrain fit otherwise."""
    if gpu == "cpu":
        return _shipped("cpu.json")
    return _shipped("calibration.json")
