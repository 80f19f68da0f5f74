"""The floor under `bench/agents_load.py`: a grpc.aio server that answers what the load's
agents call and does nothing else (`bench/agents_load.py --echo` starts it instead of
`strata coordinator`).

    .venv/bin/python bench/echo_coordinator.py --port-file F --http-port-file H

Same proto, same messages, same server options (message sizes, pending-call limits), one
grpc.aio server on one event loop, as the coordinator. RegisterAgent answers a session;
Connect holds its stream open, sending nothing; Heartbeat and Heartbeats answer each
heartbeat with an empty answer; SubmitJob and CancelJob answer a job at once; ListWorkers answers none. No
store, no ticks, no token checks, no metrics (`/metrics` is served empty). What the load
measures against it is what gRPC and Python on this machine cost, with no coordinator: the
least `strata coordinator` could reach here.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
from typing import Any, AsyncIterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from strata.coordinator.service import server_options  # noqa: E402
from strata.protos import strata_pb2 as pb  # noqa: E402
from strata.protos import strata_pb2_grpc as pb_grpc  # noqa: E402

IDS = itertools.count()


class Cluster(pb_grpc.ClusterServiceServicer):
    def __init__(self, stop: asyncio.Event):
        self.stop = stop

    async def RegisterAgent(self, request: pb.RegisterAgentRequest,
                            context: Any) -> pb.RegisterAgentResponse:
        return pb.RegisterAgentResponse(session=f"s{next(IDS)}", heartbeat_interval_s=1.0)

    async def Connect(self, request: pb.ConnectRequest,
                      context: Any) -> AsyncIterator[pb.AgentCommand]:
        await self.stop.wait()
        return
        yield  # an async generator that sends nothing

    async def Heartbeat(self, request: pb.HeartbeatRequest,
                        context: Any) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse()

    async def Heartbeats(self, request_iterator: Any, context: Any) -> None:
        # as the coordinator's handler: grpc.aio's reader/writer API
        while (await context.read()) is not grpc.aio.EOF:
            await context.write(pb.HeartbeatResponse())


class Jobs(pb_grpc.JobServiceServicer):
    async def SubmitJob(self, request: pb.SubmitJobRequest, context: Any) -> pb.Job:
        return pb.Job(id=f"job-{next(IDS)}", name=request.spec.name, state=pb.PENDING)

    async def CancelJob(self, request: pb.CancelJobRequest, context: Any) -> pb.Job:
        return pb.Job(id=request.id, state=pb.CANCELLED)

    async def ListWorkers(self, request: pb.ListWorkersRequest,
                          context: Any) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse()


async def serve(port_file: str, http_port_file: str) -> None:
    stop = asyncio.Event()
    server = grpc.aio.server(options=server_options())
    pb_grpc.add_ClusterServiceServicer_to_server(Cluster(stop), server)
    pb_grpc.add_JobServiceServicer_to_server(Jobs(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()
    web = await asyncio.start_server(http, "127.0.0.1", 0)
    for path, text in ((port_file, f"127.0.0.1:{port}"),
                       (http_port_file, f"http://127.0.0.1:{web.sockets[0].getsockname()[1]}")):
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    web.close()
    await server.stop(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--http-port-file", required=True)
    args = ap.parse_args()
    asyncio.run(serve(args.port_file, args.http_port_file))


if __name__ == "__main__":
    main()
