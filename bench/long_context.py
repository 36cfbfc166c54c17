"""Long-context plans the search gives context parallelism, run on 4 gloo ranks against the reference.

Two plans of a micro Llama (hidden 16, 2 layers, 2 query heads sharing 1 key/value head, context
32,768), compiled by `planner compile` for ``cpu:1x4``, validated by `planner validate`, then run
with ``torchrun --nproc-per-node 4 -m runtime PLAN`` and with ``python -m runtime PLAN
--reference`` (one process, unsharded):

- SFT of one 32,768-token sequence per step: the search splits it over cp 2 (all-gathered keys and
  values, causal load-balanced chunks; `runtime.context_parallel`);
- GRPO with 16,368 generated tokens per response (one prompt, two samples, two optimizer steps
  per call): generation runs data-parallel, the train call context-parallel on the same ranks (its
  cp ranks hold replicas, so no parameter moves between the two).

It prints each plan's layouts, the predicted and measured step times and the largest difference
of any metric between the 4-rank run and the reference, step by step (the second step runs on
weights the first updated). ``--smoke`` runs the SFT plan at 16,384 tokens (where the search
starts to consider cp), one step.

    python bench/long_context.py [--smoke] [--steps N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rlhf_learning import _metrics, _run  # noqa: E402  (one way to launch a run and read its metrics)

from plans.plan import load_plan  # noqa: E402

MICRO = ("model_type=llama,hidden_size=16,intermediate_size=32,num_hidden_layers=2,num_attention_heads=2,"
         "num_key_value_heads=1,vocab_size=256,max_position_embeddings=32768")
TOL = 1e-5


def bench(name: str, compile_args: list[str], *, steps: int, tmp: Path) -> float:
    plan_path = tmp / f"{name}.json"
    _run(["-m", "planner", "compile", *compile_args, "--cluster", "cpu:1x4", "-o", str(plan_path)])
    _run(["-m", "planner", "validate", str(plan_path)])
    plan = load_plan(plan_path)
    if not any(c.layout.cp > 1 for c in plan.calls):
        raise SystemExit(f"{name}: the search chose no context parallel: " + ", ".join(c.layout.short() for c in plan.calls))
    par_path, ref_path = tmp / f"{name}.par.jsonl", tmp / f"{name}.ref.jsonl"
    common = ["--steps", str(steps), "--metrics-out"]
    _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "runtime", str(plan_path),
          *common, str(par_path)])
    _run(["-m", "runtime", str(plan_path), "--reference", *common, str(ref_path)])
    par, ref = _metrics(par_path), _metrics(ref_path)
    print(f"\n== {name}: " + ", ".join(f"{c.name} {c.layout.short()} on {len(c.mesh.ranks)} ranks (seq {c.seq_len})"
                                      for c in plan.calls))
    print(f"predicted step {plan.estimate.iteration_s:.2f} s")
    worst = 0.0
    for p, r in zip(par, ref):
        diffs = [(abs(p[k] - r[k]), k) for k in r if k in p and not k.endswith("time_s") and k != "step"]
        d, key = max(diffs, default=(0.0, ""))
        worst = max(worst, d)
        print(f"step {r['step']}: 4 ranks {p['time_s']:.2f} s, reference {r['time_s']:.2f} s; largest metric "
              f"difference {d:.1e} ({key}); " + ", ".join(f"{k} {r[k]:.6g}" for k in sorted(r)
                                                           if not k.endswith("time_s") and k != "step"))
    print(f"{name}: largest metric difference {worst:.1e} over {len(ref)} steps (tolerance {TOL:g}): "
          f"{'equal to the reference' if worst <= TOL else 'DIFFERS from the reference'}")
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the SFT plan at 16,384 tokens only, one step")
    ap.add_argument("--steps", type=int, default=2, help="steps per run (default 2)")
    args = ap.parse_args()
    worst = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        seq = 16384 if args.smoke else 32768
        worst.append(bench(f"sft_{seq // 1024}k", ["sft", "--actor", MICRO, "--batch", "1", "--seq-len", str(seq)],
                           steps=1 if args.smoke else args.steps, tmp=tmp))
        if not args.smoke:
            worst.append(bench("grpo_16k", ["grpo", "--actor", MICRO, "--reward-fn", "runtime.tasks:pattern_reward",
                                            "--batch", "1", "--samples-per-prompt", "2", "--prompt-len", "16",
                                            "--gen-len", "16368", "--ppo-minibatches", "2"],
                               steps=args.steps, tmp=tmp))
    if max(worst) > TOL:
        raise SystemExit("a context-parallel run differs from the reference")


if __name__ == "__main__":
    main()
