"""Checkpoints of a running plan: saved every K steps, resumed under the same plan or a re-planned one.

The format is `plans.checkpoint` (the manifest, the box of every piece in full-tensor coordinates,
``ROOT/step-NNNNNNNNN/``); this module does the tensor I/O on each rank.

**Saving** (`save_checkpoint`, a collective of every rank). Each model's state lives with its home
call (`runtime.executor`). Every rank writes one safetensors file ``rank-RRRRR.safetensors`` into
``ROOT/step-NNNNNNNNN.tmp``: the distinct parameter shards it is the first holder of
(`plans.checkpoint.shard_writers`: data-parallel replicas write nothing), for a trainable model
also Adam's exp_avg and exp_avg_sq in the same boxes (ZeRO 1/2 ranks all-gather their flat
partitions first, `DataParallel.moments`), and its RNG states (torch, CUDA, Python, NumPy). Files
are fsynced; rank 0 gathers every rank's list of pieces with its file's size and SHA-256, writes
the manifest last and renames the directory into place (then fsyncs ROOT). A crash at any point
before the rename leaves only a ``.tmp`` directory, which `plans.checkpoint.latest_complete` never
picks and the next save removes; so a checkpoint is complete or absent.

**Resuming** (`resume`). Rank 0 picks the checkpoint (``auto``: the newest complete one under the
checkpoint directory, none meaning a fresh start; or a given directory, which must be complete)
and checks it against the plan (same graph fingerprint, same models, same seed); a problem is
raised on every rank. Each rank then fills its own slices of every model it holds at rest, under
this plan's layouts, from the saved pieces that overlap them (`plans.checkpoint.reads_for`), so a
checkpoint of a 4-rank plan resumes under a re-planned 2-rank one; it reads only the slices it
needs (safetensors slicing) and checks the SHA-256 of every file it opens. Adam's step count
comes back with the moments, the data position with the step: the graph inputs and the sampling
noise are pure functions of (seed, step) (`runtime.tasks`, `runtime.executor.call_seed`), so a
resumed run draws exactly what the uninterrupted run draws. RNG states come back rank by rank
when the world size is the one saved (a re-planned run keeps its own; the runtime draws nothing
from them).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor

from plans.checkpoint import (
    MANIFEST_NAME,
    STEP_DIR,
    CheckpointManifest,
    DataPosition,
    SavedFile,
    SavedModel,
    TensorPiece,
    checkpoint_problems,
    completeness_problems,
    graph_fingerprint,
    latest_complete,
    load_manifest,
    plan_fingerprint,
    reads_for,
    resume_problems,
    shard_writers,
    step_dir,
)
from plans.errors import PlannerError
from plans.sharding import Box, box_numel, parameters, shard_box
from runtime.executor import PlanRunner
from runtime.faults import FaultHooks, named

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
        raise PlannerError(outcome[1], hint=outcome[2])
    return outcome[1]


def _gather(runner: PlanRunner, obj: Any, *, what: str) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if not runner.distributed:
        return [obj]
    parts: list[Any] | None = [None] * runner.world if runner.rank == 0 else None
    with named(what, rank=runner.rank, timeout_s=runner.timeout_s):
        dist.gather_object(obj, parts, dst=0)
    return parts


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _set_rng_state(f: Any, device: torch.device) -> None:
    meta = f.metadata() or {}
    torch.set_rng_state(f.get_tensor("rng/torch"))
    if device.type == "cuda" and "rng/cuda" in f.keys():
        torch.cuda.set_rng_state(f.get_tensor("rng/cuda"), device)
    version, state, gauss = json.loads(meta["rng/python"])
    random.setstate((version, tuple(state), gauss))
    kind, pos, has_gauss, gauss_np = json.loads(meta["rng/numpy"])
    np.random.set_state((kind, f.get_tensor("rng/numpy").numpy().astype(np.uint32), pos, has_gauss, gauss_np))


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


def _write_file(path: Path, data: bytes) -> dict:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return SavedFile(path=path.name, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()).model_dump(mode="json")


def _prepare(root: Path, tmp: Path) -> None:
    """Rank 0: an empty temporary directory for the new checkpoint; leftovers of interrupted saves go."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        for p in root.iterdir():
            if p.is_dir() and LEFTOVER.match(p.name):
                shutil.rmtree(p)
        tmp.mkdir()
    except OSError as e:
        raise PlannerError(f"cannot write checkpoints to {str(root)!r}: {e.strerror or e}",
                           hint="--checkpoint-dir must be a writable directory every rank sees") from None


def _finish(runner: PlanRunner, reports: list[dict], *, step: int, tmp: Path, final: Path,
            keep: int | None) -> str:
    """Rank 0: the manifest from every rank's report, written last, then the rename into place."""
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
        data=DataPosition(iterations=step, samples=step * sum(i.seqs for i in plan.inputs)),
        files=[r["file"] for r in reports])
    problems = checkpoint_problems(manifest)
    if problems:  # the ranks' pieces do not tile the models: never leave such a checkpoint behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise PlannerError(f"checkpoint of step {step} would be incomplete: {problems[0]}")
    _write_file(tmp / MANIFEST_NAME, manifest.model_dump_json(indent=1).encode())
    _fsync_dir(tmp)
    if final.exists():  # an incomplete checkpoint of this step from an earlier attempt
        old = final.with_name(final.name + ".old")
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    _fsync_dir(final.parent)
    if keep is not None:
        _prune(final.parent, keep=keep, newest=step)
    return str(final)


def _prune(root: Path, *, keep: int, newest: int) -> None:
    """Delete all but the newest `keep` checkpoints (renamed out of the ``step-*`` names first, so
    a half-deleted one is never mistaken for a checkpoint)."""
    steps = sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name)))
    for step in [s for s in steps if s <= newest][:-keep]:
        doomed = step_dir(root, step)
        gone = doomed.with_name(doomed.name + ".deleting")
        doomed.rename(gone)
        shutil.rmtree(gone)


def save_checkpoint(runner: PlanRunner, root: str | Path, *, step: int, keep: int | None = None,
                    hooks: FaultHooks | None = None) -> Path:
    """Save the run's state after `step` iterations as ``ROOT/step-NNNNNNNNN`` (every rank calls it);
    returns the directory. A failure on any rank is a `PlannerError` on every rank, and leaves no
    checkpoint of this step."""
    root = Path(root)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    what = f"saving checkpoint {final.name}"
    _rank0(runner, lambda: _prepare(root, tmp), what=what)
    file = f"rank-{runner.rank:05d}.safetensors"
    with named(what, rank=runner.rank, timeout_s=runner.timeout_s):
        tensors, pieces, steps = _my_pieces(runner, file)
    rng, meta = _rng_state(runner.device)
    try:
        record = _write_file(tmp / file, safetensors.torch.save({**tensors, **rng}, metadata=meta))
        report: dict = {"rank": runner.rank, "pieces": pieces, "file": record, "optimizer_steps": steps}
    except OSError as e:
        report = {"rank": runner.rank, "error": f"cannot write {str(tmp / file)!r}: {e.strerror or e}"}
    if hooks is not None:
        hooks.while_saving(step)
    reports = _gather(runner, report, what=what)
    return Path(_rank0(runner, lambda: _finish(runner, reports or [], step=step, tmp=tmp, final=final, keep=keep),
                       what=what))


# Resuming -------------------------------------------------------------------------------------

def _choose(options: CheckpointOptions, runner: PlanRunner) -> tuple[str, str, list[str]] | None:
    """Rank 0: (directory, manifest JSON, newer incomplete checkpoints skipped) to resume, or None
    for a fresh start; a `PlannerError` when the checkpoint cannot be resumed by this run."""
    skipped: list[str] = []
    if options.resume == "auto":
        assert options.directory is not None
        found = latest_complete(options.directory)
        if found is None:
            return None
        directory, manifest = found
        skipped = sorted(p.name for p in options.directory.iterdir()
                         if p.is_dir() and (m := STEP_DIR.match(p.name)) and int(m.group(1)) > manifest.step)
    else:
        directory = Path(str(options.resume))
        if not (directory / MANIFEST_NAME).is_file() and directory.is_dir() and \
                any(STEP_DIR.match(p.name) for p in directory.iterdir()):
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
    problems = resume_problems(manifest, runner.plan)
    if problems:
        raise PlannerError(f"cannot resume checkpoint {str(directory)!r} with plan {runner.plan.name!r}: "
                           + "; ".join(problems),
                           hint="resume it with its own plan or one from `planner replan` of that plan")
    if manifest.seed != runner.seed:
        raise PlannerError(f"checkpoint {str(directory)!r} was saved by a run with --seed {manifest.seed}, this run "
                           f"has --seed {runner.seed} (the data and sampling would not continue where they stopped)",
                           hint=f"resume with --seed {manifest.seed}")
    return str(directory), manifest.model_dump_json(), skipped


class _Reader:
    """Reads boxes of saved tensors from a checkpoint's files, checking each file's hash once."""

    def __init__(self, directory: Path, manifest: CheckpointManifest) -> None:
        self.directory, self.manifest = directory, manifest
        self.records = {f.path: f for f in manifest.files}
        self.open: dict[str, Any] = {}

    def file(self, name: str) -> Any:
        if name not in self.open:
            path, record = self.directory / name, self.records[name]
            data = path.read_bytes()
            if record.sha256 is not None and hashlib.sha256(data).hexdigest() != record.sha256:
                raise PlannerError(f"checkpoint file {str(path)!r} does not have the content its manifest records "
                                   "(SHA-256 differs): it was damaged after it was written",
                                   hint="resume from an earlier checkpoint")
            try:
                self.open[name] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type for a malformed file
                raise PlannerError(f"checkpoint file {str(path)!r} is not a readable safetensors file: {e}") from None
        return self.open[name]

    def read(self, *, model: str, param: str, kind: str, box: Box) -> Tensor:
        """The `box` of a saved tensor, assembled from the pieces that overlap it."""
        out = torch.empty(tuple(hi - lo for lo, hi in box), dtype=torch.float32)
        covered = 0
        for piece, src, dst in reads_for(self.manifest, model=model, param=param, kind=kind, need=box):  # type: ignore[arg-type]
            part = self.file(piece.file).get_slice(piece.key)
            if tuple(part.get_shape()) != tuple(hi - lo for lo, hi in piece.box):
                raise PlannerError(f"checkpoint file {piece.file!r}: tensor {piece.key!r} has shape "
                                   f"{tuple(part.get_shape())}, its box {piece.box} says otherwise")
            out[tuple(slice(lo, hi) for lo, hi in dst)] = part[tuple(slice(lo, hi) for lo, hi in src)].float()
            covered += box_numel(dst)
        if covered != box_numel(box):
            raise PlannerError(f"checkpoint {str(self.directory)!r} lacks part of {model}'s {param} ({kind}): "
                               f"{covered} of the {box_numel(box)} elements of box {box}")
        return out


def _restore(runner: PlanRunner, directory: Path, manifest: CheckpointManifest) -> None:
    """Fill this rank's resident slices (and Adam states) from the checkpoint; RNG states too."""
    reader = _Reader(directory, manifest)
    for model, where, held in runner.resident():
        if held is None:
            continue
        decl, saved = runner.plan.models[model], manifest.models[model]
        moments: dict[str, tuple[Tensor, Tensor]] = {}
        with torch.no_grad():
            for param in parameters(decl.spec, head=decl.head):
                t = held.shard.params.get(param.name)
                box = shard_box(param, decl.spec, where.layout, held.groups.local)
                if t is None or box is None:
                    continue
                t.copy_(reader.read(model=model, param=param.name, kind="param", box=box))
                if held.dp is not None and saved.optimizer_step:
                    moments[param.name] = (reader.read(model=model, param=param.name, kind="exp_avg", box=box),
                                           reader.read(model=model, param=param.name, kind="exp_avg_sq", box=box))
        if held.dp is not None and moments:  # else the fresh state (no step taken) is the saved one
            held.dp.load_moments(moments, steps=saved.optimizer_step)
    if manifest.world_size == runner.world and runner.rank in manifest.rng:
        _set_rng_state(reader.file(manifest.rng[runner.rank]), runner.device)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from."""

    directory: Path
    step: int
    world_size: int
    skipped: list[str]


def resume(runner: PlanRunner, options: CheckpointOptions) -> Resumed | None:
    """Load the checkpoint `options.resume` names into `runner` (every rank calls it); None for a
    fresh start (``auto`` and no complete checkpoint). Problems are `PlannerError`s on every rank."""
    if options.resume is None:
        return None
    chosen = _rank0(runner, lambda: _choose(options, runner), what="choosing the checkpoint to resume")
    if chosen is None:
        return None
    path, text, skipped = chosen
    manifest = CheckpointManifest.model_validate_json(text)
    error: tuple[str, str | None] | None = None
    try:
        _restore(runner, Path(path), manifest)
    except PlannerError as e:  # a rank that cannot read its pieces tells the others instead of leaving them waiting
        error = (f"rank {runner.rank}: {e.message}", e.hint)
    errors = _gather(runner, error, what="resuming from a checkpoint")
    _rank0(runner, lambda: _raise_first(errors or []), what="resuming from a checkpoint")
    return Resumed(Path(path), manifest.step, manifest.world_size, skipped)


def _raise_first(errors: list[tuple[str, str | None] | None]) -> None:
    for e in errors:
        if e is not None:
            raise PlannerError(e[0], hint=e[1])
