"""The strategy registry: every distribution strategy Strata runs, by the name a job spec uses.

The built-in strategies are one module each in this package. Another strategy plugs in by adding
one module with a ``Strategy`` subclass decorated with ``@register`` (imported by this package,
or by an installed distribution through the ``strata.strategies`` entry point group): nothing
else in the code base names strategies. ``docs/strategies.md`` walks through adding one.
"""

from __future__ import annotations

from typing import TypeVar

from strata.errors import SpecError
from strata.strategies.base import (
    EndDecision, FailureAction, FailureDecision, Strategy, budget_for, describe_failure,
    offer_for_estimate, too_big,
)

__all__ = [
    "DEFAULT", "Strategy", "FailureAction", "FailureDecision", "EndDecision", "register", "get", "names",
    "budget_for", "describe_failure", "offer_for_estimate", "too_big",
]

#: the strategy of a spec that names none
DEFAULT = "multi_worker_mirrored"

_REGISTRY: dict[str, Strategy] = {}
S = TypeVar("S", bound=type[Strategy])


def register(cls: S) -> S:
    """Class decorator: makes a strategy available under ``cls.name``."""
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name`")
    if name in _REGISTRY and type(_REGISTRY[name]) is not cls:
        raise ValueError(f"strategy {name!r} is registered twice "
                         f"({type(_REGISTRY[name]).__name__} and {cls.__name__})")
    _REGISTRY[name] = cls()
    return cls


def unregister(name: str) -> None:
    """Removes a strategy (for tests that register their own)."""
    _REGISTRY.pop(name, None)


def get(name: str) -> Strategy:
    """The strategy called ``name``; ``SpecError`` on field ``strategy`` when there is none."""
    _load()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise SpecError("strategy", f"must be one of {', '.join(names())}; got {name!r}") from None


def names() -> list[str]:
    _load()
    return list(_REGISTRY)


def elastic_names() -> list[str]:
    """The strategies whose jobs may take ``workers: {min, max}``."""
    return [n for n in names() if _REGISTRY[n].elastic]


def all_strategies() -> list[Strategy]:
    _load()
    return list(_REGISTRY.values())


def all_fields() -> list[str]:
    """Every strategy-specific spec field (dotted, as ``JobSpec`` attributes), in a fixed order."""
    _load()
    return sorted({f for s in _REGISTRY.values() for f in s.fields})


def users_of(field: str) -> list[str]:
    """The strategies that take the optional spec field ``field``."""
    _load()
    return [n for n, s in _REGISTRY.items() if field in s.fields]


_loaded = False


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    import pkgutil
    from importlib.metadata import entry_points

    # the built-in strategies first, in the order users read them; then any other module of
    # this package (a strategy added as one file), then installed ones (entry points)
    first = ["mirrored", "parameter_server", "pipeline", "hybrid"]
    found = [m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"]
    for name in first + sorted(set(found) - set(first)):
        importlib.import_module(f"{__name__}.{name}")
    for ep in entry_points(group="strata.strategies"):
        ep.load()  # its module registers itself
