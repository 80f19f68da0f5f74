"""Elastic jobs (``workers: {min, max}``): the spec's range, planning at the widest width that
places, growth when room frees, shrinking on a notice, each resize an event with its cost;
the coordinator driven tick by tick with a manual clock (no processes). The end-to-end run
with real task processes and counted examples is in ``test_elastic_run.py``."""

import pytest

from strata.coordinator.agents import NoticeCommand
from strata.coordinator.elastic import RESIZE_SETTLE_S
from strata.errors import InfeasibleError, SpecError
from strata.jobspec import JobSpec
from strata.spec import parse_job_spec
from strata.types import JobState, TaskState, job_to_json

from conftest import queued as commands
from test_restarts import register, report

MODEL = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64], "classes": 10}}
SPEC = {"name": "el", "workers": {"min": 2, "max": 4}, "model": MODEL,
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 1000},
        "restart": {"backoff_s": 3}}


# --- the spec -------------------------------------------------------------------------------

def test_a_range_plans_at_its_widest_width_that_shares_the_global_batch():
    spec = parse_job_spec({**SPEC, "workers": {"min": 2, "max": 5}, "data": {"batch_size": 48}})
    assert (spec.workers, spec.workers_min, spec.workers_max, spec.elastic) == (4, 2, 5, True)
    # the normalized form (and the message) carry the range beside the width of now
    assert spec.to_dict()["elastic"] == {"min": 2, "max": 5}
    assert parse_job_spec(spec.to_dict()) == spec == JobSpec.from_dict(spec.to_dict())
    fixed = parse_job_spec({**SPEC, "workers": 2})
    assert not fixed.elastic and "elastic" not in fixed.to_dict()


@pytest.mark.parametrize("change, field, words", [
    ({"workers": {"min": 3, "max": 2}}, "workers.max", "must be >= min"),
    ({"workers": {"min": 0, "max": 2}}, "workers.min", ">= 1"),
    ({"workers": {"max": 2}}, "workers", "needs both min and max"),
    ({"workers": {"min": 1, "max": 2, "step": 1}}, "workers.step", "unknown field"),
    ({"workers": {"min": 3, "max": 4}}, "data.batch_size", "among 3 workers"),
    ({"workers": {"min": 1, "max": 2}, "strategy": "pipeline", "stages": 2}, "workers",
     "fixed width"),
    ({"workers": {"min": 1, "max": 2}, "strategy": "hybrid"}, "stages", "names its stages"),
    ({"workers": 5, "elastic": {"min": 1, "max": 4}}, "workers", "outside the elastic range"),
    ({"elastic": {"min": 1, "max": 4}, "workers": {"min": 1, "max": 4}}, "elastic", "once"),
])
def test_a_bad_range_is_refused_naming_the_field(change, field, words):
    with pytest.raises(SpecError) as e:
        parse_job_spec({**SPEC, **change})
    assert e.value.field == field and words in str(e.value)


# --- the coordinator ------------------------------------------------------------------------

def _run(coord, sessions, job):
    coord.tick()
    assert job.state == JobState.SCHEDULED, job.message
    for t in job.tasks:
        report(coord, sessions, t, TaskState.RUNNING)
    assert job.state == JobState.RUNNING


def _later(coord, clock, seconds):
    """``seconds`` pass, the agents heard from meanwhile."""
    clock.now += seconds
    for name, live in coord.workers.items():
        if not live.lost:
            coord.heartbeat(name, live.session, live.memory, [], sorted(live.free_ports))


def _sessions(coord):
    return {w: live.session for w, live in coord.workers.items()}


def _steps(coord, sessions, job, step, clock):
    lead = next(t for t in job.tasks if t.index == 0)
    report(coord, sessions, lead, TaskState.RUNNING, step=step, total_steps=1000, loss=1.0,
           examples_per_sec=640.0, first_step_time=clock.now)  # 10 steps/s


def _save_and_stop(coord, sessions, job):
    """The tasks' side of a notice: each saves at the step it was told and stops (exit 79)."""
    step = job.recovery.notice_step
    assert step
    lead = next(t for t in job.tasks if t.index == 0)
    for t in job.tasks:
        if t is not lead:
            report(coord, sessions, t, TaskState.CANCELLED, exit_code=79)
    report(coord, sessions, lead, TaskState.CANCELLED, step=step, checkpoint_step=step,
           exit_code=79)
    return step


def test_an_elastic_job_grows_when_agents_join_and_shrinks_on_a_notice(env):
    coord, clock, store, _ = env
    for w in ("a", "b"):
        register(coord, w)
    job = coord.submit(SPEC)
    assert job.spec.workers == 2  # two agents: it starts at min, not waiting for max
    _run(coord, _sessions(coord), job)
    _steps(coord, _sessions(coord), job, 30, clock)
    for w in ("c", "d"):
        register(coord, w)
    coord.tick()
    assert not job.recovery.notice_step  # it settles first
    _later(coord, clock, RESIZE_SETTLE_S)
    coord.tick()
    step = job.recovery.notice_step
    assert step and job.recovery.resize_from == 2
    told = {w for w in "abcd" for c in commands(coord, w) if isinstance(c, NoticeCommand)}
    assert told == {"a", "b"}
    assert any(e.kind == "resize" and "from 2 to 4 workers" in e.message
               for e in store.events(job.id))
    _later(coord, clock, 2)
    _save_and_stop(coord, _sessions(coord), job)
    assert job.state == JobState.RESTARTING and job.recovery.failures == 0
    coord.tick()  # no backoff after a checkpoint saved on notice
    assert job.spec.workers == 4 and len(job.tasks) == 4
    assert job.spec.data.batch_size == 64  # the global batch kept
    _run(coord, _sessions(coord), job)
    resized = [e.message for e in store.events(job.id) if e.kind == "resized"]
    assert "2 -> 4 workers at step" in resized[0] and "32 examples per worker -> 16 examples per worker" in resized[0]
    assert "planned 2.0 s after it began (its checkpoint at step" in resized[0]
    assert "running 4 wide (2 before), 2.0 s after the resize began" in resized[1]
    shown = job_to_json(job)
    assert shown["resizes"] == 1 and shown["workers_now"] == 4

    # a notice on one of the four: it saves, and resumes on the three left, as wide as the
    # batch allows at or above min (two)
    _steps(coord, _sessions(coord), job, 80, clock)
    for name in coord.workers:
        commands(coord, name)
    coord.drain("d", deadline_s=30)
    _save_and_stop(coord, _sessions(coord), job)
    coord.tick()
    assert job.spec.workers == 2 and "d" not in {t.worker for t in job.tasks}
    assert job.recovery.resizes == 2
    assert any(e.kind == "resized" and "4 -> 2 workers" in e.message
               for e in store.events(job.id))
    # stored: a coordinator started again reads the width and the count back
    back = store.load_jobs()
    again = next(j for j in back if j.id == job.id)
    assert again.spec.workers == 2 and again.spec.workers_max == 4
    assert again.recovery.resizes == 2


def test_it_never_runs_below_min_and_waits_for_it(env):
    coord, clock, _, _ = env
    for w in ("a", "b"):
        register(coord, w)
    job = coord.submit(SPEC)
    _run(coord, _sessions(coord), job)
    _steps(coord, _sessions(coord), job, 30, clock)
    coord.drain("b", deadline_s=30)
    _save_and_stop(coord, _sessions(coord), job)
    coord.tick()
    # one agent left: the job waits at min (two) rather than run one wide
    assert job.state == JobState.RESTARTING and job.spec.workers == 2
    register(coord, "c")
    coord.tick()
    assert job.state == JobState.SCHEDULED and job.spec.workers == 2


def test_a_waiting_job_starts_narrower_at_what_places_and_growth_waits_for_waiting_jobs(env):
    coord, clock, _, _ = env
    for w in "abcd":
        register(coord, w)
    whole = {**SPEC, "memory": {"per_task_budget": "600MiB"}}  # a task per agent
    other = coord.submit({**whole, "name": "fixed", "workers": 2})
    _run(coord, _sessions(coord), other)
    job = coord.submit(whole)
    assert job.spec.workers == 2  # two of the four agents are busy
    _run(coord, _sessions(coord), job)
    _steps(coord, _sessions(coord), job, 30, clock)
    # a job that waits for room keeps the elastic one from growing into what frees up
    blocked = coord.submit({**whole, "name": "wide", "workers": 4})
    coord.tick()
    assert blocked.state == JobState.PENDING
    for t in other.tasks:
        report(coord, _sessions(coord), t, TaskState.SUCCEEDED)
    _later(coord, clock, RESIZE_SETTLE_S)
    coord.tick()
    assert not job.recovery.notice_step and job.spec.workers == 2


def test_an_elastic_job_is_refused_without_shared_storage_or_room_for_its_min(env):
    coord, *_ = env
    register(coord, "a", shared="")
    with pytest.raises(InfeasibleError, match="resizes through checkpoints.*--shared-dir"):
        coord.submit(SPEC)
    register(coord, "b")
    register(coord, "c")
    with pytest.raises(InfeasibleError, match="needs 4 workers"):
        coord.submit({**SPEC, "workers": {"min": 4, "max": 8}})


def test_a_waiting_elastic_job_narrows_to_min_and_starts_as_wide_as_places(env):
    coord, clock, store, _ = env
    for w in "abcd":
        register(coord, w)
    whole = {**SPEC, "memory": {"per_task_budget": "600MiB"}}
    first = coord.submit({**whole, "name": "first", "workers": 4})
    clock.now += 1
    job = coord.submit(whole)
    assert job.spec.workers == 4  # at submission the four agents were free
    _run(coord, _sessions(coord), first)
    assert job.state == JobState.PENDING and job.spec.workers == 2  # it waits at min
    assert any("planned 2 wide instead of 4" in e.message for e in store.events(job.id))
    for t in first.tasks[:2]:
        report(coord, _sessions(coord), t, TaskState.FAILED, exit_code=1)
    for t in first.tasks:
        if not t.state.final:
            report(coord, _sessions(coord), t, TaskState.CANCELLED)
    # all four free again: it starts four wide, not at min to resize at once
    _run(coord, _sessions(coord), job)
    assert job.spec.workers == 4 and len(job.tasks) == 4
    assert any("planned 4 wide instead of 2" in e.message for e in store.events(job.id))


def test_a_parameter_server_job_counts_its_worker_tasks_and_grows_them(env):
    coord, clock, store, _ = env
    for w in "abc":
        register(coord, w)
    ps = {**SPEC, "strategy": "parameter_server", "parameter_servers": 1,
          "workers": {"min": 1, "max": 3}, "memory": {"per_task_budget": "600MiB"}}
    job = coord.submit(ps)
    assert job.spec.workers == 1  # the chief and the server take two of the three agents
    _run(coord, _sessions(coord), job)
    _steps(coord, _sessions(coord), job, 30, clock)
    register(coord, "d")
    _later(coord, clock, RESIZE_SETTLE_S)
    coord.tick()
    assert job.recovery.notice_step
    _save_and_stop(coord, _sessions(coord), job)
    coord.tick()
    assert job.spec.workers == 2
    assert sorted(t.role for t in job.tasks) == ["chief", "ps", "worker", "worker"]


def test_an_elastic_job_is_estimated_holding_the_whole_training_set():
    from strata.memory import dataset_bytes, estimate_task_memory

    elastic = parse_job_spec({**SPEC, "data": {"source": "synthetic", "examples": 65536,
                                               "batch_size": 64}}).to_dict()
    fixed = {k: v for k, v in elastic.items() if k != "elastic"}
    whole, half = dataset_bytes(fixed), dataset_bytes(fixed, shards=4)
    more = estimate_task_memory(elastic, 16).data - estimate_task_memory(fixed, 16).data
    assert more >= whole - half > 0  # (at least: the input's making holds a second copy)
