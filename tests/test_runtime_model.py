"""The single-process model against transformers, and HF-format checkpoints both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch

from plans import Layout, resolve_model
from plans.errors import PlannerError
from runtime.model import (
    Shard,
    _lm_logits,
    build_shard,
    init_tensor,
    load_checkpoint,
    save_checkpoint,
    stage_forward,
    token_logprobs,
    token_values,
)

transformers = pytest.importorskip("transformers")

LLAMA = resolve_model(
    "model_type=llama,hidden_size=64,num_hidden_layers=2,num_attention_heads=8,num_key_value_heads=2,"
    "intermediate_size=96,vocab_size=100,max_position_embeddings=64,rope_theta=500000,rms_norm_eps=1e-6"
)
GPT = resolve_model("model_type=gpt,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,vocab_size=100,"
                    "max_position_embeddings=32")


def _shard(spec, head="lm", state=None) -> Shard:
    layers = tuple(range(spec.num_hidden_layers))
    return build_shard(spec, head=head, layout=Layout(), local=0, layers=layers, device=torch.device("cpu"),
                       state=state or (lambda p: init_tensor(p, seed=7) + 0.01 * torch.randn(p.shape)))


def _logits(shard: Shard, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = stage_forward(shard, tokens, positions=torch.arange(tokens.shape[1]))
        return _lm_logits(shard, h, False)


def test_llama_logits_match_transformers_through_a_saved_checkpoint(tmp_path: Path) -> None:
    shard = _shard(LLAMA)
    save_checkpoint(tmp_path, {n: p.data for n, p in shard.params.items()}, spec=LLAMA, head="lm")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.randint(0, LLAMA.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    got = _logits(shard, tokens)
    assert (got - expected).abs().max().item() < 1e-5
    assert expected.abs().max().item() > 0.01  # not a trivially zero comparison


def test_checkpoint_written_by_transformers_loads_and_matches(tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                   intermediate_size=128, vocab_size=90, max_position_embeddings=64)
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    spec, state = load_checkpoint(tmp_path, head="lm")
    assert spec.kv_heads == 4 and spec.vocab_size == 90
    shard = _shard(spec, state=lambda p: state[p.name])
    tokens = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf(tokens).logits
        lp = token_logprobs(shard, stage_forward(shard, tokens, positions=torch.arange(11)), tokens)
    assert (_logits(shard, tokens) - expected).abs().max().item() < 1e-5
    ref_lp = torch.log_softmax(expected[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    assert (lp - ref_lp).abs().max().item() < 1e-5


def test_value_head_matches_transformers_sequence_classification(tmp_path: Path) -> None:
    shard = _shard(LLAMA, head="value")
    save_checkpoint(tmp_path, {n: p.data for n, p in shard.params.items()}, spec=LLAMA, head="value")
    hf = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path, pad_token_id=LLAMA.vocab_size - 1).eval()
    tokens = torch.randint(0, LLAMA.vocab_size - 1, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(tokens).logits[:, 0]  # the score at the last (non-pad) token
        values = token_values(shard, stage_forward(shard, tokens, positions=torch.arange(9)))
    assert values.shape == (2, 9)
    assert (values[:, -1] - expected).abs().max().item() < 1e-5


def _gpt2_state(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Our gpt names -> transformers' GPT-2 names (Conv1D stores [in, out]; q, k, v fused)."""
    out = {"transformer.wte.weight": state["model.embed_tokens.weight"],
           "transformer.wpe.weight": state["model.embed_positions.weight"],
           "transformer.ln_f.weight": state["model.norm.weight"], "transformer.ln_f.bias": state["model.norm.bias"]}
    for i in range(layers):
        p, q = f"model.layers.{i}.", f"transformer.h.{i}."
        out[q + "ln_1.weight"], out[q + "ln_1.bias"] = state[p + "input_layernorm.weight"], state[p + "input_layernorm.bias"]
        out[q + "ln_2.weight"] = state[p + "post_attention_layernorm.weight"]
        out[q + "ln_2.bias"] = state[p + "post_attention_layernorm.bias"]
        qkv = ("q_proj", "k_proj", "v_proj")
        out[q + "attn.c_attn.weight"] = torch.cat([state[p + f"self_attn.{n}.weight"] for n in qkv]).T
        out[q + "attn.c_attn.bias"] = torch.cat([state[p + f"self_attn.{n}.bias"] for n in qkv])
        out[q + "attn.c_proj.weight"] = state[p + "self_attn.o_proj.weight"].T
        out[q + "attn.c_proj.bias"] = state[p + "self_attn.o_proj.bias"]
        out[q + "mlp.c_fc.weight"] = state[p + "mlp.up_proj.weight"].T
        out[q + "mlp.c_fc.bias"] = state[p + "mlp.up_proj.bias"]
        out[q + "mlp.c_proj.weight"] = state[p + "mlp.down_proj.weight"].T
        out[q + "mlp.c_proj.bias"] = state[p + "mlp.down_proj.bias"]
    out["lm_head.weight"] = state["model.embed_tokens.weight"]
    return out


def test_gpt_family_matches_transformers_gpt2() -> None:
    shard = _shard(GPT)
    assert "lm_head.weight" not in shard.params  # tied to the embedding
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=32,
                                  activation_function="gelu_new", layer_norm_epsilon=GPT.layer_norm_epsilon,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    missing, unexpected = hf.load_state_dict(_gpt2_state({n: p.data for n, p in shard.params.items()}, 2), strict=False)
    assert not unexpected and all("attn.bias" in m or "masked_bias" in m for m in missing)
    tokens = torch.randint(0, 100, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf(tokens).logits
    assert (_logits(shard, tokens) - expected).abs().max().item() < 1e-5


def test_checkpoint_round_trip_is_bit_exact_and_checks_names(tmp_path: Path) -> None:
    shard = _shard(GPT, head="value")
    state = {n: p.data for n, p in shard.params.items()}
    save_checkpoint(tmp_path, state, spec=GPT, head="value")
    spec, loaded = load_checkpoint(tmp_path, head="value")
    assert spec.model_type == "gpt" and spec.tied
    assert set(loaded) == set(state) and all(torch.equal(loaded[n], state[n]) for n in state)
    from safetensors.torch import save_file

    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")
    save_file({n: t for n, t in saved.items() if n != "score.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(PlannerError, match="has no tensor for score.weight"):
        load_checkpoint(tmp_path, head="value")


def test_bfloat16_autocast_stays_close_to_float32() -> None:
    from runtime.engine import ModelRunner
    from runtime.groups import solo_groups

    def runner(dtype: torch.dtype) -> ModelRunner:
        return ModelRunner(LLAMA, head="lm", trainable=False, groups=solo_groups(Layout()),
                           state=lambda p: init_tensor(p, seed=7), device=torch.device("cpu"), dtype=dtype)

    tokens = torch.randint(0, LLAMA.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    lp32 = runner(torch.float32).forward(tokens, what="logprobs")
    lp16 = runner(torch.bfloat16).forward(tokens, what="logprobs")
    assert lp16.dtype == torch.float32
    assert 0 < (lp16 - lp32).abs().max().item() < 0.05  # bf16 rounding, nothing worse
