"""Sharding a packed stream over ranks so attention work balances and few rank pairs interact.

A :class:`Dispatch` gives every rank an ordered list of *segments*
``(doc, start, stop)`` (positions inside the document); a rank's local rows are
its segments' rows back to back. Modes:

- ``contiguous``: the stream cut into equal contiguous shares (what a
  document-unaware ring does);
- ``zigzag``: every document cut into ``2P`` chunks, rank ``r`` holding chunks
  ``r`` and ``2P-1-r`` (the early, cheap causal rows paired with the late,
  expensive ones), so every document is balanced on its own;
- ``area`` (default): area-weighted hybrid. Documents are taken largest area
  first; the largest ``k`` are zigzag-split over all ranks and the rest are
  placed *whole* by longest-processing-time on the least-loaded rank, with the
  smallest ``k`` whose imbalance (max/mean per-rank attention area) is at most
  ``tolerance``. A whole document lives on one rank, so its keys never travel
  and rank pairs that share no document skip both transfer and compute.

Area counts query-key pairs exactly (causal rows see their prefix, text keys
count for every query). Pure integer Python; cached by signature, so every
rank derives the same dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..common import even_splits
from .docs import PackedDocs

MODES = ("area", "zigzag", "contiguous")
TOLERANCE = 1.05

Segment = tuple[int, int, int]  # (doc, start, stop), positions inside the document


def segment_area(docs: PackedDocs, seg: Segment) -> int:
    d, a, b = seg
    n = b - a
    if docs.causal[d]:
        keys = (a + 1 + b) * n // 2  # query at position p sees p + 1 keys
    else:
        keys = n * docs.lengths[d]
    return keys + n * docs.text_lens[d]


@dataclass(frozen=True, eq=False)
class Dispatch:
    """Per-rank segments of one packed stream."""

    docs: PackedDocs
    world_size: int
    mode: str
    segments: tuple[tuple[Segment, ...], ...]
    _cache: dict = field(default_factory=dict, repr=False)

    def rank_rows(self, rank: int) -> np.ndarray:
        """Global stream rows held by ``rank``, in its local order."""
        key = ("rows", rank)
        if key not in self._cache:
            cu = self.docs.cu_seqlens
            parts = [np.arange(cu[d] + a, cu[d] + b, dtype=np.int64) for d, a, b in self.segments[rank]]
            self._cache[key] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._cache[key]

    @property
    def rank_lens(self) -> list[int]:
        return [sum(b - a for _, a, b in segs) for segs in self.segments]

    @property
    def rank_area(self) -> list[int]:
        return [sum(segment_area(self.docs, s) for s in segs) for segs in self.segments]

    @property
    def imbalance(self) -> float:
        """max / mean per-rank attention area (1.0 is perfect)."""
        area = self.rank_area
        return max(area) / max(1e-9, sum(area) / len(area))

    def local_segments(self, rank: int) -> list[tuple[int, int, int, int]]:
        """``(doc, start, stop, local row offset)`` of every segment of ``rank``."""
        out, o = [], 0
        for d, a, b in self.segments[rank]:
            out.append((d, a, b, o))
            o += b - a
        return out


def _zigzag(n: int, p: int) -> list[list[tuple[int, int]]]:
    """Per rank: the (start, stop) chunks of a length-``n`` document, non-empty only."""
    cuts = even_splits(n, 2 * p)
    o = [0]
    for c in cuts:
        o.append(o[-1] + c)
    out = []
    for r in range(p):
        mine = [(o[r], o[r + 1]), (o[2 * p - 1 - r], o[2 * p - r])]
        out.append([(a, b) for a, b in mine if b > a])
    return out


def _contiguous(docs: PackedDocs, p: int) -> list[list[Segment]]:
    shares = even_splits(docs.total, p)
    cu, out, start = docs.cu_seqlens, [], 0
    for s in shares:
        lo, hi, segs = start, start + s, []
        for d in range(docs.num_docs):
            a, b = max(lo, cu[d]), min(hi, cu[d + 1])
            if b > a:
                segs.append((d, a - cu[d], b - cu[d]))
        out.append(segs)
        start = hi
    return out


def _hybrid(docs: PackedDocs, p: int, split: set[int]) -> list[list[Segment]]:
    segs: list[list[Segment]] = [[] for _ in range(p)]
    load = [0] * p
    for d in sorted(split):
        for r, chunks in enumerate(_zigzag(docs.lengths[d], p)):
            for a, b in chunks:
                segs[r].append((d, a, b))
                load[r] += segment_area(docs, (d, a, b))
    whole = sorted((d for d in range(docs.num_docs) if d not in split), key=lambda d: (-docs.area(d), d))
    for d in whole:
        r = min(range(p), key=lambda k: (load[k], k))
        segs[r].append((d, 0, docs.lengths[d]))
        load[r] += docs.area(d)
    return [sorted(s) for s in segs]


def _imbalance(docs: PackedDocs, segs: list[list[Segment]]) -> float:
    area = [sum(segment_area(docs, s) for s in ss) for ss in segs]
    return max(area) / max(1e-9, sum(area) / len(area))


@lru_cache(maxsize=64)
def _dispatch(sig: tuple, p: int, mode: str, tolerance: float) -> Dispatch:
    docs = PackedDocs(*sig)
    if mode == "contiguous":
        segs = _contiguous(docs, p)
    elif mode == "zigzag":
        segs = _hybrid(docs, p, set(range(docs.num_docs)))
    elif mode == "area":
        order = sorted(range(docs.num_docs), key=lambda d: (-docs.area(d), d))
        best = None
        for k in range(docs.num_docs + 1):
            cand = _hybrid(docs, p, set(order[:k]))
            imb = _imbalance(docs, cand)
            if best is None or imb < best[0] - 1e-12:
                best = (imb, cand)
            if imb <= tolerance:
                best = (imb, cand)
                break
        segs = best[1]
    else:
        raise ValueError(f"unknown dispatch mode {mode!r}; choose from {', '.join(MODES)}")
    return Dispatch(docs, p, mode, tuple(tuple(s) for s in segs))


def dispatch(docs: PackedDocs, world_size: int, mode: str = "area", tolerance: float = TOLERANCE) -> Dispatch:
    """The (cached) dispatch of ``docs`` over ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    return _dispatch(docs.signature(), int(world_size), mode, float(tolerance))
