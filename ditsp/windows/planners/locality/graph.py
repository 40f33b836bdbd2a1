"""The partition problem: windows of every layout as vertices, shared tokens as edges, and the
mutable assignment state (per-rank loads, per-layout per-rank caps, cut) every other step edits."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...capacity import Shares
from ...geometry import WindowLayout

RankWindows = tuple[tuple[int, ...], ...]


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


def centroids(layout: WindowLayout) -> np.ndarray:
    return np.array(
        [[(s.start + s.stop) / 2.0 for s in win] for win in layout.windows], dtype=np.float64
    )


class Graph:
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


class State:
    """An assignment of every vertex to a rank, with connectivity and loads."""

    def __init__(self, g: Graph, owner: Sequence[int], p: int, caps: Sequence, shares: Shares | None = None):
        self.g, self.p = g, p
        self.shares = shares  # None: equal ranks (the plain path); else speeds and token caps
        self.caps = [[int(c)] * p if np.ndim(c) == 0 else [int(x) for x in c] for c in caps]  # per layout, per rank
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

    def copy(self) -> "State":
        new = object.__new__(State)
        new.g, new.p, new.layer, new.w, new.shares = self.g, self.p, self.layer, self.w, self.shares
        new.caps = [list(c) for c in self.caps]
        new.owner = list(self.owner)
        new.load = [list(x) for x in self.load]
        new.conn = [list(x) for x in self.conn]
        return new

    def fits(self, v: int, s: int) -> bool:
        lay = self.layer[v]
        return self.load[lay][s] + self.w[v] <= self.caps[lay][s]

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
        return any(x > c for ld, cap in zip(self.load, self.caps) for x, c in zip(ld, cap))

    def layout_over(self, lay: int) -> bool:
        return any(x > c for x, c in zip(self.load[lay], self.caps[lay]))
