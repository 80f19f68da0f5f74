"""Keeps CPython's cycle collector from stalling the coordinator's event loop.

``GcPolicy`` runs on the loop (``run``): ``start`` collects once and freezes what is loaded;
every ``YOUNG_INTERVAL_S`` (50 ms) ``collect_young`` collects generations 0 and 1 and freezes
what survived (``gc.freeze()`` only moves lists), so the old generation stays empty and no full
collection, automatic or not, walks more than what became old since the last freeze; every
``REFREEZE_S`` (10 min) ``step`` unfreezes, collects everything once (the cyclic garbage that
was frozen alive waits for this), freezes again and logs how much it reclaimed. ``close``
unfreezes, for a process that outlives the coordinator. The automatic collector stays on.

Why, and what it was measured to cost and save: docs/benchmarks-log.md, "The collector
policy, as it stands".
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
    """Collects the young generations on a clock and freezes what survives (the module
    docstring; why: docs/benchmarks-log.md, "The collector policy, as it stands")."""

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
        """One collection of generations 0 and 1, and what survived it frozen (the module
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
