"""Planning speed: a 1,000-layer MLP-like profile on 64 workers with heterogeneous budgets.

    .venv/bin/python bench/planner_speed.py [--layers 1000] [--workers 64] [--runs 5]

Prints one line per case: the median wall time of ``plan_pipeline`` over the runs
(time.perf_counter), the full probes it made (0: the two homogeneous bounds met, see the
docs/planner.md, point 4), the depth and bottleneck found, whether the bottleneck is proven
optimal (else the proven lower bound), and the largest stage's memory. Target: well
under a second per plan. The model: 1,000 Dense layers of widths 256..4096 (2.3 G parameters,
Adam, global batch 512 in 8 micro-batches: about 52 GiB of training state). Budget cases, each
worker with a random part of its device already reserved, so all 64 budgets differ:

- ``roomy``: devices of 24, 40, 48 and 80 GiB (up to 25% reserved); memory does not bind.
- ``tight``: 3 devices of 12 GiB and 61 of 6 GiB (up to 15% reserved); with 8 stages the heavy
  stages only fit the 3 big workers, so the optimal split is not the cost-balanced one.
- ``stress``: devices of 0.8 to 2.4 GiB (up to 25% reserved): the 64 stages must be packed
  into budgets barely larger than they are, all different. This is the hard (NP-hard in
  general) regime: the search may run out of its allowance and then reports a gap.
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

import strata.planner.search as search  # noqa: E402
from strata.planner import WorkerSlot, plan_pipeline  # noqa: E402
from strata.units import format_size  # noqa: E402
from strata.modelspec import LayerProfile, ModelProfile  # noqa: E402

GiB = 1 << 30


def mlp_profile(n_layers: int, seed: int = 7, giants: float = 0.0) -> ModelProfile:
    """Dense layers of widths between 256 and 4096; ``giants``: the share of 16384-wide ones."""
    rng = random.Random(seed)
    n_in = 1024
    layers = []
    for i in range(n_layers):
        width = rng.choice([256, 512, 1024, 1024, 2048, 2048, 4096])
        if rng.random() < giants:
            width = 16384
        params = n_in * width + width
        layers.append(LayerProfile(f"dense_{i}", "Dense", params, width, 2 * n_in * width, 0,
                                   (width,)))
        n_in = width
    return ModelProfile((1024,), tuple(layers))


def budgets(n: int, sizes_gib: list[float], seed: int, reserved: float = 0.25
            ) -> list[WorkerSlot]:
    """Worker i has a device of ``sizes_gib[i % len]`` GiB with a random share (up to
    ``reserved``) already taken by other jobs."""
    rng = random.Random(seed)
    return [WorkerSlot(f"w{i:02d}", int(sizes_gib[i % len(sizes_gib)] * GiB
                                        * (1 - rng.random() * reserved)))
            for i in range(n)]


def count_probes(fn):
    count = {"n": 0}
    orig = search.Search.probe

    def probe(self, *a, **k):
        count["n"] += 1
        return orig(self, *a, **k)

    search.Search.probe = probe
    try:
        fn()
    finally:
        search.Search.probe = orig
    return count["n"]


def run_case(name, profile, workers, stages, runs, **kw) -> float:
    times = []
    plan = None
    for _ in range(runs):
        t0 = time.perf_counter()
        plan = plan_pipeline(profile, workers, stages=stages, **kw)
        times.append(time.perf_counter() - t0)
    probes = count_probes(lambda: plan_pipeline(profile, workers, stages=stages, **kw))
    if plan.feasible:
        proof = ("optimal" if plan.optimal else
                 f"NOT proven optimal: >= {plan.lower_bound:.4g} "
                 f"(gap {plan.bottleneck_cost / plan.lower_bound - 1:.1%})")
        result = (f"{plan.num_stages} stages, bottleneck {plan.bottleneck_cost:.4g} FLOPs "
                  f"({proof}), largest stage "
                  f"{format_size(max(s.memory_bytes for s in plan.stages))}")
    else:
        result = f"infeasible: {plan.reason[:90]}"
    median = statistics.median(times)
    print(f"{name:<7} stages={stages:<2} median {median * 1000:7.1f} ms "
          f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}), {probes:2d} full probes; "
          f"{result}", flush=True)
    return median


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    profile = mlp_profile(args.layers)
    print(f"model: {args.layers} layers, {profile.total_params / 1e9:.2f} G parameters, "
          f"{profile.total_flops / 1e9:.1f} GFLOPs per example forward; {args.workers} "
          f"workers; adam, global batch 512, 8 micro-batches")
    kw = dict(microbatches=8, global_batch=512, optimizer="adam")
    n = args.workers
    cases = [
        ("roomy", budgets(n, [24, 40, 48, 80], seed=1), (0, 8), {}),
        ("tight", budgets(n, [12] * 3 + [6] * (n - 3), seed=5, reserved=0.15)[:n], (0, 8), {}),
        ("stress", budgets(n, [0.8, 1, 1.2, 1.6, 2.4], seed=3), (0,), {}),
    ]
    worst = 0.0
    for name, workers, depths, extra in cases:
        for stages in depths:
            worst = max(worst, run_case(name, profile, workers, stages, args.runs, **kw,
                                        **extra))
    print(f"slowest median: {worst * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
