"""Budgets under CPU contention: large-batch data-parallel jobs, three at once, at a given limit.

    .venv/bin/python bench/contention_budget.py --limit-mib 111 [--rounds 3]

Each round starts three 2-worker digits MLP jobs (64-1024-512-256-10, global batch 8,192:
4,096 examples per replica, 3 steps) at once on this machine's cores, every task under the
same allocator limit (TF_CPU_BFC_MEM_LIMIT_IN_MB). Prints each job's exit statuses and peaks
in use, and how many jobs ran out of memory (exit 75). Without `--limit-mib` the limit is the
planner's own budget for the job.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from strata.memory import default_budget, estimate_task_memory  # noqa: E402
from strata.spec import parse_job_spec  # noqa: E402
from test_task_process import launch, make_spec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--limit-mib", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    spec = make_spec()
    spec["data"] = {**spec["data"], "batch_size": 8192}
    spec["training"] = {**spec["training"], "epochs": 0, "steps": 3}
    parsed = parse_job_spec({k: v for k, v in spec.items() if k != "parameter_servers"})
    estimate = estimate_task_memory(parsed.to_dict(), parsed.per_replica_batch)
    limit = args.limit_mib or default_budget(estimate) >> 20
    print(f"estimate {estimate.total / 2**20:.1f} MiB, planner's budget "
          f"{default_budget(estimate) >> 20} MiB, limit {limit} MiB")
    failed = total = 0
    for _ in range(args.rounds):
        jobs = [launch(spec, pathlib.Path(tempfile.mkdtemp()), workers=2, bfc_mb=limit)
                for _ in range(3)]
        for tasks in jobs:
            rcs = [t.wait() for t in tasks]
            total += 1
            failed += any(rc == 75 for rc in rcs)
            peaks = [round(t.of("result")[0]["memory"]["peak"] / 2**20, 1)
                     if t.of("result") else None for t in tasks]
            print(f"exit {rcs} peaks (MiB) {peaks}", flush=True)
    print(f"limit {limit} MiB: {failed} of {total} jobs ran out of memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
