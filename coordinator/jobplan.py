"""What a job will run: its tasks (role, index, stage, layers), each task's memory estimate and
budget, and whether the cluster's workers could ever hold them. A pure decision like
``coordinator.placement`` and ``coordinator.planner``: no TensorFlow, no side effects, and the
model is only ever profiled (``strata.modelspec``), never built.

One function per strategy:

- ``multi_worker_mirrored``: ``workers`` identical tasks ``worker:i``, each holding the whole
  model (``strata.memory.estimate_task_memory``). When the model fits no worker, the refusal
  says how deep a ``pipeline`` would have to be for its stages to fit (``planner.suggest_stages``).
- ``parameter_server``: ``chief:0`` (drives the loop), ``worker:i`` and ``ps:j``; layers are
  placed on PS tasks by ``strata.psplan`` so that no PS task's share exceeds its slice.
- ``pipeline`` / ``hybrid``: the stage planner (``coordinator.planner``) splits the layers;
  replica 0's stage 0 is ``chief:0`` (the driver, which also holds the training data), every
  other (replica, stage) is ``worker:K`` with ``K = replica * stages + stage - 1``.

Budgets: ``memory.per_task_budget`` when the job sets one, else ``default_budget(estimate)``
(the estimate plus headroom). The stage planner fits ESTIMATES, so each worker offers it what
that budget rule leaves for an estimate (``offer_for_estimate``).

Which budgets: ``strata submit`` plans on the workers' whole budgets (could the job ever run
here?) and the job then waits until placement finds the stage budgets free; ``strata plan``
plans on what is free now. Pipeline and hybrid jobs are planned at submission on the workers
connected then, so with no workers connected they are refused with that reason (a
data-parallel job is admitted and waits, since any worker that joins can hold it or not).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from strata.memory import (
    HEADROOM_FRACTION, HEADROOM_MIN, dataset_bytes, default_budget, estimate_task_memory,
    format_size, label_bytes_of,
)
from strata.modelspec import ModelProfile, profile_model
from strata.spec import JobSpec


@dataclasses.dataclass(frozen=True)
class WorkerOffer:
    """A worker as the job planner sees it: its name and the bytes it can give (its whole
    budget when admitting, its free budget when planning for now)."""
    name: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    role: str
    index: int
    estimate_bytes: int
    budget_bytes: int
    stage: int = 0
    replica: int = 0
    first_layer: int = 0
    last_layer: int = 0
    layers: tuple[str, ...] = ()
    worker: str = ""        # the planner's choice (pipeline); placement decides at run time


@dataclasses.dataclass(frozen=True)
class JobPlan:
    strategy: str
    feasible: bool
    reason: str
    tasks: tuple[TaskPlan, ...]
    summary: str = ""
    microbatch: int = 0                       # pipeline, hybrid: rows per micro-batch
    ps_placement: dict | None = None          # parameter_server: layer name -> ps index

    @property
    def largest_estimate(self) -> int:
        return max((t.estimate_bytes for t in self.tasks), default=0)


def offer_for_estimate(free_bytes: int) -> int:
    """The largest estimate whose default budget fits ``free_bytes``."""
    return max(0, min(int(free_bytes / (1 + HEADROOM_FRACTION)), free_bytes - HEADROOM_MIN))


def plan_job(spec: JobSpec, workers: Sequence[WorkerOffer], *,
             profile: ModelProfile | None = None) -> JobPlan:
    """Raises ``ValueError`` whose message starts with the spec field for arguments the
    planners refuse (e.g. a batch not divisible into micro-batches)."""
    if profile is None:
        profile = profile_model(spec.model)
    if spec.strategy == "multi_worker_mirrored":
        return _plan_mirrored(spec, workers, profile)
    if spec.strategy == "parameter_server":
        return _plan_parameter_server(spec, workers, profile)
    return _plan_pipeline(spec, workers, profile)


def _budget(spec: JobSpec, estimate: int) -> int:
    return spec.memory.per_task_budget_bytes or default_budget(estimate)


def _too_big(tasks: Sequence[TaskPlan], workers: Sequence[WorkerOffer]) -> TaskPlan | None:
    """The largest task no worker can hold, if any (with no workers: none, they may join)."""
    if not workers:
        return None
    largest = max(w.bytes for w in workers)
    worst = max(tasks, key=lambda t: t.budget_bytes, default=None)
    return worst if worst is not None and worst.budget_bytes > largest else None


def _plan_mirrored(spec: JobSpec, workers: Sequence[WorkerOffer], profile: ModelProfile) -> JobPlan:
    estimate = estimate_task_memory(spec.to_dict(), spec.per_replica_batch, profile).total
    budget = _budget(spec, estimate)
    layers = tuple(layer.name for layer in profile.layers)
    tasks = tuple(TaskPlan("worker", i, estimate, budget, layers=layers,
                           last_layer=len(layers)) for i in range(spec.workers))
    if _too_big(tasks, workers) is None:
        return JobPlan(spec.strategy, True, "", tasks)
    largest = max(w.bytes for w in workers)
    reason = (f"fits no worker: each task needs {format_size(budget)} (estimate "
              f"{format_size(estimate)} plus headroom) but the largest worker budget is "
              f"{format_size(largest)}")
    return JobPlan(spec.strategy, False, reason + _pipeline_hint(spec, profile, workers), tasks)


def _pipeline_hint(spec: JobSpec, profile: ModelProfile, workers: Sequence[WorkerOffer]) -> str:
    """How deep a pipeline of this model would fit the largest worker, for the refusal."""
    from strata.coordinator.planner import suggest_stages

    largest = offer_for_estimate(max(w.bytes for w in workers))
    microbatches = max(spec.microbatches, 4)
    if spec.data.batch_size % microbatches:
        microbatches = 1
    d = spec.to_dict()
    try:
        k = suggest_stages(profile, largest, global_batch=spec.data.batch_size,
                           microbatches=microbatches, optimizer=spec.training.optimizer.name,
                           mixed_precision=spec.memory.mixed_precision,
                           label_bytes=label_bytes_of(d, profile), data_bytes=0)
    except ValueError:
        k = None
    if k is None:
        return ("; no pipeline split fits either (a single layer is too large for every "
                "worker; see `strata plan` with strategy: pipeline)")
    enough = "" if k <= len(workers) else f" (the cluster has {len(workers)} workers now)"
    return (f"; it fits as a pipeline: strategy: pipeline, stages: {k}, microbatches: "
            f"{microbatches}{enough}; `strata plan` shows the split")


def _plan_parameter_server(spec: JobSpec, workers: Sequence[WorkerOffer],
                           profile: ModelProfile) -> JobPlan:
    from strata.psplan import plan_parameter_servers

    d = spec.to_dict()
    p = plan_parameter_servers(
        profile, num_ps=spec.parameter_servers, workers=spec.workers,
        optimizer=spec.training.optimizer.name, batch_size=spec.data.batch_size,
        mixed_precision=spec.memory.mixed_precision, data_bytes=dataset_bytes(d, profile),
        ps_budget_bytes=spec.memory.per_task_budget_bytes or None)
    by_ps: dict[int, list[str]] = {}
    for layer in profile.layers:
        if layer.name in p.placement:
            by_ps.setdefault(p.placement[layer.name], []).append(layer.name)
    tasks = [TaskPlan("chief", 0, p.chief_bytes, _budget(spec, p.chief_bytes))]
    tasks += [TaskPlan("worker", i, p.worker_bytes, _budget(spec, p.worker_bytes))
              for i in range(spec.workers)]
    tasks += [TaskPlan("ps", j, p.ps_bytes[j], _budget(spec, p.ps_bytes[j]),
                       layers=tuple(by_ps.get(j, ())))
              for j in range(spec.parameter_servers)]
    summary = (f"1 chief, {spec.workers} worker(s), {spec.parameter_servers} parameter "
               "server(s); layers on PS tasks: " + "; ".join(
                   f"ps:{j} {len(by_ps.get(j, ()))} layer(s), {format_size(p.ps_bytes[j])}"
                   for j in range(spec.parameter_servers)))
    if not p.feasible:
        return JobPlan(spec.strategy, False, p.reason, tuple(tasks), summary,
                       ps_placement=dict(p.placement))
    worst = _too_big(tasks, workers)
    if worst is not None:
        reason = (f"task {worst.role}:{worst.index} needs {format_size(worst.budget_bytes)} "
                  f"(estimate {format_size(worst.estimate_bytes)} plus headroom) but the largest "
                  f"worker budget is {format_size(max(w.bytes for w in workers))}")
        if worst.role == "ps":
            reason += f"; add parameter servers (parameter_servers: {spec.parameter_servers + 1})"
        return JobPlan(spec.strategy, False, reason, tuple(tasks), summary,
                       ps_placement=dict(p.placement))
    return JobPlan(spec.strategy, True, "", tuple(tasks), summary, ps_placement=dict(p.placement))


def _plan_pipeline(spec: JobSpec, workers: Sequence[WorkerOffer], profile: ModelProfile) -> JobPlan:
    from strata.coordinator.planner import WorkerSlot, plan_pipeline

    fixed = spec.memory.per_task_budget_bytes
    slots = []
    for w in workers:
        if fixed:
            if w.bytes >= fixed:
                slots.append(WorkerSlot(w.name, fixed))
        else:
            slots.append(WorkerSlot(w.name, offer_for_estimate(w.bytes)))
    d = spec.to_dict()
    replicas = spec.workers
    p = plan_pipeline(
        profile, slots, stages=spec.stages, microbatches=spec.microbatches,
        global_batch=spec.data.batch_size, replicas=replicas,
        optimizer=spec.training.optimizer.name, mixed_precision=spec.memory.mixed_precision,
        recompute=spec.memory.recompute, label_bytes=label_bytes_of(d, profile),
        # worker.pipeline keeps the training set in host memory, outside the allocator: only
        # the batches it draws count (the planner's input term)
        data_bytes=0)
    S = p.num_stages
    tasks = []
    for s in sorted(p.stages, key=lambda s: (s.replica, s.index)):
        k = s.replica * S + s.index
        role, index = ("chief", 0) if k == 0 else ("worker", k - 1)
        tasks.append(TaskPlan(role, index, s.memory_bytes, _budget(spec, s.memory_bytes),
                              stage=s.index, replica=s.replica, first_layer=s.first_layer,
                              last_layer=s.last_layer, layers=tuple(s.layer_names),
                              worker=s.worker))
    if not p.feasible:
        reason = p.reason
        if not workers:
            reason = ("no workers are connected: pipeline and hybrid jobs are planned on the "
                      "connected workers' budgets; start workers first")
        return JobPlan(spec.strategy, False, reason, tuple(tasks), microbatch=p.microbatch)
    summary = (f"{S} stages" + (f" x {replicas} replicas" if replicas > 1 else "")
               + f", {p.microbatches} micro-batches of {p.microbatch}")
    if not p.optimal:
        summary += " (a fitting plan, not proven optimal within the planner's time limit)"
    return JobPlan(spec.strategy, True, "", tuple(tasks), summary, microbatch=p.microbatch)
