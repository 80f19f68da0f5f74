"""The ``multi_worker_mirrored`` runner: data parallel with ``MultiWorkerMirroredStrategy``.

A custom training loop (Keras 3 ``model.fit`` does not work under the strategy): each worker
reads its own shard of the training set, all workers run the same number of steps, gradients
are all-reduced every step (``tf.nn.compute_average_loss`` over the global batch), so every
worker ends with the same weights. Every worker evaluates the full test split locally; worker
0 saves ``model.keras``. The result carries a SHA-256 of the final weights, so anyone can check
that the replicas agree.

Checkpoints (``strata.worker.checkpoints``): every worker takes part in each save (TensorFlow's
rule for multi-worker strategies); worker 0 writes the job's checkpoint, the others a copy of
their own that they delete at once. Before building, worker 0's choice of checkpoint to resume
from reaches every worker in one all-reduce, so all resume at the same step; each worker's
input skips the batches the restored steps consumed.

Collective timeout: a worker whose training makes no progress (no step done, no checkpoint
saved) for ``STRATA_COLLECTIVE_TIMEOUT_S`` (``DEFAULT_COLLECTIVE_TIMEOUT_S``, 60 s) ends with exit
status 78, a collective timeout (``strata.worker.watchdog.StallWatch``, which says why not
TensorFlow's per-operation timeout: a thread per all-reduce), so a worker whose peer hangs ends
within a minute (the watch covers the training loop; the local evaluation after it runs no
collective). A peer that dies is usually
noticed much sooner: its SIGKILL resets the collective's connection (``UnavailableError:
Collective ops is aborted by: ... Connection reset by peer``, measured well under a second), and
TensorFlow's coordination service reports a peer that stopped heartbeating in about 10 s.

Signals: during the cluster rendezvous (the strategy's constructor) TensorFlow's coordination
service has its own SIGTERM handler and the GIL is held: only SIGKILL works there, so the agent
stops a task with SIGTERM and then SIGKILL after a grace period.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable

from strata.types import STREAMED_SOURCES
from strata.taskconfig import TaskConfig, TaskConfigError
from strata.worker.cluster import cluster_from_tf_config, wait_reachable
from strata.exitcodes import EXIT_KIND, TASK_EXIT_COLLECTIVE
from strata.worker.events import Events, log
from strata.worker.watchdog import StallWatch
from strata.worker.losses import eval_sums
from strata.worker.checkpoints import Found, checkpoint_path
from strata.worker.exchange import accumulating_step, install_all_reduce
from strata.worker.runner import Data, TrainingRunner, gradient_step, variable_bytes

#: seconds before an all-reduce that has not completed fails (STRATA_COLLECTIVE_TIMEOUT_S
#: overrides): a hung peer ends the job's other workers within a minute. Legitimate waits in a
#: collective are short: workers reach each step together, and a checkpoint is saved by every
#: worker at the same step.
DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
#: seconds a worker other than 0 waits for worker 0's server to listen before joining
LEAD_WAIT_S = 30.0


class MirroredRunner(TrainingRunner):
    def check(self) -> None:
        # without TF_CONFIG the strategy runs this process as the only worker
        self.index, self.n_workers = self.cfg.index, 1
        self.lead_address = ""
        if os.environ.get("TF_CONFIG"):
            cluster, role, index = cluster_from_tf_config()
            if index > 0 and cluster.get("worker"):
                self.lead_address = str(cluster["worker"][0])
            if (role, index) != (self.cfg.role, self.cfg.index):
                log(f"warning: TF_CONFIG names task {role}:{index}, the task config "
                    f"{self.cfg.task_name}; using TF_CONFIG's")
            self.index, self.n_workers = index, len(cluster.get("worker", [])) or 1
        if self.gb % self.n_workers:
            raise TaskConfigError("data.batch_size", f"global batch {self.gb} is not divisible "
                                                     f"by the {self.n_workers} workers")

    def join(self) -> dict[str, Any]:
        tf = self.tf
        self.stall_timeout_s = float(os.environ.get("STRATA_COLLECTIVE_TIMEOUT_S")
                                     or DEFAULT_COLLECTIVE_TIMEOUT_S)
        if self.lead_address:
            # worker 0 holds the cluster's coordination service: asked before it listens,
            # TensorFlow retries about a second later (a warm job's rendezvous took 0.9-1.0 s
            # instead of 0.1 s whenever worker 1 came first). Past the wait TensorFlow's own
            # retries and timeouts apply as before.
            wait_reachable(self.lead_address, LEAD_WAIT_S)
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy()
        self.n_replicas = self.strategy.num_replicas_in_sync
        if self.gb % self.n_replicas:
            raise TaskConfigError("data.batch_size", f"global batch {self.gb} is not divisible "
                                                     f"by the {self.n_replicas} replicas")
        self.per_replica = self.gb // self.n_replicas
        if self.per_replica % self.spec.gradients.accumulate:
            raise TaskConfigError("gradients.accumulate", f"a replica's {self.per_replica} "
                                                          "examples do not split into "
                                                          f"{self.spec.gradients.accumulate} "
                                                          "equal slices")
        return {"workers": self.n_workers, "replicas": self.n_replicas}

    def train(self, steps: int) -> None:
        """The training loop, watched for a stall when there are peers to wait for."""
        if self.n_workers <= 1:
            return super().train(steps)
        self._watch = StallWatch(self.stall_timeout_s, self._stalled).start()
        try:
            super().train(steps)
        finally:
            self._watch.stop()
            self._watch = None

    def after_step(self, step: int) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            watch.beat()  # the step is done; a checkpoint it saves counts on its own
        super().after_step(step)
        if watch is not None:
            watch.beat()

    def _stalled(self, idle: float) -> None:
        """No progress for the stall timeout: a peer has hung; this worker ends as a
        collective timeout (78), from the watching thread (the training thread is blocked)."""
        msg = (f"a collective or a peer task failed: no training step done in {idle:.0f} s "
               f"(STRATA_COLLECTIVE_TIMEOUT_S {self.stall_timeout_s:g}): a peer has hung")
        log(msg)
        self.events.emit("error", kind=EXIT_KIND[TASK_EXIT_COLLECTIVE], message=msg)
        os._exit(TASK_EXIT_COLLECTIVE)

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
                    self.loss_kind() in wdata.CLASSIFICATION_LOSSES, steps)

    def build(self) -> None:
        import keras

        tf, strategy, d = self.tf, self.strategy, self.data
        assert d is not None
        keras.utils.set_random_seed(self.seed)
        model, loss_fn, optimizer = self._build_model()
        dataset_fn, global_input, after_input = self._train_input(model)

        # the input pipeline (and its transient second copy of the shard while the iterator is
        # created) comes before the optimizer slots exist, which keeps this start-up peak low
        self.iterator = iter(strategy.experimental_distribute_dataset(global_input)
                             if global_input is not None
                             else strategy.distribute_datasets_from_function(dataset_fn))
        after_input()
        with strategy.scope():
            optimizer.build(model.trainable_variables)
        g = self.spec.gradients
        if g.compression != "none" or g.pack_bytes:
            install_all_reduce(tf, optimizer, g.compression, g.pack_bytes)
        step_fn = self._step_fn(model, optimizer, loss_fn)

        @tf.function
        def train_step(it: Any) -> Any:
            per_replica_loss = strategy.run(step_fn, args=next(it))
            return strategy.experimental_local_results(per_replica_loss)

        @tf.function(reduce_retracing=True)
        def eval_batch(x: Any, y: Any, w: Any = None) -> Any:
            out = tf.cast(model(x, training=False), tf.float32)
            return eval_sums(tf, loss_fn, y, out, d.classify, w)

        self._train_step, self._eval_batch = train_step, eval_batch
        self.local_replicas = len(strategy.extended.worker_devices)
        log(f"model {model.name}: {model.count_params():,} params, {self.per_replica} examples "
            "per replica" + (f" in {g.accumulate} slices" if g.accumulate > 1 else "")
            + (f", all-reduce in {g.compression}" if g.compression != "none" else ""))

    def _build_model(self) -> tuple[Any, Any, Any]:
        """The model, its loss and its optimizer, under the strategy's scope (also kept as
        ``self.model``, ``self.loss_fn``, ``self.optimizer``)."""
        from strata.worker import models as wmodels

        with self.strategy.scope():
            if self.spec.code_model:
                model = self.user_model()
                last = model.layers[-1] if model.layers else None
                act = getattr(getattr(last, "activation", None), "__name__", "")
                from_logits = act != "softmax" and type(last).__name__ != "Softmax"
            else:
                model, from_logits = wmodels.build_model(self.spec.model, self.mixed,
                                                         sync_batchnorm=self.n_replicas > 1,
                                                         blob_dir=self.cfg.agent.blob_dir)
            optimizer, loss_fn, _kind, self.training_text = wmodels.training_setup(
                self.spec.training, model, self.mixed, from_logits, bool(self.spec.code_model))
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        return model, loss_fn, optimizer

    def _train_input(self, model: Any) -> tuple[Callable[[Any], Any], Any, Callable[[], None]]:
        """The training input: a function of an input context making each worker's dataset,
        or the whole input for the strategy to shard (a ``code.dataset`` called without a
        context; None otherwise), and what to look at once the strategy made its input. A
        resumed task's input skips the batches the restored steps consumed."""
        if self.spec.code_dataset:
            return self._user_input(model)
        if self.spec.data.source in STREAMED_SOURCES:
            return self._streamed_input(model), None, lambda: None
        return self._array_input(), None, lambda: None

    def _user_input(self, model: Any) -> tuple[Callable[[Any], Any], Any, Callable[[], None]]:
        """``_train_input`` from the job's ``code.dataset``."""
        from strata.worker.usercode import DatasetCall, load_callable, reads_whole
        from strata.worker.usercode import user_dataset

        tf, gb, skip = self.tf, self.gb, self.start_step
        global_input = None  # the whole input, for the strategy to shard (``DatasetCall``)
        after_input: Callable[[], None] = lambda: None  # noqa: E731 - looks at the input made
        user_fn = load_callable(self.cfg, self.spec.code_dataset, "code.dataset")
        what = self.spec.code_dataset
        loss_kind = self.loss_kind()
        how = DatasetCall.of(user_fn, what)
        inputs = getattr(model, "inputs", None)
        rank = len(inputs[0].shape) if inputs and len(inputs) == 1 else None

        def dataset_fn(ctx: Any) -> Any:
            rows = ctx.get_per_replica_batch_size(gb)
            ds = user_dataset(tf, what, user_fn, ctx, "train", max_rows=rows,
                              loss=loss_kind, how=how, global_batch=gb, model_rank=rank,
                              batch=rows)
            built.append(ds)  # looked at once the strategy made its input (below)
            # the job runs training.steps steps, whatever its size
            return ds.repeat().skip(skip) if skip else ds.repeat()
        built: list[Any] = []
        self._user_dataset = (user_fn, what, how)
        if how.context and self.n_workers > 1:
            def unsharded() -> None:
                if built and reads_whole(tf, built[0]):
                    self.notes.append(
                        f"code.dataset {what} does not shard by input_context: every "
                        "worker reads the whole training data, so the workers train on "
                        "the same examples (shard by input_context.input_pipeline_id)")
            after_input = unsharded
        elif not how.context:
            ds = user_dataset(tf, what, user_fn, None, "train", max_rows=gb,
                              loss=loss_kind, how=how, global_batch=gb, model_rank=rank,
                              batch=gb)
            off = tf.data.experimental.AutoShardPolicy.OFF
            if self.n_workers > 1 and \
                    ds.options().experimental_distribute.auto_shard_policy == off:
                self.notes.append(
                    f"code.dataset {what} turns auto-sharding off: every worker reads the "
                    "whole training data and the workers train on the same examples")
            ds = ds.repeat()
            global_input = ds.skip(skip) if skip else ds
        return dataset_fn, global_input, after_input

    def _streamed_input(self, model: Any) -> Callable[[Any], Any]:
        """``_train_input``'s function for a streamed ``data.source``, each worker reading its
        own shard of the stream."""
        from strata.worker import data as wdata

        tf, gb, seed, skip = self.tf, self.gb, self.seed, self.start_step
        data_spec, loss, elastic = self.spec.data, self.loss_kind(), self.spec.elastic
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
            if elastic:
                return self._global_stream(ctx, wdata.stream(
                    data_spec, "train", input_names=names).map(prepare))
            ds = wdata.stream(data_spec, "train", shards=ctx.num_input_pipelines,
                              index=wid, input_names=names).map(prepare)
            ds = ds.shuffle(wdata.STREAM_SHUFFLE_EXAMPLES, seed=seed + wid).repeat() \
                .batch(ctx.get_per_replica_batch_size(gb), drop_remainder=True)
            return (ds.skip(skip) if skip else ds).prefetch(1)

        def test_fn(ctx: Any, split: str) -> Any:
            return wdata.stream(data_spec, "test", input_names=names).map(prepare) \
                .batch(max(1, self.per_replica))
        self._user_dataset = (test_fn, f"data.source {data_spec.source}", None)
        return dataset_fn

    def _array_input(self) -> Callable[[Any], Any]:
        """``_train_input``'s function for a training set in memory, each worker its shard."""
        from strata.worker import data as wdata

        assert self.data is not None
        gb, seed, skip = self.gb, self.seed, self.start_step
        x_train, y_train = self.data.x_train, self.data.y_train

        def dataset_fn(ctx: Any) -> Any:
            wid, nw = ctx.input_pipeline_id, ctx.num_input_pipelines
            if self.spec.elastic:
                return wdata.make_global_dataset(
                    x_train, y_train, gb, wid, nw, ctx.get_per_replica_batch_size(gb), seed,
                    skip=skip, trace=self._trace_path(wid))
            x, y = wdata.shard(x_train, y_train, wid, nw)
            return wdata.make_train_dataset(x, y, ctx.get_per_replica_batch_size(gb),
                                            seed + wid, skip=skip)
        return dataset_fn

    def _global_stream(self, ctx: Any, ds: Any) -> Any:
        """An elastic job's streamed input (``_streamed_input``): the whole stream in one
        order on every worker (the same seed), cut into global batches; each worker takes its
        share of each (``strata.worker.data.make_global_dataset``, which says why). Every
        worker reads the whole stream."""
        tf, gb, skip = self.tf, self.gb, self.start_step
        wid, nw = ctx.input_pipeline_id, ctx.num_input_pipelines
        share, rows = gb // nw, ctx.get_per_replica_batch_size(gb)
        from strata.worker import data as wdata

        ds = ds.shuffle(wdata.STREAM_SHUFFLE_EXAMPLES, seed=self.seed).repeat() \
            .batch(gb, drop_remainder=True)
        if skip:
            ds = ds.skip(skip)
        ds = ds.map(lambda *e: tf.nest.map_structure(
            lambda t: t[wid * share:(wid + 1) * share], e))
        if rows != share:
            ds = ds.unbatch().batch(rows, drop_remainder=True)
        return ds.prefetch(1)

    def _trace_path(self, pipeline: int) -> str:
        """Where an elastic job's input writes the examples of each batch it makes, when the
        agent's environment sets ``STRATA_TRACE_EXAMPLES`` (a directory): one file per
        restart and worker, so that a reader can tell attempts apart."""
        root = os.environ.get("STRATA_TRACE_EXAMPLES", "")
        if not root:
            return ""
        os.makedirs(root, exist_ok=True)
        return os.path.join(root, f"{self.cfg.job_id}-r{self.cfg.restart:04d}-"
                                  f"w{pipeline}.txt")

    def _step_fn(self, model: Any, optimizer: Any, loss_fn: Any) -> Callable[..., Any]:
        """One replica's step: loss reduced over the global batch, sliced with
        ``gradients.accumulate``."""
        tf, gb = self.tf, self.gb

        def reduce(per_example: Any) -> Any:
            return tf.nn.compute_average_loss(per_example, global_batch_size=gb)
        if self.spec.gradients.accumulate > 1:
            return accumulating_step(tf, model, optimizer, loss_fn, self.mixed, reduce,
                                     self.spec.gradients.accumulate)
        return gradient_step(tf, model, optimizer, loss_fn, self.mixed, reduce)

    # -- checkpoints

    def checkpoint_writer(self) -> bool:
        return self.index == 0

    def agree_resume(self, found: Found | None) -> Found | None:
        """Worker 0's choice, sent to every worker in one all-reduce (the others add zeros):
        every worker restores the same checkpoint even if the shared directory changed between
        their looks at it."""
        if self.n_workers <= 1:
            return found
        tf, strategy = self.tf, self.strategy
        mine = [found.generation + 1, found.step] if found is not None else [0, 0]

        @tf.function
        def pick() -> Any:
            ctx = tf.distribute.get_replica_context()
            v = tf.constant(mine, tf.int64)
            return tf.where(tf.equal(ctx.replica_id_in_sync_group, 0), v, tf.zeros_like(v))

        got = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(pick), axis=None)
        gen1, step = (int(x) for x in got.numpy())
        if gen1 == 0:
            if found is not None:
                log(f"worker 0 found no checkpoint; not resuming from {found.path}")
            return None
        assert self.checkpointer is not None
        agreed = Found(gen1 - 1, step, checkpoint_path(self.checkpointer.root, gen1 - 1, step))
        if found != agreed:
            log(f"resuming from worker 0's choice {agreed.path}"
                + (f" (this worker found {found.path})" if found is not None else ""))
        return agreed

    def checkpoint_objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"strategy": self.spec.strategy, "workers": self.n_workers,
                "replicas": self.n_replicas}

    def restore_checkpoint(self, found: Found) -> int:
        assert self.checkpointer is not None
        meta = self.checkpointer.read_meta(self.tf, found)
        if meta.get("replicas") not in (None, self.n_replicas):
            log(f"the checkpoint was written by {meta['replicas']} replicas, this job has "
                f"{self.n_replicas}: " + (
                    "the input goes on at the same example of its one order (elastic)"
                    if self.spec.elastic else
                    "each worker resumes its new shard at the step (the examples differ "
                    "from an uninterrupted run's)"))
        return self.checkpointer.restore(found)

    def train_step(self, step: int) -> Callable[[], float]:
        local = self._train_step(self.iterator)
        # this worker's replicas' share of the global mean, scaled back to a mean over the
        # examples this worker saw (reading it waits for the step to finish)
        return lambda: float(sum(float(t) for t in local)) * self.n_replicas / max(
            1, self.local_replicas)

    def largest_alloc_bytes(self) -> int:
        """A data-parallel step all-reduces every gradient as one concatenated pack
        (``gradients.pack_size`` bounds it): ResNet50's is 90 MiB, and a budget of 1.09 x its
        peak failed allocating it in one piece (``bench/peak_growth.py``)."""
        single = super().largest_alloc_bytes()
        if self.n_replicas < 2:
            return single  # one replica: nothing to all-reduce
        total = sum(variable_bytes(self.model))
        pack = self.spec.gradients.pack_bytes
        return max(single, min(total, pack) if pack else total)

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
        if self.index == 0 and not self.cfg.probe:  # a memory probe keeps figures, no model
            out_dir = self.cfg.agent.output_dir or os.getcwd()
            os.makedirs(out_dir, exist_ok=True)
            model_path = os.path.abspath(os.path.join(out_dir, "model.keras"))
            self.model.save(model_path)
        return {"weights_sha256": h.hexdigest(), "model_path": model_path}


def run(cfg: TaskConfig, events: Events) -> int:
    return MirroredRunner(cfg, events).run()
