"""Context parallel computes what one process computes: 4 gloo ranks against the unsharded reference.

cp 2 and 4, alone and with dp, tp (with and without sequence parallel), pp (with micro-batches),
ZeRO 1-3 (ZeRO 1/2 partitioned over dp x cp, also with dp 1) and recompute, for both model families and heads (`test_runtime_parallel`'s harness and
checks: inference outputs, train-step loss and statistics, every updated parameter slice, and
generation, whose prefill is context-parallel and whose decode KV-parallel), on left-padded rows.
Attention scores are made a few at a time (`ATTN_BLOCK_ELEMENTS` shrunk) so the blocked attention
of a context-parallel rank runs many blocks. The sequence (13 tokens) is padded
to a multiple of 2 * cp (and of tp under sequence parallel).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from plans import PRESETS
from tests.test_runtime_parallel import WORLD, _free_port, _state, collect, run_layouts

CASES = [
    # dp, tp, pp, extra layout fields (every one with cp > 1)
    (1, 1, 1, {"cp": 4}),
    (1, 1, 1, {"cp": 4, "recompute": "selective"}),
    (2, 1, 1, {"cp": 2, "micro_batches": 2}),
    (2, 1, 1, {"cp": 2, "zero": 1}),
    (2, 1, 1, {"cp": 2, "zero": 2, "micro_batches": 2}),  # ZeRO 1/2 partition over dp x cp
    (1, 1, 1, {"cp": 4, "zero": 1}),  # over the cp ranks alone
    (1, 2, 1, {"cp": 2, "zero": 2, "sequence_parallel": True}),
    (1, 1, 1, {"cp": 4, "zero": 3}),  # ZeRO-3's slices are the dp axis's: whole on each cp rank
    (2, 1, 1, {"cp": 2, "zero": 3, "recompute": "full"}),
    (1, 2, 1, {"cp": 2, "sequence_parallel": True}),
    (1, 2, 1, {"cp": 2}),
    (1, 1, 2, {"cp": 2, "micro_batches": 3}),
]


def _worker(rank: int, port: int, out_dir: str) -> None:
    import runtime.model

    runtime.model.ATTN_BLOCK_ELEMENTS = 300  # a block of a few queries: many blocks per attention
    models = [(family, PRESETS[f"tiny-{family}"], head) for family in ("llama", "gpt") for head in ("lm", "value")]
    run_layouts(rank, port, out_dir, models, CASES, _state, pad=torch.tensor([0, 3, 0, 1, 2, 0, 0, 5]))


@pytest.mark.heavy
@pytest.mark.slow
def test_context_parallel_layouts_match_single_process_reference(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    problems, checks = collect(tmp_path)
    assert not problems, "\n".join(problems[:40])
    assert checks > 2 * 2 * len(CASES) * WORLD * 10


def test_a_rank_holds_two_balanced_chunks_and_all_slots_once() -> None:
    from runtime.context_parallel import ContextParallel

    cpu = torch.device("cpu")
    cp = ContextParallel(size=4, rank=1)
    assert cp.slots(16, cpu).tolist() == [2, 3, 12, 13]  # chunks 1 and 6 of 8
    gathered, inverse = cp.order(16, cpu)
    assert sorted(gathered.tolist()) == list(range(16))
    assert torch.equal(gathered[inverse], torch.arange(16))
    # causal work is balanced: every rank's queries see the same number of keys in all
    seen = [sum(int(t) + 1 for t in ContextParallel(size=4, rank=r).slots(16, cpu)) for r in range(4)]
    assert len(set(seen)) == 1
    with pytest.raises(ValueError, match="divisible by 8"):
        cp.slots(12, cpu)


MICRO = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 32768}


def test_a_32k_sft_compiles_to_context_parallel_that_the_runtime_runs() -> None:
    """One 32k-token sequence per step cannot split over data-parallel ranks: the search gives the
    train call cp, and nothing in the plan is refused (`bench/long_context.py` runs it against the
    reference)."""
    from planner.algorithms import sft
    from planner.compile import compile_graph
    from plans import parse_cluster, resolve_model
    from plans.runnable import runtime_problems

    plan = compile_graph(sft(resolve_model(MICRO), batch=1, seq_len=32768), parse_cluster("cpu:1x4"), time_limit_s=2)
    (call,) = plan.calls
    assert call.layout.cp > 1 and call.layout.dp == 1
    assert runtime_problems(plan) == []
