"""Data roots: the directories a worker agent lets jobs read their files from.

``strata worker --data-root DIR`` (repeatable) confines ``data.path`` and ``data.test_path``
to those directories. An agent started without one is unconfined (a one-user machine; `strata
up` passes the roots it is given), and says so when it starts.

Two checks, one rule:

- ``under_roots`` is lexical and touches no file: the coordinator uses it to place a job only
  on agents whose roots hold its paths, and to refuse a job no agent could read, without ever
  learning (or telling) whether a file exists.
- ``confine`` runs in the task process before the data is opened: the path, and every file a
  directory or a glob yields, must resolve (symbolic links followed) inside a root.

A refusal is the same message whether or not the file exists, so it cannot be used to probe
the agent's file system; only inside a root does "not found" become an answer.
"""

from __future__ import annotations

import glob
import os
from typing import Iterable, Sequence

__all__ = ["MAX_ROOTS", "OutsideRoots", "under_roots", "outside_message", "confine",
           "check_roots"]

MAX_ROOTS = 16


class OutsideRoots(PermissionError):
    """A data path that does not resolve inside the agent's data roots."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def outside_message(roots: Sequence[str]) -> str:
    """The refusal of a path outside ``roots``: it never says whether the path exists."""
    return ("is not under the worker's data roots (" + ", ".join(roots[:4])
            + (", ..." if len(roots) > 4 else "") + "); the agent's --data-root names them")


def _inside(path: str, root: str) -> bool:
    root = root.rstrip(os.sep) or os.sep
    return path == root or path.startswith(root if root == os.sep else root + os.sep)


def under_roots(path: str, roots: Iterable[str]) -> bool:
    """Whether ``path`` (a file, directory or glob) lies lexically under one of ``roots``;
    true for every path when there are no roots. A relative path is never under a root."""
    roots = list(roots)
    if not roots:
        return True
    if not os.path.isabs(path):
        return False
    norm = os.path.normpath(path)
    return any(_inside(norm, os.path.normpath(r)) for r in roots)


def check_roots(roots: Iterable[str]) -> list[str]:
    """``--data-root`` values as an agent registers them: absolute, normalized, at most
    MAX_ROOTS. Raises ValueError naming the one at fault."""
    out = []
    for r in roots:
        if not r or "\0" in r or len(r) > 4096 or not os.path.isabs(r):
            raise ValueError(f"{r[:64]!r} is not an absolute path")
        out.append(os.path.normpath(r))
    if len(out) > MAX_ROOTS:
        raise ValueError(f"at most {MAX_ROOTS} data roots, got {len(out)}")
    return out


def _matches(path: str) -> list[str]:
    """What reading ``path`` opens: a directory's files (recursively), a glob's matches, or
    the file itself."""
    if os.path.isdir(path):
        return [os.path.join(base, n) for base, _dirs, names in os.walk(path) for n in names]
    if glob.has_magic(path):
        return glob.glob(path)
    return [path]


def confine(path: str, field: str, roots: Sequence[str]) -> None:
    """Raises ``OutsideRoots`` unless ``path`` and everything it yields resolve inside
    ``roots`` (nothing to check without roots)."""
    if not roots or not path:
        return
    refusal = OutsideRoots(field, outside_message(roots))
    if not under_roots(path, roots):
        raise refusal
    real_roots = [os.path.realpath(r) for r in roots]
    # the path itself first: a link inside a root to a directory outside it is refused
    # before anything under it is listed

    def outside(p: str) -> bool:
        return os.path.lexists(p) and not any(_inside(os.path.realpath(p), r)
                                              for r in real_roots)
    if not glob.has_magic(path) and outside(path):
        raise refusal
    if any(outside(p) for p in _matches(path)):
        raise refusal
