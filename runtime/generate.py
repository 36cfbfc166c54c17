"""Batched generation with a KV cache, greedy or sampled, identical under every layout.

A prefill runs the prompts [b, p] through the stage's layers, filling the cache; each decode
step then runs one position. The last stage picks the next token and sends it to the first.

Sampling uses the Gumbel-max trick (``argmax(logits / T + g)`` with g ~ Gumbel(0, 1) is a draw
from softmax(logits / T)) with noise from a counter-based hash of (seed, sequence id, position,
vocabulary id). A token therefore depends only on the sequence's own logits and its global
index in the batch, not on how the batch or the vocabulary is split across ranks, and the
vocabulary-parallel argmax needs no gathered logits. Temperature 0 is greedy.

The returned log-probs are those of the chosen tokens under the model's own distribution
(temperature 1), the quantity PPO's ratio compares against. After a sequence emits
`stop_token`, its later positions hold `stop_token` and are masked out; once every sequence of
the batch has stopped, decoding ends (the last stage tells the other stages with the token it
sends back), and the remaining positions are that padding.

A call that decodes with another layout than it prefills with (Seesaw) prefills every prompt
position but the last (`prefill_cache`), the cache and weights move (`runtime.executor`), and the
decode layout runs the last prompt position as its first step. Under context parallel the
prefill is context-parallel and the decode KV-parallel (`runtime.context_parallel`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor

from plans.sharding import split_range
from runtime import tensor_parallel as tpx
from runtime.model import KVCache, Shard, last_logits, stage_forward
from runtime.pipeline_parallel import Pipeline

_M32 = 0xFFFFFFFF
CUDA_GRAPHS = True  # capture static decode steps on CUDA (False: run them eagerly, to compare or debug)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2**32;
    multipliers stay below 2**31 so no product overflows int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x68E31DA5) & _M32
    return x ^ (x >> 16)


def gumbel_noise(seed: int, seq_ids: Tensor, position: int | Tensor, vocab: tuple[int, int]) -> Tensor:
    """Gumbel(0, 1) noise [b, hi - lo] for vocabulary ids [lo, hi), a pure function of its
    arguments (`position`: one for all rows, or each row's [b])."""
    device = seq_ids.device
    x = _mix32(torch.tensor(seed & _M32, dtype=torch.int64, device=device))
    x = _mix32(x ^ (seq_ids.long() & _M32))[:, None]
    pos = position[:, None].long() if isinstance(position, Tensor) else position
    x = _mix32(x ^ (pos & _M32))
    x = _mix32(x ^ torch.arange(*vocab, dtype=torch.int64, device=device)[None, :])
    # 23 random bits, so u < 1 in fp32 (no fp64 pass over the vocabulary; the GPU's fp64 is slow)
    u = ((x >> 9).float() + 0.5) / 2.0**23
    return -torch.log(-torch.log(u))


def _choose(shard: Shard, logits: Tensor, *, temperature: float, seed: int, seq_ids: Tensor,
            position: int | Tensor) -> tuple[Tensor, Tensor]:
    """Next token [b] and its log-prob [b] from vocabulary-sharded logits [b, V/tp]."""
    tp, vocab = shard.tp, shard.spec.vocab_size
    if temperature == 0:
        scores = logits.float()
    else:
        scores = logits.float() / temperature + gumbel_noise(seed, seq_ids, position, tp.vocab_range(vocab))
    token = tpx.vocab_choose(scores, tp, vocab_size=vocab)
    logprob = tpx.vocab_logprobs(logits[:, None], token[:, None], tp, vocab_size=vocab)[:, 0]
    return token, logprob


def new_cache(shard: Shard, *, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> KVCache:
    """An empty KV cache for this stage's layers (this rank's key/value heads)."""
    kv_local = shard.spec.kv_heads // shard.tp.size
    shape = (batch, kv_local, max_len, shard.spec.d_head)
    return KVCache(kv={i: (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for i in shard.layers})


def _whole(shard: Shard) -> Shard:
    """Under ZeRO-3, a transient copy of the stage with gathered parameters (one gather per call
    instead of one per decode step); freed when generation returns."""
    if shard.gather is None:
        return shard
    names = list(shard.params)
    whole = dict(zip(names, shard.gather(names)))
    return Shard(spec=shard.spec, head=shard.head, layers=shard.layers, first=shard.first, last=shard.last,
                 params=whole, tp=shard.tp, ep=shard.ep, cp=shard.cp)  # type: ignore[arg-type]


def _cast_once(shard: Shard, dtype: torch.dtype) -> Shard:
    """Under autocast to `dtype`, the stage with its matmul weights cast to `dtype` once for the
    whole generation: autocast caches casts only of leaves that require grad, so a transient copy
    (a call's own copy of a trainable model's weights, a gathered one) would otherwise be cast
    again at every decode step, an extra read of every weight per token. Autocast leaves a
    tensor already in `dtype` as it is, so every product is bitwise the one it computed."""
    if dtype == torch.float32:
        return shard
    tied = "model.embed_tokens.weight"  # also the embedding, which autocast does not cast
    params = {n: (t.detach().to(dtype) if n != tied and (n.endswith("proj.weight") or n.endswith("proj.bias")
                                                          or n == "lm_head.weight") else t)
              for n, t in shard.params.items()}
    return dataclasses.replace(shard, params=params, gather=None)  # type: ignore[arg-type]


@dataclass
class _Group:
    """Rows [lo, hi) of the batch decoding together, with their cache and what they produced."""

    lo: int
    hi: int
    cache: KVCache
    pad: Tensor | None
    step: Callable[[Tensor, Tensor], Tensor] | None = None  # a decode step (static cache), graphed on CUDA
    step_in: Tensor | None = None
    done: Tensor | None = None
    tokens: list[Tensor] = field(default_factory=list)
    logprobs: list[Tensor] = field(default_factory=list)
    mask: list[Tensor] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def prefill_cache(shard: Shard, pipe: Pipeline, prompts: Tensor, *, device: torch.device, pad: Tensor | None = None,
                  groups: int = 1) -> dict[int, tuple[Tensor, Tensor]]:
    """The KV cache of every prompt position but the last, for a generation that decodes with
    another layout (`generate`'s `prefilled`): this stage's layers -> (keys, values), each
    [b, kv/tp, p - 1, d] over the rows of `prompts` [b, p], computed a group of rows at a time
    (the prefill layout's micro-batches, pipelined through the stages). The decode layout runs
    the last prompt position as its first step, so no logits and no token are made here."""
    b, p = prompts.shape
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32
    shard = _cast_once(_whole(shard), dtype)
    keys: dict[int, list[Tensor]] = {i: [] for i in shard.layers}
    values: dict[int, list[Tensor]] = {i: [] for i in shard.layers}
    n = max(1, min(groups, b))
    # Under context parallel each rank runs its share of the positions (`runtime.context_parallel`,
    # padded after the prompt to a multiple of 2 * cp) and keeps the whole gathered cache.
    cp, s = shard.cp, p - 1
    padded = -(-s // cp.multiple) * cp.multiple
    slots = cp.slots(padded, device)
    positions = slots.clamp(max=shard.spec.max_position_embeddings - 1)
    for lo, hi in (split_range(b, n, g) for g in range(n)):
        cache = new_cache(shard, batch=hi - lo, max_len=padded, dtype=dtype, device=device)
        if s > 0:
            if pipe.first:
                x = torch.nn.functional.pad(prompts[lo:hi, :s], (0, padded - s)).index_select(1, slots)
            else:
                x = pipe.recv((hi - lo, slots.numel(), shard.spec.hidden_size), pipe.prev, device=device)
            h = stage_forward(shard, x, positions=positions, cache=cache, pad=None if pad is None else pad[lo:hi])
            if not pipe.last:
                pipe.send(h.float(), pipe.next)
        for i, (k, v) in cache.kv.items():
            keys[i].append(k[:, :, :s])
            values[i].append(v[:, :, :s])
    pipe.flush()
    return {i: (torch.cat(keys[i]), torch.cat(values[i])) for i in shard.layers}


def generate(shard: Shard, pipe: Pipeline, prompts: Tensor, *, seq_ids: Tensor, gen_len: int, temperature: float,
             seed: int, stop_token: int | None, device: torch.device, pad: Tensor | None = None,
             stopped: Callable[[Tensor, Tensor], Tensor] | None = None, groups: int = 1,
             static: bool | None = None,
             prefilled: dict[int, tuple[Tensor, Tensor]] | None = None) -> dict[str, Tensor] | None:
    """Generate `gen_len` tokens after `prompts` [b, p] (left-padded by `pad` [b] tokens, when
    given: each row then generates what it generates alone); on the last stage returns ``tokens``
    [b, p + gen_len], ``logprobs`` [b, gen_len] (fp32) and ``mask`` [b, gen_len] (bool). The
    sampling noise of a token depends on its position counted from the row's first real token.
    `stopped(generated [b, k], done [b]) -> done [b]`, when given (with `stop_token`), also ends
    rows on the last stage (a stop string: the token that completes it is the row's last).

    The rows are split into `groups` (the decode layout's micro-batches), as the cost model
    prices them (`cost_models.generation`): with one stage the groups run one after another
    (waves: only one group's cache is alive at a time); with several stages they are all in
    flight, each stage working on one group while the others' tokens travel and are chosen, so
    no stage idles (pp - 1) / pp of the time as with one batch. Every row's result is the same
    whatever the split.

    With `static` (the default on CUDA), decode steps run on a static cache (`KVCache.static`),
    and on CUDA each group's step (the stage's layers, and the head on the last stage) is
    captured once as a CUDA graph and replayed: one launch per step instead of hundreds of
    kernels issued from Python. On CPU the same static step runs eagerly (the tests compare it
    with the growing cache).

    With `prefilled` (this stage's layers -> keys and values [b, kv/tp, p - 1, d] of every prompt
    position but the last, made under another layout by `prefill_cache` and moved here), the
    first step runs the last prompt position on that cache instead of the whole prompt."""
    b, p = prompts.shape
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32
    cp = shard.cp
    if cp.size > 1 and prefilled is None:  # prefill under context parallel, then keep this rank's share
        a, z = split_range(p - 1, cp.size, cp.rank)
        prefilled = {i: (k[:, :, a:z], v[:, :, a:z])
                     for i, (k, v) in prefill_cache(shard, pipe, prompts, device=device, pad=pad, groups=groups).items()}
    shard = _cast_once(_whole(shard), dtype)
    n = max(1, min(groups, b))
    bounds = [split_range(b, n, g) for g in range(n)]

    def group(lo: int, hi: int) -> _Group:
        if cp.size > 1:
            assert prefilled is not None  # made above when not given
            return _kv_parallel_group(shard, lo, hi, prompts=prompts, prefilled=prefilled, gen_len=gen_len, pad=pad,
                                      dtype=dtype, device=device, first=pipe.first)
        cache = new_cache(shard, batch=hi - lo, max_len=p + gen_len, dtype=dtype, device=device)
        step_in = prompts[lo:hi] if pipe.first else None
        if prefilled is not None:
            for i, (k, v) in cache.kv.items():
                k[:, :, :p - 1] = prefilled[i][0][lo:hi]
                v[:, :, :p - 1] = prefilled[i][1][lo:hi]
            cache.length = p - 1
            step_in = prompts[lo:hi, p - 1:] if pipe.first else None
        return _Group(lo, hi, cache, None if pad is None else pad[lo:hi], step_in=step_in,
                      done=torch.zeros(hi - lo, dtype=torch.bool, device=device))

    static = device.type == "cuda" and cp.size == 1 if static is None else static  # KV-parallel steps run eagerly
    run = partial(_decode, shard, pipe, p=p, gen_len=gen_len, temperature=temperature, seed=seed, seq_ids=seq_ids,
                  stop_token=stop_token, device=device, stopped=stopped, static=static,
                  first=p if prefilled is None else 1)
    if pipe.stages == 1:
        done = []
        for lo, hi in bounds:  # waves: each group's cache is freed before the next is made
            g = group(lo, hi)
            run([g])
            g.cache, g.step = None, None  # type: ignore[assignment]  # (a captured graph holds the cache)
            done.append(g)
    else:
        done = [group(lo, hi) for lo, hi in bounds]
        run(done)
    pipe.flush()
    if not pipe.last:
        return None
    for g in done:  # rows that stopped early: the rest is padding, masked out
        for _ in range(gen_len - len(g.tokens)):
            g.tokens.append(torch.full((g.rows,), int(stop_token or 0), dtype=torch.int64, device=device))
            g.logprobs.append(torch.zeros(g.rows, device=device))
            g.mask.append(torch.zeros(g.rows, dtype=torch.bool, device=device))
    return {"tokens": torch.cat([prompts, torch.cat([torch.stack(g.tokens, dim=1) for g in done])], dim=1),
            "logprobs": torch.cat([torch.stack(g.logprobs, dim=1) for g in done]).float(),
            "mask": torch.cat([torch.stack(g.mask, dim=1) for g in done])}


def _kv_parallel_group(shard: Shard, lo: int, hi: int, *, prompts: Tensor, prefilled: dict[int, tuple[Tensor, Tensor]],
                       gen_len: int, pad: Tensor | None, dtype: torch.dtype, device: torch.device, first: bool) -> _Group:
    """Rows [lo, hi) decoding under KV parallel: this rank's cache holds its contiguous share of
    the prefilled positions (`plans.sharding.kv_box` with ``decode``), then every cp-th new one."""
    cp, p = shard.cp, prompts.shape[1]
    a, z = split_range(p - 1, cp.size, cp.rank)
    room = (z - a) + gen_len // cp.size + 1
    cache = new_cache(shard, batch=hi - lo, max_len=room, dtype=dtype, device=device)
    for i, (k, v) in cache.kv.items():
        k[:, :, :z - a] = prefilled[i][0][lo:hi]
        v[:, :, :z - a] = prefilled[i][1][lo:hi]
    cache.held = torch.full((room,), -1, dtype=torch.int64, device=device)
    cache.held[:z - a] = torch.arange(a, z, device=device)
    cache.local, cache.length = z - a, p - 1
    return _Group(lo, hi, cache, None if pad is None else pad[lo:hi], step_in=prompts[lo:hi, p - 1:] if first else None,
                  done=torch.zeros(hi - lo, dtype=torch.bool, device=device))


def _decode(shard: Shard, pipe: Pipeline, active: list[_Group], *, p: int, gen_len: int, temperature: float,
            seed: int, seq_ids: Tensor, stop_token: int | None, device: torch.device,
            stopped: Callable[[Tensor, Tensor], Tensor] | None, static: bool, first: int) -> None:
    """Prefill and decode the groups `active`, step by step, each step every group in turn; the
    first step runs the `first` positions the cache lacks (the prompt, or its last position).

    Each stage handles (step k, group g) in the same order, skipping groups that have finished,
    so every message between two stages is received in the order it was sent. The last stage
    sends each group's next token, with whether the group has finished, to the first stage, and
    (with a stop token) that flag to the middle stages."""
    h_size = shard.spec.hidden_size
    middle = not pipe.first and not pipe.last
    active = list(active)
    for k in range(gen_len):
        for g in list(active):
            if k > 0 and middle and stop_token is not None:  # the last stage says whether the group has finished
                if pipe.recv((1,), pipe.ranks[-1], dtype=torch.int64, device=device).item():
                    active.remove(g)
                    continue
            if k > 0 and pipe.first and not pipe.last:
                got = pipe.recv((g.rows + 1,), pipe.ranks[-1], dtype=torch.int64, device=device)
                if got[-1].item():
                    active.remove(g)
                    continue
                g.step_in = got[:g.rows, None]
            s = first if k == 0 else 1
            positions = torch.arange(g.cache.length, g.cache.length + s, device=device)
            x = g.step_in if pipe.first else pipe.recv((g.rows, s, h_size), pipe.prev, device=device)
            assert x is not None
            if g.cache.held is not None:  # KV parallel: the step's keys and values stay on one rank
                g.cache.begin(shard.cp.rank, shard.cp.size)
            if k == 0 or not static:
                h = stage_forward(shard, x, positions=positions, cache=g.cache, pad=g.pad)
                out = last_logits(shard, h) if pipe.last else h
            else:
                if g.step is None:
                    g.cache.static = True
                    g.step = _static_step(shard, g, last=pipe.last, x=x, positions=positions)
                out = g.step(x, positions)
            g.cache.end()
            g.cache.length += s
            if not pipe.last:
                pipe.send(out.float(), pipe.next)
                continue
            if _choose_next(shard, pipe, g, out, k=k, p=p, gen_len=gen_len, temperature=temperature, seed=seed,
                            seq_ids=seq_ids[g.lo:g.hi], stop_token=stop_token, device=device, stopped=stopped):
                active.remove(g)
        if not active:
            return


def _static_step(shard: Shard, g: _Group, *, last: bool, x: Tensor, positions: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """The group's decode step on its static cache: eager on CPU; on CUDA captured as a graph
    from `x` and `positions`, the first step's real inputs (the warm-up runs compute that step
    and write its cache slot exactly as the replay then does again)."""
    def step(x: Tensor, positions: Tensor) -> Tensor:
        h = stage_forward(shard, x, positions=positions, cache=g.cache, pad=g.pad)
        return last_logits(shard, h) if last else h

    if x.device.type != "cuda" or not CUDA_GRAPHS or (shard.tp.size > 1 and dist.get_backend(shard.tp.group) != "nccl"):
        return step  # CPU, or collectives a graph cannot capture (gloo on CUDA tensors)
    return _CudaGraph(step, x, positions)


class _CudaGraph:
    """`fn(x, positions)` captured once; a call copies its inputs into the captured buffers and replays."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor], x: Tensor, positions: Tensor) -> None:
        self.x, self.positions = x.clone(), positions.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation and allocator state before capture
                fn(self.x, self.positions)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda")
        with torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False), torch.cuda.graph(self.graph):
            self.out = fn(self.x, self.positions)

    def __call__(self, x: Tensor, positions: Tensor) -> Tensor:
        self.x.copy_(x)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites the captured output (a send may be in flight)


def _choose_next(shard: Shard, pipe: Pipeline, g: _Group, logits: Tensor, *, k: int, p: int, gen_len: int,
                 temperature: float, seed: int, seq_ids: Tensor, stop_token: int | None, device: torch.device,
                 stopped: Callable[[Tensor, Tensor], Tensor] | None) -> bool:
    """On the last stage: the group's token of step `k`, passed on; whether the group has finished."""
    assert g.done is not None
    token, logprob = _choose(shard, logits, temperature=temperature, seed=seed, seq_ids=seq_ids,
                             position=p + k if g.pad is None else p + k - g.pad)
    if stop_token is not None:
        token = token.masked_fill(g.done, stop_token)
    g.mask.append(~g.done)
    g.tokens.append(token)
    g.logprobs.append(logprob.masked_fill(g.done, 0.0))
    if stop_token is not None:
        g.done = g.done | (token == stop_token)
        if stopped is not None:
            g.done = stopped(torch.stack(g.tokens, dim=1), g.done)
    finished = stop_token is not None and bool(g.done.all())
    if stop_token is not None and shard.ep.size > 1:
        # Expert parallel couples the replicas: every rank of the group runs each sparse layer's
        # all-to-alls, so a group stops only when it has stopped on all of them.
        going = torch.tensor([0 if finished else 1], device=device)
        dist.all_reduce(going, op=dist.ReduceOp.MAX, group=shard.ep.group)
        finished = not bool(going.item())
    if pipe.stages > 1 and k + 1 < gen_len:  # the next token (and whether to go on) to the first stage
        pipe.send(torch.cat([token, torch.tensor([int(finished)], device=device)]), pipe.ranks[0])
        if stop_token is not None:
            for r in pipe.ranks[1:-1]:
                pipe.send(torch.tensor([int(finished)], device=device), r)
    if pipe.first:
        g.step_in = token[:, None]
    return finished
