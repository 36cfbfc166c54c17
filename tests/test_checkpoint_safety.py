"""Checkpoints that cannot be fooled or lost: hashes are mandatory and checked on the open file,
links are refused, a directory belongs to one run (a lock, and its graph and seed), a full disk is
one clear error, pruning never follows a link nor fails a run, damaged contents name their file.

Single-process runs (``--reference``) keep these fast; the 4-rank cases are in
`tests/test_runtime_checkpoint.py` and at the end here.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch

from plans.checkpoint import MANIFEST_NAME, step_dir
from plans.plan import load_plan, save_plan
from runtime.checkpoint import LOCK_NAME, _prune
from tests.test_runtime_cli import ROOT, _run, _torchrun

PLAN = ROOT / "plans" / "tiny_ppo.json"


def _reference(*args: str) -> subprocess.CompletedProcess:
    return _run(["-m", "runtime", str(PLAN), "--reference", "--quiet", *args])


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A reference run's checkpoints after steps 1 and 2."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    out = _reference("--steps", "2", "--checkpoint-dir", str(root), "--checkpoint-every", "1")
    assert out.returncode == 0, out.stderr
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root, symlinks=True)
    return root


def _rewrite(directory: Path, name: str, tensors: dict, metadata: dict) -> None:
    """Replace a shard file and record its new size and hash in the manifest (a consistent but
    damaged checkpoint: only the contents are wrong)."""
    data = safetensors.torch.save(tensors, metadata=metadata)
    (directory / name).write_bytes(data)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    for f in manifest["files"]:
        if f["path"] == name:
            f["bytes"], f["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_shard_swapped_for_a_symbolic_link_is_refused(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    shard = step_dir(root, 2) / "rank-00000.safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    out = _reference("--steps", "3", "--resume", str(step_dir(root, 2)))
    assert out.returncode == 2 and "is a symbolic link (never followed in a checkpoint)" in out.stderr, out.stderr
    out = _reference("--steps", "3", "--checkpoint-dir", str(root), "--resume", "auto")
    assert out.returncode == 2 and "contains a symbolic link: 'ckpt/step-000000002/rank-00000.safetensors'" \
        in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and shard.is_symlink() and outside.is_file()  # nothing touched


def test_a_manifest_without_hashes_is_refused(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    path = step_dir(root, 2) / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    for f in manifest["files"]:
        f.pop("sha256")
    path.write_text(json.dumps(manifest))
    out = _reference("--steps", "3", "--resume", str(step_dir(root, 2)))
    assert out.returncode == 2 and "without a SHA-256" in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_directory_of_another_graphs_or_seeds_run_is_refused(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    other = tmp_path / "other.json"
    plan = load_plan(PLAN)
    save_plan(plan.model_copy(update={"algorithm": plan.algorithm.model_copy(update={"adam_eps": 1e-6})}), other)
    out = _run(["-m", "runtime", str(other), "--reference", "--quiet", "--steps", "1", "--checkpoint-dir", str(root)])
    assert out.returncode == 2 and "is not this run's to write: 2 checkpoints (step-000000001 to step-000000002) " \
        "were saved by plan 'tiny_ppo' of another graph" in out.stderr, out.stderr
    out = _reference("--steps", "1", "--checkpoint-dir", str(root), "--seed", "5")
    assert out.returncode == 2 and "saved by a run with --seed 0 (this run has --seed 5)" in out.stderr
    assert "--resume auto" in out.stderr  # how to continue that run instead
    assert sorted(p.name for p in root.iterdir()) == ["step-000000001", "step-000000002"]  # untouched


def test_two_live_runs_cannot_share_a_directory_and_a_dead_runs_lock_is_taken_over(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    first = subprocess.Popen([sys.executable, "-m", "runtime", str(PLAN), "--reference", "--quiet", "--steps",
                              "100000", "--checkpoint-dir", str(root)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((root / LOCK_NAME).exists() and (root / LOCK_NAME).read_text()) and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.1)
        out = _reference("--steps", "1", "--checkpoint-dir", str(root))
        assert out.returncode == 2 and f"in use by another live run (pid {first.pid} on host" in out.stderr, out.stderr
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock: the kernel releases it, the file stays
        first.communicate()
    assert (root / LOCK_NAME).exists()
    out = _reference("--steps", "1", "--checkpoint-dir", str(root))
    assert out.returncode == 0, out.stderr
    assert f"taking over {str(root / LOCK_NAME)!r} from a run that is no longer alive (pid {first.pid}" in out.stderr
    assert not (root / LOCK_NAME).exists()  # released at the end of the run


def test_damaged_contents_name_their_file(saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    directory = step_dir(root, 2)
    name = "rank-00000.safetensors"
    raw = (directory / name).read_bytes()  # in memory: the file is rewritten below (a mapping of it would break)
    tensors = {k: v.clone() for k, v in safetensors.torch.load(raw).items()}
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    meta = header["__metadata__"]
    missing = next(k for k in tensors if k.startswith("actor/param/"))
    _rewrite(directory, name, {k: v for k, v in tensors.items() if k != missing}, meta)
    out = _reference("--steps", "3", "--resume", str(directory))
    assert out.returncode == 2 and f"has no tensor {missing!r}, which its manifest lists" in out.stderr, out.stderr
    assert str(directory / name) in out.stderr and "Traceback" not in out.stderr
    _rewrite(directory, name, tensors, {**meta, "rng/python": "[not json"})
    out = _reference("--steps", "3", "--resume", str(directory))
    assert out.returncode == 2 and "metadata 'rng/python' is not valid JSON" in out.stderr, out.stderr
    _rewrite(directory, name, tensors, {**meta, "rng/python": "[3, [1, 2], null]"})
    out = _reference("--steps", "3", "--resume", str(directory))
    assert out.returncode == 2 and "holds RNG states this process cannot take" in out.stderr, out.stderr
    # Under --resume auto a damaged newest checkpoint is skipped, saying why, for the older one.
    out = _reference("--steps", "3", "--checkpoint-dir", str(root), "--resume", "auto", "--checkpoint-every", "5")
    assert out.returncode == 0, out.stderr
    out = _run(["-m", "runtime", str(PLAN), "--reference", "--steps", "3", "--checkpoint-dir", str(root),
                "--resume", "auto"])
    assert out.returncode == 0 and "resumed from" in out.stdout and "step-000000003" in out.stdout


def test_pruning_never_follows_a_link_and_never_fails_the_run(tmp_path: Path, monkeypatch, capsys) -> None:
    root = tmp_path / "ckpt"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_text("keep me")
    for step in (1, 3):
        step_dir(root, step).mkdir(parents=True)
    step_dir(root, 2).symlink_to(outside)
    _prune(root, keep=1, newest=3)
    assert sorted(p.name for p in root.iterdir()) == ["step-000000002", "step-000000003"]
    assert (outside / "data").read_text() == "keep me" and step_dir(root, 2).is_symlink()

    def fail(*_args) -> None:
        raise PermissionError(13, "Permission denied")

    step_dir(root, 1).mkdir()
    monkeypatch.setattr(shutil, "rmtree", fail)
    _prune(root, keep=1, newest=3)  # warns, does not raise
    assert "could not prune old checkpoints" in capsys.readouterr().err


@pytest.mark.slow
def test_a_full_disk_while_writing_the_manifest_is_one_clear_error_on_every_rank(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = _torchrun(4, str(PLAN), "--steps", "3", "--checkpoint-dir", str(root), "--checkpoint-every", "1", "--quiet",
                    env={"RUNTIME_TEST_DISK_FULL_AT": "2"})  # the kernel answers ENOSPC (/dev/full)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error (rank")]
    assert sorted(e.split(")")[0] for e in errors) == [f"error (rank {r}" for r in range(4)], out.stderr[-3000:]
    assert all("No space left on device (writing its manifest)" in e for e in errors), errors
    assert str(ROOT / "runtime") not in out.stderr  # no traceback of ours (torchrun prints its own summary)
    assert sorted(p.name for p in root.iterdir()) == ["step-000000001"]  # no .tmp left, step 1 intact
