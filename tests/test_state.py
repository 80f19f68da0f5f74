"""``ClusterState``: every change through its methods keeps the derived indexes equal to a scan
(``check``), and ``check`` sees an index that drifted. The state runs on a real SQLite store;
no coordinator, no event loop."""

from __future__ import annotations

import random

import pytest

from strata.coordinator.agents import Agents, Needs
from strata.coordinator.jobtable import JobTable
from strata.coordinator.placement import TaskDemand, place
from strata.coordinator.state import ClusterState, is_over
from strata.coordinator.store import SqliteStore, WorkerRecord
from strata.types import Job, JobState, Task, TaskState
from strata.units import GiB, MiB


@pytest.fixture
def state(tmp_path):
    store = SqliteStore(str(tmp_path / "state.db"))
    yield ClusterState(JobTable(store), Agents([], 0.0))
    store.close()


_pids = iter(range(100, 1 << 30))


def _register(state: ClusterState, name: str, budget: int, ports: list[int],
              draining: bool = False):
    """An agent process (a new one each time, after the old one's silence: its budget may
    differ) registers."""
    pid = next(_pids)
    live = state.agents.register(WorkerRecord(name=name, address="127.0.0.1", device="CPU",
                                              budget_bytes=budget), pid, ports, 0.0,
                                 100.0 * pid, 10.0)
    state.agent_registered(live, draining)
    return live


def _job(i: int, tasks: int, budget: int) -> Job:
    job = Job(id=f"j{i}", name=f"j{i}", state=JobState.PENDING, strategy="multi_worker_mirrored",
              spec=None,
              created_at=float(i % 7), message="")
    job.tasks = [Task(job_id=job.id, role="worker", index=k, memory_budget_bytes=budget)
                 for k in range(tasks)]
    return job


def _place(state: ClusterState, job: Job) -> bool:
    placement = state.room.place([TaskDemand(t.role, t.index, t.memory_budget_bytes)
                                  for t in job.tasks])
    if not placement.assignments:
        return False
    for t in job.tasks:
        state.place_task(t, state.agents.workers[placement.assignments[(t.role, t.index)]])
        state.set_task_state(t, TaskState.STARTING)
    job.state = JobState.SCHEDULED
    return True


def _end(state: ClusterState, job: Job, target: JobState) -> None:
    for t in job.tasks:
        if not t.state.final:
            state.set_task_state(t, TaskState.CANCELLED if target == JobState.CANCELLED
                                 else TaskState.SUCCEEDED)
    job.state, job.finished_at = target, 100.0
    state.job_ended(job)


def test_random_changes_keep_every_index_equal_to_a_scan(state):
    rng = random.Random(11)
    names = [f"w{i}" for i in range(6)]
    jobs: list[Job] = []
    retired: set[str] = set()
    for step in range(600):
        op = rng.random()
        name = rng.choice(names)
        live = state.agents.get(name)
        if op < 0.12 or live is None:
            _register(state, name, rng.choice([GiB // 2, GiB, 2 * GiB]),
                      [7000 + 10 * names.index(name) + i for i in range(rng.randint(0, 4))],
                      draining=rng.random() < 0.1)
        elif op < 0.3 and live.session:
            state.ports_offered(live, [7000 + 10 * names.index(name) + i
                                       for i in range(rng.randint(0, 5))])
        elif op < 0.45:
            job = _job(len(jobs), rng.randint(1, 3), rng.choice([128, 300, 700]) * MiB)
            state.add_job(job)
            jobs.append(job)
        elif op < 0.6 and jobs:
            job = rng.choice(jobs)
            if job.state == JobState.PENDING:
                _place(state, job)
        elif op < 0.75 and jobs:
            job = rng.choice(jobs)
            if not job.state.final:
                _end(state, job, rng.choice([JobState.SUCCEEDED, JobState.CANCELLED]))
        elif op < 0.8 and live.session:
            state.agent_draining(live)
        elif op < 0.87 and live.session:
            state.agent_lost(live)
        elif op < 0.9 and live.lost and live.session:
            state.agent_back(live)
        elif op < 0.95:
            retired |= state.retire_over()
        else:
            for job_id in state.due_for_deletion(200.0, 10.0):
                state.forget_job(job_id)
        state.check()
        # the kept room places as a fresh scan does
        demands = [TaskDemand("worker", i, rng.choice([128, 300, 700]) * MiB) for i in range(2)]
        scanned = state.agents.capacities(state.reserved_scan())
        assert state.room.place(demands) == place(demands, scanned), step
        assert [j.id for j in state.ordered()] == \
            [j.id for j in sorted(state.live.values(), key=lambda j: (j.created_at, j.id))]
    assert len(retired) > 10 and all(is_over(j) for j in jobs if j.id in retired)
    assert sum(bool(t.worker) for j in jobs for t in j.tasks) > 20


def test_check_sees_each_index_that_drifted(state):
    live = _register(state, "w0", GiB, [7000, 7001])
    _register(state, "w1", GiB, [7100])
    job = _job(1, 2, 100 * MiB)
    state.add_job(job)
    assert _place(state, job)
    state.check()

    def drifted(change, undo, what: str) -> None:
        change()
        with pytest.raises(AssertionError) as e:
            state.check()
        assert what in str(e.value)
        undo()
        state.check()

    drifted(lambda: state.reservations.__setitem__("w0", 1),
            lambda: state.reservations.__setitem__("w0", 100 * MiB), "reservations")
    drifted(lambda: state.ports_held["w0"].add("9999"),
            lambda: state.ports_held["w0"].discard("9999"), "ports held")
    drifted(lambda: state.room.drop("w0"), lambda: state.refresh("w0"), "room")
    drifted(lambda: state.live.pop(job.id), lambda: state.live.__setitem__(job.id, job),
            "not over but not live")
    state.whole_offers(Needs())
    old = live.record.budget_bytes
    drifted(lambda: setattr(live.record, "budget_bytes", 3 * GiB),
            lambda: setattr(live.record, "budget_bytes", old), "room")


def test_a_task_that_ends_gives_back_its_budget_and_port_and_a_job_over_leaves_live(state):
    live = _register(state, "w0", GiB, [7000, 7001])
    job = _job(1, 1, 300 * MiB)
    state.add_job(job)
    assert _place(state, job)
    assert state.reservations == {"w0": 300 * MiB} and state.ports_held["w0"] == {"7000"}
    assert live.free_ports == [7001] and state.room.get("w0").free_bytes == GiB - 300 * MiB
    # a heartbeat that still offers a port a task took does not give it out again
    state.ports_offered(live, [7000, 7001, 7002])
    assert live.free_ports == [7001, 7002]
    other = _job(2, 1, 200 * MiB)
    state.add_job(other)
    assert _place(state, other) and other.tasks[0].address == "127.0.0.1:7001"
    state.set_task_state(job.tasks[0], TaskState.SUCCEEDED)
    assert state.reservations == {"w0": 200 * MiB} and state.ports_held["w0"] == {"7001"}
    assert state.retire_over() == set() and job.id in state.live  # a task still runs
    _end(state, job, JobState.SUCCEEDED)
    assert state.retire_over() == {job.id} and job.id not in state.live
    assert state.reservations == {"w0": 200 * MiB} and job.id in state.jobs
    assert state.due_for_deletion(105.0, 10.0) == [] and state.due_for_deletion(111.0, 10.0) == [job.id]
    state.check()
