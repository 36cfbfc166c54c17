"""Checkpoints of real runs on 4 gloo ranks: fault recovery under torchrun restarts, elastic resume
on 2 ranks under a re-planned layout, crashes while saving, hung collectives, and bad resumes.

Faults are injected with the runtime's test hooks (`runtime.faults`): a rank `os._exit`s in the
middle of a step or of a save, or sleeps before a call, as a lost GPU or a hung peer would.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

from plans import save_plan
from plans.checkpoint import latest_complete, load_manifest, step_dir
from plans.plan import load_plan
from tests.test_runtime_cli import LAYOUTS, ROOT, TOL, _metrics, _run, _torchrun, tiny_ppo_plan

PLAN = ROOT / "plans" / "tiny_ppo.json"  # the bundled compiled example: several meshes, data between them
SHARDED = LAYOUTS  # tensor and pipeline parallel, ZeRO 1 and 2, sequence parallel: every kind of shard
STEPS, EVERY = 4, 2


def _trainer() -> int:
    """A rank other than 0 that the bundled plan trains on (the rank the fault tests kill)."""
    ranks = sorted({r for c in load_plan(PLAN).calls if c.kind == "train" for r in c.mesh.ranks} - {0})
    assert ranks, "the bundled tiny PPO plan trains on rank 0 alone: recompile it or pick another plan"
    return ranks[0]


def _values(metrics: list[dict]) -> list[dict]:
    """The computed values of each step (wall-clock times differ from run to run)."""
    return [{k: v for k, v in m.items() if not k.endswith("time_s")} for m in metrics]


def _state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (parameters, Adam moments, RNG states), keyed by file and name."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        for key, value in safetensors.torch.load_file(f).items():
            out[f"{f.name}:{key}"] = value
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The bundled tiny PPO plan run for 4 steps on 4 ranks, saving every 2 steps."""
    d = tmp_path_factory.mktemp("uninterrupted")
    out = _torchrun(4, str(PLAN), "--steps", str(STEPS), "--checkpoint-dir", str(d / "ckpt"),
                    "--checkpoint-every", str(EVERY), "--metrics-out", str(d / "metrics.jsonl"), "--quiet")
    assert out.returncode == 0, out.stderr[-3000:]
    return d


@pytest.mark.slow
def test_a_rank_killed_mid_step_recovers_under_torchrun_restarts_bitwise(uninterrupted: Path, tmp_path: Path) -> None:
    out = _torchrun(4, str(PLAN), "--steps", str(STEPS), "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--checkpoint-every", str(EVERY), "--resume", "auto", "--metrics-out", str(tmp_path / "m.jsonl"),
                    restarts=2, env={"RUNTIME_TEST_KILL_AT": f"3:{_trainer()}"})  # it dies in step 3's first train call
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"exitcode\s*:\s*137", out.stderr), out.stderr[-3000:]  # torchrun saw it die
    assert "no intact checkpoint" in out.stdout and "resumed from" in out.stdout and "step-000000002" in out.stdout
    final = "step-000000004"
    want, got = _state(uninterrupted / "ckpt" / final), _state(tmp_path / "ckpt" / final)
    assert got.keys() == want.keys() and any("/exp_avg/" in k for k in got)
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert unequal == []  # parameters, optimizer moments and RNG states: bit for bit
    # The metrics file has every step once: the restarted run kept the lines before its checkpoint.
    assert _values(_metrics(tmp_path / "m.jsonl")) == _values(_metrics(uninterrupted / "metrics.jsonl"))


@pytest.mark.heavy
@pytest.mark.slow
def test_a_bit_flipped_newest_checkpoint_is_skipped_and_the_run_recovers_bitwise(uninterrupted: Path,
                                                                                  tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = _torchrun(4, str(PLAN), "--steps", str(EVERY), "--checkpoint-dir", str(root), "--checkpoint-every", "1",
                    "--quiet")
    assert out.returncode == 0, out.stderr[-3000:]
    shard = step_dir(root, EVERY) / "rank-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x10  # one bit of a tensor: same size, so only the hash can tell
    shard.write_bytes(bytes(data))
    out = _torchrun(4, str(PLAN), "--steps", str(STEPS), "--checkpoint-dir", str(root), "--checkpoint-every",
                    str(EVERY), "--resume", "auto", restarts=2, env={"RUNTIME_TEST_KILL_AT": f"3:{_trainer()}"})
    assert out.returncode == 0, out.stderr[-3000:]
    first, *rest = [line for line in out.stdout.splitlines() if line.startswith("resumed from")]
    assert "step-000000001" in first and "skipped step-000000002" in first and "SHA-256 differs" in first, first
    assert rest and "step-000000002" in rest[0] and "skipped" not in rest[0]  # the restart resumed the rewritten one
    final = "step-000000004"
    want, got = _state(uninterrupted / "ckpt" / final), _state(root / final)
    assert got.keys() == want.keys() and [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.heavy
@pytest.mark.slow
def test_a_four_rank_checkpoint_resumes_on_two_ranks_under_a_replanned_layout(tmp_path: Path) -> None:
    four = tmp_path / "four.json"
    save_plan(tiny_ppo_plan(SHARDED), four)
    out = _torchrun(4, str(four), "--steps", str(EVERY), "--checkpoint-dir", str(tmp_path / "ckpt"), "--quiet")
    assert out.returncode == 0, out.stderr[-3000:]
    two = tmp_path / "two.json"
    out = _run(["-m", "planner", "replan", str(four), "--cluster", "cpu:1x2", "-o", str(two), "--time-limit", "1"])
    assert out.returncode == 0, out.stderr[-3000:]
    new = load_plan(two)
    assert new.cluster.world_size == 2
    assert {(c.mesh, c.layout) for c in new.calls}.isdisjoint({(m, lay) for m, lay in SHARDED.values()})
    out = _torchrun(2, str(two), "--steps", str(STEPS), "--resume", str(step_dir(tmp_path / "ckpt", EVERY)),
                    "--metrics-out", str(tmp_path / "two.jsonl"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "saved by 4 ranks" in out.stdout
    ref = _run(["-m", "runtime", str(four), "--reference", "--steps", str(STEPS),
                "--metrics-out", str(tmp_path / "ref.jsonl")])
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = _values(_metrics(tmp_path / "two.jsonl")), _values(_metrics(tmp_path / "ref.jsonl"))[EVERY:]
    assert [m["step"] for m in got] == list(range(EVERY + 1, STEPS + 1))
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and "actor_train.loss" in g
        for key, value in w.items():
            assert abs(g[key] - value) <= TOL, (g["step"], key, g[key], value)


@pytest.mark.slow
def test_a_crash_while_saving_leaves_no_checkpoint_that_resume_would_load(uninterrupted: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = _torchrun(4, str(PLAN), "--steps", str(STEPS), "--checkpoint-dir", str(root), "--checkpoint-every",
                    str(EVERY), "--quiet", env={"RUNTIME_TEST_KILL_AT": f"save:{STEPS}:1"})
    assert out.returncode != 0
    # The .tmp directory of the interrupted save is removed by rank 0 when it notices (or at the next save).
    assert {p.name for p in root.iterdir()} - {"step-000000004.tmp"} == {"step-000000002"}
    found = latest_complete(root)
    assert found is not None and found[1].step == EVERY
    # Stale pieces in a step directory (a copy cut short, a manifest gone) are skipped too.
    shutil.copytree(root / "step-000000002", root / "step-000000003")
    shard = next((root / "step-000000003").glob("rank-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    assert latest_complete(root)[1].step == EVERY  # type: ignore[index]
    out = _torchrun(4, str(PLAN), "--steps", str(STEPS), "--checkpoint-dir", str(root), "--resume", "auto")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout and "step-000000002" in out.stdout and "skipped step-000000003 (file " \
        in out.stdout
    assert not (root / "step-000000004.tmp").exists()
    final = _state(root / "step-000000004")
    want = _state(uninterrupted / "ckpt" / "step-000000004")
    assert final.keys() == want.keys() and all(torch.equal(final[k], want[k]) for k in want)


@pytest.mark.slow
def test_a_hung_collective_times_out_naming_its_call(tmp_path: Path) -> None:
    out = _torchrun(4, str(PLAN), "--steps", "3", "--collective-timeout", "5", "--quiet",
                    env={"RUNTIME_TEST_HANG_AT": "2:0"})  # rank 0 (every plan's first mesh) never starts step 2
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error (rank")]
    assert errors, out.stderr[-3000:]
    calls = {c.name for c in load_plan(PLAN).calls}
    for line in errors:
        assert "of step 2 on rank" in line and "did not complete within 5 s" in line
        assert any(f"call {name!r}" in line for name in calls), line
    assert "raise --collective-timeout" in out.stderr


@pytest.mark.slow
def test_a_checkpoint_missing_a_shard_is_refused_on_every_rank(uninterrupted: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "step-000000002"
    shutil.copytree(uninterrupted / "ckpt" / "step-000000002", damaged)
    (damaged / "rank-00002.safetensors").unlink()
    out = _torchrun(4, str(PLAN), "--steps", str(STEPS), "--resume", str(damaged))
    assert out.returncode != 0
    for rank in range(4):
        assert f"error (rank {rank}): checkpoint {str(damaged)!r} is incomplete: file 'rank-00002.safetensors' " \
               "is missing" in out.stderr
    assert str(ROOT / "runtime") not in out.stderr  # our error, not a traceback


def test_resume_problems_are_clear_errors(uninterrupted: Path, tmp_path: Path) -> None:
    saved = uninterrupted / "ckpt" / "step-000000002"
    cases = [
        (["--checkpoint-every", "2"], "need --checkpoint-dir"),
        (["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
        (["--resume", str(uninterrupted / "ckpt")], "is a directory of checkpoints, not one checkpoint"),
        (["--resume", str(saved), "--seed", "7"], "was saved by a run with --seed 0, this run has --seed 7"),
        (["--resume", str(tmp_path / "nowhere")], "has no readable manifest"),
    ]
    for extra, message in cases:
        out = _run(["-m", "runtime", str(PLAN), "--reference", "--quiet", *extra])
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, (extra, out.stderr)
    other = tmp_path / "other.json"  # a plan of another graph: the same calls under another algorithm setting
    plan = load_plan(PLAN)
    save_plan(plan.model_copy(update={"algorithm": plan.algorithm.model_copy(update={"adam_eps": 1e-6})}), other)
    out = _run(["-m", "runtime", str(other), "--reference", "--quiet", "--resume", str(saved)])
    assert out.returncode == 2 and "of another graph" in out.stderr and "planner replan" in out.stderr, out.stderr


def test_a_reference_run_resumes_where_it_stopped(uninterrupted: Path, tmp_path: Path) -> None:
    """One process, save after 2 steps, resume for 2 more: the metrics of one 4-step run."""
    args = ["-m", "runtime", str(PLAN), "--reference", "--quiet", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--metrics-out", str(tmp_path / "m.jsonl")]
    assert _run([*args, "--steps", str(EVERY)]).returncode == 0
    out = _run([*args, "--steps", str(STEPS), "--resume", "auto"])
    assert out.returncode == 0, out.stderr[-3000:]
    whole = _run(["-m", "runtime", str(PLAN), "--reference", "--quiet", "--steps", str(STEPS),
                  "--metrics-out", str(tmp_path / "whole.jsonl")])
    assert whole.returncode == 0
    assert _values(_metrics(tmp_path / "m.jsonl")) == _values(_metrics(tmp_path / "whole.jsonl"))
    manifest = load_manifest(step_dir(tmp_path / "ckpt", STEPS))
    assert manifest.step == STEPS and manifest.world_size == 1 and manifest.data.iterations == STEPS
