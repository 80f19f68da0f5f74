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
from typing import Iterable, Mapping, NamedTuple

from strata.coordinator.decisions import trained_for
from strata.coordinator.placement import Capacity, TaskDemand, place
from strata.queues import Queue, Queues, Share
from strata.types import Job, JobState, TaskState

#: states in which a job holds room (its tasks' budgets are reserved)
HOLDING = frozenset({JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING})


def share_of(job: Job) -> Share:
    """What ``job`` holds, or will when placed: a worker per task, their budgets."""
    return Share(len(job.tasks), sum(t.memory_budget_bytes for t in job.tasks))


def held(job: Job) -> Share:
    """What ``job`` holds now: its tasks placed on an agent that have not ended (a waiting
    job holds nothing, nor does a restarting one planned again and not placed yet)."""
    if job.state not in HOLDING:
        return Share()
    live = [t for t in job.tasks if t.worker and t.state not in _ENDED]
    return Share(len(live), sum(t.memory_budget_bytes for t in live))


_ENDED = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED})


def queue_use(jobs: Iterable[Job], queue_of: Mapping[str, str]) -> dict[str, Share]:
    """What each queue's jobs hold now. ``queue_of``: job id -> its queue."""
    use: dict[str, Share] = {}
    for j in jobs:
        if j.state not in HOLDING:
            continue
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


class Standing(NamedTuple):
    """What the order needs of a waiting job, which does not change while it waits (a job's
    tasks change only when it is planned again): its queue, priority value, workers, memory
    (its tasks' budgets) and its smallest task's budget."""

    queue: str
    priority: int
    workers: int
    memory_bytes: int
    smallest: int

    @classmethod
    def of(cls, job: Job, place: Place) -> "Standing":
        budgets = [t.memory_budget_bytes for t in job.tasks]
        return cls(place.queue, place.priority, len(budgets), sum(budgets), min(budgets or [0]))


def order(waiting: Iterable[tuple[Job, Standing]], queues: Queues, use: Mapping[str, Share],
          fair: FairShare, now: float, *, aged: bool = False) -> list[Job]:
    """The waiting jobs in the order they are considered: a job whose queue holds less than
    its nominal share first (a queue's state, not the job's size: within a queue, a wide job
    is not put behind narrow ones), then the higher priority, then the owner with less recent
    use, then the older (then the smaller id). ``aged``: ``waiting`` is in that last order
    already (the coordinator's live jobs are kept so).

    The first three depend only on a job's standing and owner, which thousands of waiting
    jobs share with few others: they are worked out once for each, and a stable sort on them
    keeps the age order within (a pass over ten thousand waiting jobs costs a dictionary
    look-up each)."""
    pairs = list(waiting)
    if not aged:
        pairs.sort(key=lambda p: (p[0].created_at, p[0].id))
    # (keyed by the standing's identity: the coordinator's jobs of one standing share one
    # object, so its tuple is not hashed ten thousand times; equal ones apart cost a look-up)
    prefix: dict[tuple[int, str], tuple[int, int, float]] = {}
    keys = []
    for j, st in pairs:
        k = (id(st), j.owner)
        p = prefix.get(k)
        if p is None:
            q, have = queues.get(st.queue), use.get(st.queue, Share())
            under = q is not None and have.workers < q.nominal.workers \
                and have.memory_bytes < q.nominal.memory_bytes
            p = prefix[k] = (0 if under else 1, -st.priority, fair.usage(j.owner, now))
        keys.append(p)
    return [pairs[i][0] for i in sorted(range(len(pairs)), key=keys.__getitem__)]


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
    """When running ``job`` is expected to end: when it will have trained its
    ``training.time_limit`` (it fails past it; ``decisions.trained_for``), else its remaining
    steps at its measured rate, whichever is sooner; None when neither is
    known (a job may then hold its room for ever, as far as the scheduler can tell)."""
    spec = job.spec
    ends: list[float] = []
    if spec is not None and spec.training.time_limit_s and job.started_at:
        ends.append(now + max(0.0, spec.training.time_limit_s - trained_for(job, now)))
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
    """Room kept for ``job_id`` (a waiting job that was the head of the order and did not
    fit): the agents its placement will take at ``start`` (epoch seconds; None: not known, the
    room frees when a job whose end is unknown ends). With ``queue``, its queue's room is kept
    instead (the first job its queue's limit holds back): no later job of that queue takes the
    share it waits for (``queue_start``)."""

    job_id: str
    agents: frozenset[str]
    start: float | None
    queue: str = ""


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
        fitting += _add_room(caps, other, need)
        if fitting < len(demands):
            continue
        placed = place(demands, list(caps.values()))
        if placed.placed:
            return Reservation(job.id, frozenset(placed.assignments.values()),
                               None if end is None else max(now, end))
    return Reservation(job.id, frozenset(), None)


def queue_start(job: Job, queue: Queue, use: Mapping[str, Share],
                running: list[tuple[Job, float | None]], now: float) -> Reservation:
    """The room of ``queue`` kept for ``job``, which its limit holds back: it starts once
    enough of the queue's running jobs (``running``, with their expected ends) have ended
    for it to fit, at the expected end of the last of them (None: one of them has no known
    end)."""
    have = use.get(queue.name, Share())
    need = share_of(job)
    at: float | None = now
    for other, end in sorted(running, key=lambda r: (r[1] is None, r[1] or 0.0)):
        if (have + need).within(queue.limit):
            break
        have = _minus(have, held(other))
        at = None if end is None else max(now, end)
    return Reservation(job.id, frozenset(), at, queue=queue.name)


def honours(job: Place, holder: Place) -> bool:
    """Whether a job at ``job`` keeps off the room kept for a waiting job at ``holder``: every
    job does but one of a higher priority class. A kept room holds back its holder's class and
    those below, so a class never waits on a lower one's room."""
    return job.priority <= holder.priority


def delays(reservation: Reservation, agents: Iterable[str], duration: float | None,
           now: float, queue: str = "") -> bool:
    """Whether a job of ``queue`` placed now on ``agents`` for ``duration`` would delay
    ``reservation``: it takes a reserved agent (or, the reservation keeping its queue's room,
    it is of that queue) and is not known to end before the reserved start."""
    if reservation.queue:
        if queue != reservation.queue:
            return False
    elif not reservation.agents.intersection(agents):
        return False
    if reservation.start is None or duration is None:
        return True
    return now + duration > reservation.start


# --- preemption ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Running:
    """A running job preemption may stop: where it stands (its queue and priority) and the
    work it would lose, in worker-seconds (0: it saves a checkpoint on notice; else its
    workers times the time since its last checkpoint)."""

    job: Job
    place: Place
    lost_s: float


def may_preempt(job: Job, place: Place, other: Running, queues: Queues,
                use: Mapping[str, Share]) -> bool:
    """Whether waiting ``job`` (at ``place``) may preempt ``other``: ``other`` is preemptible and,
    in the same queue, of lower priority; in another queue, that queue is borrowing (holds
    more than its nominal share, after what ``use`` says) and ``job``'s queue is under its
    nominal share with ``job`` (it reclaims), or ``other`` is of lower priority. A queue
    within its nominal share is never preempted by another queue's jobs: that share is
    guaranteed."""
    spec = other.job.spec
    if spec is None or not spec.preemptible or other.job.id == job.id:
        return False
    if other.place.queue == place.queue:
        return other.place.priority < place.priority
    q = queues.get(other.place.queue)
    if q is None or use.get(q.name, Share()).within(q.nominal):
        return False
    if other.place.priority < place.priority:
        return True
    mine = queues.get(place.queue)
    return mine is not None and (use.get(mine.name, Share()) + share_of(job)).within(mine.nominal)


def _add_room(caps: dict[str, Capacity], job: Job, need: int) -> int:
    """Gives ``job``'s live tasks' room back to their agents in ``caps`` (its budget and a port
    each); returns how many agents that brought to fit a task of ``need`` bytes."""
    n = 0
    for t in job.tasks:
        c = caps.get(t.worker)
        if c is not None and t.state not in _ENDED:
            before = c.free_bytes >= need and c.free_ports > 0
            c = caps[t.worker] = dataclasses.replace(
                c, free_bytes=min(c.budget_bytes, c.free_bytes + t.memory_budget_bytes),
                free_ports=c.free_ports + 1)
            n += (c.free_bytes >= need and c.free_ports > 0) and not before
    return n


def _minus(a: Share, b: Share) -> Share:
    return Share(a.workers - b.workers, a.memory_bytes - b.memory_bytes)


@dataclasses.dataclass(frozen=True, slots=True)
class Preemption:
    """The running jobs to stop so that ``job_id`` starts, and the agents it would take
    once they are gone."""

    job_id: str
    victims: tuple[Running, ...]
    agents: frozenset[str]

    @property
    def lost_s(self) -> float:
        return sum(r.lost_s for r in self.victims)


def victims(job: Job, where: Place, running: Iterable[Running], free: list[Capacity],
            queues: Queues, use: Mapping[str, Share]) -> Preemption | None:
    """The running jobs to preempt so that waiting ``job`` (at ``where``) starts, losing
    least; None when no set of them would do. ``free``: the agents' free room now (those that
    meet ``job``'s needs); ``use``: what each queue holds.

    Those it may preempt (``may_preempt``) are taken lowest priority first, then least work
    lost, then fewest workers, until ``job`` places and its queue may hold it; then each
    taken, most costly first, is given back where ``job`` still starts without it. A
    borrowing queue's job is taken only while that queue still borrows."""
    demands = [TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in job.tasks]
    mine = queues.get(where.queue)
    if not demands:
        return None
    need = min(d.budget_bytes for d in demands)
    left = dict(use)
    pool = sorted((r for r in running if may_preempt(job, where, r, queues, use)),
                  key=lambda r: (r.place.priority, r.lost_s, len(r.job.tasks),
                                 -r.job.created_at, r.job.id))
    if not pool:
        return None

    def starts(taken: list[Running]) -> frozenset[str] | None:
        """The agents ``job`` takes once ``taken`` are gone (None: it does not start)."""
        have = use.get(where.queue, Share())
        for r in taken:
            if r.place.queue == where.queue:
                have = _minus(have, held(r.job))
        if mine is not None and not (have + share_of(job)).within(mine.limit):
            return None
        caps = {c.name: c for c in free}
        for r in taken:
            _add_room(caps, r.job, need)
        if sum(1 for c in caps.values()
               if c.free_bytes >= need and c.free_ports > 0) < len(demands):
            return None
        placed = place(demands, list(caps.values()))
        return frozenset(placed.assignments.values()) if placed.placed else None

    # the greedy pass: the room of each victim taken is added to what the last one left (not
    # computed again from every agent for each: a wide preemptor may take hundreds)
    taken: list[Running] = []
    agents: frozenset[str] | None = None
    caps = {c.name: c for c in free}
    fitting = sum(1 for c in caps.values() if c.free_bytes >= need and c.free_ports > 0)
    have = use.get(where.queue, Share())
    for r in pool:
        if r.place.queue != where.queue:
            q = queues.get(r.place.queue)
            if q is None or left.get(q.name, Share()).within(q.nominal):
                continue  # that queue no longer borrows: the rest of it is its own
        taken.append(r)
        left[r.place.queue] = _minus(left.get(r.place.queue, Share()), held(r.job))
        if r.place.queue == where.queue:
            have = _minus(have, held(r.job))
        fitting += _add_room(caps, r.job, need)
        if fitting < len(demands) or (
                mine is not None and not (have + share_of(job)).within(mine.limit)):
            continue
        placed = place(demands, list(caps.values()))
        if placed.placed:
            agents = frozenset(placed.assignments.values())
            break
    else:
        return None
    for r in sorted(taken, key=lambda r: (-r.lost_s, -len(r.job.tasks))):
        rest = [x for x in taken if x is not r]
        fewer = starts(rest) if rest else None
        if fewer is not None:
            taken, agents = rest, fewer
    assert agents is not None
    return Preemption(job.id, tuple(taken), agents)
