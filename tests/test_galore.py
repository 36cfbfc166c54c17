"""GaLore (`plans.layout.GaLore`): layout and plan rules, memory and time in the cost model,
the search choosing it where memory binds, the CLI, exports refusing it, and the runtime on 4
gloo ranks against a single-process reference of the same optimizer."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import ValidationError

from cost_models import CostModel
from planner.algorithms import grpo, sft
from planner.candidates import SearchSpace
from planner.compile import compile_graph
from plans import PRESETS, GaLore, Layout, Mesh, PlannerError
from plans.cluster import parse_cluster, with_headroom
from plans.graph import Call, ModelDecl
from plans.plan import load_plan, plan_to_json
from plans.sharding import galore_projected, parameters, shard_box
from runtime.data_parallel import AdamConfig
from runtime.engine import ModelRunner
from runtime.galore import owners
from runtime.groups import Groups, solo_groups
from runtime.losses import make_loss
from tests.test_runtime_parallel import ALGO, WORLD, _batch, _free_port, _state, collect

G = GaLore(rank=512)
TRAIN = Call(name="t", model="m", kind="train", seqs=64, seq_len=2048, loss="sft")


# ---- layout and plan rules --------------------------------------------------------------


def test_galore_needs_whole_gradients() -> None:
    for bad in ({"dp": 2, "zero": 2}, {"dp": 2, "zero": 3}):
        with pytest.raises(ValidationError, match="galore needs zero 0 or 1"):
            Layout(galore=G, **bad)
    assert Layout(dp=2, zero=1, galore=G).short() == "dp2 tp1 pp1 z1 galore:r512"
    assert Layout(dp=2, tp=2, zero=1, galore=G).tp == 2  # tensor-parallel slices project their own parts
    assert Layout(galore=GaLore(rank=8, update_interval=50)).short().endswith("galore:r8/50")


def test_plain_layouts_keep_their_bytes() -> None:
    """A layout without GaLore writes no galore key (plans compiled before it are unchanged)."""
    assert "galore" not in Layout(dp=2).model_dump_json()
    assert json.loads(Layout(galore=G).model_dump_json())["galore"] == {"rank": 512, "update_interval": 200,
                                                                         "scale": 0.25}


def test_plan_check_refuses_galore_outside_a_train_call(tmp_path: Path) -> None:
    graph = grpo("tiny-llama", batch=8, prompt_len=6, gen_len=5, samples_per_prompt=2, ppo_minibatches=1)
    plan = compile_graph(graph, parse_cluster("cpu:1x4"), time_limit_s=0)
    calls = [c.model_copy(update={"layout": c.layout.model_copy(update={"galore": G})}) if c.kind == "generate"
             else c for c in plan.calls]
    path = tmp_path / "bad.json"
    path.write_text(plan_to_json(plan.model_copy(update={"calls": calls})))
    with pytest.raises(PlannerError, match="names a GaLore optimizer, which only a train call"):
        load_plan(path)


# ---- cost model -------------------------------------------------------------------------


def test_memory_counts_the_low_rank_states() -> None:
    """What GaLore saves is Adam's full moments of the projected matrices, less their low-rank
    moments and projectors, over the ZeRO-1 group: computed here from the shapes by hand."""
    spec = PRESETS["llama-3-8b"]
    cm = CostModel(parse_cluster("h100-sxm:1x8"))
    decl = ModelDecl(spec=spec, trainable=True)
    h, f, kv, r = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.d_head, G.rank
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]
    saved = spec.num_hidden_layers * sum(8 * (m * n - r * max(m, n)) - 4 * r * min(m, n) for m, n in shapes)
    for dp, zero in ((8, 1), (8, 0), (1, 0)):
        plain = cm.call_cost(TRAIN, decl, Mesh.block(0, dp), Layout(dp=dp, zero=zero, micro_batches=8, recompute="full"))
        low = cm.call_cost(TRAIN, decl, Mesh.block(0, dp),
                           Layout(dp=dp, zero=zero, micro_batches=8, recompute="full", galore=G))
        got = plain.mem_breakdown_bytes["optimizer"] - low.mem_breakdown_bytes["optimizer"]
        assert got == pytest.approx(saved / (dp if zero else 1), rel=1e-6)
        assert low.mem_breakdown_bytes["params"] == plain.mem_breakdown_bytes["params"]
        # the projections every step and the SVDs every update_interval steps cost time
        assert low.breakdown_s["galore"] > 0 and low.time_s > plain.time_s - plain.breakdown_s["optimizer"]


def test_memory_of_tensor_parallel_slices() -> None:
    """Under tensor parallel a slice cut along the side its projection keeps holds that part of
    the moments and the whole projector; one cut along the side the projection sums over holds
    the whole moments and its rows of the projector (`cost_models.galore`), counted by hand:
    q/k/v (rows split, P^T G) sum over the split, o and down (columns split, P^T G) and gate/up
    (rows split, G Q) keep theirs. The summed projections cost an all-reduce every step."""
    spec = PRESETS["llama-3-8b"]
    cm = CostModel(parse_cluster("h100-sxm:1x8"))
    decl = ModelDecl(spec=spec, trainable=True)
    h, f, kv, r = spec.hidden_size, spec.intermediate_size, spec.num_key_value_heads * spec.d_head, G.rank
    for tp in (2, 4):
        # (m, n, moment, projector) per rank
        mats = [(h, h, r * h, h // tp * r), (kv, h, r * h, kv // tp * r), (kv, h, r * h, kv // tp * r),
                (h, h, r * h // tp, h * r), (f, h, f // tp * r, h * r), (f, h, f // tp * r, h * r),
                (h, f, r * f // tp, h * r)]
        saved = spec.num_hidden_layers * sum(8 * (m * n // tp - mom) - 4 * proj for m, n, mom, proj in mats)
        dp = 8 // tp
        lay = Layout(dp=dp, tp=tp, zero=1, micro_batches=8, recompute="full", sequence_parallel=True)
        plain = cm.call_cost(TRAIN, decl, Mesh.block(0, 8), lay)
        low = cm.call_cost(TRAIN, decl, Mesh.block(0, 8), lay.model_copy(update={"galore": G}))
        got = plain.mem_breakdown_bytes["optimizer"] - low.mem_breakdown_bytes["optimizer"]
        assert got == pytest.approx(saved / dp, rel=1e-6)
        assert low.breakdown_s["tp_comm"] > plain.breakdown_s["tp_comm"]


def test_svd_is_amortised_over_the_interval() -> None:
    spec = PRESETS["llama-3-8b"]
    cm = CostModel(parse_cluster("h100-sxm:1x8"))
    decl = ModelDecl(spec=spec, trainable=True)

    def galore_s(interval: int) -> float:
        lay = Layout(dp=8, zero=1, micro_batches=8, galore=GaLore(rank=512, update_interval=interval))
        return cm.call_cost(TRAIN, decl, Mesh.block(0, 8), lay).breakdown_s["galore"]

    every, rarely = galore_s(1), galore_s(1000)
    assert every > 10 * rarely  # one SVD per step dwarfs the projections


# ---- search -----------------------------------------------------------------------------


def _compile(graph, cluster: str, galore: GaLore | None):  # noqa: ANN001, ANN202
    return compile_graph(graph, with_headroom(parse_cluster(cluster), None), time_limit_s=5,
                         space=SearchSpace(galore=galore))


def test_galore_lets_a_7b_fine_tune_fit_one_gpu() -> None:
    graph = sft("llama-2-7b", batch=64, seq_len=2048)
    with pytest.raises(PlannerError, match="does not fit"):
        _compile(graph, "h100-sxm:1x1", None)
    plan = _compile(graph, "h100-sxm:1x1", G)
    assert plan.calls[0].layout.galore == G
    assert plan.estimate.peak_mem_bytes <= with_headroom(parse_cluster("h100-sxm:1x1"), None).usable_mem_bytes


def test_galore_chosen_where_memory_binds_and_only_when_asked() -> None:
    graph = grpo("llama-2-7b", batch=32, prompt_len=512, gen_len=512, samples_per_prompt=4)
    plain = _compile(graph, "h200:1x1", None)
    low = _compile(graph, "h200:1x1", G)
    assert all(c.layout.galore is None for c in plain.calls)
    train = next(c for c in low.calls if c.kind == "train")
    assert train.layout.galore == G and all(c.layout.galore is None for c in low.calls if c.kind != "train")
    assert low.estimate.iteration_s < plain.estimate.iteration_s
    # where AdamW's states fit with room to spare, the space with GaLore finds the same plan
    small = grpo("tiny-llama", batch=8, prompt_len=6, gen_len=5, samples_per_prompt=2, ppo_minibatches=1)
    with_galore, without = (_compile(small, "h100-sxm:1x8", g).model_dump(exclude={"search"}) for g in (G, None))
    assert with_galore == without


# ---- CLI and exports --------------------------------------------------------------------


def test_cli_galore_options(tmp_path: Path, cli) -> None:  # noqa: ANN001
    base = ["compile", "sft", "--actor", "llama-2-7b", "--cluster", "h100-sxm:1x1", "--batch", "64", "--time-limit", "1"]
    out = cli(*base, "--galore-interval", "50", "-o", str(tmp_path / "x.json"))
    assert out.code == 2 and "--galore-rank turns on" in out.err, out
    out = cli(*base, "--galore-rank", "512", "--framework", "megatron-core", "-o", str(tmp_path / "q.json"))
    assert out.code == 2 and "planner's runtime" in out.err, out
    path = tmp_path / "p.json"
    out = cli(*base, "--galore-rank", "512", "-o", str(path))
    assert out.code == 0, out
    assert "galore:r512" in out.out and load_plan(path).calls[0].layout.galore == G
    for engine in ("megatron", "deepspeed", "verl", "openrlhf"):
        out = cli("export", str(path), "--to", engine, "-o", str(tmp_path / engine))
        assert out.code == 2, (engine, out)
        assert "GaLore" in out.err and "model_train" in out.err, (engine, out)
        assert not (tmp_path / engine).exists()


# ---- runtime ----------------------------------------------------------------------------

RANK = 8  # below every tiny-llama matrix's smaller side (32), so all seven are projected
LR = 1e-3
ADAM = AdamConfig(eps=1e-6, weight_decay=0.1)
STEPS_PER_TRAIN, TRAINS = 2, 2  # 4 optimizer steps: projectors refreshed at steps 1 and 3
CFG = GaLore(rank=RANK, update_interval=2, scale=0.25)
CASES = [
    (4, 1, {"zero": 0}),
    (4, 1, {"zero": 1}),
    (2, 2, {"zero": 1, "micro_batches": 2}),
    (2, 2, {"zero": 0}),
    (1, 4, {"micro_batches": 2}),
    (4, 1, {"zero": 1, "offload": "optimizer"}),
    (2, 1, {"zero": 1, "cp": 2}),
    # tensor parallel: q/k/v and gate/up split along the rows, o/down along the columns, so some
    # projections sum over the group and some are the slice's own part of the whole
    (2, 1, {"tp": 2, "zero": 0}),
    (2, 1, {"tp": 2, "zero": 1, "sequence_parallel": True}),
    (1, 1, {"tp": 4}),
    (1, 2, {"tp": 2, "micro_batches": 2}),
]
# A mixture of experts: routed experts keep AdamW (reduced over their own group), the shared
# expert's and attention matrices are projected.
MOE_CASES = [(4, 1, {"ep": 4}), (2, 2, {"ep": 2, "micro_batches": 2}), (2, 1, {"tp": 2, "ep": 2, "etp": 2})]
TOL = 1e-5


class ReferenceGaLore:
    """GaLore over a whole model in one process, parameter by parameter: Adam in each projected
    matrix's low-rank space (the SVD on the full gradient), torch.optim.AdamW for the rest."""

    def __init__(self, params: dict[str, torch.Tensor], spec, head: str) -> None:  # noqa: ANN001
        catalog = {p.name: p for p in parameters(spec, head=head)}
        self.params = params
        self.projected = [n for n in params if galore_projected(catalog[n], CFG.rank)]
        rest = [params[n] for n in params if n not in self.projected]
        self.adamw = torch.optim.AdamW(rest, lr=LR, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                                       weight_decay=ADAM.weight_decay)
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.t = 0

    def step(self, *, lr: float) -> None:
        self.t += 1
        b1, b2 = ADAM.beta1, ADAM.beta2
        with torch.no_grad():
            for n in self.projected:
                w = self.params[n]
                g = w.grad
                rows, cols = g.shape
                st = self.state.setdefault(n, {})
                if (self.t - 1) % CFG.update_interval == 0:
                    u, _, vh = torch.linalg.svd(g, full_matrices=False)
                    p = u[:, :CFG.rank] if rows <= cols else vh[:CFG.rank].T
                    for j in range(CFG.rank):  # each vector's largest entry positive
                        if p[p[:, j].abs().argmax(), j] < 0:
                            p[:, j] = -p[:, j]
                    st["p"] = p
                p = st["p"]
                low = p.T @ g if rows <= cols else g @ p
                st["m"] = b1 * st.get("m", torch.zeros_like(low)) + (1 - b1) * low
                st["v"] = b2 * st.get("v", torch.zeros_like(low)) + (1 - b2) * low * low
                n_ = st["m"] / (st["v"].sqrt() + ADAM.eps)
                back = p @ n_ if rows <= cols else n_ @ p.T
                w -= lr * math.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t) * CFG.scale * back
                w -= lr * ADAM.weight_decay * w
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()


def _train(runner: ModelRunner, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    loss = make_loss("grpo", ALGO)
    halves = [float(batch["mask"][:4].sum()), float(batch["mask"][4:].sum())]
    for _ in range(TRAINS):
        runner.reload_states()
        runner.train(batch, loss=loss, denoms=halves, lr=LR)
        runner.offload_states()
    return runner.local_parameters()


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    groups = Groups(distributed=True)
    problems, checks = [], 0
    for model, cases in (("tiny-llama", CASES), ("tiny-qwen-moe", MOE_CASES)):
        p, c = _check_model(rank, groups, PRESETS[model], cases)
        problems += [f"{model}: {x}" for x in p]
        checks += c
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"problems": problems, "checks": checks}))
    dist.destroy_process_group()


def _check_model(rank: int, groups: Groups, spec, cases: list) -> tuple[list[str], int]:  # noqa: ANN001
    head = "lm"
    batch = _batch(seed=5)
    cpu = torch.device("cpu")
    ref_runner = ModelRunner(spec, head=head, trainable=True, groups=solo_groups(Layout()), state=_state, device=cpu,
                             adam=ADAM)
    assert ref_runner.dp is not None
    reference = ReferenceGaLore(ref_runner.shard.params, spec, head)
    ref_runner.dp.step = reference.step  # type: ignore[method-assign]
    ref = _train(ref_runner, batch)
    adamw = ModelRunner(spec, head=head, trainable=True, groups=solo_groups(Layout()), state=_state, device=cpu,
                        adam=ADAM)
    plain = _train(adamw, batch)
    problems, checks = [], 0
    # the optimizers differ measurably, so agreement below is the GaLore path's
    apart = max((ref[n] - plain[n]).abs().max().item() for n in reference.projected)
    if apart < 100 * TOL:
        problems.append(f"GaLore and AdamW differ by only {apart:.2e}: the test cannot tell them apart")
    mesh = Mesh.block(0, WORLD)
    catalog = {p.name: p for p in parameters(spec, head=head)}
    for dp, pp, extra in cases:
        layout = Layout(dp=dp, pp=pp, galore=CFG, **extra)
        mine = groups.build(mesh, layout, rank=rank, tied=False)
        runner = ModelRunner(spec, head=head, trainable=True, groups=mine, state=_state, device=cpu, adam=ADAM)
        got = _train(runner, batch)
        for name, t in got.items():
            box = shard_box(catalog[name], spec, layout, mine.local)
            want = ref[name][tuple(slice(a, b) for a, b in box)]
            checks += 1
            diff = (want - t).abs().max().item()
            if diff > TOL:
                problems.append(f"{layout.short()} {name}: max diff {diff:.2e}")
    return problems, checks


@pytest.mark.heavy
@pytest.mark.slow
def test_galore_runtime_matches_single_process_reference(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    problems, checks = collect(tmp_path)
    assert not problems, "\n".join(problems[:40])
    assert checks >= (len(CASES) + len(MOE_CASES)) * WORLD * 5


def test_owners_split_runs_evenly() -> None:
    assert owners([10] * 8, 4) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert owners([100, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert owners([5], 4) == [0]
    assert sorted(set(owners([3, 1, 4, 1, 5, 9, 2, 6], 3))) == [0, 1, 2]


def test_replan_keeps_galore_on_offer() -> None:
    from planner.replan import replan

    plan = _compile(sft("llama-2-7b", batch=64, seq_len=2048), "h100-sxm:1x1", G)
    new = replan(plan, with_headroom(parse_cluster("h200:1x1"), None), time_limit_s=2).new
    assert new.calls[0].layout.galore == G  # some AdamW layouts still do not fit a 140 GiB GPU; GaLore wins there


def test_runtime_cli_runs_a_galore_plan_and_refuses_checkpoints_of_it(tmp_path: Path) -> None:
    import subprocess
    import sys

    from plans.plan import save_plan
    from tests.conftest import ROOT

    plan = compile_graph(sft("tiny-llama", batch=8, seq_len=12, task="pattern"), parse_cluster("cpu:1x4"),
                         time_limit_s=0)
    calls = [c.model_copy(update={"mesh": Mesh.block(0, 4), "layout": Layout(dp=4, zero=1, galore=CFG)})
             for c in plan.calls]
    path = tmp_path / "galore.json"
    save_plan(plan.model_copy(update={"calls": calls}), path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "runtime", str(path), "--reference", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)

    out = run("--steps", "2", "--quiet")
    assert out.returncode == 0, out.stderr
    out = run("--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert out.returncode == 2 and "GaLore" in out.stderr and "--checkpoint-dir" in out.stderr, out.stderr
    assert not (tmp_path / "ckpt").exists()


def test_auto_offers_galore_and_hashes_it(tmp_path: Path) -> None:
    import runpy

    from planner.auto import plan_hash

    loop = '''
import planner

@planner.auto(cluster="h100-sxm:1x1", plan=PLAN, batch=64, seq_len=2048, verbose=False, time_limit_s=1, GALORE
              models={"policy": planner.model("llama-2-7b", trainable=True)})
def sft_step(policy, tokens):
    return policy.train(tokens, loss="sft")
'''

    def load(galore: str):  # noqa: ANN202
        path = tmp_path / "loop.py"
        path.write_text(loop.replace("PLAN", repr(str(tmp_path / "p.json"))).replace("GALORE", galore))
        return runpy.run_path(str(path))["sft_step"]

    plain, low = load(""), load("galore={'rank': 512},")
    assert low.galore == G and low.source_hash() != plain.source_hash()
    assert low.source_hash() == plan_hash(low.trace(), cluster=low.cluster(), galore=G)
    with pytest.raises(PlannerError, match="does not fit"):
        plain.compile()
    plan, compiled = low.compile()
    assert compiled and plan.calls[0].layout.galore == G
    with pytest.raises(PlannerError, match="galore=.*rank"):
        load("galore={'rank': 0},")


def test_estimate_galore_rank(cli) -> None:  # noqa: ANN001
    base = ["estimate", "--model", "llama-2-7b", "--pp", "1", "--dp", "1", "--micro-batch", "2", "--global-batch", "64",
            "--seq-len", "2048", "--galore-rank", "512"]
    out = cli(*base, "--cluster", "h100-sxm:1x2", "--tp", "1", "--dp", "2", "--zero", "2")
    assert out.code == 2 and "galore needs zero 0 or 1" in out.err, out
    out = cli(*base, "--cluster", "h100-sxm:1x2", "--tp", "2", "--json")
    assert out.code == 0 and json.loads(out.out)["layout"].endswith("galore:r512"), out
    out = cli(*base, "--cluster", "h100-sxm:1x1", "--tp", "1", "--recompute", "full", "--json")
    assert out.code == 0, out
    got = json.loads(out.out)
    assert got["fits"] and got["breakdown"]["time_s"]["galore"] > 0 and got["layout"].endswith("galore:r512")
