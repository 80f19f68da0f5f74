"""The shared cluster's scheduler for real: two teams' queues on a 4-agent local cluster, their
members named by the groups of the coordinator's token file. A high-priority job preempts a
low-priority one, which saves a checkpoint on notice, waits, and resumes to end at exactly its
step count; a 4-wide gang waiting behind a running job starts before a stream of 1-worker jobs
that would fit beside that job overtakes it (its room is kept)."""

from __future__ import annotations

import os
import time

import pytest

from strata.client import Client
from strata.local import LocalCluster
from strata.types import JobState

from conftest import spec, wait_until

pytestmark = pytest.mark.integration

QUEUES = """
queues:
  - name: team-a
    members: [group:team-a]
    nominal: {workers: 2}
    borrow: {workers: 2}
  - name: team-b
    members: [group:team-b]
    nominal: {workers: 2}
    borrow: {workers: 2}
priority_classes: {low: 0, normal: 100, high: 1000}
"""
MLP = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64], "classes": 10}}


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    state = str(tmp_path_factory.mktemp("teams"))
    path = os.path.join(state, "queues.yaml")
    with open(path, "w") as f:
        f.write(QUEUES)
    c = LocalCluster(workers=4, memory_budget="1GiB", threads=1, tls=True, state_dir=state,
                     heartbeat_timeout_s=8, coordinator_args=["--queues", path])
    try:
        c.start()
        tokens = {"alice": c._new_token("submitter", "alice", ["team-a"]),
                  "bob": c._new_token("submitter", "bob", ["team-b"])}
        time.sleep(0.5)  # the SIGHUP that loads them

        def client(name: str) -> Client:
            return Client(c.address, tls=c.client_tls(), token=tokens[name])
        yield c, client
    finally:
        c.stop()


def _job(name: str, workers: int, steps: int, **extra) -> dict:
    return spec(name=name, workers=workers, model=MLP, training={"steps": steps},
                restart={"max_restarts": 1, "backoff_s": 1},
                memory={"per_task_budget": "600MiB"}, **extra)  # a task per agent


def test_a_high_priority_job_preempts_a_low_one_which_resumes_at_its_step(teams):
    cluster, client = teams
    steps = 1500
    with client("alice") as alice, cluster.client() as admin:
        low = alice.submit(_job("low", 4, steps, priority="low"))
        assert alice.get(low.id).spec.queue == "team-a"  # her group's; it borrows 2 of team-b's
        wait_until(lambda: alice.get(low.id).metrics.step >= 100, 180, interval=0.2,
                   what="the low job's first 100 steps")
        high = alice.submit(_job("high", 2, 200, priority="high"))
        # team-a holds its 4: only stopping its own low job makes room, which saves first
        saved = wait_until(lambda: (lambda j: j if j.recovery.preemptions else None)(
            alice.get(low.id)), 60, interval=0.2, what="the preemption")
        done = alice.wait(high.id, timeout=180)
        assert done.state == JobState.SUCCEEDED, done.message
        final = alice.wait(low.id, timeout=300)
        events = [e for e in admin.watch(low.id) if e.seq]
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.step == steps and final.recovery.preemptions == 1
    preempted = [e for e in events if e.kind == "preempted"]
    assert preempted and f"preempted by {high.id}" in preempted[0].message
    assert "saves a checkpoint after step" in preempted[0].message, preempted[0].message
    # it resumed from the checkpoint saved on notice: no step trained twice
    assert final.restarts == 1 and final.steps_repeated <= 1, (final.restarts,
                                                                final.steps_repeated)
    assert final.checkpoint_step >= saved.metrics.step
    # the high job ran while the low one waited: it started after the notice and ended
    # before the low one started again
    restarted = [e for e in events if e.kind == "restart"]
    assert restarted and done.started_at >= restarted[0].time


def test_a_large_gang_is_not_overtaken_by_a_stream_of_small_jobs(teams):
    cluster, client = teams
    with client("bob") as bob:
        long = bob.submit(_job("long", 2, 1500))
        wait_until(lambda: bob.get(long.id).metrics.step >= 50, 180, interval=0.2,
                   what="the running job's first steps")
        gang = bob.submit(_job("gang", 4, 100))
        small = []
        started = None
        deadline = time.monotonic() + 240
        # a stream of 1-worker jobs, each fitting the two agents the running job leaves
        while started is None and time.monotonic() < deadline:
            small.append(bob.submit(_job(f"small{len(small)}", 1, 100)))
            time.sleep(2.0)
            g = bob.get(gang.id)
            assert not g.state.final or g.state == JobState.SUCCEEDED, g.message
            if g.started_at or g.state in (JobState.SCHEDULED, JobState.RUNNING,
                                           JobState.SUCCEEDED):
                started = g
        assert started is not None, "the gang never started while small jobs kept coming"
        gang_done = bob.wait(gang.id, timeout=180)
        smalls = [bob.wait(j.id, timeout=240) for j in small]
        bob.wait(long.id, timeout=240)
    assert gang_done.state == JobState.SUCCEEDED, gang_done.message
    # none of the small jobs, all submitted after the gang, started before it
    assert all(s.state == JobState.SUCCEEDED for s in smalls), [s.message for s in smalls]
    first_small = min(s.started_at for s in smalls)
    assert gang_done.started_at <= first_small, (gang_done.started_at, first_small)
