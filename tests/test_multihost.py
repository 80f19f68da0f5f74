"""Several hosts on one machine: Linux network namespaces joined by veth pairs to a bridge give a
coordinator and three agents (two for the job, one spare) their own addresses. Cutting one
agent's link mid-job must make it LOST within the heartbeat timeout, the job must recover on the
spare from its checkpoint, and when the link comes back the agent rejoins with nothing of the
old attempt left running.

Needs root and ``ip`` (iproute2); skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest

from strata.client import Client, CoordinatorError
from strata.tls import ClientTls, make_cluster_certs
from strata.types import JobState

from conftest import spec, task_processes, wait_until

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_TIMEOUT_S = 4
EVERY = 100


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


class Hosts:
    """A bridge in the root namespace (the test's own address, ``.254``) and one namespace per
    host, each with a veth pair whose outer end is on the bridge."""

    def __init__(self, names: list[str]):
        tag = secrets.token_hex(2)
        self.net = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:], 16)}"
        self.bridge = f"stbr{tag}"
        self.names = names
        self.ns = {n: f"st{tag}{n}" for n in names}
        self.outer = {n: f"st{tag}o{i}" for i, n in enumerate(names)}
        self.addr = {n: f"{self.net}.{10 + i}" for i, n in enumerate(names)}
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.net}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for n in self.names:
            ns, outer, inner = self.ns[n], self.outer[n], self.outer[n] + "i"
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("addr", "add", f"{self.addr[n]}/24", "dev", inner, ns=ns)
            _ip("link", "set", inner, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)

    def link(self, name: str, up: bool) -> None:
        _ip("link", "set", self.outer[name], "up" if up else "down")

    def run(self, name: str, args: list[str], log: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
        out = open(log, "ab")
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[name], sys.executable, "-m",
                              "strata.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        out.close()
        self.procs.append(p)
        return p

    def down(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        for n in self.names:
            subprocess.run(["ip", "link", "del", self.outer[n]], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns[n]], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    h = Hosts(["coord", "h1", "h2", "h3"])
    try:
        h.up()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        h.down()
        err = getattr(e, "stderr", b"") or b""
        pytest.skip(f"cannot make network namespaces here: {err.decode(errors='replace')}")
    yield h
    h.down()


def test_cut_link_loses_the_agent_job_recovers_on_the_spare_agent_rejoins(hosts, tmp_path):
    port = 50000 + secrets.randbelow(10000)
    coord = f"{hosts.addr['coord']}:{port}"
    shared = tmp_path / "shared"
    shared.mkdir()
    # off loopback: mutual TLS, as a real cluster would run
    p = make_cluster_certs(str(tmp_path / "tls"), [hosts.addr["coord"]])
    hosts.run("coord", ["coordinator", "--listen", coord, "--state-dir", str(tmp_path / "state"),
                        "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--tls-cert",
                        p["server"], "--tls-key", p["server_key"], "--tls-client-ca", p["ca"]],
              str(tmp_path / "coordinator.log"))
    for n in ("h1", "h2", "h3"):
        hosts.run(n, ["worker", "--coordinator", coord, "--memory-budget", "1GiB", "--name", n,
                      "--work-dir", str(tmp_path / "workers" / n), "--threads", "1",
                      "--warm-pool", "0",
                      "--shared-dir", str(shared), "--tls-ca", p["ca"], "--tls-cert",
                      p["agent"], "--tls-key", p["agent_key"]], str(tmp_path / f"{n}.log"))
    with Client(coord, tls=ClientTls(p["ca"], p["client"], p["client_key"])) as client:
        def ready() -> int:
            try:
                return len([w for w in client.workers() if w.state.value == "READY"])
            except CoordinatorError:
                return 0  # not listening yet
        wait_until(lambda: ready() == 3, 60, interval=0.5, what="three agents")
        addresses = {w.name: w.address for w in client.workers()}
        assert addresses == {n: hosts.addr[n] for n in ("h1", "h2", "h3")}  # their own hosts
        job = client.submit(spec(
            name="netsplit", workers=2, training={"steps": 2000},
            model={"builtin": {"kind": "mlp", "input_shape": [64], "hidden": [256, 256],
                               "classes": 10}},
            data={"source": "digits", "batch_size": 64},
            checkpoint={"every_steps": EVERY, "keep": 2},
            restart={"max_restarts": 2, "backoff_s": 1}))
        j = wait_until(lambda: (lambda j: j if j.checkpoint_step >= EVERY
                                and j.metrics.step > j.checkpoint_step else None)(
            client.get(job.id)), 120, interval=0.2, what="a checkpoint, then more steps")
        victim = next(t.worker for t in j.tasks if t.index == 1)
        t0 = time.monotonic()
        hosts.link(victim, up=False)
        wait_until(lambda: {w.name: w.state.value for w in client.workers()}[victim] == "LOST",
                   HEARTBEAT_TIMEOUT_S + 6, interval=0.2, what=f"{victim} LOST")
        lost_after = time.monotonic() - t0
        assert lost_after < HEARTBEAT_TIMEOUT_S + 3, lost_after
        final = client.wait(job.id, timeout=240)
        assert final.state == JobState.SUCCEEDED, final.message
        assert final.metrics.step == 2000 and final.restarts == 1
        assert final.steps_repeated <= EVERY
        assert victim not in {t.worker for t in final.tasks}
        # the link comes back: the agent registers again, and whatever it still ran of the
        # old attempt is stopped, never left running beside the new one
        hosts.link(victim, up=True)
        wait_until(lambda: {w.name: w.state.value for w in client.workers()}[victim] == "READY",
                   60, interval=0.5, what=f"{victim} back")
        wait_until(lambda: not task_processes(f"/workers/{victim}/jobs/{job.id}/"), 30,
                   what="no task of the old attempt left")
        assert not task_processes(f"/jobs/{job.id}/")
