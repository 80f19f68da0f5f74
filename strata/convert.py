"""Paired ``x_to_proto`` / ``x_from_proto`` functions: the only module that maps between domain
types and protobuf messages. Scheduler, store and planner never import ``*_pb2``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Mapping

from google.protobuf import json_format
from google.protobuf.message import Message

from strata.protos import strata_pb2 as pb
from strata.spec import parse_job_spec
from strata.jobspec import (
    DataSpec, GradientSpec, JobSpec, MemorySpec, OptimizerSpec, TrainingSpec,
)
from strata.errors import SpecError
from strata.queues import UNBOUNDED, QueueView, Share
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
#
# Both directions go field by field between ``pb.JobSpec`` and ``JobSpec`` (and its sections):
# ``spec_to_proto`` and ``accepted_spec_from_proto`` trust the spec (this side or the coordinator
# made it); ``spec_from_proto`` checks what a client sent.

def spec_to_proto(spec: JobSpec) -> pb.JobSpec:
    """A parsed spec to its message, field by field: every field set (the normalized spec), so
    that both ``*spec_from_proto`` give the same spec back."""
    t, o = spec.training, spec.training.optimizer
    return pb.JobSpec(
        name=spec.name, strategy=spec.strategy, workers=spec.workers,
        elastic=pb.WorkerRange(min=spec.workers_min, max=spec.workers_max)
        if spec.elastic else None,
        queue=spec.queue, priority=spec.priority,
        preemptible=None if spec.preemptible else False,
        parameter_servers=spec.parameter_servers, stages=spec.stages,
        microbatches=spec.microbatches, model=_model_to_proto(spec.model),
        data=_data_to_proto(spec.data),
        training=pb.TrainingSpec(
            epochs=t.epochs, steps=t.steps, seed=t.seed, loss=t.loss,
            time_limit=t.time_limit_s if t.time_limit_s else None,
            # an optimizer not given stays out: the task then knows it was not
            optimizer=pb.OptimizerSpec(name=o.name, learning_rate=o.learning_rate)
            if o is not None else None),
        memory=pb.MemorySpec(
            per_task_budget=spec.memory.per_task_budget,
            mixed_precision=spec.memory.mixed_precision, recompute=spec.memory.recompute,
            profile=spec.memory.profile),
        gradients=pb.GradientSpec(
            accumulate=spec.gradients.accumulate, compression=spec.gradients.compression,
            pack_size=spec.gradients.pack_size),
        checkpoint=pb.CheckpointSpec(every_steps=spec.checkpoint_every_steps,
                                     keep=spec.checkpoint_keep),
        restart=pb.RestartSpec(max_restarts=spec.max_restarts,
                               backoff_s=spec.restart_backoff_s,
                               retry_user_errors=spec.retry_user_errors),
        code=pb.CodeSpec(**spec.code) if spec.code else None)


def _model_to_proto(model: Mapping[str, Any]) -> pb.ModelSpec:
    """``JobSpec.model``: one of its three forms, or none (the job's code builds the model)."""
    msg = pb.ModelSpec()
    if "keras_json" in model:
        msg.keras_json = model["keras_json"]
    elif "keras_file" in model:
        msg.keras_file.CopyFrom(pb.KerasFile(**model["keras_file"]))
    elif "builtin" in model:
        msg.builtin.CopyFrom(pb.BuiltinModel(**model["builtin"]))
        _mark_empty_lists(model, msg)
    return msg


def _data_to_proto(d: DataSpec) -> pb.DataSpec:
    return pb.DataSpec(
        source=d.source, path=d.path, batch_size=d.batch_size, examples=d.examples,
        test_path=d.test_path, label=d.label, image_size=d.image_size,
        test_fraction=d.test_fraction,
        features={name: pb.FeatureSpec(**f) for name, f in d.features.items()})


def raw_spec_to_proto(raw: Mapping[str, Any]) -> pb.JobSpec:
    """A spec mapping as a user wrote it, unvalidated (for tools and tests that must send what
    a client would refuse); unknown fields raise ``json_format.ParseError``."""
    msg = pb.JobSpec()
    json_format.ParseDict(dict(raw), msg)
    model = raw.get("model")
    if isinstance(model, Mapping):
        _mark_empty_lists(model, msg.model)
    return msg


def _mark_empty_lists(model: Mapping[str, Any], msg: pb.ModelSpec) -> None:
    # an empty repeated field is indistinguishable from an unset one on the wire; the lists
    # whose emptiness means something carry a presence flag (BuiltinModel.no_hidden), read
    # back by ``_Given``
    builtin = model.get("builtin")
    if isinstance(builtin, Mapping) and builtin.get("hidden") == []:
        msg.builtin.no_hidden = True


#: the lists whose emptiness means something, by message: list field -> its presence flag
_EMPTY_LIST_FLAGS = {pb.BuiltinModel.DESCRIPTOR.full_name: {"hidden": "no_hidden"}}


def accepted_spec_from_proto(msg: pb.JobSpec) -> JobSpec:
    """A spec the coordinator has accepted (in a ``Job``), field by field and not validated
    again, so a rule added later, or a strategy this side does not know, never makes an
    accepted job unreadable. A field the message lacks (a coordinator older than the field)
    takes its section's default, as ``JobSpec.from_dict`` does for the store's copy."""
    c, r, t = msg.checkpoint, msg.restart, msg.training
    return JobSpec(
        name=msg.name, strategy=msg.strategy, workers=msg.workers,
        parameter_servers=msg.parameter_servers, stages=msg.stages,
        microbatches=msg.microbatches, model=_model_from_proto(msg.model),
        data=_data_from_proto(msg.data),
        training=TrainingSpec(epochs=t.epochs, steps=t.steps, loss=t.loss, seed=t.seed,
                              optimizer=_optimizer_from_proto(t.optimizer),
                              time_limit_s=t.time_limit),
        memory=_memory_from_proto(msg.memory), gradients=_gradients_from_proto(msg.gradients),
        checkpoint_every_steps=c.every_steps,
        checkpoint_keep=c.keep if c.HasField("keep") else JobSpec.checkpoint_keep,
        max_restarts=r.max_restarts,
        restart_backoff_s=r.backoff_s if r.HasField("backoff_s") else JobSpec.restart_backoff_s,
        retry_user_errors=r.retry_user_errors,
        code=_code_from_proto(msg.code),
        workers_min=msg.elastic.min, workers_max=msg.elastic.max, queue=msg.queue,
        priority=msg.priority,
        preemptible=msg.preemptible if msg.HasField("preemptible") else True)


def _model_from_proto(m: pb.ModelSpec) -> dict[str, Any]:
    which = m.WhichOneof("source")
    if which == "keras_json":
        return {"keras_json": m.keras_json}
    if which == "keras_file":
        f = m.keras_file
        return {"keras_file": {"name": f.name, "sha256": f.sha256, "size": f.size,
                               "config": f.config}}
    if which == "builtin":
        b = m.builtin
        return {"builtin": {"kind": b.kind, "input_shape": list(b.input_shape),
                            "hidden": list(b.hidden), "classes": b.classes}}
    return {}


def _data_from_proto(d: pb.DataSpec) -> DataSpec:
    return DataSpec(
        source=d.source or DataSpec.source, path=d.path,
        batch_size=d.batch_size if d.HasField("batch_size") else DataSpec.batch_size,
        examples=d.examples, test_path=d.test_path, label=d.label,
        features={name: {"shape": list(f.shape), "dtype": f.dtype}
                  for name, f in d.features.items()},
        image_size=tuple(d.image_size),
        test_fraction=d.test_fraction if d.HasField("test_fraction") else DataSpec.test_fraction)


def _optimizer_from_proto(o: pb.OptimizerSpec) -> OptimizerSpec | None:
    if not o.ListFields():
        return None  # not given: the model's own, else the default (``optimizer_used``)
    return OptimizerSpec(
        name=o.name or OptimizerSpec.name,
        learning_rate=o.learning_rate if o.HasField("learning_rate")
        else OptimizerSpec.learning_rate)


def _memory_from_proto(m: pb.MemorySpec) -> MemorySpec:
    return MemorySpec(per_task_budget=m.per_task_budget,
                      mixed_precision=m.mixed_precision or MemorySpec.mixed_precision,
                      recompute=m.recompute, profile=m.profile or MemorySpec.profile)


def _gradients_from_proto(g: pb.GradientSpec) -> GradientSpec:
    return GradientSpec(
        accumulate=g.accumulate if g.HasField("accumulate") else GradientSpec.accumulate,
        compression=g.compression or GradientSpec.compression, pack_size=g.pack_size)


def _code_from_proto(c: pb.CodeSpec) -> dict[str, Any]:
    if not c.ListFields():
        return {}  # no code
    return {"dir_name": c.dir_name, "sha256": c.sha256, "size": c.size, "model": c.model,
            "dataset": c.dataset}


def spec_from_proto(msg: pb.JobSpec) -> JobSpec:
    """Checks a JobSpec message a client sent: the one validation path (``parse_job_spec``)
    reads the fields that are set straight from the message (``_Given``). Raises ``SpecError``
    naming the field.

    Why not build a ``JobSpec`` from the message first and check that: the rules depend on
    which fields were given, which a built spec no longer shows (``workers`` absent is 1,
    ``workers: 0`` is refused; ``test_fraction`` absent is 0.2, 0 is refused; ``hidden``
    absent is the default layers, empty is none), and on the order fields are read in (the
    first bad one is named). Building first would need a second copy of every default and
    of that order, one per kind of input; reading the message in place keeps one."""
    return parse_job_spec(_Given(msg))


class _Given(Mapping[str, Any]):
    """A message's fields as a client gave them, read in place as the loose mapping
    ``parse_job_spec`` takes: a field is there when it is set (by presence where it has
    presence, else when not zero or empty); a submessage or a map's message reads the same
    way; an empty list whose emptiness means something shows by its flag
    (``_EMPTY_LIST_FLAGS``; the flag itself is no field)."""

    __slots__ = ("_msg", "_readers")

    def __init__(self, msg: Message) -> None:
        self._msg = msg
        self._readers = _readers(msg.DESCRIPTOR)

    def get(self, key: str, default: Any = None) -> Any:
        value = self._readers.get(key, _no_field)(self._msg, key)
        return default if value is _ABSENT else value

    def __getitem__(self, key: str) -> Any:
        value = self._readers.get(key, _no_field)(self._msg, key)
        if value is _ABSENT:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name, read in self._readers.items()
                if read(self._msg, name) is not _ABSENT)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _GivenMap(Mapping[str, Any]):
    """A map of messages (``DataSpec.features``), each read as ``_Given``."""

    __slots__ = ("_map",)

    def __init__(self, m: Any) -> None:
        self._map = m

    def __getitem__(self, key: str) -> Any:
        if key not in self._map:  # reading a missing key of a message map would add it
            raise KeyError(key)
        return _Given(self._map[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)


# How ``_Given`` reads a field: each reader gives the value, or ``_ABSENT`` when it is not set.
_ABSENT = object()
_Reader = Callable[[Any, str], Any]


def _no_field(msg: Any, key: str) -> Any:
    return _ABSENT


def _by_presence(msg: Any, key: str) -> Any:
    return getattr(msg, key) if msg.HasField(key) else _ABSENT


def _submessage(msg: Any, key: str) -> Any:
    return _Given(getattr(msg, key)) if msg.HasField(key) else _ABSENT


def _by_value(msg: Any, key: str) -> Any:  # a plain proto3 scalar: set when not zero
    value = getattr(msg, key)
    return value if value else _ABSENT


def _list(msg: Any, key: str) -> Any:
    value = getattr(msg, key)
    return list(value) if value else _ABSENT


def _message_map(msg: Any, key: str) -> Any:
    value = getattr(msg, key)
    return _GivenMap(value) if value else _ABSENT


def _scalar_map(msg: Any, key: str) -> Any:
    value = getattr(msg, key)
    return dict(value) if value else _ABSENT


def _flagged_list(flag: str) -> _Reader:
    def read(msg: Any, key: str) -> Any:
        value = getattr(msg, key)
        return list(value) if value or getattr(msg, flag) else _ABSENT
    return read


@functools.lru_cache(maxsize=None)
def _readers(desc: Any) -> dict[str, _Reader]:
    """Each field of a message type -> its reader (worked out once per type)."""
    flags = _EMPTY_LIST_FLAGS.get(desc.full_name, {})
    out: dict[str, _Reader] = {}
    for f in desc.fields:
        if f.name in flags.values():
            out[f.name] = _no_field  # a flag is read with its list
        elif f.name in flags:
            out[f.name] = _flagged_list(flags[f.name])
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            valued = f.message_type.fields_by_name["value"].message_type is not None
            out[f.name] = _message_map if valued else _scalar_map
        elif _is_repeated(f):
            out[f.name] = _list
        elif f.message_type is not None:
            out[f.name] = _submessage
        else:
            out[f.name] = _by_presence if f.has_presence else _by_value
    return out


def _is_repeated(field: Any) -> bool:
    # protobuf 5+: field.is_repeated; older: label == LABEL_REPEATED.
    rep = getattr(field, "is_repeated", None)
    return bool(rep) if rep is not None else field.label == field.LABEL_REPEATED


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
        training=j.training, probe_of=j.recovery.probe_of, resizes=j.recovery.resizes,
        preemptions=j.recovery.preemptions,
        workers_now=j.spec.workers if j.spec is not None else j.recovery.workers_now,
        position=j.position, estimated_start=j.estimated_start,
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
        training=m.training, recovery=JobRecovery(probe_of=m.probe_of, resizes=m.resizes,
                                                  workers_now=m.workers_now,
                                                  preemptions=m.preemptions),
        position=m.position, estimated_start=m.estimated_start,
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
    """A coordinator command (``StartTaskCommand``, ``StopTaskCommand``, ``PurgeJobCommand``
    or ``NoticeCommand``) to its message."""
    if hasattr(cmd, "step"):
        return pb.AgentCommand(notice=pb.Notice(job_id=cmd.job_id, step=cmd.step,
                                                attempt=cmd.attempt))
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


# --- queues -----------------------------------------------------------------------------------

def _share_to_proto(s: Share) -> pb.QueueShare:
    return pb.QueueShare(workers=None if s.workers >= UNBOUNDED else s.workers,
                         memory_bytes=None if s.memory_bytes >= UNBOUNDED else s.memory_bytes)


def _share_from_proto(m: pb.QueueShare) -> Share:
    return Share(m.workers if m.HasField("workers") else UNBOUNDED,
                 m.memory_bytes if m.HasField("memory_bytes") else UNBOUNDED)


def queue_to_proto(q: QueueView) -> pb.QueueInfo:
    return pb.QueueInfo(name=q.name, nominal=_share_to_proto(q.nominal),
                        borrow=_share_to_proto(q.borrow), in_use=_share_to_proto(q.in_use),
                        waiting=q.waiting, running=q.running, default=q.default)


def queue_from_proto(m: pb.QueueInfo) -> QueueView:
    return QueueView(m.name, _share_from_proto(m.nominal), _share_from_proto(m.borrow),
                     _share_from_proto(m.in_use), m.waiting, m.running, m.default)
