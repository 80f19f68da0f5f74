"""The coordinator's jobs by id, with the history kept on disk until someone asks for it.

A coordinator holds every job it has not deleted (``--retention`` deletes old ones). Parsing
all of them at start made a restart cost what the history weighs: 20 s for 100,000 finished
jobs of 4 tasks, against the issue's target of 3 s. ``JobTable`` starts with the jobs that are
not over (``Store.load_live_jobs``) as ``Job`` objects and only a ``JobSummary`` of each of
the others: id, state, times and restarts, what listing, paging, metrics and retention need.
A finished job is loaded from the store the first time it is looked up (``table[id]``), then
kept like any other.

Iterating ``values()`` loads every job: the hot paths read ``ClusterState.live``, and the
views over all jobs read ``summaries()`` and load only what they show.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, MutableMapping, TypeVar, overload

from strata.types import Job, JobSummary

if TYPE_CHECKING:
    from strata.coordinator.store import Store


_T = TypeVar("_T")


class JobTable(MutableMapping[str, Job]):
    def __init__(self, store: "Store"):
        self._store = store
        self._loaded: dict[str, Job] = {j.id: j for j in store.load_live_jobs()}
        #: finished jobs (and their tasks) not loaded yet: every job the store holds but the
        #: live ones
        self._cold: dict[str, JobSummary] = {
            s.id: s for s in store.load_job_summaries() if s.id not in self._loaded}

    def __getitem__(self, job_id: str) -> Job:
        job = self._loaded.get(job_id)
        if job is not None:
            return job
        if job_id not in self._cold:
            raise KeyError(job_id)
        job = self._store.load_job(job_id)
        del self._cold[job_id]
        if job is None:  # deleted under us: nothing else deletes rows, but never invent one
            raise KeyError(job_id)
        self._loaded[job_id] = job
        return job

    @overload
    def get(self, job_id: str, /) -> Job | None: ...
    @overload
    def get(self, job_id: str, /, default: Job | _T) -> Job | _T: ...

    def get(self, job_id: str, /, default: Any = None) -> Any:
        """``Mapping.get`` without raising and catching for a loaded job: a heartbeat looks up
        each of its tasks' jobs."""
        job = self._loaded.get(job_id)
        if job is not None:
            return job
        if job_id not in self._cold:
            return default
        try:
            return self[job_id]
        except KeyError:
            return default

    def __setitem__(self, job_id: str, job: Job) -> None:
        self._cold.pop(job_id, None)
        self._loaded[job_id] = job

    def __delitem__(self, job_id: str) -> None:
        if self._loaded.pop(job_id, None) is None and self._cold.pop(job_id, None) is None:
            raise KeyError(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._loaded or job_id in self._cold

    def __iter__(self) -> Iterator[str]:
        yield from list(self._loaded)
        yield from list(self._cold)

    def __len__(self) -> int:
        return len(self._loaded) + len(self._cold)

    def summaries(self) -> list[JobSummary]:
        """Every job's summary, loaded or not (a loaded job's as it is now)."""
        return [JobSummary.of(j) for j in self._loaded.values()] + list(self._cold.values())

    def loaded_jobs(self) -> list[Job]:
        """The jobs held as objects (the live ones, and those looked up since)."""
        return list(self._loaded.values())
