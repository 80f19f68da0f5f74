"""Bearer tokens with roles: who may call what on the coordinator.

The coordinator reads ``--auth-tokens FILE``: one ``TOKEN ROLE NAME [GROUPS]`` per line, ``#``
comments, reloaded on SIGHUP. ``GROUPS``, comma-separated, are the teams the NAME belongs to (a
queues file's members name them as ``group:NAME``: ``strata.queues``); a NAME's groups are
those of all its lines. Callers send ``authorization: Bearer TOKEN`` as gRPC metadata (so
``grpcurl -H`` works); clients and agents take the token from ``STRATA_TOKEN`` (the token
itself) or ``--token-file``, never from a command-line value (a process list shows those).

Roles:

- ``admin``: everything.
- ``submitter``: submit and plan jobs, upload their files; cancel, read the logs of and download
  its own jobs (its NAME is the owner); read every job's and worker's status.
- ``viewer``: read only (jobs, workers, events).
- ``agent``: the cluster API only, and only as the agent NAME the token is bound to.

No token, or an unknown one: UNAUTHENTICATED. A known token whose role may not call the method,
or that acts on another owner's job or another agent's name: PERMISSION_DENIED. Tokens are
never logged or echoed: the coordinator keeps only their SHA-256, and messages name the
caller by its NAME.

Without tokens, under mutual TLS, certificates name callers instead (``certificate_caller``):
the subject's common name is the NAME and its organizational unit the role, as ``strata certs
--client NAME:ROLE`` makes them. A certificate that carries no role may call nothing: no
certificate a CA signed for something else gets an agent's powers by accident.

A NAME may be revoked (``strata admin revoke``): every token and certificate of that name is
refused from then on, and the coordinator closes the calls they have open.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import os
import re
from typing import Iterable

import grpc

ROLES = ("admin", "submitter", "viewer", "agent")
ENV_TOKEN = "STRATA_TOKEN"
#: tokens shorter than this are guessable
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")

#: what each role may call, by RPC method name (cluster API: the agent role, checked against
#: the request's agent name as well)
READ = frozenset({"GetJob", "ListJobs", "WatchJob", "ListWorkers", "ListQueues"})
SUBMIT = frozenset({"SubmitJob", "PlanJob", "UploadBlob"})
OWN_JOB = frozenset({"CancelJob", "GetLogs", "DownloadOutput", "DeleteJob"})
ADMIN_ONLY = frozenset({"DrainWorker", "Revoke"})
CLUSTER = frozenset({"RegisterAgent", "Heartbeat", "Heartbeats", "Connect", "ReportTask",
                     "AppendLogs", "FetchBlob", "UploadOutput", "DrainAgent"})
ALLOWED: dict[str, frozenset[str]] = {
    "admin": READ | SUBMIT | OWN_JOB | ADMIN_ONLY | CLUSTER,
    "submitter": READ | SUBMIT | OWN_JOB,
    "viewer": READ,
    "agent": CLUSTER,
}


class AuthFileError(ValueError):
    pass


#: the common name of a certificate (role ``agent``) that may act as any agent: the cluster-wide
#: agent certificate ``strata certs`` makes by default
ANY_AGENT_CN = "agent"


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who made a call: the role and NAME of the token (or certificate) it carried, and
    ``key``, what identifies that credential (a token's digest, a certificate's fingerprint):
    what revoking it closes."""

    role: str
    name: str
    key: str = dataclasses.field(default="", compare=False)
    #: an agent credential that may act under any agent name (``ANY_AGENT_CN``)
    any_agent: bool = dataclasses.field(default=False, compare=False)
    #: the groups its line names (``TOKEN ROLE NAME GROUPS``): what queues it is a member of
    groups: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def owns(self, owner: str) -> bool:
        return self.role == "admin" or (bool(owner) and owner == self.name)


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "replace")).digest()


def parse_tokens(text: str, source: str = "--auth-tokens") -> dict[bytes, Caller]:
    """``TOKEN ROLE NAME [GROUPS]`` lines. Raises ``AuthFileError`` naming the line (never the
    token)."""
    out: dict[bytes, Caller] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (3, 4):
            raise AuthFileError(f"{source} line {n}: expected TOKEN ROLE NAME [GROUPS], got "
                                f"{len(parts)} field(s)")
        token, role, name = parts[:3]
        groups = tuple(sorted(set(parts[3].split(",")))) if len(parts) == 4 else ()
        bad = next((g for g in groups if not NAME_RE.match(g)), None)
        if bad is not None:
            raise AuthFileError(f"{source} line {n}: group {bad[:40]!r}: letters, digits and "
                                "._@- only, at most 128, comma-separated")
        if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
            raise AuthFileError(f"{source} line {n}: a token must be {MIN_TOKEN_CHARS}-"
                                f"{MAX_TOKEN_CHARS} characters")
        if role not in ROLES:
            raise AuthFileError(f"{source} line {n}: role {role[:20]!r} is not one of "
                                f"{', '.join(ROLES)}")
        if not NAME_RE.match(name):
            raise AuthFileError(f"{source} line {n}: name {name[:40]!r}: letters, digits and "
                                "._@- only, at most 128")
        d = _digest(token)
        if d in out:
            raise AuthFileError(f"{source} line {n}: the same token appears twice")
        out[d] = Caller(role, name, key="token:" + d.hex()[:32], groups=groups)
    return out


@functools.lru_cache(maxsize=4096)
def certificate_caller(cert: bytes) -> Caller:
    """The caller a client certificate (PEM or DER) names: its common name, the role in its
    organizational unit (``""`` when it carries none of ``ROLES``), and its SHA-256
    fingerprint as the key. Cached: each certificate is parsed once."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    c = (x509.load_pem_x509_certificate(cert) if cert.lstrip().startswith(b"-----")
         else x509.load_der_x509_certificate(cert))
    cns = c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = [str(a.value) for a in c.subject.get_attributes_for_oid(
        NameOID.ORGANIZATIONAL_UNIT_NAME)]
    name = str(cns[0].value) if len(cns) == 1 else ""
    roles = {r for r in ous if r in ROLES}
    # one role, one name that a NAME can be (so it can be revoked): else no role at all
    role = roles.pop() if len(roles) == 1 and NAME_RE.match(name) else ""
    return Caller(role, name, key="cert:" + c.fingerprint(hashes.SHA256()).hex()[:32],
                  any_agent=role == "agent" and name == ANY_AGENT_CN)


class Auth:
    """Who may call: the coordinator's tokens (``path``), else under mutual TLS its callers'
    certificates (``certificates``), else nobody is asked (everything open)."""

    def __init__(self, path: str | None = None, certificates: bool = False):
        self.path = path
        #: no tokens: callers are named by their client certificates (mutual TLS)
        self.certificates = certificates and not path
        self._tokens: dict[bytes, Caller] = {}
        #: NAMEs whose every credential is refused (``strata admin revoke``)
        self.revoked: set[str] = set()
        if path:
            self.reload()

    @property
    def enabled(self) -> bool:
        return bool(self.path) or self.certificates

    @property
    def tokens(self) -> bool:
        return bool(self.path)

    def reload(self) -> set[str]:
        """Reads the file again (SIGHUP). A file that does not parse keeps the old tokens.
        Returns the keys of the credentials that are gone (removed, or given another role or
        name): what the coordinator closes."""
        assert self.path
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 22)
        except OSError as e:
            raise AuthFileError(f"--auth-tokens: cannot read {self.path}: {e.strerror}") from None
        before, self._tokens = self._tokens, parse_tokens(text)
        return {c.key for d, c in before.items() if self._tokens.get(d) != c}

    def __len__(self) -> int:
        return len(self._tokens)

    def groups(self) -> dict[str, tuple[str, ...]]:
        """Each NAME's groups: those of every line of it."""
        out: dict[str, set[str]] = {}
        for c in self._tokens.values():
            out.setdefault(c.name, set()).update(c.groups)
        return {name: tuple(sorted(g)) for name, g in out.items() if g}

    def set_revoked(self, names: Iterable[str]) -> None:
        self.revoked = set(names)

    def _not_revoked(self, who: Caller) -> Caller:
        if who.name in self.revoked:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         f"the credentials of {who.name} were revoked")
        return who

    def certificate(self, cert: bytes | None) -> Caller:
        """The caller a client certificate names (``certificate_caller``), when there are no
        tokens. Raises ``Denied``: no certificate, or one revoked."""
        if not cert:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         "no client certificate: this coordinator names callers by their "
                         "certificates (mutual TLS without --auth-tokens)")
        try:
            who = certificate_caller(bytes(cert))
        except ValueError:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         "the client certificate cannot be read") from None
        return self._not_revoked(who)

    def caller(self, metadata: tuple[tuple[str, str | bytes], ...] | None) -> Caller | None:
        """The caller of a request with this invocation metadata (None when auth is off)."""
        if not self.enabled:
            return None
        token = ""
        for key, value in metadata or ():
            if key == "authorization":
                v = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
                if v[:7].lower() == "bearer ":
                    token = v[7:].strip()
                break
        if not token:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                         "no token: send `authorization: Bearer TOKEN` (STRATA_TOKEN or "
                         "--token-file)")
        d = _digest(token)
        found = None
        for known, who in self._tokens.items():  # every entry compared: no early exit
            if hmac.compare_digest(known, d):
                found = who
        if found is None:
            raise Denied(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        return self._not_revoked(found)

    def check(self, caller: Caller | None, method: str, agent_name: str | None = None) -> None:
        """Whether ``caller`` may call ``method`` (as agent ``agent_name`` for the cluster
        API). Raises ``Denied``."""
        if caller is None:
            return
        if not caller.role:
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"the certificate of {caller.name[:64]!r} carries no Strata role (its "
                         "organizational unit: admin, submitter, viewer or agent): make one "
                         "with `strata certs --client NAME:ROLE`")
        if method not in ALLOWED.get(caller.role, frozenset()):
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"{caller.name} ({caller.role}) may not call {method}")
        if agent_name is not None and agent_name in self.revoked:
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"agent {agent_name[:64]!r} was revoked (strata admin revoke)")
        if (caller.role == "agent" and agent_name is not None
                and agent_name != caller.name and not caller.any_agent):
            what = "certificate" if caller.key.startswith("cert:") else "token"
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"the {what} of agent {caller.name} cannot act as agent "
                         f"{agent_name[:64]!r}")


def read_token(token_file: str | None = None) -> str:
    """A client's or agent's token: ``--token-file`` (its first line), else ``STRATA_TOKEN``;
    empty when neither is given."""
    if token_file:
        try:
            with open(token_file, encoding="utf-8", errors="replace") as f:
                token = f.readline(MAX_TOKEN_CHARS + 2).strip()
        except OSError as e:
            raise ValueError(f"--token-file: cannot read {token_file}: {e.strerror}") from None
        if not token:
            raise ValueError(f"--token-file: {token_file} is empty")
        return token
    return os.environ.get(ENV_TOKEN, "").strip()


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self._md = ("authorization", f"Bearer {token}")

    def _details(self, d):  # noqa: ANN001, ANN202 - grpc's ClientCallDetails
        md = list(d.metadata or []) + [self._md]
        return _Details(d.method, d.timeout, md, d.credentials, d.wait_for_ready,
                        d.compression)

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, it):  # noqa: ANN001, ANN201
        return continuation(self._details(details), it)

    def intercept_stream_stream(self, continuation, details, it):  # noqa: ANN001, ANN201
        return continuation(self._details(details), it)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready,  # noqa: ANN001
                 compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = (credentials, wait_for_ready,
                                                                   compression)


def with_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """``channel`` sending ``authorization: Bearer TOKEN`` on every call (unchanged without a
    token)."""
    return grpc.intercept_channel(channel, _TokenInterceptor(token)) if token else channel
