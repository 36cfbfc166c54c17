"""Mixture-of-experts layers in the runtime: the single-process model against transformers'
Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE on the same weights, HF directories both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plans import Layout
from runtime.model import _lm_logits, build_shard, load_checkpoint, save_checkpoint, stage_forward, token_logprobs

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
              max_position_embeddings=64, num_experts_per_tok=2)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, intermediate_size=80, num_experts=4,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                     mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, intermediate_size=80, num_experts=4, head_dim=16,
                                                     moe_intermediate_size=32, norm_topk_prob=True),
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, pad_token_id=0,
                                              eos_token_id=1),
}


def _hf(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():  # transformers zero-initialises some routers: give every weight a spread
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _logits(spec, state, tokens):
    shard = build_shard(spec, head="lm", layout=Layout(), local=0, layers=tuple(range(spec.num_hidden_layers)),
                        state=lambda p: state[p.name], device=torch.device("cpu"))
    with torch.no_grad():
        h = stage_forward(shard, tokens, positions=torch.arange(tokens.shape[1]))
        return _lm_logits(shard, h, False), token_logprobs(shard, h, tokens)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_moe_logits_equal_transformers_on_the_same_weights(kind: str, tmp_path: Path) -> None:
    hf = _hf(kind)
    hf.save_pretrained(tmp_path)
    spec, state = load_checkpoint(tmp_path, head="lm")
    assert spec.is_moe and spec.num_params() == sum(p.numel() for p in hf.parameters())
    tokens = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(tokens).logits
    got, lp = _logits(spec, state, tokens)
    assert (got - expected).abs().max().item() < 1e-5
    assert expected.abs().max().item() > 0.01
    ref_lp = torch.log_softmax(expected[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert (lp - ref_lp).abs().max().item() < 1e-5
    # and back: our checkpoint loads in transformers as the same model
    out = tmp_path / "ours"
    save_checkpoint(out, state, spec=spec, head="lm")
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert (again(tokens).logits - expected).abs().max().item() < 1e-5
