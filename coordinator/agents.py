"""Agent sessions: the worker agents the coordinator knows, their registrations, heartbeats and
command queues, and the pure decisions about them (which agents are lost, how a re-registering
agent's tasks line up with what the coordinator assigned to it).

``Coordinator`` (``coordinator.core``) owns an ``Agents`` and carries out what these decisions
return; nothing here touches jobs.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import logging
import secrets
import threading
from typing import AsyncIterator, Iterable, Mapping

from strata.coordinator.placement import Capacity
from strata.dataroots import under_roots
from strata.coordinator.store import WorkerRecord
from strata.errors import DuplicateAgent, SpecError, UnknownAgentSession
from strata.units import format_size
from strata.taskconfig import TaskConfig
from strata.jobspec import JobSpec
from strata.auth import Caller
from strata.types import DiskStatus, Job, JobState, MemoryStatus, Task, TaskReport, TaskState


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a job needs of an agent besides memory: a shared directory when it checkpoints,
    and data roots that hold its data files (``strata.dataroots``; checked lexically)."""

    shared: bool = False
    paths: tuple[str, ...] = ()

    @classmethod
    def of(cls, spec: JobSpec) -> Needs:
        return cls(shared=bool(spec.checkpoint_every_steps),
                   paths=tuple(p for p in (spec.data.path, spec.data.test_path) if p))

    def met_by(self, rec: WorkerRecord) -> bool:
        if self.shared and not rec.shared_dir:
            return False
        return all(under_roots(p, rec.data_roots) for p in self.paths)


NO_NEEDS = Needs()

log = logging.getLogger("strata.coordinator")


# --- commands pushed to agents ---------------------------------------------------------------

@dataclasses.dataclass
class StartTaskCommand:
    job_id: str
    role: str
    index: int
    attempt: int
    tf_config: str
    memory_budget_bytes: int
    config: TaskConfig


@dataclasses.dataclass
class StopTaskCommand:
    job_id: str
    role: str = ""   # empty: every task of the job on that agent
    index: int = 0
    reason: str = ""
    attempt: int = 0  # only this attempt (a stale one); 0: whichever runs


@dataclasses.dataclass
class PurgeJobCommand:
    """The job was deleted: the agent removes its files (``jobs/JOB_ID/``)."""

    job_id: str


@dataclasses.dataclass
class NoticeCommand:
    """A notice for the job's tasks on the agent: save a checkpoint once step ``step`` is done,
    then stop (``strata drain --deadline``)."""

    job_id: str
    step: int
    attempt: int = 0  # only this attempt; 0: whichever runs


AgentCommand = StartTaskCommand | StopTaskCommand | PurgeJobCommand | NoticeCommand


# --- live agents -----------------------------------------------------------------------------

@dataclasses.dataclass
class LiveWorker:
    """A worker agent as the coordinator sees it now."""

    record: WorkerRecord
    session: str = ""            # empty until the agent (re-)registers after a coordinator start
    last_seen: float = 0.0       # wall clock, for people: when it was last heard
    #: the coordinator's monotonic clock when it last heard the agent (registered or a
    #: heartbeat): what an agent is judged lost by. Not the wall clock, which steps (NTP, a
    #: virtual machine paused and resumed) and would call every agent silent at once.
    heard: float = 0.0
    lost: bool = False
    memory: MemoryStatus = dataclasses.field(default_factory=MemoryStatus)
    free_ports: list[int] = dataclasses.field(default_factory=list)
    queue: asyncio.Queue[AgentCommand | None] | None = None
    pid: int = 0
    #: the credential it registered with (None without authentication): what revoking closes
    caller: Caller | None = None
    #: its work directory's disk, as its last heartbeat said
    disk: DiskStatus = DiskStatus()

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def connected(self) -> bool:
        return bool(self.session) and not self.lost


class Agents:
    """The agents by name. Sessions identify registrations: a call with another session is
    refused (``UnknownAgentSession``) and the agent registers again."""

    def __init__(self, records: Iterable[WorkerRecord], heard: float):
        # Known from before a restart: not schedulable until the agent registers again, and
        # declared LOST if it has not done so within one heartbeat timeout of ``heard``.
        self.workers: dict[str, LiveWorker] = {
            r.name: LiveWorker(record=r, last_seen=r.last_seen, heard=heard, pid=r.pid)
            for r in records}

    def get(self, name: str) -> LiveWorker | None:
        return self.workers.get(name)

    def values(self) -> Iterable[LiveWorker]:
        return self.workers.values()

    def register(self, rec: WorkerRecord, pid: int, free_ports: list[int], now: float,
                 heard: float, heartbeat_timeout_s: float) -> LiveWorker:
        """A (re-)registration: a new session and command queue. A name is one agent: another
        live agent registering under it is refused (``DuplicateAgent``)."""
        live = self.workers.get(rec.name)
        if (live is not None and live.connected and heard - live.heard < heartbeat_timeout_s
                and (live.record.address, live.pid) != (rec.address, pid)):
            raise DuplicateAgent(rec.name, live.record.address, live.pid)
        if live is not None and pid and live.pid == pid and live.record.address == rec.address:
            # the same process again (a reconnect): its device and budget are what they were;
            # what its tasks report is judged against them (``confine``)
            for field, was, now_ in (("budget_bytes", live.record.budget_bytes,
                                      rec.budget_bytes),
                                     ("device", live.record.device, rec.device)):
                if was != now_:
                    raise SpecError(field, f"agent {rec.name} registered with {was} and now "
                                           f"says {now_}: a running agent's {field} does not "
                                           "change (restart it to change it)")
        if live is None:
            live = self.workers[rec.name] = LiveWorker(record=rec)
        else:
            # a drain lasts until the agent restarts (a new process: a new pid)
            rec.draining = live.record.draining and live.pid == pid
            live.record = rec
        rec.pid = pid
        old_queue = live.queue
        live.session = secrets.token_hex(8)
        live.pid = pid
        live.last_seen, live.heard = now, heard
        live.lost = False
        live.free_ports = list(free_ports)
        live.queue = asyncio.Queue()
        if old_queue is not None:
            old_queue.put_nowait(None)  # ends the previous Connect stream, if one is still open
        log.info("worker %s registered (%s, %s, budget %s)", rec.name, rec.address, rec.device,
                 format_size(rec.budget_bytes))
        return live

    def check_session(self, name: str, session: str) -> LiveWorker:
        live = self.workers.get(name)
        if live is None or not live.session or live.session != session:
            raise UnknownAgentSession(f"worker {name!r} is not registered with this session")
        return live

    def expired(self, heard_now: float, timeout_s: float) -> list[LiveWorker]:
        """The agents silent for longer than ``timeout_s`` (on the ``heard`` clock) that are
        not yet marked lost."""
        return [w for w in self.workers.values() if not w.lost and heard_now - w.heard > timeout_s]

    def excuse(self, seconds: float) -> None:
        """The coordinator could not listen for ``seconds`` (its loop was held up): that time
        does not count against any agent's silence."""
        for w in self.workers.values():
            if not w.lost:
                w.heard += seconds

    def mark_lost(self, w: LiveWorker) -> None:
        w.lost = True
        if w.queue is not None:
            w.queue.put_nowait(None)
        w.session = ""

    def send(self, name: str, cmd: AgentCommand) -> None:
        live = self.workers.get(name)
        if live is not None and live.queue is not None:
            live.queue.put_nowait(cmd)

    def broadcast(self, cmd: AgentCommand) -> None:
        """``cmd`` to every connected agent."""
        for w in self.workers.values():
            if w.connected and w.queue is not None:
                w.queue.put_nowait(cmd)

    async def commands(self, name: str, session: str) -> AsyncIterator[AgentCommand]:
        live = self.check_session(name, session)
        queue = live.queue
        assert queue is not None
        while True:
            cmd = await queue.get()
            if cmd is None:
                return
            yield cmd

    def capacities(self, reserved: Mapping[str, int], needs: Needs = NO_NEEDS) -> list[Capacity]:
        """The agents that can take tasks now, of those that meet a job's ``needs``, listed
        afresh: the scan the coordinator's kept room is checked against (``ClusterState.check``; a
        connected agent has a session and is not lost; no needs are met by every agent)."""
        anything = needs == NO_NEEDS
        return [Capacity(rec.name, rec.budget_bytes, rec.budget_bytes - reserved.get(rec.name, 0),
                         len(w.free_ports))
                for w in self.workers.values()
                if w.session and not w.lost and not (rec := w.record).draining
                and (anything or needs.met_by(rec))]

    def close(self) -> None:
        for w in self.workers.values():
            if w.queue is not None:
                w.queue.put_nowait(None)


# --- how long heartbeats wait before they are handled ----------------------------------------

class HeartbeatDelay:
    """How long heartbeats wait between being sent and being handled (behind the other work
    of a saturated coordinator, in the gRPC server and the event loop), so that an agent is
    judged lost by when its heartbeats were sent, not by when they are handled.

    Each heartbeat carries its agent's clock (``sent_at``). Per agent, handled minus sent is
    the clocks' offset plus the wait; its smallest value seen is taken as the offset with no
    wait, so clocks need not agree. That floor may rise by ``drift`` seconds a second, so
    clocks that drift apart (up to 1,000 ppm) are followed, while a wait that builds in
    seconds stands out. The estimate is the median wait of the heartbeats handled in the
    last ``window_s`` (at most ``samples`` of them): one agent with a clock that jumped
    cannot move it. With none handled lately it keeps its last value (a coordinator that
    hears nothing at all judges on the timeout plus that, capped by the caller). Calls not
    yet started (a stream opened again, a unary heartbeat) are not seen here.

    Every wait is also counted, since start, into ``counts`` over ``BUCKETS`` (upper bounds,
    seconds; the last count is beyond them) and ``total``: the histogram
    ``strata_heartbeat_delay_seconds`` that `/metrics` shows."""

    BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 30.0)

    def __init__(self, window_s: float = 2.0, samples: int = 512, drift: float = 1e-3):
        self.window_s = window_s
        self.drift = drift
        self._offset: dict[str, tuple[float, float]] = {}  # name -> (floor, when set)
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=samples)
        self._estimate = 0.0
        self.counts = [0] * (len(self.BUCKETS) + 1)
        self.total = 0.0

    def observe(self, name: str, handled_at: float, sent_at: float) -> None:
        if sent_at <= 0:
            return  # an agent that does not stamp its heartbeats
        offset = handled_at - sent_at
        floor = self._offset.get(name)
        least = offset if floor is None else min(
            offset, floor[0] + self.drift * max(0.0, handled_at - floor[1]))
        self._offset[name] = (least, handled_at)
        wait = offset - least
        self._recent.append((handled_at, wait))
        self.counts[bisect.bisect_left(self.BUCKETS, wait)] += 1
        self.total += wait

    def forget(self, name: str) -> None:
        """A new registration: perhaps another process, or host, under the name."""
        self._offset.pop(name, None)

    def estimate(self, now: float) -> float:
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        if self._recent:
            waits = sorted(w for _, w in self._recent)
            self._estimate = waits[len(waits) // 2]
        return self._estimate


class CallWait:
    """How long a new call waits at this coordinator before it is answered: what a heartbeat
    on a stream being opened again, a unary heartbeat or a registration meets, which
    ``HeartbeatDelay`` cannot see (it learns only from heartbeats that were handled). A probe
    (``callprobe.CallProbe``, a thread) calls the coordinator's own server, one call at a time,
    and marks each try ``sent`` and an answer ``answered`` on its monotonic clock; a call
    refused is tried again, and its wait counts from the first try. The estimate is the
    longest wait answered in the last ``window_s``, or the age of the call still out if that
    is longer: a probe stuck behind thousands of registrations counts from the moment it was
    sent, before it is answered.

    A server with too many calls waiting refuses new ones at random: the probe may get
    through now and then while an unlucky agent's calls are refused for longer than the
    timeout. So while tries are refused, and for ``window_s`` after the last refusal, the
    estimate is at least the time since the refusals began: no silence during such an
    episode is held against an agent.
    Thread-safe: the probe writes, the control loop reads."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._out: float | None = None
        self._recent: collections.deque[tuple[float, float]] = collections.deque()
        self._refusing: tuple[float, float] | None = None  # (first, last) of an episode
        #: calls answered and tries refused, since the start (``/metrics``)
        self.answers = self.refusals = 0

    def sent(self, at: float) -> None:
        with self._lock:
            if self._out is None:  # else a try again: the wait runs from the first
                self._out = at

    def answered(self, at: float) -> None:
        with self._lock:
            if self._out is not None:
                self._recent.append((at, at - self._out))
                self._out = None
                self.answers += 1

    def refused(self, at: float) -> None:
        """The try was refused (too many calls waiting): the call stays out, and an episode
        of refusals begins or goes on."""
        with self._lock:
            self.refusals += 1
            r = self._refusing
            self._refusing = (at, at) if r is None or at - r[1] > self.window_s else (r[0], at)

    def dropped(self) -> None:
        """The call out could not be measured (no server to reach): it does not count."""
        with self._lock:
            self._out = None

    def estimate(self, now: float) -> float:
        with self._lock:
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()
            longest = max((w for _, w in self._recent), default=0.0)
            if self._out is not None:
                longest = max(longest, now - self._out)
            if self._refusing is not None and now - self._refusing[1] <= self.window_s:
                longest = max(longest, now - self._refusing[0])
            return longest


# --- reconciling a registering agent (a pure decision) ---------------------------------------

@dataclasses.dataclass
class Reconciliation:
    """What to do with the tasks an agent reports when it registers, and with those assigned
    to it that it does not report."""

    apply: list[TaskReport] = dataclasses.field(default_factory=list)        # as reports
    stop: list[StopTaskCommand] = dataclasses.field(default_factory=list)    # unwanted processes
    stop_again: list[TaskReport] = dataclasses.field(default_factory=list)   # of ended jobs
    cancel: list[Task] = dataclasses.field(default_factory=list)     # of ended jobs, gone
    start_again: list[tuple[Job, Task]] = dataclasses.field(default_factory=list)
    lost: list[tuple[Job, Task]] = dataclasses.field(default_factory=list)   # it no longer runs


def reconcile(worker: str, reports: Iterable[TaskReport], jobs: Mapping[str, Job],
              live: Iterable[Job]) -> Reconciliation:
    """``jobs`` finds a reported task's job; ``live`` are the jobs not over (a job that is
    over has no task left to stop, start or fail: only they are walked, so a registration
    costs the live jobs, not the history)."""
    out = Reconciliation()
    reported = {r.key: r for r in reports}

    def task_of(job: Job | None, role: str, index: int) -> Task | None:
        if job is None:
            return None
        return next((t for t in job.tasks if t.role == role and t.index == index), None)

    for r in reported.values():
        job = jobs.get(r.job_id)
        task = task_of(job, r.role, r.index)
        mine = task is not None and task.worker == worker
        if r.state.final:
            if mine and task is not None and not task.state.final:
                out.apply.append(r)
            continue
        if mine and job is not None and job.state.final:
            out.stop_again.append(r)  # a stop lost while the agent was away
        elif not mine or job is None or task is None or task.state.final \
                or r.attempt != task.attempt or job.state == JobState.RESTARTING:
            # not this agent's, or an attempt the job has moved on from (it was restarted
            # while the agent was away): never two processes of one task
            out.stop.append(StopTaskCommand(job_id=r.job_id, role=r.role, index=r.index,
                                            reason="not assigned to this worker",
                                            attempt=r.attempt))
        else:
            out.apply.append(r)
    for job in live:
        for t in job.tasks:
            if t.worker != worker or t.state.final or t.key in reported:
                continue
            if job.state.final:
                out.cancel.append(t)
            elif t.state == TaskState.PENDING and job.state == JobState.SCHEDULED:
                out.start_again.append((job, t))  # the start never reached the agent
            else:
                out.lost.append((job, t))
    return out
