"""The runtime on a CUDA GPU: what `bench/gpu_check.sh` runs on the device machine.

Every test here needs CUDA and is skipped without it (so on CPU machines and in CI). They check
what only a GPU can show: the same model on CUDA computes what the CPU reference computes (fp32),
bf16 runs end to end, an NCCL process group drives the runtime's collectives, and call outputs
that arrive on different devices are joined on the GPU.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from plans import AlgorithmConfig, Layout, Mesh, resolve_model
from runtime.engine import ModelRunner
from runtime.groups import solo_groups
from runtime.losses import make_loss
from runtime.model import init_tensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.sh)")

SPEC = resolve_model("model_type=llama,hidden_size=128,num_hidden_layers=2,num_attention_heads=8,"
                     "num_key_value_heads=2,intermediate_size=256,vocab_size=1024,max_position_embeddings=256")


def _runner(device: str, dtype: torch.dtype = torch.float32, *, trainable: bool = False) -> ModelRunner:
    return ModelRunner(SPEC, head="lm", trainable=trainable, groups=solo_groups(Layout()),
                       state=lambda p: init_tensor(p, seed=0), device=torch.device(device), dtype=dtype)


def test_cuda_log_probs_equal_the_cpu_reference() -> None:
    tokens = torch.randint(0, SPEC.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    cpu = _runner("cpu").forward(tokens, what="logprobs")
    gpu = _runner("cuda").forward(tokens.cuda(), what="logprobs")
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-4, atol=1e-4)


def test_cuda_greedy_generation_equals_the_cpu_reference() -> None:
    prompts = torch.randint(0, SPEC.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    cpu = _runner("cpu").generate(prompts, gen_len=8, temperature=0.0, seed=0)
    gpu = _runner("cuda").generate(prompts.cuda(), gen_len=8, temperature=0.0, seed=0)
    assert cpu is not None and gpu is not None
    assert torch.equal(gpu["tokens"].cpu(), cpu["tokens"])


def test_decode_steps_run_as_cuda_graphs_and_generate_what_eager_decoding_does(monkeypatch) -> None:  # noqa: ANN001
    import runtime.generate as gen

    captured = []
    init = gen._CudaGraph.__init__

    def counting(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        captured.append(1)
        init(self, *args, **kwargs)

    monkeypatch.setattr(gen._CudaGraph, "__init__", counting)
    prompts = torch.randint(0, SPEC.vocab_size, (6, 16), generator=torch.Generator().manual_seed(3)).cuda()
    pad = torch.tensor([0, 3, 0, 1, 5, 0], device="cuda")

    def run(r: ModelRunner, *, static: bool, graphs: bool = True) -> dict:
        monkeypatch.setattr(gen, "CUDA_GRAPHS", graphs)
        with torch.no_grad(), r._autocast():
            out = gen.generate(r.shard, r.pipe, prompts, seq_ids=torch.arange(6, device="cuda"), gen_len=12,
                               temperature=1.0, seed=5, stop_token=None, device=r.device, pad=pad, groups=2,
                               static=static)
        assert out is not None
        return out

    r = _runner("cuda")  # fp32: the graphed static cache generates what the growing cache does
    graphed, eager = run(r, static=True), run(r, static=False)
    assert torch.equal(graphed["tokens"], eager["tokens"])
    torch.testing.assert_close(graphed["logprobs"], eager["logprobs"], rtol=1e-4, atol=1e-4)
    assert len(captured) == 2  # one graph per group
    r = _runner("cuda", torch.bfloat16)  # bf16: a replay computes exactly what the same step computes eagerly
    graphed, eager = run(r, static=True), run(r, static=True, graphs=False)
    assert torch.equal(graphed["tokens"], eager["tokens"]) and torch.equal(graphed["logprobs"], eager["logprobs"])
    assert len(captured) == 4


def test_bf16_train_steps_run_and_lower_the_loss() -> None:
    r = _runner("cuda", torch.bfloat16, trainable=True)
    tokens = torch.randint(0, SPEC.vocab_size, (4, 64), generator=torch.Generator().manual_seed(2)).cuda()
    mask = torch.ones(4, 63, dtype=torch.bool, device="cuda")
    loss = make_loss("sft", AlgorithmConfig())
    first = r.train({"tokens": tokens, "mask": mask}, loss=loss, denoms=[float(mask.numel())], lr=1e-3)
    for _ in range(5):
        last = r.train({"tokens": tokens, "mask": mask}, loss=loss, denoms=[float(mask.numel())], lr=1e-3)
    key = next(k for k in first if "loss" in k)
    assert last[key] < first[key]


def test_an_nccl_group_runs_the_runtime_on_one_gpu() -> None:
    import torch.distributed as dist

    from runtime.groups import Groups

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        groups = Groups(distributed=True).build(Mesh.block(0, 1), Layout(), rank=0, tied=False)
        r = ModelRunner(SPEC, head="lm", trainable=False, groups=groups, state=lambda p: init_tensor(p, seed=0),
                        device=torch.device("cuda"))
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        assert x.sum().item() == 4
        out = r.forward(torch.randint(0, SPEC.vocab_size, (2, 16)).cuda(), what="logprobs")
        assert out.is_cuda and torch.isfinite(out).all()
    finally:
        dist.destroy_process_group()


def test_call_outputs_from_the_host_and_the_gpu_join_on_the_gpu() -> None:
    from runtime.dataflow import Incoming

    here = {"x": torch.ones(2, 3, device="cuda")}
    arrived = {"x": torch.zeros(1, 3)}  # a piece unpacked from a host buffer
    inc = Incoming(shapes={"x": ((3,), torch.float32)}, parts=[(2, here), (1, arrived)])
    out = inc.get()["x"]
    assert out.is_cuda and out.shape == (3, 3)


def test_a_ppo_step_keeps_call_outputs_on_the_gpu_and_matches_the_cpu_reference(monkeypatch) -> None:  # noqa: ANN001
    """examples/tiny_ppo.py's plan through the executor in one process on the GPU: every call
    output stays on the device from call to call, and the metrics are the CPU reference's."""
    import runpy
    from pathlib import Path

    from planner.compile import compile_graph
    from plans import parse_cluster
    from runtime.executor import PlanRunner

    graph = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "tiny_ppo.py"))["graph"]
    plan = compile_graph(graph, parse_cluster("cpu:1x4"), time_limit_s=0)
    seen: list[str] = []
    share = PlanRunner._share

    def recording(self, call, local, shapes, mail):  # noqa: ANN001, ANN202
        out = share(self, call, local, shapes, mail)
        seen.extend(v.device.type for v in out.values() if isinstance(v, torch.Tensor))
        return out

    monkeypatch.setattr(PlanRunner, "_share", recording)
    metrics = {}
    for device in ("cpu", "cuda"):
        runner = PlanRunner(plan, rank=0, world_size=1, reference=True, seed=0, dtype=torch.float32,
                            device=torch.device(device))
        metrics[device] = [runner.step(s) for s in (1, 2)]
        if device == "cuda":
            assert seen and set(seen[len(seen) // 2:]) == {"cuda"}, seen
    for got, want in zip(metrics["cuda"], metrics["cpu"]):
        for key, value in want.items():
            if not key.endswith("time_s"):
                assert abs(got[key] - value) <= 1e-3 * max(1.0, abs(value)), (key, got[key], value)
