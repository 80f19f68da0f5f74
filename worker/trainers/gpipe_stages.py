"""A pipeline stage's share of one replica, on the stage's own task (for
``strata.worker.trainers.gpipe``): each layer made from the job's model description and created,
built and called under ``tf.device(<the stage's task>)`` (``build_stages``), so its variables
and its optimizer (``build_optimizers``) live there; ``copy_replica_zero`` makes a hybrid job's
replicas start identical; ``run_layers`` runs a stage's layers statelessly on a micro-batch
from given layer state and 16-bit weight copies; ``with_weight_regularizers`` adds the
regularizers' gradients once a step. Config problems raise ``TaskConfigError``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from strata.modelspec import ModelSpecError
from strata.taskconfig import StageAssignment, TaskConfigError
from strata.worker.trainers.gpipe_layout import Layout


# --------------------------------------------------------------------------------------------
# layers


def layer_factories(model_spec: dict, mixed: str, names: list[str]) -> tuple[list, dict]:
    """One zero-argument factory per layer, in the profile's order (``names``), and how each
    layer is called (``strata.modelspec.layer_calls``: its inputs as ``TensorRef``)."""
    import keras

    from strata.modelspec import TensorRef, layer_calls, layer_entries
    from strata.worker.models import POLICIES, _policy_json

    policy = POLICIES[mixed]
    if model_spec.get("builtin"):
        b = model_spec["builtin"]
        shape = [int(d) for d in b["input_shape"]]
        out = []
        if len(shape) > 1:
            out.append(lambda: keras.layers.Flatten(name="flatten", dtype=policy))
        for i, units in enumerate(b["hidden"]):
            out.append(lambda i=i, u=int(units): keras.layers.Dense(
                u, activation="relu", name=f"hidden_{i}", kernel_initializer="he_uniform",
                dtype=policy))  # as worker.models builds the builtin MLP
        out.append(lambda: keras.layers.Dense(int(b["classes"]), name="logits", dtype="float32"))
        calls, prev = {}, "input"
        for n in names:
            calls[n] = ([TensorRef(prev)], {})
            prev = n
        return out, calls
    field = "model.keras_file" if model_spec.get("keras_file") else "model.keras_json"
    try:
        entries = layer_entries(model_spec)
        calls = layer_calls(model_spec)
    except ModelSpecError as e:
        raise TaskConfigError(e.field, e.message) from None
    out = []
    for i, name in enumerate(names):
        d = json.loads(json.dumps(entries[name]))
        if policy != "float32" and isinstance(d.get("config"), dict):
            # the output layer keeps float32 so outputs and the loss stay float32
            d["config"]["dtype"] = _policy_json("float32" if i == len(names) - 1 else policy)

        def make(d=d):
            try:
                layer = keras.saving.deserialize_keras_object(d, safe_mode=True)
            except Exception as e:  # Keras raises ValueError/TypeError for what it refuses
                raise TaskConfigError(field, f"Keras cannot build layer "
                                             f"{d.get('config', {}).get('name')!r}: "
                                             f"{type(e).__name__}: {e}") from None
            if not isinstance(layer, keras.layers.Layer):
                raise TaskConfigError(field, f"{d.get('class_name')} is not a layer")
            return layer
        out.append(make)
    return out, calls


def call_layer(layer, call: tuple, env: dict, training: bool):
    """Calls ``layer`` as the model's graph does, its input tensors taken from ``env`` (by
    ``TensorRef``); stores its output(s) in ``env`` and returns the first."""
    from strata.modelspec import TensorRef

    def sub(v):
        if isinstance(v, TensorRef):
            return env[str(v)]
        if isinstance(v, list):
            return [sub(x) for x in v]
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        return v

    args, kwargs = call
    a = sub(args)
    kw = {k: v for k, v in sub(kwargs).items() if k != "training"}
    out = layer(*a, training=training, **kw)
    if isinstance(out, (list, tuple)):
        for i, t in enumerate(out):
            env[layer.name if i == 0 else f"{layer.name}:{i}"] = t
        return out[0]
    env[layer.name] = out
    return out


class Stage:
    """One stage task's share of one replica: its layers, variables and optimizer."""

    def __init__(self, place: StageAssignment, device: str, layers: list, calls: list,
                 input_ref: str):
        self.place = place
        self.device = device
        self.layers = layers
        self.calls = calls            # per layer: how the graph calls it (``call_layer``)
        self.input_ref = input_ref    # the one tensor entering the stage

        self.tvars = [v for l in layers for v in l.trainable_variables]
        # per layer: its non-trainable variables (BN statistics, seed generator states)
        self.nt = [list(l.non_trainable_variables) for l in layers]
        # mixed precision: the variables Keras would cast to the layer's compute dtype on every
        # call (as Layer.__call__'s AutocastScope does), with that dtype
        self.casts = {}
        for l in layers:
            if l.autocast and l.compute_dtype != l.variable_dtype and "float" in l.compute_dtype:
                for v in l.trainable_variables:
                    if getattr(v, "_autocast", False) and is_float(v):
                        self.casts[id(v)] = l.compute_dtype
        self.optimizer = None


def is_float(v) -> bool:
    return "float" in str(v.dtype)


# --------------------------------------------------------------------------------------------
# building the stages


def build_stages(tf, layout: Layout, factories: list, calls: dict, input_name: str,
                 layer_names: list[str], input_shape: tuple, dev_of: Callable[[Any], str],
                 strategy: str) -> list[list[Stage]]:
    """Every replica's stages (``[replica][stage]``), each stage's layers made, built and
    called once on a zero batch on the stage's task (never the whole model in one place)."""
    stages: list[list[Stage]] = []
    for r in range(layout.replicas):
        row = []
        h = tf.zeros((1,) + tuple(input_shape), tf.float32)
        for s in range(layout.stages):
            pl = layout.at(r, s)
            in_ref = input_name if pl.first_layer == 0 else layer_names[pl.first_layer - 1]
            st, h = _build_stage(tf, pl, dev_of(pl), factories, calls, in_ref, h, strategy)
            row.append(st)
        stages.append(row)
    return stages


def _build_stage(tf, pl: StageAssignment, dev: str, factories: list, calls: dict, in_ref: str,
                 h, strategy: str) -> tuple[Stage, Any]:
    """The stage at ``pl`` on ``dev``, its layers built by calling them on ``h`` (the previous
    stage's output); returns the stage and its output."""
    with tf.device(dev):
        layers = [factories[i]() for i in range(pl.first_layer, pl.last_layer)]
        for layer in layers:
            if getattr(layer, "activity_regularizer", None) is not None:
                # its loss would be made inside the stage and dropped: refused
                # rather than trained without it (weight regularizers are applied)
                raise TaskConfigError("model", f"layer {layer.name!r} has an "
                                               "activity_regularizer, which "
                                               f"{strategy} stages do not "
                                               "apply; use multi_worker_mirrored "
                                               "or remove it")
        env = {in_ref: h}
        for layer, want in zip(layers, pl.layers):
            if layer.name != want:
                raise TaskConfigError("stage_layout.layout", f"layer {layer.name!r} is where the "
                                                   f"layout has {want!r}")
            # builds it here: its variables live on dev
            h = call_layer(layer, calls[want], env, False)
    return Stage(pl, dev, layers, [calls[n] for n in pl.layers], in_ref), h


def copy_replica_zero(tf, stages: list[list[Stage]]) -> None:
    """Replicas start identical: replica 0's values everywhere (seed states stay their own)."""
    for r in range(1, len(stages)):
        for s in range(len(stages[0])):
            src, dst = stages[0][s], stages[r][s]
            pairs = list(zip(src.tvars, dst.tvars)) + [
                (a, b) for la, lb in zip(src.nt, dst.nt) for a, b in zip(la, lb) if is_float(a)]
            with tf.device(dst.device):
                for a, b in pairs:
                    b.assign(a)


def build_optimizers(tf, stages: list[list[Stage]], make: Callable[[], Any]) -> None:
    """One optimizer (``make()``) per stage and replica, its slots built on the stage's task."""
    for row in stages:
        for st in row:
            with tf.device(st.device):
                st.optimizer = make()
                st.optimizer.build(st.tvars)


# --------------------------------------------------------------------------------------------
# running a stage in the step


def run_layers(st: Stage, h, nt_vals, casts: dict, training: bool):
    """The stage's layers on ``h``. Layers with state run statelessly from ``nt_vals``
    (one list per layer) and return their new state; the variables are not touched.
    ``casts`` maps id(variable) to its 16-bit copy for this step (mixed precision)."""
    import keras

    new = []
    env = {st.input_ref: h}
    for layer, call, vars_, vals in zip(st.layers, st.calls, st.nt, nt_vals):
        raw = [(v, casts[id(v)]) for v in layer.trainable_variables if id(v) in casts]
        if vars_ or raw:
            scope = keras.StatelessScope(list(zip(vars_, vals)))
            # StatelessScope casts mapped values back to the variable's dtype; the 16-bit
            # copy goes in as it is (Keras' autocast then leaves it alone)
            for v, val in raw:
                scope.state_mapping[id(v)] = val
            with scope:
                h = call_layer(layer, call, env, training)
            new.append([scope.get_current_value(v) for v in vars_])
        else:
            h = call_layer(layer, call, env, training)
            new.append([])
    return h, new


def with_weight_regularizers(tf, st: Stage, g: list) -> list:
    """``g`` (the step's mean gradients of ``st.tvars``) plus the gradients of the
    stage's weight regularizers (``kernel_regularizer`` and the like), once a step, as
    Keras's fit adds them to the mean loss."""
    regs = [(k, v) for k, v in enumerate(st.tvars)
            if getattr(v, "regularizer", None) is not None]
    if not regs:
        return g
    with tf.GradientTape() as rt:
        vals = [tf.convert_to_tensor(v.value) for _, v in regs]
        rt.watch(vals)
        terms = [v.regularizer(val) for (_, v), val in zip(regs, vals)]
    out = list(g)
    for (k, _), d in zip(regs, rt.gradient(terms, vals)):
        if d is not None:
            out[k] = out[k] + tf.cast(d, out[k].dtype)
    return out
