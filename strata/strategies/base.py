"""The ``Strategy`` interface: everything that differs between distribution strategies.

A strategy owns, for its jobs:

- ``fields`` and ``validate``: which strategy-specific spec fields it takes, and their checks;
- ``plan``: the job plan (tasks, each task's estimate and budget), a pure function of the spec,
  the workers offered and the model's profile;
- ``lead`` and ``decide_on_end``: whose progress and result are the job's, and when the job has
  succeeded (the success rule);
- ``on_failure``: the failure policy, a pure function that returns a ``FailureDecision`` for the
  coordinator to carry out (restarts plug in here);
- ``task_section``: its part of the task contract (``strata.taskconfig``);
- ``runner``: the task-side code that runs a task of a given role (imported lazily, so that the
  coordinator, which also holds strategies, never imports TensorFlow).

Strategies are found by name in the registry (``strata.strategies``); nothing outside a
strategy's module and the registry branches on a strategy's name.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import TYPE_CHECKING, ClassVar, Mapping, Sequence

from strata.cpukernels import ANY
from strata.memory import (
    HEADROOM_FRACTION, HEADROOM_MIN, conv_workspace_bytes, default_budget, largest_variable_bytes,
)
from strata.taskconfig import TaskConfigError
from strata.types import FailureKind, Job, JobPlan, Task, TaskPlan, TaskState, WorkerOffer
from strata.units import format_size

if TYPE_CHECKING:
    from strata.modelspec import ModelProfile
    from strata.jobspec import JobSpec
    from strata.taskconfig import StrategySection


# --- decisions -------------------------------------------------------------------------------

class FailureAction(str, enum.Enum):
    FAIL_JOB = "FAIL_JOB"      # stop the other tasks, the job ends FAILED
    CONTINUE = "CONTINUE"      # the job carries on without the task
    RESTART = "RESTART"        # stop the other tasks, place the job again, resume it from
                               # its latest checkpoint (``restart.max_restarts``)


@dataclasses.dataclass(frozen=True)
class FailureDecision:
    action: FailureAction
    message: str


@dataclasses.dataclass(frozen=True)
class EndDecision:
    """The job has succeeded. ``stop_others``: its remaining tasks (servers) are stopped, and
    count as succeeded when they report being stopped."""

    message: str
    stop_others: bool = False


def describe_failure(t: Task) -> str:
    if t.failure == FailureKind.OOM:
        if "ran out of memory" in t.message:  # the coordinator's account (strata.oom.describe)
            return t.message
        return (f"out of memory: the task exceeded its memory slice of "
                f"{format_size(t.memory_budget_bytes)} (peak seen {format_size(t.peak_memory_bytes)})"
                + (f"; {t.message}" if t.message else ""))
    if t.failure == FailureKind.EXIT_CODE:
        return f"exited with code {t.exit_code}" + (f": {t.message}" if t.message else "")
    return t.message or t.failure.value.lower()


#: failures a restart cannot mend: the same configuration fails the same way
NEVER_RETRIED = {FailureKind.BAD_CONFIG: "its configuration was refused; a restart would run "
                                         "the same configuration"}


def restart_or_fail(job: Job, task: Task) -> FailureDecision:
    """The restart policy every strategy's ``on_failure`` ends in: restart the job while
    ``restart.max_restarts`` allows, unless the failure would only repeat. The job's own code
    raising is not retried unless ``restart.retry_user_errors`` says so; running out of memory
    is retried only on a new plan (the coordinator re-plans with the measured need and fails
    the job when no plan of the cluster fits it)."""
    assert job.spec is not None
    spec = job.spec
    what = f"task {task.role}:{task.index} failed: {describe_failure(task)}"
    if task.failure in NEVER_RETRIED:
        return FailureDecision(FailureAction.FAIL_JOB, f"{what}; {NEVER_RETRIED[task.failure]}")
    if task.failure == FailureKind.USER_CODE and not spec.retry_user_errors:
        retry = " (restart.retry_user_errors: true retries it)" if spec.max_restarts else ""
        return FailureDecision(FailureAction.FAIL_JOB, f"{what}; the job's own code raised, "
                                                       f"not retried{retry}")
    used = job.recovery.failures
    if used >= spec.max_restarts:
        if not spec.max_restarts:
            return FailureDecision(FailureAction.FAIL_JOB, what)
        return FailureDecision(FailureAction.FAIL_JOB, f"{what}; no restarts left ({used} of "
                                                       f"restart.max_restarts {spec.max_restarts}"
                                                       " used)")
    return FailureDecision(FailureAction.RESTART, what)


def success_message(job: Job) -> str:
    acc = job.metrics.test_accuracy
    return f"test accuracy {acc:.4f}" if acc is not None else "done"


# --- plan helpers ----------------------------------------------------------------------------

def budget_for(spec: JobSpec, estimate: int, largest_alloc: int = 0) -> int:
    """A task's budget: ``memory.per_task_budget`` when the job sets one, else the estimate plus
    headroom, with room for its largest single allocation (``strata.memory.default_budget``)."""
    return spec.memory.per_task_budget_bytes or default_budget(estimate, largest_alloc)


def largest_variable(profile: ModelProfile, first: int = 0, last: int | None = None) -> int:
    """Bytes of the largest trainable variable of layers ``[first, last)``."""
    layers = profile.layers[first:last]
    return max((largest_variable_bytes(layer) for layer in layers), default=0)


def largest_training_alloc(profile: ModelProfile, first: int = 0, last: int | None = None,
                           kernels: str = ANY) -> int:
    """The largest single tensor a training step of layers ``[first, last)`` allocates: a
    variable (its gradient and update temporaries are the same size) or a convolution's
    im2col buffer (``strata.memory.conv_workspace_bytes``). A budget leaves room for it to be
    found contiguous (``default_budget``)."""
    layers = profile.layers[first:last]
    return max([largest_variable(profile, first, last)]
               + [conv_workspace_bytes(layer, kernels) for layer in layers])


def offer_for_estimate(free_bytes: int) -> int:
    """The largest estimate whose default budget fits ``free_bytes``."""
    return max(0, min(int(free_bytes / (1 + HEADROOM_FRACTION)), free_bytes - HEADROOM_MIN))


def too_big(tasks: Sequence[TaskPlan], workers: Sequence[WorkerOffer]) -> TaskPlan | None:
    """The largest task no worker can hold, if any (with no workers: none, they may join)."""
    if not workers:
        return None
    largest = max(w.bytes for w in workers)
    worst = max(tasks, key=lambda t: t.memory_budget_bytes, default=None)
    return worst if worst is not None and worst.memory_budget_bytes > largest else None


# --- the interface ---------------------------------------------------------------------------

class Strategy(abc.ABC):
    #: the spec's ``strategy`` value
    name: ClassVar[str]
    #: one line for help texts and docs
    summary: ClassVar[str] = ""
    #: optional spec fields this strategy takes (dotted names); others must stay unset
    fields: ClassVar[frozenset[str]] = frozenset()
    #: the task whose progress and result are the job's
    lead: ClassVar[tuple[str, int]] = ("chief", 0)
    #: True: the lead drives the job, the other tasks serve it and are stopped when it succeeds;
    #: False: every task trains, and the job succeeds when all of them have
    lead_drives: ClassVar[bool] = True
    #: runs a job's own code (``code.model``, ``code.dataset``): its runner calls the user's
    #: functions and its ``plan`` takes ``profile=None`` for a model only code can build
    runs_user_code: ClassVar[bool] = False
    #: per role, the function its task process runs, as ``"module:function"`` (a
    #: ``(TaskConfig, Events) -> int``; ``runner``): named, not imported, so that the
    #: coordinator, which holds strategies too, never loads task-side code or TensorFlow
    runners: ClassVar[Mapping[str, str]] = {}
    #: takes ``workers: {min, max}``: its ``narrow`` runs the job at any width in the range, and
    #: a resize restarts it from a checkpoint at another width, the global batch kept
    elastic: ClassVar[bool] = False

    # -- spec

    def defaults(self) -> Mapping[str, int]:
        """Defaults of strategy-specific integer fields, e.g. ``{"parameter_servers": 1}``."""
        return {}

    def validate(self, spec: JobSpec) -> None:
        """Checks the strategy's own constraints on a parsed spec. Raises ``SpecError``."""

    # -- plan

    @abc.abstractmethod
    def plan(self, spec: JobSpec, workers: Sequence[WorkerOffer],
             profile: ModelProfile | None) -> JobPlan:
        """The job's tasks and budgets against ``workers`` (whole budgets when admitting, free
        ones for ``strata plan``). Pure. Raises ``SpecError`` for arguments it refuses.
        ``profile`` is None only for a model the job's code builds (``runs_user_code``)."""

    def describe_plan(self, spec: JobSpec, plan: JobPlan) -> str:
        """The submit event's account of the plan."""
        return f"{self.name}: {plan.summary}; tasks " + ", ".join(
            f"{t.role}:{t.index} est {format_size(t.estimated_memory_bytes)} budget "
            f"{format_size(t.memory_budget_bytes)}" for t in plan.tasks)

    def probe_steps(self, spec: JobSpec) -> int:
        """Steps of the probe run that measures a job's tasks (``memory.profile``): the first
        step traces and allocates everything; the peak is reached in it or the next."""
        return 3

    # -- lifecycle decisions (pure)

    def is_lead(self, task: Task) -> bool:
        return (task.role, task.index) == self.lead

    def decide_on_end(self, job: Job, task: Task) -> EndDecision | None:
        """Called when ``task`` reached a final state and the job is not final: whether the job
        has now succeeded. Failures go through ``on_failure`` instead."""
        if self.lead_drives:
            if self.is_lead(task) and task.state == TaskState.SUCCEEDED:
                return EndDecision(success_message(job), stop_others=True)
            return None
        if all(t.state == TaskState.SUCCEEDED for t in job.tasks):
            return EndDecision(success_message(job))
        return None

    def stopped_counts_as_success(self, job: Job, task: Task) -> bool:
        """A task stopped after its job succeeded (a server whose driver finished)."""
        return self.lead_drives and not self.is_lead(task)

    def on_failure(self, job: Job, task: Task) -> FailureDecision:
        """The failure policy: what a failed task means for its job. The default restarts the
        job while its restart policy allows (``restart_or_fail``), else fails it; strategies
        that can carry on without the task say so."""
        return restart_or_fail(job, task)

    def narrow(self, spec: JobSpec, workers: int) -> JobSpec:
        """The spec a restart runs when only ``workers`` agents are available (fewer than the
        job's tasks): a strategy that can run narrower (fewer data-parallel replicas, the
        global batch kept) returns that spec; the default keeps the spec and the job waits
        for workers."""
        return spec

    def batch_share(self, spec: JobSpec) -> str:
        """What each of ``spec``'s workers takes of the global batch, for a resize's event."""
        return f"{spec.data.batch_size // max(1, spec.workers)} examples per worker"

    def width_for(self, spec: JobSpec, agents: int) -> JobSpec:
        """An elastic ``spec`` at its widest for ``agents`` agents (``narrow`` from its
        ``max``), never below its ``min``: with fewer agents than ``min`` needs, the spec at
        ``min``, which waits for them. A fixed spec is ``narrow``'s."""
        import dataclasses

        if not spec.elastic:
            return self.narrow(spec, agents)
        out = self.narrow(dataclasses.replace(spec, workers=spec.workers_max), agents)
        if out.workers < spec.workers_min:
            out = dataclasses.replace(spec, workers=spec.workers_min)
        return out

    # -- out of memory

    def where(self, job: Job, task: Task) -> str:
        """Where ``task`` sits in its job, for messages: e.g. " (stage 1 of replica 0)"."""
        return ""

    def oom_levers(self, job: Job, task: Task) -> list[str]:
        """What, besides a larger budget, would make ``task`` fit (for an OOM report)."""
        assert job.spec is not None
        b = job.spec.data.batch_size
        return [f"a smaller batch (data.batch_size: {b // 2})"] if b > 1 else []

    # -- the task contract

    def task_section(self, job: Job, task: Task) -> StrategySection:
        """This strategy's section of ``task``'s ``TaskConfig`` (None: it needs none)."""
        return None

    def runner(self, role: str) -> str:
        """Where the function that runs a task of ``role`` lives: ``"module:function"``, from
        ``runners``. The task process imports it (``strata.worker.task``); this floor never
        imports task-side code. Raises ``TaskConfigError`` for a role it does not run."""
        path = self.runners.get(role)
        if path is None:
            roles = " and ".join(self.runners) or "no"
            raise TaskConfigError("role", f"a {self.name} job has {roles} tasks, not {role!r}")
        return path


def code_model_plan(name: str, spec: JobSpec, workers: Sequence[WorkerOffer],
                    tasks: Sequence[tuple[str, int]]) -> JobPlan:
    """The plan of a model only the job's code can build: it has no size before it runs. With
    ``memory.per_task_budget`` that is each task's budget; without it every task is planned for
    a whole worker (the ``len(tasks)``-th largest budget: the most every task can have), a probe
    run measures them (``memory.profile``, which a code model always takes), and the job is
    planned again on what the probe measured."""
    n = len(tasks)
    if spec.memory.per_task_budget:
        budget = spec.memory.per_task_budget_bytes
    else:
        sizes = sorted((w.bytes for w in workers), reverse=True)
        if len(sizes) < n:
            return JobPlan(name, False, f"a model built by code.model is measured by a probe "
                                        f"run on {n} workers before it is planned; {len(sizes)} "
                                        f"{'is' if len(sizes) == 1 else 'are'} connected "
                                        f"(or give memory.per_task_budget)",
                           tuple(TaskPlan(r, i, 0, 0) for r, i in tasks))
        budget = sizes[n - 1]
    plan = tuple(TaskPlan(r, i, budget, budget) for r, i in tasks)
    if too_big(plan, workers) is None:
        return JobPlan(name, True, "", plan)
    return JobPlan(name, False, f"each task asks for memory.per_task_budget "
                                f"{format_size(budget)}, more than any worker has", plan)
