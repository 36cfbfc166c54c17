"""Closed forms derived by hand, monotonicity, and every call kind of the cost model."""

from __future__ import annotations

import dataclasses
import math

import pytest

from cost_models import Calibration, CostModel, comm, model_flops
from cost_models.calibration import Coefficients
from cost_models.comm import Group, all_gather_s, all_reduce_s, group_at
from cost_models.framework import resolve_framework
from cost_models.training import Topology, grad_sync_s, pipeline_s
from cost_models.transfer import rank_volumes
from plans import Call, Layout, Mesh, ModelDecl, PlannerError, parse_cluster, resolve_model
from plans.sharding import transfer_plan, transfer_volume

# Round coefficients so the closed forms below can be written out by hand.
COEF = Coefficients(gemm_efficiency=0.5, attention_efficiency=0.5, hbm_efficiency=0.5, nvlink_efficiency=0.5,
                    network_efficiency=0.5, kernel_latency_us=0.0, host_kernel_us=0.0, host_collective_us=0.0,
                    host_overlap=1.0, microbatch_overhead_ms=0.0, step_overhead_ms=0.0)
CAL = Calibration(coefficients=COEF)
LLAMA = resolve_model("llama-2-7b")
TRAIN = Call(name="t", model="m", kind="train", seqs=64, seq_len=1024, loss="sft")
INFER = Call(name="i", model="m", kind="inference", seqs=64, seq_len=1024, returns="logprobs")
GEN = Call(name="g", model="m", kind="generate", seqs=64, seq_len=1024, gen_len=512)


def test_pure_data_parallel_step_costs_one_gradient_all_reduce():
    """dp=8 in one node under Megatron-LM (no bucketing): one ring all-reduce of the fp16 gradients
    over NVLink (300 GB/s x 0.5), 2(n-1) steps of 6 us latency; nothing else communicates."""
    cm = CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework="megatron")
    cost = cm.call_cost(TRAIN, ModelDecl(spec=LLAMA, trainable=True), Mesh.block(0, 8), Layout(dp=8, micro_batches=8))
    grad_bytes = 2 * LLAMA.num_params()
    expected = 2 * 7 / 8 * grad_bytes / (300e9 * 0.5) + 2 * 7 * 6e-6
    assert cost.breakdown_s["dp_comm"] == pytest.approx(expected, rel=1e-9)
    assert "tp_comm" not in cost.breakdown_s and "pp_bubble" not in cost.breakdown_s


def test_optimizer_streams_its_bytes_through_hbm():
    cm = CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework="megatron")
    cost = cm.call_cost(TRAIN, ModelDecl(spec=LLAMA, trainable=True), Mesh.block(0, 8), Layout(dp=8, micro_batches=8))
    assert cost.breakdown_s["optimizer"] == pytest.approx(LLAMA.num_params() * 34 / (2039e9 * 0.5), rel=1e-9)


def test_tensor_parallel_all_reduces_per_layer():
    """tp=2 without recompute, the runtime (`torch`): per layer 2 all-reduces of one [s, b, h]
    block output in bf16 forward and 2 of the blocks' input gradients in the fp32 stream backward,
    the vocabulary-parallel lookup's rows in the fp32 table (forward) and the LM head's input
    gradient (backward), and per chunk of the head's logits the log-softmax's all-reduces of an
    fp32 value per token (the maximum) and two (the sum of exponentials, the target's logit).
    Full recompute runs the forward's again."""
    from cost_models.ops import head_chunks

    cm = CostModel(parse_cluster("a100-80gb:1x2"), CAL)
    call = Call(name="t", model="m", kind="train", seqs=8, seq_len=1024, loss="sft")
    lay = Layout(tp=2, micro_batches=4)
    cost = cm.call_cost(call, ModelDecl(spec=LLAMA, trainable=True), Mesh.block(0, 2), lay)
    m = 2 * 1024  # b = 2 sequences per micro-batch
    ar = lambda n: all_reduce_s(n, Group(2, 2, 1), cm.hw)  # noqa: E731
    assert ar(2 * m * LLAMA.hidden_size) == pytest.approx(2 * 1 / 2 * 2 * m * LLAMA.hidden_size / 150e9 + 2 * 6e-6)
    layers = 2 * ar(2 * m * LLAMA.hidden_size) + 2 * ar(4 * m * LLAMA.hidden_size)
    ends = 2 * ar(4 * m * LLAMA.hidden_size)
    ce = sum(ar(4 * r) + ar(8 * r) for r in head_chunks(cm.framework, m=m, vt=LLAMA.vocab_size // 2))
    want = 4 * (LLAMA.num_hidden_layers * layers + ends + ce)  # four micro-batches
    assert cost.breakdown_s["tp_comm"] == pytest.approx(want, rel=1e-9)
    full = cm.call_cost(call, ModelDecl(spec=LLAMA, trainable=True), Mesh.block(0, 2), lay.model_copy(update={"recompute": "full"}))
    again = 4 * LLAMA.num_hidden_layers * 2 * ar(2 * m * LLAMA.hidden_size)
    assert full.breakdown_s["tp_comm"] == pytest.approx(want + again, rel=1e-9)


def test_one_f_one_b_bubble():
    steady, bubble = pipeline_s([1.0] * 4, m=8, interleave=1, host_s=0.0)
    assert (steady, bubble) == (8.0, 3.0)  # (m + pp - 1) t
    _, bubble_v = pipeline_s([1.0] * 4, m=8, interleave=2, host_s=0.0)
    assert bubble_v == 1.5  # interleaving divides the fill and drain by v
    steady, bubble = pipeline_s([1.0, 2.0, 1.0], m=5, interleave=1, host_s=0.5)
    assert (steady, bubble) == (5 * 2.5, 2.0)  # the slowest stage sets the pace; host work adds no bubble


def test_pipeline_bubble_shrinks_with_more_microbatches():
    cm = CostModel(parse_cluster("a100-80gb:1x8"), CAL)
    decl = ModelDecl(spec=LLAMA, trainable=True)
    call = Call(name="t", model="m", kind="train", seqs=256, seq_len=1024, loss="sft")
    fractions = []
    for m in (8, 32, 128):
        c = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(pp=4, dp=2, micro_batches=m, recompute="full"))
        fractions.append(c.breakdown_s["pp_bubble"] / c.time_s)
    assert fractions[0] > fractions[1] > fractions[2] > 0
    assert fractions[0] == pytest.approx(3 / (8 + 3), rel=0.15)


def test_collectives_over_the_network_use_the_nodes_nics():
    """A data-parallel group of one rank per node shares each node's network with the node's 7
    other groups; one that fills its nodes has the network to itself."""
    cm = CostModel(parse_cluster("a100-80gb:4x8"), CAL)
    hw = cm.hw
    sparse = group_at(first=0, stride=8, n=4, mesh_size=32, gpus_per_node=8)
    dense = group_at(first=0, stride=1, n=32, mesh_size=32, gpus_per_node=8)
    assert (sparse.per_node, sparse.concurrent, dense.per_node, dense.concurrent) == (1, 8, 8, 1)
    nbytes = 1e9
    assert all_gather_s(nbytes, sparse, hw) == pytest.approx(3 / 4 * nbytes / (1600e9 / 8 * 0.5 / 8) + 3 * 10e-6)
    assert all_reduce_s(nbytes, dense, hw) == pytest.approx(2 * 31 / 32 * nbytes / (200e9 * 0.5 / 1) + 2 * 31 * 10e-6)


def test_small_messages_take_the_tree():
    cm = CostModel(parse_cluster("a100-80gb:64x8"), CAL)
    g = group_at(first=0, stride=1, n=512, mesh_size=512, gpus_per_node=8)
    t = all_reduce_s(1024, g, cm.hw)
    assert t == pytest.approx(2 * 1024 / (200e9 * 0.5) + 2 * math.log2(512) * 10e-6)


def test_model_flops_match_megatron_formula():
    """6N + 12Lhs per token equals Megatron-LM's 72Bslh^2(1 + s/6h + V/12lh) up to the biases and
    norms it leaves out."""
    spec = resolve_model(dict(model_type="gpt", hidden_size=12288, num_hidden_layers=96, num_attention_heads=96,
                              vocab_size=51200, max_position_embeddings=2048))
    call = Call(name="t", model="m", kind="train", seqs=1536, seq_len=2048, loss="sft")
    b, s, l, h, v = 1536, 2048, 96, 12288, 51200
    megatron = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert model_flops(spec, call) == pytest.approx(megatron, rel=1e-3)
    infer = Call(name="i", model="m", kind="inference", seqs=1536, seq_len=2048, returns="logprobs")
    assert model_flops(spec, infer) == pytest.approx(model_flops(spec, call) / 3)


@pytest.mark.parametrize("kind", ["train", "inference", "generate"])
def test_more_bandwidth_is_never_slower(kind):
    call = {"train": TRAIN, "inference": INFER, "generate": GEN}[kind]
    decl = ModelDecl(spec=LLAMA, trainable=kind == "train")
    layouts = [Layout(dp=16, micro_batches=4, zero=1), Layout(tp=8, dp=2, micro_batches=4, sequence_parallel=True),
               Layout(tp=4, pp=2, dp=2, micro_batches=8), Layout(pp=4, dp=4, micro_batches=4, recompute="selective")]
    if kind != "train":
        layouts = [lay.model_copy(update={"zero": 0, "recompute": "none", "sequence_parallel": False}) for lay in layouts]
    gains = []
    for lay in layouts:
        times = []
        for intra, inter in [(600, 200), (1200, 200), (1200, 800), (2400, 800), (2400, 3200), (4800, 3200)]:
            cm = CostModel(parse_cluster(f"a100-80gb:2x8,intra_node_gbps={intra},inter_node_gbps={inter}"))
            times.append(cm.call_cost(call, decl, Mesh.block(0, 16), lay).time_s)
        assert all(a >= b for a, b in zip(times, times[1:])), (lay.short(), times)
        gains.append(times[0] - times[-1])
    assert gains[0] >= 0 and max(gains) > 0  # layouts that communicate get faster; pure dp forward does not


def test_faster_gpu_is_never_slower():
    decl = ModelDecl(spec=LLAMA, trainable=True)
    lay = Layout(tp=2, dp=4, micro_batches=8)
    t = [CostModel(parse_cluster(f"{gpu}:1x8")).call_cost(TRAIN, decl, Mesh.block(0, 8), lay).time_s
         for gpu in ("v100-16gb", "a100-80gb", "h100-sxm")]
    assert t[0] > t[1] > t[2]


def test_generation_grows_with_generated_tokens():
    cm = CostModel(parse_cluster("a100-80gb:1x8"))
    decl = ModelDecl(spec=LLAMA)
    times = [cm.call_cost(Call(name="g", model="m", kind="generate", seqs=64, seq_len=512 + g, gen_len=g), decl,
                          Mesh.block(0, 8), Layout(dp=8)).breakdown_s["decode"] for g in (64, 256, 1024)]
    assert times[0] < times[1] < times[2]
    flops = model_flops(LLAMA, GEN)
    p, g = GEN.prompt_len, GEN.gen_len
    n = LLAMA.num_params() - LLAMA.vocab_size * LLAMA.hidden_size + 0  # untied: the input embedding is a lookup
    lh = LLAMA.num_hidden_layers * LLAMA.hidden_size
    assert flops == pytest.approx(64 * (2 * n * (p + g) + 4 * lh * (p * p + g * p + g * (g + 1) / 2)), rel=1e-3)


def test_decode_layout_adds_a_reshard():
    cm = CostModel(parse_cluster("a100-80gb:1x8"))
    decl = ModelDecl(spec=LLAMA)
    mesh = Mesh.block(0, 8)
    same = cm.call_cost(GEN, decl, mesh, Layout(tp=4, dp=2))
    other = cm.call_cost(GEN, decl, mesh, Layout(tp=4, dp=2), decode_layout=Layout(tp=1, dp=8))
    assert "reshard" not in same.breakdown_s and other.breakdown_s["reshard"] > 0
    # 8 replicas of 8 sequences each read the whole model per token (memory-bound), against 2 of
    # 32 reading a quarter plus their tensor-parallel all-reduces: both differ, neither is free.
    assert other.breakdown_s["decode"] != same.breakdown_s["decode"] and other.breakdown_s["decode"] > 0


def test_realloc_bytes_are_the_transfer_plans():
    cm = CostModel(parse_cluster("a100-80gb:2x8"))
    decl = ModelDecl(spec=resolve_model("tiny-llama"))
    src = (Mesh.block(0, 8), Layout(tp=4, dp=2))
    dst = (Mesh.block(8, 8), Layout(tp=2, pp=2, dp=2))
    cost = cm.realloc_cost(decl, src, dst)
    vol = transfer_volume(decl.spec, head="lm", src=src, dst=dst, gpus_per_node=8)
    # The runtime moves its fp32 parameters as they are (bit-exact).
    assert cost.bytes == 4 * vol.moved_numel == 4 * rank_volumes(decl.spec, head="lm", src=src, dst=dst, gpus_per_node=8).moved_numel
    assert cost.time_s > 0
    assert cm.realloc_cost(decl, src, src) == type(cost)(0, 0.0)


def test_realloc_across_nodes_is_slower_than_within_one():
    decl = ModelDecl(spec=LLAMA)
    src = (Mesh.block(0, 4), Layout(tp=4))
    dst = (Mesh.block(4, 4), Layout(tp=4))
    within = CostModel(parse_cluster("a100-80gb:1x8")).realloc_cost(decl, src, dst)
    across = CostModel(parse_cluster("a100-80gb:2x4")).realloc_cost(decl, src, dst)
    assert within.bytes == across.bytes > 0
    assert across.time_s > within.time_s


def test_data_transfer():
    cm = CostModel(parse_cluster("a100-80gb:2x8"))
    a, b, c = Mesh.block(0, 4), Mesh.block(4, 4), Mesh.block(8, 8)
    assert cm.data_transfer_s(10**9, a, a) == 0.0
    assert 0 < cm.data_transfer_s(10**9, a, b) < cm.data_transfer_s(10**9, a, c)


def test_layout_must_fill_the_mesh():
    cm = CostModel(parse_cluster("a100-80gb:1x8"))
    with pytest.raises(PlannerError, match="needs 4 ranks, mesh has 8"):
        cm.call_cost(TRAIN, ModelDecl(spec=LLAMA, trainable=True), Mesh.block(0, 8), Layout(dp=4))


def test_costs_are_deterministic_and_cached():
    cm = CostModel(parse_cluster("h100-sxm:2x8"))
    decl = ModelDecl(spec=LLAMA, trainable=True)
    a = cm.call_cost(TRAIN, decl, Mesh.block(0, 16), Layout(tp=2, pp=2, dp=4, micro_batches=4, zero=2))
    b = CostModel(parse_cluster("h100-sxm:2x8")).call_cost(TRAIN, decl, Mesh.block(0, 16),
                                                           Layout(tp=2, pp=2, dp=4, micro_batches=4, zero=2))
    assert a == b
    assert a.peak_mem_bytes > a.state_mem_bytes > 0 and a.model_flops > 0
    assert sum(a.breakdown_s.values()) == pytest.approx(a.time_s)
    assert sum(a.mem_breakdown_bytes.values()) == a.peak_mem_bytes


def test_zero_stages_trade_memory_for_traffic():
    """Across nodes on a slow network: ZeRO-1 reduce-scatters the fp32 gradients and gathers the
    bf16 weights, 3/4 of what the fp32 all-reduce moves; ZeRO-2 reduce-scatters every micro-batch,
    ZeRO-3 also gathers weights; each keeps less per GPU."""
    cm = CostModel(parse_cluster("a100-80gb:2x8,inter_node_gbps=100"), CAL, framework="megatron-core")
    decl = ModelDecl(spec=LLAMA, trainable=True)
    call = Call(name="t", model="m", kind="train", seqs=128, seq_len=1024, loss="sft")
    costs = [cm.call_cost(call, decl, Mesh.block(0, 16), Layout(dp=16, zero=z, micro_batches=8)) for z in range(4)]
    comm_s = [c.breakdown_s["dp_comm"] for c in costs]
    state = [c.state_mem_bytes for c in costs]
    assert comm_s[1] == pytest.approx(0.75 * comm_s[0], rel=0.02)  # (4 + 2) / (2 x 4) bytes per weight
    assert comm_s[1] < comm_s[2] < comm_s[3]
    assert state[0] > state[1] > state[2] > state[3]


def test_bucketed_overlap_hides_the_gradient_reduction():
    from cost_models.framework import FRAMEWORKS

    torch = FRAMEWORKS["torch"]
    assert torch.overlap_grad_reduce  # the runtime's buckets start during the last backward
    plain_fw = torch.__class__(**{**torch.__dict__, "name": "after-backward", "overlap_grad_reduce": False})
    decl = ModelDecl(spec=LLAMA, trainable=True)
    lay = Layout(dp=16, micro_batches=4)
    plain = CostModel(parse_cluster("a100-80gb:2x8"), CAL, framework=plain_fw).call_cost(TRAIN, decl, Mesh.block(0, 16), lay)
    hidden = CostModel(parse_cluster("a100-80gb:2x8"), CAL).call_cost(TRAIN, decl, Mesh.block(0, 16), lay)
    assert 0 < hidden.breakdown_s["dp_comm"] < plain.breakdown_s["dp_comm"]


def test_megatron_runs_the_input_gradient_collective_under_the_weight_gradient():
    """Megatron-LM issues a column-parallel GEMM's input-gradient all-reduce (reduce-scatter with
    sequence parallelism) asynchronously before that GEMM's weight gradient
    (`Framework.tp_dgrad_overlap`): the backward's two such collectives per layer hide under the
    QKV and first MLP weight gradients, the forward's and the sequence-parallel backward
    all-gathers do not. A stack without the trait (the runtime) is unchanged."""
    from cost_models.framework import FRAMEWORKS
    from cost_models.training import stretch_of

    core = FRAMEWORKS["megatron-core"]
    assert core.tp_dgrad_overlap and FRAMEWORKS["megatron"].tp_dgrad_overlap and not FRAMEWORKS["torch"].tp_dgrad_overlap
    serial = dataclasses.replace(core, name="dgrad-after", tp_dgrad_overlap=False)
    decl = ModelDecl(spec=LLAMA, trainable=True)
    for sp in (False, True):
        lay = Layout(tp=8, micro_batches=8, sequence_parallel=sp)
        cost = {fw.name: CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework=fw).call_cost(TRAIN, decl, Mesh.block(0, 8), lay)
                for fw in (core, serial)}
        hidden, exposed = cost["megatron-core"].breakdown_s["tp_comm"], cost["dgrad-after"].breakdown_s["tp_comm"]
        # The forward's collectives (half of them) stay, and of the backward's the sequence-parallel
        # all-gathers (a quarter) and what outlasts its window (the QKV weight gradient, 0.4 ms at
        # 8,192 tokens, is shorter than a 64 MB all-reduce on 8 A100s).
        assert exposed * (0.75 if sp else 0.5) < hidden < exposed * (0.95 if sp else 0.85)
        assert cost["megatron-core"].time_s < cost["dgrad-after"].time_s
    # The closed form on one stretch: two input-gradient all-reduces, the first under a weight
    # gradient longer than it, the second under a shorter one.
    from cost_models.comm import all_reduce_s, overlap_interference_s
    from cost_models.compute import kernel_time_s
    from cost_models.ops import Comm, gemm

    hw = CostModel(parse_cluster("a100-80gb:1x8"), CAL).hw
    group = Group(8, 8, 1)
    t = all_reduce_s(64e6, group, hw)
    long, short = gemm(8192, 8192, 8192), gemm(1024, 1024, 1024)
    w = kernel_time_s(short, hw)
    assert kernel_time_s(long, hw) > t > w
    comms = (Comm("all_reduce", 64e6, "tp", under=long), Comm("all_reduce", 64e6, "tp", under=short))
    kernels = (gemm(4096, 4096, 4096),)
    out = stretch_of(kernels, comms, {"tp": group}, hw, dgrad_overlap=True)
    assert out.comm_s == pytest.approx(overlap_interference_s(t, hw) + (t - w) + overlap_interference_s(w, hw))
    assert stretch_of(kernels, comms, {"tp": group}, hw).comm_s == pytest.approx(2 * t)


def test_tp_comm_overlap_hides_sequence_parallel_collectives_under_their_gemms():
    """Megatron-core's --tp-comm-overlap pipelines each sequence-parallel all-gather and
    reduce-scatter with the GEMM beside it in tp chunks: the tensor-parallel time drops, but one
    chunk of the transfers (1/tp) stays exposed and the hidden rest slows the GEMMs; without
    sequence parallelism (all-reduces) nothing changes."""
    from cost_models.framework import FRAMEWORKS
    from cost_models.training import stretch_of

    core = FRAMEWORKS["megatron-core"]
    piped = dataclasses.replace(core, name="tp-overlap", tp_comm_overlap=True)
    decl = ModelDecl(spec=LLAMA, trainable=True)
    sp = Layout(tp=8, micro_batches=8, sequence_parallel=True)
    cost = {fw.name: CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework=fw).call_cost(TRAIN, decl, Mesh.block(0, 8), sp)
            for fw in (core, piped)}
    piped_s, exposed_s = cost["tp-overlap"].breakdown_s["tp_comm"], cost["megatron-core"].breakdown_s["tp_comm"]
    assert exposed_s / 8 < piped_s < exposed_s
    plain = Layout(tp=8, micro_batches=8)
    assert CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework=piped).call_cost(TRAIN, decl, Mesh.block(0, 8), plain) \
        == CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework=core).call_cost(TRAIN, decl, Mesh.block(0, 8), plain)
    # The closed form on one stretch: 4 equal collectives on tp 4 beside GEMMs longer than all of
    # them: one (a chunk of the four) stays exposed, the other three slow the GEMMs by 32/108 of the SMs.
    from cost_models.compute import kernels_time_s
    from cost_models.ops import Comm, gemm

    hw = CostModel(parse_cluster("a100-80gb:1x8"), CAL).hw
    group = Group(4, 4, 1)
    one = all_gather_s(2e6, group, hw)
    kernels = (gemm(8192, 8192, 8192),) * 4
    assert kernels_time_s(kernels, hw) > 4 * one
    comms = (Comm("all_gather", 2e6, "tp"), Comm("reduce_scatter", 2e6, "tp")) * 2
    hidden = stretch_of(kernels, comms, {"tp": group}, hw, tp_pipelined=True)
    exposed = stretch_of(kernels, comms, {"tp": group}, hw)
    assert exposed.comm_s == pytest.approx(4 * one)
    assert hidden.comm_s == pytest.approx(one + 3 * one * (32 / 108) / (1 - 32 / 108))


def test_overlap_param_gather_hides_the_zero1_weight_gather_under_the_forward():
    """Megatron-core's --overlap-param-gather: ZeRO-1's all-gather of the updated weights runs
    under the next step's first forward, one bucket exposed; ZeRO-0 (no gather) is unchanged."""
    from cost_models.framework import FRAMEWORKS

    core = FRAMEWORKS["megatron-core"]
    over = dataclasses.replace(core, name="param-overlap", overlap_param_gather=True)
    decl = ModelDecl(spec=LLAMA, trainable=True)
    cl = parse_cluster("a100-80gb:2x8")
    for zero, lower in ((1, True), (0, False)):
        lay = Layout(dp=16, zero=zero, micro_batches=4)
        a, b = (CostModel(cl, CAL, framework=fw).call_cost(TRAIN, decl, Mesh.block(0, 16), lay) for fw in (core, over))
        assert (b.breakdown_s["dp_comm"] < a.breakdown_s["dp_comm"]) is lower
        assert b.breakdown_s["dp_comm"] > 0


def test_context_parallel_splits_the_sequence():
    """cp=2 halves each rank's tokens (and activations) against dp=2, and adds a ring exchange of
    keys and values that only shows where attention is too short to hide it."""
    cm = CostModel(parse_cluster("a100-80gb:1x8"), CAL)
    decl = ModelDecl(spec=LLAMA, trainable=True)
    call = Call(name="t", model="m", kind="train", seqs=8, seq_len=16384, loss="sft")
    dp = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(tp=4, dp=2, micro_batches=4, sequence_parallel=True))
    cp = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(tp=4, cp=2, micro_batches=8, sequence_parallel=True))
    assert cp.mem_breakdown_bytes["activations"] == pytest.approx(dp.mem_breakdown_bytes["activations"] / 2, rel=0.01)
    slow = CostModel(parse_cluster("a100-80gb:1x8,intra_node_gbps=8"), CAL)
    short = Call(name="t", model="m", kind="train", seqs=64, seq_len=1024, loss="sft")
    exposed = slow.call_cost(short, decl, Mesh.block(0, 8), Layout(tp=4, cp=2, micro_batches=8, sequence_parallel=True))
    assert exposed.breakdown_s["cp_comm"] > 0 and "cp_comm" not in dp.breakdown_s


def test_context_parallel_all_gather_is_priced_unhidden_for_the_runtime():
    """The planner's runtime all-gathers keys and values before attention and reduce-scatters
    their gradients after (`runtime.context_parallel`): the same bytes as a ring, none of it
    hidden, and its gradient reduction waits for the backward."""
    decl = ModelDecl(spec=LLAMA, trainable=True)
    call = Call(name="t", model="m", kind="train", seqs=8, seq_len=16384, loss="sft")
    lay = Layout(tp=4, cp=2, micro_batches=8, sequence_parallel=True)
    ring = CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework="megatron-core").call_cost(call, decl, Mesh.block(0, 8), lay)
    torch_fw = CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework="torch")
    gather = torch_fw.call_cost(call, decl, Mesh.block(0, 8), lay)
    assert "cp_comm" not in ring.breakdown_s  # 16k tokens of attention hide the ring
    assert gather.breakdown_s["cp_comm"] > 0
    unfolded = dataclasses.replace(torch_fw.framework, cp_comm="ring")
    hidden = CostModel(parse_cluster("a100-80gb:1x8"), CAL, framework=unfolded).call_cost(call, decl, Mesh.block(0, 8), lay)
    assert "cp_comm" not in hidden.breakdown_s and hidden.time_s < gather.time_s


@pytest.mark.parametrize("name", ["llama-2-70b", "gpt3-1.3b", "qwen2.5-7b"])
@pytest.mark.parametrize("tp", [1, 8])
def test_layer_flops_are_exact(name, tp):
    """The kernels of a layer carry exactly the closed-form FLOPs: projections 2*M*h*(a+2kv)*d/t and
    2*M*a*d*h/t, MLP 2*M*h*f/t per matrix (SwiGLU 3, GELU 2), scores and context 2*2*b*a*s^2*d/t
    (materialised); backward GEMMs twice the forward."""
    from cost_models.framework import FRAMEWORKS
    from cost_models.ops import layer_work

    spec = resolve_model(name)
    h, d, f, a, kv = spec.hidden_size, spec.d_head, spec.ffn_size, spec.num_attention_heads, spec.kv_heads
    b, s = 2, 1024
    m = b * s
    w = layer_work(spec, FRAMEWORKS["megatron"], b=b, s=s, tp=tp, cp=1, sp=False)
    mats = 2 if spec.model_type == "gpt" else 3
    gemms = 2 * m * h * (a + 2 * kv) * d / tp + 2 * m * a * d * h / tp + mats * 2 * m * h * f / tp
    attn = 2 * 2 * b * a * s * s * d / tp
    fwd = sum(k.flops for k in w.fwd)
    assert fwd == pytest.approx(gemms + attn, rel=1e-12)
    assert sum(k.flops for k in w.bwd) == pytest.approx(2 * fwd, rel=1e-12)
    flash = layer_work(spec, FRAMEWORKS["torch"], b=b, s=s, tp=tp, cp=1, sp=False)
    assert sum(k.flops for k in flash.fwd) == pytest.approx(gemms + attn * (s + 1) / (2 * s), rel=1e-12)


def test_executed_flops_match_model_flops_without_recompute():
    """Forward + backward of every layer and the head, with full attention, is 6N + 12Lhs per token."""
    from cost_models.framework import FRAMEWORKS
    from cost_models.ops import head_work, layer_work

    spec = resolve_model("gpt3-1.3b")
    fw = FRAMEWORKS["megatron"]
    b, s = 4, 2048
    w = layer_work(spec, fw, b=b, s=s, tp=1, cp=1, sp=False)
    hf, hb = head_work(spec, fw, head="lm", b=b, s=s, tp=1, cp=1, sp=False, loss=True)
    executed = spec.num_hidden_layers * sum(k.flops for k in w.fwd + w.bwd) + sum(k.flops for k in hf + hb)
    call = Call(name="t", model="m", kind="train", seqs=b, seq_len=s, loss="sft")
    assert executed == pytest.approx(model_flops(spec, call), rel=2e-3)  # model FLOPs count biases too


def test_interleaving_shrinks_the_bubble():
    cm = CostModel(parse_cluster("a100-80gb:1x8"), CAL)
    decl = ModelDecl(spec=LLAMA, trainable=True)
    call = Call(name="t", model="m", kind="train", seqs=64, seq_len=1024, loss="sft")
    plain = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(pp=8, micro_batches=16, recompute="full"))
    inter = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(pp=8, micro_batches=16, recompute="full", interleave=2))
    assert inter.breakdown_s["pp_bubble"] == pytest.approx(plain.breakdown_s["pp_bubble"] / 2, rel=0.1)
    assert inter.breakdown_s["pp_comm"] > plain.breakdown_s["pp_comm"]  # v times the sends
    assert inter.mem_breakdown_bytes["activations"] > plain.mem_breakdown_bytes["activations"]


@pytest.mark.parametrize("src,dst", [
    ((Mesh.block(0, 8), Layout(tp=4, dp=2)), (Mesh.block(8, 8), Layout(tp=2, pp=2, dp=2))),
    ((Mesh.block(0, 2), Layout(dp=2, zero=3)), (Mesh.block(0, 4), Layout(dp=4))),
    ((Mesh.block(0, 4), Layout(tp=2, dp=2)), (Mesh.block(0, 4), Layout(pp=2, dp=2))),
])
def test_realloc_pieces_are_the_transfer_plans_and_cost_host_time(src, dst):
    """The slices each rank packs, unpacks and copies are those of `plans.sharding.transfer_plan`
    (what `runtime.realloc` loops over), and each costs the host a few tensor ops."""
    from cost_models.api import REALLOC_PIECE_OPS

    spec = resolve_model("tiny-llama")
    vol = rank_volumes(spec, head="lm", src=src, dst=dst, gpus_per_node=8)
    plan = transfer_plan(spec, head="lm", src=src, dst=dst, gpus_per_node=8)
    for k in range(len(vol.send_pieces)):
        r = vol.first + k
        assert vol.send_pieces[k] == sum(t.src == r != t.dst for t in plan)
        assert vol.recv_pieces[k] == sum(t.dst == r != t.src for t in plan)
        assert vol.local_pieces[k] == sum(t.dst == r == t.src for t in plan)
    cm = CostModel(parse_cluster("cpu:4x4"))
    decl = ModelDecl(spec=spec)
    host = REALLOC_PIECE_OPS * cm.hw.host_kernel_s * (vol.send_pieces.max() + (vol.recv_pieces + vol.local_pieces).max())
    assert cm.realloc_cost(decl, src, dst).time_s >= host > 0


def test_kv_parallel_decode_reads_a_share_of_each_cache_and_combines_it():
    """A decode layout with cp > 1 decodes the same rows on every cp rank (not more replicas),
    each attending to 1/cp of every sequence's cache, then combining the shares (`cp_comm`)."""
    from cost_models.generation import decode_split

    cm = CostModel(parse_cluster("h100-sxm:1x8"))
    decl = ModelDecl(spec=resolve_model("qwen2.5-7b"))
    call = Call(name="g", model="m", kind="generate", seqs=2, seq_len=65536 + 1024, gen_len=1024, outputs=["s"])
    assert decode_split(2, Layout(cp=8)).seqs_per_group == 2 and decode_split(2, Layout(dp=2, tp=4)).seqs_per_group == 1
    kvp = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(tp=4, cp=2))
    whole = cm.call_cost(call, decl, Mesh.block(0, 8), Layout(tp=4, pp=2, micro_batches=2))
    assert kvp.breakdown_s["cp_comm"] > 0 and "cp_comm" not in whole.breakdown_s
    # its context-parallel prefill keeps the whole gathered cache on each rank, as the runtime does
    four = cm.call_cost(call, decl, Mesh.block(0, 4), Layout(tp=4))
    assert kvp.mem_breakdown_bytes["kv_cache"] == four.mem_breakdown_bytes["kv_cache"]
    assert kvp.time_s < whole.time_s  # half of each cache per rank, against a pipeline's idle stages


def test_vllm_decode_gathers_the_logits_and_samples_the_whole_vocabulary():
    """vLLM V1 all-gathers each rank's block of the logits in bf16 and samples from the whole
    vocabulary on every rank (`Framework.logits_all_gather`); the runtime chooses over its block
    and gathers a best score and id per row (`ops.sample_comm`). At tp 4 the gather adds the
    logits' bytes to each decode step's collectives, and sampling reads four times the logits."""
    from cost_models.generation import SAMPLE_BYTES, decode_step_s
    from cost_models.ops import Comm, sample_comm

    spec = resolve_model("llama-3-8b")
    vllm = resolve_framework("vllm")
    assert sample_comm(spec, vllm, rows=64, tp=4) == (Comm("all_gather", 2.0 * 64 * spec.vocab_size, "tp"),)
    assert sample_comm(spec, vllm, rows=64, tp=1) == ()
    assert [c.op for c in sample_comm(spec, resolve_framework("torch"), rows=64, tp=4)] == \
        ["all_gather", "all_reduce", "all_reduce"]
    cm = CostModel(parse_cluster("h100-sxm:1x8"), framework=vllm)
    layout = Layout(tp=4)
    topo = Topology(first=0, size=4, gpus_per_node=8)
    own = dataclasses.replace(vllm, logits_all_gather=False)
    step, tp_comm, _, _ = decode_step_s(spec, vllm, cm.hw, layout, topo, b=64, groups=1, ctx=2048)
    step0, tp_comm0, _, _ = decode_step_s(spec, own, cm.hw, layout, topo, b=64, groups=1, ctx=2048)
    gather = all_gather_s(2.0 * 64 * spec.vocab_size, topo.group(layout, "tp"), cm.hw)
    assert tp_comm - tp_comm0 >= gather * (1 - 1e-9) and gather > 0
    sampling = SAMPLE_BYTES * 64 * spec.vocab_size * 3 / 4 / cm.hw.mem_bytes_s  # the other ranks' blocks
    assert step - step0 >= gather + 0.5 * sampling


def test_the_floors_that_skip_costing_never_exceed_the_cost() -> None:
    """`call_candidates` skips layouts whose states alone exceed the memory, and `_split_decode`
    split layouts whose prefill and decode alone lose: both floors must bound the full cost."""
    from planner.algorithms import ppo as ppo_graph
    from planner.candidates import costed_view, layouts_for

    cluster = parse_cluster("a100-80gb:2x8")
    cm = CostModel(cluster)
    graph = ppo_graph("llama-2-13b", batch=64, prompt_len=512, gen_len=256)
    mesh = Mesh.block(0, 8)
    checked = 0
    for call in graph.calls:
        view = costed_view(call, graph.models[call.model])
        lays = layouts_for(call, graph.models[call.model], 8, cluster)[::7]
        for lay in lays:
            cost = cm.call_cost(call, view, mesh, lay)
            assert cm.state_floor_bytes(view, lay) <= cost.peak_mem_bytes
            checked += 1
        if call.kind == "generate":
            for pre, dec in zip(lays, lays[1:]):
                split = cm.call_cost(call, view, mesh, pre, decode_layout=dec)
                assert cm.split_floor_s(call, view, mesh, pre, dec) <= split.time_s
                assert split.breakdown_s.get("reshard", 0) > 0
    assert checked > 20


@pytest.mark.parametrize("keep", [1, 2, 4, 7])
def test_train_candidates_priced_lazily_are_those_pricing_every_layout_keeps(keep: int) -> None:
    """`call_candidates` prices a train layout's time only as far as its pipeline bound
    (`CostModel.train_time_floor_s`) when it could still be kept: the kept candidates equal those
    of pricing every layout that fits, and the bound never exceeds the time."""
    from planner.algorithms import ppo as ppo_graph
    from planner.candidates import Candidate, _train_candidates, costed_view, diverse, layouts_for, pareto

    cluster = parse_cluster("a100-80gb:3x8")
    cm = CostModel(cluster)
    graph = ppo_graph("llama-2-13b", critic="llama-2-7b", batch=256, prompt_len=512, gen_len=512, ppo_minibatches=2)
    cap = cluster.usable_mem_bytes
    compared = priced_fewer = 0
    for call in (c for c in graph.calls if c.kind == "train"):
        view = costed_view(call, graph.models[call.model])
        for size in (8, 16, 24):
            mesh = Mesh.block(0, size)
            fits = [lay for lay in layouts_for(call, view, size, cluster) if cm.train_peak_bytes(call, view, mesh, lay) <= cap]
            every = []
            for lay in fits:
                cost = cm.call_cost(call, view, mesh, lay)
                assert cm.train_time_floor_s(call, view, mesh, lay) <= cost.time_s
                assert cm.train_state_bytes(call, view, mesh, lay) == cost.state_mem_bytes
                every.append(Candidate(mesh, lay, cost))
            lazy = _train_candidates(call, view, cm, mesh, fits, keep)
            assert diverse(pareto(lazy), keep) == diverse(pareto(every), keep)
            compared += 1
            priced_fewer += len(lazy) < len(every)
    assert compared == 6 and priced_fewer >= 4  # and the bound saves work


def _zero_sync(framework: str, *, zero: int, recompute: str = "none", m: int = 4, window_s: float = 0.0):
    """The exposed data-parallel time of 1e9 parameters on 32 A100s, with what computed it."""
    cm = CostModel(parse_cluster("a100-80gb:4x8"), framework=framework)
    topo = Topology(0, 32, 8)
    layout = Layout(dp=32, zero=zero, recompute=recompute, micro_batches=m)
    return grad_sync_s(1e9, resolve_framework(framework), cm.hw, layout, topo, m=m, microbatch_s=window_s,
                       last_bwd_s=window_s, zero3_groups=32), cm, topo, layout


def test_zero3_gathers_per_micro_batch_by_stack():
    """Nothing hidden (no compute to hide under): FSDP stacks gather twice per micro-batch, for the
    forward and the backward, a full recompute's forward sharing the backward's gather; the
    runtime, whose autograd keeps its gathers, once, and twice under full recompute."""
    for fw, none, full in (("megatron-core", 2, 2), ("torch", 1, 2)):
        t_none, cm, topo, layout = _zero_sync(fw, zero=3)
        t_full, *_ = _zero_sync(fw, zero=3, recompute="full")
        g = topo.group(layout, "dpcp")
        f = resolve_framework(fw)
        ag = comm.all_gather_s(1e9 * f.param_bytes, g, cm.hw)
        assert t_full - t_none == pytest.approx(4 * (full - none) * ag, rel=1e-6)
        rs = comm.reduce_scatter_s(1e9 * f.grad_bytes, g, cm.hw)
        assert t_none >= 4 * (rs + none * ag)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_the_runtime_reduces_over_dp_and_cp_together_but_for_zero3_slices(zero):
    """Under context parallel the runtime's ZeRO 0-2 reduce over the dp x cp ranks as one group,
    bucketed under the backward as Megatron-core does (the same time); its ZeRO-3 slices are the dp
    axis's, the cp ranks holding the same ones, so their gradients are reduce-scattered over dp and
    then all-reduced over the cp group after the backward."""
    cm = CostModel(parse_cluster("a100-80gb:4x8"), framework="torch")
    fw, core, topo = resolve_framework("torch"), resolve_framework("megatron-core"), Topology(0, 32, 8)
    layout = Layout(dp=8, cp=4, zero=zero)
    got = grad_sync_s(1e9, fw, cm.hw, layout, topo, m=1, microbatch_s=0.0, last_bwd_s=10.0)
    if zero < 3:
        assert fw.zero_group(layout) == "dpcp" and fw.zero_ranks(layout) == 32
        unfolded = dataclasses.replace(core, zero1_all_reduce=fw.zero1_all_reduce,
                                       grads_sharded_from_zero=fw.grads_sharded_from_zero, grad_bytes=fw.grad_bytes)
        assert got == pytest.approx(grad_sync_s(1e9, unfolded, cm.hw, layout, topo, m=1, microbatch_s=0.0, last_bwd_s=10.0))
        return
    assert fw.zero_group(layout) == "dp" and fw.zero_ranks(layout) == 8 and core.zero_ranks(layout) == 32
    cp_sum = comm.all_reduce_s(1e9 * fw.grad_bytes / 8, topo.group(layout, "cp"), cm.hw)
    # The same reduction over the dp group named explicitly, without the cp sum (no skew on GPUs).
    over_dp = grad_sync_s(1e9, fw, cm.hw, layout, topo, m=1, microbatch_s=0.0, last_bwd_s=10.0, group="dp")
    assert cp_sum > 0 and got == pytest.approx(cp_sum + over_dp, rel=1e-9)


def test_the_last_micro_batch_reduces_under_its_own_backward():
    """Each parameter group's gradients leave as its backward ends: with a backward long enough,
    the last micro-batch exposes one group's share (of 32) and the interference, not the whole
    reduce-scatter."""
    exposed, cm, topo, layout = _zero_sync("megatron-core", zero=2, m=1, window_s=100.0)
    g = topo.group(layout, "dpcp")
    rs = comm.reduce_scatter_s(1e9 * 4, g, cm.hw)
    assert exposed == pytest.approx(rs / 32 + comm.overlap_interference_s(rs - rs / 32, cm.hw, g), rel=1e-9)
    assert exposed < 0.5 * rs


def test_a_collective_across_nodes_takes_two_sms_per_rank_of_a_node():
    """NCCL gives a ring that leaves the node one channel per NIC its ranks there use (one NIC per
    GPU on DGX/HGX nodes) and doubles them; inside a node it opens 32 over NVLink. The SMs those
    channels hold are what a hidden collective takes from the compute beside it."""
    hw = CostModel(parse_cluster("h100-sxm:4x8")).hw
    within, one, four, eight = Group(8, 8, 1), Group(4, 1, 8), Group(16, 4, 2), Group(32, 8, 1)
    assert [comm.nccl_channels(g) for g in (None, within, one, four, eight)] == [32, 32, 2, 8, 16]
    lost = {k: comm.overlap_interference_s(1.0, hw, g) for k, g in (("within", within), ("one", one), ("eight", eight))}
    assert lost["within"] == pytest.approx(32 / (132 - 32)) and lost["one"] == pytest.approx(2 / 130)
    assert lost["one"] < lost["eight"] < lost["within"]
    # What stays exposed is the same; only the hidden rest's slowdown depends on the group.
    assert comm.overlapped_s(1.0, 0.4, 0.1, hw, one) == pytest.approx(0.6 + 0.4 * 2 / 130)


def test_a_communicator_across_nodes_holds_buffers_for_its_own_channels():
    """NCCL keeps a connection's buffers per channel of a communicator (12 MiB, NVIDIA/nccl#1685),
    so one across nodes holds them for the channels its NICs give it, with its tree's beside its
    ring's; one inside a node for NVLink's 32. A plan's data-parallel group under tp 8 across four
    nodes thus holds 48 MiB, not 768."""
    from cost_models.memory import NCCL_CHANNEL_BYTES, NCCL_P2P_CHANNELS, nccl_bytes

    within, one, eight = Group(8, 8, 1), Group(4, 1, 8), Group(32, 8, 1)
    assert nccl_bytes([within], p2p_peers=0) == 32 * NCCL_CHANNEL_BYTES
    assert nccl_bytes([one], p2p_peers=0) == 2 * 2 * NCCL_CHANNEL_BYTES == 48 * 2**20
    assert nccl_bytes([eight], p2p_peers=0) == 2 * 16 * NCCL_CHANNEL_BYTES
    assert nccl_bytes([within, one], p2p_peers=2) == (32 + 4 + 2 * NCCL_P2P_CHANNELS) * NCCL_CHANNEL_BYTES
    # ... and a plan's memory says so: tp 8 inside each node, dp 4 across the four nodes.
    cm = CostModel(parse_cluster("h100-sxm:4x8"), framework="megatron-core")
    decl = ModelDecl(spec=LLAMA, trainable=True)
    call = Call(name="t", model="m", kind="train", seqs=64, seq_len=2048, loss="sft")
    cost = cm.call_cost(call, decl, Mesh.block(0, 32), Layout(tp=8, dp=4, zero=1, micro_batches=16,
                                                               sequence_parallel=True))
    assert cost.mem_breakdown_bytes["nccl"] == (32 + 4) * NCCL_CHANNEL_BYTES


def test_the_runtime_all_reduces_under_zero1_and_reduces_once_under_zero2():
    """The runtime keeps whole gradients until ZeRO-3 (`grads_sharded_from_zero`): ZeRO-1 all-reduces
    them and ZeRO-2 sums each bucket on its owner, once per step; Megatron's distributed optimizer
    reduce-scatters (ZeRO-1) and DeepSpeed's ZeRO-2 every micro-batch."""
    z1, cm, topo, layout = _zero_sync("torch", zero=1)
    g = topo.group(layout, "dpcp")
    assert z1 >= comm.all_reduce_s(4e9, g, cm.hw)
    z2, *_ = _zero_sync("torch", zero=2)
    assert comm.reduce_scatter_s(4e9, g, cm.hw) <= z2 < 2 * comm.reduce_scatter_s(4e9, g, cm.hw)
    mc1, *_ = _zero_sync("megatron-core", zero=1)
    assert mc1 < comm.all_reduce_s(4e9, g, cm.hw)
    mc2, *_ = _zero_sync("megatron-core", zero=2)
    assert mc2 >= 4 * comm.reduce_scatter_s(4e9, g, cm.hw)


def test_megatron_core_accumulates_weight_gradients_inside_the_weight_gradient_gemm():
    """Megatron-LM fuses the micro-batch's weight-gradient accumulation into the weight-gradient
    GEMM by default (`--gradient-accumulation-fusion`, Transformer Engine's
    `fuse_wgrad_accumulation`): `megatron-core` adds only the norms' weights (and biases) by a
    kernel of their own, and its weight-gradient GEMMs read and write the fp32 buffer (4 + 4 bytes
    per weight instead of writing 2). Megatron-DeepSpeed (`megatron`, vTrain's runs) and the
    runtime add every gradient by a kernel of their own. Each extra micro-batch therefore costs the
    unfused stack that kernel more."""
    from cost_models.framework import FRAMEWORKS
    from cost_models.ops import gemm, gemm_bwd, layer_matrix_params, layer_params_per_rank, layer_work

    core = FRAMEWORKS["megatron-core"]
    unfused = dataclasses.replace(core, name="unfused", wgrad_accum_fused=False)
    assert core.wgrad_accum_fused and not FRAMEWORKS["megatron"].wgrad_accum_fused
    assert not FRAMEWORKS["torch"].wgrad_accum_fused and not FRAMEWORKS["rlhf-engine"].wgrad_accum_fused
    fused_w = layer_work(LLAMA, core, b=1, s=1024, tp=2, cp=1, sp=True)
    plain_w = layer_work(LLAMA, unfused, b=1, s=1024, tp=2, cp=1, sp=True)
    weights, norms = layer_params_per_rank(LLAMA, 2), 2 * LLAMA.hidden_size  # two RMSNorm weights, whole
    assert weights - layer_matrix_params(LLAMA) / 2 == pytest.approx(norms)
    assert fused_w.grad_accum.bytes == pytest.approx(10 * norms) and fused_w.grad_tensors == 2  # fp32: 2 + 4 + 4
    assert plain_w.grad_accum.bytes == pytest.approx(unfused.grad_accum_bytes * weights) and plain_w.grad_tensors == 9
    # The weight-gradient GEMMs carry the buffer's traffic: 6 bytes more per weight of the four
    # matrices (the norms' weights are not GEMMs).
    extra = sum(f.bytes for f in fused_w.bwd) - sum(p.bytes for p in plain_w.bwd)
    h = LLAMA.hidden_size
    mats = (h * (LLAMA.num_attention_heads + 2 * LLAMA.kv_heads) * LLAMA.d_head + LLAMA.num_attention_heads
            * LLAMA.d_head * h + 3 * h * LLAMA.ffn_size) / 2
    assert extra == pytest.approx(6.0 * mats)
    dgrad, wgrad = gemm_bwd(gemm(8, 16, 32), accum_bytes=6.0)
    assert wgrad.bytes == gemm(32, 16, 8).bytes + 6.0 * 32 * 16 and dgrad == gemm(8, 32, 16)
    # On a step: the fused stack pays nothing per micro-batch for it, the unfused a kernel each.
    decl = ModelDecl(spec=LLAMA, trainable=True)
    hw_cal = Calibration(coefficients=COEF.model_copy(update={"host_kernel_us": 5.0}))
    times = {}
    for fw in (core, unfused):
        cm = CostModel(parse_cluster("a100-80gb:1x8"), hw_cal, framework=fw)
        times[fw.name] = [cm.call_cost(TRAIN, decl, Mesh.block(0, 8), Layout(dp=8, micro_batches=m)).time_s
                          for m in (1, 8)]
    assert times["megatron-core"][1] < times["unfused"][1]
    assert times["unfused"][1] - times["unfused"][0] > times["megatron-core"][1] - times["megatron-core"][0]


def test_megatron_runs_its_unfused_vocab_parallel_cross_entropy():
    """Megatron's loss without --cross-entropy-loss-fusion (its default) upcasts the logits to fp32
    and makes six passes forward (upcast, max, subtract, exp, sum, divide) and two backward
    (multiply, the upcast's backward): 52 bytes per logit in eight kernels, on Megatron-LM and on
    Megatron-DeepSpeed. Stacks with a fused loss keep one kernel each way. Only the loss kernels
    differ, so the difference between two heads is exactly those bytes; on a step with a large
    vocabulary over a narrow model it is a visible share."""
    from cost_models.framework import FRAMEWORKS, UNFUSED_CROSS_ENTROPY
    from cost_models.ops import head_work

    fused = FRAMEWORKS["torch"]
    for name in ("megatron", "megatron-core"):
        fw = FRAMEWORKS[name]
        assert (fw.loss_fwd, fw.loss_bwd) == UNFUSED_CROSS_ENTROPY
    assert sum(UNFUSED_CROSS_ENTROPY[0]) + sum(UNFUSED_CROSS_ENTROPY[1]) == 52.0
    assert len(UNFUSED_CROSS_ENTROPY[0]) + len(UNFUSED_CROSS_ENTROPY[1]) == 8
    for name in ("torch", "rlhf-engine", "vllm"):
        assert (FRAMEWORKS[name].loss_fwd, FRAMEWORKS[name].loss_bwd) == ((14.0,), (6.0,))
    core = FRAMEWORKS["megatron-core"]
    as_fused = dataclasses.replace(core, name="fused loss", loss_fwd=fused.loss_fwd, loss_bwd=fused.loss_bwd)
    b, s, tp = 2, 1024, 2
    logits = b * s * LLAMA.vocab_size / tp
    (uf, ub), (ff, fb) = (head_work(LLAMA, fw, head="lm", b=b, s=s, tp=tp, cp=1, sp=True, loss=True)
                          for fw in (core, as_fused))
    assert len(uf) - len(ff) == 5 and len(ub) - len(fb) == 1
    extra = sum(k.bytes for k in (*uf, *ub)) - sum(k.bytes for k in (*ff, *fb))
    assert extra == pytest.approx((52.0 - 20.0) * logits)
    # Inference log-probs (no loss) are not this kernel.
    assert head_work(LLAMA, core, head="lm", b=b, s=s, tp=tp, cp=1, sp=True, loss=False)[0] == \
        head_work(LLAMA, as_fused, head="lm", b=b, s=s, tp=tp, cp=1, sp=True, loss=False)[0]
    decl = ModelDecl(spec=LLAMA, trainable=True)
    t = {fw.name: CostModel(parse_cluster("a100-80gb:1x8"), framework=fw).call_cost(
        TRAIN, decl, Mesh.block(0, 8), Layout(dp=8)).time_s for fw in (core, as_fused)}
    assert t["megatron-core"] > t["fused loss"]


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_context_parallel_attention_runs_one_kernel_per_block_of_keys_and_merges_each(cp) -> None:
    """Transformer Engine's ring attention (`ops.ring_attention`): cp fused-attention calls of the
    same total scores as one causal kernel over the sequence (1/cp of them on the rank), each
    merged into the output; backward adds q's and the keys' and values' gradients per call."""
    from cost_models.ops import _attention, layer_work, ring_attention

    spec, fw = resolve_model("llama-3-8b"), resolve_framework("megatron-core")
    b, s, tp = 2, 8192, 2
    s_loc = s // cp
    fwd, bwd = ring_attention(spec, fw, b=b, s_loc=s_loc, tp=tp, cp=cp)
    whole_f, whole_b = _attention(spec, fw, b=b, s_q=s_loc, s_k=s, tp=tp, causal=True)
    for ring, whole in ((fwd, whole_f), (bwd, whole_b)):
        attn = [k for k in ring if k.kind == "attn"]
        assert len(attn) == cp
        assert sum(k.scores for k in attn) == pytest.approx(whole[0].scores, rel=1e-12)
        assert sum(k.flops for k in attn) == pytest.approx(whole[0].flops, rel=1e-12)
        # Each call sees about s / (2 cp) keys per query where one kernel would see s / 2.
        assert all(k.scores / (k.batch * k.m) <= s_loc / 2 + 1 for k in attn)
    q = b * s_loc * spec.num_attention_heads * spec.d_head / tp
    kv = 2 * b * s_loc * spec.kv_heads * spec.d_head / tp
    merge_f = sum(k.bytes for k in fwd if k.kind != "attn")
    merge_b = sum(k.bytes for k in bwd if k.kind != "attn")
    assert merge_f == pytest.approx(4 * kv + 4 * q + 6 * q * (cp - 1))  # pack K, V; first output, then cp - 1 merges
    assert merge_b == pytest.approx(4 * kv + 4 * q + 6 * q * (cp - 1) + 2 * kv + 3 * kv * (cp - 2) + 6 * kv)
    # In a layer: Megatron-Core's ring, not the runtime's gathered K and V, nor a sliding window.
    ring_layer = layer_work(spec, fw, b=b, s=s, tp=tp, cp=cp, sp=True)
    assert ring_layer.attn_core == fwd
    runtime = layer_work(spec, resolve_framework("torch"), b=b, s=s, tp=tp, cp=cp, sp=True)
    assert sum(k.kind == "attn" for k in runtime.attn_core) == 1
    mistral = resolve_model("mistral-7b-v0.1")
    assert sum(k.kind == "attn" for k in layer_work(mistral, fw, b=b, s=s, tp=tp, cp=cp, sp=True).attn_core) == 1


def test_ulysses_context_parallel_attends_over_the_whole_sequence_with_a_share_of_the_heads() -> None:
    """verl's FSDP workers (`verl-fsdp`): q, k and v all-to-all'd to the whole sequence with 1/cp
    of the heads, one kernel over it, the output back; k and v repeated up to cp heads where they
    have fewer; each exchange copies its parts out and concatenates what it gets."""
    from cost_models.ops import INDEX_BYTES, _attention, layer_work

    fw = resolve_framework("verl-fsdp")
    assert fw.cp_comm == "all_to_all" and resolve_framework("rlhf-engine-hf").cp_comm == "all_gather"
    spec = resolve_model("llama-3-8b")  # 32 heads, 8 of k and v
    b, s, cp = 1, 16384, 4
    work = layer_work(spec, fw, b=b, s=s, tp=1, cp=cp, sp=False)
    attn = [k for k in work.attn_core if k.kind == "attn"]
    whole = _attention(spec, fw, b=b, s_q=s // cp, s_k=s, tp=1, causal=True)[0][0]
    assert len(attn) == 1 and attn[0].m == s and attn[0].batch == b * 32 // cp
    assert attn[0].flops == pytest.approx(whole.flops, rel=1e-12)  # the same scores, another shape
    q_bytes = 2.0 * b * (s // cp) * 32 * 128
    kv_bytes = 2.0 * b * (s // cp) * 8 * 128
    a2a = [c for c in work.fwd_comm if c.group == "cp"]
    assert [c.op for c in a2a] == ["all_to_all"] * 3 + ["all_gather", "all_to_all"]
    assert [c.bytes for c in a2a] == [q_bytes, kv_bytes, kv_bytes, INDEX_BYTES * b * s, q_bytes]
    assert [c.op for c in work.bwd_comm if c.group == "cp"] == ["all_to_all"] * 4
    copies = sum(k.bytes for k in work.attn_core if k.kind != "attn")
    assert copies == pytest.approx(4 * (2 * q_bytes + 2 * kv_bytes))  # two copies of 2+2 bytes per exchange
    # Two heads of k and v per rank at cp 8 over tp 4: each repeated to 8 (read 2, write 8 heads).
    rep = layer_work(spec, fw, b=b, s=s, tp=4, cp=8, sp=False)
    kv8 = 2.0 * b * (s // 8) * 8 * 128
    extra = sum(k.bytes for k in rep.attn_core if k.kind != "attn") - 4 * (2 * 2.0 * b * (s // 8) * 8 * 128 + 2 * kv8)
    assert extra == pytest.approx(2 * (kv8 / 4 + kv8))
