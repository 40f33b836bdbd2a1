"""Token-balanced assignment of one layout's windows: LPT, and a packing search that improves on it.

Pure Python: the same counts give the same assignment on every rank. With unequal :class:`Shares`
(speeds, token caps) both balance modelled time (tokens / speed) instead of tokens, never putting a rank
above its cap where another rank can take the window; equal shares take the integer path unchanged.
"""

from __future__ import annotations

from typing import Sequence

from ..capacity import Shares

VERSION = 1


def _move(bins, load, counts, r: int, s: int, i: int, j: int) -> None:
    """Move item ``i`` from bin ``r`` to bin ``s`` and, when ``j >= 0``, item ``j`` back from ``s`` to ``r``."""
    bins[r].remove(i)
    bins[s].append(i)
    load[r] -= counts[i]
    load[s] += counts[i]
    if j >= 0:
        bins[s].remove(j)
        bins[r].append(j)
        load[s] -= counts[j]
        load[r] += counts[j]


def lpt_assign(token_counts: Sequence[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Longest-processing-time assignment, the seed's tie-breaking exactly.

    Windows sorted by (-tokens, id); each goes to the rank with the smallest
    (assigned tokens, rank id); each rank lists its windows by ascending id.
    """
    counts = [int(c) for c in token_counts]
    order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    load = [0] * world_size
    owned: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], k))
        load[r] += counts[i]
        owned[r].append(i)
    return tuple(tuple(sorted(ws)) for ws in owned)


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
        _move(bins, load, counts, r, s, i, j)
    return [sorted(b) for b in bins]


def lpt_shares(token_counts: Sequence[int], shares: Shares) -> tuple[tuple[int, ...], ...]:
    """LPT for ranks of unequal speed (and token caps): windows sorted by (-tokens, id), each to the rank
    that would finish it first ((load + tokens) / speed, then rank id) among those whose cap it fits (all
    ranks where none fits: the plan then breaks a cap, which its caller refuses)."""
    counts = [int(c) for c in token_counts]
    p, speed = shares.world_size, shares.speed
    order = sorted(range(len(counts)), key=lambda i: (-counts[i], i))
    load = [0] * p
    owned: list[list[int]] = [[] for _ in range(p)]
    for i in order:
        c = counts[i]
        fit = [k for k in range(p) if shares.cap(k) is None or load[k] + c <= shares.cap(k)]
        r = min(fit or range(p), key=lambda k: ((load[k] + c) / speed[k], k))
        load[r] += c
        owned[r].append(i)
    return tuple(tuple(sorted(ws)) for ws in owned)


def packed_shares(token_counts: Sequence[int], shares: Shares, caps: Sequence[int] | None = None) -> list[list[int]]:
    """:func:`packed_assign` for unequal shares: LPT by finishing time, then moves and swaps that lower the
    largest modelled time (tokens / speed) until every rank is within ``caps`` (per rank) or nothing
    improves; no move puts a rank above its token cap. Deterministic."""
    counts = [int(c) for c in token_counts]
    p, speed = shares.world_size, shares.speed
    bins = [list(ws) for ws in lpt_shares(counts, shares)]
    load = [sum(counts[i] for i in b) for b in bins]
    hard = [shares.cap(k) for k in range(p)]

    def room(s: int, add: int) -> bool:
        return hard[s] is None or load[s] + add <= hard[s]

    for _ in range(4 * len(counts) + 16):
        if caps is not None and all(load[k] <= caps[k] for k in range(p)):
            break
        r = max(range(p), key=lambda k: (load[k] / speed[k], -k))
        now = load[r] / speed[r]
        best = None  # (new max of the two ranks' times, item out, item in or -1, dest)
        for s in range(p):
            if s == r:
                continue
            for i in bins[r]:
                after = max((load[r] - counts[i]) / speed[r], (load[s] + counts[i]) / speed[s])
                if after < now and room(s, counts[i]):
                    key = (after, i, -1, s)
                    best = key if best is None or key < best else best
                for j in bins[s]:
                    d = counts[i] - counts[j]
                    if d <= 0:
                        continue
                    after = max((load[r] - d) / speed[r], (load[s] + d) / speed[s])
                    if after < now and room(s, d):
                        key = (after, i, j, s)
                        best = key if best is None or key < best else best
        if best is None:
            break
        _, i, j, s = best
        _move(bins, load, counts, r, s, i, j)
    return [sorted(b) for b in bins]


def plan_lpt(layouts, world_size: int, shares: Shares | None = None):
    """The ``lpt`` planner: every layout balanced on its own (by modelled time under unequal ``shares``)."""
    if shares is None or shares.even:
        return tuple(lpt_assign(lay.token_counts, world_size) for lay in layouts)
    return tuple(lpt_shares(lay.token_counts, shares) for lay in layouts)
