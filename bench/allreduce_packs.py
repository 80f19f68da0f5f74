"""All-reduce pack sizes, interleaved: which default (``gradients.pack_size``) is fastest here.

    .venv/bin/python bench/allreduce_packs.py

A 2-worker multi_worker_mirrored job of the seed MLP (bench/allreduce.py's) at per-worker
batches 128 and 1024, with one pack, 1 MiB and 2 MiB packs, three rounds in rotation; prints
each run's steady examples/s and the medians.
"""

import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, ROOT)
from allreduce import steady_rate, steps_for, throughput_spec  # noqa: E402
from service_overhead import finish, launch  # noqa: E402

PACKS = (("one pack", "0"), ("1MiB", "1MiB"), ("2MiB", "2MiB"))


def main() -> int:
    work = tempfile.mkdtemp(prefix="strata-packs-")
    res: dict = {}
    for rnd in range(3):
        for b in (128, 1024):
            for label, size in PACKS:
                raw = throughput_spec(2, b, 1, steps_for(5, 15000, 2 * b), {"pack_size": size})
                r = steady_rate(finish(launch(raw, 1, work))[0], 2 * b)
                res.setdefault((b, label), []).append(r)
                print(rnd, b, label, f"{r:,.0f}", flush=True)
    for (b, label), v in res.items():
        print(f"batch {b} {label}: median {statistics.median(v):,.0f}",
              [f"{x:,.0f}" for x in v])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
