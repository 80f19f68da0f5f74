"""Gradient exchange: a 2-worker multi_worker_mirrored job's throughput against the same work
without the exchange, for each ``gradients`` option, and the accuracy each option reaches.

    .venv/bin/python bench/allreduce.py [--batches 128,1024] [--seconds 6] [--threads 1]
                                        [--accuracy-epochs 10] [--skip-accuracy]

Throughput (synthetic data of the seed MLP's shape, 784-1024-512-256-10, 1.46M parameters,
5.6 MiB of float32 gradients): for each per-worker batch B,
- baseline: two 1-worker jobs at batch B running at once, one per task process, as the two
  workers of the job would (same processes, same cores, no exchange): their summed examples/s;
- each option: one 2-worker job whose workers each compute B examples at a time (with
  ``gradients.accumulate: K`` the global batch is 2 x B x K, one exchange per K slices).
  "ratio" is against the baseline at B; "same step" against two 1-worker jobs running the
  same sliced step (B x K in K slices), which isolates the exchange: a sliced step also saves
  the per-step dispatch that a step of B examples pays K times.
The task processes are launched exactly as an agent launches them (TF_CONFIG, the allocator
limit of the planner's budget, 1 intra-op thread), without the coordinator, which adds
nothing to a running step. Rates are steady state: examples between the second progress
report and the last, over the time between them (reports every 0.5 s).

Accuracy (digits, 2 workers, global batch 256, ``--accuracy-epochs``): the final test
accuracy with each option against the plain all-reduce, and whether the two replicas ended
with the same weights (their SHA-256).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from service_overhead import finish, launch  # noqa: E402

#: (label, gradients section, slices per step)
OPTIONS: list[tuple[str, dict, int]] = [
    ("plain (one pack)", {}, 1),
    ("pack_size 1MiB", {"pack_size": "1MiB"}, 1),
    ("pack_size 4MiB", {"pack_size": "4MiB"}, 1),
    ("compression bfloat16", {"compression": "bfloat16"}, 1),
    ("compression float16", {"compression": "float16"}, 1),
    ("accumulate 4", {"accumulate": 4}, 4),
    ("accumulate 8", {"accumulate": 8}, 8),
    ("accumulate 4 + bfloat16", {"accumulate": 4, "compression": "bfloat16"}, 4),
]


def throughput_spec(workers: int, batch: int, slices: int, steps: int, gradients: dict) -> dict:
    return {
        "name": "bench-allreduce", "strategy": "multi_worker_mirrored", "workers": workers,
        "model": {"builtin": {"kind": "mlp", "input_shape": [784], "hidden": [1024, 512, 256],
                              "classes": 10}},
        "data": {"source": "synthetic", "batch_size": workers * batch * slices,
                 "examples": 16384},
        "training": {"steps": steps, "optimizer": {"name": "adam", "learning_rate": 0.001}},
        "memory": {"profile": "false"},
        "gradients": gradients,
    }


def digits_spec(epochs: int, gradients: dict) -> dict:
    return {
        "name": "bench-allreduce-acc", "strategy": "multi_worker_mirrored", "workers": 2,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256],
                              "classes": 10}},
        "data": {"source": "digits", "batch_size": 256},
        "training": {"epochs": epochs, "optimizer": {"name": "adam", "learning_rate": 0.001}},
        "memory": {"profile": "false"},
        "gradients": gradients,
    }


def steady_rate(events: list, global_batch: int) -> float:
    prog = [e for e in events if e["event"] == "progress"]
    if len(prog) < 3:
        raise RuntimeError("too few progress reports for a steady rate: raise --seconds")
    a, b = prog[1], prog[-1]
    return (b["step"] - a["step"]) * global_batch / (b["time"] - a["time"])


def steps_for(seconds: float, rate_guess: float, examples_per_step: int) -> int:
    return max(20, int(seconds * rate_guess / examples_per_step))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="128,1024", help="per-worker batches, comma separated")
    ap.add_argument("--seconds", type=float, default=6.0, help="steady training time per run")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per task")
    ap.add_argument("--accuracy-epochs", type=int, default=10)
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="strata-allreduce-")
    results: dict = {"throughput": [], "accuracy": []}
    print(f"{os.cpu_count()} cores, {args.threads} intra-op thread(s) per task")

    def alone(b: int, k: int) -> float:
        """Two 1-worker jobs at once, each B x K examples a step in K slices: summed ex/s."""
        grads = {"accumulate": k} if k > 1 else {}
        steps = steps_for(args.seconds, 15000, b * k)
        pair = launch(throughput_spec(1, b, k, steps, grads), args.threads, work) + \
            launch(throughput_spec(1, b, k, steps, grads), args.threads, work)
        return sum(steady_rate(ev, b * k) for ev in finish(pair))

    for b in (int(x) for x in args.batches.split(",")):
        bases = {1: alone(b, 1)}
        base = bases[1]
        print(f"\nper-worker batch {b}: no exchange (two 1-worker jobs) {base:,.0f} ex/s")
        results["throughput"].append({"batch": b, "option": "no exchange", "rate": base,
                                      "ratio": 1.0, "same_step": 1.0})
        print(f"  {'option':<26} {'ex/s':>9} {'ratio':>6} {'same step':>9}  global batch")
        for label, grads, k in OPTIONS:
            if k not in bases:
                bases[k] = alone(b, k)
            steps = steps_for(args.seconds, 15000, 2 * b * k)
            raw = throughput_spec(2, b, k, steps, grads)
            evs = finish(launch(raw, args.threads, work))
            rate = steady_rate(evs[0], raw["data"]["batch_size"])
            print(f"  {label:<26} {rate:>9,.0f} {rate / base:>6.2f} {rate / bases[k]:>9.2f}  "
                  f"{raw['data']['batch_size']}")
            results["throughput"].append({"batch": b, "option": label, "rate": rate,
                                          "ratio": rate / base,
                                          "same_step": rate / bases[k]})

    if not args.skip_accuracy:
        print(f"\ndigits, 2 workers, global batch 256, {args.accuracy_epochs} epochs")
        print(f"  {'option':<26} {'accuracy':>8} {'vs plain':>8} {'test loss':>9}  "
              "replicas identical")
        plain = None
        for label, grads, k in OPTIONS:
            if 128 % k:
                continue
            evs = finish(launch(digits_spec(args.accuracy_epochs, grads), args.threads, work))
            res = [next(e for e in ev if e["event"] == "result") for ev in evs]
            acc = res[0]["test_accuracy"]
            plain = acc if plain is None else plain
            same = len({r["weights_sha256"] for r in res}) == 1
            loss = res[0]["test_loss"]
            print(f"  {label:<26} {acc:>8.4f} {acc - plain:>+8.4f} {loss:>9.5f}  "
                  f"{'yes' if same else 'NO'}")
            results["accuracy"].append({"option": label, "accuracy": acc, "test_loss": loss,
                                        "delta": acc - plain, "identical": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
