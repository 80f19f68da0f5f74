"""Service overhead and start latency: a 2-worker job through Strata vs. the same task code
launched by hand with TF_CONFIG (same settings, same machine), in interleaved runs.

    .venv/bin/python bench/service_overhead.py [--pairs 3] [--steps 150] [--batch 2048]

Prints, per pair and as medians: steady-state examples/s (median over the progress windows after
the first two) and submit-to-first-step latency, and the ratios Strata / hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from strata.taskconfig import TASK_CONFIG_VERSION  # noqa: E402
from strata.local import LocalCluster  # noqa: E402
from strata.memory import default_budget, estimate_task_memory  # noqa: E402
from strata.spec import parse_job_spec  # noqa: E402
from strata.tfconfig import build_tf_config  # noqa: E402


def job_spec(steps: int, batch: int) -> dict:
    return {
        "name": "bench-overhead", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"builtin": {"kind": "mlp", "input_shape": [784], "hidden": [1024, 512, 256],
                              "classes": 10}},
        "data": {"source": "synthetic", "batch_size": batch, "examples": 8192},
        "training": {"steps": steps, "optimizer": {"name": "adam", "learning_rate": 0.001}},
    }


def steady(samples: list[float]) -> float:
    tail = samples[2:] if len(samples) > 3 else samples
    return statistics.median(tail) if tail else 0.0


def launch(raw: dict, threads: int, workdir: str) -> list[tuple[subprocess.Popen, list]]:
    """The job's tasks, launched as an agent launches them; each with its events list."""
    import portpicker

    spec = parse_job_spec(raw)
    budget = default_budget(estimate_task_memory(spec.to_dict(), spec.per_replica_batch))
    n = spec.workers
    ports = [portpicker.pick_unused_port() for _ in range(n)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    out = []
    for i in range(n):
        d = tempfile.mkdtemp(dir=workdir)
        cfg = {"version": TASK_CONFIG_VERSION, "job_id": "bench", "role": "worker", "index": i,
               "spec": spec.to_dict(), "memory_budget_bytes": budget, "report_interval_s": 0.5,
               "agent": {"output_dir": os.path.join(d, "out"), "threads": threads,
                         "device": "CPU"}}
        path = os.path.join(d, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        r, w = os.pipe()
        env = dict(os.environ, TF_CONFIG=build_tf_config(cluster, "worker", i),
                   TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(budget >> 20),
                   CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
        with open(os.path.join(d, "task.log"), "w") as log:
            p = subprocess.Popen([sys.executable, "-m", "strata.worker.task", "--config", path,
                                  "--events-fd", str(w)], pass_fds=(w,), env=env, cwd=d,
                                 stdout=log, stderr=subprocess.STDOUT)
        os.close(w)
        events: list = []

        def read(fd: int = r, into: list = events) -> None:
            with os.fdopen(fd) as f:
                for line in f:
                    into.append(json.loads(line))

        threading.Thread(target=read, daemon=True).start()
        out.append((p, events))
    return out


def finish(tasks: list[tuple[subprocess.Popen, list]]) -> list[list]:
    for p, _ in tasks:
        try:
            rc = p.wait(timeout=600)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        if rc != 0:
            raise RuntimeError(f"a bench task exited {rc}")
    time.sleep(0.2)  # the readers drain the pipes
    return [ev for _, ev in tasks]


def run_by_hand(raw: dict, threads: int, workdir: str) -> tuple[float, float]:
    """Launches the two task processes exactly as an agent would, minus the service:
    (steady examples/s of worker 0, seconds from launch to its first step)."""
    t0 = time.time()
    events = finish(launch(raw, threads, workdir))
    first = next(e["time"] for e in events[0] if e["event"] == "first_step")
    eps = [e["examples_per_sec"] for e in events[0] if e["event"] == "progress"]
    return steady(eps), first - t0


def run_through_strata(cluster: LocalCluster, raw: dict) -> tuple[float, float]:
    with cluster.client() as c:
        t0 = time.time()
        job = c.submit(raw)
        eps, last_step = [], 0
        for ev in c.watch(job.id):
            j = ev.job
            if j is not None and j.metrics.step != last_step and j.metrics.examples_per_sec:
                last_step = j.metrics.step
                eps.append(j.metrics.examples_per_sec)
        final = c.get(job.id)
        if final.state.value != "SUCCEEDED":
            raise RuntimeError(f"bench job ended {final.state.value}: {final.message}")
        return steady(eps), final.started_at - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    raw = job_spec(args.steps, args.batch)
    work = tempfile.mkdtemp(prefix="strata-bench-")
    cluster = LocalCluster(workers=2, memory_budget="2GiB", state_dir=os.path.join(work, "cluster"),
                           threads=args.threads).start()
    rows = []
    try:
        for i in range(args.pairs):
            # Alternate which goes first so drift on a shared machine hits both alike.
            order = ("strata", "hand") if i % 2 == 0 else ("hand", "strata")
            got = {}
            for which in order:
                got[which] = (run_through_strata(cluster, raw) if which == "strata"
                              else run_by_hand(raw, args.threads, work))
            rows.append(got)
            print(f"pair {i + 1}: strata {got['strata'][0]:,.0f} ex/s, first step {got['strata'][1]:.2f} s"
                  f" | hand {got['hand'][0]:,.0f} ex/s, first step {got['hand'][1]:.2f} s"
                  f" | ratio {got['strata'][0] / got['hand'][0]:.3f}", flush=True)
    finally:
        cluster.stop()
    ratios = [r["strata"][0] / r["hand"][0] for r in rows]
    lat_s = [r["strata"][1] for r in rows]
    lat_h = [r["hand"][1] for r in rows]
    print(f"\nsteady-state throughput ratio strata/hand: median {statistics.median(ratios):.3f} "
          f"(per pair: {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"submit-to-first-step: strata median {statistics.median(lat_s):.2f} s, hand median "
          f"{statistics.median(lat_h):.2f} s, difference {statistics.median(lat_s) - statistics.median(lat_h):+.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
