"""``multi_worker_mirrored``: data parallel with TensorFlow's ``MultiWorkerMirroredStrategy``.

``workers`` identical tasks ``worker:i``, each holding the whole model and its shard of the
data; gradients are all-reduced every step, so every replica ends with the same weights. The
job succeeds when every task has its result; worker 0's progress and result are the job's.
When the model fits no worker, the refusal says how deep a pipeline would have to be for its
stages to fit. The runner is ``strata.worker.trainers.data_parallel``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Sequence

from strata.cpukernels import family
from strata.memory import estimate_task_memory, label_bytes_of
from strata.units import format_size
from strata.strategies import register
from strata.strategies.base import (
    Strategy, budget_for, code_model_plan, offer_for_estimate, too_big,
)
from strata.types import Job, JobPlan, Task, TaskPlan, WorkerOffer

if TYPE_CHECKING:
    from strata.modelspec import ModelProfile
    from strata.jobspec import JobSpec


@register
class MultiWorkerMirrored(Strategy):
    name = "multi_worker_mirrored"
    elastic = True
    runners = {"worker": "strata.worker.trainers.data_parallel:run"}
    summary = "data parallel: identical replicas, gradients all-reduced every step"
    lead: ClassVar[tuple[str, int]] = ("worker", 0)
    lead_drives = False
    runs_user_code = True
    fields = frozenset({"gradients.accumulate", "gradients.compression", "gradients.pack_size"})

    def plan(self, spec: JobSpec, workers: Sequence[WorkerOffer],
             profile: ModelProfile | None) -> JobPlan:
        if profile is None:
            return code_model_plan(self.name, spec, workers,
                                   [("worker", i) for i in range(spec.workers)])
        e = estimate_task_memory(spec.to_dict(), spec.per_replica_batch, profile,
                                 collective=True, kernels=family(w.kernels for w in workers))
        estimate = e.total
        budget = budget_for(spec, estimate, e.largest_alloc)
        layers = tuple(layer.name for layer in profile.layers)
        tasks = tuple(TaskPlan("worker", i, estimate, budget, layers=layers,
                               last_layer=len(layers)) for i in range(spec.workers))
        if too_big(tasks, workers) is None:
            return JobPlan(self.name, True, "", tasks)
        largest = max(w.bytes for w in workers)
        reason = (f"fits no worker: each task needs {format_size(budget)} (estimate "
                  f"{format_size(estimate)} plus headroom) but the largest worker budget is "
                  f"{format_size(largest)}")
        return JobPlan(self.name, False, reason + _pipeline_hint(spec, profile, workers), tasks)

    def describe_plan(self, spec: JobSpec, plan: JobPlan) -> str:
        t0 = plan.tasks[0]
        return (f"{spec.workers} x {self.name} task(s), estimate "
                f"{format_size(t0.estimated_memory_bytes)}, budget "
                f"{format_size(t0.memory_budget_bytes)} each")

    def narrow(self, spec: JobSpec, workers: int) -> JobSpec:
        # fewer replicas, each a larger share of the same global batch: the most that divide it
        import dataclasses

        if workers >= spec.workers or workers < 1:
            return spec
        share = spec.gradients.accumulate
        n = max(k for k in range(1, workers + 1) if spec.data.batch_size % (k * share) == 0)
        return dataclasses.replace(spec, workers=n)

    def oom_levers(self, job: Job, task: Task) -> list[str]:
        assert job.spec is not None
        w = job.spec.workers
        return [f"more workers, so each replica takes a smaller share of the batch (workers: "
                f"{2 * w}, data.batch_size unchanged)",
                "a pipeline, whose stages each hold part of the model (strategy: pipeline)"
                ] + super().oom_levers(job, task)

def _pipeline_hint(spec: JobSpec, profile: ModelProfile, workers: Sequence[WorkerOffer]) -> str:
    """How deep a pipeline of this model would fit the largest worker, for the refusal."""
    from strata.planner import suggest_stages
    from strata.strategies.pipeline import Pipeline

    largest = offer_for_estimate(max(w.bytes for w in workers))
    microbatches = max(spec.microbatches, 4)
    if spec.data.batch_size % microbatches:
        microbatches = 1
    try:
        k = suggest_stages(profile, largest, global_batch=spec.data.batch_size,
                           microbatches=microbatches, optimizer=spec.training.optimizer_used.name,
                           mixed_precision=spec.memory.mixed_precision,
                           label_bytes=label_bytes_of(spec.to_dict(), profile), data_bytes=0,
                           kernels=family(w.kernels for w in workers))
    except ValueError:
        k = None
    if k is None:
        return ("; no pipeline split fits either (a single layer is too large for every "
                f"worker; see `strata plan` with strategy: {Pipeline.name})")
    enough = "" if k <= len(workers) else f" (the cluster has {len(workers)} workers now)"
    return (f"; it fits as a pipeline: strategy: {Pipeline.name}, stages: {k}, microbatches: "
            f"{microbatches}{enough}; `strata plan` shows the split")
