"""Soak: N jobs on a local cluster while processes are killed at random, for up to M minutes.

    .venv/bin/python bench/soak.py --jobs 8 --minutes 10 --workers 4 --kill-every 20

Every ``--kill-every`` seconds (jittered) one of: SIGKILL of a random task process (60%), SIGKILL
of a random agent, restarted a few seconds later under its name (25%), SIGKILL of the
coordinator, restarted on the same state directory and port (15%). Jobs are the digits MLP
under the three strategies, with checkpoints every 100 steps and 6 restarts allowed. At the end
it prints each job (state, steps against plan, restarts, steps trained again), what caused
the restarts, and a summary. It exits 1 if any job ended wrong:
- SUCCEEDED at a step count other than its plan;
- more than one checkpoint interval repeated per restart;
- FAILED for any reason but having used up its restarts (that is the policy working:
  counted apart, as "gave up").

Not part of the test suite (it runs for minutes); figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from strata.client import Client, CoordinatorError  # noqa: E402
from strata.local import LocalCluster  # noqa: E402
from strata.types import JobState  # noqa: E402

from conftest import task_processes  # noqa: E402

EVERY = 100
STRATEGIES = {
    "multi_worker_mirrored": ({"workers": 2}, 1500),
    "parameter_server": ({"workers": 1, "parameter_servers": 1}, 2500),
    "pipeline": ({"workers": 1, "stages": 2, "microbatches": 2}, 3000),
}


def job(i: int, rng: random.Random, max_restarts: int) -> dict:
    strategy = sorted(STRATEGIES)[i % len(STRATEGIES)]  # each strategy in turn
    extra, steps = STRATEGIES[strategy]
    return {"name": f"soak-{i}", "strategy": strategy, **extra,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 256],
                                  "classes": 10}},
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": steps},
            "checkpoint": {"every_steps": EVERY, "keep": 2},
            "restart": {"max_restarts": max_restarts, "backoff_s": 1}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kill-every", type=float, default=20.0, metavar="SECONDS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-restarts", type=int, default=6)
    return p.parse_args()


def kill_one(cluster: LocalCluster, jobs: list, rng: random.Random,
             kills: dict[str, int]) -> None:
    """SIGKILL of a task process (60%), of an agent restarted under its name (25%), or of the
    coordinator restarted on its state (15%); counted in ``kills``."""
    what = rng.choices(["task", "agent", "coordinator"], [60, 25, 15])[0]
    if what == "task":
        pids = [pid for j in jobs if not j.state.final
                for pid in task_processes(f"/jobs/{j.id}/")]
        if pids:
            os.kill(rng.choice(pids), signal.SIGKILL)
            kills["task"] += 1
    elif what == "agent":
        name = rng.choice(sorted(cluster.agents))
        cluster.kill_worker(name, signal.SIGKILL)
        time.sleep(rng.uniform(2, 8))
        cluster.add_worker(name, wait=False)
        kills["agent"] += 1
    else:
        assert cluster.coordinator is not None
        os.killpg(cluster.coordinator.pid, signal.SIGKILL)
        cluster.coordinator.wait(timeout=10)
        time.sleep(rng.uniform(1, 5))
        cluster.start_coordinator()
        kills["coordinator"] += 1


def run_with_kills(cluster: LocalCluster, ids: list[str], args: argparse.Namespace,
                   rng: random.Random, kills: dict[str, int], deadline: float) -> None:
    """Until every job has ended or ``deadline``: one kill every ``--kill-every`` s, jittered."""
    next_kill = time.monotonic() + args.kill_every
    while time.monotonic() < deadline:
        try:
            with Client(cluster.address) as c:
                jobs = [c.get(i) for i in ids]
        except CoordinatorError:
            time.sleep(1)
            continue
        if all(j.state.final for j in jobs):
            break
        if time.monotonic() >= next_kill:
            next_kill = time.monotonic() + args.kill_every * rng.uniform(0.5, 1.5)
            kill_one(cluster, jobs, rng, kills)
        time.sleep(1)


def restart_causes(cluster: LocalCluster, ids: list[str]) -> tuple[list, dict[str, int]]:
    """The jobs as they ended, and how many of their restarts each cause made."""
    causes: dict[str, int] = {}
    with Client(cluster.address) as c:
        jobs = [c.get(i) for i in ids]
        for i in ids:
            for e in c.watch(i):
                if e.seq and e.kind == "restart":
                    kind = next((k for k, text in (
                        ("agent lost", "lost (no heartbeat"), ("task SIGKILLed", "SIGKILL"),
                        ("peer failed", "a collective or a peer"),
                        ("agent restarted", "no longer runs"), ("PS unreachable", "unreachable"),
                        ("stopped", "stopped")) if text in e.message), e.message[:60])
                    causes[kind] = causes.get(kind, 0) + 1
    return jobs, causes


def report(jobs: list, kills: dict[str, int], causes: dict[str, int], wall: float) -> int:
    """Prints each job and the summary; 1 if any job ended wrong."""
    wrong, gave_up = [], []
    print(f"{'job':<12} {'strategy':<22} {'state':<10} {'steps':>11} {'restarts':>8} "
          f"{'repeated':>8}")
    for j in jobs:
        planned = j.metrics.total_steps
        spent = j.state == JobState.FAILED and "no restarts left" in j.message
        ok = (j.state == JobState.SUCCEEDED and j.metrics.step == planned
              and j.steps_repeated <= EVERY * max(1, j.restarts)) or spent
        if spent:
            gave_up.append(j)
        elif not ok:
            wrong.append(j)
        print(f"{j.name:<12} {j.strategy:<22} {j.state.value:<10} "
              f"{j.metrics.step:>5}/{planned:<5} {j.restarts:>8} {j.steps_repeated:>8}"
              + ("  (gave up: no restarts left)" if spent else "" if ok
                 else f"  WRONG: {j.message[:120]}"))
    done = sum(j.state == JobState.SUCCEEDED for j in jobs)
    print(f"\n{done}/{len(jobs)} jobs SUCCEEDED in {wall / 60:.1f} min; kills: "
          f"{kills['task']} task, {kills['agent']} agent, {kills['coordinator']} coordinator; "
          f"restarts {sum(j.restarts for j in jobs)}; steps trained again "
          f"{sum(j.steps_repeated for j in jobs)} (of {sum(j.metrics.step for j in jobs)}); "
          f"gave up: {len(gave_up)}; wrong: {len(wrong)}")
    print("restart causes: " + ", ".join(f"{k} {v}" for k, v in sorted(causes.items())))
    return 1 if wrong else 0


def main() -> int:
    args = parse_args()
    rng = random.Random(args.seed)
    cluster = LocalCluster(workers=args.workers, memory_budget="1GiB", threads=1,
                           heartbeat_timeout_s=4).start()
    kills = {"task": 0, "agent": 0, "coordinator": 0}
    t_start = time.monotonic()
    deadline = t_start + args.minutes * 60
    try:
        with Client(cluster.address) as c:
            ids = [c.submit(job(i, rng, args.max_restarts)).id for i in range(args.jobs)]
        run_with_kills(cluster, ids, args, rng, kills, deadline)
        jobs, causes = restart_causes(cluster, ids)
    finally:
        cluster.stop()
    wall = time.monotonic() - t_start
    return report(jobs, kills, causes, wall)


if __name__ == "__main__":
    sys.exit(main())
