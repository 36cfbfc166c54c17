"""RLHF calls against published measurements: predicted against measured, per call kind.

Each row is a published measurement whose configuration is stated in full (model, GPU, engine and
version, batch or concurrency, input and output lengths), predicted with the cost model for the
engine it ran on, or the nearest one it has (`cost_models.framework`). None of them was used to
fit or choose anything in the cost model.

Generate, decode at one request at a time (time per output token, TPOT; the first token excluded):

- Musgrave, "vLLM throughput-latency sweep on NVIDIA A100" (johnmusgrave.com, 2026): vLLM 0.23.0,
  meta-llama/Llama-3.1-8B-Instruct BF16, one A100 40GB, no tensor parallelism, a fixed 1024-token
  input and 128-token output (``--ignore-eos``), concurrency 1: "about 75 tokens/sec".

Generate, a whole static batch (prefill, then every decode step of the batch: what an RLHF rollout
call does), output tokens per second over the call:

- TensorRT-LLM, "Performance of TensorRT-LLM" (docs/source/performance.md, v0.6.1 data), A100
  GPUs (FP16) peak-throughput table, the rows on one GPU (TP 1): GPT-J 6B and LLaMA 7B, batch
  sizes, input and output lengths as listed, measured with ``gptSessionBenchmark`` (one static
  batch per run). The A100s are SXM 80GB (the same release's blog, docs/source/blogs/H100vsA100.md).
  The rows with TP > 1 are left out: the table does not say whether their throughput is per GPU.

Inference, a forward pass over the prompt at batch 1 (first-token latency: the prefill and the
first token, what a log-prob call of one sequence costs):

- the same document's A100 GPUs (FP16) low-latency table (v0.5 data): GPT-J 6B and LLaMA 7B on
  one GPU, LLaMA 70B on 4 (TP 4), at 128 and 2048 input tokens.

TensorRT-LLM is costed with the ``vllm`` preset, the nearest engine the cost model has (fused
kernels and attention in half precision, no per-kernel host cost in decode). GPT-J is costed as a
GPT-style model of its shape (4096 wide, 28 layers, 16 heads, vocabulary 50,400): its parallel
attention and MLP and rotary embedding change neither its FLOPs nor its bytes. LLaMA 7B and 70B
are ``llama-2-7b`` and ``llama-2-70b`` (LLaMA 2 70B has the grouped KV heads the benchmark's 70B
engine was built with).

Training calls are validated in ``bench/cost_accuracy.py`` (Megatron-LM and Llama 3 tables).
What is still missing: RLHF iteration breakdowns with full configurations.

    python bench/rlhf_calls.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models import CostModel  # noqa: E402
from plans import Layout, Mesh, ModelSpec, parse_cluster, resolve_model  # noqa: E402
from plans.graph import Call, ModelDecl  # noqa: E402

TRT_DOC = "TensorRT-LLM performance.md"
GPTJ = ModelSpec(name="gpt-j-6b", model_type="gpt", hidden_size=4096, num_hidden_layers=28, num_attention_heads=16,
                 vocab_size=50400, max_position_embeddings=2048)

# (source, engine, model, cluster, concurrency, input tokens, output tokens, published TPOT ms)
DECODE = [
    ("Musgrave 2026, vLLM 0.23.0", "vllm", "llama-3-8b", "a100-40gb:1x1", 1, 1024, 128, 1000.0 / 75),
]
# (source, engine, model, cluster, batch, input tokens, output tokens, published output tokens/s)
BATCH = [
    (f"{TRT_DOC} (v0.6.1)", "vllm", "gpt-j-6b", "a100-80gb:1x1", 512, 128, 128, 6374.0),
    (f"{TRT_DOC} (v0.6.1)", "vllm", "gpt-j-6b", "a100-80gb:1x1", 60, 2048, 128, 670.0),
    (f"{TRT_DOC} (v0.6.1)", "vllm", "llama-2-7b", "a100-80gb:1x1", 384, 128, 128, 5586.0),
    (f"{TRT_DOC} (v0.6.1)", "vllm", "llama-2-7b", "a100-80gb:1x1", 60, 128, 2048, 1928.0),
    (f"{TRT_DOC} (v0.6.1)", "vllm", "llama-2-7b", "a100-80gb:1x1", 52, 2048, 128, 591.0),
]
# (source, engine, model, cluster, tp, input tokens, published first-token latency ms)
FIRST_TOKEN = [
    (f"{TRT_DOC} (v0.5)", "vllm", "gpt-j-6b", "a100-80gb:1x1", 1, 128, 12.0),
    (f"{TRT_DOC} (v0.5)", "vllm", "gpt-j-6b", "a100-80gb:1x1", 1, 2048, 129.0),
    (f"{TRT_DOC} (v0.5)", "vllm", "llama-2-7b", "a100-80gb:1x1", 1, 128, 16.0),
    (f"{TRT_DOC} (v0.5)", "vllm", "llama-2-7b", "a100-80gb:1x1", 1, 2048, 133.0),
    (f"{TRT_DOC} (v0.5)", "vllm", "llama-2-70b", "a100-80gb:1x4", 4, 128, 47.0),
    (f"{TRT_DOC} (v0.5)", "vllm", "llama-2-70b", "a100-80gb:1x4", 4, 2048, 377.0),
]


def spec_of(model: str) -> ModelSpec:
    return GPTJ if model == GPTJ.name else resolve_model(model)


def generate_cost(cm: CostModel, model: str, *, seqs: int, prompt: int, gen: int, tp: int = 1):
    """The cost of generating `gen` tokens after `prompt` for `seqs` sequences on `tp` GPUs."""
    call = Call(name="g", model="m", kind="generate", seqs=seqs, seq_len=prompt + gen, gen_len=gen)
    return cm.call_cost(call, ModelDecl(spec=spec_of(model)), Mesh.block(0, tp), Layout(tp=tp))


def decode_tpot_s(cm: CostModel, model: str, seqs: int, prompt: int, gen: int) -> float:
    """Predicted time per output token after the first: the decode steps and their overhead."""
    parts = generate_cost(cm, model, seqs=seqs, prompt=prompt, gen=gen).breakdown_s
    return (parts.get("decode", 0.0) + parts.get("tp_comm", 0.0) + parts.get("overhead", 0.0)) / (gen - 1)


def batch_tokens_s(cm: CostModel, model: str, seqs: int, prompt: int, gen: int) -> tuple[float, bool]:
    """Predicted output tokens per second of one static batch, and whether it fits in memory."""
    cost = generate_cost(cm, model, seqs=seqs, prompt=prompt, gen=gen)
    return seqs * gen / cost.time_s, cost.peak_mem_bytes <= cm.cluster.usable_mem_bytes


def first_token_s(cm: CostModel, model: str, tp: int, prompt: int) -> float:
    """Predicted time to the first token of one sequence: its prefill and one sampling step."""
    return generate_cost(cm, model, seqs=1, prompt=prompt, gen=1, tp=tp).time_s


def row(kind: str, source: str, what: str, published: float, predicted: float, unit: str, errs: list[float]) -> None:
    err = (predicted - published) / published
    errs.append(err)
    print(f"  {kind:<24} {source:<36} {what:<48} published {published:8.2f} {unit:<6} predicted {predicted:8.2f}"
          f" ({err * 100:+.1f}%)")


def main() -> None:
    print("RLHF calls: published measurements against predictions for the engine that ran them")
    by_kind: dict[str, list[float]] = {}
    for source, engine, model, cluster, seqs, prompt, gen, tpot_ms in DECODE:
        cm = CostModel(parse_cluster(cluster), framework=engine)
        row("generate (decode TPOT)", source, f"{model} on {cluster}, {prompt} in / {gen} out, concurrency {seqs}",
            tpot_ms, decode_tpot_s(cm, model, seqs, prompt, gen) * 1e3, "ms", by_kind.setdefault("generate", []))
    for source, engine, model, cluster, seqs, prompt, gen, tokens_s in BATCH:
        cm = CostModel(parse_cluster(cluster), framework=engine)
        pred, fits = batch_tokens_s(cm, model, seqs, prompt, gen)
        row("generate (batch)", source, f"{model} on {cluster}, batch {seqs}, {prompt} in / {gen} out"
            + ("" if fits else " (over memory)"), tokens_s, pred, "tok/s", by_kind.setdefault("generate", []))
    for source, engine, model, cluster, tp, prompt, ms in FIRST_TOKEN:
        cm = CostModel(parse_cluster(cluster), framework=engine)
        row("inference (first token)", source, f"{model} on {cluster} tp{tp}, batch 1, {prompt} in", ms,
            first_token_s(cm, model, tp, prompt) * 1e3, "ms", by_kind.setdefault("inference", []))
    print()
    for kind, errs in by_kind.items():
        print(f"  {kind}: mean |error| {sum(abs(e) for e in errs) / len(errs) * 100:.1f}%,"
              f" mean signed {sum(errs) / len(errs) * 100:+.1f}%, over {len(errs)} rows")


if __name__ == "__main__":
    main()
