"""The coordinator's probe of its own server (``CallProbe``): how long a new heartbeat
stream waits to be answered, queued or refused, timed into ``agents.CallWait`` so that agents
are not judged lost while their calls wait."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time

import grpc

from strata.coordinator.agents import CallWait
from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc

log = logging.getLogger("strata.coordinator")

#: how often the coordinator times a call to its own server (``CallProbe``)
PROBE_INTERVAL_S = 0.5
#: a probe call's own limit; the wait counts on as its age meanwhile (``agents.CallWait``)
PROBE_TIMEOUT_S = 300.0


#: a probe call that ended so was not served: refused by a server with too many calls waiting
#: (CANCELLED, RESOURCE_EXHAUSTED), or past its own time limit
REFUSED = (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.DEADLINE_EXCEEDED)


class CallProbe:
    """Opens a ``Heartbeats`` stream to this coordinator's own server every
    ``PROBE_INTERVAL_S``, one at a time, and times its answer into ``wait``
    (``agents.CallWait``): how long an agent whose stream broke waits to be heard, so that
    agents are not judged lost while their calls wait in the queue. A try refused (the
    server sheds calls) is tried again every interval, and the wait counts from the first.

    The method matters: gRPC queues new calls, and refuses them past its limits, method by
    method, so a health check went through at once while heartbeat streams were refused.
    The call goes through a Unix socket the same server also listens on (same queues, same
    event loop), so it needs no credentials under TLS. Every call of the job and cluster
    APIs through that socket is refused before its handler runs (``rpcguard._authorize``),
    and that refusal is the probe's answer; the socket lies in a directory only this user
    may enter (``mkdtemp``). A blocking stub on its own thread: the time it measures is not
    the coordinator's loop measuring itself."""

    def __init__(self, server: grpc.aio.Server, wait: CallWait):
        self.wait = wait
        self._dir = self.path = ""
        self.bound = False
        try:
            self._dir = tempfile.mkdtemp(prefix="strata-probe-")
            self.path = os.path.join(self._dir, "probe.sock")
            # (a socket's path is at most 107 bytes)
            self.bound = len(self.path) < 100 and \
                server.add_insecure_port("unix:" + self.path) != 0
        except (OSError, RuntimeError):
            pass
        if not self.bound:
            log.warning("cannot listen on a Unix socket in %s: calls waiting in the queue "
                        "are not measured, only heartbeats that were handled",
                        self._dir or tempfile.gettempdir())
        self._stop = threading.Event()
        self._channel: grpc.Channel | None = None
        self._thread = threading.Thread(target=self._run, name="strata-call-probe", daemon=True)

    def start(self) -> None:
        if self.bound:
            self._channel = grpc.insecure_channel("unix:" + self.path)
            self._thread.start()

    def _run(self) -> None:
        assert self._channel is not None
        stub = pb_grpc.ClusterServiceStub(self._channel)  # type: ignore[no-untyped-call]
        while not self._stop.is_set():
            self.wait.sent(time.monotonic())
            try:
                next(stub.Heartbeats(iter([pb.HeartbeatRequest()]), timeout=PROBE_TIMEOUT_S))
                self.wait.answered(time.monotonic())
            except grpc.RpcError as e:
                if e.code() in REFUSED:  # the wait runs on from the first try until one is
                    self.wait.refused(time.monotonic())
                elif e.code() == grpc.StatusCode.UNAVAILABLE:
                    self.wait.dropped()  # no server to measure (stopping)
                else:  # answered: PERMISSION_DENIED (``rpcguard``), UNIMPLEMENTED (tests)
                    self.wait.answered(time.monotonic())
            except StopIteration:  # a stream ended without an answer: it was handled
                self.wait.answered(time.monotonic())
            self._stop.wait(PROBE_INTERVAL_S)

    def stop(self) -> None:
        self._stop.set()
        if self._channel is not None:
            self._channel.close()  # ends a call in flight
            self._thread.join(timeout=5.0)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
