"""Parameter reallocation on 4 gloo ranks: bandwidth against a plain broadcast, bytes against the minimum.

For a 110M-parameter Llama-shaped model (fp32, 440 MB) and several (mesh, layout) pairs (the
tiny PPO plan's train -> generate move, re-shardings on one mesh, disjoint meshes, a ZeRO-3
source), this measures `runtime.realloc.reallocate` side by side with
``torch.distributed.broadcast`` of a buffer holding the same total bytes, from the first rank to
the same ranks (all ranks of both meshes), interleaved and repeated, median times. It prints:

- bytes moved (counted from the buffers sent) and the minimum any reallocation must move: every
  element each destination rank needs and does not already hold under the source layout
  (computed here from `plans.sharding.shard_box` intersections, independently of the transfer
  plan); the aim is a ratio of 1.0;
- achieved bandwidth (bytes moved / time) of the reallocation and of the broadcast, and their
  ratio (aim: at least 0.8).

    .venv/bin/python bench/realloc.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plans import Layout, Mesh, ModelSpec  # noqa: E402
from plans.sharding import box_numel, intersect, parameters, shard_box  # noqa: E402
from runtime.model import init_tensor  # noqa: E402
from runtime.realloc import rank_plan, reallocate  # noqa: E402

WORLD = 4
GPN = 4
SPEC = ModelSpec(model_type="llama", hidden_size=1024, num_hidden_layers=6, num_attention_heads=16,
                 num_key_value_heads=16, intermediate_size=2816, vocab_size=16000, max_position_embeddings=512)
W, A, B = Mesh.block(0, 4), Mesh.block(0, 2), Mesh.block(2, 2)
CASES = [
    ("train [0-1] dp1 tp2 -> generate [0-3] tp4", (A, Layout(tp=2)), (W, Layout(tp=4))),
    ("[0-3] dp2 tp2 -> [0-3] pp4", (W, Layout(dp=2, tp=2)), (W, Layout(pp=4))),
    ("[0-3] pp4 -> [0-3] tp4", (W, Layout(pp=4)), (W, Layout(tp=4))),
    ("[0-3] dp2 pp2 -> [0-3] dp2 tp2", (W, Layout(dp=2, pp=2)), (W, Layout(dp=2, tp=2))),
    ("[0-1] tp2 -> [2-3] tp2 (disjoint)", (A, Layout(tp=2)), (B, Layout(tp=2))),
    ("[0-3] dp4 ZeRO-3 -> [0-3] tp4", (W, Layout(dp=4, zero=3)), (W, Layout(tp=4))),
]


def minimum_numel(src: tuple[Mesh, Layout], dst: tuple[Mesh, Layout]) -> int:
    """Elements every destination rank needs and does not hold under the source layout."""
    total = 0
    for rank in dst[0].ranks:
        for p in parameters(SPEC):
            need = shard_box(p, SPEC, dst[1], dst[0].ranks.index(rank))
            if need is None:
                continue
            held = shard_box(p, SPEC, src[1], src[0].ranks.index(rank)) if rank in src[0].ranks else None
            overlap = intersect(need, held) if held is not None else None
            total += box_numel(need) - (box_numel(overlap) if overlap is not None else 0)
    return total


def _worker(rank: int, port: int, repeats: int, cases: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cpu = torch.device("cpu")
    rows = []
    for name, src, dst in CASES[:cases]:
        held = {}
        if rank in src[0].ranks:
            local = src[0].ranks.index(rank)
            for p in parameters(SPEC):
                box = shard_box(p, SPEC, src[1], local)
                if box is not None:
                    held[p.name] = init_tensor(p, seed=0)[tuple(slice(*b) for b in box)].clone()
        plan = rank_plan(SPEC, head="lm", src=src, dst=dst, rank=rank, gpus_per_node=GPN)
        ranks = sorted(set(src[0].ranks) | set(dst[0].ranks))
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        sent = torch.tensor([0])
        t_realloc, t_bcast = [], []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            _, traffic = reallocate(plan, held, device=cpu)
            dist.barrier()
            t_realloc.append(time.perf_counter() - t0)
            sent = torch.tensor([sum(traffic.sent.values()) * traffic.element_bytes])
            dist.all_reduce(sent)
            buf = torch.empty(int(sent) // 4, dtype=torch.float32)
            dist.barrier()
            t0 = time.perf_counter()
            if rank in ranks:
                dist.broadcast(buf, ranks[0], group=group)
            dist.barrier()
            t_bcast.append(time.perf_counter() - t0)
        rows.append({"case": name, "bytes": int(sent), "min_bytes": minimum_numel(src, dst) * 4,
                     "realloc_s": statistics.median(t_realloc), "bcast_s": statistics.median(t_bcast)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs of each case; the median is reported (default 5)")
    ap.add_argument("--cases", type=int, default=len(CASES), help=f"run the first N cases (default all {len(CASES)})")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp, "rows.json"))
        mp.spawn(_worker, args=(port, args.repeats, args.cases, out), nprocs=WORLD, join=True)
        rows = json.loads(Path(out).read_text())
    params = sum(p.numel for p in parameters(SPEC))
    print(f"model: {params / 1e6:.1f}M parameters, fp32 ({params * 4 / 1e6:.0f} MB); 4 gloo ranks on "
          f"{os.cpu_count()} CPU cores; medians of {args.repeats} runs\n")
    print(f"{'reallocation':<44} {'moved MB':>9} {'moved/min':>9} {'realloc GB/s':>12} {'bcast GB/s':>10} {'ratio':>6}")
    for r in rows:
        bw, bw_b = r["bytes"] / r["realloc_s"] / 1e9, r["bytes"] / r["bcast_s"] / 1e9
        ratio_min = r["bytes"] / r["min_bytes"] if r["min_bytes"] else float("nan")
        print(f"{r['case']:<44} {r['bytes'] / 1e6:>9.1f} {ratio_min:>9.3f} {bw:>12.2f} {bw_b:>10.2f} {bw / bw_b:>6.2f}")
    print("\nratio: reallocation bandwidth / broadcast bandwidth for the same total bytes on the same ranks (aim >= 0.8)")
    print("moved/min: bytes sent / bytes the destination ranks lack under the source layout (aim 1.0)")


if __name__ == "__main__":
    main()
