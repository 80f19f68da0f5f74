"""The control plane's indexes, tick by tick: waiting jobs cost nothing until room grows and
are placed as soon as it does; the live-job set and the held ports always agree with a full
scan; finished jobs leave the hot path."""

from __future__ import annotations

import os

import pytest

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
    assert set(coord.jobs) - over <= set(coord.state.live)
    held: dict[str, set[str]] = {}
    for j in coord.jobs.values():
        for t in j.tasks:
            if t.worker and t.address and not t.state.final:
                held.setdefault(t.worker, set()).add(t.address.rsplit(":", 1)[1])
    assert {w: p for w, p in coord.state.ports_held.items() if p} == held


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
    assert first.id not in coord.state.live and first.id in coord.jobs


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
    again = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock,
                        monotonic=clock)
    assert running.id in again.state.live and done.id not in again.state.live
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


def test_a_held_up_loop_excuses_its_time_not_a_silence_before_it(env):
    # an agent silent 8 s, then the loop held up 30 s: the stall is not counted, so a tick
    # later it is judged on 9 s (not lost), and lost once the coordinator listened for it
    # 10 s in all. (Judging the tick after a stall on the wall clock called it lost at 39 s.)
    import time

    coord, clock, store, _ = env
    coord.register("a", "127.0.0.1", "CPU", GiB, [5000], [], shared_dir="/s")
    coord.tick()
    clock.now += 8
    coord._last_tick_mono = time.monotonic()
    coord.tick()
    clock.now += 30
    coord._last_tick_mono = time.monotonic() - 30
    coord.tick()
    assert not coord.workers["a"].lost
    clock.now += 1
    coord._last_tick_mono = time.monotonic()
    coord.tick()
    assert not coord.workers["a"].lost
    clock.now += 1.5
    coord._last_tick_mono = time.monotonic()
    coord.tick()
    assert coord.workers["a"].lost


def test_a_step_of_the_wall_clock_does_not_call_agents_lost(tmp_path):
    # Agents are judged on the monotonic clock. The wall clock steps (NTP; a virtual machine
    # paused and resumed sets it forward while the monotonic one may not count the pause):
    # judged on it, every agent not heard since the step was called lost at once.
    from strata.coordinator.core import Coordinator
    from strata.coordinator.store import SqliteStore

    from conftest import Clock

    wall, mono = Clock(), Clock()
    coord = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path),
                        heartbeat_timeout_s=10, clock=wall, monotonic=mono)
    s = coord.register("a", "127.0.0.1", "CPU", GiB, [5000], [], shared_dir="/s")
    coord.tick()
    wall.now += 3600
    coord.tick()
    assert not coord.workers["a"].lost
    coord.heartbeat("a", s, coord.workers["a"].memory, [], [5000])
    assert coord.workers["a"].last_seen == wall.now  # shown to people as wall-clock time
    mono.now += 11
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
    from strata.coordinator.jobapi import JobServicer
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

    again = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock,
                        monotonic=clock)
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
    again2 = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock,
                         monotonic=clock)
    again2.retention_s = 1
    clock.now += 3600
    again2.tick()
    assert set(again2.jobs) == {running.id, waiting.id}


def test_list_workers_pages_by_name_and_builds_only_its_page(env, monkeypatch):
    """ListWorkers pages over the workers' names (by state when asked) and builds only the
    page's workers in full: the pages together are what ``list_workers`` shows, tasks and
    all."""
    import asyncio

    from strata import convert
    from strata.coordinator.jobapi import JobServicer
    from strata.protos import strata_pb2 as pb

    coord = env[0]
    for name in ("e", "a", "d", "b", "c"):
        coord.register(name, "127.0.0.1", "CPU", GiB, [5000, 5001], [], shared_dir="/s")
    coord.drain("d")
    job = coord.submit(SPEC)
    coord.tick()
    assert job.tasks[0].worker
    built: list[int] = []
    whole = coord.list_workers

    def counted(names=None):
        out = whole(names)
        built.append(len(out))
        return out
    monkeypatch.setattr(coord, "list_workers", counted)
    servicer = JobServicer(coord)

    def pages(*states: int) -> list[pb.Worker]:
        got, token = [], ""
        while True:
            resp = asyncio.run(servicer.ListWorkers.__wrapped__(  # type: ignore[attr-defined]
                servicer, pb.ListWorkersRequest(states=states, page_size=2, page_token=token),
                None))
            got += resp.workers
            token = resp.next_page_token
            if not token:
                return got
    everyone = whole()
    assert pages() == [convert.worker_to_proto(w) for w in everyone]
    assert built and max(built) <= 2
    (busy,) = pages(pb.BUSY)
    assert busy.name == job.tasks[0].worker and busy.tasks[0].job_id == job.id
    assert [w.name for w in pages(pb.DRAINING)] == ["d"]
    assert [w.name for w in whole(["c", "nobody", "a"])] == ["a", "c"]


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
    again = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path), clock=clock,
                        monotonic=clock)
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


def test_heartbeat_delay_counts_every_wait_into_its_histogram():
    """Each heartbeat handled lands in one bucket of ``strata_heartbeat_delay_seconds``: an
    agent's first is its own floor (no wait), then its waits above it; a heartbeat with no
    clock is not counted."""
    from strata.coordinator.agents import HeartbeatDelay

    d = HeartbeatDelay()
    d.observe("a", 100.0, 100.0 - 7.0)         # the floor: 7 s of clock offset, no wait
    d.observe("a", 101.0, 101.0 - 7.0 - 0.3)   # 0.3 s: the bucket from 0.25 to 0.35 s
    d.observe("a", 102.0, 102.0 - 7.0 - 40.0)  # 40 s: beyond the last bound
    d.observe("b", 102.0, 0.0)                 # not stamped
    assert sum(d.counts) == 3
    assert d.counts[0] == 1
    assert d.counts[HeartbeatDelay.BUCKETS.index(0.35)] == 1
    assert d.counts[-1] == 1
    assert d.total == pytest.approx(40.3, abs=0.01)


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


def test_call_wait_counts_from_the_first_try_until_an_answer():
    """The wait of new calls as the probe sees it: the age of the call out (tries refused
    meanwhile do not restart it), then the longest answered within the window."""
    from strata.coordinator.agents import CallWait

    w = CallWait(window_s=5.0)
    assert w.estimate(100.0) == 0.0
    w.sent(100.0)
    assert w.estimate(103.0) == 3.0
    w.sent(103.5)  # tried again
    assert w.estimate(104.0) == 4.0
    w.answered(104.0)
    w.sent(104.5)
    w.answered(104.51)
    assert w.estimate(108.9) == 4.0  # the longest answered in the last 5 s
    assert 0.0 < w.estimate(109.2) < 0.02
    assert w.estimate(110.0) == 0.0
    w.sent(110.0)
    w.dropped()  # no server to reach: not a wait
    assert w.estimate(120.0) == 0.0
    # refused at random: tries that get through between refusals do not end the episode
    for t in range(200, 230):
        w.sent(float(t))
        if t % 3:
            w.refused(float(t))
        else:
            w.answered(t + 0.01)
    w.answered(230.0)
    assert 29.9 < w.estimate(230.0) < 30.1  # since the first refusal
    assert 33.9 < w.estimate(234.0) < 34.1  # the last, 5 s ago: still in the episode
    assert w.estimate(235.1) == 0.0
    w.refused(300.0)  # a new episode
    assert w.estimate(301.0) == 1.0
    assert (w.answers, w.refusals) == (13, 21)


def test_a_silent_agent_is_judged_after_the_wait_new_calls_see(env):
    """While the probe's call has been out 8 s (new calls wait: a stream opened again, a
    unary heartbeat), an agent silent for 12 s is not lost (10 s timeout + 8 s); once the
    probe is answered and the wait has left the window, it is."""
    import time

    from strata.coordinator.agents import CallWait

    coord, clock, _, _ = env
    coord.call_wait = CallWait(window_s=0.05)
    sa = coord.register("a", "127.0.0.1", "CPU", GiB, [5000], [])
    coord.register("b", "127.0.0.1", "CPU", GiB, [6000], [])
    mem = coord.workers["a"].memory
    coord.call_wait.sent(time.monotonic() - 8.0)
    for _ in range(12):
        clock.now += 1
        coord.heartbeat("a", sa, mem, [], [5000], sent_at=clock.now)
        coord.tick()
    assert not coord.workers["b"].lost
    coord.call_wait.answered(time.monotonic())
    time.sleep(0.1)
    clock.now += coord.tick_interval_s  # agents are judged once a tick interval
    coord.tick()
    assert coord.workers["b"].lost and not coord.workers["a"].lost


class _ServerThread:
    """A grpc.aio server with the health service on its own event loop and thread, as the
    coordinator's: ``block`` holds that loop up from outside."""

    def __init__(self, options=(), setup=None):
        import asyncio
        import threading

        import grpc
        from grpc_health.v1 import health, health_pb2_grpc

        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0

        async def start():
            self.server = grpc.aio.server(options=list(options))
            self.health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            if setup is not None:
                setup(self.server)
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            self.ready.set()

        self.thread = threading.Thread(
            target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
            daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    def block(self, seconds: float) -> None:
        import time
        self.loop.call_soon_threadsafe(time.sleep, seconds)

    def stop(self) -> None:
        import asyncio
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _cluster_server(tmp_path, options=()):
    """A real ClusterService (and JobService) over a coordinator on a SQLite store, with the
    coordinator's probe socket: ``(server thread, coordinator, probe)``."""
    from strata.coordinator.agents import CallWait
    from strata.coordinator.core import Coordinator
    from strata.coordinator.clusterapi import ClusterServicer
    from strata.coordinator.jobapi import JobServicer
    from strata.coordinator.callprobe import CallProbe
    from strata.coordinator.service import add_service
    from strata.coordinator.store import SqliteStore

    coord = Coordinator(SqliteStore(str(tmp_path / "s.db")), str(tmp_path))
    probes = []

    def setup(server):
        add_service(JobServicer(coord), "JobService", server)
        add_service(ClusterServicer(coord), "ClusterService", server)
        probes.append(CallProbe(server, CallWait(window_s=60.0)))
    return _ServerThread(options=options, setup=setup), coord, probes[0]


def test_the_probe_times_new_calls_that_wait_and_those_refused(tmp_path):
    """A real grpc.aio server whose event loop is held up: the probe's heartbeat stream counts
    as waiting from its first try, whether it waits to be matched or is refused at once (too
    many heartbeat streams waiting), and is answered once the loop runs."""
    import time

    import grpc

    from strata.protos import strata_pb2_grpc as pb_grpc

    # one new call of a method may wait to be matched, and any beyond it is refused
    srv, coord, probe = _cluster_server(tmp_path, [("grpc.server.max_pending_requests", 0),
                                                   ("grpc.server.max_pending_requests_hard_limit", 1)])
    wait = probe.wait
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    held = []
    try:
        stub = pb_grpc.ClusterServiceStub(channel)
        with pytest.raises(StopIteration):  # a stream with no heartbeat ends, served
            next(stub.Heartbeats(iter([]), timeout=10))
        assert probe.bound
        srv.block(3.0)
        time.sleep(0.2)
        # agents' streams: one matched while the loop is held, one waiting
        held = [stub.Heartbeats(iter([]), timeout=30) for _ in range(2)]
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as refused:  # a third is refused, at once
            next(stub.Heartbeats(iter([]), timeout=10))
        assert refused.value.code() in (grpc.StatusCode.CANCELLED,
                                        grpc.StatusCode.RESOURCE_EXHAUSTED)
        t0 = time.monotonic()
        probe.start()  # its tries are refused while the loop is held
        time.sleep(1.8)
        assert wait.refusals >= 2 and wait.answers == 0
        assert wait.estimate(time.monotonic()) >= time.monotonic() - t0 - 0.1
        for call in held:
            with pytest.raises(StopIteration):
                next(call)
        deadline = time.monotonic() + 10
        while wait.answers == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert wait.answers >= 1  # answered once the loop ran: the wait is kept in the window
        assert wait.estimate(time.monotonic()) >= 1.7
        assert wait._refusing is not None and wait._refusing[0] >= t0
        assert not coord.workers
    finally:
        for call in held:
            call.cancel()
        channel.close()
        probe.stop()
        srv.stop()
        coord.store.close()
    assert not os.path.exists(probe.path)


def test_the_probe_socket_refuses_the_api(tmp_path):
    """The probe's Unix socket carries no credentials under TLS: every call of the job and
    cluster APIs that comes through it is refused before its handler runs, whatever the auth
    settings, and is left out of the RPC metrics."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from strata.coordinator.web import RPC_SECONDS
    from strata.protos import strata_pb2 as pb
    from strata.protos import strata_pb2_grpc as pb_grpc

    srv, coord, probe = _cluster_server(tmp_path)
    channel = grpc.insecure_channel("unix:" + probe.path)
    tcp = grpc.insecure_channel(f"127.0.0.1:{srv.port}")

    def denied() -> float:
        return sum(s.value for m in RPC_SECONDS.collect() for s in m.samples
                   if s.name.endswith("_count") and s.labels.get("code") == "PERMISSION_DENIED")
    before = denied()
    try:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        cluster = pb_grpc.ClusterServiceStub(channel)
        for call in (lambda: pb_grpc.JobServiceStub(channel).ListJobs(pb.ListJobsRequest(),
                                                                      timeout=10),
                     lambda: cluster.RegisterAgent(pb.RegisterAgentRequest(
                         name="x", host="h", budget_bytes=GiB), timeout=10),
                     lambda: next(cluster.Heartbeats(iter([pb.HeartbeatRequest(name="x")]),
                                                     timeout=10))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert not coord.workers
        assert denied() == before
        pb_grpc.JobServiceStub(tcp).ListJobs(pb.ListJobsRequest(), timeout=10)  # served there
    finally:
        channel.close()
        tcp.close()
        probe.stop()
        srv.stop()
        coord.store.close()


def test_a_registration_that_waited_past_its_deadline_is_not_kept(tmp_path):
    """An agent gave up on its registration while it waited (the coordinator's loop held up)
    and will send another: the late one registers nothing, which would otherwise be a
    schedulable session nobody heartbeats. gRPC drops such a call before its handler runs
    (a check in the handler never fired), and this keeps that so."""
    import time

    import grpc

    from strata.protos import strata_pb2 as pb
    from strata.protos import strata_pb2_grpc as pb_grpc

    srv, coord, probe = _cluster_server(tmp_path)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        stub = pb_grpc.ClusterServiceStub(channel)
        stub.RegisterAgent(pb.RegisterAgentRequest(name="early", host="h", budget_bytes=GiB),
                           timeout=10)
        srv.block(2.0)
        time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAgent(pb.RegisterAgentRequest(name="late", host="h", budget_bytes=GiB),
                               timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(2.5)  # the loop ran again, and handled or dropped the late call
        stub.RegisterAgent(pb.RegisterAgentRequest(name="after", host="h", budget_bytes=GiB),
                           timeout=10)
        assert set(coord.workers) == {"early", "after"}
    finally:
        channel.close()
        probe.stop()
        srv.stop()
        coord.store.close()


def test_without_a_writable_temp_dir_the_coordinator_serves_unprobed(monkeypatch, tmp_path):
    """No socket for the probe (no writable temp directory): the coordinator starts
    anyway, judging agents by the heartbeats it handled only."""
    import tempfile

    from strata.coordinator.agents import CallWait
    from strata.coordinator.callprobe import CallProbe

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    probe = CallProbe(None, CallWait())  # type: ignore[arg-type]  (never reached)
    assert not probe.bound and probe.path == ""
    probe.start()
    probe.stop()
    assert probe.wait.estimate(1.0) == 0.0


def test_retention_reads_the_ended_jobs_oldest_first_and_waits_for_their_tasks(env):
    """--retention deletes from the jobs that ended, oldest first (no scan of every job): a
    cancelled job whose task has not stopped yet is kept until it has; one a user deleted
    first is passed over."""
    from strata.coordinator.loop import EXPIRY_INTERVAL_S

    coord, clock, store, _ = env
    coord.retention_s = 100
    s = coord.register("a", "127.0.0.1", "CPU", 4 * GiB, [5000, 5001], [], shared_dir="/s")
    placed = coord.submit(SPEC)
    coord.tick()
    t = placed.tasks[0]
    assert t.worker == "a"
    coord.report("a", s, TaskReport(placed.id, t.role, t.index, TaskState.RUNNING,
                                    attempt=t.attempt))
    gone = coord.submit(SPEC)
    coord.cancel(gone.id)
    coord.delete(gone.id)  # by its user, before the retention
    coord.cancel(placed.id)  # ended; its task runs until the agent stops it
    clock.now += 101 + EXPIRY_INTERVAL_S
    coord.heartbeat("a", s, coord.workers["a"].memory, [], [5001])  # the agent is alive
    coord.tick()
    assert placed.id in coord.jobs
    coord.report("a", s, TaskReport(placed.id, t.role, t.index, TaskState.CANCELLED,
                                    attempt=t.attempt))
    clock.now += EXPIRY_INTERVAL_S
    coord.tick()
    assert placed.id not in coord.jobs and gone.id not in coord.jobs
    assert coord.state._ended == []
