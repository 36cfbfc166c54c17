"""The estimator interface the planner uses: `CostModel.call_cost`, `realloc_cost`, `data_transfer_s`.

`CostModel(cluster, calibration)` times any call (generate, inference, train) of a model under a
(mesh, layout) placement and states its per-rank memory; `realloc_cost` times moving a model's
parameters between two placements from the exact transfer plan of `plans.sharding`. Results are
cached per instance (the search asks for the same pairs many times); everything is deterministic.

FLOPs convention (`CallCost.model_flops`, MFU): a training token costs ``6*N + 12*L*h*s`` FLOPs, N
the parameters that take part in matmuls (the LM head included, embedding lookups excluded) and
the second term full (non-causal) attention scores and context (PaLM, Chowdhery et al. 2022,
appendix B; equal to Megatron-LM's ``72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h))`` without recompute).
A forward-only token costs a third; a decoded token ``2*N + 4*L*h*ctx``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from cost_models import comm
from cost_models.attention import KERNEL_NAMES, has_curves
from cost_models.calibration import Calibration, default_calibration
from cost_models.compute import attention_anchor
from cost_models.framework import Framework, resolve_framework, uncalibrated_attention_share
from cost_models.galore import galore_stage
from cost_models.generation import decode_split, generate_times, pages
from cost_models.hardware import Hardware, core_share, effective_hardware, matmul_ceiling_ratio
from cost_models.lengths import length_dist
from cost_models.memory import (
    TRANSIENT,
    eager_head_saved_bytes,
    forward_working_bytes,
    fragmentation_bytes,
    in_flight_microbatches,
    kv_cache_bytes,
    layer_activation_bytes,
    nccl_bytes,
    reserve_bytes,
    state_bytes,
)
from cost_models.ops import (
    ExpertLoad,
    expert_load,
    expert_params_per_rank,
    layer_cast_params,
    layer_params_per_rank,
    mean_layer_params,
)
from cost_models.training import (
    StepTimes,
    Topology,
    forward_pass,
    microbatch_size,
    pipeline_parts,
    stage_layer_counts,
    stage_param_counts,
    train_step,
)
from cost_models.transfer import KV_BYTES, RankVolumes, kv_volumes, rank_volumes, realloc_floor
from plans.cluster import ClusterSpec
from plans.errors import PlannerError
from plans.graph import Call, ModelDecl
from plans.hardware import gpu_spec
from plans.layout import Layout, Mesh
from plans.model import Head, ModelSpec
from plans.sharding import slicing, stage_layers

# What a plan on Hopper says while its efficiencies come from another architecture: the one
# published table of this stack on H100s at small scale (Megatron-Core r0.8.0, the Megatron-LM
# README; `bench/cost_accuracy.py`) ran slower than costed, and nothing here has measured why
# (`tests/test_cost_realism.py` keeps the figures equal to the bench's).
HOPPER_CAVEAT = ("training optimistic on Hopper: Megatron-Core's published H100 runs of 1.7B and 7.1B GPTs took 18% "
                 "and 16% longer than costed, NeMo's of Llama 3.1 8B-405B and GPT-3 175B 1-8% (README, Current limits)")

# Host-side tensor ops per slice a reallocation packs, unpacks or copies (`runtime.realloc`: index
# the source, slice the flat buffer, view it, copy).
REALLOC_PIECE_OPS = 4
LOGIT_INFER_BYTES = 6  # fp16 logits and fp32 log-softmax
# Of a host link's raw rate (`GpuSpec.host_gbps`, after line encoding), what a pinned copy moves:
# PCIe's transaction-layer packets carry 256 bytes of payload behind about 24 bytes of header,
# sequence number and framing (0.91), and acknowledgement and flow-control packets take a few
# percent more of the link.
HOST_COPY_EFFICIENCY = 0.85
# What `Layout.offload` keeps in host memory between calls, and how many times a call copies it
# across the host link: optimizer states go in before the step and come back after it; a frozen
# model's weights only go in (the host copy stays valid).
OFFLOADED = {"optimizer": ("optimizer", 2), "weights": ("params", 1)}


@dataclass(frozen=True)
class CallCost:
    """Estimated time and per-rank memory of one call under one placement."""

    time_s: float
    # What stays on each rank between calls: parameters (+ gradients and optimizer states when
    # trainable), less what `Layout.offload` keeps in host memory instead (`host_mem_bytes`).
    state_mem_bytes: int
    peak_mem_bytes: int  # state plus the call's transient peak (offloaded states, activations, KV cache, buffers)
    model_flops: float  # useful FLOPs of the call (see the module docstring)
    breakdown_s: dict[str, float] = field(default_factory=dict)
    mem_breakdown_bytes: dict[str, int] = field(default_factory=dict)
    host_mem_bytes: int = 0  # host memory per rank holding offloaded states between calls


@dataclass(frozen=True)
class ReallocCost:
    """Bytes sent between distinct ranks to move a model between placements, and the time it takes."""

    bytes: int
    time_s: float


def matmul_params(spec: ModelSpec, head: Head = "lm") -> int:
    """N of the FLOPs convention: decoder layers plus the output head's matrix; of a mixture of
    experts, the parameters a token uses (its `num_experts_per_tok` experts, not all of them)."""
    h = spec.hidden_size
    layers = spec.num_hidden_layers * mean_layer_params(spec, 1, active=True)
    return int(layers + (spec.vocab_size * h if head == "lm" else h))


def model_flops(spec: ModelSpec, call: Call, *, head: Head = "lm") -> float:
    """Useful FLOPs of a call by the 6N + attention convention."""
    n, lh = matmul_params(spec, head), spec.num_hidden_layers * spec.hidden_size
    if call.kind == "train":
        return call.seqs * call.seq_len * (6.0 * n + 12.0 * lh * call.seq_len)
    if call.kind == "inference":
        return call.seqs * call.seq_len * (2.0 * n + 4.0 * lh * call.seq_len)
    p = call.prompt_len
    dist = length_dist(call.response_len, call.gen_len)
    g = dist.mean if dist is not None else call.gen_len  # the tokens really generated
    ctx_sum = p * p + g * p + g * (g + 1) / 2  # prefill tokens see the prompt; decoded token i sees p + i
    return call.seqs * (2.0 * n * (p + g) + 4.0 * lh * ctx_sum)


def _peak_stage_candidates(counts: tuple[tuple[int, int], ...]) -> list[int]:
    """The pipeline stages one of which holds a train call's peak, in order: the first and last
    (embeddings, head and logits) and, of the stages between holding the same (dense, sparse)
    layers, the earliest: it holds the same states and, in 1F1B, the most micro-batches in flight
    (`in_flight_microbatches` falls with the stage), so the later ones never peak higher."""
    pp = len(counts)
    seen: set[tuple[int, int]] = set()
    out = [0]
    for st in range(1, pp - 1):
        if counts[st] not in seen:
            seen.add(counts[st])
            out.append(st)
    return out + ([pp - 1] if pp > 1 else [])


def _state_bytes(mem: dict[str, int]) -> int:
    """The model states of a call's memory (what stays resident between calls)."""
    return sum(v for k, v in mem.items() if k in ("params", "grads", "optimizer"))


def _window_max(values: np.ndarray, width: int) -> np.ndarray:
    """The largest of every `width` consecutive `values` (one per window start), by doubling."""
    out, span = values, 1
    while 2 * span <= width:
        out = np.maximum(out[:-span], out[span:])
        span *= 2
    return np.maximum(out[: len(values) - width + 1], out[width - span: width - span + len(values) - width + 1])


class CostModel:
    """Estimates over one cluster with one calibration and one framework's kernels."""

    def __init__(self, cluster: ClusterSpec, calibration: Calibration | None = None, *,
                 framework: str | Framework = "torch", busy: int | None = None) -> None:
        self.cluster = cluster
        self.calibration = calibration or default_calibration(cluster.gpu)
        self.framework = resolve_framework(framework)
        self.busy = busy  # ranks of each node at work (None: all of them), for `at_busy`
        hw = effective_hardware(cluster, self.calibration, busy=busy)
        if not self.framework.gpu_calibrated and cluster.gpu != "cpu":  # a CPU calibration measured the runtime itself
            share = uncalibrated_attention_share(cluster.sheet.arch)
            hw = dataclasses.replace(hw, attn_flops=min(hw.attn_flops, share * hw.peak_flops))
        # The attention kernel's published speed by head dim and length: under that rate as a
        # ceiling, or through a GPU profile's measured point.
        kernel = self.attention_kernel()
        if kernel is not None and self.profiled():
            hw = dataclasses.replace(hw, attn_kernel=kernel, arch=cluster.sheet.arch, attn_anchor=attention_anchor(
                kernel, cluster.sheet.arch, measured_flops=hw.attn_flops, peak_flops=hw.peak_flops,
                sm_count=hw.sm_count))
        elif kernel is not None:
            hw = dataclasses.replace(hw, attn_kernel=kernel, arch=cluster.sheet.arch, attn_cap_flops=hw.attn_flops)
        self.hw: Hardware = hw
        self._calls: dict[tuple, CallCost] = {}
        self._reallocs: dict[tuple, ReallocCost] = {}
        self._floors: dict[tuple, float] = {}  # `realloc_floor_s`
        self._floors_anywhere: dict[tuple, float] = {}  # `realloc_floor_anywhere_s`
        self._states: dict[tuple, dict[str, int]] = {}  # `_state`
        self._nccl: dict[tuple, int] = {}  # `_outside_tensors`
        self._train_mem: dict[tuple, dict[str, int]] = {}  # `_train_memory_at`
        self._train_live: dict[tuple, tuple] = {}  # `_train_transients`
        self._at_busy: dict[int, CostModel] = {}
        self._decl_ids: dict[int, tuple[ModelDecl, int]] = {}  # `_decl_key`
        self._decl_keys: dict[ModelDecl, int] = {}

    def _decl_key(self, decl: ModelDecl) -> int:
        """A small integer for `decl` in the caches' keys, the same for equal declarations: hashing
        a declaration hashes its whole `ModelSpec`, and the candidate search looks up tens of
        thousands of keys. Found by identity first (each object is kept, so its id stays its own)."""
        hit = self._decl_ids.get(id(decl))
        if hit is None or hit[0] is not decl:
            hit = self._decl_ids[id(decl)] = (decl, self._decl_keys.setdefault(decl, len(self._decl_keys)))
        return hit[1]

    @property
    def shares_cores(self) -> bool:
        """Whether a node's ranks time-share its cores when all of them work (a CPU profiled with
        fewer cores than ranks x threads). Every cost is priced with all ranks at work; a call
        then runs faster while fewer of its node's ranks work (`at_busy`, `planner.simulate`)."""
        return core_share(self.cluster, self.calibration) < 1.0

    @property
    def drifts(self) -> bool:
        """Whether ranks drift apart between collectives (time-shared cores with a profiled skew),
        so a message between calls also waits for the end of the work before it
        (`data_transfer_s`'s `after_s`); never on GPUs."""
        return self.hw.skew_s_per_sqrt_s > 0

    def at_busy(self, busy: int) -> CostModel:
        """This cost model while only `busy` ranks of each node work (itself when that changes
        nothing: all ranks busy, or ranks that do not share cores)."""
        if self.busy is not None:
            raise ValueError("at_busy is asked of the cost model priced with all ranks at work")
        if busy >= self.cluster.gpus_per_node or not self.shares_cores:
            return self
        if busy not in self._at_busy:
            self._at_busy[busy] = CostModel(self.cluster, self.calibration, framework=self.framework, busy=busy)
        return self._at_busy[busy]

    def attention_kernel(self) -> str | None:
        """The fused attention kernel whose published speed by length times this stack's attention
        on this GPU (`cost_models.attention`), or None: the calibration's rate at every length (a
        CPU, or an architecture without published curves)."""
        arch = self.cluster.sheet.arch
        kernel = dict(self.framework.attention_kernels).get(arch)
        if kernel is None or not has_curves(kernel, arch) or self.cluster.gpu == "cpu":
            return None
        return kernel

    def profiled(self) -> bool:
        """Whether the calibration is a GPU profile, which measured its own peak and attention."""
        return self.calibration.hardware.peak_tflops is not None

    def costed_for(self) -> str:
        """The stack these costs describe and what backs its efficiencies (stated in every plan)."""
        fw, cal = self.framework, self.calibration
        stack = "the planner runtime" if fw.name == "torch" else fw.name
        if self.cluster.gpu == "cpu" or cal.gpu == self.cluster.gpu and cal.framework == fw.name:
            return f"{stack} (framework {fw.name}), calibrated: {cal.source or 'no source recorded'}"
        runs = f"{cal.framework} runs" + (f" on {cal.fitted_on}" if cal.fitted_on else "")
        if matmul_ceiling_ratio(self.cluster.sheet, cal) != 1.0:
            runs += f" (GEMMs at the same share of the {self.cluster.gpu}'s matmul ceiling)"
        kernel = self.attention_kernel()
        attention = (f"attention at {KERNEL_NAMES[kernel]}'s published speed by head dim and sequence length"
                     if kernel is not None else None)
        if fw.gpu_calibrated:
            hopper = self.cluster.sheet.arch == "hopper" and not self.profiled() and cal.fitted_on is not None \
                and gpu_spec(cal.fitted_on).arch != "hopper"
            return (f"{stack} (framework {fw.name}), efficiencies fitted on {runs}" + (f"; {attention}" if attention else "")
                    + (f"; {HOPPER_CAVEAT}" if hopper else ""))
        cap = f"{uncalibrated_attention_share(self.cluster.sheet.arch):.0%} of the {self.cluster.gpu} peak"
        attention = f"{attention}, at most {cap}" if attention else f"attention at FlashAttention-2's published {cap}"
        return (f"{stack} (framework {fw.name}), not yet calibrated on a GPU: GEMM and bandwidth efficiencies fitted "
                f"on {runs}, {attention}; run bench/gpu_check.sh")

    # ---- calls ---------------------------------------------------------------------------

    def call_cost(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout, *,
                  decode_layout: Layout | None = None) -> CallCost:
        """Time and per-rank memory of `call` on `mesh` with `layout` (decode with `decode_layout`)."""
        gpn = self.cluster.gpus_per_node
        # An inference call's cost reads only whether it returns per-token log-probs (scores and
        # values cost alike), unless the stack serves its reward models on the rollout engine.
        returns = call.returns == "logprobs" if call.kind == "inference" and not self.framework.layouts.served_scores \
            else call.returns
        key = (call.kind, call.seqs, call.seq_len, call.gen_len, call.response_len, call.minibatches, returns,
               self._decl_key(decl),
               mesh.first % gpn if mesh.size < gpn else 0, mesh.size, layout, decode_layout)
        hit = self._calls.get(key)
        if hit is None:
            if layout.offload != "none":  # the same call, plus the host copies
                base = self.call_cost(call, decl, mesh, layout.on_device, decode_layout=decode_layout)
                hit = self._offloaded(base, layout.offload)
            else:
                hit = self._call_cost(call, decl, mesh, layout, decode_layout)
            self._calls[key] = hit
        return hit

    def _call_cost(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout,
                   decode_layout: Layout | None) -> CallCost:
        if layout.size != mesh.size:
            raise PlannerError(f"call {call.name!r}: layout {layout.short()} needs {layout.size} ranks, mesh has {mesh.size}")
        spec, fw, hw = decl.spec, self.framework, self.hw
        topo = Topology(mesh.first, mesh.size, self.cluster.gpus_per_node)
        head: Head = decl.head
        cv = decl.expert_load_cv
        if call.kind == "train":
            step = train_step(spec, fw, hw, layout, topo, head=head, seqs=call.step_seqs,
                              seq_len=call.seq_len, load_cv=cv)
            times = {k: v * call.minibatches for k, v in step.parts.items()}
            mem = self._train_memory_at(call, decl, mesh, layout)
        elif call.kind == "inference":
            served = call.returns == "scores" and fw.layouts.served_scores  # on the rollout engine's kernels
            times = forward_pass(spec, fw.for_rollouts() if served else fw, hw, layout, topo, head=head, seqs=call.seqs,
                                 seq_len=call.seq_len, load_cv=cv).parts
            mem = self._forward_memory(decl, layout, topo, seqs=call.seqs, seq_len=call.seq_len,
                                       logits="all" if call.returns == "logprobs" else "none")
        else:
            dec = decode_layout or layout
            parts: StepTimes = generate_times(spec, fw, hw, layout, dec, topo, seqs=call.seqs,
                                              prompt_len=call.prompt_len, gen_len=call.gen_len, load_cv=cv,
                                              lengths=length_dist(call.response_len, call.gen_len))
            times = dict(parts.parts)
            if dec != layout:  # the weights and the prefilled KV cache move to the decode layout
                times["reshard"] = (times.get("reshard", 0.0) + self.realloc_cost(decl, (mesh, layout), (mesh, dec)).time_s
                                    + self.kv_reshard_cost(decl, call, mesh, layout, dec).time_s)
            mem = self._generate_memory(decl, layout, dec, call, topo)
        state = _state_bytes(mem)
        return CallCost(
            time_s=sum(times.values()),
            state_mem_bytes=state,
            peak_mem_bytes=sum(mem.values()),
            model_flops=model_flops(spec, call, head=head),
            breakdown_s={k: v for k, v in sorted(times.items()) if v > 0},
            mem_breakdown_bytes=dict(sorted(mem.items())),
        )

    def train_peak_bytes(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout) -> int:
        """`call_cost(call, decl, mesh, layout).peak_mem_bytes` of a train call whose states stay
        on the GPU, without pricing its time: the candidate search skips the time of layouts that
        do not fit (about half of a large model's)."""
        return sum(self._train_memory_at(call, decl, mesh, layout).values())

    def train_state_bytes(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout) -> int:
        """`call_cost(...).state_mem_bytes` of a train call whose states stay on the GPU, without
        pricing its time."""
        return _state_bytes(self._train_memory_at(call, decl, mesh, layout))

    def train_time_floor_s(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout) -> float:
        """A lower bound on `call_cost(call, decl, mesh, layout).time_s` of a train call with AdamW
        and its states on the GPU: the step's pipeline part alone (compute, the collectives inside
        the pipeline, the bubble), which its ZeRO stages share (`training.train_step`); the gradient
        reduction, optimizer and step overhead only add to it. Summed in the same order as the
        call's time, so it is no larger in floating point either."""
        topo = Topology(mesh.first, mesh.size, self.cluster.gpus_per_node)
        parts = pipeline_parts(decl.spec, self.framework, self.hw, layout, topo, head=decl.head, seqs=call.step_seqs,
                               seq_len=call.seq_len, load_cv=decl.expert_load_cv)
        return sum(v * call.minibatches for _, v in parts)

    def _train_memory_at(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout) -> dict[str, int]:
        topo = Topology(mesh.first, mesh.size, self.cluster.gpus_per_node)
        key = (call.step_seqs, call.seq_len, self._decl_key(decl), topo.first % topo.gpus_per_node if mesh.size < topo.gpus_per_node else 0,
               mesh.size, layout)
        hit = self._train_mem.get(key)
        if hit is None:
            hit = self._train_mem[key] = self._train_memory(decl, layout, topo, seqs=call.step_seqs, seq_len=call.seq_len)
        return dict(hit)

    def _offloaded(self, cost: CallCost, offload: str) -> CallCost:
        """`cost` of a call whose home keeps `offload` (`Layout.offload`) in host memory between
        calls: that much less resident, the same peak, the host copies added to its time."""
        kept, trips = OFFLOADED[offload]
        host = cost.mem_breakdown_bytes.get(kept, 0)
        copy_s = trips * self.host_copy_s(host)
        breakdown = dict(sorted({**cost.breakdown_s, "offload": copy_s}.items())) if copy_s > 0 else cost.breakdown_s
        return dataclasses.replace(cost, time_s=cost.time_s + copy_s, state_mem_bytes=cost.state_mem_bytes - host,
                                   breakdown_s=breakdown, host_mem_bytes=host)

    def host_copy_s(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` per rank between host and device memory, every GPU of the node
        copying at once (`GpuSpec.host_gbps`, at `HOST_COPY_EFFICIENCY`)."""
        return nbytes * 8 / (self.cluster.sheet.host_gbps * 1e9 * HOST_COPY_EFFICIENCY)

    def split_floor_s(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout, decode_layout: Layout) -> float:
        """A lower bound on `call_cost(call, decl, mesh, layout, decode_layout=...)`'s time for a
        generate call: its prefill and decode without moving the weights and the KV cache between
        the two layouts (the costly part to price, skipped where this bound already loses)."""
        topo = Topology(mesh.first, mesh.size, self.cluster.gpus_per_node)
        parts = generate_times(decl.spec, self.framework, self.hw, layout, decode_layout, topo, seqs=call.seqs,
                               prompt_len=call.prompt_len, gen_len=call.gen_len, load_cv=decl.expert_load_cv,
                               lengths=length_dist(call.response_len, call.gen_len))
        return sum(parts.parts.values())

    def state_floor_bytes(self, decl: ModelDecl, layout: Layout) -> int:
        """A lower bound on `call_cost(...).peak_mem_bytes` of any call of `decl` under `layout`:
        the model states of its fullest stage, which every call holds while it runs (a layout
        whose states alone exceed the memory need not be costed)."""
        return sum(self._state(decl, layout.on_device).values())

    # ---- memory --------------------------------------------------------------------------

    def _stage_params(self, spec: ModelSpec, head: Head, layout: Layout) -> tuple[tuple[float, float], ...]:
        """(dense, routed-expert) parameters of one rank of each stage."""
        return stage_param_counts(spec, head, layout)

    def _state(self, decl: ModelDecl, layout: Layout, stage: int | None = None) -> dict[str, int]:
        """Model states of one rank of `stage` (None: of the stage holding the most); a new dict
        (callers add to it)."""
        # What the states read of the layout: how it splits parameters and shards states.
        key = (self._decl_key(decl), layout.tp, layout.pp, layout.interleave, layout.dp, layout.cp, layout.zero, layout.ep, layout.etp,
               layout.galore, stage)
        hit = self._states.get(key)
        if hit is None:
            hit = self._states[key] = self._state_of(decl, layout, stage)
        return dict(hit)

    def _state_of(self, decl: ModelDecl, layout: Layout, stage: int | None) -> dict[str, int]:
        counts = self._stage_params(decl.spec, decl.head, layout)
        at = stage if stage is not None else max(range(len(counts)), key=lambda i: sum(counts[i]))
        dense, experts = counts[at]
        galore = None
        if layout.galore is not None and decl.trainable:
            galore = galore_stage(decl.spec, layout.galore,
                                  *stage_layer_counts(decl.spec, layout.pp, layout.interleave)[at], tp=layout.tp)
        return state_bytes(dense, self.framework, layout=layout, trainable=decl.trainable, expert_params=experts,
                           galore=galore)

    @staticmethod
    def _moe(decl: ModelDecl, layout: Layout, tokens: int) -> ExpertLoad | None:
        return expert_load(decl.spec, layout, tokens=tokens, load_cv=decl.expert_load_cv) if decl.spec.moe_layers else None

    def _train_memory(self, decl: ModelDecl, layout: Layout, topo: Topology, *, seqs: int, seq_len: int) -> dict[str, int]:
        spec, fw = decl.spec, self.framework
        kept = fw.zero3_keeps_gathered and layout.zero == 3 and layout.recompute != "full" and fw.zero_ranks(layout) > 1
        # A stack that keeps the gathered weights holds them at the forward's end, with gathers but
        # no reduce-scatters under way; in backward it scatters but does not gather again.
        gathers, both = self._zero3_buffer(spec, layout), self._zero3_buffer(spec, layout, training=True)
        zero3 = max(gathers, both - gathers) if kept else both
        counts = self._stage_params(spec, decl.head, layout)
        # The runtime on a GPU casts its fp32 weights to bf16 in each forward; the matmuls keep the casts.
        casts = fw.layer_activations == "autocast" and fw.param_bytes > 2 and self.cluster.gpu != "cpu"
        layer_counts = stage_layer_counts(spec, layout.pp, layout.interleave)
        best: dict[str, int] = {}
        best_s = -1
        for st, activations, logits, buffers in self._train_transients(decl, layout, seqs=seqs, seq_len=seq_len):
            mem = self._state(decl, layout, st)
            mem["activations"] = activations
            if logits is not None:
                mem["logits"] = logits
            mem["buffers"] = int(buffers + zero3)
            in_flight = in_flight_microbatches(layout, st, layout.micro_batches)
            if kept:  # every micro-batch in flight keeps its own compute-dtype copies (2 bytes a weight)
                mem["gathered"] = int(2 * sum(counts[st]) * in_flight)
            elif casts and layout.recompute != "full":  # ... of its layers' matrices, cast by autocast
                nd, ns = layer_counts[st]
                sparse = layer_cast_params(spec, sparse=True, tp=layout.tp, ep=layout.ep, etp=layout.etp) if ns else 0.0
                mem["weight_casts"] = int(2 * (nd * layer_cast_params(spec, sparse=False, tp=layout.tp) + ns * sparse)
                                          * in_flight)
            mem = self._compute_dtype(mem, exact=("activations",))  # counted at the compute dtype already
            step = self._step_copy_bytes(decl, layout, counts[st])
            if step:  # the step runs once the micro-batches' tensors are gone
                over = step - sum(mem.get(k, 0) for k in TRANSIENT if k != "step")
                if over > 0:
                    mem["step"] = int(over)
            # The stage with the most, outside tensors included; of those only the fragmentation
            # differs between stages (`_outside_tensors`), so the rest is added to the winner alone.
            total = sum(mem.values()) + (fragmentation_bytes(mem) if self.cluster.gpu != "cpu" else 0)
            if total > best_s:
                best, best_s = mem, total
        best.update(self._outside_tensors(layout, best, topo, moe=spec.is_moe))
        return best

    def _train_transients(self, decl: ModelDecl, layout: Layout, *, seqs: int,
                          seq_len: int) -> tuple[tuple[int, int, int | None, float], ...]:
        """Per stage that may hold a train call's peak (`_peak_stage_candidates`): (stage, its
        activations, its logits or None, its pipeline buffers before ZeRO-3's), which the ZeRO
        stage does not change (cached without it)."""
        key = (self._decl_key(decl), layout.model_copy(update={"zero": 0}) if layout.zero else layout, seqs, seq_len)
        hit = self._train_live.get(key)
        if hit is None:
            hit = self._train_live[key] = self._train_transients_of(decl, key[1], seqs=seqs, seq_len=seq_len)
        return hit

    def _train_transients_of(self, decl: ModelDecl, layout: Layout, *, seqs: int,
                             seq_len: int) -> tuple[tuple[int, int, int | None, float], ...]:
        spec, fw = decl.spec, self.framework
        b, m, tp, pp = microbatch_size(seqs, layout), layout.micro_batches, layout.tp, layout.pp
        s_loc = seq_len // layout.cp
        moe = self._moe(decl, layout, b * s_loc)

        compute = 4 if self.cluster.gpu == "cpu" else 2  # a CPU run computes in fp32

        def act(recompute: str, sparse: bool = False) -> float:
            return layer_activation_bytes(spec, fw, b=b, s=s_loc, tp=tp, sp=layout.sequence_parallel, recompute=recompute,
                                          moe=moe if sparse else None, compute_bytes=compute)

        kinds = [False] + ([True] if moe is not None else [])
        per_layer = {k: act(layout.recompute, k) for k in kinds}
        # Recomputing a layer makes what it did not keep again, one layer at a time.
        if layout.recompute == "full":
            working = max(act("none", k) for k in kinds)
        elif layout.recompute == "selective":
            working = max(act("none", k) - per_layer[k] for k in kinds)
        else:
            working = 0.0
        counts = stage_layer_counts(spec, pp, layout.interleave)
        act_bytes = 2.0 * b * s_loc * spec.hidden_size / tp
        out = []
        for st in _peak_stage_candidates(counts):
            nd, ns = counts[st]
            kept = nd * per_layer[False] + (ns * per_layer[True] if ns else 0.0)
            if fw.layer_activations != "fused" and st == pp - 1:  # the final norm and the head's input
                kept += eager_head_saved_bytes(spec, head=decl.head, b=b, s=s_loc, tp=tp, sp=layout.sequence_parallel,
                                               compute_bytes=compute, style=fw.layer_activations)
            logits = self._logits_bytes(self.framework.logit_train_bytes, b * s_loc * spec.vocab_size / tp) \
                if st == pp - 1 and decl.head == "lm" else None
            out.append((st, int(kept * in_flight_microbatches(layout, st, m) + working), logits,
                        4 * act_bytes if pp > 1 else 0))
        return tuple(out)

    def _logits_bytes(self, per_logit: int, logits: float) -> int:
        """The head's live logits: all of them, or one chunk where the framework makes them in chunks."""
        chunk = self.framework.logits_chunk_elements
        return int(per_logit * (logits if chunk is None else min(logits, chunk)))

    def _compute_dtype(self, mem: dict[str, int], *, exact: tuple[str, ...] = ()) -> dict[str, int]:
        """`mem` with the tensors a call computes (activations, logits, KV cache) in the runtime's
        compute dtype: the byte counts are bf16's; a CPU run computes in fp32, twice as many (except
        the keys in `exact`, counted at the compute dtype already)."""
        if self.cluster.gpu != "cpu":
            return mem
        return {k: 2 * v if k in ("activations", "logits", "kv_cache", "gathered") and k not in exact else v
                for k, v in mem.items()}

    def _outside_tensors(self, layout: Layout, mem: dict[str, int], topo: Topology, *, moe: bool = False) -> dict[str, int]:
        """Context and workspaces; on GPUs also NCCL buffers of the layout's communicators and the
        allocator's fragmentation of `mem`'s transient tensors (`cost_models.memory`)."""
        if self.cluster.gpu == "cpu":  # no CUDA context; gloo and malloc: neither buffer pool is there
            return {}
        key = (layout.tp, layout.cp, layout.dp, layout.ep, layout.etp, layout.pp, topo, moe)
        nccl = self._nccl.get(key)
        if nccl is None:
            kinds = ("tp", "cp", self.framework.zero_group(layout)) + (("ep", "edp") if moe else ())
            used = [g for g in (topo.group(layout, k) for k in kinds) if g.n > 1]
            nccl = self._nccl[key] = nccl_bytes(used, p2p_peers=min(2, layout.pp - 1))
        return {"reserve": reserve_bytes(self.cluster.mem_bytes), "nccl": nccl, "fragmentation": fragmentation_bytes(mem)}

    def _step_copy_bytes(self, decl: ModelDecl, layout: Layout, stage_params: tuple[float, float]) -> float:
        """What a ZeRO-1/2 step of a stack that gathers the updated buffer from a copy of each
        rank's part (`Framework.zero12_step_copy`) holds beside the states: that copy, and on CPU
        gloo's staging of the gathered whole, which it allocates before copying into the buffer."""
        fw = self.framework
        dp = fw.zero_ranks(layout)
        if not (fw.zero12_step_copy and decl.trainable and layout.zero in (1, 2) and dp > 1):
            return 0.0
        whole = sum(stage_params) * fw.param_bytes
        return whole / dp + (whole if self.cluster.gpu == "cpu" else 0.0)

    def _zero3_buffer(self, spec: ModelSpec, layout: Layout, *, training: bool = False) -> float:
        """ZeRO-3's gathered layers in flight (`Framework.zero3_gather_layers`) and, in training, the
        gradients being reduce-scattered (`Framework.zero3_scatter_layers`), in layers' weights; none
        where nothing is sharded (the runtime's ZeRO-3 at dp 1, whose cp ranks hold whole weights)."""
        if layout.zero != 3 or self.framework.zero_ranks(layout) == 1:
            return 0.0
        fw = self.framework
        layers = fw.zero3_gather_layers + (fw.zero3_scatter_layers if training else 0.0)
        layer = layer_params_per_rank(spec, layout.tp)
        if spec.moe_layers:
            layer = max(layer, layer_params_per_rank(spec, layout.tp, sparse=True) +
                        expert_params_per_rank(spec, layout.ep, layout.etp))
        return layers * layer * fw.param_bytes

    def _forward_memory(self, decl: ModelDecl, layout: Layout, topo: Topology, *, seqs: int, seq_len: int, logits: str) -> dict[str, int]:
        """Inference or prefill: weights, one layer's live tensors and the head's logits per micro-batch.

        `logits` is "all" (per-token log-probs), "last" (prefill samples the next token) or "none".
        """
        spec, fw = decl.spec, self.framework
        b, tp = microbatch_size(seqs, layout), layout.tp
        s_loc = seq_len // layout.cp
        mem = self._state(decl, layout)
        moe = self._moe(decl, layout, b * s_loc)
        mem["activations"] = int(max(forward_working_bytes(spec, fw, b=b, s=s_loc, tp=tp, kv_len=seq_len, moe=m)
                                     for m in {None, moe}))
        if logits != "none":
            positions = s_loc if logits == "all" else 1
            mem["logits"] = self._logits_bytes(LOGIT_INFER_BYTES, b * positions * spec.vocab_size / tp)
        mem["buffers"] = int(self._zero3_buffer(spec, layout) + (4.0 * b * s_loc * spec.hidden_size / tp if layout.pp > 1 else 0))
        mem = self._compute_dtype(mem)
        mem.update(self._outside_tensors(layout, mem, topo, moe=spec.is_moe))
        return mem

    def _generate_memory(self, decl: ModelDecl, layout: Layout, dec: Layout, call: Call,
                         topo: Topology) -> dict[str, int]:
        """The larger of the prefill peak and the decode peak (see `cost_models.generation`)."""
        spec = decl.spec
        split = decode_split(call.seqs, dec)
        wave_seqs = -(-call.seqs // split.waves)
        pre_layers = max(len(x) for x in stage_layers(spec.num_hidden_layers, layout.pp, layout.interleave))
        pre = self._forward_memory(decl, layout, topo, seqs=wave_seqs, seq_len=call.prompt_len, logits="last")
        pre.update(self._compute_dtype({"kv_cache": int(kv_cache_bytes(
            spec, seqs=wave_seqs / layout.dp, ctx=call.prompt_len, layers=pre_layers, tp=layout.tp))}))  # cp ranks: whole
        layers = max(len(x) for x in stage_layers(spec.num_hidden_layers, dec.pp, dec.interleave))
        decode = self._state(decl, dec)
        decode["kv_cache"] = int(kv_cache_bytes(spec, seqs=split.resident_seqs, ctx=-(-call.seq_len // dec.cp),
                                                layers=layers, tp=dec.tp))  # KV-parallel decode: a share
        # The rows one decode step runs: a wave's, or under a paged cache every row an engine may
        # run at once (vLLM sizes its step's activations and logits for max_num_seqs).
        fw = self.framework.for_rollouts()
        step_rows = split.seqs_per_group
        if pages(fw, dec):
            step_rows = min(-(-call.seqs // dec.dp), fw.max_num_seqs or call.seqs)
        decode["logits"] = int(LOGIT_INFER_BYTES * step_rows * spec.vocab_size / dec.tp)
        moe = self._moe(decl, dec, step_rows)
        decode["activations"] = int(max(forward_working_bytes(spec, self.framework, b=step_rows, s=1,
                                                              tp=dec.tp, kv_len=call.seq_len, moe=m)
                                        for m in {None, moe}))
        if dec != layout:  # both placements' weights are live while the layout changes
            decode["buffers"] = pre["params"]
        decode = self._compute_dtype(decode)
        decode.update(self._outside_tensors(dec, decode, topo, moe=spec.is_moe))
        if dec != layout and "nccl" in pre:  # the prefill layout's communicators stay (none on a CPU)
            decode["nccl"] = max(decode.get("nccl", 0), pre["nccl"])
        return decode if sum(decode.values()) >= sum(pre.values()) else pre

    # ---- moving parameters and data --------------------------------------------------------

    def realloc_cost(self, decl: ModelDecl, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout]) -> ReallocCost:
        """Bytes and time to move `decl`'s parameters from placement `src` to `dst` (cached)."""
        src, dst = (src[0], slicing(src[1])), (dst[0], slicing(dst[1]))  # where the slices sit, nothing else
        key = (decl.spec, decl.head, src, dst)
        hit = self._reallocs.get(key)
        if hit is None:
            hit = self._realloc(decl, src, dst)
            self._reallocs[key] = hit
        return hit

    def _realloc(self, decl: ModelDecl, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout]) -> ReallocCost:
        # Every rank sends and receives its slices at once: the busiest NVLink port, or the busiest
        # node's network (its ranks' inter-node traffic summed), bounds the time; slices a rank
        # already holds are copied locally through HBM.
        if src == dst:
            return ReallocCost(0, 0.0)
        vol = rank_volumes(decl.spec, head=decl.head, src=src, dst=dst, gpus_per_node=self.cluster.gpus_per_node)
        return self._move_cost(vol, self.framework.param_bytes, dst[0].size)

    def realloc_floor_s(self, decl: ModelDecl, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout]) -> float:
        """A lower bound on `realloc_cost(decl, src, dst).time_s` that costs a fraction of it: the
        parts of `_move_cost` that do not depend on which rank sends what (`realloc_floor`).

        Every destination rank unpacks or copies each source slice its slices overlap (exactly
        the exact cost's receiving side), the busiest sender packs at least its share of the
        slices that cannot be local, and each rank receives what it needs beyond the most it can
        already hold: all of it when the meshes are disjoint, over NVLink when one node holds
        both meshes, over the network (summed per node) when they share no node, else over both
        links at once."""
        (smesh, slay), (dmesh, dlay) = (src[0], slicing(src[1])), (dst[0], slicing(dst[1]))
        if (smesh, slay) == (dmesh, dlay):
            return 0.0
        gpn = self.cluster.gpus_per_node
        # What the bound reads of the two meshes: the destination ranks inside the source mesh (a
        # run [a, b) of them), whether they share nodes, and where the destination's nodes begin.
        a = min(max(smesh.first - dmesh.first, 0), dmesh.size)
        b = min(max(smesh.first + smesh.size - dmesh.first, 0), dmesh.size)
        s_nodes = range(smesh.first // gpn, (smesh.first + smesh.size - 1) // gpn + 1)
        d_nodes = range(dmesh.first // gpn, (dmesh.first + dmesh.size - 1) // gpn + 1)
        apart = s_nodes.stop <= d_nodes.start or d_nodes.stop <= s_nodes.start
        one_node = len(s_nodes) == len(d_nodes) == 1 and s_nodes == d_nodes
        key = (decl.spec, decl.head, slay, dlay, smesh.size, a, b, apart, one_node, dmesh.first % gpn)
        hit = self._floors.get(key)
        if hit is None:
            hit = self._floors[key] = self._realloc_floor_s(decl, slay, dlay, smesh.size, (a, b), apart=apart,
                                                            one_node=one_node, offset=dmesh.first % gpn)
        return hit

    def _realloc_floor_s(self, decl: ModelDecl, slay: Layout, dlay: Layout, src_size: int, inside: tuple[int, int], *,
                         apart: bool, one_node: bool, offset: int) -> float:
        floor = realloc_floor(decl.spec, head=decl.head, src=slay, dst=dlay)
        gpn, hw, pb = self.cluster.gpus_per_node, self.hw, self.framework.param_bytes
        a, b = inside
        moved_pieces = floor.total_pieces - int(floor.tensors[a:b].sum())
        host_s = REALLOC_PIECE_OPS * hw.host_kernel_s * (int(floor.pieces.max(initial=0))
                                                         + max(0, -(-moved_pieces // src_size)))
        lack = floor.need.copy()
        lack[a:b] -= floor.own_max[a:b]
        if lack.max(initial=0) <= 0:
            return host_s
        if apart:  # every slice crosses the network
            per_node = np.bincount((offset + np.arange(len(floor.need))) // gpn, weights=floor.need)
            return float(per_node.max()) * pb / hw.node_net_bytes_s + hw.inter_latency_s + host_s
        if one_node:
            return float(lack.max()) * pb / hw.intra_bytes_s + hw.intra_latency_s + host_s
        return (float(lack.max()) * pb / (hw.intra_bytes_s + hw.node_net_bytes_s)
                + min(hw.intra_latency_s, hw.inter_latency_s) + host_s)

    def realloc_floor_anywhere_s(self, decl: ModelDecl, src: tuple[int, Layout], dst: tuple[int, Layout]) -> float:
        """A lower bound on `realloc_floor_s` for a mesh of `src[0]` GPUs and one of `dst[0]` GPUs
        wherever both sit (so on the exact cost too): what a search that has not placed the meshes
        yet may count (`planner.relax`). Identical slicings on meshes of one size cost nothing (they
        may be the same mesh).

        `realloc_floor_s` at one placement is the host's piece work plus, unless every destination
        rank already holds what it needs, the largest shortfall over a link. Over every placement:
        the fewest slices that cannot be local (the destination ranks inside the source mesh are a
        run of them, at most as long as the smaller mesh), plus the smaller of the least largest
        shortfall over any such run (over NVLink alone when both meshes fit in one node, else over
        both links at once) and the least per-node volume with the meshes apart."""
        (ssize, slay), (dsize, dlay) = (src[0], slicing(src[1])), (dst[0], slicing(dst[1]))
        if ssize == dsize and slay == dlay:
            return 0.0
        key = (decl.spec, decl.head, slay, dlay, ssize, dsize)
        hit = self._floors_anywhere.get(key)
        if hit is None:
            hit = self._floors_anywhere[key] = self._realloc_floor_anywhere_s(decl, slay, dlay, ssize, dsize)
        return hit

    def _realloc_floor_anywhere_s(self, decl: ModelDecl, slay: Layout, dlay: Layout, ssize: int, dsize: int) -> float:
        floor = realloc_floor(decl.spec, head=decl.head, src=slay, dst=dlay)
        gpn, hw, pb = self.cluster.gpus_per_node, self.hw, self.framework.param_bytes
        run = min(ssize, dsize)  # the most destination ranks inside the source mesh
        ends = np.concatenate([[0], np.cumsum(floor.tensors)])
        local = int((ends[run:] - ends[:-run]).max())
        moved_pieces = max(0, floor.total_pieces - local)
        host_s = REALLOC_PIECE_OPS * hw.host_kernel_s * (int(floor.pieces.max(initial=0))
                                                         + -(-moved_pieces // ssize))
        need = floor.need.astype(np.float64)
        inside = _window_max(need - floor.own_max, run)  # per run start
        before = np.maximum.accumulate(np.concatenate([[0.0], need]))[: len(inside)]  # ranks before the run
        after = np.maximum.accumulate(np.concatenate([need, [0.0]])[::-1])[::-1][run:]  # ranks after it
        lack = float(np.maximum(inside, np.maximum(before, after)).min())
        if lack <= 0:
            return host_s
        if ssize <= gpn and dsize <= gpn:
            near = lack * pb / hw.intra_bytes_s + hw.intra_latency_s
        else:
            near = lack * pb / (hw.intra_bytes_s + hw.node_net_bytes_s) + min(hw.intra_latency_s, hw.inter_latency_s)
        # Apart: the busiest node's need, for the destination's first rank at each offset in a node.
        offsets = np.arange(min(gpn, dsize))
        bins = (gpn - 1 + dsize) // gpn + 1
        node = (offsets[:, None] + np.arange(dsize)[None, :]) // gpn + bins * offsets[:, None]
        per_node = np.bincount(node.ravel(), weights=np.broadcast_to(need, node.shape).ravel(), minlength=bins * len(offsets))
        apart = float(per_node.reshape(len(offsets), bins).max(axis=1).min())
        return host_s + min(near, apart * pb / hw.node_net_bytes_s + hw.inter_latency_s)

    def kv_reshard_cost(self, decl: ModelDecl, call: Call, mesh: Mesh, prefill: Layout, decode: Layout) -> ReallocCost:
        """Bytes and time to move a generate call's prefilled KV cache (every prompt position but
        the last, which the decode layout runs as its first step) from its prefill layout to its
        decode layout (`plans.sharding.kv_transfer_plan`, what the runtime moves)."""
        if prefill == decode or call.prompt_len <= 1:
            return ReallocCost(0, 0.0)
        vol = kv_volumes(decl.spec, rows=call.seqs, positions=call.prompt_len - 1, src=(mesh, prefill),
                         dst=(mesh, decode), gpus_per_node=self.cluster.gpus_per_node)
        return self._move_cost(vol, KV_BYTES, mesh.size)

    def _move_cost(self, vol: RankVolumes, pb: int, dst_size: int) -> ReallocCost:
        gpn, hw = self.cluster.gpus_per_node, self.hw
        local_s = 2.0 * pb * vol.local_numel / max(1, dst_size) / hw.mem_bytes_s
        # The host packs every slice it sends before the messages go and unpacks (or copies) every
        # slice it gets after: the busiest packer, then the busiest unpacker.
        assert vol.send_pieces is not None and vol.recv_pieces is not None and vol.local_pieces is not None
        op_s = REALLOC_PIECE_OPS * hw.host_kernel_s
        host_s = op_s * (int(vol.send_pieces.max(initial=0)) + int((vol.recv_pieces + vol.local_pieces).max(initial=0)))
        if vol.moved_numel == 0:
            return ReallocCost(0, local_s + host_s)
        intra = max(int(vol.send_intra.max()), int(vol.recv_intra.max())) * pb / hw.intra_bytes_s
        nodes = (vol.first + np.arange(len(vol.send_inter))) // gpn
        node_send = np.bincount(nodes - nodes[0], weights=vol.send_inter)
        node_recv = np.bincount(nodes - nodes[0], weights=vol.recv_inter)
        inter = max(float(node_send.max()), float(node_recv.max())) * pb / hw.node_net_bytes_s
        latency = hw.inter_latency_s if inter > 0 else hw.intra_latency_s
        return ReallocCost(vol.moved_numel * pb, max(intra, inter) + latency + local_s + host_s)

    def data_transfer_s(self, nbytes: int, src_mesh: Mesh, dst_mesh: Mesh, *, after_s: float = 0.0) -> float:
        """Time to move `nbytes` of call outputs spread over `src_mesh` to the ranks of `dst_mesh`,
        sent at the end of a call of `after_s`: ranks that time-share cores drifted apart over it,
        and a message waits for its later end (`comm.skew_wait_s`; nothing on GPUs)."""
        if nbytes <= 0 or src_mesh == dst_mesh:
            return 0.0
        gpn, hw = self.cluster.gpus_per_node, self.hw
        wait = comm.skew_wait_s(after_s, 2, hw)
        src_nodes = {r // gpn for r in src_mesh.ranks}
        dst_nodes = {r // gpn for r in dst_mesh.ranks}
        if src_nodes == dst_nodes and len(src_nodes) == 1:
            lanes = min(src_mesh.size, dst_mesh.size)
            return nbytes / (lanes * hw.intra_bytes_s) + hw.intra_latency_s + wait
        lanes = min(len(src_nodes), len(dst_nodes))
        return nbytes / (lanes * hw.node_net_bytes_s) + hw.inter_latency_s + wait

    def group(self, mesh: Mesh, layout: Layout, kind: str) -> comm.Group:
        """Where `layout`'s `kind` group (tp, cp, dp, dpcp) sits on `mesh` (for reports and tests)."""
        return Topology(mesh.first, mesh.size, self.cluster.gpus_per_node).group(layout, kind)
