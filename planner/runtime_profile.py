"""What the planner's own runtime costs on a CPU: the part of `planner profile` that runs it.

On a CPU a small model's call is mostly the host working through eager PyTorch, one op after
another, on the same core that does the arithmetic. The cost model charges that as a host time
per kernel of its inventory (`cost_models.ops`), per micro-batch, per optimizer step and per
generated token, and the arithmetic as FLOPs and bytes. The runtime is timed here at two scales:

- at *negligible width* (hidden size 8, one sequence of 6 tokens) the arithmetic vanishes and
  what is left is host time: a forward, a train step and a generation at 1 and at 3 layers give
  the host time per layer, hence per kernel (the cost model says how many kernels a layer has):
  the forward's per forward kernel, then the train step's per backward kernel (autograd's engine
  runs each backward op as a node, beside the views' and the accumulations' nodes: with the
  inventory counting every kernel the runtime launches, `tests/test_kernel_inventory.py`, a
  backward kernel took 1.5 times a forward one on this machine), then the generation's per kernel
  of a decode step (which also writes the layer's keys and values into the cache and reads it
  through views: 1.4 times a forward kernel), and, from what the cost
  model then predicts at 1 layer, the overheads per micro-batch (a forward), per optimizer
  step (a train step) and per generated token (a generation);
- on a *small real* model (`PROBE`) the forward's time beyond its GEMMs, attention and host
  work is its memory-bound work (norms, rotary embedding, activations, residuals, casts: the
  eager kernels the runtime launches, each counted by the cost model with the bytes it moves),
  expressed as the fraction of streaming bandwidth per modeled byte (`elementwise_efficiency`).

Attention (`torch.nn.functional.scaled_dot_product_attention`) on a CPU core pays a setup per
(sequence, head) and an exponential per score on top of its matmuls: two shapes give both.

Timings interleave the variants being compared, round after round, so all of them meet the same
conditions, and keep the median: what the cost model predicts is a call's mean time over a run's
steps, slower moments included. (Until the validation in `bench/predict_vs_measure.py` showed it,
the 10th percentile was kept, as the machine's own speed; on a 2-core machine a round's median was
1.2-1.4 times its 10th percentile, and every prediction came out 15-40% short.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from cost_models.api import CostModel
from cost_models.calibration import Calibration, Coefficients, HardwareOverrides
from plans.cluster import parse_cluster
from plans.graph import Call, ModelDecl
from plans.layout import Layout, Mesh
from plans.model import ModelSpec, resolve_model

QUANTILE = 50  # percentile kept of interleaved timings: the median
NEGLIGIBLE = ("model_type=llama,hidden_size=8,num_hidden_layers={layers},num_attention_heads=2,num_key_value_heads=1,"
              "intermediate_size=16,vocab_size=8,max_position_embeddings=64")
NEG_PROMPT, NEG_GEN = 2, 4  # one sequence of 2 prompt + 4 generated tokens
PROBE = ("model_type=llama,hidden_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
         "intermediate_size=256,vocab_size=512,max_position_embeddings=128")
PROBE_SEQS, PROBE_LEN = 4, 32
ATTN_SHAPES = ((64, 16, 16), (64, 64, 16))  # (sequences x heads, tokens, head dim), causal
EFFICIENCY_RANGE = (0.01, 1.0)


def interleaved_s(fns: list[Callable[[], object]], *, budget_s: float, min_rounds: int = 8) -> list[float]:
    """Seconds per call of each of `fns`, called in turn round after round for about `budget_s`
    (at least `min_rounds` rounds, after one warm-up round): the `QUANTILE`-th percentile of each."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_rounds or (time.perf_counter() - start < budget_s and len(times[0]) < 500):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [float(np.percentile(t, QUANTILE)) for t in times]


def attention_softmax(*, peak_flops: float, budget_s: float) -> tuple[float, float]:
    """(seconds per (sequence, head), seconds per score) of causal fused attention on this core,
    beyond its matmul FLOPs at `peak_flops`: least squares over `ATTN_SHAPES`."""
    fns: list[Callable[[], object]] = []
    rows, flops_s = [], []
    for pairs, s, d in ATTN_SHAPES:
        q = torch.randn(1, pairs, s, d)
        fns.append(partial(F.scaled_dot_product_attention, q, q, q, is_causal=True))
        scores = pairs * s * (s + 1) / 2
        rows.append((pairs, scores))
        flops_s.append(4.0 * d * scores / peak_flops)
    measured = interleaved_s(fns, budget_s=budget_s)
    (head_s, score_s), *_ = np.linalg.lstsq(np.array(rows, dtype=float),
                                           np.array([t - f for t, f in zip(measured, flops_s)]), rcond=None)
    return max(float(head_s), 0.0), max(float(score_s), 0.0)


@dataclass(frozen=True)
class RuntimeCosts:
    """The runtime's host and eager costs on this core, in the calibration's units."""

    host_kernel_us: float
    host_backward_kernel_us: float
    host_decode_kernel_us: float
    microbatch_overhead_ms: float
    step_overhead_ms: float
    decode_step_overhead_ms: float
    elementwise_efficiency: float


def _runner(spec: ModelSpec):  # noqa: ANN202 - a runtime.engine.ModelRunner
    from runtime.engine import ModelRunner
    from runtime.groups import solo_groups
    from runtime.model import init_tensor

    return ModelRunner(spec, head="lm", trainable=True, groups=solo_groups(Layout()),
                       state=lambda p: init_tensor(p, seed=0), device=torch.device("cpu"))


def probe_forward() -> Callable[[], object]:
    """One forward of the small real model `PROBE` (log-probs of `PROBE_SEQS` x `PROBE_LEN` tokens)."""
    spec = resolve_model(PROBE)
    runner = _runner(spec)
    tokens = torch.randint(0, spec.vocab_size, (PROBE_SEQS, PROBE_LEN), generator=torch.Generator().manual_seed(0))
    return lambda: runner.forward(tokens, what="logprobs")


def _calls(seqs: int, seq_len: int, gen_len: int) -> dict[str, Call]:
    return {"forward": Call(name="forward", model="m", kind="inference", seqs=seqs, seq_len=seq_len, returns="logprobs"),
            "train": Call(name="train", model="m", kind="train", seqs=seqs, seq_len=seq_len, loss="sft"),
            "generate": Call(name="generate", model="m", kind="generate", seqs=seqs, seq_len=seq_len, gen_len=gen_len)}


def _negligible_fns(layers: int) -> dict[str, Callable[[], object]]:
    return call_fns(NEGLIGIBLE.format(layers=layers), seqs=1, prompt=NEG_PROMPT, gen=NEG_GEN)


def call_fns(model: str, *, seqs: int, prompt: int, gen: int) -> dict[str, Callable[[], object]]:
    """A forward (log-probs), a train step and a generation of `model` on one process."""
    from plans.graph import AlgorithmConfig
    from runtime.losses import make_loss

    spec = resolve_model(model)
    runner = _runner(spec)
    n = prompt + gen
    tokens = torch.randint(0, spec.vocab_size, (seqs, n), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(seqs, n - 1, dtype=torch.bool)
    loss = make_loss("sft", AlgorithmConfig())
    return {"forward": lambda: runner.forward(tokens, what="logprobs"),
            "train": lambda: runner.train({"tokens": tokens, "mask": mask}, loss=loss, denoms=[float(seqs * (n - 1))],
                                          lr=1e-3),
            "generate": lambda: runner.generate(tokens[:, :prompt], gen_len=gen, temperature=1.0, seed=0)}


def _model(hardware: HardwareOverrides, coefficients: Coefficients, **update: float) -> CostModel:
    cal = Calibration(gpu="cpu", framework="torch", coefficients=coefficients.model_copy(update=update),
                      hardware=hardware)
    return CostModel(parse_cluster("cpu:1x1"), cal)


def _predict_s(cm: CostModel, spec: ModelSpec, call: Call) -> float:
    return cm.call_cost(call, ModelDecl(spec=spec, trainable=True), Mesh.block(0, 1), Layout()).time_s


def runtime_costs(hardware: HardwareOverrides, coefficients: Coefficients, *, budget_s: float) -> RuntimeCosts:
    """Time the runtime at negligible width and on `PROBE`, and express what was measured as the
    cost model's coefficients (with `hardware` and the other `coefficients` as measured)."""
    fns: dict[tuple[int | str, str], Callable[[], object]] = {
        (layers, kind): fn for layers in (1, 3) for kind, fn in _negligible_fns(layers).items()}
    fns[("probe", "forward")] = probe_forward()
    got = dict(zip(fns, interleaved_s(list(fns.values()), budget_s=budget_s)))
    specs = {layers: resolve_model(NEGLIGIBLE.format(layers=layers)) for layers in (1, 3)}
    calls = _calls(1, NEG_PROMPT + NEG_GEN, NEG_GEN)
    zero = _model(hardware, coefficients, host_kernel_us=0.0, microbatch_overhead_ms=0.0, step_overhead_ms=0.0,
                  decode_step_overhead_ms=0.0)
    unit = _model(hardware, coefficients, host_kernel_us=1.0, microbatch_overhead_ms=0.0, step_overhead_ms=0.0,
                  decode_step_overhead_ms=0.0)
    fwd = calls["forward"]

    def two_layers(cm: CostModel) -> float:  # what 2 more layers add to a forward
        return _predict_s(cm, specs[3], fwd) - _predict_s(cm, specs[1], fwd)

    kernels = (two_layers(unit) - two_layers(zero)) / 1e-6
    host_us = max(got[(3, "forward")] - got[(1, "forward")] - two_layers(zero), 0.0) / kernels * 1e6
    coef = {"host_kernel_us": host_us, "microbatch_overhead_ms": 0.0, "step_overhead_ms": 0.0,
            "decode_step_overhead_ms": 0.0}
    # What 2 more layers add to a train step (a generation) beyond the host time of their forward
    # kernels (their prefill) and the arithmetic, per kernel of their backward (decode steps).
    for key, kind in (("host_backward_kernel_us", "train"), ("host_decode_kernel_us", "generate")):
        without = _model(hardware, coefficients, **coef, **{key: 0.0})

        def two_more(cm: CostModel, kind: str = kind) -> float:
            return _predict_s(cm, specs[3], calls[kind]) - _predict_s(cm, specs[1], calls[kind])

        launches = (two_more(_model(hardware, coefficients, **coef, **{key: 1.0})) - two_more(without)) / 1e-6
        coef[key] = max(got[(3, kind)] - got[(1, kind)] - two_more(without), 0.0) / launches * 1e6
    # Each overhead is what a 1-layer call takes beyond the model with the ones found before it.
    for key, kind, per in (("microbatch_overhead_ms", "forward", 1), ("step_overhead_ms", "train", 1),
                           ("decode_step_overhead_ms", "generate", NEG_GEN)):
        beyond = _predict_s(_model(hardware, coefficients, **coef), specs[1], calls[kind])
        coef[key] = max(got[(1, kind)] - beyond, 0.0) / per * 1e3
    # The probe's memory-bound work: the efficiency at which the model's forward takes what was measured.
    spec = resolve_model(PROBE)
    call = _calls(PROBE_SEQS, PROBE_LEN, 1)["forward"]
    lo, hi = EFFICIENCY_RANGE

    def predicted(eff: float) -> float:
        return _predict_s(_model(hardware, coefficients, elementwise_efficiency=eff, **coef), spec, call)

    want = got[("probe", "forward")]
    if predicted(hi) >= want:
        eff = hi
    elif predicted(lo) <= want:
        eff = lo
    else:
        for _ in range(40):  # bisection on a log scale: time falls as efficiency rises
            mid = (lo * hi) ** 0.5
            lo, hi = (mid, hi) if predicted(mid) > want else (lo, mid)
        eff = (lo * hi) ** 0.5
    return RuntimeCosts(host_kernel_us=round(coef["host_kernel_us"], 3),
                        host_backward_kernel_us=round(coef["host_backward_kernel_us"], 3),
                        host_decode_kernel_us=round(coef["host_decode_kernel_us"], 3),
                        microbatch_overhead_ms=round(coef["microbatch_overhead_ms"], 4),
                        step_overhead_ms=round(coef["step_overhead_ms"], 4),
                        decode_step_overhead_ms=round(coef["decode_step_overhead_ms"], 4),
                        elementwise_efficiency=round(eff, 4))

