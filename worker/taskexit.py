"""How a task process ended: its state, failure kind, exit code and message, read from its exit
status, the error event it sent and its allocator's figures (``classify_exit``)."""

from __future__ import annotations

import signal
from typing import Callable

from strata import exitcodes
from strata.types import FailureKind, TaskState

#: a task that crashes (SIGSEGV, SIGABRT, SIGBUS) with its allocator peak this close to its
#: budget is reported out of memory
NEAR_BUDGET = 0.9


def classify_exit(code: int, *, stopped: bool, has_result: bool, error_kind: str, message: str,
                  peak: int, budget: int, log_tail: Callable[[], str],
                  refused: Callable[[], str] = lambda: ""
                  ) -> tuple[TaskState, FailureKind, int, str]:
    """How a task process ended: ``(state, failure, exit code, message)`` from its exit status,
    the error event it sent (``error_kind``, ``message``), its allocator figures, and
    ``refused()``: the size of an allocation its allocator logged it refused (empty: none)."""
    if stopped:
        return TaskState.CANCELLED, FailureKind.NONE, code, "stopped"
    if code == 0 and has_result:
        return TaskState.SUCCEEDED, FailureKind.NONE, 0, ""
    if code == exitcodes.TASK_EXIT_NOTICE:
        return (TaskState.CANCELLED, FailureKind.NONE, code,
                message or "saved a checkpoint on notice and stopped")
    if code == exitcodes.TASK_EXIT_OOM or error_kind == "oom":
        return TaskState.FAILED, FailureKind.OOM, code, message
    if code == exitcodes.TASK_EXIT_BAD_CONFIG or error_kind == "bad_config":
        return TaskState.FAILED, FailureKind.BAD_CONFIG, code, message
    if code == exitcodes.TASK_EXIT_USER_CODE or error_kind == "user_code":
        return TaskState.FAILED, FailureKind.USER_CODE, code, message
    if code == exitcodes.TASK_EXIT_COLLECTIVE or error_kind == "collective_timeout":
        return TaskState.FAILED, FailureKind.COLLECTIVE_TIMEOUT, code, message
    if code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        if sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) and budget \
                and peak >= NEAR_BUDGET * budget:
            # seen: a stage server died by SIGSEGV with its peak at 92% of its budget, an
            # allocation failing where TensorFlow does not raise ResourceExhaustedError
            return (TaskState.FAILED, FailureKind.OOM, code,
                    f"killed by {name} with its allocator peak at {peak / budget:.0%} of its "
                    f"{budget >> 20} MiB budget: out of memory where TensorFlow raised no error")
        if sig in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS) and (size := refused()):
            # seen: copying a 128 MiB array into a tensor under a 68 MiB budget; the allocator
            # refused it (and logged so) but the copy had no error path, so the peak stayed low
            return (TaskState.FAILED, FailureKind.OOM, code,
                    f"killed by {name} after its allocator refused {size}"
                    + (f" over its {budget >> 20} MiB budget" if budget else "")
                    + ": out of memory where TensorFlow raised no error")
        hint = " (SIGKILL from outside: possibly the kernel's OOM killer)" if sig == 9 else ""
        return TaskState.FAILED, FailureKind.SIGNAL, code, f"killed by {name}{hint}"
    if code == 0:
        return TaskState.FAILED, FailureKind.EXIT_CODE, 0, "exited without a result"
    return TaskState.FAILED, FailureKind.EXIT_CODE, code, message or log_tail()
