"""End to end on one shared local cluster: real coordinator, agents and TensorFlow processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import spec, task_processes, wait_until
from strata.client import Infeasible, JobRejected
from strata.types import FailureKind, JobState, TaskState

pytestmark = pytest.mark.integration
GiB = 1 << 30


def test_two_worker_digits_job_trains_and_releases_memory(cluster, client):
    job = client.submit(spec())
    assert job.state == JobState.PENDING and len(job.tasks) == 2
    final = client.wait(job.id, timeout=300)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.90
    assert final.metrics.step == final.metrics.total_steps > 0
    hashes = {t.weights_sha256 for t in final.tasks}
    assert len(hashes) == 1 and "" not in hashes, "replicas ended with different weights"
    assert {t.worker for t in final.tasks} == {"worker-0", "worker-1"}
    for t in final.tasks:
        assert t.state == TaskState.SUCCEEDED
        assert 0 < t.peak_memory_bytes <= t.memory_budget_bytes
    (saved,) = [t.model_path for t in final.tasks if t.model_path]
    assert saved.endswith("model.keras")
    # stored once: on the coordinator, for `strata download`; the agent's copy is gone
    stored = client.get(job.id)
    assert "model.keras" in stored.outputs
    assert os.path.getsize(os.path.join(stored.output_dir, "model.keras")) > 0
    assert not os.path.exists(saved)
    # Reservations go at once; in-use memory returns to the idle figure with the next heartbeat.
    def idle():
        ws = client.workers()
        ok = all(w.memory.reserved_bytes == 0 and w.memory.in_use_bytes == 0
                 and w.state.value == "READY" for w in ws)
        return ws if ok and len(ws) == 2 else None

    workers = wait_until(idle, 10, what="idle workers")
    # a worker's PEAK is its running tasks' (an earlier job's stays with that job's tasks)
    assert all(w.memory.peak_bytes == 0 for w in workers)
    logs = b"".join(data for _, _, data in client.logs(job.id))
    assert b"step" in logs
    assert not task_processes(job.id)
    r = subprocess.run([sys.executable, "-m", "strata.cli", "logs", job.id, "--task", "worker:1",
                        "--coordinator", cluster.address], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "step" in r.stdout
    r = subprocess.run([sys.executable, "-m", "strata.cli", "status", job.id,
                        "--coordinator", cluster.address], capture_output=True, text=True, timeout=60)
    assert "SUCCEEDED" in r.stdout and "PEAK" in r.stdout and "MiB" in r.stdout
    # deleted, the job leaves no file behind: the coordinator's, and the agents' folders
    job_dirs = [os.path.join(cluster.shared_dir, "jobs", job.id)] + [
        os.path.join(cluster.state_dir, "workers", w, "jobs", job.id)
        for w in ("worker-0", "worker-1")]
    assert any(os.path.exists(d) for d in job_dirs)
    client.delete(job.id)
    wait_until(lambda: not any(os.path.exists(d) for d in job_dirs), 10, what="purged")
    assert not os.path.exists(stored.output_dir)
    assert not os.path.exists(os.path.join(cluster.state_dir, "logs", job.id))


def test_cancel_leaves_no_task_process(cluster, client):
    job = client.submit(spec(name="long", training={"steps": 1_000_000}))
    wait_until(lambda: client.get(job.id).state == JobState.RUNNING, 120, what="RUNNING")
    assert len(task_processes(job.id)) == 2
    # the two local agents share this host's CPUs: status says so
    r = subprocess.run([sys.executable, "-m", "strata.cli", "status", job.id,
                        "--coordinator", cluster.address], capture_output=True, text=True,
                       timeout=60)
    assert "worker-0, worker-1 share host" in r.stdout, r.stdout
    client.cancel(job.id)
    final = client.wait(job.id, timeout=60)
    assert final.state == JobState.CANCELLED
    wait_until(lambda: all(t.state == TaskState.CANCELLED for t in client.get(job.id).tasks), 30,
               what="tasks CANCELLED")
    assert not task_processes(job.id)
    wait_until(lambda: all(w.memory.reserved_bytes == 0 for w in client.workers()), 10,
               what="reservations released")


def test_over_budget_job_is_refused(cluster, client, tmp_path):
    with pytest.raises(Infeasible) as e:
        client.submit(spec(name="huge", memory={"per_task_budget": "64GiB"}))
    assert "64 GiB" in e.value.message and "1 GiB" in e.value.message
    # The same through the CLI: the reason and exit code 2.
    import json
    path = tmp_path / "huge.yaml"
    path.write_text(json.dumps(spec(name="huge")))
    r = subprocess.run([sys.executable, "-m", "strata.cli", "submit", str(path), "--coordinator",
                        cluster.address, "--set", "memory.per_task_budget=64GiB"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "fits no worker" in r.stderr and "64 GiB" in r.stderr


def test_invalid_spec_names_the_field(cluster, client):
    bad = spec(data={"source": "digits", "batch_size": 255})
    from strata.protos import strata_pb2 as pb
    from strata import convert
    import grpc
    # Bypass the client's local validation: the coordinator itself must refuse.
    stub = client._stub
    with pytest.raises(grpc.RpcError) as e:
        stub.SubmitJob(pb.SubmitJobRequest(spec=convert.raw_spec_to_proto(bad)), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("data.batch_size")
    # the field travels as data, not only in the message
    assert ("strata-field", "data.batch_size") in tuple(e.value.trailing_metadata())
    with pytest.raises(JobRejected) as rejected:
        client.submit(bad)
    assert rejected.value.field == "data.batch_size"


def test_task_over_its_slice_fails_as_oom_and_agent_survives(cluster, client, tmp_path):
    import json
    path = tmp_path / "tight.yaml"
    path.write_text(json.dumps(spec(name="tight", memory={"per_task_budget": "12MiB"},
                                    training={"steps": 20})))
    r = subprocess.run([sys.executable, "-m", "strata.cli", "submit", str(path), "--follow",
                        "--coordinator", cluster.address], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stdout + r.stderr  # --follow exits 1 on FAILED
    job_id = r.stdout.splitlines()[0].strip()
    assert "FAILED" in r.stdout and "OOM" in r.stdout
    final = client.get(job_id)
    job = final
    assert final.state == JobState.FAILED
    oom = [t for t in final.tasks if t.failure == FailureKind.OOM]
    assert oom, [(t.failure, t.message) for t in final.tasks]
    assert "out of memory" in final.message
    wait_until(lambda: not task_processes(job.id), 30, what="task processes gone")
    # The agents are unharmed: both still registered and able to run the next job.
    assert all(p.poll() is None for p in cluster.agents.values())
    ok = client.wait(client.submit(spec(name="after-oom", training={"steps": 5})).id, timeout=180)
    assert ok.state == JobState.SUCCEEDED, ok.message


def test_a_task_that_crashes_after_its_allocator_refused_is_out_of_memory(client):
    # 64 MiB of synthetic examples copied into a tensor under a 2 MiB budget: the allocator
    # refuses the copy and TensorFlow, with no error path there, crashes (SIGSEGV on TF 2.21);
    # the agent reads the refusal in the task's log and reports an OOM with the allocation
    job = client.submit(spec(
        name="refused", workers=1, memory={"per_task_budget": "2MiB"}, training={"steps": 5},
        model={"builtin": {"kind": "mlp", "input_shape": [256], "hidden": [32], "classes": 10}},
        data={"source": "synthetic", "examples": 65536, "batch_size": 64}))
    final = client.wait(job.id, timeout=180)
    assert final.state == JobState.FAILED
    assert final.tasks[0].failure == FailureKind.OOM, (final.tasks[0].failure, final.message)
    assert "ran out of memory: budget 2 MiB" in final.message, final.message
    assert "the allocation that failed: 64 MiB" in final.message or \
        "OOM when allocating" in final.message, final.message


def test_keras_json_model_with_batchnorm_keeps_replicas_identical(cluster, client):
    import json
    import pathlib
    fixtures = json.loads((pathlib.Path(__file__).parent / "fixtures" / "keras_models.json").read_text())
    model = fixtures["good"]["func_mlp"]  # Dense, BatchNormalization, LayerNormalization; 64 -> 10
    job = client.submit(spec(name="keras-json", model={"keras_json": model["json"]},
                             training={"epochs": 10, "optimizer": {"name": "adam", "learning_rate": 0.01}}))
    final = client.wait(job.id, timeout=300)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.85
    hashes = {t.weights_sha256 for t in final.tasks}
    assert len(hashes) == 1 and "" not in hashes
