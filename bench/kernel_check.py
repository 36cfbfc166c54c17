"""Kernel by kernel on one GPU: a decoder layer's GEMMs and fused attention against the cost model.

    python bench/kernel_check.py --out REPORT.json                    # on a CUDA machine (gpu_check.sh runs it)
    python bench/kernel_check.py --device cpu --quick --out r.json   # the same code, tiny shapes, on CPU

The cost model's efficiencies were fitted on A100s only and are carried to other GPUs by their
datasheets (GEMMs by their published matmul ceilings). On Hopper that is not borne out: the
Megatron-LM README's H100 table (Megatron-Core r0.8.0, `bench/cost_accuracy.py`) is predicted
18% too fast for a 1.7B GPT and 27% too slow for a 32B one. This check measures what those predictions rest on, for the layer shapes of those
two rows (GPT, sequence 4096, micro-batch 1; the 1.7B at tp 1, the 32B at tp 8 with sequence
parallelism, so every GEMM has 4096 rows):

- every distinct GEMM of a layer's forward and backward and of the LM head, as the cost model
  lists them (`cost_models.ops.layer_work`, `head_work`), run as `torch.matmul` in bf16;
- causal fused attention at those heads, forward and backward, through PyTorch's SDPA with its
  flash backend (FlashAttention-2) and, where PyTorch has it, its cuDNN backend;
- the 16 bf16 GEMMs of OpenXLA's measured sm_90 table (4,096 rows, n and k 512 to 4,096;
  `bench/cost_accuracy.py`, "kernel level"), beside that table's published rate, so a Hopper run
  also says whether this GPU's GEMMs follow its shape (a fixed time per GEMM and a cost per output
  tile that make short-k GEMMs slow), which the model does not have;
- a large copy (HBM bandwidth).

Each is timed with CUDA events (median of `--repeats` after a warm-up) beside the cost model's
time for that kernel on the GPU preset the device matches (h200, h100-sxm, a100-80gb), with the
shipped calibration. The measured/predicted ratio by kind says which efficiency is off on this
GPU: GEMMs (`gemm_efficiency` and the wave model), attention (published kernel speeds by
length, `cost_models.attention`: cuDNN's for megatron-core on Hopper, FlashAttention-2's for the
runtime; the flash backend measures the latter, the cuDNN backend the former) or bandwidth
(`hbm_efficiency`). One JSON report, to commit under bench/results/ with the GPU check's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import importlib.util  # noqa: E402

import torch  # noqa: E402

from cost_models import CostModel  # noqa: E402
from cost_models.compute import kernel_time_s  # noqa: E402
from cost_models.framework import resolve_framework  # noqa: E402
from cost_models.ops import Kernel, gemm, head_work, layer_work  # noqa: E402
from planner.profiling import GPU_NAMES  # noqa: E402
from plans import parse_cluster, resolve_model  # noqa: E402

# (label, hidden, heads, layers, tp): the smallest and largest unpipelined rows of the H100 table.
ROWS = (("gpt-1.7b tp1", 2048, 16, 24, 1), ("gpt-32b tp8 sp", 7168, 56, 48, 8))
QUICK_ROWS = (("tiny tp1", 64, 4, 2, 1), ("tiny tp2 sp", 64, 4, 2, 2))
SEQ, QUICK_SEQ, VOCAB, QUICK_VOCAB = 4096, 64, 131072, 512


def published_hopper_gemms() -> tuple[int, dict[tuple[int, int], float]]:
    """OpenXLA's measured sm_90 bf16 GEMMs as `bench/cost_accuracy.py` holds them: (rows,
    {(n, k): TFLOP/s}). Loaded from its file, since this script keeps bench/ off the import path
    (bench/runtime.py would shadow the runtime package)."""
    spec = importlib.util.spec_from_file_location("bench_cost_accuracy", ROOT / "bench" / "cost_accuracy.py")
    assert spec is not None and spec.loader is not None
    acc = sys.modules["bench_cost_accuracy"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(acc)
    return acc.XLA_H100_GEMM_ROWS, {(n, k): rate for k, rates in acc.XLA_H100_GEMM.items()
                                    for n, rate in zip(acc.XLA_H100_GEMM_N, rates)}


def timed(fn, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of `fn` after one warm-up call: CUDA events on a GPU, perf_counter on a CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_runner(k: Kernel, device: torch.device, dtype: torch.dtype):  # noqa: ANN201
    """`torch.matmul` of the kernel's [batch x] m x k by k x n operands."""
    lead = (k.batch,) if k.batch > 1 else ()
    a = torch.randn(*lead, k.m, k.k, device=device, dtype=dtype)
    b = torch.randn(*lead, k.k, k.n, device=device, dtype=dtype)
    return lambda: torch.matmul(a, b)


def attention_backends(device: torch.device) -> dict[str, object]:
    """SDPA backends to time: flash and cuDNN on a GPU (where this PyTorch has them), math on a CPU."""
    from torch.nn.attention import SDPBackend

    if device.type != "cuda":
        return {"math": SDPBackend.MATH}
    out = {"flash": SDPBackend.FLASH_ATTENTION}
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        out["cudnn"] = SDPBackend.CUDNN_ATTENTION
    return out


def attention_times(heads: int, seq: int, d: int, backend: object, device: torch.device, dtype: torch.dtype,
                    repeats: int) -> tuple[float, float]:
    """Forward and backward seconds of causal SDPA over one sequence of `heads` heads."""
    from torch.nn.attention import sdpa_kernel

    q, k, v = (torch.randn(1, heads, seq, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq, d, device=device, dtype=dtype)

    def fwd() -> torch.Tensor:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def both() -> None:
        fwd().backward(grad)

    f = timed(fwd, device, repeats)
    return f, max(0.0, timed(both, device, repeats) - f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test of this script)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --quick for the CPU smoke run", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    preset = next((p for key, p in GPU_NAMES if key in name), None) or "h200"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # Each GEMM is timed writing its output, as a forward GEMM does: none accumulates into a buffer.
    fw = dataclasses.replace(resolve_framework("megatron-core"), wgrad_accum_fused=False)
    hw = CostModel(parse_cluster(f"{preset}:1x1"), framework=fw).hw
    # The runtime (`torch`) differs only in its attention, timed at FlashAttention-2's published
    # share of the peak until this very check calibrates it.
    hw_runtime = CostModel(parse_cluster(f"{preset}:1x1")).hw
    seq, vocab = (QUICK_SEQ, QUICK_VOCAB) if args.quick else (SEQ, VOCAB)
    print(f"{name}: predicted as {preset} with the shipped calibration (megatron-core kernels), "
          f"{'tiny shapes' if args.quick else f'sequence {seq}, micro-batch 1'}")
    report: dict = {"device": name, "torch": torch.__version__, "preset": preset, "dtype": str(dtype), "seq": seq,
                    "gemms": [], "attention": [], "bandwidth": {}}
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # kind -> [measured, predicted]
    for label, hidden, heads, layers, tp in QUICK_ROWS if args.quick else ROWS:
        spec = resolve_model(dict(model_type="gpt", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                  vocab_size=vocab, max_position_embeddings=seq, tie_word_embeddings=False))
        work = layer_work(spec, fw, b=1, s=seq, tp=tp, cp=1, sp=tp > 1)
        head_f, head_b = head_work(spec, fw, head="lm", b=1, s=seq, tp=tp, cp=1, sp=tp > 1, loss=True)
        gemms: dict[tuple[int, int, int, int], list] = {}
        for k in (*work.fwd, *work.bwd, *head_f, *head_b):
            if k.kind == "gemm":
                gemms.setdefault((k.m, k.n, k.k, k.batch), [k, 0])[1] += 1
        print(f"\n{label}: {len(gemms)} distinct GEMMs (m x n x k, per layer or head use)")
        for (m, n, kk, batch), (k, count) in sorted(gemms.items()):
            measured = timed(gemm_runner(k, device, dtype), device, args.repeats)
            predicted = kernel_time_s(k, hw)
            kinds["gemm"][0] += count * measured
            kinds["gemm"][1] += count * predicted
            tflops = k.flops / measured / 1e12
            print(f"  {m:6d} x {n:6d} x {kk:6d}{f' x{batch}' if batch > 1 else ''}  x{count}  measured {1e3 * measured:8.3f} ms"
                  f" ({tflops:6.1f} TFLOP/s)  predicted {1e3 * predicted:8.3f} ms  ratio {measured / predicted:5.2f}")
            report["gemms"].append({"row": label, "m": m, "n": n, "k": kk, "batch": batch, "count": count,
                                    "measured_s": measured, "predicted_s": predicted, "tflops": tflops})
        att_f = next(k for k in work.fwd if k.kind == "attn")
        att_b = next(k for k in work.bwd if k.kind == "attn")
        pred_f, pred_b = kernel_time_s(att_f, hw), kernel_time_s(att_b, hw)
        runtime_f, runtime_b = kernel_time_s(att_f, hw_runtime), kernel_time_s(att_b, hw_runtime)
        for backend_name, backend in attention_backends(device).items():
            try:
                f, b = attention_times(heads // tp, seq, spec.d_head, backend, device, dtype, args.repeats)
            except RuntimeError as e:  # a backend this GPU or build cannot run
                print(f"  attention {backend_name}: not available ({str(e).splitlines()[0][:100]})")
                continue
            kinds[f"attention ({backend_name})"][0] += f + b
            kinds[f"attention ({backend_name})"][1] += pred_f + pred_b
            print(f"  attention {backend_name:5s} {heads // tp} heads x {seq} causal, head dim {spec.d_head}: forward "
                  f"{1e3 * f:7.3f} ms ({att_f.flops / f / 1e12:5.1f} TFLOP/s) predicted {1e3 * pred_f:7.3f}; backward "
                  f"{1e3 * b:7.3f} ms ({att_b.flops / max(b, 1e-12) / 1e12:5.1f}) predicted {1e3 * pred_b:7.3f}"
                  f" (the runtime's: {1e3 * runtime_f:7.3f} and {1e3 * runtime_b:7.3f})")
            report["attention"].append({"row": label, "backend": backend_name, "heads": heads // tp, "seq": seq,
                                        "head_dim": spec.d_head, "forward_s": f, "backward_s": b,
                                        "predicted_forward_s": pred_f, "predicted_backward_s": pred_b,
                                        "runtime_predicted_forward_s": runtime_f,
                                        "runtime_predicted_backward_s": runtime_b})
    rows, published_table = published_hopper_gemms()
    table: dict[tuple[int, int], float | None] = dict(published_table)
    if args.quick:  # the same code on two tiny shapes: a CPU has nothing to compare with the table
        rows, table = 64, {(n // 64, k // 64): None for (n, k) in table if n == k and n in (1024, 2048)}
    print(f"\nOpenXLA's sm_90 GEMMs, {rows} rows (published TFLOP/s on sm_90 / measured here / the model's)")
    report["xla_gemms"] = []
    for (n, kk), published in sorted(table.items(), key=lambda item: (item[0][1], item[0][0])):
        k = gemm(rows, n, kk)
        measured, predicted = timed(gemm_runner(k, device, dtype), device, args.repeats), kernel_time_s(k, hw)
        kinds["gemm (OpenXLA shapes)"][0] += measured
        kinds["gemm (OpenXLA shapes)"][1] += predicted
        shown = "    -" if published is None else f"{published:5.0f}"
        print(f"  n {n:5d} k {kk:5d}: {shown} / {k.flops / measured / 1e12:7.1f} / {k.flops / predicted / 1e12:5.0f}")
        report["xla_gemms"].append({"m": rows, "n": n, "k": kk, "published_sm90_tflops": published,
                                    "measured_s": measured, "predicted_s": predicted})
    nbytes = (1 << 20) if args.quick else (1 << 30)
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), device, args.repeats)
    moved = 2.0 * nbytes  # read and write
    report["bandwidth"] = {"copy_bytes": moved, "measured_s": copy_s, "measured_gb_s": moved / copy_s / 1e9,
                           "model_gb_s": hw.mem_bytes_s / 1e9}
    kinds["bandwidth (copy)"] = [copy_s, moved / hw.mem_bytes_s]
    print(f"\nHBM: a {nbytes >> 20} MiB copy moves {moved / copy_s / 1e9:.0f} GB/s; the model streams {hw.mem_bytes_s / 1e9:.0f}")
    print("\nmeasured / predicted by kind (above 1: the cost model is too fast on this GPU"
          + ("; on a CPU the ratios mean nothing, this run only checks the script" if device.type != "cuda" else "") + "):")
    for kind, (meas, pred) in kinds.items():
        print(f"  {kind:20s} {meas / pred:5.2f}")
    report["ratios"] = {kind: meas / pred for kind, (meas, pred) in kinds.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
