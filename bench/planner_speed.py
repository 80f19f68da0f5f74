"""Planning speed: a 1,000-layer MLP-like profile on 64 workers with heterogeneous budgets.

    .venv/bin/python bench/planner_speed.py [--layers 1000] [--workers 64] [--runs 5]

Prints one line per case: the depth and bottleneck found, the number of probes, and the median
wall time of ``plan_pipeline`` over the runs (time.perf_counter). The target is well under a
second per plan. Cases:

- ``roomy``: free budgets from 24 to 80 GiB (four device sizes, each worker with a different
  amount already reserved, so all 64 budgets differ); memory does not bind.
- ``tight``: budgets from 4 to 22 GiB, all different; the heavy parts of the model only fit the
  larger workers, so the exact heterogeneous search does real work (several Pareto keys).
- ``tight-recompute``: the same budgets with activation recomputation.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from coordinator.planner import WorkerSlot, _Search, plan_pipeline  # noqa: E402
from strata.memory import format_size  # noqa: E402
from strata.modelspec import LayerProfile, ModelProfile  # noqa: E402

GiB = 1 << 30


def mlp_profile(n_layers: int, seed: int = 7) -> ModelProfile:
    """Dense layers of widths between 256 and 4096 (a few much wider), batch-independent."""
    rng = random.Random(seed)
    n_in = 1024
    layers = []
    for i in range(n_layers):
        width = rng.choice([256, 512, 1024, 1024, 2048, 2048, 4096])
        if rng.random() < 0.01:
            width = 16384
        params = n_in * width + width
        layers.append(LayerProfile(f"dense_{i}", "Dense", params, width, 2 * n_in * width, 0,
                                   (width,)))
        n_in = width
    return ModelProfile((1024,), tuple(layers))


def budgets(n: int, sizes_gib: list[float], seed: int) -> list[WorkerSlot]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        size = sizes_gib[i % len(sizes_gib)] * GiB
        reserved = rng.randint(0, int(size * 0.25))
        out.append(WorkerSlot(f"w{i:02d}", int(size - reserved)))
    return out


def run_case(name, profile, workers, stages, runs, **kw):
    times = []
    plan = None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = plan_pipeline(profile, workers, stages=stages, **kw)
        times.append(time.perf_counter() - t0)
    # count the probes of one more run (instrumented separately, not timed)
    import coordinator.planner as planner

    count = {"n": 0}
    orig = _Search.probe

    def probe(self, *a, **k):
        count["n"] += 1
        return orig(self, *a, **k)

    planner._Search.probe = probe
    try:
        plan_pipeline(profile, workers, stages=stages, **kw)
    finally:
        planner._Search.probe = orig
    if plan.feasible:
        result = (f"{plan.num_stages} stages, bottleneck {plan.bottleneck_cost:.4g} FLOPs, "
                  f"max stage memory {format_size(max(s.memory_bytes for s in plan.stages))}")
    else:
        result = f"infeasible: {plan.reason[:80]}"
    print(f"{name:<16} stages={stages:<2} median {statistics.median(times) * 1000:7.1f} ms "
          f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}), "
          f"{count['n']} probes; {result}")
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    profile = mlp_profile(args.layers)
    params = profile.total_params
    print(f"model: {args.layers} layers, {params / 1e9:.2f} G parameters, "
          f"{profile.total_flops / 1e9:.1f} GFLOPs per example forward; "
          f"{args.workers} workers; adam, global batch 512, 8 micro-batches")
    kw = dict(microbatches=8, global_batch=512, optimizer="adam")
    roomy = budgets(args.workers, [24, 40, 48, 80], seed=1)
    tight = budgets(args.workers, [4, 6, 8, 12, 16, 22], seed=2)
    worst = 0.0
    for name, workers, extra in (("roomy", roomy, {}), ("tight", tight, {}),
                                 ("tight-recompute", tight, {"recompute": True})):
        for stages in (0, 8):
            worst = max(worst, run_case(name, profile, workers, stages, args.runs, **kw,
                                        **extra))
    print(f"slowest case: {worst * 1000:.1f} ms median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
