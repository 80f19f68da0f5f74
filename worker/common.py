"""What every Strata task process shares, whatever its strategy and role: the events pipe to
the agent, logs, the exit path, the parent watchdogs, SIGTERM handling, error summaries, and the
device set-up (memory budget, threads) done right after TensorFlow is imported.

Runners (``strata.worker.runner``'s skeleton and each strategy's ``mirrored``, ``ps``,
``pipeline``; ``server`` for the plain ``tf.distribute.Server`` tasks) import from here.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from strata.exitcodes import TASK_EXIT_ERROR
from strata.taskconfig import TaskConfig, TaskConfigError


# --------------------------------------------------------------------------------------------
# events and logs


def _clean(v: Any) -> Any:
    """JSON-safe values: non-finite floats become null (strict JSON has no NaN)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class Events:
    """Newline-delimited JSON events on a file descriptor (stderr when none is given)."""

    def __init__(self, fd: int | None):
        self._f = None
        if fd is not None and fd >= 0:
            try:
                self._f = os.fdopen(fd, "w", buffering=1)
            except OSError as e:
                log(f"cannot open events fd {fd}: {e}; events go to stderr")
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "time": time.time()}
        rec.update(fields)
        line = json.dumps(_clean(rec), allow_nan=False)
        with self._lock:
            try:
                if self._f is not None:
                    self._f.write(line + "\n")
                else:
                    sys.stderr.write("EVENT " + line + "\n")
                    sys.stderr.flush()
            except (OSError, ValueError):
                pass  # the reader is gone; the parent watchdog ends the process if it died

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                try:
                    self._f.flush()
                    self._f.close()
                except (OSError, ValueError):
                    pass
                self._f = None


def log(msg: str) -> None:
    print(f"[task] {msg}", flush=True)


def format_mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def exit_task(code: int, events: Events | None) -> None:
    if events is not None:
        events.close()
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# The forked watcher runs this in a fresh interpreter (exec'd, so its command line does not
# look like a task's): argv = [-c, name, task pid, agent pid, interval].
_WATCHER_SRC = """
import os, signal, sys, time
me, parent, interval = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
def ppid_of(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
while True:
    time.sleep(interval)
    if os.getppid() != me:
        break
    p = ppid_of(me)
    if p is not None and p != parent:
        try:
            os.kill(me, signal.SIGKILL)
        except OSError:
            pass
        break
"""


def start_parent_watchdog(interval_s: float = 1.0) -> None:
    """Ends this process when its parent (the agent) dies, so no TensorFlow task is left
    orphaned. Two watchers: a daemon thread (exits with a message), and, where /proc exists,
    a small forked process started before TensorFlow is imported that SIGKILLs this one. The
    second is needed because TensorFlow's MultiWorkerMirroredStrategy constructor blocks in the
    cluster rendezvous while holding the GIL, so no Python thread runs until every worker has
    joined. The watcher (``python -S -c ... strata-task-watchdog``) holds no file descriptors
    of ours (the agent sees EOF on the events pipe and logs when we exit), stays in our process
    group (a killpg reaches it) and leaves within ``interval_s`` after we do."""
    parent = os.getppid()
    me = os.getpid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                try:
                    print("[task] parent process died; exiting", file=sys.stderr, flush=True)
                finally:
                    os._exit(TASK_EXIT_ERROR)

    if os.path.exists(f"/proc/{me}/stat"):
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:  # the watcher process: a fresh interpreter, no fds of ours, its own name
            try:
                devnull = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(devnull, fd)
                os.closerange(3, 65536)
                os.execv(sys.executable, [sys.executable, "-S", "-c", _WATCHER_SRC,
                                          "strata-task-watchdog", str(me), str(parent),
                                          str(interval_s)])
            finally:
                os._exit(0)
    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def install_sigterm_handler(events: Events) -> None:
    """SIGTERM: write an error event, then die by SIGTERM. Re-installed after the strategy is
    created because TensorFlow's coordination service installs its own SIGTERM handler (for
    preemption notices) that swallows the signal: a SIGTERM during the cluster rendezvous is
    ignored, so the agent must follow SIGTERM with SIGKILL after a grace period."""

    def on_term(signum, frame):  # noqa: ARG001
        events.emit("error", kind="error", message="terminated by SIGTERM")
        events.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)



# --------------------------------------------------------------------------------------------
# training


def _resource_exhausted(exc: BaseException) -> BaseException | None:
    """The ResourceExhaustedError in ``exc``'s chain of causes, if any."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return None
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, tf.errors.ResourceExhaustedError):
            return e
        e = e.__cause__ or e.__context__
    return None


def is_oom(exc: BaseException) -> bool:
    return _resource_exhausted(exc) is not None


#: TensorFlow errors that mean a collective or a peer task failed (a dead peer resets the
#: collective's connection: UnavailableError; a hung one times it out: DeadlineExceededError;
#: the coordination service aborts the others' collectives: Unavailable, Aborted, Cancelled)
PEER_ERROR_TYPES = ("DeadlineExceededError", "UnavailableError", "CancelledError", "AbortedError")
#: what their text says when TensorFlow wraps them in another type (lower case)
PEER_ERROR_TEXT = (
    "collective ops is aborted", "collective has timed out", "stopped sending heartbeats",
    "the tasks have crashed", "connection reset by peer", "failed to connect to all addresses",
    "socket closed", "deadline exceeded", "is unreachable",
)


def peer_failure(exc: BaseException) -> BaseException | None:
    """The error in ``exc``'s chain of causes that says a collective or a peer task failed
    (``PEER_ERROR_TYPES``, or an error whose text says so), if any."""
    tf = sys.modules.get("tensorflow")
    types = tuple(getattr(tf.errors, n) for n in PEER_ERROR_TYPES) if tf is not None else ()
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if types and isinstance(e, types):
            return e
        text = str(e).lower()
        if any(t in text for t in PEER_ERROR_TEXT):
            return e
        e = e.__cause__ or e.__context__
    return None


def oom_text(exc: BaseException) -> str:
    """The text of the ResourceExhaustedError in ``exc``'s chain (it names the allocation)."""
    return str(_resource_exhausted(exc) or exc)


def allocator_figures() -> dict[str, int]:
    """``{current, peak}`` of this process's device allocator (GPU:0 when a GPU is visible,
    else CPU:0), without touching a device that is not initialised; zeros when unreadable."""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return {"current": 0, "peak": 0}
    try:
        device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
        info = tf.config.experimental.get_memory_info(device)
        return {"current": int(info.get("current", 0)), "peak": int(info.get("peak", 0))}
    except Exception:  # noqa: BLE001 - a report must never fail the failure path
        return {"current": 0, "peak": 0}


_NOISE = ("File ", "Detected at node", "[[", "Graph execution error", "The error could be from",
          "Additional GRPC error", ":UNKNOWN:", "WARNING")


def summarize_error(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` with TensorFlow's traceback-like noise (graph node call sites,
    node names) left out, e.g. "DeadlineExceededError: Collective has timed out during
    execution." The full text is in the task's log."""
    lines = [l.strip() for l in str(exc).splitlines()]
    keep = [l for l in lines if l and not l.startswith(_NOISE)]
    text = " ".join(keep[:3]) if keep else (lines[0] if lines and lines[0] else "")
    return f"{type(exc).__name__}: {text}"[:limit] if text else type(exc).__name__



def cluster_from_tf_config() -> tuple[dict[str, list[str]], str, int]:
    """``(cluster, role, index)`` from ``TF_CONFIG``; TaskConfigError when it is missing, malformed, or
    does not list this task."""
    raw = os.environ.get("TF_CONFIG", "")
    try:
        tc = json.loads(raw)
        cluster = {str(k): [str(a) for a in v] for k, v in tc["cluster"].items()}
        role, index = str(tc["task"]["type"]), int(tc["task"]["index"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise TaskConfigError("TF_CONFIG", "needs cluster and task.type/task.index") from None
    if role not in cluster or not 0 <= index < len(cluster[role]):
        raise TaskConfigError("TF_CONFIG", f"task {role}:{index} is not in the cluster")
    return cluster, role, index


def weighted(tf: Any, per_example: Any, w: Any) -> Any:
    """Per-example losses times sample weights ``w`` (None: as they are), as Keras's ``fit``
    weighs them: the weights' shape is brought to the losses' rank (a trailing axis of 1
    dropped, or one added) and the product reduced as the unweighted losses would be, over the
    batch's size, not over the weights' sum."""
    if w is None:
        return per_example
    w = tf.cast(w, per_example.dtype)
    while w.shape.rank is not None and w.shape.rank > per_example.shape.rank \
            and w.shape[-1] == 1:
        w = tf.squeeze(w, -1)
    while w.shape.rank is not None and w.shape.rank < per_example.shape.rank:
        w = tf.expand_dims(w, -1)
    return per_example * w


def extra_losses(tf: Any, model: Any) -> tuple[Any, Any]:
    """The losses Keras's ``fit`` adds to the loss function's, from ``model``'s last call, as
    two float32 scalars (None when there are none): ``(own, weights)``.

    - ``own``: ``add_loss`` terms and activity regularizers, computed on that call's examples
      (Keras 3 divides an activity regularizer by the batch's size; ``add_loss`` terms are
      taken alike, as means over the examples, so a batch's is its slices' weighted by rows);
    - ``weights``: the weight regularizers (``kernel_regularizer`` and the like), which depend
      on the weights alone: once per step, whatever its slices.

    Keras 3 lists the weight regularizers last in ``model.losses``, one per trainable weight
    that has one; that is how the two are told apart."""
    losses = list(model.losses)
    n_weights = sum(1 for v in model.trainable_weights
                    if getattr(v, "regularizer", None) is not None)
    cut = max(0, len(losses) - n_weights)

    def total(terms: list) -> Any:
        return tf.add_n([tf.cast(t, tf.float32) for t in terms]) if terms else None
    return total(losses[:cut]), total(losses[cut:])


def training_loss(tf: Any, model: Any, loss_fn: Any, reduce: Any, x: Any, y: Any, w: Any = None,
                  *, rows: Any = 1.0, scale: Any = 1.0, share: Any = 1.0) -> Any:
    """``model`` on a batch in training mode, and the loss to differentiate as Keras's ``fit``
    counts it: ``reduce`` of the float32 per-example losses times the sample weights ``w``,
    plus the model's own losses (``extra_losses``) divided by the replicas.

    For one slice of a step's batch: its own losses weigh ``rows`` (its share of the batch's
    rows), both times ``scale`` (0 for a slice that only reruns the batch), plus ``share`` of
    the step's weight regularizers (the slices' shares add to one)."""
    out = model(x, training=True)
    per_example = loss_fn(y, tf.cast(out, tf.float32))
    if per_example.shape.rank == 0:
        # a loss that already reduced the batch: averaged again over the global batch, its
        # gradient would be off by the batch's size; refused rather than trained wrong
        from strata.taskconfig import TaskConfigError

        raise TaskConfigError("code.model", "its loss returns one number for a batch, not one "
                                            "per example: a distributed step averages over the "
                                            "global batch itself; return the per-example losses "
                                            "(or give training.loss)")
    loss = reduce(weighted(tf, per_example, w))
    own, weights = extra_losses(tf, model)
    if own is not None:
        loss = loss + tf.nn.scale_regularization_loss(own) * rows
    loss = loss * scale
    if weights is not None:
        loss = loss + tf.nn.scale_regularization_loss(weights) * share
    return loss


def eval_sums(tf, loss_fn, y, out, classify: bool, w=None):
    """(summed loss, number of correct predictions) of one evaluation batch, for float32
    outputs ``out``, each example counted ``w`` times when sample weights are given; the count
    is 0 for a model that does not classify."""
    per_example = weighted(tf, loss_fn(y, out), w)
    if classify:
        pred = tf.argmax(out, axis=-1)
        truth = tf.cast(y, tf.int64) if y.shape.rank == 1 else tf.argmax(y, axis=-1)
        hit = weighted(tf, tf.cast(tf.equal(pred, truth), tf.float32), w)
        correct = tf.reduce_sum(hit)
    else:
        correct = tf.constant(0.0)
    return tf.reduce_sum(per_example), correct


def configure_device(cfg: TaskConfig):
    """Imports TensorFlow and applies the task's device settings before the runtime starts:
    on ``GPU:N`` a logical device limited to the memory budget, on CPU no GPUs (the BFC limit
    comes from the environment, see ``prepare_environment``); intra-op threads. Returns
    ``(tf, memory)`` where ``memory()`` reads this process's allocator ``{current, peak}``."""
    device = cfg.agent.device
    threads = cfg.agent.threads
    import tensorflow as tf

    if device.startswith("GPU:"):
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            raise RuntimeError(f"device {device} requested but TensorFlow sees no GPU "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        budget_mb = cfg.memory_budget_bytes >> 20
        if budget_mb > 0:
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=budget_mb)])
        mem_device = "GPU:0"
    else:
        tf.config.set_visible_devices([], "GPU")
        mem_device = "CPU:0"
    if threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(2)

    def memory() -> dict:
        try:
            info = tf.config.experimental.get_memory_info(mem_device)
            return {"current": int(info.get("current", 0)), "peak": int(info.get("peak", 0))}
        except (ValueError, RuntimeError, tf.errors.OpError):
            return {"current": 0, "peak": 0}

    return tf, memory


def prepare_environment(cfg: TaskConfig) -> None:
    """Environment TensorFlow reads at import: quiet C++ INFO logs; on CPU, a BFC allocator
    limited to the budget when the agent has not set one (it normally does)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    budget = cfg.memory_budget_bytes
    if cfg.agent.device == "CPU" and budget > 0 \
            and "TF_CPU_ALLOCATOR_USE_BFC" not in os.environ:
        os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(max(1, budget >> 20))


def reachable(address: str, timeout: float = 0.5) -> bool:
    """Whether ``HOST:PORT`` accepts a TCP connection (a task's server is listening)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "localhost"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def wait_reachable(address: str, timeout_s: float, interval_s: float = 0.02) -> bool:
    """Polls ``address`` until it accepts a connection or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if reachable(address, timeout=min(0.5, max(0.01, deadline - time.monotonic()))):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
