"""The training loss as Keras's ``fit`` computes it (sample weights, the model's own extra
losses, the reduction) and the evaluation sums, shared by every trainer."""

from __future__ import annotations

from typing import Any



def weighted(tf: Any, per_example: Any, w: Any) -> Any:
    """Per-example losses times sample weights ``w`` (None: as they are), as Keras's ``fit``
    weighs them: the weights' shape is brought to the losses' rank (a trailing axis of 1
    dropped, or one added) and the product reduced as the unweighted losses would be, over the
    batch's size, not over the weights' sum."""
    if w is None:
        return per_example
    w = tf.cast(w, per_example.dtype)
    while w.shape.rank is not None and w.shape.rank > per_example.shape.rank \
            and w.shape[-1] == 1:
        w = tf.squeeze(w, -1)
    while w.shape.rank is not None and w.shape.rank < per_example.shape.rank:
        w = tf.expand_dims(w, -1)
    return per_example * w


def extra_losses(tf: Any, model: Any) -> tuple[Any, Any]:
    """The losses Keras's ``fit`` adds to the loss function's, from ``model``'s last call, as
    two float32 scalars (None when there are none): ``(own, weights)``.

    - ``own``: ``add_loss`` terms and activity regularizers, computed on that call's examples
      (Keras 3 divides an activity regularizer by the batch's size; ``add_loss`` terms are
      taken alike, as means over the examples, so a batch's is its slices' weighted by rows);
    - ``weights``: the weight regularizers (``kernel_regularizer`` and the like), which depend
      on the weights alone: once per step, whatever its slices.

    Keras 3 lists the weight regularizers last in ``model.losses``, one per trainable weight
    that has one; that is how the two are told apart."""
    losses = list(model.losses)
    n_weights = sum(1 for v in model.trainable_weights
                    if getattr(v, "regularizer", None) is not None)
    cut = max(0, len(losses) - n_weights)

    def total(terms: list) -> Any:
        return tf.add_n([tf.cast(t, tf.float32) for t in terms]) if terms else None
    return total(losses[:cut]), total(losses[cut:])


def training_loss(tf: Any, model: Any, loss_fn: Any, reduce: Any, x: Any, y: Any, w: Any = None,
                  *, rows: Any = 1.0, scale: Any = 1.0, share: Any = 1.0) -> Any:
    """``model`` on a batch in training mode, and the loss to differentiate as Keras's ``fit``
    counts it: ``reduce`` of the float32 per-example losses times the sample weights ``w``,
    plus the model's own losses (``extra_losses``) divided by the replicas.

    For one slice of a step's batch: its own losses weigh ``rows`` (its share of the batch's
    rows), both times ``scale`` (0 for a slice that only reruns the batch), plus ``share`` of
    the step's weight regularizers (the slices' shares add to one)."""
    out = model(x, training=True)
    per_example = loss_fn(y, tf.cast(out, tf.float32))
    if per_example.shape.rank == 0:
        # a loss that already reduced the batch: averaged again over the global batch, its
        # gradient would be off by the batch's size; refused rather than trained wrong
        from strata.taskconfig import TaskConfigError

        raise TaskConfigError("code.model", "its loss returns one number for a batch, not one "
                                            "per example: a distributed step averages over the "
                                            "global batch itself; return the per-example losses "
                                            "(or give training.loss)")
    loss = reduce(weighted(tf, per_example, w))
    own, weights = extra_losses(tf, model)
    if own is not None:
        loss = loss + tf.nn.scale_regularization_loss(own) * rows
    loss = loss * scale
    if weights is not None:
        loss = loss + tf.nn.scale_regularization_loss(weights) * share
    return loss


def eval_sums(tf, loss_fn, y, out, classify: bool, w=None):
    """(summed loss, number of correct predictions) of one evaluation batch, for float32
    outputs ``out``, each example counted ``w`` times when sample weights are given; the count
    is 0 for a model that does not classify."""
    per_example = weighted(tf, loss_fn(y, out), w)
    if classify:
        pred = tf.argmax(out, axis=-1)
        truth = tf.cast(y, tf.int64) if y.shape.rank == 1 else tf.argmax(y, axis=-1)
        hit = weighted(tf, tf.cast(tf.equal(pred, truth), tf.float32), w)
        correct = tf.reduce_sum(hit)
    else:
        correct = tf.constant(0.0)
    return tf.reduce_sum(per_example), correct
