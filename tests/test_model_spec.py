"""ModelSpec: exact parameter counts against published sizes, presets, HF config loading."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plans.errors import PlannerError
from plans.model import PRESETS, ModelSpec, resolve_model
from tests.strategies import fuzz_settings

# Published parameter counts: exact figures from the models' Hugging Face model cards / safetensors
# indexes (Llama 2, Code Llama, Llama 3/3.1, Qwen2.5).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "codellama-34b": 33_743_970_304,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3-405b": 405_853_388_800,
    "mistral-7b-v0.1": 7_241_732_096,
    "llama-3.1-8b": 8_030_261_248,  # 3.1 changed the context (RoPE scaling), not the weights
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32_763_876_352,
    "qwen2.5-72b": 72_706_203_648,
}

# Brown et al. 2020, Table 2.1, states sizes to two significant digits (1.3B, 2.7B, ...); our
# presets use the table's widths and depths with GPT-2's vocabulary (50,257) and 2,048 positions.
# The paper's rounding alone is up to 2% (2.65B prints as "2.7B"), so the bound here is the
# half-unit of the last printed digit.
GPT3_PAPER = {"gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9}
GPT3_ROUNDING = {"gpt3-1.3b": 0.05e9, "gpt3-2.7b": 0.05e9, "gpt3-6.7b": 0.05e9, "gpt3-13b": 0.5e9, "gpt3-175b": 0.5e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama_family_counts_match_published_within_1pct(name):
    assert abs(PRESETS[name].num_params() - PUBLISHED[name]) / PUBLISHED[name] < 0.01


# Qwen3 dense: the model cards' "Number of Parameters" (8.2B, 32.8B), to their rounding.
QWEN3_CARD = {"qwen3-8b": 8.2e9, "qwen3-32b": 32.8e9}


@pytest.mark.parametrize("name", sorted(QWEN3_CARD))
def test_qwen3_dense_counts_match_model_cards_to_their_rounding(name):
    assert abs(PRESETS[name].num_params() - QWEN3_CARD[name]) <= 0.05e9
    assert PRESETS[name].qk_norm == "head" and not PRESETS[name].tie_word_embeddings


@pytest.mark.parametrize("name", sorted(GPT3_PAPER))
def test_gpt3_counts_match_paper_to_its_rounding(name):
    assert abs(PRESETS[name].num_params() - GPT3_PAPER[name]) <= GPT3_ROUNDING[name]


# Narayanan et al. 2021 (Megatron-LM), Table 1: GPT models with V=51,200 and s=2,048; the paper's
# count P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) is what our gpt family computes, plus the final norm.
MEGATRON_TABLE1 = [(2304, 24, 24, 1.7e9), (3072, 30, 32, 3.6e9), (4096, 36, 32, 7.5e9), (6144, 40, 48, 18.4e9),
                   (8192, 48, 64, 39.1e9), (10240, 60, 80, 76.1e9), (12288, 80, 96, 145.6e9), (16384, 96, 128, 310.1e9)]


@pytest.mark.parametrize("h,layers,heads,published", MEGATRON_TABLE1)
def test_gpt_family_matches_megatron_table(h, layers, heads, published):
    spec = ModelSpec(model_type="gpt", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                     vocab_size=51200, max_position_embeddings=2048)
    formula = 12 * layers * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * layers * h))
    # The paper's expression leaves out the final LayerNorm (weight and bias: 2h).
    assert spec.num_params() == round(formula) + 2 * h
    # The table prints billions to one decimal (1.65B reads "1.7"): within 1% or that rounding.
    assert abs(spec.num_params() - published) <= max(0.01 * published, 0.05e9)


def test_value_head_replaces_lm_head():
    spec = PRESETS["llama-2-7b"]
    assert spec.num_params("lm") - spec.num_params("value") == spec.vocab_size * spec.hidden_size - spec.hidden_size


def test_family_defaults():
    gpt = ModelSpec(model_type="gpt", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    assert gpt.intermediate_size == 256 and gpt.tie_word_embeddings is True and gpt.kv_heads == 4
    llama = resolve_model("model_type=llama,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,"
                          "intermediate_size=128,vocab_size=100")
    assert llama.tie_word_embeddings is False and llama.kv_heads == 4


@pytest.mark.parametrize("fields,needle", [
    ({"hidden_size": 65}, "not divisible by num_attention_heads"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"intermediate_size": None}, "intermediate_size is required"),
    ({"model_type": "mamba"}, "model_type"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_bad_specs_name_the_field(fields, needle):
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128, vocab_size=100)
    base.update(fields)
    with pytest.raises(PlannerError, match=needle):
        resolve_model({k: v for k, v in base.items() if v is not None})


def test_unknown_key_is_an_error():
    with pytest.raises(PlannerError, match="unknown key"):
        resolve_model({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "intermediate_size": 128, "vocab_size": 100, "hidden_sise": 3})


def test_hf_config_json(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
           "max_position_embeddings": 4096, "torch_dtype": "float16", "architectures": ["LlamaForCausalLM"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_model(str(path))
    assert spec.num_params() == PRESETS["llama-2-7b"].num_params()
    assert resolve_model(str(tmp_path)).num_params() == spec.num_params()  # a checkpoint directory


def test_hf_gpt2_and_qwen2_configs(tmp_path):
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    assert resolve_model(str(tmp_path / "gpt2.json")).num_params() == 124_439_808  # GPT-2 small, as published by HF
    qwen = PRESETS["qwen2.5-7b"].model_dump(exclude={"name"}) | {"model_type": "qwen2", "attention_bias": None}
    (tmp_path / "qwen.json").write_text(json.dumps(qwen))
    assert resolve_model(str(tmp_path / "qwen.json")).num_params() == PUBLISHED["qwen2.5-7b"]


def test_unsupported_hf_type_and_missing_file(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(PlannerError, match="not supported"):
        resolve_model(str(tmp_path / "c.json"))
    with pytest.raises(PlannerError, match="does not exist"):
        resolve_model(str(tmp_path / "nope.json"))
    with pytest.raises(PlannerError, match="unknown model 'llama-9b'"):
        resolve_model("llama-9b")


def test_rope_scaling_is_checked_where_it_is_given():
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                vocab_size=128)
    with pytest.raises(PlannerError, match="rope_type 'llama3' needs low_freq_factor, high_freq_factor"):
        resolve_model({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(PlannerError, match="high_freq_factor .* above low_freq_factor"):
        resolve_model({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                "high_freq_factor": 1.0}})
    with pytest.raises(PlannerError, match="rope_type"):
        resolve_model({**base, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(PlannerError, match="gpt learns its positions"):
        resolve_model({**base, "model_type": "gpt", "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    spec = resolve_model({**base, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4}})
    assert spec.rope_original_positions == 4096  # transformers' default for the pre-training length
    assert PRESETS["llama-3.1-8b"].rope_original_positions == 8192


@given(kind=st.sampled_from(["linear", "llama3", "yarn"]), factor=st.floats(0.01, 1e4), low=st.floats(0.01, 100),
       gap=st.floats(0.01, 100), original=st.integers(1, 1 << 20), theta=st.floats(1.001, 1e9),
       beta=st.one_of(st.none(), st.floats(0.01, 1e3)), truncate=st.booleans())
@fuzz_settings(60)
def test_every_valid_rope_scaling_gives_finite_frequencies(kind, factor, low, gap, original, theta, beta, truncate):
    import torch

    from runtime.model import rope_frequencies

    spec = resolve_model({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                          "intermediate_size": 96, "vocab_size": 128, "rope_theta": theta,
                          "rope_scaling": {"rope_type": kind, "factor": factor, "low_freq_factor": low,
                                           "high_freq_factor": low + gap, "original_max_position_embeddings": original,
                                           "beta_fast": beta, "truncate": truncate}})
    inv_freq, scale = rope_frequencies(spec, torch.device("cpu"))
    assert inv_freq.shape == (8,) and bool(torch.isfinite(inv_freq).all()) and scale > 0
