"""Recent figures of each job, for the status page: progress (step, loss, examples/s) and each
task's memory in use over time. In memory only, bounded: at most POINTS per series, at most
one point per MIN_INTERVAL_S, forgotten with the job. Pure logic."""

from __future__ import annotations

import collections
from typing import Any

from strata.types import Job, Task

POINTS = 600
MIN_INTERVAL_S = 1.0

Point = tuple[float, ...]


class Series:
    def __init__(self) -> None:
        #: job id -> (time, step, loss, examples/s)
        self.progress: dict[str, collections.deque[Point]] = {}
        #: job id -> "role:index" -> (time, in use bytes, peak bytes)
        self.memory: dict[str, dict[str, collections.deque[Point]]] = {}

    @staticmethod
    def _add(points: collections.deque[Point], point: Point) -> None:
        if points and point[0] - points[-1][0] < MIN_INTERVAL_S:
            # the latest figures, in the slot that began less than MIN_INTERVAL_S ago (its
            # time kept, else reports a little under the interval apart would never append)
            points[-1] = (points[-1][0],) + point[1:]
        else:
            points.append(point)

    def record(self, job: Job, task: Task, now: float) -> None:
        m = job.metrics
        if m.step:
            points = self.progress.setdefault(job.id, collections.deque(maxlen=POINTS))
            self._add(points, (now, float(m.step), float(m.loss or 0.0),
                               float(m.examples_per_sec or 0.0)))
        tasks = self.memory.setdefault(job.id, {})
        points = tasks.setdefault(f"{task.role}:{task.index}", collections.deque(maxlen=POINTS))
        self._add(points, (now, float(task.in_use_bytes), float(task.peak_memory_bytes)))

    def forget(self, job_id: str) -> None:
        self.progress.pop(job_id, None)
        self.memory.pop(job_id, None)

    def of(self, job_id: str) -> dict[str, Any]:
        """The job's series as JSON: ``progress`` rows and ``memory`` rows per task."""
        return {"progress": [list(p) for p in self.progress.get(job_id, ())],
                "memory": {k: [list(p) for p in v]
                           for k, v in self.memory.get(job_id, {}).items()}}
