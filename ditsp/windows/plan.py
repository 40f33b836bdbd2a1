"""Plans and transitions: which rank holds which windows, and which rows move at a layout change.

Immutable values, pure numpy: a :class:`Plan` says which windows and which
canonical tokens each rank holds (in that rank's local row order); a
:class:`Transition` says which rows go where when the layout changes. Both are
cached (LRU) by everything that determines them, so a different SP degree or
planner never reuses a stale result.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .geometry import GEOMETRY_VERSION, WindowLayout


@dataclass(frozen=True, eq=False)
class Plan:
    """Windows of one layout assigned to ``world_size`` ranks.

    Rank r holds the windows ``rank_windows[r]`` (ascending ids) and its local
    rows are those windows' tokens back to back, row-major inside a window.
    """

    layout: WindowLayout
    world_size: int
    planner: str
    rank_windows: tuple[tuple[int, ...], ...]
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def rank_tokens(self) -> np.ndarray:
        if "rank_tokens" not in self._cache:
            counts = self.layout.token_counts
            self._cache["rank_tokens"] = np.array(
                [int(counts[list(w)].sum()) if w else 0 for w in self.rank_windows], dtype=np.int64
            )
        return self._cache["rank_tokens"]

    @property
    def imbalance(self) -> float:
        """max / mean tokens over ranks (1.0 is perfect)."""
        tok = self.rank_tokens
        return float(tok.max() / tok.mean())

    def rank_token_ids(self, rank: int) -> np.ndarray:
        """Canonical token ids held by ``rank``, in its local row order."""
        key = ("ids", rank)
        if key not in self._cache:
            lay = self.layout
            parts = [lay.window_token_ids(i) for i in self.rank_windows[rank]]
            self._cache[key] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._cache[key]

    def owner_and_position(self) -> tuple[np.ndarray, np.ndarray]:
        """For every canonical token: its owning rank and its local row there."""
        if "owner" not in self._cache:
            n = self.layout.num_tokens
            owner = np.empty(n, dtype=np.int64)
            pos = np.empty(n, dtype=np.int64)
            for r in range(self.world_size):
                ids = self.rank_token_ids(r)
                owner[ids] = r
                pos[ids] = np.arange(ids.size)
            self._cache["owner"] = (owner, pos)
        return self._cache["owner"]

    def window_owner(self) -> np.ndarray:
        owner = np.empty(len(self.layout), dtype=np.int64)
        for r, ws in enumerate(self.rank_windows):
            owner[list(ws)] = r
        return owner

    def rank_window_lengths(self, rank: int) -> list[int]:
        counts = self.layout.token_counts
        return [int(counts[i]) for i in self.rank_windows[rank]]


# ---------------------------------------------------------------- cache


class LRUCache:
    """A small bounded mapping; the oldest entry goes first."""

    def __init__(self, maxsize: int = 32):
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self.hits = self.misses = 0

    def get_or_make(self, key, make):
        if key in self._data:
            self.hits += 1
            self._data.move_to_end(key)
            return self._data[key]
        self.misses += 1
        value = make()
        self._data[key] = value
        if len(self._data) > self.maxsize:
            self._data.popitem(last=False)
        return value

    def keys(self):
        return list(self._data)

    def clear(self):
        self._data.clear()
        self.hits = self.misses = 0

    def __len__(self):
        return len(self._data)


PLAN_CACHE = LRUCache(32)
TRANSITION_CACHE = LRUCache(64)


# ---------------------------------------------------------------- transitions


@dataclass(frozen=True, eq=False)
class Transition:
    """Moving rows from plan ``src`` to plan ``dst``.

    ``counts[r, d]`` is the number of rows rank d needs from rank r. Rank r
    sends ``send_index(r)`` rows of its src-local activations (grouped by
    destination, each group in destination-local order) and restores its
    dst-local order from what it receives with ``recv_order(r)``.
    """

    src: Plan
    dst: Plan
    counts: np.ndarray
    _index: dict = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.src.world_size

    @property
    def exchange_required(self) -> bool:
        """Decided from the global matrix, so every rank takes the same branch."""
        return bool((self.counts - np.diag(np.diag(self.counts))).any())

    @property
    def tokens_moved(self) -> int:
        return int(self.counts.sum() - np.trace(self.counts))

    @property
    def fraction_moved(self) -> float:
        return self.tokens_moved / max(1, int(self.counts.sum()))

    @property
    def rank_send(self) -> np.ndarray:
        return self.counts.sum(axis=1) - np.diag(self.counts)

    @property
    def rank_recv(self) -> np.ndarray:
        return self.counts.sum(axis=0) - np.diag(self.counts)

    def memo(self, key, make: Callable):
        """A value derived from this transition (index orders, device tensors), made once and kept."""
        if key not in self._index:
            self._index[key] = make()
        return self._index[key]

    def _orders(self) -> tuple[np.ndarray, np.ndarray]:
        if "orders" not in self._index:
            so, sp = self.src.owner_and_position()
            do, dp = self.dst.owner_and_position()
            send = np.lexsort((dp, do, so))  # grouped by sender, then destination, then dst row
            recv = np.lexsort((dp, so, do))  # grouped by receiver, then sender, then dst row
            self._index["orders"] = (send, recv)
        return self._index["orders"]

    def send_index(self, rank: int) -> np.ndarray:
        """Src-local rows of ``rank`` in send order (by destination, dst-local order)."""
        key = ("send", rank)
        if key not in self._index:
            send, _ = self._orders()
            _, sp = self.src.owner_and_position()
            start = int(self.counts[:rank].sum())
            self._index[key] = sp[send[start : start + int(self.counts[rank].sum())]]
        return self._index[key]

    def recv_order(self, rank: int) -> np.ndarray:
        """Permutation that turns received rows (by sender) into dst-local order."""
        key = ("recv", rank)
        if key not in self._index:
            _, recv = self._orders()
            _, dp = self.dst.owner_and_position()
            start = int(self.counts[:, :rank].sum())
            positions = dp[recv[start : start + int(self.counts[:, rank].sum())]]
            self._index[key] = np.argsort(positions, kind="stable")
        return self._index[key]


def count_matrix(src: Plan, dst: Plan) -> np.ndarray:
    """C[r, d]: rows rank d needs from rank r."""
    if src.layout.grid != dst.layout.grid or src.world_size != dst.world_size:
        raise ValueError("a transition needs two plans of the same grid and world size")
    so, _ = src.owner_and_position()
    do, _ = dst.owner_and_position()
    p = src.world_size
    return np.bincount(so * p + do, minlength=p * p).reshape(p, p)


def transition(src: Plan, dst: Plan) -> Transition:
    """The (cached) layout change from ``src`` to ``dst``."""
    key = (
        src.layout.grid,
        src.layout.fingerprint,
        dst.layout.fingerprint,
        GEOMETRY_VERSION,
        src.world_size,
        src.planner,
        dst.planner,
        src.rank_windows,
        dst.rank_windows,
    )
    return TRANSITION_CACHE.get_or_make(key, lambda: Transition(src, dst, count_matrix(src, dst)))
