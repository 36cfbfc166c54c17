"""Parameter reallocation: move a model's parameters from one (mesh, layout) to another.

What moves is exactly `plans.sharding.transfer_plan`, the plan the cost model charges: every
slice a destination rank needs comes from one sender, a rank that already holds a slice copies it
locally, and each element crosses the wire at most once per receiver, so the bytes sent are the
minimum any reallocation must move. On top of that plan this module decides only how to send:

- one flat buffer per (sender, receiver) pair, the pair's pieces concatenated in plan order
  (parameter by parameter), so a reallocation is a handful of large messages, not one per slice;
- every receive and send of a rank is posted at once (`torch.distributed.batch_isend_irecv`,
  which NCCL needs to group opposite directions of a pair), then the local copies run while the
  messages are in flight, then the receives are unpacked;
- messages carry the parameters' own dtype, so the result is bit-exact.

`RankPlan` is what one rank does (computed once per reallocation of a plan, reused every step);
`reallocate` does it. The same machinery moves a generate call's prefilled KV cache to its decode
layout (`kv_rank_plan`, from `plans.sharding.kv_transfer_plan`). Under ZeRO-3 the source boxes are the data-parallel row splits
(`shard_box`), so reallocating from a ZeRO-3 layout gathers the rows as well.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from plans.layout import Layout, Mesh
from plans.model import Head, ModelSpec
from plans.sharding import (
    Box,
    Transfer,
    box_numel,
    kv_box,
    kv_names,
    kv_transfer_plan,
    parameters,
    shard_box,
    transfer_plan,
)

TAG = 13  # p2p tag of reallocation messages (gloo matches on it; NCCL relies on the common order)
Index = tuple[slice, ...]


@dataclass(frozen=True)
class Piece:
    """One slice of one parameter: where it sits in the sender's and in the receiver's tensors."""

    name: str
    src: Index  # index into the sender's slice of the parameter
    dst: Index  # index into the receiver's slice
    numel: int


@dataclass
class RankPlan:
    """One rank's part of a reallocation: what it sends to whom, receives from whom, copies locally,
    and the shapes of the slices it holds afterwards (empty when it is not in the destination mesh)."""

    rank: int
    sends: dict[int, list[Piece]] = field(default_factory=dict)  # receiver -> pieces, plan order
    recvs: dict[int, list[Piece]] = field(default_factory=dict)  # sender -> pieces, plan order
    local: list[Piece] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        """Whether the rank takes part (holds, sends or receives anything)."""
        return bool(self.sends or self.recvs or self.local or self.shapes)

    def send_numel(self) -> dict[int, int]:
        return {d: sum(p.numel for p in ps) for d, ps in self.sends.items()}

    def recv_numel(self) -> dict[int, int]:
        return {s: sum(p.numel for p in ps) for s, ps in self.recvs.items()}


@dataclass(frozen=True)
class Traffic:
    """What one rank did in one reallocation: elements sent per receiver and received per sender
    (counted from the buffers that went on the wire), elements copied locally, bytes per element."""

    sent: dict[int, int]
    received: dict[int, int]
    local_numel: int
    element_bytes: int

    @property
    def sent_bytes(self) -> int:
        return sum(self.sent.values()) * self.element_bytes


def _relative(box: Box, held: Box) -> Index:
    return tuple(slice(lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(box, held))


def _boxes(spec: ModelSpec, head: Head, mesh: Mesh, layout: Layout, rank: int) -> dict[str, Box]:
    """The boxes `rank` holds under (mesh, layout), by parameter name (none outside the mesh; a
    ZeRO-3 split of fewer rows than ranks leaves some ranks an empty box, which they still hold)."""
    if rank not in mesh.ranks:
        return {}
    local = mesh.ranks.index(rank)
    out = {}
    for p in parameters(spec, head=head):
        box = shard_box(p, spec, layout, local)
        if box is not None:
            out[p.name] = box
    return out


def rank_plan(spec: ModelSpec, *, head: Head, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout], rank: int,
              gpus_per_node: int) -> RankPlan:
    """`rank`'s part of reallocating `spec` from `src` to `dst` (`plans.sharding.transfer_plan`)."""
    held = _boxes(spec, head, *src, rank)
    wanted = _boxes(spec, head, *dst, rank)
    if not held and not wanted:
        return RankPlan(rank=rank)
    return plan_of(transfer_plan(spec, head=head, src=src, dst=dst, gpus_per_node=gpus_per_node), rank=rank,
                   held=held, wanted=wanted, boxes_of=lambda r: _boxes(spec, head, *src, r))


def kv_rank_plan(spec: ModelSpec, *, rows: int, positions: int, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
                 rank: int, gpus_per_node: int) -> RankPlan:
    """`rank`'s part of moving a prefilled KV cache (`plans.sharding.kv_transfer_plan`; tensors
    named by `plans.sharding.kv_names`, each this rank's box of it)."""
    def boxes(mesh: Mesh, layout: Layout, r: int, decode: bool) -> dict[str, Box]:
        if r not in mesh.ranks:
            return {}
        local = mesh.ranks.index(r)
        got = {n: kv_box(spec, layout, local, n, rows=rows, positions=positions, decode=decode) for n in kv_names(spec)}
        return {n: b for n, b in got.items() if b is not None}

    transfers = kv_transfer_plan(spec, rows=rows, positions=positions, src=src, dst=dst, gpus_per_node=gpus_per_node)
    return plan_of(transfers, rank=rank, held=boxes(*src, rank, False), wanted=boxes(*dst, rank, True),
                   boxes_of=lambda r: boxes(*src, r, False))


def plan_of(transfers: list[Transfer], *, rank: int, held: dict[str, Box], wanted: dict[str, Box],
            boxes_of: Callable[[int], dict[str, Box]]) -> RankPlan:
    """`rank`'s part of `transfers`: `held` and `wanted` are its boxes before and after (by tensor
    name), `boxes_of(r)` a sender's boxes before."""
    plan = RankPlan(rank=rank, shapes={n: tuple(hi - lo for lo, hi in b) for n, b in wanted.items()})
    sends: dict[int, list[Piece]] = defaultdict(list)
    recvs: dict[int, list[Piece]] = defaultdict(list)
    senders: dict[int, dict[str, Box]] = {rank: held}  # boxes of the ranks that send to this one
    for t in transfers:
        if rank not in (t.src, t.dst):
            continue
        if t.src not in senders:
            senders[t.src] = boxes_of(t.src)
        sbox = senders[t.src][t.param]
        dbox = wanted[t.param] if t.dst == rank else None
        piece = Piece(t.param, _relative(t.box, sbox), _relative(t.box, dbox) if dbox else (), box_numel(t.box))
        if t.src == t.dst:
            plan.local.append(piece)
        elif t.src == rank:
            sends[t.dst].append(piece)
        else:
            recvs[t.src].append(piece)
    plan.sends, plan.recvs = dict(sends), dict(recvs)
    return plan


def _pack(held: Mapping[str, Tensor], pieces: list[Piece], *, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One flat buffer of `pieces`, in order (one copy per piece, strided slices included)."""
    buf = torch.empty(sum(p.numel for p in pieces), dtype=dtype, device=device)
    off = 0
    with torch.no_grad():
        for p in pieces:
            src = held[p.name][p.src]
            buf[off:off + p.numel].view(src.shape).copy_(src)
            off += p.numel
    return buf


def reallocate(plan: RankPlan, held: Mapping[str, Tensor], *, device: torch.device,
               dtype: torch.dtype = torch.float32) -> tuple[dict[str, Tensor], Traffic]:
    """Run `plan` on this rank: `held` are its slices under the source layout (empty when outside
    the source mesh); returns its slices under the destination layout (new tensors, so the source
    stays intact) and what it sent and received. Every rank of both meshes must call it."""
    for name, t in held.items():
        if t.dtype != dtype:
            raise ValueError(f"parameter {name} is {t.dtype}, the reallocation moves {dtype}")
    out = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in plan.shapes.items()}
    inbox = {s: torch.empty(sum(p.numel for p in ps), dtype=dtype, device=device) for s, ps in plan.recvs.items()}
    outbox = {d: _pack(held, ps, dtype=dtype, device=device) for d, ps in plan.sends.items()}
    ops = [dist.P2POp(dist.irecv, buf, s, tag=TAG) for s, buf in sorted(inbox.items())]
    # Receivers after this rank first, then wrapping around: the senders of a mesh do not all
    # start on the same receiver.
    order = sorted(outbox, key=lambda d: (d < plan.rank, d))
    ops += [dist.P2POp(dist.isend, outbox[d], d, tag=TAG) for d in order]
    works = dist.batch_isend_irecv(ops) if ops else []
    with torch.no_grad():
        for p in plan.local:  # overlaps the messages in flight
            out[p.name][p.dst] = held[p.name][p.src]
        for w in works:
            w.wait()
        for s, pieces in plan.recvs.items():
            buf, off = inbox[s], 0
            for p in pieces:
                target = out[p.name][p.dst]
                target.copy_(buf[off:off + p.numel].view(target.shape))
                off += p.numel
    element = torch.empty((), dtype=dtype).element_size()
    traffic = Traffic(sent={d: b.numel() for d, b in outbox.items()}, received={s: b.numel() for s, b in inbox.items()},
                      local_numel=sum(p.numel for p in plan.local), element_bytes=element)
    return out, traffic
