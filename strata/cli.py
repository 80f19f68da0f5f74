# PYTHON_ARGCOMPLETE_OK
"""The ``strata`` command line.

Exit codes: 0 success; 1 the job FAILED or was CANCELLED, or the command failed; 2 bad usage or a
rejected job spec (the message names the field or flag); 3 the coordinator cannot be reached;
4 no such job or task; 124 ``strata wait --timeout`` ran out.

Shell completion: ``eval "$(register-python-argcomplete strata)"`` (argcomplete).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any, Callable

from strata import cpukernels
from strata.limits import DEFAULT_MAX_PENDING_PER_USER, DEFAULT_MAX_TASKS_PER_JOB

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_NOT_FOUND = 0, 1, 2, 3, 4
#: `strata wait --timeout` ran out (as timeout(1) exits)
EXIT_TIMEOUT = 124

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


def _duration(flag: str, text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s`` or plain seconds."""
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    t = text.strip().lower()
    scale = units.get(t[-1:], 0.0)
    number = t[:-1] if scale else t
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e10 or value != value:
        raise UsageError(f"{flag} {text[:32]!r}: a duration such as 7d, 12h, 30m or seconds")
    return value


def _size(flag: str, text: str, zero: bool = False) -> int:
    """A size flag (``512MiB``, ``2GiB``, bytes); ``zero``: 0 is allowed (none, no limit)."""
    from strata.units import parse_size

    if zero and text.strip() == "0":
        return 0
    try:
        value = parse_size(text)
    except ValueError as e:
        raise UsageError(f"{flag} {text!r}: {e}") from None
    if value <= 0:
        raise UsageError(f"{flag} must be positive" + (" (or 0)" if zero else ""))
    return value


def _address(flag: str, text: str, allow_port_zero: bool = False) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if allow_port_zero else 1) <= int(port) <= 65535:
        raise UsageError(f"{flag} {text!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")
    return text


def _fmt_bytes(n: int | None) -> str:
    from strata.units import format_size

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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args.listen, args.state_dir, heartbeat_timeout_s=args.heartbeat_timeout,
                      start_timeout_s=args.start_timeout, port_file=args.port_file,
                      max_upload_bytes=max_upload, allow_user_code=args.allow_user_code,
                      tls_cert=args.tls_cert, tls_key=args.tls_key,
                      tls_client_ca=args.tls_client_ca, auth_tokens=args.auth_tokens,
                      max_pending_per_user=args.max_pending_per_user,
                      max_tasks_per_job=args.max_tasks_per_job, retention_s=retention,
                      http_listen=args.http_listen, http_port_file=args.http_port_file,
                      **storage))
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
                            cpu_kernels=kernels))


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
    return client.settled(job_id, SETTLE_S)


#: how long ``--follow`` waits, once a job ended, for its tasks to end too (its servers are
#: stopped after its lead succeeded): the last table then shows how each ended
SETTLE_S = 15.0


#: seconds a job file and its --set flags may take to parse; a real one takes milliseconds
PARSE_LIMIT_S = 10.0


class _ParseTimeout(BaseException):
    """The parse's time is up. Not an Exception: no ``except Exception`` inside may keep it."""


def _check_job(job: Any, overrides: list[str] | None) -> None:
    """Parses the job file (or mapping) and the --set flags under a time bound before the
    client parses them again to send: the parser bounds what it knows of (aliases, depth,
    size), and this bounds what it does not, so a command never hangs on a file."""
    import threading

    from strata.errors import SpecError
    from strata.spec import apply_overrides, load_spec_file

    def parse() -> None:
        raw = load_spec_file(job) if isinstance(job, str) else dict(job)
        if overrides:
            apply_overrides(raw, overrides)

    if threading.current_thread() is not threading.main_thread():
        return parse()  # a timer's signal reaches the main thread only

    def expire(signum: int, frame: Any) -> None:
        raise _ParseTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        timer = signal.setitimer(signal.ITIMER_REAL, PARSE_LIMIT_S)
        try:
            parse()
        finally:
            signal.setitimer(signal.ITIMER_REAL, *timer)  # the caller's timer, if it had one
    except _ParseTimeout:
        raise SpecError("JOB", f"{job if isinstance(job, str) else 'the job'}: still parsing "
                               f"after {PARSE_LIMIT_S:g} s; a job file takes milliseconds, so "
                               "this one is refused") from None
    finally:
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


def cmd_submit(args: argparse.Namespace) -> int:
    _check_job(args.job, args.set)
    wait = _duration("--queue-for-capacity", args.queue_for_capacity) \
        if args.queue_for_capacity else 0.0
    with _client(args) as c:
        job = c.submit(args.job, overrides=args.set, queue_for_capacity_s=wait)
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
    if not args.all:  # a memory probe is part of its job: shown with --all
        jobs = [j for j in jobs if not j.recovery.probe_of]
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
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created_at)),
                     j.message])  # whole: the last column, and why a job waits
    _table(rows, ["ID", "STATE", "STRATEGY", "TASKS", "STEP", "RESTARTS", "ACCURACY", "CREATED",
                  "MESSAGE"])
    return EXIT_OK


def _local_time(t: float) -> str:
    """A time as a local date (with its zone), as users read them."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def _print_status(job) -> None:
    m = job.metrics
    print(f"job {job.id} ({job.name}): {job.state.value}" + (f" - {job.message}" if job.message else ""))
    print(f"  strategy {job.strategy}; step {m.step}/{m.total_steps}"
          + (f"; loss {m.loss:.4f}" if m.loss is not None else "")
          + (f"; {m.examples_per_sec:,.0f} examples/s" if m.examples_per_sec else "")
          + (f"; test accuracy {m.test_accuracy:.4f}" if m.test_accuracy is not None else ""))
    print(f"  memory estimate {_fmt_bytes(job.estimated_memory_bytes)} per task")
    if job.training:
        print(f"  training with {job.training}")
    if m.test_metrics:
        print("  test metrics (its compile's): " + ", ".join(
            f"{k} {v:.4f}" for k, v in sorted(m.test_metrics.items())))
    print(f"  created {_local_time(job.created_at)}"
          + (f"; finished {_local_time(job.finished_at)}" if job.finished_at else ""))
    if job.checkpoint_step or job.restarts:
        print(f"  checkpoint at step {job.checkpoint_step}; restarts {job.restarts}; steps "
              f"trained again {job.steps_repeated}")
    rows = [[f"{t.role}:{t.index}", t.worker or "-", t.state.value, str(t.stage),
             _fmt_bytes(t.memory_budget_bytes), _fmt_bytes(t.in_use_bytes), _fmt_bytes(t.peak_memory_bytes),
             (t.failure.value if t.failure.value != "NONE" else "")
             + (f" {t.message.splitlines()[0][:70]}" if t.message.strip() else "")]
            for t in job.tasks]
    _table(rows, ["  TASK", "WORKER", "STATE", "STAGE", "BUDGET", "IN USE", "PEAK", "NOTE"])
    for t in job.tasks:  # a message of several lines (a traceback) in full, its lines kept
        if t.message.count("\n"):
            print(f"  {t.role}:{t.index}:")
            print("\n".join(f"    {line}" for line in t.message.splitlines()))
    for t in job.tasks:
        if t.model_path:
            print(f"  model saved by {t.role}:{t.index} on {t.worker}: {t.model_path}")
    if job.output_dir:
        shown = [o for o in job.outputs if not o.startswith("tensorboard/")]
        print(f"  outputs: {job.output_dir} ({', '.join(shown)}); fetch with "
              f"`strata download {job.id} DIR`")
    if job.tensorboard_dir:
        print(f"  TensorBoard: tensorboard --logdir {job.tensorboard_dir}")


def cmd_status(args: argparse.Namespace) -> int:
    from strata.types import job_to_json

    with _client(args) as c:
        job = c.get(args.job_id)
        if args.json:
            _print_json(job_to_json(job))
            return EXIT_OK
        running = [t.worker for t in job.tasks if t.worker and not t.state.final]
        workers = c.workers() if running else []
    _print_status(job)
    for line in _sharing(job, workers):
        print(f"  {line}")
    return EXIT_OK


def _sharing(job, workers) -> list[str]:
    """What shares the job's running tasks' workers and hosts: other tasks on the same device
    take its memory and time, and agents on one host share its CPUs (a reason a job runs
    slowly)."""
    by_name = {w.name: w for w in workers}
    mine = {t.worker for t in job.tasks if t.worker and not t.state.final}
    out = []
    for name in sorted(mine):
        w = by_name.get(name)
        others = [f"{t.job_id} {t.role}:{t.index}" for t in (w.tasks if w else [])
                  if t.job_id != job.id and not t.state.final]
        if others:
            out.append(f"{name} also runs {', '.join(others)}")
    hosts: dict[str, list[str]] = {}
    for name in sorted(mine):
        if name in by_name:
            hosts.setdefault(by_name[name].address, []).append(name)
    for host, names in sorted(hosts.items()):
        if len(names) > 1:
            out.append(f"{', '.join(names)} share host {host} (its CPUs, and its GPU if they "
                       "name the same one)")
    return out


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


def cmd_drain(args: argparse.Namespace) -> int:
    with _client(args) as c:
        w = c.drain(args.worker)
    moving = len(w.tasks)
    print(f"{w.name}: {w.state.value}" + (f"; {moving} task(s) moving elsewhere" if moving
                                          else ""))
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: seconds, more than 0")
    with _client(args) as c:
        try:
            job = c.wait(args.job_id, timeout=args.timeout)
        except TimeoutError:
            job = c.get(args.job_id)
            print(f"{job.id}: still {job.state.value} after {args.timeout:g} s", file=sys.stderr)
            return EXIT_TIMEOUT
    print(f"{job.id}: {job.state.value}" + (f" - {job.message}" if job.message else ""))
    return EXIT_OK if job.state.value == "SUCCEEDED" else EXIT_FAILED


def cmd_delete(args: argparse.Namespace) -> int:
    with _client(args) as c:
        c.delete(args.job_id)
    print(f"{args.job_id}: deleted")
    return EXIT_OK


def cmd_validate(args: argparse.Namespace) -> int:
    from strata.client import local_spec
    from strata.coordinator.core import prepare

    _check_job(args.job, args.set)
    spec = local_spec(args.job, args.set)
    plan = prepare(spec).plan  # the model profiled, the strategy's plan without workers
    _check_local_data(spec, plan)
    if args.coordinator:  # and every check that needs the cluster: what submit would say
        with _client(args) as c:
            seen = c.plan(args.job, overrides=args.set)
        if not seen.feasible:
            return _fail(f"{args.job}: rejected by {args.coordinator}: {seen.reason}",
                         EXIT_USAGE)
    if not plan.tasks:  # stages are cut to fit the workers' budgets
        print(f"{args.job}: valid - {spec.name}, {spec.strategy}; its stages are planned "
              f"against the workers' budgets (strata plan {args.job} --workers N "
              f"--memory-budget SIZE shows them)")
        return EXIT_OK
    print(f"{args.job}: valid - {spec.name}, {spec.strategy}, {len(plan.tasks)} task(s), "
          f"about {_fmt_bytes(plan.largest_estimate)} for the largest")
    return EXIT_OK


#: a local data file validate reads whole to check its shapes, at most (larger: the task does)
VALIDATE_READ_BYTES = 256 << 20


def _check_local_data(spec, plan) -> None:
    """The job's data against its model, where this machine can see the data, as the task
    checks it before it trains: an npz file's arrays' shapes (read only when small); a CSV's,
    TFRecord's or image directory's files, the label, and the features' size against the
    model's input. Raises SpecError naming the field."""
    import dataclasses
    import glob

    from strata.errors import SpecError
    from strata.modelspec import ModelSpecError, profile_model
    from strata.worker import data as wdata

    def here(path: str) -> bool:  # a file, a directory or a pattern of files on this machine
        return bool(path) and (os.path.exists(path) or bool(glob.glob(path)))

    d = spec.data
    if spec.code_model or not here(d.path):
        return  # what the job's code builds, or data only the workers see
    if d.test_path and not here(d.test_path):
        d = dataclasses.replace(d, test_path="")  # a test split only the workers see
    try:
        profile = profile_model(dict(spec.model))
    except ModelSpecError:
        return  # the model's own checks said what there is to say
    try:
        if d.source == "npz" and not spec.code_dataset and os.path.isfile(d.path) and \
                os.path.getsize(d.path) <= VALIDATE_READ_BYTES:
            wdata.load_splits(d, profile.input_shape, profile.output_shape)
        elif d.source in ("csv", "tfrecord", "images") and not spec.code_dataset:
            wdata.check_streamed(d)
            _check_feature_size(d, profile)
    except wdata.DataError as e:
        raise SpecError(e.field, e.message) from None


def _check_feature_size(d, profile) -> None:
    """A CSV's feature columns, or a one-input TFRecord's feature, against the size of the
    model's input (the task reshapes neither: a mismatch fails its first step)."""
    from strata.worker import data as wdata

    want = 1
    for n in profile.input_shape:
        want *= int(n or 0)
    if not want or len(profile.model_inputs) > 1:
        return
    if d.source == "csv":
        path = wdata.data_files(d.path, "data.path")[0]
        have = len(wdata.csv_columns(path)) - 1
        what = f"{path} has {have} feature columns besides {d.label!r}"
        field = "data.path"
    elif d.source == "tfrecord":
        inputs = [n for n in d.features if n != d.label]
        if len(inputs) != 1:
            return
        shape = list(d.features[inputs[0]].get("shape") or [])
        have = 1
        for n in shape:
            have *= int(n)
        what = f"feature {inputs[0]!r} has shape {shape}"
        field = f"data.features.{inputs[0]}"
    else:
        return
    if have != want:
        raise wdata.DataError(field, f"{what}, and the model's input "
                                     f"{list(profile.input_shape)} takes {want} values")


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
    if args.tail < 0:
        raise UsageError(f"--tail {args.tail}: a number of lines, 0 or more")
    with _client(args) as c:
        job = c.get(args.job_id)
        prefix = role is None and len(job.tasks) > 1
        pending: dict[tuple[str, int], bytes] = {}
        for r, i, data in c.logs(args.job_id, role, index, follow=args.follow, tail=args.tail):
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


def _fmt_disk(d) -> str:
    """An agent's disk: Strata's own files / what its file system has left."""
    return f"{_fmt_bytes(d.used_bytes)}/{_fmt_bytes(d.free_bytes)}" if d.total_bytes else "-"


def _offline_plan(args: argparse.Namespace):
    """``strata plan --workers N --memory-budget SIZE``: the plan for N idle workers of that
    budget, computed here (the coordinator's planner, no coordinator)."""
    from strata.client import local_spec
    from strata.coordinator.core import PreparedJob, plan_on, prepare
    from strata.coordinator.placement import Capacity
    from strata.types import WorkerOffer

    if not 1 <= args.workers <= 4096:
        raise UsageError(f"--workers {args.workers}: 1 to 4096")
    budget = _size("--memory-budget", args.memory_budget)
    names = [f"worker-{i}" for i in range(args.workers)]
    spec = local_spec(args.job, args.set)
    prepared: PreparedJob = prepare(spec, [WorkerOffer(n, budget) for n in names])
    plan = plan_on(prepared, [Capacity(name=n, budget_bytes=budget, free_bytes=budget,
                                       free_ports=64) for n in names], {})
    if plan.feasible and any(not t.worker for t in plan.tasks):
        # idle workers that cannot hold it now never will: no job ends to make room
        why = plan.reason.rsplit("would wait: ", 1)[-1]
        return dataclasses.replace(plan, feasible=False, reason=(
            f"{args.workers} worker(s) of {_fmt_bytes(budget)} cannot hold every task at "
            f"once: {why}"))
    return plan


def cmd_plan(args: argparse.Namespace) -> int:
    from strata.types import plan_to_json

    if (args.workers is None) != (args.memory_budget is None):
        raise UsageError("--workers and --memory-budget go together (offline planning)")
    _check_job(args.job, args.set)
    if args.workers is not None:
        plan = _offline_plan(args)
    else:
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

JSON_HELP = "print JSON (the shapes in docs/ARCHITECTURE.md), for scripts"
#: one example per command, shown at the end of its --help
EXAMPLES = {
    "coordinator": "strata coordinator --listen 0.0.0.0:50051 --state-dir /var/lib/strata "
                   "--tls-cert server.crt --tls-key server.key --auth-tokens tokens",
    "certs": "strata certs --out tls --host coord.example.org --client node-a:agent "
             "--client alice",
    "worker": "strata worker --coordinator coord:50051 --memory-budget 8GiB --device GPU:0 "
              "--shared-dir /mnt/shared --data-root /mnt/datasets",
    "up": "strata up --workers 2 --memory-budget 2GiB",
    "demo": "strata demo --set training.epochs=2",
    "submit": "strata submit examples/digits-mlp.yaml --set workers=2 --follow",
    "jobs": "strata jobs --state RUNNING --state PENDING",
    "status": "strata status job-1a2b3c4d --json",
    "wait": "strata wait job-1a2b3c4d --timeout 600 && echo trained",
    "drain": "strata drain host1-gpu0",
    "cancel": "strata cancel job-1a2b3c4d",
    "delete": "strata delete job-1a2b3c4d",
    "logs": "strata logs job-1a2b3c4d --task worker:1 --tail 50 --follow",
    "workers": "strata workers --json",
    "download": "strata download job-1a2b3c4d out/",
    "plan": "strata plan examples/deep-pipeline.yaml --workers 4 --memory-budget 2GiB",
    "validate": "strata validate examples/digits-ps.yaml",
    "health": "strata health --coordinator 127.0.0.1:50051",
    "admin": "strata admin revoke host1-gpu0",
}


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings
                or action.default in (None, False, [], "", argparse.SUPPRESS)):
            return text
        return f"{text} (default: {action.default})"


class _Commands:
    """The subcommand parsers as they are built: ``add`` makes one, with the flags of a
    client of the coordinator unless ``client=False``."""

    def __init__(self, sub: Any):
        self.sub = sub

    def add(self, name: str, fn: Callable[[argparse.Namespace], int], help_: str,
            client: bool = True) -> argparse.ArgumentParser:
        sp = self.sub.add_parser(name, help=help_.split(". ")[0], description=help_)
        sp.set_defaults(fn=fn)
        if client:
            sp.add_argument("--coordinator", metavar="HOST:PORT",
                            help="coordinator address (default: $STRATA_COORDINATOR or 127.0.0.1:50051)")
            self.tls_flags(sp)
        return sp

    @staticmethod
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Strata: distributed TensorFlow training.",
                                epilog="Exit codes: 0 ok; 1 job failed or command failed; 2 bad usage "
                                       "or rejected spec; 3 coordinator unreachable; 4 not found; "
                                       "124 strata wait timed out.")
    from strata import __version__

    p.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    cmds = _Commands(sub)
    _coordinator_command(cmds)
    _cluster_commands(cmds)
    _job_commands(cmds)
    for name, sp in sub.choices.items():
        sp.formatter_class = _Help
        sp.epilog = f"example:\n  {EXAMPLES[name]}"
    return p


def _coordinator_command(cmds: _Commands) -> None:
    """``strata coordinator``: the control plane's flags."""
    sp = cmds.add("coordinator", cmd_coordinator, "run the control plane", client=False)
    sp.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                    help="the address to serve gRPC on; off loopback it needs TLS or --insecure")
    sp.add_argument("--http-listen", default="", metavar="HOST:PORT",
                    help="serve the status page (/) and Prometheus metrics (/metrics) here; "
                         "behind the same tokens, over TLS with --tls-cert (default: none)")
    sp.add_argument("--http-port-file", help=argparse.SUPPRESS)
    sp.add_argument("--retention", default="7d", metavar="DURATION",
                    help="delete finished jobs (records, logs, outputs) this long after they "
                         "ended: 7d, 12h, 30m, seconds; 0 keeps them")
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
    sp.add_argument("--user-quota", default="20GiB", metavar="SIZE",
                    help="bytes one user may keep on the coordinator: its uploads and its "
                         "jobs' outputs; more are refused (0: no quota)")
    sp.add_argument("--max-job-outputs", default="8GiB", metavar="SIZE",
                    help="bytes of outputs one job may keep (model, TensorBoard logs)")
    sp.add_argument("--max-job-logs", default="256MiB", metavar="SIZE",
                    help="bytes of logs one job may keep, all its tasks; the rest is dropped")
    sp.add_argument("--disk-reserve", default="256MiB", metavar="SIZE",
                    help="room kept free on --state-dir's disk for state changes: uploads, "
                         "outputs, logs and new jobs stop there, cancels go on")
    sp.add_argument("--upload-grace", default="1h", metavar="DURATION",
                    help="how long an uploaded file no job names is kept before it is deleted")



def _cluster_commands(cmds: _Commands) -> None:
    """Running and administering a cluster: admin, certs, worker, up, demo."""
    sp = cmds.add("admin", cmd_admin, "administer the cluster's credentials: revoke a caller "
                                 "(every token and certificate of its NAME) at once, restore "
                                 "one, list those revoked")
    sp.add_argument("action", choices=("revoke", "restore", "revoked"),
                    help="revoke NAME: its open calls close, its agents are LOST and their "
                         "tasks restart elsewhere; restore NAME: let it in again; revoked: "
                         "list the names revoked")
    sp.add_argument("name", nargs="?", default="", metavar="NAME",
                    help="the caller's NAME (as the tokens file or its certificate names it)")

    sp = cmds.add("certs", cmd_certs, "make a CA, a coordinator certificate and client certificates",
             client=False)
    sp.add_argument("--out", required=True, metavar="DIR", help="where to write the files")
    sp.add_argument("--host", action="append", default=[], metavar="NAME",
                    help="a name or address clients reach the coordinator at (repeatable; "
                         "localhost and the loopback addresses are always included)")
    sp.add_argument("--client", action="append", default=None, metavar="NAME[:ROLE]",
                    help="a client certificate to make, with its role (admin, submitter, "
                         "viewer, agent; default submitter), read when the coordinator has no "
                         "--auth-tokens (repeatable; default: agent:agent, client:admin)")
    sp.add_argument("--force", action="store_true", help="replace an existing CA in --out")

    sp = cmds.add("worker", cmd_worker, "run a worker agent that owns one device", client=False)
    sp.add_argument("--coordinator", default=os.environ.get("STRATA_COORDINATOR", "127.0.0.1:50051"),
                    metavar="HOST:PORT", help="the coordinator's address ($STRATA_COORDINATOR)")
    sp.add_argument("--memory-budget", required=True, metavar="SIZE", help="e.g. 2GiB, 512MiB, 1.5GB")
    sp.add_argument("--name", help="worker name (default: HOSTNAME-DEVICE)")
    sp.add_argument("--device", default="CPU", help="CPU or GPU:N")
    sp.add_argument("--work-dir", default=".strata/worker", metavar="DIR",
                    help="the agent's own files: task configs, fetched blobs, outputs without "
                         "a shared directory")
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
    sp.add_argument("--warm-pool", type=int, default=1, metavar="N",
                    help="task processes kept ready with TensorFlow imported, so a task starts "
                         "without paying the import (each idles at about 300 MiB of RAM)")
    sp.add_argument("--cpu-kernels", default="auto", metavar="auto|onednn|eigen",
                    help="the CPU kernels this host's TensorFlow runs, which the memory "
                         "estimates depend on (default auto: TensorFlow's own rule, from "
                         "TF_ENABLE_ONEDNN_OPTS and the CPU's features)")
    cmds.tls_flags(sp)

    for name, fn, help_ in (("up", cmd_up, "run a coordinator and N workers locally in the foreground"),
                            ("demo", cmd_demo, "train the digits MLP on a local 2-worker cluster")):
        sp = cmds.add(name, fn, help_, client=False)
        if name == "up":
            sp.add_argument("--workers", type=int, default=2, help="worker agents to start")
        sp.add_argument("--memory-budget", default="1GiB", metavar="SIZE",
                        help="each worker's memory budget")
        sp.add_argument("--listen", default="127.0.0.1:50051" if name == "up" else "127.0.0.1:0",
                        metavar="HOST:PORT", help="the coordinator's address; off loopback it "
                                                  "makes certificates and tokens (mutual TLS)")
        sp.add_argument("--state-dir", default=".strata/local" if name == "up" else None,
                        metavar="DIR", help="the coordinator's state and the workers' files"
                        + ("" if name == "up" else " (default: a new temporary directory)"))
        sp.add_argument("--shared-dir", default=None, metavar="DIR",
                        help="the workers' shared directory (default: STATE_DIR/shared)")
        sp.add_argument("--data-root", action="append", default=[], metavar="DIR",
                        help="the workers' data roots (repeatable; default: none, unconfined)")
        sp.add_argument("--http-listen", default="", metavar="HOST:PORT",
                        help="the coordinator's status page and /metrics (default: none)")
        sp.add_argument("--warm-pool", type=int, default=1, metavar="N",
                        help="each worker's task processes kept ready with TensorFlow imported")
        if name == "demo":
            sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="override a field of the demo job (repeatable)")


def _job_commands(cmds: _Commands) -> None:
    """Jobs and what users look at: submit, jobs, status, wait, drain, cancel, delete, logs,
    workers, download, plan, health, validate."""
    from strata.types import JobState, WorkerState

    sp = cmds.add("submit", cmd_submit, "submit a job file (YAML or JSON)")
    sp.add_argument("job", metavar="JOB.yaml", help="the job file")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set training.epochs=3 (repeatable)")
    sp.add_argument("--follow", action="store_true", help="show live progress until the job ends")
    sp.add_argument("--queue-for-capacity", default="", metavar="DURATION",
                    help="a job wider or larger than any the cluster has had workers for is "
                         "refused; with this it waits that long for them (30m, 12h), then fails")

    sp = cmds.add("jobs", cmd_jobs, "list jobs")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp.add_argument("--all", action="store_true",
                    help="also the memory probes (NAME-probe-...) jobs run before they start")
    sp.add_argument("--state", action="append", default=[], type=str.upper,
                    choices=[s.value for s in JobState], metavar="STATE",
                    help="only jobs in this state (repeatable): "
                         + ", ".join(s.value for s in JobState))
    sp = cmds.add("status", cmd_status, "show one job")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp = cmds.add("wait", cmd_wait, "wait for a job to end; exit 0 if it SUCCEEDED, 1 if it FAILED "
                               "or was CANCELLED")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help=f"give up after this long, exit {EXIT_TIMEOUT} (default: no limit)")
    sp = cmds.add("drain", cmd_drain, "stop placing tasks on a worker and move its jobs elsewhere "
                                 "(they resume from their checkpoints)")
    sp.add_argument("worker", metavar="WORKER", help="the worker's name (strata workers)")
    sp = cmds.add("cancel", cmd_cancel, "cancel a job")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp = cmds.add("delete", cmd_delete, "delete a finished job: its records, events, logs and "
                                   "stored outputs")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job (cancel a running one first)")
    sp = cmds.add("logs", cmd_logs, "print a job's task logs")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("--task", metavar="ROLE:INDEX",
                    help="one task's log, e.g. worker:1 (default: every task's, each line "
                         "prefixed with its task)")
    sp.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    sp.add_argument("--tail", type=int, default=0, metavar="N",
                    help="only the last N lines of each task's log (default: all)")
    sp = cmds.add("workers", cmd_workers, "list worker agents and their memory")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp.add_argument("--state", action="append", default=[], type=str.upper,
                    choices=[s.value for s in WorkerState], metavar="STATE",
                    help="only workers in this state (repeatable): "
                         + ", ".join(s.value for s in WorkerState))
    sp = cmds.add("download", cmd_download, "fetch a job's outputs (trained model, metrics.json)")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("dest", metavar="DIR", help="where to write them (made if missing)")
    sp = cmds.add("plan", cmd_plan, "show what would run: tasks, workers, stages, memory per task; "
                               "starts nothing. With --workers and --memory-budget it needs no "
                               "coordinator")
    sp.add_argument("job", metavar="JOB.yaml", help="the job file")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set workers=4 (repeatable)")
    sp.add_argument("--workers", type=int, default=None, metavar="N",
                    help="plan offline for N workers of --memory-budget each (default: the "
                         "coordinator's workers)")
    sp.add_argument("--memory-budget", default=None, metavar="SIZE",
                    help="each offline worker's budget, e.g. 8GiB")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp = cmds.add("health", cmd_health, "probe the coordinator's health service (exit 0 when "
                                   "SERVING), or an agent's last heartbeat")
    sp.add_argument("--heartbeat-file", default="", metavar="FILE",
                    help="an agent's WORK_DIR/agent.alive: healthy when a heartbeat was "
                         "accepted within --max-age (default: probe the coordinator)")
    sp.add_argument("--max-age", type=float, default=30.0, metavar="SECONDS",
                    help="how old the last heartbeat may be; also the coordinator probe's "
                         "timeout")
    sp = cmds.add("validate", cmd_validate, "check a job file on this machine, as the coordinator "
                                       "would: fields, model, memory estimate, the data it can "
                                       "see; nothing is sent. With --coordinator, also what "
                                       "that cluster would say: whether it fits there")
    sp.add_argument("job", metavar="JOB.yaml", help="the job file")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field (repeatable)")


def main(argv: list[str] | None = None) -> int:
    from strata.client import (
        CoordinatorError, DiskFull, Infeasible, JobRejected, NotFound, Unavailable,
    )
    from strata.errors import SpecError

    parser = build_parser()
    try:
        import argcomplete

        argcomplete.autocomplete(parser)  # `eval "$(register-python-argcomplete strata)"`
    except ImportError:
        pass
    args = parser.parse_args(argv)
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
    except DiskFull as e:  # reached, but it cannot store this: not "unreachable"
        return _fail(e.message, EXIT_FAILED)
    except Unavailable as e:
        return _fail(e.message, EXIT_UNAVAILABLE)
    except CoordinatorError as e:
        return _fail(e.message, EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:
        # the reader went away (`strata logs ... | head`): end quietly; stdout is pointed at
        # /dev/null so that the interpreter's last flush does not complain either
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except (OSError, RuntimeError, TimeoutError) as e:
        return _fail(str(e) or type(e).__name__, EXIT_FAILED)


if __name__ == "__main__":
    sys.exit(main())
