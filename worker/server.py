"""The task processes that only serve TensorFlow's distributed runtime: parameter servers and
workers of a ``parameter_server`` job, and the stage tasks of ``pipeline`` and ``hybrid`` jobs
(every stage but the driver's own). Each runs one ``tf.distribute.Server`` for its place in
``TF_CONFIG``; the job's chief creates variables on it and runs ops there.

A server has no training loop of its own, so what it reports is memory: the device's allocator
(the BFC allocator limited to the task's slice on CPU, the logical device on GPU) is shared by
every op the chief runs here, so ``get_memory_info`` in this process gives the task's real
in-use and peak bytes (checked: a 64 MiB variable created and added to by a remote chief shows
as a 128 MiB peak here). It emits ``started`` once the server listens, then ``memory`` events
every ``report_interval_s`` while the figures change, until it is stopped.

A server's normal end is being stopped by its agent when the job is over: SIGTERM ends it with
exit status 0 (a ``stopped`` event first), so the agent and coordinator can tell a stop from a
crash (a signal or a non-zero status).
"""

from __future__ import annotations

import signal
import threading
import time

from strata.exitcodes import TASK_EXIT_OK
from strata.taskconfig import TaskConfig
from strata.worker.cluster import cluster_from_tf_config
from strata.worker.device import configure_device
from strata.worker.events import Events, exit_task, log


def _server_config(tf, cfg: TaskConfig):
    """The server builds its own devices and thread pools from a ConfigProto (what
    ``configure_device`` set on the eager context does not reach them): the task's intra-op
    threads, and on GPU the budget as a virtual device's memory limit."""
    device = cfg.agent.device
    threads = cfg.agent.threads
    budget_mb = cfg.memory_budget_bytes >> 20
    config = tf.compat.v1.ConfigProto()
    if threads > 0:
        config.intra_op_parallelism_threads = threads
        config.inter_op_parallelism_threads = 2
    if device.startswith("GPU:") and budget_mb > 0:
        config.gpu_options.CopyFrom(tf.compat.v1.GPUOptions(
            experimental=tf.compat.v1.GPUOptions.Experimental(
                virtual_devices=[tf.compat.v1.GPUOptions.Experimental.VirtualDevices(
                    memory_limit_mb=[float(budget_mb)])])))
    return config


def serve(cfg: TaskConfig, events: Events) -> int:
    cluster, role, index = cluster_from_tf_config()
    interval = cfg.report_interval_s
    t0 = time.time()
    tf, memory = configure_device(cfg)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=role, task_index=index,
                                  protocol="grpc", config=_server_config(tf, cfg), start=True)
    stopping = threading.Event()

    def on_term(signum, frame):  # noqa: ARG001
        stopping.set()

    signal.signal(signal.SIGTERM, on_term)
    events.emit("started", role=role, index=index, address=server.target)
    log(f"started: {role}:{index} of {sorted((k, len(v)) for k, v in cluster.items())} "
        f"serving at {cluster[role][index]} (import+start {time.time() - t0:.1f} s)")
    last = None
    last_emit = 0.0
    while not stopping.wait(interval):
        m = memory()
        now = time.time()
        # repeat unchanged figures rarely: the agent's heartbeat already carries the last ones
        if m != last or now - last_emit >= 30.0:
            events.emit("memory", memory=m)
            last, last_emit = m, now
    m = memory()
    events.emit("stopped", memory=m)
    log(f"stopped; peak memory {m['peak'] / (1 << 20):.1f} MiB")
    exit_task(TASK_EXIT_OK, events)
    return TASK_EXIT_OK  # not reached
