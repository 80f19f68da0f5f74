"""Many agents against one coordinator, over real gRPC: heartbeat latency, false LOST, submits.

    .venv/bin/python bench/agents_load.py [--agents 1000] [--seconds 30] [--pending 200]
                                          [--finished 800] [--procs 2] [--grid] [--unary]
                                          [--registering 200] [--scrape-every 15]
                                          [--status-page] [--echo] [--keep]

Starts a real `strata coordinator` process and `--agents` simulated agents on grpc.aio in
`--procs` generator processes (`--echo`: against `bench/echo_coordinator.py` instead), fills
it with `--finished` and `--pending` jobs, submits and cancels a job every 200 ms while the
agents heartbeat, and prints JSON: heartbeat and submit latencies, agents LOST at the end
(must be 0), the coordinator's CPU and event-loop lateness, and the views without the
generators' own pauses (`handled_after_ms_*`, `observer_ms_*`). `--keep` keeps the
coordinator's state directory and log.

The load and every printed figure, in detail: docs/benchmarks-log.md, "`bench/agents_load.py`:
the load, and what it prints".
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from strata.protos import strata_pb2 as pb  # noqa: E402
from strata.protos import strata_pb2_grpc as pb_grpc  # noqa: E402
from strata.worker.agent import HEARTBEAT_JITTER, REGISTER_BACKOFF_MAX_S  # noqa: E402

GiB = 1 << 30
REGISTERING = 200
JOB = pb.JobSpec(name="load", strategy="multi_worker_mirrored", workers=1,
                 model=pb.ModelSpec(builtin=pb.BuiltinModel(kind="mlp", input_shape=[64],
                                                            hidden=[16], classes=10)),
                 data=pb.DataSpec(source="digits", batch_size=64),
                 training=pb.TrainingSpec(steps=10))
#: a job no 1 GiB agent can hold: it waits (admitted: one agent of 2 GiB is registered first)
BIG = pb.JobSpec()
BIG.CopyFrom(JOB)
BIG.memory.per_task_budget = "1536MiB"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


async def agent(stub, name: str, budget: int, stop: asyncio.Event, window: list[float],
                lat: list[float], failed: list[int], start_in: float, registered: list[float],
                retries: list[int], args: argparse.Namespace,
                registering: asyncio.Semaphore) -> None:
    await asyncio.sleep(start_in)
    # As `strata worker` does: a short timeout, and again after a jittered backoff that
    # doubles up to REGISTER_BACKOFF_MAX_S. Thousands of agents share one
    # grpc.aio event loop here: with thousands of calls started at once some were never
    # answered and never timed out, so at most --registering (200) are in flight (over
    # all generator processes), each bounded here too.
    backoff = 0.2
    while True:
        try:
            async with registering:
                resp = await asyncio.wait_for(stub.RegisterAgent(pb.RegisterAgentRequest(
                    name=name, host="10.0.0.1", device="CPU", budget_bytes=budget,
                    free_ports=[20000, 20001]), timeout=10), timeout=15)
            break
        except (grpc.aio.AioRpcError, asyncio.TimeoutError) as e:
            if isinstance(e, grpc.aio.AioRpcError) and e.code() not in (
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise  # (CANCELLED: wait_for's own timeout, raised through grpc.aio)
            retries.append(1)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, REGISTER_BACKOFF_MAX_S)
    registered.append(time.monotonic())
    session = resp.session
    stream = stub.Connect(pb.ConnectRequest(name=name, session=session))

    async def drain() -> None:
        try:
            async for _ in stream:
                pass
        except grpc.aio.AioRpcError:
            pass
    reader = asyncio.create_task(drain())
    memory = pb.MemoryStatus(budget_bytes=budget)
    beats = None if args.unary else stub.Heartbeats()  # as worker/heartbeats.py: one stream
    next_at = time.monotonic()
    while not stop.is_set():
        t0 = time.monotonic()
        counted = bool(window) and window[0] <= t0 < window[1]
        request = pb.HeartbeatRequest(name=name, session=session, memory=memory,
                                      free_ports=[20000, 20001], sent_at=time.time())
        try:
            if beats is None:
                r = await stub.Heartbeat(request, timeout=30)
            else:
                await beats.write(request)
                r = await asyncio.wait_for(beats.read(), timeout=30)
            if counted:
                lat.append(time.monotonic() - t0)
            if r.reregister and counted:
                failed.append(1)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            if counted:
                failed.append(1)
            if beats is not None:
                beats.cancel()
                beats = stub.Heartbeats()
        if args.grid:
            next_at += 1.0
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        else:  # as worker/agent.py: the interval after the answer, jittered
            await asyncio.sleep(random.uniform(1 - HEARTBEAT_JITTER, 1 + HEARTBEAT_JITTER))
    if beats is not None:
        beats.cancel()
    stream.cancel()
    reader.cancel()


async def submitter(stub, stop: asyncio.Event, window: tuple[float, float],
                    lat: list[float]) -> None:
    """A job submitted and cancelled every 200 ms; counted are the submits that started in
    the window, as the heartbeats are."""
    while not stop.is_set():
        t0 = time.monotonic()
        job = await stub.SubmitJob(pb.SubmitJobRequest(spec=JOB), timeout=60)
        if window[0] <= t0 < window[1]:
            lat.append(time.monotonic() - t0)
        await stub.CancelJob(pb.CancelJobRequest(id=job.id), timeout=60)
        await asyncio.sleep(0.2)


async def wait_for_file(path: str, deadline_s: float) -> dict:
    deadline = time.monotonic() + deadline_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {os.path.basename(path)} within {deadline_s:g} s")
        await asyncio.sleep(0.1)
    with open(path) as f:
        return json.load(f)


def write_json(path: str, body: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


async def generator(args: argparse.Namespace) -> None:
    """One generator process (``--child I``): its share of the agents, from registration to
    the end of the measured window the parent sets; what it measured goes to a file."""
    d, me = args.dir, args.child
    per = max(1, args.agents_per_channel)
    channels = [grpc.aio.insecure_channel(args.address) for _ in range(-(-args.agents // per))]
    stop = asyncio.Event()
    lat: list[float] = []
    failed: list[int] = []
    registered: list[float] = []
    retries: list[int] = []
    window: list[float] = []  # [start, end) in CLOCK_MONOTONIC, shared by the processes
    registering = asyncio.Semaphore(max(1, args.registering // args.procs))
    spread = min(5.0, args.total / 500)
    lag: list[float] = [0.0]  # the longest this process's own loop was late, from the start
    late_in_window: list[float] = []  # how late each 50 ms timer ran, within the window

    async def watch_loop() -> None:
        while not stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(0.05)
            late = time.monotonic() - t - 0.05
            lag[0] = max(lag[0], late)
            if window and window[0] <= t < window[1]:
                late_in_window.append(late)
    watcher = asyncio.create_task(watch_loop())
    come = time.monotonic()
    tasks = [asyncio.create_task(agent(pb_grpc.ClusterServiceStub(channels[i // per]),
                                       f"sim-{args.offset + i:05d}", GiB, stop, window, lat,
                                       failed, random.random() * spread, registered, retries,
                                       args, registering))
             for i in range(args.agents)]
    deadline = come + 120
    while len(registered) < args.agents and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    write_json(os.path.join(d, f"registered-{me}"), {
        "registered": len(registered), "first": come, "last": max(registered, default=come),
        "retries": len(retries), "loop_late_max": lag[0]})
    times = await wait_for_file(os.path.join(d, "window"), 300)
    # The generator's own pauses count in the latencies it measures: its agents, streams and
    # channels are frozen out of its collector once they are all there.
    gc.collect()
    gc.freeze()
    window[:] = [times["start"], times["end"]]
    await asyncio.sleep(max(0.0, times["start"] - time.monotonic()))
    own0 = time.process_time()
    await asyncio.sleep(max(0.0, times["end"] - time.monotonic()))
    own_cpu = time.process_time() - own0
    await wait_for_file(os.path.join(d, "stop"), 120)
    stop.set()
    ended = await asyncio.gather(*tasks, return_exceptions=True)
    watcher.cancel()
    errors: dict[str, int] = {}
    for e in ended:
        if isinstance(e, BaseException):
            key = (f"{e.code().name}: {e.details()}"[:120] if isinstance(e, grpc.aio.AioRpcError)
                   else type(e).__name__)
            errors[key] = errors.get(key, 0) + 1
    for c in channels:
        await c.close()
    write_json(os.path.join(d, f"result-{me}"), {"lat": lat, "failed": len(failed),
                                                 "cpu": own_cpu, "errors": errors,
                                                 "late": late_in_window})


def scrape(url: str, path: str = "/metrics") -> str:
    """One read of ``path`` on the coordinator's HTTP listener: a scrape of ``/metrics`` as
    Prometheus's, or ``/api/state`` as the status page's (read, not parsed: the parse would
    be this process's cost, not the coordinator's)."""
    with urllib.request.urlopen(url + path, timeout=30) as r:
        body: bytes = r.read()
    return body.decode()


async def status_page(url: str, stop: asyncio.Event, reads: list[float]) -> None:
    """An open status page: ``/api/state`` every 2 s, as status.html reads it."""
    while not stop.is_set():
        t0 = time.monotonic()
        await asyncio.to_thread(scrape, url, "/api/state")
        reads.append(time.monotonic() - t0)
        await asyncio.sleep(2.0)


def histograms(url: str) -> dict[str, dict[float, float]]:
    """The coordinator's histograms ``strata_event_loop_late_seconds`` and
    ``strata_heartbeat_delay_seconds``, their buckets (cumulative): name -> upper bound in
    seconds -> how many at most that."""
    from prometheus_client.parser import text_string_to_metric_families

    names = ("strata_event_loop_late_seconds", "strata_heartbeat_delay_seconds")
    text = scrape(url)
    # Only those two families' lines are parsed. prometheus_client's parser takes ~0.26 s of
    # this process's interpreter for the whole 25,000-sample text at 5,000 agents and 5,000
    # jobs, and the submitter and the observer run here: their answers waited behind it.
    text = "\n".join(line for line in text.splitlines()
                     if line.removeprefix("# HELP ").removeprefix("# TYPE ").startswith(names))
    out: dict[str, dict[float, float]] = {}
    for f in text_string_to_metric_families(text + "\n"):
        if f.name in names:
            out[f.name] = {float(s.labels["le"]): s.value for s in f.samples
                           if s.name.endswith("_bucket")}
    return out


def quantile(buckets: dict[float, float], q: float) -> float:
    """As Prometheus's histogram_quantile: linear within the bucket the quantile falls in
    (the last finite bound where it falls beyond them)."""
    bounds = sorted(buckets)
    if not bounds:
        return float("nan")  # a coordinator without the histogram
    total = buckets[bounds[-1]]
    if total <= 0:
        return 0.0
    rank, below, lower = q * total, 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if b == float("inf"):
                return lower
            return lower + (b - lower) * (rank - below) / max(1e-12, buckets[b] - below)
        below, lower = buckets[b], b
    return lower


async def observe(channel: grpc.aio.Channel, session: str, stop: asyncio.Event,
                  seen: list[tuple[float, float]]) -> None:
    """The observer's heartbeats, ten a second on a channel of its own; each round trip goes
    to ``seen`` as (started, seconds)."""
    beats = pb_grpc.ClusterServiceStub(channel).Heartbeats()
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            await beats.write(pb.HeartbeatRequest(name="observer", session=session,
                                                  sent_at=time.time()))
            await asyncio.wait_for(beats.read(), timeout=30)
            seen.append((t0, time.monotonic() - t0))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            beats.cancel()
            beats = pb_grpc.ClusterServiceStub(channel).Heartbeats()
        await asyncio.sleep(0.1)
    beats.cancel()


async def big_alive(cluster, session: str, stop: asyncio.Event) -> None:
    """The large agent heartbeats too, as an agent does."""
    beats = cluster.Heartbeats()
    while not stop.is_set():
        try:
            await beats.write(pb.HeartbeatRequest(name="big", session=session,
                                                  free_ports=[30001], sent_at=time.time()))
            await asyncio.wait_for(beats.read(), timeout=5)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            beats.cancel()
            beats = cluster.Heartbeats()
        await asyncio.sleep(random.uniform(1 - HEARTBEAT_JITTER, 1 + HEARTBEAT_JITTER))
    beats.cancel()


async def fill_jobs(jobs, args: argparse.Namespace) -> None:
    """The jobs held before the agents come: ``--finished`` cancelled, ``--pending`` + 1 large
    (one runs on the large agent, the others wait)."""
    for _ in range(args.finished):
        j = await jobs.SubmitJob(pb.SubmitJobRequest(spec=JOB), timeout=60)
        await jobs.CancelJob(pb.CancelJobRequest(id=j.id), timeout=60)
    for _ in range(args.pending + 1):
        await jobs.SubmitJob(pb.SubmitJobRequest(spec=BIG), timeout=60)


def start_generators(address: str, args: argparse.Namespace, d: str
                     ) -> tuple[int, list[subprocess.Popen]]:
    """The generator processes, the agents split evenly over them: (how many, the processes)."""
    procs = max(1, min(args.procs, args.agents))
    shares = [args.agents * (i + 1) // procs - args.agents * i // procs for i in range(procs)]
    children = []
    for i, n in enumerate(shares):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(i), "--address",
               address, "--dir", d, "--agents", str(n), "--offset", str(sum(shares[:i])),
               "--total", str(args.agents), "--procs", str(procs), "--agents-per-channel",
               str(args.agents_per_channel), "--registering", str(args.registering)] \
            + ["--grid"] * args.grid + ["--unary"] * args.unary
        children.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": ROOT}))
    return procs, children


@dataclasses.dataclass
class Window:
    """What the parent measured over the window, and what the generators wrote."""

    regs: list[dict]  # each generator's registrations
    register_s: float
    scrapes: int
    page_reads: list[float]
    window_cpu: float  # the coordinator's CPU seconds in the window
    window_s: float
    observed: list[float]  # the observer's round trips started in the window
    late: dict[float, float]  # the coordinator's loop lateness histogram over the window
    delay: dict[float, float]  # its heartbeat delay histogram over the window
    lost: int  # agents the coordinator counts LOST at the end
    results: list[dict]  # each generator's figures


async def measure(args: argparse.Namespace, d: str, procs: int, jobs, stop: asyncio.Event,
                  tasks: list[asyncio.Task], sub_lat: list[float],
                  seen: list[tuple[float, float]], cpu: Callable[[], float],
                  http_url: str) -> Window:
    """Waits for every agent to register, opens the window for the generators, submits and
    scrapes within it, then stops the generators and collects their figures."""
    regs = [await wait_for_file(os.path.join(d, f"registered-{i}"), 300)
            for i in range(procs)]
    register_s = max(r["last"] for r in regs) - min(r["first"] for r in regs)
    start = time.monotonic() + 3.0  # a few seconds to settle
    write_json(os.path.join(d, "window"), {"start": start, "end": start + args.seconds})
    await asyncio.sleep(start - time.monotonic())
    end = start + args.seconds
    tasks.append(asyncio.create_task(submitter(jobs, stop, (start, end), sub_lat)))
    page_reads: list[float] = []
    if args.status_page:
        tasks.append(asyncio.create_task(status_page(http_url, stop, page_reads)))
    # the coordinator's CPU over the measured window only; its scrapes of /metrics are in
    # the window, as Prometheus's would be
    cpu0, t0 = cpu(), time.monotonic()
    hist0 = await asyncio.to_thread(histograms, http_url)
    scrapes = 1
    while args.scrape_every > 0 and start + scrapes * args.scrape_every < end:
        await asyncio.sleep(max(0.0, start + scrapes * args.scrape_every - time.monotonic()))
        await asyncio.to_thread(scrape, http_url)
        scrapes += 1
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    observed = [rt for t, rt in seen if start <= t < end]
    window_cpu, window_s = cpu() - cpu0, time.monotonic() - t0
    hist1 = await asyncio.to_thread(histograms, http_url)
    late, delay = ({le: n - hist0.get(name, {}).get(le, 0.0)
                    for le, n in hist1.get(name, {}).items()}
                   for name in ("strata_event_loop_late_seconds",
                                "strata_heartbeat_delay_seconds"))
    workers = await jobs.ListWorkers(pb.ListWorkersRequest(states=[pb.LOST],
                                                           page_size=1000), timeout=60)
    write_json(os.path.join(d, "stop"), {})
    results = [await wait_for_file(os.path.join(d, f"result-{i}"), 120)
               for i in range(procs)]
    return Window(regs, register_s, scrapes, page_reads, window_cpu, window_s, observed, late,
                  delay, len(workers.workers), results)


def summarize(args: argparse.Namespace, procs: int, w: Window, sub_lat: list[float]) -> dict:
    """The figures printed (docs/benchmarks-log.md, "`bench/agents_load.py`: the load, and what
    it prints", says what each is)."""
    regs, results, late, window_s = w.regs, w.results, w.late, w.window_s
    lat = [x for r in results for x in r["lat"]]
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    beats = len(lat)
    return {"transport": "unary" if args.unary else "stream",
            "schedule": "grid" if args.grid else "after answer", "generators": procs,
            "registered": sum(r["registered"] for r in regs),
            "register_s": round(w.register_s, 1),
            "register_retries": sum(r["retries"] for r in regs),
            "generator_late_s_max": round(max(r["loop_late_max"] for r in regs), 2),
            "heartbeats": beats, "heartbeats_per_s": round(beats / window_s),
            "heartbeats_failed": sum(r["failed"] for r in results),
            "coordinator_cpu_per_s": round(w.window_cpu / window_s, 2),
            "coordinator_cpu_us_per_heartbeat": round(1e6 * w.window_cpu / max(1, beats)),
            # its loop's 50 ms timer over the window: how many ran, and how many ran late
            # (none against --echo: it times nothing)
            "coordinator_loop_wakeups": int(late.get(float("inf"), 0)),
            "coordinator_loop_late_over_ms": {
                str(int(1e3 * le)): int(late.get(float("inf"), 0) - late.get(le, 0))
                for le in (0.05, 0.1, 0.25, 0.5)},
            "generator_cpu_per_s": round(sum(r["cpu"] for r in results) / window_s, 2),
            # the generators' own loops, their 50 ms timer over the window, the same way
            "generator_loop_wakeups": sum(len(r["late"]) for r in results),
            "generator_loop_late_over_ms": {
                str(ms): sum(1 for r in results for x in r["late"] if x > ms / 1e3)
                for ms in (50, 100, 250, 500)},
            "heartbeat_ms_p50": round(1e3 * pct(lat, 0.5), 1),
            "heartbeat_ms_p99": round(1e3 * pct(lat, 0.99), 1),
            "heartbeat_ms_max": round(1e3 * max(lat, default=0.0), 1),
            # the coordinator's own view: sent to handled, over every heartbeat in the window
            # (strata_heartbeat_delay_seconds, interpolated within its buckets)
            "handled_after_ms_p50": round(1e3 * quantile(w.delay, 0.5), 1),
            "handled_after_ms_p99": round(1e3 * quantile(w.delay, 0.99), 1),
            "observer_heartbeats": len(w.observed),
            "observer_ms_p50": round(1e3 * pct(w.observed, 0.5), 1),
            "observer_ms_p99": round(1e3 * pct(w.observed, 0.99), 1),
            "observer_ms_max": round(1e3 * max(w.observed, default=0.0), 1),
            "scrapes": w.scrapes, "status_page_reads": len(w.page_reads),
            "status_page_read_ms_max": round(1e3 * max(w.page_reads, default=0.0), 1),
            "submits": len(sub_lat), "submit_ms_p50": round(1e3 * pct(sub_lat, 0.5), 1),
            "submit_ms_p99": round(1e3 * pct(sub_lat, 0.99), 1),
            "lost_at_end": w.lost, "agents_failed": errors}


async def run(address: str, args: argparse.Namespace, cpu: Callable[[], float],
              http_url: str) -> dict:
    ch = grpc.aio.insecure_channel(address)
    cluster, jobs = pb_grpc.ClusterServiceStub(ch), pb_grpc.JobServiceStub(ch)
    # the one agent that makes the large jobs admissible, holding a large job so they wait
    big = await cluster.RegisterAgent(pb.RegisterAgentRequest(
        name="big", host="10.0.0.2", device="CPU", budget_bytes=2 * GiB,
        free_ports=[30000, 30001]), timeout=60)
    stop = asyncio.Event()
    sub_lat: list[float] = []
    # An observer: one more agent, on a channel of its own in this mostly idle process,
    # heartbeating ten times a second. It registers draining, so nothing is placed on it. Its
    # round trips see the coordinator's side without the generators' own load.
    seen: list[tuple[float, float]] = []  # (started, round trip)
    observer = await cluster.RegisterAgent(pb.RegisterAgentRequest(
        name="observer", host="10.0.0.3", device="CPU", budget_bytes=GiB, draining=True),
        timeout=60)
    observer_ch = grpc.aio.insecure_channel(address)
    tasks = [asyncio.create_task(big_alive(cluster, big.session, stop)),
             asyncio.create_task(observe(observer_ch, observer.session, stop, seen))]
    await fill_jobs(jobs, args)
    d = tempfile.mkdtemp(prefix="strata-load-gen-")
    procs, children = start_generators(address, args, d)
    try:
        w = await measure(args, d, procs, jobs, stop, tasks, sub_lat, seen, cpu, http_url)
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in children:
            c.wait(timeout=30)
        shutil.rmtree(d, ignore_errors=True)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await ch.close()
    await observer_ch.close()
    return summarize(args, procs, w, sub_lat)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--pending", type=int, default=200)
    ap.add_argument("--finished", type=int, default=800)
    ap.add_argument("--agents-per-channel", type=int, default=50)
    ap.add_argument("--status-page", action="store_true",
                    help="an open status page too: /api/state read every 2 s in the window")
    ap.add_argument("--scrape-every", type=float, default=15.0,
                    help="seconds between scrapes of /metrics in the window, as Prometheus's "
                         "scrape_interval (0: only the one as the window opens)")
    ap.add_argument("--unary", action="store_true",
                    help="one Heartbeat call per heartbeat instead of the Heartbeats stream")
    ap.add_argument("--procs", type=int, default=2,
                    help="generator processes the agents are split over")
    ap.add_argument("--grid", action="store_true",
                    help="heartbeat on a fixed 1 s grid instead of 1 s (jittered) after each "
                         "answer as the agent does")
    ap.add_argument("--registering", type=int, default=REGISTERING,
                    help="registrations in flight at most, over all generator processes")
    ap.add_argument("--pin", action="store_true",
                    help="the coordinator on CPU 0 and the generators on CPU 1, as if on two "
                         "hosts that each have a core, instead of all free on every CPU")
    ap.add_argument("--echo", action="store_true",
                    help="against bench/echo_coordinator.py, a grpc.aio server that only answers, "
                         "instead of strata coordinator: the floor gRPC and Python set here")
    ap.add_argument("--keep", action="store_true",
                    help="keep the coordinator's state directory (its log) and print where")
    # a generator process (started by this script)
    ap.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.child >= 0:
        asyncio.run(generator(args))
        return
    if args.pin:
        os.sched_setaffinity(0, {1})  # before any gRPC thread starts: they inherit it
    state = tempfile.mkdtemp(prefix="strata-load-")
    port_file = os.path.join(state, "address")
    http_file = os.path.join(state, "http")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "echo_coordinator.py"), "--port-file",
           port_file, "--http-port-file", http_file] if args.echo else [
        sys.executable, "-m", "strata.cli", "coordinator", "--listen", "127.0.0.1:0",
        "--state-dir", state, "--port-file", port_file, "--max-pending-per-user", "100000",
        "--http-listen", "127.0.0.1:0", "--http-port-file", http_file]
    proc = subprocess.Popen(cmd,
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(state, "log"), "w"),
                            env={**os.environ, "PYTHONPATH": ROOT},
                            preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if args.pin else None)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.exists(port_file) and os.path.exists(http_file)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        address = open(port_file).read().strip()
        out = asyncio.run(run(address, args, lambda: _cpu(proc.pid),
                              open(http_file).read().strip()))
        out = {"coordinator": "echo" if args.echo else "strata", "agents": args.agents,
               "jobs_held": args.finished + args.pending + 1, **out}
        print(json.dumps(out))
        if args.keep:
            print(f"coordinator state and log: {state}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if not args.keep:
            shutil.rmtree(state, ignore_errors=True)


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
