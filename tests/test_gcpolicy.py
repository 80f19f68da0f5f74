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


def test_start_freezes_what_is_loaded_and_a_slow_collection_freezes_what_it_kept(clock):
    p = GcPolicy(refreeze_s=100, slow_collection_s=0.0, clock=lambda: clock[0])
    try:
        p.start()
        frozen = gc.get_freeze_count()
        assert frozen > 0 and not p.freeze_due  # its own collection does not count
        kept = [Node() for _ in range(1000)]
        gc.collect()  # a full collection the policy did not run: "slow" at a 0 s limit
        assert p.freeze_due
        p.step()
        assert p.freezes == 1 and not p.freeze_due
        assert gc.get_freeze_count() >= frozen + len(kept)
        p.step()  # nothing due: nothing frozen
        assert p.freezes == 1
    finally:
        p.close()
    gc.collect()
    assert not p.freeze_due  # closed: no longer watching


def test_a_fast_collection_freezes_nothing(clock):
    p = GcPolicy(refreeze_s=100, slow_collection_s=60.0, clock=lambda: clock[0])
    try:
        p.start()
        gc.collect()
        assert not p.freeze_due
    finally:
        p.close()


def test_the_refreeze_reclaims_a_cycle_that_died_frozen(clock):
    p = GcPolicy(refreeze_s=100, slow_collection_s=0.0, clock=lambda: clock[0])
    try:
        p.start()
        a = Node()
        a.me = a  # a cycle: reference counting alone never frees it
        dead = weakref.ref(a)
        p.freeze_due = True
        p.step()  # frozen while alive
        del a
        gc.collect()
        assert dead() is not None  # frozen objects are not walked, so the cycle stays
        clock[0] = 99.0
        p.step()
        assert dead() is not None and p.refreezes == 0
        clock[0] = 100.0
        p.step()
        assert p.refreezes == 1 and dead() is None
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
