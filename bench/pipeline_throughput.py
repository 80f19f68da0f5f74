"""Pipeline throughput and stage memory: GPipe over 1, 2 and 4 stage tasks and 1-16 micro-batches,
against GPipe's ideal speed-up and against one plain process training the same model.

    .venv/bin/python bench/pipeline_throughput.py [--quick] [--json OUT.json]
    .venv/bin/python bench/pipeline_throughput.py --calibrate    # the stage memory table

Full run about 9-10 minutes on 2 cores (15 pipeline runs of 12 steps of a 8.4 M-parameter
MLP at global batch 512, 3 plain runs; most of it is starting 1-4 task processes per run),
``--quick`` about 2, ``--calibrate`` about 4. On a shared machine every run first waits
(``--wait-quiet``) for other jobs' task processes to end and is marked noisy if any ran.

Each pipeline run launches the job's task processes by hand exactly as an agent would
(``python -m strata.worker.task`` with ``TF_CONFIG``, a BFC allocator limited to the task's budget,
events on a pipe): the chief runs ``worker.trainers.gpipe`` and holds stage 0, every other
stage is a ``worker.server`` task. The layout comes from ``strata.planner.plan_pipeline`` and each
task's budget is ``strata.memory.default_budget`` of its stage's estimate, as the coordinator
would reserve. K = 1 means the chief alone holds the whole model (no server tasks).

Throughput is the steady state: examples/s between the progress event at the first step >=
``--warmup`` and the last step. "ideal" is GPipe's speed-up over K = 1 at the same M when the
K stages run truly in parallel: K x M / (M + K - 1) (bubble fraction (K-1)/(M+K-1)); "cores
busy" is the CPU seconds of all the job's task processes per second of that window (about 1
when the stages take turns, up to the core count when they overlap). "plain"
is one process (no cluster) training the same Keras model with a custom loop and the same total
intra-op threads (K x ``--threads``). Memory: each stage task's allocator peak (the chief's
own, the servers' last ``memory`` report) against the planner's estimate for that stage.

``launch_job`` is also what the throwaway test harnesses use: it returns every task's events.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from strata.taskconfig import TASK_CONFIG_VERSION  # noqa: E402
from strata.planner import WorkerSlot, plan_pipeline  # noqa: E402
from strata.memory import default_budget  # noqa: E402
from strata.modelspec import profile_model  # noqa: E402
from strata.spec import parse_job_spec  # noqa: E402

MiB = 1 << 20


def mlp_spec(*, name: str = "bench-pipeline", strategy: str = "pipeline", replicas: int = 1,
             stages: int = 2, microbatches: int = 4, input_dim: int = 64, hidden=(512,) * 8,
             classes: int = 10, batch: int = 512, steps: int = 0, epochs: int = 1,
             source: str = "synthetic", examples: int = 8192, recompute: bool = False,
             mixed: str = "none", optimizer: str = "adam", lr: float = 0.001,
             seed: int = 0) -> dict:
    data = {"source": source, "batch_size": batch}
    if source == "synthetic":
        data["examples"] = examples
    return {
        "name": name, "strategy": strategy, "workers": replicas, "stages": stages,
        "microbatches": microbatches,
        "model": {"builtin": {"kind": "mlp", "input_shape": [input_dim], "hidden": list(hidden),
                              "classes": classes}},
        "data": data,
        "training": {**({"steps": steps} if steps else {"epochs": epochs}),
                     "optimizer": {"name": optimizer, "learning_rate": lr}, "seed": seed},
        "memory": {"mixed_precision": mixed, "recompute": recompute},
    }


class TaskProc:
    """One task process and the thread that drains its events pipe."""

    def __init__(self, name: str, proc: subprocess.Popen, read_fd: int, log_path: str):
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.events: list[dict] = []
        self._t = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._t.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as f:
            for line in f:
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    pass

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == kind]

    def peak(self) -> int:
        peaks = [e["memory"]["peak"] for e in self.events
                 if isinstance(e.get("memory"), dict) and e["memory"].get("peak")]
        return max(peaks) if peaks else 0

    def stop(self, grace: float = 10.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._t.join(timeout=5)
        return self.proc.returncode

    def log(self, n: int = 3000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""


def plan_layout(spec: dict) -> tuple[dict, list[dict]]:
    """The ``pipeline`` section the coordinator would hand the chief, from the planner (workers
    with room to spare, so the split is the planner's cost-optimal one)."""
    profile = profile_model(spec["model"])
    S, R, M = int(spec["stages"]), int(spec["workers"]), int(spec["microbatches"])
    workers = [WorkerSlot(f"w{i}", 1 << 40) for i in range(S * R)]
    tr = spec["training"]
    plan = plan_pipeline(profile, workers, stages=S, microbatches=M,
                         global_batch=int(spec["data"]["batch_size"]), replicas=R,
                         optimizer=tr["optimizer"]["name"],
                         mixed_precision=spec["memory"]["mixed_precision"],
                         recompute=bool(spec["memory"]["recompute"]))
    if not plan.feasible:
        raise RuntimeError(f"planner: {plan.reason}")
    layout = []
    for st in sorted(plan.stages, key=lambda s: (s.replica, s.index)):
        r, s = st.replica, st.index
        task = "chief:0" if (r, s) == (0, 0) else f"worker:{r * S + s - 1}"
        layout.append({"replica": r, "stage": s, "task": task, "first_layer": st.first_layer,
                       "last_layer": st.last_layer, "layers": list(st.layer_names),
                       "estimated_memory_bytes": st.memory_bytes,
                       "memory_budget_bytes": default_budget(st.memory_bytes)})
    section = {"stages": S, "replicas": R, "microbatches": M, "microbatch": plan.microbatch,
               "layout": layout}
    return section, layout


def task_config(spec: dict, section: dict, role: str, idx: str, budget: int, workdir: str,
                threads: int, report_interval_s: float) -> dict:
    """The TaskConfig message in its JSON form, as the coordinator and agent would build it."""
    cfg = {"version": TASK_CONFIG_VERSION, "job_id": "bench", "role": role,
           "index": int(idx), "spec": spec, "memory_budget_bytes": budget,
           "report_interval_s": report_interval_s,
           "agent": {"output_dir": os.path.join(workdir, "out"), "threads": threads,
                     "device": "CPU"}}
    if role == "chief":
        cfg["stage_layout"] = dict(section, layout=[
            {k: v for k, v in dict(e, role=e["task"].partition(":")[0],
                                   index=int(e["task"].partition(":")[2])).items()
             if k != "task"} for e in section["layout"]])
    return cfg


def start_task(task: str, cfg: dict, cluster: dict, workdir: str,
               env_extra: dict | None) -> TaskProc:
    """One task process started as an agent would: its config written, ``TF_CONFIG``, a BFC
    allocator limited to its budget, events on a pipe, output to ``ROLEINDEX.log``."""
    role, _, idx = task.partition(":")
    budget = cfg["memory_budget_bytes"]
    path = os.path.join(workdir, f"{role}{idx}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               TF_CONFIG=json.dumps({"cluster": cluster,
                                     "task": {"type": role, "index": int(idx)}}),
               TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(max(1, budget // MiB)))
    env.update(env_extra or {})
    r, w = os.pipe()
    log_path = os.path.join(workdir, f"{role}{idx}.log")
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "strata.worker.task", "--config", path,
                                 "--events-fd", str(w)], cwd=ROOT, env=env, pass_fds=(w,),
                                stdout=logf, stderr=subprocess.STDOUT)
    os.close(w)
    return TaskProc(task, proc, r, log_path)


def wait_sampling(procs: dict[str, TaskProc], timeout_s: float
                  ) -> tuple[int | None, list[tuple[float, int, float]], int]:
    """Waits for the chief (at most ``timeout_s``), sampling every 0.1 s its last step and the
    CPU seconds of all the tasks, then stops them all. Returns the chief's exit status (None:
    timed out), the samples and the most task processes of other jobs seen meanwhile."""
    chief = procs["chief:0"]
    samples: list[tuple[float, int, float]] = []  # (time, chief's last step, CPU s of all tasks)
    done = threading.Event()

    own = {p.proc.pid for p in procs.values()}
    foreign = [0]

    def sample() -> None:
        while not done.wait(0.1):
            prog = chief.of("progress")
            cpu = sum(_cpu_seconds(p.proc.pid) for p in procs.values())
            samples.append((time.time(), prog[-1]["step"] if prog else 0, cpu))
            if len(samples) % 10 == 0:
                foreign[0] = max(foreign[0], foreign_tasks(own))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        rc = chief.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        done.set()
        sampler.join(timeout=5)
        chief.stop(grace=5)
        for t, p in procs.items():
            if t != "chief:0":
                p.stop()
    return rc, samples, foreign[0]


def launch_job(raw: dict, workdir: str, *, threads: int = 1,
               budget_bytes: int | dict | None = None,
               report_interval_s: float = 0.5, timeout_s: float = 600,
               env_extra: dict | None = None) -> dict:
    """Runs one pipeline/hybrid job by hand (``budget_bytes``: every task's budget, or a
    {task: bytes} override; default the planner's estimate + headroom). Returns {"chief":
    TaskProc, "servers": {task: TaskProc}, "procs", "layout": [...], "rc": the chief's exit
    status, "spec": the normalized spec, "cpu_samples", "foreign_tasks"}."""
    import portpicker

    spec = parse_job_spec(raw).to_dict()
    section, layout = plan_layout(spec)
    S, R = section["stages"], section["replicas"]
    n_workers = S * R - 1
    ports = [portpicker.pick_unused_port() for _ in range(n_workers + 1)]
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"]}
    if n_workers:
        cluster["worker"] = [f"127.0.0.1:{p}" for p in ports[1:]]
    os.makedirs(workdir, exist_ok=True)
    procs: dict[str, TaskProc] = {}
    by_task = {e["task"]: e for e in layout}
    # servers first, then the chief (which waits for them anyway)
    order = [f"worker:{k}" for k in range(n_workers)] + ["chief:0"]
    for task in order:
        role, _, idx = task.partition(":")
        entry = by_task[task]
        budget = (budget_bytes.get(task) if isinstance(budget_bytes, dict) else budget_bytes) \
            or entry["memory_budget_bytes"]
        cfg = task_config(spec, section, role, idx, budget, workdir, threads, report_interval_s)
        procs[task] = start_task(task, cfg, cluster, workdir, env_extra)
    chief = procs["chief:0"]
    rc, samples, foreign = wait_sampling(procs, timeout_s)
    return {"chief": chief, "servers": {t: p for t, p in procs.items() if t != "chief:0"},
            "procs": procs, "layout": layout, "rc": rc, "spec": spec, "section": section,
            "cpu_samples": samples, "foreign_tasks": foreign}


def foreign_tasks(own: set[int]) -> int:
    """Task processes of other jobs on this machine (a shared machine's noise): processes whose
    command line runs ``strata.worker.task`` or pytest and that are not ``own``."""
    n = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in own or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"worker.task" in cmd or b"pytest" in cmd:
            n += 1
    return n


def wait_quiet(limit_s: float) -> int:
    """Waits (at most ``limit_s``) until no other task process runs; returns how many still do."""
    deadline = time.time() + limit_s
    while True:
        n = foreign_tasks(set())
        if n == 0 or time.time() >= deadline:
            return n
        time.sleep(2)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def busy_cores(job: dict, warmup: int) -> float:
    """CPU seconds of all the job's task processes per wall second while the chief went from
    step ``warmup`` to its last step: about 1 when the stages take turns, up to the number of
    cores when they overlap."""
    samples = job.get("cpu_samples") or []
    last = max((s[1] for s in samples), default=0)
    window = [s for s in samples if warmup <= s[1] < last]
    if len(window) < 2:
        return 0.0
    (t0, _, c0), (t1, _, c1) = window[0], window[-1]
    return (c1 - c0) / max(t1 - t0, 1e-9)


def stage_memory_rows(job: dict) -> list[dict]:
    """Per stage task: estimate, budget and measured allocator peak."""
    rows = []
    for e in job["layout"]:
        p = job["procs"][e["task"]]
        peak = p.peak()
        rows.append({"replica": e["replica"], "stage": e["stage"], "task": e["task"],
                     "layers": f"{e['first_layer']}-{e['last_layer'] - 1}",
                     "estimate": e["estimated_memory_bytes"],
                     "budget": e["memory_budget_bytes"], "peak": peak,
                     "ratio": peak / e["estimated_memory_bytes"] if e["estimated_memory_bytes"]
                     else 0.0})
    return rows


def steady_rate(chief: TaskProc, batch: int, warmup: int) -> float:
    prog = [e for e in chief.of("progress")]
    if len(prog) < 2:
        return 0.0
    start = next((e for e in prog if e["step"] >= warmup), prog[0])
    end = prog[-1]
    if end["step"] <= start["step"]:
        return float(end.get("examples_per_sec") or 0.0)
    return (end["step"] - start["step"]) * batch / max(end["time"] - start["time"], 1e-9)


# --------------------------------------------------------------------------------------------
# the plain single-process baseline (run in a child process for its own thread settings)


def plain_child(args: argparse.Namespace) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import keras

    from strata.worker import data as wdata
    from strata.jobspec import OptimizerSpec
    from strata.worker import models as wmodels

    raw = mlp_spec(hidden=[args.width] * args.depth, input_dim=args.input_dim, batch=args.batch)
    spec = parse_job_spec(raw).to_dict()
    keras.utils.set_random_seed(0)
    model, from_logits = wmodels.build_model(spec["model"], "none")
    opt = wmodels.build_optimizer(OptimizerSpec("adam"), "none")
    loss_fn = wmodels.build_loss("sparse_categorical_crossentropy", from_logits)
    s = wdata.load_synthetic_splits((args.input_dim,), 10, 8192)
    it = iter(wdata.make_train_dataset(s.x_train, s.y_train, args.batch, 0))
    opt.build(model.trainable_variables)

    @tf.function
    def step(it):
        x, y = next(it)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
        g = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(g, model.trainable_variables))
        return loss

    for _ in range(args.warmup):
        step(it).numpy()
    t = time.time()
    for _ in range(args.steps):
        loss = step(it)
    float(loss)
    rate = args.steps * args.batch / (time.time() - t)
    print(json.dumps({"examples_per_sec": rate}))
    return 0


def run_plain(width: int, depth: int, input_dim: int, batch: int, threads: int, steps: int,
              warmup: int) -> float:
    cmd = [sys.executable, os.path.abspath(__file__), "--plain-child", "--threads", str(threads),
           "--width", str(width), "--depth", str(depth), "--input-dim", str(input_dim),
           "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup)]
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    for line in out.stdout.splitlines()[::-1]:
        if line.startswith("{"):
            return float(json.loads(line)["examples_per_sec"])
    raise RuntimeError(f"plain baseline failed: {out.stderr[-2000:]}")


# --------------------------------------------------------------------------------------------


CAL_BATCH = 1024
CALIBRATION = [  # (name, spec overrides): the deep MLP 64-[1024]x13-10 on digits, CAL_BATCH
    ("pipeline, 4 stages, M=4", dict(stages=4, microbatches=4)),
    ("pipeline, 4 stages, M=4, recompute", dict(stages=4, microbatches=4, recompute=True)),
    ("pipeline, 2 stages, M=4", dict(stages=2, microbatches=4)),
    ("pipeline, 2 stages, M=4, recompute", dict(stages=2, microbatches=4, recompute=True)),
    ("hybrid 2 x 2, M=4", dict(strategy="hybrid", replicas=2, stages=2, microbatches=4)),
    ("pipeline, 4 stages, M=4, bfloat16", dict(stages=4, microbatches=4, mixed="bfloat16")),
    ("pipeline, 4 stages, M=4, bfloat16, recompute",
     dict(stages=4, microbatches=4, mixed="bfloat16", recompute=True)),
]


def calibrate(args: argparse.Namespace) -> int:
    """Measured stage peaks against the planner's estimates on a model whose data-parallel
    estimate is over 3x one stage's budget, with the budgets the coordinator would give."""
    from strata.memory import estimate_task_memory

    hidden = [1024] * 13
    spec = parse_job_spec(mlp_spec(hidden=hidden, source="digits", batch=CAL_BATCH, steps=6,
                                   strategy="multi_worker_mirrored", stages=0),
                          ).to_dict()
    whole = estimate_task_memory(spec, CAL_BATCH).total
    print(f"model 64-[1024]x13-10 ({profile_model(spec['model']).total_params:,} params), digits, "
          f"global batch {CAL_BATCH}, Adam, 6 steps; data-parallel estimate of the whole model "
          f"{whole / MiB:.0f} MiB", flush=True)
    print("| configuration | task | layers | measured peak (MiB) | estimate (MiB) | budget (MiB) | "
          "peak / estimate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    work = tempfile.mkdtemp(prefix="strata-pipe-cal-")
    out = []
    for n, (name, kw) in enumerate(CALIBRATION):
        busy = wait_quiet(args.wait_quiet)
        raw = mlp_spec(hidden=hidden, batch=CAL_BATCH, source="digits", steps=6, **kw)
        job = launch_job(raw, os.path.join(work, str(n)), report_interval_s=0.2)
        rows = stage_memory_rows(job)
        res = job["chief"].of("result")
        digests = res[0]["replica_weights_sha256"] if res else []
        note = "" if job["rc"] == 0 else f" (chief exit {job['rc']})"
        if len(digests) > 1:
            note += " (replicas identical)" if len(set(digests)) == 1 else " (replicas DIFFER)"
        if max(busy, job["foreign_tasks"]):
            note += " (noisy)"
        for r in rows:
            print(f"| {name}{note} | replica {r['replica']} stage {r['stage']} ({r['task']}) | "
                  f"{r['layers']} | {r['peak'] / MiB:.1f} | {r['estimate'] / MiB:.1f} | "
                  f"{r['budget'] / MiB:.0f} | {r['ratio']:.2f} |", flush=True)
        out.append({"name": name, "rc": job["rc"], "rows": rows,
                    "max_budget": max(r["budget"] for r in rows)})
    ratios = [r["ratio"] for o in out for r in o["rows"]]
    print(f"\npeak / estimate {min(ratios):.2f} - {max(ratios):.2f}; every peak under its budget: "
          f"{all(r['peak'] <= r['budget'] for o in out for r in o['rows'])}; whole-model estimate "
          f"/ largest stage budget of the 4-stage pipeline: {whole / out[0]['max_budget']:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"whole_model_estimate": whole, "runs": out}, f, indent=1)
    return 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="K in 1,2 and M in 1,4 only, fewer steps (about 2 minutes)")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=8, help="hidden layers (a multiple of 4)")
    ap.add_argument("--input-dim", type=int, default=1024,
                    help="input features (= width: every layer the same size)")
    ap.add_argument("--batch", type=int, default=512, help="global batch")
    ap.add_argument("--steps", type=int, default=12, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=4, help="steps before the steady state")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per stage task")
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--microbatches", default="1,2,4,8,16")
    ap.add_argument("--wait-quiet", type=float, default=300,
                    help="before each run, wait up to this many seconds for other jobs' task "
                         "processes (or pytest) on this machine to end; runs that saw any are "
                         "marked noisy")
    ap.add_argument("--calibrate", action="store_true",
                    help="instead: the stage memory table (measured peaks against the planner's "
                         "estimates, 7 configurations, about 4 minutes)")
    ap.add_argument("--plain-child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args()


def measure_plain(args: argparse.Namespace, ks: list[int], results: dict) -> None:
    """The plain process with K x ``--threads`` intra-op threads, for each K."""
    for k in ks:
        wait_quiet(args.wait_quiet)
        rate = run_plain(args.width, args.depth, args.input_dim, args.batch, k * args.threads,
                         args.steps, args.warmup)
        results["plain"][k] = rate
        print(f"plain process, {k * args.threads} intra-op threads: {rate:,.0f} ex/s", flush=True)


def run_line(row: dict, noisy: int) -> str:
    """One pipeline run's figures, as printed once it ends."""
    k, m, rate, mem = row["stages"], row["microbatches"], row["examples_per_sec"], row["memory"]
    return (f"K={k} M={m:2d}: {rate:7,.0f} ex/s  x{row['speedup_vs_k1'] or 0:.2f} vs K=1 "
            f"M=1, "
            f"x{row['speedup_vs_k1_same_m'] or 0:.2f} vs K=1 same M (ideal "
            f"x{row['ideal_speedup']:.2f}), {row['vs_plain']:.2f} of plain, "
            f"{row['busy_cores']:.2f} cores busy, first step {row['first_step_s']:.1f} s; "
            f"stage peak/estimate " + ", ".join(f"{r['peak'] / MiB:.0f}/"
                                                f"{r['estimate'] / MiB:.0f}" for r in mem)
            + f" MiB; run {row['wall_s']:.0f} s"
            + (f"; NOISY: {noisy} other task processes ran" if noisy else ""))


def measure_pipelines(args: argparse.Namespace, ks: list[int], ms: list[int],
                      hidden: list[int], work: str, env: dict[str, str], results: dict) -> None:
    """Each K stages x M micro-batches run, its row added to ``results["pipeline"]``."""
    base = None
    base_m: dict[int, float] = {}
    for k in ks:
        for m in ms:
            if args.batch % m:
                continue
            raw = mlp_spec(stages=k, microbatches=m, hidden=hidden, input_dim=args.input_dim,
                           batch=args.batch, steps=args.steps)
            busy = wait_quiet(args.wait_quiet)
            t0 = time.time()
            job = launch_job(raw, os.path.join(work, f"k{k}-m{m}"), threads=args.threads,
                             report_interval_s=0.0001, env_extra=env)
            noisy = max(busy, job["foreign_tasks"])
            if job["rc"] != 0:
                print(f"K={k} M={m}: chief exit {job['rc']}\n{job['chief'].log()}", flush=True)
                continue
            rate = steady_rate(job["chief"], args.batch, args.warmup)
            if k == 1:
                base_m[m] = rate
                if m == 1:
                    base = rate
            mem = stage_memory_rows(job)
            row = {"stages": k, "microbatches": m, "examples_per_sec": rate,
                   "speedup_vs_k1": rate / base if base else None,
                   "speedup_vs_k1_same_m": rate / base_m[m] if base_m.get(m) else None,
                   "efficiency": m / (m + k - 1), "ideal_speedup": k * m / (m + k - 1),
                   "vs_plain": rate / results["plain"][k],
                   "busy_cores": busy_cores(job, args.warmup),
                   "first_step_s": job["chief"].of("first_step")[0]["latency_s"],
                   "wall_s": time.time() - t0, "memory": mem, "foreign_tasks": noisy}
            results["pipeline"].append(row)
            print(run_line(row, noisy), flush=True)


def print_table(results: dict, threads: int) -> None:
    """The pipeline runs as a table, the stage peaks against their estimates, the plain runs."""
    print()
    print("| K | M | examples/s | speed-up vs K=1, M=1 | vs K=1, same M | ideal K*M/(M+K-1) | "
          "efficiency M/(M+K-1) | vs plain process (K threads) | cores busy | first step | "
          "stage peak / estimate (MiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in results["pipeline"]:
        mem = ", ".join(f"{r['peak'] / MiB:.0f} / {r['estimate'] / MiB:.0f}"
                        for r in row["memory"])
        sp = f"{row['speedup_vs_k1']:.2f}" if row["speedup_vs_k1"] else "-"
        sm = f"{row['speedup_vs_k1_same_m']:.2f}" if row["speedup_vs_k1_same_m"] else "-"
        print(f"| {row['stages']} | {row['microbatches']} | {row['examples_per_sec']:,.0f} | {sp} "
              f"| {sm} "
              f"| {row['ideal_speedup']:.2f} | {row['efficiency']:.2f} | {row['vs_plain']:.2f} "
              f"| {row['busy_cores']:.2f} | {row['first_step_s']:.1f} s | {mem} |"
              + (" (noisy)" if row["foreign_tasks"] else ""))
    ratios = [r["peak"] / r["estimate"] for row in results["pipeline"] for r in row["memory"]
              if r["estimate"]]
    if ratios:
        under = all(r["peak"] <= r["budget"] for row in results["pipeline"] for r in row["memory"])
        print(f"\nstage peak / estimate over all runs: {min(ratios):.2f} - {max(ratios):.2f}; "
              f"every peak under its budget: {under}")
    print("plain process: " + ", ".join(f"{k * threads} threads {v:,.0f} ex/s"
                                        for k, v in results["plain"].items()))


def main() -> int:
    args = parse_args()
    if args.plain_child:
        return plain_child(args)
    if args.calibrate:
        return calibrate(args)
    ks = [int(k) for k in args.stages.split(",")]
    ms = [int(m) for m in args.microbatches.split(",")]
    if args.quick:
        ks, ms, args.steps, args.warmup = [k for k in ks if k <= 2], [1, 4], 8, 3
    work = tempfile.mkdtemp(prefix="strata-pipe-bench-")
    hidden = [args.width] * args.depth
    # worker.server does not hand the task's thread count to tf.distribute.Server (its
    # sessions use every core); TensorFlow's own variable makes every task use --threads
    env = {"TF_NUM_INTRAOP_THREADS": str(args.threads)}
    t_all = time.time()
    params = profile_model(mlp_spec(hidden=hidden, input_dim=args.input_dim)["model"]).total_params
    results = {"config": {"width": args.width, "depth": args.depth, "input_dim": args.input_dim,
                          "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
                          "threads_per_stage": args.threads, "params": params,
                          "cores": os.cpu_count()},
               "pipeline": [], "plain": {}}
    print(f"model: {args.input_dim}-" + "-".join(str(h) for h in hidden) + f"-10 MLP, {params:,} "
          f"params, global batch {args.batch}, Adam, synthetic data; {args.steps} steps per run, "
          f"steady state from step {args.warmup}; {args.threads} intra-op thread(s) per stage "
          f"task; {os.cpu_count()} cores", flush=True)
    measure_plain(args, ks, results)
    measure_pipelines(args, ks, ms, hidden, work, env, results)
    print_table(results, args.threads)
    print(f"total {time.time() - t_all:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
