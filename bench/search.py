"""Search benchmark: wall time, plan quality, certified gap, and speedup over fair baselines.

    python bench/search.py                  # the whole suite (about two minutes on 2 cores)
    python bench/search.py --only ppo-7b    # one instance
    python bench/search.py --exhaustive     # also check enumerable instances against brute force
    python bench/search.py --node-ranges    # also search ReaLHF's wider mesh space, side by side
                                            # (the 3-, 6- and 12-node instances are searched in both always)
    python bench/search.py --no-old-space   # skip the search in the space before offload
    python bench/search.py --only grpo-7b-1gpu   # one of the GaLore instances (AdamW beside GaLore)

Besides the main table (the default space), every instance is searched again in the space before
offload (`SearchSpace(offload=False)`: every state on the GPU) and the two plans are printed side
by side, with the calls whose states the new plan keeps in host memory. Then the instances where
memory binds (`GALORE_SUITE`) are searched with AdamW only and with a GaLore optimizer allowed,
and clusters whose node count is no power of two (`NODE_RANGE_SUITE`: 3, 6, 12 nodes) in the aligned
space and in ReaLHF's node ranges (the default space there: `planner.candidates.node_ranges_on`).

Suite (batch 512, prompt 1024, generation 1024 unless stated), as in issue 4. Each baseline is
the best plan its rule allows (`planner.baselines`). Speedup = baseline iteration / plan iteration.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.algorithms import grpo, ppo, sft  # noqa: E402
from planner.baselines import BASELINES  # noqa: E402
from planner.compile import compile_graph  # noqa: E402
from plans.cluster import parse_cluster  # noqa: E402
from plans.errors import PlannerError  # noqa: E402
from plans.graph import Graph  # noqa: E402
from plans.layout import GaLore  # noqa: E402

PPO = dict(batch=512, prompt_len=1024, gen_len=1024, ppo_minibatches=4)


@dataclass(frozen=True)
class Instance:
    name: str
    cluster: str
    graph: Graph
    rlhf: bool
    limit_s: float  # the wall-clock target of issue 4


SUITE = [
    Instance("ppo-7b", "a100-80gb:2x8", ppo("llama-2-7b", reward="llama-2-7b", name="ppo_7b", **PPO), True, 10),
    Instance("ppo-13b", "a100-80gb:4x8", ppo("llama-2-13b", reward="llama-2-13b", name="ppo_13b", **PPO), True, 10),
    Instance("ppo-34b-7b", "a100-80gb:4x8",
             ppo("codellama-34b", critic="llama-2-7b", reward="llama-2-7b", name="ppo_34b_7b", **PPO), True, 10),
    Instance("ppo-70b", "a100-80gb:16x8", ppo("llama-2-70b", reward="llama-2-70b", name="ppo_70b", **PPO), True, 10),
    Instance("grpo-qwen7b", "h100-sxm:1x8",
             grpo("qwen2.5-7b", reward="qwen2.5-7b", batch=512, prompt_len=1024, gen_len=1024, samples_per_prompt=8,
                  ppo_minibatches=4, name="grpo_qwen7b"), True, 10),
    Instance("sft-70b", "h100-sxm:8x8", sft("llama-3-70b", batch=512, seq_len=4096, name="sft_70b"), False, 10),
    Instance("sft-405b", "h100-sxm:128x8", sft("llama-3-405b", batch=512, seq_len=4096, name="sft_405b"), False, 60),
]

# Clusters whose node count is no power of two: the aligned space has holes there (no mesh between
# one node and all three), ReaLHF's (`SearchSpace.node_ranges`, on by default on these) places calls
# on 2 of 3 nodes, 4 of 6, 7 of 12 too.
NODE_RANGE_SUITE = [
    Instance("grpo-7b-3node", "a100-80gb:3x8",
             grpo("llama-2-7b", batch=512, prompt_len=1024, gen_len=1024, samples_per_prompt=8, ppo_minibatches=4,
                  name="grpo_7b_3node"), True, 10),
    Instance("ppo-7b-3node", "a100-80gb:3x8", ppo("llama-2-7b", reward="llama-2-7b", name="ppo_7b_3node", **PPO),
             True, 10),
    Instance("ppo-70b-6node", "a100-80gb:6x8", ppo("llama-2-70b", reward="llama-2-70b", name="ppo_70b_6node", **PPO),
             True, 10),
    Instance("ppo-13b-12node", "a100-80gb:12x8",
             ppo("llama-2-13b", critic="llama-2-7b", reward="llama-2-7b", name="ppo_13b_12node", **PPO), True, 10),
]

# Where memory binds: AdamW's states against a GaLore optimizer's (`--galore-rank 512`), the space
# with GaLore opt-in (`SearchSpace.galore`; it changes the optimizer). Fine-tuning 7B models on
# one or two GPUs, GaLore's own setting (Zhao et al. 2024 pre-train 7B on one 24 GB GPU).
GALORE = GaLore(rank=512)
GALORE_SUITE = [
    Instance("sft-7b-1gpu", "h100-sxm:1x1", sft("llama-2-7b", batch=64, seq_len=2048, name="sft_7b_1gpu"), False, 10),
    Instance("grpo-7b-1gpu", "h200:1x1",
             grpo("llama-2-7b", batch=32, prompt_len=512, gen_len=512, samples_per_prompt=4, name="grpo_7b_1gpu"),
             True, 10),
    Instance("grpo-7b-2gpu", "h100-sxm:1x2",
             grpo("llama-2-7b", batch=64, prompt_len=512, gen_len=512, samples_per_prompt=4, name="grpo_7b_2gpu"),
             True, 10),
]


def galore_row(inst: Instance, *, time_limit_s: float) -> str:
    """The instance searched with AdamW only (the default space) and with GaLore allowed."""
    from planner.candidates import SearchSpace

    cluster = parse_cluster(inst.cluster)
    out = []
    for space in (SearchSpace(), SearchSpace(galore=GALORE)):
        t0 = time.perf_counter()
        try:
            plan = compile_graph(inst.graph, cluster, time_limit_s=time_limit_s, space=space)
        except PlannerError as e:
            out.append((None, time.perf_counter() - t0, e.message.splitlines()[0]))
            continue
        low = [f"{c.name} {c.layout.short()}" for c in plan.calls if c.layout.galore is not None]
        out.append((plan, time.perf_counter() - t0, "; ".join(low) or "none"))

    def cell(plan, wall: float) -> str:  # noqa: ANN001
        if plan is None:
            return f"{'no plan':>9} ({wall:>4.1f}s)          "
        return f"{plan.estimate.iteration_s:>8.2f}s ({wall:>4.1f}s, gap {(plan.search.gap or 0) * 100:>4.1f}%)"

    (adam, t_adam, why), (low, t_low, chosen) = out
    if low is None:
        return f"{inst.name:<12} AdamW {cell(adam, t_adam)}  GaLore: {chosen}"
    gain = f"{adam.estimate.iteration_s / low.estimate.iteration_s:.3f}x" if adam is not None else "fits only with GaLore"
    note = f"  (AdamW: {why})" if adam is None else ""
    return f"{inst.name:<12} AdamW {cell(adam, t_adam)}  with GaLore {cell(low, t_low)}  {gain}  GaLore on: {chosen}{note}"


def run(inst: Instance, *, time_limit_s: float) -> dict:
    cluster = parse_cluster(inst.cluster)
    t0 = time.perf_counter()
    plan = compile_graph(inst.graph, cluster, time_limit_s=time_limit_s)
    wall = time.perf_counter() - t0
    row = {"instance": inst.name, "gpus": cluster.world_size, "wall_s": wall, "iteration_s": plan.estimate.iteration_s,
           "lower_bound_s": plan.search.lower_bound_s, "gap": plan.search.gap, "status": plan.search.status,
           "limit_s": inst.limit_s,
           "offloaded": [(c.name, c.layout.offload) for c in plan.calls if c.layout.offload != "none"]}
    for b in BASELINES if inst.rlhf else ():
        try:
            base = compile_graph(inst.graph, cluster, time_limit_s=time_limit_s, baseline=b)
            row[b] = base.estimate.iteration_s / plan.estimate.iteration_s
        except PlannerError as e:
            row[b] = None
            row[f"{b}_why"] = e.message
    return row


def node_ranges_row(inst: Instance, *, time_limit_s: float, aligned: dict | None = None) -> str:
    """The instance searched again with runs of consecutive nodes and half nodes
    (`SearchSpace.node_ranges`), beside the aligned space's plan of the same run (searched here
    when not given)."""
    from planner.candidates import SearchSpace, mesh_positions, mesh_sizes

    if aligned is None:
        t0 = time.perf_counter()
        base = compile_graph(inst.graph, parse_cluster(inst.cluster), time_limit_s=time_limit_s,
                             space=SearchSpace(node_ranges=False))
        aligned = {"iteration_s": base.estimate.iteration_s, "wall_s": time.perf_counter() - t0,
                   "gap": base.search.gap or 0.0}
    t0 = time.perf_counter()
    plan = compile_graph(inst.graph, parse_cluster(inst.cluster), time_limit_s=time_limit_s,
                         space=SearchSpace(node_ranges=True))
    wall = time.perf_counter() - t0
    gain = aligned["iteration_s"] / plan.estimate.iteration_s
    cluster = parse_cluster(inst.cluster)
    blocks = SearchSpace(node_ranges=False)
    aligned_space = {m for size in mesh_sizes(cluster, blocks) for m in mesh_positions(cluster, size, blocks)}
    ranges = sorted({c.mesh.short() for c in plan.calls if c.mesh not in aligned_space})
    return (f"{inst.name:<12} aligned {aligned['iteration_s']:>8.2f}s ({aligned['wall_s']:>5.1f}s, gap "
            f"{aligned['gap'] * 100:>4.1f}%)  node ranges {plan.estimate.iteration_s:>8.2f}s ({wall:>5.1f}s, gap "
            f"{plan.search.gap * 100:>4.1f}%, {plan.search.candidates} candidates, {plan.search.status})  "
            f"{gain:.3f}x  meshes off the aligned blocks: {', '.join(ranges) or 'none'}")


def old_space_row(inst: Instance, *, time_limit_s: float, new: dict) -> str:
    """The instance searched in the space before offload, beside the default space's plan."""
    from planner.candidates import SearchSpace

    t0 = time.perf_counter()
    plan = compile_graph(inst.graph, parse_cluster(inst.cluster), time_limit_s=time_limit_s,
                         space=SearchSpace(offload=False))
    wall = time.perf_counter() - t0
    gain = plan.estimate.iteration_s / new["iteration_s"]
    off = ", ".join(f"{name} ({kind})" for name, kind in new["offloaded"]) or "none"
    return (f"{inst.name:<12} old space {plan.estimate.iteration_s:>8.2f}s ({wall:>5.1f}s, gap "
            f"{(plan.search.gap or 0) * 100:>4.1f}%)  new space {new['iteration_s']:>8.2f}s ({new['wall_s']:>5.1f}s, "
            f"gap {(new['gap'] or 0) * 100:>4.1f}%)  {gain:.3f}x  offloaded: {off}")


def exhaustive_check(inst: Instance) -> str:
    """Beam + CP-SAT against brute force on the instance restricted to an enumerable space."""
    from cost_models import CostModel
    from planner.candidates import SearchSpace
    from planner.compile import search
    from planner.exhaustive import exhaustive
    from planner.problem import build_problem

    cm = CostModel(parse_cluster(inst.cluster))
    space = SearchSpace(max_blocks=2, keep_per_size=1)
    problem = build_problem(inst.graph, cm, space)
    t0 = time.perf_counter()
    truth = exhaustive(problem)
    t_brute = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = search(problem, time_limit_s=10)
    t_search = time.perf_counter() - t0
    n = 1
    for s in problem.slots:
        n *= len(s.cands)
    if truth is None:
        return f"{inst.name:<12} {n:>8} assignments: nothing fits; search {'agrees' if found is None else 'DISAGREES'}"
    got = found[1].iteration_s if found else float("nan")
    same = abs(got - truth[0]) <= 1e-6 * truth[0]
    return (f"{inst.name:<12} {n:>8} assignments  brute force {truth[0]:.3f}s ({t_brute:.1f}s)  "
            f"search {got:.6f}s ({t_search:.1f}s) vs {truth[0]:.6f}  {'equal' if same else 'DIFFERENT'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated instance names")
    ap.add_argument("--time-limit", type=float, default=None, help="override each instance's limit (seconds)")
    ap.add_argument("--exhaustive", action="store_true", help="also compare against brute force on restricted spaces")
    ap.add_argument("--no-old-space", action="store_true",
                    help="skip searching each instance again in the space before offload")
    ap.add_argument("--no-galore", action="store_true",
                    help="skip the instances where memory binds, searched with AdamW only and with GaLore allowed")
    ap.add_argument("--node-ranges", action="store_true",
                    help="also search each instance with runs of consecutive nodes and half nodes (ReaLHF's space)")
    args = ap.parse_args()
    chosen = [i for i in SUITE if not args.only or i.name in args.only.split(",")]
    rows = []
    hdr = f"{'instance':<12} {'GPUs':>5} {'wall':>7} {'target':>7} {'iteration':>10} {'bound':>10} {'gap':>6} " \
          f"{'status':>9} " + " ".join(f"{'vs ' + b:>12}" for b in BASELINES)
    print(hdr)
    print("-" * len(hdr))
    for inst in chosen:
        limit = args.time_limit if args.time_limit is not None else inst.limit_s
        r = run(inst, time_limit_s=limit)
        rows.append(r)
        speed = " ".join(f"{(f'{r[b]:.2f}x' if r.get(b) else '-'):>12}" for b in BASELINES)
        ok = "ok" if r["wall_s"] <= inst.limit_s and (r["gap"] or 0) <= 0.05 else "MISS"
        print(f"{r['instance']:<12} {r['gpus']:>5} {r['wall_s']:>6.1f}s {inst.limit_s:>6.0f}s {r['iteration_s']:>9.2f}s "
              f"{r['lower_bound_s']:>9.2f}s {r['gap'] * 100:>5.1f}% {str(r['status']):>9} {speed}  {ok}", flush=True)
    best = [min(r[b] for b in BASELINES if r.get(b)) for r in rows if any(r.get(b) for b in BASELINES)]
    if best:
        geo = math.exp(sum(math.log(x) for x in best) / len(best))
        print(f"\ngeometric-mean speedup over the best baseline (RLHF instances): {geo:.2f}x")
    for r in rows:
        for b in BASELINES:
            if r.get(f"{b}_why"):
                print(f"note: {r['instance']}: baseline {b} not applicable: {r[f'{b}_why']}")
    if not args.no_old_space and chosen:
        print("\nthe space before offload (every state on the GPU) beside the default space:")
        for inst, r in zip(chosen, rows):
            limit = args.time_limit if args.time_limit is not None else inst.limit_s
            print(old_space_row(inst, time_limit_s=limit, new=r), flush=True)
    if not args.no_galore:
        print(f"\nwhere memory binds: AdamW only beside a GaLore optimizer allowed ({GALORE.short()}, planner compile "
              f"--galore-rank {GALORE.rank}):")
        for inst in GALORE_SUITE:
            if not args.only or inst.name in args.only.split(","):
                limit = args.time_limit if args.time_limit is not None else inst.limit_s
                print(galore_row(inst, time_limit_s=limit), flush=True)
    extra = [i for i in NODE_RANGE_SUITE if not args.only or i.name in args.only.split(",")]
    if args.node_ranges or extra:
        print("\nthe wider mesh space (runs of consecutive nodes, half nodes) beside the aligned blocks:")
    if args.node_ranges:
        for inst, r in zip(chosen, rows):
            limit = args.time_limit if args.time_limit is not None else inst.limit_s
            print(node_ranges_row(inst, time_limit_s=limit, aligned=r), flush=True)
    for inst in extra:  # node counts that are no power of two, searched in both spaces here
        limit = args.time_limit if args.time_limit is not None else inst.limit_s
        print(node_ranges_row(inst, time_limit_s=limit), flush=True)
    if args.exhaustive:
        print("\nexhaustive enumeration (candidate space restricted to 1 layout per mesh size, meshes >= half the cluster):")
        for inst in chosen:
            if inst.rlhf:
                print(exhaustive_check(inst), flush=True)


if __name__ == "__main__":
    main()
