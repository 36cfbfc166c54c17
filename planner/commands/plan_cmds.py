"""Commands on plans: compile, show, validate, compare, schema."""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.console import Console
from rich.markup import escape

from plans.errors import PlannerError
from plans.layout import GaLore

if TYPE_CHECKING:
    from planner.candidates import SearchSpace

COMPILE_HELP = """Compile a graph file or a built-in algorithm into a plan.

TARGET is a Python file that defines `graph` (or `build()`) or a training loop decorated with
@planner.auto (traced; the plan goes to the decorator's plan path and is reused by the loop while
it is unchanged), or one of the algorithms sft, dpo, ppo, grpo, remax, rloo, configured by the
flags below.

Examples:

  planner compile examples/ppo_llama7b.py

  planner compile examples/train_loop_ppo.py

  planner compile ppo --actor llama-2-7b --cluster a100-80gb:2x8 --batch 512 --prompt-len 1024 --gen-len 1024

  planner compile grpo --actor qwen2.5-7b --cluster h100-sxm:1x8 --samples-per-prompt 8 --json

  planner compile sft --actor llama-3-70b --cluster h100-sxm:8x8 --batch 512 --seq-len 4096

  planner compile grpo --actor ./models/actor --data data/train.jsonl --extra-keys ground_truth --reward-fn mypkg.rewards:score --cluster cpu:1x4

A graph file is Python code: compiling it runs it, as `python FILE` would, so compile only files
you trust (its print() output goes to stderr). A plan, in contrast, is data: the runtime never
runs code a plan names (algorithm.reward_fn) unless the launch names the same code too
(--reward-fn), and `planner validate` lists it.

A SPEC is a preset (llama-2-7b, qwen2.5-7b, ...), a config.json path, or inline HF fields
(model_type=llama,hidden_size=4096,...). A CLUSTER is GPU:NODESxGPUS_PER_NODE
(h100-sxm:2x8, a100-80gb:16x8,inter_node_gbps=800) or a .yaml/.json file.
"""


class Baseline(str, Enum):
    # Upper-case names: a member named `split` would shadow str.split on every member.
    COLOCATE = "colocate"
    SPLIT = "split"
    HEURISTIC = "heuristic"


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte: not a file
        return False


def _graph_from_target(target: str, *, actor: str | None, critic: str | None, ref: str | None, reward: str | None,
                       reward_fn: str | None, batch: int | None, prompt_len: int | None, gen_len: int | None,
                       seq_len: int | None, samples_per_prompt: int | None, ppo_minibatches: int | None,
                       function: str | None = None, data: dict | None = None,
                       lr: float | None = None, stop: list[str] | None = None,
                       policy_logprobs: bool | None = None, stack_recomputes: bool = False,
                       stack_name: str = "torch"):  # noqa: ANN202
    """The graph a compile target names, and what was added to a graph file's; `policy_logprobs`
    is the flag as given (None: the stack's way, `stack_recomputes`)."""
    from planner.algorithms import ALGORITHMS
    from planner.loader import LoadedGraph, load_target

    if target.endswith(".py") or _is_file(target):
        if data is not None or lr is not None or stop:
            raise PlannerError("--data, --lr and --stop configure a built-in algorithm; a graph file declares its own",
                               hint="in the graph file: g.input('prompts', data='train.jsonl', key='prompt')")
        loaded = load_target(target, function=function)
        return _graph_file_logprobs(loaded, target, policy_logprobs=policy_logprobs, stack_recomputes=stack_recomputes,
                                    stack_name=stack_name)
    if function is not None:
        raise PlannerError(f"--function picks a @planner.auto loop of a graph file; {target!r} is not a file")
    if target not in ALGORITHMS:
        raise PlannerError(f"{target!r} is neither a graph file nor an algorithm",
                           hint=f"algorithms: {', '.join(ALGORITHMS)}; graph files end in .py")
    if actor is None:
        raise PlannerError(f"algorithm {target} needs --actor SPEC")
    kw: dict = {"batch": batch or 512, "data": data, **({"lr": lr} if lr else {}), **({"stop": stop} if stop else {})}
    if target in ("sft", "dpo"):
        if policy_logprobs:
            raise PlannerError(f"--policy-logprobs: {target} generates nothing, so it has no policy log-probs to "
                               "recompute", hint="drop --policy-logprobs")
        kw["seq_len"] = seq_len or 2048
        if target == "dpo" and ref:
            kw["ref"] = ref
    else:
        kw.update(prompt_len=prompt_len or 1024, gen_len=gen_len or 1024, ref=ref, reward=reward, reward_fn=reward_fn)
        if target == "ppo":
            kw["critic"] = critic
        if target in ("grpo", "rloo") and samples_per_prompt:
            kw["samples_per_prompt"] = samples_per_prompt
        if ppo_minibatches:
            kw["ppo_minibatches"] = ppo_minibatches
        kw["policy_logprobs"] = stack_recomputes if policy_logprobs is None else policy_logprobs
    return LoadedGraph(ALGORITHMS[target](actor, **kw), None), []  # type: ignore[operator]


def _graph_file_logprobs(loaded, target: str, *, policy_logprobs: bool | None,  # noqa: ANN001, ANN202
                         stack_recomputes: bool, stack_name: str):
    """A graph file's graph with the recomputed log-probs the stack runs (`with_policy_logprobs`),
    and a note per call added; a traced loop's calls are the loop's own, so it only gets a note."""
    import dataclasses

    from planner.algorithms import rl_trains, with_policy_logprobs

    if policy_logprobs is False or (policy_logprobs is None and not stack_recomputes):
        return loaded, []
    if policy_logprobs and loaded.auto is not None:
        raise PlannerError(f"--policy-logprobs with {target}: a @planner.auto loop's calls are the ones it makes",
                           hint="make the call in the loop: old = actor.inference(samples), then pass old to the "
                                "train call")
    if policy_logprobs and not rl_trains(loaded.graph):
        raise PlannerError(f"--policy-logprobs: no train call of {target} with an RL loss (ppo_policy, grpo, rloo, "
                           "remax) takes as its first input samples its own model generated",
                           hint="drop --policy-logprobs")
    graph, added = with_policy_logprobs(loaded.graph)
    why = (f"{stack_name} recomputes a generating model's log-probs of its samples before training it, as verl "
           "and OpenRLHF do" if policy_logprobs is None else "asked for by --policy-logprobs")
    if loaded.auto is not None:
        return loaded, [f"not costed: {why}, and {loaded.auto.fn.__qualname__}() does not ({', '.join(added)} "
                        "would)"] if added else []
    notes = [f"added {name}, an inference call over the samples passed to their train calls: {why}"
             + ("; --no-policy-logprobs keeps the graph as declared" if policy_logprobs is None else "")
             for name in added]
    return dataclasses.replace(loaded, graph=graph), notes


GALORE_INTERVAL = GaLore.model_fields["update_interval"].default
GALORE_SCALE = GaLore.model_fields["scale"].default


def _galore(rank: int | None, interval: int, scale: float) -> GaLore | None:
    """The GaLore optimizer the compile flags ask for (None: AdamW only)."""
    if rank is None:
        if interval != GALORE_INTERVAL or scale != GALORE_SCALE:
            raise PlannerError("--galore-interval and --galore-scale set up a GaLore optimizer that --galore-rank turns on",
                               hint="add --galore-rank R (e.g. 128), or drop them")
        return None
    if scale <= 0:  # GaLore's own check, said as a flag
        raise PlannerError(f"--galore-scale must be positive, got {scale}", hint=f"GaLore's papers use {GALORE_SCALE}")
    return GaLore(rank=rank, update_interval=interval, scale=scale)


def _search_space(*, offload: bool, galore_rank: int | None, galore_interval: int, galore_scale: float,
                  node_ranges: bool | None = None) -> SearchSpace | None:
    """The compile command's search space (None: the default one)."""
    from planner.candidates import SearchSpace  # noqa: F811 (imported here at run time)

    galore = _galore(galore_rank, galore_interval, galore_scale)
    if offload and galore is None and node_ranges is None:
        return None
    return SearchSpace(offload=offload, galore=galore, node_ranges=node_ranges)


def compile_cmd(
    target: Annotated[str, typer.Argument(help="Graph file (.py) or algorithm name.", show_default=False)],
    cluster: Annotated[Optional[str], typer.Option("--cluster", "-c", help="GPU:NODESxPER_NODE or a file (default: the graph file's CLUSTER).")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Plan file to write [default: plans/<name>.json].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan JSON to stdout instead of tables (writes a file only with -o).")] = False,
    time_limit: Annotated[float, typer.Option("--time-limit", min=0, help="Search budget in seconds: CP-SAT work (deterministic, about wall seconds on an idle machine), so the same inputs give the same plan; 0 keeps the beam-search plan.")] = 10.0,
    baseline: Annotated[Optional[Baseline], typer.Option("--baseline", help="Emit a baseline's best plan instead: colocate, split, heuristic.")] = None,
    calibration: Annotated[Optional[Path], typer.Option("--calibration", help="Cost-model calibration file (from `planner calibrate` or `planner profile`).")] = None,
    framework: Annotated[str, typer.Option("--framework", help="The stack the plan is costed for: torch (the planner's runtime, which runs the plan), megatron-core (Megatron-Core with Transformer Engine), megatron (Megatron-LM's GPT on Megatron-DeepSpeed, as vTrain measured it), vllm (vLLM generation), rlhf-engine (verl's Megatron workers: Megatron-Core training, vLLM rollouts), rlhf-engine-hf (OpenRLHF: HF transformers models trained on DeepSpeed, vLLM rollouts) or verl-fsdp (verl's FSDP workers: the same models on FSDP, Ulysses context parallel); cost the stack you will run, e.g. megatron-core before `planner export --to megatron`; a plan for rlhf-engine, rlhf-engine-hf, verl-fsdp or vllm keeps to the layouts their engines run (rlhf-engine-hf, verl-fsdp: no tensor or pipeline parallel in training and scoring, ZeRO-3 sharding; verl's stacks: every call on all GPUs; none of them: pipelined or context-parallel generation, a separate decode layout).")] = "torch",
    mem_headroom: Annotated[Optional[float], typer.Option("--mem-headroom", min=0, help="GiB per GPU every call leaves free, beyond what the cost model counts (context, NCCL buffers, fragmentation) [default: 1 GiB + 2.5% of the memory, 3 GiB of an 80 GiB GPU; 0 packs to the edge].")] = None,
    offload: Annotated[bool, typer.Option("--offload/--no-offload", help="Let home calls keep states in host memory between calls (a trained model's optimizer states, a frozen model's weights), copied over PCIe for each call, where that makes the iteration faster; --no-offload keeps every state on the GPU.")] = True,
    node_ranges: Annotated[Optional[bool], typer.Option("--node-ranges/--aligned-meshes", show_default=False, help="Also place calls on any run of consecutive whole nodes (2 of 3 nodes, 12 of 16) and on half nodes, as ReaLHF does, besides aligned power-of-two blocks; --aligned-meshes keeps to the blocks. [default: node ranges where the node count is no power of two, up to 12 nodes (3, 5-7, 9-12): there the blocks have holes (none between one node and all three) and the runs gave 1.00-1.58x faster plans, certified in seconds; elsewhere the wider space gains less or takes longer (a PPO 70B on 16 nodes: 7-9 s, searched mesh sizes first and then positions, certified within 3%)]")] = None,
    galore_rank: Annotated[Optional[int], typer.Option("--galore-rank", min=1, help="Let train calls use a GaLore optimizer of this rank (Adam states of each decoder matrix's rank-r gradient projection; Zhao et al. 2024) where AdamW's states do not fit: it changes the optimizer, so it is off unless asked. Runs on the planner's runtime with ZeRO 0 or 1 (tensor parallel too); no export engine has it. GaLore's papers use 128-1024 for 60M-7B models.")] = None,
    galore_interval: Annotated[int, typer.Option("--galore-interval", min=1, help="With --galore-rank: optimizer steps between the SVDs that refresh each projection.")] = GALORE_INTERVAL,
    galore_scale: Annotated[float, typer.Option("--galore-scale", min=0, help="With --galore-rank: alpha, the scale of the projected-back update.")] = GALORE_SCALE,
    actor: Annotated[Optional[str], typer.Option(help="Actor / policy model SPEC (algorithms).")] = None,
    critic: Annotated[Optional[str], typer.Option(help="Critic SPEC (ppo; default: the actor's).")] = None,
    ref: Annotated[Optional[str], typer.Option(help="Reference model SPEC (default: the actor's).")] = None,
    reward: Annotated[Optional[str], typer.Option(help="Reward model SPEC (default: the critic's, else the actor's).")] = None,
    reward_fn: Annotated[Optional[str], typer.Option(help="Reward function module:function instead of a reward model.")] = None,
    batch: Annotated[Optional[int], typer.Option(min=1, help="Prompts (or sequences, or pairs) per iteration [default: 512].")] = None,
    prompt_len: Annotated[Optional[int], typer.Option(min=1, help="Prompt tokens [default: 1024].")] = None,
    gen_len: Annotated[Optional[int], typer.Option(min=1, help="Generated tokens [default: 1024].")] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=1, help="sft/dpo: tokens per sequence [default: 2048].")] = None,
    samples_per_prompt: Annotated[Optional[int], typer.Option(min=1, help="grpo/rloo: samples per prompt.")] = None,
    ppo_minibatches: Annotated[Optional[int], typer.Option(min=1, help="Optimizer steps per train call.")] = None,
    function: Annotated[Optional[str], typer.Option("--function", help="The @planner.auto loop to trace, when the file has several.")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Algorithms: a .jsonl or .parquet dataset of prompts (RL), prompt+response (sft) or prompt+chosen+rejected (dpo), tokenized with the actor directory's tokenizer.")] = None,
    prompt_key: Annotated[str, typer.Option("--prompt-key", help="Dataset column of the prompt.")] = "prompt",
    response_key: Annotated[Optional[str], typer.Option("--response-key", help="sft: dataset column of the response [default: response].")] = None,
    chosen_key: Annotated[Optional[str], typer.Option("--chosen-key", help="dpo: column of the preferred response [default: chosen].")] = None,
    rejected_key: Annotated[Optional[str], typer.Option("--rejected-key", help="dpo: column of the other response [default: rejected].")] = None,
    extra_keys: Annotated[Optional[str], typer.Option("--extra-keys", help="Comma-separated columns passed to the reward function (e.g. ground_truth).")] = None,
    chat_template: Annotated[bool, typer.Option("--chat-template/--no-chat-template", help="Apply the tokenizer's chat template to prompts.")] = True,
    lr: Annotated[Optional[float], typer.Option("--lr", min=0, help="Algorithms: learning rate of the train calls [default: 1e-5].")] = None,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="A string that also ends a response (repeat for several; with --data).")] = None,
    response_len_mean: Annotated[Optional[float], typer.Option("--response-len-mean", min=1, help="Generate calls: the mean tokens a response really has (gen_len is the cap); lengths are costed as geometric (a constant chance of stopping at each token), and a batch takes as many steps as its longest response [default: every response runs to gen_len].")] = None,
    response_len_from: Annotated[Optional[Path], typer.Option("--response-len-from", help="Generate calls: take that mean from a previous run's --metrics-out file (its last 10 steps' response_len).")] = None,
    policy_logprobs: Annotated[Optional[bool], typer.Option("--policy-logprobs/--no-policy-logprobs", show_default=False, help="RL training: run the actor over its samples before training (an inference call, actor_logprobs) for the log-probs of the PPO ratio and the KL term, as verl and OpenRLHF do, instead of taking generation's. A graph file gets the call after its generate call, passed to the train calls that read those samples, unless it has one (the compile prints what it added); a @planner.auto loop must make it itself. Default: on for the stacks that do it (rlhf-engine, rlhf-engine-hf, verl-fsdp), off otherwise (the planner's runtime takes generation's).")] = None,
) -> None:
    from planner.compile import SearchProgress, compile_graph
    from planner.render import print_plan
    from plans.cluster import resolve_cluster, with_headroom
    from plans.io import check_output
    from plans.plan import plan_to_json, save_plan

    source = None
    if data is not None:
        source = {"data": data, "key": prompt_key, "chat_template": chat_template,
                  "extra_keys": [k.strip() for k in (extra_keys or "").split(",") if k.strip()]}
        if target == "sft":
            source["response_key"] = response_key or "response"
        if target == "dpo":
            source.update(chosen_key=chosen_key or "chosen", rejected_key=rejected_key or "rejected")
    elif any(v is not None for v in (response_key, chosen_key, rejected_key, extra_keys)):
        raise PlannerError("--response-key, --chosen-key, --rejected-key and --extra-keys describe a --data file",
                           hint="add --data FILE.jsonl")
    from cost_models.framework import resolve_framework

    stack = resolve_framework(framework)  # an unknown name is an error before any work
    loaded, notes = _graph_from_target(
        target, actor=actor, critic=critic, ref=ref, reward=reward, reward_fn=reward_fn, batch=batch,
        prompt_len=prompt_len, gen_len=gen_len, seq_len=seq_len, samples_per_prompt=samples_per_prompt,
        ppo_minibatches=ppo_minibatches, function=function, data=source, lr=lr, stop=stop,
        policy_logprobs=policy_logprobs, stack_recomputes=stack.layouts.policy_logprobs, stack_name=stack.name)
    graph = loaded.graph
    if response_len_mean is not None and response_len_from is not None:
        raise PlannerError("give --response-len-mean or --response-len-from, not both")
    if response_len_mean is not None or response_len_from is not None:
        from planner.lengths import from_metrics, with_response_len
        from plans.graph import ResponseLengths

        lengths = from_metrics(response_len_from) if response_len_from is not None else \
            ResponseLengths(mean=response_len_mean, source="--response-len-mean")
        graph = with_response_len(graph, lengths)
    if cluster is None and loaded.cluster is None:
        raise PlannerError("no cluster given", hint="pass --cluster GPU:NODESxPER_NODE, e.g. --cluster a100-80gb:2x8")
    cl = with_headroom(resolve_cluster(cluster if cluster is not None else loaded.cluster), mem_headroom)
    if galore_rank is not None and framework != "torch":
        raise PlannerError(f"--galore-rank with --framework {framework}: GaLore runs on the planner's runtime only "
                           "(framework torch); no engine planner exports to has it",
                           hint="drop --framework to plan for the planner's runtime, or drop --galore-rank")
    default_path = loaded.auto.plan_path if loaded.auto is not None else Path("plans") / f"{graph.name}.json"
    if not as_json or output is not None:
        check_output(output or default_path)
    calib = None
    if calibration is not None:
        from cost_models import load_calibration

        calib = load_calibration(calibration)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    with err.status("compiling", spinner="dots") as status:
        # Candidates, best plan so far and the proven bound, as the search reports them.
        def show(p: SearchProgress) -> None:
            status.update(f"{time.perf_counter() - t0:5.1f} s  {escape(str(p))}")

        plan = compile_graph(graph, cl, time_limit_s=time_limit, baseline=baseline.value if baseline else None,
                             calibration=calib, progress=show, framework=framework,
                             space=_search_space(offload=offload, galore_rank=galore_rank, galore_interval=galore_interval,
                                                 galore_scale=galore_scale, node_ranges=node_ranges))
    if loaded.auto is not None:  # the loop reuses this plan while it, the cluster and the options are unchanged
        from planner.auto import file_sha256, plan_hash

        digest = plan_hash(graph, cluster=cl, baseline=baseline.value if baseline else None,
                           calibration_sha256=file_sha256(calibration), offload=offload,
                           galore=_galore(galore_rank, galore_interval, galore_scale), node_ranges=node_ranges)
        plan = plan.model_copy(update={"source_hash": digest})
    if as_json:
        typer.echo(plan_to_json(plan), nl=False)
        if output is not None:
            save_plan(plan, output)
        for note in notes:
            err.print(note, highlight=False)
        return
    path = output or default_path
    save_plan(plan, path)
    from planner.render import make_console

    console = make_console()
    print_plan(plan, console)
    for note in notes:
        console.print(note, highlight=False)
    console.print(f"wrote {path}", highlight=False)
    if loaded.auto is not None:
        loop = f"{loaded.auto.fn.__qualname__}()"
        if Path(path).resolve() != loaded.auto.plan_path.resolve():
            note = f"{loop} reads its plan from {loaded.auto.plan_path}, not from this file"
        elif loaded.auto.source_hash(graph) != plan.source_hash:
            note = f"{loop} will recompile it: the cluster or options given here differ from the decorator's"
        else:
            note = f"{loop} reuses it while the loop, cluster and models are unchanged"
        console.print(note, highlight=False)


def show(plan_file: Annotated[Path, typer.Argument(help="Plan JSON file.")],
         as_json: Annotated[bool, typer.Option("--json", help="Print the validated plan JSON.")] = False) -> None:
    """Render a plan: calls with mesh, layout, time and memory; reallocations; estimates."""
    from planner.render import print_plan
    from plans.plan import load_plan, plan_to_json

    plan = load_plan(plan_file)
    if as_json:
        typer.echo(plan_to_json(plan), nl=False)
    else:
        print_plan(plan)


class Engine(str, Enum):
    megatron = "megatron"
    deepspeed = "deepspeed"
    verl = "verl"
    openrlhf = "openrlhf"


def validate(plan_file: Annotated[Path, typer.Argument(help="Plan JSON file.")],
             target: Annotated[Optional[list[Engine]], typer.Option("--target", help="Also check what this engine's export cannot take of the plan (repeat for several): megatron, deepspeed, verl, openrlhf.")] = None,
             as_json: Annotated[bool, typer.Option("--json", help="Print the findings as one JSON object.")] = False) -> None:
    """Check a plan before running it: schema, placements inside the cluster, degrees that fill
    each mesh and shard each model, every call's memory within the GPU's capacity under the cost
    model, what this runtime cannot run (context parallel, separate decode layouts, sequences
    beyond a model's positions, ...), batches that do not split the way the plan was costed, and
    with --target what an engine's export cannot take. Lists the code the plan names (a reward
    function, host steps): the runtime runs it only when the launch names it too. Exit status 2
    when anything is found."""
    from planner.check import check_plan
    from plans.plan import load_plan

    plan = load_plan(plan_file)
    found = check_plan(plan, targets=tuple(t.value for t in target or ()))
    if as_json:
        typer.echo(json.dumps({"plan": str(plan_file), "ok": found.ok, "problems": found.problems,
                               "mismatches": found.mismatches, "export": found.export,
                               "code": [{"kind": c.kind, "name": c.name, "runs": c.runs} for c in found.code]},
                              indent=2, sort_keys=True))
        if not found.ok:
            raise typer.Exit(PlannerError.exit_code)
        return
    lines = [f"  {p}" for p in found.problems]
    lines += [f"  runs, but not as estimated: {p}" for p in found.mismatches]
    lines += [f"  {engine} cannot take: {x}" for engine, limits in found.export.items() for x in limits]
    code = [f"  {c.line()}" for c in found.code] or ["  none"]
    if lines:
        raise PlannerError(f"{plan_file} is not executable as planned:\n" + "\n".join(lines)
                           + "\ncode the plan names:\n" + "\n".join(code))
    typer.echo(f"{plan_file}: valid ({len(plan.calls)} calls on {plan.cluster.short()}, "
               f"iteration {plan.estimate.iteration_s:.4g} s)"
               + ("; exports checked: " + ", ".join(found.export) if found.export else ""))
    typer.echo("code the plan names:\n" + "\n".join(code))


def compare(plan_files: Annotated[list[Path], typer.Argument(help="Plan JSON files.")],
            as_json: Annotated[bool, typer.Option("--json", help="Print the comparison as JSON.")] = False) -> None:
    """Compare plans side by side: iteration time, throughput, MFU, memory, and speedup over the first."""
    from rich.table import Table

    from planner.render import fmt_gib, fmt_s
    from plans.plan import load_plan

    plans = [load_plan(p) for p in plan_files]
    base = plans[0].estimate.iteration_s
    # A plan may state an iteration time of 0 (nothing to do); a speedup against it is undefined.
    rows: list[dict[str, Any]] = [{"plan": str(f), "method": p.search.method, "iteration_s": p.estimate.iteration_s,
             "tokens_per_s": p.estimate.tokens_per_s, "mfu": p.estimate.mfu,
             "peak_mem_bytes": p.estimate.peak_mem_bytes,
             "speedup_vs_first": base / p.estimate.iteration_s if p.estimate.iteration_s and base else None}
            for f, p in zip(plan_files, plans)]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    t = Table()
    for col in ("plan", "method", "iteration", "tokens/s", "MFU", "peak mem", "speedup vs first"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["plan"], r["method"], fmt_s(r["iteration_s"]), f"{r['tokens_per_s']:,.0f}", f"{r['mfu'] * 100:.1f}%",
                  fmt_gib(r["peak_mem_bytes"]),
                  "n/a" if r["speedup_vs_first"] is None else f"{r['speedup_vs_first']:.2f}x")
    from planner.render import make_console

    make_console().print(t)


IMPORT_HELP = """Cost your own engine config: build the plan it amounts to (meshes, layouts, batch).

SOURCE, by --from:

  verl: a verl 0.9 config YAML (as `main_ppo --cfg job` prints it) or '-'; ARGS are Hydra overrides key=value; keys not given take verl 0.9.1's defaults.

  openrlhf: train_ppo_ray flags of OpenRLHF 0.11, quoted, unquoted, or a script running it.

  megatron: pretrain_gpt.py flags of Megatron-LM core_v0.19.0, the same ways.

  deepspeed: a DeepSpeed 0.19 JSON config, with --model model=SPEC and --seq-len N (and --pp N for a PipelineModule), which its job sets in code.

A model path that is neither a preset nor a local HF directory (a hub id) needs --model ROLE=SPEC (roles: actor, critic, reward; model for megatron and deepspeed). The plan is costed by the same model as `planner compile`:

  planner import --from verl my_verl.yaml --cluster a100-80gb:1x8 -o mine.json

  planner import --from openrlhf run_ppo.sh --model actor=llama-3-8b --cluster h100-sxm:1x8 -o mine.json

  planner compare mine.json plans/ppo.json; planner explain mine.json
"""


class Source(str, Enum):
    verl = "verl"
    openrlhf = "openrlhf"
    megatron = "megatron"
    deepspeed = "deepspeed"


def import_cmd(
    source_kind: Annotated[Source, typer.Option("--from", help="The engine the config is for.")],
    source: Annotated[str, typer.Argument(help="Config file, flags string or script (see above); '-' for none (verl).")],
    args: Annotated[Optional[list[str]], typer.Argument(help="verl: Hydra overrides key=value.")] = None,
    cluster: Annotated[str, typer.Option("--cluster", help="GPU:NODESxPER_NODE the config runs on.")] = "",
    model: Annotated[Optional[list[str]], typer.Option("--model", help="ROLE=SPEC for a role whose path is not a preset or local directory.")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", min=1, help="deepspeed: tokens per sequence.")] = None,
    pp: Annotated[int, typer.Option("--pp", min=1, help="deepspeed: pipeline stages of its PipelineModule.")] = 1,
    world: Annotated[Optional[int], typer.Option("--world", min=1, help="megatron, deepspeed: GPUs of the job [default: the cluster's].")] = None,
    prompt_len: Annotated[Optional[int], typer.Option("--prompt-len", min=1, help="openrlhf without --rollout.max_new_tokens: prompt tokens.")] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Plan file to write [default: stdout summary only].")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan JSON.")] = False,
) -> None:
    from planner import imports
    from planner.pinned import pinned_plan
    from planner.render import make_console, print_plan
    from plans.cluster import parse_cluster
    from plans.io import check_output
    from plans.plan import plan_to_json, save_plan

    if not cluster:
        raise PlannerError("--cluster is required: the GPUs the config runs on", hint="e.g. --cluster a100-80gb:1x8")
    spec = parse_cluster(cluster)
    models: dict[str, str] = {}
    for m in model or []:
        role, eq, value = m.partition("=")
        if not eq or role not in ("actor", "critic", "reward", "model") or not value:
            raise PlannerError(f"--model {m!r} is not ROLE=SPEC", hint="roles: actor, critic, reward, model")
        models[role] = value
    if output is not None:
        check_output(output)
    import shlex

    extra = list(args or [])
    if extra and source_kind is Source.deepspeed:
        raise PlannerError(f"unexpected arguments {' '.join(extra)!r} after the DeepSpeed config")
    # Flags may come quoted as one string, as a script, or unquoted after the planner's own options.
    words = imports.command_words(shlex.join([source, *extra]) if extra else source) \
        if source_kind in (Source.openrlhf, Source.megatron) else []
    if source_kind is Source.verl:
        tree = imports.verl_config(None if source == "-" else Path(source), extra)
        got = imports.from_verl(tree, spec, models)
    elif source_kind is Source.openrlhf:
        got = imports.from_openrlhf(words, spec, models, prompt_len=prompt_len)
    elif source_kind is Source.megatron:
        got = imports.from_megatron(words, spec, models, world=world)
    else:
        got = imports.from_deepspeed(imports.read_json(Path(source)), spec, models, world=world, seq_len=seq_len, pp=pp)
    plan = pinned_plan(got.graph, spec, got.placements, method=f"imported from {source_kind.value}",
                       framework=got.framework or imports.FRAMEWORK_OF[source_kind.value])
    if output is not None:
        save_plan(plan, output)
    if as_json:
        typer.echo(plan_to_json(plan), nl=False)
        return
    console = make_console()
    print_plan(plan, console)
    for note in got.notes:
        console.print(f"note: {escape(note)}", highlight=False)
    if plan.search.status != "fits":
        console.print(f"[bold red]the config exceeds GPU memory[/] (peak {plan.estimate.peak_mem_bytes / 2**30:.1f} "
                      f"GiB of {spec.mem_bytes / 2**30:.0f} GiB per GPU, as costed)")
    if output is not None:
        console.print(f"wrote {output}", highlight=False)


def schema() -> None:
    """Print the JSON Schema of the plan format."""
    from plans.plan import Plan

    typer.echo(json.dumps(Plan.model_json_schema(), indent=2))


def register(app: typer.Typer) -> None:
    app.command("compile", help=COMPILE_HELP)(compile_cmd)
    app.command()(show)
    app.command()(validate)
    app.command()(compare)
    app.command()(schema)
    # Engine flags (--actor.num_nodes ...) pass through unquoted: options the planner does not know
    # are SOURCE/ARGS words.
    app.command("import", help=IMPORT_HELP, context_settings={"ignore_unknown_options": True})(import_cmd)
