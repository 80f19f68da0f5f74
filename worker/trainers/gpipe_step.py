"""The GPipe driver's two ``tf.function``s (``strata.worker.trainers.gpipe``):
``make_train_step``, one training step over every replica's stages (inputs split on the chief,
each replica's micro-batches scheduled by ``gpipe_schedule``, gradients and layer state agreed
by ``gpipe_exchange``, the optimizers applied on every stage at once, the float16 loss scale
updated; returns the global mean loss), and ``make_eval_batch``, one test batch through replica
0's stages. ``LossScale``: the one dynamic loss scale of a float16 pipeline, on the chief.
"""

from __future__ import annotations

from typing import Any, Callable

from strata.worker.losses import eval_sums
from strata.worker.trainers.gpipe_exchange import ReplicaAverage, write_layer_state
from strata.worker.trainers.gpipe_schedule import ReplicaSchedule
from strata.worker.trainers.gpipe_stages import Stage, call_layer

LOSS_SCALE_INITIAL = 2.0 ** 15     # float16: Keras LossScaleOptimizer's defaults
LOSS_SCALE_GROWTH_STEPS = 2000


class LossScale:
    """float16's loss scale, ONE for the whole pipeline (a stage cannot unscale by a factor
    another stage did not use): variables on ``device`` (the chief), halved on overflow,
    doubled after ``LOSS_SCALE_GROWTH_STEPS`` finite steps."""

    def __init__(self, tf: Any, device: str):
        self.tf = tf
        with tf.device(device):
            self.scale = tf.Variable(LOSS_SCALE_INITIAL, dtype=tf.float32, trainable=False,
                                     name="loss_scale")
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps")

    def update(self, ok: Any) -> None:
        """After a step whose gradients were all finite (``ok``) or not; under the caller's
        device."""
        tf, loss_scale, good_steps = self.tf, self.scale, self.good_steps
        grow = tf.logical_and(ok, good_steps + 1 >= LOSS_SCALE_GROWTH_STEPS)
        new_scale = tf.where(ok, tf.where(grow, loss_scale * 2.0, loss_scale),
                             tf.maximum(loss_scale * 0.5, 1.0))
        loss_scale.assign(new_scale)
        good_steps.assign(tf.where(ok, tf.where(grow, tf.constant(0, tf.int64),
                                                good_steps + 1),
                                   tf.constant(0, tf.int64)))


class GPipeStep:
    """The body of the training step (``__call__``, traced once by ``make_train_step``).
    ``microbatches``: M per replica; ``per_replica``: a replica's rows (m x M);
    ``loss_scale``: None unless float16; ``wire``: the replicas' exchange dtype or None."""

    def __init__(self, tf: Any, stages: list[list[Stage]], microbatches: int, per_replica: int,
                 loss_fn: Any, recompute: bool, wire: Any, chief_dev: str,
                 loss_scale: LossScale | None):
        self.tf, self.stages, self.M, self.per_replica = tf, stages, microbatches, per_replica
        self.R, self.S = len(stages), len(stages[0])
        self.loss_fn, self.recompute, self.wire = loss_fn, recompute, wire
        self.chief_dev, self.loss_scale = chief_dev, loss_scale

    def mb_loss(self, out: Any, y: Any) -> Any:
        """A micro-batch's share of its replica's mean loss."""
        tf = self.tf
        per_example = self.loss_fn(y, tf.cast(out, tf.float32))
        return tf.reduce_sum(per_example) / float(self.per_replica)

    def __call__(self, x: Any, y: Any) -> Any:
        tf, R, M = self.tf, self.R, self.M
        scaled = self.loss_scale is not None
        with tf.device(self.chief_dev):
            xs = tf.split(x, R * M)
            ys = tf.split(y, R * M)
            scale = self.loss_scale.scale.read_value() if self.loss_scale is not None else None
        losses = []
        acc, nt_final = [], []
        for r in range(R):
            rows = slice(r * M, (r + 1) * M)
            schedule = ReplicaSchedule(tf, self.stages[r], self.recompute, self.mb_loss, scale)
            losses.extend(schedule.forward(xs[rows], ys[rows]))
            schedule.backward(ys[rows])
            acc.append(schedule.acc)
            nt_final.append(list(schedule.state))
        average = ReplicaAverage(tf, self.stages, self.wire, scale)
        means = average.run(acc)
        ok = None
        if scaled:
            with tf.device(self.chief_dev):
                ok = tf.reduce_all(tf.stack(average.finite))
        self._apply(means, ok)
        write_layer_state(tf, self.stages, nt_final)
        with tf.device(self.chief_dev):
            total = tf.add_n(losses) * (1.0 / R)
            if self.loss_scale is not None:
                self.loss_scale.update(ok)
        return total

    def _apply(self, means: list[list[Any]], ok: Any) -> None:
        """Every stage's optimizer step at once; float16: only when every gradient of every
        stage is finite (``ok``)."""
        tf = self.tf
        for r in range(self.R):
            for s in range(self.S):
                st = self.stages[r][s]
                with tf.device(st.device):
                    if ok is not None:
                        def apply(st=st, g=means[r][s]):
                            st.optimizer.apply_gradients(zip(g, st.tvars))
                            return tf.constant(True)
                        tf.cond(ok, apply, lambda: tf.constant(False))
                    else:
                        st.optimizer.apply_gradients(zip(means[r][s], st.tvars))


def make_train_step(tf: Any, step: GPipeStep) -> Callable[[Any, Any], Any]:
    @tf.function
    def train_step(x, y):
        return step(x, y)
    return train_step


def make_eval_batch(tf: Any, row: list[Stage], loss_fn: Any,
                    classify: bool) -> Callable[[Any, Any], Any]:
    """Test batches through replica ``row``'s pipeline, whole batches, no micro-batching:
    (loss sum, correct) as ``strata.worker.losses.eval_sums``."""
    last_dev = row[-1].device

    @tf.function(reduce_retracing=True)
    def eval_batch(x, y):
        # through replica 0's pipeline, whole batches, no micro-batching
        h = x
        for st in row:
            with tf.device(st.device):
                env = {st.input_ref: h}
                for layer, call in zip(st.layers, st.calls):
                    h = call_layer(layer, call, env, False)
        with tf.device(last_dev):
            out = tf.cast(h, tf.float32)
            return eval_sums(tf, loss_fn, y, out, classify)
    return eval_batch
