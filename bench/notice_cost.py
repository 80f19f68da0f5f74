"""What a notice costs: a job moved off a worker that leaves with notice (``strata drain
--deadline``), per strategy and model size.

    .venv/bin/python bench/notice_cost.py [--deadline 30] [--cases mlp,big]

On one local cluster of four 1 GiB agents (1 intra-op thread per task), for each case: the
job runs without periodic checkpoints near (``checkpoint.every_steps`` beyond its length); once
it has trained ``--after`` steps, the worker of one of its tasks is drained with a deadline.
Timed from the drain: the notice's event, the checkpoint's report (the restart), the job placed
again, its resumed first step; with the steps trained again (0 when the save came in time) and
the step saved at. The drained agent is then
restarted under its name, so that every case finds four (a parameter-server job needs
three agents besides the one that leaves).

Prints a Markdown table (the top table of docs/benchmarks.md keeps the figures that hold).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from strata.local import LocalCluster  # noqa: E402
from strata.types import JobState  # noqa: E402

from conftest import wait_until  # noqa: E402

SEED_MLP = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 256],
                        "classes": 10}}
#: about ResNet50's 25.6 M parameters (25.5 M here), as a model this suite's digits data feeds
BIG_MLP = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [4096, 4096, 2048],
                       "classes": 10}}
CASES = {  # name: (strategy, extra fields, model, steps, the task whose worker leaves)
    "mirrored-mlp": ("multi_worker_mirrored", {"workers": 2}, SEED_MLP, 3000, ("worker", 1)),
    "pipeline-mlp": ("pipeline", {"workers": 1, "stages": 2, "microbatches": 2}, SEED_MLP,
                     4000, ("worker", 0)),
    "ps-mlp": ("parameter_server", {"workers": 1, "parameter_servers": 1}, SEED_MLP, 4000,
               ("ps", 0)),
    "mirrored-big": ("multi_worker_mirrored", {"workers": 2}, BIG_MLP, 400, ("worker", 1)),
}


def spec(name: str, case: str) -> dict:
    strategy, extra, model, steps, _ = CASES[case]
    return {"name": name, "strategy": strategy, **extra, "model": model,
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": steps},
            "checkpoint": {"every_steps": 100000, "keep": 2},
            "restart": {"max_restarts": 1, "backoff_s": 0}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deadline", type=float, default=30.0, help="the notice's deadline (s)")
    p.add_argument("--after", type=int, default=50, help="steps trained before the notice")
    p.add_argument("--cases", default=",".join(CASES), help="of " + ", ".join(CASES))
    return p.parse_args()


def first_event(events: list, *words: str) -> float:
    return next((e.time for e in events if all(w in e.message for w in words)), float("nan"))


def measure(c: LocalCluster, client, case: str, args: argparse.Namespace) -> tuple:
    """One notice: the times from the drain, the steps trained again, the save's seconds."""
    _, _, _, steps, (role, index) = CASES[case]
    job = client.submit(spec(f"notice-{case}", case))
    j = wait_until(lambda: (lambda j: j if j.state.final or j.metrics.step >= args.after
                            else None)(client.get(job.id)), 300, interval=0.05,
                   what=f"{args.after} steps")
    assert not j.state.final, j.message
    leaving = next(t.worker for t in j.tasks if (t.role, t.index) == (role, index))
    at_step, t0 = j.metrics.step, time.time()
    client.drain(leaving, deadline_s=args.deadline)
    final = client.wait(job.id, timeout=900)
    assert final.state == JobState.SUCCEEDED and final.metrics.step == steps, final.message
    events = [e for e in client.watch(job.id) if e.seq]
    saved = first_event(events, "restart 1:", "saved on notice")
    placed = [e.time for e in events if e.message.startswith("SCHEDULED")][-1]
    resumed = first_event(events, "resumed from the checkpoint")
    c.kill_worker(leaving)
    c.add_worker(leaving)
    return (case, at_step, first_event(events, "leaves within") - t0, saved - t0,
            placed - t0, resumed - t0, final.steps_repeated, final.checkpoint_step)


def main() -> int:
    args = parse_args()
    rows = []
    with LocalCluster(workers=4, memory_budget="1GiB", threads=1, heartbeat_timeout_s=4) as c:
        with c.client() as client:
            for case in args.cases.split(","):
                rows.append(measure(c, client, case, args))
    print(f"notice deadline {args.deadline:g} s, after {args.after} steps")
    print("| case | step at the drain | to the notice (s) | to the saved checkpoint (s) | "
          "to placed again (s) | to the resumed step (s) | steps trained again | saved at |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for case, at, notice, saved, placed, resumed, repeated, ckpt in rows:
        print(f"| {case} | {at} | {notice:.2f} | {saved:.2f} | {placed:.2f} | {resumed:.2f} | "
              f"{repeated} | {ckpt} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
