"""The search problem as arrays: what beam search, CP-SAT, the simulator, `build_plan`,
`explain` and the error messages all read.

Built from a graph, a cost model and the candidate space:

- `slots`: one per call, in topological order, each with its placed candidates (every aligned
  position of every pruned layout);
- the model's *home* call holds its parameters between iterations (a trainable model's train call,
  else its first call); every other call on the model works on a transient copy reallocated from
  the home placement just before it runs, unless the placements hold identical slices ("twins");
- data edges with the bytes of the handle they carry;
- `atoms`: the cluster cut into blocks of the smallest mesh size, so every mesh is a set of atoms;
- `ops`: the op-semantics table, one `OpSemantics` per slot and candidate (atoms, duration, the
  bytes it keeps resident, needs while it runs and copies unless a twin holds its slices, and
  which home candidates are its twins). Every rule of what a choice occupies and needs is read
  from it, so the simulator and the CP-SAT model cannot disagree about memory or occupancy.

Times that depend on two choices (reallocation, data transfer) are computed on demand and cached,
keyed by relative position so symmetric pairs share one cost evaluation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cost_models import CostModel
from planner.candidates import (
    Candidate,
    SearchSpace,
    costed_view,
    graph_candidates,
    mesh_positions,
    node_ranges_on,
    placed,
)
from plans.errors import PlannerError
from plans.graph import Call, Graph
from plans.layout import Mesh
from plans.sharding import distinct_slices, slices_key, slicing

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


def handle_bytes(call: Call) -> int:
    """Bytes of the data handle a call writes."""
    if call.kind == "generate":
        return call.seqs * call.seq_len * TOKEN_BYTES + call.seqs * call.gen_len * FLOAT_BYTES
    if call.kind == "inference":
        per_seq = 1 if call.returns == "scores" else call.seq_len
        return call.seqs * per_seq * FLOAT_BYTES
    return 0


@dataclass(frozen=True)
class OpSemantics:
    """What choosing one candidate of one slot means, as every reader of the search counts it."""

    atoms: range  # the atoms its mesh covers
    time_s: float  # its priced duration (`Candidate.time_s`)
    resident_bytes: int  # state kept on each of its atoms between calls (a home slot's candidate)
    work_bytes: int  # transient bytes per GPU while it runs, on top of what is resident
    copy_bytes: int  # a transient copy of the parameters, unless its home runs one of `twins`
    twins: frozenset[int]  # home candidates holding exactly its slices (no copy, no reallocation)
    host_bytes: int = 0  # host memory per GPU it keeps offloaded between calls (`Layout.offload`)

    def need_bytes(self, home: int | None) -> int:
        """Bytes per GPU it needs while it runs beside the resident states, its home running `home`."""
        return self.work_bytes + (0 if home in self.twins else self.copy_bytes)

    def copies(self, home: int | None) -> bool:
        """Whether it runs on a transient copy of the parameters (reallocated from the home)."""
        return self.copy_bytes > 0 and home not in self.twins


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
    _floor: dict[tuple, float] = field(default_factory=dict, repr=False)  # reallocation lower bounds by key
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

    @property
    def ops(self) -> list[list[OpSemantics]]:
        """The op-semantics table: `ops[slot][k]` for candidate k of `slot` (built once)."""
        return self.cached("ops", self._op_table)

    def _op_table(self) -> list[list[OpSemantics]]:
        out = []
        for s in self.slots:
            twins_of: dict[tuple[int, ...], list[int]] = {}
            if s.home is not None:
                for h, c in enumerate(self.slots[s.home].cands):
                    twins_of.setdefault(c.param_key(), []).append(h)
            out.append([OpSemantics(self.atoms(c), c.time_s, c.state_bytes if s.home is None else 0, c.work_bytes,
                                    0 if s.home is None else c.state_bytes,
                                    frozenset(twins_of.get(c.param_key(), ()) if s.home is not None else ()),
                                    c.cost.host_mem_bytes if s.home is None else 0)
                        for c in s.cands])
        return out

    def add_candidate(self, slot: int, cand: Candidate) -> int:
        """Append a candidate to `slot` (e.g. a plan's own placement outside the space) and return
        its index; the op-semantics table is rebuilt on next use."""
        self.slots[slot].cands.append(cand)
        for key in [k for k in self._cache if k == "ops" or k.startswith(("transfer", "realloc"))]:
            del self._cache[key]
        return len(self.slots[slot].cands) - 1

    def subset(self, keep: Sequence[Sequence[int]]) -> Problem:
        """The same problem with only candidates `keep[slot]` (in that order) of each slot; the
        costs it has computed, kept by what they depend on rather than by index, are shared."""
        slots = [Slot(s.index, s.call, [s.cands[k] for k in ks], s.home) for s, ks in zip(self.slots, keep)]
        return Problem(self.graph, self.cm, slots, self.edges, self.atom_size, self.unroll, self.symmetric,
                       self.realloc_work, _realloc=self._realloc, _transfer=self._transfer, _floor=self._floor,
                       _busy=self._busy, _per_node=self._per_node)

    def serial_makespan_s(self) -> float:
        """A makespan every sensible schedule stays within: every op one after another at its
        slowest candidate, after the slowest reallocation and transfer."""
        worst = sum(max(c.time_s for c in s.cands) for s in self.slots)
        realloc = sum(max(self.realloc_s(s.index, h, k) for h in range(len(self.slots[s.home].cands))
                          for k in range(len(s.cands))) for s in self.slots if s.home is not None)
        transfer = sum(max(self.transfer(e, a, b) for a in range(len(self.slots[i].cands))
                           for b in range(len(self.slots[j].cands))) for e, (i, j, _) in enumerate(self.edges))
        return (worst + realloc + transfer) * self.unroll

    def home_choice(self, slot: int, choice: Sequence[int | None]) -> int | None:
        """The candidate `choice` gives the home of `slot` (None for a home slot or an unassigned home)."""
        home = self.slots[slot].home
        return None if home is None else choice[home]

    def memory(self, choice: Sequence[int | None]) -> tuple[list[int], list[int]]:
        """(resident bytes per atom, peak bytes per atom) for a (possibly partial) assignment: the
        states homed on each atom, plus the largest need of any op that runs there."""
        resident = self._resident(choice)
        peak = list(resident)
        for s in self.slots:
            k = choice[s.index]
            if k is None:
                continue
            op = self.ops[s.index][k]
            need = op.need_bytes(self.home_choice(s.index, choice))
            for a in op.atoms:
                peak[a] = max(peak[a], resident[a] + need)
        return resident, peak

    def _resident(self, choice: Sequence[int | None]) -> list[int]:
        """The states homed on each atom (a difference array over the atoms' runs)."""
        diff = [0] * (self.n_atoms + 1)
        for s in self.slots:
            k = choice[s.index]
            if k is not None and self.ops[s.index][k].resident_bytes:
                op = self.ops[s.index][k]
                diff[op.atoms.start] += op.resident_bytes
                diff[op.atoms.stop] -= op.resident_bytes
        return list(itertools.accumulate(diff[:-1]))

    @property
    def host_cap_bytes(self) -> int:
        """Host memory per GPU that offloaded states may take (`ClusterSpec.host_mem_bytes`)."""
        return self.cluster.host_mem_bytes

    def host_bytes(self, choice: Sequence[int | None]) -> list[int]:
        """Host memory per GPU of each atom holding offloaded states between calls."""
        out = [0] * self.n_atoms
        for s in self.slots:
            k = choice[s.index]
            if k is not None and self.ops[s.index][k].host_bytes:
                op = self.ops[s.index][k]
                for a in op.atoms:
                    out[a] += op.host_bytes
        return out

    def host_fits(self, choice: Sequence[int | None]) -> bool:
        """Whether every atom's offloaded states fit in the host memory per GPU."""
        return max(self.host_bytes(choice)) <= self.host_cap_bytes

    def fits(self, choice: Sequence[int | None]) -> bool:
        """Whether a (possibly partial) assignment fits: every atom's peak within the usable GPU
        memory (`memory`) and its offloaded states within the host memory (`host_fits`). The beam
        asks this of every extension, so it checks each call's peak (`call_peak_bytes`) rather than
        building the per-atom peaks."""
        cap = self.cluster.usable_mem_bytes
        resident = self._resident(choice)
        if max(resident, default=0) > cap:
            return False
        return all(self.call_peak_bytes(resident, s.index, choice) <= cap for s in self.slots
                   if choice[s.index] is not None) and self.host_fits(choice)

    def call_peak_bytes(self, resident: Sequence[int], slot: int, choice: Sequence[int | None]) -> int:
        """The peak per GPU of the call in `slot` while it runs (`memory`'s rule, for that call alone)."""
        k = choice[slot]
        assert k is not None
        op = self.ops[slot][k]
        return max(resident[op.atoms.start:op.atoms.stop]) + op.need_bytes(self.home_choice(slot, choice))

    def twins(self, slot: int, k: int) -> list[int]:
        """Home candidates holding exactly the slices candidate k of `slot` needs (no copy, no
        reallocation when one of them is chosen); empty for a home slot."""
        return sorted(self.ops[slot][k].twins)

    def shares_params(self, slot: int, k: int, h: int | None) -> bool:
        """Whether candidate k of `slot` uses its home's parameters in place when the home runs
        candidate h."""
        return h is not None and h in self.ops[slot][k].twins

    def realloc(self, slot: int, h: int, k: int) -> tuple[int, float]:
        """(bytes, seconds) to reallocate slot's model from home candidate h to candidate k."""
        hit = self._realloc_at.get((slot, h, k))
        if hit is None:
            hit = self._realloc_at[slot, h, k] = self._realloc_of(slot, h, k)
        return hit

    def _realloc_of(self, slot: int, h: int, k: int) -> tuple[int, float]:
        if self.shares_params(slot, k, h):
            return 0, 0.0
        s = self.slots[slot]
        assert s.home is not None
        src, dst = self.slots[s.home].cands[h], s.cands[k]
        key = self._realloc_key(slot, h, k)
        if key not in self._realloc:
            self._charge_realloc(dst.mesh.size * distinct_slices(src.layout))
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
        """Reallocation time for searching: exact when already computed, else the cost model's
        cheap lower bound (`CostModel.realloc_floor_s`, which depends on the two layouts and on
        how the meshes overlap, so it is kept per `_realloc_key`). Search results are
        re-simulated with exact times, and bounds stay valid."""
        if self.shares_params(slot, k, h):
            return 0.0
        key = self._realloc_key(slot, h, k)
        if key in self._realloc:
            return self._realloc[key][1]
        hit = self._floor.get(key)
        if hit is None:
            s = self.slots[slot]
            assert s.home is not None
            src, dst = self.slots[s.home].cands[h], s.cands[k]
            hit = self._floor[key] = self.cm.realloc_floor_s(self.graph.models[s.call.model], (src.mesh, src.layout),
                                                             (dst.mesh, dst.layout))
        return hit

    def is_exact(self, slot: int, h: int, k: int) -> bool:
        return self.shares_params(slot, k, h) or self._realloc_key(slot, h, k) in self._realloc

    def _realloc_key(self, slot: int, h: int, k: int) -> tuple:
        """What the reallocation from home candidate h to candidate k of `slot` depends on: the
        model, both layouts, and how the two meshes sit (`_relation`); equal keys cost the same."""
        s = self.slots[slot]
        assert s.home is not None
        src, dst = self.slots[s.home].cands[h], s.cands[k]
        return (s.call.model, slicing(src.layout), slicing(dst.layout), *self._relation(src.mesh, dst.mesh))

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

    def transfer_groups(self, edge: int) -> tuple[list[int], list[int], list[list[float]]]:
        """The transfer table of `edge` by what it depends on: (group of each producer candidate,
        group of each consumer candidate, seconds per (producer group, consumer group)). A group
        is a mesh (and, where ranks drift, the producer's duration: `_transfer_of`); every
        candidate pair's `transfer` is its groups' entry. Built once per search."""
        def make() -> tuple[list[int], list[int], list[list[float]]]:
            pg, cg = self.transfer_group_keys(edge)
            p_rep, c_rep = _firsts(pg), _firsts(cg)
            return pg, cg, [[self.transfer(edge, ki, kj) for kj in c_rep] for ki in p_rep]
        return self.cached(f"transfer{edge}", make)

    def transfer_group_keys(self, edge: int) -> tuple[list[int], list[int]]:
        """`transfer_groups`'s (producer groups, consumer groups) alone, without costing its table."""
        def make() -> tuple[list[int], list[int]]:
            i, j, _ = self.edges[edge]
            return (_groups([self._transfer_source(c) for c in self.slots[i].cands])[0],
                    _groups([(c.mesh.first, c.mesh.size) for c in self.slots[j].cands])[0])
        return self.cached(f"transfer-groups{edge}", make)

    def _transfer_source(self, cand: Candidate) -> tuple[int, int, float]:
        """What a transfer's time depends on at the producer's end: its mesh and, where ranks drift
        apart (`CostModel.drifts`), the producer call's duration, since its ranks met the consumer's."""
        return (cand.mesh.first, cand.mesh.size, cand.time_s if self.cm.drifts else 0.0)

    def _transfer_of(self, edge: int, ki: int, kj: int) -> float:
        i, j, nbytes = self.edges[edge]
        src, mj = self.slots[i].cands[ki], self.slots[j].cands[kj].mesh
        if src.mesh == mj or nbytes == 0:
            return 0.0
        first, size, after_s = self._transfer_source(src)
        key = (edge, first, size, after_s, mj.first, mj.size)
        if key not in self._transfer:
            self._transfer[key] = self.cm.data_transfer_s(nbytes, src.mesh, mj, after_s=after_s)
        return self._transfer[key]

    def realloc_groups(self, slot: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """The reallocation table of `slot` by what it depends on (`_realloc_key`, twins
        included): (group of each home candidate, group of each of the slot's candidates, a
        (home candidate, candidate) pair standing for each (home group, group)): a group is a
        mesh and the slices its layout holds there."""
        def make() -> tuple[list[int], list[int], list[tuple[int, int]]]:
            s = self.slots[slot]
            assert s.home is not None
            hg, h_rep = _groups([slices_key(c.mesh, c.layout) for c in self.slots[s.home].cands])
            kg, k_rep = _groups([slices_key(c.mesh, c.layout) for c in s.cands])
            return hg, kg, [(h, k) for h in h_rep for k in k_rep]
        return self.cached(f"realloc{slot}", make)


def _groups(keys: list) -> tuple[list[int], list[int]]:
    """(group index of each item, first item of each group), groups numbered by first appearance."""
    index: dict = {}
    of: list[int] = []
    reps: list[int] = []
    for n, key in enumerate(keys):
        if key not in index:
            index[key] = len(reps)
            reps.append(n)
        of.append(index[key])
    return of, reps


def _firsts(groups: list[int]) -> list[int]:
    """The first item of each group of `_groups`' numbering."""
    out: dict[int, int] = {}
    for n, g in enumerate(groups):
        out.setdefault(g, n)
    return [out[g] for g in range(len(out))]


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
                                                    for m in mesh_positions(cm.cluster, size, space)])
    edges = slot_edges(graph, index)
    sizes = {c.mesh.size for s in slots for c in s.cands} | {cm.cluster.world_size}
    # Runs of consecutive nodes are not closed under swapping halves of the cluster (a 3-node mesh
    # straddles them), so the mirror symmetry that pins the first home call to rank 0 is off.
    return Problem(graph, cm, slots, edges, atom_size=math.gcd(*sizes), unroll=unroll,
                   symmetric=not node_ranges_on(space, cm.cluster))
