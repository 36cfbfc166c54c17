"""Fitting the calibration coefficients to measured runs (what `planner calibrate` does).

The objective is the mean absolute percentage error of predicted against measured iteration
time, averaged over the measured files with equal weight (so 109 multi-node rows count as much
as 1,440 single-node ones). It is minimised by coordinate search: each coefficient in turn is
line-searched over its physical range (golden section on a log or linear scale), sweeping until
no coefficient improves. Deterministic (no random starts) and dependency-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from cost_models.api import CostModel
from cost_models.calibration import Calibration, Coefficients
from cost_models.framework import Framework
from cost_models.measured import MeasuredRun
from plans.graph import Call, ModelDecl
from plans.layout import Mesh

# name -> (low, high, log scale): the physical range searched for each coefficient.
SEARCH_RANGES: dict[str, tuple[float, float, bool]] = {
    "gemm_efficiency": (0.4, 1.0, False),
    "hbm_efficiency": (0.4, 1.0, False),
    "nvlink_efficiency": (0.2, 1.0, True),
    "network_efficiency": (0.1, 1.0, True),
    "kernel_latency_us": (0.5, 20.0, True),
    "host_kernel_us": (2.0, 200.0, True),
    "host_collective_us": (1.0, 1000.0, True),
    "host_overlap": (0.0, 1.0, False),
    "microbatch_overhead_ms": (0.01, 50.0, True),
    "step_overhead_ms": (0.1, 200.0, True),
}
GOLDEN = (math.sqrt(5) - 1) / 2

# Where the search starts (so a fit reproduces from its inputs alone): datasheet-level guesses.
# attention_efficiency is not searched (measured runs with materialised attention say nothing
# about fused kernels): FlashAttention-2 reaches 60-73% of an A100's peak (Dao 2023), about 0.85
# of what a large GEMM reaches. Where a stack's kernel has published speeds by length
# (`cost_models.attention`), that rate is only their ceiling.
START = Coefficients(
    gemm_efficiency=0.8, attention_efficiency=0.85, hbm_efficiency=0.8, nvlink_efficiency=0.8, network_efficiency=0.8,
    kernel_latency_us=4.0, host_kernel_us=40.0, host_collective_us=50.0, host_overlap=0.8, microbatch_overhead_ms=1.0,
    step_overhead_ms=5.0,
)


@dataclass(frozen=True)
class Setup:
    """How measured runs map to clusters: accelerator, node size and link overrides."""

    gpu: str
    gpus_per_node: int
    intra_node_gbps: float | None
    inter_node_gbps: float | None
    framework: str | Framework


def predict(runs: Sequence[MeasuredRun], cal: Calibration, setup: Setup) -> list[float]:
    """Predicted iteration time of every run, seconds."""
    models: dict[int, CostModel] = {}
    out = []
    for r in runs:
        nodes = -(-r.gpus // setup.gpus_per_node)
        cm = models.get(nodes)
        if cm is None:
            cluster = r.cluster(gpu=setup.gpu, gpus_per_node=setup.gpus_per_node,
                                intra_node_gbps=setup.intra_node_gbps, inter_node_gbps=setup.inter_node_gbps)
            cm = models[nodes] = CostModel(cluster, cal, framework=setup.framework)
        call = Call(name="step", model="m", kind="train", seqs=r.global_batch, seq_len=r.seq_len, loss="sft")
        cost = cm.call_cost(call, ModelDecl(spec=r.spec, trainable=True), Mesh.block(0, r.layout.size), r.layout)
        out.append(cost.time_s)
    return out


def mape(pred: Sequence[float], runs: Sequence[MeasuredRun]) -> float:
    """Mean absolute percentage error, in percent."""
    return 100.0 * sum(abs(p - r.iteration_s) / r.iteration_s for p, r in zip(pred, runs)) / len(runs)


def objective(groups: Sequence[Sequence[MeasuredRun]], cal: Calibration, setup: Setup) -> float:
    """Mean over groups of each group's MAPE."""
    return sum(mape(predict(g, cal, setup), g) for g in groups) / len(groups)


def _with(cal: Calibration, name: str, value: float) -> Calibration:
    co = cal.coefficients.model_copy(update={name: value})
    return cal.model_copy(update={"coefficients": Coefficients.model_validate(co.model_dump())})


def _objective_at(groups: Sequence[Sequence[MeasuredRun]], cal: Calibration, name: str, setup: Setup,
                  value: float) -> float:
    """The objective with coefficient `name` of `cal` set to `value`."""
    return objective(groups, _with(cal, name, value), setup)


def _line_search(f: Callable[[float], float], lo: float, hi: float, log: bool, x0: float, iters: int) -> tuple[float, float]:
    """Golden-section minimum of f on [lo, hi] (log-scaled if asked), never worse than x0."""
    tr = (math.log, math.exp) if log else ((lambda v: v), (lambda v: v))
    a, b = tr[0](lo), tr[0](hi)
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc, fd = f(tr[1](c)), f(tr[1](d))
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = f(tr[1](c))
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = f(tr[1](d))
    best_x, best_f = (tr[1](c), fc) if fc < fd else (tr[1](d), fd)
    f0 = f(x0)
    return (x0, f0) if f0 <= best_f else (best_x, best_f)


def fit(groups: Sequence[Sequence[MeasuredRun]], start: Calibration, setup: Setup, *,
        names: Sequence[str] = tuple(SEARCH_RANGES), sweeps: int = 8, iters: int = 12, tol: float = 0.01,
        progress: Callable[[str, float, float], None] | None = None) -> tuple[Calibration, float]:
    """Coordinate search from `start`, at most `sweeps` sweeps, stopping when a sweep gains less
    than `tol` percentage points; returns the fitted calibration and its objective."""
    cal = start
    best = objective(groups, cal, setup)
    for _ in range(sweeps):
        before = best
        for name in names:
            lo, hi, log = SEARCH_RANGES[name]
            x0 = getattr(cal.coefficients, name)
            at = partial(_objective_at, groups, cal, name, setup)
            x, fx = _line_search(at, lo, hi, log, x0, iters)
            if fx < best - 1e-9:
                cal = _with(cal, name, round(x, 6))
                best = objective(groups, cal, setup)
            if progress:
                progress(name, getattr(cal.coefficients, name), best)
        if before - best < tol:
            break
    return cal, best
