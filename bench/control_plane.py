"""Control-plane cost as state grows: the coordinator's own work for A agents and J jobs held.

    .venv/bin/python bench/control_plane.py [--agents 5000] [--running 2000] [--pending 1000]
                                            [--finished 2000] [--compare REV]

With --compare REV the same measurement runs first on the code of git revision REV (a
worktree laid out as the installed package), then on this checkout, one after the other in
one invocation, and the ratios are printed: before and after a change, on the same machine.

The coordinator is driven directly, on its real SQLite store, with a manual clock. No gRPC and
no processes: this isolates what the control loop and the cluster API cost per call as jobs
and agents accumulate. `--agents` agents of 1 GiB each register, and one of 2 GiB; `--running`
1-task jobs of 900 MiB are placed (one per agent) and report RUNNING; `--finished` jobs are
submitted and cancelled; `--pending` jobs of 1.5 GiB wait: only the large agent could hold
one, and a job of 1.5 GiB runs there.

Prints JSON with:
- tick: one pass of the control loop (detect lost agents, schedule waiting jobs), median ms;
- heartbeat: one agent's heartbeat with its task's report, mean and p99 µs;
- submit: a job's submission (parse, plan, admission, store), p50 and p99 ms;
- list_workers: the `strata workers` view, ms;
- metrics_scrape / status_page_state: one `/metrics` scrape and one `/api/state` read (what
  the status page reads every 2 s), median of 5, ms: the part on the coordinator's loop, the
  longest it holds the loop at once (it may read in steps), and the part in a thread;
- tick_after_change: a tick right after one task ended (room grew: waiting jobs are tried), ms;
- retention_pass: the tick's look for jobs past `--retention` (once a minute; nothing is old
  enough here, so this is what the look itself costs), median of 5, ms;
- restart: a new coordinator loading the store (what a restart costs before listening), s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("STRATA_BENCH_SHIM"):
    sys.path.insert(0, ROOT)

from strata.coordinator.core import Coordinator  # noqa: E402
from strata.coordinator.store import SqliteStore  # noqa: E402
from strata.coordinator.web import Web  # noqa: E402
from strata.queues import load_queues  # noqa: E402
from strata.types import MemoryStatus, TaskReport, TaskState  # noqa: E402

GiB = 1 << 30
SPEC = {"name": "cp", "workers": 1,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64], "classes": 10}},
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 1000},
        "memory": {"per_task_budget": "900MiB"}}
BIG = {**SPEC, "name": "big", "memory": {"per_task_budget": "1536MiB"}}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=5000)
    ap.add_argument("--running", type=int, default=2000)
    ap.add_argument("--pending", type=int, default=1000)
    ap.add_argument("--finished", type=int, default=2000)
    ap.add_argument("--queues", default="", metavar="FILE",
                    help="a queues file (strata coordinator --queues): the tick orders the "
                         "waiting jobs by the shared cluster's policy")
    args = ap.parse_args()
    assert args.running <= args.agents
    return args


def populate(coord: Coordinator, args: argparse.Namespace
             ) -> tuple[dict[str, str], list, dict[str, TaskReport]]:
    """The state measured: the agents registered, the finished, running and pending jobs.
    Returns the agents' sessions, the running jobs and each busy agent's task report."""
    sessions = {}
    for i in range(args.agents):
        name = f"agent-{i:05d}"
        sessions[name] = coord.register(name, "10.0.0.1", "CPU", GiB,
                                        [20000 + 2 * i, 20001 + 2 * i], [], shared_dir="/s")
    sessions["agent-big"] = coord.register("agent-big", "10.0.0.2", "CPU", 2 * GiB,
                                           [40000, 40001], [], shared_dir="/s")
    for _ in range(args.finished):
        coord.cancel(coord.submit(SPEC).id)
    running = [coord.submit(BIG)]
    coord.tick()
    running += [coord.submit(SPEC) for _ in range(args.running)]
    coord.tick()
    on: dict[str, TaskReport] = {}
    for job in running:
        t = job.tasks[0]
        assert t.worker, job.message
        r = TaskReport(job.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt, step=1,
                       total_steps=1000, loss=1.0, in_use_bytes=100 << 20, peak_bytes=200 << 20)
        coord.report(t.worker, sessions[t.worker], r)
        on[t.worker] = r
    for _ in range(args.pending):
        coord.submit(BIG)
    return sessions, running, on


def time_ticks(coord: Coordinator, clock: Clock) -> list[float]:
    ticks = []
    for _ in range(20):
        clock.now += 0.5
        s = time.perf_counter()
        coord.tick()
        ticks.append(time.perf_counter() - s)
    return ticks


def time_ticks_after_change(coord: Coordinator, clock: Clock, sessions: dict[str, str],
                            running: list, on: dict[str, TaskReport]) -> list[float]:
    changed = []
    ended = 0
    for job in running[1:11]:  # ten tasks end, one at a time, each followed by a tick
        t = job.tasks[0]
        coord.report(t.worker, sessions[t.worker], TaskReport(
            job.id, t.role, t.index, TaskState.SUCCEEDED, attempt=t.attempt, step=1000,
            total_steps=1000, test_accuracy=0.5, test_loss=1.0))
        on.pop(t.worker, None)
        ended += 1
        clock.now += 0.5
        s = time.perf_counter()
        coord.tick()
        changed.append(time.perf_counter() - s)
    return changed


def time_heartbeats(coord: Coordinator, sessions: dict[str, str],
                    on: dict[str, TaskReport]) -> list[float]:
    beats = []
    names = list(sessions)
    random.Random(0).shuffle(names)
    mem = MemoryStatus(budget_bytes=GiB, in_use_bytes=100 << 20, peak_bytes=200 << 20)
    for name in names:
        reports = [on[name]] if name in on else []
        s = time.perf_counter()
        coord.heartbeat(name, sessions[name], mem, reports, [30000, 30001])
        beats.append(time.perf_counter() - s)
    return beats


def time_submits(coord: Coordinator) -> list[float]:
    submits = []
    for _ in range(200):
        s = time.perf_counter()
        job = coord.submit(SPEC)
        submits.append(time.perf_counter() - s)
        coord.cancel(job.id)
    return submits


def time_retention(coord: Coordinator, clock: Clock) -> list[float]:
    retention = []
    for _ in range(5):
        coord._next_expiry = 0.0
        s = time.perf_counter()
        coord._expire(clock.now)
        retention.append(time.perf_counter() - s)
    return retention


def time_web(coord: Coordinator) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """For ``/metrics`` and ``/api/state``: the seconds of each read on the coordinator's loop,
    the longest it held the loop at once, and the part in a thread."""
    web = Web(coord, None)
    served: dict[str, tuple[list[float], list[float], list[float]]] = {}
    for path in ("/metrics", "/api/state"):
        on_loop, longest, made = served.setdefault(path, ([], [], []))
        for _ in range(5):
            s = time.perf_counter()
            # on the coordinator's loop (a revision before the split made it all there)
            code, _, body = web._route(path, {}) if hasattr(web, "_route") else \
                web.route(path, {})
            parts = [time.perf_counter() - s]
            assert code == 200
            if hasattr(body, "steps"):  # read in steps, the loop running in between
                while True:
                    s = time.perf_counter()
                    if next(body.steps, StopIteration) is StopIteration:
                        break
                    parts.append(time.perf_counter() - s)
                body = body.write
            on_loop.append(sum(parts))
            longest.append(max(parts))
            s = time.perf_counter()
            if callable(body):
                body()  # in a thread
            made.append(time.perf_counter() - s)
    return served


def main() -> None:
    args = parse_args()
    tmp = tempfile.mkdtemp(prefix="strata-cp-")
    db = os.path.join(tmp, "s.db")
    clock = Clock()
    queues = load_queues(args.queues) if args.queues else None
    coord = Coordinator(SqliteStore(db), tmp, heartbeat_timeout_s=1e9, clock=clock,
                        queues=queues)
    coord.max_pending_per_user = 10**9  # one simulated user queues them all
    t0 = time.perf_counter()
    sessions, running, on = populate(coord, args)
    setup_s = time.perf_counter() - t0
    # the long-lived state out of the collector's walks, as the coordinator's GcPolicy keeps
    # it: else a full collection of it (60 ms here) lands in whichever step allocates
    gc.collect()
    gc.freeze()

    ticks = time_ticks(coord, clock)
    changed = time_ticks_after_change(coord, clock, sessions, running, on)
    beats = time_heartbeats(coord, sessions, on)
    submits = time_submits(coord)

    s = time.perf_counter()
    coord.list_workers()
    list_s = time.perf_counter() - s
    retention = time_retention(coord, clock)
    gc.collect()
    gc.freeze()
    served = time_web(coord)
    coord.store.close()

    s = time.perf_counter()
    again = Coordinator(SqliteStore(db), tmp, heartbeat_timeout_s=1e9, clock=clock)
    restart_s = time.perf_counter() - s
    again.store.close()

    print(json.dumps({
        "agents": args.agents + 1, "jobs_held": len(coord.jobs), "running": args.running + 1,
        "pending": args.pending, "finished": args.finished + 200,
        "setup_s": round(setup_s, 1),
        "tick_ms_median": round(1e3 * statistics.median(ticks), 2),
        "tick_after_change_ms_median": round(1e3 * statistics.median(changed), 2),
        "heartbeat_us_mean": round(1e6 * statistics.mean(beats), 1),
        "heartbeat_us_p99": round(1e6 * p(beats, 0.99), 1),
        "heartbeats_per_s_one_core": round(1 / statistics.mean(beats)),
        "submit_ms_p50": round(1e3 * p(submits, 0.5), 2),
        "submit_ms_p99": round(1e3 * p(submits, 0.99), 2),
        "list_workers_ms": round(1e3 * list_s, 1),
        "retention_pass_ms_median": round(1e3 * statistics.median(retention), 2),
        **{f"{key}_{where}_ms_median": round(1e3 * statistics.median(part), 1)
           for key, path in (("metrics_scrape", "/metrics"), ("status_page_state", "/api/state"))
           for where, part in zip(("on_loop", "longest_hold", "in_thread"), served[path])},
        "restart_s": round(restart_s, 2),
    }))


def compare(rev: str, argv: list[str], script: str = __file__) -> None:
    """Runs ``script`` (this benchmark by default) on revision ``rev`` and on this checkout,
    one after the other; each run's last line of output is its JSON figures."""
    import shutil
    import subprocess

    base = tempfile.mkdtemp(prefix="strata-cp-base-")
    tree = os.path.join(base, "tree")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tree, rev], check=True,
                   capture_output=True)
    try:
        shim = os.path.join(base, "shim", "strata")  # the installed layout: strata.coordinator...
        os.makedirs(shim)
        for name in os.listdir(os.path.join(tree, "strata")):
            os.symlink(os.path.join(tree, "strata", name), os.path.join(shim, name))
        for sub in ("coordinator", "worker", "protos"):
            os.symlink(os.path.join(tree, sub), os.path.join(shim, sub))
        runs = {}
        for label, env in (("before", {"PYTHONPATH": os.path.dirname(shim),
                                       "STRATA_BENCH_SHIM": "1"}), ("after", {})):
            out = subprocess.run([sys.executable, os.path.abspath(script), *argv],
                                 env={**os.environ, **env}, capture_output=True, text=True,
                                 check=True, cwd=base).stdout
            runs[label] = json.loads(out.strip().splitlines()[-1])
            print(label, rev if label == "before" else "this checkout", json.dumps(runs[label]))
        ratios = {k: round(runs["before"][k] / runs["after"][k], 1)
                  for k in runs["after"] if k.endswith(("_ms_median", "_us_mean", "_us_p99",
                                                        "_ms_p99", "_ms", "_s"))
                  and isinstance(runs["after"][k], (int, float)) and runs["after"][k] > 0}
        print("before / after", json.dumps(ratios))
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree],
                       capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    if "--compare" in sys.argv:
        i = sys.argv.index("--compare")
        argv = sys.argv[1:i] + sys.argv[i + 2:]
        if "--queues" in argv:  # (each run's working directory is a temporary one)
            q = argv.index("--queues") + 1
            argv[q] = os.path.abspath(argv[q])
        compare(sys.argv[i + 1], argv)
    else:
        main()
