"""A local cluster: one coordinator and N worker agents as child processes of this one.

Used by ``strata up``, ``strata demo`` and the integration tests. Every process started here is
stopped by ``stop()`` (agents first, so they stop their task processes, then the coordinator).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

from strata.client import Client

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM it when the thread that started it dies, so
    a test run or `strata up` killed without its clean-up never leaves a cluster running (the
    agents stop their task processes on SIGTERM). Elsewhere a no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class LocalCluster:
    def __init__(self, workers: int = 2, memory_budget: str = "1GiB", *, state_dir: str | None = None,
                 listen: str = "127.0.0.1:0", threads: int | None = None,
                 heartbeat_timeout_s: float = 10.0, quiet: bool = True, log_dir: str | None = None,
                 allow_user_code: bool = True, shared_dir: str | None = None,
                 tls: bool = False, data_roots: list[str] | None = None,
                 http_listen: str = "", warm_pool: int = 0,
                 coordinator_args: Sequence[str] = ()):
        self.n_workers = workers
        #: more flags for ``strata coordinator`` (limits, quotas)
        self.coordinator_args = list(coordinator_args)
        # one user on loopback: that user's own code may run (``--allow-user-code``)
        self.allow_user_code = allow_user_code
        self.memory_budget = memory_budget
        self._tmp = None
        if state_dir is None:
            self._tmp = tempfile.mkdtemp(prefix="strata-")
            state_dir = self._tmp
        self.state_dir = os.path.abspath(state_dir)
        # one directory every local agent sees: the shared storage of a one-host cluster
        self.shared_dir = os.path.abspath(shared_dir or os.path.join(self.state_dir, "shared"))
        os.makedirs(self.shared_dir, exist_ok=True)
        #: each agent's --warm-pool (0 here by default: tests start processes enough)
        self.warm_pool = warm_pool
        #: the coordinator's --http-listen, and where it serves once started
        self.http_listen = http_listen
        self.http_url = ""
        #: the agents' --data-root (none: unconfined)
        self.data_roots = [os.path.abspath(r) for r in data_roots or []]
        self.listen = listen
        self.threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // max(1, workers))
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.quiet = quiet
        self.log_dir = log_dir or os.path.join(self.state_dir, "process-logs")
        self.address = ""
        self.coordinator: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}
        #: mutual TLS between every process of the cluster, with certificates made for it under
        #: STATE_DIR/tls (``strata.tls``); ``strata up`` turns it on off loopback
        self.tls_paths: dict[str, str] = self._certs() if tls else {}
        #: bearer tokens (``strata.auth``), with TLS: STATE_DIR/tls/tokens (an admin token for
        #: the user, ``admin.token``; an agent token per agent, made as it is added)
        self.tokens_file = os.path.join(self.state_dir, "tls", "tokens") if tls else ""
        self.admin_token = self._new_token("admin", "admin") if tls else ""

    def _certs(self) -> dict[str, str]:
        from strata.tls import make_cluster_certs

        out = os.path.join(self.state_dir, "tls")
        names = ("ca", "server", "agent", "client")
        if all(os.path.exists(os.path.join(out, f"{n}.crt")) for n in names):
            return {**{n: os.path.join(out, f"{n}.crt") for n in names},
                    **{f"{n}_key": os.path.join(out, f"{n}.key") for n in names}}
        import socket

        host = self.listen.rsplit(":", 1)[0].strip("[]")
        names = [host] if host not in ("", "0.0.0.0", "::") else [socket.getfqdn(),
                                                                  socket.gethostname()]
        return make_cluster_certs(out, [n for n in names if n])

    def _token_file(self, role: str, name: str) -> str:
        path = os.path.join(os.path.dirname(self.tokens_file), f"{name}.token")
        if not os.path.exists(path):
            self._new_token(role, name)
        return path

    def _new_token(self, role: str, name: str, groups: Sequence[str] = ()) -> str:
        """A fresh token for ``name`` (in ``groups``) in the tokens file (and ``NAME.token``,
        mode 0600); the coordinator is told to read the file again (SIGHUP)."""
        import secrets

        token = secrets.token_urlsafe(32)
        fd = os.open(self.tokens_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{token} {role} {name}" + (f" {','.join(groups)}" if groups else "") + "\n")
        path = os.path.join(os.path.dirname(self.tokens_file), f"{name}.token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        if self.coordinator is not None and self.coordinator.poll() is None:
            os.kill(self.coordinator.pid, signal.SIGHUP)
        return token

    def remove_tokens(self, name: str) -> None:
        """Takes every token of ``name`` out of the tokens file and has the coordinator read
        it again (SIGHUP): how an operator revokes a token by hand."""
        with open(self.tokens_file) as f:
            kept = [line for line in f if line.split()[2:3] != [name]]
        fd = os.open(self.tokens_file + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(kept)
        os.replace(self.tokens_file + ".tmp", self.tokens_file)
        if self.coordinator is not None and self.coordinator.poll() is None:
            os.kill(self.coordinator.pid, signal.SIGHUP)

    def client_tls(self):
        from strata.tls import ClientTls

        p = self.tls_paths
        return ClientTls(p["ca"], p["client"], p["client_key"]) if p else ClientTls()

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        out = open(os.path.join(self.log_dir, log_name), "ab") if self.quiet else None
        env = dict(os.environ)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            return subprocess.Popen([sys.executable, "-m", "strata.cli", *args], stdout=out,
                                    stderr=subprocess.STDOUT if out else None,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                    preexec_fn=_die_with_parent)
        finally:
            if out is not None:
                out.close()

    def start_coordinator(self) -> str:
        port_file = os.path.join(self.state_dir, "coordinator.address")
        http_file = os.path.join(self.state_dir, "coordinator.http")
        for f in (port_file, http_file):
            if os.path.exists(f):
                os.unlink(f)
        # a restart keeps the port the agents know
        listen = (f"{self.listen.rsplit(':', 1)[0]}:{self.address.rsplit(':', 1)[1]}"
                  if self.address else self.listen)
        self.coordinator = self._spawn(
            ["coordinator", "--listen", listen, "--state-dir", self.state_dir,
             "--heartbeat-timeout", str(self.heartbeat_timeout_s), "--port-file", port_file]
            + (["--allow-user-code"] if self.allow_user_code else [])
            + (["--http-listen", self.http_listen, "--http-port-file", http_file]
               if self.http_listen else [])
            + (["--tls-cert", self.tls_paths["server"], "--tls-key", self.tls_paths["server_key"],
                "--tls-client-ca", self.tls_paths["ca"], "--auth-tokens", self.tokens_file]
               if self.tls_paths else [])
            + self.coordinator_args,
            "coordinator.log")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not os.path.exists(port_file):
            if self.coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited with {self.coordinator.returncode}; "
                                   f"see {self.log_dir}/coordinator.log")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("the coordinator did not start within "
                                   f"{START_TIMEOUT_S:g} s")
            time.sleep(0.05)
        with open(port_file) as f:
            bound = f.read().strip()
        host, port = bound.rsplit(":", 1)
        # every interface: the local processes dial loopback (in the certificate's names)
        self.address = f"127.0.0.1:{port}" if host.strip("[]") in ("0.0.0.0", "::", "") \
            else bound
        if self.http_listen:  # written before the address file
            with open(http_file) as f:
                self.http_url = f.read().strip().replace("://0.0.0.0:", "://127.0.0.1:")
        return self.address

    def add_worker(self, name: str, memory_budget: str | None = None, wait: bool = True,
                   device: str = "CPU") -> None:
        """An agent named ``name`` owning ``device`` (``CPU`` or ``GPU:N``; agents may share a
        GPU, each with its own slice of it as ``memory_budget``)."""
        work_dir = os.path.join(self.state_dir, "workers", name)
        self.agents[name] = self._spawn(
            ["worker", "--coordinator", self.address, "--memory-budget",
             memory_budget or self.memory_budget, "--name", name, "--work-dir", work_dir,
             "--device", device,
             "--threads", str(self.threads), "--shared-dir", self.shared_dir]
            + [a for r in self.data_roots for a in ("--data-root", r)]
            + ["--warm-pool", str(self.warm_pool)]
            + (["--tls-ca", self.tls_paths["ca"], "--tls-cert", self.tls_paths["agent"],
                "--tls-key", self.tls_paths["agent_key"], "--token-file",
                self._token_file("agent", name)] if self.tls_paths else []),
            f"{name}.log")
        if wait:
            self.wait_for_workers({name})

    def wait_for_workers(self, names: set[str], timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                ready = {w.name for w in c.workers() if w.state.value in ("READY", "BUSY")}
                if names <= ready:
                    return
                for n in names:
                    p = self.agents.get(n)
                    if p is not None and p.poll() is not None:
                        raise RuntimeError(f"worker {n} exited with {p.returncode}; see "
                                           f"{self.log_dir}/{n}.log")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers {sorted(names - ready)} did not register within "
                                       f"{timeout:g} s")
                time.sleep(0.1)

    def start(self) -> "LocalCluster":
        try:
            self.start_coordinator()
            for i in range(self.n_workers):
                self.add_worker(f"worker-{i}", wait=False)
            self.wait_for_workers({f"worker-{i}" for i in range(self.n_workers)})
        except BaseException:
            self.stop()
            raise
        return self

    def client(self) -> Client:
        return Client(self.address, tls=self.client_tls(), token=self.admin_token or None)

    @staticmethod
    def _terminate(procs: list[subprocess.Popen], sig: int = signal.SIGTERM) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=5)

    def kill_worker(self, name: str, sig: int = signal.SIGTERM) -> None:
        p = self.agents.pop(name)
        self._terminate([p], sig)

    def stop_coordinator(self) -> None:
        if self.coordinator is not None:
            self._terminate([self.coordinator])
            self.coordinator = None

    def stop(self) -> None:
        # SIGINT: an agent stops its tasks at once (SIGTERM would first drain them elsewhere)
        self._terminate(list(self.agents.values()), signal.SIGINT)
        self.agents.clear()
        self.stop_coordinator()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
