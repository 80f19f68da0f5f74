"""TLS and mutual TLS for every gRPC channel Strata owns, and the certificates for a cluster.

- The coordinator serves TLS with ``--tls-cert``/``--tls-key``; with ``--tls-client-ca`` it
  requires client certificates signed by that CA (mutual TLS).
- Agents and clients verify the coordinator with ``--tls-ca`` (clients also ``STRATA_TLS_CA``)
  and, under mutual TLS, present ``--tls-cert``/``--tls-key`` (``STRATA_TLS_CERT``,
  ``STRATA_TLS_KEY``).
- ``strata certs --out DIR --host NAME ...`` (``make_cluster_certs``) makes a CA, a server
  certificate for the coordinator's names and client certificates for agents and users, with
  Python's ``cryptography``.

Plain text stays the default only on loopback: ``strata coordinator`` refuses a non-loopback
``--listen`` without TLS unless ``--insecure`` (``check_listen``).
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import socket
from typing import Any, Sequence

import grpc

ENV_CA, ENV_CERT, ENV_KEY = "STRATA_TLS_CA", "STRATA_TLS_CERT", "STRATA_TLS_KEY"
#: a certificate file larger than this is not a certificate
MAX_PEM_BYTES = 1 << 20


class TlsError(ValueError):
    """A TLS setting cannot be used; ``flag`` names the flag (or variable) at fault."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag
        self.message = message


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """How a client or an agent reaches the coordinator: the CA that signed its certificate
    (empty: plain text) and, for mutual TLS, this side's certificate and key."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    @classmethod
    def from_env(cls, ca: str | None = None, cert: str | None = None,
                 key: str | None = None) -> "ClientTls":
        """Flags first, then ``STRATA_TLS_CA``/``_CERT``/``_KEY``."""
        return cls(ca=ca or os.environ.get(ENV_CA, ""), cert=cert or os.environ.get(ENV_CERT, ""),
                   key=key or os.environ.get(ENV_KEY, ""))

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    def check(self) -> None:
        if (self.cert or self.key) and not (self.cert and self.key):
            raise TlsError("--tls-cert/--tls-key", "give both the certificate and its key")
        if (self.cert or self.key) and not self.ca:
            raise TlsError("--tls-ca", "a client certificate needs the coordinator's CA too")
        for flag, path in (("--tls-ca", self.ca), ("--tls-cert", self.cert),
                           ("--tls-key", self.key)):
            if path:
                read_pem(path, flag)

    def credentials(self) -> grpc.ChannelCredentials:
        self.check()
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, "--tls-ca"),
            private_key=read_pem(self.key, "--tls-key") if self.key else None,
            certificate_chain=read_pem(self.cert, "--tls-cert") if self.cert else None)


def read_pem(path: str, flag: str) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > MAX_PEM_BYTES:
            raise TlsError(flag, f"{path} is {size} bytes: not a PEM file")
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TlsError(flag, f"cannot read {path}: {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(flag, f"{path} is not a PEM file")
    return data


def channel(address: str, tls: ClientTls, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to the coordinator: TLS when ``tls`` names a CA, plain text otherwise."""
    if tls.enabled:
        return grpc.secure_channel(address, tls.credentials(), options=list(options))
    return grpc.insecure_channel(address, options=list(options))


def server_credentials(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """The coordinator's TLS; with ``client_ca`` every client must present a certificate
    that CA signed."""
    if not (cert and key):
        raise TlsError("--tls-cert/--tls-key", "give both the certificate and its key")
    pair = (read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))
    if client_ca:
        return grpc.ssl_server_credentials([pair], root_certificates=read_pem(
            client_ca, "--tls-client-ca"), require_client_auth=True)
    return grpc.ssl_server_credentials([pair])


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback
                       for a in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def check_listen(listen: str, tls: bool, insecure: bool) -> None:
    """Plain text only on loopback, unless ``--insecure`` says the network is trusted."""
    host = listen.rsplit(":", 1)[0]
    if tls or insecure or is_loopback(host):
        return
    raise TlsError("--listen", f"{listen} is reachable from other hosts, and without TLS every "
                               "job spec, token and task report would cross the network in "
                               "plain text: give --tls-cert and --tls-key (`strata certs` makes "
                               "them), or --insecure on a network you trust")


# --- certificates -----------------------------------------------------------------------------

def _name(common_name: str, role: str = "") -> Any:
    """A subject: the cluster (O), the caller's Strata role (OU, read by ``strata.auth``
    when there are no tokens) and its NAME (CN)."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "strata")]
    if role:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role))
    return x509.Name(attrs + [x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write(path: str, data: bytes, private: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def issue(ca_cert: Any, ca_key: Any, common_name: str, *, server_names: Sequence[str] = (),
          client: bool = False, days: float = 825,
          not_before: datetime.datetime | None = None, role: str = "") -> tuple[Any, Any]:
    """A key and a certificate signed by the CA: for a server (``server_names`` as its
    subject alternative names) or a client (``client``) with its Strata ``role``. ``days``
    may be negative (a certificate already expired, for tests)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    start = not_before or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(
        minutes=5)
    end = start + datetime.timedelta(days=days)
    if end <= start:
        start, end = end - datetime.timedelta(days=1), end
    builder = (x509.CertificateBuilder().subject_name(_name(common_name, role))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(start)
               .not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH]
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_names:
        alts: list[Any] = []
        for n in server_names:
            try:
                alts.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                alts.append(x509.DNSName(n))
        builder = builder.add_extension(x509.SubjectAlternativeName(alts), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_ca(common_name: str = "strata cluster CA", days: float = 3650) -> tuple[Any, Any]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name))
            .issuer_name(_name(common_name)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def write_pair(out: str, name: str, key: Any, cert: Any) -> tuple[str, str]:
    cert_path, key_path = os.path.join(out, f"{name}.crt"), os.path.join(out, f"{name}.key")
    _write(key_path, _pem_key(key), private=True)
    _write(cert_path, _pem_cert(cert))
    return cert_path, key_path


#: the client certificates ``strata certs`` makes when none are named: the cluster-wide agent
#: certificate and the operator's
DEFAULT_CLIENTS = ("agent:agent", "client:admin")
#: the role of a client certificate named without one (``--client NAME``)
DEFAULT_CLIENT_ROLE = "submitter"


def parse_client(text: str) -> tuple[str, str]:
    """``NAME`` or ``NAME:ROLE`` (``strata certs --client``) as (name, role)."""
    from strata.auth import ROLES

    name, _, role = text.partition(":")
    role = role or DEFAULT_CLIENT_ROLE
    if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").replace(
            ".", "").isalnum():
        raise TlsError("--client", f"{name[:64]!r}: a name is letters, digits, '.', '-' and '_'")
    if role not in ROLES:
        raise TlsError("--client", f"{text[:80]!r}: the role is one of {', '.join(ROLES)}")
    return name, role


def make_cluster_certs(out: str, hosts: Sequence[str] = (),
                       clients: Sequence[str] = DEFAULT_CLIENTS) -> dict[str, str]:
    """``ca.crt`` (and ``ca.key``, keep it safe), ``server.crt``/``.key`` for the coordinator
    under ``hosts`` plus localhost and the loopback addresses, and ``NAME.crt``/``.key`` per
    client (``NAME`` or ``NAME:ROLE``, the role a submitter's when not given). Returns the
    paths by name. Existing files are overwritten."""
    os.makedirs(out, exist_ok=True)
    ca_key, ca_cert = make_ca()
    paths: dict[str, str] = {}
    paths["ca"], paths["ca_key"] = write_pair(out, "ca", ca_key, ca_cert)
    names = list(dict.fromkeys([*hosts, "localhost", "127.0.0.1", "::1"]))
    key, cert = issue(ca_cert, ca_key, names[0], server_names=names)
    paths["server"], paths["server_key"] = write_pair(out, "server", key, cert)
    for c in clients:
        name, role = parse_client(c)
        key, cert = issue(ca_cert, ca_key, name, client=True, role=role)
        paths[name], paths[f"{name}_key"] = write_pair(out, name, key, cert)
    return paths
