"""Pretrained weights from a local Hugging Face model directory, read slice by slice.

A model whose `plans.graph.ModelDecl.weights` names a directory (``config.json`` and one or more
``*.safetensors`` files, sharded ones listed by ``model.safetensors.index.json``) starts from
those weights. Each rank reads only the boxes its layout gives it (`plans.sharding.shard_box`)
through safetensors' lazy slices, so no rank materialises the whole model; calls on other
placements get their copies by reallocation, as for any model.

Names: the llama family (llama, mistral, qwen2) stores the catalog's own names. GPT-2 stores
``transformer.*`` names with `Conv1D` weights laid out [in, out] and q, k, v fused into one
``c_attn``: each of our tensors is a transposed (and, for q/k/v, column-offset) view of one HF
tensor, and a box of ours is read as the matching box of theirs.

A value head (``score.weight``) absent from the directory is initialised fresh (seeded, as any
parameter without weights): a critic starts from the actor's directory with a new value head, as
verl and OpenRLHF do. Any other missing tensor, a shape that differs, or a directory whose config
no longer describes the plan's model, is a `PlannerError` naming the file and tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plans.base import loads_json
from plans.errors import PlannerError
from plans.model import Head, ModelSpec, spec_from_hf_config
from plans.sharding import Box, Param, box_numel

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Source:
    """Where one of our tensors lives in the directory: HF key, stored transposed ([in, out]) or
    not, and the offset of our rows along the stored tensor's output dim (q/k/v of a fused c_attn)."""

    key: str
    transposed: bool = False
    offset: int = 0
    fused: bool = False  # one of several tensors stacked along the stored output dim (q, k, v of c_attn)
    per_expert: bool = False  # `key` holds "{e}": one stored tensor per expert of our stacked [E, ...] tensor


# Routed experts are stored one tensor per expert (the Hub's checkpoints, and what transformers'
# save_pretrained writes); Mixtral names its MLP block_sparse_moe and its projections w1 (gate),
# w3 (up), w2 (down).
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}


def _moe_sources(spec: ModelSpec, hf_type: str) -> dict[str, Source]:
    block, projs = _EXPERT_NAMES.get(hf_type, ("mlp", {n: n for n in ("gate_proj", "up_proj", "down_proj")}))
    out = {}
    for i in range(spec.num_hidden_layers):
        if not spec.is_moe_layer(i):
            continue
        ours, theirs = f"model.layers.{i}.mlp.", f"model.layers.{i}.{block}."
        out[f"{ours}gate.weight"] = Source(f"{theirs}gate.weight")
        for proj, stored in projs.items():
            out[f"{ours}experts.{proj}.weight"] = Source(f"{theirs}experts.{{e}}.{stored}.weight", per_expert=True)
    return out


def _gpt2_sources(spec: ModelSpec) -> dict[str, Source]:
    h = spec.hidden_size
    out = {"model.embed_tokens.weight": Source("transformer.wte.weight"),
           "model.embed_positions.weight": Source("transformer.wpe.weight"),
           "model.norm.weight": Source("transformer.ln_f.weight"), "model.norm.bias": Source("transformer.ln_f.bias"),
           "score.weight": Source("score.weight")}
    for i in range(spec.num_hidden_layers):
        ours, theirs = f"model.layers.{i}.", f"transformer.h.{i}."
        for n, key in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            out[f"{ours}{n}.weight"], out[f"{ours}{n}.bias"] = Source(f"{theirs}{key}.weight"), Source(f"{theirs}{key}.bias")
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            out[f"{ours}self_attn.{proj}.weight"] = Source(f"{theirs}attn.c_attn.weight", True, j * h, True)
            out[f"{ours}self_attn.{proj}.bias"] = Source(f"{theirs}attn.c_attn.bias", False, j * h, True)
        for n, key in (("self_attn.o_proj", "attn.c_proj"), ("mlp.up_proj", "mlp.c_fc"), ("mlp.down_proj", "mlp.c_proj")):
            out[f"{ours}{n}.weight"] = Source(f"{theirs}{key}.weight", True)
            out[f"{ours}{n}.bias"] = Source(f"{theirs}{key}.bias")
    return out


class HFWeights:
    """The safetensors of one HF model directory, opened lazily, read by box."""

    def __init__(self, directory: str | Path, *, spec: ModelSpec, head: Head, hf_type: str) -> None:
        from safetensors import safe_open  # the runtime's own dependency; imported where used

        self.directory, self.spec, self.head = Path(directory), spec, head
        self.sources = _gpt2_sources(spec) if hf_type == "gpt2" else _moe_sources(spec, hf_type) if spec.is_moe else {}
        self._open = safe_open
        self.files: dict[str, Any] = {}
        self.where = self._index()
        self.read_numel = 0  # elements read so far (what the tests measure against the shard's size)

    def _index(self) -> dict[str, str]:
        """HF key -> file name, from the index of a sharded checkpoint or each file's header."""
        index = self.directory / INDEX_NAME
        if index.is_file():
            data = loads_json(index.read_text(encoding="utf-8"), source=f"safetensors index {str(index)!r}")
            mapping = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(mapping, dict):
                raise PlannerError(f"safetensors index {str(index)!r} has no weight_map")
            return {str(k): str(v) for k, v in mapping.items()}
        files = sorted(p.name for p in self.directory.glob("*.safetensors"))
        if not files:
            raise PlannerError(f"model directory {str(self.directory)!r} has no *.safetensors weights",
                               hint="save the model with save_pretrained(..., safe_serialization=True)")
        out: dict[str, str] = {}
        for name in files:
            for key in self._file(name).keys():
                out[key] = name
        return out

    def _file(self, name: str) -> Any:
        if name not in self.files:
            path = self.directory / name
            try:
                self.files[name] = self._open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a malformed file
                raise PlannerError(f"cannot read weights file {str(path)!r}: {e}") from None
        return self.files[name]

    def source(self, param: Param) -> Source | None:
        """Where `param` is stored (None when the directory does not hold it)."""
        src = self.sources.get(param.name, Source(param.name))
        if (src.key.format(e=0) if src.per_expert else src.key) in self.where:
            return src
        if self.spec.model_type == "gpt" and src.key.startswith("transformer.") and src.key[12:] in self.where:
            return Source(src.key[12:], src.transposed, src.offset, src.fused)  # saved from GPT2Model: no prefix
        return None

    def has(self, param: Param) -> bool:
        return self.source(param) is not None

    def read(self, param: Param, box: Box) -> Tensor:
        """The `box` of `param` (our layout), fp32, reading only that slice from its file."""
        src = self.source(param)
        if src is None:
            raise PlannerError(f"model directory {str(self.directory)!r} has no tensor for {param.name}"
                               + (f" ({self.sources[param.name].key})" if param.name in self.sources else ""),
                               hint="is it a checkpoint of this architecture and head?")
        if src.per_expert:  # our box's experts, one stored tensor each, stacked
            lo, hi = box[0]
            one = Param(param.name, param.shape[1:], None, param.layer, param.where)
            pieces = [self._read_one(Source(src.key.format(e=e)), one, box[1:]) for e in range(lo, hi)]
            return torch.stack(pieces) if pieces else torch.empty((0, *(b - a for a, b in box[1:])))
        return self._read_one(src, param, box)

    def _read_one(self, src: Source, param: Param, box: Box) -> Tensor:
        if src.key not in self.where:
            raise PlannerError(f"model directory {str(self.directory)!r} has no tensor {src.key!r} for {param.name}",
                               hint="is it a checkpoint of this architecture and head?")
        part = self._file(self.where[src.key]).get_slice(src.key)
        stored = tuple(part.get_shape())
        want = tuple(reversed(param.shape)) if src.transposed else param.shape
        out_dim = len(want) - 1 if src.transposed else 0  # where our rows (and the offset) lie in theirs
        ok = len(stored) == len(want) and all(stored[d] == want[d] for d in range(len(want)) if d != out_dim) and \
            (stored[out_dim] >= src.offset + want[out_dim] if src.fused else stored[out_dim] == want[out_dim])
        if not ok:
            raise PlannerError(f"weights file {self.where[src.key]!r}: tensor {src.key!r} has shape {stored}, the "
                               f"model's {param.name} needs {param.shape}"
                               + (" (within a fused tensor)" if src.fused else ""),
                               hint="the directory's weights do not match its config.json")
        ours = [(lo + src.offset, hi + src.offset) if d == 0 else (lo, hi) for d, (lo, hi) in enumerate(box)]
        theirs = list(reversed(ours)) if src.transposed else ours
        piece = part[tuple(slice(lo, hi) for lo, hi in theirs)]
        self.read_numel += box_numel(box)
        return (piece.t() if src.transposed else piece).to(torch.float32).contiguous()


def open_weights(directory: str, *, spec: ModelSpec, head: Head) -> HFWeights:
    """The weights of `directory` for a model of `spec`: its config.json must still describe
    `spec` (a directory changed since the plan was compiled is refused)."""
    path = Path(directory)
    cfg = path / "config.json"
    try:
        config = loads_json(cfg.read_text(encoding="utf-8"), source=f"model config {str(cfg)!r}")
    except OSError as e:
        raise PlannerError(f"cannot read the weights of model directory {directory!r}: {e.strerror or e}",
                           hint="the plan names it (models.*.weights); run where it is, or recompile") from None
    if not isinstance(config, dict):
        raise PlannerError(f"model config {str(cfg)!r} must hold a JSON object")
    now = spec_from_hf_config(config, source=str(cfg))
    if now.model_dump(exclude={"name"}) != spec.model_dump(exclude={"name"}):
        raise PlannerError(f"model directory {directory!r} no longer holds the model the plan was compiled for "
                           "(its config.json differs)", hint="recompile the plan")
    return HFWeights(path, spec=spec, head=head, hf_type=str(config.get("model_type")))


# Writing: our whole tensors as an HF directory ------------------------------------------------

ARCHITECTURES = {  # (HF model_type, head) -> transformers class written into config.json
    ("llama", "lm"): "LlamaForCausalLM", ("llama", "value"): "LlamaForSequenceClassification",
    ("mistral", "lm"): "MistralForCausalLM", ("mistral", "value"): "MistralForSequenceClassification",
    ("qwen2", "lm"): "Qwen2ForCausalLM", ("qwen2", "value"): "Qwen2ForSequenceClassification",
    ("gpt2", "lm"): "GPT2LMHeadModel", ("gpt2", "value"): "GPT2ForSequenceClassification",
    ("mixtral", "lm"): "MixtralForCausalLM", ("mixtral", "value"): "MixtralForSequenceClassification",
    ("qwen2_moe", "lm"): "Qwen2MoeForCausalLM", ("qwen2_moe", "value"): "Qwen2MoeForSequenceClassification",
    ("qwen3_moe", "lm"): "Qwen3MoeForCausalLM", ("qwen3_moe", "value"): "Qwen3MoeForSequenceClassification",
    ("olmoe", "lm"): "OlmoeForCausalLM",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def hf_type_of(spec: ModelSpec, base: dict[str, Any] | None) -> str:
    """The HF ``model_type`` a model is written as: its directory's, else llama (mistral with a
    sliding window) or gpt2."""
    if base is not None and isinstance(base.get("model_type"), str):
        return str(base["model_type"])
    return spec.hf_model_type


def hf_config(spec: ModelSpec, *, head: Head, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of a model written in fp32: its own directory's (the same model), or one
    built from the spec with every field that changes the math set explicitly."""
    hf_type = hf_type_of(spec, base)
    if base is not None:
        cfg = dict(base)
    elif hf_type == "gpt2":
        cfg = {"model_type": "gpt2", "n_embd": spec.hidden_size, "n_layer": spec.num_hidden_layers,
               "n_head": spec.num_attention_heads, "n_inner": spec.ffn_size, "n_positions": spec.max_position_embeddings,
               "vocab_size": spec.vocab_size, "layer_norm_epsilon": spec.layer_norm_epsilon,
               "activation_function": "gelu_new", "tie_word_embeddings": spec.tied, "resid_pdrop": 0.0,
               "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True}
    else:
        cfg = {"model_type": hf_type, "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_hidden_layers,
               "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.kv_heads,
               "intermediate_size": spec.ffn_size, "vocab_size": spec.vocab_size,
               "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tied,
               "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta, "hidden_act": "silu"}
        if hf_type == "llama":
            cfg.update(attention_bias=spec.attention_bias, mlp_bias=False)
        if hf_type in ("mistral", "mixtral"):
            cfg["sliding_window"] = spec.sliding_window
        if spec.rope_scaling is not None:  # transformers 4's key, which transformers 5 reads too
            cfg["rope_scaling"] = spec.rope_scaling.model_dump(exclude_defaults=True)
        if spec.is_moe:
            cfg.update(num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=spec.norm_topk_prob,
                       output_router_logits=False)
            if hf_type == "mixtral":
                cfg.update(num_local_experts=spec.experts, intermediate_size=spec.expert_ffn, router_jitter_noise=0.0)
            elif hf_type == "olmoe":
                cfg.update(num_experts=spec.experts, intermediate_size=spec.expert_ffn, attention_bias=False,
                           clip_qkv=None)
            else:
                cfg.update(num_experts=spec.experts, moe_intermediate_size=spec.expert_ffn,
                           decoder_sparse_step=spec.decoder_sparse_step, mlp_only_layers=list(spec.mlp_only_layers),
                           use_sliding_window=False)
            if hf_type == "qwen2_moe":
                cfg.update(shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                           qkv_bias=spec.attention_bias)
            if hf_type == "qwen3_moe":
                cfg.update(head_dim=spec.d_head, attention_bias=spec.attention_bias)
    arch = ARCHITECTURES.get((hf_type, head))
    if arch is None:
        raise PlannerError(f"transformers has no {head} head for model_type {hf_type!r}, so this checkpoint cannot be "
                           "written as an HF directory", hint="save the model with the lm head")
    cfg["architectures"] = [arch]
    cfg.update(torch_dtype="float32", dtype="float32")
    if head == "value":
        cfg["num_labels"] = 1
        cfg.pop("id2label", None)
        cfg.pop("label2id", None)
    return cfg


def hf_tensors(spec: ModelSpec, state: dict[str, Tensor], *, hf_type: str) -> dict[str, Tensor]:
    """Our whole tensors (catalog names) under the names and layouts an HF directory stores."""
    if hf_type != "gpt2":
        sources = _moe_sources(spec, hf_type) if spec.is_moe else {}
        out_moe: dict[str, Tensor] = {}
        for n, t in state.items():
            src = sources.get(n, Source(n))
            if src.per_expert:
                out_moe.update({src.key.format(e=e): t[e].contiguous() for e in range(t.shape[0])})
            else:
                out_moe[src.key] = t.contiguous()
        return out_moe
    sources = _gpt2_sources(spec)
    out: dict[str, Tensor] = {}
    fused: dict[str, list[tuple[int, Tensor]]] = {}
    for name, t in state.items():
        src = sources[name]
        stored = t.t() if src.transposed else t
        if src.fused:
            fused.setdefault(src.key, []).append((src.offset, stored))
        else:
            out[src.key] = stored.contiguous()
    for key, parts in fused.items():  # q, k, v side by side along the stored output dim
        out[key] = torch.cat([p for _, p in sorted(parts, key=lambda x: x[0])], dim=parts[0][1].dim() - 1).contiguous()
    return out
