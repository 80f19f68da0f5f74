"""Job logs: what the agents forward of their tasks' output, kept by the coordinator.

One file per task, ``STATE_DIR/logs/JOB_ID/ROLE-INDEX.log``, so logs outlive the agents. Readers
follow them through an ``asyncio.Event`` per job, kept apart from the job watchers' signals so
that log traffic never wakes a job watcher (each wake-up sends it a snapshot).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import AsyncIterator, Callable, Sequence

READ_CHUNK_BYTES = 1 << 20
TAIL_BLOCK_BYTES = 64 * 1024
FOLLOW_POLL_S = 1.0


class JobLogs:
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self._signals: dict[str, asyncio.Event] = {}

    def path(self, job_id: str, role: str, index: int) -> str:
        return os.path.join(self.log_dir, job_id, f"{role}-{index}.log")

    def append(self, job_id: str, role: str, index: int, data: bytes) -> None:
        path = self.path(job_id, role, index)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "ab") as f:
            f.write(data)
        ev = self._signals.pop(job_id, None)
        if ev is not None:
            ev.set()

    def delete(self, job_id: str) -> None:
        shutil.rmtree(os.path.join(self.log_dir, job_id), ignore_errors=True)

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
