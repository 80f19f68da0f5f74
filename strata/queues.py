"""The queues of a shared cluster: the admin's file (``strata coordinator --queues FILE``,
reloaded on SIGHUP), parsed and checked, each error naming its field.

```yaml
queues:
  - name: research
    members: [alice, group:vision]        # token NAMEs, groups; "*": everyone not elsewhere
    nominal: {workers: 2, memory: 2GiB}   # the share it is entitled to
    borrow: {workers: 2, memory: 2GiB}    # idle room it may use beyond it
    default: true                         # the queue of jobs that name none
priority_classes: {low: 0, normal: 100, high: 1000}
fair_share_half_life: 1h
```

A job names its queue (``queue:``; else its owner's: the queue listing the owner by NAME, else
the first listing one of its groups (``group:NAME``: the token file's ``TOKEN ROLE NAME
GROUPS``), else the one with ``"*"``, else the ``default``), and a priority class (``priority:``; else
``DEFAULT_PRIORITY`` when the file has that class, else the lowest). Without a file the cluster
is one queue, ``default``, everyone's, unbounded. Pure: no coordinator state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable, Mapping

from strata import safeyaml
from strata.units import parse_size

#: the priority class of a job that names none, when the file defines it
DEFAULT_PRIORITY = "normal"
#: the classes of a cluster without a queues file
DEFAULT_CLASSES: Mapping[str, int] = {"low": 0, "normal": 100, "high": 1000}
DEFAULT_HALF_LIFE_S = 3600.0
EVERYONE = "*"
#: a member that names a group of the token file (``TOKEN ROLE NAME GROUPS``), not a NAME
GROUP = "group:"
#: a share with no bound (a queue without ``nominal``, the cluster without a file)
UNBOUNDED = 1 << 62


class QueueError(ValueError):
    """A queues file, or a job's queue or priority, that cannot be used: ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class Share:
    """Room in workers (whole agents' worth of tasks) and memory budget bytes."""

    workers: int = 0
    memory_bytes: int = 0

    def __add__(self, other: "Share") -> "Share":
        return Share(self.workers + other.workers, self.memory_bytes + other.memory_bytes)

    def within(self, other: "Share") -> bool:
        return self.workers <= other.workers and self.memory_bytes <= other.memory_bytes

    def to_json(self) -> dict[str, int | None]:
        return {"workers": None if self.workers >= UNBOUNDED else self.workers,
                "memory_bytes": None if self.memory_bytes >= UNBOUNDED else self.memory_bytes}


ALL = Share(UNBOUNDED, UNBOUNDED)
NONE = Share(0, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class Queue:
    name: str
    members: tuple[str, ...] = (EVERYONE,)
    nominal: Share = ALL
    borrow: Share = NONE
    default: bool = False

    @property
    def limit(self) -> Share:
        """The most it may hold: its nominal share and what it may borrow."""
        return Share(min(UNBOUNDED, self.nominal.workers + self.borrow.workers),
                     min(UNBOUNDED, self.nominal.memory_bytes + self.borrow.memory_bytes))


@dataclasses.dataclass(frozen=True)
class Queues:
    queues: tuple[Queue, ...] = (Queue("default", default=True),)
    priority_classes: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_CLASSES))
    fair_share_half_life_s: float = DEFAULT_HALF_LIFE_S

    def get(self, name: str) -> Queue | None:
        return self._by_name.get(name)

    @functools.cached_property
    def _by_name(self) -> dict[str, Queue]:
        """(looked up for every waiting job at every pass: a dict, not a walk)"""
        return {q.name: q for q in self.queues}

    def queue_of(self, owner: str, asked: str = "", groups: Iterable[str] = ()) -> Queue:
        """The queue a job of ``owner`` (in ``groups``, from the token file) runs in: the one
        it names (``asked``), which must list the owner or one of its groups (or everyone);
        else the queue listing the owner by name, else the first listing one of its groups
        (``group:NAME``), else everyone's, else the default. Raises ``QueueError`` (field
        ``queue``)."""
        tags = [GROUP + g for g in groups]
        if asked:
            q = self.get(asked)
            if q is None:
                raise QueueError("queue", f"no queue {asked!r} (queues: "
                                          f"{', '.join(x.name for x in self.queues)})")
            if not self.admits(q, owner, tags):
                raise QueueError("queue", f"{owner or 'an anonymous caller'} is not a member of "
                                          f"queue {asked!r}")
            return q
        mine = next((q for q in self.queues if owner and owner in q.members), None) or next(
            (q for q in self.queues if any(t in q.members for t in tags)), None)
        anyone = next((q for q in self.queues if EVERYONE in q.members), None)
        default = next((q for q in self.queues if q.default), None)
        q = mine or anyone or default
        if q is None:
            raise QueueError("queue", f"{owner or 'an anonymous caller'} is in no queue and "
                                      "there is no default queue")
        return q

    def admits(self, q: Queue, owner: str, tags: Iterable[str] = ()) -> bool:
        """Whether ``owner`` (with its groups as ``group:NAME`` ``tags``) may submit into
        ``q``: a member, by name or group, or ``q`` is everyone's, or the default of one in
        no other queue."""
        mine = {owner, *tags} if owner else set(tags)
        return EVERYONE in q.members or bool(mine.intersection(q.members)) or (
            q.default and not any(mine.intersection(x.members)
                                  for x in self.queues if x is not q))

    def priority_of(self, name: str) -> tuple[str, int]:
        """The class a job runs at, and its value. Raises ``QueueError`` (field ``priority``)."""
        if not name:
            if DEFAULT_PRIORITY in self.priority_classes:
                return DEFAULT_PRIORITY, self.priority_classes[DEFAULT_PRIORITY]
            low = min(self.priority_classes.items(), key=lambda kv: kv[1])
            return low[0], low[1]
        if name not in self.priority_classes:
            raise QueueError("priority", f"no priority class {name!r} (classes: "
                                         f"{', '.join(sorted(self.priority_classes))})")
        return name, self.priority_classes[name]


@dataclasses.dataclass(frozen=True)
class QueueView:
    """One queue as ``strata queues`` shows it."""

    name: str
    nominal: Share
    borrow: Share
    in_use: Share
    waiting: int
    running: int
    default: bool

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "nominal": self.nominal.to_json(),
                "borrow": self.borrow.to_json(), "in_use": self.in_use.to_json(),
                "borrowed": max(0, self.in_use.workers - self.nominal.workers),
                "waiting": self.waiting, "running": self.running, "default": self.default}


def parse_queues(text: str, source: str = "queues file") -> Queues:
    """The queues of ``text`` (YAML). Raises ``QueueError`` naming the field."""
    try:
        raw = safeyaml.load(text, source)
    except safeyaml.YamlRefused as e:
        raise QueueError("queues", str(e)) from None
    except Exception as e:  # a YAML syntax error: its line and column
        raise QueueError("queues", f"not YAML: {e}") from None
    if not isinstance(raw, Mapping):
        raise QueueError("queues", "must be a mapping with a list under queues:")
    unknown = set(raw) - {"queues", "priority_classes", "fair_share_half_life"}
    if unknown:
        raise QueueError(str(sorted(unknown)[0]), "unknown field (known: queues, "
                                                  "priority_classes, fair_share_half_life)")
    items = raw.get("queues")
    if not isinstance(items, list) or not items:
        raise QueueError("queues", "must be a non-empty list of queues")
    queues = tuple(_queue(q, f"queues[{i}]") for i, q in enumerate(items))
    names = [q.name for q in queues]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise QueueError(f"queues[{i}].name", f"{name!r} is named twice")
    if sum(q.default for q in queues) > 1:
        raise QueueError("queues", "more than one queue is the default")
    seen: dict[str, str] = {}
    for i, q in enumerate(queues):
        for m in q.members:
            if m != EVERYONE and m in seen:
                raise QueueError(f"queues[{i}].members", f"{m!r} is a member of queue "
                                                         f"{seen[m]!r} already")
            seen[m] = q.name
    classes = _classes(raw.get("priority_classes"))
    return Queues(queues, classes, _half_life(raw.get("fair_share_half_life")))


def _queue(raw: Any, field: str) -> Queue:
    if not isinstance(raw, Mapping):
        raise QueueError(field, "must be a mapping (name, members, nominal, borrow, default)")
    unknown = set(raw) - {"name", "members", "nominal", "borrow", "default"}
    if unknown:
        raise QueueError(f"{field}.{sorted(unknown)[0]}", "unknown field (known: name, "
                                                          "members, nominal, borrow, default)")
    name = raw.get("name")
    if not isinstance(name, str) or not name or len(name) > 64 or not all(
            c.isalnum() or c in "-_." for c in name):
        raise QueueError(f"{field}.name", "must be 1-64 characters of letters, digits, - _ .")
    members = raw.get("members", [])
    if not isinstance(members, list) or not all(isinstance(m, str) and m for m in members):
        raise QueueError(f"{field}.members", "must be a list of token NAMEs (or \"*\")")
    default = raw.get("default", False)
    if not isinstance(default, bool):
        raise QueueError(f"{field}.default", f"must be true or false, got {default!r}")
    nominal = _share(raw.get("nominal"), f"{field}.nominal", ALL)
    return Queue(name=name, members=tuple(members), nominal=nominal,
                 borrow=_share(raw.get("borrow"), f"{field}.borrow", NONE), default=default)


def _share(raw: Any, field: str, absent: Share) -> Share:
    if raw is None:
        return absent
    if not isinstance(raw, Mapping):
        raise QueueError(field, "must be a mapping {workers: N, memory: SIZE}")
    unknown = set(raw) - {"workers", "memory"}
    if unknown:
        raise QueueError(f"{field}.{sorted(unknown)[0]}", "unknown field (known: workers, "
                                                          "memory)")
    workers = raw.get("workers", UNBOUNDED if absent is ALL else 0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise QueueError(f"{field}.workers", f"must be a whole number >= 0, got {workers!r}")
    memory = raw.get("memory")
    if memory is None:
        mem = UNBOUNDED if absent is ALL else 0
    else:
        try:
            mem = parse_size(memory)
        except ValueError as e:
            raise QueueError(f"{field}.memory", str(e)) from None
        if mem < 0:
            raise QueueError(f"{field}.memory", "must not be negative")
    return Share(workers, mem)


def _classes(raw: Any) -> Mapping[str, int]:
    if raw is None:
        return dict(DEFAULT_CLASSES)
    if not isinstance(raw, Mapping) or not raw:
        raise QueueError("priority_classes", "must be a mapping of class names to integers")
    out = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not k:
            raise QueueError("priority_classes", f"class names are text, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, int):
            raise QueueError(f"priority_classes.{k}", f"must be an integer, got {v!r}")
        out[k] = v
    return out


def _half_life(raw: Any) -> float:
    if raw is None:
        return DEFAULT_HALF_LIFE_S
    from strata.units import parse_duration

    try:
        s = parse_duration(str(raw))
    except ValueError as e:
        raise QueueError("fair_share_half_life", str(e)) from None
    if not math.isfinite(s) or s <= 0:
        raise QueueError("fair_share_half_life", f"must be a positive duration, got {raw!r}")
    return s


def load_queues(path: str) -> Queues:
    """The queues file at ``path``. Raises ``QueueError`` naming the file and the field."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except OSError as e:
        raise QueueError("--queues", f"cannot read {path}: {e.strerror or e}") from None
    try:
        return parse_queues(text, path)
    except QueueError as e:
        raise QueueError(e.field, f"{e.message} (in {path})") from None
