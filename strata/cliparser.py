"""The ``strata`` command line's parser: every command's flags, help and example."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from strata.clicluster import (
    cmd_admin, cmd_certs, cmd_coordinator, cmd_demo, cmd_drain, cmd_health, cmd_up, cmd_worker,
    cmd_queues, cmd_workers,
)
from strata.clicommon import EXIT_TIMEOUT
from strata.clijobs import (
    cmd_cancel, cmd_delete, cmd_download, cmd_jobs, cmd_logs, cmd_status, cmd_submit, cmd_wait,
)
from strata.clioffline import cmd_plan, cmd_validate
from strata.limits import DEFAULT_MAX_PENDING_PER_USER, DEFAULT_MAX_TASKS_PER_JOB


JSON_HELP = "print JSON (the shapes in docs/ARCHITECTURE.md), for scripts"


#: one example per command, shown at the end of its --help
EXAMPLES = {
    "coordinator": "strata coordinator --listen 0.0.0.0:50051 --state-dir /var/lib/strata "
                   "--tls-cert server.crt --tls-key server.key --auth-tokens tokens",
    "certs": "strata certs --out tls --host coord.example.org --client node-a:agent "
             "--client alice",
    "worker": "strata worker --coordinator coord:50051 --memory-budget 8GiB --device GPU:0 "
              "--shared-dir /mnt/shared --data-root /mnt/datasets",
    "up": "strata up --workers 2 --memory-budget 2GiB",
    "demo": "strata demo --set training.epochs=2",
    "submit": "strata submit examples/digits-mlp.yaml --set workers=2 --follow",
    "jobs": "strata jobs --state RUNNING --state PENDING",
    "status": "strata status job-1a2b3c4d --json",
    "wait": "strata wait job-1a2b3c4d --timeout 600 && echo trained",
    "drain": "strata drain host1-gpu0 --deadline 30s",
    "cancel": "strata cancel job-1a2b3c4d",
    "delete": "strata delete job-1a2b3c4d",
    "logs": "strata logs job-1a2b3c4d --task worker:1 --tail 50 --follow",
    "workers": "strata workers --json",
    "queues": "strata queues --json",
    "download": "strata download job-1a2b3c4d out/",
    "plan": "strata plan examples/deep-pipeline.yaml --workers 4 --memory-budget 2GiB",
    "validate": "strata validate examples/digits-ps.yaml",
    "health": "strata health --coordinator 127.0.0.1:50051",
    "admin": "strata admin revoke host1-gpu0",
}


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its default, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings
                or action.default in (None, False, [], "", argparse.SUPPRESS)):
            return text
        return f"{text} (default: {action.default})"


class _Commands:
    """The subcommand parsers as they are built: ``add`` makes one, with the flags of a
    client of the coordinator unless ``client=False``."""

    def __init__(self, sub: Any):
        self.sub = sub

    def add(self, name: str, fn: Callable[[argparse.Namespace], int], help_: str,
            client: bool = True) -> argparse.ArgumentParser:
        sp = self.sub.add_parser(name, help=help_.split(". ")[0], description=help_)
        sp.set_defaults(fn=fn)
        if client:
            sp.add_argument("--coordinator", metavar="HOST:PORT",
                            help="coordinator address (default: $STRATA_COORDINATOR or 127.0.0.1:50051)")
            self.tls_flags(sp)
        return sp

    @staticmethod
    def tls_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--tls-ca", default=None, metavar="FILE",
                        help="the CA that signed the coordinator's certificate: connect with TLS "
                             "(default: $STRATA_TLS_CA; none: plain text)")
        sp.add_argument("--tls-cert", default=None, metavar="FILE",
                        help="this side's certificate, for mutual TLS (default: $STRATA_TLS_CERT)")
        sp.add_argument("--tls-key", default=None, metavar="FILE",
                        help="its private key (default: $STRATA_TLS_KEY)")
        sp.add_argument("--token-file", default=None, metavar="FILE",
                        help="a file holding the bearer token (default: $STRATA_TOKEN; none: "
                             "no token)")


def _state_filter(sp: argparse.ArgumentParser, what: str, states: Any) -> None:
    """``--state``: only ``what`` in one of these states (repeatable, any case)."""
    names = [st.value for st in states]
    sp.add_argument("--state", action="append", default=[], type=str.upper, choices=names,
                    metavar="STATE", help=f"only {what} in this state (repeatable): "
                                          + ", ".join(names))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata", description="Strata: distributed TensorFlow training.",
                                epilog="Exit codes: 0 ok; 1 job failed or command failed; 2 bad usage "
                                       "or rejected spec; 3 coordinator unreachable; 4 not found; "
                                       "124 strata wait timed out.")
    from strata import __version__

    p.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    cmds = _Commands(sub)
    _coordinator_command(cmds)
    _cluster_commands(cmds)
    _job_commands(cmds)
    _look_commands(cmds)
    for name, sp in sub.choices.items():
        sp.formatter_class = _Help
        sp.epilog = f"example:\n  {EXAMPLES[name]}"
    return p


def _coordinator_command(cmds: _Commands) -> None:
    """``strata coordinator``: the control plane's flags."""
    sp = cmds.add("coordinator", cmd_coordinator, "run the control plane", client=False)
    sp.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                    help="the address to serve gRPC on; off loopback it needs TLS or --insecure")
    sp.add_argument("--http-listen", default="", metavar="HOST:PORT",
                    help="serve the status page (/) and Prometheus metrics (/metrics) here; "
                         "behind the same tokens, over TLS with --tls-cert (default: none)")
    sp.add_argument("--http-port-file", help=argparse.SUPPRESS)
    sp.add_argument("--retention", default="7d", metavar="DURATION",
                    help="delete finished jobs (records, logs, outputs) this long after they "
                         "ended: 7d, 12h, 30m, seconds; 0 keeps them")
    sp.add_argument("--state-dir", default=".strata/coordinator", metavar="DIR",
                    help="where the SQLite state and job logs live")
    sp.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="declare a worker LOST after this long without a heartbeat (default 10)")
    sp.add_argument("--start-timeout", type=float, default=300.0, metavar="SECONDS",
                    help="fail a job whose tasks are not all running this long after placement "
                         "(default 300)")
    sp.add_argument("--max-upload", default="2GiB", metavar="SIZE",
                    help="the largest file a client may upload with a job: a .keras model or a "
                         "packed code directory (default 2GiB)")
    sp.add_argument("--allow-user-code", action="store_true",
                    help="run jobs that bring their own Python (code: model / dataset functions) "
                         "on the agents; only for a cluster whose every submitter may run code "
                         "there")
    sp.add_argument("--port-file", help=argparse.SUPPRESS)
    sp.add_argument("--tls-cert", default="", metavar="FILE",
                    help="serve TLS with this certificate (`strata certs` makes one)")
    sp.add_argument("--tls-key", default="", metavar="FILE", help="the certificate's private key")
    sp.add_argument("--tls-client-ca", default="", metavar="FILE",
                    help="mutual TLS: require client certificates signed by this CA")
    sp.add_argument("--insecure", action="store_true",
                    help="allow plain text on a non-loopback --listen (a network you trust)")
    sp.add_argument("--auth-tokens", default="", metavar="FILE",
                    help="require bearer tokens: lines TOKEN ROLE NAME, roles admin, submitter, "
                         "viewer, agent; reloaded on SIGHUP (default: none, everything open)")
    sp.add_argument("--queues", default="", metavar="FILE",
                    help="the shared cluster's queues (YAML: shares, borrowing, priority "
                         "classes, fair share; docs/scheduling.md); reloaded on SIGHUP "
                         "(default: one queue, everyone's, jobs oldest first)")
    sp.add_argument("--max-pending-per-user", type=int, default=DEFAULT_MAX_PENDING_PER_USER,
                    metavar="N", help="jobs one user may have waiting; more are refused "
                                      f"(default {DEFAULT_MAX_PENDING_PER_USER})")
    sp.add_argument("--max-tasks-per-job", type=int, default=DEFAULT_MAX_TASKS_PER_JOB,
                    metavar="N", help="task processes one job may run (default "
                                      f"{DEFAULT_MAX_TASKS_PER_JOB})")
    sp.add_argument("--user-quota", default="20GiB", metavar="SIZE",
                    help="bytes one user may keep on the coordinator: its uploads and its "
                         "jobs' outputs; more are refused (0: no quota)")
    sp.add_argument("--max-job-outputs", default="8GiB", metavar="SIZE",
                    help="bytes of outputs one job may keep (model, TensorBoard logs)")
    sp.add_argument("--max-job-logs", default="256MiB", metavar="SIZE",
                    help="bytes of logs one job may keep, all its tasks; the rest is dropped")
    sp.add_argument("--disk-reserve", default="256MiB", metavar="SIZE",
                    help="room kept free on --state-dir's disk for state changes: uploads, "
                         "outputs, logs and new jobs stop there, cancels go on")
    sp.add_argument("--upload-grace", default="1h", metavar="DURATION",
                    help="how long an uploaded file no job names is kept before it is deleted")


def _cluster_commands(cmds: _Commands) -> None:
    """Running and administering a cluster: admin, certs, worker, up, demo."""
    sp = cmds.add("admin", cmd_admin, "administer the cluster's credentials: revoke a caller "
                                 "(every token and certificate of its NAME) at once, restore "
                                 "one, list those revoked")
    sp.add_argument("action", choices=("revoke", "restore", "revoked"),
                    help="revoke NAME: its open calls close, its agents are LOST and their "
                         "tasks restart elsewhere; restore NAME: let it in again; revoked: "
                         "list the names revoked")
    sp.add_argument("name", nargs="?", default="", metavar="NAME",
                    help="the caller's NAME (as the tokens file or its certificate names it)")

    sp = cmds.add("certs", cmd_certs, "make a CA, a coordinator certificate and client certificates",
             client=False)
    sp.add_argument("--out", required=True, metavar="DIR", help="where to write the files")
    sp.add_argument("--host", action="append", default=[], metavar="NAME",
                    help="a name or address clients reach the coordinator at (repeatable; "
                         "localhost and the loopback addresses are always included)")
    sp.add_argument("--client", action="append", default=None, metavar="NAME[:ROLE]",
                    help="a client certificate to make, with its role (admin, submitter, "
                         "viewer, agent; default submitter), read when the coordinator has no "
                         "--auth-tokens (repeatable; default: agent:agent, client:admin)")
    sp.add_argument("--force", action="store_true", help="replace an existing CA in --out")

    sp = cmds.add("worker", cmd_worker, "run a worker agent that owns one device", client=False)
    sp.add_argument("--coordinator", default=os.environ.get("STRATA_COORDINATOR", "127.0.0.1:50051"),
                    metavar="HOST:PORT", help="the coordinator's address ($STRATA_COORDINATOR)")
    sp.add_argument("--memory-budget", required=True, metavar="SIZE", help="e.g. 2GiB, 512MiB, 1.5GB")
    sp.add_argument("--name", help="worker name (default: HOSTNAME-DEVICE)")
    sp.add_argument("--device", default="CPU", help="CPU or GPU:N")
    sp.add_argument("--work-dir", default=".strata/worker", metavar="DIR",
                    help="the agent's own files: task configs, fetched blobs, outputs without "
                         "a shared directory")
    sp.add_argument("--threads", type=int, default=0, help="intra-op threads per task (0: TF default)")
    sp.add_argument("--advertise-host", default="", metavar="HOST",
                    help="address task peers reach this host at (default: the route to the coordinator)")
    sp.add_argument("--shared-dir", default="", metavar="DIR",
                    help="a directory every worker sees at the same path (NFS, a ReadWriteMany "
                         "volume): jobs' checkpoints and outputs, under jobs/JOB_ID/; without "
                         "it no job that checkpoints runs here (default: none)")
    sp.add_argument("--data-root", action="append", default=[], metavar="DIR",
                    help="jobs read data.path / data.test_path only under this directory "
                         "(repeatable; default: none, anywhere this user can read)")
    sp.add_argument("--warm-pool", type=int, default=1, metavar="N",
                    help="task processes kept ready with TensorFlow imported, so a task starts "
                         "without paying the import (each idles at about 300 MiB of RAM)")
    sp.add_argument("--notice", default="60s", metavar="DURATION",
                    help="how long this machine stays after SIGTERM (a spot reclaim's notice, a "
                         "pod's grace period, Slurm's --signal lead): its jobs save a checkpoint "
                         "within 80%% of it and move elsewhere (default 60s)")
    sp.add_argument("--cpu-kernels", default="auto", metavar="auto|onednn|eigen",
                    help="the CPU kernels this host's TensorFlow runs, which the memory "
                         "estimates depend on (default auto: TensorFlow's own rule, from "
                         "TF_ENABLE_ONEDNN_OPTS and the CPU's features)")
    cmds.tls_flags(sp)

    for name, fn, help_ in (("up", cmd_up, "run a coordinator and N workers locally in the foreground"),
                            ("demo", cmd_demo, "train the digits MLP on a local 2-worker cluster")):
        sp = cmds.add(name, fn, help_, client=False)
        if name == "up":
            sp.add_argument("--workers", type=int, default=2, help="worker agents to start")
        sp.add_argument("--memory-budget", default="1GiB", metavar="SIZE",
                        help="each worker's memory budget")
        sp.add_argument("--listen", default="127.0.0.1:50051" if name == "up" else "127.0.0.1:0",
                        metavar="HOST:PORT", help="the coordinator's address; off loopback it "
                                                  "makes certificates and tokens (mutual TLS)")
        sp.add_argument("--state-dir", default=".strata/local" if name == "up" else None,
                        metavar="DIR", help="the coordinator's state and the workers' files"
                        + ("" if name == "up" else " (default: a new temporary directory)"))
        sp.add_argument("--shared-dir", default=None, metavar="DIR",
                        help="the workers' shared directory (default: STATE_DIR/shared)")
        sp.add_argument("--data-root", action="append", default=[], metavar="DIR",
                        help="the workers' data roots (repeatable; default: none, unconfined)")
        sp.add_argument("--http-listen", default="", metavar="HOST:PORT",
                        help="the coordinator's status page and /metrics (default: none)")
        sp.add_argument("--warm-pool", type=int, default=1, metavar="N",
                        help="each worker's task processes kept ready with TensorFlow imported")
        if name == "demo":
            sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help="override a field of the demo job (repeatable)")


def _job_commands(cmds: _Commands) -> None:
    """Jobs: submit, jobs, status, wait, drain (a worker's jobs move), cancel, delete."""
    from strata.types import JobState

    sp = cmds.add("submit", cmd_submit, "submit a job file (YAML or JSON)")
    sp.add_argument("job", metavar="JOB.yaml", help="the job file")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set training.epochs=3 (repeatable)")
    sp.add_argument("--follow", action="store_true", help="show live progress until the job ends")
    sp.add_argument("--queue-for-capacity", default="", metavar="DURATION",
                    help="a job wider or larger than any the cluster has had workers for is "
                         "refused; with this it waits that long for them (30m, 12h), then fails")

    sp = cmds.add("jobs", cmd_jobs, "list jobs")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp.add_argument("--all", action="store_true",
                    help="also the memory probes (NAME-probe-...) jobs run before they start")
    _state_filter(sp, "jobs", JobState)
    sp = cmds.add("status", cmd_status, "show one job")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp = cmds.add("wait", cmd_wait, "wait for a job to end; exit 0 if it SUCCEEDED, 1 if it FAILED "
                               "or was CANCELLED")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                    help=f"give up after this long, exit {EXIT_TIMEOUT} (default: no limit)")
    sp = cmds.add("drain", cmd_drain, "stop placing tasks on a worker and move its jobs elsewhere "
                                 "(they resume from their checkpoints)")
    sp.add_argument("worker", metavar="WORKER", help="the worker's name (strata workers)")
    sp.add_argument("--deadline", default="", metavar="DURATION",
                    help="a notice: the worker leaves within DURATION (30s, 2m), so each of its "
                         "jobs first saves a checkpoint at a step all its tasks reach in time and "
                         "resumes from it (default: none, they resume from their last checkpoint)")
    sp = cmds.add("cancel", cmd_cancel, "cancel a job")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp = cmds.add("delete", cmd_delete, "delete a finished job: its records, events, logs and "
                                   "stored outputs")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job (cancel a running one first)")


def _look_commands(cmds: _Commands) -> None:
    """What users look at and check: logs, workers, download, plan, health, validate."""
    from strata.types import WorkerState

    sp = cmds.add("logs", cmd_logs, "print a job's task logs")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("--task", metavar="ROLE:INDEX",
                    help="one task's log, e.g. worker:1 (default: every task's, each line "
                         "prefixed with its task)")
    sp.add_argument("--follow", action="store_true", help="keep printing until the job ends")
    sp.add_argument("--tail", type=int, default=0, metavar="N",
                    help="only the last N lines of each task's log (default: all)")
    sp = cmds.add("workers", cmd_workers, "list worker agents and their memory")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    _state_filter(sp, "workers", WorkerState)
    sp = cmds.add("queues", cmd_queues, "list the shared cluster's queues: each one's share, "
                                          "what it holds and borrows, its waiting and running "
                                          "jobs")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp = cmds.add("download", cmd_download, "fetch a job's outputs (trained model, metrics.json)")
    sp.add_argument("job_id", metavar="JOB_ID", help="the job")
    sp.add_argument("dest", metavar="DIR", help="where to write them (made if missing)")
    sp = cmds.add("plan", cmd_plan, "show what would run: tasks, workers, stages, memory per task; "
                               "starts nothing. With --workers and --memory-budget it needs no "
                               "coordinator")
    sp.add_argument("job", metavar="JOB.yaml", help="the job file")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field, e.g. --set workers=4 (repeatable)")
    sp.add_argument("--workers", type=int, default=None, metavar="N",
                    help="plan offline for N workers of --memory-budget each (default: the "
                         "coordinator's workers)")
    sp.add_argument("--memory-budget", default=None, metavar="SIZE",
                    help="each offline worker's budget, e.g. 8GiB")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)
    sp = cmds.add("health", cmd_health, "probe the coordinator's health service (exit 0 when "
                                   "SERVING), or an agent's last heartbeat")
    sp.add_argument("--heartbeat-file", default="", metavar="FILE",
                    help="an agent's WORK_DIR/agent.alive: healthy when a heartbeat was "
                         "accepted within --max-age (default: probe the coordinator)")
    sp.add_argument("--max-age", type=float, default=30.0, metavar="SECONDS",
                    help="how old the last heartbeat may be; also the coordinator probe's "
                         "timeout")
    sp = cmds.add("validate", cmd_validate, "check a job file on this machine, as the coordinator "
                                       "would: fields, model, memory estimate, the data it can "
                                       "see; nothing is sent. With --coordinator, also what "
                                       "that cluster would say: whether it fits there")
    sp.add_argument("job", metavar="JOB.yaml", help="the job file")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field (repeatable)")
