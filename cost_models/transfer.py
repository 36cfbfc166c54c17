"""Per-rank volumes of a parameter reallocation, vectorised.

The same transfer plan as `plans.sharding.transfer_plan` (same slices, same stateless choice of
sender), reduced to what a time model needs: elements each rank sends and receives over NVLink
(same node) and over the network, and the elements kept locally. numpy makes it cheap enough for
the search to cost every (source, destination) candidate pair; a test checks it against the
pure-Python plan element for element.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from plans.layout import Layout, Mesh
from plans.model import Head, ModelSpec
from plans.sharding import Param, _stage_of_layer, param_stages, parameters


@dataclass(frozen=True)
class RankVolumes:
    """Elements moved per global rank (arrays indexed by rank - `first`)."""

    first: int
    send_intra: np.ndarray
    send_inter: np.ndarray
    recv_intra: np.ndarray
    recv_inter: np.ndarray
    local_numel: int

    @property
    def moved_numel(self) -> int:
        return int(self.recv_intra.sum() + self.recv_inter.sum())


def _splits(n: int, parts: int) -> np.ndarray:
    """array_split bounds: starts of each part plus n (length parts + 1)."""
    q, r = divmod(n, parts)
    idx = np.arange(parts + 1)
    return idx * q + np.minimum(idx, r)


def _boxes(param: Param, spec: ModelSpec, lay: Layout, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(holds[local], lo[local, dim], hi[local, dim]) of every rank of a mesh (see `shard_box`)."""
    local = np.arange(size)
    tp = local % lay.tp
    dp = (local // (lay.tp * lay.cp)) % lay.dp
    pp = local // (lay.tp * lay.cp * lay.dp)
    holds = np.isin(pp, param_stages(param, spec, lay))
    ndim = len(param.shape)
    lo = np.zeros((size, ndim), dtype=np.int64)
    hi = np.tile(np.array(param.shape, dtype=np.int64), (size, 1))
    if param.tp_dim is not None and lay.tp > 1:
        b = _splits(param.shape[param.tp_dim], lay.tp)
        lo[:, param.tp_dim], hi[:, param.tp_dim] = b[tp], b[tp + 1]
    if lay.zero == 3:
        span = hi[:, 0] - lo[:, 0]
        q, r = np.divmod(span, lay.dp)
        start = dp * q + np.minimum(dp, r)
        stop = start + q + (dp < r)
        lo[:, 0], hi[:, 0] = lo[:, 0] + start, lo[:, 0] + stop
    holds &= np.prod(hi - lo, axis=1) > 0
    return holds, lo, hi


PAIR_CHUNK = 1 << 22  # (receiver, cell) pairs evaluated at once: bounds memory on very large meshes


def _param_volumes(param: Param, spec: ModelSpec, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout], gpn: int,
                   first: int, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    (smesh, slay), (dmesh, dlay) = src, dst
    s_holds, s_lo, s_hi = _boxes(param, spec, slay, smesh.size)
    d_needs, d_lo, d_hi = _boxes(param, spec, dlay, dmesh.size)
    zeros = [np.zeros(span, dtype=np.int64) for _ in range(4)]
    if not s_holds.any() or not d_needs.any():
        return (*zeros, 0)
    # Cells: distinct source boxes, each with its holders (global ranks, ascending).
    s_idx = np.flatnonzero(s_holds)
    s_box = np.concatenate([s_lo[s_idx], s_hi[s_idx]], axis=1)
    cells, cell_of = np.unique(s_box, axis=0, return_inverse=True)
    cell_of = cell_of.reshape(-1)
    holder_rank = smesh.first + s_idx
    ndim = s_lo.shape[1]
    c_lo, c_hi = cells[:, :ndim], cells[:, ndim:]
    src_cell = np.full(span, -1)
    src_cell[holder_rank - first] = cell_of
    # Sender tables: holders grouped by (cell, node), and by cell alone.
    node_h = holder_rank // gpn
    order = np.lexsort((holder_rank, node_h, cell_of))  # holders grouped by (cell, node), ascending
    stride = span // gpn + 2 + first // gpn
    key_h = cell_of[order] * stride + node_h[order]
    uniq, start_idx, counts = np.unique(key_h, return_index=True, return_counts=True)
    by_cell = np.argsort(cell_of, kind="stable")
    cell_start = np.searchsorted(cell_of[by_cell], np.arange(len(cells)))
    cell_count = np.bincount(cell_of, minlength=len(cells))
    send_intra, send_inter, recv_intra, recv_inter = zeros
    kept = 0
    # Receivers: every destination rank that needs a non-empty box, a chunk at a time (the
    # receiver x cell overlap table of a large mesh would not fit in memory at once).
    d_all = np.flatnonzero(d_needs)
    rows = max(1, PAIR_CHUNK // len(cells))
    for at in range(0, len(d_all), rows):
        d_idx = d_all[at:at + rows]
        recv_rank = dmesh.first + d_idx
        ov = np.prod(np.clip(np.minimum(d_hi[d_idx, None, :], c_hi[None]) - np.maximum(d_lo[d_idx, None, :], c_lo[None]),
                             0, None), axis=2)  # [receiver, cell] overlapping elements
        rj, cj = np.nonzero(ov)
        vol = ov[rj, cj]
        r = recv_rank[rj]
        # Local when the receiver itself holds the cell.
        is_local = src_cell[r - first] == cj
        # Sender: a holder of the cell on the receiver's node if any, else any holder; the k-th
        # such holder with k = receiver's position in the destination mesh mod their count.
        key_r = cj * stride + r // gpn
        pos = np.searchsorted(uniq, key_r)
        pos = np.minimum(pos, len(uniq) - 1)
        has_near = uniq[pos] == key_r
        kth = r - dmesh.first
        near_sender = holder_rank[order][start_idx[pos] + kth % np.where(has_near, counts[pos], 1)]
        any_sender = holder_rank[by_cell][cell_start[cj] + kth % cell_count[cj]]
        sender = np.where(has_near, near_sender, any_sender)
        moved = ~is_local
        intra = (sender // gpn == r // gpn) & moved
        inter = moved & ~intra
        np.add.at(send_intra, sender[intra] - first, vol[intra])
        np.add.at(send_inter, sender[inter] - first, vol[inter])
        np.add.at(recv_intra, r[intra] - first, vol[intra])
        np.add.at(recv_inter, r[inter] - first, vol[inter])
        kept += int(vol[is_local].sum())
    return send_intra, send_inter, recv_intra, recv_inter, kept


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
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(spec.num_hidden_layers):
        groups.setdefault((s_owner[i], d_owner[i]), []).append(i)
    reps = {layers[0]: len(layers) for layers in groups.values()}
    totals = [np.zeros(span, dtype=np.int64) for _ in range(4)]
    local = 0
    seen: dict[tuple, tuple] = {}
    for param in parameters(spec, head=head):
        if param.layer is not None and param.layer not in reps:
            continue
        scale = reps[param.layer] if param.layer is not None else 1
        kind = (param.shape, param.tp_dim, param_stages(param, spec, src[1]), param_stages(param, spec, dst[1]))
        if kind not in seen:
            seen[kind] = _param_volumes(param, spec, src, dst, gpn, first, span)
        *arrays, kept = seen[kind]
        for t, a in zip(totals, arrays):
            t += a * scale
        local += kept * scale
    return RankVolumes(first, *totals, local)
