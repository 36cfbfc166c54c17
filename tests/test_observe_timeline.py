"""Timelines: the predicted trace, GPU groups, the Gantt chart's rows and bars, predicted vs measured."""

from __future__ import annotations

import json

import pytest
from matplotlib.patches import Rectangle

from planner.timeline import (
    MIN_BAR_FRACTION,
    chrome_trace,
    compare_calls,
    figure_png,
    gpu_groups,
    mean_abs_error,
    merged_trace,
    predicted_trace,
    timeline_figure,
)
from plans.layout import Layout
from plans.trace import planner_trace_problems, spans, trace_problems
from tests.observe_fixtures import measured_trace, ppo_7b, tiny_ppo, with_placement


def _bars(ax) -> dict[str, Rectangle]:  # noqa: ANN001
    return {p.get_gid(): p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid()}


def test_predicted_trace_is_the_plan_per_rank() -> None:
    plan = tiny_ppo()
    doc = predicted_trace(plan)
    assert trace_problems(doc) == [] and planner_trace_problems(doc) == []
    items = spans(doc)
    calls = {c.name: c for c in plan.calls}
    assert len([s for s in items if s.cat == "call"]) == sum(c.mesh.size for c in plan.calls)
    for s in items:
        if s.cat == "call":
            c = calls[s.call]
            assert s.rank in c.mesh.ranks
            assert (s.start_s, s.dur_s) == pytest.approx((c.est_start_s, c.est_time_s), abs=1e-9)
    (r,) = plan.reallocations
    ranks = {s.rank for s in items if s.cat == "realloc"}
    assert ranks == set(calls[r.from_call].mesh.ranks) | set(calls[r.to_call].mesh.ranks)


def test_gpu_groups_merge_ranks_that_run_the_same_calls() -> None:
    plan = tiny_ppo()  # actor on [0], critic train on [1], ref on [2-3]
    groups = gpu_groups(plan)
    assert [g.label for g in groups] == ["GPU 0", "GPU 1", "GPUs 2-3"]
    assert [r for g in groups for r in g.ranks] == list(range(plan.cluster.world_size))
    # Each node trains a model of its own (the search may put both on all 16 GPUs, one after the other).
    train = Layout(dp=4, tp=2, zero=3, micro_batches=8, sequence_parallel=True)
    split = with_placement(ppo_7b(), {"actor_train": (0, train), "critic_train": (8, train)})
    assert [g.label for g in gpu_groups(split)] == ["GPUs 0-7", "GPUs 8-15"]


def test_chart_has_one_row_per_group_and_one_bar_per_call_and_group() -> None:
    plan = tiny_ppo()
    fig = timeline_figure(plan)
    (ax,) = fig.axes
    groups = gpu_groups(plan)
    assert [t.get_text() for t in ax.get_yticklabels()] == [g.label for g in groups]
    bars = _bars(ax)
    scale = 1e3  # this plan's axis is in ms
    assert ax.get_xlabel() == "time (ms)"
    min_w = ax.get_xlim()[1] / 1.01 * MIN_BAR_FRACTION
    expected = set()
    for c in plan.calls:
        for row, g in enumerate(groups):
            if set(g.ranks) & set(c.mesh.ranks):
                gid = f"call:{c.name}:{row}"
                expected.add(gid)
                rect = bars[gid]
                assert rect.get_x() == pytest.approx(c.est_start_s * scale)
                assert rect.get_width() == pytest.approx(max(c.est_time_s * scale, min_w))
                assert rect.get_y() + rect.get_height() / 2 == pytest.approx(row)
    (r,) = plan.reallocations
    realloc = {gid for gid in bars if gid.startswith("realloc:")}
    assert realloc == {f"realloc:{r.to_call}:0", f"realloc:{r.to_call}:1"}  # source GPU 1, destination GPU 0
    assert all(bars[g].get_hatch() == "////" for g in realloc)
    assert set(bars) - realloc == expected
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [*plan.models, "parameter reallocation"]


def test_bar_labels_fit_inside_their_bars() -> None:
    fig = timeline_figure(ppo_7b())
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    bars = _bars(ax)
    shown = 0
    for t in ax.texts:
        gid = (t.get_gid() or "").removeprefix("label:")
        if gid in bars and t.get_text():
            shown += 1
            assert t.get_window_extent(renderer).width <= bars[gid].get_window_extent(renderer).width
    assert shown >= len(ppo_7b().calls)  # every call is labelled somewhere


def test_png_is_deterministic() -> None:
    a, b = figure_png(timeline_figure(tiny_ppo())), figure_png(timeline_figure(tiny_ppo()))
    assert a[:8] == b"\x89PNG\r\n\x1a\n" and a == b


def test_measured_panel_shares_the_axis_and_shows_the_median_step() -> None:
    plan = tiny_ppo()
    meas = measured_trace(plan, steps=4, slowdown=2.0)
    fig = timeline_figure(plan, measured=meas)
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim()
    assert bottom.get_title(loc="left").startswith("measured: step 2 of 4")  # all equal: the first after warm-up
    pred, got = _bars(top), _bars(bottom)
    assert set(got) == set(pred)
    c = max(plan.calls, key=lambda c: c.est_time_s)
    gid = next(g for g in got if g.startswith(f"call:{c.name}:"))
    assert got[gid].get_width() == pytest.approx(2 * pred[gid].get_width())


def test_compare_calls_and_merged_trace() -> None:
    plan = tiny_ppo()
    meas = measured_trace(plan, steps=3, slowdown=1.25, skew_s=1e-4)
    rows = compare_calls(plan, meas)
    assert {r.call for r in rows if r.cat == "call"} == {c.name for c in plan.calls}
    for r in rows:  # ranks start 0.1 ms apart and take 1.25x the estimate: from the last start, no spread
        assert r.measured_s == pytest.approx(1.25 * r.predicted_s, rel=1e-6, abs=1e-9)
    assert all(r.error == pytest.approx(-0.2) for r in rows if r.cat == "call")  # 1.25x slower
    spread = compare_calls(plan, meas, start="first")
    for r, f in zip(rows, spread):  # from the first start: the spread of the ranks' starts on top
        ranks = plan.call(r.call).mesh.ranks if r.cat == "call" else None
        if ranks is not None:
            assert f.measured_s == pytest.approx(r.measured_s + 1e-4 * (max(ranks) - min(ranks)), rel=1e-6, abs=1e-9)
    assert mean_abs_error(rows) == pytest.approx(
        sum(abs(r.error) for r in rows if r.cat == "call") / len(plan.calls))
    doc = merged_trace(plan, meas)
    assert trace_problems(doc) == []
    world = plan.cluster.world_size
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names[0] == "predicted rank 0" and names[world] == "measured rank 0"
    step = doc["otherData"]["measured_step"]
    assert step in (2, 3)  # a step after the warm-up one
    step_start = min(s.start_s for s in spans(meas) if s.step == step)
    first_pred = min(e["ts"] for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] < world)
    assert first_pred == pytest.approx(step_start * 1e6)


def test_timeline_cli_writes_png_and_a_valid_chrome_trace(cli, tmp_path) -> None:  # noqa: ANN001
    from plans.plan import save_plan
    from plans.trace import write_trace

    plan_path = tmp_path / "tiny.json"
    save_plan(tiny_ppo(), plan_path)
    r = cli("timeline", str(plan_path), "-o", str(tmp_path / "t.png"), "--trace", str(tmp_path / "t.json"))
    assert r.code == 0, r.err
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    doc = json.loads((tmp_path / "t.json").read_text())
    assert trace_problems(doc) == [] and doc == json.loads(json.dumps(chrome_trace(tiny_ppo())))
    write_trace(tmp_path / "m.json", measured_trace(tiny_ppo(), steps=3, slowdown=2.0))
    r = cli("timeline", str(plan_path), "--measured", str(tmp_path / "m.json"), "-o", str(tmp_path / "vs.png"),
            "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["written"] == [str(tmp_path / "vs.png")] and out["mean_abs_error"] == pytest.approx(0.5)
    r = cli("timeline", str(plan_path), "-o", str(tmp_path / "t.svg"))
    assert r.code == 2 and "use -o FILE.png" in r.err
