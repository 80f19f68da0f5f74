"""The coordinator's gRPC server (``serve``): the job and cluster APIs (``coordinator.jobapi``,
``coordinator.clusterapi``), grpc.health.v1.Health and server reflection, so that stock tools
(grpcurl, grpc_health_probe) can list and call it; bound with or without TLS, run until
SIGINT/SIGTERM (SIGHUP reloads ``--auth-tokens``), then stopped in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import IO, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from strata.auth import Auth, AuthFileError
from strata.queues import QueueError, load_queues
from strata.coordinator.blobs import (
    DEFAULT_BLOB_GRACE_S, DEFAULT_MAX_JOB_OUTPUTS_BYTES, DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_USER_QUOTA_BYTES,
)
from strata.coordinator.bounds import Undecodable
from strata.coordinator.clusterapi import ClusterServicer
from strata.coordinator.core import Coordinator
from strata.coordinator.disk import DEFAULT_RESERVE_BYTES
from strata.coordinator.gcpolicy import GcPolicy
from strata.coordinator.jobapi import JobServicer
from strata.coordinator.logs import DEFAULT_MAX_JOB_LOG_BYTES
from strata.coordinator.opencalls import OpenCalls, Revocations
from strata.coordinator.callprobe import CallProbe
from strata.coordinator.store import SqliteStore
from strata.coordinator.web import LOOP_LATE_SECONDS
from strata.limits import (
    DEFAULT_MAX_PENDING_PER_USER, DEFAULT_MAX_TASKS_PER_JOB, DEFAULT_RETENTION_S,
)
from strata.protos import strata_pb2 as pb

log = logging.getLogger("strata.coordinator")

# Requests larger than this are refused by gRPC before they reach a handler (a keras_json of a
# large model is a few hundred KiB; logs arrive in chunks of at most 1 MiB).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


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
        # now, and the probe counts refusals beyond these limits as waiting (``callprobe.CallProbe``).
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
    ]


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


#: the services this server serves, by full name: the job and cluster APIs (marked SERVING
#: once the server runs), health and reflection
SERVICES = (
    pb.DESCRIPTOR.services_by_name["JobService"].full_name,
    pb.DESCRIPTOR.services_by_name["ClusterService"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


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
                blob_grace_s: float = DEFAULT_BLOB_GRACE_S, queues: str = "") -> None:
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
                        disk_ballast=disk_ballast, blob_grace_s=blob_grace_s,
                        queues=load_queues(queues) if queues else None)
    server = grpc.aio.server(options=server_options())
    auth = _auth(auth_tokens, tls_client_ca)
    coord.queueing.groups = auth.groups()
    calls = OpenCalls()
    revocations = Revocations(auth, calls, coord)
    health_servicer = _add_services(server, coord, auth, calls, revocations)
    address = _bind(server, listen, credentials)
    # after the state is loaded (the live jobs are frozen with the modules), before serving
    gc_policy = GcPolicy()
    gc_policy.start()
    probe = CallProbe(server, coord.call_wait)
    await _start(server, probe, health_servicer)
    how = ("mutual TLS" if tls_client_ca else "TLS") if credentials is not None else "plain text"
    print(f"strata coordinator listening on {address}, {how} (state in "
          f"{os.path.abspath(state_dir)})", flush=True)
    http = None
    if http_listen:
        http = await _start_http(http_listen, http_port_file, coord, auth,
                                 (tls_cert, tls_key, tls_client_ca), probe)
    # The signals are handled before the address is announced: whoever reads the port file
    # may send SIGHUP at once (new tokens), and SIGHUP's default ends the process.
    stop = _handle_signals(auth, revocations, coord, queues)
    if port_file:
        _write_file(port_file, address)
    tasks = (asyncio.create_task(coord.run()), asyncio.create_task(gc_policy.run()),
             asyncio.create_task(watch_loop()))
    if ready is not None:
        ready.set_result(address)
    await stop.wait()
    log.info("stopping")
    await _stop(server, health_servicer, http, coord, probe, tasks)
    gc_policy.close()
    store.close()
    lock.close()


def _auth(auth_tokens: str, tls_client_ca: str) -> Auth:
    """Who may call what: the tokens of ``--auth-tokens``, else under mutual TLS the client
    certificates (``strata.auth``); neither, everyone."""
    auth = Auth(auth_tokens or None, certificates=bool(tls_client_ca))
    if auth.certificates:
        log.info("mutual TLS without --auth-tokens: each caller is the common name of its "
                 "certificate, with the role its organizational unit names (strata certs "
                 "--client NAME:ROLE); a certificate without a role may call nothing")
    return auth


def _add_services(server: grpc.aio.Server, coord: Coordinator, auth: Auth, calls: OpenCalls,
                  revocations: Revocations) -> health.aio.HealthServicer:
    """Registers every service of ``SERVICES`` on ``server``; returns the health servicer
    (nothing is SERVING until ``_start``)."""
    add_service(JobServicer(coord, auth, calls, revocations), "JobService", server)
    add_service(ClusterServicer(coord, auth, calls), "ClusterService", server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(SERVICES, server)
    return health_servicer


def _bind(server: grpc.aio.Server, listen: str,
          credentials: grpc.ServerCredentials | None) -> str:
    """Binds ``listen`` (TLS only with ``credentials``); returns the address bound ("host:port",
    the port the system chose for port 0). Exits if the address cannot be bound."""
    try:
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError:
        port = 0
    if port == 0:
        raise SystemExit(f"--listen {listen}: cannot bind that address")
    host = listen.rsplit(":", 1)[0]
    return f"{host}:{port}"


async def _start(server: grpc.aio.Server, probe: CallProbe,
                 health_servicer: health.aio.HealthServicer) -> None:
    """Starts serving, then the probe, then says SERVING for the job and cluster APIs and the
    server as a whole."""
    await server.start()
    probe.start()
    for name in SERVICES[:2] + ("",):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


async def _start_http(http_listen: str, http_port_file: str | None, coord: Coordinator,
                      auth: Auth, tls: tuple[str, str, str],
                      probe: CallProbe) -> asyncio.Server:
    """Starts the status page and ``/metrics`` (``coordinator.web``, with the TLS files
    ``(cert, key, client CA)``) and returns its server; writes its URL to ``http_port_file``.
    Exits (the probe stopped) if ``http_listen`` cannot be bound."""
    from strata.coordinator import web

    try:
        http, url = await web.start(http_listen, coord, auth, *tls)
    except OSError as e:
        probe.stop()
        raise SystemExit(f"--http-listen {http_listen}: cannot bind that address "
                         f"({e.strerror or e})") from None
    print(f"status page at {url}/, Prometheus metrics at {url}/metrics", flush=True)
    if http_port_file:
        _write_file(http_port_file, url)
    return http


def _handle_signals(auth: Auth, revocations: Revocations, coord: Coordinator,
                    queues: str) -> asyncio.Event:
    """The event SIGINT and SIGTERM set; SIGHUP reloads the tokens (and revokes those gone)
    and the queues file, each kept as it was if its file is wrong."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)

    def reload_tokens() -> None:
        try:
            gone = auth.reload()
            coord.queueing.groups = auth.groups()
        except AuthFileError as e:
            log.error("SIGHUP: kept the tokens in force: %s", e)
            return
        log.info("SIGHUP: %d token(s) from %s, %d gone", len(auth), auth.path, len(gone))
        revocations.keys(gone, "removed from --auth-tokens")

    def reload_queues() -> None:
        try:
            coord.queueing.reload(load_queues(queues))
        except QueueError as e:
            log.error("SIGHUP: kept the queues in force: %s", e)
            return
        log.info("SIGHUP: %d queue(s) from %s", len(coord.queueing.queues.queues), queues)
        coord.wake()

    def reload() -> None:
        if auth.tokens:
            reload_tokens()
        if queues:
            reload_queues()
    if auth.tokens or queues:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGHUP, reload)
    return stop


def _write_file(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` whole or not at all (a reader never sees half of it)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


async def _stop(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                http: asyncio.Server | None, coord: Coordinator, probe: CallProbe,
                tasks: tuple[asyncio.Task[Any], ...]) -> None:
    """Stops in order: NOT_SERVING, the status page, the coordinator, the probe, the server
    (2 s for calls in flight), then the background tasks."""
    await health_servicer.enter_graceful_shutdown()
    if http is not None:
        http.close()
    coord.stop()
    probe.stop()
    await server.stop(grace=2.0)
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
