"""A small typed Python client for the coordinator's job API; the CLI is built on it.

    from strata.client import Client
    with Client("127.0.0.1:50051") as c:
        job = c.submit("job.yaml")
        final = c.wait(job.id, timeout=600)
        print(final.state, final.metrics.test_accuracy)
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
import uuid
from typing import Any, Iterator, Mapping, Sequence

import grpc

from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata import convert
from strata.errors import SpecError, StrataError
from strata.spec import load_spec_file, parse_job_spec
from strata.jobspec import JobSpec
from strata.queues import QueueView
from strata.auth import read_token, with_token
from strata.tls import ClientTls, channel
from strata.types import CoordinatorDisk, Job, JobEvent, Plan, WorkerInfo

DEFAULT_ADDRESS = "127.0.0.1:50051"
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # as the coordinator's limit
#: how long ``submit`` keeps retrying while the coordinator is unreachable (a restart)
SUBMIT_RETRY_S = 30.0


def default_address() -> str:
    return os.environ.get("STRATA_COORDINATOR") or DEFAULT_ADDRESS


class CoordinatorError(StrataError):
    """The coordinator answered with an error status (or could not be reached)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class JobRejected(CoordinatorError):
    """INVALID_ARGUMENT: the spec is invalid; the message (and ``field``, when known) names it.

    Raised for the client's own validation too, which applies the coordinator's rules before
    sending, so a caller handles one exception whichever side found the fault."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = ""):
        super().__init__(code, message)
        self.field = field


class Infeasible(CoordinatorError):
    """FAILED_PRECONDITION: e.g. no worker could ever hold the job, or the job already ended."""


class NotFound(CoordinatorError):
    pass


class Unavailable(CoordinatorError):
    """The coordinator cannot be reached."""


class DiskFull(Unavailable):
    """UNAVAILABLE because the coordinator's disk is full: reached, but it cannot store
    this (reads and cancels still work). Not retried."""


class Unauthenticated(CoordinatorError):
    """No token, or one the coordinator does not know (STRATA_TOKEN, --token-file)."""


class PermissionDenied(CoordinatorError):
    """The token's role may not do this, or the job is another owner's."""


class QuotaExceeded(CoordinatorError):
    """RESOURCE_EXHAUSTED: over a per-user limit (jobs pending); retry once some have started."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: JobRejected,
    grpc.StatusCode.FAILED_PRECONDITION: Infeasible,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QuotaExceeded,
}


#: trailing metadata in which the coordinator names a rejected spec field (as coordinator.rpcguard)
FIELD_METADATA_KEY = "strata-field"
REASON_METADATA_KEY = "strata-reason"


def _wrap(e: grpc.RpcError, address: str) -> CoordinatorError:
    code = e.code()
    message = e.details() or str(code)
    trailing = getattr(e, "trailing_metadata", lambda: None)() or ()
    if code == grpc.StatusCode.UNAVAILABLE and (REASON_METADATA_KEY, "disk-full") in trailing:
        return DiskFull(code, message)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        hint = ""
        low = message.lower()
        if any(w in low for w in ("socket closed", "handshake", "ssl", "certificate", "tls")):
            hint = ("; if it serves TLS, give its CA (--tls-ca or STRATA_TLS_CA) and, under "
                    "mutual TLS, a client certificate (--tls-cert, --tls-key)")
        message = f"cannot reach the coordinator at {address} ({message}){hint}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = next((v for k, v in trailing if k == FIELD_METADATA_KEY), "")
        return JobRejected(code, message, field if isinstance(field, str) else "")
    cls: type[CoordinatorError] = _ERRORS.get(code, CoordinatorError)
    return cls(code, message)


SpecInput = str | Mapping[str, Any] | JobSpec


@dataclasses.dataclass(frozen=True)
class Revocation:
    """What ``Client.revoke`` did: the names revoked now, the calls it closed, the agents it
    made LOST."""

    revoked: list[str]
    streams_closed: int = 0
    agents_lost: list[str] = dataclasses.field(default_factory=list)


def _spec_proto(spec: SpecInput, overrides: list[str] | None = None
                ) -> tuple[pb.JobSpec, list[str]]:
    """Parses and validates locally (the same rules the coordinator applies: one parse on this
    side) and converts the parsed spec to the message. Local files the spec names
    (``model.keras_file``) are read here; returns the message and the files to upload first.
    Relative paths are relative to the job file's directory (else the current one)."""
    from strata.spec import apply_overrides
    from strata.uploads import attach_files

    try:
        if isinstance(spec, JobSpec) and not overrides:
            return convert.spec_to_proto(spec), []
        base_dir = None
        if isinstance(spec, JobSpec):
            raw: Any = spec.to_dict()
        elif isinstance(spec, str):
            raw = load_spec_file(spec)
            base_dir = os.path.dirname(os.path.abspath(spec))
        else:
            raw = json.loads(json.dumps(dict(spec)))
        if overrides:
            raw = apply_overrides(raw, overrides)
        files = attach_files(raw, base_dir)
        return convert.spec_to_proto(parse_job_spec(raw)), files
    except SpecError as e:
        raise JobRejected(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None


def local_spec(spec: SpecInput, overrides: list[str] | None = None) -> JobSpec:
    """The job as the coordinator would parse it, checked on this machine alone (``strata
    validate``, ``strata plan --workers``): local files it names are read, nothing is sent,
    and a code directory packed on the way is removed again."""
    msg, files = _spec_proto(spec, overrides)
    for path in files:
        if os.path.basename(path).startswith("strata-code-"):
            os.unlink(path)
    # checked once already (``_spec_proto``); the message's round trip is exact
    return convert.accepted_spec_from_proto(msg)


class Client:
    def __init__(self, address: str | None = None, timeout: float = 10.0,
                 tls: ClientTls | None = None, token: str | None = None):
        """``tls``: the coordinator's CA (and a client certificate under mutual TLS); by
        default from ``STRATA_TLS_CA``, ``STRATA_TLS_CERT``, ``STRATA_TLS_KEY`` (none: plain
        text)."""
        self.address = address or default_address()
        self.timeout = timeout
        self.tls = tls if tls is not None else ClientTls.from_env()
        self._raw_channel = channel(self.address, self.tls, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        # ``token``: sent as ``authorization: Bearer``; by default STRATA_TOKEN (none: no auth)
        self._channel = with_token(self._raw_channel,
                                   token if token is not None else read_token())
        self._stub = pb_grpc.JobServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._raw_channel.close()

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise _wrap(e, self.address) from None

    def submit(self, spec: SpecInput, overrides: list[str] | None = None, *,
               retry_s: float = SUBMIT_RETRY_S, request_id: str | None = None,
               queue_for_capacity_s: float = 0.0) -> Job:
        """Submits a job (a path to YAML/JSON, a mapping, or a JobSpec), uploading the files it
        names first. Raises JobRejected with the field name for an invalid spec, Infeasible if
        no worker could ever hold it.

        While the coordinator cannot be reached (restarting) the submission is retried for
        ``retry_s`` seconds with backoff and jitter, always with the same ``request_id`` (one
        is made per call): a retry after a reply that was lost returns the job the first
        attempt created, never a second one.

        A job the cluster has never had the workers for is refused (Infeasible, with the
        numbers); with ``queue_for_capacity_s`` it waits that long for them instead."""
        msg, files = _spec_proto(spec, overrides)
        request = pb.SubmitJobRequest(spec=msg, request_id=request_id or uuid.uuid4().hex,
                                      queue_for_capacity_s=queue_for_capacity_s)
        deadline = time.monotonic() + retry_s
        backoff = 0.2
        while True:
            try:
                self._upload_all(files)
                return convert.job_from_proto(self._call("SubmitJob", request))
            except Unavailable as e:
                if isinstance(e, DiskFull) or time.monotonic() + backoff > deadline:
                    raise
                time.sleep(backoff * random.uniform(0.5, 1.5))
                backoff = min(2 * backoff, 5.0)

    def drain(self, worker: str, deadline_s: float = 0.0) -> WorkerInfo:
        """No new tasks on ``worker``; its jobs restart elsewhere from their checkpoints. With
        ``deadline_s`` (a notice: the worker leaves within it) they first save one on notice."""
        return convert.worker_from_proto(self._call(
            "DrainWorker", pb.DrainWorkerRequest(name=worker, deadline_s=deadline_s)))

    def plan(self, spec: SpecInput, overrides: list[str] | None = None) -> Plan:
        msg, files = _spec_proto(spec, overrides)
        self._upload_all(files)
        return convert.plan_from_proto(self._call("PlanJob", pb.PlanJobRequest(spec=msg)))

    def _upload_all(self, files: list[str]) -> None:
        """Uploads the files a spec brings; removes the archives packed for it on the way."""
        try:
            for path in files:
                self.upload(path)
        finally:
            for path in files:
                if os.path.basename(path).startswith("strata-code-"):
                    os.unlink(path)

    def upload(self, path: str) -> str:
        """Uploads a file to the coordinator's blob store; returns its SHA-256 (checked)."""
        from strata.uploads import file_chunks, sha256_file

        sha, size = sha256_file(path)
        # a slow link must not time out a large file: at least 10 MB/s is assumed
        timeout = max(self.timeout, 30.0 + size / 10e6)
        try:
            ref = self._stub.UploadBlob((pb.FileChunk(data=d) for d in file_chunks(path)),
                                        timeout=timeout)
        except grpc.RpcError as e:
            raise _wrap(e, self.address) from None
        if ref.sha256 != sha:
            raise CoordinatorError(grpc.StatusCode.DATA_LOSS,
                                   f"upload of {path}: the coordinator stored {ref.sha256[:12]}, "
                                   f"the file is {sha[:12]} (changed while uploading?)")
        return sha

    def download(self, job_id: str, dest: str, timeout: float | None = None) -> list[str]:
        """Fetches every output file of a job into ``dest``; returns their local paths."""
        from strata.uploads import safe_relpath

        os.makedirs(dest, exist_ok=True)
        written: list[str] = []
        f = None
        current = None
        try:
            for chunk in self._stub.DownloadOutput(pb.DownloadOutputRequest(job_id=job_id),
                                                   timeout=timeout):
                if chunk.path != current:
                    if f is not None:
                        f.close()
                    current = chunk.path
                    path = os.path.join(dest, safe_relpath(chunk.path))
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    f = open(path, "wb")
                    written.append(path)
                assert f is not None
                f.write(chunk.data)
        except grpc.RpcError as e:
            raise _wrap(e, self.address) from None
        finally:
            if f is not None:
                f.close()
        return written

    def get(self, job_id: str) -> Job:
        return convert.job_from_proto(self._call("GetJob", pb.GetJobRequest(id=job_id)))

    def _pages(self, method: str, request: Any) -> Iterator[Any]:
        """Every page of a paged list call (``page_token`` sent back until the last)."""
        while True:
            resp = self._call(method, request)
            yield resp
            if not resp.next_page_token:
                return
            request.page_token = resp.next_page_token

    def jobs(self, states: Sequence[str] = (), page_size: int = 0) -> list[Job]:
        """Every job (oldest first), or those in ``states``, fetched a page at a time."""
        req = pb.ListJobsRequest(page_size=page_size, states=[pb.JobState.Value(s) for s in states])
        return [convert.job_from_proto(j) for r in self._pages("ListJobs", req) for j in r.jobs]

    def cancel(self, job_id: str) -> Job:
        return convert.job_from_proto(self._call("CancelJob", pb.CancelJobRequest(id=job_id)))

    def delete(self, job_id: str) -> None:
        """Deletes a finished job: records, events, logs, stored outputs (Infeasible while it
        runs)."""
        self._call("DeleteJob", pb.DeleteJobRequest(id=job_id))

    def revoke(self, name: str = "", restore: bool = False) -> Revocation:
        """Admin: revokes every credential of ``name`` at once (its open calls closed, its
        agents LOST), or with ``restore`` lets them in again; no name lists the revoked."""
        r = self._call("Revoke", pb.RevokeRequest(name=name, restore=restore))
        return Revocation(list(r.revoked), int(r.streams_closed), list(r.agents_lost))

    def state_disk(self) -> CoordinatorDisk:
        """What the coordinator's ``--state-dir`` holds and has left."""
        resp = self._call("ListWorkers", pb.ListWorkersRequest(page_size=1))
        return convert.coordinator_disk_from_proto(resp.coordinator_disk)

    def workers(self, states: Sequence[str] = (), page_size: int = 0) -> list[WorkerInfo]:
        """Every worker (by name), or those in ``states``, fetched a page at a time."""
        req = pb.ListWorkersRequest(page_size=page_size,
                                    states=[pb.WorkerState.Value(s) for s in states])
        return [convert.worker_from_proto(w) for r in self._pages("ListWorkers", req)
                for w in r.workers]

    def queues(self) -> list[QueueView]:
        """The coordinator's queues (``--queues``): shares, use, waiting and running jobs."""
        resp = self._call("ListQueues", pb.ListQueuesRequest())
        return [convert.queue_from_proto(q) for q in resp.queues]

    def watch(self, job_id: str, after_seq: int = 0, timeout: float | None = None) -> Iterator[JobEvent]:
        """Stored events, then live snapshots, until the job ends (or ``timeout`` seconds pass)."""
        try:
            for m in self._stub.WatchJob(pb.WatchJobRequest(id=job_id, after_seq=after_seq),
                                         timeout=timeout):
                yield convert.event_from_proto(m)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
                raise TimeoutError(f"job {job_id} did not end within {timeout:g} s") from None
            raise _wrap(e, self.address) from None

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        """Blocks until the job reaches a final state; returns it. Raises TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.1, deadline - time.monotonic())
            try:
                for ev in self.watch(job_id, after_seq=1 << 62, timeout=remaining):
                    if ev.job is not None and ev.job.state.final:
                        return ev.job
            except Unavailable:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {job_id} did not end within {timeout:g} s") from None
                time.sleep(0.5)  # the coordinator may be restarting
                continue
            job = self.get(job_id)
            if job.state.final:
                return job

    def settled(self, job_id: str, timeout: float = 15.0) -> Job:
        """The job once it and (up to ``timeout`` seconds) each of its tasks have ended. A job
        ends when its lead task does; the others (a pipeline's later stages, a PS job's
        servers) send their last report, with their final state and allocator peak, a moment
        later. A job not yet final is returned as it is."""
        job = self.get(job_id)
        deadline = time.monotonic() + timeout
        while job.state.final and any(not t.state.final for t in job.tasks) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
            job = self.get(job_id)
        return job

    def logs(self, job_id: str, role: str | None = None, index: int = 0, follow: bool = False,
             timeout: float | None = None, tail: int = 0) -> Iterator[tuple[str, int, bytes]]:
        """Task logs in chunks: every task's, or one task's; ``tail``: only the last lines of
        each first."""
        req = pb.GetLogsRequest(job_id=job_id, role=role or "", index=index, all_tasks=role is None,
                                follow=follow, tail_lines=tail)
        try:
            for chunk in self._stub.GetLogs(req, timeout=timeout):
                yield chunk.role, chunk.index, chunk.data
        except grpc.RpcError as e:
            raise _wrap(e, self.address) from None
