"""parameter_server, pipeline and hybrid jobs end to end: one coordinator, four agents and real
TensorFlow task processes on loopback, shared by the tests of this module (one job at a time:
every job here needs all four agents)."""

from __future__ import annotations

import os
import signal

import pytest

from strata.client import Infeasible
from strata.local import LocalCluster
from strata.types import JobState, TaskState

from tests.conftest import spec, task_processes, wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.integration  # starts coordinator, agent or TensorFlow processes

MiB = 1 << 20
AGENTS = 4
# Sized so that the deep model's data-parallel estimate is more than 2.5x one agent's budget
# while its four pipeline stages each fit one agent.
AGENT_BUDGET_MIB = 96
JOB_TIMEOUT_S = 420

# 64 -> 1024 x 13 -> 10: 12.7 M parameters; a 4-stage split puts three 1024x1024 layers on
# each stage (plus the small first and last layers on the end stages)
DEEP = dict(
    name="deep-mlp",
    model={"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024] * 13, "classes": 10}},
    training={"epochs": 10, "optimizer": {"name": "adam", "learning_rate": 0.0005}},
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(workers=AGENTS, memory_budget=f"{AGENT_BUDGET_MIB}MiB",
                     state_dir=str(tmp_path_factory.mktemp("strategies")), threads=1,
                     heartbeat_timeout_s=10)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    with cluster.client() as c:
        yield c


def run_job(client, job_spec, timeout=JOB_TIMEOUT_S):
    """Submits, follows the job to its end and returns (final job, first reported loss)."""
    job = client.submit(job_spec)
    first_loss = None
    for ev in client.watch(job.id, timeout=timeout):
        j = ev.job
        if j is not None and first_loss is None and j.metrics.step >= 1 and j.metrics.loss is not None:
            first_loss = j.metrics.loss
    client.wait(job.id, timeout=30)
    return settled(client, job.id), first_loss


def settled(client, job_id):
    """The job once its agents have confirmed every task's end (servers are stopped after the
    chief finishes, so they end a moment after the job)."""
    return wait_until(lambda: (lambda j: j if all(t.state.final for t in j.tasks) else None)(
        client.get(job_id)), 30, what="every task ended")


def deep(**over):
    d = spec(**{k: v for k, v in DEEP.items() if k not in ("model", "training")})
    d["model"], d["training"] = DEEP["model"], DEEP["training"]
    d.update(over)
    return d


def by_role(job):
    return {(t.role, t.index): t for t in job.tasks}


# --------------------------------------------------------------------------------------------
# parameter_server


def ps_spec(**over):
    d = spec(name="digits-ps", strategy="parameter_server", workers=2, parameter_servers=1,
             training={"epochs": 20, "optimizer": {"name": "adam", "learning_rate": 0.001}})
    d.update(over)
    return d


def test_parameter_server_job_trains_digits(client):
    final, first_loss = run_job(client, ps_spec())
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.90, final.metrics
    tasks = by_role(final)
    assert sorted(tasks) == [("chief", 0), ("ps", 0), ("worker", 0), ("worker", 1)]
    assert len({t.worker for t in final.tasks}) == 4  # one task per agent
    for t in final.tasks:
        assert t.state == TaskState.SUCCEEDED, (t.role, t.index, t.message)
        assert 0 < t.peak_memory_bytes <= t.memory_budget_bytes, (t.role, t.index)
    # every layer with variables is hosted by the one PS task
    assert tasks[("ps", 0)].layers == ["hidden_0", "hidden_1", "hidden_2", "logits"]
    assert first_loss is not None and final.metrics.loss < first_loss


def test_parameter_server_job_survives_a_killed_worker(client):
    job = client.submit(ps_spec(name="ps-kill", training={"epochs": 30}))
    wait_until(lambda: client.get(job.id).metrics.step >= 20, 240, what="20 steps")
    [pid] = wait_until(lambda: task_processes(os.path.join(job.id, "worker-1")), 10,
                       what="the worker:1 task process")
    os.kill(pid, signal.SIGKILL)
    client.wait(job.id, timeout=JOB_TIMEOUT_S)
    final = settled(client, job.id)
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.90
    assert final.metrics.step == final.metrics.total_steps
    tasks = by_role(final)
    assert tasks[("worker", 1)].state == TaskState.FAILED
    assert tasks[("worker", 0)].state == TaskState.SUCCEEDED
    messages = [e.message for e in client.watch(job.id, timeout=10)]
    assert any("continues on 1 remaining worker" in m for m in messages), messages


# --------------------------------------------------------------------------------------------
# pipeline: the headline


@pytest.fixture(scope="module")
def pipeline_job(cluster):
    with cluster.client() as c:
        return run_job(c, deep(strategy="pipeline", workers=1, stages=4, microbatches=4))


def test_deep_model_is_refused_as_mirrored_with_a_pipeline_suggestion(client):
    mirrored = deep(strategy="multi_worker_mirrored", workers=1)
    plan = client.plan(mirrored)
    assert not plan.feasible
    estimate = plan.tasks[0].estimated_memory_bytes
    assert estimate >= 2.5 * AGENT_BUDGET_MIB * MiB, estimate / MiB
    with pytest.raises(Infeasible) as e:
        client.submit(mirrored)
    assert "strategy: pipeline, stages: 4" in e.value.message, e.value.message


def test_deep_model_trains_as_a_four_stage_pipeline(pipeline_job):
    final, first_loss = pipeline_job
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.90, final.metrics
    assert first_loss is not None and final.metrics.loss < first_loss
    stages = sorted(final.tasks, key=lambda t: t.stage)
    assert [t.stage for t in stages] == [0, 1, 2, 3]
    assert (stages[0].role, stages[0].index) == ("chief", 0)
    assert len({t.worker for t in stages}) == 4
    names = [n for t in stages for n in t.layers]
    assert names == [f"hidden_{i}" for i in range(13)] + ["logits"]
    for t in stages:
        assert t.state == TaskState.SUCCEEDED, (t.stage, t.message)
        peak, est = t.peak_memory_bytes, t.estimated_memory_bytes
        assert 0 < peak <= t.memory_budget_bytes, (t.stage, peak / MiB, t.memory_budget_bytes / MiB)
        assert abs(peak - est) <= 0.20 * est, (t.stage, peak / MiB, est / MiB)


def test_recompute_lowers_the_measured_peak(client):
    """A model whose stages' memory is mostly activations (64-[512]x13-10 at a global batch of
    4096 in 4 micro-batches), so that what recomputation saves stands well clear of the
    allocator's run-to-run noise (at batch 256 the deep model above saves ~2 MiB a stage)."""
    def job(name, recompute):
        d = spec(name=name, strategy="pipeline", workers=1, stages=4, microbatches=4,
                 memory={"recompute": recompute}, training={"steps": 4},
                 data={"source": "synthetic", "batch_size": 4096, "examples": 8192})
        d["model"] = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [512] * 13,
                                  "classes": 10}}
        final, _ = run_job(client, d)
        assert final.state == JobState.SUCCEEDED, final.message
        for t in final.tasks:
            assert 0 < t.peak_memory_bytes <= t.memory_budget_bytes, (t.stage, name)
            assert abs(t.peak_memory_bytes - t.estimated_memory_bytes) \
                <= 0.20 * t.estimated_memory_bytes, (name, t.stage, t.peak_memory_bytes / MiB,
                                                     t.estimated_memory_bytes / MiB)
        return {t.stage: t.peak_memory_bytes for t in final.tasks}

    before, after = job("act-plain", False), job("act-recompute", True)
    assert sum(after.values()) < 0.9 * sum(before.values()), (before, after)
    # the middle stages hold nothing but layers: each saves activations
    for s in (1, 2):
        assert after[s] < before[s], (s, before[s] / MiB, after[s] / MiB)


# --------------------------------------------------------------------------------------------
# hybrid


@pytest.mark.parametrize("gradients", [{}, {"compression": "bfloat16"}])
def test_hybrid_replicas_stay_identical(client, gradients):
    # with compression the stages' gradients travel between the replicas as 16 bits
    final, _ = run_job(client, spec(name="digits-hybrid", strategy="hybrid", workers=2, stages=2,
                                    microbatches=2, gradients=gradients))
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.90, final.metrics
    tasks = sorted(final.tasks, key=lambda t: (t.replica, t.stage))
    assert [(t.replica, t.stage) for t in tasks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    chief = by_role(final)[("chief", 0)]
    digests = chief.replica_weights_sha256
    assert len(digests) == 2 and digests[0] == digests[1], digests
    assert chief.weights_sha256 == digests[0]
    for t in tasks:
        assert 0 < t.peak_memory_bytes <= t.memory_budget_bytes


def test_hybrid_model_comes_back_whole_and_matches_its_digest(client, tmp_path):
    # the builtin MLP's stages, assembled into one .keras file by the chief
    import hashlib

    import keras
    import numpy as np

    final, _ = run_job(client, spec(name="digits-hybrid-out", strategy="hybrid", workers=2,
                                    stages=2, microbatches=2, training={"steps": 5}))
    assert final.state == JobState.SUCCEEDED, final.message
    client.download(final.id, str(tmp_path))
    model = keras.saving.load_model(str(tmp_path / "model.keras"), safe_mode=True)
    h = hashlib.sha256()
    for w in model.weights:
        h.update(np.ascontiguousarray(np.asarray(w.numpy(), dtype=np.float32)).tobytes())
    assert h.hexdigest() == by_role(final)[("chief", 0)].weights_sha256


def test_pipeline_applies_weight_regularizers_and_refuses_activity_ones(client, tmp_path):
    # the same 2-stage pipeline with and without a strong L2 on every kernel: the regularized
    # model's kernels come back much smaller (Keras's fit adds the penalty to the loss;
    # measured: a twelfth of the plain model's squared norm)
    import json

    import keras
    import numpy as np

    def model(**reg):
        return keras.Sequential([keras.Input((64,)),
                                 keras.layers.Dense(64, activation="relu", name="h1", **reg),
                                 keras.layers.Dense(32, activation="relu", name="h2", **reg),
                                 keras.layers.Dense(10, name="out", **reg)]).to_json()

    norms = {}
    for name, reg in (("plain", {}), ("l2", {"kernel_regularizer": keras.regularizers.L2(0.05)})):
        final, _ = run_job(client, spec(
            name=f"pipe-{name}", strategy="pipeline", workers=1, stages=2, microbatches=2,
            model={"keras_json": model(**reg)}, memory={"profile": "false"},
            training={"epochs": 3, "optimizer": {"name": "adam", "learning_rate": 0.01}}))
        assert final.state == JobState.SUCCEEDED, final.message
        client.download(final.id, str(tmp_path / name))
        m = keras.saving.load_model(str(tmp_path / name / "model.keras"), safe_mode=True)
        norms[name] = sum(float(np.sum(np.square(l.kernel.numpy()))) for l in m.layers)
        if name == "plain":
            assert final.metrics.test_accuracy >= 0.8, final.metrics
    assert norms["l2"] < 0.5 * norms["plain"], norms
    # an activity regularizer's loss would be made inside a stage and dropped: refused
    activity = json.loads(model(activity_regularizer={"class_name": "L2",
                                                      "config": {"l2": 0.01}}))
    final, _ = run_job(client, spec(
        name="pipe-activity", strategy="pipeline", workers=1, stages=2, microbatches=2,
        model={"keras_json": json.dumps(activity)}, memory={"profile": "false"},
        training={"steps": 5}))
    assert final.state == JobState.FAILED
    assert "activity_regularizer" in final.message and "model" in final.message, final.message


def test_agents_are_idle_after_the_jobs(cluster, client):
    wait_until(lambda: all(w.memory.reserved_bytes == 0 for w in client.workers()), 30,
               what="every reservation released")
    # no task process of this cluster left behind (their configs live under its state dir)
    assert not task_processes(cluster.state_dir)


def test_parameter_server_runs_users_code(client):
    # the example project's own model and input pipeline, variables round-robin on the PS
    # tasks; a code model is measured by a probe first
    project = os.path.join(ROOT, "examples", "own-code", "my_project")
    final, _ = run_job(client, {
        "name": "ps-code", "strategy": "parameter_server", "workers": 2, "parameter_servers": 1,
        "code": {"dir": project, "model": "train:build_model", "dataset": "train:make_dataset"},
        "data": {"batch_size": 64},
        "training": {"steps": 200, "optimizer": {"name": "adam", "learning_rate": 0.003}}})
    assert final.state == JobState.SUCCEEDED, final.message
    assert final.metrics.test_accuracy >= 0.9, final.metrics
    for t in final.tasks:
        assert 0 < t.peak_memory_bytes <= t.memory_budget_bytes, t
