"""The worker agent: owns one device and its memory budget, runs and supervises task processes.

It registers with the coordinator, keeps a server stream open on which the coordinator pushes
StartTask / StopTask commands, heartbeats its memory status, and reports every task state change
at once. Each task is one ``python -m strata.worker.task`` process in its own process group, so a stop
kills the whole tree. The memory slice is enforced by TensorFlow's allocator: on CPU through
``TF_CPU_ALLOCATOR_USE_BFC`` + ``TF_CPU_BFC_MEM_LIMIT_IN_MB``, on GPU through the logical device's
``memory_limit`` (the task applies it from its config). One task process and its watchers are
``strata.worker.taskprocess``; the warm pool ``strata.worker.warmpool``; its disk
``strata.worker.disk``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import threading
import time

import grpc

from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata import convert
from strata.auth import with_token
from strata.tls import channel
from strata.types import MemoryStatus
from strata.worker.agentconfig import AgentConfig
from strata.worker.disk import DiskMeter, collect_blobs
from strata.worker.heartbeats import HeartbeatStream
from strata.worker.taskenv import STOP_GRACE_S
from strata.worker.taskprocess import TaskProcess, blobs_needed
from strata.worker.warmpool import WarmPool

log = logging.getLogger("strata.worker")

RPC_TIMEOUT_S = 5.0
BLOB_TIMEOUT_S = 600.0  # one file a job brings or produces, fetched or sent whole
PORT_POOL = 4
LOG_FLUSH_INTERVAL_S = 0.5
#: how soon the heartbeat loop, waiting for its next beat, sees it must register again
REREGISTER_POLL_S = 0.1
#: a heartbeat this much later than due is logged (nothing in the loop waits that long)
HELD_UP_S = 2.0
FINISHED_KEEP_S = 120.0   # finished tasks stay in heartbeats this long, in case a report was lost
#: under --work-dir: the time of the latest heartbeat the coordinator accepted
ALIVE_FILE = "agent.alive"
REGISTER_BACKOFF_MAX_S = 5.0
#: each wait between heartbeats is the interval times 1 ± this, drawn afresh
HEARTBEAT_JITTER = 0.1
#: SIGTERM: how long the agent waits for the coordinator to move its tasks elsewhere
DRAIN_TIMEOUT_S = 60.0
#: of the time a notice leaves (``--notice``), the share its jobs may take to reach and save a
#: checkpoint; the rest is for their processes to stop and the agent to go
NOTICE_SAVE_SHARE = 0.8
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


class Agent:
    """One worker agent: its registration and heartbeats, the commands it takes, its tasks
    and their logs, and the files it fetches and keeps."""

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
        return collect_blobs(self.blob_dir, self._blob_lock, needed, keep_s, max_idle_bytes,
                             only)

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
        elif which == "notice":
            n = cmd.notice
            for t in self._victims(n.job_id, attempt=n.attempt):
                t.notice(n.step)

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

    def drain(self, timeout_s: float | None = None) -> None:
        """SIGTERM: a notice. Asks the coordinator to drain this agent (no new tasks; its jobs
        save a checkpoint on notice, within ``NOTICE_SAVE_SHARE`` of ``timeout_s``, and restart
        elsewhere from it) and waits, at most ``timeout_s`` (``--notice``), for its tasks to be
        stopped that way. Without a coordinator to ask, ``shutdown`` stops them directly."""
        timeout_s = self.cfg.notice_s if timeout_s is None else timeout_s
        self.draining.set()
        deadline = time.monotonic() + timeout_s
        try:
            self.stub.DrainAgent(pb.DrainAgentRequest(
                name=self.cfg.name, session=self.session,
                deadline_s=timeout_s * NOTICE_SAVE_SHARE), timeout=RPC_TIMEOUT_S)
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
