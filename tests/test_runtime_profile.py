"""`planner.runtime_profile`: the runtime's host costs on a CPU, read back from its timings.

The profile times the runtime at negligible width (1 and 3 layers) and on a small real model and
inverts the cost model to get its coefficients. Fed the times the cost model itself predicts under
known coefficients, the inversion must give those coefficients back: the forward's host time per
kernel, the backward's and the decode step's (each its own), the overheads and the memory-bound
efficiency.
"""

from __future__ import annotations

import pytest

from cost_models.calibration import HardwareOverrides, default_calibration
from planner import runtime_profile as rp
from plans.model import resolve_model

KNOWN = dict(host_kernel_us=5.0, host_backward_kernel_us=9.0, host_decode_kernel_us=6.5, microbatch_overhead_ms=0.3,
             step_overhead_ms=0.6, decode_step_overhead_ms=0.2, elementwise_efficiency=0.3)
HW = HardwareOverrides(peak_tflops=0.1, hbm_gb_s=10.0)


def _base():
    """The coefficients the profile starts from; the memory-bound efficiency already the truth's,
    since the host times are read at negligible width before it is measured (a different one there
    moves them by about 2%)."""
    return default_calibration().coefficients.model_copy(update=dict(
        gemm_efficiency=1.0, hbm_efficiency=1.0, attention_efficiency=1.0, kernel_latency_us=0.0, host_overlap=0.0,
        host_collective_us=0.0, elementwise_efficiency=KNOWN["elementwise_efficiency"]))


def test_the_profile_reads_back_the_coefficients_that_made_the_times(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _base()
    truth = rp._model(HW, base, **KNOWN)

    def tagged(model: str, layers: int | str) -> dict[str, object]:
        return {kind: (model, layers, kind) for kind in ("forward", "train", "generate")}

    monkeypatch.setattr(rp, "_negligible_fns", lambda layers: tagged(rp.NEGLIGIBLE.format(layers=layers), layers))
    monkeypatch.setattr(rp, "probe_forward", lambda: (rp.PROBE, "probe", "forward"))

    def timed(fns: list[tuple[str, int | str, str]], *, budget_s: float) -> list[float]:
        out = []
        for model, layers, kind in fns:
            spec = resolve_model(model)
            calls = rp._calls(rp.PROBE_SEQS, rp.PROBE_LEN, 1) if layers == "probe" else \
                rp._calls(1, rp.NEG_PROMPT + rp.NEG_GEN, rp.NEG_GEN)
            out.append(rp._predict_s(truth, spec, calls[kind]))
        return out

    monkeypatch.setattr(rp, "interleaved_s", timed)
    got = rp.runtime_costs(HW, base, budget_s=0.0)
    for key, want in KNOWN.items():
        assert getattr(got, key) == pytest.approx(want, rel=2e-3), key


def test_backward_and_decode_kernels_cost_the_host_their_own_time() -> None:
    """A train call's time moves with the backward's host time per kernel and an inference call's
    does not; a generation's moves with the decode step's."""
    from plans.graph import ModelDecl
    from plans.layout import Layout, Mesh

    base = _base()
    spec = resolve_model("tiny-llama")
    calls = rp._calls(4, 32, 8)

    def times(**update: float) -> dict[str, float]:
        cm = rp._model(HW, base, **{**KNOWN, **update})
        return {k: cm.call_cost(c, ModelDecl(spec=spec, trainable=True), Mesh.block(0, 1), Layout()).time_s
                for k, c in calls.items()}

    ref, bwd, dec = times(), times(host_backward_kernel_us=19.0), times(host_decode_kernel_us=16.5)
    assert bwd["forward"] == ref["forward"] and bwd["generate"] == ref["generate"]
    assert bwd["train"] > ref["train"]
    assert dec["forward"] == ref["forward"] and dec["train"] == ref["train"]
    assert dec["generate"] > ref["generate"]
    # Unset, both are the forward's (a GPU calibration, the shipped one included, sets neither).
    shipped = default_calibration().coefficients
    assert shipped.host_backward_kernel_us is None and shipped.host_decode_kernel_us is None
    same = times(host_backward_kernel_us=KNOWN["host_kernel_us"], host_decode_kernel_us=KNOWN["host_kernel_us"])
    unset = rp._model(HW, base, **{k: v for k, v in KNOWN.items() if k not in ("host_backward_kernel_us",
                                                                               "host_decode_kernel_us")})
    assert {k: unset.call_cost(c, ModelDecl(spec=spec, trainable=True), Mesh.block(0, 1), Layout()).time_s
            for k, c in calls.items()} == same
