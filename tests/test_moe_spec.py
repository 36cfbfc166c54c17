"""Mixture-of-experts specs: HF configs in, exact parameter counts out, clear refusals.

Counts are checked against transformers' own models of the same config (instantiated on the meta
device, so nothing is allocated) and against the totals and active counts the model cards
publish.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from cost_models.transfer import rank_volumes
from plans.errors import PlannerError
from plans.layout import Layout, Mesh
from plans.model import PRESETS, ModelSpec, resolve_model, spec_from_hf_config
from plans.runnable import expert_layout_problems
from plans.sharding import box_numel, layout_problems, parameters, shard_box, transfer_plan, transfer_volume

# Model cards: (total, active) parameters in billions as published.
PUBLISHED = {
    "mixtral-8x7b": (46.7, 12.9),  # mistral.ai, "Mixtral of experts" (2023)
    "mixtral-8x22b": (141.0, 39.0),  # mistral.ai, "Cheaper, better, faster, stronger" (2024)
    "qwen3-30b-a3b": (30.5, 3.3),  # Qwen/Qwen3-30B-A3B model card
    "qwen3-235b-a22b": (235.0, 22.0),  # Qwen/Qwen3-235B-A22B model card
    "qwen1.5-moe-a2.7b": (14.3, 2.7),  # Qwen/Qwen1.5-MoE-A2.7B model card
    "olmoe-1b-7b": (6.9, 1.3),  # allenai/OLMoE-1B-7B-0924 model card ("1B active, 7B total": 1.3B, 6.9B)
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_counts_match_the_published_ones(name: str) -> None:
    spec = PRESETS[name]
    total, active = PUBLISHED[name]
    assert spec.num_params() / 1e9 == pytest.approx(total, rel=0.01)
    assert spec.active_params() / 1e9 == pytest.approx(active, rel=0.01 if active >= 10 else 0.035)


def _hf_config(spec: ModelSpec) -> transformers.PretrainedConfig:
    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
                  num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.kv_heads,
                  max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tied,
                  num_experts_per_tok=spec.num_experts_per_tok)
    if spec.qk_norm == "head":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=spec.ffn_size, head_dim=spec.d_head,
                                           num_experts=spec.experts, moe_intermediate_size=spec.expert_ffn,
                                           norm_topk_prob=spec.norm_topk_prob)
    if spec.qk_norm == "proj":
        return transformers.OlmoeConfig(**common, intermediate_size=spec.expert_ffn, num_experts=spec.experts)
    if spec.shared_expert_intermediate_size:
        return transformers.Qwen2MoeConfig(**common, intermediate_size=spec.ffn_size, num_experts=spec.experts,
                                           moe_intermediate_size=spec.expert_ffn, mlp_only_layers=list(spec.mlp_only_layers),
                                           shared_expert_intermediate_size=spec.shared_expert_intermediate_size)
    return transformers.MixtralConfig(**common, intermediate_size=spec.expert_ffn, num_local_experts=spec.experts)


@pytest.mark.parametrize("name", [*sorted(PUBLISHED), "tiny-mixtral", "tiny-qwen-moe"])
def test_counts_equal_transformers_models_of_the_same_config(name: str, tmp_path) -> None:
    spec = PRESETS[name]
    config = _hf_config(spec)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.num_params() == sum(p.numel() for p in model.parameters())
    # The config.json transformers writes reads back as the same model.
    config.save_pretrained(tmp_path)
    back = resolve_model(str(tmp_path))
    assert back.model_dump(exclude={"name", "rope_theta", "rms_norm_eps", "max_position_embeddings"}) == \
        spec.model_dump(exclude={"name", "rope_theta", "rms_norm_eps", "max_position_embeddings"})


def test_inline_moe_fields_and_their_checks() -> None:
    base = "model_type=llama,hidden_size=64,num_hidden_layers=4,num_attention_heads=8,intermediate_size=128,vocab_size=256"
    spec = resolve_model(base + ",num_experts=8,num_experts_per_tok=2,moe_intermediate_size=32,first_k_dense_replace=1")
    assert [spec.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert spec.moe_layers == 3
    with pytest.raises(PlannerError, match="num_experts_per_tok 9 exceeds num_experts 8"):
        resolve_model(base + ",num_experts=8,num_experts_per_tok=9")
    with pytest.raises(PlannerError, match="describe experts, but num_experts is not set"):
        resolve_model(base + ",shared_expert_intermediate_size=64")
    with pytest.raises(PlannerError, match="no layer is sparse"):
        resolve_model(base + ",num_experts=4,first_k_dense_replace=4")
    with pytest.raises(PlannerError, match="llama-family models only"):
        resolve_model("model_type=gpt,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,vocab_size=256,num_experts=4")


def test_deepseek_attention_is_refused_by_name() -> None:
    config = json.loads(transformers.DeepseekV3Config(num_hidden_layers=2).to_json_string())
    with pytest.raises(PlannerError, match="multi-head latent attention") as e:
        spec_from_hf_config(config, source="config.json")
    assert "first_k_dense_replace" in e.value.hint


def test_mixtral_router_noise_is_refused() -> None:
    config = json.loads(transformers.MixtralConfig(num_hidden_layers=2).to_json_string())
    assert spec_from_hf_config(config, source="c").experts == 8
    with pytest.raises(PlannerError, match="config field router_jitter_noise = 0.1"):
        spec_from_hf_config({**config, "router_jitter_noise": 0.1}, source="c")


def test_the_runtime_says_which_expert_splits_it_does_not_run_yet() -> None:
    spec = PRESETS["tiny-mixtral"]
    assert expert_layout_problems(spec, Layout(dp=2, tp=2, ep=2, etp=2)) == []
    assert "etp=1 with tp=2" in expert_layout_problems(spec, Layout(dp=2, tp=2, ep=2))[0]
    assert "ZeRO 1 with expert parallel" in expert_layout_problems(spec, Layout(dp=4, ep=2, zero=1))[0]
    assert expert_layout_problems(PRESETS["tiny-llama"], Layout(dp=2, tp=2)) == []  # dense: nothing to split


def test_expert_parallel_shards_partition_every_expert_tensor() -> None:
    spec = PRESETS["tiny-qwen-moe"]
    for layout in (Layout(dp=4, ep=4), Layout(dp=2, tp=2, ep=2, etp=2), Layout(dp=2, tp=2, ep=4),
                   Layout(dp=4, ep=2, zero=3), Layout(dp=2, tp=2, ep=2, zero=3)):
        assert layout_problems(spec, layout) == []
        for p in parameters(spec):
            held = [shard_box(p, spec, layout, r) for r in range(layout.size)]
            copies = sum(box_numel(b) for b in held if b is not None)
            if p.expert_dim is not None:
                # each expert element on exactly edp ranks, or once under ZeRO-3
                assert copies == p.numel * (1 if layout.zero == 3 else layout.edp), (layout.short(), p.name)
    assert layout_problems(spec, Layout(dp=8, ep=8)) == ["ep=8 does not divide num_experts=4"]
    assert "expert parallelism needs" in layout_problems(PRESETS["tiny-llama"], Layout(dp=2, ep=2))[0]


@pytest.mark.parametrize(("src", "dst"), [
    ((0, 4, Layout(dp=4, ep=4)), (0, 4, Layout(dp=2, tp=2, ep=2, etp=2))),
    ((0, 4, Layout(dp=2, tp=2, ep=4)), (0, 2, Layout(dp=2, ep=2, zero=3))),
    ((0, 4, Layout(dp=2, pp=2, ep=2)), (4, 4, Layout(dp=4, ep=4, zero=3))),
    ((0, 2, Layout(tp=2)), (0, 4, Layout(dp=4, ep=2))),
])
def test_moving_experts_between_layouts_sends_what_the_plan_counts(src, dst) -> None:
    spec = PRESETS["tiny-qwen-moe"]
    src = (Mesh.block(src[0], src[1]), src[2])
    dst = (Mesh.block(dst[0], dst[1]), dst[2])
    plan = transfer_plan(spec, head="lm", src=src, dst=dst, gpus_per_node=4)
    vol = transfer_volume(spec, head="lm", src=src, dst=dst, gpus_per_node=4)
    moved = sum(t.numel for t in plan if t.src != t.dst)
    assert moved == vol.moved_numel > 0
    assert sum(t.numel for t in plan if t.src == t.dst) == vol.local_numel
    fast = rank_volumes(spec, head="lm", src=src, dst=dst, gpus_per_node=4)
    assert fast.moved_numel == moved and fast.local_numel == vol.local_numel
    received = {}
    for t in plan:
        if t.src != t.dst:
            received[t.dst] = received.get(t.dst, 0) + t.numel
    for rank, n in received.items():
        i = rank - fast.first
        assert fast.recv_intra[i] + fast.recv_inter[i] == n
    # every destination rank ends with exactly its slices
    for local, rank in enumerate(dst[0].ranks):
        for p in parameters(spec):
            box = shard_box(p, spec, dst[1], local)
            need = box_numel(box) if box is not None else 0
            got = sum(t.numel for t in plan if t.dst == rank and t.param == p.name)
            assert got == need, (rank, p.name)


def test_layout_checks_expert_degrees() -> None:
    with pytest.raises(ValueError, match="etp=2 must be 1 or tp=1"):
        Layout(dp=2, etp=2)
    with pytest.raises(ValueError, match="does not divide the 2 ranks"):
        Layout(dp=2, ep=4)
    assert Layout(dp=4, tp=2, ep=8).edp == 1
    assert Layout(dp=4, tp=2, ep=2, etp=2).short() == "dp4 tp2 pp1 ep2 etp2"
