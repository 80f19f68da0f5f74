"""Shared helpers for the integration tests: a real local cluster on loopback."""

from __future__ import annotations

import os
import time

import pytest

# Every coordinator the tests start, in this process or as a child, checks the indexes its
# state keeps against a full scan after each tick (ClusterState.check).
os.environ.setdefault("STRATA_CHECK_STATE", "1")

from strata.local import LocalCluster  # noqa: E402

# A small seed-shaped MLP on the digits data that reaches >= 0.90 test accuracy quickly.
DIGITS_SPEC = {
    "name": "digits-mlp",
    "strategy": "multi_worker_mirrored",
    "workers": 2,
    "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256], "classes": 10}},
    "data": {"source": "digits", "batch_size": 256},
    "training": {"epochs": 10, "optimizer": {"name": "adam", "learning_rate": 0.001}},
}


def spec(**overrides):
    import copy

    out = copy.deepcopy(DIGITS_SPEC)
    for key, value in overrides.items():
        node = out
        parts = key.split("__")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _processes(*needles: str) -> list[int]:
    """PIDs of live (not zombie) processes whose command line contains every needle."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    continue  # a zombie holds no memory and runs nothing
        except OSError:
            continue
        if all(n in cmd for n in needles):
            pids.append(int(entry))
    return pids


def task_processes(marker: str) -> list[int]:
    """PIDs of live processes whose command line contains ``worker.task`` and ``marker``."""
    return _processes("worker.task", marker)


def warm_processes(imported: bool = False) -> list[int]:
    """PIDs of the agents' warm task processes (``strata.worker.warm``); ``imported``: only
    those that are ready, their imports done (each marks itself with ``PID.ready`` in its
    working directory)."""
    from strata.worker.warm import ready_mark

    def ready(pid: int) -> bool:
        try:
            return os.path.exists(ready_mark(os.readlink(f"/proc/{pid}/cwd"), pid))
        except OSError:
            return False
    return [p for p in _processes("strata.worker.warm") if not imported or ready(p)]


def wait_until(predicate, timeout: float, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class Clock:
    """A manual clock for the coordinator's logic driven tick by tick."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def env(tmp_path):
    """A coordinator on a real SQLite store with a manual clock (no processes):
    ``(coordinator, clock, store, tmp_path)``."""
    from strata.coordinator.core import Coordinator
    from strata.coordinator.store import SqliteStore

    clock = Clock()
    store = SqliteStore(str(tmp_path / "s.db"))
    coord = Coordinator(store, str(tmp_path), heartbeat_timeout_s=10, clock=clock,
                        monotonic=clock)
    return coord, clock, store, tmp_path


def queued(coord, name):
    """The commands queued for agent ``name``, taken off its queue."""
    q = coord.workers[name].queue
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One coordinator and two 1 GiB agents, shared by the tests of a module."""
    c = LocalCluster(workers=2, memory_budget="1GiB", state_dir=str(tmp_path_factory.mktemp("cluster")),
                     threads=1, heartbeat_timeout_s=10)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    with cluster.client() as c:
        yield c
