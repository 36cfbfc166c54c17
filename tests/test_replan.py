"""`planner replan`: a plan's graph recompiled for a new cluster, old against new, clear errors."""

from __future__ import annotations

import json

import pytest

from planner.algorithms import ppo
from planner.check import memory_problems
from planner.compile import compile_graph
from planner.replan import baseline_of, replan
from plans.checkpoint import graph_fingerprint
from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.plan import load_plan, parse_plan, plan_to_json, save_plan

TIME_LIMIT_S = 0.5


def _graph():  # noqa: ANN202
    return ppo("tiny-llama", critic="tiny-llama", reward_fn="m:f", batch=8, prompt_len=8, gen_len=8,
               ppo_minibatches=2, name="tiny_ppo")


@pytest.fixture(scope="module")
def plans_dir(tmp_path_factory):
    """The tiny PPO plan on 4 GPUs, full search and colocate baseline."""
    d = tmp_path_factory.mktemp("replan")
    save_plan(compile_graph(_graph(), parse_cluster("cpu:1x4"), time_limit_s=TIME_LIMIT_S), d / "four.json")
    save_plan(compile_graph(_graph(), parse_cluster("cpu:1x4"), time_limit_s=0, baseline="colocate"),
              d / "colocate.json")
    return d


@pytest.mark.parametrize("cluster", ["cpu:1x2", "cpu:2x4", "cpu:1x1"])
def test_replan_keeps_the_graph_and_fits_the_new_cluster(plans_dir, cluster):
    old = load_plan(plans_dir / "four.json")
    result = replan(old, parse_cluster(cluster), time_limit_s=TIME_LIMIT_S)
    new = result.new
    assert new.cluster == parse_cluster(cluster)
    assert graph_fingerprint(new.graph()) == graph_fingerprint(old.graph())
    assert {c.name: c for c in new.graph().calls} == {c.name: c for c in old.graph().calls}
    assert all(c.mesh.ranks[-1] < new.cluster.world_size for c in new.calls)
    assert memory_problems(new) == []
    assert parse_plan(plan_to_json(new)) == new
    # The report states both plans' figures as the plans do.
    report = result.to_json()
    assert report["old"]["iteration_s"] == old.estimate.iteration_s
    assert report["new"]["iteration_s"] == new.estimate.iteration_s
    assert report["new"]["gpus"] == new.cluster.world_size
    assert report["speedup"] == pytest.approx(old.estimate.iteration_s / new.estimate.iteration_s)


def test_replan_equals_compiling_the_graph_for_the_new_cluster(plans_dir):
    """Deterministic, and nothing of the old placement leaks into the new plan."""
    old = load_plan(plans_dir / "four.json")
    # Beam search only: CP-SAT repeats under its work budget, but a loaded CI machine may hit the
    # wall-clock safety net of a short time limit first.
    new = replan(old, parse_cluster("cpu:1x2"), time_limit_s=0).new
    direct = compile_graph(old.graph(), parse_cluster("cpu:1x2"), time_limit_s=0)

    def without_wall(p):  # noqa: ANN001, ANN202
        data = json.loads(plan_to_json(p))
        data["search"]["wall_s"] = None
        return data

    assert without_wall(new) == without_wall(direct)


def test_replan_keeps_a_baseline_rule_unless_told_otherwise(plans_dir):
    old = load_plan(plans_dir / "colocate.json")
    assert baseline_of(old) == "colocate"
    kept = replan(old, parse_cluster("cpu:1x2"), time_limit_s=0).new
    assert kept.search.method.startswith("colocate")
    full = replan(old, parse_cluster("cpu:1x2"), time_limit_s=0, baseline=None).new
    assert not full.search.method.startswith("colocate")


def test_replan_names_both_clusters_when_the_graph_does_not_fit(plans_dir):
    old = load_plan(plans_dir / "four.json")
    with pytest.raises(PlannerError, match=r"cannot be re-planned for cpu:1x1,mem_gib=0\.001.*does not fit"):
        replan(old, parse_cluster("cpu:1x1,mem_gib=0.001"), time_limit_s=0)


def test_cli_replan_prints_old_and_new_and_writes_the_plan(cli, plans_dir, tmp_path):
    out = tmp_path / "two.json"
    r = cli("replan", str(plans_dir / "four.json"), "--cluster", "cpu:1x2", "-o", str(out),
            "--time-limit", str(TIME_LIMIT_S))
    assert r.code == 0, r.err
    old, new = load_plan(plans_dir / "four.json"), load_plan(out)
    assert new.cluster.world_size == 2
    assert "cpu:1x4" in r.out and "cpu:1x2" in r.out and "placements" in r.out and f"wrote {out}" in r.out
    from planner.render import fmt_s

    assert f"iteration {fmt_s(old.estimate.iteration_s)} -> {fmt_s(new.estimate.iteration_s)}" in r.out
    assert cli("validate", str(out)).code == 0


def test_cli_replan_json(cli, plans_dir, tmp_path):
    out = tmp_path / "eight.json"
    r = cli("replan", str(plans_dir / "four.json"), "-c", "cpu:2x4", "-o", str(out), "--time-limit", "0", "--json")
    assert r.code == 0, r.err
    report = json.loads(r.out)
    new = load_plan(out)
    assert report["new"]["gpus"] == 8 and report["old"]["gpus"] == 4
    assert report["new"]["iteration_s"] == new.estimate.iteration_s
    assert report["graph_fingerprint"] == graph_fingerprint(new.graph())
    assert [c["call"] for c in report["calls"]] == [c.name for c in new.calls]
    assert set(report["reshard_models"]) <= set(new.models)


@pytest.mark.parametrize("args, message", [
    (["missing.json", "-c", "cpu:1x2", "-o", "x.json"], "cannot read plan"),
    (["{plans}", "-c", "cpu:1x2", "-o", "x.json"], "Is a directory"),
    (["{plans}/four.json", "-c", "cpu:2", "-o", "x.json"], "malformed cluster"),
    (["{plans}/four.json", "-c", "tpu:1x2", "-o", "x.json"], "unknown GPU"),
    (["{plans}/four.json", "-c", "cpu:1x2", "-o", "{plans}"], "is a directory"),
    (["{plans}/four.json", "-c", "cpu:1x1,mem_gib=0.001", "-o", "x.json", "--time-limit", "0"], "does not fit"),
    (["{plans}/four.json", "-c", "cpu:1x2", "-o", "x.json", "--time-limit", "inf"], "time limit"),
    (["{plans}/four.json", "-c", "cpu:1x2", "-o", "x.json", "--calibration", "{plans}"], "is a directory"),
])
def test_cli_replan_errors(cli, plans_dir, tmp_path, args, message):
    args = [a.replace("{plans}", str(plans_dir)) for a in args]
    r = cli("replan", *args, cwd=tmp_path)
    assert r.code == 2, r.out + r.err
    assert message in r.err and "Traceback" not in r.err
    assert not (tmp_path / "x.json").exists()
