"""The warm pool's choices, as pure logic (no TensorFlow): which process a task takes, and when
the pool refills; and the wait for a peer's port that saves a warm job's rendezvous a second."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

from strata.worker import warmpool
from strata.worker.warmpool import Warm, WarmPool
from strata.worker.cluster import reachable, wait_reachable
from strata.worker.warm import ready_mark


class CountingPool(WarmPool):
    """A pool whose processes are plain sleeping ``python`` processes (the real ``_spawn``'s
    interface: a Warm with its process, an events fd and the pool's directory)."""

    def __init__(self, size: int, work_dir: str):
        super().__init__(size, sys.executable, "CPU", work_dir)
        self.spawned = 0

    def _spawn(self) -> Warm | None:
        os.makedirs(self.dir, exist_ok=True)
        self.spawned += 1
        r, w = os.pipe()
        os.close(w)
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                start_new_session=True, stdin=subprocess.PIPE)
        return Warm(proc, r, self.dir)


def test_a_task_takes_a_ready_process_first_and_the_refill_waits_for_its_first_step(tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setattr(warmpool, "REFILL_AFTER_S", 5.0)
    pool = CountingPool(2, str(tmp_path))
    try:
        pool.fill()
        assert pool.spawned == 2
        older, newer = pool.ready
        # only the newer one has finished importing
        open(ready_mark(pool.dir, newer.proc.pid), "w").close()
        settled = threading.Event()
        got = pool.take(settled)
        assert got is newer
        time.sleep(0.5)
        assert pool.spawned == 2, "refilled while the task was still starting"
        settled.set()  # its first step
        deadline = time.monotonic() + 5
        while pool.spawned < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.spawned == 3 and len(pool.ready) == 2
        got.close()
        assert not os.path.exists(ready_mark(pool.dir, got.proc.pid))
    finally:
        pool.close()
    assert all(w.proc.poll() is not None for w in [older, newer])


def test_the_refill_happens_anyway_after_its_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(warmpool, "REFILL_AFTER_S", 0.3)
    pool = CountingPool(1, str(tmp_path))
    try:
        pool.fill()
        got = pool.take(threading.Event())  # a task that never reports
        assert got is not None
        deadline = time.monotonic() + 5
        while pool.spawned < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.spawned == 2
        got.close()
    finally:
        pool.close()


def test_wait_reachable_returns_once_the_port_listens():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    assert not reachable(addr)
    threading.Timer(0.3, s.listen).start()
    t = time.monotonic()
    assert wait_reachable(addr, 5.0)
    assert 0.25 < time.monotonic() - t < 2.0
    s.close()
    t = time.monotonic()
    assert not wait_reachable(addr, 0.3)  # nothing listens: gives up at its limit
    assert time.monotonic() - t < 1.5
