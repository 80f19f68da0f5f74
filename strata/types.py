"""Domain types shared by the coordinator, the agent, the client and the CLI.

Plain dataclasses and enums; protobuf messages appear only at the service edge
(``strata.convert``). The ``to_json`` functions produce the contract's ``--json`` shapes.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import TYPE_CHECKING, Any, NamedTuple

from strata.units import format_size

if TYPE_CHECKING:
    from strata.jobspec import JobSpec

#: the job spec's ``data.source`` values (``strata.jobspec``); the estimators size them
DATA_SOURCES = ("digits", "synthetic", "npz", "tfrecord", "csv", "images")
#: read from files as a stream (tf.data), sharded per worker; never loaded whole
STREAMED_SOURCES = ("tfrecord", "csv", "images")


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
    """One failed allocation. ``task`` is ``role:index`` of the task whose device it was on
    (empty when the message names no cluster device); ``op`` the graph node, when named."""

    task: str = ""
    allocation_bytes: int = 0
    shape: tuple[int, ...] = ()
    dtype: str = ""
    op: str = ""

    @property
    def allocation(self) -> str:
        """e.g. ``9 MiB (float32 [1536, 1536] in adam/Sub_10)``; empty when unknown."""
        if not self.allocation_bytes and not self.shape:
            return ""
        what = f"{self.dtype} [{', '.join(str(d) for d in self.shape)}]" if self.dtype else ""
        if self.op:
            what = f"{what} in {self.op}" if what else f"in {self.op}"
        return format_size(self.allocation_bytes) + (f" ({what})" if what else "")


class JobState(str, enum.Enum):
    """PENDING: accepted, waiting for workers with enough free budget. SCHEDULED: placed, budgets
    reserved, agents starting the processes. RUNNING: every task process runs. The rest are final."""

    PENDING = "PENDING"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    #: a task failed and the restart policy restarts the job: its other tasks are stopped,
    #: then (after ``restart.backoff_s``) it is placed again and resumes from its checkpoint
    RESTARTING = "RESTARTING"

    @property
    def final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class TaskState(str, enum.Enum):
    PENDING = "PENDING"      # assigned, the agent has not started it yet
    STARTING = "STARTING"    # process launched, joining its cluster
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def final(self) -> bool:
        return self in (TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED)


class FailureKind(str, enum.Enum):
    NONE = "NONE"
    EXIT_CODE = "EXIT_CODE"
    OOM = "OOM"
    SIGNAL = "SIGNAL"
    LAUNCH = "LAUNCH"
    LOST = "LOST"
    BAD_CONFIG = "BAD_CONFIG"
    USER_CODE = "USER_CODE"
    COLLECTIVE_TIMEOUT = "COLLECTIVE_TIMEOUT"   # a collective or a peer's RPC timed out/aborted
    CANCELLED = "CANCELLED"                     # stopped on purpose: cancel, restart, drain


class WorkerState(str, enum.Enum):
    READY = "READY"
    BUSY = "BUSY"
    LOST = "LOST"
    DRAINING = "DRAINING"


# One table per lifecycle. Anything not listed is an illegal edge.
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.SCHEDULED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SCHEDULED: frozenset({JobState.RUNNING, JobState.SUCCEEDED, JobState.FAILED,
                                   JobState.CANCELLED, JobState.RESTARTING}),
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED,
                                 JobState.RESTARTING}),
    JobState.RESTARTING: frozenset({JobState.SCHEDULED, JobState.FAILED, JobState.CANCELLED}),
    JobState.SUCCEEDED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

TASK_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.PENDING: frozenset({TaskState.STARTING, TaskState.RUNNING, TaskState.SUCCEEDED,
                                  TaskState.FAILED, TaskState.CANCELLED}),
    TaskState.STARTING: frozenset({TaskState.RUNNING, TaskState.SUCCEEDED, TaskState.FAILED,
                                   TaskState.CANCELLED}),
    TaskState.RUNNING: frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED}),
    TaskState.SUCCEEDED: frozenset(),
    TaskState.FAILED: frozenset(),
    TaskState.CANCELLED: frozenset(),
}


def can_transition(current: enum.Enum, target: enum.Enum) -> bool:
    table: dict[Any, frozenset[Any]] = JOB_TRANSITIONS if isinstance(current, JobState) else TASK_TRANSITIONS
    return target in table[current]


@dataclasses.dataclass
class JobMetrics:
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    test_accuracy: float | None = None
    test_loss: float | None = None
    examples_per_sec: float = 0.0
    #: a compiled ``code.model``'s own metrics on the test split, by name
    test_metrics: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Task:
    """One task of a job as the coordinator knows it."""

    job_id: str
    role: str
    index: int
    worker: str = ""
    state: TaskState = TaskState.PENDING
    stage: int = 0
    memory_budget_bytes: int = 0
    estimated_memory_bytes: int = 0
    peak_memory_bytes: int = 0
    in_use_bytes: int = 0
    failure: FailureKind = FailureKind.NONE
    exit_code: int = 0
    message: str = ""
    address: str = ""
    weights_sha256: str = ""
    model_path: str = ""
    attempt: int = 0
    replica: int = 0
    first_layer: int = 0         # stage tasks: layers [first_layer, last_layer) of the profile
    last_layer: int = 0
    layers: list[str] = dataclasses.field(default_factory=list)
    replica_weights_sha256: list[str] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.job_id, self.role, self.index)


@dataclasses.dataclass
class JobRecovery:
    """The coordinator's own bookkeeping of a job's restarts (stored, not shown)."""

    #: the client's id of the ``SubmitJob`` that created the job (a retry returns this job)
    request_id: str = ""
    #: RESTARTING: when the restart may be placed (``restart.backoff_s`` after the failure)
    restart_at: float = 0.0
    #: the data-parallel width the user asked for; a restart on fewer workers runs narrower
    #: and the next restart widens it again when the workers are back (0: the spec's)
    requested_workers: int = 0
    #: the lead's last reported step when the job last failed: steps after its checkpoint are
    #: trained again (``Job.steps_repeated``)
    step_at_failure: int = 0
    #: the failure that caused the latest restart, for messages
    last_cause: str = ""
    #: restarts caused by failures (``restart.max_restarts`` bounds them; drains do not count)
    failures: int = 0
    #: RESTARTING: the job has been planned again and waits to be placed
    replanned: bool = False
    #: a memory probe (``memory.profile``): the id of the job it measures. Its tasks keep
    #: their figures and save no model, and it keeps no outputs
    probe_of: str = ""
    #: ``--queue-for-capacity``: when a job not placed yet fails (0: it waits as long as it
    #: must, on a cluster that has had the workers for it)
    capacity_deadline: float = 0.0
    #: a task ran out of a budget Strata chose and the job was restarted with its need, not
    #: counted against ``restart.max_restarts`` (once: ``decisions.may_retry_memory``)
    memory_retried: bool = False
    #: a notice (``strata drain --deadline``): the step after which every task saves a
    #: checkpoint and stops, and when the notice's worker leaves (0: no notice in flight)
    notice_step: int = 0
    notice_deadline: float = 0.0
    #: an elastic job's changes of width, in all; the width before the resize in flight (0:
    #: none) and when that resize began; when the last one ended (resizes settle between)
    resizes: int = 0
    resize_from: int = 0
    resize_began: float = 0.0
    resized_at: float = 0.0
    #: the width a job read back without its spec runs at (shown; the spec's ``workers``)
    workers_now: int = 0
    #: preempted (``coordinator.preemption``): the job it waits behind until placed again
    #: (empty: none), and its preemptions in all
    preempted_by: str = ""
    preemptions: int = 0
    #: seconds it trained in runs that ended (restarts, preemptions), and when its current
    #: run was placed (0: its first run, counted from its first step): a time limit counts
    #: training, not the time it spent stopped (``decisions.trained_for``)
    ran_s: float = 0.0
    run_began: float = 0.0


@dataclasses.dataclass
class Job:
    id: str
    name: str
    state: JobState
    strategy: str
    spec: JobSpec | None          # None only in views that leave it out (lists, events)
    message: str = ""
    restarts: int = 0
    created_at: float = 0.0
    finished_at: float = 0.0
    started_at: float = 0.0
    estimated_memory_bytes: int = 0
    metrics: JobMetrics = dataclasses.field(default_factory=JobMetrics)
    tasks: list[Task] = dataclasses.field(default_factory=list)
    #: the coordinator's copy of the job's outputs, and their paths under it (read from the
    #: files when the job is reported, not stored)
    output_dir: str = ""
    outputs: list[str] = dataclasses.field(default_factory=list)
    #: the step of the latest checkpoint the lead task saved
    checkpoint_step: int = 0
    #: steps trained again after restarts (the steps between a job's last checkpoint and its
    #: failure), summed over its restarts
    steps_repeated: int = 0
    recovery: JobRecovery = dataclasses.field(default_factory=JobRecovery)
    #: the NAME of the token that submitted it (``strata.auth``; empty with auth off)
    owner: str = ""
    #: its TensorBoard logs (``tensorboard --logdir``): the shared directory while it runs,
    #: the coordinator's copy of its outputs once they are in (empty: not known)
    tensorboard_dir: str = ""
    #: what trains it (optimizer, loss, where each came from), as its lead task says
    training: str = ""
    #: while it waits, with queues: its place among the waiting jobs (1: next), and when its
    #: kept room is expected to free (epoch seconds; 0: not known). Not stored: each pass of
    #: the control loop sets them
    position: int = 0
    estimated_start: float = 0.0


@dataclasses.dataclass
class MemoryStatus:
    budget_bytes: int = 0
    reserved_bytes: int = 0
    in_use_bytes: int = 0
    peak_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class DiskStatus:
    """One place Strata writes: its own files' bytes there, and what the file system that
    holds them has left (for Strata's user) and holds in all."""

    used_bytes: int = 0
    free_bytes: int = 0
    total_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class CoordinatorDisk:
    """The coordinator's ``--state-dir``: its use by kind, and the room kept free."""

    disk: DiskStatus = DiskStatus()
    blobs_bytes: int = 0
    outputs_bytes: int = 0
    logs_bytes: int = 0
    reserve_bytes: int = 0


@dataclasses.dataclass
class WorkerTask:
    job_id: str
    role: str
    index: int
    state: TaskState
    memory_budget_bytes: int = 0
    in_use_bytes: int = 0
    peak_bytes: int = 0


@dataclasses.dataclass
class WorkerInfo:
    name: str
    address: str
    device: str
    state: WorkerState
    memory: MemoryStatus
    tasks: list[WorkerTask] = dataclasses.field(default_factory=list)
    last_seen: float = 0.0
    shared_dir: str = ""
    data_roots: list[str] = dataclasses.field(default_factory=list)
    disk: DiskStatus = DiskStatus()
    #: the CPU kernels its tasks run (``strata.cpukernels``; empty: a GPU, or not known)
    cpu_kernels: str = ""


@dataclasses.dataclass(frozen=True)
class WorkerOffer:
    """A worker as the job planner sees it: its name and the bytes it can give (its whole
    budget when admitting, its free budget when planning for now)."""

    name: str
    bytes: int
    #: the CPU kernels its tasks run (``strata.cpukernels``; empty: unknown, estimated as Eigen)
    kernels: str = ""


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """The blueprint of one task: what a strategy's plan says it runs and needs. ``Task`` is the
    live instance the coordinator tracks; the task process sees its share as a ``TaskConfig``."""

    role: str
    index: int
    estimated_memory_bytes: int
    memory_budget_bytes: int
    stage: int = 0
    replica: int = 0
    first_layer: int = 0          # layers [first_layer, last_layer) of the model's profile
    last_layer: int = 0
    layers: tuple[str, ...] = ()
    worker: str = ""              # the planner's choice (pipeline); placement decides at run time


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """A strategy's plan of a job: its tasks, and whether the workers offered could hold them."""

    strategy: str
    feasible: bool
    reason: str
    tasks: tuple[TaskPlan, ...]
    summary: str = ""

    @property
    def largest_estimate(self) -> int:
        return max((t.estimated_memory_bytes for t in self.tasks), default=0)


@dataclasses.dataclass
class Plan:
    """What ``strata plan`` shows: a job plan placed on the workers as they are now."""

    strategy: str
    feasible: bool
    reason: str
    tasks: list[TaskPlan] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class JobEvent:
    seq: int
    time: float
    kind: str
    message: str
    job: Job | None


# --- the contract's --json shapes -------------------------------------------------------------

def task_to_json(t: Task) -> dict[str, Any]:
    return {
        "role": t.role, "index": t.index, "worker": t.worker, "state": t.state.value,
        "stage": t.stage, "memory_budget_bytes": t.memory_budget_bytes,
        "peak_memory_bytes": t.peak_memory_bytes, "in_use_bytes": t.in_use_bytes,
        "estimated_memory_bytes": t.estimated_memory_bytes, "failure": t.failure.value,
        "exit_code": t.exit_code, "message": t.message, "address": t.address,
        "weights_sha256": t.weights_sha256, "model_path": t.model_path,
        "replica": t.replica, "layers": list(t.layers),
        "replica_weights_sha256": list(t.replica_weights_sha256),
    }


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def job_to_json(j: Job) -> dict[str, Any]:
    m = j.metrics
    return {
        "id": j.id, "name": j.name, "state": j.state.value, "strategy": j.strategy,
        "message": j.message, "restarts": j.restarts, "created_at": j.created_at,
        "finished_at": j.finished_at or None, "started_at": j.started_at or None,
        "estimated_memory_bytes": j.estimated_memory_bytes,
        "metrics": {"step": m.step, "total_steps": m.total_steps, "loss": _finite(m.loss),
                    "test_accuracy": _finite(m.test_accuracy), "test_loss": _finite(m.test_loss),
                    "examples_per_sec": m.examples_per_sec,
                    "test_metrics": {k: _finite(v) for k, v in m.test_metrics.items()}},
        "tasks": [task_to_json(t) for t in j.tasks],
        "output_dir": j.output_dir or None, "outputs": list(j.outputs),
        "checkpoint_step": j.checkpoint_step, "steps_repeated": j.steps_repeated,
        "owner": j.owner, "tensorboard_dir": j.tensorboard_dir or None,
        "training": j.training or None, "probe_of": j.recovery.probe_of or None,
        "resizes": j.recovery.resizes, "workers_now": _width(j),
        "queue": (j.spec.queue or None) if j.spec is not None else None,
        "priority": (j.spec.priority or None) if j.spec is not None else None,
        "preemptions": j.recovery.preemptions,
        "position": (j.position or None) if j.state in _WAITING else None,
        "waiting_for": j.message if j.state in (JobState.PENDING, JobState.RESTARTING) else None,
        "estimated_start": (j.estimated_start or None) if j.state in _WAITING else None,
    }


_WAITING = frozenset({JobState.PENDING, JobState.RESTARTING})


def _width(j: Job) -> int | None:
    return j.spec.workers if j.spec is not None else (j.recovery.workers_now or None)


def worker_to_json(w: WorkerInfo) -> dict[str, Any]:
    return {
        "name": w.name, "address": w.address, "state": w.state.value, "device": w.device,
        "memory": dataclasses.asdict(w.memory),
        "tasks": [{"job_id": t.job_id, "role": t.role, "index": t.index, "state": t.state.value,
                   "memory_budget_bytes": t.memory_budget_bytes, "in_use_bytes": t.in_use_bytes,
                   "peak_bytes": t.peak_bytes} for t in w.tasks],
        "last_seen": w.last_seen, "shared_dir": w.shared_dir,
        "disk": dataclasses.asdict(w.disk), "cpu_kernels": w.cpu_kernels,
    }


def plan_to_json(p: Plan) -> dict[str, Any]:
    return {
        "strategy": p.strategy, "feasible": p.feasible, "reason": p.reason,
        "tasks": [{"role": t.role, "index": t.index, "worker": t.worker, "stage": t.stage,
                   "layers": list(t.layers), "estimated_memory_bytes": t.estimated_memory_bytes,
                   "memory_budget_bytes": t.memory_budget_bytes} for t in p.tasks],
    }


@dataclasses.dataclass
class TaskReport:
    """What an agent says about one of its task processes (progress, final state, memory)."""

    job_id: str
    role: str
    index: int
    state: TaskState
    attempt: int = 0
    failure: FailureKind = FailureKind.NONE
    exit_code: int = 0
    message: str = ""
    in_use_bytes: int = 0
    peak_bytes: int = 0
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    examples_per_sec: float = 0.0
    test_accuracy: float | None = None
    test_loss: float | None = None
    weights_sha256: str = ""
    model_path: str = ""
    first_step_time: float = 0.0
    replica_weights_sha256: list[str] = dataclasses.field(default_factory=list)
    oom: OutOfMemory | None = None
    checkpoint_step: int = 0     # the latest checkpoint the task saved
    resumed_step: int = 0        # the checkpoint it resumed from (0: started afresh)
    training: str = ""           # the optimizer and loss it trains with, and their source
    test_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # for the job's events, once
    largest_alloc_bytes: int = 0  # its largest single allocation (the all-reduce pack)

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.job_id, self.role, self.index)


class JobSummary(NamedTuple):
    """What the table knows of a job without loading it. (A named tuple: views over every
    job make one for each loaded job, and a frozen dataclass took three times as long,
    5.5 ms for 5,000.)"""

    id: str
    state: JobState
    created_at: float
    finished_at: float
    started_at: float
    restarts: int

    @classmethod
    def of(cls, job: Job) -> "JobSummary":
        return cls(job.id, job.state, job.created_at, job.finished_at, job.started_at,
                   job.restarts)
