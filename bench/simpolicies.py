"""The simulated cluster of ``bench/sched_sim.py`` and three of its policies (today, fifo,
kueue; strata's is ``simstrata.py``), on a simulated clock, each driving the coordinator's pure
decisions (the policies and what they measure: ``sched_sim.py``'s docstring)."""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
import sys
import time
from typing import Iterable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from simtrace import BATCH, HOUR, MINUTE, T0, JobTemplate, Trace  # noqa: E402
from strata.coordinator import decisions, policy  # noqa: E402
from strata.coordinator.placement import Capacity, Placement, TaskDemand, place  # noqa: E402
from strata.queues import Share  # noqa: E402
from strata.types import Job, JobState, Task, TaskState  # noqa: E402

# --- what a preemption costs ---------------------------------------------------------------------
CHECKPOINT_S = 30 * MINUTE  # periodic checkpoints, every job, from its run's first step
RESTART_S = 60.0            # a restarted job's startup on its workers
NOTICE_S = 60.0             # Strata's notice (coordinator.preemption.PREEMPT_DEADLINE_S)
KUEUE_GRACE_S = 30.0        # a pod's terminationGracePeriodSeconds, by default
#: waiting jobs whose victims are looked for in a pass, at most (preemption.PREEMPT_TRIES_PER_PASS)
PREEMPT_TRIES_PER_PASS = 4
IDLE_PASS_S = 10 * MINUTE   # a pass at least this often while jobs wait

BUCKETS = (("1", 1, 1), ("2-4", 2, 4), ("5-16", 5, 16), ("17+", 17, 1 << 30))

# --- the simulated cluster ------------------------------------------------------------------------

class Cluster:
    """The workers, each taking one task at a time, with its free bytes kept: every worker's
    ``Capacity`` (what ``reserve`` and ``victims`` read), and the idle ones (what a job is
    placed on)."""

    def __init__(self, budgets: list[int]) -> None:
        self.budget = {f"w{i:05d}": b for i, b in enumerate(budgets)}
        self.caps = {n: Capacity(n, b, b, 1) for n, b in self.budget.items()}
        self.idle = dict(self.caps)
        self.sizes = sorted(set(budgets))
        self.idle_by_size = {s: budgets.count(s) for s in self.sizes}
        #: moves whenever room is taken or given back (the coordinator's ``room_version``)
        self.version = 0
        self._idle_list: tuple[int, list[Capacity]] = (-1, [])

    def take(self, name: str, budget: int) -> None:
        b = self.budget[name]
        self.caps[name] = Capacity(name, b, b - budget, 0)
        del self.idle[name]
        self.idle_by_size[b] -= 1
        self.version += 1

    def give(self, name: str) -> None:
        b = self.budget[name]
        self.caps[name] = self.idle[name] = Capacity(name, b, b, 1)
        self.idle_by_size[b] += 1
        self.version += 1

    def fitting(self, need: int) -> int:
        """Idle workers that could take a task of ``need`` bytes."""
        return sum(n for s, n in self.idle_by_size.items() if s >= need)

    def largest_idle(self) -> int:
        return max((s for s, n in self.idle_by_size.items() if n), default=0)

    def idle_list(self) -> list[Capacity]:
        if self._idle_list[0] != self.version:
            self._idle_list = (self.version, list(self.idle.values()))
        return self._idle_list[1]

    def place(self, demands: list[TaskDemand]) -> Placement | None:
        """``placement.place`` on the idle workers; None without a call when too few of them
        could take even the smallest task (``place`` would fail: one task per worker)."""
        if self.fitting(min(d.budget_bytes for d in demands)) < len(demands):
            return None
        p = place(demands, self.idle_list())
        return p if p.assignments else None


# --- a job as the simulator runs it --------------------------------------------------------------

@dataclasses.dataclass(eq=False)
class SimJob:
    """The coordinator's ``Job`` (what the pure functions read) and what only the simulator
    knows: its true duration and its progress."""

    t: JobTemplate
    job: Job
    demands: list[TaskDemand]
    standing: policy.Standing
    done: float = 0.0        # training seconds kept when its current run began
    run_at: float = 0.0      # when its current run was placed (0: not running)
    train_from: float = 0.0  # when that run trains from (after a restart's startup)
    token: int = 0           # a run's end or stop event is good only for its run
    resumed: bool = False    # placed again after a preemption: pays the startup
    stopping: bool = False   # a preemption's notice or grace in flight
    first_start: float = 0.0
    ended: float = 0.0

    @property
    def id(self) -> str:
        return self.t.id

    def progress(self, now: float) -> float:
        return self.done + max(0.0, now - self.train_from) if self.run_at else self.done


@dataclasses.dataclass
class Result:
    policy: str
    util: float = 0.0
    util_drain: float = 0.0
    goodput: float = 0.0
    makespan_h: float = 0.0
    waits: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    lost_wh: float = 0.0
    overhead_wh: float = 0.0
    preemptions: int = 0
    preempted_jobs: int = 0
    team_wh: dict[str, float] = dataclasses.field(default_factory=dict)  # within the window
    team_waits: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    over_limit: int | None = 0
    unfinished: int = 0
    passes: int = 0
    cpu_s: float = 0.0


ARRIVE, END, STOP = 0, 1, 2


class Sim:
    """The cluster under one policy: events on a simulated clock, scheduling passes between
    them (``schedule``, each policy's own)."""

    name = ""
    #: a victim keeps its progress (a checkpoint on notice), else its last periodic one's
    saves_on_notice = True
    #: jobs past their time limit are counted (Strata's ``decisions.past_time_limit``: the
    #: time trained, not the time stopped); kueue: not counted (no such limit)
    strata_time_limit = True

    def __init__(self, trace: Trace, pass_gap: float) -> None:
        self.trace, self.pass_gap = trace, pass_gap
        self.queues = trace.queues
        self.cluster = Cluster(trace.workers)
        self.sims: dict[str, SimJob] = {}
        #: one object per standing, shared by its jobs (as ``Queueing.order`` keeps them)
        interned: dict[policy.Standing, policy.Standing] = {}
        for t in trace.jobs:
            tasks = [Task(t.id, "worker", i, memory_budget_bytes=t.budget)
                     for i in range(t.width)]
            job = Job(t.id, t.id, JobState.PENDING, "mirrored", t.spec, created_at=t.submit,
                      tasks=tasks, owner=t.owner)
            st = policy.Standing.of(job, policy.Place(t.team, t.priority))
            self.sims[t.id] = SimJob(t, job, [TaskDemand("worker", i, t.budget)
                                              for i in range(t.width)],
                                     interned.setdefault(st, st))
        self.waiting: dict[str, SimJob] = {}
        self.running: dict[str, SimJob] = {}
        #: each queue's held share, each owner's held workers (kept as room moves)
        self.use: dict[str, Share] = {}
        self.owner_workers: dict[str, int] = {}
        self._events: list[tuple[float, int, int, str, int]] = []
        self._seq = 0
        self.window_end = T0 + trace.span
        self.r = Result(self.name, waits={b: [] for b, _, _ in BUCKETS},
                        team_wh={t: 0.0 for t in trace.entitled},
                        team_waits={t: [] for t in trace.entitled},
                        over_limit=0 if self.strata_time_limit else None)
        self._busy_window = 0.0
        self._busy = 0.0
        self._lost = 0.0
        self._preempted: set[str] = set()

    # --- events ---------------------------------------------------------------------------------

    def _push(self, at: float, kind: int, job_id: str, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, self._seq, kind, job_id, token))

    def run(self) -> Result:
        cpu = time.process_time()
        for sj in self.sims.values():
            self._push(sj.t.submit, ARRIVE, sj.id)
        next_pass: float | None = None
        last_pass = -math.inf
        now = T0
        while True:
            at = self._events[0][0] if self._events else math.inf
            if next_pass is not None and next_pass <= at:
                now = next_pass
                self.schedule(now)
                self.r.passes += 1
                last_pass = now
                next_pass = now + IDLE_PASS_S if self.waiting and (
                    self.running or self._events) else None
                continue
            if not self._events:
                break
            at, _, kind, job_id, token = heapq.heappop(self._events)
            now = at
            sj = self.sims[job_id]
            if kind == ARRIVE:
                self.waiting[job_id] = sj
            elif sj.token != token or not sj.run_at:
                continue  # a run that is over already
            elif kind == END:
                self._end(sj, now)
            else:
                self._stop(sj, now)
            due = max(now, last_pass + self.pass_gap)
            next_pass = due if next_pass is None else min(next_pass, due)
        self._finish(now)
        self.r.cpu_s = time.process_time() - cpu
        return self.r

    # --- what happens to a job ------------------------------------------------------------------

    def start(self, sj: SimJob, placement: Placement, now: float) -> None:
        job = sj.job
        for task in job.tasks:
            name = placement.assignments[(task.role, task.index)]
            task.worker, task.state = name, TaskState.RUNNING
            self.cluster.take(name, task.memory_budget_bytes)
        startup = RESTART_S if sj.resumed else 0.0
        sj.resumed, sj.stopping = False, False
        sj.run_at, sj.train_from = now, now + startup
        sj.token += 1
        job.state = JobState.RUNNING
        if job.started_at:  # a run after a restart: its training time counts from now
            job.recovery.run_began = now
        else:
            job.started_at = now  # its first step (the coordinator never sets it again)
        if not sj.first_start:
            sj.first_start = now
        m = job.metrics
        m.total_steps = max(1, round(sj.t.duration * sj.t.rate))
        m.examples_per_sec = sj.t.rate * BATCH
        m.step = int(sj.done * sj.t.rate)
        self._push(sj.train_from + sj.t.duration - sj.done, END, sj.id, sj.token)
        del self.waiting[sj.id]
        self.running[sj.id] = sj
        self._hold(sj, +1)

    def _hold(self, sj: SimJob, sign: int) -> None:
        q, w = sj.t.team, sj.t.width
        have = self.use.get(q, Share())
        self.use[q] = Share(have.workers + sign * w, have.memory_bytes + sign * w * sj.t.budget)
        self.owner_workers[sj.t.owner] = self.owner_workers.get(sj.t.owner, 0) + sign * w

    def notice(self, victim: SimJob, by: SimJob, now: float, delay: float) -> None:
        """``victim`` is told to stop for ``by``: it stops ``delay`` later."""
        victim.stopping = True
        victim.job.recovery.notice_step = 1  # (a notice in flight: not a candidate again)
        victim.job.recovery.preempted_by = by.id
        victim.job.recovery.preemptions += 1
        self._push(now + delay, STOP, victim.id, victim.token)

    def _over(self, sj: SimJob, t1: float) -> float:
        """The run of ``sj`` is over at ``t1``: its workers given back, its time counted.
        Returns its progress then."""
        w = sj.t.width
        startup_end = min(sj.train_from, t1)
        self.r.overhead_wh += w * (startup_end - sj.run_at) / HOUR
        self._busy += w * max(0.0, t1 - sj.train_from)
        in_window = w * max(0.0, min(t1, self.window_end) - sj.train_from)
        self._busy_window += in_window
        self.r.team_wh[sj.t.team] += in_window / HOUR
        progress = sj.progress(t1)
        for task in sj.job.tasks:
            self.cluster.give(task.worker)
        self._hold(sj, -1)
        del self.running[sj.id]
        sj.run_at = 0.0
        sj.token += 1
        return progress

    def _end(self, sj: SimJob, now: float) -> None:
        if self.r.over_limit is not None and decisions.past_time_limit(sj.job, now):
            self.r.over_limit += 1  # the control loop would have failed it
        self._over(sj, now)
        sj.done, sj.ended = sj.t.duration, now
        sj.job.state = JobState.SUCCEEDED
        for task in sj.job.tasks:
            task.state = TaskState.SUCCEEDED

    def _stop(self, sj: SimJob, now: float) -> None:
        """A victim stops: it keeps its progress when it saved on notice, else what its last
        periodic checkpoint holds."""
        trained = max(0.0, now - sj.train_from)
        # the run ends (decisions.restart): what it trained counts, the time it stops does not
        sj.job.recovery.ran_s = decisions.trained_for(sj.job, now)
        sj.job.recovery.run_began = 0.0
        progress = self._over(sj, now)
        kept = progress if self.saves_on_notice else sj.done + (
            trained // CHECKPOINT_S) * CHECKPOINT_S
        self._lost += sj.t.width * (progress - kept)
        sj.done = kept
        sj.resumed, sj.stopping = True, False
        job = sj.job
        job.recovery.notice_step = 0
        job.state = JobState.RESTARTING if job.recovery.preempted_by else JobState.PENDING
        job.checkpoint_step = int(kept * sj.t.rate)
        for task in job.tasks:
            task.worker, task.state = "", TaskState.PENDING
        self.r.preemptions += 1
        self._preempted.add(sj.id)
        self.waiting[sj.id] = sj

    def _finish(self, now: float) -> None:
        r, n = self.r, len(self.trace.workers)
        ends = [sj.ended for sj in self.sims.values() if sj.ended]
        makespan = (max(ends) if ends else now) - T0
        r.makespan_h = makespan / HOUR
        r.util = self._busy_window / (n * self.trace.span)
        r.util_drain = self._busy / (n * makespan) if makespan else 0.0
        r.goodput = (self._busy - self._lost) / (n * makespan) if makespan else 0.0
        r.lost_wh = self._lost / HOUR
        r.preempted_jobs = len(self._preempted)
        r.unfinished = sum(not sj.ended for sj in self.sims.values())
        for sj in self.sims.values():
            if sj.first_start:
                b = next(name for name, lo, hi in BUCKETS if lo <= sj.t.width <= hi)
                r.waits[b].append(sj.first_start - sj.t.submit)
                r.team_waits[sj.t.team].append(sj.first_start - sj.t.submit)

    def schedule(self, now: float) -> None:
        raise NotImplementedError


# --- the policies ---------------------------------------------------------------------------------

class Today(Sim):
    """Strata without a queues file: oldest first, each placed as soon as its tasks fit."""

    name = "today"

    def schedule(self, now: float) -> None:
        for sj in list(self.waiting.values()):  # (submission order: nothing is preempted)
            if not self.cluster.idle:
                return
            p = self.cluster.place(sj.demands)
            if p is not None:
                self.start(sj, p, now)


class Fifo(Sim):
    """Strict FIFO: nothing starts before the oldest waiting job."""

    name = "fifo"

    def schedule(self, now: float) -> None:
        for sj in list(self.waiting.values()):
            p = self.cluster.place(sj.demands)
            if p is None:
                return
            self.start(sj, p, now)


class Quota(Sim):
    """What Kueue and Strata share: the queues, and the running jobs preemption may stop."""

    def _preemptible(self) -> list[SimJob]:
        return [sj for sj in self.running.values()
                if not sj.stopping and sj.t.spec.preemptible]

    def _free_for(self, pool: Iterable[SimJob]) -> list[Capacity]:
        """The capacities a preemption's choice reads: the idle workers and those of the jobs
        it may stop (the others can take nothing, whatever is stopped: leaving them out
        changes no choice, and a choice costs a pass over fewer agents)."""
        caps = dict(self.cluster.idle)
        for sj in pool:
            for task in sj.job.tasks:
                caps[task.worker] = self.cluster.caps[task.worker]
        return list(caps.values())

    def _could_start(self, sj: SimJob, pool: Sequence[SimJob], limit: Share) -> bool:
        """Whether ``sj`` could start were all of ``pool`` stopped (enough workers for its
        smallest task, its queue within ``limit``): else no subset does, and the search for
        victims is skipped (it would find none)."""
        q = sj.t.team
        have = self.use.get(q, Share())
        mine = [x for x in pool if x.t.team == q]
        have = Share(have.workers - sum(x.t.width for x in mine),
                     have.memory_bytes - sum(x.t.width * x.t.budget for x in mine))
        if not (have + policy.share_of(sj.job)).within(limit):
            return False
        need = min(d.budget_bytes for d in sj.demands)
        budget = self.cluster.budget
        return self.cluster.fitting(need) + sum(
            1 for x in pool for t in x.job.tasks if budget[t.worker] >= need) >= sj.t.width


class Kueue(Quota):
    """Kueue's ClusterQueues in one cohort, BestEffortFIFO, classic preemption (docstring)."""

    name = "kueue"
    saves_on_notice = False
    strata_time_limit = False

    def __init__(self, trace: Trace, pass_gap: float) -> None:
        super().__init__(trace, pass_gap)
        self._inflight: dict[str, list[SimJob]] = {}
        self._tried: dict[str, int] = {}

    def schedule(self, now: float) -> None:
        tries, preempted_queues = 0, set()
        for sj in self._order():
            job = sj.job
            q = self.queues.get(sj.t.team)
            if not policy.room_for(job, q, self.use):
                p = self.cluster.place(sj.demands)
                if p is not None:
                    self.start(sj, p, now)
                    self._inflight.pop(sj.id, None)
                    continue
            if tries >= PREEMPT_TRIES_PER_PASS or sj.t.team in preempted_queues \
                    or self._tried.get(sj.id) == self.cluster.version or self._waits_for(sj):
                continue
            self._tried[sj.id] = self.cluster.version
            found = self._victims(sj)
            if found is None:
                continue
            tries += 1
            if found:
                preempted_queues.add(sj.t.team)
                self._inflight[sj.id] = found
                for v in found:
                    self.notice(v, sj, now, KUEUE_GRACE_S)

    def _order(self) -> list[SimJob]:
        """Kueue's order of the heads across a cohort (its scheduler's ``entryOrdering``): a
        job its queue holds within its nominal quota before one that would borrow, then the
        higher priority, then the older."""
        fits: dict[tuple[str, int], bool] = {}

        def key(sj: SimJob) -> tuple[bool, int, float, str]:
            k = (sj.t.team, sj.t.width)
            f = fits.get(k)
            if f is None:
                q = self.queues.get(sj.t.team)
                f = fits[k] = q is not None and (self.use.get(q.name, Share()) + Share(
                    sj.standing.workers, sj.standing.memory_bytes)).within(q.nominal)
            return (not f, -sj.t.priority, sj.t.submit, sj.id)

        return sorted(self.waiting.values(), key=key)

    def _waits_for(self, sj: SimJob) -> bool:
        """Whether ``sj``'s victims are still stopping."""
        victims = self._inflight.get(sj.id)
        if victims and any(v.run_at and v.stopping for v in victims):
            return True
        self._inflight.pop(sj.id, None)
        return False

    def _victims(self, sj: SimJob) -> list[SimJob] | None:
        """Kueue's classic preemption targets for ``sj`` (docstring): None when it has no
        candidates (no search made), [] when no set of them would do."""
        queue = self.queues.get(sj.t.team)
        assert queue is not None
        share = policy.share_of(sj.job)
        if not share.within(queue.nominal):
            return None  # it may preempt only within its nominal quota (no borrowWithinCohort)

        def borrowing(name: str, use: dict[str, Share]) -> bool:
            q = self.queues.get(name)
            return q is not None and not use.get(name, Share()).within(q.nominal)

        cands = [x for x in self._preemptible()
                 if (x.t.team == sj.t.team and x.t.priority < sj.t.priority)
                 or (x.t.team != sj.t.team and borrowing(x.t.team, self.use))]
        if not cands:
            return None
        # borrowing queues' first, then the lowest priority, then the most recently admitted
        cands.sort(key=lambda x: (x.t.team == sj.t.team, x.t.priority, -x.run_at, x.id))
        if not self._could_start(sj, cands, queue.limit):
            return []
        need = sj.t.budget  # (every task of a job has the same budget)
        budget = self.cluster.budget
        idle = self.cluster.fitting(need)

        def fits(taken: list[SimJob], limit: Share) -> bool:
            """Whether ``sj``'s queue may hold it and its tasks place once ``taken`` stop:
            with one task per worker and one budget per job, enough workers that fit it
            (what ``place`` would find)."""
            have = self.use.get(sj.t.team, Share())
            for x in taken:
                if x.t.team == sj.t.team:
                    have = Share(have.workers - x.t.width,
                                 have.memory_bytes - x.t.width * x.t.budget)
            if not (have + share).within(limit):
                return False
            return idle + sum(1 for x in taken for task in x.job.tasks
                              if budget[task.worker] >= need) >= sj.t.width

        def greedy(pool: list[SimJob], limit: Share) -> list[SimJob]:
            left = dict(self.use)
            taken: list[SimJob] = []
            for x in pool:
                if x.t.team != sj.t.team and not borrowing(x.t.team, left):
                    continue  # that queue no longer borrows
                taken.append(x)
                h = left.get(x.t.team, Share())
                left[x.t.team] = Share(h.workers - x.t.width,
                                       h.memory_bytes - x.t.width * x.t.budget)
                if fits(taken, limit):
                    # the least set: each taken but the last, in reverse, given back where the
                    # job still fits without it
                    for y in reversed(taken[:-1]):
                        rest = [z for z in taken if z is not y]
                        if fits(rest, limit):
                            taken = rest
                    return taken
            return []

        if all(x.t.team == sj.t.team for x in cands):
            return greedy(cands, queue.limit)
        found: list[SimJob] = []
        if (self.use.get(sj.t.team, Share()) + share).within(queue.nominal):
            found = greedy(cands, queue.nominal)
        return found or greedy([x for x in cands if x.t.team == sj.t.team], queue.limit)
