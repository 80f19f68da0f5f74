"""The task's cluster: ``TF_CONFIG`` read and checked, and whether a peer's server listens."""

from __future__ import annotations

import json
import os
import socket
import time

from strata.taskconfig import TaskConfigError


def cluster_from_tf_config() -> tuple[dict[str, list[str]], str, int]:
    """``(cluster, role, index)`` from ``TF_CONFIG``; TaskConfigError when it is missing, malformed, or
    does not list this task."""
    raw = os.environ.get("TF_CONFIG", "")
    try:
        tc = json.loads(raw)
        cluster = {str(k): [str(a) for a in v] for k, v in tc["cluster"].items()}
        role, index = str(tc["task"]["type"]), int(tc["task"]["index"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise TaskConfigError("TF_CONFIG", "needs cluster and task.type/task.index") from None
    if role not in cluster or not 0 <= index < len(cluster[role]):
        raise TaskConfigError("TF_CONFIG", f"task {role}:{index} is not in the cluster")
    return cluster, role, index


def reachable(address: str, timeout: float = 0.5) -> bool:
    """Whether ``HOST:PORT`` accepts a TCP connection (a task's server is listening)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "localhost"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def wait_reachable(address: str, timeout_s: float, interval_s: float = 0.02) -> bool:
    """Polls ``address`` until it accepts a connection or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if reachable(address, timeout=min(0.5, max(0.01, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
