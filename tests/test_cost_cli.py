"""`planner estimate`, `planner calibrate` and `planner profile`: outputs and every error path."""

from __future__ import annotations

import json

import pytest

from cost_models.calibration import load_calibration

BASE = ["estimate", "--model", "gpt3-1.3b", "--cluster", "a100-80gb:1x8", "--tp", "2", "--pp", "2", "--dp", "2",
        "--micro-batch", "2", "--global-batch", "32", "--seq-len", "2048"]


def _with(args: list[str], **changes: str) -> list[str]:
    out = list(args)
    for key, value in changes.items():
        flag = "--" + key.replace("_", "-")
        out[out.index(flag) + 1] = value
    return out


def test_estimate_json(cli):
    r = cli(*BASE, "--recompute", "selective", "--sequence-parallel", "--zero", "1", "--json")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    for key in ("iteration_s", "model_tflops_per_gpu", "mfu", "peak_mem_bytes", "breakdown", "fits", "tokens_per_s"):
        assert key in out
    assert 0 < out["mfu"] < 1 and out["iteration_s"] > 0
    assert out["model_tflops_per_gpu"] == pytest.approx(out["mfu"] * 312, rel=1e-6)
    times, mem = out["breakdown"]["time_s"], out["breakdown"]["memory_bytes"]
    assert sum(times.values()) == pytest.approx(out["iteration_s"])
    assert {"compute", "tp_comm", "pp_bubble", "dp_comm"} <= set(times)
    assert sum(mem.values()) == out["peak_mem_bytes"]
    assert {"params", "grads", "optimizer", "activations"} <= set(mem)
    assert out["layout"] == "dp2 tp2 pp2 z1 mb8 rc:sel sp"
    # the runtime is not calibrated on a GPU, and the estimate says so as a plan does
    assert out["costed_for"].startswith("the planner runtime (framework torch), not yet calibrated on a GPU")
    assert ("FlashAttention-2's published speed by head dim and sequence length, at most 50% of the a100-80gb peak"
            in out["costed_for"])


def test_estimate_table_and_inline_spec(cli):
    spec = "model_type=gpt,hidden_size=2048,num_hidden_layers=24,num_attention_heads=16,vocab_size=51200"
    r = cli(*_with(BASE, model=spec))
    assert r.code == 0, r.err
    assert "iteration" in r.out and "MFU" in r.out and "peak memory per GPU" in r.out and "tp_comm" in r.out
    assert "costed for the planner runtime" in " ".join(r.out.split())


def test_estimate_config_json_and_cluster_file(cli, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8,
                               "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 2816,
                               "vocab_size": 32000}))
    cl = tmp_path / "cluster.json"
    cl.write_text(json.dumps({"gpu": "h100-sxm", "nodes": 1, "gpus_per_node": 8}))
    r = cli(*_with(BASE, model=str(cfg), cluster=str(cl)), "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["cluster"] == "h100-sxm:1x8"


def test_estimate_calibration_changes_the_estimate(cli, tmp_path):
    base = json.loads(cli(*BASE, "--json").out)["iteration_s"]
    from cost_models.calibration import default_calibration, save_calibration

    cal = default_calibration()
    slow = cal.model_copy(update={"coefficients": cal.coefficients.model_copy(update={"gemm_efficiency": 0.2})})
    path = tmp_path / "slow.json"
    save_calibration(slow, path)
    r = cli(*BASE, "--calibration", str(path), "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["iteration_s"] > 1.5 * base


@pytest.mark.parametrize("args,message", [
    (_with(BASE, model="gpt-9000"), "unknown model 'gpt-9000'"),
    (_with(BASE, model="model_type=gpt,hidden_size=10"), "model spec"),
    (_with(BASE, model="model_type=gpt,hidden_size=1000,num_hidden_layers=2,num_attention_heads=3,vocab_size=10"),
     "not divisible by num_attention_heads"),
    (_with(BASE, model="/nonexistent/config.json"), "does not exist"),
    (_with(BASE, cluster="a100-80gb"), "malformed cluster"),
    (_with(BASE, cluster="tpu-v9:1x8"), "unknown GPU 'tpu-v9'"),
    (_with(BASE, cluster="a100-80gb:1x8,bogus=1"), "cannot read override"),
    (_with(BASE, cluster="/nonexistent/cluster.yaml"), "does not exist"),
    (_with(BASE, dp="4"), "but cluster a100-80gb:1x8 has 8 GPUs"),
    (_with(BASE, tp="8", pp="1", dp="1", model="model_type=gpt,hidden_size=1200,num_hidden_layers=4,num_attention_heads=12,vocab_size=1000"),
     "tp=8 does not divide num_attention_heads=12"),
    (_with(BASE, global_batch="30"), "global batch 30 is not divisible by dp x micro batch = 2 x 2"),
    (_with(BASE, micro_batch="0"), "micro batch must be at least 1"),
    (_with(BASE, seq_len="4096"), "exceeds max_position_embeddings=2048"),
    ([*_with(BASE, tp="1", dp="4"), "--sequence-parallel"], "sequence_parallel needs tp > 1"),
    ([*_with(BASE, tp="4", dp="1"), "--zero", "1"], "a ZeRO stage needs dp > 1 or cp > 1"),
    ([*_with(BASE, pp="1", dp="4"), "--interleave", "2"], "interleave > 1 needs pp > 1"),
    ([*_with(BASE, tp="1", pp="8", dp="1", global_batch="16"), "--interleave", "4"], "exceeds num_hidden_layers"),
    ([*_with(BASE, tp="1", dp="2"), "--cp", "2", "--seq-len", "2047"], "not divisible by cp=2"),
    ([*BASE, "--calibration", "/nonexistent/calib.json"], "calibration file '/nonexistent/calib.json' does not exist"),
])
def test_estimate_errors_exit_2_with_a_message(cli, args, message):
    r = cli(*args)
    assert r.code == 2, (r.out, r.err)
    assert message in " ".join(r.err.split()), r.err
    assert "Traceback" not in r.err


def test_estimate_rejects_a_malformed_calibration(cli, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "planner-calibration/1", "coefficients": {"gemm_efficiency": 2}}')
    r = cli(*BASE, "--calibration", str(bad))
    assert r.code == 2 and "calibration" in r.err and "gemm_efficiency" in r.err
    bad.write_text("not json")
    r = cli(*BASE, "--calibration", str(bad))
    assert r.code == 2 and "not valid JSON" in r.err


def _synthetic_csv(path, cal_path):
    """Rows 'measured' by the model itself under a known calibration, in vTrain's column names."""
    from cost_models.fit import Setup, predict
    from cost_models.measured import read_measured

    rows = [(24, 1024, 16, 12, 1, 2, 1, 1), (24, 1024, 16, 12, 2, 1, 2, 2), (16, 2048, 16, 12, 2, 2, 2, 4),
            (32, 2048, 16, 16, 1, 4, 2, 2), (8, 1024, 16, 12, 4, 1, 1, 8), (16, 1024, 16, 16, 1, 1, 4, 4)]
    header = "# GPUs,global batch,micro batch,hidden size,attention heads,# layers,sequence length," \
             "tensor parallelism,data parallelism,pipeline parallelism,iteration time (ms)\n"
    lines = [f"{tp * dp * pp},{gb},{mb},{h},{a},{layers},1024,{tp},{dp},{pp},1.0"
             for gb, h, a, layers, tp, dp, pp, mb in rows]
    path.write_text(header + "\n".join(lines) + "\n")
    runs = read_measured(path)
    truth = predict(runs, load_calibration(cal_path), Setup("a100-80gb", 8, None, None, "megatron"))
    path.write_text(header + "\n".join(line.rsplit(",", 1)[0] + f",{1e3 * t:.4f}" for line, t in zip(lines, truth)) + "\n")


def test_calibrate_fits_measured_runs(cli, tmp_path):
    from cost_models.calibration import default_calibration, save_calibration

    cal = default_calibration()
    truth = cal.model_copy(update={"coefficients": cal.coefficients.model_copy(update={"gemm_efficiency": 0.55})})
    save_calibration(truth, tmp_path / "truth.json")
    csv = tmp_path / "runs.csv"
    _synthetic_csv(csv, tmp_path / "truth.json")
    out = tmp_path / "fit.json"
    r = cli("calibrate", str(csv), "--gpu", "a100-80gb", "--sweeps", "1", "-o", str(out))
    assert r.code == 0, r.err
    fitted = load_calibration(out)
    assert fitted.fit[f"mape_{csv.stem}"] < 5.0
    assert "MAPE after" in r.out
    assert fitted.source.startswith("planner calibrate")
    assert fitted.fitted_on == "a100-80gb"  # its GEMM efficiency is carried to other GPUs by their matmul ceilings


@pytest.mark.parametrize("content,gpu,message", [
    (None, "a100-80gb", "does not exist"),
    ("hidden size,# layers\n1024,12\n", "a100-80gb", "lacks columns"),
    ("x\n1\n", "tpu-v9", "unknown GPU 'tpu-v9'"),
])
def test_calibrate_errors(cli, tmp_path, content, gpu, message):
    csv = tmp_path / "runs.csv"
    if content is not None:
        csv.write_text(content)
    r = cli("calibrate", str(csv), "--gpu", gpu, "-o", str(tmp_path / "out.json"))
    assert r.code == 2 and message in r.err, r.err


@pytest.mark.slow
def test_profile_on_cpu_writes_a_usable_calibration(cli, tmp_path):
    out = tmp_path / "cpu.json"
    r = cli("profile", "-o", str(out), "--budget-s", "1", "--ranks", "2", "--device", "cpu")
    assert r.code == 0, r.err
    cal = load_calibration(out)
    assert cal.gpu == "cpu" and cal.framework == "torch"
    hw = cal.hardware
    assert hw.peak_tflops and hw.peak_tflops > 0 and hw.hbm_gb_s and hw.hbm_gb_s > 0
    assert hw.intra_node_gbps and hw.intra_node_gbps > 0 and hw.intra_latency_us is not None
    assert cal.coefficients.host_kernel_us > 0 and cal.coefficients.host_overlap == 0.0
    # The runtime's own costs: per kernel, per generated token, attention's softmax, eager kernels.
    co = cal.coefficients
    assert co.decode_step_overhead_ms > 0 and co.attention_head_us + co.attention_score_ns > 0
    assert 0 < co.elementwise_efficiency <= 1 and co.attention_efficiency == 1.0
    from planner.profiling import rank_threads

    assert hw.cpu_cores and hw.cpu_cores >= 1 and hw.rank_threads == rank_threads(2)  # 1 unless OMP_NUM_THREADS
    r = cli("estimate", "--model", "tiny-llama", "--cluster", "cpu:1x4", "--tp", "2", "--pp", "1", "--dp", "2",
            "--micro-batch", "2", "--global-batch", "8", "--seq-len", "64", "--calibration", str(out), "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["iteration_s"] > 0
