"""The coordinator's HTTP listener: Prometheus metrics, the status page's state, tokens; then
the real page in headless Chromium against a running job, its memory figures checked against
`strata workers --json`, and a screenshot kept for the README."""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.types import JobState, MemoryStatus, TaskReport, TaskState

GiB = 1 << 30
JOB = {"name": "web", "workers": 1,
       "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [32], "classes": 10}},
       "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 50}}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def running(env):
    coord, clock, store, _ = env
    session = coord.register("w0", "127.0.0.1", "CPU", GiB, [5000, 5001], [], shared_dir="/s")
    job = coord.submit(JOB)
    coord.tick()
    t = job.tasks[0]
    for step in (5, 10):
        clock.now += 2
        coord.report("w0", session, TaskReport(job.id, t.role, t.index, TaskState.RUNNING,
                                               attempt=t.attempt, step=step, total_steps=50,
                                               loss=2.0 / step, examples_per_sec=1000.0,
                                               in_use_bytes=step << 20, peak_bytes=12 << 20))
    return coord, job


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus scrape's samples: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_follow_prometheus_conventions(env):
    from strata.coordinator.web import Web

    coord, job = running(env)
    code, ctype, body = Web(coord, None).route("/metrics", {})
    text = body.decode()
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    samples = _samples(text)
    w0 = (("device", "CPU"), ("worker", "w0"))
    me = (("job", job.id), ("name", "web"))
    assert samples[("strata_jobs", (("state", "RUNNING"),))] == 1
    assert samples[("strata_workers", (("state", "BUSY"),))] == 1
    assert samples[("strata_worker_memory_budget_bytes", w0)] == GiB
    assert samples[("strata_worker_memory_reserved_bytes", w0)] == job.tasks[0].memory_budget_bytes
    assert samples[("strata_worker_memory_in_use_bytes", w0)] == 0  # no heartbeat yet
    assert samples[("strata_job_step", me)] == 10
    assert samples[("strata_job_loss", me)] == pytest.approx(0.2)
    assert samples[("strata_job_examples_per_second", me)] == 1000
    assert samples[("strata_job_restarts_total", ())] == 0
    assert ("strata_job_queue_seconds_bucket", (("le", "+Inf"),)) in samples
    assert samples[("strata_heartbeat_wait_seconds", ())] == 0.0
    assert samples[("strata_call_wait_seconds", ())] == 0.0  # no probe runs in-process
    assert samples[("strata_call_probes_total", (("outcome", "answered"),))] == 0
    assert samples[("strata_heartbeat_delay_seconds_count", ())] == 0
    # the state directory's disk, by kind (the store's own file is the records)
    assert samples[("strata_state_dir_bytes", (("kind", "records"),))] > 0
    assert samples[("strata_state_dir_bytes", (("kind", "uploads"),))] == 0
    assert samples[("strata_state_dir_free_bytes", ())] > 0
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("strata_"), family.name
        for s in family.samples:
            if family.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name
            if "memory" in s.name:
                assert s.name.endswith("_bytes"), s.name
    # two heartbeats, the second handled 0.3 s later than the first was (the first is the floor)
    coord, clock = env[0], env[1]
    session = coord.agents.get("w0").session
    coord.heartbeat("w0", session, MemoryStatus(), [], [5001], sent_at=clock.now - 7.0)
    clock.now += 1.0
    coord.heartbeat("w0", session, MemoryStatus(), [], [5001], sent_at=clock.now - 7.3)
    samples = _samples(Web(coord, None).route("/metrics", {})[2].decode())
    delay = "strata_heartbeat_delay_seconds"
    assert samples[(f"{delay}_bucket", (("le", "0.25"),))] == 1
    assert samples[(f"{delay}_bucket", (("le", "0.5"),))] == 2
    assert samples[(f"{delay}_count", ())] == 2
    assert samples[(f"{delay}_sum", ())] == pytest.approx(0.3, abs=0.01)


def test_large_bodies_are_written_from_what_was_read_on_the_loop(env, monkeypatch):
    """The listener writes `/metrics` and `/api/state` in a thread, so each must be made of
    what was read on the loop: state that changes afterwards (a worker registers, a job's
    step moves) does not show in it, and nothing it reads is the coordinator's own.
    Both are read in steps with the loop running between them: a job deleted meanwhile is
    left out, not an error."""
    from strata.coordinator import web as web_module
    from strata.coordinator.web import Steps, Web

    monkeypatch.setattr(web_module, "STATE_STEP", 1)
    monkeypatch.setattr(web_module, "SNAPSHOT_STEP", 1)
    coord, job = running(env)
    gone = coord.submit({**JOB, "name": "gone"})
    coord.cancel(gone.id)
    later = coord.submit({**JOB, "name": "later"})  # waiting: no tick since
    coord.register("w2", "127.0.0.3", "CPU", GiB, [5003], [], shared_dir="/s")
    web = Web(coord, None)
    _, _, metrics = web._route("/metrics", {})
    _, _, made = web._route("/api/state", {})
    assert isinstance(metrics, Steps) and isinstance(made, Steps)
    next(made.steps)  # which workers and jobs to show is settled; then one a step
    next(metrics.steps)  # the job counts, and which unfinished jobs to read
    coord.delete(gone.id)
    coord.cancel(later.id)
    coord.delete(later.id)
    for _ in made.steps:
        pass
    # the loop ran between each unfinished job and each worker read for /metrics: two jobs
    # (one of them deleted meanwhile) and two workers, a step each
    assert len(list(metrics.steps)) == 4
    state = made.write
    coord.register("w1", "127.0.0.2", "CPU", 2 * GiB, [5002], [], shared_dir="/s")
    t = job.tasks[0]
    coord.report("w0", coord.agents.get("w0").session, TaskReport(
        job.id, t.role, t.index, TaskState.RUNNING, attempt=t.attempt, step=30, total_steps=50))
    samples = _samples(metrics.write().decode())
    assert samples[("strata_workers", (("state", "READY"),))] == 1  # w2
    assert samples[("strata_workers", (("state", "BUSY"),))] == 1  # w0
    assert ("strata_worker_memory_budget_bytes", (("device", "CPU"), ("worker", "w1"))) \
        not in samples
    assert samples[("strata_job_step", (("job", job.id), ("name", "web")))] == 10
    assert not [k for k in samples if ("job", later.id) in k[1]]
    shown = json.loads(state())
    assert [w["name"] for w in shown["workers"]] == ["w0", "w2"]
    assert [j["id"] for j in shown["jobs"]] == [job.id]
    assert shown["jobs"][0]["metrics"]["step"] == 10
    now = _samples(web.route("/metrics", {})[2].decode())
    assert now[("strata_workers", (("state", "READY"),))] == 2
    assert now[("strata_job_step", (("job", job.id), ("name", "web")))] == 30


def test_state_carries_series_and_tokens_guard_everything_but_the_page(env, tmp_path):
    from strata.auth import Auth
    from strata.coordinator.web import Web

    coord, job = running(env)
    code, _, body = Web(coord, None).route("/api/state", {})
    state = json.loads(body)
    (j,) = state["jobs"]
    assert j["id"] == job.id and [p[1] for p in j["progress"]] == [5.0, 10.0]
    assert [p[1] for p in j["memory"]["worker:0"]] == [5 << 20, 10 << 20]
    assert state["workers"][0]["memory"]["budget_bytes"] == GiB
    assert set(state["workers"][0]["disk"]) == {"used_bytes", "free_bytes", "total_bytes"}
    assert state["coordinator_disk"]["disk"]["free_bytes"] > 0
    assert state["coordinator_disk"]["reserve_bytes"] == 256 << 20
    tokens = tmp_path / "tokens"
    tokens.write_text("v" * 20 + " viewer eve\n" + "a" * 20 + " agent w0\n")
    web = Web(coord, Auth(str(tokens)))
    assert web.route("/", {})[0] == 200 and web.route("/healthz", {})[0] == 200
    assert web.route("/metrics", {})[0] == 401
    assert web.route("/api/state", {"authorization": "Bearer " + "x" * 20})[0] == 401
    assert web.route("/api/state", {"authorization": "Bearer " + "a" * 20})[0] == 403
    assert web.route("/metrics", {"authorization": "Bearer " + "v" * 20})[0] == 200
    assert web.route("/nope", {})[0] == 404


def test_the_state_shows_a_bounded_part_busy_workers_and_jobs_not_waiting_first(
        env, monkeypatch):
    """At thousands of workers the page gets a part: the busy, draining and lost workers
    first, the jobs not waiting before the waiting ones, and how many there are of each."""
    from strata.coordinator import web as web_module
    from strata.coordinator.web import state_json

    monkeypatch.setattr(web_module, "SHOWN_WORKERS", 2)
    monkeypatch.setattr(web_module, "SHOWN_JOBS", 1)
    monkeypatch.setattr(web_module, "SNAPSHOT_STEP", 1)  # counted over several steps
    coord, job = running(env)  # w0 busy with it
    for i, name in enumerate(("a", "b", "c")):
        coord.register(name, f"127.0.0.{10 + i}", "CPU", GiB, [6000 + i], [], shared_dir="/s")
    coord.drain("c")
    waiting = coord.submit({**JOB, "name": "waiting"})  # newer, and waiting: no tick since
    state = state_json(coord)
    assert [w["name"] for w in state["workers"]] == ["c", "w0"]
    assert [w["state"] for w in state["workers"]] == ["DRAINING", "BUSY"]
    assert state["workers_total"] == 4
    assert state["worker_states"] == {"BUSY": 1, "READY": 2, "DRAINING": 1}
    assert [j["id"] for j in state["jobs"]] == [job.id]
    assert state["job_states"] == {"RUNNING": 1, "PENDING": 1}
    assert state["jobs_unfinished"] == 2
    monkeypatch.setattr(web_module, "SHOWN_JOBS", 2)
    assert [j["id"] for j in state_json(coord)["jobs"]] == [job.id, waiting.id]


# --------------------------------------------------------------------------------------------
# a real coordinator, a real job, a real browser


def _get(url: str, token: str = "", context=None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.integration
def test_the_listener_serves_tls_and_tokens_with_the_coordinator(tmp_path):
    from strata.local import LocalCluster

    c = LocalCluster(workers=0, tls=True, state_dir=str(tmp_path), http_listen="127.0.0.1:0")
    try:
        c.start_coordinator()
        assert c.http_url.startswith("https://")
        ctx = ssl.create_default_context(cafile=c.tls_paths["ca"])
        # under mutual TLS the page asks for a client certificate, as gRPC does
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            _get(c.http_url + "/healthz", context=ctx)
        ctx.load_cert_chain(c.tls_paths["client"], c.tls_paths["client_key"])
        assert _get(c.http_url + "/healthz", context=ctx) == (200, b"ok\n")
        assert _get(c.http_url + "/metrics", context=ctx)[0] == 401
        code, body = _get(c.http_url + "/metrics", c.admin_token, context=ctx)
        assert code == 200 and b"strata_workers" in body
        # the coordinator times calls to itself through its probe socket, under TLS too
        deadline = time.monotonic() + 20
        answered = 0.0
        while answered < 2 and time.monotonic() < deadline:
            time.sleep(0.25)
            samples = _samples(_get(c.http_url + "/metrics", c.admin_token, context=ctx)[1]
                               .decode())
            answered = samples[("strata_call_probes_total", (("outcome", "answered"),))]
        assert answered >= 2
        # the loop's lateness is timed every 50 ms
        assert samples[("strata_event_loop_late_seconds_count", ())] >= 10
    finally:
        c.stop()


@pytest.mark.integration
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (.ci/run "
                                             "installs it)")
def test_status_page_in_headless_chromium_shows_a_running_job(tmp_path):
    from strata.local import LocalCluster

    c = LocalCluster(workers=2, memory_budget="1GiB", state_dir=str(tmp_path / "cluster"),
                     threads=1, http_listen="127.0.0.1:0")
    c.start()
    try:
        with c.client() as client:
            job = client.submit({**JOB, "workers": 2, "training": {"steps": 100000}})
            deadline = time.monotonic() + 120
            while True:
                j = client.get(job.id)
                if j.state == JobState.RUNNING and j.metrics.step > 20:
                    break
                assert time.monotonic() < deadline and not j.state.final, j.message
                time.sleep(0.5)
            time.sleep(3)  # a few points of loss and memory for the charts
            dom = _chromium(["--dump-dom", c.http_url + "/"], tmp_path)
            workers = json.loads(subprocess.run(
                [sys.executable, "-m", "strata.cli", "workers", "--json", "--coordinator",
                 c.address], capture_output=True, text=True, timeout=60).stdout)
            png = os.path.join(ROOT, "docs", "status-page.png")
            _chromium(["--screenshot=" + png, "--window-size=1280,900",
                       "--hide-scrollbars", c.http_url + "/"], tmp_path)
            client.cancel(job.id)
    finally:
        c.stop()
    assert 'data-loaded="1"' in dom, dom[:2000]
    assert "2 worker(s), 1 job(s) running, 0 waiting<" in dom
    assert f'data-job="{job.id}"' in dom and "RUNNING" in dom
    assert dom.count("<polyline") >= 2  # the loss curve and per-task memory
    rows = {m.group(1): m.group(0) for m in re.finditer(r'<tr data-worker="([^"]+)"[^>]*>', dom)}
    assert set(rows) == {w["name"] for w in workers}
    for w in workers:
        attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', rows[w["name"]]))
        m = w["memory"]
        # budget and reservations do not move while the job runs; in use and peak do
        assert int(attrs["budget"]) == m["budget_bytes"]
        assert int(attrs["reserved"]) == m["reserved_bytes"] > 0
        assert 0 < int(attrs["peak"]) <= m["budget_bytes"]
    assert os.path.getsize(png) > 10_000


def _chromium(args: list[str], tmp_path) -> str:
    profile = tempfile.mkdtemp(dir=tmp_path)
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                        "--disable-quic", "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", "--virtual-time-budget=8000", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_series_keep_one_point_a_second_even_when_reports_come_a_little_faster():
    from strata.coordinator.series import POINTS, Series
    from strata.types import Job, JobMetrics, Task

    s = Series()
    job = Job(id="j", name="j", state=JobState.RUNNING, strategy="x", spec=None,
              metrics=JobMetrics())
    task = Task(job_id="j", role="worker", index=0)
    for i in range(2 * POINTS):
        job.metrics.step, job.metrics.loss = i + 1, 1.0 / (i + 1)
        task.in_use_bytes = i
        s.record(job, task, 1000.0 + 0.98 * i)   # heartbeats slightly under a second apart
    progress = s.of("j")["progress"]
    assert len(progress) == POINTS                # bounded
    times = [p[0] for p in progress]
    assert all(1.0 <= b - a < 2.0 for a, b in zip(times, times[1:]))
    assert progress[-1][1] == 2 * POINTS          # the newest figures are kept
    s.forget("j")
    assert s.of("j") == {"progress": [], "memory": {}}


def test_series_text_is_what_prometheus_client_writes_scrape_after_scrape():
    """The per-worker and per-job series are written by ``SeriesText``, keeping label text
    between scrapes: byte for byte what ``generate_latest`` writes for the same families,
    odd label values, NaN and counters included, as series come, change and go."""
    from prometheus_client import generate_latest

    from strata.coordinator.web import SeriesText, _Families, series, series_families

    def snap(workers, live):
        return {"workers": workers, "live": live}

    odd = 'we"ird\\na\nme ü'
    scrapes = [
        snap([("w0", "CPU", "READY", GiB, 0, 0, 0), ("w-1", "GPU:0", "BUSY", 2 * GiB, GiB, 5, 7)],
             [("j1", odd, 3, 10, float("nan"), 12.5, 1), ("j2", "plain", 0, 0, None, 0.0, 0)]),
        snap([("w-1", "GPU:0", "BUSY", 2 * GiB, 0.5 * GiB, 1e21, 0.1),
              ("w2", odd, "READY", 3, 0, 0, 0)],
             [("j2", "plain", 4, 10, 0.25, 1e-7, 2)]),
        snap([], []),
    ]
    writer = SeriesText()
    for s in scrapes:
        spec = series(s)
        assert writer.write(spec).encode() == generate_latest(_Families(list(series_families(spec))))
