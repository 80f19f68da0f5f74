"""gRPC edge of the coordinator: thin servicers (convert, delegate, map errors) and the server.

The server also serves grpc.health.v1.Health and server reflection so that stock tools
(grpcurl, grpc_health_probe) can list and call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from strata.coordinator.core import Coordinator, StartTaskCommand, StopTaskCommand
from strata.coordinator.store import SqliteStore
from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata import convert
from strata.errors import (
    DuplicateAgent, InfeasibleError, InvalidTransition, NotFoundError, SpecError, StrataError,
    UnknownAgentSession,
)

log = logging.getLogger("strata.coordinator")

# Requests larger than this are refused by gRPC before they reach a handler (a keras_json of a
# large model is a few hundred KiB; logs arrive in chunks of at most 1 MiB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def status_for(err: Exception) -> tuple[grpc.StatusCode, str]:
    """The one mapping from domain errors to gRPC status codes."""
    if isinstance(err, SpecError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(err)
    if isinstance(err, InfeasibleError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(err)
    if isinstance(err, InvalidTransition):
        return grpc.StatusCode.FAILED_PRECONDITION, str(err)
    if isinstance(err, UnknownAgentSession):
        return grpc.StatusCode.FAILED_PRECONDITION, str(err)
    if isinstance(err, DuplicateAgent):
        return grpc.StatusCode.ALREADY_EXISTS, str(err)
    if isinstance(err, MalformedRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, StrataError):
        return grpc.StatusCode.INTERNAL, str(err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}"


class MalformedRequest(StrataError):
    """A message that parses but carries values no Strata client sends (e.g. unknown enums)."""


def _reports(statuses) -> list:
    try:
        return [convert.report_from_proto(t) for t in statuses]
    except ValueError as e:
        raise MalformedRequest(f"malformed task status: {e}") from None


async def _abort(context: grpc.aio.ServicerContext, err: Exception) -> None:
    code, message = status_for(err)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=err)
    await context.abort(code, message)


class JobServicer(pb_grpc.JobServiceServicer):
    def __init__(self, coord: Coordinator):
        self.coord = coord

    async def SubmitJob(self, request: pb.SubmitJobRequest, context: Any) -> pb.Job:
        try:
            # Validation profiles the model: pure work, kept off the event loop.
            prepared = await asyncio.to_thread(self.coord.prepare, convert.spec_from_proto(request.spec),
                                               False, self.coord.worker_offers(free=False))
            return convert.job_to_proto(self.coord.submit(prepared), with_spec=False)
        except Exception as e:  # noqa: BLE001 - mapped to a status code
            await _abort(context, e)

    async def GetJob(self, request: pb.GetJobRequest, context: Any) -> pb.Job:
        try:
            return convert.job_to_proto(self.coord.get(request.id))
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListJobsResponse:
        # Without specs: a list of jobs with large keras_json models would outgrow any message.
        return pb.ListJobsResponse(jobs=[convert.job_to_proto(j, with_spec=False)
                                         for j in self.coord.list_jobs()])

    async def CancelJob(self, request: pb.CancelJobRequest, context: Any) -> pb.Job:
        try:
            return convert.job_to_proto(self.coord.cancel(request.id), with_spec=False)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def WatchJob(self, request: pb.WatchJobRequest, context: Any):
        try:
            async for event in self.coord.watch(request.id, request.after_seq):
                yield convert.event_to_proto(event)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def GetLogs(self, request: pb.GetLogsRequest, context: Any):
        try:
            job = self.coord.get(request.job_id)
            if request.all_tasks or not request.role:
                tasks = [(t.role, t.index) for t in job.tasks]
            else:
                tasks = [(t.role, t.index) for t in job.tasks
                         if t.role == request.role and t.index == request.index]
                if not tasks:
                    raise NotFoundError("task", f"{request.role}:{request.index} of {job.id}")
            async for role, index, data in self.coord.read_logs(job.id, tasks, request.follow):
                yield pb.LogChunk(role=role, index=index, data=data)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def PlanJob(self, request: pb.PlanJobRequest, context: Any) -> pb.Plan:
        try:
            prepared = await asyncio.to_thread(self.coord.prepare,
                                               convert.spec_from_proto(request.spec), True,
                                               self.coord.worker_offers(free=True))
            return convert.plan_to_proto(self.coord.plan(prepared))
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def ListWorkers(self, request: pb.ListWorkersRequest, context: Any) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(
            workers=[convert.worker_to_proto(w) for w in self.coord.list_workers()])


def _command_to_proto(cmd: StartTaskCommand | StopTaskCommand) -> pb.AgentCommand:
    import json

    if isinstance(cmd, StartTaskCommand):
        return pb.AgentCommand(start=pb.StartTask(
            job_id=cmd.job_id, role=cmd.role, index=cmd.index, tf_config=cmd.tf_config,
            memory_budget_bytes=cmd.memory_budget_bytes, config_json=json.dumps(cmd.config),
            attempt=cmd.attempt))
    return pb.AgentCommand(stop=pb.StopTask(job_id=cmd.job_id, role=cmd.role, index=cmd.index,
                                            reason=cmd.reason))


class ClusterServicer(pb_grpc.ClusterServiceServicer):
    def __init__(self, coord: Coordinator):
        self.coord = coord

    async def RegisterAgent(self, request: pb.RegisterAgentRequest, context: Any):
        if not request.name or request.budget_bytes <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "name and a positive budget_bytes are required")
        try:
            session = self.coord.register(
                request.name, request.host, request.device or "CPU", request.budget_bytes,
                list(request.free_ports), _reports(request.tasks), work_dir=request.work_dir,
                pid=request.pid)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
        return pb.RegisterAgentResponse(session=session,
                                        heartbeat_interval_s=self.coord.heartbeat_interval_s)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any):
        try:
            self.coord.heartbeat(request.name, request.session,
                                 convert.memory_from_proto(request.memory), _reports(request.tasks),
                                 list(request.free_ports))
        except UnknownAgentSession:
            return pb.HeartbeatResponse(reregister=True)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
        return pb.HeartbeatResponse()

    async def Connect(self, request: pb.ConnectRequest, context: Any):
        try:
            async for cmd in self.coord.commands(request.name, request.session):
                yield _command_to_proto(cmd)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)

    async def ReportTask(self, request: pb.ReportTaskRequest, context: Any):
        try:
            (report,) = _reports([request.status])
            self.coord.report(request.name, request.session, report)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
        return pb.ReportTaskResponse()

    async def AppendLogs(self, request: pb.AppendLogsRequest, context: Any):
        try:
            self.coord.append_logs(request.name, request.session, request.job_id, request.role,
                                   request.index, request.data)
        except Exception as e:  # noqa: BLE001
            await _abort(context, e)
        return pb.AppendLogsResponse()


async def serve(listen: str, state_dir: str, *, heartbeat_timeout_s: float = 10.0,
                heartbeat_interval_s: float = 1.0, start_timeout_s: float = 300.0,
                ready: asyncio.Future | None = None, port_file: str | None = None) -> None:
    """Runs the coordinator until SIGINT/SIGTERM. Prints (and optionally writes) the bound address."""
    os.makedirs(state_dir, exist_ok=True)
    lock = _lock_state_dir(state_dir)
    store = SqliteStore(os.path.join(state_dir, "strata.db"))
    coord = Coordinator(store, state_dir, heartbeat_timeout_s=heartbeat_timeout_s,
                        heartbeat_interval_s=heartbeat_interval_s, start_timeout_s=start_timeout_s)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    pb_grpc.add_JobServiceServicer_to_server(JobServicer(coord), server)
    pb_grpc.add_ClusterServiceServicer_to_server(ClusterServicer(coord), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (
        pb.DESCRIPTOR.services_by_name["JobService"].full_name,
        pb.DESCRIPTOR.services_by_name["ClusterService"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(services, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError:
        port = 0
    if port == 0:
        raise SystemExit(f"--listen {listen}: cannot bind that address")
    host = listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    await server.start()
    for name in services[:2] + ("",):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"strata coordinator listening on {address} (state in {os.path.abspath(state_dir)})",
          flush=True)
    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(address)
        os.replace(tmp, port_file)
    loop_task = asyncio.create_task(coord.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set_result(address)
    await stop.wait()
    log.info("stopping")
    await health_servicer.enter_graceful_shutdown()
    coord.stop()
    await server.stop(grace=2.0)
    loop_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await loop_task
    store.close()
    lock.close()


def _lock_state_dir(state_dir: str):
    """One coordinator per state directory: a second one would corrupt the job history."""
    import fcntl

    f = open(os.path.join(state_dir, "coordinator.lock"), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise SystemExit(f"--state-dir {state_dir}: another coordinator is using it") from None
    return f
