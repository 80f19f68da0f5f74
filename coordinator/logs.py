"""Job logs: what the agents forward of their tasks' output, kept by the coordinator.

One file per task, ``STATE_DIR/logs/JOB_ID/ROLE-INDEX.log``, so logs outlive the agents. Readers
follow them through an ``asyncio.Event`` per job, kept apart from the job watchers' signals so
that log traffic never wakes a job watcher (each wake-up sends it a snapshot).

A job's logs, all its tasks together, are at most ``max_job_bytes`` (``--max-job-logs``), and
they count in their owner's quota (``account``: ``BlobStore.charge_logs``): what comes past
either is dropped, and one line in the log says so. Logs are not refused (the agent would only
send them again); a disk below its reserve is (``DiskFull``: the agent keeps them a while).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import TYPE_CHECKING, AsyncIterator, Callable, Mapping, Protocol, Sequence

from strata.units import format_size

if TYPE_CHECKING:
    from strata.coordinator.disk import DiskGuard

#: one job's logs, all tasks (``--max-job-logs``): a week of a chatty task (a line a second)
DEFAULT_MAX_JOB_LOG_BYTES = 256 << 20


class LogAccount(Protocol):
    """Where logs are charged to their job's owner (``BlobStore``)."""

    def charge_logs(self, job_id: str, owner: str, size: int, force: bool = False) -> int: ...

    def forget_logs(self, job_id: str) -> None: ...
READ_CHUNK_BYTES = 1 << 20
TAIL_BLOCK_BYTES = 64 * 1024
FOLLOW_POLL_S = 1.0


class JobLogs:
    def __init__(self, log_dir: str, max_job_bytes: int = DEFAULT_MAX_JOB_LOG_BYTES,
                 disk: DiskGuard | None = None, account: LogAccount | None = None):
        self.log_dir = log_dir
        self.max_job_bytes = max_job_bytes
        self.disk = disk
        self.account = account
        self._signals: dict[str, asyncio.Event] = {}
        #: job id -> bytes of its logs on disk; the jobs whose owner's quota is full
        self._bytes: dict[str, int] = {}
        self._full: set[str] = set()

    def load(self, jobs: Mapping[str, str]) -> None:
        """Counts the logs on disk at a coordinator's start (``jobs``: id -> owner, of the
        jobs held), charged to their owners; deletes those of jobs not held (deleted while the
        coordinator stopped)."""
        if not os.path.isdir(self.log_dir):
            return
        for job_id in os.listdir(self.log_dir):
            root = os.path.join(self.log_dir, job_id)
            if job_id not in jobs:
                shutil.rmtree(root, ignore_errors=True)
                continue
            total = 0
            for name in os.listdir(root):
                try:
                    total += os.path.getsize(os.path.join(root, name))
                except OSError:
                    pass
            self._bytes[job_id] = total
            if self.account is not None:  # charged whatever the quota: they are on disk
                self.account.charge_logs(job_id, jobs[job_id], total, force=True)

    def total(self) -> int:
        return sum(self._bytes.values())

    def path(self, job_id: str, role: str, index: int) -> str:
        return os.path.join(self.log_dir, job_id, f"{role}-{index}.log")

    def append(self, job_id: str, role: str, index: int, data: bytes, owner: str = "") -> None:
        used = self._bytes.get(job_id, 0)
        if used >= self.max_job_bytes or job_id in self._full:
            return  # past a bound: dropped (the line that says so is in the log)
        if self.disk is not None:
            self.disk.check(len(data), f"logs of job {job_id}")
        why = ""
        if used + len(data) > self.max_job_bytes:
            data = data[:self.max_job_bytes - used]
            why = f"this job's logs reached {format_size(self.max_job_bytes)} (--max-job-logs)"
        if self.account is not None:
            fits = self.account.charge_logs(job_id, owner, len(data))
            if fits < len(data):
                data = data[:fits]
                why = f"{owner or 'the owner'} has no room left in its quota (--user-quota)"
                self._full.add(job_id)
        if why:
            data += f"\n[strata] {why}; what the tasks print from here on is not kept\n".encode()
        path = self.path(job_id, role, index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)
        self._bytes[job_id] = used + len(data)
        ev = self._signals.pop(job_id, None)
        if ev is not None:
            ev.set()

    def delete(self, job_id: str) -> None:
        shutil.rmtree(os.path.join(self.log_dir, job_id), ignore_errors=True)
        self._bytes.pop(job_id, None)
        self._full.discard(job_id)
        if self.account is not None:
            self.account.forget_logs(job_id)

    def tail_offset(self, job_id: str, role: str, index: int, lines: int) -> int:
        """Where the last ``lines`` lines of a task's log start (read backwards in blocks)."""
        try:
            with open(self.path(job_id, role, index), "rb") as f:
                end = f.seek(0, os.SEEK_END)
                pos, seen = end, 0
                while pos > 0:
                    step = min(TAIL_BLOCK_BYTES, pos)
                    pos -= step
                    f.seek(pos)
                    block = f.read(step)
                    # a final newline ends the last line; it does not start another
                    if pos + step == end and block.endswith(b"\n"):
                        block = block[:-1]
                    for i in range(len(block) - 1, -1, -1):
                        if block[i] == 0x0A:
                            seen += 1
                            if seen == lines:
                                return pos + i + 1
                return 0
        except FileNotFoundError:
            return 0

    async def read(self, job_id: str, tasks: Sequence[tuple[str, int]], follow: bool,
                   done: Callable[[], bool],
                   tail_lines: int = 0) -> AsyncIterator[tuple[str, int, bytes]]:
        """Every task's log from the start (or its last ``tail_lines`` lines); with
        ``follow``, new data until ``done()`` (the job and all its tasks have ended) and nothing
        is left to read."""
        offsets = {t: self.tail_offset(job_id, *t, tail_lines) if tail_lines > 0 else 0
                   for t in tasks}
        while True:
            final = done()
            got = False
            for (role, index) in tasks:
                try:
                    with open(self.path(job_id, role, index), "rb") as f:
                        f.seek(offsets[(role, index)])
                        data = f.read(READ_CHUNK_BYTES)
                except FileNotFoundError:
                    continue
                if data:
                    got = True
                    offsets[(role, index)] += len(data)
                    yield role, index, data
            if got:
                continue
            if not follow or final:
                return
            ev = self._signals.get(job_id)
            if ev is None:
                ev = self._signals[job_id] = asyncio.Event()
            try:
                await asyncio.wait_for(ev.wait(), timeout=FOLLOW_POLL_S)
            except asyncio.TimeoutError:
                pass
