"""The task's events pipe to its agent (``Events``: progress, allocator figures, checkpoints,
the result, as JSON lines), its log lines, and the exit path that flushes both."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any



def _clean(v: Any) -> Any:
    """JSON-safe values: non-finite floats become null (strict JSON has no NaN)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class Events:
    """Newline-delimited JSON events on a file descriptor (stderr when none is given)."""

    def __init__(self, fd: int | None):
        self._f = None
        if fd is not None and fd >= 0:
            try:
                self._f = os.fdopen(fd, "w", buffering=1)
            except OSError as e:
                log(f"cannot open events fd {fd}: {e}; events go to stderr")
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "time": time.time()}
        rec.update(fields)
        line = json.dumps(_clean(rec), allow_nan=False)
        with self._lock:
            try:
                if self._f is not None:
                    self._f.write(line + "\n")
                else:
                    sys.stderr.write("EVENT " + line + "\n")
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass  # the reader is gone; the parent watchdog ends the process if it died

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                try:
                    self._f.flush()
                    self._f.close()
                except (OSError, ValueError):
                    pass
                self._f = None


def log(msg: str) -> None:
    print(f"[task] {msg}", flush=True)


def format_mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def exit_task(code: int, events: Events | None) -> None:
    if events is not None:
        events.close()
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
