"""Peak growth after the probe: does a budget derived from a ``memory.profile`` probe (3 steps
and the evaluation) cover the whole run?

    .venv/bin/python bench/peak_growth.py [--workloads a,b] [--steps N]
                                          [--out bench/results/peak_growth.jsonl] [--table]

Each row is one real job of users' code (``bench/peak_growth_code/workloads.py``: TensorFlow's
multi-worker tutorial at MNIST's shape, keras.applications MobileNetV2 and ResNet50 at 32x32,
a stacked LSTM, a two-block transformer; compiled by the code, datasets as tf.distribute
calls them) on two data-parallel workers of a local cluster, with ``memory.profile: true``:
the probe measures each task kind, the job is budgeted from that, then runs ``--steps``
steps and its evaluation. A row records, per kind: the probe's peak, the run's budget and
peak, ``run / probe``, and where the run's peak grew (each task's ``memory peak grew at``
log line: after which step, checkpoint, the evaluation or the outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 1 << 20
CODE = os.path.join(ROOT, "bench", "peak_growth_code")

#: name -> (model function, dataset function, global batch)
WORKLOADS: dict[str, tuple[str, str, int]] = {
    "tutorial-mnist": ("tutorial_model", "mnist_dataset", 128),
    "mobilenetv2-32": ("mobilenet", "images_with_test", 64),
    "resnet50-32": ("resnet50", "images_with_test", 64),
    "lstm-256-128": ("lstm", "sequences_with_test", 64),
    "transformer-2": ("transformer", "sequences_with_test", 64),
}


def spec_of(name: str, steps: int) -> dict[str, Any]:
    model, dataset, batch = WORKLOADS[name]
    return {"name": name, "strategy": "multi_worker_mirrored", "workers": 2,
            "code": {"dir": CODE, "model": f"workloads:{model}",
                     "dataset": f"workloads:{dataset}"},
            "data": {"batch_size": batch}, "training": {"steps": steps},
            "memory": {"profile": "true"}}


def growth(client: Any, job_id: str) -> dict[str, str]:
    out = {}
    for role, index, data in client.logs(job_id):
        for line in data.decode(errors="replace").splitlines():
            m = re.search(r"memory peak grew at: (.*)", line)
            if m:
                out[f"{role}:{index}"] = m.group(1)[:2000]
    return out


def run(names: list[str], steps: int, out: str, timeout: float) -> None:
    from strata.local import LocalCluster

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with LocalCluster(workers=2, memory_budget="4GiB", threads=1) as cluster, \
            cluster.client() as client:
        for name in names:
            t0 = time.time()
            job = client.submit(spec_of(name, steps))
            final = client.wait(job.id, timeout=timeout)
            probes = [j for j in client.jobs() if j.name == f"{name}-probe"]
            probe = client.get(max(probes, key=lambda j: j.created_at).id) if probes else None
            got = client.get(job.id)
            row: dict[str, Any] = {"workload": name, "steps": steps, "state": final.state.value,
                                   "message": final.message[:300],
                                   "seconds": round(time.time() - t0, 1)}
            if probe is not None:
                row["probe_peak"] = max(t.peak_memory_bytes for t in probe.tasks)
                row["probe_tasks"] = [t.peak_memory_bytes for t in probe.tasks]
            row["estimate"] = max(t.estimated_memory_bytes for t in got.tasks)
            row["budget"] = max(t.memory_budget_bytes for t in got.tasks)
            row["run_peak"] = max(t.peak_memory_bytes for t in got.tasks)
            row["run_tasks"] = [t.peak_memory_bytes for t in got.tasks]
            row["grew"] = growth(client, job.id)
            row["probe_grew"] = growth(client, probe.id) if probe is not None else {}
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(summary(row), flush=True)


def summary(r: dict[str, Any]) -> str:
    if "probe_peak" not in r or not r.get("probe_peak"):
        return f"{r['workload']}: {r['state']} {r['message']}"
    return (f"{r['workload']}: {r['state']} probe {r['probe_peak'] / MiB:.1f} MiB, run "
            f"{r['run_peak'] / MiB:.1f} MiB ({r['run_peak'] / r['probe_peak']:.2f} x probe), "
            f"budget {r['budget'] / MiB:.0f} MiB ({r['run_peak'] / r['budget']:.0%} used)")


def table(out: str) -> str:
    with open(out) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    lines = ["| workload | steps | state | probe peak MiB | run peak MiB | run / probe | "
             "budget MiB | peak / budget |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("probe_peak"):
            lines.append(f"| {r['workload']} | {r['steps']} | {r['state']} | - | - | - | - | - |")
            continue
        lines.append(f"| {r['workload']} | {r['steps']} | {r['state']} | "
                     f"{r['probe_peak'] / MiB:.1f} | {r['run_peak'] / MiB:.1f} | "
                     f"{r['run_peak'] / r['probe_peak']:.2f} | {r['budget'] / MiB:.0f} | "
                     f"{r['run_peak'] / r['budget']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--workloads", default="", help=f"comma-separated, of {list(WORKLOADS)}")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--repeat", type=int, default=1, help="runs of each workload")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "peak_growth.jsonl"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    a = p.parse_args()
    if a.table:
        print(table(a.out))
        return
    names = [n for n in a.workloads.split(",") if n] or list(WORKLOADS)
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; known: {list(WORKLOADS)}")
    run(names * a.repeat, a.steps, a.out, a.timeout)


if __name__ == "__main__":
    main()
