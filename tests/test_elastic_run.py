"""An elastic job for real: it starts 2 wide on the two agents there are, grows to 4 when two
more join, shrinks back to 2 when one of them is drained with notice, and ends SUCCEEDED at
exactly its step count; every example of every epoch is trained on exactly once, counted from
what the task processes' inputs made (``STRATA_TRACE_EXAMPLES``), in one order whatever the
width."""

from __future__ import annotations

import collections
import glob
import os
import re

import pytest

from strata.local import LocalCluster
from strata.types import JobState

from conftest import spec, wait_until

pytestmark = pytest.mark.integration

#: long enough to outlast two agents' start, the 10 s settle and a resize, on a quiet machine
#: too (3,000 ended 2 wide before the job grew once)
STEPS = 5000
BATCH = 64
DIGITS_TRAIN = 1437  # the digits split's training rows (strata.worker.data)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    trace = str(tmp_path_factory.mktemp("trace"))
    # in the environment of every agent started while it runs, and so of their tasks
    os.environ["STRATA_TRACE_EXAMPLES"] = trace
    c = LocalCluster(workers=2, memory_budget="1GiB", threads=1, heartbeat_timeout_s=6,
                     state_dir=str(tmp_path_factory.mktemp("elastic")))
    try:
        c.start()
        yield c, trace
    finally:
        c.stop()
        del os.environ["STRATA_TRACE_EXAMPLES"]


def global_batches(trace: str, job_id: str, steps: int) -> list[list[int]]:
    """Each step's global batch as the inputs made it: for each step, the shares of the last
    attempt that made it (a batch made ahead of a stop is made again after it), in worker
    order."""
    made: dict[int, dict[int, dict[int, list[int]]]] = collections.defaultdict(dict)
    for path in glob.glob(os.path.join(trace, f"{job_id}-r*-w*.txt")):
        attempt = int(re.search(r"-r(\d+)-w", path).group(1))
        with open(path) as f:
            for line in f:
                step, who, rows = line.split()
                worker, width = (int(v) for v in who.split("-of-"))
                made[int(step)].setdefault(attempt, {})[worker] = [int(r) for r in rows.split(",")]
    out = []
    for step in range(steps):
        assert step in made, f"no input made step {step}"
        shares = made[step][max(made[step])]
        assert sorted(shares) == list(range(len(shares))), (step, sorted(shares))
        out.append([r for w in sorted(shares) for r in shares[w]])
    return out


def test_an_elastic_job_grows_to_four_shrinks_to_two_and_sees_each_example_once(traced):
    cluster, trace = traced
    with cluster.client() as client:
        job = client.submit(spec(
            name="elastic", workers={"min": 2, "max": 4}, training={"steps": STEPS},
            model={"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [128],
                               "classes": 10}},
            data={"source": "digits", "batch_size": BATCH},
            restart={"max_restarts": 2, "backoff_s": 1}))
        assert job.recovery.workers_now == 2  # the two agents there are
        wait_until(lambda: client.get(job.id).metrics.step >= 10, 120, interval=0.2,
                   what="10 steps at 2 wide")
        cluster.add_worker("w3")
        cluster.add_worker("w4")

        def wide(n: int, after: int):
            j = client.get(job.id)
            assert not j.state.final, j.message
            return j if (j.state == JobState.RUNNING and len(j.tasks) == n
                         and j.metrics.step > after) else None
        grown = wait_until(lambda: wide(4, 0), 120, interval=0.3, what="4 wide")
        grown = wait_until(lambda: wide(4, grown.metrics.step + 50), 120, interval=0.2,
                           what="steps at 4 wide")
        client.drain("w4", deadline_s=30)
        wait_until(lambda: wide(2, grown.metrics.step + 50), 120, interval=0.3,
                   what="2 wide again")
        final = client.wait(job.id, timeout=300)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.step == STEPS
    assert final.recovery.resizes == 2 and final.recovery.workers_now == 2
    assert final.steps_repeated <= 2, final.steps_repeated  # one step at most per notice
    with cluster.client() as client:
        events = [e for e in client.watch(job.id) if e.seq]
    resized = [e.message for e in events if e.kind == "resized"]
    assert any("2 -> 4 workers" in m for m in resized), resized
    assert any("4 -> 2 workers" in m for m in resized), resized
    assert sum("running" in m and "wide" in m for m in resized) == 2, resized

    # each epoch, in the one order, is every training row exactly once
    stream = [r for batch in global_batches(trace, job.id, STEPS) for r in batch]
    epochs = len(stream) // DIGITS_TRAIN
    assert epochs >= 100
    for e in range(epochs):
        seen = collections.Counter(stream[e * DIGITS_TRAIN:(e + 1) * DIGITS_TRAIN])
        assert len(seen) == DIGITS_TRAIN and max(seen.values()) == 1, e
