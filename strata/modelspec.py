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

from strata import layers as _rules
from strata.layerbase import LayerRuleError, _pos, _prod, activation_name

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

_KJ = "model.keras_json"
_KF = "model.keras_file"
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
    #: the layers (or model inputs) whose outputs it takes, in call order; a tensor other than
    #: a layer's first output is named ``layer:index``. Empty for the first layer of a chain.
    inputs: tuple[str, ...] = ()
    #: per example, what it keeps for the backward pass beyond its outputs (recurrent gates
    #: and states, attention projections and scores; ``strata.layers``)
    internal_elems: int = 0
    #: elements of its largest trainable variable (0: all of ``trainable_params``)
    largest_weight: int = 0
    #: its activation function's name ("linear" when it has none)
    activation: str = "linear"
    #: bytes its backward pass holds whatever the batch (a recurrent layer's per-step kernel
    #: gradients; ``strata.memory.layer_workspaces``)
    workspace_bytes: int = 0

    @property
    def trainable_params(self) -> int:
        return self.params - self.non_trainable_params


@dataclass(frozen=True)
class ModelInput:
    """One input of the model: its name, per-example shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class ModelProfile:
    """The model's layers in a topological order (a chain's own order; the output layer is
    last). ``input_shape`` has no batch axis: the first input's. The input layers are not in
    ``layers``; ``inputs`` lists them (empty means one float32 input named "input")."""

    input_shape: tuple[int, ...]
    layers: tuple[LayerProfile, ...]
    inputs: tuple[ModelInput, ...] = ()

    @property
    def model_inputs(self) -> tuple[ModelInput, ...]:
        return self.inputs or (ModelInput("input", self.input_shape),)

    @property
    def is_chain(self) -> bool:
        """Each layer takes exactly the previous one's output (the first: the one input)."""
        if len(self.model_inputs) != 1:
            return False
        prev = self.model_inputs[0].name
        for l in self.layers:
            if l.inputs and l.inputs != (prev,):
                return False
            prev = l.name
        return True

    @property
    def cut_points(self) -> tuple[int, ...]:
        """The boundaries ``k`` (1 <= k < len(layers), between ``layers[k-1]`` and
        ``layers[k]``) where exactly one tensor, a layer's output, crosses: where a pipeline
        may cut. Every boundary of a chain; in a residual network, those between blocks."""
        L = len(self.layers)
        if self.is_chain:
            return tuple(range(1, L))
        pos = {inp.name: -1 for inp in self.model_inputs}
        last_use: dict[str, int] = {}
        for i, l in enumerate(self.layers):
            pos[l.name] = i
            for ref in l.inputs:
                last_use[ref] = max(last_use.get(ref, -1), i)
        # tensor t (made at pos p, last used at u) crosses boundary k when p < k <= u
        crossing = [0] * (L + 1)
        for ref, u in last_use.items():
            p = pos.get(ref.split(":")[0], -1)
            for k in range(p + 1, u + 1):
                crossing[k] += 1
        inputs_alive = max((last_use.get(inp.name, -1) for inp in self.model_inputs), default=-1)
        return tuple(k for k in range(1, L) if crossing[k] == 1 and k > inputs_alive)

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
        """Sum of all layers' output elements per example, with what they keep inside for the
        backward pass (``LayerProfile.internal_elems``)."""
        return sum(l.output_elems + l.internal_elems for l in self.layers)


# --------------------------------------------------------------------------------------------
# entry point


def profile_model(model: dict) -> ModelProfile:
    """Profiles a normalized ``spec["model"]`` section (see the module docstring).

    Raises ``ModelSpecError`` for anything it cannot or must not run."""
    if not isinstance(model, dict):
        raise ModelSpecError("model", "must be a mapping with builtin, keras_json or keras_file")
    present = [k for k in MODEL_SOURCES if model.get(k) not in (None, "", {})]
    if len(present) != 1:
        raise ModelSpecError("model", f"exactly one of {', '.join('model.' + k for k in MODEL_SOURCES)}"
                             f" is required (got {', '.join(present) or 'none'})")
    if present[0] == "builtin":
        return _profile_builtin(model["builtin"])
    if present[0] == "keras_file":
        return _profile_keras_json(keras_file_config(model), _KF)
    return _profile_keras_json(model["keras_json"])


#: where a model can come from (``code`` models are profiled by running them: see
#: ``strata.spec``)
MODEL_SOURCES = ("builtin", "keras_json", "keras_file")


def keras_file_config(model: dict) -> str:
    """The ``config.json`` text of a ``model.keras_file`` section as the coordinator normalized
    it (``{"sha256", "size", "name", "config"}``: the file itself travels as an upload)."""
    kf = model.get("keras_file")
    if not isinstance(kf, dict) or not isinstance(kf.get("config"), str) or not kf["config"]:
        raise ModelSpecError(_KF, "has no model config: submit the .keras file through the "
                                  "client (strata submit), which uploads it")
    return kf["config"]


def model_json(model: dict) -> str | dict:
    """The serialized Keras model of a keras_json or keras_file section (for a builtin one,
    the config of the model ``worker.models`` builds)."""
    if model.get("keras_file"):
        return keras_file_config(model)
    if model.get("builtin"):
        return builtin_keras_config(model["builtin"])
    return model.get("keras_json")


def builtin_keras_config(b: dict) -> dict:
    """The builtin MLP as a Keras ``Sequential`` config (what ``model.to_json()`` of the model
    ``worker.models`` builds says, in its essentials): a saved pipeline model needs it."""
    def layer(cls: str, **cfg: Any) -> dict:
        return {"module": "keras.layers", "class_name": cls, "config": cfg,
                "registered_name": None}

    shape = [int(d) for d in b["input_shape"]]
    layers = [layer("InputLayer", batch_shape=[None] + shape, dtype="float32", name="input")]
    if len(shape) > 1:
        layers.append(layer("Flatten", name="flatten"))
    he = {"module": "keras.initializers", "class_name": "HeUniform", "config": {"seed": None},
          "registered_name": None}
    for i, units in enumerate(b.get("hidden") or []):
        layers.append(layer("Dense", name=f"hidden_{i}", units=int(units), activation="relu",
                            kernel_initializer=he))
    layers.append(layer("Dense", name="logits", units=int(b["classes"]), activation="linear"))
    return {"module": "keras", "class_name": "Sequential",
            "config": {"name": "mlp", "trainable": True, "layers": layers},
            "registered_name": None}


# --------------------------------------------------------------------------------------------
# builtin


def _profile_builtin(b: Any) -> ModelProfile:
    if not isinstance(b, dict):
        raise ModelSpecError(_B, "must be a mapping like {kind: mlp, input_shape: [64], "
                                 "hidden: [1024, 512, 256], classes: 10}")
    kind = b.get("kind", "mlp")
    if kind != "mlp":
        raise ModelSpecError(f"{_B}.kind", f"unknown builtin model {kind!r}; supported: mlp")
    shape = b.get("input_shape")
    if (not isinstance(shape, (list, tuple)) or not shape
            or not all(_pos(d) for d in shape)):
        raise ModelSpecError(f"{_B}.input_shape",
                             f"must be a non-empty list of positive integers, got {shape!r}")
    hidden = b.get("hidden", [])
    if not isinstance(hidden, (list, tuple)) or not all(_pos(h) for h in hidden):
        raise ModelSpecError(f"{_B}.hidden", f"must be a list of positive integers, got {hidden!r}")
    classes = b.get("classes")
    if not _pos(classes):
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
        o = _rules.dense(name, cfg, [cur], {})
        cur = o.outputs[0]
        layers.append(LayerProfile(name, "Dense", o.params, _prod(cur), o.flops, 0, cur,
                                   largest_weight=o.extra["kernel"],
                                   activation=cfg["activation"]))
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
            raise ModelSpecError(_KJ, f"is not valid JSON: {str(e)[:200]}") from None
        except RecursionError:
            raise ModelSpecError(_KJ, "is nested too deeply to be a Keras model") from None
    if not isinstance(obj, dict) or "class_name" not in obj or "config" not in obj:
        raise ModelSpecError(_KJ, "is not a serialized Keras model (expected an object with "
                                  "class_name and config, as keras.Model.to_json() writes)")
    return obj


def _is_keras_module(module: Any) -> bool:
    return isinstance(module, str) and (module == "keras" or module.startswith("keras."))


#: Keras' own markers for values it serializes as objects without a module (tensors, tuples,
#: slices...): deserialized without importing anything. ``__lambda__`` (code) and
#: ``__typespec__`` (which names a module) are not among them.
_KERAS_VALUE_CLASSES = frozenset({"__keras_tensor__", "__tensor__", "__numpy__", "__bytes__",
                                  "__tuple__", "__slice__", "__ellipsis__"})
_IDENTIFIER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def check_keras_json_safe(obj: Any) -> None:
    """Refuses Lambda layers and every serialized object that is not Keras' own.

    Walks the whole JSON tree, every nested config included. Every mapping with a
    ``class_name`` is a serialized object, whatever else it carries:

    - ``class_name`` must be a plain identifier, never Lambda or ``__lambda__``;
    - a ``module`` must be ``keras`` or under it (Keras imports it to find the class); it
      may be left out only in the older form without ``registered_name`` either;
    - a ``registered_name``, when given and not null, must be the class name itself, or for
      a function (``class_name: function``) a plain name, never ``"package>Name"`` (what
      ``register_keras_serializable`` writes);
    - without a module, the class must be found among Keras' own by name, which only looks
      up registered built-ins; Keras' value markers (``__tuple__``, ``__keras_tensor__``...)
      are allowed, ``__typespec__`` and any other marker are not.

    Keras' safe mode stays on in the task process as well (``worker.models``)."""

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
        if "class_name" in node:
            _check_object(node, layer_name)
        for v in node.values():
            walk(v, depth + 1)

    walk(obj, 0)


def _check_object(node: dict, layer_name: Any) -> None:
    cls, module, reg = node.get("class_name"), node.get("module"), node.get("registered_name")

    def refuse(why: str) -> None:
        raise ModelSpecError(
            _KJ, f"object {str(layer_name(node))[:64]!r} (class {str(cls)[:64]!r}, module "
                 f"{str(module)[:64]!r}): {why}; custom objects and custom code are refused "
                 f"(safe mode)")

    if not isinstance(cls, str) or not cls or len(cls) > 128:
        refuse("class_name is not a class name")
    if cls in ("Lambda", "__lambda__"):
        raise ModelSpecError(_KJ, f"layer {str(layer_name(node))[:64]!r} is a Lambda layer; "
                                  f"Lambda and custom code are refused (safe mode)")
    if cls.startswith("__"):
        if cls not in _KERAS_VALUE_CLASSES or module is not None:
            refuse("is not one of the values Keras serializes itself")
        return
    if not set(cls) <= _IDENTIFIER_CHARS:
        refuse("class_name is not a plain identifier")
    # Keras 3 writes a module for each of its own objects (null: a class it cannot import)
    if (module is not None or "registered_name" in node) and not _is_keras_module(module):
        refuse("its module is not Keras")
    if reg is not None:
        plain = isinstance(reg, str) and reg and set(reg) <= _IDENTIFIER_CHARS
        if not plain or (cls != "function" and reg != cls):
            refuse(f"registered_name {str(reg)[:64]!r} is not a built-in Keras name")


# --------------------------------------------------------------------------------------------
# keras_json: the layer graph


def _profile_keras_json(text: Any, field: str = _KJ) -> ModelProfile:
    try:
        obj = parse_keras_json(text)
        check_keras_json_safe(obj)
        return _profile_graph(obj)
    except ModelSpecError as e:
        if field == e.field:
            raise
        raise ModelSpecError(field, e.message) from None


@dataclass
class _Node:
    """One layer call: the layer's serialized form and the tensors it takes."""

    name: str
    kind: str
    cfg: dict
    args: list[tuple[str, int, Any]]              # (producer, tensor index, recorded shape)
    kwargs: dict[str, tuple[str, int, Any]]

    @property
    def deps(self) -> list[str]:
        return [p for p, _, _ in self.args] + [p for p, _, _ in self.kwargs.values()]


def _layer_name(entry: dict) -> str:
    cfg = entry.get("config") if isinstance(entry.get("config"), dict) else {}
    return str(entry.get("name") or cfg.get("name") or entry.get("class_name"))


def _tensor(n: Any) -> tuple[str, int, Any] | None:
    if isinstance(n, dict) and n.get("class_name") == "__keras_tensor__":
        c = n.get("config") or {}
        hist = c.get("keras_history")
        if isinstance(hist, list) and len(hist) == 3:
            if hist[1] not in (0, None):
                raise ModelSpecError(_KJ, f"layer {hist[0]!r} is called more than once (a "
                                          "shared layer); shared layers are not supported")
            shape = c.get("shape")
            return str(hist[0]), int(hist[2] or 0), shape
    return None


def _flat_tensors(n: Any) -> list[tuple[str, int, Any]]:
    t = _tensor(n)
    if t is not None:
        return [t]
    out: list[tuple[str, int, Any]] = []
    if isinstance(n, list):
        for v in n:
            out += _flat_tensors(v)
    elif isinstance(n, dict) and n.get("class_name") != "__keras_tensor__":
        for v in n.values():
            out += _flat_tensors(v)
    return out


def _input_entry(entry: dict) -> tuple[str, Any, str]:
    c = entry.get("config") or {}
    shape = c.get("batch_shape") or c.get("batch_input_shape")
    if shape is None and c.get("shape") is not None:
        shape = [None] + list(c["shape"])
    dtype = c.get("dtype") or "float32"
    if isinstance(dtype, dict):
        dtype = (dtype.get("config") or {}).get("name", "float32")
    return _layer_name(entry), shape, str(dtype)


def _graph(obj: dict) -> tuple[list[tuple[str, Any, str]], list[_Node], list[tuple[str, int]]]:
    """(inputs, layer calls in the file's order, outputs) of a Sequential or Functional model."""
    cls = obj.get("class_name")
    cfg = obj.get("config")
    if not isinstance(cfg, dict) or not isinstance(cfg.get("layers"), list):
        raise ModelSpecError(_KJ, f"{cls} config has no layers list")
    entries = [l for l in cfg["layers"] if isinstance(l, dict)]
    for e in entries:
        if e.get("class_name") in ("Sequential", "Functional", "Model"):
            raise ModelSpecError(_KJ, f"layer {_layer_name(e)!r} is a nested model; flatten it "
                                      "into one model (its layers in the outer graph)")
    if cls == "Sequential":
        shape = _sequential_input_shape(obj, entries)
        if shape is None:
            raise ModelSpecError(_KJ, "the model has no input shape; build it with keras.Input"
                                      "(shape) (or call model.build) before to_json()")
        dtype = "float32"
        if entries and entries[0].get("class_name") == "InputLayer":
            dtype = _input_entry(entries[0])[2]
        body = [e for e in entries if e.get("class_name") != "InputLayer"]
        inputs = [("input", shape, dtype)]
        nodes, prev = [], "input"
        for e in body:
            name = _layer_name(e)
            nodes.append(_Node(name, str(e.get("class_name")), _cfg(e), [(prev, 0, None)], {}))
            prev = name
        return inputs, nodes, [(prev, 0)]
    if cls not in ("Functional", "Model"):
        raise ModelSpecError(_KJ, f"top-level class {cls!r} is not supported; use a Sequential "
                                  f"or Functional model")
    inputs, nodes = [], []
    for e in entries:
        if e.get("class_name") == "InputLayer":
            inputs.append(_input_entry(e))
            continue
        name = _layer_name(e)
        calls = e.get("inbound_nodes") or []
        if len(calls) != 1:
            raise ModelSpecError(_KJ, f"layer {name!r} is called {len(calls)} times; each layer "
                                      "must be called exactly once (shared layers are not "
                                      "supported)")
        call = calls[0] if isinstance(calls[0], dict) else {"args": calls[0], "kwargs": {}}
        args = _flat_tensors(call.get("args") or [])
        kwargs = {}
        for k, v in (call.get("kwargs") or {}).items():
            ts = _flat_tensors(v)
            for j, t in enumerate(ts):
                kwargs[k if j == 0 else f"{k}:{j}"] = t
        if not args and not kwargs:
            raise ModelSpecError(_KJ, f"layer {name!r} takes no input tensor")
        nodes.append(_Node(name, str(e.get("class_name")), _cfg(e), args, kwargs))
    outs = cfg.get("output_layers") or []
    if outs and not isinstance(outs[0], list):
        outs = [outs]
    outputs = [(str(o[0]), int(o[2] or 0)) for o in outs if isinstance(o, list) and o]
    return inputs, nodes, outputs


def _cfg(entry: dict) -> dict:
    return entry.get("config") if isinstance(entry.get("config"), dict) else {}


def _dims(shape: Any) -> tuple[int, ...] | None:
    """A recorded Keras shape without its batch axis, if every other dimension is known."""
    if not isinstance(shape, (list, tuple)) or len(shape) < 2:
        return None
    dims = shape[1:]
    if not all(_pos(d) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def _profile_graph(obj: dict) -> ModelProfile:
    """The profile of a Sequential or Functional model's graph: checked (one output, unique
    names, known inputs, no cycle, every layer leading to the output), then each layer's
    rule applied in a topological order, the output layer last."""
    inputs, nodes, outputs = _graph(obj)
    if not inputs:
        raise ModelSpecError(_KJ, "the model has no input layer")
    if len(outputs) != 1:
        raise ModelSpecError(_KJ, f"the model has {len(outputs)} outputs; one output (one loss) "
                                  "is supported; use `code:` for several")
    if not nodes:
        raise ModelSpecError(_KJ, "the model has no layers besides its input")
    shapes: dict[str, list[tuple[int, ...]]] = {}
    model_inputs = []
    for name, shape, dtype in inputs:
        dims = _check_shape(shape)
        shapes[name] = [dims]
        model_inputs.append(ModelInput(name, dims, dtype))
    order = _ordered(nodes, set(shapes))
    out_name = outputs[0][0]
    _check_all_lead_to(out_name, order, model_inputs)
    order.sort(key=lambda n: n.name == out_name)  # stable: the output layer last
    layers = [_layer_profile(n, shapes) for n in order]
    if outputs[0][1] != 0:
        raise ModelSpecError(_KJ, f"the model's output is output {outputs[0][1]} of layer "
                                  f"{out_name!r}; use a model whose output is a layer's first "
                                  "output")
    return ModelProfile(model_inputs[0].shape, tuple(layers), tuple(model_inputs))


def _ordered(nodes: list[_Node], inputs: set[str]) -> list[_Node]:
    """The layer calls in a topological order, keeping the file's order among ready layers;
    refuses shared names, unknown inputs and cycles."""
    by_name = {n.name: n for n in nodes}
    if len(by_name) != len(nodes) or set(by_name) & inputs:
        raise ModelSpecError(_KJ, "two layers share a name")
    for n in nodes:
        for d in n.deps:
            if d not in by_name and d not in inputs:
                raise ModelSpecError(_KJ, f"layer {n.name!r} takes its input from unknown layer "
                                          f"{d!r}")
    order: list[_Node] = []
    done = set(inputs)
    pending = list(nodes)
    while pending:
        ready = [n for n in pending if all(d in done for d in n.deps)]
        if not ready:
            raise ModelSpecError(_KJ, f"layers {[n.name for n in pending][:5]} form a cycle")
        for n in ready:
            order.append(n)
            done.add(n.name)
        pending = [n for n in pending if n.name not in done]
    return order


def _check_all_lead_to(out_name: str, order: list[_Node], model_inputs: list[ModelInput]
                       ) -> None:
    """Every layer and input must lead to the output (nothing computed for nothing)."""
    if out_name not in {n.name for n in order}:
        raise ModelSpecError(_KJ, f"the model's output {out_name!r} is not one of its layers")
    needed = {out_name}
    for n in reversed(order):
        if n.name in needed:
            needed.update(n.deps)
    unused = [n.name for n in order if n.name not in needed]
    if unused:
        raise ModelSpecError(_KJ, f"layers {unused[:5]} do not lead to the model's output")
    unused_inputs = [i.name for i in model_inputs if i.name not in needed]
    if unused_inputs:
        raise ModelSpecError(_KJ, f"inputs {unused_inputs} do not lead to the model's output")


def _shape_of(shapes: dict[str, list[tuple[int, ...]]], ref: tuple[str, int, Any], user: str
              ) -> tuple[int, ...]:
    """The per-example shape of the tensor ``ref`` that layer ``user`` takes: as recorded in
    the file when it is fully known, else as its producer's rule made it."""
    producer, idx, recorded = ref
    outs = shapes[producer]
    if idx >= len(outs):
        dims = _dims(recorded)
        if dims is None:
            raise ModelSpecError(_KJ, f"layer {user!r} takes output {idx} of {producer!r}, "
                                      "which has no such output")
        return dims
    dims = _dims(recorded)
    return dims if dims is not None else outs[idx]


def _layer_profile(n: _Node, shapes: dict[str, list[tuple[int, ...]]]) -> LayerProfile:
    """Layer call ``n`` through its class's rule; its output shapes join ``shapes``."""
    rule = _rules.RULES.get(n.kind)
    if rule is None:
        why = _rules.REFUSED.get(n.kind)
        if n.kind == "Lambda":
            raise ModelSpecError(_KJ, f"layer {n.name!r} is a Lambda layer; Lambda and custom "
                                      f"code are refused (safe mode)")
        raise ModelSpecError(_KJ, f"layer {n.name!r} has unsupported class {n.kind!r}"
                                  + (f": {why}" if why else "")
                                  + f"; supported layers: {', '.join(SUPPORTED_LAYERS)}")
    ins = [_shape_of(shapes, r, n.name) for r in n.args]
    kw = {k: _shape_of(shapes, r, n.name) for k, r in n.kwargs.items()}
    try:
        o = rule(n.name, n.cfg, ins, kw)
    except LayerRuleError as e:
        raise ModelSpecError(_KJ, str(e)) from None
    shapes[n.name] = [tuple(int(d) for d in s) for s in o.outputs]
    refs = tuple(p if i == 0 else f"{p}:{i}" for p, i, _ in n.args) + tuple(
        p if i == 0 else f"{p}:{i}" for p, i, _ in n.kwargs.values())
    out0 = shapes[n.name][0]
    return LayerProfile(
        n.name, n.kind, o.params, sum(_prod(s) for s in shapes[n.name]), o.flops,
        o.non_trainable, out0, refs, o.internal_elems, int(o.extra.get("kernel", 0)),
        activation_name(n.cfg) if "activation" in n.cfg else (
            "softmax" if n.kind == "Softmax" else "linear"),
        int(o.extra.get("workspace", 0)))


def _check_shape(batch_shape: Any) -> tuple[int, ...]:
    if not isinstance(batch_shape, (list, tuple)) or len(batch_shape) < 2:
        raise ModelSpecError(_KJ, f"input shape {batch_shape!r} must have a batch axis and at "
                                  "least one more dimension")
    dims = batch_shape[1:]
    if not all(_pos(d) for d in dims):
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


#: layers that keep their input's activation (a softmax before them stays the output's)
_PASS_ACTIVATION = ("Dropout", "Flatten", "Reshape", "Identity", "ActivityRegularization",
                    "GaussianNoise", "GaussianDropout", "AlphaDropout", "SpatialDropout1D",
                    "SpatialDropout2D", "SpatialDropout3D", "Permute")

SUPPORTED_LAYERS = tuple(sorted(_rules.RULES))


def final_activation(model: dict) -> str:
    """The activation of the model's output (``"linear"`` for the builtin MLP's logits):
    ``softmax`` means its outputs are probabilities, not logits."""
    profile = profile_model(model)
    by_name = {l.name: l for l in profile.layers}
    layer = profile.layers[-1] if profile.layers else None
    while layer is not None and layer.kind in _PASS_ACTIVATION and len(layer.inputs) <= 1:
        prev = layer.inputs[0] if layer.inputs else None
        idx = profile.layers.index(layer)
        layer = by_name.get(prev) if prev else (profile.layers[idx - 1] if idx else None)
    return layer.activation if layer is not None else "linear"


class TensorRef(str):
    """An input tensor in a layer's call template (``layer_calls``): the producing layer's name,
    with ``:index`` for a tensor other than its first output."""


def layer_calls(model: dict) -> dict[str, tuple[list, dict]]:
    """How each layer of a keras_json or keras_file model is called: ``{name: (args, kwargs)}``
    as the model's graph calls it, every input tensor replaced by a ``TensorRef`` and every
    other argument (``use_causal_mask``, ``mask: None``, ...) kept. A Sequential model's layer
    takes the previous layer's output (the first: the input, named "input")."""
    obj = parse_keras_json(model_json(model))
    entries = [l for l in (obj.get("config") or {}).get("layers") or [] if isinstance(l, dict)]
    out: dict[str, tuple[list, dict]] = {}
    if obj.get("class_name") == "Sequential":
        prev = "input"
        for e in entries:
            if e.get("class_name") == "InputLayer":
                continue
            name = _layer_name(e)
            out[name] = ([TensorRef(prev)], {})
            prev = name
        return out

    def sub(n: Any) -> Any:
        t = _tensor(n)
        if t is not None:
            return TensorRef(t[0] if t[1] == 0 else f"{t[0]}:{t[1]}")
        if isinstance(n, list):
            return [sub(v) for v in n]
        if isinstance(n, dict):
            return {k: sub(v) for k, v in n.items()}
        return n

    for e in entries:
        if e.get("class_name") == "InputLayer":
            continue
        calls = e.get("inbound_nodes") or [{}]
        call = calls[0] if isinstance(calls[0], dict) else {"args": calls[0], "kwargs": {}}
        out[_layer_name(e)] = (sub(call.get("args") or []), sub(call.get("kwargs") or {}))
    return out


def layer_entries(model: dict) -> dict[str, dict]:
    """Each layer's serialized form (module, class_name, config, registered_name) by name, of
    a keras_json or keras_file model, checked safe."""
    obj = parse_keras_json(model_json(model))
    check_keras_json_safe(obj)
    entries = [l for l in (obj.get("config") or {}).get("layers") or [] if isinstance(l, dict)]
    return {_layer_name(e): {k: e[k] for k in ("module", "class_name", "config", "registered_name")
                             if k in e}
            for e in entries if e.get("class_name") != "InputLayer"}
