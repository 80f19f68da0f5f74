"""The ``strata`` command line.

Exit codes: 0 success; 1 the job FAILED or was CANCELLED, or the command failed; 2 bad usage or a
rejected job spec (the message names the field or flag); 3 the coordinator cannot be reached;
4 no such job or task.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any, Callable

from strata.limits import DEFAULT_MAX_PENDING_PER_USER, DEFAULT_MAX_TASKS_PER_JOB

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_NOT_FOUND = 0, 1, 2, 3, 4

DEMO_SPEC: dict[str, Any] = {
    "name": "digits-mlp",
    "workers": 2,
    "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256], "classes": 10}},
    "data": {"source": "digits", "batch_size": 256},
    "training": {"epochs": 20, "optimizer": {"name": "adam", "learning_rate": 0.001},
                 "loss": "sparse_categorical_crossentropy"},
}


class UsageError(Exception):
    """A bad flag value; the message names the flag."""


def _fail(message: str, code: int) -> int:
    print(f"strata: {message}", file=sys.stderr)
    return code


def _size(flag: str, text: str) -> int:
    from strata.memory import parse_size

    try:
        value = parse_size(text)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: {e}") from None
    if value <= 0:
        raise UsageError(f"{flag} must be positive")
    return value


def _address(flag: str, text: str, allow_port_zero: bool = False) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if allow_port_zero else 1) <= int(port) <= 65535:
        raise UsageError(f"{flag} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return text


def _fmt_bytes(n: int | None) -> str:
    from strata.memory import format_size

    return format_size(n) if n else "-"


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


# --- server commands --------------------------------------------------------------------------

def cmd_coordinator(args: argparse.Namespace) -> int:
    import asyncio

    from strata.coordinator.service import serve

    _address("--listen", args.listen, allow_port_zero=True)
    if args.heartbeat_timeout <= 0:
        raise UsageError("--heartbeat-timeout must be positive")
    if args.start_timeout <= 0:
        raise UsageError("--start-timeout must be positive")
    max_upload = _size("--max-upload", args.max_upload)
    from strata.tls import TlsError, check_listen, server_credentials

    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    for flag in ("max_pending_per_user", "max_tasks_per_job"):
        if not 1 <= getattr(args, flag) <= 1_000_000:
            raise UsageError(f"--{flag.replace('_', '-')}: 1 to 1000000, got {getattr(args, flag)}")
    if args.tls_client_ca and not args.tls_cert:
        raise UsageError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
    try:
        check_listen(args.listen, bool(args.tls_cert), args.insecure)
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.listen, args.state_dir, heartbeat_timeout_s=args.heartbeat_timeout,
                      start_timeout_s=args.start_timeout, port_file=args.port_file,
                      max_upload_bytes=max_upload, allow_user_code=args.allow_user_code,
                      tls_cert=args.tls_cert, tls_key=args.tls_key,
                      tls_client_ca=args.tls_client_ca, auth_tokens=args.auth_tokens,
                      max_pending_per_user=args.max_pending_per_user,
                      max_tasks_per_job=args.max_tasks_per_job))
    return EXIT_OK


def _token(args: argparse.Namespace) -> str:
    """``--token-file``, else ``STRATA_TOKEN`` (never a token on the command line)."""
    from strata.auth import read_token

    try:
        return read_token(args.token_file)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _client_tls(args: argparse.Namespace):
    """The TLS settings of a client or agent: its flags, else ``STRATA_TLS_*``."""
    from strata.tls import ClientTls, TlsError

    tls = ClientTls.from_env(args.tls_ca, args.tls_cert, args.tls_key)
    try:
        tls.check()
    except TlsError as e:
        raise UsageError(str(e)) from None
    return tls


def cmd_certs(args: argparse.Namespace) -> int:
    from strata.tls import make_cluster_certs

    if os.path.exists(os.path.join(args.out, "ca.key")) and not args.force:
        raise UsageError(f"--out {args.out} already holds a CA (ca.key); --force replaces it, "
                         "and every certificate it signed stops being trusted")
    clients = args.client or ["agent", "client"]
    for c in clients:
        if not c.replace("-", "").replace("_", "").isalnum() or len(c) > 64:
            raise UsageError(f"--client {c[:64]!r}: letters, digits, '-' and '_' only")
    paths = make_cluster_certs(args.out, args.host, clients=clients)
    print(f"certificates in {os.path.abspath(args.out)}:")
    for name in ("ca", "server", *clients):
        print(f"  {name}: {paths[name]}")
    print("coordinator: --tls-cert server.crt --tls-key server.key "
          "[--tls-client-ca ca.crt for mutual TLS]")
    print("agents and clients: --tls-ca ca.crt [--tls-cert NAME.crt --tls-key NAME.key] "
          "(or STRATA_TLS_CA, STRATA_TLS_CERT, STRATA_TLS_KEY); keep ca.key offline")
    return EXIT_OK


def cmd_worker(args: argparse.Namespace) -> int:
    from strata.worker.agent import AgentConfig, main

    budget = _size("--memory-budget", args.memory_budget)
    device = args.device.upper()
    if device != "CPU" and not (device.startswith("GPU:") and device[4:].isdigit()):
        raise UsageError(f"--device {args.device!r}: expected CPU or GPU:N")
    if args.threads < 0:
        raise UsageError("--threads must be >= 0")
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
                            else "", data_roots=tuple(roots)))


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
                        tls=tls, data_roots=getattr(args, "data_root", [])).start()


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

    if args.state_dir is None:
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


# --- client commands --------------------------------------------------------------------------

def _client(args: argparse.Namespace):
    from strata.client import Client, default_address

    return Client(_address("--coordinator", args.coordinator or default_address()),
                  tls=_client_tls(args), token=_token(args))


def _bar(done: int, total: int, width: int = 24) -> str:
    if total <= 0:
        return "[" + " " * width + "]"
    filled = min(width, int(width * done / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _progress_line(job) -> str:
    m = job.metrics
    in_use = max((t.in_use_bytes for t in job.tasks), default=0)
    peak = max((t.peak_memory_bytes for t in job.tasks), default=0)
    budget = max((t.memory_budget_bytes for t in job.tasks), default=0)
    parts = [f"{job.state.value:<9}", _bar(m.step, m.total_steps), f"{m.step}/{m.total_steps or '?'}"]
    if m.loss is not None:
        parts.append(f"loss {m.loss:.4f}")
    if m.examples_per_sec:
        parts.append(f"{m.examples_per_sec:,.0f} ex/s")
    parts.append(f"mem/task {_fmt_bytes(in_use)} in use, peak {_fmt_bytes(peak)} of {_fmt_bytes(budget)}")
    return " ".join(parts)


# How long --follow keeps retrying while the coordinator cannot be reached (e.g. restarting).
FOLLOW_RECONNECT_S = 60.0


def _watch_resuming(client, job_id: str):
    """client.watch, resumed after the last stored event when the coordinator goes away."""
    from strata.client import Unavailable

    seq, down_since = 0, None
    while True:
        try:
            for ev in client.watch(job_id, after_seq=seq):
                down_since = None
                seq = max(seq, ev.seq)
                yield ev
            return
        except Unavailable:
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since > FOLLOW_RECONNECT_S:
                raise
            time.sleep(1.0)


def _follow(client, job_id: str):
    """Prints events and a live progress line until the job ends; returns the final job."""
    tty = sys.stdout.isatty()
    last_line, last_print = "", 0.0
    job = None
    for ev in _watch_resuming(client, job_id):
        job = ev.job or job
        if ev.kind != "progress" and ev.message:
            if tty and last_line:
                sys.stdout.write("\r" + " " * min(len(last_line), shutil.get_terminal_size().columns - 1) + "\r")
            print(f"[{time.strftime('%H:%M:%S', time.localtime(ev.time))}] {ev.message}", flush=True)
            last_line = ""
        if job is None:
            continue
        line = _progress_line(job)
        if tty:
            cols = shutil.get_terminal_size().columns - 1
            sys.stdout.write("\r" + line[:cols].ljust(min(len(last_line), cols)))
            sys.stdout.flush()
            last_line = line
        elif line != last_line and not job.state.final and time.monotonic() - last_print >= 2.0:
            print(line, flush=True)
            last_line, last_print = line, time.monotonic()
    if tty and last_line:
        print()
    return client.get(job_id) if job is None or not job.state.final else job


def cmd_submit(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.submit(args.job, overrides=args.set)
        print(job.id, flush=True)
        if not args.follow:
            return EXIT_OK
        final = _follow(c, job.id)
        _print_status(final)
        return EXIT_OK if final.state.value == "SUCCEEDED" else EXIT_FAILED


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_jobs(args: argparse.Namespace) -> int:
    from strata.types import job_to_json

    with _client(args) as c:
        jobs = c.jobs(states=args.state)
    if args.json:
        _print_json([job_to_json(j) for j in jobs])
        return EXIT_OK
    if not jobs:
        print("no jobs")
        return EXIT_OK
    rows = []
    for j in jobs:
        m = j.metrics
        rows.append([j.id, j.state.value, j.strategy, str(len(j.tasks)), f"{m.step}/{m.total_steps}",
                     str(j.restarts), f"{m.test_accuracy:.4f}" if m.test_accuracy is not None else "-",
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created_at)), j.message[:60]])
    _table(rows, ["ID", "STATE", "STRATEGY", "TASKS", "STEP", "RESTARTS", "ACCURACY", "CREATED",
                  "MESSAGE"])
    return EXIT_OK


def _print_status(job) -> None:
    m = job.metrics
    print(f"job {job.id} ({job.name}): {job.state.value}" + (f" - {job.message}" if job.message else ""))
    print(f"  strategy {job.strategy}; step {m.step}/{m.total_steps}"
          + (f"; loss {m.loss:.4f}" if m.loss is not None else "")
          + (f"; {m.examples_per_sec:,.0f} examples/s" if m.examples_per_sec else "")
          + (f"; test accuracy {m.test_accuracy:.4f}" if m.test_accuracy is not None else ""))
    print(f"  memory estimate {_fmt_bytes(job.estimated_memory_bytes)} per task")
    if job.checkpoint_step or job.restarts:
        print(f"  checkpoint at step {job.checkpoint_step}; restarts {job.restarts}; steps "
              f"trained again {job.steps_repeated}")
    rows = [[f"{t.role}:{t.index}", t.worker or "-", t.state.value, str(t.stage),
             _fmt_bytes(t.memory_budget_bytes), _fmt_bytes(t.in_use_bytes), _fmt_bytes(t.peak_memory_bytes),
             (t.failure.value if t.failure.value != "NONE" else "") + (f" {t.message[:70]}" if t.message else "")]
            for t in job.tasks]
    _table(rows, ["  TASK", "WORKER", "STATE", "STAGE", "BUDGET", "IN USE", "PEAK", "NOTE"])
    for t in job.tasks:
        if t.model_path:
            print(f"  model saved by {t.role}:{t.index} on {t.worker}: {t.model_path}")
    if job.output_dir:
        print(f"  outputs: {job.output_dir} ({', '.join(job.outputs)}); fetch with "
              f"`strata download {job.id} DIR`")


def cmd_status(args: argparse.Namespace) -> int:
    from strata.types import job_to_json

    with _client(args) as c:
        job = c.get(args.job_id)
    if args.json:
        _print_json(job_to_json(job))
    else:
        _print_status(job)
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.get(args.job_id)
        if not job.outputs:
            print(f"{job.id} ({job.state.value}) has no outputs yet", file=sys.stderr)
            return EXIT_FAILED
        files = c.download(args.job_id, args.dest)
    for path in files:
        print(path)
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    with _client(args) as c:
        w = c.drain(args.worker)
    moving = len(w.tasks)
    print(f"{w.name}: {w.state.value}" + (f"; {moving} task(s) moving elsewhere" if moving
                                          else ""))
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.cancel(args.job_id)
    print(f"{job.id}: {job.state.value}")
    return EXIT_OK


def cmd_logs(args: argparse.Namespace) -> int:
    role, index = None, 0
    if args.task:
        role, _, idx = args.task.partition(":")
        if not role or not idx.isdigit():
            raise UsageError(f"--task {args.task!r}: expected ROLE:INDEX, e.g. worker:0")
        index = int(idx)
    with _client(args) as c:
        job = c.get(args.job_id)
        prefix = role is None and len(job.tasks) > 1
        pending: dict[tuple[str, int], bytes] = {}
        for r, i, data in c.logs(args.job_id, role, index, follow=args.follow):
            if not prefix:
                sys.stdout.buffer.write(data)
                sys.stdout.flush()
                continue
            buf = pending.get((r, i), b"") + data
            *lines, rest = buf.split(b"\n")
            pending[(r, i)] = rest
            for line in lines:
                sys.stdout.buffer.write(f"[{r}:{i}] ".encode() + line + b"\n")
            sys.stdout.flush()
        for (r, i), rest in pending.items():
            if rest:
                sys.stdout.buffer.write(f"[{r}:{i}] ".encode() + rest + b"\n")
    return EXIT_OK


def cmd_workers(args: argparse.Namespace) -> int:
    from strata.types import worker_to_json

    with _client(args) as c:
        workers = c.workers(states=args.state)
    if args.json:
        _print_json([worker_to_json(w) for w in workers])
        return EXIT_OK
    if not workers:
        print("no workers")
        return EXIT_OK
    rows = [[w.name, w.address, w.device, w.state.value, _fmt_bytes(w.memory.budget_bytes),
             _fmt_bytes(w.memory.reserved_bytes), _fmt_bytes(w.memory.in_use_bytes),
             _fmt_bytes(w.memory.peak_bytes), ",".join(f"{t.job_id}/{t.role}:{t.index}" for t in w.tasks) or "-"]
            for w in workers]
    _table(rows, ["NAME", "ADDRESS", "DEVICE", "STATE", "BUDGET", "RESERVED", "IN USE", "PEAK", "TASKS"])
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from strata.types import plan_to_json

    with _client(args) as c:
        plan = c.plan(args.job, overrides=args.set)
    if args.json:
        _print_json(plan_to_json(plan))
    else:
        print(f"strategy {plan.strategy}: {'feasible' if plan.feasible else 'NOT feasible'} - {plan.reason}")
        rows = [[f"{t.role}:{t.index}", t.worker or "-", str(t.stage), str(len(t.layers)),
                 _fmt_bytes(t.estimated_memory_bytes), _fmt_bytes(t.memory_budget_bytes)] for t in plan.tasks]
        _table(rows, ["TASK", "WORKER", "STAGE", "LAYERS", "ESTIMATE", "BUDGET"])
    return EXIT_OK if plan.feasible else EXIT_FAILED


# --- parser -----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Strata: distributed TensorFlow training.",
                                epilog="Exit codes: 0 ok; 1 job failed or command failed; 2 bad usage "
                                       "or rejected spec; 3 coordinator unreachable; 4 not found.")
    from strata import __version__
    from strata.types import JobState, WorkerState

    p.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str, client: bool = True):
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(fn=fn)
        if client:
            sp.add_argument("--coordinator", metavar="HOST:PORT",
                            help="coordinator address (default: $STRATA_COORDINATOR or 127.0.0.1:50051)")
            tls_flags(sp)
        return sp

    def tls_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="the CA that signed the coordinator's certificate: connect with TLS "
                             "(default: $STRATA_TLS_CA; none: plain text)")
        sp.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="this side's certificate, for mutual TLS (default: $STRATA_TLS_CERT)")
        sp.add_argument("--tls-key", default=None, metavar="FILE",
                        help="its private key (default: $STRATA_TLS_KEY)")
        sp.add_argument("--token-file", default=None, metavar="FILE",
                        help="a file holding the bearer token (default: $STRATA_TOKEN; none: "
                             "no token)")

    sp = add("coordinator", cmd_coordinator, "run the control plane", client=False)
    sp.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT")
    sp.add_argument("--state-dir", default=".strata/coordinator", metavar="DIR",
                    help="where the SQLite state and job logs live")
    sp.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="declare a worker LOST after this long without a heartbeat (default 10)")
    sp.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="fail a job whose tasks are not all running this long after placement "
                         "(default 300)")
    sp.add_argument("--max-upload", default="2GiB", metavar="SIZE",
                    help="the largest file a client may upload with a job: a .keras model or a "
                         "packed code directory (default 2GiB)")
    sp.add_argument("--allow-user-code", action="store_true",
                    help="run jobs that bring their own Python (code: model / dataset functions) "
                         "on the agents; only for a cluster whose every submitter may run code "
                         "there")
    sp.add_argument("--port-file", help=argparse.SUPPRESS)
    sp.add_argument("--tls-cert", default="", metavar="FILE",
                    help="serve TLS with this certificate (`strata certs` makes one)")
    sp.add_argument("--tls-key", default="", metavar="FILE", help="the certificate's private key")
    sp.add_argument("--tls-client-ca", default="", metavar="FILE",
                    help="mutual TLS: require client certificates signed by this CA")
    sp.add_argument("--insecure", action="store_true",
                    help="allow plain text on a non-loopback --listen (a network you trust)")
    sp.add_argument("--auth-tokens", default="", metavar="FILE",
                    help="require bearer tokens: lines TOKEN ROLE NAME, roles admin, submitter, "
                         "viewer, agent; reloaded on SIGHUP (default: none, everything open)")
    sp.add_argument("--max-pending-per-user", type=int, default=DEFAULT_MAX_PENDING_PER_USER,
                    metavar="N", help="jobs one user may have waiting; more are refused "
                                      f"(default {DEFAULT_MAX_PENDING_PER_USER})")
    sp.add_argument("--max-tasks-per-job", type=int, default=DEFAULT_MAX_TASKS_PER_JOB,
                    metavar="N", help="task processes one job may run (default "
                                      f"{DEFAULT_MAX_TASKS_PER_JOB})")

    sp = add("certs", cmd_certs, "make a CA, a coordinator certificate and client certificates",
             client=False)
    sp.add_argument("--out", required=True, metavar="DIR")
    sp.add_argument("--host", action="append", default=[], metavar="NAME",
                    help="a name or address clients reach the coordinator at (repeatable; "
                         "localhost and the loopback addresses are always included)")
    sp.add_argument("--client", action="append", default=None, metavar="NAME",
                    help="a client certificate to make (repeatable; default: agent, client)")
    sp.add_argument("--force", action="store_true", help="replace an existing CA in --out")

    sp = add("worker", cmd_worker, "run a worker agent that owns one device", client=False)
    sp.add_argument("--coordinator", default=os.environ.get("STRATA_COORDINATOR", "127.0.0.1:50051"),
                    metavar="HOST:PORT")
    sp.add_argument("--memory-budget", required=True, metavar="SIZE", help="e.g. 2GiB, 512MiB, 1.5GB")
    sp.add_argument("--name", help="worker name (default: HOSTNAME-DEVICE)")
    sp.add_argument("--device", default="CPU", help="CPU or GPU:N")
    sp.add_argument("--work-dir", default=".strata/worker", metavar="DIR")
    sp.add_argument("--threads", type=int, default=0, help="intra-op threads per task (0: TF default)")
    sp.add_argument("--advertise-host", default="", metavar="HOST",
                    help="address task peers reach this host at (default: the route to the coordinator)")
    sp.add_argument("--shared-dir", default="", metavar="DIR",
                    help="a directory every worker sees at the same path (NFS, a ReadWriteMany "
                         "volume): jobs' checkpoints and outputs, under jobs/JOB_ID/; without "
                         "it no job that checkpoints runs here (default: none)")
    sp.add_argument("--data-root", action="append", default=[], metavar="DIR",
                    help="jobs read data.path / data.test_path only under this directory "
                         "(repeatable; default: none, anywhere this user can read)")
    tls_flags(sp)

    for name, fn, help_ in (("up", cmd_up, "run a coordinator and N workers locally in the foreground"),
                            ("demo", cmd_demo, "train the digits MLP on a local 2-worker cluster")):
        sp = add(name, fn, help_, client=False)
        if name == "up":
            sp.add_argument("--workers", type=int, default=2)
        sp.add_argument("--memory-budget", default="1GiB", metavar="SIZE")
        sp.add_argument("--listen", default="127.0.0.1:50051" if name == "up" else "127.0.0.1:0",
                        metavar="HOST:PORT")
        sp.add_argument("--state-dir", default=".strata/local" if name == "up" else None, metavar="DIR")
        sp.add_argument("--shared-dir", default=None, metavar="DIR",
                        help="the workers' shared directory (default: STATE_DIR/shared)")
        sp.add_argument("--data-root", action="append", default=[], metavar="DIR",
                        help="the workers' data roots (repeatable; default: none, unconfined)")
        if name == "demo":
            sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")

    sp = add("submit", cmd_submit, "submit a job file (YAML or JSON)")
    sp.add_argument("job", metavar="JOB.yaml")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set training.epochs=3")
    sp.add_argument("--follow", action="store_true", help="show live progress until the job ends")

    sp = add("jobs", cmd_jobs, "list jobs")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--state", action="append", default=[], type=str.upper,
                    choices=[s.value for s in JobState], metavar="STATE",
                    help="only jobs in this state (repeatable): "
                         + ", ".join(s.value for s in JobState))
    sp = add("status", cmd_status, "show one job")
    sp.add_argument("job_id", metavar="JOB_ID")
    sp.add_argument("--json", action="store_true")
    sp = add("drain", cmd_drain, "stop placing tasks on a worker and move its jobs elsewhere "
                                 "(they resume from their checkpoints)")
    sp.add_argument("worker", metavar="WORKER")
    sp = add("cancel", cmd_cancel, "cancel a job")
    sp.add_argument("job_id", metavar="JOB_ID")
    sp = add("logs", cmd_logs, "print a job's task logs")
    sp.add_argument("job_id", metavar="JOB_ID")
    sp.add_argument("--task", metavar="ROLE:INDEX")
    sp.add_argument("--follow", action="store_true")
    sp = add("workers", cmd_workers, "list worker agents and their memory")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--state", action="append", default=[], type=str.upper,
                    choices=[s.value for s in WorkerState], metavar="STATE",
                    help="only workers in this state (repeatable): "
                         + ", ".join(s.value for s in WorkerState))
    sp = add("download", cmd_download, "fetch a job's outputs (trained model, metrics.json)")
    sp.add_argument("job_id", metavar="JOB_ID")
    sp.add_argument("dest", metavar="DIR")
    sp = add("plan", cmd_plan, "show what the coordinator would run; starts nothing")
    sp.add_argument("job", metavar="JOB.yaml")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.add_argument("--json", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    from strata.client import CoordinatorError, Infeasible, JobRejected, NotFound, Unavailable
    from strata.errors import SpecError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as e:
        return _fail(str(e), EXIT_USAGE)
    except SpecError as e:
        return _fail(f"job spec rejected: {e}", EXIT_USAGE)
    except JobRejected as e:
        return _fail(f"job spec rejected: {e.message}", EXIT_USAGE)
    except Infeasible as e:
        if args.command == "submit":
            return _fail(f"job rejected: {e.message}", EXIT_USAGE)
        return _fail(e.message, EXIT_FAILED)
    except NotFound as e:
        return _fail(e.message, EXIT_NOT_FOUND)
    except Unavailable as e:
        return _fail(e.message, EXIT_UNAVAILABLE)
    except CoordinatorError as e:
        return _fail(e.message, EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except (OSError, RuntimeError, TimeoutError) as e:
        return _fail(str(e) or type(e).__name__, EXIT_FAILED)
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
