"""The effective hardware a cost model times kernels and collectives on.

Datasheet peaks (`plans.hardware`), the cluster's bandwidth overrides (`plans.cluster`) and a
calibration's measured figures combine into one immutable `Hardware`: achieved rates in SI units
(FLOP/s, bytes/s, seconds), the calibration's efficiencies already applied.

A CPU "GPU" is a process of a local gloo cluster. When a node's ranks need more threads than the
machine has cores (`HardwareOverrides.cpu_cores`, `rank_threads`), the operating system gives
every thread an equal share of the cores, so each rank computes and runs its host code at that
share of the speed it was profiled at: its speed while all ranks work. Time slicing also lets
ranks drift apart between collectives, so a collective waits for its slowest rank
(`cost_models.comm.skew_wait_s`, from the profiled `skew_ms_per_sqrt_s`); ranks with cores or
devices of their own do not drift.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.calibration import Calibration, Coefficients
from plans.cluster import ClusterSpec
from plans.hardware import GpuSpec, gpu_spec

GBIT = 1e9 / 8  # bytes per Gbit


@dataclass(frozen=True)
class Hardware:
    """Achieved rates of one accelerator type in one cluster."""

    peak_flops: float  # datasheet (or profiled) dense FLOP/s
    gemm_flops: float  # what a large, well-shaped GEMM reaches
    attn_flops: float  # what fused attention reaches
    mem_bytes_s: float  # what a streaming kernel reaches
    elementwise_bytes_s: float  # modeled bytes per second of a layer's memory-bound kernels
    intra_bytes_s: float  # collective bus bandwidth over NVLink, per GPU
    node_net_bytes_s: float  # collective bandwidth of all NICs of one node
    intra_latency_s: float
    inter_latency_s: float
    gpus_per_node: int
    sm_count: int | None
    kernel_latency_s: float
    attn_head_s: float  # fused attention softmax, per (sequence, head) (0 where hidden under the matmuls)
    attn_score_s: float  # and per score
    host_kernel_s: float
    host_backward_kernel_s: float  # per kernel of a layer's backward
    host_decode_kernel_s: float  # per kernel of a layer's decode step
    host_collective_s: float
    host_overlap: float
    microbatch_overhead_s: float
    decode_step_overhead_s: float
    step_overhead_s: float
    mem_capacity_bytes: int
    skew_s_per_sqrt_s: float = 0.0  # std of a rank's lag after 1 s of work on shared cores (0: no drift)
    skew_slice_s: float = 1e-3  # below this much work the lag grows linearly
    # The fused attention kernel whose published speed by head dim and keys times attention on
    # this architecture (`cost_models.attention`); None: `attn_flops` for every length.
    attn_kernel: str | None = None
    arch: str = ""
    # That curve times `attn_anchor` (1: as published; a GPU profile's measured level otherwise),
    # never above `attn_cap_flops` (the calibration's rate for the shipped one: the uncalibrated
    # runtime's conservative share; none for a profile, which measured one length only).
    attn_anchor: float = 1.0
    attn_cap_flops: float = float("inf")


def matmul_ceiling_ratio(sheet: GpuSpec, cal: Calibration) -> float:
    """How a GEMM efficiency fitted on `cal.fitted_on` carries to `sheet`'s GPU: a GEMM reaches the
    same share of each GPU's matmul ceiling (its maximum achievable matmul FLOPS), not of its
    datasheet peak; an H100 reaches 80.3% of its peak at best where an A100 reaches 86.9%. 1 where
    either ceiling is unpublished, the calibration names no GPU, or a measured peak overrides the
    datasheet's (a profile's own figures)."""
    if cal.fitted_on is None or cal.hardware.peak_tflops is not None:
        return 1.0
    fitted = gpu_spec(cal.fitted_on).matmul_ceiling
    if fitted is None or sheet.matmul_ceiling is None:
        return 1.0
    return sheet.matmul_ceiling / fitted


def effective_hardware(cluster: ClusterSpec, cal: Calibration, *, busy: int | None = None) -> Hardware:
    """Combine datasheet, cluster overrides and calibration into achieved rates, while `busy` ranks
    of each node work (`core_share`; default: all of them)."""
    sheet = cluster.sheet
    hw = cal.hardware
    co: Coefficients = cal.coefficients
    assert cluster.intra_node_gbps is not None and cluster.inter_node_gbps is not None  # filled by the schema
    peak = (hw.peak_tflops or sheet.peak_tflops) * 1e12
    hbm = (hw.hbm_gb_s or sheet.hbm_gb_s) * 1e9
    # The cluster's stated bandwidths win over a profile's only when the user overrode them.
    intra_gbps = cluster.intra_node_gbps if cluster.intra_node_gbps != sheet.nvlink_gbps else (hw.intra_node_gbps or cluster.intra_node_gbps)
    inter_gbps = cluster.inter_node_gbps if cluster.inter_node_gbps != sheet.nic_gbps_per_node else (hw.inter_node_gbps or cluster.inter_node_gbps)
    intra_lat = hw.intra_latency_us if hw.intra_latency_us is not None else sheet.nvlink_latency_us
    inter_lat = hw.inter_latency_us if hw.inter_latency_us is not None else sheet.net_latency_us
    share = core_share(cluster, cal, busy=busy)
    gemm = co.gemm_efficiency * matmul_ceiling_ratio(sheet, cal)
    return Hardware(
        peak_flops=peak,
        gemm_flops=peak * gemm * share,
        attn_flops=peak * gemm * co.attention_efficiency * share,
        mem_bytes_s=hbm * co.hbm_efficiency * share,
        elementwise_bytes_s=hbm * co.hbm_efficiency * co.elementwise_efficiency * share,
        intra_bytes_s=intra_gbps * GBIT * co.nvlink_efficiency,
        node_net_bytes_s=inter_gbps * GBIT * co.network_efficiency,
        intra_latency_s=intra_lat * 1e-6,
        inter_latency_s=inter_lat * 1e-6,
        gpus_per_node=cluster.gpus_per_node,
        sm_count=sheet.sm_count,
        kernel_latency_s=co.kernel_latency_us * 1e-6,
        attn_head_s=co.attention_head_us * 1e-6 / share,
        attn_score_s=co.attention_score_ns * 1e-9 / share,
        host_kernel_s=co.host_kernel_us * 1e-6 / share,
        host_backward_kernel_s=(co.host_kernel_us if co.host_backward_kernel_us is None
                                else co.host_backward_kernel_us) * 1e-6 / share,
        host_decode_kernel_s=(co.host_kernel_us if co.host_decode_kernel_us is None
                              else co.host_decode_kernel_us) * 1e-6 / share,
        host_collective_s=co.host_collective_us * 1e-6,
        host_overlap=co.host_overlap,
        microbatch_overhead_s=co.microbatch_overhead_ms * 1e-3 / share,
        decode_step_overhead_s=co.decode_step_overhead_ms * 1e-3 / share,
        step_overhead_s=co.step_overhead_ms * 1e-3 / share,
        mem_capacity_bytes=cluster.mem_bytes,
        # Ranks drift apart only while they time-share cores.
        skew_s_per_sqrt_s=(hw.skew_ms_per_sqrt_s or 0.0) * 1e-3 if share < 1 else 0.0,
        skew_slice_s=(hw.skew_slice_ms or 1.0) * 1e-3,
    )


def core_share(cluster: ClusterSpec, cal: Calibration, *, busy: int | None = None) -> float:
    """The fraction of its profiled speed a rank keeps while `busy` ranks of its node work (default:
    all of them): 1 on devices of their own; on a CPU, its share of the cores, cores / (busy ranks x
    threads) up to 1, times what the shared caches and switching leave (`sharing_efficiency`)."""
    hw = cal.hardware
    if hw.cpu_cores is None:
        return 1.0
    threads = hw.rank_threads or 1
    busy = busy or cluster.gpus_per_node
    equal = hw.cpu_cores / (busy * threads)
    return min(1.0, equal) * sharing_efficiency(busy * threads, cores=hw.cpu_cores, full=hw.full_efficiency,
                                                shared=hw.share_efficiency, all_threads=cluster.gpus_per_node * threads)


def sharing_efficiency(threads: int, *, cores: int, full: float | None, shared: float | None, all_threads: int) -> float:
    """The speed a rank keeps, beyond its share of the cores, while `threads` rank threads of a node
    work: 1 alone; `full` (measured by `planner profile`) with as many threads as cores, lost to
    the caches, memory bandwidth and background threads they share; `shared` with all of the
    node's threads time-sharing the cores, which adds the switches. Linear between those points
    (the contention grows with the threads at work), `shared` past the last."""
    full_e, shared_e = full or 1.0, shared or 1.0
    if threads <= 1:
        return 1.0
    if threads <= cores:
        return 1.0 + (full_e - 1.0) * (threads - 1) / max(1, cores - 1)
    if all_threads <= cores or threads >= all_threads:
        return shared_e
    return full_e + (shared_e - full_e) * (threads - cores) / (all_threads - cores)
