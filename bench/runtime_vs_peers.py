"""The runtime against its peers on one CPU process: transformers on the same weights, and torch DDP.

    python bench/runtime_vs_peers.py [--rounds 7] [--quick]

Same model (Llama shape: hidden 512, 8 layers, 8 query heads over 2 key/value heads, SwiGLU,
vocabulary 8192), same weights, same inputs, fp32, one process with this machine's threads:

- generation: greedy decoding with the KV cache (transformers' `generate`, no early stop);
- inference: per-token log-probs of a batch (transformers: logits, log-softmax, gather);
- training: one step of forward, backward and AdamW (transformers: the same loss, torch AdamW
  with foreach, torch's default; and again with AdamW's fused kernel, the one the runtime uses,
  so that the ratio is not the optimizer's alone);
- ops per decode step: aten operators dispatched per generated token (a TorchDispatchMode count
  of a longer generation minus a shorter one);
- dp=2: the runtime's data-parallel train step against torch DDP + AdamW (foreach, and fused)
  on 2 gloo ranks (`bench/runtime.py`'s measurement, same model).

Runs are interleaved (A B A B ..., the order swapped every round) because this machine is shared
and noisy; each ratio is runtime / peer per round, printed as min and median. Nothing is
asserted: the aims (median <= 1.0 against transformers, <= 1.05 against DDP, fewer ops per decode
step) are the issue's.
"""

from __future__ import annotations

import argparse
import importlib.util
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from plans import AlgorithmConfig, Layout, resolve_model  # noqa: E402
from runtime.engine import ModelRunner  # noqa: E402
from runtime.groups import solo_groups  # noqa: E402
from runtime.losses import make_loss  # noqa: E402
from runtime.model import init_tensor  # noqa: E402
from runtime.weights import hf_config, hf_tensors  # noqa: E402

SPEC = ("model_type=llama,hidden_size=512,num_hidden_layers=8,num_attention_heads=8,num_key_value_heads=2,"
        "intermediate_size=1376,vocab_size=8192,max_position_embeddings=1024,tie_word_embeddings=false")
LR = 1e-4


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops(fn) -> int:  # noqa: ANN001
    with torch.no_grad(), OpCount() as c:
        fn()
    return c.n


def build(spec):  # noqa: ANN001, ANN201
    """The runtime's model and transformers' on the same weights."""
    import transformers

    cpu = torch.device("cpu")
    runner = ModelRunner(spec, head="lm", trainable=True, groups=solo_groups(Layout()),
                         state=lambda p: init_tensor(p, seed=0), device=cpu)
    state = {n: p.detach().clone() for n, p in runner.shard.params.items()}
    cfg = transformers.AutoConfig.for_model(**hf_config(spec, head="lm"))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    missing, unexpected = hf.load_state_dict(hf_tensors(spec, state, hf_type="llama"), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return runner, hf


def interleaved(pairs: dict[str, tuple], rounds: int) -> dict[str, list[float]]:
    """Per round, runtime / peer time of each measurement (order swapped every round)."""
    ratios: dict[str, list[float]] = {k: [] for k in pairs}
    for r in range(rounds + 1):  # round 0 warms up
        for name, (ours, peer) in pairs.items():
            t = {}
            for which, fn in ((("ours", ours), ("peer", peer)) if r % 2 else (("peer", peer), ("ours", ours))):
                t0 = time.perf_counter()
                fn()
                t[which] = time.perf_counter() - t0
            if r:
                ratios[name].append(t["ours"] / t["peer"])
    return ratios


def _ddp_ratio(steps: int) -> tuple[float, float]:
    """bench/runtime.py's dp=2 train step against DDP, on this benchmark's model."""
    import torch.multiprocessing as mp

    path = Path(__file__).resolve().parent / "runtime.py"  # each rank loads it (spawned processes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    args = argparse.Namespace(batch=4, seq=128, steps=steps)
    procs = [ctx.Process(target=_ddp_worker, args=(str(path), r, 2, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = queue.get()
    for p in procs:
        p.join()
    return out


def _ddp_worker(path: str, rank: int, ranks: int, port: int, args: argparse.Namespace, queue) -> None:  # noqa: ANN001
    import os

    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("bench_runtime", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.SPEC = SPEC  # its measurement, on this benchmark's model
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    t = mod._bench_train(rank, ranks, args)
    if rank == 0:
        queue.put((t["ours"] / t["ddp"], t["ours"] / t["ddp_fused"]))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per measurement (default 7)")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (a smoke test of the script)")
    args = ap.parse_args()
    spec = resolve_model(SPEC if not args.quick else SPEC.replace("num_hidden_layers=8", "num_hidden_layers=2")
                         .replace("hidden_size=512", "hidden_size=128").replace("intermediate_size=1376",
                                                                               "intermediate_size=344"))
    torch.manual_seed(0)
    runner, hf = build(spec)
    b, prompt, gen = (2, 8, 4) if args.quick else (8, 64, 32)
    tb, ts = (2, 16) if args.quick else (8, 256)
    prompts = torch.randint(0, spec.vocab_size, (b, prompt), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, spec.vocab_size, (tb, ts), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(tb, ts - 1, dtype=torch.bool)
    loss = make_loss("sft", AlgorithmConfig())
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0, foreach=True)
    opt_fused = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0, fused=True)

    def ours_gen() -> None:
        runner.generate(prompts, gen_len=gen, temperature=0.0, seed=0)

    def hf_gen() -> None:
        with torch.no_grad():
            hf.generate(prompts, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                        attention_mask=torch.ones_like(prompts))

    def ours_inf() -> None:
        runner.forward(tokens, what="logprobs")

    def hf_inf() -> None:
        with torch.no_grad():
            logits = hf(tokens).logits[:, :-1].float()
            torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])

    def ours_train() -> None:
        runner.train({"tokens": tokens, "mask": mask}, loss=loss, denoms=[float(mask.numel())], lr=LR)

    def hf_train(optimizer: torch.optim.Optimizer = opt) -> None:
        optimizer.zero_grad(set_to_none=False)
        logits = hf(tokens).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        (-lp.mean()).backward()
        optimizer.step()

    ratios = interleaved({"generation": (ours_gen, hf_gen), "inference": (ours_inf, hf_inf),
                          "train step": (ours_train, hf_train),
                          "train step, fused AdamW": (ours_train, lambda: hf_train(opt_fused))},
                         1 if args.quick else args.rounds)
    long_, short = gen + 8, 8

    def ours_ops(n: int) -> int:
        return _ops(lambda: runner.generate(prompts, gen_len=n, temperature=0.0, seed=0))

    def hf_ops(n: int) -> int:
        return _ops(lambda: hf.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        attention_mask=torch.ones_like(prompts)))

    ops_ours = (ours_ops(long_) - ours_ops(short)) / (long_ - short)
    ops_hf = (hf_ops(long_) - hf_ops(short)) / (long_ - short)
    print(f"model: llama h={spec.hidden_size} L={spec.num_hidden_layers} heads {spec.num_attention_heads}/"
          f"{spec.kv_heads} V={spec.vocab_size} ({spec.num_params() / 1e6:.1f}M params), fp32, "
          f"{torch.get_num_threads()} threads; {len(next(iter(ratios.values())))} interleaved rounds")
    print(f"generation {b} x ({prompt} + {gen}) greedy; inference and train step {tb} x {ts} tokens")
    print(f"{'runtime / transformers':28s} {'min':>7s} {'median':>7s}")
    for name, r in ratios.items():
        print(f"  {name:26s} {min(r):7.3f} {statistics.median(r):7.3f}")
    print(f"ops per decode step: runtime {ops_ours:.0f}, transformers {ops_hf:.0f} ({ops_ours / ops_hf:.2f}x)")
    if not args.quick:
        foreach, fused = _ddp_ratio(8)
        print(f"dp=2 train step, runtime / torch DDP (median of 8): {foreach:.3f} (AdamW foreach), "
              f"{fused:.3f} (AdamW fused)")


if __name__ == "__main__":
    main()
