"""Agents' heartbeats on one bidirectional stream (worker/heartbeats.py), against a real
coordinator process over real gRPC, and against small real servers that lack the method or never
answer (the fallback and the timeout)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from strata.protos import strata_pb2 as pb
from strata.protos import strata_pb2_grpc as pb_grpc
from strata.worker.heartbeats import HeartbeatStream

pytestmark = pytest.mark.integration
GiB = 1 << 30


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    from strata.local import LocalCluster

    c = LocalCluster(workers=0, state_dir=str(tmp_path_factory.mktemp("beats")))
    c.start_coordinator()
    ch = grpc.insecure_channel(c.address)
    yield pb_grpc.ClusterServiceStub(ch), pb_grpc.JobServiceStub(ch)
    ch.close()
    c.stop()


def register(stub, name: str) -> str:
    return stub.RegisterAgent(pb.RegisterAgentRequest(
        name=name, host="127.0.0.1", budget_bytes=GiB, free_ports=[41000, 41001]),
        timeout=10).session


def worker(jobs, name: str) -> pb.Worker:
    return next(w for w in jobs.ListWorkers(pb.ListWorkersRequest(), timeout=10).workers
                if w.name == name)


def test_heartbeats_on_one_stream_reach_the_coordinator_in_order(coordinator):
    stub, jobs = coordinator
    session = register(stub, "beat-a")
    beats = HeartbeatStream(stub, timeout_s=10)
    try:
        for used in (1, 2, 3):
            r = beats.send(pb.HeartbeatRequest(name="beat-a", session=session,
                                               memory=pb.MemoryStatus(budget_bytes=GiB,
                                                                      in_use_bytes=used << 20),
                                               free_ports=[41000]))
            assert not r.reregister
            assert worker(jobs, "beat-a").memory.in_use_bytes == used << 20
        stream = beats._responses
        # a session the coordinator does not know: told to register again, on the same stream
        assert beats.send(pb.HeartbeatRequest(name="beat-a", session="0" * 16)).reregister
        session = register(stub, "beat-a")
        assert not beats.send(pb.HeartbeatRequest(name="beat-a", session=session)).reregister
        assert beats._responses is stream and not beats.unary
    finally:
        beats.close()


def test_a_refused_message_ends_the_stream_and_the_next_send_opens_another(coordinator):
    stub, jobs = coordinator
    session = register(stub, "beat-b")
    beats = HeartbeatStream(stub, timeout_s=10)
    try:
        with pytest.raises(grpc.RpcError) as e:
            beats.send(pb.HeartbeatRequest(name="beat-b", session=session, free_ports=[0]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "free_ports" in e.value.details()
        assert beats._responses is None
        r = beats.send(pb.HeartbeatRequest(name="beat-b", session=session,
                                           memory=pb.MemoryStatus(in_use_bytes=7 << 20)))
        assert not r.reregister
        assert worker(jobs, "beat-b").memory.in_use_bytes == 7 << 20
    finally:
        beats.close()


class _Server:
    """A real gRPC server offering ClusterService's unary Heartbeat and, when ``stream`` is
    given, a Heartbeats handler of the test's own."""

    def __init__(self, stream=None):
        self.unary_calls = 0

        def unary(request, context):
            self.unary_calls += 1
            return pb.HeartbeatResponse()
        handlers = {"Heartbeat": grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=pb.HeartbeatRequest.FromString,
            response_serializer=pb.HeartbeatResponse.SerializeToString)}
        if stream is not None:
            handlers["Heartbeats"] = grpc.stream_stream_rpc_method_handler(
                stream, request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.HeartbeatResponse.SerializeToString)
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "strata.v1.ClusterService", handlers),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.ClusterServiceStub(self.channel)

    def close(self):
        self.channel.close()
        self.server.stop(0)


def test_a_coordinator_without_the_stream_gets_one_call_per_heartbeat():
    s = _Server()
    beats = HeartbeatStream(s.stub, timeout_s=5)
    try:
        for _ in range(3):
            assert not beats.send(pb.HeartbeatRequest(name="x", session="s")).reregister
        assert beats.unary and s.unary_calls == 3
    finally:
        beats.close()
        s.close()


def test_no_answer_fails_within_the_timeout_and_a_new_stream_follows():
    opened = []
    release = threading.Event()

    def stream(requests, context):
        opened.append(1)
        for i, _ in enumerate(requests):
            if len(opened) == 1:
                release.wait(30)  # the first stream never answers
                return
            yield pb.HeartbeatResponse(reregister=i == 1)
    s = _Server(stream)
    beats = HeartbeatStream(s.stub, timeout_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            beats.send(pb.HeartbeatRequest(name="x"))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - start < 3
        assert [beats.send(pb.HeartbeatRequest(name="x")).reregister for _ in range(2)] \
            == [False, True]
        assert len(opened) == 2 and not beats.unary
    finally:
        release.set()
        beats.close()
        s.close()
