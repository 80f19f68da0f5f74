"""The coordinator's decisions as tables of (state, event) -> effects, without a coordinator:
``decisions.on_report``, an agent's report of one task."""

from __future__ import annotations

import dataclasses

import pytest

from strata.coordinator import decisions
from strata.coordinator.decisions import CHANGE, FAIL, FAIL_OOM, MAX_NOTES_PER_JOB, on_report
from strata.types import FailureKind, Job, JobState, Task, TaskReport, TaskState
from strata.units import MiB


def _job(state: JobState = JobState.RUNNING, **fields) -> Job:
    job = Job(id="j", name="j", state=state, strategy="pipeline", spec=None, created_at=0.0)
    for name, value in fields.items():
        setattr(job, name, value)
    return job


def _task(state: TaskState = TaskState.RUNNING, **fields) -> Task:
    return Task(job_id="j", role=fields.pop("role", "chief"), index=0, state=state,
                memory_budget_bytes=100 * MiB, **fields)


def _report(state: TaskState = TaskState.RUNNING, **fields) -> TaskReport:
    return TaskReport("j", "chief", 0, state, **fields)


#: (job state, task state, report, stopped_is_success) -> (move, state, message)
MOVES = [
    (JobState.RUNNING, TaskState.RUNNING, _report(), False, None, None),
    (JobState.RUNNING, TaskState.STARTING, _report(), False, CHANGE, TaskState.RUNNING),
    (JobState.RUNNING, TaskState.RUNNING, _report(TaskState.PENDING), False, None, None),
    (JobState.RUNNING, TaskState.RUNNING, _report(TaskState.SUCCEEDED, message="done"), False,
     CHANGE, TaskState.SUCCEEDED),
    (JobState.RUNNING, TaskState.RUNNING,
     _report(TaskState.FAILED, failure=FailureKind.EXIT_CODE, message="boom", exit_code=1), False,
     FAIL, TaskState.FAILED),
    (JobState.RUNNING, TaskState.RUNNING,
     _report(TaskState.FAILED, failure=FailureKind.OOM, message="OOM"), False,
     FAIL_OOM, TaskState.FAILED),
    # a server stopped because its driver finished: succeeded, said so
    (JobState.SUCCEEDED, TaskState.RUNNING, _report(TaskState.CANCELLED), True,
     CHANGE, TaskState.SUCCEEDED),
    # the same stop of a task that is not a server: cancelled as reported
    (JobState.SUCCEEDED, TaskState.RUNNING, _report(TaskState.CANCELLED), False,
     CHANGE, TaskState.CANCELLED),
    # stopped while its job runs (its agent shut down): cancelled, the job then decides
    (JobState.RUNNING, TaskState.RUNNING, _report(TaskState.CANCELLED), True,
     CHANGE, TaskState.CANCELLED),
    # a move the lifecycle forbids is not made
    (JobState.RUNNING, TaskState.RUNNING, _report(TaskState.STARTING), False, None, None),
]


@pytest.mark.parametrize("job_state, task_state, report, stopped, move, state", MOVES)
def test_what_a_report_does_to_its_task(job_state, task_state, report, stopped, move, state):
    fx = on_report(_job(job_state), _task(task_state), report, lead=True,
                   stopped_is_success=stopped)
    assert fx.move == move
    if move is not None:
        assert fx.state == state and fx.failure == report.failure
        assert fx.exit_code == report.exit_code
        assert fx.message == ("stopped after the job succeeded"
                              if stopped and job_state == JobState.SUCCEEDED else report.message)


def test_progress_of_the_lead_is_the_jobs_and_only_a_change_wakes_watchers():
    job, task = _job(), _task(peak_memory_bytes=50 * MiB)
    r = _report(step=7, total_steps=10, loss=0.5, examples_per_sec=100.0, in_use_bytes=30 * MiB,
                peak_bytes=40 * MiB, first_step_time=12.0, test_accuracy=0.9, test_loss=0.2,
                test_metrics={"auc": 0.8})
    fx = on_report(job, task, r, lead=True, stopped_is_success=False)
    assert (fx.in_use_bytes, fx.peak_bytes) == (30 * MiB, 50 * MiB)  # peaks only rise
    assert fx.task == {}
    made = on_report(job, task, _report(weights_sha256="ab", model_path="m.keras"), lead=True,
                     stopped_is_success=False)
    assert made.task == {"weights_sha256": "ab", "model_path": "m.keras"}
    assert fx.metrics == {"step": 7, "total_steps": 10, "loss": 0.5, "examples_per_sec": 100.0,
                          "test_accuracy": 0.9, "test_loss": 0.2, "test_metrics": {"auc": 0.8}}
    assert fx.job == {"started_at": 12.0} and fx.progressed and not fx.write_job
    # a worker's progress is not the job's
    fx = on_report(job, task, r, lead=False, stopped_is_success=False)
    assert fx.metrics == {} and fx.job == {} and fx.progressed  # its memory still changed
    # the same figures again: nothing for watchers
    task.in_use_bytes = 30 * MiB
    job.metrics.step, job.metrics.test_accuracy = 7, 0.9
    assert not on_report(job, task, r, lead=True, stopped_is_success=False).progressed


@pytest.mark.parametrize("step_at_failure, resumed, step, repeated, said", [
    (120, 100, 101, 20, "resumed from the checkpoint at step 100; 20 step(s) trained again"),
    (120, 0, 1, 120, "no checkpoint to resume from; 120 step(s) trained again"),
    (0, 100, 101, None, None),      # no failure to account for
    (120, 0, 0, None, None),        # no progress yet: it has not resumed
])
def test_a_resumed_lead_counts_the_steps_trained_again_once(step_at_failure, resumed, step,
                                                            repeated, said):
    job = _job(JobState.RUNNING, steps_repeated=5)
    job.recovery.step_at_failure = step_at_failure
    fx = on_report(job, _task(), _report(resumed_step=resumed, step=step), lead=True,
                   stopped_is_success=False)
    if repeated is None:
        assert "steps_repeated" not in fx.job and fx.events == ()
        return
    assert fx.job["steps_repeated"] == 5 + repeated and fx.recovery == {"step_at_failure": 0}
    assert fx.events == (("message", said),) and fx.write_job
    # a restarting job's reports are its old attempt's
    job.state = JobState.RESTARTING
    assert "steps_repeated" not in on_report(job, _task(), _report(resumed_step=resumed,
                                                                   step=step),
                                             lead=True, stopped_is_success=False).job


def test_training_and_checkpoints_of_the_lead_are_stored_and_said_once():
    job = _job()
    fx = on_report(job, _task(), _report(training="SGD from code.model", checkpoint_step=50),
                   lead=True, stopped_is_success=False)
    assert fx.job == {"training": "SGD from code.model", "checkpoint_step": 50} and fx.write_job
    assert fx.events == (("message", "training with SGD from code.model"),)
    job.training, job.checkpoint_step = "SGD from code.model", 50
    fx = on_report(job, _task(), _report(training="SGD from code.model", checkpoint_step=50),
                   lead=True, stopped_is_success=False)
    assert fx.job == {} and not fx.write_job and fx.events == ()
    # changed again: stored, not said again
    fx = on_report(job, _task(), _report(training="Adam from the spec"), lead=True,
                   stopped_is_success=False)
    assert fx.job == {"training": "Adam from the spec"} and fx.events == ()


def test_notes_are_said_once_per_job_and_bounded():
    said = frozenset(f"n{i}" for i in range(MAX_NOTES_PER_JOB - 2))
    fx = on_report(_job(), _task(), _report(notes=["n0", "new", "new", "other", "more"]),
                   lead=False, stopped_is_success=False, notes_said=said)
    assert fx.notes == ("new", "other")


@pytest.mark.parametrize("reported, known, kept", [
    (30 * MiB, 0, 30 * MiB),
    (300 * MiB, 0, 100 * MiB),     # never more than the task's budget
    (30 * MiB, 40 * MiB, None),    # not larger than what is kept
    (0, 0, None),
])
def test_the_largest_allocation_is_kept_per_task_kind(reported, known, kept):
    fx = on_report(_job(), _task(), _report(largest_alloc_bytes=reported), lead=False,
                   stopped_is_success=False, kind="k", largest_known=known)
    assert fx.largest_alloc == (None if kept is None else ("k", kept))


def test_moves_are_named():
    assert {decisions.FAIL_OOM, decisions.FAIL, decisions.CHANGE} == {"fail_oom", "fail", "change"}


# --- a task's change ---------------------------------------------------------------------------

from strata import strategies  # noqa: E402
from strata.coordinator.decisions import (  # noqa: E402
    FAIL_JOB, NOTHING, RESTART, RUN, SUCCEED, SUCCEED_AND_STOP, WAKE, on_task_change,
)
from strata.spec import parse_job_spec  # noqa: E402


def _spec_job(strategy: str, state: JobState, tasks: list[tuple[str, TaskState]],
              max_restarts: int = 2) -> Job:
    raw = {"name": "j", "strategy": strategy, "workers": 1 if strategy == "pipeline" else 2,
           "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [16],
                                 "classes": 10}},
           "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 10},
           "restart": {"max_restarts": max_restarts}}
    if strategy == "parameter_server":
        raw["parameter_servers"] = 1
    job = Job(id="j", name="j", state=state, strategy=strategy, spec=parse_job_spec(raw),
              created_at=0.0)
    counts: dict[str, int] = {}
    for role, s in tasks:
        job.tasks.append(Task(job_id="j", role=role, index=counts.get(role, 0), state=s))
        counts[role] = counts.get(role, 0) + 1
    return job


R, S, C, F, ST = (TaskState.RUNNING, TaskState.SUCCEEDED, TaskState.CANCELLED, TaskState.FAILED,
                  TaskState.STARTING)
#: (strategy, job state, its tasks, the task that changed, max_restarts) -> (action, cancelled)
CHANGES = [
    # a job over or restarting: only a task's end matters, for the room it frees
    ("multi_worker_mirrored", JobState.SUCCEEDED, [("worker", S), ("worker", S)], 1, 2, WAKE, False),
    ("multi_worker_mirrored", JobState.RESTARTING, [("worker", R), ("worker", C)], 1, 2, WAKE, False),
    ("multi_worker_mirrored", JobState.RESTARTING, [("worker", R), ("worker", R)], 1, 2, NOTHING, False),
    # data parallel succeeds when every task has
    ("multi_worker_mirrored", JobState.RUNNING, [("worker", S), ("worker", R)], 0, 2, NOTHING, False),
    ("multi_worker_mirrored", JobState.RUNNING, [("worker", S), ("worker", S)], 1, 2, SUCCEED, False),
    # the chief drives a pipeline: its success ends the job and stops the stages
    ("pipeline", JobState.RUNNING, [("chief", S), ("worker", R)], 0, 2, SUCCEED_AND_STOP, False),
    ("pipeline", JobState.RUNNING, [("chief", R), ("worker", S)], 1, 2, NOTHING, False),
    # stopped while its job runs (its agent shut down): a failure, restarts left or not
    ("pipeline", JobState.RUNNING, [("chief", R), ("worker", C)], 1, 2, RESTART, True),
    ("pipeline", JobState.RUNNING, [("chief", R), ("worker", C)], 1, 0, FAIL_JOB, True),
    # a parameter-server worker's loss is carried: another worker remains
    ("parameter_server", JobState.RUNNING,
     [("chief", R), ("worker", C), ("worker", R), ("ps", R)], 1, 2, NOTHING, True),
    # every task up: the job runs
    ("multi_worker_mirrored", JobState.SCHEDULED, [("worker", R), ("worker", R)], 1, 2, RUN, False),
    ("multi_worker_mirrored", JobState.SCHEDULED, [("worker", R), ("worker", ST)], 0, 2, NOTHING, False),
]


@pytest.mark.parametrize("strategy, job_state, tasks, changed, restarts, action, cancelled",
                         CHANGES)
def test_what_a_tasks_change_does_to_its_job(strategy, job_state, tasks, changed, restarts,
                                             action, cancelled):
    job = _spec_job(strategy, job_state, tasks, restarts)
    task = job.tasks[changed]
    step = on_task_change(job, task, strategies.get(strategy))
    assert (step.action, step.cancelled) == (action, cancelled), step.message
    assert task.failure == FailureKind.NONE  # the decision changes nothing itself
    if action in (RESTART, FAIL_JOB):
        assert f"task {task.role}:{task.index} failed" in step.message


# --- a tick -------------------------------------------------------------------------------------

from strata.coordinator.decisions import AFTER_PROBE, PLACE, RESUME, on_tick  # noqa: E402


def _tick_job(state: JobState, tasks: list[TaskState], **recovery) -> Job:
    job = _job(state, message="waiting for 2 workers")
    job.tasks = [Task(job_id="j", role="worker", index=i, state=s) for i, s in enumerate(tasks)]
    for name, value in recovery.items():
        setattr(job.recovery, name, value)
    return job


#: (job, now, probing, scheduled since) -> (action, words of the message)
TICKS = [
    (_tick_job(JobState.PENDING, [TaskState.PENDING]), 10.0, False, 0.0, PLACE, ""),
    (_tick_job(JobState.PENDING, [TaskState.PENDING]), 10.0, True, 0.0, AFTER_PROBE, ""),
    (_tick_job(JobState.PENDING, [TaskState.PENDING], capacity_deadline=20.0), 10.0, False, 0.0,
     PLACE, ""),
    (_tick_job(JobState.PENDING, [TaskState.PENDING], capacity_deadline=20.0), 21.0, False, 0.0,
     FAIL_JOB, "not placed by its --queue-for-capacity deadline: waiting for 2 workers"),
    # a restart waits for its processes to stop and its backoff, then is planned again
    (_tick_job(JobState.RESTARTING, [TaskState.RUNNING], restart_at=5.0), 10.0, False, 0.0,
     NOTHING, ""),
    (_tick_job(JobState.RESTARTING, [TaskState.CANCELLED], restart_at=15.0), 10.0, False, 0.0,
     NOTHING, ""),
    (_tick_job(JobState.RESTARTING, [TaskState.CANCELLED], restart_at=5.0), 10.0, False, 0.0,
     RESUME, ""),
    (_tick_job(JobState.RESTARTING, [TaskState.PENDING], replanned=True), 10.0, False, 0.0,
     PLACE, ""),
    # placed tasks that never all run give their room back
    (_tick_job(JobState.SCHEDULED, [TaskState.RUNNING, TaskState.STARTING]), 200.0, False, 0.0,
     NOTHING, ""),
    (_tick_job(JobState.SCHEDULED, [TaskState.RUNNING, TaskState.STARTING]), 301.0, False, 0.0,
     FAIL_JOB, "tasks did not start within 300 s: worker:1 (STARTING)"),
    (_tick_job(JobState.RUNNING, [TaskState.RUNNING]), 1e6, False, 0.0, NOTHING, ""),
]


@pytest.mark.parametrize("job, now, probing, since, action, message", TICKS)
def test_what_a_tick_does_with_a_live_job(job, now, probing, since, action, message):
    step = on_tick(job, now, probing=probing, scheduled_since=since, start_timeout_s=300.0)
    assert step.action == action and step.message == message


def test_an_agents_loss_takes_its_unfinished_tasks():
    from strata.coordinator.decisions import lost_with

    a, b = _job(), _job()
    a.tasks = [Task(job_id="a", role="worker", index=0, state=TaskState.RUNNING, worker="w0"),
               Task(job_id="a", role="worker", index=1, state=TaskState.RUNNING, worker="w1")]
    b.tasks = [Task(job_id="b", role="worker", index=0, state=TaskState.SUCCEEDED, worker="w0"),
               Task(job_id="b", role="worker", index=1, state=TaskState.STARTING, worker="w0")]
    assert [(j, t.index) for j, t in lost_with([a, b], "w0")] == [(a, 0), (b, 1)]
    assert lost_with([a, b], "w9") == []


def test_a_tick_decides_nothing_for_the_states_it_skips():
    from strata.coordinator.decisions import TICK_STATES

    for state in JobState:
        if state not in TICK_STATES:
            job = _tick_job(state, [TaskState.RUNNING], capacity_deadline=1.0)
            assert on_tick(job, 1e9, probing=True, scheduled_since=0.0).action == NOTHING


# --- a task's failure, a restart, a stop ---------------------------------------------------------

from strata.coordinator.decisions import (  # noqa: E402
    CONTINUE, MEMORY_RETRY, failure_step, may_retry_memory, on_failure, restart, stopping,
)
from strata.strategies import FailureAction  # noqa: E402

_POLICY_RESTART = failure_step(FailureAction.RESTART, "task worker:1 failed")
_POLICY_FAIL = failure_step(FailureAction.FAIL_JOB, "task worker:1 failed, no restarts left")
_POLICY_CONTINUE = failure_step(FailureAction.CONTINUE, "carries on without worker:1")

#: (job state, the policy's step, an allowed memory retry) -> action
FAILURES = [
    (JobState.RUNNING, _POLICY_RESTART, False, RESTART),
    (JobState.SCHEDULED, _POLICY_FAIL, False, FAIL_JOB),
    (JobState.RUNNING, _POLICY_CONTINUE, False, CONTINUE),
    # out of memory on a budget Strata guessed: one retry, whatever the policy, unless it carries on
    (JobState.RUNNING, _POLICY_FAIL, True, MEMORY_RETRY),
    (JobState.RUNNING, _POLICY_RESTART, True, MEMORY_RETRY),
    (JobState.RUNNING, _POLICY_CONTINUE, True, CONTINUE),
    # a casualty of its job's stop or restart decides nothing
    (JobState.RESTARTING, _POLICY_RESTART, True, NOTHING),
    (JobState.FAILED, _POLICY_FAIL, False, NOTHING),
    (JobState.CANCELLED, _POLICY_RESTART, False, NOTHING),
]


@pytest.mark.parametrize("job_state, policy, retry, action", FAILURES)
def test_what_a_tasks_failure_does_to_its_job(job_state, policy, retry, action):
    step = on_failure(_job(job_state), policy, memory_retry=retry)
    assert step.action == action
    if action != NOTHING:
        assert step.message == policy.message


def test_failure_actions_are_named():
    assert failure_step(FailureAction.RESTART, "m").action == RESTART
    assert failure_step(FailureAction.FAIL_JOB, "m").action == FAIL_JOB
    assert failure_step(FailureAction.CONTINUE, "m").action == CONTINUE


@pytest.mark.parametrize("fixed, retried, probe, budget, device, allowed", [
    (0, False, "", 100, 1000, True),
    (0, False, "", 100, 0, True),          # the device's size not known: its budget was a guess
    (100, False, "", 100, 1000, False),    # memory.per_task_budget: the user's figure
    (0, True, "", 100, 1000, False),       # retried once already
    (0, False, "j0", 100, 1000, False),    # a probe grows instead
    (0, False, "", 1000, 1000, False),     # it had the whole device: no plan gives it more
])
def test_an_out_of_memory_failure_is_retried_once_on_a_guessed_budget(
        fixed, retried, probe, budget, device, allowed):
    job = _spec_job("multi_worker_mirrored", JobState.RUNNING, [("worker", R)])
    job.spec = dataclasses.replace(job.spec, memory=dataclasses.replace(job.spec.memory,
                                                                        per_task_budget=fixed))
    job.recovery.memory_retried, job.recovery.probe_of = retried, probe
    task = dataclasses.replace(job.tasks[0], memory_budget_bytes=budget)
    assert may_retry_memory(job, task, device) is allowed


@pytest.mark.parametrize("failure, checkpoint, oom", [(True, 0, False), (False, 40, True)])
def test_a_restart_is_recorded_and_said(failure, checkpoint, oom):
    job = _spec_job("multi_worker_mirrored", JobState.RUNNING, [("worker", R), ("worker", F)],
                    max_restarts=3)
    job.restarts, job.recovery.failures, job.checkpoint_step = 1, 1, checkpoint
    job.metrics.step, job.recovery.step_at_failure = 42, 30
    culprit = dataclasses.replace(job.tasks[1], memory_budget_bytes=64 * MiB) if oom else None
    r = restart(job, "task worker:1 failed", 100.0, failure=failure, oom=culprit)
    assert r.restarts == 2
    assert r.recovery["failures"] == (2 if failure else 1)
    assert r.recovery["restart_at"] == 100.0 + job.spec.restart_backoff_s
    assert r.recovery["step_at_failure"] == 42 and r.recovery["replanned"] is False
    assert r.recovery["requested_workers"] == 2
    assert r.recovery["last_cause"] == "task worker:1 failed"
    assert ("2 of 3" in r.message) is failure
    assert ("not counted against restart.max_restarts" in r.message) is (not failure)
    assert r.event.endswith("the checkpoint at step 40" if checkpoint
                            else "the start (no checkpoint yet)")
    assert r.oom_budget == (("worker", 1, 64 * MiB) if oom else None)
    assert job.restarts == 1 and job.recovery.failures == 1  # the decision changes nothing


def test_a_stop_cancels_what_never_started_fails_what_was_lost_and_tells_the_rest():
    job = _job()
    job.tasks = [Task(job_id="j", role="worker", index=i, state=s, worker=w)
                 for i, (s, w) in enumerate([
                     (TaskState.SUCCEEDED, "a"),   # over: untouched
                     (TaskState.RUNNING, "a"),     # told
                     (TaskState.PENDING, "b"),     # its start may be in flight: told, cancelled
                     (TaskState.RUNNING, "lost"),  # failed with its agent
                     (TaskState.RUNNING, "gone"),  # an agent unknown: cancelled
                     (TaskState.PENDING, ""),      # never placed: cancelled
                     (TaskState.RUNNING, "a")])]   # one message per agent
    agents = {"a": False, "b": False, "lost": True}
    stop = stopping(job, agents.get)
    assert [t.index for t in stop.cancel] == [2, 4, 5]
    assert [t.index for t in stop.lost] == [3]
    assert stop.tell == ("a", "b")
    assert [t.state for t in job.tasks][1] == TaskState.RUNNING  # the decision changes nothing


# --- a notice --------------------------------------------------------------------------------

from strata.coordinator.decisions import NOTICE_LEAD_S, notice, notice_saved  # noqa: E402


def _running(step: int, every: int = 100) -> Job:
    job = _spec_job("multi_worker_mirrored", JobState.RUNNING, [("worker", R), ("worker", R)])
    job.spec = dataclasses.replace(job.spec, checkpoint_every_steps=every)
    job.metrics.step = step
    return job


#: (reported step, checkpoint.every_steps, storage, steps/s, deadline) -> (save step, words)
NOTICES = [
    # the step all tasks are told before they reach it: the reported one plus the lead time
    (40, 100, True, 10.0, 30.0, 40 + int(10 * NOTICE_LEAD_S) + 1, ""),
    (40, 100, True, 0.5, 30.0, 42, ""),
    # slow steps: reaching the save takes more than half the deadline
    (40, 100, True, 0.05, 30.0, 0, "no time to reach a step"),
    (40, 100, True, 10.0, 1.0, 0, "no time to reach a step"),
    # a job without periodic checkpoints saves on notice too; not without a shared directory
    (40, 0, True, 10.0, 30.0, 40 + int(10 * NOTICE_LEAD_S) + 1, ""),
    (40, 100, False, 10.0, 30.0, 0, "no shared directory"),
    (0, 100, True, 10.0, 30.0, 0, "not reported a step yet"),
    (40, 100, True, 0.0, 30.0, 0, "not reported a step yet"),
]


@pytest.mark.parametrize("step, every, storage, rate, deadline, at, words", NOTICES)
def test_where_a_job_saves_on_notice(step, every, storage, rate, deadline, at, words):
    plan = notice(_running(step, every), deadline, rate, storage=storage)
    assert plan.step == at
    assert words in plan.reason and bool(plan.reason) == (at == 0)


def test_a_notice_is_saved_once_the_lead_reports_its_step_and_a_restart_ends_it():
    job = _running(45)
    assert not notice_saved(job)  # no notice
    job.recovery.notice_step = 61
    job.checkpoint_step = 60
    assert not notice_saved(job)
    job.checkpoint_step = 61
    assert notice_saved(job)
    job.state = JobState.RESTARTING
    assert not notice_saved(job)  # restarting already
    r = restart(job, "saved on notice", 10.0, failure=False)
    assert r.recovery["notice_step"] == 0 and r.recovery["notice_deadline"] == 0.0


def test_a_task_stopped_on_notice_waits_for_the_save_not_a_restart():
    job = _spec_job("multi_worker_mirrored", JobState.RUNNING, [("worker", R), ("worker", C)])
    assert on_task_change(job, job.tasks[1], strategies.get(job.strategy)).action == RESTART
    job.recovery.notice_step = 61
    assert on_task_change(job, job.tasks[1], strategies.get(job.strategy)).action == NOTHING


def test_a_restart_from_a_notice_checkpoint_does_not_back_off_and_a_failure_does():
    job = _running(45)
    job.spec = dataclasses.replace(job.spec, restart_backoff_s=5.0)
    assert restart(job, "boom", 10.0, failure=True).recovery["restart_at"] == 15.0
    assert restart(job, "drained", 10.0, failure=False).recovery["restart_at"] == 15.0
    job.recovery.notice_step = 61
    assert restart(job, "saved on notice", 10.0, failure=False).recovery["restart_at"] == 10.0
    assert restart(job, "lost", 10.0, failure=True).recovery["restart_at"] == 15.0


from strata.coordinator.decisions import may_grow  # noqa: E402


def _elastic(**change) -> Job:
    job = _running(45)
    job.spec = dataclasses.replace(job.spec, workers=2, workers_min=2, workers_max=4)
    job.started_at = 100.0
    for name, value in change.items():
        target = job.recovery if hasattr(job.recovery, name) else job
        setattr(target, name, value)
    return job


#: (job fields, now) -> whether it may grow
GROWS = [
    ({}, 110.0, True),
    ({}, 105.0, False),                                # settling after its first step
    ({"resized_at": 108.0}, 115.0, False),             # settling after its last resize
    ({"resized_at": 108.0}, 118.0, True),
    ({"notice_step": 60}, 200.0, False),               # a notice in flight
    ({"resize_began": 150.0}, 200.0, False),           # a resize in flight
    ({"state": JobState.RESTARTING}, 200.0, False),
    ({"started_at": 0.0}, 200.0, False),               # no step yet
    ({"probe_of": "p"}, 200.0, False),                 # a memory probe keeps its width
]


@pytest.mark.parametrize("change, now, grows", GROWS)
def test_when_an_elastic_job_may_grow(change, now, grows):
    assert may_grow(_elastic(**change), now, 10.0) == grows


def test_a_fixed_job_or_one_at_its_max_never_grows():
    job = _running(45)
    job.started_at = 100.0
    assert not may_grow(job, 500.0, 10.0)
    wide = _elastic()
    wide.spec = dataclasses.replace(wide.spec, workers=4)
    assert not may_grow(wide, 500.0, 10.0)
