"""Memory per GPU: model states by ZeRO stage, activations by recompute mode, KV cache, buffers.

- Model states (Rajbhandari et al. 2020, ZeRO): 2 bytes of bf16/fp16 weights, 2 of gradients and
  12 of fp32 master weights, Adam m and v per parameter; stage 1 shards the 12 over the
  data-parallel group, stage 2 also the gradients, stage 3 also the weights.
- Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation"): per layer and
  micro-batch a GPT layer keeps ``s*b*h*(34 + 5*a*s/h)`` bytes; with tensor parallelism
  ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``, with sequence parallelism ``s*b*h/t * (34 + 5*a*s/h)``;
  selective recompute drops the ``5*a*s/h`` attention term; full recompute keeps only the layer
  input, ``2*s*b*h`` (divided by t under sequence parallelism). Llama layers (SwiGLU, grouped-
  query attention, no dropout) are counted from the same list of saved tensors.
- The planner's runtime (`Framework.layer_activations` "autocast") runs each layer as PyTorch ops, and every op
  saves what its backward reads (`eager_layer_saved_bytes`, byte for byte what autograd saves in
  `runtime/model.py`, fp32 and bf16 autocast alike: `tests/test_cost_memory.py`): the residual
  stream and the norms stay fp32, each GEMM saves its own compute-dtype cast of its input, SwiGLU
  keeps four f-wide tensors. On a GPU its fp32 weights are cast to bf16 for each forward and the
  matmuls keep the casts until backward (``weight_casts``: 2 bytes per matrix weight of the stage,
  per micro-batch in flight). HF transformers' layers on bf16 weights (`layer_activations` "hf",
  what FSDP and DeepSpeed engines train) are counted the same way, byte for byte what they save.
- ZeRO-3 buffers (``buffers``): gathered layers in flight and, in training, gradients on their way
  to the reduce-scatter (`Framework.zero3_gather_layers`, `zero3_scatter_layers`). Where autograd
  keeps the gathered weights (`Framework.zero3_keeps_gathered`: the planner's runtime, without
  full recompute), ``gathered``: every layer's compute-dtype copy of its weights, per micro-batch
  in flight, held at the forward's end (with the gathers in flight, not the scatters).
- ``step``: what a ZeRO-1/2 optimizer step holds beyond the micro-batches' transients (gone by
  then) where the stack gathers the updated buffer from a copy of each rank's part
  (`Framework.zero12_step_copy`): that copy, and on CPU ranks gloo's staging of the whole buffer.
- 1F1B keeps ``pp - stage`` micro-batches in flight on a stage; the interleaved schedule keeps
  ``pp * (1 + (pp-1)/(pp*v))`` on the first stage (Korthikanti et al. 2022, section 4.2.3).
- Outside tensors, on a GPU (none of it on CPU ranks, which use gloo and malloc):
  - ``reserve``: the CUDA context (with lazy module loading about 0.5 GiB) and the cuBLAS and
    attention workspaces;
  - ``nccl``: each NCCL communicator a call's layout uses on the rank keeps per channel a
    connection's buffers, 10 MiB (Simple + LL128 + LL) and 2 MiB, measured by NCCL's allocation
    log (NVIDIA/nccl#1685), on 32 channels over NVLink; memory grows linearly with channels and a
    ring keeps two connections at any scale, trees add theirs across nodes (NVIDIA/nccl#986). A
    communicator spanning nodes has the channels its NICs give it (`comm.nccl_channels`: two per
    rank it has on each node), not the 32 of NVLink inside a node. A
    pipeline neighbour's send/recv shares one buffer per channel of the peer (NVIDIA/nccl#1450);
  - ``fragmentation``: the caching allocator's split blocks that no request fits. GMLake (Guo
    et al., ASPLOS 2024) measured 15% on average (up to 33%) over eight LLMs' training on
    A100-80GB; it falls on the tensors that come and go (activations, logits, buffers), not on
    the model states allocated once at the start.
  A per-GPU headroom (`plans.cluster.default_headroom_gib`) is kept on top of all this.
"""

from __future__ import annotations

from collections.abc import Sequence

from cost_models.comm import Group, nccl_channels
from cost_models.framework import Framework
from cost_models.galore import GaLoreLayer, saved_optimizer_bytes
from cost_models.ops import ExpertLoad
from plans.layout import Layout
from plans.model import Head, ModelSpec

GIB = 1024**3
MIB = 1024**2
RESERVE_MAX_BYTES = 1 * GIB  # CUDA context, cuBLAS and attention workspaces
RESERVE_FRACTION = 0.05  # ... bounded by this share of a small device
NCCL_CHANNEL_BYTES = 12 * MIB  # one connection's buffers per channel (10 MiB + 2 MiB)
NCCL_P2P_CHANNELS = 4  # channels of one send/recv peer
FRAGMENTATION = 0.15  # of the transient tensors' bytes (GMLake's average)
TRANSIENT = ("activations", "logits", "buffers", "gathered", "weight_casts", "step")


def sparse_mlp_saved_bytes(spec: ModelSpec, *, tokens: int, tp: int, moe: ExpertLoad) -> float:
    """What a sparse MLP keeps for backward on a rank: router probabilities (fp32), the permuted
    token copies the experts read, their gate, up and SwiGLU outputs at the busiest rank's rows,
    the copies' outputs before the weighted sum, and the shared expert's three f-wide tensors."""
    h, e, k = spec.hidden_size, spec.experts, spec.num_experts_per_tok
    copies = 2.0 * moe.routed * k * h
    cells = 2.0 * moe.rows * moe.active * moe.width
    shared = 6.0 * tokens * spec.shared_expert_intermediate_size / tp
    return 4.0 * moe.routed * e + 2 * copies + 3 * cells + shared


def hf_sparse_mlp_saved_bytes(spec: ModelSpec, *, tokens: int, tp: int, moe: ExpertLoad) -> float:
    """What transformers' sparse MLP keeps for backward on bf16 weights (`cost_models.ops.hf_sparse_mlp`,
    its ``grouped_mm`` experts), byte for byte (`tests/test_cost_memory.py`), for the `t` tokens a
    rank routes, `c = t k` copies: the router's fp32 probabilities; top-k's int64 indices; where the
    top-k is renormalised the clone of its values and their sum (fp32); the sort's permutation and
    the copies' token ids (int64, for the gathers' backward); the gathered bf16 token copies (the
    first grouped GEMM's input); the per-expert offsets (int32); the gate-and-up output (SwiGLU's
    input), the activation and the product (the second grouped GEMM's input); the experts' outputs
    and their routing weights (fp32 in Mixtral) for the weighting; the inverse permutation. A shared
    expert keeps its gate and up outputs, the activation and the product, and with its sigmoid gate
    the gate's value and the expert's output."""
    h, e, k = spec.hidden_size, spec.experts, spec.num_experts_per_tok
    t = float(moe.routed)
    c = t * k
    w = 4.0 if spec.hf_model_type == "mixtral" else 2.0
    router = 4.0 * t * e + 8.0 * c + (4.0 * c + 4.0 * t if spec.norm_topk_prob else 0.0)
    order = 3 * 8.0 * c + 4.0 * e  # the permutation, the copies' tokens, the inverse; the offsets
    experts = 2.0 * c * h + 8.0 * c * moe.width + 2.0 * c * h + w * c
    fs = spec.shared_expert_intermediate_size
    shared = 8.0 * tokens * fs / tp + ((2.0 * tokens + 2.0 * tokens * h) if spec.shared_expert_gate else 0.0)
    return router + order + experts + shared


def runtime_sparse_mlp_saved_bytes(spec: ModelSpec, *, tokens: int, tp: int, moe: ExpertLoad,
                                   compute_bytes: int, router_tokens: float | None = None) -> float:
    """What the planner's runtime's sparse MLP keeps for backward (`runtime.model._sparse_mlp`,
    `_experts`), byte for byte on one rank (`tests/test_cost_memory.py`), computing in
    `compute_bytes` (2: bf16 autocast on fp32 weights; 4: fp32), for the `t` tokens it routes, `c =
    t k` copies and the `moe.rows * moe.active` copies its experts compute: the router's fp32
    probabilities, top-k's int64 indices, where renormalised the top-k values and their sum (fp32),
    the copies' tokens and their order (int64); the token copies the experts read (fp32, or two bf16
    casts of them for the gate and up projections), each expert's gate and up outputs, activation
    and product, the experts' outputs and the copies' weights (fp32, as the stream) for the
    weighting, and the fp32 weighted copies, which ``index_add`` keeps; under expert parallelism the
    orders that sort the received copies by expert and back (int64). A shared expert keeps its
    gate and up outputs, activation and product and, under autocast, the casts of its input for its
    projections; with its sigmoid gate also the gate's value and the expert's output.

    The router (and a shared expert's gate) runs on the rank's own `router_tokens` (its chunk of
    the sequence under sequence parallelism; default `moe.routed`), whose weights and ids are then
    gathered: the gathered gate is kept beside the chunk's, and in fp32 a shared expert keeps the
    gathered input apart from the router's chunk."""
    h, e, k = spec.hidden_size, spec.experts, spec.num_experts_per_tok
    cb = float(compute_bytes)
    t = float(moe.routed)
    tr = t if router_tokens is None else float(router_tokens)
    apart = tr != t  # the router's tokens are a chunk of those the experts see
    c = t * k
    recv = float(moe.rows) * moe.active
    router = 4.0 * tr * e + 8.0 * tr * k + (4.0 * tr * k + 4.0 * tr if spec.norm_topk_prob else 0.0)
    order = 2 * 8.0 * c + 4.0 * c  # the copies' tokens and order, their weights
    experts = 4.0 * recv * h + 4.0 * cb * recv * moe.width + cb * c * h + 4.0 * c * h
    if moe.ep > 1:  # the exchange sorts the received copies by expert and back: two int64 orders
        experts += 2 * 8.0 * recv
    fs, gated = spec.shared_expert_intermediate_size, spec.shared_expert_gate
    shared = 0.0
    if fs:
        m = float(tokens)
        if cb < 4:  # the gate and up projections' casts of the gathered input, the sigmoid gate's of the chunk
            casts = 2 * 2.0 * m * h + (2.0 * tr * h if gated else 0.0)
        else:
            casts = 4.0 * m * h if apart else 0.0
        shared = 4.0 * cb * m * fs / tp + casts + ((cb * m + cb * m * h + (cb * tr if apart else 0.0)) if gated else 0.0)
    return router + order + experts + shared


def qk_norm_saved_bytes(spec: ModelSpec, *, tokens: float, tp: int, element_bytes: float) -> float:
    """What the norms of q and k keep for `tokens` tokens on a tensor-parallel rank: per element
    `element_bytes` (a fused kernel its bf16 input, 2; eager ops the fp32 input and the normalised
    value, 4 + the compute dtype's bytes) and the fp32 rsqrt of each row (a head of a token, or the
    token's whole projection)."""
    if spec.qk_norm == "none":
        return 0.0
    heads = (spec.num_attention_heads + spec.kv_heads) / tp
    rows = tokens * heads if spec.qk_norm == "head" else 2.0 * tokens
    return element_bytes * tokens * heads * spec.d_head + 4.0 * rows


def layer_activation_bytes(spec: ModelSpec, fw: Framework, *, b: int, s: int, tp: int, sp: bool,
                           recompute: str, moe: ExpertLoad | None = None, compute_bytes: int = 2) -> float:
    """Bytes one layer keeps for backward, for one micro-batch of `b` sequences of `s` tokens (a
    sparse layer's MLP as `moe` loads it), computing in a dtype of `compute_bytes` (2: bf16; 4: a
    CPU run in fp32)."""
    if fw.layer_activations != "fused":
        return eager_layer_saved_bytes(spec, b=b, s=s, tp=tp, sp=sp, recompute=recompute, moe=moe,
                                       compute_bytes=compute_bytes, style=fw.layer_activations)
    return compute_bytes / 2 * _fused_layer_saved_bytes(spec, fw, b=b, s=s, tp=tp, sp=sp, recompute=recompute, moe=moe)


def _fused_layer_saved_bytes(spec: ModelSpec, fw: Framework, *, b: int, s: int, tp: int, sp: bool,
                             recompute: str, moe: ExpertLoad | None) -> float:
    """Korthikanti et al.'s list of a layer of fused kernels, in bf16."""
    h, d, f = spec.hidden_size, spec.d_head, spec.ffn_size
    a, kv = spec.num_attention_heads, spec.kv_heads
    sbh = float(s) * b * h
    norm_div = tp if sp else 1
    if recompute == "full":
        return 2 * sbh / norm_div
    if spec.model_type == "gpt":
        # LN inputs (2+2), QKV and MLP inputs (2+2), two dropout masks (1+1): 10 sbh.
        replicated = (8 + (2 if fw.dropout else 0)) * sbh
        # Q, K, V (2 each), out-proj input (2), GELU input and down input (2 sbf each): 24 sbh at f=4h.
        split = 2 * s * b * (a * d + 2 * kv * d) + 2 * sbh + 4.0 * s * b * f
    else:
        replicated = 8 * sbh  # two norm inputs, QKV and MLP inputs
        mlp = 0.0 if moe is not None else 6.0 * s * b * f  # gate, up, down inputs
        split = 2 * s * b * (a * d + 2 * kv * d) + 2 * sbh + mlp
    if recompute == "selective" or fw.attention == "flash":
        core = 0.0 if recompute == "selective" else 4.0 * a * s * b  # flash keeps fp32 log-sum-exp only
    else:
        core = (5.0 if fw.dropout else 2.0) * a * s * s * b  # softmax out (2), mask (1), dropout out (2)
    experts = sparse_mlp_saved_bytes(spec, tokens=s * b, tp=tp, moe=moe) if moe is not None else 0.0
    qk_norms = qk_norm_saved_bytes(spec, tokens=float(s) * b, tp=tp, element_bytes=2.0)
    return replicated / norm_div + (split + core) / tp + experts + qk_norms


def eager_layer_saved_bytes(spec: ModelSpec, *, b: int, s: int, tp: int, sp: bool, recompute: str,
                            moe: ExpertLoad | None = None, compute_bytes: int = 2, style: str = "autocast") -> float:
    """Bytes autograd keeps for one layer of eager PyTorch ops, for one micro-batch of `b`
    sequences of `s` tokens on one tensor-parallel rank: the planner's runtime (`runtime/model.py`,
    `style` "autocast"), computing in `compute_bytes` (2: bf16 under autocast, fp32 weights; 4:
    fp32 throughout), or HF transformers' Llama layers (with attention biases or without) on bf16
    weights (`style` "hf", as FSDP and DeepSpeed engines train them).

    - Each norm (on the rank's s/t tokens under sequence parallelism): its fp32 input and, for
      RMSNorm, its fp32 normalised value and the per-token rsqrt (LayerNorm: mean and rstd); HF's
      RMSNorm keeps the normalised value cast back to bf16 and the output its weight scales.
    - Its output feeds GEMMs: in fp32 all of them save that one tensor; under autocast each casts
      it to bf16 for itself and saves the cast (q, k and v: three; gate and up: two; GELU's up: one),
      on the gathered tokens under sequence parallelism; HF's GEMMs share the norm's bf16 output.
    - Attention: q and k after rotary embedding, v, the output (which the output projection reads
      as a view) and the fp32 log-sum-exp of each query row; selective recompute drops the last.
    - The MLP: SwiGLU's gate, up, activation and product; GELU's input and output (HF GPT-2's
      gelu_new, written out in eager ops, also its half input, its tanh and one plus the tanh).
    - The norms of q and k, where the model has them: their fp32 input, the normalised value in the
      compute dtype and each row's rsqrt (`qk_norm_saved_bytes`).
    - Full recompute keeps the layer's input only (fp32 in the runtime; HF's gradient
      checkpointing, bf16).

    The weights' casts are not here (`weight_casts` in `CostModel`). A sparse layer's experts keep
    `hf_sparse_mlp_saved_bytes` in HF's layers, `runtime_sparse_mlp_saved_bytes` in the runtime's,
    and its router one cast of the input.
    """
    h, d, f = spec.hidden_size, spec.d_head, spec.ffn_size
    a, kv = spec.num_attention_heads, spec.kv_heads
    hf = style == "hf"
    c = 2 if hf else compute_bytes
    m = float(s) * b
    mn = m / tp if sp else m  # tokens of the norm region
    if recompute == "full":
        return (2 if hf else 4) * mn * h
    gpt = spec.model_type == "gpt"
    if hf:  # two norms, each with the bf16 output every GEMM of its block reads
        norms = 2 * (_hf_norm_bytes(spec, mn) + 2 * m * h)
    else:
        # The inputs the GEMMs keep (casts under autocast, the norms' fp32 outputs in fp32): q, k and v's
        # and the MLP's up (and gate), or the router's, which reads the rank's own chunk of tokens.
        mlp_in = mn if moe is not None else m
        if c < 4:
            norms = 2 * _runtime_norm_bytes(spec, mn) + (3 * m + (1 if moe is not None or gpt else 2) * mlp_in) * c * h
        else:
            norms = 2 * _runtime_norm_bytes(spec, mn) + 4 * (m + mlp_in) * h
    # The runtime's q and k leave their norms in fp32 (`runtime.model._rms`): selective recompute's
    # checkpoint keeps them so, where attention keeps its own casts of them.
    qk_bytes = 4 if not hf and spec.qk_norm != "none" and recompute == "selective" else c
    attn = qk_bytes * m * (a + kv) * d / tp + c * m * kv * d / tp + c * m * a * d / tp
    attn += qk_norm_saved_bytes(spec, tokens=m, tp=tp, element_bytes=4 + c)
    if recompute != "selective":
        attn += 4 * m * a / tp
    if moe is not None and hf:
        mlp = hf_sparse_mlp_saved_bytes(spec, tokens=int(m), tp=tp, moe=moe)
    elif moe is not None:
        mlp = runtime_sparse_mlp_saved_bytes(spec, tokens=int(m), tp=tp, moe=moe, compute_bytes=c,
                                             router_tokens=mn if sp and tp > 1 else None)
    else:
        mlp = ((5 if hf else 2) if gpt else 4) * c * m * f / tp
    return norms + attn + mlp


def _runtime_norm_bytes(spec: ModelSpec, tokens: float) -> float:
    """What a norm of the runtime keeps of `tokens` tokens: its fp32 input, and RMSNorm's fp32
    normalised value and per-token rsqrt (LayerNorm's mean and rstd)."""
    h = spec.hidden_size
    return tokens * ((4 * h + 8) if spec.model_type == "gpt" else (8 * h + 4))


def _hf_norm_bytes(spec: ModelSpec, tokens: float) -> float:
    """What an HF norm keeps of `tokens` tokens besides its output: RMSNorm its fp32 upcast input,
    the per-token rsqrt and the normalised value cast back to bf16; LayerNorm its bf16 input and
    the fp32 mean and rstd CUDA keeps (on a CPU they are bf16, 4 bytes a token less)."""
    h = spec.hidden_size
    return tokens * ((2 * h + 8) if spec.model_type == "gpt" else (4 * h + 4 + 2 * h))


def eager_head_saved_bytes(spec: ModelSpec, *, head: Head, b: int, s: int, tp: int, sp: bool, compute_bytes: int = 2,
                           style: str = "autocast") -> float:
    """What an eager last stage keeps beyond its layers: the final norm's (`eager_layer_saved_bytes`)
    and the head's input: the runtime's fp32 for the LM head (its log-probs run in chunks in fp32
    and recompute the logits in backward) or the value head's cast of it; HF's, the norm's bf16
    normalised value and output (the logits are `logits` of the cost model)."""
    h = spec.hidden_size
    m = float(s) * b
    mn = m / tp if sp else m
    if style == "hf":
        return _hf_norm_bytes(spec, mn) + 2 * m * h
    return _runtime_norm_bytes(spec, mn) + (4 if head == "lm" else compute_bytes) * m * h


def forward_working_bytes(spec: ModelSpec, fw: Framework, *, b: int, s: int, tp: int, kv_len: int | None = None,
                          moe: ExpertLoad | None = None) -> float:
    """Peak live bytes inside one layer's forward when nothing is kept for backward (inference).

    The residual stream in and out (2 x 2sbh) plus the larger of the MLP intermediates (GELU: up
    and activation; SwiGLU: gate, up and product, 2 bytes each per element of s x b x f/t) and
    the attention intermediates (q, k, v and the output; materialised scores and probabilities).
    """
    h, d, f = spec.hidden_size, spec.d_head, spec.ffn_size
    a, kv = spec.num_attention_heads, spec.kv_heads
    keys = kv_len or s
    tokens = float(s) * b
    mlp = (2 if spec.model_type == "gpt" else 3) * 2 * tokens * f / tp
    if moe is not None:  # token copies in and out, the experts' gate, up and product
        mlp = 2 * 2.0 * moe.routed * spec.num_experts_per_tok * h + 3 * 2.0 * moe.rows * moe.active * moe.width + \
            3 * 2 * tokens * spec.shared_expert_intermediate_size / tp
    attn = 2 * tokens * (a + 2 * kv) * d / tp + 2 * tokens * a * d / tp
    if fw.attention == "materialized":
        attn += 2 * 2 * b * (a / tp) * s * keys
    return 4 * tokens * h + max(mlp, attn)


def in_flight_microbatches(layout: Layout, stage: int, m: int) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak."""
    pp, v = layout.pp, layout.interleave
    if pp == 1:
        return 1.0
    if v == 1:
        return float(min(m, pp - stage))
    return min(float(m), pp * (1 + (pp - 1) / (pp * v)) - stage)


def stage_params(spec: ModelSpec, *, head: Head, layers: int, first: bool, last: bool, tp: int,
                 layer_params: float) -> float:
    """Parameters one tensor-parallel rank of a stage holds (`layer_params` per decoder layer)."""
    h, v = spec.hidden_size, spec.vocab_size
    n = layers * layer_params
    vocab_rows = -(-v // tp) * h
    if first:
        n += vocab_rows + (spec.max_position_embeddings * h if spec.model_type == "gpt" else 0)
    if last:
        n += h * (2 if spec.model_type == "gpt" else 1)  # final norm
        if head == "value":
            n += h
        elif not spec.tied or not first:  # a tied head on its own stage keeps a copy
            n += vocab_rows
    return n


def state_bytes(params: float, fw: Framework, *, layout: Layout, trainable: bool,
                expert_params: float = 0.0, galore: GaLoreLayer | None = None) -> dict[str, int]:
    """Weights (+ gradients and optimizer states when trainable) per rank, by ZeRO stage: dense
    weights sharded over the data-parallel group (with the context-parallel ranks, or without
    them where they hold replicas of ZeRO-3's slices: `Framework.cp_zero3_replicas`), routed experts over theirs
    (`Layout.edp`); with a GaLore optimizer the stage's projected matrices (`galore`) keep
    low-rank moments."""
    dp = fw.zero_ranks(layout)
    edp = layout.edp
    z = layout.zero

    def over(n_dense: float, n_expert: float, shard: bool) -> float:
        return n_dense / (dp if shard else 1) + n_expert / (edp if shard else 1)

    out = {"params": int(over(params, expert_params, z >= 3) * fw.param_bytes)}
    if trainable:
        out["grads"] = int(over(params, expert_params, z >= fw.grads_sharded_from_zero) * fw.grad_bytes)
        optimizer = over(params, expert_params, z >= 1) * fw.optimizer_bytes
        if galore is not None:
            optimizer -= saved_optimizer_bytes(galore) / (dp if z >= 1 else 1)
        out["optimizer"] = int(optimizer)
    return out


def reserve_bytes(capacity_bytes: int) -> int:
    """Memory the CUDA context and the libraries' workspaces hold outside tensors."""
    return int(min(RESERVE_MAX_BYTES, RESERVE_FRACTION * capacity_bytes))


def nccl_bytes(groups: Sequence[Group], *, p2p_peers: int) -> int:
    """NCCL buffers of a rank in the communicators of `groups` with `p2p_peers` pipeline
    neighbours: per channel of each communicator (`comm.nccl_channels`: 32 inside a node, two per
    rank on each node for one spanning nodes) a connection's buffers, twice for one spanning
    nodes (its tree's as well as its ring's)."""
    coll = sum(nccl_channels(g) * (2 if g.spans_nodes else 1) for g in groups)
    return int((coll + p2p_peers * NCCL_P2P_CHANNELS) * NCCL_CHANNEL_BYTES)


def fragmentation_bytes(mem: dict[str, int]) -> int:
    """The caching allocator's unusable share of the transient tensors."""
    return int(FRAGMENTATION * sum(mem.get(k, 0) for k in TRANSIENT))


def kv_cache_bytes(spec: ModelSpec, *, seqs: float, ctx: int, layers: int, tp: int) -> float:
    """K and V of `seqs` sequences of `ctx` tokens over `layers` layers on one tensor-parallel rank."""
    return 2.0 * 2 * seqs * ctx * layers * spec.kv_heads * spec.d_head / tp
