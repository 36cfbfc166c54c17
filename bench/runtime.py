"""Runtime benchmark: the data-parallel train step against plain torch DDP, and generation speed.

    python bench/runtime.py [--ranks 2] [--steps 8]

1. Train step, dp = ranks: `runtime.engine.ModelRunner.train` (flat gradient buffer reduced
   in buckets during backward, fused AdamW on the flat buffer) against a hand-written step of the same model, same
   weights, same batch: `torch.nn.parallel.DistributedDataParallel` + `torch.optim.AdamW` +
   cross entropy, with torch's default AdamW (foreach) and with its fused kernel (the one the
   runtime uses, so the optimizer is not what the ratio measures). Measured in turn in one run
   (ABCABC...), median step time each. Aim: ratio at most 1.05.
2. Generation: tokens/s of greedy decoding with the KV cache, sharded (dp = ranks, and
   tp = ranks) against one process generating the whole batch with as many threads as there
   are ranks (the same cores).

gloo on CPU here; the same code takes NCCL on GPUs. Figures are printed, nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

# This file is named like the package it measures: drop its own folder from the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from plans import AlgorithmConfig, Layout, Mesh, resolve_model  # noqa: E402
from runtime.engine import ModelRunner  # noqa: E402
from runtime.groups import Groups, solo_groups  # noqa: E402
from runtime.losses import make_loss  # noqa: E402
from runtime.model import init_tensor, stage_forward, token_logprobs  # noqa: E402

SPEC = ("model_type=llama,hidden_size=256,num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=4,"
        "intermediate_size=688,vocab_size=4096,max_position_embeddings=512")
LR = 1e-4


class PlainModel(torch.nn.Module):
    """The same decoder as an nn.Module holding the same parameters, for DDP."""

    def __init__(self, runner: ModelRunner) -> None:
        super().__init__()
        self.shard = runner.shard
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(p.detach().clone()) for p in runner.shard.params.values()])
        self.names = list(runner.shard.params)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.shard.params = dict(zip(self.names, self.weights))  # type: ignore[arg-type]
        h = stage_forward(self.shard, tokens, positions=torch.arange(tokens.shape[1]))
        return -token_logprobs(self.shard, h, tokens).mean()


def _bench_train(rank: int, ranks: int, args: argparse.Namespace) -> dict[str, float]:
    spec = resolve_model(SPEC)
    cpu = torch.device("cpu")
    layout = Layout(dp=ranks)
    groups = Groups(distributed=True).build(Mesh.block(0, ranks), layout, rank=rank, tied=False)
    ours = ModelRunner(spec, head="lm", trainable=True, groups=groups, state=lambda p: init_tensor(p, seed=0), device=cpu)
    plain_src = ModelRunner(spec, head="lm", trainable=False, groups=solo_groups(Layout()),
                            state=lambda p: init_tensor(p, seed=0), device=cpu)
    plain = torch.nn.parallel.DistributedDataParallel(PlainModel(plain_src))
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.0, foreach=True)  # torch's default
    plain_fused = torch.nn.parallel.DistributedDataParallel(PlainModel(plain_src))
    opt_fused = torch.optim.AdamW(plain_fused.parameters(), lr=LR, weight_decay=0.0, fused=True)  # the kernel ours uses
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (args.batch * ranks, args.seq), generator=gen)
    mask = torch.ones(tokens.shape[0], args.seq - 1, dtype=torch.bool)
    mine = tokens[rank * args.batch:(rank + 1) * args.batch]
    loss = make_loss("sft", AlgorithmConfig())
    denom = float(mask.numel())

    def step_ours() -> None:
        ours.train({"tokens": tokens, "mask": mask}, loss=loss, denoms=[denom], lr=LR)

    def step_plain() -> None:
        opt.zero_grad(set_to_none=False)
        plain(mine).backward()
        opt.step()

    def step_plain_fused() -> None:
        opt_fused.zero_grad(set_to_none=False)
        plain_fused(mine).backward()
        opt_fused.step()

    times: dict[str, list[float]] = {"ours": [], "ddp": [], "ddp_fused": []}
    for i in range(args.steps + 2):  # two warm-up rounds
        for name, fn in (("ours", step_ours), ("ddp", step_plain), ("ddp_fused", step_plain_fused)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _bench_generate(rank: int, ranks: int, args: argparse.Namespace) -> dict[str, float]:
    spec = resolve_model(SPEC)
    cpu = torch.device("cpu")
    prompts = torch.randint(0, spec.vocab_size, (args.gen_batch, args.prompt), generator=torch.Generator().manual_seed(2))
    new_tokens = args.gen_batch * args.gen_len
    out: dict[str, float] = {}
    groups = Groups(distributed=True)
    for name, layout in (("dp", Layout(dp=ranks)), ("tp", Layout(tp=ranks))):
        mine = groups.build(Mesh.block(0, ranks), layout, rank=rank, tied=False)
        runner = ModelRunner(spec, head="lm", trainable=False, groups=mine, state=lambda p: init_tensor(p, seed=0), device=cpu)
        runner.generate(prompts, gen_len=2, temperature=0.0, seed=0)  # warm-up
        dist.barrier()
        t0 = time.perf_counter()
        runner.generate(prompts, gen_len=args.gen_len, temperature=0.0, seed=0)
        dist.barrier()
        out[name] = new_tokens / (time.perf_counter() - t0)
    dist.barrier()
    if rank == 0:  # one process, the same cores as threads
        torch.set_num_threads(ranks)
        single = ModelRunner(spec, head="lm", trainable=False, groups=solo_groups(Layout()),
                             state=lambda p: init_tensor(p, seed=0), device=cpu)
        single.generate(prompts, gen_len=2, temperature=0.0, seed=0)
        t0 = time.perf_counter()
        single.generate(prompts, gen_len=args.gen_len, temperature=0.0, seed=0)
        out["single"] = new_tokens / (time.perf_counter() - t0)
        torch.set_num_threads(1)
    dist.barrier()
    return out


def _worker(rank: int, ranks: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    train = _bench_train(rank, ranks, args)
    generate = _bench_generate(rank, ranks, args)
    if rank == 0:
        spec = resolve_model(SPEC)
        print(f"model: llama h={spec.hidden_size} L={spec.num_hidden_layers} V={spec.vocab_size} "
              f"({spec.num_params() / 1e6:.1f}M params), {ranks} gloo ranks x 1 thread")
        print(f"train step, dp={ranks}, batch {args.batch}/rank x {args.seq} tokens, median of {args.steps}:")
        print(f"  runtime (bucketed, ZeRO 0)         {train['ours'] * 1e3:8.1f} ms")
        print(f"  plain torch DDP + AdamW (foreach)  {train['ddp'] * 1e3:8.1f} ms")
        print(f"  plain torch DDP + AdamW (fused)    {train['ddp_fused'] * 1e3:8.1f} ms")
        print(f"  ratio runtime / DDP                {train['ours'] / train['ddp']:8.3f}   (aim <= 1.05)")
        print(f"  ratio runtime / DDP, fused AdamW   {train['ours'] / train['ddp_fused']:8.3f}")
        print(f"generation, greedy, {args.gen_batch} prompts x {args.prompt} tokens + {args.gen_len} new tokens:")
        print(f"  single process ({ranks} threads)        {generate['single']:8.1f} tokens/s")
        for name in ("dp", "tp"):
            print(f"  sharded {name}={ranks}                     {generate[name]:8.1f} tokens/s"
                  f"   ({generate[name] / generate['single']:.2f}x single)")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2, help="gloo processes (default 2: this machine's cores)")
    ap.add_argument("--steps", type=int, default=8, help="timed train steps per variant")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank per train step")
    ap.add_argument("--seq", type=int, default=128, help="tokens per training sequence")
    ap.add_argument("--gen-batch", type=int, default=16, help="prompts generated")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--gen-len", type=int, default=32, help="new tokens per prompt")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.ranks, port, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
