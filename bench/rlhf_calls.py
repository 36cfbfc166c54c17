"""RLHF calls against published measurements: predicted against measured, per call kind.

Each row is a published measurement whose configuration is stated in full (model, GPU, engine and
version, batch or concurrency, input and output lengths), predicted with the cost model for the
engine it ran on (`cost_models.framework`: ``vllm`` for vLLM generation). None of them was used
to fit or choose anything in the cost model.

Generate, decode at one request at a time (time per output token, TPOT; the first token excluded):

- Musgrave, "vLLM throughput-latency sweep on NVIDIA A100" (johnmusgrave.com, 2026): vLLM 0.23.0,
  meta-llama/Llama-3.1-8B-Instruct BF16, one A100 40GB, no tensor parallelism, a fixed 1024-token
  input and 128-token output (``--ignore-eos``), concurrency 1: "about 75 tokens/sec".

Training calls are validated in ``bench/cost_accuracy.py`` (Megatron-LM and Llama 3 tables).
What is still missing: published inference (log-prob) and iteration breakdowns of RLHF runs
with full configurations.

    python bench/rlhf_calls.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models import CostModel  # noqa: E402
from plans import Layout, Mesh, parse_cluster, resolve_model  # noqa: E402
from plans.graph import Call, ModelDecl  # noqa: E402

# (source, engine, model, cluster, concurrency, input tokens, output tokens, published TPOT ms)
DECODE = [
    ("Musgrave 2026, vLLM 0.23.0", "vllm", "llama-3-8b", "a100-40gb:1x1", 1, 1024, 128, 1000.0 / 75),
]


def decode_tpot_s(cm: CostModel, model: str, seqs: int, prompt: int, gen: int) -> float:
    """Predicted time per output token after the first: the decode steps and their overhead."""
    call = Call(name="g", model="m", kind="generate", seqs=seqs, seq_len=prompt + gen, gen_len=gen)
    cost = cm.call_cost(call, ModelDecl(spec=resolve_model(model)), Mesh.block(0, 1), Layout())
    parts = cost.breakdown_s
    return (parts.get("decode", 0.0) + parts.get("tp_comm", 0.0) + parts.get("overhead", 0.0)) / (gen - 1)


def main() -> None:
    print("generate: decode time per output token at concurrency 1 (published, predicted for the engine)")
    errs = []
    for source, engine, model, cluster, seqs, prompt, gen, tpot_ms in DECODE:
        cm = CostModel(parse_cluster(cluster), framework=engine)
        pred = decode_tpot_s(cm, model, seqs, prompt, gen) * 1e3
        err = (pred - tpot_ms) / tpot_ms
        errs.append(err)
        print(f"  {source:<30} {model} on {cluster}, {prompt} in / {gen} out: published {tpot_ms:6.2f} ms,"
              f" predicted {pred:6.2f} ms ({err * 100:+.1f}%)")
    print(f"  mean |error| {sum(abs(e) for e in errs) / len(errs) * 100:.1f}% over {len(errs)} row(s)")


if __name__ == "__main__":
    main()
