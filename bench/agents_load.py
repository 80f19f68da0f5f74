"""Many agents against one coordinator, over real gRPC: heartbeat latency, false LOST, submits.

    .venv/bin/python bench/agents_load.py [--agents 1000] [--seconds 30] [--pending 200]
                                          [--finished 800] [--unary]

A real `strata coordinator` process (plain text, loopback, heartbeat timeout 10 s) and, in this
process, `--agents` simulated agents on grpc.aio: each registers, opens its command stream
and heartbeats once a second (start times spread over the first seconds) on the Heartbeats
stream as `strata worker` does (`--unary`: one Heartbeat call each). The measure starts
3 s after the last agent registered (`register_s`: from the first agent's start). Agents
are separate hosts, each with its own connection; here `--agents-per-channel` (50) share
one. Before they
come, `--finished` jobs are submitted and cancelled, and `--pending` jobs of 1.5 GiB wait:
one agent of 2 GiB registers first and holds one such job, so they are admissible but find
no room on the 1 GiB agents. While the agents heartbeat, one client submits a job every
200 ms and cancels it.

Prints JSON: heartbeat latency p50/p99/max (ms), heartbeats sent and failed, submit latency
p50/p99 (ms), the agents the coordinator counts LOST at the end (must be 0), and the
coordinator's CPU over the measured window: seconds per wall second and microseconds per
heartbeat (everything it did in the window, divided by the heartbeats); the generator's own
CPU; how many agents registered, how long that took, and the agents that failed, by error.
Both sides share this machine's cores: the load generator's own cost and pauses are in the
latencies it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from strata.protos import strata_pb2 as pb  # noqa: E402
from strata.protos import strata_pb2_grpc as pb_grpc  # noqa: E402

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


async def agent(stub, name: str, budget: int, stop: asyncio.Event, lat: list[float],
                failed: list[int], start_in: float, registered: list[float],
                retries: list[int], unary: bool, registering: asyncio.Semaphore) -> None:
    await asyncio.sleep(start_in)
    # As `strata worker` does: a short timeout, and again. Here all agents share one grpc.aio
    # event loop: with thousands of calls started at once some were never answered and never
    # timed out, so at most REGISTERING registrations are in flight, each bounded here too.
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
    beats = None if unary else stub.Heartbeats()  # as worker/heartbeats.py: one stream
    next_at = time.monotonic()
    while not stop.is_set():
        t0 = time.monotonic()
        request = pb.HeartbeatRequest(name=name, session=session, memory=memory,
                                      free_ports=[20000, 20001])
        try:
            if beats is None:
                r = await stub.Heartbeat(request, timeout=30)
            else:
                await beats.write(request)
                r = await asyncio.wait_for(beats.read(), timeout=30)
            lat.append(time.monotonic() - t0)
            if r.reregister:
                failed.append(1)
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, asyncio.InvalidStateError):
            failed.append(1)
            if beats is not None:
                beats.cancel()
                beats = stub.Heartbeats()
        next_at += 1.0
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    if beats is not None:
        beats.cancel()
    stream.cancel()
    reader.cancel()


async def submitter(stub, stop: asyncio.Event, lat: list[float]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        job = await stub.SubmitJob(pb.SubmitJobRequest(spec=JOB), timeout=60)
        lat.append(time.monotonic() - t0)
        await stub.CancelJob(pb.CancelJobRequest(id=job.id), timeout=60)
        await asyncio.sleep(0.2)


async def run(address: str, args: argparse.Namespace, cpu: Callable[[], float]) -> dict:
    ch = grpc.aio.insecure_channel(address, options=[("grpc.max_concurrent_streams", 100000)])
    cluster, jobs = pb_grpc.ClusterServiceStub(ch), pb_grpc.JobServiceStub(ch)
    # the one agent that makes the large jobs admissible, holding a large job so they wait
    big = await cluster.RegisterAgent(pb.RegisterAgentRequest(
        name="big", host="10.0.0.2", device="CPU", budget_bytes=2 * GiB,
        free_ports=[30000, 30001]), timeout=60)
    stop = asyncio.Event()
    lat: list[float] = []
    failed: list[int] = []
    sub_lat: list[float] = []

    async def big_alive() -> None:  # the large agent heartbeats too
        while not stop.is_set():
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                await asyncio.wait_for(cluster.Heartbeat(pb.HeartbeatRequest(
                    name="big", session=big.session, free_ports=[30001]), timeout=5), 6)
            await asyncio.sleep(1.0)
    tasks = [asyncio.create_task(big_alive())]
    for _ in range(args.finished):
        j = await jobs.SubmitJob(pb.SubmitJobRequest(spec=JOB), timeout=60)
        await jobs.CancelJob(pb.CancelJobRequest(id=j.id), timeout=60)
    for _ in range(args.pending + 1):
        await jobs.SubmitJob(pb.SubmitJobRequest(spec=BIG), timeout=60)
    # agents are separate hosts, each with its own connection: here one channel (one HTTP/2
    # connection) per --agents-per-channel agents rather than one for all
    per = max(1, args.agents_per_channel)
    channels = [grpc.aio.insecure_channel(address) for _ in range(-(-args.agents // per))]
    registered: list[float] = []
    retries: list[int] = []
    registering = asyncio.Semaphore(REGISTERING)
    spread = min(5.0, args.agents / 500)
    come = time.monotonic()
    tasks += [asyncio.create_task(agent(pb_grpc.ClusterServiceStub(channels[i // per]),
                                       f"sim-{i:05d}", GiB, stop, lat, failed,
                                       random.random() * spread, registered, retries,
                                       args.unary, registering))
             for i in range(args.agents)]
    # the measure starts once every agent registered and had a few seconds to settle
    deadline = come + 120
    while len(registered) < args.agents and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    register_s = max(registered, default=come) - come
    await asyncio.sleep(3.0)
    # The generator's own pauses count in the latencies it measures: its agents, streams and
    # channels are frozen out of its collector once they are all there. (Running gcpolicy.py's
    # GcPolicy here as well measured no better: p99 164 and 1,366 ms in two runs.)
    gc.collect()
    gc.freeze()
    lat.clear()
    failed.clear()
    tasks.append(asyncio.create_task(submitter(jobs, stop, sub_lat)))
    # the coordinator's CPU (and this process's) over the measured window only
    cpu0, own0, t0 = cpu(), time.process_time(), time.monotonic()
    await asyncio.sleep(args.seconds)
    window_cpu, window_s, beats = cpu() - cpu0, time.monotonic() - t0, len(lat)
    own_cpu = time.process_time() - own0
    workers = await jobs.ListWorkers(pb.ListWorkersRequest(states=[pb.LOST], page_size=1000),
                                     timeout=60)
    stop.set()
    ended = await asyncio.gather(*tasks, return_exceptions=True)
    errors: dict[str, int] = {}
    for e in ended:
        if isinstance(e, BaseException) and os.environ.get("TRACE"):
            print("failed task", ended.index(e), file=sys.stderr)
        if isinstance(e, BaseException):
            key = (f"{e.code().name}: {e.details()}"[:120] if isinstance(e, grpc.aio.AioRpcError)
                   else type(e).__name__)
            errors[key] = errors.get(key, 0) + 1
    await ch.close()
    for c in channels:
        await c.close()
    return {"transport": "unary" if args.unary else "stream",
            "registered": len(registered), "register_s": round(register_s, 1),
            "register_retries": len(retries),
            "heartbeats": len(lat), "heartbeats_per_s": round(beats / window_s),
            "heartbeats_failed": len(failed),
            "coordinator_cpu_per_s": round(window_cpu / window_s, 2),
            "coordinator_cpu_us_per_heartbeat": round(1e6 * window_cpu / max(1, beats)),
            "generator_cpu_per_s": round(own_cpu / window_s, 2),
            "heartbeat_ms_p50": round(1e3 * pct(lat, 0.5), 1),
            "heartbeat_ms_p99": round(1e3 * pct(lat, 0.99), 1),
            "heartbeat_ms_max": round(1e3 * max(lat, default=0.0), 1),
            "submits": len(sub_lat), "submit_ms_p50": round(1e3 * pct(sub_lat, 0.5), 1),
            "submit_ms_p99": round(1e3 * pct(sub_lat, 0.99), 1),
            "lost_at_end": len(workers.workers), "agents_failed": errors}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--pending", type=int, default=200)
    ap.add_argument("--finished", type=int, default=800)
    ap.add_argument("--agents-per-channel", type=int, default=50)
    ap.add_argument("--unary", action="store_true",
                    help="one Heartbeat call per heartbeat instead of the Heartbeats stream")
    ap.add_argument("--pin", action="store_true",
                    help="the coordinator on CPU 0 and this generator on CPU 1, as if on two "
                         "hosts that each have a core, instead of both free on every CPU")
    args = ap.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {1})  # before any gRPC thread starts: they inherit it
    state = tempfile.mkdtemp(prefix="strata-load-")
    port_file = os.path.join(state, "address")
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "coordinator", "--listen",
                             "127.0.0.1:0", "--state-dir", state, "--port-file", port_file,
                             "--max-pending-per-user", "100000"],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(state, "log"), "w"),
                            env={**os.environ, "PYTHONPATH": ROOT},
                            preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if args.pin else None)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        address = open(port_file).read().strip()
        out = asyncio.run(run(address, args, lambda: _cpu(proc.pid)))
        out = {"agents": args.agents, "jobs_held": args.finished + args.pending + 1, **out}
        print(json.dumps(out))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
