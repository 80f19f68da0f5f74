"""The control plane's indexes, tick by tick: waiting jobs cost nothing until room grows and
are placed as soon as it does; the live-job set and the held ports always agree with a full
scan; finished jobs leave the hot path."""

from __future__ import annotations

from strata.coordinator import placement as placement_module
from strata.types import JobState, TaskReport, TaskState

GiB = 1 << 30
SPEC = {"name": "cp", "workers": 1,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [16], "classes": 10}},
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 100},
        "memory": {"per_task_budget": "900MiB"}}


def agree_with_a_full_scan(coord) -> None:
    over = {j.id for j in coord.jobs.values()
            if j.state.final and all(t.state.final for t in j.tasks)}
    assert set(coord.jobs) - over <= set(coord._live)
    held: dict[str, set[str]] = {}
    for j in coord.jobs.values():
        for t in j.tasks:
            if t.worker and t.address and not t.state.final:
                held.setdefault(t.worker, set()).add(t.address.rsplit(":", 1)[1])
    assert {w: p for w, p in coord._ports_held.items() if p} == held


def test_waiting_jobs_are_not_retried_until_room_grows_then_placed_at_once(env, monkeypatch):
    coord, clock, store, _ = env
    calls = []
    real = placement_module.Room.place

    def counting(room, demands):
        calls.append(len(demands))
        return real(room, demands)
    monkeypatch.setattr(placement_module.Room, "place", counting)
    s = coord.register("a", "127.0.0.1", "CPU", GiB, [5000, 5001, 5002], [], shared_dir="/s")
    first = coord.submit(SPEC)
    coord.tick()
    assert first.state == JobState.SCHEDULED
    waiting = [coord.submit(SPEC) for _ in range(50)]
    calls.clear()
    coord.tick()
    assert len(calls) == 1          # 50 identical jobs, one placement tried
    for _ in range(5):
        clock.now += 1
        coord.tick()
    assert len(calls) == 1          # nothing moved: nothing tried
    coord.heartbeat("a", s, coord.workers["a"].memory, [], [5001, 5002])  # no new room
    coord.tick()
    assert len(calls) == 1
    t = first.tasks[0]
    for state in (TaskState.RUNNING, TaskState.SUCCEEDED):
        coord.report("a", s, TaskReport(first.id, t.role, t.index, state, attempt=t.attempt,
                                        test_accuracy=0.5 if state.final else None))
    agree_with_a_full_scan(coord)
    assert first.state == JobState.SUCCEEDED, (first.state, first.message, t.state)
    coord.tick()                    # room grew: a waiting job goes at once
    states = sorted(j.state.value for j in waiting)  # one takes the room (same submit time)
    assert states == ["PENDING"] * 49 + ["SCHEDULED"]
    agree_with_a_full_scan(coord)
    # the finished job has left the hot path
    assert first.id not in coord._live and first.id in coord.jobs


def test_a_port_held_by_a_live_task_is_never_offered_again(env):
    coord, clock, store, _ = env
    s = coord.register("a", "127.0.0.1", "CPU", 4 * GiB, [5000, 5001], [], shared_dir="/s")
    job = coord.submit(SPEC)
    coord.tick()
    port = job.tasks[0].address.rsplit(":", 1)[1]
    # a heartbeat composed before the agent saw the start still offers that port
    coord.heartbeat("a", s, coord.workers["a"].memory, [], [5000, 5001])
    assert port not in {str(p) for p in coord.workers["a"].free_ports}
    # and a re-registration (a coordinator restart's reconnect) too
    coord.register("a", "127.0.0.1", "CPU", 4 * GiB, [5000, 5001], [], shared_dir="/s",
                   pid=coord.workers["a"].pid)
    assert port not in {str(p) for p in coord.workers["a"].free_ports}
    agree_with_a_full_scan(coord)
    coord.cancel(job.id)
    agree_with_a_full_scan(coord)


def test_a_restarted_coordinator_rebuilds_its_indexes_from_the_store(env, tmp_path):
    from strata.coordinator.core import Coordinator
    from strata.coordinator.store import SqliteStore

    coord, clock, store, _ = env
    coord.register("a", "127.0.0.1", "CPU", 4 * GiB, [5000, 5001, 5002], [], shared_dir="/s")
    running = coord.submit(SPEC)
    done = coord.submit(SPEC)
    coord.cancel(done.id)
    coord.tick()
    store.close()
    again = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock)
    assert running.id in again._live and done.id not in again._live
    agree_with_a_full_scan(again)


def test_a_held_up_loop_does_not_call_healthy_agents_lost(env):
    import time

    coord, clock, store, _ = env
    s = coord.register("a", "127.0.0.1", "CPU", GiB, [5000], [], shared_dir="/s")
    coord.tick()
    clock.now += 30                      # past the 10 s timeout, as after a long stall
    coord._last_tick_mono = time.monotonic() - 30
    coord.tick()                         # the stalled tick: heartbeats may still be queued
    assert not coord.workers["a"].lost
    coord.heartbeat("a", s, coord.workers["a"].memory, [], [5000])  # ... and here it is
    coord.tick()
    assert not coord.workers["a"].lost
    clock.now += 30                      # silent for real, no stall: lost
    coord.tick()
    assert coord.workers["a"].lost


def test_agents_coming_do_not_write_an_event_per_waiting_job_each(env):
    """The waiting reason's counts change with every agent that registers; only a new kind
    of reason is stored and told (a write per waiting job per registration stalled the loop)."""
    coord, clock, store, _ = env
    coord.register("big", "127.0.0.1", "CPU", 2 * GiB, [5000, 5001], [], shared_dir="/s")
    big = {**SPEC, "memory": {"per_task_budget": "1536MiB"}}
    coord.submit(big)
    coord.tick()
    waiting = [coord.submit(big) for _ in range(20)]
    coord.tick()
    before = {j.id: len(store.events(j.id)) for j in waiting}
    for i in range(30):
        coord.register(f"small-{i}", "127.0.0.1", "CPU", GiB, [6000 + i], [], shared_dir="/s")
        coord.tick()
    assert all(len(store.events(j.id)) == before[j.id] for j in waiting)
    assert "of 31 connected workers" in waiting[0].message  # the figures stay current


def test_a_restart_loads_the_live_jobs_and_the_history_when_asked(env, tmp_path):
    """History stays on disk until looked at: the restarted coordinator holds the live jobs
    as objects and the finished ones as summaries, and a finished job read back is the same
    job, tasks included."""
    import asyncio

    from strata.coordinator.core import Coordinator
    from strata.coordinator.service import JobServicer
    from strata.coordinator.store import SqliteStore
    from strata.protos import strata_pb2 as pb

    coord, clock, store, _ = env
    s = coord.register("a", "127.0.0.1", "CPU", 4 * GiB, [5000, 5001, 5002], [], shared_dir="/s")
    done = coord.submit(SPEC)
    coord.tick()
    t = done.tasks[0]
    for state in (TaskState.RUNNING, TaskState.SUCCEEDED):
        coord.report("a", s, TaskReport(done.id, t.role, t.index, state, attempt=t.attempt,
                                        test_accuracy=0.75 if state.final else None))
    assert done.state == JobState.SUCCEEDED
    cancelled = [coord.submit({**SPEC, "name": f"old-{i}"}) for i in range(30)]
    for j in cancelled:
        coord.cancel(j.id)
    running = coord.submit(SPEC)
    clock.now += 1  # older first: the running one is placed, then no room for the other
    waiting = coord.submit({**SPEC, "memory": {"per_task_budget": "3500MiB"}})
    coord.tick()
    assert running.state == JobState.SCHEDULED
    clock.now += 1
    coord.tick()
    store.close()

    again = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock)
    assert {j.id for j in again.jobs.loaded_jobs()} == {running.id, waiting.id}
    assert len(again.jobs) == 33 and done.id in again.jobs
    # agents coming back (after a coordinator restart, all at once) reconcile against the live
    # jobs: a registration loads no finished job
    again.register("a", "127.0.0.1", "CPU", 4 * GiB, [5003], [
        TaskReport(running.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt)
        for t in running.tasks], shared_dir="/s")
    again.register("b", "127.0.0.1", "CPU", 4 * GiB, [5004], [], shared_dir="/s")
    assert {j.id for j in again.jobs.loaded_jobs()} == {running.id, waiting.id}
    summaries = {x.id: x for x in again.jobs.summaries()}
    assert summaries[done.id].state == JobState.SUCCEEDED and len(summaries) == 33
    back = again.get(done.id)  # read from the store now
    assert back == done and back.tasks[0].state == TaskState.SUCCEEDED
    assert back.metrics.test_accuracy == 0.75
    assert done.id in {j.id for j in again.jobs.loaded_jobs()}
    agree_with_a_full_scan(again)

    # ListJobs pages over summaries and loads what it shows
    servicer = JobServicer(again)
    got, token = [], ""
    while True:
        resp = asyncio.run(servicer.ListJobs.__wrapped__(  # type: ignore[attr-defined]
            servicer, pb.ListJobsRequest(page_size=7, page_token=token), None))
        got += [j.id for j in resp.jobs]
        token = resp.next_page_token
        if not token:
            break
    assert got == [j.id for j in sorted([done, *cancelled, running, waiting],
                                        key=lambda j: (j.created_at, j.id))]
    assert len({j.id for j in again.jobs.loaded_jobs()}) == 33

    # retention deletes a finished job it never loaded
    again2 = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock)
    again2.retention_s = 1
    clock.now += 3600
    again2.tick()
    assert set(again2.jobs) == {running.id, waiting.id}


def test_the_status_page_loads_only_the_finished_jobs_it_shows(env, tmp_path):
    from strata.coordinator.core import Coordinator
    from strata.coordinator.store import SqliteStore
    from strata.coordinator.web import RECENT_JOBS, state_json

    coord, clock, store, _ = env
    for i in range(RECENT_JOBS + 15):
        coord.cancel(coord.submit({**SPEC, "name": f"done-{i}"}).id)
        clock.now += 1
    live = coord.submit(SPEC)
    store.close()
    again = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock)
    shown = [j["id"] for j in state_json(again)["jobs"]]
    assert shown[0] == live.id and len(shown) == 1 + RECENT_JOBS
    assert len(again.jobs.loaded_jobs()) == 1 + RECENT_JOBS


def test_heartbeat_delay_follows_waits_not_clocks():
    """The wait of heartbeats before they are handled, from the agents' own clocks: a constant
    skew is no wait; a queue that builds is; one agent whose clock jumps back cannot move the
    median; clocks drifting apart at 500 ppm for a day are followed; with nothing handled the
    last estimate holds."""
    from strata.coordinator.agents import HeartbeatDelay

    d = HeartbeatDelay()
    t = 1000.0
    for _ in range(20):  # four agents, 100 s and -50 s off, answered at once
        t += 0.25
        for name, skew in (("a", 100.0), ("b", -50.0), ("c", 0.0), ("e", 3.0)):
            d.observe(name, t, t - skew)
    assert d.estimate(t) == 0.0
    for wait in (2.0, 4.0, 6.0, 8.0, 8.0, 8.0, 8.0):  # a queue builds, then holds at 8 s
        t += 1.0
        for name, skew in (("a", 100.0), ("b", -50.0), ("c", 0.0), ("e", 3.0)):
            d.observe(name, t, t - wait - skew)
    assert 7.9 < d.estimate(t) < 8.1
    assert 7.9 < d.estimate(t + 60) < 8.1  # nothing handled since: the last estimate holds
    t += 5.0
    for name, skew in (("a", 100.0), ("b", -50.0), ("c", 0.0)):
        d.observe(name, t, t - skew)
    d.observe("e", t, t + 1e6)  # a clock thrown far off
    assert d.estimate(t) < 0.1
    d.observe("e", t, 1.0)  # and far back
    assert d.estimate(t) < 0.1
    drifting = HeartbeatDelay()
    for i in range(86_400):  # a day at 1 Hz, the agent's clock 500 ppm slow
        drifting.observe("a", 1000.0 + i, 1000.0 + i * (1 - 5e-4))
    assert drifting.estimate(1000.0 + 86_399) < 0.01
    assert HeartbeatDelay().estimate(5.0) == 0.0


def test_a_silent_agent_is_judged_after_the_wait_heartbeats_see(env):
    """While the heartbeats the coordinator handles had waited 8 s (a registration burst in
    front of them), an agent silent for 12 s is not lost (10 s timeout + 8 s); once they come
    through without waiting, it is."""
    coord, clock, _, _ = env
    sa = coord.register("a", "127.0.0.1", "CPU", GiB, [5000], [])
    coord.register("b", "127.0.0.1", "CPU", GiB, [6000], [])
    mem = coord.workers["a"].memory
    coord.heartbeat("a", sa, mem, [], [5000], sent_at=clock.now - 7.0)  # the agent's clock
    for _ in range(12):
        clock.now += 1
        coord.heartbeat("a", sa, mem, [], [5000], sent_at=clock.now - 7.0 - 8.0)
        coord.tick()
    assert not coord.workers["b"].lost
    for _ in range(3):  # the queue drained
        clock.now += 1
        coord.heartbeat("a", sa, mem, [], [5000], sent_at=clock.now - 7.0)
    coord.tick()
    assert coord.workers["b"].lost and not coord.workers["a"].lost
