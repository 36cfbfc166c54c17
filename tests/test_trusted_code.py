"""No code from data: a plan naming a function makes the runtime import nothing unless the launch
names the same function, never from the current directory implicitly; validate and show list it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from plans.plan import load_plan, save_plan
from tests.conftest import ROOT

PLAN = ROOT / "plans" / "tiny_ppo.json"
EVIL = """from pathlib import Path
Path(__file__).with_name("IMPORTED").write_text("the plan ran my code")

def score(prompts, responses):
    return (responses % 4 == 0).float().mean(dim=1)
"""


def _plan_naming(tmp_path: Path, name: str) -> Path:
    plan = load_plan(PLAN)
    path = tmp_path / "plan.json"
    save_plan(plan.model_copy(update={"algorithm": plan.algorithm.model_copy(update={"reward_fn": name})}), path)
    return path


def _runtime(cwd: Path, *args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *([pythonpath] if pythonpath else [])])
    return subprocess.run([sys.executable, "-m", "runtime", *args, "--reference", "--quiet"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_plan_naming_a_module_in_the_working_directory_imports_nothing_without_the_flag(tmp_path: Path) -> None:
    (tmp_path / "evil.py").write_text(EVIL)
    plan = _plan_naming(tmp_path, "evil:score")
    out = _runtime(tmp_path, str(plan))
    assert out.returncode == 2 and not (tmp_path / "IMPORTED").exists(), out.stderr
    assert "names reward function 'evil:score'" in out.stderr and "--reward-fn evil:score" in out.stderr
    # Naming another function is refused before any import, too.
    out = _runtime(tmp_path, str(plan), "--reward-fn", "other:score")
    assert out.returncode == 2 and "does not match the plan's reward function" in out.stderr
    assert not (tmp_path / "IMPORTED").exists()
    # The flag alone does not search the current directory...
    out = _runtime(tmp_path, str(plan), "--reward-fn", "evil:score")
    assert out.returncode == 2 and "No module named 'evil'" in out.stderr and "PYTHONPATH" in out.stderr, out.stderr
    assert not (tmp_path / "IMPORTED").exists()
    # ...saying where to look does, and then the run uses the function.
    out = _runtime(tmp_path, str(plan), "--reward-fn", "evil:score", "--steps", "1", pythonpath=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "IMPORTED").exists()


def test_a_flag_without_a_plan_function_and_builtin_rewards(tmp_path: Path) -> None:
    plan = load_plan(PLAN)
    none = tmp_path / "none.json"
    save_plan(plan.model_copy(update={"algorithm": plan.algorithm.model_copy(update={"reward_fn": None})}), none)
    out = _runtime(tmp_path, str(none), "--reward-fn", "evil:score")
    assert out.returncode == 2 and "names no reward function" in out.stderr
    assert plan.algorithm.reward_fn == "runtime.tasks:pattern_reward"  # built in: runs without the flag
    out = _runtime(tmp_path, str(PLAN), "--steps", "1")
    assert out.returncode == 0, out.stderr


def test_validate_and_show_list_the_code_a_plan_names(cli, tmp_path: Path) -> None:
    plan = _plan_naming(tmp_path, "mypkg.rewards:score")
    r = cli("validate", str(plan))
    assert r.code == 0
    assert "reward function mypkg.rewards:score" in r.out and "--reward-fn mypkg.rewards:score" in r.out
    r = cli("validate", str(plan), "--json")
    assert json.loads(r.out)["code"][0]["name"] == "mypkg.rewards:score"
    r = cli("show", str(plan))
    assert r.code == 0 and "mypkg.rewards:score" in r.out and "--reward-fn" in r.out
    r = cli("validate", str(ROOT / "plans" / "tiny_ppo.json"))
    assert "runtime.tasks:pattern_reward: built into the runtime" in r.out


def test_a_reward_fn_must_look_like_module_function(cli, tmp_path: Path) -> None:
    plan = json.loads(PLAN.read_text())
    plan["algorithm"]["reward_fn"] = "os.system('rm -rf /')"
    (tmp_path / "p.json").write_text(json.dumps(plan))
    r = cli("validate", str(tmp_path / "p.json"))
    assert r.code == 2 and "algorithm.reward_fn" in r.err


def test_graph_files_are_code_says_compile_help(cli) -> None:
    r = cli("compile", "--help")
    assert "A graph file is Python code" in " ".join(r.out.split())


def test_a_cached_plan_of_a_loop_cannot_name_code_the_loop_does_not(tmp_path: Path, monkeypatch) -> None:
    import pytest
    import torch

    import planner
    from plans.errors import PlannerError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "evil.py").write_text(EVIL)
    path = tmp_path / "sft.json"

    def loop():  # noqa: ANN202
        @planner.auto(cluster="cpu:1x2", plan=path, batch=4, seq_len=8, time_limit_s=0, verbose=False,
                      models={"policy": planner.model("tiny-gpt", trainable=True)}, algorithm={"task": "pattern"})
        def sft_step(policy, tokens):
            return policy.train(tokens, loss="sft")
        return sft_step

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = loop()
        first()
        first.close()
        data = json.loads(path.read_text())  # the cache file edited: same source hash, a reward function named
        data["algorithm"]["reward_fn"] = "evil:score"
        path.write_text(json.dumps(data))
        second = loop()
        with pytest.raises(PlannerError, match="names reward function 'evil:score'"):
            second()
        second.close()
    finally:
        torch.set_num_threads(threads)
    assert not (tmp_path / "IMPORTED").exists()
