"""Pipeline planner: split a model's layers into contiguous stages and give each stage a worker.

A pure decision, like ``coordinator.placement``: standard library only (the coordinator has no
TensorFlow), no side effects, and it reads only the model's ``ModelProfile`` (per-layer
parameter counts, output sizes and FLOPs); nothing is ever built to plan it.

It decides where a ``pipeline`` or ``hybrid`` job's layers are cut and which worker runs each
stage replica. Inputs: the profile, the free workers (``WorkerSlot``: a name and a free budget
in bytes, all possibly different), the depth (``stages``; 0 lets the planner choose), the
replicas, the micro-batching and the training settings that size a stage. Output: a
``PipelinePlan`` with one ``PlannedStage`` per task (its layers, worker, memory estimate and
cost), or ``feasible=False`` with a reason that says what does not fit and what to change. It
minimises the BOTTLENECK, the slowest stage's cost, subject to every task's memory estimate
(``strata.stagememory.StageCostModel``) fitting its worker's free budget.

The search is exact, with a bounded work allowance (``WORK_LIMIT``, about a second): with many
distinct budgets the problem is strongly NP-hard, and a search that runs out returns a plan
that still fits, marked ``optimal=False`` with a proven ``lower_bound``. The design (matching
by Hall's theorem, keys, probes, the bisection, hardness and the allowance; the "points"
cited below) is in ``docs/planner.md``; the memory and cost of a stage in
``strata/stagememory.py``.
"""

from __future__ import annotations

from strata.errors import SpecError

import bisect
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from strata.cpukernels import ANY
from strata.memory import FIXED_OVERHEAD, FRAGMENTATION, format_size
from strata.modelspec import ModelProfile
from strata.stagememory import (  # noqa: F401  (re-exported: planner's public names)
    CutView,
    MIXED_PRECISION_MODES,
    PIPELINE_ACTIVATION_BYTES,
    PIPELINE_INPUT_BATCHES,
    PIPELINE_MIXED_ACTIVATION_BYTES,
    StageCostModel,
    stage_memory,
)

__all__ = [
    "WorkerSlot", "PlannedStage", "PipelinePlan", "StageCostModel", "stage_memory",
    "plan_pipeline", "suggest_stages", "format_plan",
]


@dataclass(frozen=True)
class WorkerSlot:
    """A worker that can take one stage task now, with its free memory budget in bytes."""

    name: str
    free_bytes: int


@dataclass(frozen=True)
class PlannedStage:
    """One task of the plan: replica ``replica`` of stage ``index`` (layers
    ``[first_layer, last_layer)``) on ``worker``. ``memory_bytes`` is the stage's demand in
    the search (``StageCostModel.memory``), ``estimate_bytes`` its estimate
    (``StageCostModel.estimate``, at most the demand: the figure its budget comes from),
    ``cost`` its per-example training cost (FLOPs or the measured unit)."""

    index: int
    worker: str
    first_layer: int
    last_layer: int
    layer_names: tuple[str, ...]
    memory_bytes: int
    cost: float
    replica: int = 0
    worker_free_bytes: int = 0
    estimate_bytes: int = 0


@dataclass(frozen=True)
class PipelinePlan:
    """The plan. ``stages`` holds one entry per task, ordered by (stage index, replica), so a
    hybrid plan has ``num_stages * replicas`` entries. ``reason`` says why an infeasible plan is
    infeasible (empty when feasible); ``bottleneck_cost`` is the slowest stage's cost.
    ``optimal`` is False only when the search ran out of its work allowance (``WORK_LIMIT``,
    ``docs/planner.md`` point 5) before it could prove the bottleneck optimal: the plan still fits,
    and the optimum is known to be at least ``lower_bound`` (which equals ``bottleneck_cost``
    when ``optimal``). For ``stages: 0`` the depth is the smallest with that bottleneck unless
    the allowance ran out."""

    feasible: bool
    reason: str
    stages: tuple[PlannedStage, ...]
    bottleneck_cost: float
    replicas: int = 1
    microbatch: int = 0
    microbatches: int = 1
    optimal: bool = True
    lower_bound: float = 0.0

    @property
    def num_stages(self) -> int:
        return len({s.index for s in self.stages})


# --------------------------------------------------------------------------------------------
# the search


# Keys. A key is the set of slot ranks its stages took (bit r = rank r; ranks 1..S from the
# largest budget). For dominance tests each key also carries its prefix counts c(t) = #taken
# ranks <= t packed in one integer, a field of F bits per t whose top bit is a guard, so that
# "c_A(t) <= c_B(t) for every t" is one subtraction: ((pack_B | G) - pack_A) & G == G.


def _take_slot(key: int, q: int) -> int:
    """Adds a stage that fits the ``q`` largest slots to ``key``: it takes the largest free
    rank <= q (best fit). Returns the new key, or -1 when ranks 1..q are all taken."""
    free = ~key & ((2 << q) - 2)
    if not free:
        return -1
    return key | (1 << (free.bit_length() - 1))


class _Packing:
    """Packed prefix counts for ranks 1..S: ``ones[r]`` adds 1 to c(t) for every t >= r;
    ``guard`` has the top bit of every field."""

    def __init__(self, S: int):
        F = S.bit_length() + 1  # counts <= S stay below the guard bit
        self.ones = [0] * (S + 2)
        acc = 0
        for r in range(S, 0, -1):
            acc |= 1 << (r * F)
            self.ones[r] = acc
        self.guard = sum(1 << (t * F + F - 1) for t in range(1, S + 1))

    def dominates(self, pack_a: int, pack_b: int) -> bool:
        """c_A(t) <= c_B(t) for every t."""
        g = self.guard
        return ((pack_b | g) - pack_a) & g == g


def _pareto(cand: dict[int, tuple[int, int]], kfix: int, packs: dict[int, int],
            sums: dict[int, int], packing: _Packing) -> tuple[dict[int, tuple[int, int]], int]:
    """Drops the dominated keys: A dominates B when it has the same number of stages (fixed
    depth; no more stages for a free depth) and c_A(t) <= c_B(t) for every t. Then A's rank sum
    is at least B's (sum over t of c(t) is the stages' sum of S + 1 - rank), so in the order
    (stages, -rank sum) A comes first, and each key is compared with the kept keys before it
    only. Distinct keys never dominate each other both ways. Returns the kept keys and the
    number of comparisons made."""
    order = sorted(cand, key=lambda k: (k.bit_count(), -sums[k], k))
    kept: list[tuple[int, int]] = []
    out = {}
    g = packing.guard
    for k in order:
        n = k.bit_count()
        pk = packs[k]
        for kn, po in kept:
            if (kn == n or (not kfix and kn < n)) and ((pk | g) - po) & g == g:
                break
        else:
            kept.append((n, pk))
            out[k] = cand[k]
    return out, len(order) * (len(kept) + 1)


def _rounded(slots_desc: list[int], cuts: list[int], up: bool) -> list[int]:
    """Slots ``(cuts[i-1], cuts[i]]`` (ranks, 1-based) set to their group's largest (``up``)
    or smallest budget."""
    out = []
    start = 0
    for end in cuts:
        value = slots_desc[start] if up else slots_desc[end - 1]
        out += [value] * (end - start)
        start = end
    return out


class _Undecided(Exception):
    """A probe ran out of its work allowance before it could decide."""


# Work allowances, in units of about a microsecond (state extensions and dominance tests of the
# programmes with heterogeneous slots; homogeneous ones are cheap and not counted). Only
# pathological budget mixes get near them (docs/planner.md, point 5).
WORK_LIMIT = 1_000_000       # one plan
PROBE_WORK = 300_000         # one probe
EXACT_FIRST_WORK = 60_000    # the first, short try of the exact programme in a probe
WITNESS_WORK = 500_000       # the last-resort probe without a cost limit
REORDER_ROUNDS = 3           # rounds of the slot-order local search
BEAM_ALIVE = 6               # keys per stage count the heuristic programme keeps alive


class _Search:
    """Bottleneck minimisation over the splits for one list of virtual slots
    (``docs/planner.md``, points 3-5)."""

    def __init__(self, model: StageCostModel, work_limit: int | None = None):
        self.m = model
        self.L = model.L
        self.probes = 0
        self.work_left = WORK_LIMIT if work_limit is None else work_limit
        self.exact = True
        self.undecided = False
        self.refuted = -math.inf  # the largest cost limit proven infeasible
        self.t_low = 0.0  # the bottleneck with every slot at the largest budget

    # -- candidate values cost(a, b)

    def _next_candidate(self, x: float, strict: bool) -> float | None:
        """The smallest cost(a, b) > x (strict) or >= x; None if there is none."""
        L, f, fac = self.L, self.m._f, self.m.cost_factor
        best = None
        b = 1
        for a in range(L):
            if b < a + 1:
                b = a + 1
            if strict:
                while b <= L and (f[b] - f[a]) * fac <= x:
                    b += 1
            else:
                while b <= L and (f[b] - f[a]) * fac < x:
                    b += 1
            if b <= L:
                c = (f[b] - f[a]) * fac
                if best is None or c < best:
                    best = c
        return best

    # -- one probe

    def windows(self, T: float) -> tuple[list[int], list[int]] | None:
        """For cost limit T: ``lo[b]``, the first start a with cost(a, b) <= T, and ``g[a]``,
        the fewest stages covering layers [a, L) at cost <= T (greedy furthest jump, exact for
        that question). None when a single layer costs more than T."""
        L, f, fac = self.L, self.m._f, self.m.cost_factor
        lo = [0] * (L + 1)
        a = 0
        for b in range(1, L + 1):
            while (f[b] - f[a]) * fac > T:
                a += 1
            if a == b:
                return None  # layer b-1 alone costs more than T
            lo[b] = a
        r = [0] * L
        b = 1
        for a in range(L):
            if b < a + 1:
                b = a + 1
            while b < L and (f[b + 1] - f[a]) * fac <= T:
                b += 1
            r[a] = b
        g = [0] * (L + 1)
        for a in range(L - 1, -1, -1):
            g[a] = 1 + g[r[a]]
        return lo, g

    def dp(self, win: tuple[list[int], list[int]], slots_desc: Sequence[int], kfix: int,
           limited: bool = False, beam: bool = False) -> list[tuple[int, int]] | None:
        """The dynamic programme of ``docs/planner.md`` (points 2-3) for the windows of one cost
        limit: a placeable split on ``slots_desc`` with exactly ``kfix`` stages, or (kfix == 0)
        with the fewest stages; None if there is none. ``limited`` charges the work to the
        allowance and raises ``_Undecided`` when it runs out. ``beam`` makes it a heuristic
        that keeps one key per boundary and stage count (the one that took the smallest slots):
        a split it finds is placeable, None proves nothing."""
        L = self.L
        X, Y = self.m._x, self.m._y
        lo_, g = win
        S = len(slots_desc)
        if S == 0 or (kfix and (kfix > S or kfix > L)):
            return None
        kcap = kfix or S
        if g[0] > kcap:
            return None
        homogeneous = slots_desc[0] == slots_desc[-1]
        if homogeneous and not beam:
            if kfix:
                return self.ordered_dp(win, slots_desc, charge=False)
            return self._fewest(win, slots_desc[0], S)
        asc = sorted(slots_desc)
        fixed, frag, ceil = FIXED_OVERHEAD, FRAGMENTATION, math.ceil
        work = 0
        limited = limited or not homogeneous
        allowance = self.work_left if limited else -1

        # states: (boundary b, key); one sliding-window-maximum deque of boundaries per key
        queues: dict[int, deque[int]] = {0: deque([0])}
        packing = _Packing(1 if homogeneous else S)  # homogeneous keys are never compared
        ones = packing.ones if not homogeneous else [0] * (S + 2)
        packs: dict[int, int] = {0: 0}
        sums: dict[int, int] = {0: 0}
        parent: dict[tuple[int, int], tuple[int, int]] = {}
        final: dict[int, tuple[int, int]] = {}
        alive: dict[int, set[int]] = {0: {0}}
        for b in range(1, L + 1):
            lb = lo_[b]
            xb = X[b]
            last = b == L
            cand: dict[int, tuple[int, int]] = {}
            dead = []
            work += 3 * len(queues)  # about a microsecond per unit
            if work > allowance >= 0:
                self.work_left = 0
                raise _Undecided()
            for key, dq in queues.items():
                while dq[0] < lb:
                    dq.popleft()
                    if not dq:
                        break
                if not dq:
                    dead.append(key)
                    continue
                a = dq[0]
                c = ceil(xb - Y[a])
                q = S - bisect.bisect_left(asc, c + fixed + ceil(frag * c))
                if q == 0:
                    continue
                free = ~key & ((2 << q) - 2)  # _take_slot, inlined
                if not free:
                    continue
                rank = free.bit_length() - 1
                nk = key | (1 << rank)
                if last:
                    if kfix and nk.bit_count() != kfix:
                        continue
                else:
                    k1 = nk.bit_count()
                    if k1 + g[b] > kcap or (kfix and kfix - k1 > L - b):
                        continue
                if nk not in cand:
                    cand[nk] = (a, key)
                    if nk not in packs:
                        packs[nk] = packs[key] + ones[rank]
                        sums[nk] = sums[key] + rank
            for key in dead:
                del queues[key]
                if beam:
                    alive[key.bit_count()].discard(key)
            if len(cand) > 1:
                if homogeneous:
                    # keys are {S-k+1..S}: at a fixed depth none dominates another, at a free
                    # one the fewest stages dominate
                    if not kfix:
                        nk = min(cand, key=int.bit_count)
                        cand = {nk: cand[nk]}
                elif beam:
                    # heuristic: per stage count, the key that took the smallest slots
                    best: dict[int, int] = {}
                    for nk in cand:
                        n = nk.bit_count()
                        o = best.get(n)
                        if o is None or (sums[nk], nk) > (sums[o], o):
                            best[n] = nk
                    cand = {nk: cand[nk] for nk in best.values()}
                    work += len(cand)
                else:
                    cand, compared = _pareto(cand, kfix, packs, sums, packing)
                    work += compared // 3
            if last:
                final = cand
                break
            yb = Y[b]
            for nk, pa in cand.items():
                parent[(b, nk)] = pa
                dq = queues.get(nk)
                if dq is None:
                    queues[nk] = deque([b])
                    if beam:
                        group = alive.setdefault(nk.bit_count(), set())
                        group.add(nk)
                        if len(group) > BEAM_ALIVE:  # evict the key that took the largest slots
                            worst = min(group, key=lambda k: (sums[k], k))
                            group.discard(worst)
                            del queues[worst]
                else:
                    while dq and Y[dq[-1]] <= yb:
                        dq.pop()
                    dq.append(b)
        if limited:
            self.work_left -= work
        if not final:
            return None
        key = min(final, key=lambda k: (k.bit_count(), k))
        a, prev = final[key]
        split = [(a, L)]
        while a > 0:
            a2, prev2 = parent[(a, prev)]
            split.append((a2, a))
            a, prev = a2, prev2
        split.reverse()
        return split

    def _fewest(self, win: tuple[list[int], list[int]], budget: int, S: int
                ) -> list[tuple[int, int]] | None:
        """The homogeneous programme for a free depth: the fewest stages (at most S) of cost
        <= T and memory <= ``budget`` covering the chain. With equal slots the state with the
        fewest stages at a boundary dominates the others, so f[b] = 1 + the smallest k with a
        state in the window that fits; per k the state with the largest Y[a] is the best."""
        L = self.L
        X, Y = self.m._x, self.m._y
        lo_, g = win
        if g[0] > S:
            return None
        fixed, frag, ceil = FIXED_OVERHEAD, FRAGMENTATION, math.ceil
        queues: list[deque[int]] = [deque() for _ in range(S + 1)]
        queues[0].append(0)
        parent = [-1] * (L + 1)
        kmin, kmax = 0, 0  # stage counts with possibly live queues
        for b in range(1, L + 1):
            lb = lo_[b]
            xb = X[b]
            while kmin <= kmax:
                dq = queues[kmin]
                while dq and dq[0] < lb:
                    dq.popleft()
                if dq:
                    break
                kmin += 1
            found = a = -1
            for k in range(kmin, min(kmax, S - 1) + 1):
                dq = queues[k]
                while dq and dq[0] < lb:
                    dq.popleft()
                if not dq:
                    continue
                a = dq[0]
                c = ceil(xb - Y[a])
                if c + fixed + ceil(frag * c) <= budget:
                    found = k + 1
                    break
            if found < 0 or found + g[b] > S:
                continue
            parent[b] = a
            if b < L:
                dq = queues[found]
                yb = Y[b]
                while dq and Y[dq[-1]] <= yb:
                    dq.pop()
                dq.append(b)
                if found > kmax:
                    kmax = found
        if parent[L] < 0:
            return None
        split = []
        b = L
        while b > 0:
            a = parent[b]
            split.append((a, b))
            b = a
        split.reverse()
        return split

    def ordered_dp(self, win: tuple[list[int], list[int]], budgets: Sequence[int],
                   charge: bool = True) -> list[tuple[int, int]] | None:
        """A split into exactly ``len(budgets)`` stages whose k-th stage fits ``budgets[k]``
        (the processor order fixed: exact for that order, O(L) per stage count in the band),
        or None. Used with the budgets of distinct slots, so a split found is placeable; with
        equal budgets it is the exact homogeneous programme for a fixed depth (not charged)."""
        L = self.L
        X, Y = self.m._x, self.m._y
        lo_, g = win
        K = len(budgets)
        if K > L or g[0] > K:
            return None
        fixed, frag, ceil = FIXED_OVERHEAD, FRAGMENTATION, math.ceil
        queues: list[deque[int]] = [deque() for _ in range(K + 1)]
        queues[0].append(0)
        parent: dict[tuple[int, int], int] = {}
        work = 0
        allowance = self.work_left if charge else math.inf
        for b in range(1, L + 1):
            lb = lo_[b]
            xb = X[b]
            # stage counts k that can end at b and still finish: k + g[b] <= K <= k + L - b
            kmin = max(1, K - (L - b))
            kmax = min(K - g[b], b)
            work += kmax - kmin + 2
            if work > allowance:
                self.work_left = 0
                raise _Undecided()
            reached = []
            for k in range(kmin, kmax + 1):
                dq = queues[k - 1]
                while dq and dq[0] < lb:
                    dq.popleft()
                if not dq:
                    continue
                a = dq[0]
                c = ceil(xb - Y[a])
                if c + fixed + ceil(frag * c) <= budgets[k - 1]:
                    parent[(b, k)] = a
                    reached.append(k)
            if b == L:
                break
            yb = Y[b]
            for k in reached:
                dq = queues[k]
                while dq and Y[dq[-1]] <= yb:
                    dq.pop()
                dq.append(b)
        if charge:
            self.work_left -= work
        if (L, K) not in parent:
            return None
        split = []
        b, k = L, K
        while k > 0:
            a = parent[(b, k)]
            split.append((a, b))
            b, k = a, k - 1
        split.reverse()
        return split

    def _reorder(self, win: tuple[list[int], list[int]], slots_desc: Sequence[int],
                 reference: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        """Local search for a placeable split (a heuristic: None proves nothing). Give the
        largest slots to the stages of ``reference`` that need the most memory and re-cut with
        that order fixed (``ordered_dp``); if no cut fits, take the cut that fits the smallest
        uniform stretch of those budgets as the next reference, and repeat."""
        seen = set()
        for _ in range(REORDER_ROUNDS):
            if reference is None or len(reference) > len(slots_desc):
                return None
            demands = [self.m.memory(a, b) for a, b in reference]
            order = sorted(range(len(reference)), key=lambda i: (-demands[i], i))
            budgets = [0] * len(reference)
            for rank, i in enumerate(order):
                budgets[i] = slots_desc[rank]
            if tuple(budgets) in seen:
                return None
            seen.add(tuple(budgets))
            split = self.ordered_dp(win, budgets)
            if split is not None:
                return split
            lo, hi = 1.0, max(d / u for d, u in zip(demands, budgets))
            nxt = reference
            for _ in range(6):
                mid = (lo + hi) / 2
                split = self.ordered_dp(win, [int(u * mid) for u in budgets])
                if split is None:
                    lo = mid
                else:
                    hi, nxt = mid, split
            if nxt == reference:
                return None
            reference = nxt
        return None

    def probe(self, T: float, slots_desc: Sequence[int], kfix: int
              ) -> list[tuple[int, int]] | None:
        """A placeable split whose stages all cost <= T (exactly ``kfix`` stages, or any
        number when kfix == 0), or None if there is none. Raises ``_Undecided`` when the probe
        runs out of its allowance (``PROBE_WORK``, and what is left of ``WORK_LIMIT``).

        The order (``docs/planner.md``, point 3): homogeneous bounds, the exact programme on a
        short allowance, heuristic witnesses, rounded bounds, the exact programme on the rest."""
        self.probes += 1
        left = self.work_left
        self.work_left = granted = min(PROBE_WORK, left)
        try:
            return self._probe(T, slots_desc, kfix)
        finally:
            self.work_left = left - (granted - self.work_left)

    def _probe(self, T: float, slots_desc: Sequence[int], kfix: int
               ) -> list[tuple[int, int]] | None:
        S = len(slots_desc)
        if S == 0 or (kfix and (kfix > S or kfix > self.L)):
            return None
        win = self.windows(T)
        if win is None:
            return None
        top, bottom = slots_desc[0], slots_desc[(kfix or S) - 1]
        if top == bottom:
            return self.dp(win, slots_desc[:kfix or S], kfix)
        n = kfix or S
        slots = list(slots_desc[:n])
        # homogeneous bounds: all slots at the smallest budget (a split found is placeable),
        # all at the largest (none found means none is placeable)
        split = self.dp(win, [bottom] * n, kfix)
        if split is not None:
            return split
        relaxed = self.dp(win, [top] * n, kfix)
        if relaxed is None:
            return None
        if not kfix:
            # a split into k stages each within the k-th largest budget is placeable
            tried = {S}
            for j in ((3 * S) // 4, S // 2, S // 4, len(relaxed)):
                if j < len(relaxed) or j in tried:
                    continue
                tried.add(j)
                split = self.dp(win, [slots_desc[j - 1]] * j, 0)
                if split is not None:
                    return split
        # the exact programme, on a short allowance first: usually it is small and decides
        left = self.work_left
        self.work_left = granted = min(EXACT_FIRST_WORK, left)
        try:
            return self.dp(win, slots, kfix)
        except _Undecided:
            pass
        finally:
            self.work_left = left - (granted - self.work_left)
        # heuristic witnesses: the programme keeping one key per boundary and stage count, then
        # a local search over the order of the slots along the chain
        split = self.dp(win, slots, kfix, beam=True)
        if split is not None:
            return split
        split = self._reorder(win, slots, relaxed)
        if split is not None:
            return split
        # the same bounds with the slots in a few groups: each group at its smallest budget
        # (a split found is placeable) or at its largest (no split means none is placeable);
        # few distinct budgets keep these programmes small
        for groups in (2, 4, 8):
            if groups >= len(set(slots)):
                break
            cuts = sorted({-(-n * i // groups) for i in range(1, groups + 1)})
            down, up = _rounded(slots, cuts, up=False), _rounded(slots, cuts, up=True)
            split = self.dp(win, down, kfix)
            if split is not None:
                return split
            if self.dp(win, up, kfix) is None:
                return None
        if self.work_left <= 0:
            raise _Undecided()
        return self.dp(win, slots, kfix, limited=True)

    # -- the search

    def bottleneck(self, split: list[tuple[int, int]]) -> float:
        return max(self.m.cost(a, b) for a, b in split)

    def _try(self, T: float, slots_desc: Sequence[int], kfix: int
             ) -> list[tuple[int, int]] | None:
        """``probe``, with an undecided probe counted as infeasible (``self.exact`` becomes
        False and ``self.undecided`` says so for this call); ``self.refuted`` keeps the
        largest T proven infeasible."""
        self.undecided = False
        try:
            split = self.probe(T, slots_desc, kfix)
        except _Undecided:
            self.exact = False
            self.undecided = True
            return None
        if split is None and T > self.refuted:
            self.refuted = T
        return split

    def _witness(self, slots_desc: list[int], kfix: int) -> list[tuple[int, int]] | None:
        """Last resort once the allowance is spent without any placeable split found: one more
        probe with no cost limit and a fresh (smaller) allowance."""
        self.work_left = WITNESS_WORK
        try:
            return self._probe(self.m.cost(0, self.L), slots_desc, kfix)
        except _Undecided:
            return None

    def _homogeneous(self, T: float, budget: int, n: int, kfix: int
                     ) -> list[tuple[int, int]] | None:
        """``n`` slots of one budget: exact and cheap (a key is a stage count)."""
        win = self.windows(T)
        return None if win is None else self.dp(win, [budget] * n, kfix)

    def _smallest(self, probe: Callable[[float], Any], lo: float, lo_strict: bool,
                  best: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        """Bisection over the candidate bottlenecks cost(a, b) with a monotone ``probe``
        (T -> split or None). On entry every candidate below ``lo`` (at or below it when
        ``lo_strict``) is infeasible and ``best`` is a feasible split or None. Returns the
        split of the smallest feasible bottleneck found, or None if none is feasible (or, for
        undecided probes, none was found)."""
        m, L = self.m, self.L
        total = m.cost(0, L)
        if best is None:  # gallop up to a feasible upper end
            step = max(max(m.cost(i, i + 1) for i in range(L)), total / L, 1e-12)
            t = self._next_candidate(lo, strict=lo_strict)
            while t is not None:
                best = probe(t)
                if best is not None:
                    break
                if t >= total:
                    return None
                lo, lo_strict = t, True
                t = min(t + step, total)
                step *= 2
            if best is None:
                return None
        hi = self.bottleneck(best)
        while True:
            c = self._next_candidate(lo, strict=lo_strict)
            if c is None or c >= hi:
                return best
            mid = (lo + hi) / 2
            if not c <= mid < hi:  # also when rounding lands on hi
                mid = c
            split = probe(mid)
            if split is None:
                lo, lo_strict = mid, True
            else:
                best, hi = split, self.bottleneck(split)

    def optimise(self, slots_desc: Sequence[int], kfix: int) -> list[tuple[int, int]] | None:
        """The placeable split with the smallest bottleneck (fewest stages among equals when
        kfix == 0), or None when no placeable split exists at any cost. When a probe runs out
        of the allowance the result is still placeable but ``self.exact`` is False; raises
        ``_Undecided`` when no placeable split was found and none was proven impossible.

        First the two homogeneous bounds are optimised (cheap): every slot at the largest
        budget gives T_low <= T*, every slot at the smallest used budget gives a placeable
        split of bottleneck T_high >= T*. When they meet, that is the answer; otherwise the
        full probes bisect between them."""
        m, L = self.m, self.L
        slots_desc = list(slots_desc[:kfix] if kfix else slots_desc)
        depth = kfix or min(L, len(slots_desc))
        if depth < 1:
            return None
        n = kfix or len(slots_desc)
        # total capacity: the K largest slots must hold at least the K stages' summed memory
        if not any(m.total_lower_bound(k) <= sum(slots_desc[:k])
                   for k in ([kfix] if kfix else range(1, depth + 1))):
            return None
        total = m.cost(0, L)
        biggest = max(m.cost(i, i + 1) for i in range(L))
        lower = max(biggest, total / depth * (1 - 1e-9))  # margin for float rounding
        top, bottom = slots_desc[0], slots_desc[n - 1]
        low = self._smallest(lambda T: self._homogeneous(T, top, n, kfix), lower, False, None)
        if low is None:
            return None  # not even with every slot at the largest budget
        t_low = self.t_low = self.bottleneck(low)
        if top == bottom:
            best = low
        else:
            high = self._smallest(lambda T: self._homogeneous(T, bottom, n, kfix), t_low,
                                  False, None)
            if high is not None and self.bottleneck(high) <= t_low:
                best = high
            else:
                best = self._smallest(lambda T: self._try(T, slots_desc, kfix), t_low, False,
                                      high)
                if best is None:
                    if self.exact:
                        return None  # proven: nothing fits even without a cost limit
                    best = self._witness(slots_desc, kfix)
                    if best is None:
                        raise _Undecided()
        if kfix:
            return best
        # fewest stages with this bottleneck: the smallest depth K that is feasible at it
        hi = self.bottleneck(best)
        win = self.windows(hi)
        assert win is not None
        fewest = self.dp(win, [top] * len(slots_desc), 0)
        assert fewest is not None
        for k in range(len(fewest), len(best)):
            try:
                split = self.probe(hi, slots_desc[:k], k)
            except _Undecided:  # the bottleneck stays optimal; the depth may not be minimal
                continue
            if split is not None:
                return split
        return best

    def lower_bound(self) -> float:
        """A proven lower bound on the optimal bottleneck after ``optimise``: the larger of the
        bottleneck with every slot at the largest budget and the first candidate above the
        largest cost limit a probe proved infeasible."""
        above = self._next_candidate(self.refuted, strict=True) if self.refuted > -math.inf \
            else None
        return max(self.t_low, above if above is not None else 0.0)


# --------------------------------------------------------------------------------------------
# planning


def _virtual_slots(workers: Sequence[WorkerSlot], replicas: int) -> list[int]:
    """``v_j = w_{jR}``: the budget the j-th replica group of workers can all offer."""
    budgets = sorted((w.free_bytes for w in workers), reverse=True)
    return [budgets[j * replicas - 1] for j in range(1, len(budgets) // replicas + 1)]


def _assign(demands: list[int], workers: Sequence[WorkerSlot], replicas: int
            ) -> dict[tuple[int, int], WorkerSlot] | None:
    """Best-fit decreasing of every (stage, replica) task to a distinct worker."""
    pool = sorted(workers, key=lambda w: (w.free_bytes, w.name))
    used: set[int] = set()
    out: dict[tuple[int, int], WorkerSlot] = {}
    tasks = sorted(((d, s, r) for s, d in enumerate(demands) for r in range(replicas)),
                   key=lambda t: (-t[0], t[1], t[2]))
    for d, s, r in tasks:
        for i, w in enumerate(pool):
            if i not in used and w.free_bytes >= d:
                used.add(i)
                out[(s, r)] = w
                break
        else:
            return None
    return out


def _microbatch(global_batch: int, replicas: int, microbatches: int) -> int:
    for name, value in (("data.batch_size", global_batch), ("microbatches", microbatches),
                        ("replicas", replicas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(name, f"must be a positive integer, got {value!r}")
    if global_batch % replicas:
        raise SpecError("data.batch_size", f"the global batch {global_batch} must divide evenly "
                         f"among {replicas} replicas")
    per_replica = global_batch // replicas
    if per_replica % microbatches:
        raise SpecError("microbatches", f"the per-replica batch {per_replica} (data.batch_size "
                         f"{global_batch} / {replicas} replicas) does not divide into "
                         f"{microbatches} micro-batches of equal size")
    return per_replica // microbatches


def plan_pipeline(profile: ModelProfile, workers: Sequence[WorkerSlot], *, stages: int,
                  microbatches: int, global_batch: int, replicas: int = 1,
                  optimizer: str = "adam", mixed_precision: str = "none",
                  recompute: bool = False, layer_costs: Sequence[float] | None = None,
                  label_bytes: int = 8, data_bytes: int = 0,
                  compressed: bool = False, kernels: str = ANY) -> PipelinePlan:
    """Splits ``profile``'s layers into ``stages`` contiguous stages (0: the planner picks the
    depth, fewest stages among equal bottlenecks) and places ``replicas`` copies of each on
    distinct ``workers``, minimising the slowest stage's cost subject to every task's memory
    fitting its worker's free budget. Exact; see ``docs/planner.md``.

    Raises SpecError (a ValueError naming the spec field) for inconsistent arguments; returns
    a plan with ``feasible=False`` and a ``reason`` when nothing fits."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 0:
        raise SpecError("stages", f"must be 0 (let the planner choose) or a positive integer, "
                         f"got {stages!r}")
    microbatch = _microbatch(global_batch, replicas, microbatches)
    names = [w.name for w in workers]
    if len(set(names)) != len(names):
        raise SpecError("workers", "worker names must be distinct")
    model = StageCostModel(profile, microbatch=microbatch, microbatches=microbatches,
                           optimizer=optimizer, mixed_precision=mixed_precision,
                           recompute=recompute, replicas=replicas, layer_costs=layer_costs,
                           label_bytes=label_bytes, data_bytes=data_bytes,
                           compressed=compressed, kernels=kernels)
    view = _cut_view(model, profile)
    if stages and stages > view.L and view is not model:
        return PipelinePlan(False, _too_few_cuts(profile, stages), (), 0.0, replicas,
                            microbatch, microbatches)
    return _plan(view, list(workers), stages)


def _cut_view(model: StageCostModel, profile: ModelProfile) -> Any:
    """The model as the search sees it: every boundary of a chain, only the cut points of a
    graph (``CutView``)."""
    cuts = profile.cut_points
    return model if len(cuts) == model.L - 1 else CutView(model, cuts)


def _too_few_cuts(profile: ModelProfile, stages: int) -> str:
    cuts = profile.cut_points
    names = [profile.layers[k - 1].name for k in cuts]
    where = (f"after {', '.join(repr(n) for n in names[:8])}{', ...' if len(names) > 8 else ''}"
             if names else "nowhere")
    return (f"stages: {stages} asked for but this model can be cut into at most "
            f"{len(cuts) + 1} stage{'s' if cuts else ''}: a pipeline cuts only where exactly one "
            f"tensor crosses (between blocks, never inside a branch or residual block), which "
            f"here is {where}; use fewer stages, or a data-parallel strategy")


def _plan(model: StageCostModel, workers: list[WorkerSlot], stages: int) -> PipelinePlan:
    L, R = model.L, model.replicas

    def infeasible(reason: str) -> PipelinePlan:
        return PipelinePlan(False, reason, (), 0.0, R, model.microbatch, model.microbatches)

    slots = _virtual_slots(workers, R)
    n = len(workers)
    if stages > L:
        return infeasible(f"stages: {stages} asked for but the model has only {L} layers")
    if not slots:
        if n == 0:
            return infeasible("no workers are free")
        return infeasible(f"each stage needs {R} workers (one per replica) but only {n} "
                          f"{'is' if n == 1 else 'are'} free")
    if stages > len(slots):
        if R == 1:
            return infeasible(f"stages: {stages} asked for but {n} worker"
                              f"{'s are' if n != 1 else ' is'} free")
        return infeasible(f"stages: {stages} with {R} replicas needs {stages * R} workers but "
                          f"{n} {'are' if n != 1 else 'is'} free")
    used_slots = slots[:stages] if stages else slots
    search = _Search(model)
    try:
        split = search.optimise(used_slots, stages)
    except _Undecided:
        return infeasible(
            "the planner found no placement within its search limit, and could not rule one "
            "out: the free budgets are many, all different and close to what the stages need "
            f"({_budget_list(workers)}); try an explicit stages value"
            f"{_advice(model, None).replace('; ', ', ', 1)}")
    if split is None:
        return infeasible(_explain(model, workers, slots, stages))
    demands = [model.memory(a, b) for a, b in split]
    assignment = _assign(demands, workers, R)
    if assignment is None:  # pragma: no cover - the search only returns placeable splits
        raise AssertionError("planner: a placeable split could not be assigned")
    out = []
    layers = getattr(model, "base", model).layers
    for s, (a, b) in enumerate(split):
        first, last = model.bound(a), model.bound(b)
        names = tuple(l.name for l in layers[first:last])
        for r in range(R):
            w = assignment[(s, r)]
            out.append(PlannedStage(s, w.name, first, last, names, demands[s], model.cost(a, b),
                                    r, w.free_bytes, model.estimate(a, b)))
    bottleneck = search.bottleneck(split)
    lower = bottleneck if search.exact else min(bottleneck, search.lower_bound())
    return PipelinePlan(True, "", tuple(out), bottleneck, R, model.microbatch,
                        model.microbatches, optimal=lower >= bottleneck, lower_bound=lower)


# --------------------------------------------------------------------------------------------
# explanations


_TERM_WORDS = {
    "weights": "weights", "gradients": "gradients", "accumulator": "gradient accumulator",
    "collective": "gradient averaging buffers", "boundary_input": "stage inputs",
    "boundary_gradients": "boundary gradients", "input_data": "input batches",
    "labels": "labels", "overhead": "overhead",
}


def _describe_terms(model: StageCostModel, terms: dict[str, int]) -> str:
    parts = []
    for name, value in terms.items():
        if name == "total" or value <= 0:
            continue
        if name == "optimizer_slots":
            word = f"{model.optimizer} slots"
        elif name == "activations":
            word = ("activations of 1 micro-batch (recomputed)" if model.recompute else
                    f"activations of {model.microbatches} micro-batch"
                    f"{'es' if model.microbatches != 1 else ''}")
        else:
            word = _TERM_WORDS.get(name, name)
        parts.append((value, f"{word} {format_size(value)}"))
    parts.sort(key=lambda p: -p[0])
    return ", ".join(p[1] for p in parts)


def _advice(model: StageCostModel, terms: dict[str, int] | None) -> str:
    tips = []
    state = 0
    if terms is not None:
        state = (terms["weights"] + terms["gradients"] + terms["accumulator"]
                 + terms["optimizer_slots"] + terms["collective"])
    if terms is None or state < terms["total"] * 0.8:
        if not model.recompute:
            tips.append("set memory.recompute: true")
        elif model.microbatch > 1:
            tips.append("use more microbatches")
        tips.append("use a smaller data.batch_size")
    if model.optimizer != "sgd" and terms is not None and terms["optimizer_slots"] > 0 \
            and state >= terms["total"] * 0.5:
        tips.append("use an optimizer with fewer slots (sgd has none)")
    tips.append("add workers with more free memory")
    return "; " + ", ".join(tips[:-1]) + (" or " if len(tips) > 1 else "") + tips[-1]


def _budget_list(workers: list[WorkerSlot]) -> str:
    text = ", ".join(format_size(w.free_bytes) for w in
                     sorted(workers, key=lambda w: -w.free_bytes)[:8])
    return text + (", ..." if len(workers) > 8 else "")


def _explain(model: StageCostModel, workers: list[WorkerSlot], slots: list[int],
             stages: int) -> str:
    L, R = model.L, model.replicas
    X, Y = model._x, model._y
    v1 = slots[0]
    n_big = sum(1 for w in workers if w.free_bytes >= v1)
    largest = (f"the largest free worker budget is {format_size(v1)}" if R == 1 else
               f"the largest budget {R} free workers share (one per replica) is "
               f"{format_size(v1)}")
    # a layer that fits in no stage at all: min over a <= i < b of total(X[b] - Y[a])
    pre_y = []
    best = -math.inf
    for i in range(L):
        best = max(best, Y[i])
        pre_y.append(best)
    suf_x = [0.0] * L
    best = math.inf
    for i in range(L - 1, -1, -1):
        best = min(best, X[i + 1])
        suf_x[i] = best
    worst, worst_need, bad = -1, 0, 0
    for i in range(L):
        c = math.ceil(suf_x[i] - pre_y[i])
        need = c + FIXED_OVERHEAD + math.ceil(FRAGMENTATION * c)
        if need > v1:
            bad += 1
            if need > worst_need:
                worst, worst_need = i, need
    if worst >= 0:
        layer = model.layers[worst]
        terms = model.breakdown(worst, worst + 1)
        if terms["total"] == worst_need:
            what = f"layer {layer.name!r} alone needs {format_size(worst_need)}"
        else:
            what = (f"every stage holding layer {layer.name!r} needs at least "
                    f"{format_size(worst_need)} (alone: {format_size(terms['total'])})")
        more = f" ({bad - 1} more layer{'s' if bad > 2 else ''} fit nowhere either)" \
            if bad > 1 else ""
        return (f"{what} ({_describe_terms(model, terms)}) but {largest}{more}"
                f"{_advice(model, terms)}")
    # fewest stages if every stage had the largest budget (cost ignored)
    search = _Search(model)
    relaxed = search.probe(math.inf, [v1] * L, 0)
    if relaxed is None:
        return (f"no split of the {L} layers into contiguous stages fits {format_size(v1)} per "
                f"stage: the cuts each layer would need exclude each other"
                f"{_advice(model, None)}")
    k1 = len(relaxed)
    if k1 > len(slots):
        have = (f"only {len(workers)} worker{'s are' if len(workers) != 1 else ' is'} free"
                if R == 1 else f"only {len(workers)} workers are free, enough for "
                               f"{len(slots)} stage{'s' if len(slots) != 1 else ''} of {R} "
                               f"replicas")
        return (f"the model needs at least {k1} stages of <= {format_size(v1)} "
                f"({'the largest free budget' if R == 1 else 'the largest shared budget'}) "
                f"but {have}{_advice(model, None)}")
    if stages and k1 > stages:
        return (f"stages: {stages} is too few: the model needs at least {k1} stages of <= "
                f"{format_size(v1)} (the largest free budget); set stages: {k1} or more, or 0 "
                f"to let the planner choose{_advice(model, None)}")
    # total capacity
    depths = [stages] if stages else list(range(1, min(L, len(slots)) + 1))
    if not any(model.total_lower_bound(k) <= sum(slots[:k]) for k in depths):
        k = depths[-1]
        return (f"the model needs at least {format_size(model.total_lower_bound(k))} in all "
                f"({_describe_terms(model, model.breakdown(0, L))} for the whole model, plus "
                f"per-stage overheads) but the {k} largest free "
                f"{'budgets' if R == 1 else 'budgets shared by ' + str(R) + ' workers'} add up "
                f"to {format_size(sum(slots[:k]))}{_advice(model, model.breakdown(0, L))}")
    if stages and search.probe(math.inf, [v1] * stages, stages) is None:
        return (f"no split into exactly {stages} stages fits even {format_size(v1)} per stage "
                f"(every such split cuts the model after a wide layer whose output a stage "
                f"must keep for all micro-batches); {k1} stages fit: set stages: {k1} or 0"
                f"{_advice(model, None)}")
    budgets = _budget_list(workers)
    what = f"{stages}" if stages else f"at most {len(slots)}"
    return (f"no split into {what} stages gives every stage{' replica' if R > 1 else ''} its "
            f"own worker with enough free memory (free budgets: {budgets}): with every stage "
            f"at {format_size(v1)} {k1} stage{'s' if k1 != 1 else ''} would do, but only "
            f"{n_big} worker{'s have' if n_big != 1 else ' has'} that much free and the splits "
            f"into more stages need more of the larger workers than there are"
            f"{_advice(model, None)}")


# --------------------------------------------------------------------------------------------
# helpers for admission and the CLI


def suggest_stages(profile: ModelProfile, budget_bytes: int, *, global_batch: int,
                   microbatches: int = 1, replicas: int = 1, optimizer: str = "adam",
                   mixed_precision: str = "none", recompute: bool = False,
                   max_stages: int | None = None, label_bytes: int = 8,
                   data_bytes: int = 0, kernels: str = ANY) -> int | None:
    """The smallest pipeline depth whose stages each fit ``budget_bytes`` (at most
    ``max_stages``, default: one stage per layer), or None when no depth does. Used by
    admission to tell a user "this model fits as a 4-stage pipeline"."""
    microbatch = _microbatch(global_batch, replicas, microbatches)
    model = _cut_view(StageCostModel(
        profile, microbatch=microbatch, microbatches=microbatches, optimizer=optimizer,
        mixed_precision=mixed_precision, recompute=recompute, replicas=replicas,
        label_bytes=label_bytes, data_bytes=data_bytes, kernels=kernels), profile)
    limit = model.L if max_stages is None else max(0, min(int(max_stages), model.L))
    if limit < 1:
        return None
    split = _Search(model).probe(math.inf, [int(budget_bytes)] * limit, 0)
    return None if split is None else len(split)


def format_plan(plan: PipelinePlan) -> str:
    """The plan as text for ``strata plan``: one line per task, or the reason it is
    infeasible."""
    if not plan.feasible:
        return f"pipeline plan: NOT feasible - {plan.reason}"
    lines = [f"pipeline plan: {plan.num_stages} stage{'s' if plan.num_stages != 1 else ''}"
             + (f" x {plan.replicas} replicas" if plan.replicas > 1 else "")
             + f", {plan.microbatches} micro-batch{'es' if plan.microbatches != 1 else ''} of "
               f"{plan.microbatch}, bottleneck cost {plan.bottleneck_cost:.4g}"
             + ("" if plan.optimal else f" (search limit reached: not proven optimal, the "
                                       f"optimum is at least {plan.lower_bound:.4g})")]
    for s in plan.stages:
        names = s.layer_names
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        rep = f" replica {s.replica}" if plan.replicas > 1 else ""
        lines.append(f"  stage {s.index}{rep} on {s.worker}: layers {s.first_layer}-"
                     f"{s.last_layer - 1} ({len(names)}: {span}), memory "
                     f"{format_size(s.memory_bytes)} of {format_size(s.worker_free_bytes)} free,"
                     f" cost {s.cost:.4g}")
    return "\n".join(lines)
