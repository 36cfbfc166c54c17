"""Separate prefill and decode layouts (Seesaw): what the search gains by them, under the cost model.

Each workload is compiled twice by the same search, once with every generate call on one layout
(`SearchSpace(split_decode=False)`) and once as `planner compile` does by default, where a generate
call may prefill with one layout (for prompts of 16k tokens or more, context parallel among
them) and decode with another on the same GPUs, paying for moving the weights and the prefilled
KV cache between them (`CostModel.realloc_cost`, `kv_reshard_cost`).
It prints both plans' generate layouts, iteration times, the win and the compile times. Only
the planner's runtime (framework torch) runs such plans: the RLHF engines' stacks (vllm,
rlhf-engine, rlhf-engine-hf, verl-fsdp) decode where they prefill, so their plans never split. The
runtime runs such plans (`tests/test_runtime_seesaw.py`: 4 gloo ranks equal to the reference,
exactly the elements charged moved). Last, a workload of few long sequences: its generate call as
compiled (a context-parallel prefill, then KV-parallel decode, Mnemosyne's KVP: each rank attends
to its share of every sequence's cache and the shares are combined) against the best layout on
the same GPUs that keeps whole sequences.

    python bench/seesaw.py [--smoke]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models import CallCost, CostModel  # noqa: E402
from planner.algorithms import grpo  # noqa: E402
from planner.candidates import SearchSpace, costed_view, layouts_for  # noqa: E402
from planner.compile import compile_graph  # noqa: E402
from plans import parse_cluster  # noqa: E402

WORKLOADS = [
    # long prompts: the prefill is compute-bound, the decode bound by reading weights and cache
    ("GRPO qwen2.5-7b, 8k prompts, 512 new tokens, 8 H100s, torch",
     dict(actor="qwen2.5-7b", batch=32, samples_per_prompt=4, prompt_len=8192, gen_len=512), "h100-sxm:1x8", "torch"),
    # prompts of 32k tokens: the prefill also splits each prompt over context-parallel ranks
    ("GRPO qwen2.5-7b, 32k prompts, 256 new tokens, 8 H100s, torch",
     dict(actor="qwen2.5-7b", batch=8, samples_per_prompt=4, prompt_len=32768, gen_len=256), "h100-sxm:1x8", "torch"),
    ("GRPO llama-3-8b, 2k prompts, 1k new tokens, 8 H100s, torch",
     dict(actor="llama-3-8b", batch=64, samples_per_prompt=8, prompt_len=2048, gen_len=1024), "h100-sxm:1x8", "torch"),
]


# KV-parallel decode: few sequences with long prompts, so data parallel cannot split them
KVP = ("GRPO qwen2.5-7b, one 64k prompt x 2 samples, 1k new tokens, 8 H100s, torch",
       dict(actor="qwen2.5-7b", batch=1, samples_per_prompt=2, prompt_len=65536, gen_len=1024), "h100-sxm:1x8", "torch")


def kv_parallel(smoke: bool) -> None:
    """The plan's generate call against the best layout for it on the same GPUs that keeps whole
    sequences (cp 1), both costed by the same model: a context-parallel prefill, then KV-parallel
    decode (each rank a share of every sequence's cache) where the search picks it."""
    name, kw, cluster, fw = KVP
    g = grpo(kw.pop("actor"), reward_fn="runtime.tasks:pattern_reward", **kw)
    plan = compile_graph(g, parse_cluster(cluster), framework=fw, time_limit_s=2 if smoke else 10)
    (gen,) = [c for c in plan.calls if c.kind == "generate"]
    cm = CostModel(plan.cluster, framework=fw)
    view = costed_view(gen, plan.models[gen.model])
    chosen = cm.call_cost(gen, view, gen.mesh, gen.layout, decode_layout=gen.decode_layout)
    whole = [(cm.call_cost(gen, view, gen.mesh, lay), lay) for lay in layouts_for(gen, view, gen.mesh.size, plan.cluster)
             if lay.cp == 1]
    fits = [(c, lay) for c, lay in whole if c.peak_mem_bytes <= plan.cluster.usable_mem_bytes]
    best, lay = min(fits, key=lambda x: x[0].time_s)
    layouts = gen.layout.short() + (f" / decode {gen.decode_layout.short()}" if gen.decode_layout else "")

    def parts(c: CallCost) -> str:
        return ", ".join(f"{k} {v:.2f} s" for k, v in c.breakdown_s.items())

    print(f"  chosen:            generate {layouts:<32} {chosen.time_s:7.2f} s ({parts(chosen)})")
    print(f"  best with cp 1:    generate {lay.short():<32} {best.time_s:7.2f} s ({parts(best)})")
    print(f"  the generate call is {best.time_s / chosen.time_s:.2f}x faster"
          f" ({'KV parallel chosen' if max(gen.layout.cp, (gen.decode_layout or gen.layout).cp) > 1 else 'no cp chosen'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="the first workload only, a 2 s search budget")
    args = ap.parse_args()
    for name, kw, cluster, fw in WORKLOADS[:1] if args.smoke else WORKLOADS:
        g = grpo(kw.pop("actor"), reward_fn="runtime.tasks:pattern_reward", **kw)
        out = {}
        for split in (False, True):
            t0 = time.perf_counter()
            plan = compile_graph(g, parse_cluster(cluster), framework=fw, space=SearchSpace(split_decode=split),
                                 time_limit_s=2 if args.smoke else 10)
            (gen,) = [c for c in plan.calls if c.kind == "generate"]
            layouts = gen.layout.short() + (f" / decode {gen.decode_layout.short()}" if gen.decode_layout else "")
            out[split] = (plan.estimate.iteration_s, gen.est_time_s, layouts, time.perf_counter() - t0)
        (a, ga, la, ta), (b, gb, lb, tb) = out[False], out[True]
        print(f"\n== {name}")
        print(f"  one layout:      generate {la:<40} {ga:7.2f} s   iteration {a:7.2f} s   compile {ta:5.1f} s")
        print(f"  split (default): generate {lb:<40} {gb:7.2f} s   iteration {b:7.2f} s   compile {tb:5.1f} s")
        print(f"  split decode wins {100 * (a - b) / a:.2f}% of the iteration"
              f" ({'chosen' if 'decode' in lb else 'not chosen: one layout is best'})")
    print(f"\n== {KVP[0]}")
    kv_parallel(args.smoke)


if __name__ == "__main__":
    main()
