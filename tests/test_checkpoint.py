"""Checkpoints, resume and the peer-failure exit, with real task processes
(``python -m strata.worker.task``) launched by hand as the agent would: a hand-made
``TaskConfig`` (JSON) with a shared directory and a restart generation, ``TF_CONFIG`` on
loopback ports, events read from a pipe (``tests.test_task_process``'s ``Task``).

Costs on 2 cores: 23 task processes (3-8 s each to start TensorFlow), most of them two at a
time: about 75 s in all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from strata.exitcodes import TASK_EXIT_COLLECTIVE, TASK_EXIT_NOTICE, TASK_EXIT_OK
from strata.taskconfig import NOTICE_FILE, TASK_CONFIG_VERSION

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from strata.worker.failures import peer_failure  # noqa: E402
from strata.worker.trainers.data_parallel import DEFAULT_COLLECTIVE_TIMEOUT_S  # noqa: E402
from tests.test_task_process import ROOT, Task, check_well_formed, make_spec  # noqa: E402

pytestmark = pytest.mark.integration  # starts TensorFlow processes

portpicker = pytest.importorskip("portpicker")

JOB = "ckpt-job"
WAIT_S = 150
SMALL_MLP = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 128],
                         "classes": 10}}


def ckpt_spec(steps: int, every: int, keep: int = 3, workers: int = 1, **over) -> dict:
    base = make_spec()
    fields = dict(workers=workers, model=SMALL_MLP,
                  training={**base["training"], "epochs": 0, "steps": steps},
                  checkpoint={"every_steps": every, "keep": keep})
    fields.update(over)
    return make_spec(**fields)


def start(tmp, name: str, spec: dict, *, shared: str, restart: int, role: str = "worker",
          index: int = 0, cluster: dict | None = None, section: dict | None = None,
          env_extra: dict | None = None, cwd: str | None = None) -> Task:
    """One task process of job ``JOB`` (``cluster``: its TF_CONFIG's; none: no TF_CONFIG),
    run in ``cwd`` (its working directory, where a notice is read; default the checkout)."""
    cfg = {"version": TASK_CONFIG_VERSION, "job_id": JOB, "role": role, "index": index,
           "spec": spec, "memory_budget_bytes": 512 << 20, "report_interval_s": 0.5,
           "restart": restart,
           "agent": {"output_dir": str(tmp / f"out-{name}"), "threads": 1, "device": "CPU",
                     "shared_dir": shared}}
    cfg.update(section or {})
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB="512")
    env.pop("TF_CONFIG", None)
    env.pop("STRATA_COLLECTIVE_TIMEOUT_S", None)  # the default
    if cluster is not None:
        env["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                       "task": {"type": role, "index": index}})
    env.update(env_extra or {})
    r, w = os.pipe()
    log_path = str(tmp / f"{name}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "strata.worker.task", "--config",
                                 str(path), "--events-fd", str(w)], cwd=cwd or ROOT, env=env,
                                pass_fds=(w,), stdout=log, stderr=subprocess.STDOUT)
    os.close(w)
    return Task(proc, r, log_path)


def ports(n: int) -> list[str]:
    return [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(n)]


def finish(*tasks: Task, timeout: float = WAIT_S) -> None:
    """Waits for every task; each must succeed."""
    try:
        for t in tasks:
            rc = t.wait(timeout)
            assert rc == TASK_EXIT_OK, f"exit {rc}; log:\n{t.log()}"
            check_well_formed(t)
    finally:
        for t in tasks:
            t.kill()


def stop(*servers: Task) -> None:
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in servers:
        try:
            s.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            s.kill()


def steps_of(t: Task, kind: str) -> list[int]:
    return [e["step"] for e in t.of(kind)]


def gen_dir(shared, gen: int) -> str:
    return os.path.join(str(shared), "jobs", JOB, "checkpoints", f"gen-{gen}")


def saved_steps(directory: str) -> list[int]:
    return sorted(int(n[len("ckpt-"):-len(".index")]) for n in os.listdir(directory)
                  if n.startswith("ckpt-") and n.endswith(".index"))


def digest(t: Task) -> str:
    [res] = t.of("result")
    return res["weights_sha256"]


def check_resumed(t: Task, at: int, total: int) -> None:
    [res] = t.of("resumed")
    assert res["step"] == at, res
    progress = t.of("progress")
    assert progress and progress[0]["step"] == at + 1 and progress[-1]["step"] == total, progress
    assert all(p["total_steps"] == total for p in progress)
    kinds = [e["event"] for e in t.events]
    assert kinds.index("resumed") < kinds.index("first_step")
    assert t.of("result")[0]["steps"] == total


# ---------------------------------------------------------------------------------------------
# multi_worker_mirrored, one worker (no TF_CONFIG)


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """Generation 0 (6 steps, every 3, keep 2) next to an uninterrupted 10-step run, then
    generation 1 (10 steps) resuming from generation 0."""
    tmp = tmp_path_factory.mktemp("one")
    shared = tmp / "shared"
    g0 = start(tmp, "gen0", ckpt_spec(6, 3, keep=2), shared=str(shared), restart=0)
    plain = start(tmp, "plain", ckpt_spec(10, 0), shared="", restart=0)
    finish(g0, plain)
    gen0_copy = tmp / "gen0-copy"
    shutil.copytree(gen_dir(shared, 0), gen0_copy)
    g1 = start(tmp, "gen1", ckpt_spec(10, 3, keep=2), shared=str(shared), restart=1)
    finish(g1)
    return {"tmp": tmp, "shared": shared, "g0": g0, "g1": g1, "plain": plain,
            "gen0_copy": gen0_copy}


def test_generation_0_checkpoints_every_3_steps(one_worker):
    g0 = one_worker["g0"]
    assert steps_of(g0, "checkpoint") == [3, 6]
    assert all(e["seconds"] > 0 and e["path"].endswith(f"gen-0/ckpt-{e['step']}")
               for e in g0.of("checkpoint"))
    assert not g0.of("resumed") and steps_of(g0, "progress")[-1] == 6
    # keep 2 of 2 here; the 2-worker test below keeps 2 of 3
    assert saved_steps(str(one_worker["gen0_copy"])) == [3, 6]


def test_generation_1_resumes_where_0_stopped_and_matches_an_uninterrupted_run(one_worker):
    g1, plain, shared = one_worker["g1"], one_worker["plain"], one_worker["shared"]
    check_resumed(g1, 6, 10)
    [res] = g1.of("resumed")
    assert res["path"].endswith("gen-0/ckpt-6") and res["generation"] == 0
    assert steps_of(g1, "checkpoint") == [9]
    # its first checkpoint written, generation 1 deleted generation 0
    assert not os.path.exists(gen_dir(shared, 0))
    assert saved_steps(gen_dir(shared, 1)) == [9]
    # model, optimizer and data position restored: the same weights, bit for bit
    assert digest(g1) == digest(plain)
    assert not plain.of("checkpoint") and not plain.of("resumed")


def test_a_generation_ignores_its_own_and_later_generations(one_worker, tmp_path):
    copy = one_worker["gen0_copy"]
    # only a later generation's checkpoints: start afresh, leave them alone
    later = tmp_path / "later"
    shutil.copytree(copy, gen_dir(later, 5))
    fresh = start(tmp_path, "fresh", ckpt_spec(3, 3), shared=str(later), restart=1)
    # an earlier generation's checkpoint at step 6 of a 5-step job: nothing left to train
    done = tmp_path / "done"
    shutil.copytree(copy, gen_dir(done, 0))
    shutil.copytree(copy, gen_dir(done, 2))  # its own generation: not read
    past = start(tmp_path, "past", ckpt_spec(5, 3), shared=str(done), restart=2)
    finish(fresh, past)
    assert not fresh.of("resumed") and steps_of(fresh, "progress")[0] == 1
    assert steps_of(fresh, "checkpoint") == [3]
    assert saved_steps(gen_dir(later, 5)) == [3, 6]
    [res] = past.of("resumed")
    assert res["step"] == 6 and res["generation"] == 0, res
    assert not past.of("progress") and not past.of("checkpoint")
    [result] = past.of("result")
    assert result["steps"] == 5 and result["test_accuracy"] > 0


# ---------------------------------------------------------------------------------------------
# multi_worker_mirrored, two workers


def task_dir(tmp, name: str, notice: int = 0) -> str:
    """A task's working directory, with a notice for step ``notice`` (0: none) in it."""
    d = tmp / f"{name}-dir"
    d.mkdir()
    if notice:
        (d / NOTICE_FILE).write_text(str(notice))
    return str(d)


def start_workers(tmp, name: str, spec: dict, *, shared: str, restart: int,
                  env_extra: dict | None = None, notice: int = 0) -> list[Task]:
    """Two workers; ``notice``: a notice for that step already in each one's directory."""
    cluster = {"worker": ports(2)}
    return [start(tmp, f"{name}-w{i}", spec, shared=shared, restart=restart, index=i,
                  cluster=cluster, env_extra=env_extra, cwd=task_dir(tmp, f"{name}-w{i}", notice))
            for i in range(2)]


def test_two_workers_save_and_resume_together(tmp_path):
    shared = tmp_path / "shared"
    digits_mlp = make_spec()["model"]  # the seed-shaped MLP: its save time is logged
    g0 = start_workers(tmp_path, "gen0", ckpt_spec(6, 2, keep=2, workers=2, model=digits_mlp),
                       shared=str(shared), restart=0)
    finish(*g0)
    assert steps_of(g0[0], "checkpoint") == [2, 4, 6]
    assert not g0[1].of("checkpoint")  # worker 1 takes part in each save, writes a copy
    assert saved_steps(gen_dir(shared, 0)) == [4, 6]  # keep 2
    assert not [n for n in os.listdir(gen_dir(shared, 0)) if n.startswith("tmp-")]
    print("seconds per save (seed MLP, 2 workers):",
          [round(e["seconds"], 3) for e in g0[0].of("checkpoint")])

    g1 = start_workers(tmp_path, "gen1", ckpt_spec(8, 2, keep=2, workers=2, model=digits_mlp),
                       shared=str(shared), restart=1)
    finish(*g1)
    for t in g1:
        check_resumed(t, 6, 8)
    assert steps_of(g1[0], "checkpoint") == [8] and not g1[1].of("checkpoint")
    assert digest(g1[0]) == digest(g1[1])
    assert not os.path.exists(gen_dir(shared, 0))
    assert saved_steps(gen_dir(shared, 1)) == [8]
    assert not [n for n in os.listdir(gen_dir(shared, 1)) if n.startswith("tmp-")]


@pytest.mark.parametrize("every", [1000, 0])
def test_a_notice_saves_both_workers_at_its_step_and_the_resumed_run_matches(tmp_path, every):
    """A notice for step 4 of a 10-step 2-worker job with no periodic checkpoint due (or none
    at all: a job without ``checkpoint:`` saves on notice too): both workers save step 4
    together and stop (79); the next generation resumes at 4 and ends with the weights of an
    uninterrupted run, bit for bit."""
    shared = tmp_path / "shared"
    spec = ckpt_spec(10, every, keep=2, workers=2)
    g0 = start_workers(tmp_path, "gen0", spec, shared=str(shared), restart=0, notice=4)
    plain = start_workers(tmp_path, "plain", ckpt_spec(10, 0, workers=2), shared="", restart=0)
    try:
        for t in g0:
            rc = t.wait(WAIT_S)
            assert rc == TASK_EXIT_NOTICE, f"exit {rc}; log:\n{t.log()}"
            assert steps_of(t, "progress")[-1] <= 4 and not t.of("result")
    finally:
        for t in g0:
            t.kill()
    assert steps_of(g0[0], "checkpoint") == [4] and not g0[1].of("checkpoint")
    assert saved_steps(gen_dir(shared, 0)) == [4]
    g1 = start_workers(tmp_path, "gen1", spec, shared=str(shared), restart=1)
    finish(*g1, *plain)
    for t in g1:
        check_resumed(t, 4, 10)
    assert digest(g1[0]) == digest(g1[1]) == digest(plain[0])


def test_survivor_of_a_killed_peer_exits_78(tmp_path):
    # the default collective timeout bounds the wait; a SIGKILLed peer's connection reset
    # ends it at once (measured 0.2 s)
    timeout_s = DEFAULT_COLLECTIVE_TIMEOUT_S
    assert timeout_s <= 60
    workers = start_workers(tmp_path, "kill", ckpt_spec(100000, 0, workers=2), shared="",
                            restart=0)
    survivor, victim = workers
    try:
        deadline = time.time() + WAIT_S
        while not any(p["step"] >= 20 for p in survivor.of("progress")):
            assert survivor.proc.poll() is None, survivor.log()
            assert time.time() < deadline, survivor.log()
            time.sleep(0.1)
        victim.proc.send_signal(signal.SIGKILL)
        t_kill = time.time()
        rc = survivor.wait(timeout_s + 30)
        took = time.time() - t_kill
    finally:
        for t in workers:
            t.kill()
    print(f"survivor exited {rc} {took:.1f} s after its peer's SIGKILL")
    assert rc == TASK_EXIT_COLLECTIVE, survivor.log()
    assert took < timeout_s + 10, took
    err = survivor.events[-1]
    assert err["event"] == "error" and err["kind"] == "collective_timeout", err
    assert not survivor.of("result")


# ---------------------------------------------------------------------------------------------
# parameter_server chief, pipeline driver: hand-launched clusters of task processes


def run_ps(tmp, name: str, steps: int, *, shared: str, restart: int, every: int = 3,
           notice: int = 0) -> Task:
    """A parameter_server job (chief, 1 worker, 1 ps) of ``steps`` steps, every ``every``;
    returns the chief once it has ended (its servers stopped); ``notice``: a notice for that
    step in the chief's directory (it must then stop on it)."""
    spec = ckpt_spec(steps, every, workers=1, strategy="parameter_server", parameter_servers=1)
    cluster = {"chief": ports(1), "worker": ports(1), "ps": ports(1)}
    servers = [start(tmp, f"{name}-{role}", spec, shared=shared, restart=restart, role=role,
                     cluster=cluster) for role in ("ps", "worker")]
    section = {"ps_placement": {"placement": {"hidden_0": 0, "hidden_1": 0, "logits": 0},
                                "ps_budgets_bytes": [512 << 20]}}
    chief = start(tmp, f"{name}-chief", spec, shared=shared, restart=restart, role="chief",
                  cluster=cluster, section=section, cwd=task_dir(tmp, f"{name}-chief", notice))
    try:
        if notice:
            stopped_on_notice(chief, notice)
        else:
            finish(chief)
    finally:
        chief.kill()
        stop(*servers)
    return chief


def test_parameter_server_chief_saves_and_resumes(tmp_path):
    shared = str(tmp_path / "shared")
    g0 = run_ps(tmp_path, "gen0", 6, shared=shared, restart=0)
    assert steps_of(g0, "checkpoint") == [3, 6]
    assert steps_of(g0, "progress")[-1] == 6
    g1 = run_ps(tmp_path, "gen1", 8, shared=shared, restart=1)
    check_resumed(g1, 6, 8)
    assert not g1.of("checkpoint")  # the next one would be at step 9
    assert saved_steps(gen_dir(shared, 0)) == [3, 6]  # kept: generation 1 wrote none


def start_pipeline(tmp, name: str, steps: int, every: int, *, shared: str,
                   restart: int, notice: int = 0) -> tuple[Task, Task]:
    """A 2-stage pipeline job: the driver (chief, stage 0: hidden_0) and one stage server
    (worker:0, stage 1: hidden_1 and logits). Returns (chief, server)."""
    spec = ckpt_spec(steps, every, workers=1, strategy="pipeline", stages=2, microbatches=2)
    cluster = {"chief": ports(1), "worker": ports(1)}
    server = start(tmp, f"{name}-stage1", spec, shared=shared, restart=restart,
                   cluster=cluster)
    layout = [{"replica": 0, "stage": 0, "role": "chief", "index": 0, "first_layer": 0,
               "last_layer": 1, "layers": ["hidden_0"]},
              {"replica": 0, "stage": 1, "role": "worker", "index": 0, "first_layer": 1,
               "last_layer": 3, "layers": ["hidden_1", "logits"]}]
    section = {"stage_layout": {"stages": 2, "replicas": 1, "microbatches": 2,
                                "microbatch": 128, "layout": layout}}
    chief = start(tmp, f"{name}-chief", spec, shared=shared, restart=restart, role="chief",
                  cluster=cluster, section=section, cwd=task_dir(tmp, f"{name}-chief", notice))
    return chief, server


def stopped_on_notice(chief: Task, step: int) -> None:
    rc = chief.wait(WAIT_S)
    assert rc == TASK_EXIT_NOTICE, f"exit {rc}; log:\n{chief.log()}"
    assert steps_of(chief, "checkpoint")[-1] == step and not chief.of("result")


def test_pipeline_driver_saves_and_resumes_remote_stages(tmp_path):
    shared = str(tmp_path / "shared")
    g0 = start_pipeline(tmp_path, "gen0", 4, 2, shared=shared, restart=0)
    plain = start_pipeline(tmp_path, "plain", 6, 0, shared="", restart=0)
    try:
        finish(g0[0], plain[0])
    finally:
        stop(g0[1], plain[1])
    assert steps_of(g0[0], "checkpoint") == [2, 4]
    # the stage server wrote its own variables' shard
    assert any(".data-00001-of-" in n for n in os.listdir(gen_dir(shared, 0)))
    chief, server = start_pipeline(tmp_path, "gen1", 6, 2, shared=shared, restart=1)
    try:
        finish(chief)
    finally:
        stop(server)
    check_resumed(chief, 4, 6)
    assert steps_of(chief, "checkpoint") == [6]
    assert not os.path.exists(gen_dir(shared, 0))
    # every stage's layers and optimizer, and the data position, restored exactly
    assert digest(chief) == digest(plain[0])


def test_a_notice_stops_a_pipeline_and_a_parameter_server_job_at_its_step(tmp_path):
    """The chief drives both: told step 3 of 6 (no periodic checkpoint due), it saves every
    stage's (or server's) variables there and stops; the next generation resumes at 3."""
    shared = str(tmp_path / "shared")
    chief, server = start_pipeline(tmp_path, "pipe0", 6, 1000, shared=shared, restart=0,
                                   notice=3)
    plain = start_pipeline(tmp_path, "plain", 6, 0, shared="", restart=0)
    try:
        stopped_on_notice(chief, 3)
        finish(plain[0])
    finally:
        chief.kill()
        stop(server, plain[1])
    chief, server = start_pipeline(tmp_path, "pipe1", 6, 1000, shared=shared, restart=1)
    try:
        finish(chief)
    finally:
        stop(server)
    check_resumed(chief, 3, 6)
    assert digest(chief) == digest(plain[0])

    ps_shared = str(tmp_path / "ps-shared")
    run_ps(tmp_path, "ps0", 8, shared=ps_shared, restart=0, every=1000, notice=3)
    assert saved_steps(os.path.join(ps_shared, "jobs", JOB, "checkpoints", "gen-0")) == [3]
    g1 = run_ps(tmp_path, "ps1", 8, shared=ps_shared, restart=1, every=1000)
    check_resumed(g1, 3, 8)


def test_peer_failures_are_told_from_other_errors():
    # what TensorFlow 2.21 raised in a survivor (as text: the types need TensorFlow loaded)
    aborted = RuntimeError("Graph execution error:\nCollective ops is aborted by: recvmsg:"
                           "Connection reset by peer")
    assert peer_failure(aborted) is aborted
    try:
        try:
            raise ConnectionError("The following tasks are unhealthy (stopped sending "
                                  "heartbeats): /job:worker/replica:0/task:1")
        except ConnectionError as e:
            raise RuntimeError("step failed") from e
    except RuntimeError as e:
        assert isinstance(peer_failure(e), ConnectionError)  # found in the chain
    assert peer_failure(ValueError("shapes (2, 3) and (4,) are incompatible")) is None
    assert peer_failure(RuntimeError("stage servers not reachable after 120 s")) is None


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


def test_a_hung_peer_ends_the_survivor_within_the_timeout_and_threads_stay_few(tmp_path):
    # SIGSTOP: the peer neither answers nor resets its connections; the survivor's stall
    # watch ends it as a collective timeout. Meanwhile a task's threads do not grow with its
    # steps (TensorFlow's per-collective timeout kept a sleeping thread per all-reduce)
    timeout_s = 6.0
    workers = start_workers(tmp_path, "hang", ckpt_spec(100000, 0, workers=2), shared="",
                            restart=0, env_extra={"STRATA_COLLECTIVE_TIMEOUT_S": str(timeout_s)})
    survivor, victim = workers
    try:
        deadline = time.time() + WAIT_S
        while not any(p["step"] >= 200 for p in survivor.of("progress")):
            assert survivor.proc.poll() is None, survivor.log()
            assert time.time() < deadline, survivor.log()
            time.sleep(0.1)
        early = _threads(survivor.proc.pid)
        while not any(p["step"] >= 2000 for p in survivor.of("progress")):
            assert survivor.proc.poll() is None, survivor.log()
            assert time.time() < deadline, survivor.log()
            time.sleep(0.2)
        late = _threads(survivor.proc.pid)
        victim.proc.send_signal(signal.SIGSTOP)
        t_stop = time.time()
        rc = survivor.wait(timeout_s + 30)
        took = time.time() - t_stop
    finally:
        for t in workers:
            t.kill()
    print(f"threads {early} at step 200, {late} at step 2000; survivor exited {rc} "
          f"{took:.1f} s after its peer stopped")
    assert late <= early + 20, (early, late)
    assert rc == TASK_EXIT_COLLECTIVE, survivor.log()
    assert timeout_s <= took < timeout_s + 10, took
    assert any("no training step done" in e["message"] for e in survivor.of("error"))


def test_the_stall_watch_fires_once_after_its_timeout_not_while_beaten():
    from strata.worker.watchdog import StallWatch

    fired: list[float] = []
    watch = StallWatch(0.3, fired.append).start()
    try:
        for _ in range(6):
            time.sleep(0.1)
            watch.beat()  # steps keep it quiet
        assert not fired
        time.sleep(0.8)
        assert len(fired) == 1 and fired[0] > 0.3
    finally:
        watch.stop()
