"""The coordinator's collector policy (coordinator/gcpolicy.py), with the real ``gc`` module:
what it freezes is no longer walked, and the periodic refreeze reclaims cycles that died after
they were frozen. Restores the process's collector state after each test."""

from __future__ import annotations

import gc
import weakref

import pytest

from strata.coordinator.gcpolicy import GcPolicy


class Node:
    pass


@pytest.fixture
def clock():
    now = [0.0]
    yield now
    gc.unfreeze()


def test_start_freezes_what_is_loaded_and_close_gives_it_back(clock):
    p = GcPolicy(refreeze_s=100, clock=lambda: clock[0])
    p.start()
    assert gc.get_freeze_count() > 0
    p.close()
    assert gc.get_freeze_count() == 0


def test_what_survives_a_young_collection_is_frozen_and_never_walked_again(clock):
    # a full collection walks only what is not frozen: the old generation stays empty, so
    # however many objects live a while (here 20,000 in cycles, as a heartbeat stream's
    # pending reads do) a full collection has next to nothing to walk
    p = GcPolicy(refreeze_s=100, clock=lambda: clock[0])
    try:
        p.start()
        kept = []
        for _ in range(20_000):
            a = Node()
            a.me = a
            kept.append(a)
        p.collect_young()
        assert p.young_collections == 1
        assert gc.get_freeze_count() >= len(kept)
        assert sum(len(gc.get_objects(g)) for g in range(3)) < 1000
        walked = []
        gc.callbacks.append(cb := lambda phase, info: walked.append(len(gc.get_objects(2)))
                            if phase == "start" else None)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(cb)
        assert walked and walked[0] < 1000
        del kept
    finally:
        p.close()


def test_the_refreeze_reclaims_a_cycle_that_died_frozen(clock):
    p = GcPolicy(refreeze_s=100, clock=lambda: clock[0])
    try:
        p.start()
        a = Node()
        a.me = a  # a cycle: reference counting alone never frees it
        dead = weakref.ref(a)
        p.collect_young()  # frozen while alive
        del a
        gc.collect()
        assert dead() is not None  # frozen objects are not walked, so the cycle stays
        clock[0] = 99.0
        p.step()
        assert dead() is not None and p.refreezes == 0
        clock[0] = 100.0
        p.step()
        assert p.refreezes == 1 and dead() is None and p.reclaimed >= 1
        assert gc.get_freeze_count() > 0  # what is left is frozen again
    finally:
        p.close()


def test_young_collections_run_on_the_clock_whatever_the_count():
    # CPython's young collections follow a count (allocations minus deallocations) that
    # objects dying old keep down: with the count out of play (collector off), the policy's
    # loop still collects the young generations every young_interval_s
    import asyncio

    p = GcPolicy(young_interval_s=0.01)

    async def main():
        task = asyncio.create_task(p.run())
        a = Node()
        a.me = a  # a cycle: only a collection frees it
        dead = weakref.ref(a)
        del a
        await asyncio.sleep(0.3)
        task.cancel()
        return dead

    was = gc.isenabled()
    gc.disable()
    try:
        dead = asyncio.run(main())
    finally:
        if was:
            gc.enable()
    assert dead() is None
    assert p.young_collections >= 5
