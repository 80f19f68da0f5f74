"""``Coordinator``: the control plane's API over its state, in three layers, each a file:
``lifecycle.JobLifecycle`` (a job's state changes, stops, failures, restarts, probes) under
``loop.ControlLoop`` (the tick: agents judged, jobs placed) under this module's API (admission
of a submit, agents' registrations, heartbeats and reports, logs and outputs, views).

Everything runs on one asyncio event loop (the gRPC aio server's), so the live state needs no
locks: handlers and the control loop take turns. Every change is written through to the
``Store`` before a message it causes is queued to an agent; decisions are pure functions
(``coordinator.decisions``) that return data.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Any, AsyncIterator, Callable, Iterable, Mapping

from strata import strategies
from strata.coordinator.agents import (
    AgentCommand, Agents, LiveWorker, Needs, NO_NEEDS, StartTaskCommand,
    PurgeJobCommand, StopTaskCommand, reconcile,
)
from strata.coordinator.blobs import (
    DEFAULT_BLOB_GRACE_S, DEFAULT_MAX_JOB_OUTPUTS_BYTES, DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_USER_QUOTA_BYTES, BlobStore,
)
from strata.coordinator.confine import check_report, job_blobs
from strata.uploads import safe_relpath
from strata.coordinator.disk import DEFAULT_RESERVE_BYTES, DiskGuard
from strata.coordinator.jobtable import JobTable
from strata.coordinator.logs import DEFAULT_MAX_JOB_LOG_BYTES, JobLogs
from strata.coordinator.placement import Capacity, TaskDemand, place
from strata.coordinator.series import Series
from strata.coordinator import decisions
from strata.coordinator.state import ClusterState
from strata.coordinator.loop import ControlLoop
from strata.coordinator.queueing import Queueing
from strata.queues import Queues, QueueView, Share
from strata.coordinator.admission import (
    PreparedJob, first_probe_budget, plan_on, prepare, probe_plan, probe_spec,
    wants_probe,
)
from strata.coordinator.store import SqliteStore, Store, WorkerRecord
from strata.errors import (
    InfeasibleError, InvalidTransition, NotFoundError, NotYours, QuotaExceeded, SpecError,
)
from strata.dataroots import outside_message, under_roots
from strata.limits import (
    MAX_NOTICE_S, DEFAULT_MAX_PENDING_PER_USER, DEFAULT_MAX_TASKS_PER_JOB, DEFAULT_RETENTION_S,
)
from strata.measured import measured_kinds, task_kind
from strata.units import format_size
from strata.spec import parse_job_spec
from strata.jobspec import JobSpec
from strata.auth import Caller
from strata.types import (
    CoordinatorDisk, DiskStatus, FailureKind, Job, JobEvent, JobPlan, JobState, MemoryStatus,
    Plan, Task, TaskReport, TaskState, WorkerInfo, WorkerOffer, WorkerState, WorkerTask,
)

__all__ = ["Coordinator", "PreparedJob", "plan_on", "prepare", "StartTaskCommand",
           "StopTaskCommand", "AgentCommand", "LiveWorker"]

log = logging.getLogger("strata.coordinator")

#: a job none of whose tasks' notes were said yet
NO_NOTES: frozenset[str] = frozenset()
# How often progress metrics are written to the store (they are always live in memory).
METRICS_PERSIST_INTERVAL_S = 2.0
# A stop for a task of a finished job is repeated at most this often while the agent still
# reports the task running (the first stop may have been lost on a reconnect).
STOP_RESEND_INTERVAL_S = 5.0
# Agents retry registration with backoff of up to 5 s x 1.5 (``worker.agent``): after a
# coordinator restart the agents it knew have this long beyond the heartbeat timeout to come
# back before they are LOST (and their jobs restart)
REREGISTER_GRACE_S = 10.0
#: refused outputs of a job that become events (an agent that retries writes no more)
MAX_REFUSAL_EVENTS = 5


def _sizes(sizes: list[int]) -> str:
    """``3 x 1 GiB, 512 MiB``: sizes, largest first, equal ones counted."""
    out: list[str] = []
    for size in sorted(set(sizes), reverse=True):
        n = sizes.count(size)
        out.append(f"{n} x {format_size(size)}" if n > 1 else format_size(size))
    return ", ".join(out[:6]) + (", ..." if len(out) > 6 else "")


def _worker_state(w: LiveWorker, busy: bool) -> WorkerState:
    if w.lost:
        return WorkerState.LOST
    if w.record.draining:
        return WorkerState.DRAINING
    return WorkerState.BUSY if busy else WorkerState.READY


class Coordinator(ControlLoop):
    def __init__(self, store: Store, state_dir: str, *, heartbeat_timeout_s: float = 10.0,
                 heartbeat_interval_s: float = 1.0, tick_interval_s: float = 0.5,
                 start_timeout_s: float = 300.0, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES, allow_user_code: bool = False,
                 max_pending_per_user: int = DEFAULT_MAX_PENDING_PER_USER,
                 max_tasks_per_job: int = DEFAULT_MAX_TASKS_PER_JOB,
                 retention_s: float = DEFAULT_RETENTION_S,
                 user_quota: int = DEFAULT_USER_QUOTA_BYTES,
                 max_job_outputs: int = DEFAULT_MAX_JOB_OUTPUTS_BYTES,
                 max_job_logs: int = DEFAULT_MAX_JOB_LOG_BYTES,
                 disk_reserve: int = DEFAULT_RESERVE_BYTES,
                 disk_ballast: int | None = None,
                 blob_grace_s: float = DEFAULT_BLOB_GRACE_S, queues: Queues | None = None):
        #: recent progress and memory of each job, for the status page (not stored)
        self.series = Series()
        #: one tenant cannot fill the queue or the cluster: ``--max-pending-per-user``,
        #: ``--max-tasks-per-job`` (with authentication off every job has the owner "")
        self.max_pending_per_user = max_pending_per_user
        self.max_tasks_per_job = max_tasks_per_job
        #: jobs may run their own Python (``code:``) on the agents: ``--allow-user-code``
        self.allow_user_code = allow_user_code
        self.state_dir = state_dir
        #: the state directory's room: bulk writes stop at the reserve, the ballast is what a
        #: write that finds no room at all can free (``coordinator.disk``)
        self.disk = DiskGuard(state_dir, disk_reserve, disk_ballast)
        if isinstance(store, SqliteStore):
            store.on_full = self.disk.release
        # Agents known from before a restart get their retry backoff on top of the heartbeat
        # timeout to register again before they count as lost.
        super().__init__(store, ClusterState(
            JobTable(store), Agents(store.load_workers(), monotonic() + REREGISTER_GRACE_S)),
            BlobStore(state_dir, max_upload_bytes, disk=self.disk, user_quota=user_quota,
                      max_job_outputs=max_job_outputs, blob_grace_s=blob_grace_s,
                      on_hold=store.put_blob_owner, on_release=store.delete_blob_owner,
                      clock=clock), clock, monotonic=monotonic,
            heartbeat_timeout_s=heartbeat_timeout_s, tick_interval_s=tick_interval_s,
            start_timeout_s=start_timeout_s, retention_s=retention_s)
        self.logs = JobLogs(os.path.join(state_dir, "logs"), max_job_logs, self.disk,
                            account=self.blobs)
        owners = store.job_owners()
        self.blobs.load(store.load_blob_owners(), store.blob_refs(), owners)
        self.logs.load(owners)
        self.heartbeat_interval_s = heartbeat_interval_s
        #: ``--queues``: shares, priorities, fair share (none: one queue, oldest first)
        self.queueing = Queueing(queues)
        self._stops_sent: dict[tuple[str, str, str, int], float] = {}
        self._implausible_said: dict[str, float] = {}
        #: job id -> outputs refused so far (``output_refused``: a few become events)
        self._refusals_said: dict[str, int] = {}

    # --- views of a job ------------------------------------------------------------------------

    def with_outputs(self, job: Job) -> Job:
        """``job`` with its output directory and files as they are now."""
        files = self.blobs.outputs(job.id)
        out = self.blobs.output_dir(job.id) if files else ""
        tensorboard = ""
        if any(f.startswith("tensorboard/") for f in files):
            tensorboard = os.path.join(out, "tensorboard")
        else:  # still on the shared directory of the workers that run it
            for t in job.tasks:
                w = self.workers.get(t.worker)
                if w is not None and w.record.shared_dir:
                    tensorboard = os.path.join(w.record.shared_dir, "jobs", job.id, "output",
                                               "tensorboard")
                    break
        return dataclasses.replace(job, output_dir=out, outputs=files,
                                   tensorboard_dir=tensorboard)

    # --- job API ------------------------------------------------------------------------------

    def worker_offers(self, free: bool, needs: Needs = NO_NEEDS) -> list[WorkerOffer]:
        """The connected workers as the job planner sees them: whole budgets (admission: could
        the job ever run here) or free budgets (``strata plan``: where would it run now);
        only those that meet a job's ``needs`` (a shared directory, data roots)."""
        if free:
            return [WorkerOffer(c.name, c.free_bytes, w.record.cpu_kernels if w else "")
                    for c in self._capacities(needs) for w in (self.agents.get(c.name),)]
        # whole budgets change only when an agent comes, goes or drains: kept until then, a
        # submit does not list every agent again
        return self.state.whole_offers(needs)

    def offers_for(self, spec: JobSpec, free: bool) -> list[WorkerOffer]:
        """``worker_offers`` for this job (``Needs.of``)."""
        return self.worker_offers(free, Needs.of(spec))

    def _prepared(self, spec: JobSpec | Mapping[str, Any] | PreparedJob,
                  free: bool) -> PreparedJob:
        if isinstance(spec, PreparedJob):
            return spec
        parsed = spec if isinstance(spec, JobSpec) else parse_job_spec(spec)
        return prepare(parsed, self.offers_for(parsed, free), self.measured,
                       largest=self.largest_alloc)

    def _check_needs(self, spec: JobSpec) -> None:
        """A job whose data path no registered agent's ``--data-root`` holds is refused, and
        so is a job that checkpoints when agents are registered and none has a
        ``--shared-dir`` (with none registered yet it waits for them)."""
        known = [w for w in self.agents.values() if not w.lost]
        for field, path in (("data.path", spec.data.path), ("data.test_path", spec.data.test_path)):
            roots = [w.record.data_roots for w in known] if path else []
            if roots and not any(under_roots(path, r) for r in roots):
                confined = sorted({r for rs in roots for r in rs})
                raise SpecError(field, outside_message(confined).replace(
                    "the worker's", "any worker's"))
        if known and spec.elastic and not any(w.record.shared_dir for w in known):
            raise InfeasibleError(
                f"job {spec.name!r} is elastic (workers: {{min: {spec.workers_min}, max: "
                f"{spec.workers_max}}}) and resizes through checkpoints, but no worker has a "
                "shared directory: start the workers with --shared-dir DIR, a directory every "
                "worker sees at the same path, or give a fixed workers: N")
        if not spec.checkpoint_every_steps:
            return
        if known and not any(w.record.shared_dir for w in known):
            raise InfeasibleError(
                f"job {spec.name!r} asks for checkpoints (checkpoint.every_steps "
                f"{spec.checkpoint_every_steps}) but no worker has a shared directory: start "
                "the workers with --shared-dir DIR, a directory every worker sees at the same "
                "path (NFS, a ReadWriteMany volume; `strata up` makes one)",
                estimate_bytes=0, largest_budget_bytes=0)

    def job_for_request(self, request_id: str, owner: str = "") -> Job | None:
        """The job an earlier ``SubmitJob`` with this client request id created (for the
        same owner: another caller's id finds nothing)."""
        job_id = self._by_request.get(request_id) if request_id else None
        job = self.jobs.get(job_id) if job_id else None
        return job if job is not None and job.owner == owner else None

    def _check_limits(self, spec: JobSpec, tasks: int, owner: str) -> None:
        if tasks > self.max_tasks_per_job:
            field = "workers" if spec.workers > 1 else "stages"
            raise SpecError(field, f"the job would run {tasks} tasks; this coordinator allows at "
                                   f"most {self.max_tasks_per_job} per job "
                                   f"(--max-tasks-per-job)")
        pending = sum(1 for j in self.state.live.values()
                      if j.owner == owner and j.state == JobState.PENDING)
        if pending >= self.max_pending_per_user:
            who = f"{owner} has" if owner else "there are"
            raise QuotaExceeded(f"{who} {pending} jobs pending, the most this coordinator "
                                f"queues per user (--max-pending-per-user); wait for some to "
                                f"start or cancel some")

    def submit(self, spec: JobSpec | Mapping[str, Any] | PreparedJob,
               request_id: str = "", owner: str = "", queue_for_capacity_s: float = 0.0
               ) -> Job:
        """Accepts a job. ``request_id``: the client's id of this submission; a retry with the
        same id (its first reply lost) returns the job the first created. A job the cluster
        has never had the workers for is refused (``_check_capacity``), unless it may wait
        ``queue_for_capacity_s`` for them (then it fails if not placed by then)."""
        done = self.job_for_request(request_id, owner)
        if done is not None:
            return done
        prepared = self._prepared(spec, free=False)
        prepared = PreparedJob(self.queueing.resolve(prepared.spec, owner), prepared.plan)
        if prepared.spec.elastic and self.state.whole_offers(Needs.of(prepared.spec)):
            # as wide as places now, at least min (waiting, it narrows: _place_narrower)
            prepared = PreparedJob(*self._widest(prepared.spec))
        spec, plan = prepared.spec, prepared.plan
        self._check_limits(spec, len(plan.tasks), owner)
        self.queueing.check_share(spec, Share(len(plan.tasks),
                                              sum(t.memory_budget_bytes for t in plan.tasks)))
        self._check_needs(spec)
        if not plan.feasible:
            budgets = [w.record.budget_bytes for w in self.agents.values() if not w.lost]
            raise InfeasibleError(f"job {spec.name!r} cannot run on this cluster: {plan.reason}",
                                  estimate_bytes=plan.largest_estimate,
                                  largest_budget_bytes=max(budgets, default=0))
        if not queue_for_capacity_s:
            self._check_capacity(spec, plan)
        deadline = self.clock() + queue_for_capacity_s if queue_for_capacity_s else 0.0
        if not wants_probe(spec, plan) or measured_kinds(spec, self.measured):
            return self._add_job(spec, plan, request_id=request_id, owner=owner,
                                 deadline=deadline)
        # memory.profile: a short run of the same plan measures every task first; the job
        # waits for it, then is planned with what it measured (``_after_probe``)
        budget = first_probe_budget(spec, plan, self.measured)
        probe = self._add_job(probe_spec(spec), probe_plan(plan, budget),
                              note=f"memory probe of job {spec.name!r}", owner=owner,
                              probe_of=spec.name)
        job = self._add_job(spec, plan, request_id=request_id, owner=owner, deadline=deadline)
        self._start_probe(job, probe, budget)
        return job

    def _check_capacity(self, spec: JobSpec, plan: JobPlan) -> None:
        """Refuses a job that the workers this coordinator has known (connected now or not,
        draining or lost: all it has been offered) could never hold together: it would wait
        for ever. A cluster with no workers yet is starting: its jobs wait for them."""
        needs = Needs.of(spec)
        known = [w for w in self.agents.values() if needs.met_by(w.record)]
        if not known:
            return
        demands = [TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in plan.tasks]
        if place(demands, [Capacity(w.name, w.record.budget_bytes, w.record.budget_bytes)
                           for w in known]).placed:
            return
        sizes = sorted((d.budget_bytes for d in demands), reverse=True)
        have = sorted((w.record.budget_bytes for w in known), reverse=True)
        fit = sum(1 for b in have if b >= sizes[-1])
        raise InfeasibleError(
            f"job {spec.name!r} needs {len(demands)} workers, one task each "
            f"({_sizes(sizes)}), and this cluster has had {len(known)} "
            + ("that meet its needs " if needs != NO_NEEDS else "")
            + f"({_sizes(have)}; {fit} with {format_size(sizes[-1])} or more): it would wait "
            "for ever. Add workers, ask for fewer (workers, parameter_servers, stages), or "
            "submit with --queue-for-capacity DURATION to wait for workers that will come",
            estimate_bytes=plan.largest_estimate, largest_budget_bytes=have[0])

    def queue_views(self) -> list[QueueView]:
        """Each queue: its shares, what its jobs hold, how many wait and run."""
        return self.queueing.views(self.state.live.values())

    def get(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise NotFoundError("job", job_id)
        return job

    def list_jobs(self) -> list[Job]:
        """Every job, oldest first (each finished one loaded: views page ``jobs.summaries()``
        and load what they show)."""
        return sorted(self.jobs.values(), key=lambda j: (j.created_at, j.id))

    def cancel(self, job_id: str) -> Job:
        job = self.get(job_id)
        if job.state.final:
            raise InvalidTransition("job", job.state.value, JobState.CANCELLED.value)
        self._stop_job(job, JobState.CANCELLED, "cancelled by user")
        probe = self.jobs.get(self._probe_of.pop(job.id, ""))
        if probe is not None and not probe.state.final:
            self._stop_job(probe, JobState.CANCELLED, f"job {job.id} it measured was cancelled")
        return job

    def plan(self, spec: JobSpec | Mapping[str, Any] | PreparedJob) -> Plan:
        """What the coordinator would run now, on the free budgets of the connected workers;
        infeasible, with the reason, where submit would refuse it (``_check_capacity``)."""
        prepared = self._prepared(spec, free=True)
        shown = plan_on(prepared, self._capacities(Needs.of(prepared.spec)), self.measured)
        if shown.feasible:
            try:
                self._check_capacity(prepared.spec, prepared.plan)
            except InfeasibleError as e:
                return dataclasses.replace(shown, feasible=False, reason=str(e))
        return shown

    async def watch(self, job_id: str, after_seq: int = 0,
                    max_interval_s: float = 5.0) -> AsyncIterator[JobEvent]:
        """Stored events after ``after_seq``, then a snapshot at every change, until the job ends."""
        job = self.get(job_id)
        seq = after_seq
        first = True
        while True:
            final = job.state.final
            new = self.store.events(job_id, seq)
            for rec in new:
                seq = rec.seq
                yield JobEvent(rec.seq, rec.time, rec.kind, rec.message, job)
            if first or not new:
                yield JobEvent(0, self.clock(), "progress", "", job)
            first = False
            if final:
                return
            try:
                await asyncio.wait_for(self._signal(job_id).wait(), timeout=max_interval_s)
            except asyncio.TimeoutError:
                pass

    # --- logs ---------------------------------------------------------------------------------

    def log_path(self, job_id: str, role: str, index: int) -> str:
        return self.logs.path(job_id, role, index)

    def live_task(self, worker: str, session: str, job_id: str, role: str, index: int,
                  attempt: int) -> tuple[Job, Task]:
        """The task an agent's call names, if that agent runs it now: assigned to ``worker``,
        of this ``attempt``, not ended. Anything else is ``NotYours`` (PERMISSION_DENIED):
        another agent's task, an attempt that moved on, a task or job that has ended."""
        self.agents.check_session(worker, session)
        job = self.jobs.get(job_id)
        task = self._task(job_id, role, index) if job is not None else None
        what = f"task {role[:32]}:{index} of job {job_id[:64]!r}"
        if job is None or task is None or task.worker != worker:
            raise NotYours(f"{what} is not assigned to worker {worker[:64]!r}")
        if attempt != task.attempt:
            raise NotYours(f"{what}: attempt {attempt} is not its current attempt "
                           f"{task.attempt}")
        if task.state.final:
            raise NotYours(f"{what} has ended ({task.state.value})")
        return job, task

    def append_logs(self, worker: str, session: str, job_id: str, role: str, index: int,
                    data: bytes, attempt: int) -> None:
        """A chunk of a task's output, from the agent that runs it (``live_task``)."""
        job, _ = self.live_task(worker, session, job_id, role, index, attempt)
        self.logs.append(job_id, role, index, data, job.owner)

    def may_fetch(self, worker: str, session: str, sha: str) -> None:
        """An agent fetches only the files that the jobs of the tasks it runs name."""
        self.agents.check_session(worker, session)
        for job in self.state.live.values():
            if sha in job_blobs(job.spec) and any(
                    t.worker == worker and not t.state.final for t in job.tasks):
                return
        raise NotYours(f"no task on worker {worker[:64]!r} needs blob {sha[:12]}")

    def output_task(self, worker: str, session: str, job_id: str, role: str, index: int,
                    attempt: int, path: str) -> Job:
        """The job an agent may upload output ``path`` of: its lead task runs on that agent
        (``live_task``), the job has not ended (a finished job's outputs never change), and
        it is not a memory probe (which keeps figures, no files). ``metrics.json`` is the
        coordinator's own."""
        job, task = self.live_task(worker, session, job_id, role, index, attempt)
        if job.state.final:
            raise NotYours(f"job {job.id} has ended ({job.state.value}): its outputs are kept "
                           "as they are")
        if not strategies.get(job.strategy).is_lead(task):
            raise NotYours(f"task {role[:32]}:{index} of job {job.id} is not the task whose "
                           "outputs the job keeps")
        if job.recovery.probe_of:
            raise NotYours(f"job {job.id} is a memory probe: it keeps figures, no outputs")
        if safe_relpath(path) == "metrics.json":  # however spelt (./metrics.json, a/../...)
            raise NotYours("metrics.json is written by the coordinator")
        return job

    def read_logs(self, job_id: str, tasks: list[tuple[str, int]], follow: bool,
                  tail_lines: int = 0) -> AsyncIterator[tuple[str, int, bytes]]:
        job = self.get(job_id)
        return self.logs.read(job_id, tasks, follow,
                              lambda: job.state.final and all(t.state.final for t in job.tasks),
                              tail_lines)

    def delete(self, job_id: str) -> Job:
        """Forgets a finished job: its records, events, logs and stored outputs. Checkpoints on
        the agents' shared directory are the agents' (``jobs/JOB_ID/`` there)."""
        job = self.get(job_id)
        if not job.state.final or any(not t.state.final for t in job.tasks):
            raise InvalidTransition("job", job.state.value, "DELETED",
                                    hint="cancel it first, then delete it once it has ended")
        for probing, probe in list(self._probe_of.items()):
            if job.id in (probing, probe):
                del self._probe_of[probing]
        self.state.forget_job(job.id)
        self._tried.pop(job.id, None)
        self._needs.pop(job.id, None)
        if job.recovery.request_id:
            self._by_request.pop(job.recovery.request_id, None)
        for d in (self._metrics_saved, self._scheduled_at, self._refusals_said,
                  self._notes_said):
            d.pop(job.id, None)
        self.store.delete_job(job.id)
        self.series.forget(job.id)
        self.logs.delete(job.id)
        self.blobs.delete_outputs(job.id)
        self.blobs.detach(job.id, job_blobs(job.spec))
        self.agents.broadcast(PurgeJobCommand(job_id=job.id))
        self._notify(job.id)
        return job

    # --- cluster API --------------------------------------------------------------------------

    def register(self, name: str, host: str, device: str, budget_bytes: int, free_ports: list[int],
                 reports: list[TaskReport], work_dir: str = "", pid: int = 0,
                 shared_dir: str = "", draining: bool = False,
                 data_roots: list[str] | None = None, caller: Caller | None = None,
                 cpu_kernels: str = "") -> str:
        now = self.clock()
        rec = WorkerRecord(name=name, address=host, device=device, budget_bytes=budget_bytes,
                           work_dir=work_dir, last_seen=now, shared_dir=shared_dir,
                           data_roots=list(data_roots or []), cpu_kernels=cpu_kernels)
        live = self.agents.register(rec, pid, free_ports, now, self.monotonic(),
                                    self.heartbeat_timeout_s)
        live.caller = caller
        self.heartbeat_delay.forget(name)
        self.state.agent_registered(live, draining)
        self.store.put_worker(live.record)
        self._reconcile(live, reports)
        self.wake()
        return live.session

    def _reconcile(self, live: LiveWorker, reports: list[TaskReport]) -> None:
        """Aligns what the agent runs with what the coordinator assigned to it."""
        todo = reconcile(live.name, reports, self.jobs, list(self.state.live.values()))
        for r in todo.apply:
            self._report(live, r)
        for r in todo.stop_again:
            self._resend_stop(live, r)
        for cmd in todo.stop:
            self.agents.send(live.name, cmd)
        for t in todo.cancel:
            self.state.set_task_state(t, TaskState.CANCELLED)
            self.store.put_tasks([t])
        for job, t in todo.start_again:
            self._send_start(job, t)
        for job, t in todo.lost:
            self._fail_task(job, t, FailureKind.LOST,
                            "the agent restarted and no longer runs this task")

    def heartbeat(self, name: str, session: str, memory: MemoryStatus, reports: list[TaskReport],
                  free_ports: list[int], sent_at: float = 0.0,
                  disk: DiskStatus | None = None) -> None:
        live = self.agents.check_session(name, session)
        was_lost = live.lost
        live.last_seen, live.heard = self.clock(), self.monotonic()
        self.heartbeat_delay.observe(name, live.last_seen, sent_at)
        live.memory = memory
        if disk is not None:
            live.disk = disk
        if was_lost:
            self.state.agent_back(live)
            log.info("worker %s is back", name)
            self.wake()
        # A heartbeat composed before the agent saw its latest start may still offer the port
        # that start took: never hand out a port a live task of this worker holds.
        self.state.ports_offered(live, free_ports)
        for r in reports:
            job, task = self._report(live, r)
            if r.state.final:
                continue
            if job is None or task is None or job.state.final or task.worker != name \
                    or (job.state == JobState.RESTARTING and r.attempt == task.attempt):
                # a process of an ended job, of an attempt that moved elsewhere, or of a job
                # that is restarting: its stop may have been lost
                self._resend_stop(live, r)

    def _resend_stop(self, live: LiveWorker, r: TaskReport) -> None:
        now = self.clock()
        key = (live.name, *r.key)
        if now - self._stops_sent.get(key, 0.0) >= STOP_RESEND_INTERVAL_S:
            self._stops_sent[key] = now
            self.agents.send(live.name, StopTaskCommand(job_id=r.job_id, role=r.role,
                                                        index=r.index, reason="its job has ended",
                                                        attempt=r.attempt))

    def _implausible(self, worker: str, e: SpecError) -> None:
        """A heartbeat's report that claims the impossible is not applied; said once a minute
        per agent (the heartbeat itself goes on: it is how the agent is known alive)."""
        now = self.clock()
        if now - self._implausible_said.get(worker, 0.0) >= 60.0:
            self._implausible_said[worker] = now
            log.warning("worker %s: a report was refused: %s", worker, e)

    def tasks_on(self, name: str) -> int:
        """Tasks assigned to the worker that have not ended."""
        return sum(1 for j in self.state.live.values() for t in j.tasks
                   if t.worker == name and not t.state.final)

    def drain(self, name: str, deadline_s: float = 0.0) -> WorkerInfo:
        """``strata drain``: no new placements on the worker; every running job with a task
        there restarts elsewhere (not counted against ``restart.max_restarts``: nothing
        failed): from its latest checkpoint, or with ``deadline_s`` (a notice: the worker
        leaves within it) from one its tasks save on notice (``_notice``). The worker stays
        DRAINING until it registers again without asking to drain."""
        if not 0.0 <= deadline_s <= MAX_NOTICE_S:  # (NaN too)
            raise SpecError("deadline_s", f"a notice's deadline is 0 (none) to "
                                          f"{MAX_NOTICE_S:g} s, not {deadline_s}")
        live = self.agents.get(name)
        if live is None:
            raise NotFoundError("worker", name)
        if not live.record.draining:
            self.state.agent_draining(live)
            self.store.put_worker(live.record)
            log.info("worker %s draining", name)
        for job in list(self.state.live.values()):
            if job.state in (JobState.SCHEDULED, JobState.RUNNING) and any(
                    t.worker == name and not t.state.final for t in job.tasks):
                if deadline_s > 0:
                    self._notice(job, name, deadline_s)
                else:
                    self._restart(job, f"worker {name} is draining", failure=False)
        self.wake()
        return self.list_workers([name])[0]

    def commands(self, name: str, session: str) -> AsyncIterator[AgentCommand]:
        return self.agents.commands(name, session)

    def report(self, worker: str, session: str, r: TaskReport, strict: bool = False) -> None:
        """An agent's report of one task. ``strict`` (a ``ReportTask`` call) refuses a report
        of a task the agent does not run now (``live_task``: ``NotYours``) or whose figures
        are impossible (``confine.check_report``: ``SpecError`` naming the field). A
        heartbeat's reports are not refused but such ones are not applied: a heartbeat
        repeats what an agent still runs of an attempt that moved on."""
        self._report(self.agents.check_session(worker, session), r, strict)

    def _report(self, live: LiveWorker, r: TaskReport, strict: bool = False
                ) -> tuple[Job | None, Task | None]:
        """``report`` for a checked session; returns the job and task ``r`` names (None where
        there is none), applied or not."""
        worker = live.name
        if strict:
            job, task = self.live_task(worker, live.session, *r.key, r.attempt)
        else:
            job_or_none, task_or_none = self._job_task(r.job_id, r.role, r.index)
            if job_or_none is None or task_or_none is None or task_or_none.worker != worker \
                    or r.attempt != task_or_none.attempt or task_or_none.state.final:
                return job_or_none, task_or_none
            job, task = job_or_none, task_or_none
        try:
            check_report(r, job.spec, live.record.budget_bytes, self.clock(),
                         task.memory_budget_bytes)
        except SpecError as e:
            if strict:
                raise
            self._implausible(worker, e)
            return job, task
        strategy = strategies.get(job.strategy)
        # (a task's kind hashes its job's spec: found only for a figure kept by kind)
        kind = "" if job.spec is None or not r.largest_alloc_bytes else task_kind(
            job.spec, task.role, task.index, task.first_layer, task.last_layer)
        fx = decisions.on_report(
            job, task, r, lead=strategy.is_lead(task),
            stopped_is_success=(r.state == TaskState.CANCELLED
                                and strategy.stopped_counts_as_success(job, task)),
            kind=kind, largest_known=self.largest_alloc.get(kind, 0) if kind else 0,
            notes_said=self._notes_said.get(job.id, NO_NOTES))
        # its effects: the task's and the job's fields, the store, the events, then the
        # task's move (``_move_task``)
        task.in_use_bytes, task.peak_memory_bytes = fx.in_use_bytes, fx.peak_bytes
        for name, value in fx.task.items():
            setattr(task, name, value)
        if fx.largest_alloc is not None:
            self.largest_alloc[fx.largest_alloc[0]] = fx.largest_alloc[1]
        for note in fx.notes:
            self._notes_said.setdefault(job.id, set()).add(note)
            self._event(job, "note", note)
        if fx.job or fx.recovery or fx.metrics:
            for name, value in fx.job.items():
                setattr(job, name, value)
            for name, value in fx.recovery.items():
                setattr(job.recovery, name, value)
            for name, value in fx.metrics.items():
                setattr(job.metrics, name, value)
        if fx.write_job:
            self.store.put_job(job)
        for kind, message in fx.events:
            self._event(job, kind, message)
        if fx.job and job.recovery.notice_step and decisions.notice_saved(job):
            self._notice_saved(job)  # before the task's stop on notice is taken
        self.series.record(job, task, self.clock())
        if fx.move is not None:
            self._move_task(job, task, r, fx)
        elif fx.progressed:
            now = self.clock()
            if now - self._metrics_saved.get(job.id, 0.0) >= METRICS_PERSIST_INTERVAL_S:
                self._metrics_saved[job.id] = now
                self.store.put_job(job)
                self.store.put_tasks([task])
            self._notify(job.id)
        return job, task

    # --- control loop -------------------------------------------------------------------------

    def revoke_agents(self, match: Callable[[Caller, str], bool], why: str) -> list[str]:
        """The connected agents whose credential (and name) ``match`` are LOST at once: their
        sessions end, their tasks fail as a lost agent's do (their jobs restart elsewhere
        from their checkpoints), nothing more is placed on them. Returns their names."""
        lost = []
        for w in list(self.agents.values()):
            if w.connected and w.caller is not None and match(w.caller, w.name):
                self._mark_lost(w, f"its credentials were revoked: {why}")
                lost.append(w.name)
        if lost:
            self.wake()
        return lost

    def output_refused(self, job: Job, path: str, why: str) -> None:
        """An output the job's agent could not store (a quota, a cap, the disk): the job
        says so, as its outputs will lack it; the first few times (an agent that tries again
        and again writes no event each time)."""
        n = self._refusals_said.get(job.id, 0)
        self._refusals_said[job.id] = n + 1
        if n < MAX_REFUSAL_EVENTS:
            self._event(job, "message", f"output {path[:64]!r} not kept: {why}"
                        + ("; later refusals are not recorded" if n + 1 == MAX_REFUSAL_EVENTS
                           else ""))

    def disk_status(self) -> CoordinatorDisk:
        """What ``--state-dir`` holds by kind, and what its file system has left."""
        use = self.disk.use()
        blobs, outputs = self.blobs.totals()
        logs = self.logs.total()
        db = 0
        path = getattr(self.store, "path", "")  # the store's file, when it keeps one
        for suffix in ("", "-wal", "-shm") if path and path != ":memory:" else ():
            try:
                db += os.path.getsize(path + suffix)
            except OSError:
                pass
        return CoordinatorDisk(
            disk=DiskStatus(used_bytes=blobs + outputs + logs + db, free_bytes=use.free_bytes,
                            total_bytes=use.total_bytes),
            blobs_bytes=blobs, outputs_bytes=outputs, logs_bytes=logs,
            reserve_bytes=self.disk.reserve_bytes)

    # --- views --------------------------------------------------------------------------------

    def worker_names(self) -> list[str]:
        """Every worker's name, in no order."""
        return list(self.agents.workers)

    def busy_workers(self) -> set[str]:
        """The workers that hold a task not yet ended."""
        return {t.worker for j in self.state.live.values() for t in j.tasks
                if t.worker and not t.state.final}

    def worker_rows(self, names: Iterable[str] | None = None, busy: set[str] | None = None
                    ) -> list[tuple[str, str, WorkerState, int, int, int, int]]:
        """Each worker's name, device, state, and memory budget, reserved, in use and peak
        (bytes), in no order: what ``list_workers`` says of each worker but its tasks, at a
        fraction of its cost. Every worker, or those of ``names`` (a name not known is left
        out); ``busy``: ``busy_workers()`` as read before, by a view that reads the rows a
        part at a time (``/metrics``) and finds the busy ones once."""
        if busy is None:
            busy = self.busy_workers()
        reserved = self.state.reservations
        chosen = self.agents.values() if names is None else \
            [w for w in map(self.agents.get, names) if w is not None]
        return [(w.name, w.record.device, _worker_state(w, w.name in busy), w.record.budget_bytes,
                 reserved.get(w.name, 0), w.memory.in_use_bytes, w.memory.peak_bytes)
                for w in chosen]

    def list_workers(self, names: Iterable[str] | None = None) -> list[WorkerInfo]:
        """Every worker, or those of ``names`` (a name not known is left out), by name. Each
        costs about 14 µs to build: views of thousands of workers page or step through their
        names (``worker_rows``) and build a part at a time."""
        reserved = self.state.reservations
        wanted = None if names is None else set(names)
        on: dict[str, list[WorkerTask]] = {}
        for j in self.state.live.values():
            for t in j.tasks:
                if t.worker and not t.state.final and (wanted is None or t.worker in wanted):
                    on.setdefault(t.worker, []).append(WorkerTask(
                        job_id=t.job_id, role=t.role, index=t.index, state=t.state,
                        memory_budget_bytes=t.memory_budget_bytes, in_use_bytes=t.in_use_bytes,
                        peak_bytes=t.peak_memory_bytes))
        chosen = self.agents.values() if wanted is None else \
            [w for n in wanted if (w := self.agents.get(n)) is not None]
        out = []
        for w in sorted(chosen, key=lambda w: w.name):
            tasks = on.get(w.name, [])
            out.append(WorkerInfo(
                name=w.name, address=w.record.address, device=w.record.device,
                state=_worker_state(w, bool(tasks)),
                memory=MemoryStatus(budget_bytes=w.record.budget_bytes,
                                    reserved_bytes=reserved.get(w.name, 0),
                                    in_use_bytes=w.memory.in_use_bytes,
                                    peak_bytes=w.memory.peak_bytes),
                tasks=tasks, last_seen=w.last_seen, shared_dir=w.record.shared_dir,
                data_roots=list(w.record.data_roots), disk=w.disk,
                cpu_kernels=w.record.cpu_kernels))
        return out
