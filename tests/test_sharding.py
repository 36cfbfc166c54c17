"""Layout algebra: shards partition every parameter, and transfer plans move the minimum."""

from __future__ import annotations

import itertools

import pytest

from plans.layout import Layout, Mesh
from plans.model import PRESETS, resolve_model
from plans.sharding import (
    box_numel,
    parameters,
    shard_box,
    split_range,
    stage_layers,
    transfer_plan,
    transfer_volume,
)

TINY = PRESETS["tiny-llama"]
LAYOUTS = [Layout(dp=4), Layout(tp=4), Layout(pp=4), Layout(dp=2, tp=2), Layout(dp=2, pp=2), Layout(tp=2, pp=2),
           Layout(dp=2, tp=2, zero=3), Layout(dp=4, zero=3)]


def test_split_range_is_array_split():
    assert [split_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_stage_layers_balanced():
    assert stage_layers(10, 4) == [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert stage_layers(8, 2, interleave=2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError):
        stage_layers(3, 4)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.short())
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt"])
def test_shards_cover_each_parameter_once_per_replica(layout, model):
    spec = PRESETS[model]
    for p in parameters(spec, head="lm"):
        held = [shard_box(p, spec, layout, i) for i in range(layout.size)]
        total = sum(box_numel(b) for b in held if b is not None)
        replicas = layout.cp * (layout.dp if layout.zero < 3 else 1) * (layout.tp if p.tp_dim is None else 1)
        copies = 2 if p.where == "first+last" and layout.pp > 1 else 1
        assert total == p.numel * replicas * copies, p.name


@pytest.mark.parametrize("src,dst", list(itertools.product(LAYOUTS[:6], repeat=2))[::5])
def test_plan_delivers_exactly_what_is_needed(src, dst):
    mesh = Mesh.block(0, 4)
    plan = transfer_plan(TINY, head="lm", src=(mesh, src), dst=(mesh, dst), gpus_per_node=4)
    params = {p.name: p for p in parameters(TINY, head="lm")}
    got: dict[tuple[str, int], int] = {}
    for t in plan:
        got[(t.param, t.dst)] = got.get((t.param, t.dst), 0) + t.numel
        owner = shard_box(params[t.param], TINY, src, mesh.ranks.index(t.src))
        assert owner is not None and all(o0 <= b0 and b1 <= o1 for (o0, o1), (b0, b1) in zip(owner, t.box))
    for name, p in params.items():
        for local, rank in enumerate(mesh.ranks):
            need = shard_box(p, TINY, dst, local)
            assert got.get((name, rank), 0) == (box_numel(need) if need else 0)


def test_identical_layouts_move_nothing_and_disjoint_meshes_move_everything():
    lay = Layout(dp=2, tp=2)
    held = sum(box_numel(b) for p in parameters(TINY, head="lm") for i in range(4)
               if (b := shard_box(p, TINY, lay, i)) is not None)
    same = transfer_volume(TINY, head="lm", src=(Mesh.block(0, 4), lay), dst=(Mesh.block(0, 4), lay), gpus_per_node=4)
    assert same.moved_numel == 0 and same.local_numel == held
    apart = transfer_volume(TINY, head="lm", src=(Mesh.block(0, 4), lay), dst=(Mesh.block(4, 4), lay), gpus_per_node=4)
    assert apart.moved_numel == held and apart.local_numel == 0
    # Each receiver takes from a sender on its own node when one exists... here none does.
    assert all(s // 4 == 0 and d // 4 == 1 for s, d in apart.by_pair)


@pytest.mark.parametrize("src,dst", [(Layout(dp=4), Layout(tp=2, pp=2)), (Layout(tp=4), Layout(dp=2, pp=2)),
                                     (Layout(dp=2, tp=2, zero=3), Layout(pp=4))])
@pytest.mark.parametrize("offset", [0, 2, 4])
def test_grouped_volume_equals_explicit_plan(src, dst, offset):
    spec = PRESETS["tiny-gpt"]
    a, b = (Mesh.block(0, 4), src), (Mesh.block(offset, 4), dst)
    plan = transfer_plan(spec, head="value", src=a, dst=b, gpus_per_node=2)
    vol = transfer_volume(spec, head="value", src=a, dst=b, gpus_per_node=2)
    pairs: dict[tuple[int, int], int] = {}
    for t in plan:
        if t.src != t.dst:
            pairs[(t.src, t.dst)] = pairs.get((t.src, t.dst), 0) + t.numel
    assert vol.by_pair == dict(sorted(pairs.items()))
    assert vol.local_numel == sum(t.numel for t in plan if t.src == t.dst)


EVEN = resolve_model("model_type=llama,hidden_size=64,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
                     "intermediate_size=128,vocab_size=256")


@pytest.mark.parametrize("src,dst", [(Layout(dp=4, zero=3), Layout(tp=2, pp=2)), (Layout(dp=2, tp=2, zero=3), Layout(tp=4)),
                                     (Layout(tp=2, pp=2), Layout(dp=2, tp=2, zero=3)), (Layout(tp=4), Layout(dp=4))])
@pytest.mark.parametrize("offset", [0, 2])
def test_rank_volumes_of_evenly_cut_tensors_equal_the_explicit_plan(src, dst, offset):
    """Tensors both layouts cut evenly the same way are costed once, at the smallest such shape,
    and scaled (`cost_models.transfer._unit`): per rank and per link, in elements and in slices,
    the same as the pure-Python transfer plan."""
    from cost_models.transfer import _unit, rank_volumes

    a, b = (Mesh.block(0, 4), src), (Mesh.block(offset, 4), dst)
    assert all(_unit(p.shape, p.tp_dim, p.expert_dim, src, dst) is not None for p in parameters(EVEN, head="lm"))
    plan = transfer_plan(EVEN, head="lm", src=a, dst=b, gpus_per_node=2)
    vol = rank_volumes(EVEN, head="lm", src=a, dst=b, gpus_per_node=2)
    ranks = range(vol.first, vol.first + len(vol.send_intra))
    moved = [t for t in plan if t.src != t.dst]
    want = {
        "send_intra": [sum(t.numel for t in moved if t.src == r and t.dst // 2 == r // 2) for r in ranks],
        "recv_inter": [sum(t.numel for t in moved if t.dst == r and t.src // 2 != r // 2) for r in ranks],
        "send_pieces": [sum(t.src == r for t in moved) for r in ranks],
        "recv_pieces": [sum(t.dst == r for t in moved) for r in ranks],
        "local_pieces": [sum(t.dst == r and t.src == r for t in plan) for r in ranks],
    }
    for name, values in want.items():
        assert [int(x) for x in getattr(vol, name)] == values, name
    assert vol.local_numel == sum(t.numel for t in plan if t.src == t.dst)
