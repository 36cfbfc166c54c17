"""`planner compile / show / validate / compare / schema`: happy paths and every user error."""

from __future__ import annotations

import json

import pytest

from plans.plan import PLAN_VERSION, load_plan, plan_to_json
from tests.conftest import ROOT

EXAMPLES = ["tiny_ppo", "tiny_ppo_moe", "ppo_llama7b", "grpo_qwen7b", "sft_llama3_70b"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every example compiled once (short CP-SAT budget) for the tests below."""
    from planner.cli import main

    out = tmp_path_factory.mktemp("plans")
    for name in EXAMPLES:
        try:
            main(["compile", str(ROOT / "examples" / f"{name}.py"), "-o", str(out / f"{name}.json"), "--time-limit", "2"])
        except SystemExit as e:
            assert e.code in (0, None), f"compiling {name} exited {e.code}"
    return out


@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_compile_validate_and_round_trip(compiled, cli, name):
    path = compiled / f"{name}.json"
    r = cli("validate", str(path))
    assert r.code == 0, r.err
    assert "valid" in r.out
    plan = load_plan(path)
    assert plan_to_json(plan) == path.read_text()  # the schema round-trips the file unchanged
    assert plan.version == PLAN_VERSION
    assert plan.estimate.iteration_s > 0 and 0 < plan.estimate.mfu < 1
    assert plan.estimate.peak_mem_bytes <= plan.cluster.mem_bytes
    assert plan.search.lower_bound_s is not None and plan.search.lower_bound_s <= plan.estimate.iteration_s


def test_compile_prints_table_and_writes_default_path(cli, tmp_path):
    r = cli("compile", str(ROOT / "examples" / "tiny_ppo.py"), "--time-limit", "1", cwd=tmp_path)
    assert r.code == 0, r.err
    assert "actor_generate" in r.out and "iteration" in r.out and "lower bound" in r.out
    assert (tmp_path / "plans" / "tiny_ppo.json").is_file()


def test_compile_is_deterministic(cli, tmp_path):
    texts = []
    for _ in range(2):
        r = cli("compile", str(ROOT / "examples" / "tiny_ppo.py"), "--json", "--time-limit", "2")
        assert r.code == 0, r.err
        data = json.loads(r.out)
        data["search"]["wall_s"] = None
        texts.append(json.dumps(data))
    assert texts[0] == texts[1]


def test_compile_algorithm_from_flags(cli):
    r = cli("compile", "grpo", "--actor", "tiny-llama", "--reward-fn", "m:f", "--cluster", "cpu:1x4", "--batch", "8",
            "--prompt-len", "8", "--gen-len", "8", "--samples-per-prompt", "4", "--json", "--time-limit", "1")
    assert r.code == 0, r.err
    plan = json.loads(r.out)
    assert [c["name"] for c in plan["calls"]].count("actor_train") == 1
    assert plan["calls"][0]["samples_per_prompt"] == 4


def test_show_and_compare(compiled, cli):
    r = cli("show", str(compiled / "tiny_ppo.json"))
    assert r.code == 0 and "actor_train" in r.out
    r = cli("compare", str(compiled / "tiny_ppo.json"), str(compiled / "tiny_ppo.json"), "--json")
    rows = json.loads(r.out)
    assert r.code == 0 and rows[1]["speedup_vs_first"] == pytest.approx(1.0)


def test_schema_command(cli):
    r = cli("schema")
    schema = json.loads(r.out)
    assert r.code == 0 and "version" in schema["properties"] and "calls" in schema["properties"]


def _graph_file(tmp_path, body: str):
    path = tmp_path / "g.py"
    path.write_text(body)
    return str(path)


CYCLE = """
from plans.graph import Call, Graph, ModelDecl
from plans.model import PRESETS
def c(name, inp, out):
    return Call(name=name, model="m", kind="inference", inputs=[inp], outputs=[out], seqs=4, seq_len=8, returns="logprobs")
graph = Graph(name="g", models={"m": ModelDecl(spec=PRESETS["tiny-llama"])}, calls=[c("a", "y", "x"), c("b", "x", "y")])
"""
UNKNOWN_MODEL = """
from planner import Graph
g = Graph("g", batch=4, seq_len=8)
g.model("m", "tiny-llama")
g._add_call(model="ghost", kind="inference", inputs=(g.input("tokens"),), name=None, output=None,
            default_output="logprobs", returns="logprobs")
graph = g.build()
"""


@pytest.mark.parametrize("args,needle", [
    (lambda p: ["compile", _graph_file(p, "graph = (\n")], "syntax error"),
    (lambda p: ["compile", _graph_file(p, CYCLE), "-c", "cpu:1x4"], "cycle: a -> b -> a"),
    (lambda p: ["compile", _graph_file(p, UNKNOWN_MODEL), "-c", "cpu:1x4"], "unknown model 'ghost'"),
    (lambda p: ["compile", _graph_file(p, "x = 1\n"), "-c", "cpu:1x4"], "defines neither `graph` nor `build()`"),
    (lambda p: ["compile", str(ROOT / "examples" / "tiny_ppo.py"), "-c", "b200:1x8"], "unknown GPU 'b200'"),
    (lambda p: ["compile", str(ROOT / "examples" / "tiny_ppo.py"), "-c", "a100"], "malformed cluster 'a100'"),
    (lambda p: ["compile", "sft", "--actor", "llama-2-70b", "-c", "a100-80gb:1x2", "--batch", "8"],
     "does not fit: its best layout on 2 GPUs needs"),
    (lambda p: ["compile", "ppo", "--actor", "llama-9b", "-c", "a100-80gb:1x8"], "unknown model 'llama-9b'"),
    (lambda p: ["compile", "ppx", "--actor", "tiny-llama"], "neither a graph file nor an algorithm"),
    (lambda p: ["compile", "ppo", "-c", "cpu:1x4"], "needs --actor"),
    (lambda p: ["compile", "sft", "--actor", "tiny-llama"], "no cluster given"),
    (lambda p: ["validate", str(p / "missing.json")], "cannot read plan"),
])
def test_errors_are_clear_and_exit_2(cli, tmp_path, args, needle):
    r = cli(*args(tmp_path))
    assert r.code == 2
    assert needle in r.err
    assert "Traceback" not in r.err + r.out


def test_plan_with_unknown_key_or_wrong_version(compiled, cli, tmp_path):
    data = json.loads((compiled / "tiny_ppo.json").read_text())
    data["calls"][0]["layuot"] = {}
    (tmp_path / "typo.json").write_text(json.dumps(data))
    r = cli("validate", str(tmp_path / "typo.json"))
    assert r.code == 2 and "calls.0.layuot: unknown key" in r.err
    data = json.loads((compiled / "tiny_ppo.json").read_text())
    data["version"] = 99
    (tmp_path / "v99.json").write_text(json.dumps(data))
    r = cli("validate", str(tmp_path / "v99.json"))
    assert r.code == 2 and "plan version 99" in r.err and "recompile" in r.err


def test_plan_that_breaks_placement_rules(compiled, cli, tmp_path):
    data = json.loads((compiled / "tiny_ppo.json").read_text())
    data["calls"][0]["mesh"]["ranks"] = [4, 5]
    data["calls"][0]["layout"].update(dp=2, tp=1, pp=1, cp=1, zero=0, micro_batches=1, sequence_parallel=False)
    (tmp_path / "bad.json").write_text(json.dumps(data))
    r = cli("validate", str(tmp_path / "bad.json"))
    assert r.code == 2 and "exceeds the cluster's 4 GPUs" in r.err


def test_help_prose_reflows_to_the_terminal_and_examples_keep_their_lines():
    from planner.cli import reflow

    text = "Summary line\ncontinued.\n\nExamples:\n\n  planner a\n  planner b\n\nTail\nparagraph."
    assert reflow(text) == "Summary line continued.\n\nExamples:\n\n  planner a\n  planner b\n\nTail paragraph."


def test_every_command_has_help_that_teaches(cli):
    out = cli("--help")
    assert out.code == 0
    for command in ("compile", "validate", "timeline", "explain", "export", "replan", "profile"):
        page = cli(command, "--help")
        assert page.code == 0 and "Usage: planner " + command in page.out
    assert "Examples:" in cli("replan", "--help").out


def test_help_starts_without_the_search_or_the_cost_model():
    """`planner --help` (and every command's help) loads neither the search nor the cost model:
    the package's names are imported on first use."""
    import subprocess
    import sys

    probe = ("import sys\nfrom planner.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('planner.compile', 'planner.auto', 'cost_models.api', 'ortools') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_planner_auto_stays_the_decorator_when_its_module_is_imported():
    """The submodule `planner.auto` has the decorator's name; importing it (as the graph loader
    does) must not replace `planner.auto` on the package."""
    import subprocess
    import sys

    probe = ("import planner.loader, planner\nfrom planner.auto import AutoFunction\nimport planner.auto as pa\n"
             "print(callable(planner.auto) and planner.auto is pa and planner.auto.__module__ == 'planner.auto')")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"
