"""The strategy seam: a strategy is one module found through the registry, and nothing else in
the coordinator, agent or task runners names a strategy."""

from __future__ import annotations

import pathlib
import re

import pytest

from strata import convert, strategies
from strata.coordinator.core import Coordinator, StartTaskCommand, StopTaskCommand
from strata.coordinator.store import SqliteStore
from strata.errors import SpecError
from strata.spec import parse_job_spec
from strata.strategies import FailureAction
from strata.types import FailureKind, JobState, TaskReport, TaskState

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [32], "classes": 10}}


def test_builtin_strategies_are_registered_in_order():
    assert strategies.names()[:4] == ["multi_worker_mirrored", "parameter_server", "pipeline",
                                      "hybrid"]
    assert strategies.DEFAULT == "multi_worker_mirrored"
    with pytest.raises(SpecError) as e:
        strategies.get("async_magic")
    assert e.value.field == "strategy"


def test_no_strategy_name_outside_the_strategies_and_the_registry():
    """Strategy names appear quoted only in strata/strategies/ (and in tests and docs)."""
    names = strategies.names()
    pattern = re.compile(r"""["'](%s)["']""" % "|".join(map(re.escape, names)))
    offenders = []
    for d in ("coordinator", "worker", "strata", "protos"):
        for path in (ROOT / d).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("strata", "strategies") or path.name.endswith(("_pb2.py",
                                                                                 "_pb2_grpc.py")):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_a_strategy_owns_its_fields():
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "a", "model": MODEL, "stages": 2})
    assert e.value.field == "stages" and "pipeline and hybrid" in e.value.message
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "a", "model": MODEL, "strategy": "pipeline", "workers": 2})
    assert e.value.field == "workers"
    ps = parse_job_spec({"name": "a", "model": MODEL, "strategy": "parameter_server"})
    assert ps.parameter_servers == 1  # the strategy's default


# --- a new strategy, plugged in by one module ---------------------------------------------------
# This is all a strategy needs (see docs/strategies.md): a Strategy subclass in one module,
# registered. Here it is defined in the test; in the product it is a file in strata/strategies/
# or an installed package's `strata.strategies` entry point.

from strata.strategies.base import EndDecision, Strategy, budget_for  # noqa: E402
from strata.types import JobPlan, TaskPlan  # noqa: E402


class Solo(Strategy):
    """One task trains alone; it may fail once (it 'retries' by carrying on) to show the
    failure policy is the strategy's."""

    name = "solo_for_test"
    lead = ("worker", 0)
    lead_drives = False

    def plan(self, spec, workers, profile):
        estimate = 8 << 20
        return JobPlan(self.name, True, "", (TaskPlan("worker", 0, estimate,
                                                       budget_for(spec, estimate)),), "one task")

    def decide_on_end(self, job, task):
        if task.state == TaskState.SUCCEEDED:
            return EndDecision("solo done")
        return None

    def on_failure(self, job, task):
        return strategies.FailureDecision(FailureAction.FAIL_JOB, "solo gives up")

    runners = {"worker": "tests.no_such_module:run"}  # no task process starts in this test


@pytest.fixture
def solo():
    strategies.register(Solo)
    yield strategies.get(Solo.name)
    strategies.unregister(Solo.name)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_a_new_strategy_plugs_in_with_one_module(solo, tmp_path):
    store = SqliteStore(str(tmp_path / "s.db"))
    clock = Clock()
    coord = Coordinator(store, str(tmp_path), clock=clock, monotonic=clock)
    session = coord.register("a", "127.0.0.1", "CPU", 1 << 30, [5000, 5001], [])
    raw = {"name": "solo", "strategy": Solo.name, "model": MODEL, "training": {"steps": 2}}
    # the spec parser, the planner, placement, the contract and the success rule are generic
    job = coord.submit(raw)
    assert [(t.role, t.index) for t in job.tasks] == [("worker", 0)]
    coord.tick()
    assert job.state == JobState.SCHEDULED
    q = coord.workers["a"].queue
    (start,) = [q.get_nowait() for _ in range(q.qsize())]
    assert isinstance(start, StartTaskCommand)
    assert start.config.spec.strategy == Solo.name and start.config.section is None
    assert convert.task_config_from_proto(convert.task_config_to_proto(start.config)) == start.config
    t = job.tasks[0]
    coord.report("a", session, TaskReport(job.id, "worker", 0, TaskState.RUNNING,
                                          attempt=t.attempt))
    assert job.state == JobState.RUNNING
    coord.report("a", session, TaskReport(job.id, "worker", 0, TaskState.SUCCEEDED,
                                          attempt=t.attempt, test_accuracy=0.5))
    assert job.state == JobState.SUCCEEDED and job.message == "solo done"
    # and its failure policy decides a failure
    job2 = coord.submit(raw)
    coord.tick()
    t2 = job2.tasks[0]
    coord.report("a", session, TaskReport(job2.id, "worker", 0, TaskState.FAILED,
                                          attempt=t2.attempt, failure=FailureKind.EXIT_CODE,
                                          exit_code=1))
    assert job2.state == JobState.FAILED and job2.message == "solo gives up"
    assert not any(isinstance(c, StopTaskCommand) and c.job_id == job.id
                   for c in [q.get_nowait() for _ in range(q.qsize())])
    store.close()


def test_every_runner_a_strategy_names_loads_without_tensorflow():
    """Strategies name their task-side runners (``runners``); the task process loads them
    (``strata.worker.task.load_runner``): each resolves to a function, and loading one does not
    import TensorFlow (the trainers import it when they run)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from strata import strategies\n"
            "from strata.worker.task import load_runner\n"
            "for s in strategies.all_strategies():\n"
            "    for role in s.runners:\n"
            "        assert callable(load_runner(s.runner(role))), (s.name, role)\n"
            "print('tensorflow' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_a_role_a_strategy_does_not_run_and_a_runner_that_does_not_load_are_named():
    from strata.taskconfig import TaskConfigError
    from strata.worker.task import load_runner

    with pytest.raises(TaskConfigError) as e:
        strategies.get("pipeline").runner("ps")
    assert e.value.field == "role" and "chief and worker" in e.value.message
    for path in ("strata.no_such_module:run", "strata.worker.task:no_such_function",
                 "strata.worker.task"):
        with pytest.raises(TaskConfigError) as e:
            load_runner(path)
        assert e.value.field == "strategy" and path in e.value.message
