"""The kernels one decoder layer (and the embedding and head) launch per micro-batch, per GPU.

Every kernel is a GEMM (with its M, N, K after tensor-parallel splitting), a fused attention
kernel, or a memory-bound kernel (bytes read + written); collectives are listed apart. FLOPs are
exact for both families:

- per layer forward, tokens M = b*s on a rank: QKV ``2*M*h*(a+2*kv)*d/t``, attention scores and
  context ``2 * 2*b*(a/t)*s_q*s_k*d`` (halved for causal flash attention), output projection
  ``2*M*a*d*h/t``, MLP ``2*M*h*f/t`` per matrix (2 for GELU, 3 for SwiGLU); with a sliding
  window W shorter than the keys (Mistral), a kernel that takes the window (FlashAttention's
  ``window_size``: `Framework.windowed_attention`) computes ``min(p, W)`` keys for query p and a
  decode step reads the last W of the cache, while an explicit mask (the planner's runtime,
  PyTorch SDPA with ``attn_mask``) computes every score, the causal half too;
- backward: two GEMMs per forward GEMM (input and weight gradient), so twice the forward FLOPs;
  flash attention backward is 2.5x its forward (FlashAttention-2, Dao 2023);
- LM head ``2*M*h*V/t`` forward.

Memory-bound kernels count fp16/bf16 bytes read and written: norms (read x, write y: 4 bytes per
element), bias-dropout-add (read 2 inputs, write, 1-byte mask: 7), bias-GELU (4 per element of the
4h activation), SwiGLU (6), materialised softmax over the s x s scores (4) and its dropout (5);
backward kernels read the saved input and the incoming gradient and write one gradient.
With sequence parallelism the norm/dropout region holds M/t tokens (Korthikanti et al. 2022).

A sparse (mixture-of-experts) layer replaces the MLP by a router GEMM ``2*T*h*E`` over the T tokens
a rank routes, a top-k softmax, a permutation of the T*k token copies into expert order, grouped
GEMMs of the experts a rank holds (each at the rows it really receives: `ExpertLoad`), the
un-permutation and weighted sum, and an all-to-all over the expert-parallel group before and
after the experts (dispatch and combine; the backward runs both again). A shared expert is a
dense SwiGLU MLP beside them. The experts' GEMMs are launched as the stack launches them
(`Framework.expert_gemms`: one grouped kernel, one per expert, or a loop over the experts), and
the host pays each launch (`Kernel.launches`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from cost_models.comm import expected_max_normal
from cost_models.framework import UNFUSED_CROSS_ENTROPY, Framework, MoeDispatch, QkNormKernels
from plans.layout import Layout
from plans.model import Head, ModelSpec

KernelKind = Literal["gemm", "attn", "mem"]
CommOp = Literal["all_reduce", "all_gather", "reduce_scatter", "ring_p2p", "all_to_all"]
FLASH_BWD_FLOPS_RATIO = 2.5  # FlashAttention-2 backward: 5 matmuls against 2 forward
LOGPROB_BYTES = 10  # log-softmax and gather for inference log-probs


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: a GEMM of shape (m, n, k) x batch, fused attention, or a memory-bound op.

    Fused attention is (m, n, k) = (queries, keys, head dim) x batch (sequences x heads); it
    computes `scores` attention scores (the causal half) in each of its `passes` (1 forward;
    the backward recomputes the scores and forms their gradients, `FLASH_BWD_FLOPS_RATIO`)."""

    kind: KernelKind
    flops: float
    bytes: float
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    scores: float = 0.0
    passes: float = 1.0
    # Kernels the host launches for this entry (each paying the host's issue time and the device's
    # launch latency): more than one where a stack runs a grouped operation expert by expert.
    # `serial`: those launches run one after another, each on its share of `batch` (a Python loop);
    # otherwise they fill the GPU together, as one grouped kernel would (streams running concurrently).
    launches: int = 1
    serial: bool = False


@dataclass(frozen=True)
class Comm:
    """One collective over the tensor- or context-parallel group, `bytes` per rank."""

    op: CommOp
    bytes: float
    group: Literal["tp", "cp", "ep"]
    leaving: float | None = None  # all-to-all: bytes per rank that leave the node, where not the even share
    # Backward only, on the input-gradient collective of a column-parallel GEMM (the backward of
    # the all-gather or copy that feeds it): that GEMM's weight gradient, which Megatron computes
    # while the collective runs (`Framework.tp_dgrad_overlap`).
    under: Kernel | None = None


@dataclass(frozen=True)
class LayerWork:
    """The kernels and collectives of one decoder layer for one micro-batch on one rank."""

    fwd: tuple[Kernel, ...]
    bwd: tuple[Kernel, ...]
    fwd_comm: tuple[Comm, ...]
    bwd_comm: tuple[Comm, ...]
    attn_core: tuple[Kernel, ...]  # what selective recompute reruns
    grad_accum: Kernel  # adding the micro-batch's weight gradients into the gradient buffer
    grad_tensors: int  # accumulation kernels per layer: one per parameter tensor, one more per cast matrix


def gemm(m: int, n: int, k: int, batch: int = 1) -> Kernel:
    """C[m, n] = A[m, k] @ B[k, n], `batch` times, fp16/bf16 operands."""
    return Kernel("gemm", 2.0 * batch * m * n * k, 2.0 * batch * (m * k + k * n + m * n), m, n, k, batch)


def gemm_bwd(g: Kernel, accum_bytes: float = 0.0) -> tuple[Kernel, Kernel]:
    """Gradients of A (m, k, n) and of B (k, n, m) for a forward GEMM `g`, launched as `g` is;
    `accum_bytes` more per element of B's gradient where that GEMM accumulates into the gradient
    buffer itself (`Framework.wgrad_accum_fused`)."""
    wgrad = gemm(g.k, g.n, g.m, g.batch)
    if accum_bytes:
        wgrad = dataclasses.replace(wgrad, bytes=wgrad.bytes + accum_bytes * g.batch * g.k * g.n)
    return (launched(gemm(g.m, g.k, g.n, g.batch), g.launches, g.serial), launched(wgrad, g.launches, g.serial))


def fused_accum_bytes(fw: Framework) -> float:
    """What a weight-gradient GEMM that accumulates into the gradient buffer adds to its traffic per
    weight: reading and writing the buffer's dtype instead of writing a bf16 gradient (0 where the
    stack accumulates by a kernel of its own)."""
    return 2.0 * fw.grad_bytes - fw.param_bytes if fw.wgrad_accum_fused else 0.0


ACT_BYTES = 2.0  # activations in the compute dtype (bf16 or fp16), bytes per element


def mem(nbytes: float, launches: int = 1) -> Kernel:
    return Kernel("mem", 0.0, float(nbytes), launches=launches)


def launched(g: Kernel, launches: int, serial: bool) -> Kernel:
    """`g` issued as `launches` kernels (see `Kernel.launches`)."""
    return dataclasses.replace(g, launches=launches, serial=serial)


def host_launches(kernels: tuple[Kernel, ...] | list[Kernel]) -> int:
    """Kernels the host issues for `kernels`."""
    return sum(k.launches for k in kernels)


def layer_params_per_rank(spec: ModelSpec, tp: int, *, sparse: bool = False) -> float:
    """Weights of one decoder layer held by one tensor-parallel rank (replicated norms counted whole),
    routed experts left out (`expert_params_per_rank`): a `sparse` layer holds its router and shared
    expert in place of the dense MLP."""
    h, d, f = spec.hidden_size, spec.d_head, spec.ffn_size
    q, kv = spec.num_attention_heads * d, spec.kv_heads * d
    mats = layer_matrix_params(spec, sparse=sparse)
    if spec.model_type == "gpt":
        split_bias, whole = q + 2 * kv + f, 6 * h  # 2 norms (w, b), out and down biases
    else:
        split_bias, whole = (q + 2 * kv) if spec.attention_bias else 0, 2 * h
    if spec.qk_norm == "head":
        whole += 2 * d
    elif spec.qk_norm == "proj":
        split_bias += q + kv
    if sparse:
        whole += spec.experts * h + (h if spec.shared_expert_gate else 0)  # router, shared expert gate
    return (mats + split_bias) / tp + whole


def layer_matrix_params(spec: ModelSpec, *, sparse: bool = False) -> float:
    """Weights of one decoder layer's matrices (QKV, output, the dense MLP's or a sparse layer's
    shared expert's), before any tensor-parallel split; norms, biases, a router and routed experts
    left out."""
    h, d, f = spec.hidden_size, spec.d_head, spec.ffn_size
    q, kv = spec.num_attention_heads * d, spec.kv_heads * d
    mlp = 3 * h * spec.shared_expert_intermediate_size if sparse else (2 if spec.model_type == "gpt" else 3) * h * f
    return h * (q + 2 * kv) + q * h + mlp


def layer_cast_params(spec: ModelSpec, *, sparse: bool, tp: int, ep: int = 1, etp: int = 1) -> float:
    """Weights of one decoder layer on a rank that autocast casts for its matmuls and the matmuls
    keep until backward (the planner's runtime on fp32 weights): the layer's matrices and, in a
    sparse layer, its routed experts (every one computes in training), its router and a shared
    expert's gate (both replicated over tensor parallelism)."""
    cast = layer_matrix_params(spec, sparse=sparse) / tp
    if sparse:
        cast += expert_params_per_rank(spec, ep, etp) + spec.experts * spec.hidden_size + \
            (spec.hidden_size if spec.shared_expert_gate else 0)
    return cast


def expert_params_per_rank(spec: ModelSpec, ep: int, etp: int) -> float:
    """Routed-expert weights of one sparse layer on one rank: its experts' share of the f dim."""
    return spec.experts / ep * 3 * spec.hidden_size * spec.expert_ffn / etp


def mean_layer_params(spec: ModelSpec, tp: int, *, active: bool = False) -> float:
    """Per-rank weights of an average decoder layer (dense and sparse layers, all experts or, with
    `active`, the `num_experts_per_tok` a token uses): for FLOPs and weight streaming."""
    sparse = spec.moe_layers
    dense = spec.num_hidden_layers - sparse
    experts = expert_params_per_rank(spec, 1, tp) * (spec.num_experts_per_tok / spec.experts if active else 1.0) \
        if sparse else 0.0
    total = dense * layer_params_per_rank(spec, tp) + sparse * (layer_params_per_rank(spec, tp, sparse=True) + experts)
    return total / spec.num_hidden_layers


@dataclass(frozen=True)
class ExpertLoad:
    """How one micro-batch's routed tokens fall on one rank's experts in a sparse layer.

    A rank routes `routed` tokens (all its replica's tokens when experts are tensor-parallel like
    the dense MLP, etp = tp; its 1/tp share of them when each expert is whole, etp = 1) and sends
    their ``routed * k`` copies over the expert-parallel group. Its E/ep experts receive ep times
    its share of the group's copies on average; an expert receives one with probability k/E per
    token of the group, so `active` experts get any at all (all of them in training; few in decode,
    which then streams only those experts' weights). The busiest rank bounds the layer: each
    expert's count is binomial (tokens x k/E), plus the router's own unevenness `load_cv`
    (coefficient of variation of an expert's load); a rank sums E/ep of them, and the largest of
    ep such sums is ``1 + cv_rank * E[max of ep normals]`` times the mean (`skew`).
    """

    routed: int
    active: int  # local experts receiving tokens
    rows: int  # tokens each active expert of the busiest rank computes
    width: int  # expert width on this rank (f / etp)
    skew: float
    a2a_bytes: float  # what the busiest rank sends (and receives) in one all-to-all
    a2a_leaving: float | None = None  # of it, what leaves the node (None: the share of the other nodes' ranks)
    ep: int = 1  # ranks of the expert-parallel group


def groups_hit(experts: int, k: int, groups: int) -> float:
    """Expected groups holding at least one of a token's `k` distinct experts, `experts` of them
    spread evenly over `groups` groups (ranks or nodes) and chosen uniformly."""
    per = experts // groups
    miss = 1.0
    for i in range(k):  # none of the k draws (without replacement) lands in a given group
        miss *= max(0.0, (experts - per - i) / (experts - i))
    return groups * (1.0 - miss)


def expert_load(spec: ModelSpec, layout: Layout, *, tokens: int, load_cv: float = 0.0,
                dispatch: MoeDispatch = "alltoall", ep_nodes: int = 1) -> ExpertLoad:
    """The `ExpertLoad` of `tokens` tokens of one replica (one micro-batch, one context chunk).

    With the ``deepep`` dispatch a token goes once to each rank holding any of its experts and,
    across the `ep_nodes` nodes of the expert-parallel group, once to each other node holding any."""
    return expert_load_at(spec, tp=layout.tp, ep=layout.ep, etp=layout.etp, tokens=tokens, load_cv=load_cv,
                          dispatch=dispatch, ep_nodes=ep_nodes)


def expert_load_at(spec: ModelSpec, *, tp: int, ep: int, etp: int, tokens: int, load_cv: float = 0.0,
                   dispatch: MoeDispatch = "alltoall", ep_nodes: int = 1) -> ExpertLoad:
    """`expert_load` from the only degrees it reads: tp, ep and etp."""
    e, k = spec.experts, spec.num_experts_per_tok
    routed = max(1, tokens // tp) if etp == 1 and tp > 1 else tokens
    group_tokens = ep * routed
    p = k / e
    local = e // ep
    active = max(1, min(local, math.ceil(local * (1.0 - (1.0 - p) ** group_tokens))))
    if ep > 1:
        cv_expert = math.sqrt(load_cv**2 + (1.0 - p) / (group_tokens * p))
        skew = 1.0 + cv_expert / math.sqrt(local) * expected_max_normal(ep)
    else:
        skew = 1.0
    rows = max(1, math.ceil(routed * k / active * skew))
    token = 2.0 * routed * spec.hidden_size * skew  # bytes of the routed tokens, busiest rank
    leaving = None
    if ep <= 1:
        a2a = 0.0
    elif dispatch == "deepep":
        a2a = token * groups_hit(e, k, ep)
        if ep_nodes > 1:  # own node's share excluded: (nodes-1)/nodes of the nodes hit are others
            leaving = token * groups_hit(e, k, ep_nodes) * (ep_nodes - 1) / ep_nodes
    else:
        a2a = token * k
    return ExpertLoad(routed, active, rows, spec.expert_ffn // etp, skew, a2a, leaving, ep)


def _attention(spec: ModelSpec, fw: Framework, *, b: int, s_q: int, s_k: int, tp: int, causal: bool) -> tuple[
        tuple[Kernel, ...], tuple[Kernel, ...]]:
    """Forward and backward kernels of the attention core (scores, softmax, context)."""
    d = spec.d_head
    heads = b * spec.num_attention_heads // tp
    m_q = b * s_q
    q_bytes = 2.0 * m_q * spec.num_attention_heads * d / tp
    kv_bytes = 2.0 * 2 * b * s_k * spec.kv_heads * d / tp
    window = spec.sliding_window if spec.sliding_window is not None and spec.sliding_window < s_k else None
    if window is not None and fw.windowed_attention:  # the kernel skips the keys outside the window
        # causal: query p sees min(p, W) keys, summed over a sequence of s_k; decode: the last W of the cache
        keys = (window * (window + 1) / 2 + (s_k - window) * window) / s_k if causal else float(window)
        if not causal:
            kv_bytes *= window / s_k  # decode reads only the window's part of the cache
    elif window is not None:  # an explicit mask: every score is computed, the causal half included
        keys = float(s_k)
    else:
        keys = s_k * ((s_k + 1) / (2 * s_k) if causal else 1.0)
    if fw.attention == "flash":
        n_scores = float(heads) * s_q * keys
        flops = 4.0 * d * n_scores
        f = Kernel("attn", flops, 2 * q_bytes + kv_bytes, s_q, s_k, d, heads, n_scores)
        b_ = Kernel("attn", FLASH_BWD_FLOPS_RATIO * flops, 4 * q_bytes + 2 * kv_bytes, s_q, s_k, d, heads, n_scores,
                    FLASH_BWD_FLOPS_RATIO)
        return (f,), (b_,)
    scores = gemm(s_q, s_k, d, heads)
    context = gemm(s_q, d, s_k, heads)
    sq = float(heads) * s_q * s_k
    if heads % fw.fused_softmax_multiple == 0 and s_k <= fw.fused_softmax_max_keys:
        soft_f, soft_b = [mem(4 * sq)], [mem(6 * sq)]
    else:  # scale (2+2), mask (2+1+2), to fp32 (2+4), softmax (4+4), to fp16 (4+2); backward in fp32
        soft_f = [mem(4 * sq), mem(5 * sq), mem(6 * sq), mem(8 * sq), mem(6 * sq)]
        soft_b = [mem(6 * sq), mem(12 * sq), mem(6 * sq), mem(4 * sq)]
    fwd = [scores, *soft_f]
    bwd = [*gemm_bwd(context)]
    if fw.dropout:
        fwd.append(mem(5 * sq))
        bwd.append(mem(5 * sq))
    fwd += [context, mem(2 * q_bytes)]  # context back to [s, b, h] (permute + contiguous)
    bwd = [mem(2 * q_bytes), *bwd, *soft_b, *gemm_bwd(scores)]
    return tuple(fwd), tuple(bwd)


def ring_attention(spec: ModelSpec, fw: Framework, *, b: int, s_loc: int, tp: int, cp: int) -> tuple[
        tuple[Kernel, ...], tuple[Kernel, ...]]:
    """Causal attention of a rank's `s_loc` tokens under context parallelism over a ring, as
    Transformer Engine runs it (`AttnFuncWithCPAndKVP2P` in
    transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py): each rank
    holds two chunks of s / (2 cp) tokens (load balancing) and runs cp fused-attention calls, one
    per block of keys that reaches it: its own, causal over its s_loc tokens, then cp - 1 without
    a mask, where the last rank (the busiest, which the others wait for at the next exchange)
    attends all its queries to the first half of each received block. Each call's output and
    log-sum-exp are merged into the result by a fused elementwise kernel in the compute dtype (the
    first scaled, 2+2 bytes a q element, each later one added, 2+2+2), and K and V are packed into
    the ring's send buffer (2+2 a k or v element). Backward runs the same calls in reverse; q's
    gradient is copied (2+2) then added to (2+2+2) per call, and the gradient of the keys and values
    in flight is copied or added to per call, over the half of the block the call saw, except the
    last (the whole block), with K and V copied into the backward's ring buffer first. The total
    scores equal one causal kernel's over the whole sequence (1/cp of them on the rank), in
    kernels of s / (2 cp) keys per query rather than s / 2."""
    own_f, own_b = _attention(spec, fw, b=b, s_q=s_loc, s_k=s_loc, tp=tp, causal=True)
    got_f, got_b = _attention(spec, fw, b=b, s_q=s_loc, s_k=s_loc // 2, tp=tp, causal=False)
    q = b * s_loc * spec.num_attention_heads * spec.d_head / tp  # elements of q (and of the output)
    kv = 2.0 * b * s_loc * spec.kv_heads * spec.d_head / tp  # of k and v
    fwd: list[Kernel] = [mem(4.0 * kv), *own_f, mem(4.0 * q)]
    bwd: list[Kernel] = [mem(4.0 * kv), *got_b, mem(4.0 * q), mem(2.0 * kv)]
    for i in range(1, cp):
        fwd += [*got_f, mem(6.0 * q)]
        last = i == cp - 1
        bwd += [*(own_b if last else got_b), mem(6.0 * q), mem((6.0 if last else 3.0) * kv)]
    return tuple(fwd), tuple(bwd)


def ulysses_bytes(spec: ModelSpec, *, b: int, s_loc: int, tp: int, cp: int) -> tuple[float, float]:
    """Bytes a rank sends into Ulysses' all-to-all of q (and of the output), and of k (or v):
    its chunk of the sequence with every head of its tensor-parallel share, k and v with their
    heads repeated up to cp where there are fewer (verl's `repeat_kv`)."""
    d = spec.d_head
    kv_heads = max(spec.kv_heads // tp, cp)
    return ACT_BYTES * b * s_loc * spec.num_attention_heads * d / tp, ACT_BYTES * b * s_loc * kv_heads * d


def ulysses_attention(spec: ModelSpec, fw: Framework, *, b: int, s: int, tp: int, cp: int) -> tuple[
        tuple[Kernel, ...], tuple[Kernel, ...]]:
    """Causal attention under DeepSpeed-Ulysses context parallelism as verl's FSDP workers run it
    (`gather_seq_scatter_heads` / `gather_heads_scatter_seq` in verl/utils/ulysses.py): q, k and v
    are exchanged from the rank's chunk of the sequence with every head to the whole sequence
    with 1/cp of the heads, one fused kernel attends over the whole sequence, and the output goes
    back; each all-to-all copies its input into cp contiguous parts (2+2 bytes an element, cp
    launches) and concatenates what it receives (2+2), backward the same for the gradients. k and
    v with fewer heads than cp are repeated up to cp first (`repeat_kv`, a copy; backward sums the
    copies)."""
    f, b_ = _attention(spec, fw, b=b, s_q=s, s_k=s, tp=tp * cp, causal=True)
    q_b, kv_b = ulysses_bytes(spec, b=b, s_loc=s // cp, tp=tp, cp=cp)

    def exchange(nbytes: float) -> list[Kernel]:  # cp contiguous parts of the input, then one concatenation
        return [mem(2.0 * nbytes, cp), mem(2.0 * nbytes)]

    own_kv = kv_b * (spec.kv_heads // tp) / max(spec.kv_heads // tp, cp)
    repeat = [mem(own_kv + kv_b)] * 2 if spec.kv_heads // tp < cp else []  # k, v; backward sums the copies
    heads = [*exchange(q_b), *exchange(kv_b), *exchange(kv_b)]
    fwd = (*repeat, *heads, *f, *exchange(q_b))
    bwd = (*exchange(q_b), *b_, *heads, *repeat)
    return fwd, bwd


def stream_bytes(fw: Framework) -> float:
    """Bytes per element of the residual stream, which the hidden states between layers keep:
    fp32 where each GEMM casts its input from it (`Framework.input_cast_bytes`), else bf16."""
    return fw.input_cast_bytes - ACT_BYTES if fw.input_cast_bytes else float(ACT_BYTES)


@dataclass(frozen=True)
class TpCopies:
    """The stack's copies around a block's tensor-parallel collectives (`Framework.tp_copies`), of
    `m` tokens (`mn` a rank's chunk under sequence parallelism): under it, the block's input
    all-gathered and its output reduce-scattered each through two copies (a transpose made
    contiguous in and out), backward the reverse; without it only the backward all-reduce of the
    input's gradient copies it first (one clone). Empty lists without them."""

    enter_f: list[Kernel]
    exit_f: list[Kernel]
    exit_b: list[Kernel]
    enter_b: list[Kernel]


def tp_copies(fw: Framework, *, tp: int, sp: bool, m: int, mn: int, h: int, enter_bytes: float,
              exit_bytes: float) -> TpCopies:
    """`TpCopies` of a block whose input holds `enter_bytes` per element and output `exit_bytes`."""
    if not (fw.tp_copies and tp > 1):
        return TpCopies([], [], [], [])
    if not sp:
        return TpCopies([], [], [], [mem(2.0 * enter_bytes * m * h)])
    return TpCopies([mem(2.0 * enter_bytes * mn * h), mem(2.0 * enter_bytes * m * h)],
                    [mem(2.0 * exit_bytes * m * h), mem(2.0 * exit_bytes * mn * h)],
                    [mem(2.0 * exit_bytes * mn * h), mem(2.0 * exit_bytes * m * h)],
                    [mem(2.0 * enter_bytes * m * h), mem(2.0 * enter_bytes * mn * h)])


def qk_norm_work(spec: ModelSpec, fw: Framework, *, m: int, tp: int) -> tuple[list[Kernel], list[Kernel]]:
    """The norms of q and of k for `m` tokens on a rank (forward, backward): none without
    `ModelSpec.qk_norm`; the stack's eager kernels where `Framework.qk_norm_kernels` lists them
    for the kind (each kernel once for q and once for k), its fused norm kernel on each otherwise
    (Transformer Engine's in Megatron-core's ``q_layernorm`` / ``k_layernorm``, vLLM's RMSNorm).
    A row is a head of a token (Qwen3) or the token's whole projection (OLMoE); kernels on the
    rows' statistics move bytes only where rows outnumber tokens."""
    if spec.qk_norm == "none":
        return [], []
    d, a, kv = spec.d_head, spec.num_attention_heads, spec.kv_heads
    qk = m * (a + kv) * d / tp
    kinds = dict(fw.qk_norm_kernels)
    if spec.qk_norm not in kinds:
        return [mem(x * qk, 2) for x in fw.norm_fwd], [mem(x * qk, 2) for x in fw.norm_bwd]
    kn = kinds[spec.qk_norm]
    # Rows of q and of k: a head of a token each (Qwen3), or the token (OLMoE).
    heads = [a // tp, max(1, kv // tp)] if spec.qk_norm == "head" else [1, 1]
    rows = sum(float(m * n) for n in heads if n > 1)  # only more rows than tokens move bytes that count
    fwd = [mem(x * qk, 2) for x in kn.fwd] + [mem(x * rows, 2) for x in kn.fwd_rows]
    bwd = [mem(x * qk, 2) for x in kn.bwd] + [mem(x * rows, 2) for x in kn.bwd_rows]
    if spec.qk_norm == "proj" and tp > 1 and fw.tp_copies:
        # Over a tensor-parallel split projection the sums of squares are all-reduced (a value per
        # token, not priced), their gradients cloned for the backward's all-reduce.
        bwd.append(mem(0.0, 2))
    return fwd, bwd


@lru_cache(maxsize=4096)
def layer_work(spec: ModelSpec, fw: Framework, *, b: int, s: int, tp: int, cp: int, sp: bool,
               kv_len: int | None = None, moe: ExpertLoad | None = None) -> LayerWork:
    """Kernels of one layer for a micro-batch of `b` sequences of `s` tokens on one rank.

    Context parallelism splits each sequence into `cp` chunks (queries local, keys and values
    exchanged around a ring); sequence parallelism shards the norm/dropout region over `tp`.
    `kv_len` (decode) attends `s` new tokens to a cache of that many keys, without a causal mask.
    With `moe` the layer is sparse: its MLP is the router, the experts as `moe` loads them, the
    shared expert and two all-to-alls each way (`sparse_mlp`).
    """
    h, d, f = spec.hidden_size, spec.d_head, spec.ffn_size
    a, kv = spec.num_attention_heads, spec.kv_heads
    kv_parallel = kv_len is not None and cp > 1  # decode: the queries whole, the cache in cp shares
    s_loc = s if kv_parallel else s // cp
    m = b * s_loc
    mn = m // tp if sp else m  # tokens in the norm/residual region
    gpt = spec.model_type == "gpt"
    drop = fw.dropout
    add_bytes = 7 if drop else 6

    split = fw.split_projections if not gpt or fw.gpt_split_projections is None else fw.gpt_split_projections
    qkv = gemm(m, (a + 2 * kv) * d // tp, h)
    projs = [gemm(m, a * d // tp, h), gemm(m, kv * d // tp, h), gemm(m, kv * d // tp, h)] if split else [qkv]
    out = gemm(m, h, a * d // tp)
    if moe is not None:
        sparse = sparse_mlp(spec, fw, m=m, tp=tp, moe=moe, sp=sp)
        ups, act_fwd, act_bwd, down = [], list(sparse.fwd), list(sparse.bwd), None
    elif gpt:
        ups = [gemm(m, f // tp, h)]
        act_fwd = [mem(x * m * f / tp) for x in fw.gelu_fwd or (4.0,)]
        act_bwd = [mem(x * m * f / tp) for x in fw.gelu_bwd or (6.0,)]
    else:
        ups = [gemm(m, f // tp, h)] * 2 if split else [gemm(m, 2 * f // tp, h)]
        act_fwd = [mem(x * m * f / tp) for x in fw.swiglu_fwd or (6.0,)]
        act_bwd = [mem(x * m * f / tp) for x in fw.swiglu_bwd or (10.0,)]
    if moe is None:
        down = gemm(m, h, f // tp)
    keys = -(-kv_len // cp) if kv_len is not None else s
    windowed = spec.sliding_window is not None and spec.sliding_window < s
    if cp > 1 and kv_len is None and fw.cp_comm == "ring" and fw.attention == "flash" and not windowed:
        att_f, att_b = ring_attention(spec, fw, b=b, s_loc=s_loc, tp=tp, cp=cp)
    elif cp > 1 and kv_len is None and fw.cp_comm == "all_to_all":
        att_f, att_b = ulysses_attention(spec, fw, b=b, s=s, tp=tp, cp=cp)
    else:
        att_f, att_b = _attention(spec, fw, b=b, s_q=s_loc, s_k=keys, tp=tp, causal=kv_len is None)
    qk = m * (a + kv) * d / tp
    rope_f = [] if gpt else [mem(x * qk, fw.rope_launches) for x in fw.rope_fwd]
    rope_b = [] if gpt else [mem(x * qk, fw.rope_launches) for x in fw.rope_bwd]
    qk_f, qk_b = qk_norm_work(spec, fw, m=m, tp=tp)
    if qk_f and dict(fw.qk_norm_kernels).get(spec.qk_norm, QkNormKernels((), (), (), ())).out_fp32:
        # Rotary on fp32 q and k (twice the bytes; backward's copy back to the projection's layout
        # too where the norm ran on the projection, before the heads were split off), then the
        # attention's casts of both to bf16 and their backward.
        clone = len(fw.rope_bwd) - 1  # the last backward entry: that copy
        rope_f = [dataclasses.replace(k, bytes=2 * k.bytes) for k in rope_f]
        rope_b = [dataclasses.replace(k, bytes=2 * k.bytes) if i != clone or spec.qk_norm == "proj" else k
                  for i, k in enumerate(rope_b)]
        rope_f.append(mem(6.0 * qk, 2))
        rope_b.insert(0, mem(6.0 * qk, 2))

    norm_fwd, norm_bwd = fw.layernorm if gpt and fw.layernorm else (fw.norm_fwd, fw.norm_bwd)
    norm_f, norm_b = [mem(x * mn * h) for x in norm_fwd], [mem(x * mn * h) for x in norm_bwd]
    add_f = [mem(x * mn * h) for x in fw.residual_fwd or (add_bytes,)]
    add_b = [mem(x * mn * h) for x in fw.residual_bwd or (5 if drop else 6,)]
    if gpt and fw.row_bias_apart:  # the bias add makes the branch the weights' dtype, then the residual add
        add_f = [mem((ACT_BYTES + fw.param_bytes) * mn * h), mem(3.0 * fw.param_bytes * mn * h)]
        add_b = [*add_b, mem(fw.param_bytes * mn * h)]  # and the bias's gradient, summed over tokens
    # The runtime's eager sparse MLP returns its sum in fp32 (index_add into an fp32 tensor): the MLP's
    # residual add reads two fp32 tensors, and its backward casts no gradient back to bf16 (the
    # sum where the branch's gradient meets the stream's stays).
    mlp_add_f, mlp_add_b = add_f, add_b
    if moe is not None and fw.moe_routing == "eager":
        mlp_add_f, mlp_add_b = [mem(3.0 * fw.param_bytes * mn * h)], [mem(3.0 * fw.param_bytes * mn * h)]
    # Backward sums the input gradients of separate projections: two kernels for q, k, v, one for
    # gate, up; under autocast each projection cast its own input (`Framework.input_cast_bytes`).
    in_cast = [mem(fw.input_cast_bytes * m * h)] if fw.input_cast_bytes else []
    # A router reads the rank's own tokens (its chunk of the sequence under sequence parallel).
    router_cast = [mem(fw.input_cast_bytes * mn * h)] if fw.input_cast_bytes else []
    cast_qkv, cast_up = in_cast * len(projs), (in_cast * len(ups) if moe is None else router_cast)
    sum_qkv = [mem(3.0 * fw.param_bytes * m * h)] * (len(projs) - 1)
    sum_up = [mem(3.0 * fw.param_bytes * m * h)] * (len(ups) - 1)
    # Where a bias inside a GEMM has its gradient summed over tokens apart (the GEMM's output
    # gradient, in the compute dtype; `Framework.bias_grads_apart`); under autocast the bias is cast
    # too. A GPT's output and down biases are summed with their adds where those run apart.
    bias_qkv = projs if fw.bias_grads_apart and (gpt or spec.attention_bias) else []
    bias_up = ups if fw.bias_grads_apart and gpt else []
    biased = [*bias_qkv, *bias_up]
    sum_qkv += [mem(ACT_BYTES * m * g.n) for g in bias_qkv]
    sum_up += [mem(ACT_BYTES * m * g.n) for g in bias_up]
    rows_apart = fw.bias_grads_apart and gpt and not fw.row_bias_apart
    sum_out = [mem(ACT_BYTES * m * h)] if rows_apart else []
    sum_down = [mem(ACT_BYTES * m * h)] if rows_apart and moe is None else []
    if fw.qkv_grad_cat and len(projs) == 1:  # q's, k's and v's gradients concatenated back (read, write)
        sum_qkv.append(mem(2.0 * ACT_BYTES * m * projs[0].n))
    mats = (*projs, out, *ups) + ((down,) if down is not None else ())
    casts = [mem(fw.weight_cast_bytes * g.k * g.n) for g in mats] if fw.weight_cast_bytes else []
    casts += [mem(fw.weight_cast_bytes * g.n) for g in biased] if fw.weight_cast_bytes else []
    # A sparse layer's other matrices: its router, and a shared expert's projections and gate.
    fs = spec.shared_expert_intermediate_size if moe is not None else 0
    sparse_mats = ([gemm(m, spec.experts, h)] + ([gemm(m, fs // tp, h)] * 2 + [gemm(m, h, fs // tp)] if fs else [])
                   + ([gemm(m, 1, h)] if fs and spec.shared_expert_gate else [])) if moe is not None else []
    if moe is not None and fw.weight_cast_bytes:
        casts.append(mem(fw.weight_cast_bytes * moe.active * 3 * h * moe.width,
                         3 * moe.active if fw.expert_gemms == "loop" else 1))  # one cast per matrix used
        casts += [mem(fw.weight_cast_bytes * g.k * g.n) for g in sparse_mats]
    # The stack's copies around each block's tensor-parallel collectives: a block's input is the
    # residual stream, its output the compute dtype. A sparse MLP makes its own (`eager_sparse_mlp`).
    copies_tp = tp_copies(fw, tp=tp, sp=sp, m=m, mn=mn, h=h, enter_bytes=stream_bytes(fw), exit_bytes=ACT_BYTES)
    enter_f, exit_f, exit_b, enter_b = copies_tp.enter_f, copies_tp.exit_f, copies_tp.exit_b, copies_tp.enter_b
    dense = moe is None
    mlp_f = (*(enter_f if dense else ()), *cast_up, *ups, *act_fwd) + ((down,) if down is not None else ()) + \
        tuple(exit_f if dense else ())
    fwd = (*casts, *norm_f, *enter_f, *cast_qkv, *projs, *qk_f, *rope_f, *att_f, out, *exit_f, *add_f, *norm_f, *mlp_f,
           *mlp_add_f)
    fused = fused_accum_bytes(fw)
    bwd: list[Kernel] = [*mlp_add_b, *(exit_b if dense else ()), *sum_down,
                         *(gemm_bwd(down, fused) if down is not None else ()), *act_bwd]
    for g in ups:
        bwd += gemm_bwd(g, fused)
    bwd += [*cast_up, *sum_up, *(enter_b if dense else ()), *norm_b, *add_b, *sum_out, *exit_b, *gemm_bwd(out, fused),
            *att_b, *rope_b, *qk_b]
    for g in projs:
        bwd += gemm_bwd(g, fused)
    bwd += [*cast_qkv, *sum_qkv, *enter_b, *norm_b]

    act = 2.0 * m * h  # one [s, b, h] activation, bytes
    # Per block (attention, MLP): forward, the column-parallel GEMM's input is all-gathered (sequence
    # parallel) and the row-parallel GEMM's output reduce-scattered, or the output all-reduced.
    # Backward, the row-parallel output's gradient is all-gathered (sequence parallel), and the
    # column-parallel GEMM's input gradient reduce-scattered or all-reduced, under its weight gradient.
    # Sequence parallel's backward all-gather of the saved input for the weight gradient overlaps
    # the input-gradient GEMM (Megatron-LM does it asynchronously), so it is not on the path.
    # A block's input is the norm's output in the stream's dtype (fp32 in the runtime, whose norms
    # keep it), its output the GEMM's (the compute dtype; the runtime's sparse MLP sums in fp32).
    enter = stream_bytes(fw) * m * h

    def block(wgrad: Kernel | None, out: float = act) -> tuple[tuple[Comm, ...], tuple[Comm, ...]]:
        if tp == 1:
            return (), ()
        if sp:
            return ((Comm("all_gather", enter, "tp"), Comm("reduce_scatter", out, "tp")),
                    (Comm("all_gather", out, "tp"), Comm("reduce_scatter", enter, "tp", under=wgrad)))
        return (Comm("all_reduce", out, "tp"),), (Comm("all_reduce", enter, "tp", under=wgrad),)

    block_f, block_b = block(gemm_bwd(qkv, fused)[1])
    eager = moe is not None and fw.moe_routing == "eager"
    mlp_cf, mlp_cb = block(gemm_bwd(ups[0], fused)[1] if ups else None,  # a sparse MLP's experts are not here
                           out=enter if eager else act)  # the runtime's routed sum is in the stream's dtype
    if moe is not None and moe.width == spec.expert_ffn and tp > 1:
        # Whole experts (etp = 1): each tensor-parallel rank routes its own 1/tp of the tokens, so the
        # MLP's tensor-parallel pair goes (sequence parallel: the tokens stay sharded) or becomes an
        # all-gather of the routed outputs; a shared expert keeps the dense MLP's collectives.
        shared = spec.shared_expert_intermediate_size
        mlp_cf = block_f if shared else ()
        mlp_cb = mlp_cb if shared else ()
        if not sp:
            mlp_cf += (Comm("all_gather", act, "tp"),)
            mlp_cb += (Comm("all_gather", act, "tp"),)
    fwd_comm = block_f + mlp_cf
    bwd_comm = mlp_cb + block_b  # the backward meets the MLP first
    if spec.qk_norm == "proj" and tp > 1:  # q's and k's sums of squares over the split projection
        fwd_comm += (Comm("all_reduce", 4.0 * m, "tp"),) * 2
        bwd_comm += (Comm("all_reduce", 4.0 * m, "tp"),) * 2
    if moe is not None and eager and sp and tp > 1 and moe.width != spec.expert_ffn:
        # The runtime gathers the top-k weights (the stream's dtype) and their int64 ids along the
        # sequence for its experts split over tp; backward reduce-scatters the weights' gradient.
        weights = stream_bytes(fw) * moe.routed * spec.num_experts_per_tok
        fwd_comm += (Comm("all_gather", weights, "tp"), Comm("all_gather", INDEX_BYTES * weights / stream_bytes(fw), "tp"))
        bwd_comm += (Comm("reduce_scatter", weights, "tp"),)
        if spec.shared_expert_gate:  # the shared expert's sigmoid gate, a compute-dtype value per token, likewise
            fwd_comm += (Comm("all_gather", ACT_BYTES * m, "tp"),)
            bwd_comm += (Comm("reduce_scatter", ACT_BYTES * m, "tp"),)
    if moe is not None and moe.a2a_bytes:
        dispatch = combine = Comm("all_to_all", moe.a2a_bytes, "ep", moe.a2a_leaving)  # the compute dtype
        if eager:  # the runtime: the counts per rank and the copies' int64 ids first; the copies in the stream's dtype
            grow = stream_bytes(fw) / ACT_BYTES
            dispatch = Comm("all_to_all", moe.a2a_bytes * grow, "ep",
                            None if moe.a2a_leaving is None else moe.a2a_leaving * grow)
            copies = moe.a2a_bytes / (ACT_BYTES * spec.hidden_size)
            fwd_comm += (Comm("all_to_all", INDEX_BYTES * moe.ep, "ep"), Comm("all_to_all", INDEX_BYTES * copies, "ep"))
        fwd_comm += (dispatch, combine)
        bwd_comm += (combine, dispatch)
    if kv_parallel:  # each share's max and (sum, weighted values) in fp32, all-reduced to combine them
        fwd_comm += (Comm("all_reduce", 4.0 * b * s * a / tp, "cp"), Comm("all_reduce", 4.0 * b * s * a * (d + 1) / tp, "cp"))
    elif cp > 1:
        kv_chunk = 2.0 * 2 * b * s_loc * kv * d / tp
        if fw.cp_comm == "all_gather":  # every chunk of K and V gathered; their gradients reduce-scattered
            fwd_comm += (Comm("all_gather", cp * kv_chunk, "cp"),)
            bwd_comm += (Comm("reduce_scatter", cp * kv_chunk, "cp"),)
        elif fw.cp_comm == "all_to_all":  # Ulysses: q, k, v to heads, the output back, each apart
            q_b, kv_b = ulysses_bytes(spec, b=b, s_loc=s_loc, tp=tp, cp=cp)
            heads = (Comm("all_to_all", q_b, "cp"), Comm("all_to_all", kv_b, "cp"), Comm("all_to_all", kv_b, "cp"))
            # verl all-gathers the position ids (int64) for flash attention's varlen form in each layer
            fwd_comm += (*heads, Comm("all_gather", INDEX_BYTES * b * s, "cp"), Comm("all_to_all", q_b, "cp"))
            bwd_comm += (Comm("all_to_all", q_b, "cp"), *heads)
        else:
            fwd_comm += (Comm("ring_p2p", (cp - 1) * kv_chunk, "cp"),)
            bwd_comm += (Comm("ring_p2p", 2 * (cp - 1) * kv_chunk, "cp"),)  # K, V and their gradients

    n_tensors = (12 if gpt else 9) + (3 if spec.attention_bias else 0) + (2 if spec.qk_norm != "none" else 0)
    if gpt and split:
        n_tensors += 4  # q, k and v apart: two more weights and two more biases than a fused QKV
    params = layer_params_per_rank(spec, tp, sparse=moe is not None)
    shared = moe is not None and bool(spec.shared_expert_intermediate_size)
    if moe is not None:
        n_tensors += 1 + (4 if shared else 0)
        if fw.moe_routing == "hf":  # transformers keeps every expert's gate and up in one tensor, downs in another
            n_tensors -= 1
    if fw.wgrad_accum_fused:
        # The matrices' (experts' too) weight gradients were added by their GEMMs above; the rest
        # (norms, biases, a router, a shared expert's gate) by a kernel each.
        n_tensors -= (4 if gpt else 7) + (3 if shared else 0)
        params -= layer_matrix_params(spec, sparse=moe is not None) / tp
    elif moe is not None:
        params += moe.active * 3 * h * moe.width  # only experts that got tokens have gradients to add
    stacked = 0.0
    if fw.weight_cast_bytes:  # each cast weight's gradient comes back through its cast's backward first
        n_tensors += len(mats) + len(biased) + len(sparse_mats)
        if moe is not None:
            n_tensors += 3 * moe.active if fw.expert_gemms == "loop" else 3
    if moe is not None and fw.expert_gemms == "loop" and not fw.wgrad_accum_fused:
        # The loop takes each expert's matrices apart (unbind), so the backward stacks their
        # gradients into the three expert tensors (read and write) before they are accumulated.
        n_tensors += 3
        stacked = 2.0 * fw.grad_bytes * moe.active * 3 * h * moe.width
    accum = mem(params * fw.grad_accum_bytes + stacked)
    return LayerWork(fwd, tuple(bwd), fwd_comm, bwd_comm, att_f, accum, n_tensors)


@dataclass(frozen=True)
class SparseMLP:
    fwd: tuple[Kernel, ...]
    bwd: tuple[Kernel, ...]


def sparse_mlp(spec: ModelSpec, fw: Framework, *, m: int, tp: int, moe: ExpertLoad, sp: bool = False) -> SparseMLP:
    """Kernels of a sparse MLP for `m` tokens on a rank (before the expert all-to-alls).

    Router logits (fp16) to an fp32 softmax and top-k (read 2 + write 4, then read 4 + write the k
    weights and indices); permuting the k copies of each routed token into expert order (read and
    write 2 bytes per element); the active experts' gate/up and down GEMMs as one grouped GEMM each
    at `moe.rows` rows; SwiGLU on their outputs; un-permuting, weighting and summing the k copies
    (read 2 per copy and element, write 2 per token and element). A shared expert is a dense
    SwiGLU MLP on all `m` tokens (tensor-parallel), scaled by a sigmoid gate where the model has one.
    """
    if fw.moe_routing == "eager":
        return eager_sparse_mlp(spec, fw, m=m, tp=tp, moe=moe, sp=sp)
    if fw.moe_routing == "hf":
        return hf_sparse_mlp(spec, fw, m=m, tp=tp, moe=moe)
    h, e, k = spec.hidden_size, spec.experts, spec.num_experts_per_tok
    t = moe.routed
    copies = float(t) * k * h
    router = gemm(t, e, h)
    n = moe.active
    down = gemm(moe.rows, h, moe.width, n)
    cells = float(moe.rows) * n * moe.width
    act_launches = 1
    if fw.expert_gemms == "loop":  # gate and up apart, every kernel once per expert, in turn
        ups = [launched(gemm(moe.rows, moe.width, h, n), n, True) for _ in range(2)]
        down, act_launches = launched(down, n, True), n
    elif fw.expert_gemms == "per_expert":
        ups, down = [launched(gemm(moe.rows, 2 * moe.width, h, n), n, False)], launched(down, n, False)
    else:
        ups = [gemm(moe.rows, 2 * moe.width, h, n)]
    fwd: list[Kernel] = [router, mem(10.0 * t * e), mem(4.0 * copies), *ups,
                         *[mem(x * cells, act_launches) for x in fw.swiglu_fwd or (6.0,)], down,
                         mem(2.0 * copies + 2.0 * t * h)]
    fused = fused_accum_bytes(fw)
    bwd: list[Kernel] = [mem(2.0 * copies + 4.0 * t * h), *gemm_bwd(down, fused),
                         *[mem(x * cells, act_launches) for x in fw.swiglu_bwd or (10.0,)],
                         *[g for u in ups for g in gemm_bwd(u, fused)], mem(4.0 * copies), mem(10.0 * t * e),
                         *gemm_bwd(router)]  # a plain parameter, not a Transformer Engine linear: not fused
    fs = spec.shared_expert_intermediate_size
    if fs:
        s_up, s_down = gemm(m, 2 * fs // tp, h), gemm(m, h, fs // tp)
        fwd += [s_up, *[mem(x * m * fs / tp) for x in fw.swiglu_fwd or (6.0,)], s_down]
        bwd += [*gemm_bwd(s_down, fused), *[mem(x * m * fs / tp) for x in fw.swiglu_bwd or (10.0,)],
                *gemm_bwd(s_up, fused)]
        if spec.shared_expert_gate:
            gate = gemm(m, 1, h)
            fwd += [gate, mem(6.0 * m * h)]
            bwd += [mem(6.0 * m * h), *gemm_bwd(gate)]
    return SparseMLP(tuple(fwd), tuple(bwd))


# Autograd's backward of the runtime's renormalised top-k weights, w / w.sum(-1): per kernel, bytes
# per (token copy, token): the quotient's gradient (div), the divisor's (div, neg, mul, div, sum
# over the copies) and the two summed (add).
RENORM_BWD = ((8.0, 4.0), (8.0, 4.0), (8.0, 0.0), (12.0, 0.0), (8.0, 4.0), (4.0, 4.0), (12.0, 0.0))
INDEX_BYTES = 8.0  # int64 expert ids and positions


def eager_sparse_mlp(spec: ModelSpec, fw: Framework, *, m: int, tp: int, moe: ExpertLoad,
                     sp: bool = False) -> SparseMLP:
    """The sparse MLP as the planner's runtime runs it (`Framework.moe_routing` "eager";
    `runtime/model._sparse_mlp` and `_experts`), kernel by kernel, bytes as
    `tests/test_kernel_inventory.py` records them (an index or weight vector read beside a much
    larger tensor is left out, as a broadcast operand is).

    Forward, on the `t` tokens the rank routes (its replica's: experts are split over tensor
    parallelism like the dense MLP), `c = t k` copies: the bf16 logits upcast (2+4 per logit),
    softmax (4+4), top-k (4), the top-k weights renormalised (a sum and a division), an argsort of
    the copies' int64 expert ids (8 in, 8 + 8 out), their tokens (a floor division, 8+8), a gather of
    the fp32 token copies (4 per element of the tokens read, 4 per copy written), the ids in that
    order (8+8+8) and their count per expert (8). With expert parallelism the counts per rank (a
    division and a count), the received copies put in expert order (two argsorts, a gather of the
    copies and of their ids, the ids made local) and the outputs back in arrival order (a gather).
    Each expert then casts its rows to bf16 for its gate and its up projection apart (`loop`,
    `input_cast_bytes` each), SwiGLU, and its down projection; its outputs are concatenated (2+2),
    the copies' weights gathered (4+8+4 per copy), each copy weighted into fp32 (2+4), and the
    copies summed back into a zero-filled fp32 tensor (a fill of 4; index_add reading the zeros,
    the copies and writing the sum, 4+4+4). Backward: each of those in reverse, the copies' gradient
    gathered from the tokens', the weights' gradient (a product over h and its sum), the copies'
    gradient (a product and its cast to bf16), each expert's SwiGLU and its two input casts'
    backward with their sum (4+4+4), the pieces concatenated back (4+4), the tokens' gradient summed
    from the copies (a fill and an index_add), the top-k's and renormalisation's (`RENORM_BWD`),
    the softmax's (4+4+4) and the upcast's (4+2), and the router's input gradient added to the
    experts' (4+4+4). The shared expert is a dense MLP as the runtime runs one: separate gate and up
    projections each casting its input, SwiGLU, the down projection, its output added to the
    routed one in fp32 (2+4+4), scaled first by a sigmoid gate where the model has one (a GEMM of
    one column on its own cast input; the product 2+2), with their backward.

    Under sequence parallelism (`sp`, tp > 1) the router and the top-k run on the rank's own
    chunk of the tokens; the top-k weights (fp32), their ids and the tokens are then gathered
    along the sequence and the fp32 sum reduce-scattered back, each through the stack's copies
    (`Framework.tp_copies`: two per collective, backward the reverse); without it the backward
    all-reduces of the tokens' and the weights' gradients clone them first."""
    h, e, k = spec.hidden_size, spec.experts, spec.num_experts_per_tok
    sb, ib, cast = fw.param_bytes, INDEX_BYTES, fw.input_cast_bytes
    sw_f, sw_b = fw.swiglu_fwd or (6.0,), fw.swiglu_bwd or (10.0,)  # a fused SwiGLU: one kernel each way
    t, n = float(moe.routed), moe.active
    c = t * k  # this rank's token copies
    recv = float(moe.rows) * n  # the copies its experts compute
    chunk = sp and tp > 1  # the router on this rank's chunk of the sequence
    t_r = t / tp if chunk else t
    c_r = t_r * k
    te = t_r * e
    router = gemm(moe.routed // tp if chunk else moe.routed, e, h)
    # The stack's copies around the collectives (`Framework.tp_copies`): forward the gathers of the
    # weights, the ids and the tokens, and the sum's reduce-scatter; backward the sum's gradient
    # gathered, the tokens' and the weights' reduce-scattered (or, without sp, cloned for their
    # all-reduce).
    copies = fw.tp_copies and tp > 1
    gathers_f = [mem(2.0 * sb * c_r), mem(2.0 * sb * c), mem(2.0 * ib * c_r), mem(2.0 * ib * c),
                 mem(2.0 * sb * t_r * h), mem(2.0 * sb * t * h)] if copies and chunk else []
    scatter_f = [mem(2.0 * sb * t * h), mem(2.0 * sb * t_r * h)] if copies and chunk else []
    scatter_b = [mem(2.0 * sb * t_r * h), mem(2.0 * sb * t * h)] if copies and chunk else []
    tokens_b = ([mem(2.0 * sb * t * h), mem(2.0 * sb * t_r * h)] if chunk else [mem(2.0 * sb * t * h)]) if copies else []
    weights_b = ([mem(2.0 * sb * c), mem(2.0 * sb * c_r)] if chunk else [mem(2.0 * sb * c)]) if copies else []
    cells = float(moe.rows) * n * moe.width
    # The runtime loops over its experts (`expert_gemms` "loop"); the same kernels issued otherwise
    # are launched as that trait says, elementwise ones once for all experts unless looped.
    each = {"loop": (n, True), "per_expert": (n, False)}.get(fw.expert_gemms, (1, False))
    ups = [launched(gemm(moe.rows, moe.width, h, n), *each) for _ in range(2)]
    down = launched(gemm(moe.rows, h, moe.width, n), *each)
    each_n = n if fw.expert_gemms == "loop" else 1  # launches of the experts' elementwise kernels
    renorm_f = [mem(4.0 * c_r + 4.0 * t_r), mem(8.0 * c_r + 4.0 * t_r)] if spec.norm_topk_prob else []
    renorm_b = [mem(a * c_r + b * t_r) for a, b in RENORM_BWD] if spec.norm_topk_prob else []
    exchange_f: list[Kernel] = []  # before the experts
    back_f: list[Kernel] = []  # after them
    back_b: list[Kernel] = []  # backward of `back_f`
    exchange_b: list[Kernel] = []  # backward of `exchange_f`
    if moe.a2a_bytes:  # expert parallel: counts per rank, the arrivals sorted by expert, and back
        exchange_f = [mem(2.0 * ib * c), mem(ib * c), mem(3.0 * ib * recv), mem(3.0 * ib * recv),
                      mem(2.0 * sb * recv * h), mem(3.0 * ib * recv), mem(2.0 * ib * recv)]
        back_f = [mem(2.0 * ACT_BYTES * recv * h)]  # the outputs in arrival order (bf16)
        # Each gather's gradient summed back into a zero-filled tensor: a fill and an index_add.
        back_b = [mem(ACT_BYTES * recv * h), mem(3.0 * ACT_BYTES * recv * h)]
        exchange_b = [mem(sb * recv * h), mem(3.0 * sb * recv * h)]
    in_casts = [mem(cast * recv * h, each_n)] * 2 if cast else []
    fwd: list[Kernel] = [router, mem(6.0 * te), mem(8.0 * te), mem(4.0 * te), *renorm_f, *gathers_f, mem(3.0 * ib * c),
                         mem(2.0 * ib * c), mem(sb * t * h + sb * c * h), mem(3.0 * ib * c), *exchange_f,
                         mem(ib * recv), *in_casts[:1], ups[0], mem(sw_f[0] * cells, each_n), *in_casts[1:],
                         ups[1], *[mem(x * cells, each_n) for x in sw_f[1:]], down,
                         mem(2.0 * ACT_BYTES * recv * h), *back_f, mem(16.0 * c),
                         mem((ACT_BYTES + sb) * c * h), mem(sb * t * h), mem(sb * (2.0 * t + c) * h), *scatter_f]
    fused = fused_accum_bytes(fw)
    bwd: list[Kernel] = [*scatter_b, mem(sb * t * h + sb * c * h), mem((2.0 * sb + ACT_BYTES) * c * h),
                         mem(2.0 * sb * c * h),
                         mem((sb + ACT_BYTES) * c * h), mem(sb * c * h), mem(4.0 * c), mem(20.0 * c),
                         *back_b, *gemm_bwd(down, fused),
                         *[mem(x * cells, each_n) for x in sw_b[:2]], *in_casts[1:], *gemm_bwd(ups[1], fused),
                         *[mem(x * cells, each_n) for x in sw_b[2:]], *in_casts[:1], *gemm_bwd(ups[0], fused),
                         mem(3.0 * sb * recv * h, each_n), mem(2.0 * sb * recv * h), *exchange_b, mem(sb * t * h),
                         mem(sb * (2.0 * t + c) * h), *tokens_b, *weights_b, *renorm_b, mem(4.0 * te), mem(8.0 * te),
                         mem(12.0 * te), mem(6.0 * te), *gemm_bwd(router), mem(3.0 * sb * t_r * h)]
    fs = spec.shared_expert_intermediate_size
    if fs:
        mt = float(m)
        s_ups = [gemm(m, fs // tp, h)] * 2
        s_down = gemm(m, h, fs // tp)
        s_cells = mt * fs / tp
        s_cast = [mem(cast * mt * h)] if cast else []
        fwd += [*s_cast, s_ups[0], mem(sw_f[0] * s_cells), *s_cast, s_ups[1],
                *[mem(x * s_cells) for x in sw_f[1:]], s_down]
        # Its gate and up projections' input gradients summed, then with the routed copies'.
        s_bwd = [*gemm_bwd(s_down, fused), *[mem(x * s_cells) for x in sw_b[:2]], *s_cast,
                 *gemm_bwd(s_ups[1], fused), *[mem(x * s_cells) for x in sw_b[2:]], *s_cast,
                 *gemm_bwd(s_ups[0], fused), mem(3.0 * sb * mt * h), mem(3.0 * sb * mt * h)]
        if spec.shared_expert_gate:  # sigmoid of one value per token: a kernel, no bytes that count
            # on the rank's chunk under sequence parallel, gathered like the top-k weights
            g_m = m // tp if chunk else m
            g_cast = [mem(cast * g_m * h)] if cast else []
            gate = gemm(g_m, 1, h)
            g_f = [mem(0.0), mem(2.0 * ACT_BYTES * mt)] if copies and chunk else []
            g_b = ([mem(2.0 * ACT_BYTES * mt), mem(0.0)] if chunk else [mem(0.0)]) if copies else []
            fwd += [*g_cast, gate, mem(0.0), *g_f, mem(2.0 * ACT_BYTES * mt * h)]
            # The product's two gradients (the shared output's, and the gate's summed over h), the
            # sigmoid's, the gate's input cast and its input gradient joining the others.
            s_bwd = [mem(2.0 * ACT_BYTES * mt * h), mem(3.0 * ACT_BYTES * mt * h), mem(ACT_BYTES * mt * h), *g_b,
                     mem(0.0), *s_bwd, *gemm_bwd(gate), *g_cast, mem(3.0 * sb * g_m * h)]
        fwd.append(mem((ACT_BYTES + 2.0 * sb) * mt * h))
        bwd = [mem((sb + ACT_BYTES) * mt * h), *s_bwd, *bwd]
    return SparseMLP(tuple(fwd), tuple(bwd))


def hf_sparse_mlp(spec: ModelSpec, fw: Framework, *, m: int, tp: int, moe: ExpertLoad) -> SparseMLP:
    """The sparse MLP as transformers 5.25 trains it on bf16 weights (`Framework.moe_routing` "hf":
    the family's ``TopKRouter`` and its default experts implementation, ``grouped_mm_experts_forward``
    in ``integrations/moe.py``), kernel by kernel, bytes as `tests/test_kernel_inventory.py`
    records them against transformers' own blocks.

    Forward, on the `t` tokens the rank routes, `c = t k` copies: the router's logits upcast (2+4
    per logit), softmax (4+4), top-k (4); where the top-k is renormalised its sum (4 per copy, 4
    per token), a clone (4+4) and the in-place division (4+4+4); the weights cast back to bf16
    (4+2) except in Mixtral, whose fp32 weights then scale the copies, so that the weighted copies,
    their gather and their sum are fp32; a sort of the copies' int64 expert ids (8 in, 8 + 8
    out), their tokens (a floor division, 8+8), a gather of the token copies (2+2 per element),
    and of their weights, the ids cast to int32 (8+4) and counted per expert (``histc``, 4) and
    summed (``cumsum``, a value per expert); one grouped GEMM for every expert's gate and up
    projections, SwiGLU (the stack's kernels on the gate half), one grouped GEMM for the down
    projections; the copies weighted (2 + the weights' dtype in, the product's out), the inverse
    permutation (``arange`` 8, ``index_put_`` of the ids 8+8), the weighted copies gathered back
    into token order and summed over the k per token (reshape + sum, read c, write t), Mixtral's
    fp32 sum cast to bf16 (4+2). Backward: Mixtral's gradient upcast (2+4); the summed copies'
    gradient made contiguous from its broadcast (read and write c), the gather's backward into a
    zero-filled tensor (a fill, then an accumulating ``index_put`` reading the copies and reading
    and writing their places), the weights' gradient (the product with the expert outputs, summed
    over h) and the outputs' (the product with the weights; cast to bf16 in Mixtral), SwiGLU's
    backward, the gate and up gradients concatenated (2+2), the weights' gather and the tokens'
    gather scattered back the same way, Qwen's weight gradient upcast (2+4), the renormalisation's
    backward (`RENORM_BWD`), top-k's (a fill and a scatter of the logits' size), the softmax's
    (4+4+4), the upcast's (4+2), and the router's input gradient added to the experts' (2+2+2).

    The shared expert (Qwen2-MoE) is HF's MLP on all `m` tokens: gate, up and down projections,
    SwiGLU, the routed output added (2+2+2); with its sigmoid gate (a GEMM of one column, a value
    per token) the product (2+2), backward the product's two gradients, the gate's sum over h and
    the input gradients of the gate, gate and up projections each added to the others.

    On a GPU the sort (CUB's radix sort) and each accumulating ``index_put`` (sorted indices
    first) launch a few kernels each where a CPU records one; those tensors hold a few bytes per
    copy. Expert parallelism is priced with these kernels and the stack's all-to-alls, though the
    HF engines (verl's FSDP workers, OpenRLHF on DeepSpeed) shard experts with FSDP instead."""
    h, e, k = spec.hidden_size, spec.experts, spec.num_experts_per_tok
    sb, ib = ACT_BYTES, INDEX_BYTES
    sw_f, sw_b = fw.swiglu_fwd or (6.0,), fw.swiglu_bwd or (10.0,)
    mixtral = spec.hf_model_type == "mixtral"
    w = 4.0 if mixtral else sb  # the routing weights as they scale the copies
    wo = max(w, sb)  # the weighted copies
    t = float(moe.routed)
    c, te = t * k, t * e
    n = moe.active
    cells = float(moe.rows) * n * moe.width
    router = gemm(moe.routed, e, h)
    ups, down = gemm(moe.rows, 2 * moe.width, h, n), gemm(moe.rows, h, moe.width, n)
    renorm_f = [mem(4.0 * c + 4.0 * t), mem(8.0 * c), mem(8.0 * c + 4.0 * t)] if spec.norm_topk_prob else []
    renorm_b = [mem(a * c + b * t) for a, b in RENORM_BWD] if spec.norm_topk_prob else []
    cast_w = [] if mixtral else [mem(6.0 * c)]
    fwd: list[Kernel] = [router, mem(6.0 * te), mem(8.0 * te), mem(4.0 * te), *renorm_f, *cast_w, mem(3.0 * ib * c),
                         mem(2.0 * ib * c), mem(2.0 * sb * c * h), mem(2.0 * w * c), mem(12.0 * c), mem(4.0 * c),
                         mem(0.0), ups, mem(sw_f[0] * cells), *[mem(x * cells) for x in sw_f[1:]], down,
                         mem((sb + wo) * c * h), mem(ib * c), mem(2.0 * ib * c), mem(2.0 * wo * c * h),
                         mem(wo * (c + t) * h), *([mem((wo + sb) * t * h)] if mixtral else [])]
    bwd: list[Kernel] = [*([mem((sb + wo) * t * h)] if mixtral else []), mem(2.0 * wo * c * h), mem(wo * c * h),
                         mem(3.0 * wo * c * h), mem((2.0 * wo + sb) * c * h), mem(2.0 * wo * c * h),
                         *([mem((wo + sb) * c * h)] if mixtral else []), mem(wo * c * h), *gemm_bwd(down),
                         *[mem(x * cells) for x in sw_b], mem(4.0 * sb * cells), *gemm_bwd(ups),
                         mem(w * c), mem(3.0 * w * c), mem(sb * t * h), mem(3.0 * sb * c * h), *cast_w, *renorm_b,
                         mem(4.0 * te), mem(8.0 * te), mem(12.0 * te), mem(6.0 * te), *gemm_bwd(router),
                         mem(3.0 * sb * t * h)]
    fs = spec.shared_expert_intermediate_size
    if fs:
        mt = float(m)
        s_cells = mt * fs / tp
        s_ups, s_down = [gemm(m, fs // tp, h)] * 2, gemm(m, h, fs // tp)
        fwd = [*s_ups, *[mem(x * s_cells) for x in sw_f], s_down, *fwd]
        s_bwd = [*gemm_bwd(s_down), *[mem(x * s_cells) for x in sw_b], *gemm_bwd(s_ups[1]), *gemm_bwd(s_ups[0]),
                 *[mem(3.0 * sb * mt * h)] * 2]  # the up and gate projections' input gradients joining the rest
        gate_f: list[Kernel] = []
        gate_b: list[Kernel] = []
        if spec.shared_expert_gate:
            gate = gemm(m, 1, h)
            gate_f = [gate, mem(0.0), mem(2.0 * sb * mt * h)]  # sigmoid of a value per token, the product
            gate_b = [mem(2.0 * sb * mt * h), mem(3.0 * sb * mt * h), mem(sb * mt * h), mem(0.0), *gemm_bwd(gate),
                      mem(3.0 * sb * mt * h)]
        fwd += [*gate_f, mem(3.0 * sb * mt * h)]
        bwd = [*gate_b, *bwd, *s_bwd]
    return SparseMLP(tuple(fwd), tuple(bwd))


def final_norm(spec: ModelSpec, fw: Framework, rows: int) -> tuple[list[Kernel], list[Kernel]]:
    """The final norm over `rows` tokens, forward and backward: the stack's norm kernels, as its
    layers run them."""
    h = spec.hidden_size
    nf, nb = fw.layernorm if spec.model_type == "gpt" and fw.layernorm else (fw.norm_fwd, fw.norm_bwd)
    return [mem(x * rows * h) for x in nf], [mem(x * rows * h) for x in nb]


def ends_accum(fw: Framework, elements: float) -> Kernel:
    """One end tensor's micro-batch gradient (`elements` on the rank) added into the gradient
    buffer: the stack's accumulation kernel, less the cast of the gradient back to the weights'
    dtype where the weights are cast for compute (`Framework.weight_cast_bytes`), which a table, a
    norm and the runtime's fused head (fp32 sums) do not need."""
    return mem(elements * (fw.grad_accum_bytes - fw.weight_cast_bytes))


@lru_cache(maxsize=4096)
def head_work(spec: ModelSpec, fw: Framework, *, head: Head, b: int, s: int, tp: int, cp: int, sp: bool,
              loss: bool) -> tuple[tuple[Kernel, ...], tuple[Kernel, ...]]:
    """Final norm, output head and loss (forward, backward) for one micro-batch on the last stage,
    the micro-batch's gradients of the norm and the head added into the gradient buffer."""
    h, v = spec.hidden_size, spec.vocab_size
    m = b * (s // cp)
    mn = m // tp if sp else m
    norm_f, norm_b = final_norm(spec, fw, mn)
    norm_acc = [ends_accum(fw, h)] * (2 if spec.model_type == "gpt" else 1)  # weight (and bias)
    if head == "value":
        g = gemm(mn if fw.runtime_ends else m, 1, h)  # the runtime scores its own chunk under sp
        # Under autocast the scores' input is cast to bf16 and its gradient back; the [1, h] weight
        # likewise (a value per hidden unit), its gradient then added.
        cast = [mem(fw.input_cast_bytes * mn * h)] if fw.input_cast_bytes else []
        w_cast = [mem(fw.weight_cast_bytes * h)] if fw.weight_cast_bytes else []
        acc = [mem(fw.grad_accum_bytes * h, 2 if fw.weight_cast_bytes else 1)]
        # The runtime's values upcast to fp32 (one per token), and under sequence parallel gathered
        # along the sequence (a copy in and out of the all-gather; backward the rank's chunk copied).
        up_f = ([mem(0.0, 3 if sp and tp > 1 else 1)]) if fw.runtime_ends else []
        up_b = ([mem(0.0, 2 if sp and tp > 1 else 1)]) if fw.runtime_ends else []
        return (*norm_f, *cast, *w_cast, g, *up_f), (*up_b, *gemm_bwd(g), *cast, *norm_b, *acc, *norm_acc)
    vt = -(-v // tp)
    weight = float(vt) * h
    if fw.runtime_ends:
        return _runtime_lm_head(spec, fw, m=m, mn=mn, tp=tp, sp=sp, loss=loss, norm=(norm_f, norm_b),
                                norm_acc=norm_acc)
    g = gemm(m, vt, h)
    logits = float(m) * v / tp
    fwd = (*norm_f, g, *[mem(x * logits) for x in (fw.loss_fwd if loss else (LOGPROB_BYTES,))])
    chunk = fw.logits_chunk_elements
    again = (g,) if chunk is not None and logits > chunk else ()  # each chunk's logits made again
    fused = fused_accum_bytes(fw)
    acc = [] if fused else [ends_accum(fw, weight)]  # the head's weight gradient, where no GEMM adds it
    bwd = (*again, *[mem(x * logits) for x in fw.loss_bwd], *gemm_bwd(g, fused), *norm_b, *acc, *norm_acc)
    return fwd, bwd


def _runtime_lm_head(spec: ModelSpec, fw: Framework, *, m: int, mn: int, tp: int, sp: bool, loss: bool,
                     norm: tuple[list[Kernel], list[Kernel]], norm_acc: list[Kernel]) -> tuple[
                         tuple[Kernel, ...], tuple[Kernel, ...]]:
    """The runtime's LM head (`runtime.model.token_logprobs`, `tensor_parallel.head_logprobs`) as
    it launches its kernels: every position's next token looked up (arange, +1, clamp,
    index_select; the last position's prediction dropped after), the weight cast to bf16 once per
    call and direction, and per chunk of at most `Framework.logits_chunk_elements` logits: the
    chunk's hidden states cast, the GEMM, the logits upcast to fp32 (2+4), then with one rank a
    log-softmax (4+4) and two picks and a subtraction per token; over a tensor-parallel group the
    max (4), the shift (4+4), exp (4+4) and sum (4), thirteen kernels on per-token values (the sums
    and picked logits stacked for one all-reduce among them) and two all-reduces of them (not
    priced: a few bytes per token). Backward: the weight cast again, then either
    - where one chunk held every logit, or the rank has no more vocabulary rows than tokens, a run
      of tokens at a time: an fp32 weight-gradient sum zeroed (4), per chunk the hidden states cast,
      the logits made again unless kept (then the log-softmax is), the softmax in place (exp 4+4,
      shifted first over a group 4+4), times the output gradient (4+4), the targets' ones added
      (nine kernels on per-token values), the gradient cast to bf16 (4+2), the input-gradient GEMM
      copied into the fp32 result (2+4), and the weight-gradient GEMM's bf16 product added into the
      fp32 sum (2+4+4);
    - or a slice of the vocabulary at a time over every token: the hidden states cast once, an fp32
      input-gradient sum zeroed (4), per slice the logits made again and upcast (2+4), shifted by
      the kept log-sum-exp (4+4), exponentiated (4+4), times the output gradient (4+4), the
      targets' ones added (nine per-token kernels), cast to bf16 (4+2), the input-gradient GEMM's
      product added into the fp32 sum (2+4+4), and the slice's weight gradient written once (2+4).
    Per-token kernels move no bytes that count."""
    h, v = spec.hidden_size, spec.vocab_size
    vt = -(-v // tp)
    weight = float(vt) * h
    norm_f, norm_b = norm
    stream = stream_bytes(fw)  # the hidden states enter the column-parallel head as a layer's block
    copies_tp = tp_copies(fw, tp=tp, sp=sp, m=m, mn=mn, h=h, enter_bytes=stream, exit_bytes=ACT_BYTES)
    enter_f, enter_b = copies_tp.enter_f, copies_tp.enter_b
    chunks = head_chunks(fw, m=m, vt=vt)
    kept = loss and len(chunks) == 1
    cast_in = stream + ACT_BYTES

    def per_chunk(r: int) -> tuple[list[Kernel], list[Kernel]]:
        lg = float(r) * vt
        g = gemm(r, vt, h)
        make = [mem(cast_in * r * h), g, mem((ACT_BYTES + 4.0) * lg)]
        if tp == 1:
            pick = [mem(8.0 * lg), mem(0.0, 3)]
            keep = [mem(8.0 * lg)]  # log-softmax, made again when not kept
            soft = [mem(8.0 * lg)]
        else:
            pick = [mem(4.0 * lg), mem(8.0 * lg), mem(8.0 * lg), mem(4.0 * lg), mem(0.0, 13)]
            keep = []
            soft = [mem(8.0 * lg), mem(8.0 * lg)]
        f = [*make, *pick]
        again = [] if kept else [g, mem((ACT_BYTES + 4.0) * lg), *keep]
        dgrad, wgrad = gemm_bwd(g)
        bwd = [mem(cast_in * r * h), *again, *soft, mem(0.0), mem(8.0 * lg), mem(0.0, 9), mem((4.0 + ACT_BYTES) * lg),
               dgrad, mem((ACT_BYTES + stream) * r * h), wgrad, mem((ACT_BYTES + 8.0) * weight)]
        return f, bwd

    fwd: list[Kernel] = [*norm_f, *enter_f, mem(0.0, 4), mem(fw.weight_cast_bytes * weight)]
    bwd: list[Kernel] = [mem(0.0, 2), mem(fw.weight_cast_bytes * weight)]
    by_vocabulary = not kept and m < vt
    if by_vocabulary:
        bwd += [mem(0.0), mem(cast_in * m * h), mem(4.0 * m * h), mem(0.0)]  # ids in the block, h cast, dh, -grad
        cols = max(1, (fw.logits_chunk_elements or m * vt) // m)
        for c in [min(cols, vt - v0) for v0 in range(0, vt, cols)]:
            lg = float(m) * c
            g = gemm(m, c, h)
            dgrad, wgrad = gemm_bwd(g)
            bwd += [g, mem((ACT_BYTES + 4.0) * lg), mem(8.0 * lg), mem(8.0 * lg), mem(8.0 * lg), mem(0.0, 9),
                    mem((4.0 + ACT_BYTES) * lg), dgrad, mem((ACT_BYTES + 8.0) * m * h), wgrad,
                    mem((ACT_BYTES + 4.0) * c * h)]
    else:
        bwd.append(mem(4.0 * weight))  # the weight gradient's fp32 sum, zeroed
    for r in chunks:
        f, bw = per_chunk(r)
        fwd += f  # inference runs the same forward, under no_grad
        if not by_vocabulary:
            bwd += bw
    fwd += [mem(0.0, 2 if len(chunks) > 1 else 1)]  # the chunks' log-sum-exps (and log-probs) concatenated
    bwd += [ends_accum(fw, weight), *enter_b, *norm_b, *norm_acc]
    return tuple(fwd), tuple(bwd)


def head_chunks(fw: Framework, *, m: int, vt: int) -> list[int]:
    """Tokens in each chunk of the runtime's LM head: at most `Framework.logits_chunk_elements`
    logits of the rank's `vt` vocabulary rows at a time, at least one token."""
    rows = max(1, (fw.logits_chunk_elements or m * vt) // vt)
    return [min(rows, m - lo) for lo in range(0, m, rows)]


def lookup_comm(spec: ModelSpec, fw: Framework, *, b: int, s: int, tp: int, cp: int, sp: bool) -> tuple[
        tuple[Comm, ...], tuple[Comm, ...]]:
    """The vocabulary-parallel lookup's collectives for one micro-batch (forward, backward): its
    rows summed over the group in the table's dtype, under sequence parallelism reduce-scattered
    along the sequence (backward all-gathered), else all-reduced (backward nothing)."""
    if tp == 1:
        return (), ()
    table = fw.param_bytes * b * (s // cp) * spec.hidden_size
    if sp:
        return (Comm("reduce_scatter", table, "tp"),), (Comm("all_gather", table, "tp"),)
    return (Comm("all_reduce", table, "tp"),), ()


def head_comm(spec: ModelSpec, fw: Framework, *, head: Head, b: int, s: int, tp: int, cp: int, sp: bool) -> tuple[
        tuple[Comm, ...], tuple[Comm, ...]]:
    """The head's collectives for one micro-batch (forward, backward). The column-parallel LM head
    takes the hidden states as a block's input, in the stream's dtype: under sequence parallelism
    all-gathered (backward the input gradient reduce-scattered), else backward all-reduced, under
    its weight gradient where the stack overlaps them (`Framework.tp_dgrad_overlap`: Megatron's
    output layer is a column-parallel linear too). Its log-probabilities assemble the group's
    maximum (an fp32 value per token, all-reduced) and sums of exponentials with the targets'
    logits (two, all-reduced together; Megatron's unfused cross entropy reduces them one at a
    time), per chunk of the runtime's logits. The runtime's value head is replicated: each rank
    scores its own tokens, and under sequence parallelism the fp32 values are all-gathered
    (backward each rank takes its own)."""
    if tp == 1:
        return (), ()
    m = b * (s // cp)
    if head == "value" and fw.runtime_ends:
        return ((Comm("all_gather", 4.0 * m, "tp"),) if sp else ()), ()
    enter = stream_bytes(fw) * m * spec.hidden_size
    vt = -(-spec.vocab_size // tp)
    wgrad = gemm_bwd(gemm(m, vt, spec.hidden_size), fused_accum_bytes(fw))[1]
    fwd: tuple[Comm, ...]
    fwd, bwd = ((Comm("all_gather", enter, "tp"),), (Comm("reduce_scatter", enter, "tp", under=wgrad),)) if sp \
        else ((), (Comm("all_reduce", enter, "tp", under=wgrad),))
    if head == "lm":
        unfused = fw.loss_fwd == UNFUSED_CROSS_ENTROPY[0]
        for r in head_chunks(fw, m=m, vt=vt) if fw.runtime_ends else [m]:
            fwd += (Comm("all_reduce", 4.0 * r, "tp"),) * 3 if unfused else \
                (Comm("all_reduce", 4.0 * r, "tp"), Comm("all_reduce", 8.0 * r, "tp"))
    return fwd, bwd


def sample_comm(spec: ModelSpec, fw: Framework, *, rows: int, tp: int) -> tuple[Comm, ...]:
    """Choosing each row's next token over a vocabulary-parallel group. The runtime
    (`runtime.generate`): every rank's best score and its id, two fp64 values per row,
    all-gathered (`tensor_parallel.vocab_choose`), then the token's log-probability from the
    group's maximum and sums (one fp32 value per row all-reduced, then two). vLLM
    (`Framework.logits_all_gather`): the rows' logits all-gathered in the compute dtype. Other
    stacks do not generate here."""
    if tp == 1:
        return ()
    if fw.runtime_ends:
        return (Comm("all_gather", 16.0 * rows * tp, "tp"), Comm("all_reduce", 4.0 * rows, "tp"),
                Comm("all_reduce", 8.0 * rows, "tp"))
    if fw.logits_all_gather:
        return (Comm("all_gather", float(ACT_BYTES) * rows * -(-spec.vocab_size // tp) * tp, "tp"),)
    return ()


@lru_cache(maxsize=4096)
def embedding_work(spec: ModelSpec, fw: Framework, *, b: int, s: int, tp: int, cp: int, sp: bool = False) -> tuple[
        tuple[Kernel, ...], tuple[Kernel, ...]]:
    """Token (and position) embedding lookup forward and backward on the first stage, the tables'
    micro-batch gradients added into the gradient buffer. A table holds the weights' dtype: a
    lookup reads and writes rows of it, its backward zero-fills a dense gradient of the whole table
    and index-adds the rows (read the incoming gradient, read and write the rows)."""
    h = spec.hidden_size
    pb = fw.param_bytes
    s_loc = s // cp
    m = b * s_loc
    table = float(-(-spec.vocab_size // tp)) * h
    fwd = [mem(2.0 * pb * m * h)]  # gather rows (read + write)
    bwd = [mem(pb * table), mem(3.0 * pb * m * h)]
    mn, s_pos = (m // tp, s_loc // tp) if sp else (m, s_loc)  # the rows the stream holds after the lookup
    if fw.runtime_ends and tp > 1:
        # Ids outside the rank's vocabulary block masked (five kernels on ids), their rows zeroed
        # after the lookup, then reduced over the group as a block's output (`tp_copies`, here in
        # the table's dtype): under sequence parallel a reduce-scatter, backward an all-gather.
        out = tp_copies(fw, tp=tp, sp=sp, m=m, mn=mn, h=h, enter_bytes=pb, exit_bytes=pb)
        fwd = [mem(0.0, 5), *fwd, mem(2.0 * pb * m * h), *out.exit_f]
        bwd = [*out.exit_b, mem(2.0 * pb * m * h), *bwd]
    acc = [ends_accum(fw, table)]
    if spec.model_type == "gpt":
        positions = float(spec.max_position_embeddings) * h
        if fw.runtime_ends:  # looked up once per position, broadcast over the batch; backward summed over it
            fwd += [mem(2.0 * pb * s_pos * h), mem(2.0 * pb * mn * h)]
            bwd = [mem(pb * mn * h), mem(pb * positions), mem(3.0 * pb * s_pos * h), *bwd]
        else:  # looked up per token, added (+ dropout)
            fwd += [mem(2.0 * pb * m * h), mem((7 if fw.dropout else 6) * m * h)]
            bwd = [*bwd, mem(pb * positions), mem(3.0 * pb * m * h)]
        acc.append(ends_accum(fw, positions))
    return tuple(fwd), (*bwd, *acc)
