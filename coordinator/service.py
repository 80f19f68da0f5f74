"""gRPC edge of the coordinator: thin servicers (convert, delegate, map errors) and the server.

The server also serves grpc.health.v1.Health and server reflection so that stock tools
(grpcurl, grpc_health_probe) can list and call it.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from typing import IO, Any, AsyncIterator, Callable, Iterable, NoReturn, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from strata.auth import CLUSTER, NAME_RE, Auth, AuthFileError, Caller, Denied
from strata.coordinator.bounds import Undecodable, check_request
from strata.coordinator.agents import CallWait
from strata.coordinator.core import Coordinator, prepare
from strata.coordinator.gcpolicy import GcPolicy
from strata.coordinator.web import LOOP_LATE_SECONDS, RPC_SECONDS
from strata.cpukernels import KINDS
from strata.dataroots import check_roots
from strata.limits import (
    DEFAULT_MAX_PENDING_PER_USER, DEFAULT_MAX_TASKS_PER_JOB, DEFAULT_RETENTION_S,
)
from strata.coordinator.store import SqliteStore
from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata import convert
from strata.errors import (
    DiskFull, DuplicateAgent, InfeasibleError, InvalidTransition, NotFoundError, NotYours,
    QuotaExceeded, SpecError, StrataError, UnknownAgentSession, UploadError, UserCodeRefused,
)
from strata.coordinator.blobs import (
    DEFAULT_BLOB_GRACE_S, DEFAULT_MAX_JOB_OUTPUTS_BYTES, DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_USER_QUOTA_BYTES, MAX_OUTPUT_FILE_BYTES, check_sha,
)
from strata.coordinator.disk import DEFAULT_RESERVE_BYTES, is_full
from strata.coordinator.logs import DEFAULT_MAX_JOB_LOG_BYTES
from strata.types import Job, JobState, TaskReport, WorkerState

log = logging.getLogger("strata.coordinator")

# Requests larger than this are refused by gRPC before they reach a handler (a keras_json of a
# large model is a few hundred KiB; logs arrive in chunks of at most 1 MiB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: Trailing metadata key that carries a SpecError's field, so clients get it as data.
FIELD_METADATA_KEY = "strata-field"
#: trailing metadata that says why a call was refused where the code alone does not
REASON_METADATA_KEY = "strata-reason"


class PermissionDenied(StrataError):
    """The caller's token does not allow this (another owner's job)."""


class MalformedRequest(StrataError):
    """A message that parses but carries values no Strata client sends (e.g. unknown enums)."""


class NotConfigured(StrataError):
    """The call needs something this coordinator was not started with (authentication)."""


# The one table from domain errors to gRPC status codes (most specific first).
STATUS_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (SpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (MalformedRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (UploadError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (InfeasibleError, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidTransition, grpc.StatusCode.FAILED_PRECONDITION),
    (UserCodeRefused, grpc.StatusCode.FAILED_PRECONDITION),
    (UnknownAgentSession, grpc.StatusCode.FAILED_PRECONDITION),
    (DuplicateAgent, grpc.StatusCode.ALREADY_EXISTS),
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (NotYours, grpc.StatusCode.PERMISSION_DENIED),
    (QuotaExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DiskFull, grpc.StatusCode.UNAVAILABLE),
    (NotConfigured, grpc.StatusCode.FAILED_PRECONDITION),
    (StrataError, grpc.StatusCode.INTERNAL),
)


def status_for(err: Exception) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an error raised by a handler. A write that found the disk full,
    wherever it was, is UNAVAILABLE (``DiskFull``), never INTERNAL."""
    if is_full(err):
        err = DiskFull("the coordinator's disk is full: free room on the file system of its "
                       "--state-dir")
    for cls, code in STATUS_CODES:
        if isinstance(err, cls):
            return code, str(err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}"


async def _abort(context: grpc.aio.ServicerContext, err: Exception) -> NoReturn:
    code, message = status_for(err)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error", exc_info=err)
    if isinstance(err, SpecError):
        context.set_trailing_metadata(((FIELD_METADATA_KEY, err.field),))
    elif isinstance(err, DiskFull) or is_full(err):
        # UNAVAILABLE that is not "unreachable": clients say it as it is and do not retry
        context.set_trailing_metadata(((REASON_METADATA_KEY, "disk-full"),))
    await context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort raises


F = TypeVar("F", bound=Callable[..., Any])

#: the caller of the RPC being handled (``strata.auth``; None when authentication is off)
CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("caller", default=None)
#: the RPC being handled came through the probe's socket (``CallProbe``)
PROBED: contextvars.ContextVar[bool] = contextvars.ContextVar("probed", default=False)


def _peer_certificate(context: Any) -> bytes | None:
    """The caller's client certificate, PEM (mutual TLS), else None."""
    try:
        pems = context.auth_context().get("x509_pem_cert") or ()
    except Exception:  # noqa: BLE001 - no auth context on a plain-text channel
        return None
    return pems[0] if pems else None


async def _authorize(self: Any, name: str, request: Any, context: Any) -> None:
    """The check of every RPC (``strata.auth``): who calls (its token, or without tokens under
    mutual TLS its certificate), and whether that role may call ``name`` (agents: only as the
    agent they are)."""
    if context.peer().startswith("unix:"):  # the coordinator's own probe (``CallProbe``)
        PROBED.set(True)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            "this socket serves the coordinator's own probe only")
    auth: Auth | None = getattr(self, "auth", None)
    if auth is None or not auth.enabled:
        CALLER.set(None)
        return
    try:
        caller = (auth.caller(context.invocation_metadata()) if auth.tokens
                  else auth.certificate(_peer_certificate(context)))
        agent = getattr(request, "name", None) if name in CLUSTER else None
        auth.check(caller, name, agent if isinstance(agent, str) else None)
    except Denied as e:
        await context.abort(e.code, e.message)
    CALLER.set(caller)


def owned(job_owner: str) -> None:
    """Refuses a call on another owner's job (cancel, logs, download) unless by an admin."""
    caller = CALLER.get()
    if caller is not None and not caller.owns(job_owner):
        raise PermissionDenied(f"{caller.name} ({caller.role}) does not own this job")


def _checked(self: Any, name: str, request: Any, context: Any) -> Any:
    """The request, once it decoded and every field is within its bounds
    (``coordinator.bounds``); a client-streaming request is checked message by message, and
    an agent's token is checked against the agent name of each."""
    if isinstance(request, Undecodable):
        raise MalformedRequest(f"{name}: the request ({request.size} bytes) does not decode "
                               f"as a {request.message} message")
    if isinstance(request, Message):
        check_request(request)
        return request

    async def messages() -> AsyncIterator[Any]:
        async for msg in request:
            yield _checked_message(self, name, msg, context)
    return messages()


def _checked_message(self: Any, name: str, msg: Any, context: Any) -> Any:
    """One message of a client stream, checked as a unary request is, and its agent name
    against the caller's token (or client certificate)."""
    if isinstance(msg, Undecodable):
        raise MalformedRequest(f"{name}: a message of the stream ({msg.size} bytes) "
                               "does not decode")
    check_request(msg)
    auth: Auth | None = getattr(self, "auth", None)
    agent = getattr(msg, "name", None)
    if auth is not None and auth.enabled and name in CLUSTER and isinstance(agent, str):
        try:
            auth.check(CALLER.get(), name, agent)
        except Denied as e:
            raise PermissionDenied(e.message) from None
        calls: OpenCalls | None = getattr(self, "calls", None)
        if calls is not None:
            calls.acting_as(agent)
    return msg


class OpenCalls:
    """The calls in flight, by the credential that made them, so that revoking a credential
    ends its calls at once: a stream open for hours (heartbeats, commands, a followed log)
    is closed with PERMISSION_DENIED the moment its credential goes, as a new call is
    refused. Each call is its handler's asyncio task; revoking cancels the task, and the
    handler's wrapper (``rpc``) turns that cancellation into the refusal."""

    def __init__(self) -> None:
        #: each call's credential, and the agent it acts as (cluster API; "" until known)
        self._calls: dict[asyncio.Task[Any], tuple[Caller, str]] = {}
        self._revoked: dict[asyncio.Task[Any], str] = {}

    def enter(self, caller: Caller | None, agent: str = "") -> asyncio.Task[Any] | None:
        task = asyncio.current_task() if caller is not None else None
        if task is not None and caller is not None:
            self._calls[task] = (caller, agent)
        return task

    def acting_as(self, agent: str) -> None:
        """The current call acts as agent ``agent`` (a stream's messages name it)."""
        task = asyncio.current_task()
        entry = self._calls.get(task) if task is not None else None
        if entry is not None and entry[1] != agent:
            self._calls[task] = (entry[0], agent)  # type: ignore[index]

    def leave(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._calls.pop(task, None)
            self._revoked.pop(task, None)

    def __len__(self) -> int:
        return len(self._calls)

    def revoke(self, match: Callable[[Caller, str], bool], why: str) -> int:
        """Ends every call whose caller (and the agent it acts as) ``match``; returns how
        many."""
        n = 0
        for task, (caller, agent) in list(self._calls.items()):
            if task not in self._revoked and match(caller, agent):
                self._revoked[task] = f"the credentials of {caller.name} were revoked ({why})"
                task.cancel()
                n += 1
        return n

    async def refuse_if_revoked(self, task: asyncio.Task[Any] | None, context: Any) -> None:
        """Called on a handler's cancellation: a revoked call answers PERMISSION_DENIED (its
        cancellation was ours, and is taken back); any other passes on."""
        why = self._revoked.get(task) if task is not None else None
        if why is None:
            return
        uncancel = getattr(task, "uncancel", None)  # (Python 3.11+)
        if uncancel is not None:
            uncancel()
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)


def _enter(self: Any, request: Any) -> tuple[OpenCalls | None, asyncio.Task[Any] | None]:
    calls: OpenCalls | None = getattr(self, "calls", None)
    agent = getattr(request, "name", "") if isinstance(request, Message) else ""
    return calls, calls.enter(CALLER.get(), agent if isinstance(agent, str) else "") \
        if calls is not None else None


def rpc(method: F) -> F:
    """Applies the token check, the request's bounds and the error table to a handler: unary
    (a coroutine) or server streaming (an async generator). A bidirectional handler written
    with ``context.read()``/``write()`` is a coroutine too, and checks each message it reads
    with ``_checked_message``. ``context.abort``'s own exception
    (and cancellation, a BaseException) passes through untouched, but for a call whose
    credential was revoked (``OpenCalls``), which ends PERMISSION_DENIED."""
    name = method.__name__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
            start = time.perf_counter()
            calls = task = None
            try:
                await _authorize(self, name, request, context)
                calls, task = _enter(self, request if name in CLUSTER else None)
                try:
                    request = _checked(self, name, request, context)
                    async for item in method(self, request, context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except asyncio.CancelledError:
                    if calls is not None:
                        await calls.refuse_if_revoked(task, context)
                    raise
                except Exception as e:  # noqa: BLE001 - mapped to a status code
                    await _abort(context, e)
            finally:
                if calls is not None:
                    calls.leave(task)
                _observe(name, start, context)
        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    async def unary(self: Any, request: Any, context: Any) -> Any:
        start = time.perf_counter()
        calls = task = None
        try:
            await _authorize(self, name, request, context)
            calls, task = _enter(self, request if name in CLUSTER else None)
            try:
                request = _checked(self, name, request, context)
                return await method(self, request, context)
            except grpc.aio.AbortError:
                raise
            except asyncio.CancelledError:
                if calls is not None:
                    await calls.refuse_if_revoked(task, context)
                raise
            except Exception as e:  # noqa: BLE001 - mapped to a status code
                await _abort(context, e)
        finally:
            if calls is not None:
                calls.leave(task)
            _observe(name, start, context)
    return unary  # type: ignore[return-value]


def _observe(method: str, start: float, context: Any) -> None:
    """The call's latency, by method and status code (``/metrics``); not the probe's."""
    if PROBED.get():
        return
    try:
        code = context.code()
    except Exception:  # noqa: BLE001 - a context without one
        code = None
    label = code.name if isinstance(code, grpc.StatusCode) else "OK"
    RPC_SECONDS.labels(method, label).observe(time.perf_counter() - start)


#: the longest a job may wait for workers the cluster has not had (``--queue-for-capacity``)
MAX_CAPACITY_WAIT_S = 30 * 86400.0
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
T = TypeVar("T")


def page(items: list[T], key: Callable[[T], tuple[Any, ...]], size: int,
         token: str) -> tuple[list[T], str]:
    """One page of ``items`` (sorted by ``key``) after the one ``token`` ended, and the token
    of the next page ("" after the last). A token is the key of the last item it returned, so
    pages stay right while items come and go between calls."""
    if not 0 <= size <= MAX_PAGE_SIZE:
        raise SpecError("page_size", f"must be 0-{MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE}), "
                                     f"got {size}")
    size = size or DEFAULT_PAGE_SIZE
    start = 0
    if token:
        after = _decode_token(token, key(items[0]) if items else None)
        if after is not None:
            start = bisect.bisect_right([key(i) for i in items], after)
    chosen = items[start:start + size]
    more = start + size < len(items)
    return chosen, _encode_token(key(chosen[-1])) if more and chosen else ""


def _encode_token(key: tuple[Any, ...]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def _decode_token(token: str, like: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    bad = SpecError("page_token", "is not a token this coordinator gave (send back "
                                  "next_page_token as it came)")
    if len(token) > 1024:
        raise bad
    try:
        key = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, UnicodeError):
        raise bad from None
    if not isinstance(key, list) or not key or not all(isinstance(k, (str, int, float))
                                                      and not isinstance(k, bool) for k in key):
        raise bad
    if like is not None and (len(key) != len(like) or any(
            isinstance(a, str) != isinstance(b, str) for a, b in zip(key, like))):
        raise bad
    return tuple(key)


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


class Revocations:
    """Revoking credentials, at once: the calls they have open end (``OpenCalls``) and the
    agents registered with them are LOST, their tasks restarted elsewhere as a lost agent's
    are. By key (a token removed from ``--auth-tokens``, SIGHUP) or by NAME (``strata admin
    revoke``, every token and certificate of the name, kept in the store across restarts)."""

    def __init__(self, auth: Auth, calls: OpenCalls, coord: Coordinator):
        self.auth, self.calls, self.coord = auth, calls, coord
        auth.set_revoked(coord.store.load_revoked())

    def _close(self, match: Callable[[Caller, str], bool], why: str) -> tuple[int, list[str]]:
        closed = self.calls.revoke(match, why)
        lost = self.coord.revoke_agents(match, why)
        if closed or lost:
            log.warning("revoked (%s): %d open call(s) closed, agent(s) lost: %s", why, closed,
                        ", ".join(lost) or "none")
        return closed, lost

    def keys(self, keys: set[str], why: str) -> tuple[int, list[str]]:
        return self._close(lambda c, _agent: c.key in keys, why) if keys else (0, [])

    def name(self, name: str) -> tuple[int, list[str]]:
        self.coord.store.put_revoked(name, self.coord.clock())
        self.auth.revoked.add(name)
        # the name's own credentials, and whatever acts as the agent of that name (a
        # cluster-wide agent certificate acting as it)
        return self._close(lambda c, agent: c.name == name or agent == name,
                           "strata admin revoke")

    def restore(self, name: str) -> None:
        self.coord.store.delete_revoked(name)
        self.auth.revoked.discard(name)


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
        return convert.worker_to_proto(self.coord.drain(request.name))

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
                _checked_message(self, "Heartbeats", request, context)))

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
        self.coord.drain(request.name)
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


def add_service(servicer: Any, service: str, server: grpc.aio.Server) -> None:
    """Registers ``servicer`` as the protocol's ``service``, as the generated
    ``add_*Servicer_to_server`` does, but with deserializers that hand bytes which do not
    decode to the handler (``Undecodable``), which refuses them with INVALID_ARGUMENT."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for m in desc.methods:
        factory = factories[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = factory(
            getattr(servicer, m.name),
            request_deserializer=Undecodable.deserializer(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(desc.full_name,
                                                                          handlers),))


#: new calls that may wait to be matched with a handler before gRPC starts refusing some (at
#: random, all beyond twice this): above the 5,000 agents this coordinator is measured with
MAX_PENDING_CALLS = 10_000


def server_options() -> list[tuple[str, int]]:
    """The coordinator's gRPC server options (``bench/echo_coordinator.py`` uses them too)."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        # gRPC refuses new calls at random (CANCELLED, at once) once more than 1,000 wait to
        # be matched with a handler: a cluster's agents registering at once (a restart) then
        # had their heartbeat streams refused too, for longer than the timeout. They queue
        # now, and the probe counts refusals beyond these limits as waiting (``CallProbe``).
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
    ]


#: how often the coordinator times a call to its own server (``CallProbe``)
PROBE_INTERVAL_S = 0.5
#: a probe call's own limit; the wait counts on as its age meanwhile (``agents.CallWait``)
PROBE_TIMEOUT_S = 300.0


#: a probe call that ended so was not served: refused by a server with too many calls waiting
#: (CANCELLED, RESOURCE_EXHAUSTED), or past its own time limit
REFUSED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.DEADLINE_EXCEEDED)


class CallProbe:
    """Opens a ``Heartbeats`` stream to this coordinator's own server every
    ``PROBE_INTERVAL_S``, one at a time, and times its answer into ``wait``
    (``agents.CallWait``): how long an agent whose stream broke waits to be heard, so that
    agents are not judged lost while their calls wait in the queue. A try refused (the
    server sheds calls) is tried again every interval, and the wait counts from the first.

    The method matters: gRPC queues new calls, and refuses them past its limits, method by
    method, so a health check went through at once while heartbeat streams were refused.
    The call goes through a Unix socket the same server also listens on (same queues, same
    event loop), so it needs no credentials under TLS. Every call of the job and cluster
    APIs through that socket is refused before its handler runs (``_authorize``), and that
    refusal is the probe's answer; the socket lies in a directory only this user may enter
    (``mkdtemp``). A blocking stub on its own thread: the time it measures is not the
    coordinator's loop measuring itself."""

    def __init__(self, server: grpc.aio.Server, wait: CallWait):
        self.wait = wait
        self._dir = self.path = ""
        self.bound = False
        try:
            self._dir = tempfile.mkdtemp(prefix="strata-probe-")
            self.path = os.path.join(self._dir, "probe.sock")
            # (a socket's path is at most 107 bytes)
            self.bound = len(self.path) < 100 and \
                server.add_insecure_port("unix:" + self.path) != 0
        except (OSError, RuntimeError):
            pass
        if not self.bound:
            log.warning("cannot listen on a Unix socket in %s: calls waiting in the queue "
                        "are not measured, only heartbeats that were handled",
                        self._dir or tempfile.gettempdir())
        self._stop = threading.Event()
        self._channel: grpc.Channel | None = None
        self._thread = threading.Thread(target=self._run, name="strata-call-probe", daemon=True)

    def start(self) -> None:
        if self.bound:
            self._channel = grpc.insecure_channel("unix:" + self.path)
            self._thread.start()

    def _run(self) -> None:
        assert self._channel is not None
        stub = pb_grpc.ClusterServiceStub(self._channel)  # type: ignore[no-untyped-call]
        while not self._stop.is_set():
            self.wait.sent(time.monotonic())
            try:
                next(stub.Heartbeats(iter([pb.HeartbeatRequest()]), timeout=PROBE_TIMEOUT_S))
                self.wait.answered(time.monotonic())
            except grpc.RpcError as e:
                if e.code() in REFUSED:  # the wait runs on from the first try until one is
                    self.wait.refused(time.monotonic())
                elif e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.wait.dropped()  # no server to measure (stopping)
                else:  # answered: PERMISSION_DENIED (``_authorize``), UNIMPLEMENTED (tests)
                    self.wait.answered(time.monotonic())
            except StopIteration:  # a stream ended without an answer: it was handled
                self.wait.answered(time.monotonic())
            self._stop.wait(PROBE_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()
        if self._channel is not None:
            self._channel.close()  # ends a call in flight
            self._thread.join(timeout=5.0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


#: how often ``watch_loop`` sets its timer
LOOP_WATCH_INTERVAL_S = 0.05


async def watch_loop() -> None:
    """Times the event loop's own lateness into ``strata_event_loop_late_seconds``: a timer
    set every ``LOOP_WATCH_INTERVAL_S`` runs late by as long as the callbacks ready before
    it took (gRPC's reads and writes, handlers, ticks). A due timer runs ahead of the
    completions gRPC still holds, so on a busy loop calls wait longer than this shows:
    ``strata_heartbeat_delay_seconds`` is the heartbeats' own view (docs/benchmarks-log.md,
    "The heartbeat tail, measured leg by leg"). Costs 20 wake-ups a second."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(LOOP_WATCH_INTERVAL_S)
        LOOP_LATE_SECONDS.observe(max(0.0, loop.time() - t - LOOP_WATCH_INTERVAL_S))


async def serve(listen: str, state_dir: str, *, heartbeat_timeout_s: float = 10.0,
                heartbeat_interval_s: float = 1.0, start_timeout_s: float = 300.0,
                ready: asyncio.Future[str] | None = None, port_file: str | None = None,
                max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
                allow_user_code: bool = False, tls_cert: str = "", tls_key: str = "",
                tls_client_ca: str = "", auth_tokens: str = "",
                max_pending_per_user: int = DEFAULT_MAX_PENDING_PER_USER,
                max_tasks_per_job: int = DEFAULT_MAX_TASKS_PER_JOB,
                retention_s: float = DEFAULT_RETENTION_S, http_listen: str = "",
                http_port_file: str | None = None,
                user_quota: int = DEFAULT_USER_QUOTA_BYTES,
                max_job_outputs: int = DEFAULT_MAX_JOB_OUTPUTS_BYTES,
                max_job_logs: int = DEFAULT_MAX_JOB_LOG_BYTES,
                disk_reserve: int = DEFAULT_RESERVE_BYTES,
                disk_ballast: int | None = None,
                blob_grace_s: float = DEFAULT_BLOB_GRACE_S) -> None:
    """Runs the coordinator until SIGINT/SIGTERM. Prints (and optionally writes) the bound
    address. With ``tls_cert``/``tls_key`` it serves TLS only; with ``tls_client_ca`` clients
    and agents must present a certificate that CA signed (``strata.tls``), and without
    ``auth_tokens`` that certificate names the caller and its role (``strata.auth``)."""
    from strata.tls import server_credentials

    credentials = server_credentials(tls_cert, tls_key, tls_client_ca) if tls_cert else None
    os.makedirs(state_dir, exist_ok=True)
    lock = _lock_state_dir(state_dir)
    store = SqliteStore(os.path.join(state_dir, "strata.db"))
    coord = Coordinator(store, state_dir, heartbeat_timeout_s=heartbeat_timeout_s,
                        heartbeat_interval_s=heartbeat_interval_s, start_timeout_s=start_timeout_s,
                        max_upload_bytes=max_upload_bytes, allow_user_code=allow_user_code,
                        max_pending_per_user=max_pending_per_user,
                        max_tasks_per_job=max_tasks_per_job, retention_s=retention_s,
                        user_quota=user_quota, max_job_outputs=max_job_outputs,
                        max_job_logs=max_job_logs, disk_reserve=disk_reserve,
                        disk_ballast=disk_ballast, blob_grace_s=blob_grace_s)
    server = grpc.aio.server(options=server_options())
    auth = Auth(auth_tokens or None, certificates=bool(tls_client_ca))
    if auth.certificates:
        log.info("mutual TLS without --auth-tokens: each caller is the common name of its "
                 "certificate, with the role its organizational unit names (strata certs "
                 "--client NAME:ROLE); a certificate without a role may call nothing")
    calls = OpenCalls()
    revocations = Revocations(auth, calls, coord)
    add_service(JobServicer(coord, auth, calls, revocations), "JobService", server)
    add_service(ClusterServicer(coord, auth, calls), "ClusterService", server)
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
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError:
        port = 0
    if port == 0:
        raise SystemExit(f"--listen {listen}: cannot bind that address")
    host = listen.rsplit(":", 1)[0]
    address = f"{host}:{port}"
    # after the state is loaded (the live jobs are frozen with the modules), before serving
    gc_policy = GcPolicy()
    gc_policy.start()
    probe = CallProbe(server, coord.call_wait)
    await server.start()
    probe.start()
    for name in services[:2] + ("",):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    how = ("mutual TLS" if tls_client_ca else "TLS") if credentials is not None else "plain text"
    print(f"strata coordinator listening on {address}, {how} (state in "
          f"{os.path.abspath(state_dir)})", flush=True)
    http = None
    if http_listen:
        from strata.coordinator import web

        try:
            http, url = await web.start(http_listen, coord, auth, tls_cert, tls_key,
                                        tls_client_ca)
        except OSError as e:
            probe.stop()
            raise SystemExit(f"--http-listen {http_listen}: cannot bind that address "
                             f"({e.strerror or e})") from None
        print(f"status page at {url}/, Prometheus metrics at {url}/metrics", flush=True)
        if http_port_file:
            with open(http_port_file + ".tmp", "w") as f:
                f.write(url)
            os.replace(http_port_file + ".tmp", http_port_file)
    # The signals are handled before the address is announced: whoever reads the port file
    # may send SIGHUP at once (new tokens), and SIGHUP's default ends the process.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)

    def reload_tokens() -> None:
        try:
            gone = auth.reload()
        except AuthFileError as e:
            log.error("SIGHUP: kept the tokens in force: %s", e)
            return
        log.info("SIGHUP: %d token(s) from %s, %d gone", len(auth), auth.path, len(gone))
        revocations.keys(gone, "removed from --auth-tokens")
    if auth.tokens:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, reload_tokens)
    if port_file:
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(address)
        os.replace(tmp, port_file)
    loop_task = asyncio.create_task(coord.run())
    gc_task = asyncio.create_task(gc_policy.run())
    watch_task = asyncio.create_task(watch_loop())
    if ready is not None:
        ready.set_result(address)
    await stop.wait()
    log.info("stopping")
    await health_servicer.enter_graceful_shutdown()
    if http is not None:
        http.close()
    coord.stop()
    probe.stop()
    await server.stop(grace=2.0)
    for task in (loop_task, gc_task, watch_task):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    gc_policy.close()
    store.close()
    lock.close()


def _lock_state_dir(state_dir: str) -> IO[str]:
    """One coordinator per state directory: a second one would corrupt the job history."""
    import fcntl

    f = open(os.path.join(state_dir, "coordinator.lock"), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise SystemExit(f"--state-dir {state_dir}: another coordinator is using it") from None
    return f
