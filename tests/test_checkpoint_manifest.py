"""`plans.checkpoint`: the manifest contract a saving runtime and a resuming one share.

A checkpoint is complete or ignored; its shards cover every parameter (and Adam moment) under the
saved layout; any other layout can be assembled from its pieces exactly once per element; a
re-planned plan of the same graph may resume it, a plan of another graph may not.
"""

from __future__ import annotations

import hashlib
import json
from itertools import product
from pathlib import Path

import pytest

from planner.algorithms import ppo
from planner.compile import compile_graph
from plans.checkpoint import (
    MANIFEST_NAME,
    CheckpointManifest,
    checkpoint_problems,
    completeness_problems,
    expected_boxes,
    graph_fingerprint,
    latest_complete,
    load_manifest,
    plan_fingerprint,
    reads_for,
    resume_problems,
    step_dir,
)
from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.layout import Layout
from plans.model import PRESETS
from plans.sharding import box_numel, parameters

SPEC = PRESETS["tiny-llama"]
SAVED = Layout(dp=2, tp=2, zero=3)


def write_checkpoint(root: Path, step: int, *, layout: Layout = SAVED, optimizer_step: int = 3,
                     drop: int = 0) -> Path:
    """A checkpoint of a trainable tiny-llama saved under `layout`; `drop` leaves out that many pieces."""
    directory = step_dir(root, step)
    directory.mkdir(parents=True)
    tensors, files = [], []
    for n, (param, boxes) in enumerate(sorted(expected_boxes(SPEC, head="lm", layout=layout).items())):
        for kind, box in product(("param", "exp_avg", "exp_avg_sq"), sorted(boxes)):
            name = f"shard-{n}-{kind}-{box[0][0]}.bin"
            size = 4 * box_numel(box)
            (directory / name).write_bytes(b"\0" * size)
            tensors.append({"model": "actor", "param": param, "kind": kind, "box": box, "file": name, "key": "t"})
            files.append({"path": name, "bytes": size, "sha256": hashlib.sha256(b"\0" * size).hexdigest()})
    (directory / "rng-0.bin").write_bytes(b"rng")
    files.append({"path": "rng-0.bin", "bytes": 3, "sha256": hashlib.sha256(b"rng").hexdigest()})
    manifest = {
        "format": "planner-checkpoint/1", "step": step, "plan_name": "tiny", "graph_fingerprint": "a" * 64,
        "plan_fingerprint": "b" * 64, "world_size": layout.size, "seed": 0,
        "models": {"actor": {"spec": SPEC.model_dump(mode="json"), "trainable": True,
                             "mesh": {"ranks": list(range(layout.size))}, "layout": layout.model_dump(mode="json"),
                             "optimizer_step": optimizer_step}},
        "tensors": tensors[: len(tensors) - drop], "rng": {"0": "rng-0.bin"},
        "data": {"iterations": step, "samples": 16 * step}, "files": files,
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    return directory


def test_a_complete_checkpoint_validates_and_is_found(tmp_path):
    directory = write_checkpoint(tmp_path, 10)
    manifest = load_manifest(directory)
    assert completeness_problems(directory, manifest) == []
    found = latest_complete(tmp_path)
    assert found is not None and found[0] == directory and found[1].step == 10


def test_incomplete_checkpoints_are_never_the_one_resumed(tmp_path):
    write_checkpoint(tmp_path, 10)
    write_checkpoint(tmp_path, 20, drop=1)  # a shard missing from the manifest
    truncated = write_checkpoint(tmp_path, 30)  # a file cut short by a crash
    victim = next(truncated.glob("shard-*"))
    victim.write_bytes(victim.read_bytes()[:-1])
    no_manifest = write_checkpoint(tmp_path, 40)
    (no_manifest / MANIFEST_NAME).unlink()
    torn = write_checkpoint(tmp_path, 50)
    (torn / MANIFEST_NAME).write_text((torn / MANIFEST_NAME).read_text()[:100])  # a partial manifest
    (tmp_path / "step-000000060.tmp").mkdir()  # an interrupted save, not yet renamed
    (tmp_path / "step-000000070").write_text("not a directory")

    found = latest_complete(tmp_path)
    assert found is not None and found[1].step == 10
    problems = completeness_problems(truncated, load_manifest(truncated))
    assert any("bytes, the manifest says" in p for p in problems)
    assert checkpoint_problems(load_manifest(step_dir(tmp_path, 20)))[0].startswith("model 'actor': ")
    assert latest_complete(tmp_path / "nowhere") is None


def test_missing_optimizer_state_is_a_missing_shard(tmp_path):
    directory = write_checkpoint(tmp_path, 1)
    data = json.loads((directory / MANIFEST_NAME).read_text())
    data["tensors"] = [t for t in data["tensors"] if t["kind"] != "exp_avg_sq"]
    problems = checkpoint_problems(CheckpointManifest.model_validate(data))
    assert problems and all("(exp_avg_sq) lacks" in p for p in problems)
    data["models"]["actor"]["optimizer_step"] = 0  # before the first step there are no moments to save ...
    problems = checkpoint_problems(CheckpointManifest.model_validate(data))
    assert problems and all("unexpected exp_avg pieces" in p for p in problems)  # ... and none are expected


@pytest.mark.parametrize("new", [Layout(), Layout(tp=4), Layout(pp=2, dp=2), Layout(dp=4, zero=3),
                                 Layout(tp=2, pp=2, interleave=2), Layout(dp=2, tp=4, zero=3)])
@pytest.mark.parametrize("saved", [SAVED, Layout(tp=4, pp=2), Layout(dp=8, zero=3)])
def test_any_layout_assembles_from_the_saved_pieces_exactly_once(tmp_path, saved, new):
    """Resharding on resume: every element each new shard needs comes from exactly one saved piece."""
    manifest = load_manifest(write_checkpoint(tmp_path, 1, layout=saved))
    for param in parameters(SPEC, head="lm"):
        for need in expected_boxes(SPEC, head="lm", layout=new)[param.name]:
            for kind in ("param", "exp_avg"):
                reads = reads_for(manifest, model="actor", param=param.name, kind=kind, need=need)
                assert sum(box_numel(dst) for _, _, dst in reads) == box_numel(need)
                for i, (_, _, a) in enumerate(reads):  # disjoint, so the sum is an exact cover
                    for _, _, b in reads[i + 1:]:
                        assert any(min(x1, y1) <= max(x0, y0) for (x0, x1), (y0, y1) in zip(a, b))
                for piece, src, dst in reads:  # the two views of an overlap have the same shape
                    assert [hi - lo for lo, hi in src] == [hi - lo for lo, hi in dst]
                    assert all(0 <= lo < hi <= p1 - p0 for (lo, hi), (p0, p1) in zip(src, piece.box))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["tensors"][0].update(file="../escape.bin"), "relative path inside the checkpoint"),
    (lambda d: d["tensors"][0].update(file="unlisted.bin"), "not listed in files"),
    (lambda d: d["tensors"][0].update(model="critic"), "unknown model"),
    (lambda d: d["tensors"][0].update(box=[[4, 4], [0, 64]]), "start < stop"),
    (lambda d: d.update(rng={"9": "rng-0.bin"}), "outside the saving run"),
    (lambda d: d.update(graph_fingerprint="xyz"), "graph_fingerprint"),
    (lambda d: d.update(format="planner-checkpoint/0"), "format"),
    (lambda d: d.pop("data"), "data"),
    (lambda d: d["files"][0].pop("sha256"), "without a SHA-256"),
    (lambda d: d["files"][0].update(sha256=None), "without a SHA-256"),
])
def test_bad_manifests_are_planner_errors(tmp_path, edit, message):
    directory = write_checkpoint(tmp_path, 1)
    data = json.loads((directory / MANIFEST_NAME).read_text())
    edit(data)
    (directory / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(PlannerError, match=message):
        load_manifest(directory)


def test_a_replanned_plan_may_resume_a_checkpoint_of_the_same_graph_only():
    from planner.replan import replan

    graph = ppo("tiny-llama", reward_fn="m:f", batch=8, prompt_len=8, gen_len=8, ppo_minibatches=2)
    old = compile_graph(graph, parse_cluster("cpu:1x4"), time_limit_s=0)
    new = replan(old, parse_cluster("cpu:1x2"), time_limit_s=0).new
    assert graph_fingerprint(new.graph()) == graph_fingerprint(old.graph())
    assert plan_fingerprint(new) != plan_fingerprint(old)
    renamed = graph.model_copy(update={"name": "renamed"})
    assert graph_fingerprint(renamed) == graph_fingerprint(graph)
    bigger = ppo("tiny-llama", reward_fn="m:f", batch=16, prompt_len=8, gen_len=8, ppo_minibatches=2)
    assert graph_fingerprint(bigger) != graph_fingerprint(graph)

    home = old.call("actor_train")
    manifest = CheckpointManifest(
        step=1, plan_name=old.name, graph_fingerprint=graph_fingerprint(old.graph()),
        plan_fingerprint=plan_fingerprint(old), world_size=4, seed=0,
        models={name: {"spec": d.spec, "head": d.head, "trainable": d.trainable, "mesh": home.mesh,
                       "layout": home.layout} for name, d in old.models.items()},
        tensors=[], data={"iterations": 1, "samples": 8}, files=[])
    assert resume_problems(manifest, new) == []
    other = compile_graph(bigger, parse_cluster("cpu:1x2"), time_limit_s=0)
    assert "another graph" in resume_problems(manifest, other)[0]


def test_a_link_in_a_checkpoint_makes_it_incomplete(tmp_path):
    directory = write_checkpoint(tmp_path, 10)
    victim = next(p for p in sorted(directory.iterdir()) if p.name.startswith("shard-"))
    outside = tmp_path / "outside.bin"
    victim.rename(outside)
    victim.symlink_to(outside)
    problems = completeness_problems(directory, load_manifest(directory))
    assert f"{'step-000000010/' + victim.name!r} is a symbolic link (never followed in a checkpoint)" in problems
    assert f"file {victim.name!r} is not a regular file" in problems
    assert latest_complete(tmp_path) is None
    (tmp_path / "step-000000011").symlink_to(directory)  # a linked step directory is never a checkpoint
    assert latest_complete(tmp_path) is None
