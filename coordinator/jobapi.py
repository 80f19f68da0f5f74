"""The job API (``JobService``), users' calls: each handler converts its request, delegates
to the coordinator and converts the answer; the checks and error codes every call gets are
``rpcguard.rpc``'s."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from strata import convert
from strata.auth import NAME_RE, Auth
from strata.coordinator.blobs import check_sha
from strata.coordinator.admission import prepare
from strata.coordinator.core import Coordinator
from strata.coordinator.opencalls import OpenCalls, Revocations
from strata.coordinator.paging import page
from strata.coordinator.rpcguard import CALLER, NotConfigured, owned, rpc
from strata.errors import NotFoundError, SpecError, UserCodeRefused
from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata.types import JobState, WorkerState

#: the longest a job may wait for workers the cluster has not had (``--queue-for-capacity``)
MAX_CAPACITY_WAIT_S = 30 * 86400.0


class JobServicer(pb_grpc.JobServiceServicer):
    def __init__(self, coord: Coordinator, auth: Auth | None = None,
                 calls: OpenCalls | None = None, revocations: Revocations | None = None):
        self.coord = coord
        self.auth = auth
        self.calls = calls
        self.revocations = revocations

    def _stored_files(self, msg: pb.JobSpec, owner: str) -> pb.JobSpec:
        """The spec with what the coordinator itself holds of its uploaded files: a
        ``.keras`` file's config is read from the stored copy, never taken from the client.
        A job names only files its owner uploaded (or its earlier jobs named): a digest seen
        in another user's job is not a way to another user's file."""
        def mine(sha: str, field: str) -> None:
            if self.coord.blobs.exists(sha) and not self.coord.blobs.holds(sha, owner):
                raise SpecError(field, "was not uploaded by you: submit through the client, "
                                       "which uploads the file first")
        if msg.model.HasField("keras_file"):
            kf = msg.model.keras_file
            check_sha(kf.sha256, "model.keras_file.sha256")
            mine(kf.sha256, "model.keras_file")
            kf.config = self.coord.blobs.keras_config(kf.sha256, kf.name or "model.keras")
            kf.size = self.coord.blobs.size(kf.sha256)
        if msg.HasField("code") and (msg.code.sha256 or msg.code.model or msg.code.dataset):
            if not self.coord.allow_user_code:
                raise UserCodeRefused(
                    "this coordinator does not run users' code (code:): start it with "
                    "--allow-user-code to let jobs run their own Python on the agents (strata "
                    "up does, for one user on loopback); or give the model as "
                    "model.keras_file / model.keras_json")
            check_sha(msg.code.sha256, "code.dir")
            mine(msg.code.sha256, "code.dir")
            if not self.coord.blobs.exists(msg.code.sha256):
                raise SpecError("code.dir", f"{msg.code.dir_name or 'the code directory'} was "
                                            "not uploaded to this coordinator; submit through "
                                            "the client, which uploads it first")
            msg.code.size = self.coord.blobs.size(msg.code.sha256)
        return msg

    @rpc
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: Any) -> pb.Job:
        request_id = request.request_id
        if len(request_id) > 128:
            raise SpecError("request_id", f"at most 128 characters, got {len(request_id)}")
        wait = request.queue_for_capacity_s
        if not 0 <= wait <= MAX_CAPACITY_WAIT_S:
            raise SpecError("queue_for_capacity_s", f"0 to {MAX_CAPACITY_WAIT_S:g} seconds (30 "
                                                    f"days), got {wait:g}")
        caller = CALLER.get()
        owner = caller.name if caller is not None else ""
        done = self.coord.job_for_request(request_id, owner)
        if done is not None:  # a retry whose first reply was lost
            return convert.job_to_proto(done, with_spec=False)
        self.coord.disk.check(0, "new jobs")
        spec = convert.spec_from_proto(await asyncio.to_thread(self._stored_files, request.spec,
                                                               owner))
        # Planning profiles the model and may run the stage planner: kept off the event loop.
        offers = self.coord.offers_for(spec, free=False)
        prepared = await asyncio.to_thread(prepare, spec, offers, dict(self.coord.measured))
        return convert.job_to_proto(self.coord.submit(prepared, request_id, owner=owner,
                                                      queue_for_capacity_s=wait),
                                    with_spec=False)

    @rpc
    async def DrainWorker(self, request: pb.DrainWorkerRequest, context: Any) -> pb.Worker:
        return convert.worker_to_proto(self.coord.drain(request.name, request.deadline_s))

    @rpc
    async def Revoke(self, request: pb.RevokeRequest, context: Any) -> pb.RevokeResponse:
        r = self.revocations
        if r is None or not r.auth.enabled:
            raise NotConfigured("this coordinator has no authentication (--auth-tokens, or "
                                "--tls-client-ca): there are no credentials to revoke")
        name, closed, lost = request.name, 0, list[str]()
        if name and not NAME_RE.match(name):
            raise SpecError("name", f"{name[:64]!r} is not a caller's NAME (letters, digits "
                                    "and ._@-, at most 128)")
        caller = CALLER.get()
        if name and request.restore:
            r.restore(name)
        elif name:
            if caller is not None and caller.name == name:
                raise NotConfigured(f"{name} is the name this call was made with: revoke it "
                                    "with another admin's credentials")
            closed, lost = r.name(name)
        return pb.RevokeResponse(revoked=sorted(r.auth.revoked), streams_closed=closed,
                                 agents_lost=lost)

    @rpc
    async def GetJob(self, request: pb.GetJobRequest, context: Any) -> pb.Job:
        return convert.job_to_proto(self.coord.with_outputs(self.coord.get(request.id)))

    @rpc
    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListJobsResponse:
        states = {JobState(pb.JobState.Name(s)) for s in request.states}
        # paged over the summaries: only the jobs on the page are loaded (a finished job is
        # read from the store when first shown, ``coordinator.jobtable``)
        found = sorted((s for s in self.coord.jobs.summaries() if not states or s.state in states),
                       key=lambda s: (s.created_at, s.id))
        page_of, token = page(found, lambda s: (s.created_at, s.id), request.page_size,
                              request.page_token)
        chosen = [self.coord.get(s.id) for s in page_of]
        # Without specs: a list of jobs with large keras_json models would outgrow any message.
        return pb.ListJobsResponse(jobs=[convert.job_to_proto(j, with_spec=False)
                                         for j in chosen], next_page_token=token)

    @rpc
    async def CancelJob(self, request: pb.CancelJobRequest, context: Any) -> pb.Job:
        owned(self.coord.get(request.id).owner)
        return convert.job_to_proto(self.coord.cancel(request.id), with_spec=False)

    @rpc
    async def DeleteJob(self, request: pb.DeleteJobRequest, context: Any) -> pb.DeleteJobResponse:
        owned(self.coord.get(request.id).owner)
        self.coord.delete(request.id)
        return pb.DeleteJobResponse()

    @rpc
    async def WatchJob(self, request: pb.WatchJobRequest, context: Any) -> AsyncIterator[pb.JobEvent]:
        async for event in self.coord.watch(request.id, request.after_seq):
            yield convert.event_to_proto(event)

    @rpc
    async def GetLogs(self, request: pb.GetLogsRequest, context: Any) -> AsyncIterator[pb.LogChunk]:
        job = self.coord.get(request.job_id)
        owned(job.owner)
        if request.all_tasks or not request.role:
            tasks = [(t.role, t.index) for t in job.tasks]
        else:
            tasks = [(t.role, t.index) for t in job.tasks
                     if t.role == request.role and t.index == request.index]
            if not tasks:
                raise NotFoundError("task", f"{request.role}:{request.index} of {job.id}")
        async for role, index, data in self.coord.read_logs(job.id, tasks, request.follow,
                                                            request.tail_lines):
            yield pb.LogChunk(role=role, index=index, data=data)

    @rpc
    async def PlanJob(self, request: pb.PlanJobRequest, context: Any) -> pb.Plan:
        caller = CALLER.get()
        spec = convert.spec_from_proto(await asyncio.to_thread(
            self._stored_files, request.spec, caller.name if caller is not None else ""))
        offers = self.coord.offers_for(spec, free=True)
        prepared = await asyncio.to_thread(prepare, spec, offers, dict(self.coord.measured))
        return convert.plan_to_proto(self.coord.plan(prepared))

    @rpc
    async def ListWorkers(self, request: pb.ListWorkersRequest, context: Any) -> pb.ListWorkersResponse:
        states = {WorkerState(pb.WorkerState.Name(s)) for s in request.states}
        # paged by name over the cheap rows; only the page's workers are built in full
        names = sorted(name for name, _, state, *_ in self.coord.worker_rows()
                       if not states or state in states)
        chosen, token = page(names, lambda n: (n,), request.page_size, request.page_token)
        return pb.ListWorkersResponse(
            workers=[convert.worker_to_proto(w) for w in self.coord.list_workers(chosen)],
            next_page_token=token,
            coordinator_disk=convert.coordinator_disk_to_proto(self.coord.disk_status()))

    @rpc
    async def ListQueues(self, request: pb.ListQueuesRequest, context: Any) -> pb.ListQueuesResponse:
        return pb.ListQueuesResponse(
            queues=[convert.queue_to_proto(q) for q in self.coord.queue_views()])

    @rpc
    async def UploadBlob(self, request_iterator: AsyncIterator[pb.FileChunk],
                         context: Any) -> pb.BlobRef:
        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in request_iterator:
                yield chunk.data
        caller = CALLER.get()
        sha, size = await self.coord.blobs.put(chunks(), caller.name if caller else "")
        return pb.BlobRef(sha256=sha, size=size)

    @rpc
    async def DownloadOutput(self, request: pb.DownloadOutputRequest,
                             context: Any) -> AsyncIterator[pb.FileChunk]:
        job = self.coord.get(request.job_id)
        owned(job.owner)
        chunks = iter(self.coord.blobs.read_outputs(job.id))
        while (c := await asyncio.to_thread(next, chunks, None)) is not None:
            path, offset, size, data = c
            yield pb.FileChunk(path=path, offset=offset, size=size, data=data)
