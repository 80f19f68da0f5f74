"""The agent's pool of warm task processes (``--warm-pool``): ``WarmPool`` keeps processes of
``python -m strata.worker.warm`` ready with TensorFlow imported, hands one to a task that asks
(``take``), refills after that task settles, and ends every one it started when closed."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import threading

from strata.worker.taskenv import STOP_GRACE_S, base_env
from strata.worker.warm import ready_mark

log = logging.getLogger("strata.worker")


@dataclasses.dataclass
class Warm:
    proc: subprocess.Popen
    events_fd: int
    dir: str  # its working directory, where it marks itself ready

    @property
    def is_ready(self) -> bool:
        return os.path.exists(ready_mark(self.dir, self.proc.pid))

    def close(self) -> None:
        """Ends a warm process that was never given a task (its whole process group)."""
        with contextlib.suppress(OSError):
            os.close(self.events_fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_GRACE_S)
        with contextlib.suppress(OSError):
            os.unlink(ready_mark(self.dir, self.proc.pid))


#: the longest a warm pool waits for the task that took a process to start training before
#: it refills (``WarmPool.take``)
REFILL_AFTER_S = 30.0


class WarmPool:
    """``--warm-pool N``: processes with TensorFlow imported, ready for a task
    (``strata.worker.warm``). A task takes one if one is ready (else starts cold) and the pool
    refills in the background. The agent stops every one it started when it stops."""

    def __init__(self, size: int, python: str, device: str, work_dir: str):
        self.size = size
        self.python, self.device = python, device
        self.dir = os.path.join(work_dir, "warm")
        self.ready: list[Warm] = []
        self.lock = threading.Lock()
        self.closed = False

    def _spawn(self) -> Warm | None:
        os.makedirs(self.dir, exist_ok=True)
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(
                [self.python, "-m", "strata.worker.warm", "--events-fd", str(write_fd)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                pass_fds=(write_fd,), start_new_session=True, cwd=self.dir,
                env=base_env(self.device))
        except OSError as e:
            log.warning("cannot start a warm task process: %s", e)
            os.close(read_fd)
            return None
        finally:
            os.close(write_fd)
        return Warm(proc, read_fd, self.dir)

    def fill(self) -> None:
        while True:
            with self.lock:
                if self.closed or len(self.ready) >= self.size:
                    return
            warm = self._spawn()
            if warm is None:
                return
            with self.lock:
                if self.closed:
                    warm.close()
                    return
                self.ready.append(warm)

    def take(self, settled: threading.Event | None = None) -> Warm | None:
        """A ready process, or None. The pool refills once ``settled`` is set (the task that
        took one reached its first step or ended) or after ``REFILL_AFTER_S``: a refill imports
        TensorFlow, seconds of CPU that would otherwise compete with the starting task's own
        (on 2 cores it made a warm start 2.4-3.0 s instead of 1.5 s)."""
        with self.lock:
            # one that has finished importing first (``strata.worker.warm`` marks it), else
            # the oldest: still importing, it is further along than a new process
            self.ready.sort(key=lambda w: not w.is_ready)
            while self.ready:
                warm = self.ready.pop(0)
                if warm.proc.poll() is None:
                    break
                warm.close()  # died waiting: start another
            else:
                warm = None
        if self.size and not self.closed:
            threading.Thread(target=self._refill_after, args=(settled,), daemon=True,
                             name="warm-pool").start()
        return warm

    def _refill_after(self, settled: threading.Event | None) -> None:
        if settled is not None:
            settled.wait(REFILL_AFTER_S)
        self.fill()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            ready, self.ready = self.ready, []
        for warm in ready:
            warm.close()
