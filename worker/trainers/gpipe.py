"""The driver of ``pipeline`` and ``hybrid`` jobs: GPipe model parallelism over TensorFlow's own
distributed runtime, run by the job's chief task (``PipelineDriver``, the strategies' runner for
role ``chief``, on ``strata.worker.runner``'s skeleton). Its parts, next to it: ``gpipe_layout``
(the stage layout, checked), ``gpipe_stages`` (each stage's layers on its task), ``gpipe_step``
(the step's ``tf.function``), ``gpipe_schedule`` (one replica's micro-batches),
``gpipe_exchange`` (the replicas' averaging).

Contract: the chief holds replica 0's stage 0 and never builds the whole model; each stage's
variables, optimizer and ops live on its own task, and only micro-batches, labels, boundary
activations and their gradients, scalars and (R > 1) stage gradients cross the wire. A step is
GPipe (all forwards, then all backwards) over the global batch's ``R x M`` micro-batches, and
leaves bit-identical weights on every replica. Config problems raise ``TaskConfigError``; an
out-of-memory op on any stage reaches the chief as ``ResourceExhaustedError`` (kind ``oom``).

Design (the step, hybrid averaging, recomputation, mixed precision, events): docs/pipeline.md.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time

from typing import Any, Callable

from strata.modelspec import ModelSpecError
from strata.taskconfig import TaskConfig, TaskConfigError
from strata.worker.cluster import reachable
from strata.worker.events import Events, format_mib, log
from strata.worker.exchange import wire_dtype
from strata.worker.runner import TrainingRunner
from strata.worker.trainers.gpipe_layout import Layout, parse_layout, read_cluster
from strata.worker.trainers.gpipe_stages import (Stage, build_optimizers, build_stages,
                                                 copy_replica_zero, layer_factories)
from strata.worker.trainers.gpipe_step import GPipeStep, LossScale, make_eval_batch, \
    make_train_step

CONNECT_TIMEOUT_S = 120.0          # STRATA_PIPELINE_CONNECT_TIMEOUT_S overrides
HASH_CHUNK_ELEMS = 1 << 18         # weights are read for hashing 1 MiB at a time (chief memory)


# --------------------------------------------------------------------------------------------
# connecting


def connect(tf, cluster: dict, layout: Layout, timeout_s: float) -> float:
    """Connects the eager context to the cluster. ``experimental_connect_to_cluster`` returns
    at once; the context then blocks (GIL released) until every task answers, for ever, so the
    wait runs in a thread with a deadline. Returns the seconds it took."""
    t0 = time.time()
    deadline = t0 + timeout_s
    stage_addrs = {pl.task_name: cluster[pl.role][pl.index] for pl in layout.places.values()
                   if pl.role != "chief"}
    # first the cheap check: every stage server accepts TCP connections
    missing = dict(stage_addrs)
    last_log = 0.0
    while missing:
        missing = {t: a for t, a in missing.items() if not reachable(a, timeout=1.0)}
        if not missing:
            break
        now = time.time()
        if now >= deadline:
            raise RuntimeError(f"stage servers not reachable after {timeout_s:.0f} s: "
                               + ", ".join(f"{t} at {a}" for t, a in sorted(missing.items())))
        if now - last_log > 10:
            log(f"waiting for stage servers: {', '.join(sorted(missing))}")
            last_log = now
        time.sleep(0.25)
    tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(cluster), job_name="chief")
    box: dict = {}

    def init() -> None:
        try:
            box["devices"] = tf.config.list_logical_devices()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            box["error"] = e

    th = threading.Thread(target=init, name="cluster-connect", daemon=True)
    th.start()
    th.join(max(1.0, deadline - time.time()))
    if th.is_alive():
        raise RuntimeError(f"could not connect to the cluster within {timeout_s:.0f} s (stage "
                           f"servers {', '.join(sorted(stage_addrs))} accept connections but "
                           "the TensorFlow runtime did not answer)")
    if "error" in box:
        raise box["error"]
    names = {d.name for d in box["devices"]}
    for pl in layout.places.values():
        want = f"/job:{pl.role}/replica:0/task:{pl.index}/"
        if not any(n.startswith(want) for n in names):
            raise RuntimeError(f"stage task {pl.task_name} has no device after connecting "
                               f"(devices: {sorted(names)})")
    return time.time() - t0


# --------------------------------------------------------------------------------------------
# the driver


class PipelineDriver(TrainingRunner):
    memory_label = "mem"

    def check(self) -> None:
        self.layer_names = [l.name for l in self.profile.layers]
        self.layout = parse_layout(self.cfg, self.layer_names, self.profile.cut_points)
        self.cluster = read_cluster(self.layout)

    def join(self) -> dict[str, Any]:
        tf, cfg, layout, cluster = self.tf, self.cfg, self.layout, self.cluster
        timeout = float(os.environ.get("STRATA_PIPELINE_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S))
        waited = connect(tf, cluster, layout, timeout)
        kind = "GPU" if cfg.agent.device.startswith("GPU") else "CPU"
        self.dev_of = lambda pl: f"/job:{pl.role}/replica:0/task:{pl.index}/device:{kind}:0"
        self.chief_dev = self.dev_of(layout.at(0, 0))
        return {"stages": layout.stages, "replicas": layout.replicas,
                "microbatches": layout.microbatches, "microbatch": layout.microbatch,
                "recompute": self.spec.memory.recompute, "connect_s": round(waited, 1)}

    def build(self) -> None:
        import keras

        from strata.worker import models as wmodels

        tf, spec, layout, d = self.tf, self.spec, self.layout, self.data
        assert d is not None
        keras.utils.set_random_seed(self.seed)
        stages = self._build_stages()
        from_logits = _from_logits(spec.model)
        loss_fn = wmodels.build_loss(spec.training.loss_used, from_logits)
        if spec.model.get("keras_file"):
            self._load_uploaded_weights(stages)
        copy_replica_zero(tf, stages)
        build_optimizers(tf, stages,
                         lambda: wmodels.build_optimizer(spec.training.optimizer_used, "none"))
        self.training_text = _training_text(spec, stages[0][0].optimizer, from_logits)

        loss_scale = LossScale(tf, self.chief_dev)
        # a resumed driver's batches start where the restored step left them
        self.batches = _batch_indices(d.n_train, self.gb, self.seed, skip=self.start_step)
        self.loss_scale, self.good_steps = loss_scale.scale, loss_scale.good_steps
        self.per_replica = layout.microbatch * layout.microbatches
        self._log_stages(stages)
        step = GPipeStep(tf, stages, layout.microbatches, self.per_replica, loss_fn,
                         spec.memory.recompute,
                         wire_dtype(tf, spec.gradients.compression),  # hybrid: the exchange's dtype
                         self.chief_dev, loss_scale if self.mixed == "float16" else None)
        self.stages = stages
        self._train_step = make_train_step(tf, step)
        self._eval_batch = make_eval_batch(tf, stages[0], loss_fn, d.classify)

    def _build_stages(self) -> list[list[Stage]]:
        """Every replica's stages, each stage's layers on its task (never the whole model in
        one place)."""
        spec, profile, layer_names = self.spec, self.profile, self.layer_names
        factories, calls = layer_factories(spec.model, self.mixed, layer_names)
        inputs = profile.model_inputs
        if len(inputs) != 1:
            raise TaskConfigError("model", f"the model has {len(inputs)} inputs; pipeline and "
                                           "hybrid jobs take one-input models")
        if len(factories) != len(layer_names):
            raise TaskConfigError("model", f"the model has {len(factories)} layers, its profile "
                                     f"{len(layer_names)}")
        return build_stages(self.tf, self.layout, factories, calls, inputs[0].name, layer_names,
                            tuple(profile.input_shape), self.dev_of, spec.strategy)

    def _load_uploaded_weights(self, stages: list[list[Stage]]) -> None:
        """The uploaded model's own weights, stage by stage, into replica 0 (copied to the
        others by ``copy_replica_zero``)."""
        from strata.worker import models as wmodels

        try:
            wmodels.load_layer_weights([l for st in stages[0] for l in st.layers],
                                       self.spec.model, self.cfg.agent.blob_dir)
        except ModelSpecError as e:
            raise TaskConfigError(e.field, e.message) from None

    def _log_stages(self, stages: list[list[Stage]]) -> None:
        import numpy as np

        layout = self.layout
        for s in range(layout.stages):
            pl = layout.at(0, s)
            n_params = sum(int(np.prod(v.shape)) for l in stages[0][s].layers for v in l.weights)
            log(f"stage {s}: layers {pl.first_layer}-{pl.last_layer - 1} ({pl.layers[0]} .. "
                f"{pl.layers[-1]}), "
                f"{n_params:,} params on "
                f"{', '.join(stages[r][s].place.task_name for r in range(layout.replicas))}"
                f"; estimate {format_mib(pl.estimated_memory_bytes)}, budget "
                f"{format_mib(pl.memory_budget_bytes)}")

    # -- checkpoints

    def _layer_objects(self, r: int, saved_replica: int) -> dict[str, Any]:
        """Replica ``r``'s layers under the names replica ``saved_replica``'s were saved as."""
        return {f"r{saved_replica}_{layer.name}": layer
                for st in self.stages[r] for layer in st.layers}

    def _optimizer_objects(self, r: int, saved_replica: int) -> dict[str, Any]:
        return {f"r{saved_replica}_s{s}_optimizer": st.optimizer
                for s, st in enumerate(self.stages[r])}

    def checkpoint_objects(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss_scale": self.loss_scale, "good_steps": self.good_steps}
        for r in range(len(self.stages)):
            out.update(self._layer_objects(r, r))
            out.update(self._optimizer_objects(r, r))
        return out

    def _split(self) -> list[list[int]]:
        return [[st.place.first_layer, st.place.last_layer] for st in self.stages[0]]

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"strategy": self.spec.strategy, "stages": self.layout.stages,
                "replicas": self.layout.replicas, "split": self._split()}

    def checkpoint_device(self) -> str | None:
        return "/job:chief/replica:0/task:0/device:CPU:0"  # the step counter: on the chief

    def restore_checkpoint(self, found: Any) -> int:
        c = self.checkpointer
        assert c is not None
        meta = c.read_meta(self.tf, found)
        same_split = meta.get("split") in (None, self._split())
        if same_split and meta.get("replicas") in (None, self.layout.replicas):
            return c.restore(found)
        views = []
        for r in range(len(self.stages)):
            view = {"loss_scale": self.loss_scale, "good_steps": self.good_steps}
            view.update(self._layer_objects(r, 0))
            if same_split:
                view.update(self._optimizer_objects(r, 0))
            views.append(view)
        log(f"the checkpoint was written by {meta.get('replicas')} replicas of stages "
            f"{meta.get('split')}; this job has {self.layout.replicas} of {self._split()}: "
            "replica 0's " + ("layers and optimizers go" if same_split else
                              "layers' weights go (the optimizers start afresh)")
            + " to every replica")
        return c.restore(found, views)

    def train_step(self, step: int) -> Callable[[], float]:
        tf = self.tf
        assert self.data is not None
        idx = next(self.batches)
        with tf.device(self.chief_dev):
            xb = tf.constant(self.data.x_train[idx])
            yb = tf.constant(self.data.y_train[idx])
        total = self._train_step(xb, yb)
        return lambda: float(total)

    def eval_batch_size(self) -> int:
        return max(1, self.per_replica)

    def eval_batch(self, x: Any, y: Any) -> tuple[float, float]:
        tf = self.tf
        with tf.device(self.chief_dev):
            xb, yb = tf.constant(x), tf.constant(y)
        loss_sum, correct = self._eval_batch(xb, yb)
        return float(loss_sum), float(correct)

    def result_fields(self) -> dict[str, Any]:
        import numpy as np

        digests = [_digest(self.tf, np, row) for row in self.stages]
        R = self.layout.replicas
        same = "identical" if len(set(digests)) == 1 else "DIFFERENT"
        from strata.worker import models as wmodels

        model_path = None
        if not self.cfg.probe:  # a memory probe keeps figures, no model
            out_dir = self.cfg.agent.output_dir or os.getcwd()
            os.makedirs(out_dir, exist_ok=True)
            model_path = os.path.abspath(os.path.join(out_dir, "model.keras"))
            # the whole model, assembled from replica 0's stages a slice at a time
            wmodels.write_keras_file(model_path, self.spec.model,
                                     [(st.device, st.layers) for st in self.stages[0]], self.tf)
        log(f"weights {digests[0][:12]}" + (f" ({R} replicas {same})" if R > 1 else "")
            + (f"; model assembled from the {self.layout.stages} stages: {model_path}"
               if model_path else ""))
        return {"weights_sha256": digests[0], "replica_weights_sha256": digests,
                "model_path": model_path}


def run_driver(cfg: TaskConfig, events: Events) -> int:
    return PipelineDriver(cfg, events).run()


def _batch_indices(n: int, batch: int, seed: int, skip: int = 0):
    """Endless global batches of row indices: every pass over the training set in a fresh
    random order, batches running on across passes (as ``worker.data.make_train_dataset``).
    ``skip``: batches left out first (a resumed driver; a function of ``seed`` alone, so the
    batches are those an uninterrupted run would draw next).
    The training set stays a NumPy array on the host; only each step's batch becomes a
    tensor, so the chief's allocator holds input batches, not the data set (a tf.data
    pipeline over the whole set as a constant holds it twice while its iterator is made)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pending = np.empty(0, dtype=np.int64)
    for _ in range(skip):  # permutations only: cheap
        while pending.size < batch:
            pending = np.concatenate([pending, rng.permutation(n)])
        pending = pending[batch:]
    while True:
        while pending.size < batch:
            pending = np.concatenate([pending, rng.permutation(n)])
        idx, pending = pending[:batch], pending[batch:]
        yield np.sort(idx)


def _training_text(spec: Any, optimizer: Any, from_logits: bool) -> str:
    """What trains the job, and where each part came from (the ``setup`` event)."""
    from strata.worker import models as wmodels

    given = spec.training
    return (f"optimizer {wmodels.describe_optimizer(optimizer)} (one per stage) "
            f"from {'training.optimizer' if given.optimizer else 'the defaults'}; loss "
            f"{given.loss_used} (from_logits={from_logits}) from "
            f"{'training.loss' if given.loss else 'the defaults'}")


def _from_logits(model_spec: dict) -> bool:
    from strata.modelspec import final_activation

    return final_activation(model_spec) != "softmax"


def _digest(tf, np, row: list[Stage]) -> str:
    """SHA-256 over the replica's weights in layer order as float32 bytes (as
    ``strata.worker.trainers.data_parallel`` hashes ``model.weights``). Remote weights come over in chunks so the chief never holds a
    whole remote kernel."""
    h = hashlib.sha256()
    for st in row:
        for layer in st.layers:
            for w in layer.weights:
                n = int(np.prod(w.shape)) if len(w.shape) else 1
                with tf.device(st.device):
                    flat = tf.reshape(w.value, [-1])
                    for a in range(0, n, HASH_CHUNK_ELEMS):
                        piece = flat[a:a + HASH_CHUNK_ELEMS]
                        h.update(np.ascontiguousarray(
                            np.asarray(piece.numpy(), dtype=np.float32)).tobytes())
    return h.hexdigest()
