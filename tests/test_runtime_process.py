"""Clean exits and launches refused up front: an interrupt is one line and no partial file, ranks do
not outlive a dead torchrun agent, a GPU plan on a machine without GPUs (or a reference too large
for its memory) is refused before anything is allocated, and `planner validate` flags what the
runtime cannot run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from planner import algorithms
from plans import Layout, Mesh
from plans.errors import PlannerError
from plans.plan import load_plan, save_plan
from runtime.executor import PlanRunner
from runtime.process import cpu_threads, reference_bytes, usable_cpus
from tests.machine import facts
from tests.test_runtime_cli import ROOT, _run, tiny_ppo_plan
from tests.test_runtime_executor import REWARD, place

PLAN = ROOT / "plans" / "tiny_ppo.json"


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _launch(tmp_path: Path, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                             "-m", "runtime", str(PLAN), "--steps", "100000", "--quiet", *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(predicate, *, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what} {facts()}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_is_one_line_for_the_run_and_leaves_no_partial_file(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    agent = _launch(tmp_path, "--metrics-out", str(metrics), "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--checkpoint-every", "1")
    try:
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, timeout_s=120,
                  what="three steps")
        os.killpg(agent.pid, signal.SIGINT)  # what Ctrl-C in the terminal does: the whole process group
        _, err = agent.communicate(timeout=60)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    ours = [line for line in err.splitlines() if line.startswith(("stopped (rank", "error (rank"))]
    assert len(ours) == 1 and ours[0].startswith("stopped (rank 0): SIGINT in step "), err[-3000:]
    assert "runtime/" not in err  # no traceback from any rank (torchrun's agent prints its own)
    lines = metrics.read_text().splitlines()
    assert lines and all(line.startswith("{") and line.endswith("}") for line in lines)  # whole lines only
    assert not [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.endswith(".tmp")]
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ranks_exit_within_seconds_when_the_torchrun_agent_dies(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    agent = _launch(tmp_path, "--metrics-out", str(metrics))
    try:
        _wait_for(lambda: metrics.exists(), timeout_s=120, what="the first step")
        ranks = _children(agent.pid)
        assert len(ranks) == 4, ranks
        os.kill(agent.pid, signal.SIGKILL)  # the agent dies without stopping its workers
        agent.communicate(timeout=30)
        t0 = time.monotonic()
        _wait_for(lambda: not any(_alive(r) for r in ranks), timeout_s=15, what="the orphaned ranks to exit")
        assert time.monotonic() - t0 < 15
    finally:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_gpu_plan_on_a_machine_without_gpus_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    plan = load_plan(PLAN)
    gpu = tmp_path / "gpu.json"
    save_plan(plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"gpu": "h100-sxm"})}), gpu)
    out = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "runtime", str(gpu)])
    assert out.returncode != 0
    # Every rank refuses it on its own, before joining the others, and waits for the others to say so
    # too (torchrun stops the group at the first exit, which would silence a rank slower to start).
    errors = [line for line in out.stderr.splitlines() if line.startswith("error (rank")]
    assert len(errors) == 4 and all("but this machine has no CUDA GPU" in e for e in errors), out.stderr[-2000:]
    assert "planner replan" in out.stderr


def test_a_reference_too_large_for_this_machine_is_refused(tmp_path: Path) -> None:
    out = _run(["-m", "planner", "compile", str(ROOT / "examples" / "ppo_llama7b.py"), "-o", str(tmp_path / "p.json"),
                "--time-limit", "0"])
    assert out.returncode == 0, out.stderr
    big = load_plan(tmp_path / "p.json")
    assert reference_bytes(big) > 240 * 2**30  # four 7B models in fp32, two with a gradient and Adam moments
    out = _run(["-m", "runtime", str(tmp_path / "p.json"), "--reference"])
    assert out.returncode == 2 and "GiB of weights and optimizer state, but this machine has" in out.stderr, out.stderr


def test_cpu_threads_follow_the_usable_cpus_unless_omp_num_threads_says(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    n = usable_cpus()
    assert n >= 1 and cpu_threads(local_ranks=1) == n and cpu_threads(local_ranks=4 * n) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(local_ranks=1) is None


def test_validate_flags_what_the_runtime_cannot_run(cli, tmp_path: Path) -> None:
    four = Mesh.block(0, 4)
    cases = {
        "vpp.json": (tiny_ppo_plan({m: (four, Layout(dp=2, pp=2, interleave=2)) for m in ("actor", "critic", "ref")}),
                     "interleaved pipelines (interleave=2) are not run by the runtime yet"),
        "dp.json": (place(algorithms.ppo("tiny-llama", reward_fn=REWARD, batch=12, prompt_len=6, gen_len=5,
                                         ppo_minibatches=2), {m: (four, Layout(dp=4)) for m in ("actor", "critic", "ref")}),
                    "6 sequences per optimizer step do not split evenly over dp=4"),
        "mb.json": (tiny_ppo_plan({m: (four, Layout(dp=4, micro_batches=3)) for m in ("actor", "critic", "ref")}),
                    "do not split into micro_batches=3"),
    }
    plan = load_plan(PLAN)
    short = plan.models["actor"].spec.model_copy(update={"max_position_embeddings": 8})
    cases["pos.json"] = (plan.model_copy(update={"models": {**plan.models, "actor": plan.models["actor"].model_copy(
        update={"spec": short})}}), "exceed model 'actor''s max_position_embeddings 8")
    for name, (p, message) in cases.items():
        save_plan(p, tmp_path / name)
        r = cli("validate", str(tmp_path / name))
        assert r.code == 2 and message in r.err, (name, r.err)
    r = cli("validate", str(PLAN), "--target", "verl")
    assert r.code == 2 and "verl cannot take: " in r.err
    with pytest.raises(PlannerError, match="cannot run on this runtime: call "):  # the runtime refuses it up front
        PlanRunner(cases["vpp.json"][0], rank=0, world_size=4, reference=False, seed=0, dtype=torch.float32,
                   device=torch.device("cpu"))
