"""Admission: a job's spec validated and planned (``prepare``), shown placed on capacities
(``plan_on``, what ``strata plan`` prints), and its memory probe sized (``wants_probe``,
``first_probe_budget``, ``probe_plan``, ``probe_spec``). Pure functions of their arguments, so
the service runs the slow ones (profiling a model, the stage planner) off the event loop."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from strata import strategies
from strata.coordinator.placement import Capacity, TaskDemand, place
from strata.errors import SpecError
from strata.jobspec import JobSpec
from strata.measured import apply_measured, bound_of, measured_kinds, task_kind
from strata.memory import uncalibrated_kinds
from strata.modelspec import ModelSpecError, profile_model
from strata.spec import parse_job_spec
from strata.types import JobPlan, Plan, Task, WorkerOffer
from strata.units import format_size

# Bytes no task could ever need; larger estimates come from nonsense shapes and would overflow
# the store's 64-bit integers.
MAX_TASK_BYTES = 1 << 50
# ``memory.profile: auto`` probes jobs whose largest task estimate is at least this. A probe costs
# one more start of the job's processes (about 8 s on 2 cores: TensorFlow's import, the
# rendezvous, tracing) and saves what the estimate overstates; under this size a task's budget
# is dominated by the 16 MiB floor of the headroom and the estimators' error is a few MiB.
PROBE_FROM_BYTES = 64 << 20
# The first probe of a model only the job's code builds gets this per task (it has no estimate:
# the job itself is planned at a whole worker until measured). Most users' models train in less
# (the tutorial's CNN peaks under 100 MiB, keras.applications' ResNet50 at 32x32 and batch 32
# under 600 MiB); one that needs more runs out of memory within its first step and is probed
# again with PROBE_GROWTH times as much (or half again what it was seen to need): a few extra
# probe starts (~10 s each on 2 cores) for a large model instead of a whole worker held for
# every small one.
PROBE_FIRST_BYTES = 256 << 20
PROBE_GROWTH = 4


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    spec: JobSpec
    plan: JobPlan


def plan_on(prepared: PreparedJob, capacities: Sequence[Capacity],
            measured: Mapping[str, int]) -> Plan:
    """A prepared job placed on these capacities: what ``strata plan`` shows, for the
    coordinator's workers or (offline) for N workers of a given budget."""
    spec, plan = prepared.spec, prepared.plan
    placement = place([TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in plan.tasks],
                      list(capacities)) if plan.feasible else None
    assigned = placement.assignments if placement is not None else {}
    tasks = [dataclasses.replace(t, worker=assigned.get((t.role, t.index), "")
                                 if assigned else t.worker) for t in plan.tasks]
    if not plan.feasible:
        return Plan(spec.strategy, False, plan.reason, tasks)
    summary = f"{plan.summary}; " if plan.summary else ""
    if wants_probe(spec, plan) and not measured_kinds(spec, measured):
        summary += (f"memory.profile: a probe run ({probe_spec(spec).training.steps} steps) "
                    "measures the tasks first and the estimates become its peaks; ")
    if placement is None or not placement.assignments:
        why = placement.reason if placement is not None else ""
        return Plan(spec.strategy, True, f"{summary}admissible; would wait: {why}", tasks)
    return Plan(spec.strategy, True, f"{summary}fits now", tasks)


def prepare(spec: JobSpec | Mapping[str, Any], workers: Sequence[WorkerOffer] = (),
            measured: Mapping[str, int] | None = None, *, probed: bool = False,
            largest: Mapping[str, int] | None = None) -> PreparedJob:
    """Validates a spec (unless already parsed) and has its strategy plan the tasks against
    ``workers`` (a snapshot: see ``Coordinator.worker_offers``), with estimates raised to what
    earlier runs ``measured`` (``strata.measured``), or with ``probed`` set to it (a probe run
    of this plan just measured it). Pure and possibly slow (it profiles the model and may run
    the stage planner), so the service runs it off the event loop. Raises SpecError naming the
    field."""
    if not isinstance(spec, JobSpec):
        spec = parse_job_spec(spec)
    profile = None  # a model only the job's code builds: measured by a probe (``wants_probe``)
    if not spec.code_model:
        try:
            profile = profile_model(dict(spec.model))
        except ModelSpecError as e:
            raise SpecError(e.field, e.message) from None
    plan = strategies.get(spec.strategy).plan(spec, list(workers), profile)
    # a model only its code builds has no estimate (its plan holds a whole worker): what a
    # run of it measured replaces that, as a probe's figures do
    placeholder = bool(spec.code_model) and not spec.memory.per_task_budget
    plan = apply_measured(spec, plan, measured or {}, list(workers), lower=probed or placeholder,
                          largest=largest)
    offered = {w.name: w.bytes for w in workers}
    if plan.feasible and any(t.worker in offered and t.memory_budget_bytes > offered[t.worker]
                             for t in plan.tasks):
        # a planner fitted estimates to these workers; a budget's room for the task's largest
        # allocation can outgrow the worker chosen: the job must still be placeable as a whole
        placed = place([TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in plan.tasks],
                       [Capacity(w.name, w.bytes, w.bytes) for w in workers])
        if not placed.placed:
            worst = max(plan.tasks, key=lambda t: t.memory_budget_bytes)
            plan = dataclasses.replace(plan, feasible=False, reason=(
                f"the tasks' budgets (estimates plus headroom, with room for each task's largest "
                f"tensor) do not fit the workers together; the largest is "
                f"{worst.role}:{worst.index}'s {format_size(worst.memory_budget_bytes)}: add "
                "workers or larger ones, or use more stages"))
    for t in plan.tasks:
        need = max(t.estimated_memory_bytes, t.memory_budget_bytes)
        if need > MAX_TASK_BYTES:
            field = "memory.per_task_budget" if t.memory_budget_bytes > MAX_TASK_BYTES else "model"
            raise SpecError(field, f"task {t.role}:{t.index} would need {format_size(need)}, "
                                   "beyond any machine")
    return PreparedJob(spec=spec, plan=plan)


def wants_probe(spec: JobSpec, plan: JobPlan) -> bool:
    """``memory.profile``: ``true`` always probes a job not measured yet, ``false`` never;
    ``auto`` probes when the job's budgets come from the estimates (no fixed
    ``memory.per_task_budget``) and its largest task estimate is ``PROBE_FROM_BYTES`` or more,
    or its model has a layer kind the estimators were not fitted on
    (``strata.memory.CALIBRATED_KINDS``): modelled is not measured."""
    if spec.memory.profile == "true":
        return True
    if spec.memory.profile == "false" or spec.memory.per_task_budget:
        return False
    if plan.largest_estimate >= PROBE_FROM_BYTES or spec.code:
        return True  # a code model or dataset: nothing was estimated from what it holds
    try:
        return bool(uncalibrated_kinds(profile_model(dict(spec.model))))
    except ModelSpecError:
        return True


def first_probe_budget(spec: JobSpec, plan: JobPlan, measured: Mapping[str, int]) -> int:
    """The per-task budget of a job's first probe: for a model only its code builds (no
    estimate; planned at a whole worker, ``code_model_plan``) ``PROBE_FIRST_BYTES``, or half
    again what an earlier run of it ran out of memory at (``strata.measured``), so that the
    probe runs beside other jobs instead of waiting for whole workers; a probe that runs out
    of memory is started again with more (``Coordinator._grow_probe``). 0 (the plan's own
    budgets) for every other job: their estimates size the probe."""
    if not spec.code_model or spec.memory.per_task_budget:
        return 0
    smallest = min((t.memory_budget_bytes for t in plan.tasks), default=0)
    bound = max((measured.get(bound_of(task_kind(spec, t.role, t.index, t.first_layer,
                                                 t.last_layer)), 0) for t in plan.tasks),
                default=0)
    first = max(PROBE_FIRST_BYTES, bound * 3 // 2)
    return first if first < smallest else 0


def probe_plan(plan: JobPlan, budget: int) -> JobPlan:
    """``plan`` with every task's budget (and estimate) at most ``budget`` (0: as it is)."""
    if not budget:
        return plan
    return dataclasses.replace(plan, tasks=tuple(
        dataclasses.replace(t, memory_budget_bytes=min(t.memory_budget_bytes, budget),
                            estimated_memory_bytes=min(t.estimated_memory_bytes, budget))
        for t in plan.tasks))


def probe_spec(spec: JobSpec) -> JobSpec:
    """The probe run of ``spec`` (``memory.profile``): the same job, memory-wise (the same
    ``strata.measured`` fingerprint), for ``probe_steps`` steps and its evaluation."""
    steps = strategies.get(spec.strategy).probe_steps(spec)
    if spec.training.steps:
        steps = min(steps, spec.training.steps)
    return dataclasses.replace(
        spec, name=f"{spec.name}-probe",
        training=dataclasses.replace(spec.training, steps=steps, epochs=0),
        memory=dataclasses.replace(spec.memory, profile="false"),
        # a few steps: nothing to checkpoint, and a failure is the job's answer, not retried
        checkpoint_every_steps=0, max_restarts=0)


def tasks_of(job_id: str, plan: JobPlan, attempt: int = 0) -> list[Task]:
    return [Task(job_id=job_id, role=t.role, index=t.index, stage=t.stage, replica=t.replica,
                 first_layer=t.first_layer, last_layer=t.last_layer, layers=list(t.layers),
                 memory_budget_bytes=t.memory_budget_bytes,
                 estimated_memory_bytes=t.estimated_memory_bytes, attempt=attempt)
            for t in plan.tasks]
