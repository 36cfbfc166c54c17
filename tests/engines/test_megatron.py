"""Megatron-LM accepts every export.

1. Always: megatron-core's own config classes (`TransformerConfig`, which is a
   `ModelParallelConfig`; megatron-core 0.16.1 from PyPI) are built from each command's flags the way
   Megatron-LM's `core_transformer_config_from_args` does (same-named fields; `--swiglu` is a gated
   linear unit, `--disable-bias-linear` clears `add_bias_linear`, `--norm-epsilon` is
   `layernorm_epsilon`), and their `__post_init__` checks pass.
2. When MEGATRON_LM_SRC names a Megatron-LM source tree (checked against tag core_v0.19.0, commit
   5be9626709af2722333bf54797c954c09edeada3): its `parse_args`, `validate_args` and
   `core_transformer_config_from_args` run on the command with the job's WORLD_SIZE and the
   command's environment (the tree's MoE ops import `triton`: install it in the engines venv for
   this part). Megatron-LM is not on PyPI, so CI skips this part and says so.
   Stubbed there: `get_device_arch_version` and `torch.cuda.get_device_capability` (they read the
   GPU; they return the plan's accelerator's compute capability), Transformer Engine's fused RoPE
   kernel (a GPU build; `TransformerConfig` only checks that it exists, as it does on any TE
   install, where rope fusion is the default)
   and, because that tag targets Python 3.12, `typing.override` on 3.11 (from typing_extensions).
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import exports, ids, load, plan_of, words

EXPORTS = exports("megatron")
MEGATRON_LM = os.environ.get("MEGATRON_LM_SRC")
ARCH = {"a100-80gb": 8, "a100-40gb": 8, "h100-sxm": 9, "h100-pcie": 9, "h200": 9, "b200": 10}


def commands(text: str) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, flags) of each pretrain_gpt.py command of an export."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    out = []
    for block in (b for b in body.split("\n\n") if b.strip()):
        argv = words(block)
        env = {}
        while "=" in argv[0] and not argv[0].startswith("-"):
            k, v = argv.pop(0).split("=", 1)
            env[k] = v
        assert argv[:3] == ["torchrun", "$DISTRIBUTED_ARGS", "pretrain_gpt.py"], argv[:3]
        out.append((env, argv[3:]))
    return out


def options(flags: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    i = 0
    while i < len(flags):
        name = flags[i][2:].replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[name] = flags[i + 1]
            i += 2
        else:
            out[name] = True
            i += 1
    return out


def core_config(o: dict[str, object]):  # noqa: ANN201
    import torch
    from megatron.core.transformer import TransformerConfig

    layers, pp = int(o["num_layers"]), int(o["pipeline_model_parallel_size"])
    vpp = None
    if "num_layers_per_virtual_pipeline_stage" in o:
        vpp = layers // (pp * int(o["num_layers_per_virtual_pipeline_stage"]))
    elif "num_virtual_stages_per_pipeline_rank" in o:
        vpp = int(o["num_virtual_stages_per_pipeline_rank"])
    kw = dict(
        num_layers=layers, hidden_size=int(o["hidden_size"]), ffn_hidden_size=int(o["ffn_hidden_size"]),
        num_attention_heads=int(o["num_attention_heads"]),
        num_query_groups=int(o["num_query_groups"]) if "num_query_groups" in o else None,
        tensor_model_parallel_size=int(o["tensor_model_parallel_size"]), pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=int(o["context_parallel_size"]),
        sequence_parallel=bool(o.get("sequence_parallel", False)), bf16=bool(o.get("bf16")),
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16 if pp > 1 else None,
        normalization=o["normalization"], layernorm_epsilon=float(o["norm_epsilon"]),
        gated_linear_unit=bool(o.get("swiglu", False)), add_bias_linear=not o.get("disable_bias_linear", False),
        add_qkv_bias=bool(o.get("add_qkv_bias", False)), hidden_dropout=float(o["hidden_dropout"]),
        attention_dropout=float(o["attention_dropout"]),
        recompute_granularity=o.get("recompute_granularity"), recompute_method=o.get("recompute_method"),
        recompute_num_layers=int(o["recompute_num_layers"]) if "recompute_num_layers" in o else None,
    )
    if "num_experts" in o:  # megatron-core's MoE checks (TransformerConfig.__post_init__)
        freq = o.get("moe_layer_freq")
        kw.update(num_moe_experts=int(o["num_experts"]), moe_router_topk=int(o["moe_router_topk"]),
                  moe_ffn_hidden_size=int(o["moe_ffn_hidden_size"]),
                  moe_layer_freq=[int(x) for x in str(freq).strip("[]").split(",")] if freq else 1,
                  moe_router_pre_softmax=bool(o.get("moe_router_pre_softmax", False)),
                  moe_token_dispatcher_type=o["moe_token_dispatcher_type"],
                  moe_grouped_gemm=bool(o.get("moe_grouped_gemm", False)),
                  expert_model_parallel_size=int(o["expert_model_parallel_size"]),
                  expert_tensor_parallel_size=int(o["expert_tensor_parallel_size"]))
        if "moe_shared_expert_intermediate_size" in o:
            kw["moe_shared_expert_intermediate_size"] = int(o["moe_shared_expert_intermediate_size"])
            kw["moe_shared_expert_gate"] = bool(o.get("moe_shared_expert_gate", False))
    if "kv_channels" in o:
        kw["kv_channels"] = int(o["kv_channels"])
    if "qk_layernorm" in o:
        kw["qk_layernorm"] = True
    if "window_size" in o:  # Megatron-LM's tuple_type: "(left,right)" or "left,right"
        kw["window_size"] = tuple(int(x) for x in str(o["window_size"]).strip("()").split(","))
    if "decoder_first_pipeline_num_layers" in o:
        kw["num_layers_in_first_pipeline_stage"] = int(o["decoder_first_pipeline_num_layers"])
    if kw["gated_linear_unit"]:
        kw["activation_func"] = torch.nn.functional.silu
    return TransformerConfig(**kw)


def _job(path):  # noqa: ANN001, ANN202
    doc = load(path)
    plan = plan_of(path)
    call = next(c for c in plan["calls"] if c["name"] == path.name.split(".")[2])
    return doc, plan, call


@pytest.mark.parametrize("path", EXPORTS, ids=ids(EXPORTS))
def test_megatron_core_configs_accept_each_export(path) -> None:  # noqa: ANN001
    doc, plan, call = _job(path)
    if "refused" in doc:
        # Refused: other losses, and the one pipeline split Megatron-LM cannot set (80 layers on 32 stages).
        assert call["loss"] != "sft" or ("pipeline stages of" in doc["refused"] and plan["name"] == "sft_70b_uneven_pp"), \
            doc["refused"]
        return
    assert call["loss"] == "sft"
    (env, flags), = commands(doc["text"])
    o = options(flags)
    cfg = core_config(o)
    lay = call["layout"]
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size) == \
        (lay["tp"], lay["pp"], lay["cp"])
    assert cfg.hidden_dropout == 0 and cfg.attention_dropout == 0
    spec = plan["models"][call["model"]]["spec"]
    if spec.get("num_experts"):
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.expert_model_parallel_size,
                cfg.expert_tensor_parallel_size) == (spec["num_experts"], spec["num_experts_per_tok"], lay["ep"],
                                                     lay["etp"])
    scaling = spec.get("rope_scaling")
    if scaling and scaling["rope_type"] == "llama3":  # Megatron-Core's llama3 scaling: only the factor is a flag
        assert "use_rope_scaling" in o and float(o["rope_scaling_factor"]) == scaling["factor"]
    if spec.get("sliding_window"):  # W positions, itself included: W-1 keys back, none ahead
        assert cfg.window_size == (spec["sliding_window"] - 1, 0)
    assert o["lr_decay_style"] == "constant"
    assert ("use_distributed_optimizer" in o) == (lay["zero"] in (1, 2))
    assert ("use_megatron_fsdp" in o) == (lay["zero"] == 3)
    assert "overlap_grad_reduce" in o  # the megatron-core stack the plan was costed for overlaps it
    seqs = call["seqs"] // call.get("minibatches", 1)
    assert int(o["global_batch_size"]) == seqs
    assert int(o["micro_batch_size"]) * lay["micro_batches"] * lay["dp"] == seqs


@pytest.mark.skipif(not MEGATRON_LM, reason="MEGATRON_LM_SRC is not set: Megatron-LM's parse_args/validate_args "
                    "(not on PyPI) not run; set it to a Megatron-LM tree at core_v0.19.0")
@pytest.mark.parametrize("path", EXPORTS, ids=ids(EXPORTS))
def test_megatron_lm_parses_and_validates_each_export(path, monkeypatch) -> None:  # noqa: ANN001
    doc, plan, call = _job(path)
    if "refused" in doc:
        return
    (env, flags), = commands(doc["text"])
    monkeypatch.syspath_prepend(MEGATRON_LM)
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)
    for k in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, k)  # the tree's megatron.core, not the wheel's
    import megatron.training.arguments as arguments

    assert os.path.realpath(arguments.__file__).startswith(os.path.realpath(MEGATRON_LM))
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: ARCH[plan["cluster"]["gpu"]])
    import torch

    # validate_args reads the GPU's compute capability for --moe-grouped-gemm.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (ARCH[plan["cluster"]["gpu"]], 0))
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", lambda *a, **k: None)
    world = len(call["mesh"]["ranks"])
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # What the export leaves to the user (its notes say so): data, tokenizer, run length.
    user = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--train-iters", "10"]
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *flags, *user])
    args = arguments.parse_args()
    arguments.validate_args(args, {})
    cfg = arguments.core_transformer_config_from_args(args)
    lay = call["layout"]
    assert args.data_parallel_size == lay["dp"] and args.overlap_grad_reduce
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size) == (lay["tp"], lay["pp"])
    assert cfg.hidden_dropout == 0 and cfg.attention_dropout == 0
    spec = plan["models"][call["model"]]["spec"]
    if spec.get("num_experts"):
        assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.expert_model_parallel_size,
                cfg.expert_tensor_parallel_size) == (spec["num_experts"], spec["num_experts_per_tok"], lay["ep"],
                                                     lay["etp"])
