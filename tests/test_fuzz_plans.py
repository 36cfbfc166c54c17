"""Property tests (hypothesis) over plan JSON: mutations of real compiled plans.

Deleted and extra keys, wrong types, out-of-range numbers, meshes and layouts moved
inconsistently, wrong versions and truncated text: reading a plan either gives a `Plan` (which then
round-trips, renders, and can be re-checked for memory without error) or a `PlannerError`, never
another exception. `planner validate` and `planner show` get the same guarantee through the CLI.
"""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from rich.console import Console

from planner.algorithms import ppo, sft
from planner.check import memory_problems
from planner.compile import compile_graph
from planner.render import print_plan
from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.plan import PLAN_VERSION, parse_plan, plan_to_json
from tests.strategies import fuzz_settings, mutated, replaced_placements


def _compiled() -> list[dict]:
    """Two real plans: PPO with reallocations on 4 GPUs, and SFT on 2 nodes of 2."""
    plans = [
        compile_graph(ppo("tiny-llama", critic="tiny-llama", reward_fn="m:f", batch=8, prompt_len=8, gen_len=8,
                          ppo_minibatches=2, name="tiny_ppo"), parse_cluster("cpu:1x4"), time_limit_s=0),
        compile_graph(sft("tiny-gpt", batch=16, seq_len=32, minibatches=2), parse_cluster("cpu:2x2"), time_limit_s=0),
    ]
    return [json.loads(plan_to_json(p)) for p in plans]


BASES = _compiled()


def read_or_error(text: str):  # noqa: ANN201
    """Parse plan text; for a plan, exercise everything a reader of it does."""
    try:
        plan = parse_plan(text)
    except PlannerError as e:
        assert str(e)
        event("rejected")
        return None
    event("accepted")
    assert parse_plan(plan_to_json(plan)) == plan
    assert isinstance(memory_problems(plan), list)
    print_plan(plan, Console(file=io.StringIO(), width=160))
    return plan


@fuzz_settings(300)
@given(data=st.one_of(*(mutated(b, max_edits=3) for b in BASES)))
def test_mutated_plans_read_or_raise_planner_error(data):
    read_or_error(json.dumps(data))


@fuzz_settings(150)
@given(data=st.one_of(*(replaced_placements(b) for b in BASES)))
def test_plans_with_moved_meshes_and_layouts_read_or_raise_planner_error(data):
    read_or_error(json.dumps(data))


@fuzz_settings(100)
@given(base=st.sampled_from(BASES), cut=st.floats(0, 1, exclude_max=True))
def test_truncated_plan_text_is_a_planner_error(base, cut):
    text = json.dumps(base)
    with pytest.raises(PlannerError):
        parse_plan(text[: int(len(text) * cut)])


@pytest.mark.parametrize("version", [0, 2, PLAN_VERSION + 1, -1, "1", 1.0, True, None, [1], {"v": 1}])
def test_wrong_versions_are_named_in_the_error(version):
    data = dict(BASES[0], version=version)
    with pytest.raises(PlannerError, match="version"):
        parse_plan(json.dumps(data))


def test_deeply_nested_or_non_object_json_is_a_planner_error():
    for text in ["[" * 100_000 + "]" * 100_000, "null", "[]", '"plan"', "1e999", "", "   \n"]:
        with pytest.raises(PlannerError):
            parse_plan(text)


def test_a_mutated_plan_file_through_the_cli(cli, tmp_path):
    """`planner validate` and `show` on bad plan files: exit 2 and one message, no traceback."""
    bad = dict(BASES[0])
    bad["calls"] = [dict(c) for c in bad["calls"]]
    call = bad["calls"][0] = dict(bad["calls"][0])
    call["mesh"] = {"ranks": [2, 3, 4, 5]}  # beyond the 4 GPUs of cpu:1x4, and misaligned
    call["layout"] = dict(call["layout"], dp=4, tp=1, pp=1, cp=1)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    for command in ("validate", "show"):
        r = cli(command, str(path))
        assert r.code == 2, r.out + r.err
        assert "exceeds the cluster's 4 GPUs" in r.err and "Traceback" not in r.err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BASES[0]))
    assert cli("validate", str(good)).code == 0


def test_a_plan_names_only_frameworks_the_cost_model_has() -> None:
    import typing

    from cost_models.framework import FRAMEWORKS
    from plans.plan import FrameworkName

    assert set(typing.get_args(FrameworkName)) == set(FRAMEWORKS)
