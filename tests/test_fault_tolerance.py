"""Jobs survive failures, for real: SIGKILL of a task process, of an agent and of the
coordinator mid-job, a drain, and a retried submit; each job ends SUCCEEDED at exactly its
planned step count, with its restarts recorded and at most one checkpoint interval of work
trained again.

One local cluster of three 1 GiB agents (two for a job, one spare) serves the module; the
heartbeat timeout is short (4 s) so that a lost agent is noticed quickly. Jobs are the digits
MLP, long enough (~10-20 s of training on 2 cores) to be killed mid-run after their first
checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from strata.local import LocalCluster
from strata.types import JobState

from conftest import spec, task_processes, wait_until

pytestmark = pytest.mark.integration

EVERY = 100          # checkpoint.every_steps
WAIT_S = 240         # any one job, restarts included
# a one-worker job runs no collectives: ~700 steps/s of this model here, against ~120 for two
SOLO_STEPS = 12000


@pytest.fixture(scope="module")
def ft(tmp_path_factory):
    c = LocalCluster(workers=3, memory_budget="1GiB", threads=1, heartbeat_timeout_s=4,
                     state_dir=str(tmp_path_factory.mktemp("ft")))
    c.start()
    yield c
    c.stop()


def job_spec(name: str, strategy: str = "multi_worker_mirrored", steps: int = 2000,
             batch: int = 64, every: int = EVERY, **kw):
    extra = {"multi_worker_mirrored": {"workers": 2},
             "parameter_server": {"workers": 1, "parameter_servers": 1},
             "pipeline": {"workers": 1, "stages": 2, "microbatches": 2}}[strategy]
    return spec(name=name, strategy=strategy, training={"steps": steps},
                model={"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 256],
                                   "classes": 10}},
                data={"source": "digits", "batch_size": batch},
                checkpoint={"every_steps": every, "keep": 2},
                restart={"max_restarts": 2, "backoff_s": 1}, **{**extra, **kw})


def after_first_checkpoint(client, job_id: str):
    """Waits until the job has checkpointed and trained past it (killing then repeats work)."""
    j = wait_until(lambda: (lambda j: j if j.state.final or (
        j.checkpoint_step >= EVERY and j.metrics.step > j.checkpoint_step) else None)(
        client.get(job_id)), 120, interval=0.2, what="a checkpoint, then more steps")
    assert not j.state.final, f"{job_id} ended before it could be disturbed: make it longer"
    return j


def task_pid(cluster: LocalCluster, job_id: str, role: str, index: int) -> int:
    pids = task_processes(f"/jobs/{job_id}/{role}-{index}/")
    assert pids, f"no process for {role}:{index} of {job_id}"
    return pids[0]


def check_resumed(client, job_id: str, steps: int, restarts: int = 1):
    final = client.wait(job_id, timeout=WAIT_S)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.step == steps  # exactly the planned count, not more, not less
    assert final.restarts == restarts
    assert 0 <= final.steps_repeated <= EVERY, final.steps_repeated
    events = [e.message for e in client.watch(job_id) if e.seq]
    assert any(m.startswith("restart 1:") for m in events), events
    assert any("resumed from the checkpoint at step" in m for m in events), events
    return final, events


@pytest.mark.parametrize("strategy,role,index", [
    ("multi_worker_mirrored", "worker", 1),
    ("parameter_server", "chief", 0),
    ("parameter_server", "ps", 0),
    ("pipeline", "worker", 0),
])
def test_killed_task_restarts_the_job_from_its_checkpoint(ft, strategy, role, index):
    steps = {"multi_worker_mirrored": 2000, "parameter_server": 3000, "pipeline": 4000}[strategy]
    with ft.client() as client:
        job = client.submit(job_spec(f"kill-{strategy[:6].replace('_', '')}-{role}", strategy, steps))
        after_first_checkpoint(client, job.id)
        os.kill(task_pid(ft, job.id, role, index), signal.SIGKILL)
        final, events = check_resumed(client, job.id, steps)
        assert any("SIGKILL" in m for m in events if m.startswith("restart 1:")), events
        wait_until(lambda: not task_processes(f"/jobs/{job.id}/"), 30, what="no task left")


def test_killed_agent_is_lost_and_its_job_recovers_on_the_spare(ft):
    with ft.client() as client:
        job = client.submit(job_spec("kill-agent"))
        j = after_first_checkpoint(client, job.id)
        victim = next(t.worker for t in j.tasks if t.index == 1)
        t0 = time.monotonic()
        ft.kill_worker(victim, signal.SIGKILL)
        wait_until(lambda: {w.name: w.state.value for w in client.workers()}[victim] == "LOST",
                   15, what=f"{victim} LOST")
        assert time.monotonic() - t0 < 4 + 5
        final, _ = check_resumed(client, job.id, 2000)
        assert victim not in {t.worker for t in final.tasks}
        # the agent comes back under its name and takes work again; nothing of it is left
        ft.add_worker(victim)
        assert {w.name: w.state.value for w in client.workers()}[victim] == "READY"
        assert not task_processes(f"/workers/{victim}/jobs/{job.id}/")


def test_coordinator_sigkill_loses_and_duplicates_nothing(ft):
    with ft.client() as client:
        running = client.submit(job_spec("crash-running", steps=2500))
        after_first_checkpoint(client, running.id)
        # a job that waits: two workers busy, it needs three
        queued = client.submit(job_spec("crash-queued", steps=300, workers=3, batch=96))
        before = {j.id for j in client.jobs()}
    pid_before = task_pid(ft, running.id, "worker", 0)
    os.killpg(ft.coordinator.pid, signal.SIGKILL)
    ft.coordinator.wait(timeout=10)
    # a submission while the coordinator is away is retried with its request id: one job
    late: dict = {}

    def submit_late():
        with ft.client() as c:
            late["job"] = c.submit(job_spec("crash-late", steps=200, workers=1), retry_s=60)
    th = threading.Thread(target=submit_late)
    th.start()
    time.sleep(3)  # the tasks train on meanwhile
    ft.start_coordinator()
    th.join(timeout=90)
    assert "job" in late
    with ft.client() as client:
        wait_until(lambda: all(w.state.value in ("READY", "BUSY") for w in client.workers()),
                   30, what="agents back")
        final = client.wait(running.id, timeout=WAIT_S)
        assert final.state == JobState.SUCCEEDED, final.message
        assert final.metrics.step == 2500 and final.restarts == 0  # it just went on
        assert pid_before not in task_processes("")  # ended by itself, not restarted
        for j in (queued, late["job"]):
            f = client.wait(j.id, timeout=WAIT_S)
            assert f.state == JobState.SUCCEEDED, f.message
        names = [j.name for j in client.jobs()]
        assert names.count("crash-late") == 1 and names.count("crash-running") == 1
        assert before | {late["job"].id} == {j.id for j in client.jobs()} & (
            before | {late["job"].id})


def test_a_notice_moves_a_job_and_trains_no_step_again(ft):
    """strata drain --deadline: both workers of a 2-worker job save at one step ahead of
    them (no periodic checkpoint is near) and stop; the job resumes there on the spare."""
    with ft.client() as client:
        job = client.submit(job_spec("notice", steps=2500, every=100000))
        j = wait_until(lambda: (lambda j: j if j.state.final or j.metrics.step >= 100 else None)(
            client.get(job.id)), 120, interval=0.2, what="100 steps")
        assert not j.state.final, j.message
        leaving = next(t.worker for t in j.tasks if t.index == 1)
        client.drain(leaving, deadline_s=30)
        final = client.wait(job.id, timeout=WAIT_S)
        assert final.state == JobState.SUCCEEDED, final.message
        assert final.metrics.step == 2500 and final.restarts == 1
        assert final.steps_repeated <= 1, final.steps_repeated
        assert leaving not in {t.worker for t in final.tasks}
        events = [e.message for e in client.watch(job.id) if e.seq]
        saved = [m for m in events if "saved on notice" in m]
        assert saved and any(m.startswith("restart 1:") for m in saved), events
        assert any("resumed from the checkpoint at step" in m for m in events), events
    # the agent leaves, and comes back under its name ready for work
    ft.kill_worker(leaving)
    ft.add_worker(leaving)


def test_drain_moves_the_job_and_places_nothing_more(ft):
    with ft.client() as client:
        job = client.submit(job_spec("drained", workers=1, steps=SOLO_STEPS))
        j = after_first_checkpoint(client, job.id)
        where = j.tasks[0].worker
        w = client.drain(where)
        assert w.state.value == "DRAINING"
        final = client.wait(job.id, timeout=WAIT_S)
        assert final.state == JobState.SUCCEEDED, final.message
        assert final.tasks[0].worker != where and final.restarts == 1
        assert final.metrics.step == SOLO_STEPS and final.steps_repeated <= EVERY
        small = client.submit(job_spec("after-drain", workers=1, steps=50))
        f = client.wait(small.id, timeout=WAIT_S)
        assert f.state == JobState.SUCCEEDED and f.tasks[0].worker != where
        # SIGTERM to an agent drains it the same way, then it exits
        job2 = client.submit(job_spec("sigterm", workers=1, steps=SOLO_STEPS))
        j2 = after_first_checkpoint(client, job2.id)
        victim = j2.tasks[0].worker
        proc = ft.agents.pop(victim)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        final2 = client.wait(job2.id, timeout=WAIT_S)
        assert final2.state == JobState.SUCCEEDED and final2.tasks[0].worker != victim
        assert final2.metrics.step == SOLO_STEPS
