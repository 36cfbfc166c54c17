"""Candidate placements per call: aligned meshes x valid layouts, costed and pruned.

A candidate is one (mesh, layout) a call may run with, with its estimated time and memory. The
cluster is homogeneous, so all aligned meshes of one size behave alike: layouts are costed once
per mesh size on a representative block and the result is shared by every position (symmetry).
Dominated layouts (no faster and no smaller in memory than another of the same size) are dropped,
and at most `keep_per_size` survive per size, fastest first.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import product

from cost_models import CallCost, CostModel
from cost_models.framework import engine_layout_problems
from plans.cluster import ClusterSpec
from plans.graph import Call, Graph, ModelDecl
from plans.layout import GaLore, Layout, Mesh
from plans.model import ModelSpec
from plans.runnable import expert_layout_problems
from plans.sharding import layout_problems, slices_key

RECOMPUTE_MODES = ("none", "selective", "full")
SPLIT_DECODE_PREFILLS = 3  # prefill layouts per mesh size tried with every other decode layout
# Kept layouts per mesh size of a home call (fastest first) also tried with offload: a train call's
# fastest, a frozen model's two fastest. More variants make CP-SAT's deterministic budget go
# further for less: on bench/search.py's PPO instances both at 2 (or all at 4) found slower plans.
OFFLOAD_VARIANTS = {"optimizer": 1, "weights": 2}
LONG_SEQ_TOKENS = 16384  # context parallel is considered from this sequence length on


@dataclass(frozen=True)
class Candidate:
    """One placement of one call, with its costs."""

    mesh: Mesh
    layout: Layout
    cost: CallCost
    decode_layout: Layout | None = None

    @property
    def time_s(self) -> float:
        return self.cost.time_s

    @property
    def state_bytes(self) -> int:
        return self.cost.state_mem_bytes

    @property
    def work_bytes(self) -> int:
        """Transient bytes during the call on top of the resident state."""
        return self.cost.peak_mem_bytes - self.cost.state_mem_bytes

    @cached_property
    def _param_key(self) -> tuple[int, ...]:
        return slices_key(self.mesh, self.layout)

    def param_key(self) -> tuple[int, ...]:
        """Equal keys hold every parameter slice on the same ranks (a reallocation moves nothing)."""
        return self._param_key

    def describe(self) -> str:
        text = f"{self.mesh.short()} {self.layout.short()}"
        if self.decode_layout is not None:
            text += f" / decode {self.decode_layout.short()}"
        return text


LayoutFilter = Callable[[Call, ModelDecl, Layout], bool]


@dataclass(frozen=True)
class SearchSpace:
    """Knobs and restrictions of the candidate space (a baseline is a restriction, not a new search)."""

    max_blocks: int = 8  # smallest mesh considered is cluster / max_blocks (or one GPU)
    keep_per_size: int = 4  # layouts kept per mesh size after dominance pruning
    mesh_sizes: tuple[int, ...] | None = None  # only these mesh sizes
    layout_ok: LayoutFilter | None = None  # applied before pruning
    split_decode: bool = True  # generation may decode with a different layout than it prefills with
    # ReaLHF's mesh space: besides aligned power-of-two blocks, any run of consecutive whole nodes
    # (3 of 4, 12 of 16) at any node offset, and half nodes on every cluster size. None: on three
    # nodes only (`node_ranges_on`).
    node_ranges: bool | None = None
    # Home calls may also keep states in host memory between calls (`Layout.offload`): a train
    # call's optimizer states, a frozen model's weights when it has no other call.
    offload: bool = True
    # A GaLore optimizer (`Layout.galore`) train calls may use where AdamW's states do not fit
    # (None: AdamW only). Opt-in: it changes the training algorithm, not only where it runs.
    galore: GaLore | None = None
    # Costing one layout takes about a millisecond; past this many (distinct calls x mesh sizes x
    # layouts) a request is refused with an error rather than left to run for many minutes.
    max_layout_evals: int = 200_000


def _divisors(n: int) -> list[int]:
    """Divisors of n, ascending (O(sqrt n))."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


MICRO_BATCH_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # powers of two up to 64


def _micro_batch_counts(per_dp: int) -> list[int]:
    # Never enumerate the divisors of the batch itself: it may be millions of sequences.
    return [m for m in MICRO_BATCH_COUNTS if per_dp % m == 0]


# Node ranges are on by default where the aligned blocks have a hole: a node count that is no
# power of two (no block between the largest power of two and all the nodes, e.g. none between one
# node and all three), up to `AUTO_NODE_RANGES_MAX_NODES`. Measured on this project's 2-core VM
# (PPO 13B+7B and PPO 70B, batch 512, prompt and generation 1024; GRPO 7B on three nodes): on 3-12
# nodes the runs give plans 1.00-1.58x faster (1.06-1.22x on 6 and 10-12 nodes), certified within
# 2.2% in 1.6-8.8 s; on 13-15 nodes 1.06-1.42x but in 6-10 s, at the 10 s aim, so there (and past)
# they stay opt-in (`--node-ranges`), as on a power of two, where the blocks hold the halves,
# quarters, ... already (`bench/search.py --node-ranges`).
AUTO_NODE_RANGES_MAX_NODES = 12


def node_ranges_on(space: SearchSpace | None, cluster: ClusterSpec) -> bool:
    """Whether `space` searches node ranges on `cluster`: as it says, else by default on a node
    count that is no power of two, up to `AUTO_NODE_RANGES_MAX_NODES`."""
    if space is not None and space.node_ranges is not None:
        return space.node_ranges
    n = cluster.nodes
    return n & (n - 1) != 0 and n <= AUTO_NODE_RANGES_MAX_NODES


def mesh_sizes(cluster: ClusterSpec, space: SearchSpace) -> list[int]:
    """Mesh sizes: divisors of a node up to one node, then whole-node powers of two (with
    node ranges (`node_ranges_on`), every whole-node count, and half a node however large the cluster)."""
    gpn, n = cluster.gpus_per_node, cluster.world_size
    sizes = [d for d in _divisors(gpn) if d & (d - 1) == 0 or d == gpn]
    k = 2
    while k <= cluster.nodes:
        if cluster.nodes % k == 0:
            sizes.append(k * gpn)
        k *= 2
    if n not in sizes:
        sizes.append(n)
    lo = max(1, n // space.max_blocks)
    sizes = sorted({s for s in sizes if s >= lo or s == n})
    if node_ranges_on(space, cluster):
        extra = {k * gpn for k in range(1, cluster.nodes + 1)} | ({gpn // 2} if gpn % 2 == 0 else set())
        sizes = sorted(set(sizes) | extra)
    if space.mesh_sizes is not None:
        sizes = [s for s in sizes if s in space.mesh_sizes]
    return sizes


def mesh_positions(cluster: ClusterSpec, size: int, space: SearchSpace | None = None) -> list[Mesh]:
    """Every aligned block of `size` GPUs; with node ranges (`node_ranges_on`), a mesh of whole
    nodes starts at any node."""
    gpn = cluster.gpus_per_node
    step = gpn if node_ranges_on(space, cluster) and size % gpn == 0 else size
    return [Mesh.block(first, size) for first in range(0, cluster.world_size - size + 1, step)]


def layouts_for(call: Call, decl: ModelDecl, size: int, cluster: ClusterSpec) -> list[Layout]:
    """Every valid layout of `size` ranks for `call`: degrees that shard the model, tp inside a
    node, the batch splitting evenly over data-parallel ranks and micro-batches."""
    return list(_layouts_for(call.kind == "train", call.step_seqs, call.seq_len, decl.spec, size, cluster.gpus_per_node))


def stack_space(space: SearchSpace, cm: CostModel) -> SearchSpace:
    """`space` kept to the meshes the stack the plan is costed for places calls on: the whole
    cluster where its engines run every call on all GPUs (`EngineLayouts.whole_pool`)."""
    if cm.framework.layouts.whole_pool:
        return dataclasses.replace(space, mesh_sizes=(cm.cluster.world_size,))
    return space


def runnable_layouts(call: Call, decl: ModelDecl, size: int, cm: CostModel) -> list[Layout]:
    """`layouts_for`, kept to those the stack the plan is costed for runs (`cm.framework`): the
    runtime's way of splitting experts under framework torch, the engines' layouts under an
    export stack (`engine_layout_problems`). Where those engines shard forward-only models
    (verl's FSDP workers: no ZeRO-0 over several ranks), an inference call's layouts take the
    ZeRO stage they shard with."""
    fw = cm.framework
    stages = fw.layouts.zero
    served = call.kind == "inference" and call.returns == "scores" and fw.layouts.served_scores
    shard = max(stages) if call.kind == "inference" and stages is not None and 0 not in stages and not served else 0
    out = []
    for lay in layouts_for(call, decl, size, cm.cluster):
        if shard and lay.dp * lay.cp > 1:
            lay = lay.model_copy(update={"zero": shard})
        if fw.name == "torch" and expert_layout_problems(decl.spec, lay):
            continue
        if engine_layout_problems(fw, call.kind, lay, returns=call.returns):
            continue
        if fw.cp_comm == "all_to_all" and lay.cp > 1 and decl.spec.num_attention_heads % (lay.tp * lay.cp):
            continue  # Ulysses splits the heads over the context-parallel ranks
        out.append(lay)
    return out


@lru_cache(maxsize=1024)
def _layouts_for(train: bool, seqs: int, seq_len: int, spec: ModelSpec, size: int, gpus_per_node: int) -> tuple[Layout, ...]:
    out: list[Layout] = []
    cps = [1]
    if seq_len >= LONG_SEQ_TOKENS:  # generation: a context-parallel prefill, then KV-parallel decode
        cps = [c for c in (1, 2, 4, 8) if seq_len % (2 * c) == 0]
    for tp, pp, cp in product(_divisors(gpus_per_node), _divisors(size), cps):
        if size % (tp * pp * cp):
            continue
        dp = size // (tp * pp * cp)
        if seqs % dp:
            continue
        per_dp = seqs // dp
        if layout_problems(spec, Layout(tp=tp, pp=pp)):
            continue
        for ep, etp in expert_degrees(spec, tp=tp, stage=tp * cp * dp):
            if train:
                mbs = _micro_batch_counts(per_dp)
                zeros = [0, 1, 2, 3] if dp * cp > 1 else [0]
                for mb, zero, rc in product(mbs, zeros, RECOMPUTE_MODES):
                    out.append(Layout(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, micro_batches=mb, recompute=rc,
                                      sequence_parallel=tp > 1, ep=ep, etp=etp))
            else:
                # Inference and generation split each replica's batch into micro-batches: pipelined
                # through the stages when pp > 1, run as waves (each with its own activations or KV
                # cache) when pp = 1, which is how a large batch fits at all.
                mbs = _micro_batch_counts(per_dp)
                out += [Layout(dp=dp, tp=tp, pp=pp, cp=cp, micro_batches=mb, ep=ep, etp=etp) for mb in mbs
                        if cp == 1 or ep == 1]
    return tuple(out)


def expert_degrees(spec: ModelSpec, *, tp: int, stage: int) -> list[tuple[int, int]]:
    """(ep, etp) choices for a stage of `stage` ranks: (1, 1) for a dense model; for a mixture of
    experts every power-of-two ep dividing the experts and the stage, with each expert whole
    (etp 1) or split like the dense MLP (etp = tp)."""
    if not spec.is_moe:
        return [(1, 1)]
    out = []
    for etp in sorted({1, tp}):
        ep = 1
        while ep * etp <= stage and stage % (ep * etp) == 0:
            if spec.experts % ep == 0 and spec.expert_ffn % etp == 0:
                out.append((ep, etp))
            ep *= 2
    return out


def pareto(cands: list[Candidate]) -> list[Candidate]:
    """Drop candidates that another beats or ties on time, state and transient memory.

    Taken fastest first, a candidate is dominated exactly when some earlier one has no more state
    and no more transient memory: the earlier ones' (state, work) staircase (state rising, work
    falling) answers that with one bisection."""
    ranked = sorted(cands, key=lambda c: (c.time_s, c.state_bytes, c.work_bytes, c.layout.short()))
    front: list[Candidate] = []
    states: list[int] = []  # the staircase: states ascending, their works strictly descending
    works: list[int] = []
    for c in ranked:
        at = bisect_right(states, c.state_bytes)
        if at and works[at - 1] <= c.work_bytes:
            continue
        front.append(c)
        end = at
        while end < len(states) and works[end] >= c.work_bytes:  # now dominated in (state, work)
            end += 1
        states[at:end], works[at:end] = [c.state_bytes], [c.work_bytes]
    return front


def costed_view(call: Call, decl: ModelDecl) -> ModelDecl:
    """The model as `call` is costed on it: a non-train call of a trainable model runs on a
    transient copy of the parameters, which holds no gradients or optimizer states."""
    return decl if call.kind == "train" else decl.model_copy(update={"trainable": False})


def call_candidates(call: Call, decl: ModelDecl, cm: CostModel, space: SearchSpace) -> dict[int, list[Candidate]]:
    """Pruned candidates per mesh size, costed on the block at rank 0 (placement comes later)."""
    cluster = cm.cluster
    cap = cluster.usable_mem_bytes
    view = costed_view(call, decl)
    out: dict[int, list[Candidate]] = {}
    for size in mesh_sizes(cluster, space):
        mesh = Mesh.block(0, size)
        costed = []
        # Layouts whose model states alone exceed the memory are not costed (they cannot fit).
        allowed = [lay for lay in runnable_layouts(call, decl, size, cm)
                   if space.layout_ok is None or space.layout_ok(call, decl, lay)]
        valid = [lay for lay in allowed if cm.state_floor_bytes(view, lay) <= cap]
        if call.kind == "train":
            # Layouts that do not fit need no time; without GaLore, only those that can be kept.
            fits = [lay for lay in valid if cm.train_peak_bytes(call, view, mesh, lay) <= cap]
            costed = _train_candidates(call, view, cm, mesh, fits, space.keep_per_size) if space.galore is None \
                else [Candidate(mesh, lay, cm.call_cost(call, view, mesh, lay)) for lay in fits]
        else:
            for lay in valid:
                cost = cm.call_cost(call, view, mesh, lay)
                if cost.peak_mem_bytes <= cap:
                    costed.append(Candidate(mesh, lay, cost))
        # Memory binds the call on this mesh size where some layout does not fit: only then are
        # GaLore variants considered (GaLore changes the optimizer; where AdamW fits every way
        # the plan stays AdamW's).
        galore = space.galore is not None and call.kind == "train" and decl.trainable and len(costed) < len(allowed)
        if galore:
            costed += _galore_variants(call, view, cm, mesh, space, allowed, {c.layout for c in costed})
        if call.kind == "generate" and space.split_decode and cm.framework.layouts.split_decode and costed:
            costed += _split_decode(call, view, cm, mesh, pareto(costed)[:SPLIT_DECODE_PREFILLS], valid)
            if call.prompt_len >= LONG_SEQ_TOKENS:  # long prompts: a context-parallel prefill, then decode
                costed += _split_decode(call, view, cm, mesh, _cp_prefills(call, view, cm, mesh, valid), valid,
                                        must_split=True)
        if costed:
            out[size] = diverse(pareto(costed), space.keep_per_size)
            if galore:
                _add_galore(call, view, cm, space, out[size], costed)
    return out


def _train_candidates(call: Call, view: ModelDecl, cm: CostModel, mesh: Mesh, fits: list[Layout],
                      keep: int) -> list[Candidate]:
    """Enough of the train layouts `fits` (each fits, states on the GPU, AdamW) costed that
    `diverse(pareto(...), keep)` of them is that of all of them, pricing the rest only as far as
    a bound on their time (`CostModel.train_time_floor_s`, the step's pipeline part, which its
    ZeRO stages share): on PPO 70B's sixteen nodes with node ranges about one in ten.

    Exact: `diverse` keeps the leanest in state and in peak memory (known before pricing, so all
    layouts of that least state or peak are priced) and then the fastest of the front. A layout
    whose bound is at least F is no faster than F, so it can neither join nor reshape the front
    below F; once `keep` front members are faster than the smallest bound left unpriced, the
    front's fastest `keep` are final."""
    if len(fits) <= keep:
        return [Candidate(mesh, lay, cm.call_cost(call, view, mesh, lay)) for lay in fits]
    states = [cm.train_state_bytes(call, view, mesh, lay) for lay in fits]
    peaks = [cm.train_peak_bytes(call, view, mesh, lay) for lay in fits]
    least_state, least_peak = min(states), min(peaks)
    floors = [cm.train_time_floor_s(call, view, mesh, lay) for lay in fits]
    priced: dict[int, Candidate] = {}

    def price(i: int) -> None:
        if i not in priced:
            priced[i] = Candidate(mesh, fits[i], cm.call_cost(call, view, mesh, fits[i]))

    for i in range(len(fits)):
        if states[i] == least_state or peaks[i] == least_peak:
            price(i)
    order = sorted(range(len(fits)), key=lambda i: (floors[i], i))
    at, batch = 0, keep
    while at < len(order):
        for i in order[at:at + batch]:
            price(i)
        at += batch
        batch *= 2  # the front is rebuilt per batch: doubling keeps that to a log of the layouts
        bound = floors[order[at]] if at < len(order) else math.inf
        if sum(c.time_s < bound for c in pareto(list(priced.values()))) >= keep:
            break
    return list(priced.values())


def _galore_variants(call: Call, view: ModelDecl, cm: CostModel, mesh: Mesh, space: SearchSpace,
                     allowed: list[Layout], fitted: set[Layout]) -> list[Candidate]:
    """A train call's `allowed` layouts with the space's GaLore optimizer where AdamW's states do
    not fit (none of `fitted`) but GaLore's do. GaLore needs each matrix's whole gradient on a
    rank (`Layout.check_galore_whole_gradients`)."""
    assert space.galore is not None
    cap = cm.cluster.usable_mem_bytes
    out = []
    for lay in allowed:
        if lay.zero > 1 or lay in fitted:
            continue
        low = lay.model_copy(update={"galore": space.galore})
        if cm.state_floor_bytes(view, low) > cap or cm.train_peak_bytes(call, view, mesh, low) > cap:
            continue
        cost = cm.call_cost(call, view, mesh, low)
        if cost.peak_mem_bytes <= cap:
            out.append(Candidate(mesh, low, cost))
    return out


def _cp_prefills(call: Call, view: ModelDecl, cm: CostModel, mesh: Mesh, layouts: list[Layout]) -> list[Candidate]:
    """The fastest prefills of a long prompt that split data-parallel ranks into context-parallel
    ones, ranked by their prefill alone (each is then tried with every decode layout)."""
    seen, out = set(), []
    for lay in layouts:
        for c in (2, 4, 8):
            if lay.cp == 1 and lay.dp % c == 0 and lay.ep == 1:
                pre = lay.model_copy(update={"dp": lay.dp // c, "cp": c})
                if pre not in seen:
                    seen.add(pre)
                    out.append(Candidate(mesh, pre, cm.call_cost(call, view, mesh, pre)))
    return sorted(out, key=lambda c: (c.cost.breakdown_s.get("prefill", 0.0), c.layout.short()))[:SPLIT_DECODE_PREFILLS]


def _split_decode(call: Call, view: ModelDecl, cm: CostModel, mesh: Mesh, prefills: list[Candidate],
                  layouts: list[Layout], *, must_split: bool = False) -> list[Candidate]:
    """Generation that prefills with one layout and decodes with another on the same mesh (the
    cost model charges moving the weights and KV cache between them), where that is faster (with
    `must_split`, the fastest split of each prefill even where it decodes faster itself: its own
    candidate competes in the front anyway)."""
    out = []
    # A decode layout's own decode steps bound any split decoding with it from below (the prefill
    # and the move cost more on top), so layouts whose decode alone is no faster are not costed.
    decode_s = {}
    for dec in layouts:
        plain = cm.call_cost(call, view, mesh, dec)
        decode_s[dec] = plain.time_s - plain.breakdown_s.get("prefill", 0.0)
    # Tried by their decode alone, fastest first, so a good split is priced early and bounds the
    # rest; the answer is the one a walk in `layouts`' order keeps (the fastest, the first of equals).
    order = sorted(range(len(layouts)), key=lambda j: (decode_s[layouts[j]], j))
    for pre in prefills:
        best, best_s, best_j = pre, math.inf if must_split else pre.time_s, -1
        for j in order:
            dec = layouts[j]
            if decode_s[dec] >= best_s:
                break
            if dec == pre.layout:
                continue
            # Loses before the move is priced: its prefill and decode alone, then with the weights'
            # move at its floor (`CostModel.realloc_floor_s`, a fraction of the exact move's price).
            floor_s = cm.split_floor_s(call, view, mesh, pre.layout, dec)
            floor_s += cm.realloc_floor_s(view, (mesh, pre.layout), (mesh, dec))
            if floor_s > best_s or (floor_s == best_s and j > best_j):
                continue
            cost = cm.call_cost(call, view, mesh, pre.layout, decode_layout=dec)
            if cost.peak_mem_bytes <= cm.cluster.usable_mem_bytes and (
                    cost.time_s < best_s or (cost.time_s == best_s and j < best_j)):
                best, best_s, best_j = Candidate(mesh, pre.layout, cost, decode_layout=dec), cost.time_s, j
        if best is not pre:
            out.append(best)
    return out


def diverse(front: list[Candidate], keep: int) -> list[Candidate]:
    """`keep` candidates of a Pareto front: the leanest in resident and in peak memory (which may
    be what lets other calls fit beside them), then the fastest."""
    if len(front) <= keep:
        return front
    picks = [min(front, key=lambda c: (c.state_bytes, c.time_s)),
             min(front, key=lambda c: (c.cost.peak_mem_bytes, c.time_s))]
    chosen: list[Candidate] = []
    for c in [*picks, *front]:  # front is fastest first
        if c not in chosen:
            chosen.append(c)
        if len(chosen) == keep:
            break
    return sorted(chosen, key=lambda c: (c.time_s, c.state_bytes, c.work_bytes, c.layout.short()))


def twin_layout(call: Call, home: Layout) -> Layout:
    """The layout of `call` with the home's degrees; it holds parameters exactly as the home does
    (no reallocation) unless the home shards them over data-parallel ranks (ZeRO-3), in which
    case the call gathers them first, as FSDP does."""
    if call.kind == "train":
        return home
    # Context-parallel ranks hold replicas, exactly like data-parallel ones.
    return Layout(dp=home.dp * home.cp, tp=home.tp, pp=home.pp, micro_batches=home.micro_batches,
                  interleave=home.interleave, ep=home.ep, etp=home.etp)


def placed(cand: Candidate, mesh: Mesh) -> Candidate:
    """The same layout and costs on another aligned block of the same size."""
    return Candidate(mesh, cand.layout, cand.cost, cand.decode_layout)


def min_memory_needed(call: Call, decl: ModelDecl, cm: CostModel, space: SearchSpace) -> tuple[int, int]:
    """(smallest peak bytes per GPU over the layouts on the largest mesh the space allows, that
    mesh's size); -1 bytes when no layout is valid there."""
    cluster = cm.cluster
    size = max(mesh_sizes(cluster, space))
    view = costed_view(call, decl)
    best = None
    for lay in runnable_layouts(call, decl, size, cm):
        if space.layout_ok is not None and not space.layout_ok(call, decl, lay):
            continue
        peak = cm.call_cost(call, view, Mesh.block(0, size), lay).peak_mem_bytes
        best = peak if best is None else min(best, peak)
    return (best if best is not None else -1), size


def layout_evaluations(graph: Graph, cm: CostModel, space: SearchSpace) -> dict[str, int]:
    """Layouts the candidate costing of each call evaluates: a call that repeats an earlier one
    (same kind, sizes and model) counts 0, the cost model's cache answers it."""
    seen: set[tuple] = set()
    out: dict[str, int] = {}
    for c in graph.calls:
        decl = graph.models[c.model]
        key = (c.kind, c.seqs, c.seq_len, c.gen_len, c.response_len, c.minibatches, c.returns, decl.spec, decl.head,
               decl.trainable and c.kind == "train")
        out[c.name] = 0 if key in seen else sum(len(runnable_layouts(c, decl, size, cm))
                                                 for size in mesh_sizes(cm.cluster, space))
        seen.add(key)
    return out


def offload_kind(call: Call, graph: Graph) -> str | None:
    """What the home call `call` may keep in host memory between calls (`Layout.offload`): a
    trainable model's optimizer states, the weights of a frozen model no other call reads."""
    decl = graph.models[call.model]
    if decl.trainable:
        return "optimizer" if call.kind == "train" else None
    return "weights" if sum(c.model == call.model for c in graph.calls) == 1 else None


def _add_offload(call: Call, graph: Graph, cm: CostModel, sizes: dict[int, list[Candidate]]) -> None:
    """Add to a home call's kept candidates their variants with states in host memory: less
    resident on the GPU between calls, for the time of the host copies. None on a CPU cluster,
    where the host memory is the memory the ranks use."""
    kind = offload_kind(call, graph)
    cluster = cm.cluster
    if kind is None or cluster.gpu == "cpu":
        return
    view = costed_view(call, graph.models[call.model])
    for cands in sizes.values():
        # The kept candidates keep every state on the GPU; a variant has their peak, so it fits.
        for c in cands[:OFFLOAD_VARIANTS[kind]]:
            lay = c.layout.model_copy(update={"offload": kind})
            if engine_layout_problems(cm.framework, call.kind, lay, c.decode_layout, returns=call.returns):
                continue  # the stack's engines keep these states on the GPU
            cost = cm.call_cost(call, view, c.mesh, lay, decode_layout=c.decode_layout)
            if 0 < cost.host_mem_bytes <= cluster.host_mem_bytes:
                cands.append(Candidate(c.mesh, lay, cost, c.decode_layout))
        cands.sort(key=lambda c: (c.time_s, c.state_bytes, c.work_bytes, c.layout.short()))


def _add_galore(call: Call, view: ModelDecl, cm: CostModel, space: SearchSpace, kept: list[Candidate],
                costed: list[Candidate]) -> None:
    """Add to a train call's `kept` candidates of one mesh size the GaLore variant of the fastest
    AdamW one GaLore can run (ZeRO 0 or 1): as fast but for the projections, and less resident
    between calls, which is what binds where the models of a plan share GPUs."""
    plain = next((c for c in sorted(costed, key=lambda c: (c.time_s, c.layout.short()))
                  if c.layout.galore is None and c.layout.zero <= 1), None)
    if plain is None:
        return
    lay = plain.layout.model_copy(update={"galore": space.galore})
    if any(c.layout == lay for c in kept):
        return
    cost = cm.call_cost(call, view, plain.mesh, lay)
    if cost.peak_mem_bytes <= cm.cluster.usable_mem_bytes:
        kept.append(Candidate(plain.mesh, lay, cost))
        kept.sort(key=lambda c: (c.time_s, c.state_bytes, c.work_bytes, c.layout.short()))


def merge_candidates(into: dict[str, dict[int, list[Candidate]]], more: dict[str, dict[int, list[Candidate]]]) -> None:
    """Add to `into` the candidates of `more` it lacks (same call, mesh size and layouts)."""
    for name, sizes in more.items():
        for size, cands in sizes.items():
            have = into.setdefault(name, {}).setdefault(size, [])
            seen = {(c.layout, c.decode_layout) for c in have}
            for c in cands:
                if (c.layout, c.decode_layout) not in seen:
                    have.append(c)
                    seen.add((c.layout, c.decode_layout))
            have.sort(key=lambda c: (c.time_s, c.state_bytes, c.work_bytes, c.layout.short()))


def graph_candidates(graph: Graph, cm: CostModel, space: SearchSpace,
                     progress: Callable[[int, str], None] | None = None) -> dict[str, dict[int, list[Candidate]]]:
    """Candidates of every call. Each non-home call of a model also gets the twins of its home
    call's layouts, so sharing one placement (no reallocation) is always an option."""
    out = {}
    for n, c in enumerate(graph.calls):
        if progress is not None:
            progress(n + 1, c.name)
        out[c.name] = call_candidates(c, graph.models[c.model], cm, space)
    homes = graph.home_calls()
    cap = cm.cluster.usable_mem_bytes
    if space.offload:
        for c in graph.calls:
            if homes[c.model] == c.name:
                _add_offload(c, graph, cm, out[c.name])
    for c in graph.calls:
        home = homes[c.model]
        if home == c.name:
            continue
        view = costed_view(c, graph.models[c.model])
        for size, hcands in out[home].items():
            have = {x.layout for x in out[c.name].get(size, [])}
            for hc in hcands:
                lay = twin_layout(c, hc.layout)
                if lay in have or c.step_seqs % (lay.dp * lay.micro_batches):
                    continue
                cost = cm.call_cost(c, view, hc.mesh, lay)
                if cost.peak_mem_bytes <= cap:
                    out[c.name].setdefault(size, []).append(Candidate(hc.mesh, lay, cost))
                    have.add(lay)
    return out
