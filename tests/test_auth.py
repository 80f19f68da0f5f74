"""Bearer tokens with roles: every role against every RPC (pure), then the real thing through a
coordinator with --auth-tokens over mutual TLS: no token, an unknown token, the wrong role,
another owner's job, an agent token used for another agent's name."""

from __future__ import annotations

import grpc
import pytest

from strata import auth
from strata.auth import ALLOWED, Auth, AuthFileError, Caller, Denied, parse_tokens
from strata.protos import strata_pb2 as pb

EVERY_RPC = sorted({m.name for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods})
T = "t" * 20


def test_every_rpc_is_in_the_table():
    assert set(EVERY_RPC) == set().union(*ALLOWED.values())


@pytest.mark.parametrize("role", auth.ROLES)
@pytest.mark.parametrize("method", EVERY_RPC)
def test_each_role_against_each_rpc(tmp_path, role, method):
    path = tmp_path / "tokens"
    path.write_text(f"# a comment\n{T}{role} {role} someone-{role}\n")
    a = Auth(str(path))
    caller = a.caller((("authorization", f"Bearer {T}{role}"),))
    assert caller == Caller(role, f"someone-{role}")
    expected = {"admin": True, "viewer": method in auth.READ,
                "submitter": method in auth.READ | auth.SUBMIT | auth.OWN_JOB,
                "agent": method in auth.CLUSTER}[role]
    if expected:
        a.check(caller, method, f"someone-{role}" if method in auth.CLUSTER else None)
    else:
        with pytest.raises(Denied) as e:
            a.check(caller, method)
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_agents_act_only_as_themselves_and_tokens_are_checked(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{T}a agent node-a\n")
    a = Auth(str(path))
    me = a.caller((("authorization", f"Bearer {T}a"),))
    a.check(me, "RegisterAgent", "node-a")
    with pytest.raises(Denied, match="cannot act as agent"):
        a.check(me, "RegisterAgent", "node-b")
    for md in ((), (("authorization", "Basic abc"),), (("authorization", "Bearer nope-" + T),)):
        with pytest.raises(Denied) as e:
            a.caller(md)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "nope" not in e.value.message  # a token is never echoed


@pytest.mark.parametrize("text,needle", [
    ("short admin x\n", "line 1: a token must be"),
    (f"{T} root x\n", "role 'root'"),
    (f"{T} admin\n", "expected TOKEN ROLE NAME"),
    (f"{T} admin a\n{T} viewer b\n", "line 2: the same token"),
    (f"{T} admin bad/name\n", "name 'bad/name'"),
])
def test_bad_token_files_name_the_line_never_the_token(text, needle):
    with pytest.raises(AuthFileError, match=needle) as e:
        parse_tokens(text)
    assert T not in str(e.value)


@pytest.mark.integration
def test_roles_and_owners_through_a_real_coordinator(tmp_path):
    from strata.client import Client, PermissionDenied, Unauthenticated
    from strata.local import LocalCluster

    spec = {"name": "mine", "workers": 1,
            "model": {"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [8],
                                  "classes": 10}},
            "data": {"source": "digits", "batch_size": 64}, "training": {"steps": 1}}
    c = LocalCluster(workers=0, tls=True, state_dir=str(tmp_path))
    try:
        c.start_coordinator()
        tokens = {n: c._new_token(r, n) for n, r in (
            ("alice", "submitter"), ("bob", "submitter"), ("eve", "viewer"),
            ("node-a", "agent"))}
        tls = c.client_tls()

        def client(name: str | None) -> Client:
            return Client(c.address, tls=tls, token=tokens.get(name, "x" * 20) if name else "")
        import time
        time.sleep(0.5)  # the SIGHUP that loads the new tokens
        with client(None) as anon, pytest.raises(Unauthenticated):
            anon.jobs()
        with client("nobody") as unknown, pytest.raises(Unauthenticated):
            unknown.jobs()
        with client("alice") as alice:
            job = alice.submit(spec)
            assert alice.get(job.id).owner == "alice"
        with client("eve") as eve:
            assert [j.id for j in eve.jobs()] == [job.id]  # viewers read
            with pytest.raises(PermissionDenied):
                eve.submit(spec)
            with pytest.raises(PermissionDenied):
                eve.cancel(job.id)
        with client("bob") as bob, pytest.raises(PermissionDenied, match="does not own"):
            bob.cancel(job.id)
        with client("node-a") as agent, pytest.raises(PermissionDenied):
            agent.jobs()  # an agent token is for the cluster API only
        from strata.auth import with_token
        from strata.protos import strata_pb2_grpc as pb_grpc
        from strata.tls import channel
        from strata.worker.heartbeats import HeartbeatStream

        ch = channel(c.address, tls)
        try:
            stub = pb_grpc.ClusterServiceStub(with_token(ch, tokens["node-a"]))
            with pytest.raises(grpc.RpcError) as e:
                stub.RegisterAgent(pb.RegisterAgentRequest(name="node-b", host="127.0.0.1",
                                                           budget_bytes=1 << 30), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            ok = stub.RegisterAgent(pb.RegisterAgentRequest(name="node-a", host="127.0.0.1",
                                                            budget_bytes=1 << 30), timeout=10)
            assert ok.session
            # on the heartbeat stream each message is checked: node-a's token, node-b's name
            beats = HeartbeatStream(stub, timeout_s=10)
            assert not beats.send(pb.HeartbeatRequest(name="node-a", session=ok.session)).reregister
            with pytest.raises(grpc.RpcError) as e:
                beats.send(pb.HeartbeatRequest(name="node-b", session=ok.session))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            beats.close()
        finally:
            ch.close()
        with client("alice") as alice:
            assert alice.cancel(job.id).state.value == "CANCELLED"
        with Client(c.address, tls=tls, token=c.admin_token) as admin:
            assert admin.get(job.id).state.value == "CANCELLED"
    finally:
        c.stop()
