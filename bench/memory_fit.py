"""Fits one CPU kernel family's memory rates (``strata.memory.KernelRates``) to memory zoo runs.

    .venv/bin/python bench/memory_fit.py --kernels onednn \\
        bench/results/memory_zoo_onednn.jsonl bench/results/memory_zoo_confirm_onednn.jsonl

Re-estimates every data-parallel and pipeline task of the given runs (``bench/memory_zoo.py``
rows: the measured peaks are kept) with candidate rates, and searches them: a random
coordinate search from the family's current rates, each rate bounded to half and twice its
start. A candidate is refused when any task's peak is above ``--margin`` of the budget it
would get; among the others, the best has the most task kinds within 15% of their peak
(the ``--target`` models counted twice) and the fewest above 1.15. It prints each
improvement and the best rates, in the order ``RATES`` takes them; copying them into
``strata/memory.py`` is a decision left to the reader (round them; check every zoo file with
``bench/memory_zoo.py --table --reestimate``). Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

MiB = 1 << 20
CONV = ("Conv2D", "DepthwiseConv2D")
ACT = ("BatchNormalization", "LayerNormalization", "Activation", "ReLU", "Dropout",
       "Multiply", "MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D")
NAMES = ("dense f32", "dense mixed", "conv f32", "conv mixed", "act f32", "act mixed",
         "pipeline f32", "pipeline mixed", "internal f32", "internal mixed",
         "pipeline conv share", "pipeline act share")
APPS = "mobilenetv2-32,resnet50-32,efficientnetb0-32,densenet121-32,lstm-seq,transformer-block"


def load(paths: list[str]) -> list[tuple[dict[str, Any], Any, Any]]:
    import memory_zoo as mz
    from strata.modelspec import profile_model
    from strata.spec import parse_job_spec

    by = {m.name: m for m in mz.ZOO}
    sections: dict[str, Any] = {}
    rows = []
    for path in paths:
        with open(path) as f:
            for line in f:
                r = json.loads(line) if line.strip() else {}
                if "tasks" not in r or r.get("model") not in by \
                        or r["strategy"] not in ("multi_worker_mirrored", "pipeline"):
                    continue
                m = by[r["model"]]
                if m.name not in sections:
                    sections[m.name] = m.make()
                spec = parse_job_spec(mz.job_spec(m, r["strategy"], m.batches.index(r["batch"]),
                                                  r["precision"], r["optimizer"], 3,
                                                  sections[m.name]))
                rows.append((r, spec, profile_model(spec.model)))
    return rows


def start_of(kernels: str) -> list[float]:
    from strata.memory import RATES, pipeline_share

    r = RATES[kernels]
    inner = r.internal or r.dense
    return [r.dense[0], r.dense[1], *r.layers["Conv2D"], *r.layers["Activation"],
            *r.pipeline, *inner, pipeline_share(r, "Conv2D"), pipeline_share(r, "Activation")]


def apply(kernels: str, p: list[float]) -> None:
    from strata import memory

    r0 = memory.RATES[kernels]
    layers = dict(r0.layers)
    layers.update({k: (p[2], p[3]) for k in CONV})
    layers.update({k: (p[4], p[5]) for k in ACT})
    shares = dict(r0.pipeline_shares or {})
    shares.update({k: p[10] for k in CONV})
    shares.update({k: p[11] for k in ACT if k != "MaxPooling2D"})
    memory.RATES[kernels] = memory.KernelRates((p[0], p[1]), layers, r0.conv_workspace,
                                               (p[6], p[7]), (p[8], p[9]), shares)


def kinds(rows: list, kernels: str) -> list[dict[str, Any]]:
    """Every task kind of ``rows`` with its peak and the current rates' estimate and budget."""
    from strata import strategies
    from strata.types import WorkerOffer

    out = []
    offers = [WorkerOffer(f"w{i}", 6 << 30, kernels) for i in range(4)]
    for r, spec, profile in rows:
        planned = {f"{t.role}:{t.index}": t for t in
                   strategies.get(r["strategy"]).plan(spec, offers, profile).tasks}
        groups: dict[tuple, dict[str, Any]] = {}
        for t in r["tasks"]:
            p = planned.get(t["task"])
            if p is None:
                continue
            g = groups.setdefault((t["task"].split(":")[0], p.stage), {
                "model": r["model"], "peak": 0, "est": p.estimated_memory_bytes,
                "budget": p.memory_budget_bytes})
            g["peak"] = max(g["peak"], t["peak"])
        out += groups.values()
    return out


def score(ks: list[dict[str, Any]], margin: float, target: set[str]) -> tuple[float, dict]:
    over = sum(k["peak"] > margin * k["budget"] for k in ks)
    big = [k for k in ks if max(k["est"], k["peak"]) >= 4 * MiB]
    within = [0.85 <= k["peak"] / k["est"] <= 1.15 for k in big]
    above = [k["peak"] / k["est"] > 1.15 for k in big]
    tw = sum(w for w, k in zip(within, big) if k["model"] in target)
    ta = sum(a for a, k in zip(above, big) if k["model"] in target)
    ratios = sorted(k["peak"] / k["est"] for k in big)
    stats = {"kinds": len(big), "within": sum(within), "above": sum(above), "over": over,
             "target_within": tw, "median": round(statistics.median(ratios), 3) if ratios else 0}
    return over * 1000 + 2 * ta + sum(above) - 2 * tw - sum(within), stats


def main() -> None:
    a = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    a.add_argument("runs", nargs="+", help="memory zoo JSON lines files (one family's runs)")
    a.add_argument("--kernels", choices=("onednn", "eigen"), required=True)
    a.add_argument("--margin", type=float, default=0.9,
                   help="no task's peak above this fraction of its budget (default 0.9)")
    a.add_argument("--target", default=APPS, help="models counted twice (comma-separated)")
    a.add_argument("--iterations", type=int, default=2000)
    a.add_argument("--seed", type=int, default=1)
    args = a.parse_args()
    rows = load(args.runs)
    target = set(args.target.split(","))
    start = start_of(args.kernels)
    bounds = [(x / 2, x * 2) for x in start]
    best = list(start)
    apply(args.kernels, best)
    best_score, stats = score(kinds(rows, args.kernels), args.margin, target)
    print("start", dict(zip(NAMES, best)), stats, flush=True)
    rng = random.Random(args.seed)
    for it in range(args.iterations):
        cand = list(best)
        for i in rng.sample(range(len(cand)), rng.choice([1, 1, 2, 3])):
            x = cand[i] * rng.uniform(0.6, 1.5) + rng.uniform(-0.3, 0.3)
            cand[i] = round(min(max(x, bounds[i][0]), bounds[i][1]), 2)
        apply(args.kernels, cand)
        s, st = score(kinds(rows, args.kernels), args.margin, target)
        if st["over"] == 0 and s < best_score:
            best, best_score, stats = cand, s, st
            print(it, dict(zip(NAMES, best)), st, flush=True)
    print("best", json.dumps(best), stats)


if __name__ == "__main__":
    main()
