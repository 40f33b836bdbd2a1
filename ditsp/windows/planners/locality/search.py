"""Search: every start repaired and refined, the best one improved by a short deterministic iterated
local search; the planner entry point."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...capacity import Shares
from ...geometry import WindowLayout
from ..lpt import packed_assign, packed_shares
from .balance import layout_caps
from .graph import Graph, RankWindows, State
from .params import ILS_WORK, SECTOR_OFFSETS
from .refine import refine
from .starts import ORDERS, majority, rcb, sectors


class Lcg:
    """A tiny fixed-seed generator: the same perturbations on every machine and version."""

    def __init__(self, seed: int):
        self.x = seed & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        self.x = (self.x * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        return (self.x >> 33) % n


def perturb_search(st: State, iters: int) -> State:
    """Iterated local search: shake a few boundary windows, re-refine, keep improvements."""
    rng = Lcg(0x5EED)
    best, best_score = st, score(st)
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
        if not refine(cand):
            continue
        sc = score(cand)
        if sc < best_score:
            best, best_score = cand, sc
    return best


def score(st: State) -> tuple:
    return (st.over(), max(st.volumes()), st.cut())


def locality_assign(layouts: Sequence[WindowLayout], world_size: int,
                    shares: Shares | None = None) -> tuple[RankWindows, ...]:
    """Per layout, per rank: the window ids of a locality-aware balanced plan (balanced by modelled time,
    tokens / speed, under each rank's token cap where ``shares`` are unequal)."""
    layouts = list(layouts)
    p = int(world_size)
    if p == 1:
        return tuple((tuple(range(len(lay))),) for lay in layouts)
    shares = None if shares is None or shares.even else shares
    g = Graph(layouts)
    caps = layout_caps(layouts, p, shares)
    tw = None if shares is None else [t / int(g.totals[0]) for t in shares.targets(int(g.totals[0]))]
    modes = (0,) if p & (p - 1) == 0 else (0, 1)  # k//2 == (k+1)//2 at every node of a power of two
    starts = [lambda m=m: rcb(g, p, range(len(ORDERS)), m, tw) for m in modes]
    starts += [lambda k=k: sectors(g, p, 2 * np.pi * k / SECTOR_OFFSETS, tw) for k in range(SECTOR_OFFSETS)]
    best = None
    for make in starts:
        st = State(g, majority(g, make(), p), p, caps, shares)
        if not refine(st):
            continue
        sc = score(st)
        if best is None or sc < best[0]:
            best = (sc, st)
    if best is None:  # cannot happen: the packing fallback always fits its own caps
        if shares is not None:
            return tuple(tuple(map(tuple, packed_shares(lay.token_counts, shares, c))) for lay, c in zip(layouts, caps))
        return tuple(tuple(map(tuple, packed_assign(lay.token_counts, p, c))) for lay, c in zip(layouts, caps))
    st = perturb_search(best[1], min(200, max(16, ILS_WORK // g.n)))
    out = []
    for lay in range(len(layouts)):
        lo = int(g.base[lay])
        ranks: list[list[int]] = [[] for _ in range(p)]
        for i in range(len(layouts[lay])):
            ranks[st.owner[lo + i]].append(i)
        out.append(tuple(tuple(r) for r in ranks))
    return tuple(out)
