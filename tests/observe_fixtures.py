"""Plans the observe tests share, compiled once per test session (beam search only: fast and
deterministic), and a measured trace built the way the runtime writes one.

The tests check the tiny plans' shapes (which GPUs run what), so those are compiled with a fixed
CPU calibration (`FIXED_CPU`, an earlier `planner profile` of a 2-core machine) rather than the
shipped one, which follows whichever machine was profiled last; explain them with `cpu_model`."""

from __future__ import annotations

from functools import cache

from cost_models import CostModel
from cost_models.calibration import Calibration
from planner.algorithms import ppo, sft
from planner.candidates import SearchSpace
from planner.compile import compile_graph
from plans.cluster import ClusterSpec, parse_cluster
from plans.layout import Layout, Mesh
from plans.plan import Plan
from plans.trace import TraceRecorder, trace_document

FIXED_CPU = Calibration.model_validate({
    "gpu": "cpu", "framework": "torch", "source": "planner profile on cpu (4 ranks), kept for these tests",
    "coefficients": {
        "attention_efficiency": 0.2534,
        "gemm_efficiency": 1.0,
        "hbm_efficiency": 1.0,
        "host_collective_us": 0.0,
        "host_kernel_us": 2.507,
        "host_overlap": 0.0,
        "kernel_latency_us": 0.0,
        "microbatch_overhead_ms": 2.776921,
        "network_efficiency": 0.941215,
        "nvlink_efficiency": 1.0,
        "step_overhead_ms": 0.467186,
    },
    "hardware": {
        "hbm_gb_s": 6.723184,
        "intra_latency_us": 1163.382801,
        "intra_node_gbps": 8.442735,
        "peak_tflops": 0.200612,
    },
})


def cpu_model(cluster: ClusterSpec) -> CostModel:
    """The cost model the tiny plans were compiled with."""
    return CostModel(cluster, calibration=FIXED_CPU)


@cache
def tiny_ppo() -> Plan:
    """Tiny PPO on cpu:1x4: three GPU groups and one reallocation (critic train -> inference).
    Placed by hand, so the shape the tests read does not follow the search's choices: the actor
    on GPU 0, the critic's home (its train call) on GPU 1 and its inference on GPU 0, the
    reference on GPUs 2-3."""
    from planner.pinned import pinned_plan

    g = ppo("tiny-llama", critic="tiny-llama", reward_fn="runtime.tasks:pattern_reward", batch=16, prompt_len=8,
            gen_len=8, ppo_minibatches=2, name="tiny_ppo", task="pattern", lr=1e-3)
    one, two = Mesh.block(0, 1), Mesh.block(2, 2)
    places = {"actor_generate": (one, Layout(), None), "critic_inference": (one, Layout(), None),
              "ref_inference": (two, Layout(dp=2), None), "actor_train": (one, Layout(), None),
              "critic_train": (Mesh.block(1, 1), Layout(), None)}
    return pinned_plan(g, parse_cluster("cpu:1x4"), places, method="placed by hand", calibration=FIXED_CPU)


@cache
def tiny_ppo_rm() -> Plan:
    """Tiny PPO with a reward model on cpu:2x4 (every role on its own GPUs)."""
    g = ppo("tiny-llama", critic="tiny-llama", reward="tiny-llama", batch=16, prompt_len=8, gen_len=8,
            ppo_minibatches=2, name="tiny_ppo_rm")
    return compile_graph(g, parse_cluster("cpu:2x4"), time_limit_s=0, calibration=FIXED_CPU)


@cache
def ppo_7b(offload: bool = True) -> Plan:
    """PPO with four Llama-2-7B on a100-80gb:2x8 (memory-bound choices, 7B shapes); without
    `offload`, in the space where every state stays on the GPU."""
    g = ppo("llama-2-7b", critic="llama-2-7b", ref="llama-2-7b", reward="llama-2-7b", batch=512, prompt_len=1024,
            gen_len=1024, ppo_minibatches=4, name="ppo_llama7b")
    return compile_graph(g, parse_cluster("a100-80gb:2x8"), time_limit_s=0, space=SearchSpace(offload=offload))


@cache
def sft_70b() -> Plan:
    return compile_graph(sft("llama-3-70b", batch=512, seq_len=4096, name="sft_llama3_70b"),
                         parse_cluster("h100-sxm:8x8"), time_limit_s=0)


def sft_70b_tp2_pp4() -> Plan:
    """`sft_70b` with its train call pinned to tp2 pp4 ZeRO-2 (the search may pick another)."""
    return with_layout(sft_70b(), "model_train", Layout(dp=8, tp=2, pp=4, zero=2, micro_batches=64))


def filling(plan: Plan, call: str, **degrees) -> Layout:  # noqa: ANN003
    """A layout of `call` with the given degrees and dp filling the call's mesh, whatever mesh the
    search gave it."""
    size = next(c.mesh.size for c in plan.calls if c.name == call)
    rest = degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("cp", 1)
    return Layout(dp=size // rest, **degrees)


def with_layout(plan: Plan, call: str, layout: Layout) -> Plan:
    """The plan with one call's layout replaced (validated like any plan)."""
    data = plan.model_dump(mode="json")
    for c in data["calls"]:
        if c["name"] == call:
            c["layout"] = layout.model_dump(mode="json")
    return Plan.model_validate(data)


def with_placement(plan: Plan, moves: dict[str, tuple[int, Layout]]) -> Plan:
    """The plan with calls moved: call -> (first rank of its new mesh, layout filling it)."""
    data = plan.model_dump(mode="json")
    for c in data["calls"]:
        if c["name"] in moves:
            first, layout = moves[c["name"]]
            c["mesh"] = {"ranks": list(range(first, first + layout.size))}
            c["layout"] = layout.model_dump(mode="json")
    return Plan.model_validate(data)


def measured_trace(plan: Plan, *, steps: int, slowdown: float, skew_s: float = 0.0) -> dict:
    """A trace in the runtime's format of `steps` steps in which every call takes `slowdown` times
    its estimate and runs at its estimated start (rank r starting `skew_s * r` late), recorded by
    `TraceRecorder` on a clock that the steps advance."""
    now = [0.0]
    period = max(c.est_start_s + c.est_time_s for c in plan.calls) * slowdown * 1.5
    recorders = [TraceRecorder(r, clock=lambda: now[0]) for r in range(plan.cluster.world_size)]
    calls = {c.name: c for c in plan.calls}
    for step in range(1, steps + 1):
        t0 = (step - 1) * period
        for r, rec in enumerate(recorders):
            for ra in plan.reallocations:
                ranks = set(calls[ra.from_call].mesh.ranks) | set(calls[ra.to_call].mesh.ranks)
                if r in ranks:
                    now[0] = t0 + ra.est_start_s * slowdown + skew_s * r
                    with rec.realloc(ra.to_call, step=step, model=ra.model, from_call=ra.from_call):
                        now[0] += ra.est_time_s * slowdown
            for c in plan.calls:
                if r in c.mesh.ranks:
                    now[0] = t0 + c.est_start_s * slowdown + skew_s * r
                    with rec.call(c.name, step=step, kind=c.kind, model=c.model):
                        now[0] += c.est_time_s * slowdown
    events = [e for rec in recorders for e in rec.events]
    return trace_document(events, source="measured", plan=plan.name, world_size=plan.cluster.world_size)
