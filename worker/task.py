"""A Strata task process: one TensorFlow training task of a job.

    python -m strata.worker.task --config CONFIG.json --events-fd N

The worker agent starts it with ``TF_CONFIG`` (the job's cluster and this task's place in it)
and, on CPU, ``TF_CPU_ALLOCATOR_USE_BFC=true`` and ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` (the task's
memory budget) already in the environment. CONFIG.json carries the job id, role and index,
the normalized job spec, the output directory, intra-op threads, the memory budget in bytes,
the device (``CPU`` or ``GPU:N``) and the progress report interval.

It writes newline-delimited JSON events to file descriptor N: ``started`` (cluster rendezvous
done), ``first_step``, ``progress`` (at most every ``report_interval_s``, plus after the first
and the last step), ``result`` (test accuracy and loss, a SHA-256 of the final weights, the
saved model path on worker 0) or ``error`` (kind ``oom``, ``bad_config`` or ``error``) before
a failing exit. Exit statuses are in ``strata.exitcodes``. Human-readable logs go to stdout.

Training is MultiWorkerMirroredStrategy with a custom loop (Keras 3 ``model.fit`` does not work
under it): each worker reads its own shard of the training set, all workers run the same
number of steps, gradients are all-reduced every step.

The process always leaves through ``os._exit`` after flushing its outputs (a normal
interpreter exit after MWMS training takes another 1-1.5 s of TensorFlow teardown), and
watchdogs end it if its parent (the agent) dies, so no TensorFlow process is left orphaned.

Signals: SIGTERM writes an ``error`` event and kills the process, except during the cluster
rendezvous (the MultiWorkerMirroredStrategy constructor), where TensorFlow's coordination
service has its own SIGTERM handler and the GIL is held: there only SIGKILL works, so stop a
task with SIGTERM and then SIGKILL after a grace period.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import traceback

from strata.exitcodes import TASK_EXIT_BAD_CONFIG, TASK_EXIT_ERROR, TASK_EXIT_OK, TASK_EXIT_OOM
from strata.worker.common import (
    eval_sums,
    BadConfig, Events, configure_device, exit_task, format_mib, install_sigterm_handler, is_oom,
    log, prepare_environment, start_parent_watchdog, summarize_error,
)

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
SUPPORTED_STRATEGIES = ("multi_worker_mirrored", "parameter_server", "pipeline", "hybrid")


# --------------------------------------------------------------------------------------------
# configuration (checked before TensorFlow is imported, so bad configs fail in milliseconds)


def load_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise BadConfig("--config", f"cannot read task config {path}: {e}") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("spec"), dict):
        raise BadConfig("--config", "task config must be an object with a spec")
    return cfg


def validate(cfg: dict) -> None:
    from strata.modelspec import ModelSpecError, check_keras_json_safe, parse_keras_json
    from strata.worker.models import LOSSES, OPTIMIZERS, POLICIES

    spec = cfg["spec"]
    strategy = spec.get("strategy", "multi_worker_mirrored")
    if strategy not in SUPPORTED_STRATEGIES:
        raise BadConfig("strategy", f"strategy {strategy!r} is not supported by this task "
                                    f"runner (supported: {', '.join(SUPPORTED_STRATEGIES)})")
    mem = spec.get("memory", {}) or {}
    if mem.get("recompute") and strategy not in ("pipeline", "hybrid"):
        raise BadConfig("memory.recompute", "activation recomputation is only available for "
                                            "pipeline and hybrid jobs")
    mp = mem.get("mixed_precision", "none") or "none"
    if mp not in POLICIES:
        raise BadConfig("memory.mixed_precision", f"unknown value {mp!r}; use none, bfloat16 or "
                                                  "float16")
    tr = spec.get("training", {}) or {}
    opt = str((tr.get("optimizer") or {}).get("name", "adam")).lower()
    if opt not in OPTIMIZERS:
        raise BadConfig("training.optimizer.name", f"unknown optimizer {opt!r}; use one of "
                                                   f"{', '.join(OPTIMIZERS)}")
    loss = tr.get("loss", "sparse_categorical_crossentropy")
    if loss not in LOSSES:
        raise BadConfig("training.loss", f"unknown loss {loss!r}; use one of {', '.join(LOSSES)}")
    data = spec.get("data", {}) or {}
    if data.get("source", "digits") not in ("digits", "synthetic", "npz"):
        raise BadConfig("data.source", f"unknown source {data.get('source')!r}")
    gb = int(data.get("batch_size", 0) or 0)
    if gb < 1:
        raise BadConfig("data.batch_size", f"must be a positive integer, got {gb}")
    model = spec.get("model") or {}
    if model.get("keras_json"):
        try:
            check_keras_json_safe(parse_keras_json(model["keras_json"]))
        except ModelSpecError as e:
            raise BadConfig(e.field, e.message) from None
    elif not model.get("builtin"):
        raise BadConfig("model", "needs builtin or keras_json")
    if data.get("source") == "npz":
        _check_npz(data.get("path", ""))
    device = str(cfg.get("device", "CPU") or "CPU")
    if device != "CPU" and not device.startswith("GPU:"):
        raise BadConfig("device", f"unknown device {device!r}; use CPU or GPU:N")


def _check_npz(path: str) -> None:
    """Fails fast (before importing TensorFlow) on a missing or incomplete npz file; reads
    only the archive's directory."""
    from strata.worker.data import DataError, load_npz_keys

    try:
        load_npz_keys(path)
    except DataError as e:
        raise BadConfig(e.field, e.message) from None


def _num_workers_from_tf_config() -> tuple[int, int]:
    raw = os.environ.get("TF_CONFIG", "")
    if not raw:
        return 1, 0
    try:
        tc = json.loads(raw)
        workers = tc.get("cluster", {}).get("worker", [])
        return max(1, len(workers)), int(tc.get("task", {}).get("index", 0))
    except (ValueError, AttributeError, TypeError):
        raise BadConfig("TF_CONFIG", "is not valid JSON with cluster.worker and task.index") from None


def run(cfg: dict, events: Events) -> int:
    spec = cfg["spec"]
    data_spec = spec.get("data", {}) or {}
    training = spec.get("training", {}) or {}
    mem = spec.get("memory", {}) or {}
    mixed = mem.get("mixed_precision", "none") or "none"
    device = str(cfg.get("device", "CPU") or "CPU")
    threads = int(cfg.get("threads", 0) or 0)
    interval = float(cfg.get("report_interval_s", 0.5) or 0.5)
    index = int(cfg.get("index", 0) or 0)
    seed = int(training.get("seed", 0) or 0)
    gb = int(data_spec["batch_size"])
    n_workers, tf_index = _num_workers_from_tf_config()
    if gb % n_workers:
        raise BadConfig("data.batch_size", f"global batch {gb} is not divisible by the "
                                           f"{n_workers} workers")
    if tf_index != index:
        log(f"warning: config index {index} differs from TF_CONFIG task.index {tf_index}; "
            "using TF_CONFIG's")
        index = tf_index

    t_import = time.time()
    import numpy as np

    tf, memory = configure_device(cfg)
    import keras

    from strata.worker import data as wdata
    from strata.worker import models as wmodels

    timeout = float(os.environ.get("STRATA_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S))
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    install_sigterm_handler(events)
    n_replicas = strategy.num_replicas_in_sync
    events.emit("started", workers=n_workers, replicas=n_replicas)
    log(f"started: worker {index} of {n_workers}, {n_replicas} replicas, device {device}, "
        f"threads {threads or 'default'}, TF {tf.__version__} (import+rendezvous "
        f"{time.time() - t_import:.1f} s)")
    if gb % n_replicas:
        raise BadConfig("data.batch_size", f"global batch {gb} is not divisible by the "
                                           f"{n_replicas} replicas")
    per_replica = gb // n_replicas

    keras.utils.set_random_seed(seed)
    from strata.modelspec import ModelSpecError

    loss_name = training.get("loss", "sparse_categorical_crossentropy")
    try:
        with strategy.scope():
            model, from_logits = wmodels.build_model(spec["model"], mixed,
                                                     sync_batchnorm=n_replicas > 1)
            optimizer = wmodels.build_optimizer(training.get("optimizer") or {}, mixed)
            loss_fn = wmodels.build_loss(loss_name, from_logits)
    except ModelSpecError as e:
        raise BadConfig(e.field, e.message) from None
    input_shape = tuple(int(d) for d in model.inputs[0].shape[1:])
    output_shape = tuple(int(d) for d in model.outputs[0].shape[1:])

    try:
        splits = wdata.load_splits(data_spec, input_shape, output_shape)
        field = "data.path" if data_spec.get("source") == "npz" else "data.source"
        y_train = wdata.prepare_targets(splits.y_train, loss_name, output_shape, field)
        y_test = wdata.prepare_targets(splits.y_test, loss_name, output_shape, field)
    except wdata.DataError as e:
        raise BadConfig(e.field, e.message) from None
    x_test = splits.x_test
    classify = loss_name in wdata.CLASSIFICATION_LOSSES or (
        np.issubdtype(splits.y_test.dtype, np.integer) and splits.y_test.ndim == 1)
    n_train = splits.n_train
    steps = wdata.total_steps(training, n_train, gb)

    def dataset_fn(ctx: tf.distribute.InputContext):
        wid, nw = ctx.input_pipeline_id, ctx.num_input_pipelines
        x, y = wdata.shard(splits.x_train, y_train, wid, nw)
        return wdata.make_train_dataset(x, y, ctx.get_per_replica_batch_size(gb), seed + wid)

    # the input pipeline (and its transient second copy of the shard while the iterator is
    # created) comes before the optimizer slots exist, which keeps this start-up peak low
    dist_ds = strategy.distribute_datasets_from_function(dataset_fn)
    iterator = iter(dist_ds)
    with strategy.scope():
        optimizer.build(model.trainable_variables)
    variables = model.trainable_variables
    scaled = mixed == "float16"

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            out = model(x, training=True)
            per_example = loss_fn(y, tf.cast(out, tf.float32))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=gb)
            loss_for_grad = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(loss_for_grad, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    @tf.function
    def train_step(it):
        per_replica_loss = strategy.run(step_fn, args=next(it))
        return strategy.experimental_local_results(per_replica_loss)

    log(f"training {model.name}: {model.count_params():,} params, {steps} steps, global batch "
        f"{gb} ({per_replica} per replica), {n_train} train / {x_test.shape[0]} test rows, "
        f"mixed precision {mixed}")

    local_replicas = len(strategy.extended.worker_devices)
    t_start = time.time()
    last_t, last_step, last_report = t_start, 0, t_start
    for step in range(1, steps + 1):
        local = train_step(iterator)
        now = time.time()
        if step == 1:
            events.emit("first_step", latency_s=now - t_start)
        if step == 1 or step == steps or now - last_report >= interval:
            # this worker's replicas' share of the global mean, scaled back to a mean over the
            # examples this worker saw (reading it waits for the step to finish)
            loss_v = float(sum(float(t) for t in local)) * n_replicas / max(1, local_replicas)
            now = time.time()
            eps = (step - last_step) * gb / max(now - last_t, 1e-9)
            m = memory()
            events.emit("progress", step=step, total_steps=steps, loss=loss_v,
                        examples_per_sec=eps, memory=m)
            log(f"step {step}/{steps} loss {loss_v:.4f} {eps:,.0f} ex/s mem "
                f"{format_mib(m['current'])} (peak {format_mib(m['peak'])})")
            last_t, last_step, last_report = now, step, now
    train_s = time.time() - t_start

    # evaluation: every worker evaluates the full test split locally (same weights, same result)
    @tf.function(reduce_retracing=True)
    def eval_batch(x, y):
        out = tf.cast(model(x, training=False), tf.float32)
        return eval_sums(tf, loss_fn, y, out, classify)

    total_loss, total_correct = 0.0, 0.0
    eval_bs = max(1, per_replica)
    n_test = int(x_test.shape[0])
    for i in range(0, n_test, eval_bs):
        l, c = eval_batch(tf.constant(x_test[i:i + eval_bs]), tf.constant(y_test[i:i + eval_bs]))
        total_loss += float(l)
        total_correct += float(c)
    test_loss = total_loss / max(1, n_test)
    test_acc = total_correct / max(1, n_test) if classify else 0.0

    h = hashlib.sha256()
    for w in model.weights:
        h.update(np.ascontiguousarray(np.asarray(w.numpy(), dtype=np.float32)).tobytes())
    digest = h.hexdigest()

    model_path = None
    if index == 0:
        out_dir = cfg.get("output_dir") or os.getcwd()
        os.makedirs(out_dir, exist_ok=True)
        model_path = os.path.abspath(os.path.join(out_dir, "model.keras"))
        model.save(model_path)
    m = memory()
    events.emit("result", test_accuracy=test_acc, test_loss=test_loss, weights_sha256=digest,
                model_path=model_path, memory=m, steps=steps, train_seconds=train_s)
    log(f"result: test accuracy {test_acc:.4f} test loss {test_loss:.4f} after {steps} steps "
        f"({train_s:.1f} s); peak memory {format_mib(m['peak'])}; weights {digest[:12]}"
        + (f"; saved {model_path}" if model_path else ""))
    # Leave from here, not by returning: returning frees the strategy, its iterators and
    # collective state, whose destructors talk to the cluster's coordination service. When a
    # peer has already exited that blocks ~10 s (measured: the second worker of every job
    # ended 10 s after the first) before failing.
    exit_task(TASK_EXIT_OK, events)
    return TASK_EXIT_OK  # not reached


# --------------------------------------------------------------------------------------------


def runner_for(cfg: dict):
    """The function that runs this task: the MWMS loop here; for the other strategies the
    chief's driver (``worker.ps`` or ``worker.pipeline``) or a plain server (``worker.server``)."""
    strategy = cfg["spec"].get("strategy", "multi_worker_mirrored")
    role = str(cfg.get("role", "worker"))
    if strategy == "multi_worker_mirrored":
        return run
    if role == "chief":
        if strategy == "parameter_server":
            from strata.worker.ps import run_chief
            return run_chief
        from strata.worker.pipeline import run_driver
        return run_driver
    if role in ("worker", "ps"):
        from strata.worker.server import serve
        return serve
    raise BadConfig("role", f"role {role!r} has no runner for strategy {strategy!r}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m strata.worker.task", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="task config JSON file")
    p.add_argument("--events-fd", type=int, default=None,
                   help="file descriptor for newline-delimited JSON events (default: stderr)")
    args = p.parse_args(argv)
    start_parent_watchdog()
    events = Events(args.events_fd)
    install_sigterm_handler(events)
    code = TASK_EXIT_ERROR
    try:
        cfg = load_config(args.config)
        validate(cfg)
        prepare_environment(cfg)
        code = runner_for(cfg)(cfg, events)
    except BadConfig as e:
        log(f"bad config: {e}")
        events.emit("error", kind="bad_config", message=str(e))
        code = TASK_EXIT_BAD_CONFIG
    except BaseException as e:  # noqa: BLE001 - every failure must become an event and a code
        if is_oom(e):
            limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")
            budget = f"{limit} MiB" if limit else "its memory budget"
            msg = f"out of memory: the task exceeded {budget}: {summarize_error(e)}"
            log(msg)
            events.emit("error", kind="oom", message=msg)
            code = TASK_EXIT_OOM
        elif isinstance(e, KeyboardInterrupt):
            events.emit("error", kind="error", message="interrupted")
            code = TASK_EXIT_ERROR
        else:
            traceback.print_exc()
            log(f"failed: {summarize_error(e)}")
            events.emit("error", kind="error", message=summarize_error(e))
            code = TASK_EXIT_ERROR
    exit_task(code, events)


if __name__ == "__main__":
    main()
