"""Bad files and flags on every command: one clear message and exit status 2, never a traceback.

Covers what used to escape as a traceback: directories where a file is expected, non-UTF-8,
empty and deeply nested files, graph files whose `build()` raises or that call sys.exit, a
CLUSTER of the wrong type, outputs that cannot be written (checked before the long work), plans
stating a zero iteration time, sizes beyond the schema, and out-of-range numbers on flags.
"""

from __future__ import annotations

import json

import pytest

from plans.plan import plan_to_json
from tests.conftest import ROOT

OK_GRAPH = """from planner.algorithms import sft
CLUSTER = "cpu:1x2"
graph = sft("tiny-llama", batch=4, seq_len=8)
"""
MEASURED_HEADER = ("hidden_size,num_attention_heads,num_hidden_layers,seq_len,global_batch,micro_batch,tp,dp,pp,"
                   "iteration_ms\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A directory of broken inputs, one per failure mode (the commands below only read it)."""
    tmp_path = tmp_path_factory.mktemp("inputs")
    (tmp_path / "ok.py").write_text(OK_GRAPH)
    for name in ("nonutf8.py", "nonutf8.json", "nonutf8.csv", "nonutf8.yaml"):
        (tmp_path / name).write_bytes(b"\xff\xfe\x00not text")
    for name in ("empty.py", "empty.json", "empty.csv", "empty.yaml"):
        (tmp_path / name).write_text("")
    for name in ("dir.py", "dir.json", "dir.yaml", "dir.csv"):
        (tmp_path / name).mkdir()
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "build_raises.py").write_text("def build():\n    raise RuntimeError('boom')\n")
    (tmp_path / "build_args.py").write_text("def build(x):\n    return x\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "cluster_int.py").write_text(OK_GRAPH.replace('"cpu:1x2"', "5"))
    cluster_dict = '{"gpu": "cpu", "nodes": 1, "gpus_per_node": 2}'
    (tmp_path / "cluster_dict.py").write_text(OK_GRAPH.replace('"cpu:1x2"', cluster_dict))
    (tmp_path / "graph_dict.py").write_text('graph = {"name": "x"}\n')
    (tmp_path / "cluster_types.yaml").write_text('gpu: cpu\nnodes: "two"\ngpus_per_node: 2\n')
    (tmp_path / "cluster_inf.yaml").write_text("gpu: cpu\nnodes: 1\ngpus_per_node: 2\nmem_gib: .inf\n")
    (tmp_path / "cluster_list.yaml").write_text("[1, 2]\n")
    (tmp_path / "measured_dp0.csv").write_text(MEASURED_HEADER + "1024,16,24,2048,8,1,1,0,1,100\n")
    (tmp_path / "measured_text.csv").write_text(MEASURED_HEADER + "1024,16,24,2048,8,1,1,1,1,fast\n")
    (tmp_path / "measured_inf.csv").write_text(MEASURED_HEADER + "1024,16,24,inf,8,1,1,1,1,100\n")
    (tmp_path / "measured_zero.csv").write_text(MEASURED_HEADER + "1024,16,24,2048,8,1,1,1,1,0\n")
    (tmp_path / "measured.csv").write_text(MEASURED_HEADER + "1024,16,24,2048,8,1,1,1,1,100\n")
    return tmp_path


CASES = [
    # compile: graph files
    (["compile", "dir.py"], "is a directory"),
    (["compile", "nonutf8.py"], "syntax error"),
    (["compile", "empty.py"], "defines neither"),
    (["compile", "build_raises.py", "-c", "cpu:1x2"], "build_raises.py:2: build() raised RuntimeError: boom"),
    (["compile", "build_args.py", "-c", "cpu:1x2"], "build() raised TypeError"),
    (["compile", "exits.py", "-c", "cpu:1x2"], "called sys.exit(3)"),
    (["compile", "cluster_int.py"], "CLUSTER is a int"),
    (["compile", "graph_dict.py", "-c", "cpu:1x2"], "`graph` is a dict"),
    # compile: outputs, search settings, cluster and calibration files
    (["compile", "ok.py", "-o", "dir.json"], "is a directory"),
    (["compile", "ok.py", "-o", "ok.py/plan.json"], "is a file, not a directory"),
    (["compile", "ok.py", "--time-limit", "inf"], "time limit must be between 0 and"),
    (["compile", "ok.py", "--time-limit", "-1"], "Invalid value for '--time-limit'"),
    (["compile", "ok.py", "--calibration", "dir.json"], "is a directory"),
    (["compile", "ok.py", "--calibration", "nonutf8.json"], "not a UTF-8 text"),
    (["compile", "ok.py", "--calibration", "empty.json"], "not valid JSON"),
    (["compile", "ok.py", "--calibration", "deep.json"], "nests too deeply"),
    (["compile", "ok.py", "--cluster", "cluster_types.yaml"], "nodes: Input should be a valid integer"),
    (["compile", "ok.py", "--cluster", "cluster_inf.yaml"], "mem_gib: Input should be a finite number"),
    (["compile", "ok.py", "--cluster", "cluster_list.yaml"], "must hold a mapping"),
    (["compile", "ok.py", "--cluster", "dir.yaml"], "is a directory"),
    (["compile", "ok.py", "--cluster", "nonutf8.yaml"], "is not readable"),
    (["compile", "ok.py", "--cluster", "empty.json"], "is not readable"),
    (["compile", "ok.py", "--cluster", "cpu:1x2,mem_gib=inf"], "finite"),
    (["compile", "ok.py", "--cluster", "cpu:1x2,inter_node_gbps=1e-320"], "greater than or equal to 0.001"),
    # compile: algorithm flags
    (["compile", "sft", "--actor", "tiny-llama", "-c", "cpu:1x2", "--batch", "0"], "Invalid value for '--batch'"),
    (["compile", "sft", "--actor", "tiny-llama", "-c", "cpu:1x2", "--batch", "99999999999"],
     "less than or equal to 16777216"),
    (["compile", "sft", "--actor", "dir.json", "-c", "cpu:1x2"], "has no config.json"),
    (["compile", "sft", "--actor", "nonutf8.json", "-c", "cpu:1x2"], "not readable JSON"),
    (["compile", "ppo", "--actor", "tiny-llama", "-c", "cpu:1x2", "--reward-fn", "m:f", "--gen-len", "99999999"],
     "less than or equal to 16777216"),
    # show / validate / compare
    (["show", "dir.json"], "Is a directory"),
    (["show", "nonutf8.json"], "not a text (UTF-8) file"),
    (["show", "empty.json"], "is empty"),
    (["validate", "deep.json"], "nests too deeply"),
    (["compare", "ok.py"], "not valid JSON"),
    # estimate
    (["estimate", "--model", "tiny-llama", "--cluster", "cpu:1x2", "--tp", "1", "--pp", "1", "--dp", "2",
      "--micro-batch", "1", "--global-batch", "2", "--seq-len", "99999999999"], "beyond what the cost model handles"),
    (["estimate", "--model", "tiny-llama", "--cluster", "cpu:1x2", "--tp", "0", "--pp", "1", "--dp", "2",
      "--micro-batch", "1", "--global-batch", "2", "--seq-len", "8"], "tp must be at least 1"),
    (["estimate", "--model", "nonutf8.json", "--cluster", "cpu:1x2", "--tp", "1", "--pp", "1", "--dp", "2",
      "--micro-batch", "1", "--global-batch", "2", "--seq-len", "8"], "not readable JSON"),
    # calibrate / profile
    (["calibrate", "measured_dp0.csv", "--gpu", "a100-80gb", "-o", "c.json"], "column 'dp' must be at least 1"),
    (["calibrate", "measured_text.csv", "--gpu", "a100-80gb", "-o", "c.json"], "must be a number, got 'fast'"),
    (["calibrate", "measured_inf.csv", "--gpu", "a100-80gb", "-o", "c.json"], "must be a number, got 'inf'"),
    (["calibrate", "measured_zero.csv", "--gpu", "a100-80gb", "-o", "c.json"], "positive, finite"),
    (["calibrate", "nonutf8.csv", "--gpu", "a100-80gb", "-o", "c.json"], "not a UTF-8 text (CSV) file"),
    (["calibrate", "empty.csv", "--gpu", "a100-80gb", "-o", "c.json"], "lacks columns"),
    (["calibrate", "dir.csv", "--gpu", "a100-80gb", "-o", "c.json"], "is a directory"),
    (["calibrate", "measured.csv", "--gpu", "a100-80gb", "-o", "dir.json"], "is a directory"),
    (["calibrate", "measured.csv", "--gpu", "a100-80gb", "-o", "c.json", "--gpus-per-node", "0"],
     "Invalid value for '--gpus-per-node'"),
    (["calibrate", "measured.csv", "--gpu", "a100-80gb", "-o", "c.json", "--intra-node-gbps", "-1"],
     "greater than or equal to 0.001"),
    (["calibrate", "measured.csv", "--gpu", "a100-80gb", "-o", "c.json", "--start", "dir.json"], "is a directory"),
    (["profile", "-o", "dir.json", "--ranks", "1"], "is a directory"),
    (["profile", "-o", "p.json", "--budget-s", "inf"], "Invalid value for '--budget-s'"),
]


@pytest.mark.parametrize("args, message", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_one_message_and_exit_2(cli, files, args, message):
    r = cli(*args, cwd=files)
    assert r.code == 2, f"exit {r.code}\n{r.out}\n{r.err}"
    assert "Traceback" not in r.err + r.out
    assert message in r.err, r.err


def test_graph_file_cluster_may_be_a_dict(cli, files):
    r = cli("compile", "cluster_dict.py", "--json", "--time-limit", "0", cwd=files)
    assert r.code == 0, r.err
    assert json.loads(r.out)["cluster"]["gpus_per_node"] == 2


def test_compare_with_a_zero_iteration_time(cli, tmp_path):
    from planner.algorithms import sft
    from planner.compile import compile_graph
    from plans.cluster import parse_cluster

    plan = json.loads(plan_to_json(compile_graph(sft("tiny-llama", batch=4, seq_len=8), parse_cluster("cpu:1x2"),
                                                 time_limit_s=0)))
    (tmp_path / "a.json").write_text(json.dumps(plan))
    plan["estimate"]["iteration_s"] = 0.0
    (tmp_path / "zero.json").write_text(json.dumps(plan))
    for first, second in (("a.json", "zero.json"), ("zero.json", "a.json")):
        r = cli("compare", first, second, cwd=tmp_path)
        assert r.code == 0, r.err
        assert "n/a" in r.out
    rows = json.loads(cli("compare", "zero.json", "a.json", "--json", cwd=tmp_path).out)
    assert [row["speedup_vs_first"] for row in rows] == [None, None]


def test_unwritable_output_fails_before_compiling(cli, files, monkeypatch):
    """The output path is checked first: a long search is not wasted on a path that cannot be written."""
    import planner.compile

    def never(*_a, **_k):  # noqa: ANN002, ANN003
        raise AssertionError("compiled although the output cannot be written")

    monkeypatch.setattr(planner.compile, "compile_graph", never)
    r = cli("compile", str(ROOT / "examples" / "tiny_ppo.py"), "-o", str(files / "dir.json"))
    assert r.code == 2 and "is a directory" in r.err
