"""Tiny PPO and GRPO under their compiled plans on 4 gloo ranks: the reward rises, and every step's
metrics equal the single-process reference.

For each plan (default: `plans/tiny_ppo.json`, `plans/tiny_grpo.json`, from
`planner compile examples/tiny_*.py -o plans/tiny_*.json`, and the same graphs placed by hand
over all 4 ranks with tensor, data and pipeline parallelism and ZeRO, reallocating every step
between nested meshes, so that parallel arithmetic is exercised on every call) this runs

- ``torchrun --nproc-per-node 4 -m runtime PLAN --steps N`` (the plan's meshes, layouts and
  reallocations) and ``python -m runtime PLAN --reference --steps N`` (one process, unsharded);
- a *float-noise twin* of the reference: the same single process with every initial weight
  multiplied by (1 + 1e-7 * noise), i.e. perturbed at the level of float32 rounding. RL training
  amplifies such differences (sampling is discrete, Adam normalises tiny gradients), so the twin
  shows how far two runs that differ only by rounding can agree: a parallel run cannot be held
  to more than that.

It prints, per step, the reference's mean reward, the largest difference of any metric between
the 4-rank run and the reference (and between the twin and the reference), and both runs' step
times; then the reward's rise and the first step (if any) at which the runs differ by more than
the tolerance.

    .venv/bin/python bench/rlhf_learning.py [--steps 30] [--seed 0] [--no-spread] [PLAN ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import runpy  # noqa: E402

from plans import Layout, Mesh, PlanCall, Reallocation, save_plan  # noqa: E402
from plans.plan import Plan, load_plan  # noqa: E402
from plans.sharding import transfer_volume  # noqa: E402
from runtime.executor import PlanRunner  # noqa: E402

TOL = 1e-4
TWIN_NOISE = 1e-7


def _run(args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


W, A, B = Mesh.block(0, 4), Mesh.block(0, 2), Mesh.block(2, 2)
SPREAD = {  # per example: call (or model) -> (mesh, layout)
    "tiny_ppo": {"actor_train": (A, Layout(tp=2, micro_batches=2, sequence_parallel=True)),
                 "actor_generate": (W, Layout(tp=4)), "ref": (B, Layout(pp=2, micro_batches=2)),
                 "critic_train": (W, Layout(dp=2, pp=2, zero=1, micro_batches=2)),
                 "critic_inference": (B, Layout(dp=2))},
    "tiny_grpo": {"actor_train": (W, Layout(dp=2, tp=2, zero=3, micro_batches=2, sequence_parallel=True)),
                  "actor_generate": (A, Layout(tp=2)), "ref": (B, Layout(dp=2))},
}


def spread_plan(compiled: Plan, name: str) -> Plan:
    """`compiled` with its calls placed by hand (`SPREAD`), listing the reallocations the
    compiler would: each non-home call whose placement holds other slices than its home's."""
    graph = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["graph"]
    where = {c.name: SPREAD[name].get(c.name) or SPREAD[name][c.model] for c in graph.calls}
    homes = graph.home_calls()
    moves = []
    for c in graph.calls:
        home = homes[c.model]
        if home != c.name and where[c.name] != where[home]:
            decl = graph.models[c.model]
            vol = transfer_volume(decl.spec, head=decl.head, src=where[home], dst=where[c.name],
                                  gpus_per_node=compiled.cluster.gpus_per_node)
            moves.append(Reallocation(model=c.model, from_call=home, to_call=c.name, bytes=2 * vol.moved_numel,
                                      est_time_s=0))
    calls = [PlanCall(**c.model_dump(), mesh=where[c.name][0], layout=where[c.name][1], est_start_s=0, est_time_s=0,
                      est_peak_mem_bytes=0) for c in graph.calls]
    return compiled.model_copy(update={"name": f"{name}_spread", "calls": calls, "reallocations": moves,
                                       "transfers": []})


def twin_run(plan_path: Path, *, steps: int, seed: int) -> list[dict]:
    """The reference with its initial weights perturbed at float32 rounding level."""
    torch.set_num_threads(1)
    runner = PlanRunner(load_plan(plan_path), rank=0, world_size=1, reference=True, seed=seed,
                        dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for model in runner.homes.values():
            for p in model.shard.params.values():
                p.mul_(1 + TWIN_NOISE * torch.randn(p.shape, generator=gen))
    return [runner.step(s) for s in range(1, steps + 1)]


def max_diff(a: dict, b: dict) -> tuple[float, str]:
    return max(((abs(a[k] - b[k]), k) for k in b if not k.endswith("time_s") and k in a), default=(0.0, ""))


def bench(plan_path: Path, *, steps: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        par_path, ref_path = Path(tmp, "par.jsonl"), Path(tmp, "ref.jsonl")
        common = ["--steps", str(steps), "--seed", str(seed)]
        _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "runtime", str(plan_path),
              *common, "--metrics-out", str(par_path)])
        _run(["-m", "runtime", str(plan_path), "--reference", *common, "--metrics-out", str(ref_path)])
        par, ref = _metrics(par_path), _metrics(ref_path)
    twin = twin_run(plan_path, steps=steps, seed=seed)
    plan = load_plan(plan_path)
    print(f"\n== {plan.name}: {len({c.mesh for c in plan.calls})} meshes, "
          f"{len(plan.reallocations)} reallocation(s) per step "
          f"({', '.join(f'{r.model} {r.from_call}->{r.to_call} {r.bytes / 1024:.0f} KiB bf16' for r in plan.reallocations)})")
    print(f"{'step':>4} {'reward':>7} {'4 ranks - ref':>14} {'twin - ref':>11} {'4-rank s':>9} {'ref s':>6}  largest difference in")
    diffs, twins = [], []
    for p, r, t in zip(par, ref, twin):
        d, key = max_diff(p, r)
        dt, _ = max_diff(t, r)
        diffs.append(d)
        twins.append(dt)
        print(f"{r['step']:>4} {r['reward_mean']:>7.3f} {d:>14.1e} {dt:>11.1e} {p['time_s']:>9.2f} {r['time_s']:>6.2f}  {key}")
    reward = [r["reward_mean"] for r in ref]
    parted = next((i + 1 for i, d in enumerate(diffs) if d > TOL), None)
    twin_parted = next((i + 1 for i, d in enumerate(twins) if d > TOL), None)
    first, last = sum(reward[:3]) / 3, sum(reward[-5:]) / 5
    print(f"reward: first 3 steps {first:.3f} -> last 5 steps {last:.3f} (random: 0.25, learned: 1.0)")
    print(f"4 ranks vs reference: largest metric difference over {steps} steps {max(diffs):.1e} "
          f"(tolerance {TOL:g}); {'never exceeds it' if parted is None else f'first exceeds it at step {parted}'}")
    print(f"float-noise twin vs reference: largest {max(twins):.1e}; "
          f"{'never exceeds it' if twin_parted is None else f'first exceeds it at step {twin_parted}'}")
    print(f"mean step time: 4 ranks {sum(p['time_s'] for p in par) / steps:.2f} s, "
          f"reference {sum(r['time_s'] for r in ref) / steps:.2f} s")
    return {"plan": plan.name, "reward_first": first, "reward_last": last, "max_diff": max(diffs), "parted": parted,
            "twin_parted": twin_parted}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plans", nargs="*", default=[str(ROOT / "plans" / "tiny_ppo.json"),
                                                  str(ROOT / "plans" / "tiny_grpo.json")])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-spread", action="store_true", help="skip the hand-placed variants of the tiny examples")
    args = ap.parse_args()
    for path in args.plans:
        if not Path(path).is_file():
            raise SystemExit(f"no plan {path}; compile it first: planner compile examples/{Path(path).stem}.py -o {path}")
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(p) for p in args.plans]
        if not args.no_spread:
            for path in list(paths):
                if path.stem in SPREAD:
                    paths.append(Path(tmp, f"{path.stem}_spread.json"))
                    save_plan(spread_plan(load_plan(path), path.stem), paths[-1])
        for path in paths:
            bench(path, steps=args.steps, seed=args.seed)


if __name__ == "__main__":
    main()
