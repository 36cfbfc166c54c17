"""Checkpoint manifests: what a checkpoint holds, so that any plan of the same graph can resume it.

The contract between a runtime that saves and one that resumes, possibly under another plan (a
re-planned layout for another GPU count, `planner replan`). Pure Python over the schemas; the
runtime does the tensor I/O.

Layout on disk: ``ROOT/step-{step:09d}/`` holds the shard files and ``manifest.json``. A
checkpoint is written into a temporary sibling directory and renamed into place once every file
is flushed, the manifest last; `latest_complete` accepts only a directory whose manifest parses,
lists every file with its exact size, and covers every shard (`checkpoint_problems`), so a crash
while writing never leaves a checkpoint that ``--resume auto`` would load.

Tensors are stored by *box*: the slice of the full, unsharded tensor a piece holds, in the
coordinates of `plans.sharding.shard_box` (one ``[start, stop)`` per dim). The saver writes each
distinct shard of the saved layout once (data-parallel replicas write nothing), for the
parameters and, for a trainable model, Adam's elementwise ``exp_avg`` and ``exp_avg_sq`` in the
same boxes (a ZeRO-1/2 run gathers its flat optimizer partitions back into parameter shards
first). A resume under any layout asks `reads_for` which saved pieces overlap each slice it needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Final, Literal

from pydantic import Field, field_validator, model_validator

from plans.base import Strict, loads_json, validated
from plans.errors import PlannerError, brief
from plans.graph import Graph
from plans.layout import Layout, Mesh
from plans.model import Head, ModelSpec
from plans.sharding import Box, intersect, parameters, shard_box

CHECKPOINT_FORMAT: Final = "planner-checkpoint/1"
MANIFEST_NAME = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{9})$")
StateKind = Literal["param", "exp_avg", "exp_avg_sq"]
OPTIMIZER_KINDS: tuple[StateKind, ...] = ("exp_avg", "exp_avg_sq")


def _relative_file(path: str) -> str:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\\" in path:
        raise ValueError(f"file {path!r} must be a relative path inside the checkpoint directory")
    return path


class TensorPiece(Strict):
    """One saved slice of one tensor: which model, parameter and state, where in the full tensor,
    and where in the checkpoint."""

    model: str
    param: str = Field(description="Parameter name from the catalog (`plans.sharding.parameters`).")
    kind: StateKind = Field("param", description="The parameter itself or one of Adam's moment estimates.")
    box: tuple[tuple[int, int], ...] = Field(description="[start, stop) per dim of the full tensor.")
    file: str = Field(description="File holding the piece, relative to the checkpoint directory.")
    key: str = Field(description="Name of the tensor inside the file (e.g. a safetensors key).")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @field_validator("file")
    @classmethod
    def check_file(cls, path: str) -> str:
        return _relative_file(path)

    @field_validator("box")
    @classmethod
    def check_box(cls, box: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        if not box or any(not 0 <= lo < hi for lo, hi in box):
            raise ValueError(f"box {box} must have 0 <= start < stop in every dim")
        return box


class SavedModel(Strict):
    """A model as it was saved: its architecture and the placement its shards come from."""

    spec: ModelSpec
    head: Head = "lm"
    trainable: bool
    mesh: Mesh = Field(description="Ranks of the call that held the parameters at rest (its home call).")
    layout: Layout = Field(description="Layout of that call; its distinct shard boxes are the pieces saved.")
    optimizer_step: int = Field(0, ge=0, description="Adam steps taken (bias correction); 0 means no moments saved.")


class SavedFile(Strict):
    """A file of the checkpoint, its exact size (a truncated file is an incomplete checkpoint) and
    its content hash (a resume reads only files whose content hashes to it)."""

    path: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the file's content (mandatory).")

    @field_validator("path")
    @classmethod
    def check_path(cls, path: str) -> str:
        return _relative_file(path)


class DataPosition(Strict):
    """Where the data stream stands, so a resume neither repeats nor skips samples."""

    iterations: int = Field(ge=0, description="Iterations completed (the next one to run has this index).")
    samples: int = Field(ge=0, description="Sequences drawn from the data source so far.")
    epoch: int = Field(0, ge=0)


class CheckpointManifest(Strict):
    """Everything needed to resume: models and their shards, RNG states per rank, data position."""

    format: Literal["planner-checkpoint/1"] = CHECKPOINT_FORMAT
    step: int = Field(ge=0, description="Iterations completed when saved (names the directory).")
    plan_name: str
    graph_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$", description="`graph_fingerprint` of the plan's graph.")
    plan_fingerprint: str = Field(pattern=r"^[0-9a-f]{64}$", description="`plan_fingerprint` of the saving plan.")
    world_size: int = Field(ge=1, description="Ranks of the saving run.")
    seed: int
    models: dict[str, SavedModel]
    tensors: list[TensorPiece]
    rng: dict[int, str] = Field(default_factory=dict, description="Saving rank -> file of its RNG states.")
    data: DataPosition
    files: list[SavedFile] = Field(description="Every file of the checkpoint but the manifest.")

    @model_validator(mode="after")
    def check_references(self) -> CheckpointManifest:
        listed = {f.path for f in self.files}
        for t in self.tensors:
            if t.model not in self.models:
                raise ValueError(f"tensor piece of unknown model {t.model!r}")
            if t.file not in listed:
                raise ValueError(f"tensor file {t.file!r} is not listed in files")
        for rank, path in self.rng.items():
            if not 0 <= rank < self.world_size:
                raise ValueError(f"rng state of rank {rank} outside the saving run's {self.world_size} ranks")
            _relative_file(path)
            if path not in listed:
                raise ValueError(f"rng file {path!r} is not listed in files")
        return self


# Fingerprints -----------------------------------------------------------------------------------

def _sha256(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def graph_fingerprint(graph: Graph) -> str:
    """Hash of what a checkpoint's contents depend on: models, calls, inputs, algorithm (not the
    placement). A re-planned plan keeps it, so its runs may resume the old plan's checkpoints."""
    data = graph.model_dump(mode="json")
    data["calls"] = sorted(data["calls"], key=lambda c: c["name"])  # execution order is placement
    for call in data["calls"]:
        call.pop("response_len", None)  # a costing figure: the computation is the same
    data.pop("name", None)  # renaming a job does not change its state
    for decl in data["models"].values():
        decl["spec"].pop("name", None)
        # Fields added after checkpoint format 1 are left out while unset, so the checkpoints of
        # graphs that do not use them keep their fingerprints.
        for obj, key in ((decl, "weights"), (decl["spec"], "sliding_window"), (decl["spec"], "rope_scaling")):
            if obj.get(key) is None:
                obj.pop(key, None)
    for inp in data.get("inputs", []):
        if inp.get("data") is None:
            inp.pop("data", None)
    if not data.get("algorithm", {}).get("stop"):
        data.get("algorithm", {}).pop("stop", None)
    return _sha256(data)


def plan_fingerprint(plan: Any) -> str:
    """Hash of a plan (a `plans.plan.Plan`) minus how long its search took."""
    data = plan.model_dump(mode="json")
    data["search"]["wall_s"] = None
    return _sha256(data)


# Shards -----------------------------------------------------------------------------------------

def expected_boxes(spec: ModelSpec, *, head: Head, layout: Layout) -> dict[str, set[Box]]:
    """Parameter -> the distinct boxes its shards have under `layout` (what a saver writes once each)."""
    out: dict[str, set[Box]] = {}
    for param in parameters(spec, head=head):
        boxes = out.setdefault(param.name, set())
        for local in range(layout.size):
            box = shard_box(param, spec, layout, local)
            if box is not None and all(lo < hi for lo, hi in box):
                boxes.add(box)
    return out


def shard_writers(spec: ModelSpec, *, head: Head, mesh: Mesh, layout: Layout) -> dict[str, dict[Box, int]]:
    """Parameter -> distinct box -> the global rank that saves it: the first rank of `mesh` (in
    mesh order) holding the box, so each shard is written once (data-parallel replicas, and the
    last stage's copy of a tied embedding, write nothing). Covers `expected_boxes` exactly."""
    out: dict[str, dict[Box, int]] = {}
    for param in parameters(spec, head=head):
        writers = out.setdefault(param.name, {})
        for local, rank in enumerate(mesh.ranks):
            box = shard_box(param, spec, layout, local)
            if box is not None and all(lo < hi for lo, hi in box):
                writers.setdefault(box, rank)
    return out


def checkpoint_problems(manifest: CheckpointManifest) -> list[str]:
    """Shards the manifest lacks or does not expect, per model, parameter and state kind."""
    problems: list[str] = []
    have: dict[tuple[str, str, str], set[Box]] = {}
    for t in manifest.tensors:
        have.setdefault((t.model, t.param, t.kind), set()).add(t.box)
    expected_keys: set[tuple[str, str, str]] = set()
    for name, m in manifest.models.items():
        kinds: tuple[StateKind, ...] = ("param", *(OPTIMIZER_KINDS if m.trainable and m.optimizer_step else ()))
        for param, boxes in expected_boxes(m.spec, head=m.head, layout=m.layout).items():
            for kind in kinds:
                expected_keys.add((name, param, kind))
                got = have.get((name, param, kind), set())
                missing, extra = boxes - got, got - boxes
                if missing:
                    problems.append(f"model {name!r}: {param} ({kind}) lacks {len(missing)} of {len(boxes)} shards, "
                                    f"e.g. box {sorted(missing)[0]}")
                if extra:
                    problems.append(f"model {name!r}: {param} ({kind}) has shards {sorted(extra)[:2]} that layout "
                                    f"{m.layout.short()} does not cut")
    for key in sorted(set(have) - expected_keys):
        problems.append(f"model {key[0]!r}: unexpected {key[2]} pieces of {key[1]!r}")
    return problems


def reads_for(manifest: CheckpointManifest, *, model: str, param: str, kind: StateKind, need: Box
              ) -> list[tuple[TensorPiece, Box, Box]]:
    """The saved pieces overlapping `need` (a box of the full tensor), each with the overlap
    relative to the piece (what to read from it) and to `need` (where it goes)."""
    out = []
    for t in manifest.tensors:
        if (t.model, t.param, t.kind) != (model, param, kind) or len(t.box) != len(need):
            continue
        common = intersect(t.box, need)
        if common is None:
            continue
        in_piece = tuple((lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(common, t.box))
        in_need = tuple((lo - n0, hi - n0) for (lo, hi), (n0, _) in zip(common, need))
        out.append((t, in_piece, in_need))
    return out


# Files ------------------------------------------------------------------------------------------

def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint after `step` iterations."""
    return Path(root) / f"step-{step:09d}"


def load_manifest(directory: str | Path) -> CheckpointManifest:
    """Read and validate ``DIRECTORY/manifest.json``; a `PlannerError` says what is wrong."""
    path = Path(directory) / MANIFEST_NAME
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as e:
        raise PlannerError(f"checkpoint {str(directory)!r} has no readable manifest: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise PlannerError(f"checkpoint manifest {str(path)!r} is not valid JSON: {e}") from None
    data = loads_json(raw, source=f"checkpoint manifest {str(path)!r}")
    if isinstance(data, dict) and data.get("format") != CHECKPOINT_FORMAT:
        raise PlannerError(f"checkpoint {str(directory)!r} has format {data.get('format')!r}; this version reads "
                           f"{CHECKPOINT_FORMAT!r}")
    files = data.get("files") if isinstance(data, dict) else None
    unhashed = [f.get("path") for f in files if isinstance(f, dict) and not f.get("sha256")] \
        if isinstance(files, list) else []
    if unhashed:
        raise PlannerError(f"checkpoint manifest {str(path)!r} lists {len(unhashed)} file(s) without a SHA-256 "
                           f"(e.g. {brief(unhashed[0])}); every file of a checkpoint must carry its hash, so that a "
                           "resume reads only what was written", hint="resume from a checkpoint this version wrote")
    return validated(CheckpointManifest, data, source=f"checkpoint manifest {str(path)!r}")


def symbolic_links(root: str | Path) -> list[str]:
    """Every symbolic link at or under `root` (not followed), relative to `root`'s parent: a
    checkpoint directory holds none, so that a resume never reads, and pruning never deletes,
    files outside it."""
    root = Path(root)
    found = [root.name] if root.is_symlink() else []
    for top, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(top, name)):
                found.append(os.path.relpath(os.path.join(top, name), root.parent))
    return found


def completeness_problems(directory: str | Path, manifest: CheckpointManifest) -> list[str]:
    """Files the manifest lists that are missing, not regular files (a symbolic link is refused,
    never followed) or of another size, and shards it lacks. The hashes are checked when the
    files are read (`runtime.stfile`)."""
    root = Path(directory)
    problems = [f"{link!r} is a symbolic link (never followed in a checkpoint)" for link in symbolic_links(root)]
    for f in manifest.files:
        try:
            st = os.lstat(root / f.path)
        except OSError:
            problems.append(f"file {f.path!r} is missing")
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"file {f.path!r} is not a regular file")
        elif st.st_size != f.bytes:
            problems.append(f"file {f.path!r} has {st.st_size} bytes, the manifest says {f.bytes}")
    return problems + checkpoint_problems(manifest)


def step_dirs(root: str | Path) -> list[Path]:
    """The ``step-NNNNNNNNN`` entries directly under `root`, newest first (links included, so
    that callers can refuse them); temporary directories of an interrupted save do not match."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def scan(root: str | Path) -> list[tuple[Path, CheckpointManifest | None, list[str]]]:
    """Every checkpoint under `root`, newest first: (directory, its manifest or None, why it is
    incomplete: empty for a complete one)."""
    out: list[tuple[Path, CheckpointManifest | None, list[str]]] = []
    for directory in step_dirs(root):
        if directory.is_symlink() or not directory.is_dir():
            out.append((directory, None, ["it is a symbolic link or not a directory"]))
            continue
        try:
            manifest = load_manifest(directory)
        except PlannerError as e:
            out.append((directory, None, [e.message]))
            continue
        out.append((directory, manifest, completeness_problems(directory, manifest)))
    return out


def latest_complete(root: str | Path) -> tuple[Path, CheckpointManifest] | None:
    """The newest complete checkpoint under `root`, or None. Incomplete directories (no manifest,
    a partial file, a missing shard, a symbolic link) are skipped, never loaded. ``--resume
    auto`` starts from here and also falls back past one whose content does not hash to its
    manifest (`runtime.checkpoint.resume`)."""
    for directory, manifest, problems in scan(root):
        if manifest is not None and not problems:
            return directory, manifest
    return None


def resume_problems(manifest: CheckpointManifest, plan: Any) -> list[str]:
    """Why a run of `plan` (a `plans.plan.Plan`) cannot resume from `manifest` (empty when it can)."""
    problems = []
    if manifest.graph_fingerprint != graph_fingerprint(plan.graph()):
        problems.append(f"the checkpoint was saved by plan {manifest.plan_name!r} of another graph "
                        "(models, calls or algorithm differ); only a re-planned plan of the same graph resumes it")
    used = plan.graph().home_calls()  # a model no call uses has no state to resume
    for name, decl in plan.models.items():
        if name not in used:
            continue
        saved = manifest.models.get(name)
        if saved is None:
            problems.append(f"model {name!r} is not in the checkpoint")
        elif (saved.spec.model_dump(exclude={"name"}), saved.head) != (decl.spec.model_dump(exclude={"name"}), decl.head):
            problems.append(f"model {name!r} has another architecture or head in the checkpoint")
    return problems
