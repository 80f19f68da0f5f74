"""Placement: a pure decision, no side effects. The coordinator applies it.

Gang scheduling: every task of a job is placed at once or none is. Tasks of one job go to
distinct agents (an agent owns one device; two replicas of one job on one device would only
contend for it). Agents may run tasks of several jobs while their budgets allow.
"""

from __future__ import annotations

import dataclasses

from strata.memory import format_size


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
    if not demands:
        return Placement({})
    pool = sorted((a for a in agents if a.free_ports > 0), key=lambda a: (a.free_bytes, a.name))
    used: set[str] = set()
    out: dict[tuple[str, int], str] = {}
    for d in sorted(demands, key=lambda d: (-d.budget_bytes, d.role, d.index)):
        chosen = next((a for a in pool if a.name not in used and a.free_bytes >= d.budget_bytes), None)
        if chosen is None:
            need = max(x.budget_bytes for x in demands)
            fitting = sum(1 for a in agents if a.free_bytes >= need)
            return Placement({}, reason=(
                f"waiting for {len(demands)} workers with {format_size(need)} free each; "
                f"{fitting} of {len(agents)} connected workers have that much free"))
        used.add(chosen.name)
        out[(d.role, d.index)] = chosen.name
    return Placement(out)


def admission_error(demand_bytes: int, budgets: list[int]) -> str:
    """Why a job can never fit the registered workers, or "" if some worker could hold a task.

    With no workers registered yet the job is admitted and waits: workers may still join.
    """
    if not budgets or demand_bytes <= max(budgets):
        return ""
    return (f"each task needs {format_size(demand_bytes)} but the largest worker budget is "
            f"{format_size(max(budgets))}")
