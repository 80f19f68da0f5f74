"""The stage search: the bottleneck-minimising split of a model's layers into stages whose
memory fits the workers' free budgets (``docs/planner.md``: keys, probes, the bisection,
hardness and the work allowance). ``strata.planner`` wraps it for the strategies."""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Any, Callable, Sequence

from strata.memory import FIXED_OVERHEAD, FRAGMENTATION
from strata.stagememory import StageCostModel

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


class _Keys:
    """The states of ``Search.dp``'s keyed programme. A key is the set of slot ranks its
    stages took (a bit per rank); per key: a sliding-window-maximum deque of the boundaries
    it reaches, its packed prefix counts and rank sum (for dominance, ``_pareto``), and per
    state (boundary, key) the state it came from; for the beam, the keys alive per stage
    count."""

    def __init__(self, S: int, homogeneous: bool):
        self.homogeneous = homogeneous
        self.queues: dict[int, deque[int]] = {0: deque([0])}
        self.packing = _Packing(1 if homogeneous else S)  # homogeneous keys are never compared
        self.ones = self.packing.ones if not homogeneous else [0] * (S + 2)
        self.packs: dict[int, int] = {0: 0}
        self.sums: dict[int, int] = {0: 0}
        self.parent: dict[tuple[int, int], tuple[int, int]] = {}
        self.alive: dict[int, set[int]] = {0: {0}}

    def admit(self, nk: int) -> None:
        """The beam: a new key joins those of its stage count; past ``BEAM_ALIVE`` of them,
        the key that took the largest slots is evicted."""
        group = self.alive.setdefault(nk.bit_count(), set())
        group.add(nk)
        if len(group) > BEAM_ALIVE:
            sums = self.sums
            worst = min(group, key=lambda k: (sums[k], k))
            group.discard(worst)
            del self.queues[worst]

    def drop(self, dead: list[int], beam: bool) -> None:
        """Forgets keys whose boundaries all left the window."""
        for key in dead:
            del self.queues[key]
            if beam:
                self.alive[key.bit_count()].discard(key)

    def split(self, final: dict[int, tuple[int, int]], L: int) -> list[tuple[int, int]]:
        """The split of the final key with the fewest stages (then the smallest), traced
        back through the parents."""
        key = min(final, key=lambda k: (k.bit_count(), k))
        a, prev = final[key]
        split = [(a, L)]
        while a > 0:
            a2, prev2 = self.parent[(a, prev)]
            split.append((a2, a))
            a, prev = a2, prev2
        split.reverse()
        return split


def _beam_keys(cand: dict[int, tuple[int, int]], kfix: int, homogeneous: bool,
               sums: dict[int, int]) -> tuple[dict[int, tuple[int, int]], int]:
    """The keys ``dp``'s beam keeps at a boundary, and the work that took. Homogeneous keys
    are {S-k+1..S}: at a fixed depth none dominates another, at a free one the fewest stages
    dominate. Otherwise (the heuristic), per stage count the key that took the smallest
    slots."""
    if homogeneous:
        if not kfix:
            nk = min(cand, key=int.bit_count)
            return {nk: cand[nk]}, 0
        return cand, 0
    best: dict[int, int] = {}
    for nk in cand:
        n = nk.bit_count()
        o = best.get(n)
        if o is None or (sums[nk], nk) > (sums[o], o):
            best[n] = nk
    kept = {nk: cand[nk] for nk in best.values()}
    return kept, len(kept)


class Undecided(Exception):
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


class Search:
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
        allowance and raises ``Undecided`` when it runs out. ``beam`` makes it a heuristic
        that keeps one key per boundary and stage count (the one that took the smallest slots):
        a split it finds is placeable, None proves nothing."""
        L = self.L
        g = win[1]
        S = len(slots_desc)
        if S == 0 or (kfix and (kfix > S or kfix > L)):
            return None
        if g[0] > (kfix or S):
            return None
        homogeneous = slots_desc[0] == slots_desc[-1]
        if homogeneous and not beam:
            if kfix:
                return self.ordered_dp(win, slots_desc, charge=False)
            return self._fewest(win, slots_desc[0], S)
        keys = _Keys(S, homogeneous)
        final = self._keyed(win, slots_desc, kfix, keys, limited or not homogeneous, beam)
        if not final:
            return None
        return keys.split(final, L)

    def _keyed(self, win: tuple[list[int], list[int]], slots_desc: Sequence[int], kfix: int,
               keys: _Keys, limited: bool, beam: bool) -> dict[int, tuple[int, int]]:
        """``dp``'s keyed programme, boundary by boundary: the keys reaching the last one, each
        with its last stage's start and previous key (``keys.parent``: the rest), or none."""
        L, S = self.L, len(slots_desc)
        X, Y = self.m._x, self.m._y
        lo_, g = win
        kcap = kfix or S
        asc = sorted(slots_desc)
        fixed, frag, ceil = FIXED_OVERHEAD, FRAGMENTATION, math.ceil
        queues, packs, sums, ones = keys.queues, keys.packs, keys.sums, keys.ones
        parent, packing, homogeneous = keys.parent, keys.packing, keys.homogeneous
        work = 0
        allowance = self.work_left if limited else -1
        final: dict[int, tuple[int, int]] = {}
        for b in range(1, L + 1):
            lb, xb, last = lo_[b], X[b], b == L
            cand: dict[int, tuple[int, int]] = {}
            dead = []
            work += 3 * len(queues)  # about a microsecond per unit
            if work > allowance >= 0:
                self.work_left = 0
                raise Undecided()
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
            if dead:
                keys.drop(dead, beam)
            if len(cand) > 1:
                if beam:  # the only way homogeneous keys come here
                    cand, extra = _beam_keys(cand, kfix, homogeneous, sums)
                    work += extra
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
                        keys.admit(nk)
                else:
                    while dq and Y[dq[-1]] <= yb:
                        dq.pop()
                    dq.append(b)
        if limited:
            self.work_left -= work
        return final

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
                raise Undecided()
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
        number when kfix == 0), or None if there is none. Raises ``Undecided`` when the probe
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
        except Undecided:
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
            raise Undecided()
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
        except Undecided:
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
        except Undecided:
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
        ``Undecided`` when no placeable split was found and none was proven impossible.

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
                        raise Undecided()
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
            except Undecided:  # the bottleneck stays optimal; the depth may not be minimal
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


