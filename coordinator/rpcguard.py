"""What every RPC of the job and cluster APIs goes through (``rpc``): who calls (its token or,
under mutual TLS without tokens, its certificate) and whether that role may call the method,
the request's bounds (``coordinator.bounds``), the call's entry among the calls in flight
(``coordinator.opencalls``), and the one table from domain errors to gRPC status codes
(``status_for``). Each call's latency goes to ``/metrics``."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import logging
import time
from typing import Any, AsyncIterator, Callable, NoReturn, TypeVar

import grpc
from google.protobuf.message import Message

from strata.auth import CLUSTER, Auth, Caller, Denied
from strata.coordinator.bounds import Undecodable, check_request
from strata.coordinator.disk import is_full
from strata.coordinator.opencalls import OpenCalls
from strata.coordinator.web import RPC_SECONDS
from strata.errors import (
    DiskFull, DuplicateAgent, InfeasibleError, InvalidTransition, NotFoundError, NotYours,
    QuotaExceeded, SpecError, StrataError, UnknownAgentSession, UploadError, UserCodeRefused,
)

log = logging.getLogger("strata.coordinator")

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
#: the RPC being handled came through the probe's socket (``probe.CallProbe``)
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
    if context.peer().startswith("unix:"):  # the coordinator's own probe (``probe.CallProbe``)
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
            yield checked_message(self, name, msg, context)
    return messages()


def checked_message(self: Any, name: str, msg: Any, context: Any) -> Any:
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




def _enter(self: Any, request: Any) -> tuple[OpenCalls | None, asyncio.Task[Any] | None]:
    calls: OpenCalls | None = getattr(self, "calls", None)
    agent = getattr(request, "name", "") if isinstance(request, Message) else ""
    return calls, calls.enter(CALLER.get(), agent if isinstance(agent, str) else "") \
        if calls is not None else None


def rpc(method: F) -> F:
    """Applies the token check, the request's bounds and the error table to a handler: unary
    (a coroutine) or server streaming (an async generator). A bidirectional handler written
    with ``context.read()``/``write()`` is a coroutine too, and checks each message it reads
    with ``checked_message``. ``context.abort``'s own exception
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
