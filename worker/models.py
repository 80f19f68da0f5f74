"""Building the job's Keras model, optimizer and loss inside a task process (TensorFlow side).

Call these under ``strategy.scope()``. Models come from ``spec["model"]``:

- builtin ``mlp``: ``Input(input_shape, name="input")`` -> ``Flatten("flatten")`` when the
  input has rank > 1 -> ``Dense(h, relu, name="hidden_i")`` for each hidden size ->
  ``Dense(classes, name="logits")`` (no activation; always float32). Same names as
  ``strata.modelspec`` reports. The hidden ReLU layers use He initialisation
  (``he_uniform``) so a deep MLP keeps its activation scale; ``worker.trainers.gpipe`` builds the
  same layers.
- ``keras_json``: checked by ``strata.modelspec.check_keras_json_safe`` (no Lambda, no custom
  objects) and then deserialized by Keras with ``safe_mode=True`` and no custom objects.
- ``keras_file``: the same, from the config.json the coordinator read out of the uploaded file;
  then the file's weights are loaded into it (``model.load_weights``: the user's trained
  weights are the starting point). The file itself is the agent's copy in ``blob_dir``.

Mixed precision: ``bfloat16`` -> Keras ``mixed_bfloat16`` policy, ``float16`` ->
``mixed_float16`` plus a ``LossScaleOptimizer``. Variables stay float32; the last layer is
forced to float32 so logits and the loss are float32.
"""

from __future__ import annotations

import json
import os
from typing import Any

from strata.jobspec import OptimizerSpec
from strata.modelspec import (
    ModelSpecError, check_keras_json_safe, final_activation, model_json, parse_keras_json,
)

OPTIMIZERS = ("adam", "sgd", "rmsprop", "adagrad", "adamw")
LOSSES = ("sparse_categorical_crossentropy", "categorical_crossentropy", "mean_squared_error")
POLICIES = {"none": "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


def _policy_json(name: str) -> dict:
    return {"module": "keras", "class_name": "DTypePolicy", "config": {"name": name},
            "registered_name": None}


def _rewrite_json(obj: dict, policy: str, sync_batchnorm: bool) -> dict:
    """Adapts a keras_json model to the task. ``policy``: rewrites every layer's serialized
    dtype policy (Keras 3 writes an explicit float32 policy per layer, which would override
    the global policy); the last layer keeps float32 so outputs and the loss stay float32;
    input layers keep their input dtype. ``sync_batchnorm``: BatchNormalization layers use
    global-batch statistics across the replicas (``synchronized=True``), so the moving
    statistics, and so the final weights, are identical on every worker."""
    obj = json.loads(json.dumps(obj))
    layers = obj.get("config", {}).get("layers", [])
    outputs = obj.get("config", {}).get("output_layers") or []
    if outputs and isinstance(outputs[0], list):
        outputs = outputs[0]
    out_name = outputs[0] if outputs else None
    for i, layer in enumerate(layers):
        cfg = layer.get("config")
        if layer.get("class_name") == "InputLayer" or not isinstance(cfg, dict):
            continue
        if policy != "float32":
            last = cfg.get("name") == out_name if out_name else i == len(layers) - 1
            cfg["dtype"] = _policy_json("float32" if last else policy)
        if sync_batchnorm and layer.get("class_name") == "BatchNormalization":
            cfg["synchronized"] = True
    return obj


def build_model(model_spec: dict, mixed_precision: str = "none", sync_batchnorm: bool = False,
                blob_dir: str = ""):
    """Returns ``(model, from_logits)``. Raises ``ModelSpecError`` for a model it must refuse.
    ``sync_batchnorm``: see ``_rewrite_json`` (pass True with more than one replica).
    ``blob_dir``: where the agent keeps a ``keras_file`` model's file."""
    import keras

    policy = POLICIES[mixed_precision]
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        if model_spec.get("builtin"):
            b = model_spec["builtin"]
            if b["kind"] != "mlp":
                raise ModelSpecError("model.builtin.kind", f"unknown builtin model {b.get('kind')!r}")
            shape = tuple(int(d) for d in b["input_shape"])
            inp = keras.Input(shape, name="input")
            x = inp
            if len(shape) > 1:
                x = keras.layers.Flatten(name="flatten")(x)
            for i, units in enumerate(b["hidden"]):
                # He initialisation: glorot shrinks a ReLU stack's signal ~0.7x per layer, so a
                # deep MLP starts on a plateau and where it ends depends on float summation
                # order (a 14-layer MLP: 0.81-0.96 test accuracy after 50 steps; He 0.97-0.98)
                x = keras.layers.Dense(int(units), activation="relu", name=f"hidden_{i}",
                                       kernel_initializer="he_uniform")(x)
            out = keras.layers.Dense(int(b["classes"]), name="logits", dtype="float32")(x)
            return keras.Model(inp, out, name="mlp"), True
        field = "model.keras_file" if model_spec.get("keras_file") else "model.keras_json"
        obj = parse_keras_json(model_json(model_spec))
        check_keras_json_safe(obj)
        if policy != "float32" or sync_batchnorm:
            obj = _rewrite_json(obj, policy, sync_batchnorm)
        try:
            model = keras.saving.deserialize_keras_object(obj, safe_mode=True)
        except Exception as e:  # Keras raises ValueError/TypeError for what it refuses
            raise ModelSpecError(field, f"Keras cannot build this model: "
                                        f"{type(e).__name__}: {e}") from None
        if not isinstance(model, keras.Model):
            raise ModelSpecError(field, "does not describe a keras.Model")
        if model_spec.get("keras_file"):
            load_file_weights(model, model_spec, blob_dir)
        from_logits = final_activation(model_spec) != "softmax"
        return model, from_logits
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


def keras_file_path(model_spec: dict, blob_dir: str) -> str:
    """The agent's copy of a ``keras_file`` model's file."""
    kf = model_spec["keras_file"]
    path = os.path.join(blob_dir or ".", kf["sha256"] + ".keras")
    if not os.path.isfile(path):
        raise ModelSpecError("model.keras_file", f"{kf.get('name')}: the agent has no copy of "
                                                 f"the uploaded file ({path})")
    return path


def load_file_weights(model, model_spec: dict, blob_dir: str) -> None:
    """Loads the weights of the uploaded ``.keras`` file into ``model`` (built from its config)."""
    path = keras_file_path(model_spec, blob_dir)
    try:
        model.load_weights(path)
    except Exception as e:  # noqa: BLE001 - h5 and shape errors, reported as the file's
        raise ModelSpecError("model.keras_file", f"cannot load the weights of "
                                                 f"{model_spec['keras_file'].get('name')}: "
                                                 f"{type(e).__name__}: {e}") from None


def _weight_paths(model_spec: dict) -> dict[str, str]:
    """Where a ``.keras`` file keeps each layer's weights: Keras names them not by the layer's
    name but by its class in snake case, numbered in the order of ``model.layers`` (a
    functional model's input layers count, a Sequential model's do not): ``layers/conv2d_1``."""
    from keras.src.utils import naming

    obj = parse_keras_json(model_json(model_spec))
    entries = [e for e in (obj.get("config") or {}).get("layers") or [] if isinstance(e, dict)]
    if obj.get("class_name") == "Sequential":
        entries = [e for e in entries if e.get("class_name") != "InputLayer"]
    used: dict[str, int] = {}
    out = {}
    for e in entries:
        name = naming.to_snake_case(str(e.get("class_name")))
        if name in used:
            used[name] += 1
            name = f"{name}_{used[name]}"
        else:
            used[name] = 0
        out[str((e.get("config") or {}).get("name") or e.get("name"))] = f"layers/{name}"
    return out


def load_layer_weights(layers: list, model_spec: dict, blob_dir: str) -> None:
    """Loads the uploaded ``.keras`` file's weights into some of its model's layers (a pipeline
    stage's, built one by one: the whole model never exists in one place). Uses Keras' own
    reader of the file's ``model.weights.h5`` (``layers/NAME/...``), layer by layer."""
    import zipfile

    from keras.src.saving import saving_lib

    path = keras_file_path(model_spec, blob_dir)
    name = model_spec["keras_file"].get("name")
    try:
        with zipfile.ZipFile(path) as archive:
            store = saving_lib.H5IOStore("model.weights.h5", archive=archive, mode="r")
            try:
                paths = _weight_paths(model_spec)
                for layer in layers:
                    errors: dict = {}
                    saving_lib._load_state(layer, weights_store=store, assets_store=None,
                                           inner_path=paths[layer.name],
                                           visited_saveables=set(), failed_saveables=set(),
                                           error_msgs=errors)
                    if errors:
                        raise ValueError("; ".join(str(e) for e in list(errors.values())[:3]))
            finally:
                store.close()
    except Exception as e:  # noqa: BLE001 - reported as the file's
        raise ModelSpecError("model.keras_file", f"cannot load the weights of {name}: "
                                                 f"{type(e).__name__}: {e}") from None


#: rows of a variable read from its stage task at a time when the chief writes the model
WRITE_CHUNK_ELEMS = 1 << 20


def write_keras_file(path: str, model_spec: dict, stage_layers: list, tf) -> None:
    """Writes a ``.keras`` file of a model whose layers live on other tasks (a pipeline's
    stages, as ``(device, layers)`` pairs): the model's config, and its weights written from
    each stage's variables a slice at a time, so the chief never holds a whole remote kernel.
    Keras' own walk over each layer's state (``_save_state``) decides what is saved and where;
    ``keras.saving.load_model`` reads the file like any other."""
    import datetime
    import zipfile

    import h5py
    import keras
    import numpy as np
    from keras.src.saving import saving_lib

    paths = _weight_paths(model_spec)

    class ChunkedStore(saving_lib.H5IOStore):
        """Keras' H5 store, writing each variable in row slices on its own device."""

        def __init__(self, h5, device):  # noqa: D401 - no file of its own to open
            self.h5_file, self.mode, self.archive = h5, "w", None
            self.device = device
            self._group = None

        def make(self, path, metadata=None):
            self._group = self.h5_file.require_group(path).require_group("vars")
            return self

        def __setitem__(self, key, value):
            v = value.value if hasattr(value, "value") else value
            shape = tuple(int(d) for d in v.shape)
            dtype = np.dtype(str(getattr(value, "dtype", v.dtype)).replace("bfloat16", "float32"))
            ds = self._group.create_dataset(str(key), shape=shape, dtype=dtype)
            if not shape:
                with tf.device(self.device):
                    ds[()] = np.asarray(tf.identity(v).numpy(), dtype=dtype)
                return
            row = max(1, int(np.prod(shape[1:])))
            step = max(1, WRITE_CHUNK_ELEMS // row)
            for a in range(0, shape[0], step):
                with tf.device(self.device):
                    ds[a:a + step] = np.asarray(v[a:a + step].numpy(), dtype=dtype)

        def close(self):
            pass

    tmp = path + ".part"
    h5_tmp = path + ".weights.h5"
    try:
        with h5py.File(h5_tmp, "w") as h5:
            for device, layers in stage_layers:
                store = ChunkedStore(h5, device)
                for layer in layers:
                    saving_lib._save_state(layer, weights_store=store, assets_store=None,
                                           inner_path=paths[layer.name],
                                           visited_saveables=set())
        with zipfile.ZipFile(tmp, "w") as z:
            z.writestr("metadata.json", json.dumps({
                "keras_version": keras.__version__,
                "date_saved": datetime.datetime.now().strftime("%Y-%m-%d@%H:%M:%S")}))
            z.writestr("config.json", json.dumps(parse_keras_json(model_json(model_spec))))
            z.write(h5_tmp, "model.weights.h5")
        os.replace(tmp, path)
    finally:
        for f in (tmp, h5_tmp):
            if os.path.exists(f):
                os.unlink(f)


def build_optimizer(opt: OptimizerSpec, mixed_precision: str = "none"):
    import keras

    name = opt.name.lower()
    lr = float(opt.learning_rate)
    classes: dict[str, Any] = {
        "adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD,
        "rmsprop": keras.optimizers.RMSprop, "adagrad": keras.optimizers.Adagrad,
        "adamw": keras.optimizers.AdamW,
    }
    if name not in classes:
        raise ModelSpecError("training.optimizer.name",
                             f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZERS)}")
    optimizer = classes[name](learning_rate=lr)
    if mixed_precision == "float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def build_loss(name: str, from_logits: bool):
    """A per-example loss (``reduction=None``); the caller averages over the global batch."""
    import keras

    if name == "sparse_categorical_crossentropy":
        return keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits, reduction=None)
    if name == "categorical_crossentropy":
        return keras.losses.CategoricalCrossentropy(from_logits=from_logits, reduction=None)
    if name == "mean_squared_error":
        return keras.losses.MeanSquaredError(reduction=None)
    raise ModelSpecError("training.loss", f"unknown loss {name!r}; use one of {', '.join(LOSSES)}")


def _number(v: Any) -> str:
    """A value of an optimizer's config as the user wrote it (0.001, not 0.0010000000474)."""
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, dict) and "class_name" in v:  # a learning-rate schedule
        cfg = {k: x for k, x in (v.get("config") or {}).items() if k != "name"}
        return f"{v['class_name']}(" + ", ".join(f"{k}={_number(x)}" for k, x in cfg.items()) \
            + ")"
    return repr(v)


def describe_optimizer(optimizer: Any) -> str:
    """``SGD(learning_rate=0.001, momentum=0.9, clipnorm=1.0)``: the class and every setting
    that differs from the class's own default, the learning rate (or its schedule) always."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:  # a LossScaleOptimizer: float16's loss scaling
        return f"{describe_optimizer(inner)} with dynamic loss scaling"
    cfg = optimizer.get_config()
    try:
        defaults = type(optimizer)().get_config()
    except Exception:  # noqa: BLE001 - a class that needs arguments: show what it has
        defaults = {}
    shown = [f"learning_rate={_number(cfg.get('learning_rate'))}"]
    for k, v in cfg.items():
        if k in ("name", "learning_rate") or (k in defaults and defaults[k] == v):
            continue
        if v is None and k not in defaults:
            continue
        shown.append(f"{k}={_number(v)}")
    return f"{type(optimizer).__name__}({', '.join(shown)})"


def describe_loss(loss: Any) -> str:
    if isinstance(loss, str):
        return loss
    cfg = getattr(loss, "get_config", lambda: {})() or {}
    extra = [f"{k}={v!r}" for k, v in cfg.items()
             if k not in ("name", "reduction", "dtype") and v not in (None, False, -1)]
    name = type(loss).__name__ if not callable(loss) or hasattr(loss, "get_config") \
        else getattr(loss, "__name__", type(loss).__name__)
    return f"{name}({', '.join(extra)})" if extra else name


def per_example_loss(loss: Any, field: str = "code.model") -> Any:
    """A compiled model's loss as a per-example loss (``reduction=None``: the step averages
    over the global batch, as ``tf.distribute`` needs). A loss given by name or as a function
    is per example already; a ``keras.losses.Loss`` is rebuilt from its config with no
    reduction. What cannot be (several outputs' losses, a Loss class that takes no reduction)
    is refused naming ``field``: trained otherwise, it would not be the user's loss."""
    import keras

    if isinstance(loss, (dict, list, tuple)):
        raise ModelSpecError(field, "the model is compiled with several losses (one per "
                                    "output); a job trains one output with one loss")
    if isinstance(loss, str):
        try:
            return keras.losses.get(loss)
        except ValueError as e:
            raise ModelSpecError(field, f"its compiled loss {loss!r}: {e}") from None
    if isinstance(loss, keras.losses.Loss):
        cfg = loss.get_config()
        try:
            return type(loss).from_config({**cfg, "reduction": None})
        except Exception as e:  # noqa: BLE001 - the user's Loss subclass
            raise ModelSpecError(field, f"its compiled loss {type(loss).__name__} cannot be "
                                        "made per example (from_config with reduction=None: "
                                        f"{type(e).__name__}: {e}); give training.loss, or "
                                        "compile with a loss that takes a reduction") from None
    if callable(loss):
        return loss
    raise ModelSpecError(field, f"its compiled loss is a {type(loss).__name__}, not a loss")


def training_setup(training: Any, model: Any, mixed_precision: str, from_logits: bool,
                   code_model: bool) -> tuple[Any, Any, str, str]:
    """The optimizer and per-example loss a job trains with, and the words that say what they
    are and where each came from: the job's ``training.optimizer`` / ``training.loss`` when
    it gives them, else what a ``code.model`` was compiled with, else the defaults
    (``strata.jobspec.DEFAULT_OPTIMIZER``, ``DEFAULT_LOSS``). Returns (optimizer, loss, the
    loss's name as ``strata.worker.data`` knows losses, the description)."""
    import keras

    compiled = code_model and bool(getattr(model, "compiled", False))
    if training.optimizer is not None:
        optimizer, opt_from = build_optimizer(training.optimizer, mixed_precision), \
            "training.optimizer"
    elif compiled and getattr(model, "optimizer", None) is not None:
        optimizer, opt_from = _fresh(model.optimizer), "code.model"
        if mixed_precision == "float16" and not isinstance(
                optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    else:
        optimizer, opt_from = build_optimizer(training.optimizer_used, mixed_precision), \
            "the defaults"
    if training.loss:
        loss_fn, name, loss_from = build_loss(training.loss, from_logits), training.loss, \
            "training.loss"
        shown = f"{training.loss} (from_logits={from_logits})"
    elif compiled and getattr(model, "loss", None) is not None:
        loss_fn, loss_from = per_example_loss(model.loss), "code.model"
        shown = describe_loss(model.loss)
        name = loss_kind(model.loss)
    else:
        name = training.loss_used
        loss_fn, loss_from = build_loss(name, from_logits), "the defaults"
        shown = f"{name} (from_logits={from_logits})"
    text = (f"optimizer {describe_optimizer(optimizer)} from {opt_from}; loss {shown} from "
            f"{loss_from}")
    return optimizer, loss_fn, name, text


def _fresh(optimizer: Any) -> Any:
    """The same optimizer (class and config: learning rate or schedule, clipping, momentum,
    ...) made anew here, under the caller's strategy scope, with no variables yet: the step
    builds its slots where the strategy places them."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", None)
    try:
        if inner is not None:
            return keras.optimizers.LossScaleOptimizer(_fresh(inner))
        return type(optimizer).from_config(optimizer.get_config())
    except ModelSpecError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's optimizer class
        raise ModelSpecError("code.model", f"its compiled optimizer {type(optimizer).__name__} "
                                           "cannot be made again from its config "
                                           f"({type(e).__name__}: {e}); give "
                                           "training.optimizer") from None


def loss_kind(loss: Any) -> str:
    """Which of ``LOSSES`` a compiled loss is (how targets are shaped and accuracy counted);
    the default's for any other."""
    from strata.jobspec import DEFAULT_LOSS

    name = loss if isinstance(loss, str) else (
        (getattr(loss, "get_config", lambda: {})() or {}).get("name")
        or getattr(loss, "__name__", ""))
    aliases = {"mse": "mean_squared_error", "mean_squared_error": "mean_squared_error"}
    name = aliases.get(str(name), str(name))
    return name if name in LOSSES else DEFAULT_LOSS


def compiled_metrics(model: Any, loss_name: str) -> list[Any]:
    """Fresh objects of the metrics a ``code.model`` was compiled with (``metrics=[...]``), to
    be updated on the test split in eager, outside any strategy. ``"accuracy"`` and
    ``"crossentropy"`` are resolved as Keras resolves them, by the loss. Metrics of several
    outputs (a dict or nested list) are not reported."""
    import keras

    if not getattr(model, "compiled", False):
        return []
    try:
        listed = model.get_compile_config().get("metrics") or []
    except Exception:  # noqa: BLE001 - a model whose compile config cannot be read
        return []
    if not isinstance(listed, list):
        return []
    sparse = loss_name == "sparse_categorical_crossentropy"
    categorical = loss_name == "categorical_crossentropy"
    out: list[Any] = []
    for item in listed:
        try:
            if isinstance(item, str):
                if item in ("accuracy", "acc"):
                    cls = (keras.metrics.SparseCategoricalAccuracy if sparse else
                           keras.metrics.CategoricalAccuracy if categorical else
                           keras.metrics.BinaryAccuracy)
                    out.append(cls(name=item))
                elif item in ("crossentropy", "ce"):
                    cls = (keras.metrics.SparseCategoricalCrossentropy if sparse else
                           keras.metrics.CategoricalCrossentropy if categorical else
                           keras.metrics.BinaryCrossentropy)
                    out.append(cls(name=item))
                else:
                    m = keras.metrics.get(item)
                    out.append(m if isinstance(m, keras.metrics.Metric)
                               else keras.metrics.MeanMetricWrapper(m, name=item))
            elif isinstance(item, dict):
                out.append(keras.metrics.deserialize(item))
        except (ValueError, TypeError):
            continue  # one Keras cannot rebuild here: left out, the rest reported
    return out
