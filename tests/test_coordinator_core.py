"""The coordinator's control logic driven tick by tick with a manual clock (no processes)."""

import json
import os

import pytest

from strata.coordinator.core import Coordinator, StartTaskCommand, StopTaskCommand
from strata.spec import load_spec_file
from strata.errors import InfeasibleError, InvalidTransition, NotFoundError, UnknownAgentSession
from strata.types import OutOfMemory
from strata.types import FailureKind, JobState, MemoryStatus, TaskReport, TaskState

from conftest import queued as drain

GiB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = {"name": "t", "workers": 2,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [64], "classes": 10}},
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 10}}


def register(coord, name, budget=GiB):
    return coord.register(name, "127.0.0.1", "CPU", budget, [5000 + len(coord.workers) * 10 + i for i in range(4)], [])


def test_pending_until_workers_join_then_scheduled(env):
    coord, clock, _, _ = env
    job = coord.submit(SPEC)
    coord.tick()
    assert job.state == JobState.PENDING and "waiting for 2 workers" in job.message
    s0 = register(coord, "a")
    coord.tick()
    assert job.state == JobState.PENDING
    s1 = register(coord, "b")
    coord.tick()
    assert job.state == JobState.SCHEDULED
    starts = drain(coord, "a") + drain(coord, "b")
    assert all(isinstance(c, StartTaskCommand) for c in starts) and len(starts) == 2
    cfg = json.loads(starts[0].tf_config)
    assert len(cfg["cluster"]["worker"]) == 2
    assert {t.worker for t in job.tasks} == {"a", "b"}
    # Reservations are derived from the tasks.
    ws = {w.name: w for w in coord.list_workers()}
    assert ws["a"].memory.reserved_bytes == job.tasks[0].memory_budget_bytes
    assert ws["a"].state.value == "BUSY"
    for name, session, t in (("a", s0, job.tasks[0]), ("b", s1, job.tasks[1])):
        coord.report(name, session, TaskReport(t.job_id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt))
    assert job.state == JobState.RUNNING
    for name, session, t in (("a", s0, job.tasks[0]), ("b", s1, job.tasks[1])):
        coord.report(name, session, TaskReport(t.job_id, t.role, t.index, TaskState.SUCCEEDED,
                                               attempt=t.attempt, test_accuracy=0.95, peak_bytes=123))
    assert job.state == JobState.SUCCEEDED and job.metrics.test_accuracy == 0.95
    assert all(w.memory.reserved_bytes == 0 for w in coord.list_workers())
    assert job.tasks[0].peak_memory_bytes == 123


def test_submit_refuses_job_larger_than_every_worker(env):
    coord, *_ = env
    register(coord, "small", budget=64 << 20)
    with pytest.raises(InfeasibleError) as e:
        coord.submit({**SPEC, "memory": {"per_task_budget": "1GiB"}})
    assert "largest worker budget is 64 MiB" in str(e.value)


def test_task_failure_fails_job_and_stops_the_rest(env):
    coord, clock, _, _ = env
    sa, sb = register(coord, "a"), register(coord, "b")
    job = coord.submit(SPEC)
    coord.tick()
    drain(coord, "a"), drain(coord, "b")
    t0, t1 = job.tasks
    coord.report(t1.worker, sa if t1.worker == "a" else sb,
                 TaskReport(job.id, "worker", 1, TaskState.RUNNING, attempt=t1.attempt))
    coord.report(t0.worker, sa if t0.worker == "a" else sb,
                 TaskReport(job.id, "worker", 0, TaskState.FAILED, attempt=t0.attempt,
                            failure=FailureKind.EXIT_CODE, exit_code=1, message="bad luck"))
    assert job.state == JobState.FAILED and "exited with code 1" in job.message
    other = t1.worker
    cmds = drain(coord, other)
    assert any(isinstance(c, StopTaskCommand) and c.job_id == job.id for c in cmds)
    # The other task stays reserved until its agent confirms the process is gone.
    assert {w.name: w.memory.reserved_bytes for w in coord.list_workers()}[other] > 0
    coord.report(other, sa if other == "a" else sb,
                 TaskReport(job.id, "worker", 1, TaskState.CANCELLED, attempt=t1.attempt))
    assert all(w.memory.reserved_bytes == 0 for w in coord.list_workers())


def test_lost_worker_fails_its_job(env):
    coord, clock, _, _ = env
    sa, sb = register(coord, "a"), register(coord, "b")
    job = coord.submit(SPEC)
    coord.tick()
    clock.now += 5
    coord.heartbeat("a", sa, MemoryStatus(), [], [1, 2])
    clock.now += 6
    coord.tick()
    ws = {w.name: w.state.value for w in coord.list_workers()}
    assert ws == {"a": "READY", "b": "LOST"}  # a's task never started: released at once
    assert job.state == JobState.FAILED and "lost" in job.message
    with pytest.raises(UnknownAgentSession):
        coord.heartbeat("b", sb, MemoryStatus(), [], [])


def test_cancel(env):
    coord, *_ = env
    job = coord.submit(SPEC)
    coord.cancel(job.id)
    assert job.state == JobState.CANCELLED
    assert all(t.state == TaskState.CANCELLED for t in job.tasks)
    with pytest.raises(InvalidTransition):
        coord.cancel(job.id)
    with pytest.raises(NotFoundError):
        coord.cancel("nope")


def test_restart_keeps_jobs_and_reconciles(env):
    coord, clock, store, tmp = env
    sa, sb = register(coord, "a"), register(coord, "b")
    job = coord.submit(SPEC)
    coord.tick()
    for t in job.tasks:
        coord.report(t.worker, sa if t.worker == "a" else sb,
                     TaskReport(job.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt))
    done = coord.submit({**SPEC, "name": "u"})
    coord.cancel(done.id)
    # A new coordinator over the same store.
    coord2 = Coordinator(store, str(tmp), heartbeat_timeout_s=10, clock=clock,
                          monotonic=clock)
    assert {j.id for j in coord2.list_jobs()} == {job.id, done.id}
    j2 = coord2.get(job.id)
    assert j2.state == JobState.RUNNING
    # Agent a comes back still running its task; agent b never does.
    ta = next(t for t in j2.tasks if t.worker == "a")
    coord2.register("a", "127.0.0.1", "CPU", GiB, [1, 2, 3, 4],
                    [TaskReport(job.id, ta.role, ta.index, TaskState.RUNNING, attempt=ta.attempt)])
    clock.now += 11
    coord2.tick()
    assert j2.state == JobState.FAILED and "lost" in j2.message


def test_stop_lost_on_reconnect_is_sent_again(env):
    coord, clock, _, _ = env
    sa, sb = register(coord, "a"), register(coord, "b")
    job = coord.submit(SPEC)
    coord.tick()
    for t in job.tasks:
        coord.report(t.worker, sa if t.worker == "a" else sb,
                     TaskReport(job.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt))
    coord.workers["a"].queue = None  # the agent is between sessions: the stop is dropped
    coord.cancel(job.id)
    ta = next(t for t in job.tasks if t.worker == "a")
    running = [TaskReport(job.id, ta.role, ta.index, TaskState.RUNNING, attempt=ta.attempt)]
    sa = coord.register("a", "127.0.0.1", "CPU", GiB, [1, 2, 3, 4], running)
    assert any(isinstance(c, StopTaskCommand) for c in drain(coord, "a"))
    # And while it keeps reporting the task running, heartbeats repeat the stop (throttled).
    coord.heartbeat("a", sa, MemoryStatus(), running, [1])
    clock.now += 6
    coord.heartbeat("a", sa, MemoryStatus(), running, [1])
    assert sum(isinstance(c, StopTaskCommand) for c in drain(coord, "a")) == 1
    assert {w.name: w.memory.reserved_bytes for w in coord.list_workers()}["a"] > 0
    coord.heartbeat("a", sa, MemoryStatus(), [TaskReport(job.id, ta.role, ta.index, TaskState.CANCELLED,
                                                         attempt=ta.attempt)], [1])
    assert {w.name: w.memory.reserved_bytes for w in coord.list_workers()}["a"] == 0


def test_duplicate_agent_name_is_refused_while_the_first_lives(env):
    from strata.errors import DuplicateAgent
    coord, clock, _, _ = env
    coord.register("a", "10.0.0.1", "CPU", GiB, [1], [], pid=100)
    with pytest.raises(DuplicateAgent):
        coord.register("a", "10.0.0.2", "CPU", GiB, [1], [], pid=200)
    coord.register("a", "10.0.0.1", "CPU", GiB, [1], [], pid=100)  # the same agent again is fine
    clock.now += 11
    coord.register("a", "10.0.0.2", "CPU", GiB, [1], [], pid=200)  # the first one went silent


def test_ports_of_live_tasks_are_not_offered_again(env):
    coord, *_ = env
    sa, _sb = register(coord, "a"), register(coord, "b")
    job = coord.submit(SPEC)
    coord.tick()
    ta = next(t for t in job.tasks if t.worker == "a")
    used = int(ta.address.rsplit(":", 1)[1])
    coord.heartbeat("a", sa, MemoryStatus(), [], [used, 7777])
    assert coord.workers["a"].free_ports == [7777]


def test_absurd_sizes_are_refused_without_a_phantom_job(env):
    from strata.errors import SpecError
    coord, *_ = env
    huge = {**SPEC, "data": {"source": "synthetic", "batch_size": 64},
            "model": {"builtin": {"kind": "mlp", "input_shape": [16777216, 16777216], "hidden": [8],
                                  "classes": 10}}}
    with pytest.raises(SpecError):
        coord.submit(huge)
    assert coord.list_jobs() == []


def test_job_whose_tasks_never_start_fails_and_frees_its_budget(env):
    coord, clock, _, _ = env
    coord.start_timeout_s = 60
    sa, sb = register(coord, "a"), register(coord, "b")
    job = coord.submit(SPEC)
    coord.tick()
    t0 = job.tasks[0]
    coord.report(t0.worker, sa if t0.worker == "a" else sb,
                 TaskReport(job.id, t0.role, t0.index, TaskState.RUNNING, attempt=t0.attempt))
    clock.now += 30
    coord.heartbeat("a", sa, MemoryStatus(), [], [1]), coord.heartbeat("b", sb, MemoryStatus(), [], [1])
    coord.tick()
    assert job.state == JobState.SCHEDULED
    clock.now += 31
    coord.heartbeat("a", sa, MemoryStatus(), [], [1]), coord.heartbeat("b", sb, MemoryStatus(), [], [1])
    coord.tick()
    assert job.state == JobState.FAILED and "did not start within 60 s" in job.message
    assert "worker:1" in job.message
    # The task that never reported started is released at once; the running one when its
    # agent confirms.
    reserved = {w.name: w.memory.reserved_bytes for w in coord.list_workers()}
    assert reserved[job.tasks[1].worker] == 0 and reserved[job.tasks[0].worker] > 0


# --- parameter_server, pipeline and hybrid jobs ----------------------------------------------

PIPE = {"name": "p", "strategy": "pipeline", "stages": 2, "microbatches": 4,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 256, 256],
                              "classes": 10}},
        "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 10}}


def start_all(coord, sessions, job):
    """Drains the start commands and reports every task running; returns {task key: cmd}."""
    cmds = {}
    for name in sessions:
        for c in drain(coord, name):
            if isinstance(c, StartTaskCommand):
                cmds[(c.role, c.index)] = c
    for t in job.tasks:
        coord.report(t.worker, sessions[t.worker], TaskReport(t.job_id, t.role, t.index,
                                                              TaskState.RUNNING, attempt=t.attempt))
    return cmds


def test_pipeline_job_gets_its_stage_layout_and_ends_with_its_chief(env):
    coord, *_ = env
    sessions = {n: register(coord, n) for n in ("a", "b", "c")}
    job = coord.submit(PIPE)
    assert sorted((t.role, t.index, t.stage) for t in job.tasks) == [("chief", 0, 0), ("worker", 0, 1)]
    coord.tick()
    assert job.state == JobState.SCHEDULED
    cmds = start_all(coord, sessions, job)
    assert job.state == JobState.RUNNING
    chief = cmds[("chief", 0)]
    tf_config = json.loads(chief.tf_config)
    assert tf_config["task"] == {"type": "chief", "index": 0}
    assert len(tf_config["cluster"]["chief"]) == 1 and len(tf_config["cluster"]["worker"]) == 1
    assert chief.config.role == "chief" and chief.config.spec.name == "p"
    layout = chief.config.section.layout
    assert [(s.stage, s.task_name) for s in layout] == [(0, "chief:0"), (1, "worker:0")]
    assert layout[0].first_layer == 0 and layout[0].last_layer == layout[1].first_layer
    assert layout[1].last_layer == 4  # hidden_0..2 and logits
    assert chief.config.section.microbatch == 16
    assert sum(len(s.layers) for s in layout) == 4
    # the contract survives the wire as it is
    from strata import convert
    assert convert.task_config_from_proto(convert.task_config_to_proto(chief.config)) == chief.config
    # each stage's budget comes from its own estimate
    for t in job.tasks:
        assert t.memory_budget_bytes > t.estimated_memory_bytes > 0
    # the chief's result ends the job; the stage server, stopped, counts as succeeded
    c, w = (next(t for t in job.tasks if t.role == r) for r in ("chief", "worker"))
    coord.report(c.worker, sessions[c.worker], TaskReport(job.id, "chief", 0, TaskState.SUCCEEDED,
                                                          attempt=c.attempt, test_accuracy=0.93,
                                                          replica_weights_sha256=["x"]))
    assert job.state == JobState.SUCCEEDED and job.metrics.test_accuracy == 0.93
    assert any(isinstance(x, StopTaskCommand) for x in drain(coord, w.worker))
    coord.report(w.worker, sessions[w.worker], TaskReport(job.id, "worker", 0, TaskState.CANCELLED,
                                                          attempt=w.attempt))
    assert w.state == TaskState.SUCCEEDED and w.message == "stopped after the job succeeded"
    assert c.replica_weights_sha256 == ["x"]
    assert all(x.memory.reserved_bytes == 0 for x in coord.list_workers())


def test_pipeline_stage_failure_fails_the_job(env):
    coord, *_ = env
    sessions = {n: register(coord, n) for n in ("a", "b")}
    job = coord.submit(PIPE)
    coord.tick()
    start_all(coord, sessions, job)
    w = next(t for t in job.tasks if t.role == "worker")
    coord.report(w.worker, sessions[w.worker], TaskReport(job.id, "worker", 0, TaskState.FAILED,
                                                          attempt=w.attempt,
                                                          failure=FailureKind.EXIT_CODE,
                                                          exit_code=1, message="died"))
    assert job.state == JobState.FAILED and "worker:0" in job.message


def test_pipeline_needs_connected_workers_and_names_why(env):
    coord, *_ = env
    with pytest.raises(InfeasibleError) as e:
        coord.submit(PIPE)
    assert "no workers are connected" in str(e.value)
    register(coord, "a", budget=8 << 20)
    register(coord, "b", budget=8 << 20)
    with pytest.raises(InfeasibleError) as e:
        coord.submit(PIPE)
    assert "cannot run on this cluster" in str(e.value)


def test_hybrid_tasks_follow_replica_and_stage(env):
    coord, *_ = env
    for n in "abcd":
        register(coord, n)
    job = coord.submit({**PIPE, "name": "h", "strategy": "hybrid", "workers": 2, "microbatches": 2})
    got = sorted((t.replica, t.stage, t.role, t.index) for t in job.tasks)
    assert got == [(0, 0, "chief", 0), (0, 1, "worker", 0), (1, 0, "worker", 1), (1, 1, "worker", 2)]


def test_mirrored_refusal_suggests_a_pipeline_depth(env):
    coord, *_ = env
    for n in "abcd":
        register(coord, n, budget=96 << 20)
    big = {**SPEC, "workers": 1, "model": {"builtin": {"kind": "mlp", "input_shape": [64],
                                                        "hidden": [1024] * 9, "classes": 10}}}
    with pytest.raises(InfeasibleError) as e:
        coord.submit(big)
    assert "it fits as a pipeline: strategy: pipeline, stages: " in str(e.value), str(e.value)


with open(os.path.join(ROOT, "tests", "fixtures", "keras_models.json")) as _f:
    FIXTURES = json.load(_f)

EXAMPLES = sorted(os.path.relpath(os.path.join(d, f), os.path.join(ROOT, "examples"))
                  for d, _, files in os.walk(os.path.join(ROOT, "examples"))
                  for f in files if f.endswith((".yaml", ".yml", ".json")))


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_plans_on_four_agents(env, name, tmp_path):
    """The shipped example specs parse and fit the clusters their comments name."""
    import zipfile

    from strata.uploads import attach_files

    coord, *_ = env
    for n in "abcd":
        register(coord, n, budget=96 << 20)
    path = os.path.join(ROOT, "examples", name)
    raw = load_spec_file(path)
    if isinstance(raw.get("model"), dict) and "keras_file" in raw["model"]:
        # the example's script makes the file with Keras; its graph is the fixture's
        fake = tmp_path / "model.keras"
        with zipfile.ZipFile(fake, "w") as z:
            z.writestr("config.json", FIXTURES["good"]["residual_cnn"]["json"])
            z.writestr("model.weights.h5", b"")
        raw["model"]["keras_file"] = str(fake)
    packed = attach_files(raw, os.path.dirname(path))  # as the client does: files become digests
    for f in packed:
        if os.path.basename(f).startswith("strata-code-"):
            os.unlink(f)
    plan = coord.plan(raw)
    assert plan.feasible, plan.reason
    job = coord.submit(raw)
    assert job.state == JobState.PENDING


def test_remote_oom_is_blamed_on_the_stage_and_the_next_plan_uses_its_need(env):
    from strata.types import OutOfMemory

    coord, *_ = env
    sessions = {n: register(coord, n) for n in ("a", "b")}
    job = coord.submit(PIPE)
    coord.tick()
    start_all(coord, sessions, job)
    c, w = (next(t for t in job.tasks if t.role == r) for r in ("chief", "worker"))
    coord.report(w.worker, sessions[w.worker], TaskReport(job.id, "worker", 0, TaskState.RUNNING,
                                                          attempt=w.attempt, peak_bytes=9 << 20))
    oom = OutOfMemory(task="worker:0", allocation_bytes=4 << 20, shape=(1024, 1024),
                      dtype="float32", op="adam/Sub_3")
    coord.report(c.worker, sessions[c.worker], TaskReport(
        job.id, "chief", 0, TaskState.FAILED, attempt=c.attempt, failure=FailureKind.OOM,
        exit_code=75, message="out of memory", oom=oom))
    # (the budget was Strata's: the job restarts once with the need, ``_memory_retry``)
    assert job.state == JobState.RESTARTING
    # the job's message names the stage that ran out, its budget, peak and allocation
    assert "task worker:0 (stage 1, layers" in job.message
    assert f"budget {w.memory_budget_bytes >> 20} MiB" in job.message
    assert "peak reached 9 MiB" in job.message and "adam/Sub_3" in job.message
    assert "what would fit" in job.message and "reported by chief:0" in job.message
    assert w.failure == FailureKind.OOM and "ran out of memory" in w.message
    # the agent's later report that it stopped the server keeps the account
    coord.report(w.worker, sessions[w.worker], TaskReport(job.id, "worker", 0,
                                                          TaskState.CANCELLED, attempt=w.attempt))
    assert "ran out of memory" in w.message
    # the restart gives the stage that ran out more, not the chief that reported it
    old = w.memory_budget_bytes
    coord.report(c.worker, sessions[c.worker], TaskReport(job.id, "chief", 0,
                                                          TaskState.FAILED, attempt=c.attempt))
    coord.clock.now += 6  # restart.backoff_s
    coord.tick()
    coord.tick()
    assert job.state == JobState.SCHEDULED, job.message
    assert next(t for t in job.tasks if t.role == "worker").memory_budget_bytes > old
    # the same job again plans the stage above the budget that failed, and so does a
    # coordinator restarted on the same state
    again = coord.submit(PIPE)
    w2 = next(t for t in again.tasks if t.role == "worker")
    assert w2.estimated_memory_bytes >= w.memory_budget_bytes + (2 << 20)
    assert w2.memory_budget_bytes > w2.estimated_memory_bytes
    restarted = Coordinator(coord.store, coord.state_dir, clock=coord.clock,
                            monotonic=coord.monotonic)
    assert restarted.measured == coord.measured


def test_memory_profile_probes_first_then_plans_with_the_measured_peaks(env):
    coord, clock, *_ = env
    sessions = {n: register(coord, n) for n in ("a", "b")}
    spec = {**SPEC, "memory": {"profile": True}}
    job = coord.submit(spec)
    probe = next(j for j in coord.list_jobs() if j.id != job.id)
    assert probe.spec.training.steps == 3 and probe.spec.memory.profile == "false"
    assert "memory probe" in job.message
    estimate = job.tasks[0].estimated_memory_bytes
    coord.tick()
    # the probe runs first; the job waits for it even though nothing else holds the workers
    assert probe.state == JobState.SCHEDULED and job.state == JobState.PENDING
    start_all(coord, sessions, probe)
    peaks = {0: 9 << 20, 1: 7 << 20}
    for t in probe.tasks:
        coord.report(t.worker, sessions[t.worker], TaskReport(
            probe.id, t.role, t.index, TaskState.SUCCEEDED, attempt=t.attempt,
            peak_bytes=peaks[t.index], test_accuracy=0.5))
    assert probe.state == JobState.SUCCEEDED
    coord.tick()
    assert job.state == JobState.SCHEDULED
    # both replicas share a kind: the larger peak is the estimate, with the default headroom
    assert {t.estimated_memory_bytes for t in job.tasks} == {9 << 20}
    assert estimate != 9 << 20
    assert all(t.memory_budget_bytes >= (9 << 20) + (16 << 20) for t in job.tasks)
    events = [e.message for e in coord.store.events(job.id, 0)]
    assert any("estimates set to its measured peaks" in m for m in events)
    # a second submission of the same job is measured already: no probe
    n = len(coord.list_jobs())
    again = coord.submit(spec)
    assert len(coord.list_jobs()) == n + 1 and again.id not in coord._probe_of


def test_a_failed_probe_fails_its_job_and_cancelling_the_job_cancels_the_probe(env):
    coord, clock, *_ = env
    sessions = {n: register(coord, n) for n in ("a", "b")}
    spec = {**SPEC, "memory": {"profile": True}}
    job = coord.submit(spec)
    probe = next(j for j in coord.list_jobs() if j.id != job.id)
    coord.tick()
    start_all(coord, sessions, probe)
    t = probe.tasks[0]
    coord.report(t.worker, sessions[t.worker], TaskReport(
        probe.id, t.role, t.index, TaskState.FAILED, attempt=t.attempt,
        failure=FailureKind.EXIT_CODE, exit_code=1, message="no such file: data.npz"))
    assert probe.state == JobState.FAILED
    for other in probe.tasks[1:]:
        coord.report(other.worker, sessions[other.worker], TaskReport(
            probe.id, other.role, other.index, TaskState.CANCELLED, attempt=other.attempt))
    coord.tick()
    assert job.state == JobState.FAILED and "memory probe" in job.message
    assert "no such file" in job.message

    job2 = coord.submit({**spec, "name": "u"})
    probe2 = next(j for j in coord.list_jobs() if j.name == "u-probe")
    coord.cancel(job2.id)
    assert probe2.state == JobState.CANCELLED


def test_memory_profile_auto_probes_only_large_jobs_without_a_fixed_budget(env):
    from strata.coordinator.admission import PROBE_FROM_BYTES

    coord, *_ = env
    register(coord, "a"), register(coord, "b")
    small = coord.submit(SPEC)
    assert small.estimated_memory_bytes < PROBE_FROM_BYTES and len(coord.list_jobs()) == 1
    big_model = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [2048] * 4, "classes": 10}}
    assert "probe run" in coord.plan({**SPEC, "name": "big", "model": big_model}).reason
    assert "probe run" not in coord.plan(SPEC).reason
    big = coord.submit({**SPEC, "name": "big", "model": big_model})
    assert big.estimated_memory_bytes >= PROBE_FROM_BYTES and big.id in coord._probe_of
    fixed = coord.submit({**SPEC, "name": "fixed", "model": big_model,
                          "memory": {"per_task_budget": "512MiB"}})
    off = coord.submit({**SPEC, "name": "off", "model": big_model, "memory": {"profile": False}})
    assert fixed.id not in coord._probe_of and off.id not in coord._probe_of
    assert [j.name for j in coord.list_jobs()].count("big-probe") == 1
    assert len(coord.list_jobs()) == 5


def test_kept_room_matches_a_full_scan_through_random_cluster_events(env):
    """The reservations and room index the coordinator keeps as things change (placing by
    binary search) equal what a scan of every task and agent gives, after each of a few
    hundred random registrations, heartbeats offering more or fewer ports, submits and
    cancels, task ends, drains, losses and returns; and each placement is the one the plain
    `place` over a fresh scan makes."""
    import random

    from strata.coordinator.placement import TaskDemand, place

    coord, clock, _, _ = env
    rng = random.Random(7)
    names = [f"w{i}" for i in range(8)]
    sessions: dict[str, str] = {}
    jobs = []
    for step in range(400):
        op = rng.random()
        name = rng.choice(names)
        live = coord.workers.get(name)
        if op < 0.15 or name not in sessions:
            budget = rng.choice([GiB // 2, GiB, 2 * GiB])
            sessions[name] = coord.register(name, "127.0.0.1", "CPU", budget,
                                            [6000 + 10 * names.index(name) + i
                                             for i in range(rng.randint(0, 3))], [])
        elif op < 0.35 and live is not None and live.session:
            ports = [6000 + 10 * names.index(name) + i for i in range(rng.randint(0, 4))]
            coord.heartbeat(name, sessions[name], live.memory, [], ports)
        elif op < 0.55:
            spec = {**SPEC, "workers": rng.randint(1, 3),
                    "memory": {"per_task_budget": f"{rng.choice([128, 300, 700])}MiB"}}
            try:
                jobs.append(coord.submit(spec))
            except Exception:  # noqa: BLE001 - refused with no worker large enough: fine
                pass
        elif op < 0.7 and jobs:
            job = rng.choice(jobs)
            ended = [t for t in job.tasks if t.worker and not t.state.final
                     and coord.workers[t.worker].session]
            if ended:
                t = rng.choice(ended)
                coord.report(t.worker, coord.workers[t.worker].session, TaskReport(
                    job.id, t.role, t.index, rng.choice([TaskState.SUCCEEDED, TaskState.FAILED]),
                    attempt=t.attempt))
        elif op < 0.8 and jobs:
            job = rng.choice(jobs)
            if not job.state.final:
                coord.cancel(job.id)
        elif op < 0.85 and live is not None:
            coord.drain(name)
        elif op < 0.9:
            clock.now += 11  # every agent silent past the timeout but those heartbeating now
            for other in names:
                w = coord.workers.get(other)
                if w is not None and w.session and rng.random() < 0.7:
                    coord.heartbeat(other, sessions[other], w.memory, [], list(w.free_ports))
        demands = [TaskDemand("worker", i, rng.choice([128, 300, 700]) << 20) for i in range(2)]
        scanned = coord.agents.capacities(coord.state.reserved_scan())
        assert coord.state.room.place(demands) == place(demands, scanned), step
        coord.tick()
        coord.state.check()
    placed = [t for j in jobs for t in j.tasks if t.worker]
    assert len(placed) > 20 and sum(t.state.final for t in placed) > 10, len(placed)


def test_a_job_wider_than_the_cluster_has_ever_been_is_refused_with_the_numbers(env):
    coord, clock, *_ = env
    # no workers yet: a cluster starting, its jobs wait
    early = coord.submit({**SPEC, "workers": 4, "data": {"source": "digits", "batch_size": 64}})
    assert early.state == JobState.PENDING
    register(coord, "a")
    register(coord, "b")
    with pytest.raises(InfeasibleError) as e:
        coord.submit({**SPEC, "workers": 4, "data": {"source": "digits", "batch_size": 64}})
    msg = str(e.value)
    assert "needs 4 workers" in msg and "has had 2" in msg and "--queue-for-capacity" in msg
    # a worker lost or draining was offered all the same: it counts
    coord._mark_lost(coord.workers["b"])
    coord.submit(SPEC)
    # allowed to wait, it waits its time, then fails saying why
    waiting = coord.submit({**SPEC, "workers": 4, "data": {"source": "digits",
                                                           "batch_size": 64}},
                           queue_for_capacity_s=60)
    coord.tick()
    assert waiting.state == JobState.PENDING
    clock.now += 61
    coord.tick()
    assert waiting.state == JobState.FAILED and "--queue-for-capacity" in waiting.message
    assert "waiting for 4 workers" in waiting.message


CODE_SPEC = {"name": "c", "workers": 2, "code": {"sha256": "a" * 64, "size": 10,
                                                  "model": "m:build", "dataset": "m:data"},
             "data": {"batch_size": 64}, "training": {"steps": 10}}


def run_out(coord, sessions, job, allocation, peak=0, rest_cancelled=True):
    """The job's first task runs out of memory allocating ``allocation`` bytes (having
    reached ``peak``); the others report they were stopped."""
    t = job.tasks[0]
    coord.report(t.worker, sessions[t.worker], TaskReport(
        job.id, t.role, t.index, TaskState.FAILED, attempt=t.attempt,
        failure=FailureKind.OOM, exit_code=75, message="out of memory", peak_bytes=peak,
        oom=OutOfMemory(task=f"{t.role}:{t.index}", allocation_bytes=allocation)))
    for o in job.tasks[1:] if rest_cancelled else ():
        coord.report(o.worker, sessions[o.worker], TaskReport(
            job.id, o.role, o.index, TaskState.CANCELLED, attempt=o.attempt))


def test_a_code_models_probe_starts_small_and_grows_when_it_runs_out(env):
    """A model only the job's code builds has no estimate: its probe starts at
    PROBE_FIRST_BYTES per task, not a whole worker, so it runs beside other jobs; one that runs
    out of memory is probed again with more, and the job is planned on the probe that fit."""
    from strata.coordinator.admission import PROBE_FIRST_BYTES, PROBE_GROWTH

    coord, *_ = env
    sessions = {n: register(coord, n, budget=8 * GiB) for n in ("a", "b")}
    job = coord.submit(CODE_SPEC)
    probe = next(j for j in coord.list_jobs() if j.id != job.id)
    # the job itself is planned at a whole worker until measured; its probe is not
    assert {t.memory_budget_bytes for t in job.tasks} == {8 * GiB}
    assert {t.memory_budget_bytes for t in probe.tasks} == {PROBE_FIRST_BYTES}
    # the small probe leaves room: another job of 7 GiB per task runs beside it
    other = coord.submit({**SPEC, "name": "o", "memory": {"per_task_budget": "7GiB",
                                                          "profile": False}})
    coord.tick()
    assert probe.state == JobState.SCHEDULED and other.state == JobState.SCHEDULED
    start_all(coord, sessions, probe)
    run_out(coord, sessions, probe, 400 << 20, peak=250 << 20)
    assert probe.state == JobState.FAILED
    coord.tick()
    # a second probe with more: PROBE_GROWTH times the first, or half again what it needed
    assert job.state == JobState.PENDING
    second = coord.get(coord._probe_of[job.id])
    needed = PROBE_FIRST_BYTES + (400 << 20)
    want = max(PROBE_FIRST_BYTES * PROBE_GROWTH, needed * 3 // 2)
    assert {t.memory_budget_bytes for t in second.tasks} == {want}
    events = [e.message for e in coord.store.events(job.id, 0)]
    assert any("ran out of memory at 256 MiB per task" in m and "probing again" in m
               for m in events), events
    coord.cancel(other.id)
    for o in other.tasks:
        coord.report(o.worker, sessions[o.worker], TaskReport(
            other.id, o.role, o.index, TaskState.CANCELLED, attempt=o.attempt))
    coord.tick()
    start_all(coord, sessions, second)
    for o in second.tasks:
        coord.report(o.worker, sessions[o.worker], TaskReport(
            second.id, o.role, o.index, TaskState.SUCCEEDED, attempt=o.attempt,
            peak_bytes=700 << 20, largest_alloc_bytes=300 << 20))
    coord.tick()
    # planned on what the probe that fit measured (and the first one's need, below it), with
    # room for its largest allocation (the all-reduce pack) in one piece
    assert job.state == JobState.SCHEDULED
    assert {t.estimated_memory_bytes for t in job.tasks} == {700 << 20}
    assert all((700 << 20) + 1.25 * (300 << 20) <= t.memory_budget_bytes < 8 * GiB
               for t in job.tasks)
    # the same code again is measured already: no probe, and not a whole worker either
    again = coord.submit({**CODE_SPEC, "name": "c2"})
    assert again.id not in coord._probe_of
    assert {t.estimated_memory_bytes for t in again.tasks} == {700 << 20}
    assert all((700 << 20) + 1.25 * (300 << 20) <= t.memory_budget_bytes < 8 * GiB
               for t in again.tasks)


def test_a_code_models_probe_that_runs_out_at_a_whole_worker_plans_on_its_need(env):
    """The growth stops at the job's own plan (a whole worker): a probe that ran out there
    leaves the job planned on what it was seen to need, as before."""
    coord, *_ = env
    sessions = {n: register(coord, n, budget=GiB) for n in ("a", "b")}
    job = coord.submit(CODE_SPEC)
    budgets = []
    for _ in range(3):
        probe = coord.get(coord._probe_of[job.id])
        budgets.append(probe.tasks[0].memory_budget_bytes)
        coord.tick()
        start_all(coord, sessions, probe)
        run_out(coord, sessions, probe, 1 << 20)
        coord.tick()
        if job.id not in coord._probe_of:
            break
    assert budgets == [256 << 20, GiB]
    assert job.id not in coord._probe_of and job.state == JobState.SCHEDULED
    assert sum(1 for j in coord.list_jobs() if j.name == "c-probe") == 2


def test_a_task_out_of_a_budget_strata_chose_restarts_its_job_once_with_its_need(env):
    """No restarts allowed, and yet a task that ran out of the budget Strata chose (its
    estimate, or its probe's peak) does not fail its job the first time: the job restarts,
    not counted against restart.max_restarts, with the need the OOM showed; the second time
    it fails. A fixed memory.per_task_budget is the user's: it fails at once."""
    coord, clock, *_ = env
    sessions = {n: register(coord, n) for n in ("a", "b")}
    job = coord.submit(SPEC)
    coord.tick()
    start_all(coord, sessions, job)
    t0 = job.tasks[0]
    old = t0.memory_budget_bytes
    coord.report(t0.worker, sessions[t0.worker], TaskReport(
        job.id, t0.role, t0.index, TaskState.FAILED, attempt=t0.attempt,
        failure=FailureKind.OOM, exit_code=75, message="out of memory", peak_bytes=old - (1 << 20),
        oom=OutOfMemory(task=f"{t0.role}:{t0.index}", allocation_bytes=8 << 20)))
    assert job.state == JobState.RESTARTING, job.message
    assert "restarts once with what the task was seen to need" in job.message
    assert job.recovery.failures == 0 and job.recovery.memory_retried
    for t in job.tasks[1:]:
        coord.report(t.worker, sessions[t.worker], TaskReport(
            job.id, t.role, t.index, TaskState.CANCELLED, attempt=t.attempt))
    clock.now += 6  # restart.backoff_s
    coord.tick()
    coord.tick()
    assert job.state == JobState.SCHEDULED, job.message
    assert all(t.memory_budget_bytes > old for t in job.tasks)
    start_all(coord, sessions, job)
    t0 = job.tasks[0]
    coord.report(t0.worker, sessions[t0.worker], TaskReport(
        job.id, t0.role, t0.index, TaskState.FAILED, attempt=t0.attempt,
        failure=FailureKind.OOM, exit_code=75, message="out of memory"))
    assert job.state == JobState.FAILED
    fixed = coord.submit({**SPEC, "name": "fixed", "memory": {"per_task_budget": "64MiB"}})
    coord.tick()
    start_all(coord, sessions, fixed)
    f0 = fixed.tasks[0]
    coord.report(f0.worker, sessions[f0.worker], TaskReport(
        fixed.id, f0.role, f0.index, TaskState.FAILED, attempt=f0.attempt,
        failure=FailureKind.OOM, exit_code=75, message="out of memory"))
    assert fixed.state == JobState.FAILED


def test_an_oom_bound_is_not_a_peak_a_code_job_that_ran_out_is_probed_again_above_it(env):
    """What a probe that ran out of memory showed is a lower bound, not the task's peak: the
    same code submitted again (its job cancelled meanwhile) is not planned at that bound but
    probed again, starting at half again above it."""
    from strata.coordinator.admission import PROBE_FIRST_BYTES

    coord, *_ = env
    sessions = {n: register(coord, n, budget=8 * GiB) for n in ("a", "b")}
    job = coord.submit(CODE_SPEC)
    probe = coord.get(coord._probe_of[job.id])
    coord.tick()
    start_all(coord, sessions, probe)
    run_out(coord, sessions, probe, 100 << 20, rest_cancelled=False)
    coord.cancel(job.id)
    again = coord.submit({**CODE_SPEC, "name": "c2", "training": {"steps": 99}})
    assert again.id in coord._probe_of  # still measured by a probe
    second = coord.get(coord._probe_of[again.id])
    bound = PROBE_FIRST_BYTES + (100 << 20) // 2  # strata.oom.needed_bytes, no peak seen
    assert {t.memory_budget_bytes for t in second.tasks} == {bound * 3 // 2}


def test_workers_cpu_kernels_decide_the_estimate(env):
    """An agent's CPU kernels (``strata.cpukernels``) reach the planner's offers and the workers
    list; a job on oneDNN workers is estimated without Eigen's convolution workspace, and a
    cluster of both families at the larger figure."""
    coord, _, _, _ = env
    for name, kernels in (("a", "onednn"), ("b", "onednn")):
        coord.register(name, "127.0.0.1", "CPU", 4 * GiB, [1, 2, 3, 4], [], cpu_kernels=kernels)
    assert {o.kernels for o in coord.worker_offers(free=False)} == {"onednn"}
    assert {w.name: w.cpu_kernels for w in coord.list_workers()} == {"a": "onednn", "b": "onednn"}
    with open(os.path.join(ROOT, "tests", "fixtures", "keras_models.json")) as f:
        cnn = json.load(f)["good"]["cnn"]
    spec = {**SPEC, "name": "cnn", "model": {"keras_json": cnn["json"]},
            "data": {"source": "synthetic", "examples": 256, "batch_size": 64}}
    onednn = coord.plan(spec).tasks[0].estimated_memory_bytes
    coord.register("c", "127.0.0.1", "CPU", 4 * GiB, [1, 2, 3, 4], [], cpu_kernels="eigen")
    both = coord.plan(spec).tasks[0].estimated_memory_bytes
    assert both > onednn + (1 << 20)  # Eigen's im2col buffer, at least


def test_each_change_is_written_before_the_messages_it_causes(env):
    """Persist before send: a placement, a failure's restart and a cancel write the job's
    and its tasks' new state before a start or stop is queued to an agent, and a placement
    whose write fails queues nothing."""
    from strata.errors import DiskFull

    coord, clock, store, _ = env
    trail: list[str] = []
    real_send, real_tasks, real_job = coord.agents.send, store.put_tasks, store.put_job
    full = {"on": False}

    def send(name, cmd):
        trail.append(f"send {type(cmd).__name__}")
        real_send(name, cmd)

    def put_tasks(tasks):
        if full["on"]:
            raise DiskFull("the coordinator's disk is full")
        trail.append("write tasks")
        real_tasks(tasks)

    def put_job(job):
        trail.append(f"write job {job.state.value}")
        real_job(job)

    coord.agents.send, store.put_tasks, store.put_job = send, put_tasks, put_job
    sessions = {n: register(coord, n) for n in ("a", "b")}
    job = coord.submit(dict(SPEC, restart={"max_restarts": 2}))
    full["on"] = True
    trail.clear()
    with pytest.raises(DiskFull):
        coord.tick()
    assert job.state == JobState.PENDING and not any(x.startswith("send") for x in trail)
    assert all(not drain(coord, n) for n in sessions)
    assert all(t.worker == "" and t.attempt == 0 for t in job.tasks)  # nothing taken
    coord.state.check()
    full["on"] = False
    coord.wake()
    clock.now += 1
    coord._tried.clear()  # the room did not move: the coordinator would not try again yet
    trail.clear()
    coord.tick()
    assert job.state == JobState.SCHEDULED and {t.worker for t in job.tasks} == {"a", "b"}
    assert [t for t in store.load_job(job.id).tasks] == job.tasks  # as written
    first_send = trail.index("send StartTaskCommand")
    assert "write tasks" in trail[:first_send] and "write job SCHEDULED" in trail[:first_send]

    for x in job.tasks:
        coord.report(x.worker, sessions[x.worker], TaskReport(
            job.id, x.role, x.index, TaskState.RUNNING, attempt=x.attempt))
    t = job.tasks[0]
    trail.clear()
    coord.report(t.worker, sessions[t.worker], TaskReport(
        job.id, t.role, t.index, TaskState.FAILED, attempt=t.attempt, message="boom",
        failure=FailureKind.EXIT_CODE, exit_code=1))
    assert job.state == JobState.RESTARTING
    first_send = trail.index("send StopTaskCommand")
    assert "write job RESTARTING" in trail[:first_send] and "write tasks" in trail[:first_send]

    trail.clear()
    coord.cancel(job.id)  # its other task is still being stopped: told again
    first_send = trail.index("send StopTaskCommand")
    assert "write job CANCELLED" in trail[:first_send]
