"""Row ownership: which rank holds each canonical row of a grid, and where in its local rows.

A window :class:`~.plan.Plan` is one kind of ownership (whole windows per
rank); a height-slab split of a latent (what a sharded VAE holds) is another;
contiguous shards (the Ulysses baseline) a third. Moving activations between
any two ownerships of the same grid is one :class:`~.plan.Transition`, so the
VAE's slabs can go straight to the DiT's first window layout, and the DiT's
output rows straight back to the decoder's slabs, without ever gathering the
whole latent on every rank.

:meth:`RowOwnership.refine` maps a token-level ownership to the finer grid
the tokens were patched from: each token's pt x ph x pw pixels go with it, in
the patch order (dt, dy, dx) that patchify uses, so "exchange pixels, then
reshape (tokens, pixels x channels)" is exactly "patchify, then exchange".
Pure numpy; no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .plan import LRUCache, Transition
import hashlib

Grid = tuple[int, int, int]
_CACHE = LRUCache(32)


@dataclass(frozen=True, eq=False)
class RowOwnership:
    """Owner rank and local row of every canonical row ``(t*H + h)*W + w`` of ``grid``."""

    grid: Grid
    world_size: int
    owner: np.ndarray
    position: np.ndarray
    name: str
    _cache: dict = field(default_factory=dict, repr=False)

    def owner_and_position(self) -> tuple[np.ndarray, np.ndarray]:
        return self.owner, self.position

    @property
    def key(self) -> tuple:
        """A cache key that changes with the ownership's content."""
        if "key" not in self._cache:
            h = hashlib.sha1(self.owner.tobytes() + self.position.tobytes()).hexdigest()
            self._cache["key"] = (self.grid, self.world_size, h)
        return self._cache["key"]

    @property
    def rank_rows(self) -> np.ndarray:
        return np.bincount(self.owner, minlength=self.world_size)

    def rank_ids(self, rank: int) -> np.ndarray:
        """Canonical ids rank ``rank`` holds, in its local order."""
        ids = np.flatnonzero(self.owner == rank)
        return ids[np.argsort(self.position[ids], kind="stable")]

    @classmethod
    def from_rank_ids(cls, grid: Sequence[int], rank_ids: Sequence[np.ndarray], name: str) -> "RowOwnership":
        """Rank r holds canonical rows ``rank_ids[r]`` in that order; every row exactly once."""
        grid = tuple(int(v) for v in grid)
        n = int(np.prod(grid))
        owner = np.full(n, -1, dtype=np.int64)
        position = np.zeros(n, dtype=np.int64)
        for r, ids in enumerate(rank_ids):
            ids = np.asarray(ids, dtype=np.int64)
            if ids.size and (owner[ids] >= 0).any():
                raise ValueError(f"{name}: a row is held by two ranks")
            owner[ids] = r
            position[ids] = np.arange(ids.size)
        if (owner < 0).any():
            raise ValueError(f"{name}: {int((owner < 0).sum())} rows of grid {grid} are held by no rank")
        return cls(grid, len(rank_ids), owner, position, name)

    @classmethod
    def of_plan(cls, plan) -> "RowOwnership":
        """A window plan's ownership (whole windows per rank)."""
        owner, position = plan.owner_and_position()
        return cls(tuple(plan.layout.grid), plan.world_size, owner, position, f"{plan.layout.name}/{plan.planner}")

    @classmethod
    def slabs(cls, grid: Sequence[int], ranges: Sequence[tuple[int, int, int, int]], name: str = "slabs"
              ) -> "RowOwnership":
        """Rank r holds ``(t0, t1, h0, h1) = ranges[r]`` with every column, row-major (t, h, w)."""
        T, H, W = (int(v) for v in grid)
        ids = []
        for t0, t1, h0, h1 in ranges:
            t = np.arange(t0, t1)[:, None, None]
            h = np.arange(h0, h1)[None, :, None]
            w = np.arange(W)[None, None, :]
            ids.append(((t * H + h) * W + w).reshape(-1))
        return cls.from_rank_ids((T, H, W), ids, name)

    @classmethod
    def contiguous(cls, grid: Sequence[int], rows: Sequence[int], name: str = "contiguous") -> "RowOwnership":
        """Rank r holds the ``rows[r]`` canonical rows after those of ranks before it."""
        starts = np.concatenate([[0], np.cumsum(rows)])
        return cls.from_rank_ids(grid, [np.arange(starts[r], starts[r + 1]) for r in range(len(rows))], name)

    def refine(self, patch: Sequence[int]) -> "RowOwnership":
        """The same ownership on the grid the tokens were patched from (each token's pixels go with it)."""
        key = ("refine", tuple(patch))
        if key in self._cache:
            return self._cache[key]
        pt, ph, pw = (int(v) for v in patch)
        T, H, W = self.grid
        P = pt * ph * pw
        t = np.arange(T * pt)[:, None, None]
        h = np.arange(H * ph)[None, :, None]
        w = np.arange(W * pw)[None, None, :]
        token = ((t // pt) * H + h // ph) * W + w // pw
        sub = ((t % pt) * ph + h % ph) * pw + w % pw
        token, sub = (np.broadcast_to(a, (T * pt, H * ph, W * pw)).reshape(-1) for a in (token, sub))
        out = RowOwnership((T * pt, H * ph, W * pw), self.world_size, self.owner[token],
                           self.position[token] * P + sub, f"{self.name}x{pt}{ph}{pw}")
        self._cache[key] = out
        return out


def ownership_transition(src: RowOwnership, dst: RowOwnership) -> Transition:
    """Rows from ``src`` to ``dst`` (same grid and world size), cached by both ownerships' content."""
    if src.grid != dst.grid or src.world_size != dst.world_size:
        raise ValueError(f"a transition needs one grid and world size: {src.name} {src.grid}/{src.world_size}, "
                         f"{dst.name} {dst.grid}/{dst.world_size}")

    def make() -> Transition:
        p = src.world_size
        counts = np.bincount(src.owner * p + dst.owner, minlength=p * p).reshape(p, p)
        return Transition(src, dst, counts)

    return _CACHE.get_or_make((src.key, dst.key), make)
