"""A notice as a task reads it: its agent writes ``NOTICE_FILE`` into the task's working
directory with a step (``TaskProcess.notice``); the training loop asks ``due`` after each step
and, once that step is done, saves a checkpoint and stops with ``TASK_EXIT_NOTICE``. Every task
of a job is told the same step, ahead of where they are, so the workers of a data-parallel job
save the same step (docs/fault-tolerance.md, "Notices")."""

from __future__ import annotations

from strata.taskconfig import NOTICE_FILE


class Notice:
    """Reads the notice file until it appears, then remembers its step (a file read per step
    while there is none: microseconds, against steps of milliseconds)."""

    def __init__(self, path: str = NOTICE_FILE):
        self.path = path
        self.step = 0

    def at(self) -> int:
        """The notice's step (0: none yet)."""
        if not self.step:
            try:
                with open(self.path) as f:
                    self.step = max(0, int(f.read().strip() or 0))
            except (OSError, ValueError):
                return 0
        return self.step

    def due(self, step: int) -> bool:
        """Whether step ``step`` (done) is the notice's, or past it."""
        at = self.at()
        return bool(at) and step >= at
