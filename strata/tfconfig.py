"""TF_CONFIG: the cluster description each TensorFlow task process reads at start-up."""

from __future__ import annotations

import json


def build_tf_config(cluster: dict[str, list[str]], role: str, index: int) -> str:
    """Returns the TF_CONFIG JSON for task ``role:index`` of ``cluster``.

    Args:
        cluster: role -> list of "host:port", in task-index order (e.g. {"worker": [...]}).
        role: the task's job name in the cluster ("worker", "chief", "ps").
        index: the task's index within its role.
    """
    if role not in cluster:
        raise ValueError(f"role {role!r} is not in the cluster ({', '.join(cluster)})")
    if not 0 <= index < len(cluster[role]):
        raise ValueError(f"index {index} is out of range for role {role!r}")
    return json.dumps({"cluster": {r: list(addrs) for r, addrs in cluster.items()},
                       "task": {"type": role, "index": index}}, sort_keys=True)
