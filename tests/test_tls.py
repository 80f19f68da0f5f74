"""TLS and mutual TLS on the coordinator's channels, with certificates made here: the right CA
and certificate get through; plain text, a wrong CA, a missing or expired client certificate are
refused; plain text off loopback is refused unless --insecure; an agent joins over mutual TLS."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from strata.client import Client, Unavailable
from strata.local import LocalCluster
from strata.tls import ClientTls, TlsError, check_listen, issue, make_cluster_certs, write_pair

pytestmark = pytest.mark.integration  # starts coordinator and agent processes


@pytest.fixture(scope="module")
def mtls(tmp_path_factory):
    c = LocalCluster(workers=1, tls=True, state_dir=str(tmp_path_factory.mktemp("mtls")))
    c.start()  # the agent registers over mutual TLS, or this times out
    yield c
    c.stop()


def test_the_right_ca_and_certificate_get_through(mtls):
    with mtls.client() as c:
        assert [w.state.value for w in c.workers()] == ["READY"]  # the agent joined over mTLS


def test_plain_text_wrong_ca_and_missing_or_expired_certificates_are_refused(mtls, tmp_path):
    p = mtls.tls_paths
    other = make_cluster_certs(str(tmp_path / "other"))  # another cluster's CA
    # an expired client certificate signed by the right CA needs the right CA's key
    from cryptography.hazmat.primitives import serialization
    from cryptography import x509

    with open(p["ca_key"], "rb") as f:
        real_key = serialization.load_pem_private_key(f.read(), None)
    with open(p["ca"], "rb") as f:
        real_ca = x509.load_pem_x509_certificate(f.read())
    expired = write_pair(str(tmp_path), "expired", *issue(real_ca, real_key, "old", client=True,
                                                          days=-1))
    cases = {
        "plain text": ClientTls(),
        "wrong CA": ClientTls(other["ca"], p["client"], p["client_key"]),
        "no client certificate": ClientTls(p["ca"]),
        "certificate of another CA": ClientTls(p["ca"], other["client"], other["client_key"]),
        "expired certificate": ClientTls(p["ca"], expired[0], expired[1]),
    }
    for what, tls in cases.items():
        with Client(mtls.address, timeout=5, tls=tls) as c:
            with pytest.raises(Unavailable):
                c.jobs()
                pytest.fail(f"{what} got through")


def test_plain_text_off_loopback_needs_insecure(tmp_path):
    check_listen("127.0.0.1:50051", tls=False, insecure=False)
    check_listen("localhost:50051", tls=False, insecure=False)
    check_listen("0.0.0.0:50051", tls=True, insecure=False)
    check_listen("0.0.0.0:50051", tls=False, insecure=True)
    with pytest.raises(TlsError, match="--insecure"):
        check_listen("0.0.0.0:50051", tls=False, insecure=False)
    r = subprocess.run([sys.executable, "-m", "strata.cli", "coordinator", "--listen",
                        "0.0.0.0:0", "--state-dir", str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--tls-cert" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "strata.cli", "coordinator", "--listen",
                        "127.0.0.1:0", "--tls-cert", str(tmp_path / "none.crt"), "--tls-key",
                        str(tmp_path / "none.key")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and ("--tls-key" in r.stderr or "--tls-cert" in r.stderr)


def test_strata_certs_makes_a_usable_set(tmp_path):
    out = tmp_path / "certs"
    r = subprocess.run([sys.executable, "-m", "strata.cli", "certs", "--out", str(out), "--host",
                        "coord.example", "--host", "10.1.2.3"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    names = sorted(os.listdir(out))
    assert names == sorted(f"{n}.{e}" for n in ("ca", "server", "agent", "client")
                           for e in ("crt", "key"))
    assert oct(os.stat(out / "ca.key").st_mode & 0o777) == "0o600"
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"coord.example", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    r = subprocess.run([sys.executable, "-m", "strata.cli", "certs", "--out", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--force" in r.stderr  # never replaces a CA silently


def test_without_tokens_certificates_name_callers_and_their_roles(tmp_path):
    """Mutual TLS, no --auth-tokens: a certificate's common name is the caller and its
    organizational unit the role. An agent certificate made for node-a registers node-a only,
    the cluster-wide ``agent`` certificate any name; a user's certificate, or one that carries
    no role (made by another tool, or by an older ``strata certs``), is no agent."""
    import grpc

    from strata.protos import strata_pb2 as pb
    from strata.protos import strata_pb2_grpc as pb_grpc
    from strata.tls import channel, issue, write_pair

    p = make_cluster_certs(str(tmp_path / "certs"),
                           clients=("agent:agent", "node-a:agent", "alice", "root:admin"))
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    ca_cert = x509.load_pem_x509_certificate(open(p["ca"], "rb").read())
    ca_key = serialization.load_pem_private_key(open(p["ca_key"], "rb").read(), None)
    key, cert = issue(ca_cert, ca_key, "node-x", client=True)  # no role
    p["node-x"], p["node-x_key"] = write_pair(str(tmp_path / "certs"), "node-x", key, cert)
    port_file = tmp_path / "address"
    proc = subprocess.Popen([sys.executable, "-m", "strata.cli", "coordinator", "--listen",
                             "127.0.0.1:0", "--state-dir", str(tmp_path / "s"), "--port-file",
                             str(port_file), "--tls-cert", p["server"], "--tls-key",
                             p["server_key"], "--tls-client-ca", p["ca"]],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time

        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        address = port_file.read_text()

        def call(cert: str, method: str, request) -> grpc.StatusCode:
            ch = channel(address, ClientTls(p["ca"], p[cert], p[f"{cert}_key"]))
            try:
                service = (pb_grpc.ClusterServiceStub if method == "RegisterAgent"
                           else pb_grpc.JobServiceStub)
                getattr(service(ch), method)(request, timeout=20)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()
            finally:
                ch.close()

        def register(cert: str, name: str) -> grpc.StatusCode:
            return call(cert, "RegisterAgent", pb.RegisterAgentRequest(
                name=name, host="127.0.0.1", budget_bytes=1 << 30))
        denied = grpc.StatusCode.PERMISSION_DENIED
        assert register("node-a", "node-b") == denied
        assert register("node-a", "node-a") == grpc.StatusCode.OK
        assert register("agent", "node-c") == grpc.StatusCode.OK
        assert register("alice", "alice") == denied      # a user is no agent
        assert register("node-x", "node-x") == denied    # no role: nothing
        jobs = pb.ListJobsRequest()
        assert call("alice", "ListJobs", jobs) == grpc.StatusCode.OK
        assert call("node-a", "ListJobs", jobs) == denied  # an agent reads no jobs
        assert call("node-x", "ListJobs", jobs) == denied
        assert call("alice", "DrainWorker", pb.DrainWorkerRequest(name="node-a")) == denied
        assert call("root", "Revoke", pb.RevokeRequest(name="node-a")) == grpc.StatusCode.OK
        assert register("node-a", "node-a") == grpc.StatusCode.UNAUTHENTICATED  # revoked
        assert call("root", "Revoke", pb.RevokeRequest(name="node-a", restore=True)) \
            == grpc.StatusCode.OK
        assert register("node-a", "node-a") == grpc.StatusCode.OK
    finally:
        proc.terminate()
        proc.wait(timeout=30)
