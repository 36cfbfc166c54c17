"""The search's reallocation lower bound (`CostModel.realloc_floor_s`) against the exact cost.

`cost_models.transfer.realloc_floor` counts, per destination rank, the elements it needs, the most
it can already hold and the source slices it unpacks or copies, without choosing senders. The
piece counts must equal the exact transfer plan's (received + local slices of every rank), and
the bound must never exceed the exact time, wherever the two meshes sit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cost_models import CostModel
from cost_models.transfer import rank_volumes, realloc_floor
from plans.cluster import parse_cluster
from plans.graph import ModelDecl
from plans.layout import Layout, Mesh
from plans.model import PRESETS, resolve_model
from plans.sharding import box_numel, parameters, shard_box, slices_key, slicing

FOUR = [Layout(dp=4), Layout(tp=4), Layout(pp=4), Layout(dp=2, tp=2), Layout(dp=2, pp=2, interleave=1),
        Layout(tp=2, pp=2), Layout(dp=2, tp=2, zero=3), Layout(dp=4, zero=3), Layout(dp=2, cp=2),
        Layout(dp=2, cp=2, zero=3), Layout(dp=4, zero=1, micro_batches=2, recompute="full")]
EXPERTS = [Layout(dp=4, ep=4), Layout(dp=4, ep=2, zero=3), Layout(dp=2, tp=2, ep=2, etp=2), Layout(dp=2, pp=2, ep=2),
           Layout(dp=4)]
# (source first, destination first) of meshes of 4 ranks on nodes of 4 and 8: the same mesh,
# disjoint on one node, disjoint on two nodes.
POSITIONS = [(0, 0, 4), (0, 4, 8), (0, 4, 4)]


def _cases(layouts: list[Layout]) -> list[tuple[Layout, Layout]]:
    return list(itertools.product(layouts, repeat=2))


# Every tensor cut evenly by every layout above: its floors are costed at the smallest such shape
# and scaled (`cost_models.transfer._unit`).
EVEN = ("model_type=llama,hidden_size=64,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2,"
        "intermediate_size=128,vocab_size=256")


@pytest.mark.parametrize("model,layouts", [("tiny-llama", FOUR), ("tiny-gpt", FOUR[:8]), ("tiny-qwen-moe", EXPERTS),
                                           (EVEN, FOUR)])
def test_pieces_and_needs_equal_the_exact_plan(model, layouts):
    spec = resolve_model(model)
    for src, dst in _cases(layouts):
        floor = realloc_floor(spec, head="lm", src=slicing(src), dst=slicing(dst))
        need = [sum(box_numel(b) for p in parameters(spec, head="lm") if (b := shard_box(p, spec, dst, r)) is not None)
                for r in range(dst.size)]
        assert floor.need.tolist() == need, (src.short(), dst.short())
        for s_first, d_first, gpn in POSITIONS:
            vol = rank_volumes(spec, head="lm", src=(Mesh.block(s_first, 4), src), dst=(Mesh.block(d_first, 4), dst),
                               gpus_per_node=gpn)
            at = d_first - vol.first
            assert vol.recv_pieces is not None and vol.local_pieces is not None
            got = vol.recv_pieces[at:at + 4] + vol.local_pieces[at:at + 4]
            assert floor.pieces.tolist() == got.tolist(), (src.short(), dst.short(), s_first, d_first)


def test_the_bound_never_exceeds_the_exact_time_and_is_not_trivial():
    decl = ModelDecl(spec=PRESETS["llama-2-7b"], trainable=True)
    cm = CostModel(parse_cluster("a100-80gb:2x8"))
    layouts = {8: [Layout(dp=8), Layout(tp=8), Layout(tp=4, pp=2), Layout(dp=2, tp=4), Layout(dp=8, zero=3),
                   Layout(dp=4, tp=2, zero=3), Layout(tp=2, pp=4, interleave=2)],
               16: [Layout(dp=16, zero=3), Layout(dp=2, tp=8), Layout(tp=8, pp=2), Layout(dp=4, tp=4)],
               4: [Layout(tp=4), Layout(dp=4), Layout(dp=2, tp=2, zero=3)]}
    meshes = {4: [Mesh.block(0, 4), Mesh.block(4, 4), Mesh.block(8, 4)], 8: [Mesh.block(0, 8), Mesh.block(8, 8)],
              16: [Mesh.block(0, 16)]}
    ratios = []
    for (ss, sl), (ds, dl) in itertools.product(layouts.items(), repeat=2):
        for src_lay, dst_lay in itertools.product(sl, dl):
            for sm, dm in itertools.product(meshes[ss], meshes[ds]):
                if slices_key(sm, src_lay) == slices_key(dm, dst_lay):
                    continue
                exact = cm.realloc_cost(decl, (sm, src_lay), (dm, dst_lay)).time_s
                bound = cm.realloc_floor_s(decl, (sm, src_lay), (dm, dst_lay))
                assert bound <= exact * (1 + 1e-12), (sm.short(), src_lay.short(), dm.short(), dst_lay.short())
                ratios.append(bound / exact)
    # Most of the exact cost is what no choice of senders avoids: the bound is close on most pairs.
    assert np.median(ratios) > 0.6


def test_layouts_holding_the_same_slices_cost_the_same():
    decl = ModelDecl(spec=PRESETS["tiny-llama"], trainable=True)
    cm = CostModel(parse_cluster("cpu:1x4"))
    a, b = Mesh.block(0, 4), Mesh.block(0, 2)
    plain, busy = Layout(dp=4), Layout(dp=2, cp=2, zero=1, micro_batches=4, recompute="full", offload="optimizer")
    assert slicing(plain) == slicing(busy) and slices_key(a, plain) == slices_key(a, busy)
    dst = Layout(dp=2)
    assert cm.realloc_cost(decl, (a, busy), (b, dst)) == cm.realloc_cost(decl, (a, plain), (b, dst))
    # ZeRO-3 over data-parallel ranks is a different slicing (and context-parallel ranks then matter)
    assert slicing(Layout(dp=4, zero=3)) != slicing(plain)
    assert slicing(Layout(dp=2, cp=2, zero=3)) != slicing(Layout(dp=4, zero=3))


def test_window_max_is_the_largest_of_every_window() -> None:
    """The anywhere floor's sliding maximum (by doubling) against the plain one, every width."""
    from cost_models.api import _window_max

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 8, 16, 33):
        values = rng.integers(-50, 50, size=n).astype(np.float64)
        for width in range(1, n + 1):
            want = [values[i:i + width].max() for i in range(n - width + 1)]
            assert _window_max(values, width).tolist() == want, (n, width)
