"""A Strata task process: one TensorFlow task of a job.

    python -m strata.worker.task --config CONFIG.pb --events-fd N

The worker agent starts it with ``TF_CONFIG`` (the job's cluster and this task's place in it)
and, on CPU, ``TF_CPU_ALLOCATOR_USE_BFC=true`` and ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` (the task's
memory budget) already in the environment. CONFIG is the task contract, a ``TaskConfig``
message (``strata.taskconfig``; a ``.json`` file holds its JSON form), read once here; the
job's strategy (``strata.strategies``) names the runner for the task's role.

It writes newline-delimited JSON events to file descriptor N: ``started`` (cluster joined),
``first_step``, ``progress`` (at most every ``report_interval_s``, plus after the first and
the last step), ``checkpoint`` and ``resumed`` (``strata.worker.checkpoints``), ``memory``
(server tasks), ``result`` or ``error`` (kind ``oom``, ``bad_config``, ``user_code``,
``collective_timeout`` or ``error``) before a failing exit. Exit statuses are in
``strata.exitcodes``. Human-readable logs go to stdout.

Failures are classified in this order: out of memory (75, kind ``oom``) first, then a
collective or a peer that failed (78, kind ``collective_timeout``): TensorFlow's
``DeadlineExceededError``, ``UnavailableError``, ``CancelledError`` or ``AbortedError`` in the
error's chain, or an error whose text says a collective was aborted or a peer is unreachable
(``strata.worker.failures.peer_failure``). A MultiWorkerMirrored worker whose peer is SIGKILLed
mid-training gets ``UnavailableError: Collective ops is aborted by: ... Connection reset by
peer`` (under a second), or, for a peer that stops without closing its connections,
``UnavailableError``/``DeadlineExceededError`` from the coordination service's heartbeats
(about 10 s), at the latest the collective timeout (``strata.worker.trainers.data_parallel``).

The process always leaves through ``os._exit`` after flushing its outputs, and watchdogs end it
if its parent (the agent) dies, so no TensorFlow process is left orphaned.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import traceback
from typing import Callable

from strata.oom import parse_oom
from strata.exitcodes import (
    EXIT_KIND, TASK_EXIT_BAD_CONFIG, TASK_EXIT_COLLECTIVE, TASK_EXIT_ERROR, TASK_EXIT_OOM,
    TASK_EXIT_USER_CODE,
)
from strata.convert import read_task_config
from strata.taskconfig import TaskConfig, TaskConfigError
from strata.worker.usercode import UserCodeError, failed_batch_check
from strata.worker.device import allocator_figures, prepare_environment
from strata.worker.events import Events, exit_task, log
from strata.worker.failures import is_oom, oom_text, peer_failure, summarize_error
from strata.worker.watchdog import install_sigterm_handler, start_parent_watchdog


def load_runner(path: str) -> Callable[[TaskConfig, Events], int]:
    """The runner a strategy names (``Strategy.runner``: ``"module:function"``)."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if name else None
    except (ImportError, AttributeError) as e:
        raise TaskConfigError("strategy", f"its runner {path!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise TaskConfigError("strategy", f"its runner {path!r} is not a function "
                                          "(give it as 'module:function')")
    return fn


def run_task(config_path: str, events: Events) -> int:
    from strata import strategies
    from strata.worker.runner import check_data_available

    cfg = read_task_config(config_path)
    runner = load_runner(strategies.get(cfg.spec.strategy).runner(cfg.role))
    check_data_available(cfg)
    prepare_environment(cfg)
    return runner(cfg, events)


def _config_error_in(e: BaseException) -> TaskConfigError | None:
    """The ``TaskConfigError`` ``e`` wraps (its causes and contexts), if any."""
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 32:
        if isinstance(cur, TaskConfigError):
            return cur
        cur = cur.__cause__ or cur.__context__
        seen += 1
    return None


def main(argv: list[str] | None = None, watchdog: bool = True) -> None:
    """``watchdog``: start the parent watchdog (a warm process, ``strata.worker.warm``, started
    its own before it imported TensorFlow)."""
    p = argparse.ArgumentParser(prog="python -m strata.worker.task",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--config", required=True, help="the TaskConfig message (.pb, or .json)")
    p.add_argument("--events-fd", type=int, default=None,
                   help="file descriptor for newline-delimited JSON events (default: stderr)")
    args = p.parse_args(argv)
    if watchdog:
        start_parent_watchdog()
    events = Events(args.events_fd)
    install_sigterm_handler(events)
    code = TASK_EXIT_ERROR
    try:
        code = run_task(args.config, events)
    except TaskConfigError as e:
        log(f"bad config: {e}")
        events.emit("error", kind="bad_config", message=str(e), field=e.field)
        code = TASK_EXIT_BAD_CONFIG
    except UserCodeError as e:
        log(f"user code failed: {e}\n{e.details}")
        tail = e.details.strip().splitlines()
        events.emit("error", kind="user_code", message=f"{e}\ntraceback (most recent call "
                                                       f"last):\n" + "\n".join(tail[-12:]))
        code = TASK_EXIT_USER_CODE
    except BaseException as e:  # noqa: BLE001 - every failure must become an event and a code
        if is_oom(e):
            limit = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB")
            budget = f"{limit} MiB" if limit else "its memory budget"
            msg = f"out of memory: the task exceeded {budget}: {summarize_error(e)}"
            log(msg)
            # the allocator's figures are still readable: a task that fails before its first
            # progress report still tells the peak it reached
            oom = parse_oom(oom_text(e))
            events.emit("error", kind="oom", message=msg, memory=allocator_figures(),
                        oom=dataclasses.asdict(oom) if oom else None)
            code = TASK_EXIT_OOM
        elif peer_failure(e) is not None:
            traceback.print_exc()
            msg = f"a collective or a peer task failed: {summarize_error(e)}"
            log(msg)
            events.emit("error", kind=EXIT_KIND[TASK_EXIT_COLLECTIVE], message=msg)
            code = TASK_EXIT_COLLECTIVE
        elif (bad := _config_error_in(e)) is not None:
            # raised while a step was traced: TensorFlow's StagingError wraps it
            log(f"bad config: {bad}")
            events.emit("error", kind="bad_config", message=str(bad), field=bad.field)
            code = TASK_EXIT_BAD_CONFIG
        elif (words := failed_batch_check(e)) is not None:
            log(f"bad config: {words}")
            events.emit("error", kind="bad_config", message=words, field="code.dataset")
            code = TASK_EXIT_BAD_CONFIG
        elif isinstance(e, KeyboardInterrupt):
            events.emit("error", kind="error", message="interrupted")
            code = TASK_EXIT_ERROR
        else:
            traceback.print_exc()
            log(f"failed: {summarize_error(e)}")
            events.emit("error", kind="error", message=summarize_error(e))
            code = TASK_EXIT_ERROR
    exit_task(code, events)


if __name__ == "__main__":
    main()
