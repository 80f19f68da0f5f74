"""A shared cluster's trust boundaries, tried from outside against a real coordinator over mutual
TLS with tokens: an agent driven by hand (``Rogue``, the real protocol, nothing faked) acts only
on the task it was given, of that attempt, while it is live; what it claims is checked against
the plan; revoking its token (SIGHUP) or its name (``strata admin revoke``) closes its open
streams at once and its task restarts on another agent; a quota and a full disk are answered
RESOURCE_EXHAUSTED and UNAVAILABLE, never INTERNAL, and reads and cancels go on."""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time

import grpc
import pytest

from conftest import wait_until
from strata.auth import with_token
from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata.tls import ClientTls, channel
from strata.types import JobState

pytestmark = pytest.mark.integration

DENIED = grpc.StatusCode.PERMISSION_DENIED
PORTS = [41001, 41002, 41003]  # offered, never bound: no task process starts there
MODEL = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [8], "classes": 10}}


def job(name: str, steps: int = 1_000_000, budget: str = "64MiB", **more) -> dict:
    return {"name": name, "strategy": "multi_worker_mirrored", "workers": 1, "model": MODEL,
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": steps},
            "memory": {"per_task_budget": budget}, **more}


class Rogue:
    """An agent driven by hand over the cluster API: what a compromised or broken host can
    send with a valid agent token. It registers, keeps its command stream and heartbeats
    open (threads), and records what the coordinator answers."""

    def __init__(self, cluster, name: str, budget: int, draining: bool = False):
        token = cluster._new_token("agent", name)
        time.sleep(0.5)  # the SIGHUP that loads it
        p = cluster.tls_paths
        self.channel = channel(cluster.address, ClientTls(p["ca"], p["agent"], p["agent_key"]))
        self.stub = pb_grpc.ClusterServiceStub(with_token(self.channel, token))
        self.name = name
        self.session = self.stub.RegisterAgent(pb.RegisterAgentRequest(
            name=name, host="127.0.0.1", budget_bytes=budget, free_ports=PORTS,
            pid=os.getpid(), draining=draining), timeout=20).session
        self.commands: queue.Queue[pb.AgentCommand] = queue.Queue()
        #: how the command stream and the heartbeat stream ended (a status code), and when
        self.connect_end: tuple[grpc.StatusCode, float] | None = None
        self.beats_end: tuple[grpc.StatusCode, float] | None = None
        self.beats: list[pb.TaskStatus] = []  # what the heartbeats report
        self._stop = threading.Event()
        threading.Thread(target=self._connect, daemon=True).start()
        threading.Thread(target=self._heartbeats, daemon=True).start()

    def _connect(self) -> None:
        try:
            for cmd in self.stub.Connect(pb.ConnectRequest(name=self.name,
                                                           session=self.session)):
                self.commands.put(cmd)
            self.connect_end = (grpc.StatusCode.OK, time.monotonic())
        except grpc.RpcError as e:
            self.connect_end = (e.code(), time.monotonic())

    def _heartbeats(self) -> None:
        requests: queue.Queue[pb.HeartbeatRequest | None] = queue.Queue()

        def gen():
            while (r := requests.get()) is not None:
                yield r
        call = self.stub.Heartbeats(gen())
        try:
            while not self._stop.is_set():
                requests.put(pb.HeartbeatRequest(name=self.name, session=self.session,
                                                 tasks=list(self.beats), sent_at=time.time(),
                                                 free_ports=PORTS))
                next(call)
                self._stop.wait(0.5)
        except grpc.RpcError as e:
            self.beats_end = (e.code(), time.monotonic())
        finally:
            requests.put(None)

    def start(self, timeout: float = 60) -> pb.StartTask:
        """The next StartTask pushed to this agent."""
        while True:
            cmd = self.commands.get(timeout=timeout)
            if cmd.WhichOneof("command") == "start":
                return cmd.start

    def call(self, method: str, request) -> tuple[grpc.StatusCode, str, str]:
        """(code, details, the field named) of one call."""
        try:
            getattr(self.stub, method)(request, timeout=20)
            return grpc.StatusCode.OK, "", ""
        except grpc.RpcError as e:
            field = dict(e.trailing_metadata() or ()).get("strata-field", "")
            return e.code(), e.details(), field

    def report(self, start: pb.StartTask, attempt: int | None = None, **status):
        return self.call("ReportTask", pb.ReportTaskRequest(
            name=self.name, session=self.session, status=pb.TaskStatus(
                job_id=start.job_id, role=start.role, index=start.index,
                attempt=start.attempt if attempt is None else attempt, **status)))

    def logs(self, job_id: str, role: str, index: int, attempt: int, data: bytes):
        return self.call("AppendLogs", pb.AppendLogsRequest(
            name=self.name, session=self.session, job_id=job_id, role=role, index=index,
            attempt=attempt, data=data))

    def upload(self, job_id: str, role: str, index: int, attempt: int, path: str,
               data: bytes):
        def chunks():
            yield pb.OutputChunk(name=self.name, session=self.session, job_id=job_id,
                                 role=role, index=index, attempt=attempt,
                                 chunk=pb.FileChunk(path=path, data=data, size=len(data)))
        return self.call("UploadOutput", chunks())

    def fetch(self, sha: str):
        def drain(request, timeout):
            return list(self.stub.FetchBlob(request, timeout=timeout))
        try:
            drain(pb.FetchBlobRequest(name=self.name, session=self.session, sha256=sha), 20)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    def close(self) -> None:
        """Leaves as an agent that stops does: drained (it takes nothing more), then gone."""
        self.call("DrainAgent", pb.DrainAgentRequest(name=self.name, session=self.session))
        self._stop.set()
        self.channel.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A coordinator over mutual TLS with tokens, and no agents yet (each test adds its own):
    alice and bob submit, the admin revokes."""
    from strata.local import LocalCluster

    c = LocalCluster(workers=0, tls=True, state_dir=str(tmp_path_factory.mktemp("confined")),
                     threads=1, coordinator_args=["--user-quota", "3MiB"])
    c.start_coordinator()
    tokens = {n: c._new_token("submitter", n) for n in ("alice", "bob")}
    time.sleep(0.5)
    yield c, tokens
    c.stop()


def client(c, token):
    from strata.client import Client

    return Client(c.address, tls=c.client_tls(), token=token)


def upload(cl, tmp_path, data: bytes) -> str:
    """Uploads ``data`` as a file through the client; returns its digest."""
    path = tmp_path / f"up-{os.urandom(4).hex()}"
    path.write_bytes(data)
    try:
        return cl.upload(str(path))
    finally:
        path.unlink()


def events(cl, job_id: str) -> list[str]:
    """The job's stored events, as text."""
    out = []
    try:
        for ev in cl.watch(job_id, timeout=3):
            if ev.seq:
                out.append(ev.message)
    except TimeoutError:
        pass
    return out


def test_an_agent_acts_only_on_its_live_task_and_claims_only_the_possible(shared, tmp_path):
    c, tokens = shared
    evil = Rogue(c, "evil", budget=256 << 20)
    try:
        with client(c, tokens["alice"]) as alice, client(c, tokens["bob"]) as bob:
            # job A is evil's own: the only agent there is
            a = alice.submit(job("a", steps=10))
            start = evil.start()
            assert (start.job_id, start.role, start.index, start.attempt) == \
                (a.id, "worker", 0, 1)
            assert evil.report(start, state=pb.RUNNING)[0] == grpc.StatusCode.OK
            # a real agent for bob's job B (too large for evil's budget); bob's upload is a
            # file that job names
            c.add_worker("worker-0")
            sha = upload(bob, tmp_path, b"bob's code" * 100)
            b = bob.submit(job("b", budget="300MiB"))
            wait_until(lambda: bob.get(b.id).state == JobState.RUNNING, 120, what="b RUNNING")
            bt = bob.get(b.id).tasks[0]
            assert bt.worker == "worker-0"

            # another job's task: nothing evil sends about it is taken
            assert evil.logs(b.id, "worker", 0, 1, b"forged\n")[0] == DENIED
            assert evil.upload(b.id, "worker", 0, 1, "model.keras", b"forged")[0] == DENIED
            assert evil.report(pb.StartTask(job_id=b.id, role="worker", index=0, attempt=1),
                               state=pb.SUCCEEDED)[0] == DENIED
            assert evil.fetch(sha) == DENIED
            evil.beats = [pb.TaskStatus(job_id=b.id, role="worker", index=0, attempt=1,
                                        state=pb.FAILED, step=999_999)]
            time.sleep(2)  # heartbeats carry it: never applied
            evil.beats = []
            got = bob.get(b.id)
            assert got.state == JobState.RUNNING and got.metrics.step < 999_999
            assert b"forged" not in b"".join(d for _, _, d in bob.logs(b.id))

            # its own task: another attempt, or impossible figures, are refused by name
            assert evil.report(start, attempt=2, state=pb.RUNNING)[0] == DENIED
            for status, field in ((dict(peak_bytes=1 << 62), "status.peak_bytes"),
                                  (dict(has_result=True, test_accuracy=7.5),
                                   "status.test_accuracy"),
                                  (dict(step=10**12, total_steps=10), "status.step"),
                                  (dict(step=5, total_steps=10**12), "status.total_steps"),
                                  (dict(step=9, total_steps=8), "status.step")):
                code, _details, named = evil.report(start, state=pb.RUNNING, **status)
                assert (code, named) == (grpc.StatusCode.INVALID_ARGUMENT, field)
            assert evil.upload(a.id, "worker", 0, 1, "metrics.json", b"{}")[0] == DENIED
            assert evil.upload(a.id, "worker", 0, 1, "model.keras", b"v1")[0] == \
                grpc.StatusCode.OK
            assert evil.logs(a.id, "worker", 0, 1, b"hello from a\n")[0] == grpc.StatusCode.OK
            # an upload begun while the job runs and finished after it ended is not kept
            go_on, held = threading.Event(), []

            def chunks():
                for i, data in enumerate((b"forged-", b"after-success")):
                    if i:
                        go_on.wait(30)
                    yield pb.OutputChunk(name=evil.name, session=evil.session, job_id=a.id,
                                         role="worker", index=0, attempt=1,
                                         chunk=pb.FileChunk(path="model.keras", data=data))

            def late_upload():
                held.append(evil.call("UploadOutput", chunks())[0])
            t = threading.Thread(target=late_upload, daemon=True)
            t.start()
            time.sleep(0.5)
            assert evil.report(start, state=pb.SUCCEEDED, step=10, total_steps=10,
                               has_result=True, test_accuracy=0.5)[0] == grpc.StatusCode.OK
            go_on.set()
            t.join(30)
            assert held == [DENIED]
            done = alice.wait(a.id, timeout=30)
            assert done.state == JobState.SUCCEEDED
            # a finished job's outputs and logs are as they were
            assert evil.upload(a.id, "worker", 0, 1, "model.keras", b"forged")[0] == DENIED
            assert evil.logs(a.id, "worker", 0, 1, b"late\n")[0] == DENIED
            out = c.state_dir + "/outputs/" + a.id + "/model.keras"
            assert open(out, "rb").read() == b"v1"
            assert b"".join(d for _, _, d in alice.logs(a.id)) == b"hello from a\n"
            bob.cancel(b.id)
    finally:
        evil.close()


def test_revoking_a_token_closes_its_streams_and_moves_its_task(shared):
    c, tokens = shared
    mole = Rogue(c, "mole", budget=256 << 20)
    try:
        with client(c, tokens["alice"]) as alice, c.client() as admin:
            # an agent an earlier test started takes nothing here
            if any(w.name == "worker-0" for w in admin.workers()):
                admin.drain("worker-0")
            jc = alice.submit(job("c", restart={"max_restarts": 3, "backoff_s": 0}))
            start = mole.start()
            assert start.job_id == jc.id
            assert mole.report(start, state=pb.RUNNING)[0] == grpc.StatusCode.OK
            wait_until(lambda: alice.get(jc.id).state == JobState.RUNNING, 30, what="RUNNING")
            c.add_worker("worker-1")  # where the job goes once mole is revoked
            sighup = time.monotonic()
            c.remove_tokens("mole")
            wait_until(lambda: mole.connect_end is not None, 5, what="the command stream end")
            code, at = mole.connect_end
            assert code == DENIED and at - sighup < 2.0
            wait_until(lambda: mole.beats_end is not None, 5, what="the heartbeat stream end")
            assert mole.beats_end[0] == DENIED
            # its task restarts elsewhere, as a lost agent's does
            moved = wait_until(lambda: (j := alice.get(jc.id)).state == JobState.RUNNING
                               and j.tasks[0].worker == "worker-1" and j, 120,
                               what="the job running on worker-1")
            assert moved.restarts == 1
            assert "credentials were revoked" in " ".join(events(alice, jc.id))
            code, _, _ = mole.call("RegisterAgent", pb.RegisterAgentRequest(
                name="mole", host="127.0.0.1", budget_bytes=1 << 28))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            alice.cancel(jc.id)
    finally:
        mole.close()


def test_admin_revoke_closes_every_call_of_a_name(shared):
    c, tokens = shared
    spy = Rogue(c, "spy", budget=1 << 28, draining=True)
    try:
        with client(c, tokens["bob"]) as bob, c.client() as admin:
            jd = bob.submit(job("d"))
            ended: list[grpc.StatusCode] = []

            def watch():
                try:
                    for _ in bob.watch(jd.id, timeout=60):
                        pass
                except Exception as e:  # noqa: BLE001 - the watch's end is what is looked at
                    ended.append(getattr(e, "code", None))
            t = threading.Thread(target=watch, daemon=True)
            t.start()
            time.sleep(1)
            r = admin.revoke("spy")
            assert r.agents_lost == ["spy"] and "spy" in r.revoked and r.streams_closed >= 2
            wait_until(lambda: spy.connect_end is not None, 5, what="spy's stream end")
            assert spy.connect_end[0] == DENIED
            r = admin.revoke("bob")  # a user: its open watch closes too
            t.join(timeout=10)
            assert ended and ended[0] == DENIED
            assert sorted(admin.revoke().revoked) == ["bob", "spy"]
            with pytest.raises(Exception, match="revoked"):
                bob.jobs()
            admin.revoke("bob", restore=True)
            assert [j.id for j in bob.jobs() if j.id == jd.id] == [jd.id]
            bob.cancel(jd.id)
            r = subprocess.run([sys.executable, "-m", "strata.cli", "admin", "revoked",
                                "--coordinator", c.address, "--tls-ca", c.tls_paths["ca"],
                                "--tls-cert", c.tls_paths["client"], "--tls-key",
                                c.tls_paths["client_key"], "--token-file",
                                os.path.join(c.state_dir, "tls", "admin.token")],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0 and r.stdout.split() == ["spy"], r.stderr
    finally:
        spy.close()


def test_a_users_stored_bytes_are_bounded_by_its_quota(shared, tmp_path):
    from strata.client import QuotaExceeded

    c, tokens = shared
    with client(c, tokens["alice"]) as alice, client(c, tokens["bob"]) as bob:
        one = os.urandom(1 << 20)
        upload(alice, tmp_path, one)
        upload(alice, tmp_path, one)  # the same file again: held once, charged once
        upload(alice, tmp_path, os.urandom(1 << 20))
        with pytest.raises(QuotaExceeded, match=r"--user-quota"):
            upload(alice, tmp_path, os.urandom(3 << 19))
        upload(bob, tmp_path, os.urandom(1 << 20))  # another user's room is its own


def _mount_tmpfs_coordinator(tmp_path, size_mib: int) -> tuple[subprocess.Popen, str, str]:
    """A coordinator whose --state-dir is a tmpfs of ``size_mib`` in a mount namespace of
    its own (``unshare``), so that its disk can really fill; returns the process, its
    address and where its state directory is seen from here (through /proc)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to give the coordinator a small disk")
    mnt = tmp_path / "small"
    mnt.mkdir()
    port_file = tmp_path / "address"
    log = open(tmp_path / "coordinator.log", "wb")
    script = (f"mount -t tmpfs -o size={size_mib}m tmpfs {mnt} || exit 97; exec "
              f"{sys.executable} -m strata.cli coordinator --listen 127.0.0.1:0 --state-dir "
              f"{mnt}/state --port-file {port_file} --disk-reserve 8MiB")
    proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", script], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None:
            pytest.skip(f"cannot mount a tmpfs in a mount namespace here (exit "
                        f"{proc.returncode})")
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return proc, port_file.read_text(), f"/proc/{proc.pid}/root{mnt}"


def test_a_full_disk_is_unavailable_and_reads_and_cancels_go_on(tmp_path):
    from strata.client import Client, DiskFull

    proc, address, seen = _mount_tmpfs_coordinator(tmp_path, 64)
    try:
        with Client(address) as cl:
            waiting = [cl.submit(job(f"w{i}")) for i in range(3)]
            # something else fills the disk to the last byte
            with open(f"{seen}/filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                except OSError:
                    pass
            with pytest.raises(DiskFull, match="disk is full"):
                upload(cl, tmp_path, b"x" * 1000)
            with pytest.raises(DiskFull, match="disk is full"):
                cl.submit(job("more"))
            # reads, cancels and deletes go on (the ballast makes their room)
            assert {j.id for j in cl.jobs()} == {j.id for j in waiting}
            assert cl.cancel(waiting[0].id).state == JobState.CANCELLED
            cl.delete(waiting[0].id)
            assert cl.cancel(waiting[1].id).state == JobState.CANCELLED
            assert cl.get(waiting[1].id).state == JobState.CANCELLED
            os.unlink(f"{seen}/filler")
            assert cl.submit(job("after")).state == JobState.PENDING
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = (tmp_path / "coordinator.log").read_text()
    assert "Traceback" not in text and "internal error" not in text
