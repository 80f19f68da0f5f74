"""How data-parallel replicas exchange gradients: packs, 16-bit compression, accumulation.

The job's ``gradients`` section (``strata.jobspec.GradientSpec``) chooses; ``strata.worker.trainers.data_parallel``
uses both functions here.

- ``install_all_reduce``: Keras 3 all-reduces every gradient in the optimizer's own step
  (``_all_reduce_sum_gradients``, one ``ReplicaContext.all_reduce`` over the list). This
  replaces that method on the optimizer in use (the inner one of a LossScaleOptimizer) with the
  same sum taken with the job's ``CommunicationOptions(bytes_per_pack=...)`` and, with
  compression, over 16-bit copies of the float gradients, cast back after. TensorFlow packs the
  gradients in reverse order (last layer first: the order backward produces them), so each
  pack's all-reduce can start while earlier layers are still being differentiated. The
  collective delivers the same bytes to every replica, so compressed replicas stay
  bit-identical; the rounding (bfloat16: 8 bits of mantissa, float32's range; float16: 11 bits,
  overflow past 65,504) is the only change, its effect on accuracy measured in
  docs/benchmarks.md.
- ``accumulating_step``: a replica's batch in ``k`` slices, one after the other in a
  ``tf.while_loop``, their gradients summed into one float32 buffer per variable, then one
  ``apply_gradients``: one exchange per step instead of one per slice. Each slice's loss is
  reduced over the global batch, so the sum is the unsliced step's gradient (up to float
  rounding): the same training, with a slice's activations alive instead of the batch's.
  (A model that all-reduces in its forward pass, synchronized BatchNormalization, has its
  slices written out in sequence instead of looped; its batch statistics are then a slice's.)

The hook is a private Keras method; ``install_all_reduce`` fails the task (BAD_CONFIG, naming
``gradients``) rather than silently not compressing if a Keras release renames it, and
tests/test_exchange.py checks that it is still there.
"""

from __future__ import annotations

from typing import Any, Callable

from strata.taskconfig import TaskConfigError
from strata.worker.events import log
from strata.worker.losses import training_loss


#: the Keras 3 optimizer method that all-reduces gradients in a replica context
KERAS_ALL_REDUCE = "_all_reduce_sum_gradients"


def wire_dtype(tf: Any, compression: str) -> Any:
    return {"none": None, "bfloat16": tf.bfloat16, "float16": tf.float16}[compression]


def install_all_reduce(tf: Any, optimizer: Any, compression: str, pack_bytes: int) -> None:
    """Makes ``optimizer`` all-reduce its gradients with these options (see the module)."""
    target = getattr(optimizer, "inner_optimizer", optimizer)
    if not callable(getattr(target, KERAS_ALL_REDUCE, None)):
        raise TaskConfigError("gradients", f"this Keras release's optimizer has no "
                                           f"{KERAS_ALL_REDUCE}; Strata cannot set the "
                                           "all-reduce's packs or compression (unset gradients)")
    wire = wire_dtype(tf, compression)
    options = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=int(pack_bytes))

    def all_reduce(grads_and_vars: Any) -> list:
        pairs = list(grads_and_vars)
        ctx = tf.distribute.get_replica_context()
        if ctx is None:
            return pairs
        present = [i for i, (g, _) in enumerate(pairs) if g is not None]
        sent = [_to_wire(tf, pairs[i][0], wire) for i in present]
        # one collective call per wire dtype (a pack concatenates tensors of one dtype)
        by_dtype: dict[Any, list[int]] = {}
        for k, t in enumerate(sent):
            by_dtype.setdefault(t.dtype, []).append(k)
        got: list[Any] = [None] * len(sent)
        for ks in by_dtype.values():
            reduced = ctx.all_reduce(tf.distribute.ReduceOp.SUM, [sent[k] for k in ks],
                                     options=options)
            for k, r in zip(ks, reduced):
                got[k] = r
        out = list(pairs)
        for k, i in enumerate(present):
            g, v = pairs[i]
            r = got[k]
            if isinstance(r, tf.Tensor) and r.dtype != g.dtype:
                r = tf.cast(r, g.dtype)
            out[i] = (r, v)
        return out

    setattr(target, KERAS_ALL_REDUCE, all_reduce)


def _to_wire(tf: Any, g: Any, wire: Any) -> Any:
    """A dense float gradient as ``wire`` (16 bits); sparse ones (an Embedding's rows, gathered
    not summed) and narrower ones as they are."""
    if wire is None or isinstance(g, tf.IndexedSlices):
        return g
    g = tf.convert_to_tensor(g)
    if g.dtype.is_floating and g.dtype.size > wire.size:
        return tf.cast(g, wire)
    return g


def accumulating_step(tf: Any, model: Any, optimizer: Any, loss_fn: Any, mixed: str,
                      reduce: Callable[[Any], Any], k: int) -> Callable[[Any, Any], Any]:
    """One replica's step over its batch in ``k`` slices (see the module). ``reduce`` turns a
    slice's per-example losses into its share of the loss (a sum over the global batch), so
    the slices' losses add up to the step's. Returns the step's loss.

    A batch of ``n`` rows is cut at ``i * n // k``: slices differ by a row at most, so a batch
    that does not split evenly (the last of an epoch, a job's own dataset batched without
    ``drop_remainder``) runs too, and none is larger than the planned slice when the batch is
    no larger than planned.

    The slices run in a ``tf.while_loop`` unless the model synchronises replicas inside its
    forward pass (``BatchNormalization(synchronized=True)``, which Strata sets for built models
    of more than one replica, or a layer of the job's own that all-reduces): TensorFlow cannot
    cross replicas inside a loop body. Those models' slices are written out one after the
    other instead, each slice's rows waiting for the previous slice's gradients, so one slice's
    activations are alive at a time as in the loop; the graph is ``k`` times the size."""
    sliced = _SlicedStep(tf, model, optimizer, loss_fn, mixed, reduce, k)

    def step_fn(x: Any, y: Any, w: Any = None) -> Any:
        return sliced.step(x, y, w)

    return step_fn


class _SlicedStep:
    """``accumulating_step``'s parts: a slice's gradients (``one_slice``), the slices looped
    or written out, and the step that sums them and applies the sum once."""

    def __init__(self, tf: Any, model: Any, optimizer: Any, loss_fn: Any, mixed: str,
                 reduce: Callable[[Any], Any], k: int):
        self.tf, self.model, self.optimizer, self.loss_fn = tf, model, optimizer, loss_fn
        self.reduce, self.k = reduce, k
        self.variables = model.trainable_variables
        self.scaled = mixed == "float16"
        self.unused: list[bool] = []  # variables without a gradient, found while tracing a slice
        self.unrolled = _synchronises(model)
        if self.unrolled:
            self.written_out_note()

    def written_out_note(self) -> None:
        log(f"gradients.accumulate: the model all-reduces in its forward pass (a synchronized "
            f"BatchNormalization); its {self.k} slices are written out one after the other "
            "rather than looped")

    def one_slice(self, lo: Any, hi: Any, n: Any, scale: Any, share: Any, x: Any, y: Any,
                  w: Any, acc: list, after: list) -> tuple:
        """Slice ``[lo, hi)`` of a batch of ``n`` rows, once ``after`` has run; ``scale`` and
        ``share`` as ``training_loss`` takes them."""
        tf = self.tf
        with tf.control_dependencies(after):
            xi, yi, wi = tf.nest.map_structure(
                lambda t: None if t is None else tf.identity(t[lo:hi]), (x, y, w))
        rows = tf.cast(hi - lo, tf.float32) / tf.cast(tf.maximum(n, 1), tf.float32)
        with tf.GradientTape() as tape:
            loss = training_loss(tf, self.model, self.loss_fn, self.reduce, xi, yi, wi,
                                 rows=rows, scale=scale, share=share)
            loss_for_grad = self.optimizer.scale_loss(loss) if self.scaled else loss
        grads = tape.gradient(loss_for_grad, self.variables)
        self.unused[:] = [g is None for g in grads]
        summed = [a if g is None else a + tf.cast(tf.convert_to_tensor(g), a.dtype)
                  for a, g in zip(acc, grads)]
        return loss, summed

    def looped(self, x: Any, y: Any, w: Any, n: Any, acc0: list) -> tuple:
        tf = self.tf
        parts = tf.minimum(n, self.k)  # a batch of fewer than k rows: n slices of one

        def body(i: Any, total: Any, acc: list) -> tuple:
            loss, summed = self.one_slice(i * n // parts, (i + 1) * n // parts, n, 1.0,
                                          1.0 / tf.cast(parts, tf.float32), x, y, w, acc, [])
            return i + 1, total + loss, summed

        # one slice at a time: a while loop runs independent iterations side by side (10 by
        # default), which would hold that many slices' activations at once
        _, total, acc = tf.while_loop(
            lambda i, *_: i < parts, body, (tf.constant(0), tf.constant(0.0, tf.float32), acc0),
            parallel_iterations=1)
        return total, acc

    def written_out(self, x: Any, y: Any, w: Any, n: Any, acc0: list) -> tuple:
        tf, k = self.tf, self.k
        total, acc, after = tf.constant(0.0, tf.float32), acc0, []
        for i in range(k):
            lo, hi = i * n // k, (i + 1) * n // k
            # A batch of fewer than k rows leaves some slices empty, and batch statistics of
            # no rows are NaN for good in the moving averages: such a slice runs the whole
            # batch again with its loss times 0 (statistics updated, gradient unchanged).
            empty = hi <= lo
            lo, hi = tf.where(empty, 0, lo), tf.where(empty, n, hi)
            loss, acc = self.one_slice(lo, hi, n, tf.where(empty, 0.0, 1.0), 1.0 / k, x, y, w,
                                       acc, after)
            total = total + loss
            after = list(acc) + [total]
        return total, acc

    def step(self, x: Any, y: Any, w: Any = None) -> Any:
        tf = self.tf
        n = tf.shape(tf.nest.flatten(y)[0])[0]
        acc0 = [tf.zeros(v.shape, v.dtype) for v in self.variables]
        if not self.unrolled:
            try:
                total, acc = self.looped(x, y, w, n, acc0)
            except RuntimeError as e:
                # merge_call inside the loop body: a cross-replica step Strata did not see
                if "merge_call" not in str(e):
                    raise
                self.unrolled = True
                self.written_out_note()
        if self.unrolled:
            total, acc = self.written_out(x, y, w, n, acc0)
        grads = [None if none else a for a, none in zip(acc, self.unused)]
        self.optimizer.apply_gradients(zip(grads, self.variables))
        return total


def _synchronises(model: Any) -> bool:
    """Whether ``model`` has a layer that all-reduces across replicas in its forward pass."""
    layers = model._flatten_layers() if hasattr(model, "_flatten_layers") else model.layers
    return any(getattr(layer, "synchronized", False) for layer in layers)
