"""Locality-aware window planner (``planner="locality"``).

LPT balances each layout on its own and ignores where tokens are, so at a
regular <-> shifted change almost every token changes rank. This planner
assigns the windows of all layouts of a schedule *together*, as one balanced
graph partition:

* vertices are the windows of every layout, each weighted by its token count
  in its own layout (one balance constraint per layout);
* an edge joins two windows of different layouts and weighs the tokens they
  share. A token changes rank at a transition exactly when the two windows
  holding it sit on different ranks, so the edge cut *is* the number of tokens
  moved per transition.

The partition is built deterministically:

1. **Starts.** (a) Recursive coordinate bisection of the first layout's windows:
   at each node the windows are ordered along an axis (ties by the two other
   axes, ascending or descending, so a partial slab becomes a staircase) and
   cut at the prefix nearest the rank split's token share; of all orders and
   the prefixes within a small slack, the cut splitting the fewest tokens of
   the other layouts wins. (b) Angular sectors around the (h, w) centre at
   8 rotations: every sector runs through all of t and touches the border, so
   ranks get similar boundary lengths and a low per-rank peak. Cutting t is
   avoided because the shifted layout moves the temporal cuts by half a window
   too, and a diagonal (staircase) boundary costs no more than its longer leg.
2. The windows of the other layouts go to the rank holding most of their
   tokens; a **balance repair** moves the cheapest windows off any rank above
   its cap (falling back to an affinity-aware LPT, then to a pure packing).
3. **Multi-constraint k-way Fiduccia-Mattheyses** (moves with hill climbing
   and rollback, never breaking a cap; first under caps relaxed by 6% and 3%
   of a share, then the real ones) minimises the tokens moved; a greedy pass
   then lowers the largest per-rank send+receive without raising the total.
4. The best start by (largest per-rank send+recv, tokens moved) gets a short
   iterated local search (fixed-seed LCG perturbations of boundary windows,
   re-refined, improvements kept).

Balance is a hard cap per layout: ``max/mean <= 1.03``, or, where no
assignment reaches 1.03 (more ranks than windows, coarse windows such as
720p at SP=6), the balance of a packing search (LPT plus moves and swaps),
which is never worse than LPT. Pure numpy/Python integer arithmetic: the same
request always gets the same plan, on every rank.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from .geometry import WindowLayout, window_size
from .planner import lpt_assign, register_planner

VERSION = 1
MAX_IMBALANCE = 1.03
_CAP_MARGIN = 1e-9  # keep max/mean strictly inside the cap despite float rounding
_SPLIT_SLACK = 0.01  # bisection may miss its token share by this fraction of a rank's share, per rank
_FM_PASSES = 8
_FM_STALL = 60  # FM stops after this many moves without a new best
_RELAX = (0.06, 0.03)  # FM first runs with caps this much (of a rank's share) above the real cap
_SECTOR_OFFSETS = 8  # angular starts
_ILS_WORK = 12000  # perturbation rounds x vertices on the best start (more rounds for small graphs)

RankWindows = tuple[tuple[int, ...], ...]


# ------------------------------------------------------------------ graph


def overlap_pairs(a: WindowLayout, b: WindowLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(window of ``a``, window of ``b``, shared tokens) for every overlapping pair."""
    if a.grid != b.grid:
        raise ValueError("layouts planned together must share one grid")
    na, nb = len(a), len(b)
    key = a.window_of_token() * nb + b.window_of_token()
    if na * nb <= 1 << 24:
        cnt = np.bincount(key, minlength=na * nb)
        nz = np.flatnonzero(cnt)
        w = cnt[nz]
    else:  # pragma: no cover - only for enormous window counts
        nz, w = np.unique(key, return_counts=True)
    return nz // nb, nz % nb, w.astype(np.int64)


def _centroids(layout: WindowLayout) -> np.ndarray:
    return np.array(
        [[(s.start + s.stop) / 2.0 for s in win] for win in layout.windows], dtype=np.float64
    )


class _Graph:
    """Windows of all layouts as vertices; shared tokens as edge weights."""

    def __init__(self, layouts: Sequence[WindowLayout]):
        self.layouts = list(layouts)
        sizes = [len(lay) for lay in layouts]
        self.base = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.n = int(self.base[-1])
        self.layer = np.repeat(np.arange(len(layouts)), sizes)
        self.weight = np.concatenate([lay.token_counts for lay in layouts]).astype(np.int64)
        self.totals = np.array([int(lay.num_tokens) for lay in layouts], dtype=np.int64)
        # dense overlap of every other layout with layout 0 (for bisection costs)
        self.dense0: list[np.ndarray] = []
        src, dst, wts = [], [], []
        for i in range(len(layouts)):
            for j in range(i + 1, len(layouts)):
                ia, ib, w = overlap_pairs(layouts[i], layouts[j])
                if i == 0:
                    m = np.zeros((sizes[j], sizes[0]), dtype=np.int64)
                    m[ib, ia] = w
                    self.dense0.append(m)
                src.append(ia + self.base[i])
                dst.append(ib + self.base[j])
                wts.append(w)
        nbrs: list[list[tuple[int, int]]] = [[] for _ in range(self.n)]
        if src:
            s, d, w = (np.concatenate(x).tolist() for x in (src, dst, wts))
            for a, b, c in zip(s, d, w):
                nbrs[a].append((b, c))
                nbrs[b].append((a, c))
        self.nbrs = nbrs
        self.deg = [sum(c for _, c in nb) for nb in nbrs]


# ------------------------------------------------------------------ state


class _State:
    """An assignment of every vertex to a rank, with connectivity and loads."""

    def __init__(self, g: _Graph, owner: Sequence[int], p: int, caps: Sequence[int]):
        self.g, self.p = g, p
        self.caps = [int(c) for c in caps]
        self.owner = [int(r) for r in owner]
        self.layer = g.layer.tolist()
        self.w = g.weight.tolist()
        self.load = [[0] * p for _ in range(len(g.layouts))]
        for v, r in enumerate(self.owner):
            self.load[self.layer[v]][r] += self.w[v]
        self.conn = [[0] * p for _ in range(g.n)]
        for v in range(g.n):
            row = self.conn[v]
            for u, c in g.nbrs[v]:
                row[self.owner[u]] += c

    def move(self, v: int, s: int) -> None:
        r = self.owner[v]
        if r == s:
            return
        lay, w = self.layer[v], self.w[v]
        self.load[lay][r] -= w
        self.load[lay][s] += w
        self.owner[v] = s
        conn = self.conn
        for u, c in self.g.nbrs[v]:
            row = conn[u]
            row[r] -= c
            row[s] += c

    def copy(self) -> "_State":
        new = object.__new__(_State)
        new.g, new.p, new.layer, new.w = self.g, self.p, self.layer, self.w
        new.caps = list(self.caps)
        new.owner = list(self.owner)
        new.load = [list(x) for x in self.load]
        new.conn = [list(x) for x in self.conn]
        return new

    def fits(self, v: int, s: int) -> bool:
        lay = self.layer[v]
        return self.load[lay][s] + self.w[v] <= self.caps[lay]

    def cut(self) -> int:
        """Tokens whose two windows sit on different ranks (counted once per edge)."""
        own = self.owner
        return sum(c for v in range(self.g.n) for u, c in self.g.nbrs[v] if u > v and own[u] != own[v])

    def volumes(self) -> list[int]:
        """Per rank: tokens of its windows held elsewhere in another layout (send + recv)."""
        vol = [0] * self.p
        own, conn, deg = self.owner, self.conn, self.g.deg
        for v in range(self.g.n):
            vol[own[v]] += deg[v] - conn[v][own[v]]
        return vol

    def over(self) -> bool:
        return any(max(ld) > cap for ld, cap in zip(self.load, self.caps))


# ------------------------------------------------------------------ construction


def _orders() -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Window orders for bisection: (primary, secondary, tertiary) axis directions.

    Windows are ordered along the primary axis; ties (a partial slab) by the secondary,
    then the tertiary axis, each ascending or descending, so a partial slab becomes a
    staircase on either side.
    """
    unit = ((1, 0, 0), (0, 1, 0), (0, 0, 1))
    out = []
    for a in range(3):
        for b in range(3):
            if b == a:
                continue
            c = 3 - a - b
            for sb in (1, -1):
                for sc in (1, -1):
                    out.append((unit[a], tuple(sb * x for x in unit[b]), tuple(sc * x for x in unit[c])))
    return tuple(out)


_ORDERS = _orders()


def _bisect_cost(g: _Graph, order_ids: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Tokens of the other layouts split by cutting ``order_ids`` after each ``cand`` prefix."""
    cost = np.zeros(cand.size, dtype=np.int64)
    for dense in g.dense0:
        d = dense[:, order_ids]
        rows = d.any(axis=1)
        if not rows.any():
            continue
        c = np.cumsum(d[rows], axis=1)
        tot = c[:, -1:]
        pre = np.zeros((c.shape[0], cand.size), dtype=np.int64)
        pos = cand > 0
        pre[:, pos] = c[:, cand[pos] - 1]
        cost += np.minimum(pre, tot - pre).sum(axis=0)
    return cost


def _rcb(g: _Graph, p: int, root_orders: Sequence[int], split_mode: int) -> np.ndarray:
    """Recursive coordinate bisection of layout 0's windows into ``p`` ranks."""
    lay0 = g.layouts[0]
    unit = np.array(window_size(lay0.grid, lay0.num_windows), dtype=np.float64)
    proj = _centroids(lay0) / unit @ np.array(_ORDERS, dtype=np.float64).reshape(-1, 3).T
    proj = np.round(proj, 6).reshape(len(lay0), len(_ORDERS), 3)  # exact ties stay ties
    wts = lay0.token_counts.astype(np.int64)
    share = float(wts.sum()) / p
    owner = np.zeros(len(lay0), dtype=np.int64)

    def rec(ids: np.ndarray, r0: int, k: int, orders) -> None:
        if k == 1 or ids.size == 0:
            owner[ids] = r0
            return
        k1 = k // 2 if split_mode == 0 else (k + 1) // 2
        k2 = k - k1
        best = None
        for oi in orders:
            pj = proj[ids, oi]
            o = ids[np.lexsort((pj[:, 2], pj[:, 1], pj[:, 0]))]
            pre = np.concatenate([[0], np.cumsum(wts[o])])
            target = pre[-1] * k1 / k
            slack = _SPLIT_SLACK * share * min(k1, k2)
            cand = np.flatnonzero(np.abs(pre - target) <= slack)
            nearest = int(np.argmin(np.abs(pre - target)))
            if nearest not in cand:
                cand = np.sort(np.append(cand, nearest))
            cost = _bisect_cost(g, o, cand)
            for c, m in zip(cost.tolist(), cand.tolist()):
                key = (c, abs(float(pre[m]) - target), oi)
                if best is None or key < best[0]:
                    best = (key, o, m)
        _, o, m = best
        rec(o[:m], r0, k1, range(len(_ORDERS)))
        rec(o[m:], r0 + k1, k2, range(len(_ORDERS)))

    rec(np.arange(len(lay0)), 0, p, root_orders)
    return owner


def _sectors(g: _Graph, p: int, offset: float) -> np.ndarray:
    """Layout 0's windows cut into ``p`` angular sectors around the grid's (h, w) centre.

    Every sector runs through all of t and touches the grid border, so ranks get similar
    boundary lengths (a low per-rank peak) rather than a crowded middle block.
    """
    lay0 = g.layouts[0]
    unit = np.array(window_size(lay0.grid, lay0.num_windows), dtype=np.float64)
    c = _centroids(lay0) / unit
    mid = np.array(lay0.grid, dtype=np.float64) / unit / 2
    ang = np.mod(np.arctan2(c[:, 1] - mid[1], c[:, 2] - mid[2]) - offset, 2 * np.pi)
    order = np.lexsort((c[:, 0], np.round(ang, 6)))
    pre = np.cumsum(lay0.token_counts[order])
    targets = pre[-1] * np.arange(1, p) / p
    cuts = np.concatenate([[0], np.abs(pre[None, :] - targets[:, None]).argmin(axis=1) + 1, [order.size]])
    cuts = np.maximum.accumulate(cuts)
    owner = np.zeros(len(lay0), dtype=np.int64)
    for r in range(p):
        owner[order[cuts[r] : cuts[r + 1]]] = r
    return owner


def _majority(g: _Graph, owner0: np.ndarray, p: int) -> np.ndarray:
    """Layout-0 owners plus, for every other window, the rank holding most of its tokens."""
    owner = np.zeros(g.n, dtype=np.int64)
    owner[: len(g.layouts[0])] = owner0
    for j, dense in enumerate(g.dense0, start=1):
        score = np.zeros((dense.shape[0], p), dtype=np.int64)
        for r in range(p):
            score[:, r] = dense[:, owner0 == r].sum(axis=1)
        owner[g.base[j] : g.base[j + 1]] = np.argmax(score, axis=1)  # ties: lowest rank
    return owner


# ------------------------------------------------------------------ refinement


def _repair(st: _State) -> bool:
    """Move the cheapest windows off ranks above their layout's cap; True when balanced."""
    p, w, conn = st.p, st.w, st.conn
    by_rank: dict[tuple[int, int], list[int]] = {}
    for v, r in enumerate(st.owner):
        by_rank.setdefault((st.layer[v], r), []).append(v)
    for lay, cap in enumerate(st.caps):
        load = st.load[lay]
        guard = 4 * st.g.n + 16
        while max(load) > cap and guard > 0:
            guard -= 1
            r = max(range(p), key=lambda k: (load[k], -k))
            excess = load[r] - cap
            best = None
            for adjacent in (True, False):  # prefer a neighbouring rank; any rank as a last resort
                for v in by_rank.get((lay, r), []):
                    row, wv = conn[v], w[v]
                    for s in range(p):
                        if s == r or (adjacent and row[s] == 0) or load[s] + wv > cap:
                            continue
                        # least cut increase; then a move that clears the excess; then small windows
                        key = (row[r] - row[s], wv < excess, wv, v, s)
                        if best is None or key < best:
                            best = key
                if best is not None:
                    break
            if best is None:
                return False
            v, s = best[3], best[4]
            by_rank[(lay, r)].remove(v)
            by_rank.setdefault((lay, s), []).append(v)
            st.move(v, s)
    return not st.over()


def _best_move(st: _State, v: int) -> tuple[int, int] | None:
    """(gain, destination) of v's best cap-respecting move to an adjacent rank."""
    r = st.owner[v]
    row = st.conn[v]
    lay, wv = st.layer[v], st.w[v]
    load, cap = st.load[lay], st.caps[lay]
    best = None
    for s in range(st.p):
        if s == r or row[s] == 0 or load[s] + wv > cap:
            continue
        key = (row[s] - row[r], -load[s], -s)
        if best is None or key > best:
            best = key
    return None if best is None else (best[0], -best[2])


def _fm(st: _State) -> None:
    """k-way Fiduccia-Mattheyses on the cut, with caps as hard constraints."""
    n = st.g.n
    nbrs = st.g.nbrs
    for _ in range(_FM_PASSES):
        stamp = [0] * n
        locked = bytearray(n)
        heap: list = []

        def push(v: int) -> None:
            m = _best_move(st, v)
            if m is not None:
                heapq.heappush(heap, (-m[0], v, m[1], stamp[v]))

        for v in range(n):
            if st.g.deg[v] and st.conn[v][st.owner[v]] < st.g.deg[v]:
                push(v)
        moves: list[tuple[int, int]] = []
        total = best_total = 0
        best_len = 0
        while heap:
            neg, v, s, sv = heapq.heappop(heap)
            if locked[v] or sv != stamp[v]:
                continue
            if not st.fits(v, s) or st.conn[v][s] - st.conn[v][st.owner[v]] != -neg:
                stamp[v] += 1
                push(v)
                continue
            r = st.owner[v]
            st.move(v, s)
            locked[v] = 1
            moves.append((v, r))
            total += -neg
            if total > best_total:
                best_total, best_len = total, len(moves)
            elif len(moves) - best_len >= _FM_STALL:
                break
            for u, _c in nbrs[v]:
                if not locked[u]:
                    stamp[u] += 1
                    push(u)
        for v, r in reversed(moves[best_len:]):
            st.move(v, r)
        if best_total <= 0:
            break


def _lower_peak(st: _State, max_steps: int = 400) -> None:
    """Greedy moves lowering (largest per-rank send+recv, ranks at it, tokens moved) lexicographically."""
    deg, conn, p = st.g.deg, st.conn, st.p
    vol = st.volumes()
    for _ in range(max_steps):
        peak = max(vol)
        cur = (peak, vol.count(peak), 0)
        best = None
        for v in range(st.g.n):
            r = st.owner[v]
            row = conn[v]
            if row[r] == deg[v]:
                continue
            for s in range(p):
                if s == r or row[s] == 0 or (vol[r] != peak and vol[s] != peak) or not st.fits(v, s):
                    continue
                new = vol[:]
                new[r] += 2 * row[r] - deg[v]
                new[s] += deg[v] - 2 * row[s]
                m = max(new)
                key = (m, new.count(m), row[r] - row[s], v, s)
                if key[:3] < cur and (best is None or key < best):
                    best = key
        if best is None:
            return
        v, s = best[3], best[4]
        r = st.owner[v]
        vol[r] += 2 * conn[v][r] - deg[v]
        vol[s] += deg[v] - 2 * conn[v][s]
        st.move(v, s)


# ------------------------------------------------------------------ planner


def packed_assign(token_counts: Sequence[int], p: int, cap: int | None = None) -> list[list[int]]:
    """A balanced assignment of one layout (no locality): LPT, then moves and swaps that lower
    the largest rank until it is at most ``cap`` or nothing improves. Deterministic."""
    counts = [int(c) for c in token_counts]
    bins = [list(ws) for ws in lpt_assign(counts, p)]
    load = [sum(counts[i] for i in b) for b in bins]
    for _ in range(4 * len(counts) + 16):
        r = max(range(p), key=lambda k: (load[k], -k))
        if cap is not None and load[r] <= cap:
            break
        best = None  # (new max of the two ranks, -, item out, item in or -1, dest)
        for s in range(p):
            if s == r:
                continue
            for i in bins[r]:
                if load[s] + counts[i] < load[r]:
                    key = (max(load[r] - counts[i], load[s] + counts[i]), i, -1, s)
                    best = key if best is None or key < best else best
                for j in bins[s]:
                    d = counts[i] - counts[j]
                    if d > 0 and load[s] + d < load[r]:
                        key = (max(load[r] - d, load[s] + d), i, j, s)
                        best = key if best is None or key < best else best
        if best is None:
            break
        _, i, j, s = best
        bins[r].remove(i)
        bins[s].append(i)
        load[r] -= counts[i]
        load[s] += counts[i]
        if j >= 0:
            bins[s].remove(j)
            bins[r].append(j)
            load[s] -= counts[j]
            load[r] += counts[j]
    return [sorted(b) for b in bins]


def _caps(layouts: Sequence[WindowLayout], p: int) -> list[int]:
    """Per layout, the most tokens one rank may hold: 1.03 x the mean, or the best balance a
    packing search finds where 1.03 is out of reach (more ranks than windows, coarse windows)."""
    caps = []
    for lay in layouts:
        cap = int(np.floor(MAX_IMBALANCE * lay.num_tokens / p - _CAP_MARGIN))
        counts = lay.token_counts
        packed = packed_assign(counts, p, cap)
        caps.append(max(cap, max(int(counts[b].sum()) if b else 0 for b in packed)))
    return caps


def _place_packed(st: _State, lay: int) -> None:
    """Give one layout the packing search's assignment, its bins matched to the ranks that
    already hold most of their tokens (a guaranteed-feasible fallback)."""
    g = st.g
    lo = int(g.base[lay])
    bins = packed_assign(g.layouts[lay].token_counts, st.p, st.caps[lay])
    score = [[0] * st.p for _ in bins]
    for b, ids in enumerate(bins):
        for i in ids:
            row = st.conn[lo + i]
            for r in range(st.p):
                score[b][r] += row[r]
            score[b][st.owner[lo + i]] += st.w[lo + i]
    pairs = sorted(((-score[b][r], b, r) for b in range(st.p) for r in range(st.p)))
    used_b, used_r, rank_of = set(), set(), {}
    for _, b, r in pairs:
        if b not in used_b and r not in used_r:
            used_b.add(b)
            used_r.add(r)
            rank_of[b] = r
    for b, ids in enumerate(bins):
        for i in ids:
            st.move(lo + i, rank_of[b])


def _affinity_lpt(st: _State, lay: int) -> None:
    """Re-place one layout's windows largest first, each on its best-connected rank that fits."""
    g = st.g
    lo, hi = int(g.base[lay]), int(g.base[lay + 1])
    cap = st.caps[lay]
    ids = sorted(range(lo, hi), key=lambda v: (-st.w[v], v))
    load = [0] * st.p
    owner = {}
    for v in ids:
        pref = [None] * st.p
        for u, c in g.nbrs[v]:
            if not lo <= u < hi:
                pref[st.owner[u]] = (pref[st.owner[u]] or 0) + c
        fitting = [s for s in range(st.p) if load[s] + st.w[v] <= cap]
        if fitting:
            s = max(fitting, key=lambda k: ((pref[k] or 0), -load[k], -k))
        else:
            s = min(range(st.p), key=lambda k: (load[k], k))
        load[s] += st.w[v]
        owner[v] = s
    for v, s in owner.items():
        st.move(v, s)


def _balance(st: _State) -> bool:
    """Repair; for a layout the repair cannot fix, an affinity-aware LPT, then the packing."""
    if _repair(st):
        return True
    for lay in range(len(st.caps)):
        if max(st.load[lay]) > st.caps[lay]:
            _affinity_lpt(st, lay)
    if _repair(st):
        return True
    for lay in range(len(st.caps)):
        if max(st.load[lay]) > st.caps[lay]:
            _place_packed(st, lay)
    return _repair(st)


def _refine(st: _State) -> bool:
    """FM under gradually tightened caps, then under the real caps, then the peak pass."""
    caps = st.caps
    for relax in _RELAX:
        st.caps = [int(c + relax * t / st.p) for c, t in zip(caps, st.g.totals)]
        if _balance(st):
            _fm(st)
    st.caps = caps
    if not _balance(st):
        return False
    _fm(st)
    _lower_peak(st)
    return True


class _Lcg:
    """A tiny fixed-seed generator: the same perturbations on every machine and version."""

    def __init__(self, seed: int):
        self.x = seed & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        self.x = (self.x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        return (self.x >> 33) % n


def _perturb_search(st: _State, iters: int) -> _State:
    """Iterated local search: shake a few boundary windows, re-refine, keep improvements."""
    rng = _Lcg(0x5EED)
    best, best_score = st, _score(st)
    for _ in range(iters):
        cand = best.copy()
        own, conn, deg = cand.owner, cand.conn, cand.g.deg
        boundary = [v for v in range(cand.g.n) if conn[v][own[v]] < deg[v]]
        if not boundary:
            break
        for _k in range(max(1, len(boundary) // 20)):
            v = boundary[rng.below(len(boundary))]
            row, r = conn[v], own[v]
            dest = [s for s in range(cand.p) if s != r and row[s] > 0]
            if dest:
                cand.move(v, max(dest, key=lambda s: (row[s], -s)))
        if not _refine(cand):
            continue
        sc = _score(cand)
        if sc < best_score:
            best, best_score = cand, sc
    return best


def _score(st: _State) -> tuple:
    return (st.over(), max(st.volumes()), st.cut())


def locality_assign(layouts: Sequence[WindowLayout], world_size: int) -> tuple[RankWindows, ...]:
    """Per layout, per rank: the window ids of a locality-aware balanced plan."""
    layouts = list(layouts)
    p = int(world_size)
    if p == 1:
        return tuple((tuple(range(len(lay))),) for lay in layouts)
    g = _Graph(layouts)
    caps = _caps(layouts, p)
    modes = (0,) if p & (p - 1) == 0 else (0, 1)  # k//2 == (k+1)//2 at every node of a power of two
    starts = [lambda m=m: _rcb(g, p, range(len(_ORDERS)), m) for m in modes]
    starts += [lambda k=k: _sectors(g, p, 2 * np.pi * k / _SECTOR_OFFSETS) for k in range(_SECTOR_OFFSETS)]
    best = None
    for make in starts:
        st = _State(g, _majority(g, make(), p), p, caps)
        if not _refine(st):
            continue
        sc = _score(st)
        if best is None or sc < best[0]:
            best = (sc, st)
    if best is None:  # cannot happen: the packing fallback always fits its own caps
        return tuple(tuple(map(tuple, packed_assign(lay.token_counts, p, c))) for lay, c in zip(layouts, caps))
    st = _perturb_search(best[1], min(200, max(16, _ILS_WORK // g.n)))
    out = []
    for lay in range(len(layouts)):
        lo = int(g.base[lay])
        ranks: list[list[int]] = [[] for _ in range(p)]
        for i in range(len(layouts[lay])):
            ranks[st.owner[lo + i]].append(i)
        out.append(tuple(tuple(r) for r in ranks))
    return tuple(out)


register_planner("locality", locality_assign, version=VERSION)
