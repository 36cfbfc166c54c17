"""The memory-bound kernels the cost model prices for a layer are the kernels the stack's own code
launches: each test runs one decoder layer forward and backward as the stack trains it (HF's on bf16
weights, the runtime's on fp32 weights under bf16 autocast) under a TorchDispatchMode that records
every aten op with the bytes it reads and writes, and compares their number and bytes with
`cost_models.ops.layer_work`'s (GEMMs and the attention kernel apart). Outside attention, the aten
ops a layer dispatches on a CPU are those it dispatches on a GPU, where each is a kernel.

What is counted: an op is one kernel (ATen's `slice_backward` two: a zero fill of the whole and a
copy of the slice, `TensorShape.cpp`; on CUDA `native_layer_norm_backward` two: the input's
gradient, and the weight's and bias's, which reads the output gradient and the input again,
`layer_norm_kernel.cu`); its bytes are those of its inputs and outputs, leaving out an
operand broadcast over heads or tokens (fewer than half the elements of the op's largest tensor:
a norm's weight, rotary's cos and sin, a per-token statistic, an index vector beside the rows it
picks), which is read from cache; an op whose tensors hold at most one value per token moves no
bytes that count (the model's 0-byte kernels). A fill (zeros_like, new_zeros) writes and reads
nothing; a cat or stack reads every piece however small (unless each holds a value per token at
most); views, splits, unbinds, allocations and
the collectives (counted as communication, not kernels) launch none.

The mixture-of-experts test checks the runtime's sparse layer the same way, on one rank and with
its experts over two gloo ranks (expert parallel), with a router set so that every expert gets
the same number of token copies."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models.framework import FRAMEWORKS
from cost_models.ops import layer_work
from plans import resolve_model

torch = pytest.importorskip("torch")

VIEWS = {"t", "view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided",
         "alias", "permute", "detach", "_reshape_alias", "reshape", "lift_fresh", "split", "split_with_sizes", "unbind",
         "empty", "empty_like", "new_empty"}  # allocations launch nothing either
FILLS = {"zeros_like", "new_zeros", "full_like", "ones_like", "zeros", "full"}  # write only
GATHERS = {"cat", "stack"}  # read every piece of a list, however small each is
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}
KERNELS_PER_OP = {"slice_backward": 2, "native_layer_norm_backward": 2, "embedding_dense_backward": 2}
# Indexing ops, by the elements they pick (a lookup's rows, a gather's or scatter's values): a
# lookup reads and writes its rows; a gather reads and writes what it picks; a scatter-add reads
# its values and reads and writes their places; an embedding's backward zero-fills the dense
# gradient of the whole table, then index-adds the incoming rows (read them, read and write theirs:
# two kernels, ATen's `embedding_dense_backward` on CUDA sorting the ids as well); a copy into a
# slice reads its source and writes the slice (nothing of the destination is read, `copy_`); an
# `index` by a tensor gathers (transformers' `x[perm]`), an `index_put` scatters its values (reads
# them, writes their places) or, accumulating (an index's backward), scatter-adds them.
PICKS = {
    "embedding": lambda picked, out: 2 * picked.numel() * picked.element_size(),
    "gather": lambda picked, out: 2 * picked.numel() * picked.element_size(),
    "index": lambda picked, out: 2 * picked.numel() * picked.element_size(),
    "index_put": lambda picked, out: 2 * picked.numel() * out.element_size(),  # + its places read if accumulating
    "index_put_": lambda picked, out: 2 * picked.numel() * out.element_size(),
    "scatter_add_": lambda picked, out: 3 * picked.numel() * out.element_size(),
    "embedding_dense_backward": lambda picked, out: out.numel() * out.element_size() + 3 * picked.numel() * out.element_size(),
}


def _recorder(tokens: int, weights: set[tuple[int, ...]] | frozenset = frozenset()):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Kernels(TorchDispatchMode):
        """(kernels, bytes) of every memory-bound op dispatched inside the block; apart, those of
        ops on the weights' shapes alone (casts of weights and of their gradients, accumulations)."""

        def __init__(self) -> None:
            super().__init__()
            self.kernels, self.bytes, self.ops = 0, 0, []
            self.weight_kernels, self.weight_bytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in VIEWS or name in GEMMS or "scaled_dot_product" in name or func.namespace == "c10d":
                return out
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            big = max(t.numel() for t in ins + outs)
            if name in GATHERS:  # pieces of one value per token make a per-token whole, however many
                big = max(t.numel() for t in ins)
            moved = 0
            if name in PICKS:  # an indexing op moves the rows it picks, not the table it picks them from
                picked = args[2] if name.startswith("index_put") else {
                    "embedding": outs[0], "gather": outs[0], "index": outs[0], "scatter_add_": ins[-1],
                    "embedding_dense_backward": ins[0]}[name]
                accumulate = name.startswith("index_put") and bool(args[3] if len(args) > 3 else (kwargs or {}).get(
                    "accumulate", False))
                big = picked.numel()
            if big > tokens:
                if name in FILLS:
                    ins = []
                nbytes = [t.numel() * t.element_size() for t in ins + outs if 2 * t.numel() >= big or name in GATHERS]
                moved = sum(nbytes)
                if name in PICKS:
                    moved = PICKS[name](picked, outs[0]) + (picked.numel() * outs[0].element_size() if accumulate else 0)
                if name == "slice_backward":  # the fill writes the whole, the copy reads and writes the slice
                    moved += nbytes[0]
                if name == "native_layer_norm_backward":  # the weight and bias kernel reads both again
                    moved += nbytes[0] + nbytes[1]
                if name == "copy_":  # into a slice: the destination is written, not read
                    moved -= nbytes[0]
            if all(tuple(t.shape) in weights for t in ins + outs):
                self.weight_kernels += 1
                self.weight_bytes += sum(t.numel() * t.element_size() for t in ins + outs)
                self.ops.append((name + " (weight)", moved))
                return out
            self.kernels += KERNELS_PER_OP.get(name, 1)
            self.bytes += moved
            self.ops.append((name, moved))
            return out

    return Kernels


def _model_kernels(spec, framework: str, *, b: int, s: int) -> tuple[tuple[int, float], tuple[int, float]]:
    work = layer_work(spec, FRAMEWORKS[framework], b=b, s=s, tp=1, cp=1, sp=False)
    pick = lambda ks: [k for k in ks if k.kind == "mem"]  # noqa: E731
    return tuple((sum(k.launches for k in pick(ks)), sum(k.bytes for k in pick(ks)))  # type: ignore[return-value]
                 for ks in (work.fwd, work.bwd))


HF_SPECS = {
    "llama-gqa": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=160),
    "qwen2-bias": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=352,
                       attention_bias=True),  # q, k and v biases (Qwen2's; HF's Llama would add one to o_proj)
    "qwen3-qk-norm": dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=160,
                          head_dim=8, qk_norm="head"),  # Qwen3's RMSNorm of each head of q and k
}
GPT2_SPEC = dict(hidden_size=64, num_attention_heads=8, intermediate_size=256)


def test_hf_gpt2_layers_launch_the_kernels_rlhf_engine_hf_prices():
    """`rlhf-engine-hf` against `transformers`' own GPT-2 block on bf16 weights, as its configs set
    it (gelu_new) and RLHF trains it (no dropout): every memory-bound kernel of its forward and
    backward by number and bytes (native LayerNorm, the residual adds, gelu_new written out in
    eager ops, each bias's gradient summed over tokens, and the fused c_attn's q, k and v gradients
    concatenated back)."""
    from transformers import GPT2Config, GPT2Model

    h, heads, f = GPT2_SPEC["hidden_size"], GPT2_SPEC["num_attention_heads"], GPT2_SPEC["intermediate_size"]
    cfg = GPT2Config(n_embd=h, n_layer=1, n_head=heads, n_inner=f, vocab_size=256, bos_token_id=0, eos_token_id=0,
                     n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     activation_function="gelu_new", attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = GPT2Model(cfg).to(torch.bfloat16).train()
    b, s = 2, 24
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    record = _recorder(b * s)
    with record() as fwd:
        y = model.h[0](x)
    y = y[0] if isinstance(y, tuple) else y
    grad = torch.randn_like(y)
    with record() as bwd:
        y.backward(grad)
    spec = resolve_model({"model_type": "gpt", **GPT2_SPEC, "num_hidden_layers": 1, "vocab_size": 256,
                          "max_position_embeddings": 128})
    assert ((fwd.kernels, fwd.bytes), (bwd.kernels, bwd.bytes)) == _model_kernels(spec, "rlhf-engine-hf", b=b, s=s), \
        (fwd.ops, bwd.ops)
    fused_fwd, _ = _model_kernels(spec, "rlhf-engine", b=b, s=s)
    assert fused_fwd[0] == 5 and fwd.kernels == 12  # gelu_new is eight kernels where a fused GELU is one


@pytest.mark.parametrize("name", sorted(HF_SPECS))
def test_hf_llama_layers_launch_the_kernels_rlhf_engine_hf_prices(name):
    """`rlhf-engine-hf` (OpenRLHF, verl's FSDP workers) against `transformers`' own Llama, Qwen2 and
    Qwen3 decoder layers on bf16 weights: every memory-bound kernel of its forward and backward, by
    number and bytes (its eager RMSNorm and rotary, Qwen3's RMSNorm of each head of q and k, SwiGLU's
    silu and product, the residual adds, the sums of the separate projections' input gradients, the
    biases' gradients and the copy of q's and k's gradients back to the
    projections' layout). CPU's SDPA stands in for FlashAttention-2 and is left out with the GEMMs."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    fields = dict(HF_SPECS[name])
    config, model_class = (Qwen2Config, Qwen2ForCausalLM) if fields.pop("attention_bias", False) else \
        (Qwen3Config, Qwen3ForCausalLM) if fields.pop("qk_norm", None) else (LlamaConfig, LlamaForCausalLM)
    cfg = config(**fields, num_hidden_layers=1, vocab_size=256, max_position_embeddings=128,
                 attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = model_class(cfg).to(torch.bfloat16).train()
    b, s, h = 2, 24, fields["hidden_size"]
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(s)[None].expand(b, s)
    rope = model.model.rotary_emb(x, positions)  # built once per forward for every layer
    record = _recorder(b * s)
    with record() as fwd:
        y = model.model.layers[0](x, position_embeddings=rope, attention_mask=None, position_ids=positions)
    y = y[0] if isinstance(y, tuple) else y
    grad = torch.randn_like(y)
    with record() as bwd:
        y.backward(grad)
    spec = resolve_model({"model_type": "llama", **HF_SPECS[name], "num_hidden_layers": 1, "vocab_size": 256,
                          "max_position_embeddings": 128})
    want_fwd, want_bwd = _model_kernels(spec, "rlhf-engine-hf", b=b, s=s)
    assert (fwd.kernels, fwd.bytes) == want_fwd, fwd.ops
    assert (bwd.kernels, bwd.bytes) == want_bwd, str(bwd.ops)
    # Where the fused stacks launch a few: one norm, rotary, SwiGLU and residual kernel each way (and
    # one norm each of q and k).
    fused_fwd, fused_bwd = _model_kernels(spec, "rlhf-engine", b=b, s=s)
    assert (fused_fwd[0], fused_bwd[0]) == ((8, 8) if spec.qk_norm != "none" else (6, 6))
    assert fwd.bytes > 2.5 * fused_fwd[1] and bwd.bytes > 4 * fused_bwd[1]


def test_rollouts_of_an_eager_stack_run_the_rollout_engines_fused_kernels():
    """verl and OpenRLHF generate with vLLM: `rlhf-engine-hf`'s generate calls are costed with
    fused layers, its training and inference with HF's."""
    hf = FRAMEWORKS["rlhf-engine-hf"]
    rollout = hf.for_rollouts()
    spec = resolve_model("llama-3-8b")
    assert layer_work(spec, rollout, b=4, s=1, tp=1, cp=1, sp=False, kv_len=512) == \
        layer_work(spec, FRAMEWORKS["rlhf-engine"].for_rollouts(), b=4, s=1, tp=1, cp=1, sp=False, kv_len=512)
    assert rollout.layer_activations == "hf" and rollout.expert_gemms == "grouped"  # what else it keeps
    assert layer_work(spec, hf, b=4, s=1, tp=1, cp=1, sp=False, kv_len=512) != \
        layer_work(spec, rollout, b=4, s=1, tp=1, cp=1, sp=False, kv_len=512)


# Mixture-of-experts layers: 6 experts of width 40, top 2, hidden 48; 2 sequences of 15 tokens.
MOE_E, MOE_K, MOE_H, MOE_F = 6, 2, 48, 40
MOE_B, MOE_S = 2, 15

# transformers' mixture-of-experts families, as `planner` reads their configs: (config class, model
# class, config fields); every one with 6 experts of width 40, top 2, 4 heads and 4 key heads.
HF_MOE = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(model_type="mixtral", num_local_experts=MOE_E,
                                                            intermediate_size=MOE_F)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(model_type="qwen2_moe", num_experts=MOE_E,
                  moe_intermediate_size=MOE_F, shared_expert_intermediate_size=56, norm_topk_prob=True,
                  intermediate_size=112)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(model_type="qwen3_moe", num_experts=MOE_E,
                  moe_intermediate_size=MOE_F, norm_topk_prob=True, head_dim=12, intermediate_size=112)),
    "qwen3_moe-unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        model_type="qwen3_moe", num_experts=MOE_E, moe_intermediate_size=MOE_F, norm_topk_prob=False, head_dim=12,
        intermediate_size=112)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(model_type="olmoe", num_experts=MOE_E, intermediate_size=MOE_F,
                                                      norm_topk_prob=False)),
}


@pytest.mark.parametrize("name", sorted(HF_MOE))
def test_hf_moe_layers_launch_the_kernels_rlhf_engine_hf_prices(name):
    """`rlhf-engine-hf` against `transformers`' own sparse decoder layers (Mixtral, Qwen2-MoE with
    its gated shared expert, Qwen3-MoE with and without renormalised top-k, OLMoE with its norms of
    the whole q and k projections) on bf16 weights, with transformers' default experts
    implementation (``grouped_mm``: every expert's gate and up projections one grouped GEMM, the
    downs another): every memory-bound kernel forward and backward by number and bytes (the
    router's softmax and top-k, the sort of the copies by expert, the gathers, index_puts and
    per-expert counts, SwiGLU, the weighted copies summed per token, Mixtral's in fp32). The
    spec comes from the config as `planner` reads it (`spec_from_hf_config`). Every expert gets
    the same number of copies (the load the model is given): the router picks experts i and i + 1
    for token i."""
    import transformers

    from cost_models.ops import ExpertLoad
    from plans.model import spec_from_hf_config

    config_class, model_class, fields = HF_MOE[name]
    common = dict(hidden_size=MOE_H, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1,
                  vocab_size=256, max_position_embeddings=128, num_experts_per_tok=MOE_K)
    hf_fields = {k: v for k, v in fields.items() if k != "model_type"}
    cfg = getattr(transformers, config_class)(**common, **hf_fields, attn_implementation="sdpa", use_cache=False,
                                              bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg).to(torch.bfloat16).train()
    assert model.config._experts_implementation == "grouped_mm"  # transformers' default
    layer = model.model.layers[0]
    b, s, h = MOE_B, MOE_S, MOE_H
    t = b * s
    with torch.no_grad():
        layer.mlp.gate.weight.copy_(torch.eye(MOE_E, h))
    x = 0.01 * torch.randn(t, h)
    for i in range(t):
        x[i, i % MOE_E], x[i, (i + 1) % MOE_E] = 10.0, 5.0
    x = x.to(torch.bfloat16).view(b, s, h)
    with torch.no_grad():  # the router sees the norm of x: set its weights so that the picks hold
        layer.post_attention_layernorm.weight.fill_(1.0)
        layer.self_attn.o_proj.weight.zero_()
    x.requires_grad_(True)
    positions = torch.arange(s)[None].expand(b, s)
    rope = model.model.rotary_emb(x, positions)
    record = _recorder(t)
    with record() as fwd:
        y = layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
    y = y[0] if isinstance(y, tuple) else y
    picks = layer.mlp.gate(layer.post_attention_layernorm(x.detach()).view(t, h))[2]
    assert torch.bincount(picks.flatten(), minlength=MOE_E).tolist() == [t * MOE_K // MOE_E] * MOE_E
    grad = torch.randn_like(y)
    with record() as bwd:
        y.backward(grad)
    spec = spec_from_hf_config({**common, **fields}, source=name)
    assert spec.hf_model_type == fields["model_type"]
    moe = ExpertLoad(routed=t, active=MOE_E, rows=t * MOE_K // MOE_E, width=MOE_F, skew=1.0, a2a_bytes=0.0)
    work = layer_work(spec, FRAMEWORKS["rlhf-engine-hf"], b=b, s=s, tp=1, cp=1, sp=False, moe=moe)
    pick = lambda ks: [q for q in ks if q.kind == "mem"]  # noqa: E731
    want_fwd, want_bwd = ((sum(q.launches for q in pick(ks)), sum(q.bytes for q in pick(ks))) for ks in (work.fwd, work.bwd))
    assert (fwd.kernels, fwd.bytes) == want_fwd, fwd.ops
    assert (bwd.kernels, bwd.bytes) == want_bwd, bwd.ops
    # Two grouped GEMMs each way for the experts, where Megatron-core's per-expert GEMMs launch one per expert.
    gemms = [q for q in work.fwd if q.kind == "gemm" and q.batch == MOE_E]
    assert [q.launches for q in gemms] == [1, 1]


RUNTIME_SPECS = {
    "llama-gqa": {"model_type": "llama", **HF_SPECS["llama-gqa"]},
    "qwen3-qk-norm": {"model_type": "llama", **HF_SPECS["qwen3-qk-norm"]},
    "olmoe-qk-norm": {"model_type": "llama", **HF_SPECS["llama-gqa"], "qk_norm": "proj"},
    "gpt": dict(model_type="gpt", hidden_size=64, num_attention_heads=8, intermediate_size=256),
}


@pytest.mark.parametrize("name", sorted(RUNTIME_SPECS))
def test_the_runtime_layers_launch_the_kernels_the_torch_preset_prices(name):
    """`torch` (the planner's runtime) against `runtime/model.py`'s own layer (Llama; GPT with its
    LayerNorm, biases and GELU) under bf16 autocast on fp32 weights, as it trains on a GPU: every
    memory-bound kernel forward (the weights' and biases' casts included) and backward by number and
    bytes; the gradient accumulation of the backward (each cast weight's gradient cast back to fp32,
    and every gradient added into the runtime's buffer) against the model's accumulation kernel."""
    from plans import Layout
    from runtime.engine import ModelRunner
    from runtime.groups import solo_groups
    from runtime.model import Rope, _layer, init_tensor

    spec = resolve_model({**RUNTIME_SPECS[name], "num_hidden_layers": 1, "vocab_size": 256,
                          "max_position_embeddings": 128})
    runner = ModelRunner(spec, head="lm", trainable=True, groups=solo_groups(Layout()),
                         state=lambda p: init_tensor(p, seed=0), device=torch.device("cpu"))
    weights = {tuple(p.shape) for p in runner.shard.params.values()}
    b, s = 2, 24
    x = torch.randn(b, s, spec.hidden_size, requires_grad=True)
    positions = torch.arange(s)
    record = _recorder(b * s, weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rope = Rope(spec, positions) if spec.model_type == "llama" else None
        if rope is not None:  # the tables are built once per forward for every layer
            rope(torch.bfloat16)
            rope(torch.float32)  # q and k leave the runtime's q and k norms in fp32
        with record() as fwd:
            y = _layer(runner.shard, 0, x, positions, None, False, None, rope)
    grad = torch.randn_like(y)
    with record() as bwd:
        y.backward(grad)
    want_fwd, want_bwd = _model_kernels(spec, "torch", b=b, s=s)
    assert (fwd.kernels + fwd.weight_kernels, fwd.bytes + fwd.weight_bytes) == want_fwd, str(fwd.ops)
    assert (bwd.kernels, bwd.bytes) == want_bwd, str(bwd.ops)
    work = layer_work(spec, FRAMEWORKS["torch"], b=b, s=s, tp=1, cp=1, sp=False)
    assert bwd.weight_kernels == work.grad_tensors, str(bwd.ops)
    # Weights used in fp32 (the norms', q's and k's norms', a GPT's output and down biases) are added
    # without a cast, which the model charges them too (6 bytes each, of 18).
    qk_norms = {"none": 0, "head": 2, "proj": spec.num_attention_heads + spec.kv_heads}[spec.qk_norm] * spec.d_head
    fp32_only = 2 * spec.hidden_size * (3 if spec.model_type == "gpt" else 1) + qk_norms
    assert work.grad_accum.bytes - bwd.weight_bytes == 6 * fp32_only


COLLECTIVES: list[list] = []  # [kind, bytes] of each collective a rank ran, in order


def _model_comm(comms) -> list[list]:  # noqa: ANN001
    """The cost model's collectives as `COLLECTIVES` logs them, sorted (lists, as JSON reads them)."""
    return sorted([c.op, int(c.bytes)] for c in comms)


def _backend_collectives_unrecorded() -> None:
    """A collective's own work is the backend's, not a kernel the runtime launches: gloo copies the
    reduced block into the output tensor on the host (NCCL writes it there), so the runtime's
    all-gather and reduce-scatter calls run unrecorded in these ranks. Each collective is logged
    instead in `COLLECTIVES`, with its bytes as the cost model counts them: an all-gather's
    gathered output, a reduce-scatter's input, an all-reduce's tensor."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    import runtime.tensor_parallel as tpx

    def unrecorded(fn, kind: str, which: int):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            COLLECTIVES.append([kind, args[which].numel() * args[which].element_size()])
            with _disable_current_modes():
                return fn(*args, **kwargs)
        return call

    tpx.all_gather_into = unrecorded(tpx.all_gather_into, "all_gather", 0)
    tpx.reduce_scatter_into = unrecorded(tpx.reduce_scatter_into, "reduce_scatter", 1)
    dist.all_reduce = unrecorded(dist.all_reduce, "all_reduce", 0)
    dist.all_to_all_single = unrecorded(dist.all_to_all_single, "all_to_all", 1)


def _layer_inventory(runner, x, positions, sp: bool, record) -> dict[str, tuple[int, int, int, int]]:  # noqa: ANN001
    """(kernels, bytes, weight kernels, weight bytes) of the runner's first layer, forward and
    backward, under bf16 autocast as the runtime trains (the rotary tables built beforehand, once
    per forward for every layer), and the bytes autograd keeps for its backward (``saved``: every
    saved tensor's storage, the input and the weights' casts included, the weights and the rotary
    tables, which every layer shares, left out)."""
    from runtime.model import Rope, _layer
    from tests.test_cost_memory import _saved_storage_bytes

    spec = runner.shard.spec
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rope = Rope(spec, positions) if spec.model_type == "llama" else None
        if rope is not None:
            rope(torch.bfloat16)
            rope(torch.float32)  # for q and k in fp32 after their norms
        COLLECTIVES.clear()
        out = []
        with record() as fwd:
            tables = [t for pair in (rope._by_dtype.values() if rope is not None else ()) for t in pair]
            saved = _saved_storage_bytes([*runner.shard.params.values(), *tables],  # every layer's rotary tables
                                         lambda: out.append(_layer(runner.shard, 0, x, positions, None, sp, None, rope)))
        y = out[0]
    fwd_comm = sorted(COLLECTIVES)
    grad = torch.randn_like(y)
    COLLECTIVES.clear()
    with record() as bwd:
        y.backward(grad)
    return {"fwd": (fwd.kernels, fwd.bytes, fwd.weight_kernels, fwd.weight_bytes),
            "bwd": (bwd.kernels, bwd.bytes, bwd.weight_kernels, bwd.weight_bytes),
            "fwd_comm": fwd_comm, "bwd_comm": sorted(COLLECTIVES), "saved": saved}


def _dense_tp_worker(rank: int, port: int, out_dir: str) -> None:
    """Each runtime layer of `RUNTIME_SPECS` on two gloo ranks at tp 2, with and without sequence
    parallel: (kernels, bytes, weight kernels, weight bytes) forward and backward."""
    import json

    import torch.distributed as dist

    from plans import Layout, Mesh
    from runtime.engine import ModelRunner
    from runtime.groups import Groups
    from runtime.model import init_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _backend_collectives_unrecorded()
    out = {}
    try:
        for sp in (False, True):
            groups = Groups(distributed=True).build(Mesh.block(0, 2), Layout(tp=2, sequence_parallel=sp), rank=rank,
                                                    tied=False)
            for name in sorted(RUNTIME_SPECS):
                spec = resolve_model({**RUNTIME_SPECS[name], "num_hidden_layers": 1, "vocab_size": 256,
                                      "max_position_embeddings": 128})
                runner = ModelRunner(spec, head="lm", trainable=True, groups=groups,
                                     state=lambda p: init_tensor(p, seed=0), device=torch.device("cpu"))
                s_loc = TP_S // 2 if sp else TP_S
                x = torch.randn(TP_B, s_loc, spec.hidden_size, requires_grad=True)
                positions = torch.arange(TP_S)
                # A value per token of the whole sequence moves nothing that counts (OLMoE's q and k
                # norm statistics, made after the gather along the sequence).
                record = _recorder(TP_B * TP_S, {tuple(p.shape) for p in runner.shard.params.values()})
                out[f"{name} sp={sp}"] = _layer_inventory(runner, x, positions, sp, record)
        with open(f"{out_dir}/rank{rank}.json", "w") as fh:
            json.dump(out, fh)
    finally:
        dist.destroy_process_group()


TP_B, TP_S = 2, 24


def test_the_runtime_layers_at_tp2_launch_the_kernels_the_torch_preset_prices(tmp_path):
    """`torch` against the runtime's layers on two gloo ranks at tp 2 (`runtime/tensor_parallel.py`):
    besides each rank's share of the layer's kernels, under sequence parallel every all-gather and
    reduce-scatter along the sequence copies its input and its output (a transpose made
    contiguous), and without it the backward all-reduce of each block's input gradient clones it
    first (`Framework.tp_copies`); by number and bytes, forward and backward, weights apart; and
    what autograd keeps for backward (`memory.eager_layer_saved_bytes` at tp 2)."""
    import json

    import torch.multiprocessing as mp

    from cost_models.memory import eager_layer_saved_bytes
    from cost_models.ops import layer_cast_params
    from tests.test_runtime_parallel import _free_port

    mp.spawn(_dense_tp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    pick = lambda ks: [q for q in ks if q.kind == "mem"]  # noqa: E731
    for case, got in ranks[0].items():
        name, sp = case.split(" sp=")
        spec = resolve_model({**RUNTIME_SPECS[name], "num_hidden_layers": 1, "vocab_size": 256,
                              "max_position_embeddings": 128})
        work = layer_work(spec, FRAMEWORKS["torch"], b=TP_B, s=TP_S, tp=2, cp=1, sp=sp == "True")
        want_fwd, want_bwd = ((sum(q.launches for q in pick(ks)), sum(q.bytes for q in pick(ks)))
                              for ks in (work.fwd, work.bwd))
        fk, fb, fwk, fwb = got["fwd"]
        bk, bb, bwk, _ = got["bwd"]
        assert (fk + fwk, fb + fwb) == want_fwd, case
        assert (bk, bb) == want_bwd, case
        assert bwk == work.grad_tensors, case
        # What autograd keeps on a rank, byte for byte: the layer's activations as the memory model
        # counts them at tp 2 (the norms' regions a chunk of the sequence under sequence parallel) and
        # the rank's weights' casts.
        kept = eager_layer_saved_bytes(spec, b=TP_B, s=TP_S, tp=2, sp=sp == "True", recompute="none", compute_bytes=2)
        assert got["saved"] == kept + 2 * layer_cast_params(spec, sparse=False, tp=2), case
        # Every collective by kind and bytes: the blocks' inputs go in the stream's fp32, their outputs
        # in bf16 (and OLMoE's sums of squares, a value per token).
        assert got["fwd_comm"] == _model_comm(work.fwd_comm), case
        assert got["bwd_comm"] == _model_comm(work.bwd_comm), case
        untouched = dataclasses.replace(FRAMEWORKS["torch"], tp_copies=False)
        bare = layer_work(spec, untouched, b=TP_B, s=TP_S, tp=2, cp=1, sp=sp == "True")
        copies = (8, 8) if sp == "True" else (0, 2)  # per layer: two blocks, each way
        if spec.qk_norm == "proj":  # and the gradients of q's and k's sums of squares for their all-reduce
            copies = (copies[0], copies[1] + 1)
        assert (len(pick(work.fwd)) - len(pick(bare.fwd)), len(pick(work.bwd)) - len(pick(bare.bwd))) == copies, case


MOE_SPECS = {
    "routed": {},
    "shared-gated": dict(shared_expert_intermediate_size=56, shared_expert_gate=True),  # Qwen2-MoE's
}
# Under sequence parallel over tp 2: 3 sequences of 36 positions, 18 on each rank (54 tokens a rank, 108
# in all, 36 copies per expert). The spec has four key heads, so each rank keeps two: with one, the
# eager layers skip the copy of k's gradient back to its projection's layout (a transposed size-1 dim
# is already contiguous), which the model charges (4 bytes per key element and layer).
MOE_B_SP, MOE_S_SP = 3, 18


def _moe_spec(name: str):
    return resolve_model(dict(model_type="llama", hidden_size=MOE_H, num_attention_heads=4, num_key_value_heads=4,
                              intermediate_size=112, num_experts=MOE_E, num_experts_per_tok=MOE_K,
                              moe_intermediate_size=MOE_F, num_hidden_layers=1, vocab_size=256,
                              max_position_embeddings=128, **MOE_SPECS[name]))


def _moe_inventory(name: str, groups, b: int = MOE_B, s: int = MOE_S) -> dict[str, tuple[int, int, int, int]]:  # noqa: ANN001
    """(kernels, bytes, weight kernels, weight bytes) of the runtime's MoE layer forward and backward
    on this rank, `b` sequences of `s` positions (its chunk under sequence parallel), every expert
    receiving the same number of copies (token i picks experts i and i+1 mod E, on every rank)."""
    from runtime.engine import ModelRunner
    from runtime.model import init_tensor

    spec = _moe_spec(name)
    runner = ModelRunner(spec, head="lm", trainable=True, groups=groups, state=lambda p: init_tensor(p, seed=0),
                         device=torch.device("cpu"))
    params = runner.shard.params
    t, h = b * s, MOE_H
    with torch.no_grad():
        params["model.layers.0.self_attn.o_proj.weight"].zero_()
        params["model.layers.0.mlp.gate.weight"].copy_(torch.eye(MOE_E, h))
    x = 0.01 * torch.randn(t, h, generator=torch.Generator().manual_seed(groups.local))
    for i in range(t):
        x[i, i % MOE_E], x[i, (i + 1) % MOE_E] = 10.0, 5.0
    x = x.view(b, s, h).requires_grad_(True)
    f_loc = MOE_F // groups.layout.tp
    weights = {tuple(p.shape) for p in params.values()} | {(f_loc, h), (h, f_loc)}  # an expert's, once unbound
    sp = groups.layout.sequence_parallel
    return _layer_inventory(runner, x, torch.arange(s * (groups.layout.tp if sp else 1)), sp, _recorder(t, weights))


MOE_LAYOUTS = {"ep": dict(dp=2, ep=2), "tp-sp": dict(tp=2, etp=2, sequence_parallel=True)}


def _moe_worker(rank: int, port: int, out_dir: str, layout: str, name: str) -> None:
    import json

    import torch.distributed as dist

    from plans import Layout, Mesh
    from runtime.groups import Groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _backend_collectives_unrecorded()
    try:
        groups = Groups(distributed=True).build(Mesh.block(0, 2), Layout(**MOE_LAYOUTS[layout]), rank=rank, tied=False)
        with open(f"{out_dir}/rank{rank}.json", "w") as fh:
            json.dump(_moe_inventory(name, groups, *((MOE_B_SP, MOE_S_SP) if layout == "tp-sp" else (MOE_B, MOE_S))),
                      fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,layout", [("routed", None), ("shared-gated", None), ("routed", "ep"),
                                         ("routed", "tp-sp"), ("shared-gated", "tp-sp")])
def test_the_runtime_moe_layer_launches_the_kernels_the_torch_preset_prices(name, layout, tmp_path):
    """`torch` against the runtime's mixture-of-experts layer (`runtime/model._sparse_mlp` and
    `_experts`: routing in PyTorch ops, a Python loop over the experts; with ep 2 on two gloo
    ranks, the copies exchanged by all-to-all; with tp 2 and sequence parallel, each expert split
    over the two ranks, the router on each rank's chunk of the sequence and its weights, ids and
    tokens gathered) under bf16 autocast on fp32 weights: every memory-bound kernel forward and
    backward by number and bytes, and the weights' casts, their gradients' casts back, the stacking
    of the experts' gradients and their accumulation; on two ranks also every collective by kind
    and bytes. The router is set so that every expert
    receives the same number of copies, the load the model is given; the attention's output
    projection is zeroed so the MLP sees those tokens (its kernels run all the same). Dimensions
    are distinct so no activation has a weight's shape."""
    import json

    from cost_models.memory import eager_layer_saved_bytes
    from cost_models.ops import ExpertLoad, layer_cast_params
    from plans import Layout
    from runtime.groups import solo_groups

    if layout is None:
        got = _moe_inventory(name, solo_groups(Layout()))
    else:
        import torch.multiprocessing as mp

        from tests.test_runtime_parallel import _free_port

        mp.spawn(_moe_worker, args=(_free_port(), str(tmp_path), layout, name), nprocs=2, join=True)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert ranks[0] == ranks[1]  # the same load on both
        got = {k: tuple(v) if isinstance(v, list) else v for k, v in ranks[0].items()}
    ep, tp = (2, 1) if layout == "ep" else (1, 2) if layout == "tp-sp" else (1, 1)
    b, s = (MOE_B_SP, MOE_S_SP * tp) if layout == "tp-sp" else (MOE_B, MOE_S)
    t, k, e = b * s, MOE_K, MOE_E
    spec = _moe_spec(name)
    # Each rank routes t tokens (its replica's), t k / E copies to every expert from every rank.
    moe = ExpertLoad(routed=t, active=e // ep, rows=ep * t * k // e, width=MOE_F // tp, skew=1.0,
                     a2a_bytes=0.0 if ep == 1 else 2.0 * t * MOE_H * k, ep=ep)
    work = layer_work(spec, FRAMEWORKS["torch"], b=b, s=s, tp=tp, cp=1, sp=tp > 1, moe=moe)
    pick = lambda ks: [q for q in ks if q.kind == "mem"]  # noqa: E731
    want_fwd, want_bwd = ((sum(q.launches for q in pick(ks)), sum(q.bytes for q in pick(ks))) for ks in (work.fwd, work.bwd))
    fk, fb, fwk, fwb = got["fwd"]
    bk, bb, bwk, bwb = got["bwd"]
    assert (fk + fwk, fb + fwb) == want_fwd
    assert (bk, bb) == want_bwd
    assert bwk == work.grad_tensors
    assert work.grad_accum.bytes - bwb == 6 * 2 * MOE_H  # the norms' fp32 weights, never cast
    # What autograd keeps: the layer's activations as the memory model counts them (under expert
    # parallelism with the exchange's orders, under sequence parallelism the router on the rank's
    # chunk), and the weights' casts.
    kept = eager_layer_saved_bytes(spec, b=b, s=s, tp=tp, sp=tp > 1, recompute="none", compute_bytes=2, moe=moe)
    assert got["saved"] == kept + 2 * layer_cast_params(spec, sparse=True, tp=tp, ep=ep, etp=tp)
    if layout is not None:  # every collective by kind and bytes (the token copies leave in fp32, return in bf16)
        assert list(got["fwd_comm"]) == _model_comm(work.fwd_comm)
        assert list(got["bwd_comm"]) == _model_comm(work.bwd_comm)
    # The fused routing (Megatron-core's) launches a small fraction of that.
    fused = layer_work(spec, FRAMEWORKS["megatron-core"], b=b, s=s, tp=tp, cp=1, sp=tp > 1, moe=moe)
    assert sum(q.launches for q in pick(fused.fwd)) < want_fwd[0] / 4


ENDS_B, ENDS_S = 3, 24  # 72 tokens, more than the hidden size: a value head's [1, h] weight is per-token-sized
# (model, head, tied, logits per chunk, vocabulary): with 256 rows, more than the 72 tokens, backward
# goes a slice of the vocabulary at a time (4,608 logits: 64 rows of every token, four slices); with 48
# rows, fewer than the tokens, a run of tokens at a time (1,152 logits: 24 tokens, three runs).
ENDS_CASES = [(name, "lm", tied, chunk, 256) for name in sorted(RUNTIME_SPECS) for tied in (False, True)
              for chunk in (None, 4608)] + [(name, "lm", False, 1152, 48) for name in sorted(RUNTIME_SPECS)] + \
    [(name, "value", False, None, 256) for name in sorted(RUNTIME_SPECS)]


def _ends_spec(name: str, tied: bool = False, vocab: int = 256):
    return resolve_model({**RUNTIME_SPECS[name], "num_hidden_layers": 1, "vocab_size": vocab,
                          "max_position_embeddings": 128, "tie_word_embeddings": tied})


def _ends_inventory(spec, head: str, groups, b: int, s: int) -> dict[str, tuple[int, int]]:  # noqa: ANN001
    """(kernels, bytes) forward and backward of the runtime's ends on this rank, weights' ops
    included: `stage_forward`'s embedding and `token_logprobs` or `token_values`, under bf16
    autocast on fp32 weights, with every parameter's gradient a view of a buffer as in training
    (so each is added there)."""
    import dataclasses as dc

    from runtime.engine import ModelRunner
    from runtime.model import init_tensor, stage_forward, token_logprobs, token_values

    runner = ModelRunner(spec, head=head, trainable=True, groups=groups, state=lambda p: init_tensor(p, seed=0),
                         device=torch.device("cpu"))
    shard = dc.replace(runner.shard, layers=())  # the ends alone
    for p in shard.params.values():
        p.grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank
    tokens, positions = torch.randint(0, spec.vocab_size, (b, s), generator=g), torch.arange(s)
    # Per-token values are the whole sequence's here (the head's), also under sequence parallel.
    record = _recorder(b * s, {tuple(p.shape) for n, p in shard.params.items() if ".layers." not in n})
    comm = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        COLLECTIVES.clear()
        with record() as fwd:
            x = stage_forward(shard, tokens, positions=positions)
            comm["emb_fwd"] = sorted(COLLECTIVES)
            COLLECTIVES.clear()
            out = token_logprobs(shard, x, tokens) if head == "lm" else token_values(shard, x)
            comm["head_fwd"] = sorted(COLLECTIVES)
    grad = torch.randn(out.shape, generator=g)
    COLLECTIVES.clear()
    with record() as bwd:
        out.backward(grad)
    comm["bwd"] = sorted(COLLECTIVES)
    return {"fwd": (fwd.kernels + fwd.weight_kernels, fwd.bytes + fwd.weight_bytes),
            "bwd": (bwd.kernels + bwd.weight_kernels, bwd.bytes + bwd.weight_bytes), "comm": comm}


def _ends_model(spec, fw, head: str, *, b: int, s: int, tp: int, sp: bool) -> dict[str, tuple[int, float]]:  # noqa: ANN001
    from cost_models.ops import embedding_work, head_work

    ef, eb = embedding_work(spec, fw, b=b, s=s, tp=tp, cp=1, sp=sp)
    hf, hb = head_work(spec, fw, head=head, b=b, s=s, tp=tp, cp=1, sp=sp, loss=True)
    pick = lambda ks: [k for k in ks if k.kind == "mem"]  # noqa: E731
    return {way: (sum(k.launches for k in pick(ks)), sum(k.bytes for k in pick(ks)))
            for way, ks in (("fwd", (*ef, *hf)), ("bwd", (*eb, *hb)))}


@pytest.mark.parametrize("name,head,tied,chunk,vocab", ENDS_CASES)
def test_the_runtime_ends_launch_the_kernels_the_torch_preset_prices(name, head, tied, chunk, vocab, monkeypatch):
    """`torch` against the runtime's own ends (`runtime/model.py`: `stage_forward`'s embedding,
    `token_logprobs` or `token_values`): every memory-bound kernel forward and backward by number
    and bytes, weights' casts and gradient accumulations included, against `embedding_work` and
    `head_work`. The LM head with one chunk (its log-softmax kept for backward) and with several,
    made again in backward along the vocabulary or along the tokens (`ENDS_CASES`), tied to the
    embedding and not (the same kernels: one more add of the two gradients, one accumulation
    fewer)."""
    import dataclasses as dc

    import runtime.model as rm
    from cost_models.ops import head_work
    from plans import Layout
    from runtime.groups import solo_groups

    spec = _ends_spec(name, tied, vocab)
    fw = FRAMEWORKS["torch"]
    if chunk is not None:
        monkeypatch.setattr(rm, "LOGITS_CHUNK_ELEMENTS", chunk)
        fw = dc.replace(fw, logits_chunk_elements=chunk)
    got = _ends_inventory(spec, head, solo_groups(Layout()), ENDS_B, ENDS_S)
    assert got.pop("comm") == {"emb_fwd": [], "head_fwd": [], "bwd": []}
    assert got == _ends_model(spec, fw, head, b=ENDS_B, s=ENDS_S, tp=1, sp=False)
    if head == "lm":
        hf, hb = head_work(spec, fw, head=head, b=ENDS_B, s=ENDS_S, tp=1, cp=1, sp=False, loss=True)
        gemms = [k for k in (*hf, *hb) if k.kind == "gemm"]
        # one chunk kept: 3 GEMMs; else each chunk's forward, and each slice or run's three backward
        assert len(gemms) == {None: 3, 4608: 4 + 4 * 3, 1152: 3 + 3 * 3}[chunk]


def _ends_tp_worker(rank: int, port: int, out_dir: str) -> None:
    """The runtime's ends on two gloo ranks at tp 2, with and without sequence parallel."""
    import json

    import torch.distributed as dist

    import runtime.model as rm
    from plans import Layout, Mesh
    from runtime.groups import Groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _backend_collectives_unrecorded()
    out: dict = {}
    whole = rm.LOGITS_CHUNK_ELEMENTS
    try:
        for sp in (False, True):
            groups = Groups(distributed=True).build(Mesh.block(0, 2), Layout(tp=2, sequence_parallel=sp), rank=rank,
                                                    tied=False)
            for name in sorted(RUNTIME_SPECS):
                for head in ("lm", "value"):
                    out[f"{name} {head} sp={sp}"] = _ends_inventory(_ends_spec(name), head, groups, ENDS_B, ENDS_S)
                rm.LOGITS_CHUNK_ELEMENTS = TP_CHUNK  # 32 of the rank's 128 vocabulary rows at a time
                out[f"{name} lm sp={sp} chunk={TP_CHUNK}"] = _ends_inventory(_ends_spec(name), "lm", groups, ENDS_B,
                                                                            ENDS_S)
                rm.LOGITS_CHUNK_ELEMENTS = whole
            out["chunked gradients off by"] = _chunked_head_difference(groups)
        with open(f"{out_dir}/rank{rank}.json", "w") as fh:
            json.dump(out, fh)
    finally:
        dist.destroy_process_group()


TP_CHUNK = 2304


def _chunked_head_difference(groups) -> float:  # noqa: ANN001
    """Largest difference, in fp32, between the head's log-probs and gradients (hidden states,
    the rank's weight rows) made in one chunk and in slices of the vocabulary (`TP_CHUNK`)."""
    import runtime.model as rm
    from runtime import tensor_parallel as tpx
    from runtime.engine import ModelRunner
    from runtime.model import init_tensor

    spec = _ends_spec("llama-gqa")
    runner = ModelRunner(spec, head="lm", trainable=True, groups=groups, state=lambda p: init_tensor(p, seed=0),
                         device=torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    h = torch.randn(ENDS_B * ENDS_S, spec.hidden_size, generator=g)
    targets = torch.randint(0, spec.vocab_size, (ENDS_B * ENDS_S,), generator=g)
    weight = rm._lm_weight(runner.shard).detach()
    grad = torch.randn(ENDS_B * ENDS_S, generator=g)
    got = []
    for chunk in (rm.LOGITS_CHUNK_ELEMENTS, TP_CHUNK):
        x, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        lp = tpx.head_logprobs(x, w, targets, runner.shard.tp, vocab_size=spec.vocab_size, chunk_elements=chunk)
        lp.backward(grad)
        got.append((lp.detach(), x.grad, w.grad))
    return max(float((a - b).abs().max()) for a, b in zip(*got))


def test_the_runtime_ends_at_tp2_launch_the_kernels_the_torch_preset_prices(tmp_path):
    """The same on two gloo ranks at tp 2, with and without sequence parallel: each rank looks up
    its vocabulary block's rows (the other ids masked, their rows zeroed) and reduces them over the
    group, its head makes its block's logits, and the log-softmax is assembled from the group's
    maxima and sums; the hidden states enter the head and leave the embedding through the copies
    of `Framework.tp_copies`."""
    import json

    import torch.multiprocessing as mp

    from cost_models.ops import head_comm, lookup_comm
    from tests.test_runtime_parallel import _free_port

    mp.spawn(_ends_tp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:  # slices of the vocabulary give one chunk's values, on each rank's block
        assert rank.pop("chunked gradients off by") < 1e-5
    assert ranks[0] == ranks[1]
    for case, got in ranks[0].items():
        name, head, sp, *chunk = case.replace(" sp=", " ").replace(" chunk=", " ").split()
        fw = FRAMEWORKS["torch"] if not chunk else dataclasses.replace(FRAMEWORKS["torch"], logits_chunk_elements=TP_CHUNK)
        want = _ends_model(_ends_spec(name), fw, head, b=ENDS_B, s=ENDS_S, tp=2, sp=sp == "True")
        # Every collective by kind and bytes: the lookup's rows in the fp32 table's dtype, the hidden
        # states entering the head in the stream's fp32, a value or two per token for the log-softmax.
        ef, eb = lookup_comm(_ends_spec(name), fw, b=ENDS_B, s=ENDS_S, tp=2, cp=1, sp=sp == "True")
        hf, hb = head_comm(_ends_spec(name), fw, head=head, b=ENDS_B, s=ENDS_S, tp=2, cp=1, sp=sp == "True")
        assert got.pop("comm") == {"emb_fwd": _model_comm(ef), "head_fwd": _model_comm(hf),
                                   "bwd": _model_comm(eb + hb)}, case
        assert {k: tuple(v) for k, v in got.items()} == want, case


GEN_B, GEN_P, GEN_LEN = 3, 10, 4  # rows, prompt, tokens generated (a prefill and three decode steps)


def _generate_tp_worker(rank: int, port: int, out_dir: str) -> None:
    """Every collective of the runtime's generation at tp 2 (no sequence parallelism) under bf16
    autocast, for each model of `RUNTIME_SPECS` with two layers."""
    import json

    import torch.distributed as dist

    from plans import Layout, Mesh
    from runtime.engine import ModelRunner
    from runtime.groups import Groups
    from runtime.model import init_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _backend_collectives_unrecorded()
    out = {}
    try:
        groups = Groups(distributed=True).build(Mesh.block(0, 2), Layout(tp=2), rank=rank, tied=False)
        for name in sorted(RUNTIME_SPECS):
            spec = resolve_model({**RUNTIME_SPECS[name], "num_hidden_layers": 2, "vocab_size": 256,
                                  "max_position_embeddings": 128})
            runner = ModelRunner(spec, head="lm", trainable=False, groups=groups,
                                 state=lambda p: init_tensor(p, seed=0), device=torch.device("cpu"),
                                 dtype=torch.bfloat16)
            prompts = torch.randint(0, spec.vocab_size, (GEN_B, GEN_P), generator=torch.Generator().manual_seed(0))
            COLLECTIVES.clear()
            runner.generate(prompts, gen_len=GEN_LEN, temperature=1.0, seed=7)
            out[name] = sorted(COLLECTIVES)
        with open(f"{out_dir}/rank{rank}.json", "w") as fh:
            json.dump(out, fh)
    finally:
        dist.destroy_process_group()


def test_the_runtime_generation_at_tp2_runs_the_collectives_the_torch_preset_prices(tmp_path):
    """The runtime's generation on two gloo ranks at tp 2: every collective of the prefill and of
    each decode step, by kind and bytes, against what `cost_models.generation` prices (a layer's
    `fwd_comm`; the lookup's rows reduced in the fp32 table, `lookup_comm`; each row's next token
    chosen over the vocabulary blocks and its log-probability, `sample_comm`)."""
    import json

    import torch.multiprocessing as mp

    from cost_models.ops import lookup_comm, sample_comm
    from tests.test_runtime_parallel import _free_port

    mp.spawn(_generate_tp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    fw = FRAMEWORKS["torch"].for_rollouts()
    for name, got in ranks[0].items():
        spec = resolve_model({**RUNTIME_SPECS[name], "num_hidden_layers": 2, "vocab_size": 256,
                              "max_position_embeddings": 128})

        def step(spec, s: int, ctx: int) -> tuple:  # noqa: ANN001, ANN202 - one step over s new positions
            layer = layer_work(spec, fw, b=GEN_B, s=s, tp=2, cp=1, sp=False, kv_len=ctx).fwd_comm
            lookup, _ = lookup_comm(spec, fw, b=GEN_B, s=s, tp=2, cp=1, sp=False)
            return layer * spec.num_hidden_layers + lookup + sample_comm(spec, fw, rows=GEN_B, tp=2)

        want = step(spec, GEN_P, GEN_P) + sum((step(spec, 1, GEN_P + k) for k in range(1, GEN_LEN)), ())
        assert got == _model_comm(want), name
        assert len(sample_comm(spec, fw, rows=GEN_B, tp=2)) == 3
