"""Single-GPU calls of the runtime against transformers, beside the cost model's prediction.

    python bench/gpu_check.py --out REPORT.json            # on a CUDA machine (bench/gpu_check.sh runs it)
    python bench/gpu_check.py --device cpu --quick --out r.json   # the same code on a tiny model, on CPU

A Llama-shape model (1.2B parameters: hidden 2048, 16 layers, 32 query heads over 8 key/value
heads, vocabulary 32000) in bf16 on one GPU, the same weights in the runtime and in
transformers (sdpa attention):

- generate: greedy, KV cache, 16 prompts x 128 tokens + 128 new tokens (decode steps as CUDA
  graphs; `generate_eager_decode` is the same call with the steps issued from Python);
- inference: per-token log-probs of 8 x 1024 tokens;
- train: forward, backward and AdamW over 4 x 1024 tokens.

Each is timed with CUDA events (median of 3 after a warm-up), with the peak of
`torch.cuda.max_memory_allocated` over the call; the cost model's prediction for `h200:1x1` (time
and peak memory of that call on that layout) is written beside each. One JSON report, so the
numbers can be committed under bench/results/ and used to calibrate the `torch` framework.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

SPEC = ("model_type=llama,hidden_size=2048,num_hidden_layers=16,num_attention_heads=32,num_key_value_heads=8,"
        "intermediate_size=8192,vocab_size=32000,max_position_embeddings=4096,tie_word_embeddings=false")
QUICK = ("model_type=llama,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
         "intermediate_size=128,vocab_size=512,max_position_embeddings=256,tie_word_embeddings=false")
LR = 1e-5


class Timer:
    """Wall time of a callable: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:  # noqa: ANN001
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3


def measure(fn, timer: Timer, device: torch.device, repeats: int) -> dict[str, float]:  # noqa: ANN001
    fn()  # warm-up (kernels, allocator, caches)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = [timer(fn) for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {"median_s": statistics.median(times), "min_s": min(times), "peak_mem_bytes": peak}


def predictions(spec, shapes: dict[str, dict]) -> dict[str, dict]:  # noqa: ANN001
    """The cost model's time and peak memory of each call on one H200 (layout dp1 tp1 pp1)."""
    from cost_models import CostModel
    from plans.cluster import parse_cluster
    from plans.graph import Call, ModelDecl
    from plans.layout import Layout, Mesh

    cm = CostModel(parse_cluster("h200:1x1"))
    out = {}
    for name, sh in shapes.items():
        kind = {"generate": "generate", "inference": "inference", "train": "train"}[name]
        call = Call(name=name, model="m", kind=kind, seqs=sh["batch"], seq_len=sh["seq_len"],
                    gen_len=sh.get("gen_len", 0), returns="logprobs" if kind == "inference" else None,
                    loss="sft" if kind == "train" else None)
        decl = ModelDecl(spec=spec, trainable=kind == "train")
        cost = cm.call_cost(call, decl, Mesh.block(0, 1), Layout())
        out[name] = {"time_s": cost.time_s, "peak_mem_bytes": int(cost.peak_mem_bytes)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--quick", action="store_true", help="a tiny model and batch (a smoke test of this script)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import transformers

    from plans import AlgorithmConfig, Layout, resolve_model
    from runtime.engine import ModelRunner
    from runtime.groups import solo_groups
    from runtime.losses import make_loss
    from runtime.model import init_tensor
    from runtime.weights import hf_config, hf_tensors

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --quick for the CPU smoke run", file=sys.stderr)
        return 2
    spec = resolve_model(QUICK if args.quick else SPEC)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = {"batch": 2, "prompt": 8, "gen": 4} if args.quick else {"batch": 16, "prompt": 128, "gen": 128}
    inf = {"batch": 2, "seq_len": 16} if args.quick else {"batch": 8, "seq_len": 1024}
    tr = {"batch": 2, "seq_len": 16} if args.quick else {"batch": 4, "seq_len": 1024}
    shapes = {"generate": {"batch": g["batch"], "seq_len": g["prompt"] + g["gen"], "gen_len": g["gen"]},
              "inference": inf, "train": tr}
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, spec.vocab_size, (g["batch"], g["prompt"]), generator=gen).to(device)
    itoks = torch.randint(0, spec.vocab_size, (inf["batch"], inf["seq_len"]), generator=gen).to(device)
    ttoks = torch.randint(0, spec.vocab_size, (tr["batch"], tr["seq_len"]), generator=gen).to(device)
    mask = torch.ones(tr["batch"], tr["seq_len"] - 1, dtype=torch.bool, device=device)
    timer = Timer(device)
    report: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                    "torch": torch.__version__, "transformers_version": transformers.__version__, "dtype": str(dtype),
                    "model": {"spec": SPEC if not args.quick else QUICK, "params": spec.num_params()},
                    "shapes": shapes, "runtime": {}, "transformers": {}}

    def runtime_calls() -> dict[str, Tensor]:
        """Measure the runtime's calls; its weights after them (for transformers), on the host."""
        runner = ModelRunner(spec, head="lm", trainable=True, groups=solo_groups(Layout()),
                             state=lambda p: init_tensor(p, seed=0), device=device, dtype=dtype)
        loss = make_loss("sft", AlgorithmConfig())
        def eager_generate() -> None:  # the decode steps issued from Python, for the graphs' effect
            import runtime.generate as gen
            gen.CUDA_GRAPHS = False
            try:
                runner.generate(prompts, gen_len=g["gen"], temperature=0.0, seed=0)
            finally:
                gen.CUDA_GRAPHS = True

        calls = {
            "generate": lambda: runner.generate(prompts, gen_len=g["gen"], temperature=0.0, seed=0),
            "generate_eager_decode": eager_generate,
            "inference": lambda: runner.forward(itoks, what="logprobs"),
            "train": lambda: runner.train({"tokens": ttoks, "mask": mask}, loss=loss, denoms=[float(mask.numel())],
                                          lr=LR),
        }
        for name, fn in calls.items():
            report["runtime"][name] = measure(fn, timer, device, args.repeats)
            print(f"runtime      {name:10s} {report['runtime'][name]}", flush=True)
        return {n: p.detach().float().cpu() for n, p in runner.shard.params.items()}

    state = runtime_calls()  # the runner is freed on return
    ours = ("generate", "inference", "train")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cfg = transformers.AutoConfig.for_model(**hf_config(spec, head="lm"))
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    hf.load_state_dict(hf_tensors(spec, state, hf_type="llama"), strict=False)
    hf = hf.to(device=device, dtype=dtype)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0, fused=device.type == "cuda")

    def hf_train() -> None:
        opt.zero_grad(set_to_none=True)
        logits = hf(ttoks).logits[:, :-1].float()
        (-torch.log_softmax(logits, -1).gather(-1, ttoks[:, 1:, None]).mean()).backward()
        opt.step()

    def hf_inf() -> None:
        with torch.no_grad():
            torch.log_softmax(hf(itoks).logits[:, :-1].float(), -1).gather(-1, itoks[:, 1:, None])

    def hf_gen() -> None:
        with torch.no_grad():
            hf.generate(prompts, max_new_tokens=g["gen"], min_new_tokens=g["gen"], do_sample=False,
                        attention_mask=torch.ones_like(prompts))

    for name, fn in (("generate", hf_gen), ("inference", hf_inf), ("train", hf_train)):
        report["transformers"][name] = measure(fn, timer, device, args.repeats)
        print(f"transformers {name:10s} {report['transformers'][name]}", flush=True)
    report["predicted_h200"] = predictions(spec, shapes)
    report["ratios"] = {k: report["runtime"][k]["median_s"] / report["transformers"][k]["median_s"]
                        for k in ours}
    report["measured_over_predicted"] = {k: report["runtime"][k]["median_s"] / report["predicted_h200"][k]["time_s"]
                                         for k in ours}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(json.dumps({"ratios runtime/transformers": report["ratios"],
                      "measured/predicted": report["measured_over_predicted"]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
