"""Hypothesis strategies for the fuzz tests: model specs, clusters, graphs and plan mutations.

Inputs are mostly well-formed and small (tiny models on a handful of CPU "GPUs", so a compile
takes a fraction of a second), with a steady share of hostile values mixed in: zero, negative,
huge and wrongly typed numbers, unknown names, broken dataflow. The fuzz tests assert that every
input gives either a valid plan or a `PlannerError`, never another exception.

`fuzz_settings(n)` fixes the seed (`derandomize`) and the budget, so CI runs the same examples
every time; set PLANNER_FUZZ_SCALE=10 to run ten times as many locally.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from plans.hardware import gpu_catalog
from plans.model import PRESETS


def fuzz_settings(max_examples: int) -> settings:
    """Seeded, budgeted settings for one fuzz test (scaled by PLANNER_FUZZ_SCALE)."""
    scale = float(os.environ.get("PLANNER_FUZZ_SCALE", "1"))
    return settings(max_examples=max(1, int(max_examples * scale)), derandomize=True, deadline=None, database=None,
                    print_blob=False, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                            HealthCheck.filter_too_much])


# Numbers: mostly small positive ones that divide nicely, sometimes hostile ------------------------

GOOD = [1, 2, 4, 8, 16, 3, 6, 12]
HOSTILE = [0, -1, -7, 2**24 + 1, 10**9, 2**62, 10**30, None, True, 1.5, "8", "eight", [4], {"n": 4},
           float("nan"), float("inf")]
# One list, good values repeated: hypothesis picks an index uniformly (and dedupes by choices, not
# values), so this is how a draw stays mostly good while every hostile value still comes up.
_WEIGHTED = GOOD * 8 + HOSTILE


def counts(*, bad: bool = True) -> st.SearchStrategy[Any]:
    """A count field: a small good value, or with `bad` (about one draw in five) a hostile one."""
    return st.sampled_from(_WEIGHTED if bad else GOOD)


def rare() -> st.SearchStrategy[bool]:
    """True about one draw in ten."""
    return st.sampled_from([True] + [False] * 9)


# Model specs ------------------------------------------------------------------------------------

TINY_INLINE = [
    "model_type=llama,hidden_size=32,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
    "intermediate_size=48,vocab_size=64",
    "model_type=gpt,hidden_size=24,num_hidden_layers=3,num_attention_heads=3,vocab_size=50,max_position_embeddings=32",
    "model_type=llama,hidden_size=16,num_hidden_layers=1,num_attention_heads=1,intermediate_size=16,vocab_size=8,"
    "tie_word_embeddings=true",
]
TINY_MODELS = ["tiny-llama", "tiny-gpt", *TINY_INLINE]

MODEL_FIELDS = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "attention_bias", "rms_norm_eps", "layer_norm_epsilon", "rope_theta", "name"]
FIELD_VALUES = st.one_of(
    st.integers(-4, 300), st.sampled_from([0, 2**18, 2**18 + 1, 2**40, 10**400 // 10**300]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.sampled_from(["llama", "gpt", "mistral", "gpt2", "qwen2", "bert", "", "12", "1e3", "true"]),
    st.text(max_size=8), st.lists(st.integers(0, 4), max_size=2),
)


@st.composite
def model_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A dict of ModelSpec fields: a valid tiny spec with some fields replaced, dropped or added."""
    base: dict[str, Any] = {"model_type": draw(st.sampled_from(["llama", "gpt"])), "hidden_size": 32,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}
    if base["model_type"] == "llama":
        base["intermediate_size"] = 48
    for key in draw(st.lists(st.sampled_from(MODEL_FIELDS), max_size=3)):
        base[key] = draw(FIELD_VALUES)
    for key in draw(st.lists(st.sampled_from(MODEL_FIELDS), max_size=2)):
        base.pop(key, None)
    if draw(st.booleans()) and draw(st.booleans()):
        base[draw(st.text(min_size=1, max_size=6))] = draw(FIELD_VALUES)
    return base


def _inline(d: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())


HF_TYPES = st.sampled_from(["llama", "mistral", "qwen2", "gpt2", "gpt", "bert", None, 3, ["llama"], {"a": 1}])


@st.composite
def hf_configs(draw: st.DrawFn) -> dict[str, Any]:
    """An HF config.json dict: GPT-2 or Llama field names, with extras the planner ignores."""
    hf_type = draw(HF_TYPES)
    if hf_type == "gpt2":
        cfg: dict[str, Any] = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 64}
    else:
        cfg = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 64, "vocab_size": 64}
    cfg["model_type"] = hf_type
    cfg["architectures"] = ["X"]
    cfg["torch_dtype"] = "bfloat16"
    for key in draw(st.lists(st.sampled_from([*cfg, "n_inner", "rope_theta"]), max_size=2)):
        cfg[key] = draw(FIELD_VALUES)
    if draw(st.booleans()):  # RoPE scaling in either spelling, its fields sometimes junk or missing
        rope: dict[str, Any] = {"rope_type": draw(st.sampled_from(["llama3", "yarn", "linear", "dynamic", "longrope",
                                                                   "default", None, 3, ""]))}
        for key in draw(st.lists(st.sampled_from(["factor", "low_freq_factor", "high_freq_factor", "beta_fast",
                                                  "original_max_position_embeddings", "attention_factor", "truncate",
                                                  "partial_rotary_factor", "mscale", "rope_theta", "type"]),
                                 max_size=4)):
            rope[key] = draw(st.one_of(FIELD_VALUES, st.sampled_from([1.0, 4.0, 8.0, 64])))
        where = draw(st.sampled_from(["rope_scaling", "rope_parameters"]))
        cfg[where] = rope if draw(st.integers(0, 4)) else draw(FIELD_VALUES)
    return cfg


def model_specs() -> st.SearchStrategy[Any]:
    """Anything a user might pass as a model SPEC: presets, inline strings, dicts, junk."""
    junk = st.one_of(st.text(max_size=20), st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))
    return st.one_of(
        st.sampled_from(sorted(PRESETS)),
        st.sampled_from(TINY_INLINE),
        model_dicts(),
        model_dicts().map(_inline),
        st.text(alphabet="=,abcdehilmnopstuyz_0123456789 ", max_size=40),
        junk,
    )


# Clusters ---------------------------------------------------------------------------------------

GPUS = sorted(gpu_catalog())
OVERRIDE_VALUES = st.sampled_from(["0", "-1", "1e-320", "1e400", "inf", "nan", "abc", "", "0.5", "100", "1e6", "2e6"])


@st.composite
def cluster_texts(draw: st.DrawFn) -> str:
    """`GPU:NODESxPER[,key=value...]` shorthand, sometimes malformed."""
    gpu = draw(st.one_of(st.sampled_from(GPUS), st.sampled_from(GPUS), st.sampled_from(["tpu", "", "a100", "CPU"])))
    nodes = draw(st.one_of(st.integers(1, 4), st.sampled_from([0, 4096, 4097, 10**12])))
    per = draw(st.one_of(st.integers(1, 8), st.sampled_from([0, 16, 17, 3])))
    sep = draw(st.sampled_from(["x", "x", "x", "*", "X", ""]))
    text = f"{gpu}:{nodes}{sep}{per}"
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(["intra_node_gbps", "inter_node_gbps", "mem_gib", "nodes", "bogus", ""]))
        text += f",{key}={draw(OVERRIDE_VALUES)}"
    if draw(st.integers(0, 9)) == 0:
        text = draw(st.text(max_size=30))
    return text


@st.composite
def cluster_dicts(draw: st.DrawFn) -> dict[str, Any]:
    """A dict of ClusterSpec fields (what a YAML/JSON cluster file holds), sometimes wrong."""
    d: dict[str, Any] = {"gpu": draw(st.sampled_from(GPUS)), "nodes": draw(st.integers(1, 4)),
                         "gpus_per_node": draw(st.integers(1, 8))}
    fields = ["gpu", "nodes", "gpus_per_node", "intra_node_gbps", "inter_node_gbps", "mem_gib", "extra"]
    for key in draw(st.lists(st.sampled_from(fields), max_size=2)):
        d[key] = draw(st.one_of(FIELD_VALUES, st.floats(0.001, 1e6)))
    for key in draw(st.lists(st.sampled_from(fields), max_size=1)):
        d.pop(key, None)
    return d


# Small clusters that compile fast; two oddly shaped ones and one with almost no memory.
TINY_CLUSTERS = ["cpu:1x1", "cpu:1x2", "cpu:1x4", "cpu:2x2", "cpu:2x4", "cpu:1x3", "cpu:3x2",
                 "a100-80gb:1x8", "cpu:1x4,mem_gib=0.001"]


# Graphs through the builder API ----------------------------------------------------------------

MODEL_NAMES = ["actor", "critic", "ref", "reward"]
BAD_NAMES = st.sampled_from(["", "1st", "a b", "x/y", "é", "actor"])


BREAKABLE = ["batch", "prompt_len", "gen_len", "seq_len", "algorithm", "model_name", "model_spec", "head", "kind",
             "input", "loss", "returns", "gen_kw", "minibatches", "trainable"]


@st.composite
def graph_recipes(draw: st.DrawFn, *, broken_share: float = 1 / 3) -> dict[str, Any]:
    """The steps of a `planner.Graph` program: graph sizes, model declarations and calls.

    Most recipes follow every rule (generate on LM models, train on trainable ones, inputs that
    exist); about `broken_share` of them break one rule, named by the recipe's "broken" entry."""
    intact = round(len(BREAKABLE) * (1 - broken_share) / broken_share)
    broken = draw(st.sampled_from(["nothing"] * intact + BREAKABLE))

    def size(what: str) -> Any:
        return draw(counts() if broken == what else counts(bad=False))

    graph: dict[str, Any] = {"batch": size("batch"), "prompt_len": size("prompt_len"), "gen_len": size("gen_len"),
                             "seq_len": draw(st.one_of(st.none(), counts())) if broken == "seq_len" else None}
    if broken == "algorithm":
        graph["algorithm"] = {draw(st.sampled_from(["kl_coef", "lr", "gamma", "name", "bogus"])): draw(FIELD_VALUES)}
    models = []
    for i in range(draw(st.integers(1, 3))):
        head = draw(st.sampled_from(["lm", "lm", "value"]))
        models.append({"name": draw(BAD_NAMES) if broken == "model_name" else MODEL_NAMES[i],
                       "spec": draw(model_specs() if broken == "model_spec" else st.sampled_from(TINY_MODELS)),
                       "trainable": draw(FIELD_VALUES) if broken == "trainable" else draw(st.booleans()),
                       "head": draw(st.text(max_size=3)) if broken == "head" else head})
    calls = []
    for _ in range(draw(st.integers(1, 5))):
        m = draw(st.integers(0, len(models) - 1))
        decl = models[m]
        kinds = (["generate", "inference"] if decl["head"] == "lm" else ["inference"]) + (
            ["train"] if decl["trainable"] is True else [])
        kind = draw(st.sampled_from(["generate", "inference", "train"] if broken == "kind" else kinds))
        n_in = draw(st.integers(1, 3))
        lo = -1 if broken == "input" else 0  # -1: a handle nobody writes
        inputs = [draw(st.integers(lo, len(calls))) for _ in range(n_in)]
        kw: dict[str, Any] = {}
        if kind == "generate" and draw(st.booleans()):
            kw["gen_len"] = size("gen_kw")
        if kind == "generate" and draw(st.booleans()):
            kw["samples_per_prompt"] = size("gen_kw")
        if kind == "train":
            kw["loss"] = draw(st.sampled_from(["sft", "ppo_policy", "grpo", "dpo"])) if broken != "loss" else "bogus"
            kw["minibatches"] = size("minibatches") if broken == "minibatches" else draw(st.sampled_from([1, 1, 2, 4]))
        if kind == "inference" and broken == "returns":
            kw["returns"] = draw(st.sampled_from(["logprobs", "values", "scores", "bogus"]))
        calls.append({"model": m, "kind": kind, "inputs": inputs, "kw": kw})
    return {"broken": broken, "graph": graph, "models": models, "calls": calls}


def build_recipe(recipe: dict[str, Any]):  # noqa: ANN201 - a plans.Graph
    """Run a recipe through the builder API; raises `PlannerError` where the recipe breaks a rule."""
    from planner import Graph

    g = Graph("fuzz", **recipe["graph"])
    handles = [g.input("prompts")]
    models = [g.model(m["name"], m["spec"], trainable=m["trainable"], head=m["head"]) for m in recipe["models"]]
    for c in recipe["calls"]:
        ins = [handles[i] if 0 <= i < len(handles) else "nobody_writes_this" for i in c["inputs"]]
        model = models[c["model"]]
        if c["kind"] == "generate":
            out = model.generate(ins[0], **c["kw"])
        elif c["kind"] == "inference":
            out = model.inference(*ins, **c["kw"])
        else:
            out = model.train(*ins, **c["kw"])
        handles.append(out)
    return g.build()


# JSON mutations (plans and raw graph dicts) ---------------------------------------------------

Path_ = tuple[Any, ...]


def json_paths(obj: Any, prefix: Path_ = ()) -> list[Path_]:
    """Every path (keys and indices) to a node of a JSON value, the root included."""
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += json_paths(v, (*prefix, i))
    return out


def _get(obj: Any, path: Path_) -> Any:
    for p in path:
        obj = obj[p]
    return obj


REPLACEMENTS = st.one_of(
    FIELD_VALUES, st.sampled_from([0, -1, 1, 2, 3, 5, 8, 10**6, 2**31, 2**63, 1e308, -0.0, 0.5]),
    st.sampled_from([{}, [], "", "x", {"ranks": [0]}, [0, 1, 2], {"dp": 2}]),
)


def _replacement(draw: st.DrawFn) -> Any:
    """A replacement value, copied: `sampled_from` hands out the same object every time, and an
    edit inside one (a key added to it) must not change the next example, or put it inside itself."""
    import copy

    return copy.deepcopy(draw(REPLACEMENTS))


@st.composite
def mutated(draw: st.DrawFn, base: Any, *, max_edits: int = 3) -> Any:
    """`base` (a JSON value, not modified) with 1..max_edits random edits: replace a value, delete or
    add a key, drop, duplicate or reorder list entries, scale a number."""
    import copy

    obj = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, max_edits))):
        paths = json_paths(obj)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "delete", "add", "scale", "dup", "swap"]))
        if not path:
            if op == "replace":
                obj = _replacement(draw)
            continue
        parent, key = _get(obj, path[:-1]), path[-1]
        node = parent[key]
        if op == "replace":
            parent[key] = _replacement(draw)
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(node, dict):
            node[draw(st.sampled_from(["extra", "dp", "ranks", "name", "version"]))] = _replacement(draw)
        elif op == "scale" and isinstance(node, (int, float)) and not isinstance(node, bool):
            parent[key] = node * draw(st.sampled_from([0, -1, 2, 3, 1000, 10**12])) + draw(st.sampled_from([0, 1]))
        elif op == "dup" and isinstance(node, list) and node:
            node.append(copy.deepcopy(node[draw(st.integers(0, len(node) - 1))]))
        elif op == "swap" and isinstance(node, list) and len(node) > 1:
            i, j = draw(st.integers(0, len(node) - 1)), draw(st.integers(0, len(node) - 1))
            node[i], node[j] = node[j], node[i]
    return obj


@st.composite
def replaced_placements(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """A plan dict with one call moved to another mesh and layout whose degrees fill it (so the
    schema's simple checks pass and the deeper ones are exercised), or a decode layout added."""
    import copy

    plan = copy.deepcopy(base)
    call = plan["calls"][draw(st.integers(0, len(plan["calls"]) - 1))]
    world = plan["cluster"]["nodes"] * plan["cluster"]["gpus_per_node"]
    size = draw(st.sampled_from([d for d in range(1, world + 1) if world % d == 0]))
    first = draw(st.integers(0, world // size - 1)) * size
    call["mesh"] = {"ranks": list(range(first, first + size))}
    degrees = [d for d in range(1, size + 1) if size % d == 0]
    tp = draw(st.sampled_from(degrees))
    pp = draw(st.sampled_from([d for d in degrees if (size // tp) % d == 0]))
    cp = draw(st.sampled_from([d for d in degrees if (size // (tp * pp)) % d == 0]))
    dp = size // (tp * pp * cp)
    layout = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": draw(st.integers(0, 3)) if dp > 1 else 0,
              "micro_batches": draw(st.sampled_from([1, 2, 3, 4, 8, 64, 1024])),
              "recompute": draw(st.sampled_from(["none", "selective", "full"])),
              "sequence_parallel": tp > 1 and draw(st.booleans()),
              "interleave": draw(st.sampled_from([1, 2, 3])) if pp > 1 else 1}
    call["layout"] = layout
    if draw(st.booleans()):
        call["decode_layout"] = {**layout, "zero": 0, "micro_batches": draw(st.sampled_from([1, 2, 4]))}
    return plan
