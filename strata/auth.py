"""Bearer tokens with roles: who may call what on the coordinator.

The coordinator reads ``--auth-tokens FILE``: one ``TOKEN ROLE NAME`` per line, ``#`` comments,
reloaded on SIGHUP. Callers send ``authorization: Bearer TOKEN`` as gRPC metadata (so
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
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import re

import grpc

ROLES = ("admin", "submitter", "viewer", "agent")
ENV_TOKEN = "STRATA_TOKEN"
#: tokens shorter than this are guessable
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 512
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")

#: what each role may call, by RPC method name (cluster API: the agent role, checked against
#: the request's agent name as well)
READ = frozenset({"GetJob", "ListJobs", "WatchJob", "ListWorkers"})
SUBMIT = frozenset({"SubmitJob", "PlanJob", "UploadBlob"})
OWN_JOB = frozenset({"CancelJob", "GetLogs", "DownloadOutput", "DeleteJob"})
ADMIN_ONLY = frozenset({"DrainWorker"})
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


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who made a call: the role and NAME of the token it carried."""

    role: str
    name: str

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
    """``TOKEN ROLE NAME`` lines. Raises ``AuthFileError`` naming the line (never the token)."""
    out: dict[bytes, Caller] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3:
            raise AuthFileError(f"{source} line {n}: expected TOKEN ROLE NAME, got "
                                f"{len(parts)} field(s)")
        token, role, name = parts
        if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
            raise AuthFileError(f"{source} line {n}: a token must be {MIN_TOKEN_CHARS}-"
                                f"{MAX_TOKEN_CHARS} characters")
        if role not in ROLES:
            raise AuthFileError(f"{source} line {n}: role {role[:20]!r} is not one of "
                                f"{', '.join(ROLES)}")
        if not _NAME_RE.match(name):
            raise AuthFileError(f"{source} line {n}: name {name[:40]!r}: letters, digits and "
                                "._@- only, at most 128")
        d = _digest(token)
        if d in out:
            raise AuthFileError(f"{source} line {n}: the same token appears twice")
        out[d] = Caller(role, name)
    return out


class Auth:
    """The coordinator's tokens (``None`` path: no authentication, everything open)."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._tokens: dict[bytes, Caller] = {}
        if path:
            self.reload()

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def reload(self) -> int:
        """Reads the file again (SIGHUP). A file that does not parse keeps the old tokens."""
        assert self.path
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read(1 << 22)
        except OSError as e:
            raise AuthFileError(f"--auth-tokens: cannot read {self.path}: {e.strerror}") from None
        self._tokens = parse_tokens(text)
        return len(self._tokens)

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
        return found

    def check(self, caller: Caller | None, method: str, agent_name: str | None = None) -> None:
        """Whether ``caller`` may call ``method`` (as agent ``agent_name`` for the cluster
        API). Raises ``Denied``."""
        if caller is None:
            return
        if method not in ALLOWED.get(caller.role, frozenset()):
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"{caller.name} ({caller.role}) may not call {method}")
        if (caller.role == "agent" and agent_name is not None
                and agent_name != caller.name):
            raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                         f"the token of agent {caller.name} cannot act as agent "
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
