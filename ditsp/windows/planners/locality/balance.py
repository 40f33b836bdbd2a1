"""Balance: per-layout token caps, and repairs that bring every rank under its cap (cheapest moves,
then an affinity-aware LPT, then a pure packing); a pass that lowers the per-rank traffic peak."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...capacity import Shares
from ...geometry import WindowLayout
from ..lpt import packed_assign, packed_shares
from .graph import State
from .params import MAX_IMBALANCE, CAP_MARGIN


def layout_caps(layouts: Sequence[WindowLayout], p: int, shares: Shares | None = None) -> list:
    """Per layout, the most tokens one rank may hold: 1.03 x the mean, or the best balance a
    packing search finds where 1.03 is out of reach (more ranks than windows, coarse windows).

    Unequal ``shares``: per layout a list, per rank: 1.03 x the rank's target (its speed's share, no rank above its token cap,
    :meth:`Shares.targets`), never above the token cap, or the packing's modelled time x its speed."""
    caps = []
    for lay in layouts:
        counts = lay.token_counts
        if shares is None:
            cap = int(np.floor(MAX_IMBALANCE * lay.num_tokens / p - CAP_MARGIN))
            packed = packed_assign(counts, p, cap)
            caps.append(max(cap, max(int(counts[b].sum()) if b else 0 for b in packed)))
            continue
        want = [int(np.floor(MAX_IMBALANCE * t - CAP_MARGIN)) for t in shares.targets(lay.num_tokens)]
        want = [w if shares.cap(r) is None else min(w, shares.cap(r)) for r, w in enumerate(want)]
        packed = packed_shares(counts, shares, want)
        loads = [int(counts[b].sum()) if b else 0 for b in packed]
        worst = max(x / s for x, s in zip(loads, shares.speed))
        reach = [int(np.floor(worst * sp)) for sp in shares.speed]  # the packing's modelled time, per rank
        reach = [x if shares.cap(r) is None else min(x, shares.cap(r)) for r, x in enumerate(reach)]
        caps.append([max(w, x, ld) for w, x, ld in zip(want, reach, loads)])
    return caps


def repair(st: State) -> bool:
    """Move the cheapest windows off ranks above their layout's cap; True when balanced."""
    p, w, conn = st.p, st.w, st.conn
    by_rank: dict[tuple[int, int], list[int]] = {}
    for v, r in enumerate(st.owner):
        by_rank.setdefault((st.layer[v], r), []).append(v)
    for lay, cap in enumerate(st.caps):
        load = st.load[lay]
        guard = 4 * st.g.n + 16
        while st.layout_over(lay) and guard > 0:
            guard -= 1
            r = max(range(p), key=lambda k: (load[k] - cap[k], -k))  # equal caps: the most loaded rank
            excess = load[r] - cap[r]
            best = None
            for adjacent in (True, False):  # prefer a neighbouring rank; any rank as a last resort
                for v in by_rank.get((lay, r), []):
                    row, wv = conn[v], w[v]
                    for s in range(p):
                        if s == r or (adjacent and row[s] == 0) or load[s] + wv > cap[s]:
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


def place_packed(st: State, lay: int) -> None:
    """Give one layout the packing search's assignment, its bins matched to the ranks that
    already hold most of their tokens (a guaranteed-feasible fallback)."""
    g = st.g
    lo = int(g.base[lay])
    if st.shares is not None:  # bins packed for each rank's speed and cap: bin r is rank r's
        for r, ids in enumerate(packed_shares(g.layouts[lay].token_counts, st.shares, st.caps[lay])):
            for i in ids:
                st.move(lo + i, r)
        return
    bins = packed_assign(g.layouts[lay].token_counts, st.p, st.caps[lay][0])
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


def affinity_lpt(st: State, lay: int) -> None:
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
        fitting = [s for s in range(st.p) if load[s] + st.w[v] <= cap[s]]
        if fitting:
            s = max(fitting, key=lambda k: ((pref[k] or 0), -load[k], -k))
        elif st.shares is None:
            s = min(range(st.p), key=lambda k: (load[k], k))
        else:
            s = min(range(st.p), key=lambda k: ((load[k] + st.w[v]) / st.shares.speed[k], k))
        load[s] += st.w[v]
        owner[v] = s
    for v, s in owner.items():
        st.move(v, s)


def balance(st: State) -> bool:
    """Repair; for a layout the repair cannot fix, an affinity-aware LPT, then the packing."""
    if repair(st):
        return True
    for lay in range(len(st.caps)):
        if st.layout_over(lay):
            affinity_lpt(st, lay)
    if repair(st):
        return True
    for lay in range(len(st.caps)):
        if st.layout_over(lay):
            place_packed(st, lay)
    return repair(st)


def lower_peak(st: State, max_steps: int = 400) -> None:
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
