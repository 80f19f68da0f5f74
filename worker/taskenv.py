"""What a task process starts with: the environment every one of an agent's task processes
shares, warm or not (``base_env``), and one task's own (``task_env``); and how long a process
asked to stop is given before it is killed (``STOP_GRACE_S``)."""

from __future__ import annotations

import os

STOP_GRACE_S = 5.0


def base_env(device: str) -> dict[str, str]:
    """What every task process of this agent starts with, warm or not: the agent's one device,
    quiet C++ logs, and the project importable however the agent runs."""
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1] if device.startswith("GPU") else ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def task_env(device: str, tf_config: str, budget_mib: int) -> dict[str, str]:
    """What is one task's own: its cluster and, on CPU, its allocator's limit. TensorFlow reads
    these when the strategy and the CPU device are created, not at import, so a warm process
    takes them as well as a new one."""
    env = {"TF_CONFIG": tf_config}
    if not device.startswith("GPU"):
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(budget_mib)
    return env

