"""The coordinator's HTTP listener (``--http-listen``): Prometheus metrics and a status page.

- ``/metrics``: Prometheus text format (``prometheus_client``; the per-worker and per-job
  series written by ``SeriesText``, to the same bytes). Names follow its conventions:
  the ``strata_`` prefix, base units (``_bytes``, ``_seconds``), ``_total`` for counters.
- ``/``: the status page, one static HTML file with its script inline (``status.html``; no
  build step). It reads ``/api/state`` every two seconds.
- ``/api/state``: workers and jobs as ``strata workers --json`` / ``strata jobs --json`` show
  them, with each job's recent progress and per-task memory (``coordinator.series``).
- ``/healthz``: ``ok`` while the coordinator serves.

Read only. With ``--auth-tokens`` every path but ``/`` and ``/healthz`` needs a token of a
role that may read jobs (``Authorization: Bearer TOKEN``; Prometheus' ``authorization``
setting sends it); the page asks for one and keeps it in the browser tab's session storage.
Served with the coordinator's TLS certificate when it has one; under ``--tls-client-ca``
every connection must show a client certificate that CA signed (without tokens, the
certificate is the caller, as on gRPC). A tiny HTTP/1.1 server on the
coordinator's own event loop: it reads the coordinator's state there, without locks, into plain
values, and writes the large bodies (``/metrics``, ``/api/state``) from them in a thread, so a
scrape of thousands of agents does not hold heartbeats up. Both are read in steps with the
loop running in between (``snapshot_steps``, ``state_steps``).
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import json
import logging
import os
import ssl
import time
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

import grpc

from strata.auth import Auth, Denied
from strata.coordinator.agents import HeartbeatDelay
from strata.errors import NotFoundError
from strata.types import JobState, WorkerState, job_to_json, worker_to_json

log = logging.getLogger("strata.coordinator.web")

#: the gRPC edge's latencies (``coordinator.rpcguard.rpc`` observes every call)
RPC_REGISTRY = CollectorRegistry()
RPC_SECONDS = Histogram("strata_rpc_duration_seconds", "Time to handle a gRPC call (for a "
                        "streaming call, to its last message)", ["method", "code"],
                        registry=RPC_REGISTRY,
                        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                 2.5, 5.0, 10.0, 30.0, 60.0, float("inf")))
#: how late the coordinator's event loop ran a timer: how long its ready callbacks (gRPC's
#: reads and writes, handlers, ticks) held it up (``service.watch_loop``; calls queued in
#: gRPC behind them wait longer)
LOOP_LATE_SECONDS = Histogram("strata_event_loop_late_seconds", "How late the coordinator's "
                              "event loop ran a timer set every 50 ms: the time ready work "
                              "kept a call waiting", registry=RPC_REGISTRY,
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                       float("inf")))
QUEUE_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)
#: finished jobs shown on the page (newest first), besides the unfinished ones it shows
RECENT_JOBS = 20
#: workers or jobs ``/api/state`` reads between two turns of the loop (about 5 ms of work),
#: and unfinished jobs ``/metrics`` reads
STATE_STEP = 200
#: workers whose rows ``/metrics`` and ``/api/state`` read between two turns of the loop
#: (about 2 ms of work)
SNAPSHOT_STEP = 1000
#: workers and unfinished jobs the status page shows at most (``state_steps``)
SHOWN_WORKERS = 200
SHOWN_JOBS = 100
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 10.0
PAGE = os.path.join(os.path.dirname(__file__), "status.html")


def snapshot_steps(coord: Any, out: dict[str, Any]) -> Iterator[None]:
    """Fills ``out`` with what ``/metrics`` shows, read on the coordinator's loop as plain
    values; ``families`` and ``series`` make the metrics of it, and the text is written, in
    a thread. It yields after the job counts, after every ``STATE_STEP`` unfinished jobs and
    after every ``SNAPSHOT_STEP`` workers, and the listener lets the loop run there: at
    5,000 agents and 3,000 unfinished jobs the whole is 12-17 ms, and Prometheus scrapes
    every 15 s. Each job and worker is as it was at its step (a worker's busy or ready as at
    the first worker step); one that went away meanwhile is left out."""
    jobs = coord.jobs.summaries()
    delay, calls = coord.heartbeat_delay, coord.call_wait
    states: dict[JobState, int] = {}
    for j in jobs:
        states[j.state] = states.get(j.state, 0) + 1
    live_ids = [j.id for j in jobs if not j.state.final]
    out.update(job_states=states, restarts=sum(j.restarts for j in jobs),
               waited=[j.started_at - j.created_at for j in jobs
                       if j.started_at and j.started_at >= j.created_at],
               live=[], workers=[], heartbeat_wait=delay.estimate(coord.clock()),
               delay_counts=list(delay.counts), delay_total=delay.total,
               call_wait=calls.estimate(time.monotonic()), probes=(calls.answers, calls.refusals),
               disk=coord.disk_status())
    yield
    yield from jobs_steps(coord, live_ids, lambda j: out["live"].append(
        (j.id, j.name, j.metrics.step, j.metrics.total_steps, j.metrics.loss,
         j.metrics.examples_per_sec or 0.0, j.restarts)))
    yield from worker_rows_steps(coord, out["workers"])


def jobs_steps(coord: Any, ids: list[str], each: Callable[[Any], None]) -> Iterator[None]:
    """``each`` called with every job of ``ids`` still held (one deleted meanwhile is left
    out), ``STATE_STEP`` jobs at a time, yielding after each part."""
    for i in range(0, len(ids), STATE_STEP):
        for job_id in ids[i:i + STATE_STEP]:
            try:
                j = coord.get(job_id)
            except NotFoundError:  # deleted since
                continue
            each(j)
        yield


def worker_rows_steps(coord: Any, rows: list[Any]) -> Iterator[None]:
    """Every worker's row (``Coordinator.worker_rows``) added to ``rows``, ``SNAPSHOT_STEP``
    workers at a time, yielding after each part; busy or ready as at the first part."""
    busy, names = coord.busy_workers(), coord.worker_names()
    for i in range(0, len(names), SNAPSHOT_STEP):
        rows += coord.worker_rows(names[i:i + SNAPSHOT_STEP], busy)
        yield


def families(snap: dict[str, Any]) -> Iterator[Any]:
    """The coordinator's state as metric families, from what ``snapshot_steps`` read: pure,
    run off the loop."""
    by_state = GaugeMetricFamily("strata_jobs", "Jobs held, by state", labels=["state"])
    for s in JobState:
        by_state.add_metric([s.value], snap["job_states"].get(s, 0))
    yield by_state
    restarts = CounterMetricFamily("strata_job_restarts", "Restarts of the jobs held, in all",
                                   labels=[])
    restarts.add_metric([], snap["restarts"])
    yield restarts
    waited = sorted(snap["waited"])
    buckets = [(str(b), bisect.bisect_right(waited, b)) for b in QUEUE_BUCKETS]
    buckets.append(("+Inf", len(waited)))
    yield HistogramMetricFamily("strata_job_queue_seconds", "From submit to the first "
                                "training step, of the jobs held that started",
                                buckets=buckets, sum_value=sum(waited))
    disk = snap.get("disk")
    if disk is not None:
        held = GaugeMetricFamily("strata_state_dir_bytes", "What the coordinator's "
                                 "--state-dir holds, by kind", labels=["kind"])
        for kind, n in (("uploads", disk.blobs_bytes), ("outputs", disk.outputs_bytes),
                        ("logs", disk.logs_bytes),
                        ("records", max(0, disk.disk.used_bytes - disk.blobs_bytes
                                        - disk.outputs_bytes - disk.logs_bytes))):
            held.add_metric([kind], n)
        yield held
        yield GaugeMetricFamily("strata_state_dir_free_bytes", "Free on the file system of "
                                "the coordinator's --state-dir (bulk writes stop at "
                                "--disk-reserve)", value=disk.disk.free_bytes)
    workers = snap["workers"]
    by_wstate = GaugeMetricFamily("strata_workers", "Worker agents, by state",
                                  labels=["state"])
    counts = {ws: 0 for ws in WorkerState}
    for row in workers:
        counts[row[2]] += 1
    for ws in WorkerState:
        by_wstate.add_metric([ws.value], counts[ws])
    yield by_wstate
    # what an agent's silence is judged against: the heartbeat timeout plus the longer
    # of these two waits (``Coordinator.tick``)
    yield GaugeMetricFamily(
        "strata_heartbeat_wait_seconds", "Median wait of the heartbeats handled in the "
        "last 2 s, from being sent to being handled", value=snap["heartbeat_wait"])
    cumulative, delay_buckets = 0, []
    for bound, n in zip((*map(str, HeartbeatDelay.BUCKETS), "+Inf"), snap["delay_counts"]):
        cumulative += n
        delay_buckets.append((bound, cumulative))
    yield HistogramMetricFamily(
        "strata_heartbeat_delay_seconds", "How long each heartbeat handled waited, from "
        "being sent to being handled, above the least its agent's heartbeats have waited "
        "(so agents' clocks need not agree)", buckets=delay_buckets,
        sum_value=snap["delay_total"])
    yield GaugeMetricFamily(
        "strata_call_wait_seconds", "How long a new call waits to be answered, as the "
        "coordinator's own probe measures it (the longest in the last 5 s, or the age of "
        "the probe still out)", value=snap["call_wait"])
    probes = CounterMetricFamily("strata_call_probes", "Probe calls to the coordinator's "
                                 "own server, by outcome", labels=["outcome"])
    probes.add_metric(["answered"], snap["probes"][0])
    probes.add_metric(["refused"], snap["probes"][1])
    yield probes


#: a family with a series per worker or per unfinished job: (name, type, help, label names,
#: rows of (label values, value)). Tens of thousands of samples at 5,000 agents, written by
#: ``SeriesText`` rather than ``prometheus_client`` (``series_families`` is the reference).
Series = tuple[str, str, str, tuple[str, ...], list[tuple[tuple[str, ...], float]]]


def series(snap: dict[str, Any]) -> list[Series]:
    """The per-worker and per-job families of what ``snapshot_steps`` read: pure, run off
    the loop."""
    live, workers = snap["live"], snap["workers"]
    job = ("job", "name")
    out: list[Series] = [
        ("strata_job_step", "gauge", "Training step of each unfinished job", job,
         [((j[0], j[1]), j[2]) for j in live]),
        ("strata_job_steps", "gauge", "Steps each unfinished job will train", job,
         [((j[0], j[1]), j[3]) for j in live]),
        ("strata_job_loss", "gauge", "Latest training loss of each unfinished job", job,
         [((j[0], j[1]), j[4]) for j in live if j[4] is not None]),
        ("strata_job_examples_per_second", "gauge", "Training throughput of each unfinished "
         "job", job, [((j[0], j[1]), j[5]) for j in live]),
        ("strata_job_restarts_per_job", "counter", "Restarts of each unfinished job", job,
         [((j[0], j[1]), j[6]) for j in live])]
    figures = (("budget", "Memory budget of each worker"),
               ("reserved", "Memory reserved by the tasks placed on each worker"),
               ("in_use", "Memory in use by each worker's tasks (their allocators)"),
               ("peak", "Peak memory of each worker's tasks"))
    for i, (key, text) in enumerate(figures):
        out.append((f"strata_worker_memory_{key}_bytes", "gauge", text, ("worker", "device"),
                    [((row[0], row[1]), row[3 + i]) for row in workers]))
    return out


def series_families(spec: list[Series]) -> Iterator[Any]:
    """``series`` as ``prometheus_client`` families: what ``SeriesText`` must write."""
    for name, kind, text, labels, rows in spec:
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            name, text, labels=list(labels))
        for values, value in rows:
            family.add_metric(list(values), value)
        yield family


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class SeriesText:
    """Writes ``series`` in Prometheus' text format, as ``generate_latest`` writes their
    ``series_families``, keeping each label set's text from one scrape to the next. Made by
    ``prometheus_client`` the 25,000 samples of 5,000 agents and 1,000 waiting jobs were
    about 150 ms of Python per scrape; in a thread, but holding the interpreter's lock
    against the event loop, and the heartbeats queued behind it set the heartbeat p99
    (docs/benchmarks-log.md)."""

    def __init__(self) -> None:
        self._labels: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}

    def write(self, spec: list[Series]) -> str:
        kept = self._labels
        labels: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
        values: dict[float, str] = {}
        out: list[str] = []
        for name, kind, text, names, rows in spec:
            if kind == "counter":
                name += "_total"
            help_text = text.replace("\\", "\\\\").replace("\n", "\\n")
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
            order = sorted(range(len(names)), key=lambda i: names[i])  # as generate_latest
            for label_values, value in rows:
                key = (names, label_values)
                label_text = kept.get(key)
                if label_text is None:
                    label_text = "{" + ",".join(f'{names[i]}="{_escape(label_values[i])}"'
                                                for i in order) + "}"
                labels[key] = label_text
                value_text = values.get(value)
                if value_text is None:
                    value_text = values[value] = floatToGoString(value)  # type: ignore[no-untyped-call]
                out.append(f"{name}{label_text} {value_text}\n")
        self._labels = labels  # only the label sets still shown are kept
        return "".join(out)


class _Families(Collector):
    """Families already made, as ``generate_latest`` reads a registry."""

    def __init__(self, made: list[Any]):
        self.made = made

    def collect(self) -> Iterator[Any]:
        return iter(self.made)


def metrics_text(snap: dict[str, Any], rpc: list[Any], writer: SeriesText) -> bytes:
    """``/metrics``' body from what ``snapshot_steps`` read and the RPC registry's families:
    off the loop."""
    return generate_latest(_Families([*families(snap), *rpc])) + \
        writer.write(series(snap)).encode()


def state_steps(coord: Any, out: dict[str, Any]) -> Iterator[None]:
    """Fills ``out`` with what the status page shows: how many workers and jobs there are in
    each state (``worker_states``, ``job_states``); up to ``SHOWN_WORKERS`` workers, the busy,
    draining and lost ones first, then the ready ones, each part by name; up to
    ``SHOWN_JOBS`` unfinished jobs, the ones not waiting first, then the waiting, each part
    newest first; and the ``RECENT_JOBS`` latest finished ones, each job with its recent
    progress and per-task memory (``jobs_unfinished``: how many are not finished). It
    yields after the jobs are counted, after every ``SNAPSHOT_STEP`` workers counted and
    after every ``STATE_STEP`` workers or jobs read, and the listener lets the loop run
    there. Each worker and job is as it was at its step; one that went away meanwhile is
    left out.

    Why the bounds: every worker and unfinished job at 5,000 agents and 1,000 waiting jobs
    was 120 ms of Python on the loop and 50 ms in a thread, every 2 s while a page was open,
    and the objects it built kept the young collections busy: heartbeat p99 went from
    15-21 ms to 126-348 ms with one page open (docs/benchmarks-log.md, "An open status page").
    No page shows 5,000 rows usefully either; ``strata workers`` and ``strata jobs`` list
    them all."""
    jobs = sorted(coord.jobs.summaries(), key=lambda s: (s.created_at, s.id), reverse=True)
    job_states: dict[str, int] = {}
    for s in jobs:
        job_states[s.state.value] = job_states.get(s.state.value, 0) + 1
    unfinished = sorted((s for s in jobs if not s.state.final),
                        key=lambda s: s.state == JobState.PENDING)  # stable: newest first
    # sliced before loading: every finished job beyond these stays on disk
    ids = [s.id for s in unfinished[:SHOWN_JOBS]] + \
        [s.id for s in jobs if s.state.final][:RECENT_JOBS]
    out.update(time=time.time(), workers=[], jobs=[], job_states=job_states,
               jobs_unfinished=len(unfinished), worker_states={}, workers_total=0,
               coordinator_disk=dataclasses.asdict(coord.disk_status()))
    yield
    rows: list[Any] = []
    yield from worker_rows_steps(coord, rows)
    worker_states: dict[str, int] = {}
    for row in rows:
        worker_states[row[2].value] = worker_states.get(row[2].value, 0) + 1
    out.update(worker_states=worker_states, workers_total=len(rows))
    chosen = sorted(rows, key=lambda row: (row[2] == WorkerState.READY, row[0]))[:SHOWN_WORKERS]
    names = [row[0] for row in chosen]
    for i in range(0, len(names), STATE_STEP):
        part = {w.name: w for w in coord.list_workers(names[i:i + STATE_STEP])}
        out["workers"] += [worker_to_json(part[n]) for n in names[i:i + STATE_STEP]
                           if n in part]
        yield
    yield from jobs_steps(coord, ids, lambda j: out["jobs"].append(
        {**job_to_json(j), **coord.series.of(j.id)}))


def state_json(coord: Any) -> dict[str, Any]:
    """``state_steps`` in one go."""
    out: dict[str, Any] = {}
    for _ in state_steps(coord, out):
        pass
    return out


@dataclasses.dataclass
class Steps:
    """A body read in steps on the loop (``steps``; the loop runs between them, and there may
    be none), then written (``write``, in a thread)."""
    steps: Iterator[None]
    write: Callable[[], bytes]


class Web:
    def __init__(self, coord: Any, auth: Auth | None):
        self.coord = coord
        self.auth = auth
        #: the per-worker and per-job series' text, kept from one scrape to the next
        self.series_text = SeriesText()
        with open(PAGE, "rb") as f:
            self.page = f.read()

    def _check(self, headers: dict[str, str], cert: bytes | None = None) -> tuple[int, str] | None:
        """None when the caller may read; else the HTTP status and why. The caller is its
        token, or without tokens (mutual TLS) its client certificate (``cert``, DER)."""
        if self.auth is None or not self.auth.enabled:
            return None
        value = headers.get("authorization", "")
        try:  # the page and the metrics read what ListJobs and ListWorkers do
            caller = (self.auth.caller((("authorization", value),)) if self.auth.tokens
                      else self.auth.certificate(cert))
            self.auth.check(caller, "ListJobs")
        except Denied as e:
            return (401 if e.code == grpc.StatusCode.UNAUTHENTICATED else 403, e.message)
        return None

    def route(self, path: str, headers: dict[str, str],
              cert: bytes | None = None) -> tuple[int, str, bytes]:
        """The response to a GET of ``path``, made here and now."""
        code, ctype, made = self._route(path, headers, cert)
        if isinstance(made, Steps):
            for _ in made.steps:
                pass
            made = made.write()
        return code, ctype, made

    def _route(self, path: str, headers: dict[str, str],
               cert: bytes | None = None) -> tuple[int, str, bytes | Steps]:
        """The response to a GET of ``path``. A large body comes as ``Steps``: what is left
        to read (the listener lets the loop run between steps), then a function that writes
        the body from what was read (the listener runs it in a thread, off the loop)."""
        if path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", self.page
        if path == "/healthz":
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if path not in ("/metrics", "/api/state"):
            return 404, "text/plain; charset=utf-8", b"not found\n"
        refused = self._check(headers, cert)
        if refused is not None:
            code, why = refused
            return code, "application/json", json.dumps({"error": why}).encode()
        if path == "/metrics":
            snap: dict[str, Any] = {}
            # prometheus_client's own metrics are read in the thread: they take their locks
            return (200, "text/plain; version=0.0.4; charset=utf-8",
                    Steps(snapshot_steps(self.coord, snap),
                          lambda: metrics_text(snap, list(RPC_REGISTRY.collect()),
                                               self.series_text)))
        state: dict[str, Any] = {}
        return 200, "application/json", Steps(state_steps(self.coord, state),
                                              lambda: json.dumps(state).encode())

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError, ssl.SSLError):
            writer.close()
            return
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, target, _version = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            if method not in ("GET", "HEAD"):
                code, ctype, body = 405, "text/plain; charset=utf-8", b"GET only\n"
            else:
                tls = writer.get_extra_info("ssl_object")
                cert = tls.getpeercert(binary_form=True) if tls is not None else None
                code, ctype, made = self._route(urlsplit(target).path, headers, cert)
                if isinstance(made, Steps):
                    for _ in made.steps:
                        await asyncio.sleep(0)  # heartbeats and the rest run in between
                    made = await asyncio.to_thread(made.write)
                body = made
        except ValueError:
            code, ctype, body = 400, "text/plain; charset=utf-8", b"bad request\n"
        except Exception:  # noqa: BLE001 - never take the coordinator down
            log.exception("status page")
            code, ctype, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden",
                  404: "Not Found", 405: "Method Not Allowed"}.get(code, "Error")
        writer.write((f"HTTP/1.1 {code} {reason}\r\nContent-Type: {ctype}\r\n"
                      f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
                      "X-Content-Type-Options: nosniff\r\n"
                      "Content-Security-Policy: default-src 'self'; script-src 'unsafe-inline';"
                      " style-src 'unsafe-inline'\r\nConnection: close\r\n\r\n").encode())
        if not head.startswith(b"HEAD"):
            writer.write(body)
        try:
            await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        writer.close()


async def start(listen: str, coord: Any, auth: Auth | None, tls_cert: str = "",
                tls_key: str = "", tls_client_ca: str = "") -> tuple[asyncio.Server, str]:
    """Starts the listener; returns it and the bound ``scheme://host:port``. With
    ``tls_client_ca`` every connection must show a certificate that CA signed, as gRPC
    callers must: the page is not a way around mutual TLS."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    context = None
    if tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls_cert, tls_key)
        if tls_client_ca:
            context.load_verify_locations(tls_client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    web = Web(coord, auth)
    server = await asyncio.start_server(web.handle, host or None, int(port), ssl=context,
                                        limit=MAX_REQUEST_BYTES)
    bound = server.sockets[0].getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return server, f"{'https' if context else 'http'}://{shown}:{bound}"
