"""Pipeline planner: split a model's layers into contiguous stages and give each stage a worker.

A pure decision, like ``coordinator.placement``: standard library only (the coordinator has no
TensorFlow), no side effects, and it reads only the model's ``ModelProfile`` (per-layer
parameter counts, output sizes and FLOPs); nothing is ever built to plan it.

It decides where a ``pipeline`` or ``hybrid`` job's layers are cut and which worker runs each
stage replica. Inputs: the profile, the free workers (``WorkerSlot``: a name and a free budget
in bytes, all possibly different), the depth (``stages``; 0 lets the planner choose), the
replicas, the micro-batching and the training settings that size a stage. Output: a
``PipelinePlan`` with one ``PlannedStage`` per task (its layers, worker, memory estimate and
cost), or ``feasible=False`` with a reason that says what does not fit and what to change. It
minimises the BOTTLENECK, the slowest stage's cost, subject to every task's memory estimate
(``strata.stagememory.StageCostModel``) fitting its worker's free budget.

The search is exact, with a bounded work allowance (``WORK_LIMIT``, about a second): with many
distinct budgets the problem is strongly NP-hard, and a search that runs out returns a plan
that still fits, marked ``optimal=False`` with a proven ``lower_bound``. The design (matching
by Hall's theorem, keys, probes, the bisection, hardness and the allowance; the "points"
cited below) is in ``docs/planner.md``; the memory and cost of a stage in
``strata/stagememory.py`` (its terms: docs/memory.md, "Pipeline stages").
"""

from __future__ import annotations

from strata.errors import SpecError

import math
from dataclasses import dataclass
from typing import Any, Sequence

from strata.cpukernels import ANY
from strata.memory import FIXED_OVERHEAD, FRAGMENTATION
from strata.units import format_size
from strata.modelspec import ModelProfile
from strata.planner.search import Search, Undecided
from strata.stagememory import (  # noqa: F401  (re-exported: planner's public names)
    CutView,
    MIXED_PRECISION_MODES,
    PIPELINE_ACTIVATION_BYTES,
    PIPELINE_INPUT_BATCHES,
    PIPELINE_MIXED_ACTIVATION_BYTES,
    StageCostModel,
    stage_memory,
)

__all__ = [
    "WorkerSlot", "PlannedStage", "PipelinePlan", "StageCostModel", "stage_memory",
    "plan_pipeline", "suggest_stages", "format_plan",
]


@dataclass(frozen=True)
class WorkerSlot:
    """A worker that can take one stage task now, with its free memory budget in bytes."""

    name: str
    free_bytes: int


@dataclass(frozen=True)
class PlannedStage:
    """One task of the plan: replica ``replica`` of stage ``index`` (layers
    ``[first_layer, last_layer)``) on ``worker``. ``memory_bytes`` is the stage's demand in
    the search (``StageCostModel.memory``), ``estimate_bytes`` its estimate
    (``StageCostModel.estimate``, at most the demand: the figure its budget comes from),
    ``cost`` its per-example training cost (FLOPs or the measured unit)."""

    index: int
    worker: str
    first_layer: int
    last_layer: int
    layer_names: tuple[str, ...]
    memory_bytes: int
    cost: float
    replica: int = 0
    worker_free_bytes: int = 0
    estimate_bytes: int = 0


@dataclass(frozen=True)
class PipelinePlan:
    """The plan. ``stages`` holds one entry per task, ordered by (stage index, replica), so a
    hybrid plan has ``num_stages * replicas`` entries. ``reason`` says why an infeasible plan is
    infeasible (empty when feasible); ``bottleneck_cost`` is the slowest stage's cost.
    ``optimal`` is False only when the search ran out of its work allowance (``WORK_LIMIT``,
    ``docs/planner.md`` point 5) before it could prove the bottleneck optimal: the plan still fits,
    and the optimum is known to be at least ``lower_bound`` (which equals ``bottleneck_cost``
    when ``optimal``). For ``stages: 0`` the depth is the smallest with that bottleneck unless
    the allowance ran out."""

    feasible: bool
    reason: str
    stages: tuple[PlannedStage, ...]
    bottleneck_cost: float
    replicas: int = 1
    microbatch: int = 0
    microbatches: int = 1
    optimal: bool = True
    lower_bound: float = 0.0

    @property
    def num_stages(self) -> int:
        return len({s.index for s in self.stages})


# --------------------------------------------------------------------------------------------
# the search


# Keys. A key is the set of slot ranks its stages took (bit r = rank r; ranks 1..S from the
# largest budget). For dominance tests each key also carries its prefix counts c(t) = #taken
def _virtual_slots(workers: Sequence[WorkerSlot], replicas: int) -> list[int]:
    """``v_j = w_{jR}``: the budget the j-th replica group of workers can all offer."""
    budgets = sorted((w.free_bytes for w in workers), reverse=True)
    return [budgets[j * replicas - 1] for j in range(1, len(budgets) // replicas + 1)]


def _assign(demands: list[int], workers: Sequence[WorkerSlot], replicas: int
            ) -> dict[tuple[int, int], WorkerSlot] | None:
    """Best-fit decreasing of every (stage, replica) task to a distinct worker."""
    pool = sorted(workers, key=lambda w: (w.free_bytes, w.name))
    used: set[int] = set()
    out: dict[tuple[int, int], WorkerSlot] = {}
    tasks = sorted(((d, s, r) for s, d in enumerate(demands) for r in range(replicas)),
                   key=lambda t: (-t[0], t[1], t[2]))
    for d, s, r in tasks:
        for i, w in enumerate(pool):
            if i not in used and w.free_bytes >= d:
                used.add(i)
                out[(s, r)] = w
                break
        else:
            return None
    return out


def _microbatch(global_batch: int, replicas: int, microbatches: int) -> int:
    for name, value in (("data.batch_size", global_batch), ("microbatches", microbatches),
                        ("replicas", replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(name, f"must be a positive integer, got {value!r}")
    if global_batch % replicas:
        raise SpecError("data.batch_size", f"the global batch {global_batch} must divide evenly "
                         f"among {replicas} replicas")
    per_replica = global_batch // replicas
    if per_replica % microbatches:
        raise SpecError("microbatches", f"the per-replica batch {per_replica} (data.batch_size "
                         f"{global_batch} / {replicas} replicas) does not divide into "
                         f"{microbatches} micro-batches of equal size")
    return per_replica // microbatches


def plan_pipeline(profile: ModelProfile, workers: Sequence[WorkerSlot], *, stages: int,
                  microbatches: int, global_batch: int, replicas: int = 1,
                  optimizer: str = "adam", mixed_precision: str = "none",
                  recompute: bool = False, layer_costs: Sequence[float] | None = None,
                  label_bytes: int = 8, data_bytes: int = 0,
                  compressed: bool = False, kernels: str = ANY) -> PipelinePlan:
    """Splits ``profile``'s layers into ``stages`` contiguous stages (0: the planner picks the
    depth, fewest stages among equal bottlenecks) and places ``replicas`` copies of each on
    distinct ``workers``, minimising the slowest stage's cost subject to every task's memory
    fitting its worker's free budget. Exact; see ``docs/planner.md``.

    Raises SpecError (a ValueError naming the spec field) for inconsistent arguments; returns
    a plan with ``feasible=False`` and a ``reason`` when nothing fits."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 0:
        raise SpecError("stages", f"must be 0 (let the planner choose) or a positive integer, "
                         f"got {stages!r}")
    microbatch = _microbatch(global_batch, replicas, microbatches)
    names = [w.name for w in workers]
    if len(set(names)) != len(names):
        raise SpecError("workers", "worker names must be distinct")
    model = StageCostModel(profile, microbatch=microbatch, microbatches=microbatches,
                           optimizer=optimizer, mixed_precision=mixed_precision,
                           recompute=recompute, replicas=replicas, layer_costs=layer_costs,
                           label_bytes=label_bytes, data_bytes=data_bytes,
                           compressed=compressed, kernels=kernels)
    view = _cut_view(model, profile)
    if stages and stages > view.L and view is not model:
        return PipelinePlan(False, _too_few_cuts(profile, stages), (), 0.0, replicas,
                            microbatch, microbatches)
    return _plan(view, list(workers), stages)


def _cut_view(model: StageCostModel, profile: ModelProfile) -> Any:
    """The model as the search sees it: every boundary of a chain, only the cut points of a
    graph (``CutView``)."""
    cuts = profile.cut_points
    return model if len(cuts) == model.L - 1 else CutView(model, cuts)


def _too_few_cuts(profile: ModelProfile, stages: int) -> str:
    cuts = profile.cut_points
    names = [profile.layers[k - 1].name for k in cuts]
    where = (f"after {', '.join(repr(n) for n in names[:8])}{', ...' if len(names) > 8 else ''}"
             if names else "nowhere")
    return (f"stages: {stages} asked for but this model can be cut into at most "
            f"{len(cuts) + 1} stage{'s' if cuts else ''}: a pipeline cuts only where exactly one "
            f"tensor crosses (between blocks, never inside a branch or residual block), which "
            f"here is {where}; use fewer stages, or a data-parallel strategy")


def _plan(model: StageCostModel, workers: list[WorkerSlot], stages: int) -> PipelinePlan:
    L, R = model.L, model.replicas

    def infeasible(reason: str) -> PipelinePlan:
        return PipelinePlan(False, reason, (), 0.0, R, model.microbatch, model.microbatches)

    slots = _virtual_slots(workers, R)
    n = len(workers)
    if stages > L:
        return infeasible(f"stages: {stages} asked for but the model has only {L} layers")
    if not slots:
        if n == 0:
            return infeasible("no workers are free")
        return infeasible(f"each stage needs {R} workers (one per replica) but only {n} "
                          f"{'is' if n == 1 else 'are'} free")
    if stages > len(slots):
        if R == 1:
            return infeasible(f"stages: {stages} asked for but {n} worker"
                              f"{'s are' if n != 1 else ' is'} free")
        return infeasible(f"stages: {stages} with {R} replicas needs {stages * R} workers but "
                          f"{n} {'are' if n != 1 else 'is'} free")
    used_slots = slots[:stages] if stages else slots
    search = Search(model)
    try:
        split = search.optimise(used_slots, stages)
    except Undecided:
        return infeasible(
            "the planner found no placement within its search limit, and could not rule one "
            "out: the free budgets are many, all different and close to what the stages need "
            f"({_budget_list(workers)}); try an explicit stages value"
            f"{_advice(model, None).replace('; ', ', ', 1)}")
    if split is None:
        return infeasible(_explain(model, workers, slots, stages))
    demands = [model.memory(a, b) for a, b in split]
    assignment = _assign(demands, workers, R)
    if assignment is None:  # pragma: no cover - the search only returns placeable splits
        raise AssertionError("planner: a placeable split could not be assigned")
    out = []
    layers = getattr(model, "base", model).layers
    for s, (a, b) in enumerate(split):
        first, last = model.bound(a), model.bound(b)
        names = tuple(l.name for l in layers[first:last])
        for r in range(R):
            w = assignment[(s, r)]
            out.append(PlannedStage(s, w.name, first, last, names, demands[s], model.cost(a, b),
                                    r, w.free_bytes, model.estimate(a, b)))
    bottleneck = search.bottleneck(split)
    lower = bottleneck if search.exact else min(bottleneck, search.lower_bound())
    return PipelinePlan(True, "", tuple(out), bottleneck, R, model.microbatch,
                        model.microbatches, optimal=lower >= bottleneck, lower_bound=lower)


# --------------------------------------------------------------------------------------------
# explanations


_TERM_WORDS = {
    "weights": "weights", "gradients": "gradients", "accumulator": "gradient accumulator",
    "collective": "gradient averaging buffers", "boundary_input": "stage inputs",
    "boundary_gradients": "boundary gradients", "input_data": "input batches",
    "labels": "labels", "overhead": "overhead",
}


def _describe_terms(model: StageCostModel, terms: dict[str, int]) -> str:
    parts = []
    for name, value in terms.items():
        if name == "total" or value <= 0:
            continue
        if name == "optimizer_slots":
            word = f"{model.optimizer} slots"
        elif name == "activations":
            word = ("activations of 1 micro-batch (recomputed)" if model.recompute else
                    f"activations of {model.microbatches} micro-batch"
                    f"{'es' if model.microbatches != 1 else ''}")
        else:
            word = _TERM_WORDS.get(name, name)
        parts.append((value, f"{word} {format_size(value)}"))
    parts.sort(key=lambda p: -p[0])
    return ", ".join(p[1] for p in parts)


def _advice(model: StageCostModel, terms: dict[str, int] | None) -> str:
    tips = []
    state = 0
    if terms is not None:
        state = (terms["weights"] + terms["gradients"] + terms["accumulator"]
                 + terms["optimizer_slots"] + terms["collective"])
    if terms is None or state < terms["total"] * 0.8:
        if not model.recompute:
            tips.append("set memory.recompute: true")
        elif model.microbatch > 1:
            tips.append("use more microbatches")
        tips.append("use a smaller data.batch_size")
    if model.optimizer != "sgd" and terms is not None and terms["optimizer_slots"] > 0 \
            and state >= terms["total"] * 0.5:
        tips.append("use an optimizer with fewer slots (sgd has none)")
    tips.append("add workers with more free memory")
    return "; " + ", ".join(tips[:-1]) + (" or " if len(tips) > 1 else "") + tips[-1]


def _budget_list(workers: list[WorkerSlot]) -> str:
    text = ", ".join(format_size(w.free_bytes) for w in
                     sorted(workers, key=lambda w: -w.free_bytes)[:8])
    return text + (", ..." if len(workers) > 8 else "")


def _unplaceable_layer(model: StageCostModel, v1: int, largest: str) -> str | None:
    """The explanation when some layer fits in no stage of at most ``v1`` bytes (``largest``
    says what ``v1`` is), naming the layer that needs the most; None when every layer fits."""
    L = model.L
    X, Y = model._x, model._y
    # a layer that fits in no stage at all: min over a <= i < b of total(X[b] - Y[a])
    pre_y = []
    best = -math.inf
    for i in range(L):
        best = max(best, Y[i])
        pre_y.append(best)
    suf_x = [0.0] * L
    best = math.inf
    for i in range(L - 1, -1, -1):
        best = min(best, X[i + 1])
        suf_x[i] = best
    worst, worst_need, bad = -1, 0, 0
    for i in range(L):
        c = math.ceil(suf_x[i] - pre_y[i])
        need = c + FIXED_OVERHEAD + math.ceil(FRAGMENTATION * c)
        if need > v1:
            bad += 1
            if need > worst_need:
                worst, worst_need = i, need
    if worst < 0:
        return None
    layer = model.layers[worst]
    terms = model.breakdown(worst, worst + 1)
    if terms["total"] == worst_need:
        what = f"layer {layer.name!r} alone needs {format_size(worst_need)}"
    else:
        what = (f"every stage holding layer {layer.name!r} needs at least "
                f"{format_size(worst_need)} (alone: {format_size(terms['total'])})")
    more = f" ({bad - 1} more layer{'s' if bad > 2 else ''} fit nowhere either)" \
        if bad > 1 else ""
    return (f"{what} ({_describe_terms(model, terms)}) but {largest}{more}"
            f"{_advice(model, terms)}")


def _explain(model: StageCostModel, workers: list[WorkerSlot], slots: list[int],
             stages: int) -> str:
    """Why no placeable split exists and what to change, the first cause found: a layer that
    fits no stage, too few workers or stages, too little memory in all, the budgets' mix."""
    L, R = model.L, model.replicas
    v1 = slots[0]
    n_big = sum(1 for w in workers if w.free_bytes >= v1)
    largest = (f"the largest free worker budget is {format_size(v1)}" if R == 1 else
               f"the largest budget {R} free workers share (one per replica) is "
               f"{format_size(v1)}")
    unplaceable = _unplaceable_layer(model, v1, largest)
    if unplaceable:
        return unplaceable
    # fewest stages if every stage had the largest budget (cost ignored)
    search = Search(model)
    relaxed = search.probe(math.inf, [v1] * L, 0)
    if relaxed is None:
        return (f"no split of the {L} layers into contiguous stages fits {format_size(v1)} per "
                f"stage: the cuts each layer would need exclude each other"
                f"{_advice(model, None)}")
    k1 = len(relaxed)
    if k1 > len(slots):
        have = (f"only {len(workers)} worker{'s are' if len(workers) != 1 else ' is'} free"
                if R == 1 else f"only {len(workers)} workers are free, enough for "
                               f"{len(slots)} stage{'s' if len(slots) != 1 else ''} of {R} "
                               f"replicas")
        return (f"the model needs at least {k1} stages of <= {format_size(v1)} "
                f"({'the largest free budget' if R == 1 else 'the largest shared budget'}) "
                f"but {have}{_advice(model, None)}")
    if stages and k1 > stages:
        return (f"stages: {stages} is too few: the model needs at least {k1} stages of <= "
                f"{format_size(v1)} (the largest free budget); set stages: {k1} or more, or 0 "
                f"to let the planner choose{_advice(model, None)}")
    # total capacity
    depths = [stages] if stages else list(range(1, min(L, len(slots)) + 1))
    if not any(model.total_lower_bound(k) <= sum(slots[:k]) for k in depths):
        k = depths[-1]
        return (f"the model needs at least {format_size(model.total_lower_bound(k))} in all "
                f"({_describe_terms(model, model.breakdown(0, L))} for the whole model, plus "
                f"per-stage overheads) but the {k} largest free "
                f"{'budgets' if R == 1 else 'budgets shared by ' + str(R) + ' workers'} add up "
                f"to {format_size(sum(slots[:k]))}{_advice(model, model.breakdown(0, L))}")
    if stages and search.probe(math.inf, [v1] * stages, stages) is None:
        return (f"no split into exactly {stages} stages fits even {format_size(v1)} per stage "
                f"(every such split cuts the model after a wide layer whose output a stage "
                f"must keep for all micro-batches); {k1} stages fit: set stages: {k1} or 0"
                f"{_advice(model, None)}")
    budgets = _budget_list(workers)
    what = f"{stages}" if stages else f"at most {len(slots)}"
    return (f"no split into {what} stages gives every stage{' replica' if R > 1 else ''} its "
            f"own worker with enough free memory (free budgets: {budgets}): with every stage "
            f"at {format_size(v1)} {k1} stage{'s' if k1 != 1 else ''} would do, but only "
            f"{n_big} worker{'s have' if n_big != 1 else ' has'} that much free and the splits "
            f"into more stages need more of the larger workers than there are"
            f"{_advice(model, None)}")


# --------------------------------------------------------------------------------------------
# helpers for admission and the CLI


def suggest_stages(profile: ModelProfile, budget_bytes: int, *, global_batch: int,
                   microbatches: int = 1, replicas: int = 1, optimizer: str = "adam",
                   mixed_precision: str = "none", recompute: bool = False,
                   max_stages: int | None = None, label_bytes: int = 8,
                   data_bytes: int = 0, kernels: str = ANY) -> int | None:
    """The smallest pipeline depth whose stages each fit ``budget_bytes`` (at most
    ``max_stages``, default: one stage per layer), or None when no depth does. Used by
    admission to tell a user "this model fits as a 4-stage pipeline"."""
    microbatch = _microbatch(global_batch, replicas, microbatches)
    model = _cut_view(StageCostModel(
        profile, microbatch=microbatch, microbatches=microbatches, optimizer=optimizer,
        mixed_precision=mixed_precision, recompute=recompute, replicas=replicas,
        label_bytes=label_bytes, data_bytes=data_bytes, kernels=kernels), profile)
    limit = model.L if max_stages is None else max(0, min(int(max_stages), model.L))
    if limit < 1:
        return None
    split = Search(model).probe(math.inf, [int(budget_bytes)] * limit, 0)
    return None if split is None else len(split)


def format_plan(plan: PipelinePlan) -> str:
    """The plan as text for ``strata plan``: one line per task, or the reason it is
    infeasible."""
    if not plan.feasible:
        return f"pipeline plan: NOT feasible - {plan.reason}"
    lines = [f"pipeline plan: {plan.num_stages} stage{'s' if plan.num_stages != 1 else ''}"
             + (f" x {plan.replicas} replicas" if plan.replicas > 1 else "")
             + f", {plan.microbatches} micro-batch{'es' if plan.microbatches != 1 else ''} of "
               f"{plan.microbatch}, bottleneck cost {plan.bottleneck_cost:.4g}"
             + ("" if plan.optimal else f" (search limit reached: not proven optimal, the "
                                       f"optimum is at least {plan.lower_bound:.4g})")]
    for s in plan.stages:
        names = s.layer_names
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        rep = f" replica {s.replica}" if plan.replicas > 1 else ""
        lines.append(f"  stage {s.index}{rep} on {s.worker}: layers {s.first_layer}-"
                     f"{s.last_layer - 1} ({len(names)}: {span}), memory "
                     f"{format_size(s.memory_bytes)} of {format_size(s.worker_free_bytes)} free,"
                     f" cost {s.cost:.4g}")
    return "\n".join(lines)
