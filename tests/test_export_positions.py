"""What a Megatron-LM export says about RoPE scaling and sliding windows: flags where Megatron
has them, a listed limit where it does not (its own validators run in `tests/engines`)."""

from __future__ import annotations

import pytest

from planner.algorithms import sft
from planner.compile import compile_graph
from planner.exports import export_plan
from plans import parse_cluster

BASE = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=128, max_position_embeddings=16384)


def _export(**spec):
    plan = compile_graph(sft({**BASE, **spec}, batch=8, seq_len=64, name="sft_pos"), parse_cluster("cpu:1x4"),
                         time_limit_s=0)
    return export_plan(plan, "megatron")


@pytest.mark.parametrize(("scaling", "flags", "limit"), [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, ["--use-rope-scaling", "--rope-scaling-factor 8.0"], None),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 4096}, [], "Megatron-Core fixes them at 1, 4 and 8192"),
    ({"rope_type": "linear", "factor": 4.0}, ["--rotary-seq-len-interpolation-factor 4"], None),
    ({"rope_type": "linear", "factor": 1.5}, [], "takes whole numbers"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, [], "YaRN RoPE scaling is not "
     "exported"),
])
def test_rope_scaling_is_a_flag_or_a_limit(scaling: dict, flags: list[str], limit: str | None) -> None:
    exp = _export(rope_scaling=scaling)
    command = "\n".join(line for line in exp.text.splitlines() if not line.startswith("#"))
    for flag in flags:
        assert flag in command
    if limit is None:
        assert not [x for x in exp.cannot_express if "RoPE" in x]
    else:
        assert any(limit in x for x in exp.cannot_express)
        assert "--use-rope-scaling" not in command and "--rotary-seq-len-interpolation-factor" not in command


def test_a_sliding_window_is_transformer_engines_left_window() -> None:
    assert "--window-size 4095,0" in _export(sliding_window=4096).text
    assert "--window-size" not in _export().text
