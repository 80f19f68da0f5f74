"""Elastic jobs (``workers: {min, max}``): the half of the job lifecycle that changes a job's
width. A job is planned at the widest width in its range whose tasks can be placed now (at
submission, when it waits, and when it restarts), never below ``min``; a running job below
``max`` grows when room frees up and no other job waits for it. A resize is a notice to the
job's own tasks (``JobLifecycle._save_and_stop``): they save a checkpoint after a step they all
reach and stop, and the job restarts from it at the new width, the global batch kept (each
replica's share changes; the data's order is global, ``strata.worker.data``, so the position
in the epoch is exact). Each resize is an event with its cost.

Why grow only when nothing waits: a waiting job needs the room it would take (the shared
cluster's scheduler decides between jobs; growth only uses what no job asked for). Why settle
``RESIZE_SETTLE_S`` between resizes: each costs a save and a restart, which a cluster whose
agents come and go every few seconds would otherwise pay over and over.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strata import strategies
from strata.coordinator import decisions
from strata.coordinator.admission import prepare, tasks_of
from strata.coordinator.agents import Needs
from strata.coordinator.lifecycle import JobLifecycle
from strata.coordinator.placement import Capacity, TaskDemand, place
from strata.jobspec import JobSpec
from strata.types import Job, JobPlan, JobState, Task

#: seconds an elastic job runs at a width before it may grow again
RESIZE_SETTLE_S = 10.0
#: seconds a growing job's tasks have to save their checkpoint and stop
RESIZE_DEADLINE_S = 60.0


class ElasticJobs(JobLifecycle):
    """Width changes of elastic jobs, on top of the lifecycle's restarts and notices."""

    #: whether a live job may be elastic: the tick's grow check walks the live jobs only then
    _elastic = True

    def _add_job(self, spec: JobSpec, plan: JobPlan, *args: Any, **kwargs: Any) -> Job:
        job = super()._add_job(spec, plan, *args, **kwargs)
        self._elastic = self._elastic or spec.elastic
        return job

    def _replan(self, job: Job) -> tuple[JobSpec, JobPlan]:
        assert job.spec is not None
        if not job.spec.elastic:
            return super()._replan(job)
        return self._widest(job.spec)

    def _widest(self, spec: JobSpec, holding: Job | None = None,
                above: int = 0) -> tuple[JobSpec, JobPlan]:
        """``spec`` at the widest width of its range (and over ``above``) whose plan places on
        the room free now, with ``holding``'s own tasks' room counted free (it would stop to
        resize); none placing, the spec at ``min``, which waits (at ``above``: the spec as
        it is). Raises ``SpecError``."""
        strategy = strategies.get(spec.strategy)
        needs = Needs.of(spec)
        offers = self.state.whole_offers(needs)
        room = self._room_with(holding, needs)
        seen: set[int] = set()
        for agents in range(len(offers), 0, -1):
            wide = strategy.width_for(spec, agents)
            if wide.workers in seen or wide.workers <= above:
                continue
            seen.add(wide.workers)
            plan = prepare(wide, offers, self.measured, largest=self.largest_alloc).plan
            demands = [TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in plan.tasks]
            if plan.feasible and self._queue_holds(wide, plan, holding) \
                    and place(demands, room).placed:
                return wide, plan
        fallback = spec if above else dataclasses.replace(spec, workers=spec.workers_min)
        return fallback, prepare(fallback, offers, self.measured, largest=self.largest_alloc).plan

    def _room_with(self, job: Job | None, needs: Needs) -> list[Capacity]:
        """The agents' free room now, with ``job``'s tasks' budgets and ports given back."""
        room = self.state.capacities(needs)
        if job is None:
            return room
        back: dict[str, tuple[int, int]] = {}
        for t in job.tasks:
            if t.worker and not t.state.final:
                b, p = back.get(t.worker, (0, 0))
                back[t.worker] = (b + t.memory_budget_bytes, p + 1)
        return [dataclasses.replace(c, free_bytes=c.free_bytes + back[c.name][0],
                                    free_ports=c.free_ports + back[c.name][1])
                if c.name in back else c for c in room]

    def _place_narrower(self, job: Job) -> bool:
        """A PENDING elastic ``job`` that does not place at its width: planned again at the
        widest that places now (at least ``min``). Whether its width changed."""
        assert job.spec is not None
        if job.spec.workers <= job.spec.workers_min:
            return False
        spec, plan = self._widest(job.spec)
        if spec.workers == job.spec.workers or not plan.feasible:
            return False
        self._set_width(job, spec, plan, f"planned {spec.workers} wide instead of "
                                         f"{job.spec.workers}: that many place now")
        return True

    def _start_wider(self, job: Job) -> bool:
        """An elastic ``job`` about to be placed below its ``max``: planned at the widest that
        places now instead (a resize just after the start would cost a save and a restart).
        Whether its width changed."""
        assert job.spec is not None
        if job.spec.workers >= job.spec.workers_max:
            return False
        spec, plan = self._widest(job.spec, above=job.spec.workers)
        if spec.workers <= job.spec.workers or not plan.feasible:
            return False
        self._set_width(job, spec, plan, f"planned {spec.workers} wide instead of "
                                         f"{job.spec.workers}: that many place now")
        return True

    def _set_width(self, job: Job, spec: JobSpec, plan: JobPlan, why: str) -> None:
        attempt = max((t.attempt for t in job.tasks), default=0)
        job.spec = spec
        job.tasks = tasks_of(job.id, plan, attempt)
        job.estimated_memory_bytes = plan.largest_estimate
        self.store.replace_tasks(job.id, job.tasks)
        self.store.put_job(job)
        self._event(job, "message", why)

    def _grow(self, now: float) -> None:
        """Running elastic jobs below ``max`` that more of would place now, while no job waits:
        each is told to save and stop, and restarts wider (``_width_changed``)."""
        elastic = self.state.elastic()
        self._elastic = bool(elastic)
        if not elastic or any(self._waits_for_room(j) for j in self.state.ordered()):
            return
        for job in elastic:
            if not decisions.may_grow(job, now, RESIZE_SETTLE_S):
                continue
            assert job.spec is not None
            wide, plan = self._widest(job.spec, holding=job, above=job.spec.workers)
            if wide.workers <= job.spec.workers or not plan.feasible:
                continue
            save = self._save_at(job, RESIZE_DEADLINE_S)
            if not save.step:
                continue  # a resize that loses work costs more than the width it buys
            job.recovery.resize_from = job.spec.workers
            job.recovery.resize_began = now
            self._save_and_stop(job, save.step, RESIZE_DEADLINE_S, "resize",
                                f"grows from {job.spec.workers} to {wide.workers} workers: "
                                f"every task saves a checkpoint after step {save.step} and "
                                f"stops; the job resumes from it {wide.workers} wide")

    def _notice(self, job: Job, worker: str, deadline_s: float) -> None:
        # an elastic job that may shrink: its resize, if any, is timed from the notice
        if job.spec is not None and job.spec.elastic and not job.recovery.resize_began:
            job.recovery.resize_began = self.clock()
        super()._notice(job, worker, deadline_s)

    def _restart(self, job: Job, cause: str, *, failure: bool, oom: Task | None = None) -> None:
        # (a loss: from the restart)
        if job.spec is not None and job.spec.elastic and not job.recovery.resize_began:
            job.recovery.resize_began = self.clock()
        super()._restart(job, cause, failure=failure, oom=oom)

    def _queue_holds(self, spec: JobSpec, plan: JobPlan, holding: Job | None) -> bool:
        """Whether ``spec``'s queue may hold ``plan`` (``holding``'s own share given back):
        ``ControlLoop`` asks its queues; without them, always."""
        return True

    def _waits_for_room(self, job: Job) -> bool:
        """Whether ``job`` waits for room that growth would take (``ControlLoop`` leaves out
        a job its queue holds back: room would not start it)."""
        return job.state in (JobState.PENDING, JobState.RESTARTING)

    def _width_changed(self, job: Job, spec: JobSpec) -> None:
        assert job.spec is not None
        if not job.spec.elastic:
            return super()._width_changed(job, spec)
        rec = job.recovery
        rec.resizes += 1
        rec.resize_from = rec.resize_from or job.spec.workers
        now = self.clock()
        rec.resize_began = rec.resize_began or now
        share = strategies.get(spec.strategy).batch_share
        self._event(job, "resized", (
            f"resize {rec.resizes}: {job.spec.workers} -> {spec.workers} workers at step "
            f"{job.checkpoint_step}, global batch {spec.data.batch_size} kept "
            f"({share(job.spec)} -> {share(spec)}); planned {now - rec.resize_began:.1f} s "
            f"after it began ({rec.last_cause})"))

    def _running(self, job: Job) -> None:
        rec = job.recovery
        if not rec.resize_began or job.spec is None:
            return
        now = self.clock()
        if not rec.resize_from:  # a notice or a restart that kept its width: no resize
            rec.resize_began = 0.0
            self.store.put_job(job)
            return
        took = f"{now - rec.resize_began:.1f} s after the resize began"
        if rec.resize_from == job.spec.workers:
            self._event(job, "message", f"running {job.spec.workers} wide as before, "
                                        f"{took}: the room it would have grown into was taken")
        else:
            self._event(job, "resized", f"running {job.spec.workers} wide "
                                        f"({rec.resize_from} before), {took}")
        rec.resize_from, rec.resize_began, rec.resized_at = 0, 0.0, now
        self.store.put_job(job)
