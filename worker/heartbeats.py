"""An agent's heartbeats, on one long-lived bidirectional stream (``ClusterService.Heartbeats``).

A heartbeat as its own call costs the coordinator about 290 µs of CPU in grpc.aio alone; a
message on an open stream about 80 µs (bench/agents_load.py, docs/benchmarks-log.md). At thousands
of agents that difference is whether the coordinator keeps up.

Each request is answered by one response, in order, so ``send`` is a call in all but name:
it returns the response, or raises ``grpc.RpcError`` within ``timeout_s``. A stream that
failed is closed and the next ``send`` opens a new one. A coordinator without the method
(UNIMPLEMENTED) is sent unary ``Heartbeat`` calls from then on.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator

import grpc

from strata.protos import strata_pb2 as pb

log = logging.getLogger("strata.worker")


class HeartbeatStreamError(grpc.RpcError):
    """The stream failed without a status of its own: no response in time (cancelled here,
    DEADLINE_EXCEEDED), or ended by the coordinator (UNAVAILABLE: it is going away)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class HeartbeatStream:
    """Heartbeats of one agent over ``stub`` (a ``ClusterServiceStub``), one at a time."""

    def __init__(self, stub: Any, timeout_s: float):
        self.stub = stub
        self.timeout_s = timeout_s
        #: the coordinator has no Heartbeats method: one call per heartbeat
        self.unary = False
        self._requests: queue.Queue[pb.HeartbeatRequest | None] | None = None
        self._responses: Any = None  # the call: an iterator of responses, and cancel()
        self._timed_out = threading.Event()

    def send(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        if self.unary:
            return self.stub.Heartbeat(request, timeout=self.timeout_s)
        if self._responses is None:
            self._requests = queue.Queue()
            self._responses = self.stub.Heartbeats(_until_none(self._requests))
        assert self._requests is not None
        self._requests.put(request)
        self._timed_out.clear()
        call = self._responses
        timer = threading.Timer(self.timeout_s, self._expire, args=(call,))
        timer.daemon = True
        timer.start()
        try:
            return next(call)
        except grpc.RpcError as e:
            self.close()
            if self._timed_out.is_set():
                raise HeartbeatStreamError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"no response within {self.timeout_s:g} s") from None
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the coordinator has no heartbeat stream: one call per heartbeat")
                self.unary = True
                return self.stub.Heartbeat(request, timeout=self.timeout_s)
            raise
        except StopIteration:
            self.close()
            raise HeartbeatStreamError(grpc.StatusCode.UNAVAILABLE,
                                       "the coordinator ended the heartbeat stream") from None
        finally:
            timer.cancel()

    def _expire(self, call: Any) -> None:
        self._timed_out.set()
        call.cancel()

    def close(self) -> None:
        """Ends the stream (the next ``send`` opens another)."""
        if self._requests is not None:
            self._requests.put(None)
        if self._responses is not None:
            self._responses.cancel()
        self._requests = self._responses = None


def _until_none(requests: queue.Queue[pb.HeartbeatRequest | None]) -> Iterator[pb.HeartbeatRequest]:
    while (request := requests.get()) is not None:
        yield request
