"""The cluster API (``ClusterService``), agents' calls: registration (each field of it
checked, ``check_agent``), heartbeats, commands, task reports, logs and files. Each handler
converts, delegates to the coordinator and converts back; the checks and error codes every
call gets are ``rpcguard.rpc``'s."""

from __future__ import annotations

import asyncio
import re
from typing import Any, AsyncIterator, Iterable

import grpc

from strata import convert
from strata.auth import Auth
from strata.coordinator.blobs import MAX_OUTPUT_FILE_BYTES, check_sha
from strata.coordinator.core import Coordinator
from strata.coordinator.opencalls import OpenCalls
from strata.coordinator.rpcguard import CALLER, MalformedRequest, checked_message, rpc
from strata.cpukernels import KINDS
from strata.dataroots import check_roots
from strata.errors import DiskFull, QuotaExceeded, UnknownAgentSession
from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata.types import Job, TaskReport

AGENT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HOST_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                     r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
DEVICE_RE = re.compile(r"^(CPU|GPU:[0-9]{1,3})$")


def check_ports(ports: Iterable[int]) -> None:
    """Each offered port is a port (how many, ``coordinator.bounds`` has checked already)."""
    bad = [p for p in ports if not 1 <= p <= 65535]
    if bad:
        raise MalformedRequest(f"free_ports: {bad[0]} is not a port (1-65535)")


def check_agent(request: pb.RegisterAgentRequest) -> None:
    """An agent's registration names itself, where its tasks are reached and its device: each
    field is checked, and a refusal quotes none of it unbounded. Sizes and counts (paths,
    ports, tasks) were bounded before the handler ran (``coordinator.bounds``)."""
    import ipaddress

    if not AGENT_NAME_RE.match(request.name):
        raise MalformedRequest(f"name {request.name[:64]!r}: 1-64 of letters, digits, '.', '_' "
                               "and '-', starting with a letter or digit")
    host = request.host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not HOST_RE.match(host):
            raise MalformedRequest(f"host {host[:64]!r} is not a host name or an IP "
                                   "address") from None
    if request.device and not DEVICE_RE.match(request.device):
        raise MalformedRequest(f"device {request.device[:16]!r}: CPU or GPU:N")
    if request.budget_bytes > 1 << 50:
        raise MalformedRequest("budget_bytes: beyond any machine")
    check_ports(request.free_ports)
    try:
        check_roots(request.data_roots)
    except ValueError as e:
        raise MalformedRequest(f"data_roots: {e}") from None


def _reports(statuses: Iterable[pb.TaskStatus]) -> list[TaskReport]:
    try:
        return [convert.report_from_proto(t) for t in statuses]
    except ValueError as e:
        raise MalformedRequest(f"malformed task status: {e}") from None



class ClusterServicer(pb_grpc.ClusterServiceServicer):
    def __init__(self, coord: Coordinator, auth: Auth | None = None,
                 calls: OpenCalls | None = None):
        self.coord = coord
        self.auth = auth
        self.calls = calls

    @rpc
    async def RegisterAgent(self, request: pb.RegisterAgentRequest,
                            context: Any) -> pb.RegisterAgentResponse:
        if not request.name or request.budget_bytes <= 0:
            raise MalformedRequest("name and a positive budget_bytes are required")
        check_agent(request)
        session = self.coord.register(
            request.name, request.host, request.device or "CPU", request.budget_bytes,
            list(request.free_ports), _reports(request.tasks), work_dir=request.work_dir,
            pid=request.pid, shared_dir=request.shared_dir, draining=request.draining,
            data_roots=check_roots(request.data_roots), caller=CALLER.get(),
            cpu_kernels=request.cpu_kernels if request.cpu_kernels in KINDS else "")
        return pb.RegisterAgentResponse(session=session,
                                        heartbeat_interval_s=self.coord.heartbeat_interval_s)

    def _heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        check_ports(request.free_ports)
        try:
            self.coord.heartbeat(request.name, request.session,
                                 convert.memory_from_proto(request.memory), _reports(request.tasks),
                                 list(request.free_ports), sent_at=request.sent_at,
                                 disk=convert.disk_from_proto(request.disk))
        except UnknownAgentSession:
            return pb.HeartbeatResponse(reregister=True)
        return pb.HeartbeatResponse()

    @rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        return self._heartbeat(request)

    @rpc
    async def Heartbeats(self, request_iterator: AsyncIterator[pb.HeartbeatRequest],
                         context: Any) -> None:
        # grpc.aio's reader/writer API rather than an async generator over the iterator: what
        # waits for an agent's next heartbeat (a second) is then one read, not a stack of async
        # generators and their asend objects, which the cycle collector walked again and again
        # (6.6 s against 1.0 s of its CPU in one 5,000-agent run, docs/benchmarks-log.md). Each
        # message is checked as a unary request is, and its name against the token.
        while (request := await context.read()) is not grpc.aio.EOF:
            await context.write(self._heartbeat(
                checked_message(self, "Heartbeats", request, context)))

    @rpc
    async def Connect(self, request: pb.ConnectRequest, context: Any) -> AsyncIterator[pb.AgentCommand]:
        async for cmd in self.coord.commands(request.name, request.session):
            yield convert.command_to_proto(cmd)

    @rpc
    async def ReportTask(self, request: pb.ReportTaskRequest, context: Any) -> pb.ReportTaskResponse:
        (report,) = _reports([request.status])
        self.coord.report(request.name, request.session, report, strict=True)
        return pb.ReportTaskResponse()

    @rpc
    async def DrainAgent(self, request: pb.DrainAgentRequest,
                         context: Any) -> pb.DrainAgentResponse:
        self.coord.agents.check_session(request.name, request.session)
        self.coord.drain(request.name, request.deadline_s)
        return pb.DrainAgentResponse(tasks=self.coord.tasks_on(request.name))

    @rpc
    async def AppendLogs(self, request: pb.AppendLogsRequest, context: Any) -> pb.AppendLogsResponse:
        self.coord.append_logs(request.name, request.session, request.job_id, request.role,
                               request.index, request.data, request.attempt)
        return pb.AppendLogsResponse()

    @rpc
    async def FetchBlob(self, request: pb.FetchBlobRequest,
                        context: Any) -> AsyncIterator[pb.FileChunk]:
        self.coord.may_fetch(request.name, request.session, check_sha(request.sha256))
        size = self.coord.blobs.size(request.sha256)
        offset = 0
        chunks = self.coord.blobs.read(request.sha256)
        while (data := await asyncio.to_thread(next, chunks, None)) is not None:
            yield pb.FileChunk(data=data, offset=offset, size=size)
            offset += len(data)

    @rpc
    async def UploadOutput(self, request_iterator: AsyncIterator[pb.OutputChunk],
                           context: Any) -> pb.UploadOutputResponse:
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise MalformedRequest("an output upload with no chunk") from None
        def allowed() -> Job:  # checked again once the file is whole, before it is kept
            return self.coord.output_task(first.name, first.session, first.job_id, first.role,
                                          first.index, first.attempt, first.chunk.path)
        job = allowed()

        async def chunks() -> AsyncIterator[bytes]:
            yield first.chunk.data
            async for msg in it:
                if msg.job_id != first.job_id:
                    raise MalformedRequest("an output upload names one job in every chunk")
                yield msg.chunk.data
        try:
            size = await self.coord.blobs.put_output(job.id, first.chunk.path, chunks(),
                                                     MAX_OUTPUT_FILE_BYTES, owner=job.owner,
                                                     still_allowed=allowed)
        except (QuotaExceeded, DiskFull) as e:
            self.coord.output_refused(job, first.chunk.path, str(e))
            raise
        return pb.UploadOutputResponse(size=size)
