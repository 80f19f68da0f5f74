"""Operating Strata from the command line: wait, delete, retention, logs --tail, validate and
plan without a coordinator, --help of every command, and output piped into head."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from strata.clicommon import EXIT_TIMEOUT
from strata.cliparser import EXAMPLES, build_parser
from strata.types import JobState

JOB = {"name": "op", "workers": 1,
       "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [16], "classes": 10}},
       "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 30}}


def strata(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "strata.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


# --------------------------------------------------------------------------------------------
# pure


def test_every_command_explains_each_flag_its_default_and_one_example():
    import argparse

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == set(EXAMPLES)
    for name, sp in commands.choices.items():
        text = sp.format_help()
        assert "example:\n  strata " + name in text, name
        for action in sp._actions:
            if action.dest == "help":
                continue
            assert action.help, f"strata {name} {action.option_strings or action.dest}"
        # a default worth saying is said
        for action in sp._actions:
            if action.option_strings and action.default not in (None, False, [], "",
                                                                argparse.SUPPRESS):
                assert "default" in sp.formatter_class(prog="x")._get_help_string(action), \
                    (name, action.option_strings)


def test_tail_offset_finds_the_last_lines(tmp_path):
    from strata.coordinator.logs import TAIL_BLOCK_BYTES, JobLogs

    logs = JobLogs(str(tmp_path))
    lines = [f"line {i} ".encode() + b"x" * 50 for i in range(5000)]  # several blocks
    logs.append("j", "worker", 0, b"\n".join(lines) + b"\n")
    path = logs.path("j", "worker", 0)
    assert os.path.getsize(path) > 3 * TAIL_BLOCK_BYTES
    data = open(path, "rb").read()
    for n in (1, 3, 2000):
        assert data[logs.tail_offset("j", "worker", 0, n):] == b"\n".join(lines[-n:]) + b"\n"
    assert logs.tail_offset("j", "worker", 0, 10_000) == 0
    logs.append("k", "worker", 0, b"a\nb\nno newline at the end")
    k = open(logs.path("k", "worker", 0), "rb").read()
    assert k[logs.tail_offset("k", "worker", 0, 2):] == b"b\nno newline at the end"
    assert logs.tail_offset("missing", "worker", 0, 5) == 0


def test_finished_jobs_are_deleted_after_the_retention(env):
    coord, clock, store, tmp_path = env
    coord.retention_s = 3600
    old, new, live = (coord.submit({**JOB, "name": n}) for n in ("old", "new", "live"))
    for job in (old, new):
        coord.cancel(job.id)
        coord.logs.append(job.id, "worker", 0, b"some output\n")
        clock.now += 7200  # old ended two hours before new
    clock.now -= 7199
    coord.tick()
    assert old.id not in coord.jobs and new.id in coord.jobs and live.id in coord.jobs
    assert not os.path.exists(os.path.join(coord.logs.log_dir, old.id))
    assert os.path.exists(os.path.join(coord.logs.log_dir, new.id))
    assert {j.id for j in store.load_jobs()} == {new.id, live.id}
    assert store.events(old.id) == []
    from strata.errors import InvalidTransition, NotFoundError

    with pytest.raises(InvalidTransition, match="cancel it first"):
        coord.delete(live.id)  # still pending
    with pytest.raises(NotFoundError):
        coord.delete(old.id)


# --------------------------------------------------------------------------------------------
# without a coordinator


@pytest.mark.integration
def test_validate_and_plan_offline_need_no_coordinator(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB))
    nowhere = {"STRATA_COORDINATOR": "127.0.0.1:1"}
    r = strata("validate", str(job), env=nowhere)
    assert r.returncode == 0 and "valid" in r.stdout, r.stderr
    r = strata("validate", str(job), "--set", "data.batch_size=0", env=nowhere)
    assert r.returncode == 2 and "data.batch_size" in r.stderr and "Traceback" not in r.stderr
    r = strata("plan", str(job), "--set", "workers=2", "--workers", "2", "--memory-budget",
               "1GiB", "--json", env=nowhere)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["feasible"] and sorted(t["worker"] for t in plan["tasks"]) == ["worker-0",
                                                                              "worker-1"]
    r = strata("plan", str(job), "--set", "workers=2", "--workers", "1", "--memory-budget",
               "1GiB", env=nowhere)
    assert r.returncode == 1 and "cannot hold every task" in r.stdout
    r = strata("plan", str(job), "--workers", "2", env=nowhere)
    assert r.returncode == 2 and "--memory-budget" in r.stderr


def test_validate_reads_local_streamed_data_against_the_model(tmp_path):
    """validate runs the task's own data checks where the data is on this machine: the CSV's
    label column and its number of feature columns against the model's input."""
    csv = tmp_path / "d.csv"
    csv.write_text("a,b,c,label\n" + "".join(f"{i},{i},{i},{i % 2}\n" for i in range(20)))
    job = {"name": "v", "strategy": "multi_worker_mirrored", "workers": 1,
           "model": {"builtin": {"kind": "mlp", "input_shape": [3], "hidden": [8],
                                 "classes": 2}},
           "data": {"source": "csv", "path": str(csv), "label": "label", "batch_size": 8},
           "training": {"steps": 2}}
    path = tmp_path / "job.json"
    path.write_text(json.dumps(job))
    nowhere = {"STRATA_COORDINATOR": "127.0.0.1:1"}
    r = strata("validate", str(path), env=nowhere)
    assert r.returncode == 0 and "valid" in r.stdout, r.stderr
    r = strata("validate", str(path), "--set", "model.builtin.input_shape=[4]", env=nowhere)
    assert r.returncode == 2 and "data.path" in r.stderr and "3 feature columns" in r.stderr \
        and "takes 4 values" in r.stderr, r.stderr
    r = strata("validate", str(path), "--set", "data.label=nope", env=nowhere)
    assert r.returncode == 2 and "data.label" in r.stderr and "no column 'nope'" in r.stderr


# --------------------------------------------------------------------------------------------
# against a cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from strata.local import LocalCluster

    c = LocalCluster(workers=1, state_dir=str(tmp_path_factory.mktemp("operate")), threads=1)
    c.start()
    yield c
    c.stop()


@pytest.mark.integration
def test_wait_logs_tail_delete_and_a_pipe_into_head(cluster, tmp_path):
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(JOB))
    at = ["--coordinator", cluster.address]
    job_id = strata("submit", str(job_file), *at).stdout.strip()
    r = strata("wait", job_id, "--timeout", "0.5", *at)
    assert r.returncode in (0, EXIT_TIMEOUT), r.stderr  # usually still starting
    r = strata("wait", job_id, "--timeout", "240", *at, timeout=300)
    assert r.returncode == 0 and "SUCCEEDED" in r.stdout, r.stdout + r.stderr
    full = strata("logs", job_id, *at).stdout.splitlines()
    assert len(full) > 3
    tail = strata("logs", job_id, "--tail", "2", *at).stdout.splitlines()
    assert tail == full[-2:]
    # the reader goes away after one line: the command ends quietly
    r = subprocess.run(f"{sys.executable} -m strata.cli logs {job_id} --coordinator "
                       f"{cluster.address} | head -1", shell=True, capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.count("\n") == 1 and r.stderr == "", r.stderr
    r = strata("status", job_id, *at)
    assert "created 20" in r.stdout
    # TensorBoard scalars of every task, where `strata status` says
    tb = r.stdout.split("tensorboard --logdir ", 1)[1].split()[0]
    events = [os.path.join(base, f) for base, _, files in os.walk(tb) for f in files
              if f.startswith("events.out.tfevents.")]
    assert events and os.path.basename(os.path.dirname(events[0])) == "worker-0", tb
    data = b"".join(open(e, "rb").read() for e in events)
    for tag in (b"loss", b"examples_per_sec", b"memory/in_use_bytes", b"test/accuracy"):
        assert tag in data, tag
    # a running job is not deleted; a finished one is, with its logs
    running = strata("submit", str(job_file), "--set", "training.steps=100000", *at).stdout.strip()
    r = strata("delete", running, *at)
    assert r.returncode == 1 and "cancel it first" in r.stderr
    strata("cancel", running, *at)
    assert strata("delete", job_id, *at).returncode == 0
    r = strata("status", job_id, *at)
    assert r.returncode == 4
    assert not os.path.exists(os.path.join(cluster.state_dir, "logs", job_id))
    with cluster.client() as c:
        assert job_id not in [j.id for j in c.jobs()]
        c.wait(running, timeout=60)
        assert c.get(running).state == JobState.CANCELLED
