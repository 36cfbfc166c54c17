"""Micro-benchmarks of the local devices, written as a calibration (`planner profile`).

Measures what the cost model's coefficients stand for, on this machine: the best GEMM throughput
(the peak the wave model scales), streaming bandwidth (a large copy), fused attention throughput
relative to GEMMs, the host time per small op, and all-reduce latency and bandwidth between
`ranks` local processes (gloo on CPU, NCCL on GPUs), fitted to the alpha-beta model. What a single
machine cannot measure (the network between nodes, framework overheads) keeps the shipped values.

On a CPU there is no separate device: an op's host time includes its execution, so host and
device time add (`host_overlap` 0) and the per-kernel device latency is already in the host time.
A CPU "GPU" is one rank of a local gloo cluster, so everything is measured as a rank runs:

- with the threads a rank has (`rank_threads`: torchrun gives each rank one unless
  OMP_NUM_THREADS says otherwise);
- the framework overheads on the planner's own runtime (`planner.runtime_profile`): host time per
  kernel, per micro-batch, per optimizer step and per generated token, attention's softmax cost
  per (sequence, head) and per score, and the throughput of its eager memory-bound kernels;
- the cores the ranks share (`cpu_cores`) and the threads of a rank (`rank_threads`): a small
  machine may run more rank threads than it has cores, and the cost model then slows each rank
  to its share of the cores while the ranks it shares them with work
  (`cost_models.hardware.core_share`; `planner.simulate` follows which ranks are busy); the
  speed a rank keeps, beyond that share, when as many ranks as cores work (`full_efficiency`:
  shared caches, memory bandwidth, the processes' own threads) and when all of them time-share
  the cores (`share_efficiency`), each measured on the runtime's calls of a small model. Other
  processes are assumed away: on a shared machine their load makes runs slower than predicted;
- how far ranks sharing cores drift apart between collectives (`skew_ms_per_sqrt_s`,
  `skew_slice_ms`; `cost_models.comm.skew_wait_s`): all ranks work, in pairs that meet in a
  small all-reduce after each burst of work; a burst's wait beyond the all-reduce's own time is
  the pair's lag, fitted to ``E[max of 2 normals] * sigma * sqrt(work)`` (linear below a slice).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_models.attention import PROFILE_HEAD_DIM, PROFILE_HEADS, PROFILE_SEQ
from cost_models.calibration import Calibration, Coefficients, HardwareOverrides, default_calibration
from cost_models.comm import expected_max_normal, lag_std
from planner.runtime_profile import attention_softmax, runtime_costs
from plans.errors import PlannerError

# torch.cuda device names -> our presets (substring match, first hit wins)
GPU_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80gb"), ("A100 80GB", "a100-80gb"),
             ("A100", "a100-40gb"), ("V100", "v100-16gb"))
ALLREDUCE_BYTES = (4 * 1024, 256 * 1024, 4 * 1024 * 1024)


def _timed(fn: Callable[[], object], *, budget_s: float, sync: Callable[[], None]) -> float:
    """Median seconds per call of `fn`, repeating within `budget_s` (at least 3 runs)."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_threads(ranks: int) -> int:
    """Threads of one CPU rank: OMP_NUM_THREADS, else what torchrun gives each of several ranks (1),
    else torch's default for a single process."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return 1 if ranks > 1 else torch.get_num_threads()


def _allreduce_worker(rank: int, world: int, port: int, backend: str, budget_s: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        sync = torch.cuda.synchronize if backend == "nccl" else (lambda: None)
        if backend == "gloo":
            torch.set_num_threads(rank_threads(world))
        rows = []
        for nbytes in ALLREDUCE_BYTES:
            buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
            # Every rank must run the same number of collectives: agree on it from a probe.
            probe_t = torch.tensor([_repeat(partial(dist.all_reduce, buf), reps=3, sync=sync)])
            dist.all_reduce(probe_t, op=dist.ReduceOp.MAX)
            reps = int(min(200, max(3, budget_s / len(ALLREDUCE_BYTES) / max(float(probe_t), 1e-6))))
            t = torch.tensor([_repeat(partial(dist.all_reduce, buf), reps=reps, sync=sync)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the collective's time
            rows.append((nbytes, float(t)))
        if rank == 0:
            np.savetxt(out, np.array(rows))
    finally:
        dist.destroy_process_group()


SKEW_BURSTS_MS = (0.0, 2.0, 5.0, 10.0, 20.0, 40.0)  # work between a pair's meetings, at the loaded speed


def _skew_worker(rank: int, world: int, port: int, budget_s: float, out: str) -> None:
    """Every rank works in bursts; rank pairs (0,1), (2,3)... meet in an all-reduce of a few
    bytes after each (an odd last rank works alone, keeping the load). Rank 0 writes, per burst
    length, the ranks' mean (work wall time, wait in the all-reduce) in ms."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(rank_threads(world))
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]
        mine = pairs[rank // 2] if rank // 2 < len(pairs) else None
        a, flag = torch.randn(96, 96), torch.zeros(8)
        dist.barrier()  # time the work while every rank works, agreeing on the slowest
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < min(0.5, budget_s / 10):
            a @ a
            n += 1
        per_op = torch.tensor([(time.perf_counter() - t0) / n])
        dist.all_reduce(per_op, op=dist.ReduceOp.MAX)
        rows = []
        for burst_ms in SKEW_BURSTS_MS:
            ops = int(burst_ms * 1e-3 / float(per_op))
            reps = int(min(200, max(12, budget_s / len(SKEW_BURSTS_MS) / (burst_ms * 1e-3 + 2e-3))))
            work, wait = [], []
            dist.barrier()
            for i in range(reps + 2):  # two to warm up
                t0 = time.perf_counter()
                for _ in range(ops):
                    a @ a
                t1 = time.perf_counter()
                if mine is not None:
                    dist.all_reduce(flag, group=mine)
                if i >= 2:
                    work.append(t1 - t0)
                    wait.append(time.perf_counter() - t1)
            got = torch.tensor([float(np.mean(work)), float(np.mean(wait)) if mine is not None else 0.0])
            dist.all_reduce(got)
            rows.append((float(got[0]) / world * 1e3, float(got[1]) / (2 * len(pairs)) * 1e3))
        if rank == 0:
            np.savetxt(out, np.array(rows))
    finally:
        dist.destroy_process_group()


def fit_skew(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """(sigma ms per sqrt(s), slice ms) of the lag model fitted to (work ms, wait ms) rows.

    The wait after the shortest work is the all-reduce itself; the rest of each wait is the
    pair's lag, ``E[max of 2 normals] * lag_std(work)``: least squares on sigma for each slice
    on a grid, keeping the best. No wait beyond the all-reduce: sigma 0."""
    base_work, base_wait = min(rows)
    pts = [(w - base_work, max(0.0, t - base_wait)) for w, t in rows if w > base_work]
    best = (0.0, 1.0, sum(y * y for _, y in pts))
    for q in (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0):
        f = [expected_max_normal(2) * lag_std(w / 1e3, sigma=1.0, slice_=q / 1e3) for w, _ in pts]
        den = sum(x * x for x in f)
        if den <= 0:
            continue
        sigma = max(0.0, sum(x * y for x, (_, y) in zip(f, pts)) / den)
        sse = sum((sigma * x - y) ** 2 for x, (_, y) in zip(f, pts))
        if sse < best[2]:
            best = (sigma, q, sse)
    return round(best[0], 4), best[1]


def measure_skew(*, ranks: int, budget_s: float) -> list[tuple[float, float]]:
    """(work ms, wait ms) per burst length, `ranks` gloo processes working in pairs (`_skew_worker`)."""
    return [(float(w), float(t)) for w, t in _spawn(_skew_worker, ranks=ranks, budget_s=budget_s, what="skew", backend="gloo",
                                                    hint="run with --ranks 1 to skip measurements between ranks")]


def _spawn(target: Callable[..., None], *, ranks: int, budget_s: float, what: str, backend: str, hint: str,
           args: tuple = ()) -> np.ndarray:
    """Run `target(rank, ranks, port, *args, budget_s, out)` in `ranks` processes; the rows rank 0 saved."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / f"{what}.txt")
        ctx = mp.get_context("spawn")
        port = _free_port()
        procs = [ctx.Process(target=target, args=(r, ranks, port, *args, budget_s, out)) for r in range(ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120 + budget_s * 4)
        failed = [p.exitcode for p in procs if p.exitcode != 0]
        for p in procs:
            if p.is_alive():
                p.kill()
        if failed or not Path(out).exists():
            raise PlannerError(f"the {what} benchmark between {ranks} {backend} processes failed (exit codes {failed})",
                               hint=hint)
        return np.loadtxt(out, ndmin=2)


# Representative small-model work for the sharing measurement: the probe model's forward, train
# step and generation of a few short sequences (as the tiny plans' calls: host work and small
# GEMMs that live in the caches the processes share).
SHARE_WORK = {"seqs": 4, "prompt": 8, "gen": 8}


def _calls_seconds(budget_s: float) -> float:
    """Median seconds of one round of the runtime's forward, train step and generation of the
    probe model over about `budget_s`."""
    from planner.runtime_profile import PROBE, call_fns

    fns = list(call_fns(PROBE, **SHARE_WORK).values())
    for fn in fns:
        fn()
    rounds: list[float] = []
    end = time.perf_counter() + budget_s
    while time.perf_counter() < end or len(rounds) < 5:
        t0 = time.perf_counter()
        for fn in fns:
            fn()
        rounds.append(time.perf_counter() - t0)
    return float(np.median(rounds))


def _share_worker(rank: int, ranks: int, port: int, budget_s: float, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # As a rank runs: with its gloo process group (and that group's threads) up.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        dist.barrier()
        mine = _calls_seconds(budget_s)
        each: list[float | None] = [None] * ranks
        dist.all_gather_object(each, mine)
        if rank == 0:
            np.savetxt(out, np.array([each]))
    finally:
        dist.destroy_process_group()


def measure_core_share(*, ranks: int, budget_s: float) -> float:
    """The speed each of `ranks` single-thread processes keeps while all of them run the
    runtime's calls of a small model at once, relative to one process alone (the median over
    the processes)."""
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _calls_seconds(budget_s / 2)
    finally:
        torch.set_num_threads(torch_threads)
    each = _spawn(_share_worker, ranks=ranks, budget_s=budget_s, what="core-sharing", backend="gloo",
                  hint="run with --ranks 1 to skip measurements between ranks")
    return alone / float(np.median(each))


def _repeat(fn: Callable[[], object], *, reps: int, sync: Callable[[], None]) -> float:
    """Median seconds per call of `fn` over exactly `reps` calls after one warm-up."""
    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def allreduce_alpha_beta(times: list[tuple[int, float]], ranks: int) -> tuple[float, float]:
    """(latency per ring step s, bus bandwidth bytes/s) fitted to ring all-reduce times.

    Ring all-reduce: ``t = 2(n-1) * alpha + 2(n-1)/n * S / B``; least squares on (alpha, 1/B),
    both kept positive.
    """
    steps = 2 * (ranks - 1)
    a = np.array([[steps, steps / ranks * s] for s, _ in times], dtype=float)
    y = np.array([t for _, t in times], dtype=float)
    (alpha, inv_bw), *_ = np.linalg.lstsq(a, y, rcond=None)
    inv_bw = max(float(inv_bw), 1e-15)
    alpha = max(float(alpha), 0.0)
    return alpha, 1.0 / inv_bw


def measure_allreduce(*, ranks: int, backend: str, budget_s: float) -> list[tuple[int, float]]:
    """All-reduce times by message size between `ranks` local processes."""
    rows = _spawn(_allreduce_worker, ranks=ranks, budget_s=budget_s, what="all-reduce", backend=backend,
                  hint="run with --ranks 1 to skip collectives", args=(backend,))
    return [(int(s), float(t)) for s, t in rows]


def _peak_and_bandwidth(dev: torch.device, *, dtype: torch.dtype, sync: Callable[[], None],
                        budget_s: float) -> tuple[float, float]:
    """(best GEMM FLOP/s, streaming bytes/s read + written) on `dev`."""
    cuda = dev.type == "cuda"
    sizes = (1024, 4096, 8192) if cuda else (128, 256, 512)
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
        t = _timed(partial(torch.matmul, a, b), budget_s=budget_s / 2 / len(sizes), sync=sync)
        best = max(best, 2.0 * n**3 / t)
    n_bytes = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(n_bytes // 4, device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), budget_s=budget_s / 2, sync=sync)
    return best, 2.0 * n_bytes / t


def profile_devices(*, budget_s: float, ranks: int, device: str | None = None,
                    progress: Callable[[str], None] = lambda _: None) -> Calibration:
    """Run the micro-benchmarks on the local device and return them as a calibration."""
    use_cuda = device == "cuda" or (device is None and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise PlannerError("--device cuda asked for, but torch sees no CUDA device")
    if use_cuda:
        return _profile_cuda(budget_s=budget_s, ranks=ranks, progress=progress)
    before = torch.get_num_threads()
    torch.set_num_threads(rank_threads(ranks))
    try:
        return _profile_cpu(budget_s=budget_s, ranks=ranks, progress=progress)
    finally:
        torch.set_num_threads(before)


def _profile_cuda(*, budget_s: float, ranks: int, progress: Callable[[str], None]) -> Calibration:
    dev, sync, dtype = torch.device("cuda"), torch.cuda.synchronize, torch.bfloat16
    name = torch.cuda.get_device_name()
    gpu = next((preset for key, preset in GPU_NAMES if key in name), None)
    share = budget_s / 6

    progress("GEMM throughput and memory bandwidth")
    best, mem_bw = _peak_and_bandwidth(dev, dtype=dtype, sync=sync, budget_s=2 * share)

    progress("attention")
    heads, s, d = PROFILE_HEADS, PROFILE_SEQ, PROFILE_HEAD_DIM  # the point the attention curves are anchored at
    q = torch.randn(1, heads, s, d, device=dev, dtype=dtype)
    t = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), budget_s=share, sync=sync)
    attn_eff = min(1.0, (4.0 * heads * s * s * d * 0.5 / t) / best)

    progress("per-op host time")
    tiny = torch.ones(1, device=dev)
    reps = 200
    t = _timed(lambda: [tiny.add_(1.0) for _ in range(reps)], budget_s=share, sync=sync) / reps
    host_us = t * 1e6

    base = default_calibration().coefficients  # what a profile cannot measure keeps the fitted values
    hw = dict(peak_tflops=best / 1e12, hbm_gb_s=mem_bw / 1e9)
    coef = base.model_dump()
    coef.update(gemm_efficiency=1.0, hbm_efficiency=1.0, attention_efficiency=round(attn_eff, 4), host_kernel_us=round(host_us, 3))
    if ranks > 1:
        progress(f"all-reduce between {ranks} processes")
        times = measure_allreduce(ranks=ranks, backend="nccl", budget_s=2 * share)
        alpha, bw = allreduce_alpha_beta(times, ranks)
        hw.update(intra_node_gbps=bw * 8 / 1e9, intra_latency_us=alpha * 1e6)
        coef.update(nvlink_efficiency=1.0)
    return Calibration(
        gpu=gpu, framework="torch", source=f"planner profile on {name} ({ranks} ranks)",
        coefficients=Coefficients(**coef),
        hardware=HardwareOverrides(**{k: round(v, 6) for k, v in hw.items()}),
    )


def _profile_cpu(*, budget_s: float, ranks: int, progress: Callable[[str], None]) -> Calibration:
    part = budget_s / 6
    threads = torch.get_num_threads()

    progress("GEMM throughput and memory bandwidth")
    best, mem_bw = _peak_and_bandwidth(torch.device("cpu"), dtype=torch.float32, sync=lambda: None, budget_s=part)
    progress("attention")
    head_s, score_s = attention_softmax(peak_flops=best, budget_s=part)

    # What a CPU cannot show (the network, NVLink) keeps the fitted values; the CPU has no
    # separate device, so nothing overlaps and a kernel has no launch latency of its own.
    coef = default_calibration().coefficients.model_copy(update=dict(
        gemm_efficiency=1.0, hbm_efficiency=1.0, attention_efficiency=1.0, kernel_latency_us=0.0, host_overlap=0.0,
        host_collective_us=0.0, attention_head_us=round(head_s * 1e6, 4), attention_score_ns=round(score_s * 1e9, 4)))
    hw = HardwareOverrides(peak_tflops=round(best / 1e12, 6), hbm_gb_s=round(mem_bw / 1e9, 6))

    progress("the runtime's host and eager costs")
    costs = runtime_costs(hw, coef, budget_s=2 * part)
    coef = coef.model_copy(update=dict(host_kernel_us=costs.host_kernel_us,
                                       host_backward_kernel_us=costs.host_backward_kernel_us,
                                       host_decode_kernel_us=costs.host_decode_kernel_us,
                                       microbatch_overhead_ms=costs.microbatch_overhead_ms,
                                       step_overhead_ms=costs.step_overhead_ms,
                                       decode_step_overhead_ms=costs.decode_step_overhead_ms,
                                       elementwise_efficiency=costs.elementwise_efficiency))
    if ranks > 1:
        progress(f"all-reduce between {ranks} processes")
        times = measure_allreduce(ranks=ranks, backend="gloo", budget_s=2 * part)
        alpha, bw = allreduce_alpha_beta(times, ranks)
        hw = hw.model_copy(update=dict(intra_node_gbps=round(bw * 8 / 1e9, 6), intra_latency_us=round(alpha * 1e6, 6)))
        coef = coef.model_copy(update=dict(nvlink_efficiency=1.0))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    hw = hw.model_copy(update=dict(cpu_cores=cores, rank_threads=threads))
    if ranks > 1 and ranks * threads > cores:  # ranks time-share the cores: how far they drift apart
        progress(f"drift between {ranks} processes sharing {cores} cores")
        sigma, slice_ms = fit_skew(measure_skew(ranks=ranks, budget_s=part))
        hw = hw.model_copy(update=dict(skew_ms_per_sqrt_s=sigma, skew_slice_ms=slice_ms))
        progress(f"the runtime's calls on {ranks} processes sharing {cores} cores")
        equal = cores / (ranks * threads)
        efficiency = min(1.0, max(0.05, measure_core_share(ranks=ranks, budget_s=part) / equal))
        hw = hw.model_copy(update=dict(share_efficiency=round(efficiency, 4)))
    full_ranks = min(ranks, cores // threads)
    if full_ranks > 1:  # as many processes as cores: no time-sharing, but shared caches and bandwidth
        progress(f"the runtime's calls on {full_ranks} processes, a core each")
        full = min(1.0, max(0.05, measure_core_share(ranks=full_ranks, budget_s=part)))
        hw = hw.model_copy(update=dict(full_efficiency=round(full, 4)))
    return Calibration(
        gpu="cpu", framework="torch", source=f"planner profile on cpu ({ranks} ranks of {threads} thread(s))",
        coefficients=Coefficients.model_validate(coef.model_dump()),
        hardware=HardwareOverrides.model_validate(hw.model_dump()),
    )
