"""How many threads a multi-worker mirrored task holds as it trains: a 2-worker MLP job on two
local agents, its task processes' thread counts and the job's step every 5 s for 20 s.

    .venv/bin/python bench/task_threads.py

A task's threads should not grow with its steps (TensorFlow's per-collective timeout kept a
sleeping thread per all-reduce: docs/checkpoints.md). Prints one line per sample.
"""

from __future__ import annotations

import glob
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from strata.local import LocalCluster  # noqa: E402

from conftest import wait_until  # noqa: E402

MODEL = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64], "classes": 10}}


def task_threads() -> list[int]:
    """The thread counts of the task processes running now (warm or cold started)."""
    out = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmd = f.read()
            if b"strata.worker.warm" not in cmd and b"strata.worker.task" not in cmd:
                continue
            with open(path.replace("cmdline", "status")) as f:
                n = int(next(line.split()[1] for line in f if line.startswith("Threads:")))
        except (OSError, StopIteration, ValueError):
            continue
        if n > 20:  # (a warm process not yet given a task holds a handful)
            out.append(n)
    return sorted(out)


def main() -> int:
    with LocalCluster(workers=2, memory_budget="1GiB", threads=1, warm_pool=0) as c, \
            c.client() as client:
        job = client.submit({"name": "threads", "workers": 2, "model": MODEL,
                             "data": {"source": "digits", "batch_size": 64},
                             "training": {"steps": 10 ** 6}})
        wait_until(lambda: client.get(job.id).metrics.step >= 50, 300, interval=0.2,
                   what="50 steps")
        t0 = time.time()
        for _ in range(4):
            time.sleep(5)
            print(f"{time.time() - t0:4.0f} s: step {client.get(job.id).metrics.step}, "
                  f"task threads {task_threads()}", flush=True)
        client.cancel(job.id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
