"""Seed exploration: which candidate seeds a prompt tries, which of them its rollouts keep, and how well
rewards under stale weights rank the seeds as fresh weights would.

A prompt's ``m`` candidates at step ``s`` are the first ``m`` seeds of the run's seed sequence for
(step, prompt) (:func:`ditsp.rl.loop.default_seeds`), so with ``m == n`` exploration keeps exactly the seeds
a run without it uses. The ``n`` kept are the highest-contrast ones: the top ``ceil(n / 2)`` and the bottom
``floor(n / 2)`` by reward (ties by candidate order), so each group's advantages compare clear winners with
clear losers. Scored with the previous step's weights, the choice is only as good as the stale ranking:
:func:`spearman` measures it (the rank correlation of the same candidates' rewards under both weights).
"""

from __future__ import annotations

import numpy as np

from .loop import default_seeds


def candidate_seeds(run_seed: int, step: int, prompt: int, m: int) -> tuple[int, ...]:
    """The ``m`` candidate seeds of (step, prompt): the run's seed sequence, its first ``n`` the default seeds."""
    return default_seeds(run_seed, step, prompt, m)


def contrast_choice(rewards: dict[int, float], order, n: int) -> list[int]:
    """The ``n`` seeds of highest contrast among the candidates ``order`` (scored in ``rewards``): the top
    ``ceil(n / 2)`` and the bottom ``floor(n / 2)``, returned in candidate order."""
    order = list(order)
    if len(order) < n:
        raise ValueError(f"{len(order)} candidate seed(s) cannot give {n}")
    if len(order) == n:
        return order
    ranked = sorted(order, key=lambda s: (-rewards[s], order.index(s)))  # best first, ties by candidate order
    keep = set(ranked[: (n + 1) // 2]) | set(ranked[len(ranked) - n // 2:])
    return [s for s in order if s in keep]


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing their mean rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tied = x == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a, b) -> float | None:
    """Spearman's rank correlation of two score lists of one set of seeds (None when either has no spread
    or fewer than 3 seeds: no ranking to compare)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"spearman needs two lists of one length, got {a.shape} and {b.shape}")
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    ra, rb = _ranks(a), _ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])
