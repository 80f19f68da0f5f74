"""Per-user limits of the coordinator, and their defaults (``strata coordinator`` flags).

Light on purpose: the CLI reads the defaults for its ``--help`` without importing the
coordinator.
"""

#: jobs one user may have waiting (PENDING) at once; more are refused with RESOURCE_EXHAUSTED
#: (``--max-pending-per-user``). With authentication off every job has the same owner, "".
DEFAULT_MAX_PENDING_PER_USER = 1000
#: task processes one job may run (``--max-tasks-per-job``; raise it for larger clusters)
DEFAULT_MAX_TASKS_PER_JOB = 256
#: finished jobs are deleted (records, logs, stored outputs) this long after they ended
#: (``--retention``; 0 keeps them)
DEFAULT_RETENTION_S = 7 * 24 * 3600.0
#: the longest notice a drain may give (``strata drain --deadline``, ``strata worker --notice``):
#: clouds give 30 s to 2 min, Slurm's ``--signal`` minutes; beyond an hour it is a plan, not a
#: notice
MAX_NOTICE_S = 3600.0
