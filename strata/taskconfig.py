"""The task contract: what the coordinator tells one task process, as typed domain objects.

On the wire it is the ``TaskConfig`` message of ``protos/strata.proto`` (``strata.convert`` maps
between the two). The coordinator builds it from the stored plan (``Coordinator.task_config``, with the
strategy's ``task_section``); the
agent passes it through, adding only ``agent`` (``AgentSettings``: what the agent owns); the task
process reads it once (``read_task_config``) and hands the typed object to its strategy's
runner. Every default of the contract lives here, once.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata.jobspec import JobSpec

#: Bumped when a field of the contract changes meaning; a task refuses another version.
TASK_CONFIG_VERSION = 1
#: How often a task reports progress and allocator figures. Every report costs the agent and the
#: coordinator a little CPU, and on a small host that is CPU the lockstep trainers do not get.
REPORT_INTERVAL_S = 1.0
#: a notice to a task: this file in its working directory, written by its agent, holds the step
#: after which the task saves a checkpoint and stops (``strata.worker.notice``)
NOTICE_FILE = "notice"


@dataclasses.dataclass(frozen=True)
class ParameterServerSection:
    """parameter_server: the PS task holding each layer's variables, and each PS task's slice."""

    placement: dict[str, int]
    ps_budgets_bytes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StageAssignment:
    """One (replica, stage) of a pipeline: the task that holds it and its layers
    ``[first_layer, last_layer)`` of the model's profile."""

    replica: int
    stage: int
    role: str
    index: int
    first_layer: int
    last_layer: int
    layers: tuple[str, ...]
    estimated_memory_bytes: int = 0
    memory_budget_bytes: int = 0

    @property
    def task_name(self) -> str:
        return f"{self.role}:{self.index}"


@dataclasses.dataclass(frozen=True)
class PipelineSection:
    """pipeline, hybrid: the stage layout (``stages`` x ``replicas`` assignments)."""

    stages: int
    replicas: int
    microbatches: int
    microbatch: int
    layout: tuple[StageAssignment, ...]


StrategySection = ParameterServerSection | PipelineSection | None


@dataclasses.dataclass(frozen=True)
class AgentSettings:
    """Filled by the agent alone: where outputs go, intra-op threads, the device as the task
    sees it (``CPU`` or ``GPU:0``: the agent makes its one GPU the only visible one)."""

    output_dir: str = ""
    threads: int = 0
    device: str = "CPU"
    blob_dir: str = ""      # the agent's fetched blobs (a job's .keras file), by SHA-256
    shared_dir: str = ""    # --shared-dir: every agent of the cluster sees it at this path
    data_roots: tuple[str, ...] = ()  # --data-root: data.path must resolve inside one


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    job_id: str
    role: str
    index: int
    spec: JobSpec
    memory_budget_bytes: int = 0
    report_interval_s: float = REPORT_INTERVAL_S
    section: StrategySection = None
    agent: AgentSettings = AgentSettings()
    version: int = TASK_CONFIG_VERSION
    #: the job's restart count when this task was started: its checkpoint generation
    #: (``checkpoint_dir``)
    restart: int = 0
    #: a memory probe (``memory.profile``): it measures and reports, and saves no model and
    #: no TensorBoard scalars (the job it measures does)
    probe: bool = False

    @property
    def task_name(self) -> str:
        return f"{self.role}:{self.index}"

    @property
    def job_dir(self) -> str:
        """The job's directory on the shared storage (empty without ``--shared-dir``)."""
        if not self.agent.shared_dir:
            return ""
        import os

        return os.path.join(self.agent.shared_dir, "jobs", self.job_id)

    @property
    def checkpoint_root(self) -> str:
        """``JOB_DIR/checkpoints``: one ``gen-N`` directory per restart generation N. A task
        of generation N writes only into ``gen-N`` and resumes from the newest checkpoint of
        the generations before it, so a task of an earlier generation still running somewhere
        (a partitioned host) can never overwrite what the current one reads or writes."""
        import os

        return os.path.join(self.job_dir, "checkpoints") if self.job_dir else ""

    @property
    def checkpoints_enabled(self) -> bool:
        """The task keeps checkpoints: wherever its agent has a shared directory. It saves one
        every ``checkpoint.every_steps`` (0: never periodically) and one on a notice, and
        resumes from the latest of an earlier generation."""
        return bool(self.agent.shared_dir)


class TaskConfigError(Exception):
    """The task configuration cannot be read or run; ``field`` names what to fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
