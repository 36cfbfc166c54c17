"""Model architectures by their Hugging Face config fields, with exact parameter counts.

Two families cover the Llama/GPT lineage:

- ``llama``: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP, no biases except the
  optional q/k/v bias (``attention_bias``, as in Qwen2), untied LM head by default.
- ``gpt``: LayerNorm with bias, learned positions, multi-head attention with biases, GELU MLP
  (4x hidden by default), tied LM head by default (GPT-2/GPT-3, Megatron-LM's GPT).

A spec can be a preset name (`PRESETS`), a local HF ``config.json`` path, or inline fields
(``model_type=gpt,hidden_size=2048,...``); `resolve_model` accepts all three. The parameter catalog
(names, shapes, how each tensor shards) lives in `plans.sharding`; `ModelSpec.num_params` sums it,
so the count the cost model uses is the count the runtime allocates.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from plans.base import Strict, loads_json, validated
from plans.errors import PlannerError, brief

ModelType = Literal["llama", "gpt"]
Head = Literal["lm", "value"]
QKNorm = Literal["none", "head", "proj"]

MAX_WIDTH = 2**18  # hidden_size (the largest published models are near 2**15)
MAX_LAYERS = 2048
MAX_HEADS = 2**14
MAX_VOCAB = 2**24
MAX_POSITIONS = 2**24


RopeType = Literal["linear", "llama3", "yarn"]


class RopeScaling(Strict):
    """RoPE scaling of a long-context llama-family model, as transformers computes it
    (``rope_scaling`` / ``rope_parameters`` of config.json): the inverse frequencies are rescaled,
    and for YaRN cos and sin are multiplied by an attention factor. ``linear`` divides every
    frequency by `factor`; ``llama3`` (Llama 3.1 and later) divides the low frequencies by
    `factor`, keeps the high ones and blends in between; ``yarn`` (Qwen2.5/Qwen3 long context)
    blends interpolation and extrapolation over a ramp set by `beta_fast` and `beta_slow`.
    Dynamic NTK and LongRoPE depend on the running sequence length and are refused."""

    rope_type: RopeType = Field(description="'linear', 'llama3' or 'yarn'.")
    factor: float | None = Field(None, gt=0, le=1e6, description="Context extension factor; yarn without it uses "
                                 "max_position_embeddings / original_max_position_embeddings.")
    original_max_position_embeddings: int | None = Field(
        None, ge=1, le=MAX_POSITIONS, description="llama3/yarn: the pre-training context length (transformers' "
        "default: max_position_embeddings).")
    low_freq_factor: float | None = Field(None, gt=0, le=1e6, description="llama3: wavelengths above original / "
                                          "low_freq_factor are scaled by factor.")
    high_freq_factor: float | None = Field(None, gt=0, le=1e6, description="llama3: wavelengths below original / "
                                           "high_freq_factor are kept.")
    attention_factor: float | None = Field(None, gt=0, le=1e3, description="yarn: cos/sin multiplier (default "
                                           "0.1 ln(factor) + 1, or from mscale and mscale_all_dim).")
    beta_fast: float | None = Field(None, gt=0, le=1e6, description="yarn: extrapolation bound of the ramp (32).")
    beta_slow: float | None = Field(None, gt=0, le=1e6, description="yarn: interpolation bound of the ramp (1).")
    mscale: float | None = Field(None, ge=0, le=1e3, description="yarn (DeepSeek style): attention factor numerator.")
    mscale_all_dim: float | None = Field(None, ge=0, le=1e3, description="yarn: attention factor denominator.")
    truncate: bool = Field(True, description="yarn: round the ramp's bounds to whole dimensions.")

    @model_validator(mode="after")
    def check_needed(self) -> RopeScaling:
        need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ()}
        missing = [f for f in need[self.rope_type] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"rope_type {self.rope_type!r} needs {', '.join(missing)}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:  # type: ignore[operator]
            raise ValueError(f"llama3 needs high_freq_factor ({self.high_freq_factor}) above low_freq_factor "
                             f"({self.low_freq_factor})")
        return self


class ModelSpec(Strict):
    """A decoder-only transformer, described by HF config field names."""

    name: str | None = Field(None, description="Preset name or file the spec came from (display only).")
    model_type: ModelType = Field(description="Architecture family: 'llama' or 'gpt'.")
    # Upper bounds are far beyond any published model; they keep every size the cost model and the
    # layout algebra derive finite and every loop over layers or heads short.
    hidden_size: int = Field(ge=1, le=MAX_WIDTH, description="Model width h.")
    num_hidden_layers: int = Field(ge=1, le=MAX_LAYERS, description="Number of decoder layers L.")
    num_attention_heads: int = Field(ge=1, le=MAX_HEADS, description="Query heads.")
    num_key_value_heads: int | None = Field(
        None, ge=1, le=MAX_HEADS, description="Key/value heads (grouped-query attention); defaults to num_attention_heads."
    )
    intermediate_size: int | None = Field(
        None, ge=1, le=4 * MAX_WIDTH, description="MLP inner width; required for llama, defaults to 4*hidden_size for gpt."
    )
    vocab_size: int = Field(ge=1, le=MAX_VOCAB, description="Vocabulary size V.")
    max_position_embeddings: int = Field(
        2048, ge=1, le=MAX_POSITIONS, description="Longest sequence; gpt learns this many positions."
    )
    tie_word_embeddings: bool | None = Field(
        None, description="LM head shares the embedding matrix; defaults to False for llama, True for gpt."
    )
    attention_bias: bool = Field(False, description="llama only: q/k/v projections carry a bias (Qwen2).")
    rms_norm_eps: float = Field(1e-5, gt=0, description="llama RMSNorm epsilon.")
    layer_norm_epsilon: float = Field(1e-5, gt=0, description="gpt LayerNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="llama rotary base.")
    rope_scaling: RopeScaling | None = Field(
        None, description="llama family: RoPE scaling for long context (Llama 3.1 'llama3', YaRN, linear); None: plain "
        "RoPE.")
    sliding_window: int | None = Field(
        None, ge=1, le=MAX_POSITIONS, description="llama family (Mistral): each position attends to the last "
        "sliding_window positions, itself included; None attends to all.")
    head_dim: int | None = Field(
        None, ge=1, le=MAX_WIDTH, description="Width of one attention head; defaults to hidden_size / "
        "num_attention_heads (Qwen3 sets its own: q_proj is num_attention_heads * head_dim wide).")
    qk_norm: QKNorm = Field(
        "none", description="llama family: RMSNorm of queries and keys before rotary: 'head' over each head's "
        "head_dim (Qwen3), 'proj' over the whole q and k projections (OLMoE); 'none' for neither.")
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; DeepSeek-MoE's structure). A layer is
    # sparse when `is_moe_layer` says so; its MLP is `num_experts` SwiGLU experts of width
    # `moe_intermediate_size`, of which a softmax router picks `num_experts_per_tok` per token, plus
    # an always-on shared expert of width `shared_expert_intermediate_size` when that is > 0.
    num_experts: int | None = Field(
        None, ge=1, le=MAX_HEADS, description="llama family: routed experts per sparse layer (HF num_local_experts, "
        "num_experts or n_routed_experts); None for a dense model.")
    num_experts_per_tok: int = Field(2, ge=1, le=MAX_HEADS, description="Experts the router picks per token (top-k).")
    moe_intermediate_size: int | None = Field(
        None, ge=1, le=4 * MAX_WIDTH, description="Width of one routed expert; defaults to intermediate_size (Mixtral).")
    shared_expert_intermediate_size: int = Field(
        0, ge=0, le=4 * MAX_WIDTH, description="Width of the always-on shared expert MLP (Qwen2-MoE; DeepSeek's "
        "n_shared_experts * moe_intermediate_size); 0 for none.")
    shared_expert_gate: bool = Field(False, description="The shared expert's output is scaled by a sigmoid gate "
                                     "(Qwen2-MoE).")
    norm_topk_prob: bool = Field(True, description="Renormalise the top-k routing weights to sum to 1 (Mixtral "
                                 "always does; Qwen and OLMoE configs say).")
    first_k_dense_replace: int = Field(0, ge=0, le=MAX_LAYERS, description="The first this many layers keep a dense "
                                       "MLP of intermediate_size (DeepSeek).")
    decoder_sparse_step: int = Field(1, ge=1, le=MAX_LAYERS, description="Layer i is sparse when (i+1) is a "
                                     "multiple of this (Qwen-MoE).")
    mlp_only_layers: tuple[int, ...] = Field((), max_length=MAX_LAYERS, description="Layers that keep a dense MLP "
                                             "(Qwen-MoE).")

    @model_validator(mode="before")
    @classmethod
    def fill_family_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("num_key_value_heads") is None and "num_attention_heads" in data:
            data["num_key_value_heads"] = data["num_attention_heads"]
        family = data.get("model_type")
        width = _as_int(data.get("hidden_size"))
        heads = _as_int(data.get("num_attention_heads"))
        if data.get("head_dim") is None and width is not None and heads and width % heads == 0:
            data["head_dim"] = width // heads
        if data.get("num_experts") is not None and data.get("moe_intermediate_size") is None:
            data["moe_intermediate_size"] = data.get("intermediate_size")
        if data.get("intermediate_size") is None and family == "gpt" and width is not None:
            data["intermediate_size"] = 4 * width
        if data.get("tie_word_embeddings") is None and family in ("llama", "gpt"):
            data["tie_word_embeddings"] = family == "gpt"
        return data

    @model_validator(mode="after")
    def check_heads_divide_width(self) -> ModelSpec:
        if self.head_dim is None:  # not given, and the default does not exist
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}; "
                "give head_dim where the model sets its own (Qwen3)")
        if self.model_type == "gpt" and self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ValueError(f"gpt models have heads of hidden_size / num_attention_heads; head_dim {self.head_dim} "
                             f"x {self.num_attention_heads} heads is not hidden_size {self.hidden_size}")
        return self

    @model_validator(mode="after")
    def check_moe(self) -> ModelSpec:
        moe_fields = ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_expert_gate",
                      "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers")
        if self.num_experts is None:
            given = [f for f in moe_fields if f in self.model_fields_set and getattr(self, f) != \
                     type(self).model_fields[f].default and f != "moe_intermediate_size"]
            if given:
                raise ValueError(f"{', '.join(given)} describe experts, but num_experts is not set")
            return self
        if self.model_type != "llama":
            raise ValueError("mixture-of-experts layers apply to llama-family models only (Mixtral, Qwen-MoE, OLMoE)")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")
        bad = [i for i in self.mlp_only_layers if i >= self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} are beyond the model's {self.num_hidden_layers} layers")
        if not any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            raise ValueError("num_experts is set but no layer is sparse (first_k_dense_replace, decoder_sparse_step "
                             "and mlp_only_layers leave every layer dense)")
        return self

    @model_validator(mode="after")
    def check_kv_heads_group_queries(self) -> ModelSpec:
        kv = self.num_key_value_heads
        if kv is None or self.num_attention_heads % kv:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_key_value_heads {kv}"
            )
        if self.model_type == "gpt" and kv != self.num_attention_heads:
            raise ValueError("gpt models use multi-head attention: num_key_value_heads must equal num_attention_heads")
        return self

    @model_validator(mode="after")
    def check_intermediate_given(self) -> ModelSpec:
        if self.intermediate_size is None:
            raise ValueError("intermediate_size is required for llama models")
        return self

    @model_validator(mode="after")
    def check_window_family(self) -> ModelSpec:
        if self.sliding_window is not None and self.model_type != "llama":
            raise ValueError("sliding_window applies to llama-family models only (Mistral)")
        if self.rope_scaling is not None and self.model_type != "llama":
            raise ValueError("rope_scaling applies to llama-family models only (gpt learns its positions)")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "yarn" and self.rope_theta <= 1:
            raise ValueError(f"yarn RoPE scaling needs rope_theta above 1 (its ramp divides by log(rope_theta)), "
                             f"got {self.rope_theta}")
        return self

    @property
    def rope_original_positions(self) -> int:
        """The context RoPE scaling counts from (transformers' default: max_position_embeddings)."""
        r = self.rope_scaling
        return (r.original_max_position_embeddings if r is not None and r.original_max_position_embeddings
                else self.max_position_embeddings)

    @model_validator(mode="after")
    def check_qk_norm_family(self) -> ModelSpec:
        if self.qk_norm != "none" and self.model_type != "llama":
            raise ValueError("qk_norm applies to llama-family models only (Qwen3, OLMoE)")
        return self

    @model_validator(mode="after")
    def check_bias_family(self) -> ModelSpec:
        if self.attention_bias and self.model_type != "llama":
            raise ValueError("attention_bias applies to llama models only (gpt always has biases)")
        return self

    # Derived sizes -------------------------------------------------------------------------

    @property
    def d_head(self) -> int:
        assert self.head_dim is not None  # filled by the validator
        return self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer `i` has a sparse (mixture-of-experts) MLP."""
        return self.num_experts is not None and _sparse_layers(self)[i]

    @property
    def moe_layers(self) -> int:
        """Decoder layers with a sparse MLP."""
        return sum(_sparse_layers(self)) if self.num_experts is not None else 0

    @property
    def hf_model_type(self) -> str:
        """The transformers family that computes this model, as planner writes it (`planner
        save-hf`) and HF engines run it: gpt2; for mixtures of experts qwen3_moe (per-head q/k
        norm), olmoe (whole-projection q/k norm), qwen2_moe (a shared expert), else mixtral; else
        mistral (a sliding window) or llama."""
        if self.model_type == "gpt":
            return "gpt2"
        if self.is_moe:
            if self.qk_norm == "head":
                return "qwen3_moe"
            if self.qk_norm == "proj":
                return "olmoe"
            return "qwen2_moe" if self.shared_expert_intermediate_size else "mixtral"
        return "mistral" if self.sliding_window is not None else "llama"

    @property
    def experts(self) -> int:
        """Routed experts per sparse layer (0 for a dense model)."""
        return self.num_experts or 0

    @property
    def expert_ffn(self) -> int:
        """Width of one routed expert."""
        return self.moe_intermediate_size or self.ffn_size

    @property
    def kv_heads(self) -> int:
        assert self.num_key_value_heads is not None  # filled by the validator
        return self.num_key_value_heads

    @property
    def ffn_size(self) -> int:
        assert self.intermediate_size is not None  # filled by the validator
        return self.intermediate_size

    @property
    def tied(self) -> bool:
        return bool(self.tie_word_embeddings)

    def num_params(self, head: Head = "lm") -> int:
        """Exact parameter count: the sum of `plans.sharding.parameters` over the catalog."""
        from plans.sharding import parameters  # local: sharding imports this module

        return sum(p.numel for p in parameters(self, head=head))

    def active_params(self, head: Head = "lm") -> int:
        """Parameters one token uses: every tensor but the routed experts, of which only
        `num_experts_per_tok` of `num_experts` per sparse layer (the "A3B" of Qwen3-30B-A3B)."""
        from plans.sharding import parameters

        total = 0
        for p in parameters(self, head=head):
            total += p.numel * self.num_experts_per_tok // self.experts if p.expert_dim is not None else p.numel
        return total

    def display_name(self) -> str:
        if self.name:
            return self.name
        return f"{self.model_type}-h{self.hidden_size}-l{self.num_hidden_layers}"


@lru_cache(maxsize=1024)
def _sparse_layers(spec: ModelSpec) -> tuple[bool, ...]:
    return tuple(i >= spec.first_k_dense_replace and (i + 1) % spec.decoder_sparse_step == 0 and
                 i not in spec.mlp_only_layers for i in range(spec.num_hidden_layers))


def _as_int(value: Any) -> int | None:
    """`value` as an int when it plainly is one (an int or a string of digits), else None, so a
    default derived from it is left out and the field's own check reports the bad value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit() and len(value.strip()) <= 18:
        return int(value)
    return None


def _llama(name: str, h: int, layers: int, heads: int, kv: int, ffn: int, vocab: int, pos: int, **kw: Any) -> ModelSpec:
    return ModelSpec(
        name=name, model_type="llama", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab, max_position_embeddings=pos, **kw,
    )


def _gpt(name: str, h: int, layers: int, heads: int, vocab: int = 50257, pos: int = 2048) -> ModelSpec:
    return ModelSpec(
        name=name, model_type="gpt", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
        vocab_size=vocab, max_position_embeddings=pos,
    )


_LLAMA31 = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)

# Published configurations (HF config.json of each model; GPT-3 from Brown et al. 2020, Table 2.1,
# with the head count that divides the width where the table's d_head does not).
PRESETS: dict[str, ModelSpec] = {
    s.name: s  # type: ignore[misc]
    for s in [
        _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, 4096),
        _llama("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, 4096),
        _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 32000, 4096),
        _llama("codellama-34b", 8192, 48, 64, 8, 22016, 32000, 16384, rope_theta=1e6),
        _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 8192, rope_theta=5e5),
        _llama("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, 8192, rope_theta=5e5),
        # Llama 3.1 (and "Llama 3 405B", which only exists as 3.1): 128k context by llama3 RoPE scaling.
        _llama("llama-3-405b", 16384, 126, 128, 8, 53248, 128256, 131072, rope_theta=5e5, rope_scaling=_LLAMA31),
        _llama("mistral-7b-v0.1", 4096, 32, 32, 8, 14336, 32000, 32768, sliding_window=4096),
        _llama("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, 131072, rope_theta=5e5, rope_scaling=_LLAMA31),
        _llama("llama-3.1-70b", 8192, 80, 64, 8, 28672, 128256, 131072, rope_theta=5e5, rope_scaling=_LLAMA31),
        _llama("llama-3.1-405b", 16384, 126, 128, 8, 53248, 128256, 131072, rope_theta=5e5, rope_scaling=_LLAMA31),
        _llama("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, 32768, attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6),
        _llama("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, 32768, attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6),
        _llama("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, 32768, attention_bias=True, rope_theta=1e6, rms_norm_eps=1e-6),
        # Qwen3 dense (HF config.json): per-head RMSNorm of q and k, no QKV bias, untied head.
        _llama("qwen3-8b", 4096, 36, 32, 8, 12288, 151936, 40960, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=128,
               qk_norm="head"),
        _llama("qwen3-32b", 5120, 64, 64, 8, 25600, 151936, 40960, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=128,
               qk_norm="head"),
        # Mixtures of experts (HF config.json of each).
        _llama("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, 32768, rope_theta=1e6, num_experts=8,
               num_experts_per_tok=2),
        _llama("mixtral-8x22b", 6144, 56, 48, 8, 16384, 32768, 65536, rope_theta=1e6, num_experts=8,
               num_experts_per_tok=2),
        _llama("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 151936, 40960, rope_theta=1e6, rms_norm_eps=1e-6, head_dim=128,
               qk_norm="head", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
        _llama("qwen3-235b-a22b", 4096, 94, 64, 4, 12288, 151936, 40960, rope_theta=1e6, rms_norm_eps=1e-6,
               head_dim=128, qk_norm="head", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536,
               norm_topk_prob=True),
        _llama("qwen1.5-moe-a2.7b", 2048, 24, 16, 16, 5632, 151936, 8192, rope_theta=1e6, rms_norm_eps=1e-6,
               attention_bias=True, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
               shared_expert_intermediate_size=5632, shared_expert_gate=True, norm_topk_prob=False),
        _llama("olmoe-1b-7b", 2048, 16, 16, 16, 1024, 50304, 4096, qk_norm="proj", num_experts=64,
               num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=False),
        _gpt("gpt3-1.3b", 2048, 24, 16),
        _gpt("gpt3-2.7b", 2560, 32, 32),
        _gpt("gpt3-6.7b", 4096, 32, 32),
        _gpt("gpt3-13b", 5120, 40, 40),
        _gpt("gpt3-175b", 12288, 96, 96),
        # Tiny models for CPU tests and examples: every degree up to 4 divides their heads,
        # kv heads, layers and vocabulary.
        _llama("tiny-llama", 64, 4, 8, 4, 128, 256, 128),
        # Tiny mixtures of experts: 4 experts (ep up to 4), Mixtral-style and Qwen-MoE-style (a
        # gated shared expert, one dense layer, un-normalised top-k).
        _llama("tiny-mixtral", 64, 4, 8, 4, 128, 256, 128, num_experts=4, num_experts_per_tok=2),
        _llama("tiny-qwen-moe", 64, 4, 8, 4, 128, 256, 128, attention_bias=True, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, shared_expert_intermediate_size=64, shared_expert_gate=True,
               norm_topk_prob=False, mlp_only_layers=(0,)),
        _gpt("tiny-gpt", 64, 4, 4, vocab=256, pos=128),
    ]
}


# HF model_type -> (our family, field renames, fixed values)
_HF_FAMILIES: dict[str, tuple[ModelType, dict[str, str], dict[str, Any]]] = {
    "llama": ("llama", {}, {}),
    "mistral": ("llama", {}, {}),
    "qwen2": ("llama", {}, {"attention_bias": True}),
    "mixtral": ("llama", {"num_local_experts": "num_experts"}, {"norm_topk_prob": True}),
    "qwen2_moe": ("llama", {"qkv_bias": "attention_bias"}, {"shared_expert_gate": True}),
    "qwen3_moe": ("llama", {"num_local_experts": "num_experts"}, {"qk_norm": "head"}),
    "olmoe": ("llama", {}, {"qk_norm": "proj"}),
    "gpt2": (
        "gpt",
        {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
         "n_inner": "intermediate_size", "n_positions": "max_position_embeddings"},
        {},
    ),
    "gpt": ("gpt", {}, {}),
}

# Config fields that change a model's math, per HF family, with the values this planner computes
# exactly. Any other value is refused with an error naming the field: nothing that changes the math
# is silently ignored. (Dropout is not among them: the runtime never applies it, as RLHF trainers
# (TRL, OpenRLHF, verl) disable it; training without dropout is stated in the README.)
_LLAMA_EXACT: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"), "mlp_bias": (False, None), "use_sliding_window": (False, None),
    "partial_rotary_factor": (1, 1.0, None),
}
_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
_EXACT: dict[str, dict[str, tuple[Any, ...]]] = {
    "llama": _LLAMA_EXACT, "mistral": _LLAMA_EXACT, "qwen2": _LLAMA_EXACT,
    "mixtral": {**_LLAMA_EXACT, "router_jitter_noise": (0, 0.0, None)},
    "qwen2_moe": _LLAMA_EXACT, "qwen3_moe": _LLAMA_EXACT,
    "olmoe": {**_LLAMA_EXACT, "clip_qkv": (None,)},
    "gpt2": {"activation_function": ("gelu_new", "gelu_pytorch_tanh"), "scale_attn_weights": (True, None),
             "scale_attn_by_inverse_layer_idx": (False, None), "add_cross_attention": (False, None)},
    "gpt": {},
}


def _refuse(source: str, field: str, value: Any, why: str) -> PlannerError:
    return PlannerError(f"{source}: config field {field} = {brief(value)} {why}; planner would compute another "
                        "model", hint="planner computes llama/mistral/qwen2/gpt2 and mixtral/qwen2_moe/qwen3_moe/olmoe "
                        "models as transformers does with "
                        "their default values of this field; convert the model or change the field if it is wrong")


_ROPE_KEYS = frozenset(RopeScaling.model_fields) - {"rope_type"}


def _rope_fields(config: dict[str, Any], *, source: str) -> dict[str, Any]:
    """``rope_theta`` and ``rope_scaling`` of a config written by transformers 4 (``rope_theta``,
    ``rope_scaling``) or 5 (``rope_parameters``). Linear, llama3 and YaRN scaling are computed;
    dynamic NTK and LongRoPE (which change with the running length) are refused, naming them."""
    params = config.get("rope_parameters")
    scaling = config.get("rope_scaling")
    out: dict[str, Any] = {}
    if config.get("rope_theta") is not None:
        out["rope_theta"] = config["rope_theta"]
    where, given = "rope_scaling", scaling
    if params is not None:
        if not isinstance(params, dict):
            raise _refuse(source, "rope_parameters", params, "is not a mapping")
        if params.get("rope_theta") is not None:
            out["rope_theta"] = params["rope_theta"]
        where, given = "rope_parameters", {k: v for k, v in params.items() if k != "rope_theta"}
    if given is None:
        return out
    if not isinstance(given, dict):
        raise _refuse(source, where, given, "is not a mapping")
    kind = given.get("rope_type", given.get("type", "default"))
    if kind in (None, "default"):
        return out
    if kind not in ("linear", "llama3", "yarn"):
        raise _refuse(source, f"{where}.rope_type", kind, "(RoPE scaling that changes with the running sequence "
                      "length) is not supported; linear, llama3 and yarn are")
    if given.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise _refuse(source, f"{where}.partial_rotary_factor", given["partial_rotary_factor"],
                      "(rotary embedding of part of each head) is not supported")
    rope = {k: v for k, v in given.items() if k in _ROPE_KEYS and v is not None}
    if "original_max_position_embeddings" in config:  # Phi-3 style: outside the rope dict, and it wins
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    out["rope_scaling"] = {"rope_type": kind, **rope}
    return out


def _exact_fields(config: dict[str, Any], hf_type: str, *, source: str) -> dict[str, Any]:
    """Check the math-changing fields of `config`; the spec fields they imply."""
    for field, allowed in _EXACT[hf_type].items():
        if field in config and config[field] not in allowed:
            raise _refuse(source, field, config[field], f"is not supported (supported: {', '.join(map(repr, allowed))})")
    out: dict[str, Any] = {}
    if hf_type in ("llama", "mistral", "qwen2", *_MOE_FAMILIES):
        out.update(_rope_fields(config, source=source))
        heads, width, head_dim = config.get("num_attention_heads"), config.get("hidden_size"), config.get("head_dim")
        if hf_type != "qwen3_moe" and head_dim is not None and isinstance(heads, int) and isinstance(width, int) \
                and heads > 0 and head_dim * heads != width:
            raise _refuse(source, "head_dim", head_dim, f"differs from hidden_size / num_attention_heads "
                          f"({width} / {heads}); separate head dims are not supported yet")
        types = config.get("layer_types")
        if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
            raise _refuse(source, "layer_types", types, "mixes attention kinds per layer, which is not supported yet")
        window = config.get("sliding_window") if hf_type in ("mistral", "mixtral") else None
        if window is not None:
            out["sliding_window"] = window
    return out


def spec_from_hf_config(config: dict[str, Any], *, source: str) -> ModelSpec:
    """Build a spec from an HF ``config.json`` dict: the fields the planner models, each computed
    exactly as transformers does, or a `PlannerError` naming a field whose value it cannot honour
    (RoPE scaling, another activation, per-layer attention kinds, ...). Fields that do not change
    the math (token ids, ``torch_dtype``, ``use_cache``, ...) are not needed."""
    hf_type = config.get("model_type")
    if hf_type in ("deepseek_v2", "deepseek_v3") and config.get("kv_lora_rank") is not None:
        raise PlannerError(
            f"{source}: model_type {hf_type!r} uses multi-head latent attention (kv_lora_rank = "
            f"{brief(config.get('kv_lora_rank'))}), which planner does not compute yet",
            hint="its mixture-of-experts structure can be planned with inline fields: model_type=llama, num_experts, "
                 "num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size (n_shared_experts x "
                 "moe_intermediate_size), first_k_dense_replace, with grouped-query attention in place of MLA")
    if not isinstance(hf_type, str) or hf_type not in _HF_FAMILIES:
        raise PlannerError(
            f"{source}: model_type {hf_type!r} is not supported",
            hint=f"supported model_type values: {', '.join(sorted(_HF_FAMILIES))}",
        )
    family, renames, fixed = _HF_FAMILIES[hf_type]
    fields = set(ModelSpec.model_fields) - {"name", "model_type", "sliding_window", "rope_scaling"}
    data: dict[str, Any] = {"model_type": family, "name": source}
    for key, value in config.items():
        key = renames.get(key, key)
        if key in fields and value is not None:
            data[key] = value
    data.update(_exact_fields(config, hf_type, source=source))
    data.update(fixed)
    if hf_type == "qwen2_moe":
        data.setdefault("attention_bias", True)  # Qwen2-MoE's q/k/v carry biases unless qkv_bias says not
        data["norm_topk_prob"] = bool(config.get("norm_topk_prob", False))
    if hf_type in ("qwen3_moe", "olmoe"):
        data["norm_topk_prob"] = bool(config.get("norm_topk_prob", False))
    if hf_type == "olmoe":  # OLMoE's intermediate_size is the width of each expert (every layer is sparse)
        data["moe_intermediate_size"] = data.get("intermediate_size")
    if hf_type in ("qwen2_moe", "qwen3_moe") and "num_experts_per_tok" not in config:
        data["num_experts_per_tok"] = {"qwen2_moe": 4, "qwen3_moe": 8}[hf_type]  # transformers' defaults
    if hf_type == "olmoe" and "num_experts_per_tok" not in config:
        data["num_experts_per_tok"] = 8
    return _validated(data, source=source)


def _validated(data: dict[str, Any], *, source: str) -> ModelSpec:
    return validated(ModelSpec, data, source=source)


_INLINE_LISTS = ("mlp_only_layers",)


def _parse_inline(text: str) -> ModelSpec:
    data: dict[str, Any] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PlannerError(f"model spec {text!r}: {item!r} is not key=value")
        v = value.strip()
        if key.strip() in _INLINE_LISTS:  # layer lists are ;-separated inline: mlp_only_layers=0;3
            data[key.strip()] = [x.strip() for x in v.strip("()[]").split(";") if x.strip()]
            continue
        data[key.strip()] = {"true": True, "false": False}.get(v.lower(), v)
    return _validated(data, source=f"model spec {text!r}")


def weights_directory(spec: Any) -> str | None:
    """The absolute path of `spec` when it names a local HF model directory holding weights
    (``config.json`` and ``*.safetensors``): the model starts from those weights. None for a
    preset, a config.json file, inline fields or a directory without weights (random init)."""
    if not isinstance(spec, str) or "=" in spec or spec.strip() in PRESETS:
        return None
    try:
        path = Path(spec.strip())
        if path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return str(path.resolve())
    except (OSError, ValueError):
        return None
    return None


def resolve_model(spec: str | ModelSpec | dict[str, Any]) -> ModelSpec:
    """Turn a preset name, a config.json path, inline ``key=value`` fields or a dict into a spec."""
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, dict):
        return _validated(spec, source="model spec")
    if not isinstance(spec, str):
        raise PlannerError(
            f"model spec must be a preset name, a config.json path, inline fields, a dict or a ModelSpec; "
            f"got a {type(spec).__name__}"
        )
    text = spec.strip()
    if text in PRESETS:
        return PRESETS[text]
    if "=" in text:
        return _parse_inline(text)
    try:
        path = Path(text)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise PlannerError(f"model directory {text!r} has no config.json",
                                   hint="point at an HF model directory or its config.json")
            path = path / "config.json"
        is_file = path.is_file()
    except (OSError, ValueError) as e:  # a name too long for the file system, or with a NUL byte
        raise PlannerError(f"model spec {text[:200]!r} is neither a preset nor a usable path: {e}") from None
    if path.suffix == ".json" or is_file:
        if not is_file:
            raise PlannerError(f"model config file {text!r} does not exist")
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PlannerError(f"model config {brief(text)} is not readable JSON: {e}") from None
        config = loads_json(raw, source=f"model config {brief(text)}")
        if not isinstance(config, dict):
            raise PlannerError(f"model config {text!r} must hold a JSON object")
        return spec_from_hf_config(config, source=text)
    raise PlannerError(
        f"unknown model {text[:200]!r}",
        hint=f"use a preset ({', '.join(PRESETS)}), a config.json path, or inline fields "
        "like model_type=llama,hidden_size=4096,...",
    )
