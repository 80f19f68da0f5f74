"""Warm task processes (--warm-pool): a task handed to a process that imported TensorFlow in
advance still gets its own budget (the allocator's limit is set before the CPU device exists),
its own cluster, and ends like a cold one; the pool refills; the agent stops what it started."""

from __future__ import annotations

import os
import time

import pytest

from strata.local import LocalCluster
from strata.types import FailureKind, JobState
from strata.worker.warm import ready_mark

from conftest import spec, wait_until, warm_processes

pytestmark = pytest.mark.integration


def agent_log(cluster, name: str) -> str:
    with open(os.path.join(cluster.log_dir, f"{name}.log")) as f:
        return f.read()


def test_a_warm_task_keeps_its_budget_and_the_pool_refills(tmp_path):
    c = LocalCluster(workers=2, memory_budget="1GiB", state_dir=str(tmp_path), threads=1,
                     warm_pool=1)
    c.start()
    try:
        ready = wait_until(lambda: (lambda got: got if len(got) >= 2 else None)(
            warm_processes(imported=True)), 120, what="two warm processes with TensorFlow imported")
        marks = [ready_mark(os.readlink(f"/proc/{pid}/cwd"), pid) for pid in ready]
        assert all(os.path.exists(m) and m.startswith(str(tmp_path)) for m in marks), marks
        with c.client() as client:
            # over its slice: the limit the agent handed over after the import is enforced
            tight = client.wait(client.submit(spec(name="warm-tight",
                                                   memory={"per_task_budget": "12MiB"},
                                                   training={"steps": 20})).id, timeout=180)
            assert tight.state == JobState.FAILED, tight.message
            assert any(t.failure == FailureKind.OOM for t in tight.tasks), \
                [(t.failure, t.message) for t in tight.tasks]
            assert "12 MiB" in tight.message or "out of memory" in tight.message
            logs = agent_log(c, "worker-0") + agent_log(c, "worker-1")
            assert "warm, budget 12 MiB" in logs, logs[-3000:]
            # the processes that took the tasks were the warm ones: they are gone once the job's
            # other task has been stopped (the job ends FAILED as soon as the OOM is reported)
            wait_until(lambda: not set(ready) & set(warm_processes()), 30,
                       what="the warm processes that took the tasks to end")
            # refilled, and the next job (2 workers: its cluster handed over too) succeeds warm
            wait_until(lambda: len(warm_processes(imported=True)) >= 2, 120,
                       what="the pool refilled")
            ok = client.wait(client.submit(spec(name="warm-ok", training={"steps": 30})).id,
                             timeout=180)
            assert ok.state == JobState.SUCCEEDED, ok.message
            assert len({t.weights_sha256 for t in ok.tasks}) == 1  # one model, two replicas
            assert agent_log(c, "worker-0").count(", warm, budget") >= 2
    finally:
        c.stop()
    time.sleep(0.5)
    assert not warm_processes()  # the agents stopped every process they started
    # and no process is left marked ready
    import glob

    marks = glob.glob(str(tmp_path / "**" / "warm" / "*.ready"), recursive=True)
    assert not marks, marks
