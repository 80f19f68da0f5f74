"""The control loop: on every wake-up (and at least every tick interval) it judges the agents'
silence, retires and expires ended jobs, collects unheld uploads, and asks
``decisions.on_tick`` what to do with each waiting job: place it (``coordinator.placement``,
on the room ``ClusterState`` keeps), resume it after a restart, take its memory probe's
figures, or fail it. A placement is written before its tasks' starts are queued to their agents.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import re
import time
from typing import Any, Callable

from strata import strategies
from strata.coordinator import decisions, policy
from strata.coordinator.agents import (
    NO_NEEDS, CallWait, HeartbeatDelay, LiveWorker, Needs, StartTaskCommand,
)
from strata.coordinator.blobs import BlobStore
from strata.coordinator.disk import DiskGuard
from strata.coordinator.preemption import PREEMPT_DEADLINE_S, Preemptions
from strata.coordinator.queueing import Queueing
from strata.coordinator.placement import Capacity, Placement, Room, TaskDemand, place
from strata.coordinator.state import ClusterState
from strata.coordinator.store import Store
from strata.errors import DiskFull
from strata.taskconfig import REPORT_INTERVAL_S, TaskConfig
from strata.tfconfig import build_tf_config
from strata.jobspec import JobSpec
from strata.queues import Share
from strata.types import FailureKind, Job, JobPlan, JobState, Task
from strata.units import format_size

log = logging.getLogger("strata.coordinator")

#: the least time between two ticks of the control loop
MIN_TICK_GAP_S = 0.05
#: a gap between ticks longer than this (real time) means the event loop was held up
LOOP_STALL_S = 2.0
#: the most the wait of heartbeats before they are handled may add to the heartbeat timeout,
#: in timeouts: a dead agent is still judged within (1 + this) timeouts under any burst
MAX_DELAY_ALLOWANCE = 5.0
#: how often finished jobs are checked against --retention
EXPIRY_INTERVAL_S = 60.0
#: seconds between checks whether an elastic job may grow, when no room has freed meanwhile
GROW_CHECK_S = 5.0
#: seconds a kept room is used without being computed again while no room moved (its
#: expected start comes from the running jobs' rates, which move slowly)
RESERVATION_REFRESH_S = 5.0
_KEPT = "; its room is kept"  # what a waiting job's message adds while its room is kept
#: waiting jobs whose room is kept at once, at most. A job keeps its room from the pass it is
#: the head of the order and does not fit until it starts, stops waiting, or its queue's limit
#: holds it back, wherever the order puts it meanwhile: the order changes from pass to pass
#: (fair share, queues under their nominal share), and a room that moved with it let the widest
#: jobs wait for days (``bench/sched_sim.py``). Each room is computed on the agents the older
#: ones leave (``_keep_room``), so a later head cannot take an earlier one's room.
KEPT_ROOMS = 8


def _when(start: float | None, now: float) -> str:
    """When a reservation is expected to start, in words."""
    if start is None:
        return " (its start is not known: the jobs it waits for name no time limit)"
    wait = max(0.0, start - now)
    return f", expected to start in about {wait / 60:.0f} min" if wait >= 90 \
        else f", expected to start in about {wait:.0f} s"


@functools.lru_cache(maxsize=1024)  # a thousand waiting jobs share a handful of messages
def _shape(message: str) -> str:
    """A message with its numbers left out: what kind of thing it says."""
    return re.sub(r"[0-9][0-9.,]*", "#", message)


class ControlLoop(Preemptions):
    """The control loop over the jobs' lifecycle (``Coordinator`` adds the API)."""

    #: the state directory's room (``coordinator.disk``), set by ``Coordinator``
    disk: DiskGuard

    def __init__(self, store: Store, state: ClusterState, blobs: BlobStore,
                 clock: Callable[[], float], *, monotonic: Callable[[], float],
                 heartbeat_timeout_s: float, tick_interval_s: float, start_timeout_s: float,
                 retention_s: float):
        super().__init__(store, state, blobs, clock)
        #: finished jobs are deleted this long after they ended (``--retention``; 0: kept)
        self.retention_s = retention_s
        self._next_expiry = 0.0
        self._next_collection = 0.0
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.tick_interval_s = tick_interval_s
        self.start_timeout_s = start_timeout_s
        self._scheduled_at: dict[str, float] = {}  # job id -> when it was placed (this process)
        #: what agents' silence is measured on (``LiveWorker.heard``): it never steps
        self.monotonic = monotonic
        #: STRATA_CHECK_STATE=1 (the test suite sets it): every tick checks the state's indexes
        #: against a scan (``ClusterState.check``), and a mismatch stops the control loop
        #: rather than being logged and passed
        self._check_state = os.environ.get("STRATA_CHECK_STATE") == "1"
        #: per waiting job, the room version and demands it last failed to fit at: it is not
        #: tried again until one of them moves (``_try_schedule``)
        self._tried: dict[str, tuple[Any, ...]] = {}
        self._grow_version, self._next_grow = -1, 0.0
        self._next_limits = 0.0  # when jobs are next held to their training.time_limit
        #: with queues: the room of the first waiting job this pass that does not fit (kept, or
        #: without agents when ``KEPT_ROOMS`` are kept for others already)
        self._reservation: policy.Reservation | None = None
        #: with queues: the rooms kept for waiting jobs (``KEPT_ROOMS``), job id -> its room, the
        #: room version it was computed at and when; oldest first
        self._kept: dict[str, tuple[policy.Reservation, int, float]] = {}
        #: with queues: each queue's room kept this pass for the first job its limit holds
        #: back (``_keep_queue_room``)
        self._queue_kept: dict[str, policy.Reservation] = {}
        #: the jobs given an estimated start by the last pass (the next one clears them)
        self._estimated: list[Job] = []
        #: the queues (``--queues``): order, shares, fair share (``Coordinator`` sets them)
        self.queueing = Queueing()
        self._init_preemption()
        #: when agents are next judged (monotonic): once a tick interval, not on every wake-up
        self._next_judgement = 0.0
        #: each waiting job's needs (``Needs.of`` its spec, which does not change)
        self._needs: dict[str, Needs] = {}
        #: during a tick: the capacities by job needs, and the placements that failed by
        #: (needs, demands), both dropped as soon as a job is placed (``tick``)
        self._tick_cache: dict[Any, Any] | None = None
        self._tick_failed: dict[Any, Any] = {}
        self._tick_version = 0
        self._last_tick_mono = 0.0
        #: how long heartbeats wait before they are handled: added to the timeout (``tick``)
        self.heartbeat_delay = HeartbeatDelay()
        #: how long a new call waits before it is answered, when a probe measures it
        #: (``callprobe.CallProbe``): added to the timeout too (``tick``)
        self.call_wait = CallWait()
        self._delay_noted = False
        self._disk_full_said = 0.0
        self._stopping = False

    def delete(self, job_id: str) -> Job:
        """Forgets a finished job (``Coordinator.delete``: the API's, which ``_expire`` uses)."""
        raise NotImplementedError

    async def run(self) -> None:
        """The control loop: a tick on every wake-up, and at least every tick_interval_s."""
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.tick_interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                self.tick()
            except DiskFull as e:  # said once a minute, never a traceback a tick
                now = self.clock()
                if now - self._disk_full_said >= 60.0:
                    self._disk_full_said = now
                    log.error("control loop tick: %s", e)
            except Exception:  # a bug in one tick must not stop the control plane
                log.exception("control loop tick failed")
                if self._check_state:
                    raise
            # Wake-ups that come while a tick runs are served by the next one, at most
            # MIN_TICK_GAP_S later: a burst of registrations or reports costs a few ticks,
            # not one each, and the calls queued meanwhile are handled in between.
            await asyncio.sleep(MIN_TICK_GAP_S)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self.agents.close()

    def tick(self) -> None:
        """One step of the control loop: detect lost agents, then schedule pending jobs."""
        now = self.clock()
        # After the event loop was held up (a long disk write, a slow plan, the whole machine
        # paused), heartbeats that arrived meanwhile still wait to be handled, and agents had
        # nobody to talk to: the time the loop did not run is not counted against them. Their
        # silence is what the coordinator did not hear while it could listen.
        mono = time.monotonic()
        gap = mono - self._last_tick_mono if self._last_tick_mono else 0.0
        self._last_tick_mono = mono
        # Heartbeats can also wait in front of the handlers, not the loop (in the gRPC server's
        # queue, behind thousands of registrations): an agent is lost only once silent for the
        # timeout plus how long heartbeats handled lately had waited (``HeartbeatDelay``), or
        # a new call waits to be answered (``CallWait``: a stream opened again, a unary
        # heartbeat), whichever is longer.
        delay = min(max(self.heartbeat_delay.estimate(now), self.call_wait.estimate(mono)),
                    MAX_DELAY_ALLOWANCE * self.heartbeat_timeout_s)
        if (delay > 1.0) != self._delay_noted:
            self._delay_noted = delay > 1.0
            log.warning("calls wait %.1f s before they are handled; agents are judged "
                        "lost after %.1f s", delay, self.heartbeat_timeout_s + delay)
        if gap > max(LOOP_STALL_S, 4 * self.tick_interval_s):
            log.warning("the control loop was held up %.1f s: not counted against the agents' "
                        "heartbeats", gap)
            self.agents.excuse(gap)
        heard_now = self.monotonic()
        if heard_now >= self._next_judgement:
            # every agent is looked at: once a tick interval, not on each of the wake-ups a
            # stream of submits and reports brings (5,000 agents: about 1 ms each time)
            self._next_judgement = heard_now + self.tick_interval_s
            for w in self.agents.expired(heard_now, self.heartbeat_timeout_s + delay):
                self._mark_lost(w)
        for job_id in self.state.retire_over():
            self._tried.pop(job_id, None)
            self._needs.pop(job_id, None)
            self._tried_preempt.pop(job_id, None)
        if self._notices:
            self._notices_due(now)
        self._expire(now)  # (after: it takes the jobs that are over out of the live ones)
        self._collect(now)
        self._tick_cache, self._tick_failed = {}, {}
        self._tick_version = self.state.room_version
        try:
            self._schedule(now)
        finally:
            self._tick_cache, self._tick_failed = None, {}
        if self._check_state:
            self.state.check()

    def _expire(self, now: float) -> None:
        """Deletes jobs that ended more than ``retention_s`` ago (``--retention``)."""
        if not self.retention_s or now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRY_INTERVAL_S
        old = self.state.due_for_deletion(now, self.retention_s)
        for job_id in old:
            self.delete(job_id)
        if old:
            log.info("deleted %d job(s) that ended more than %g s ago", len(old),
                     self.retention_s)

    def _collect(self, now: float) -> None:
        """Deletes the uploaded files nobody holds any more (``BlobStore.collect``) and makes
        the disk's ballast again once there is room, every ``EXPIRY_INTERVAL_S``."""
        if now < self._next_collection:
            return
        self._next_collection = now + EXPIRY_INTERVAL_S
        files, freed = self.blobs.collect()
        if files:
            log.info("deleted %d uploaded file(s) no job names (%s)", files, format_size(freed))
        self.disk.restore()

    def _mark_lost(self, w: LiveWorker, why: str = "") -> None:
        why = why or f"no heartbeat for {self.heartbeat_timeout_s:g} s"
        log.warning("worker %s lost: %s", w.name, why)
        self.state.agent_lost(w)
        for job, t in decisions.lost_with(self.state.live.values(), w.name):
            self._fail_task(job, t, FailureKind.LOST, f"worker {w.name} lost ({why})")

    def _schedule(self, now: float) -> None:
        # a copy: scheduling a job may end another (a failed probe fails its job)
        jobs = list(self.state.ordered())
        self._reservation = None  # the head of the order that does not fit, this pass
        self._queue_kept = {}  # each queue's first job its limit holds back, this pass
        self._new_pass()
        waiting: list[Job] = []
        if self.queueing.configured:
            # the policy's order of the waiting jobs (preempted ones among them), after those
            # placed or being restarted
            others: list[Job] = []
            stopping: list[Job] = []  # preempted, its tasks not all gone: they hold room
            pending, restarting = JobState.PENDING, JobState.RESTARTING  # (locals: 10,000 jobs)
            for j in jobs:  # (``_waiting``, inline)
                if j.state is pending:
                    waiting.append(j)
                elif j.state is restarting and j.recovery.preempted_by:
                    waiting.append(j)
                    stopping.append(j)
                else:
                    others.append(j)
            self.queueing.begin_tick(others + stopping, now)
            waiting = self.queueing.order(waiting, now)
            for i, j in enumerate(waiting, 1):
                j.position = i
            for j in self._estimated:
                j.estimated_start = 0.0
            self._estimated = []
            self._keep_rooms(now)
            jobs = others
        for job in jobs:
            if job.state in decisions.TICK_STATES:
                self._tick_job(job, now)
        if waiting:
            self._tick_waiting(waiting, now)
            if self._kept:
                self._refresh_kept(now)
        if self._elastic and (self.state.room_version != self._grow_version
                              or now >= self._next_grow):
            self._grow_version, self._next_grow = self.state.room_version, now + GROW_CHECK_S
            self._grow(now)
        if now >= self._next_limits:
            self._next_limits = now + GROW_CHECK_S
            # (only jobs that have started: not the thousands waiting)
            for job in [j for j in self.state.ordered() if j.started_at]:
                why = decisions.past_time_limit(job, now)
                if why:
                    self._stop_job(job, JobState.FAILED, why)

    def _tick_job(self, job: Job, now: float) -> None:
        """What this pass does with live ``job`` (``decisions.on_tick``)."""
        since = self._scheduled_at.setdefault(job.id, now) \
            if job.state == JobState.SCHEDULED else 0.0
        step = decisions.on_tick(job, now, probing=job.id in self._probe_of,
                                 scheduled_since=since, start_timeout_s=self.start_timeout_s)
        if step.action == decisions.FAIL_JOB:
            self._stop_job(job, JobState.FAILED, step.message)
        elif step.action == decisions.PLACE:
            self._try_schedule(job)
        elif step.action == decisions.AFTER_PROBE:
            if self._after_probe(job):
                self._try_schedule(job)
        elif step.action == decisions.RESUME:
            self._resume(job)
            if job.state == JobState.RESTARTING:
                self._try_schedule(job)

    def _tick_waiting(self, waiting: list[Job], now: float) -> None:
        """The waiting jobs, in the policy's order. Once the head of the order has its room
        kept, a job is passed over without a look when no agent has room for its smallest
        task and no preemption would start for it this pass (it has no deadline to meet and
        no probe to read): it would only fail to place again. So a pass over ten thousand
        waiting jobs on a full cluster costs a few comparisons each
        (``bench/control_plane.py --queues``); such a job keeps its message until room
        frees."""
        standing, room, probing = self.queueing.standing, self.state.room, self._probe_of
        for i, job in enumerate(waiting):
            if self._reservation is not None:
                break
            self._tick_job(job, now)
        else:
            return
        # The head has its room kept. What is left is passed over by its standing (queue,
        # priority, size), which thousands share: the jobs of a standing whose smallest task
        # no agent has room for, and for which no preemption would start, are left out in one
        # sweep (room only shrinks while the pass places jobs); the others are looked at.
        largest = room.largest_free()
        # (the jobs of a standing share one object, ``Queueing.order``: by identity, ten
        # thousand look-ups cost a few milliseconds)
        kinds = {id(s): s for s in standing.values()}
        skip = {k for k, s in kinds.items() if s.smallest > largest and self._class_settled(s)}
        # a queue's first job its limit holds back keeps the queue's room, skipped or not
        held = {k for k in skip if kinds[k].queue not in self._queue_kept
                and not self.queueing.has_room(kinds[k].queue, Share(kinds[k].workers,
                                                                     kinds[k].memory_bytes))}
        for q in {kinds[k].queue for k in held}:
            first = next((j for j in waiting[i:] if id(standing[j.id]) in held
                          and standing[j.id].queue == q), None)
            if first is not None:
                self._keep_queue_room(first)
        pending = JobState.PENDING
        for job in [j for j in waiting[i:]
                    if id(standing[j.id]) not in skip or j.state is not pending
                    or j.recovery.capacity_deadline or j.id in probing]:
            st = standing.get(job.id)
            if st is not None and st.smallest > largest \
                    and (job.state is JobState.PENDING or job.recovery.replanned) \
                    and not job.recovery.capacity_deadline and job.id not in probing \
                    and self._preemption_settled(job, st):
                continue
            if job.state in decisions.TICK_STATES:
                self._tick_job(job, now)
                largest = room.largest_free()  # (it may have placed a job, or stopped one)

    def _tick_fresh(self) -> bool:
        """Whether the tick's caches may be used: inside a tick, and dropped first if room
        grew since they were filled (a task ended while the tick ran)."""
        if self._tick_cache is None:
            return False
        if self._tick_version != self.state.room_version:
            self._tick_cache.clear()
            self._tick_failed.clear()
            self._tick_version = self.state.room_version
        return True

    def _capacities(self, needs: Needs = NO_NEEDS) -> list[Capacity]:
        """The agents that can take tasks now and meet ``needs``, in the agents' order."""
        if self._tick_fresh():  # within one tick, until a job is placed or room grows
            assert self._tick_cache is not None
            caps = self._tick_cache.get(needs)
            if caps is None:
                caps = self._tick_cache[needs] = self._capacities_now(needs)
            return caps
        return self._capacities_now(needs)

    def _capacities_now(self, needs: Needs) -> list[Capacity]:
        return self.state.capacities(needs)

    def _place(self, demands: list[TaskDemand], needs: Needs) -> Placement:
        if needs == NO_NEEDS:  # every agent in the room: its kept order serves
            return self.state.room.place(demands)
        return place(demands, self._capacities(needs))

    def _try_schedule(self, job: Job) -> None:
        assert job.spec is not None
        # Nothing that could make room has happened since this job last failed to fit, and
        # its demands are the same: it would fail again (placement is deterministic, and other
        # placements only take room). Waiting jobs cost a tick nothing until something moves.
        waiting = self.queueing.configured and self._waiting(job)
        behind = self._behind_preemptor(job) if waiting else ""
        if behind:
            self._kept.pop(job.id, None)
            self._wait_with(job, behind)
            return
        key = (self.state.room_version, tuple(t.memory_budget_bytes for t in job.tasks))
        if self._tried.get(job.id) == key:
            said = ""
            if waiting and self._reservation is None:
                if self.queueing.blocked(job):
                    self._kept.pop(job.id, None)  # its queue's room is kept instead
                else:  # the head, still waiting: its room is kept (from now, or still)
                    said = self._reserve(job)
                    if _KEPT in job.message:
                        said = ""
            said += self._preempt_for(job) if waiting else ""
            if said and said not in job.message:
                self._wait_with(job, job.message + said)
            return
        held_back = self.queueing.blocked(job) if waiting else ""
        if held_back and job.spec.elastic and not job.recovery.probe_of \
                and job.id not in self._probe_of and self._place_narrower(job):
            self._try_schedule(job)  # narrower, its queue may hold it
            return
        if held_back:
            self._kept.pop(job.id, None)  # its queue's room is kept instead
            kept = self._keep_queue_room(job) if waiting else ""
            self._wait_with(job, held_back + kept + self._preempt_for(job))
            return
        needs = self._needs.get(job.id)
        if needs is None:
            needs = self._needs[job.id] = Needs.of(job.spec)
        # a job with the same needs and demands already failed this tick, on the same room
        placement = self._tick_failed.get((needs, key[1])) if self._tick_fresh() else None
        if placement is None:
            demands = [TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in job.tasks]
            placement = self._place(demands, needs)
        # (an elastic job's width is set with its probe's measures; a probe keeps its own)
        if job.spec.elastic and job.id not in self._probe_of and not job.recovery.probe_of and (
                self._start_wider(job) if placement.assignments else self._place_narrower(job)):
            self._try_schedule(job)
            return
        if not placement.assignments:
            self._tried[job.id] = key
            if self._tick_cache is not None:
                self._tick_failed[(needs, key[1])] = placement
            reserved = ""
            if waiting and self._reservation is None:
                reserved = self._reserve(job)
            self._wait_with(job, placement.reason + reserved
                            + (self._preempt_for(job) if waiting else ""))
            return
        r = None
        if waiting:
            placement, r = self._off_kept(job, needs, placement)
        if r is not None:
            room = f"room in queue {r.queue}" if r.queue else "room"
            self._wait_with(job, f"waiting behind {r.job_id}, the job ahead of it, whose "
                                 f"{room} is kept{_when(r.start, self.clock())}: this job "
                                 "would take some of it" + (
                                     "" if policy.expected_duration(job) else
                                     " (with a training.time_limit that ends before, it could "
                                     "run meanwhile)"))
            return
        self._place_job(job, placement)
        self.queueing.placed(job)
        self._kept.pop(job.id, None)
        self._placed_again(job)

    def _off_kept(self, job: Job, needs: Needs, placement: Placement,
                  ) -> tuple[Placement, policy.Reservation | None]:
        """Where waiting ``job`` starts, placed as ``placement`` first, and the room kept for
        another job it would delay there (None: it starts). Placed on a room kept for another
        job, it is placed off the kept rooms where it fits there (a job keeping its own room so
        goes there, not on another's; one of a higher class leaves a lower one's room be when
        it can), else off those it honours."""
        r = self._delayed(job, placement)
        if (r is not None and not r.queue) or self._on_kept(job, placement):
            elsewhere = self._place_off_kept(job, needs, every=True)
            if not elsewhere.assignments and r is not None and not r.queue:
                elsewhere = self._place_off_kept(job, needs, every=False)
            if elsewhere.assignments:
                return elsewhere, self._delayed(job, elsewhere)
        return placement, r

    def _on_kept(self, job: Job, placement: Placement) -> bool:
        """Whether ``placement`` takes an agent of a room kept for another job."""
        agents = placement.assignments.values()
        return any(k != job.id and not r.agents.isdisjoint(agents)
                   for k, (r, _, _) in self._kept.items())

    def _place_off_kept(self, job: Job, needs: Needs, *, every: bool) -> Placement:
        """``job`` placed on the agents of no room kept for another job (``every``), or of no
        room it keeps off (``_kept_rooms``). The agents left are kept in order for the tick,
        until room moves, per set of rooms left out (which jobs of a class share)."""
        kept = super()._kept_rooms(job) + [r for k, (r, _, _) in self._kept.items()
                                           if k != job.id] if every else self._kept_rooms(job)
        kept = [k for k in kept if k.agents]
        key = ("off kept", needs, tuple(sorted((k.job_id, hash(k.agents)) for k in kept)))
        fresh = self._tick_fresh()
        room = self._tick_cache.get(key) if fresh and self._tick_cache is not None else None
        if room is None:
            avoid = {a for k in kept for a in k.agents}
            room = Room([c for c in self._capacities(needs) if c.name not in avoid])
            if fresh and self._tick_cache is not None:
                self._tick_cache[key] = room
        return room.place([TaskDemand(t.role, t.index, t.memory_budget_bytes)
                           for t in job.tasks])

    def _delayed(self, job: Job, placement: Placement) -> policy.Reservation | None:
        """The room kept for another job that ``job`` placed as ``placement`` would delay
        (``policy.delays``), or None."""
        assert job.spec is not None
        duration, now = policy.expected_duration(job), self.clock()
        return next((r for r in [*self._queue_kept.values(), *self._kept_rooms(job)]
                     if r.job_id != job.id and policy.delays(
                         r, placement.assignments.values(), duration, now, job.spec.queue)),
                    None)

    def _preempt_for(self, job: Job) -> str:
        """A waiting ``job`` that does not start: its preemption in flight keeps its room, or
        one is started where the policy allows (``Preemptions._try_preempt``). Returns what its
        wait adds ("" when neither)."""
        pre = self._in_flight(job)
        if pre is not None:
            if self._reservation is None or self._reservation.job_id == job.id:
                self._reservation = policy.Reservation(job.id, pre.agents, None)
            return (f"; waiting for the job(s) it preempted "
                    f"({', '.join(r.job.id for r in pre.victims)}) to save and stop")
        if self._reservation is not None and self._reservation.job_id == job.id \
                and self._reservation.start is not None \
                and self._reservation.start <= self.clock() + PREEMPT_DEADLINE_S:
            return ""  # its room frees before a preemption's would
        said = self._try_preempt(job)
        if said:
            self._kept.pop(job.id, None)  # the victims' agents are its room now
            if self._reservation is None or self._reservation.job_id == job.id:
                self._reservation = policy.Reservation(job.id, self._preempting[job.id].agents,
                                                       None)
        return "; " + said if said else ""

    def _keep_queue_room(self, job: Job) -> str:
        """Keeps its queue's room for ``job``, the first waiting job of its queue this pass
        that the queue's limit holds back: later jobs of that queue start only where they do
        not delay it (``policy.delays``), so a wide job is not overtaken for ever by a stream
        of narrow ones of its own queue. Returns the words its wait adds."""
        assert job.spec is not None
        q = self.queueing.queues.get(job.spec.queue)
        if q is None or q.name in self._queue_kept:
            return ""
        now = self.clock()
        running = [(j, policy.expected_end(j, now)) for j in self.state.ordered()
                   if j.state in policy.HOLDING and j.spec is not None
                   and j.spec.queue == q.name]
        kept = self._queue_kept[q.name] = policy.queue_start(job, q, self.queueing.use,
                                                             running, now)
        job.estimated_start = kept.start or 0.0
        self._estimated.append(job)
        return f"; its room in the queue is kept{_when(kept.start, now)}"

    def _reserve(self, job: Job) -> str:
        """``job``, the first waiting job this pass that does not fit, keeps its room: later
        jobs start only where they do not delay it (``policy.delays``), this pass and the next
        ones until it starts (``KEPT_ROOMS``). Returns the words its wait adds ("; its room is
        kept: expected to start in about 5 min")."""
        now = self.clock()
        kept = self._kept.get(job.id)
        if kept is None and len(self._kept) >= KEPT_ROOMS:
            # the rooms of jobs that came first are kept: this one's is, once one of them starts
            self._reservation = policy.Reservation(job.id, frozenset(), None)
            return ""
        if kept is not None and not self._stale(kept, now):
            self._reservation = kept[0]  # nothing moved lately: the same room, the same start
        else:
            self._reservation = self._keep_room(job, now)
        if not self._reservation.agents:
            return ""
        job.estimated_start = self._reservation.start or 0.0
        self._estimated.append(job)
        return f"{_KEPT}{_when(self._reservation.start, now)}"

    def _keep_room(self, job: Job, now: float) -> policy.Reservation:
        """Computes the room kept for waiting ``job``: where and when it would start on the
        agents kept neither for the jobs that kept theirs before it (the older rooms come first:
        a job keeps its place among them until it starts) nor for preemptors. A newer room that
        the new one overlaps is computed again at the pass's end, so rooms do not overlap for
        long. A job that keeps no room yet and finds none keeps none; one that kept a room keeps
        its place with none (an agent lost, say) until one is found."""
        assert job.spec is not None
        taken: set[str] = set()
        for k, (r, _, _) in self._kept.items():
            if k == job.id:
                break
            taken |= r.agents
        taken.update(a for p in self._preempting.values() if p.job_id != job.id
                     for a in p.agents)
        caps = self.state.capacities(Needs.of(job.spec))
        if taken:
            caps = [c for c in caps if c.name not in taken]
        running = [(j, policy.expected_end(j, now)) for j in self.state.ordered()
                   if j.state in policy.HOLDING]
        r = policy.reserve(job, caps, running, now)
        if not r.agents and job.id not in self._kept:
            return r
        after = False
        for k, (other, v, at) in self._kept.items():
            if after and other.agents & r.agents:
                self._kept[k] = (other, -1, at)  # (computed again at the pass's end)
            after = after or k == job.id
        self._kept[job.id] = (r, self.state.room_version, now)
        return r

    def _stale(self, kept: tuple[policy.Reservation, int, float], now: float) -> bool:
        """Whether a kept room is to be computed again: an older room overlaps it, or room
        moved since it was and it is older than ``RESERVATION_REFRESH_S``."""
        _, version, at = kept
        return version < 0 or (version != self.state.room_version
                                and now - at >= RESERVATION_REFRESH_S)

    def _keep_rooms(self, now: float) -> None:
        """At a pass's start: the rooms kept for jobs that no longer wait (started, ended,
        deleted, or waiting behind the job that preempted them) are given up; the others say
        their holder's expected start."""
        for job_id in list(self._kept):
            job = self.jobs.get(job_id)
            if job is None or not self._waiting(job) or self._behind_preemptor(job):
                del self._kept[job_id]
                continue
            job.estimated_start = self._kept[job_id][0].start or 0.0
            self._estimated.append(job)

    def _refresh_kept(self, now: float) -> None:
        """At a pass's end, the stale kept rooms (``_stale``) are computed again, oldest
        first: a kept room follows the cluster (its agents and start as jobs end, start and
        report their rates). Computed less often (one a pass), stale rooms cost the simulated
        week a point of utilisation and the widest jobs 37 more hours of waiting
        (``bench/sched_sim.py``)."""
        for job_id in list(self._kept):
            kept = self._kept.get(job_id)
            job = self.jobs.get(job_id)
            if kept is not None and job is not None and self._stale(kept, now):
                job.estimated_start = self._keep_room(job, now).start or 0.0

    def _kept_rooms(self, job: Job) -> list[policy.Reservation]:
        """The rooms ``job`` keeps off: preemptors' (``Preemptions._kept_rooms``) and those kept
        for other waiting jobs of its priority class or a higher one (``policy.honours``)."""
        rooms = super()._kept_rooms(job)
        if self._kept:
            where = self.queueing.priority(job)
            for k, (r, _, _) in self._kept.items():
                holder = self.jobs.get(k)
                if k != job.id and holder is not None and policy.honours(
                        policy.Place("", where), policy.Place("", self.queueing.priority(holder))):
                    rooms.append(r)
        return rooms

    def _queue_holds(self, spec: JobSpec, plan: JobPlan, holding: Job | None) -> bool:
        return self.queueing.holds(spec, Share(len(plan.tasks), sum(
            t.memory_budget_bytes for t in plan.tasks)), holding)

    def _waits_for_room(self, job: Job) -> bool:
        return super()._waits_for_room(job) and not (
            self._waiting(job) and self.queueing.blocked(job))

    def _wait_with(self, job: Job, reason: str) -> None:
        """``job`` waits for ``reason``."""
        if job.message != reason:
            # Only a new kind of reason is stored and becomes an event: counts in it ("3 of
            # 980 workers") change with every agent that comes or goes, and a write and an
            # event per waiting job per registration stalled the loop with many waiting.
            news = _shape(job.message) != _shape(reason)
            job.message = reason
            if news:
                self.store.put_job(job)
                self._event(job, "message", reason)

    def _place_job(self, job: Job, placement: Placement) -> None:
        """``job`` placed as ``placement`` says: written first (its tasks with their workers and
        ports, the job SCHEDULED), so a full disk leaves it waiting as it was; then its budgets
        and ports are taken, and its tasks' starts queued."""
        order = sorted(job.tasks, key=lambda t: (t.role, t.index))
        lives = [self.workers[placement.assignments[(t.role, t.index)]] for t in order]
        taken: dict[str, int] = {}
        placed: dict[tuple[str, int], Task] = {}
        for t, live in zip(order, lives):
            i = taken[live.name] = taken.get(live.name, -1) + 1
            placed[(t.role, t.index)] = self.state.placed(t, live, i)
        message = "placed on " + ", ".join(
            f"{t.role}:{t.index}->{placed[(t.role, t.index)].worker}" for t in job.tasks)
        if job.started_at:  # a run after a restart: its training time counts from now
            job.recovery.run_began = self.clock()
        self.store.put_tasks(placed.values())
        self.store.put_job(dataclasses.replace(job, state=JobState.SCHEDULED, message=message))
        cluster: dict[str, list[str]] = {}
        for t, live in zip(order, lives):
            self.state.place_task(t, live)
            cluster.setdefault(t.role, []).append(t.address)
        if self._tick_cache is not None:  # room was taken: what failed may fail differently
            self._tick_cache.clear()
            self._tick_failed.clear()
        self._scheduled_at[job.id] = self.clock()
        self._set_job_state(job, JobState.SCHEDULED, message, stored=True)
        for t in job.tasks:
            self._send_start(job, t, cluster)

    def task_config(self, job: Job, t: Task) -> TaskConfig:
        """The task contract for ``t``, from the stored plan (the agent adds its settings)."""
        assert job.spec is not None
        return TaskConfig(job_id=job.id, role=t.role, index=t.index, spec=job.spec,
                          memory_budget_bytes=t.memory_budget_bytes,
                          report_interval_s=REPORT_INTERVAL_S, restart=job.restarts,
                          probe=bool(job.recovery.probe_of),
                          section=strategies.get(job.strategy).task_section(job, t))

    def _send_start(self, job: Job, t: Task, cluster: dict[str, list[str]] | None = None) -> None:
        if cluster is None:
            cluster = {}
            for x in sorted(job.tasks, key=lambda x: (x.role, x.index)):
                cluster.setdefault(x.role, []).append(x.address)
        self.agents.send(t.worker, StartTaskCommand(
            job_id=job.id, role=t.role, index=t.index, attempt=t.attempt,
            tf_config=build_tf_config(cluster, t.role, t.index),
            memory_budget_bytes=t.memory_budget_bytes, config=self.task_config(job, t)))
