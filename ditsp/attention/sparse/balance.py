"""Runtime load balancing of sparse heads under Ulysses: the migration plan and the slack (pure).

After the sequence->head all-to-all a rank owns a contiguous shard of heads.
With adaptive routing the heads' selected work differs, so the rank with the
most work (the *critical* rank) sets the step time. Every rank gathers the
per-row costs of every head (one small all-gather) and calls
:func:`plan_migrations` on the same numbers, so every rank derives the same
plan without further messages.

The plan, greedy and deterministic:

1. ``c`` = the most loaded rank (lowest index on ties), ``d`` = the least loaded.
2. Candidates: a suffix of query rows ``[s, hi)`` of one of ``c``'s heads
   still at home (``s = 0`` is the whole head; with ``split_heads`` off only
   whole heads). Moving cost ``x`` gives the pair ``max(L_c - x, L_d + x)``;
   the best ``x`` is the one closest to ``(L_c - L_d) / 2``.
3. A move is made only when it shortens the pair's longer path by more than
   ``min_gain`` of the mean load, so no move lengthens the critical path.
4. Repeat up to ``max_moves``. The plan is kept only if the global critical
   path shrank (ties between several critical ranks may need more moves than
   allowed; then nothing moves).

Rows move at most once (only rows still at home are candidates), so the
receiver returns the output of the rows it got and nothing is forwarded.

**Slack**: after the plan, rank r may add ``critical - load_r`` of work
without lengthening the step (see :func:`ditsp.attention.sparse.routing.augment`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .config import SparseConfig


@dataclass(frozen=True)
class Move:
    """Query rows ``[lo, hi)`` (rows are ``batch * nb + q_block``) of ``head`` computed on ``dst`` instead of ``src``."""

    src: int
    dst: int
    head: int
    lo: int
    hi: int
    cost: float


@dataclass(frozen=True)
class MigrationPlan:
    moves: tuple[Move, ...]
    loads_before: tuple[float, ...]
    loads_after: tuple[float, ...]
    home_hi: tuple[int, ...] = field(default=())  # per head: rows [0, home_hi) stay with the owner

    @property
    def critical_before(self) -> float:
        return max(self.loads_before)

    @property
    def critical_after(self) -> float:
        return max(self.loads_after)

    @property
    def imbalance_before(self) -> float:
        return imbalance(self.loads_before)

    @property
    def imbalance_after(self) -> float:
        return imbalance(self.loads_after)

    def slack(self, rank: int) -> float:
        """Work rank ``rank`` may add without lengthening the step."""
        return self.critical_after - self.loads_after[rank]


def imbalance(loads: Sequence[float]) -> float:
    """max / mean (1.0 when perfectly even, or when there is no work)."""
    loads = np.asarray(loads, dtype=np.float64)
    m = loads.mean() if loads.size else 0.0
    return float(loads.max() / m) if m > 0 else 1.0


def owners_of(head_ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Owner rank of every head from contiguous head ranges."""
    out = []
    for r, (lo, hi) in enumerate(head_ranges):
        out += [r] * (hi - lo)
    return out


def plan_migrations(row_costs: np.ndarray, head_ranges: Sequence[tuple[int, int]], cfg: SparseConfig) -> MigrationPlan:
    """The migration plan of ``row_costs`` ``[H, R]`` (work per query row of every head) over ranks owning ``head_ranges``."""
    row_costs = np.asarray(row_costs, dtype=np.float64)
    H = row_costs.shape[0]
    P = len(head_ranges)
    owner = owners_of(head_ranges)
    if len(owner) != H:
        raise ValueError(f"head ranges cover {len(owner)} heads, costs have {H}")
    R = row_costs.shape[1] if row_costs.ndim == 2 else 0
    prefix = np.concatenate([np.zeros((H, 1)), np.cumsum(row_costs, axis=1)], axis=1)  # [H, R+1]
    loads = np.zeros(P)
    for h in range(H):
        loads[owner[h]] += prefix[h, -1]
    before = tuple(float(x) for x in loads)
    home_hi = [R] * H
    moves: list[Move] = []
    mean = loads.mean() if P else 0.0
    if cfg.balance and P > 1 and mean > 0:
        for _ in range(cfg.max_moves):
            c = int(np.argmax(loads))
            rest = [r for r in range(P) if r != c]
            d = min(rest, key=lambda r: (loads[r], r))
            gap = loads[c] - loads[d]
            want = gap / 2
            best = None  # (distance to want, head, start)
            for h in range(*head_ranges[c]):
                hi = home_hi[h]
                if hi == 0:
                    continue
                starts = np.arange(hi) if cfg.split_heads else np.array([0])
                x = prefix[h, hi] - prefix[h, starts]  # suffix costs, decreasing in start
                ok = (x > 0) & (x < gap)
                if not ok.any():
                    continue
                dist = np.where(ok, np.abs(x - want), np.inf)
                s = int(np.argmin(dist))
                if best is None or dist[s] < best[0]:
                    best = (float(dist[s]), h, int(starts[s]))
            if best is None:
                break
            _, h, s = best
            x = float(prefix[h, home_hi[h]] - prefix[h, s])
            gain = loads[c] - max(loads[c] - x, loads[d] + x)
            if gain <= cfg.min_gain * mean:
                break
            moves.append(Move(c, d, h, s, home_hi[h], x))
            home_hi[h] = s
            loads[c] -= x
            loads[d] += x
        if moves and max(loads) >= max(before):  # the critical path did not shrink: move nothing
            moves, loads, home_hi = [], np.asarray(before), [R] * H
    return MigrationPlan(tuple(moves), before, tuple(float(x) for x in loads), tuple(home_hi))
