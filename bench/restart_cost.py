"""What a failure and a checkpoint cost: restart latency and checkpoint overhead, per strategy.

    .venv/bin/python bench/restart_cost.py [--repeats 2]

On one local cluster of three 1 GiB agents (1 intra-op thread per task), for each strategy:

- checkpoint overhead: the same job without checkpoints and with ``checkpoint.every_steps``
  100, run one after the other (``--repeats`` pairs); examples/s of each (the lead's figure
  over the run) and the ratio;
- restart: the job with checkpoints, its lead-independent task SIGKILLed after the first
  checkpoint; from the kill to RESTARTING (the agent's report), to SCHEDULED again (after
  ``restart.backoff_s`` 0), and to the resumed lead's first step (TensorFlow's start and
  rendezvous again), with the steps trained again.

Prints a Markdown table (docs/benchmarks-log.md keeps them; the top table of
docs/benchmarks.md, the figures that hold).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from strata.local import LocalCluster  # noqa: E402
from strata.types import JobState  # noqa: E402

from conftest import task_processes, wait_until  # noqa: E402

EVERY = 100
CASES = {  # strategy: (extra fields, steps, the task killed)
    "multi_worker_mirrored": ({"workers": 2}, 1500, ("worker", 1)),
    "parameter_server": ({"workers": 1, "parameter_servers": 1}, 2500, ("ps", 0)),
    "pipeline": ({"workers": 1, "stages": 2, "microbatches": 2}, 3000, ("worker", 0)),
}


def spec(name: str, strategy: str, checkpoints: bool) -> dict:
    extra, steps, _ = CASES[strategy]
    return {"name": name, "strategy": strategy, **extra,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 256],
                                  "classes": 10}},
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": steps},
            "checkpoint": {"every_steps": EVERY if checkpoints else 0, "keep": 2},
            "restart": {"max_restarts": 1, "backoff_s": 0}}


def event_time(client, job_id: str, prefix: str) -> float:
    for e in client.watch(job_id):
        if e.seq and e.message.startswith(prefix):
            return e.time
    return float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    rows = []
    with LocalCluster(workers=3, memory_budget="1GiB", threads=1, heartbeat_timeout_s=4) as c:
        with c.client() as client:
            for strategy, (_, steps, (role, index)) in CASES.items():
                eps = {False: [], True: []}
                for r in range(args.repeats):
                    for ckpt in (False, True):
                        j = client.submit(spec(f"cost-{r}-{int(ckpt)}", strategy, ckpt))
                        f = client.wait(j.id, timeout=600)
                        assert f.state == JobState.SUCCEEDED, f.message
                        eps[ckpt].append(f.metrics.examples_per_sec)
                j = client.submit(spec("restart", strategy, True))
                wait_until(lambda: client.get(j.id).checkpoint_step >= EVERY, 120,
                           interval=0.05, what="first checkpoint")
                pid = task_processes(f"/jobs/{j.id}/{role}-{index}/")[0]
                t_kill = time.time()
                os.kill(pid, signal.SIGKILL)
                f = client.wait(j.id, timeout=600)
                assert f.state == JobState.SUCCEEDED and f.restarts == 1, f.message
                t_restarting = event_time(client, j.id, "RESTARTING")
                t_scheduled = [e.time for e in client.watch(j.id)
                               if e.seq and e.message.startswith("SCHEDULED")][-1]
                t_resumed = event_time(client, j.id, "resumed from the checkpoint")
                off, on = (sum(v) / len(v) for v in (eps[False], eps[True]))
                rows.append((strategy, f"{role}:{index}", off, on, on / off,
                             t_restarting - t_kill, t_scheduled - t_kill, t_resumed - t_kill,
                             f.steps_repeated))
    print("| strategy | killed | ex/s no ckpt | ex/s ckpt every 100 | ratio | kill to "
          "RESTARTING (s) | to SCHEDULED (s) | to resumed (s) | steps repeated |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for s, k, off, on, ratio, a, b, c_, rep in rows:
        print(f"| {s} | {k} | {off:,.0f} | {on:,.0f} | {ratio:.2f} | {a:.2f} | {b:.2f} | "
              f"{c_:.2f} | {rep} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
