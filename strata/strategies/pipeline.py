"""``pipeline``: GPipe model parallelism, contiguous layer stages on different workers.

The stage planner (``strata.planner``, over ``strata.stagememory``'s estimates)
splits the layers into stages that each fit a worker. Replica 0's stage 0 is ``chief:0``, the
driver, which also holds the training data; every other (replica, stage) is ``worker:K`` with
``K = replica * stages + stage - 1``, a plain TF server. The chief's result ends the job. The
stage layout travels in the task contract. Runners: ``strata.worker.trainers.gpipe`` (chief),
``strata.worker.server`` (stages). ``hybrid`` (``strata.strategies.hybrid``) is this with
data-parallel replicas of the pipeline.

Budgets: the stage planner fits ESTIMATES, so each worker offers it what the budget rule leaves
for an estimate (``offer_for_estimate``). Pipeline jobs are planned at submission on the
workers connected then, so with no workers connected they are refused with that reason.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from strata.errors import SpecError
from strata.cpukernels import family
from strata.memory import label_bytes_of
from strata.strategies import register
from strata.strategies.base import (
    Strategy, budget_for, largest_training_alloc, offer_for_estimate,
)
from strata.taskconfig import PipelineSection, StageAssignment
from strata.types import Job, JobPlan, Task, TaskPlan, WorkerOffer

if TYPE_CHECKING:
    from strata.modelspec import ModelProfile
    from strata.jobspec import JobSpec


@register
class Pipeline(Strategy):
    name = "pipeline"
    runners = {"chief": "strata.worker.trainers.gpipe:run_driver",
               "worker": "strata.worker.server:serve"}
    summary = "model parallel: contiguous layer stages on different workers, micro-batched"
    fields = frozenset({"stages", "memory.recompute"})

    def validate(self, spec: JobSpec) -> None:
        if spec.workers != 1:
            raise SpecError("workers", "a pipeline job has one replica; for data-parallel "
                                       "replicas of a pipeline use strategy hybrid")

    def plan(self, spec: JobSpec, workers: Sequence[WorkerOffer],
             profile: ModelProfile | None) -> JobPlan:
        assert profile is not None, "only a strategy that runs_user_code plans a code model"
        from strata.planner import WorkerSlot, plan_pipeline

        fixed = spec.memory.per_task_budget_bytes
        kernels = family(w.kernels for w in workers)
        slots = []
        for w in workers:
            if fixed:
                if w.bytes >= fixed:
                    slots.append(WorkerSlot(w.name, fixed))
            else:
                slots.append(WorkerSlot(w.name, offer_for_estimate(w.bytes)))
        replicas = spec.workers
        # raises SpecError naming the field for arguments it refuses
        p = plan_pipeline(
            profile, slots, stages=spec.stages, microbatches=spec.microbatches,
            global_batch=spec.data.batch_size, replicas=replicas,
            optimizer=spec.training.optimizer_used.name,
            mixed_precision=spec.memory.mixed_precision, recompute=spec.memory.recompute,
            label_bytes=label_bytes_of(spec.to_dict(), profile),
            # the driver keeps the training set in host memory, outside the allocator: only
            # the batches it draws count (the planner's input term)
            data_bytes=0, compressed=spec.gradients.compression != "none",
            kernels=kernels)
        S = p.num_stages
        tasks = []
        for s in sorted(p.stages, key=lambda s: (s.replica, s.index)):
            k = s.replica * S + s.index
            role, index = ("chief", 0) if k == 0 else ("worker", k - 1)
            big = largest_training_alloc(profile, s.first_layer, s.last_layer, kernels)
            tasks.append(TaskPlan(role, index, s.estimate_bytes,
                                  budget_for(spec, s.estimate_bytes, big),
                                  stage=s.index, replica=s.replica, first_layer=s.first_layer,
                                  last_layer=s.last_layer, layers=tuple(s.layer_names),
                                  worker=s.worker))
        if not p.feasible:
            reason = p.reason
            if not workers:
                reason = ("no workers are connected: pipeline and hybrid jobs are planned on "
                          "the connected workers' budgets; start workers first")
            return JobPlan(self.name, False, reason, tuple(tasks))
        summary = (f"{S} stages" + (f" x {replicas} replicas" if replicas > 1 else "")
                   + f", {p.microbatches} micro-batches of {p.microbatch}")
        if not p.optimal:
            summary += " (a fitting plan, not proven optimal within the planner's time limit)"
        return JobPlan(self.name, True, "", tuple(tasks), summary)

    def describe_plan(self, spec: JobSpec, plan: JobPlan) -> str:
        from strata.units import format_size

        def where(t: TaskPlan) -> str:
            return f" (stage {t.stage}" + (f", replica {t.replica}" if spec.workers > 1 else "") + ")"

        return f"{self.name}: {plan.summary}; tasks " + ", ".join(
            f"{t.role}:{t.index}{where(t)} est {format_size(t.estimated_memory_bytes)} budget "
            f"{format_size(t.memory_budget_bytes)}" for t in plan.tasks)

    def where(self, job: Job, task: Task) -> str:
        assert job.spec is not None
        replica = f" of replica {task.replica}" if job.spec.workers > 1 else ""
        return f" (stage {task.stage}{replica}, layers {task.first_layer}-{task.last_layer - 1})"

    def oom_levers(self, job: Job, task: Task) -> list[str]:
        assert job.spec is not None
        spec = job.spec
        stages = 1 + max(t.stage for t in job.tasks)
        levers = [f"more stages, so each holds fewer layers (stages: {stages + 1})"]
        m = spec.microbatches
        if not spec.memory.recompute:
            levers.append("recomputation, which keeps one micro-batch's activations instead "
                          "of all (memory.recompute: true)")
        # GPipe keeps every micro-batch's activations: smaller ones help only with recompute
        elif spec.data.batch_size % (2 * m * spec.workers) == 0:
            levers.append(f"more, smaller micro-batches (microbatches: {2 * m})")
        return levers + super().oom_levers(job, task)

    def task_section(self, job: Job, task: Task) -> PipelineSection:
        assert job.spec is not None
        stages = sorted(job.tasks, key=lambda t: (t.replica, t.stage))
        replicas = job.spec.workers
        microbatches = job.spec.microbatches
        return PipelineSection(
            stages=1 + max(t.stage for t in stages), replicas=replicas,
            microbatches=microbatches,
            microbatch=job.spec.data.batch_size // max(1, replicas * microbatches),
            layout=tuple(StageAssignment(
                replica=t.replica, stage=t.stage, role=t.role, index=t.index,
                first_layer=t.first_layer, last_layer=t.last_layer, layers=tuple(t.layers),
                estimated_memory_bytes=t.estimated_memory_bytes,
                memory_budget_bytes=t.memory_budget_bytes) for t in stages))
