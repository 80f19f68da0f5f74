"""deploy/: the Kubernetes manifests rendered with kustomize and validated offline against the
Kubernetes schemas; the Slurm launcher run against stub srun/scontrol/strata commands to see
the processes it would start; the systemd units and the Dockerfile read for what they must
carry."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPLOY = os.path.join(ROOT, "deploy")
KUBECTL = shutil.which("kubectl")


def render(overlay: str) -> list[dict]:
    if KUBECTL is None:
        pytest.skip("needs kubectl (for `kubectl kustomize`)")
    r = subprocess.run([KUBECTL, "kustomize", os.path.join(DEPLOY, "kubernetes", overlay)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


@pytest.fixture(scope="module")
def manifests() -> list[dict]:
    return render("")


def test_every_manifest_is_valid_against_the_kubernetes_schemas(manifests):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = "1.30"
    for doc in manifests + render("gpu"):
        kubernetes_validate.validate(doc, version, strict=True)  # raises naming the field
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in manifests)
    assert kinds == sorted([
        ("Namespace", "strata"), ("Service", "strata-coordinator"),
        ("StatefulSet", "strata-coordinator"), ("Service", "strata-agents"),
        ("StatefulSet", "strata-agent"), ("PersistentVolumeClaim", "strata-shared"),
        ("PersistentVolumeClaim", "strata-data"), ("NetworkPolicy", "strata-agents"),
        ("NetworkPolicy", "strata-coordinator")])


def by(manifests, kind, name):
    return next(d for d in manifests if d["kind"] == kind and d["metadata"]["name"] == name)


def test_the_cluster_is_laid_out_as_strata_needs(manifests):
    coord = by(manifests, "StatefulSet", "strata-coordinator")
    agents = by(manifests, "StatefulSet", "strata-agent")
    assert coord["spec"]["replicas"] == 1  # one owner of the SQLite state
    assert coord["spec"]["volumeClaimTemplates"][0]["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert by(manifests, "Service", "strata-agents")["spec"]["clusterIP"] == "None"
    assert agents["spec"]["serviceName"] == "strata-agents"
    assert by(manifests, "PersistentVolumeClaim", "strata-shared")["spec"]["accessModes"] == \
        ["ReadWriteMany"]
    for sts in (coord, agents):
        pod = sts["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (c,) = pod["containers"]
        assert c["readinessProbe"]["exec"]["command"][:2] == ["strata", "health"]
        assert c["livenessProbe"]["exec"]["command"][:2] == ["strata", "health"]
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        assert secrets == {"strata-tls", "strata-tokens"}
    args = " ".join(coord["spec"]["template"]["spec"]["containers"][0]["args"])
    for flag in ("--tls-cert", "--tls-client-ca", "--auth-tokens", "--http-listen"):
        assert flag in args
    script = agents["spec"]["template"]["spec"]["containers"][0]["args"][0]
    # a stable DNS name per pod; the budget from the pod's memory limit; its own token
    assert '--advertise-host "$POD_NAME.strata-agents.$POD_NAMESPACE.svc.cluster.local"' in script
    assert "$((MEMORY_LIMIT * 85 / 100))" in script and '"/etc/strata/tokens/$POD_NAME"' in script
    env = {e["name"]: e for e in agents["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MEMORY_LIMIT"]["valueFrom"]["resourceFieldRef"]["resource"] == "limits.memory"
    # TensorFlow's ports: agents take traffic only from agents
    policy = by(manifests, "NetworkPolicy", "strata-agents")
    assert policy["spec"]["podSelector"]["matchLabels"] == {"strata.io/role": "agent"}
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": {
        "strata.io/role": "agent"}}}]}]


def test_the_agent_command_line_is_one_strata_accepts(tmp_path):
    """The agent pod's shell command, with the pod's environment, parses as `strata worker`
    flags (the budget arithmetic included)."""
    from strata.cli import build_parser

    agents = yaml.safe_load(open(os.path.join(DEPLOY, "kubernetes", "base", "agents.yaml"))
                            .read().split("\n---\n")[1])
    script = agents["spec"]["template"]["spec"]["containers"][0]["args"][0]
    env = {"POD_NAME": "strata-agent-0", "POD_NAMESPACE": "strata", "STRATA_DEVICE": "CPU",
           "MEMORY_LIMIT": str(8 << 30), "PATH": os.environ["PATH"]}
    r = subprocess.run(["/bin/sh", "-c", script.replace("exec strata", "printf '%s\\n' strata")],
                       env=env, capture_output=True, text=True, timeout=10)
    argv = r.stdout.split("\n")[1:-1]
    args = build_parser().parse_args(argv)
    assert args.name == "strata-agent-0" and int(args.memory_budget) == (8 << 30) * 85 // 100
    assert args.advertise_host == "strata-agent-0.strata-agents.strata.svc.cluster.local"
    assert args.data_root == ["/data"] and args.shared_dir == "/shared"


def test_the_gpu_overlay_gives_each_agent_one_gpu_and_its_budget():
    agents = by(render("gpu"), "StatefulSet", "strata-agent")
    (c,) = agents["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["image"] == "strata:gpu"
    assert env["STRATA_DEVICE"] == "GPU:0" and env["STRATA_MEMORY_BUDGET"] == "70GiB"


# --------------------------------------------------------------------------------------------
# Slurm


STUB = """#!/usr/bin/env bash
# one record per call: agents start at once, and two unlocked writes each would interleave
exec 9>>"$STUB_LOG.lock"; flock 9
printf '%s\\0' "$(basename "$0")" "$@" >> "$STUB_LOG"; printf '\\n' >> "$STUB_LOG"
flock -u 9
# the coordinator runs until the allocation ends: here, until every agent has started
case " $* " in *" coordinator "*)
    for _ in $(seq 300); do
        [ "$(grep -a -c ' worker ' <(tr '\\0' ' ' < "$STUB_LOG"))" -ge "$STUB_AGENTS" ] && break
        sleep 0.1
    done ;;
esac
"""


def run_sbatch(tmp_path, agents: int, **env) -> list[list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "strata"):
        (bin_dir / name).write_text(STUB)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] '
                                      '&& printf "node-a\\nnode-b\\n"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    log = tmp_path / "calls"
    script = os.path.join(DEPLOY, "slurm", "strata.sbatch")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    r = subprocess.run(["bash", script], env={
        "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), "STUB_LOG": str(log),
        "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node-[a-b]", "STUB_AGENTS": str(agents),
        **env},
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [line.split("\0")[:-1] for line in log.read_text().splitlines() if line]


def srun_command(call: list[str]) -> tuple[dict[str, str], list[str]]:
    """srun's own options, and the command it runs."""
    i = call.index("strata")
    opts = dict(o[2:].split("=", 1) if "=" in o else (o[2:], "") for o in call[1:i])
    return opts, call[i:]


def test_slurm_starts_a_coordinator_then_one_agent_per_gpu_on_every_node(tmp_path):
    calls = run_sbatch(tmp_path, 4, SLURM_GPUS_ON_NODE="2", STRATA_TLS_DIR="/etc/strata/tls")
    runs = [srun_command(c) for c in calls if c[0] == "srun"]
    (opts, coord), *agents = runs
    assert opts["nodelist"] == "node-a" and coord[:2] == ["strata", "coordinator"]
    assert "0.0.0.0:50051" in coord and "--tls-client-ca" in coord
    probes = [c for c in calls if c[:2] == ["strata", "health"]]
    assert probes and "node-a:50051" in probes[0]  # waits for it before the agents
    seen = []
    for opts, cmd in agents:
        assert cmd[:2] == ["strata", "worker"]
        flags = dict(zip(cmd[2::2], cmd[3::2]))
        assert flags["--coordinator"] == "node-a:50051" and flags["--device"] == "GPU:0"
        assert flags["--advertise-host"] == opts["nodelist"]
        assert opts["export"].startswith("ALL,CUDA_VISIBLE_DEVICES=")
        assert flags["--tls-cert"] == "/etc/strata/tls/agent.crt"
        seen.append((opts["nodelist"], opts["export"][-1], flags["--name"]))
    assert sorted(seen) == [("node-a", "0", "node-a-gpu0"), ("node-a", "1", "node-a-gpu1"),
                            ("node-b", "0", "node-b-gpu0"), ("node-b", "1", "node-b-gpu1")]


def test_slurm_without_gpus_starts_one_cpu_agent_per_node(tmp_path):
    calls = run_sbatch(tmp_path, 2)
    agents = [srun_command(c)[1] for c in calls if c[0] == "srun"][1:]
    assert sorted(dict(zip(a[2::2], a[3::2]))["--name"] for a in agents) == ["node-a-cpu",
                                                                            "node-b-cpu"]
    assert all("--device" in a and a[a.index("--device") + 1] == "CPU" for a in agents)
    # the time limit is a notice: Slurm signals the script, which tells the agents to leave
    assert all(a[a.index("--notice") + 1] == "120s" for a in agents)
    with open(os.path.join(DEPLOY, "slurm", "strata.sbatch")) as f:
        script = f.read()
    assert "#SBATCH --signal=B:USR1@120" in script and "USR1" in script.split("trap")[-1]
    coord = [srun_command(c)[1] for c in calls if c[0] == "srun"][0]
    assert "--insecure" in coord  # no certificates given: said, not silent


# --------------------------------------------------------------------------------------------
# systemd and the image


@pytest.mark.parametrize("unit,command", [("strata-coordinator.service", "coordinator"),
                                          ("strata-worker@.service", "worker")])
def test_systemd_units_run_strata_with_tls_and_tokens(unit, command):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(os.path.join(DEPLOY, "systemd", unit))
    assert {"Unit", "Service", "Install"} <= set(parser.sections())
    svc = parser["Service"]
    argv = shlex.split(svc["ExecStart"].replace("\\\n", " "))
    assert argv[0].endswith("/strata") and argv[1] == command
    for flag in ("--tls-cert", "--tls-key"):
        assert flag in argv
    assert svc["User"] == "strata" and svc["Restart"] == "on-failure"
    assert svc["NoNewPrivileges"] == "yes"
    assert parser["Install"]["WantedBy"] == "multi-user.target"


def test_the_image_runs_unprivileged_with_a_health_check():
    text = open(os.path.join(DEPLOY, "docker", "Dockerfile")).read()
    stages = {line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")}
    assert {"cpu", "gpu"} <= stages
    assert text.count("USER 10001:10001") == 2
    assert text.count("CMD strata health $STRATA_HEALTH_ARGS") == 2
    assert '"/src[cpu]"' in text and "tensorflow/tensorflow:2.21.0-gpu" in text
