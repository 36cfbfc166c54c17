"""Baselines as restrictions of the search domain, each given its best plan within its rule.

- ``colocate``: every call on all GPUs, one layout per model (DeepSpeed-Chat, verl's default):
  the same data/tensor/pipeline degrees for all calls of a model; its train call may add ZeRO
  (with ZeRO-3 the other calls gather the parameters, as FSDP does), micro-batches and recompute.
- ``split``: the policy and its reference on one half of the cluster, the other models (critic,
  reward) on the other half, as OpenRLHF places them; each call its best layout in its half.
- ``heuristic``: a Megatron-style layout per model on all GPUs, shared by all its calls (ReaLHF's
  heuristic plan): tensor parallel over the node, the fewest pipeline stages that fit, ZeRO-1
  over data parallel; micro-batches and recompute the best for it.

Baselines keep every state on the GPU (`SearchSpace.offload` off): they stand for those systems'
default configurations, and `bench/search.py` reports what offload adds separately.

A restriction filters candidates (`static`, and the `SearchSpace` it builds) and, for one layout
per model, ties every call to its home call's mesh and degrees (`add_joint`); beam search and
CP-SAT apply the same rule, so a baseline is searched exactly like a plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cost_models import CostModel
from planner.candidates import SearchSpace, call_candidates
from planner.problem import Problem
from plans.errors import PlannerError
from plans.graph import Call, Graph, ModelDecl
from plans.layout import Layout
from plans.sharding import layout_problems

BASELINES = ("colocate", "split", "heuristic")
POLICY_MODELS = ("actor", "ref")


@dataclass
class Restriction:
    """A baseline's rule over (slot, candidate) choices."""

    name: str
    space: SearchSpace
    same_degrees: bool = False  # every call of a model uses its home call's mesh and dp/tp/pp
    half_of: dict[str, int] = field(default_factory=dict)  # model -> 0 (first half) or 1
    # With same_degrees, only these models' calls, and not their generate calls, which run on the
    # rollout engine's own layout (None: every call of every model).
    tied: frozenset[str] | None = None

    def ties(self, p: Problem, i: int) -> bool:
        """Whether slot `i` must take its home call's degrees."""
        s = p.slots[i]
        if not self.same_degrees or s.home is None:
            return False
        return self.tied is None or (s.call.model in self.tied and s.call.kind != "generate")

    def static(self, p: Problem, i: int, k: int) -> bool:
        cand = p.slots[i].cands[k]
        model = p.slots[i].call.model
        if model in self.half_of:
            half = p.cluster.world_size // 2
            lo = self.half_of[model] * half
            if not (lo <= cand.mesh.first and cand.mesh.first + cand.mesh.size <= lo + half):
                return False
        if self.ties(p, i) and not self._matches(p, i, k):
            return False
        return True

    @staticmethod
    def degrees(c) -> tuple[int, ...]:  # noqa: ANN001 - a Candidate
        lay = c.layout
        return (c.mesh.first, c.mesh.size, lay.dp * lay.cp, lay.tp, lay.pp)

    def _matches(self, p: Problem, i: int, k: int, h: int | None = None) -> bool:
        key = self.degrees(p.slots[i].cands[k])
        home = p.slots[p.slots[i].home]  # type: ignore[index]
        if h is not None:
            return self.degrees(home.cands[h]) == key
        return any(self.degrees(hc) == key for hc in home.cands)

    def __call__(self, p: Problem, i: int, k: int, choice: Sequence[int | None]) -> bool:
        """Beam-search check against the choices made so far."""
        if not self.static(p, i, k):
            return False
        home = p.slots[i].home
        if home is not None and self.ties(p, i) and choice[home] is not None:
            return self._matches(p, i, k, choice[home])
        return True

    def add_joint(self, model, p: Problem) -> None:  # noqa: ANN001 - planner.cpsat._Model
        if not self.same_degrees:
            return
        for s in p.slots:
            if s.home is None or not self.ties(p, s.index):
                continue
            home = p.slots[s.home]
            for k, c in enumerate(s.cands):
                same = [model.x[s.home][h] for h, hc in enumerate(home.cands) if self.degrees(hc) == self.degrees(c)]
                model.m.add(model.x[s.index][k] <= sum(same))


def _full_mesh_only(graph: Graph, cm: CostModel) -> SearchSpace:
    return SearchSpace(mesh_sizes=(cm.cluster.world_size,), keep_per_size=6, split_decode=False, offload=False)


def _megatron_tp(decl: ModelDecl, gpus_per_node: int) -> int:
    tp = gpus_per_node
    while tp > 1 and layout_problems(decl.spec, Layout(tp=tp)):
        tp //= 2
    return tp


def _heuristic_space(graph: Graph, cm: CostModel) -> SearchSpace:
    world = cm.cluster.world_size
    homes = graph.home_calls()
    tp_of = {m: min(_megatron_tp(d, cm.cluster.gpus_per_node), world) for m, d in graph.models.items()}

    def megatron(tp: int, pp: int | None):  # noqa: ANN202
        def ok(call: Call, decl: ModelDecl, lay: Layout) -> bool:
            zero = 1 if lay.dp > 1 else 0
            rule = lay.tp == tp and lay.cp == 1 and lay.interleave == 1
            if call.kind == "train":
                rule = rule and lay.zero == zero and lay.sequence_parallel == (tp > 1)
            return rule and (pp is None or lay.pp == pp)
        return ok

    pp_of: dict[str, int] = {}
    for model, home in homes.items():
        call, decl = graph.call(home), graph.models[model]
        space = SearchSpace(mesh_sizes=(world,), keep_per_size=64, layout_ok=megatron(tp_of[model], None))
        fits = call_candidates(call, decl, cm, space).get(world, [])
        if not fits:
            raise PlannerError(f"baseline heuristic: no Megatron-style layout (tp={tp_of[model]}) of model {model!r} fits")
        pp_of[model] = min(c.layout.pp for c in fits)

    def ok(call: Call, decl: ModelDecl, lay: Layout) -> bool:
        return megatron(tp_of[call.model], pp_of[call.model])(call, decl, lay)

    return SearchSpace(mesh_sizes=(world,), keep_per_size=6, layout_ok=ok, split_decode=False, offload=False)


def baseline_spaces(graph: Graph, cm: CostModel) -> list[SearchSpace]:
    """The candidate spaces of every baseline that applies to `graph` on this cluster."""
    out = []
    for name in BASELINES:
        try:
            out.append(restriction(name, graph, cm).space)
        except PlannerError:  # the baseline does not apply (e.g. split without critic or reward)
            continue
    return out


def restriction(name: str, graph: Graph, cm: CostModel) -> Restriction:
    """The restriction implementing baseline `name`."""
    if name == "colocate":
        return Restriction(name, _full_mesh_only(graph, cm), same_degrees=True)
    if name == "heuristic":
        return Restriction(name, _heuristic_space(graph, cm), same_degrees=True)
    if name == "split":
        if cm.cluster.world_size < 2:
            raise PlannerError("baseline split needs at least 2 GPUs")
        half_of = {m: 0 if m in POLICY_MODELS else 1 for m in graph.models}
        if len(set(half_of.values())) < 2:
            raise PlannerError(
                f"baseline split needs models on both halves: the policy ({', '.join(POLICY_MODELS)}) and others "
                f"(critic, reward); graph {graph.name!r} has {', '.join(graph.models)}"
            )
        half = cm.cluster.world_size // 2
        sizes = tuple(s for s in range(1, half + 1) if half % s == 0)
        # Meshes down to 1/8 of a half, as the main search goes down to 1/8 of the cluster: smaller
        # ones multiply the aligned positions (one per GPU at size 1) without better plans.
        blocks = 2 * SearchSpace().max_blocks
        return Restriction(name, SearchSpace(mesh_sizes=sizes, max_blocks=blocks, offload=False), half_of=half_of)
    raise PlannerError(f"unknown baseline {name!r}", hint=f"baselines: {', '.join(BASELINES)}")
