"""The agent's own disk: the bytes its files take and what its file system has left
(``DiskMeter``), and the collection of fetched files (a job's .keras file, its code) that no
running task's job names (``collect_blobs``)."""

from __future__ import annotations

import os
import threading
import time

from strata.types import DiskStatus


class DiskMeter:
    """The agent's disk: the bytes under its work directory (task folders, fetched files),
    counted every ``DISK_WALK_INTERVAL_S`` (``strata.worker.agent``) by the log thread, and
    what its file system has left, read at each heartbeat (one ``statvfs``)."""

    def __init__(self, root: str):
        self.root = root
        self.used = 0

    def walk(self) -> int:
        total = 0
        for base, _dirs, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(base, name)).st_size
                except OSError:
                    pass
        self.used = total
        return total

    def status(self) -> DiskStatus:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return DiskStatus(used_bytes=self.used)
        return DiskStatus(used_bytes=self.used, free_bytes=st.f_bavail * st.f_frsize,
                          total_bytes=st.f_blocks * st.f_frsize)


def collect_blobs(blob_dir: str, lock: threading.Lock, needed: set[str], keep_s: float,
                  max_idle_bytes: int, only: set[str] | None) -> int:
    """Deletes the fetched files in ``blob_dir`` whose digest is not in ``needed``: those not
    used for ``keep_s``, then the least recently used beyond ``max_idle_bytes`` (``only``:
    those of these digests, whatever their age), holding ``lock`` while it deletes. Returns
    how many."""
    try:
        names = os.listdir(blob_dir)
    except OSError:
        return 0
    now = time.time()
    gone = 0
    with lock:
        idle = []
        for name in names:
            path = os.path.join(blob_dir, name)
            if name[:64] in needed:
                continue
            try:
                st = os.stat(path)
                if (only is not None and name[:64] in only) or \
                        (only is None and now - st.st_mtime >= keep_s):
                    os.unlink(path)
                    gone += 1
                else:
                    idle.append((st.st_mtime, st.st_size, path))
            except OSError:
                pass
        if only is None:
            total = sum(size for _, size, _ in idle)
            for _mtime, size, path in sorted(idle):  # least recently used first
                if total <= max_idle_bytes:
                    break
                try:
                    os.unlink(path)
                    gone += 1
                    total -= size
                except OSError:
                    pass
    return gone
