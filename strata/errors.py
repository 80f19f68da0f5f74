"""Typed errors under one root. Each carries structured fields; the coordinator maps them to gRPC
status codes in exactly one place (``coordinator.rpcguard.status_for``), never by message text."""

from __future__ import annotations


class StrataError(Exception):
    """Root of every error Strata raises on purpose."""


class SpecError(StrataError, ValueError):
    """A job spec field is invalid. ``field`` is the dotted path a user edits (``data.batch_size``):
    data, never parsed back out of the message. A ValueError too, for the pure planners and
    estimators whose callers treat bad arguments as such."""

    #: a message never echoes unbounded input: what a user sent is cut to this
    MAX_MESSAGE_CHARS = 1000

    def __init__(self, field: str, message: str):
        field = field[:200]
        if len(message) > self.MAX_MESSAGE_CHARS:
            message = message[:self.MAX_MESSAGE_CHARS] + "... (cut)"
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class UserCodeRefused(StrataError):
    """A job with users' own code, sent to a coordinator that does not run it."""


class UploadError(StrataError):
    """An upload or output path the coordinator refuses (over its size limit, malformed)."""


class NotFoundError(StrataError):
    def __init__(self, kind: str, name: str):
        super().__init__(f"{kind} {name!r} not found")
        self.kind = kind
        self.name = name


class InfeasibleError(StrataError):
    """No cluster of the registered workers could ever run the job as specified."""

    def __init__(self, message: str, estimate_bytes: int = 0, largest_budget_bytes: int = 0):
        super().__init__(message)
        self.estimate_bytes = estimate_bytes
        self.largest_budget_bytes = largest_budget_bytes


class InvalidTransition(StrataError):
    """A lifecycle change that the transition table forbids (e.g. cancelling a finished job)."""

    def __init__(self, kind: str, current: str, target: str, hint: str = ""):
        super().__init__(f"{kind} cannot go from {current} to {target}"
                         + (f": {hint}" if hint else ""))
        self.kind = kind
        self.current = current
        self.target = target


class NotYours(StrataError):
    """A caller acting on something that is not its own (a task never given to the agent
    reporting it)."""


class UnknownAgentSession(StrataError):
    """An agent called with a session the coordinator does not hold (e.g. after a restart)."""


class DuplicateAgent(StrataError):
    """Another live agent already holds this name (two agents on one host without --name)."""

    def __init__(self, name: str, host: str = "", pid: int = 0):
        # which host and process hold it is not said: that is what a registration must match
        # to be taken for the same agent
        super().__init__(f"worker name {name[:64]!r} is in use by a live agent; give each "
                         "agent its own --name")
        self.name = name


class QuotaExceeded(StrataError):
    """A caller is over one of its limits (pending jobs per user): RESOURCE_EXHAUSTED."""


class DiskFull(StrataError):
    """The coordinator's disk has no room for this write (a file system full, or below the
    room kept for state changes): UNAVAILABLE, naming the place. Reads and cancels go on."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path
