"""One task process of an agent and the threads that watch it (``TaskProcess``): it is started
cold (``python -m strata.worker.task``) or handed to a warm process, its events become its
``TaskReport``, its output goes to ``task.log`` (rotated) and to a bounded buffer the agent sends
on, and its end is classified (``strata.worker.taskexit``) and reported. A stop kills its whole
process group."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from typing import Protocol

from strata.protos import strata_pb2 as pb
from strata import convert
from strata.taskconfig import NOTICE_FILE, AgentSettings
from strata.units import parse_size
from strata.oom import allocator_refusal
from strata.types import OutOfMemory
from strata.types import FailureKind, TaskReport, TaskState
from strata.worker.agentconfig import AgentConfig
from strata.worker.taskenv import STOP_GRACE_S, base_env, task_env
from strata.worker.taskexit import classify_exit
from strata.worker.warmpool import WarmPool

log = logging.getLogger("strata.worker")

#: the most log bytes of one task sent in one AppendLogs
MAX_LOG_CHUNK = 256 * 1024
#: a task's own log here is at most this: ``task.log`` is moved to ``task.log.1`` (replacing
#: the one before) when it reaches half of it, so a task that prints without end fills no disk
MAX_LOCAL_LOG_BYTES = 64 << 20
#: log bytes of one task kept to send while the coordinator does not take them (its disk is
#: full, a partition): beyond it the oldest are dropped, and the log says so
MAX_LOG_BUFFER_BYTES = 16 << 20


class TaskHost(Protocol):
    """What a task process needs of its agent (``strata.worker.agent.Agent``)."""

    cfg: AgentConfig
    blob_dir: str
    warm: WarmPool

    def fetch_blob(self, sha: str, suffix: str = "") -> str: ...

    def report(self, task: TaskProcess) -> None: ...

    def flush_logs(self, task: TaskProcess | None = None) -> None: ...

    def upload_outputs(self, task: TaskProcess, directory: str) -> None: ...


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

    def __init__(self, agent: TaskHost, cmd: pb.StartTask):
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
        with contextlib.suppress(FileNotFoundError):  # an earlier attempt's notice
            os.unlink(os.path.join(self.dir, NOTICE_FILE))
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

    def notice(self, step: int) -> None:
        """A notice (``strata drain --deadline``): the task saves a checkpoint once ``step``
        is done and stops (``strata.worker.notice``, which reads this file at each step)."""
        path = os.path.join(self.dir, NOTICE_FILE)
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                f.write(str(int(step)))
            os.replace(path + ".tmp", path)
            log.info("task %s/%s:%d: notice, save after step %d", self.job_id, self.role,
                     self.index, step)

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
