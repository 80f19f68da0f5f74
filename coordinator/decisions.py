"""What the coordinator decides on an event, as data: pure functions of the state they are
shown and the event, returning effects that ``Coordinator`` applies (state first, then the
store, then events and messages to agents). Tested by tables of (state, event) -> effects
in ``tests/test_decisions.py``, without a running coordinator.

``on_report``: an agent's report of one task (progress, figures, a final state).
``on_task_change``: what a task's new state means for its job.
``on_failure``: what a task's failure does to its job (with ``may_retry_memory``).
``restart``: a restart's record; ``stopping``: how a job's remaining tasks stop.
``notice``: where a job saves on a notice that its worker leaves (``notice_saved``: it did).
``on_tick``: what a pass of the control loop does with a live job.
``lost_with``: the tasks an agent's loss fails.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import AbstractSet, Any, Callable, Iterable, Mapping

from strata.strategies import FailureAction, Strategy
from strata.types import FailureKind, Job, JobState, Task, TaskReport, TaskState, can_transition

_NONE: Mapping[str, Any] = MappingProxyType({})
# (enum members looked up once: a heartbeat repeats every task's report)
_T_CANCELLED, _T_FAILED, _T_PENDING, _T_SUCCEEDED = (
    TaskState.CANCELLED, TaskState.FAILED, TaskState.PENDING, TaskState.SUCCEEDED)
_J_SUCCEEDED, _F_OOM = JobState.SUCCEEDED, FailureKind.OOM
_RESUMABLE = (JobState.SCHEDULED, JobState.RUNNING)

#: distinct notes of a job's tasks said as events; more are dropped (a task that sends a new
#: note every step must not flood the job's events)
MAX_NOTES_PER_JOB = 8


class Move(str):
    """What a report does to its task's state (``ReportEffects.move``)."""


#: the task ran out of memory: the coordinator blames the task whose device ran out
#: (``Coordinator._fail_oom``)
FAIL_OOM = Move("fail_oom")
#: the task failed otherwise (``Coordinator._fail_task``: the strategy's failure policy)
FAIL = Move("fail")
#: the task moved to another state (``ReportEffects.state``); its job then decides
#: (``Coordinator._after_task_change``)
CHANGE = Move("change")


@dataclasses.dataclass(slots=True)
class ReportEffects:
    """The effects of one report. ``in_use_bytes`` and ``peak_bytes``: the task's figures
    now (its peak never falls). ``task`` and ``job`` are other fields to set on the task and the
    job (``metrics`` on ``job.metrics``, ``recovery`` on ``job.recovery``); ``largest_alloc`` a (task kind, bytes) to keep when
    larger than what is kept; ``notes`` and ``events`` (kind, message) to add to the job's
    events; ``write_job``: the job's record changed in a field stored at once; ``move``
    (None: the state stays), with ``state``, ``failure``, ``exit_code`` and ``message`` the
    report's (``message`` rewritten where the report is read differently); ``progressed``:
    something watchers see changed (``Coordinator`` then writes figures now and then and
    wakes them)."""

    in_use_bytes: int
    peak_bytes: int
    task: Mapping[str, Any]
    job: Mapping[str, Any]
    metrics: Mapping[str, Any]
    recovery: Mapping[str, Any]
    largest_alloc: tuple[str, int] | None
    notes: tuple[str, ...]
    events: tuple[tuple[str, str], ...]
    write_job: bool
    move: Move | None
    state: TaskState
    failure: FailureKind
    exit_code: int
    message: str
    progressed: bool


def on_report(job: Job, task: Task, r: TaskReport, *, lead: bool, stopped_is_success: bool,
              kind: str = "", largest_known: int = 0,
              notes_said: AbstractSet[str] = frozenset()) -> ReportEffects:
    """The effects of report ``r`` of ``task`` (of ``job``, not final for the task). ``lead``:
    the task is its strategy's lead (its progress and result are the job's);
    ``stopped_is_success``: the strategy counts this task stopped after its job succeeded as
    succeeded (a server whose driver finished); ``kind`` (``strata.measured.task_kind``) and
    ``largest_known``: the largest single allocation kept for that kind; ``notes_said``: the
    notes of the job already said."""
    peak = max(task.peak_memory_bytes, r.peak_bytes)
    t: Mapping[str, Any] = _NONE
    if r.weights_sha256 or r.replica_weights_sha256 or r.model_path:
        t = _outputs(r)
    largest = None
    if r.largest_alloc_bytes and kind:
        # (a computed figure, not the allocator's: never more than the task's budget)
        alloc = min(r.largest_alloc_bytes, task.memory_budget_bytes)
        if alloc > largest_known:
            largest = (kind, alloc)
    notes: tuple[str, ...] = ()
    if r.notes:  # said once per job, whichever task says it
        new: list[str] = []
        for note in r.notes:
            if note not in notes_said and note not in new \
                    and len(notes_said) + len(new) < MAX_NOTES_PER_JOB:
                new.append(note)
        notes = tuple(new)
    j: Mapping[str, Any] = _NONE
    m: Mapping[str, Any] = _NONE
    rec: Mapping[str, Any] = _NONE
    events: tuple[tuple[str, str], ...] = ()
    write = False
    metrics = job.metrics
    step, accuracy = metrics.step, metrics.test_accuracy
    if lead:  # (a heartbeat repeats every task's report: the common case costs little)
        j, m, rec, events, write = _lead_report(job, r)
        step, accuracy = m.get("step", step), m.get("test_accuracy", accuracy)

    state, message = r.state, r.message
    if state == _T_CANCELLED and stopped_is_success and job.state == _J_SUCCEEDED:
        # a server task stopped because its driver finished: that is how such a task ends
        # when all went well
        state, message = _T_SUCCEEDED, "stopped after the job succeeded"
    move = None
    if state != task.state and state != _T_PENDING:
        if state == _T_FAILED:
            move = FAIL_OOM if r.failure == _F_OOM else FAIL
        elif can_transition(task.state, state):
            move = CHANGE
    progressed = (task.in_use_bytes != r.in_use_bytes or task.peak_memory_bytes != peak
                  or step != metrics.step or accuracy != metrics.test_accuracy)
    return ReportEffects(r.in_use_bytes, peak, t, j, m, rec, largest, notes, events, write, move,
                         state, r.failure, r.exit_code, message, progressed)


def _outputs(r: TaskReport) -> dict[str, Any]:
    """What the task says it made: its weights' digests, the model it saved."""
    t: dict[str, Any] = {}
    if r.weights_sha256:
        t["weights_sha256"] = r.weights_sha256
    if r.replica_weights_sha256:
        t["replica_weights_sha256"] = list(r.replica_weights_sha256)
    if r.model_path:
        t["model_path"] = r.model_path
    return t


def _lead_report(job: Job, r: TaskReport) -> tuple[Mapping[str, Any], Mapping[str, Any],
                                                   Mapping[str, Any],
                                                   tuple[tuple[str, str], ...], bool]:
    """What the lead's report says of its job: (job fields, metrics, recovery fields, events,
    whether the job's record is written now)."""
    j: dict[str, Any] = {}
    rec: Mapping[str, Any] = _NONE
    events: tuple[tuple[str, str], ...] = ()
    if r.training and r.training != job.training:
        j["training"] = r.training  # what its model trains with, and where it came from
        if not job.training:  # an event once: a lead that says it again writes no more
            events += (("message", f"training with {r.training}"),)
    if r.checkpoint_step > job.checkpoint_step:
        j["checkpoint_step"] = r.checkpoint_step
    # (a restarting job's reports are its old attempt's: resumes come after it is placed)
    if job.recovery.step_at_failure and (r.resumed_step or r.step) and job.state in _RESUMABLE:
        # the lead resumed from a checkpoint, or started afresh without one (its first
        # progress carries no resumed step): what it trains again is counted once
        repeated = max(0, job.recovery.step_at_failure - r.resumed_step)
        j["steps_repeated"] = job.steps_repeated + repeated
        rec = {"step_at_failure": 0}
        events += (("message", (f"resumed from the checkpoint at step {r.resumed_step}"
                                if r.resumed_step else "no checkpoint to resume from")
                    + f"; {repeated} step(s) trained again"),)
    write = bool(j)
    m: Mapping[str, Any] = _NONE
    if r.step:
        progress: dict[str, Any] = {"step": r.step, "total_steps": r.total_steps, "loss": r.loss}
        if r.examples_per_sec:
            progress["examples_per_sec"] = r.examples_per_sec
        m = progress
        if r.first_step_time and not job.started_at:
            j["started_at"] = r.first_step_time  # (written with the figures, now and then)
    if r.test_accuracy is not None:
        m = {**m, "test_accuracy": r.test_accuracy, "test_loss": r.test_loss,
             "test_metrics": dict(r.test_metrics)}
    return j or _NONE, m, rec, events, write


# --- a task's change ---------------------------------------------------------------------------

class JobAction(str):
    """What a task's change does to its job (``JobStep.action``)."""


NOTHING = JobAction("nothing")
#: the job is over or restarting and the task ended: the control loop looks again (its
#: budget is free once the process is gone)
WAKE = JobAction("wake")
#: restart the job (``restart.max_restarts`` counts it: a task failed)
RESTART = JobAction("restart")
#: fail the job and stop its other tasks
FAIL_JOB = JobAction("fail_job")
#: the job succeeded; with ``SUCCEED_AND_STOP`` its other tasks (servers) are stopped
SUCCEED = JobAction("succeed")
SUCCEED_AND_STOP = JobAction("succeed_and_stop")
#: every task runs (or ended as its strategy allows): the job is RUNNING
RUN = JobAction("run")


@dataclasses.dataclass(frozen=True, slots=True)
class JobStep:
    """``action`` with its ``message``; ``cancelled``: the task, stopped while its job ran
    (its agent shut down), is a failure of kind CANCELLED (stored first)."""

    action: JobAction
    message: str = ""
    cancelled: bool = False


_NOTHING = JobStep(NOTHING)


def on_task_change(job: Job, task: Task, strategy: Strategy) -> JobStep:
    """What ``task``'s new state (already set) means for ``job``, by ``strategy``'s rules
    (``Strategy.on_failure``, ``decide_on_end``: pure functions of the job and task)."""
    if job.state.final or job.state == JobState.RESTARTING:
        return JobStep(WAKE if task.state.final else NOTHING)
    if task.state == TaskState.CANCELLED and job.recovery.notice_step:
        # stopped on a notice after its save: the job restarts once the save is reported,
        # or at the notice's deadline (``Coordinator._notices_due``)
        return _NOTHING
    if task.state == TaskState.CANCELLED and job.state in (JobState.SCHEDULED, JobState.RUNNING):
        # stopped although its job runs (its agent shut down): the job lost a task
        decision = strategy.on_failure(job, dataclasses.replace(task,
                                                                failure=FailureKind.CANCELLED))
        action = {FailureAction.RESTART: RESTART,
                  FailureAction.FAIL_JOB: FAIL_JOB}.get(decision.action, NOTHING)
        return JobStep(action, decision.message, cancelled=True)
    if task.state.final:
        end = strategy.decide_on_end(job, task)
        if end is not None:
            return JobStep(SUCCEED_AND_STOP if end.stop_others else SUCCEED, end.message)
    if job.state == JobState.SCHEDULED and all(
            t.state in (TaskState.RUNNING, TaskState.SUCCEEDED, TaskState.FAILED)
            for t in job.tasks):
        # (a FAILED task here is one the strategy's failure policy carries on without)
        return JobStep(RUN, "all tasks running")
    return _NOTHING


# --- a task's failure ---------------------------------------------------------------------------

#: the job carries on without the failed task (its policy says so): an event says why
CONTINUE = JobAction("continue")
#: restart once, not counted, planned on what the task was seen to need (``may_retry_memory``)
MEMORY_RETRY = JobAction("memory_retry")
def on_failure(job: Job, policy: JobStep, *, memory_retry: bool) -> JobStep:
    """What a task's failure (its state already FAILED) does to ``job``: ``policy`` is what the
    strategy's failure policy says of it (``Strategy.on_failure`` as ``failure_step``);
    ``memory_retry``: the failure was out of memory and ``may_retry_memory`` allows one retry.
    A job that is no longer running or starting takes no decision: the task died in its stop."""
    if job.state not in _RESUMABLE:
        return _NOTHING  # a casualty of its job's stop or restart
    if policy.action == CONTINUE:
        return policy
    if memory_retry:
        return JobStep(MEMORY_RETRY, policy.message)
    return policy


def failure_step(action: FailureAction, message: str) -> JobStep:
    """A strategy's failure decision as a job step (CONTINUE, RESTART or FAIL_JOB)."""
    return JobStep({FailureAction.CONTINUE: CONTINUE, FailureAction.RESTART: RESTART}.get(
        action, FAIL_JOB), message)


def may_retry_memory(job: Job, task: Task, device_bytes: int) -> bool:
    """Whether ``task``'s out-of-memory failure restarts its job once, not counted: only when
    its budget was Strata's guess (no ``memory.per_task_budget``), the job was not retried for
    memory before, it is not a probe (a probe grows instead: ``Coordinator._grow_probe``) and
    the task did not have the whole device (``device_bytes``; 0: unknown)."""
    assert job.spec is not None
    rec = job.recovery
    if job.spec.memory.per_task_budget or rec.memory_retried or rec.probe_of:
        return False
    return not (device_bytes and task.memory_budget_bytes >= device_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Restart:
    """A restart's record: ``recovery`` fields to set on ``job.recovery``, the job's new
    ``restarts`` count, the RESTARTING state's ``message`` and the ``event`` that says where it
    resumes from; ``oom_budget`` (role, index, budget) that a re-plan must exceed, or None."""

    restarts: int
    recovery: Mapping[str, Any]
    message: str
    event: str
    oom_budget: tuple[str, int, int] | None


def restart(job: Job, cause: str, now: float, *, failure: bool,
            oom: Task | None = None) -> Restart:
    """The restart of ``job`` for ``cause`` at ``now``; ``failure``: it counts against
    ``restart.max_restarts``; ``oom``: the task that ran out of memory, which the next plan
    must give more."""
    assert job.spec is not None
    rec = job.recovery
    restarts = job.restarts + 1
    failures = rec.failures + (1 if failure else 0)
    fields = {"failures": failures,
              "requested_workers": rec.requested_workers or job.spec.workers,
              # a restart from a notice's checkpoint has no failure to back off from
              "restart_at": now + (0.0 if rec.notice_step and not failure
                                   else job.spec.restart_backoff_s),
              "step_at_failure": max(rec.step_at_failure, job.metrics.step),
              "last_cause": cause, "replanned": False, "notice_step": 0,
              "notice_deadline": 0.0,
              # the run ends: what it trained counts, the time it stops does not
              "ran_s": trained_for(job, now), "run_began": 0.0}
    left = (f"{failures} of {job.spec.max_restarts}" if failure
            else "not counted against restart.max_restarts")
    resumes = (f"the checkpoint at step {job.checkpoint_step}" if job.checkpoint_step
               else "the start (no checkpoint yet)")
    return Restart(
        restarts=restarts, recovery=MappingProxyType(fields),
        message=f"restart {restarts} ({left}) in {job.spec.restart_backoff_s:g} s: {cause}",
        event=f"restart {restarts}: {cause}; resumes from {resumes}",
        oom_budget=None if oom is None else (oom.role, oom.index, oom.memory_budget_bytes))


# --- a notice --------------------------------------------------------------------------------

#: how long a notice takes to reach a job's tasks, in seconds: the lead's step is up to a report
#: interval (1 s) old, and the command goes through the agent to the task. The step they are
#: asked to save at is this far ahead of the last reported one, at the job's rate.
NOTICE_LEAD_S = 2.0


@dataclasses.dataclass(frozen=True, slots=True)
class NoticePlan:
    """What a notice does to a running job: its tasks save at ``step`` and stop, and the job
    restarts from that checkpoint; or, with ``step`` 0, it restarts now for ``reason`` (from its
    last periodic checkpoint)."""

    step: int
    reason: str = ""


def notice(job: Job, deadline_s: float, steps_per_s: float, *, storage: bool) -> NoticePlan:
    """Where ``job``, running at ``steps_per_s`` (0: not known yet), saves on a notice that its
    worker leaves in ``deadline_s``: the step its lead last reported plus what it trains in
    ``NOTICE_LEAD_S`` and one more, so that every task is told before it gets there. The save
    must be reached within half the deadline (the other half is the save's and the stop's);
    else, with nowhere to save (a shared directory on every task's agent, ``storage``; a job
    without ``checkpoint:`` saves on notice too), or with no step yet, the job restarts at once."""
    if not storage:
        return NoticePlan(0, "a worker of it has no shared directory to save a checkpoint in")
    now_step = job.metrics.step
    if not now_step or steps_per_s <= 0:
        return NoticePlan(0, "it has not reported a step yet")
    step = now_step + int(steps_per_s * NOTICE_LEAD_S) + 1
    if (step - now_step) / steps_per_s > deadline_s / 2:
        return NoticePlan(0, f"the deadline of {deadline_s:g} s leaves no time to reach a "
                             f"step all its tasks can save at (step {step})")
    return NoticePlan(step)


_RUNS = frozenset({JobState.SCHEDULED, JobState.RUNNING})


def trained_for(job: Job, now: float) -> float:
    """Seconds ``job`` has trained by ``now``: its ended runs (``recovery.ran_s``) and its
    current one, from its first step (first run) or its placement (later runs); not the time
    it spent restarting, preempted or waiting."""
    rec = job.recovery
    begin = rec.run_began or job.started_at
    if job.state in _RUNS and begin:
        return rec.ran_s + max(0.0, now - begin)
    return rec.ran_s


def past_time_limit(job: Job, now: float) -> str:
    """Why ``job`` fails now for its ``training.time_limit`` (the time it trained, from its
    first step, not counting the time it was stopped), or "" while within it."""
    limit = job.spec.training.time_limit_s if job.spec is not None else 0.0
    if not limit or job.state.final or trained_for(job, now) <= limit:
        return ""
    return (f"ran past its training.time_limit of {limit:g} s (training from its first step, "
            f"not counting the time it was stopped), at step {job.metrics.step}")


def may_grow(job: Job, now: float, settle_s: float) -> bool:
    """Whether elastic ``job`` may grow now: running below its ``max``, no notice or resize in
    flight, a step reported, and ``settle_s`` passed since its first step and since its last
    resize ended."""
    spec = job.spec
    if spec is None or not spec.elastic or job.state != JobState.RUNNING:
        return False
    rec = job.recovery
    if spec.workers >= spec.workers_max or rec.notice_step or rec.resize_began or rec.probe_of:
        return False
    return job.metrics.step > 0 and bool(job.started_at) \
        and now - max(rec.resized_at, job.started_at) >= settle_s


def notice_saved(job: Job) -> bool:
    """Whether ``job``'s notice checkpoint has been reported: it restarts from it now."""
    step = job.recovery.notice_step
    return bool(step) and job.checkpoint_step >= step and job.state in _RESUMABLE


# --- a job's stop -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    """How a job's remaining tasks stop: ``cancel`` (never reported started: nothing to wait
    for), ``lost`` (their agent is lost: they failed with it), and the agents to tell
    (``tell``, in the order the tasks are listed), whose tasks stay reserved until reported
    gone."""

    cancel: tuple[Task, ...]
    lost: tuple[Task, ...]
    tell: tuple[str, ...]


def stopping(job: Job, lost: Callable[[str], bool | None]) -> Stop:
    """The stop of ``job``'s tasks not yet ended. ``lost``: whether the agent of that name is
    lost (None: no such agent). A task on a live agent is told to stop even when
    PENDING: its start may still be in flight (should it arrive, the agent reports the task
    running and heartbeats repeat the stop)."""
    cancel: list[Task] = []
    gone: list[Task] = []
    tell: dict[str, None] = {}
    for t in job.tasks:
        if t.state.final:
            continue
        agent_lost = lost(t.worker) if t.worker else None
        if agent_lost is False:
            tell[t.worker] = None
        if agent_lost is None or t.state == _T_PENDING:
            cancel.append(t)
        elif agent_lost:
            gone.append(t)
    return Stop(tuple(cancel), tuple(gone), tuple(tell))


# --- a tick -------------------------------------------------------------------------------------

#: try to place the job now (``Coordinator._try_schedule``)
PLACE = JobAction("place")
#: its memory probe may have ended: take its figures (``Coordinator._after_probe``), then place
AFTER_PROBE = JobAction("after_probe")
#: its processes are gone and its backoff is over: plan it again, then place it
RESUME = JobAction("resume")


#: the states of the jobs ``on_tick`` may act on (for the others it decides NOTHING): a tick
#: asks only for these, so thousands of running jobs cost it nothing
TICK_STATES = frozenset({JobState.PENDING, JobState.RESTARTING, JobState.SCHEDULED})

_PLACE, _AFTER_PROBE, _RESUME = JobStep(PLACE), JobStep(AFTER_PROBE), JobStep(RESUME)


def on_tick(job: Job, now: float, *, probing: bool = False, scheduled_since: float = 0.0,
            start_timeout_s: float = 300.0) -> JobStep:
    """What a pass of the control loop does with live ``job``: ``probing``, it waits for its
    memory probe; ``scheduled_since``, when it was placed (SCHEDULED)."""
    if job.state == JobState.PENDING:
        deadline = job.recovery.capacity_deadline
        if deadline and now > deadline:
            return JobStep(FAIL_JOB, f"not placed by its --queue-for-capacity deadline: "
                                     f"{job.message}")
        return _AFTER_PROBE if probing else _PLACE
    if job.state == JobState.RESTARTING:
        if job.recovery.replanned:
            return _PLACE
        if any(not t.state.final for t in job.tasks) or now < job.recovery.restart_at:
            return _NOTHING  # its processes are being stopped, or it backs off
        return _RESUME
    if job.state == JobState.SCHEDULED and now - scheduled_since > start_timeout_s:
        # tasks that never all reach RUNNING (a peer that cannot start, a rendezvous that
        # never completes) must not hold their reservations for ever
        slow = [f"{t.role}:{t.index} ({t.state.value})" for t in job.tasks
                if t.state != TaskState.RUNNING]
        return JobStep(FAIL_JOB, f"tasks did not start within {start_timeout_s:g} s: "
                                 f"{', '.join(slow)}")
    return _NOTHING


# --- an agent's loss ----------------------------------------------------------------------------

def lost_with(jobs: Iterable[Job], worker: str) -> list[tuple[Job, Task]]:
    """The unfinished tasks of ``jobs`` on ``worker``, which a lost agent takes with it (each
    fails as LOST, and its job's failure policy decides: one task per agent per job)."""
    return [(job, t) for job in jobs for t in job.tasks
            if t.worker == worker and not t.state.final]
