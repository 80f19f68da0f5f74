"""The synthetic workload of ``bench/sched_sim.py``: the cluster's workers, the teams' queues
and the jobs, drawn from a seed (the distributions: ``sched_sim.py``'s docstring)."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import sys
from typing import NamedTuple, Sequence, TypeVar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from strata.jobspec import JobSpec  # noqa: E402
from strata.queues import (  # noqa: E402
    DEFAULT_CLASSES, DEFAULT_HALF_LIFE_S, UNBOUNDED, Queue, Queues, Share,
)

T = TypeVar("T")


GiB = 1 << 30
MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
#: the simulated clock's origin (epoch seconds): a job's ``started_at`` of 0 would read "never"
T0 = 1_700_000_000.0

# --- the cluster and the workload (docstring) ----------------------------------------------------
WORKER_MIX = ((16, 0.4), (32, 0.4), (80, 0.2))  # GiB, share of the workers
WIDTHS = ((1, 0.72), (2, 0.10), (4, 0.09), (8, 0.05), (16, 0.025), (32, 0.01), (64, 0.0035),
          (128, 0.0015))
SWEEP_MAX_WIDTH = 8
MEMORY_CLASSES = ((6.0, 15.0, 0.55), (17.0, 30.0, 0.30), (34.0, 76.0, 0.15))  # GiB range, share
MEDIAN_S, WIDTH_EXPONENT, SIGMA = 30 * MINUTE, 0.3, 1.8
MIN_DURATION_S, MAX_DURATION_S = 2 * MINUTE, 3 * DAY
SWEEP_P, SWEEP_SIZE, SWEEP_SIGMA = 0.015, (10, 50), 0.3
HIGH_P = 0.03
LIMIT_P, LIMIT_FACTOR = 0.8, (1.5, 3.0)
#: (team, nominal share of the workers, share of the submissions)
TEAMS = (("a", 0.30, 0.45), ("b", 0.30, 0.30), ("c", 0.25, 0.17), ("d", 0.15, 0.08))
USERS_PER_TEAM = 5
BATCH = 256
RATE_STEPS_S = (1.0, 10.0)
DIURNAL_AMPLITUDE, PEAK_HOUR, WEEKEND = 0.5, 14.0, 0.6


# --- the trace ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JobTemplate:
    """One job of the trace, as every policy sees it arrive."""

    id: str
    team: str
    owner: str
    submit: float
    width: int
    budget: int  # each task's memory budget, bytes
    duration: float  # true training seconds
    spec: JobSpec
    priority: int
    sweep: bool
    rate: float  # steps per second


class Draw(NamedTuple):
    """A job as drawn, before its submission time."""

    team: str
    owner: str
    width: int
    budget: int
    duration: float
    priority: str


@dataclasses.dataclass(frozen=True)
class Trace:
    workers: list[int]  # each worker's budget, bytes
    jobs: list[JobTemplate]
    span: float  # the arrival window, seconds
    queues: Queues
    entitled: dict[str, float]  # team -> nominal share
    sweeps: int

    @property
    def offered(self) -> float:
        """Offered load: the jobs' work over the cluster's worker-seconds in the window."""
        return sum(j.width * j.duration for j in self.jobs) / (len(self.workers) * self.span)


def _pick(rng: random.Random, weighted: Sequence[tuple[T, float]]) -> T:
    r, acc = rng.random() * sum(w for _, w in weighted), 0.0
    for value, w in weighted:
        acc += w
        if r < acc:
            return value
    return weighted[-1][0]


def _intensity(t: float) -> float:
    """The submission rate at ``t`` seconds into the week, relative to its peak."""
    hour = (t % DAY) / HOUR
    day = int(t // DAY) % 7
    diurnal = 1 + DIURNAL_AMPLITUDE * math.cos(2 * math.pi * (hour - PEAK_HOUR) / 24)
    return diurnal * (WEEKEND if day >= 5 else 1.0) / (1 + DIURNAL_AMPLITUDE)


def _round_limit(s: float) -> float:
    step = 15 * MINUTE if s < 2 * HOUR else HOUR
    return math.ceil(s / step) * step


def _duration(rng: random.Random, width: int) -> float:
    median = MEDIAN_S * width ** WIDTH_EXPONENT
    return rng.lognormvariate(math.log(median), SIGMA)


def make_trace(seed: int, days: float, workers: int, load: float) -> Trace:
    rng = random.Random(seed)
    budgets: list[int] = []
    for i, (gib, share) in enumerate(WORKER_MIX):
        n = round(share * workers) if i < len(WORKER_MIX) - 1 else workers - len(budgets)
        budgets += [gib * GiB] * n
    span = days * DAY
    # how many workers could take a task of each memory class
    eligible = [sum(b >= hi * GiB for b in budgets) for _, hi, _ in MEMORY_CLASSES]
    nominal = [round(s * workers) for _, s, _ in TEAMS[:-1]]
    nominal.append(workers - sum(nominal))
    queues = Queues(tuple(
        Queue(name, members=tuple(f"{name}-u{k}" for k in range(1, USERS_PER_TEAM + 1)),
              nominal=Share(n, UNBOUNDED), borrow=Share(workers - n, 0))
        for (name, _, _), n in zip(TEAMS, nominal)), dict(DEFAULT_CLASSES), DEFAULT_HALF_LIFE_S)
    users = [(k, 1.0 / k) for k in range(1, USERS_PER_TEAM + 1)]
    sweep_widths = [(w, p) for w, p in WIDTHS if w <= SWEEP_MAX_WIDTH]
    classes = [(i, p) for i, (_, _, p) in enumerate(MEMORY_CLASSES)]
    target = load * workers * span
    # submissions (one job, or a sweep of many) drawn until their work reaches the target
    drawn: list[list[Draw]] = []
    work = 0.0
    while work < target:
        team = _pick(rng, [(t, d) for t, _, d in TEAMS])
        owner = f"{team}-u{_pick(rng, users)}"
        sweep = rng.random() < SWEEP_P
        width = min(workers, _pick(rng, sweep_widths if sweep else list(WIDTHS)))
        cls = _pick(rng, classes)
        while cls > 0 and eligible[cls] < width:
            cls -= 1
        lo, hi, _ = MEMORY_CLASSES[cls]
        budget = int(rng.uniform(lo, hi) * GiB)
        if sweep:
            base = _duration(rng, width)
            durations = [base * rng.lognormvariate(0.0, SWEEP_SIGMA)
                         for _ in range(rng.randint(*SWEEP_SIZE))]
            prio = "low"
        else:
            durations = [_duration(rng, width)]
            prio = "high" if rng.random() < HIGH_P else "normal"
        group = [Draw(team, owner, width, budget, min(MAX_DURATION_S, max(MIN_DURATION_S, d)),
                      prio) for d in durations]
        work += sum(d.width * d.duration for d in group)
        drawn.append(group)
    # their submission times: the diurnal density, by rejection
    times = []
    for _ in drawn:
        while True:
            t = rng.random() * span
            if rng.random() < _intensity(t):
                times.append(t)
                break
    times.sort()
    jobs: list[JobTemplate] = []
    for at, group in zip(times, drawn):
        for k, d in enumerate(group):
            job_id = f"j{len(jobs) + 1:06d}"
            limit = _round_limit(d.duration * rng.uniform(*LIMIT_FACTOR)) \
                if rng.random() < LIMIT_P else 0.0
            rate = rng.uniform(*RATE_STEPS_S)
            spec = JobSpec.from_dict({
                "name": job_id, "strategy": "mirrored", "workers": d.width,
                "data": {"batch_size": BATCH},
                "training": {"steps": max(1, round(d.duration * rate)), "time_limit": limit},
                "queue": d.team, "priority": d.priority})
            jobs.append(JobTemplate(job_id, d.team, d.owner, T0 + at + k * 1e-3, d.width,
                                    d.budget, d.duration, spec, DEFAULT_CLASSES[d.priority],
                                    len(group) > 1, rate))
    return Trace(budgets, jobs, span, queues, {t: s for t, s, _ in TEAMS},
                 sum(len(g) > 1 for g in drawn))
