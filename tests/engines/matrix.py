"""The plans `make test-engines` exports, and what the engine tests read (run in the project's venv).

    python -m tests.engines.matrix OUT

writes, under OUT:
- ``models/NAME/``: an HF directory per model of the matrix (config.json from the plan's spec and a
  small tokenizer; no weights: the engines' config checks read the config and the tokenizer only);
- ``plans/PLAN.json``: each plan of the matrix, its models pointing at those directories;
- ``exports/PLAN.TARGET.json``: `planner export --json` of each plan to each target, or the
  refusal (``{"refused": message}``) when the target cannot run the plan.

The matrix: SFT 7B and 70B, PPO 7B, 13B and 70B, GRPO 7B, DPO 7B as compiled (and PPO 7B twice,
GRPO Mixtral and PPO 13B compiled for the RLHF engines' stacks), plus layout
variants of them (tp, pp with interleaving and uneven stages, ZeRO-1/2/3, sequence parallel,
context parallel, recompute) that the search may not pick but users do. Plans compile with beam
search only (deterministic, seconds each).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from planner.algorithms import dpo, grpo, ppo, sft
from planner.candidates import offload_kind
from planner.compile import compile_graph
from planner.exports import EXPORTERS, export_plan
from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.layout import Layout
from plans.plan import Plan

PER_CALL = ("megatron", "deepspeed")
TOKENS = ["<pad>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]


def _compile(graph, cluster: str, framework: str = "torch") -> Plan:  # noqa: ANN001
    return compile_graph(graph, parse_cluster(cluster), time_limit_s=0, framework=framework)


def _relayout(plan: Plan, layouts: dict[str, Layout], name: str) -> Plan:
    data = plan.model_dump(mode="json")
    data["name"] = name
    for c in data["calls"]:
        if c["name"] in layouts:
            c["layout"] = layouts[c["name"]].model_dump(mode="json")
            c["decode_layout"] = None
            c["mesh"] = {"ranks": c["mesh"]["ranks"][:layouts[c["name"]].size]} if \
                len(c["mesh"]["ranks"]) >= layouts[c["name"]].size else {"ranks": list(range(layouts[c["name"]].size))}
    data["reallocations"] = []  # the runtime's concern; exports read meshes and layouts
    data["transfers"] = []
    return Plan.model_validate(data)


def plans() -> dict[str, Plan]:
    sft7 = _compile(sft("llama-2-7b", batch=256, seq_len=4096, name="sft_7b"), "a100-80gb:2x8")
    sft70 = _compile(sft("llama-3-70b", batch=512, seq_len=4096, name="sft_70b"), "h100-sxm:8x8")
    ppo7 = _compile(ppo("llama-2-7b", critic="llama-2-7b", reward="llama-2-7b", batch=512, prompt_len=1024,
                        gen_len=1024, name="ppo_7b"), "a100-80gb:2x8")
    ppo13 = _compile(ppo("llama-2-13b", critic="llama-2-13b", reward="llama-2-13b", batch=512, prompt_len=1024,
                         gen_len=1024, name="ppo_13b"), "h100-sxm:2x8")
    ppo70 = _compile(ppo("llama-3-70b", critic="llama-3-8b", reward="llama-3-8b", batch=512, prompt_len=1024,
                         gen_len=1024, name="ppo_70b"), "h100-sxm:8x8")
    grpo7 = _compile(grpo("qwen2.5-7b", reward_fn="runtime.tasks:pattern_reward", batch=64, prompt_len=512,
                          gen_len=1024, samples_per_prompt=8, name="grpo_7b"), "h100-sxm:1x8")
    dpo7 = _compile(dpo("llama-2-7b", batch=128, seq_len=2048, name="dpo_7b"), "a100-80gb:1x8")
    # Mixtures of experts: Qwen3-30B-A3B SFT (Megatron-LM; per-head q/k norms, heads wider than
    # hidden / heads) and Mixtral GRPO (verl, OpenRLHF).
    sft_moe = _compile(sft("qwen3-30b-a3b", batch=256, seq_len=4096, name="sft_qwen3_moe"), "h100-sxm:2x8")
    grpo_moe = _compile(grpo("mixtral-8x7b", reward_fn="runtime.tasks:pattern_reward", batch=64, prompt_len=512,
                             gen_len=1024, samples_per_prompt=8, name="grpo_mixtral"), "h100-sxm:2x8")
    # Long context: Llama 3.1's RoPE scaling at 16k tokens; Mistral's sliding window (4096) shorter
    # than the sequence.
    sft_llama31 = _compile(sft("llama-3.1-8b", batch=64, seq_len=16384, name="sft_llama31"), "h100-sxm:1x8")
    sft_mistral = _compile(sft("mistral-7b-v0.1", batch=128, seq_len=8192, name="sft_mistral"), "h100-sxm:1x8")
    # Compiled for the RLHF engines' own stacks (`--framework`), which keep to the layouts they run:
    # OpenRLHF (rlhf-engine-hf), verl's FSDP workers (verl-fsdp) and its Megatron workers (rlhf-engine);
    # with the actor's log-probs recomputed before training, as `planner compile` adds for them.
    ppo7_hf = _compile(ppo("llama-2-7b", critic="llama-2-7b", reward="llama-2-7b", batch=512, prompt_len=1024,
                           gen_len=1024, name="ppo_7b_hf", policy_logprobs=True), "a100-80gb:2x8", "rlhf-engine-hf")
    grpo_moe_hf = _compile(grpo("mixtral-8x7b", reward_fn="runtime.tasks:pattern_reward", batch=64, prompt_len=512,
                                gen_len=1024, samples_per_prompt=8, name="grpo_mixtral_hf", policy_logprobs=True),
                           "h100-sxm:2x8", "rlhf-engine-hf")
    ppo13_verl = _compile(ppo("llama-2-13b", critic="llama-2-13b", reward="llama-2-13b", batch=512, prompt_len=1024,
                              gen_len=1024, name="ppo_13b_verl", policy_logprobs=True), "h100-sxm:2x8", "rlhf-engine")
    ppo7_fsdp = _compile(ppo("llama-2-7b", critic="llama-2-7b", reward="llama-2-7b", batch=512, prompt_len=1024,
                             gen_len=1024, name="ppo_7b_verl_fsdp", policy_logprobs=True), "a100-80gb:2x8", "verl-fsdp")
    out = {p.name: p for p in (sft7, sft70, ppo7, ppo13, ppo70, grpo7, dpo7, sft_moe, grpo_moe, sft_llama31,
                               sft_mistral, ppo7_hf, grpo_moe_hf, ppo13_verl, ppo7_fsdp)}
    variants = {
        "sft_7b_tp2_sp_z1": (sft7, {"model_train": Layout(dp=8, tp=2, zero=1, micro_batches=16,
                                                          sequence_parallel=True)}),
        "sft_7b_z3_full": (sft7, {"model_train": Layout(dp=16, zero=3, micro_batches=8, recompute="full")}),
        "sft_7b_dp_z1": (sft7, {"model_train": Layout(dp=16, zero=1, micro_batches=8)}),
        "sft_70b_pp_interleave": (sft70, {"model_train": Layout(dp=4, tp=8, pp=2, interleave=5, zero=1,
                                                                micro_batches=128, recompute="full",
                                                                sequence_parallel=True)}),
        "sft_70b_cp2_z2": (sft70, {"model_train": Layout(dp=8, tp=4, cp=2, zero=2, micro_batches=64,
                                                         recompute="selective", sequence_parallel=True)}),
        # ZeRO over the context-parallel ranks alone (dp 1): the distributed optimizer over dp x cp.
        "sft_llama31_cp8_z1": (sft_llama31, {"model_train": Layout(cp=8, zero=1, micro_batches=64,
                                                                   recompute="selective")}),
        "sft_70b_uneven_pp": (sft70, {"model_train": Layout(tp=2, pp=32, micro_batches=64, sequence_parallel=True)}),
        "ppo_7b_colocated_z3": (ppo7, _colocated(ppo7, Layout(dp=16, zero=3, micro_batches=4))),
        "ppo_7b_colocated_tp2_z1": (ppo7, _colocated(ppo7, Layout(dp=8, tp=2, zero=1, micro_batches=4,
                                                                  sequence_parallel=True))),
        "grpo_7b_z3": (grpo7, _colocated(grpo7, Layout(dp=8, zero=3, micro_batches=16))),
        "sft_qwen3_moe_ep8": (sft_moe, {"model_train": Layout(dp=8, tp=2, ep=8, zero=1, micro_batches=8,
                                                              recompute="full", sequence_parallel=True)}),
        "sft_qwen3_moe_etp": (sft_moe, {"model_train": Layout(dp=4, tp=4, ep=4, etp=4, micro_batches=16,
                                                              sequence_parallel=True)}),
        "grpo_mixtral_ep": (grpo_moe, _colocated(grpo_moe, Layout(dp=8, tp=2, ep=8, zero=1, micro_batches=16,
                                                                  sequence_parallel=True))),
        "grpo_7b_tp2_z1": (grpo7, _colocated(grpo7, Layout(dp=4, tp=2, zero=1, micro_batches=16,
                                                           sequence_parallel=True))),
        # States in host memory between calls: the trained models' optimizers, the frozen ones' weights.
        "ppo_7b_colocated_offload": (ppo7, _offloaded(ppo7, _colocated(ppo7, Layout(dp=16, zero=1, micro_batches=4)))),
        "grpo_7b_z3_offload": (grpo7, _offloaded(grpo7, _colocated(grpo7, Layout(dp=8, zero=3, micro_batches=16)))),
    }
    for name, (base, layouts) in variants.items():
        out[name] = _relayout(base, layouts, name)
    return out


def _colocated(plan: Plan, train: Layout) -> dict[str, Layout]:
    """Every call of the plan on all its GPUs: trains with `train`, the others with its degrees."""
    out = {}
    for c in plan.calls:
        # Forward calls share the training degrees; under ZeRO-3 their parameters stay sharded too
        # (FSDP), except generation, which an engine runs on its own full copy.
        zero = 3 if train.zero == 3 and c.kind == "inference" else 0
        out[c.name] = train if c.kind == "train" else Layout(dp=train.dp, tp=train.tp, pp=train.pp, zero=zero,
                                                              micro_batches=1, ep=train.ep, etp=train.etp)
    return out


def _offloaded(plan: Plan, layouts: dict[str, Layout]) -> dict[str, Layout]:
    """`layouts` with every home call keeping in host memory what it may (`Layout.offload`)."""
    graph = plan.graph()
    homes = graph.home_calls()
    out = dict(layouts)
    for c in plan.calls:
        kind = offload_kind(c, graph)
        if kind is not None and homes[c.model] == c.name and c.name in out:
            out[c.name] = out[c.name].model_copy(update={"offload": kind})
    return out


def write_model(directory: Path, plan: Plan, model: str) -> None:
    """An HF directory with the model's config.json and a character-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from runtime.weights import hf_config

    decl = plan.models[model]
    directory.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(decl.spec, head=decl.head)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "pad_token": "<pad>"}, indent=2) + "\n")


def with_directories(plan: Plan, root: Path) -> Plan:
    data = plan.model_dump(mode="json")
    for name, decl in data["models"].items():
        path = root / "models" / f"{plan.name}.{name}"
        write_model(path, plan, name)
        decl["weights"] = str(path.resolve())
    return Plan.model_validate(data)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    (root / "plans").mkdir(parents=True, exist_ok=True)
    (root / "exports").mkdir(parents=True, exist_ok=True)
    for name, plan in plans().items():
        plan = with_directories(plan, root)
        (root / "plans" / f"{name}.json").write_text(plan.model_dump_json(indent=2) + "\n")
        for target in EXPORTERS:
            # Megatron-LM and DeepSpeed configure one model's training: one export per train call.
            calls = [c.name for c in plan.calls if c.kind == "train"] if target in PER_CALL else [None]
            for call in calls:
                try:
                    exp = export_plan(plan, target, call=call)
                    doc = {**exp.to_json(), "text": exp.text}
                except PlannerError as e:
                    doc = {"refused": e.message}
                stem = f"{name}.{target}" + (f".{call}" if call else "")
                (root / "exports" / f"{stem}.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        print(f"{name}: {len(plan.calls)} calls on {plan.cluster.world_size} GPUs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
