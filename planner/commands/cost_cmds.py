"""Commands on the cost model: estimate, calibrate, profile."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plans.errors import PlannerError
from plans.hardware import GIB
from plans.io import check_output
from plans.layout import GaLore, Layout


class Recompute(str, Enum):
    none = "none"
    selective = "selective"
    full = "full"


class FrameworkName(str, Enum):
    torch = "torch"
    megatron = "megatron"
    megatron_core = "megatron-core"
    vllm = "vllm"
    rlhf_engine = "rlhf-engine"
    rlhf_engine_hf = "rlhf-engine-hf"
    verl_fsdp = "verl-fsdp"


FRAMEWORK_HELP = ("Software stack whose kernels are timed: 'torch' (the planner's runtime: flash attention, fp32 "
                  "weights under bf16 autocast, eager norms; not yet calibrated on a GPU), 'megatron-core' (Megatron-Core "
                  "with Transformer Engine: fused kernels, bf16 weights, overlapped communication), 'megatron' "
                  "(Megatron-LM's GPT on Megatron-DeepSpeed, as vTrain measured it: materialised attention scores, dropout), "
                  "'rlhf-engine' (verl's Megatron workers, vLLM rollouts), 'rlhf-engine-hf' (OpenRLHF: HF transformers "
                  "layers on DeepSpeed, whose activations are larger, ring attention), 'verl-fsdp' (verl's FSDP workers: "
                  "the same layers on FSDP, Ulysses context parallel) or 'vllm' (generation).")


def estimate(
    model: str = typer.Option(..., "--model", help="Preset name, HF config.json path, or inline fields "
                              "(model_type=gpt,hidden_size=12288,num_hidden_layers=96,num_attention_heads=96,vocab_size=51200)."),
    cluster: str = typer.Option(..., "--cluster", help="GPU:NODESxPER_NODE[,intra_node_gbps=..,inter_node_gbps=..,mem_gib=..,mem_headroom_gib=..] or a .yaml/.json file."),
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel degree."),
    pp: int = typer.Option(..., "--pp", help="Pipeline-parallel stages."),
    dp: int = typer.Option(..., "--dp", help="Data-parallel degree."),
    cp: int = typer.Option(1, "--cp", help="Context-parallel degree."),
    micro_batch: int = typer.Option(..., "--micro-batch", help="Sequences per micro-batch."),
    global_batch: int = typer.Option(..., "--global-batch", help="Sequences per optimizer step."),
    seq_len: int = typer.Option(..., "--seq-len", help="Tokens per sequence."),
    recompute: Recompute = typer.Option(Recompute.none, "--recompute", help="Activation recompute."),
    zero: int = typer.Option(0, "--zero", min=0, max=3, help="ZeRO stage over the data-parallel group."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="Shard norm/dropout activations over tp."),
    interleave: int = typer.Option(1, "--interleave", help="Virtual pipeline stages per rank (interleaved 1F1B)."),
    galore_rank: int | None = typer.Option(None, "--galore-rank", min=1, help="Train with a GaLore optimizer of this rank (needs --zero 0 or 1; see planner compile --help)."),
    galore_interval: int = typer.Option(GaLore.model_fields["update_interval"].default, "--galore-interval", min=1, help="With --galore-rank: steps between the SVDs that refresh the projections."),
    calibration: Path | None = typer.Option(None, "--calibration", help="Calibration file (planner calibrate / profile)."),
    framework: FrameworkName = typer.Option(FrameworkName.torch, "--framework", help=FRAMEWORK_HELP),
    mem_headroom: float | None = typer.Option(None, "--mem-headroom", min=0, help="GiB per GPU every call leaves free, beyond what the cost model counts (context, NCCL buffers, fragmentation) [default: 1 GiB + 2.5% of the memory, 3 GiB of an 80 GiB GPU; 0 packs to the edge]."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Estimate one training iteration: time, throughput, MFU and memory per GPU.

    model_tflops_per_gpu counts 6*N + 12*L*h*s FLOPs per token (N: parameters in matmuls, LM head
    included; the attention term for full, non-causal scores; PaLM / Megatron-LM convention,
    recompute not counted); mfu divides it by the datasheet peak. With --json the object has
    iteration_s, tokens_per_s, model_flops, model_tflops_per_gpu, mfu, peak_mem_bytes,
    mem_capacity_bytes, mem_usable_bytes (the capacity less the headroom), fits, breakdown: {time_s: {kind: seconds}, memory_bytes: {kind: bytes}}, and costed_for (the stack and what backs its efficiencies).
    """
    from cost_models.calibration import load_calibration
    from cost_models.estimate import estimate_training, training_layout
    from cost_models.framework import engine_layout_problems, resolve_framework
    from plans.cluster import parse_cluster, with_headroom
    from plans.model import resolve_model

    spec = resolve_model(model)
    cl = with_headroom(parse_cluster(cluster), mem_headroom)
    cal = load_calibration(calibration) if calibration is not None else None
    layout = training_layout(spec, cl, tp=tp, pp=pp, dp=dp, cp=cp, micro_batch=micro_batch, global_batch=global_batch,
                             seq_len=seq_len, recompute=recompute.value, zero=zero, sequence_parallel=sequence_parallel,
                             interleave=interleave)
    if galore_rank is not None:
        galore = GaLore(rank=galore_rank, update_interval=galore_interval)
        try:  # the layout's own rule (`Layout.check_galore_whole_gradients`)
            layout = Layout.model_validate({**layout.model_dump(), "galore": galore})
        except ValidationError as e:
            raise PlannerError(f"--galore-rank with --tp {tp} --zero {zero}: "
                               + "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors()),
                               hint="use --zero 0 or 1") from None
    est = estimate_training(spec, cl, layout, global_batch=global_batch, seq_len=seq_len, calibration=cal,
                            framework=framework.value)
    if as_json:
        out = est.to_json()
        out.update(model=spec.display_name(), cluster=cl.short(), layout=layout.short(), framework=framework.value)
        typer.echo(json.dumps(out, sort_keys=True))
        return
    console = Console(highlight=False)
    title = escape(f"{spec.display_name()} on {cl.short()} [{layout.short()}] micro-batch {micro_batch}, seq {seq_len}")
    head = Table(title=title, show_header=False, title_justify="left")
    head.add_row("iteration", f"{est.iteration_s:.3f} s")
    head.add_row("throughput", f"{est.to_json()['tokens_per_s']:,.0f} tokens/s")
    head.add_row("model TFLOP/s per GPU", f"{est.model_tflops_per_gpu:.1f}  (6N + attention)")
    head.add_row("MFU", f"{100 * est.mfu:.1f}%")
    verdict = "fits" if est.fits else f"does NOT fit (over by {(est.peak_mem_bytes - est.mem_usable_bytes) / GIB:.1f} GiB)"
    head.add_row("peak memory per GPU", f"{est.peak_mem_bytes / GIB:.1f} of {est.mem_usable_bytes / GIB:.1f} GiB usable "
                 f"({est.mem_capacity_bytes / GIB:.0f} GiB less {cl.headroom_bytes / GIB:.1f} GiB headroom): {verdict}")
    if tp > cl.gpus_per_node:
        head.add_row("note", f"tp={tp} spans nodes of {cl.gpus_per_node} GPUs: its all-reduces cross the network")
    for why in engine_layout_problems(resolve_framework(framework.value), "train", layout):
        head.add_row("note", f"{why}; `planner compile --framework {framework.value}` keeps to what they run")
    console.print(head)
    times = Table("time", "seconds", "share", title_justify="left")
    for k, v in sorted(est.time_breakdown_s.items(), key=lambda kv: -kv[1]):
        times.add_row(k, f"{v:.3f}", f"{100 * v / est.iteration_s:.1f}%")
    mems = Table("memory", "GiB", title_justify="left")
    for k, v in sorted(est.mem_breakdown_bytes.items(), key=lambda kv: -kv[1]):
        mems.add_row(k, f"{v / GIB:.2f}")
    console.print(times)
    console.print(mems)
    console.print(f"[dim]costed for {escape(est.costed_for)}[/]")


def calibrate(
    measured: list[Path] = typer.Argument(..., help="Measured-runs CSV files (vTrain column names accepted)."),
    gpu: str = typer.Option(..., "--gpu", help="Accelerator the runs were measured on (a preset name)."),
    output: Path = typer.Option(..., "-o", "--output", help="Calibration file to write."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, max=16, help="GPUs per node of the measured cluster."),
    intra_node_gbps: float | None = typer.Option(None, "--intra-node-gbps", help="Intra-node bandwidth per GPU (default: datasheet)."),
    inter_node_gbps: float | None = typer.Option(None, "--inter-node-gbps", help="Network bandwidth per node (default: datasheet)."),
    framework: FrameworkName = typer.Option(FrameworkName.megatron, "--framework", help=FRAMEWORK_HELP),
    model_type: str = typer.Option("gpt", "--model-type", help="Family of rows without a model_type column."),
    vocab_size: int = typer.Option(51200, "--vocab-size", min=1, help="Vocabulary of rows without a vocab_size column."),
    recompute: Recompute = typer.Option(Recompute.full, "--recompute", help="Recompute of rows without a recompute column."),
    start: Path | None = typer.Option(None, "--start", help="Calibration to start the search from (default: fixed datasheet-level guesses, so a fit reproduces from its inputs)."),
    sweeps: int = typer.Option(8, "--sweeps", min=1, help="Most coordinate-search sweeps (stops early when a sweep gains < 0.01 points)."),
) -> None:
    """Fit the cost model's coefficients to measured iteration times and write a calibration.

    The fit minimises the mean over the given files of each file's mean absolute percentage
    error, so every file counts the same however many rows it has.
    """
    from cost_models.calibration import Calibration, load_calibration, save_calibration
    from cost_models.fit import START, Setup, fit, mape, predict
    from cost_models.measured import read_measured
    from plans.cluster import resolve_cluster
    from plans.hardware import gpu_spec

    gpu_spec(gpu)  # unknown GPU: clear error before reading anything
    # The node the runs were measured on, checked as a cluster (bandwidth bounds) before any work.
    resolve_cluster({"gpu": gpu, "nodes": 1, "gpus_per_node": gpus_per_node, "intra_node_gbps": intra_node_gbps,
                     "inter_node_gbps": inter_node_gbps})
    check_output(output)
    if recompute.value not in ("none", "selective", "full"):
        raise PlannerError(f"unknown recompute {recompute.value!r}")
    groups = [read_measured(p, model_type=model_type, vocab_size=vocab_size, recompute=recompute.value) for p in measured]
    setup = Setup(gpu, gpus_per_node, intra_node_gbps, inter_node_gbps, framework.value)
    base = load_calibration(start) if start is not None else Calibration(coefficients=START)
    console = Console(stderr=True, highlight=False)
    before = [mape(predict(g, base, setup), g) for g in groups]
    with console.status("fitting", spinner="dots") as status:
        cal, _ = fit(groups, base, setup, sweeps=sweeps,
                     progress=lambda name, value, obj: status.update(f"fitting: {name} = {value:.4g}, mean MAPE {obj:.2f}%"))
    after = [mape(predict(g, cal, setup), g) for g in groups]
    cmd = " ".join([f"planner calibrate {' '.join(str(p) for p in measured)} --gpu {gpu}",
                    f"--gpus-per-node {gpus_per_node}",
                    *( [f"--intra-node-gbps {intra_node_gbps:g}"] if intra_node_gbps else []),
                    *( [f"--inter-node-gbps {inter_node_gbps:g}"] if inter_node_gbps else []),
                    f"--framework {framework.value}"])
    cal = cal.model_copy(update={"gpu": None, "fitted_on": gpu, "framework": framework.value, "source": cmd,
                                 "fit": {f"mape_{Path(p).stem}": round(m, 3) for p, m in zip(measured, after)}})
    save_calibration(cal, output)
    table = Table("file", "rows", "MAPE before", "MAPE after", title=f"calibration written to {output}", title_justify="left")
    for p, g, b, a in zip(measured, groups, before, after):
        table.add_row(str(p), str(len(g)), f"{b:.2f}%", f"{a:.2f}%")
    Console(highlight=False).print(table)
    coef = Table("coefficient", "value", title_justify="left")
    for k, v in cal.coefficients.model_dump().items():
        if v is not None:  # an unset host time per backward or decode kernel is host_kernel_us
            coef.add_row(k, f"{v:.4g}")
    Console(highlight=False).print(coef)


def profile(
    output: Path = typer.Option(..., "-o", "--output", help="Calibration file to write."),
    budget_s: float = typer.Option(20.0, "--budget-s", min=0.5, max=3600, help="Rough wall-time budget of the benchmarks, seconds."),
    ranks: int = typer.Option(2, "--ranks", min=1, max=16, help="Local processes for the benchmarks between ranks: all-reduce, and on a CPU with fewer cores than their threads, how far they drift apart (1: skip). Use the ranks per node the plans will run with."),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
) -> None:
    """Micro-benchmark the local devices (GEMMs, memory, attention, all-reduce) into a calibration.

    On a CPU it also measures the planner runtime's own host costs and, when the ranks share fewer
    cores than they have threads, how far they drift apart between collectives (each collective
    then waits for the rank furthest behind). Compile with `--calibration FILE` to use it.
    """
    from cost_models.calibration import save_calibration
    from planner.profiling import profile_devices

    if device not in (None, "cpu", "cuda"):
        raise PlannerError(f"unknown device {device!r}", hint="use --device cpu or --device cuda")
    check_output(output)  # before minutes of benchmarks, not after
    console = Console(stderr=True, highlight=False)
    with console.status("profiling", spinner="dots") as status:
        cal = profile_devices(budget_s=budget_s, ranks=ranks, device=device, progress=lambda m: status.update(f"profiling: {m}"))
    save_calibration(cal, output)
    table = Table("measured", "value", title=f"calibration written to {output}", title_justify="left")
    for k, v in cal.hardware.model_dump().items():
        if v is not None:
            table.add_row(k, f"{v:.4g}")
    shown = ("attention_efficiency", "host_kernel_us") if device == "cuda" or cal.gpu != "cpu" else \
        ("elementwise_efficiency", "attention_head_us", "attention_score_ns", "host_kernel_us", "host_backward_kernel_us",
         "host_decode_kernel_us", "microbatch_overhead_ms", "step_overhead_ms", "decode_step_overhead_ms")
    for k in shown:
        table.add_row(k, f"{getattr(cal.coefficients, k):.4g}")
    Console(highlight=False).print(table)


def register(app: typer.Typer) -> None:
    app.command()(estimate)
    app.command()(calibrate)
    app.command()(profile)
