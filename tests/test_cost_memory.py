"""Memory estimates against closed forms: Korthikanti et al. 2022 (activations), ZeRO (model states),
the parameter catalog of `plans.sharding`, and the vTrain configurations fitting in 80 GB."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cost_models import CostModel
from cost_models.framework import FRAMEWORKS
from cost_models.measured import read_measured
from cost_models.memory import kv_cache_bytes, layer_activation_bytes, stage_params
from cost_models.ops import layer_params_per_rank
from plans import Call, Layout, Mesh, ModelDecl, parse_cluster, resolve_model
from plans.sharding import box_numel, parameters, shard_box, stage_layers

MEGATRON = FRAMEWORKS["megatron"]
GPT = resolve_model(dict(model_type="gpt", hidden_size=4096, num_hidden_layers=8, num_attention_heads=32,
                         vocab_size=51200, max_position_embeddings=2048))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("b,s", [(1, 2048), (4, 1024)])
def test_activations_match_korthikanti(tp, b, s):
    """Korthikanti et al. 2022, Table 2, per layer in bytes."""
    h, a = GPT.hidden_size, GPT.num_attention_heads
    sbh = s * b * h
    act = lambda **kw: layer_activation_bytes(GPT, MEGATRON, b=b, s=s, tp=tp, **kw)  # noqa: E731
    assert act(sp=False, recompute="none") == pytest.approx(sbh * (10 + 24 / tp + 5 * a * s / (h * tp)))
    assert act(sp=False, recompute="selective") == pytest.approx(sbh * (10 + 24 / tp))
    assert act(sp=False, recompute="full") == pytest.approx(2 * sbh)
    if tp > 1:
        assert act(sp=True, recompute="none") == pytest.approx(sbh / tp * (34 + 5 * a * s / h))
        assert act(sp=True, recompute="selective") == pytest.approx(34 * sbh / tp)
        assert act(sp=True, recompute="full") == pytest.approx(2 * sbh / tp)


def test_activations_without_parallelism_are_34_plus_5as_over_h():
    h, a, s, b = GPT.hidden_size, GPT.num_attention_heads, 2048, 2
    got = layer_activation_bytes(GPT, MEGATRON, b=b, s=s, tp=1, sp=False, recompute="none")
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt", "llama-2-7b", "qwen2.5-7b", "gpt3-1.3b"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_stage_params_match_the_sharding_catalog(name, tp, pp):
    """The per-rank parameter count the cost model charges equals what plans.sharding assigns."""
    spec = resolve_model(name)
    lay = Layout(tp=tp, pp=pp)
    if spec.num_attention_heads % tp or spec.kv_heads % tp:
        pytest.skip("tp does not shard this model")
    layers = [len(x) for x in stage_layers(spec.num_hidden_layers, pp)]
    lp = layer_params_per_rank(spec, tp)
    for stage in range(pp):
        local = lay.local_rank(lay.coord(0)._replace(pp=stage))  # tp rank 0 holds the largest split
        exact = sum(box_numel(bx) for p in parameters(spec) if (bx := shard_box(p, spec, lay, local)) is not None)
        est = stage_params(spec, head="lm", layers=layers[stage], first=stage == 0, last=stage == pp - 1, tp=tp,
                           layer_params=lp)
        assert est == pytest.approx(exact, rel=1e-3, abs=64)


def test_stage_params_of_whole_model_is_num_params():
    for name in ("llama-2-7b", "gpt3-1.3b", "tiny-llama"):
        spec = resolve_model(name)
        est = stage_params(spec, head="lm", layers=spec.num_hidden_layers, first=True, last=True, tp=1,
                           layer_params=layer_params_per_rank(spec, 1))
        assert est == spec.num_params()


@pytest.mark.parametrize("framework,zero,per_param,frozen_bytes", [
    ("megatron", 0, 2 + 2 + 12, 2), ("megatron", 1, 2 + 2 + 12 / 8, 2), ("megatron", 2, 2 + (2 + 12) / 8, 2),
    ("megatron", 3, 16 / 8, 2),
    # the runtime: fp32 weights and gradients, Adam m and v (no separate master copy); its ZeRO-2
    # reduces each bucket to its owner but keeps the stage's whole gradient buffer
    ("torch", 0, 4 + 4 + 8, 4), ("torch", 1, 4 + 4 + 8 / 8, 4), ("torch", 2, 4 + 4 + 8 / 8, 4), ("torch", 3, 16 / 8, 4),
])
def test_model_states_by_zero_stage(framework, zero, per_param, frozen_bytes):
    """Rajbhandari et al. 2020: 2 (weights) + 2 (gradients) + 12 (fp32 master, Adam m, v) bytes per
    parameter under mixed precision, sharded over the data-parallel group stage by stage."""
    spec = resolve_model("llama-2-7b")
    cm = CostModel(parse_cluster("a100-80gb:1x8"), framework=framework)
    call = Call(name="t", model="m", kind="train", seqs=64, seq_len=512, loss="sft")
    cost = cm.call_cost(call, ModelDecl(spec=spec, trainable=True), Mesh.block(0, 8), Layout(dp=8, zero=zero, micro_batches=8))
    assert cost.state_mem_bytes == pytest.approx(spec.num_params() * per_param, rel=1e-6)
    frozen = cm.call_cost(Call(name="i", model="m", kind="inference", seqs=8, seq_len=512, returns="logprobs"),
                          ModelDecl(spec=spec), Mesh.block(0, 8), Layout(dp=8))
    assert frozen.state_mem_bytes == spec.num_params() * frozen_bytes


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_context_parallel_ranks_share_zero_states_where_the_stack_shards_over_them(zero):
    """Megatron-core shards the ZeRO states over the data-parallel group with its context-parallel
    ranks (dp x cp), and so does the runtime for ZeRO 1/2 (`RankGroups.dpcp`); the runtime's ZeRO-3
    slices are the dp axis's (`plans.sharding`), the cp ranks holding the same ones: there dp 2 x
    cp 4 holds what dp 2 holds, not what dp 8 does."""
    spec = resolve_model("llama-2-7b")
    call = Call(name="t", model="m", kind="train", seqs=16, seq_len=32768, loss="sft")
    decl = ModelDecl(spec=spec, trainable=True)
    states = {}
    for framework in ("torch", "megatron-core"):
        cm = CostModel(parse_cluster("a100-80gb:1x8"), framework=framework)
        states[framework] = [cm.call_cost(call, decl, Mesh.block(0, lay.size), lay).state_mem_bytes for lay in
                             (Layout(dp=2, cp=4, zero=zero, micro_batches=8), Layout(dp=2, zero=zero, micro_batches=8),
                              Layout(dp=8, zero=zero, micro_batches=2))]
    with_cp, dp2, dp8 = states["torch"]
    assert (with_cp == dp2 and with_cp > dp8) if zero == 3 else (with_cp == dp8 and with_cp < dp2)
    with_cp, dp2, dp8 = states["megatron-core"]
    assert with_cp == dp8 and with_cp < dp2


def test_full_recompute_keeps_only_layer_inputs_in_flight():
    """1F1B: stage 0 holds pp micro-batches of its layers' inputs (2sbh each), plus one layer's
    full activations while it recomputes (a small vocabulary keeps stage 0 the peak)."""
    spec = GPT.model_copy(update={"vocab_size": 1024})
    cm = CostModel(parse_cluster("a100-80gb:1x8"), framework="megatron")
    b, s, pp = 2, 2048, 4
    lay = Layout(pp=pp, dp=2, micro_batches=16, recompute="full")
    call = Call(name="t", model="m", kind="train", seqs=2 * 2 * 16, seq_len=s, loss="sft")
    cost = cm.call_cost(call, ModelDecl(spec=spec, trainable=True), Mesh.block(0, 8), lay)
    sbh = s * b * spec.hidden_size
    working = layer_activation_bytes(spec, MEGATRON, b=b, s=s, tp=1, sp=False, recompute="none")
    assert working == pytest.approx(sbh * (34 + 5 * spec.num_attention_heads * s / spec.hidden_size))
    layers0 = len(stage_layers(spec.num_hidden_layers, pp)[0])
    assert cost.mem_breakdown_bytes["activations"] == int(2 * sbh * layers0 * pp + working)


def test_kv_cache_closed_form():
    spec = resolve_model("llama-2-70b")  # 8 key/value heads of 128
    assert kv_cache_bytes(spec, seqs=16, ctx=4096, layers=80, tp=8) == 2 * 2 * 16 * 4096 * 80 * 8 * 128 / 8


def test_generate_cache_shrinks_with_waves():
    spec = resolve_model("llama-2-7b")
    cm = CostModel(parse_cluster("a100-80gb:1x8"))
    call = Call(name="g", model="m", kind="generate", seqs=256, seq_len=2048, gen_len=1024)
    one = cm.call_cost(call, ModelDecl(spec=spec), Mesh.block(0, 8), Layout(dp=8))
    four = cm.call_cost(call, ModelDecl(spec=spec), Mesh.block(0, 8), Layout(dp=8, micro_batches=4))
    assert one.mem_breakdown_bytes["kv_cache"] == kv_cache_bytes(spec, seqs=32, ctx=2048, layers=32, tp=1)
    assert four.mem_breakdown_bytes["kv_cache"] == one.mem_breakdown_bytes["kv_cache"] // 4
    assert four.time_s > one.time_s  # waves trade time for memory


def _vtrain_dir() -> Path | None:
    env = os.environ.get("PLANNER_DATA_DIR")
    root = Path(__file__).resolve().parents[1]
    for p in ([Path(env)] if env else []) + [root.parent / "shared" / "data", root.parent.parent / "shared" / "data"]:
        if (p / "vtrain").is_dir():
            return p / "vtrain"
    return None


# Megatron-LM GPT configurations (on Megatron-DeepSpeed) of the vTrain measurements with the largest memory per GPU
# (model, tp, pp, dp, micro-batch, global batch); all ran on 80 GB A100s with full recompute.
HEAVY = [((3072, 30, 32), 1, 1, 64, 8, 512), ((3072, 30, 32), 8, 1, 8, 64, 512), ((8192, 48, 64), 2, 8, 32, 6, 1536),
         ((8192, 48, 64), 1, 16, 32, 3, 1536), ((12288, 96, 96), 4, 32, 4, 6, 1536), ((12288, 96, 96), 2, 32, 8, 3, 1536)]


@pytest.mark.parametrize("model,tp,pp,dp,mb,gb", HEAVY)
def test_heavy_megatron_configs_fit_in_80gb(model, tp, pp, dp, mb, gb):
    h, layers, heads = model
    spec = resolve_model(dict(model_type="gpt", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                              vocab_size=51200, max_position_embeddings=2048))
    n = tp * pp * dp
    cm = CostModel(parse_cluster(f"a100-80gb:{n // 8}x8"), framework="megatron")
    lay = Layout(tp=tp, pp=pp, dp=dp, micro_batches=gb // (dp * mb), recompute="full")
    call = Call(name="t", model="m", kind="train", seqs=gb, seq_len=2048, loss="sft")
    cost = cm.call_cost(call, ModelDecl(spec=spec, trainable=True), Mesh.block(0, n), lay)
    assert 0.3 * cm.cluster.mem_bytes < cost.peak_mem_bytes <= cm.cluster.mem_bytes
    # Without recompute the same configuration does not fit: the check can fail.
    no_rc = cm.call_cost(call, ModelDecl(spec=spec, trainable=True), Mesh.block(0, n), lay.model_copy(update={"recompute": "none"}))
    assert no_rc.peak_mem_bytes > cm.cluster.mem_bytes


@pytest.mark.skipif(_vtrain_dir() is None, reason="vTrain data (../shared/data/vtrain) not present")
def test_every_vtrain_configuration_fits_in_80gb():
    vt = _vtrain_dir()
    assert vt is not None
    over = []
    for csv in sorted(vt.glob("*.csv")):
        for r in read_measured(csv):
            cluster = r.cluster(gpu="a100-80gb", gpus_per_node=8, intra_node_gbps=None, inter_node_gbps=800)
            cm = CostModel(cluster, framework="megatron")
            call = Call(name="t", model="m", kind="train", seqs=r.global_batch, seq_len=r.seq_len, loss="sft")
            cost = cm.call_cost(call, ModelDecl(spec=r.spec, trainable=True), Mesh.block(0, r.layout.size), r.layout)
            if cost.peak_mem_bytes > cluster.mem_bytes:
                over.append(f"{r.source}: {cost.peak_mem_bytes / 2**30:.1f} GiB")
    assert not over, over


def test_the_runtime_keeps_its_zero3_gathers_for_backward_and_fsdp_stacks_do_not():
    """ZeRO-3 without full recompute: the runtime's gather is an autograd function whose outputs
    the matmuls save, so every layer's compute-dtype weights (2 bytes each) stay until backward
    (`Framework.zero3_keeps_gathered`); FSDP stacks free them after the forward. Full recompute
    frees them in the runtime too. On a CPU the runtime computes in fp32: 4 bytes."""
    spec = resolve_model("llama-2-7b")
    call = Call(name="t", model="m", kind="train", seqs=64, seq_len=512, loss="sft")
    decl = ModelDecl(spec=spec, trainable=True)

    def mem(framework: str, cluster: str, **kw) -> dict[str, int]:
        cm = CostModel(parse_cluster(cluster), framework=framework)
        n = cm.cluster.nodes * cm.cluster.gpus_per_node
        return cm.call_cost(call, decl, Mesh.block(0, n), Layout(dp=n, zero=3, micro_batches=8, **kw)).mem_breakdown_bytes

    assert mem("torch", "a100-80gb:1x8")["gathered"] == pytest.approx(2 * spec.num_params(), rel=1e-6)
    assert "gathered" not in mem("torch", "a100-80gb:1x8", recompute="full")
    assert "gathered" not in mem("megatron-core", "a100-80gb:1x8")
    tiny = resolve_model("tiny-llama")
    decl = ModelDecl(spec=tiny, trainable=True)
    assert mem("torch", "cpu:1x4")["gathered"] == pytest.approx(4 * tiny.num_params(), rel=1e-6)


@pytest.mark.parametrize("cluster,staging", [("a100-80gb:1x8", False), ("cpu:1x4", True)])
def test_a_runtime_zero1_step_holds_a_copy_of_its_part_and_gloo_the_whole(cluster, staging):
    """After a ZeRO-1/2 step the runtime all-gathers the flat buffer from a copy of each rank's
    part (`DataParallel.step`), and gloo stages the gathered whole before copying it in: with
    activations smaller than that (a tiny batch), the step is the peak. Megatron's distributed
    optimizer gathers in place."""
    spec = resolve_model("llama-2-7b")
    call = Call(name="t", model="m", kind="train", seqs=4, seq_len=64, loss="sft")
    decl = ModelDecl(spec=spec, trainable=True)
    for framework in ("torch", "megatron-core"):
        cm = CostModel(parse_cluster(cluster), framework=framework)
        n = cm.cluster.nodes * cm.cluster.gpus_per_node
        for zero in (1, 2):
            got = cm.call_cost(call, decl, Mesh.block(0, n), Layout(dp=n, zero=zero)).mem_breakdown_bytes
            live = sum(got.get(k, 0) for k in ("activations", "logits", "buffers", "weight_casts"))
            if framework == "megatron-core":
                assert "step" not in got
                continue
            whole = 4 * spec.num_params()
            # On a GPU the bf16 casts of the weights that the micro-batch keeps outweigh the copy.
            assert live + got.get("step", 0) == pytest.approx(max(live, whole / n + (whole if staging else 0)), rel=1e-6)
            assert ("step" in got) == staging


def _runtime_saved_bytes(spec, *, b: int, s: int, dtype, recompute: str, head: str = "lm", outputs: bool = False) -> int:
    """Bytes autograd keeps through the runtime's forward (`runtime.engine.ModelRunner`, one
    process), the parameters themselves left out: what every saved tensor's storage holds."""
    import torch

    from runtime.engine import ModelRunner
    from runtime.groups import solo_groups
    from runtime.model import init_tensor

    runner = ModelRunner(spec, head=head, trainable=True, groups=solo_groups(Layout(recompute=recompute)),
                         state=lambda p: init_tensor(p, seed=0), device=torch.device("cpu"), dtype=dtype)
    tokens = torch.randint(0, spec.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))

    def forward() -> None:
        h = runner._run_stage(tokens, None)
        if outputs:
            runner._outputs(h, tokens, "logprobs" if head == "lm" else "values")

    return _saved_storage_bytes(runner.shard.params.values(), forward)


def _saved_storage_bytes(params, forward) -> int:
    """Bytes of every storage autograd saves while `forward()` runs, `params`' own left out."""
    import torch

    kept = {t.untyped_storage().data_ptr() for t in params}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in kept:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


EAGER_SPECS = {
    "llama-gqa": dict(model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                      intermediate_size=128, vocab_size=256, max_position_embeddings=128),
    "llama-bias": dict(model_type="llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=4,
                       intermediate_size=352, vocab_size=256, max_position_embeddings=128, attention_bias=True),
    "gpt": dict(model_type="gpt", hidden_size=128, num_attention_heads=4, intermediate_size=512, vocab_size=256,
                max_position_embeddings=128),
    # Norms of q and k: Qwen3's per head, OLMoE's over the whole projection.
    "qwen3-qk-norm": dict(model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                          intermediate_size=128, vocab_size=256, max_position_embeddings=128, head_dim=8,
                          qk_norm="head"),
    "olmoe-qk-norm": dict(model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                          intermediate_size=128, vocab_size=256, max_position_embeddings=128, qk_norm="proj"),
}
# The runtime's sparse layers (every layer sparse): Mixtral's routed experts, and Qwen-MoE's with a
# gated shared expert and un-normalised top-k.
RUNTIME_MOE_SPECS = {
    "moe-routed": dict(model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=128, vocab_size=256, max_position_embeddings=128, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=48),
    "moe-shared-gated": dict(model_type="llama", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                             intermediate_size=128, vocab_size=256, max_position_embeddings=128, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=56,
                             shared_expert_gate=True, norm_topk_prob=False),
}


@pytest.mark.parametrize("name", sorted(EAGER_SPECS) + sorted(RUNTIME_MOE_SPECS))
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_runtime_layers_keep_exactly_what_the_memory_model_counts(name, recompute):
    """`eager_layer_saved_bytes` against what autograd really keeps in the runtime's layers, byte for
    byte, in fp32 (a CPU run) and under bf16 autocast with fp32 weights (a GPU run; CPU autocast
    applies the same casting rules): one layer is the difference between 4 and 2 layers, and the
    weights' bf16 casts are the layer's matrices at 2 bytes each (`weight_casts`), a sparse layer's
    routed experts, router and shared expert's gate among them (`layer_cast_params`). The sparse
    layers' bytes do not depend on how the router spreads the copies over the experts."""
    import torch

    from cost_models.memory import eager_layer_saved_bytes
    from cost_models.ops import ExpertLoad, layer_cast_params

    fields = {**EAGER_SPECS, **RUNTIME_MOE_SPECS}[name]
    b, s = 4, 24
    for dtype, compute in ((torch.float32, 4), (torch.bfloat16, 2)):
        got = [_runtime_saved_bytes(resolve_model({**fields, "num_hidden_layers": n}), b=b, s=s, dtype=dtype,
                                    recompute=recompute) for n in (2, 4)]
        spec = resolve_model({**fields, "num_hidden_layers": 2})
        moe = ExpertLoad(routed=b * s, active=spec.experts, rows=b * s * spec.num_experts_per_tok // spec.experts,
                         width=spec.expert_ffn, skew=1.0, a2a_bytes=0.0) if spec.is_moe else None
        casts = 2 * layer_cast_params(spec, sparse=spec.is_moe, tp=1) if compute == 2 and recompute != "full" else 0
        want = eager_layer_saved_bytes(spec, b=b, s=s, tp=1, sp=False, recompute=recompute, compute_bytes=compute,
                                       moe=moe)
        assert (got[1] - got[0]) / 2 == want + casts, (dtype, recompute)


@pytest.mark.parametrize("head", ["lm", "value"])
def test_the_runtime_head_keeps_its_final_norm_and_its_input(head):
    """The last stage keeps the final norm's tensors and the head's input beyond its layers
    (`eager_head_saved_bytes`): fp32 for the LM head's chunked log-probs, a cast for the value head."""
    import torch

    from cost_models.memory import eager_head_saved_bytes

    spec = resolve_model({**EAGER_SPECS["llama-gqa"], "num_hidden_layers": 1})
    b, s = 4, 24
    for dtype, compute in ((torch.float32, 4), (torch.bfloat16, 2)):
        kw = dict(b=b, s=s, dtype=dtype, recompute="none", head=head)
        head_bytes = _runtime_saved_bytes(spec, outputs=True, **kw) - _runtime_saved_bytes(spec, **kw)
        want = eager_head_saved_bytes(spec, head=head, b=b, s=s, tp=1, sp=False, compute_bytes=compute)
        # Also kept, and left out as small: the targets and log-sum-exp of each position (LM head)
        # or the value head's weight cast.
        assert 0 <= head_bytes - want <= 16 * b * s + 2 * spec.hidden_size, (dtype, head_bytes, want)


def _hf_saved_bytes(fields: dict, *, layers: int, b: int, s: int, checkpoint: bool, lm_head: bool) -> int:
    """Bytes autograd keeps through an HF transformers Llama (or GPT-2) forward on bf16 weights (SDPA attention,
    as FSDP and DeepSpeed engines train it; `checkpoint`: HF's non-reentrant gradient checkpointing),
    the parameters left out: what every saved tensor's storage holds."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if fields.get("qk_norm") == "head":  # Qwen3
        cfg = Qwen3Config(**{k: v for k, v in fields.items() if k not in ("model_type", "qk_norm")},
                          num_hidden_layers=layers, attn_implementation="sdpa", use_cache=False)
        model_class = Qwen3ForCausalLM
    elif fields["model_type"] == "gpt":  # GPT-2 as its configs set it (gelu_new); no dropout, as RLHF trains
        cfg = GPT2Config(n_embd=fields["hidden_size"], n_inner=fields["intermediate_size"],
                         n_head=fields["num_attention_heads"], n_layer=layers, vocab_size=fields["vocab_size"],
                         n_positions=fields["max_position_embeddings"], resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, activation_function="gelu_new", attn_implementation="sdpa", use_cache=False)
        model_class = GPT2LMHeadModel
    else:
        cfg = LlamaConfig(hidden_size=fields["hidden_size"], intermediate_size=fields["intermediate_size"],
                          num_attention_heads=fields["num_attention_heads"],
                          num_key_value_heads=fields["num_key_value_heads"], num_hidden_layers=layers,
                          vocab_size=fields["vocab_size"], max_position_embeddings=fields["max_position_embeddings"],
                          attention_bias=fields.get("attention_bias", False), attn_implementation="sdpa",
                          use_cache=False)
        model_class = LlamaForCausalLM
    torch.manual_seed(0)
    model = model_class(cfg).to(torch.bfloat16).train()
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    return _saved_storage_bytes(model.parameters(), lambda: (model if lm_head else model.base_model)(input_ids=ids))


HF_SPECS = {name: fields for name, fields in EAGER_SPECS.items() if name != "olmoe-qk-norm"}  # no dense HF OLMoE


@pytest.mark.parametrize("name", sorted(HF_SPECS))
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hf_layers_keep_exactly_what_the_memory_model_counts(name, recompute):
    """`eager_layer_saved_bytes(style="hf")` (the `rlhf-engine-hf` stack) against what autograd keeps
    in `transformers`' own Llama and GPT-2 layers on bf16 weights, byte for byte, without and with
    gradient checkpointing (one layer: the difference between 4 and 2 layers); the last stage keeps
    the final norm's tensors and the LM head's input beyond them (`eager_head_saved_bytes`). A CPU's
    bf16 LayerNorm keeps its mean and rstd in bf16 where CUDA keeps fp32: 4 bytes a token per norm
    less here."""
    from cost_models.framework import FRAMEWORKS
    from cost_models.memory import eager_head_saved_bytes, eager_layer_saved_bytes, layer_activation_bytes

    b, s = 4, 24
    kw = dict(b=b, s=s, checkpoint=recompute == "full")
    two, four = (_hf_saved_bytes(HF_SPECS[name], layers=n, lm_head=True, **kw) for n in (2, 4))
    spec = resolve_model({**HF_SPECS[name], "num_hidden_layers": 2})
    want = eager_layer_saved_bytes(spec, b=b, s=s, tp=1, sp=False, recompute=recompute, style="hf")
    cpu_stats = 2 * 4 * b * s if spec.model_type == "gpt" and recompute != "full" else 0
    assert (four - two) / 2 == want - cpu_stats
    assert layer_activation_bytes(spec, FRAMEWORKS["rlhf-engine-hf"], b=b, s=s, tp=1, sp=False,
                                  recompute=recompute) == want
    # Beyond the layers: the final norm and the head's input (outside the checkpointed layers), and,
    # left out as small, the token ids (8 bytes each) and the rotary tables (under 4 bytes per
    # position and head dimension).
    head = eager_head_saved_bytes(spec, head="lm", b=b, s=s, tp=1, sp=False, style="hf")
    layers = 2 * (want - cpu_stats)
    assert 0 <= two - layers - head <= (8 + 4 * spec.d_head) * b * s, (two - layers, head)


# transformers' mixture-of-experts families (config class, model class, fields): 4 experts of width
# 48, top 2, hidden 64.
HF_MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(model_type="mixtral", num_local_experts=4,
                                                            intermediate_size=48)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        model_type="qwen2_moe", num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=56,
        intermediate_size=128)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        model_type="qwen3_moe", num_experts=4, moe_intermediate_size=48, head_dim=8, norm_topk_prob=True,
        intermediate_size=128)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(model_type="olmoe", num_experts=4, intermediate_size=48)),
}


@pytest.mark.parametrize("name", sorted(HF_MOE))
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_hf_moe_layers_keep_exactly_what_the_memory_model_counts(name, recompute):
    """`eager_layer_saved_bytes(style="hf")` with `hf_sparse_mlp_saved_bytes` against what autograd
    keeps in transformers' own Mixtral, Qwen2-MoE (gated shared expert), Qwen3-MoE (per-head q and k
    norms, renormalised top-k) and OLMoE (norms over the q and k projections) layers on bf16
    weights with their default ``grouped_mm`` experts, byte for byte, without and with gradient
    checkpointing (one layer: the difference between 4 and 2 layers). The bytes do not depend on
    how the router spreads the copies over the experts."""
    import torch
    import transformers

    from cost_models.framework import FRAMEWORKS
    from cost_models.memory import eager_layer_saved_bytes, layer_activation_bytes
    from cost_models.ops import ExpertLoad
    from plans.model import spec_from_hf_config

    config_class, model_class, fields = HF_MOE[name]
    common = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
                  max_position_embeddings=128, num_experts_per_tok=2)
    b, s = 4, 24

    def saved(layers: int) -> int:
        cfg = getattr(transformers, config_class)(**common, **{k: v for k, v in fields.items() if k != "model_type"},
                                                  num_hidden_layers=layers, attn_implementation="sdpa",
                                                  use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(cfg).to(torch.bfloat16).train()
        if recompute == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
        return _saved_storage_bytes(model.parameters(), lambda: model(input_ids=ids))

    got = (saved(4) - saved(2)) / 2
    spec = spec_from_hf_config({**common, **fields, "num_hidden_layers": 2}, source=name)
    t, k = b * s, spec.num_experts_per_tok
    moe = ExpertLoad(routed=t, active=spec.experts, rows=t * k // spec.experts, width=spec.expert_ffn, skew=1.0,
                     a2a_bytes=0.0)
    want = eager_layer_saved_bytes(spec, b=b, s=s, tp=1, sp=False, recompute=recompute, moe=moe, style="hf")
    assert got == want
    assert layer_activation_bytes(spec, FRAMEWORKS["rlhf-engine-hf"], b=b, s=s, tp=1, sp=False, recompute=recompute,
                                  moe=moe) == want
