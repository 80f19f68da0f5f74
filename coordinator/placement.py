"""Placement: a pure decision, no side effects. The coordinator applies it.

Gang scheduling: every task of a job is placed at once or none is. Tasks of one job go to
distinct agents (an agent owns one device; two replicas of one job on one device would only
contend for it). Agents may run tasks of several jobs while their budgets allow.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Iterator

from strata.units import format_size


@dataclasses.dataclass(frozen=True)
class TaskDemand:
    role: str
    index: int
    budget_bytes: int


@dataclasses.dataclass(frozen=True)
class Capacity:
    """An agent that can take tasks now: free = budget - reserved."""

    name: str
    budget_bytes: int
    free_bytes: int
    free_ports: int = 1 << 30


@dataclasses.dataclass(frozen=True)
class Placement:
    assignments: dict[tuple[str, int], str]  # (role, index) -> agent name
    reason: str = ""

    @property
    def placed(self) -> bool:
        return bool(self.assignments) or not self.reason


def place(demands: list[TaskDemand], agents: list[Capacity]) -> Placement:
    """Largest demand first, each to the agent with the least free budget that still fits.

    Since an agent that fits a demand fits every smaller one, this greedy order finds a placement
    whenever one exists under the one-task-per-agent rule, and it keeps large agents free for
    large tasks.
    """
    return Room(agents).place(demands)


class Room:
    """The agents that can take tasks now, kept in order of free budget as they change, so
    that placing a job costs the job's tasks and a binary search, not a pass over every
    agent: the coordinator ``set``s an agent whenever its reservation, ports or standing
    changed, and ``drop``s one that can take nothing (lost, draining)."""

    def __init__(self, agents: Iterable[Capacity] = ()) -> None:
        self._caps: dict[str, Capacity] = {a.name: a for a in agents}
        #: (free_bytes, name), ascending
        self._order: list[tuple[int, str]] = sorted((a.free_bytes, a.name)
                                                    for a in self._caps.values())

    def set(self, cap: Capacity) -> None:
        old = self._caps.get(cap.name)
        self._caps[cap.name] = cap
        if old is not None:
            if old.free_bytes == cap.free_bytes:
                return  # (its ports or budget changed: same place in the order)
            del self._order[bisect.bisect_left(self._order, (old.free_bytes, old.name))]
        bisect.insort(self._order, (cap.free_bytes, cap.name))

    def drop(self, name: str) -> None:
        old = self._caps.pop(name, None)
        if old is not None:
            del self._order[bisect.bisect_left(self._order, (old.free_bytes, old.name))]

    def get(self, name: str) -> Capacity | None:
        return self._caps.get(name)

    def __len__(self) -> int:
        return len(self._caps)

    def largest_free(self) -> int:
        """The most free budget any agent has (0: none): no task larger places."""
        return self._order[-1][0] if self._order else 0

    def __iter__(self) -> Iterator[Capacity]:
        """In order of free budget (then name)."""
        return (self._caps[name] for _, name in self._order)

    def place(self, demands: list[TaskDemand]) -> Placement:
        """``place`` on these agents."""
        if not demands:
            return Placement({})
        used: set[str] = set()
        out: dict[tuple[str, int], str] = {}
        for d in sorted(demands, key=lambda d: (-d.budget_bytes, d.role, d.index)):
            chosen = None
            for i in range(bisect.bisect_left(self._order, (d.budget_bytes, "")),
                           len(self._order)):
                name = self._order[i][1]
                if name not in used and self._caps[name].free_ports > 0:
                    chosen = name
                    break
            if chosen is None:
                need = max(x.budget_bytes for x in demands)
                fitting = len(self._order) - bisect.bisect_left(self._order, (need, ""))
                return Placement({}, reason=(
                    f"waiting for {len(demands)} workers with {format_size(need)} free each; "
                    f"{fitting} of {len(self._order)} connected workers have that much free"))
            used.add(chosen)
            out[(d.role, d.index)] = chosen
        return Placement(out)


def admission_error(demand_bytes: int, budgets: list[int]) -> str:
    """Why a job can never fit the registered workers, or "" if some worker could hold a task.

    With no workers registered yet the job is admitted and waits: workers may still join.
    """
    if not budgets or demand_bytes <= max(budgets):
        return ""
    return (f"each task needs {format_size(demand_bytes)} but the largest worker budget is "
            f"{format_size(max(budgets))}")
