"""Goodput under churn: a 4-agent data-parallel job while agents leave with notice at random
intervals and come back, against the same job without churn.

    .venv/bin/python bench/goodput_churn.py [--minutes 6] [--every 120] [--seed 1] [--agents 5]

A local cluster of ``--agents`` 1 GiB agents (1 intra-op thread per task, warm pools of one;
five by default: the job's four and a spare, see below) runs the
seed MLP (digits, global batch 64) 4 wide for a fixed number of steps: as many as it trains in
``--minutes`` without churn (calibrated first). Then, for each mode, the same job under the same
churn: every ``--every`` seconds on average (uniform in 0.75-1.25 of it, from ``--seed``, the
same times in every mode) one agent holding a task of the job gets a notice with a 30 s
deadline; it leaves at the deadline (or once the job's tasks have left it) and comes back
``--down`` seconds later. Modes:

- ``periodic``: today's behaviour without notices: the agent is killed at its deadline, the job
  loses the steps since its last periodic checkpoint (``checkpoint.every_steps``, about
  ``--checkpoint-s`` of training) and restarts on the agents left;
- ``notice``: ``strata drain --deadline 30s``: the job saves at a step its tasks all reach
  and restarts from it on the agents left (2 wide of 3: the batch divides by 2, not 3), and
  goes back to 4 wide only at a later restart;
- ``elastic``: the same with ``workers: {min: 2, max: 4}``: it also grows back to 4 when the
  agent returns.

Goodput: the churn-free run's wall time over the mode's, for the same steps (useful examples
per second against the run without churn). Also: notices, restarts, resizes, steps trained
again. Prints a Markdown table.

Why a spare by default: on these 2-core machines four task processes share two cores, so a job
2 wide trains its global batch faster than 4 wide (measured with ``--agents 4``: a run that
lost 8,724 steps to two kills still finished in 263 s against 303 s without churn). Without a
spare, churn would look like a speed-up; with one, a job that loses an agent moves to the spare
and keeps its width, and what is measured is what churn costs: the saves, the restarts and the
steps trained again. Where width buys throughput (one GPU per agent), ``--agents 4`` shows the
elastic job's growing back.
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

from strata.local import LocalCluster  # noqa: E402
from strata.types import JobState  # noqa: E402

from conftest import wait_until  # noqa: E402

MODEL = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 256], "classes": 10}}
DEADLINE_S = 30.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=6.0, help="the churn-free run's length")
    p.add_argument("--every", type=float, default=120.0, help="mean seconds between notices")
    p.add_argument("--down", type=float, default=60.0, help="seconds an agent stays away")
    p.add_argument("--checkpoint-s", type=float, default=60.0,
                   help="periodic checkpoints, in seconds of churn-free training")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default="periodic,notice,elastic")
    p.add_argument("--agents", type=int, default=5, help="agents (the job is 4 wide)")
    return p.parse_args()


def job_spec(name: str, steps: int, every: int, elastic: bool) -> dict:
    return {"name": name, "workers": {"min": 2, "max": 4} if elastic else 4, "model": MODEL,
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": steps},
            "checkpoint": {"every_steps": every, "keep": 2},
            "restart": {"max_restarts": 100, "backoff_s": 1}}


def cluster(agents: int) -> LocalCluster:
    """``agents`` agents (``worker-0`` ...), started by ``with``."""
    return LocalCluster(workers=agents, memory_budget="1GiB", threads=1,
                        heartbeat_timeout_s=6, warm_pool=1)


def calibrate(agents: int, seconds: float = 40.0) -> float:
    """Steps per second of the churn-free job, after its start."""
    with cluster(agents) as c, c.client() as client:
        job = client.submit(job_spec("calibrate", 10 ** 7, 10 ** 7, False))
        j = wait_until(lambda: (lambda j: j if j.metrics.step >= 200 else None)(
            client.get(job.id)), 300, interval=0.2, what="200 steps")
        s0, t0 = j.metrics.step, time.time()
        time.sleep(seconds)
        j = client.get(job.id)
        client.cancel(job.id)
        return (j.metrics.step - s0) / (time.time() - t0)


def run(mode: str, steps: int, every: int, args: argparse.Namespace) -> dict:
    """One run of the job in ``mode`` ("none": no churn); its wall time and counts."""
    rng = random.Random(args.seed)
    with cluster(args.agents) as c, c.client() as client:
        job = client.submit(job_spec(f"churn-{mode}", steps, every, mode == "elastic"))
        t0 = time.time()
        next_notice = t0 + rng.uniform(0.75, 1.25) * args.every
        leaving: dict[str, float] = {}  # agent -> its deadline
        away: dict[str, float] = {}  # agent -> when it comes back
        notices = 0
        while True:
            j = client.get(job.id)
            if j.state.final:
                break
            now = time.time()
            for name, back in list(away.items()):
                if now >= back:
                    c.add_worker(name, wait=False)
                    del away[name]
            for name, deadline in list(leaving.items()):
                # with notice: it leaves once the job's tasks have; without: at the deadline
                moved = mode != "periodic" and not any(
                    t.worker == name and not t.state.final for t in j.tasks)
                if now >= deadline or moved:
                    c.kill_worker(name, signal.SIGKILL if mode == "periodic"
                                  else signal.SIGTERM)
                    del leaving[name]
                    away[name] = time.time() + args.down
            if mode != "none" and now >= next_notice:
                next_notice += rng.uniform(0.75, 1.25) * args.every
                holding = sorted({t.worker for t in j.tasks if t.worker and not t.state.final}
                                 - set(away) - set(leaving))
                if holding and j.state == JobState.RUNNING:
                    victim = rng.choice(holding)
                    notices += 1
                    leaving[victim] = now + DEADLINE_S
                    if mode != "periodic":
                        client.drain(victim, deadline_s=DEADLINE_S)
            time.sleep(0.25)
        wall = time.time() - t0
        assert j.state == JobState.SUCCEEDED and j.metrics.step == steps, j.message
        events = [e for e in client.watch(job.id) if e.seq]
    return {"mode": mode, "wall": wall, "notices": notices, "restarts": j.restarts,
            "resizes": j.recovery.resizes, "repeated": j.steps_repeated,
            "saved_on_notice": sum(e.kind == "restart" and "saved on notice" in e.message
                                   for e in events)}


def main() -> int:
    args = parse_args()
    rate = calibrate(args.agents)
    steps = int(rate * args.minutes * 60)
    every = max(1, int(rate * args.checkpoint_s))
    print(f"calibrated: {rate:.1f} steps/s; {steps} steps, a periodic checkpoint every {every}",
          flush=True)
    rows = [run("none", steps, every, args)]
    print(rows[-1], flush=True)
    for mode in args.modes.split(","):
        rows.append(run(mode, steps, every, args))
        print(rows[-1], flush=True)
    base = rows[0]["wall"]
    print(f"\n{steps} steps of the seed MLP 4 wide, {args.agents} agents; a notice every "
          f"{args.every:g} s on "
          f"average (30 s deadline), the agent away {args.down:g} s; periodic checkpoints every "
          f"{every} steps")
    print("| mode | wall (s) | goodput | notices | saved on notice | restarts | resizes "
          "| steps trained again |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['wall']:.0f} | {base / r['wall']:.2f} | {r['notices']} | "
              f"{r['saved_on_notice']} | {r['restarts']} | {r['resizes']} | {r['repeated']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
