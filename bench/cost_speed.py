"""Speed of the cost model as the search uses it: one `call_cost` per (call, candidate layout).

For each bundled example graph, every call is costed under every layout the search enumerates
(`planner.candidates.layouts_for`) on every mesh size, first on a fresh `CostModel` (nothing
cached: what the search pays) and then again (cached). Reallocation costs between the first
layouts of consecutive calls on a model are timed the same way. Target: well under 1 ms per
uncached estimate on average.

Run: ``python bench/cost_speed.py``.
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models import CostModel  # noqa: E402
from planner.candidates import SearchSpace, layouts_for, mesh_sizes  # noqa: E402
from plans import Mesh, parse_cluster  # noqa: E402

EXAMPLES = ["ppo_llama7b.py", "grpo_qwen7b.py", "sft_llama3_70b.py", "tiny_ppo.py"]
TARGET_MS = 1.0


def pairs(graph, cluster):
    out = []
    for size in mesh_sizes(cluster, SearchSpace()):
        mesh = Mesh.block(0, size)
        for call in graph.calls:
            decl = graph.models[call.model]
            view = decl if call.kind == "train" else decl.model_copy(update={"trainable": False})
            for lay in layouts_for(call, decl, size, cluster):
                out.append((call, view, mesh, lay))
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help; no options
    print(f"{'example':18s} {'cluster':14s} {'pairs':>6s} {'uncached ms/call':>17s} {'cached us/call':>15s}"
          f" {'realloc ms (first)':>19s}")
    worst = 0.0
    all_uncached = []
    for name in EXAMPLES:
        ns = runpy.run_path(str(ROOT / "examples" / name))
        graph, cluster = ns["graph"], parse_cluster(ns["CLUSTER"])
        work = pairs(graph, cluster)
        cm = CostModel(cluster)
        t0 = time.perf_counter()
        for call, decl, mesh, lay in work:
            cm.call_cost(call, decl, mesh, lay)
        uncached = (time.perf_counter() - t0) / len(work)
        t0 = time.perf_counter()
        for call, decl, mesh, lay in work:
            cm.call_cost(call, decl, mesh, lay)
        cached = (time.perf_counter() - t0) / len(work)
        # Reallocations between the first few layouts of a model's calls on the full mesh.
        full = Mesh.block(0, cluster.world_size)
        by_model: dict[str, list] = {}
        for call, _decl, mesh, lay in work:
            if mesh == full:
                by_model.setdefault(call.model, []).append(lay)
        realloc = []
        for model, lays in by_model.items():
            decl = graph.models[model]
            for src, dst in zip(lays[:6], lays[1:7]):
                t1 = time.perf_counter()
                cm.realloc_cost(decl, (full, src), (full, dst))
                realloc.append(time.perf_counter() - t1)
        all_uncached.append(uncached)
        worst = max(worst, uncached)
        r = f"{1e3 * statistics.median(realloc):.2f}" if realloc else "-"
        print(f"{name:18s} {cluster.short():14s} {len(work):6d} {1e3 * uncached:17.3f} {1e6 * cached:15.2f} {r:>19s}")
    mean = statistics.mean(all_uncached)
    print(f"\nmean uncached estimate {1e3 * mean:.3f} ms, worst example {1e3 * worst:.3f} ms "
          f"(target < {TARGET_MS:g} ms): {'met' if worst < TARGET_MS else 'NOT met'}")


if __name__ == "__main__":
    main()
