"""Refinement: multi-constraint k-way Fiduccia-Mattheyses moves that lower the tokens moved without
breaking a cap."""

from __future__ import annotations

import heapq


from .balance import balance, lower_peak
from .graph import State
from .params import FM_PASSES, FM_STALL, RELAX


def best_move(st: State, v: int) -> tuple[int, int] | None:
    """(gain, destination) of v's best cap-respecting move to an adjacent rank."""
    r = st.owner[v]
    row = st.conn[v]
    lay, wv = st.layer[v], st.w[v]
    load, cap = st.load[lay], st.caps[lay]
    best = None
    for s in range(st.p):
        if s == r or row[s] == 0 or load[s] + wv > cap[s]:
            continue
        key = (row[s] - row[r], -load[s], -s)
        if best is None or key > best:
            best = key
    return None if best is None else (best[0], -best[2])


def fm(st: State) -> None:
    """k-way Fiduccia-Mattheyses on the cut, with caps as hard constraints."""
    n = st.g.n
    nbrs = st.g.nbrs
    for _ in range(FM_PASSES):
        stamp = [0] * n
        locked = bytearray(n)
        heap: list = []

        def push(v: int) -> None:
            m = best_move(st, v)
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
            elif len(moves) - best_len >= FM_STALL:
                break
            for u, _c in nbrs[v]:
                if not locked[u]:
                    stamp[u] += 1
                    push(u)
        for v, r in reversed(moves[best_len:]):
            st.move(v, r)
        if best_total <= 0:
            break


def relaxed(st: State, caps: list[list[int]], relax: float) -> list[list[int]]:
    """Caps raised by ``relax`` of each rank's share of a layout's tokens (equal ranks: of the mean)."""
    if st.shares is None:
        return [[int(c + relax * t / st.p) for c in cap] for cap, t in zip(caps, st.g.totals)]
    frac = st.shares.fractions()
    return [[int(c + relax * t * f) for c, f in zip(cap, frac)] for cap, t in zip(caps, st.g.totals)]


def refine(st: State) -> bool:
    """FM under gradually tightened caps, then under the real caps, then the peak pass."""
    caps = st.caps
    for relax in RELAX:
        st.caps = relaxed(st, caps, relax)
        if balance(st):
            fm(st)
    st.caps = caps
    if not balance(st):
        return False
    fm(st)
    lower_peak(st)
    return True
