"""The chief of a ``parameter_server`` job: asynchronous training with TensorFlow's
``ParameterServerStrategy`` and ``ClusterCoordinator`` (the strategy's runner for role
``chief``; the job's ``worker`` and ``ps`` tasks are plain ``worker.server`` processes).

Contract: every layer's variables and optimizer slots live on the PS task the contract's
``ps_placement`` names (checked after building; a misplaced one fails the job, bad_config).
Steps are scheduled on whichever worker is free and applied asynchronously; a lost worker does
not fail the job, a lost PS task does. Every wait is bounded (``Watchdog``:
``STRATA_PS_CONNECT_TIMEOUT_S``, ``STRATA_PS_UNREACHABLE_TIMEOUT_S``); a chief whose peers are
gone exits 78 (``TASK_EXIT_COLLECTIVE``, kind ``collective_timeout``). A checkpoint holds
exactly the steps it counts; evaluation, the weights' SHA-256 and ``model.keras`` run on the
chief. Events as every training runner (``strata.worker.runner``).

Placement, training, failures, checkpoints, events: docs/strategies.md, "The parameter-server
chief".
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

from typing import Any, Callable

from strata.exitcodes import EXIT_KIND, TASK_EXIT_COLLECTIVE, TASK_EXIT_ERROR
from strata.jobspec import JobSpec
from strata.taskconfig import ParameterServerSection, TaskConfig, TaskConfigError
from strata.worker.cluster import cluster_from_tf_config, reachable
from strata.worker.events import Events, exit_task, format_mib, log
from strata.worker.losses import eval_sums
from strata.worker.runner import Progress, TrainingRunner, gradient_step

DEFAULT_CONNECT_TIMEOUT_S = 120.0
DEFAULT_UNREACHABLE_TIMEOUT_S = 60.0
PROBE_INTERVAL_S = 1.0
EVAL_BATCH_MAX = 256  # the chief evaluates in batches of at most this many rows


# --------------------------------------------------------------------------------------------
# cluster


def _ps_cluster() -> dict[str, list[str]]:
    cluster, role, index = cluster_from_tf_config()
    if role != "chief" or index != 0 or len(cluster.get("chief", [])) != 1:
        raise TaskConfigError("TF_CONFIG", f"the parameter_server driver runs as chief:0 of a cluster "
                                     f"with one chief, not {role}:{index}")
    if not cluster.get("worker"):
        raise TaskConfigError("TF_CONFIG", "a parameter_server job needs at least one worker task")
    if not cluster.get("ps"):
        raise TaskConfigError("TF_CONFIG", "a parameter_server job needs at least one ps task")
    return cluster


class Watchdog(threading.Thread):
    """Bounds every wait of the chief. Probes each worker and PS task's port every second;
    in phase ``connect`` fails when the coordinator has not connected within ``connect_s``;
    in phase ``train`` when no worker is reachable for ``unreachable_s`` (the coordinator
    would wait for one to come back for an hour); in ``train`` and ``eval`` when a PS task is
    unreachable for ``unreachable_s`` (its variables are gone). Fails by writing an ``error``
    event and ending the process (the main thread is blocked inside TensorFlow)."""

    def __init__(self, cluster: dict[str, list[str]], events: Events, *, connect_s: float,
                 unreachable_s: float):
        super().__init__(name="ps-watchdog", daemon=True)
        self.workers = list(cluster["worker"])
        self.ps = list(cluster["ps"])
        self.events = events
        self.connect_s = connect_s
        self.unreachable_s = unreachable_s
        self.phase = "connect"
        self._phase_t0 = time.time()
        self._stopping = threading.Event()
        self.worker_up = [True] * len(self.workers)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        # time-outs count from the start of the phase
        now = time.time()
        self._phase_t0 = now
        self._last_worker = now
        self._last_ps = [now] * len(self.ps)

    def stop(self) -> None:
        self._stopping.set()

    def _fail(self, msg: str, peer: bool = False) -> None:
        """Ends the task; ``peer``: because tasks it trains with are gone (exit status 78)."""
        log(f"failed: {msg}")
        code = TASK_EXIT_COLLECTIVE if peer else TASK_EXIT_ERROR
        self.events.emit("error", kind=EXIT_KIND[code], message=msg)
        exit_task(code, self.events)

    def run(self) -> None:
        self.set_phase(self.phase)
        while not self._stopping.wait(PROBE_INTERVAL_S):
            now = time.time()
            wup = [reachable(a) for a in self.workers]
            pup = [reachable(a) for a in self.ps]
            for i, (was, up) in enumerate(zip(self.worker_up, wup)):
                if was and not up and self.phase == "train":
                    log(f"worker:{i} at {self.workers[i]} is unreachable; its steps go to the "
                        "other workers")
                elif up and not was and self.phase == "train":
                    log(f"worker:{i} at {self.workers[i]} is reachable again")
            self.worker_up = wup
            if any(wup):
                self._last_worker = now
            for i, up in enumerate(pup):
                if up:
                    self._last_ps[i] = now
            phase = self.phase
            if phase == "connect" and now - self._phase_t0 > self.connect_s:
                down = [f"worker:{i} ({a})" for i, (a, u) in enumerate(zip(self.workers, wup))
                        if not u] + [f"ps:{i} ({a})" for i, (a, u) in enumerate(zip(self.ps, pup))
                                     if not u]
                self._fail(f"could not connect to the cluster within {self.connect_s:.0f} s"
                           + (f"; not reachable: {', '.join(down)}" if down else ""))
            if phase == "train" and now - self._last_worker > self.unreachable_s:
                self._fail(f"all {len(self.workers)} worker tasks have been unreachable for "
                           f"{self.unreachable_s:.0f} s ({', '.join(self.workers)}); no step "
                           "can run", peer=True)
            if phase in ("train", "eval"):
                for i, last in enumerate(self._last_ps):
                    if now - last > self.unreachable_s:
                        self._fail(f"parameter server ps:{i} ({self.ps[i]}) has been "
                                   f"unreachable for {self.unreachable_s:.0f} s; the variables "
                                   "it held are lost", peer=True)


# --------------------------------------------------------------------------------------------
# placement


def _placement_from_config(cfg: TaskConfig, profile, num_ps: int) -> dict[str, int]:
    section = cfg.section
    if not isinstance(section, ParameterServerSection):
        raise TaskConfigError("ps_placement", "the chief of a parameter_server job needs the "
                                            "layer placement section")
    out = {}
    for name, k in section.placement.items():
        if not 0 <= k < num_ps:
            raise TaskConfigError("ps_placement",
                            f"layer {name!r} -> {k!r}: not a PS index of the {num_ps} ps tasks")
        out[str(name)] = int(k)
    # fail before connecting when the placement does not match the model's layers (checked
    # again on the built model's variables)
    with_params = {l.name for l in profile.layers if l.params > 0}
    missing, extra = sorted(with_params - set(out)), sorted(set(out) - with_params)
    if missing or extra:
        raise TaskConfigError("ps_placement",
                        "does not match the model's layers with parameters"
                        + (f"; no PS for {', '.join(missing)}" if missing else "")
                        + (f"; unknown or parameter-free {', '.join(extra)}" if extra else ""))
    return out


def _task_of(tf, device: str) -> tuple[str | None, int | None]:
    d = tf.DeviceSpec.from_string(device or "")
    return d.job, d.task


def _check_placement(tf, model, placement: dict[str, int], slot_log: list,
                     num_ps: int) -> dict[int, int]:
    """Raises TaskConfigError unless every model variable lives on its layer's PS task and every
    optimizer slot on its variable's task. Returns the bytes of variables per PS task."""
    problems: list[str] = []
    per_ps = {k: 0 for k in range(num_ps)}
    var_task: dict[int, int] = {}
    layers_with_vars = set()
    for layer in model.layers:
        if not layer.weights:
            continue
        layers_with_vars.add(layer.name)
        if layer.name not in placement:
            problems.append(f"layer {layer.name!r} has variables but no placement")
            continue
        want = placement[layer.name]
        for w in layer.weights:
            job, task = _task_of(tf, w.value.device)
            if job != "ps" or task != want:
                problems.append(f"{w.path} is on {w.value.device}, planned ps:{want}")
            var_task[id(w.value)] = want
            per_ps[want] += int(w.value.shape.num_elements() or 0) * w.value.dtype.size
    extra = sorted(set(placement) - layers_with_vars)
    if extra:
        problems.append(f"placement names layers the model does not have (or that have no "
                        f"variables): {', '.join(extra)}")
    for var, ref in slot_log:
        job, task = _task_of(tf, var.device)
        n = int(var.shape.num_elements() or 0) * var.dtype.size
        if ref is None:
            if job != "ps":
                problems.append(f"optimizer variable {var.name} is on {var.device}")
            elif task is not None:
                per_ps[task] += n
            continue
        want = var_task.get(id(ref))
        if want is None:
            rjob, want = _task_of(tf, ref.device)
        if job != "ps" or task != want:
            problems.append(f"optimizer slot {var.name} is on {var.device}, its variable on "
                            f"ps:{want}")
        elif task is not None:
            per_ps[task] += n
    if problems:
        raise TaskConfigError("ps_placement", "the layer placement was not honoured: "
                        + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
    return per_ps


def _build_placed(tf, strategy, spec: JobSpec, mixed: str, placement: dict[str, int],
                  num_ps: int, blob_dir: str = "", user_model=None):
    from strata.modelspec import ModelSpecError
    from strata.worker import models as wmodels

    try:
        from keras.src.backend.common.name_scope import current_path
    except ImportError:  # pragma: no cover - a Keras that moved its name scopes
        raise TaskConfigError("strategy", "this Keras version does not expose the layer name scope "
                                    "that parameter_server placement needs") from None

    with strategy.scope():
        # a scalar anchor on each PS task (TensorFlow places them round-robin)
        anchors: dict[int, object] = {}
        for i in range(2 * num_ps):
            if len(anchors) == num_ps:
                break
            a = tf.Variable(0.0, trainable=False, name=f"strata_ps_anchor_{i}")
            job, task = _task_of(tf, a.device)
            if job == "ps" and task is not None:
                anchors.setdefault(task, a)
        if len(anchors) != num_ps:
            raise TaskConfigError("ps_placement", f"could not place an anchor variable "
                                                          f"on each of the {num_ps} ps tasks")

        def place(next_creator, **kwargs):
            if kwargs.get("colocate_with") is None:
                for part in reversed(current_path().split("/")):
                    if part in placement:
                        kwargs["colocate_with"] = anchors[placement[part]]
                        break
            return next_creator(**kwargs)

        try:
            if user_model is not None:
                # the job's own code builds the model: its variables go round-robin over the
                # PS tasks (TensorFlow's default; Strata cannot place layers it cannot see)
                model = user_model()
                last = model.layers[-1] if model.layers else None
                act = getattr(getattr(last, "activation", None), "__name__", "")
                from_logits = act != "softmax" and type(last).__name__ != "Softmax"
            else:
                with tf.variable_creator_scope(place):
                    model, from_logits = wmodels.build_model(spec.model, mixed,
                                                             blob_dir=blob_dir)
            optimizer, loss_fn, _kind, training_text = wmodels.training_setup(
                spec.training, model, mixed, from_logits, user_model is not None)
        except ModelSpecError as e:
            raise TaskConfigError(e.field, e.message) from None

        slot_log: list = []

        def record(next_creator, **kwargs):
            v = next_creator(**kwargs)
            slot_log.append((v, kwargs.get("colocate_with")))
            return v

        with tf.variable_creator_scope(record):
            optimizer.build(model.trainable_variables)
    if user_model is not None:
        per_ps = {k: 0 for k in range(num_ps)}
        # model weights are Keras variables (their TF variable is .value); the optimizer's,
        # logged by the creator scope, are TF variables already
        for vv in [w.value for w in model.weights] + [v for v, _ in slot_log]:
            job, task = _task_of(tf, vv.device)
            if job == "ps" and task in per_ps:
                per_ps[task] += int(vv.shape.num_elements() or 0) * vv.dtype.size
        return model, optimizer, loss_fn, per_ps, training_text
    per_ps = _check_placement(tf, model, placement, slot_log, num_ps)
    return model, optimizer, loss_fn, per_ps, training_text


# --------------------------------------------------------------------------------------------
# the chief


class PsChiefRunner(TrainingRunner):
    memory_label = "chief mem"

    def check(self) -> None:
        self.cluster = cluster = _ps_cluster()
        self.n_workers, self.num_ps = len(cluster["worker"]), len(cluster["ps"])
        if self.spec.workers != self.n_workers:
            log(f"warning: spec has {self.spec.workers} workers, TF_CONFIG {self.n_workers}; "
                "using TF_CONFIG's")
        self.placement = ({} if self.spec.code_model else
                          _placement_from_config(self.cfg, self.profile, self.num_ps))

    def _user_model_fn(self) -> Any:
        """For a ``code.model`` job, the model (built by ``load``) as ``_build_placed`` takes
        it; None otherwise."""
        if not self.spec.code_model:
            return None
        return self.user_model

    def join(self) -> dict[str, Any]:
        tf, cluster = self.tf, self.cluster
        self.watchdog = Watchdog(
            cluster, self.events,
            connect_s=float(os.environ.get("STRATA_PS_CONNECT_TIMEOUT_S",
                                           DEFAULT_CONNECT_TIMEOUT_S)),
            unreachable_s=float(os.environ.get("STRATA_PS_UNREACHABLE_TIMEOUT_S",
                                               DEFAULT_UNREACHABLE_TIMEOUT_S)))
        self.watchdog.start()  # phase connect: the strategy's constructor waits for every task
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        self.strategy = tf.distribute.ParameterServerStrategy(resolver)
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        self.watchdog.set_phase("build")
        return {"workers": self.n_workers, "parameter_servers": self.num_ps}

    def build(self) -> None:
        import keras

        tf, strategy, d, seed = self.tf, self.strategy, self.data, self.seed
        assert d is not None and isinstance(self.cfg.section, ParameterServerSection)
        keras.utils.set_random_seed(seed)
        model, optimizer, loss_fn, per_ps, self.training_text = _build_placed(
            tf, strategy, self.spec, self.mixed, self.placement, self.num_ps,
            self.cfg.agent.blob_dir, self._user_model_fn())
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self._log_placement(per_ps)
        dataset_fn = self._user_dataset_fn() if self.spec.code_dataset else self._dataset_fn()
        self.per_worker_iter = iter(self.coordinator.create_per_worker_dataset(dataset_fn))

        # steps applied and the sum of their losses, kept on a PS task: a step returns nothing,
        # because a result left on a worker cannot be fetched once that worker dies
        with strategy.scope():
            self.applied = applied = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                 name="strata_steps_applied")
            self.loss_sum = loss_sum = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                                   name="strata_loss_sum")

        # one step is one whole batch on one worker: the mean over that batch
        step_fn = gradient_step(tf, model, optimizer, loss_fn, self.mixed, tf.reduce_mean)

        @tf.function
        def train_step(it: Any) -> None:
            # (features, labels) or, from the job's code.dataset, with sample weights too
            losses = strategy.experimental_local_results(strategy.run(step_fn,
                                                                      args=tuple(next(it))))
            loss_sum.assign_add(tf.add_n([tf.cast(l, tf.float64) for l in losses]) / len(losses))
            applied.assign_add(1)

        @tf.function(reduce_retracing=True)
        def eval_batch(x: Any, y: Any, w: Any = None) -> Any:
            out = tf.cast(model(x, training=False), tf.float32)
            return eval_sums(tf, loss_fn, y, out, d.classify, w)

        self._train_step, self._eval_batch = train_step, eval_batch

    def _log_placement(self, per_ps: list) -> None:
        assert isinstance(self.cfg.section, ParameterServerSection)
        budgets = self.cfg.section.ps_budgets_bytes
        for k in range(self.num_ps):
            names = sorted(n for n, p in self.placement.items() if p == k)
            log(f"placement: ps:{k} holds {format_mib(per_ps[k])} of variables and slots "
                f"({', '.join(names) or 'no layers'})"
                + (f", budget {format_mib(int(budgets[k]))}" if k < len(budgets) else ""))

    def _dataset_fn(self) -> Callable[[], Any]:
        """Each worker's input pipeline over the training set in memory."""
        tf, gb, seed = self.tf, self.gb, self.seed
        assert self.data is not None
        x_train, y_train = self.data.x_train, self.data.y_train
        n_train = self.data.n_train if x_train is not None else 0

        def dataset_fn() -> Any:
            # Traced once on the chief, run on every worker. The shuffle seed comes from the
            # worker's clock when its pipeline is created, so each worker (and a restarted one)
            # draws its own order; a stateless shuffle because tf.data's shuffle takes no
            # tensor seed. The training set is embedded in the function as constants.
            xt, yt = tf.constant(x_train), tf.constant(y_train)
            wseed = tf.math.floormod(tf.cast(tf.timestamp() * 1e6, tf.int64) + seed, 2 ** 31 - 1)
            order = tf.data.Dataset.range(2 ** 62).map(
                lambda epoch: tf.random.experimental.stateless_shuffle(
                    tf.range(n_train, dtype=tf.int64), seed=tf.stack([wseed, epoch])))
            ds = order.unbatch().batch(gb, drop_remainder=True)
            ds = ds.map(lambda i: (tf.gather(xt, i), tf.gather(yt, i)))
            return ds.prefetch(1)
        return dataset_fn

    def _user_dataset_fn(self) -> Callable[[], Any]:
        """Each worker's input pipeline from the job's ``code.dataset`` (checked here once)."""
        from strata.worker.usercode import DatasetCall, load_callable, user_dataset

        tf, gb = self.tf, self.gb
        user_fn = load_callable(self.cfg, self.spec.code_dataset, "code.dataset")
        what = self.spec.code_dataset
        how = DatasetCall.of(user_fn, what)
        self._user_dataset = (user_fn, what, how)
        inputs = getattr(self.model, "inputs", None)
        rank = len(inputs[0].shape) if inputs and len(inputs) == 1 else None
        # each worker reads its own input and a step is one global batch: whichever way the
        # function is written, it gives one worker's whole batches here
        take = dict(how=how, global_batch=gb, model_rank=rank, batch=gb)

        # a step is one whole batch on one worker, so the context is one pipeline of one
        # replica: get_per_replica_batch_size(gb) = gb
        ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                         num_replicas_in_sync=1)
        # checked here first: inside dataset_fn, traced for the workers, TensorFlow would
        # wrap the error in its own StagingError and the field would be lost
        loss = self.loss_kind()
        user_dataset(tf, what, user_fn, ctx, "train", max_rows=gb, loss=loss, **take)

        def dataset_fn() -> Any:
            ds = user_dataset(tf, what, user_fn, ctx, "train", max_rows=gb, loss=loss,
                              **take)
            return ds.repeat().prefetch(1)
        return dataset_fn

    def _wait(self, rv: Any) -> None:
        tf, coordinator = self.tf, self.coordinator
        try:
            rv.fetch()  # no return value: only waits, and raises the step's error
        except Exception as first:  # noqa: BLE001 - surface the coordinator's first error
            err = first
            try:
                coordinator.join()
            except Exception as e:  # noqa: BLE001
                err = e
            # the coordinator re-runs the steps of a lost worker, but a lost PS task is fatal:
            # name it
            lost = [f"ps:{i} ({a})" for i, a in enumerate(self.cluster["ps"]) if a in str(err)]
            if isinstance(err, tf.errors.UnavailableError) and lost:
                raise RuntimeError(f"parameter server {', '.join(lost)} is unreachable; the "
                                   f"variables it held are lost ({type(err).__name__})") from err
            if err is first:
                raise
            raise err from first

    # -- checkpoints

    def checkpoint_objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "applied": self.applied,
                "loss_sum": self.loss_sum}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"strategy": self.spec.strategy, "workers": self.n_workers,
                "parameter_servers": self.num_ps}

    def checkpoint_device(self) -> str | None:
        return "/job:chief/replica:0/task:0/device:CPU:0"  # the step counter: on the chief

    def train(self, steps: int) -> None:
        """Asynchronous: steps are scheduled on whichever worker is free, at most ``4 x
        workers`` ahead; progress reads the steps applied and their summed loss on the PS.
        A resumed chief runs steps ``start_step + 1 .. steps``; at a checkpoint step no step
        is in flight (scheduling stops there) and the coordinator is joined before saving."""
        coordinator = self.coordinator
        start = self.start_step
        progress = Progress(self.events, self.memory, steps, self.gb, self.cfg.report_interval_s,
                            self.memory_label, start=start, scalars=self.scalars)
        window = max(4, 4 * self.n_workers)
        self.watchdog.set_phase("train")
        ckpt = self.checkpointer
        if start >= steps:
            self.watchdog.set_phase("eval")
            return
        # the counters as restored (zeros for a fresh start)
        last = {"step": start, "count": int(self.applied.numpy()),
                "sum": float(self.loss_sum.numpy()), "loss": float("nan")}

        def report(final: bool = False) -> None:
            count, total = int(self.applied.numpy()), float(self.loss_sum.numpy())
            if count > last["count"]:
                last["loss"] = (total - last["sum"]) / (count - last["count"])
            # a step re-run after its worker died mid-step can count twice: clamp
            step = steps if final else min(count, steps)
            if step <= last["step"]:
                return  # nothing new (steps in progress events strictly increase)
            progress.report(step, last["loss"])
            last.update(step=step, count=count, sum=total)

        next_ckpt = ckpt.next_due(start) if ckpt is not None and ckpt.every > 0 else steps + 1
        # a notice's step once read (the chief alone drives: it stops at the notice's step, or
        # at the first one not yet scheduled); nothing is scheduled past it
        stop_at = steps + 1
        inflight = [coordinator.schedule(self._train_step, args=(self.per_worker_iter,))]
        scheduled = waited = start + 1
        while True:
            self._wait(inflight.pop(0))
            if waited == start + 1:
                progress.first_step()
                report()
            elif time.time() - progress.last_report >= progress.interval and waited < steps:
                report()
            if waited == next_ckpt:
                assert ckpt is not None
                coordinator.join()  # nothing is in flight: scheduling stopped at this step
                ckpt.save(waited)
                next_ckpt = ckpt.next_due(waited)
            if ckpt is not None and stop_at > steps and self.notice.at():
                stop_at = max(self.notice.at(), scheduled)
            if waited == stop_at:
                coordinator.join()
                report()
                self.stop_on_notice(waited)
            if waited >= steps:
                break
            while scheduled < min(steps, next_ckpt, stop_at) and len(inflight) < window:
                inflight.append(coordinator.schedule(self._train_step,
                                                     args=(self.per_worker_iter,)))
                scheduled += 1
            waited += 1
        coordinator.join()
        report(final=True)
        if int(self.applied.numpy()) != steps:
            log(f"note: {int(self.applied.numpy())} steps were applied for {steps} scheduled (a "
                "step whose worker died after applying its gradients was run again)")
        self.watchdog.set_phase("eval")

    def eval_batch_size(self) -> int:
        return min(self.gb, EVAL_BATCH_MAX)

    def eval_batch(self, x: Any, y: Any) -> tuple[float, float]:
        # on the chief, reading the variables from the PS tasks
        tf = self.tf
        local = "GPU:0" if self.cfg.agent.device.startswith("GPU:") else "CPU:0"
        with tf.device(f"/job:chief/replica:0/task:0/device:{local}"):
            loss_sum, correct = self._eval_batch(tf.constant(x), tf.constant(y))
        return float(loss_sum), float(correct)

    def result_fields(self) -> dict[str, Any]:
        import numpy as np

        h = hashlib.sha256()
        weight_bytes = 0
        for w in self.model.weights:
            a = np.ascontiguousarray(np.asarray(w.numpy(), dtype=np.float32))
            weight_bytes += a.nbytes
            h.update(a.tobytes())
        model_path = None
        budget = self.cfg.memory_budget_bytes
        m = self.memory()
        if self.cfg.probe:
            pass  # a memory probe keeps figures, no model
        elif budget and budget - m["peak"] < 2 * weight_bytes + (4 << 20):
            log(f"not saving model.keras: {format_mib(2 * weight_bytes)} of weights copies would "
                f"not fit in the chief's budget {format_mib(budget)} (peak so far "
                f"{format_mib(m['peak'])})")
        else:
            out_dir = self.cfg.agent.output_dir or os.getcwd()
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.abspath(os.path.join(out_dir, "model.keras"))
            try:
                self.model.save(path)
                model_path = path
            except Exception as e:  # noqa: BLE001 - the trained result still stands
                log(f"warning: saving {path} failed: {type(e).__name__}: {e}")
        # the coordinator's threads and the remote resources' destructors would talk to tasks
        # that are being stopped: the skeleton leaves at once after the result
        self.watchdog.stop()
        return {"weights_sha256": h.hexdigest(), "model_path": model_path}


def run_chief(cfg: TaskConfig, events: Events) -> int:
    return PsChiefRunner(cfg, events).run()
