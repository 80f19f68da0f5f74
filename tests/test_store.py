"""The SQLite store: everything written survives reopening the file."""

import pytest

from strata.coordinator.store import SqliteStore, Store, WorkerRecord
from strata.spec import parse_job_spec
from strata.types import FailureKind, Job, JobMetrics, JobState, Task, TaskState


SPEC = parse_job_spec({"name": "a", "workers": 2, "model": {"builtin": {"hidden": [32]}},
                       "training": {"steps": 3}})


class StoreContract:
    """Run against every Store implementation."""

    def make(self, tmp_path) -> Store:
        raise NotImplementedError

    def reopen(self, store: Store, tmp_path) -> Store:
        return store

    def test_jobs_tasks_events_workers_round_trip(self, tmp_path):
        s = self.make(tmp_path)
        job = Job(id="a-1", name="a", state=JobState.RUNNING, strategy="multi_worker_mirrored",
                  spec=SPEC, created_at=1.0, metrics=JobMetrics(step=3, loss=0.5))
        s.put_job(job)
        s.put_tasks([Task(job_id="a-1", role="worker", index=i, worker=f"w{i}",
                          state=TaskState.FAILED if i else TaskState.RUNNING,
                          failure=FailureKind.OOM if i else FailureKind.NONE,
                          memory_budget_bytes=100) for i in range(2)])
        assert s.add_event("a-1", 1.0, "state", "one") == 1
        assert s.add_event("a-1", 2.0, "state", "two") == 2
        s.put_worker(WorkerRecord("w0", "127.0.0.1", "CPU", 1 << 30, last_seen=5.0))
        s = self.reopen(s, tmp_path)
        (loaded,) = s.load_jobs()
        assert loaded.state == JobState.RUNNING and loaded.metrics.step == 3
        assert loaded.spec == SPEC
        assert [t.failure for t in loaded.tasks] == [FailureKind.NONE, FailureKind.OOM]
        assert [e.message for e in s.events("a-1")] == ["one", "two"]
        assert [e.seq for e in s.events("a-1", after_seq=1)] == [2]
        assert s.add_event("a-1", 3.0, "state", "three") == 3
        assert s.load_workers()[0].budget_bytes == 1 << 30


class TestSqliteFile(StoreContract):
    def make(self, tmp_path):
        return SqliteStore(str(tmp_path / "state" / "strata.db"))

    def reopen(self, store, tmp_path):
        store.close()
        return SqliteStore(str(tmp_path / "state" / "strata.db"))


class TestSqliteMemory(StoreContract):
    def make(self, tmp_path):
        return SqliteStore(":memory:")


def test_schema_version_mismatch_is_refused(tmp_path):
    path = str(tmp_path / "s.db")
    s = SqliteStore(path)
    s._db.execute("UPDATE meta SET value='999' WHERE key='schema'")
    s.close()
    with pytest.raises(RuntimeError, match="state-dir"):
        SqliteStore(path)
