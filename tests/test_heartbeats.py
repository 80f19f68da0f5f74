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


def _cluster_server(handlers: dict, threads: int) -> tuple[grpc.Server, str]:
    """A real gRPC server started on loopback with ``handlers`` as ClusterService's methods,
    and its address."""
    server = grpc.server(futures.ThreadPoolExecutor(threads))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "strata.v1.ClusterService", handlers),))
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    return server, address


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
        self.server, address = _cluster_server(handlers, 4)
        self.channel = grpc.insecure_channel(address)
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


class _Coordinator:
    """A real gRPC server with the calls an agent's loops make: RegisterAgent (a heartbeat
    every ``interval_s``), Heartbeats (each one's arrival kept), Connect (no commands) and
    AppendLogs, which takes ``append_s`` and fails its first ``fail_appends`` calls."""

    def __init__(self, interval_s: float, append_s: float, fail_appends: int = 0):
        self.beats: list[float] = []
        self.chunks: list[bytes] = []
        self.closing = threading.Event()
        self._fail = fail_appends

        def register(request, context):
            return pb.RegisterAgentResponse(session="s1", heartbeat_interval_s=interval_s)

        def heartbeats(requests, context):
            for _ in requests:
                self.beats.append(time.monotonic())
                yield pb.HeartbeatResponse()

        def connect(request, context):
            self.closing.wait(30)
            return iter(())

        def append(request, context):
            if self._fail:
                self._fail -= 1
                time.sleep(append_s)
                context.abort(grpc.StatusCode.UNAVAILABLE, "not now")
            self.chunks.append(request.data)
            time.sleep(append_s)
            return pb.AppendLogsResponse()

        def unary(fn, req, resp):
            return grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=req.FromString, response_serializer=resp.SerializeToString)
        handlers = {
            "RegisterAgent": unary(register, pb.RegisterAgentRequest, pb.RegisterAgentResponse),
            "AppendLogs": unary(append, pb.AppendLogsRequest, pb.AppendLogsResponse),
            "Heartbeats": grpc.stream_stream_rpc_method_handler(
                heartbeats, request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.HeartbeatResponse.SerializeToString),
            "Connect": grpc.unary_stream_rpc_method_handler(
                connect, request_deserializer=pb.ConnectRequest.FromString,
                response_serializer=pb.AgentCommand.SerializeToString)}
        self.server, self.address = _cluster_server(handlers, 8)

    def close(self):
        self.closing.set()
        self.server.stop(0)


def _agent_with_logs(address: str, work_dir: str, data: bytes):
    from strata.worker.agent import Agent, AgentConfig
    from strata.worker.taskprocess import TaskProcess

    agent = Agent(AgentConfig(coordinator=address, name="w", budget_bytes=GiB,
                              work_dir=work_dir))
    task = TaskProcess(agent, pb.StartTask(job_id="j", role="worker", index=0, attempt=1))
    task._log_buf += data
    agent.tasks[task.key] = task
    return agent, task


def test_slow_log_sends_do_not_hold_up_the_heartbeats(tmp_path):
    # AppendLogs answering in 2 s: sent from the heartbeat loop, each flush held the next
    # heartbeat for 2 s (5 s with a timeout, per task with logs), past the coordinator's
    # heartbeat timeout with two such tasks. The heartbeats keep their 0.2 s.
    server = _Coordinator(interval_s=0.2, append_s=2.0)
    agent, _ = _agent_with_logs(server.address, str(tmp_path), b"a line\n")
    runner = threading.Thread(target=agent.run, daemon=True)
    try:
        runner.start()
        time.sleep(3.5)
        beats = list(server.beats)
        assert server.chunks == [b"a line\n"]  # the logs did go, while the heartbeats went on
        assert len(beats) >= 8, beats
        assert max(b - a for a, b in zip(beats, beats[1:])) < 1.0, beats
    finally:
        agent.shutdown()
        runner.join(timeout=10)
        server.close()


def test_a_tasks_logs_arrive_in_order_when_two_threads_send_them(tmp_path):
    # The log loop's send fails (the chunk goes back to the front) while the task's end
    # sends too: the second sender waits for the first, so the chunks arrive in order.
    from strata.worker.taskprocess import MAX_LOG_CHUNK

    server = _Coordinator(interval_s=1.0, append_s=0.5, fail_appends=1)
    data = b"".join(bytes([65 + i]) * MAX_LOG_CHUNK for i in range(3))
    agent, task = _agent_with_logs(server.address, str(tmp_path), data)
    agent.session = "s1"
    try:
        first = threading.Thread(target=agent.flush_logs)
        first.start()
        time.sleep(0.1)
        agent.flush_logs(task)
        first.join(timeout=10)
        assert b"".join(server.chunks) == data, [c[:1] for c in server.chunks]
    finally:
        agent.shutdown()
        server.close()
