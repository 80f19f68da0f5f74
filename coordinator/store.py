"""Durable state of the control plane: jobs, their tasks and events, and known workers.

``Store`` is the interface; ``SqliteStore`` keeps everything in one SQLite file under
``--state-dir`` (WAL mode, so readers never block the writer). The coordinator holds the live
copies in memory and writes every change through, so a restarted coordinator starts from here.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import json
import os
import sqlite3
import threading
from typing import Any, Callable, Iterable, Iterator, TypeVar

from strata.coordinator.confine import job_blobs
from strata.coordinator.disk import is_full
from strata.errors import DiskFull
from strata.jobspec import JobSpec
from strata.types import (
    FailureKind, Job, JobMetrics, JobRecovery, JobState, JobSummary, Task, TaskState,
)


@dataclasses.dataclass
class WorkerRecord:
    name: str
    address: str
    device: str
    budget_bytes: int
    work_dir: str = ""
    last_seen: float = 0.0
    draining: bool = False
    shared_dir: str = ""          # --shared-dir as the agent sees it (empty: none)
    pid: int = 0                  # the agent process (a drain lasts while it lives)
    #: --data-root: jobs' data paths must lie under one (empty: the agent reads anywhere)
    data_roots: list[str] = dataclasses.field(default_factory=list)
    #: the CPU kernels its tasks run (``strata.cpukernels``; empty: unknown)
    cpu_kernels: str = ""


@dataclasses.dataclass
class EventRecord:
    job_id: str
    seq: int
    time: float
    kind: str
    message: str


class Store(abc.ABC):
    @abc.abstractmethod
    def put_job(self, job: Job) -> None:
        """Inserts or replaces a job row (not its tasks)."""

    @abc.abstractmethod
    def put_tasks(self, tasks: Iterable[Task]) -> None:
        """Inserts or replaces task rows."""

    @abc.abstractmethod
    def load_jobs(self) -> list[Job]:
        """Every job with its tasks, oldest first."""

    # What a coordinator loads at start (``strata.coordinator.jobtable``). These defaults read
    # every job; a store that can select them (SqliteStore) reads only what is asked for.

    def load_live_jobs(self) -> list[Job]:
        """The jobs that are not over (the job or one of its tasks has not ended)."""
        return [j for j in self.load_jobs()
                if not (j.state.final and all(t.state.final for t in j.tasks))]

    def load_job_summaries(self) -> list[JobSummary]:
        """Every job's id, state, times and restarts."""
        return [JobSummary.of(j) for j in self.load_jobs()]

    def load_job(self, job_id: str) -> Job | None:
        return next((j for j in self.load_jobs() if j.id == job_id), None)

    def request_ids(self) -> dict[str, str]:
        """Client request id -> the job its SubmitJob created."""
        return {j.recovery.request_id: j.id for j in self.load_jobs() if j.recovery.request_id}

    @abc.abstractmethod
    def replace_tasks(self, job_id: str, tasks: Iterable[Task]) -> None:
        """The job's task rows become ``tasks`` (a restart re-planned it), atomically."""

    @abc.abstractmethod
    def job_for_request(self, request_id: str) -> str | None:
        """The id of the job a ``SubmitJob`` with this client request id created, if any."""

    @abc.abstractmethod
    def add_event(self, job_id: str, time: float, kind: str, message: str) -> int:
        """Appends an event and returns its sequence number within the job (1, 2, ...)."""

    @abc.abstractmethod
    def events(self, job_id: str, after_seq: int = 0) -> list[EventRecord]: ...

    @abc.abstractmethod
    def delete_job(self, job_id: str) -> None:
        """Removes a job with its tasks, events and restart bookkeeping."""

    @abc.abstractmethod
    def put_worker(self, worker: WorkerRecord) -> None: ...

    @abc.abstractmethod
    def load_workers(self) -> list[WorkerRecord]: ...

    def put_measured(self, kind: str, needed_bytes: int, job_id: str, time: float) -> None:
        """Keeps the memory a kind of task was measured to need (``strata.measured``), when
        larger than what is kept. A store that keeps none plans from estimates alone."""

    def load_measured(self) -> dict[str, int]:
        return {}

    # Files users uploaded and who holds each (``coordinator.blobs``), and names revoked
    # (``strata admin revoke``). These defaults keep nothing: a store that keeps none forgets
    # them at a restart.

    def put_blob_owner(self, sha: str, owner: str, size: int, time: float) -> None:
        """``owner`` holds uploaded file ``sha`` (charged ``size`` bytes) since ``time``."""

    def delete_blob_owner(self, sha: str, owner: str) -> None:
        pass

    def load_blob_owners(self) -> list[tuple[str, str, int, float]]:
        """Every (sha, owner, size, time) row."""
        return []

    def blob_refs(self) -> list[tuple[str, str, str]]:
        """(job id, its owner, sha) of every file a held job names."""
        return [(j.id, j.owner, sha) for j in self.load_jobs() for sha in job_blobs(j.spec)]

    def job_owners(self) -> dict[str, str]:
        """Job id -> its owner, for every job held."""
        return {j.id: j.owner for j in self.load_jobs()}

    def put_revoked(self, name: str, time: float) -> None:
        pass

    def delete_revoked(self, name: str) -> None:
        pass

    def load_revoked(self) -> list[str]:
        return []

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, name TEXT NOT NULL, state TEXT NOT NULL, strategy TEXT NOT NULL,
  spec TEXT NOT NULL, message TEXT NOT NULL, restarts INTEGER NOT NULL,
  created_at REAL NOT NULL, finished_at REAL NOT NULL, started_at REAL NOT NULL,
  estimated_memory_bytes INTEGER NOT NULL, metrics TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tasks (
  job_id TEXT NOT NULL, role TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL,
  PRIMARY KEY (job_id, role, idx)
);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
  message TEXT NOT NULL, PRIMARY KEY (job_id, seq)
);
CREATE TABLE IF NOT EXISTS workers (
  name TEXT PRIMARY KEY, body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS measured_memory (
  kind TEXT PRIMARY KEY, bytes INTEGER NOT NULL, job_id TEXT NOT NULL, time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS job_recovery (
  job_id TEXT PRIMARY KEY, request_id TEXT NOT NULL, body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS job_recovery_request ON job_recovery (request_id);
CREATE TABLE IF NOT EXISTS blob_owners (
  sha TEXT NOT NULL, owner TEXT NOT NULL, size INTEGER NOT NULL, time REAL NOT NULL,
  PRIMARY KEY (sha, owner)
);
CREATE TABLE IF NOT EXISTS revoked (name TEXT PRIMARY KEY, time REAL NOT NULL);
"""
SCHEMA_VERSION = "1"

_FINAL = "('SUCCEEDED', 'FAILED', 'CANCELLED')"  # JobState and TaskState alike
#: the ids of the jobs that are not over: the job, or one of its tasks, has not ended
_LIVE_IDS = (f"SELECT id FROM jobs WHERE state NOT IN {_FINAL} UNION "
             f"SELECT job_id FROM tasks WHERE json_extract(body, '$.state') NOT IN {_FINAL}")


F = TypeVar("F", bound=Callable[..., Any])


def _writes(method: F) -> F:
    """A write that finds the disk full: once the store's ``on_full`` has made room (the
    coordinator releases its ballast, ``coordinator.disk``) it is tried once more; else, or
    if it fails again, ``DiskFull`` (UNAVAILABLE), never an ``OperationalError``."""
    @functools.wraps(method)
    def write(self: "SqliteStore", *args: Any, **kwargs: Any) -> Any:
        for again in (True, False):
            try:
                return method(self, *args, **kwargs)
            except (sqlite3.OperationalError, OSError) as e:
                if not is_full(e):
                    raise
                if not (again and self.on_full is not None and self.on_full()):
                    raise DiskFull(f"the coordinator's disk is full: cannot write to "
                                   f"{self.path}; free room on its file system",
                                   self.path) from None
        raise AssertionError("unreachable")
    return write  # type: ignore[return-value]


class SqliteStore(Store):
    """One SQLite file; a single connection behind a lock (writes are small and short)."""

    #: called when a write finds the disk full; returns whether it made room (``_writes``)
    on_full: Callable[[], bool] | None = None

    def __init__(self, path: str):
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (SCHEMA_VERSION,))
        elif row[0] != SCHEMA_VERSION:
            raise RuntimeError(f"{path}: state schema {row[0]} is not {SCHEMA_VERSION}; "
                               "use a new --state-dir")
        self._next_seq: dict[str, int] = {}

    def _rollback(self) -> None:
        """Ends a failed transaction, if SQLite has not ended it already (a write that found
        the disk full may have): the error that matters is the write's, not this one's."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """The statements inside as one transaction, under the lock: all written or none
        (the connection is in autocommit mode: each statement outside one commits alone)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()  # never leave the connection inside a transaction
                raise

    @_writes
    def put_job(self, job: Job) -> None:
        m = dataclasses.asdict(job.metrics)
        spec = json.dumps(job.spec.to_dict() if job.spec is not None else None)
        with self._transaction():  # the job and its bookkeeping together: no half a job
            self._db.execute(
                "INSERT OR REPLACE INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (job.id, job.name, job.state.value, job.strategy, spec, job.message,
                 job.restarts, job.created_at, job.finished_at, job.started_at,
                 job.estimated_memory_bytes, json.dumps(m)))
            r = job.recovery
            self._db.execute("INSERT OR REPLACE INTO job_recovery VALUES (?,?,?)", (
                job.id, r.request_id, json.dumps({
                    **dataclasses.asdict(r), "checkpoint_step": job.checkpoint_step,
                    "steps_repeated": job.steps_repeated, "owner": job.owner,
                    "training": job.training})))

    @_writes
    def replace_tasks(self, job_id: str, tasks: Iterable[Task]) -> None:
        rows = [_task_row(t) for t in tasks]
        with self._transaction():
            self._db.execute("DELETE FROM tasks WHERE job_id=?", (job_id,))
            self._db.executemany("INSERT OR REPLACE INTO tasks VALUES (?,?,?,?)", rows)

    def job_for_request(self, request_id: str) -> str | None:
        if not request_id:
            return None
        with self._lock:
            row = self._db.execute("SELECT job_id FROM job_recovery WHERE request_id=?",
                                   (request_id,)).fetchone()
        return str(row[0]) if row else None

    @_writes
    def put_tasks(self, tasks: Iterable[Task]) -> None:
        rows = [_task_row(t) for t in tasks]
        with self._transaction():
            self._db.executemany("INSERT OR REPLACE INTO tasks VALUES (?,?,?,?)", rows)

    def load_jobs(self) -> list[Job]:
        return self._load()

    def load_live_jobs(self) -> list[Job]:
        return self._load(_LIVE_IDS)

    def load_job(self, job_id: str) -> Job | None:
        got = self._load("?", (job_id,))
        return got[0] if got else None

    def load_job_summaries(self) -> list[JobSummary]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, state, created_at, finished_at, started_at, restarts FROM jobs"
            ).fetchall()
        return [JobSummary(i, JobState(s), c, f, st, r) for i, s, c, f, st, r in rows]

    def request_ids(self) -> dict[str, str]:
        with self._lock:
            return dict(self._db.execute(
                "SELECT request_id, job_id FROM job_recovery WHERE request_id != ''").fetchall())

    def _load(self, ids: str = "", params: tuple[str, ...] = ()) -> list[Job]:
        """The jobs whose ids the SQL ``ids`` yields (all without it), with their tasks."""
        def where(column: str) -> str:
            return f"WHERE {column} IN ({ids})" if ids else ""

        with self._lock:
            jobs = self._db.execute(f"SELECT * FROM jobs {where('id')} ORDER BY created_at, id",
                                    params).fetchall()
            tasks = self._db.execute(f"SELECT job_id, body FROM tasks {where('job_id')} "
                                     "ORDER BY job_id, role, idx", params).fetchall()
            recovery = dict(self._db.execute(
                f"SELECT job_id, body FROM job_recovery {where('job_id')}", params).fetchall())
        by_job: dict[str, list[Task]] = {}
        for job_id, body in tasks:
            d: dict[str, Any] = json.loads(body)
            d["state"] = TaskState(d["state"])
            d["failure"] = FailureKind(d["failure"])
            by_job.setdefault(job_id, []).append(Task(**d))
        out = []
        names = {f.name for f in dataclasses.fields(JobRecovery)}
        for (jid, name, state, strategy, spec, message, restarts, created, finished, started,
             estimate, metrics) in jobs:
            rec = json.loads(recovery.get(jid) or "{}")
            out.append(Job(
                id=jid, name=name, state=JobState(state), strategy=strategy, spec=_spec(spec),
                message=message, restarts=restarts, created_at=created, finished_at=finished,
                started_at=started, estimated_memory_bytes=estimate,
                metrics=JobMetrics(**json.loads(metrics)), tasks=by_job.get(jid, []),
                checkpoint_step=int(rec.get("checkpoint_step", 0)),
                steps_repeated=int(rec.get("steps_repeated", 0)),
                owner=str(rec.get("owner", "")), training=str(rec.get("training", "")),
                recovery=JobRecovery(**{k: v for k, v in rec.items() if k in names})))
        return out

    @_writes
    def add_event(self, job_id: str, time: float, kind: str, message: str) -> int:
        with self._lock:
            seq = self._next_seq.get(job_id)
            if seq is None:
                row = self._db.execute("SELECT MAX(seq) FROM events WHERE job_id=?", (job_id,)).fetchone()
                seq = (row[0] or 0) + 1
            self._db.execute("INSERT INTO events VALUES (?,?,?,?,?)", (job_id, seq, time, kind, message))
            self._next_seq[job_id] = seq + 1
            return seq

    def events(self, job_id: str, after_seq: int = 0) -> list[EventRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, seq, time, kind, message FROM events WHERE job_id=? AND seq>? "
                "ORDER BY seq", (job_id, after_seq)).fetchall()
        return [EventRecord(*r) for r in rows]

    @_writes
    def delete_job(self, job_id: str) -> None:
        with self._transaction():
            for table in ("tasks", "events", "job_recovery"):
                self._db.execute(f"DELETE FROM {table} WHERE job_id = ?", (job_id,))
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            self._next_seq.pop(job_id, None)  # a job of this id again numbers from 1

    @_writes
    def put_worker(self, worker: WorkerRecord) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO workers VALUES (?,?)",
                             (worker.name, json.dumps(dataclasses.asdict(worker))))

    def load_workers(self) -> list[WorkerRecord]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM workers ORDER BY name").fetchall()
        return [WorkerRecord(**json.loads(b)) for (b,) in rows]

    @_writes
    def put_measured(self, kind: str, needed_bytes: int, job_id: str, time: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT INTO measured_memory VALUES (?,?,?,?) ON CONFLICT(kind) DO UPDATE SET "
                "bytes=excluded.bytes, job_id=excluded.job_id, time=excluded.time "
                "WHERE excluded.bytes > measured_memory.bytes",
                (kind, int(needed_bytes), job_id, time))

    def load_measured(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT kind, bytes FROM measured_memory").fetchall()
        return {str(k): int(b) for k, b in rows}

    @_writes
    def put_blob_owner(self, sha: str, owner: str, size: int, time: float) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO blob_owners VALUES (?,?,?,?)",
                             (sha, owner, int(size), time))

    @_writes
    def delete_blob_owner(self, sha: str, owner: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM blob_owners WHERE sha=? AND owner=?", (sha, owner))

    def load_blob_owners(self) -> list[tuple[str, str, int, float]]:
        with self._lock:
            rows = self._db.execute("SELECT sha, owner, size, time FROM blob_owners").fetchall()
        return [(str(a), str(b), int(c), float(d)) for a, b, c, d in rows]

    def blob_refs(self) -> list[tuple[str, str, str]]:
        out = []
        with self._lock:
            rows = self._db.execute(
                "SELECT j.id, json_extract(r.body, '$.owner'), "
                "json_extract(j.spec, '$.model.keras_file.sha256'), "
                "json_extract(j.spec, '$.code.sha256') "
                "FROM jobs j LEFT JOIN job_recovery r ON r.job_id = j.id").fetchall()
        for job_id, owner, keras, code in rows:
            for sha in (keras, code):
                if sha:
                    out.append((str(job_id), str(owner or ""), str(sha)))
        return out

    def job_owners(self) -> dict[str, str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT job_id, json_extract(body, '$.owner') FROM job_recovery").fetchall()
        return {str(j): str(o or "") for j, o in rows}

    @_writes
    def put_revoked(self, name: str, time: float) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO revoked VALUES (?,?)", (name, time))

    @_writes
    def delete_revoked(self, name: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM revoked WHERE name=?", (name,))

    def load_revoked(self) -> list[str]:
        with self._lock:
            rows = self._db.execute("SELECT name FROM revoked ORDER BY name").fetchall()
        return [str(n) for (n,) in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _task_row(t: Task) -> tuple[str, str, int, str]:
    body = dataclasses.asdict(t)
    body["state"] = t.state.value
    body["failure"] = t.failure.value
    return (t.job_id, t.role, t.index, json.dumps(body))


def _spec(text: str) -> JobSpec | None:
    d = json.loads(text)
    return JobSpec.from_dict(d) if d is not None else None
