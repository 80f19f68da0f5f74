"""Keeps CPython's cycle collector from stalling the coordinator's event loop.

A full collection walks every tracked object. In the coordinator that is the imported modules
(about 35,000 objects, ~25 ms to walk on these machines: grpc and protobuf types are slow to
traverse) plus the agents' sessions, queues and streams. With 1,500 heartbeating agents full
collections ran every few seconds and took 70-100 ms each, and they were the heartbeat p99
(bench/agents_load.py; docs/benchmarks.md, "Control plane at scale").

The cure is ``gc.freeze()``: frozen objects are never walked again. What is frozen is only what
survived a collection moments before, so almost nothing frozen is garbage:

- once at start, after the state is loaded: the modules and the live jobs;
- after an automatic full collection that took longer than ``SLOW_COLLECTION_S``: what it kept
  is long-lived (agents that registered, jobs that are running), so the next one is short;
- every ``REFREEZE_S`` a full collection over everything, frozen included, then a freeze: it
  reclaims cycles that died after they were frozen (a finished job, an agent that left). That
  one pause is as long as an unfrozen full collection, once in ``REFREEZE_S``.

Reference counting frees frozen objects as usual; only cyclic garbage waits for the refreeze.

Young collections run on a clock, every ``YOUNG_INTERVAL_S``, not only when CPython's
allocation count says so. That count is allocations minus deallocations, and an object that
outlived a young collection and dies old counts against new ones. The coordinator is full of
such objects: each of 5,000 heartbeat streams holds a pending read (a future, its callbacks,
gRPC's operation objects) for the second between heartbeats. So the young list grew to tens
of thousands of objects while the count stayed under its threshold, and every ~1.4 s one
automatic young collection walked it all at once: 40-70 ms with the loop stopped, the
heartbeat tail (docs/benchmarks.md, "The heartbeat tail, lump by lump"). Collected every
50 ms (generation 1 with 0: what survives goes straight to the old generation, so the
middle one never builds up either) the same work comes in slices of 1-3 ms, and the time
in young collections did not grow (1.07-1.20 s in 30 s, against 1.15-1.19 s).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Callable

log = logging.getLogger("strata.coordinator")

#: an automatic full collection that took longer than this freezes what it kept
SLOW_COLLECTION_S = 0.01
#: how often everything, frozen objects included, is collected once
REFREEZE_S = 600.0
#: how often the loop looks whether a freeze is due
CHECK_S = 1.0
#: how often the young generations (0 and 1) are collected from the loop, whatever the count
YOUNG_INTERVAL_S = 0.05


class GcPolicy:
    """Freezes long-lived objects out of the collector's reach (module docstring)."""

    def __init__(self, *, refreeze_s: float = REFREEZE_S,
                 slow_collection_s: float = SLOW_COLLECTION_S,
                 young_interval_s: float = YOUNG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.refreeze_s = refreeze_s
        self.young_interval_s = young_interval_s
        self.young_collections = 0
        self.slow_collection_s = slow_collection_s
        self.clock = clock
        self.freeze_due = False
        self.freezes = 0
        self.refreezes = 0
        self._last_refreeze = clock()
        self._started: float | None = None
        self._own = False  # a collection this policy runs is not a slow automatic one

    def start(self) -> None:
        """Collects once and freezes what is left; watches full collections from now on."""
        self._collect_and_freeze()
        gc.callbacks.append(self._on_collection)

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2 or self._own:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            if time.perf_counter() - self._started > self.slow_collection_s:
                self.freeze_due = True
            self._started = None

    def step(self) -> None:
        """One check: a refreeze when one is due, else a freeze after a slow collection."""
        if self.clock() - self._last_refreeze >= self.refreeze_s:
            start = time.perf_counter()
            gc.unfreeze()
            self._collect_and_freeze()
            self.refreezes += 1
            log.debug("gc: refroze in %.0f ms", 1e3 * (time.perf_counter() - start))
        elif self.freeze_due:
            # young objects first: the short-lived ones die here instead of being frozen
            self._own = True
            try:
                gc.collect(1)
            finally:
                self._own = False
            gc.freeze()
            self.freezes += 1
        self.freeze_due = False

    def _collect_and_freeze(self) -> None:
        self._own = True
        try:
            gc.collect()
        finally:
            self._own = False
        gc.freeze()
        self._last_refreeze = self.clock()

    def collect_young(self) -> None:
        """One collection of generations 0 and 1 (module docstring)."""
        gc.collect(1)
        self.young_collections += 1

    async def run(self) -> None:
        next_check = self.clock() + CHECK_S
        while True:
            await asyncio.sleep(min(self.young_interval_s, CHECK_S))
            self.collect_young()
            if self.clock() >= next_check:
                next_check = self.clock() + CHECK_S
                self.step()
