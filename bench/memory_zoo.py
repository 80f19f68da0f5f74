"""Memory zoo: Strata's memory estimate and default budget against the allocator peak that
real tasks reach, over models that differ in the ways that matter, on every strategy.

    .venv/bin/python bench/memory_zoo.py [--models a,b] [--strategies s,t] [--configs all|half]
                                         [--out bench/results/memory_zoo.jsonl] [--table]

Each row is one real job on a local cluster (coordinator and four agents with large budgets,
real task processes with the BFC allocator limited to the budget Strata assigns by default):
the job runs ``--steps`` steps and its evaluation, and every task reports its allocator peak.
A row records, per task: the estimate, the assigned budget, the measured peak, and
``peak / estimate``. ``over`` marks a task whose peak exceeded its budget or that ran out of
memory. Jobs run with ``memory.profile: false`` (the estimators' figures); ``--profile`` runs
them with ``memory.profile: true`` instead (a probe run measures each job first and the row's
estimates are the probe's peaks; the probe's own tasks, with the estimators' figures, are in
the row's ``probe``). The run appends to ``--out`` (JSON lines) and skips rows already there, so it can be
interrupted and resumed; ``--table`` prints the Markdown table of what is in ``--out``. Each row
records the CPU kernels its workers ran (``kernels``: ``strata.cpukernels``; set
``TF_ENABLE_ONEDNN_OPTS=0`` to run the Eigen family on a oneDNN host). ``--table --reestimate``
prints it with the estimates and budgets the current estimators give each row instead of those
it ran with (the peaks are the run's): how constants fitted on a zoo run are checked.

Configurations per model and strategy: per-task batch small / large, float32 / bfloat16, Adam /
SGD. ``--configs all`` runs the 8 combinations; ``half`` (the default) the 4 of a
half-fraction design (every level of every factor, and every pair of levels of any two factors,
appears once); ``optimizers`` the other optimizers a job accepts (AdamW, RMSprop in bfloat16,
Adagrad) at the large batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 1 << 20


# --------------------------------------------------------------------------------------------
# the zoo

def _mlp(input_shape: list[int], hidden: list[int], classes: int = 10) -> dict[str, Any]:
    return {"builtin": {"kind": "mlp", "input_shape": input_shape, "hidden": hidden,
                        "classes": classes}}


def _keras(build: Callable[[Any], Any]) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        import keras

        return {"keras_json": build(keras).to_json()}
    return make


def _seq(input_shape: tuple[int, ...], layers: Callable[[Any], list[Any]]
         ) -> Callable[[], dict[str, Any]]:
    return _keras(lambda k: k.Sequential([k.Input(input_shape)] + layers(k.layers)))


@dataclass(frozen=True)
class Model:
    name: str
    what: str
    make: Callable[[], dict[str, Any]]
    data: dict[str, Any]
    batches: tuple[int, int]  # small and large per-task batch
    #: strategies that do not apply (a one-layer model has no stages to split)
    skip: tuple[str, ...] = ()


SYN = {"source": "synthetic", "examples": 1024}

ZOO: list[Model] = [
    Model("mlp-seed", "64-1024-512-256-10 on digits", lambda: _mlp([64], [1024, 512, 256]),
          {"source": "digits"}, (32, 512)),
    Model("mlp-wide-deep", "9 x 1536 wide, deep", lambda: _mlp([64], [1536] * 9),
          {"source": "digits"}, (16, 256)),
    Model("mlp-narrow-deep", "16 x 64 narrow, deep", lambda: _mlp([64], [64] * 16),
          {"source": "digits"}, (32, 1024)),
    Model("mlp-huge-layer", "one 1024 x 8192 layer", lambda: _mlp([1024], [8192]),
          dict(SYN), (16, 256)),
    Model("mlp-bottleneck", "784-4096-32-4096-10", lambda: _mlp([784], [4096, 32, 4096]),
          dict(SYN), (32, 512)),
    Model("mlp-tiny", "784-10 logistic regression", lambda: _mlp([784], []),
          dict(SYN), (32, 1024), skip=("pipeline", "hybrid")),
    Model("conv-small", "28x28x1, conv 32-64, max pool, dense 128",
          _seq((28, 28, 1), lambda L: [
              L.Conv2D(32, 3, activation="relu"), L.Conv2D(64, 3, activation="relu"),
              L.MaxPooling2D(2), L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)]),
          dict(SYN), (16, 128)),
    Model("conv-deep-gap", "32x32x3, 4 conv 3x3 x 64 same, pools, global average",
          _seq((32, 32, 3), lambda L: [
              L.Conv2D(64, 3, padding="same", activation="relu"),
              L.Conv2D(64, 3, padding="same", activation="relu"), L.MaxPooling2D(2),
              L.Conv2D(64, 3, padding="same", activation="relu"),
              L.Conv2D(64, 3, padding="same", activation="relu"),
              L.GlobalAveragePooling2D(), L.Dense(10)]),
          dict(SYN), (8, 64)),
    Model("conv-bn", "32x32x3, conv-batchnorm-relu x 3, average pool",
          _seq((32, 32, 3), lambda L: [
              L.Conv2D(32, 3, padding="same"), L.BatchNormalization(), L.Activation("relu"),
              L.Conv2D(32, 3, padding="same"), L.BatchNormalization(), L.Activation("relu"),
              L.AveragePooling2D(2),
              L.Conv2D(64, 3, padding="same"), L.BatchNormalization(), L.Activation("relu"),
              L.GlobalAveragePooling2D(), L.Dense(10)]),
          dict(SYN), (8, 64)),
    Model("conv-big-image", "64x64x3, 16 filters 5x5, few params, big activations",
          _seq((64, 64, 3), lambda L: [
              L.Conv2D(16, 5, padding="same", activation="relu"), L.MaxPooling2D(4),
              L.Flatten(), L.Dense(10)]),
          {"source": "synthetic", "examples": 512}, (8, 64)),
    Model("conv-wide-kernel", "16x16x8, conv 128 x 5x5 twice",
          _seq((16, 16, 8), lambda L: [
              L.Conv2D(128, 5, padding="same", activation="relu"),
              L.Conv2D(128, 5, padding="same", activation="relu"),
              L.Flatten(), L.Dense(10)]),
          dict(SYN), (8, 64)),
    Model("mlp-layernorm-dropout", "dense 1024 + layer norm + dropout, x 3",
          _seq((256,), lambda L: [
              L.Dense(1024, activation="relu"), L.LayerNormalization(), L.Dropout(0.2),
              L.Dense(1024, activation="relu"), L.LayerNormalization(), L.Dropout(0.2),
              L.Dense(1024, activation="relu"), L.LayerNormalization(), L.Dropout(0.2),
              L.Dense(10)]),
          dict(SYN), (32, 512)),
    Model("mlp-batchnorm", "dense 512 + batch norm + relu, x 4",
          _seq((128,), lambda L: [
              x for _ in range(4) for x in (L.Dense(512), L.BatchNormalization(),
                                            L.Activation("relu"))] + [L.Dense(10)]),
          dict(SYN), (32, 512)),
    Model("reshape-conv", "flat 784 reshaped to 28x28x1, conv, average pool, dense",
          _seq((784,), lambda L: [
              L.Reshape((28, 28, 1)), L.Conv2D(16, 3, activation="relu"),
              L.AveragePooling2D(2), L.Flatten(), L.Dense(64, activation="relu"),
              L.Dense(10)]),
          dict(SYN), (16, 256)),
]

def _text_embedding(k: Any) -> Any:
    i = k.Input((64,), dtype="int32", name="tokens")
    x = k.layers.Embedding(5000, 64)(i)
    x = k.layers.GlobalAveragePooling1D()(x)
    x = k.layers.Dense(64, activation="relu")(x)
    return k.Model(i, k.layers.Dense(10)(x))


def _transformer(k: Any) -> Any:
    L = k.layers
    i = k.Input((32, 64), name="seq")
    a = L.MultiHeadAttention(num_heads=4, key_dim=16)(i, i)
    x = L.LayerNormalization()(L.Add()([i, a]))
    f = L.Dense(64)(L.Dense(256, activation="relu")(x))
    x = L.LayerNormalization()(L.Add()([x, f]))
    x = L.GlobalAveragePooling1D()(x)
    return k.Model(i, L.Dense(10)(x))


def _resnet(k: Any) -> Any:
    L = k.layers
    i = k.Input((16, 16, 3), name="img")
    x = L.Conv2D(32, 3, padding="same", activation="relu")(i)
    for _ in range(2):
        y = L.Conv2D(32, 3, padding="same")(x)
        y = L.BatchNormalization()(y)
        y = L.ReLU()(y)
        y = L.Conv2D(32, 3, padding="same")(y)
        x = L.Add()([x, y])
    x = L.GlobalAveragePooling2D()(x)
    return k.Model(i, L.Dense(10)(x))


#: the layer kinds beyond the chains above (users' own models): embeddings, recurrent layers,
#: attention, residual graphs, 1-D convolutions
GRAPH_ZOO: list[Model] = [
    Model("text-embedding", "64 token ids, embedding 5000 x 64, average, dense",
          _keras(_text_embedding), dict(SYN), (32, 512)),
    Model("lstm-seq", "32 x 16 sequence, LSTM 128 (sequences), LSTM 64",
          _seq((32, 16), lambda L: [L.LSTM(128, return_sequences=True), L.LSTM(64),
                                    L.Dense(10)]), dict(SYN), (16, 128)),
    Model("transformer-block", "32 x 64 sequence, attention 4 x 16, FFN 256, residuals",
          _keras(_transformer), dict(SYN), (16, 128)),
    Model("resnet-small", "16x16x3, two residual blocks of conv 32 + batch norm",
          _keras(_resnet), dict(SYN), (8, 64)),
    Model("conv1d-seq", "128 x 8 sequence, conv1d 64 x 5, max pool, conv1d 64, global max",
          _seq((128, 8), lambda L: [L.Conv1D(64, 5, activation="relu"), L.MaxPooling1D(2),
                                    L.Conv1D(64, 3, activation="relu"),
                                    L.GlobalMaxPooling1D(), L.Dense(10)]),
          dict(SYN), (16, 128)),
]
ZOO += GRAPH_ZOO


def _app(name: str) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        import keras

        build = getattr(keras.applications, name)
        return {"keras_json": build(input_shape=(32, 32, 3), weights=None,
                                    classes=10).to_json()}
    return make


IMAGES = {"source": "synthetic", "examples": 512}

#: keras.applications at a small input (32x32x3, weights=None, 10 classes): depthwise and
#: grouped blocks, deep residual bottlenecks, squeeze-and-excitation, dense concatenation
APPS_ZOO: list[Model] = [
    Model("mobilenetv2-32", "keras.applications.MobileNetV2 at 32x32", _app("MobileNetV2"),
          dict(IMAGES), (8, 32)),
    Model("resnet50-32", "keras.applications.ResNet50 at 32x32", _app("ResNet50"),
          dict(IMAGES), (8, 32)),
    Model("efficientnetb0-32", "keras.applications.EfficientNetB0 at 32x32",
          _app("EfficientNetB0"), dict(IMAGES), (8, 32)),
    Model("densenet121-32", "keras.applications.DenseNet121 at 32x32", _app("DenseNet121"),
          dict(IMAGES), (8, 32)),
]
ZOO += APPS_ZOO

STRATEGIES: dict[str, dict[str, Any]] = {
    "multi_worker_mirrored": {"workers": 2},
    "parameter_server": {"workers": 2, "parameter_servers": 1},
    "pipeline": {"stages": 2, "microbatches": 4},
    "hybrid": {"workers": 2, "stages": 2, "microbatches": 2},
}

# (batch: 0 small / 1 large, mixed precision, optimizer)
ALL_CONFIGS = [(b, p, o) for b in (0, 1) for p in ("none", "bfloat16") for o in ("adam", "sgd")]
HALF_CONFIGS = [(0, "none", "adam"), (1, "none", "sgd"), (0, "bfloat16", "sgd"),
                (1, "bfloat16", "adam")]
# two opposite corners (the graph models' rows)
PAIR_CONFIGS = [(0, "none", "adam"), (1, "bfloat16", "sgd")]
# the other optimizers a job accepts, at the large batch (their slots and update temporaries)
OPTIMIZER_CONFIGS = [(1, "none", "adamw"), (1, "bfloat16", "rmsprop"), (1, "none", "adagrad")]


def job_spec(model: Model, strategy: str, batch_index: int, precision: str, optimizer: str,
             steps: int, model_section: dict[str, Any], profile: bool = False) -> dict[str, Any]:
    extra = dict(STRATEGIES[strategy])
    per_task = model.batches[batch_index]
    # the per-task batch: a data-parallel replica's batch, a pipeline replica's batch
    if strategy in ("multi_worker_mirrored", "hybrid"):
        global_batch = per_task * extra.get("workers", 1)
    else:
        global_batch = per_task
    if strategy in ("pipeline", "hybrid"):
        m = extra["microbatches"]
        global_batch = max(global_batch, m * extra.get("workers", 1))
    return {
        "name": f"zoo-{model.name}"[:40], "strategy": strategy, **extra,
        "model": model_section,
        "data": {**model.data, "batch_size": global_batch},
        # parameter-server steps are asynchronous: enough of them that every worker runs some
        "training": {"steps": steps * 4 if strategy == "parameter_server" else steps,
                     "optimizer": {"name": optimizer, "learning_rate": 0.001}},
        # the estimators' own figures unless asked: memory.profile would replace them
        "memory": {"mixed_precision": precision, "profile": "true" if profile else "false"},
    }


def row_key(r: dict[str, Any]) -> tuple:
    return (r["model"], r["strategy"], r["batch"], r["precision"], r["optimizer"])


def run_rows(models: list[Model], strategies: list[str], configs: list[tuple], out: str,
             steps: int, agents: int, budget: str, timeout: float, profile: bool = False) -> None:
    """Every (model, strategy, configuration) not yet in ``out``, on a fresh local cluster."""
    from strata.local import LocalCluster

    done = set()
    if os.path.exists(out):
        with open(out) as f:
            done = {row_key(json.loads(l)) for l in f if l.strip()}
    todo = [(m.name, s, c) for m in models for s in strategies for c in configs
            if s not in m.skip and (m.name, s, m.batches[c[0]], c[1], c[2]) not in done]
    print(f"{len(todo)} rows to run ({len(done)} already in {out})", flush=True)
    if not todo:
        return
    with LocalCluster(workers=agents, memory_budget=budget, threads=1) as cluster, \
            cluster.client() as client:
        kernels = sorted({w.cpu_kernels for w in client.workers()})
        run_with_client(client, todo, out, steps, timeout, profile=profile,
                        kernels=",".join(kernels))


def _task_rows(job: Any) -> list[dict[str, Any]]:
    return [{"task": f"{t.role}:{t.index}", "stage": t.stage, "replica": t.replica,
             "estimate": t.estimated_memory_bytes, "budget": t.memory_budget_bytes,
             "peak": t.peak_memory_bytes, "state": t.state.value,
             "failure": t.failure.value, "message": t.message[:300]} for t in job.tasks]


def run_with_client(client: Any, rows: list[tuple[str, str, tuple]], out: str, steps: int,
                    timeout: float, profile: bool = False, kernels: str = "") -> None:
    """Runs ``rows`` (model name, strategy, (batch index, precision, optimizer)) one job at a
    time through ``client`` and appends each result to ``out``. With ``profile`` the jobs ask
    for ``memory.profile`` (a probe run measures them first; the row's estimates are then the
    probe's peaks, and ``probe`` records the probe's own tasks: the estimators' figures)."""
    from strata.client import CoordinatorError

    by_name = {m.name: m for m in ZOO}
    sections: dict[str, dict[str, Any]] = {}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    for i, (name, strategy, (bi, precision, optimizer)) in enumerate(rows):
        m = by_name[name]
        if name not in sections:
            sections[name] = m.make()
        spec = job_spec(m, strategy, bi, precision, optimizer, steps, sections[name], profile)
        row: dict[str, Any] = {"model": name, "strategy": strategy, "batch": m.batches[bi],
                               "precision": precision, "optimizer": optimizer}
        if kernels:
            row["kernels"] = kernels
        t0 = time.time()
        job = None
        try:
            job = client.submit(spec)
            job = client.wait(job.id, timeout=timeout)
            # a pipeline's later stages and a PS job's servers end (and send their final
            # peak) just after the job does
            job = client.settled(job.id)
        except TimeoutError as e:
            row.update(state="TIMEOUT", message=str(e))
            if job is not None:
                client.cancel(job.id)
        except CoordinatorError as e:
            row.update(state="REFUSED", message=str(e))
        else:
            row.update(state=job.state.value, message=job.message, tasks=_task_rows(job))
            if profile:
                probes = [j for j in client.jobs() if j.name == f"{spec['name']}-probe"
                          and j.created_at <= job.created_at]
                if probes:
                    probe = client.get(max(probes, key=lambda j: j.created_at).id)
                    row["probe"] = {"state": probe.state.value, "tasks": _task_rows(probe)}
        row["seconds"] = round(time.time() - t0, 1)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{i + 1}/{len(rows)}] {summary_line(row)}", flush=True)


def _ratio(t: dict[str, Any]) -> float:
    return t["peak"] / t["estimate"] if t["estimate"] else 0.0


def task_over(t: dict[str, Any]) -> bool:
    return t["failure"] == "OOM" or t["peak"] > t["budget"]


def summary_line(r: dict[str, Any]) -> str:
    head = f"{r['model']} {r['strategy']} b{r['batch']} {r['precision']} {r['optimizer']}: "
    if "tasks" not in r:
        return head + f"{r['state']} {r.get('message', '')[:200]}"
    parts = [f"{t['task']} est {t['estimate'] / MiB:.1f} bud {t['budget'] / MiB:.0f} "
             f"peak {t['peak'] / MiB:.1f} ({_ratio(t):.2f}){' OVER' if task_over(t) else ''}"
             for t in r["tasks"]]
    return head + f"{r['state']} ({r['seconds']} s); " + "; ".join(parts)


def kinds(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's tasks grouped by kind: tasks planned alike (the workers of a data-parallel or
    parameter-server job, the replicas of one hybrid stage) share one estimate, which must
    cover the highest of them; the ratio of a kind is its highest peak over the estimate."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for t in r.get("tasks", []):
        role = t["task"].split(":")[0]
        key = (role if role != "ps" else t["task"], t["stage"], t["estimate"])
        groups.setdefault(key, []).append(t)
    out = []
    for ts in groups.values():
        est = ts[0]["estimate"]
        peak = max(t["peak"] for t in ts)
        out.append({"tasks": ",".join(t["task"] for t in ts), "estimate": est,
                    "budget": max(t["budget"] for t in ts), "peak": peak,
                    "ratio": peak / est if est else 0.0,
                    "over": any(task_over(t) for t in ts)})
    return out


SMALL = 16 * MiB  # below this the budget is the 16 MiB floor and the ratio is noise


def reestimate(rows: list[dict[str, Any]], kernels: str) -> list[dict[str, Any]]:
    """``rows`` with every task's estimate and budget as the current estimators give them on
    workers of ``kernels`` (``strata.cpukernels``), the measured peaks kept."""
    from strata import strategies
    from strata.modelspec import profile_model
    from strata.spec import parse_job_spec
    from strata.types import WorkerOffer

    by_name = {m.name: m for m in ZOO}
    sections: dict[str, dict[str, Any]] = {}
    out = []
    for r in rows:
        m = by_name.get(r["model"])
        if m is None or "tasks" not in r:
            out.append(r)
            continue
        if m.name not in sections:
            sections[m.name] = m.make()
        spec = parse_job_spec(job_spec(m, r["strategy"], m.batches.index(r["batch"]),
                                       r["precision"], r["optimizer"], 3, sections[m.name]))
        offers = [WorkerOffer(f"w{i}", 6 << 30, kernels) for i in range(4)]
        plan = strategies.get(r["strategy"]).plan(spec, offers, profile_model(spec.model))
        planned = {f"{t.role}:{t.index}": t for t in plan.tasks}
        tasks = [{**t, "estimate": planned[t["task"]].estimated_memory_bytes,
                  "budget": planned[t["task"]].memory_budget_bytes}
                 if t["task"] in planned else t for t in r["tasks"]]
        out.append({**r, "tasks": tasks})
    return out


def table(out: str, kernels: str | None = None) -> str:
    with open(out) as f:
        rows = [json.loads(l) for l in f if l.strip()]
    if kernels is not None:
        rows = reestimate(rows, kernels)
    lines = ["| model | strategy | batch | precision | optimizer | tasks | estimate MiB | "
             "budget MiB | peak MiB | peak / estimate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    ratios: list[float] = []
    over = low = failed = within = 0
    for r in rows:
        if "tasks" not in r or r["state"] != "SUCCEEDED":
            failed += 1
        for k in kinds(r):
            flag = " **over budget**" if k["over"] else ""
            over += bool(flag)
            if k["estimate"] >= SMALL:
                ratios.append(k["ratio"])
                low += k["ratio"] < 0.8
                within += 0.85 <= k["ratio"] <= 1.15
            lines.append(f"| {r['model']} | {r['strategy']} | {r['batch']} | {r['precision']} | "
                         f"{r['optimizer']} | {k['tasks']} | {k['estimate'] / MiB:.1f} | "
                         f"{k['budget'] / MiB:.0f} | {k['peak'] / MiB:.1f} | "
                         f"{k['ratio']:.2f}{flag} |")
        if "tasks" not in r:
            lines.append(f"| {r['model']} | {r['strategy']} | {r['batch']} | {r['precision']} | "
                         f"{r['optimizer']} | - | - | - | - | {r['state']} |")
    if ratios:
        ratios.sort()
        q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
        lines += ["", f"{len(rows)} jobs ({failed} not SUCCEEDED); task kinds over budget: "
                      f"{over}. Peak / estimate over the {len(ratios)} kinds estimated at "
                      f"{SMALL // MiB} MiB or more: min {ratios[0]:.2f}, 10th percentile "
                      f"{q(0.1):.2f}, median {q(0.5):.2f}, 90th percentile {q(0.9):.2f}, max "
                      f"{ratios[-1]:.2f}; below 0.8: {low}; within 15%: {within}."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    p.add_argument("--strategies", default="", help="comma-separated (default: all four)")
    p.add_argument("--configs", choices=("all", "half", "optimizers", "pair"), default="half")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "memory_zoo.jsonl"))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--agent-budget", default="6GiB")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--table", action="store_true", help="print the table of --out and exit")
    p.add_argument("--reestimate", choices=("onednn", "eigen", "any"), default=None,
                   help="with --table: the current estimators' figures for workers of these "
                        "CPU kernels instead of the run's")
    p.add_argument("--profile", action="store_true",
                   help="jobs ask for memory.profile (a probe run measures them first)")
    a = p.parse_args()
    if a.table:
        print(table(a.out, None if a.reestimate is None else
                    "" if a.reestimate == "any" else a.reestimate))
        return
    names = [n for n in a.models.split(",") if n]
    unknown = set(names) - {m.name for m in ZOO}
    if unknown:
        p.error(f"--models: unknown {sorted(unknown)}; known: {[m.name for m in ZOO]}")
    models = [m for m in ZOO if not names or m.name in names]
    strategies = [s for s in a.strategies.split(",") if s] or list(STRATEGIES)
    if set(strategies) - set(STRATEGIES):
        p.error(f"--strategies: known are {list(STRATEGIES)}")
    configs = {"all": ALL_CONFIGS, "half": HALF_CONFIGS, "optimizers": OPTIMIZER_CONFIGS,
               "pair": PAIR_CONFIGS}[a.configs]
    run_rows(models, strategies, configs, a.out, a.steps, a.agents, a.agent_budget, a.timeout,
             a.profile)


if __name__ == "__main__":
    main()
