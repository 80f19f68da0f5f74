"""Shape, parameter and FLOP rules of Keras 3's built-in layers, in pure Python.

The coordinator has no TensorFlow, yet must know every layer of a submitted model: its
parameters (weights, gradients, optimizer slots), its outputs (activations, stage boundaries)
and its work (stage costs). ``RULES`` maps a Keras class name to a rule
``(name, cfg, ins, kw) -> Out``: ``cfg`` is the layer's serialized config, ``ins`` the
per-example shapes (no batch axis) of its positional tensor inputs in call order, ``kw`` those
passed by keyword (``key`` of MultiHeadAttention, ``initial_state`` of an RNN, masks); ``Out``,
``LayerRuleError`` and the readers of configs they share are ``strata.layerbase``'s. The
rules follow Keras 3.15's own ``compute_output_shape`` and ``build``; tests/test_modelspec.py
checks every one against Keras itself (``tests/fixtures/keras_models.json``).

What is not here is refused by name (``ModelSpecError``): stateful preprocessing layers
(lookups, text vectorization, hashing: they belong in the input pipeline), wrappers of other
frameworks' code (``TFSMLayer``, ``JaxLayer``, ``FlaxLayer``, ``TorchModuleWrapper``), and the
convolutional recurrent layers.

``internal_elems`` counts, per example, what a layer keeps for its backward pass beyond its
outputs: a recurrent layer's per-step gates and states, an attention layer's projections and
score matrices. The memory estimators add it to the activations.
"""

from __future__ import annotations

from typing import Any, Callable

from strata.layerbase import (
    LayerRuleError, Out, Shape, _act_flops, _check_quant, _conv_len, _join, _one, _pads, _pos,
    _prod, _spatial, _tuple,
)

__all__ = ["RULES", "SHAPE_PRESERVING", "REFUSED", "rule_for"]


# --------------------------------------------------------------------------------------------
# core


def dense(name, cfg, ins, kw):
    shape = _one(name, ins, "Dense")
    units = cfg.get("units")
    if not _pos(units):
        raise LayerRuleError(f"layer {name!r} has bad units {units!r}")
    _check_quant(name, cfg)
    fan_in = shape[-1]
    out = shape[:-1] + (units,)
    bias = units if cfg.get("use_bias", True) else 0
    params = fan_in * units + bias
    non_trainable = 0
    rank = cfg.get("lora_rank")
    if _pos(rank):  # LoRA: the kernel is frozen, two low-rank factors train
        non_trainable = fan_in * units
        params += rank * (fan_in + units)
    flops = _prod(shape[:-1]) * (2 * fan_in * units + bias) + _act_flops(cfg, _prod(out))
    return Out([out], params, non_trainable, flops, extra={"kernel": fan_in * units})


def embedding(name, cfg, ins, kw):
    shape = _one(name, ins, "Embedding")
    vocab, dim = cfg.get("input_dim"), cfg.get("output_dim")
    if not _pos(vocab) or not _pos(dim):
        raise LayerRuleError(f"layer {name!r} needs positive input_dim and output_dim, got "
                             f"{vocab!r}, {dim!r}")
    _check_quant(name, cfg)
    params = vocab * dim
    non_trainable = 0
    if _pos(cfg.get("lora_rank")):
        non_trainable = params
        params += cfg["lora_rank"] * (vocab + dim)
    out = tuple(shape) + (dim,)
    return Out([out], params, non_trainable, _prod(out), extra={"kernel": vocab * dim})


def elementwise(kind: str, flops_per: int = 1):
    def rule(name, cfg, ins, kw):
        shape = _one(name, ins, kind)
        return Out([tuple(shape)], flops=flops_per * _prod(shape))
    return rule


def prelu(name, cfg, ins, kw):
    shape = _one(name, ins, "PReLU")
    alpha = list(shape)
    for a in cfg.get("shared_axes") or []:
        if not isinstance(a, int) or not 1 <= a <= len(shape):
            raise LayerRuleError(f"layer {name!r} has a bad shared axis {a!r}")
        alpha[a - 1] = 1
    return Out([tuple(shape)], params=_prod(alpha), flops=2 * _prod(shape))


# --------------------------------------------------------------------------------------------
# convolutions and pooling


def _window(name: str, cfg: dict, ins: list[Shape], rank: int, kind: str):
    """What every sliding-window layer reads: (spatial dims, channels, channels_first,
    kernel_size, strides, dilation_rate, padding)."""
    shape = _one(name, ins, kind)
    dims, cin, cf = _spatial(name, cfg, shape, rank, kind)
    k = _tuple(cfg.get("kernel_size"), rank, name, "kernel_size")
    s = _tuple(cfg.get("strides", 1), rank, name, "strides")
    d = _tuple(cfg.get("dilation_rate", 1), rank, name, "dilation_rate")
    return dims, cin, cf, k, s, d, str(cfg.get("padding", "valid")).lower()


def _filters(name: str, cfg: dict) -> int:
    filters = cfg.get("filters")
    if not _pos(filters):
        raise LayerRuleError(f"layer {name!r} has bad filters {filters!r}")
    return int(filters)


def conv(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        dims, cin, cf, k, s, d, padding = _window(name, cfg, ins, rank, kind)
        filters = _filters(name, cfg)
        groups = cfg.get("groups", 1) or 1
        if cin % groups or filters % groups:
            raise LayerRuleError(f"layer {name!r}: groups {groups} must divide channels {cin} "
                                 f"and filters {filters}")
        out_dims = tuple(_conv_len(n, kk, ss, padding, dd, name)
                         for n, kk, ss, dd in zip(dims, k, s, d))
        bias = filters if cfg.get("use_bias", True) else 0
        kernel = _prod(k) * (cin // groups) * filters
        out = _join(out_dims, filters, cf)
        n = _prod(out)
        flops = _prod(out_dims) * (2 * _prod(k) * (cin // groups) * filters + bias) \
            + _act_flops(cfg, n)
        return Out([out], kernel + bias, 0, flops, extra={"kernel": kernel})
    return rule


def conv_transpose(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        dims, cin, cf, k, s, d, padding = _window(name, cfg, ins, rank, kind)
        filters = _filters(name, cfg)
        op = cfg.get("output_padding")
        ops = _tuple(op, rank, name, "output_padding", allow_zero=True) if op is not None \
            else None
        out_dims = []
        for i in range(rank):
            kk = (k[i] - 1) * d[i] + 1
            if ops is None:
                n = dims[i] * s[i] + (max(kk - s[i], 0) if padding == "valid" else 0)
            else:
                pad = 0 if padding == "valid" else kk // 2
                n = (dims[i] - 1) * s[i] + kk - 2 * pad + ops[i]
            out_dims.append(n)
        bias = filters if cfg.get("use_bias", True) else 0
        kernel = _prod(k) * cin * filters
        out = _join(tuple(out_dims), filters, cf)
        flops = 2 * _prod(dims) * kernel + _prod(out) * (1 if bias else 0)
        return Out([out], kernel + bias, 0, flops, extra={"kernel": kernel})
    return rule


def depthwise(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        dims, cin, cf, k, s, d, padding = _window(name, cfg, ins, rank, kind)
        dm = cfg.get("depth_multiplier", 1)
        if not _pos(dm):
            raise LayerRuleError(f"layer {name!r} has a bad depth_multiplier {dm!r}")
        out_dims = tuple(_conv_len(n, kk, ss, padding, dd, name)
                         for n, kk, ss, dd in zip(dims, k, s, d))
        cout = cin * dm
        bias = cout if cfg.get("use_bias", True) else 0
        kernel = _prod(k) * cin * dm
        out = _join(out_dims, cout, cf)
        flops = _prod(out_dims) * (2 * _prod(k) * cout + bias) + _act_flops(cfg, _prod(out))
        return Out([out], kernel + bias, 0, flops, extra={"kernel": kernel})
    return rule


def separable(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        dims, cin, cf, k, s, d, padding = _window(name, cfg, ins, rank, kind)
        filters = _filters(name, cfg)
        dm = cfg.get("depth_multiplier", 1)
        if not _pos(dm):
            raise LayerRuleError(f"layer {name!r} has a bad depth_multiplier {dm!r}")
        out_dims = tuple(_conv_len(n, kk, ss, padding, dd, name)
                         for n, kk, ss, dd in zip(dims, k, s, d))
        bias = filters if cfg.get("use_bias", True) else 0
        dwk, pwk = _prod(k) * cin * dm, cin * dm * filters
        out = _join(out_dims, filters, cf)
        pos = _prod(out_dims)
        flops = pos * (2 * dwk + 2 * pwk + bias) + _act_flops(cfg, _prod(out))
        return Out([out], dwk + pwk + bias, 0, flops, internal_elems=pos * cin * dm,
                   extra={"kernel": max(dwk, pwk)})
    return rule


def pool(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        shape = _one(name, ins, kind)
        dims, c, cf = _spatial(name, cfg, shape, rank, kind)
        p = _tuple(cfg.get("pool_size", 2), rank, name, "pool_size")
        st = cfg.get("strides")
        s = _tuple(st, rank, name, "strides") if st is not None else p
        padding = str(cfg.get("padding", "valid")).lower()
        out_dims = tuple(_conv_len(n, pp, ss, padding, 1, name) for n, pp, ss in zip(dims, p, s))
        out = _join(out_dims, c, cf)
        return Out([out], flops=_prod(out) * _prod(p))
    return rule


def global_pool(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        shape = _one(name, ins, kind)
        dims, c, cf = _spatial(name, cfg, shape, rank, kind)
        if cfg.get("keepdims"):
            out = _join((1,) * rank, c, cf)
        else:
            out = (c,)
        return Out([out], flops=_prod(shape))
    return rule


def adaptive_pool(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        shape = _one(name, ins, kind)
        dims, c, cf = _spatial(name, cfg, shape, rank, kind)
        o = _tuple(cfg.get("output_size"), rank, name, "output_size")
        return Out([_join(o, c, cf)], flops=_prod(shape))
    return rule


def _steps_or_spatial(name: str, cfg: dict, shape: Shape, rank: int, kind: str):
    """(dims, channels, channels_first) of a 1-D layer's (steps, features) input or a 2-3-D
    layer's spatial one."""
    if rank == 1:
        if len(shape) != 2:
            raise LayerRuleError(f"layer {name!r} ({kind}) needs (steps, features)")
        return (shape[0],), shape[1], False
    return _spatial(name, cfg, shape, rank, kind)


def upsampling(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        dims, c, cf = _steps_or_spatial(name, cfg, _one(name, ins, kind), rank, kind)
        size = _tuple(cfg.get("size", 2), rank, name, "size")
        out = _join(tuple(n * f for n, f in zip(dims, size)), c, cf)
        return Out([out], flops=0 if rank == 1 else _prod(out))
    return rule


def cropping(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        dims, c, cf = _steps_or_spatial(name, cfg, _one(name, ins, kind), rank, kind)
        crop = _pads(cfg.get("cropping"), rank, name, "cropping")
        out_dims = tuple(n - a - b for n, (a, b) in zip(dims, crop))
        if any(n < 1 for n in out_dims):
            raise LayerRuleError(f"layer {name!r} crops {list(dims)} to nothing")
        return Out([_join(out_dims, c, cf)])
    return rule


def zeropad(rank: int, kind: str):
    def rule(name, cfg, ins, kw):
        dims, c, cf = _steps_or_spatial(name, cfg, _one(name, ins, kind), rank, kind)
        pad = _pads(cfg.get("padding", 1), rank, name, "padding")
        out_dims = tuple(n + a + b for n, (a, b) in zip(dims, pad))
        return Out([_join(out_dims, c, cf)])
    return rule


# --------------------------------------------------------------------------------------------
# normalisation


def _norm_axes(axis: Any, rank: int, name: str) -> list[int]:
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    out = []
    for a in axes:
        if not isinstance(a, int) or isinstance(a, bool) or not -rank - 1 <= a <= rank or a == 0:
            raise LayerRuleError(f"layer {name!r} normalizes over axis {a!r}, which the input "
                                 f"(rank {rank} without batch) does not have")
        out.append(a - 1 if a > 0 else rank + a)
    return out


def batchnorm(name, cfg, ins, kw):
    shape = _one(name, ins, "BatchNormalization")
    c = _prod(shape[a] for a in _norm_axes(cfg.get("axis", -1), len(shape), name))
    trainable = c * (int(bool(cfg.get("center", True))) + int(bool(cfg.get("scale", True))))
    n = _prod(shape)
    return Out([tuple(shape)], trainable + 2 * c, 2 * c, 4 * n)


def layernorm(name, cfg, ins, kw):
    shape = _one(name, ins, "LayerNormalization")
    c = _prod(shape[a] for a in _norm_axes(cfg.get("axis", -1), len(shape), name))
    if cfg.get("rms_scaling"):
        params = c
    else:
        params = c * (int(bool(cfg.get("center", True))) + int(bool(cfg.get("scale", True))))
    return Out([tuple(shape)], params, 0, 8 * _prod(shape))


def groupnorm(name, cfg, ins, kw):
    shape = _one(name, ins, "GroupNormalization")
    axes = _norm_axes(cfg.get("axis", -1), len(shape), name)
    c = shape[axes[0]]
    groups = cfg.get("groups", 32)
    if not _pos(groups) or c % groups:
        raise LayerRuleError(f"layer {name!r}: groups {groups!r} must divide the {c} channels")
    params = c * (int(bool(cfg.get("center", True))) + int(bool(cfg.get("scale", True))))
    return Out([tuple(shape)], params, 0, 8 * _prod(shape))


def normalization(name, cfg, ins, kw):
    """The ``Normalization`` preprocessing layer inside a model (keras.applications'
    EfficientNet has one): ``(x - mean) / sqrt(variance)`` per channel with fixed statistics,
    from its config, its saved weights, or (never adapted) 0 and 1. Not trained."""
    shape = _one(name, ins, "Normalization")
    axis = cfg.get("axis", -1)
    axes = _norm_axes(list(axis) if isinstance(axis, (list, tuple)) else axis, len(shape), name)
    c = _prod(shape[a] for a in axes)
    if cfg.get("mean") is not None and cfg.get("variance") is not None:
        return Out([tuple(shape)], 0, 0, 2 * _prod(shape))  # constants, no weights
    return Out([tuple(shape)], 2 * c + 1, 2 * c + 1, 2 * _prod(shape))


def rmsnorm(name, cfg, ins, kw):
    shape = _one(name, ins, "RMSNormalization")
    c = _prod(shape[a] for a in _norm_axes(cfg.get("axis", -1), len(shape), name))
    return Out([tuple(shape)], c, 0, 4 * _prod(shape))


# --------------------------------------------------------------------------------------------
# reshaping


def flatten(name, cfg, ins, kw):
    shape = _one(name, ins, "Flatten")
    return Out([(_prod(shape),)])


def reshape(name, cfg, ins, kw):
    shape = _one(name, ins, "Reshape")
    target = cfg.get("target_shape")
    if not isinstance(target, (list, tuple)) or not target:
        raise LayerRuleError(f"layer {name!r} has a bad target_shape {target!r}")
    total = _prod(shape)
    unknown = [i for i, d in enumerate(target) if d in (-1, None)]
    known = [d for d in target if d not in (-1, None)]
    if len(unknown) > 1 or not all(_pos(d) for d in known):
        raise LayerRuleError(f"layer {name!r} has a bad target_shape {target!r}")
    kp = _prod(known)
    if unknown:
        if total % kp:
            raise LayerRuleError(f"layer {name!r} cannot reshape {list(shape)} into {target}")
        target = [total // kp if d in (-1, None) else d for d in target]
    out = tuple(int(d) for d in target)
    if _prod(out) != total:
        raise LayerRuleError(f"layer {name!r} cannot reshape {list(shape)} ({total} values) "
                             f"into {list(out)}")
    return Out([out])


def permute(name, cfg, ins, kw):
    shape = _one(name, ins, "Permute")
    dims = cfg.get("dims")
    if not isinstance(dims, (list, tuple)) or sorted(dims) != list(range(1, len(shape) + 1)):
        raise LayerRuleError(f"layer {name!r} has bad dims {dims!r} for input {list(shape)}")
    return Out([tuple(shape[d - 1] for d in dims)], flops=_prod(shape))


def repeat_vector(name, cfg, ins, kw):
    shape = _one(name, ins, "RepeatVector")
    n = cfg.get("n")
    if len(shape) != 1 or not _pos(n):
        raise LayerRuleError(f"layer {name!r} repeats a vector (features,) n >= 1 times; got "
                             f"input {list(shape)}, n {n!r}")
    return Out([(n, shape[0])])


def resizing(name, cfg, ins, kw):
    shape = _one(name, ins, "Resizing")
    dims, c, cf = _spatial(name, cfg, shape, 2, "Resizing")
    h, w = cfg.get("height"), cfg.get("width")
    if not _pos(h) or not _pos(w):
        raise LayerRuleError(f"layer {name!r} needs positive height and width")
    out = _join((h, w), c, cf)
    return Out([out], flops=4 * _prod(out))


def center_crop(name, cfg, ins, kw):
    shape = _one(name, ins, "CenterCrop")
    dims, c, cf = _spatial(name, cfg, shape, 2, "CenterCrop")
    h, w = cfg.get("height"), cfg.get("width")
    if not _pos(h) or not _pos(w):
        raise LayerRuleError(f"layer {name!r} needs positive height and width")
    return Out([_join((h, w), c, cf)])


# --------------------------------------------------------------------------------------------
# merging


def _broadcast(name: str, shapes: list[Shape]) -> Shape:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = {s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise LayerRuleError(f"layer {name!r} merges inputs of incompatible shapes "
                                 f"{[list(s) for s in shapes]}")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def merge(kind: str):
    def rule(name, cfg, ins, kw):
        if len(ins) < 2 or (kind == "Subtract" and len(ins) != 2):
            raise LayerRuleError(f"layer {name!r} ({kind}) needs "
                                 f"{'two' if kind == 'Subtract' else 'at least two'} inputs, "
                                 f"got {len(ins)}")
        out = _broadcast(name, ins)
        return Out([out], flops=(len(ins) - 1) * _prod(out))
    return rule


def concatenate(name, cfg, ins, kw):
    if len(ins) < 2:
        raise LayerRuleError(f"layer {name!r} (Concatenate) needs at least two inputs")
    rank = len(ins[0])
    axis = cfg.get("axis", -1)
    if any(len(s) != rank for s in ins) or not isinstance(axis, int) \
            or not -rank - 1 <= axis <= rank or axis == 0:
        raise LayerRuleError(f"layer {name!r} cannot concatenate {[list(s) for s in ins]} on "
                             f"axis {axis!r}")
    a = axis - 1 if axis > 0 else rank + axis
    for s in ins[1:]:
        if any(s[i] != ins[0][i] for i in range(rank) if i != a):
            raise LayerRuleError(f"layer {name!r} cannot concatenate {[list(s) for s in ins]} "
                                 f"on axis {axis}")
    out = list(ins[0])
    out[a] = sum(s[a] for s in ins)
    return Out([tuple(out)])


def dot(name, cfg, ins, kw):
    if len(ins) != 2:
        raise LayerRuleError(f"layer {name!r} (Dot) needs two inputs")
    axes = cfg.get("axes")
    a, b = ins
    pair = axes if isinstance(axes, (list, tuple)) else [axes, axes]
    if len(pair) != 2 or not all(isinstance(x, int) for x in pair):
        raise LayerRuleError(f"layer {name!r} has bad axes {axes!r}")
    ia = (pair[0] - 1) if pair[0] > 0 else len(a) + pair[0]
    ib = (pair[1] - 1) if pair[1] > 0 else len(b) + pair[1]
    if not (0 <= ia < len(a) and 0 <= ib < len(b)) or a[ia] != b[ib]:
        raise LayerRuleError(f"layer {name!r} cannot dot {list(a)} and {list(b)} on axes {axes}")
    out = tuple(d for i, d in enumerate(a) if i != ia) + tuple(d for i, d in enumerate(b) if i != ib)
    out = out or (1,)
    return Out([out], flops=2 * _prod(out) * a[ia])


# --------------------------------------------------------------------------------------------
# recurrent and attention


_GATES = {"SimpleRNN": 1, "GRU": 3, "LSTM": 4}


def _rnn_params(kind: str, cfg: dict, features: int) -> tuple[int, int]:
    units = cfg.get("units")
    g = _GATES[kind]
    bias = 0
    if cfg.get("use_bias", True):
        bias = g * units * (2 if kind == "GRU" and cfg.get("reset_after", True) else 1)
    return g * units * (features + units) + bias, units


def rnn(kind: str):
    def rule(name, cfg, ins, kw):
        shape = ins[0] if ins else None
        if shape is None or len(shape) != 2:
            raise LayerRuleError(f"layer {name!r} ({kind}) needs (timesteps, features) inputs, "
                                 f"got {list(shape) if shape else None}")
        units = cfg.get("units")
        if not _pos(units):
            raise LayerRuleError(f"layer {name!r} has bad units {units!r}")
        steps, feats = shape
        params, _ = _rnn_params(kind, cfg, feats)
        seq = (steps, units) if cfg.get("return_sequences") else (units,)
        outs = [seq]
        if cfg.get("return_state"):
            outs += [(units,)] * (2 if kind == "LSTM" else 1)
        g = _GATES[kind]
        flops = steps * 2 * g * units * (feats + units)
        # kept per step for the backward pass: the state(s) (the memory zoo's stacked LSTM: the
        # peak grew by about this much per example, far less than every gate of every step)
        internal = steps * (2 if kind == "LSTM" else 1) * units
        # and, whatever the batch, each step's share of the kernels' gradient until the loop's
        # backward pass sums them: a stacked LSTM peaked ~20 MB at 16 and 128 examples alike
        return Out(outs, params, 0, flops, internal,
                   extra={"kernel": g * units * max(feats, units), "workspace": 4 * steps * params})
    return rule


def bidirectional(name, cfg, ins, kw):
    inner = cfg.get("layer")
    if not isinstance(inner, dict) or inner.get("class_name") not in _GATES:
        raise LayerRuleError(f"layer {name!r} (Bidirectional) wraps "
                             f"{inner.get('class_name') if isinstance(inner, dict) else inner!r}; "
                             f"supported: {', '.join(_GATES)}")
    kind = inner["class_name"]
    icfg = inner.get("config") or {}
    back = cfg.get("backward_layer")
    if back is not None and (not isinstance(back, dict) or back.get("class_name") != kind):
        raise LayerRuleError(f"layer {name!r} (Bidirectional) needs a backward layer of the same "
                             "kind")
    fwd = rnn(kind)(name, icfg, ins, kw)
    bcfg = (back.get("config") if back else None) or icfg
    bwd = rnn(kind)(name, bcfg, ins, kw)
    mode = cfg.get("merge_mode", "concat")
    fo, bo = fwd.outputs[0], bwd.outputs[0]
    if mode == "concat":
        outs = [fo[:-1] + (fo[-1] + bo[-1],)]
    elif mode in ("sum", "ave", "mul"):
        outs = [fo]
    elif mode is None:
        outs = [fo, bo]
    else:
        raise LayerRuleError(f"layer {name!r} has an unknown merge_mode {mode!r}")
    if icfg.get("return_state"):
        outs += fwd.outputs[1:] + bwd.outputs[1:]
    return Out(outs, fwd.params + bwd.params, 0, fwd.flops + bwd.flops,
               fwd.internal_elems + bwd.internal_elems + _prod(fo) + _prod(bo),
               extra={"kernel": max(fwd.extra["kernel"], bwd.extra["kernel"]),
                      "workspace": fwd.extra["workspace"] + bwd.extra["workspace"]})


def multi_head_attention(name, cfg, ins, kw):
    if not ins:
        raise LayerRuleError(f"layer {name!r} (MultiHeadAttention) has no query input")
    q = ins[0]
    v = ins[1] if len(ins) > 1 else kw.get("value")
    k = ins[2] if len(ins) > 2 else kw.get("key", v)
    if v is None:
        raise LayerRuleError(f"layer {name!r} (MultiHeadAttention) has no value input")
    k = k if k is not None else v
    heads, kd = cfg.get("num_heads"), cfg.get("key_dim")
    vd = cfg.get("value_dim") or kd
    if not _pos(heads) or not _pos(kd) or not _pos(vd):
        raise LayerRuleError(f"layer {name!r} needs positive num_heads and key_dim")
    if len(q) < 2 or len(v) < 2 or len(k) < 2:
        raise LayerRuleError(f"layer {name!r} needs (sequence, features) inputs, got "
                             f"{list(q)}, {list(v)}")
    if cfg.get("attention_axes") not in (None, [], ()):
        axes = cfg.get("attention_axes")
        if list(axes) not in ([len(q) - 1], [-2]):
            raise LayerRuleError(f"layer {name!r}: attention_axes {axes!r} is not supported "
                                 "(attention over the sequence axis only)")
    out_shape = cfg.get("output_shape")
    if out_shape is None:
        out_dims: tuple[int, ...] = (q[-1],)
    elif _pos(out_shape):
        out_dims = (int(out_shape),)
    elif isinstance(out_shape, (list, tuple)) and all(_pos(x) for x in out_shape):
        out_dims = tuple(int(x) for x in out_shape)
    else:
        raise LayerRuleError(f"layer {name!r} has a bad output_shape {out_shape!r}")
    b = 1 if cfg.get("use_bias", True) else 0
    params = (q[-1] * heads * kd + b * heads * kd) + (k[-1] * heads * kd + b * heads * kd) \
        + (v[-1] * heads * vd + b * heads * vd) + (heads * vd * _prod(out_dims)
                                                   + b * _prod(out_dims))
    tq, tk = _prod(q[:-1]), _prod(v[:-1])
    out = tuple(q[:-1]) + out_dims
    outs = [out]
    if cfg.get("_return_scores"):  # not serialized: scores are a call argument
        outs.append((heads, tq, tk))
    scores = heads * tq * tk
    internal = tq * heads * kd + tk * heads * (kd + vd) + 3 * scores + tq * heads * vd
    flops = 2 * (tq * q[-1] * heads * kd + tk * k[-1] * heads * kd + tk * v[-1] * heads * vd
                 + scores * (kd + vd) + tq * heads * vd * _prod(out_dims))
    return Out(outs, params, 0, flops, internal,
               extra={"kernel": max(q[-1], k[-1], v[-1]) * heads * max(kd, vd)})


def attention(kind: str):
    def rule(name, cfg, ins, kw):
        if len(ins) < 2:
            raise LayerRuleError(f"layer {name!r} ({kind}) needs [query, value] inputs")
        q, v = ins[0], ins[1]
        if len(q) != 2 or len(v) != 2:
            raise LayerRuleError(f"layer {name!r} ({kind}) needs (sequence, features) inputs")
        params = 0
        if kind == "AdditiveAttention" and cfg.get("use_scale", True):
            params = q[-1]
        elif kind == "Attention" and cfg.get("use_scale"):
            params = 1
        if kind == "Attention" and cfg.get("score_mode") == "concat":
            params += 1
        scores = q[0] * v[0]
        return Out([tuple(q[:-1]) + (v[-1],)], params, 0, 2 * scores * (q[-1] + v[-1]),
                   3 * scores)
    return rule


def time_distributed(name, cfg, ins, kw):
    inner = cfg.get("layer")
    shape = _one(name, ins, "TimeDistributed")
    if not isinstance(inner, dict) or len(shape) < 2:
        raise LayerRuleError(f"layer {name!r} (TimeDistributed) needs a layer and a time axis")
    kind = inner.get("class_name")
    fn = RULES.get(str(kind))
    if fn is None:
        raise LayerRuleError(f"layer {name!r} (TimeDistributed) wraps unsupported {kind!r}")
    o = fn(name, inner.get("config") or {}, [tuple(shape[1:])], {})
    steps = shape[0]
    return Out([(steps,) + tuple(s) for s in o.outputs], o.params, o.non_trainable,
               steps * o.flops, steps * o.internal_elems, extra=o.extra)


# --------------------------------------------------------------------------------------------
# the table

#: paramless layers whose output has their input's shape
SHAPE_PRESERVING = (
    "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax", "Dropout", "SpatialDropout1D",
    "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise", "GaussianDropout", "AlphaDropout",
    "ActivityRegularization", "Identity", "Masking", "UnitNormalization", "Rescaling",
    "RandomFlip", "RandomRotation", "RandomZoom", "RandomTranslation", "RandomContrast",
    "RandomBrightness",
)

RULES: dict[str, Callable[..., Out]] = {
    "Dense": dense, "Embedding": embedding, "PReLU": prelu,
    "Conv1D": conv(1, "Conv1D"), "Conv2D": conv(2, "Conv2D"), "Conv3D": conv(3, "Conv3D"),
    "Conv1DTranspose": conv_transpose(1, "Conv1DTranspose"),
    "Conv2DTranspose": conv_transpose(2, "Conv2DTranspose"),
    "Conv3DTranspose": conv_transpose(3, "Conv3DTranspose"),
    "DepthwiseConv1D": depthwise(1, "DepthwiseConv1D"),
    "DepthwiseConv2D": depthwise(2, "DepthwiseConv2D"),
    "SeparableConv1D": separable(1, "SeparableConv1D"),
    "SeparableConv2D": separable(2, "SeparableConv2D"),
    "MaxPooling1D": pool(1, "MaxPooling1D"), "MaxPooling2D": pool(2, "MaxPooling2D"),
    "MaxPooling3D": pool(3, "MaxPooling3D"),
    "AveragePooling1D": pool(1, "AveragePooling1D"),
    "AveragePooling2D": pool(2, "AveragePooling2D"),
    "AveragePooling3D": pool(3, "AveragePooling3D"),
    "GlobalAveragePooling1D": global_pool(1, "GlobalAveragePooling1D"),
    "GlobalAveragePooling2D": global_pool(2, "GlobalAveragePooling2D"),
    "GlobalAveragePooling3D": global_pool(3, "GlobalAveragePooling3D"),
    "GlobalMaxPooling1D": global_pool(1, "GlobalMaxPooling1D"),
    "GlobalMaxPooling2D": global_pool(2, "GlobalMaxPooling2D"),
    "GlobalMaxPooling3D": global_pool(3, "GlobalMaxPooling3D"),
    "AdaptiveAveragePooling1D": adaptive_pool(1, "AdaptiveAveragePooling1D"),
    "AdaptiveAveragePooling2D": adaptive_pool(2, "AdaptiveAveragePooling2D"),
    "AdaptiveAveragePooling3D": adaptive_pool(3, "AdaptiveAveragePooling3D"),
    "AdaptiveMaxPooling1D": adaptive_pool(1, "AdaptiveMaxPooling1D"),
    "AdaptiveMaxPooling2D": adaptive_pool(2, "AdaptiveMaxPooling2D"),
    "AdaptiveMaxPooling3D": adaptive_pool(3, "AdaptiveMaxPooling3D"),
    "UpSampling1D": upsampling(1, "UpSampling1D"), "UpSampling2D": upsampling(2, "UpSampling2D"),
    "UpSampling3D": upsampling(3, "UpSampling3D"),
    "Cropping1D": cropping(1, "Cropping1D"), "Cropping2D": cropping(2, "Cropping2D"),
    "Cropping3D": cropping(3, "Cropping3D"),
    "ZeroPadding1D": zeropad(1, "ZeroPadding1D"), "ZeroPadding2D": zeropad(2, "ZeroPadding2D"),
    "ZeroPadding3D": zeropad(3, "ZeroPadding3D"),
    "BatchNormalization": batchnorm, "LayerNormalization": layernorm,
    "GroupNormalization": groupnorm, "RMSNormalization": rmsnorm,
    "Normalization": normalization,
    "Flatten": flatten, "Reshape": reshape, "Permute": permute, "RepeatVector": repeat_vector,
    "Resizing": resizing, "CenterCrop": center_crop,
    "Add": merge("Add"), "Subtract": merge("Subtract"), "Multiply": merge("Multiply"),
    "Average": merge("Average"), "Maximum": merge("Maximum"), "Minimum": merge("Minimum"),
    "Concatenate": concatenate, "Dot": dot,
    "SimpleRNN": rnn("SimpleRNN"), "GRU": rnn("GRU"), "LSTM": rnn("LSTM"),
    "Bidirectional": bidirectional,
    "MultiHeadAttention": multi_head_attention,
    "Attention": attention("Attention"), "AdditiveAttention": attention("AdditiveAttention"),
    "TimeDistributed": time_distributed,
}
for _kind in SHAPE_PRESERVING:
    RULES[_kind] = elementwise(_kind, 0 if _kind in (
        "Identity", "Masking", "ActivityRegularization") else 1)

#: refused with a reason of their own
REFUSED = {
    "Lambda": "Lambda layers run arbitrary code; use `code:` (users' own code) instead",
    "TFSMLayer": "it wraps a SavedModel's code",
    "JaxLayer": "it wraps JAX code", "FlaxLayer": "it wraps Flax code",
    "TorchModuleWrapper": "it wraps PyTorch code",
    "TextVectorization": "stateful preprocessing belongs in the input pipeline (`code.dataset`)",
    "StringLookup": "stateful preprocessing belongs in the input pipeline (`code.dataset`)",
    "IntegerLookup": "stateful preprocessing belongs in the input pipeline (`code.dataset`)",
    "Hashing": "preprocessing belongs in the input pipeline (`code.dataset`)",
    "HashedCrossing": "preprocessing belongs in the input pipeline (`code.dataset`)",
    "Discretization": "preprocessing belongs in the input pipeline (`code.dataset`)",
    "CategoryEncoding": "preprocessing belongs in the input pipeline (`code.dataset`)",
    "ConvLSTM1D": "convolutional recurrent layers are not supported yet",
    "ConvLSTM2D": "convolutional recurrent layers are not supported yet",
    "ConvLSTM3D": "convolutional recurrent layers are not supported yet",
    "RNN": "a generic RNN over a cell; use SimpleRNN, GRU or LSTM",
    "EinsumDense": "not supported yet",
}


def rule_for(kind: str) -> Callable[..., Out] | None:
    return RULES.get(kind)
