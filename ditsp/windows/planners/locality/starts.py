"""Starting partitions: recursive coordinate bisection, angular sectors, majority placement of the
other layouts' windows."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...geometry import window_size
from .graph import Graph, centroids
from .params import SPLIT_SLACK


def make_orders() -> tuple[tuple[tuple[int, int, int], ...], ...]:
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


ORDERS = make_orders()


def bisect_cost(g: Graph, order_ids: np.ndarray, cand: np.ndarray) -> np.ndarray:
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


def rcb(g: Graph, p: int, root_orders: Sequence[int], split_mode: int,
        targets: Sequence[float] | None = None) -> np.ndarray:
    """Recursive coordinate bisection of layout 0's windows into ``p`` ranks (``targets``: each rank's
    share of the tokens, unequal ranks; None: equal)."""
    lay0 = g.layouts[0]
    unit = np.array(window_size(lay0.grid, lay0.num_windows), dtype=np.float64)
    proj = centroids(lay0) / unit @ np.array(ORDERS, dtype=np.float64).reshape(-1, 3).T
    proj = np.round(proj, 6).reshape(len(lay0), len(ORDERS), 3)  # exact ties stay ties
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
            if targets is None:
                target = pre[-1] * k1 / k
                slack = SPLIT_SLACK * share * min(k1, k2)
            else:  # the first k1 ranks' share of what this node holds
                a, b = sum(targets[r0:r0 + k1]), sum(targets[r0 + k1:r0 + k])
                target = pre[-1] * a / (a + b)
                slack = SPLIT_SLACK * float(wts.sum()) * min(a, b)
            cand = np.flatnonzero(np.abs(pre - target) <= slack)
            nearest = int(np.argmin(np.abs(pre - target)))
            if nearest not in cand:
                cand = np.sort(np.append(cand, nearest))
            cost = bisect_cost(g, o, cand)
            for c, m in zip(cost.tolist(), cand.tolist()):
                key = (c, abs(float(pre[m]) - target), oi)
                if best is None or key < best[0]:
                    best = (key, o, m)
        _, o, m = best
        rec(o[:m], r0, k1, range(len(ORDERS)))
        rec(o[m:], r0 + k1, k2, range(len(ORDERS)))

    rec(np.arange(len(lay0)), 0, p, root_orders)
    return owner


def sectors(g: Graph, p: int, offset: float, targets: Sequence[float] | None = None) -> np.ndarray:
    """Layout 0's windows cut into ``p`` angular sectors around the grid's (h, w) centre.

    Every sector runs through all of t and touches the grid border, so ranks get similar
    boundary lengths (a low per-rank peak) rather than a crowded middle block.
    """
    lay0 = g.layouts[0]
    unit = np.array(window_size(lay0.grid, lay0.num_windows), dtype=np.float64)
    c = centroids(lay0) / unit
    mid = np.array(lay0.grid, dtype=np.float64) / unit / 2
    ang = np.mod(np.arctan2(c[:, 1] - mid[1], c[:, 2] - mid[2]) - offset, 2 * np.pi)
    order = np.lexsort((c[:, 0], np.round(ang, 6)))
    pre = np.cumsum(lay0.token_counts[order])
    if targets is None:
        goal = pre[-1] * np.arange(1, p) / p
    else:
        goal = pre[-1] * np.cumsum(np.asarray(targets, dtype=np.float64))[:-1]
    cuts = np.concatenate([[0], np.abs(pre[None, :] - goal[:, None]).argmin(axis=1) + 1, [order.size]])
    cuts = np.maximum.accumulate(cuts)
    owner = np.zeros(len(lay0), dtype=np.int64)
    for r in range(p):
        owner[order[cuts[r] : cuts[r + 1]]] = r
    return owner


def majority(g: Graph, owner0: np.ndarray, p: int) -> np.ndarray:
    """Layout-0 owners plus, for every other window, the rank holding most of its tokens."""
    owner = np.zeros(g.n, dtype=np.int64)
    owner[: len(g.layouts[0])] = owner0
    for j, dense in enumerate(g.dense0, start=1):
        score = np.zeros((dense.shape[0], p), dtype=np.int64)
        for r in range(p):
            score[:, r] = dense[:, owner0 == r].sum(axis=1)
        owner[g.base[j] : g.base[j + 1]] = np.argmax(score, axis=1)  # ties: lowest rank
    return owner
