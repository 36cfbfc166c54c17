"""The decoder both families share, written over one rank's parameter shard.

Parameters live in a flat dict keyed by their Hugging Face names (`plans.sharding.parameters`),
each holding the slice `plans.sharding.shard_box` gives the rank, so a checkpoint, a layout and
(next) a reallocation all speak the same names and boxes. The forward pass is a handful of plain
functions a reader can follow top to bottom:

    tokens [b, s] -> embed -> layers of this pipeline stage -> final norm -> LM head or value head

- llama: RMSNorm (fp32 statistics, as HF), rotary positions (HF's rotate-half convention),
  grouped-query attention, SwiGLU MLP, optional q/k/v bias; matches transformers'
  `LlamaForCausalLM` on the same weights (tests/test_runtime_model.py).
- gpt: LayerNorm with bias, learned positions, multi-head attention and MLP with biases, GELU with
  the tanh approximation (GPT-2's ``gelu_new``), LM head tied to the embedding by default.
- value head: ``score.weight`` [1, h], one scalar per position (HF's sequence-classification
  head with one label).

Tensor-parallel collectives come from `runtime.tensor_parallel`; under ZeRO-3 a shard's
`gather` turns dp-split parameters into whole tensor-parallel slices for the duration of a use.
With one rank everything reduces to the plain single-process model: that is the reference.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from plans.errors import PlannerError
from plans.layout import Layout
from plans.model import Head, ModelSpec, spec_from_hf_config
from plans.sharding import Box, Param, parameters, shard_box
from runtime import tensor_parallel as tpx
from runtime.context_parallel import ContextParallel, gather_kv, gather_positions
from runtime.recompute import Recompute, checkpointed
from runtime.tensor_parallel import TensorParallel

INIT_STD = 0.02  # GPT-2 / Llama initializer_range
LOGITS_CHUNK_ELEMENTS = 2**26  # log-probs: logits (tokens x vocabulary rows) made at once, forward and backward
ATTN_BLOCK_ELEMENTS = 2**24  # context parallel: attention scores (queries x keys x heads x rows) made at once


@dataclass
class KVCache:
    """Keys and values of every layer of a stage: layer -> ([b, kv/tp, max_len, d], same)."""

    kv: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    length: int = 0  # positions already cached
    # Static shapes (decode steps captured as CUDA graphs): a step writes its slot given by the
    # `positions` tensor and attends over the whole buffer, masked to the slots before it, so
    # no shape or Python value changes from one step to the next.
    static: bool = False
    # KV-parallel decode (`kv_parallel_core`): this rank holds a share of each sequence's positions,
    # `held[j]` the slot of local entry j (-1: unused), `local` entries filled; the token of the
    # step goes to the rank `slot % cp` (`pending` on it).
    held: Tensor | None = None
    local: int = 0
    pending: bool = False

    def begin(self, cp_rank: int, cp_size: int) -> None:
        """A KV-parallel step at slot `length`: whether this rank keeps its keys and values."""
        self.pending = self.length % cp_size == cp_rank
        if self.pending:
            assert self.held is not None
            self.held[self.local] = self.length

    def end(self) -> None:
        if self.pending:
            self.local += 1
        self.pending = False


@dataclass(frozen=True)
class ExpertParallel:
    """A rank's expert-parallel group: the ranks holding the other experts of its pipeline stage
    (same tensor-parallel rank); `size == 1` holds every expert."""

    group: Any = None
    size: int = 1
    rank: int = 0


@dataclass
class Shard:
    """The part of one model a rank holds, and how it talks to the other ranks.

    `params` maps HF names to this rank's slice (`shard_box`); `gather`, when set (ZeRO-3),
    returns the whole tensor-parallel slices of the named parameters for one use."""

    spec: ModelSpec
    head: Head
    layers: tuple[int, ...]
    first: bool  # holds the embeddings (pipeline stage 0)
    last: bool  # holds the final norm and the head (last pipeline stage)
    params: dict[str, torch.nn.Parameter]
    tp: TensorParallel = field(default_factory=TensorParallel)
    ep: ExpertParallel = field(default_factory=lambda: ExpertParallel())
    cp: ContextParallel = field(default_factory=ContextParallel)
    recompute: Recompute = "none"
    gather: Callable[[list[str]], list[Tensor]] | None = None

    _names: dict[str, list[str]] = field(default_factory=dict, repr=False, init=False)  # prefix -> names (`fetch`)
    _indexed: tuple[int, int] = field(default=(0, -1), repr=False, init=False)  # (id, size) of the dict indexed

    def fetch(self, prefix: str) -> dict[str, Tensor]:
        """Every parameter whose name starts with `prefix`, keyed by the rest of its name."""
        key = (id(self.params), len(self.params))
        if self._indexed != key:  # another dict, or names added or removed: index afresh
            self._names, self._indexed = {}, key
        names = self._names.get(prefix)
        if names is None:
            names = self._names[prefix] = [n for n in self.params if n.startswith(prefix)]
        tensors = self.gather(names) if self.gather is not None else [self.params[n] for n in names]
        return {n[len(prefix):]: t for n, t in zip(names, tensors)}


# Building a shard ------------------------------------------------------------------------


def init_tensor(param: Param, *, seed: int) -> Tensor:
    """Deterministic initial value of a whole parameter: a function of (seed, name) only, so every
    layout (and the reference) starts from the same weights."""
    if param.name.endswith(".bias"):
        return torch.zeros(param.shape)
    if "norm" in param.name.rsplit(".", 2)[-2]:  # RMSNorm / LayerNorm scales
        return torch.ones(param.shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(param.name.encode())) % 2**62)
    return torch.randn(param.shape, generator=gen) * INIT_STD


def build_shard(spec: ModelSpec, *, head: Head, layout: Layout, local: int, layers: tuple[int, ...],
                state: Callable[[Param], Tensor] | None = None, given: Mapping[str, Tensor] | None = None,
                piece: Callable[[Param, Box], Tensor] | None = None, device: torch.device) -> Shard:
    """The slices rank `local` of a mesh holds under `layout`: copied from whole tensors
    `state(param)`, read box by box with `piece(param, box)` (pretrained weights,
    `runtime.weights`), or `given` as they are (this rank's slices, shared, not copied: a call that
    runs on its model's resident parameters, or a reallocated copy)."""
    if sum(x is not None for x in (state, given, piece)) != 1:
        raise ValueError("build_shard takes whole tensors (state), boxes (piece) or this rank's slices (given): one")
    c = layout.coord(local)
    params: dict[str, torch.nn.Parameter] = {}
    for p in parameters(spec, head=head):
        box = shard_box(p, spec, layout, local)
        if box is None:
            continue
        if given is not None:
            t = given[p.name]
            if tuple(t.shape) != tuple(hi - lo for lo, hi in box):
                raise ValueError(f"parameter {p.name}: slice of shape {tuple(t.shape)} does not match its box {box}")
            params[p.name] = t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
            continue
        if piece is not None:
            t = piece(p, box)
            if tuple(t.shape) != tuple(hi - lo for lo, hi in box):
                raise ValueError(f"parameter {p.name}: piece of shape {tuple(t.shape)} does not match its box {box}")
            params[p.name] = torch.nn.Parameter(t.to(device=device, dtype=torch.float32, copy=True).contiguous())
            continue
        assert state is not None
        whole = state(p)
        if tuple(whole.shape) != p.shape:
            raise PlannerError(f"parameter {p.name}: shape {tuple(whole.shape)} does not match the model's {p.shape}")
        part = whole[tuple(slice(lo, hi) for lo, hi in box)]
        # copy: a view would keep the whole tensor alive on every rank
        params[p.name] = torch.nn.Parameter(part.to(device=device, dtype=torch.float32, copy=True).contiguous())
    return Shard(spec=spec, head=head, layers=layers, first=c.pp == 0, last=c.pp == layout.pp - 1, params=params)


# The forward pass ------------------------------------------------------------------------


def _norm(spec: ModelSpec, w: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    """LayerNorm with bias (gpt) or RMSNorm with fp32 statistics (llama) of the weights `{name}weight` (and `{name}bias`) in `w`."""
    if spec.model_type == "gpt":
        return F.layer_norm(x, (x.shape[-1],), w[f"{name}weight"], w[f"{name}bias"], spec.layer_norm_epsilon)
    return _rms(spec, w[f"{name}weight"], x)


def _rms(spec: ModelSpec, weight: Tensor, x: Tensor) -> Tensor:
    """RMSNorm of `x` over its last dim with fp32 statistics, as transformers' RMSNorm."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps)).to(x.dtype)


def _sharded_rms(spec: ModelSpec, weight: Tensor, x: Tensor, tp: TensorParallel) -> Tensor:
    """RMSNorm over a last dim that tensor parallel splits: the sum of squares is added over the
    group (forward and backward), so every rank normalises by the whole projection's statistics."""
    x32 = x.float()
    sq = x32.pow(2).sum(-1, keepdim=True)
    width = x.shape[-1] * tp.size
    if tp.size > 1:
        sq = tpx.enter(tpx.reduce_sum(sq.contiguous(), tp), tp, sp=False)
    return weight * (x32 * torch.rsqrt(sq / width + spec.rms_norm_eps)).to(x.dtype)


def _rope(spec: ModelSpec, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin [s, d] for positions [s], or [b, 1, s, d] for per-row positions [b, s].
    The sin's first half is negated, so ``x * cos + roll(x, d/2) * sin`` is the rotation
    ``x * cos + rotate_half(x) * sin`` of transformers bit for bit (the sign moves from the
    rotated value to the factor; IEEE products are sign-symmetric) with one rotation op instead
    of slice, slice, neg and cat."""
    d = spec.d_head
    inv_freq, scale = rope_frequencies(spec, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [..., s, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    if emb.dim() == 3:
        emb = emb[:, None]  # broadcast over heads
    half = d // 2
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:  # YaRN's attention factor, on both (transformers' attention_scaling)
        cos, sin = cos * scale, sin * scale
    sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.to(dtype), sin.to(dtype)


def rope_frequencies(spec: ModelSpec, device: torch.device) -> tuple[Tensor, float]:
    """The inverse frequencies [d/2] of RoPE and the factor on cos and sin, as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them in fp32 for the spec's `rope_scaling` (the same ops in
    the same order, so the results are bitwise equal): plain, linear, llama3 or YaRN."""
    d, base, r = spec.d_head, spec.rope_theta, spec.rope_scaling
    if r is None or r.rope_type != "yarn":
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if r is None:
        return inv_freq, 1.0
    if r.rope_type == "linear":
        return inv_freq / r.factor, 1.0  # type: ignore[operator]
    original = spec.rope_original_positions
    if r.rope_type == "llama3":
        factor, low, high = r.factor, r.low_freq_factor, r.high_freq_factor
        low_wavelen, high_wavelen = original / low, original / high  # type: ignore[operator]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # type: ignore[operator]
        smooth = (original / wavelen - low) / (high - low)  # type: ignore[operator]
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled  # type: ignore[operator]
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # YaRN (Peng et al. 2023): interpolate the low frequencies, extrapolate the high ones, a linear ramp between.
    factor = r.factor if r.factor is not None else spec.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    scale = r.attention_factor
    if scale is None:
        scale = mscale(factor, r.mscale) / mscale(factor, r.mscale_all_dim) if r.mscale and r.mscale_all_dim \
            else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    lo, hi = correction_dim(r.beta_fast or 32), correction_dim(r.beta_slow or 1)
    if r.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, d, 2).to(device=device, dtype=torch.float) / d)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1).to(device)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(scale)


def row_positions(slots: Tensor, pad: Tensor | None) -> Tensor:
    """Positions of the tokens in `slots` [s] (indices into the padded sequence): [s] when no row
    is padded, else [b, s] counted from each row's first real token (left padding of `pad` [b]
    tokens; a pad slot gets position 0), as transformers derives them from the attention mask."""
    if pad is None:
        return slots
    return (slots[None, :] - pad[:, None]).clamp(min=0)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE of `x` [..., d] with `_rope`'s cos and signed sin."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def _attention_core(q: Tensor, k: Tensor, v: Tensor, causal: bool, mask: Tensor | None = None) -> Tensor:
    """softmax(q k^T / sqrt(d)) v, each key/value head serving its group of query heads in place
    (`enable_gqa`: no repeated copy of K/V); `mask` [sq, sk] (True: attend), when given, replaces
    the causal rule."""
    gqa = q.shape[1] != k.shape[1]
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _attention_mask(q_slots: Tensor, k_len: int, *, window: int | None, pad: Tensor | None,
                    always: bool = False) -> Tensor | None:
    """Which keys each query attends to, or None when plain causal attention says it all (never
    None with `always`: a static cache's keys include slots not yet written).

    Causal (key slot <= query slot); within a sliding window (Mistral, as transformers: query p
    sees p - window < j <= p); and never a left-padding slot of its row (`pad` [b]): [sq, sk], or
    [b, 1, sq, sk] with padding. A padding slot's own query sees only itself, so its (unused)
    output stays finite."""
    windowed = window is not None and (k_len > window or always)
    if not windowed and pad is None and not always:
        return None
    k = torch.arange(k_len, device=q_slots.device)[None, :]
    q = q_slots[:, None]
    mask = k <= q
    if window is not None and windowed:
        mask = mask & (k > q - window)
    if pad is None:
        return mask
    real = k[None] >= pad[:, None, None]  # [b, 1, sk]
    return ((mask[None] & real) | (k == q)[None])[:, None]  # [b, 1, sq, sk]


def _blocked_core(q: Tensor, k: Tensor, v: Tensor, q_slots: Tensor, window: int | None,
                  pad: Tensor | None) -> Tensor:
    """Attention of queries at `q_slots` (a context-parallel rank's, ascending) to every slot's
    keys, under the causal mask of the slots: a block of queries at a time, each over the keys up
    to its last slot, so no more than about ATTN_BLOCK_ELEMENTS scores exist at once (an explicit
    mask makes SDPA materialise them)."""
    b, heads, sq, _ = q.shape
    ends = q_slots.tolist()  # the slots are known on the host: no device sync per block
    outs, a = [], 0
    while a < sq:
        z = a
        while z < sq and b * heads * (z - a + 1) * (ends[z] + 1) <= ATTN_BLOCK_ELEMENTS:
            z += 1
        z = max(z, a + 1)
        kmax = ends[z - 1] + 1
        mask = _attention_mask(q_slots[a:z], kmax, window=window, pad=pad, always=True)
        outs.append(_attention_core(q[:, :, a:z], k[:, :, :kmax], v[:, :, :kmax], False, mask))
        a = z
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def kv_parallel_core(q: Tensor, k: Tensor, v: Tensor, held: Tensor, q_slots: Tensor, window: int | None,
                     pad: Tensor | None, cp: ContextParallel) -> Tensor:
    """One decode query [b, H, 1, d] against this rank's share of the cache (keys and values
    [b, KV, n, d] at slots `held` [n]), combined over the context-parallel group (Mnemosyne's KV
    parallelism): each share's softmax numerator and denominator under the group's maximum score,
    summed. Causal by slot, within the sliding window, never a left-padding slot; fp32 throughout."""
    import torch.distributed as dist

    b, heads, _, d = q.shape
    kv = k.shape[1]
    qf = q.float().reshape(b, kv, heads // kv, d)  # each key/value head serves its group of query heads
    scores = torch.einsum("bkgd,bknd->bkgn", qf, k.float()) / math.sqrt(d)
    slot = q_slots.reshape(-1)[-1]
    valid = held <= slot
    if window is not None:
        valid = valid & (held > slot - window)
    valid = valid[None].expand(b, -1) if pad is None else valid[None] & (held[None] >= pad[:, None])
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    top = scores.amax(-1)  # [b, KV, g]; -inf where this share has no key for a row
    best = top.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=cp.group)
    weights = torch.exp(scores - best[..., None])
    packed = torch.cat([torch.einsum("bkgn,bknd->bkgd", weights, v.float()).reshape(-1), weights.sum(-1).reshape(-1)])
    dist.all_reduce(packed, group=cp.group)
    n_out = b * heads * d
    out = packed[:n_out].view(b, kv, heads // kv, d) / packed[n_out:].view(b, kv, heads // kv, 1)
    return out.reshape(b, heads, 1, d).to(q.dtype)


class Rope:
    """cos/sin of one forward's positions, computed once for all its layers (per dtype)."""

    def __init__(self, spec: ModelSpec, positions: Tensor) -> None:
        self.spec, self.positions = spec, positions
        self._by_dtype: dict[torch.dtype, tuple[Tensor, Tensor]] = {}

    def __call__(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        got = self._by_dtype.get(dtype)
        if got is None:
            got = self._by_dtype[dtype] = _rope(self.spec, self.positions, dtype)
        return got


def _attention(shard: Shard, w: dict[str, Tensor], x: Tensor, positions: Tensor, cache: KVCache | None,
               layer: int, sp: bool, pad: Tensor | None = None, rope: Rope | None = None) -> Tensor:
    spec, d = shard.spec, shard.spec.d_head
    x = tpx.enter(x, shard.tp, sp=sp)  # [b, s, h]
    b, s, _ = x.shape
    q = F.linear(x, w["q_proj.weight"], w.get("q_proj.bias"))
    k = F.linear(x, w["k_proj.weight"], w.get("k_proj.bias"))
    if spec.qk_norm == "proj":  # OLMoE: over the whole projection, which tensor parallel splits
        q, k = _sharded_rms(spec, w["q_norm.weight"], q, shard.tp), _sharded_rms(spec, w["k_norm.weight"], k, shard.tp)
    q = q.view(b, s, -1, d).transpose(1, 2)  # [b, H/tp, s, d]
    k = k.view(b, s, -1, d).transpose(1, 2)  # [b, KV/tp, s, d]
    if spec.qk_norm == "head":  # Qwen3: over each head
        q, k = _rms(spec, w["q_norm.weight"], q), _rms(spec, w["k_norm.weight"], k)
    v = F.linear(x, w["v_proj.weight"], w.get("v_proj.bias")).view(b, s, -1, d).transpose(1, 2)
    if spec.model_type == "llama":
        cos, sin = (rope or Rope(spec, row_positions(positions, pad)))(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    causal, static = True, cache is not None and cache.static
    if cache is not None and cache.held is not None:  # KV-parallel decode: attend to this rank's share
        kc, vc = cache.kv[layer]
        n = cache.local
        if cache.pending:
            kc[:, :, n] = k[:, :, 0]
            vc[:, :, n] = v[:, :, 0]
            n += 1
        core = kv_parallel_core(q, kc[:, :, :n], vc[:, :, :n], cache.held[:n], positions, spec.sliding_window, pad,
                                shard.cp)
        out = tpx.exit(F.linear(core.transpose(1, 2).reshape(b, s, -1), w["o_proj.weight"]), shard.tp, sp=sp)
        return out + w["o_proj.bias"] if "o_proj.bias" in w else out
    split = shard.cp.size > 1  # this rank's queries are some slots of the sequence: all keys, masked by slot
    if split:
        k, v = gather_kv(k, shard.cp), gather_kv(v, shard.cp)
        if cache is not None:  # a prefill: every rank of the group keeps the whole (gathered) cache
            if cache.length or static:
                raise ValueError("under context parallel a KV cache is only filled by a prefill")
            kc, vc = cache.kv[layer]
            kc[:, :, :k.shape[2]] = k
            vc[:, :, :v.shape[2]] = v
    if cache is not None and static:  # the slots by index, then the whole buffer under the mask
        kc, vc = cache.kv[layer]
        kc.index_copy_(2, positions, k)
        vc.index_copy_(2, positions, v)
        k, v, causal = kc, vc, False
    elif cache is not None and not split:
        start = cache.length
        kc, vc = cache.kv[layer]
        kc[:, :, start:start + s] = k
        vc[:, :, start:start + s] = v
        k, v = kc[:, :, :start + s], vc[:, :, :start + s]
        if start > 0:
            if s != 1:
                raise ValueError("a KV cache extends by one position at a time after the prefill")
            causal = False  # one query attends to every cached position
    if split:
        core = checkpointed(_blocked_core, q, k, v, positions, spec.sliding_window, pad,
                            enabled=shard.recompute == "selective")
    else:
        mask = _attention_mask(positions, k.shape[2], window=spec.sliding_window, pad=pad, always=static)
        core = checkpointed(_attention_core, q, k, v, causal, mask, enabled=shard.recompute == "selective")
    out = F.linear(core.transpose(1, 2).reshape(b, s, -1), w["o_proj.weight"])
    out = tpx.exit(out, shard.tp, sp=sp)
    return out + w["o_proj.bias"] if "o_proj.bias" in w else out


def _mlp(shard: Shard, w: dict[str, Tensor], x: Tensor, sp: bool) -> Tensor:
    x = tpx.enter(x, shard.tp, sp=sp)
    if shard.spec.model_type == "gpt":
        hidden = F.gelu(F.linear(x, w["up_proj.weight"], w["up_proj.bias"]), approximate="tanh")
        out = tpx.exit(F.linear(hidden, w["down_proj.weight"]), shard.tp, sp=sp)
        return out + w["down_proj.bias"]
    hidden = F.silu(F.linear(x, w["gate_proj.weight"])) * F.linear(x, w["up_proj.weight"])
    return tpx.exit(F.linear(hidden, w["down_proj.weight"]), shard.tp, sp=sp)


def _sparse_mlp(shard: Shard, w: dict[str, Tensor], x: Tensor, sp: bool) -> Tensor:
    """A mixture-of-experts MLP as transformers computes it (Mixtral, Qwen-MoE, OLMoE): router
    logits, softmax in fp32, the top k experts per token (renormalised where the model says),
    each token's k copies through their experts and summed by their weights, plus a shared
    expert (scaled by a sigmoid gate where the model has one).

    The router runs on the rank's own tokens (its sequence chunk under sequence parallel, else
    the replicated tokens), so its weights' gradients follow the replicated-parameter rules of
    `runtime.tensor_parallel`; routing weights enter the tensor-parallel region like
    activations. Experts are split like the dense MLP (f over tp, partial sums reduced on exit)
    and over the expert-parallel group: token copies go to the rank holding their expert and
    come back by all-to-all (`_expert_exchange`)."""
    spec, tp = shard.spec, shard.tp
    b, s_loc, h = x.shape
    k = spec.num_experts_per_tok
    probs = torch.softmax(F.linear(x, w["gate.weight"]).float(), dim=-1)
    top_w, top_i = torch.topk(probs, k, dim=-1)  # [b, s', k]
    if spec.norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    top_w = tpx.enter(top_w.to(x.dtype), tp, sp=sp)  # [b, s, k]
    if sp and tp.size > 1:
        top_i = tpx.gather_ids(top_i, tp)
    full = tpx.enter(x, tp, sp=sp)  # [b, s, h]
    flat = full.reshape(-1, h)
    out = _experts(shard, w, flat, top_i.reshape(-1, k), top_w.reshape(-1, k))
    if spec.shared_expert_intermediate_size:
        shared = F.linear(F.silu(F.linear(flat, w["shared_expert.gate_proj.weight"])) *
                          F.linear(flat, w["shared_expert.up_proj.weight"]), w["shared_expert.down_proj.weight"])
        if spec.shared_expert_gate:
            gate = tpx.enter(torch.sigmoid(F.linear(x, w["shared_expert_gate.weight"])), tp, sp=sp)
            shared = gate.reshape(-1, 1) * shared
        out = out + shared
    return tpx.exit(out.view(full.shape), tp, sp=sp)


def _experts(shard: Shard, w: dict[str, Tensor], x: Tensor, top_i: Tensor, top_w: Tensor) -> Tensor:
    """The routed experts' sum for tokens `x` [T, h] (tensor-parallel partial sums when experts
    are split over tp): copies [T*k] sorted by expert, exchanged with the ranks holding their
    experts, run expert by expert, exchanged back, weighted and added per token."""
    spec, ep = shard.spec, shard.ep
    t, k = top_i.shape
    local = spec.experts // ep.size
    expert = top_i.reshape(-1)
    order = torch.argsort(expert, stable=True)
    token = order // k  # the token of each sorted copy
    rows = x.index_select(0, token)
    ids = expert.index_select(0, order)
    if ep.size > 1:
        send = torch.bincount(ids // local, minlength=ep.size)
        rows, ids, back = _expert_exchange(rows, ids, send, ep)
        ids = ids - ep.rank * local
    else:
        back = None
    counts = torch.bincount(ids, minlength=local).tolist()
    gate, up, down = w["experts.gate_proj.weight"], w["experts.up_proj.weight"], w["experts.down_proj.weight"]
    # unbind and split, not indexing: their backward stacks (concatenates) the pieces' gradients in
    # one kernel, where indexing adds a zero-filled copy of the whole stacked tensor per expert.
    outs = [F.linear(F.silu(F.linear(r, g)) * F.linear(r, u), d)
            for r, g, u, d, n in zip(rows.split(counts), gate.unbind(0), up.unbind(0), down.unbind(0), counts) if n]
    # With no copies here, the (empty) output still depends on the rows and weights, so backward
    # runs this rank's side of both exchanges, as every rank of the group must.
    y = torch.cat(outs) if outs else rows.new_zeros((0, x.shape[1])) + 0 * (down.sum() + rows.sum())
    if back is not None:
        y = back(y)
    weighted = y * top_w.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add(0, token, weighted.to(x.dtype))


def _expert_exchange(rows: Tensor, ids: Tensor, send: Tensor, ep: ExpertParallel) -> tuple[Tensor, Tensor, Any]:
    """Send each rank of the expert-parallel group the copies for its experts (sorted by
    expert, so by rank) and receive the copies for ours, sorted by expert again; and the
    inverse exchange (a function) that returns each received copy's output to its sender in the
    original order."""
    import torch.distributed as dist

    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    got = tpx.all_to_all(rows, recv_sizes, send_sizes, ep.group)
    got_ids = torch.empty(sum(recv_sizes), dtype=ids.dtype, device=ids.device)
    dist.all_to_all_single(got_ids, ids.contiguous(), recv_sizes, send_sizes, group=ep.group)
    order = torch.argsort(got_ids, stable=True)  # arrivals by sender, each sorted: sort by expert
    unsort = torch.argsort(order)

    def back(y: Tensor) -> Tensor:
        return tpx.all_to_all(y.index_select(0, unsort), send_sizes, recv_sizes, ep.group)

    return got.index_select(0, order), got_ids.index_select(0, order), back


def _layer(shard: Shard, i: int, x: Tensor, positions: Tensor, cache: KVCache | None, sp: bool,
           pad: Tensor | None = None, rope: Rope | None = None) -> Tensor:
    w = shard.fetch(f"model.layers.{i}.")
    attn_w = {k[len("self_attn."):]: t for k, t in w.items() if k.startswith("self_attn.")}
    mlp_w = {k[len("mlp."):]: t for k, t in w.items() if k.startswith("mlp.")}
    x = x + _attention(shard, attn_w, _norm(shard.spec, w, "input_layernorm.", x), positions, cache, i, sp, pad,
                       rope)
    mlp = _sparse_mlp if shard.spec.is_moe_layer(i) else _mlp
    return x + mlp(shard, mlp_w, _norm(shard.spec, w, "post_attention_layernorm.", x), sp)


def _local_positions(positions: Tensor, tp: TensorParallel, sp: bool) -> Tensor:
    """This rank's chunk of positions [s] or [b, s] along the sequence under sequence parallel."""
    if not sp or tp.size == 1:
        return positions
    chunk = positions.shape[-1] // tp.size
    return positions[..., tp.rank * chunk:(tp.rank + 1) * chunk]


def stage_forward(shard: Shard, x: Tensor, *, positions: Tensor, cache: KVCache | None = None,
                  pad: Tensor | None = None) -> Tensor:
    """Run this pipeline stage: tokens [b, s] (first stage) or hidden states [b, s', h] in,
    hidden states [b, s', h] out (s' = s / tp under sequence parallel, else s). `positions` [s]
    are the slots of the padded sequence; `pad` [b], when given, counts each row's left padding
    (its real tokens then compute exactly what they compute unpadded)."""
    sp = shard.tp.sequence_parallel and cache is None  # decoding one position cannot split it
    if sp and positions.shape[0] % shard.tp.size:
        raise ValueError(f"sequence parallel needs a length divisible by tp={shard.tp.size}")
    if shard.first:
        w = shard.fetch("model.embed_")
        x = tpx.vocab_embedding(x, w["tokens.weight"], shard.tp, vocab_size=shard.spec.vocab_size, sp=sp)
        if "positions.weight" in w:
            x = x + F.embedding(_local_positions(row_positions(positions, pad), shard.tp, sp), w["positions.weight"])
    rope = Rope(shard.spec, row_positions(positions, pad)) if shard.spec.model_type == "llama" else None
    for i in shard.layers:
        x = checkpointed(_layer, shard, i, x, positions, cache, sp, pad, rope, enabled=shard.recompute == "full")
    return x


def _final_norm(shard: Shard, h: Tensor) -> Tensor:
    return _norm(shard.spec, shard.fetch("model.norm."), "", h)


def _lm_weight(shard: Shard) -> Tensor:
    """This rank's vocabulary rows of the LM head [V/tp, h] (the embedding's when tied)."""
    (w,) = shard.fetch("model.embed_tokens.weight" if shard.spec.tied else "lm_head.weight").values()
    return w


def _lm_logits(shard: Shard, h: Tensor, sp: bool) -> Tensor:
    """Vocabulary-sharded logits [b, s, V/tp] of every position of last-stage states (generation
    takes the last one; the tests compare them with transformers')."""
    return F.linear(tpx.enter(_final_norm(shard, h), shard.tp, sp=sp), _lm_weight(shard))


def token_logprobs(shard: Shard, h: Tensor, tokens: Tensor) -> Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for t < s-1, fp32 [b, s-1], from last-stage states.

    The head runs fused with the log-probs (`tensor_parallel.head_logprobs`), a chunk of at most
    LOGITS_CHUNK_ELEMENTS logits at a time, forward and backward; the last position predicts
    nothing: its prediction (of itself) is made and dropped after the head, so the hidden states go
    in whole, with no copy of them. Under context parallel `h` holds this rank's slots (`tokens`
    the whole padded rows): each slot's next token is looked up, and the last slot's prediction is
    dropped after the log-probs are gathered over the group."""
    sp, cp = shard.tp.sequence_parallel, shard.cp
    h = tpx.enter(_final_norm(shard, h), shard.tp, sp=sp)  # sequence parallel: gathered here
    s = tokens.shape[1]
    nxt = (cp.slots(s, tokens.device) + 1).clamp(max=s - 1)
    targets = tokens.index_select(1, nxt)
    b, s1, hidden = h.shape
    out = tpx.head_logprobs(h.reshape(b * s1, hidden), _lm_weight(shard), targets.reshape(-1), shard.tp,
                            vocab_size=shard.spec.vocab_size, chunk_elements=LOGITS_CHUNK_ELEMENTS)
    return gather_positions(out.view(b, s1), cp)[:, :-1]


def token_values(shard: Shard, h: Tensor) -> Tensor:
    """Value-head output per position, fp32 [b, s], from last-stage states."""
    sp = shard.tp.sequence_parallel
    (w,) = shard.fetch("score.weight").values()
    values = F.linear(_final_norm(shard, h), w).squeeze(-1).float()  # [b, s'] on this rank's chunk
    return gather_positions(tpx.gather_seq(values.unsqueeze(-1), shard.tp, sp=sp).squeeze(-1), shard.cp)


def last_logits(shard: Shard, h: Tensor) -> Tensor:
    """Vocabulary-sharded fp32 logits of the last position [b, V/tp] (generation: no sequence parallel)."""
    return _lm_logits(shard, h[:, -1:], False)[:, 0].float()


# HF-format checkpoints -------------------------------------------------------------------
# The HF formats themselves (names, GPT-2's fused Conv1D layout, config.json) are `runtime.weights`.


def save_checkpoint(path: str | Path, state: dict[str, Tensor], *, spec: ModelSpec, head: Head) -> None:
    """Write whole tensors as an HF model directory transformers loads (``model.safetensors`` +
    ``config.json``: llama, mistral with a sliding window, or gpt2)."""
    from safetensors.torch import save

    from plans.io import check_output, write_bytes_atomic, write_text_atomic
    from runtime.weights import hf_config, hf_tensors, hf_type_of

    expected = {p.name: p.shape for p in parameters(spec, head=head)}
    missing = sorted(set(expected) - set(state))
    if missing:
        raise PlannerError(f"checkpoint for {spec.display_name()} is missing {len(missing)} tensors, e.g. {missing[0]}")
    path = Path(path)
    for name in ("model.safetensors", "config.json"):
        check_output(path / name)  # both refused before either is written
    whole = {n: state[n].detach().float().contiguous().cpu() for n in expected}
    data = save(hf_tensors(spec, whole, hf_type=hf_type_of(spec, None)), metadata={"format": "pt"})
    write_bytes_atomic(path / "model.safetensors", data)
    write_text_atomic(path / "config.json", json.dumps(hf_config(spec, head=head), indent=2, sort_keys=True) + "\n")


def load_checkpoint(path: str | Path, *, head: Head) -> tuple[ModelSpec, dict[str, Tensor]]:
    """Read an HF model directory (one or several ``*.safetensors`` files) into whole tensors."""
    from plans.base import loads_json
    from runtime.weights import HFWeights

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file() or not any(path.glob("*.safetensors")):
        raise PlannerError(f"{str(path)!r} is not an HF checkpoint directory (needs config.json and *.safetensors)")
    config = loads_json(cfg_path.read_text(encoding="utf-8"), source=f"model config {str(cfg_path)!r}")
    spec = spec_from_hf_config(config, source=str(cfg_path))
    weights = HFWeights(path, spec=spec, head=head, hf_type=str(config.get("model_type")))
    return spec, {p.name: weights.read(p, tuple((0, n) for n in p.shape)) for p in parameters(spec, head=head)}
