"""What a task's exception was: out of memory (``is_oom``, ``oom_text``), a peer task's failure
seen through a collective (``peer_failure``), and the one-line summary its report carries."""

from __future__ import annotations

import sys



def _resource_exhausted(exc: BaseException) -> BaseException | None:
    """The ResourceExhaustedError in ``exc``'s chain of causes, if any."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return None
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, tf.errors.ResourceExhaustedError):
            return e
        e = e.__cause__ or e.__context__
    return None


def is_oom(exc: BaseException) -> bool:
    return _resource_exhausted(exc) is not None


#: TensorFlow errors that mean a collective or a peer task failed (a dead peer resets the
#: collective's connection: UnavailableError; a hung one times it out: DeadlineExceededError;
#: the coordination service aborts the others' collectives: Unavailable, Aborted, Cancelled)
PEER_ERROR_TYPES = ("DeadlineExceededError", "UnavailableError", "CancelledError", "AbortedError")


#: what their text says when TensorFlow wraps them in another type (lower case)
PEER_ERROR_TEXT = (
    "collective ops is aborted", "collective has timed out", "stopped sending heartbeats",
    "the tasks have crashed", "connection reset by peer", "failed to connect to all addresses",
    "socket closed", "deadline exceeded", "is unreachable",
)


def peer_failure(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain of causes that says a collective or a peer task failed
    (``PEER_ERROR_TYPES``, or an error whose text says so), if any."""
    tf = sys.modules.get("tensorflow")
    types = tuple(getattr(tf.errors, n) for n in PEER_ERROR_TYPES) if tf is not None else ()
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if types and isinstance(e, types):
            return e
        text = str(e).lower()
        if any(t in text for t in PEER_ERROR_TEXT):
            return e
        e = e.__cause__ or e.__context__
    return None


def oom_text(exc: BaseException) -> str:
    """The text of the ResourceExhaustedError in ``exc``'s chain (it names the allocation)."""
    return str(_resource_exhausted(exc) or exc)


_NOISE = ("File ", "Detected at node", "[[", "Graph execution error", "The error could be from",
          "Additional GRPC error", ":UNKNOWN:", "WARNING")


def summarize_error(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` with TensorFlow's traceback-like noise (graph node call sites,
    node names) left out, e.g. "DeadlineExceededError: Collective has timed out during
    execution." The full text is in the task's log."""
    lines = [l.strip() for l in str(exc).splitlines()]
    keep = [l for l in lines if l and not l.startswith(_NOISE)]
    text = " ".join(keep[:3]) if keep else (lines[0] if lines and lines[0] else "")
    return f"{type(exc).__name__}: {text}"[:limit] if text else type(exc).__name__
