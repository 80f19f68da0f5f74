"""Memory figures measured by earlier runs, and how planning uses them.

Pure Python. The estimators (``strata.memory``, ``strata.psplan``, ``strata.stagememory``) are
models; a task's allocator peak is a fact. The coordinator keeps, per kind of task, the
largest figure a run has shown it needs: the peak of a task that finished, or, for a task
that ran out of memory, its budget plus the allocation that failed (``strata.oom.needed_bytes``).
A later job with the same memory-relevant spec plans with ``max(estimate, measured)``, so a
model the estimators get wrong fails at most once, and a rerun (or a restart) gets a budget
that holds.

A task's kind is its job's spec without the fields that do not change memory (name, steps,
epochs, seed, learning rate, checkpoints, restarts, a fixed per-task budget), its role, its
layer range, and for PS tasks the index (each holds different layers). Replicas of one stage
and the identical workers of a data-parallel job share a kind; the figure is the largest
of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from strata.memory import LARGEST_ALLOC_ROOM, default_budget
from strata.units import format_size
from strata.types import JobPlan, TaskPlan, WorkerOffer

if TYPE_CHECKING:
    from strata.jobspec import JobSpec

__all__ = ["spec_fingerprint", "task_kind", "apply_measured", "measured_kinds", "bound_of",
           "OOM_BOUND"]

#: the key of a kind's out-of-memory lower bound (``kind + OOM_BOUND``): budget plus the
#: allocation that failed. It raises a plan as a peak does, but is not a peak: a plan is never
#: lowered to it, and a job with only a bound is still probed
OOM_BOUND = "#oom"


def bound_of(kind: str) -> str:
    return kind + OOM_BOUND

#: what does not change a task's memory: names, schedules, the queue it waits in
_IGNORED = {
    "name": None, "checkpoint": None, "restart": None, "queue": None, "priority": None,
    "preemptible": None,
    "training": {"steps", "epochs", "seed", "optimizer.learning_rate", "time_limit"},
    "memory": {"per_task_budget", "per_task_budget_bytes", "profile"},
}


def spec_fingerprint(spec: JobSpec) -> str:
    d: dict[str, Any] = json.loads(json.dumps(spec.to_dict(), sort_keys=True, default=str))
    for top, inner in _IGNORED.items():
        if inner is None:
            d.pop(top, None)
            continue
        section = d.get(top)
        if not isinstance(section, dict):
            continue
        for name in inner:
            if "." in name:
                a, b = name.split(".", 1)
                sub = section.get(a)
                if isinstance(sub, dict):
                    sub.pop(b, None)
            else:
                section.pop(name, None)
    text = json.dumps(d, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def task_kind(spec: JobSpec | str, role: str, index: int, first_layer: int,
              last_layer: int) -> str:
    fp = spec if isinstance(spec, str) else spec_fingerprint(spec)
    who = f"{role}:{index}" if role == "ps" else role
    return f"{fp}/{who}/{first_layer}-{last_layer}"


def _largest_alloc(t: TaskPlan) -> int:
    """A bound on the task's largest single allocation, from the room its planned budget left
    for it (``default_budget``: at least ``LARGEST_ALLOC_ROOM`` x that allocation): a budget
    made from a measured figure keeps that room."""
    return int(max(0, t.memory_budget_bytes - t.estimated_memory_bytes) / LARGEST_ALLOC_ROOM)


def measured_kinds(spec: JobSpec, measured: Mapping[str, int]) -> int:
    """How many task kinds of ``spec``'s fingerprint have a measured peak (an out-of-memory
    bound is not one)."""
    prefix = spec_fingerprint(spec) + "/"
    return sum(1 for k in measured if k.startswith(prefix) and not k.endswith(OOM_BOUND))


def apply_measured(spec: JobSpec, plan: JobPlan, measured: Mapping[str, int],
                   workers: Sequence[WorkerOffer], *, lower: bool = False,
                   largest: Mapping[str, int] | None = None) -> JobPlan:
    """``plan`` with every task's estimate raised to what an earlier run measured for its kind
    (and its default budget with it). With ``lower`` (the figures come from a probe run of
    this very plan: ``memory.profile``) an estimate above the measured figure is lowered to
    it as well: the estimate becomes the measurement. The changed plan is checked again
    against ``workers``: a task planned on a named worker must fit that worker, any other the
    largest. ``largest``: per kind, the largest single allocation a run reported (the
    all-reduce pack): the new budget keeps room for it as one chunk."""
    if not measured:
        return plan
    fp = spec_fingerprint(spec)
    tasks: list[TaskPlan] = []
    changed: list[tuple[TaskPlan, int]] = []
    for t in plan.tasks:
        kind = task_kind(fp, t.role, t.index, t.first_layer, t.last_layer)
        peak, bound = int(measured.get(kind, 0)), int(measured.get(bound_of(kind), 0))
        m = max(peak, bound)  # raised to what it was seen to need; lowered only to a peak
        if m > t.estimated_memory_bytes or (lower and 0 < peak and m < t.estimated_memory_bytes):
            alloc = max(_largest_alloc(t), int((largest or {}).get(kind, 0)))
            budget = spec.memory.per_task_budget_bytes or default_budget(m, alloc)
            changed.append((t, m))
            t = dataclasses.replace(t, estimated_memory_bytes=m, memory_budget_bytes=budget)
        tasks.append(t)
    if not changed:
        return plan
    note = (("estimates set to what a probe run of this job measured: " if lower else
             "estimates raised to what an earlier run of this job measured: ")
            + ", ".join(f"{t.role}:{t.index} {format_size(t.estimated_memory_bytes)} -> "
                        f"{format_size(m)}" for t, m in changed[:8]))
    summary = f"{plan.summary}; {note}" if plan.summary else note
    new = dataclasses.replace(plan, tasks=tuple(tasks), summary=summary)
    if not plan.feasible or not workers:
        return new
    caps = {w.name: w.bytes for w in workers}
    largest = max(caps.values())
    for t in tasks:
        cap = caps.get(t.worker, largest) if t.worker else largest
        if t.memory_budget_bytes > cap:
            where = f"worker {t.worker}" if t.worker and t.worker in caps else "any worker"
            return dataclasses.replace(new, feasible=False, reason=(
                f"task {t.role}:{t.index} needs a budget of {format_size(t.memory_budget_bytes)} "
                f"(an earlier run of this job measured {format_size(t.estimated_memory_bytes)}), "
                f"more than {where} offers ({format_size(cap)}); use more stages or workers, a "
                "smaller batch, or larger workers"))
    return new
