"""Time of a training step and of a forward-only pass, per micro-batch, stage and pipeline.

One layer's forward for one micro-batch is its kernels (`cost_models.ops`) timed on the device
(`cost_models.compute`) plus its tensor-parallel collectives, which Megatron-style layers run on
the critical path: 2 all-reduces forward, 2 backward, 2 more when full recompute reruns the
forward. The host issues every kernel and collective; the longer of host and device bounds each
stretch (`compute.host_device_s`). Backward adds the recompute (none, the attention core, or
the whole forward) and the accumulation of the weight gradients.

A stage's micro-batch time is its layers plus the embedding (first stage) or head and loss (last)
plus its pipeline sends. 1F1B over m micro-batches then takes ``sum_s t_s + (m-1) max_s t_s``:
``(m + pp - 1) t`` for equal stages, the bubble ``(pp-1)/m`` of the steady state (Narayanan et al.
2021); interleaving with v chunks per stage cuts the fill and drain to ``1/v``. After the last
backward the data-parallel group reduces gradients (ring all-reduce over the slowest link; ZeRO-2
reduce-scatters every micro-batch; ZeRO-3 also gathers weights, prefetched under compute), then
the optimizer streams its states through HBM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from cost_models import comm
from cost_models.compute import host_device_s, kernel_time_s, kernels_time_s
from cost_models.framework import Framework
from cost_models.galore import galore_stage
from cost_models.hardware import Hardware
from cost_models.memory import stage_params
from cost_models.ops import (
    Comm,
    Kernel,
    embedding_work,
    expert_load_at,
    expert_params_per_rank,
    head_comm,
    head_work,
    host_launches,
    layer_params_per_rank,
    layer_work,
    lookup_comm,
    sample_comm,
)
from plans.layout import Layout
from plans.model import Head, ModelSpec
from plans.sharding import stage_layers

DDP_BUCKET_BYTES = 25 * 1024**2  # PyTorch DDP's default gradient bucket (bucket_cap_mb=25)


@dataclass(frozen=True)
class Topology:
    """Where a layout's process groups sit: the mesh's first rank and size, node size."""

    first: int
    size: int
    gpus_per_node: int

    def group(self, layout: Layout, kind: str) -> comm.Group:
        """The process group of `kind`: tp, cp, dp, dpcp (the gradient-reduction group), ep (the
        experts' all-to-all) or edp (the experts' gradient reduction)."""
        return _group(self, layout.tp, layout.cp, layout.dp, layout.ep, layout.etp, kind)

    def pp_cross_node(self, layout: Layout) -> bool:
        """Whether neighbouring pipeline stages sit on different nodes."""
        stage_ranks = layout.tp * layout.cp * layout.dp
        return layout.pp > 1 and (stage_ranks >= self.gpus_per_node or self.size > self.gpus_per_node)


@lru_cache(maxsize=65536)
def _group(topo: Topology, tp: int, cp: int, dp: int, ep: int, etp: int, kind: str) -> comm.Group:
    # Rank order is tp fastest, then cp, then dp: ranks sharing (pp, tp) coordinates are the
    # cp x dp grid, which strides by tp. Experts (`Layout.expert_coord`): etp fastest within a
    # stage, then ep, then edp.
    stride, n = {
        "tp": (1, tp),
        "cp": (tp, cp),
        "dp": (tp * cp, dp),
        "dpcp": (tp, dp * cp),
        "ep": (etp, ep),
        "edp": (etp * ep, tp * cp * dp // (ep * etp)),
    }[kind]
    return comm.group_at(first=topo.first, stride=stride, n=n, mesh_size=topo.size, gpus_per_node=topo.gpus_per_node)


@dataclass(frozen=True)
class Stretch:
    """Device time (kernels + collectives) and host time of some work."""

    device_s: float = 0.0
    comm_s: float = 0.0  # all collectives on the critical path, context- and expert-parallel ones included
    host_s: float = 0.0
    cp_comm_s: float = 0.0  # the exposed part of the context-parallel ring exchange
    ep_comm_s: float = 0.0  # the experts' all-to-alls

    def __add__(self, o: Stretch) -> Stretch:
        return Stretch(self.device_s + o.device_s, self.comm_s + o.comm_s, self.host_s + o.host_s,
                       self.cp_comm_s + o.cp_comm_s, self.ep_comm_s + o.ep_comm_s)

    def scale(self, k: float) -> Stretch:
        return Stretch(self.device_s * k, self.comm_s * k, self.host_s * k, self.cp_comm_s * k, self.ep_comm_s * k)

    def wall_s(self, hw: Hardware) -> float:
        return host_device_s(self.host_s, self.device_s + self.comm_s, hw)


@dataclass
class StepTimes:
    """A step's wall time by kind, seconds (summed into the call's breakdown)."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + value

    @property
    def total_s(self) -> float:
        return sum(self.parts.values())


def comm_time_s(c: Comm, g: comm.Group, hw: Hardware) -> float:
    if c.op == "all_reduce":
        return comm.all_reduce_s(c.bytes, g, hw)
    if c.op == "all_to_all":
        return comm.all_to_all_s(c.bytes, g, hw, c.leaving)
    if c.op in ("all_gather", "reduce_scatter"):
        return comm.all_gather_s(c.bytes, g, hw)
    # Ring attention: cp-1 neighbour exchanges carrying `bytes` in all, each paying a latency.
    one = comm.p2p_s(c.bytes, cross_node=g.spans_nodes, senders_per_node=g.per_node * g.concurrent, hw=hw)
    return one + max(0, g.n - 2) * (hw.inter_latency_s if g.spans_nodes else hw.intra_latency_s)


def stretch_of(kernels: tuple[Kernel, ...], comms: tuple[Comm, ...], groups: dict[str, comm.Group],
               hw: Hardware, *, hidden_comm: str | None = None, hide_under: float = 0.0,
               tp_pipelined: bool = False, dgrad_overlap: bool = False, host_kernel_s: float | None = None) -> Stretch:
    """Device, collective and host time of kernels and collectives run in order.

    Collectives of the `hidden_comm` group overlap compute worth `hide_under` seconds. With
    `tp_pipelined` (`Framework.tp_comm_overlap`) the tensor-parallel all-gathers and
    reduce-scatters are pipelined with the GEMMs beside them in tp chunks: the longer of one
    chunk of the transfers and what the GEMMs cannot cover stays exposed, and the rest slows the
    GEMMs it runs under (`comm.overlap_interference_s`). With `dgrad_overlap`
    (`Framework.tp_dgrad_overlap`) each input-gradient collective runs under the weight gradient
    it names (`Comm.under`), exposed only where longer. Each kernel costs the host `host_kernel_s`
    (default `Hardware.host_kernel_s`; a layer's backward and a decode step have their own).
    """
    dev = kernels_time_s(kernels, hw)
    t_comm = host = t_cp = t_ep = pipelined = 0.0
    issue_s = host_launches(kernels) * (hw.host_kernel_s if host_kernel_s is None else host_kernel_s)
    between = (dev + issue_s) / max(1, len(comms))  # work before each collective
    for c in comms:
        g = groups[c.group]
        t = comm_time_s(c, g, hw) + comm.skew_wait_s(between, g.n, hw)
        if c.group == hidden_comm:  # ring attention overlaps the key/value exchange with compute
            t = max(0.0, t - hide_under)
        if c.under is not None and dgrad_overlap and not (tp_pipelined and c.op == "reduce_scatter"):
            t = comm.overlapped_s(t, kernel_time_s(c.under, hw), 0.0, hw, g)
        if c.group == "cp":
            t_cp += t
        elif c.group == "ep":
            t_ep += t
        if tp_pipelined and c.group == "tp" and c.op in ("all_gather", "reduce_scatter"):
            pipelined += t
        else:
            t_comm += t
        # Issuing a collective waits for the group's ranks to meet (a tree rendezvous), so its host
        # cost grows with the tree's depth, log2 of the group.
        host += hw.host_collective_s * math.log2(max(2, g.n))
    if pipelined:
        gemm_s = kernels_time_s(tuple(k for k in kernels if k.kind == "gemm"), hw)
        t_comm += comm.overlapped_s(pipelined, gemm_s, pipelined / groups["tp"].n, hw, groups["tp"])
    return Stretch(dev, t_comm, issue_s + host, t_cp, t_ep)


@dataclass(frozen=True)
class LayerTimes:
    fwd: Stretch
    bwd: Stretch  # recompute + backward + gradient accumulation
    fwd_only: Stretch  # forward without storing anything (inference)


@dataclass(frozen=True)
class StageLayers:
    """Per-layer stretches of the two kinds of layer and how many of each every stage runs."""

    dense: LayerTimes
    sparse: LayerTimes | None
    counts: tuple[tuple[int, int], ...]  # per stage: (dense layers, sparse layers)

    def of(self, stage: int, part: str) -> Stretch:
        nd, ns = self.counts[stage]
        out = getattr(self.dense, part).scale(nd)
        if ns:
            assert self.sparse is not None
            out = out + getattr(self.sparse, part).scale(ns)
        return out

    @property
    def sizes(self) -> list[int]:
        return [nd + ns for nd, ns in self.counts]

    def mean(self, part: str, hw: Hardware) -> float:
        """Wall time of an average layer's `part`."""
        wall: dict[tuple[int, int], float] = {}  # stages holding alike layers take alike times
        total = 0.0
        for i, c in enumerate(self.counts):
            if c not in wall:
                wall[c] = self.of(i, part).wall_s(hw)
            total += wall[c]
        return total / max(1, sum(self.sizes))


@lru_cache(maxsize=4096)
def stage_layer_counts(spec: ModelSpec, pp: int, interleave: int) -> tuple[tuple[int, int], ...]:
    """(dense, sparse) decoder layers of each pipeline stage."""
    out = []
    for layers in stage_layers(spec.num_hidden_layers, pp, interleave):
        ns = sum(spec.is_moe_layer(i) for i in layers)
        out.append((len(layers) - ns, ns))
    return tuple(out)


def stage_times(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, b: int, s: int,
                training: bool, load_cv: float = 0.0) -> StageLayers:
    counts = stage_layer_counts(spec, layout.pp, layout.interleave)
    dense = layer_times(spec, fw, hw, layout, topo, b=b, s=s, training=training)
    sparse = layer_times(spec, fw, hw, layout, topo, b=b, s=s, training=training, sparse=True, load_cv=load_cv) \
        if spec.moe_layers else None
    return StageLayers(dense, sparse, counts)


def layer_times(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, b: int, s: int,
                training: bool, sparse: bool = False, load_cv: float = 0.0) -> LayerTimes:
    """Per-layer, per-micro-batch stretches on one rank (of a sparse layer with `sparse`), cached
    by what they read: the degrees that split a layer (tp, cp, ep, etp), sequence parallel, the
    recompute mode and where the tp, cp and ep groups sit; not the pipeline, the data-parallel
    degree, the ZeRO stage, the micro-batch count or the mesh's size."""
    return _layer_times(spec, fw, hw, layout.tp, layout.cp, layout.ep, layout.etp, layout.sequence_parallel,
                        layout.recompute, topo.group(layout, "tp"), topo.group(layout, "cp"), topo.group(layout, "ep"),
                        b=b, s=s, training=training, sparse=sparse, load_cv=load_cv)


@lru_cache(maxsize=16384)
def _layer_times(spec: ModelSpec, fw: Framework, hw: Hardware, tp: int, cp: int, ep: int, etp: int, sp: bool,
                 recompute: str, tp_group: comm.Group, cp_group: comm.Group, ep_group: comm.Group, *, b: int, s: int,
                 training: bool, sparse: bool, load_cv: float) -> LayerTimes:
    groups = {"tp": tp_group, "cp": cp_group, "ep": ep_group}
    moe = expert_load_at(spec, tp=tp, ep=ep, etp=etp, tokens=b * (s // cp), load_cv=load_cv, dispatch=fw.moe_dispatch,
                         ep_nodes=ep_group.nodes) if sparse else None
    w = layer_work(spec, fw, b=b, s=s, tp=tp, cp=cp, sp=sp, moe=moe)
    attn_fwd = kernels_time_s(w.attn_core, hw)
    hidden = "cp" if fw.cp_comm == "ring" else None  # ring attention overlaps its exchange; a gather does not
    piped = fw.tp_comm_overlap and sp
    fwd = stretch_of(w.fwd, w.fwd_comm, groups, hw, hidden_comm=hidden, hide_under=attn_fwd, tp_pipelined=piped)
    if not training:
        return LayerTimes(fwd, Stretch(), fwd)
    bwd = stretch_of(w.bwd, w.bwd_comm, groups, hw, hidden_comm=hidden, hide_under=2 * attn_fwd, tp_pipelined=piped,
                     dgrad_overlap=fw.tp_dgrad_overlap, host_kernel_s=hw.host_backward_kernel_s)
    accum = Stretch(kernels_time_s((w.grad_accum,), hw), 0.0, w.grad_tensors * hw.host_backward_kernel_s)
    if recompute == "full":
        rec = fwd
    elif recompute == "selective":
        rec = stretch_of(w.attn_core, (), groups, hw)
    else:
        rec = Stretch()
    return LayerTimes(fwd, rec + bwd + accum, fwd)


def _ends(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, head: Head, b: int, s: int,
          loss: bool, head_tokens: int | None = None) -> tuple[Stretch, Stretch, Stretch, Stretch]:
    """Embedding forward/backward (first stage) and head forward/backward (last stage), cached by
    what they read (tp, cp, sequence parallel and where the tp group sits).

    `head_tokens` limits the head to the last positions of each sequence (prefill needs one).
    """
    return _ends_of(spec, fw, hw, layout.tp, layout.cp, layout.sequence_parallel, topo.group(layout, "tp"), head=head,
                    b=b, s=s, loss=loss, head_tokens=head_tokens)


@lru_cache(maxsize=16384)
def _ends_of(spec: ModelSpec, fw: Framework, hw: Hardware, tp: int, cp: int, sp: bool, tp_group: comm.Group, *,
             head: Head, b: int, s: int, loss: bool, head_tokens: int | None) -> tuple[Stretch, Stretch, Stretch, Stretch]:
    ef, eb = embedding_work(spec, fw, b=b, s=s, tp=tp, cp=cp, sp=sp and head_tokens is None)
    hs = s if head_tokens is None else head_tokens * cp
    hf, hb = head_work(spec, fw, head=head, b=b, s=hs, tp=tp, cp=cp, sp=sp and head_tokens is None, loss=loss)
    ecf, ecb = lookup_comm(spec, fw, b=b, s=s, tp=tp, cp=cp, sp=sp and head_tokens is None)
    hcf, hcb = head_comm(spec, fw, head=head, b=b, s=hs, tp=tp, cp=cp, sp=sp and head_tokens is None)
    if head_tokens is not None:  # a prefill: the runtime chooses each row's first token
        hcf = sample_comm(spec, fw, rows=b * head_tokens, tp=tp)
    g = {"tp": tp_group}
    return (stretch_of(ef, ecf, g, hw), stretch_of(eb, ecb, g, hw), stretch_of(hf, hcf, g, hw),
            stretch_of(hb, hcb, g, hw, dgrad_overlap=fw.tp_dgrad_overlap))


def pipeline_s(stage_s: list[float], *, m: int, interleave: int, host_s: float) -> tuple[float, float]:
    """(steady-state time, fill-and-drain bubble) of m micro-batches over stages taking stage_s each.

    `host_s` is per-micro-batch host work outside the layers (fetching the batch, the loss, the
    schedule's bookkeeping): every stage pays it once per micro-batch in the steady state, but a
    stage waiting in the fill or drain does it while it waits, so it adds nothing to the bubble.
    """
    t_max = max(stage_s)
    steady = m * (t_max + host_s)
    bubble = (sum(stage_s) - t_max) / interleave
    return steady, bubble


def microbatch_size(seqs: int, layout: Layout) -> int:
    """Sequences per micro-batch (rounded up when the batch does not split evenly)."""
    return max(1, -(-seqs // (layout.dp * layout.micro_batches)))


def stage_param_counts(spec: ModelSpec, head: Head, layout: Layout) -> tuple[tuple[float, float], ...]:
    """(dense, routed-expert) parameters one rank of each pipeline stage holds."""
    return _stage_param_counts(spec, head, layout.tp, layout.pp, layout.interleave, layout.ep, layout.etp)


@lru_cache(maxsize=16384)
def _stage_param_counts(spec: ModelSpec, head: Head, tp: int, pp: int, interleave: int, ep: int,
                        etp: int) -> tuple[tuple[float, float], ...]:
    dense_lp, sparse_lp = layer_params_per_rank(spec, tp), layer_params_per_rank(spec, tp, sparse=True)
    experts = expert_params_per_rank(spec, ep, etp) if spec.moe_layers else 0.0
    out = []
    for i, (nd, ns) in enumerate(stage_layer_counts(spec, pp, interleave)):
        dense = stage_params(spec, head=head, layers=nd + ns, first=i == 0, last=i == pp - 1, tp=tp,
                             layer_params=(nd * dense_lp + ns * sparse_lp) / max(1, nd + ns))
        out.append((dense, ns * experts))
    return tuple(out)


@dataclass(frozen=True)
class _Pipeline:
    """The part of a training step the ZeRO stage and the optimizer do not change: micro-batches
    through the pipeline (`train_step`)."""

    parts: tuple[tuple[str, float], ...]
    microbatch_s: float  # the critical stage's time per micro-batch
    last_bwd_s: float  # ... its last backward
    since_sync_s: float  # the pipeline's steady state and bubble
    layers: tuple[int, ...]  # decoder layers per stage
    cross: bool  # neighbouring stages on different nodes


def train_step(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, head: Head,
               seqs: int, seq_len: int, load_cv: float = 0.0) -> StepTimes:
    """Wall time of one optimizer step over `seqs` sequences of `seq_len` tokens, by kind."""
    fw = fw.at_zero(layout.zero)
    pp, tp, m = layout.pp, layout.tp, layout.micro_batches
    pipe = _bare_pipeline(spec, fw, hw, layout, topo, head=head, seqs=seqs, seq_len=seq_len, load_cv=load_cv)
    out = StepTimes(dict(pipe.parts))
    layers, cross = pipe.layers, pipe.cross

    # Gradient reduction and optimizer, on the stage with the most parameters: dense weights over
    # the data-parallel group, routed experts over the experts' own (`Layout.edp`).
    counts = stage_param_counts(spec, head, layout)
    heavy = max(range(pp), key=lambda i: sum(counts[i]))
    params, experts = counts[heavy]
    # Parameter groups a stage gathers one at a time under ZeRO-3: its layers, plus the embeddings
    # on the first stage and the final norm and head on the last.
    groups = max(n + (1 if i == 0 else 0) + (2 if i == pp - 1 else 0) for i, n in enumerate(layers))
    out.add("dp_comm", grad_sync_s(params, fw, hw, layout, topo, m=m, microbatch_s=pipe.microbatch_s,
                                   last_bwd_s=pipe.last_bwd_s, zero3_groups=groups, since_sync_s=pipe.since_sync_s))
    if experts:
        out.add("dp_comm", grad_sync_s(experts, fw, hw, layout, topo, m=m, microbatch_s=pipe.microbatch_s,
                                       last_bwd_s=pipe.last_bwd_s, zero3_groups=groups, since_sync_s=pipe.since_sync_s,
                                       group="edp"))
    zero_div = fw.zero_ranks(layout) if layout.zero >= 1 else 1
    expert_div = layout.edp if layout.zero >= 1 else 1
    optimizer_s = (params / zero_div + experts / expert_div) * fw.optimizer_step_bytes / hw.mem_bytes_s
    if layout.galore is not None:
        optimizer_s += _galore_step(spec, fw, hw, layout, topo, out, heavy=heavy, zero_div=zero_div)
    out.add("optimizer", optimizer_s)
    if 1 <= layout.zero < 3:  # ZeRO gathers the updated weight shards back to every rank
        g = topo.group(layout, fw.zero_group(layout))
        gather = comm.all_gather_s(params * fw.param_bytes, g, hw)
        if fw.overlap_param_gather:  # under the next step's first forward, one bucket exposed
            forward_s = max(0.0, pipe.microbatch_s - pipe.last_bwd_s)
            bucket = comm.all_gather_s(min(params * fw.param_bytes, DDP_BUCKET_BYTES), g, hw)
            gather = comm.overlapped_s(gather, forward_s, bucket, hw, g)
        out.add("dp_comm", gather + comm.skew_wait_s(optimizer_s, g.n, hw))
        if experts:
            out.add("dp_comm", comm.all_gather_s(experts * fw.param_bytes, topo.group(layout, "edp"), hw))
    if spec.tied and head == "lm" and pp > 1:  # first and last stage sum the shared embedding's gradient
        rows = -(-spec.vocab_size // tp) * spec.hidden_size
        out.add("pp_comm", comm.all_reduce_s(rows * fw.grad_bytes, comm.Group(2, 1, 1) if cross else comm.Group(2, 2, 1), hw))
    out.add("overhead", hw.step_overhead_s)
    return out


def pipeline_parts(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, head: Head,
                   seqs: int, seq_len: int, load_cv: float = 0.0) -> tuple[tuple[str, float], ...]:
    """The parts of `train_step` that its pipeline makes (compute, the collectives inside the
    pipeline, overhead per micro-batch, the bubble), in `train_step`'s order: the rest of a step
    (gradient reduction, optimizer, step overhead) only adds to these."""
    return _bare_pipeline(spec, fw, hw, layout, topo, head=head, seqs=seqs, seq_len=seq_len, load_cv=load_cv).parts


def _bare_pipeline(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, head: Head,
                   seqs: int, seq_len: int, load_cv: float) -> _Pipeline:
    bare = layout if layout.zero == 0 and layout.galore is None else layout.model_copy(update={"zero": 0, "galore": None})
    return _pipeline(spec, fw, hw, bare, topo, head=head, seqs=seqs, seq_len=seq_len, load_cv=load_cv)


@lru_cache(maxsize=16384)
def _pipeline(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, head: Head,
              seqs: int, seq_len: int, load_cv: float) -> _Pipeline:
    b, m = microbatch_size(seqs, layout), layout.micro_batches
    pp, v, tp = layout.pp, layout.interleave, layout.tp
    out = StepTimes()
    lt = stage_times(spec, fw, hw, layout, topo, b=b, s=seq_len, training=True, load_cv=load_cv)
    ef, eb, hf, hb = _ends(spec, fw, hw, layout, topo, head=head, b=b, s=seq_len, loss=True)
    layers = lt.sizes
    act_bytes = 2.0 * b * (seq_len // layout.cp) * spec.hidden_size / tp  # scatter-gather sends 1/t
    cross = topo.pp_cross_node(layout)
    senders = min(topo.gpus_per_node, layout.tp * layout.cp * layout.dp)
    chunk = (lt.mean("fwd", hw) + lt.mean("bwd", hw)) * max(layers) / (2 * v)  # a stage's work between sends
    p2p = comm.p2p_s(act_bytes, cross_node=cross, senders_per_node=senders, hw=hw) + \
        comm.skew_wait_s(chunk, 2, hw) if pp > 1 else 0.0

    stage_s, compute_s, comm_s = [], [], []
    seen: dict[tuple, tuple[float, float, tuple[float, float, float, float]]] = {}  # stages alike time alike
    for st in range(pp):
        key = (lt.counts[st], st == 0, st == pp - 1)
        if key not in seen:
            f = lt.of(st, "fwd") + (ef if st == 0 else Stretch()) + (hf if st == pp - 1 else Stretch())
            bw = lt.of(st, "bwd") + (eb if st == 0 else Stretch()) + (hb if st == pp - 1 else Stretch())
            sends = (2 if 0 < st < pp - 1 else 1) * p2p * v if pp > 1 else 0.0
            wall = f.wall_s(hw) + bw.wall_s(hw)
            cp_s, ep_s = f.cp_comm_s + bw.cp_comm_s, f.ep_comm_s + bw.ep_comm_s
            seen[key] = (wall + sends, wall - f.comm_s - bw.comm_s, (f.comm_s + bw.comm_s - cp_s - ep_s, cp_s, sends, ep_s))
        stage_s.append(seen[key][0])
        compute_s.append(seen[key][1])
        comm_s.append(seen[key][2])
    steady, bubble = pipeline_s(stage_s, m=m, interleave=v, host_s=hw.microbatch_overhead_s)
    crit = max(range(pp), key=lambda i: stage_s[i])
    out.add("compute", compute_s[crit] * m)
    out.add("tp_comm", comm_s[crit][0] * m)
    out.add("cp_comm", comm_s[crit][1] * m)
    out.add("pp_comm", comm_s[crit][2] * m)
    out.add("ep_comm", comm_s[crit][3] * m)
    out.add("overhead", hw.microbatch_overhead_s * m)
    out.add("pp_bubble", bubble)
    return _Pipeline(tuple(out.parts.items()), stage_s[crit], lt.of(crit, "bwd").wall_s(hw), steady + bubble,
                     tuple(layers), cross)


def _galore_step(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, out: StepTimes, *,
                 heavy: int, zero_div: int) -> float:
    """What a GaLore optimizer (`cost_models.galore`) changes in a step of the `heavy` stage: the
    projected matrices' Adam runs on their low-rank moments instead (returned: the change to the
    optimizer's time, negative where it streams less), plus the projections (`galore`) and, once
    every `update_interval` steps, the SVDs, split over the data-parallel group's owners, and
    under ZeRO-0 the projectors sent from each owner to the group (`dp_comm`). Under tensor
    parallel, the projections summed over the group are all-reduced every step, and for each SVD
    the gradient's slices are gathered and the projector sent back (`tp_comm`)."""
    galore = layout.galore
    assert galore is not None
    stage = galore_stage(spec, galore, *stage_layer_counts(spec, layout.pp, layout.interleave)[heavy], tp=layout.tp)
    # Adam over the low-rank moments, and the update added to each weight (read the projected-back
    # step, read and write the weight: 12 bytes), in place of Adam over the full matrix.
    adam_s = ((stage.moment - stage.params) * fw.optimizer_step_bytes + stage.params * 3 * 4) / zero_div / hw.mem_bytes_s
    owners = fw.zero_ranks(layout)
    svd_s = (stage.svd_gemm_flops / hw.gemm_flops + stage.svd_stream_bytes / hw.mem_bytes_s) / owners
    out.add("galore", stage.project_flops / zero_div / hw.gemm_flops + svd_s / galore.update_interval)
    if layout.zero == 0 and owners > 1:
        out.add("dp_comm", comm.all_gather_s(stage.projector * 4, topo.group(layout, fw.zero_group(layout)), hw) / galore.update_interval)
    if layout.tp > 1:
        tp = topo.group(layout, "tp")
        refresh = comm.all_gather_s(stage.tp_gather * 4, tp, hw) + comm.broadcast_s(stage.tp_projector * 4, tp, hw)
        out.add("tp_comm", comm.all_reduce_s(stage.tp_reduce * 4, tp, hw) / zero_div
                + refresh / owners / galore.update_interval)
    return adam_s


def grad_sync_s(params: float, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, m: int,
                microbatch_s: float, last_bwd_s: float, zero3_groups: int = 1, since_sync_s: float = 0.0,
                group: str | None = None) -> float:
    """Exposed time of the data-parallel gradient reduction (and ZeRO-3 weight gathers).

    Below `Framework.grads_sharded_from_zero` (ZeRO 0/1, and 2 in the runtime) whole gradients
    are kept and reduced once after the last backward (all-reduce, or reduce-scatter for ZeRO-1
    unless `Framework.zero1_all_reduce`), in full unless the framework buckets gradients and
    overlaps them with that backward, leaving the last bucket exposed. From that stage on they
    cannot be kept whole, so they are reduce-scattered every micro-batch, each parameter group's
    as its backward ends: under the next micro-batch's compute, and for the last micro-batch under
    its own backward, one group's share exposed. ZeRO-3 also all-gathers the weights, prefetched
    under each micro-batch's compute: for the forward and again for the backward, whose gather a
    full recompute's forward shares (FSDP's way), or, where autograd keeps the gathered weights
    (`Framework.zero3_keeps_gathered`), for the forward and a full recompute only.
    A framework that does not prefetch (`Framework.zero3_prefetch`) gathers each of the
    `zero3_groups` parameter groups when it runs and reduce-scatters its gradient in backward,
    each a blocking collective paying its own latency; it keeps the gathered weights for the
    backward, so only the forward and a full recompute gather.

    `group` is the reduction group: the framework's `zero_group` for dense weights (default),
    edp for routed experts. Where context-parallel ranks hold replicas of ZeRO-3's slices
    (`Framework.cp_zero3_replicas`), their gradients are also all-reduced over the cp group after
    the backward.

    The last reduction also waits for the group's slowest rank, `since_sync_s` of work after the
    ranks last met (`comm.skew_wait_s`; a blocking ZeRO-3 gather or reduction waits after its
    share of a micro-batch).
    """
    g = topo.group(layout, group or fw.zero_group(layout))
    grad = params * fw.grad_bytes
    # Only ZeRO-3's slices have cp replicas (`Framework.zero_group`), so the whole-gradient branch
    # below never sums over cp.
    replicas = group is None and fw.zero_group(layout) == "dp" and layout.cp > 1
    cp_sum = comm.all_reduce_s(grad / g.n, topo.group(layout, "cp"), hw) if replicas else 0.0
    # The first reduction waits for the slowest of all the ranks the gradients are summed over.
    wait = comm.skew_wait_s(since_sync_s, g.n * (layout.cp if replicas else 1), hw)
    if g.n == 1:
        return cp_sum + (wait if replicas else 0.0)
    if layout.zero < fw.grads_sharded_from_zero:  # whole gradients kept: one reduction, after the last backward
        whole = layout.zero == 0 or (layout.zero == 1 and fw.zero1_all_reduce)
        t = comm.all_reduce_s(grad, g, hw) if whole else comm.reduce_scatter_s(grad, g, hw)
        if fw.overlap_grad_reduce:
            return comm.overlapped_s(t, last_bwd_s, comm.all_reduce_s(min(grad, DDP_BUCKET_BYTES), g, hw), hw, g) + wait
        return t + wait
    # Gathers of the weights per micro-batch (`Framework.zero3_keeps_gathered`).
    k = (2 if layout.recompute == "full" else 1) if fw.zero3_keeps_gathered or not fw.zero3_prefetch else 2
    if layout.zero == 3 and not fw.zero3_prefetch:
        n = zero3_groups
        gathers = k * n * comm.all_gather_s(params * fw.param_bytes / n, g, hw)
        waits = (k + 1) * n * comm.skew_wait_s(microbatch_s / ((k + 1) * n), g.n, hw)
        return cp_sum + (wait if replicas else 0.0) + m * (gathers + n * comm.reduce_scatter_s(grad / n, g, hw) + waits)
    # Each parameter group's gradients are reduce-scattered as its backward ends, under the
    # backward of the groups before it and the next micro-batch: the last micro-batch's leave
    # exposed what its own backward cannot cover, at least one group's share.
    rs = comm.reduce_scatter_s(grad, g, hw)
    last = comm.overlapped_s(rs, last_bwd_s, rs / max(1, zero3_groups), hw, g) if fw.overlap_grad_reduce else rs
    exposed = last + (m - 1) * max(0.0, rs - microbatch_s) + wait
    hidden = (m - 1) * min(rs, microbatch_s)
    if layout.zero == 3:
        gathers = k * comm.all_gather_s(params * fw.param_bytes, g, hw)
        exposed += m * max(0.0, gathers - microbatch_s)
        hidden += m * min(gathers, microbatch_s)
    return cp_sum + exposed + comm.overlap_interference_s(hidden, hw, g)


def forward_pass(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, head: Head,
                 seqs: int, seq_len: int, last_token_logits: bool = False, load_cv: float = 0.0) -> StepTimes:
    """Wall time of a forward-only pass (log-probs, values or scores) over `seqs` sequences.

    Micro-batches are pipelined over the stages, or run one after another when pp = 1.
    """
    out = StepTimes()
    b, m = microbatch_size(seqs, layout), layout.micro_batches
    pp, v = layout.pp, layout.interleave
    lt = stage_times(spec, fw, hw, layout, topo, b=b, s=seq_len, training=False, load_cv=load_cv)
    ef, _, hf, _ = _ends(spec, fw, hw, layout, topo, head=head, b=b, s=seq_len, loss=False,
                         head_tokens=1 if last_token_logits else None)
    layers = lt.sizes
    act_bytes = 2.0 * b * (seq_len // layout.cp) * spec.hidden_size / layout.tp
    senders = min(topo.gpus_per_node, layout.tp * layout.cp * layout.dp)
    chunk = lt.mean("fwd_only", hw) * max(layers) / v  # a stage's work between sends
    p2p = comm.p2p_s(act_bytes, cross_node=topo.pp_cross_node(layout), senders_per_node=senders, hw=hw) + \
        comm.skew_wait_s(chunk, 2, hw) if pp > 1 else 0.0
    stage_s, comm_s = [], []
    seen: dict[tuple, tuple[float, tuple[float, float, float]]] = {}  # stages alike time alike
    for st in range(pp):
        key = (lt.counts[st], st == 0, st == pp - 1)
        if key not in seen:
            f = lt.of(st, "fwd_only") + (ef if st == 0 else Stretch()) + (hf if st == pp - 1 else Stretch())
            seen[key] = (f.wall_s(hw) + (p2p * v if st < pp - 1 else 0.0), (f.comm_s, f.cp_comm_s, f.ep_comm_s))
        stage_s.append(seen[key][0])
        comm_s.append(seen[key][1])
    steady, bubble = pipeline_s(stage_s, m=m, interleave=v, host_s=hw.microbatch_overhead_s)
    crit = max(range(pp), key=lambda i: stage_s[i])
    sends = p2p * v if crit < pp - 1 else 0.0
    out.add("compute", (stage_s[crit] - comm_s[crit][0] - sends) * m)
    out.add("tp_comm", (comm_s[crit][0] - comm_s[crit][1] - comm_s[crit][2]) * m)
    out.add("cp_comm", comm_s[crit][1] * m)
    out.add("ep_comm", comm_s[crit][2] * m)
    out.add("pp_comm", sends * m)
    out.add("overhead", hw.microbatch_overhead_s * m)
    out.add("pp_bubble", bubble)
    if layout.zero == 3 and fw.zero_ranks(layout) > 1:
        # Sharded parameters (FSDP / ZeRO-3 inference, as verl runs its reference): every
        # micro-batch's forward gathers the stage's weights, prefetched under its compute or, without
        # prefetch, one blocking gather per parameter group.
        counts = stage_param_counts(spec, head, layout)
        params, experts = counts[max(range(pp), key=lambda i: sum(counts[i]))]
        g_dense, g_expert = topo.group(layout, fw.zero_group(layout)), topo.group(layout, "edp")
        dense = comm.all_gather_s(params * fw.param_bytes, g_dense, hw)
        gather = dense + comm.all_gather_s(experts * fw.param_bytes, g_expert, hw)
        if fw.zero3_prefetch:
            hidden = min(gather, stage_s[crit])
            share = dense / gather if gather > 0 else 1.0  # each group's gathers slow the compute by its own channels
            lost = comm.overlap_interference_s(hidden * share, hw, g_dense) + \
                comm.overlap_interference_s(hidden * (1 - share), hw, g_expert)
            out.add("dp_comm", m * (gather - hidden + lost))
        else:
            out.add("dp_comm", m * gather)
    return out
