"""Property tests (hypothesis) over model and cluster specs: a valid spec or a `PlannerError`.

Each input a user can give as a model SPEC (preset name, inline ``key=value`` fields, an HF
config dict or file, random field values) or a CLUSTER (shorthand with overrides, a dict, a
YAML/JSON file) either resolves to a spec whose derived figures are sane, or raises a
`PlannerError`; no other exception escapes. Seeded and budgeted (`tests.strategies.fuzz_settings`).
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from plans.cluster import parse_cluster, resolve_cluster
from plans.errors import PlannerError
from plans.model import ModelSpec, resolve_model, spec_from_hf_config
from tests.strategies import cluster_dicts, cluster_texts, fuzz_settings, hf_configs, model_dicts, model_specs


def _check_model(spec: ModelSpec) -> None:
    assert spec.hidden_size % spec.num_attention_heads == 0
    assert spec.num_attention_heads % spec.kv_heads == 0
    assert spec.ffn_size >= 1
    for head in ("lm", "value"):
        assert spec.num_params(head) > 0


@fuzz_settings(300)
@given(spec=model_specs())
def test_any_model_spec_resolves_or_raises_planner_error(spec):
    try:
        resolved = resolve_model(spec)
    except PlannerError as e:
        assert str(e)
        return
    _check_model(resolved)


@fuzz_settings(100)
@given(data=model_dicts())
def test_a_valid_model_round_trips_through_inline_fields(data):
    try:
        spec = resolve_model(data)
    except PlannerError:
        return
    fields = spec.model_dump(exclude={"name"})
    inline = ",".join(f"{k}={';'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in fields.items()
                      if v is not None)
    again = resolve_model(inline)
    assert again.model_dump(exclude={"name"}) == fields


@fuzz_settings(150)
@given(config=hf_configs(), as_file=st.booleans())
def test_hf_configs_resolve_or_raise_planner_error(config, as_file):
    try:
        if as_file:
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "config.json"
                path.write_text(json.dumps(config))
                spec = resolve_model(d)  # the model directory, as users pass it
        else:
            spec = spec_from_hf_config(config, source="config.json")
    except PlannerError:
        return
    _check_model(spec)


def _check_cluster(cl) -> None:  # noqa: ANN001
    assert 1 <= cl.world_size <= 4096 * 16
    for value in (cl.intra_node_gbps, cl.inter_node_gbps, cl.mem_gib):
        assert value is not None and math.isfinite(value) and value > 0
    assert cl.mem_bytes > 0
    assert parse_cluster(cl.short()) == cl  # the shorthand it prints rebuilds it


@fuzz_settings(300)
@given(text=cluster_texts())
def test_cluster_shorthand_parses_or_raises_planner_error(text):
    try:
        cl = parse_cluster(text)
    except PlannerError as e:
        assert str(e)
        return
    _check_cluster(cl)


@fuzz_settings(150)
@given(data=cluster_dicts(), fmt=st.sampled_from(["dict", ".json", ".yaml"]))
def test_cluster_dicts_and_files_resolve_or_raise_planner_error(data, fmt):
    try:
        if fmt == "dict":
            cl = resolve_cluster(data)
        else:
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / f"cluster{fmt}"
                try:
                    text = json.dumps(data) if fmt == ".json" else yaml.safe_dump(data)
                except (ValueError, yaml.YAMLError):
                    return  # not representable in that format (e.g. NaN in strict JSON): nothing to read
                path.write_text(text)
                cl = parse_cluster(str(path))
    except PlannerError:
        return
    _check_cluster(cl)
