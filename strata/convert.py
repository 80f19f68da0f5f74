"""Paired ``x_to_proto`` / ``x_from_proto`` functions: the only module that maps between domain
types and protobuf messages. Scheduler, store and planner never import ``*_pb2``."""

from __future__ import annotations

from typing import Any, Mapping

from google.protobuf import json_format
from google.protobuf.message import Message

from strata.protos import strata_pb2 as pb
from strata.spec import parse_job_spec
from strata.jobspec import JobSpec
from strata.errors import SpecError
from strata.taskconfig import (
    TASK_CONFIG_VERSION, AgentSettings, ParameterServerSection, PipelineSection,
    StageAssignment, TaskConfig, TaskConfigError,
)
from strata.types import OutOfMemory
from strata.types import (
    CoordinatorDisk, DiskStatus, FailureKind, Job, JobEvent, JobMetrics, JobRecovery, JobState,
    MemoryStatus, Plan, Task, TaskPlan, TaskReport, TaskState, WorkerInfo, WorkerState,
    WorkerTask,
)


# --- specs ------------------------------------------------------------------------------------

def message_to_dict(msg: Message) -> dict[str, Any]:
    """Only the fields that are set (optional scalars by presence), with native Python types.

    Unlike json_format.MessageToDict this keeps int64 as int, so the one validation path
    (``strata.spec.parse_job_spec``) sees the same types as from a YAML file.
    """
    out: dict[str, Any] = {}
    for field, value in msg.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vf = field.message_type.fields_by_name["value"]
            out[field.name] = {k: message_to_dict(v) if vf.message_type is not None else v
                               for k, v in value.items()}
        elif field.message_type is not None and not _is_repeated(field):
            out[field.name] = message_to_dict(value)
        elif _is_repeated(field):
            out[field.name] = [message_to_dict(v) if isinstance(v, Message) else v for v in value]
        else:
            out[field.name] = value
    return out


def _is_repeated(field: Any) -> bool:
    # protobuf 5+: field.is_repeated; older: label == LABEL_REPEATED.
    rep = getattr(field, "is_repeated", None)
    return bool(rep) if rep is not None else field.label == field.LABEL_REPEATED


def spec_to_proto(spec: JobSpec) -> pb.JobSpec:
    """A parsed spec to its message (every field set: the normalized spec)."""
    msg = pb.JobSpec()
    json_format.ParseDict(spec.to_dict(), msg)
    _mark_empty_lists(spec.to_dict(), msg)
    return msg


def raw_spec_to_proto(raw: Mapping[str, Any]) -> pb.JobSpec:
    """A spec mapping as a user wrote it, unvalidated (for tools and tests that must send what
    a client would refuse); unknown fields raise ``json_format.ParseError``."""
    msg = pb.JobSpec()
    json_format.ParseDict(dict(raw), msg)
    _mark_empty_lists(raw, msg)
    return msg


def _mark_empty_lists(raw: Mapping[str, Any], msg: pb.JobSpec) -> None:
    # an empty repeated field is indistinguishable from an unset one on the wire; the lists
    # whose emptiness means something carry a presence flag (BuiltinModel.no_hidden)
    model = raw.get("model")
    builtin = model.get("builtin") if isinstance(model, Mapping) else None
    if isinstance(builtin, Mapping) and builtin.get("hidden") == []:
        msg.model.builtin.no_hidden = True


def _spec_dict(msg: pb.JobSpec) -> dict[str, Any]:
    d = message_to_dict(msg)
    builtin = d.get("model", {}).get("builtin")
    if isinstance(builtin, dict) and builtin.pop("no_hidden", False):
        builtin.setdefault("hidden", [])
    return d


def accepted_spec_from_proto(msg: pb.JobSpec) -> JobSpec:
    """A spec the coordinator has accepted (in a ``Job``): decoded, not validated again."""
    return JobSpec.from_dict(_spec_dict(msg))


def spec_from_proto(msg: pb.JobSpec) -> JobSpec:
    """Parses a JobSpec message: the one validation path (``parse_job_spec``) over the fields
    that are set. Raises ``SpecError`` naming the field."""
    return parse_job_spec(_spec_dict(msg))


# --- jobs -------------------------------------------------------------------------------------

def _task_state_to_proto(s: TaskState) -> Any:
    return pb.TaskState.Value("TASK_" + s.value)


def _task_state_from_proto(v: int) -> TaskState:
    name = pb.TaskState.Name(v)
    return TaskState(name[len("TASK_"):]) if name != "TASK_STATE_UNSPECIFIED" else TaskState.PENDING


def _failure_to_proto(f: FailureKind) -> Any:
    return pb.FailureKind.Value("FAILURE_" + f.value)


def _failure_from_proto(v: int) -> FailureKind:
    return FailureKind(pb.FailureKind.Name(v)[len("FAILURE_"):])


def task_to_proto(t: Task) -> pb.TaskInfo:
    return pb.TaskInfo(
        role=t.role, index=t.index, worker=t.worker, state=_task_state_to_proto(t.state),
        stage=t.stage, memory_budget_bytes=t.memory_budget_bytes,
        peak_memory_bytes=t.peak_memory_bytes, in_use_bytes=t.in_use_bytes,
        estimated_memory_bytes=t.estimated_memory_bytes, failure=_failure_to_proto(t.failure),
        exit_code=t.exit_code, message=t.message, address=t.address,
        weights_sha256=t.weights_sha256, model_path=t.model_path, replica=t.replica,
        layers=t.layers, replica_weights_sha256=t.replica_weights_sha256,
    )


def task_from_proto(job_id: str, m: pb.TaskInfo) -> Task:
    return Task(
        job_id=job_id, role=m.role, index=m.index, worker=m.worker,
        state=_task_state_from_proto(m.state), stage=m.stage,
        memory_budget_bytes=m.memory_budget_bytes, estimated_memory_bytes=m.estimated_memory_bytes,
        peak_memory_bytes=m.peak_memory_bytes, in_use_bytes=m.in_use_bytes,
        failure=_failure_from_proto(m.failure), exit_code=m.exit_code, message=m.message,
        address=m.address, weights_sha256=m.weights_sha256, model_path=m.model_path,
        replica=m.replica, layers=list(m.layers),
        replica_weights_sha256=list(m.replica_weights_sha256),
    )


def job_to_proto(j: Job, with_spec: bool = True) -> pb.Job:
    m = j.metrics
    return pb.Job(
        id=j.id, name=j.name, state=pb.JobState.Value(j.state.value), strategy=j.strategy,
        message=j.message, restarts=j.restarts, created_at=j.created_at,
        finished_at=j.finished_at, started_at=j.started_at,
        estimated_memory_bytes=j.estimated_memory_bytes,
        metrics=pb.JobMetrics(
            step=m.step, total_steps=m.total_steps, loss=m.loss or 0.0,
            test_accuracy=m.test_accuracy or 0.0, test_loss=m.test_loss or 0.0,
            has_test_accuracy=m.test_accuracy is not None, examples_per_sec=m.examples_per_sec,
            test_metrics=m.test_metrics,
        ),
        tasks=[task_to_proto(t) for t in j.tasks],
        spec=spec_to_proto(j.spec) if j.spec is not None and with_spec else None,
        output_dir=j.output_dir, outputs=list(j.outputs), checkpoint_step=j.checkpoint_step,
        steps_repeated=j.steps_repeated, owner=j.owner, tensorboard_dir=j.tensorboard_dir,
        training=j.training, probe_of=j.recovery.probe_of,
    )


def job_from_proto(m: pb.Job) -> Job:
    mm = m.metrics
    return Job(
        id=m.id, name=m.name, state=JobState(pb.JobState.Name(m.state)), strategy=m.strategy,
        spec=accepted_spec_from_proto(m.spec) if m.HasField("spec") else None,
        message=m.message,
        restarts=m.restarts,
        created_at=m.created_at, finished_at=m.finished_at, started_at=m.started_at,
        estimated_memory_bytes=m.estimated_memory_bytes,
        metrics=JobMetrics(
            step=mm.step, total_steps=mm.total_steps,
            loss=mm.loss if mm.step else None,
            test_accuracy=mm.test_accuracy if mm.has_test_accuracy else None,
            test_loss=mm.test_loss if mm.has_test_accuracy else None,
            examples_per_sec=mm.examples_per_sec, test_metrics=dict(mm.test_metrics),
        ),
        tasks=[task_from_proto(m.id, t) for t in m.tasks],
        output_dir=m.output_dir, outputs=list(m.outputs), checkpoint_step=m.checkpoint_step,
        steps_repeated=m.steps_repeated, owner=m.owner, tensorboard_dir=m.tensorboard_dir,
        training=m.training, recovery=JobRecovery(probe_of=m.probe_of),
    )


def event_to_proto(e: JobEvent) -> pb.JobEvent:
    """Events carry the job without its spec: a watcher gets many, the spec never changes."""
    return pb.JobEvent(seq=e.seq, time=e.time, kind=e.kind, message=e.message,
                       job=job_to_proto(e.job, with_spec=False) if e.job else None)


def event_from_proto(m: pb.JobEvent) -> JobEvent:
    return JobEvent(seq=m.seq, time=m.time, kind=m.kind, message=m.message,
                    job=job_from_proto(m.job) if m.HasField("job") else None)


# --- workers ----------------------------------------------------------------------------------

def memory_to_proto(m: MemoryStatus) -> pb.MemoryStatus:
    return pb.MemoryStatus(budget_bytes=m.budget_bytes, reserved_bytes=m.reserved_bytes,
                           in_use_bytes=m.in_use_bytes, peak_bytes=m.peak_bytes)


def memory_from_proto(m: pb.MemoryStatus) -> MemoryStatus:
    return MemoryStatus(budget_bytes=m.budget_bytes, reserved_bytes=m.reserved_bytes,
                        in_use_bytes=m.in_use_bytes, peak_bytes=m.peak_bytes)


def disk_to_proto(d: DiskStatus) -> pb.DiskStatus:
    return pb.DiskStatus(used_bytes=d.used_bytes, free_bytes=d.free_bytes,
                         total_bytes=d.total_bytes)


def disk_from_proto(m: pb.DiskStatus) -> DiskStatus:
    return DiskStatus(used_bytes=max(0, m.used_bytes), free_bytes=max(0, m.free_bytes),
                      total_bytes=max(0, m.total_bytes))


def coordinator_disk_to_proto(d: CoordinatorDisk) -> pb.CoordinatorDisk:
    return pb.CoordinatorDisk(disk=disk_to_proto(d.disk), blobs_bytes=d.blobs_bytes,
                              outputs_bytes=d.outputs_bytes, logs_bytes=d.logs_bytes,
                              reserve_bytes=d.reserve_bytes)


def coordinator_disk_from_proto(m: pb.CoordinatorDisk) -> CoordinatorDisk:
    return CoordinatorDisk(disk=disk_from_proto(m.disk), blobs_bytes=m.blobs_bytes,
                           outputs_bytes=m.outputs_bytes, logs_bytes=m.logs_bytes,
                           reserve_bytes=m.reserve_bytes)


def worker_to_proto(w: WorkerInfo) -> pb.Worker:
    return pb.Worker(
        name=w.name, address=w.address, state=pb.WorkerState.Value(w.state.value), device=w.device,
        memory=memory_to_proto(w.memory), last_seen=w.last_seen, shared_dir=w.shared_dir,
        data_roots=w.data_roots, disk=disk_to_proto(w.disk), cpu_kernels=w.cpu_kernels,
        tasks=[pb.WorkerTask(job_id=t.job_id, role=t.role, index=t.index,
                             state=_task_state_to_proto(t.state),
                             memory_budget_bytes=t.memory_budget_bytes,
                             in_use_bytes=t.in_use_bytes, peak_bytes=t.peak_bytes) for t in w.tasks],
    )


def worker_from_proto(m: pb.Worker) -> WorkerInfo:
    return WorkerInfo(
        name=m.name, address=m.address, device=m.device, state=WorkerState(pb.WorkerState.Name(m.state)),
        memory=memory_from_proto(m.memory), last_seen=m.last_seen, shared_dir=m.shared_dir,
        data_roots=list(m.data_roots), disk=disk_from_proto(m.disk), cpu_kernels=m.cpu_kernels,
        tasks=[WorkerTask(job_id=t.job_id, role=t.role, index=t.index,
                          state=_task_state_from_proto(t.state),
                          memory_budget_bytes=t.memory_budget_bytes, in_use_bytes=t.in_use_bytes,
                          peak_bytes=t.peak_bytes) for t in m.tasks],
    )


# --- plans ------------------------------------------------------------------------------------

def plan_to_proto(p: Plan) -> pb.Plan:
    return pb.Plan(strategy=p.strategy, feasible=p.feasible, reason=p.reason, tasks=[
        pb.PlannedTask(role=t.role, index=t.index, worker=t.worker, stage=t.stage, layers=t.layers,
                       estimated_memory_bytes=t.estimated_memory_bytes,
                       memory_budget_bytes=t.memory_budget_bytes) for t in p.tasks])


def plan_from_proto(m: pb.Plan) -> Plan:
    return Plan(strategy=m.strategy, feasible=m.feasible, reason=m.reason, tasks=[
        TaskPlan(role=t.role, index=t.index, worker=t.worker, stage=t.stage,
                 layers=tuple(t.layers), estimated_memory_bytes=t.estimated_memory_bytes,
                 memory_budget_bytes=t.memory_budget_bytes) for t in m.tasks])


# --- the task contract ------------------------------------------------------------------------

def task_config_to_proto(c: TaskConfig) -> pb.TaskConfig:
    msg = pb.TaskConfig(
        version=c.version, job_id=c.job_id, role=c.role, index=c.index,
        spec=spec_to_proto(c.spec), memory_budget_bytes=c.memory_budget_bytes,
        report_interval_s=c.report_interval_s, restart=c.restart, probe=c.probe,
        agent=agent_settings_to_proto(c.agent))
    s = c.section
    if isinstance(s, ParameterServerSection):
        msg.ps_placement.CopyFrom(pb.ParameterServerConfig(
            placement=s.placement, ps_budgets_bytes=s.ps_budgets_bytes))
    elif isinstance(s, PipelineSection):
        msg.stage_layout.CopyFrom(pb.PipelineConfig(
            stages=s.stages, replicas=s.replicas, microbatches=s.microbatches,
            microbatch=s.microbatch, layout=[pb.StageAssignment(
                replica=a.replica, stage=a.stage, role=a.role, index=a.index,
                first_layer=a.first_layer, last_layer=a.last_layer, layers=a.layers,
                estimated_memory_bytes=a.estimated_memory_bytes,
                memory_budget_bytes=a.memory_budget_bytes) for a in s.layout]))
    return msg


def agent_settings_to_proto(a: AgentSettings) -> pb.AgentSettings:
    return pb.AgentSettings(output_dir=a.output_dir, threads=a.threads, device=a.device,
                            blob_dir=a.blob_dir, shared_dir=a.shared_dir,
                            data_roots=list(a.data_roots))


def with_agent_settings(m: pb.TaskConfig, a: AgentSettings) -> pb.TaskConfig:
    """The agent's one change to a contract: its own settings. Everything else of the
    coordinator's message passes through as it came (a copy, the original untouched)."""
    out = pb.TaskConfig()
    out.CopyFrom(m)
    out.agent.CopyFrom(agent_settings_to_proto(a))
    return out


def task_config_from_proto(m: pb.TaskConfig) -> TaskConfig:
    """Raises ``SpecError`` when the spec inside does not parse."""
    which = m.WhichOneof("strategy_config")
    section: ParameterServerSection | PipelineSection | None = None
    if which == "ps_placement":
        ps = m.ps_placement
        section = ParameterServerSection(placement=dict(ps.placement),
                                         ps_budgets_bytes=tuple(ps.ps_budgets_bytes))
    elif which == "stage_layout":
        p = m.stage_layout
        section = PipelineSection(
            stages=p.stages, replicas=p.replicas, microbatches=p.microbatches,
            microbatch=p.microbatch, layout=tuple(StageAssignment(
                replica=a.replica, stage=a.stage, role=a.role, index=a.index,
                first_layer=a.first_layer, last_layer=a.last_layer, layers=tuple(a.layers),
                estimated_memory_bytes=a.estimated_memory_bytes,
                memory_budget_bytes=a.memory_budget_bytes) for a in p.layout))
    return TaskConfig(
        version=m.version, job_id=m.job_id, role=m.role, index=m.index,
        spec=spec_from_proto(m.spec), memory_budget_bytes=m.memory_budget_bytes,
        report_interval_s=m.report_interval_s or TaskConfig.report_interval_s,
        section=section, restart=m.restart, probe=m.probe,
        agent=AgentSettings(output_dir=m.agent.output_dir, threads=m.agent.threads,
                            device=m.agent.device or AgentSettings.device,
                            blob_dir=m.agent.blob_dir, shared_dir=m.agent.shared_dir,
                            data_roots=tuple(m.agent.data_roots)))


# --- agent commands ---------------------------------------------------------------------------

def command_to_proto(cmd: Any) -> pb.AgentCommand:
    """A coordinator command (``StartTaskCommand``, ``StopTaskCommand`` or
    ``PurgeJobCommand``) to its message."""
    if not hasattr(cmd, "reason") and not hasattr(cmd, "config"):
        return pb.AgentCommand(purge=pb.PurgeJob(job_id=cmd.job_id))
    config = getattr(cmd, "config", None)
    if config is not None:
        return pb.AgentCommand(start=pb.StartTask(
            job_id=cmd.job_id, role=cmd.role, index=cmd.index, tf_config=cmd.tf_config,
            memory_budget_bytes=cmd.memory_budget_bytes, attempt=cmd.attempt,
            config=task_config_to_proto(config)))
    return pb.AgentCommand(stop=pb.StopTask(job_id=cmd.job_id, role=cmd.role, index=cmd.index,
                                            reason=cmd.reason, attempt=cmd.attempt))


# --- agent reports ----------------------------------------------------------------------------

def report_to_proto(r: TaskReport) -> pb.TaskStatus:
    return pb.TaskStatus(
        job_id=r.job_id, role=r.role, index=r.index, state=_task_state_to_proto(r.state),
        attempt=r.attempt, failure=_failure_to_proto(r.failure), exit_code=r.exit_code,
        message=r.message, in_use_bytes=r.in_use_bytes, peak_bytes=r.peak_bytes, step=r.step,
        total_steps=r.total_steps, loss=r.loss or 0.0, examples_per_sec=r.examples_per_sec,
        has_result=r.test_accuracy is not None, test_accuracy=r.test_accuracy or 0.0,
        test_loss=r.test_loss or 0.0, weights_sha256=r.weights_sha256, model_path=r.model_path,
        first_step_time=r.first_step_time, replica_weights_sha256=r.replica_weights_sha256,
        oom=pb.OutOfMemory(task=r.oom.task, allocation_bytes=r.oom.allocation_bytes,
                           shape=list(r.oom.shape), dtype=r.oom.dtype, op=r.oom.op)
        if r.oom is not None else None,
        checkpoint_step=r.checkpoint_step, resumed_step=r.resumed_step, training=r.training,
        test_metrics=r.test_metrics, notes=r.notes, largest_alloc_bytes=r.largest_alloc_bytes,
    )


def report_from_proto(m: pb.TaskStatus) -> TaskReport:
    return TaskReport(
        job_id=m.job_id, role=m.role, index=m.index, state=_task_state_from_proto(m.state),
        attempt=m.attempt, failure=_failure_from_proto(m.failure), exit_code=m.exit_code,
        message=m.message, in_use_bytes=m.in_use_bytes, peak_bytes=m.peak_bytes, step=m.step,
        total_steps=m.total_steps, loss=m.loss if m.step else None,
        examples_per_sec=m.examples_per_sec,
        test_accuracy=m.test_accuracy if m.has_result else None,
        test_loss=m.test_loss if m.has_result else None, weights_sha256=m.weights_sha256,
        model_path=m.model_path, first_step_time=m.first_step_time,
        replica_weights_sha256=list(m.replica_weights_sha256),
        oom=OutOfMemory(task=m.oom.task[:64], allocation_bytes=max(0, m.oom.allocation_bytes),
                        shape=tuple(m.oom.shape)[:16], dtype=m.oom.dtype[:32], op=m.oom.op[:200])
        if m.HasField("oom") else None,
        checkpoint_step=max(0, m.checkpoint_step), resumed_step=max(0, m.resumed_step),
        training=m.training[:1000],
        test_metrics={k[:64]: v for k, v in list(m.test_metrics.items())[:64]},
        notes=[n[:500] for n in m.notes[:8]],
        largest_alloc_bytes=m.largest_alloc_bytes,
    )


# --- task config files ------------------------------------------------------------------------

def read_task_config(path: str) -> TaskConfig:
    """Reads a ``TaskConfig`` message from ``path``: binary protobuf as the agent writes it, or
    its JSON form (``.json``: protobuf's JSON mapping, for hand-made configs and tests)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TaskConfigError("--config", f"cannot read task config {path}: {e.strerror}") from None
    msg = pb.TaskConfig()
    try:
        if path.endswith(".json"):
            json_format.Parse(data.decode("utf-8"), msg)
        else:
            msg.ParseFromString(data)
    except (json_format.ParseError, UnicodeDecodeError, ValueError) as e:
        raise TaskConfigError("--config", f"{path} is not a TaskConfig message: {e}") from None
    if msg.version != TASK_CONFIG_VERSION:
        raise TaskConfigError("version", f"task config version {msg.version}; this task runner "
                                         f"reads version {TASK_CONFIG_VERSION}")
    try:
        return task_config_from_proto(msg)
    except SpecError as e:
        raise TaskConfigError(e.field, e.message) from None


def write_task_config(path: str, config: TaskConfig) -> None:
    with open(path, "wb") as f:
        f.write(task_config_to_proto(config).SerializeToString())
