"""The coordinator's disk: room kept for state changes, and a ballast for when it fills anyway.

Bulk writes (uploaded files, jobs' outputs, logs, new jobs) are refused with ``DiskFull``
(UNAVAILABLE, naming the directory) once they would leave less than ``reserve_bytes`` free on
the file system of ``--state-dir``: what is left is for the small writes that keep the service
running (a job's state, a cancel, an event), so a cluster whose users filled the disk can still
cancel and delete jobs to make room.

Something else may fill the disk all the same (another program, another tenant of the volume).
For that the coordinator keeps a ballast file of ``ballast_bytes`` in the state directory, as
CockroachDB keeps its emergency ballast: the first write that finds no room at all releases it
(``release``) and is tried again, so the cancel that frees room can be written. The ballast is
made again once the disk has room (``restore``, from the collector).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import sqlite3

from strata.errors import DiskFull
from strata.units import format_size

log = logging.getLogger("strata.coordinator")

#: room left free for state changes: a job's records and events are a few KiB, a day of a busy
#: cluster's state changes a few MiB; SQLite's WAL may grow by its checkpoint size (~4 MiB)
DEFAULT_RESERVE_BYTES = 256 << 20
#: released when a write finds no room at all (room for thousands of cancels and deletes): a
#: quarter of the reserve, at most this
DEFAULT_BALLAST_BYTES = 32 << 20
BALLAST_NAME = "disk-ballast"
#: SQLite's result code for a write that found no room (``sqlite3.SQLITE_FULL`` from 3.11)
SQLITE_FULL = 13


@dataclasses.dataclass(frozen=True)
class DiskUse:
    free_bytes: int
    total_bytes: int


def disk_use(path: str) -> DiskUse:
    """Free (for this user) and total bytes of the file system that holds ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return DiskUse(0, 0)
    return DiskUse(st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def is_full(err: BaseException) -> bool:
    """Whether ``err`` says a file system had no room (or a quota was hit): the errors of a
    write, and SQLite's own."""
    if isinstance(err, OSError):
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if isinstance(err, sqlite3.OperationalError):
        code = getattr(err, "sqlite_errorcode", None)  # (Python 3.11+)
        return code == SQLITE_FULL if code is not None else "disk is full" in str(err)
    return False


class DiskGuard:
    """The room of ``--state-dir``: refuses bulk writes below the reserve, holds the ballast."""

    def __init__(self, state_dir: str, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
                 ballast_bytes: int | None = None):
        self.state_dir = state_dir
        self.reserve_bytes = max(0, int(reserve_bytes))
        self.ballast_bytes = max(0, int(ballast_bytes)) if ballast_bytes is not None else \
            min(DEFAULT_BALLAST_BYTES, self.reserve_bytes // 4)
        self.ballast = os.path.join(state_dir, BALLAST_NAME)
        self._said_full = False
        self.restore()

    def use(self) -> DiskUse:
        return disk_use(self.state_dir)

    def check(self, incoming: int, what: str) -> None:
        """Raises ``DiskFull`` when writing ``incoming`` more bytes would leave less than the
        reserve free. ``what`` names the write refused."""
        free = self.use().free_bytes
        if free - incoming >= self.reserve_bytes:
            self._said_full = False
            return
        if not self._said_full:
            self._said_full = True
            log.error("the state directory's disk is full: %s free, %s kept for state changes; "
                      "uploads, outputs, logs and new jobs are refused until there is room",
                      format_size(free), format_size(self.reserve_bytes))
        raise DiskFull(self.full_message(free, what), self.state_dir)

    def full_message(self, free: int, what: str) -> str:
        return (f"the coordinator's disk is full: {os.path.abspath(self.state_dir)} has "
                f"{format_size(free)} free, and {format_size(self.reserve_bytes)} of it is kept "
                f"for state changes (--disk-reserve); {what} refused: delete finished jobs "
                "(strata delete), or give the state directory more room")

    def release(self) -> bool:
        """Frees the ballast (a write found no room); whether there was one to free."""
        try:
            os.unlink(self.ballast)
        except FileNotFoundError:
            return False
        except OSError as e:
            log.error("cannot remove the disk ballast %s: %s", self.ballast, e.strerror)
            return False
        log.error("the state directory's disk is full: released the %s ballast so that state "
                  "changes can be written", format_size(self.ballast_bytes))
        return True

    def restore(self) -> None:
        """Makes the ballast when it is missing and the disk has room for it and the reserve."""
        if not self.ballast_bytes or os.path.exists(self.ballast):
            return
        if self.use().free_bytes < self.reserve_bytes + 2 * self.ballast_bytes:
            return
        tmp = self.ballast + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.ballast_bytes)
            finally:
                os.close(fd)
            os.replace(tmp, self.ballast)
        except OSError as e:
            log.warning("cannot make the disk ballast %s: %s", self.ballast, e.strerror)
            try:
                os.unlink(tmp)
            except OSError:
                pass
