"""What the runtime can run of a plan: one list of rules, read by the runtime and `planner validate`.

The schema accepts plans the runtime refuses (a layout dimension it does not implement yet, a
placement its parameter handling cannot follow) and plans it runs differently from how they were
costed (a batch that does not split evenly). The runtime refuses the first kind before building
anything (`runtime_problems`); `planner validate` lists both, so neither surprises anyone at launch.
A compiled plan has neither: the search only proposes layouts that pass `layout_runtime_problems`
and split their batch evenly.
"""

from __future__ import annotations

from plans.layout import Layout
from plans.model import ModelSpec
from plans.plan import Plan, PlanCall
from plans.sharding import slices_key


def layout_runtime_problems(layout: Layout) -> list[str]:
    """The layout dimensions of `layout` the runtime does not implement."""
    problems = []
    if layout.cp > 1 and layout.ep > 1:
        problems.append(f"context parallel (cp={layout.cp}) with expert parallel (ep={layout.ep}) is not run by the "
                        "runtime yet")
    if layout.interleave != 1:
        problems.append(f"interleaved pipelines (interleave={layout.interleave}) are not run by the runtime yet")
    return problems


def expert_layout_problems(spec: ModelSpec, layout: Layout) -> list[str]:
    """How the runtime cannot split `spec`'s experts under `layout` (empty when it can): experts
    are split over tp like the dense MLP (etp = tp), and expert-parallel training keeps full
    optimizer states (ZeRO 0)."""
    if not spec.is_moe:
        return []
    problems = []
    if layout.etp != layout.tp:
        problems.append(f"experts whole on each tensor-parallel rank (etp={layout.etp} with tp={layout.tp}) are not "
                        "run by the runtime yet")
    if layout.ep > 1 and layout.zero:
        problems.append(f"ZeRO {layout.zero} with expert parallel (ep={layout.ep}) is not run by the runtime yet")
    return problems


def batch_units(call: PlanCall) -> tuple[int, int]:
    """(rows one optimizer step or one call processes, rows that must stay together: 2 for a
    DPO pair, else 1)."""
    rows = call.step_seqs
    return rows, 2 if call.loss == "dpo" else 1


def runtime_problems(plan: Plan, *, reference: bool = False) -> list[str]:
    """Why the runtime cannot run `plan` (empty when it can); with `reference`, in one process,
    where every call runs unsharded: then the layouts do not matter, but the models' own limits
    and how the plan says parameters move still must hold."""
    problems = []
    for c in plan.calls:
        spec = plan.models[c.model].spec
        if c.seq_len > spec.max_position_embeddings:
            problems.append(f"call {c.name!r}: sequences of {c.seq_len} tokens exceed model {c.model!r}'s "
                            f"max_position_embeddings {spec.max_position_embeddings}")
    homes = plan.graph().home_calls()
    listed = {(r.model, r.to_call) for r in plan.reallocations}
    for r in plan.reallocations:
        if r.from_call != homes[r.model]:
            problems.append(f"the plan reallocates {r.model!r} from {r.from_call!r} to {r.to_call!r}, but the model's "
                            f"parameters live with its home call {homes[r.model]!r}")
        if r.to_call == homes[r.model]:
            problems.append(f"the plan reallocates {r.model!r} to its home call {r.to_call!r}")
    for c in plan.calls:
        problems += _placement_problems(plan, c, homes=homes, listed=listed)
        if reference:
            continue
        for what, layout in (("layout", c.layout), ("decode layout", c.decode_layout)):
            if layout is not None:
                problems += [f"call {c.name!r} {what} {layout.short()}: {p}" for p in
                             layout_runtime_problems(layout) + expert_layout_problems(spec, layout)]
        rows, group = batch_units(c)
        if rows // group < c.layout.dp:
            what = "each minibatch of" if c.kind == "train" else "the batch of"
            problems.append(f"call {c.name!r}: {what} {rows} sequences cannot split over dp={c.layout.dp}")
    return problems


def _placement_problems(plan: Plan, c: PlanCall, *, homes: dict[str, str], listed: set[tuple[str, str]]) -> list[str]:
    """Whether call `c` gets its parameters the way the runtime moves them: from its model's home
    placement, as it is (the same slices) or by a listed reallocation."""
    problems: list[str] = []
    home = plan.call(homes[c.model])
    if c.name == home.name or (c.mesh, c.layout) == (home.mesh, home.layout):
        return problems
    if c.kind == "train":
        problems.append(f"model {c.model!r} is trained by {c.name!r} on {c.mesh.short()} {c.layout.short()} and by "
                        f"{home.name!r} on {home.mesh.short()} {home.layout.short()}; the runtime keeps one "
                        "optimizer state per model, so its train calls must share one placement")
    elif (c.model, c.name) not in listed and slices_key(c.mesh, c.layout) != slices_key(home.mesh, home.layout):
        problems.append(f"call {c.name!r} runs {c.model!r} on {c.mesh.short()} {c.layout.short()}, which does not "
                        f"hold the slices of its home {home.name!r} ({home.mesh.short()} {home.layout.short()}), "
                        "but the plan lists no reallocation to it")
    return problems


def split_problems(plan: Plan) -> list[str]:
    """Calls the runtime runs, but not as the plan costs them: a batch that does not split evenly
    over the data-parallel replicas, or a replica's share over its micro-batches (the runtime
    then gives replicas unequal shares, or runs fewer micro-batches, than the estimate assumes)."""
    problems = []
    for c in plan.calls:
        rows, group = batch_units(c)
        units, dp, mb = rows // group, c.layout.dp, c.layout.micro_batches
        unit = "pairs" if group == 2 else "sequences"
        if units >= dp and units % dp:
            problems.append(f"call {c.name!r}: {units} {unit} per {'optimizer step' if c.kind == 'train' else 'call'} "
                            f"do not split evenly over dp={dp}")
        elif units >= dp and (units // dp) % mb:
            problems.append(f"call {c.name!r}: each data-parallel replica's {units // dp} {unit} do not split into "
                            f"micro_batches={mb}")
    return problems
