"""The coordinator's state and control loop: the job lifecycle.

Everything here runs on one asyncio event loop (the gRPC aio server's), so the live state needs no
locks: gRPC handlers and the control loop take turns. Every change is written through to the
``Store`` so that a restarted coordinator resumes from it. Decisions are pure functions that
return data, and this module carries them out: placement (``coordinator.placement``), the
strategy's plan, success rule and failure policy (``strata.strategies``), and how a registering
agent's tasks line up (``coordinator.agents.reconcile``). Agent sessions live in
``coordinator.agents``, job logs in ``coordinator.logs``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import math
import os
import re
import secrets
import time
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Sequence

from strata import strategies
from strata.coordinator.agents import (
    AgentCommand, Agents, CallWait, HeartbeatDelay, LiveWorker, Needs, NO_NEEDS, StartTaskCommand,
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
from strata.coordinator.placement import Capacity, Placement, TaskDemand, place
from strata.coordinator.series import Series
from strata.coordinator import decisions
from strata.coordinator.state import ClusterState
from strata.coordinator.store import SqliteStore, Store, WorkerRecord
from strata.errors import (
    DiskFull, InfeasibleError, InvalidTransition, NotFoundError, NotYours, QuotaExceeded, SpecError,
)
from strata.dataroots import outside_message, under_roots
from strata.limits import (
    DEFAULT_MAX_PENDING_PER_USER, DEFAULT_MAX_TASKS_PER_JOB, DEFAULT_RETENTION_S,
)
from strata.measured import apply_measured, bound_of, measured_kinds, task_kind
from strata.memory import uncalibrated_kinds
from strata.units import format_size
from strata.oom import describe as describe_oom
from strata.oom import needed_bytes
from strata.modelspec import ModelSpecError, profile_model
from strata.spec import parse_job_spec
from strata.jobspec import JobSpec
from strata.strategies import FailureAction, describe_failure
from strata.taskconfig import REPORT_INTERVAL_S, TaskConfig
from strata.tfconfig import build_tf_config
from strata.auth import Caller
from strata.types import (
    CoordinatorDisk, DiskStatus, FailureKind, Job, JobEvent, JobPlan, JobState, MemoryStatus,
    Plan, Task, TaskPlan, TaskReport, TaskState, WorkerInfo, WorkerOffer, WorkerState, WorkerTask,
    can_transition,
)

__all__ = ["Coordinator", "PreparedJob", "StartTaskCommand", "StopTaskCommand", "AgentCommand",
           "LiveWorker"]

log = logging.getLogger("strata.coordinator")

#: a job none of whose tasks' notes were said yet
NO_NOTES: frozenset[str] = frozenset()
# How often progress metrics are written to the store (they are always live in memory).
METRICS_PERSIST_INTERVAL_S = 2.0
# Bytes no task could ever need; larger estimates come from nonsense shapes and would overflow
# the store's 64-bit integers.
MAX_TASK_BYTES = 1 << 50
# A stop for a task of a finished job is repeated at most this often while the agent still
# reports the task running (the first stop may have been lost on a reconnect).
STOP_RESEND_INTERVAL_S = 5.0
# ``memory.profile: auto`` probes jobs whose largest task estimate is at least this. A probe costs
# one more start of the job's processes (about 8 s on 2 cores: TensorFlow's import, the
# rendezvous, tracing) and saves what the estimate overstates; under this size a task's budget
# is dominated by the 16 MiB floor of the headroom and the estimators' error is a few MiB.
PROBE_FROM_BYTES = 64 << 20
# Agents retry registration with backoff of up to 5 s x 1.5 (``worker.agent``): after a
# coordinator restart the agents it knew have this long beyond the heartbeat timeout to come
# back before they are LOST (and their jobs restart)
REREGISTER_GRACE_S = 10.0
#: the least time between two ticks of the control loop
MIN_TICK_GAP_S = 0.05
#: a gap between ticks longer than this (real time) means the event loop was held up
LOOP_STALL_S = 2.0
#: the most the wait of heartbeats before they are handled may add to the heartbeat timeout,
#: in timeouts: a dead agent is still judged within (1 + this) timeouts under any burst
MAX_DELAY_ALLOWANCE = 5.0
#: how often finished jobs are checked against --retention
EXPIRY_INTERVAL_S = 60.0
# The first probe of a model only the job's code builds gets this per task (it has no estimate:
# the job itself is planned at a whole worker until measured). Most users' models train in less
# (the tutorial's CNN peaks under 100 MiB, keras.applications' ResNet50 at 32x32 and batch 32
# under 600 MiB); one that needs more runs out of memory within its first step and is probed
# again with PROBE_GROWTH times as much (or half again what it was seen to need): a few extra
# probe starts (~10 s each on 2 cores) for a large model instead of a whole worker held for
# every small one.
PROBE_FIRST_BYTES = 256 << 20
PROBE_GROWTH = 4
# how long a job waits, after its probe ended, for the probe's remaining tasks to report their end
PROBE_SETTLE_S = 30.0
#: refused outputs of a job that become events (an agent that retries writes no more)
MAX_REFUSAL_EVENTS = 5


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    spec: JobSpec
    plan: JobPlan


def plan_on(prepared: PreparedJob, capacities: Sequence[Capacity],
            measured: Mapping[str, int]) -> Plan:
    """A prepared job placed on these capacities: what ``strata plan`` shows, for the
    coordinator's workers or (offline) for N workers of a given budget."""
    spec, plan = prepared.spec, prepared.plan
    placement = place([TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in plan.tasks],
                      list(capacities)) if plan.feasible else None
    assigned = placement.assignments if placement is not None else {}
    tasks = [dataclasses.replace(t, worker=assigned.get((t.role, t.index), "")
                                 if assigned else t.worker) for t in plan.tasks]
    if not plan.feasible:
        return Plan(spec.strategy, False, plan.reason, tasks)
    summary = f"{plan.summary}; " if plan.summary else ""
    if wants_probe(spec, plan) and not measured_kinds(spec, measured):
        summary += (f"memory.profile: a probe run ({probe_spec(spec).training.steps} steps) "
                    "measures the tasks first and the estimates become its peaks; ")
    if placement is None or not placement.assignments:
        why = placement.reason if placement is not None else ""
        return Plan(spec.strategy, True, f"{summary}admissible; would wait: {why}", tasks)
    return Plan(spec.strategy, True, f"{summary}fits now", tasks)


def prepare(spec: JobSpec | Mapping[str, Any], workers: Sequence[WorkerOffer] = (),
            measured: Mapping[str, int] | None = None, *, probed: bool = False,
            largest: Mapping[str, int] | None = None) -> PreparedJob:
    """Validates a spec (unless already parsed) and has its strategy plan the tasks against
    ``workers`` (a snapshot: see ``Coordinator.worker_offers``), with estimates raised to what
    earlier runs ``measured`` (``strata.measured``), or with ``probed`` set to it (a probe run
    of this plan just measured it). Pure and possibly slow (it profiles the model and may run
    the stage planner), so the service runs it off the event loop. Raises SpecError naming the
    field."""
    if not isinstance(spec, JobSpec):
        spec = parse_job_spec(spec)
    profile = None  # a model only the job's code builds: measured by a probe (``wants_probe``)
    if not spec.code_model:
        try:
            profile = profile_model(dict(spec.model))
        except ModelSpecError as e:
            raise SpecError(e.field, e.message) from None
    plan = strategies.get(spec.strategy).plan(spec, list(workers), profile)
    # a model only its code builds has no estimate (its plan holds a whole worker): what a
    # run of it measured replaces that, as a probe's figures do
    placeholder = bool(spec.code_model) and not spec.memory.per_task_budget
    plan = apply_measured(spec, plan, measured or {}, list(workers), lower=probed or placeholder,
                          largest=largest)
    offered = {w.name: w.bytes for w in workers}
    if plan.feasible and any(t.worker in offered and t.memory_budget_bytes > offered[t.worker]
                             for t in plan.tasks):
        # a planner fitted estimates to these workers; a budget's room for the task's largest
        # allocation can outgrow the worker chosen: the job must still be placeable as a whole
        placed = place([TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in plan.tasks],
                       [Capacity(w.name, w.bytes, w.bytes) for w in workers])
        if not placed.placed:
            worst = max(plan.tasks, key=lambda t: t.memory_budget_bytes)
            plan = dataclasses.replace(plan, feasible=False, reason=(
                f"the tasks' budgets (estimates plus headroom, with room for each task's largest "
                f"tensor) do not fit the workers together; the largest is "
                f"{worst.role}:{worst.index}'s {format_size(worst.memory_budget_bytes)}: add "
                "workers or larger ones, or use more stages"))
    for t in plan.tasks:
        need = max(t.estimated_memory_bytes, t.memory_budget_bytes)
        if need > MAX_TASK_BYTES:
            field = "memory.per_task_budget" if t.memory_budget_bytes > MAX_TASK_BYTES else "model"
            raise SpecError(field, f"task {t.role}:{t.index} would need {format_size(need)}, "
                                   "beyond any machine")
    return PreparedJob(spec=spec, plan=plan)


def wants_probe(spec: JobSpec, plan: JobPlan) -> bool:
    """``memory.profile``: ``true`` always probes a job not measured yet, ``false`` never;
    ``auto`` probes when the job's budgets come from the estimates (no fixed
    ``memory.per_task_budget``) and its largest task estimate is ``PROBE_FROM_BYTES`` or more,
    or its model has a layer kind the estimators were not fitted on
    (``strata.memory.CALIBRATED_KINDS``): modelled is not measured."""
    if spec.memory.profile == "true":
        return True
    if spec.memory.profile == "false" or spec.memory.per_task_budget:
        return False
    if plan.largest_estimate >= PROBE_FROM_BYTES or spec.code:
        return True  # a code model or dataset: nothing was estimated from what it holds
    try:
        return bool(uncalibrated_kinds(profile_model(dict(spec.model))))
    except ModelSpecError:
        return True


def first_probe_budget(spec: JobSpec, plan: JobPlan, measured: Mapping[str, int]) -> int:
    """The per-task budget of a job's first probe: for a model only its code builds (no
    estimate; planned at a whole worker, ``code_model_plan``) ``PROBE_FIRST_BYTES``, or half
    again what an earlier run of it ran out of memory at (``strata.measured``), so that the
    probe runs beside other jobs instead of waiting for whole workers; a probe that runs out
    of memory is started again with more (``Coordinator._grow_probe``). 0 (the plan's own
    budgets) for every other job: their estimates size the probe."""
    if not spec.code_model or spec.memory.per_task_budget:
        return 0
    smallest = min((t.memory_budget_bytes for t in plan.tasks), default=0)
    bound = max((measured.get(bound_of(task_kind(spec, t.role, t.index, t.first_layer,
                                                 t.last_layer)), 0) for t in plan.tasks),
                default=0)
    first = max(PROBE_FIRST_BYTES, bound * 3 // 2)
    return first if first < smallest else 0


def probe_plan(plan: JobPlan, budget: int) -> JobPlan:
    """``plan`` with every task's budget (and estimate) at most ``budget`` (0: as it is)."""
    if not budget:
        return plan
    return dataclasses.replace(plan, tasks=tuple(
        dataclasses.replace(t, memory_budget_bytes=min(t.memory_budget_bytes, budget),
                            estimated_memory_bytes=min(t.estimated_memory_bytes, budget))
        for t in plan.tasks))


def probe_spec(spec: JobSpec) -> JobSpec:
    """The probe run of ``spec`` (``memory.profile``): the same job, memory-wise (the same
    ``strata.measured`` fingerprint), for ``probe_steps`` steps and its evaluation."""
    steps = strategies.get(spec.strategy).probe_steps(spec)
    if spec.training.steps:
        steps = min(steps, spec.training.steps)
    return dataclasses.replace(
        spec, name=f"{spec.name}-probe",
        training=dataclasses.replace(spec.training, steps=steps, epochs=0),
        memory=dataclasses.replace(spec.memory, profile="false"),
        # a few steps: nothing to checkpoint, and a failure is the job's answer, not retried
        checkpoint_every_steps=0, max_restarts=0)


def _sizes(sizes: list[int]) -> str:
    """``3 x 1 GiB, 512 MiB``: sizes, largest first, equal ones counted."""
    out: list[str] = []
    for size in sorted(set(sizes), reverse=True):
        n = sizes.count(size)
        out.append(f"{n} x {format_size(size)}" if n > 1 else format_size(size))
    return ", ".join(out[:6]) + (", ..." if len(out) > 6 else "")


@functools.lru_cache(maxsize=1024)  # a thousand waiting jobs share a handful of messages
def _shape(message: str) -> str:
    """A message with its numbers left out: what kind of thing it says."""
    return re.sub(r"[0-9][0-9.,]*", "#", message)


def _tasks_of(job_id: str, plan: JobPlan, attempt: int = 0) -> list[Task]:
    return [Task(job_id=job_id, role=t.role, index=t.index, stage=t.stage, replica=t.replica,
                 first_layer=t.first_layer, last_layer=t.last_layer, layers=list(t.layers),
                 memory_budget_bytes=t.memory_budget_bytes,
                 estimated_memory_bytes=t.estimated_memory_bytes, attempt=attempt)
            for t in plan.tasks]


def _worker_state(w: LiveWorker, busy: bool) -> WorkerState:
    if w.lost:
        return WorkerState.LOST
    if w.record.draining:
        return WorkerState.DRAINING
    return WorkerState.BUSY if busy else WorkerState.READY


class Coordinator:
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
                 blob_grace_s: float = DEFAULT_BLOB_GRACE_S):
        self.store = store
        #: finished jobs are deleted this long after they ended (``--retention``; 0: kept)
        self.retention_s = retention_s
        self._next_expiry = 0.0
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
        self.blobs = BlobStore(state_dir, max_upload_bytes, disk=self.disk,
                               user_quota=user_quota, max_job_outputs=max_job_outputs,
                               blob_grace_s=blob_grace_s, on_hold=store.put_blob_owner,
                               on_release=store.delete_blob_owner, clock=clock)
        self.logs = JobLogs(os.path.join(state_dir, "logs"), max_job_logs, self.disk,
                            account=self.blobs)
        owners = store.job_owners()
        self.blobs.load(store.load_blob_owners(), store.blob_refs(), owners)
        self.logs.load(owners)
        self._next_collection = 0.0
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.tick_interval_s = tick_interval_s
        self.start_timeout_s = start_timeout_s
        self._scheduled_at: dict[str, float] = {}  # job id -> when it was placed (this process)
        self.clock = clock
        #: what agents' silence is measured on (``LiveWorker.heard``): it never steps
        self.monotonic = monotonic
        #: STRATA_CHECK_STATE=1 (the test suite sets it): every tick checks the state's indexes
        #: against a scan (``ClusterState.check``), and a mismatch stops the control loop
        #: rather than being logged and passed
        self._check_state = os.environ.get("STRATA_CHECK_STATE") == "1"
        #: per waiting job, the room version and demands it last failed to fit at: it is not
        #: tried again until one of them moves (``_try_schedule``)
        self._tried: dict[str, tuple[Any, ...]] = {}
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
        #: (``service.CallProbe``): added to the timeout too (``tick``)
        self.call_wait = CallWait()
        self._delay_noted = False
        #: client request id -> the job its SubmitJob created (a retried submit returns it)
        self._by_request: dict[str, str] = store.request_ids()
        #: task kind -> bytes it was measured to need (``strata.measured``)
        self.measured: dict[str, int] = store.load_measured()
        #: every job (the live ones loaded, finished ones when first looked up), every agent,
        #: and the indexes derived from them (``coordinator.state``). Agents known from before
        #: a restart get their retry backoff on top of the heartbeat timeout to register again
        #: before they count as lost.
        self.state = ClusterState(
            JobTable(store), Agents(store.load_workers(), monotonic() + REREGISTER_GRACE_S))
        self.jobs = self.state.jobs
        self.agents = self.state.agents
        self.workers = self.agents.workers
        self._signals: dict[str, asyncio.Event] = {}
        self._wake = asyncio.Event()
        self._metrics_saved: dict[str, float] = {}
        self._stops_sent: dict[tuple[str, str, str, int], float] = {}
        self._implausible_said: dict[str, float] = {}
        #: job id -> outputs refused so far (``output_refused``: a few become events)
        self._refusals_said: dict[str, int] = {}
        #: job id -> the notes its tasks sent that are events already
        self._notes_said: dict[str, set[str]] = {}
        self._disk_full_said = 0.0
        self._stopping = False
        #: job id -> its memory probe's job id (``memory.profile``), while the job waits for it.
        #: Not persisted: after a coordinator restart a waiting job runs on its estimates.
        self._probe_of: dict[str, str] = {}
        #: job id -> (role, index, budget) of the task whose out-of-memory failure restarts it:
        #: the re-plan must give that task more (in memory: after a coordinator restart the
        #: measured need, which is stored, raises the plan anyway)
        self._oom_budget: dict[str, tuple[str, int, int]] = {}
        #: per task kind (``strata.measured``), the largest single allocation a task reported
        #: (its all-reduce pack): a budget made from a probe keeps room for it. In memory only:
        #: a job planned after a restart of the coordinator has its estimators' room
        self.largest_alloc: dict[str, int] = {}

    # --- notifications ------------------------------------------------------------------------

    def _notify(self, job_id: str) -> None:
        """Wakes the job's watchers (state, task or progress changes)."""
        ev = self._signals.pop(job_id, None)
        if ev is not None:
            ev.set()

    def _signal(self, job_id: str) -> asyncio.Event:
        ev = self._signals.get(job_id)
        if ev is None:
            ev = self._signals[job_id] = asyncio.Event()
        return ev

    def wake(self) -> None:
        self._wake.set()

    def _event(self, job: Job, kind: str, message: str) -> None:
        """An event of the job: what it says, for its watchers. With the disk full it is
        logged and not kept: a state change that was written stands without its event."""
        try:
            self.store.add_event(job.id, self.clock(), kind, message)
        except DiskFull as e:
            log.error("job %s: event not kept (%s): %s", job.id, e, message)
        log.info("job %s: %s", job.id, message)
        self._notify(job.id)

    # --- lifecycle ----------------------------------------------------------------------------

    def _set_job_state(self, job: Job, target: JobState, message: str) -> None:
        if not can_transition(job.state, target):
            raise InvalidTransition("job", job.state.value, target.value)
        before = (job.state, job.message, job.finished_at)
        job.state = target
        job.message = message
        if target.final:
            job.finished_at = self.clock()
        try:
            self.store.put_job(job)
        except BaseException:  # not written (a full disk): not changed
            job.state, job.message, job.finished_at = before
            raise
        if target.final:
            self.state.job_ended(job)
        self._event(job, "state", f"{target.value}: {message}" if message else target.value)
        if target == JobState.SUCCEEDED and not job.recovery.probe_of:  # a probe keeps no files
            self._write_metrics(job)
        if target.final:
            self.wake()  # its reservations are free once its processes are gone

    def _write_metrics(self, job: Job) -> None:
        """``metrics.json`` among the job's outputs: its final figures, for ``strata
        download`` (the model comes from the agent that ran the lead task)."""
        m = job.metrics
        def num(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        body = {"job_id": job.id, "name": job.name, "strategy": job.strategy,
                "state": job.state.value, "steps": m.step, "loss": num(m.loss),
                "test_loss": num(m.test_loss), "test_accuracy": num(m.test_accuracy),
                "examples_per_sec": m.examples_per_sec, "finished_at": job.finished_at,
                "tasks": [{"task": f"{t.role}:{t.index}", "worker": t.worker,
                           "memory_budget_bytes": t.memory_budget_bytes,
                           "peak_memory_bytes": t.peak_memory_bytes,
                           "weights_sha256": t.weights_sha256} for t in job.tasks]}
        try:
            self.blobs.write_output(job.id, "metrics.json",
                                    (json.dumps(body, indent=1) + "\n").encode(), job.owner)
        except OSError as e:
            log.warning("cannot write metrics.json of %s: %s", job.id, e)

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
        spec, plan = prepared.spec, prepared.plan
        self._check_limits(spec, len(plan.tasks), owner)
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

    def _start_probe(self, job: Job, probe: Job | JobPlan, budget: int) -> None:
        """Has ``job`` wait for its probe run (``memory.profile``): ``probe``, or a new one of
        this plan with each task's budget at most ``budget`` (0: the plan's own)."""
        assert job.spec is not None
        if isinstance(probe, JobPlan):
            probe = self._add_job(probe_spec(job.spec), probe_plan(probe, budget),
                                  note=f"memory probe of job {job.spec.name!r}",
                                  owner=job.owner, probe_of=job.id)
        probing = probe.spec
        assert probing is not None
        probe.recovery.probe_of = job.id
        self.store.put_job(probe)
        self._probe_of[job.id] = probe.id
        job.message = f"waiting for its memory probe {probe.id}"
        self.store.put_job(job)
        at = (f" with {format_size(budget)} per task (it grows if that runs out)" if budget
              else "")
        self._event(job, "message", f"memory.profile: probe job {probe.id} runs "
                                    f"{probing.training.steps} steps of this plan{at} to measure "
                                    "each task's peak; the job is planned with those figures")

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

    def _add_job(self, spec: JobSpec, plan: JobPlan, note: str = "",
                 request_id: str = "", owner: str = "", probe_of: str = "",
                 deadline: float = 0.0) -> Job:
        now = self.clock()
        job_id = f"{spec.name}-{secrets.token_hex(3)}"
        while job_id in self.jobs:
            job_id = f"{spec.name}-{secrets.token_hex(3)}"
        job = Job(id=job_id, name=spec.name, state=JobState.PENDING, strategy=spec.strategy,
                  spec=spec, created_at=now, estimated_memory_bytes=plan.largest_estimate,
                  message="waiting for workers")
        job.recovery.request_id = request_id
        job.recovery.probe_of = probe_of
        job.recovery.capacity_deadline = deadline
        job.owner = owner
        job.tasks = _tasks_of(job_id, plan)
        self.store.put_job(job)
        self.store.put_tasks(job.tasks)
        self.blobs.attach(job_id, owner, job_blobs(spec))
        self.state.add_job(job)  # only once stored: a failed write leaves no phantom job
        if request_id:
            self._by_request[request_id] = job_id
        what = strategies.get(spec.strategy).describe_plan(spec, plan)
        self._event(job, "state", f"PENDING: submitted{'; ' + note if note else ''}; {what}")
        low = [t for t in plan.tasks if t.memory_budget_bytes < t.estimated_memory_bytes]
        if spec.memory.per_task_budget and low:
            self._event(job, "message", f"warning: memory.per_task_budget "
                                        f"{format_size(low[0].memory_budget_bytes)} is below the "
                                        f"estimate "
                                        f"{format_size(max(t.estimated_memory_bytes for t in low))}"
                                        f" of {len(low)} task(s); they may run out of memory")
        self.wake()
        return job

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

    def _stop_job(self, job: Job, target: JobState, message: str) -> None:
        """Moves the job to a final state and tells agents to stop its remaining processes.

        Tasks never started are cancelled at once; running ones stay reserved until their agent
        reports the process gone (or the agent is lost), so budgets are never double-booked.
        """
        self._set_job_state(job, target, message)
        self._stop_tasks(job, message)

    def _stop_tasks(self, job: Job, message: str) -> None:
        """Tells the agents to stop the job's remaining processes (see ``_stop_job``)."""
        by_worker: set[str] = set()
        for t in job.tasks:
            if t.state.final:
                continue
            w = self.agents.get(t.worker) if t.worker else None
            if w is not None and not w.lost:
                by_worker.add(t.worker)  # also for a start that may still be in flight
            if w is None or t.state == TaskState.PENDING:
                # Never reported started: nothing to wait for. Should the start still arrive,
                # the agent reports the task running and heartbeats send the stop again.
                self.state.set_task_state(t, TaskState.CANCELLED)
                t.message = t.message or message
            elif w.lost:
                self.state.set_task_state(t, TaskState.FAILED)
                t.failure = FailureKind.LOST
        self.store.put_tasks(job.tasks)
        for name in by_worker:
            self.agents.send(name, StopTaskCommand(job_id=job.id, reason=message))
        self._notify(job.id)

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

    def drain(self, name: str) -> WorkerInfo:
        """``strata drain``: no new placements on the worker; every running job with a task
        there restarts elsewhere from its latest checkpoint (not counted against
        ``restart.max_restarts``: nothing failed). The worker stays DRAINING until it
        registers again without asking to drain."""
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
                self._restart(job, f"worker {name} is draining", failure=False)
        self.wake()
        return self.list_workers([name])[0]

    def commands(self, name: str, session: str) -> AsyncIterator[AgentCommand]:
        return self.agents.commands(name, session)

    def _task(self, job_id: str, role: str, index: int) -> Task | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        return next((t for t in job.tasks if t.role == role and t.index == index), None)

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
            job_or_none = self.jobs.get(r.job_id)
            task_or_none = None if job_or_none is None else next(
                (t for t in job_or_none.tasks if t.role == r.role and t.index == r.index), None)
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

    def _move_task(self, job: Job, task: Task, r: TaskReport,
                   fx: decisions.ReportEffects) -> None:
        """A report's move of its task: a failure goes to the failure policy; a change is
        written before it is made, then the job decides on it."""
        if fx.move == decisions.FAIL_OOM:
            self._fail_oom(job, task, r)
        elif fx.move == decisions.FAIL:
            self._fail_task(job, task, fx.failure, fx.message, exit_code=fx.exit_code)
        elif fx.move == decisions.CHANGE:
            # the task's account of an out-of-memory failure it caused is kept
            message = task.message if task.failure == FailureKind.OOM else fx.message
            # written before it is changed (``_fail_task``)
            self.store.put_tasks([dataclasses.replace(
                task, state=fx.state, exit_code=fx.exit_code, message=message)])
            self.state.set_task_state(task, fx.state)
            task.exit_code, task.message = fx.exit_code, message
            if task.state.final and task.failure != FailureKind.OOM:
                # (the peak of a task that ran out is short of its need: ``_fail_oom`` kept
                # the bound)
                self._remember_peak(job, task)
            self.store.put_tasks([task])
            self._after_task_change(job, task)

    def _remember_peak(self, job: Job, task: Task, needed: int = 0) -> None:
        """Keeps what a task of this kind was seen to need (``strata.measured``): its peak, or
        for an out-of-memory failure (``needed``) the lower bound on its need, kept apart
        (``strata.measured.bound_of``): a plan is raised to a bound but never lowered to it."""
        need = max(needed, task.peak_memory_bytes)
        if job.spec is None or need <= 0:
            return
        kind = task_kind(job.spec, task.role, task.index, task.first_layer, task.last_layer)
        if needed:
            kind = bound_of(kind)
        if need > self.measured.get(kind, 0):
            self.measured[kind] = need
            self.store.put_measured(kind, need, job.id, self.clock())

    def _fail_oom(self, job: Job, reporter: Task, r: TaskReport) -> None:
        """An out-of-memory failure, blamed on the task whose device ran out (in pipeline and
        parameter-server jobs the driver runs ops on other tasks, and the error reaches it),
        described with that task's budget, peak and the allocation that failed, and what would
        fit; the task's need is kept for the next plan of this job."""
        strategy = strategies.get(job.strategy)
        culprit = reporter
        if r.oom is not None and r.oom.task:
            role, _, index = r.oom.task.partition(":")
            found = self._task(job.id, role, int(index)) if index.isdigit() else None
            if found is not None:
                culprit = found
        name = f"{culprit.role}:{culprit.index}"
        reporter_name = f"{reporter.role}:{reporter.index}"
        text = describe_oom(name, strategy.where(job, culprit), culprit.memory_budget_bytes,
                            culprit.estimated_memory_bytes, culprit.peak_memory_bytes, r.oom,
                            strategy.oom_levers(job, culprit), reporter=reporter_name)
        alloc = r.oom.allocation_bytes if r.oom is not None else 0
        # what it learns is never more than the device it ran on: an agent's report is no
        # more to be believed than its device (and the need is kept for every job like it)
        where = self.agents.get(culprit.worker)
        device = where.record.budget_bytes if where is not None else 0
        need = needed_bytes(culprit.memory_budget_bytes, culprit.peak_memory_bytes, alloc)
        self._remember_peak(job, culprit, min(need, device) if device else need)
        if culprit is not reporter:
            culprit.failure = FailureKind.OOM
            culprit.message = text
            self.store.put_tasks([culprit])
            text_for_reporter = f"an op it ran on {name} failed there: {text}"
        else:
            text_for_reporter = text
        self._fail_task(job, reporter, FailureKind.OOM, text_for_reporter,
                        exit_code=r.exit_code, culprit=culprit)

    def _fail_task(self, job: Job, task: Task, failure: FailureKind, message: str,
                   exit_code: int = 0, culprit: Task | None = None) -> None:
        """``task`` failed. ``culprit``: for an out-of-memory failure, the task whose device
        ran out (another one's, when a driver ran ops there): the one a re-plan must give
        more."""
        # written before it is changed: a full disk leaves the task as it was, for the
        # agent's report to be tried again
        self.store.put_tasks([dataclasses.replace(task, state=TaskState.FAILED, failure=failure,
                                                  exit_code=exit_code, message=message)])
        self.state.set_task_state(task, TaskState.FAILED)
        task.failure = failure
        task.exit_code = exit_code
        task.message = message
        self.store.put_tasks([task])
        self._event(job, "task", f"task {task.role}:{task.index} on {task.worker} failed "
                                 f"({failure.value}): {describe_failure(task)}")
        if job.state not in (JobState.SCHEDULED, JobState.RUNNING):
            return  # ended, or restarting: a casualty of the stop, not a new failure
        # the policy judges the process that died: a driver that failed on another task's
        # device is still a dead driver (``_fail_oom`` names where memory ran out)
        decision = strategies.get(job.strategy).on_failure(job, task)
        if decision.action == FailureAction.CONTINUE:
            self._event(job, "message", decision.message)
            return
        oom = (culprit or task) if failure == FailureKind.OOM else None
        if oom is not None and self._memory_retry(job, oom, decision.message):
            return  # the first OOM of a budget Strata chose: its restart is not counted
        if decision.action == FailureAction.RESTART:
            self._restart(job, decision.message, failure=True, oom=oom)
            return
        self._stop_job(job, JobState.FAILED, decision.message)

    def _memory_retry(self, job: Job, task: Task, why: str) -> bool:
        """A task that ran out of a budget Strata chose (from its estimate or its probe's
        peak, no ``memory.per_task_budget``) does not fail its job the first time: the budget
        was Strata's guess, and a run can outgrow its probe (``bench/peak_growth.py``: an
        LSTM's peak at 1.36 x its probe's). The job restarts once, from its last checkpoint,
        planned on what the task was seen to need (``_fail_oom`` kept it), not counted
        against ``restart.max_restarts``. A probe is not retried: its growth is
        ``_grow_probe``'s."""
        assert job.spec is not None
        rec = job.recovery
        if job.spec.memory.per_task_budget or rec.memory_retried or rec.probe_of:
            return False
        where = self.agents.get(task.worker)
        if where is not None and task.memory_budget_bytes >= where.record.budget_bytes:
            return False  # it had the whole device: no plan gives it more
        rec.memory_retried = True
        self._restart(job, f"{why}; the budget was Strata's estimate, so the job restarts once "
                           "with what the task was seen to need", failure=False, oom=task)
        return True

    def _restart(self, job: Job, cause: str, *, failure: bool, oom: Task | None = None) -> None:
        """RESTARTING: the job's remaining tasks are stopped; once they are gone and
        ``restart.backoff_s`` has passed, the tick plans the job again on the workers there are
        and places it (``_resume``); its tasks resume from the latest checkpoint."""
        assert job.spec is not None
        rec = job.recovery
        job.restarts += 1
        if failure:
            rec.failures += 1
        if not rec.requested_workers:
            rec.requested_workers = job.spec.workers
        rec.restart_at = self.clock() + job.spec.restart_backoff_s
        rec.step_at_failure = max(rec.step_at_failure, job.metrics.step)
        rec.last_cause = cause
        rec.replanned = False
        self._oom_budget.pop(job.id, None)
        if oom is not None:
            # out of memory is not retried on the same plan: the re-plan must give it more
            self._oom_budget[job.id] = (oom.role, oom.index, oom.memory_budget_bytes)
        left = (f"{rec.failures} of {job.spec.max_restarts}" if failure
                else "not counted against restart.max_restarts")
        self._set_job_state(job, JobState.RESTARTING,
                            f"restart {job.restarts} ({left}) in "
                            f"{job.spec.restart_backoff_s:g} s: {cause}")
        self._event(job, "restart", f"restart {job.restarts}: {cause}; resumes from "
                    + (f"the checkpoint at step {job.checkpoint_step}" if job.checkpoint_step
                       else "the start (no checkpoint yet)"))
        self._stop_tasks(job, f"its job restarts: {cause}")

    def _resume(self, job: Job) -> None:
        """A RESTARTING job whose tasks are gone and whose backoff has passed: planned again
        on the workers available now (narrower when fewer are left: ``Strategy.narrow``), then
        placed like a pending job. A plan that no longer fits fails the job with the reason."""
        assert job.spec is not None
        rec = job.recovery
        offers = self.worker_offers(False, Needs.of(job.spec))
        strategy = strategies.get(job.strategy)
        wanted = dataclasses.replace(job.spec, workers=rec.requested_workers or job.spec.workers)
        spec = strategy.narrow(wanted, len(offers)) if offers else wanted
        try:
            plan = prepare(spec, offers, self.measured, largest=self.largest_alloc).plan
        except SpecError as e:
            self._stop_job(job, JobState.FAILED, f"cannot restart: {e}")
            return
        oom = self._oom_budget.pop(job.id, None)
        if not plan.feasible:
            self._stop_job(job, JobState.FAILED, f"cannot restart on this cluster: {plan.reason}"
                           + (f" (after {rec.last_cause})" if oom else ""))
            return
        if oom is not None:
            role, index, old = oom
            new = next((t.memory_budget_bytes for t in plan.tasks
                        if (t.role, t.index) == (role, index)), 0)
            if new and new <= old:
                self._stop_job(job, JobState.FAILED, (
                    f"{rec.last_cause}; not restarted: a new plan gives {role}:{index} the same "
                    f"{format_size(old)} (memory.per_task_budget fixes it); it needs more"))
                return
        if spec.workers != job.spec.workers:
            self._event(job, "message", f"restart {job.restarts}: {spec.workers} of "
                                        f"{wanted.workers} workers available; the job runs "
                                        f"{spec.workers} wide, global batch "
                                        f"{spec.data.batch_size} kept")
        attempt = max((t.attempt for t in job.tasks), default=0)
        job.spec = spec
        job.tasks = _tasks_of(job.id, plan, attempt)
        job.estimated_memory_bytes = plan.largest_estimate
        rec.replanned = True
        job.message = f"restart {job.restarts}: waiting for workers"
        self.store.replace_tasks(job.id, job.tasks)
        self.store.put_job(job)

    def _after_task_change(self, job: Job, task: Task) -> None:
        self._event(job, "task", f"task {task.role}:{task.index} on {task.worker}: {task.state.value}")
        step = decisions.on_task_change(job, task, strategies.get(job.strategy))
        if step.cancelled:
            task.failure = FailureKind.CANCELLED
            self.store.put_tasks([task])
        if step.action == decisions.WAKE:
            self.wake()
        elif step.action == decisions.RESTART:
            self._restart(job, step.message, failure=True)
        elif step.action == decisions.FAIL_JOB:
            self._stop_job(job, JobState.FAILED, step.message)
        elif step.action == decisions.SUCCEED_AND_STOP:
            self._stop_job(job, JobState.SUCCEEDED, step.message)
        elif step.action == decisions.SUCCEED:
            self._set_job_state(job, JobState.SUCCEEDED, step.message)
        elif step.action == decisions.RUN:
            self._set_job_state(job, JobState.RUNNING, step.message)

    # --- control loop -------------------------------------------------------------------------

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

    def _schedule(self, now: float) -> None:
        # a copy: scheduling a job may end another (a failed probe fails its job)
        for job in list(self.state.ordered()):
            if job.state not in decisions.TICK_STATES:
                continue
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

    def _after_probe(self, job: Job) -> bool:
        """Whether ``job`` may be scheduled: its memory probe has ended and the job's tasks now
        carry what the probe measured (estimates set to the measured peaks after a probe that
        succeeded; raised to what a probe that ran out of memory needed). A probe that failed
        otherwise fails the job with its reason: the job would fail the same way."""
        probe = self.jobs.get(self._probe_of[job.id])
        if probe is not None and not probe.state.final:
            return False
        if probe is not None and any(not t.state.final for t in probe.tasks) \
                and self.clock() - probe.finished_at < PROBE_SETTLE_S:
            return False  # its server tasks are being stopped: their last peaks come with that
        del self._probe_of[job.id]
        if probe is None or probe.state == JobState.CANCELLED:
            self._event(job, "message", "memory probe did not finish; planned on the estimates")
            return True
        oom = any(t.failure == FailureKind.OOM for t in probe.tasks)
        if probe.state == JobState.FAILED and oom and self._grow_probe(job, probe):
            return False
        if probe.state == JobState.FAILED and not oom:
            self._stop_job(job, JobState.FAILED, f"its memory probe {probe.id} failed: "
                                                 f"{probe.message}")
            return False
        assert job.spec is not None
        try:
            # on the event loop, once per probed job: the stage planner takes tens of ms, up
            # to ~0.7 s on its stress case (bench/planner_speed.py), under a heartbeat timeout
            plan = prepare(job.spec, self.worker_offers(free=False), self.measured,
                           probed=probe.state == JobState.SUCCEEDED,
                           largest=self.largest_alloc).plan
        except SpecError as e:
            self._stop_job(job, JobState.FAILED, f"after its memory probe: {e}")
            return False
        if not plan.feasible:
            self._stop_job(job, JobState.FAILED, f"after its memory probe {probe.id}: "
                                                 f"{plan.reason}")
            return False
        new = {(t.role, t.index): t for t in plan.tasks}
        if set(new) != {(t.role, t.index) for t in job.tasks} or any(
                (new[(t.role, t.index)].first_layer, new[(t.role, t.index)].last_layer)
                != (t.first_layer, t.last_layer) for t in job.tasks):
            # the workers changed since submission and the planner would now split it
            # otherwise: the probe measured another layout, so keep the planned estimates
            self._event(job, "message", "the plan changed during the memory probe; planned "
                                        "on the estimates")
            return True
        changes = []
        for t in job.tasks:
            p = new[(t.role, t.index)]
            if p.estimated_memory_bytes != t.estimated_memory_bytes:
                changes.append(f"{t.role}:{t.index} {format_size(t.estimated_memory_bytes)} -> "
                               f"{format_size(p.estimated_memory_bytes)} (budget "
                               f"{format_size(p.memory_budget_bytes)})")
            t.estimated_memory_bytes = p.estimated_memory_bytes
            t.memory_budget_bytes = p.memory_budget_bytes
        job.estimated_memory_bytes = plan.largest_estimate
        job.message = "waiting for workers"
        self.store.put_tasks(job.tasks)
        self.store.put_job(job)
        self._event(job, "message", f"memory probe {probe.id} {probe.state.value}; estimates "
                                    + ("set to its measured peaks: " + ", ".join(changes)
                                       + ("" if job.spec.memory.per_task_budget else
                                          " (budgets: each peak plus 25%, at least 16 MiB, or "
                                          "room for the task's largest allocation)")
                                       if changes else "kept"))
        return True

    def _needed(self, job: Job) -> int:
        """The most any of ``job``'s task kinds was seen to need: a peak or an out-of-memory
        bound (``strata.measured``)."""
        assert job.spec is not None
        kinds = [task_kind(job.spec, t.role, t.index, t.first_layer, t.last_layer)
                 for t in job.tasks]
        return max((max(self.measured.get(k, 0), self.measured.get(bound_of(k), 0))
                    for k in kinds), default=0)

    def _grow_probe(self, job: Job, probe: Job) -> bool:
        """After ``probe`` ran out of memory under a first budget smaller than the job's plan
        (``first_probe_budget``): a new probe with more, at least ``PROBE_GROWTH`` times as
        much and half again what the failed one was seen to need, up to the plan's budget.
        False when the probe already had the plan's budget: the job is planned on what it
        needed (``_after_probe``)."""
        had = max((t.memory_budget_bytes for t in probe.tasks), default=0)
        cap = min((t.memory_budget_bytes for t in job.tasks), default=0)
        if not had or had >= cap:
            return False
        needed = self._needed(job)
        budget = min(cap, max(had * PROBE_GROWTH, needed * 3 // 2))
        plan = JobPlan(job.strategy, True, "", tuple(
            TaskPlan(t.role, t.index, t.estimated_memory_bytes, t.memory_budget_bytes,
                     stage=t.stage, replica=t.replica, first_layer=t.first_layer,
                     last_layer=t.last_layer) for t in job.tasks))
        self._event(job, "message", f"memory probe {probe.id} ran out of memory at "
                                    f"{format_size(had)} per task (it needed at least "
                                    f"{format_size(needed)}); probing again at "
                                    f"{format_size(budget)}")
        self._start_probe(job, plan, budget)
        return True

    def _mark_lost(self, w: LiveWorker, why: str = "") -> None:
        why = why or f"no heartbeat for {self.heartbeat_timeout_s:g} s"
        log.warning("worker %s lost: %s", w.name, why)
        self.state.agent_lost(w)
        for job, t in decisions.lost_with(self.state.live.values(), w.name):
            self._fail_task(job, t, FailureKind.LOST, f"worker {w.name} lost ({why})")

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

    def _try_schedule(self, job: Job) -> None:
        assert job.spec is not None
        # Nothing that could make room has happened since this job last failed to fit, and
        # its demands are the same: it would fail again (placement is deterministic, and other
        # placements only take room). Waiting jobs cost a tick nothing until something moves.
        key = (self.state.room_version, tuple(t.memory_budget_bytes for t in job.tasks))
        if self._tried.get(job.id) == key:
            return
        needs = self._needs.get(job.id)
        if needs is None:
            needs = self._needs[job.id] = Needs.of(job.spec)
        # a job with the same needs and demands already failed this tick, on the same room
        placement = self._tick_failed.get((needs, key[1])) if self._tick_fresh() else None
        if placement is None:
            demands = [TaskDemand(t.role, t.index, t.memory_budget_bytes) for t in job.tasks]
            placement = self._place(demands, needs)
        if not placement.assignments:
            self._tried[job.id] = key
            if self._tick_cache is not None:
                self._tick_failed[(needs, key[1])] = placement
            if job.message != placement.reason:
                # Only a new kind of reason is stored and becomes an event: counts in it ("3 of
                # 980 workers") change with every agent that comes or goes, and a write and an
                # event per waiting job per registration stalled the loop with many waiting.
                news = _shape(job.message) != _shape(placement.reason)
                job.message = placement.reason
                if news:
                    self.store.put_job(job)
                    self._event(job, "message", placement.reason)
            return
        cluster: dict[str, list[str]] = {}
        for t in sorted(job.tasks, key=lambda t: (t.role, t.index)):
            self.state.place_task(t, self.workers[placement.assignments[(t.role, t.index)]])
            cluster.setdefault(t.role, []).append(t.address)
        self.store.put_tasks(job.tasks)
        if self._tick_cache is not None:  # room was taken: what failed may fail differently
            self._tick_cache.clear()
            self._tick_failed.clear()
        self._scheduled_at[job.id] = self.clock()
        self._set_job_state(job, JobState.SCHEDULED, "placed on " + ", ".join(
            f"{t.role}:{t.index}->{t.worker}" for t in job.tasks))
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
