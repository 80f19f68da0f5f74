"""Sizes in bytes: the units, and the one parser and printer of memory sizes every field,
flag and table uses."""

from __future__ import annotations

import math
import re
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
    "t": 1000 ** 4, "tb": 1000 ** 4,
    "ki": KiB, "kib": KiB, "mi": MiB, "mib": MiB, "gi": GiB, "gib": GiB,
    "ti": TiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: Any) -> int:
    """Parses a memory size: plain bytes ("123"), decimal units ("1.5GB", "100MB", "10kB":
    powers of 1000) or binary units ("512MiB", "2GiB", "1KiB": powers of 1024); units are
    case-insensitive, the "B" optional ("2Gi"). Returns whole bytes (rounded down).
    Raises ValueError with a clear message otherwise."""
    if isinstance(text, bool):
        raise ValueError(f"not a memory size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"memory size must not be negative: {text}")
        return text
    if isinstance(text, float):
        if not math.isfinite(text) or text < 0:
            raise ValueError(f"not a memory size: {text!r}")
        return int(text)
    if not isinstance(text, str):
        raise ValueError(f"not a memory size: {text!r}")
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 512MiB, 2GiB, 1.5GB, 100MB or "
                         "a plain number of bytes)")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {m.group(2)!r} in {text!r} (use B, KB, MB, GB, TB "
                         "or KiB, MiB, GiB, TiB)")
    if unit in ("", "b") and "." in number:
        raise ValueError(f"a size in bytes must be a whole number: {text!r}")
    value = float(number) * _UNITS[unit]
    if value != value or value > 1 << 62:
        raise ValueError(f"memory size out of range: {text!r}")
    return int(value)


def format_size(n: int | float) -> str:
    """Human-readable binary size: "512 B", "1.5 KiB", "40.2 MiB", "1.5 GiB", "2 GiB"
    (one decimal, dropped when it is 0)."""
    n = int(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < KiB:
        return f"{sign}{n} B"
    units = (("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("TiB", TiB))
    for i, (unit, size) in enumerate(units):
        text = f"{n / size:.1f}"
        if float(text) < 1024 or i == len(units) - 1:
            if text.endswith(".0"):
                text = text[:-2]
            return f"{sign}{text} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def parse_duration(text: str) -> float:
    """Seconds of ``7d``, ``12h``, ``30m``, ``45s`` or plain seconds. Raises ``ValueError``."""
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    t = str(text).strip().lower()
    scale = units.get(t[-1:], 0.0)
    number = t[:-1] if scale else t
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e10 or value != value:
        raise ValueError(f"{str(text)[:32]!r}: a duration such as 7d, 12h, 30m or seconds")
    return value
