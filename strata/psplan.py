"""Layer placement and memory estimates for ``parameter_server`` jobs.

Pure Python (standard library and ``strata.modelspec`` / ``strata.memory`` only): the
coordinator plans with it. ``plan_parameter_servers`` places whole layers (each layer's
variables and optimizer slots on one PS task, largest layer first onto the least loaded task:
LPT, ties to the lower index) and returns a ``PsPlan``: the placement, each PS task's estimate
and the worker's and chief's, all PEAK allocator bytes (what the BFC limit is checked against).
Given a PS task's budget, the plan is infeasible when a layer (never split) or a task's load
exceeds it, with a ``reason`` that names the layer or task and the sizes. The estimates aim at
the larger of the measured peaks. ``layer_share_bytes``: one layer's share of its PS task.

Placement, terms, calibration and measured peaks: docs/memory.md, "Parameter-server tasks".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from strata.cpukernels import ANY
from strata.memory import gradient_bytes, largest_variable_bytes, largest_workspace
from strata.units import format_size
from strata.modelspec import LayerProfile, ModelProfile

__all__ = ["PsPlan", "plan_parameter_servers", "layer_share_bytes", "OPTIMIZER_SLOTS"]

MiB = 1 << 20

#: Keras 3 optimizer slot variables per trainable parameter (as strata.memory).
OPTIMIZER_SLOTS = {"adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1, "sgd": 0}

#: gradient-sized buffers on a PS task per layer while updates arrive: a + b x workers
PS_UPDATE_BUFFERS = {"slots": (1.5, 2.5), "sgd": (1.7, 0.3)}
PS_FIXED = MiB // 2
BFC_ROUND_FROM = 1 * MiB
FRAGMENTATION = 0.05

WORKER_ACTIVATION_BYTES = 1.8 * 4   # per layer output element and example, float32
WORKER_MIXED_ACTIVATION_BYTES = 12.0
WORKER_INPUT_BATCHES = 4.8
WORKER_FIXED = 1 * MiB

EVAL_BATCH_MAX = 256                # worker/trainers/ps_chief.py evaluates in batches of at most this
CHIEF_ACTIVATION_BYTES = 4.2       # per element of a layer's input and output, and example
CHIEF_CONV_OUTPUT = 1.6             # float32 Conv2D outputs: the pre-activation copy too
CHIEF_MIXED_ACTIVATION_BYTES = 2.5  # 16-bit tensors
CHIEF_MIXED_CASTS = 6               # bytes per parameter of the largest layer: 16-bit casts
CHIEF_FIXED = MiB // 2


@dataclass(frozen=True)
class PsPlan:
    """``placement``: layer name -> PS index for every layer with parameters. ``ps_bytes``:
    estimated peak of each PS task; ``worker_bytes`` / ``chief_bytes``: of one worker task and
    of the chief. ``layer_bytes``: each placed layer's share of its PS task (before the
    task's fixed overhead and rounding margin). ``feasible`` is False when a PS task's
    estimate exceeds ``ps_budget_bytes``; ``reason`` says which and why."""

    feasible: bool
    reason: str
    placement: dict[str, int]
    ps_bytes: list[int]
    worker_bytes: int
    chief_bytes: int
    layer_bytes: dict[str, int] = field(default_factory=dict)


def _bfc_round(n: int) -> int:
    if n < BFC_ROUND_FROM:
        return n
    return 1 << (n - 1).bit_length()


def _half_rounding(n: int) -> int:
    """What a tensor of ``n`` bytes costs beyond its size when it takes a chunk of its own:
    half the way to the next power of two from 1 MiB (see ``strata.memory``, collective)."""
    return (_bfc_round(n) - n) // 2


def _slots(optimizer: str) -> int:
    return OPTIMIZER_SLOTS.get(str(optimizer).lower(), 2)


def _stored_bytes(layer: LayerProfile, slots: int) -> int:
    """The layer's variables and slots as the allocator holds them."""
    trainable = layer.trainable_params
    biggest = largest_variable_bytes(layer) // 4
    per_copy = 4 * trainable + _half_rounding(4 * biggest)
    return per_copy * (1 + slots) + 4 * layer.non_trainable_params


def _update_buffers(optimizer: str, workers: int) -> float:
    a, b = PS_UPDATE_BUFFERS["slots" if _slots(optimizer) else "sgd"]
    return a + b * max(1, int(workers))


def layer_share_bytes(layer: LayerProfile, *, workers: int, optimizer: str,
                      batch: int = 1) -> int:
    """A layer's share of its PS task: its variables and optimizer slots, and the gradients
    and update temporaries in flight with ``workers`` workers (of ``batch`` examples each: an
    Embedding's sparse gradient grows with it, ``strata.memory.gradient_bytes``)."""
    stored = _stored_bytes(layer, _slots(optimizer))
    inflight = gradient_bytes(layer, batch) * _update_buffers(optimizer, workers)
    return stored + int(math.ceil(inflight))


def _ps_total(load: int) -> int:
    return PS_FIXED + int(math.ceil(load * (1 + FRAGMENTATION)))


def plan_parameter_servers(profile: ModelProfile, *, num_ps: int, workers: int, optimizer: str,
                           batch_size: int, mixed_precision: str, data_bytes: int,
                           ps_budget_bytes: int | None = None, kernels: str = ANY) -> PsPlan:
    """Places ``profile``'s layers on ``num_ps`` PS tasks (LPT) and estimates every task's
    peak memory for asynchronous training with ``workers`` workers, ``optimizer`` (a Keras
    optimizer name), batches of ``batch_size`` examples per step and ``mixed_precision``
    (``none``, ``bfloat16`` or ``float16``). ``data_bytes``: the training set as a worker
    holds it (features as float32 plus labels; every worker holds all of it).
    ``ps_budget_bytes``: the memory each PS task gets (a fixed per-task budget); when given,
    the plan is infeasible unless every PS task's estimate fits it."""
    if num_ps < 1:
        raise ValueError(f"num_ps must be at least 1, got {num_ps}")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    shares = {l.name: layer_share_bytes(l, workers=workers, optimizer=optimizer,
                                        batch=max(1, int(batch_size)))
              for l in profile.layers if l.params > 0}
    placement, loads, members = _place(shares, num_ps)
    ps_bytes = [_ps_total(l) for l in loads]
    mixed = str(mixed_precision or "none") != "none"
    b = max(1, int(batch_size))
    worker_bytes = _worker_bytes(profile, b, mixed, data_bytes, kernels)
    chief_bytes = _chief_bytes(profile, b, mixed)
    reason = "" if ps_budget_bytes is None else _over_budget(
        profile, shares, ps_bytes, members, int(ps_budget_bytes), workers=workers,
        optimizer=optimizer)
    return PsPlan(not reason, reason, placement, ps_bytes, int(worker_bytes), int(chief_bytes),
                  shares)


def _place(shares: dict[str, int], num_ps: int
           ) -> tuple[dict[str, int], list[int], list[list[str]]]:
    """LPT: the layers largest first, each onto the PS task with the smallest load so far
    (ties to the lower index). Returns the placement, each task's load and its layers."""
    loads = [0] * num_ps
    members: list[list[str]] = [[] for _ in range(num_ps)]
    placement: dict[str, int] = {}
    for name in sorted(shares, key=lambda n: -shares[n]):  # stable: ties keep layer order
        k = min(range(num_ps), key=lambda i: (loads[i], i))
        placement[name] = k
        loads[k] += shares[name]
        members[k].append(name)
    return placement, loads, members


def _worker_bytes(profile: ModelProfile, b: int, mixed: bool, data_bytes: int,
                  kernels: str) -> int:
    """A worker task's estimate with batches of ``b`` examples (docs/memory.md,
    "Parameter-server tasks")."""
    params = profile.total_params
    act = WORKER_MIXED_ACTIVATION_BYTES if mixed else WORKER_ACTIVATION_BYTES
    label_bytes = 8  # int64 class ids (one-hot labels are wider; small next to the features)
    worker = (4 * params + (2 * params if mixed else 0) + 4 * profile.trainable_params
              + act * b * profile.activation_elems + max(0, int(data_bytes))
              + WORKER_INPUT_BATCHES * b * (4 * profile.input_elems + label_bytes))
    worker += largest_workspace(profile, kernels)
    return WORKER_FIXED + int(math.ceil(worker * (1 + FRAGMENTATION)))


def _chief_bytes(profile: ModelProfile, b: int, mixed: bool) -> int:
    """The chief's estimate, evaluating in batches of at most ``b`` examples (docs/memory.md,
    "Parameter-server tasks")."""
    params = profile.total_params
    eb = min(b, EVAL_BATCH_MAX)
    cact = CHIEF_MIXED_ACTIVATION_BYTES if mixed else CHIEF_ACTIVATION_BYTES
    # evaluation runs forward only: what is alive is a layer's input and output, not every
    # layer's output, and no convolution backward workspace (the memory zoo's conv models'
    # chiefs peaked at 0.03-0.2 of an estimate that counted both); the 16-bit casts of the
    # weights are made layer by layer (two layers' worth alive)
    outs = [float(profile.input_elems)] + [
        l.output_elems * (CHIEF_CONV_OUTPUT if l.kind == "Conv2D" and not mixed else 1.0)
        for l in profile.layers]
    pair = max((outs[i] + outs[i + 1] for i in range(len(outs) - 1)), default=outs[0])
    largest_params = max((l.params for l in profile.layers), default=0)
    chief = (4 * params + (CHIEF_MIXED_CASTS * largest_params if mixed else 0)
             + eb * (4 * profile.input_elems + cact * pair))
    # the weights it copies from the PS tasks are large tensors each in its own chunk: half
    # the way to a power of two each (the 9 x 1536 MLP's chief, nine 9 MiB kernels, peaked
    # 18 MiB above the plain sum; the digits MLP's 2 MiB kernel costs nothing more)
    chief += sum(_half_rounding(largest_variable_bytes(l)) for l in profile.layers)
    return CHIEF_FIXED + int(math.ceil(chief * (1 + FRAGMENTATION)))


def _over_budget(profile: ModelProfile, shares: dict[str, int], ps_bytes: list[int],
                 members: list[list[str]], budget: int, *, workers: int, optimizer: str
                 ) -> str:
    """Why the plan does not fit PS tasks of ``budget`` bytes: a layer too large for any of
    them, else the task that needs the most; "" when it fits."""
    too_big = [n for n in sorted(shares, key=lambda n: -shares[n])
               if _ps_total(shares[n]) > budget]
    if too_big:
        name = too_big[0]
        layer = next(l for l in profile.layers if l.name == name)
        stored = _stored_bytes(layer, _slots(optimizer))
        return (f"layer {name!r} ({layer.params:,} parameters) needs "
                f"{format_size(_ps_total(shares[name]))} on one parameter server "
                f"({format_size(stored)} of variables and {_slots(optimizer)} optimizer "
                f"slot(s) per parameter, {format_size(shares[name] - stored)} for the "
                f"updates of {workers} worker(s)), more than a PS task's budget of "
                f"{format_size(budget)}; a layer's variables cannot be split across PS "
                "tasks: raise memory.per_task_budget, use fewer workers or an optimizer "
                "with fewer slots"
                + (f" ({len(too_big) - 1} more layer(s) are too large too)"
                   if len(too_big) > 1 else ""))
    over = [k for k in range(len(ps_bytes)) if ps_bytes[k] > budget]
    if not over:
        return ""
    k = max(over, key=lambda i: ps_bytes[i])
    return (f"the layers do not fit on {len(ps_bytes)} parameter server(s) of "
            f"{format_size(budget)}: ps:{k} would need "
            f"{format_size(ps_bytes[k])} for {', '.join(members[k])}; add "
            "parameter servers or raise memory.per_task_budget")
