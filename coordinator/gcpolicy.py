"""Keeps CPython's cycle collector from stalling the coordinator's event loop.

A collection walks every tracked object of the generations it collects, with the loop
stopped. In the coordinator the old generation holds the imported modules (about 35,000
objects, ~25 ms to walk on these machines: grpc and protobuf types are slow to traverse),
the jobs and agents, and, at any moment, what each heartbeat stream holds between two
heartbeats: a pending read, its future and callbacks, gRPC's operation objects. At 5,000
agents that is tens of thousands of objects that live about a second, long enough to be
old, and die by reference counting. A full collection walked them all: 40-95 ms, set off
by whatever allocated in a burst (a `/metrics` scrape, a tick after a submit), several
times a minute (docs/benchmarks-log.md, "Full collections, and what set them off").

The cure is ``gc.freeze()``: frozen objects are never walked again, and it costs nothing (it
moves the generations' lists whole). So the policy collects the young generations on a clock
and freezes whatever survived at once:

- every ``YOUNG_INTERVAL_S``, generations 0 and 1 are collected, then everything left is
  frozen. The old generation stays empty, so a full collection, automatic or not, walks
  only what became old since the last freeze: well under a millisecond.
- The young collections run on the clock, not only when CPython's allocation count says
  so. That count is allocations minus deallocations, and an object that outlived a young
  collection and dies old counts against new ones: the young list grew to tens of
  thousands of objects while the count stayed under its threshold, and one automatic
  young collection every ~1.4 s walked it all, 40-70 ms ("The heartbeat tail, lump by
  lump"). Every 50 ms the same work comes in slices of 1-3 ms.
- Every ``REFREEZE_S`` everything, frozen objects included, is collected once, then frozen
  again. Reference counting frees frozen objects as usual; only cyclic garbage that was
  frozen alive (a cycle that lived more than ``YOUNG_INTERVAL_S``) waits for this. At 5,000
  heartbeating agents that was about 50 objects a second, a few MB in ``REFREEZE_S``; each
  refreeze logs how many it reclaimed. Its pause is one unfrozen full collection of the whole
  process, once in ``REFREEZE_S``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Callable

log = logging.getLogger("strata.coordinator")

#: how often everything, frozen objects included, is collected once
REFREEZE_S = 600.0
#: how often the loop looks whether a refreeze is due
CHECK_S = 1.0
#: how often the young generations (0 and 1) are collected and their survivors frozen
YOUNG_INTERVAL_S = 0.05


class GcPolicy:
    """Collects the young generations on a clock and freezes what survives (module
    docstring)."""

    def __init__(self, *, refreeze_s: float = REFREEZE_S,
                 young_interval_s: float = YOUNG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.refreeze_s = refreeze_s
        self.young_interval_s = young_interval_s
        self.young_collections = 0
        self.clock = clock
        self.refreezes = 0
        #: cyclic garbage the last refreeze reclaimed (objects)
        self.reclaimed = 0
        self._last_refreeze = clock()

    def start(self) -> None:
        """Collects once and freezes what is left: the modules and the state loaded."""
        gc.collect()
        gc.freeze()
        self._last_refreeze = self.clock()

    def close(self) -> None:
        """Gives what was frozen back to the collector: the process may outlive the
        coordinator (one run in-process, as the tests do)."""
        gc.unfreeze()

    def step(self) -> None:
        """One check: a refreeze when one is due."""
        if self.clock() - self._last_refreeze < self.refreeze_s:
            return
        start = time.perf_counter()
        gc.unfreeze()
        self.reclaimed = gc.collect()
        gc.freeze()
        self._last_refreeze = self.clock()
        self.refreezes += 1
        log.info("gc: refroze in %.0f ms, %d objects of cyclic garbage reclaimed",
                 1e3 * (time.perf_counter() - start), self.reclaimed)

    def collect_young(self) -> None:
        """One collection of generations 0 and 1, and what survived it frozen (module
        docstring)."""
        gc.collect(1)
        gc.freeze()
        self.young_collections += 1

    async def run(self) -> None:
        next_check = self.clock() + CHECK_S
        while True:
            await asyncio.sleep(min(self.young_interval_s, CHECK_S))
            self.collect_young()
            if self.clock() >= next_check:
                next_check = self.clock() + CHECK_S
                self.step()
