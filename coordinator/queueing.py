"""The coordinator's queues (``--queues FILE``): a job's queue and priority resolved at
submission, the waiting jobs ordered by the policy (``coordinator.policy``) and held back
while their queue's share is taken, each owner's use charged for fair share, and the view
``strata queues`` shows. Without a file the cluster is one queue, everyone's, unbounded, and
jobs are placed oldest first (the control loop's own order; no per-tick sort).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from strata.errors import QuotaExceeded, SpecError
from strata.jobspec import JobSpec
from strata.queues import UNBOUNDED, QueueError, Queues, QueueView, Share
from strata.units import format_size
from strata.coordinator import policy
from strata.types import Job, JobState, Task


class Queueing:
    """The queues in force and what the policy needs between ticks."""

    def __init__(self, queues: Queues | None = None) -> None:
        self.configured = queues is not None
        self.queues = queues or Queues()
        self.fair = policy.FairShare(self.queues.fair_share_half_life_s)
        self.use: dict[str, Share] = {}
        self._charged_at = 0.0
        #: each token NAME's groups (``--auth-tokens``: ``TOKEN ROLE NAME GROUPS``), which
        #: queues name as ``group:NAME`` (set by the service, again on SIGHUP)
        self.groups: dict[str, tuple[str, ...]] = {}
        #: this pass: each waiting job's standing (``order``); and kept between passes, with
        #: the task list it was taken from (a re-plan makes a new one)
        self.standing: dict[str, policy.Standing] = {}
        self._standing: dict[str, tuple[list[Task], policy.Standing]] = {}
        self._interned: dict[policy.Standing, policy.Standing] = {}

    def reload(self, queues: Queues) -> None:
        """A new file (SIGHUP): its queues from now on; the owners' use carries over."""
        self.configured = True
        self.queues = queues
        self._standing, self._interned = {}, {}  # priorities may have changed
        self.fair.half_life_s = queues.fair_share_half_life_s

    def resolve(self, spec: JobSpec, owner: str) -> JobSpec:
        """``spec`` with its queue and priority class resolved for ``owner``. Raises
        ``SpecError`` naming ``queue`` or ``priority``; ``QuotaExceeded`` for a job its queue
        could never hold, or one not preemptible beyond its queue's nominal share."""
        if not self.configured and (spec.queue not in ("", "default") or spec.priority):
            field = "queue" if spec.queue not in ("", "default") else "priority"
            raise SpecError(field, "this coordinator has no queues file (strata coordinator "
                                   "--queues FILE): leave queue and priority out")
        try:
            q = self.queues.queue_of(owner, spec.queue, self.groups.get(owner, ()))
            cls, _ = self.queues.priority_of(spec.priority)
        except QueueError as e:
            raise SpecError(e.field, e.message) from None
        return dataclasses.replace(spec, queue=q.name, priority=cls)

    def check_share(self, spec: JobSpec, need: Share) -> None:
        """Refuses a job needing ``need`` that its queue could never hold, or one not
        preemptible beyond its queue's nominal share (``QuotaExceeded``)."""
        q = self.queues.get(spec.queue)
        if not self.configured or q is None:
            return
        if not need.within(q.limit):
            raise QuotaExceeded(
                f"job {spec.name!r} needs {need.workers} worker(s) and "
                f"{format_size(need.memory_bytes)}, more than queue {q.name} may ever hold "
                f"({_share_text(q.limit)} with what it may borrow)")
        if not spec.preemptible and not need.within(q.nominal):
            raise QuotaExceeded(
                f"job {spec.name!r} is not preemptible, which a job may be only within its "
                f"queue's nominal share ({q.name}: {_share_text(q.nominal)}); it needs "
                f"{_share_text(need)}")

    def begin_tick(self, live: Iterable[Job], now: float) -> None:
        """What each queue holds now, and each owner's use charged since the last tick."""
        dt = now - self._charged_at if self._charged_at else 0.0
        self._charged_at = now
        use: dict[str, Share] = {}
        charged: dict[str, int] = {}
        holding = policy.HOLDING
        for j in live:
            if j.state not in holding:
                continue  # (most of them, with thousands waiting)
            h = policy.held(j)
            if h.workers or h.memory_bytes:
                q = j.spec.queue if j.spec is not None else ""
                use[q] = use.get(q, Share()) + h
                charged[j.owner] = charged.get(j.owner, 0) + h.workers
        self.use = use
        if dt > 0:
            for owner, workers in charged.items():
                if workers:
                    self.fair.charge(owner, workers * dt, now)

    def order(self, waiting: list[Job], now: float) -> list[Job]:
        """The waiting jobs (oldest first, as the live jobs are kept) in the policy's order;
        each one's standing is kept in ``standing`` for the rest of the pass."""
        standing: dict[str, policy.Standing] = {}
        pairs = []
        cache = self._standing
        for j in waiting:
            kept = cache.get(j.id)
            if kept is None or kept[0] is not j.tasks:
                st = policy.Standing.of(j, policy.Place(j.spec.queue if j.spec else "",
                                                        self.priority(j)))
                # one object for all the jobs of a standing: compared by identity per pass
                kept = cache[j.id] = (j.tasks, self._interned.setdefault(st, st))
            standing[j.id] = kept[1]
            pairs.append((j, kept[1]))
        if len(self._standing) > 2 * len(standing) + 64:  # those no longer waiting
            self._standing = {k: v for k, v in self._standing.items() if k in standing}
            self._interned = {v[1]: v[1] for v in self._standing.values()}
        self.standing = standing
        return policy.order(pairs, self.queues, self.use, self.fair, now, aged=True)

    def priority(self, job: Job) -> int:
        """``job``'s priority value (its class's, in the file in force; a class a reloaded
        file dropped ranks lowest)."""
        classes = self.queues.priority_classes
        value = classes.get(job.spec.priority if job.spec else "")
        return min(classes.values()) if value is None else value

    def blocked(self, job: Job) -> str:
        """Why ``job``'s queue cannot take it now ("" when it can)."""
        if not self.configured or job.spec is None:
            return ""
        return policy.room_for(job, self.queues.get(job.spec.queue), self.use)

    def holds(self, spec: JobSpec, need: Share, holding: Job | None = None) -> bool:
        """Whether ``spec``'s queue may hold ``need`` now, ``holding``'s share given back
        (an elastic job that would resize)."""
        q = self.queues.get(spec.queue) if self.configured else None
        if q is None:
            return True
        have = self.use.get(q.name, Share())
        if holding is not None:
            h = policy.held(holding)
            have = Share(have.workers - h.workers, have.memory_bytes - h.memory_bytes)
        return (have + need).within(q.limit)

    def has_room(self, queue: str, need: Share) -> bool:
        """Whether ``queue`` may hold ``need`` more now."""
        q = self.queues.get(queue) if self.configured else None
        return q is None or (self.use.get(q.name, Share()) + need).within(q.limit)

    def placed(self, job: Job) -> None:
        """``job`` took its room: its queue holds it from now (within this tick too)."""
        if job.spec is not None:
            q = job.spec.queue
            self.use[q] = self.use.get(q, Share()) + policy.share_of(job)

    def views(self, live: Iterable[Job]) -> list[QueueView]:
        jobs = [j for j in live if j.spec is not None and not j.recovery.probe_of]
        queue_of = {j.id: j.spec.queue for j in jobs if j.spec is not None}
        use = policy.queue_use(jobs, queue_of)
        out = []
        for q in self.queues.queues:
            mine = [j for j in jobs if queue_of.get(j.id) == q.name]
            out.append(QueueView(
                q.name, q.nominal, q.borrow, use.get(q.name, Share()),
                waiting=sum(j.state == JobState.PENDING or (
                    j.state == JobState.RESTARTING and bool(j.recovery.preempted_by))
                    for j in mine),
                running=sum(j.state in (JobState.SCHEDULED, JobState.RUNNING) for j in mine),
                default=q.default))
        return out


def _share_text(s: Share) -> str:
    w = "any number of" if s.workers >= UNBOUNDED else str(s.workers)
    m = "any memory" if s.memory_bytes >= UNBOUNDED else format_size(s.memory_bytes)
    return f"{w} worker(s), {m}"
