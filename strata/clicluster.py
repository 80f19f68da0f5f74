"""The ``strata`` commands that run and administer a cluster: coordinator, worker, certs, up
and demo (a local cluster), health, workers, drain and admin."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any

from strata import cpukernels
from strata.limits import MAX_NOTICE_S
from strata.queues import UNBOUNDED
from strata.clicommon import (
    EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, UsageError, _address, _check_job, _client,
    _client_tls, _duration, _fmt_bytes, _print_json, _size, _table, _token,
)
from strata.clijobs import _follow, _print_status


DEMO_SPEC: dict[str, Any] = {
    "name": "digits-mlp",
    "workers": 2,
    "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256], "classes": 10}},
    "data": {"source": "digits", "batch_size": 256},
    "training": {"epochs": 20, "optimizer": {"name": "adam", "learning_rate": 0.001},
                 "loss": "sparse_categorical_crossentropy"},
}


def cmd_coordinator(args: argparse.Namespace) -> int:
    import asyncio

    from strata.coordinator.service import serve

    _address("--listen", args.listen, allow_port_zero=True)
    if args.heartbeat_timeout <= 0:
        raise UsageError("--heartbeat-timeout must be positive")
    if args.start_timeout <= 0:
        raise UsageError("--start-timeout must be positive")
    max_upload = _size("--max-upload", args.max_upload)
    retention = _duration("--retention", args.retention)
    storage = {"user_quota": _size("--user-quota", args.user_quota, zero=True),
               "max_job_outputs": _size("--max-job-outputs", args.max_job_outputs),
               "max_job_logs": _size("--max-job-logs", args.max_job_logs),
               "disk_reserve": _size("--disk-reserve", args.disk_reserve, zero=True),
               "blob_grace_s": _duration("--upload-grace", args.upload_grace)}
    from strata.tls import TlsError, check_listen, server_credentials

    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    for flag in ("max_pending_per_user", "max_tasks_per_job"):
        if not 1 <= getattr(args, flag) <= 1_000_000:
            raise UsageError(f"--{flag.replace('_', '-')}: 1 to 1000000, got {getattr(args, flag)}")
    if args.tls_client_ca and not args.tls_cert:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
    if args.http_listen:
        _address("--http-listen", args.http_listen, allow_port_zero=True)
    try:
        check_listen(args.listen, bool(args.tls_cert), args.insecure)
        if args.http_listen:
            check_listen(args.http_listen, bool(args.tls_cert), args.insecure)
        if args.tls_cert:
            server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)  # readable
    except TlsError as e:
        raise UsageError(str(e)) from None
    if args.auth_tokens:
        from strata.auth import Auth, AuthFileError

        try:
            Auth(args.auth_tokens)  # readable and well formed, before listening
        except AuthFileError as e:
            raise UsageError(str(e)) from None
    if args.queues:
        from strata.queues import QueueError, load_queues

        try:
            load_queues(args.queues)  # readable and well formed, before listening
        except QueueError as e:
            raise UsageError(f"--queues: {e}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.listen, args.state_dir, heartbeat_timeout_s=args.heartbeat_timeout,
                      start_timeout_s=args.start_timeout, port_file=args.port_file,
                      max_upload_bytes=max_upload, allow_user_code=args.allow_user_code,
                      tls_cert=args.tls_cert, tls_key=args.tls_key,
                      tls_client_ca=args.tls_client_ca, auth_tokens=args.auth_tokens,
                      max_pending_per_user=args.max_pending_per_user,
                      max_tasks_per_job=args.max_tasks_per_job, retention_s=retention,
                      http_listen=args.http_listen, http_port_file=args.http_port_file,
                      queues=args.queues, **storage))
    return EXIT_OK


def cmd_worker(args: argparse.Namespace) -> int:
    from strata.worker.agent import AgentConfig, main

    budget = _size("--memory-budget", args.memory_budget)
    device = args.device.upper()
    if device != "CPU" and not (device.startswith("GPU:") and device[4:].isdigit()):
        raise UsageError(f"--device {args.device!r}: expected CPU or GPU:N")
    if args.threads < 0:
        raise UsageError("--threads must be >= 0")
    if not 0 <= args.warm_pool <= 16:
        raise UsageError(f"--warm-pool {args.warm_pool}: 0 to 16")
    notice_s = _duration("--notice", args.notice)
    if not 5 <= notice_s <= MAX_NOTICE_S:
        raise UsageError(f"--notice {args.notice}: 5s to {MAX_NOTICE_S:g}s")
    try:
        kernels = cpukernels.parse(args.cpu_kernels)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if device != "CPU":
        kernels = ""  # a GPU's kernels are its own: the estimates do not depend on these
    elif not kernels:
        kernels = cpukernels.detect()
    name = args.name or f"{socket.gethostname()}-{device.lower().replace(':', '')}"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.shared_dir and not os.path.isdir(args.shared_dir):
        raise UsageError(f"--shared-dir {args.shared_dir!r} is not a directory (it must exist "
                         "and be the same storage, at the same path, on every worker)")
    if args.shared_dir and not os.access(args.shared_dir, os.W_OK | os.X_OK):
        raise UsageError(f"--shared-dir {args.shared_dir!r} is not writable by this user: "
                         "tasks write their checkpoints and outputs there")
    roots = []
    for r in args.data_root:
        if not os.path.isdir(r):
            raise UsageError(f"--data-root {r!r} is not a directory")
        roots.append(os.path.realpath(r))
    if not roots:
        logging.getLogger("strata.worker").warning(
            "no --data-root: jobs may read data.path anywhere this user can read; give "
            "--data-root DIR on a cluster shared by several users")
    return main(AgentConfig(coordinator=_address("--coordinator", args.coordinator), name=name,
                            budget_bytes=budget, device=device, work_dir=args.work_dir,
                            host=args.advertise_host, threads=args.threads,
                            tls=_client_tls(args), token=_token(args),
                            shared_dir=os.path.abspath(args.shared_dir) if args.shared_dir
                            else "", data_roots=tuple(roots), warm_pool=args.warm_pool,
                            cpu_kernels=kernels, notice_s=notice_s))


def cmd_certs(args: argparse.Namespace) -> int:
    from strata.tls import DEFAULT_CLIENTS, TlsError, make_cluster_certs, parse_client

    if os.path.exists(os.path.join(args.out, "ca.key")) and not args.force:
        raise UsageError(f"--out {args.out} already holds a CA (ca.key); --force replaces it, "
                         "and every certificate it signed stops being trusted")
    clients = args.client or list(DEFAULT_CLIENTS)
    try:
        named = [parse_client(c) for c in clients]
    except TlsError as e:
        raise UsageError(str(e)) from None
    paths = make_cluster_certs(args.out, args.host, clients=clients)
    print(f"certificates in {os.path.abspath(args.out)}:")
    for name, role in [("ca", ""), ("server", ""), *named]:
        print(f"  {name}: {paths[name]}" + (f" (role {role})" if role else ""))
    print("coordinator: --tls-cert server.crt --tls-key server.key "
          "[--tls-client-ca ca.crt for mutual TLS]")
    print("agents and clients: --tls-ca ca.crt [--tls-cert NAME.crt --tls-key NAME.key] "
          "(or STRATA_TLS_CA, STRATA_TLS_CERT, STRATA_TLS_KEY); keep ca.key offline")
    return EXIT_OK


def _start_local(args: argparse.Namespace, workers: int, budget: str, quiet: bool):
    from strata.local import LocalCluster

    _size("--memory-budget", budget)
    if workers < 1:
        raise UsageError("--workers must be >= 1")
    from strata.tls import is_loopback

    listen = _address("--listen", args.listen, allow_port_zero=True)
    # reachable from other hosts: mutual TLS with certificates made for this cluster
    tls = not is_loopback(listen.rsplit(":", 1)[0])
    return LocalCluster(workers=workers, memory_budget=budget, state_dir=args.state_dir,
                        listen=listen, quiet=quiet, shared_dir=getattr(args, "shared_dir", None),
                        tls=tls, data_roots=getattr(args, "data_root", []),
                        http_listen=getattr(args, "http_listen", ""),
                        warm_pool=getattr(args, "warm_pool", 0)).start()


def _catch_stop_signals() -> dict:
    """SIGINT/SIGTERM set a flag (installed before any child starts, so none can leak)."""
    stop = {"flag": False}

    def handler(signum, frame):  # noqa: ARG001
        stop["flag"] = True

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    return stop


def cmd_up(args: argparse.Namespace) -> int:
    stop = _catch_stop_signals()
    cluster = _start_local(args, args.workers, args.memory_budget, quiet=True)
    try:
        print(f"strata cluster up: coordinator {cluster.address}, {args.workers} workers with "
              f"{args.memory_budget} each (state in {cluster.state_dir})", flush=True)
        print(f"export STRATA_COORDINATOR={cluster.address}", flush=True)
        if cluster.http_url:
            print(f"status page at {cluster.http_url}/, metrics at {cluster.http_url}/metrics",
                  flush=True)
        if cluster.tls_paths:
            p = cluster.tls_paths
            print(f"export STRATA_TLS_CA={p['ca']} STRATA_TLS_CERT={p['client']} "
                  f"STRATA_TLS_KEY={p['client_key']}", flush=True)
            token_file = os.path.join(os.path.dirname(cluster.tokens_file), "admin.token")
            print(f"export STRATA_TOKEN=$(cat {token_file})", flush=True)
        while not stop["flag"]:
            time.sleep(0.2)
    finally:
        print("stopping the cluster", flush=True)
        cluster.stop()
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    _check_job(DEMO_SPEC, args.set)  # a bad --set is refused before a cluster starts
    made = args.state_dir is None  # a directory of its own: removed when the demo ends
    if made:
        args.state_dir = tempfile.mkdtemp(prefix="strata-demo-")
    print("starting a local cluster: a coordinator and 2 worker agents ...", flush=True)
    cluster = _start_local(args, 2, args.memory_budget, quiet=True)
    try:
        from strata.client import Client

        with Client(cluster.address) as c:
            print(f"coordinator at {cluster.address}; workers: "
                  + ", ".join(f"{w.name} ({_fmt_bytes(w.memory.budget_bytes)})" for w in c.workers()))
            job = c.submit(DEMO_SPEC, overrides=args.set)
            print(f"submitted {job.id}: {len(job.tasks)}-worker multi_worker_mirrored MLP "
                  f"1024-512-256 on the digits data", flush=True)
            final = _follow(c, job.id)
            _print_status(final)
            acc = final.metrics.test_accuracy
            if final.state.value == "SUCCEEDED" and acc is not None:
                print(f"\ndemo: final test accuracy {acc:.4f}")
                return EXIT_OK
            print(f"\ndemo: job ended {final.state.value}: {final.message}")
            return EXIT_FAILED
    finally:
        cluster.stop()
        if made:
            shutil.rmtree(args.state_dir, ignore_errors=True)


def cmd_health(args: argparse.Namespace) -> int:
    """A probe for containers and service managers: the coordinator's gRPC health service, or
    (``--heartbeat-file``) how long ago an agent's last heartbeat was accepted."""
    if args.heartbeat_file:
        try:
            age = time.time() - os.path.getmtime(args.heartbeat_file)
        except OSError:
            print(f"{args.heartbeat_file}: no heartbeat yet", file=sys.stderr)
            return EXIT_FAILED
        if age > args.max_age:
            print(f"last heartbeat {age:.0f} s ago (more than {args.max_age:g})", file=sys.stderr)
            return EXIT_FAILED
        print(f"last heartbeat {age:.1f} s ago")
        return EXIT_OK
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from strata.auth import with_token
    from strata.client import default_address
    from strata.tls import channel

    address = _address("--coordinator", args.coordinator or default_address())
    ch = channel(address, _client_tls(args))
    try:
        token = _token(args)
        stub = health_pb2_grpc.HealthStub(with_token(ch, token) if token else ch)
        status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=args.max_age)
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name} {e.details() or ''}".rstrip(), file=sys.stderr)
        return EXIT_UNAVAILABLE
    finally:
        ch.close()
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)
    print(f"{address}: {name}")
    return EXIT_OK if status.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILED


def cmd_workers(args: argparse.Namespace) -> int:
    from strata.types import worker_to_json

    with _client(args) as c:
        workers = c.workers(states=args.state)
        if args.json:
            _print_json([worker_to_json(w) for w in workers])
            return EXIT_OK
        disk = c.state_disk()
    if not workers:
        print("no workers")
    else:
        rows = [[w.name, w.address, w.device + (f" ({w.cpu_kernels})" if w.cpu_kernels else ""),
                 w.state.value, _fmt_bytes(w.memory.budget_bytes),
                 _fmt_bytes(w.memory.reserved_bytes), _fmt_bytes(w.memory.in_use_bytes),
                 _fmt_bytes(w.memory.peak_bytes), _fmt_disk(w.disk),
                 ",".join(f"{t.job_id}/{t.role}:{t.index}" for t in w.tasks) or "-"]
                for w in workers]
        _table(rows, ["NAME", "ADDRESS", "DEVICE", "STATE", "BUDGET", "RESERVED", "IN USE",
                      "PEAK", "DISK USED/FREE", "TASKS"])
    if disk.disk.total_bytes:
        print(f"coordinator state: {_fmt_bytes(disk.disk.used_bytes)} used (uploads "
              f"{_fmt_bytes(disk.blobs_bytes)}, outputs {_fmt_bytes(disk.outputs_bytes)}, logs "
              f"{_fmt_bytes(disk.logs_bytes)}), {_fmt_bytes(disk.disk.free_bytes)} free "
              f"({_fmt_bytes(disk.reserve_bytes)} of it kept for state changes)")
    return EXIT_OK


def cmd_queues(args: argparse.Namespace) -> int:
    with _client(args) as c:
        queues = c.queues()
    if args.json:
        _print_json([q.to_json() for q in queues])
        return EXIT_OK

    def share(s) -> str:
        w = "-" if s.workers >= UNBOUNDED else str(s.workers)
        m = "-" if s.memory_bytes >= UNBOUNDED else _fmt_bytes(s.memory_bytes)
        return f"{w} / {m}"
    rows = [[q.name + (" (default)" if q.default else ""), share(q.nominal), share(q.borrow),
             share(q.in_use), str(max(0, q.in_use.workers - q.nominal.workers)),
             str(q.waiting), str(q.running)] for q in queues]
    _table(rows, ["QUEUE", "NOMINAL (WORKERS / MEMORY)", "BORROW", "IN USE", "BORROWED",
                  "WAITING", "RUNNING"])
    return EXIT_OK


def _fmt_disk(d) -> str:
    """An agent's disk: Strata's own files / what its file system has left."""
    return f"{_fmt_bytes(d.used_bytes)}/{_fmt_bytes(d.free_bytes)}" if d.total_bytes else "-"


def cmd_drain(args: argparse.Namespace) -> int:
    deadline = _duration("--deadline", args.deadline) if args.deadline else 0.0
    if args.deadline and not 1 <= deadline <= MAX_NOTICE_S:
        raise UsageError(f"--deadline {args.deadline}: 1s to {MAX_NOTICE_S:g}s")
    with _client(args) as c:
        w = c.drain(args.worker, deadline)
    moving = len(w.tasks)
    print(f"{w.name}: {w.state.value}" + (f"; {moving} task(s) moving elsewhere" if moving
                                          else ""))
    return EXIT_OK


def cmd_admin(args: argparse.Namespace) -> int:
    if args.action in ("revoke", "restore") and not args.name:
        raise UsageError(f"strata admin {args.action} NAME: which caller?")
    if args.action == "revoked" and args.name:
        raise UsageError("strata admin revoked takes no NAME")
    with _client(args) as c:
        r = c.revoke(args.name, restore=args.action == "restore")
    if args.action == "revoke":
        print(f"{args.name}: revoked; {r.streams_closed} open call(s) closed"
              + (f"; agent(s) lost, their tasks restart elsewhere: {', '.join(r.agents_lost)}"
                 if r.agents_lost else ""))
    elif args.action == "restore":
        print(f"{args.name}: restored (its credentials work again)")
    else:
        print("\n".join(r.revoked) if r.revoked else "no names revoked")
    return EXIT_OK
