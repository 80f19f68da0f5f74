"""The coordinator's state: every job, task and agent it holds, and the indexes derived from them.

``ClusterState`` is the one place where a job or task changes state, an agent comes, goes or
drains, or a task is given a worker: each method makes its change and keeps every index that
derives from it in step, so no caller updates an index by hand. ``check`` compares the indexes
with a scan of what they derive from; tests run it after changes (``tests/test_state.py``
drives random sequences of them), and ``STRATA_CHECK_STATE=1`` makes the coordinator run it
after every tick (the test suite sets it for the coordinators its integration tests start).

The indexes, each kept because a scan of its source on a hot path cost too much
(``bench/control_plane.py``): the live jobs (not over: the job or a task of it has not ended)
and their scheduling order; the finished jobs by end time (what ``--retention`` deletes); per
worker, the budgets its unfinished tasks reserve and the ports they hold; the room index
(``placement.Room``: the agents that can take tasks, by free budget); the whole-budget offers
by job needs; and two version counters that say when room may have grown
(``room_version``) or the agents' standing changed (``standing_version``).
"""

from __future__ import annotations

import dataclasses

import heapq
from typing import Iterable

from strata.coordinator.agents import NO_NEEDS, Agents, LiveWorker, Needs
from strata.coordinator.jobtable import JobTable
from strata.coordinator.placement import Capacity, Room
from strata.errors import InvalidTransition
from strata.types import Job, Task, TaskState, WorkerOffer, can_transition

#: whole-budget offers kept per job needs; needs differ by data paths, so only a few are kept
MAX_KEPT_OFFERS = 64


def order_key(job: Job) -> tuple[float, str]:
    """Jobs are scheduled oldest first."""
    return (job.created_at, job.id)


def is_over(job: Job) -> bool:
    """The job and every task of it have ended (for good: final states are never left)."""
    return job.state.final and all(t.state.final for t in job.tasks)


def _port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


class ClusterState:
    """Jobs (``jobs``: every one held; ``live``: those not over), agents (``agents``) and the
    indexes derived from them (module docstring). Read the attributes freely; change them only
    through the methods."""

    def __init__(self, jobs: JobTable, agents: Agents):
        self.jobs = jobs
        self.agents = agents
        #: the jobs that are not over. The hot paths (the control loop, heartbeats,
        #: reservations, the workers view) read these alone, so their cost follows what runs
        #: and waits, not the history kept for --retention. A job leaves once it and every
        #: task have ended (``retire_over``), which no state ever undoes.
        self.live: dict[str, Job] = {j.id: j for j in jobs.loaded_jobs() if not is_over(j)}
        #: (finished_at, id) of the jobs that ended, oldest first: what --retention deletes
        #: is read off its front (``due_for_deletion``)
        self._ended: list[tuple[float, str]] = [
            (s.finished_at, s.id) for s in jobs.summaries() if s.state.final]
        heapq.heapify(self._ended)
        #: live jobs that may be over (the job or a task of it reached a final state since
        #: ``retire_over`` last ran): it looks at these alone
        self._ending: set[str] = set()
        #: ``live`` in scheduling order (None: sorted again when next asked for)
        self._order: list[Job] | None = None
        #: worker -> the task ports its unfinished tasks hold (a heartbeat's free ports never
        #: include them)
        self.ports_held: dict[str, set[str]] = {}
        for j in self.live.values():
            for t in j.tasks:
                if t.worker and t.address and not t.state.final:
                    self.ports_held.setdefault(t.worker, set()).add(_port_of(t.address))
        #: worker -> the budgets its unfinished tasks reserve
        self.reservations: dict[str, int] = self.reserved_scan()
        #: the agents that can take tasks now, in order of free budget: a placement is a
        #: binary search, not a sort of every agent
        self.room = Room()
        #: raised whenever room can grow (a task ends, an agent registers or comes back, an
        #: agent offers more ports): a waiting job that did not fit is not tried again until
        #: it moves
        self.room_version = 0
        #: raised when an agent registers, is lost, comes back or drains: what the kept
        #: whole-budget offers were listed under
        self.standing_version = 0
        self._offers: dict[Needs, tuple[int, list[WorkerOffer]]] = {}

    # --- jobs ---------------------------------------------------------------------------------

    def add_job(self, job: Job) -> None:
        """A job accepted (and stored): held, live, and in the scheduling order."""
        self.jobs[job.id] = job
        self.live[job.id] = job
        if self._order is not None:
            if not self._order or order_key(self._order[-1]) <= order_key(job):
                self._order.append(job)
            else:
                self._order = None

    def job_ended(self, job: Job) -> None:
        """``job`` reached a final state: it may be over, and --retention counts from now."""
        self._ending.add(job.id)
        heapq.heappush(self._ended, (job.finished_at, job.id))

    def forget_job(self, job_id: str) -> None:
        """A job deleted: no longer held."""
        self.jobs.pop(job_id, None)
        if self.live.pop(job_id, None) is not None:
            self._order = None

    def retire_over(self) -> set[str]:
        """Takes the jobs that are over out of ``live`` (looking only at those that may be);
        returns their ids."""
        over = {job_id for job_id in self._ending
                if (j := self.live.get(job_id)) is not None and is_over(j)}
        self._ending.clear()
        for job_id in over:
            del self.live[job_id]
        if over and self._order is not None:
            self._order = [j for j in self._order if j.id not in over]
        return over

    def elastic(self) -> list[Job]:
        """The live elastic jobs (``workers: {min, max}``), in scheduling order: one walk of
        the live jobs."""
        return [j for j in self.ordered() if j.spec is not None and j.spec.elastic]

    def ordered(self) -> list[Job]:
        """The live jobs in scheduling order (the list kept: copy it to change jobs while
        walking it)."""
        if self._order is None:
            self._order = sorted(self.live.values(), key=order_key)
        return self._order

    def due_for_deletion(self, now: float, retention_s: float) -> list[str]:
        """The held jobs that ended more than ``retention_s`` ago and are over."""
        old, later = [], []
        while self._ended and now - self._ended[0][0] > retention_s:
            finished_at, job_id = heapq.heappop(self._ended)
            if job_id not in self.jobs:
                continue  # deleted meanwhile
            if job_id in self.live:  # a job is over once its tasks have ended too
                later.append((finished_at, job_id))
            else:
                old.append(job_id)
        for item in later:
            heapq.heappush(self._ended, item)
        return old

    # --- tasks --------------------------------------------------------------------------------

    def set_task_state(self, task: Task, target: TaskState) -> bool:
        """Moves ``task`` to ``target`` (``InvalidTransition`` if the lifecycle forbids it);
        a task that ends gives back its worker's budget and port. False: it was there."""
        if task.state == target:
            return False
        if not can_transition(task.state, target):
            raise InvalidTransition("task", task.state.value, target.value)
        task.state = target
        if target.final:
            self.room_version += 1
            self._ending.add(task.job_id)
            if task.worker and task.address:
                self.ports_held.get(task.worker, set()).discard(_port_of(task.address))
            if task.worker:
                left = self.reservations.get(task.worker, 0) - task.memory_budget_bytes
                if left > 0:
                    self.reservations[task.worker] = left
                else:
                    self.reservations.pop(task.worker, None)
                self.refresh(task.worker)
        return True

    @staticmethod
    def placed(task: Task, live: LiveWorker, nth: int = 0) -> Task:
        """A copy of ``task`` as ``place_task`` gives it to ``live`` once ``nth`` of the agent's
        offered ports are taken: what a placement writes before it takes anything."""
        return dataclasses.replace(task, worker=live.name, attempt=task.attempt + 1,
                                   address=f"{live.record.address}:{live.free_ports[nth]}")

    def place_task(self, task: Task, live: LiveWorker) -> None:
        """Gives ``task`` (a new attempt of it) to ``live``: its budget reserved there and the
        first port the agent offers taken."""
        given = self.placed(task, live)
        port = live.free_ports.pop(0)
        task.worker, task.address, task.attempt = given.worker, given.address, given.attempt
        self.reservations[live.name] = self.reservations.get(live.name, 0) \
            + task.memory_budget_bytes
        self.ports_held.setdefault(live.name, set()).add(str(port))
        self.refresh(live.name)

    def reserved_scan(self) -> dict[str, int]:
        """Per worker, the budgets of its unfinished tasks, from a scan of the live jobs."""
        out: dict[str, int] = {}
        for job in self.live.values():
            for t in job.tasks:
                if t.worker and not t.state.final:
                    out[t.worker] = out.get(t.worker, 0) + t.memory_budget_bytes
        return out

    # --- agents -------------------------------------------------------------------------------

    def unheld_ports(self, name: str, ports: Iterable[int]) -> list[int]:
        """``ports`` less those ``name``'s unfinished tasks hold (an agent's report may be
        older than the start that took one)."""
        held = self.ports_held.get(name)
        return [p for p in ports if str(p) not in held] if held else list(ports)

    def agent_registered(self, live: LiveWorker, draining: bool) -> None:
        """``live`` registered (new, or back with a new budget and ports)."""
        live.free_ports = self.unheld_ports(live.name, live.free_ports)
        live.record.draining = live.record.draining or draining
        self.room_version += 1
        self.standing_version += 1
        self.refresh(live.name)

    def ports_offered(self, live: LiveWorker, ports: Iterable[int]) -> None:
        """A heartbeat's free ports for ``live`` (less those its tasks hold)."""
        offered = self.unheld_ports(live.name, ports)
        if len(offered) > len(live.free_ports):
            self.room_version += 1
        changed = len(offered) != len(live.free_ports)
        live.free_ports = offered
        if changed:
            self.refresh(live.name)

    def agent_back(self, live: LiveWorker) -> None:
        """A lost agent heard from again."""
        live.lost = False
        self.room_version += 1
        self.standing_version += 1
        self.refresh(live.name)

    def agent_lost(self, live: LiveWorker) -> None:
        self.agents.mark_lost(live)
        self.standing_version += 1
        self.refresh(live.name)

    def agent_draining(self, live: LiveWorker) -> None:
        live.record.draining = True
        self.standing_version += 1
        self.refresh(live.name)

    def refresh(self, name: str) -> None:
        """Brings ``name``'s entry in the room index up to date."""
        w = self.agents.get(name)
        if w is None or not w.session or w.lost or w.record.draining:
            self.room.drop(name)
            return
        budget = w.record.budget_bytes
        self.room.set(Capacity(name, budget, budget - self.reservations.get(name, 0),
                               len(w.free_ports)))

    def capacities(self, needs: Needs = NO_NEEDS) -> list[Capacity]:
        """The agents that can take tasks now and meet ``needs``, in the agents' order."""
        room = self.room
        return [c for w in self.agents.values()
                if (c := room.get(w.name)) is not None and needs.met_by(w.record)]

    def whole_offers(self, needs: Needs) -> list[WorkerOffer]:
        """Every connected agent that meets ``needs``, at its whole budget (could a job ever
        run here), kept until the agents' standing changes."""
        kept = self._offers.get(needs)
        if kept is not None and kept[0] == self.standing_version:
            return list(kept[1])
        offers = self._budget_offers(needs)
        if len(self._offers) > MAX_KEPT_OFFERS:
            self._offers.clear()
        self._offers[needs] = (self.standing_version, offers)
        return list(offers)

    def _budget_offers(self, needs: Needs) -> list[WorkerOffer]:
        return [WorkerOffer(w.name, w.record.budget_bytes, w.record.cpu_kernels)
                for w in self.agents.values() if not w.lost and not w.record.draining
                and needs.met_by(w.record)]

    # --- consistency --------------------------------------------------------------------------

    def check(self) -> None:
        """Raises AssertionError, saying what differs, unless every index equals what a scan
        of the jobs and agents gives."""
        ended = {j.id for j in self.live.values() if is_over(j)}
        assert ended <= self._ending, ("over but not retired", ended - self._ending)
        missing = {j.id for j in self.jobs.loaded_jobs() if not is_over(j)} - set(self.live)
        assert not missing, ("not over but not live", missing)
        if self._order is not None:
            assert [j.id for j in self._order] == \
                [j.id for j in sorted(self.live.values(), key=order_key)], "order"
        scanned = self.reserved_scan()
        assert self.reservations == scanned, ("reservations", self.reservations, scanned)
        held: dict[str, set[str]] = {}
        for job in self.live.values():
            for t in job.tasks:
                if t.worker and t.address and not t.state.final:
                    held.setdefault(t.worker, set()).add(_port_of(t.address))
        kept = {w: p for w, p in self.ports_held.items() if p}
        assert kept == held, ("ports held", kept, held)
        want = {c.name: c for c in self.agents.capacities(scanned)}
        have = {c.name: c for c in self.room}
        assert have == want, ("room", set(have.items()) ^ set(want.items()))
        for needs, (version, offers) in self._offers.items():
            if version == self.standing_version:
                assert offers == self._budget_offers(needs), ("offers", needs)
