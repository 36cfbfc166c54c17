"""Real job benchmark: the `examples/real_grpo` flow end to end, with its figures.

    python bench/real_job.py              # 40 GRPO steps on 4 CPU ranks (about a minute on 2 cores)
    python bench/real_job.py --steps 2    # a smoke run

Builds the example's assets (a small HF Llama, a BPE tokenizer, a JSONL task), compiles GRPO for
cpu:1x4 from them with `planner compile grpo --data ...`, runs it on 4 gloo ranks and as the
single-process reference, and prints: the mean reward over the first and last steps, the largest
metric difference between the two runs, the greedy reward of the saved HF directory reloaded with
transformers against the starting model's, and generation time with and without stopping at EOS
(the same prompts, measured side by side, a model that has learned to answer in a few tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "real_grpo"
sys.path.insert(0, str(ROOT))  # before bench/ itself, whose runtime.py would shadow the runtime package


def _run(args: list[str], *, env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update(PYTHONPATH=f"{ROOT}{os.pathsep}{EXAMPLE}", OMP_NUM_THREADS="1", **(env or {}))
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=base, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args[:4])} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _generation_s(model_dir: Path, prompts: Path, *, stop: bool, repeats: int) -> float:
    """Median seconds to generate 32 tokens for the task's prompts, stopping at EOS or not."""
    import torch

    from plans import Layout
    from plans.graph import DataInput, DataSource
    from runtime.data import Dataset
    from runtime.engine import ModelRunner
    from runtime.groups import solo_groups
    from runtime.model import load_checkpoint

    spec, state = load_checkpoint(model_dir, head="lm")
    runner = ModelRunner(spec, head="lm", trainable=False, groups=solo_groups(Layout()), state=lambda p: state[p.name],
                         device=torch.device("cpu"))
    source = DataSource(path=str(prompts), format="jsonl", tokenizer=str(model_dir), rows=256)
    ds = Dataset(DataInput(name="prompts", seqs=16, seq_len=32, data=source), vocab_size=spec.vocab_size)
    rows, _ = ds.batch(step=1, seed=0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.generate(rows["tokens"], pad=rows["pad"], gen_len=32, temperature=0.0, seed=0,
                        stop_token=ds.tok.eos_id if stop else None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="GRPO steps (default 40)")
    ap.add_argument("--out", type=Path, help="keep the assets, plan and trained model here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        _run([str(EXAMPLE / "make_assets.py"), str(out)])
        plan = out / "grpo.json"
        _run(["-m", "planner", "compile", "grpo", "--actor", str(out / "model"), "--data", str(out / "train.jsonl"),
              "--extra-keys", "ground_truth", "--reward-fn", "reward:score", "--cluster", "cpu:1x4", "--batch", "8",
              "--prompt-len", "32", "--gen-len", "6", "--samples-per-prompt", "4", "--ppo-minibatches", "1",
              "--lr", "5e-3", "--time-limit", "2", "-o", str(plan)])
        common = ["-m", "runtime", str(plan), "--steps", str(args.steps), "--quiet", "--reward-fn", "reward:score"]
        t0 = time.perf_counter()
        _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", *common,
              "--metrics-out", str(out / "m.jsonl"), "--save-hf", str(out / "trained")])
        wall = time.perf_counter() - t0
        _run([*common, "--reference", "--metrics-out", str(out / "ref.jsonl")])
        got, want = _metrics(out / "m.jsonl"), _metrics(out / "ref.jsonl")
        worst = max(abs(g[k] - v) for g, w in zip(got, want) for k, v in w.items() if not k.endswith("time_s"))
        k = max(1, min(5, args.steps // 4))
        first = statistics.mean(m["reward_mean"] for m in want[:k])
        last = statistics.mean(m["reward_mean"] for m in want[-k:])
        print(f"GRPO on cpu:1x4 from an HF directory and a JSONL dataset, {args.steps} steps ({wall:.1f} s under "
              f"torchrun, 4 ranks on {os.cpu_count()} cores)")
        print(f"  mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
        print(f"  4 ranks vs reference: largest metric difference {worst:.1e} (tolerance 1e-4)")
        check = _run([str(EXAMPLE / "check.py"), str(out)])
        print("  transformers reloads the trained actor: " + check.strip().splitlines()[-1])
        stop = _generation_s(out / "trained" / "actor", out / "train.jsonl", stop=True, repeats=5)
        full = _generation_s(out / "trained" / "actor", out / "train.jsonl", stop=False, repeats=5)
        print(f"  generating 32 tokens for 16 prompts (trained actor, greedy): {stop * 1e3:.1f} ms stopping at EOS, "
              f"{full * 1e3:.1f} ms without ({full / stop:.2f}x)")


if __name__ == "__main__":
    main()
