"""Static profile of a job's model: shapes, parameter counts and FLOPs without building it.

Pure Python (no TensorFlow, Keras or NumPy): the coordinator uses it to validate a spec,
estimate memory and split models into stages, and it has no TensorFlow.

``profile_model(spec["model"])`` takes the normalized model section, one of

- ``{"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256], "classes": 10}}``
  (the layers ``worker.models`` builds: an optional ``flatten`` for rank > 1 inputs,
  ``hidden_0`` ... ``hidden_{n-1}`` Dense+relu, then ``logits`` Dense without activation);
- ``{"keras_json": "<text of keras.Model.to_json()>"}`` for a Keras 3 ``Sequential`` or a
  ``Functional`` model that is a linear chain of the supported built-in layers.

Safety: the JSON is only parsed, never deserialized here, but the same checks guard the task
process before Keras sees it (see ``check_keras_json_safe``): Lambda layers and any object
that is not Keras' own (a ``module`` outside ``keras``, or a ``registered_name`` naming a
custom registration) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ModelSpecError",
    "LayerProfile",
    "ModelProfile",
    "SUPPORTED_LAYERS",
    "profile_model",
    "check_keras_json_safe",
    "parse_keras_json",
    "final_activation",
]

SUPPORTED_LAYERS = (
    "InputLayer", "Dense", "Dropout", "Activation", "Flatten", "Reshape",
    "BatchNormalization", "LayerNormalization", "Conv2D", "MaxPooling2D",
    "AveragePooling2D", "GlobalAveragePooling2D",
)

_KJ = "model.keras_json"
_B = "model.builtin"


class ModelSpecError(Exception):
    """A model section that cannot be profiled or must be refused.

    ``field`` is the spec field at fault (``model.keras_json``, ``model.builtin.hidden``, ...),
    ``message`` says why; ``str(e)`` is ``"{field}: {message}"``.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class LayerProfile:
    """One layer. ``output_elems``, ``output_shape`` and ``flops`` are per example (no batch
    axis); ``flops`` counts a forward pass, a multiply-add as 2. ``params`` counts every weight
    (as ``keras.Model.count_params``); ``non_trainable_params`` is the part of it that gets no
    gradient or optimizer state (BatchNormalization moving statistics)."""

    name: str
    kind: str
    params: int
    output_elems: int
    flops: int
    non_trainable_params: int = 0
    output_shape: tuple[int, ...] = ()

    @property
    def trainable_params(self) -> int:
        return self.params - self.non_trainable_params


@dataclass(frozen=True)
class ModelProfile:
    """The model as a chain of layers. ``input_shape`` has no batch axis. The input layer
    itself is not in ``layers``."""

    input_shape: tuple[int, ...]
    layers: tuple[LayerProfile, ...]

    @property
    def total_params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def trainable_params(self) -> int:
        return sum(l.trainable_params for l in self.layers)

    @property
    def total_flops(self) -> int:
        return sum(l.flops for l in self.layers)

    @property
    def input_elems(self) -> int:
        return _prod(self.input_shape)

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.layers[-1].output_shape if self.layers else self.input_shape

    @property
    def activation_elems(self) -> int:
        """Sum of all layers' output elements per example."""
        return sum(l.output_elems for l in self.layers)


# --------------------------------------------------------------------------------------------
# entry point


def profile_model(model: dict) -> ModelProfile:
    """Profiles a normalized ``spec["model"]`` section (see the module docstring).

    Raises ``ModelSpecError`` for anything it cannot or must not run."""
    if not isinstance(model, dict):
        raise ModelSpecError("model", "must be a mapping with builtin or keras_json")
    present = [k for k in ("builtin", "keras_json") if model.get(k) not in (None, "", {})]
    if len(present) != 1:
        raise ModelSpecError("model", "exactly one of model.builtin or model.keras_json is required"
                             f" (got {', '.join(present) or 'neither'})")
    if present[0] == "builtin":
        return _profile_builtin(model["builtin"])
    return _profile_keras_json(model["keras_json"])


# --------------------------------------------------------------------------------------------
# builtin


def _pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _profile_builtin(b: Any) -> ModelProfile:
    if not isinstance(b, dict):
        raise ModelSpecError(_B, "must be a mapping like {kind: mlp, input_shape: [64], "
                                 "hidden: [1024, 512, 256], classes: 10}")
    kind = b.get("kind", "mlp")
    if kind != "mlp":
        raise ModelSpecError(f"{_B}.kind", f"unknown builtin model {kind!r}; supported: mlp")
    shape = b.get("input_shape")
    if (not isinstance(shape, (list, tuple)) or not shape
            or not all(_pos_int(d) for d in shape)):
        raise ModelSpecError(f"{_B}.input_shape",
                             f"must be a non-empty list of positive integers, got {shape!r}")
    hidden = b.get("hidden", [])
    if not isinstance(hidden, (list, tuple)) or not all(_pos_int(h) for h in hidden):
        raise ModelSpecError(f"{_B}.hidden", f"must be a list of positive integers, got {hidden!r}")
    classes = b.get("classes")
    if not _pos_int(classes):
        raise ModelSpecError(f"{_B}.classes", f"must be a positive integer, got {classes!r}")
    shape = tuple(int(d) for d in shape)
    layers: list[LayerProfile] = []
    cur = shape
    if len(shape) > 1:
        cur = (_prod(shape),)
        layers.append(LayerProfile("flatten", "Flatten", 0, cur[0], 0, 0, cur))
    for i, units in enumerate(list(hidden) + [classes]):
        last = i == len(hidden)
        cfg = {"units": units, "use_bias": True, "activation": "linear" if last else "relu"}
        name = "logits" if last else f"hidden_{i}"
        lp, cur = _dense(name, cfg, cur)
        layers.append(lp)
    return ModelProfile(shape, tuple(layers))


# --------------------------------------------------------------------------------------------
# keras_json: parsing and safety


def parse_keras_json(text: Any) -> dict:
    """``json.loads`` with the errors turned into ``ModelSpecError``."""
    if isinstance(text, dict):
        obj = text
    else:
        if not isinstance(text, str):
            raise ModelSpecError(_KJ, f"must be the JSON text of keras.Model.to_json(), "
                                      f"got {type(text).__name__}")
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ModelSpecError(_KJ, f"is not valid JSON: {e}") from None
    if not isinstance(obj, dict) or "class_name" not in obj or "config" not in obj:
        raise ModelSpecError(_KJ, "is not a serialized Keras model (expected an object with "
                                  "class_name and config, as keras.Model.to_json() writes)")
    return obj


def _is_keras_module(module: Any) -> bool:
    return isinstance(module, str) and (module == "keras" or module.startswith("keras."))


def check_keras_json_safe(obj: Any) -> None:
    """Refuses Lambda layers and every serialized object that is not Keras' own.

    Walks the whole JSON tree. A serialized object is a mapping with ``class_name`` and
    ``registered_name``; it must come from a ``keras`` module and its ``registered_name``
    must be null or its own class name (``register_keras_serializable`` writes
    ``"package>Name"``, unregistered subclasses have ``module: null``)."""

    def layer_name(node: dict) -> str:
        cfg = node.get("config")
        if isinstance(cfg, dict) and isinstance(cfg.get("name"), str):
            return cfg["name"]
        return str(node.get("name") or node.get("class_name"))

    def walk(node: Any, depth: int) -> None:
        if depth > 200:
            raise ModelSpecError(_KJ, "is nested too deeply")
        if isinstance(node, list):
            for v in node:
                walk(v, depth + 1)
            return
        if not isinstance(node, dict):
            return
        cls = node.get("class_name")
        if cls == "Lambda" or cls == "__lambda__":
            raise ModelSpecError(_KJ, f"layer {layer_name(node)!r} is a Lambda layer; Lambda and "
                                      f"custom code are refused (safe mode)")
        if isinstance(cls, str) and "registered_name" in node:
            module, reg = node.get("module"), node.get("registered_name")
            if not _is_keras_module(module) or (reg is not None and reg != cls) or ">" in cls:
                raise ModelSpecError(
                    _KJ, f"object {layer_name(node)!r} (class {cls}, module {module!r}, "
                         f"registered_name {reg!r}) is not a built-in Keras object; custom "
                         f"objects and custom code are refused (safe mode)")
        for v in node.values():
            walk(v, depth + 1)

    walk(obj, 0)


# --------------------------------------------------------------------------------------------
# keras_json: structure


def _profile_keras_json(text: Any) -> ModelProfile:
    obj = parse_keras_json(text)
    check_keras_json_safe(obj)
    cls = obj.get("class_name")
    cfg = obj.get("config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("layers"), list):
        raise ModelSpecError(_KJ, f"{cls} config has no layers list")
    if cls == "Sequential":
        layers = [l for l in cfg["layers"] if isinstance(l, dict)]
        input_shape = _sequential_input_shape(obj, layers)
    elif cls in ("Functional", "Model"):
        layers, input_shape = _functional_chain(cfg)
    else:
        raise ModelSpecError(_KJ, f"top-level class {cls!r} is not supported; use a Sequential "
                                  f"or Functional model")
    if input_shape is None:
        raise ModelSpecError(_KJ, "the model has no input shape; build it with keras.Input(shape) "
                                  "(or call model.build) before to_json()")
    shape = _check_shape(input_shape)
    out: list[LayerProfile] = []
    cur = shape
    for layer in layers:
        kind = layer.get("class_name")
        if kind == "InputLayer":
            continue
        lcfg = layer.get("config") if isinstance(layer.get("config"), dict) else {}
        name = str(lcfg.get("name") or layer.get("name") or kind)
        fn = _LAYER_FNS.get(kind)
        if fn is None:
            raise ModelSpecError(_KJ, f"layer {name!r} has unsupported class {kind!r}; supported "
                                      f"layers: {', '.join(SUPPORTED_LAYERS)}")
        lp, cur = fn(name, lcfg, cur)
        out.append(lp)
    if not out:
        raise ModelSpecError(_KJ, "the model has no layers besides its input")
    return ModelProfile(shape, tuple(out))


def _check_shape(batch_shape: Any) -> tuple[int, ...]:
    if not isinstance(batch_shape, (list, tuple)) or len(batch_shape) < 2:
        raise ModelSpecError(_KJ, f"input shape {batch_shape!r} must have a batch axis and at "
                                  "least one more dimension")
    dims = batch_shape[1:]
    if not all(_pos_int(d) for d in dims):
        raise ModelSpecError(_KJ, f"input shape {list(dims)!r} must have known positive "
                                  "dimensions (apart from the batch axis)")
    return tuple(int(d) for d in dims)


def _sequential_input_shape(obj: dict, layers: list[dict]) -> Any:
    if layers and layers[0].get("class_name") == "InputLayer":
        c = layers[0].get("config") or {}
        shape = c.get("batch_shape") or c.get("batch_input_shape")
        if shape is None and c.get("shape") is not None:
            shape = [None] + list(c["shape"])
        if shape is not None:
            return shape
    cfg = obj.get("config") or {}
    if cfg.get("build_input_shape"):
        return cfg["build_input_shape"]
    bc = obj.get("build_config") or {}
    if bc.get("input_shape"):
        return bc["input_shape"]
    if layers:
        c = layers[0].get("config") or {}
        if c.get("batch_input_shape"):
            return c["batch_input_shape"]
        bc = layers[0].get("build_config") or {}
        if bc.get("input_shape"):
            return bc["input_shape"]
    return None


def _history_refs(node: Any) -> list[str]:
    """Names of the layers whose outputs feed an inbound node (``keras_history`` entries)."""
    refs: list[str] = []

    def walk(n: Any) -> None:
        if isinstance(n, list):
            for v in n:
                walk(v)
        elif isinstance(n, dict):
            if n.get("class_name") == "__keras_tensor__":
                hist = (n.get("config") or {}).get("keras_history")
                if isinstance(hist, list) and hist:
                    refs.append(str(hist[0]))
                return
            for v in n.values():
                walk(v)

    walk(node)
    return refs


def _functional_chain(cfg: dict) -> tuple[list[dict], Any]:
    """Orders a Functional model's layers as a chain; refuses anything else."""
    layers = [l for l in cfg["layers"] if isinstance(l, dict)]
    by_name: dict[str, dict] = {}
    for l in layers:
        name = l.get("name") or (l.get("config") or {}).get("name")
        by_name[str(name)] = l
    inputs = [l for l in layers if l.get("class_name") == "InputLayer"]
    if len(inputs) != 1:
        raise ModelSpecError(_KJ, f"the model has {len(inputs)} inputs; only single-input linear "
                                  "models are supported")
    consumers: dict[str, list[str]] = {n: [] for n in by_name}
    for name, l in by_name.items():
        nodes = l.get("inbound_nodes") or []
        if l.get("class_name") == "InputLayer":
            continue
        if len(nodes) != 1:
            raise ModelSpecError(_KJ, f"layer {name!r} is called {len(nodes)} times; only linear "
                                      "chains (each layer used once) are supported")
        refs = _history_refs(nodes[0])
        if len(refs) != 1:
            raise ModelSpecError(_KJ, f"layer {name!r} takes {len(refs)} inputs; branching models "
                                      "are not supported, only linear chains")
        if refs[0] not in by_name:
            raise ModelSpecError(_KJ, f"layer {name!r} takes its input from unknown layer "
                                      f"{refs[0]!r}")
        consumers[refs[0]].append(name)
    outputs = cfg.get("output_layers") or []
    if outputs and isinstance(outputs[0], list):
        if len(outputs) != 1:
            raise ModelSpecError(_KJ, f"the model has {len(outputs)} outputs; only single-output "
                                      "linear models are supported")
        outputs = outputs[0]
    chain = [inputs[0]]
    name = str(inputs[0].get("name") or (inputs[0].get("config") or {}).get("name"))
    seen = {name}
    while consumers.get(name):
        nxt = consumers[name]
        if len(nxt) != 1:
            raise ModelSpecError(_KJ, f"the output of layer {name!r} feeds {len(nxt)} layers "
                                      f"({', '.join(nxt)}); branching models are not supported, "
                                      "only linear chains")
        name = nxt[0]
        if name in seen:
            raise ModelSpecError(_KJ, f"layer {name!r} appears twice in the chain")
        seen.add(name)
        chain.append(by_name[name])
    if len(chain) != len(by_name):
        unused = sorted(set(by_name) - seen)
        raise ModelSpecError(_KJ, f"layers {unused} are not on the input-to-output chain; only "
                                  "linear chains are supported")
    if outputs and str(outputs[0]) != name:
        raise ModelSpecError(_KJ, f"the model's output is layer {outputs[0]!r}, not the end of the "
                                  f"chain {name!r}; only linear chains are supported")
    c = inputs[0].get("config") or {}
    shape = c.get("batch_shape") or c.get("batch_input_shape")
    if shape is None and c.get("shape") is not None:
        shape = [None] + list(c["shape"])
    return chain, shape


# --------------------------------------------------------------------------------------------
# per-layer shape and parameter rules (shapes have no batch axis)


def _prod(xs: Any) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def _pair(v: Any, name: str, field: str) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        return (v, v)
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(_pos_int(x) for x in v):
        return (int(v[0]), int(v[1]))
    raise ModelSpecError(_KJ, f"layer {name!r} has a bad {field} {v!r}")


def _act_name(cfg: dict) -> str:
    a = cfg.get("activation", "linear")
    if a is None:
        return "linear"
    if isinstance(a, dict):  # a serialized built-in function, e.g. {"config": "relu", ...}
        c = a.get("config")
        return c if isinstance(c, str) else str(a.get("class_name"))
    return str(a)


def _act_flops(cfg: dict, elems: int) -> int:
    return 0 if _act_name(cfg) == "linear" else elems


def _axes(axis: Any, rank: int, name: str) -> list[int]:
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    out = []
    for a in axes:
        if not isinstance(a, int) or not -rank - 1 <= a <= rank or a == 0:
            raise ModelSpecError(_KJ, f"layer {name!r} normalizes over axis {a!r}, which the "
                                      f"input (rank {rank} without batch) does not have")
        out.append(a - 1 if a > 0 else rank + a)
    return out


def _dense(name: str, cfg: dict, shape: tuple[int, ...]):
    units = cfg.get("units")
    if not _pos_int(units):
        raise ModelSpecError(_KJ, f"layer {name!r} has bad units {units!r}")
    if cfg.get("quantization_config") not in (None, {}) or cfg.get("quantization_mode"):
        raise ModelSpecError(_KJ, f"layer {name!r} is quantized; quantized layers are not supported")
    fan_in = shape[-1]
    out_shape = shape[:-1] + (units,)
    rows = _prod(shape[:-1])
    bias = units if cfg.get("use_bias", True) else 0
    params = fan_in * units + bias
    non_trainable = 0
    rank = cfg.get("lora_rank")
    if _pos_int(rank):  # LoRA: the kernel is frozen, two low-rank factors train
        non_trainable = fan_in * units
        params += rank * (fan_in + units)
    flops = rows * (2 * fan_in * units + bias) + _act_flops(cfg, _prod(out_shape))
    return LayerProfile(name, "Dense", params, _prod(out_shape), flops, non_trainable,
                        out_shape), out_shape


def _dropout(name: str, cfg: dict, shape):
    n = _prod(shape)
    return LayerProfile(name, "Dropout", 0, n, n, 0, shape), shape


def _activation(name: str, cfg: dict, shape):
    n = _prod(shape)
    return LayerProfile(name, "Activation", 0, n, n, 0, shape), shape


def _flatten(name: str, cfg: dict, shape):
    out = (_prod(shape),)
    return LayerProfile(name, "Flatten", 0, out[0], 0, 0, out), out


def _reshape(name: str, cfg: dict, shape):
    target = cfg.get("target_shape")
    if not isinstance(target, (list, tuple)) or not target:
        raise ModelSpecError(_KJ, f"layer {name!r} has a bad target_shape {target!r}")
    total = _prod(shape)
    unknown = [i for i, d in enumerate(target) if d in (-1, None)]
    known = [d for d in target if d not in (-1, None)]
    if len(unknown) > 1 or not all(_pos_int(d) for d in known):
        raise ModelSpecError(_KJ, f"layer {name!r} has a bad target_shape {target!r}")
    kp = _prod(known)
    if unknown:
        if total % kp:
            raise ModelSpecError(_KJ, f"layer {name!r} cannot reshape {list(shape)} into {target}")
        target = [total // kp if d in (-1, None) else d for d in target]
    out = tuple(int(d) for d in target)
    if _prod(out) != total:
        raise ModelSpecError(_KJ, f"layer {name!r} cannot reshape {list(shape)} ({total} values) "
                                  f"into {list(out)}")
    return LayerProfile(name, "Reshape", 0, total, 0, 0, out), out


def _batchnorm(name: str, cfg: dict, shape):
    axes = _axes(cfg.get("axis", -1), len(shape), name)
    c = _prod(shape[a] for a in axes)
    trainable = c * (int(bool(cfg.get("center", True))) + int(bool(cfg.get("scale", True))))
    params = trainable + 2 * c  # moving mean and variance
    n = _prod(shape)
    return LayerProfile(name, "BatchNormalization", params, n, 4 * n, 2 * c, shape), shape


def _layernorm(name: str, cfg: dict, shape):
    axes = _axes(cfg.get("axis", -1), len(shape), name)
    c = _prod(shape[a] for a in axes)
    if cfg.get("rms_scaling"):
        params = c
    else:
        params = c * (int(bool(cfg.get("center", True))) + int(bool(cfg.get("scale", True))))
    n = _prod(shape)
    return LayerProfile(name, "LayerNormalization", params, n, 8 * n, 0, shape), shape


def _spatial(name: str, cfg: dict, shape, kind: str):
    if len(shape) != 3:
        raise ModelSpecError(_KJ, f"layer {name!r} ({kind}) needs a rank-3 input per example "
                                  f"(height, width, channels), got {list(shape)}")
    if cfg.get("data_format", "channels_last") == "channels_first":
        c, h, w = shape
        return h, w, c, True
    h, w, c = shape
    return h, w, c, False


def _out_len(n: int, k: int, stride: int, padding: str, dilation: int, name: str) -> int:
    if padding == "same":
        return -(-n // stride)
    if padding != "valid":
        raise ModelSpecError(_KJ, f"layer {name!r} has unsupported padding {padding!r} "
                                  "(valid or same)")
    eff = dilation * (k - 1) + 1
    if n < eff:
        raise ModelSpecError(_KJ, f"layer {name!r}: window {eff} is larger than its input {n}")
    return (n - eff) // stride + 1


def _shape_out(h: int, w: int, c: int, cf: bool) -> tuple[int, int, int]:
    return (c, h, w) if cf else (h, w, c)


def _conv2d(name: str, cfg: dict, shape):
    h, w, cin, cf = _spatial(name, cfg, shape, "Conv2D")
    filters = cfg.get("filters")
    if not _pos_int(filters):
        raise ModelSpecError(_KJ, f"layer {name!r} has bad filters {filters!r}")
    kh, kw = _pair(cfg.get("kernel_size"), name, "kernel_size")
    sh, sw = _pair(cfg.get("strides", 1), name, "strides")
    dh, dw = _pair(cfg.get("dilation_rate", 1), name, "dilation_rate")
    groups = cfg.get("groups", 1) or 1
    if cin % groups or filters % groups:
        raise ModelSpecError(_KJ, f"layer {name!r}: groups {groups} must divide channels {cin} and "
                                  f"filters {filters}")
    padding = str(cfg.get("padding", "valid")).lower()
    oh = _out_len(h, kh, sh, padding, dh, name)
    ow = _out_len(w, kw, sw, padding, dw, name)
    bias = filters if cfg.get("use_bias", True) else 0
    params = kh * kw * (cin // groups) * filters + bias
    out = _shape_out(oh, ow, filters, cf)
    n = _prod(out)
    flops = oh * ow * (2 * kh * kw * (cin // groups) * filters + bias) + _act_flops(cfg, n)
    return LayerProfile(name, "Conv2D", params, n, flops, 0, out), out


def _pool(kind: str):
    def fn(name: str, cfg: dict, shape):
        h, w, c, cf = _spatial(name, cfg, shape, kind)
        ph, pw = _pair(cfg.get("pool_size", 2), name, "pool_size")
        strides = cfg.get("strides")
        sh, sw = _pair(strides, name, "strides") if strides is not None else (ph, pw)
        padding = str(cfg.get("padding", "valid")).lower()
        oh = _out_len(h, ph, sh, padding, 1, name)
        ow = _out_len(w, pw, sw, padding, 1, name)
        out = _shape_out(oh, ow, c, cf)
        n = _prod(out)
        return LayerProfile(name, kind, 0, n, n * ph * pw, 0, out), out
    return fn


def _gap2d(name: str, cfg: dict, shape):
    h, w, c, cf = _spatial(name, cfg, shape, "GlobalAveragePooling2D")
    if cfg.get("keepdims"):
        out = (c, 1, 1) if cf else (1, 1, c)
    else:
        out = (c,)
    return LayerProfile(name, "GlobalAveragePooling2D", 0, c, h * w * c, 0, out), out


_LAYER_FNS = {
    "Dense": _dense,
    "Dropout": _dropout,
    "Activation": _activation,
    "Flatten": _flatten,
    "Reshape": _reshape,
    "BatchNormalization": _batchnorm,
    "LayerNormalization": _layernorm,
    "Conv2D": _conv2d,
    "MaxPooling2D": _pool("MaxPooling2D"),
    "AveragePooling2D": _pool("AveragePooling2D"),
    "GlobalAveragePooling2D": _gap2d,
}


def final_activation(model: dict) -> str:
    """The activation of the model's last layer ("linear" for the builtin MLP's logits):
    ``softmax`` means its outputs are probabilities, not logits."""
    if "builtin" in model and model.get("builtin"):
        return "linear"
    obj = parse_keras_json(model.get("keras_json"))
    cfg = obj.get("config") or {}
    layers = [l for l in cfg.get("layers") or [] if isinstance(l, dict)]
    if obj.get("class_name") != "Sequential" and layers:
        layers, _ = _functional_chain(cfg)
    for layer in reversed(layers):
        kind = layer.get("class_name")
        cfg = layer.get("config") or {}
        if kind in ("Dropout", "Flatten", "Reshape"):
            continue
        if kind in ("Dense", "Conv2D", "Activation"):
            return _act_name(cfg)
        if kind == "Softmax":
            return "softmax"
        return "linear"
    return "linear"

