"""Strata's policy in ``bench/sched_sim.py``'s simulated cluster: the coordinator's control
loop with a queues file, pass by pass, in the sequence of ``ControlLoop._schedule``, driving
the same pure decisions (``coordinator/policy.py``); and the four policies by name."""

from __future__ import annotations

from simpolicies import (  # noqa: E402  (the path is set by simpolicies' importer)
    NOTICE_S, PREEMPT_TRIES_PER_PASS, Fifo, Kueue, Placement, Quota, Share, Sim, SimJob, Today,
    Trace, place, policy,
)
from strata.types import JobState

KEPT_ROOMS = 8               # coordinator.loop.KEPT_ROOMS
RESERVATION_REFRESH_S = 5.0  # coordinator.loop.RESERVATION_REFRESH_S


class Strata(Quota):
    """The coordinator with a queues file, pass by pass as ``ControlLoop._schedule``."""

    name = "strata"

    def __init__(self, trace: Trace, pass_gap: float) -> None:
        super().__init__(trace, pass_gap)
        self.fair = policy.FairShare(trace.queues.fair_share_half_life_s)
        self._charged_at = 0.0
        self.reservation: policy.Reservation | None = None
        #: the rooms kept across passes (ControlLoop._kept): job id -> room, version, when
        self.kept: dict[str, tuple[policy.Reservation, int, float]] = {}
        self._preempting: dict[str, policy.Preemption] = {}
        self._tried_preempt: dict[str, int] = {}
        self._metrics_at = -1.0

    # --- a pass (ControlLoop._schedule, _tick_waiting, _try_schedule) -------------------------

    def schedule(self, now: float) -> None:
        dt = now - self._charged_at if self._charged_at else 0.0
        self._charged_at = now
        if dt > 0:  # Queueing.begin_tick
            for owner, workers in self.owner_workers.items():
                if workers:
                    self.fair.charge(owner, workers * dt, now)
        self.reservation = None
        self.queue_kept: dict[str, policy.Reservation] = {}
        self._preempted_this_pass, self._tries = False, 0
        self._candidates: list[policy.Running] | None = None
        self._lowest: dict[str, int] | None = None
        self._may: dict[policy.Standing, bool] = {}
        ordered = [self.sims[j.id] for j in policy.order(
            ((sj.job, sj.standing) for sj in self.waiting.values()), self.queues, self.use,
            self.fair, now)]
        self._keep_rooms()
        self._tick_waiting(ordered, now)
        if self.kept:
            self._refresh_kept(now)

    def _tick_waiting(self, ordered: list[SimJob], now: float) -> None:
        # _tick_waiting: each job in the order until the head has its room kept...
        for i, sj in enumerate(ordered):
            if self.reservation is not None:
                break
            self._try_schedule(sj, now)
        else:
            return
        # ...then the rest passed over by standing: those whose smallest task no worker has
        # room for and for which no preemption would start; a queue's first job its limit
        # holds back keeps the queue's room, passed over or not
        rest = ordered[i:]
        largest = self.cluster.largest_idle()
        skip = {s: s.smallest > largest and self._class_settled(s)
                for s in {sj.standing for sj in ordered}}
        held = {s for s, sk in skip.items() if sk and s.queue not in self.queue_kept
                and not self._has_room(s.queue, Share(s.workers, s.memory_bytes))}
        for q in {s.queue for s in held}:
            first = next((sj for sj in rest if sj.standing in held and sj.standing.queue == q),
                         None)
            if first is not None:
                self._keep_queue_room(first, now)
        for sj in [sj for sj in rest
                   if not skip[sj.standing] or sj.job.state is not JobState.PENDING]:
            if sj.standing.smallest > largest and sj.job.state is JobState.PENDING \
                    and self._preemption_settled(sj):
                continue
            if sj.id in self.waiting:
                self._try_schedule(sj, now)
                largest = self.cluster.largest_idle()

    def _has_room(self, queue: str, need: Share) -> bool:
        q = self.queues.get(queue)
        return q is None or (self.use.get(q.name, Share()) + need).within(q.limit)

    def _behind(self, sj: SimJob) -> bool:
        """Whether ``sj`` waits behind the job that preempted it (``_behind_preemptor``)."""
        by = self.sims.get(sj.job.recovery.preempted_by) if sj.job.recovery.preempted_by \
            else None
        return by is not None and by.id in self.waiting

    def _try_schedule(self, sj: SimJob, now: float) -> None:
        job = sj.job
        if self._behind(sj):
            self.kept.pop(sj.id, None)
            return  # waiting until its preemptor starts
        if policy.room_for(job, self.queues.get(sj.t.team), self.use):
            self.kept.pop(sj.id, None)
            self._keep_queue_room(sj, now)
            self._preempt_for(sj, now)
            return
        p = self.cluster.place(sj.demands)
        if p is None:
            if self.reservation is None:
                self._reserve(sj, now)
            self._preempt_for(sj, now)
            return
        r = self._delayed(sj, p, now)
        agents = p.assignments.values()
        if r is not None and not r.queue or any(  # off the kept rooms (ControlLoop)
                k != sj.id and not kr.agents.isdisjoint(agents)
                for k, (kr, _, _) in self.kept.items()):
            for every in (True, False):
                rooms = [policy.Reservation(x.job_id, x.agents, None)
                         for x in self._preempting.values() if x.job_id != sj.id] + [
                    kr for k, (kr, _, _) in self.kept.items() if k != sj.id] if every \
                    else self._kept_rooms(sj)
                avoid = {a for k in rooms for a in k.agents}
                elsewhere = place(sj.demands, [c for c in self.cluster.idle_list()
                                               if c.name not in avoid])
                if elsewhere.assignments or r is None or r.queue:
                    break
            if elsewhere.assignments:
                p, r = elsewhere, self._delayed(sj, elsewhere, now)
        if r is not None:  # waiting behind the job whose room is kept
            return
        self.start(sj, p, now)
        self._preempting.pop(sj.id, None)  # _placed_again
        self._tried_preempt.pop(sj.id, None)
        job.recovery.preempted_by = ""

    def _delayed(self, sj: SimJob, p: Placement, now: float) -> policy.Reservation | None:
        duration = policy.expected_duration(sj.job)
        return next((r for r in [*self.queue_kept.values(), *self._kept_rooms(sj)]
                     if r.job_id != sj.id and policy.delays(r, p.assignments.values(), duration,
                                                            now, sj.t.team)), None)

    def _keep_queue_room(self, sj: SimJob, now: float) -> None:
        """ControlLoop._keep_queue_room: the queue's room kept for the first job its limit
        holds back (``policy.queue_start``)."""
        q = self.queues.get(sj.t.team)
        if q is None or q.name in self.queue_kept:
            return
        self._sync_metrics(now)
        running = [(x.job, policy.expected_end(x.job, now)) for x in self.running.values()
                   if x.t.team == q.name]
        self.queue_kept[q.name] = policy.queue_start(sj.job, q, self.use, running, now)

    def _reserve(self, sj: SimJob, now: float) -> None:
        """ControlLoop._reserve: the head keeps its room (at most KEPT_ROOMS kept)."""
        kept = self.kept.get(sj.id)
        if kept is None and len(self.kept) >= KEPT_ROOMS:
            self.reservation = policy.Reservation(sj.id, frozenset(), None)
        elif kept is not None and not self._stale(kept, now):
            self.reservation = kept[0]
        else:
            self.reservation = self._keep_room(sj, now)

    def _keep_room(self, sj: SimJob, now: float) -> policy.Reservation:
        """ControlLoop._keep_room: on the agents the older kept rooms and preemptors' leave."""
        self._sync_metrics(now)
        taken: set[str] = set()
        for k, (r, _, _) in self.kept.items():
            if k == sj.id:
                break
            taken |= r.agents
        taken.update(a for p in self._preempting.values() if p.job_id != sj.id
                     for a in p.agents)
        caps = [c for n, c in self.cluster.caps.items() if n not in taken]
        running = [(x.job, policy.expected_end(x.job, now)) for x in self.running.values()]
        r = policy.reserve(sj.job, caps, running, now)
        if not r.agents and sj.id not in self.kept:
            return r
        after = False
        for k, (other, v, at) in self.kept.items():
            if after and other.agents & r.agents:
                self.kept[k] = (other, -1, at)
            after = after or k == sj.id
        self.kept[sj.id] = (r, self.cluster.version, now)
        return r

    def _stale(self, kept: tuple[policy.Reservation, int, float], now: float) -> bool:
        _, version, at = kept
        return version < 0 or (version != self.cluster.version
                                and now - at >= RESERVATION_REFRESH_S)

    def _keep_rooms(self) -> None:
        """ControlLoop._keep_rooms: rooms of jobs no longer waiting are given up."""
        for job_id in [k for k in self.kept
                       if k not in self.waiting or self._behind(self.sims[k])]:
            del self.kept[job_id]

    def _refresh_kept(self, now: float) -> None:
        """ControlLoop._refresh_kept: each stale kept room computed again."""
        for job_id in list(self.kept):
            kept = self.kept.get(job_id)
            if kept is not None and self._stale(kept, now):
                self._keep_room(self.sims[job_id], now)

    def _sync_metrics(self, now: float) -> None:
        """The running jobs' reported steps, as of ``now`` (what their reports say)."""
        if self._metrics_at == now:
            return
        self._metrics_at = now
        for x in self.running.values():
            x.job.metrics.step = int(x.progress(now) * x.t.rate)

    # --- preemption (ControlLoop._preempt_for, Preemptions._try_preempt) ----------------------

    def _preempt_for(self, sj: SimJob, now: float) -> None:
        job = sj.job
        pre = self._in_flight(sj)
        if pre is not None:
            if self.reservation is None or self.reservation.job_id == job.id:
                self.reservation = policy.Reservation(job.id, pre.agents, None)
            return
        r = self.reservation
        if r is not None and r.job_id == job.id and r.start is not None \
                and r.start <= now + NOTICE_S:
            return  # its room frees before a preemption's would
        if self._try_preempt(sj, now):
            self.kept.pop(sj.id, None)
            if r is None or r.job_id == job.id:
                self.reservation = policy.Reservation(job.id, self._preempting[job.id].agents,
                                                      None)

    def _in_flight(self, sj: SimJob) -> policy.Preemption | None:
        pre = self._preempting.get(sj.id)
        if pre is None:
            return None
        if any(policy.held(r.job).workers for r in pre.victims):
            return pre
        del self._preempting[sj.id]
        return None

    def _kept_rooms(self, sj: SimJob) -> list[policy.Reservation]:
        """ControlLoop._kept_rooms: preemptors' rooms and the kept ones ``sj`` honours."""
        rooms = [policy.Reservation(p.job_id, p.agents, None)
                 for p in self._preempting.values() if p.job_id != sj.id]
        where = policy.Place("", sj.t.priority)
        rooms += [r for k, (r, _, _) in self.kept.items() if k != sj.id and policy.honours(
            where, policy.Place("", self.sims[k].t.priority))]
        return rooms

    def _class_settled(self, st: policy.Standing) -> bool:
        """Whether this pass would not preempt for any waiting job of standing ``st``."""
        return self._preempted_this_pass or self._tries >= PREEMPT_TRIES_PER_PASS \
            or not self._may_find(st)

    def _preemption_settled(self, sj: SimJob) -> bool:
        return self._class_settled(sj.standing) \
            or self._tried_preempt.get(sj.id) == self.cluster.version

    def _pool(self) -> list[policy.Running]:
        if self._candidates is None:
            self._candidates = [policy.Running(x.job, policy.Place(x.t.team, x.t.priority), 0.0)
                                for x in self._preemptible()]
        return self._candidates

    def _may_find(self, st: policy.Standing) -> bool:
        """Preemptions._may_find: one look per queue at its lowest priority."""
        found = self._may.get(st)
        if found is None:
            if self._lowest is None:
                self._lowest = {}
                for r in self._pool():
                    if r.place.priority < self._lowest.get(r.place.queue, r.place.priority + 1):
                        self._lowest[r.place.queue] = r.place.priority
            mine = self.queues.get(st.queue)
            under = mine is not None and (self.use.get(st.queue, Share()) + Share(
                st.workers, st.memory_bytes)).within(mine.nominal)
            found = False
            for name, low in self._lowest.items():
                q = self.queues.get(name)
                if name == st.queue:
                    found = low < st.priority
                elif q is not None and not self.use.get(name, Share()).within(q.nominal):
                    found = under or low < st.priority
                if found:
                    break
            self._may[st] = found
        return found

    def _try_preempt(self, sj: SimJob, now: float) -> bool:
        job = sj.job
        if self._preempted_this_pass or self._tries >= PREEMPT_TRIES_PER_PASS \
                or self._tried_preempt.get(sj.id) == self.cluster.version:
            return False
        self._tried_preempt[sj.id] = self.cluster.version
        if not self._may_find(sj.standing):
            return False
        self._tries += 1
        where = policy.Place(sj.t.team, sj.t.priority)
        pool = [r for r in self._pool()
                if policy.may_preempt(job, where, r, self.queues, self.use)]
        queue = self.queues.get(sj.t.team)
        assert queue is not None
        if not self._could_start(sj, [self.sims[r.job.id] for r in pool], queue.limit):
            return False
        pre = policy.victims(job, where, pool, self._free_for(self.sims[r.job.id] for r in pool),
                             self.queues, self.use)
        if pre is None:
            return False
        duration = policy.expected_duration(job)
        if any(policy.delays(k, pre.agents, duration, now) for k in self._kept_rooms(sj)):
            return False
        self._preempted_this_pass = True
        self._preempting[job.id] = pre
        self._tried_preempt.pop(job.id, None)
        for v in pre.victims:
            self.notice(self.sims[v.job.id], sj, now, NOTICE_S)
        return True


POLICIES: dict[str, type[Sim]] = {"today": Today, "fifo": Fifo, "kueue": Kueue,
                                  "strata": Strata}
