"""Lowering: the augmented graph of the unrolled iteration (networkx).

Nodes: ``("call", u, name)``, call `name` in iteration `u`. A call that is not its model's home
first moves the parameters from the home call's placement; that reallocation belongs to the
call's op (its time depends on both choices: `planner.problem.Problem.realloc`), so it is no node
of its own.

Edges carry ``kind``:
- ``"data"``: a handle written by one call and read by another in the same iteration (attribute
  ``handle``); the transfer time depends on both placements;
- ``"version"``: parameter versions. A model's calls in an iteration read the parameters its
  train call then updates, so they precede it; its calls in the next iteration read the update,
  so they follow it (and a call declared after the train call reads the new version and precedes
  the next train).

The iteration is unrolled `unroll` times so that calls of iteration i+1 may overlap iteration i
where these dependencies allow.
"""

from __future__ import annotations

import networkx as nx

from plans.graph import Graph


def augmented_graph(graph: Graph, *, unroll: int = 2) -> nx.DiGraph:
    """The unrolled dependency graph of `graph`."""
    g = nx.DiGraph()
    order = graph.topo_order()
    pos = {name: i for i, name in enumerate(order)}
    homes = graph.home_calls()
    for u in range(unroll):
        for name in order:
            call = graph.call(name)
            g.add_node(("call", u, name), call=name, model=call.model, kind=call.kind, iteration=u)
        for src, dst, handle in graph.edges():
            g.add_edge(("call", u, src), ("call", u, dst), kind="data", handle=handle)
    for name in order:
        call = graph.call(name)
        home = homes[call.model]
        if graph.call(home).kind != "train" or name == home:
            continue
        for u in range(unroll):
            if pos[name] < pos[home]:
                g.add_edge(("call", u, name), ("call", u, home), kind="version")
                if u + 1 < unroll:
                    g.add_edge(("call", u, home), ("call", u + 1, name), kind="version")
            else:
                g.add_edge(("call", u, home), ("call", u, name), kind="version")
                if u + 1 < unroll:
                    g.add_edge(("call", u, name), ("call", u + 1, home), kind="version")
    for name in order:
        if homes[graph.call(name).model] == name and graph.call(name).kind == "train":
            for u in range(unroll - 1):
                g.add_edge(("call", u, name), ("call", u + 1, name), kind="version")
    assert nx.is_directed_acyclic_graph(g), "unrolled dependencies must be acyclic"
    return g
