"""Collectives by the alpha-beta model over the real topology.

A group is `n` ranks with `per_node` of them on each of its nodes; `concurrent` groups of the same
kind have members on one node at once (the other tensor-parallel ranks' data-parallel groups, say)
and share its network. A ring collective moves the same volume over every edge of the ring, and
each node has one outgoing inter-node edge per ring, so (Thakur et al. 2005; NCCL's bus
bandwidth):

- all-reduce of S bytes: ``2(n-1)/n * S / busbw + 2(n-1) * alpha`` (ring), or a double binary
  tree ``2 S / busbw + 2 log2(n) * alpha`` when that is faster (small messages, many ranks);
- all-gather / reduce-scatter (S = the full gathered size): ``(n-1)/n * S / busbw + (n-1) alpha``;
- all-to-all: every rank sends ``(n-1)/n * S``, the part leaving the node over the network;
- broadcast: pipelined ``S / busbw + log2(n) alpha``; point-to-point ``S / link + alpha``;

with busbw the slowest link: NVLink per GPU inside a node, and across nodes the node's network
shared by the `concurrent` groups: ``node_net / concurrent``. Alpha is the intra- or inter-node
step latency.

A blocking collective also waits for the group's slowest rank (`skew_wait_s`). Ranks that
time-share CPU cores drift apart between collectives: each is descheduled for whole time slices
at random, so after work w a rank's lag is a random walk of slices, standard deviation
``sigma * sqrt(w)`` (``sigma * w / sqrt(q)`` below one slice q, when at most one preemption
falls in the work), and the collective ends when the rank furthest behind arrives: each rank
waits ``lag * E[max of n standard normals]`` on average. Devices of their own run their kernels
at a steady pace (sigma 0).

A collective hidden under compute is not free: NCCL runs one thread block per channel, each on a
streaming multiprocessor of its own, for as long as the collective lasts, so the kernels beside it
run on the other SMs and take ``1 / (1 - channels/SMs)`` as long while they overlap
(`overlap_interference_s`). Inside a node NCCL opens 32 channels over NVLink (NVIDIA/nccl#1685's
log on 8 H100s). A group that spans nodes gets far fewer (`nccl_channels`): NCCL's topology search
(``src/graph/search.cc``) gives each channel of a ring one NIC pair at up to 48 GB/s (the top of
its Hopper inter-node speed list), so it finds about one channel per NIC the group's ranks on a
node use, one per rank on DGX/HGX nodes, and ``ncclTopoPostset`` doubles them: 2 channels for one
rank per node, as NCCL's logs of such communicators print (``nRanks 4 nNodes 4 localRanks 1``:
``Channel 00/02``, ``Channel 01/02``; "2 coll channels"), 16 for eight. On a CPU the collective's
work (gloo's copies and socket sends) runs on the cores that compute: overlapping hides none of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from cost_models.hardware import Hardware


@dataclass(frozen=True)
class Group:
    """Where a process group's ranks sit."""

    n: int
    per_node: int  # members on each node the group spans
    concurrent: int  # groups of this kind with members on the same node, sharing its network

    @property
    def spans_nodes(self) -> bool:
        return self.per_node < self.n

    @property
    def nodes(self) -> int:
        return self.n // self.per_node


def group_at(*, first: int, stride: int, n: int, mesh_size: int, gpus_per_node: int) -> Group:
    """The group of `n` ranks ``first + i*stride`` in a mesh of `mesh_size` ranks."""
    if n <= 1:
        return Group(1, 1, 1)
    nodes = len({(first + i * stride) // gpus_per_node for i in range(n)})
    per_node = max(1, n // nodes)
    on_node = min(gpus_per_node, mesh_size)
    return Group(n, per_node, max(1, on_node // per_node) if nodes > 1 else 1)


def _busbw(g: Group, hw: Hardware) -> float:
    if not g.spans_nodes:
        return hw.intra_bytes_s
    net = hw.node_net_bytes_s / g.concurrent
    return min(hw.intra_bytes_s, net) if g.per_node > 1 else net


def _alpha(g: Group, hw: Hardware) -> float:
    return hw.inter_latency_s if g.spans_nodes else hw.intra_latency_s


def all_reduce_s(nbytes: float, g: Group, hw: Hardware) -> float:
    """Time to all-reduce `nbytes` per rank over `g`."""
    if g.n <= 1 or nbytes <= 0:
        return 0.0
    bw, a = _busbw(g, hw), _alpha(g, hw)
    ring = 2 * (g.n - 1) / g.n * nbytes / bw + 2 * (g.n - 1) * a
    tree = 2 * nbytes / bw + 2 * math.log2(g.n) * a
    return min(ring, tree)


def all_gather_s(nbytes: float, g: Group, hw: Hardware) -> float:
    """Time to all-gather (or reduce-scatter) a buffer of `nbytes` in total over `g`."""
    if g.n <= 1 or nbytes <= 0:
        return 0.0
    return (g.n - 1) / g.n * nbytes / _busbw(g, hw) + (g.n - 1) * _alpha(g, hw)


reduce_scatter_s = all_gather_s


def all_to_all_s(nbytes: float, g: Group, hw: Hardware, leaving_bytes: float | None = None) -> float:
    """Time for every rank to exchange `nbytes` (its whole buffer) with all others; of it
    `leaving_bytes` per rank cross the network (default: the share bound for other nodes' ranks)."""
    if g.n <= 1 or nbytes <= 0:
        return 0.0
    intra = (g.n - 1) / g.n * nbytes / hw.intra_bytes_s
    if not g.spans_nodes:
        return intra + (g.n - 1) * hw.intra_latency_s
    per_rank = (g.n - g.per_node) / g.n * nbytes if leaving_bytes is None else leaving_bytes
    leaving = g.per_node * g.concurrent * per_rank
    return max(intra, leaving / hw.node_net_bytes_s) + (g.n - 1) * hw.inter_latency_s


def broadcast_s(nbytes: float, g: Group, hw: Hardware) -> float:
    """Time to broadcast `nbytes` from one rank to the group (pipelined)."""
    if g.n <= 1 or nbytes <= 0:
        return 0.0
    return nbytes / _busbw(g, hw) + math.log2(g.n) * _alpha(g, hw)


def p2p_s(nbytes: float, *, cross_node: bool, senders_per_node: int, hw: Hardware) -> float:
    """Time to send `nbytes` between two ranks while `senders_per_node` ranks of the node send too."""
    if nbytes <= 0:
        return 0.0
    if cross_node:
        return nbytes / (hw.node_net_bytes_s / max(1, senders_per_node)) + hw.inter_latency_s
    return nbytes / hw.intra_bytes_s + hw.intra_latency_s


NCCL_CHANNELS = 32  # channels (one thread block, one SM, each) NCCL opens over NVLink on A100/H100 nodes
NET_CHANNELS_PER_RANK = 2  # channels per rank of a node for a group spanning nodes: one per NIC, doubled


def nccl_channels(g: Group | None = None) -> int:
    """Channels (SMs) a collective of `g` occupies: `NCCL_CHANNELS` inside a node (or for an
    unnamed group), two per rank on each node for a group spanning nodes, at most as many."""
    if g is None or not g.spans_nodes:
        return NCCL_CHANNELS
    return min(NCCL_CHANNELS, NET_CHANNELS_PER_RANK * g.per_node)


def overlap_interference_s(hidden_s: float, hw: Hardware, g: Group | None = None) -> float:
    """Compute time lost while collectives of `g` run for `hidden_s` under it, their SMs taken
    away (`nccl_channels`). On a CPU nothing is hidden: gloo's threads copy and send on the very
    cores that compute."""
    if hidden_s <= 0:
        return 0.0
    if hw.sm_count is None:
        return hidden_s
    share = min(0.5, nccl_channels(g) / hw.sm_count)
    return hidden_s * share / (1.0 - share)


def overlapped_s(total_s: float, window_s: float, floor_s: float, hw: Hardware, g: Group | None = None) -> float:
    """Wall time a collective of `g` taking `total_s` adds when it runs under compute worth
    `window_s`: what the compute cannot cover, at least `floor_s` (the piece that cannot overlap:
    the last bucket, one pipelined chunk), plus the slowdown the hidden rest causes
    (`overlap_interference_s`)."""
    exposed = max(total_s - window_s, floor_s)
    return exposed + overlap_interference_s(total_s - exposed, hw, g)


@cache
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for one; 1/sqrt(pi) for two), by quadrature."""
    if n <= 1:
        return 0.0
    steps, lo, hi = 4000, -8.0, 8.0
    dx = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * dx
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += (0.5 if i in (0, steps) else 1.0) * x * n * pdf * cdf ** (n - 1)
    return total * dx


def lag_std(work: float, *, sigma: float, slice_: float) -> float:
    """Standard deviation of a rank's lag behind its peers after `work` of work (module
    docstring): ``sigma * sqrt(work)`` from one slice on, linear below it (any one time unit)."""
    if sigma <= 0 or work <= 0:
        return 0.0
    return sigma * (math.sqrt(work) if work >= slice_ else work / math.sqrt(slice_))


def lag_std_s(work_s: float, hw: Hardware) -> float:
    """`lag_std` on `hw`'s measured drift, in seconds."""
    return lag_std(work_s, sigma=hw.skew_s_per_sqrt_s, slice_=hw.skew_slice_s)


def skew_wait_s(work_s: float, n: int, hw: Hardware) -> float:
    """Mean time a rank of an `n`-rank group waits at a blocking collective for the slowest rank,
    after `work_s` of work since the group last met: 0 on devices of their own."""
    if n <= 1:
        return 0.0
    return lag_std_s(work_s, hw) * expected_max_normal(n)
