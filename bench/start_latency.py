"""Submit to first step of a 2-worker job: by hand, through Strata cold, through Strata warm.

    .venv/bin/python bench/start_latency.py [--rounds 4] [--steps 20] [--batch 256]

Three ways to start the same two task processes, in one run, the order rotating each round:
- hand: the two `python -m strata.worker.task` processes launched directly with TF_CONFIG (what
  an agent does, minus the service; `bench/service_overhead.run_by_hand`);
- cold: a Strata cluster whose agents start each task as a new process (`--warm-pool 0`);
- warm: a Strata cluster whose agents keep one process each with TensorFlow imported
  (`--warm-pool 1`).
Every launch starts once the warm pools are full and ready again (each process marks itself
ready when its imports are done), so no refill's imports share the cores with a measurement.

Prints each round and the medians, and warm / hand and cold / hand.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import task_processes, warm_processes  # noqa: E402
from service_overhead import job_spec, run_by_hand, run_through_strata  # noqa: E402

from strata.local import LocalCluster  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    raw = job_spec(args.steps, args.batch)
    work = tempfile.mkdtemp(prefix="strata-start-")
    cold = LocalCluster(workers=2, memory_budget="2GiB", state_dir=os.path.join(work, "cold"),
                        threads=args.threads, warm_pool=0).start()
    warm = LocalCluster(workers=2, memory_budget="2GiB", state_dir=os.path.join(work, "warm"),
                        threads=args.threads, warm_pool=1).start()
    got: dict[str, list[float]] = {"hand": [], "cold": [], "warm": []}
    kinds = ["hand", "cold", "warm"]
    try:
        for r in range(args.rounds):
            order = kinds[r % 3:] + kinds[:r % 3]
            row = {}
            for kind in order:
                # before every launch, not only the warm one: a pool refilling (two
                # TensorFlow imports) would slow whatever runs next
                # and the last job's task processes gone (their exit costs CPU too)
                deadline = time.monotonic() + 120
                while (len(warm_processes(imported=True)) < 2 or len(warm_processes()) > 2
                       or task_processes("")) and time.monotonic() < deadline:
                    time.sleep(0.2)
                time.sleep(1.0)  # the refilled processes settle
                if kind == "warm":
                    row[kind] = run_through_strata(warm, raw)[1]
                elif kind == "cold":
                    row[kind] = run_through_strata(cold, raw)[1]
                else:
                    row[kind] = run_by_hand(raw, args.threads, work)[1]
                got[kind].append(row[kind])
            print(f"round {r + 1}: " + ", ".join(f"{k} {row[k]:.2f} s" for k in kinds)
                  + f" | warm/hand {row['warm'] / row['hand']:.2f}", flush=True)
    finally:
        cold.stop()
        warm.stop()
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"\nsubmit to first step, medians of {args.rounds}: hand {med['hand']:.2f} s, "
          f"cold {med['cold']:.2f} s, warm {med['warm']:.2f} s; warm / hand "
          f"{med['warm'] / med['hand']:.2f}, cold / hand {med['cold'] / med['hand']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
