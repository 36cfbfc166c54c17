"""ClusterSpec parsing and defaults; Layout and Mesh rules."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from plans.cluster import parse_cluster
from plans.errors import PlannerError
from plans.layout import Coord, Layout, Mesh


def test_shorthand_and_datasheet_defaults():
    cl = parse_cluster("h100-sxm:2x8")
    assert (cl.gpu, cl.nodes, cl.gpus_per_node, cl.world_size) == ("h100-sxm", 2, 8, 16)
    assert cl.intra_node_gbps == 3600 and cl.inter_node_gbps == 3200 and cl.mem_gib == 80
    assert cl.node_of(7) == 0 and cl.node_of(8) == 1


def test_overrides_round_trip_through_short():
    cl = parse_cluster("a100-80gb:64x8,inter_node_gbps=800,intra_node_gbps=1200")
    assert cl.inter_node_gbps == 800 and cl.intra_node_gbps == 1200
    assert parse_cluster(cl.short()) == cl


@pytest.mark.parametrize("text,needle", [
    ("b200:1x8", "unknown GPU 'b200'"),
    ("a100-80gb", "malformed cluster"),
    ("a100-80gb:2by8", "malformed cluster"),
    ("a100-80gb:0x8", "nodes"),
    ("a100-80gb:2x8,foo=1", "cannot read override 'foo=1'"),
    ("a100-80gb:2x8,inter_node_gbps=fast", "must be a number"),
])
def test_bad_cluster_strings(text, needle):
    with pytest.raises(PlannerError, match=needle):
        parse_cluster(text)


def test_cluster_files(tmp_path):
    (tmp_path / "c.yaml").write_text("gpu: a100-40gb\nnodes: 4\ngpus_per_node: 8\ninter_node_gbps: 400\n")
    assert parse_cluster(str(tmp_path / "c.yaml")).inter_node_gbps == 400
    (tmp_path / "c.json").write_text(json.dumps({"gpu": "h200", "nodes": 1, "gpus_per_node": 8, "typo": 1}))
    with pytest.raises(PlannerError, match="typo: unknown key"):
        parse_cluster(str(tmp_path / "c.json"))
    with pytest.raises(PlannerError, match="does not exist"):
        parse_cluster(str(tmp_path / "missing.yaml"))


def test_layout_coordinates_tp_fastest_pp_slowest():
    lay = Layout(dp=2, tp=2, pp=2)
    coords = [lay.coord(i) for i in range(8)]
    assert coords[:4] == [Coord(0, 0, 0, 0), Coord(0, 0, 0, 1), Coord(0, 1, 0, 0), Coord(0, 1, 0, 1)]
    assert coords[4] == Coord(1, 0, 0, 0)
    assert all(lay.local_rank(c) == i for i, c in enumerate(coords))


@pytest.mark.parametrize("kwargs,needle", [
    ({"sequence_parallel": True}, "sequence_parallel needs tp > 1"),
    ({"zero": 2}, "ZeRO stage needs dp > 1 or cp > 1"),
    ({"interleave": 2}, "interleave > 1 needs pp > 1"),
    ({"zero": 4, "dp": 2}, "less than or equal to 3"),
    ({"recompute": "some"}, "recompute"),
])
def test_layout_rules(kwargs, needle):
    with pytest.raises(ValidationError, match=needle):
        Layout(**kwargs)


def test_mesh_alignment():
    assert Mesh.block(4, 4).alignment_error(8) is None
    assert "start at a multiple of 4" in Mesh.block(2, 4).alignment_error(8)
    assert Mesh.block(8, 16).alignment_error(8) is None
    assert Mesh.block(4, 8).alignment_error(4) is None  # nodes 1 and 2 of 4 GPUs
    assert "whole nodes" in Mesh.block(2, 8).alignment_error(4)
    assert "whole nodes" in Mesh.block(0, 12).alignment_error(8)
    with pytest.raises(ValidationError, match="contiguous"):
        Mesh(ranks=(0, 2))
