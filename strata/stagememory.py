"""Memory and cost of one pipeline stage task: the estimate the stage planner fits.

Pure Python (standard library and ``strata.memory`` / ``strata.modelspec`` only): the
coordinator plans with it, from the model's ``ModelProfile`` alone. It models the GPipe runner
``worker/trainers/gpipe.py`` (all forwards, then all backwards), as ``strata.memory`` models a
data-parallel task and ``strata.psplan`` a parameter-server one. ``strata.planner``
searches the splits with it (``docs/planner.md``).

Memory of one stage task (``StageCostModel.memory``; bytes)
-----------------------------------------------------------
The PEAK of the task's allocator while ``worker.trainers.gpipe`` runs the stage (what
``get_memory_info`` reports in the task, and what its BFC limit is checked against). With ``m``
the micro-batch size (global batch / replicas / microbatches), ``M`` the number of
micro-batches, ``R`` the replicas and the stage's layers [first, last):

- weights: 4 bytes per parameter, +2 with mixed precision (16-bit compute copies: the runner
  casts once per step, not once per micro-batch);
- gradients: 4 bytes per trainable parameter;
- accumulator: wherever the step sums gradients (the M micro-batches' gradients, M > 1; with
  M = 1 the one gradient is used as it is; or, with replicas, a gradient received from
  another replica), the kernel family's ``KernelRates.accumulator`` more gradient sizes (1 on
  Eigen, 0.75 on oneDNN: the step's graph adds each layer's gradient into the sum as the
  backward pass makes it, so a whole set never lives beside it);
- optimizer slots: ``strata.memory.optimizer_buffers(optimizer)`` x 4 bytes per trainable
  parameter (the slots, and for RMSprop one more buffer its step holds);
- collective (R > 1): every replica's task of a stage receives the other ``R - 1`` replicas'
  accumulated gradients and sums them into its own accumulator: ``R - 1`` more gradient
  sizes. (Earlier calibrations counted ``R - 2``, taking the first received gradient to reuse
  the micro-batches' place; the memory zoo (``bench/memory_zoo.py``) measured replica 1's
  tasks of a 2 x 2 hybrid job at 1.1-1.25 x that estimate and one ran out of memory, so the
  buffers do coexist.) They coexist with the task's accumulator and the sum, not with its
  backward pass: the runner sends a replica's gradients only once the receiving task has
  summed its own micro-batches (``worker.trainers.gpipe_exchange``); before it did, they
  arrived as soon as they were made and a task held one more gradient at 1.06-1.23 x its
  estimate. With ``gradients.compression`` (hybrid) the accumulated gradients
  travel as 16 bits: the task's own 16-bit copy and the ``R - 1`` it receives, 2 bytes each,
  on top (their float32 casts take the received buffers' place): ``2 R`` more bytes.
- transient: the largest convolution workspace of the stage's layers
  (``strata.memory.conv_workspace_bytes``) or optimizer-update temporaries
  (``strata.memory.update_transient_bytes``), bounded from one end for the planner's search
  (``memory``); ``estimate`` takes the exact maximum, and the larger of the backward pass and
  the optimizer step (when the activations are gone), for the budgets;
- activations: the kernel family's pipeline rate (``strata.memory.KernelRates.pipeline``;
  ``PIPELINE_ACTIVATION_BYTES`` and ``PIPELINE_MIXED_ACTIVATION_BYTES`` are Eigen's) per output
  element of the stage's layers per example, each kind at its kept share (``kept_share``),
  x m x M: GPipe keeps every
  micro-batch's activations until its backward pass. With ``recompute`` only ONE micro-batch's
  (the one being recomputed and back-propagated), x m;
- boundary input: the stage's input (the previous stage's output, or the model input for the
  first stage), float32, kept for all M micro-batches (it feeds the first layer's backward,
  and with recompute it is the checkpoint the forward is re-run from): 4 x elements x m x M;
- boundary gradients: the gradient of the stage's input sent back (not on the first stage),
  one micro-batch at a time (the runner starts a micro-batch's backward pass once the previous
  one's is made: before, a stage that summed its weights' gradients early ran the next
  backward beside it, and a max-pooling last stage peaked 1.24 x its estimate), and the
  gradients of its output received from the next stage (not on the last stage, which starts
  from the loss), TWO micro-batches' when M > 1: the one being back-propagated and the next,
  which TF receives as soon as the next stage makes it. The runner holds the next stage back
  so that no more arrive early (``worker.trainers.gpipe_schedule``); before it did, a
  lagging recomputing first stage was measured holding all M (6.5 MiB, 1.22 x its estimate).
  4 x elements x m each;
- input data (first stage): ``PIPELINE_INPUT_BATCHES`` GLOBAL batches (R x m x M examples: the
  chief draws the whole global batch and splits it) of float32 model inputs, plus
  ``data_bytes`` (0 for ``worker.trainers.gpipe``, which keeps the training set in host memory
  outside the allocator; for a runner that holds it as tensors); labels (last stage):
  ``PIPELINE_INPUT_BATCHES`` per-replica batches (m x M) of ``label_bytes`` per example (8:
  sparse int64 labels; pass 4 x classes for one-hot);
- overhead: ``FIXED_OVERHEAD`` + ``FRAGMENTATION`` of all the rest (BFC chunk rounding).

``StageCostModel.breakdown`` returns these terms one by one.

Calibration (TF 2.21 CPU, BFC allocator, Adam, ``worker.trainers.gpipe``): 4-stage runs of deep
uniform MLPs 64-[1024]x13-10 and 64-[512]x13-10 at global batches 512-4096, M = 1, 4, 16, with
and without recompute, float32 and bfloat16, and hybrid 2 x 2 and 2 x 4. The peak comes at the
start of the backward pass (weights, slots, the first micro-batch's gradients, every kept
activation) or, when activations are small, in the optimizer step (weights, slots, the
gradient and the optimizer's temporaries, about one more gradient size): the sum of the terms
above with 3.2 bytes per kept output element covers both. Measured / estimate over the
configurations of ``bench/pipeline_throughput.py --calibrate`` (2026-12-04): 0.82-0.91 for the
pipelines, 0.73-0.76 for hybrid 2 x 2 (the collective term above now overstates by about one
gradient; kept until more hybrid shapes are measured), and 0.80-0.95 over its throughput runs
(``docs/benchmarks.md``, "Pipeline throughput and stage memory"). The
data-parallel ``strata.memory`` constants (1.8 x 4 and 14 bytes per element) overestimate a
pipeline stage by up to 45%: there the whole batch's backward temporaries are alive at once,
here one micro-batch's. With mixed precision the kept activations are 16-bit but the CPU
kernels add float32 temporaries: measured about as much per element as float32, so the same
3.2.

Costs (``StageCostModel.cost``)
-------------------------------
``3 x`` the stage's forward FLOPs per example (forward + backward = 2 x forward), ``4 x`` with
recompute (one more forward). A measured per-layer cost list (seconds or any unit; a training
step's forward + backward) replaces the FLOPs; with recompute it is scaled by 4/3 (the extra
forward at the same 1:2 forward:backward ratio). Costs are per example: the micro-batch size
scales every stage alike and does not change the split.
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

# Calibrated against worker/trainers/gpipe.py (module docstring, "Calibration").
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
    terms are listed in the module docstring; ``breakdown`` returns them one by one. Internally
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
        held = min(self.microbatches, 2)  # received early: see the module docstring
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
        """Per-example training cost of layers ``[first, last)`` (see the module docstring)."""
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
    """Bytes of a GPipe stage task holding ``profile.layers[first:last]`` (terms: module
    docstring). Whether it is the first or last stage follows from the range (first == 0, last
    == number of layers); ``stage_index`` and ``num_stages``, when given, are checked against
    it. For many queries build a ``StageCostModel`` once."""
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
