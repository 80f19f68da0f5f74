"""Confinement and storage as decisions, without processes: what an agent may act on and claim
(``Coordinator.live_task``, ``output_task``, ``may_fetch``, ``confine.check_report``), who holds
each uploaded byte and when it goes (``BlobStore``), the per-job caps, the disk's reserve and
ballast, certificates that carry roles, and revocation that ends open calls (``OpenCalls``)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3

import grpc
import pytest

from conftest import queued as drain
from strata.auth import Auth, Caller, Denied, certificate_caller
from strata.coordinator.agents import PurgeJobCommand, StartTaskCommand
from strata.coordinator.blobs import BlobStore
from strata.coordinator.confine import check_report, job_blobs
from strata.coordinator.disk import DiskGuard, is_full
from strata.coordinator.logs import JobLogs
from strata.errors import DiskFull, NotYours, QuotaExceeded, SpecError, UploadError
from strata.spec import parse_job_spec
from strata.types import JobState, TaskReport, TaskState

GiB = 1 << 30
SPEC = {"name": "t", "workers": 2,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64], "classes": 10}},
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 10}}


def register(coord, name, budget=GiB):
    return coord.register(name, "127.0.0.1", "CPU", budget,
                          [5000 + len(coord.workers) * 10 + i for i in range(4)], [])


def running(coord, spec=SPEC):
    """A job placed on agents a and b, its tasks RUNNING: (job, sessions)."""
    sessions = {n: register(coord, n) for n in ("a", "b")}
    job = coord.submit(spec)
    coord.tick()
    for t in job.tasks:
        coord.report(t.worker, sessions[t.worker], TaskReport(
            job.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt))
    assert job.state == JobState.RUNNING
    return job, sessions


# --- what an agent may act on ----------------------------------------------------------------

def test_an_agent_acts_only_on_its_own_live_task_of_this_attempt(env):
    coord, *_ = env
    job, s = running(coord)
    t0, t1 = job.tasks
    coord.live_task(t0.worker, s[t0.worker], job.id, t0.role, t0.index, t0.attempt)
    for worker, role, index, attempt, why in (
            (t1.worker, t0.role, t0.index, t0.attempt, "not assigned"),  # another agent's
            (t0.worker, t0.role, t0.index, t0.attempt + 1, "not its current attempt"),
            (t0.worker, "ps", 0, 1, "not assigned"),                      # no such task
    ):
        with pytest.raises(NotYours, match=why):
            coord.live_task(worker, s[worker], job.id, role, index, attempt)
    with pytest.raises(NotYours):
        coord.live_task(t0.worker, s[t0.worker], "nope-123456", t0.role, t0.index, 1)
    coord.append_logs(t0.worker, s[t0.worker], job.id, t0.role, t0.index, b"hi\n", t0.attempt)
    with pytest.raises(NotYours):
        coord.append_logs(t1.worker, s[t1.worker], job.id, t0.role, t0.index, b"x\n",
                          t0.attempt)
    # a strict report of another agent's task is refused; a heartbeat's is not applied
    with pytest.raises(NotYours):
        coord.report(t1.worker, s[t1.worker], TaskReport(job.id, t0.role, t0.index,
                                                         TaskState.FAILED, attempt=t0.attempt),
                     strict=True)
    coord.heartbeat(t1.worker, s[t1.worker], coord.workers[t1.worker].memory, [TaskReport(
        job.id, t0.role, t0.index, TaskState.FAILED, attempt=t0.attempt)], [])
    assert t0.state == TaskState.RUNNING and job.state == JobState.RUNNING
    # once ended, nothing of it is taken
    for t in job.tasks:
        coord.report(t.worker, s[t.worker], TaskReport(
            job.id, t.role, t.index, TaskState.SUCCEEDED, attempt=t.attempt,
            test_accuracy=0.9), strict=True)
    assert job.state == JobState.SUCCEEDED
    with pytest.raises(NotYours, match="has ended"):
        coord.append_logs(t0.worker, s[t0.worker], job.id, t0.role, t0.index, b"late\n",
                          t0.attempt)


def test_a_heartbeats_impossible_report_is_not_applied(env):
    coord, *_ = env
    job, s = running(coord)
    t = job.tasks[0]
    mem = coord.workers[t.worker].memory
    coord.heartbeat(t.worker, s[t.worker], mem, [TaskReport(
        job.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt, step=5, total_steps=10,
        peak_bytes=1 << 62)], [])
    assert t.peak_memory_bytes == 0 and job.metrics.step == 0  # not applied: none of it
    coord.heartbeat(t.worker, s[t.worker], mem, [TaskReport(
        job.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt, step=5, total_steps=10,
        peak_bytes=1 << 20)], [])
    assert t.peak_memory_bytes == 1 << 20


def test_outputs_come_only_from_the_live_lead_of_a_job_that_runs(env):
    coord, *_ = env
    job, s = running(coord)
    lead = next(t for t in job.tasks if t.index == 0)
    other = next(t for t in job.tasks if t.index == 1)
    assert coord.output_task(lead.worker, s[lead.worker], job.id, lead.role, lead.index,
                             lead.attempt, "model.keras") is job
    with pytest.raises(NotYours, match="not the task whose outputs"):
        coord.output_task(other.worker, s[other.worker], job.id, other.role, other.index,
                          other.attempt, "model.keras")
    with pytest.raises(NotYours, match="metrics.json"):
        coord.output_task(lead.worker, s[lead.worker], job.id, lead.role, lead.index,
                          lead.attempt, "metrics.json")
    coord.cancel(job.id)  # the lead still runs (being stopped), the job has ended
    with pytest.raises(NotYours, match="has ended"):
        coord.output_task(lead.worker, s[lead.worker], job.id, lead.role, lead.index,
                          lead.attempt, "model.keras")


def test_a_probe_keeps_figures_and_no_outputs(env):
    coord, *_ = env
    sessions = {n: register(coord, n) for n in ("a", "b")}
    job = coord.submit({**SPEC, "memory": {"profile": True}})
    probe = coord.get(coord._probe_of[job.id])
    assert probe.recovery.probe_of == job.id and not job.recovery.probe_of
    coord.tick()
    starts = [c for n in sessions for c in drain(coord, n) if isinstance(c, StartTaskCommand)]
    assert starts and all(c.config.probe for c in starts)
    t = probe.tasks[0]
    for x in probe.tasks:
        coord.report(x.worker, sessions[x.worker], TaskReport(
            probe.id, x.role, x.index, TaskState.RUNNING, attempt=x.attempt))
    with pytest.raises(NotYours, match="memory probe"):
        coord.output_task(t.worker, sessions[t.worker], probe.id, t.role, t.index, t.attempt,
                          "model.keras")
    for x in probe.tasks:
        coord.report(x.worker, sessions[x.worker], TaskReport(
            probe.id, x.role, x.index, TaskState.SUCCEEDED, attempt=x.attempt,
            peak_bytes=5 << 20, test_accuracy=0.5))
    assert probe.state == JobState.SUCCEEDED
    assert coord.blobs.outputs(probe.id) == []  # not even metrics.json
    # the probe's flag survives a restart of the coordinator
    assert coord.store.load_job(probe.id).recovery.probe_of == job.id


def test_an_agent_fetches_only_the_files_its_live_tasks_name(env, tmp_path):
    coord, *_ = env

    async def chunks():
        yield b"a model"
    sha, _ = asyncio.run(coord.blobs.put(chunks(), "alice"))
    spec = parse_job_spec(SPEC)
    model = {"keras_file": {"name": "m.keras", "sha256": sha, "size": 7, "config": "{}"}}
    assert job_blobs(spec) == frozenset()
    import dataclasses
    assert job_blobs(dataclasses.replace(spec, model=model)) == {sha}
    job, s = running(coord)
    with pytest.raises(NotYours):
        coord.may_fetch("a", s["a"], sha)  # its job names no such file
    job.spec = dataclasses.replace(job.spec, model=model)
    coord.may_fetch("a", s["a"], sha)
    with pytest.raises(NotYours):
        coord.may_fetch("a", s["a"], "0" * 64)


@pytest.mark.parametrize("status,field", [
    ({}, None),
    ({"peak_bytes": GiB + 1}, "status.peak_bytes"),
    ({"in_use_bytes": -1}, "status.in_use_bytes"),
    ({"test_accuracy": 7.5}, "status.test_accuracy"),
    ({"test_accuracy": float("nan")}, "status.test_accuracy"),
    ({"test_accuracy": 1.0, "peak_bytes": GiB}, None),
    ({"step": 11}, "status.step"),
    ({"total_steps": 10**12}, "status.total_steps"),
    ({"step": 5, "total_steps": 4}, "status.step"),
    ({"checkpoint_step": 12}, "status.checkpoint_step"),
    ({"resumed_step": 11}, "status.resumed_step"),
    ({"examples_per_sec": float("inf")}, "status.examples_per_sec"),
    ({"examples_per_sec": -3.0}, "status.examples_per_sec"),
    ({"first_step_time": 1e12}, "status.first_step_time"),
    ({"loss": float("nan"), "step": 10, "total_steps": 10}, None),  # a diverged run is real
])
def test_reported_figures_are_checked_against_the_plan_and_the_device(status, field):
    spec = parse_job_spec(SPEC)  # 10 steps
    r = TaskReport("j", "worker", 0, TaskState.RUNNING, attempt=1, **status)
    if field is None:
        check_report(r, spec, GiB, 1000.0)
    else:
        with pytest.raises(SpecError) as e:
            check_report(r, spec, GiB, 1000.0)
        assert e.value.field == field
    # an epochs plan bounds steps by what any run could take
    epochs = parse_job_spec({**SPEC, "training": {"epochs": 3}})
    check_report(TaskReport("j", "worker", 0, TaskState.RUNNING, step=5000, total_steps=9000),
                 epochs, GiB, 1000.0)


# --- who holds stored bytes ------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


async def _chunks(*parts):
    for p in parts:
        yield p


async def _held(gate, n):
    """An upload of two chunks of ``n`` bytes that waits for ``gate`` between them."""
    yield b"p" * n
    await gate.wait()
    yield b"q" * n


def test_uploads_are_held_charged_once_and_collected_when_no_job_names_them(tmp_path):
    clock = Clock()
    rows: dict[tuple[str, str], int] = {}
    store = BlobStore(str(tmp_path), user_quota=100, blob_grace_s=60, clock=clock,
                      on_hold=lambda sha, owner, size, t: rows.__setitem__((sha, owner), size),
                      on_release=lambda sha, owner: rows.pop((sha, owner)))
    a, _ = asyncio.run(store.put(_chunks(b"x" * 40), "alice"))
    asyncio.run(store.put(_chunks(b"x" * 40), "alice"))  # again: no second charge
    assert store.usage("alice") == 40 and rows == {(a, "alice"): 40}
    b, _ = asyncio.run(store.put(_chunks(b"y" * 50), "alice"))
    with pytest.raises(QuotaExceeded, match="user alice.*--user-quota"):
        asyncio.run(store.put(_chunks(b"z" * 20), "alice"))
    assert store.usage("alice") == 90 and not [n for n in os.listdir(store.root)
                                                 if n.startswith(".upload")]
    # bob's job names alice's file: bob holds it too (its own charge), and it stays while
    # the job does
    store.attach("job-b", "bob", [a])
    assert store.usage("bob") == 40
    store.check()
    clock.now += 61
    assert store.collect() == (1, 50)  # b: named by no job, past the grace
    assert store.usage("alice") == 0 and store.usage("bob") == 40 and store.exists(a)
    store.detach("job-b", [a])
    assert store.collect() == (1, 40)
    assert not store.exists(a) and not store.exists(b) and rows == {}
    store.check()


def test_outputs_are_capped_per_job_counted_to_their_owner_and_replaced_not_added(tmp_path):
    store = BlobStore(str(tmp_path), user_quota=1000, max_job_outputs=100)
    asyncio.run(store.put_output("j1", "model.keras", _chunks(b"m" * 60), owner="alice"))
    asyncio.run(store.put_output("j1", "model.keras", _chunks(b"m" * 70), owner="alice"))
    assert store.usage("alice") == 70
    with pytest.raises(QuotaExceeded, match="--max-job-outputs"):
        asyncio.run(store.put_output("j1", "tb/events", _chunks(b"e" * 40), owner="alice"))
    assert store.outputs("j1") == ["model.keras"]
    store.write_output("j1", "metrics.json", b"{}", "alice")
    assert store.usage("alice") == 72
    store.delete_outputs("j1")
    assert store.usage("alice") == 0
    store.check()


def test_accounts_are_rebuilt_from_the_store_and_the_disk(tmp_path, env):
    coord, clock, db, _ = env
    sha, _ = asyncio.run(coord.blobs.put(_chunks(b"q" * 30), "carol"))
    register(coord, "a")
    register(coord, "b")
    job = coord.submit(SPEC, owner="carol")
    coord.blobs.write_output(job.id, "metrics.json", b"1234", "carol")
    (tmp_path / "blobs" / ".upload-cut").write_bytes(b"half")  # a stop mid-upload
    (tmp_path / "outputs" / "gone-job").mkdir()                # a job deleted meanwhile
    from strata.coordinator.core import Coordinator

    again = Coordinator(db, str(tmp_path), clock=clock, monotonic=clock)
    assert again.blobs.usage("carol") == 34
    assert not (tmp_path / "blobs" / ".upload-cut").exists()
    assert not (tmp_path / "outputs" / "gone-job").exists()
    again.blobs.check()


def test_a_jobs_logs_are_capped_and_say_so(tmp_path):
    logs = JobLogs(str(tmp_path), max_job_bytes=100)
    logs.append("j", "worker", 0, b"a" * 60)
    logs.append("j", "worker", 1, b"b" * 60)
    logs.append("j", "worker", 0, b"c" * 60)
    text = open(logs.path("j", "worker", 1), "rb").read()
    assert text.startswith(b"b" * 40) and b"--max-job-logs" in text
    assert open(logs.path("j", "worker", 0), "rb").read() == b"a" * 60
    assert logs.total() <= 100 + 200
    again = JobLogs(str(tmp_path), max_job_bytes=100)
    again.load({"j": "alice"})
    assert again.total() == logs.total()
    again.load({})  # a job no longer held: its logs go
    assert not os.path.exists(os.path.join(str(tmp_path), "j"))


def test_logs_count_in_their_owners_quota_and_are_cut_at_it(tmp_path):
    blobs = BlobStore(str(tmp_path), user_quota=100)
    logs = JobLogs(str(tmp_path / "logs"), max_job_bytes=1000, account=blobs)
    asyncio.run(blobs.put(_chunks(b"u" * 60), "alice"))
    logs.append("j", "worker", 0, b"a" * 30, "alice")
    logs.append("j", "worker", 0, b"b" * 30, "alice")  # 10 of them fit
    logs.append("j", "worker", 0, b"c" * 30, "alice")  # dropped
    text = open(logs.path("j", "worker", 0), "rb").read()
    assert text.startswith(b"a" * 30 + b"b" * 10 + b"\n[strata] alice has no room left")
    assert b"c" not in text.split(b"\n")[0]
    assert blobs.usage("alice") == 100
    blobs.check()
    logs.delete("j")
    assert blobs.usage("alice") == 60
    # found on disk at a start, logs are charged whatever the quota
    logs.append("k", "worker", 0, b"x" * 20, "alice")
    again = BlobStore(str(tmp_path / "again"), user_quota=10)
    JobLogs(str(tmp_path / "logs"), account=again).load({"k": "alice"})
    assert again.usage("alice") == 20


def test_uploads_in_parallel_cannot_run_past_the_quota(tmp_path):
    store = BlobStore(str(tmp_path), user_quota=100)

    async def main():
        gate = asyncio.Event()
        first = asyncio.create_task(store.put(_held(gate, 40), "alice"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(store.put(_held(gate, 40), "alice"))
        await asyncio.sleep(0.05)
        third = asyncio.create_task(store.put(_held(gate, 40), "alice"))
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(first, second, third, return_exceptions=True)
    results = asyncio.run(main())
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert refused and store.usage("alice") <= 100
    assert store._inflight == {}
    store.check()


def test_deleting_a_job_tells_the_agents_to_purge_its_files(env):
    coord, *_ = env
    job, s = running(coord)
    for t in job.tasks:
        coord.report(t.worker, s[t.worker], TaskReport(
            job.id, t.role, t.index, TaskState.SUCCEEDED, attempt=t.attempt,
            test_accuracy=0.9))
    drain(coord, "a")
    drain(coord, "b")
    coord.delete(job.id)
    for name in ("a", "b"):
        assert PurgeJobCommand(job.id) in drain(coord, name)


# --- the disk ---------------------------------------------------------------------------------

def test_bulk_writes_stop_at_the_reserve_and_the_ballast_is_made_and_released(tmp_path):
    guard = DiskGuard(str(tmp_path), reserve_bytes=1 << 20, ballast_bytes=1 << 20)
    assert os.path.getsize(guard.ballast) == 1 << 20
    guard.check(1000, "an upload")
    free = guard.use().free_bytes
    with pytest.raises(DiskFull, match="disk is full.*--disk-reserve.*an upload refused"):
        guard.check(free, "an upload")
    assert guard.release() and not os.path.exists(guard.ballast)
    assert not guard.release()
    guard.restore()
    assert os.path.exists(guard.ballast)
    assert DiskGuard(str(tmp_path / "x"), reserve_bytes=8 << 20).ballast_bytes == 2 << 20


def test_what_counts_as_a_full_disk():
    import errno

    assert is_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_full(OSError(errno.EACCES, "Permission denied"))
    full = sqlite3.OperationalError("database or disk is full")
    full.sqlite_errorcode = 13  # SQLITE_FULL, as sqlite3 sets it
    assert is_full(full)
    assert not is_full(sqlite3.OperationalError("database is locked"))
    from strata.coordinator.rpcguard import status_for

    assert status_for(OSError(errno.ENOSPC, "x"))[0] == grpc.StatusCode.UNAVAILABLE
    assert status_for(DiskFull("the disk is full"))[0] == grpc.StatusCode.UNAVAILABLE
    assert status_for(QuotaExceeded("over"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


# --- certificates and revocation -------------------------------------------------------------

def test_certificates_carry_a_role_and_no_role_means_nothing(tmp_path):
    from strata.tls import make_cluster_certs

    p = make_cluster_certs(str(tmp_path), clients=("agent:agent", "node-a:agent", "alice",
                                                   "root:admin", "eve:viewer"))
    pem = {n: open(p[n], "rb").read() for n in ("agent", "node-a", "alice", "root", "eve")}
    assert certificate_caller(pem["alice"]) == Caller("submitter", "alice")
    assert certificate_caller(pem["agent"]).any_agent
    assert not certificate_caller(pem["node-a"]).any_agent
    a = Auth(certificates=True)
    assert a.enabled and not a.tokens
    a.check(a.certificate(pem["node-a"]), "RegisterAgent", "node-a")
    a.check(a.certificate(pem["agent"]), "RegisterAgent", "node-z")
    for who, method, agent in (("node-a", "RegisterAgent", "node-b"),
                               ("alice", "RegisterAgent", "alice"),
                               ("eve", "SubmitJob", None), ("alice", "Revoke", None)):
        with pytest.raises(Denied) as e:
            a.check(a.certificate(pem[who]), method, agent)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    nobody = Caller("", "node-x")
    with pytest.raises(Denied, match="carries no Strata role"):
        a.check(nobody, "ListJobs")
    with pytest.raises(Denied) as e:
        a.certificate(None)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    a.revoked.add("alice")
    with pytest.raises(Denied, match="revoked") as e:
        a.certificate(pem["alice"])
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_reload_names_the_tokens_that_are_gone(tmp_path):
    path = tmp_path / "tokens"
    t = "t" * 20
    path.write_text(f"{t}1 agent node-a\n{t}2 agent node-b\n{t}3 submitter alice\n")
    a = Auth(str(path))
    keys = {n: a.caller((("authorization", f"Bearer {t}{i}"),)).key
            for i, n in ((1, "node-a"), (2, "node-b"), (3, "alice"))}
    # node-a's token goes, alice's becomes a viewer's: both are closed; node-b's stays
    path.write_text(f"{t}2 agent node-b\n{t}3 viewer alice\n{t}4 agent node-a\n")
    assert a.reload() == {keys["node-a"], keys["alice"]}
    a.set_revoked(["node-b"])
    with pytest.raises(Denied, match="revoked"):
        a.caller((("authorization", f"Bearer {t}2"),))


def test_revoking_ends_the_open_calls_of_that_credential():
    from strata.coordinator.opencalls import OpenCalls

    async def main():
        calls = OpenCalls()
        alice, bob = Caller("submitter", "alice", key="k1"), Caller("submitter", "bob", key="k2")
        ended: dict[str, str] = {}

        class Context:
            def __init__(self, name):
                self.name = name

            async def abort(self, code, details):
                ended[self.name] = f"{code.name}: {details}"
                raise RuntimeError("aborted")

        async def call(caller):
            task = calls.enter(caller)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await calls.refuse_if_revoked(task, Context(caller.name))
                raise
            finally:
                calls.leave(task)
        tasks = [asyncio.create_task(call(c)) for c in (alice, bob)]
        await asyncio.sleep(0)
        assert len(calls) == 2
        assert calls.revoke(lambda c, _agent: c.key == "k1", "removed from --auth-tokens") == 1
        await asyncio.sleep(0)
        assert tasks[0].done() and not tasks[1].done()
        with pytest.raises(RuntimeError, match="aborted"):  # what grpc's abort raises
            await tasks[0]
        assert ended == {"alice": "PERMISSION_DENIED: the credentials of alice were revoked "
                                  "(removed from --auth-tokens)"}
        tasks[1].cancel()  # an ordinary cancellation passes on as one
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert "bob" not in ended and len(calls) == 0
    asyncio.run(main())


def test_the_store_keeps_holdings_and_revocations(tmp_path):
    from strata.coordinator.store import SqliteStore

    s = SqliteStore(str(tmp_path / "s.db"))
    sha = hashlib.sha256(b"x").hexdigest()
    s.put_blob_owner(sha, "alice", 1, 5.0)
    s.put_revoked("mole", 6.0)
    s.close()
    s = SqliteStore(str(tmp_path / "s.db"))
    assert s.load_blob_owners() == [(sha, "alice", 1, 5.0)]
    assert s.load_revoked() == ["mole"]
    s.delete_blob_owner(sha, "alice")
    s.delete_revoked("mole")
    assert s.load_blob_owners() == [] and s.load_revoked() == []


# --- what an outside review tried (each once a hole) ------------------------------------------

def test_metrics_json_is_the_coordinators_however_it_is_spelt(env):
    coord, *_ = env
    job, s = running(coord)
    lead = next(t for t in job.tasks if t.index == 0)
    for path in ("metrics.json", "./metrics.json", "x/../metrics.json", "metrics.json/.",
                 "/metrics.json"):
        with pytest.raises((NotYours, UploadError)):
            coord.output_task(lead.worker, s[lead.worker], job.id, lead.role, lead.index,
                              lead.attempt, path)


def test_outputs_that_collide_or_are_named_as_temporary_files_are_refused(tmp_path):
    store = BlobStore(str(tmp_path))
    asyncio.run(store.put_output("j", "d", _chunks(b"x")))
    for path in ("d/x", ".strata-part-x", "a/.strata-part-y", "n" * 300, "a/" * 40 + "b"):
        with pytest.raises(UploadError):
            asyncio.run(store.put_output("j", path, _chunks(b"y")))
    asyncio.run(store.put_output("j", "e/x", _chunks(b"z")))
    with pytest.raises(UploadError, match="a directory"):
        asyncio.run(store.put_output("j", "e", _chunks(b"z")))
    assert store.outputs("j") == ["d", "e/x"]


def test_an_upload_that_outlives_its_permission_is_not_kept(tmp_path):
    store = BlobStore(str(tmp_path))
    asyncio.run(store.put_output("j", "model.keras", _chunks(b"v1")))

    def ended():
        raise NotYours("job j has ended")
    with pytest.raises(NotYours):
        asyncio.run(store.put_output("j", "model.keras", _chunks(b"forged"),
                                     still_allowed=ended))
    with open(os.path.join(store.output_dir("j"), "model.keras"), "rb") as f:
        assert f.read() == b"v1"
    assert store.outputs("j") == ["model.keras"] and store._inflight_out == {}


def test_output_uploads_in_parallel_cannot_run_past_the_job_cap_or_the_quota(tmp_path):
    store = BlobStore(str(tmp_path), user_quota=10_000, max_job_outputs=100)

    async def main():
        gate = asyncio.Event()
        tasks = [asyncio.create_task(store.put_output("j", f"f{i}", _held(gate, 30),
                                                      owner="alice")) for i in range(4)]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)
    results = asyncio.run(main())
    assert any(isinstance(r, QuotaExceeded) for r in results)
    assert sum(r for r in results if isinstance(r, int)) <= 100
    assert store.usage("alice") <= 100 and store._inflight_out == {}
    store.check()


def test_an_oom_report_teaches_no_more_than_the_device_it_ran_on(env):
    from strata.types import OutOfMemory
    from strata.types import FailureKind

    coord, *_ = env
    job, s = running(coord)
    t = job.tasks[0]
    coord.report(t.worker, s[t.worker], TaskReport(
        job.id, t.role, t.index, TaskState.FAILED, attempt=t.attempt, failure=FailureKind.OOM,
        oom=OutOfMemory(allocation_bytes=1 << 49)), strict=True)
    assert max(coord.measured.values()) <= GiB  # each agent registered 1 GiB


def test_a_running_agent_cannot_say_its_device_grew(env):
    coord, *_ = env
    coord.register("a", "127.0.0.1", "CPU", GiB, [6000], [], pid=4242)
    with pytest.raises(SpecError, match="budget_bytes") as e:
        coord.register("a", "127.0.0.1", "CPU", 1 << 50, [6000], [], pid=4242)
    assert e.value.field == "budget_bytes"
    coord.register("a", "127.0.0.1", "CPU", GiB, [6000], [], pid=4242)  # the same: fine


def test_refused_outputs_write_a_few_events_not_one_each(env):
    coord, *_ = env
    job, _ = running(coord)
    before = len(coord.store.events(job.id))
    for _ in range(50):
        coord.output_refused(job, "model.keras", "over the quota")
    assert len(coord.store.events(job.id)) - before == 5


def test_a_full_disk_during_a_tasks_end_changes_nothing_and_the_report_can_come_again(env):
    coord, *_ = env
    job, s = running(coord)
    t = job.tasks[0]
    real = coord.store.put_tasks
    calls = {"n": 0}

    def full_once(tasks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise DiskFull("the coordinator's disk is full")
        return real(tasks)
    coord.store.put_tasks = full_once
    end = TaskReport(job.id, t.role, t.index, TaskState.FAILED, attempt=t.attempt,
                     message="boom")
    with pytest.raises(DiskFull):
        coord.report(t.worker, s[t.worker], end, strict=True)
    assert t.state == TaskState.RUNNING and job.state == JobState.RUNNING
    coord.report(t.worker, s[t.worker], end, strict=True)  # the agent's retry
    assert t.state == TaskState.FAILED and job.state == JobState.FAILED


def test_a_job_names_only_files_its_owner_uploaded(env):
    from strata.coordinator.jobapi import JobServicer
    from strata.protos import strata_pb2 as pb

    coord, *_ = env
    sha, _ = asyncio.run(coord.blobs.put(_chunks(b"alice's code"), "alice"))
    msg = pb.JobSpec()
    msg.code.sha256, msg.code.dir_name = sha, "proj"
    coord.allow_user_code = True
    with pytest.raises(SpecError, match="not uploaded by you") as e:
        JobServicer(coord)._stored_files(msg, "bob")
    assert e.value.field == "code.dir"
    assert JobServicer(coord)._stored_files(msg, "alice").code.size == len(b"alice's code")


def test_certificates_with_a_name_no_revocation_can_name_have_no_role(tmp_path):
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from strata.tls import make_ca

    ca_key, ca = make_ca()

    def cert(attrs):
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        c = (x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca.subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
             .sign(ca_key, hashes.SHA256()))
        from cryptography.hazmat.primitives import serialization
        return c.public_bytes(serialization.Encoding.PEM)
    ou = lambda r: x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, r)  # noqa: E731
    cn = lambda n: x509.NameAttribute(NameOID.COMMON_NAME, n)  # noqa: E731
    assert certificate_caller(cert([ou("admin"), cn("root")])).role == "admin"
    for attrs in ([ou("admin")], [ou("admin"), cn("bad name")], [ou("admin"), cn("x\x01y")],
                  [ou("viewer"), ou("admin"), cn("eve")], [ou("admin"), cn("a"), cn("b")]):
        assert certificate_caller(cert(attrs)).role == "", attrs


def test_revoking_an_agents_name_stops_whatever_credential_acts_as_it(tmp_path):
    a = Auth(certificates=True)
    anyone = Caller("agent", "agent", key="cert:x", any_agent=True)
    a.check(anyone, "RegisterAgent", "w1")
    a.revoked.add("w1")
    with pytest.raises(Denied, match="w1"):
        a.check(anyone, "RegisterAgent", "w1")
    a.check(anyone, "RegisterAgent", "w2")


def test_a_keras_file_nested_beyond_reason_is_refused_naming_the_field(tmp_path):
    import zipfile

    from strata.uploads import keras_config

    path = tmp_path / "deep.keras"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("config.json", "[" * 100_000 + "]" * 100_000)
        z.writestr("model.weights.h5", b"")
        z.writestr("metadata.json", "{}")
    with pytest.raises(SpecError) as e:
        keras_config(str(path), "deep.keras")
    assert e.value.field == "model.keras_file"
