"""Preemption on a shared cluster: the victims' choice as tables (``policy.victims``, no
coordinator), and the control loop tick by tick: a notice to save, the victim waiting behind
its preemptor and resuming at its step, borrowed room reclaimed, a queue's nominal share kept.
Real processes: ``tests/test_scheduling_run.py``."""

from __future__ import annotations

import pytest

from strata.coordinator.agents import NoticeCommand
from strata.coordinator.placement import Capacity
from strata.coordinator.policy import Place, Running, may_preempt, victims
from strata.coordinator.preemption import PREEMPT_DEADLINE_S
from strata.queues import Share, parse_queues
from strata.types import Job, JobState, Task, TaskState, job_to_json

from conftest import Clock, queued as commands
from test_queues import FILE, _run, _sessions, spec
from test_restarts import register, report

GiB = 1 << 30
MiB = 1 << 20
QUEUES = parse_queues(FILE)  # research: nominal 2 + borrow 2; prod: nominal 2; everyone: 1


# --- the choice, as tables ----------------------------------------------------------------------

def _job(name: str, agents: list[str], *, created: float = 0.0,
         preemptible: bool = True) -> Job:
    from strata.jobspec import JobSpec
    j = Job(id=name, name=name, state=JobState.RUNNING, strategy="multi_worker_mirrored",
            spec=JobSpec.from_dict({**spec(name, workers=len(agents) or 1),
                                    "preemptible": preemptible}), created_at=created)
    j.tasks = [Task(job_id=name, role="worker", index=i, worker=a, state=TaskState.RUNNING,
                    memory_budget_bytes=600 * MiB) for i, a in enumerate(agents)]
    return j


def _waiting(name: str, workers: int) -> Job:
    j = _job(name, [""] * workers)
    j.state = JobState.PENDING
    return j


def _caps(names: str, free: str = "") -> list[Capacity]:
    """Agents of 1 GiB, those in ``free`` with their room free, the rest with 600 MiB taken."""
    return [Capacity(n, GiB, GiB if n in free else GiB - 600 * MiB, 4 if n in free else 3)
            for n in names]


def _r(job: Job, queue: str, priority: int, lost: float) -> Running:
    return Running(job, Place(queue, priority), lost)


@pytest.mark.parametrize("mine, theirs, use, allowed", [
    # the same queue: lower priority only
    (Place("research", 1000), Place("research", 100), {}, True),
    (Place("research", 100), Place("research", 100), {}, False),
    # another queue within its nominal share: never, whatever the priority
    (Place("prod", 1000), Place("research", 0), {"research": Share(2, 2 * GiB)}, False),
    # another queue borrowing: a lower priority, or any when this one reclaims its share
    (Place("prod", 1000), Place("research", 100), {"research": Share(3, 3 * GiB)}, True),
    (Place("prod", 100), Place("research", 100), {"research": Share(3, 3 * GiB)}, True),
    (Place("prod", 100), Place("research", 100),
     {"research": Share(3, 3 * GiB), "prod": Share(2, GiB)}, False),  # prod borrows too
])
def test_who_may_preempt_whom(mine, theirs, use, allowed):
    job = _waiting("p", 1)
    other = _r(_job("v", ["a"]), theirs.queue, theirs.priority, 0.0)
    assert may_preempt(job, mine, other, QUEUES, use) is allowed


def test_a_job_not_preemptible_is_never_a_victim():
    job = _waiting("p", 1)
    other = _r(_job("v", ["a"], preemptible=False), "research", 0, 0.0)
    assert not may_preempt(job, Place("research", 1000), other, QUEUES, {})


@pytest.mark.parametrize("running, expected", [
    # lowest priority first, whatever it loses
    ([("lo", "a", 0, 900.0), ("mid", "b", 50, 0.0)], ["lo"]),
    # at a priority, least work lost first
    ([("x", "a", 0, 900.0), ("y", "b", 0, 30.0)], ["y"]),
    # a taker that turns out not to be needed is given back (the costliest first)
    ([("cheap1", "a", 0, 10.0), ("cheap2", "b", 0, 20.0), ("dear", "cd", 0, 500.0)],
     ["cheap1", "cheap2"]),
])
def test_the_victims_lose_least(running, expected):
    """A 2-task job waits with no agent free; each running job holds the agents named."""
    jobs = [_r(_job(n, list(agents)), "research", prio, lost) for n, agents, prio, lost in running]
    pre = victims(_waiting("p", len(expected) if len(expected) > 1 else 1),
                  Place("research", 1000), jobs, _caps("abcd"), QUEUES, {})
    assert pre is not None and [r.job.id for r in pre.victims] == expected


def test_the_fewest_victims_that_make_room():
    """Two low jobs of 1 and a wide one of 2 that loses least: the wide one alone makes room
    for a 2-task job, and the greedy pass's earlier picks are given back."""
    small1 = _r(_job("s1", ["a"]), "research", 0, 100.0)
    small2 = _r(_job("s2", ["b"]), "research", 0, 100.0)
    wide = _r(_job("w", ["c", "d"]), "research", 0, 50.0)
    pre = victims(_waiting("p", 2), Place("research", 1000), [small1, small2, wide],
                  _caps("abcd"), QUEUES, {})
    assert pre is not None and [r.job.id for r in pre.victims] == ["w"]
    assert pre.agents == {"c", "d"} and pre.lost_s == 50.0


def test_nothing_is_preempted_when_even_all_would_not_make_room():
    low = _r(_job("lo", ["a"]), "research", 0, 0.0)
    assert victims(_waiting("p", 3), Place("research", 1000), [low], _caps("ab"),
                   QUEUES, {}) is None


def test_reclaim_stops_once_the_lender_no_longer_borrows():
    """research holds 3 (borrowing 1): prod reclaims one agent's worth, not research's own."""
    use = {"research": Share(3, 3 * 600 * MiB)}
    jobs = [_r(_job(f"r{i}", [a]), "research", 100, float(i)) for i, a in enumerate("abc")]
    assert victims(_waiting("p", 2), Place("prod", 100), jobs, _caps("abcd", free="d"),
                   QUEUES, use).victims[0].job.id == "r0"
    # a 3-task job would need two of research's: only one is borrowed
    assert victims(_waiting("p", 3), Place("prod", 100), jobs, _caps("abcd", free="d"),
                   QUEUES, use) is None


# --- the control loop ---------------------------------------------------------------------------

@pytest.fixture
def qenv(tmp_path):
    from strata.coordinator.core import Coordinator
    from strata.coordinator.store import SqliteStore

    clock = Clock()
    store = SqliteStore(str(tmp_path / "s.db"))
    coord = Coordinator(store, str(tmp_path), heartbeat_timeout_s=10, clock=clock,
                        monotonic=clock, queues=QUEUES)
    for w in "abcd":
        register(coord, w)
    return coord, clock, store


def _steps(coord, job, step, clock, checkpoint=0):
    lead = next(t for t in job.tasks if t.index == 0)
    report(coord, _sessions(coord), lead, TaskState.RUNNING, step=step, total_steps=1000,
           loss=1.0, examples_per_sec=640.0, first_step_time=clock.now,
           checkpoint_step=checkpoint)  # 10 steps/s


def _save(coord, job):
    """The tasks' side of a notice: each saves at the step it was told and stops (exit 79)."""
    step = job.recovery.notice_step
    assert step
    lead = next(t for t in job.tasks if t.index == 0)
    for t in job.tasks:
        if t is not lead:
            report(coord, _sessions(coord), t, TaskState.CANCELLED, exit_code=79)
    report(coord, _sessions(coord), lead, TaskState.CANCELLED, step=step, checkpoint_step=step,
           exit_code=79)
    return step


def _running_low(coord, clock):
    """alice's low-priority job, 4 wide (all of research's room), at step 100."""
    low = coord.submit(spec("low", workers=4, priority="low"), owner="alice")
    coord.tick()
    _run(coord, low)
    _steps(coord, low, 100, clock)
    return low


def _later(coord, clock, seconds):
    """``seconds`` pass, the agents heard from meanwhile."""
    clock.now += seconds
    for name, live in coord.workers.items():
        if not live.lost:
            coord.heartbeat(name, live.session, live.memory, [], sorted(live.free_ports))


def _end(coord, job):
    for t in job.tasks:
        report(coord, _sessions(coord), t, TaskState.SUCCEEDED)


def test_a_higher_priority_job_preempts_and_the_victim_resumes_at_its_step(qenv):
    coord, clock, store = qenv
    low = _running_low(coord, clock)
    clock.now += 1
    high = coord.submit(spec("high", workers=2, priority="high"), owner="bob")
    coord.tick()
    # research holds its 4: only stopping its own low job makes room, and that saves first
    step = low.recovery.notice_step
    assert step > 100 and low.recovery.preempted_by == high.id
    told = {w for w in "abcd" for c in commands(coord, w) if isinstance(c, NoticeCommand)}
    assert told == {"a", "b", "c", "d"}
    assert high.state == JobState.PENDING and "it preempted (" + low.id in high.message
    assert any(e.kind == "preempted" and f"after step {step}" in e.message
               for e in store.events(low.id))
    # a later job of the same queue does not take the room kept for the preemptor
    clock.now += 1
    _save(coord, low)
    assert low.state == JobState.RESTARTING and low.recovery.failures == 0
    coord.tick()
    assert high.state == JobState.SCHEDULED
    # it waits again, ordered behind its preemptor (placed first in the same pass)
    assert low.state == JobState.RESTARTING and low.position == 2
    shown = job_to_json(low)
    assert shown["preemptions"] == 1 and shown["position"] == 2
    assert shown["waiting_for"].startswith("waiting for room in queue research: it holds 2")
    _run(coord, high)
    coord.tick()
    # the low job's queue has room for 2 of its 4 while high runs: it waits whole
    assert low.state == JobState.RESTARTING and low.checkpoint_step == step
    _end(coord, high)
    coord.tick()
    assert low.state == JobState.SCHEDULED and low.recovery.preempted_by == ""
    # it resumes from the checkpoint it saved on notice: the next generation of its tasks
    config = coord.task_config(low, low.tasks[0])
    assert config.restart == low.restarts == 1 and low.checkpoint_step == step
    assert low.steps_repeated == 0


def test_a_victim_that_cannot_save_stops_at_once_and_loses_least(qenv):
    coord, clock, store = qenv
    # two low jobs: one just checkpointed, one far from its checkpoint; neither reported a
    # rate, so neither can save on notice: the one losing least is taken
    near = coord.submit(spec("near", workers=2, priority="low"), owner="alice")
    far = coord.submit(spec("far", workers=2, priority="low"), owner="alice")
    coord.tick()
    for j, ckpt in ((near, 95), (far, 10)):
        _run(coord, j)
        lead = next(t for t in j.tasks if t.index == 0)
        report(coord, _sessions(coord), lead, TaskState.RUNNING, step=100, total_steps=1000,
               loss=1.0, examples_per_sec=640.0, first_step_time=clock.now,
               checkpoint_step=ckpt)
    for w in coord.workers.values():  # no shared directory: nowhere to save on notice
        w.record.shared_dir = ""
    clock.now += 1
    high = coord.submit(spec("high", workers=2, priority="high"), owner="bob")
    coord.tick()
    assert near.state == JobState.RESTARTING and far.state == JobState.RUNNING
    assert any(e.kind == "preempted" and "cannot save on notice" in e.message
               for e in store.events(near.id))
    for t in near.tasks:
        report(coord, _sessions(coord), t, TaskState.CANCELLED)
    coord.tick()  # no backoff: the victim waits in the order, behind its preemptor
    assert high.state == JobState.SCHEDULED and near.state == JobState.RESTARTING


def test_a_queue_under_its_share_reclaims_borrowed_room(qenv):
    coord, clock, store = qenv
    borrowing = [coord.submit(spec(f"r{i}", workers=2), owner="alice") for i in range(2)]
    coord.tick()
    for j in borrowing:
        _run(coord, j)
        _steps(coord, j, 50, clock)
    assert all(j.state == JobState.RUNNING for j in borrowing)  # research: 4 of nominal 2
    clock.now += 1
    entitled = coord.submit(spec("p0", workers=2), owner="carol")  # prod: nominal 2, idle
    coord.tick()
    victims_ = [j for j in borrowing if j.recovery.preempted_by == entitled.id]
    assert len(victims_) == 1  # one of research's borrowed jobs, not both
    _save(coord, victims_[0])
    coord.tick()
    assert entitled.state == JobState.SCHEDULED
    # research is back at its nominal share: nothing more is taken from it
    clock.now += 1
    more = coord.submit(spec("p1", workers=2), owner="carol")
    coord.tick()
    assert more.state == JobState.PENDING
    assert not any(j.recovery.notice_step for j in borrowing if j not in victims_)


def test_a_queue_within_its_nominal_share_is_never_preempted(qenv):
    coord, clock, _ = qenv
    mine = coord.submit(spec("r0", workers=2, priority="low"), owner="alice")
    theirs = coord.submit(spec("p0", workers=2), owner="carol")
    coord.tick()
    for j in (mine, theirs):
        _run(coord, j)
        _steps(coord, j, 50, clock)
    urgent = coord.submit(spec("p1", workers=2, priority="high"), owner="carol")
    coord.tick()
    # prod holds its nominal 2 and may not borrow; research is within its own share
    assert urgent.state == JobState.PENDING and "waiting for room in queue prod" in urgent.message
    assert not mine.recovery.notice_step
    # prod's own lower-priority job is fair game
    assert theirs.recovery.preempted_by == urgent.id


def test_a_preemption_waits_when_room_frees_sooner(qenv):
    """The head's room comes back within a notice's deadline: nothing is preempted."""
    coord, clock, _ = qenv
    low = coord.submit(spec("low", workers=4, priority="low",
                            training={"steps": 100, "time_limit": "2m"}), owner="alice")
    coord.tick()
    _run(coord, low)
    _steps(coord, low, 10, clock)
    clock.now += 120 - PREEMPT_DEADLINE_S / 2  # it ends within half a deadline
    high = coord.submit(spec("high", workers=2, priority="high"), owner="bob")
    coord.tick()
    assert not low.recovery.notice_step and high.state == JobState.PENDING


def test_a_job_its_queue_holds_back_keeps_the_queues_room(qenv):
    """A 4-wide job waits for its queue's room (research may hold 4; a 2-wide job of it
    runs): 1-worker jobs of that queue, which would fit beside it, do not take that room for
    ever; one whose time limit ends before the running job does runs meanwhile."""
    coord, clock, _ = qenv
    running = coord.submit(spec("running", training={"steps": 1000, "time_limit": "10m"}),
                           owner="alice")
    coord.tick()
    _run(coord, running)
    _steps(coord, running, 10, clock)
    clock.now += 1
    gang = coord.submit(spec("gang", workers=4), owner="bob")
    clock.now += 1
    small = coord.submit(spec("small", workers=1), owner="alice")
    clock.now += 1
    brief = coord.submit(spec("brief", workers=1, training={"steps": 10, "time_limit": "1m"}),
                         owner="alice")
    coord.tick()
    assert gang.state == JobState.PENDING
    assert "waiting for room in queue research" in gang.message
    assert "its room in the queue is kept, expected to start in about" in gang.message
    assert small.state == JobState.PENDING
    assert small.message.startswith(f"waiting behind {gang.id}, the job ahead of it, whose "
                                    "room in queue research is kept")
    assert brief.state == JobState.SCHEDULED  # it ends before the gang could start
    _run(coord, brief)
    for j in (running, brief):
        _end(coord, j)
    coord.tick()
    assert gang.state == JobState.SCHEDULED, gang.message
    assert small.state == JobState.PENDING  # (research holds 4 with the gang)


def test_a_time_limit_counts_training_not_the_time_preempted(qenv):
    """A job with a 10-minute limit trains 5, is preempted and waits 20: it is not past its
    limit when it runs again, and its expected end is the 5 minutes it has left."""
    from strata.coordinator import decisions, policy
    coord, clock, _ = qenv
    low = coord.submit(spec("low", workers=4, priority="low",
                            training={"steps": 1000, "time_limit": "10m"}), owner="alice")
    coord.tick()
    _run(coord, low)
    _steps(coord, low, 10, clock)
    _later(coord, clock, 300)
    high = coord.submit(spec("high", workers=4, priority="high"), owner="bob")
    coord.tick()
    _save(coord, low)
    coord.tick()
    assert high.state == JobState.SCHEDULED
    assert low.recovery.ran_s == pytest.approx(300, abs=5)
    _later(coord, clock, 1200)
    _run(coord, high)
    _end(coord, high)
    coord.tick()
    assert low.state == JobState.SCHEDULED
    _run(coord, low)
    _later(coord, clock, 60)
    assert decisions.trained_for(low, clock.now) == pytest.approx(360, abs=5)
    assert not decisions.past_time_limit(low, clock.now)
    assert policy.expected_end(low, clock.now) == pytest.approx(clock.now + 240, abs=5)
    _later(coord, clock, 300)
    assert "ran past its training.time_limit" in decisions.past_time_limit(low, clock.now)


def test_a_preemptor_cancelled_while_its_victims_stop_keeps_no_room(qenv):
    coord, clock, _ = qenv
    low = _running_low(coord, clock)
    high = coord.submit(spec("high", workers=2, priority="high"), owner="bob")
    coord.tick()
    assert low.recovery.preempted_by == high.id
    coord.cancel(high.id)
    _save(coord, low)
    other = coord.submit(spec("other", workers=4), owner="bob")
    coord.tick()
    # a job after it in the order starts on the room the cancelled job had kept
    assert other.state == JobState.SCHEDULED, other.message
    assert low.state == JobState.RESTARTING and high.id not in coord._preempting
