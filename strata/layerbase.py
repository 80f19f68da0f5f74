"""What the layer rules of ``strata.layers`` are made of: a rule's result (``Out``), its error
(``LayerRuleError``), shape arithmetic, and readers of a layer config's arguments (integer
tuples, paddings, spatial axes and channels, window lengths, activations, quantization).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Shape = tuple[int, ...]

__all__ = ["Out", "LayerRuleError", "Shape", "activation_name"]


class LayerRuleError(Exception):
    """A layer config the rules cannot accept; the message names the layer."""


@dataclass
class Out:
    outputs: list[Shape]
    params: int = 0
    non_trainable: int = 0
    flops: int = 0
    internal_elems: int = 0
    extra: dict = field(default_factory=dict)


def _prod(xs: Any) -> int:
    p = 1
    for x in xs:
        p *= int(x)
    return p


def _pos(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _one(name: str, ins: list[Shape], kind: str) -> Shape:
    if len(ins) != 1:
        raise LayerRuleError(f"layer {name!r} ({kind}) takes one input, got {len(ins)}")
    return ins[0]


def activation_name(cfg: dict) -> str:
    """A layer config's activation function by name ("linear" when it has none)."""
    a = cfg.get("activation", "linear")
    if a is None:
        return "linear"
    if isinstance(a, dict):
        c = a.get("config")
        return c if isinstance(c, str) else str(a.get("class_name"))
    return str(a)


def _act_flops(cfg: dict, n: int) -> int:
    return 0 if activation_name(cfg) == "linear" else n


def _tuple(v: Any, n: int, name: str, what: str, allow_zero: bool = False) -> tuple[int, ...]:
    ok = (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0) if allow_zero \
        else _pos
    if ok(v):
        return (int(v),) * n
    if isinstance(v, (list, tuple)) and len(v) == n and all(ok(x) for x in v):
        return tuple(int(x) for x in v)
    raise LayerRuleError(f"layer {name!r} has a bad {what} {v!r} (expected {n} integer(s))")


def _pads(v: Any, n: int, name: str, what: str) -> list[tuple[int, int]]:
    """Cropping/ZeroPadding amounts: an int, n ints, or n pairs."""
    nonneg = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
    if nonneg(v):
        return [(int(v), int(v))] * n
    if isinstance(v, (list, tuple)):
        if n == 1 and len(v) == 2 and all(nonneg(x) for x in v):
            return [(int(v[0]), int(v[1]))]
        if len(v) == n:
            out = []
            for x in v:
                if nonneg(x):
                    out.append((int(x), int(x)))
                elif isinstance(x, (list, tuple)) and len(x) == 2 and all(nonneg(y) for y in x):
                    out.append((int(x[0]), int(x[1])))
                else:
                    break
            else:
                return out
    raise LayerRuleError(f"layer {name!r} has a bad {what} {v!r}")


def _spatial(name: str, cfg: dict, shape: Shape, rank: int, kind: str):
    """(spatial dims, channels, channels_first) of a rank-``rank`` spatial input."""
    if len(shape) != rank + 1:
        raise LayerRuleError(f"layer {name!r} ({kind}) needs a rank-{rank + 1} input per example "
                             f"({rank} spatial axes and channels), got {list(shape)}")
    if cfg.get("data_format", "channels_last") == "channels_first":
        return tuple(shape[1:]), shape[0], True
    return tuple(shape[:-1]), shape[-1], False


def _join(dims: tuple[int, ...], c: int, cf: bool) -> Shape:
    return (c,) + tuple(dims) if cf else tuple(dims) + (c,)


def _conv_len(n: int, k: int, s: int, padding: str, d: int, name: str) -> int:
    if padding == "same":
        return -(-n // s)
    if padding == "causal":
        return -(-n // s)
    if padding != "valid":
        raise LayerRuleError(f"layer {name!r} has unsupported padding {padding!r}")
    eff = d * (k - 1) + 1
    if n < eff:
        raise LayerRuleError(f"layer {name!r}: window {eff} is larger than its input {n}")
    return (n - eff) // s + 1


def _check_quant(name: str, cfg: dict) -> None:
    if cfg.get("quantization_config") not in (None, {}) or cfg.get("quantization_mode"):
        raise LayerRuleError(f"layer {name!r} is quantized; quantized layers are not supported")
