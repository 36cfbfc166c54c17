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
a norm's weight, rotary's cos and sin, a per-token statistic), which is read from cache; an op whose
tensors hold at most one value per token moves no bytes that count (the model's 0-byte kernels)."""

from __future__ import annotations

import pytest

from cost_models.framework import FRAMEWORKS
from cost_models.ops import layer_work
from plans import resolve_model

torch = pytest.importorskip("torch")

VIEWS = {"t", "view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided",
         "alias", "permute", "detach", "_reshape_alias", "reshape", "lift_fresh"}
GEMMS = {"mm", "addmm", "bmm", "baddbmm"}
KERNELS_PER_OP = {"slice_backward": 2, "native_layer_norm_backward": 2}


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
            if name in VIEWS or name in GEMMS or "scaled_dot_product" in name:
                return out
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            big = max(t.numel() for t in ins + outs)
            moved = 0
            if big > tokens:
                nbytes = [t.numel() * t.element_size() for t in ins + outs if 2 * t.numel() >= big]
                moved = sum(nbytes)
                if name == "slice_backward":  # the fill writes the whole, the copy reads and writes the slice
                    moved += nbytes[0]
                if name == "native_layer_norm_backward":  # the weight and bias kernel reads both again
                    moved += nbytes[0] + nbytes[1]
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
}


@pytest.mark.parametrize("name", sorted(HF_SPECS))
def test_hf_llama_layers_launch_the_kernels_rlhf_engine_hf_prices(name):
    """`rlhf-engine-hf` (OpenRLHF, verl's FSDP workers) against `transformers`' own Llama decoder
    layer on bf16 weights: every memory-bound kernel of its forward and backward, by number and
    bytes (its eager RMSNorm and rotary, SwiGLU's silu and product, the residual adds, the sums of
    the separate projections' input gradients, the
    biases' gradients and the copy of q's and k's gradients back to the
    projections' layout). CPU's SDPA stands in for FlashAttention-2 and is left out with the GEMMs."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    fields = dict(HF_SPECS[name])
    config, model_class = (Qwen2Config, Qwen2ForCausalLM) if fields.pop("attention_bias", False) else \
        (LlamaConfig, LlamaForCausalLM)
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
    # Where the fused stacks launch a few: one norm, rotary, SwiGLU and residual kernel each way.
    fused_fwd, fused_bwd = _model_kernels(spec, "rlhf-engine", b=b, s=s)
    assert (fused_fwd[0], fused_bwd[0]) == (6, 6)
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


RUNTIME_SPECS = {
    "llama-gqa": {"model_type": "llama", **HF_SPECS["llama-gqa"]},
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
        if rope is not None:
            rope(torch.bfloat16)  # the tables are built once per forward for every layer
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
    # Weights used in fp32 (the norms', a GPT's output and down biases) are added without a cast,
    # which the model charges them too (6 bytes each, of 18).
    fp32_only = 2 * spec.hidden_size * (3 if spec.model_type == "gpt" else 1)
    assert work.grad_accum.bytes - bwd.weight_bytes == 6 * fp32_only
