"""Memory sizes and the per-task memory estimate of a training task.

Pure Python (no TensorFlow, Keras or NumPy): the coordinator plans with it.
``estimate_task_memory`` predicts the PEAK bytes a data-parallel task's allocator holds (what
``get_memory_info(...)["peak"]`` reports, and what the BFC limit is checked against) as a
``MemoryEstimate`` whose terms add up to ``total``; ``default_budget`` turns an estimate into the
budget a task gets (estimate + headroom, whole MiB). The sizes the other estimators share live
here too: optimizer slots, per-kernel-family activation rates (``KernelRates``, ``RATES``),
convolution workspaces, update temporaries, gradient and dataset bytes. Its coefficients are
constants calibrated against measured allocator peaks; it never measures anything itself.

Terms, calibration and measured peaks: docs/memory.md, "Data-parallel tasks".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from strata.cpukernels import ANY, EIGEN, ONEDNN
from strata.modelspec import ModelProfile, profile_model
from strata.types import STREAMED_SOURCES
from strata.units import MiB

__all__ = [
    "MemoryEstimate", "estimate_task_memory", "default_budget",
    "OPTIMIZER_SLOTS", "conv_workspace_bytes", "largest_workspace", "update_transient_bytes",
    "layer_workspaces", "optimizer_buffers",
    "UPDATE_TEMPORARIES",
]


#: Keras 3 optimizer slot variables per trainable parameter, with the optimizers' defaults.
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1, "sgd": 0}
#: gradient-sized buffers an optimizer's step holds for every variable at once beyond its slots,
#: counted with them (``optimizer_slots``). Measured on the memory zoo: RMSprop (bfloat16, batch
#: 256) peaked one whole gradient above its estimate on the 9 x 1536 MLP, data-parallel (1.18)
#: and as pipeline stages (1.25: 100% of the budget); AdamW and Adagrad did not.
OPTIMIZER_STEP_BUFFERS = {"rmsprop": 1}


def optimizer_buffers(optimizer: str) -> int:
    """Gradient-sized buffers per trainable parameter the optimizer holds: its slots and what
    its step keeps alive for every variable (``OPTIMIZER_STEP_BUFFERS``)."""
    name = str(optimizer).lower()
    return OPTIMIZER_SLOTS.get(name, 2) + OPTIMIZER_STEP_BUFFERS.get(name, 0)

ACTIVATION_FACTOR = 1.8        # live float32 activations per layer output element (fwd + bwd)
MIXED_ACTIVATION_BYTES = 10.8  # bytes per layer output element with bfloat16/float16 (Eigen)
INPUT_BATCHES_IN_FLIGHT = 4.8  # input batches alive at the peak
FIXED_OVERHEAD = 1 * MiB
FRAGMENTATION = 0.05           # BFC rounding, as a fraction of the rest
BFC_ROUND_FROM = 1 * MiB       # single tensors from this size get a power-of-two region

#: the examples a worker's shuffle buffer holds of a source read as a stream
#: (``strata.types.STREAMED_SOURCES``; ``worker.data`` uses this figure)
STREAM_SHUFFLE_EXAMPLES = 256

DIGITS_TRAIN = 1437            # worker/data.py: ceil(20%) of 1,797 rows are the test split
DIGITS_FEATURES = 64
SYNTHETIC_DEFAULT_TRAIN = 4096

HEADROOM_FRACTION = 0.25
HEADROOM_MIN = 16 * MiB
LARGEST_ALLOC_ROOM = 1.25       # room for the largest single allocation (``default_budget``)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak allocator bytes of one task, by cause (docs/memory.md, "Data-parallel tasks")."""

    weights: int
    gradients: int
    optimizer_slots: int
    activations: int
    data: int
    overhead: int
    collective: int = 0
    workspace: int = 0
    #: the largest single allocation (not a term: ``default_budget`` leaves room for it)
    largest_alloc: int = 0
    #: the largest activation tensor (not a term: ``default_budget`` adds one, for CPU
    #: contention)
    activation_tensor: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_slots + self.activations
                + self.data + self.overhead + self.collective + self.workspace)

    def as_dict(self) -> dict[str, int]:
        d = asdict(self)
        d.pop("largest_alloc")
        d.pop("activation_tensor")
        d["total"] = self.total
        return d


def _bfc_round(n: int) -> int:
    if n < BFC_ROUND_FROM:
        return n
    return 1 << (n - 1).bit_length()


def _get(d: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return default
        d = d.get(k)
    return default if d is None else d


def estimate_task_memory(spec: dict[str, Any], per_replica_batch: int, profile: ModelProfile | None = None,
                         *, train_examples: int | None = None,
                         collective: bool = True, kernels: str = ANY) -> MemoryEstimate:
    """Estimates the peak memory of one data-parallel training task of ``spec`` (a normalized
    job spec) at ``per_replica_batch`` examples per step. ``profile`` saves re-profiling
    ``spec["model"]``; ``train_examples`` gives the size of an npz training set when known;
    ``collective``: the task all-reduces its gradients (a packed buffer of their size);
    ``kernels``: the CPU kernels of the workers it may run on (``strata.cpukernels``)."""
    if profile is None:
        profile = profile_model(spec["model"])
    b = max(1, int(per_replica_batch))
    # gradients.accumulate: the batch runs in slices (activations of one slice), their
    # gradients summed in float32 (``gradients`` below)
    slices = max(1, int(_get(spec, "gradients", "accumulate", default=1) or 1))
    micro = max(1, -(-b // slices))
    compressed = _get(spec, "gradients", "compression", default="none") not in ("none", "", None)
    mixed = _get(spec, "memory", "mixed_precision", default="none") not in ("none", "", None)
    optimizer = str(_get(spec, "training", "optimizer", "name", default="adam")).lower()
    workers = max(1, int(_get(spec, "workers", default=1) or 1))

    params = profile.total_params
    trainable = profile.trainable_params
    weights = 4 * params + (2 * params if mixed else 0)
    # an Embedding's gradient is sparse and grows with the batch (``gradient_bytes``)
    sparse = sum(gradient_bytes(l, micro) - 4 * l.trainable_params for l in profile.layers)
    # (the running sum and the next one, alive together while a slice's gradients are added:
    # measured 91-96 MiB against 87 unsliced for the seed MLP at 1,024 per replica in 8 slices)
    gradients = 4 * trainable + sparse + (8 * trainable if slices > 1 else 0)
    slots = 4 * trainable * optimizer_buffers(optimizer)
    # the all-reduce packs every gradient into one buffer, which the BFC allocator must find
    # as one chunk. Its regions grow by doubling and are never merged, so a large pack needs
    # more limit than its size: a 1024-8192-10 model (32.3 MiB pack) failed allocating it at
    # a 157 MiB limit with 96 MiB in use, and ran at 165 MiB, its peak in use 107-134 MiB
    # depending on the limit
    # (counted at its size in the estimate, which aims at the peak in use; the budget leaves
    # room for the pack to find a contiguous chunk: ``default_budget``'s ``largest_alloc``)
    # (sparse gradients are gathered from every worker, not reduced)
    pack = 4 * trainable + sparse * workers
    # compressed: the 16-bit copies and their 16-bit sum on top (counted whole: the float32
    # pack is not formed, but the float32 sum is, as the copies are cast back)
    wire = (pack + (4 * trainable if compressed else 0)) if collective else 0

    activations = int(math.ceil(micro * activation_bytes_per_example(profile, mixed, kernels)))

    # data: this task's shard as tensors plus the input batches in flight
    n_train, feat_bytes, label_bytes = _data_shape(spec, profile, train_examples)
    shard = dataset_bytes(spec, profile, shards=_data_shards(spec, workers), train_examples=train_examples)
    inflight = int(math.ceil(INPUT_BATCHES_IN_FLIGHT * b * (feat_bytes + label_bytes)))
    data = shard + inflight

    # the optimizer update's temporaries (``update_transient_bytes``)
    update = max((update_transient_bytes(l, optimizer) for l in profile.layers), default=0)
    # Two phases: the backward pass holds the activations and a convolution's workspace; the
    # all-reduce's pack and the update's temporaries come after it, when those are freed. The
    # weights, their 16-bit copies, the gradients and the slots are alive in both. So
    # ``collective`` is what the second phase holds beyond the first (0 when the backward pass
    # is the larger). Measured: ResNet50 at 32x32 (90 MiB of gradients) peaked at 1.03 of this
    # and at 0.95 of the sum of both phases; the sum over-counted small-image CNNs, whose
    # packs are large and activations small, by up to 2x. The 16-bit copies stay through the
    # update: a 9 x 1536 MLP in bfloat16 (40 MiB of copies) peaked at weights + copies +
    # gradients + pack.
    workspace = largest_workspace(profile, kernels)
    collective_bytes = max(0, wire + update - activations - workspace)
    # the largest activation tensor (a layer's float32 output over the batch or slice): ops
    # that interleave differently under CPU contention can keep one more alive; the budget
    # adds it (``default_budget``), the estimate aims at the uncontended peak
    act_tensor = 4 * micro * max((l.output_elems for l in profile.layers), default=0)
    train_peak = weights + gradients + slots + collective_bytes + activations + data + workspace
    startup_peak = 4 * params + 2 * shard
    if startup_peak > train_peak:
        data += startup_peak - train_peak
        train_peak = startup_peak
    overhead = FIXED_OVERHEAD + int(math.ceil(FRAGMENTATION * train_peak))
    largest = max([wire, act_tensor]
                  + [largest_variable_bytes(l) for l in profile.layers]
                  + [conv_workspace_bytes(l, kernels) for l in profile.layers])
    return MemoryEstimate(weights=weights, gradients=gradients, optimizer_slots=slots,
                          activations=activations, data=data, overhead=overhead,
                          collective=collective_bytes, workspace=workspace,
                          largest_alloc=largest, activation_tensor=act_tensor)


@dataclass(frozen=True)
class KernelRates:
    """What one family of CPU kernels (``strata.cpukernels``) holds per layer output element
    and example in a data-parallel training step, as (float32, mixed precision) bytes:
    ``dense`` for Dense layers and kinds not in ``layers``; and whether its convolution
    gradients unfold patches into a workspace (``conv_workspace_bytes``)."""

    dense: tuple[float, float]
    layers: dict[str, tuple[float, float]]
    conv_workspace: bool
    #: a pipeline stage's bytes per kept Dense output element (``strata.stagememory``)
    pipeline: tuple[float, float] = (3.2, 3.2)
    #: per element a recurrent or attention layer keeps inside (``internal_elems``; None:
    #: the Dense rate)
    internal: tuple[float, float] | None = None
    #: a pipeline stage's share of a kind's output kept, against a Dense output's (None: the
    #: float32 ``layers`` rate over the ``dense`` one; ``strata.stagememory.kept_share``)
    pipeline_shares: dict[str, float] | None = None
    #: a pipeline stage's gradient accumulator (micro-batches or replicas summed), in
    #: gradient sizes beside the one being made: the runner's graph adds each layer's
    #: gradient into it as the backward pass makes it, so only part of a whole set is alive
    #: at once beside the sum (``strata.stagememory``)
    accumulator: float = 1.0


#: Eigen (``eigen``): Dense in float32 at its calibration (docs/memory.md, "Data-parallel
#: tasks"), the rest fitted on the memory zoo rerun with ``TF_ENABLE_ONEDNN_OPTS=0``
#: (``bench/memory_zoo.py --configs pair``, the data-parallel and pipeline jobs of 19 models:
#: MLPs, convolution stacks, an LSTM, a transformer block, four keras.applications;
#: ``docs/benchmarks.md``) and its check run, with every task's peak under 90% of its budget (one
#: run's peaks of the same task differ by up to 45% on these kernels, whose 30 MiB convolution
#: buffer may or may not meet the other transients): a Conv2D output is held with its gradient
#: buffers; normalisation, activation, dropout and pooling outputs are mostly computed in place
#: or freed as the backward pass reaches them. ReLU is an activation and DepthwiseConv2D a
#: convolution; Add, Concatenate, padding, rescaling, Flatten and Reshape need nothing of their
#: output for the backward pass (their gradients pass through). Mixed precision keeps float32 and
#: 16-bit copies on these kernels (10.8 bytes per Dense output against 7.2 in float32).
_ACT = (0.65, 1.4)
_CONV = (12.1, 2.5)
_PASS = (0.0, 0.0)
_EIGEN_LAYERS: dict[str, tuple[float, float]] = {
    "Conv2D": _CONV, "DepthwiseConv2D": _CONV,
    "BatchNormalization": _ACT, "LayerNormalization": _ACT,
    "Activation": _ACT, "ReLU": _ACT, "Dropout": _ACT, "Multiply": _ACT,
    "MaxPooling2D": _ACT, "AveragePooling2D": _ACT, "GlobalAveragePooling2D": _ACT,
    "Add": _PASS, "Concatenate": _PASS, "ZeroPadding2D": _PASS, "Rescaling": _PASS,
    "Normalization": _PASS, "Flatten": _PASS, "Reshape": _PASS,
}
#: oneDNN (``onednn``): fitted the same way on the same jobs run on a oneDNN host and their
#: check run (every peak under 90% of its budget). A stage's accumulator counts 0.75 of a
#: gradient: the last stages of four keras.applications models (most of their weights, Adam or
#: SGD, float32 or bfloat16) peaked at 0.80-0.87 of estimates that counted it whole, and the
#: 0.75 that brought 58 of 72 pipeline and hybrid task kinds within 15% (39 before) kept every
#: peak under 90% of its budget (Eigen's runs gained 2 kinds and stay at 1). Its kernels
#: run bfloat16 natively, so mixed precision holds about what float32 does, not Eigen's
#: float32-and-16-bit copies; a convolution keeps no im2col workspace.
_O_ACT = (1.3, 2.1)
_O_CONV = (4.1, 5.2)
_ONEDNN_LAYERS = {k: (_O_CONV if v == _CONV else _O_ACT if v == _ACT else v)
                  for k, v in _EIGEN_LAYERS.items()}


def _shares(conv: float, act: float) -> dict[str, float]:
    """Pipeline kept shares: convolutions at ``conv``, normalisations and activations at
    ``act``, sums, concatenations, padding and rescaling at 0; max pooling keeps its output
    whole (its gradient reads it: measured, a stage of max pooling, Flatten and Dense peaked at
    1.36 times an estimate that took it at the activations' share and Flatten at 0)."""
    out = {k: (conv if v == _CONV else act if v == _ACT else 0.0)
           for k, v in _EIGEN_LAYERS.items()}
    out["MaxPooling2D"] = 1.0
    # Flatten and Reshape as the stage zoo measured them (what the runner holds at a stage's
    # edge is not a view)
    out["Flatten"] = out["Reshape"] = 1.0
    return out


RATES: dict[str, KernelRates] = {
    EIGEN: KernelRates(
        (ACTIVATION_FACTOR * 4, MIXED_ACTIVATION_BYTES), _EIGEN_LAYERS, True,
        pipeline=(4.4, 2.3), internal=(4.6, 14.0),
        pipeline_shares=_shares(1.6, 1.6)),
    ONEDNN: KernelRates(
        (4.1, 5.0), _ONEDNN_LAYERS, False, pipeline=(3.0, 2.0), internal=(5.9, 4.8),
        pipeline_shares=_shares(0.7, 1.2), accumulator=0.75),
}


def pipeline_share(r: KernelRates, kind: str) -> float:
    """The share of a ``kind`` layer's output a pipeline stage keeps on ``r``'s kernels
    (``KernelRates.pipeline_shares``; ``strata.stagememory.kept_share``)."""
    if r.pipeline_shares is not None:
        return r.pipeline_shares.get(kind, 1.0)
    own = r.layers.get(kind)
    return 1.0 if own is None else own[0] / r.dense[0]


def _larger(a: KernelRates, b: KernelRates) -> KernelRates:
    """Each of ``a``'s and ``b``'s figures, the larger (every estimate grows with every one)."""
    def hi(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
        return (max(x[0], y[0]), max(x[1], y[1]))
    kinds = set(a.layers) | set(b.layers)  # a kind one family lacks counts as its Dense
    layers = {k: hi(a.layers.get(k, a.dense), b.layers.get(k, b.dense)) for k in kinds}
    shares = {k: max(pipeline_share(a, k), pipeline_share(b, k)) for k in kinds}
    return KernelRates(hi(a.dense, b.dense), layers, a.conv_workspace or b.conv_workspace,
                       hi(a.pipeline, b.pipeline),
                       hi(a.internal or a.dense, b.internal or b.dense), shares,
                       max(a.accumulator, b.accumulator))


#: not known, or workers of both families
RATES[ANY] = _larger(RATES[EIGEN], RATES[ONEDNN])


def rates_of(kernels: str) -> KernelRates:
    """The rates of ``kernels`` (``ANY``'s for a family it does not know)."""
    return RATES.get(kernels, RATES[ANY])


def activation_bytes_per_example(profile: ModelProfile, mixed: bool,
                                 kernels: str = ANY) -> float:
    """The activations a data-parallel training step holds per example (``activations``)."""
    r = rates_of(kernels)
    i = 1 if mixed else 0
    dense = r.dense[i]
    inner = dense if r.internal is None else r.internal[i]
    total = 0.0
    for layer in profile.layers:
        rates = r.layers.get(layer.kind)
        # what a recurrent or attention layer keeps inside (gates, scores) has its own rate
        total += layer.output_elems * (dense if rates is None else rates[i]) \
            + getattr(layer, "internal_elems", 0) * inner
    return total


#: the layer kinds the estimators were fitted on (the memory zoo). A model with any other kind
#: is measured by a probe run before it is admitted when ``memory.profile`` is ``auto``
#: (``strata.strategies.base.wants_probe``): its internal buffers (recurrent gates, attention
#: scores, embedding gathers) are modelled, not measured.
CALIBRATED_KINDS = frozenset(
    ["Dense", "Conv2D", "MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D",
     "BatchNormalization", "LayerNormalization", "Activation", "Dropout", "Flatten",
     "Reshape", "ReLU"])


def uncalibrated_kinds(profile: ModelProfile) -> list[str]:
    """The layer kinds of ``profile`` the estimators were not fitted on, sorted."""
    return sorted({l.kind for l in profile.layers} - CALIBRATED_KINDS)


def _data_shape(spec: dict[str, Any], profile: ModelProfile, train_examples: int | None
                ) -> tuple[int, int, int]:
    """(training rows, bytes per feature row, bytes per label) of the job's data."""
    loss = _get(spec, "training", "loss", default="sparse_categorical_crossentropy")
    out_elems = profile.layers[-1].output_elems if profile.layers else 1
    label_bytes = 8 if loss == "sparse_categorical_crossentropy" else 4 * out_elems
    source = _get(spec, "data", "source", default="digits")
    if source == "digits":
        return DIGITS_TRAIN, 4 * DIGITS_FEATURES, label_bytes
    if source == "synthetic":
        n_train = int(_get(spec, "data", "examples", default=0) or 0) or SYNTHETIC_DEFAULT_TRAIN
    else:
        n_train = int(train_examples or 0)
    return n_train, 4 * profile.input_elems, label_bytes


def _data_shards(spec: dict[str, Any], workers: int) -> int:
    """Into how many shards a job's workers split its training set: an elastic job's workers
    each hold all of it (its order is global, so that a resize keeps the position in the
    epoch: ``strata.worker.data.make_global_dataset``)."""
    return 1 if spec.get("elastic") else workers


def dataset_bytes(spec: dict[str, Any], profile: ModelProfile | None = None, *, shards: int = 1,
                  train_examples: int | None = None) -> int:
    """Bytes of one of ``shards`` equal shards of the training set held as tensors (features
    and labels, each rounded as the BFC allocator rounds a large chunk)."""
    if profile is None:
        profile = profile_model(spec["model"])
    n_train, feat_bytes, label_bytes = _data_shape(spec, profile, train_examples)
    if _get(spec, "data", "source", default="digits") in STREAMED_SOURCES:
        # read as a stream: what a worker holds is its shuffle buffer of decoded examples
        return _bfc_round(STREAM_SHUFFLE_EXAMPLES * (feat_bytes + label_bytes))
    rows = -(-n_train // max(1, shards)) if n_train else 0
    return _bfc_round(rows * feat_bytes) + _bfc_round(rows * label_bytes)


def label_bytes_of(spec: dict[str, Any], profile: ModelProfile) -> int:
    return _data_shape(spec, profile, None)[2]


CONV_WORKING_SET = 30 * MiB    # TensorFlow's CPU convolution kernels' target working set
#: kinds whose Eigen CPU kernels unfold patches into a workspace of that size: Conv2D, and
#: Conv1D, which TensorFlow runs as a Conv2D of height 1 (measured on Eigen: a Conv1D stack at
#: 16 examples per replica peaked at 21 MiB against 5.5 estimated without it; on oneDNN the
#: same stack held no such buffer, where the earlier calibration was made). Conv3D and the
#: separable and transposed kinds are not counted; a model with them is probed
#: (``CALIBRATED_KINDS``)
CONV_KINDS = ("Conv2D", "Conv1D")


def conv_workspace_bytes(layer: Any, kernels: str = ANY) -> int:
    """The im2col buffer a Conv2D layer's Eigen CPU kernels allocate (0 for other layers, and
    on oneDNN's kernels, which keep their scratch small: measured, a 16x16 conv 144-24 step
    held 34 MiB more on Eigen, 1x1 or 3x3 alike, and 2 MiB in all on oneDNN).

    TensorFlow's CPU convolution and its gradients unfold input patches into a buffer of
    ``shard x output positions x patch`` elements, where the shard (images per chunk) is
    chosen so that one unit of work (the patches, the filter and the output of one image) fills
    a target working set of 30 MiB: ``shard = ceil((30 MiB / dtype) / (P x K + K x C + P x C))``
    for ``P`` output positions, ``K = kh x kw x c_in`` and ``C`` filters. The buffer has that
    size whatever the batch (measured: a 24x24x64 output of a 3x3x32 filter failed allocating
    ``shape[36,576,288]`` float at per-replica batch 16 and 128, and ``[72,576,288]`` in
    bfloat16: the same bytes), and it lives only while the op runs: it is a transient that
    counts once per task, the largest one, not once per layer."""
    shape = tuple(getattr(layer, "output_shape", ()) or ())
    if getattr(layer, "kind", "") not in CONV_KINDS or len(shape) < 2 \
            or not rates_of(kernels).conv_workspace:
        return 0
    oc = int(shape[-1])
    positions = 1
    for d in shape[:-1]:
        positions *= int(d)
    positions = max(1, positions)
    oc = max(1, oc)
    patch = max(1, int(layer.trainable_params) // oc)
    unit = positions * patch + patch * oc + positions * oc
    shard = -(-(CONV_WORKING_SET // 4) // unit)
    return shard * positions * patch * 4


#: the optimizer update's temporaries, in sizes of the largest variable it updates: the update
#: runs after the backward pass (activations freed) and builds expressions of gradient-sized
#: temporaries per variable, two variables at a time (two inter-op threads). Measured on
#: the memory zoo: a 1536 x 1536 kernel's Adam update failed allocating its ``adam/Sub_10``
#: temporary; one 1024 x 8192 layer's Adam step peaked 1.2 kernel sizes above the rest.
UPDATE_TEMPORARIES = {"adam": 1.25, "adamw": 1.25, "rmsprop": 1.0, "adagrad": 1.0, "sgd": 0.5}


def largest_variable_bytes(layer: Any) -> int:
    """Bytes of a layer's largest trainable variable (its kernel, as the profile says:
    ``largest_weight``; for Dense and Conv2D without it the parameters less the bias,
    ``output_shape[-1]``; all of them otherwise), float32."""
    trainable = int(getattr(layer, "trainable_params", 0))
    largest = int(getattr(layer, "largest_weight", 0) or 0)
    if largest:
        return 4 * min(largest, trainable) if trainable else 0
    shape = tuple(getattr(layer, "output_shape", ()) or ())
    if getattr(layer, "kind", "") in ("Dense", "Conv2D") and shape:
        return 4 * max(0, trainable - int(shape[-1]))
    return 4 * trainable


def gradient_bytes(layer: Any, batch: int) -> int:
    """Bytes of one step's gradient of ``layer``'s variables from ``batch`` examples. An
    Embedding's gradient is sparse (IndexedSlices): one row of the table per token looked up,
    with its index, so it grows with the batch, not with the vocabulary, and can be far larger
    than the table (measured on the memory zoo: 512 examples of 64 tokens into a 5000 x 64
    table, 8.4 MB per gradient against a 1.3 MB table; a PS task receiving two workers' peaked
    3.6x its dense estimate)."""
    dense = 4 * int(getattr(layer, "trainable_params", 0))
    if getattr(layer, "kind", "") == "Embedding":
        shape = tuple(getattr(layer, "output_shape", ()) or (1,))
        tokens = max(1, int(getattr(layer, "output_elems", 0)) // max(1, int(shape[-1])))
        return max(dense, int(batch) * (4 * int(layer.output_elems) + 8 * tokens))
    return dense


def update_transient_bytes(layer: Any, optimizer: str) -> int:
    """The optimizer update's temporaries while it updates ``layer``'s variables."""
    u = UPDATE_TEMPORARIES.get(str(optimizer).lower(), 1.25)
    return int(math.ceil(u * largest_variable_bytes(layer)))


def layer_workspaces(profile: ModelProfile, kernels: str = ANY) -> list[int]:
    """Per layer: the convolution workspaces its backward pass may hold at once. A Conv2D
    layer's filter gradient and input gradient are separate ops that both unfold patches and
    can run at the same time (two inter-op threads); a layer with no trainable layer before it
    needs no input gradient. (Measured: a 28x28 conv 32-64 model peaked one 22.8 MiB workspace
    above the estimate that counted one; a Reshape-then-conv model's peak stayed within one.)"""
    out = []
    trainable_before = False
    for layer in profile.layers:
        ws = conv_workspace_bytes(layer, kernels)
        out.append((2 * ws if trainable_before else ws)
                   + int(getattr(layer, "workspace_bytes", 0)))
        trainable_before = trainable_before or layer.trainable_params > 0
    return out


def largest_workspace(profile: ModelProfile, kernels: str = ANY) -> int:
    """The most convolution workspace one backward pass holds at once (``layer_workspaces``)."""
    return max(layer_workspaces(profile, kernels), default=0)


def default_budget(estimate: MemoryEstimate | int, largest_alloc: int = 0) -> int:
    """The memory budget to reserve for a task when the job names none: the estimate plus the
    largest of 25% of it, 16 MiB, and ``LARGEST_ALLOC_ROOM`` x the task's largest single
    allocation (taken from the estimate when it is a ``MemoryEstimate``), rounded up to a whole
    MiB (the BFC limit is set in MiB).

    Why: the estimate aims at the measured peak in use, but (1) the two workers of one job
    differ by up to ~20% and a task varies a few percent between runs, because BFC chunk
    rounding depends on the order concurrent threads allocate in; (2) the BFC limit caps the
    allocator's REGIONS, which also hold free fragments, so a task needs a limit somewhat above
    its peak in-use bytes (measured: a 784-input task peaking at 68.5 MiB ran with a 70 MiB
    limit and failed with 66 MiB; a digits task peaking at 18 MiB ran with 20 MiB and failed
    with 18 MiB); (3) a small task's allocator grows in power-of-two regions (2, 4, 8 MiB...),
    so a fixed 16 MiB floor covers one more region step for small models; (4) regions are never
    merged, so one large tensor needs a contiguous free chunk of its size on top of what is in
    use: a model whose all-reduce pack was 32.3 MiB (a 1024-8192 layer) failed at a 157 MiB
    limit with 96 MiB in use and ran at 165 MiB, 1.15 packs above its estimate in use; a
    convolution's im2col buffer is such a tensor too (a 64x64x16 conv's 25.8 MiB
    ``Conv2DBackpropFilter`` buffer failed at a 103 MiB limit with 73 MiB in use); (5) under
    CPU contention the ops interleave differently and one more of the largest activation
    tensor can be alive: it is added on top (``MemoryEstimate.activation_tensor``).

    The memory zoo (``bench/memory_zoo.py``, ``docs/benchmarks.md``) is the check: over its 216
    jobs (14 models, 4 strategies, small and large batches, float32 and bfloat16, Adam and SGD)
    no task's peak exceeded this budget. Its peak / estimate spread is what the 25% covers: 90%
    of task kinds at or under 1.16, the worst of 16 MiB or more at 1.26-1.32 (convolution
    pipeline stages, a bottleneck MLP's PS task), one of them at 100% of its budget, which is
    why the fraction is not smaller. An over-tight budget costs a failed task (exit 75); a
    loose one only idles memory."""
    total = estimate.total if isinstance(estimate, MemoryEstimate) else int(estimate)
    contention = 0
    if isinstance(estimate, MemoryEstimate):
        largest_alloc = max(largest_alloc, estimate.largest_alloc)
        contention = estimate.activation_tensor
    room = max(int(math.ceil(total * HEADROOM_FRACTION)), HEADROOM_MIN,
               int(math.ceil(LARGEST_ALLOC_ROOM * largest_alloc))) + contention
    return -(-(total + room) // MiB) * MiB


# --------------------------------------------------------------------------------------------
