"""Hybrid-parallel layouts and device meshes.

A `Layout` gives the parallel degrees of one call; a `Mesh` the global ranks it runs on. Ranks of
a mesh map to layout coordinates in one fixed order, tensor parallel fastest (so a tensor-parallel
group is adjacent ranks, inside a node) and pipeline parallel slowest (Megatron-LM's
``tp-cp-dp-pp`` order)::

    local = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field, model_validator

from plans.base import Strict

Recompute = Literal["none", "selective", "full"]
# Where a home call's states wait between calls (`Layout.offload`).
Offload = Literal["none", "optimizer", "weights"]


class GaLore(Strict):
    """A train call's low-rank optimizer (Zhao et al. 2024, GaLore; Su et al. 2025, GaLore 2):
    each decoder layer's attention and MLP matrix G (m x n) keeps Adam's moments for its rank-r
    projection only, P^T G (m <= n, P the top r left singular vectors of G) or G Q (m > n, Q the
    right ones), with P refreshed by an SVD of the gradient every `update_interval` steps; the
    update is ``-lr * scale * P N`` for Adam's normalised step N. Every other parameter keeps
    plain AdamW. See `plans.sharding.galore_projected` for which matrices."""

    rank: int = Field(ge=1, description="Rank r of the gradient projection.")
    update_interval: int = Field(200, ge=1, description="Optimizer steps between SVDs of the gradient (the projector refresh).")
    scale: float = Field(0.25, gt=0, description="alpha: the projected-back update is scaled by this.")

    def short(self) -> str:
        default = type(self).model_fields["update_interval"].default
        return f"galore:r{self.rank}" + (f"/{self.update_interval}" if self.update_interval != default else "")


class Coord(NamedTuple):
    """Where one rank of a mesh sits in the layout grid."""

    pp: int
    dp: int
    cp: int
    tp: int


class Layout(Strict):
    """Parallel degrees and memory-saving options of one call."""

    dp: int = Field(1, ge=1, description="Data-parallel degree.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (inside a node).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel stages.")
    cp: int = Field(1, ge=1, description="Context-parallel degree (sequence split across ranks for attention).")
    zero: int = Field(0, ge=0, le=3, description="ZeRO stage over the data-parallel group: 0 none, 1 optimizer, 2 +gradients, 3 +parameters.")
    micro_batches: int = Field(1, ge=1, description="Micro-batches per data-parallel rank per optimizer step (pipeline fill, gradient accumulation).")
    recompute: Recompute = Field("none", description="Activation recomputation: none, selective (attention core), full (whole layer).")
    sequence_parallel: bool = Field(False, description="Shard LayerNorm/dropout activations along the sequence across the tensor-parallel group.")
    interleave: int = Field(1, ge=1, description="Virtual pipeline stages per rank (interleaved 1F1B); 1 means plain 1F1B.")
    ep: int = Field(1, ge=1, description="Expert-parallel degree (mixture-of-experts models): each stage's routed "
                    "experts split over ep ranks; tokens reach their experts by all-to-all.")
    etp: int = Field(1, ge=1, description="Expert tensor-parallel degree: 1 (each expert whole on its rank) or tp "
                     "(every expert split like the dense MLP).")
    # Left out of a plan's JSON when "none", so plans without offload keep their bytes.
    offload: Offload = Field("none", exclude_if=lambda v: v == "none", description=(
        "What the model's home call keeps in host memory between calls: none; optimizer (a train call's "
        "optimizer states, copied to the GPU for the call and back after it, as DeepSpeed's offload_optimizer "
        "and verl's optimizer_offload keep them); weights (a frozen model's only call: its weights are "
        "copied in before the call and dropped after it, as OpenRLHF's --ref.offload)."))
    # Left out of a plan's JSON when None (plain AdamW), so plans without it keep their bytes.
    galore: GaLore | None = Field(None, exclude_if=lambda v: v is None, description=(
        "A train call's GaLore optimizer (low-rank projected Adam states), or None for AdamW. Needs ZeRO 0 "
        "or 1: each matrix's projection reads its whole gradient (a tensor-parallel slice projects its own "
        "part, summed over the tensor-parallel group where the projection runs along the split)."))

    @model_validator(mode="after")
    def check_sequence_parallel_needs_tp(self) -> Layout:
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        return self

    @model_validator(mode="after")
    def check_zero_needs_dp(self) -> Layout:
        if self.zero and self.dp * self.cp == 1:  # context-parallel ranks share the states too
            raise ValueError("a ZeRO stage needs dp > 1 or cp > 1 (there is nothing to shard over)")
        return self

    @model_validator(mode="after")
    def check_galore_whole_gradients(self) -> Layout:
        if self.galore is not None and self.zero > 1:
            raise ValueError(f"galore needs zero 0 or 1 (got zero={self.zero}): the projection of a matrix reads its "
                             "whole gradient (summed over the data-parallel group) on the ranks that hold the matrix")
        return self

    @model_validator(mode="after")
    def check_interleave_needs_pp(self) -> Layout:
        if self.interleave > 1 and self.pp == 1:
            raise ValueError("interleave > 1 needs pp > 1")
        return self

    @model_validator(mode="after")
    def check_experts_fit_stage(self) -> Layout:
        if self.etp not in (1, self.tp):
            raise ValueError(f"etp={self.etp} must be 1 or tp={self.tp}")
        stage = self.tp * self.cp * self.dp
        if stage % (self.ep * self.etp):
            raise ValueError(f"ep*etp={self.ep * self.etp} does not divide the {stage} ranks of a pipeline stage "
                             "(tp*cp*dp)")
        return self

    @property
    def edp(self) -> int:
        """Ranks of a stage holding the same expert slices (the experts' data-parallel group)."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def expert_coord(self, local: int) -> tuple[int, int, int]:
        """(ep rank, etp rank, edp rank) of the `local`-th rank: within its pipeline stage, expert
        tensor parallel fastest, then expert parallel (Megatron-core's expert rank order)."""
        i = local % (self.tp * self.cp * self.dp)
        return (i // self.etp) % self.ep, i % self.etp, i // (self.etp * self.ep)

    @property
    def on_device(self) -> Layout:
        """This layout with every state kept on the GPU: how it splits parameters and work,
        which offload does not change (a reallocation or a twin sees this)."""
        return self if self.offload == "none" else self.model_copy(update={"offload": "none"})

    @property
    def size(self) -> int:
        """Ranks the layout occupies: dp * tp * pp * cp."""
        return self.dp * self.tp * self.pp * self.cp

    def coord(self, local: int) -> Coord:
        """Layout coordinates of the `local`-th rank of the mesh."""
        tp_rank = local % self.tp
        cp_rank = (local // self.tp) % self.cp
        dp_rank = (local // (self.tp * self.cp)) % self.dp
        pp_rank = local // (self.tp * self.cp * self.dp)
        return Coord(pp_rank, dp_rank, cp_rank, tp_rank)

    def local_rank(self, c: Coord) -> int:
        return ((c.pp * self.dp + c.dp) * self.cp + c.cp) * self.tp + c.tp

    def short(self) -> str:
        """Compact text, e.g. ``dp2 tp4 pp2 z1 mb8 rc:sel sp``."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.interleave > 1:
            parts.append(f"v{self.interleave}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        if self.zero:
            parts.append(f"z{self.zero}")
        if self.micro_batches > 1:
            parts.append(f"mb{self.micro_batches}")
        if self.recompute != "none":
            parts.append("rc:" + {"selective": "sel", "full": "full"}[self.recompute])
        if self.sequence_parallel:
            parts.append("sp")
        if self.offload != "none":
            parts.append("off:" + {"optimizer": "opt", "weights": "w"}[self.offload])
        if self.galore is not None:
            parts.append(self.galore.short())
        return " ".join(parts)


class Mesh(Strict):
    """The global ranks a call runs on: a contiguous, aligned block of the cluster."""

    ranks: tuple[int, ...] = Field(min_length=1, description="Global ranks, ascending and contiguous.")

    @model_validator(mode="after")
    def check_contiguous(self) -> Mesh:
        first = self.ranks[0]
        if first < 0 or self.ranks != tuple(range(first, first + len(self.ranks))):
            raise ValueError("mesh ranks must be ascending, contiguous and non-negative")
        return self

    @classmethod
    def block(cls, first: int, size: int) -> Mesh:
        return cls(ranks=tuple(range(first, first + size)))

    @property
    def first(self) -> int:
        return self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def alignment_error(self, gpus_per_node: int) -> str | None:
        """Why this mesh is not an aligned block for nodes of `gpus_per_node`, or None if it is.

        Aligned blocks are a divisor of the node size starting at a multiple of their size, or
        whole nodes starting at a node boundary.
        """
        n, first = self.size, self.first
        if n <= gpus_per_node:
            if gpus_per_node % n or first % n:
                return f"a block of {n} GPUs must divide the node ({gpus_per_node}) and start at a multiple of {n}"
            return None
        if n % gpus_per_node or first % gpus_per_node:
            return f"a block of {n} GPUs must be whole nodes of {gpus_per_node} starting at a node boundary"
        return None

    def short(self) -> str:
        return f"[{self.first}]" if self.size == 1 else f"[{self.first}-{self.ranks[-1]}]"
