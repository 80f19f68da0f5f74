"""A warm task process: TensorFlow imported ahead of its task, waiting for one.

    python -m strata.worker.warm --events-fd N

The agent keeps ``--warm-pool`` of these ready (``strata.worker.warmpool.WarmPool``) and hands a
task to one by writing one JSON line to its stdin: ``{"config": PATH, "cwd": DIR, "env":
{...}}``. The process then becomes that task exactly as ``python -m strata.worker.task``
would, with the same events, exit statuses and watchdog.

What must be set before TensorFlow initialises is still the task's own: importing TensorFlow
creates no device (checked on TF 2.21: the CPU allocator reads
``TF_CPU_ALLOCATOR_USE_BFC`` / ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` when the CPU device is first
made, and ``TF_CONFIG`` is read when the strategy is), so the task's budget, cluster and
threads are applied here, before anything touches a device. The GPU a process may see
(``CUDA_VISIBLE_DEVICES``) is the agent's one device, fixed when the process starts. Strata's
task modules are imported too (Keras comes with TensorFlow); nothing is built in advance: a
Keras model or an op would create the devices.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

#: the file a warm process makes in its working directory once it is ready: ``PID.ready``
READY_SUFFIX = ".ready"


def ready_mark(directory: str, pid: int) -> str:
    """The path of the mark process ``pid`` makes in ``directory`` once it is ready."""
    return os.path.join(directory, f"{pid}{READY_SUFFIX}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m strata.worker.warm")
    p.add_argument("--events-fd", type=int, required=True)
    args = p.parse_args(argv)
    from strata.worker.watchdog import start_parent_watchdog

    start_parent_watchdog()
    import tensorflow  # noqa: F401 - the seconds a warm process pays before its task comes

    # the task's own modules (a tenth of a second more), none of which touches a device
    import strata.worker.checkpoints  # noqa: F401
    import strata.worker.data  # noqa: F401
    import strata.worker.trainers.data_parallel  # noqa: F401
    import strata.worker.models  # noqa: F401
    import strata.worker.trainers.gpipe  # noqa: F401
    import strata.worker.trainers.ps_chief  # noqa: F401
    import strata.worker.task  # noqa: F401

    # ready: PID.ready in the pool's directory (the working directory) says so to the agent,
    # which hands a task to a ready process first, and to anyone measuring a warm start
    mark = ready_mark(os.getcwd(), os.getpid())
    with open(mark, "w"):
        pass
    line = sys.stdin.readline()
    with contextlib.suppress(OSError):
        os.unlink(mark)
    if not line.strip():  # the pool was closed
        os._exit(0)
    order = json.loads(line)
    os.chdir(order["cwd"])
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    from strata.worker import task

    task.main(["--config", order["config"], "--events-fd", str(args.events_fd)],
              watchdog=False)


if __name__ == "__main__":
    main()
