"""The ``multi_worker_mirrored`` runner: data parallel with ``MultiWorkerMirroredStrategy``.

A custom training loop (Keras 3 ``model.fit`` does not work under the strategy): each worker
reads its own shard of the training set, all workers run the same number of steps, gradients
are all-reduced every step (``tf.nn.compute_average_loss`` over the global batch), so every
worker ends with the same weights. Every worker evaluates the full test split locally; worker
0 saves ``model.keras``. The result carries a SHA-256 of the final weights, so anyone can check
that the replicas agree.

Signals: during the cluster rendezvous (the strategy's constructor) TensorFlow's coordination
service has its own SIGTERM handler and the GIL is held: only SIGKILL works there, so the agent
stops a task with SIGTERM and then SIGKILL after a grace period.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

from strata.spec import STREAMED_SOURCES
from strata.taskconfig import TaskConfig, TaskConfigError
from strata.worker.common import (
    Events, cluster_from_tf_config, eval_sums, log,
)
from strata.worker.runner import Data, TrainingRunner, gradient_step

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0   # STRATA_COLLECTIVE_TIMEOUT_S overrides


class MirroredRunner(TrainingRunner):
    def check(self) -> None:
        # without TF_CONFIG the strategy runs this process as the only worker
        self.index, self.n_workers = self.cfg.index, 1
        if os.environ.get("TF_CONFIG"):
            cluster, role, index = cluster_from_tf_config()
            if (role, index) != (self.cfg.role, self.cfg.index):
                log(f"warning: TF_CONFIG names task {role}:{index}, the task config "
                    f"{self.cfg.task_name}; using TF_CONFIG's")
            self.index, self.n_workers = index, len(cluster.get("worker", [])) or 1
        if self.gb % self.n_workers:
            raise TaskConfigError("data.batch_size", f"global batch {self.gb} is not divisible "
                                                     f"by the {self.n_workers} workers")

    def join(self) -> dict[str, Any]:
        tf = self.tf
        timeout = float(os.environ.get("STRATA_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S))
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        self.n_replicas = self.strategy.num_replicas_in_sync
        if self.gb % self.n_replicas:
            raise TaskConfigError("data.batch_size", f"global batch {self.gb} is not divisible "
                                                     f"by the {self.n_replicas} replicas")
        self.per_replica = self.gb // self.n_replicas
        return {"workers": self.n_workers, "replicas": self.n_replicas}

    def load(self) -> Data:
        from strata.worker import data as wdata

        if self.spec.code_dataset or self.spec.data.source not in STREAMED_SOURCES:
            return super().load()
        # read as a stream by each worker (``build``); epochs cost one counting pass
        steps = self.spec.training.steps
        if not steps:
            try:
                n = wdata.count_examples(self.spec.data)
            except wdata.DataError as e:
                raise TaskConfigError(e.field, e.message) from None
            steps = wdata.total_steps(self.spec.training, n, self.gb)
            log(f"{self.spec.data.source} training split: {n:,} examples, {steps} steps")
        return Data(None, None, None, None,
                    self.spec.training.loss in wdata.CLASSIFICATION_LOSSES, steps)

    def build(self) -> None:
        import keras

        from strata.worker import data as wdata
        from strata.worker import models as wmodels

        tf, strategy, d = self.tf, self.strategy, self.data
        assert d is not None
        keras.utils.set_random_seed(self.seed)
        with strategy.scope():
            if self.spec.code_model:
                model = self.user_model()
                last = model.layers[-1] if model.layers else None
                act = getattr(getattr(last, "activation", None), "__name__", "")
                from_logits = act != "softmax" and type(last).__name__ != "Softmax"
            else:
                model, from_logits = wmodels.build_model(self.spec.model, self.mixed,
                                                         sync_batchnorm=self.n_replicas > 1,
                                                         blob_dir=self.cfg.agent.blob_dir)
            optimizer = wmodels.build_optimizer(self.spec.training.optimizer, self.mixed)
            loss_fn = wmodels.build_loss(self.spec.training.loss, from_logits)
        self.model, self.loss_fn = model, loss_fn
        gb, seed, x_train, y_train = self.gb, self.seed, d.x_train, d.y_train

        if self.spec.code_dataset:
            from strata.worker.usercode import call, load_callable

            user_fn = load_callable(self.cfg, self.spec.code_dataset, "code.dataset")
            what = self.spec.code_dataset

            def dataset_fn(ctx: Any) -> Any:
                ds = call(what, user_fn, ctx, "train")
                if not isinstance(ds, tf.data.Dataset):
                    raise TaskConfigError("code.dataset", f"{what} returned "
                                                          f"{type(ds).__name__}, not a "
                                                          "tf.data.Dataset")
                return ds.repeat()  # the job runs training.steps steps, whatever its size
            self._user_dataset = (user_fn, what)
        elif self.spec.data.source in STREAMED_SOURCES:
            data_spec, loss = self.spec.data, self.spec.training.loss
            names = tuple(getattr(t, "name", "") for t in model.inputs)
            dtypes = [str(t.dtype) for t in model.inputs]
            out_shape = tuple(int(v) for v in model.outputs[0].shape[1:])

            def prepare(x: Any, y: Any) -> Any:
                if isinstance(x, dict):
                    x = {k: tf.cast(v, dtypes[0]) for k, v in x.items()}
                else:
                    x = tf.cast(x, dtypes[0])
                return x, wdata.tf_targets(y, loss, out_shape)

            def dataset_fn(ctx: Any) -> Any:
                wid = ctx.input_pipeline_id
                ds = wdata.stream(data_spec, "train", shards=ctx.num_input_pipelines,
                                  index=wid, input_names=names).map(prepare)
                return ds.shuffle(wdata.STREAM_SHUFFLE_EXAMPLES, seed=seed + wid).repeat() \
                    .batch(ctx.get_per_replica_batch_size(gb), drop_remainder=True).prefetch(1)

            def test_fn(ctx: Any, split: str) -> Any:
                return wdata.stream(data_spec, "test", input_names=names).map(prepare) \
                    .batch(max(1, self.per_replica))
            self._user_dataset = (test_fn, f"data.source {data_spec.source}")
        else:
            def dataset_fn(ctx: Any) -> Any:
                wid, nw = ctx.input_pipeline_id, ctx.num_input_pipelines
                x, y = wdata.shard(x_train, y_train, wid, nw)
                return wdata.make_train_dataset(x, y, ctx.get_per_replica_batch_size(gb),
                                                seed + wid)

        # the input pipeline (and its transient second copy of the shard while the iterator is
        # created) comes before the optimizer slots exist, which keeps this start-up peak low
        self.iterator = iter(strategy.distribute_datasets_from_function(dataset_fn))
        with strategy.scope():
            optimizer.build(model.trainable_variables)
        step_fn = gradient_step(
            tf, model, optimizer, loss_fn, self.mixed,
            lambda per_example: tf.nn.compute_average_loss(per_example, global_batch_size=gb))

        @tf.function
        def train_step(it: Any) -> Any:
            per_replica_loss = strategy.run(step_fn, args=next(it))
            return strategy.experimental_local_results(per_replica_loss)

        @tf.function(reduce_retracing=True)
        def eval_batch(x: Any, y: Any) -> Any:
            out = tf.cast(model(x, training=False), tf.float32)
            return eval_sums(tf, loss_fn, y, out, d.classify)

        self._train_step, self._eval_batch = train_step, eval_batch
        self.local_replicas = len(strategy.extended.worker_devices)
        log(f"model {model.name}: {model.count_params():,} params, {self.per_replica} examples "
            "per replica")

    def train_step(self, step: int) -> Callable[[], float]:
        local = self._train_step(self.iterator)
        # this worker's replicas' share of the global mean, scaled back to a mean over the
        # examples this worker saw (reading it waits for the step to finish)
        return lambda: float(sum(float(t) for t in local)) * self.n_replicas / max(
            1, self.local_replicas)

    def eval_batch_size(self) -> int:
        return max(1, self.per_replica)

    def eval_batch(self, x: Any, y: Any) -> tuple[float, float]:
        tf = self.tf
        loss_sum, correct = self._eval_batch(tf.constant(x), tf.constant(y))
        return float(loss_sum), float(correct)

    def result_fields(self) -> dict[str, Any]:
        import numpy as np

        h = hashlib.sha256()
        for w in self.model.weights:
            h.update(np.ascontiguousarray(np.asarray(w.numpy(), dtype=np.float32)).tobytes())
        model_path = None
        if self.index == 0:
            out_dir = self.cfg.agent.output_dir or os.getcwd()
            os.makedirs(out_dir, exist_ok=True)
            model_path = os.path.abspath(os.path.join(out_dir, "model.keras"))
            self.model.save(model_path)
        return {"weights_sha256": h.hexdigest(), "model_path": model_path}


def run(cfg: TaskConfig, events: Events) -> int:
    return MirroredRunner(cfg, events).run()
