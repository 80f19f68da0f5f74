"""A task process's ties to its agent: a watchdog process that kills the task when its parent
agent dies, and the SIGTERM handler that reports and exits."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable

from strata.exitcodes import TASK_EXIT_ERROR
from strata.worker.events import Events


# The forked watcher runs this in a fresh interpreter (exec'd, so its command line does not
# look like a task's): argv = [-c, name, task pid, agent pid, interval].
_WATCHER_SRC = """
import os, signal, sys, time
me, parent, interval = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
def ppid_of(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
while True:
    time.sleep(interval)
    if os.getppid() != me:
        break
    p = ppid_of(me)
    if p is not None and p != parent:
        try:
            os.kill(me, signal.SIGKILL)
        except OSError:
            pass
        break
"""


def start_parent_watchdog(interval_s: float = 1.0) -> None:
    """Ends this process when its parent (the agent) dies, so no TensorFlow task is left
    orphaned. Two watchers: a daemon thread (exits with a message), and, where /proc exists,
    a small forked process started before TensorFlow is imported that SIGKILLs this one. The
    second is needed because TensorFlow's MultiWorkerMirroredStrategy constructor blocks in the
    cluster rendezvous while holding the GIL, so no Python thread runs until every worker has
    joined. The watcher (``python -S -c ... strata-task-watchdog``) holds no file descriptors
    of ours (the agent sees EOF on the events pipe and logs when we exit), stays in our process
    group (a killpg reaches it) and leaves within ``interval_s`` after we do."""
    parent = os.getppid()
    me = os.getpid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                try:
                    print("[task] parent process died; exiting", file=sys.stderr, flush=True)
                finally:
                    os._exit(TASK_EXIT_ERROR)

    if os.path.exists(f"/proc/{me}/stat"):
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:  # the watcher process: a fresh interpreter, no fds of ours, its own name
            try:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.closerange(3, 65536)
                os.execv(sys.executable, [sys.executable, "-S", "-c", _WATCHER_SRC,
                                          "strata-task-watchdog", str(me), str(parent),
                                          str(interval_s)])
            finally:
                os._exit(0)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def install_sigterm_handler(events: Events) -> None:
    """SIGTERM: write an error event, then die by SIGTERM. Re-installed after the strategy is
    created because TensorFlow's coordination service installs its own SIGTERM handler (for
    preemption notices) that swallows the signal: a SIGTERM during the cluster rendezvous is
    ignored, so the agent must follow SIGTERM with SIGKILL after a grace period."""

    def on_term(signum, frame):  # noqa: ARG001
        events.emit("error", kind="error", message="terminated by SIGTERM")
        events.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)


class StallWatch:
    """Ends a data-parallel task whose training makes no progress for ``timeout_s`` seconds:
    a peer that hangs (stopped, livelocked, its link cut without a reset) leaves every
    all-reduce waiting, and this is how the other workers learn of it. ``beat`` marks
    progress (a step done, a checkpoint saved); ``on_stall`` runs once, on the watching
    thread, when the time is up. It watches the training loop only (the local evaluation
    after it runs no collective).

    Why not TensorFlow's own collective timeout (``CommunicationOptions(timeout_seconds=)``):
    it starts a thread per collective operation that sleeps out the timeout, so a task holds
    about (collectives per second) x timeout threads: measured, 9,600 threads after 20 s of a
    2-worker MLP at 230 steps/s with 60 s, and a 4-worker job aborted with "Resource
    temporarily unavailable" when a thread could not be made. One thread here serves the
    whole task."""

    def __init__(self, timeout_s: float, on_stall: Callable[[float], None]) -> None:
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def start(self) -> "StallWatch":
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        interval = max(0.05, min(1.0, self.timeout_s / 10))
        while not self._stop.wait(interval):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                self._on_stall(idle)
                return
