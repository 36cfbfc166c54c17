"""Process groups of a (mesh, layout): one per mesh axis a rank belongs to.

`torch.distributed.new_group` must be called by every rank of the world, in the same order, for
every group, members or not. `Groups` therefore enumerates all groups of every (mesh, layout) a
plan uses on every rank, in plan order, and caches them by their rank tuple so a group shared by
two layouts (or two models) is created once. DeviceMesh is not used: plan meshes are sub-blocks
of the world and ZeRO-3 splits with numpy ``array_split`` bounds (`plans.sharding`), which
DTensor's even ``Shard`` placements do not express.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from plans.layout import Coord, Layout, Mesh


@dataclass(frozen=True)
class Axis:
    """A rank's group along one mesh axis: the global ranks in it and the rank's index there."""

    ranks: tuple[int, ...]
    index: int
    group: Any = None  # None when the axis has one rank (nothing to communicate)

    @property
    def size(self) -> int:
        return len(self.ranks)


SOLO = Axis(ranks=(0,), index=0)


@dataclass(frozen=True)
class RankGroups:
    """Where one rank sits in a (mesh, layout) and its groups along each axis."""

    layout: Layout
    local: int  # index of the rank in mesh.ranks
    coord: Coord
    tp: Axis
    dp: Axis
    pp: Axis  # the rank's pipeline: one rank per stage, same (dp, cp, tp) coordinates
    tied: Axis | None  # first and last stage sharing a tied embedding (pp > 1), else None
    ep: Axis = SOLO  # the stage's ranks holding the other experts (`Layout.expert_coord`)
    cp: Axis = SOLO  # the ranks sharing this rank's sequences: same (pp, dp, tp) coordinates
    # The data-parallel and context-parallel ranks together, same (pp, tp) coordinates (cp > 1;
    # None: the dp axis): ZeRO 0-2 partition their buffers and reduce their gradients over it.
    dpcp: Axis | None = None
    edp: Axis | None = None  # the ranks holding this rank's expert slices (None: the dp axis)

    @property
    def expert_dp(self) -> Axis:
        """The axis routed experts' gradients are summed over."""
        return self.edp if self.edp is not None else self.dp


class Groups:
    """Creates and caches process groups; `distributed=False` means a single process (the
    reference). Every group gets `timeout_s` (torch would give a new group its backend's default,
    not the default group's; None keeps that default)."""

    def __init__(self, *, distributed: bool, timeout_s: float | None = None) -> None:
        self.distributed = distributed
        self.timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        self._cache: dict[tuple[Any, ...], Any] = {}

    def _group(self, ranks: tuple[int, ...], tag: str = "") -> Any:
        """The group of `ranks`; a `tag` gives a communicator of its own (the experts'
        all-to-alls run while gradient buckets are in flight on the data-parallel one, and one
        queue holding both could order them differently on different ranks)."""
        if len(ranks) == 1 or not self.distributed:
            return None
        key = (tag, *ranks) if tag else ranks
        if key not in self._cache:
            self._cache[key] = dist.new_group(list(ranks), timeout=self.timeout)
        return self._cache[key]

    def build(self, mesh: Mesh, layout: Layout, *, rank: int, tied: bool) -> RankGroups | None:
        """Create every group of `layout` on `mesh` (collectively: call on every rank) and return
        this rank's, or None when the rank is outside the mesh."""
        def ranks_where(fixed: dict[str, int]) -> tuple[int, ...]:
            out = []
            for local in range(mesh.size):
                c = layout.coord(local)
                if all(getattr(c, k) == v for k, v in fixed.items()):
                    out.append(mesh.ranks[local])
            return tuple(out)

        axes: dict[str, tuple[str, ...]] = {"tp": ("pp", "dp", "cp"), "dp": ("pp", "cp", "tp"), "pp": ("dp", "cp", "tp")}
        if layout.cp > 1:
            axes["cp"] = ("pp", "dp", "tp")
            axes["dpcp"] = ("pp", "tp")
        mine: dict[str, Axis] = {}
        for name, fixed_axes in axes.items():
            seen: set[tuple[int, ...]] = set()
            for local in range(mesh.size):  # every group of this axis, in a fixed order
                c = layout.coord(local)
                ranks = ranks_where({k: getattr(c, k) for k in fixed_axes})
                if ranks in seen:
                    continue
                seen.add(ranks)
                # Stages talk point to point; gradient buckets on the dp x cp group run while the cp
                # group's attention collectives do, so it gets a communicator of its own.
                group = None if name == "pp" else self._group(ranks, tag="dpcp" if name == "dpcp" else "")
                if rank in ranks:
                    mine[name] = Axis(ranks=ranks, index=ranks.index(rank), group=group)
        if layout.ep > 1:  # the experts' axes: same stage, same (etp, edp) / (ep, etp) coordinates
            for name, keep in (("ep", (1, 2)), ("edp", (0, 1))):
                seen = set()
                for local in range(mesh.size):
                    fixed = (layout.coord(local).pp, *(layout.expert_coord(local)[i] for i in keep))
                    ranks = tuple(mesh.ranks[j] for j in range(mesh.size)
                                  if (layout.coord(j).pp, *(layout.expert_coord(j)[i] for i in keep)) == fixed)
                    if ranks in seen:
                        continue
                    seen.add(ranks)
                    group = self._group(ranks, tag="ep" if name == "ep" else "")
                    if rank in ranks:
                        mine[name] = Axis(ranks=ranks, index=ranks.index(rank), group=group)
        tied_axis = None
        if tied and layout.pp > 1:
            for local in range(mesh.size):
                c = layout.coord(local)
                if c.pp != 0:
                    continue
                last = mesh.ranks[layout.local_rank(c._replace(pp=layout.pp - 1))]
                pair = (mesh.ranks[local], last)
                group = self._group(pair)
                if rank in pair:
                    tied_axis = Axis(ranks=pair, index=pair.index(rank), group=group)
        if rank not in mesh.ranks:
            return None
        local = mesh.ranks.index(rank)
        return RankGroups(layout=layout, local=local, coord=layout.coord(local), tp=mine["tp"], dp=mine["dp"],
                          pp=mine["pp"], tied=tied_axis, ep=mine.get("ep", SOLO), edp=mine.get("edp"),
                          cp=mine.get("cp", SOLO), dpcp=mine.get("dpcp"))


def init_default_group(backend: str, *, timeout_s: float) -> None:
    """Create the default process group from torchrun's environment (``env://``), every key it
    puts in the rendezvous store under a prefix naming the restart attempt.

    torchrun (``--standalone`` / c10d rendezvous) shares its own store with the workers of every
    attempt; without the prefix, the ranks of a restarted group can read the addresses the ranks
    of the failed attempt left there and fail to connect (gloo: "connectFullMesh failed ...
    Connection refused")."""
    timeout = timedelta(seconds=timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def solo_groups(layout: Layout) -> RankGroups:
    """The groups of a single process running the whole model (the reference)."""
    return RankGroups(layout=layout, local=0, coord=layout.coord(0), tp=SOLO, dp=SOLO, pp=SOLO, tied=None)


def all_gather_into(out: Any, inp: Any, *, group: Any, async_op: bool = False) -> Any:
    """All-gather `inp` from every rank of `group` into `out`, concatenated along dim 0 (with
    `async_op`, returns the work handle to wait on)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: Any, inp: Any, *, group: Any, async_op: bool = False) -> Any:
    """Sum `inp` over `group` and keep this rank's dim-0 block of it in `out` (with `async_op`,
    returns the work handle to wait on)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    return fn(out, inp, group=group, async_op=async_op)
