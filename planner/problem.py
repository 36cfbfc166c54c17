"""The search problem as arrays: what beam search, CP-SAT and the simulator all read.

Built from a graph, a cost model and the candidate space:

- `slots`: one per call, in topological order, each with its placed candidates (every aligned
  position of every pruned layout);
- the model's *home* call holds its parameters between iterations (a trainable model's train call,
  else its first call); every other call on the model works on a transient copy reallocated from
  the home placement just before it runs, unless the placements hold identical slices ("twins");
- data edges with the bytes of the handle they carry;
- `atoms`: the cluster cut into blocks of the smallest mesh size, so every mesh is a set of atoms.

Times that depend on two choices (reallocation, data transfer) are computed on demand and cached,
keyed by relative position so symmetric pairs share one cost evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from cost_models import CostModel
from planner.candidates import Candidate, SearchSpace, costed_view, graph_candidates, mesh_positions, placed
from plans.errors import PlannerError
from plans.graph import Call, Graph
from plans.layout import Layout, Mesh

TOKEN_BYTES = 4  # int32 token ids
FLOAT_BYTES = 4  # fp32 per-token values, log-probs, scores
# Exact reallocation costing compares every destination rank with every distinct source shard, so
# its work grows with (destination mesh size x source shards): quadratic in the mesh size when the
# source is ZeRO-3. This bounds the sum over one search at a few minutes on one core (a PPO
# search on 512 GPUs spends 4% of it, on 2048 GPUs 70%); past it the request is refused.
REALLOC_WORK_LIMIT = 300_000_000
# One costing past this size takes minutes by itself (the arrays no longer fit in cache); a search
# that needs one is refused at once rather than after it.
REALLOC_ONE_LIMIT = 100_000_000


def _source_shards(layout: Layout) -> int:
    """Distinct slices a layout cuts a parameter into (what each destination rank is compared with)."""
    return layout.tp * layout.pp * layout.interleave * (layout.dp if layout.zero == 3 else 1)


def handle_bytes(call: Call) -> int:
    """Bytes of the data handle a call writes."""
    if call.kind == "generate":
        return call.seqs * call.seq_len * TOKEN_BYTES + call.seqs * call.gen_len * FLOAT_BYTES
    if call.kind == "inference":
        per_seq = 1 if call.returns == "scores" else call.seq_len
        return call.seqs * per_seq * FLOAT_BYTES
    return 0


@dataclass
class Slot:
    """One call of the graph and its candidates."""

    index: int
    call: Call
    cands: list[Candidate]
    home: int | None  # index of the model's home slot; None when this slot is the home


@dataclass
class Problem:
    graph: Graph
    cm: CostModel
    slots: list[Slot]
    edges: list[tuple[int, int, int]]  # (producer slot, consumer slot, bytes)
    atom_size: int
    unroll: int = 2
    symmetric: bool = False  # candidates sit at every aligned position (mirror symmetry holds)
    realloc_work: int = 0  # source x destination mesh sizes summed over exact reallocation costings
    _realloc: dict[tuple, tuple[int, float]] = field(default_factory=dict, repr=False)
    _transfer: dict[tuple, float] = field(default_factory=dict, repr=False)
    _busy: dict[tuple, tuple[float, ...]] = field(default_factory=dict, repr=False)
    _per_node: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict, repr=False)
    # The same two tables by candidate index (what the simulator asks, many times a search):
    _realloc_at: dict[tuple[int, int, int], tuple[int, float]] = field(default_factory=dict, repr=False)
    _transfer_at: dict[tuple[int, int, int], float] = field(default_factory=dict, repr=False)
    _cache: dict[str, object] = field(default_factory=dict, repr=False)

    def cached(self, key: str, make):  # noqa: ANN001, ANN201 - memo of derived tables
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    @property
    def cluster(self):
        return self.cm.cluster

    @property
    def n_atoms(self) -> int:
        return self.cluster.world_size // self.atom_size

    def atoms(self, cand: Candidate) -> range:
        return range(cand.mesh.first // self.atom_size, (cand.mesh.first + cand.mesh.size) // self.atom_size)

    def ranks_per_node(self, cand: Candidate) -> dict[int, int]:
        """Ranks of the candidate's mesh on each node it spans (do not modify: cached)."""
        key = (cand.mesh.first, cand.mesh.size)
        hit = self._per_node.get(key)
        if hit is None:
            gpn = self.cluster.gpus_per_node
            hit = {}
            for r in range(cand.mesh.first, cand.mesh.first + cand.mesh.size):
                hit[r // gpn] = hit.get(r // gpn, 0) + 1
            self._per_node[key] = hit
        return hit

    def busy_time_s(self, slot: int, k: int, busy: int) -> float:
        """Seconds candidate k of `slot` takes while `busy` ranks of its busiest node work, its own
        included (`CostModel.at_busy`): its priced time (`Candidate.time_s`) unless the node's
        ranks time-share cores and some of them are idle."""
        return self.busy_times_s(slot, k)[min(busy, self.cluster.gpus_per_node)]

    def busy_times_s(self, slot: int, k: int) -> tuple[float, ...]:
        """`busy_time_s` of candidate k of `slot` for every busy count (index 0 unused), computed
        once per layout and mesh size."""
        cand = self.slots[slot].cands[k]
        key = (slot, cand.mesh.size, cand.layout, cand.decode_layout)
        hit = self._busy.get(key)
        if hit is None:
            call = self.slots[slot].call
            view = costed_view(call, self.graph.models[call.model])
            times = [cand.time_s]  # index 0: not a busy count
            for busy in range(1, self.cluster.gpus_per_node + 1):
                cm = self.cm.at_busy(busy)
                times.append(cand.time_s if cm is self.cm else cm.call_cost(
                    call, view, Mesh.block(0, cand.mesh.size), cand.layout, decode_layout=cand.decode_layout).time_s)
            hit = self._busy[key] = tuple(times)
        return hit

    def fastest_s(self, slot: int, k: int) -> float:
        """The least time candidate k of `slot` can take: with no other rank of its nodes at work
        (what every lower bound must assume); its priced time on ranks that do not share cores."""
        if not self.cm.shares_cores:
            return self.slots[slot].cands[k].time_s
        return self.busy_time_s(slot, k, max(self.ranks_per_node(self.slots[slot].cands[k]).values()))

    def homes(self) -> dict[str, int]:
        return {s.call.model: s.index for s in self.slots if s.home is None}

    def twins(self, slot: int, k: int) -> list[int]:
        """Home candidates holding exactly the slices candidate k of `slot` needs (no copy, no
        reallocation when one of them is chosen); empty for a home slot."""
        s = self.slots[slot]
        if s.home is None:
            return []
        home = s.home
        keys = self.cached(f"keys{home}", lambda: _group_by_key(self.slots[home].cands))
        return keys.get(s.cands[k].param_key(), [])

    def shares_params(self, slot: int, k: int, h: int | None) -> bool:
        """Whether candidate k of `slot` uses its home's parameters in place when the home runs
        candidate h."""
        s = self.slots[slot]
        if s.home is None or h is None:
            return False
        return s.cands[k].param_key() == self.slots[s.home].cands[h].param_key()

    def realloc(self, slot: int, h: int, k: int) -> tuple[int, float]:
        """(bytes, seconds) to reallocate slot's model from home candidate h to candidate k."""
        hit = self._realloc_at.get((slot, h, k))
        if hit is None:
            hit = self._realloc_at[slot, h, k] = self._realloc_of(slot, h, k)
        return hit

    def _realloc_of(self, slot: int, h: int, k: int) -> tuple[int, float]:
        s = self.slots[slot]
        assert s.home is not None
        src, dst = self.slots[s.home].cands[h], s.cands[k]
        if src.param_key() == dst.param_key():
            return 0, 0.0
        key = (s.call.model, src.layout, dst.layout, *self._relation(src.mesh, dst.mesh))
        if key not in self._realloc:
            self._charge_realloc(dst.mesh.size * _source_shards(src.layout))
            decl = self.graph.models[s.call.model]
            cost = self.cm.realloc_cost(decl, (src.mesh, src.layout), (dst.mesh, dst.layout))
            self._realloc[key] = (cost.bytes, cost.time_s)
        return self._realloc[key]

    def _charge_realloc(self, work: int) -> None:
        self.realloc_work += work
        if work > REALLOC_ONE_LIMIT or self.realloc_work > REALLOC_WORK_LIMIT:
            cl = self.cluster
            raise PlannerError(
                f"the search for graph {self.graph.name!r} on {cl.short()} ({cl.world_size} GPUs) ran out of its work "
                "budget costing parameter reallocations: their exact cost grows with the square of the mesh size",
                hint="compile for fewer GPUs (e.g. the part of the cluster the job needs), or use "
                "--baseline colocate (one set of degrees per model moves almost nothing)",
            )

    def realloc_s(self, slot: int, h: int, k: int) -> float:
        """Reallocation time for searching: exact when already computed, else a cheap lower bound.

        The bound: nothing when the meshes overlap (ranks may hold what they need), else every
        destination rank receives all its parameter bytes at no more than the fastest link into it
        (the node's NVLink when both meshes share the node, the node's whole network otherwise).
        Search results are re-simulated with exact times, and bounds stay valid."""
        s = self.slots[slot]
        assert s.home is not None
        src, dst = self.slots[s.home].cands[h], s.cands[k]
        if src.param_key() == dst.param_key():
            return 0.0
        key = (s.call.model, src.layout, dst.layout, *self._relation(src.mesh, dst.mesh))
        if key in self._realloc:
            return self._realloc[key][1]
        rel = self._relation(src.mesh, dst.mesh)
        if rel[2] == 0:
            return 0.0
        cl = self.cluster
        assert cl.intra_node_gbps is not None and cl.inter_node_gbps is not None
        link_gbps = cl.intra_node_gbps if rel[3] else cl.inter_node_gbps
        return dst.state_bytes * 8 / (link_gbps * 1e9)

    def is_exact(self, slot: int, h: int, k: int) -> bool:
        s = self.slots[slot]
        assert s.home is not None
        src, dst = self.slots[s.home].cands[h], s.cands[k]
        key = (s.call.model, src.layout, dst.layout, *self._relation(src.mesh, dst.mesh))
        return src.param_key() == dst.param_key() or key in self._realloc

    def _relation(self, a: Mesh, b: Mesh) -> tuple[int, ...]:
        """What a reallocation's cost depends on in the placement of two aligned blocks: their
        sizes, and where the smaller sits in the larger when nested, or whether they share a node
        when disjoint (aligned blocks never partly overlap; `plans.sharding` picks senders by
        position in the destination mesh, so moving both by whole nodes changes nothing)."""
        if a.first <= b.first < a.first + a.size or b.first <= a.first < b.first + b.size:
            return (a.size, b.size, 0, b.first - a.first)
        gpn = self.cluster.gpus_per_node
        same_node = a.first // gpn == b.first // gpn
        return (a.size, b.size, 1, int(same_node))

    def transfer(self, edge: int, ki: int, kj: int) -> float:
        """Seconds to move the handle of `edge` between the chosen candidates."""
        hit = self._transfer_at.get((edge, ki, kj))
        if hit is None:
            hit = self._transfer_at[edge, ki, kj] = self._transfer_of(edge, ki, kj)
        return hit

    def _transfer_of(self, edge: int, ki: int, kj: int) -> float:
        i, j, nbytes = self.edges[edge]
        mi, mj = self.slots[i].cands[ki].mesh, self.slots[j].cands[kj].mesh
        if mi == mj or nbytes == 0:
            return 0.0
        after = self.slots[i].cands[ki].time_s  # the producer's call, since its ranks met the consumer's
        key = (edge, mi.first, mi.size, mj.first, mj.size, after)
        if key not in self._transfer:
            self._transfer[key] = self.cm.data_transfer_s(nbytes, mi, mj, after_s=after)
        return self._transfer[key]


def _group_by_key(cands: list[Candidate]) -> dict[tuple[int, ...], list[int]]:
    out: dict[tuple[int, ...], list[int]] = {}
    for h, c in enumerate(cands):
        out.setdefault(c.param_key(), []).append(h)
    return out


def graph_slots(graph: Graph, candidates_of: Callable[[Call], list[Candidate]]) -> tuple[list[Slot], dict[str, int]]:
    """One slot per call in topological order, with its candidates and its model's home slot, and
    the slot index of each call name."""
    order = graph.topo_order()
    index = {name: i for i, name in enumerate(order)}
    home_name = graph.home_calls()
    slots = []
    for name in order:
        call = graph.call(name)
        home = None if home_name[call.model] == name else index[home_name[call.model]]
        slots.append(Slot(index[name], call, candidates_of(call), home))
    return slots, index


def slot_edges(graph: Graph, index: dict[str, int]) -> list[tuple[int, int, int]]:
    """(producer slot, consumer slot, bytes): one edge per call pair, even when it carries several handles."""
    edge_bytes: dict[tuple[int, int], int] = {}
    for p, c, _ in graph.edges():
        edge_bytes[index[p], index[c]] = edge_bytes.get((index[p], index[c]), 0) + handle_bytes(graph.call(p))
    return [(i, j, b) for (i, j), b in edge_bytes.items()]


def build_problem(graph: Graph, cm: CostModel, space: SearchSpace, *, unroll: int = 2,
                  candidates: dict[str, dict[int, list]] | None = None) -> Problem:
    """Place every pruned candidate at every aligned position and index the graph."""
    per_size = candidates if candidates is not None else graph_candidates(graph, cm, space)
    slots, index = graph_slots(graph, lambda call: [placed(c, m) for size in sorted(per_size[call.name])
                                                    for c in per_size[call.name][size]
                                                    for m in mesh_positions(cm.cluster, size)])
    edges = slot_edges(graph, index)
    sizes = {c.mesh.size for s in slots for c in s.cands} | {cm.cluster.world_size}
    return Problem(graph, cm, slots, edges, atom_size=math.gcd(*sizes), unroll=unroll, symmetric=True)
