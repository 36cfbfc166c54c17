"""Software-stack traits: discrete implementation choices that change which kernels run.

Coefficients (`cost_models.calibration`) say how fast a GPU runs a kernel; a `Framework` says which
kernels a training step launches and which bytes it keeps. Seven presets:

- ``megatron``: Megatron-LM's GPT pretraining as the vTrain measurements ran it, on Microsoft's
  Megatron-DeepSpeed fork (the vTrain repository's ``data/README.md``; Megatron-LM's layers on
  DeepSpeed's engine): attention scores materialised (baddbmm, fused scale-mask-softmax, dropout,
  bmm), hidden and attention dropout, fp16 gradients accumulated per micro-batch by a kernel of
  their own (the fork's layers have had gradient-accumulation fusion commented out since 2023-04,
  ``megatron/core/tensor_parallel/layers.py``; vTrain's image runs PyTorch 2.0.1, of 2023-05) and
  all-reduced after the last backward (no bucketing, so no overlap with backward),
  mixed-precision Adam, Megatron's unfused vocab-parallel cross entropy over fp32 logits
  (``loss_fwd`` / ``loss_bwd``: ``UNFUSED_CROSS_ENTROPY``); like every Megatron stack, each column-parallel GEMM's input-gradient
  collective runs under its weight gradient (``tp_dgrad_overlap``; the fork's layers issue it
  asynchronously too), which the runtime does not do.
- ``megatron-core``: Megatron-Core with Transformer Engine and stacks built like it: fused kernels,
  flash attention, bf16 weights beside fp32 master weights and fp32 gradients that the
  weight-gradient GEMMs add into themselves (``wgrad_accum_fused``), communication overlapped,
  and Megatron's unfused cross entropy (``--cross-entropy-loss-fusion`` is off by default).
- ``rlhf-engine``: verl and OpenRLHF: ``megatron-core``'s training (but each micro-batch's weight
  gradients added by a kernel of their own, as verl's Megatron backend runs unless told, and a
  fused loss, as verl's FSDP backend computes log-probs with flash-attention's cross entropy; its
  Megatron backend calls Megatron's unfused one) and vLLM's rollouts; as verl's Megatron workers
  run them (their layouts).
- ``rlhf-engine-hf``: OpenRLHF: HF transformers layers as they run eagerly, trained on DeepSpeed
  ZeRO-3, ring attention for context parallel, vLLM's rollouts; ``verl-fsdp``: the same layers
  as verl's FSDP workers train them, Ulysses for context parallel, every call on verl's one pool.
- ``vllm``: vLLM's generation (bf16 weights, fused kernels, CUDA-graph decode), the rollout
  engine of verl and OpenRLHF exports.
- ``torch``: the planner's runtime (`runtime/`) as it is written: PyTorch's fused (flash) causal
  attention, no dropout, fp32 weights, gradients and Adam states in one flat buffer under bf16
  autocast, so every matmul weight is cast to bf16 on each forward pass and every weight gradient
  cast back and accumulated in fp32; the residual stream stays fp32, and RMSNorm, rotary
  embedding and residual adds run as separate eager kernels (`runtime/model.py`); gradients are
  reduced in fp32 buckets during the last backward (all-reduced under ZeRO-1, summed on their
  owner under ZeRO-2, whose step then gathers the buffer from a copy of each rank's part), and
  ZeRO-3 gathers one use ahead and keeps what it gathered until the backward; a rank's
  routed experts run one by one in a Python loop (`expert_gemms="loop"`). Not yet
  calibrated on a GPU (`bench/gpu_check.sh` measures it): its GEMM and bandwidth efficiencies
  are those fitted on vTrain's Megatron-DeepSpeed runs, its attention (PyTorch's default fused attention,
  FlashAttention-2) runs at FlashAttention-2's published speed by head dim and length, never above
  the low end of its published share of the peak (`UNCALIBRATED_ATTENTION_SHARE`: 50% on an A100,
  35% on an H100), and the kernels are its own.

A stack that stands for other engines (verl, OpenRLHF, vLLM) also says which layouts they run
(`Framework.layouts`, `EngineLayouts`), and the search keeps its plans to them
(`engine_layout_problems`, `planner.candidates.runnable_layouts`).

Every stack with fused attention times it at its kernel's published speed by head dim and length
(`Framework.attention_kernels`, `cost_models.attention`): short sequences run well below long ones.

The byte counts of the eager kernels follow the ops `runtime/model.py` runs, per element:
RMSNorm on an fp32 input: ``pow`` (4+4), ``mean`` (4), ``x * rsqrt`` (4+4), cast to bf16 (4+2),
times the fp32 weight (2+4) and autocast's cast for the next matmul (4+2): 38 bytes in six
kernels, its backward about twice that; a residual add of a bf16 branch to the fp32 stream (2+4+4),
backward a cast and an accumulation (6 + 12); rotary embedding on q and k: roll, two products and a
sum (4+4+4+6), as much backward; SwiGLU as ``silu`` (2+2) and a product (2+2+2), backward the
product's two gradients and silu's (3 x 6); the attention output's transpose back to [b, s, h]
(2+2), forward and backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from plans.errors import PlannerError

if TYPE_CHECKING:
    from plans.layout import Layout

AttentionImpl = Literal["flash", "materialized"]
MoeDispatch = Literal["alltoall", "deepep"]
ExpertGemms = Literal["grouped", "per_expert", "loop"]
CpComm = Literal["ring", "all_gather", "all_to_all"]
LayerActivations = Literal["fused", "autocast", "hf"]


@dataclass(frozen=True)
class QkNormKernels:
    """A stack's norm of q or k written out in eager kernels: bytes per element of q (or k) of
    each kernel on the elements, and bytes per normalised row of each kernel on the rows'
    statistics (a value per row; they move no bytes that count where a row is a token, as a
    hidden norm's do not), forward and backward. `out_fp32`: the norm hands q and k on in fp32
    (an fp32 weight times the bf16 normalised values), so rotary runs on fp32 and the attention
    casts them to bf16 (4+2, backward 2+4)."""

    fwd: tuple[float, ...]
    fwd_rows: tuple[float, ...]
    bwd: tuple[float, ...]
    bwd_rows: tuple[float, ...]
    out_fp32: bool = False


@dataclass(frozen=True)
class EngineLayouts:
    """The layouts the engines a stack stands for can run, which the search keeps to: a plan
    costed for a stack holds only layouts its engines take (the defaults: any layout)."""

    engines: str = ""  # who runs the stack, for messages
    # Train and inference calls: tensor, pipeline and expert parallel (False: data and context
    # parallel only, the model's layers whole on each rank, as FSDP and DeepSpeed ZeRO hold them).
    model_parallel: bool = True
    # Train and inference calls whose states more than one rank shares: the ZeRO stages the
    # engines have (None: any; an inference call at 0 replicates the weights).
    zero: tuple[int, ...] | None = None
    # Generate calls: pipeline-parallel stages, context-parallel prefill / KV-parallel decode, a
    # decode layout other than the prefill's, and experts split over tp as well as ep.
    rollout_pipeline: bool = True
    rollout_context: bool = True
    split_decode: bool = True
    rollout_expert_parallel: bool = True
    rollout_expert_tp: bool = True
    # Every call runs on all GPUs of the cluster, one after another (verl's single resource pool
    # in its hybrid engine): no call placed on part of it, so none side by side.
    whole_pool: bool = False
    # A reward model (an inference call returning one score per sequence) is served by the
    # rollout engine (verl 0.9's `reward_model.rollout`: vLLM): replicas of tensor-parallel
    # groups with their weights on the GPU (no ZeRO, no pipeline, no host offload), costed with
    # the rollout engine's kernels (`Framework.for_rollouts`).
    served_scores: bool = False
    # A trained model runs its calls other than generation with the layout its worker was built
    # with, on the worker's GPUs (verl's actor and critic workers, OpenRLHF's DeepSpeed engines:
    # one placement and tp/pp/cp for training, the actor's log-probs and the critic's value pass).
    one_worker_layout: bool = False
    # Before training, the policy's log-probs of its own samples are computed again in a forward
    # pass of the trained model (the "old" log-probs of the PPO ratio and the KL term), not taken
    # from generation: verl 0.9's `_compute_old_log_prob` (unless
    # `algorithm.rollout_correction.bypass_mode`) and OpenRLHF 0.11's experience maker (the actor
    # group's forward beside the reference's). The algorithms' graphs then have that call
    # (`planner.algorithms`, ``policy_logprobs``).
    policy_logprobs: bool = False


@dataclass(frozen=True)
class Framework:
    """Which kernels a step launches and which bytes it moves and keeps."""

    name: str
    attention: AttentionImpl  # materialized: s x s scores in HBM; flash: one fused kernel, causal half
    dropout: bool  # hidden and attention dropout kernels and their 1-byte masks
    param_bytes: int  # bf16/fp16 weights
    grad_bytes: int  # gradient buffer dtype (also the dtype of the data-parallel reduction)
    optimizer_bytes: int  # fp32 master weights + Adam m and v
    # HBM traffic of one fused Adam step per parameter: inf check and grad norm read the gradient
    # (2+2 for 2-byte gradients), Adam reads g (2), fp32 p, m, v (12) and writes p, m, v (12) and
    # the 2-byte weight (2), and the gradient buffer is zeroed (2): 34; with fp32 gradients 42.
    optimizer_step_bytes: int
    # Accumulating one micro-batch's weight gradient into the buffer by a kernel of its own: read
    # the grad, read and write the buffer (2+2+2 for fp16 buffers). Not charged where
    # `wgrad_accum_fused`.
    grad_accum_bytes: int
    overlap_grad_reduce: bool  # data-parallel reduction overlaps the last backward (bucketed DDP)
    zero3_prefetch: bool = True  # ZeRO-3 gathers the next weights under the current compute (FSDP, DeepSpeed)
    # The weight-gradient GEMM adds its product into the fp32 gradient buffer itself (Megatron's
    # gradient-accumulation fusion: Megatron-LM's `--gradient-accumulation-fusion`, on unless
    # `--no-gradient-accumulation-fusion`, which Transformer Engine's linears take as
    # `fuse_wgrad_accumulation`): no accumulation kernel and no launch, only the GEMM's epilogue
    # reading and writing fp32 outputs instead of writing bf16 ones (4+4-2 bytes per weight),
    # which a compute-bound GEMM hides. False: a kernel of its own (`grad_accum_bytes`).
    wgrad_accum_fused: bool = False
    # Bytes per logit of each kernel of a training step's loss over the vocabulary, forward and
    # backward; one kernel per entry. Default: a fused cross entropy (upcast 2+4, max 4, exp-sum
    # 4; softmax minus one-hot 4+2). `UNFUSED_CROSS_ENTROPY`: Megatron's.
    loss_fwd: tuple[float, ...] = (14.0,)
    loss_bwd: tuple[float, ...] = (6.0,)
    # Megatron's fused scale-mask-softmax kernel needs batch*heads divisible by 4 and keys <= 2048;
    # otherwise PyTorch runs scale, mask, fp32 cast, softmax and cast back as separate kernels.
    fused_softmax_multiple: int = 1
    fused_softmax_max_keys: int = 1 << 30
    # Bytes per element of each kernel of a norm, a residual add and rotary embedding (per q/k
    # element), forward and backward; one kernel per entry. Defaults: fused kernels on bf16.
    norm_fwd: tuple[float, ...] = (4.0,)
    norm_bwd: tuple[float, ...] = (6.0,)
    residual_fwd: tuple[float, ...] | None = None  # None: bias-dropout-add (7 bytes) or add (6)
    residual_bwd: tuple[float, ...] | None = None
    rope_fwd: tuple[float, ...] = (4.0,)
    rope_bwd: tuple[float, ...] = (4.0,)
    # SwiGLU per element of the f-wide intermediate (None: one fused kernel, 6 bytes forward, 10 backward).
    swiglu_fwd: tuple[float, ...] | None = None
    swiglu_bwd: tuple[float, ...] | None = None
    # A GPT's GELU per element of the f-wide intermediate (None: one fused kernel, 4 bytes forward
    # and 6 backward; HF GPT-2's gelu_new is written out in eager ops: `HF_GELU_NEW`).
    gelu_fwd: tuple[float, ...] | None = None
    gelu_bwd: tuple[float, ...] | None = None
    # Kernels per rotary entry: 2 where the queries and the keys are rotated by kernels of their own.
    rope_launches: int = 1
    # The q and k norms of a model that has them (Qwen3's per head, OLMoE's over the whole
    # projection; `ModelSpec.qk_norm`), by kind: the norm's kernels as `QkNormKernels` says, where
    # they differ from the stack's fused norm kernel (`norm_fwd` / `norm_bwd` on q and on k).
    qk_norm_kernels: tuple[tuple[str, QkNormKernels], ...] = ()
    # A LayerNorm model's norm kernels (forward, backward) where they differ from `norm_fwd` /
    # `norm_bwd`, which then describe an RMSNorm written out in eager ops (LayerNorm being one
    # native kernel each way); None: the same.
    layernorm: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # Q, K and V (and SwiGLU's gate and up) are separate GEMMs, whose input gradients backward sums
    # with a kernel per extra projection (read two, write one: 3 x param_bytes per element of the
    # input; with biases, each bias's gradient is a sum over tokens); False: one fused QKV and one
    # gate-up GEMM.
    split_projections: bool = False
    # The same for a GPT's q, k and v where it differs (None: as `split_projections`): HF GPT-2 runs
    # them as one fused projection (c_attn) split by views, while HF's Llama layers run three.
    gpt_split_projections: bool | None = None
    # Each bias's gradient is summed over tokens by a kernel of its own (the GEMM's output
    # gradient, in the compute dtype: PyTorch's Linear and addmm backward, HF's and the runtime's
    # layers); False: fused into the weight-gradient GEMM (Megatron, Transformer Engine).
    bias_grads_apart: bool = False
    # A fused QKV projection's output is split into q, k and v by views, so backward concatenates
    # their gradients into its output gradient by a kernel of its own (HF GPT-2); False: the
    # attention's backward writes them in place (Megatron-core's and Transformer Engine's layouts).
    qkv_grad_cat: bool = False
    # Under autocast each GEMM casts its own fp32 input to the compute dtype, bytes per element (the
    # norms' outputs, once per projection that reads them); backward casts each one's gradient back
    # (as many bytes). 0: the inputs are in the compute dtype already.
    input_cast_bytes: float = 0.0
    # A GPT's output and down projections add their biases by kernels of their own after the
    # tensor-parallel reduction, in the weights' dtype (the runtime: `out + bias`, a bf16 product
    # and an fp32 bias making the fp32 stream), so the residual adds two fp32 tensors; backward
    # sums each one's gradient over tokens. False: the bias is fused (bias-dropout-add).
    row_bias_apart: bool = False
    # Its generate calls run on another engine with fused kernels (vLLM under verl and OpenRLHF):
    # the norm, rotary, residual and SwiGLU kernels and the projections above are this stack's
    # training and inference layers', not its rollouts' (`for_rollouts`).
    rollouts_fused: bool = False
    # What a layer keeps for backward (`cost_models.memory.layer_activation_bytes`): "fused",
    # Megatron's fused kernels (Korthikanti et al.'s list); "autocast", PyTorch ops under autocast
    # on fp32 weights, each GEMM saving its own cast of its input (the planner's runtime); "hf",
    # HF transformers' layers on bf16 weights (what FSDP and DeepSpeed engines train), the two
    # for each op what autograd saves (`eager_layer_saved_bytes`).
    layer_activations: LayerActivations = "fused"
    # Casting fp32 weights to the compute dtype on each forward pass, bytes per weight (one kernel
    # per matrix); 0 where bf16 weights are kept beside fp32 master weights.
    weight_cast_bytes: float = 0.0
    gpu_calibrated: bool = True  # False: its efficiencies were never measured on a GPU
    # A sliding window is an argument of the attention kernel, which skips the keys outside it
    # (FlashAttention-2's window_size, as vLLM, Transformer Engine and FSDP stacks call it); False:
    # the window is an explicit mask and every score is computed (the planner's runtime).
    windowed_attention: bool = True
    # Generation drops a finished response from the running batch (vLLM's continuous batching);
    # False: every row of a batch is computed until its longest response ends (the runtime).
    decode_drops_finished: bool = False
    # Generation's KV cache is paged (vLLM's PagedAttention): blocks are taken as tokens come, not
    # for a whole response up front, so a budget runs as many rows as their tokens so far fit (at
    # most `max_num_seqs`), admitting waiting rows as others finish and preempting the newest
    # (recomputed on readmission) when a step finds no room (`cost_models.lengths.paged_schedule`).
    # The call's KV budget is what its decode layout's waves would hold at the length cap. False:
    # static waves, each row's cache held at the cap (the runtime).
    paged_kv: bool = False
    max_num_seqs: int | None = None  # rows one paged engine runs at once (vLLM's max_num_seqs)
    # The LM head makes at most this many logits at a time (fused head and log-probs) and its
    # backward makes each chunk again when there is more than one; None: all logits at once.
    logits_chunk_elements: int | None = None
    # Bytes per logit a training step's head keeps live: fp16 logits, an fp32 softmax and the fp16
    # gradient (8); a fused cross-entropy that keeps only the logits and writes their gradient over
    # them (apex's xentropy with inplace_backward, as flash-attention's training scripts run it): 2.
    logit_train_bytes: int = 8
    # Generation keeps one compute-dtype copy of the weights for the whole call (no per-step cast),
    # and on a GPU each decode step of a group replays one captured CUDA graph: no host launches.
    decode_cuda_graphs: bool = False
    # Generation all-gathers every rank's block of the logits (in the compute dtype) over the
    # tensor-parallel group and samples from the whole vocabulary on each rank: vLLM V1's
    # `LogitsProcessor._gather_logits`, whose `Platform.use_all_gather` is true under V1 and under
    # the external launcher verl runs. False: each rank samples its own block (the runtime's
    # `vocab_choose`, `ops.sample_comm`).
    logits_all_gather: bool = False
    # The ZeRO stage from which each rank keeps only its shard of the gradients (ZeRO-2 in
    # DeepSpeed and Megatron; the runtime reduces ZeRO-2 buckets to their owner but keeps one
    # gradient buffer of the whole stage, so only ZeRO-3 shards it).
    grads_sharded_from_zero: int = 2
    # How a mixture-of-experts layer moves its tokens to the experts. "alltoall": one copy per
    # (token, chosen expert), two of a token's experts on one rank included (Megatron-core's
    # alltoall dispatcher, the planner's runtime). "deepep": one copy per rank that holds any of
    # the token's experts, and across nodes one copy per node, forwarded over NVLink inside it
    # (DeepEP's dispatch and combine, DeepSeek-V3 report section 3.2.2; Megatron-core's flex
    # dispatcher).
    moe_dispatch: MoeDispatch = "alltoall"
    # The routing's own kernels. "fused": a fused softmax-top-k, one permutation of the token
    # copies into expert order and one un-permutation with the weighted sum (Megatron-core's and
    # vLLM's). "eager": the planner's runtime as `runtime/model._sparse_mlp` and `_experts` run it in
    # PyTorch ops (`cost_models.ops.eager_routing`): the logits upcast, softmax, top-k and its
    # renormalisation, an argsort of the copies by expert, index ops on int64 ids, a gather of the
    # fp32 token copies, each expert's GEMMs casting their own input, a cat of the experts'
    # outputs, the weighted copies summed back into a zero-filled fp32 tensor by index_add, and
    # the backward of each.
    # "hf": transformers' own routing and experts (`cost_models.ops.hf_sparse_mlp`): the router's
    # softmax and top-k in PyTorch ops, a sort of the copies by expert, gathers and index_puts, one
    # grouped GEMM per projection kind over every expert, the weighted copies summed per token.
    moe_routing: Literal["fused", "eager", "hf"] = "fused"
    # Copies the stack makes around its tensor-parallel collectives (the planner's runtime,
    # `runtime/tensor_parallel.py`): under sequence parallelism each all-gather and reduce-scatter
    # along the sequence takes its input and gives its output through a transpose-and-contiguous
    # copy ([b, s, h] to [s, b, h] and back), and without it each backward all-reduce of a block's
    # input gradient clones the gradient first. Megatron's collectives split the sequence-first
    # layout in place and reduce gradients where they lie (False).
    tp_copies: bool = False
    # The model's ends as the planner's runtime runs them (`runtime/model.py`, `runtime/tensor_parallel.py`;
    # `tests/test_kernel_inventory.py` counts them): fp32 tables looked up into the fp32 residual
    # stream, learned positions once per sequence position and broadcast over the batch, and the LM
    # head fused with the log-probs (`head_logprobs`): the weight cast once per call and direction,
    # each chunk of at most `logits_chunk_elements` logits made in bf16, upcast, log-softmaxed and
    # picked, its backward the softmax in place, the chunk's weight gradient added into an fp32 sum.
    # False: the ends as the fused stacks run them (Megatron's: the tables in the weights' dtype,
    # positions looked up per token, the head one GEMM and the stack's loss kernels).
    runtime_ends: bool = False
    # How the host issues a rank's routed experts. "grouped": one kernel per expert GEMM kind for
    # all local experts (vLLM's fused MoE kernel). "per_expert": one GEMM launch per local expert
    # and GEMM, the launches spread over streams that fill the GPU together (Transformer Engine's
    # GroupedLinear, which Megatron-core's TEGroupedMLP runs: a cuBLASLt call per expert on 4
    # streams, TransformerEngine PR #853, `multi_streams.h`; forward fc1 and fc2, backward their
    # data and weight gradients). "loop": a Python loop over the experts with tokens, each running
    # its gate, up and down projections and SwiGLU's kernels one after another (the planner's
    # runtime, `runtime/model._experts`).
    expert_gemms: ExpertGemms = "grouped"
    # The same for generate calls where they run on another engine (None: as `expert_gemms`).
    rollout_expert_gemms: ExpertGemms | None = None
    # How context-parallel ranks share keys and values. "ring": each passes its chunk around the
    # ring while attention runs on the one it holds (ring attention; Transformer Engine's p2p, what
    # Megatron-core runs), hidden under that attention; "all_gather": every chunk is all-gathered
    # before attention and the gradients reduce-scattered after, not overlapped (the planner's
    # runtime; OpenRLHF's ring attention, ring-flash-attn's llama3 variant, which gathers K and V);
    # "all_to_all": DeepSpeed-Ulysses (verl's FSDP workers), q, k and v all-to-all'd from a chunk of
    # the sequence with every head to the whole sequence with 1/cp of the heads, the output back,
    # not overlapped (`ops.ulysses_attention`).
    cp_comm: CpComm = "ring"
    # Under context parallel, one data-parallel group of dp x cp ranks shards the ZeRO states and
    # reduces the gradients, overlapped as the stack overlaps (Megatron-core's distributed
    # optimizer and DDP over the data-parallel group with context parallel; FSDP over a dp x cp
    # mesh; the planner's runtime for ZeRO 0-2). True: ZeRO-3 slices the weights over dp alone,
    # the cp ranks holding the same slices, whose gradients are summed over the cp group after the
    # backward, not overlapped (the planner's runtime: `runtime/data_parallel.py`, `plans.sharding`).
    cp_zero3_replicas: bool = False
    # ZeRO-3 buffers, in layers' weights: gathered weights in flight (the layer computing and the
    # one prefetched) and, in training, gradients on their way to the reduce-scatter. The runtime
    # keeps per gather the gathered buffer and the unpacked weights (2 copies, 2 gathers in flight)
    # and per reduce-scatter the layer's gradients and their packed copy (2, `SCATTERS_IN_FLIGHT` 2).
    zero3_gather_layers: float = 2.0
    zero3_scatter_layers: float = 0.0
    # ZeRO-3 in training. False: FSDP's way (PyTorch FSDP/FSDP2, Megatron-core's FSDP, DeepSpeed):
    # a layer's gathered weights are freed after its forward and gathered again for its backward,
    # where a full recompute's forward uses that same gather (Megatron-core's custom FSDP skips the
    # prefetch for it, `fully_sharded_data_parallel.py`): two gathers per micro-batch. True: the
    # planner's runtime, whose gather is an autograd function whose output the layer's matmuls
    # save, so autograd keeps each layer's gathered weights (their compute-dtype copies) from its
    # forward to its backward: one gather per micro-batch, two under full recompute (its forward
    # gathers again inside the checkpoint), and every layer's weights held at the forward's end.
    zero3_keeps_gathered: bool = False
    # ZeRO-1 all-reduces the gradients and each rank updates its part (the runtime); False: it
    # reduce-scatters them (Megatron's distributed optimizer, DeepSpeed).
    zero1_all_reduce: bool = False
    # After a ZeRO-1/2 step each rank sends a copy of its updated part to the all-gather of the
    # whole buffer (the runtime: ``flat[lo:hi].clone()``), one part held beside the states.
    zero12_step_copy: bool = False
    # Transformer Engine's userbuffers (Megatron-core --tp-comm-overlap, sequence parallel only):
    # each all-gather before a column-parallel GEMM and reduce-scatter after a row-parallel one is
    # cut into tp chunks pipelined with the GEMM's chunks, so one chunk's transfer stays exposed
    # where the GEMMs are the longer, and the rest runs under them (their SMs shared).
    tp_comm_overlap: bool = False
    # Backward, the column-parallel GEMMs' input-gradient all-reduce (reduce-scatter with sequence
    # parallelism) is issued asynchronously and runs under their weight-gradient GEMM, exposed only
    # where longer (Megatron-LM since 2021-09, LinearWithGradAccumulationAndAsyncCommunication in
    # megatron/core/tensor_parallel/layers.py, and the stacks built on it); False: after it, exposed.
    tp_dgrad_overlap: bool = False
    # ZeRO-1/2's all-gather of the updated weight shards runs bucket by bucket under the next
    # step's first forward, each layer waiting only for its own bucket (Megatron-core
    # --overlap-param-gather); False: it runs after the optimizer, exposed.
    overlap_param_gather: bool = False
    # The fused attention kernel the stack runs per GPU architecture, timed at its published speed
    # by head dim and keys per query (`cost_models.attention`); an architecture not listed keeps
    # the calibration's `attention_efficiency` at every length.
    attention_kernels: tuple[tuple[str, str], ...] = ()
    # What layouts the stack's engines run (`engine_layout_problems`).
    layouts: EngineLayouts = EngineLayouts()

    def for_rollouts(self) -> Framework:
        """The traits its generate calls are costed with: the rollout engine's way of running
        experts, and its fused kernels where `rollouts_fused`."""
        fw = self
        if fw.rollout_expert_gemms is not None:
            fw = dataclasses.replace(fw, expert_gemms=fw.rollout_expert_gemms)
        if fw.rollouts_fused:
            fused: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Framework)
                                     if f.name in FUSED_LAYER_TRAITS}
            fw = dataclasses.replace(fw, **fused)
        return fw

    def at_zero(self, zero: int) -> Framework:
        """The stack training at ZeRO stage `zero`: where gradients are reduce-scattered every
        micro-batch (`grads_sharded_from_zero` and up) there is no whole fp32 buffer for the
        weight-gradient GEMM to add into, so `wgrad_accum_fused` is off and each weight's gradient
        goes to the reduction buffer by a kernel of its own. Megatron-LM refuses the fusion with
        either FSDP (core_r0.13.0 ``megatron/training/arguments.py``: "--use-torch-fsdp2 is not
        supported with gradient accumulation fusion", "optim_grads_params optim_grads are not
        supported with gradient accumulation fusion"); its own FSDP's backward hook copies each
        ``param.grad`` into ``main_grad`` instead (``custom_fsdp/fully_sharded_data_parallel.py``)."""
        if self.wgrad_accum_fused and zero >= self.grads_sharded_from_zero:
            return dataclasses.replace(self, wgrad_accum_fused=False)
        return self

    def zero_group(self, layout: Layout) -> str:
        """The group (`cost_models.training.Topology.group`) that shards `layout`'s ZeRO states and
        reduces its gradients: dp x cp, or dp alone where the cp ranks hold replicas of ZeRO-3's
        slices (`cp_zero3_replicas`)."""
        return "dp" if self.cp_zero3_replicas and layout.zero == 3 else "dpcp"

    def zero_ranks(self, layout: Layout) -> int:
        """The ranks of `zero_group` under `layout`."""
        return layout.dp if self.zero_group(layout) == "dp" else layout.dp * layout.cp


# The traits a stack with eager layers trains and infers with and its rollout engine replaces by
# fused kernels (`Framework.for_rollouts`).
FUSED_LAYER_TRAITS = frozenset({"norm_fwd", "norm_bwd", "residual_fwd", "residual_bwd", "rope_fwd", "rope_bwd",
                                "swiglu_fwd", "swiglu_bwd", "rope_launches", "layernorm", "split_projections",
                                "input_cast_bytes", "row_bias_apart", "gelu_fwd", "gelu_bwd",
                                "gpt_split_projections", "bias_grads_apart", "qkv_grad_cat", "tp_copies",
                                "runtime_ends", "moe_routing", "qk_norm_kernels"})

# HF transformers' Llama layers on bf16 weights (transformers 5.25.0 `modeling_llama.py`), bytes per
# element of each kernel as `tests/test_kernel_inventory.py` records them dispatched; kernels of one
# value per token (the variance's epsilon, its rsqrt, their backward) move no bytes that count.
# LlamaRMSNorm forward: upcast (2+4), pow (4+4), mean (4), + eps, rsqrt, x * rsqrt (4+4), downcast
# (4+2), weight * x (2+2). Backward: the weight's (x its grad 2+2, normalised x times grad 2+2+2,
# summed over tokens 2) and the input's through the upcast graph (upcast 2+4, grad * x 4+4+4, * rsqrt
# 4+4, summed per token 4, three per-token kernels, div 4+4, pow 4+4, * 2 4+4, * 4+4+4, + 4+4+4,
# downcast 4+2).
HF_RMS_NORM = ((6.0, 8.0, 4.0, 0.0, 0.0, 8.0, 6.0, 4.0),
               (4.0, 6.0, 2.0, 6.0, 12.0, 8.0, 4.0, 0.0, 0.0, 0.0, 8.0, 8.0, 8.0, 12.0, 12.0, 6.0))
# Rotary per element of q (and apart of k): q * cos (2+2), rotate_half's neg of one half (1+1) and
# cat (2+2), * sin (2+2), + (2+2+2). Backward: grad * sin (2+2), neg of a half (1+1), the two
# slices' backward (each a zero fill of the whole, 2, and a copy of its half, 1+1), their sum
# (2+2+2), grad * cos (2+2), the sum (2+2+2), and the gradient's copy back to the projection's
# layout (2+2; the view of the transposed heads).
HF_ROPE = ((4.0, 2.0, 4.0, 4.0, 6.0), (4.0, 2.0, 2.0, 2.0, 2.0, 2.0, 6.0, 4.0, 6.0, 4.0))

# HF GPT-2's gelu_new (transformers' NewGELUActivation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715
# x^3)))) per element, as `tests/test_kernel_inventory.py` records it on bf16: forward 0.5 x (2+2),
# x^3 (2+2), times 0.044715 (2+2), + x (2+2+2), times sqrt(2/pi) (2+2), tanh (2+2), + 1 (2+2), the
# product (2+2+2); backward the product's two gradients (2+2+2 each), tanh's (2+2+2), and through
# the polynomial (scalar products 2+2, x^2 and its product, the sums 2+2+2).
HF_GELU_NEW = ((4.0, 4.0, 4.0, 6.0, 4.0, 4.0, 4.0, 6.0), (6.0, 6.0, 6.0, 4.0, 4.0, 4.0, 4.0, 6.0, 6.0, 4.0, 6.0))

# PyTorch's native LayerNorm on CUDA by activation bytes: one kernel forward (read, write); backward
# one for the input's gradient (read the gradient and the input, write) and one for the weight's
# and bias's (read both again; `layer_norm_kernel.cu`).
LAYER_NORM_KERNELS = {b: ((2.0 * b,), (3.0 * b, 2.0 * b)) for b in (2, 4)}

# Transformer Engine prefers cuDNN's fused attention on Hopper and FlashAttention-2 on Ampere (NVIDIA
# NeMo docs, memory_optimizations.rst, PR #9188); PyTorch's SDPA runs FlashAttention-2 first on both;
# vLLM runs its FlashAttention-2 build on Ampere and FlashAttention-3 on Hopper (forward only).
# Rows a vLLM engine runs at once: verl 0.9's `rollout.max_num_seqs` default, and vLLM's own for
# offline use (the `LLM` class) on A100s (EngineArgs.get_batch_defaults; 1024 on larger GPUs).
VLLM_MAX_NUM_SEQS = 256
TE_ATTENTION = (("ampere", "fa2"), ("hopper", "cudnn"))
SDPA_ATTENTION = (("ampere", "fa2"), ("hopper", "fa2"))
VLLM_ATTENTION = (("ampere", "fa2"), ("hopper", "fa3"))

# Megatron's vocab-parallel cross entropy without --cross-entropy-loss-fusion (off by default;
# core_v0.8.0 `megatron/core/tensor_parallel/cross_entropy.py`, and Megatron-DeepSpeed's copy,
# called on `output.float()`): forward upcasts the bf16 logits (2+4), takes the max (4), subtracts
# it in place (4+4), exponentiates in place (4+4), sums (4) and divides in place into the softmax
# kept for backward (4+4); backward multiplies it by the loss gradient in place (4+4) and the
# upcast's backward casts the fp32 gradient to bf16 (4+2). Per logit, 38 bytes in six kernels
# forward and 14 in two backward.
UNFUSED_CROSS_ENTROPY = ((6.0, 4.0, 8.0, 8.0, 4.0, 8.0), (8.0, 6.0))

# HF's RMSNorm of q or k (transformers 5.25 `Qwen3RMSNorm`, `OlmoeRMSNorm`: `HF_RMS_NORM`'s kernels on
# bf16 q or k): per element as `HF_RMS_NORM`; per row the epsilon's add and rsqrt (4+4 each),
# backward three kernels on the rows' statistics (4+4, 4+4, 4+4+4), moving bytes where a row is a
# head of a token (Qwen3), not where it is the token (OLMoE).
HF_QK_NORM = QkNormKernels(fwd=tuple(x for x in HF_RMS_NORM[0] if x), fwd_rows=(8.0, 8.0),
                           bwd=tuple(x for x in HF_RMS_NORM[1] if x), bwd_rows=(8.0, 8.0, 12.0))
# The planner's runtime (`runtime/model._rms` per head, `_sharded_rms` over the projection) on bf16 q
# or k under autocast: upcast (2+4), pow (4+4), mean or sum (4), the rows' statistics (per head the
# epsilon's add and rsqrt; over the projection also the division by the width), x * rsqrt (4+4), to
# bf16 (4+2), times the fp32 weight (2+4), so q and k leave it in fp32. Backward: the product's two
# gradients (4+4, 4+2+4), the weight's sum over rows (4), the gradient cast to bf16 (4+2) and back
# (2+4), grad * x (4+4+4), * rsqrt (4+4), summed per row (4), the statistics' (three kernels per head:
# 4+4, 4+4, 4+4+4; four over the projection), per head the mean's division (4+4), pow (4+4), * 2
# (4+4), * grad (4+4+4), the two paths summed (4+4+4) and the upcast's backward (4+2).
RUNTIME_QK_NORM = {
    "head": QkNormKernels(fwd=(6.0, 8.0, 4.0, 8.0, 6.0, 6.0), fwd_rows=(8.0, 8.0),
                          bwd=(8.0, 10.0, 4.0, 6.0, 6.0, 12.0, 8.0, 4.0, 8.0, 8.0, 8.0, 12.0, 12.0, 6.0),
                          bwd_rows=(8.0, 8.0, 12.0), out_fp32=True),
    "proj": QkNormKernels(fwd=(6.0, 8.0, 4.0, 8.0, 6.0, 6.0), fwd_rows=(8.0, 8.0, 8.0),
                          bwd=(8.0, 10.0, 4.0, 6.0, 6.0, 12.0, 8.0, 4.0, 8.0, 8.0, 12.0, 12.0, 6.0),
                          bwd_rows=(8.0, 8.0, 12.0, 8.0), out_fp32=True),
}


# What the engines each RLHF stack exports to run (`planner export`), which its plans keep to.
# vLLM as verl and OpenRLHF start it: one engine per tensor-parallel group, every sequence on one
# engine (no context-parallel prefill or KV-parallel decode) and one layout for prefill and decode;
# vLLM serves pipeline-parallel engines itself, which neither RLHF engine asks for.
VLLM_LAYOUTS = EngineLayouts(engines="vLLM", rollout_context=False, split_decode=False)
# verl's Megatron workers train and score with any Megatron-Core layout; the distributed optimizer
# is ZeRO-1 (reduce-scattered gradients into a whole buffer) and Megatron's FSDP ZeRO-3: no ZeRO-2.
# Its vLLM rollouts take a tensor-parallel size and, for experts, an expert-parallel size over the
# whole engine (each expert whole: verl checks expert_parallel_size == tp x dp). verl runs every
# role on its one resource pool, one after another (a reward model may have a pool of its own,
# which these plans do not use), and recomputes the actor's log-probs before training.
VERL_MEGATRON_LAYOUTS = EngineLayouts(engines="verl's Megatron workers with vLLM rollouts", zero=(0, 1, 3),
                                      rollout_pipeline=False, rollout_context=False, split_decode=False,
                                      rollout_expert_tp=False, whole_pool=True, served_scores=True,
                                      one_worker_layout=True, policy_logprobs=True)
# OpenRLHF (DeepSpeed) holds each HF model's layers whole on every rank, sharded by ZeRO-3 (its
# forward-only models follow --ds.zero_stage 3; one stage for every model, so ZeRO-3 throughout);
# sequences split by ring attention (context parallel). Its DeepSpeed AutoTP is not what this
# stack prices (its tensor-parallel layers overlap no collective with the weight gradient), so a
# plan holds no tensor parallel in training or scoring. Its vLLM engines: tensor parallel only
# (no expert-parallel flag); its roles may run on groups of their own, side by side. Its experience
# maker recomputes the actor's log-probs on the actor's group, and a trained model's forward runs on
# its training engine (the actor's log-probs, the critic's values): one group and layout per model.
HF_ENGINE_LAYOUTS = EngineLayouts(engines="OpenRLHF's DeepSpeed models with vLLM rollouts", model_parallel=False,
                                  zero=(3,), rollout_pipeline=False, rollout_context=False, split_decode=False,
                                  rollout_expert_parallel=False, rollout_expert_tp=False, one_worker_layout=True,
                                  policy_logprobs=True)
# verl's FSDP workers: every model sharded by FSDP (FULL_SHARD, ZeRO-3), no tensor or pipeline
# parallel, sequences split by Ulysses; vLLM rollouts as for its Megatron workers; every role on
# its one resource pool.
VERL_FSDP_LAYOUTS = EngineLayouts(engines="verl's FSDP workers with vLLM rollouts", model_parallel=False, zero=(3,),
                                  rollout_pipeline=False, rollout_context=False, split_decode=False,
                                  rollout_expert_tp=False, whole_pool=True, served_scores=True,
                                  one_worker_layout=True, policy_logprobs=True)

FRAMEWORKS: dict[str, Framework] = {
    "megatron": Framework(
        name="megatron", attention="materialized", dropout=True, param_bytes=2, grad_bytes=2, optimizer_bytes=12,
        optimizer_step_bytes=34, grad_accum_bytes=6, overlap_grad_reduce=False,
        fused_softmax_multiple=4, fused_softmax_max_keys=2048, tp_dgrad_overlap=True,
        loss_fwd=UNFUSED_CROSS_ENTROPY[0], loss_bwd=UNFUSED_CROSS_ENTROPY[1],
    ),
    # Megatron-Core with Transformer Engine, and stacks built like it (Llama 3's, NeMo): fused
    # (flash) attention and fused norm, rotary and SwiGLU kernels, no dropout, bf16 weights with
    # fp32 master weights and Adam states, gradients accumulated and reduced in fp32 (Megatron-LM's
    # default under --bf16, validate_args; the Llama 3 paper's, section 3.3.2) by the weight-gradient
    # GEMMs themselves (gradient-accumulation fusion, on by default), reduced in buckets during backward
    # (--overlap-grad-reduce, which the Megatron-LM export sets) and ZeRO-3 weights gathered ahead
    # of use; ZeRO-1/2's gather of the updated weights after the step is not overlapped (the
    # export leaves --overlap-param-gather off, and DeepSpeed, also costed with this stack, has none).
    "megatron-core": Framework(
        name="megatron-core", attention="flash", dropout=False, param_bytes=2, grad_bytes=4, optimizer_bytes=12,
        optimizer_step_bytes=42, grad_accum_bytes=10, overlap_grad_reduce=True, zero3_prefetch=True,
        expert_gemms="per_expert", attention_kernels=TE_ATTENTION, tp_dgrad_overlap=True, wgrad_accum_fused=True,
        loss_fwd=UNFUSED_CROSS_ENTROPY[0], loss_bwd=UNFUSED_CROSS_ENTROPY[1],
    ),
    # verl and OpenRLHF as they run a PPO/GRPO step: training on Megatron-Core or FSDP/DeepSpeed
    # with bf16 weights beside fp32 master weights, fp32 gradients (verl's Megatron DDP sets
    # grad_reduce_in_fp32, its FSDP reduces in fp32) and overlapped communication, rollouts on vLLM
    # with decode replayed as CUDA graphs (what `planner import` costs their configs with). One
    # attention kernel per architecture serves both: Transformer Engine's, so on Hopper the
    # rollouts' prefill runs at cuDNN's forward speed, which vLLM's FlashAttention-3 exceeds by
    # 8-14% at 2k-16k tokens (the FlashAttention-3 paper's forward figure, `cost_models.attention`).
    # Unlike Megatron-LM's command line, verl builds its TransformerConfig without
    # gradient-accumulation fusion unless overridden (`verl/utils/megatron/tensor_parallel.py`), and
    # DeepSpeed has none: each micro-batch's weight gradients are added by a kernel of their own.
    "rlhf-engine": Framework(
        name="rlhf-engine", attention="flash", dropout=False, param_bytes=2, grad_bytes=4, optimizer_bytes=12,
        optimizer_step_bytes=42, grad_accum_bytes=6, overlap_grad_reduce=True, zero3_prefetch=True,
        decode_cuda_graphs=True, logits_all_gather=True, decode_drops_finished=True, paged_kv=True, max_num_seqs=VLLM_MAX_NUM_SEQS,
        expert_gemms="per_expert", rollout_expert_gemms="grouped",
        attention_kernels=TE_ATTENTION, tp_dgrad_overlap=True, layouts=VERL_MEGATRON_LAYOUTS,
    ),
    # The same engines training HF transformers models (verl's FSDP workers, OpenRLHF on
    # DeepSpeed) with `attn_implementation="flash_attention_2"`: activations as HF's eager layers
    # keep them on bf16 weights (RMSNorm upcast to fp32, SwiGLU's four f-wide tensors), byte for byte
    # what `transformers` saves (`tests/test_cost_memory.py`), and FlashAttention-2 on every
    # architecture; its layers' kernels as HF's eager Llama code dispatches them (RMSNorm and
    # rotary written out in elementwise ops, q, k, v, gate and up as GEMMs of their own: 30
    # memory-bound kernels a layer forward and 60 backward where the fused stacks run 6 each,
    # `tests/test_kernel_inventory.py`); its rollouts run on vLLM's fused kernels. A GPT runs as HF's
    # GPT-2 (the `gpt` family's HF model): native LayerNorm, one fused c_attn for q, k and v whose
    # gradients backward concatenates, gelu_new written out in eight eager kernels forward and
    # eleven backward, and each bias's gradient summed over tokens by a kernel of its own (also
    # checked against `transformers`' own block, memory included). Its sparse MLPs run transformers'
    # routing in PyTorch ops and each projection kind of every expert as one grouped GEMM (its
    # default experts implementation, `grouped_mm`; `cost_models.ops.hf_sparse_mlp`), its rollouts
    # vLLM's fused MoE. Context parallelism as OpenRLHF runs it (`--ds.ring_attn_size`:
    # ring-flash-attn's `substitute_hf_flash_attn`, the llama3 variant): K and V all-gathered over
    # the ring group, their gradients reduce-scattered, not overlapped. `verl-fsdp` is the same
    # stack as verl's FSDP workers run it: Ulysses for context parallel, its layouts.
    "rlhf-engine-hf": Framework(
        name="rlhf-engine-hf", attention="flash", dropout=False, param_bytes=2, grad_bytes=4, optimizer_bytes=12,
        optimizer_step_bytes=42, grad_accum_bytes=6, overlap_grad_reduce=True, zero3_prefetch=True,
        decode_cuda_graphs=True, logits_all_gather=True, decode_drops_finished=True, paged_kv=True, max_num_seqs=VLLM_MAX_NUM_SEQS,
        expert_gemms="grouped", moe_routing="hf",
        attention_kernels=SDPA_ATTENTION, tp_dgrad_overlap=True, layer_activations="hf",
        norm_fwd=HF_RMS_NORM[0], norm_bwd=HF_RMS_NORM[1], rope_fwd=HF_ROPE[0], rope_bwd=HF_ROPE[1], rope_launches=2,
        swiglu_fwd=(4.0, 6.0), swiglu_bwd=(6.0, 6.0, 6.0), layernorm=LAYER_NORM_KERNELS[2], split_projections=True,
        gpt_split_projections=False, bias_grads_apart=True, qkv_grad_cat=True, gelu_fwd=HF_GELU_NEW[0],
        gelu_bwd=HF_GELU_NEW[1], rollouts_fused=True, qk_norm_kernels=(("head", HF_QK_NORM), ("proj", HF_QK_NORM)),
        layouts=HF_ENGINE_LAYOUTS, cp_comm="all_gather",
    ),
    # vLLM as verl and OpenRLHF run it for rollouts: bf16 weights, fused kernels, decode steps
    # replayed as CUDA graphs (its generate calls; it does not train).
    "vllm": Framework(
        name="vllm", attention="flash", dropout=False, param_bytes=2, grad_bytes=2, optimizer_bytes=12,
        optimizer_step_bytes=34, grad_accum_bytes=6, overlap_grad_reduce=True, zero3_prefetch=True,
        decode_cuda_graphs=True, logits_all_gather=True, decode_drops_finished=True, paged_kv=True, max_num_seqs=VLLM_MAX_NUM_SEQS,
        attention_kernels=VLLM_ATTENTION,
        layouts=VLLM_LAYOUTS,
    ),
    # Fused AdamW over fp32 p, g, m, v: read 16, write 12, zero the gradient 4. A micro-batch's
    # weight gradient: bf16 to fp32 (2+4, the weight cast's backward), accumulated (4+4+4). Its
    # layers as `runtime/model.py` runs them under bf16 autocast on fp32 weights and residual stream
    # (`tests/test_kernel_inventory.py` counts them against the runtime's own): RMSNorm pow (4+4),
    # mean (4), + eps and rsqrt per token, x * rsqrt (4+4), weight * x (4+4); backward the weight's
    # (grad x weight 4+4, grad x normalised x 4+4+4, summed 4), the input's (grad x x 4+4+4, x
    # rsqrt 4+4, summed per token 4, three per-token kernels, div 4+4, pow 4+4, x 2 4+4, x 4+4+4)
    # and the sum of the two paths into x (4+4+4). The residual add of a bf16 branch to the fp32
    # stream (2+4+4), backward the branch's gradient cast to bf16 (4+2) and the sum (4+4+4). Rotary
    # as x * cos + roll(x) * sin per q and k apart, backward the same and the gradient's copy back
    # to the projection's layout (2+2). q, k, v, gate and up are separate GEMMs, each casting its
    # input (`input_cast_bytes`).
    "torch": Framework(
        name="torch", attention="flash", dropout=False, param_bytes=4, grad_bytes=4, optimizer_bytes=8,
        optimizer_step_bytes=32, grad_accum_bytes=18, overlap_grad_reduce=True, zero3_prefetch=True,
        norm_fwd=(8.0, 4.0, 0.0, 0.0, 8.0, 8.0),
        norm_bwd=(8.0, 12.0, 4.0, 12.0, 8.0, 4.0, 0.0, 0.0, 0.0, 8.0, 8.0, 8.0, 12.0, 12.0),
        residual_fwd=(10.0,), residual_bwd=(6.0, 12.0), rope_fwd=(4.0, 4.0, 4.0, 6.0), rope_bwd=(4.0, 4.0, 4.0, 6.0, 4.0),
        rope_launches=2, split_projections=True, input_cast_bytes=6.0, layernorm=LAYER_NORM_KERNELS[4],
        row_bias_apart=True, bias_grads_apart=True,
        swiglu_fwd=(4.0, 6.0), swiglu_bwd=(6.0, 6.0, 6.0), layer_activations="autocast",
        weight_cast_bytes=6.0, gpu_calibrated=False, logits_chunk_elements=2**26, decode_cuda_graphs=True,
        windowed_attention=False, cp_comm="all_gather", cp_zero3_replicas=True,
        grads_sharded_from_zero=3, zero3_gather_layers=4.0, zero3_scatter_layers=4.0, zero3_keeps_gathered=True,
        zero1_all_reduce=True, zero12_step_copy=True, expert_gemms="loop", moe_routing="eager",
        attention_kernels=SDPA_ATTENTION, tp_copies=True, runtime_ends=True,
        qk_norm_kernels=tuple(RUNTIME_QK_NORM.items()),
    ),
}
# verl's FSDP workers (`actor_rollout_ref.actor.strategy: fsdp`): HF layers as `rlhf-engine-hf`
# prices them, context parallel by Ulysses (`ulysses_sequence_parallel_size`: verl's
# `gather_seq_scatter_heads` around flash attention, models/transformers/monkey_patch.py in 0.9.1).
FRAMEWORKS["verl-fsdp"] = dataclasses.replace(FRAMEWORKS["rlhf-engine-hf"], name="verl-fsdp", cp_comm="all_to_all",
                                              layouts=VERL_FSDP_LAYOUTS)


# Until a stack's attention is measured on a GPU, its fused attention is never timed above what
# FlashAttention-2 (PyTorch's first SDPA backend; cuDNN's comes last in its default order) is
# published to reach on that architecture: on an A100, the low end of its 50-73% of the peak (Dao
# 2023, arXiv:2307.08691; forward at the top, backward and short sequences lower); on an H100, 35%
# (Shah et al. 2024, arXiv:2407.08608, abstract: it does not use Hopper's asynchronous tensor cores
# and TMA, which FlashAttention-3 and cuDNN do). Volta runs no FlashAttention-2 (PyTorch falls back
# to its memory-efficient kernel), for which no figure is published: the Ampere share stands.
UNCALIBRATED_ATTENTION_SHARE = {"volta": 0.50, "ampere": 0.50, "hopper": 0.35}


def uncalibrated_attention_share(arch: str) -> float:
    """Of the peak, what an uncalibrated stack's fused attention is timed at on `arch`."""
    return UNCALIBRATED_ATTENTION_SHARE.get(arch, UNCALIBRATED_ATTENTION_SHARE["ampere"])


def resolve_framework(fw: str | Framework) -> Framework:
    """A preset by name, or the given traits."""
    if isinstance(fw, Framework):
        return fw
    if fw not in FRAMEWORKS:
        raise PlannerError(f"unknown framework {fw!r}", hint=f"known: {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[fw]


def engine_layout_problems(fw: Framework, kind: str, layout: Layout, decode_layout: Layout | None = None, *,
                           returns: str | None = None) -> list[str]:
    """Why the engines `fw` stands for cannot run a `kind` call ("train", "inference" or
    "generate"; an inference call's `returns`) with `layout` (and `decode_layout`); empty when
    they can."""
    rules = fw.layouts
    who = rules.engines or f"framework {fw.name}"
    out = []
    if kind == "inference" and returns == "scores" and rules.served_scores:
        if layout.zero or layout.pp > 1 or layout.offload != "none":
            out.append(f"a reward model at {layout.short()} is not run by {who}: the rollout engine serves it, "
                       "replicas of a tensor-parallel group with the weights on the GPU")
        return out
    if kind == "generate":
        dec = decode_layout or layout
        if not rules.rollout_pipeline and max(layout.pp, dec.pp) > 1:
            out.append(f"pipeline-parallel generation (pp={max(layout.pp, dec.pp)}) is not run by {who}: they give "
                       "vLLM a tensor-parallel size only")
        if not rules.rollout_context and max(layout.cp, dec.cp) > 1:
            out.append(f"context-parallel prefill / KV-parallel decode (cp={max(layout.cp, dec.cp)}) is not run by "
                       f"{who}: each sequence stays on one engine")
        if not rules.split_decode and decode_layout is not None and decode_layout != layout:
            out.append(f"a decode layout ({decode_layout.short()}) other than the prefill's ({layout.short()}) is not "
                       f"run by {who}: an engine decodes where it prefills")
        if not rules.rollout_expert_parallel and max(dec.ep, layout.ep) > 1:
            out.append(f"expert-parallel generation (ep={max(dec.ep, layout.ep)}) is not run by {who}: each engine "
                       "rank holds every expert")
        elif not rules.rollout_expert_tp and any(x.ep > 1 and x.etp > 1 for x in (layout, dec)):
            out.append(f"experts split over both tp and ep in generation are not run by {who}: an engine splits "
                       "whole experts over its ranks")
        return out
    if not rules.model_parallel and max(layout.tp, layout.pp, layout.ep, layout.etp) > 1:
        out.append(f"tensor, pipeline or expert parallel ({layout.short()}) is not run by {who}: they hold every "
                   "layer whole on each rank, sharded by ZeRO-3 over the data- and context-parallel ranks")
    if rules.zero is not None and layout.dp * layout.cp > 1 and layout.zero not in rules.zero:
        stages = " or ".join(str(z) for z in rules.zero)
        held = "weights replicated (ZeRO-0)" if layout.zero == 0 else f"ZeRO-{layout.zero}"
        out.append(f"{held} over {layout.dp * layout.cp} ranks is not run by {who}: they shard states by ZeRO-{stages}")
    return out
