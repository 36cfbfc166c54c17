"""Layout algebra: which rank holds which slice of every parameter, and what must move.

This is pure Python over the schemas, shared by the cost model (which charges the bytes) and the
runtime (which moves them), so the two can never disagree.

Conventions (the runtime implements exactly these):

- Parameters are named as in HF Llama checkpoints (``model.layers.{i}.self_attn.q_proj.weight``)
  and stored ``[out_features, in_features]``; gpt models use the same names plus biases and
  ``model.embed_positions.weight``.
- Tensor parallel splits column-parallel weights (q/k/v, gate/up, the vocabulary of the embedding
  and LM head) along dim 0 and row-parallel weights (o_proj, down_proj) along dim 1, with numpy
  ``array_split`` bounds (`split_range`); norms, position embeddings and row-parallel biases are
  replicated.
- Pipeline parallel gives each stage a contiguous run of layers (`stage_layers`); stage 0 holds
  the embeddings, the last stage the final norm and the head; a tied LM head is held by both.
  Interleaving with ``v`` virtual stages cuts the layers into ``pp * v`` chunks, chunk ``k`` on
  stage ``k % pp``.
- ZeRO-3 further splits each rank's tensor-parallel shard along its dim 0 across the
  data-parallel group (`split_range` again); ZeRO 0-2 keep full parameters on every dp rank.
  Context-parallel ranks hold replicas.
- Routed experts of a sparse layer are stacked in one tensor per projection, experts first
  (``mlp.experts.gate_proj.weight`` is ``[E, f, h]``, ``down_proj`` ``[E, h, f]``). Expert
  parallel splits dim 0 over the stage's `Layout.ep` ranks (`Layout.expert_coord`), expert tensor
  parallel (`Layout.etp` = tp) splits f as the dense MLP does, and ZeRO-3 splits dim 1 of the
  rank's expert block over the experts' data-parallel group (`Layout.edp`). The router
  (``mlp.gate.weight``, ``[E, h]``) and the shared expert are dense tensors.
- A generate call's prefilled KV cache, when it moves to a decode layout of its own, is named per
  layer (``kv.{i}.k`` / ``.v``, ``[rows, kv_heads, positions, d_head]``, `kv_box`): a rank holds
  its replica's rows, its tensor-parallel rank's key/value heads and its stage's layers; cp ranks
  of a prefill hold the whole positions, those of a KV-parallel decode a contiguous share.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

from plans.layout import Layout, Mesh
from plans.model import Head, ModelSpec

Box = tuple[tuple[int, int], ...]  # per tensor dim: [start, stop)


@dataclass(frozen=True)
class Param:
    """One parameter tensor of the model."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # dim split by tensor parallel; None when replicated
    layer: int | None  # decoder layer index; None for embeddings, final norm and head
    where: str  # "layer", "first" (embeddings), "last" (final norm, head), "first+last" (tied embedding)
    expert_dim: int | None = None  # routed experts stacked along this dim (split by expert parallel)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def galore_projected(param: Param, rank: int) -> bool:
    """Whether a GaLore optimizer of `rank` (`plans.layout.GaLore`) projects `param`'s gradient:
    the attention and MLP matrices of decoder layers (the weights tensor parallel splits, shared
    experts' included) larger than the rank both ways. Embeddings, the head, norms, biases,
    routers and routed experts keep plain AdamW, as GaLore's reference training does."""
    return (param.layer is not None and len(param.shape) == 2 and param.tp_dim is not None
            and param.expert_dim is None and min(param.shape) > rank)


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Bounds of part `index` when `n` items split into `parts` (numpy array_split: first n % parts get one more)."""
    q, r = divmod(n, parts)
    start = index * q + min(index, r)
    return start, start + q + (1 if index < r else 0)


def _layer_params(spec: ModelSpec, i: int) -> list[Param]:
    h, d, ffn = spec.hidden_size, spec.d_head, spec.ffn_size
    q_out, kv_out = spec.num_attention_heads * d, spec.kv_heads * d
    p = f"model.layers.{i}."
    gpt = spec.model_type == "gpt"

    def P(name: str, shape: tuple[int, ...], tp_dim: int | None) -> Param:
        return Param(p + name, shape, tp_dim, i, "layer")

    out = [P("input_layernorm.weight", (h,), None)]
    if gpt:
        out.append(P("input_layernorm.bias", (h,), None))
    for proj, rows in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
        out.append(P(f"self_attn.{proj}.weight", (rows, h), 0))
        if gpt or spec.attention_bias:
            out.append(P(f"self_attn.{proj}.bias", (rows,), 0))
    if spec.qk_norm == "head":
        out += [P("self_attn.q_norm.weight", (d,), None), P("self_attn.k_norm.weight", (d,), None)]
    elif spec.qk_norm == "proj":
        out += [P("self_attn.q_norm.weight", (q_out,), 0), P("self_attn.k_norm.weight", (kv_out,), 0)]
    out.append(P("self_attn.o_proj.weight", (h, q_out), 1))
    if gpt:
        out.append(P("self_attn.o_proj.bias", (h,), None))
    out.append(P("post_attention_layernorm.weight", (h,), None))
    if spec.is_moe_layer(i):
        e, fe, fs = spec.experts, spec.expert_ffn, spec.shared_expert_intermediate_size
        out += [
            P("mlp.gate.weight", (e, h), None),
            Param(p + "mlp.experts.gate_proj.weight", (e, fe, h), 1, i, "layer", 0),
            Param(p + "mlp.experts.up_proj.weight", (e, fe, h), 1, i, "layer", 0),
            Param(p + "mlp.experts.down_proj.weight", (e, h, fe), 2, i, "layer", 0),
        ]
        if fs:
            out += [
                P("mlp.shared_expert.gate_proj.weight", (fs, h), 0),
                P("mlp.shared_expert.up_proj.weight", (fs, h), 0),
                P("mlp.shared_expert.down_proj.weight", (h, fs), 1),
            ]
            if spec.shared_expert_gate:
                out.append(P("mlp.shared_expert_gate.weight", (1, h), None))
    elif gpt:
        out += [
            P("post_attention_layernorm.bias", (h,), None),
            P("mlp.up_proj.weight", (ffn, h), 0),
            P("mlp.up_proj.bias", (ffn,), 0),
            P("mlp.down_proj.weight", (h, ffn), 1),
            P("mlp.down_proj.bias", (h,), None),
        ]
    else:
        out += [
            P("mlp.gate_proj.weight", (ffn, h), 0),
            P("mlp.up_proj.weight", (ffn, h), 0),
            P("mlp.down_proj.weight", (h, ffn), 1),
        ]
    return out


@lru_cache(maxsize=256)
def _parameters(spec: ModelSpec, head: Head) -> tuple[Param, ...]:
    h, gpt = spec.hidden_size, spec.model_type == "gpt"
    tied_lm = spec.tied and head == "lm"
    out = [Param("model.embed_tokens.weight", (spec.vocab_size, h), 0, None, "first+last" if tied_lm else "first")]
    if gpt:
        out.append(Param("model.embed_positions.weight", (spec.max_position_embeddings, h), None, None, "first"))
    for i in range(spec.num_hidden_layers):
        out += _layer_params(spec, i)
    out.append(Param("model.norm.weight", (h,), None, None, "last"))
    if gpt:
        out.append(Param("model.norm.bias", (h,), None, None, "last"))
    if head == "value":
        out.append(Param("score.weight", (1, h), None, None, "last"))
    elif not spec.tied:
        out.append(Param("lm_head.weight", (spec.vocab_size, h), 0, None, "last"))
    return tuple(out)


def parameters(spec: ModelSpec, *, head: Head = "lm") -> tuple[Param, ...]:
    """The parameter catalog of a model with the given head, in checkpoint order."""
    return _parameters(spec, head)


def stage_layers(num_layers: int, pp: int, interleave: int = 1) -> list[list[int]]:
    """Layer indices per pipeline stage.

    Layers are cut into ``pp * interleave`` contiguous chunks whose sizes differ by at most one
    (chunks 1.. get the extra layers, sparing chunk 0, which also holds the embeddings); chunk
    ``k`` runs on stage ``k % pp``.
    """
    chunks = pp * interleave
    if num_layers < chunks:
        raise ValueError(f"{num_layers} layers cannot fill {chunks} pipeline chunks")
    base, extra = divmod(num_layers, chunks)
    sizes = [base + (1 if 1 <= k <= extra else 0) for k in range(chunks)]
    stages: list[list[int]] = [[] for _ in range(pp)]
    start = 0
    for k, size in enumerate(sizes):
        stages[k % pp].extend(range(start, start + size))
        start += size
    return stages


@lru_cache(maxsize=4096)
def _stage_of_layer(num_layers: int, pp: int, interleave: int) -> tuple[int, ...]:
    owner = [0] * num_layers
    for s, layers in enumerate(stage_layers(num_layers, pp, interleave)):
        for i in layers:
            owner[i] = s
    return tuple(owner)


def param_stages(param: Param, spec: ModelSpec, layout: Layout) -> tuple[int, ...]:
    """Pipeline stages that hold `param` under `layout`."""
    last = layout.pp - 1
    if param.where == "layer":
        assert param.layer is not None
        return (_stage_of_layer(spec.num_hidden_layers, layout.pp, layout.interleave)[param.layer],)
    return {"first": (0,), "last": (last,), "first+last": tuple(sorted({0, last}))}[param.where]


def layout_problems(spec: ModelSpec, layout: Layout) -> list[str]:
    """Why `layout` cannot shard `spec` (empty when it can)."""
    problems = []
    tp = layout.tp
    if spec.num_attention_heads % tp:
        problems.append(f"tp={tp} does not divide num_attention_heads={spec.num_attention_heads}")
    if spec.kv_heads % tp:
        problems.append(f"tp={tp} does not divide num_key_value_heads={spec.kv_heads}")
    if spec.moe_layers < spec.num_hidden_layers and spec.ffn_size % tp:
        problems.append(f"tp={tp} does not divide intermediate_size={spec.ffn_size}")
    if spec.is_moe:
        if spec.experts % layout.ep:
            problems.append(f"ep={layout.ep} does not divide num_experts={spec.experts}")
        if spec.expert_ffn % layout.etp:
            problems.append(f"etp={layout.etp} does not divide moe_intermediate_size={spec.expert_ffn}")
        if spec.shared_expert_intermediate_size % tp:
            problems.append(f"tp={tp} does not divide shared_expert_intermediate_size="
                            f"{spec.shared_expert_intermediate_size}")
    elif layout.ep > 1 or layout.etp > 1:
        problems.append(f"ep={layout.ep}, etp={layout.etp}: expert parallelism needs a mixture-of-experts model")
    if spec.vocab_size < tp:
        problems.append(f"tp={tp} exceeds vocab_size={spec.vocab_size}")
    chunks = layout.pp * layout.interleave
    if spec.num_hidden_layers < chunks:
        problems.append(f"pp*interleave={chunks} exceeds num_hidden_layers={spec.num_hidden_layers}")
    return problems


@lru_cache(maxsize=65536)
def slicing(layout: Layout) -> Layout:
    """The layout that holds the same slices as `layout` on any mesh of its size, with nothing
    else: its tensor, pipeline and expert degrees, and data-parallel ones only as ZeRO-3 splits
    over them (`shard_box` reads no other field; ZeRO 0-2 and context-parallel ranks hold
    replicas). Whatever depends only on where slices sit (a reallocation's cost) is a function
    of this."""
    z3 = layout.zero == 3
    canon = Layout(dp=layout.dp if z3 else layout.dp * layout.cp, cp=layout.cp if z3 else 1, tp=layout.tp, pp=layout.pp,
                   interleave=layout.interleave, zero=3 if z3 else 0, ep=layout.ep, etp=layout.etp)
    return layout if canon == layout else canon


def slices_key(mesh: Mesh, layout: Layout) -> tuple[int, ...]:
    """Placements with equal keys hold every parameter slice on the same ranks (`slicing`), so
    moving a model between them moves nothing."""
    s = slicing(layout)
    return (mesh.first, mesh.size, s.tp, s.pp, s.interleave, s.dp if s.zero == 3 else 0, s.ep, s.etp)


def distinct_slices(layout: Layout) -> int:
    """Distinct slices `layout` cuts a dense parameter into (the ranks of a mesh holding different
    boxes: tensor and pipeline ranks, and data-parallel ones under ZeRO-3); what the exact transfer
    plan compares each destination rank with."""
    return layout.tp * layout.pp * layout.interleave * (layout.dp if layout.zero == 3 else 1)


def shard_box(param: Param, spec: ModelSpec, layout: Layout, local: int) -> Box | None:
    """The slice of `param` the `local`-th rank of a mesh holds under `layout`, or None."""
    c = layout.coord(local)
    if c.pp not in param_stages(param, spec, layout):
        return None
    box = [(0, n) for n in param.shape]
    if param.expert_dim is not None:
        ep_rank, etp_rank, edp_rank = layout.expert_coord(local)
        box[param.expert_dim] = split_range(param.shape[param.expert_dim], layout.ep, ep_rank)
        if param.tp_dim is not None and layout.etp > 1:
            box[param.tp_dim] = split_range(param.shape[param.tp_dim], layout.etp, etp_rank)
        if layout.zero == 3:
            lo, hi = box[1]
            a, b = split_range(hi - lo, layout.edp, edp_rank)
            box[1] = (lo + a, lo + b)
        return tuple(box)
    if param.tp_dim is not None and layout.tp > 1:
        box[param.tp_dim] = split_range(param.shape[param.tp_dim], layout.tp, c.tp)
    if layout.zero == 3:
        lo, hi = box[0]
        a, b = split_range(hi - lo, layout.dp, c.dp)
        box[0] = (lo + a, lo + b)
    return tuple(box)


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= max(0, hi - lo)
    return n


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


@dataclass(frozen=True)
class Transfer:
    """One slice of one parameter sent from `src` to `dst` (global ranks); local when equal."""

    param: str
    src: int
    dst: int
    box: Box

    @property
    def numel(self) -> int:
        return box_numel(self.box)


def _pieces(param: Param, spec: ModelSpec, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
            gpus_per_node: int) -> Iterator[tuple[int, int, Box, int]]:
    """(sender, receiver, slice, numel) for every slice of `param` the destination layout needs."""
    (smesh, slay), (dmesh, dlay) = src, dst
    return _route([(rank, shard_box(param, spec, slay, local)) for local, rank in enumerate(smesh.ranks)],
                  [(rank, shard_box(param, spec, dlay, local)) for local, rank in enumerate(dmesh.ranks)],
                  first=dmesh.first, gpus_per_node=gpus_per_node)


def _route(held: list[tuple[int, Box | None]], wanted: list[tuple[int, Box | None]], *, first: int,
           gpus_per_node: int) -> Iterator[tuple[int, int, Box, int]]:
    """(sender, receiver, slice, numel) that give every rank of `wanted` its box of one tensor from
    the ranks of `held` (global rank, box or None), each element sent once per receiver lacking it."""
    cells: dict[Box, list[int]] = defaultdict(list)  # box -> global ranks holding it
    for rank, box in held:
        if box is not None and box_numel(box):
            cells[box].append(rank)
    needs: dict[Box, list[int]] = defaultdict(list)  # box -> global ranks needing it
    for rank, need in wanted:
        if need is not None and box_numel(need):
            needs[need].append(rank)
    holder_sets = {box: set(h) for box, h in cells.items()}
    by_node: dict[Box, dict[int, list[int]]] = {}
    for box, holders in cells.items():
        groups: dict[int, list[int]] = defaultdict(list)
        for h in holders:
            groups[h // gpus_per_node].append(h)
        by_node[box] = groups
    for need, ranks in needs.items():
        # Ranks needing the same box (data-parallel replicas) share its pieces.
        pieces = [(box, piece, box_numel(piece)) for box in cells if (piece := intersect(box, need)) is not None]
        for rank in ranks:
            node = rank // gpus_per_node
            for box, piece, numel in pieces:
                if rank in holder_sets[box]:
                    yield rank, rank, piece, numel
                else:
                    # Stateless choice (so grouped and explicit plans agree, and moving both meshes
                    # by whole nodes changes nothing): prefer holders on the receiver's node, and
                    # spread receivers over replicas by their position in the destination mesh.
                    near = by_node[box].get(node) or cells[box]
                    yield near[(rank - first) % len(near)], rank, piece, numel


def transfer_plan(spec: ModelSpec, *, head: Head, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
                  gpus_per_node: int) -> list[Transfer]:
    """Every slice each destination rank needs and who sends it, parameter by parameter.

    A destination rank that already holds a slice under the source layout copies it locally
    (``src == dst``). Each needed element is sent exactly once to each rank that lacks it, so the
    non-local volume is the minimum any reallocation must move.
    """
    out: list[Transfer] = []
    for param in parameters(spec, head=head):
        out += [Transfer(param.name, s, d, box) for s, d, box, _ in _pieces(param, spec, src, dst, gpus_per_node)]
    return out


def kv_names(spec: ModelSpec) -> list[str]:
    """The KV cache as named tensors: keys and values of each decoder layer, each
    ``[rows, kv_heads, positions, d_head]`` over the whole batch of a generate call."""
    return [f"kv.{i}.{kv}" for i in range(spec.num_hidden_layers) for kv in ("k", "v")]


def kv_box(spec: ModelSpec, layout: Layout, local: int, name: str, *, rows: int, positions: int,
           decode: bool = False) -> Box | None:
    """The part of KV tensor `name` rank `local` holds under `layout` after a prefill of
    `positions` tokens of `rows` sequences: its data-parallel replica's rows (the contiguous split
    of the runtime's generation, one group per replica), its tensor-parallel rank's key/value heads
    (the k/v projections' split), and the layers of its pipeline stage; None when it holds none.
    Context-parallel ranks of a prefill each hold the whole (gathered) cache; with `decode` (a
    KV-parallel decode layout) each holds its contiguous share of the positions."""
    c = layout.coord(local)
    layer = int(name.split(".")[1])
    if c.pp != _stage_of_layer(spec.num_hidden_layers, layout.pp, layout.interleave)[layer]:
        return None
    r0, r1 = split_range(rows, layout.dp, c.dp)
    h0, h1 = split_range(spec.kv_heads, layout.tp, c.tp)
    p0, p1 = split_range(positions, layout.cp, c.cp) if decode else (0, positions)
    return ((r0, r1), (h0, h1), (p0, p1), (0, spec.d_head))


def kv_transfer_plan(spec: ModelSpec, *, rows: int, positions: int, src: tuple[Mesh, Layout],
                     dst: tuple[Mesh, Layout], gpus_per_node: int) -> list[Transfer]:
    """Every slice of the KV cache each rank of `dst` needs after a prefill under `src` (a
    generation that decodes with another layout than it prefills with), and who sends it."""
    out: list[Transfer] = []
    for name in kv_names(spec):
        out += kv_tensor_transfers(spec, name, rows=rows, positions=positions, src=src, dst=dst,
                                   gpus_per_node=gpus_per_node)
    return out


def kv_tensor_transfers(spec: ModelSpec, name: str, *, rows: int, positions: int, src: tuple[Mesh, Layout],
                        dst: tuple[Mesh, Layout], gpus_per_node: int) -> list[Transfer]:
    """`kv_transfer_plan`'s transfers of one KV tensor."""
    (smesh, slay), (dmesh, dlay) = src, dst
    held = [(r, kv_box(spec, slay, i, name, rows=rows, positions=positions)) for i, r in enumerate(smesh.ranks)]
    wanted = [(r, kv_box(spec, dlay, i, name, rows=rows, positions=positions, decode=True))
              for i, r in enumerate(dmesh.ranks)]
    return [Transfer(name, s, d, box) for s, d, box, _ in _route(held, wanted, first=dmesh.first,
                                                                 gpus_per_node=gpus_per_node)]


@dataclass(frozen=True)
class TransferVolume:
    """Elements a reallocation moves, by (src, dst) global rank pair, non-local only."""

    by_pair: dict[tuple[int, int], int]
    local_numel: int

    @property
    def moved_numel(self) -> int:
        return sum(self.by_pair.values())


def transfer_volume(spec: ModelSpec, *, head: Head, src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout],
                    gpus_per_node: int) -> TransferVolume:
    """The totals of `transfer_plan`, computed on one representative layer per stage pair.

    Decoder layers differ only in which stages hold them (and whether their MLP is sparse), so
    layers are grouped by their (source stage, destination stage, sparse) and one layer per group
    is planned and scaled. Equal to
    summing `transfer_plan` (a test checks it) at a fraction of the cost.
    """
    by_pair: dict[tuple[int, int], int] = defaultdict(int)
    local = 0
    params = parameters(spec, head=head)
    groups: dict[tuple[int, int, bool], list[int]] = defaultdict(list)
    s_owner = _stage_of_layer(spec.num_hidden_layers, src[1].pp, src[1].interleave)
    d_owner = _stage_of_layer(spec.num_hidden_layers, dst[1].pp, dst[1].interleave)
    for i in range(spec.num_hidden_layers):  # dense and sparse layers hold different tensors
        groups[(s_owner[i], d_owner[i], spec.is_moe_layer(i))].append(i)
    reps = {layers[0]: len(layers) for layers in groups.values()}
    seen: dict[tuple, tuple[dict[tuple[int, int], int], int]] = {}
    for param in params:
        if param.layer is not None:
            if param.layer not in reps:
                continue
            scale = reps[param.layer]
        else:
            scale = 1
        # Tensors of one shape, split and stages move alike (q/k/v, gate/up): plan one of them.
        kind = (param.shape, param.tp_dim, param.expert_dim, param_stages(param, spec, src[1]), param_stages(param, spec, dst[1]))
        if kind not in seen:
            pairs: dict[tuple[int, int], int] = defaultdict(int)
            kept = 0
            for s, d, _, numel in _pieces(param, spec, src, dst, gpus_per_node):
                if s == d:
                    kept += numel
                else:
                    pairs[(s, d)] += numel
            seen[kind] = (pairs, kept)
        pairs, kept = seen[kind]
        local += kept * scale
        for key, numel in pairs.items():
            by_pair[key] += numel * scale
    return TransferVolume(dict(sorted(by_pair.items())), local)
