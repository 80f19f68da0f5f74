"""Memory and cost of one pipeline stage task: the estimate the stage planner fits.

Pure Python (standard library and ``strata.memory`` / ``strata.modelspec`` only): the
coordinator plans with it, from the model's ``ModelProfile`` alone. It models the GPipe runner
``worker/trainers/gpipe.py`` (all forwards, then all backwards). ``StageCostModel`` answers for
any contiguous layer range ``[first, last)`` in O(1) after an O(L) pass: ``estimate`` (the
task's PEAK allocator bytes, what its budget comes from), ``memory`` (the planner's demand:
separable as ``total(X[last] - Y[first])`` with ``total`` non-decreasing, and never below
``estimate``), ``breakdown`` (the terms, adding up to ``memory``) and ``cost`` (per example).
``strata.planner`` searches the splits with it (``docs/planner.md``); ``stage_memory`` is the
one-off form.

Terms, calibration and costs: docs/memory.md, "Pipeline stages".
"""

from __future__ import annotations

from strata.errors import SpecError

import math
from dataclasses import dataclass
from typing import Any, Sequence

from strata.cpukernels import ANY, EIGEN
from strata.memory import (
    FIXED_OVERHEAD, FRAGMENTATION, OPTIMIZER_SLOTS, layer_workspaces, optimizer_buffers,
    RATES, pipeline_share, rates_of, update_transient_bytes,
)
from strata.modelspec import ModelProfile

__all__ = [
    "StageCostModel", "stage_memory", "MIXED_PRECISION_MODES", "PIPELINE_ACTIVATION_BYTES",
    "PIPELINE_MIXED_ACTIVATION_BYTES", "PIPELINE_INPUT_BATCHES",
]

MIXED_PRECISION_MODES = ("none", "bfloat16", "float16")

# Calibrated against worker/trainers/gpipe.py (docs/memory.md, "Pipeline stages", Calibration).
# per kept layer output element per example, float32 and with bfloat16/float16 compute, on
# Eigen's kernels (``strata.memory.KernelRates.pipeline``: each family's own)
PIPELINE_ACTIVATION_BYTES, PIPELINE_MIXED_ACTIVATION_BYTES = RATES[EIGEN].pipeline
PIPELINE_INPUT_BATCHES = 2.0           # input batches alive on the first stage (batch + split)


def kept_share(kind: str, kernels: str = ANY) -> float:
    """The share of a ``kind`` layer's output a pipeline stage keeps for its backward pass,
    against a Dense layer's (the pipeline rates were measured on Dense stacks), on ``kernels``
    (``strata.memory.KernelRates.pipeline_shares``, fitted per family: a normalisation's or
    activation's output is mostly computed in place, a sum's or padding's not kept at all)."""
    return pipeline_share(rates_of(kernels), kind)


def _check_optimizer(optimizer: str) -> str:
    name = str(optimizer).lower()
    if name not in OPTIMIZER_SLOTS:
        raise SpecError("training.optimizer.name", f"unknown optimizer {optimizer!r} "
                         f"(known: {', '.join(OPTIMIZER_SLOTS)})")
    return name


def _check_settings(profile: ModelProfile, microbatch: int, microbatches: int, replicas: int,
                    mixed_precision: str) -> None:
    """``StageCostModel``'s settings checked, each error naming its spec field."""
    if not profile.layers:
        raise SpecError("model", "has no layers to split into stages")
    if not isinstance(microbatch, int) or microbatch < 1:
        raise SpecError("microbatches", f"the micro-batch size must be a positive integer, "
                         f"got {microbatch!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise SpecError("microbatches", f"must be a positive integer, got {microbatches!r}")
    if not isinstance(replicas, int) or replicas < 1:
        raise SpecError("replicas", f"must be a positive integer, got {replicas!r}")
    if mixed_precision not in MIXED_PRECISION_MODES:
        raise SpecError("memory.mixed_precision", f"unknown mode {mixed_precision!r} "
                         f"(known: {', '.join(MIXED_PRECISION_MODES)})")


class StageCostModel:
    """Memory and cost of any contiguous stage in O(1), after an O(L) prefix-sum pass.

    ``memory(first, last)`` and ``cost(first, last)`` take half-open layer ranges. The memory
    terms are listed in docs/memory.md, "Pipeline stages"; ``breakdown`` returns them one by
    one. Internally
    ``memory(a, b) = total(X[b] - Y[a])`` with ``total`` non-decreasing: the planner relies on
    that separable form (``docs/planner.md``, point 3)."""

    def __init__(self, profile: ModelProfile, *, microbatch: int, microbatches: int,
                 optimizer: str = "adam", mixed_precision: str = "none",
                 recompute: bool = False, replicas: int = 1,
                 layer_costs: Sequence[float] | None = None, label_bytes: int = 8,
                 data_bytes: int = 0, compressed: bool = False, kernels: str = ANY):
        _check_settings(profile, microbatch, microbatches, replicas, mixed_precision)
        self.profile = profile
        self.layers = profile.layers
        self.L = len(self.layers)
        self.microbatch = microbatch
        self.microbatches = microbatches
        self.optimizer = _check_optimizer(optimizer)
        self.mixed = mixed_precision != "none"
        self.recompute = bool(recompute)
        self.replicas = replicas
        self.label_bytes = int(label_bytes)
        self.data_bytes = int(data_bytes)
        self._coefficients(compressed, kernels)
        self._prefix_sums(kernels)
        x, y = self._ends()
        # ``estimate`` takes the exact transients: these, before they are folded in
        self._x0, self._y0 = list(x), list(y)
        self._fold_transients(x, y, kernels)
        self._x, self._y = x, y
        self._f = self._cost_prefix(layer_costs)

    def _coefficients(self, compressed: bool, kernels: str) -> None:
        """The per-unit coefficients (bytes per parameter, per trainable parameter and per
        kept output element) and the examples whose inputs and labels are in flight."""
        m, M, replicas = self.microbatch, self.microbatches, self.replicas
        self.c_weight = 4 + (2 if self.mixed else 0)
        slots = optimizer_buffers(self.optimizer)
        self.accumulates = M > 1 or replicas > 1
        # 16-bit copies of the exchanged gradients (``gradients.compression``, replicas only)
        self.c_wire = 2 * replicas if compressed and replicas > 1 else 0
        self.acc_share = rates_of(kernels).accumulator if self.accumulates else 0.0
        self.c_train = 4 * (1 + self.acc_share + slots + max(0, replicas - 1)) \
            + self.c_wire
        per_elem = rates_of(kernels).pipeline[1 if self.mixed else 0]
        self.c_act = per_elem * m * (1 if self.recompute else M)
        self.in_flight_examples = PIPELINE_INPUT_BATCHES * m * M * replicas  # global batches
        self.label_examples = PIPELINE_INPUT_BATCHES * m * M  # one replica's batches

    def _prefix_sums(self, kernels: str) -> None:
        """Prefix sums over the layers of parameters, trainable parameters and kept output
        elements (weighted by kind)."""
        L = self.L
        pp = [0] * (L + 1)
        pt = [0] * (L + 1)
        pa: list[float] = [0.0] * (L + 1)  # kept output elements, weighted by kind
        for i, layer in enumerate(self.layers):
            pp[i + 1] = pp[i] + layer.params
            pt[i + 1] = pt[i] + layer.trainable_params
            pa[i + 1] = pa[i] + kept_share(layer.kind, kernels) * layer.output_elems \
                + layer.internal_elems
        self._pp, self._pt, self._pa = pp, pt, pa

    def _ends(self) -> tuple[list[float], list[float]]:
        """X[b]: the terms that grow with the end b; Y[a]: with the start a (subtracted);
        the transients not yet in."""
        L, pp, pt, pa = self.L, self._pp, self._pt, self._pa
        cw, ct, ca = self.c_weight, self.c_train, self.c_act
        x = [0.0] * (L + 1)
        y = [0.0] * (L + 1)
        for i in range(L + 1):
            base = cw * pp[i] + ct * pt[i] + ca * pa[i]
            x[i] = base + (self._grad_out(i) if i < L else self._labels())
            y[i] = base - self._boundary_in(i) - self._grad_in(i) - (self._input_data() if i == 0
                                                                      else 0)
        return x, y

    def _fold_transients(self, x: list[float], y: list[float], kernels: str) -> None:
        """Transients: a convolution's workspace (backward pass, on top of the activations) or
        the optimizer update's temporaries (after it, activations freed), each the largest
        over the stage's layers. A max over the range is not a prefix-sum difference, so the
        planner's search (``memory``) bounds it from one end: "the largest of the layers from
        a on" and "of the layers before b" both bound it and each depends on one end only;
        the one that overstates less on this model is folded into Y (or X), in place.
        ``estimate``, the figure budgets come from, takes the exact range maximum and the
        larger of the two phases, and is never above ``memory``."""
        L, layers, m = self.L, self.layers, self.microbatch
        # a layer that shrinks its input (pooling) makes, in its backward pass, a gradient of
        # its input's size per micro-batch besides the boundary terms: measured, a 2 x 2 max
        # pool of a 24x24x64 map failed allocating that gradient ([64, 24, 24, 64],
        # MaxPoolGrad) 14 MiB above its stage's estimate
        self._ws = [w + (4 * self._in_elems(i) * m if self._in_elems(i) >= 2 * layer.output_elems
                         else 0)
                    for i, (w, layer) in enumerate(zip(layer_workspaces(self.profile, kernels),
                                                       layers))]
        self._upd = [update_transient_bytes(layer, self.optimizer) for layer in layers]
        # per layer: what the stage's peak can exceed the backward-pass terms by when the
        # layer's transient is the stage's largest. The update's temporaries come when the
        # layer's own activations (part of those terms) are freed, so only their excess over
        # them counts: static + U_j <= backward terms - acts_j + U_j.
        t = [max(w, u - int(self.c_act * layer.output_elems), 0)
             for w, u, layer in zip(self._ws, self._upd, layers)]
        self.transient_from = [0] * (L + 1)   # per start a: the transient memory() counts
        self.transient_to = [0] * (L + 1)     # per end b
        if not any(t):
            return
        suf = [0] * (L + 1)
        for i in range(L - 1, -1, -1):
            suf[i] = max(suf[i + 1], t[i])
        pre = [0] * (L + 1)
        for i in range(L):
            pre[i + 1] = max(pre[i], t[i])
        over_suf = sum(suf[i] - t[i] for i in range(L))
        over_pre = sum(pre[i + 1] - t[i] for i in range(L))
        if over_suf <= over_pre:
            self.transient_from = suf
            for i in range(L):
                y[i] -= suf[i]
        else:
            self.transient_to = pre
            for i in range(1, L + 1):
                x[i] += pre[i]

    def _cost_prefix(self, layer_costs: Sequence[float] | None) -> list[float]:
        """Sets the cost factor and unit; returns the prefix sums of the per-layer costs."""
        L = self.L
        if layer_costs is None:
            per_layer: list[float] = [l.flops for l in self.layers]
            self.cost_factor: float = 4 if self.recompute else 3
            self.cost_unit = "FLOPs"
        else:
            per_layer = list(layer_costs)
            if len(per_layer) != L:
                raise SpecError("layer_costs", f"{len(per_layer)} values for {L} layers")
            for c in per_layer:
                if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) \
                        or c < 0:
                    raise SpecError("layer_costs", f"every cost must be a finite number >= 0, "
                                     f"got {c!r}")
            self.cost_factor = 4 / 3 if self.recompute else 1
            self.cost_unit = "measured"
        f: list[float] = [0.0] * (L + 1)
        for i, c in enumerate(per_layer):
            f[i + 1] = f[i] + c
        return f

    # -- boundary terms (functions of one end only)

    def _in_elems(self, a: int) -> int:
        return self.profile.input_elems if a == 0 else self.layers[a - 1].output_elems

    def _boundary_in(self, a: int) -> float:
        return 4 * self._in_elems(a) * self.microbatch * self.microbatches if a < self.L else 0

    def _grad_in(self, a: int) -> float:
        return 4 * self._in_elems(a) * self.microbatch if 0 < a < self.L else 0

    def _grad_out(self, b: int) -> float:
        held = min(self.microbatches, 2)  # received early: docs/memory.md, "Pipeline stages"
        return 4 * self.layers[b - 1].output_elems * self.microbatch * held if 0 < b < self.L \
            else 0

    def _input_data(self) -> float:
        return self.in_flight_examples * 4 * self.profile.input_elems + self.data_bytes

    def _labels(self) -> float:
        return self.label_examples * self.label_bytes

    # -- queries

    def _check(self, first: int, last: int) -> None:
        if not (0 <= first < last <= self.L):
            raise ValueError(f"stage layers [{first}, {last}) must be a non-empty range of "
                             f"0..{self.L}")

    def bound(self, i: int) -> int:
        """The layer boundary of search boundary ``i`` (itself; see ``CutView``)."""
        return i

    def memory(self, first: int, last: int) -> int:
        """The planner's demand for a task holding layers ``[first, last)``: the estimate with
        its transient bounded from one end (separable; see ``__init__``), never below
        ``estimate(first, last)``."""
        self._check(first, last)
        c = math.ceil(self._x[last] - self._y[first])
        return c + FIXED_OVERHEAD + math.ceil(FRAGMENTATION * c)

    def estimate(self, first: int, last: int) -> int:
        """Estimated peak bytes of a task holding layers ``[first, last)``: the larger of the
        backward pass (every term, plus the largest convolution workspace) and the optimizer
        step (weights, gradients, accumulators, slots and the data held, plus the update's
        temporaries of the stage's largest variable)."""
        self._check(first, last)
        a, b = first, last
        ws = max(self._ws[a:b])
        upd = max(self._upd[a:b])
        backward = self._x0[b] - self._y0[a] + ws
        static = (self.c_weight * (self._pp[b] - self._pp[a])
                  + self.c_train * (self._pt[b] - self._pt[a])
                  + (self._input_data() if a == 0 else 0) + (self._labels() if b == self.L else 0))
        c = math.ceil(max(backward, static + upd))
        return c + FIXED_OVERHEAD + math.ceil(FRAGMENTATION * c)

    def cost(self, first: int, last: int) -> float:
        """Per-example training cost of layers ``[first, last)`` (docs/memory.md, "Pipeline
        stages", Costs)."""
        self._check(first, last)
        return (self._f[last] - self._f[first]) * self.cost_factor

    def total_lower_bound(self, stages: int) -> float:
        """A lower bound on the summed memory of any split into ``stages`` stages: the whole
        model's terms, the cheapest cut's boundary terms for each cut, and each stage's fixed
        overhead (every stage costs at least total(X[b] - Y[a]) >= (1 + FRAGMENTATION) x
        (X[b] - Y[a]) + FIXED_OVERHEAD, and the X - Y differences telescope)."""
        L = self.L
        cut = min((self._x[c] - self._y[c] for c in range(1, L)), default=0.0)
        raw = self._x[L] - self._y[0] + (stages - 1) * max(cut, 0.0)
        return (1 + FRAGMENTATION) * raw + stages * FIXED_OVERHEAD

    def breakdown(self, first: int, last: int) -> dict[str, int]:
        """The memory terms of a stage (bytes, each rounded up; ``overhead`` takes the rounding
        so that the terms add up to ``total``, which equals ``memory(first, last)``)."""
        self._check(first, last)
        params = self._pp[last] - self._pp[first]
        train = self._pt[last] - self._pt[first]
        acts = self._pa[last] - self._pa[first]
        slots = optimizer_buffers(self.optimizer)
        terms = {
            "weights": self.c_weight * params,
            "gradients": 4 * train,
            "accumulator": math.ceil(4 * self.acc_share * train),
            "optimizer_slots": 4 * slots * train,
            "collective": (4 * max(0, self.replicas - 1) + self.c_wire) * train,
            "activations": math.ceil(self.c_act * acts),
            "boundary_input": math.ceil(self._boundary_in(first)),
            "boundary_gradients": math.ceil(self._grad_in(first) + self._grad_out(last)),
            "input_data": math.ceil(self._input_data()) if first == 0 else 0,
            "labels": math.ceil(self._labels()) if last == self.L else 0,
            "transient": self.transient_from[first] + self.transient_to[last],
        }
        total = self.memory(first, last)
        terms["overhead"] = total - sum(terms.values())
        terms["total"] = total
        return terms


def stage_memory(profile: ModelProfile, first: int, last: int, *, microbatch: int,
                 microbatches: int, optimizer: str = "adam", mixed_precision: str = "none",
                 recompute: bool = False, stage_index: int | None = None,
                 num_stages: int | None = None, replicas: int = 1, label_bytes: int = 8,
                 data_bytes: int = 0) -> int:
    """Bytes of a GPipe stage task holding ``profile.layers[first:last]`` (terms: docs/memory.md,
    "Pipeline stages"). Whether it is the first or last stage follows from the range (first ==
    0, last == number of layers); ``stage_index`` and ``num_stages``, when given, are checked
    against it. For many queries build a ``StageCostModel`` once."""
    model = StageCostModel(profile, microbatch=microbatch, microbatches=microbatches,
                           optimizer=optimizer, mixed_precision=mixed_precision,
                           recompute=recompute, replicas=replicas, label_bytes=label_bytes,
                           data_bytes=data_bytes)
    model._check(first, last)
    if stage_index is not None and (stage_index == 0) != (first == 0):
        raise ValueError(f"stage_index {stage_index} does not match first layer {first}: "
                         "stage 0 is the one that starts at layer 0")
    if num_stages is not None and stage_index is not None \
            and (stage_index == num_stages - 1) != (last == model.L):
        raise ValueError(f"stage {stage_index} of {num_stages} does not match last layer {last}: "
                         "the last stage is the one that ends at the last layer")
    return model.memory(first, last)


@dataclass(frozen=True)
class _Block:
    """What a ``CutView`` calls a layer: the layers between two cut points."""

    name: str


class CutView:
    """A ``StageCostModel`` seen only at the model's cut points (``ModelProfile.cut_points``):
    a unit is the run of layers between two of them, so a split of the units is a split of
    the layers that cuts only where one tensor crosses. The arrays the planner searches
    (``_x``, ``_y``, ``_f``) are the model's own at those boundaries, so memory and cost keep
    their separable form and the search stays exact. ``bound(i)`` maps a unit boundary back
    to a layer boundary; ``layers`` names the units (``first..last``)."""

    def __init__(self, model: StageCostModel, cuts: Sequence[int]):
        self.base = model
        self.points = [0] + [int(c) for c in cuts] + [model.L]
        p = self.points
        self.L = len(p) - 1
        self._x = [model._x[i] for i in p]
        self._y = [model._y[i] for i in p]
        self._f = [model._f[i] for i in p]
        names = [l.name for l in model.layers]
        self.layers = tuple(
            _Block(names[p[i]] if p[i + 1] - p[i] == 1 else f"{names[p[i]]}..{names[p[i + 1] - 1]}")
            for i in range(self.L))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)

    def bound(self, i: int) -> int:
        return self.points[i]

    def memory(self, first: int, last: int) -> int:
        return self.base.memory(self.points[first], self.points[last])

    def estimate(self, first: int, last: int) -> int:
        return self.base.estimate(self.points[first], self.points[last])

    def cost(self, first: int, last: int) -> float:
        return self.base.cost(self.points[first], self.points[last])

    def breakdown(self, first: int, last: int) -> dict[str, int]:
        return self.base.breakdown(self.points[first], self.points[last])

    def total_lower_bound(self, stages: int) -> float:
        L = self.L
        cut = min((self._x[c] - self._y[c] for c in range(1, L)), default=0.0)
        raw = self._x[L] - self._y[0] + (stages - 1) * max(cut, 0.0)
        return (1 + FRAGMENTATION) * raw + stages * FIXED_OVERHEAD
