"""``python -m runtime PLAN.json``: run a plan under torchrun, or in one process with --reference.

    torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 30 --metrics-out m.jsonl
    python -m runtime plans/tiny_ppo.json --reference --steps 30 --metrics-out ref.jsonl
    torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 10 --trace-out run.trace.json
    planner timeline plans/tiny_ppo.json --measured run.trace.json -o vs.png

Both write one JSON object per step (the same keys), so the two runs compare line by line; rank 0
prints a progress line per step (`runtime.observe`, silenced by --quiet). --trace-out writes the
measured timeline of all ranks as one planner trace (`plans.trace`). Problems with the plan or the
launch are reported on every rank as one message, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from plans.errors import PlannerError
from plans.plan import load_plan, write_text_atomic
from runtime.executor import PlanRunner
from runtime.observe import gather_events, progress_line, write_measured_trace

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TIMEOUT = timedelta(minutes=10)  # a hung collective fails instead of blocking forever


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runtime", description="Execute a compiled plan.")
    ap.add_argument("plan", help="plan JSON written by `planner compile`")
    ap.add_argument("--steps", type=int, default=1, help="iterations to run (default 1)")
    ap.add_argument("--metrics-out", help="write one JSON object per step to this .jsonl file (rank 0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, data and sampling (default 0)")
    ap.add_argument("--reference", action="store_true", help="run every call in this one process, unsharded")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="compute dtype (default float32)")
    ap.add_argument("--trace-out", help="write the measured timeline of every rank to this trace JSON (rank 0)")
    ap.add_argument("--quiet", action="store_true", help="print no progress lines")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    return args


def run(args: argparse.Namespace) -> None:
    """Check the launch against the plan, run the steps, write metrics and the trace (rank 0)."""
    plan = load_plan(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.reference and world != 1:
        raise PlannerError(f"--reference runs in one process, but this launch has {world} ranks",
                           hint="run `python -m runtime PLAN.json --reference` without torchrun")
    if not args.reference and world != plan.cluster.world_size:
        raise PlannerError(
            f"plan {args.plan!r} is for {plan.cluster.world_size} ranks ({plan.cluster.short()}) "
            f"but this launch has {world}",
            hint=f"launch with torchrun --nproc-per-node {plan.cluster.gpus_per_node} --nnodes {plan.cluster.nodes}, "
            "or add --reference to run it in one process")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    distributed = not args.reference and world > 1
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
    try:
        runner = PlanRunner(plan, rank=rank, world_size=world, reference=args.reference, seed=args.seed,
                            dtype=DTYPES[args.dtype], device=device, trace=args.trace_out is not None)
        lines: list[str] = []
        for step in range(1, args.steps + 1):
            metrics = runner.step(step)
            if rank == 0:
                lines.append(json.dumps(metrics, sort_keys=True))
                if args.metrics_out:
                    write_text_atomic(args.metrics_out, "\n".join(lines) + "\n")
                if not args.quiet:
                    print(progress_line(metrics, plan=plan, steps=args.steps), flush=True)
        if args.trace_out:
            events = gather_events(runner.recorder.events, distributed=distributed, rank=rank, world_size=world)
            if events is not None:
                write_measured_trace(args.trace_out, events, plan=plan, world_size=world, steps=args.steps,
                                     reference=args.reference)
    finally:
        if distributed:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        run(args)
    except PlannerError as e:
        rank = os.environ.get("RANK", "0")
        print(f"error (rank {rank}): {e}", file=sys.stderr, flush=True)
        return PlannerError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
