"""The CLI against a real coordinator (no agents, no TensorFlow): flags, errors, exit codes, --json."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from strata.local import LocalCluster

pytestmark = pytest.mark.integration  # starts coordinator, agent or TensorFlow processes


@pytest.fixture(scope="module")
def coord(tmp_path_factory):
    c = LocalCluster(workers=0, state_dir=str(tmp_path_factory.mktemp("cli")))
    c.start_coordinator()
    yield c
    c.stop()


def strata(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def write_job(tmp_path, **extra):
    spec = {"name": "cli-job", "workers": 2,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [32], "classes": 10}},
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 3}, **extra}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(spec))
    return str(path)


def test_submit_prints_id_and_job_lists_as_pending(coord, tmp_path):
    r = strata("submit", write_job(tmp_path), "--coordinator", coord.address)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert job_id.startswith("cli-job-")
    r = strata("status", job_id, "--json", "--coordinator", coord.address)
    job = json.loads(r.stdout)
    for key in ("id", "name", "state", "strategy", "message", "restarts", "created_at",
                "finished_at", "metrics", "tasks"):
        assert key in job
    assert job["state"] == "PENDING" and len(job["tasks"]) == 2
    assert set(job["metrics"]) >= {"step", "total_steps", "loss", "test_accuracy", "examples_per_sec"}
    assert set(job["tasks"][0]) >= {"role", "index", "worker", "state", "stage",
                                    "memory_budget_bytes", "peak_memory_bytes"}
    r = strata("jobs", "--json", "--coordinator", coord.address)
    assert job_id in [j["id"] for j in json.loads(r.stdout)]
    r = strata("cancel", job_id, "--coordinator", coord.address)
    assert r.returncode == 0 and "CANCELLED" in r.stdout
    r = strata("cancel", job_id, "--coordinator", coord.address)
    assert r.returncode == 1 and "CANCELLED" in r.stderr


def test_plan_json(coord, tmp_path):
    r = strata("plan", write_job(tmp_path), "--json", "--coordinator", coord.address)
    plan = json.loads(r.stdout)
    assert plan["strategy"] == "multi_worker_mirrored" and plan["feasible"] is True
    assert len(plan["tasks"]) == 2 and plan["tasks"][0]["estimated_memory_bytes"] > 0
    assert set(plan["tasks"][0]) >= {"role", "index", "worker", "stage", "layers", "estimated_memory_bytes"}


@pytest.mark.parametrize("args,needle", [
    (["--set", "data.batch_size=63"], "data.batch_size"),
    (["--set", "strategy=magic"], "strategy"),
    (["--set", "model.builtin.hidden=[0]"], "model.builtin.hidden[0]"),
    (["--set", "nonsense"], "KEY=VALUE"),
])
def test_rejected_spec_exits_2_naming_the_field(coord, tmp_path, args, needle):
    r = strata("submit", write_job(tmp_path), *args, "--coordinator", coord.address)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bad_flags_and_missing_things(coord, tmp_path):
    r = strata("worker", "--coordinator", coord.address, "--memory-budget", "lots")
    assert r.returncode == 2 and "--memory-budget" in r.stderr
    r = strata("worker", "--coordinator", coord.address, "--memory-budget", "1GiB", "--device", "TPU")
    assert r.returncode == 2 and "--device" in r.stderr
    r = strata("worker", "--coordinator", coord.address, "--memory-budget", "1GiB",
               "--cpu-kernels", "mkl")
    assert r.returncode == 2 and "--cpu-kernels" in r.stderr and "Traceback" not in r.stderr
    r = strata("status", "nope-123456", "--coordinator", coord.address)
    assert r.returncode == 4 and "not found" in r.stderr
    r = strata("logs", "nope-123456", "--task", "worker", "--coordinator", coord.address)
    assert r.returncode == 2 and "--task" in r.stderr
    r = strata("submit", str(tmp_path / "missing.yaml"), "--coordinator", coord.address)
    assert r.returncode == 2 and "missing.yaml" in r.stderr
    r = strata("jobs", "--coordinator", "not-an-address")
    assert r.returncode == 2 and "--coordinator" in r.stderr
    assert "Traceback" not in r.stderr
    r = strata("worker", "--coordinator", coord.address, "--memory-budget", "1GiB",
               "--shared-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "--shared-dir" in r.stderr
    r = strata("drain", "no-such-worker", "--coordinator", coord.address)
    assert r.returncode == 4 and "not found" in r.stderr


def test_checkpointed_job_without_a_shared_dir_is_refused(tmp_path):
    c = LocalCluster(workers=0, state_dir=str(tmp_path))
    try:
        c.start_coordinator()
        proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "worker", "--coordinator",
                                 c.address, "--memory-budget", "1GiB", "--name", "solo",
                                 "--work-dir", str(tmp_path / "solo"), "--warm-pool", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with c.client() as client:
                import time

                deadline = time.monotonic() + 60
                while {w.name: w.state.value for w in client.workers()}.get("solo") != "READY":
                    assert time.monotonic() < deadline, "solo never registered"
                    time.sleep(0.2)
                assert client.workers()[0].shared_dir == ""
            r = strata("submit", write_job(tmp_path, workers=1,
                                           checkpoint={"every_steps": 10}),
                       "--coordinator", c.address)
            assert r.returncode == 2 and "--shared-dir" in r.stderr, r.stderr
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        c.stop()


def test_unreachable_coordinator_exits_3():
    import portpicker
    r = strata("jobs", "--coordinator", f"127.0.0.1:{portpicker.pick_unused_port()}", timeout=60)
    assert r.returncode == 3 and "cannot reach" in r.stderr


def test_health_and_reflection(coord):
    with grpc.insecure_channel(coord.address) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        resp = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="strata.v1.JobService"), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        (answer,) = list(stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in answer.list_services_response.service}
        assert {"strata.v1.JobService", "strata.v1.ClusterService", "grpc.health.v1.Health"} <= names


def test_hostile_agent_calls_are_refused_not_crashing(coord):
    from strata.protos import strata_pb2 as pb
    from strata.protos import strata_pb2_grpc as pb_grpc
    with grpc.insecure_channel(coord.address) as ch:
        stub = pb_grpc.ClusterServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAgent(pb.RegisterAgentRequest(name="", budget_bytes=-1), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Heartbeat(pb.HeartbeatRequest(name="ghost", session="x"), timeout=5).reregister
        with pytest.raises(grpc.RpcError) as e:
            stub.ReportTask(pb.ReportTaskRequest(name="ghost", session="x"), timeout=5)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # advertised names, hosts and ports are checked; refusals quote them bounded
        for bad in (dict(name="x" * (1 << 20)), dict(host=";rm -rf /"), dict(free_ports=[-1]),
                    dict(free_ports=[70000]), dict(device="TPU:0"), dict(host="")):
            req = {"name": "hostile", "host": "127.0.0.1", "budget_bytes": 1 << 30, **bad}
            with pytest.raises(grpc.RpcError) as e:
                stub.RegisterAgent(pb.RegisterAgentRequest(**req), timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
            assert len(e.value.details()) < 300
        # a report of a task the agent was never given is refused, not applied
        ok = stub.RegisterAgent(pb.RegisterAgentRequest(name="honest", host="127.0.0.1",
                                                        budget_bytes=1 << 30, pid=4242),
                                timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            stub.ReportTask(pb.ReportTaskRequest(name="honest", session=ok.session, status=(
                pb.TaskStatus(job_id="victim-123456", role="worker", index=0))), timeout=5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # a live agent's name is refused without saying which host or process holds it
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAgent(pb.RegisterAgentRequest(name="honest", host="127.0.0.1",
                                                       budget_bytes=1 << 30, pid=1), timeout=5)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "4242" not in e.value.details() and "127.0.0.1" not in e.value.details()
    r = strata("jobs", "--coordinator", coord.address)
    assert r.returncode == 0


def test_second_coordinator_on_same_state_dir_or_port_is_refused(coord):
    r = strata("coordinator", "--listen", "127.0.0.1:0", "--state-dir", coord.state_dir, timeout=30)
    assert r.returncode == 1 and "another coordinator" in r.stderr and "Traceback" not in r.stderr
    r = strata("coordinator", "--listen", coord.address, "--state-dir", coord.state_dir + "-x", timeout=30)
    assert r.returncode == 1 and "--listen" in r.stderr and "Traceback" not in r.stderr


def test_malformed_agent_status_is_invalid_argument(coord):
    from strata.protos import strata_pb2 as pb
    from strata.protos import strata_pb2_grpc as pb_grpc
    with grpc.insecure_channel(coord.address) as ch:
        stub = pb_grpc.ClusterServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAgent(pb.RegisterAgentRequest(
                name="odd", budget_bytes=1, tasks=[pb.TaskStatus(job_id="j", state=99)]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_what_the_cli_says_is_what_the_coordinator_would_do(tmp_path):
    """A job wider than the cluster has ever been is refused at submit with the numbers (and
    by validate --coordinator), or waits with --queue-for-capacity; the jobs table shows a
    waiting job's reason whole and folds memory probes into their jobs (--all shows them);
    validate reads an npz file's shapes against the model."""
    import numpy as np

    from strata.protos import strata_pb2 as pb
    from strata.protos import strata_pb2_grpc as pb_grpc
    from strata.tls import ClientTls, channel

    c = LocalCluster(workers=0, state_dir=str(tmp_path / "c"))
    try:
        c.start_coordinator()
        ch = channel(c.address, ClientTls())
        try:  # one agent, by hand: no TensorFlow needed to be a cluster of one
            pb_grpc.ClusterServiceStub(ch).RegisterAgent(pb.RegisterAgentRequest(
                name="solo", host="127.0.0.1", budget_bytes=1 << 30, free_ports=[41001]),
                timeout=20)
        finally:
            ch.close()
        wide = write_job(tmp_path)  # 2 workers
        r = strata("submit", wide, "--coordinator", c.address)
        assert r.returncode == 2 and "needs 2 workers" in r.stderr and "has had 1" in r.stderr
        assert "--queue-for-capacity" in r.stderr, r.stderr
        assert strata("validate", wide).returncode == 0  # on this machine alone: valid
        r = strata("validate", wide, "--coordinator", c.address)
        assert r.returncode == 2 and "needs 2 workers" in r.stderr, r.stderr
        r = strata("submit", wide, "--queue-for-capacity", "10m", "--coordinator", c.address)
        assert r.returncode == 0, r.stderr
        waiting = r.stdout.strip()
        r = strata("status", waiting, "--json", "--coordinator", c.address)
        reason = json.loads(r.stdout)["message"]
        assert len(reason) > 60
        r = strata("jobs", "--coordinator", c.address)
        assert reason in r.stdout  # whole, not cut
        # a job measured first: its probe is part of it
        probed = tmp_path / "probed"
        probed.mkdir()
        r = strata("submit", write_job(probed, workers=1, memory={"profile": True}),
                   "--coordinator", c.address)
        assert r.returncode == 0, r.stderr
        shown = [j["id"] for j in json.loads(strata("jobs", "--json", "--coordinator",
                                                    c.address).stdout)]
        every = json.loads(strata("jobs", "--json", "--all", "--coordinator", c.address).stdout)
        probes = [j for j in every if j["probe_of"]]
        assert len(probes) == 1 and probes[0]["id"] not in shown
        assert probes[0]["probe_of"] in shown
    finally:
        c.stop()
    # data the model cannot take, seen before anything is sent
    data = tmp_path / "data.npz"
    rows = np.zeros((20, 10), np.float32)
    np.savez(data, x_train=rows, y_train=np.zeros(20, np.int64), x_test=rows,
             y_test=np.zeros(20, np.int64))
    job = write_job(tmp_path, workers=1, data={"source": "npz", "path": str(data),
                                               "batch_size": 4})
    r = strata("validate", job)
    assert r.returncode == 2 and "data.path" in r.stderr and "[10]" in r.stderr, r.stderr
