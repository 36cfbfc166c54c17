"""Per-rank volumes of a parameter reallocation, vectorised.

The same transfer plan as `plans.sharding.transfer_plan` (same slices, same stateless choice of
sender), reduced to what a time model needs: elements each rank sends and receives over NVLink
(same node) and over the network, and the elements kept locally. numpy makes it cheap enough for
the search to cost every (source, destination) candidate pair; a test checks it against the
pure-Python plan element for element.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from plans.layout import Layout, Mesh
from plans.model import Head, ModelSpec
from plans.sharding import Param, _stage_of_layer, param_stages, parameters, stage_layers


@dataclass(frozen=True)
class RankVolumes:
    """Elements moved per global rank (arrays indexed by rank - `first`)."""

    first: int
    send_intra: np.ndarray
    send_inter: np.ndarray
    recv_intra: np.ndarray
    recv_inter: np.ndarray
    local_numel: int
    # Slices each rank packs to send, unpacks after receiving, and copies locally (each a few
    # host-side tensor ops in the runtime, `runtime.realloc`).
    send_pieces: np.ndarray | None = None
    recv_pieces: np.ndarray | None = None
    local_pieces: np.ndarray | None = None

    @property
    def moved_numel(self) -> int:
        return int(self.recv_intra.sum() + self.recv_inter.sum())


def _splits(n: int, parts: int) -> np.ndarray:
    """array_split bounds: starts of each part plus n (length parts + 1)."""
    q, r = divmod(n, parts)
    idx = np.arange(parts + 1)
    return idx * q + np.minimum(idx, r)


NODE_KEY = 1 << 24  # cell * NODE_KEY + node: a sort key of holders by (cell, node)
PAIR_CHUNK = 1 << 22  # (receiver, cell) pairs evaluated at once: bounds memory on very large meshes


def _split_at(lo: np.ndarray, hi: np.ndarray, dim: int, parts: int, index: np.ndarray) -> None:
    """Narrow every rank's [lo, hi) along `dim` to part `index` of `parts` (array_split bounds)."""
    span = hi[:, dim] - lo[:, dim]
    q, r = np.divmod(span, parts)
    start = index * q + np.minimum(index, r)
    stop = start + q + (index < r)
    lo[:, dim], hi[:, dim] = lo[:, dim] + start, lo[:, dim] + stop


@lru_cache(maxsize=65536)
def _boxes(shape: tuple[int, ...], tp_dim: int | None, stages: tuple[int, ...], lay: Layout,
           size: int, expert_dim: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(holds[local], lo[local, dim], hi[local, dim]) of every rank of a mesh (see `shard_box`)."""
    local = np.arange(size)
    tp = local % lay.tp
    dp = (local // (lay.tp * lay.cp)) % lay.dp
    pp = local // (lay.tp * lay.cp * lay.dp)
    holds = np.isin(pp, stages)
    ndim = len(shape)
    lo = np.zeros((size, ndim), dtype=np.int64)
    hi = np.tile(np.array(shape, dtype=np.int64), (size, 1))
    if expert_dim is not None:  # Layout.expert_coord, vectorised
        in_stage = local % (lay.tp * lay.cp * lay.dp)
        _split_at(lo, hi, expert_dim, lay.ep, (in_stage // lay.etp) % lay.ep)
        if tp_dim is not None and lay.etp > 1:
            _split_at(lo, hi, tp_dim, lay.etp, in_stage % lay.etp)
        if lay.zero == 3:
            _split_at(lo, hi, 1, lay.edp, in_stage // (lay.etp * lay.ep))
        holds &= np.prod(hi - lo, axis=1) > 0
        return holds, lo, hi
    if tp_dim is not None and lay.tp > 1:
        b = _splits(shape[tp_dim], lay.tp)
        lo[:, tp_dim], hi[:, tp_dim] = b[tp], b[tp + 1]
    if lay.zero == 3:
        span = hi[:, 0] - lo[:, 0]
        q, r = np.divmod(span, lay.dp)
        start = dp * q + np.minimum(dp, r)
        stop = start + q + (dp < r)
        lo[:, 0], hi[:, 0] = lo[:, 0] + start, lo[:, 0] + stop
    holds &= np.prod(hi - lo, axis=1) > 0
    return holds, lo, hi


@dataclass(frozen=True)
class _Source:
    """Where the slices of one tensor sit under a placement: distinct boxes ("cells") and their
    holders, indexed for the sender choice."""

    c_lo: np.ndarray
    c_hi: np.ndarray
    first: int
    cell_at: np.ndarray  # cell held by each rank of the mesh, -1 for none
    near_keys: np.ndarray  # sorted cell * NODE_KEY + node of holder groups
    near_start: np.ndarray  # first index of each group in `by_near`
    near_count: np.ndarray
    by_near: np.ndarray  # holder ranks sorted by (cell, node, rank)
    by_cell: np.ndarray  # holder ranks sorted by (cell, rank)
    cell_start: np.ndarray
    cell_count: np.ndarray


@lru_cache(maxsize=65536)
def _source(shape: tuple[int, ...], tp_dim: int | None, stages: tuple[int, ...], lay: Layout, mesh: Mesh,
            gpn: int, expert_dim: int | None = None) -> _Source | None:
    return _source_of(*_boxes(shape, tp_dim, stages, lay, mesh.size, expert_dim), mesh, gpn)


def _source_of(holds: np.ndarray, lo: np.ndarray, hi: np.ndarray, mesh: Mesh, gpn: int) -> _Source | None:
    """`_Source` of a tensor whose slices the ranks of `mesh` hold as [lo, hi) boxes where `holds`."""
    if not holds.any():
        return None
    idx = np.flatnonzero(holds)
    cells, cell_of = np.unique(np.concatenate([lo[idx], hi[idx]], axis=1), axis=0, return_inverse=True)
    cell_of = cell_of.reshape(-1)
    rank = mesh.first + idx
    ndim = lo.shape[1]
    cell_at = np.full(mesh.size, -1)
    cell_at[idx] = cell_of
    order = np.lexsort((rank, rank // gpn, cell_of))
    keys, starts, counts = np.unique(cell_of[order] * NODE_KEY + rank[order] // gpn, return_index=True,
                                     return_counts=True)
    by_cell = np.lexsort((rank, cell_of))
    return _Source(cells[:, :ndim], cells[:, ndim:], mesh.first, cell_at, keys, starts, counts, rank[order],
                   rank[by_cell], np.searchsorted(cell_of[by_cell], np.arange(len(cells))),
                   np.bincount(cell_of, minlength=len(cells)))


@lru_cache(maxsize=65536)
def _needs(shape: tuple[int, ...], tp_dim: int | None, stages: tuple[int, ...], lay: Layout,
           mesh: Mesh, expert_dim: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(receiver global ranks, lo, hi) of every rank of a mesh that needs a non-empty slice."""
    return _needs_of(*_boxes(shape, tp_dim, stages, lay, mesh.size, expert_dim), mesh)


def _needs_of(holds: np.ndarray, lo: np.ndarray, hi: np.ndarray, mesh: Mesh
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    if not holds.any():
        return None
    idx = np.flatnonzero(holds)
    return mesh.first + idx, lo[idx], hi[idx]


def _param_volumes(param: Param, spec: ModelSpec, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout], gpn: int,
                   first: int, span: int) -> tuple[Any, ...]:
    """(send intra, send inter, receive intra, receive inter, send pieces, receive pieces, local
    pieces) per rank, and the elements kept locally."""
    (smesh, slay), (dmesh, dlay) = src, dst
    source = _source(param.shape, param.tp_dim, param_stages(param, spec, slay), slay, smesh, gpn, param.expert_dim)
    needs = _needs(param.shape, param.tp_dim, param_stages(param, spec, dlay), dlay, dmesh, param.expert_dim)
    return _volumes(source, needs, smesh, dmesh, gpn, first, span)


def _volumes(source: _Source | None, needs: tuple[np.ndarray, np.ndarray, np.ndarray] | None, smesh: Mesh,
             dmesh: Mesh, gpn: int, first: int, span: int) -> tuple[Any, ...]:
    """`_param_volumes` of one tensor held as `source` and needed as `needs`, with the transfer
    plan's sender choice (`plans.sharding._route`)."""
    zeros = [np.zeros(span, dtype=np.int64) for _ in range(7)]
    if source is None or needs is None:
        return (*zeros, 0)
    recv_all, lo_all, hi_all = needs
    send_intra, send_inter, recv_intra, recv_inter, send_n, recv_n, local_n = zeros
    kept = 0
    # Receivers a chunk at a time: the receiver x cell overlap table of a large mesh would not fit
    # in memory at once.
    rows = max(1, PAIR_CHUNK // len(source.c_lo))
    for at in range(0, len(recv_all), rows):
        recv_rank, d_lo, d_hi = recv_all[at:at + rows], lo_all[at:at + rows], hi_all[at:at + rows]
        ov = np.prod(np.clip(np.minimum(d_hi[:, None, :], source.c_hi[None])
                             - np.maximum(d_lo[:, None, :], source.c_lo[None]), 0, None), axis=2)  # [receiver, cell]
        rj, cj = np.nonzero(ov)
        vol = ov[rj, cj]
        r = recv_rank[rj]
        # Local when the receiver itself holds the cell.
        inside = (r >= smesh.first) & (r < smesh.first + smesh.size)
        is_local = inside & (source.cell_at[np.where(inside, r - smesh.first, 0)] == cj)
        # Sender: a holder of the cell on the receiver's node if any, else any holder; the k-th
        # such holder with k = receiver's position in the destination mesh mod their count.
        key = cj * NODE_KEY + r // gpn
        pos = np.minimum(np.searchsorted(source.near_keys, key), len(source.near_keys) - 1)
        has_near = source.near_keys[pos] == key
        kth = r - dmesh.first
        near = source.by_near[source.near_start[pos] + kth % np.where(has_near, source.near_count[pos], 1)]
        anywhere = source.by_cell[source.cell_start[cj] + kth % source.cell_count[cj]]
        sender = np.where(has_near, near, anywhere)
        moved = ~is_local
        intra = (sender // gpn == r // gpn) & moved
        inter = moved & ~intra
        np.add.at(send_intra, sender[intra] - first, vol[intra])
        np.add.at(send_inter, sender[inter] - first, vol[inter])
        np.add.at(recv_intra, r[intra] - first, vol[intra])
        np.add.at(recv_inter, r[inter] - first, vol[inter])
        np.add.at(send_n, sender[moved] - first, 1)
        np.add.at(recv_n, r[moved] - first, 1)
        np.add.at(local_n, r[is_local] - first, 1)
        kept += int(vol[is_local].sum())
    return send_intra, send_inter, recv_intra, recv_inter, send_n, recv_n, local_n, kept


def rank_volumes(spec: ModelSpec, *, head: Head, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
                 gpus_per_node: int) -> RankVolumes:
    """Per-rank send/receive elements of reallocating `spec` from `src` to `dst`."""
    return _rank_volumes(spec, head, src, dst, gpus_per_node)


@lru_cache(maxsize=8192)
def _rank_volumes(spec: ModelSpec, head: Head, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
                  gpn: int) -> RankVolumes:
    first = min(src[0].first, dst[0].first)
    span = max(src[0].first + src[0].size, dst[0].first + dst[0].size) - first
    s_owner = _stage_of_layer(spec.num_hidden_layers, src[1].pp, src[1].interleave)
    d_owner = _stage_of_layer(spec.num_hidden_layers, dst[1].pp, dst[1].interleave)
    groups: dict[tuple[int, int, bool], list[int]] = {}
    for i in range(spec.num_hidden_layers):  # dense and sparse layers hold different tensors
        groups.setdefault((s_owner[i], d_owner[i], spec.is_moe_layer(i)), []).append(i)
    reps = {layers[0]: len(layers) for layers in groups.values()}
    totals = [np.zeros(span, dtype=np.int64) for _ in range(7)]
    local = 0
    seen: dict[tuple, tuple] = {}
    for param in parameters(spec, head=head):
        if param.layer is not None and param.layer not in reps:
            continue
        scale = reps[param.layer] if param.layer is not None else 1
        # Tensors that both layouts cut evenly the same way move alike, in proportion to their
        # size: each is costed as the smallest such shape (`_unit`), its elements scaled up.
        unit = _unit(param.shape, param.tp_dim, param.expert_dim, src[1], dst[1])
        shape, times = (param.shape, 1) if unit is None else (unit, math.prod(param.shape) // math.prod(unit))
        s_st, d_st = param_stages(param, spec, src[1]), param_stages(param, spec, dst[1])
        kind = (shape, param.tp_dim, param.expert_dim, s_st, d_st)
        if kind not in seen:
            source = _source(shape, param.tp_dim, s_st, src[1], src[0], gpn, param.expert_dim)
            needs = _needs(shape, param.tp_dim, d_st, dst[1], dst[0], param.expert_dim)
            seen[kind] = _volumes(source, needs, src[0], dst[0], gpn, first, span)
        *arrays, kept = seen[kind]
        for n, (t, a) in enumerate(zip(totals, arrays)):
            t += a * (scale * times if n < 4 else scale)  # elements scale with the size; slices do not
        local += kept * scale * times
    return RankVolumes(first, totals[0], totals[1], totals[2], totals[3], local, totals[4], totals[5], totals[6])


def _unit(shape: tuple[int, ...], tp_dim: int | None, expert_dim: int | None, src: Layout,
          dst: Layout) -> tuple[int, ...] | None:
    """The smallest shape that both layouts cut as they cut a tensor of `shape`, every split
    exact (each of its slices then a fixed fraction of the tensor); None where a split is uneven."""
    out = []
    for dim, n in enumerate(shape):
        need = math.lcm(_parts(tp_dim, expert_dim, dim, src), _parts(tp_dim, expert_dim, dim, dst))
        if n % need:
            return None
        out.append(need)
    return tuple(out)


def _parts(tp_dim: int | None, expert_dim: int | None, dim: int, lay: Layout) -> int:
    """Into how many parts `lay` cuts a tensor along `dim`, splits nested (`_boxes`)."""
    if expert_dim is not None:
        parts = lay.ep if dim == expert_dim else 1
        if dim == tp_dim and lay.etp > 1:
            parts *= lay.etp
        return parts * (lay.edp if lay.zero == 3 and dim == 1 else 1)
    parts = lay.tp if dim == tp_dim and lay.tp > 1 else 1
    return parts * (lay.dp if lay.zero == 3 and dim == 0 else 1)


KV_BYTES = 2  # a KV cache element (bf16), as `cost_models.memory.kv_cache_bytes` counts it


def kv_volumes(spec: ModelSpec, *, rows: int, positions: int, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
               gpus_per_node: int) -> RankVolumes:
    """Per-rank send/receive elements of moving a prefilled KV cache between layouts: the totals of
    `plans.sharding.kv_transfer_plan` (a test checks them against it)."""
    return _kv_volumes(spec, rows, positions, src, dst, gpus_per_node)


@lru_cache(maxsize=8192)
def _kv_volumes(spec: ModelSpec, rows: int, positions: int, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
                gpn: int) -> RankVolumes:
    first = min(src[0].first, dst[0].first)
    span = max(src[0].first + src[0].size, dst[0].first + dst[0].size) - first
    # Layers held by the same stages move alike: one of each (source stage, destination stage) group,
    # and a layer's keys and values alike.
    s_owner = _stage_of_layer(spec.num_hidden_layers, src[1].pp, src[1].interleave)
    d_owner = _stage_of_layer(spec.num_hidden_layers, dst[1].pp, dst[1].interleave)
    groups: dict[tuple[int, int], int] = {}
    for i in range(spec.num_hidden_layers):
        groups[s_owner[i], d_owner[i]] = groups.get((s_owner[i], d_owner[i]), 0) + 1
    totals = [np.zeros(span, dtype=np.int64) for _ in range(7)]
    local = 0
    for (s_stage, d_stage), n in groups.items():
        source = _source_of(*_kv_boxes(spec, rows, positions, s_stage, src[1], decode=False), src[0], gpn)
        needs = _needs_of(*_kv_boxes(spec, rows, positions, d_stage, dst[1], decode=True), dst[0])
        *arrays, kept = _volumes(source, needs, src[0], dst[0], gpn, first, span)
        for t, a in zip(totals, arrays):
            t += a * (2 * n)
        local += kept * 2 * n
    return RankVolumes(first, totals[0], totals[1], totals[2], totals[3], local, totals[4], totals[5], totals[6])


def _kv_boxes(spec: ModelSpec, rows: int, positions: int, stage: int, lay: Layout, *,
              decode: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`plans.sharding.kv_box` of one layer of `stage` for every rank of a mesh, vectorised."""
    local = np.arange(lay.size)
    tp = local % lay.tp
    cp = (local // lay.tp) % lay.cp
    dp = (local // (lay.tp * lay.cp)) % lay.dp
    pp = local // (lay.tp * lay.cp * lay.dp)
    lo = np.zeros((lay.size, 4), dtype=np.int64)
    hi = np.tile(np.array([rows, spec.kv_heads, positions, spec.d_head], dtype=np.int64), (lay.size, 1))
    for dim, parts, index in ((0, lay.dp, dp), (1, lay.tp, tp)) + (((2, lay.cp, cp),) if decode else ()):
        b = _splits(int(hi[0, dim]), parts)
        lo[:, dim], hi[:, dim] = b[index], b[index + 1]
    holds = (pp == stage) & (np.prod(hi - lo, axis=1) > 0)
    return holds, lo, hi


@dataclass(frozen=True)
class ReallocFloor:
    """What a reallocation between two layouts costs wherever their meshes sit: per rank of the
    destination (local index), the elements it needs, at most how many of them it can already
    hold (the largest overlap of each tensor with one source slice, summed), and its pieces (the
    source slices its slices overlap: each is unpacked or copied, received or local, `RankVolumes`'
    recv + local pieces, which the sender choice does not change); the tensors it needs."""

    need: np.ndarray
    own_max: np.ndarray
    pieces: np.ndarray
    tensors: np.ndarray

    @property
    def total_pieces(self) -> int:
        return int(self.pieces.sum())


def realloc_floor(spec: ModelSpec, *, head: Head, src: Layout, dst: Layout) -> ReallocFloor:
    """The position-free parts of reallocating `spec` from layout `src` to `dst` (cached; pass
    `plans.sharding.slicing` layouts so that layouts holding the same slices share one entry)."""
    return _realloc_floor(spec, head, src, dst)


@lru_cache(maxsize=4096)
def _one_stage(lay: Layout) -> Layout:
    """One pipeline stage of `lay`: every stage cuts a tensor it holds into the same slices."""
    return lay if lay.pp == 1 else lay.model_copy(update={"pp": 1, "interleave": 1})


@lru_cache(maxsize=256)
def _tensor_kinds(spec: ModelSpec, head: Head) -> tuple[tuple[tuple, str, bool, int], ...]:
    """(kind, where, of a sparse layer, tensors) of the model's parameters: a kind is (shape,
    tp_dim, expert_dim), counted per decoder layer of that sparsity, or per model elsewhere."""
    reps = {spec.is_moe_layer(i): i for i in reversed(range(spec.num_hidden_layers))}
    count: dict[tuple[tuple, str, bool], int] = {}
    for param in parameters(spec, head=head):
        if param.layer is not None and reps.get(spec.is_moe_layer(param.layer)) != param.layer:
            continue
        key = ((param.shape, param.tp_dim, param.expert_dim), param.where,
               param.layer is not None and spec.is_moe_layer(param.layer))
        count[key] = count.get(key, 0) + 1
    return tuple((kind, where, sparse, n) for (kind, where, sparse), n in count.items())


@lru_cache(maxsize=1024)
def _stage_counts(spec: ModelSpec, pp: int, interleave: int) -> tuple[tuple[int, int], ...]:
    """(dense layers, sparse layers) each pipeline stage holds."""
    return tuple((len(ls) - sum(map(spec.is_moe_layer, ls)), sum(map(spec.is_moe_layer, ls)))
                 for ls in stage_layers(spec.num_hidden_layers, pp, interleave))


@lru_cache(maxsize=65536)
def _realloc_floor(spec: ModelSpec, head: Head, src: Layout, dst: Layout) -> ReallocFloor:
    # Stage-major, as the destination's ranks are numbered: every stage's ranks hold its tensors.
    held = _stage_holdings(spec, head, dst.pp, dst.interleave)
    parts = _stage_parts(spec, head, _one_stage(src), _one_stage(dst))
    need, own, pieces, tensors = np.einsum("kp,ckr->cpr", held, parts).reshape(4, -1)
    return ReallocFloor(need, own, pieces, tensors)


@lru_cache(maxsize=1024)
def _stage_holdings(spec: ModelSpec, head: Head, pp: int, interleave: int) -> np.ndarray:
    """[kind, stage] tensors of each kind (`_tensor_kinds`) each pipeline stage holds."""
    layers = _stage_counts(spec, pp, interleave)
    ends = {"first": (0,), "last": (pp - 1,), "first+last": tuple(sorted({0, pp - 1}))}
    kinds = _tensor_kinds(spec, head)
    held = np.zeros((len(kinds), pp), dtype=np.int64)
    for n_kind, (_kind, where, sparse, n) in enumerate(kinds):
        if where == "layer":
            held[n_kind] = [n * stage[sparse] for stage in layers]
        else:
            held[n_kind, list(ends[where])] = n
    held.flags.writeable = False
    return held


@lru_cache(maxsize=16384)
def _stage_parts(spec: ModelSpec, head: Head, one_src: Layout, one_dst: Layout) -> np.ndarray:
    """[(need, own, pieces, tensors), kind, rank] of one tensor of each kind per rank of one stage
    of `one_dst`, from one stage of `one_src` (both with pp = 1): a pipeline split changes which
    tensors a stage holds, not how a stage cuts them."""
    kinds = _tensor_kinds(spec, head)
    parts = np.zeros((4, len(kinds), one_dst.size), dtype=np.int64)
    for n_kind, (kind, _where, _sparse, _n) in enumerate(kinds):
        shape, tp_dim, expert_dim = kind
        unit = _unit(shape, tp_dim, expert_dim, one_src, one_dst)  # as `_rank_volumes` scales
        times = 1 if unit is None else math.prod(shape) // math.prod(unit)
        parts[:, n_kind] = _kind_floor(kind if unit is None else (unit, tp_dim, expert_dim), one_src, one_dst)
        parts[:2, n_kind] *= times  # elements scale; slices do not
    parts.flags.writeable = False
    return parts


@lru_cache(maxsize=65536)
def _kind_floor(kind: tuple, src: Layout, dst: Layout) -> tuple[np.ndarray, ...]:
    """(need, own_max, pieces, 1) of one tensor of `kind` per rank of one stage of `dst`, from
    one stage of `src` (both with pp = 1)."""
    shape, tp_dim, expert_dim = kind
    out = [np.zeros(dst.size, dtype=np.int64) for _ in range(4)]
    s_holds, s_lo, s_hi = _boxes(shape, tp_dim, (0,), src, src.size, expert_dim)
    d_holds, d_lo, d_hi = _boxes(shape, tp_dim, (0,), dst, dst.size, expert_dim)
    idx, r = np.flatnonzero(s_holds), np.flatnonzero(d_holds)
    if not len(idx) or not len(r):
        return tuple(out)
    cells = np.unique(np.concatenate([s_lo[idx], s_hi[idx]], axis=1), axis=0)
    ndim = s_lo.shape[1]
    c_lo, c_hi = cells[:, :ndim], cells[:, ndim:]
    ov = np.prod(np.clip(np.minimum(d_hi[r][:, None, :], c_hi[None]) - np.maximum(d_lo[r][:, None, :], c_lo[None]),
                         0, None), axis=2)  # [receiver, cell]
    out[0][r] = np.prod(d_hi[r] - d_lo[r], axis=1)
    out[1][r] = ov.max(axis=1)
    out[2][r] = (ov > 0).sum(axis=1)
    out[3][r] = 1
    return tuple(out)
