"""Four scheduling policies of a shared cluster compared on one synthetic trace, on a simulated
clock, each driving the coordinator's own pure decisions (``coordinator/policy.py``,
``coordinator/placement.py``): wait by job width, utilisation, each team's share, work lost
to preemption.

    .venv/bin/python bench/sched_sim.py [--days 7] [--workers 1000] [--seed 1]
        [--policies today,fifo,kueue,strata] [--load 0.85] [--out bench/results/sched_sim.md]

A quick run: ``--days 1 --workers 200`` (seconds). The week at 1,000 workers takes a few
minutes for the four policies, one after the other, on one core.

The modules: this one, the command line, the measures and the report; ``simtrace.py``, the
cluster's workers, the queues and the jobs drawn from the seed; ``simpolicies.py``, the
simulated cluster and three policies; ``simstrata.py``, strata's.

The policies, over the same cluster state and the same jobs:

- today: Strata without a queues file: the waiting jobs oldest first, each placed as soon as its
  tasks fit (``placement.place``); no quotas, no reservation, no preemption.
- fifo: strict FIFO: nothing starts before the oldest waiting job (head-of-line blocking).
- kueue: Kueue's ClusterQueues, one per team, in one cohort, BestEffortFIFO, classic
  preemption with ``withinClusterQueue: LowerPriority``, ``reclaimWithinCohort: Any``,
  ``borrowWithinCohort: Never``: a queue may hold its nominal share and borrow the rest of the
  cluster (``policy.room_for``); the waiting jobs in the order Kueue's scheduler takes heads
  across a cohort (``entryOrdering``: a job its queue holds within its nominal quota before one
  that would borrow, then the higher priority, then the older); no reservation, no backfill.
  A job that does not start may preempt: candidates are its own queue's jobs of lower priority
  and the jobs of queues that borrow, ordered borrowing queues first, lowest priority, most
  recently admitted (Kueue's order), taken greedily by Kueue's four heuristics until the job's
  queue may hold it and its tasks place, then given back in reverse where it still would.
  Victims stop after a 30 s grace (a pod's default) and resume from their last periodic
  checkpoint: what they trained since is trained again.
- strata: the coordinator with a queues file, in the sequence of ``ControlLoop._schedule``:
  each owner charged its held workers times the time since the last pass (``FairShare``), the
  waiting jobs in ``policy.order`` (``Standing.of``); per job: a preempted one waits
  while its preemptor waits; a job its queue cannot hold (``room_for``) keeps its queue's
  room if it is the first so held back (``policy.queue_start``) and may only preempt; the
  first job that does not place keeps a room (``policy.reserve``: running jobs' ends from
  ``policy.expected_end``, when it will have trained its time limit, or the remaining steps
  at the measured rate) until it starts, up to 8 such rooms at once, each on the agents the
  older ones leave, computed again at a pass's end when stale (``ControlLoop._keep_room``);
  a later job starts only where ``policy.delays`` says it does not delay a kept room of its
  class or a higher one (``policy.honours``), a queue's kept room nor a preemptor's (backfill
  on ``policy.expected_duration``, the time limit), placed off those rooms when it fits
  there; preemption through ``policy.victims`` with
  ``Running.lost_s`` 0 (every job saves on a 60 s notice), at most one started per pass and
  four looked for, none while the head's reserved start is within 60 s, the preemptor's
  room kept until its victims stop, a victim waiting behind its preemptor.
  The coordinator's shortcuts that skip work without changing a decision are kept
  (``_tick_waiting``'s pass-over, ``_may_find``, ``_tried_preempt`` per room version).

Every preemption costs its victim a restart: 60 s of its workers starting again (restart
overhead), counted apart from work lost (training done again since its last checkpoint).
Every job writes a periodic checkpoint every 30 min of its run's training.

The cluster: ``--workers`` workers, 40% with 16 GiB, 40% 32 GiB, 20% 80 GiB, each taking one
task at a time (one device: ``Capacity.free_ports`` 1 when idle, 0 when busy; its free bytes
kept). Four teams, each a queue: nominal shares 30/30/25/15% of the workers (memory not
bounded), each may borrow the rest of the cluster. Priority classes low 0, normal 100, high
1000; fair share half-life 1 h (the queues file's default).

The workload (seeded), shaped after the published analyses of Microsoft's Philly (Jeon et al.,
"Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads", USENIX ATC
2019) and Alibaba PAI (Weng et al., "MLaaS in the Wild: Workload Analysis and Scheduling in
Large-Scale Heterogeneous GPU Clusters", NSDI 2022): most jobs take one GPU and few are very
wide; run times are heavy-tailed from minutes to days and wider jobs run longer; submissions
follow the working day and week; many jobs come in groups of near-identical ones (sweeps,
PAI's recurring jobs); GPU models differ in memory; teams own quotas of a shared cluster
(Philly's virtual clusters). The parameters below are chosen to have that shape, not fitted to
the papers' figures:

- width (workers): 1 72%, 2 10%, 4 9%, 8 5%, 16 2.5%, 32 1%, 64 0.35%, 128 0.15% (Philly:
  mostly single-GPU, a long thin tail of wide gangs);
- true duration: lognormal, median 30 min x width^0.3, sigma 1.8 (for one worker: median
  30 min, p95 about 10 h), at least 2 min, at most 3 days;
- a task's memory: 55% need at most 15 GiB (any worker), 30% 17-30 GiB (32 or 80 GiB
  workers), 15% 34-76 GiB (80 GiB workers), uniform within; a job too wide for the workers
  its memory needs takes the next smaller class (admission would refuse it);
- submissions: a non-homogeneous Poisson process, rate times 1 + 0.5 cos(2 pi (hour - 14)/24)
  (a day's peak at 14:00), weekends (days 6 and 7) at 0.6; 1.5% of submissions are a sweep
  of 10-50 jobs at once (uniform), one user's, of one width (drawn from the widths up to 8)
  and memory, durations the sweep's draw times lognormal(0, 0.3), priority low; other jobs
  normal, 3% of them high (production);
- teams' demand (share of submissions) 45/30/17/8% against nominal 30/30/25/15%: team a
  over-demands, d and c under-demand; five users per team, Zipf-weighted (1/k);
- ``training.time_limit``: 80% of jobs name one, their duration times uniform 1.5-3,
  rounded up to 15 min (below 2 h) or to the hour; 20% none;
- a measured rate once running (steps/s uniform 1-10, batch 256): ``metrics.step``,
  ``total_steps`` and ``examples_per_sec`` kept current, so ``expected_end`` sees the true
  remaining time (Strata's estimate; Kueue has none);
- load: jobs are drawn until their work (width x duration) is ``--load`` (0.85) of the
  cluster's worker-hours over the ``--days``; their submission times are then drawn from the
  diurnal density (a Poisson process given its count). The offered load is printed.

Scheduling passes run on events (arrival, end, a victim stopping), at most one per
``--pass-gap`` (60 s) of simulated time, and every 10 min while jobs wait.

Measured, per policy (printed as a markdown table and written to ``--out`` with the command,
seed and workload):
- util: busy worker-hours (tasks training, restart startup excluded, work later lost
  included) over the cluster's worker-hours within the arrival window [0, days); util to
  drain: the same over [0, last job's end); goodput: work kept (busy minus lost) over the
  same span as util to drain;
- wait (submit to first start) p50 / p95 per width bucket 1, 2-4, 5-16, 17+, and the longest
  wait of a 17+ job;
- each team's share of the busy worker-hours within the window against its nominal share, and
  Jain's index over the teams with demand of used share / entitled share (its jobs' waits too);
- preemptions (victims stopped), work lost to them and restart overhead, worker-hours;
- jobs that Strata's time limit would fail (``decisions.past_time_limit``: the time trained,
  from the first step, not the time stopped; a preemption sets ``recovery.ran_s`` and a new run
  ``recovery.run_began`` as the coordinator does): counted, not failed.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from simpolicies import BUCKETS, Result  # noqa: E402
from simstrata import POLICIES  # noqa: E402
from simtrace import DAY, HOUR, MINUTE, Trace, make_trace  # noqa: E402



# --- the report -----------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def fmt_wait(s: float) -> str:
    if math.isnan(s):
        return "-"
    if s < 90:
        return f"{s:.0f}s"
    if s < 2 * HOUR:
        return f"{s / MINUTE:.0f}m"
    return f"{s / HOUR:.1f}h"


def jain(r: Result, trace: Trace, demanded: set[str]) -> float:
    total = sum(r.team_wh.values()) or 1.0
    x = [r.team_wh[t] / total / trace.entitled[t] for t in trace.entitled if t in demanded]
    return sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if x else math.nan


def workload_lines(trace: Trace) -> list[str]:
    jobs = trace.jobs
    widths: dict[int, int] = {}
    for j in jobs:
        widths[j.width] = widths.get(j.width, 0) + 1
    work = sum(j.width * j.duration for j in jobs) or 1.0
    team_work = team_offered(trace)
    durations = sorted(j.duration for j in jobs)
    limits = sum(1 for j in jobs if j.spec.training.time_limit_s)
    prios = {p: sum(1 for j in jobs if j.spec.priority == p) for p in ("low", "normal", "high")}
    wide_work = sum(j.width * j.duration for j in jobs if j.width >= 17) / work
    return [
        f"- {len(jobs)} jobs over {trace.span / DAY:g} day(s) ({trace.sweeps} sweeps), "
        f"{len(trace.workers)} workers; offered load {trace.offered:.3f} of the cluster's "
        f"worker-hours in the window",
        "- width histogram (workers: jobs): " + ", ".join(
            f"{w}: {n}" for w, n in sorted(widths.items()))
        + f"; jobs of 17+ workers carry {100 * wide_work:.0f}% of the work",
        f"- duration p50 {fmt_wait(pct(durations, 0.5))}, p95 {fmt_wait(pct(durations, 0.95))}, "
        f"max {fmt_wait(durations[-1] if durations else math.nan)}; "
        f"{limits} jobs name a time limit",
        f"- priority: low {prios['low']}, normal {prios['normal']}, high {prios['high']}",
        "- teams (nominal share / share of the work offered): " + ", ".join(
            f"{t} {trace.entitled[t]:.2f}/{team_work[t]:.2f}" for t in trace.entitled),
    ]


def tables(results: list[Result], trace: Trace) -> list[str]:
    demanded = {j.team for j in trace.jobs}
    head = ("| policy | util | util to drain | goodput | makespan | "
            + " | ".join(f"wait {b} p50 / p95" for b, _, _ in BUCKETS)
            + " | longest 17+ wait | preemptions (jobs) | lost wh | restart wh | Jain | "
              "past time limit | passes | CPU s |")
    out = [head, "|" + " --- |" + " ---: |" * (head.count("|") - 2)]
    for r in results:
        waits = " | ".join(f"{fmt_wait(pct(r.waits[b], 0.5))} / {fmt_wait(pct(r.waits[b], 0.95))}"
                           for b, _, _ in BUCKETS)
        wide = r.waits["17+"]
        out.append(
            f"| {r.policy} | {r.util:.3f} | {r.util_drain:.3f} | {r.goodput:.3f} | "
            f"{r.makespan_h:.0f}h | {waits} | {fmt_wait(max(wide) if wide else math.nan)} | "
            f"{r.preemptions} ({r.preempted_jobs}) | {r.lost_wh:.0f} | {r.overhead_wh:.0f} | "
            f"{jain(r, trace, demanded):.3f} | "
            f"{'-' if r.over_limit is None else r.over_limit} | {r.passes} | {r.cpu_s:.0f} |")
    teams = list(trace.entitled)
    offered = team_offered(trace)
    out += ["", "Each team's share of the busy worker-hours within the window, and its jobs' "
            "wait p50 / p95 (team: nominal share / share of the work offered):", ""]
    out.append("| policy | " + " | ".join(
        f"{t} ({trace.entitled[t]:.2f} / {offered[t]:.2f}) | {t} wait" for t in teams) + " |")
    out.append("|" + " --- |" + " ---: |" * (2 * len(teams)))
    for r in results:
        total = sum(r.team_wh.values()) or 1.0
        out.append(f"| {r.policy} | " + " | ".join(
            f"{r.team_wh[t] / total:.3f} | {fmt_wait(pct(r.team_waits[t], 0.5))} / "
            f"{fmt_wait(pct(r.team_waits[t], 0.95))}" for t in teams) + " |")
    return out


def team_offered(trace: Trace) -> dict[str, float]:
    """Each team's share of the work offered."""
    work = sum(j.width * j.duration for j in trace.jobs) or 1.0
    return {t: sum(j.width * j.duration for j in trace.jobs if j.team == t) / work
            for t in trace.entitled}


def verdicts(results: list[Result]) -> list[str]:
    by = {r.policy: r for r in results}
    s = by.get("strata")
    others = [r for r in results if r.policy != "strata"]
    if s is None or not others:
        return []
    lines = []
    preempting = [r for r in others if r.preemptions]
    if preempting:
        best = min(preempting, key=lambda r: r.lost_wh)
        lines.append(f"- lost work: strata {s.lost_wh:.0f} wh against {best.policy} "
                     f"{best.lost_wh:.0f} wh (the others preempt nothing): "
                     + ("met" if s.lost_wh < best.lost_wh else "NOT met"))
    for label, of in (("17+ wait p95", lambda w: pct(w, 0.95)), ("longest 17+ wait", max)):
        wide = {r.policy: of(r.waits["17+"]) if r.waits["17+"] else math.nan for r in results}
        best_wide = min(others, key=lambda r: wide[r.policy])
        lines.append(f"- {label}: strata {fmt_wait(wide['strata'])} against the best of the "
                     f"others, {best_wide.policy}, {fmt_wait(wide[best_wide.policy])}: "
                     + ("met" if wide["strata"] < wide[best_wide.policy] else "NOT met"))
    for attr, label in (("util", "util"), ("util_drain", "util to drain")):
        top = max(others, key=lambda r: getattr(r, attr))
        d = getattr(s, attr) - getattr(top, attr)
        rel = d / getattr(top, attr) if getattr(top, attr) else 0.0
        lines.append(f"- {label}: strata {getattr(s, attr):.3f} against the best of the others, "
                     f"{top.policy}, {getattr(top, attr):.3f} ({100 * d:+.1f} points, "
                     f"{100 * rel:+.1f}% relative): "
                     + ("met (within 3 points)" if d >= -0.03 else "NOT met"))
    return lines


NOTES_MARK = "<!-- notes below are kept when the file is written again -->"


def revision() -> str:
    """The commit checked out (HEAD), and whether the tracked files differ from it here."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "-uno"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with local changes" if dirty else "")


def write(path: str, argv: list[str], args: argparse.Namespace, trace: Trace,
          results: list[Result], body: list[str], wall_s: float) -> None:
    notes = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = f.read()
        if NOTES_MARK in old:
            notes = old[old.index(NOTES_MARK):]
    cmd = ".venv/bin/python bench/sched_sim.py " + " ".join(shlex.quote(a) for a in argv)
    text = [
        "# Scheduling policies on a simulated week (bench/sched_sim.py)", "",
        "```", cmd.rstrip(), "```", "",
        f"seed {args.seed}; pass gap {args.pass_gap:g} s; run against the working tree of "
        f"commit {revision()}; {wall_s:.0f} s wall for the run (CPU per policy in the "
        "table). Definitions and the workload's distributions: the script's docstring.", "",
        "## Workload", "", *workload_lines(trace), "",
        "## Results", "", *body, "",
        "## Targets (strata against the others)", "", *verdicts(results), "",
    ]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(text) + ("\n" + notes if notes else ""))


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--days", type=float, default=7.0, help="the arrival window (default 7)")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.85,
                    help="offered load: the jobs' work over the window's worker-hours")
    ap.add_argument("--policies", default="today,fifo,kueue,strata")
    ap.add_argument("--pass-gap", type=float, default=60.0,
                    help="simulated seconds between two scheduling passes, at least")
    ap.add_argument("--out", default="", help="write the markdown here too")
    args = ap.parse_args(argv)
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policies {sorted(unknown)} (known: {', '.join(POLICIES)})")
    return args


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    s = began = time.perf_counter()
    trace = make_trace(args.seed, args.days, args.workers, args.load)
    print(f"workload: drawn in {time.perf_counter() - s:.1f} s")
    for line in workload_lines(trace):
        print(line)
    results = []
    for name in args.policies.split(","):
        r = POLICIES[name](trace, args.pass_gap).run()
        print(f"{name}: {r.cpu_s:.1f} s CPU, {r.passes} passes, {r.unfinished} unfinished",
              flush=True)
        results.append(r)
    body = tables(results, trace)
    print()
    print("\n".join(body))
    print()
    print("\n".join(verdicts(results)))
    if args.out:
        write(args.out, argv, args, trace, results, body, time.perf_counter() - began)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
