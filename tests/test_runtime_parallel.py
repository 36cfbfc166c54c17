"""Every layout computes what one process computes: 4 gloo ranks against the unsharded reference.

One launch of 4 processes runs all layouts (dp, tp, pp) in {(4,1,1), (1,4,1), (1,1,4), (2,2,1),
(2,1,2), (1,2,2)}, ZeRO 0-3 where dp > 1, with sequence parallel, recompute and micro-batches
mixed in, for both model families (tiny-llama: grouped-query attention, untied head; tiny-gpt:
biases, learned positions, tied head across pipeline stages), with gradient buckets of 4 KiB
(so each model's reduction runs as many buckets overlapping its backward). Each rank computes the reference
itself (one process, no groups) and compares what it holds: train-step loss and statistics,
every updated parameter slice (against the reference's `shard_box` of it), inference log-probs
and values, greedy and sampled generation tokens.

Adam divides each gradient by its own magnitude, so with its usual eps of 1e-8 an element whose
gradient is zero in exact arithmetic (a key bias: softmax ignores a shift of all scores; a GELU
unit that is off for every token) moves by a fraction of the learning rate that float rounding
noise decides, in the reference as much as in any layout. The test therefore uses eps 1e-6 and
lr 1e-4, under which gradients of 1e-9 move nothing measurable, and checks everything else at 1e-5.
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

from plans import PRESETS, AlgorithmConfig, Layout, Mesh
from plans.sharding import parameters, shard_box
from runtime.data_parallel import AdamConfig
from runtime.engine import ModelRunner
from runtime.groups import Groups, solo_groups
from runtime.losses import make_loss
from runtime.model import init_tensor

WORLD = 4
TOL = 1e-5
CASES = [
    # dp, tp, pp, extra layout fields
    (4, 1, 1, {"micro_batches": 2}),
    (4, 1, 1, {"zero": 1}),
    (4, 1, 1, {"zero": 2}),
    (4, 1, 1, {"zero": 3, "recompute": "full"}),
    (1, 4, 1, {"sequence_parallel": True, "recompute": "selective"}),
    (1, 4, 1, {}),
    (1, 1, 4, {"micro_batches": 4}),
    (2, 2, 1, {"sequence_parallel": True}),
    (2, 2, 1, {"zero": 1}),
    (2, 2, 1, {"zero": 2, "micro_batches": 2}),
    (2, 2, 1, {"zero": 3, "sequence_parallel": True}),
    (2, 1, 2, {"micro_batches": 2}),
    (2, 1, 2, {"zero": 1, "micro_batches": 3}),
    (2, 1, 2, {"zero": 2}),
    (2, 1, 2, {"zero": 3, "micro_batches": 2, "recompute": "full"}),
    (1, 2, 2, {"sequence_parallel": True, "micro_batches": 2}),
]
BATCH, PROMPT, GEN = 8, 7, 6  # odd lengths exercise sequence-parallel padding
ALGO = AlgorithmConfig()
ADAM = AdamConfig(eps=1e-6)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = PROMPT + GEN
    tokens = torch.randint(0, 256, (BATCH, s), generator=g)
    mask = torch.zeros(BATCH, s - 1, dtype=torch.bool)
    mask[:, PROMPT - 1:] = True
    mask[0, -2:] = False  # a sequence that stopped early
    return {
        "tokens": tokens, "mask": mask,
        "old_logprobs": -5.5 + 0.1 * torch.randn(BATCH, s - 1, generator=g),
        "ref_logprobs": -5.5 + 0.1 * torch.randn(BATCH, s - 1, generator=g),
        "advantages": torch.randn(BATCH, s - 1, generator=g),
        "old_values": 0.1 * torch.randn(BATCH, s - 1, generator=g),
        "returns": torch.randn(BATCH, s - 1, generator=g),
    }


def _run_model(runner: ModelRunner, batch: dict[str, torch.Tensor]) -> dict[str, object]:
    """Inference, generation (LM head), then one train call with two minibatches."""
    out: dict[str, object] = {}
    lm = runner.head == "lm"
    out["forward"] = runner.forward(batch["tokens"], what="logprobs" if lm else "values")
    if "pad" in batch:  # left-padded rows (the train call then reads the padding too)
        out["forward_pad"] = runner.forward(batch["tokens"], what="logprobs" if lm else "values", pad=batch["pad"])
    if lm:
        for temp in (0.0, 1.0):
            out[f"generate_t{temp:g}"] = runner.generate(batch["tokens"][:, :PROMPT], gen_len=GEN, temperature=temp,
                                                         seed=11, stop_token=3)
    halves = [float(batch["mask"][:4].sum()), float(batch["mask"][4:].sum())]
    loss = make_loss("grpo" if lm else "ppo_value", ALGO)
    shares = runner.train(batch, loss=loss, denoms=halves, lr=1e-4)
    if runner.pipe.last and runner.groups.dp.size > 1:  # each replica returns its share: sum them
        packed = torch.tensor([shares[k] for k in sorted(shares)], dtype=torch.float64)
        dist.all_reduce(packed, group=runner.groups.dp.group)
        shares = dict(zip(sorted(shares), packed.tolist()))
    out["train"] = shares
    out["params"] = runner.local_parameters()
    return out


def _compare(case: str, ref: dict, got: dict, runner: ModelRunner, spec, head: str) -> tuple[list[str], int]:
    problems, checks = [], 0

    def close(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal checks
        checks += 1
        if a.shape != b.shape:
            problems.append(f"{case} {what}: shape {tuple(b.shape)} != reference {tuple(a.shape)}")
        elif a.numel() and (a.float() - b.float()).abs().max().item() > TOL:
            problems.append(f"{case} {what}: max diff {(a.float() - b.float()).abs().max().item():.2e}")

    last = runner.pipe.last
    if last:
        lo, hi = runner.split(BATCH).start, runner.split(BATCH).stop
        close("forward", ref["forward"][lo:hi], got["forward"])
        if "forward_pad" in ref:
            close("forward, left-padded", ref["forward_pad"][lo:hi], got["forward_pad"])
        for key in ("generate_t0", "generate_t1"):
            if key in ref:
                checks += 1
                if not torch.equal(ref[key]["tokens"][lo:hi], got[key]["tokens"]):
                    problems.append(f"{case} {key}: tokens differ")
                close(f"{key} logprobs", ref[key]["logprobs"][lo:hi], got[key]["logprobs"])
                checks += 1
                if not torch.equal(ref[key]["mask"][lo:hi], got[key]["mask"]):
                    problems.append(f"{case} {key}: masks differ")
        for name, value in ref["train"].items():
            close(f"train {name}", torch.tensor(value), torch.tensor(got["train"][name]))
    catalog = {p.name: p for p in parameters(spec, head=head)}
    for name, mine in got["params"].items():
        box = shard_box(catalog[name], spec, runner.layout, runner.groups.local)
        close(f"param {name}", ref["params"][name][tuple(slice(a, b) for a, b in box)], mine)
    expected = {n for n, p in catalog.items() if shard_box(p, spec, runner.layout, runner.groups.local) is not None}
    if set(got["params"]) != expected:
        problems.append(f"{case}: holds {sorted(set(got['params']) ^ expected)} against the layout")
    return problems, checks


def run_layouts(rank: int, port: int, out_dir: str, models: list[tuple[str, object, str]], cases: list,
                state, pad: torch.Tensor | None = None) -> None:  # noqa: ANN001
    """On one of WORLD ranks: every (model, head) of `models` ((name, spec, head)) under every
    case's layout against the single-process reference (rows left-padded by `pad` when given);
    problems and checks to OUT_DIR."""
    import runtime.data_parallel

    runtime.data_parallel.BUCKET_BYTES = 4096  # many gradient buckets, reduced as backward fills them
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups = Groups(distributed=True)
    mesh = Mesh.block(0, WORLD)
    problems: list[str] = []
    checks = 0
    cpu = torch.device("cpu")
    batch = _batch(seed=5)
    if pad is not None:
        batch["pad"] = pad
    for name, spec, head in models:
        ref_runner = ModelRunner(spec, head=head, trainable=True, groups=solo_groups(Layout()), state=state, device=cpu,
                                 adam=ADAM)
        ref = _run_model(ref_runner, batch)
        for dp, tp, pp, extra in cases:
            layout = Layout(dp=dp, tp=tp, pp=pp, **extra)
            case = f"{name}/{head} {layout.short()}"
            mine = groups.build(mesh, layout, rank=rank, tied=spec.tied and head == "lm")
            runner = ModelRunner(spec, head=head, trainable=True, groups=mine, state=state, device=cpu, adam=ADAM)
            got = _run_model(runner, batch)
            p, c = _compare(case, ref, got, runner, spec, head)
            problems += p
            checks += c
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems, "checks": checks}))
    dist.destroy_process_group()


def _state(p):  # noqa: ANN001, ANN202
    return init_tensor(p, seed=3)


def _worker(rank: int, port: int, out_dir: str) -> None:
    models = [(family, PRESETS[f"tiny-{family}"], head) for family in ("llama", "gpt") for head in ("lm", "value")]
    run_layouts(rank, port, out_dir, models, CASES, _state)


def collect(out_dir: Path) -> tuple[list[str], int]:
    """Every rank's problems and checks."""
    problems, checks = [], 0
    for rank in range(WORLD):
        result = json.loads((out_dir / f"rank{rank}.json").read_text())
        problems += result["problems"]
        checks += result["checks"]
    return problems, checks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.heavy
@pytest.mark.slow
def test_every_layout_matches_single_process_reference(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    problems, checks = collect(tmp_path)
    assert not problems, "\n".join(problems[:40])
    # Every rank checks its parameters in every case, the last stages the outputs too.
    assert checks > 2 * 2 * len(CASES) * WORLD * 10
