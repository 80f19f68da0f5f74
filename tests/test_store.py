"""The ``Store`` contract, run against every implementation.

Each ``StoreContract`` subclass says how to make its store (``make``), open it again as a
restarted coordinator would (``reopen``: the durability tests) and make its writes find no room
(``fill``/``unfill``: the disk-full tests); a store that cannot do one skips those tests, saying
why. ``DictStore`` runs ``Store``'s own default methods against the same contract.
"""

import copy
import dataclasses
import hashlib
from typing import Any, Callable

import pytest

from strata.coordinator.store import EventRecord, SqliteStore, Store, WorkerRecord
from strata.errors import DiskFull
from strata.spec import parse_job_spec
from strata.types import (
    FailureKind, Job, JobMetrics, JobRecovery, JobState, JobSummary, Task, TaskState,
)


SPEC = parse_job_spec({"name": "a", "workers": 2, "model": {"builtin": {"hidden": [32]}},
                       "training": {"steps": 3}})
KERAS_SHA, CODE_SHA = (hashlib.sha256(b).hexdigest() for b in (b"a model", b"some code"))
KERAS_SPEC = dataclasses.replace(SPEC, model={"keras_file": {
    "name": "m.keras", "sha256": KERAS_SHA, "size": 7, "config": "{}"}})
CODE_SPEC = parse_job_spec({"name": "c", "workers": 2, "training": {"steps": 3},
                            "code": {"sha256": CODE_SHA, "model": "train:build_model"}})
BIG = "x" * 20_000  # more than a few pages of any store: a write of it needs new room
TOO_LARGE = 1 << 63  # an integer SQLite cannot hold


def job(job_id: str, state: JobState = JobState.RUNNING, created_at: float = 1.0,
        **kw: Any) -> Job:
    return Job(id=job_id, name=job_id.split("-")[0], state=state,
               strategy="multi_worker_mirrored", spec=kw.pop("spec", SPEC),
               created_at=created_at, **kw)


def task(job_id: str, index: int, state: TaskState = TaskState.RUNNING, role: str = "worker",
         **kw: Any) -> Task:
    return Task(job_id=job_id, role=role, index=index, state=state, **kw)


def full_job(job_id: str = "a-1") -> Job:
    """A job with every stored field away from its default (``test_the_samples_set_...``)."""
    return Job(
        id=job_id, name="a", state=JobState.RESTARTING, strategy="multi_worker_mirrored",
        spec=SPEC, message="restarting after an OOM", restarts=2, created_at=1.5,
        finished_at=9.5, started_at=2.5, estimated_memory_bytes=123 << 20,
        metrics=JobMetrics(step=3, total_steps=10, loss=0.5, test_accuracy=0.875,
                           test_loss=0.25, examples_per_sec=12.5, test_metrics={"auc": 0.75}),
        checkpoint_step=2, steps_repeated=1, owner="alice", training="adam, mse (spec)",
        recovery=JobRecovery(request_id="req-1", restart_at=7.5, requested_workers=2,
                             step_at_failure=3, last_cause="OOM on w1", failures=1,
                             replanned=True, probe_of="p-1", capacity_deadline=99.5,
                             memory_retried=True, notice_step=140,
                             notice_deadline=1250.5, resizes=3, resize_from=2,
                             resize_began=1200.5, resized_at=1100.5, workers_now=4,
                             preempted_by="b-2", preemptions=2, ran_s=30.5,
                             run_began=1300.5))


def full_task(job_id: str = "a-1", index: int = 1) -> Task:
    """A task with every field away from its default."""
    return Task(job_id=job_id, role="stage", index=index, worker="w1", state=TaskState.FAILED,
                stage=1, memory_budget_bytes=100, estimated_memory_bytes=90,
                peak_memory_bytes=95, in_use_bytes=80, failure=FailureKind.OOM, exit_code=137,
                message="out of memory", address="10.0.0.2:2222", weights_sha256="ab" * 32,
                model_path="/m/model.keras", attempt=3, replica=1, first_layer=2, last_layer=4,
                layers=["dense", "dense_1"], replica_weights_sha256=["cd" * 32])


def full_worker(name: str = "w1") -> WorkerRecord:
    return WorkerRecord(name=name, address="10.0.0.2:7070", device="GPU", budget_bytes=1 << 30,
                        work_dir="/work", last_seen=5.5, draining=True, shared_dir="/shared",
                        pid=4242, data_roots=["/data", "/more"], cpu_kernels="onednn")


#: what the store does not keep of a job: its outputs and TensorBoard directory (read from
#: files), its place among the waiting jobs (set by each pass of the control loop)
NOT_STORED = ("output_dir", "outputs", "tensorboard_dir", "position", "estimated_start")


def stored(j: Job, tasks: Any = ()) -> Job:
    """``j`` as the store gives it back: with ``tasks``, less what it does not keep."""
    return dataclasses.replace(j, tasks=list(tasks), output_dir="", outputs=[], tensorboard_dir="",
                               position=0, estimated_start=0.0)


def by_key(tasks: list[Task]) -> list[Task]:
    return sorted(tasks, key=lambda t: t.key)


def unset_fields(obj: Any, skip: tuple[str, ...] = ()) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING \
            else f.default
        if f.name not in skip and default is not dataclasses.MISSING \
                and getattr(obj, f.name) == default:
            out.append(f.name)
    return out


def test_the_samples_set_every_stored_field():
    """A field the store forgot would round-trip unnoticed while the samples left it default."""
    j = full_job()
    assert unset_fields(j, skip=("tasks",) + NOT_STORED) == []
    assert unset_fields(j.recovery) == [] and unset_fields(j.metrics) == []
    assert unset_fields(full_task()) == [] and unset_fields(full_worker()) == []


# --- what the durability and disk-full tests read: every kind of record -----------------------

READERS: dict[str, Callable[[Store], Any]] = {
    "jobs": lambda s: s.load_jobs(),
    "live jobs": lambda s: s.load_live_jobs(),
    "summaries": lambda s: sorted(s.load_job_summaries()),
    "one job": lambda s: s.load_job("a-1"),
    "request ids": lambda s: (s.request_ids(), s.job_for_request("req-1")),
    "events": lambda s: [s.events(j) for j in ("a-1", "b-1", "gone-1")],
    "workers": lambda s: sorted(s.load_workers(), key=lambda w: w.name),
    "measured": lambda s: s.load_measured(),
    "blob owners": lambda s: sorted(s.load_blob_owners()),
    "blob refs": lambda s: sorted(s.blob_refs()),
    "job owners": lambda s: s.job_owners(),
    "revoked": lambda s: sorted(s.load_revoked()),
}
#: what a store may keep none of (``Store``'s defaults forget them)
EXTRAS = ("measured", "blob owners", "revoked")


def populate(s: Store) -> None:
    """Some of every kind of record, including some written and then deleted."""
    s.put_job(full_job())
    s.put_tasks([task("a-1", 0), full_task()])
    s.put_job(job("b-1", JobState.SUCCEEDED, created_at=2.0, spec=KERAS_SPEC, owner="bob"))
    s.replace_tasks("b-1", [task("b-1", 0, TaskState.SUCCEEDED)])
    s.put_job(job("gone-1", created_at=3.0, spec=CODE_SPEC,
                  recovery=JobRecovery(request_id="req-gone")))
    s.put_tasks([task("gone-1", 0)])
    for j in ("a-1", "b-1", "gone-1", "a-1"):
        s.add_event(j, 4.0, "state", f"event of {j}")
    s.delete_job("gone-1")
    s.put_worker(full_worker("w1"))
    s.put_worker(WorkerRecord("w0", "10.0.0.1:7070", "CPU", 1 << 30))
    s.put_measured("mnist/worker", 300, "a-1", 5.0)
    for sha, owner in ((KERAS_SHA, "bob"), (CODE_SHA, "carol"), (CODE_SHA, "bob")):
        s.put_blob_owner(sha, owner, 7, 6.0)
    s.delete_blob_owner(CODE_SHA, "carol")
    s.put_revoked("mole", 7.0)
    s.put_revoked("spy", 7.0)
    s.delete_revoked("spy")


def snapshot(s: Store) -> dict[str, Any]:
    return {name: read(s) for name, read in READERS.items()}


class StoreContract:
    """Run against every Store implementation."""

    #: whether it keeps what ``Store``'s defaults forget (measured memory, blob holders,
    #: revocations)
    keeps_extras = True

    def make(self, tmp_path) -> Store:
        raise NotImplementedError

    def reopen(self, store: Store, tmp_path) -> Store:
        """``store`` closed and opened again, as a restarted coordinator opens it."""
        raise NotImplementedError

    def fill(self, store: Store) -> None:
        """Makes the store's writes find no room (until ``unfill``)."""
        pytest.skip(f"{type(self).__name__}: no way to fill its storage")

    def unfill(self, store: Store) -> None:
        raise NotImplementedError

    @pytest.fixture
    def store(self, tmp_path):
        s = self.make(tmp_path)
        yield s
        s.close()

    def needs_extras(self) -> None:
        if not self.keeps_extras:
            pytest.skip(f"{type(self).__name__} keeps no measured memory, blobs or revocations")

    # --- jobs and tasks

    @pytest.mark.parametrize("spec", [SPEC, KERAS_SPEC, CODE_SPEC, None],
                             ids=["builtin", "keras_file", "code", "none"])
    def test_a_job_round_trips_every_stored_field(self, store, spec):
        j = dataclasses.replace(full_job(), spec=spec, output_dir="/out", outputs=["m.keras"],
                                tensorboard_dir="/tb", tasks=[task("a-1", 0)])
        store.put_job(j)
        assert store.load_jobs() == [stored(j)]  # put_job writes no tasks
        assert store.load_job("a-1") == stored(j)
        assert store.load_job("nothing-1") is None

    def test_the_job_given_is_not_the_job_kept(self, store):
        j = full_job()
        store.put_job(j)
        j.metrics.test_metrics["auc"] = 0.0
        j.recovery.failures = 5
        assert store.load_job("a-1") == stored(full_job())

    def test_put_job_again_replaces_it(self, store):
        store.put_job(full_job())
        store.put_tasks([task("a-1", 0)])
        again = job("a-1", JobState.FAILED, created_at=1.5, message="failed", owner="dave")
        store.put_job(again)
        assert store.load_jobs() == [stored(again, [task("a-1", 0)])]
        assert store.job_for_request("req-1") is None and store.request_ids() == {}

    def test_tasks_round_trip_every_field(self, store):
        store.put_job(full_job())
        store.put_tasks([full_task("a-1", 1), task("a-1", 0)])
        assert by_key(store.load_job("a-1").tasks) == by_key([task("a-1", 0), full_task()])

    def test_put_tasks_updates_only_the_tasks_named(self, store):
        store.put_job(job("a-1"))
        store.put_job(job("b-1"))
        store.put_tasks([task("a-1", i) for i in range(3)] + [task("b-1", 1)])
        changed = task("a-1", 1, TaskState.FAILED, failure=FailureKind.OOM, worker="w2")
        store.put_tasks([changed, task("a-1", 0, role="ps")])
        assert by_key(store.load_job("a-1").tasks) == [
            task("a-1", 0, role="ps"), task("a-1", 0), changed, task("a-1", 2)]
        assert store.load_job("b-1").tasks == [task("b-1", 1)]

    @pytest.mark.parametrize("count", [0, 1, 4])
    def test_replace_tasks_makes_the_jobs_task_list_exactly_these(self, store, count):
        store.put_job(job("a-1"))
        store.put_job(job("b-1"))
        store.put_tasks([task("a-1", i, attempt=0) for i in range(2)] + [task("b-1", 0)])
        new = [task("a-1", i, TaskState.PENDING, attempt=1) for i in range(count)]
        store.replace_tasks("a-1", new)
        assert by_key(store.load_job("a-1").tasks) == new
        assert store.load_job("b-1").tasks == [task("b-1", 0)]

    def test_load_jobs_gives_every_job_with_its_own_tasks_oldest_first(self, store):
        for jid, created in (("c-1", 3.0), ("a-1", 1.0), ("b-2", 2.0), ("b-1", 2.0)):
            store.put_job(job(jid, created_at=created))
            store.put_tasks([task(jid, 0, message=jid)])
        loaded = store.load_jobs()
        assert [j.id for j in loaded] == ["a-1", "b-1", "b-2", "c-1"]
        assert all(j.tasks == [task(j.id, 0, message=j.id)] for j in loaded)

    def test_a_jobs_tasks_come_back_by_role_and_index(self, store):
        store.put_job(job("a-1"))
        written = [task("a-1", 2), task("a-1", 0, role="ps"), task("a-1", 0), task("a-1", 1)]
        store.put_tasks(written)
        assert store.load_job("a-1").tasks == by_key(written) == store.load_jobs()[0].tasks

    def test_load_live_jobs_leaves_out_only_jobs_over_with_all_their_tasks(self, store):
        cases = {  # job id: (job state, its tasks' states), and whether it is live
            "running-1": (JobState.RUNNING, [TaskState.RUNNING], True),
            "pending-1": (JobState.PENDING, [], True),
            "restarting-1": (JobState.RESTARTING, [TaskState.CANCELLED], True),
            "ending-1": (JobState.FAILED, [TaskState.FAILED, TaskState.RUNNING], True),
            "failed-1": (JobState.FAILED, [TaskState.FAILED, TaskState.CANCELLED], False),
            "done-1": (JobState.SUCCEEDED, [TaskState.SUCCEEDED], False),
            "cancelled-1": (JobState.CANCELLED, [], False),
        }
        for jid, (state, task_states, _) in cases.items():
            store.put_job(job(jid, state))
            store.put_tasks([task(jid, i, s) for i, s in enumerate(task_states)])
        live = store.load_live_jobs()
        assert sorted(j.id for j in live) == sorted(j for j, c in cases.items() if c[2])
        every = {j.id: j for j in store.load_jobs()}
        assert all(j == every[j.id] for j in live)  # whole, with their tasks

    def test_load_job_summaries_covers_every_job(self, store):
        jobs = [full_job(), job("b-1", JobState.SUCCEEDED, created_at=2.0, finished_at=3.0,
                                started_at=2.5, restarts=1)]
        for j in jobs:
            store.put_job(j)
        assert sorted(store.load_job_summaries()) == sorted(JobSummary.of(j) for j in jobs)

    # --- request ids

    def test_a_request_id_names_its_job_until_the_job_changes_or_goes(self, store):
        store.put_job(full_job("a-1"))
        store.put_job(job("b-1", recovery=JobRecovery(request_id="req-2")))
        store.put_job(job("c-1"))  # no request id
        assert store.request_ids() == {"req-1": "a-1", "req-2": "b-1"}
        assert store.job_for_request("req-2") == "b-1"
        assert store.job_for_request("req-3") is None and store.job_for_request("") is None
        store.put_job(job("a-1", recovery=JobRecovery(request_id="req-9")))
        assert store.job_for_request("req-1") is None and store.job_for_request("req-9") == "a-1"
        store.delete_job("b-1")
        assert store.request_ids() == {"req-9": "a-1"} and store.job_for_request("req-2") is None

    # --- events

    def test_events_are_numbered_from_1_within_each_job(self, store):
        store.put_job(job("a-1"))
        store.put_job(job("b-1"))
        seqs = [store.add_event(j, t, "state", f"{j} {t}")
                for j, t in (("a-1", 1.0), ("a-1", 2.0), ("b-1", 2.5), ("a-1", 3.0))]
        assert seqs == [1, 2, 1, 3]
        assert store.events("a-1") == [EventRecord("a-1", 1, 1.0, "state", "a-1 1.0"),
                                       EventRecord("a-1", 2, 2.0, "state", "a-1 2.0"),
                                       EventRecord("a-1", 3, 3.0, "state", "a-1 3.0")]
        assert store.events("b-1") == [EventRecord("b-1", 1, 2.5, "state", "b-1 2.5")]
        assert store.events("nothing-1") == []

    def test_events_after_a_seq_are_only_the_later_ones(self, store):
        store.put_job(job("a-1"))
        for i in range(5):
            store.add_event("a-1", float(i), "message", str(i))
        assert [e.seq for e in store.events("a-1", after_seq=3)] == [4, 5]
        assert [e.message for e in store.events("a-1", 1)] == ["1", "2", "3", "4"]
        assert store.events("a-1", after_seq=5) == [] and store.events("a-1", 99) == []

    def test_a_job_made_again_after_delete_numbers_its_events_from_1(self, store):
        store.put_job(job("a-1"))
        store.add_event("a-1", 1.0, "state", "one")
        store.add_event("a-1", 2.0, "state", "two")
        store.delete_job("a-1")
        store.put_job(job("a-1"))
        assert store.add_event("a-1", 3.0, "state", "again") == 1
        assert [e.seq for e in store.events("a-1")] == [1]

    # --- delete_job

    def test_delete_job_removes_it_whole_and_leaves_the_others(self, store):
        populate(store)
        before = snapshot(store)
        store.delete_job("a-1")
        assert store.load_job("a-1") is None and store.events("a-1") == []
        assert [j.id for j in store.load_jobs()] == ["b-1"]
        assert store.load_jobs() == [j for j in before["jobs"] if j.id != "a-1"]
        assert store.events("b-1") == before["events"][1]
        assert store.request_ids() == {} and store.job_for_request("req-1") is None
        assert store.job_owners() == {"b-1": "bob"}
        assert store.blob_refs() == [("b-1", "bob", KERAS_SHA)]
        assert store.load_live_jobs() == []
        assert [s.id for s in store.load_job_summaries()] == ["b-1"]
        after = snapshot(store)
        store.delete_job("nothing-1")  # not there: nothing to do
        assert snapshot(store) == after

    def test_tasks_of_a_deleted_job_do_not_come_back_with_it(self, store):
        store.put_job(job("a-1"))
        store.put_tasks([task("a-1", 0)])
        store.delete_job("a-1")
        store.put_job(job("a-1"))
        assert store.load_job("a-1").tasks == []

    # --- workers

    def test_workers_round_trip_and_update_in_place(self, store):
        store.put_worker(full_worker("w1"))
        store.put_worker(WorkerRecord("w0", "10.0.0.1:7070", "CPU", 1 << 30))
        assert sorted(store.load_workers(), key=lambda w: w.name) == [
            WorkerRecord("w0", "10.0.0.1:7070", "CPU", 1 << 30), full_worker("w1")]
        back = dataclasses.replace(full_worker("w1"), draining=False, last_seen=9.0,
                                   address="10.0.0.9:7070", data_roots=[])
        store.put_worker(back)
        assert sorted(store.load_workers(), key=lambda w: w.name) == [
            WorkerRecord("w0", "10.0.0.1:7070", "CPU", 1 << 30), back]

    # --- what a store may keep none of

    def test_measured_keeps_the_largest_need_of_each_kind(self, store):
        self.needs_extras()
        store.put_measured("mnist/worker", 300, "a-1", 1.0)
        store.put_measured("mnist/worker", 200, "b-1", 2.0)  # smaller: the larger stays
        store.put_measured("mnist/ps", 50, "b-1", 2.0)
        assert store.load_measured() == {"mnist/worker": 300, "mnist/ps": 50}
        store.put_measured("mnist/worker", 400, "c-1", 3.0)
        assert store.load_measured() == {"mnist/worker": 400, "mnist/ps": 50}

    def test_blob_owners_put_replace_and_delete_one_holding(self, store):
        self.needs_extras()
        store.put_blob_owner(KERAS_SHA, "alice", 7, 1.0)
        store.put_blob_owner(KERAS_SHA, "bob", 7, 2.0)
        store.put_blob_owner(CODE_SHA, "alice", 9, 3.0)
        store.put_blob_owner(KERAS_SHA, "alice", 8, 4.0)  # the same holding again: replaced
        assert sorted(store.load_blob_owners()) == sorted([
            (KERAS_SHA, "alice", 8, 4.0), (KERAS_SHA, "bob", 7, 2.0), (CODE_SHA, "alice", 9, 3.0)])
        store.delete_blob_owner(KERAS_SHA, "alice")
        store.delete_blob_owner(KERAS_SHA, "nobody")
        assert sorted(store.load_blob_owners()) == sorted([
            (KERAS_SHA, "bob", 7, 2.0), (CODE_SHA, "alice", 9, 3.0)])

    def test_revoked_names_put_and_delete(self, store):
        self.needs_extras()
        for name in ("mole", "spy", "mole"):
            store.put_revoked(name, 1.0)
        assert sorted(store.load_revoked()) == ["mole", "spy"]
        store.delete_revoked("mole")
        store.delete_revoked("nobody")
        assert store.load_revoked() == ["spy"]

    def test_a_store_without_extras_gives_none_back(self, store):
        if self.keeps_extras:
            pytest.skip(f"{type(self).__name__} keeps them (the tests above)")
        store.put_measured("k", 1, "a-1", 1.0)
        store.put_blob_owner(KERAS_SHA, "alice", 7, 1.0)
        store.put_revoked("mole", 1.0)
        assert (store.load_measured(), store.load_blob_owners(), store.load_revoked()) == \
            ({}, [], [])

    def test_blob_refs_and_job_owners_come_from_the_jobs_held(self, store):
        store.put_job(job("k-1", spec=KERAS_SPEC, owner="alice"))
        store.put_job(job("c-1", spec=CODE_SPEC, owner="bob"))
        store.put_job(job("plain-1", owner="carol"))
        store.put_job(job("none-1", spec=None))
        assert sorted(store.blob_refs()) == [("c-1", "bob", CODE_SHA), ("k-1", "alice", KERAS_SHA)]
        assert store.job_owners() == {"k-1": "alice", "c-1": "bob", "plain-1": "carol",
                                      "none-1": ""}
        store.delete_job("k-1")
        assert store.blob_refs() == [("c-1", "bob", CODE_SHA)] and "k-1" not in store.job_owners()

    # --- a write that raises

    @pytest.mark.parametrize("new", [False, True], ids=["changed", "new"])
    def test_a_job_that_cannot_be_stored_is_stored_whole_or_not_at_all(self, store, new):
        populate(store)
        before = snapshot(store)
        bad = job("new-1", estimated_memory_bytes=TOO_LARGE, owner="eve") if new else \
            dataclasses.replace(full_job(), message="changed", restarts=TOO_LARGE)
        try:
            store.put_job(bad)
        except (OverflowError, ValueError):
            assert snapshot(store) == before
        else:
            assert store.load_job(bad.id) == stored(bad, store.load_job(bad.id).tasks)

    @pytest.mark.parametrize("replace", [False, True], ids=["put_tasks", "replace_tasks"])
    def test_tasks_that_cannot_be_stored_are_stored_all_or_none(self, store, replace):
        populate(store)
        before = snapshot(store)
        tasks = [task("a-1", 0, TaskState.FAILED), task("a-1", TOO_LARGE)]
        try:
            store.replace_tasks("a-1", tasks) if replace else store.put_tasks(tasks)
        except (OverflowError, ValueError):
            assert snapshot(store) == before
        else:
            kept = by_key(store.load_job("a-1").tasks)
            assert kept == by_key(tasks if replace else tasks + [full_task()])

    # --- durability

    @pytest.mark.parametrize("reader", list(READERS))
    def test_every_kind_of_record_survives_a_reopen(self, tmp_path, reader):
        if reader in EXTRAS:
            self.needs_extras()
        s = self.make(tmp_path)
        populate(s)
        before = READERS[reader](s)
        assert before and before != ({}, None)  # something to lose
        s = self.reopen(s, tmp_path)
        try:
            assert READERS[reader](s) == before
        finally:
            s.close()

    def test_events_go_on_numbering_after_a_reopen(self, tmp_path):
        s = self.make(tmp_path)
        populate(s)
        s = self.reopen(s, tmp_path)
        try:
            assert s.add_event("a-1", 8.0, "state", "after") == 3
            assert s.add_event("new-1", 8.0, "state", "first") == 1
            assert [e.message for e in s.events("a-1", 2)] == ["after"]
        finally:
            s.close()

    # --- a full disk

    @pytest.mark.parametrize("write", [
        "put_job new", "put_job again", "put_tasks", "replace_tasks", "add_event", "put_worker",
        "put_measured", "put_blob_owner", "put_revoked"])
    def test_a_write_that_finds_no_room_raises_disk_full_and_changes_nothing(self, store, write):
        do = {
            "put_job new": lambda: store.put_job(job("big-1", message=BIG)),
            "put_job again": lambda: store.put_job(
                dataclasses.replace(full_job(), message=BIG, state=JobState.FAILED)),
            "put_tasks": lambda: store.put_tasks([task("a-1", 0, TaskState.FAILED),
                                                  task("a-1", 5, message=BIG)]),
            "replace_tasks": lambda: store.replace_tasks("a-1", [task("a-1", 0, message=BIG)]),
            "add_event": lambda: store.add_event("a-1", 9.0, "message", BIG),
            "put_worker": lambda: store.put_worker(full_worker(BIG)),
            "put_measured": lambda: store.put_measured(BIG, 1, "a-1", 9.0),
            "put_blob_owner": lambda: store.put_blob_owner(CODE_SHA, BIG, 1, 9.0),
            "put_revoked": lambda: store.put_revoked(BIG, 9.0),
        }[write]
        populate(store)
        before = snapshot(store)
        self.fill(store)
        with pytest.raises(DiskFull):
            do()
        assert snapshot(store) == before
        self.unfill(store)
        do()  # with room, the same write lands
        assert snapshot(store) != before

    def test_an_event_that_found_no_room_takes_no_number(self, store):
        populate(store)
        self.fill(store)
        with pytest.raises(DiskFull):
            store.add_event("a-1", 9.0, "message", BIG)
        self.unfill(store)
        assert store.add_event("a-1", 9.5, "message", "later") == 3
        assert [e.seq for e in store.events("a-1")] == [1, 2, 3]

    def test_a_job_whose_bookkeeping_finds_no_room_is_not_half_written(self, store):
        """A small job row with a large recovery record (its training line)."""
        populate(store)
        before = snapshot(store)
        self.fill(store)
        with pytest.raises(DiskFull):
            store.put_job(job("new-1", owner="eve", training=BIG,
                              recovery=JobRecovery(request_id="req-new")))
        assert snapshot(store) == before


# --- the implementations ----------------------------------------------------------------------

class SqliteContract(StoreContract):
    """SQLite: full is a ``max_page_count`` of the pages it has (on this connection only)."""

    def fill(self, store):
        (pages,) = store._db.execute("PRAGMA page_count").fetchone()
        store._db.execute(f"PRAGMA max_page_count = {pages}")

    def unfill(self, store):
        store._db.execute("PRAGMA max_page_count = 1073741823")

    def test_a_delete_that_fails_leaves_the_job_whole(self, store):
        populate(store)
        before = snapshot(store)
        store._db.execute("CREATE TEMP TRIGGER refuse BEFORE DELETE ON jobs "
                          "BEGIN SELECT RAISE(ABORT, 'refused'); END")
        with pytest.raises(Exception, match="refused"):
            store.delete_job("a-1")
        assert snapshot(store) == before

    @pytest.mark.parametrize("makes_room", [True, False])
    def test_on_full_is_asked_once_for_room_and_the_write_tried_again(self, store, makes_room):
        asked = []

        def on_full():
            asked.append(1)
            if makes_room:
                self.unfill(store)
            return makes_room
        store.on_full = on_full
        self.fill(store)
        if makes_room:
            store.put_revoked(BIG, 1.0)
            assert store.load_revoked() == [BIG]
        else:
            with pytest.raises(DiskFull, match="disk is full"):
                store.put_revoked(BIG, 1.0)
            assert store.load_revoked() == []
        assert asked == [1]

    def test_room_promised_but_not_made_is_disk_full_after_one_more_try(self, store):
        asked = []
        store.on_full = lambda: asked.append(1) or True
        self.fill(store)
        with pytest.raises(DiskFull):
            store.put_revoked(BIG, 1.0)
        assert asked == [1] and store.load_revoked() == []

    def test_an_error_other_than_a_full_disk_is_not_disk_full(self, store):
        store.on_full = lambda: pytest.fail("asked for room")
        with pytest.raises(OverflowError):
            store.put_job(job("a-1", restarts=TOO_LARGE))


class TestSqliteFile(SqliteContract):
    def make(self, tmp_path):
        return SqliteStore(str(tmp_path / "state" / "strata.db"))

    def reopen(self, store, tmp_path):
        store.close()
        return SqliteStore(str(tmp_path / "state" / "strata.db"))


class TestSqliteMemory(SqliteContract):
    def make(self, tmp_path):
        return SqliteStore(":memory:")

    def reopen(self, store, tmp_path):
        pytest.skip("an in-memory SQLite store keeps nothing once closed")


class DictStore(Store):
    """The least a store must write (copies in plain dicts); the rest is ``Store``'s defaults."""

    def __init__(self) -> None:
        self.jobs: dict[str, Job] = {}
        self.tasks: dict[tuple[str, str, int], Task] = {}
        self.log: dict[str, list[EventRecord]] = {}
        self.workers: dict[str, WorkerRecord] = {}

    def put_job(self, job: Job) -> None:
        self.jobs[job.id] = copy.deepcopy(stored(job))

    def put_tasks(self, tasks):
        self.tasks.update({t.key: copy.deepcopy(t) for t in tasks})

    def replace_tasks(self, job_id, tasks):
        new = {t.key: copy.deepcopy(t) for t in tasks}
        self.tasks = {k: t for k, t in self.tasks.items() if k[0] != job_id} | new

    def load_jobs(self):
        return [stored(copy.deepcopy(j), [copy.deepcopy(t) for k, t in sorted(self.tasks.items())
                                          if k[0] == j.id])
                for j in sorted(self.jobs.values(), key=lambda j: (j.created_at, j.id))]

    def job_for_request(self, request_id):
        return self.request_ids().get(request_id) if request_id else None

    def add_event(self, job_id, time, kind, message):
        log = self.log.setdefault(job_id, [])
        log.append(EventRecord(job_id, len(log) + 1, time, kind, message))
        return len(log)

    def events(self, job_id, after_seq=0):
        return [copy.copy(e) for e in self.log.get(job_id, []) if e.seq > after_seq]

    def delete_job(self, job_id):
        self.jobs.pop(job_id, None)
        self.log.pop(job_id, None)
        self.replace_tasks(job_id, [])

    def put_worker(self, worker):
        self.workers[worker.name] = copy.deepcopy(worker)

    def load_workers(self):
        return copy.deepcopy(list(self.workers.values()))


class TestStoreDefaults(StoreContract):
    keeps_extras = False

    def make(self, tmp_path):
        return DictStore()

    def reopen(self, store, tmp_path):
        pytest.skip("a DictStore lives in memory only")


def test_schema_version_mismatch_is_refused(tmp_path):
    path = str(tmp_path / "s.db")
    s = SqliteStore(path)
    s._db.execute("UPDATE meta SET value='999' WHERE key='schema'")
    s.close()
    with pytest.raises(RuntimeError, match="state-dir"):
        SqliteStore(path)
