"""The task process (python -m strata.worker.task) run for real: MultiWorkerMirroredStrategy workers
launched by hand with TF_CONFIG on loopback ports, events read from a pipe (os.pipe +
pass_fds), as the worker agent does.

Costs: the 2-worker digits run takes ~10 s on 2 cores; the OOM run ~15 s (TensorFlow's BFC
allocator waits 10 s for memory to be freed before it gives up), so it starts in the
background when the module starts and runs alongside the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile

import pytest

from strata.taskconfig import TASK_CONFIG_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from strata.exitcodes import TASK_EXIT_BAD_CONFIG, TASK_EXIT_OK, TASK_EXIT_OOM  # noqa: E402

pytestmark = pytest.mark.integration  # starts coordinator, agent or TensorFlow processes

portpicker = pytest.importorskip("portpicker")

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "keras_models.json")
WAIT_S = 180
DIGITS_EPOCHS = 5  # 25 steps at global batch 256: test accuracy ~0.95 (>= 0.90 from 4 epochs)


# ---------------------------------------------------------------------------------------------
# launch helpers


def make_spec(**over) -> dict:
    spec = {
        "name": "digits-mlp", "strategy": "multi_worker_mirrored", "workers": 2,
        "parameter_servers": 0, "stages": 0, "microbatches": 1,
        "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [1024, 512, 256],
                              "classes": 10}},
        "data": {"source": "digits", "path": "", "batch_size": 256, "examples": 0},
        "training": {"epochs": DIGITS_EPOCHS, "steps": 0,
                     "optimizer": {"name": "adam", "learning_rate": 0.001},
                     "loss": "sparse_categorical_crossentropy", "seed": 0},
        "memory": {"per_task_budget": "", "mixed_precision": "none", "recompute": False},
        "checkpoint": {"every_steps": 0}, "restart": {"max_restarts": 0},
    }
    spec.update(over)
    return spec


class Task:
    """One running task process; a thread drains its events pipe."""

    def __init__(self, proc: subprocess.Popen, read_fd: int, log_path: str):
        self.proc = proc
        self.log_path = log_path
        self.events: list[dict] = []
        self.bad_lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "r") as f:
            for line in f:
                try:
                    self.events.append(json.loads(line))
                except ValueError:
                    self.bad_lines.append(line)

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"task did not exit within {timeout} s; log:\n{self.log()}")
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e.get("event") == kind]


def launch(spec: dict, tmp_path, workers: int = 2, bfc_mb: int | None = 1024,
           env_extra: dict | None = None, wrap_in_shell: bool = False,
           only: list[int] | None = None) -> list[Task]:
    ports = [portpicker.pick_unused_port() for _ in range(workers)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    tasks = []
    for i in range(workers):
        if only is not None and i not in only:
            continue
        # the TaskConfig message in its JSON form (the agent writes it binary)
        cfg = {"version": TASK_CONFIG_VERSION, "job_id": "test-job", "role": "worker",
               "index": i, "spec": spec, "memory_budget_bytes": (bfc_mb or 1024) << 20,
               "report_interval_s": 0.5,
               "agent": {"output_dir": str(tmp_path / "out"), "threads": 1, "device": "CPU"}}
        cfg_path = tmp_path / f"task{i}.json"
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
        env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
        env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
        if bfc_mb:
            env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(bfc_mb))
        env.update(env_extra or {})
        r, w = os.pipe()
        cmd = [sys.executable, "-m", "strata.worker.task", "--config", str(cfg_path), "--events-fd", str(w)]
        if wrap_in_shell:  # a parent we can kill, to see the task notice it
            cmd = ["bash", "-c", " ".join(cmd) + " & wait"]
        log_path = str(tmp_path / f"task{i}.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, pass_fds=(w,), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=wrap_in_shell)
        os.close(w)
        tasks.append(Task(proc, r, log_path))
    return tasks


def check_well_formed(task: Task) -> None:
    assert not task.bad_lines, task.bad_lines
    for e in task.events:
        assert isinstance(e.get("event"), str) and isinstance(e.get("time"), float), e
    times = [e["time"] for e in task.events]
    assert times == sorted(times)


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oom_task(tmp_path_factory):
    """A 1-worker task with a 4 MiB allocator limit, started before the other tests."""
    tmp = tmp_path_factory.mktemp("oom")
    spec = make_spec(workers=1, training={**make_spec()["training"], "epochs": 1})
    [task] = launch(spec, tmp, workers=1, bfc_mb=4)
    yield task
    task.kill()


@pytest.fixture(autouse=True, scope="module")
def _start_oom_early(oom_task):
    yield


def test_two_worker_digits_run(tmp_path):
    tasks = launch(make_spec(), tmp_path, workers=2)
    try:
        rcs = [t.wait() for t in tasks]
    finally:
        for t in tasks:
            t.kill()
    for i, (t, rc) in enumerate(zip(tasks, rcs)):
        assert rc == TASK_EXIT_OK, f"worker {i} exit {rc}; log:\n{t.log()}"
        check_well_formed(t)
        kinds = [e["event"] for e in t.events]
        assert kinds[0] == "started" and kinds[-1] == "result", kinds
        assert kinds.count("first_step") == 1 and "error" not in kinds
        assert kinds.index("first_step") < kinds.index("progress")
        progress = t.of("progress")
        steps = [p["step"] for p in progress]
        total = progress[0]["total_steps"]
        assert total == DIGITS_EPOCHS * (1437 // 256)
        assert steps[0] == 1 and steps[-1] == total and steps == sorted(set(steps))
        for p in progress:
            assert p["total_steps"] == total
            assert isinstance(p["loss"], float) and p["examples_per_sec"] > 0
            assert p["memory"]["peak"] >= p["memory"]["current"] > 0  # BFC is on: real figures
        assert progress[-1]["loss"] < progress[0]["loss"]
        [res] = t.of("result")
        assert res["test_accuracy"] >= 0.90, res
        assert res["test_loss"] > 0 and res["memory"]["peak"] > 0
        assert len(res["weights_sha256"]) == 64
    r0, r1 = tasks[0].of("result")[0], tasks[1].of("result")[0]
    assert r0["weights_sha256"] == r1["weights_sha256"]
    assert r0["test_accuracy"] == r1["test_accuracy"]
    assert r1["model_path"] is None
    path = r0["model_path"]
    assert path == str(tmp_path / "out" / "model.keras") and os.path.isfile(path)
    with zipfile.ZipFile(path) as z:  # a .keras file: zip with config and weights
        names = set(z.namelist())
        assert {"config.json", "model.weights.h5"} <= names, names
        config = json.loads(z.read("config.json"))
    assert [l["config"]["name"] for l in config["config"]["layers"]] == \
        ["input", "hidden_0", "hidden_1", "hidden_2", "logits"]


def test_lambda_model_is_bad_config(tmp_path):
    with open(FIXTURES) as f:
        lam = json.load(f)["bad"]["lambda"]
    [t] = launch(make_spec(workers=1, model={"keras_json": lam}), tmp_path, workers=1)
    rc = t.wait(60)
    assert rc == TASK_EXIT_BAD_CONFIG, t.log()
    [err] = t.of("error")
    assert err["kind"] == "bad_config"
    assert "Lambda" in err["message"] and "model.keras_json" in err["message"]
    check_well_formed(t)


@pytest.mark.parametrize("over,field", [
    ({"strategy": "async_magic"}, "strategy"),
    ({"memory": {"per_task_budget": "", "mixed_precision": "none", "recompute": True}},
     "memory.recompute"),
    ({"data": {"source": "npz", "path": "/nonexistent/data.npz", "batch_size": 64, "examples": 0}},
     "data.path"),
])
def test_unrunnable_configs_are_bad_config(tmp_path, over, field):
    [t] = launch(make_spec(workers=1, **over), tmp_path, workers=1)
    assert t.wait(60) == TASK_EXIT_BAD_CONFIG, t.log()
    [err] = t.of("error")
    assert err["kind"] == "bad_config" and err["message"].startswith(field + ":"), err


def test_task_over_its_memory_budget_exits_75(oom_task):
    rc = oom_task.wait()
    assert rc == TASK_EXIT_OOM, oom_task.log()
    check_well_formed(oom_task)
    assert oom_task.events[-1]["event"] == "error"
    err = oom_task.events[-1]
    assert err["kind"] == "oom" and "4 MiB" in err["message"], err
    assert not oom_task.of("result")


def test_task_exits_when_its_parent_dies(tmp_path):
    # TF_CONFIG names two workers but only one starts: the task blocks in the cluster
    # rendezvous; when its parent (a shell standing in for the agent) is killed, the task
    # must notice and exit by itself.
    [task] = launch(make_spec(), tmp_path, workers=2, wrap_in_shell=True, only=[0])
    shell = task.proc
    child = _wait_for_child(shell.pid, timeout=20)
    assert child, "the task process did not start"
    time.sleep(float(os.environ.get("STRATA_TEST_ORPHAN_DELAY_S", "4.0")))
    shell.kill()
    shell.wait(timeout=10)
    deadline = time.time() + 15
    while time.time() < deadline and _alive(child):
        time.sleep(0.1)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive, "the orphaned task process did not exit within 15 s"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for_child(ppid: int, timeout: float) -> int | None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(f"/proc/{ppid}/task/{ppid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        if kids:
            return kids[0]
        time.sleep(0.05)
    return None
