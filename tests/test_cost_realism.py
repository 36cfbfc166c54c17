"""What keeps the cost model's numbers believable: no dense model above 60% MFU, plans that keep
a memory headroom, and the memory outside tensors (context, NCCL buffers, fragmentation)."""

from __future__ import annotations

import itertools

import pytest

from cost_models import CostModel
from cost_models.calibration import default_calibration
from cost_models.estimate import estimate_training, training_layout
from cost_models.measured import read_measured
from planner.algorithms import ppo
from planner.compile import compile_graph
from plans import Layout, Mesh, parse_cluster, resolve_model
from plans.cluster import default_headroom_gib
from plans.errors import PlannerError
from plans.graph import Call, ModelDecl
from plans.hardware import GIB

MFU_CAP = 0.60
# Published measurements above the cap, by (model, gpu, framework). Megatron-LM's best in Narayanan
# et al. 2021, Table 1 is 163 TFLOP/s per A100 counting the recompute (52%). The runtime's closest
# published relative, an eager PyTorch FSDP stack with fp32 weights under bf16 autocast and fused
# attention (MosaicML llm-foundry, MPT-7B on 8 A100-80GB, sequence 2048, no checkpointing,
# scripts/train/benchmarking/README.md): 4,641 tokens/s per GPU, 64.2% MFU as published; 64.1% by
# these estimates' own convention (`cost_models.api.model_flops`: 6N plus attention over every
# key, which is how llm-foundry counts it too; MPT-7B's N differs by its embedding). For the 7-8B
# models on A100s that is the cap.
FSDP_7B_A100 = 0.641
PUBLISHED_ABOVE_CAP: dict[tuple[str, str, str], float] = {
    (model, "a100-80gb", "torch"): FSDP_7B_A100 for model in ("llama-2-7b", "llama-3-8b", "qwen2.5-7b")}

MODELS = ("llama-2-7b", "llama-3-8b", "qwen2.5-7b", "llama-3-70b")
GPUS = ("a100-80gb", "h100-sxm")
FRAMEWORKS = ("torch", "megatron")
# (tp, pp) on 8 and 32 GPUs; sequence lengths; micro-batches; ZeRO stages; recompute modes.
SHAPES = ((1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (8, 4))
SEQS = (2048, 8192)
MICRO = (1, 2, 4)


def mfu_cases(frameworks: tuple[str, ...] = FRAMEWORKS):
    for model, gpu, fw, nodes, (tp, pp), seq, mb, zero, rec in itertools.product(
            MODELS, GPUS, frameworks, (1, 4), SHAPES, SEQS, MICRO, (0, 1, 3), ("none", "full")):
        n = 8 * nodes
        if tp * pp > n:
            continue
        yield model, gpu, fw, n, tp, pp, seq, mb, zero, rec


def fitting_estimates(frameworks: tuple[str, ...] = FRAMEWORKS):
    """(model, gpu, framework, layout, sequence, estimate) of every grid case that fits in memory."""
    for model, gpu, fw, n, tp, pp, seq, mb, zero, rec in mfu_cases(frameworks):
        spec = resolve_model(model)
        cl = parse_cluster(f"{gpu}:{n // 8}x8")
        dp = n // (tp * pp)
        gb = dp * mb * max(8, 2 * pp)
        try:
            lay = training_layout(spec, cl, tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=gb, seq_len=seq,
                                  recompute=rec, zero=zero, sequence_parallel=tp > 1)
        except PlannerError:
            continue  # a layout the model cannot take (heads over tp, layers over pp)
        est = estimate_training(spec, cl, lay, global_batch=gb, seq_len=seq, framework=fw)
        if est.fits:
            yield model, gpu, fw, lay, seq, est


def test_no_dense_estimate_above_60_percent_mfu():
    """Every case of the grid above that fits in memory: 4 dense models x A100/H100 x the runtime
    (`torch`) and Megatron-LM x 8 and 32 GPUs x 6 (tp, pp) shapes x 2k/8k tokens x micro-batch
    1/2/4 x ZeRO 0/1/3 x no or full recompute."""
    checked, worst = 0, (0.0, None)
    best = dict.fromkeys(FRAMEWORKS, 0.0)
    over = []  # above 60%, under a published figure (none since the eager activations: the README says so)
    for model, gpu, fw, lay, seq, est in fitting_estimates():
        n = lay.dp * lay.tp * lay.pp
        checked += 1
        cap = PUBLISHED_ABOVE_CAP.get((model, gpu, fw), MFU_CAP)
        assert est.mfu <= cap, f"{model} on {n} {gpu} ({fw}) {lay.short()} seq {seq}: MFU {est.mfu:.1%}"
        worst = max(worst, (est.mfu, (model, gpu, fw, lay.short(), seq)))
        best[fw] = max(best[fw], est.mfu)
        if est.mfu > MFU_CAP:
            over.append((est.mfu, gpu, fw, seq))
    assert checked > 1000, checked
    assert worst[0] > 0.3  # the grid reaches realistic utilisations, not only starved ones
    # The runtime's eager layers keep more for backward than fused kernels, so its fastest layouts
    # of 7-8B models at 8k tokens no longer fit (they reached 60.1-61.2% when its memory was
    # counted as Megatron's); none is above the cap now, the best at 57.3% (56.7% while every
    # hidden collective was charged NCCL's 32 channels of a node, also across nodes; 57.4% before
    # the ends' gradients were accumulated).
    assert over == []
    assert round(worst[0], 3) == 0.573
    # The runtime's own best (README): 50.2% since its collectives carry the fp32 stream where it
    # sends it (50.9% before, 52.3% before its head and embedding were counted as it runs them;
    # Qwen2.5-7B at 8k tokens, dp16 tp2 z1 on 32 A100s).
    assert round(best["torch"], 3) == 0.502


def test_the_megatron_core_estimates_above_the_cap_are_these():
    """The fused `megatron-core` stack is not held to the cap (README, "the 60% MFU cap"): on the
    same grid its estimates above 60% are 7-8B models, 122 on A100s up to 74.0% (within two
    points of FlashAttention-2's published 72% for a 2.7B GPT at 8k tokens on 8 A100s), two
    ZeRO-3 layouts of Llama 3 70B on 32 A100s at 61.5% and 61.9%, and 5 on H100s up to 61.7%. On
    H100s the stack at that scale is published at 60.1% by the estimates' convention: NeMo 24.12
    (Megatron-Core) training Llama 3.1 8B on 8 H100s at 8k tokens in BF16
    (NVIDIA/dgxc-benchmarking v25.03; `bench/cost_accuracy.py`, which prices that very run 7.8%
    faster than published, the model's lean on Hopper). This test lists them, so a change that
    moves them moves the README's figures with it."""
    over: dict[str, list[tuple[float, str]]] = {"a100-80gb": [], "h100-sxm": []}
    checked = 0
    for model, gpu, _, lay, seq, est in fitting_estimates(("megatron-core",)):
        checked += 1
        if est.mfu > MFU_CAP:
            over[gpu].append((est.mfu, f"{model} {lay.short()} seq {seq}"))
    assert checked == 1582  # 1,578 while a communicator across nodes was charged 32 channels of buffers
    seven = {"llama-2-7b", "llama-3-8b", "qwen2.5-7b"}
    assert {case.split()[0] for _, case in over["h100-sxm"]} <= seven
    large = sorted((round(mfu, 3), case) for mfu, case in over["a100-80gb"] if case.split()[0] not in seven)
    assert [(mfu, case.split()[0], "z3" in case) for mfu, case in large] == [
        (0.615, "llama-3-70b", True), (0.619, "llama-3-70b", True)]
    assert (len(over["a100-80gb"]), round(max(over["a100-80gb"])[0], 3)) == (124, 0.740)
    assert (len(over["h100-sxm"]), round(max(over["h100-sxm"])[0], 3)) == (5, 0.617)


def test_the_runtime_is_marked_uncalibrated_on_gpus():
    """Until `bench/gpu_check.sh` calibrates it, the runtime's attention (PyTorch's FlashAttention-2)
    runs at FlashAttention-2's published speed by length, never above the low end of its published
    share of each architecture's peak: 50% on an A100, 35% on an H100 or H200, where it cannot use
    Hopper's asynchronous tensor cores. Stacks fitted on measured runs keep their own ceiling."""
    from cost_models.framework import resolve_framework

    assert not resolve_framework("torch").gpu_calibrated and resolve_framework("megatron").gpu_calibrated
    for gpu, share in (("a100-80gb", 0.50), ("h100-sxm", 0.35), ("h200", 0.35)):
        cm = CostModel(parse_cluster(f"{gpu}:1x8"))
        assert cm.hw.attn_flops == pytest.approx(share * cm.hw.peak_flops), gpu
        assert "not yet calibrated on a GPU" in cm.costed_for()
        core = CostModel(parse_cluster(f"{gpu}:1x8"), framework="megatron-core")
        assert core.hw.attn_flops > share * core.hw.peak_flops, gpu  # fitted: 0.85 of its GEMM rate


def test_gemm_efficiency_carries_to_other_gpus_as_a_share_of_their_matmul_ceiling():
    """The shipped GEMM efficiency was fitted on A100 runs; an H100 reaches 80.3% of its peak at best
    (its maximum achievable matmul FLOPS) where an A100 reaches 86.9%, so on Hopper the GEMMs run at
    the same share of that lower ceiling. A100s are untouched; a calibration that names no GPU, or a
    profile that measured its own peak, is not rescaled; a GPU without a published ceiling keeps
    the fitted share of its peak."""
    from cost_models.calibration import HardwareOverrides
    from cost_models.hardware import effective_hardware

    cal = default_calibration()
    assert cal.fitted_on == "a100-80gb"
    eff = cal.coefficients.gemm_efficiency
    for gpu, share in (("a100-80gb", eff), ("a100-40gb", eff), ("h100-sxm", eff * 0.803 / 0.869),
                       ("h200", eff * 0.803 / 0.869), ("v100-16gb", eff)):
        hw = effective_hardware(parse_cluster(f"{gpu}:1x8"), cal)
        assert hw.gemm_flops == pytest.approx(share * hw.peak_flops, rel=1e-12), gpu
        assert hw.attn_flops == pytest.approx(share * cal.coefficients.attention_efficiency * hw.peak_flops), gpu
    h100 = parse_cluster("h100-sxm:1x8")
    unnamed = cal.model_copy(update={"fitted_on": None})
    assert effective_hardware(h100, unnamed).gemm_flops == pytest.approx(eff * effective_hardware(h100, unnamed).peak_flops)
    measured = cal.model_copy(update={"hardware": HardwareOverrides(peak_tflops=800.0)})
    assert effective_hardware(h100, measured).gemm_flops == pytest.approx(eff * 800e12)


def test_default_headroom_is_a_few_gib_and_a_share():
    assert default_headroom_gib(80) == pytest.approx(3.0)
    assert default_headroom_gib(141) == pytest.approx(4.525)
    assert default_headroom_gib(1) == 0.5  # never more than half a small memory
    cl = parse_cluster("h100-sxm:1x8")
    assert cl.usable_mem_bytes == cl.mem_bytes - 3 * GIB
    assert parse_cluster("h100-sxm:1x8,mem_headroom_gib=0").usable_mem_bytes == cl.mem_bytes
    with pytest.raises(PlannerError, match="leaves nothing"):
        parse_cluster("h100-sxm:1x8,mem_headroom_gib=80")


def test_memory_outside_tensors_on_gpus_only():
    """NCCL buffers per communicator of the layout (tp and dp rings, pipeline neighbours) and the
    allocator's fragmentation of the transient tensors on a GPU; neither on gloo CPU ranks."""
    from cost_models.comm import NCCL_CHANNELS
    from cost_models.memory import FRAGMENTATION, NCCL_CHANNEL_BYTES, NCCL_P2P_CHANNELS, TRANSIENT

    spec = resolve_model("llama-2-7b")
    call = Call(name="t", model="m", kind="train", seqs=64, seq_len=2048, loss="sft")
    decl = ModelDecl(spec=spec, trainable=True)
    cm = CostModel(parse_cluster("a100-80gb:1x8"))
    ring = NCCL_CHANNELS * NCCL_CHANNEL_BYTES
    mem = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(tp=2, pp=2, dp=2, micro_batches=8)).mem_breakdown_bytes
    assert mem["nccl"] == 2 * ring + NCCL_P2P_CHANNELS * NCCL_CHANNEL_BYTES
    assert mem["fragmentation"] == int(FRAGMENTATION * sum(mem.get(k, 0) for k in TRANSIENT))
    alone = cm.call_cost(call, decl, Mesh.block(0, 1), Layout(micro_batches=64)).mem_breakdown_bytes
    assert alone["nccl"] == 0
    tiny = ModelDecl(spec=resolve_model("tiny-llama"), trainable=True)
    cpu = CostModel(parse_cluster("cpu:1x4")).call_cost(call, tiny, Mesh.block(0, 4), Layout(dp=4)).mem_breakdown_bytes
    assert "nccl" not in cpu and "fragmentation" not in cpu


def test_a_plan_packed_to_the_edge_now_keeps_the_headroom():
    """8B PPO on 8 H100s. With no headroom and memory sized so the fastest plan fills it to 99.7%,
    the search packs some call above what the default headroom allows; with the default headroom
    on the same GPUs every call keeps it, and the plan changes."""
    graph = ppo("llama-3-8b", batch=512, prompt_len=1024, gen_len=1024)
    roomy = compile_graph(graph, parse_cluster("h100-sxm:1x8,mem_gib=400,mem_headroom_gib=0"), time_limit_s=2)
    mem_gib = roomy.estimate.peak_mem_bytes / GIB / 0.997
    packed = compile_graph(graph, parse_cluster(f"h100-sxm:1x8,mem_gib={mem_gib!r},mem_headroom_gib=0"),
                           time_limit_s=2)
    kept = parse_cluster(f"h100-sxm:1x8,mem_gib={mem_gib!r}")
    assert packed.estimate.peak_mem_bytes > kept.usable_mem_bytes  # fine without a headroom, not with one
    plan = compile_graph(graph, kept, time_limit_s=2)
    assert all(c.est_peak_mem_bytes <= kept.usable_mem_bytes for c in plan.calls)
    assert {c.name: (c.mesh, c.layout) for c in plan.calls} != {c.name: (c.mesh, c.layout) for c in packed.calls}
    assert plan.estimate.iteration_s >= packed.estimate.iteration_s


def test_a_plan_costed_for_another_stack_keeps_it_for_every_later_estimate() -> None:
    """`planner compile --framework megatron-core` costs the plan for that stack; the plan records
    it, and explain, check and exports re-cost with it (no disagreement with the plan's numbers)."""
    from planner.algorithms import sft
    from planner.check import memory_problems
    from planner.explain import explain_plan

    graph = sft("llama-2-7b", batch=64, seq_len=2048)
    cluster = parse_cluster("a100-80gb:1x8")
    plan = compile_graph(graph, cluster, time_limit_s=0, framework="megatron-core")
    assert plan.estimate.framework == "megatron-core" and "megatron-core" in (plan.estimate.costed_for or "")
    torch_plan = compile_graph(graph, cluster, time_limit_s=0)
    assert torch_plan.estimate.framework is None and "not yet calibrated on a GPU" in (torch_plan.estimate.costed_for or "")
    assert plan.estimate.iteration_s != torch_plan.estimate.iteration_s
    assert explain_plan(plan).notes == [] and memory_problems(plan) == []


def test_megatron_table1_runs_as_configured_fit_and_are_priced_near_published(bench) -> None:
    """Narayanan et al. 2021, Table 1, each row as Megatron-LM's examples/sc21/run_table_1.sh ran it
    (micro-batch, layers per virtual stage, DDP) on 80 GB A100s: the memory model must let every
    one of those runs fit, the interleaved rows get the script's chunks per stage, and each
    predicted throughput must stay within 15% of the published one (the bench prints the errors)."""
    rows = bench.megatron_table1(default_calibration("a100-80gb"))
    assert len(rows) == 10
    assert [lay.interleave for _, lay, *_ in rows] == [1, 1, 1, 1, 1, 3, 2, 2, 3, 1]
    assert [lay.micro_batches for _, lay, *_ in rows] == [1, 1, 1, 4, 12, 28, 48, 144, 280, 512]
    for row, lay, tflops, peak, fits in rows:
        assert fits, f"{row.params_b}B {lay.short()} ran on 80 GB A100s but is costed at {peak / GIB:.0f} GiB"
        assert abs(tflops / row.tflops - 1) < 0.15, (row.params_b, tflops, row.tflops)


def test_table1_configurations_run_on_vtrains_cluster_too_are_paired(bench, tmp_path, capsys) -> None:
    """A measured row of the same model, degrees, micro-batch and global batch as a Table 1 run is
    printed beside Selene's step (Table 1's TFLOP/s turned back into seconds by Eq. 3); a row that
    differs in its micro-batch is not."""
    header = "params_b,gpus,global_batch,micro_batch,hidden_size,num_attention_heads,num_hidden_layers,seq_len,tp,dp,pp,iteration_ms\n"
    path = tmp_path / "runs.csv"
    path.write_text(header + "18.4,256,1024,8,6144,48,40,2048,8,32,1,9603.6\n18.4,256,1024,4,6144,48,40,2048,8,32,1,9927.6\n")
    bench.report_both_clusters(default_calibration("a100-80gb"), read_measured(path), bench.VTRAIN)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "measured vTrain" in ln]
    assert len(lines) == 1 and "mb8 " in lines[0]
    assert "vTrain   9.60 s, Selene   9.40 s" in lines[0]  # 135 TFLOP/s on 256 GPUs by Eq. 3


def test_korthikanti_runs_fit_and_are_priced_near_published(bench) -> None:
    """Korthikanti et al. 2022's four runs (tensor 8, data-parallel size one, sequence parallel,
    selective recompute) ran on 80 GB A100s, so the memory model must let them fit; the
    published MFUs, turned back into steps by the paper's model FLOPs, must give its Table 5 steps
    to within their rounding (a check of the configuration and the formula); and each predicted MFU must stay within 20%
    of the published one (the bench prints the errors)."""
    rows = bench.korthikanti_table(default_calibration("a100-80gb"))
    assert [(lay.tp, lay.pp, lay.dp, lay.micro_batches) for _, lay, *_ in rows] == \
        [(8, 1, 1, 4), (8, 8, 1, 64), (8, 35, 1, 280), (8, 64, 1, 512)]
    assert all(lay.recompute == "selective" and lay.sequence_parallel for _, lay, *_ in rows)
    for (row, lay, mfu, peak, fits), step in zip(rows, [1.10, 13.75, 37.83, 71.49]):
        assert abs(row.step_s() / step - 1) < 5e-3, (row.params_b, row.step_s(), step)  # both are rounded
        assert fits, f"{row.params_b}B {lay.short()} ran on 80 GB A100s but is costed at {peak / GIB:.0f} GiB"
        assert abs(mfu / row.mfu - 1) < 0.20, (row.params_b, mfu, row.mfu)


def test_model_flops_are_eq3_less_the_recomputed_forward(bench) -> None:
    """The paper's model FLOPs are Narayanan et al.'s Eq. 3 (which counts full recompute) less one
    forward pass of the layers: 24*B*s*l*h^2 for the GEMMs and 4*B*s^2*l*h for attention."""
    for b, s, l, h, v in [(4, 2048, 48, 6144, 51200), (1, 8192, 2, 128, 1000)]:
        forward = 24.0 * b * s * l * h * h + 4.0 * b * s * s * l * h
        assert bench.korthikanti_flops(b, s, l, h, v) == pytest.approx(bench.megatron_flops(b, s, l, h, v) - forward)


def test_megatron_core_h100_rows_fit_and_use_megatron_lms_own_flops(bench, capsys) -> None:
    """The Megatron-LM README's H100 rows (Megatron-Core r0.8.0) ran, so each must fit under the
    memory model with the stack that overlaps tensor- and data-parallel communication as its flags
    say; and their published teraFLOP/s are counted by Megatron-LM's num_floating_point_operations
    (core_r0.8.0), which for a GPT (full attention, 4h GELU MLP) is the same formula as the 2022
    paper's model FLOPs the bench uses."""
    stack = bench.mcore_r080_stack()
    assert stack.tp_comm_overlap and stack.overlap_param_gather and stack.attention == "flash"
    errs = bench.report_mcore_h100(default_calibration())
    out = capsys.readouterr().out
    assert len(errs) == 4 and "does not fit" not in out
    for row in bench.MCORE_H100:
        heads, h, layers, batch = row[1], row[2], row[3], row[6]
        s, v, kv, ffn = 4096, 131072, heads, 4 * h  # kv_channels * heads = h
        megatron = 12 * batch * s * layers * h * h * ((1 + kv / heads + s / h) + ffn / h + v / (2 * layers * h))
        assert bench.korthikanti_flops(batch, s, layers, h, v) == pytest.approx(megatron)


def test_nemo_dgxc_rows_are_configured_as_published_and_fit(bench, capsys) -> None:
    """The DGX Cloud recipes' NeMo rows: every layout fills its GPUs with the published degrees,
    the global batch splits into whole micro-batches of one sequence (the recipes' GA: 32 for 8B,
    64 for 70B, 63 for 405B), the layers split into whole virtual stages, every run fits in memory
    under the stack the recipes configure (they ran), and the 8B row's published step is the
    recipe's 59.99% MFU by NVIDIA's formula, 60.1% by the estimates' own (`model_flops`)."""
    from cost_models.api import model_flops

    accumulations = {"Llama 3.1 8B": 32, "Llama 3.1 70B": 64, "Llama 3.1 405B proxy": 63, "Llama 3.1 405B": 63,
                     "GPT-3 175B": 64}
    for label, model, layers, tp, pp, vp, cp, _seq, _sp, overlap, fused, dropout, cols in bench.NEMO_DGXC:
        spec = bench.nemo_dgxc_spec(model, layers)
        assert spec.num_hidden_layers % (pp * vp) == 0 and (vp == 1 or pp > 1), label
        for gpus, batch, _ in cols:
            dp = gpus // (tp * pp * cp)
            assert dp * tp * pp * cp == gpus and batch // dp == accumulations[label], (label, gpus)
        stack = bench.nemo_dgxc_stack(tp_comm_overlap=overlap, loss_fused=fused, dropout=dropout)
        assert (stack.grad_bytes, stack.optimizer_step_bytes, stack.overlap_param_gather) == (2, 34, True)
    errs = bench.report_nemo_dgxc(default_calibration())
    out = capsys.readouterr().out
    assert len(errs) == 4 and out.count(" pooled,") == 4 and "does not fit" not in out
    assert len(bench.nemo_dgxc_errors(default_calibration())) == 22
    _, model, layers, *_, cols = bench.NEMO_DGXC[0]
    gpus, batch, step = cols[0]
    call = Call(name="t", model="m", kind="train", seqs=batch, seq_len=8192, loss="sft")
    spec = bench.nemo_dgxc_spec(model, layers)
    # NVIDIA's per sequence: 8192 (attention 12 l h^2 (1 + kv/heads + s/h) + MLP 18 l f h + head 6 V h),
    # which the recipe rounds to 4.74E+14 for its 59.99%; the estimates count the same FLOPs (and the
    # norms' weights, 0.003% more).
    nvidia = 8192 * (12 * 32 * 4096**2 * (1 + 8 / 32 + 8192 / 4096) + 18 * 32 * 14336 * 4096 + 6 * 128256 * 4096)
    assert model_flops(spec, call) == pytest.approx(batch * nvidia, rel=1e-4) and f"{nvidia:.2E}" == "4.74E+14"
    assert abs(batch * 4.74e14 / step / gpus / 989e12 - 0.5999) < 2e-4
    assert round(model_flops(spec, call) / step / gpus / 989e12, 3) == 0.601


# llm-foundry's published parameter counts (its table's NumParams column) at sequence 2048, and
# for the 7B model at every sequence it ran: learned position embeddings grow with the sequence.
FOUNDRY_PARAMS = {("125m", 2048): 125311488, ("350m", 2048): 355985408, ("760m", 2048): 760470528,
                  ("1b", 2048): 1315950592, ("3b", 2048): 2651837440, ("7b", 2048): 6658859008,
                  ("13b", 2048): 12853954560, ("30b", 2048): 29975214080, ("70b", 2048): 64862437376,
                  ("7b", 1024): 6654664704, ("7b", 4096): 6667247616, ("7b", 8192): 6684024832,
                  ("7b", 16384): 6717579264, ("7b", 32768): 6784688128, ("7b", 65536): 6918905856}


def test_llm_foundry_rows_are_the_gpt_the_table_counts_and_every_one_is_costed(bench) -> None:
    """MPT as llm-foundry benchmarked it (learned positions, LayerNorm and biases, 4h GELU MLP,
    tied embeddings, vocabulary 50,368) has exactly the parameters the table lists, for every size
    and, through the position embeddings, every sequence; the rows keep the table's micro-batch,
    accumulations, sharding and checkpointing, and every one is costed."""
    for (size, seq), params in FOUNDRY_PARAMS.items():
        assert bench.mpt_spec(size, seq).num_params() == params, (size, seq)
    assert len(bench.FOUNDRY) == 129 and {r[3] for r in bench.FOUNDRY} == {"a100-80gb", "h100-sxm"}
    costed = bench.foundry_table(default_calibration())
    for row, predicted, cost in costed:
        assert row[6] in (2, 3) and row[8] > 0 and predicted > 0 and cost.time_s > 0
    row = next(c[0] for c in costed if c[0][:4] == ("13b", 2048, 8, "a100-80gb"))
    assert row[4:8] == (2, 3, 3, False)  # micro-batch 2, 3 accumulations, FULL_SHARD, no checkpointing


def test_flash_attention_training_rows_are_configured_as_published(bench) -> None:
    """flash-attention's 2022 training table: the models are the GPT3 sizes their names give, the
    accumulation steps are the configs' (global batch over 8 GPUs' micro-batches), and the 2.7B
    row's 85k tokens/s is the README's 189 TFLOP/s (60.6% MFU) by the Megatron formula less the
    recompute (a check of the configuration and the formula; the bench prints the errors)."""
    sizes = {"GPT3-125M": 125e6, "GPT3-355M": 355e6, "GPT3-760M": 760e6, "GPT3-1.3B": 1.3e9, "GPT3-2.7B": 2.7e9}
    for name, hidden, heads, layers, mb, batch, _, _ in bench.FLASH_TRAINING:
        spec = bench.flash_training_spec(hidden, heads, layers)
        assert abs(spec.num_params() / sizes[name] - 1) < 0.03, (name, spec.num_params())
        assert batch % (8 * mb) == 0
    assert [b // (8 * mb) for *_, mb, b, _, _ in bench.FLASH_TRAINING] == [1, 1, 2, 8, 16]
    assert [row[6] for row in bench.FLASH_TRAINING] == [0, 0, 1, 1, 1]  # apex FusedAdam, then ZeroRedundancyOptimizer
    name, hidden, heads, layers, *_, published = bench.FLASH_TRAINING[-1]
    tflops = published * bench.korthikanti_flops(1, 2048, layers, hidden, bench.FLASH_TRAINING_VOCAB) / 2048 / 8 / 1e12
    assert abs(tflops / 189 - 1) < 0.01 and abs(tflops / 312 - 0.606) < 0.005, tflops
    stack = bench.flash_training_stack()
    assert (stack.param_bytes, stack.grad_bytes, stack.weight_cast_bytes, stack.dropout) == (4, 4, 6.0, True)
    assert stack.attention_kernels == (("ampere", "fa1"),) and stack.gpu_calibrated
    cm = CostModel(parse_cluster("a100-80gb:1x8"), default_calibration(), framework=stack)
    for name, hidden, heads, layers, mb, batch, zero, _ in bench.FLASH_TRAINING:  # they ran without checkpointing
        call = Call(name="train", model="m", kind="train", seqs=batch, seq_len=2048, loss="sft")
        decl = ModelDecl(spec=bench.flash_training_spec(hidden, heads, layers), trainable=True)
        cost = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(dp=8, zero=zero, micro_batches=batch // (8 * mb)))
        assert cost.peak_mem_bytes <= cm.cluster.usable_mem_bytes, (name, cost.peak_mem_bytes / GIB)


def test_torchtitan_async_tp_rows_are_configured_as_published(bench) -> None:
    """torchtitan's async-TP page: FSDP x TP 8 fills the GPUs, the published speed-ups are the
    page's 1.09x and 1.10x, the costing reads the page's 2.4 TB/s of HBM and SDPA's attention, and
    the model's own speed-up is a gain (the bench prints its error against the published one)."""
    assert [round(a / v, 2) for *_, v, a in bench.TORCHTITAN_ASYNC_TP] == [1.09, 1.10]
    for _, gpus, fsdp, _, rc, *_ in bench.TORCHTITAN_ASYNC_TP:
        assert fsdp * 8 == gpus and rc in ("full", "selective")
    errs = bench.report_torchtitan_async_tp(default_calibration())
    speedups = [a / v * (1 + e / 100) for (*_, v, a), e in zip(bench.TORCHTITAN_ASYNC_TP, errs)]
    assert all(1.0 < x < 1.5 for x in speedups), speedups
    cal = default_calibration()
    hbm = cal.model_copy(update={"hardware": cal.hardware.model_copy(update={"hbm_gb_s": bench.GRAND_TETON_HBM_GB_S})})
    hw = CostModel(parse_cluster("h100-sxm:1x8"), hbm).hw
    assert hw.mem_bytes_s == pytest.approx(2400e9 * cal.coefficients.hbm_efficiency)


def test_hopper_gemm_table_is_a_fixed_time_per_gemm_and_a_cost_per_output_tile(bench) -> None:
    """OpenXLA's measured bf16 GEMMs on sm_90 (16 shapes, 4,096 rows, n and k 512-4096) follow
    t = a + F (1 + k0 / k) / R to within 3% of every shape, with a few microseconds per GEMM and
    a per-tile cost worth a couple of hundred k: what makes short-k GEMMs slow on Hopper."""
    points = {(bench.XLA_H100_GEMM_ROWS, n, k): rate * 1e12
              for k, rates in bench.XLA_H100_GEMM.items() for n, rate in zip(bench.XLA_H100_GEMM_N, rates)}
    assert len(points) == 16
    a, k0, rate, worst = bench.gemm_shape_fit(points)
    assert worst < 0.03
    assert 4e-6 < a < 8e-6 and 100 <= k0 <= 250 and 800e12 < rate < 900e12
    # Both terms are needed: without the per-tile cost no (a, R) comes within 10% of every shape.
    assert bench.gemm_shape_fit(points, k0_values=(0,))[3] > 0.10


def test_the_model_prices_hopper_gemms_of_long_k_no_faster_than_measured(bench, capsys) -> None:
    """The README's reading of the sm_90 table: where k and n are both at least 2,048 (the GEMMs
    of a large layer without tensor parallelism) the model is no faster than the measured kernels,
    so Hopper's end-to-end optimism is not their rate; it is too fast exactly where k or n is
    short (tensor-parallel shards of small layers), up to +115% at 512 x 512. This lists those
    shapes, so a change that moves them moves the README with it."""
    errs = bench.report_xla_h100_gemms(default_calibration())
    out = capsys.readouterr().out
    shapes = [(n, k) for k in bench.XLA_H100_GEMM for n in bench.XLA_H100_GEMM_N]
    faster = {shape for shape, e in zip(shapes, errs) if e > 0}
    assert all(e <= 0 for (n, k), e in zip(shapes, errs) if n >= 2048 and k >= 2048)
    assert faster == {(n, k) for n, k in shapes if k <= 1024 or (k == 2048 and n <= 1024) or (k == 4096 and n == 512)}
    assert round(max(errs)) == 115 and "every shape within" in out


def test_plans_on_hopper_say_their_training_times_are_optimistic(bench, capsys) -> None:
    """A plan on an H100 or H200 costed with A100-fitted efficiencies says what the published H100
    table showed (README, Current limits), with the bench's own figures; an A100 plan, a GPU
    profile's and the uncalibrated runtime's (which says so its own way) do not."""
    from cost_models.api import HOPPER_CAVEAT

    errs = bench.report_mcore_h100(default_calibration())
    nemo = bench.nemo_dgxc_errors(default_calibration())
    capsys.readouterr()
    assert f"took {round(errs[0])}% and {round(errs[1])}% longer" in HOPPER_CAVEAT
    assert f"GPT-3 175B {round(min(nemo))}-{round(max(nemo))}%" in HOPPER_CAVEAT and min(nemo) > 0
    for gpu in ("h100-sxm", "h200"):
        for fw in ("megatron-core", "megatron", "rlhf-engine"):
            assert HOPPER_CAVEAT in CostModel(parse_cluster(f"{gpu}:1x8"), framework=fw).costed_for()
    assert HOPPER_CAVEAT not in CostModel(parse_cluster("a100-80gb:1x8"), framework="megatron-core").costed_for()
    assert HOPPER_CAVEAT not in CostModel(parse_cluster("h100-sxm:1x8")).costed_for()
