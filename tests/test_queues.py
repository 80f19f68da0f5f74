"""Queues of a shared cluster: the admin's file, a job's queue and priority, the policy's order
(tables, no coordinator), shares and borrowing held by the control loop tick by tick, and
``strata queues`` against a real coordinator reloading its file on SIGHUP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from strata.coordinator.policy import FairShare, Place, Standing, order
from strata.errors import QuotaExceeded, SpecError
from strata.queues import UNBOUNDED, QueueError, Share, parse_queues
from strata.types import Job, JobState, Task, TaskState, job_to_json

from conftest import Clock, wait_until
from test_restarts import register, report

GiB = 1 << 30
FILE = """
queues:
  - name: research
    members: [alice, bob]
    nominal: {workers: 2, memory: 2GiB}
    borrow: {workers: 2, memory: 2GiB}
  - name: prod
    members: [carol]
    nominal: {workers: 2, memory: 2GiB}
  - name: everyone
    members: ["*"]
    nominal: {workers: 1}
    default: true
priority_classes: {low: 0, normal: 100, high: 1000}
fair_share_half_life: 1h
"""


# --- the file -------------------------------------------------------------------------------

def test_a_queues_file_reads_whole():
    q = parse_queues(FILE)
    research = q.get("research")
    assert research.nominal == Share(2, 2 * GiB) and research.limit == Share(4, 4 * GiB)
    assert q.get("prod").borrow == Share(0, 0)
    assert q.get("everyone").nominal == Share(1, UNBOUNDED)
    assert q.priority_classes["high"] == 1000 and q.fair_share_half_life_s == 3600


@pytest.mark.parametrize("text, field", [
    ("queues: []", "queues"),
    ("queues: [{name: a, nominal: {workers: -1}}]", "queues[0].nominal.workers"),
    ("queues: [{name: a, nominal: {memory: lots}}]", "queues[0].nominal.memory"),
    ("queues: [{name: a, nominal: {cpus: 2}}]", "queues[0].nominal.cpus"),
    ("queues: [{name: a}, {name: a}]", "queues[1].name"),
    ("queues: [{name: a, members: [x]}, {name: b, members: [x]}]", "queues[1].members"),
    ("queues: [{name: a, default: true}, {name: b, default: true}]", "queues"),
    ("queues: [{name: 'a b'}]", "queues[0].name"),
    ("queues: [{name: a, colour: red}]", "queues[0].colour"),
    ("queues: [{name: a}]\npriority_classes: {high: big}", "priority_classes.high"),
    ("queues: [{name: a}]\nfair_share_half_life: never", "fair_share_half_life"),
    ("queues: [{name: a}]\nteams: []", "teams"),
    ("queues: [{name: a", "queues"),
])
def test_a_bad_queues_file_is_refused_naming_the_field(text, field):
    with pytest.raises(QueueError) as e:
        parse_queues(text)
    assert e.value.field == field


def test_a_jobs_queue_and_priority_resolve_for_its_owner():
    q = parse_queues(FILE)
    assert q.queue_of("alice").name == "research"
    assert q.queue_of("dave").name == "everyone"  # "*"
    assert q.queue_of("alice", "everyone").name == "everyone"
    with pytest.raises(QueueError, match="not a member of queue 'prod'"):
        q.queue_of("alice", "prod")
    with pytest.raises(QueueError, match="no queue 'gpu'"):
        q.queue_of("alice", "gpu")
    assert q.priority_of("") == ("normal", 100) and q.priority_of("high") == ("high", 1000)
    with pytest.raises(QueueError, match="no priority class 'urgent'"):
        q.priority_of("urgent")


GROUPS = """
queues:
  - name: vision
    members: [group:vision, carol]
  - name: nlp
    members: [group:nlp]
  - name: everyone
    members: ["*"]
"""


def test_a_queue_names_the_token_files_groups():
    q = parse_queues(GROUPS)
    assert q.queue_of("erin", groups=["vision"]).name == "vision"
    assert q.queue_of("erin", groups=["nlp", "other"]).name == "nlp"
    assert q.queue_of("erin").name == "everyone"
    # a NAME listed by name wins over its group
    assert q.queue_of("carol", groups=["nlp"]).name == "vision"
    assert q.queue_of("erin", "nlp", groups=["nlp"]).name == "nlp"
    with pytest.raises(QueueError, match="not a member of queue 'nlp'"):
        q.queue_of("erin", "nlp", groups=["vision"])
    with pytest.raises(QueueError, match="queues\\[1\\].members"):
        parse_queues("queues: [{name: a, members: [group:x]}, {name: b, members: [group:x]}]")


def test_the_token_files_groups(tmp_path):
    from strata.auth import Auth, AuthFileError, parse_tokens
    path = tmp_path / "tokens"
    path.write_text("a" * 20 + " submitter erin vision,nlp\n"
                    + "b" * 20 + " submitter erin ops\n"
                    + "c" * 20 + " submitter frank\n")
    assert Auth(str(path)).groups() == {"erin": ("nlp", "ops", "vision")}
    with pytest.raises(AuthFileError, match="line 1: group 'bad/group'"):
        parse_tokens("a" * 20 + " submitter erin vision,bad/group")
    with pytest.raises(AuthFileError, match="TOKEN ROLE NAME \\[GROUPS\\], got 5"):
        parse_tokens("a" * 20 + " submitter erin vision extra")


# --- the order, as a table ------------------------------------------------------------------

def _job(name: str, owner: str, created: float, workers: int = 1) -> Job:
    j = Job(id=name, name=name, state=JobState.PENDING, strategy="multi_worker_mirrored",
            spec=None, created_at=created, owner=owner)
    j.tasks = [Task(job_id=name, role="worker", index=i, memory_budget_bytes=GiB // 4)
               for i in range(workers)]
    return j


#: (jobs as (name, owner, created, queue, priority, workers), queue use, owners' use) -> order
ORDERS = [
    # oldest first, all else equal
    ([("a", "alice", 2, "research", 100, 1), ("b", "bob", 1, "research", 100, 1)], {}, {},
     ["b", "a"]),
    # the higher priority first, whatever the age
    ([("a", "alice", 1, "research", 100, 1), ("b", "bob", 2, "research", 1000, 1)], {}, {},
     ["b", "a"]),
    # a queue under its nominal share before one over it, whatever the priority
    ([("a", "alice", 1, "research", 1000, 1), ("c", "carol", 2, "prod", 0, 1)],
     {"research": Share(2, GiB)}, {}, ["c", "a"]),
    # a queue at its nominal share is not under it
    ([("a", "alice", 1, "research", 100, 1), ("c", "carol", 2, "prod", 100, 1)],
     {"research": Share(2, 0)}, {}, ["c", "a"]),
    # under it, a job's size does not matter: within a queue, the older wide job first
    ([("a", "alice", 1, "research", 100, 4), ("b", "bob", 2, "research", 100, 1)],
     {"research": Share(1, 0)}, {}, ["a", "b"]),
    # fair share: the owner who used the cluster less lately first
    ([("a", "alice", 1, "research", 100, 1), ("b", "bob", 2, "research", 100, 1)], {},
     {"alice": 7200.0, "bob": 60.0}, ["b", "a"]),
    # ... but priority comes before fair share
    ([("a", "alice", 1, "research", 1000, 1), ("b", "bob", 2, "research", 100, 1)], {},
     {"alice": 7200.0}, ["a", "b"]),
]


@pytest.mark.parametrize("jobs, use, used, expected", ORDERS)
def test_the_policys_order(jobs, use, used, expected):
    queues = parse_queues(FILE)
    fair = FairShare(3600.0)
    for owner, seconds in used.items():
        fair.charge(owner, seconds, 0.0)
    waiting = [(j, Standing.of(j, Place(q, p)))
               for j, q, p in ((_job(n, o, c, w), q, p) for n, o, c, q, p, w in jobs)]
    assert [j.id for j in order(waiting, queues, use, fair, 10.0)] == expected


def test_fair_share_use_halves_every_half_life():
    fair = FairShare(3600.0)
    fair.charge("alice", 1000.0, 0.0)
    assert fair.usage("alice", 3600.0) == pytest.approx(500.0)
    fair.charge("alice", 500.0, 3600.0)
    assert fair.usage("alice", 7200.0) == pytest.approx(500.0)
    assert fair.usage("nobody", 7200.0) == 0.0


# --- the control loop -----------------------------------------------------------------------

@pytest.fixture
def qenv(tmp_path):
    from strata.coordinator.core import Coordinator
    from strata.coordinator.store import SqliteStore

    clock = Clock()
    store = SqliteStore(str(tmp_path / "s.db"))
    coord = Coordinator(store, str(tmp_path), heartbeat_timeout_s=10, clock=clock,
                        monotonic=clock, queues=parse_queues(FILE))
    for w in "abcdef":
        register(coord, w)
    return coord, clock


def spec(name: str, workers: int = 2, **extra) -> dict:
    return {"name": name, "workers": workers,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64],
                                  "classes": 10}},
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 1000},
            "memory": {"per_task_budget": "600MiB"}, **extra}  # a task per agent


def _sessions(coord):
    return {w: live.session for w, live in coord.workers.items()}


def _run(coord, job):
    for t in job.tasks:
        report(coord, _sessions(coord), t, TaskState.RUNNING)


def test_a_queue_holds_its_nominal_share_and_borrows_up_to_its_limit(qenv):
    coord, clock = qenv
    jobs = []
    for i in range(3):
        jobs.append(coord.submit(spec(f"r{i}"), owner="alice"))
        clock.now += 1
    coord.tick()
    # research: nominal 2 and borrowing 2: two jobs of two run, the third waits for its room
    assert [j.state for j in jobs] == [JobState.SCHEDULED, JobState.SCHEDULED, JobState.PENDING]
    assert jobs[2].message.startswith("waiting for room in queue research: it holds 4")
    assert jobs[0].spec.queue == "research" and jobs[0].spec.priority == "normal"
    views = {v.name: v for v in coord.queue_views()}
    assert views["research"].in_use.workers == 4 and views["research"].waiting == 1
    assert views["research"].to_json()["borrowed"] == 2
    # one ends: the waiting one starts in its room
    _run(coord, jobs[0])
    for t in jobs[0].tasks:
        report(coord, _sessions(coord), t, TaskState.SUCCEEDED)
    coord.tick()
    assert jobs[2].state == JobState.SCHEDULED


def test_a_queue_under_its_share_goes_before_a_borrowing_one(qenv):
    coord, clock = qenv
    first = coord.submit(spec("r0"), owner="alice")  # research at its nominal 2
    other = coord.submit(spec("e0", workers=1), owner="dave")  # everyone's queue: 1
    coord.tick()
    assert first.state == other.state == JobState.SCHEDULED  # 3 agents left
    clock.now += 1
    borrowing = coord.submit(spec("r1"), owner="bob")  # older, but research would borrow
    clock.now += 1
    entitled = coord.submit(spec("p0"), owner="carol")  # prod is under its nominal share
    coord.tick()
    assert entitled.state == JobState.SCHEDULED and borrowing.state == JobState.PENDING


def test_within_a_queue_priority_then_age_decide(qenv):
    coord, clock = qenv
    # (as high as the urgent job: lower, it would be preempted, ``test_preemption.py``)
    blocker = coord.submit(spec("block", workers=4, priority="high"), owner="alice")
    coord.tick()
    assert blocker.state == JobState.SCHEDULED
    old = coord.submit(spec("old"), owner="bob")
    clock.now += 1
    urgent = coord.submit(spec("urgent", priority="high"), owner="alice")
    coord.tick()
    assert old.state == urgent.state == JobState.PENDING  # research holds its 4
    _run(coord, blocker)
    for t in blocker.tasks:
        report(coord, _sessions(coord), t, TaskState.SUCCEEDED)
    coord.tick()
    assert urgent.state == JobState.SCHEDULED and old.state == JobState.SCHEDULED
    assert urgent.spec.priority == "high"


def test_submission_refuses_what_the_queues_never_allow(qenv):
    coord, _ = qenv
    with pytest.raises(SpecError) as e:
        coord.submit(spec("x", queue="prod"), owner="alice")
    assert e.value.field == "queue"
    with pytest.raises(SpecError) as e:
        coord.submit(spec("x", priority="urgent"), owner="alice")
    assert e.value.field == "priority"
    with pytest.raises(QuotaExceeded, match="more than queue prod may ever hold"):
        coord.submit(spec("x", workers=4), owner="carol")
    with pytest.raises(QuotaExceeded, match="not preemptible"):
        coord.submit(spec("x", workers=4, preemptible=False), owner="alice")
    coord.submit(spec("x", workers=2, preemptible=False), owner="alice")


def test_without_a_queues_file_queue_and_priority_are_refused(env):
    coord, *_ = env
    register(coord, "a")
    with pytest.raises(SpecError, match="no queues file") as e:
        coord.submit(spec("x", workers=1, priority="high"))
    assert e.value.field == "priority"
    job = coord.submit(spec("x", workers=1, queue="default"))
    assert job.spec.queue == "default"


# --- strata queues, and SIGHUP ----------------------------------------------------------------

def test_strata_queues_shows_the_file_and_sighup_reloads_it(tmp_path):
    path = tmp_path / "queues.yaml"
    path.write_text(FILE)
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))}
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "coordinator", "--listen",
                             "127.0.0.1:0", "--state-dir", str(tmp_path / "state"),
                             "--port-file", str(port_file), "--queues", str(path)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: port_file.exists(), 30, what="the coordinator")
        address = port_file.read_text()

        def queues() -> list[dict]:
            out = subprocess.run([sys.executable, "-m", "strata.cli", "queues", "--json",
                                  "--coordinator", address], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout)
        shown = queues()
        assert [q["name"] for q in shown] == ["research", "prod", "everyone"]
        assert shown[0]["nominal"] == {"workers": 2, "memory_bytes": 2 * GiB}
        assert shown[2]["nominal"]["memory_bytes"] is None and shown[2]["default"]
        path.write_text(FILE.replace("name: prod", "name: production"))
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: [q["name"] for q in queues()][1] == "production", 30,
                   what="the reloaded file")
        path.write_text("queues: [")  # a broken file keeps the queues in force
        proc.send_signal(signal.SIGHUP)
        assert [q["name"] for q in queues()][1] == "production"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert b"kept the queues in force" in proc.stderr.read()


def test_a_bad_queues_file_stops_the_coordinator_naming_the_field(tmp_path):
    path = tmp_path / "queues.yaml"
    path.write_text("queues: [{name: a, nominal: {workers: -2}}]")
    out = subprocess.run([sys.executable, "-m", "strata.cli", "coordinator", "--listen",
                          "127.0.0.1:0", "--state-dir", str(tmp_path / "s"), "--queues",
                          str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "queues[0].nominal.workers" in out.stderr


def test_a_job_fails_past_its_time_limit(env):
    coord, clock, store, _ = env
    for w in "ab":
        register(coord, w)
    job = coord.submit(spec("timed", workers=1, training={"steps": 10 ** 6, "time_limit": "2m"}))
    coord.tick()
    _run(coord, job)
    t = job.tasks[0]
    report(coord, _sessions(coord), t, TaskState.RUNNING, step=5, total_steps=10 ** 6,
           loss=1.0, examples_per_sec=64.0, first_step_time=clock.now)

    def later(seconds: float) -> None:
        clock.now += seconds
        for name, live in coord.workers.items():  # heard from: they stay
            coord.heartbeat(name, live.session, live.memory, [], sorted(live.free_ports))
        coord.tick()
    later(100)
    later(6)
    assert job.state == JobState.RUNNING  # 106 s of its 120
    later(20)
    assert job.state == JobState.FAILED and "training.time_limit of 120 s" in job.message


def test_an_elastic_job_is_as_wide_as_its_queue_may_hold(qenv):
    coord, clock = qenv
    wide = {**spec("el", workers={"min": 2, "max": 8}), "data": {"source": "digits",
                                                                  "batch_size": 48}}
    job = coord.submit(wide, owner="alice")
    # six agents free (48 divides by 6), but research may hold 4 (nominal 2, borrowing 2)
    assert job.spec.workers == 4
    coord.tick()
    assert job.state == JobState.SCHEDULED and len(job.tasks) == 4


# --- a reservation for the head of the order, and backfill -----------------------------------

from strata.coordinator.placement import Capacity  # noqa: E402
from strata.coordinator.policy import Reservation, delays, reserve  # noqa: E402


def _running(name: str, agents: list[str]) -> Job:
    j = _job(name, "x", 0.0, len(agents))
    j.state = JobState.RUNNING
    for t, a in zip(j.tasks, agents):
        t.worker, t.state = a, TaskState.RUNNING
    return j


def test_a_reservation_takes_the_room_of_the_jobs_that_end_first():
    free = [Capacity(a, GiB, GiB if a in "ab" else GiB // 2) for a in "abcdef"]
    head = _job("head", "x", 0.0, 4)
    for t in head.tasks:
        t.memory_budget_bytes = GiB
    soon, late, unknown = _running("soon", ["c", "d"]), _running("late", ["e"]), \
        _running("unknown", ["f"])
    for j in (soon, late, unknown):
        for t in j.tasks:
            t.memory_budget_bytes = GiB // 2
    r = reserve(head, free, [(unknown, None), (late, 500.0), (soon, 100.0)], 10.0)
    assert r == Reservation("head", frozenset("abcd"), 100.0)
    # not enough room even when every job with a known end has ended: the start is unknown
    r = reserve(head, free[:2] + free[4:], [(late, 500.0), (unknown, None)], 10.0)
    assert r.agents == frozenset("abef") and r.start is None


@pytest.mark.parametrize("agents, duration, delayed", [
    (["e"], None, False),          # room the reservation does not need
    (["a"], None, True),           # reserved room, for as long as it likes
    (["a"], 60.0, False),          # reserved room, ending before the reserved start
    (["a"], 120.0, True),          # ... or not
])
def test_a_later_job_starts_only_where_it_does_not_delay_the_reservation(agents, duration,
                                                                         delayed):
    r = Reservation("head", frozenset("abcd"), 100.0)
    assert delays(r, agents, duration, 10.0) is delayed
    assert delays(Reservation("head", frozenset("a"), None), ["a"], 60.0, 10.0)


ONE_QUEUE = "queues: [{name: all, members: ['*'], default: true}]"


def _one_queue(tmp_path, agents: str):
    """A coordinator with one queue for all and an agent of 1 GiB for each letter of
    ``agents``, on a clock of its own."""
    from strata.coordinator.core import Coordinator
    from strata.coordinator.store import SqliteStore

    clock = Clock()
    coord = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock,
                        heartbeat_timeout_s=10, monotonic=clock,
                        queues=parse_queues(ONE_QUEUE))
    for w in agents:
        register(coord, w)
    return coord, clock


def test_a_large_gang_is_not_overtaken_for_ever_by_smaller_jobs(tmp_path):
    coord, clock = _one_queue(tmp_path, "abcd")
    running = coord.submit(spec("running", training={"steps": 1000, "time_limit": "10m"}))
    coord.tick()
    _run(coord, running)
    report(coord, _sessions(coord), running.tasks[0], TaskState.RUNNING, step=1,
           total_steps=1000, loss=1.0, first_step_time=clock.now)
    clock.now += 1
    gang = coord.submit(spec("gang", workers=4))
    clock.now += 1
    small = coord.submit(spec("small"))  # would fit the two free agents, for ever
    clock.now += 1
    brief = coord.submit(spec("brief", training={"steps": 10, "time_limit": "1m"}))
    coord.tick()
    assert gang.state == JobState.PENDING
    assert "its room is kept, expected to start in about 10 min" in gang.message
    shown = {j.name: job_to_json(j) for j in (gang, small, brief)}
    assert shown["gang"]["position"] == 1 and shown["small"]["position"] == 2
    assert shown["gang"]["estimated_start"] == pytest.approx(clock.now - 3 + 600, abs=5)
    assert shown["small"]["waiting_for"].startswith("waiting behind gang-")
    assert shown["gang"]["queue"] == "all" and shown["gang"]["priority"] == "normal"
    assert shown["brief"]["position"] is None and shown["small"]["estimated_start"] is None
    assert small.state == JobState.PENDING and small.message.startswith("waiting behind gang-")
    # ends before the gang could start: it runs meanwhile (backfill)
    assert brief.state == JobState.SCHEDULED
    _run(coord, brief)
    for j in (running, brief):
        for t in j.tasks:
            report(coord, _sessions(coord), t, TaskState.SUCCEEDED)
    coord.tick()
    assert gang.state == JobState.SCHEDULED and small.state == JobState.PENDING


def test_a_kept_room_stays_with_its_job_when_the_order_changes(tmp_path):
    """The head that does not fit keeps its room in the passes after, wherever the order puts
    it: a job that comes first later gets a room of its own on the agents left (none here), a
    job of its class keeps off the kept room, one of a higher class does not."""
    coord, clock = _one_queue(tmp_path, "abcd")
    running = coord.submit(spec("running", workers=2,
                                training={"steps": 1000, "time_limit": "10m"}), owner="alice")
    coord.tick()
    _run(coord, running)
    report(coord, _sessions(coord), running.tasks[0], TaskState.RUNNING, step=1,
           total_steps=1000, loss=1.0, first_step_time=clock.now)
    clock.now += 5
    coord.tick()  # alice has used the cluster for a while now
    gang = coord.submit(spec("gang", workers=4), owner="alice")
    coord.tick()
    assert gang.state == JobState.PENDING and "its room is kept" in gang.message
    clock.now += 1
    # bob has used nothing: his job comes first in the order now, and does not fit either
    first = coord.submit(spec("first", workers=3, data={"source": "digits", "batch_size": 60}),
                         owner="bob")
    clock.now += 1
    small = coord.submit(spec("small", workers=1), owner="carol")  # would fit a free agent
    coord.tick()
    shown = {j.name: job_to_json(j) for j in (gang, first, small)}
    assert shown["first"]["position"] == 1 and shown["gang"]["position"] == 3
    assert first.state == JobState.PENDING and "room is kept" not in first.message
    assert shown["gang"]["estimated_start"] == pytest.approx(clock.now + 593, abs=3)
    assert small.state == JobState.PENDING
    assert small.message.startswith(f"waiting behind {gang.id}, the job ahead of it")
    # a job of a higher class is not held back by the kept room of a lower one
    urgent = coord.submit(spec("urgent", workers=1, priority="high"), owner="carol")
    coord.tick()
    assert urgent.state == JobState.SCHEDULED
    # the gang starts once the jobs on its room end; its room is given up, the next job's kept
    _run(coord, urgent)
    for j in (running, urgent):
        for t in j.tasks:
            report(coord, _sessions(coord), t, TaskState.SUCCEEDED)
    coord.tick()
    assert gang.state == JobState.SCHEDULED and gang.id not in coord._kept
    coord.tick()
    assert list(coord._kept) == [first.id] and "its room is kept" in first.message


def test_a_job_that_would_take_a_kept_room_starts_elsewhere(tmp_path):
    coord, clock = _one_queue(tmp_path, "abcdef")
    running = coord.submit(spec("running", workers=3, data={"source": "digits", "batch_size": 60},
                                training={"steps": 1000, "time_limit": "10m"}))
    coord.tick()
    gang = coord.submit(spec("gang", workers=4))
    coord.tick()
    room = coord._kept[gang.id][0].agents
    assert len(room) == 4 and {t.worker for t in running.tasks} < room
    # the best fit for each is the free agent of the gang's room; two are outside it (a job of a
    # higher class, which the room does not hold back, goes there too while it can)
    smalls = [coord.submit(spec("urgent", workers=1, priority="high")),
              coord.submit(spec("small", workers=1))]
    coord.tick()
    assert all(j.state == JobState.SCHEDULED and j.tasks[0].worker not in room for j in smalls)
    other = coord.submit(spec("other", workers=1))  # none is left outside it
    coord.tick()
    assert other.state == JobState.PENDING and other.message.startswith(
        f"waiting behind {gang.id}")
