"""What an agent keeps on its own disk is bounded: a task's local log rotates, fetched files no
task uses go, a deleted job's folders go (unless a task of it still runs here), its disk is
reported, and its copy of a job's outputs goes once the coordinator has them. The agent is
real (no coordinator is needed for these: its channel is never dialled)."""

from __future__ import annotations

import io
import os
import time

import pytest

from strata.protos import strata_pb2 as pb
from strata.types import TaskState
from strata.worker import agent as agent_mod
from strata.worker import taskprocess
from strata.worker.agent import Agent, AgentConfig
from strata.worker.disk import DiskMeter
from strata.worker.taskprocess import TaskProcess


@pytest.fixture
def agent(tmp_path):
    a = Agent(AgentConfig(coordinator="127.0.0.1:1", name="a", budget_bytes=1 << 30,
                          work_dir=str(tmp_path / "work"), shared_dir=str(tmp_path / "shared")))
    yield a
    a.shutdown()


def start(job_id: str, sha: str = "") -> pb.StartTask:
    cmd = pb.StartTask(job_id=job_id, role="worker", index=0, attempt=1)
    if sha:
        cmd.config.spec.model.keras_file.sha256 = sha
    return cmd


def test_a_deleted_jobs_folders_go_unless_a_task_of_it_runs_here(agent, tmp_path):
    for root in ("work", "shared"):
        for job in ("gone", "live"):
            os.makedirs(tmp_path / root / "jobs" / job / "checkpoints")
    running = TaskProcess(agent, start("live"))
    agent.tasks[running.key] = running
    agent.purge("gone")
    agent.purge("live")
    agent.purge("../work")  # never a path: nothing outside jobs/
    for root in ("work", "shared"):
        assert not (tmp_path / root / "jobs" / "gone").exists()
        assert (tmp_path / root / "jobs" / "live").exists()
    assert (tmp_path / "work").exists()


def test_fetched_files_no_running_task_needs_are_collected(agent):
    os.makedirs(agent.blob_dir)
    needed, idle, fresh = "a" * 64, "b" * 64, "c" * 64
    for sha in (needed, idle, fresh):
        with open(os.path.join(agent.blob_dir, sha + ".keras"), "wb") as f:
            f.write(b"x")
    old = time.time() - 2 * agent_mod.BLOB_KEEP_S
    for sha in (needed, idle):
        os.utime(os.path.join(agent.blob_dir, sha + ".keras"), (old, old))
    task = TaskProcess(agent, start("j", needed))
    agent.tasks[task.key] = task
    assert agent.collect_blobs() == 1
    assert sorted(os.listdir(agent.blob_dir)) == [needed + ".keras", fresh + ".keras"]
    task.status.state = TaskState.SUCCEEDED  # no task needs it now: it goes once old
    assert agent.collect_blobs() == 1
    # idle files beyond the bound go, least recently used first
    for i, sha in enumerate(("d" * 64, "e" * 64)):
        path = os.path.join(agent.blob_dir, sha + ".keras")
        with open(path, "wb") as f:
            f.write(b"y" * 100)
        os.utime(path, (time.time() - 100 + i, time.time() - 100 + i))
    assert agent.collect_blobs(max_idle_bytes=150) == 1  # 201 idle bytes: d goes
    assert sorted(os.listdir(agent.blob_dir)) == [fresh + ".keras", "e" * 64 + ".keras"]


def test_a_deleted_jobs_fetched_files_go_with_it_unless_another_job_names_them(agent):
    os.makedirs(agent.blob_dir)
    only_a, shared = "a" * 64, "b" * 64
    for sha in (only_a, shared):
        with open(os.path.join(agent.blob_dir, sha + ".keras"), "wb") as f:
            f.write(b"x")
    agent._blobs_of = {"job-a": {only_a, shared}, "job-b": {shared}}
    agent.purge("job-a")
    assert os.listdir(agent.blob_dir) == [shared + ".keras"]
    agent.purge("job-b")
    assert os.listdir(agent.blob_dir) == []


def test_the_disk_meter_counts_the_agents_files_and_reads_what_is_free(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x" * 1000)
    meter = DiskMeter(str(tmp_path))
    assert meter.status().used_bytes == 0  # not counted yet
    assert meter.walk() == 1000
    d = meter.status()
    assert d.used_bytes == 1000 and 0 < d.free_bytes <= d.total_bytes


def test_a_tasks_local_log_rotates_and_the_held_back_logs_are_bounded(agent, monkeypatch):
    monkeypatch.setattr(taskprocess, "MAX_LOCAL_LOG_BYTES", 2000)
    monkeypatch.setattr(taskprocess, "MAX_LOG_BUFFER_BYTES", 1500)
    task = TaskProcess(agent, start("j"))
    os.makedirs(task.dir)
    lines = b"".join(b"line %04d of the task's output\n" % i for i in range(200))  # 6,400 B
    task._read_logs(io.BytesIO(lines))
    log = os.path.join(task.dir, "task.log")
    assert os.path.getsize(log) <= 1000 and os.path.getsize(log + ".1") <= 1000
    assert open(log, "rb").read().endswith(b"line 0199 of the task's output\n")
    held = task.take_logs()
    assert held.startswith(b"[strata] the agent dropped") and len(held) < 1600
    assert held.endswith(b"line 0199 of the task's output\n")
    task.return_logs(b"again")
    task.drop_logs()
    assert task.take_logs() == b""


def test_outputs_leave_the_agent_once_the_coordinator_has_them(agent, tmp_path, monkeypatch):
    out = tmp_path / "shared" / "jobs" / "j" / "output"
    (out / "tensorboard").mkdir(parents=True)
    (out / "model.keras").write_bytes(b"model")
    (out / "tensorboard" / "events").write_bytes(b"scalars")
    sent = []

    class Stub:
        def __init__(self, refuse=False):
            self.refuse = refuse

        def UploadOutput(self, chunks, timeout):  # noqa: N802 - the gRPC method's name
            msgs = list(chunks)
            first = msgs[0]
            assert (first.job_id, first.role, first.index, first.attempt) == ("j", "worker",
                                                                              0, 1)
            sent.append(first.chunk.path)
            if self.refuse:
                import grpc

                class Refused(grpc.RpcError):
                    def code(self):
                        return grpc.StatusCode.RESOURCE_EXHAUSTED

                    def details(self):
                        return "over the quota"
                raise Refused()
    task = TaskProcess(agent, start("j"))
    agent.stub = Stub(refuse=True)
    agent.upload_outputs(task, str(out))
    assert out.exists()  # refused: kept here until the job is deleted
    agent.stub = Stub()
    agent.upload_outputs(task, str(out))
    assert sorted(sent[-2:]) == ["model.keras", "tensorboard/events"]
    assert not out.exists()
