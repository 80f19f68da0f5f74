"""Exit codes of a Strata task process (``python -m strata.worker.task``).

The worker agent launches one task process per job task and classifies how it ended from
its exit status (the task also writes an ``error`` event with a ``kind`` before a failing
exit; the exit status is the authoritative signal when the event pipe is lost):

- ``TASK_EXIT_OK`` (0): training and evaluation finished and the ``result`` event was written.
- ``TASK_EXIT_ERROR`` (1): any other failure (a crash, a lost peer, a collective timeout,
  the parent agent died). Retrying may help.
- ``TASK_EXIT_OOM`` (75): TensorFlow raised ``tf.errors.ResourceExhaustedError``: the
  task's allocator went over its memory budget (``TF_CPU_BFC_MEM_LIMIT_IN_MB`` on CPU, the
  logical-device ``memory_limit`` on GPU). Retrying with the same budget will fail again;
  give the task a larger budget or a smaller per-replica batch.
- ``TASK_EXIT_BAD_CONFIG`` (76): the task configuration cannot be run (unsupported
  strategy or option, unsafe or unparsable model, unreadable data file). Retrying will
  fail again; the ``error`` event's message names the offending field.

- ``TASK_EXIT_USER_CODE`` (77): the job's own code (``code.model``, ``code.dataset``) raised;
  the ``error`` event carries its traceback. Retrying runs the same code again.

- ``TASK_EXIT_COLLECTIVE`` (78): a collective operation or a call to a peer task timed out or
  was aborted (a peer died or was stopped): the task is a casualty of another's failure, and
  a restart of the job resumes it.

- ``TASK_EXIT_NOTICE`` (79): the task saved a checkpoint on a notice (its worker leaves) and
  stopped, as asked: not a failure; the job restarts from that checkpoint.

75 to 79 come from the BSD ``sysexits.h`` range (EX_TEMPFAIL, EX_PROTOCOL) so they do not
collide with Python's own 1/2 or with 128+N signal deaths.
"""

TASK_EXIT_OK = 0
TASK_EXIT_ERROR = 1
TASK_EXIT_OOM = 75
TASK_EXIT_BAD_CONFIG = 76
TASK_EXIT_USER_CODE = 77
TASK_EXIT_COLLECTIVE = 78
TASK_EXIT_NOTICE = 79

#: exit status -> the ``kind`` of the matching ``error`` event (0 has none).
EXIT_KIND = {
    TASK_EXIT_ERROR: "error",
    TASK_EXIT_OOM: "oom",
    TASK_EXIT_BAD_CONFIG: "bad_config",
    TASK_EXIT_USER_CODE: "user_code",
    TASK_EXIT_COLLECTIVE: "collective_timeout",
}

