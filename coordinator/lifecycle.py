"""A job's life once admitted, the half of ``Coordinator`` that changes jobs: its state changes
and events, the stop of its tasks, what a report moves, a task's failure, a restart and its
resumption, and the memory probe that sizes it. Decisions come from ``coordinator.decisions``
(pure, tested by tables); this class carries them out on ``ClusterState`` and the ``Store``,
writing each change before any message it causes is sent (messages go to the agents' queues,
which their streams read only after the call that queued them has returned).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import secrets
from typing import Callable

from strata import strategies
from strata.coordinator import decisions
from strata.coordinator.admission import PROBE_GROWTH, prepare, probe_plan, probe_spec, tasks_of
from strata.coordinator.agents import NO_NEEDS, Needs, NoticeCommand, StopTaskCommand
from strata.coordinator.blobs import BlobStore
from strata.coordinator.confine import job_blobs
from strata.coordinator.state import ClusterState
from strata.coordinator.store import Store
from strata.errors import DiskFull, InvalidTransition, SpecError
from strata.measured import bound_of, task_kind
from strata.oom import describe as describe_oom
from strata.oom import needed_bytes
from strata.jobspec import JobSpec
from strata.strategies import describe_failure
from strata.types import (
    FailureKind, Job, JobPlan, JobState, Task, TaskPlan, TaskReport, TaskState, can_transition,
)
from strata.units import format_size

log = logging.getLogger("strata.coordinator")

# how long a job waits, after its probe ended, for the probe's remaining tasks to report their end
PROBE_SETTLE_S = 30.0


class JobLifecycle:
    """The jobs' side of the coordinator (``Coordinator`` adds admission, agents, the control
    loop and views)."""

    def __init__(self, store: Store, state: ClusterState, blobs: BlobStore,
                 clock: Callable[[], float]):
        self.store = store
        self.blobs = blobs
        self.clock = clock
        #: client request id -> the job its SubmitJob created (a retried submit returns it)
        self._by_request: dict[str, str] = store.request_ids()
        #: task kind -> bytes it was measured to need (``strata.measured``)
        self.measured: dict[str, int] = store.load_measured()
        #: every job (the live ones loaded, finished ones when first looked up), every agent,
        #: and the indexes derived from them (``coordinator.state``)
        self.state = state
        self.jobs = self.state.jobs
        #: jobs with a notice in flight (``recovery.notice_step``), whose deadline the tick
        #: watches (``_notices_due``); rebuilt from the store's live jobs
        self._notices: set[str] = {j.id for j in self.state.live.values()
                                   if j.recovery.notice_step}
        self.agents = self.state.agents
        self.workers = self.agents.workers
        self._signals: dict[str, asyncio.Event] = {}
        self._wake = asyncio.Event()
        self._metrics_saved: dict[str, float] = {}
        #: job id -> the notes its tasks sent that are events already
        self._notes_said: dict[str, set[str]] = {}
        #: job id -> its memory probe's job id (``memory.profile``), while the job waits for it.
        #: Not persisted: after a coordinator restart a waiting job runs on its estimates.
        self._probe_of: dict[str, str] = {}
        #: job id -> (role, index, budget) of the task whose out-of-memory failure restarts it:
        #: the re-plan must give that task more (in memory: after a coordinator restart the
        #: measured need, which is stored, raises the plan anyway)
        self._oom_budget: dict[str, tuple[str, int, int]] = {}
        #: per task kind (``strata.measured``), the largest single allocation a task reported
        #: (its all-reduce pack): a budget made from a probe keeps room for it. In memory only:
        #: a job planned after a restart of the coordinator has its estimators' room
        self.largest_alloc: dict[str, int] = {}


    # --- notifications ------------------------------------------------------------------------

    def _notify(self, job_id: str) -> None:
        """Wakes the job's watchers (state, task or progress changes)."""
        ev = self._signals.pop(job_id, None)
        if ev is not None:
            ev.set()

    def _signal(self, job_id: str) -> asyncio.Event:
        ev = self._signals.get(job_id)
        if ev is None:
            ev = self._signals[job_id] = asyncio.Event()
        return ev

    def wake(self) -> None:
        self._wake.set()

    def _event(self, job: Job, kind: str, message: str) -> None:
        """An event of the job: what it says, for its watchers. With the disk full it is
        logged and not kept: a state change that was written stands without its event."""
        try:
            self.store.add_event(job.id, self.clock(), kind, message)
        except DiskFull as e:
            log.error("job %s: event not kept (%s): %s", job.id, e, message)
        log.info("job %s: %s", job.id, message)
        self._notify(job.id)

    def _task(self, job_id: str, role: str, index: int) -> Task | None:
        return self._job_task(job_id, role, index)[1]

    def _job_task(self, job_id: str, role: str, index: int) -> tuple[Job | None, Task | None]:
        """The job of that id and its task of that role and index (None where there is none)."""
        job = self.jobs.get(job_id)
        if job is None:
            return None, None
        return job, next((t for t in job.tasks if t.role == role and t.index == index), None)

    def _set_job_state(self, job: Job, target: JobState, message: str,
                       stored: bool = False) -> None:
        """Moves ``job`` to ``target``, written first (``stored``: the caller wrote it), then
        said as an event."""
        if not can_transition(job.state, target):
            raise InvalidTransition("job", job.state.value, target.value)
        before = (job.state, job.message, job.finished_at)
        job.state = target
        job.message = message
        if target.final:
            job.finished_at = self.clock()
        try:
            if not stored:
                self.store.put_job(job)
        except BaseException:  # not written (a full disk): not changed
            job.state, job.message, job.finished_at = before
            raise
        if target.final:
            self.state.job_ended(job)
        self._event(job, "state", f"{target.value}: {message}" if message else target.value)
        if target == JobState.SUCCEEDED and not job.recovery.probe_of:  # a probe keeps no files
            self._write_metrics(job)
        if target.final:
            self.wake()  # its reservations are free once its processes are gone

    def _write_metrics(self, job: Job) -> None:
        """``metrics.json`` among the job's outputs: its final figures, for ``strata
        download`` (the model comes from the agent that ran the lead task)."""
        m = job.metrics
        def num(x: float | None) -> float | None:
            return x if x is not None and math.isfinite(x) else None

        body = {"job_id": job.id, "name": job.name, "strategy": job.strategy,
                "state": job.state.value, "steps": m.step, "loss": num(m.loss),
                "test_loss": num(m.test_loss), "test_accuracy": num(m.test_accuracy),
                "examples_per_sec": m.examples_per_sec, "finished_at": job.finished_at,
                "tasks": [{"task": f"{t.role}:{t.index}", "worker": t.worker,
                           "memory_budget_bytes": t.memory_budget_bytes,
                           "peak_memory_bytes": t.peak_memory_bytes,
                           "weights_sha256": t.weights_sha256} for t in job.tasks]}
        try:
            self.blobs.write_output(job.id, "metrics.json",
                                    (json.dumps(body, indent=1) + "\n").encode(), job.owner)
        except OSError as e:
            log.warning("cannot write metrics.json of %s: %s", job.id, e)

    def _add_job(self, spec: JobSpec, plan: JobPlan, note: str = "",
                 request_id: str = "", owner: str = "", probe_of: str = "",
                 deadline: float = 0.0) -> Job:
        now = self.clock()
        job_id = f"{spec.name}-{secrets.token_hex(3)}"
        while job_id in self.jobs:
            job_id = f"{spec.name}-{secrets.token_hex(3)}"
        job = Job(id=job_id, name=spec.name, state=JobState.PENDING, strategy=spec.strategy,
                  spec=spec, created_at=now, estimated_memory_bytes=plan.largest_estimate,
                  message="waiting for workers")
        job.recovery.request_id = request_id
        job.recovery.probe_of = probe_of
        job.recovery.capacity_deadline = deadline
        job.owner = owner
        job.tasks = tasks_of(job_id, plan)
        self.store.put_job(job)
        self.store.put_tasks(job.tasks)
        self.blobs.attach(job_id, owner, job_blobs(spec))
        self.state.add_job(job)  # only once stored: a failed write leaves no phantom job
        if request_id:
            self._by_request[request_id] = job_id
        what = strategies.get(spec.strategy).describe_plan(spec, plan)
        self._event(job, "state", f"PENDING: submitted{'; ' + note if note else ''}; {what}")
        low = [t for t in plan.tasks if t.memory_budget_bytes < t.estimated_memory_bytes]
        if spec.memory.per_task_budget and low:
            self._event(job, "message", f"warning: memory.per_task_budget "
                                        f"{format_size(low[0].memory_budget_bytes)} is below the "
                                        f"estimate "
                                        f"{format_size(max(t.estimated_memory_bytes for t in low))}"
                                        f" of {len(low)} task(s); they may run out of memory")
        self.wake()
        return job

    def _start_probe(self, job: Job, probe: Job | JobPlan, budget: int) -> None:
        """Has ``job`` wait for its probe run (``memory.profile``): ``probe``, or a new one of
        this plan with each task's budget at most ``budget`` (0: the plan's own)."""
        assert job.spec is not None
        if isinstance(probe, JobPlan):
            probe = self._add_job(probe_spec(job.spec), probe_plan(probe, budget),
                                  note=f"memory probe of job {job.spec.name!r}",
                                  owner=job.owner, probe_of=job.id)
        probing = probe.spec
        assert probing is not None
        probe.recovery.probe_of = job.id
        self.store.put_job(probe)
        self._probe_of[job.id] = probe.id
        job.message = f"waiting for its memory probe {probe.id}"
        self.store.put_job(job)
        at = (f" with {format_size(budget)} per task (it grows if that runs out)" if budget
              else "")
        self._event(job, "message", f"memory.profile: probe job {probe.id} runs "
                                    f"{probing.training.steps} steps of this plan{at} to measure "
                                    "each task's peak; the job is planned with those figures")

    def _stop_job(self, job: Job, target: JobState, message: str) -> None:
        """Moves the job to a final state and tells agents to stop its remaining processes.

        Tasks never started are cancelled at once; running ones stay reserved until their agent
        reports the process gone (or the agent is lost), so budgets are never double-booked.
        """
        self._set_job_state(job, target, message)
        self._stop_tasks(job, message)

    def _stop_tasks(self, job: Job, message: str) -> None:
        """Tells the agents to stop the job's remaining processes (see ``_stop_job``)."""
        stop = decisions.stopping(job, self._agent_lost)
        for t in stop.cancel:
            self.state.set_task_state(t, TaskState.CANCELLED)
            t.message = t.message or message
        for t in stop.lost:
            self.state.set_task_state(t, TaskState.FAILED)
            t.failure = FailureKind.LOST
        self.store.put_tasks(job.tasks)
        for name in stop.tell:
            self.agents.send(name, StopTaskCommand(job_id=job.id, reason=message))
        self._notify(job.id)

    def _agent_lost(self, name: str) -> bool | None:
        w = self.agents.get(name)
        return None if w is None else w.lost

    def _notice(self, job: Job, worker: str, deadline_s: float) -> None:
        """A notice that ``worker`` leaves within ``deadline_s``: ``job``'s tasks save a
        checkpoint after a step they all reach in time (``decisions.notice``) and stop, and the
        job restarts from it (``_notice_saved``), or at the deadline from its last periodic
        one (``_notices_due``); with no step to save at, it restarts at once."""
        if job.recovery.notice_step:
            return  # one in flight: its step and deadline stand
        plan = self._save_at(job, deadline_s)
        if not plan.step:
            self._restart(job, f"worker {worker} leaves within {deadline_s:g} s and no "
                               f"checkpoint is saved on notice: {plan.reason}", failure=False)
            return
        self._save_and_stop(job, plan.step, deadline_s, "notice",
                            f"worker {worker} leaves within {deadline_s:g} s: every task saves "
                            f"a checkpoint after step {plan.step} and stops; the job resumes "
                            "from it")

    def _save_at(self, job: Job, deadline_s: float) -> decisions.NoticePlan:
        """Where ``job``'s tasks can save a checkpoint together within ``deadline_s``."""
        assert job.spec is not None
        workers = [self.workers.get(t.worker) for t in job.tasks if t.worker]
        storage = all(w is not None and w.record.shared_dir for w in workers)
        rate = job.metrics.examples_per_sec / max(1, job.spec.data.batch_size)
        return decisions.notice(job, deadline_s, rate, storage=storage)

    def _save_and_stop(self, job: Job, step: int, deadline_s: float, kind: str,
                       message: str) -> None:
        """Every task of ``job`` saves a checkpoint after ``step`` and stops (a notice); the
        job restarts from it once saved (``_notice_saved``), or from its last periodic one
        past ``deadline_s`` (``_notices_due``)."""
        job.recovery.notice_step = step
        job.recovery.notice_deadline = self.clock() + deadline_s
        self.store.put_job(job)
        self._notices.add(job.id)
        self._event(job, kind, message)
        for name in dict.fromkeys(t.worker for t in job.tasks if t.worker and not t.state.final):
            self.agents.send(name, NoticeCommand(job_id=job.id, step=step))

    def _notice_saved(self, job: Job) -> None:
        """The lead reported the checkpoint its notice asked for: the job restarts from it."""
        self._notices.discard(job.id)
        self._restart(job, f"its checkpoint at step {job.checkpoint_step} was saved on notice",
                      failure=False)

    def _notices_due(self, now: float) -> None:
        """Notices whose deadline passed before their checkpoint was reported: the job
        restarts from its last periodic checkpoint, and says so."""
        for job_id in list(self._notices):
            job = self.jobs.get(job_id)
            if job is None or not job.recovery.notice_step \
                    or job.state not in (JobState.SCHEDULED, JobState.RUNNING):
                self._notices.discard(job_id)
            elif now >= job.recovery.notice_deadline:
                self._notices.discard(job_id)
                self._restart(job, f"its notice's deadline passed before the checkpoint at "
                                   f"step {job.recovery.notice_step} was saved", failure=False)

    def _device_bytes(self, worker: str) -> int:
        """The whole budget of agent ``worker`` (0: not known)."""
        where = self.agents.get(worker)
        return where.record.budget_bytes if where is not None else 0

    def _move_task(self, job: Job, task: Task, r: TaskReport,
                   fx: decisions.ReportEffects) -> None:
        """A report's move of its task: a failure goes to the failure policy; a change is
        written before it is made, then the job decides on it."""
        if fx.move == decisions.FAIL_OOM:
            self._fail_oom(job, task, r)
        elif fx.move == decisions.FAIL:
            self._fail_task(job, task, fx.failure, fx.message, exit_code=fx.exit_code)
        elif fx.move == decisions.CHANGE:
            # the task's account of an out-of-memory failure it caused is kept
            message = task.message if task.failure == FailureKind.OOM else fx.message
            # written before it is changed (``_fail_task``)
            self.store.put_tasks([dataclasses.replace(
                task, state=fx.state, exit_code=fx.exit_code, message=message)])
            self.state.set_task_state(task, fx.state)
            task.exit_code, task.message = fx.exit_code, message
            if task.state.final and task.failure != FailureKind.OOM:
                # (the peak of a task that ran out is short of its need: ``_fail_oom`` kept
                # the bound)
                self._remember_peak(job, task)
            self.store.put_tasks([task])
            self._after_task_change(job, task)

    def _remember_peak(self, job: Job, task: Task, needed: int = 0) -> None:
        """Keeps what a task of this kind was seen to need (``strata.measured``): its peak, or
        for an out-of-memory failure (``needed``) the lower bound on its need, kept apart
        (``strata.measured.bound_of``): a plan is raised to a bound but never lowered to it."""
        need = max(needed, task.peak_memory_bytes)
        if job.spec is None or need <= 0:
            return
        kind = task_kind(job.spec, task.role, task.index, task.first_layer, task.last_layer)
        if needed:
            kind = bound_of(kind)
        if need > self.measured.get(kind, 0):
            self.measured[kind] = need
            self.store.put_measured(kind, need, job.id, self.clock())

    def _fail_oom(self, job: Job, reporter: Task, r: TaskReport) -> None:
        """An out-of-memory failure, blamed on the task whose device ran out (in pipeline and
        parameter-server jobs the driver runs ops on other tasks, and the error reaches it),
        described with that task's budget, peak and the allocation that failed, and what would
        fit; the task's need is kept for the next plan of this job."""
        strategy = strategies.get(job.strategy)
        culprit = reporter
        if r.oom is not None and r.oom.task:
            role, _, index = r.oom.task.partition(":")
            found = self._task(job.id, role, int(index)) if index.isdigit() else None
            if found is not None:
                culprit = found
        name = f"{culprit.role}:{culprit.index}"
        reporter_name = f"{reporter.role}:{reporter.index}"
        text = describe_oom(name, strategy.where(job, culprit), culprit.memory_budget_bytes,
                            culprit.estimated_memory_bytes, culprit.peak_memory_bytes, r.oom,
                            strategy.oom_levers(job, culprit), reporter=reporter_name)
        alloc = r.oom.allocation_bytes if r.oom is not None else 0
        # what it learns is never more than the device it ran on: an agent's report is no
        # more to be believed than its device (and the need is kept for every job like it)
        device = self._device_bytes(culprit.worker)
        need = needed_bytes(culprit.memory_budget_bytes, culprit.peak_memory_bytes, alloc)
        self._remember_peak(job, culprit, min(need, device) if device else need)
        if culprit is not reporter:
            culprit.failure = FailureKind.OOM
            culprit.message = text
            self.store.put_tasks([culprit])
            text_for_reporter = f"an op it ran on {name} failed there: {text}"
        else:
            text_for_reporter = text
        self._fail_task(job, reporter, FailureKind.OOM, text_for_reporter,
                        exit_code=r.exit_code, culprit=culprit)

    def _fail_task(self, job: Job, task: Task, failure: FailureKind, message: str,
                   exit_code: int = 0, culprit: Task | None = None) -> None:
        """``task`` failed. ``culprit``: for an out-of-memory failure, the task whose device
        ran out (another one's, when a driver ran ops there): the one a re-plan must give
        more."""
        # written before it is changed: a full disk leaves the task as it was, for the
        # agent's report to be tried again
        self.store.put_tasks([dataclasses.replace(task, state=TaskState.FAILED, failure=failure,
                                                  exit_code=exit_code, message=message)])
        self.state.set_task_state(task, TaskState.FAILED)
        task.failure = failure
        task.exit_code = exit_code
        task.message = message
        self.store.put_tasks([task])
        self._event(job, "task", f"task {task.role}:{task.index} on {task.worker} failed "
                                 f"({failure.value}): {describe_failure(task)}")
        oom = (culprit or task) if failure == FailureKind.OOM else None
        policy = strategies.get(job.strategy).on_failure(job, task)
        # the policy judges the process that died: a driver that failed on another task's
        # device is still a dead driver (``_fail_oom`` names where memory ran out)
        step = decisions.on_failure(
            job, decisions.failure_step(policy.action, policy.message),
            memory_retry=oom is not None and decisions.may_retry_memory(
                job, oom, self._device_bytes(oom.worker)))
        if step.action == decisions.CONTINUE:
            self._event(job, "message", step.message)
        elif step.action == decisions.MEMORY_RETRY:
            # the first OOM of a budget Strata chose (from its estimate or its probe's peak):
            # the budget was a guess, and a run can outgrow its probe (``bench/peak_growth.py``:
            # an LSTM's peak at 1.36 x its probe's). Not counted against restart.max_restarts.
            job.recovery.memory_retried = True
            self._restart(job, f"{step.message}; the budget was Strata's estimate, so the job "
                               "restarts once with what the task was seen to need",
                          failure=False, oom=oom)
        elif step.action == decisions.RESTART:
            self._restart(job, step.message, failure=True, oom=oom)
        elif step.action == decisions.FAIL_JOB:
            self._stop_job(job, JobState.FAILED, step.message)

    def _restart(self, job: Job, cause: str, *, failure: bool, oom: Task | None = None) -> None:
        """RESTARTING: the job's remaining tasks are stopped; once they are gone and
        ``restart.backoff_s`` has passed, the tick plans the job again on the workers there are
        and places it (``_resume``); its tasks resume from the latest checkpoint."""
        r = decisions.restart(job, cause, self.clock(), failure=failure, oom=oom)
        job.restarts = r.restarts
        for name, value in r.recovery.items():
            setattr(job.recovery, name, value)
        # out of memory is not retried on the same plan: the re-plan must give it more
        if r.oom_budget is None:
            self._oom_budget.pop(job.id, None)
        else:
            self._oom_budget[job.id] = r.oom_budget
        self._set_job_state(job, JobState.RESTARTING, r.message)
        self._event(job, "restart", r.event)
        self._stop_tasks(job, f"its job restarts: {cause}")

    def _resume(self, job: Job) -> None:
        """A RESTARTING job whose tasks are gone and whose backoff has passed: planned again
        on the workers available now (narrower when fewer are left: ``Strategy.narrow``), then
        placed like a pending job. A plan that no longer fits fails the job with the reason."""
        assert job.spec is not None
        rec = job.recovery
        try:
            spec, plan = self._replan(job)
        except SpecError as e:
            self._stop_job(job, JobState.FAILED, f"cannot restart: {e}")
            return
        oom = self._oom_budget.pop(job.id, None)
        if not plan.feasible:
            self._stop_job(job, JobState.FAILED, f"cannot restart on this cluster: {plan.reason}"
                           + (f" (after {rec.last_cause})" if oom else ""))
            return
        if oom is not None:
            role, index, old = oom
            new = next((t.memory_budget_bytes for t in plan.tasks
                        if (t.role, t.index) == (role, index)), 0)
            if new and new <= old:
                self._stop_job(job, JobState.FAILED, (
                    f"{rec.last_cause}; not restarted: a new plan gives {role}:{index} the same "
                    f"{format_size(old)} (memory.per_task_budget fixes it); it needs more"))
                return
        if spec.workers != job.spec.workers:
            self._width_changed(job, spec)
        attempt = max((t.attempt for t in job.tasks), default=0)
        job.spec = spec
        job.tasks = tasks_of(job.id, plan, attempt)
        job.estimated_memory_bytes = plan.largest_estimate
        rec.replanned = True
        job.message = f"restart {job.restarts}: waiting for workers"
        self.store.replace_tasks(job.id, job.tasks)
        self.store.put_job(job)

    def _replan(self, job: Job) -> tuple[JobSpec, JobPlan]:
        """The spec and plan a restart of ``job`` runs: as wide as asked, or narrower when
        fewer agents are connected (``Strategy.narrow``). Raises ``SpecError``."""
        assert job.spec is not None
        offers = self.state.whole_offers(Needs.of(job.spec))
        wanted = dataclasses.replace(
            job.spec, workers=job.recovery.requested_workers or job.spec.workers)
        spec = strategies.get(job.strategy).narrow(wanted, len(offers)) if offers else wanted
        return spec, prepare(spec, offers, self.measured, largest=self.largest_alloc).plan

    def _width_changed(self, job: Job, spec: JobSpec) -> None:
        """A restart of ``job`` runs ``spec``, of another width than before."""
        assert job.spec is not None
        wanted = job.recovery.requested_workers or job.spec.workers
        self._event(job, "message", f"restart {job.restarts}: {spec.workers} of "
                                    f"{wanted} workers available; the job runs "
                                    f"{spec.workers} wide, global batch "
                                    f"{spec.data.batch_size} kept")

    def _after_task_change(self, job: Job, task: Task) -> None:
        self._event(job, "task", f"task {task.role}:{task.index} on {task.worker}: {task.state.value}")
        step = decisions.on_task_change(job, task, strategies.get(job.strategy))
        if step.cancelled:
            task.failure = FailureKind.CANCELLED
            self.store.put_tasks([task])
        if step.action == decisions.WAKE:
            self.wake()
        elif step.action == decisions.RESTART:
            self._restart(job, step.message, failure=True)
        elif step.action == decisions.FAIL_JOB:
            self._stop_job(job, JobState.FAILED, step.message)
        elif step.action == decisions.SUCCEED_AND_STOP:
            self._stop_job(job, JobState.SUCCEEDED, step.message)
        elif step.action == decisions.SUCCEED:
            self._set_job_state(job, JobState.SUCCEEDED, step.message)
        elif step.action == decisions.RUN:
            self._set_job_state(job, JobState.RUNNING, step.message)
            self._running(job)

    def _running(self, job: Job) -> None:
        """``job`` has just become RUNNING (every task runs)."""

    def _after_probe(self, job: Job) -> bool:
        """Whether ``job`` may be scheduled: its memory probe has ended and the job's tasks now
        carry what the probe measured (estimates set to the measured peaks after a probe that
        succeeded; raised to what a probe that ran out of memory needed). A probe that failed
        otherwise fails the job with its reason: the job would fail the same way."""
        probe = self.jobs.get(self._probe_of[job.id])
        if probe is not None and not probe.state.final:
            return False
        if probe is not None and any(not t.state.final for t in probe.tasks) \
                and self.clock() - probe.finished_at < PROBE_SETTLE_S:
            return False  # its server tasks are being stopped: their last peaks come with that
        del self._probe_of[job.id]
        if probe is None or probe.state == JobState.CANCELLED:
            self._event(job, "message", "memory probe did not finish; planned on the estimates")
            return True
        oom = any(t.failure == FailureKind.OOM for t in probe.tasks)
        if probe.state == JobState.FAILED and oom and self._grow_probe(job, probe):
            return False
        if probe.state == JobState.FAILED and not oom:
            self._stop_job(job, JobState.FAILED, f"its memory probe {probe.id} failed: "
                                                 f"{probe.message}")
            return False
        assert job.spec is not None
        try:
            # on the event loop, once per probed job: the stage planner takes tens of ms, up
            # to ~0.7 s on its stress case (bench/planner_speed.py), under a heartbeat timeout
            plan = prepare(job.spec, self.state.whole_offers(NO_NEEDS), self.measured,
                           probed=probe.state == JobState.SUCCEEDED,
                           largest=self.largest_alloc).plan
        except SpecError as e:
            self._stop_job(job, JobState.FAILED, f"after its memory probe: {e}")
            return False
        if not plan.feasible:
            self._stop_job(job, JobState.FAILED, f"after its memory probe {probe.id}: "
                                                 f"{plan.reason}")
            return False
        new = {(t.role, t.index): t for t in plan.tasks}
        if set(new) != {(t.role, t.index) for t in job.tasks} or any(
                (new[(t.role, t.index)].first_layer, new[(t.role, t.index)].last_layer)
                != (t.first_layer, t.last_layer) for t in job.tasks):
            # the workers changed since submission and the planner would now split it
            # otherwise: the probe measured another layout, so keep the planned estimates
            self._event(job, "message", "the plan changed during the memory probe; planned "
                                        "on the estimates")
            return True
        changes = []
        for t in job.tasks:
            p = new[(t.role, t.index)]
            if p.estimated_memory_bytes != t.estimated_memory_bytes:
                changes.append(f"{t.role}:{t.index} {format_size(t.estimated_memory_bytes)} -> "
                               f"{format_size(p.estimated_memory_bytes)} (budget "
                               f"{format_size(p.memory_budget_bytes)})")
            t.estimated_memory_bytes = p.estimated_memory_bytes
            t.memory_budget_bytes = p.memory_budget_bytes
        job.estimated_memory_bytes = plan.largest_estimate
        job.message = "waiting for workers"
        self.store.put_tasks(job.tasks)
        self.store.put_job(job)
        self._event(job, "message", f"memory probe {probe.id} {probe.state.value}; estimates "
                                    + ("set to its measured peaks: " + ", ".join(changes)
                                       + ("" if job.spec.memory.per_task_budget else
                                          " (budgets: each peak plus 25%, at least 16 MiB, or "
                                          "room for the task's largest allocation)")
                                       if changes else "kept"))
        return True

    def _needed(self, job: Job) -> int:
        """The most any of ``job``'s task kinds was seen to need: a peak or an out-of-memory
        bound (``strata.measured``)."""
        assert job.spec is not None
        kinds = [task_kind(job.spec, t.role, t.index, t.first_layer, t.last_layer)
                 for t in job.tasks]
        return max((max(self.measured.get(k, 0), self.measured.get(bound_of(k), 0))
                    for k in kinds), default=0)

    def _grow_probe(self, job: Job, probe: Job) -> bool:
        """After ``probe`` ran out of memory under a first budget smaller than the job's plan
        (``first_probe_budget``): a new probe with more, at least ``PROBE_GROWTH`` times as
        much and half again what the failed one was seen to need, up to the plan's budget.
        False when the probe already had the plan's budget: the job is planned on what it
        needed (``_after_probe``)."""
        had = max((t.memory_budget_bytes for t in probe.tasks), default=0)
        cap = min((t.memory_budget_bytes for t in job.tasks), default=0)
        if not had or had >= cap:
            return False
        needed = self._needed(job)
        budget = min(cap, max(had * PROBE_GROWTH, needed * 3 // 2))
        plan = JobPlan(job.strategy, True, "", tuple(
            TaskPlan(t.role, t.index, t.estimated_memory_bytes, t.memory_budget_bytes,
                     stage=t.stage, replica=t.replica, first_layer=t.first_layer,
                     last_layer=t.last_layer) for t in job.tasks))
        self._event(job, "message", f"memory probe {probe.id} ran out of memory at "
                                    f"{format_size(had)} per task (it needed at least "
                                    f"{format_size(needed)}); probing again at "
                                    f"{format_size(budget)}")
        self._start_probe(job, plan, budget)
        return True
