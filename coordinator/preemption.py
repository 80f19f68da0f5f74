"""Preemption on a shared cluster: the effects of ``policy.victims``' choice.

A waiting job that cannot start (no room, or its queue's share taken by its own queue's jobs of
lower priority) may stop running jobs: of lower priority in its own queue, or in a queue that
borrows beyond its nominal share (of lower priority, or any when the waiting job's queue
reclaims its nominal share). The victims are those losing least work (``policy.victims``).
Each gets a notice (``JobLifecycle._save_and_stop``): its tasks save a checkpoint after a step
they all reach within ``PREEMPT_DEADLINE_S`` and stop; one that cannot save on notice stops at
once and resumes from its last periodic checkpoint. A victim then waits again, ordered by the
policy with the other waiting jobs and never ahead of the job that preempted it while that one
waits; it resumes at its step count. Meanwhile the preemptor's room (the victims' agents) is
kept: no later job takes it.

Bounded per pass of the control loop: one preemption starts per pass, and a waiting job's
choice is computed again only when room moved since it last found none (``_tried_preempt``).
"""

from __future__ import annotations

from strata.coordinator import policy
from strata.coordinator.agents import Needs
from strata.coordinator.elastic import ElasticJobs
from strata.coordinator.queueing import Queueing
from strata.queues import Share
from strata.types import Job, JobState

_RUNNING = frozenset({JobState.SCHEDULED, JobState.RUNNING})

#: seconds a preempted job's tasks have to save their checkpoint and stop
PREEMPT_DEADLINE_S = 60.0
#: waiting jobs whose victims are looked for, at most, in a pass of the control loop (the
#: first in the order that do not start): a pass's cost stays bounded with thousands waiting
PREEMPT_TRIES_PER_PASS = 4


class Preemptions(ElasticJobs):
    """Preemption's effects on top of the lifecycle (``ControlLoop`` decides when)."""

    queueing: Queueing

    def _init_preemption(self) -> None:
        #: preemptor id -> its preemption in flight (victims saving and stopping)
        self._preempting: dict[str, policy.Preemption] = {}
        #: waiting job id -> the room version at which it last found nothing to preempt
        self._tried_preempt: dict[str, int] = {}
        #: this pass: whether a preemption started (one per pass), how many waiting jobs
        #: looked for victims, and the running jobs it may stop with each queue's lowest
        #: priority among them (``_new_pass``)
        self._preempted_this_pass = False
        self._preempt_tries = 0
        self._pass_running: list[policy.Running] | None = None
        self._lowest: dict[str, int] | None = None
        #: this pass: whether anything may be preempted for a job of a queue, priority and
        #: size (``_may_find``: many waiting jobs share one)
        self._may: dict[policy.Standing, bool] = {}

    def _new_pass(self) -> None:
        self._preempted_this_pass, self._preempt_tries = False, 0
        self._pass_running, self._lowest = None, None
        self._may = {}
        # a preemptor cancelled, failed or deleted while its victims stop keeps no room
        for job_id in [k for k in self._preempting
                       if k not in self.jobs or not self._waiting(self.jobs[k])]:
            del self._preempting[job_id]

    def _waiting(self, job: Job) -> bool:
        """Whether ``job`` waits in the policy's order: PENDING, or preempted and not placed
        again (RESTARTING)."""
        return job.state == JobState.PENDING or (
            job.state == JobState.RESTARTING and bool(job.recovery.preempted_by))

    def _in_flight(self, job: Job) -> policy.Preemption | None:
        """``job``'s preemption whose victims still hold room (None: none, or they are gone)."""
        pre = self._preempting.get(job.id)
        if pre is None:
            return None
        for r in pre.victims:
            v = self.jobs.get(r.job.id)
            if v is not None and policy.held(v).workers:
                return pre
        del self._preempting[job.id]
        return None

    def _behind_preemptor(self, job: Job) -> str:
        """Why preempted ``job`` waits behind the job that preempted it ("" once that one no
        longer waits: placed, ended or deleted)."""
        by = self.jobs.get(job.recovery.preempted_by) if job.recovery.preempted_by else None
        if by is None or not self._waiting(by):
            return ""
        return f"preempted by {by.id}: waiting until that job starts"

    def _kept_rooms(self, job: Job) -> list[policy.Reservation]:
        """The room kept for preemptors other than ``job`` whose victims are stopping."""
        return [policy.Reservation(p.job_id, p.agents, None)
                for p in self._preempting.values() if p.job_id != job.id]

    def _preemptible(self) -> list[Job]:
        """The running jobs preemption may stop: preemptible, no probe, no notice in flight."""
        return [j for j in self.state.ordered()
                if j.state in _RUNNING and j.spec is not None and j.spec.preemptible
                and not j.recovery.probe_of and j.id not in self._probe_of
                and not j.recovery.notice_step]

    def _candidates(self, now: float) -> list[policy.Running]:
        """The running jobs preemption may stop, with the work each would lose (once a
        pass)."""
        if self._pass_running is None:
            self._pass_running = [
                policy.Running(j, policy.Place(j.spec.queue if j.spec else "",
                                               self.queueing.priority(j)),
                               self._lost_s(j, now)) for j in self._preemptible()]
        return self._pass_running

    def _lowest_priority(self) -> dict[str, int]:
        """Each queue's lowest priority among the jobs preemption may stop (once a pass)."""
        if self._lowest is None:
            self._lowest = {}
            for j in self._preemptible():
                q, p = (j.spec.queue if j.spec else ""), self.queueing.priority(j)
                if p < self._lowest.get(q, p + 1):
                    self._lowest[q] = p
        return self._lowest

    def _class_settled(self, standing: policy.Standing) -> bool:
        """Whether this pass would not preempt for any waiting job of ``standing``."""
        return self._preempted_this_pass or self._preempt_tries >= PREEMPT_TRIES_PER_PASS \
            or not self._may_find(standing)

    def _preemption_settled(self, job: Job, standing: policy.Standing) -> bool:
        """Whether this pass would not preempt for waiting ``job``: one already started, the
        tries are spent, it found nothing at this room already, or nothing may be preempted
        for one of its standing."""
        return self._tried_preempt.get(job.id) == self.state.room_version \
            or self._class_settled(standing)

    def _may_find(self, st: policy.Standing) -> bool:
        """Whether any running job may be preempted for ``job`` (``policy.may_preempt``, on
        each queue's lowest priority: one look per queue, not per running job)."""
        found = self._may.get(st)
        if found is None:
            found = self._may[st] = self._may_find_now(
                policy.Place(st.queue, st.priority), Share(st.workers, st.memory_bytes))
        return found

    def _may_find_now(self, where: policy.Place, share: Share) -> bool:
        queues, use = self.queueing.queues, self.queueing.use
        mine = queues.get(where.queue)
        under = mine is not None and (use.get(mine.name, Share()) + share).within(mine.nominal)
        for name, low in self._lowest_priority().items():
            if name == where.queue:
                if low < where.priority:
                    return True
                continue
            q = queues.get(name)
            if q is not None and not use.get(name, Share()).within(q.nominal) \
                    and (under or low < where.priority):
                return True
        return False

    def _lost_s(self, job: Job, now: float) -> float:
        """Worker-seconds of training ``job`` would lose if preempted now: none when it saves
        a checkpoint on notice; else its steps since its last checkpoint at its rate (or its
        time since its first step, the rate not known yet), times its workers."""
        assert job.spec is not None
        workers = len(job.tasks)
        if self._save_at(job, PREEMPT_DEADLINE_S).step:
            return 0.0
        rate = job.metrics.examples_per_sec / max(1, job.spec.data.batch_size)
        if rate > 0:
            return workers * max(0, job.metrics.step - job.checkpoint_step) / rate
        return workers * max(0.0, now - job.started_at) if job.started_at else 0.0

    def _try_preempt(self, job: Job) -> str:
        """Preempts what waiting ``job`` needs, if anything may be and it would start then,
        without delaying the rooms kept for other jobs (``_kept_rooms``). Returns the words its
        wait says ("" when nothing was preempted)."""
        assert job.spec is not None
        version = self.state.room_version
        if self._preempted_this_pass or self._preempt_tries >= PREEMPT_TRIES_PER_PASS \
                or self._tried_preempt.get(job.id) == version:
            return ""
        self._tried_preempt[job.id] = version
        now = self.clock()
        where = policy.Place(job.spec.queue, self.queueing.priority(job))
        if not self._may_find(policy.Standing.of(job, where)):
            return ""
        self._preempt_tries += 1
        pre = policy.victims(job, where, self._candidates(now),
                             self.state.capacities(Needs.of(job.spec)),
                             self.queueing.queues, self.queueing.use)
        if pre is None:
            return ""
        duration = policy.expected_duration(job)
        if any(policy.delays(r, pre.agents, duration, now) for r in self._kept_rooms(job)):
            return ""
        self._preempted_this_pass = True
        self._preempting[job.id] = pre
        self._tried_preempt.pop(job.id, None)
        names = ", ".join(r.job.id for r in pre.victims)
        self._event(job, "message", f"preempts {names} to start (work lost: about "
                                    f"{pre.lost_s:.0f} worker-second(s))")
        for r in pre.victims:
            self._preempt(r.job, job, r.lost_s)
        return (f"waiting for {len(pre.victims)} job(s) it preempted ({names}) to save a "
                "checkpoint and stop")

    def _preempt(self, victim: Job, by: Job, lost_s: float) -> None:
        """Stops ``victim`` for ``by``: a notice to save and stop, or at once when it cannot
        save on notice; it then waits behind ``by``."""
        assert by.spec is not None
        rec = victim.recovery
        rec.preempted_by = by.id
        rec.preemptions += 1
        why = (f"preempted by {by.id} (queue {by.spec.queue}, priority "
               f"{by.spec.priority or 'default'})")
        save = self._save_at(victim, PREEMPT_DEADLINE_S)
        if save.step:
            self._save_and_stop(victim, save.step, PREEMPT_DEADLINE_S, "preempted",
                                f"{why}: every task saves a checkpoint after step {save.step} "
                                "and stops; the job waits behind it and resumes from that step")
            return
        self._event(victim, "preempted", f"{why}: it cannot save on notice ({save.reason}); it "
                                         f"stops now and resumes from "
                                         + (f"its checkpoint at step {victim.checkpoint_step}"
                                            if victim.checkpoint_step else "the start")
                                         + f" (about {lost_s:.0f} worker-second(s) lost)")
        self._restart(victim, why, failure=False)
        rec.restart_at = self.clock()  # it waits in the order, not in a backoff

    def _placed_again(self, job: Job) -> None:
        """``job`` was placed: a preemption it made or suffered is over."""
        self._preempting.pop(job.id, None)
        self._tried_preempt.pop(job.id, None)
        job.position, job.estimated_start = 0, 0.0
        if job.recovery.preempted_by:
            job.recovery.preempted_by = ""
