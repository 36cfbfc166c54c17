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
kernels and attention in half precision, no per-kernel host cost in decode), running the
benchmark's one static batch (`static_rollouts`: since the vLLM stacks run their rollouts through
vLLM's scheduler, whose max_num_seqs of 256 gptSessionBenchmark does not have). GPT-J is costed as a
GPT-style model of its shape (4096 wide, 28 layers, 16 heads, vocabulary 50,400): its parallel
attention and MLP and rotary embedding change neither its FLOPs nor its bytes. LLaMA 7B and 70B
are ``llama-2-7b`` and ``llama-2-70b`` (LLaMA 2 70B has the grouped KV heads the benchmark's 70B
engine was built with).

Training calls are validated in ``bench/cost_accuracy.py`` (Megatron-LM and Llama 3 tables).

Whole GRPO iterations, step time (generation, policy and reference log-probs, training and the
weight refit between them):

- NVIDIA NeMo RL v0.5, "Performance" (docs/about/performance-summary.md at commit 108bffdab,
  2026-01-20), DGX-H100, BF16, Megatron-core training and vLLM generation colocated on every GPU,
  each row's recipe in examples/configs/recipes/llm/performance/ (grpo-llama3.1-8b-instruct-2n8g,
  grpo-qwen3-32b-4n8g, grpo-qwen3-30ba3b-4n8g) over examples/configs/grpo_math_1B.yaml at that
  commit. The on-policy rows of models the cost model can take: Llama 3.1 8B on 16 GPUs, Qwen3-32B
  and Qwen3-30B-A3B on 32. Left out: the off-policy rows (generation overlaps training, which a
  synchronous iteration does not express), DeepSeek V3 (multi-head latent attention) and Qwen3-235B
  (its recipe gives the first and last pipeline stages 11 layers each, which the planner's split
  cannot express).

The protocol, fixed before any of these rows was predicted:

- calls, in order on all GPUs: the rollout (num_prompts_per_step x num_generations_per_prompt
  samples), NeMo RL's policy log-probs of the samples (an inference call of the actor), the
  reference log-probs (reference_policy_kl_penalty 0.01: an inference call whose weights are
  copied in from host memory and back, NeMo RL's use_reference_model; `offload="weights"`), the
  training (train_global_batch_size per optimizer step: G-GBS / T-GBS mini-batches), and the
  refit of the trained weights into vLLM's layout (`CostModel.realloc_cost`). Rewards are a rule
  (math verification), not a model. The optimizer states go to host memory for the rollout and
  back (offload_before_refit / prepare_for_training under colocation: `offload="optimizer"`);
- the rollout: vLLM with the row's tensor parallelism over all GPUs, prompts of 128 tokens (the
  cot.txt template and chat template around an OpenMathInstruct-2 problem; the table gives no
  prompt length), max_new_tokens the recipe's max_total_sequence_length less the prompt,
  responses of mean G-Average Seq len less the prompt, taken as geometric (the planner's rule for a
  mean alone), in the fewest waves that fit gpu_memory_utilization 0.6 and vLLM's default
  max_num_seqs 256 (`planner.imports.vllm_waves`, as verl and OpenRLHF imports are costed; since
  the change below, those waves' cache is the KV budget vLLM's scheduler runs in, at most 256 rows
  at once);
- log-probs and training: sequence packing (the base config's, into bins of
  max_total_sequence_length x train_micro_batch_size tokens, or x logprob_batch_size), costed as
  sequences of G-Average Seq len tokens, as many per micro-batch as a bin holds (at least one);
  the recipe's tp, pp, ep and sequence parallelism, the distributed optimizer (ZeRO-1), full
  recompute where activation_checkpointing is set; MoE token dispatch as `alltoall` (the base
  config's "allgather" dispatcher is not modelled);
- the `rlhf-engine` preset (Megatron-core training, vLLM rollouts), the shipped calibration;
- predicted step time against the published Total Step time (the mean of 5 steps).

As first run (commit c3553b2): +41.8%, +32.7% and +1256.4% (Llama, Qwen3-32B, Qwen3-30B-A3B). Two
errors in carrying out the protocol were then fixed: the MoE rollout held every expert whole on each
GPU, where vLLM's tensor parallelism splits them (`planner.imports.vllm_waves` now sets etp = tp for
an MoE rollout, which verl and OpenRLHF imports of MoE models lacked too), and the rollout and
policy log-probs were costed with the actor's gradients and optimizer states resident (memory
only). Then: +41.8%, +32.7%, +6.8%; since the tensor-parallel input-gradient overlap and the refit of the
shipped coefficients (0a467ae): +43.2%, +32.8%, +7.7%, every row predicted slower than published, most of it in the
rollout, and +36.3%, +32.2%, +4.9% once the actor's q and k norms and vLLM's logits gather were priced. Its waves
were the suspect: `vllm_waves` budgets every row's KV cache at the cap (4,096 tokens), so Llama's 128
sequences per engine went in 4 waves of 32, while vLLM allocates KV blocks as tokens are made and
these responses average about 900 tokens. A comparison with waves by the tokens in flight (chosen
after the result) gave -32.4%, +9.2%, -22.4%. Then, also after seeing these rows, the vLLM stacks'
rollouts were costed as vLLM V1's scheduler runs them (`cost_models.lengths.paged_schedule`, from
vLLM's ``vllm/v1/core/sched/scheduler.py``; the waves' cache at the cap is the engine's KV budget):
-33.3%, +11.1%, -18.3%. The bench prints the rows with static waves beside them (+41.4%, +32.2%, +4.9%
since a call lasts as long as its slowest engine: the wave that drew the longest response of all). Llama's rollout is
one pass of 3,967 steps (its longest response reaches the cap), 37.7 s, so its step's missing 31 s
are not in the rollout's GPU work as modelled.

    python bench/rlhf_calls.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models import CostModel, Framework  # noqa: E402
from cost_models.framework import resolve_framework  # noqa: E402
from plans import Layout, Mesh, ModelSpec, parse_cluster, resolve_model  # noqa: E402
from plans.graph import Call, ModelDecl, ResponseLengths  # noqa: E402

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


NEMO_RL = "NeMo RL v0.5 (H100 BF16)"
NEMO_PROMPT = 128  # tokens per prompt (the protocol's assumption: the table gives none)
NEMO_VLLM_MEMORY = 0.6  # grpo_math_1B.yaml: generation.vllm_cfg.gpu_memory_utilization
NEMO_MAX_NUM_SEQS = 256  # vLLM's default (the recipes set none)
# (model, GPUs, prompts, samples, T-GBS, max_total_sequence_length, train_micro_batch_size,
#  logprob_batch_size, G-Average Seq len, vLLM tp, training (tp, pp, ep, sequence parallel),
#  activation checkpointing, published step s)
NEMO_GRPO = [
    ("llama-3.1-8b", 16, 64, 32, 512, 4096, 1, 2, 1019, 1, (1, 2, 1, False), True, 92.8),
    ("qwen3-32b", 32, 64, 32, 512, 4096, 1, 4, 3251, 4, (4, 4, 1, True), False, 376.0),
    ("qwen3-30b-a3b", 32, 64, 32, 512, 4096, 1, 4, 3196, 2, (1, 1, 8, False), False, 198.0),
]


def static_rollouts(name: str) -> Framework:
    """`name`'s stack with its rollouts in static waves, each row's KV cache held at the length
    cap (how every stack's generation was costed before vLLM's scheduler was simulated), or, for
    TensorRT-LLM's `gptSessionBenchmark`, the one static batch it runs."""
    return dataclasses.replace(resolve_framework(name), paged_kv=False, max_num_seqs=None)


def nemo_rl_step(row: tuple, *, static: bool = False) -> tuple[float, dict[str, float], bool]:
    """One NeMo RL GRPO row costed by the protocol above: (step s, seconds per part, fits); with
    `static`, its rollout in static waves (`static_rollouts`)."""
    from planner.algorithms import grpo
    from planner.imports import vllm_waves

    (model, gpus, prompts, samples, tgbs, max_total, train_mb, lp_mb, avg_len, gen_tp, (tp, pp, ep, sp),
     ckpt, _) = row
    cluster = parse_cluster(f"h100-sxm:{gpus // 8}x8")
    cm = CostModel(cluster, framework=static_rollouts("rlhf-engine") if static else "rlhf-engine")
    spec = resolve_model(model)
    # The rollout and the log-probs run on the weights alone (the planner's `costed_view`).
    actor, ref = ModelDecl(spec=spec, trainable=True), ModelDecl(spec=spec)
    mesh = Mesh.block(0, gpus)
    rows = prompts * samples
    gen_len = max_total - NEMO_PROMPT
    mean = ResponseLengths(mean=avg_len - NEMO_PROMPT, source="NeMo RL G-Average Seq len less the prompt")
    graph = grpo(model, reward_fn="math:verify", batch=prompts, samples_per_prompt=samples, prompt_len=NEMO_PROMPT,
                 gen_len=gen_len)
    graph = graph.model_copy(update={"calls": [c.model_copy(update={"response_len": mean}) if c.kind == "generate"
                                               else c for c in graph.calls]})
    gen_layout, _ = vllm_waves(graph, cluster, "actor_generate", mesh, Layout(dp=gpus // gen_tp, tp=gen_tp),
                               memory_share=NEMO_VLLM_MEMORY, max_num_seqs=NEMO_MAX_NUM_SEQS)
    generate = graph.call("actor_generate")
    dp = gpus // (tp * pp)
    minibatches = rows // tgbs

    def packed(bin_seqs: int, per_rank: int) -> int:
        """Micro-batches of a rank's `per_rank` sequences, `bin_seqs` sequences of bins' tokens each."""
        per_bin = max(1, bin_seqs * max_total // avg_len)
        return -(-per_rank // per_bin)

    base = Layout(dp=dp, tp=tp, pp=pp, ep=ep, zero=1, sequence_parallel=sp)
    train = base.model_copy(update={"micro_batches": packed(train_mb, tgbs // dp), "offload": "optimizer",
                                    "recompute": "full" if ckpt else "none"})
    logprob = Layout(dp=dp, tp=tp, pp=pp, ep=ep, sequence_parallel=sp, micro_batches=packed(lp_mb, rows // dp))
    calls = {
        "rollout": cm.call_cost(generate, ref, mesh, gen_layout),
        "policy log-probs": cm.call_cost(Call(name="lp", model="actor", kind="inference", seqs=rows, seq_len=avg_len,
                                              returns="logprobs"), ref, mesh, logprob),
        "reference log-probs": cm.call_cost(Call(name="ref", model="ref", kind="inference", seqs=rows, seq_len=avg_len,
                                                 returns="logprobs"), ref, mesh,
                                            logprob.model_copy(update={"offload": "weights"})),
        "training": cm.call_cost(Call(name="train", model="actor", kind="train", seqs=rows, seq_len=avg_len,
                                      loss="grpo", minibatches=minibatches), actor, mesh, train),
    }
    parts = {k: c.time_s for k, c in calls.items()}
    parts["refit"] = cm.realloc_cost(actor, (mesh, train), (mesh, gen_layout)).time_s
    fits = all(c.peak_mem_bytes <= cluster.usable_mem_bytes for c in calls.values())
    return sum(parts.values()), parts, fits


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
        cm = CostModel(parse_cluster(cluster), framework=static_rollouts(engine))  # one static batch
        pred, fits = batch_tokens_s(cm, model, seqs, prompt, gen)
        row("generate (batch)", source, f"{model} on {cluster}, batch {seqs}, {prompt} in / {gen} out"
            + ("" if fits else " (over memory)"), tokens_s, pred, "tok/s", by_kind.setdefault("generate", []))
    for source, engine, model, cluster, tp, prompt, ms in FIRST_TOKEN:
        cm = CostModel(parse_cluster(cluster), framework=static_rollouts(engine))
        row("inference (first token)", source, f"{model} on {cluster} tp{tp}, batch 1, {prompt} in", ms,
            first_token_s(cm, model, tp, prompt) * 1e3, "ms", by_kind.setdefault("inference", []))
    for r in NEMO_GRPO:
        step, parts, fits = nemo_rl_step(r)
        model, gpus, prompts, samples = r[:4]
        what = (f"{model} on h100-sxm x{gpus}, {prompts} x {samples} samples" + ("" if fits else " (over memory)"))
        row("iteration (GRPO step)", NEMO_RL, what, r[-1], step, "s", by_kind.setdefault("iteration", []))
        print("    " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    static = [(nemo_rl_step(r, static=True)[0] - r[-1]) / r[-1] for r in NEMO_GRPO]
    print("  the same iterations with the rollouts in static waves, every row's KV cache at the cap (as costed "
          "before vLLM's scheduler was simulated): " + ", ".join(f"{r[0]} {e * 100:+.1f}%" for r, e in zip(NEMO_GRPO, static)))
    print()
    for kind, errs in by_kind.items():
        print(f"  {kind}: mean |error| {sum(abs(e) for e in errs) / len(errs) * 100:.1f}%,"
              f" mean signed {sum(errs) / len(errs) * 100:+.1f}%, over {len(errs)} rows")


if __name__ == "__main__":
    main()
