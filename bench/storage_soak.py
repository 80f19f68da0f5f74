"""Storage soak: jobs with uploads, outputs, checkpoints and logs, one after another, under
--retention, with the disk measured as they go. Does the state directory stay flat?

    .venv/bin/python bench/storage_soak.py --minutes 8 --retention 60s --upload-grace 30s

A local cluster (a coordinator, 2 agents with a shared directory) runs, one at a time, 2-worker
jobs of an MLP like the seed's (64-1024-512-256-10) on the digits data, each with its own
freshly saved ``.keras`` file uploaded with it (``model.keras_file``, 2.8 MiB), checkpoints on
the shared directory and its outputs (the trained ``model.keras``, 2.8 MiB, and
``metrics.json``). Between
jobs, one stray 1 MiB upload that no job ever names. Every ``--every`` seconds it measures the
bytes under the coordinator's state directory (records, uploads, outputs, logs), the shared
directory and the agents' work directories, and what the coordinator itself reports
(``ListWorkers``' ``coordinator_disk``).

At the end: how much the jobs put in (uploads, outputs), and for each place its size over the
second half of the run (min, max, last, and its slope by least squares, MiB a minute). Flat
means the slope is near zero while the bytes put in keep growing. Exits 1 if a job failed.
Not part of the test suite (it runs for minutes); figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from strata.client import Client  # noqa: E402
from strata.local import LocalCluster  # noqa: E402
from strata.types import JobState  # noqa: E402

MiB = 1 << 20


def du(path: str, skip: tuple[str, ...] = ()) -> int:
    """Bytes of the files under ``path`` (its top-level entries in ``skip`` left out)."""
    total = 0
    for base, dirs, files in os.walk(path):
        if base == path:
            dirs[:] = [d for d in dirs if d not in skip]
            files = [f for f in files if f not in skip]
        for name in files:
            try:
                total += os.lstat(os.path.join(base, name)).st_size
            except OSError:
                pass
    return total


def keras_file(path: str, seed: int) -> None:
    """A small model saved with its own weights: every job uploads a file of its own."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,))] + [
        keras.layers.Dense(n, activation="relu") for n in (1024, 512, 256)] + [
        keras.layers.Dense(10)])
    model.save(path)


def job(i: int, path: str) -> dict:
    return {"name": f"store-{i}", "strategy": "multi_worker_mirrored", "workers": 2,
            "model": {"keras_file": path},
            "data": {"source": "digits", "batch_size": 128}, "training": {"steps": 40},
            "checkpoint": {"every_steps": 20, "keep": 2}, "memory": {"profile": "false"}}


def slope(points: list[tuple[float, int]]) -> float:
    """Least-squares bytes a second."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mb = sum(b for _, b in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (b - mb) for t, b in points) / var if var else 0.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=8.0)
    p.add_argument("--retention", default="60s")
    p.add_argument("--upload-grace", default="30s")
    p.add_argument("--every", type=float, default=5.0, help="seconds between measurements")
    p.add_argument("--out", default="", help="write the samples and summary here (JSON)")
    return p.parse_args()


def places_of(c: LocalCluster) -> dict[str, Callable[[], int]]:
    """Each place measured, and how to count its bytes."""
    state = c.state_dir
    return {
        # the coordinator's own: what --state-dir holds for it
        # (the disk ballast is left out: a constant, kept for a full disk)
        "coordinator": lambda: du(state, skip=("shared", "workers", "process-logs", "tls",
                                               "disk-ballast")),
        "shared": lambda: du(c.shared_dir),
        "agents": lambda: du(os.path.join(state, "workers")),
    }


class Sampler:
    """Every ``every`` seconds: the bytes of each place and what the coordinator reports."""

    def __init__(self, places: dict[str, Callable[[], int]], every: float, t0: float):
        self.places, self.every, self.t0 = places, every, t0
        self.samples: list[dict] = []
        self.next_sample = 0.0

    def maybe_sample(self, client: Client, done: int) -> None:
        now = time.monotonic() - self.t0
        if now >= self.next_sample:
            self.next_sample = now + self.every
            disk = client.state_disk()
            self.samples.append({"t": round(now, 1), "jobs_done": done,
                                 **{k: f() for k, f in self.places.items()},
                                 "reported": disk.disk.used_bytes})


def submit_with_stray(client: Client, model_dir: str, i: int, put: dict[str, int]):
    """Job ``i`` with a .keras file of its own, then one stray upload no job names."""
    path = os.path.join(model_dir, f"m{i}.keras")
    keras_file(path, i)
    put["uploads"] += os.path.getsize(path)
    j = client.submit(job(i, path))
    stray = os.path.join(model_dir, f"stray{i}")
    with open(stray, "wb") as f:
        f.write(os.urandom(MiB))
    client.upload(stray)
    put["uploads"] += MiB
    os.unlink(stray)
    os.unlink(path)
    return j


def run_jobs(client: Client, minutes: float, sampler: Sampler, model_dir: str,
             put: dict[str, int]) -> tuple[int, list[tuple[str, str, str]]]:
    """Jobs one after another for ``minutes``, sampled as they run: (jobs done, those failed)."""
    failed, done = [], 0
    i = 0
    while time.monotonic() - sampler.t0 < minutes * 60:
        j = submit_with_stray(client, model_dir, i, put)
        while True:
            sampler.maybe_sample(client, done)
            got = client.get(j.id)
            if got.state.final:
                break
            time.sleep(0.5)
        done += 1
        if got.state != JobState.SUCCEEDED:
            failed.append((got.id, got.state.value, got.message))
        else:
            put["outputs"] += sum(
                os.path.getsize(os.path.join(got.output_dir, f))
                for f in got.outputs if os.path.exists(os.path.join(got.output_dir, f)))
        i += 1
    return done, failed


def summarize(args: argparse.Namespace, done: int, failed: list, put: dict[str, int],
              samples: list[dict], places: dict[str, Callable[[], int]]) -> dict:
    """What the jobs put in, and each place over the second half of the run."""
    half = [s for s in samples if s["t"] >= samples[-1]["t"] / 2]
    summary = {"minutes": args.minutes, "retention": args.retention,
               "upload_grace": args.upload_grace, "jobs": done, "failed": failed,
               "put_in_mib": {k: round(v / MiB, 1) for k, v in put.items()}, "second_half": {}}
    for place in (*places, "reported"):
        pts = [(s["t"], s[place]) for s in half]
        values = [b for _, b in pts]
        summary["second_half"][place] = {
            "min_mib": round(min(values) / MiB, 1), "max_mib": round(max(values) / MiB, 1),
            "last_mib": round(values[-1] / MiB, 1),
            "slope_mib_per_min": round(slope(pts) * 60 / MiB, 2)}
    return summary


def main() -> int:
    args = parse_args()
    work = tempfile.mkdtemp(prefix="strata-storage-soak-")
    c = LocalCluster(workers=2, memory_budget="1GiB", state_dir=os.path.join(work, "cluster"),
                     threads=1, coordinator_args=["--retention", args.retention,
                                                  "--upload-grace", args.upload_grace])
    c.start()
    places = places_of(c)
    put = {"uploads": 0, "outputs": 0}
    sampler = Sampler(places, args.every, time.monotonic())
    model_dir = os.path.join(work, "models")
    os.makedirs(model_dir)
    try:
        with Client(c.address, timeout=30) as client:
            done, failed = run_jobs(client, args.minutes, sampler, model_dir, put)
    finally:
        c.stop()

    summary = summarize(args, done, failed, put, sampler.samples, places)
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "samples": sampler.samples}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
