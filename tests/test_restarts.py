"""Restart policy, RESTARTING, re-planning, drains, request ids and reconciling stale attempts:
the coordinator driven tick by tick with a manual clock (no processes)."""

import pytest

from strata.coordinator.core import Coordinator, StartTaskCommand, StopTaskCommand
from strata.errors import InfeasibleError
from strata.types import FailureKind, JobState, TaskReport, TaskState

from conftest import queued as commands

GiB = 1 << 30
SPEC = {"name": "ft", "workers": 2,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64], "classes": 10}},
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 100},
        "checkpoint": {"every_steps": 10, "keep": 2},
        "restart": {"max_restarts": 2, "backoff_s": 3}}


def register(coord, name, shared="/shared", reports=(), pid=0):
    return coord.register(name, "127.0.0.1", "CPU", GiB,
                          [5000 + len(coord.workers) * 10 + i for i in range(4)], list(reports),
                          shared_dir=shared, pid=pid or 100 + len(coord.workers))


def report(coord, sessions, t, state, **kw):
    coord.report(t.worker, sessions[t.worker], TaskReport(t.job_id, t.role, t.index, state,
                                                          attempt=t.attempt, **kw))


def running_job(env, spec=SPEC, workers=("a", "b")):
    coord, clock, store, _ = env
    for w in workers:
        register(coord, w)
    sessions = {w: live.session for w, live in coord.workers.items()}
    job = coord.submit(spec)
    coord.tick()
    assert job.state == JobState.SCHEDULED
    for t in job.tasks:
        report(coord, sessions, t, TaskState.RUNNING)
    assert job.state == JobState.RUNNING
    return job, sessions


def test_checkpointed_job_is_refused_without_a_shared_dir(env):
    coord, *_ = env
    register(coord, "a", shared="")
    with pytest.raises(InfeasibleError, match="--shared-dir"):
        coord.submit(SPEC)
    # no checkpoints: runs anywhere (one worker: the cluster has had no more)
    coord.submit({**SPEC, "workers": 1, "checkpoint": {"every_steps": 0}})


def test_checkpointed_job_is_placed_only_where_the_shared_dir_is(env):
    coord, *_ = env
    register(coord, "plain", shared="")
    register(coord, "s1")
    job = coord.submit({**SPEC, "workers": 1})
    coord.tick()
    assert job.state == JobState.SCHEDULED and job.tasks[0].worker == "s1"


def test_a_dead_task_restarts_the_job_after_the_backoff_and_resumes(env):
    coord, clock, store, _ = env
    job, sessions = running_job(env)
    t0, t1 = job.tasks
    report(coord, sessions, t0, TaskState.RUNNING, step=25, total_steps=100,
           checkpoint_step=20)
    assert job.checkpoint_step == 20 and job.metrics.step == 25
    commands(coord, "a"), commands(coord, "b")
    report(coord, sessions, t1, TaskState.FAILED, failure=FailureKind.SIGNAL, exit_code=-9,
           message="killed by SIGKILL")
    assert job.state == JobState.RESTARTING and job.restarts == 1
    assert "restart 1 (1 of 2)" in job.message and "SIGKILL" in job.message
    # the survivor is stopped
    stops = commands(coord, "a")
    assert any(isinstance(c, StopTaskCommand) and c.job_id == job.id for c in stops)
    events = [e.message for e in store.events(job.id)]
    assert any("restart 1:" in m and "checkpoint at step 20" in m for m in events)
    # the survivor fails too as a casualty: no second restart
    report(coord, sessions, t0, TaskState.FAILED, failure=FailureKind.COLLECTIVE_TIMEOUT)
    assert job.restarts == 1 and job.state == JobState.RESTARTING
    coord.tick()
    assert job.state == JobState.RESTARTING  # backoff not over
    clock.now += 3.1
    coord.tick()
    assert job.state == JobState.SCHEDULED
    starts = commands(coord, "a") + commands(coord, "b")
    assert len(starts) == 2 and all(isinstance(c, StartTaskCommand) for c in starts)
    assert all(c.config.restart == 1 and c.attempt == 2 for c in starts)
    # a late report of the first attempt changes nothing
    new0 = job.tasks[0]
    coord.report(new0.worker, sessions[new0.worker], TaskReport(
        job.id, new0.role, new0.index, TaskState.FAILED, attempt=1, failure=FailureKind.SIGNAL))
    assert job.state == JobState.SCHEDULED
    for t in job.tasks:
        report(coord, sessions, t, TaskState.RUNNING)
    lead = next(t for t in job.tasks if t.index == 0)
    report(coord, sessions, lead, TaskState.RUNNING, step=21, total_steps=100, resumed_step=20)
    assert job.steps_repeated == 5
    for t in job.tasks:
        report(coord, sessions, t, TaskState.SUCCEEDED, step=100, total_steps=100,
               test_accuracy=0.9)
    assert job.state == JobState.SUCCEEDED and job.restarts == 1
    # stored: a restarted coordinator knows the restart history
    again = {j.id: j for j in store.load_jobs()}[job.id]
    assert (again.restarts, again.steps_repeated, again.recovery.failures) == (1, 5, 1)


def test_restarts_run_out_and_the_job_fails_with_its_last_cause(env):
    coord, clock, _, _ = env
    job, sessions = running_job(env, {**SPEC, "restart": {"max_restarts": 1, "backoff_s": 0}})
    report(coord, sessions, job.tasks[0], TaskState.FAILED, failure=FailureKind.EXIT_CODE,
           exit_code=1, message="boom")
    report(coord, sessions, job.tasks[1], TaskState.CANCELLED)
    coord.tick()
    for t in job.tasks:
        report(coord, sessions, t, TaskState.RUNNING)
    report(coord, sessions, job.tasks[1], TaskState.FAILED, failure=FailureKind.EXIT_CODE,
           exit_code=3, message="again")
    assert job.state == JobState.FAILED
    assert "again" in job.message and "no restarts left (1 of restart.max_restarts 1" in job.message


@pytest.mark.parametrize("failure,retry,restarts", [
    (FailureKind.USER_CODE, False, False), (FailureKind.USER_CODE, True, True),
    (FailureKind.BAD_CONFIG, True, False), (FailureKind.LOST, False, True),
    (FailureKind.COLLECTIVE_TIMEOUT, False, True)])
def test_failure_kinds_follow_the_policy(env, failure, retry, restarts):
    coord, *_ = env
    spec = {**SPEC, "restart": {"max_restarts": 2, "retry_user_errors": retry}}
    job, sessions = running_job(env, spec)
    report(coord, sessions, job.tasks[0], TaskState.FAILED, failure=failure, message="x")
    assert job.state == (JobState.RESTARTING if restarts else JobState.FAILED)
    if failure == FailureKind.USER_CODE and not retry:
        assert "restart.retry_user_errors" in job.message


def test_out_of_memory_restarts_only_on_a_larger_plan(env):
    coord, clock, _, _ = env
    job, sessions = running_job(env, {**SPEC, "restart": {"max_restarts": 2, "backoff_s": 0}})
    t0 = job.tasks[0]
    budget = t0.memory_budget_bytes
    report(coord, sessions, t0, TaskState.FAILED, failure=FailureKind.OOM,
           peak_bytes=budget - 1, message="out of memory")
    assert job.state == JobState.RESTARTING
    for t in job.tasks[1:]:
        report(coord, sessions, t, TaskState.CANCELLED)
    coord.tick()
    assert job.state == JobState.SCHEDULED
    assert all(t.memory_budget_bytes > budget for t in job.tasks)  # the measured need
    # with a fixed budget a new plan is the same plan: not retried
    fixed = {**SPEC, "name": "fixed", "memory": {"per_task_budget": "64MiB"},
             "restart": {"max_restarts": 2, "backoff_s": 0}}
    job2, sessions2 = running_job(env, fixed, workers=("c", "d"))
    report(coord, sessions2, job2.tasks[0], TaskState.FAILED, failure=FailureKind.OOM,
           peak_bytes=60 << 20)
    report(coord, sessions2, job2.tasks[1], TaskState.CANCELLED)
    coord.tick()
    assert job2.state == JobState.FAILED and "same" in job2.message


def test_a_lost_agent_restarts_its_job_on_the_spare_narrower_when_it_must(env):
    coord, clock, _, _ = env
    job, sessions = running_job(env, {**SPEC, "workers": 2, "restart": {"max_restarts": 3,
                                                                        "backoff_s": 0}},
                                workers=("a", "b", "spare"))
    victim = job.tasks[1].worker
    for name in sessions:
        if name != victim:
            coord.heartbeat(name, sessions[name], coord.workers[name].memory, [], [6000 + ord(name[0])])
    clock.now += 11
    for name in sessions:
        if name != victim:
            coord.heartbeat(name, sessions[name], coord.workers[name].memory, [], [6100 + ord(name[0])])
    coord.tick()  # the victim is LOST: the job restarts, the survivor is stopped
    assert job.state == JobState.RESTARTING
    survivor = next(t for t in job.tasks if t.worker != victim)
    report(coord, sessions, survivor, TaskState.CANCELLED)
    coord.tick()
    assert job.state == JobState.SCHEDULED and len(job.tasks) == 2
    assert victim not in {t.worker for t in job.tasks}
    # now only one worker is left besides: the next restart runs 1 wide, batch kept
    for t in job.tasks:
        report(coord, sessions, t, TaskState.RUNNING)
    spare_task = next(t for t in job.tasks if t.worker == "spare")
    other = next(t for t in job.tasks if t.worker != "spare")
    coord._mark_lost(coord.workers["spare"])
    assert spare_task.failure == FailureKind.LOST and job.state == JobState.RESTARTING
    report(coord, sessions, other, TaskState.CANCELLED)
    coord.heartbeat(other.worker, sessions[other.worker], coord.workers[other.worker].memory,
                    [], [6200, 6201])
    coord.tick()
    assert job.state == JobState.SCHEDULED and len(job.tasks) == 1
    assert job.spec.workers == 1 and job.spec.data.batch_size == 64
    assert job.recovery.requested_workers == 2


def test_a_retried_submit_returns_the_job_already_created(env):
    coord, clock, store, tmp_path = env
    register(coord, "a")
    first = coord.submit({**SPEC, "workers": 1}, request_id="req-1")
    again = coord.submit({**SPEC, "workers": 1}, request_id="req-1")
    assert again.id == first.id and len(coord.jobs) == 1
    # and after a coordinator restart
    coord2 = Coordinator(store, str(tmp_path), heartbeat_timeout_s=10, clock=clock,
                          monotonic=clock)
    assert coord2.submit({**SPEC, "workers": 1}, request_id="req-1").id == first.id
    assert coord2.submit({**SPEC, "workers": 1}, request_id="req-2").id != first.id


def test_drain_moves_jobs_and_places_nothing_more(env):
    coord, clock, _, _ = env
    job, sessions = running_job(env, {**SPEC, "workers": 1, "restart": {"max_restarts": 0,
                                                                        "backoff_s": 0}},
                                workers=("a", "b"))
    where = job.tasks[0].worker
    info = coord.drain(where)
    assert info.state.value == "DRAINING"
    assert job.state == JobState.RESTARTING and job.recovery.failures == 0
    report(coord, sessions, job.tasks[0], TaskState.CANCELLED)
    coord.tick()
    assert job.state == JobState.SCHEDULED and job.tasks[0].worker != where
    # a new agent process under the name is no longer draining; the same one still is
    register(coord, where, pid=coord.workers[where].pid)
    assert coord.workers[where].record.draining
    clock.now += 11  # the first process is gone (silent past the timeout)
    register(coord, where, pid=99999)
    assert not coord.workers[where].record.draining


def test_a_returning_agent_has_its_stale_attempt_stopped(env):
    coord, clock, _, _ = env
    job, sessions = running_job(env, {**SPEC, "workers": 1, "restart": {"max_restarts": 1,
                                                                        "backoff_s": 0}},
                                workers=("a", "b"))
    old = job.tasks[0]
    where, attempt = old.worker, old.attempt
    other = "b" if where == "a" else "a"
    clock.now += 11
    coord.heartbeat(other, sessions[other], coord.workers[other].memory, [], [7000])
    coord.tick()  # lost: restarts on the other agent
    coord.tick()
    assert job.state == JobState.SCHEDULED and job.tasks[0].worker == other
    commands(coord, other)
    # the partitioned agent comes back, still running the first attempt
    register(coord, where, reports=[TaskReport(job.id, old.role, old.index, TaskState.RUNNING,
                                               attempt=attempt)], pid=coord.workers[where].pid)
    stops = [c for c in commands(coord, where) if isinstance(c, StopTaskCommand)]
    assert stops and stops[0].job_id == job.id
    assert job.state == JobState.SCHEDULED and job.tasks[0].worker == other


def _notice_job(env):
    coord, clock, _, _ = env
    job, sessions = running_job(env, {**SPEC, "checkpoint": {"every_steps": 1000}},
                                workers=("a", "b", "c"))
    lead = next(t for t in job.tasks if t.index == 0)
    report(coord, sessions, lead, TaskState.RUNNING, step=40, total_steps=100, loss=1.0,
           examples_per_sec=640.0)  # 10 steps/s at a global batch of 64
    for name in coord.workers:
        commands(coord, name)
    return coord, clock, job, sessions, lead


def test_a_notice_saves_at_a_step_every_task_reaches_then_restarts_from_it(env):
    from strata.coordinator.agents import NoticeCommand

    coord, clock, job, sessions, lead = _notice_job(env)
    leaving = job.tasks[1].worker
    coord.drain(leaving, deadline_s=30)
    assert job.state == JobState.RUNNING  # not yet: its tasks save first
    step = job.recovery.notice_step
    assert step == 40 + 20 + 1
    told = {w: [c for c in commands(coord, w) if isinstance(c, NoticeCommand)]
            for w in ("a", "b", "c")}
    assert {w for w, cs in told.items() if cs} == {t.worker for t in job.tasks}
    assert all(c.step == step for cs in told.values() for c in cs)
    assert any(e.kind == "notice" and f"after step {step}" in e.message
               for e in coord.store.events(job.id))
    # a worker that saved and stopped before the lead's report: the job waits for the save
    other = job.tasks[1]
    report(coord, sessions, other, TaskState.CANCELLED, exit_code=79)
    assert job.state == JobState.RUNNING and job.recovery.failures == 0
    # the lead's checkpoint and its stop, in one report: the job restarts from it, uncounted
    report(coord, sessions, lead, TaskState.CANCELLED, step=step, checkpoint_step=step)
    assert job.state == JobState.RESTARTING and job.recovery.failures == 0
    assert job.recovery.notice_step == 0 and job.checkpoint_step == step
    assert any("saved on notice" in e.message and f"step {step}" in e.message
               for e in coord.store.events(job.id))
    clock.now += 4  # its backoff
    coord.tick()
    coord.tick()
    assert job.state == JobState.SCHEDULED and leaving not in {t.worker for t in job.tasks}


def test_a_notice_whose_deadline_passes_restarts_from_the_last_checkpoint_and_says_so(env):
    coord, clock, job, sessions, lead = _notice_job(env)
    coord.drain(job.tasks[1].worker, deadline_s=8)  # (agents are lost after 10 s unheard)
    assert job.recovery.notice_step
    clock.now += 7
    coord.tick()
    assert job.state == JobState.RUNNING
    clock.now += 2
    coord.tick()
    assert job.state == JobState.RESTARTING and job.recovery.failures == 0
    assert any("deadline passed" in e.message for e in coord.store.events(job.id))
    assert any("resumes from the start (no checkpoint yet)" in e.message
               for e in coord.store.events(job.id))


@pytest.mark.parametrize("deadline, words", [(0.5, "no time to reach a step"),
                                             (float("nan"), None), (-1.0, None), (1e9, None)])
def test_a_notice_too_short_restarts_at_once_and_a_bad_deadline_is_refused(env, deadline, words):
    from strata.errors import SpecError

    coord, clock, job, sessions, lead = _notice_job(env)
    if words is None:
        with pytest.raises(SpecError, match="deadline") as e:
            coord.drain(job.tasks[1].worker, deadline_s=deadline)
        assert e.value.field == "deadline_s" and job.state == JobState.RUNNING
        return
    coord.drain(job.tasks[1].worker, deadline_s=deadline)
    assert job.state == JobState.RESTARTING and job.recovery.notice_step == 0
    assert any(words in e.message for e in coord.store.events(job.id))
