"""The planner trace format (plans/trace.py): Trace Event Format rules, recorder, loader, per-call times."""

from __future__ import annotations

import json

import pytest

from plans.errors import PlannerError
from plans.trace import (
    TraceRecorder,
    call_times_s,
    clock_offsets_s,
    host_id,
    load_trace,
    planner_trace_problems,
    spans,
    trace_document,
    trace_problems,
    write_trace,
)


def _recorded(steps: int = 3) -> dict:
    """Two ranks; per step a 2-rank call (rank 1 starts 1 ms late) and a reallocation on rank 0."""
    now = [0.0]
    recs = [TraceRecorder(r, clock=lambda: now[0]) for r in range(2)]
    for step in range(1, steps + 1):
        base = step * 1.0
        for r, rec in enumerate(recs):
            now[0] = base + 0.001 * r
            with rec.call("train", step=step, kind="train", model="actor"):
                now[0] += 0.010 * step  # steps take 10, 20, 30 ms
        now[0] = base + 0.5
        with recs[0].realloc("gen", step=step, model="actor", from_call="train"):
            now[0] += 0.002
    return trace_document([e for r in recs for e in r.events], source="measured", plan="p", world_size=2)


def test_recorded_trace_follows_the_trace_event_format_and_the_planner_rules() -> None:
    doc = _recorded()
    assert trace_problems(doc) == []
    assert planner_trace_problems(doc) == []
    assert doc["displayTimeUnit"] == "ms"
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 3 * 3
    first = next(e for e in xs if e["name"] == "train" and e["pid"] == 1 and e["args"]["step"] == 1)
    # microseconds from the recorder's origin (its clock read 0 at construction)
    assert first["ts"] == pytest.approx(1.001e6) and first["dur"] == pytest.approx(1e4)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert {(e["pid"], e["args"]["name"]) for e in meta} == {(0, "rank 0"), (1, "rank 1")}


def test_ranks_of_one_host_align_on_its_clock_and_hosts_on_their_earliest_barrier_exit() -> None:
    # Ranks 0-2 on host a left the barrier 0, 5 and 2 ms apart (shared cores); host b's clock is
    # 40 s off and its ranks left 1 ms apart.
    readings = [("a", 100.000), ("a", 100.005), ("a", 100.002), ("b", 140.001), ("b", 140.000)]
    assert clock_offsets_s(readings) == pytest.approx([0.0, 0.005, 0.002, 0.001, 0.0])
    assert clock_offsets_s([("a", 7.0)]) == [0.0]


def test_a_rank_whose_origin_is_later_shifts_its_spans_by_the_offset() -> None:
    """Two ranks whose recorders started 5 ms apart record one moment at one timestamp."""
    now = [10.0]
    early = TraceRecorder(0, clock=lambda: now[0])
    now[0] = 10.005
    late = TraceRecorder(1, clock=lambda: now[0], offset_s=0.005)
    now[0] = 10.5
    for rec in (early, late):
        with rec.call("c", step=1, kind="inference", model="m"):
            now[0] += 0.0
    assert early.events[0]["ts"] == pytest.approx(late.events[0]["ts"]) == pytest.approx(0.5e6)


def test_host_id_names_this_machine() -> None:
    assert host_id() == host_id() and host_id().startswith(__import__("socket").gethostname())


def test_real_clock_spans_are_ordered_and_non_negative() -> None:
    rec = TraceRecorder(0)
    for step in range(2):
        with rec.call("c", step=step, kind="inference", model="m"):
            sum(range(1000))
    a, b = rec.events
    assert 0 <= a["ts"] <= a["ts"] + a["dur"] <= b["ts"]


@pytest.mark.parametrize("mutate, needle", [
    (lambda e: e.update(ph="Q"), "not a Trace Event Format phase"),
    (lambda e: e.update(ts="10"), "ts must be a number"),
    (lambda e: e.update(pid=True), "pid must be an integer"),
    (lambda e: e.update(tid=1.5), "tid must be an integer"),
    (lambda e: e.pop("dur"), "needs dur >= 0"),
    (lambda e: e.update(dur=-1), "needs dur >= 0"),
    (lambda e: e.pop("pid"), "pid is missing"),
    (lambda e: e.update(args=[1]), "args must be an object"),
])
def test_trace_problems_catch_each_broken_rule(mutate, needle) -> None:  # noqa: ANN001
    doc = _recorded(1)
    event = next(e for e in doc["traceEvents"] if e["ph"] == "X")
    mutate(event)
    assert any(needle in p for p in trace_problems(doc)), trace_problems(doc)


def test_trace_problems_check_the_document_and_metadata() -> None:
    assert trace_problems({"events": []}) == ["a JSON Object Format trace needs a traceEvents array"]
    assert "displayTimeUnit" in trace_problems({"traceEvents": [], "displayTimeUnit": "s"})[0]
    assert "metadata name" in trace_problems([{"ph": "M", "name": "proc_name", "pid": 0, "args": {}}])[0]
    assert trace_problems([{"ph": "X", "name": "a", "ts": 0, "dur": 1, "pid": 0, "tid": 0}]) == []  # array format


@pytest.mark.parametrize("mutate, needle", [
    (lambda e: e["args"].pop("step"), "args.step"),
    (lambda e: e["args"].update(kind="sleep"), "args.kind"),
    (lambda e: e.update(cat="gpu"), "cat must be one of"),
    (lambda e: e.update(pid=7), "not a rank of a world of 2"),
])
def test_planner_rules_catch_missing_fields(mutate, needle) -> None:  # noqa: ANN001
    doc = _recorded(1)
    mutate(next(e for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == "call"))
    assert any(needle in p for p in planner_trace_problems(doc))
    doc = _recorded(1)
    next(e for e in doc["traceEvents"] if e.get("cat") == "realloc")["args"].pop("from_call")
    assert any("from_call" in p for p in planner_trace_problems(doc))


def test_call_times_span_ranks_and_skip_the_warm_up_step() -> None:
    items = spans(_recorded())
    # steps 2 and 3 (20 and 30 ms on each rank): rank 1 starts 1 ms after rank 0 and ends 1 ms later
    times = call_times_s(items)
    assert times[("call", "train")] == pytest.approx((0.020 + 0.030) / 2)  # from the last start
    first = call_times_s(items, start="first")
    assert first[("call", "train")] == pytest.approx(((0.020 + 0.001) + (0.030 + 0.001)) / 2)  # spread included
    assert times[("realloc", "gen")] == pytest.approx(0.002) == first[("realloc", "gen")]
    assert call_times_s(items, skip_steps=0)[("call", "train")] == pytest.approx(0.020)
    assert call_times_s([s for s in items if s.step == 1])[("call", "train")] == pytest.approx(0.010)
    with pytest.raises(ValueError, match="start"):
        call_times_s(items, start="middle")


def test_load_trace_merges_files_and_rejects_bad_ones(tmp_path) -> None:  # noqa: ANN001
    doc = _recorded()
    per_rank = []
    for r in (0, 1):
        part = dict(doc, traceEvents=[e for e in doc["traceEvents"] if e.get("pid") == r])
        path = tmp_path / f"t{r}.json"
        write_trace(path, part)
        per_rank.append(path)
    merged = load_trace(per_rank)
    assert spans(merged) == spans(doc)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlannerError, match="not valid JSON"):
        load_trace(tmp_path / "bad.json")
    (tmp_path / "chrome.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(PlannerError, match="otherData.format"):
        load_trace(tmp_path / "chrome.json")
    other = dict(doc, otherData=dict(doc["otherData"], plan="q"))
    write_trace(tmp_path / "q.json", other)
    with pytest.raises(PlannerError, match="is of plan 'q'"):
        load_trace([per_rank[0], tmp_path / "q.json"])


def test_written_traces_are_byte_stable(tmp_path) -> None:  # noqa: ANN001
    write_trace(tmp_path / "a.json", _recorded())
    write_trace(tmp_path / "b.json", _recorded())
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
