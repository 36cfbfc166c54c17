"""Checkpoints of a running plan: saved every K steps, resumed under the same plan or a re-planned one.

The format is `plans.checkpoint` (the manifest, the box of every piece in full-tensor coordinates,
``ROOT/step-NNNNNNNNN/``); this module does the tensor I/O on each rank.

**Saving** (`save_checkpoint`, a collective of every rank). Each model's state lives with its home
call (`runtime.executor`). Every rank writes one safetensors file ``rank-RRRRR.safetensors`` into
``ROOT/step-NNNNNNNNN.tmp``: the distinct parameter shards it is the first holder of
(`plans.checkpoint.shard_writers`: data-parallel replicas write nothing), for a trainable model
also Adam's exp_avg and exp_avg_sq in the same boxes (ZeRO 1/2 ranks all-gather their flat
partitions first, `DataParallel.moments`), and its RNG states (torch, CUDA, Python, NumPy). Files
are created new (never through a link) and fsynced; rank 0 gathers every rank's list of pieces
with its file's size and SHA-256, writes the manifest last and renames the directory into place
(then fsyncs ROOT). A failure (a full disk, while writing a shard or the manifest) is one error on
every rank and removes the ``.tmp`` directory, and so does an interrupt (every rank removes it);
pruning (``--checkpoint-keep``) never follows a link and only warns when it fails, since the
checkpoint just saved is complete. A crash (a killed process) at any point
before the rename leaves only a ``.tmp`` directory, which `plans.checkpoint.latest_complete` never
picks and the next save removes; so a checkpoint is complete or absent.

**Claiming the directory** (`claim_directory`, at the start of a run with a checkpoint directory).
Rank 0 takes an exclusive lock on it for the run's lifetime (`DirectoryLock`: a second live run
is refused, naming the first; the lock of a dead one is taken over with a warning) and refuses a
directory holding another graph's or another seed's checkpoints, or any symbolic link.

**Resuming** (`resume`). Rank 0 lists the candidates (``auto``: the complete checkpoints under the
checkpoint directory, newest first, none meaning a fresh start; or a given directory, which must
be complete) and checks them against the plan (same graph fingerprint, same models, same seed); a
problem is raised on every rank. Each rank then opens every file it will read once, without
following links, checks its SHA-256 and its header, and finds each tensor it needs
(`runtime.stfile`); only when every rank found its files intact does any rank change its state.
Under ``auto`` a checkpoint some rank found damaged is skipped, saying why, for the next older one.
Each rank fills its own slices of every model it holds at rest, under this plan's layouts, from
the saved pieces that overlap them (`plans.checkpoint.reads_for`), so a checkpoint of a 4-rank
plan resumes under a re-planned 2-rank one; it reads only the slices it needs. Adam's step count
comes back with the moments, the data position with the step: the graph inputs and the sampling
noise are pure functions of (seed, step) (`runtime.tasks`, `runtime.executor.call_seed`), so a
resumed run draws exactly what the uninterrupted run draws. RNG states come back rank by rank
when the world size is the one saved (a re-planned run keeps its own; the runtime draws nothing
from them).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
from torch import Tensor

from plans.checkpoint import (
    MANIFEST_NAME,
    OPTIMIZER_KINDS,
    STEP_DIR,
    CheckpointManifest,
    DataPosition,
    SavedFile,
    SavedModel,
    StateKind,
    TensorPiece,
    checkpoint_problems,
    completeness_problems,
    graph_fingerprint,
    load_manifest,
    plan_fingerprint,
    reads_for,
    resume_problems,
    scan,
    shard_writers,
    step_dir,
    step_dirs,
    symbolic_links,
)
from plans.errors import PlannerError
from plans.io import replace_directory, write_new_file
from plans.sharding import Box, box_numel, parameters, shard_box
from runtime.executor import PlanRunner
from runtime.faults import FaultHooks, SharedError, named
from runtime.stfile import CheckpointFile, Damaged

LEFTOVER = re.compile(r"^step-\d{9}\.(tmp|old|deleting)$")  # directories of interrupted saves and prunes


@dataclass(frozen=True)
class CheckpointOptions:
    """Where and when to save, and what to resume (``--checkpoint-dir/--checkpoint-every/--resume``)."""

    directory: Path | None = None
    every: int | None = None  # save after every `every` steps (and after the last one of a CLI run)
    resume: str | None = None  # "auto" (the newest complete checkpoint in `directory`), a checkpoint directory, or None
    keep: int | None = None  # keep the newest `keep` checkpoints (None: all)

    def check(self) -> None:
        """A `PlannerError` for options that do not go together."""
        if self.every is not None and self.every < 1:
            raise PlannerError(f"--checkpoint-every must be at least 1, got {self.every}")
        if self.keep is not None and self.keep < 1:
            raise PlannerError(f"--checkpoint-keep must be at least 1, got {self.keep}")
        if self.directory is None and (self.every is not None or self.keep is not None or self.resume == "auto"):
            raise PlannerError("--checkpoint-every, --checkpoint-keep and --resume auto need --checkpoint-dir",
                               hint="add --checkpoint-dir DIR (checkpoints are written to DIR/step-NNNNNNNNN)")

    def due(self, step: int, *, last: bool = False) -> bool:
        """Whether to save after `step` (`last`: the run's final step)."""
        if self.directory is None:
            return False
        return last or (self.every is not None and step % self.every == 0)


# Collectives of the checkpoint protocol -------------------------------------------------------

def _rank0(runner: PlanRunner, fn: Callable[[], Any], *, what: str) -> Any:
    """`fn()` run on rank 0 and its value sent to every rank; its `PlannerError` raised on every rank."""
    outcome: tuple = ("error", f"rank 0 failed while {what}", None)
    failure: BaseException | None = None
    if runner.rank == 0:
        try:
            outcome = ("ok", fn(), None)
        except PlannerError as e:
            outcome = ("error", e.message, e.hint)
        except Exception as e:  # a bug: the other ranks still hear of it, rank 0 keeps the traceback
            failure = e
    if runner.distributed:
        box = [outcome]
        with named(what, rank=runner.rank, timeout_s=runner.timeout_s):
            dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if failure is not None:
        raise failure
    if outcome[0] == "error":
        raise SharedError(outcome[1], hint=outcome[2])
    return outcome[1]


def _gather(runner: PlanRunner, obj: Any, *, what: str) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if not runner.distributed:
        return [obj]
    parts: list[Any] | None = [None] * runner.world if runner.rank == 0 else None
    with named(what, rank=runner.rank, timeout_s=runner.timeout_s):
        dist.gather_object(obj, parts, dst=0)
    return parts


# Saving ---------------------------------------------------------------------------------------

def seed_process(seed: int, rank: int) -> None:
    """Seed this process's global RNGs (torch, CUDA, Python, NumPy) from (seed, rank). The runtime
    draws from its own generators, keyed by (seed, step) (`runtime.tasks`, `runtime.model`); this
    only makes the global states, which checkpoints save, a function of the run too."""
    value = seed * 1_000_003 + rank
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


def _rng_state(device: torch.device) -> tuple[dict[str, Tensor], dict[str, str]]:
    """This process's RNG states as tensors and safetensors metadata (text)."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device)
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    meta = {"rng/python": json.dumps(random.getstate()), "rng/numpy": json.dumps([kind, int(pos), int(has_gauss),
                                                                                   float(gauss)])}
    return tensors, meta


def _rng_states(f: CheckpointFile) -> tuple[Tensor, Tensor | None, tuple, tuple]:
    """The RNG states in a rank's file (torch, CUDA or None, Python, NumPy), each first set on a
    throwaway generator, so a state the generators refuse is `Damaged` before anything changes."""
    try:
        torch_state = f.tensor("rng/torch").clone()
        torch.Generator().set_state(torch_state)
        cuda_state = f.tensor("rng/cuda").clone() if "rng/cuda" in f.entries else None
        version, state, gauss = f.metadata_json("rng/python")
        py_state = (version, tuple(state), gauss)
        random.Random().setstate(py_state)
        kind, pos, has_gauss, gauss_np = f.metadata_json("rng/numpy")
        np_state = (kind, f.tensor("rng/numpy").numpy().astype(np.uint32), pos, has_gauss, gauss_np)
        np.random.RandomState().set_state(np_state)
    except (TypeError, ValueError, RuntimeError) as e:
        raise Damaged(f"checkpoint file {str(f.path)!r} holds RNG states this process cannot take: {e}") from None
    return torch_state, cuda_state, py_state, np_state


def _set_rng_state(f: CheckpointFile, device: torch.device) -> None:
    """Restore this process's RNG states from its file (checked by `_Reader.check`)."""
    torch_state, cuda_state, py_state, np_state = _rng_states(f)
    torch.set_rng_state(torch_state)
    if device.type == "cuda" and cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state, device)
    random.setstate(py_state)
    np.random.set_state(np_state)


def _my_pieces(runner: PlanRunner, file: str) -> tuple[dict[str, Tensor], list[dict], dict[str, int]]:
    """The tensors this rank saves (copies on the CPU), their manifest entries, and the Adam step
    count of each trainable model it holds. Collective within each ZeRO 1/2 data-parallel group
    (the moments are gathered)."""
    tensors: dict[str, Tensor] = {}
    pieces: list[dict] = []
    steps: dict[str, int] = {}
    for model, where, held in runner.resident():
        if held is None:
            continue
        if held.dp is not None:
            steps[model] = held.dp.steps
        decl = runner.plan.models[model]
        writers = shard_writers(decl.spec, head=decl.head, mesh=where.mesh, layout=where.layout)
        moments = held.dp.moments() if held.dp is not None and held.dp.steps else {}
        for param in parameters(decl.spec, head=decl.head):
            t = held.shard.params.get(param.name)
            box = shard_box(param, decl.spec, where.layout, held.groups.local)
            if t is None or box is None or writers[param.name].get(box) != runner.rank:
                continue
            states = {"param": t, **dict(zip(("exp_avg", "exp_avg_sq"), moments.get(param.name, ())))}
            for kind, value in states.items():
                key = f"{model}/{kind}/{param.name}"
                tensors[key] = value.detach().to("cpu", torch.float32, copy=True).contiguous()
                pieces.append(TensorPiece(model=model, param=param.name, kind=kind, box=box, file=file,
                                          key=key).model_dump(mode="json"))
    return tensors, pieces, steps


def _record(path: Path, data: bytes) -> dict:
    return SavedFile(path=path.name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()).model_dump(mode="json")


def _is_real_dir(path: Path) -> bool:
    """A directory reached without following a symbolic link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _prepare(root: Path, tmp: Path) -> None:
    """Rank 0: an empty temporary directory for the new checkpoint; leftovers of interrupted saves
    go (links among them are left alone: `claim_directory` refused them at the start)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        for p in root.iterdir():
            if LEFTOVER.match(p.name) and _is_real_dir(p):
                shutil.rmtree(p)
        tmp.mkdir()
    except OSError as e:
        raise PlannerError(f"cannot write checkpoints to {str(root)!r}: {e.strerror or e}",
                           hint="--checkpoint-dir must be a writable directory every rank sees") from None


def _finish(runner: PlanRunner, reports: list[dict], *, step: int, tmp: Path, final: Path,
            keep: int | None, device: str | None = None) -> str:
    """Rank 0: the manifest from every rank's report, written last, then the rename into place.
    `device`: where the manifest bytes go instead of its file (a fault-injection test)."""
    failed = [f"rank {r['rank']}: {r['error']}" for r in reports if "error" in r]
    if failed:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PlannerError(f"could not write checkpoint {str(final)!r}: " + "; ".join(failed),
                           hint="check the free space and permissions of --checkpoint-dir")
    plan = runner.plan
    steps = {m: n for r in reports for m, n in r["optimizer_steps"].items()}
    models = {}
    for model, where, _ in runner.resident():
        decl = plan.models[model]
        models[model] = SavedModel(spec=decl.spec, head=decl.head, trainable=decl.trainable, mesh=where.mesh,
                                   layout=where.layout, optimizer_step=steps.get(model, 0))
    manifest = CheckpointManifest(
        step=step, plan_name=plan.name, graph_fingerprint=graph_fingerprint(plan.graph()),
        plan_fingerprint=plan_fingerprint(plan), world_size=runner.world, seed=runner.seed, models=models,
        tensors=[p for r in reports for p in r["pieces"]], rng={r["rank"]: r["file"]["path"] for r in reports},
        data=DataPosition(iterations=step, samples=step * sum(i.seqs for i in plan.inputs),
                          epoch=max((d.epoch(samples=step * d.per_step) for d in runner.datasets.values()), default=0)),
        files=[r["file"] for r in reports])
    problems = checkpoint_problems(manifest)
    if problems:  # the ranks' pieces do not tile the models: never leave such a checkpoint behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise PlannerError(f"checkpoint of step {step} would be incomplete: {problems[0]}")
    try:
        write_new_file(tmp / MANIFEST_NAME, manifest.model_dump_json(indent=1).encode(), device=device)
        replace_directory(tmp, final)  # over an incomplete checkpoint of this step from an earlier attempt
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise PlannerError(f"could not write checkpoint {str(final)!r}: {e.strerror or e} (writing its manifest)",
                           hint="free space on, or fix the permissions of, the --checkpoint-dir file system; the run "
                           "stops rather than go on without checkpoints") from None
    if keep is not None:
        _prune(final.parent, keep=keep, newest=step)
    return str(final)


def _prune(root: Path, *, keep: int, newest: int) -> None:
    """Delete all but the newest `keep` checkpoints (renamed out of the ``step-*`` names first, so
    a half-deleted one is never mistaken for a checkpoint). Never follows a symbolic link, and a
    failure is a warning: the checkpoint just saved is complete, the run goes on."""
    try:
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and _is_real_dir(p))
        for step in [s for s in steps if s <= newest][:-keep]:
            doomed = step_dir(root, step)
            gone = doomed.with_name(doomed.name + ".deleting")
            doomed.rename(gone)
            shutil.rmtree(gone)
    except OSError as e:
        print(f"warning: could not prune old checkpoints in {str(root)!r}: {e.strerror or e} (the new checkpoint is "
              "complete; the run goes on)", file=sys.stderr, flush=True)


def save_checkpoint(runner: PlanRunner, root: str | Path, *, step: int, keep: int | None = None,
                    hooks: FaultHooks | None = None) -> Path:
    """Save the run's state after `step` iterations as ``ROOT/step-NNNNNNNNN`` (every rank calls it);
    returns the directory. A failure on any rank is a `PlannerError` on every rank, and leaves no
    checkpoint of this step."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    what = f"saving checkpoint {final.name}"
    try:
        _rank0(runner, lambda: _prepare(root, tmp), what=what)
        return _save(runner, tmp, final, step=step, keep=keep, hooks=hooks, what=what)
    except BaseException:  # a failure or an interrupt, even one while rank 0 is still preparing the directory
        # Every rank removes it, not only rank 0: interrupted together (Ctrl-C reaches the whole process
        # group), a rank may still create its shard file after rank 0's removal listed the directory, which
        # would leave it behind; whichever rank touches it last removes it.
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(runner: PlanRunner, tmp: Path, final: Path, *, step: int, keep: int | None, hooks: FaultHooks | None,
          what: str) -> Path:
    file = f"rank-{runner.rank:05d}.safetensors"
    with named(what, rank=runner.rank, timeout_s=runner.timeout_s), runner.states_on_device():
        tensors, pieces, steps = _my_pieces(runner, file)
    rng, meta = _rng_state(runner.device)
    try:
        data = safetensors.torch.save({**tensors, **rng}, metadata=meta)
        write_new_file(tmp / file, data)
        report: dict = {"rank": runner.rank, "pieces": pieces, "file": _record(tmp / file, data),
                        "optimizer_steps": steps}
    except OSError as e:
        report = {"rank": runner.rank, "error": f"cannot write {str(tmp / file)!r}: {e.strerror or e}"}
    if hooks is not None:
        hooks.while_saving(step)
    reports = _gather(runner, report, what=what)
    device = hooks.manifest_device(step) if hooks is not None else None
    return Path(_rank0(runner, lambda: _finish(runner, reports or [], step=step, tmp=tmp, final=final, keep=keep,
                                               device=device), what=what))


# Claiming the directory ------------------------------------------------------------------------

LOCK_NAME = ".planner-run.lock"


class DirectoryLock:
    """Rank 0's exclusive lock on a checkpoint directory, held while the run lives.

    An ``flock`` on ``DIR/.planner-run.lock``, whose text says who holds it (pid, host, start
    time, plan): the kernel drops the lock when its process dies, however it dies, so a lock
    left by a dead run is taken over (with a warning naming it), and a live run's lock is a
    clear error naming that run."""

    def __init__(self, root: Path, *, plan: str) -> None:
        self.path = root / LOCK_NAME
        self.fd = -1
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "plan": plan,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
        for _ in range(5):  # the file may be replaced between open and lock (a holder releasing it)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                other = _read_holder(fd)
                os.close(fd)
                raise PlannerError(f"checkpoint directory {str(root)!r} is in use by another live run ({other}); two "
                                   "runs writing one directory would overwrite each other's checkpoints",
                                   hint="wait for that run to end, or give this run its own --checkpoint-dir") from None
            if os.fstat(fd).st_ino == os.lstat(self.path).st_ino:
                break
            os.close(fd)
        else:
            raise PlannerError(f"could not lock checkpoint directory {str(root)!r}: its lock file keeps changing")
        self.fd = fd
        previous = _read_holder(fd)
        if previous:
            print(f"warning: taking over {str(self.path)!r} from a run that is no longer alive ({previous})",
                  file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder, sort_keys=True) + "\n").encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Remove the lock file while still holding it, then drop the lock (idempotent)."""
        if self.fd < 0:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = -1


def _read_holder(fd: int) -> str:
    """Who a lock file says holds it, for a message ('' for an empty file)."""
    raw = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    if not raw:
        return ""
    try:
        h = json.loads(raw)
        return f"pid {h['pid']} on host {h['host']}, started {h['started']}, plan {h['plan']!r}"
    except (ValueError, KeyError, TypeError):
        return f"lock file text {raw[:120]!r}"


def _owner_problems(root: Path, runner: PlanRunner) -> list[str]:
    """Checkpoints under `root` that another run wrote (another graph or seed), by run."""
    problems = []
    mine = graph_fingerprint(runner.plan.graph())
    others: dict[str, list[str]] = {}
    for directory, manifest, _ in scan(root):
        if manifest is None:
            continue
        if manifest.graph_fingerprint != mine:
            others.setdefault(f"plan {manifest.plan_name!r} of another graph", []).append(directory.name)
        elif manifest.seed != runner.seed:
            others.setdefault(f"a run with --seed {manifest.seed} (this run has --seed {runner.seed})",
                              []).append(directory.name)
    for who, names in others.items():
        which = names[0] if len(names) == 1 else f"{len(names)} checkpoints ({names[-1]} to {names[0]})"
        problems.append(f"{which} {'was' if len(names) == 1 else 'were'} saved by {who}")
    return problems


def claim_directory(runner: PlanRunner, options: CheckpointOptions) -> DirectoryLock | None:
    """Rank 0 locks the checkpoint directory for this run and checks that it holds only this run's
    checkpoints (same graph and seed) and no symbolic link; a problem is a `PlannerError` on every
    rank, before any step. Returns rank 0's lock (None elsewhere); release it when the run ends."""
    if options.directory is None:
        return None
    root = options.directory
    holder: list[DirectoryLock] = []

    def claim() -> None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = DirectoryLock(root, plan=runner.plan.name)
        except OSError as e:
            raise PlannerError(f"cannot use checkpoint directory {str(root)!r}: {e.strerror or e}",
                               hint="--checkpoint-dir must be a writable directory every rank sees") from None
        holder.append(lock)
        links = symbolic_links(root)
        if links:
            target = os.readlink(root.parent / links[0])
            raise PlannerError(f"checkpoint directory {str(root)!r} contains a symbolic link: {links[0]!r} -> "
                               f"{target!r}" + (f" (and {len(links) - 1} more)" if len(links) > 1 else "")
                               + "; planner never follows links in a checkpoint directory (a resume could read, and "
                               "pruning could delete, files outside it)",
                               hint="replace the link with the directory or file it points to, or remove it")
        problems = _owner_problems(root, runner)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise PlannerError(f"checkpoint directory {str(root)!r} is not this run's to write: "
                               + "; ".join(problems[:3]) + more,
                               hint="give this run its own --checkpoint-dir; to continue the run that wrote them, "
                               "launch its plan (or a `planner replan` of it) with its --seed and --resume auto")

    try:
        _rank0(runner, claim, what="claiming the checkpoint directory")
    except BaseException:
        for lock in holder:
            lock.release()
        raise
    return holder[0] if holder else None


# Resuming -------------------------------------------------------------------------------------

def _candidates(options: CheckpointOptions, runner: PlanRunner) -> tuple[list[tuple[str, str]], list[str]]:
    """Rank 0: the checkpoints to try, newest first, as (directory, manifest JSON), and the newer
    incomplete ones skipped (with why); a `PlannerError` when the one asked for cannot be resumed."""
    skipped: list[str] = []
    chosen: list[tuple[Path, CheckpointManifest]] = []
    if options.resume == "auto":
        assert options.directory is not None
        for directory, manifest, problems in scan(options.directory):
            if manifest is not None and not problems:
                chosen.append((directory, manifest))
            elif not chosen:
                skipped.append(f"{directory.name} ({(problems or ['incomplete'])[0]})")
    else:
        directory = Path(str(options.resume))
        if not (directory / MANIFEST_NAME).is_file() and directory.is_dir() and step_dirs(directory):
            raise PlannerError(f"--resume {str(directory)!r} is a directory of checkpoints, not one checkpoint",
                               hint=f"give one of its step-NNNNNNNNN directories, or --checkpoint-dir "
                               f"{str(directory)!r} --resume auto for the newest complete one")
        manifest = load_manifest(directory)
        problems = completeness_problems(directory, manifest)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise PlannerError(f"checkpoint {str(directory)!r} is incomplete: " + "; ".join(problems[:3]) + more,
                               hint="it was cut short or damaged; resume from an earlier one (--resume auto picks "
                               "the newest complete one)")
        chosen.append((directory, manifest))
    for directory, manifest in chosen:
        problems = resume_problems(manifest, runner.plan)
        if problems:
            raise PlannerError(f"cannot resume checkpoint {str(directory)!r} with plan {runner.plan.name!r}: "
                               + "; ".join(problems),
                               hint="resume it with its own plan or one from `planner replan` of that plan")
        if manifest.seed != runner.seed:
            raise PlannerError(f"checkpoint {str(directory)!r} was saved by a run with --seed {manifest.seed}, this "
                               f"run has --seed {runner.seed} (the data and sampling would not continue where they "
                               f"stopped)", hint=f"resume with --seed {manifest.seed}")
    return [(str(d), m.model_dump_json()) for d, m in chosen], skipped


@dataclass(frozen=True)
class _Read:
    """One slice this rank restores: `target` (a resident tensor or a new moment) from `box`."""

    model: str
    param: str
    kind: StateKind
    box: Box


class _Reader:
    """The checkpoint files this rank reads, each opened once and verified before any is used."""

    def __init__(self, directory: Path, manifest: CheckpointManifest) -> None:
        self.directory, self.manifest = directory, manifest
        self.records = {f.path: f for f in manifest.files}
        self.open: dict[str, CheckpointFile] = {}

    def file(self, name: str) -> CheckpointFile:
        if name not in self.open:
            record = self.records[name]
            self.open[name] = CheckpointFile(self.directory / name, size=record.bytes, sha256=record.sha256)
        return self.open[name]

    def check(self, reads: list[_Read], rng_file: str | None) -> None:
        """Open, hash and parse every file `reads` touch, and find each piece's tensor in it: any
        damage is found here, before this rank changes any state."""
        for r in reads:
            for piece, _, _ in reads_for(self.manifest, model=r.model, param=r.param, kind=r.kind, need=r.box):
                self.file(piece.file).tensor(piece.key, shape=tuple(hi - lo for lo, hi in piece.box))
        if rng_file is not None:
            _rng_states(self.file(rng_file))

    def read(self, r: _Read) -> Tensor:
        """The `box` of a saved tensor, assembled from the pieces that overlap it."""
        out = torch.empty(tuple(hi - lo for lo, hi in r.box), dtype=torch.float32)
        covered = 0
        for piece, src, dst in reads_for(self.manifest, model=r.model, param=r.param, kind=r.kind, need=r.box):
            part = self.file(piece.file).tensor(piece.key, shape=tuple(hi - lo for lo, hi in piece.box))
            out[tuple(slice(lo, hi) for lo, hi in dst)] = part[tuple(slice(lo, hi) for lo, hi in src)].float()
            covered += box_numel(dst)
        if covered != box_numel(r.box):
            raise Damaged(f"checkpoint {str(self.directory)!r} lacks part of {r.model}'s {r.param} ({r.kind}): "
                          f"{covered} of the {box_numel(r.box)} elements of box {r.box}")
        return out


def _reads(runner: PlanRunner, manifest: CheckpointManifest) -> list[tuple[_Read, Tensor | None]]:
    """Every slice this rank restores, with the resident tensor it goes into (None for a moment)."""
    out: list[tuple[_Read, Tensor | None]] = []
    for model, where, held in runner.resident():
        if held is None:
            continue
        decl, saved = runner.plan.models[model], manifest.models[model]
        for param in parameters(decl.spec, head=decl.head):
            t = held.shard.params.get(param.name)
            box = shard_box(param, decl.spec, where.layout, held.groups.local)
            if t is None or box is None:
                continue
            out.append((_Read(model, param.name, "param", box), t))
            if held.dp is not None and saved.optimizer_step:
                out += [(_Read(model, param.name, kind, box), None) for kind in OPTIMIZER_KINDS]
    return out


def _rng_file(runner: PlanRunner, manifest: CheckpointManifest) -> str | None:
    """The file of this rank's RNG states, restored when the world size is the one saved (a
    re-planned run keeps its own; the runtime draws nothing from them)."""
    return manifest.rng.get(runner.rank) if manifest.world_size == runner.world else None


def _restore(runner: PlanRunner, reader: _Reader, reads: list[tuple[_Read, Tensor | None]], rng: str | None) -> None:
    """Fill this rank's resident slices and Adam states from the verified files; RNG states too."""
    moments: dict[str, dict[str, dict[str, Tensor]]] = {}
    with torch.no_grad():
        for r, target in reads:
            value = reader.read(r)
            if target is not None:
                target.copy_(value)
            else:
                moments.setdefault(r.model, {}).setdefault(r.param, {})[r.kind] = value
    for model, _, held in runner.resident():
        if held is not None and held.dp is not None and model in moments:  # else the fresh state is the saved one
            pairs = {p: (m["exp_avg"], m["exp_avg_sq"]) for p, m in moments[model].items()}
            held.dp.load_moments(pairs, steps=reader.manifest.models[model].optimizer_step)
    if rng is not None:
        _set_rng_state(reader.file(rng), runner.device)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from, and the newer ones it skipped (with why)."""

    directory: Path
    step: int
    world_size: int
    skipped: list[str]


def resume(runner: PlanRunner, options: CheckpointOptions) -> Resumed | None:
    """Load the checkpoint `options.resume` names into `runner` (every rank calls it); None for a
    fresh start (``auto`` and no intact checkpoint). Every rank first opens, hashes and parses
    every file it will read; only when all ranks found theirs intact does any rank change its
    state. Under ``auto`` a checkpoint some rank found damaged is skipped for the next older one
    (so restarts under ``torchrun --max-restarts`` do not fail on it again and again); a
    checkpoint named by path must be intact. Problems are `PlannerError`s on every rank."""
    if options.resume is None:
        return None
    candidates, skipped = _rank0(runner, lambda: _candidates(options, runner),
                                 what="choosing the checkpoint to resume")
    with runner.states_on_device():  # the slices and moments it fills are the device's
        return _resume_from(runner, options, candidates, skipped)


def _resume_from(runner: PlanRunner, options: CheckpointOptions, candidates: list[tuple[str, str]],
                 skipped: list[str]) -> Resumed | None:
    for path, text in candidates:
        manifest = CheckpointManifest.model_validate_json(text)
        reader = _Reader(Path(path), manifest)
        reads, rng = _reads(runner, manifest), _rng_file(runner, manifest)
        damage: str | None = None
        try:
            reader.check([r for r, _ in reads], rng)
        except Damaged as e:
            damage = f"rank {runner.rank}: {e.message}"
        found = _gather(runner, damage, what="checking the checkpoint to resume")
        verdict = _rank0(runner, partial(_first, found or []), what="checking the checkpoint to resume")
        if verdict is not None:
            if options.resume != "auto":
                raise SharedError(f"cannot resume {path!r}: {verdict}",
                                   hint="resume from an earlier checkpoint (--resume auto falls back to the newest "
                                   "intact one)")
            skipped.append(f"{Path(path).name} ({verdict})")
            continue
        error: tuple[str, str | None] | None = None
        try:
            _restore(runner, reader, reads, rng)
        except PlannerError as e:  # a rank that cannot read its pieces tells the others instead of leaving them waiting
            error = (f"rank {runner.rank}: {e.message}", e.hint)
        errors = _gather(runner, error, what="resuming from a checkpoint")
        _rank0(runner, partial(_raise_first, errors or []), what="resuming from a checkpoint")
        return Resumed(Path(path), manifest.step, manifest.world_size, skipped)
    if skipped and runner.rank == 0:
        print(f"warning: no intact checkpoint in {str(options.directory)!r}; skipped {'; '.join(skipped)}",
              file=sys.stderr, flush=True)
    return None


def _first(found: list[str | None]) -> str | None:
    return next((d for d in found if d is not None), None)


def _raise_first(errors: list[tuple[str, str | None] | None]) -> None:
    for e in errors:
        if e is not None:
            raise SharedError(e[0], hint=e[1])
