"""What an agent may act on, and what it may claim: pure checks the coordinator runs on every
agent-side call that names a job, a task or a file.

An agent acts only on what it was given: a task assigned to it, of the attempt it was given,
while the task is live (``Coordinator.live_task``). What it reports of such a task is checked
against the task's own plan and the agent's device (``check_report``): a report that claims the
impossible is refused naming the field, never stored or shown. Blobs an agent may fetch are
those its live tasks' jobs name (``job_blobs``).
"""

from __future__ import annotations

import math

from strata.jobspec import JobSpec
from strata.errors import SpecError
from strata.types import TaskReport

#: no training run plausibly takes more steps than this (1e9 steps at 100 steps/s: 4 months);
#: what bounds a step when the plan does not fix the count (``training.epochs``)
MAX_STEPS = 10**9
#: examples a second no task reaches (a large cluster trains ~1e6 a second in all)
MAX_EXAMPLES_PER_SEC = 1e10
#: how far a task's clock may be from the coordinator's (a first step "in the future")
MAX_CLOCK_SKEW_S = 86400.0
#: bytes no allocation reaches (the store's integers hold less than 2**63)
MAX_BYTES = 1 << 50


def job_blobs(spec: JobSpec | None) -> frozenset[str]:
    """The digests of the uploaded files a job names (its ``.keras`` file, its code)."""
    if spec is None:
        return frozenset()
    out = set()
    kf = spec.model.get("keras_file") if isinstance(spec.model, dict) else None
    if isinstance(kf, dict) and kf.get("sha256"):
        out.add(str(kf["sha256"]))
    if spec.code and spec.code.get("sha256"):
        out.add(str(spec.code["sha256"]))
    return frozenset(out)


def step_limit(spec: JobSpec | None) -> int:
    """The most steps the plan allows: ``training.steps`` when it fixes them."""
    if spec is not None and spec.training.steps > 0:
        return spec.training.steps
    return MAX_STEPS


def memory_limit(budget_bytes: int, device_bytes: int) -> int:
    """The most memory a task of this budget on this device can report: its allocator stops
    at its budget (TensorFlow's BFC limit, or the GPU's ``memory_limit``, both in whole MiB
    under it), and never beyond the agent's device. Some room is left over the budget: an
    honest figure is never refused."""
    device = device_bytes if device_bytes > 0 else MAX_BYTES
    if budget_bytes <= 0:
        return device
    return min(device, budget_bytes + budget_bytes // 10 + MEMORY_SLACK_BYTES)


#: room over a task's budget its memory figures may show (the allocator's own rounding)
MEMORY_SLACK_BYTES = 16 << 20
#: names a task's metrics may have at most
MAX_METRICS = 64


def check_report(r: TaskReport, spec: JobSpec | None, device_bytes: int, now: float,
                 budget_bytes: int = 0) -> None:
    """Refuses a report whose figures no task of this plan, budget and device could produce
    (``SpecError`` naming the field of the ``TaskStatus`` message): memory beyond its budget
    (``memory_limit``), an accuracy outside [0, 1], steps beyond the plan or the total
    reported, a speed or a time no run has, metrics that are not numbers."""
    def refuse(field: str, message: str) -> None:
        raise SpecError(f"status.{field}", message)

    limit = memory_limit(budget_bytes, device_bytes)
    for field, value in (("in_use_bytes", r.in_use_bytes), ("peak_bytes", r.peak_bytes)):
        if value < 0 or value > limit:
            refuse(field, f"{value} bytes is beyond what the task's allocator can hold "
                          f"({limit} bytes: its budget, on the agent's device)")
    if r.largest_alloc_bytes < 0:
        refuse("largest_alloc_bytes", f"{r.largest_alloc_bytes} bytes is not a size")
    limit = step_limit(spec)
    for field, value in (("total_steps", r.total_steps), ("step", r.step),
                         ("checkpoint_step", r.checkpoint_step),
                         ("resumed_step", r.resumed_step)):
        if value < 0 or value > limit:
            refuse(field, f"{value} is beyond the plan's {limit} steps")
    if r.total_steps and r.step > r.total_steps:
        refuse("step", f"step {r.step} of {r.total_steps}: beyond the total it reports")
    acc = r.test_accuracy
    if acc is not None and not (math.isfinite(acc) and 0.0 <= acc <= 1.0):
        refuse("test_accuracy", f"{acc!r} is not an accuracy (0 to 1)")
    eps = r.examples_per_sec
    if not (math.isfinite(eps) and 0.0 <= eps <= MAX_EXAMPLES_PER_SEC):
        refuse("examples_per_sec", f"{eps!r} examples a second is not a speed any task has")
    if r.first_step_time and not (math.isfinite(r.first_step_time)
                                  and abs(r.first_step_time - now) <= MAX_CLOCK_SKEW_S):
        refuse("first_step_time", f"{r.first_step_time!r} is more than a day from now")
    if r.oom is not None and not 0 <= r.oom.allocation_bytes <= MAX_BYTES:
        refuse("oom.allocation_bytes", f"{r.oom.allocation_bytes} bytes is beyond any device")
    if len(r.test_metrics) > MAX_METRICS or any(
            not math.isfinite(v) for v in r.test_metrics.values()):
        refuse("test_metrics", f"at most {MAX_METRICS} metrics, each a finite number")
