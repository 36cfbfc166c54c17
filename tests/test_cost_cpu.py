"""The cost model's treatment of a CPU cluster and of the planner's eager runtime, by closed forms.

A profiled CPU calibration adds: ranks sharing fewer cores than they have threads, attention's
softmax work per (sequence, head) and per score, an efficiency of the eager memory-bound kernels,
a host overhead per generated token, the drift of ranks time-sharing cores that makes each
collective wait for the rank furthest behind; and the `torch` framework's ZeRO-3 gathers layer by
layer without prefetch. Each term is zero or one in the GPU calibrations, so those predictions stay.
"""

from __future__ import annotations

import math

import pytest

from cost_models import Calibration, CostModel
from cost_models.calibration import Coefficients, HardwareOverrides, default_calibration
from cost_models.comm import all_gather_s, reduce_scatter_s
from cost_models.compute import kernel_time_s
from cost_models.framework import resolve_framework
from cost_models.ops import FLASH_BWD_FLOPS_RATIO, layer_work
from plans import Call, Layout, Mesh, ModelDecl, parse_cluster, resolve_model
from tests.machine import facts

TINY = resolve_model("tiny-llama")
CPU4 = parse_cluster("cpu:1x4")
COEF = Coefficients(gemm_efficiency=1.0, attention_efficiency=1.0, hbm_efficiency=1.0, nvlink_efficiency=1.0,
                    network_efficiency=1.0, kernel_latency_us=0.0, host_kernel_us=20.0, host_collective_us=0.0,
                    host_overlap=0.0, microbatch_overhead_ms=0.1, step_overhead_ms=0.3)
HW = HardwareOverrides(peak_tflops=0.1, hbm_gb_s=30.0, intra_node_gbps=8.0, intra_latency_us=100.0)
INFER = Call(name="i", model="m", kind="inference", seqs=16, seq_len=16, returns="logprobs")
TRAIN = Call(name="t", model="m", kind="train", seqs=16, seq_len=16, loss="sft")
DECL = ModelDecl(spec=TINY, trainable=True)


def cost_model(cluster=CPU4, *, hw: dict | None = None, **coef: float) -> CostModel:  # noqa: ANN001
    return CostModel(cluster, Calibration(gpu="cpu", framework="torch", coefficients=COEF.model_copy(update=coef),
                                          hardware=HW.model_copy(update=hw or {})))


def test_ranks_sharing_fewer_cores_run_at_their_share():
    alone = cost_model().call_cost(INFER, DECL, Mesh.block(0, 1), Layout())
    shared = cost_model(hw={"cpu_cores": 2, "rank_threads": 1}).call_cost(INFER, DECL, Mesh.block(0, 1), Layout())
    assert shared.time_s == pytest.approx(2 * alone.time_s, rel=1e-12)  # 4 ranks on 2 cores: half speed
    two = cost_model(parse_cluster("cpu:1x2"), hw={"cpu_cores": 2, "rank_threads": 1})
    assert two.call_cost(INFER, DECL, Mesh.block(0, 1), Layout()).time_s == pytest.approx(alone.time_s, rel=1e-12)
    threads = cost_model(parse_cluster("cpu:1x2"), hw={"cpu_cores": 2, "rank_threads": 2})
    assert threads.call_cost(INFER, DECL, Mesh.block(0, 1), Layout()).time_s == pytest.approx(2 * alone.time_s)


def test_attention_softmax_per_head_and_per_score_in_each_pass():
    fw = resolve_framework("torch")
    w = layer_work(TINY, fw, b=16, s=16, tp=1, cp=1, sp=False)
    (fwd,) = [k for k in w.fwd if k.kind == "attn"]
    (bwd,) = [k for k in w.bwd if k.kind == "attn"]
    pairs, scores = 16 * TINY.num_attention_heads, 16 * TINY.num_attention_heads * 16 * 17 / 2  # causal half
    assert (fwd.batch, fwd.scores, fwd.passes) == (pairs, scores, 1.0)
    assert (bwd.scores, bwd.passes) == (scores, FLASH_BWD_FLOPS_RATIO)
    plain, soft = cost_model().hw, cost_model(attention_head_us=0.7, attention_score_ns=2.5).hw
    assert kernel_time_s(fwd, soft) - kernel_time_s(fwd, plain) == pytest.approx(pairs * 0.7e-6 + scores * 2.5e-9)
    assert kernel_time_s(bwd, soft) - kernel_time_s(bwd, plain) == \
        pytest.approx(FLASH_BWD_FLOPS_RATIO * (pairs * 0.7e-6 + scores * 2.5e-9))


def test_elementwise_efficiency_slows_only_memory_bound_kernels():
    fw = resolve_framework("torch")
    w = layer_work(TINY, fw, b=16, s=16, tp=1, cp=1, sp=False)
    full, tenth = cost_model().hw, cost_model(elementwise_efficiency=0.1).hw
    for k in w.fwd:
        if k.bytes == k.flops == 0:  # a kernel of one value per token: its launch only, the same at any efficiency
            assert kernel_time_s(k, tenth) == kernel_time_s(k, full)
            continue
        ratio = kernel_time_s(k, tenth) / kernel_time_s(k, full)
        assert ratio == pytest.approx(10.0 if k.kind == "mem" else 1.0)
    assert any(k.bytes == 0 for k in w.fwd) and any(k.kind == "mem" and k.bytes > 0 for k in w.fwd)


def test_generation_decodes_gen_len_minus_one_steps_and_pays_a_host_overhead_per_token():
    def parts(gen_len: int, **coef: float) -> dict[str, float]:
        call = Call(name="g", model="m", kind="generate", seqs=16, seq_len=8 + gen_len, gen_len=gen_len)
        return cost_model(**coef).call_cost(call, DECL, Mesh.block(0, 1), Layout()).breakdown_s

    assert "decode" not in parts(1)  # the prefill's logits give the only token
    one, two = parts(2), parts(3)
    assert two["decode"] == pytest.approx(2 * one["decode"], rel=0.05)  # 2 decode steps against 1 (context grows)
    with_overhead = parts(3, decode_step_overhead_ms=0.2)
    assert with_overhead["overhead"] - two.get("overhead", 0.0) == pytest.approx(3 * 0.2e-3)


def test_torch_zero3_prefetches_the_next_gather():
    """tiny-llama (4 layers) dp2 ZeRO-3, one micro-batch: the runtime starts each parameter group's
    all-gather one use ahead, under the compute before it. Without prefetch the 7 groups (4 layers,
    embeddings, final norm, head) would each be gathered in the forward and reduce-scattered in
    the backward as blocking collectives."""
    import dataclasses

    cm = cost_model(parse_cluster("cpu:1x2"))
    fw = resolve_framework("torch")
    assert fw.zero3_prefetch
    blocking = CostModel(parse_cluster("cpu:1x2"), cm.calibration,
                         framework=dataclasses.replace(fw, name="blocking", zero3_prefetch=False))
    cost = blocking.call_cost(TRAIN, DECL, Mesh.block(0, 2), Layout(dp=2, zero=3))
    g = cm.group(Mesh.block(0, 2), Layout(dp=2, zero=3), "dpcp")
    params = TINY.num_params()  # one stage holds every parameter
    expected = 7 * all_gather_s(params * fw.param_bytes / 7, g, cm.hw) + 7 * reduce_scatter_s(params * fw.grad_bytes / 7, g, cm.hw)
    assert cost.breakdown_s["dp_comm"] == pytest.approx(expected, rel=1e-6)
    assert cm.call_cost(TRAIN, DECL, Mesh.block(0, 2), Layout(dp=2, zero=3)).breakdown_s["dp_comm"] < expected


def test_gpu_calibrations_have_none_of_the_cpu_terms():
    cal = default_calibration()
    co, hw = cal.coefficients, cal.hardware
    assert (co.elementwise_efficiency, co.attention_head_us, co.attention_score_ns, co.decode_step_overhead_ms) == (1, 0, 0, 0)
    assert hw.cpu_cores is None and hw.rank_threads is None and hw.skew_ms_per_sqrt_s is None


def _hw(**over: float):  # noqa: ANN202
    from cost_models.hardware import effective_hardware

    cal = Calibration(gpu="cpu", framework="torch", coefficients=COEF, hardware=HW.model_copy(update=over))
    return effective_hardware(CPU4, cal)


def test_a_collective_waits_for_the_rank_furthest_behind():
    from cost_models.comm import expected_max_normal, skew_wait_s

    hw = _hw(cpu_cores=2, rank_threads=1, skew_ms_per_sqrt_s=50.0, skew_slice_ms=4.0)
    assert expected_max_normal(1) == 0 and expected_max_normal(2) == pytest.approx(1 / math.pi**0.5, rel=1e-6)
    assert expected_max_normal(4) == pytest.approx(1.0294, abs=1e-4)  # tables of normal order statistics
    # A random walk of time slices: sigma * sqrt(work) from one slice on, linear below it.
    assert skew_wait_s(0.016, 2, hw) == pytest.approx(0.050 * 0.016**0.5 / math.pi**0.5)
    assert skew_wait_s(0.002, 2, hw) == pytest.approx(0.050 * 0.002 / 0.004**0.5 / math.pi**0.5)
    assert skew_wait_s(0.004 - 1e-12, 2, hw) == pytest.approx(skew_wait_s(0.004, 2, hw))  # continuous at a slice
    assert skew_wait_s(0.016, 4, hw) > skew_wait_s(0.016, 2, hw) > 0
    assert skew_wait_s(0.016, 1, hw) == 0 == skew_wait_s(0.0, 2, hw)
    # Ranks with cores of their own (4 ranks, 4 cores) or no measured drift do not drift.
    assert _hw(cpu_cores=4, rank_threads=1, skew_ms_per_sqrt_s=50.0).skew_s_per_sqrt_s == 0
    assert _hw(cpu_cores=2, rank_threads=1).skew_s_per_sqrt_s == 0


def test_drift_slows_only_calls_whose_ranks_meet():
    drift = {"cpu_cores": 2, "rank_threads": 1, "skew_ms_per_sqrt_s": 50.0, "skew_slice_ms": 2.0}
    steady = {"cpu_cores": 2, "rank_threads": 1}
    zero2 = Layout(dp=2, zero=2)
    with_drift = cost_model(hw=drift).call_cost(TRAIN, DECL, Mesh.block(0, 2), zero2)
    without = cost_model(hw=steady).call_cost(TRAIN, DECL, Mesh.block(0, 2), zero2)
    # the gradient reduction after the whole step's work, the weight gather after the optimizer
    assert with_drift.breakdown_s["dp_comm"] > without.breakdown_s["dp_comm"] + 0.050 * 0.001**0.5 / math.pi**0.5
    assert with_drift.time_s - without.time_s == pytest.approx(
        with_drift.breakdown_s["dp_comm"] - without.breakdown_s["dp_comm"])
    for call, mesh, layout in ((INFER, Mesh.block(0, 2), Layout(dp=2)), (TRAIN, Mesh.block(0, 1), Layout())):
        a = cost_model(hw=drift).call_cost(call, DECL, mesh, layout).time_s
        assert a == cost_model(hw=steady).call_cost(call, DECL, mesh, layout).time_s  # no collective, no wait
    tp2 = Layout(tp=2)  # tensor parallel meets in every layer
    assert cost_model(hw=drift).call_cost(INFER, DECL, Mesh.block(0, 2), tp2).time_s > \
        cost_model(hw=steady).call_cost(INFER, DECL, Mesh.block(0, 2), tp2).time_s


def test_fit_skew_recovers_the_drift_of_synthetic_measurements():
    from cost_models.comm import expected_max_normal
    from planner.profiling import fit_skew

    def wait_ms(work_ms: float, sigma: float, q: float) -> float:
        lag = sigma * ((work_ms / 1e3) ** 0.5 if work_ms >= q else work_ms / 1e3 / (q / 1e3) ** 0.5)
        return 0.7 + expected_max_normal(2) * lag  # 0.7 ms: the all-reduce itself

    rows = [(w, wait_ms(w, 55.0, 3.0)) for w in (0.0, 1.0, 2.5, 6.0, 14.0, 28.0)]
    sigma, q = fit_skew(rows)
    assert sigma == pytest.approx(55.0, rel=1e-3) and q == 3.0
    assert fit_skew([(w, 0.7) for w, _ in rows]) == (0.0, 1.0)  # no wait beyond the all-reduce: no drift


@pytest.mark.slow
def test_measure_skew_runs_pairs_and_a_lone_rank():
    from planner.profiling import SKEW_BURSTS_MS, measure_skew

    rows = measure_skew(ranks=3, budget_s=0.3)  # ranks 0 and 1 meet; rank 2 works alone
    # Wall times depend on the machine's load, so only what no load can change is checked: one row
    # per burst length, the burst without work is shorter than the longest, every all-reduce takes time.
    assert len(rows) == len(SKEW_BURSTS_MS), facts()
    works = [w for w, _ in rows]
    assert all(w >= 0 for w in works) and works[0] < works[-1], (rows, facts())
    assert all(t > 0 for _, t in rows), (rows, facts())
