"""Sliding-window attention in the cost model: the scores a kernel computes, counted exactly.

A kernel that takes the window (FlashAttention's ``window_size``, the ``vllm`` and
``megatron-core`` stacks) computes ``min(p, W)`` keys for query p and a decode step reads the last
W cached keys; the planner's runtime (``torch``) passes the window as an explicit mask to SDPA,
which computes every score. RoPE scaling changes no kernel.
"""

from __future__ import annotations

import pytest

from cost_models.framework import resolve_framework
from cost_models.ops import layer_work
from plans import resolve_model

BASE = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=128, max_position_embeddings=4096)
HEADS = 4


def _attn(fw: str, window: int | None, *, s: int, kv_len: int | None = None, b: int = 1):
    spec = resolve_model({**BASE, "sliding_window": window})
    work = layer_work(spec, resolve_framework(fw), b=b, s=s, tp=1, cp=1, sp=False, kv_len=kv_len)
    (kernel,) = [k for k in work.fwd if k.kind == "attn"]
    return kernel


def test_a_window_shorter_than_the_sequence_counts_min_p_w_keys_per_query() -> None:
    s, w = 8, 3  # keys per query 1, 2, 3, 3, 3, 3, 3, 3: 21 scores per head
    assert _attn("megatron-core", w, s=s).scores == pytest.approx(HEADS * 21)
    assert _attn("vllm", w, s=s).scores == pytest.approx(HEADS * 21)
    assert _attn("megatron-core", None, s=s).scores == pytest.approx(HEADS * 36)  # causal: 1 + 2 + ... + 8
    assert _attn("megatron-core", 8, s=s).scores == pytest.approx(HEADS * 36)  # a window as long as the sequence
    assert _attn("torch", w, s=s).scores == pytest.approx(HEADS * 64)  # an explicit mask computes all of them
    assert _attn("torch", None, s=s).scores == pytest.approx(HEADS * 36)  # no mask: the causal kernel
    fw, bw = _attn("megatron-core", w, s=s), _attn("megatron-core", None, s=s)
    assert fw.flops / bw.flops == pytest.approx(21 / 36)


def test_decode_reads_only_the_window_of_the_cache_where_the_kernel_takes_it() -> None:
    full, windowed = _attn("vllm", None, s=1, kv_len=1000, b=8), _attn("vllm", 100, s=1, kv_len=1000, b=8)
    assert windowed.scores == pytest.approx(full.scores / 10)
    assert windowed.bytes < full.bytes / 5  # the cache's K and V dominate a decode step's attention bytes
    masked = _attn("torch", 100, s=1, kv_len=1000, b=8)
    assert masked.scores == pytest.approx(full.scores) and masked.bytes == pytest.approx(full.bytes)


def test_rope_scaling_changes_no_kernel() -> None:
    plain = resolve_model(BASE)
    scaled = resolve_model({**BASE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 512}})
    fw = resolve_framework("megatron-core")
    assert layer_work(plain, fw, b=2, s=64, tp=1, cp=1, sp=False) == layer_work(scaled, fw, b=2, s=64, tp=1, cp=1,
                                                                                 sp=False)

