"""Models from HF directories, weights included: the logits of transformers on the same weights,
under every layout on 4 gloo ranks, each rank reading only its own slices; config fields that
change the math are computed or refused by name.

The directories are made here with transformers (random weights, tiny sizes): llama, qwen2 (q/k/v
bias), mistral with a sliding window shorter than the sequence, and gpt2 (fused, transposed
Conv1D weights); llama also as a sharded checkpoint with an index, and with RoPE scaling (Llama
3.1's llama3, linear; qwen2 with YaRN).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from plans import Layout, Mesh, resolve_model
from plans.errors import PlannerError
from plans.model import spec_from_hf_config, weights_directory
from plans.sharding import box_numel, parameters, shard_box
from runtime.engine import ModelRunner
from runtime.groups import Groups, solo_groups
from runtime.weights import open_weights
from tests.machine import facts

transformers = pytest.importorskip("transformers")

WORLD = 4
TOL = 1e-5
SEQ = 12
WINDOW = 5  # mistral: shorter than SEQ, so the window cuts
LAYOUTS = [Layout(tp=4), Layout(pp=4), Layout(tp=2, pp=2), Layout(dp=2, tp=2, zero=3),
           Layout(dp=2, pp=2, micro_batches=2), Layout(tp=4, sequence_parallel=True), Layout(dp=4, zero=3)]
ROPE = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64},
        "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        "linear": {"rope_type": "linear", "factor": 2.0}}  # copied where transformers takes them: it fills in rope_theta
COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
              vocab_size=128, max_position_embeddings=64)


def make_models(root: Path) -> dict[str, Path]:
    """Tiny HF checkpoints of each supported family, saved with transformers."""
    configs = {
        "llama": transformers.LlamaConfig(**COMMON, rope_theta=5e5, rms_norm_eps=1e-6),
        "qwen2": transformers.Qwen2Config(**COMMON),
        "mistral": transformers.MistralConfig(**COMMON, sliding_window=WINDOW),
        # RoPE scaling: head_dim 8 at base 1e4 has wavelengths 6.3, 63, 628, 6283, so llama3's bounds
        # (64 / 4 and 64 / 1) keep one, blend one and scale two; YaRN's ramp spans them too.
        "llama31": transformers.LlamaConfig(**COMMON, rope_theta=1e4, rope_scaling=dict(ROPE["llama3"])),
        "qwen2_yarn": transformers.Qwen2Config(**COMMON, rope_theta=1e4, rope_scaling=dict(ROPE["yarn"])),
        "llama_linear": transformers.LlamaConfig(**COMMON, rope_scaling=dict(ROPE["linear"])),
        "gpt2": transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, vocab_size=128, n_positions=64,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    }
    for i, (name, cfg) in enumerate(configs.items()):
        torch.manual_seed(i)
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # norms and biases away from their initial 1 and 0, so every tensor matters
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
        model.save_pretrained(root / name)
    made = {name: root / name for name in configs}
    sharded = root / "llama_sharded"
    transformers.AutoModelForCausalLM.from_pretrained(made["llama"]).save_pretrained(sharded, max_shard_size="100KB")
    made["llama_sharded"] = sharded
    return made


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (4, SEQ), generator=torch.Generator().manual_seed(0))


def _hf_logprobs(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _runner(directory: Path, groups, *, layout: Layout) -> tuple[ModelRunner, object]:  # noqa: ANN001
    spec = resolve_model(str(directory))
    weights = open_weights(str(directory), spec=spec, head="lm")
    runner = ModelRunner(spec, head="lm", trainable=False, groups=groups, piece=weights.read,
                         device=torch.device("cpu"))
    return runner, weights


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("hf"))


def test_a_directory_spec_is_its_config_and_names_its_weights(models) -> None:
    spec = resolve_model(str(models["llama"]))
    assert spec.rope_theta == 5e5 and spec.rms_norm_eps == 1e-6 and spec.kv_heads == 4  # transformers 5 writes
    assert resolve_model(str(models["mistral"])).sliding_window == WINDOW               # rope_parameters
    assert resolve_model(str(models["qwen2"])).attention_bias
    assert weights_directory(str(models["llama"])) == str(models["llama"].resolve())
    assert weights_directory("tiny-llama") is None and weights_directory(str(models["llama"] / "config.json")) is None


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2", "llama_sharded", "llama31", "qwen2_yarn",
                                  "llama_linear"])
def test_one_process_logprobs_equal_transformers(models, name: str) -> None:
    tokens = _tokens()
    runner, weights = _runner(models[name], solo_groups(Layout()), layout=Layout())
    got = runner.forward(tokens, what="logprobs")
    want = _hf_logprobs(models[name], tokens)
    assert (got - want).abs().max().item() < TOL, facts()
    spec = resolve_model(str(models[name]))
    assert weights.read_numel == sum(p.numel for p in parameters(spec))  # each tensor read once


def _worker(rank: int, port: int, dirs: dict[str, str], out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups, mesh, tokens = Groups(distributed=True), Mesh.block(0, WORLD), _tokens()
    problems, checks = [], 0
    for name, directory in dirs.items():
        want = _hf_logprobs(Path(directory), tokens)
        spec = resolve_model(directory)
        for layout in LAYOUTS:
            case = f"{name} {layout.short()}"
            mine = groups.build(mesh, layout, rank=rank, tied=spec.tied)
            runner, weights = _runner(Path(directory), mine, layout=layout)
            got = runner.forward(tokens, what="logprobs")
            if runner.pipe.last:
                split = runner.split(tokens.shape[0])
                checks += 1
                diff = (got - want[split.start:split.stop]).abs().max().item()
                if diff > TOL:
                    problems.append(f"{case}: log-probs differ from transformers by {diff:.2e}")
            shard = sum(box_numel(b) for p in parameters(spec)
                        if (b := shard_box(p, spec, layout, mine.local)) is not None)
            checks += 1
            if weights.read_numel != shard:  # read exactly its own slices, nothing more
                problems.append(f"{case}: rank {rank} read {weights.read_numel} elements, its shard has {shard}")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems, "checks": checks}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_layout_on_four_ranks_reads_only_its_slices_and_equals_transformers(models, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dirs = {name: str(models[name]) for name in ("llama", "qwen2", "mistral", "gpt2", "llama_sharded")}
    mp.spawn(_worker, args=(port, dirs, str(tmp_path)), nprocs=WORLD, join=True)
    problems, checks = [], 0
    for rank in range(WORLD):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        problems += result["problems"]
        checks += result["checks"]
    assert not problems, "\n".join(problems[:30]) + "\n" + facts()
    assert checks >= len(dirs) * len(LAYOUTS) * (WORLD + 1)


@pytest.mark.parametrize(("edit", "field"), [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
     "rope_scaling.partial_rotary_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 16}, "head_dim"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_config_fields_that_change_the_math_are_refused_by_name(edit: dict, field: str) -> None:
    config = {"model_type": "llama", **COMMON, **edit}
    with pytest.raises(PlannerError, match=f"config field {field} = "):
        spec_from_hf_config(config, source="config.json")


def test_gpt2_and_qwen2_fields_are_checked_too() -> None:
    gpt2 = json.loads(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4).to_json_string())
    assert spec_from_hf_config(gpt2, source="gpt2").intermediate_size == 256
    with pytest.raises(PlannerError, match="config field scale_attn_by_inverse_layer_idx = True"):
        spec_from_hf_config({**gpt2, "scale_attn_by_inverse_layer_idx": True}, source="gpt2")
    with pytest.raises(PlannerError, match="config field activation_function = 'relu'"):
        spec_from_hf_config({**gpt2, "activation_function": "relu"}, source="gpt2")
    qwen = json.loads(transformers.Qwen2Config(**COMMON, use_sliding_window=True).to_json_string())
    with pytest.raises(PlannerError, match="config field use_sliding_window = True"):
        spec_from_hf_config(qwen, source="qwen2")


def test_a_directory_changed_since_the_plan_is_refused(models, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "m"
    shutil.copytree(models["llama"], copy)
    spec = resolve_model(str(copy))
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlannerError, match="no longer holds the model the plan was compiled for"):
        open_weights(str(copy), spec=spec, head="lm")


@pytest.mark.parametrize("kind", sorted(ROPE))
def test_rope_scaling_survives_the_hf_config_written_for_it(kind: str) -> None:
    """A spec with RoPE scaling (no directory of its own) is written with a config.json that
    transformers reads as the same scaling, and that planner reads back as the same spec."""
    from runtime.weights import hf_config

    spec = resolve_model({"model_type": "llama", **COMMON, "rope_theta": 1e4, "rope_scaling": ROPE[kind]})
    cfg = hf_config(spec, head="lm")
    loaded = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    want = {**ROPE[kind], "rope_theta": 1e4}
    assert {k: v for k, v in loaded.rope_parameters.items() if k in want} == want
    assert spec_from_hf_config(json.loads(loaded.to_json_string()), source="config.json").rope_scaling == \
        spec.rope_scaling
