"""Trained models out (``--save-hf``): a 4-rank run started from an HF directory writes each trained
model as an HF directory that transformers loads, holding bit for bit the run's final weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from planner import algorithms
from plans import Layout, Mesh, resolve_model, save_plan
from plans.checkpoint import load_manifest, reads_for, step_dir
from plans.sharding import parameters
from runtime.model import load_checkpoint
from tests.test_runtime_cli import _run, _torchrun
from tests.test_runtime_executor import place
from tests.test_runtime_weights import make_models

transformers = pytest.importorskip("transformers")
STEPS = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("hf"))


def _final_params(ckpt: Path, model: str) -> dict[str, torch.Tensor]:
    """The run's final parameters, whole, assembled from its last checkpoint's pieces."""
    directory = step_dir(ckpt, STEPS)
    manifest = load_manifest(directory)
    spec = manifest.models[model].spec
    out = {}
    for p in parameters(spec, head=manifest.models[model].head):
        whole = torch.empty(p.shape)
        for piece, src, dst in reads_for(manifest, model=model, param=p.name, kind="param",
                                          need=tuple((0, n) for n in p.shape)):
            t = safetensors.torch.load_file(directory / piece.file)[piece.key]
            whole[tuple(slice(a, b) for a, b in dst)] = t[tuple(slice(a, b) for a, b in src)]
        out[p.name] = whole
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), [("llama", Layout(dp=2, tp=2, zero=3)), ("gpt2", Layout(tp=2, pp=2))])
def test_a_four_rank_run_saves_hf_directories_transformers_loads_bit_for_bit(models, tmp_path: Path, family: str,
                                                                             layout: Layout) -> None:
    graph = algorithms.sft(str(models[family]), batch=8, seq_len=12, minibatches=2, task="pattern", lr=1e-3)
    assert graph.models["model"].weights == str(models[family].resolve())
    plan = tmp_path / "plan.json"
    save_plan(place(graph, {"model": (Mesh.block(0, 4), layout)}), plan)
    out = _torchrun(4, str(plan), "--steps", str(STEPS), "--quiet", "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--save-hf", str(tmp_path / "hf"), "--save-hf-shard-mb", "0.2")
    assert out.returncode == 0, out.stderr[-3000:]
    saved = tmp_path / "hf" / "model"
    assert (saved / "model.safetensors.index.json").is_file()  # sharded above 0.2 MB
    spec, state = load_checkpoint(saved, head="lm")  # our reader of HF directories
    assert spec.model_dump(exclude={"name"}) == resolve_model(str(models[family])).model_dump(exclude={"name"})
    final = _final_params(tmp_path / "ckpt", "model")
    assert state.keys() == final.keys() and all(torch.equal(state[k], final[k]) for k in final)
    started = _final_params_from(models[family])
    assert any(not torch.equal(final[k], started[k]) for k in final)  # it trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved).eval()
    config = json.loads((saved / "config.json").read_text())
    assert config["model_type"] == family and config["torch_dtype"] == "float32"
    tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = hf(tokens).logits
    ref = _run(["-c", _LOGITS.format(dir=str(saved))])  # the runtime's own forward on those weights
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = torch.tensor(json.loads(ref.stdout))
    assert (got - want).abs().max().item() < 1e-5


def _final_params_from(directory: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(directory, head="lm")[1]


_LOGITS = """
import json, torch
from plans import Layout
from runtime.model import build_shard, load_checkpoint, stage_forward, _lm_logits
spec, state = load_checkpoint({dir!r}, head="lm")
shard = build_shard(spec, head="lm", layout=Layout(), local=0, layers=tuple(range(spec.num_hidden_layers)),
                    state=lambda p: state[p.name], device=torch.device("cpu"))
tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    print(json.dumps(_lm_logits(shard, stage_forward(shard, tokens, positions=torch.arange(12)), False).tolist()))
"""


def test_save_hf_options_are_checked_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    plan = Path(__file__).resolve().parents[1] / "plans" / "tiny_ppo.json"
    out = _run(["-m", "runtime", str(plan), "--reference", "--save-hf", str(tmp_path / "file")])
    assert out.returncode == 2 and "exists and is not a directory" in out.stderr
    out = _run(["-m", "runtime", str(plan), "--reference", "--save-hf-at-checkpoints"])
    assert out.returncode == 2 and "needs --save-hf DIR and --checkpoint-dir" in out.stderr
