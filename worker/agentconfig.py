"""The settings of one worker agent (``strata worker``'s flags): its coordinator, name, device
and memory budget, where it keeps its files, and how its tasks start."""

from __future__ import annotations

import dataclasses
import sys

from strata.tls import ClientTls


@dataclasses.dataclass
class AgentConfig:
    coordinator: str
    name: str
    budget_bytes: int
    device: str = "CPU"
    work_dir: str = ".strata/worker"
    host: str = ""
    threads: int = 0
    python: str = sys.executable
    #: --shared-dir: a directory every agent of the cluster sees at the same path, holding
    #: each job's checkpoints and outputs under ``jobs/JOB_ID/`` (empty: no checkpointed jobs)
    shared_dir: str = ""
    #: --data-root: jobs read data.path and data.test_path only under these (``strata.dataroots``;
    #: empty: anywhere this user may read)
    data_roots: tuple[str, ...] = ()
    #: task processes kept ready with TensorFlow imported (``--warm-pool``; 0: none)
    warm_pool: int = 0
    #: the CPU kernels its tasks' TensorFlow runs (``--cpu-kernels``; ``strata.cpukernels``),
    #: told to the coordinator, whose memory estimates depend on it; empty on a GPU
    cpu_kernels: str = ""
    #: the coordinator's CA, and this agent's certificate under mutual TLS (empty: plain text)
    tls: ClientTls = dataclasses.field(default_factory=ClientTls)
    #: --notice: how long the machine stays after SIGTERM (a spot reclaim's or a pod's grace):
    #: the agent's jobs save a checkpoint on notice within it and move (``Agent.drain``)
    notice_s: float = 60.0
    #: its ``agent`` token (``strata.auth``; empty when the coordinator has no auth)
    token: str = dataclasses.field(default="", repr=False)
