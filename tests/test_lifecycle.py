"""Cluster lifecycle with real processes: jobs before agents, coordinator restarts, `strata up`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import spec, task_processes, wait_until
from strata.client import Client
from strata.cpukernels import detect
from strata.local import LocalCluster
from strata.types import JobState

pytestmark = pytest.mark.integration


def test_job_waits_for_agents_then_runs_and_survives_coordinator_restart(tmp_path):
    c = LocalCluster(workers=0, memory_budget="1GiB", state_dir=str(tmp_path), threads=1)
    try:
        c.start_coordinator()
        with c.client() as client:
            job = client.submit(spec(name="early", training={"steps": 10}))
            time.sleep(1.5)
            j = client.get(job.id)
            assert j.state == JobState.PENDING and "waiting for 2 workers" in j.message
            c.add_worker("worker-0")
            time.sleep(1.0)
            assert client.get(job.id).state == JobState.PENDING  # gang: one agent is not enough
            c.add_worker("worker-1")
            final = client.wait(job.id, timeout=180)
            assert final.state == JobState.SUCCEEDED, final.message
            cancelled = client.submit(spec(name="never", workers=2, training={"steps": 1_000_000},
                                           memory={"per_task_budget": "1GiB"}))
            client.submit(spec(name="second", training={"steps": 1}))
            client.cancel(cancelled.id)
            before = {j.id: j.state for j in client.jobs()}
        c.stop_coordinator()
        c.start_coordinator()  # same --state-dir and port
        with c.client() as client:
            after = {j.id: j.state for j in client.jobs()}
            assert set(after) == set(before)
            assert after[job.id] == JobState.SUCCEEDED and after[cancelled.id] == JobState.CANCELLED
            assert client.get(job.id).metrics.test_accuracy == final.metrics.test_accuracy
            # The agents find the restarted coordinator by themselves.
            wait_until(lambda: {w.state.value for w in client.workers()} <= {"READY", "BUSY"}
                       and len(client.workers()) == 2, 30, what="agents re-registered")
            events = [e.message for e in client.watch(job.id) if e.seq]
            assert any("SUCCEEDED" in m for m in events)
    finally:
        c.stop()


def test_strata_up_starts_and_stops_everything(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "up", "--workers", "2",
                             "--memory-budget", "512MiB", "--listen", "127.0.0.1:0",
                             "--state-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = ""
        deadline = time.monotonic() + 60
        while "coordinator" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
        address = line.split("coordinator ", 1)[1].split(",", 1)[0]
        r = subprocess.run([sys.executable, "-m", "strata.cli", "workers", "--json",
                            "--coordinator", address], capture_output=True, text=True, timeout=30)
        workers = json.loads(r.stdout)
        assert len(workers) == 2 and all(w["memory"]["budget_bytes"] == 512 << 20 for w in workers)
        assert {w["state"] for w in workers} == {"READY"}
        # each agent told its CPU kernels, as TensorFlow decides them on this host
        assert {w["cpu_kernels"] for w in workers} == {detect()}
        with Client(address) as client:
            job = client.submit(spec(name="under-up", training={"steps": 1_000_000}))
            wait_until(lambda: client.get(job.id).state == JobState.RUNNING, 120, what="RUNNING")
        children = _descendants(proc.pid)
        assert len(children) >= 5  # coordinator, 2 agents, 2 task processes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        wait_until(lambda: not any(_alive(p) for p in children), 15, what="children gone")
        assert not task_processes(job.id)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().split(") ", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for c in children.get(stack.pop(), []):
            out.append(c)
            stack.append(c)
    return out


def test_killed_agent_is_lost_and_its_job_fails(tmp_path):
    c = LocalCluster(workers=2, memory_budget="1GiB", state_dir=str(tmp_path), threads=1,
                     heartbeat_timeout_s=3)
    try:
        c.start()
        with c.client() as client:
            job = client.submit(spec(name="victim", training={"steps": 1_000_000}))
            wait_until(lambda: client.get(job.id).state == JobState.RUNNING, 120, what="RUNNING")
            t0 = time.monotonic()
            c.kill_worker("worker-1", signal.SIGKILL)
            final = client.wait(job.id, timeout=30)
            took = time.monotonic() - t0
            # Either the heartbeat timeout fires first ("lost"), or the survivor's collective
            # fails first when the orphaned task dies: both fail the job at once.
            assert final.state == JobState.FAILED, final.message
            assert took < 3 + 5, f"job failed only after {took:.1f} s"
            wait_until(lambda: {w.name: w.state.value for w in client.workers()}["worker-1"] == "LOST",
                       15, what="worker-1 LOST")
            # The orphaned task notices its agent is gone; the survivor's agent stops the other.
            wait_until(lambda: not task_processes(job.id), 30, what="no task process left")
            wait_until(lambda: {w.name: w.state.value for w in client.workers()}["worker-0"] == "READY",
                       15, what="worker-0 idle")
    finally:
        c.stop()
