"""What a resize of an elastic job costs: a job of ``workers: {min: 2, max: 4}`` grows from 2
to 4 workers when two agents join, then shrinks back to 2 when one of the four is drained with
notice, for the seed MLP and a ResNet50-size model (25.5 M parameters).

    .venv/bin/python bench/resize_cost.py [--cases mlp,big] [--rounds 3] [--warm-pool 1]

For each case a fresh local cluster of two 1 GiB agents (1 intra-op thread per task, the
agents' default warm pool of one task process with TensorFlow imported); once the job has
trained ``--after`` steps two more agents are added. Timed from the coordinator's events:

- grow: from the resize's notice to the checkpoint saved (the job trains on until the step it
  was told), to the job placed 4 wide, to every task running, to the first step trained 4 wide;
- shrink: from ``strata drain --deadline 30s`` of one agent to the same marks at 2 wide;

with the steps trained again over both (0 when both saves came in time): medians of
``--rounds`` rounds, each on a fresh cluster. Prints a Markdown table (the top table of
docs/benchmarks.md keeps the figures that hold).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from strata.local import LocalCluster  # noqa: E402
from strata.types import JobState  # noqa: E402

from conftest import wait_until  # noqa: E402
from notice_cost import BIG_MLP, SEED_MLP  # noqa: E402  (the same two models)
CASES = {"mlp": (SEED_MLP, 100000), "big": (BIG_MLP, 100000)}  # name: (model, steps)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help="of " + ", ".join(CASES))
    p.add_argument("--after", type=int, default=30, help="steps trained before each resize")
    p.add_argument("--warm-pool", type=int, default=1, help="each agent's --warm-pool")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case (medians shown)")
    return p.parse_args()


def at(events: list, after: float, *words: str) -> float:
    """The time of the first event at or after ``after`` whose message has ``words``."""
    return next((e.time for e in events if e.time >= after
                 and all(w in e.message for w in words)), float("nan"))


def marks(events: list, t0: float, wide: int) -> tuple[float, ...]:
    """From ``t0``: saved, placed, running, first step at ``wide`` workers."""
    saved = at(events, t0, "saved on notice")
    placed = at(events, saved, "SCHEDULED")
    running = at(events, placed, f"running {wide} wide")
    step = at(events, placed, "resumed from the checkpoint")
    return tuple(x - t0 for x in (saved, placed, running, step))


def measure(case: str, args: argparse.Namespace) -> tuple:
    model, steps = CASES[case]
    with LocalCluster(workers=2, memory_budget="1GiB", threads=1, heartbeat_timeout_s=6,
                      warm_pool=args.warm_pool) as c, c.client() as client:
        job = client.submit({
            "name": f"resize-{case}", "workers": {"min": 2, "max": 4}, "model": model,
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": steps},
            "restart": {"max_restarts": 1, "backoff_s": 0}})

        def running(width: int, past: int):
            j = client.get(job.id)
            assert not j.state.final, j.message
            return j if (len(j.tasks) == width and j.state == JobState.RUNNING
                         and j.metrics.step >= past) else None
        j = wait_until(lambda: running(2, args.after), 300, interval=0.05, what="2 wide")
        c.add_worker("w3", wait=False)
        c.add_worker("w4")
        j = wait_until(lambda: running(4, j.metrics.step + args.after), 300, interval=0.1,
                       what="4 wide")
        t_drain = time.time()
        client.drain("w4", deadline_s=30)
        wait_until(lambda: running(2, j.metrics.step + 1), 300, interval=0.1,
                   what="2 wide again")
        # resumed 2 wide: what the resizes cost is known; the rest of the job is not needed
        wait_until(lambda: any("resumed from" in e.message for e in client.watch(job.id)
                               if e.seq and e.time > t_drain), 300, interval=0.5,
                   what="the resumed step")
        final = client.get(job.id)
        client.cancel(job.id)
        events = [e for e in client.watch(job.id) if e.seq]
    t_grow = at(events, 0, "grows from 2 to 4")
    return (case, marks(events, t_grow, 4), marks(events, t_drain, 2), final.steps_repeated,
            final.recovery.resizes)


def median_of(rounds: list[tuple]) -> tuple:
    """The rounds of one case as one row: each figure's median, the counts' largest."""
    mid = [tuple(statistics.median(r[k][i] for r in rounds) for i in range(4)) for k in (1, 2)]
    return (rounds[0][0], mid[0], mid[1], max(r[3] for r in rounds),
            max(r[4] for r in rounds))


def main() -> int:
    args = parse_args()
    rows = [median_of([measure(case, args) for _ in range(args.rounds)])
            for case in args.cases.split(",")]
    print(f"elastic 2-4, warm pool {args.warm_pool}, {args.after} steps before each resize; "
          f"medians of {args.rounds} rounds")
    print("| case | resize | to saved (s) | to placed (s) | to running (s) | to first step (s) "
          "| steps trained again (most) | resizes |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case, grow, shrink, repeated, resizes in rows:
        for name, m in (("grow 2 -> 4", grow), ("shrink 4 -> 2 (drain, 30 s)", shrink)):
            print(f"| {case} | {name} | " + " | ".join(f"{x:.2f}" for x in m)
                  + f" | {repeated} | {resizes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
