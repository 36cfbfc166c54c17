"""The estimator interface the planner uses (first, simple analytic version).

`CostModel(cluster).call_cost(call, decl, mesh, layout)` gives a call's time and memory per rank;
`realloc_cost` the time to move a model's parameters between two placements, from the exact
transfer plan of `plans.sharding`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from plans.cluster import ClusterSpec
from plans.graph import Call, ModelDecl
from plans.layout import Layout, Mesh
from plans.model import ModelSpec
from cost_models.transfer import rank_volumes

BYTES_PARAM = 2  # bf16 weights
BYTES_GRAD = 2
BYTES_OPTIM = 12  # fp32 master weights + Adam m and v
GEMM_EFFICIENCY = 0.45  # placeholder achieved fraction of peak
HBM_EFFICIENCY = 0.7
LINK_EFFICIENCY = 0.7
RESERVE_BYTES = 2 * 1024**3  # allocator fragmentation, CUDA context, workspaces


@dataclass(frozen=True)
class CallCost:
    """Estimated time and per-rank memory of one call under one placement."""

    time_s: float
    state_mem_bytes: int  # parameters, gradients, optimizer states resident under this layout
    peak_mem_bytes: int  # state plus the call's transient peak (activations, KV cache, buffers)
    model_flops: float  # useful FLOPs of the call (6N+attention convention for training)
    breakdown_s: dict[str, float] = field(default_factory=dict)
    mem_breakdown_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ReallocCost:
    bytes: int
    time_s: float


def _dense_params(spec: ModelSpec) -> int:
    """Parameters that take part in per-token GEMMs (everything but the embedding lookup)."""
    return spec.num_params() - spec.vocab_size * spec.hidden_size * (0 if spec.tied else 1)


def forward_flops(spec: ModelSpec, *, seqs: int, seq_len: int) -> float:
    """2 FLOPs per weight per token, plus causal attention scores and context (Kaplan et al. 2020)."""
    tokens = seqs * seq_len
    attn = 2 * 2 * spec.num_hidden_layers * spec.hidden_size * seq_len * tokens / 2
    return 2.0 * _dense_params(spec) * tokens + attn


class CostModel:
    """Estimates over one cluster."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.cluster = cluster
        sheet = cluster.sheet
        self.peak_flops = sheet.peak_tflops * 1e12
        self.hbm_bytes_s = sheet.hbm_gb_s * 1e9
        assert cluster.intra_node_gbps is not None and cluster.inter_node_gbps is not None
        self.intra_bytes_s = cluster.intra_node_gbps / 8 * 1e9
        self.inter_bytes_s = cluster.inter_node_gbps / 8 * 1e9 / cluster.gpus_per_node

    def _link_bytes_s(self, ranks: int) -> float:
        bw = self.intra_bytes_s if ranks <= self.cluster.gpus_per_node else self.inter_bytes_s
        return bw * LINK_EFFICIENCY

    def _allreduce_s(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) / ranks * nbytes / self._link_bytes_s(ranks)

    def state_bytes(self, decl: ModelDecl, layout: Layout, *, training: bool) -> dict[str, int]:
        shard = decl.spec.num_params(decl.head) / (layout.tp * layout.pp)
        dp = layout.dp
        params = shard * BYTES_PARAM / (dp if layout.zero >= 3 else 1)
        out = {"params": int(params)}
        if training:
            out["grads"] = int(shard * BYTES_GRAD / (dp if layout.zero >= 2 else 1))
            out["optimizer"] = int(shard * BYTES_OPTIM / (dp if layout.zero >= 1 else 1))
        return out

    def call_cost(self, call: Call, decl: ModelDecl, mesh: Mesh, layout: Layout) -> CallCost:
        spec = decl.spec
        n = layout.size
        h, L = spec.hidden_size, spec.num_hidden_layers
        seqs_per_rank = call.seqs / (layout.dp * layout.cp)
        training = call.kind == "train"
        state = self.state_bytes(decl, layout, training=decl.trainable)
        breakdown: dict[str, float] = {}
        mem: dict[str, int] = dict(state)
        if call.kind == "generate":
            prefill = forward_flops(spec, seqs=call.seqs, seq_len=call.prompt_len)
            breakdown["prefill"] = prefill / (n * self.peak_flops * GEMM_EFFICIENCY)
            weights = spec.num_params(decl.head) * BYTES_PARAM / (layout.tp * layout.pp)
            kv_per_token = 2 * L * spec.kv_heads * spec.head_dim * BYTES_PARAM / (layout.tp * layout.pp)
            avg_ctx = call.prompt_len + call.gen_len / 2
            step_bytes = weights + kv_per_token * seqs_per_rank * avg_ctx
            breakdown["decode"] = call.gen_len * layout.pp * step_bytes / (self.hbm_bytes_s * HBM_EFFICIENCY)
            act = seqs_per_rank * h * 2 * 4 * call.seq_len / max(1, call.gen_len)
            mem["kv_cache"] = int(kv_per_token * seqs_per_rank * call.seq_len)
            mem["activations"] = int(act)
            flops = prefill + forward_flops(spec, seqs=call.seqs, seq_len=call.gen_len)
        else:
            fwd = forward_flops(spec, seqs=call.seqs, seq_len=call.seq_len)
            flops, executed = fwd, fwd
            if training:
                flops = 3 * fwd
                executed = fwd * (3.0 + {"none": 0.0, "selective": 0.1, "full": 1.0}[layout.recompute])
            breakdown["compute"] = executed / (n * self.peak_flops * GEMM_EFFICIENCY)
            micro = max(1.0, seqs_per_rank / layout.micro_batches)
            act_layer = call.seq_len * micro * h * 34 * (1 if training else 0.1) / layout.tp
            if layout.recompute == "full":
                act_layer = call.seq_len * micro * h * 2
            mem["activations"] = int(act_layer * L / layout.pp * min(layout.pp, layout.micro_batches))
            if layout.pp > 1:
                breakdown["pp_bubble"] = breakdown["compute"] * (layout.pp - 1) / layout.micro_batches
            tokens_rank = seqs_per_rank * call.seq_len
            breakdown["tp_comm"] = (2 if not training else 4) * L / layout.pp * self._allreduce_s(tokens_rank * h * BYTES_PARAM, layout.tp)
            if training:
                grads = spec.num_params(decl.head) * BYTES_GRAD / (layout.tp * layout.pp)
                breakdown["dp_comm"] = call.minibatches * self._allreduce_s(grads, layout.dp) * (1.5 if layout.zero >= 3 else 1.0)
        mem["reserve"] = RESERVE_BYTES
        time_s = sum(breakdown.values())
        return CallCost(time_s, sum(state.values()), sum(mem.values()), flops, breakdown, mem)

    def realloc_cost(self, decl: ModelDecl, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout]) -> ReallocCost:
        return _realloc_cost(self, decl, src, dst)

    def data_transfer_s(self, nbytes: int, src: Mesh, dst: Mesh) -> float:
        if src == dst:
            return 0.0
        same_node = self.cluster.node_of(src.first) == self.cluster.node_of(dst.first) and max(src.size, dst.size) <= self.cluster.gpus_per_node
        bw = self.intra_bytes_s if same_node else self.inter_bytes_s
        return nbytes / (bw * LINK_EFFICIENCY)


@lru_cache(maxsize=65536)
def _realloc_cost(cm: CostModel, decl: ModelDecl, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout]) -> ReallocCost:
    vol = rank_volumes(decl.spec, head=decl.head, src=src, dst=dst, gpus_per_node=cm.cluster.gpus_per_node)
    if vol.moved_numel == 0:
        return ReallocCost(0, 0.0)
    intra, inter = cm.intra_bytes_s * LINK_EFFICIENCY, cm.inter_bytes_s * LINK_EFFICIENCY
    send = vol.send_intra * BYTES_PARAM / intra + vol.send_inter * BYTES_PARAM / inter
    recv = vol.recv_intra * BYTES_PARAM / intra + vol.recv_inter * BYTES_PARAM / inter
    return ReallocCost(vol.moved_numel * BYTES_PARAM, float(max(send.max(), recv.max())))
