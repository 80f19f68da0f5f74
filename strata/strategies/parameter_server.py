"""``parameter_server``: asynchronous training with ``ParameterServerStrategy``.

Tasks: ``chief:0`` (drives the loop with a ``ClusterCoordinator``), ``worker:i`` and ``ps:j``
(plain ``tf.distribute.Server`` processes). Keras 3 ignores TF's variable partitioners, so whole
layers are placed on PS tasks (``strata.psplan``) so that no PS task's share exceeds its slice;
the placement travels in the task contract. The chief's result ends the job. A worker task that
dies does not fail the job while another worker remains: the chief's ``ClusterCoordinator``
reschedules its steps. Runners: ``strata.worker.trainers.ps_chief`` (chief),
``strata.worker.server`` (the rest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from strata.errors import SpecError
from strata.cpukernels import family
from strata.memory import dataset_bytes, largest_variable_bytes
from strata.strategies import register
from strata.strategies.base import (
    FailureAction, FailureDecision, Strategy, budget_for, code_model_plan,
    largest_training_alloc, largest_variable, restart_or_fail, too_big,
)
from strata.taskconfig import ParameterServerSection
from strata.types import Job, JobPlan, Task, TaskPlan, WorkerOffer
from strata.units import format_size

if TYPE_CHECKING:
    from strata.modelspec import ModelProfile
    from strata.jobspec import JobSpec


@register
class ParameterServer(Strategy):
    name = "parameter_server"
    elastic = True
    runners = {"chief": "strata.worker.trainers.ps_chief:run_chief",
               "worker": "strata.worker.server:serve", "ps": "strata.worker.server:serve"}
    summary = "asynchronous: a chief, workers, and layers placed on parameter-server tasks"
    fields = frozenset({"parameter_servers"})
    runs_user_code = True

    def defaults(self) -> Mapping[str, int]:
        return {"parameter_servers": 1}

    def validate(self, spec: JobSpec) -> None:
        if spec.parameter_servers < 1:
            raise SpecError("parameter_servers", f"a {self.name} job needs at least one")

    def plan(self, spec: JobSpec, workers: Sequence[WorkerOffer],
             profile: ModelProfile | None) -> JobPlan:
        from strata.psplan import plan_parameter_servers

        if profile is None:  # a code model: its variables go round-robin over the PS tasks
            return code_model_plan(self.name, spec, workers, [("chief", 0)] + [
                ("worker", i) for i in range(spec.workers)] + [
                ("ps", j) for j in range(spec.parameter_servers)])

        kernels = family(w.kernels for w in workers)
        p = plan_parameter_servers(
            profile, num_ps=spec.parameter_servers, workers=spec.workers,
            optimizer=spec.training.optimizer_used.name, batch_size=spec.data.batch_size,
            mixed_precision=spec.memory.mixed_precision,
            data_bytes=dataset_bytes(spec.to_dict(), profile),
            ps_budget_bytes=spec.memory.per_task_budget_bytes or None, kernels=kernels)
        by_ps: dict[int, list[str]] = {}
        for layer in profile.layers:
            if layer.name in p.placement:
                by_ps.setdefault(p.placement[layer.name], []).append(layer.name)
        big = largest_variable(profile)
        ps_big = {j: max((largest_variable_bytes(l) for l in profile.layers
                          if p.placement.get(l.name) == j), default=0)
                  for j in range(spec.parameter_servers)}
        tasks = [TaskPlan("chief", 0, p.chief_bytes, budget_for(spec, p.chief_bytes, big))]
        tasks += [TaskPlan("worker", i, p.worker_bytes,
                           budget_for(spec, p.worker_bytes,
                                      largest_training_alloc(profile, kernels=kernels)))
                  for i in range(spec.workers)]
        tasks += [TaskPlan("ps", j, p.ps_bytes[j], budget_for(spec, p.ps_bytes[j], ps_big[j]),
                           layers=tuple(by_ps.get(j, ())))
                  for j in range(spec.parameter_servers)]
        summary = (f"1 chief, {spec.workers} worker(s), {spec.parameter_servers} parameter "
                   "server(s); layers on PS tasks: " + "; ".join(
                       f"ps:{j} {len(by_ps.get(j, ()))} layer(s), {format_size(p.ps_bytes[j])}"
                       for j in range(spec.parameter_servers)))
        if not p.feasible:
            return JobPlan(self.name, False, p.reason, tuple(tasks), summary)
        worst = too_big(tasks, workers)
        if worst is not None:
            reason = (f"task {worst.role}:{worst.index} needs "
                      f"{format_size(worst.memory_budget_bytes)} (estimate "
                      f"{format_size(worst.estimated_memory_bytes)} plus headroom) but the "
                      f"largest worker budget is {format_size(max(w.bytes for w in workers))}")
            if worst.role == "ps":
                reason += (f"; add parameter servers (parameter_servers: "
                           f"{spec.parameter_servers + 1})")
            return JobPlan(self.name, False, reason, tuple(tasks), summary)
        return JobPlan(self.name, True, "", tuple(tasks), summary)

    def probe_steps(self, spec: JobSpec) -> int:
        # steps are dispatched asynchronously: enough that every worker runs several, or a
        # worker that ran none would be measured at nothing
        return max(super().probe_steps(spec), 4 * max(1, spec.workers))

    def on_failure(self, job: Job, task: Task) -> FailureDecision:
        if task.role == "worker":
            left = [t for t in job.tasks if t.role == "worker" and not t.state.final]
            if left:
                return FailureDecision(
                    FailureAction.CONTINUE,
                    f"the job continues on {len(left)} remaining worker(s): the chief's "
                    f"ClusterCoordinator reschedules the steps of worker:{task.index}")
        return restart_or_fail(job, task)

    def batch_share(self, spec: JobSpec) -> str:
        return f"each step a whole batch on one of {spec.workers} workers"

    def narrow(self, spec: JobSpec, workers: int) -> JobSpec:
        # the chief and every PS task are needed (the PS tasks hold the placed layers); the
        # workers are interchangeable: as many as the agents left allow, at least one
        import dataclasses

        fit = workers - 1 - spec.parameter_servers
        if fit >= spec.workers or fit < 1:
            return spec
        return dataclasses.replace(spec, workers=fit)

    def oom_levers(self, job: Job, task: Task) -> list[str]:
        assert job.spec is not None
        if task.role == "ps":
            return [f"more parameter servers, so each holds fewer layers (parameter_servers: "
                    f"{job.spec.parameter_servers + 1})",
                    "an optimizer with fewer slots per parameter (training.optimizer.name: sgd)"]
        return super().oom_levers(job, task)

    def task_section(self, job: Job, task: Task) -> ParameterServerSection:
        ps = sorted((t for t in job.tasks if t.role == "ps"), key=lambda t: t.index)
        return ParameterServerSection(
            placement={name: t.index for t in ps for name in t.layers},
            ps_budgets_bytes=tuple(t.memory_budget_bytes for t in ps))
