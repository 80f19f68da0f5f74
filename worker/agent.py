"""The worker agent: owns one device and its memory budget, runs and supervises task processes.

It registers with the coordinator, keeps a server stream open on which the coordinator pushes
StartTask / StopTask commands, heartbeats its memory status, and reports every task state change
at once. Each task is one ``python -m strata.worker.task`` process in its own process group, so a stop
kills the whole tree. The memory slice is enforced by TensorFlow's allocator: on CPU through
``TF_CPU_ALLOCATOR_USE_BFC`` + ``TF_CPU_BFC_MEM_LIMIT_IN_MB``, on GPU through the logical device's
``memory_limit`` (the task applies it from its config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
from typing import Callable
import time

import grpc

from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata import convert, exitcodes
from strata.taskconfig import AgentSettings
from strata.auth import with_token
from strata.tls import ClientTls, channel
from strata.units import parse_size
from strata.oom import allocator_refusal
from strata.types import OutOfMemory
from strata.types import DiskStatus, FailureKind, MemoryStatus, TaskReport, TaskState
from strata.worker.heartbeats import HeartbeatStream
from strata.worker.warm import ready_mark

log = logging.getLogger("strata.worker")

#: a task that crashes (SIGSEGV, SIGABRT, SIGBUS) with its allocator peak this close to its
#: budget is reported out of memory
NEAR_BUDGET = 0.9

RPC_TIMEOUT_S = 5.0
BLOB_TIMEOUT_S = 600.0  # one file a job brings or produces, fetched or sent whole
STOP_GRACE_S = 5.0
PORT_POOL = 4
LOG_FLUSH_INTERVAL_S = 0.5
#: how soon the heartbeat loop, waiting for its next beat, sees it must register again
REREGISTER_POLL_S = 0.1
#: a heartbeat this much later than due is logged (nothing in the loop waits that long)
HELD_UP_S = 2.0
FINISHED_KEEP_S = 120.0   # finished tasks stay in heartbeats this long, in case a report was lost
MAX_LOG_CHUNK = 256 * 1024
#: under --work-dir: the time of the latest heartbeat the coordinator accepted
ALIVE_FILE = "agent.alive"
REGISTER_BACKOFF_MAX_S = 5.0
#: each wait between heartbeats is the interval times 1 ± this, drawn afresh
HEARTBEAT_JITTER = 0.1
#: SIGTERM: how long the agent waits for the coordinator to move its tasks elsewhere
DRAIN_TIMEOUT_S = 60.0
#: a task's own log here is at most this: ``task.log`` is moved to ``task.log.1`` (replacing
#: the one before) when it reaches half of it, so a task that prints without end fills no disk
MAX_LOCAL_LOG_BYTES = 64 << 20
#: log bytes of one task kept to send while the coordinator does not take them (its disk is
#: full, a partition): beyond it the oldest are dropped, and the log says so
MAX_LOG_BUFFER_BYTES = 16 << 20
#: how often the agent counts its own files (``DiskMeter``) and collects fetched files no task
#: uses: those of a deleted job at once (``purge``), any other ``BLOB_KEEP_S`` after its last
#: use, and the least recently used beyond ``MAX_IDLE_BLOB_BYTES`` (a sweep of many models
#: keeps what it uses again, within a bound)
DISK_WALK_INTERVAL_S = 60.0
BLOB_KEEP_S = 3600.0
MAX_IDLE_BLOB_BYTES = 1 << 30


def advertise_host(coordinator: str) -> str:
    """The local address that routes to the coordinator: what task peers should dial."""
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _hold_port() -> socket.socket:
    """A free TCP port, held by a bound socket until a task is given it.

    An unheld port offered to the coordinator can be taken before its task binds it: as the
    local port of any outgoing connection on the host (free ports are in the ephemeral range),
    or by another agent on the same host picking it too; a task then fails with "Could not
    start gRPC server" (seen in a test run). A socket bound without SO_REUSEADDR and not
    listening keeps the port from every other bind and from the kernel's choice of ports for
    connections, and accepts nothing (a peer checking whether the task listens yet is not
    fooled). It is closed just before the task is started."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("", 0))
    return s


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
    #: its ``agent`` token (``strata.auth``; empty when the coordinator has no auth)
    token: str = dataclasses.field(default="", repr=False)


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


def blobs_needed(cmd: pb.StartTask) -> list[tuple[str, str]]:
    """The uploaded files a task's job names, as (SHA-256, the suffix its local copy takes:
    Keras reads a model file only by its extension)."""
    out = []
    model = cmd.config.spec.model
    if model.HasField("keras_file") and model.keras_file.sha256:
        out.append((model.keras_file.sha256, ".keras"))
    if cmd.config.spec.HasField("code") and cmd.config.spec.code.sha256:
        out.append((cmd.config.spec.code.sha256, ".tar.gz"))
    return out


class TaskProcess:
    """One task process and the threads that watch it."""

    def __init__(self, agent: "Agent", cmd: pb.StartTask):
        self.agent = agent
        self.job_id, self.role, self.index = cmd.job_id, cmd.role, cmd.index
        self.attempt = cmd.attempt
        self.budget = cmd.memory_budget_bytes
        self.dir = os.path.join(agent.cfg.work_dir, "jobs", cmd.job_id, f"{cmd.role}-{cmd.index}")
        # the job's outputs go to the shared directory when there is one (a restarted job's
        # new lead may run elsewhere); they also reach the coordinator (``upload_outputs``)
        self.output_dir = os.path.join(agent.cfg.shared_dir or agent.cfg.work_dir, "jobs",
                                       cmd.job_id, "output")
        self.status = TaskReport(job_id=self.job_id, role=self.role, index=self.index,
                                 state=TaskState.PENDING, attempt=self.attempt)
        self.proc: subprocess.Popen | None = None
        self.stop_requested = False
        #: the task sent its result (with or without test figures)
        self.has_result = False
        self.finished_at = 0.0
        self.error_kind = ""
        self._log_buf = bytearray()
        self._log_lock = threading.Lock()
        #: held while this task's logs are sent, so that chunks arrive in order whichever
        #: thread sends them (the log loop, or the task's end)
        self.sending_logs = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._cmd = cmd
        #: set at the first training step or the end: the warm pool refills then
        self.settled = threading.Event()

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.job_id, self.role, self.index)

    def start(self) -> None:
        try:
            self._start()
        except Exception as e:  # noqa: BLE001 - any launch problem is this task's failure
            log.exception("cannot start task %s/%s:%d", self.job_id, self.role, self.index)
            self._finish(TaskState.FAILED, FailureKind.LAUNCH, -1, f"cannot start the task: {e}")

    def _start(self) -> None:
        cmd = self._cmd
        os.makedirs(self.dir, exist_ok=True)
        # The contract passes through as the coordinator built it; the agent fills only its
        # own settings (the task sees the agent's one GPU as GPU:0: CUDA_VISIBLE_DEVICES below).
        for sha, suffix in blobs_needed(cmd):
            self.agent.fetch_blob(sha, suffix)
        config = convert.with_agent_settings(cmd.config, AgentSettings(
            output_dir=os.path.abspath(self.output_dir), threads=self.agent.cfg.threads,
            device="GPU:0" if self.agent.cfg.device.startswith("GPU") else "CPU",
            blob_dir=os.path.abspath(self.agent.blob_dir),
            shared_dir=os.path.abspath(self.agent.cfg.shared_dir) if self.agent.cfg.shared_dir
            else "", data_roots=self.agent.cfg.data_roots))
        config_path = os.path.join(self.dir, "config.pb")
        with open(config_path, "wb") as f:
            f.write(config.SerializeToString())
        budget_mib = max(1, self.budget // (1 << 20))
        own = task_env(self.agent.cfg.device, cmd.tf_config, budget_mib)
        warm = self.agent.warm.take(self.settled)
        if warm is not None:
            # a process with TensorFlow imported already: it takes the task's own settings
            # before anything of TensorFlow's runtime starts (``strata.worker.warm``)
            try:
                order = {"config": config_path, "cwd": self.dir, "env": own}
                assert warm.proc.stdin is not None
                warm.proc.stdin.write((json.dumps(order) + "\n").encode())
                warm.proc.stdin.flush()
            except OSError:
                warm.close()
                warm = None
        if warm is not None:
            self.proc, read_fd = warm.proc, warm.events_fd
            how = "warm"
        else:
            env = base_env(self.agent.cfg.device)
            env.update(own)
            read_fd, write_fd = os.pipe()
            try:
                self.proc = subprocess.Popen(
                    [self.agent.cfg.python, "-m", "strata.worker.task", "--config", config_path,
                     "--events-fd", str(write_fd)],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    pass_fds=(write_fd,), start_new_session=True, cwd=self.dir, env=env)
            except OSError as e:
                os.close(read_fd)
                os.close(write_fd)
                self._finish(TaskState.FAILED, FailureKind.LAUNCH, -1,
                             f"cannot start the task: {e}")
                return
            os.close(write_fd)
            how = "cold"
        self.status.state = TaskState.STARTING
        self.agent.report(self)
        log.info("task %s/%s:%d started (pid %d, %s, budget %d MiB)", self.job_id, self.role,
                 self.index, self.proc.pid, how, budget_mib)
        for target, args in ((self._read_logs, (self.proc.stdout,)), (self._read_events, (read_fd,)),
                             (self._wait, ())):
            t = threading.Thread(target=target, args=args, daemon=True,
                                 name=f"{target.__name__}-{self.role}{self.index}")
            t.start()
            self._threads.append(t)

    # --- watchers -----------------------------------------------------------------------------

    def _read_logs(self, stream) -> None:
        path = os.path.join(self.dir, "task.log")
        local = open(path, "ab")
        try:
            written = local.tell()
            for line in iter(stream.readline, b""):
                if written + len(line) > MAX_LOCAL_LOG_BYTES // 2:
                    local.close()  # the older half, as task.log.1
                    os.replace(path, path + ".1")
                    local, written = open(path, "ab"), 0
                local.write(line)
                local.flush()
                written += len(line)
                with self._log_lock:
                    self._log_buf += line
                    over = len(self._log_buf) - MAX_LOG_BUFFER_BYTES
                    if over > 0:
                        del self._log_buf[:over]
                        self._log_buf[:0] = (b"[strata] the agent dropped %d bytes of this log "
                                             b"the coordinator did not take\n" % over)
        finally:
            local.close()
        stream.close()

    def take_logs(self) -> bytes:
        with self._log_lock:
            data = bytes(self._log_buf[:MAX_LOG_CHUNK])
            del self._log_buf[:MAX_LOG_CHUNK]
        return data

    def drop_logs(self) -> None:
        """Forgets the logs not sent yet (the coordinator no longer takes them)."""
        with self._log_lock:
            self._log_buf.clear()

    def return_logs(self, data: bytes) -> None:
        """Puts back a chunk the coordinator did not take, to be sent first next time."""
        with self._log_lock:
            self._log_buf[:0] = data

    def _read_events(self, fd: int) -> None:
        with os.fdopen(fd, "r", encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(ev, dict):
                    self._on_event(ev)

    def _on_event(self, ev: dict) -> None:
        try:
            self._apply_event(ev)
        except (TypeError, ValueError, AttributeError) as e:  # a malformed event is not fatal
            log.warning("ignoring malformed event from %s:%d: %s", self.role, self.index, e)

    def _apply_event(self, ev: dict) -> None:
        s = self.status
        kind = ev.get("event")
        mem = ev.get("memory") or {}
        if mem:
            s.in_use_bytes = int(mem.get("current", 0))
            s.peak_bytes = max(s.peak_bytes, int(mem.get("peak", 0)))
        if kind == "started":
            s.state = TaskState.RUNNING
        elif kind == "first_step":
            s.first_step_time = float(ev.get("time", time.time()))
            self.settled.set()
        elif kind == "progress":
            s.state = TaskState.RUNNING
            s.step = int(ev.get("step", 0))
            s.total_steps = int(ev.get("total_steps", 0))
            s.loss = float(ev["loss"]) if ev.get("loss") is not None else float("nan")
            s.examples_per_sec = float(ev.get("examples_per_sec") or 0.0)
        elif kind == "result":
            self.has_result = True
            acc = ev.get("test_accuracy")  # None: the job has no test split
            s.test_accuracy = float(acc) if acc is not None else None
            s.test_loss = float(ev["test_loss"]) if ev.get("test_loss") is not None else (
                float("nan") if acc is not None else None)
            s.weights_sha256 = str(ev.get("weights_sha256") or "")
            s.model_path = str(ev.get("model_path") or "")
            digests = ev.get("replica_weights_sha256") or []
            s.replica_weights_sha256 = [str(d) for d in digests][:4096]
            metrics = ev.get("test_metrics") or {}
            s.test_metrics = {str(k)[:64]: float(v) for k, v in list(metrics.items())[:64]
                              if isinstance(v, (int, float)) and math.isfinite(v)}
        elif kind == "setup":
            s.training = str(ev.get("training") or "")[:1000]
        elif kind == "note":
            note = str(ev.get("message") or "")[:500]
            if note and note not in s.notes and len(s.notes) < 8:
                s.notes.append(note)
        elif kind == "checkpoint":
            s.checkpoint_step = max(s.checkpoint_step, int(ev.get("step", 0)))
        elif kind == "resumed":
            s.resumed_step = max(0, int(ev.get("step", 0)))
        elif kind == "peaks":  # where its peak grew (in its log) and its largest allocation
            s.largest_alloc_bytes = max(0, int(ev.get("largest_alloc") or 0))
        elif kind in ("memory", "stopped"):
            pass  # a server task (PS, worker or pipeline stage): its memory figures, above
        elif kind == "error":
            self.error_kind = str(ev.get("kind", "error"))
            s.message = str(ev.get("message", ""))[:2000]
            oom = ev.get("oom")
            if isinstance(oom, dict):
                s.oom = OutOfMemory(
                    task=str(oom.get("task") or "")[:64],
                    allocation_bytes=max(0, int(oom.get("allocation_bytes") or 0)),
                    shape=tuple(int(d) for d in (oom.get("shape") or ())[:16]),
                    dtype=str(oom.get("dtype") or "")[:32], op=str(oom.get("op") or "")[:200])
        else:
            return
        self.agent.report(self)

    def _wait(self) -> None:
        assert self.proc is not None
        code = self.proc.wait()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5.0)
        self.agent.flush_logs(self)
        refusal: list[str] = []

        def refused() -> str:
            if not refusal:
                refusal.append(self._refused())
            return refusal[0]
        outcome = classify_exit(
            code, stopped=self.stop_requested, has_result=self.has_result,
            error_kind=self.error_kind, message=self.status.message,
            peak=self.status.peak_bytes, budget=self.budget, log_tail=self._log_tail,
            refused=refused)
        if outcome[1] == FailureKind.OOM and self.status.oom is None and refusal and refusal[0]:
            # what the coordinator's account and its next budget start from
            try:
                self.status.oom = OutOfMemory(allocation_bytes=parse_size(refusal[0]))
            except ValueError:
                pass
        if outcome[0] == TaskState.SUCCEEDED and self.status.model_path:
            # the job's outputs reach the coordinator before the task is reported done, so a
            # job that has SUCCEEDED can be downloaded at once
            self.agent.upload_outputs(self, self.output_dir)
        self._finish(*outcome)

    def _log_end(self, nbytes: int) -> str:
        """The last ``nbytes`` of the task's log (empty if it cannot be read)."""
        try:
            with open(os.path.join(self.dir, "task.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def _log_tail(self) -> str:
        return " | ".join(self._log_end(600).strip().splitlines()[-3:])

    def _refused(self) -> str:
        """An allocation the task's allocator logged it refused, in its log's last 1 MiB (the
        refusal is followed by the allocator's summary: thousands of lines)."""
        return allocator_refusal(self._log_end(1 << 20))

    def _finish(self, state: TaskState, failure: FailureKind, code: int, message: str) -> None:
        s = self.status
        s.state, s.failure, s.exit_code, s.message = state, failure, code, message
        s.in_use_bytes = 0
        self.finished_at = time.time()
        self.settled.set()
        log.info("task %s/%s:%d %s%s", self.job_id, self.role, self.index, state.value,
                 f" ({failure.value}: {message})" if failure != FailureKind.NONE else "")
        self.agent.report(self)

    # --- control ------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM to the task's process group, SIGKILL after a grace period."""
        self.stop_requested = True
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=STOP_GRACE_S)
        # The group may hold children that outlived the leader.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    @property
    def running(self) -> bool:
        return not self.status.state.final


def base_env(device: str) -> dict[str, str]:
    """What every task process of this agent starts with, warm or not: the agent's one device,
    quiet C++ logs, and the project importable however the agent runs."""
    env = dict(os.environ)
    env["TF_CPP_MIN_LOG_LEVEL"] = env.get("TF_CPP_MIN_LOG_LEVEL", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1] if device.startswith("GPU") else ""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def task_env(device: str, tf_config: str, budget_mib: int) -> dict[str, str]:
    """What is one task's own: its cluster and, on CPU, its allocator's limit. TensorFlow reads
    these when the strategy and the CPU device are created, not at import, so a warm process
    takes them as well as a new one."""
    env = {"TF_CONFIG": tf_config}
    if not device.startswith("GPU"):
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        env["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = str(budget_mib)
    return env


@dataclasses.dataclass
class Warm:
    proc: subprocess.Popen
    events_fd: int
    dir: str  # its working directory, where it marks itself ready

    @property
    def is_ready(self) -> bool:
        return os.path.exists(ready_mark(self.dir, self.proc.pid))

    def close(self) -> None:
        """Ends a warm process that was never given a task (its whole process group)."""
        with contextlib.suppress(OSError):
            os.close(self.events_fd)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_GRACE_S)
        with contextlib.suppress(OSError):
            os.unlink(ready_mark(self.dir, self.proc.pid))


#: the longest a warm pool waits for the task that took a process to start training before
#: it refills (``WarmPool.take``)
REFILL_AFTER_S = 30.0


class WarmPool:
    """``--warm-pool N``: processes with TensorFlow imported, ready for a task
    (``strata.worker.warm``). A task takes one if one is ready (else starts cold) and the pool
    refills in the background. The agent stops every one it started when it stops."""

    def __init__(self, size: int, python: str, device: str, work_dir: str):
        self.size = size
        self.python, self.device = python, device
        self.dir = os.path.join(work_dir, "warm")
        self.ready: list[Warm] = []
        self.lock = threading.Lock()
        self.closed = False

    def _spawn(self) -> Warm | None:
        os.makedirs(self.dir, exist_ok=True)
        read_fd, write_fd = os.pipe()
        try:
            proc = subprocess.Popen(
                [self.python, "-m", "strata.worker.warm", "--events-fd", str(write_fd)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                pass_fds=(write_fd,), start_new_session=True, cwd=self.dir,
                env=base_env(self.device))
        except OSError as e:
            log.warning("cannot start a warm task process: %s", e)
            os.close(read_fd)
            return None
        finally:
            os.close(write_fd)
        return Warm(proc, read_fd, self.dir)

    def fill(self) -> None:
        while True:
            with self.lock:
                if self.closed or len(self.ready) >= self.size:
                    return
            warm = self._spawn()
            if warm is None:
                return
            with self.lock:
                if self.closed:
                    warm.close()
                    return
                self.ready.append(warm)

    def take(self, settled: threading.Event | None = None) -> Warm | None:
        """A ready process, or None. The pool refills once ``settled`` is set (the task that
        took one reached its first step or ended) or after ``REFILL_AFTER_S``: a refill imports
        TensorFlow, seconds of CPU that would otherwise compete with the starting task's own
        (on 2 cores it made a warm start 2.4-3.0 s instead of 1.5 s)."""
        with self.lock:
            # one that has finished importing first (``strata.worker.warm`` marks it), else
            # the oldest: still importing, it is further along than a new process
            self.ready.sort(key=lambda w: not w.is_ready)
            while self.ready:
                warm = self.ready.pop(0)
                if warm.proc.poll() is None:
                    break
                warm.close()  # died waiting: start another
            else:
                warm = None
        if self.size and not self.closed:
            threading.Thread(target=self._refill_after, args=(settled,), daemon=True,
                             name="warm-pool").start()
        return warm

    def _refill_after(self, settled: threading.Event | None) -> None:
        if settled is not None:
            settled.wait(REFILL_AFTER_S)
        self.fill()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            ready, self.ready = self.ready, []
        for warm in ready:
            warm.close()


class DiskMeter:
    """The agent's disk: the bytes under its work directory (task folders, fetched files),
    counted every ``DISK_WALK_INTERVAL_S`` by the log thread, and what its file system has
    left, read at each heartbeat (one ``statvfs``)."""

    def __init__(self, root: str):
        self.root = root
        self.used = 0

    def walk(self) -> int:
        total = 0
        for base, _dirs, files in os.walk(self.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(base, name)).st_size
                except OSError:
                    pass
        self.used = total
        return total

    def status(self) -> DiskStatus:
        try:
            st = os.statvfs(self.root)
        except OSError:
            return DiskStatus(used_bytes=self.used)
        return DiskStatus(used_bytes=self.used, free_bytes=st.f_bavail * st.f_frsize,
                          total_bytes=st.f_blocks * st.f_frsize)


class Agent:
    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        if not cfg.host:
            cfg.host = advertise_host(cfg.coordinator)
        os.makedirs(cfg.work_dir, exist_ok=True)
        if cfg.shared_dir:
            os.makedirs(os.path.join(cfg.shared_dir, "jobs"), exist_ok=True)
        self.channel = channel(cfg.coordinator, cfg.tls)
        self.stub = pb_grpc.ClusterServiceStub(with_token(self.channel, cfg.token))
        self.heartbeats = HeartbeatStream(self.stub, RPC_TIMEOUT_S)
        self.session = ""
        self.heartbeat_interval = 1.0
        self.tasks: dict[tuple[str, str, int], TaskProcess] = {}
        self.lock = threading.RLock()
        self.peak_bytes = 0
        #: the ports offered to the coordinator, each held here until a task is given it
        self._held: dict[int, socket.socket] = {}
        self.free_ports: list[int] = []
        self._refill_ports()
        self.stopping = threading.Event()
        #: SIGTERM: the coordinator moves this agent's jobs elsewhere before it stops
        self.draining = threading.Event()
        self._reregister = threading.Event()
        self.blob_dir = os.path.join(cfg.work_dir, "blobs")
        self._blob_lock = threading.Lock()
        self.disk = DiskMeter(cfg.work_dir)
        #: job id -> the files fetched for its tasks here (deleted with the job, ``purge``)
        self._blobs_of: dict[str, set[str]] = {}
        self.warm = WarmPool(cfg.warm_pool, cfg.python, cfg.device, cfg.work_dir)
        if cfg.warm_pool:
            threading.Thread(target=self.warm.fill, daemon=True, name="warm-pool").start()

    # --- coordinator calls --------------------------------------------------------------------

    def _reports(self) -> list[pb.TaskStatus]:
        now = time.time()
        with self.lock:
            for key in [k for k, t in self.tasks.items()
                        if not t.running and now - t.finished_at > FINISHED_KEEP_S]:
                del self.tasks[key]
            return [convert.report_to_proto(t.status) for t in self.tasks.values()]

    def memory(self) -> MemoryStatus:
        with self.lock:
            live = [t for t in self.tasks.values() if t.running]
            in_use = sum(t.status.in_use_bytes for t in live)
            # Peak: what the tasks running now reached, together (an earlier job's is gone
            # with it: each task's own stays with the task, in its job)
            self.peak_bytes = sum(t.status.peak_bytes for t in live)
            reserved = sum(t.budget for t in live)
        return MemoryStatus(budget_bytes=self.cfg.budget_bytes, reserved_bytes=reserved,
                            in_use_bytes=in_use, peak_bytes=self.peak_bytes)

    @property
    def alive_file(self) -> str:
        """Touched at each heartbeat the coordinator accepted: ``strata health
        --heartbeat-file`` (a container's liveness and readiness probe) reads its age."""
        return os.path.join(self.cfg.work_dir, ALIVE_FILE)

    def _alive(self) -> None:
        try:
            with open(self.alive_file + ".tmp", "w") as f:
                f.write(f"{time.time():.3f} {self.cfg.name}\n")
            os.replace(self.alive_file + ".tmp", self.alive_file)
        except OSError as e:
            log.warning("cannot write %s: %s", self.alive_file, e)

    def register(self) -> None:
        resp = self.stub.RegisterAgent(pb.RegisterAgentRequest(
            name=self.cfg.name, host=self.cfg.host, device=self.cfg.device,
            budget_bytes=self.cfg.budget_bytes, free_ports=self.free_ports, tasks=self._reports(),
            work_dir=os.path.abspath(self.cfg.work_dir), pid=os.getpid(),
            shared_dir=os.path.abspath(self.cfg.shared_dir) if self.cfg.shared_dir else "",
            draining=self.draining.is_set(), data_roots=list(self.cfg.data_roots),
            cpu_kernels=self.cfg.cpu_kernels),
            timeout=RPC_TIMEOUT_S)
        self.session = resp.session
        self._alive()
        self.heartbeat_interval = resp.heartbeat_interval_s or 1.0
        log.info("registered with %s as %s (%s, host %s)", self.cfg.coordinator, self.cfg.name,
                 self.cfg.device, self.cfg.host)

    def report(self, task: TaskProcess) -> None:
        session = self.session
        if not session:
            return  # the next registration carries it
        try:
            self.stub.ReportTask(pb.ReportTaskRequest(
                name=self.cfg.name, session=session, status=convert.report_to_proto(task.status)),
                timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning("report of %s:%d failed (%s); the next heartbeat carries it",
                        task.role, task.index, e.code())
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._reregister.set()

    def flush_logs(self, task: TaskProcess | None = None) -> None:
        with self.lock:
            tasks = [task] if task is not None else list(self.tasks.values())
        for t in tasks:
            with t.sending_logs:
                while True:
                    data = t.take_logs()
                    if not data:
                        break
                    try:
                        self.stub.AppendLogs(pb.AppendLogsRequest(
                            name=self.cfg.name, session=self.session, job_id=t.job_id,
                            role=t.role, index=t.index, data=data, attempt=t.attempt),
                            timeout=RPC_TIMEOUT_S)
                    except grpc.RpcError as e:
                        if e.code() == grpc.StatusCode.PERMISSION_DENIED:
                            # the coordinator no longer takes this task's logs (its attempt
                            # moved on, or it ended): they stay in task.log here
                            t.drop_logs()
                            break
                        t.return_logs(data)  # sent again after the next (re-)registration
                        break

    def _log_loop(self) -> None:
        """Sends the tasks' logs several times a second, so ``strata logs --follow`` stays
        live. Apart from the heartbeats: a slow AppendLogs (5 s at most, for each task with
        logs) in the heartbeat loop spaced heartbeats out past the heartbeat timeout. Every
        ``DISK_WALK_INTERVAL_S`` it also counts the agent's files and collects fetched ones
        no task uses."""
        next_walk = 0.0
        while not self.stopping.wait(LOG_FLUSH_INTERVAL_S):
            try:
                self.flush_logs()
                if time.monotonic() >= next_walk:
                    next_walk = time.monotonic() + DISK_WALK_INTERVAL_S
                    self.collect_blobs()
                    self.disk.walk()
            except Exception:  # noqa: BLE001 - the logs of one round; the next round retries
                log.exception("sending the tasks' logs failed")

    def _needed_blobs(self) -> set[str]:
        """The digests of the files the running tasks' jobs name."""
        with self.lock:
            return {sha for t in self.tasks.values() if t.running
                    for sha, _suffix in blobs_needed(t._cmd)}

    def collect_blobs(self, keep_s: float = BLOB_KEEP_S,
                      max_idle_bytes: int = MAX_IDLE_BLOB_BYTES, only: set[str] | None = None
                      ) -> int:
        """Deletes fetched files (a job's .keras file, its code) no running task's job names:
        those not used for ``keep_s``, then the least recently used beyond
        ``max_idle_bytes`` (``only``: those of these digests, whatever their age). Returns
        how many."""
        needed = self._needed_blobs()
        try:
            names = os.listdir(self.blob_dir)
        except OSError:
            return 0
        now = time.time()
        gone = 0
        with self._blob_lock:
            idle = []
            for name in names:
                path = os.path.join(self.blob_dir, name)
                if name[:64] in needed:
                    continue
                try:
                    st = os.stat(path)
                    if (only is not None and name[:64] in only) or \
                            (only is None and now - st.st_mtime >= keep_s):
                        os.unlink(path)
                        gone += 1
                    else:
                        idle.append((st.st_mtime, st.st_size, path))
                except OSError:
                    pass
            if only is None:
                total = sum(size for _, size, _ in idle)
                for _mtime, size, path in sorted(idle):  # least recently used first
                    if total <= max_idle_bytes:
                        break
                    try:
                        os.unlink(path)
                        gone += 1
                        total -= size
                    except OSError:
                        pass
        return gone

    # --- commands -----------------------------------------------------------------------------

    def handle(self, cmd: pb.AgentCommand) -> None:
        which = cmd.WhichOneof("command")
        if which == "start":
            self.start_task(cmd.start)
        elif which == "stop":
            s = cmd.stop
            # the processes to stop are chosen now, in command order (a start that follows may
            # replace one); stopping them can take seconds and runs apart
            victims = self._victims(s.job_id, s.role, s.index, s.attempt)
            threading.Thread(target=self._stop, args=(victims,), daemon=True).start()
        elif which == "purge":
            threading.Thread(target=self.purge, args=(cmd.purge.job_id,), daemon=True).start()

    def fetch_blob(self, sha: str, suffix: str = "") -> str:
        """The local copy of blob ``sha`` (a job's .keras file or code archive), fetched from
        the coordinator once and checked against its digest: ``BLOB_DIR/SHA256SUFFIX``."""
        path = os.path.join(self.blob_dir, sha + suffix)
        with self._blob_lock:
            if os.path.isfile(path):
                os.utime(path)  # used now: kept BLOB_KEEP_S from here (``collect_blobs``)
                return path
            os.makedirs(self.blob_dir, exist_ok=True)
            h = hashlib.sha256()
            tmp = f"{path}.part-{os.getpid()}"
            try:
                with open(tmp, "wb") as f:
                    for chunk in self.stub.FetchBlob(pb.FetchBlobRequest(
                            name=self.cfg.name, session=self.session, sha256=sha),
                            timeout=BLOB_TIMEOUT_S):
                        h.update(chunk.data)
                        f.write(chunk.data)
                if h.hexdigest() != sha:
                    raise RuntimeError(f"blob {sha[:12]} arrived corrupted "
                                       f"(digest {h.hexdigest()[:12]})")
                os.replace(tmp, path)
            except grpc.RpcError as e:
                raise RuntimeError(f"cannot fetch blob {sha[:12]} from the coordinator: "
                                   f"{e.code().name} {e.details()}") from None
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            log.info("fetched blob %s (%d bytes)", sha[:12], os.path.getsize(path))
            return path

    def upload_outputs(self, task: "TaskProcess", directory: str) -> None:
        """Sends every file under ``directory`` to the coordinator as the outputs of
        ``task``'s job, then removes them here: the coordinator's copy is the one kept (what
        it refused, over a quota or a full disk, stays here until the job is deleted)."""
        job_id = task.job_id
        sent = True
        for base, _dirs, files in os.walk(directory):
            for name in sorted(files):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, directory)

                def chunks(path: str = path, rel: str = rel):
                    size = os.path.getsize(path)
                    offset = 0
                    with open(path, "rb") as f:
                        while True:
                            data = f.read(1 << 20)
                            if not data and offset:
                                return
                            yield pb.OutputChunk(name=self.cfg.name, session=self.session,
                                                 job_id=job_id, role=task.role,
                                                 index=task.index, attempt=task.attempt,
                                                 chunk=pb.FileChunk(path=rel, data=data,
                                                                    offset=offset, size=size))
                            offset += len(data)
                            if not data:
                                return
                try:
                    self.stub.UploadOutput(chunks(), timeout=BLOB_TIMEOUT_S)
                    log.info("uploaded output %s of %s", rel, job_id)
                except (grpc.RpcError, OSError) as e:
                    sent = False
                    why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) \
                        else str(e)
                    log.warning("cannot upload output %s of %s (%s); it stays in %s", rel,
                                job_id, why, directory)
        if sent:
            shutil.rmtree(directory, ignore_errors=True)

    def purge(self, job_id: str) -> None:
        """The job was deleted: its folders here (task folders, and on the shared directory
        its checkpoints and outputs) go, unless a task of it still runs here."""
        if not job_id or "/" in job_id or job_id.startswith("."):
            return
        with self.lock:
            if any(t.job_id == job_id and t.running for t in self.tasks.values()):
                return
        for root in (self.cfg.work_dir, self.cfg.shared_dir):
            if root:
                shutil.rmtree(os.path.join(root, "jobs", job_id), ignore_errors=True)
        with self.lock:
            mine = self._blobs_of.pop(job_id, set())
            others = set().union(*self._blobs_of.values())
        # the files fetched for it go too, unless another job here names them
        self.collect_blobs(only=mine - others)
        log.info("deleted the files of job %s", job_id)

    def start_task(self, start: pb.StartTask) -> None:
        key = (start.job_id, start.role, start.index)
        with self.lock:
            old = self.tasks.get(key)
            if old is not None and old.running:
                if old.attempt == start.attempt:
                    return  # a repeated delivery
            else:
                old = None
            task = self.tasks[key] = TaskProcess(self, start)
            self._blobs_of.setdefault(start.job_id, set()).update(
                sha for sha, _suffix in blobs_needed(start))
            try:
                port = int(json.loads(start.tf_config)["cluster"][start.role][start.index].rsplit(":", 1)[1])
                if port in self.free_ports:
                    self.free_ports.remove(port)
                held = self._held.pop(port, None)
                if held is not None:
                    held.close()  # the task binds it next
            except (KeyError, IndexError, ValueError):
                pass
            self._refill_ports()
        if old is not None:
            # an earlier attempt of the task still runs (its agent was cut off while the job
            # restarted): it goes first, never beside the new one. Stopping takes up to
            # 2 x STOP_GRACE_S: apart from the command stream and the heartbeats.
            log.info("task %s/%s:%d attempt %d replaces attempt %d", start.job_id, start.role,
                     start.index, start.attempt, old.attempt)

            def replace(old: TaskProcess = old) -> None:
                old.stop()
                task.start()
            threading.Thread(target=replace, daemon=True, name="replace-attempt").start()
        elif blobs_needed(start):
            # fetching a large file must not hold up the command stream
            threading.Thread(target=task.start, daemon=True, name="start-with-blobs").start()
        else:
            task.start()

    def _victims(self, job_id: str, role: str = "", index: int = 0,
                 attempt: int = 0) -> list[TaskProcess]:
        with self.lock:
            return [t for t in self.tasks.values() if t.job_id == job_id and t.running
                    and (not role or (t.role == role and t.index == index))
                    and (not attempt or t.attempt == attempt)]

    def stop_tasks(self, job_id: str, role: str = "", index: int = 0, attempt: int = 0) -> None:
        self._stop(self._victims(job_id, role, index, attempt))

    def _stop(self, victims: list[TaskProcess]) -> None:
        for t in victims:
            log.info("stopping task %s/%s:%d", t.job_id, t.role, t.index)
            t.stop()

    def stop_all(self) -> None:
        with self.lock:
            victims = [t for t in self.tasks.values() if t.running]
        threads = [threading.Thread(target=t.stop, daemon=True) for t in victims]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=2 * STOP_GRACE_S + 1)

    # --- loops --------------------------------------------------------------------------------

    def _command_loop(self, session: str) -> None:
        try:
            for cmd in self.stub.Connect(pb.ConnectRequest(name=self.cfg.name, session=session)):
                try:
                    self.handle(cmd)
                except Exception:  # noqa: BLE001 - one bad command must not stop the stream
                    log.exception("command failed: %s", cmd)
        except grpc.RpcError as e:
            if not self.stopping.is_set():
                log.warning("command stream closed (%s)", e.code())
        if not self.stopping.is_set() and self.session == session:
            self._reregister.set()

    def run(self) -> None:
        """Registers (retrying with backoff), then heartbeats until stopped."""
        backoff = 0.2
        threading.Thread(target=self._log_loop, daemon=True, name="logs").start()
        due = 0.0  # when the next heartbeat should go
        while not self.stopping.is_set():
            if not self.session or self._reregister.is_set():
                self._reregister.clear()
                self.session = ""
                try:
                    self.register()
                except grpc.RpcError as e:
                    # jittered, so that the agents of a cluster do not all come back at once
                    # when a restarted coordinator listens again; tasks train on meanwhile
                    wait = backoff * random.uniform(0.5, 1.5)
                    log.warning("cannot register with %s (%s); retrying in %.1f s",
                                self.cfg.coordinator, e.code(), wait)
                    self.stopping.wait(wait)
                    backoff = min(backoff * 2, REGISTER_BACKOFF_MAX_S)
                    continue
                backoff, due = 0.2, 0.0
                threading.Thread(target=self._command_loop, args=(self.session,), daemon=True,
                                 name="commands").start()
            late = time.monotonic() - due
            if due and late > HELD_UP_S:
                # the process, or the machine, was held up: said, so that a coordinator that
                # calls this agent lost can be told apart from one that stopped hearing it
                log.warning("a heartbeat went %.1f s late", late)
            try:
                resp = self.heartbeats.send(pb.HeartbeatRequest(
                    name=self.cfg.name, session=self.session,
                    memory=convert.memory_to_proto(self.memory()), tasks=self._reports(),
                    free_ports=self.free_ports, sent_at=time.time(),
                    disk=convert.disk_to_proto(self.disk.status())))
                if resp.reregister:
                    self._reregister.set()
                    continue
                self._alive()
            except grpc.RpcError as e:
                log.warning("heartbeat failed (%s)", e.code())
                if e.code() == grpc.StatusCode.UNAVAILABLE:
                    self._reregister.set()
            # jittered: agents that registered together (after a coordinator restart, a
            # cluster brought up at once) drift apart instead of beating together for ever
            due = time.monotonic() + self.heartbeat_interval * random.uniform(
                1 - HEARTBEAT_JITTER, 1 + HEARTBEAT_JITTER)
            while not self.stopping.is_set() and not self._reregister.is_set():
                left = due - time.monotonic()
                if left <= 0:
                    break
                self.stopping.wait(min(REREGISTER_POLL_S, left))

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """SIGTERM: asks the coordinator to drain this agent (no new tasks; its jobs restart
        elsewhere from their checkpoints) and waits, at most ``timeout_s``, for its tasks to be
        stopped that way. Without a coordinator to ask, ``shutdown`` stops them directly."""
        self.draining.set()
        deadline = time.monotonic() + timeout_s
        try:
            self.stub.DrainAgent(pb.DrainAgentRequest(name=self.cfg.name, session=self.session),
                                 timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning("cannot drain through the coordinator (%s); stopping the tasks", e.code())
            return
        log.info("draining: waiting up to %.0f s for this agent's tasks to move", timeout_s)
        while time.monotonic() < deadline and not self.stopping.is_set():
            with self.lock:
                if not any(t.running for t in self.tasks.values()):
                    log.info("drained")
                    return
            self.stopping.wait(0.5)

    def _refill_ports(self) -> None:
        while len(self.free_ports) < PORT_POOL:
            s = _hold_port()
            port = s.getsockname()[1]
            self._held[port] = s
            self.free_ports.append(port)

    def shutdown(self) -> None:
        self.stopping.set()
        self.warm.close()
        with self.lock:
            for s in self._held.values():
                s.close()
            self._held.clear()
        self.stop_all()
        self.flush_logs()
        self.heartbeats.close()
        self.channel.close()


def main(cfg: AgentConfig) -> int:
    agent = Agent(cfg)
    done = threading.Event()
    drain = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        if signum == signal.SIGTERM and not drain.is_set():
            drain.set()  # drain first (below); a second SIGTERM stops at once
        else:
            agent.stopping.set()
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"strata worker {cfg.name}: device {cfg.device}, budget {cfg.budget_bytes} bytes, "
          f"coordinator {cfg.coordinator}", flush=True)
    runner = threading.Thread(target=agent.run, daemon=True, name="agent")
    runner.start()
    while not done.wait(1.0):
        if not runner.is_alive():
            log.error("the agent loop stopped unexpectedly")
            break
    if drain.is_set() and not agent.stopping.is_set():
        agent.drain()
    agent.shutdown()
    runner.join(timeout=RPC_TIMEOUT_S + 1)
    return 0
