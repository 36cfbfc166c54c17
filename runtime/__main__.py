"""``python -m runtime PLAN.json``: run a plan under torchrun, or in one process with --reference.

    torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 30 --metrics-out m.jsonl
    python -m runtime plans/tiny_ppo.json --reference --steps 30 --metrics-out ref.jsonl
    torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 10 --trace-out run.trace.json
    planner timeline plans/tiny_ppo.json --measured run.trace.json -o vs.png
    torchrun --nproc-per-node 4 --max-restarts 3 -m runtime plans/tiny_ppo.json --steps 100 \
        --checkpoint-dir ckpt --checkpoint-every 10 --resume auto

Both write one JSON object per step (the same keys), so the two runs compare line by line; rank 0
prints a progress line per step (`runtime.observe`, silenced by --quiet). --trace-out writes the
measured timeline of all ranks as one planner trace (`plans.trace`); --memory-out the most tensor
bytes each rank's allocator held, over the run and per call, beside the plan's estimates
(`runtime.observe.MemoryMeter`). Problems with the plan or the
launch are reported on every rank as one message, exit status 2.

Checkpoints (`runtime.checkpoint`): --checkpoint-dir DIR saves the run's state after every
--checkpoint-every K steps and after the last one, as DIR/step-NNNNNNNNN (complete or absent).
--resume auto continues from the newest complete checkpoint in DIR (a fresh start when there is
none), --resume PATH from that one, under this plan or a re-planned one (`planner replan`):
--steps counts from the run's beginning, so a restarted command runs the remaining steps, and a
resumed run computes what the uninterrupted run computes. Its --metrics-out keeps the lines of
the steps before the checkpoint. Under ``torchrun --max-restarts R`` a rank that dies makes the
group restart, and --resume auto picks up from the last checkpoint. A collective that does not
complete within --collective-timeout seconds fails the run with a message naming its call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from plans.errors import PlannerError
from plans.io import check_output, write_text_atomic
from plans.plan import Plan, load_plan
from runtime.checkpoint import CheckpointOptions, claim_directory, resume, save_checkpoint, seed_process
from runtime.executor import DEFAULT_TIMEOUT_S, PlanRunner, check_runnable
from runtime.faults import FaultHooks, SharedError
from runtime.groups import init_default_group
from runtime.observe import MemoryMeter, gather_events, progress_line, write_measured_trace, write_memory
from runtime.process import Interrupted, Interrupts, cpu_threads, device_problem, memory_problem, watch_parent
from runtime.save_hf import DEFAULT_SHARD_MB, check_save_dir, save_hf

LEAVE_TIMEOUT_S = 30.0  # how long a rank that reported a shared problem waits for the others to report it too
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXAMPLES = """examples:
  torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 30 --metrics-out m.jsonl
  python -m runtime plans/tiny_ppo.json --reference --steps 30 --metrics-out ref.jsonl
  torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 10 --trace-out run.trace.json
  torchrun --nproc-per-node 4 --max-restarts 3 -m runtime plans/tiny_ppo.json --steps 100 \\
      --checkpoint-dir ckpt --checkpoint-every 10 --resume auto
  planner replan plans/tiny_ppo.json --cluster cpu:1x2 -o tiny_ppo_2.json
  torchrun --nproc-per-node 2 -m runtime tiny_ppo_2.json --steps 100 --checkpoint-dir ckpt --resume auto
  torchrun --nproc-per-node 4 -m runtime plans/tiny_ppo.json --steps 20 --save-hf out/   # out/actor, out/critic

A checkpoint is DIR/step-NNNNNNNNN, complete or absent; --steps counts from the run's start, so a
restarted command runs the remaining steps. Errors are one message on every rank, exit status 2."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runtime", description="Execute a compiled plan: under torchrun "
                                 "(one rank per GPU of the plan's cluster), or in one process with --reference.",
                                 epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan", help="plan JSON written by `planner compile`")
    ap.add_argument("--steps", type=int, default=1, help="iterations to run (default 1)")
    ap.add_argument("--metrics-out", help="write one JSON object per step to this .jsonl file (rank 0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of weights, data and sampling (default 0)")
    ap.add_argument("--reference", action="store_true", help="run every call in this one process, unsharded")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="compute dtype (default: bfloat16 on CUDA GPUs, float32 on the CPU; parameters and optimizer "
                    "state stay float32)")
    ap.add_argument("--trace-out", help="write the measured timeline of every rank to this trace JSON (rank 0)")
    ap.add_argument("--memory-out", help="write every rank's peak allocated tensor bytes and the plan's estimate to "
                    "this JSON (rank 0; on a CPU the run is profiled for it, so time it separately)")
    ap.add_argument("--quiet", action="store_true", help="print no progress lines")
    ap.add_argument("--checkpoint-dir", type=Path, help="save checkpoints in this directory (seen by every rank)")
    ap.add_argument("--checkpoint-every", type=int, help="save after every K steps (default: after the last only)")
    ap.add_argument("--checkpoint-keep", type=int, help="keep only the newest N checkpoints (default: all)")
    ap.add_argument("--resume", metavar="auto|PATH",
                    help="continue from the newest complete checkpoint in --checkpoint-dir (auto; a fresh start "
                    "when there is none) or from checkpoint directory PATH")
    ap.add_argument("--save-hf", type=Path, metavar="DIR",
                    help="at the end, write each trained model as an HF directory DIR/MODEL (config.json, fp32 "
                    "safetensors, the tokenizer files of the directory it started from), loadable by transformers")
    ap.add_argument("--save-hf-at-checkpoints", action="store_true",
                    help="also write DIR/step-NNNNNNNNN/MODEL at every checkpoint")
    ap.add_argument("--save-hf-shard-mb", type=float, default=DEFAULT_SHARD_MB, metavar="MB",
                    help=f"split a model's weights into files of at most this size (default {DEFAULT_SHARD_MB:g})")
    ap.add_argument("--reward-fn", metavar="MODULE:FUNCTION",
                    help="run the reward function the plan names (algorithm.reward_fn): a plan's code runs only when "
                    "the launch names the same function; imported from PYTHONPATH or installed packages, never "
                    "implicitly from the current directory")
    ap.add_argument("--collective-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                    help=f"seconds a collective may wait for its peers before the run fails (default {DEFAULT_TIMEOUT_S:g})")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    if args.collective_timeout <= 0:
        ap.error("--collective-timeout must be positive")
    if args.save_hf_shard_mb <= 0:
        ap.error("--save-hf-shard-mb must be positive")
    if args.save_hf_at_checkpoints and (args.save_hf is None or args.checkpoint_dir is None):
        ap.error("--save-hf-at-checkpoints needs --save-hf DIR and --checkpoint-dir")
    return args


def _earlier_metrics(path: str | None, *, upto: int) -> list[str]:
    """The lines of an earlier attempt's metrics file for steps up to `upto` (a resumed run keeps them)."""
    if path is None or upto == 0 or not Path(path).is_file():
        return []
    kept = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):  # also an integer too long to read
            raise PlannerError(f"--metrics-out {path!r} line {n} is not a metrics line of this runtime",
                               hint="give a new --metrics-out file, or remove that one") from None
        if step <= upto:
            kept.append(line)
    return kept


def _check_launch(args: argparse.Namespace, plan: Plan, *, world: int) -> None:
    """Refuse a launch that cannot run the plan, before anything is allocated."""
    if args.reference and world != 1:
        raise PlannerError(f"--reference runs in one process, but this launch has {world} ranks",
                           hint="run `python -m runtime PLAN.json --reference` without torchrun")
    if not args.reference and world != plan.cluster.world_size:
        raise PlannerError(
            f"plan {args.plan!r} is for {plan.cluster.world_size} ranks ({plan.cluster.short()}) "
            f"but this launch has {world}",
            hint=f"launch with torchrun --nproc-per-node {plan.cluster.gpus_per_node} --nnodes {plan.cluster.nodes}, "
            "or add --reference to run it in one process")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    problem = device_problem(plan, cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
                             local_ranks=local, reference=args.reference)
    if problem:
        raise PlannerError(problem, hint="run it on the GPUs it was compiled for; to try its calls on this machine, "
                           "`planner replan PLAN --cluster cpu:1xN` gives a plan for N CPU ranks, and --reference "
                           "runs it in one process")
    check_runnable(plan, reference=args.reference)
    galore = plan.galore_call()
    if galore is not None and args.checkpoint_dir is not None:
        raise PlannerError(f"call {galore.name!r} trains with a GaLore optimizer, whose low-rank states checkpoints do not "
                           "hold yet: --checkpoint-dir would fail at the first save",
                           hint="run without --checkpoint-dir, or compile the plan without --galore-rank")
    if args.reference:
        problem = memory_problem(plan)
        if problem:
            raise PlannerError(problem, hint="run the plan's own layouts under torchrun on the cluster it was compiled "
                               "for; the reference is for plans of small models")


def run(args: argparse.Namespace, interrupts: Interrupts) -> None:
    """Check the launch against the plan, run the steps, write metrics and the trace (rank 0)."""
    plan = load_plan(args.plan)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    ckpt = CheckpointOptions(directory=args.checkpoint_dir, every=args.checkpoint_every, resume=args.resume,
                             keep=args.checkpoint_keep)
    ckpt.check()
    _check_launch(args, plan, world=world)
    for path in (args.metrics_out, args.trace_out, args.memory_out):
        if path is not None and rank == 0:
            check_output(path)  # before any step, not after the run
    if args.save_hf is not None and rank == 0:
        check_save_dir(args.save_hf)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        threads = cpu_threads(local_ranks=1 if args.reference else int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if threads is not None:
            torch.set_num_threads(threads)
    distributed = not args.reference and world > 1
    if distributed:
        init_default_group("nccl" if cuda else "gloo", timeout_s=args.collective_timeout)
    lock = None
    meter = MemoryMeter(device) if args.memory_out else None
    if meter is not None:
        meter.__enter__()
    try:
        hooks = FaultHooks.from_env(rank)
        seed_process(args.seed, rank)
        runner = PlanRunner(plan, rank=rank, world_size=world, reference=args.reference, seed=args.seed,
                            dtype=DTYPES[args.dtype or ("bfloat16" if cuda else "float32")], device=device, trace=args.trace_out is not None,
                            collective_timeout_s=args.collective_timeout, hooks=hooks, reward_fn=args.reward_fn)
        lock = claim_directory(runner, ckpt)
        resumed = resume(runner, ckpt)
        start = resumed.step if resumed is not None else 0
        say = print if rank == 0 and not args.quiet else (lambda *_a, **_k: None)
        costed = plan.estimate.framework
        if costed not in (None, "torch"):
            say(f"note: plan {plan.name!r} was costed for framework {costed}, another stack; the runtime runs its "
                "layouts, but its predicted times and memory are that stack's (compile with --framework torch for "
                "the runtime's)", flush=True)
        if resumed is not None:
            say(f"resumed from {resumed.directory} (step {resumed.step}, saved by {resumed.world_size} rank{'s' if resumed.world_size > 1 else ''})"
                + (f"; skipped {'; '.join(resumed.skipped)}" if resumed.skipped else ""), flush=True)
        elif ckpt.resume == "auto":
            say(f"no intact checkpoint in {ckpt.directory}: starting at step 1", flush=True)
        if start >= args.steps:
            say(f"the checkpoint is at step {start}: --steps {args.steps} already done", flush=True)
        lines = _earlier_metrics(args.metrics_out, upto=start) if rank == 0 else []
        for step in range(start + 1, args.steps + 1):
            interrupts.step = step
            metrics = runner.step(step)
            if rank == 0:
                lines.append(json.dumps(metrics, sort_keys=True))
                if args.metrics_out:
                    write_text_atomic(args.metrics_out, "\n".join(lines) + "\n")
                say(progress_line(metrics, plan=plan, steps=args.steps), flush=True)
            if ckpt.due(step, last=step == args.steps):
                saved = save_checkpoint(runner, ckpt.directory, step=step, keep=ckpt.keep, hooks=hooks)  # type: ignore[arg-type]
                say(f"saved checkpoint {saved}", flush=True)
                if args.save_hf_at_checkpoints:
                    for d in save_hf(runner, args.save_hf / saved.name, shard_mb=args.save_hf_shard_mb):
                        say(f"saved HF model {d}", flush=True)
        if args.save_hf is not None:
            for d in save_hf(runner, args.save_hf, shard_mb=args.save_hf_shard_mb):
                say(f"saved HF model {d}", flush=True)
        if meter is not None:
            if distributed:  # no collective of this rank is still running on gloo's threads when the profiler stops
                dist.barrier()
            meter.__exit__()
            peaks = gather_events([meter.peaks()], distributed=distributed, rank=rank, world_size=world)
            if peaks is not None:
                write_memory(args.memory_out, peaks, plan=plan, device=device.type)
            meter = None
        if args.trace_out:
            events = gather_events(runner.recorder.events, distributed=distributed, rank=rank, world_size=world)
            if events is not None:
                write_measured_trace(args.trace_out, events, plan=plan, world_size=world, steps=args.steps,
                                     reference=args.reference)
    except PlannerError as e:
        if interrupts.received is not None:  # a collective failed because the peers were interrupted too
            raise interrupts.received from None
        _report(e, rank=rank)
        if isinstance(e, SharedError) and distributed:  # leave together: every rank has said it
            _leave_together(timeout_s=min(args.collective_timeout, LEAVE_TIMEOUT_S))
        raise Reported(e.exit_code) from None
    finally:
        if meter is not None:
            meter.__exit__()
        if lock is not None:
            lock.release()
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


class Reported(Exception):
    """A problem already reported on this rank; the process exits with `code`."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _report(e: PlannerError, *, rank: int | str) -> None:
    """One message per rank, written at once (lines of several ranks sharing a terminal stay whole)."""
    sys.stderr.write(f"error (rank {rank}): {e}\n")
    sys.stderr.flush()


def _leave_together(*, timeout_s: float) -> None:
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError:  # a peer is gone: nothing to wait for
        pass


def _reported_before_joining(*, timeout_s: float = LEAVE_TIMEOUT_S / 3) -> None:
    """Under torchrun, wait (up to `timeout_s`) until every rank has reported a problem found before
    the process group exists: torchrun stops all ranks at the first exit, which would silence a
    rank still starting up. Counted in the launcher's key-value store; best effort."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "MASTER_ADDR" not in os.environ or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import time

    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                              is_master=False, timeout=timedelta(seconds=timeout_s))
        key = f"planner/launch-errors/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
    except (RuntimeError, OSError, ValueError):  # no store to count in: leave now
        pass


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    rank = os.environ.get("RANK", "0")
    interrupts = Interrupts()
    interrupts.install()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # launched by torchrun: do not outlive its agent
        watch_parent(interrupts)
    try:
        run(args, interrupts)
    except Interrupted as e:
        return _interrupted(e, rank=rank, interrupts=interrupts)
    except Reported as e:
        return e.code
    except PlannerError as e:  # found before the run started (options, plan, launch)
        _report(e, rank=rank)
        _reported_before_joining()
        return e.exit_code
    return 0


def _interrupted(e: Interrupted, *, rank: str, interrupts: Interrupts) -> int:
    """One line for the whole run: rank 0's (when the launcher died, the first rank of each node's,
    as no launcher is left to report anything)."""
    if rank == "0" or ("launcher" in e.reason and os.environ.get("LOCAL_RANK", "0") == "0"):  # one line per node
        where = f" in step {interrupts.step}" if interrupts.step else ""
        print(f"stopped (rank {rank}): {e.reason}{where}; no file was left half written", file=sys.stderr, flush=True)
    return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
