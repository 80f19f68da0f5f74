"""Restart time against history: a coordinator restarting over N finished jobs.

    .venv/bin/python bench/restart_history.py [--finished 100000] [--tasks 4] [--compare REV]

One real job (``--tasks`` workers) is submitted and cancelled on a coordinator with its real
SQLite store; its rows are then copied in SQL to ``--finished`` finished jobs (as many rows as
a coordinator that ran them would hold), plus 10 live jobs waiting for room. A new
coordinator is then created on the store: the seconds until it can serve (what a restart costs
before listening), and how many jobs it holds as objects. With --compare REV the same runs on
revision REV first (``bench/control_plane.compare``).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.environ.get("STRATA_BENCH_SHIM"):
    sys.path.insert(0, ROOT)

from strata.coordinator.core import Coordinator  # noqa: E402
from strata.coordinator.store import SqliteStore  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--finished", type=int, default=100_000)
    ap.add_argument("--tasks", type=int, default=4)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="strata-history-")
    db = os.path.join(tmp, "state.db")
    spec = {"name": "h", "workers": args.tasks,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64],
                                  "classes": 10}},
            "data": {"source": "digits", "batch_size": 64 * args.tasks},
            "training": {"steps": 10}, "memory": {"per_task_budget": "100MiB"}}
    coord = Coordinator(SqliteStore(db), tmp, heartbeat_timeout_s=1e9, clock=Clock())
    job = coord.submit(spec)
    coord.cancel(job.id)
    for i in range(10):  # live: no agent, they wait
        coord.submit({**spec, "name": f"live-{i}"})
    coord.store.close()
    con = sqlite3.connect(db)
    row = con.execute("SELECT * FROM jobs WHERE id=?", (job.id,)).fetchone()
    tasks = con.execute("SELECT * FROM tasks WHERE job_id=?", (job.id,)).fetchall()
    rec = con.execute("SELECT * FROM job_recovery WHERE job_id=?", (job.id,)).fetchone()
    ids = [f"h-{i:07d}" for i in range(args.finished)]
    con.execute("BEGIN")
    con.executemany("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                    ((i,) + row[1:] for i in ids))
    con.executemany("INSERT INTO tasks VALUES (?,?,?,?)", ((i,) + t[1:] for i in ids for t in tasks))
    con.executemany("INSERT INTO job_recovery VALUES (?,?,?)", ((i, "", rec[2]) for i in ids))
    con.execute("COMMIT")
    con.close()
    start = time.perf_counter()
    again = Coordinator(SqliteStore(db), tmp, heartbeat_timeout_s=1e9, clock=Clock())
    restart_s = time.perf_counter() - start
    loaded = getattr(again.jobs, "loaded_jobs", lambda: list(again.jobs.values()))()
    print(json.dumps({"finished_jobs": args.finished + 1, "task_rows": (args.finished + 1)
                      * len(tasks), "jobs_held": len(again.jobs), "jobs_loaded": len(loaded),
                      "restart_s": round(restart_s, 2)}))


if __name__ == "__main__":
    if "--compare" in sys.argv:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from control_plane import compare

        i = sys.argv.index("--compare")
        compare(sys.argv[i + 1], sys.argv[1:i] + sys.argv[i + 2:], script=__file__)
    else:
        main()
