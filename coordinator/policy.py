"""The scheduling policy of a shared cluster, as pure functions of the state: which waiting job
comes first, and whether a job's queue has room for it (``docs/scheduling.md``).

Order: across queues, a job whose queue is under its nominal share comes first; within that,
the higher priority class; then fair share: the owner who used the cluster least lately
(worker-seconds, decaying with the queues file's half-life, as Slurm's fair-share factor
does); then the older job. Room: a queue may hold its nominal share, and beyond it up to what
it may borrow.

Counted in workers (tasks: each task is a worker's worth of a job) and memory (the tasks'
budgets), the units a queue's share is given in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

from strata.queues import Queue, Queues, Share
from strata.types import Job, TaskState

#: states in which a job holds room (its tasks' budgets are reserved)
HOLDING = frozenset({"SCHEDULED", "RUNNING", "RESTARTING"})


def share_of(job: Job) -> Share:
    """What ``job`` holds, or will when placed: a worker per task, their budgets."""
    return Share(len(job.tasks), sum(t.memory_budget_bytes for t in job.tasks))


def held(job: Job) -> Share:
    """What ``job`` holds now: its tasks that have not ended (a waiting job holds nothing)."""
    if job.state.value not in HOLDING:
        return Share()
    live = [t for t in job.tasks if t.state not in _ENDED]
    return Share(len(live), sum(t.memory_budget_bytes for t in live))


_ENDED = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED})


def queue_use(jobs: Iterable[Job], queue_of: Mapping[str, str]) -> dict[str, Share]:
    """What each queue's jobs hold now. ``queue_of``: job id -> its queue."""
    use: dict[str, Share] = {}
    for j in jobs:
        h = held(j)
        if h.workers or h.memory_bytes:
            q = queue_of.get(j.id, "")
            use[q] = use.get(q, Share()) + h
    return use


@dataclasses.dataclass
class FairShare:
    """Each owner's use of the cluster in worker-seconds, decaying by half every
    ``half_life_s``: ``charge`` adds, ``usage`` reads at a time."""

    half_life_s: float
    _use: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def usage(self, owner: str, now: float) -> float:
        value, at = self._use.get(owner, (0.0, now))
        return value * math.pow(0.5, max(0.0, now - at) / self.half_life_s)

    def charge(self, owner: str, worker_seconds: float, now: float) -> None:
        self._use[owner] = (self.usage(owner, now) + worker_seconds, now)

    def owners(self) -> list[str]:
        return sorted(self._use)


@dataclasses.dataclass(frozen=True, slots=True)
class Place:
    """Where a waiting job stands: its queue and priority value, resolved at submission."""

    queue: str
    priority: int


def order_key(job: Job, place: Place, queues: Queues, use: Mapping[str, Share],
              fair: FairShare, now: float) -> tuple[int, int, float, float, str]:
    """The sort key of a waiting job (smaller first): its queue under its nominal share
    first, then the higher priority, then the owner with less recent use, then the older."""
    q = queues.get(place.queue)
    under = q is not None and (use.get(q.name, Share()) + share_of(job)).within(q.nominal)
    return (0 if under else 1, -place.priority, fair.usage(job.owner, now), job.created_at,
            job.id)


def order(waiting: Iterable[tuple[Job, Place]], queues: Queues, use: Mapping[str, Share],
          fair: FairShare, now: float) -> list[Job]:
    """The waiting jobs in the order they are considered."""
    keyed = [(order_key(j, p, queues, use, fair, now), j) for j, p in waiting]
    keyed.sort(key=lambda kv: kv[0])
    return [j for _, j in keyed]


def room_for(job: Job, queue: Queue | None, use: Mapping[str, Share]) -> str:
    """Why ``job`` may not start in ``queue`` now (its nominal share and what it may borrow
    are taken), or "" when it may."""
    if queue is None:
        return ""
    have = use.get(queue.name, Share())
    if (have + share_of(job)).within(queue.limit):
        return ""
    lim = queue.limit
    return (f"waiting for room in queue {queue.name}: it holds {have.workers} worker(s), this "
            f"job needs {len(job.tasks)}, and the queue may hold {_count(lim.workers)} "
            f"(nominal {_count(queue.nominal.workers)}, borrowing up to "
            f"{_count(queue.borrow.workers)})" if have.workers + len(job.tasks) > lim.workers
            else f"waiting for room in queue {queue.name}: its memory share is taken")


def _count(n: int) -> str:
    return "unbounded" if n >= 1 << 61 else str(n)
