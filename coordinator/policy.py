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

from strata.coordinator.placement import Capacity, TaskDemand, place
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


# --- a reservation for the head of the order, and backfill -------------------------------------

def expected_end(job: Job, now: float) -> float | None:
    """When running ``job`` is expected to end: its first step plus ``training.time_limit``
    (it fails past it), else its remaining steps at its measured rate; None when neither is
    known (a job may then hold its room for ever, as far as the scheduler can tell)."""
    spec = job.spec
    ends: list[float] = []
    if spec is not None and spec.training.time_limit_s and job.started_at:
        ends.append(job.started_at + spec.training.time_limit_s)
    m = job.metrics
    if spec is not None and m.examples_per_sec > 0 and m.total_steps > m.step:
        rate = m.examples_per_sec / max(1, spec.data.batch_size)
        ends.append(now + (m.total_steps - m.step) / rate)
    return min(ends) if ends else None


def expected_duration(job: Job) -> float | None:
    """How long a waiting ``job`` will hold its room once placed: its ``training.time_limit``
    (the most it may train), or None when it names none."""
    spec = job.spec
    return spec.training.time_limit_s if spec is not None and spec.training.time_limit_s \
        else None


@dataclasses.dataclass(frozen=True, slots=True)
class Reservation:
    """Room kept for ``job_id`` (the head of the order that does not fit now): the agents its
    placement will take at ``start`` (epoch seconds; None: not known, the room frees when a job
    whose end is unknown ends)."""

    job_id: str
    agents: frozenset[str]
    start: float | None


def reserve(job: Job, free: list[Capacity], running: list[tuple[Job, float | None]],
            now: float) -> Reservation:
    """Where and when ``job`` would start: the running jobs' room given back in the order they
    are expected to end (unknown ends last), until its tasks place. ``free``: the agents' free
    room now; ``running``: each running job with its expected end."""
    caps = {c.name: c for c in free}
    demands = [TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in job.tasks]
    if not demands:
        return Reservation(job.id, frozenset(), now)
    need = min(d.budget_bytes for d in demands)
    # agents that could take its smallest task: placement is tried only once there are enough
    # for all its tasks (one per agent), so a pass over many running jobs costs few placements
    fitting = sum(1 for c in caps.values() if c.free_bytes >= need and c.free_ports > 0)
    order = sorted(running, key=lambda r: (r[1] is None, r[1] or 0.0))
    for other, end in order:
        for t in other.tasks:
            c = caps.get(t.worker)
            if c is None or t.state in _ENDED:
                continue
            before = c.free_bytes >= need and c.free_ports > 0
            c = caps[t.worker] = dataclasses.replace(
                c, free_bytes=min(c.budget_bytes, c.free_bytes + t.memory_budget_bytes),
                free_ports=c.free_ports + 1)
            fitting += (c.free_bytes >= need) and not before
        if fitting < len(demands):
            continue
        placed = place(demands, list(caps.values()))
        if placed.placed:
            return Reservation(job.id, frozenset(placed.assignments.values()),
                               None if end is None else max(now, end))
    return Reservation(job.id, frozenset(), None)


def delays(reservation: Reservation, agents: Iterable[str], duration: float | None,
           now: float) -> bool:
    """Whether a job placed now on ``agents`` for ``duration`` would delay ``reservation``:
    it takes a reserved agent and is not known to end before the reserved start."""
    if not reservation.agents.intersection(agents):
        return False
    if reservation.start is None or duration is None:
        return True
    return now + duration > reservation.start
