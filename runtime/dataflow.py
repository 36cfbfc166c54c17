"""Moving call outputs (data handles) and per-call statistics between ranks, point to point.

A call's output is complete on the last pipeline stage of each data-parallel replica, every
tensor-parallel rank there holding the same rows (`runtime.engine`). The ranks that need a handle
are those of the meshes of the calls reading it; each gets the whole handle (the algorithm glue
of a train call normalises over the whole batch), replica by replica: from itself when it holds
that replica's rows, else from one holder, the holders of a replica taking turns by receiver so
the sends spread. One message per (holder, receiver) pair carries all of a handle's tensors as
bytes, so integer tokens, float log-probs and boolean masks arrive exactly.

Every rank walks the plan's calls in the same order and posts its sends and receives of an event
at the same point of that walk, so the messages between any two ranks are posted in the same
order on both sides (what NCCL needs; gloo also matches on the tag). Sends never block; a
receive is waited on only when a later call reads the handle, so ranks outside a producer's
mesh run their own calls meanwhile.

Statistics (each call's time, a train call's reward statistics) go from the call's *leader* (its
rank at the last stage, data- and tensor-parallel index 0) to rank 0, which writes the metrics: a
fixed-size message of JSON text. A train call's loss statistics are sums over its rows, so each
data-parallel replica's reporter (last stage, tensor-parallel index 0) sends its share and rank 0
adds them up, instead of an all-reduce that every replica would wait on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from plans.layout import Coord, Layout, Mesh
from runtime.engine import split_rows

DATA_TAG = 11
STATS_TAG = 12
STATS_BYTES = 4096  # room for a train call's statistics as JSON text
SHARES = "shares"  # key of a report's per-replica shares, which rank 0 sums
Rows = dict[str, Tensor]
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]  # key -> (shape of one row, dtype)


def leader(mesh: Mesh, layout: Layout) -> int:
    """The rank that reports a call's statistics: last stage, every other index 0."""
    return reporters(mesh, layout, kind="")[0]


def reporters(mesh: Mesh, layout: Layout, *, kind: str) -> tuple[int, ...]:
    """The ranks that send a call's statistics to rank 0, the leader first: a train call's
    replicas each report their share of its loss statistics (key `SHARES`)."""
    replicas = range(layout.dp) if kind == "train" else range(1)
    return tuple(mesh.ranks[layout.local_rank(Coord(pp=layout.pp - 1, dp=d, cp=0, tp=0))] for d in replicas)


def replica_holders(mesh: Mesh, layout: Layout) -> list[tuple[int, ...]]:
    """Per data-parallel replica, the ranks holding its output rows (its last stage)."""
    out = []
    for d in range(layout.dp):
        out.append(tuple(mesh.ranks[layout.local_rank(Coord(pp=layout.pp - 1, dp=d, cp=c, tp=t))]
                         for c in range(layout.cp) for t in range(layout.tp)))
    return out


def _pack(rows: Rows, shapes: Shapes) -> Tensor:
    return torch.cat([rows[k].to(shapes[k][1]).contiguous().view(torch.uint8).reshape(-1) for k in sorted(shapes)])


def _unpack(buf: Tensor, shapes: Shapes, n: int) -> Rows:
    out, off = {}, 0
    for k in sorted(shapes):
        shape, dtype = shapes[k]
        size = n * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[k] = buf[off:off + size].clone().view(dtype).reshape(n, *shape)  # clone: aligned storage
        off += size
    return out


@dataclass
class Incoming:
    """A handle this rank will hold once its receives complete: parts by replica, in row order."""

    shapes: Shapes
    parts: list[tuple[int, Rows | tuple[Any, Tensor]]]  # (rows, local rows or (work, buffer))
    done: Rows | None = None

    def get(self) -> Rows:
        if self.done is None:
            pieces = []
            for n, part in self.parts:
                if isinstance(part, dict):
                    pieces.append(part)
                else:
                    work, buf = part
                    work.wait()
                    pieces.append(_unpack(buf, self.shapes, n))
            # Pieces kept here and pieces received may sit on different devices (torch.cat refuses
            # a mix on CUDA): all go where the local rows are, else where the first piece is.
            self.done = {}
            for k in self.shapes:
                device = next((p[k].device for p in pieces if p[k].device.type != "cpu"), pieces[0][k].device)
                self.done[k] = torch.cat([p[k].to(device=device, dtype=self.shapes[k][1]) for p in pieces])
            self.parts = []
        return self.done


@dataclass
class Mailbox:
    """This rank's outstanding sends of a step (kept alive until they complete)."""

    rank: int
    pending: list[tuple[Any, Tensor]] = field(default_factory=list)

    def share(self, local: Rows | None, *, mesh: Mesh, layout: Layout, rows: int, shapes: Shapes,
              needers: tuple[int, ...], device: torch.device) -> Incoming | None:
        """Send this rank's replica rows to the `needers` that lack them and post the receives of
        the replicas it lacks; the handle on this rank (None when it does not need it).

        `local` are the rows of this rank's replica when it holds one (the call's last stage)."""
        holders = replica_holders(mesh, layout)
        splits = [split_rows(rows, dp=layout.dp, dp_index=d, micro_batches=1) for d in range(layout.dp)]
        mine = next((d for d, h in enumerate(holders) if self.rank in h), None)
        if mine is not None:
            if local is None:
                raise RuntimeError(f"rank {self.rank} holds replica {mine} of a call output but computed nothing")
            payload = None
            for n in needers:
                if n not in holders[mine] and _sender(holders[mine], n) == self.rank:
                    payload = _pack(local, shapes).to(device) if payload is None else payload
                    self.pending.append((dist.isend(payload, n, tag=DATA_TAG), payload))
        if self.rank not in needers:
            return None
        parts: list[tuple[int, Rows | tuple[Any, Tensor]]] = []
        for d, split in enumerate(splits):
            n = split.stop - split.start
            if d == mine:
                assert local is not None
                parts.append((n, dict(local)))  # stays where it was computed
            else:
                size = sum(n * math.prod(s) * torch.empty((), dtype=t).element_size() for s, t in shapes.values())
                buf = torch.empty(size, dtype=torch.uint8, device=device)
                parts.append((n, (dist.irecv(buf, _sender(holders[d], self.rank), tag=DATA_TAG), buf)))
        incoming = Incoming(shapes, parts)
        return incoming

    def report(self, stats: dict[str, float], *, device: torch.device) -> None:
        """Send a call's statistics to rank 0 (from the call's leader, when it is not rank 0)."""
        text = json.dumps(stats, sort_keys=True).encode()
        if len(text) > STATS_BYTES:
            raise RuntimeError(f"call statistics take {len(text)} bytes, more than the {STATS_BYTES} reserved")
        buf = torch.zeros(STATS_BYTES, dtype=torch.uint8)
        buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        buf = buf.to(device)
        self.pending.append((dist.isend(buf, 0, tag=STATS_TAG), buf))

    def flush(self) -> None:
        """Wait for every send of the step."""
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


@dataclass
class StatsInbox:
    """Rank 0's receives of the calls' statistics, read at the end of the step."""

    pending: list[tuple[Any, Tensor]] = field(default_factory=list)

    def expect(self, src: int, *, device: torch.device) -> None:
        buf = torch.empty(STATS_BYTES, dtype=torch.uint8, device=device)
        self.pending.append((dist.irecv(buf, src, tag=STATS_TAG), buf))

    def collect(self) -> list[dict[str, Any]]:
        out = []
        for work, buf in self.pending:
            work.wait()
            raw = bytes(buf.cpu().tolist())
            out.append(json.loads(raw.rstrip(b"\0").decode()))
        self.pending.clear()
        return out


def _sender(holders: tuple[int, ...], receiver: int) -> int:
    """The holder of a replica that sends it to `receiver` (holders take turns by receiver)."""
    return holders[receiver % len(holders)]
