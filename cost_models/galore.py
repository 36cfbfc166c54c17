"""What a GaLore optimizer (`plans.layout.GaLore`) keeps and does, per rank of a pipeline stage.

A projected matrix G of m x n (`plans.sharding.galore_projected`; k = min(m, n), l = max(m, n))
keeps Adam's two moments of its rank-r projection (r x l elements each) and the projector
(k x r), in fp32; every step projects the gradient down and the normalised step back up (two
GEMMs of 2rmn FLOPs each); every `update_interval` steps one SVD of the gradient refreshes the
projector. The thin SVD (U, S and V of Golub and Van Loan's R-SVD, "Matrix Computations" 4th ed.,
table 8.6.1) takes about 4lk^2 + 22k^3 FLOPs; its Householder bidiagonalisation (4lk^2 - 4k^3/3)
is half matrix-vector products however it is blocked (Dongarra, Sorensen and Hammarling 1989),
so that half streams the matrix through memory at 2 FLOPs per 4-byte element, the rest runs at
GEMM speed. GaLore 2 reports the exact SVD as the costly part of a 7B model's subspace update.

Under tensor parallelism a rank holds a slice of G (`plans.sharding`: rows of a column-parallel
matrix, columns of a row-parallel one) and projects it with the projector's matching part: where
the slice cuts the long side (the side the projection keeps), the slice's projection is its part
of the whole one, so its moments are 1/tp of them and it keeps the whole projector; where it cuts
the short side (the side the projection sums over), each slice gives a partial sum, all-reduced
over the tensor-parallel group every step (r x l elements), so every rank keeps the whole
moments and only its rows of the projector. The SVD reads the whole gradient: the slices are
all-gathered over the group for it and one rank computes it (`runtime.galore`).

The planner's runtime (`runtime.galore`) gives each matrix one owner in the data-parallel group:
it alone computes the SVD (so the SVDs of a step split over the group) and, under ZeRO-1, keeps
the moments and projector and computes the update; under ZeRO-0 the owner's projector is sent to
every rank, which all keep the moments and update every matrix, as plain data parallelism does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from plans.layout import GaLore
from plans.model import ModelSpec
from plans.sharding import galore_projected, parameters

FP32 = 4


@dataclass(frozen=True)
class GaLoreLayer:
    """One decoder layer's projected matrices at one rank (summed over them)."""

    params: float = 0.0  # elements of the projected matrices (the rank's slices)
    moment: float = 0.0  # elements of one low-rank moment (r x l per matrix, or its slice)
    projector: float = 0.0  # elements of the projectors the rank keeps (k x r per matrix, or its rows)
    project_flops: float = 0.0  # one step's projection down and back up
    svd_gemm_flops: float = 0.0  # one SVD of every matrix: its BLAS-3 part
    svd_stream_bytes: float = 0.0  # ... and the bytes its matrix-vector half streams
    tp_reduce: float = 0.0  # elements of the projections summed over the tensor-parallel group each step
    tp_gather: float = 0.0  # elements of the gradients gathered over the tensor-parallel group for an SVD
    tp_projector: float = 0.0  # elements of the projectors then sent to the group (whole, k x r each)

    def times(self, n: float) -> GaLoreLayer:
        return GaLoreLayer(*(n * getattr(self, f) for f in self.__dataclass_fields__))

    def plus(self, other: GaLoreLayer) -> GaLoreLayer:
        return GaLoreLayer(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


@lru_cache(maxsize=256)
def galore_layer(spec: ModelSpec, rank: int, sparse: bool, tp: int = 1) -> GaLoreLayer:
    """The projected matrices of one dense (or, with `sparse`, one mixture-of-experts) layer, at
    one of `tp` tensor-parallel ranks."""
    layer = next((i for i in range(spec.num_hidden_layers) if spec.is_moe_layer(i) == sparse), None)
    out = GaLoreLayer()
    if layer is None:
        return out
    for p in parameters(spec):
        if p.layer != layer or not galore_projected(p, rank):
            continue
        m, n = p.shape
        k, lng = min(m, n), max(m, n)
        bidiag = 4.0 * lng * k * k - 4.0 * k ** 3 / 3
        svd = 4.0 * lng * k * k + 22.0 * k ** 3
        whole = GaLoreLayer(params=m * n / tp, moment=rank * lng, projector=k * rank, project_flops=4.0 * rank * m * n / tp,
                            svd_gemm_flops=svd - bidiag / 2, svd_stream_bytes=bidiag / 2 * FP32 / 2)
        if tp > 1 and p.tp_dim is not None:
            summed = p.tp_dim == (0 if m <= n else 1)  # the split side is the one the projection sums over
            whole = dataclasses.replace(
                whole, moment=rank * lng / (1 if summed else tp), projector=k * rank / (tp if summed else 1),
                tp_reduce=rank * lng if summed else 0.0, tp_gather=m * n, tp_projector=k * rank)
        out = out.plus(whole)
    return out


def galore_stage(spec: ModelSpec, galore: GaLore, dense_layers: int, sparse_layers: int, tp: int = 1) -> GaLoreLayer:
    """The projected matrices of a pipeline stage of `dense_layers` + `sparse_layers` layers, at
    one of `tp` tensor-parallel ranks."""
    return galore_layer(spec, galore.rank, False, tp).times(dense_layers).plus(
        galore_layer(spec, galore.rank, True, tp).times(sparse_layers))


def saved_optimizer_bytes(stage: GaLoreLayer) -> float:
    """Optimizer bytes GaLore saves over AdamW on a stage's projected matrices (before any ZeRO
    sharding): their full-size moments, less the low-rank moments and the projectors."""
    return 2 * FP32 * (stage.params - stage.moment) - FP32 * stage.projector
