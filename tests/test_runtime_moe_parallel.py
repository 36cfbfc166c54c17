"""Mixture-of-experts layouts compute what one process computes: 4 gloo ranks, expert parallel
(tokens to their experts by all-to-all), experts split over tp, with dp, pp, sequence parallel,
micro-batches and ZeRO where the runtime runs them, against the unsharded reference (the harness
of test_runtime_parallel: inference, greedy and sampled generation, two train minibatches, every
updated parameter slice)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from plans import PRESETS, resolve_model
from runtime.model import init_tensor
from tests.test_runtime_parallel import WORLD, _free_port, collect, run_layouts

SPECS = {
    "mixtral": PRESETS["tiny-mixtral"],
    "qwen-moe": PRESETS["tiny-qwen-moe"],  # gated shared expert, a dense layer, q/k/v bias, top-k not renormalised
    # Qwen3-style heads wider than hidden / heads with per-head q/k norms; OLMoE-style norms over the projection
    "qwen3-moe": resolve_model("model_type=llama,hidden_size=64,num_hidden_layers=4,num_attention_heads=8,"
                               "num_key_value_heads=4,head_dim=16,qk_norm=head,intermediate_size=128,vocab_size=256,"
                               "max_position_embeddings=128,num_experts=4,num_experts_per_tok=2,"
                               "moe_intermediate_size=32"),
    "olmoe": resolve_model("model_type=llama,hidden_size=64,num_hidden_layers=4,num_attention_heads=8,"
                           "num_key_value_heads=4,qk_norm=proj,intermediate_size=32,vocab_size=256,"
                           "max_position_embeddings=128,num_experts=4,num_experts_per_tok=2,norm_topk_prob=false"),
}
CASES = [
    # dp, tp, pp, extra layout fields
    (4, 1, 1, {"ep": 4}),
    (4, 1, 1, {"ep": 2, "micro_batches": 2}),
    (4, 1, 1, {"zero": 3}),  # experts whole on every rank, sharded by ZeRO like the rest
    (2, 2, 1, {"ep": 2, "etp": 2, "sequence_parallel": True}),
    (2, 2, 1, {"ep": 2, "etp": 2}),
    (1, 4, 1, {"etp": 4, "sequence_parallel": True, "recompute": "full"}),
    (2, 1, 2, {"ep": 2, "micro_batches": 2}),
    (1, 2, 2, {"etp": 2, "sequence_parallel": True}),
]


def _state(p):  # noqa: ANN001, ANN202
    # routers off their near-uniform start, so routing is decisive
    return init_tensor(p, seed=3) + 0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(
        sum(map(ord, p.name))))


def _worker(rank: int, port: int, out_dir: str) -> None:
    # the value head of an MoE critic: test_runtime_executor's ppo_moe
    run_layouts(rank, port, out_dir, [(name, spec, "lm") for name, spec in SPECS.items()], CASES, _state)


@pytest.mark.heavy
@pytest.mark.slow
def test_every_expert_layout_matches_single_process_reference(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    problems, checks = collect(tmp_path)
    assert not problems, "\n".join(problems[:40])
    assert checks > 4 * len(CASES) * WORLD * 10
