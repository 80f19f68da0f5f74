"""The ``strata`` commands on jobs: submit (and ``--follow``: events and a live progress
line), jobs, status, wait, logs, cancel, delete and download."""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from strata.clicommon import (
    EXIT_FAILED, EXIT_OK, EXIT_TIMEOUT, UsageError, _check_job, _client, _duration, _fmt_bytes,
    _print_json, _table,
)


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


def _bar(done: int, total: int, width: int = 24) -> str:
    if total <= 0:
        return "[" + " " * width + "]"
    filled = min(width, int(width * done / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


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
    if job.spec is not None and job.spec.elastic:
        print(f"  elastic: {job.spec.workers} wide now, of {job.spec.workers_min}-"
              f"{job.spec.workers_max}; resizes {job.recovery.resizes}")
    if job.training:
        print(f"  training with {job.training}")
    if m.test_metrics:
        print("  test metrics (its compile's): " + ", ".join(
            f"{k} {v:.4f}" for k, v in sorted(m.test_metrics.items())))
    print(f"  created {_local_time(job.created_at)}"
          + (f"; finished {_local_time(job.finished_at)}" if job.finished_at else ""))
    if job.checkpoint_step or job.restarts:
        print(f"  checkpoint at step {job.checkpoint_step}; restarts {job.restarts}; steps "
              f"trained again {job.steps_repeated}"
              + (f"; preempted {job.recovery.preemptions} time(s)"
                 if job.recovery.preemptions else ""))
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


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        job = c.cancel(args.job_id)
    print(f"{job.id}: {job.state.value}")
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    with _client(args) as c:
        c.delete(args.job_id)
    print(f"{args.job_id}: deleted")
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
