"""The runtime's hot paths allocate and compute only what they must (issue: a fast runtime).

Each test watches the aten operators a call dispatches (a TorchDispatchMode records every op and
the size of what it returns), so what is checked is what runs, on any device: grouped-query
attention makes no repeated copy of K/V, rotary tables are built once per forward, log-probs
make a chunk of logits at a time and nothing vocabulary-sized beside their log-softmax, sampling makes no float64 pass over the
vocabulary. Exact equality with the reference and with transformers is the other runtime tests'.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plans import PRESETS, Layout, resolve_model
from runtime.engine import ModelRunner
from runtime.groups import solo_groups
from runtime.model import _attention_core, _lm_logits, init_tensor, stage_forward, token_logprobs

SPEC = resolve_model("model_type=llama,hidden_size=64,num_hidden_layers=2,num_attention_heads=8,"
                     "num_key_value_heads=2,intermediate_size=128,vocab_size=512,max_position_embeddings=128")


VIEWS = {"t", "view", "_unsafe_view", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "as_strided",
         "alias", "permute", "detach", "_reshape_alias", "reshape"}


class Ops(TorchDispatchMode):
    """(op name, output numel, output dtype) of every aten op dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func.overloadpacket.__name__), t.numel(), t.dtype))
        return out


def runner() -> ModelRunner:
    return ModelRunner(SPEC, head="lm", trainable=False, groups=solo_groups(Layout()),
                       state=lambda p: init_tensor(p, seed=0), device=torch.device("cpu"))


def test_grouped_query_attention_makes_no_repeated_copy_of_keys_and_values() -> None:
    b, h, kv, s, d = 2, 8, 2, 32, 16
    q = torch.randn(b, h, 1, d)  # one decode step against a cache of s positions
    k, v = torch.randn(b, kv, s, d), torch.randn(b, kv, s, d)
    with Ops() as ops:
        out = _attention_core(q, k, v, False)
    repeated = b * h * s * d  # the size K (or V) would have once copied out to every query head
    assert max(n for _, n, _ in ops.seen) < repeated, ops.seen
    # and the result is attention with each key/value head serving its query group
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1),
                                                            v.repeat_interleave(h // kv, 1))
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_rotary_tables_are_built_once_per_forward_not_per_layer() -> None:
    r = runner()
    tokens = torch.randint(0, SPEC.vocab_size, (2, 16))
    with torch.no_grad(), Ops() as ops:
        stage_forward(r.shard, tokens, positions=torch.arange(16))
    assert sum(1 for name, _, _ in ops.seen if name == "cos") == 1, [x for x in ops.seen if x[0] in ("cos", "sin")]
    assert SPEC.num_hidden_layers > 1


def test_log_probs_make_the_logits_and_their_log_softmax_and_nothing_else_vocabulary_sized() -> None:
    r = runner()
    b, s = 2, 16
    tokens = torch.randint(0, SPEC.vocab_size, (b, s))
    with torch.no_grad():
        h = stage_forward(r.shard, tokens, positions=torch.arange(s))
        with Ops() as ops:
            lp = token_logprobs(r.shard, h, tokens)
    full = [x for x in ops.seen if x[1] >= b * (s - 1) * SPEC.vocab_size and x[0] not in VIEWS]
    # the logits and one fused log-softmax pass over them (a chunk's: see the next test); no fp32
    # upcast copy, no separate max / exp / sum passes. Every position goes through the head (the
    # last one's prediction is dropped after): a copy of all hidden states but the last would move
    # more bytes than that one position's logits whenever s x hidden exceeds the vocabulary.
    assert [name for name, _, _ in full] in (["mm", "_log_softmax"], ["addmm", "_log_softmax"]), full
    assert all(n == b * s * SPEC.vocab_size for _, n, _ in full)
    hidden = b * (s - 1) * SPEC.hidden_size
    assert not [x for x in ops.seen if x[0] in ("clone", "copy_", "_to_copy") and x[1] >= hidden]  # h goes in as it is
    want = torch.log_softmax(torch.nn.functional.linear(torch.nn.functional.rms_norm(
        h, (SPEC.hidden_size,), r.shard.params["model.norm.weight"], SPEC.rms_norm_eps),
        r.shard.params["lm_head.weight"]), -1)[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, want, rtol=1e-5, atol=1e-5)


def test_sampling_makes_no_float64_pass_over_the_vocabulary() -> None:
    r = runner()
    prompts = torch.randint(0, SPEC.vocab_size, (4, 8))
    with torch.no_grad(), Ops() as ops:
        r.generate(prompts, gen_len=3, temperature=1.0, seed=7)
    wide = [x for x in ops.seen if x[2] == torch.float64 and x[1] >= SPEC.vocab_size]
    assert not wide, wide[:5]


def test_low_precision_generation_casts_each_weight_once_not_per_step() -> None:
    """Under bf16 autocast, a model copy whose weights do not require grad (a transient copy)
    is cast to bf16 once per generation, not again at every decode step."""
    r = runner()
    for p in r.shard.params.values():
        p.requires_grad_(False)
    prompts = torch.randint(0, SPEC.vocab_size, (2, 8))
    weight = r.shard.params["model.layers.0.mlp.up_proj.weight"].numel()

    def casts(steps: int) -> int:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), Ops() as ops:
            r.generate(prompts, gen_len=steps, temperature=0.0, seed=0)
        return sum(1 for name, n, dtype in ops.seen if name == "_to_copy" and n == weight and dtype == torch.bfloat16)

    assert casts(2) == casts(6) > 0  # the same casts however many tokens are decoded


def _unfused_logprobs(r: ModelRunner, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The head and log-probs as plain ops: logits of every position, log-softmax, gather."""
    logits = _lm_logits(r.shard, h, False)[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _grads(r: ModelRunner, tokens: torch.Tensor, logprobs) -> tuple[torch.Tensor, list[torch.Tensor]]:  # noqa: ANN001
    """Log-probs and the gradients of a weighted sum of them with respect to every parameter."""
    params = [p.requires_grad_() for p in r.shard.params.values()]
    h = stage_forward(r.shard, tokens, positions=torch.arange(tokens.shape[1]))
    lp = logprobs(r, h, tokens)
    weights = torch.linspace(-1.0, 2.0, lp.numel()).view_as(lp)  # like a PPO loss: signed per-token factors
    return lp.detach(), list(torch.autograd.grad((lp * weights).sum(), params))


def _fused(r: ModelRunner, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return token_logprobs(r.shard, h, tokens)


def _largest(ops: Ops, dtype: torch.dtype | None = None) -> int:
    """The largest tensor made, other than vocabulary-sized weights and their gradients."""
    weight = SPEC.vocab_size * SPEC.hidden_size
    return max(n for name, n, dt in ops.seen
               if name not in VIEWS and name != "cat" and dtype in (None, dt) and n != weight)


@pytest.mark.parametrize("b", [8, 40])
def test_log_probs_make_a_chunk_of_logits_at_a_time_forward_and_backward(b, monkeypatch) -> None:  # noqa: ANN001
    """With 8 rows of 16 the batch has fewer tokens than vocabulary rows, and backward makes the
    logits again a slice of the vocabulary at a time; with 40 it has more, and backward goes a run
    of tokens at a time (`tensor_parallel.head_logprobs`)."""
    import runtime.model as model

    r = runner()
    s = 16
    tokens = torch.randint(0, SPEC.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    want, want_grads = _grads(r, tokens, _unfused_logprobs)
    whole, whole_grads = _grads(r, tokens, _fused)  # one chunk: its logits are kept for backward
    chunk = b // 2 * (s - 1)  # tokens per chunk, half the batch's: backward makes the logits again
    monkeypatch.setattr(model, "LOGITS_CHUNK_ELEMENTS", chunk * SPEC.vocab_size)
    with Ops() as ops:
        chunked, chunked_grads = _grads(r, tokens, _fused)
    assert _largest(ops) <= chunk * SPEC.vocab_size < b * (s - 1) * SPEC.vocab_size
    for got, grads in ((whole, whole_grads), (chunked, chunked_grads)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # forward only (reference, critic and reward passes): the same chunks
        h = stage_forward(r.shard, tokens, positions=torch.arange(s))
        with Ops() as ops:
            got = token_logprobs(r.shard, h, tokens)
    assert _largest(ops) <= chunk * SPEC.vocab_size
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fused_head_under_bf16_autocast_matches_the_plain_ops_without_fp32_logits_of_the_batch(
        monkeypatch) -> None:  # noqa: ANN001
    import runtime.model as model

    r = runner()
    b, s = 8, 16
    chunk = 4 * (s - 1)
    tokens = torch.randint(0, SPEC.vocab_size, (b, s), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(model, "LOGITS_CHUNK_ELEMENTS", chunk * SPEC.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = _grads(r, tokens, _unfused_logprobs)
        with Ops() as ops:
            got, grads = _grads(r, tokens, _fused)
    assert _largest(ops, torch.float32) <= chunk * SPEC.vocab_size < b * (s - 1) * SPEC.vocab_size
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # bf16 logits on both sides
    # Both are bf16 computations; against the same model in fp64 the fused head's gradients are
    # as accurate as the plain ops' (within twice their error, and a bf16 step of the smallest).
    exact = runner()
    for name, p in exact.shard.params.items():
        p.data = r.shard.params[name].data.double()
    monkeypatch.setattr(model, "LOGITS_CHUNK_ELEMENTS", b * s * SPEC.vocab_size)
    _, truth = _grads(exact, tokens, _unfused_logprobs)
    for g, w, t in zip(grads, want_grads, truth):
        assert (g.double() - t).abs().max() <= 2 * (w.double() - t).abs().max() + 1e-3


def test_adam_is_torch_adamw_in_one_fused_pass(monkeypatch) -> None:  # noqa: ANN001
    import runtime.data_parallel as dpm

    torch.manual_seed(0)
    w = torch.randn(1000)
    cfg = dpm.AdamConfig(weight_decay=0.1)
    results = []
    for fused in (True, False):
        if not fused:  # the plain-ops fallback (devices without the kernel) computes the same
            monkeypatch.delattr(torch, "_fused_adamw_")
        p = torch.nn.Parameter(w.clone())
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, foreach=False)
        q, m, v = w.clone(), torch.zeros(1000), torch.zeros(1000)
        g = torch.Generator().manual_seed(1)
        with Ops() as ops:
            for k in range(1, 4):
                grad = torch.randn(1000, generator=g)
                dpm.adam_update(q, grad, m, v, step=k, lr=1e-2, cfg=cfg)
        g = torch.Generator().manual_seed(1)  # the same gradients
        for _ in range(3):
            p.grad = torch.randn(1000, generator=g)
            opt.step()
        torch.testing.assert_close(q, p.detach(), rtol=1e-6, atol=1e-6)
        passes = sum(1 for name, n, _ in ops.seen if n == 1000 and name not in VIEWS) / 3 - 1  # less the randn
        results.append(passes)
    assert results[0] <= 1 < results[1]  # one kernel per step against several passes


def test_a_static_cache_decodes_what_the_growing_cache_does() -> None:
    """The decode step CUDA graphs capture (static shapes: a slot written by index, attention over
    the whole buffer under a mask), run eagerly: the same tokens with padding, a sliding window
    and groups, in both families."""
    import runtime.generate as gen

    prompts = torch.randint(0, 256, (6, 7), generator=torch.Generator().manual_seed(0))
    pad = torch.tensor([0, 2, 0, 3, 1, 0])
    windowed = SPEC.model_copy(update={"sliding_window": 5})
    for spec in (SPEC, windowed, PRESETS["tiny-gpt"]):
        r = ModelRunner(spec, head="lm", trainable=False, groups=solo_groups(Layout()),
                        state=lambda p: init_tensor(p, seed=3), device=torch.device("cpu"))
        out = {}
        for static in (False, True):
            with torch.no_grad(), Ops() as ops:
                out[static] = gen.generate(r.shard, r.pipe, prompts, seq_ids=torch.arange(6), gen_len=9,
                                           temperature=1.0, seed=5, stop_token=3, device=r.device, pad=pad,
                                           groups=2, static=static)
            writes = sum(1 for name, _, _ in ops.seen if name == "index_copy_")
            assert (writes > 0) == static  # the static step writes its slot by index
        assert torch.equal(out[True]["tokens"], out[False]["tokens"]), spec
        assert torch.equal(out[True]["mask"], out[False]["mask"])
        torch.testing.assert_close(out[True]["logprobs"], out[False]["logprobs"], rtol=1e-5, atol=1e-5)
