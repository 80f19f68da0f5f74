"""Placement and admission decisions (pure functions)."""

import itertools

from strata.coordinator.placement import Capacity, TaskDemand, admission_error, place

MiB = 1 << 20


def caps(*frees, ports=4):
    return [Capacity(f"w{i}", 1000 * MiB, f * MiB, ports) for i, f in enumerate(frees)]


def test_gang_all_or_nothing():
    p = place([TaskDemand("worker", i, 100 * MiB) for i in range(3)], caps(500, 500))
    assert not p.assignments
    assert "3 workers" in p.reason and "2 of 2" in p.reason


def test_one_task_per_agent_and_best_fit():
    p = place([TaskDemand("worker", 0, 100 * MiB), TaskDemand("worker", 1, 100 * MiB)],
              caps(900, 120, 150))
    assert sorted(p.assignments.values()) == ["w1", "w2"]  # the big agent stays free


def test_agents_without_ports_are_skipped():
    p = place([TaskDemand("worker", 0, 1)], [Capacity("a", 10, 10, 0), Capacity("b", 10, 10, 1)])
    assert p.assignments == {("worker", 0): "b"}


def test_greedy_finds_a_placement_whenever_one_exists():
    sizes = [1, 2, 3, 4]
    for demand_sizes in itertools.product(sizes, repeat=3):
        for free_sizes in itertools.product(sizes, repeat=3):
            demands = [TaskDemand("w", i, s) for i, s in enumerate(demand_sizes)]
            agents = [Capacity(f"a{i}", 9, s) for i, s in enumerate(free_sizes)]
            exists = any(all(f >= d for f, d in zip(perm, demand_sizes))
                         for perm in itertools.permutations(free_sizes))
            p = place(demands, agents)
            assert bool(p.assignments) == exists
            for d in demands:
                if p.assignments:
                    chosen = next(a for a in agents if a.name == p.assignments[(d.role, d.index)])
                    assert chosen.free_bytes >= d.budget_bytes


def test_admission():
    assert admission_error(10, []) == ""            # no workers yet: wait for them
    assert admission_error(10, [5, 10]) == ""
    msg = admission_error(2 * 1024 * MiB, [512 * MiB, 1024 * MiB])
    assert "2 GiB" in msg and "1 GiB" in msg


def test_a_room_kept_through_changes_places_as_a_fresh_list_does():
    """Agents set (free budget and ports changing) and dropped one at a time leave the room
    in the order, and with the placements, that `place` over the same agents gives."""
    import random

    from strata.coordinator.placement import Room

    rng = random.Random(3)
    room, now = Room(), {}
    for _ in range(2000):
        name = f"a{rng.randrange(30)}"
        if rng.random() < 0.2:
            room.drop(name)
            now.pop(name, None)
        else:
            cap = Capacity(name, 16 * MiB, rng.randrange(17) * MiB, rng.randrange(3))
            room.set(cap)
            now[name] = cap
        demands = [TaskDemand("worker", i, rng.randrange(1, 17) * MiB)
                   for i in range(rng.randrange(1, 4))]
        assert room.place(demands) == place(demands, list(now.values()))
        assert [c.name for c in room] == [c.name for c in sorted(
            now.values(), key=lambda c: (c.free_bytes, c.name))]
    assert len(room) == len(now)
