"""Generation: a prefill pass over the prompts, then one decode step per further generated token.

Prefill is a forward pass over ``prompt_len`` tokens per sequence (compute-bound at realistic
batch sizes) that also writes the key/value cache; only the last position's logits are computed,
and they give the first generated token. Each of the ``gen_len - 1`` decode steps runs every
layer on the last token of each sequence: the GEMMs turn into matrix-vector
products that stream the layer's weights from HBM, attention streams the sequences' key/value
cache, each layer does its two tensor-parallel all-reduces on a tiny message (latency-bound),
and the host issues every kernel (often the bound in eager frameworks). Attention cost is linear
in the context, so the decode phase is ``gen_len - 1`` steps at the mean context
``prompt_len + (gen_len + 1) / 2``; when the call says how long its responses really are
(`Call.response_len`), the expected longest response of a batch sets its steps, and an engine that
drops finished rows runs them at the rows still going (`cost_models.lengths`). Choosing each token (sampling, cache bookkeeping) costs the
host `decode_step_overhead_ms` besides its kernels. The runtime casts its fp32 weights to the
compute dtype once per call, and on a GPU replays each decode step as one CUDA graph, so its
kernels cost the host nothing (`Framework.decode_cuda_graphs`).

How the decode layout's ``micro_batches`` = m splits a replica's sequences:

- pp = 1: m *waves* run one after another (prefill then decode of each), so only one wave's
  key/value cache is resident: generation trades time for memory. A stack with a paged cache
  (`Framework.paged_kv`: vLLM) has no waves: the m waves' cache at the length cap is the KV
  budget of one engine, whose scheduler runs as many rows as their tokens so far fit (up to
  `max_num_seqs`), admitting waiting rows as others end and preempting the newest when a step finds
  no room (`cost_models.lengths.paged_schedule`); its steps are priced at the rows and cached
  tokens that schedule runs, and the preempted rows' second prefills are added;
- pp > 1: m *groups* are pipelined through the stages, all resident, and a token takes
  ``max(m, pp)`` stage times (each stage works on one group while the others wait their turn).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_models import comm
from cost_models.framework import Framework
from cost_models.hardware import Hardware
from cost_models.lengths import LengthDist, PagedSchedule, decode_segments, paged_schedule
from cost_models.memory import kv_cache_bytes
from cost_models.ops import (
    embedding_work,
    expert_load,
    gemm,
    layer_work,
    lookup_comm,
    mean_layer_params,
    mem,
    sample_comm,
)
from cost_models.training import StepTimes, Stretch, Topology, forward_pass, stage_layer_counts, stretch_of
from plans.layout import Layout
from plans.model import ModelSpec
from plans.sharding import stage_layers

SAMPLE_BYTES = 10  # per logit per step: softmax in fp32 and sampling


@dataclass(frozen=True)
class DecodeSplit:
    """How a decode layout divides the sequences: waves in turn, groups in the pipeline."""

    waves: int
    groups: int
    seqs_per_group: int  # on one replica

    @property
    def resident_seqs(self) -> int:
        """Sequences whose cache one replica holds at once."""
        return self.groups * self.seqs_per_group


def decode_split(seqs: int, layout: Layout) -> DecodeSplit:
    replicas = layout.dp  # context-parallel ranks decode the same rows, each a share of their caches
    m = layout.micro_batches
    waves, groups = (m, 1) if layout.pp == 1 else (1, m)
    return DecodeSplit(waves, groups, max(1, -(-seqs // (replicas * m))))


def decode_step_s(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, topo: Topology, *, b: int, groups: int,
                  ctx: int, load_cv: float = 0.0) -> tuple[float, float, float, float]:
    """(wall time, tensor-parallel collective time, expert all-to-all time, KV-parallel combine
    time) of one decode step of
    `groups` groups of `b` sequences; under context parallel (KV-parallel decode) each rank reads
    its share of every cache and the shares' partial attention is combined (`ops.layer_work`).

    A sparse layer streams the weights of the experts its tokens activate (`ExpertLoad.active`:
    with few tokens, far fewer than all of them) and waits for two all-to-alls."""
    pp, tp = layout.pp, layout.tp
    g = {"tp": topo.group(layout, "tp"), "cp": topo.group(layout, "cp"), "ep": topo.group(layout, "ep")}

    def one(sparse: bool) -> Stretch:
        moe = expert_load(spec, layout, tokens=b, load_cv=load_cv, dispatch=fw.moe_dispatch,
                          ep_nodes=g["ep"].nodes) if sparse else None
        w = layer_work(spec, fw, b=b, s=1, tp=tp, cp=layout.cp, sp=False, kv_len=ctx, moe=moe)
        out = stretch_of(w.fwd, w.fwd_comm, g, hw, host_kernel_s=hw.host_decode_kernel_s)
        if fw.decode_cuda_graphs and hw.sm_count is not None:  # a GPU replays the step: no per-kernel host cost
            out = dataclasses.replace(out, host_s=0.0)
        return out

    dense_layer, sparse_layer = one(False), (one(True) if spec.moe_layers else Stretch())
    ef, _ = embedding_work(spec, fw, b=b, s=1, tp=tp, cp=1)
    # Each rank samples from its block of the vocabulary, or from the whole of it once gathered.
    sampled = spec.vocab_size if fw.logits_all_gather else spec.vocab_size / tp
    head = (gemm(b, -(-spec.vocab_size // tp), spec.hidden_size), mem(SAMPLE_BYTES * b * sampled))
    # The lookup's rows reduced over the group, the next token chosen over it.
    lookup, _ = lookup_comm(spec, fw, b=b, s=1, tp=tp, cp=1, sp=False)
    ends = stretch_of(ef + head, lookup + sample_comm(spec, fw, rows=b, tp=tp), g, hw)
    if fw.decode_cuda_graphs and hw.sm_count is not None:  # one launch for the whole step
        ends = dataclasses.replace(ends, host_s=hw.host_kernel_s)
    counts = stage_layer_counts(spec, pp, layout.interleave)
    per_stage = [dense_layer.scale(nd) + sparse_layer.scale(ns) for nd, ns in counts]
    crit = max(range(pp), key=lambda i: per_stage[i].wall_s(hw))
    stage = per_stage[crit].wall_s(hw) + ends.wall_s(hw) / pp
    hop = comm.p2p_s(2.0 * b * spec.hidden_size, cross_node=topo.pp_cross_node(layout), senders_per_node=1, hw=hw) + \
        comm.skew_wait_s(stage, 2, hw)
    turns = max(groups, pp)
    crit_s = per_stage[crit]
    return (turns * stage + (pp - 1) * hop, turns * (crit_s.comm_s - crit_s.ep_comm_s - crit_s.cp_comm_s + ends.comm_s / pp),
            turns * crit_s.ep_comm_s, turns * crit_s.cp_comm_s)


def pages(fw: Framework, decode: Layout) -> bool:
    """Whether `fw`'s rollout engine runs `decode` with a paged KV cache and its scheduler (not
    for pipelined or KV-parallel decode, which the vLLM stacks do not run)."""
    return fw.paged_kv and decode.pp == 1 and decode.cp == 1


def paged_rollout(fw: Framework, decode: Layout, *, seqs: int, prompt_len: int, gen_len: int,
                  lengths: LengthDist | None) -> PagedSchedule | None:
    """How one engine of a paged stack (`Framework.paged_kv`, the rollout engine's traits) runs its
    rows: in the KV budget its decode layout's waves would hold at the length cap; None where the
    generation is not paged (static waves, or pipelined or KV-parallel decode)."""
    if not pages(fw, decode):
        return None
    split = decode_split(seqs, decode)
    # The call ends with its slowest engine: the one that drew the longest response of all.
    return paged_schedule(lengths, cap=gen_len, rows=-(-seqs // decode.dp), prompt=prompt_len,
                          max_seqs=fw.max_num_seqs, kv_tokens=split.seqs_per_group * (prompt_len + gen_len),
                          longest_of=seqs if decode.dp > 1 else None)


def generate_times(spec: ModelSpec, fw: Framework, hw: Hardware, layout: Layout, decode: Layout, topo: Topology, *,
                   seqs: int, prompt_len: int, gen_len: int, load_cv: float = 0.0,
                   lengths: LengthDist | None = None) -> StepTimes:
    """Wall time of prefill, cache writes, layout change and decode, by kind. `lengths`: how long
    the responses really are (`cost_models.lengths`; None: all run to `gen_len`)."""
    out = StepTimes()
    split = decode_split(seqs, decode)
    fw = fw.for_rollouts()  # the rollouts' engine runs the experts, and maybe every layer, its own way
    if fw.weight_cast_bytes:  # the weights are cast once for the call, not on each step
        lp = mean_layer_params(spec, decode.tp) * spec.num_hidden_layers / decode.pp / \
            (decode.ep if spec.is_moe else 1)
        out.add("prefill", fw.weight_cast_bytes * lp / hw.mem_bytes_s)
        fw = dataclasses.replace(fw, weight_cast_bytes=0.0)
    # Each wave prefills its own prompts: the prefill layout's micro-batches subdivide a wave.
    pre_layout = layout.model_copy(update={"micro_batches": layout.micro_batches * split.waves}) if split.waves > 1 else layout
    pre = forward_pass(spec, fw, hw, pre_layout, topo, head="lm", seqs=seqs, seq_len=prompt_len, last_token_logits=True,
                       load_cv=load_cv)
    out.add("prefill", pre.total_s)
    per_rank = seqs / layout.dp  # a context-parallel prefill keeps the whole gathered cache on each cp rank
    layers = max(len(x) for x in stage_layers(spec.num_hidden_layers, layout.pp, layout.interleave))
    cache = kv_cache_bytes(spec, seqs=per_rank, ctx=prompt_len, layers=layers, tp=layout.tp)
    out.add("prefill", cache / hw.mem_bytes_s)
    sched = paged_rollout(fw, decode, seqs=seqs, prompt_len=prompt_len, gen_len=gen_len, lengths=lengths)
    if sched is not None:
        rows = -(-seqs // decode.dp)
        if sched.recomputed_tokens:  # preempted rows prefill their prompt and their tokens again
            out.add("prefill", pre.total_s * sched.recomputed_tokens / (rows * prompt_len))
        batches, ctx0 = [(1, list(sched.segments))], 0
    else:
        # The rows that decode until the longest of them ends: a wave, or all the pipelined groups.
        # The call ends with its slowest replica, whose last wave drew the longest response of all.
        rows = split.seqs_per_group * (split.groups if decode.pp > 1 else 1)
        drops = fw.decode_drops_finished
        batches = [(split.waves - 1, decode_segments(lengths, cap=gen_len, rows=rows, drops_finished=drops)),
                   (1, decode_segments(lengths, cap=gen_len, rows=rows, drops_finished=drops,
                                       longest_of=rows * split.waves * decode.dp))]
        ctx0 = prompt_len
    for count, segments in batches:
        if count == 0:
            continue
        for n, ctx, running in segments:
            b = -(-running // split.groups) if decode.pp > 1 else running
            step, tp_comm, ep_comm, cp_comm = decode_step_s(spec, fw, hw, decode, topo, b=b, groups=split.groups,
                                                            ctx=ctx0 + int(ctx), load_cv=load_cv)
            steps = count * n
            out.add("decode", steps * (step - tp_comm - ep_comm - cp_comm))
            out.add("tp_comm", steps * tp_comm)
            out.add("ep_comm", steps * ep_comm)
            out.add("cp_comm", steps * cp_comm)
        out.add("overhead", count * (sum(n for n, _, _ in segments) + 1) * hw.decode_step_overhead_s)
    return out
