"""The exploration planner: how many candidate seeds each prompt gets out of the step's budget.

Seed exploration samples ``m`` candidate seeds of a prompt and keeps the ``n`` whose rewards contrast most
(the top and the bottom). What a prompt gains from its candidates is the spread they reveal: with rewards of
spread ``sigma`` across seeds, the expected range of ``m`` candidates is ``sigma * d(m)``, ``d(m)`` the
expected range of ``m`` standard normal draws (:func:`expected_range`: 0, 1.128, 1.693, 2.059, 2.326 for
m = 1..5). ``d`` is concave, so the split of a budget that maximises the summed expected range is greedy:
every prompt starts at ``n`` (its rollouts) and each further candidate goes to the prompt whose range grows
most from it, ``sigma_i * (d(m_i + 1) - d(m_i))``.

``sigma`` is not known: a prompt's spread is learned from the rewards its seeds got (exploration and
rollouts alike), and the planner splits by an upper confidence bound on it (UCB), so a prompt with few
observations is tried before it is written off. The spread is pooled within steps (each step's rewards
around that step's own mean), so the policy's progress between steps is not mistaken for seed spread.
:func:`uniform_split` is the baseline: the budget divided evenly.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

RULES = ("bandit", "uniform")


@lru_cache(maxsize=1)
def _normal_cdf_grid() -> tuple[np.ndarray, np.ndarray]:
    x = np.linspace(-12.0, 12.0, 48001)
    return x, np.array([0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x])


@lru_cache(maxsize=None)
def expected_range(m: int) -> float:
    """E[max - min] of ``m`` independent standard normal draws: the integral over x of
    1 - Phi(x)^m - (1 - Phi(x))^m (0 for m < 2)."""
    if m < 2:
        return 0.0
    x, phi = _normal_cdf_grid()
    y = 1.0 - phi ** m - (1.0 - phi) ** m
    return float(np.sum((y[1:] + y[:-1]) * 0.5 * np.diff(x)))


def expected_contrast(sigmas, alloc) -> float:
    """Summed expected range of the candidates' rewards: sum over prompts of sigma_i * d(m_i)."""
    return float(sum(s * expected_range(int(m)) for s, m in zip(sigmas, alloc)))


def _check(prompts: int, budget: int, group: int) -> None:
    if group < 1:
        raise ValueError(f"the group (rollouts per prompt) must be >= 1, got {group}")
    if budget < prompts * group:
        raise ValueError(f"a budget of {budget} candidate samples is below {prompts} prompts x {group} rollouts")


def uniform_split(prompts: int, budget: int, group: int) -> list[int]:
    """The budget divided evenly; the remainder to the first prompts."""
    _check(prompts, budget, group)
    base, extra = divmod(budget, prompts) if prompts else (0, 0)
    return [base + (i < extra) for i in range(prompts)]


def greedy_split(sigmas, budget: int, group: int) -> list[int]:
    """The split maximising :func:`expected_contrast` for spreads ``sigmas``: each prompt ``group``
    candidates, then one at a time to the largest ``sigma_i * (d(m_i + 1) - d(m_i))`` (ties: the first)."""
    sigmas = [float(s) for s in sigmas]
    _check(len(sigmas), budget, group)
    alloc = [group] * len(sigmas)
    for _ in range(budget - group * len(sigmas)):
        gains = [s * (expected_range(m + 1) - expected_range(m)) for s, m in zip(sigmas, alloc)]
        alloc[int(np.argmax(gains))] += 1
    return alloc


@dataclass
class _Spread:
    """One prompt's recent seed spread: per step, (count, sum of squared deviations from that step's mean)."""

    steps: deque = field(default_factory=lambda: deque(maxlen=32))

    def add(self, rewards) -> None:
        r = np.asarray(list(rewards), dtype=np.float64)
        if r.size >= 2:
            self.steps.append((r.size, float(((r - r.mean()) ** 2).sum())))

    @property
    def dof(self) -> int:
        return sum(n - 1 for n, _ in self.steps)

    @property
    def sigma(self) -> float:
        return math.sqrt(sum(ss for _, ss in self.steps) / self.dof) if self.dof else 0.0


class SeedPlanner:
    """Splits a budget of candidate seeds across prompts: ``rule`` "bandit" (UCB on each prompt's observed
    spread, :func:`greedy_split`) or "uniform" (:func:`uniform_split`).

    The bound is ``sigma_i + c * pooled * sqrt(ln N / dof_i)``: ``pooled`` the spread of every prompt
    together (the bonus is in reward units), ``N`` every prompt's degrees of freedom summed. A prompt never
    seen twice gets the largest bound of those seen (every prompt alike when none is).
    """

    def __init__(self, group: int, rule: str = "bandit", c: float = 1.0, memory: int = 32):
        if rule not in RULES:
            raise ValueError(f"the planner's rule is one of {', '.join(RULES)}, got {rule!r}")
        if group < 1:
            raise ValueError(f"the group (rollouts per prompt) must be >= 1, got {group}")
        self.group, self.rule, self.c, self.memory = group, rule, c, memory
        self._spread: dict = {}

    def observe(self, prompt, rewards) -> None:
        """The rewards one step's seeds of ``prompt`` got (exploration candidates or rollouts)."""
        self._spread.setdefault(prompt, _Spread(deque(maxlen=self.memory))).add(rewards)

    def sigma(self, prompt) -> float:
        s = self._spread.get(prompt)
        return s.sigma if s else 0.0

    def bounds(self, prompts) -> list[float]:
        """The upper confidence bound on each prompt's spread."""
        seen = [s for s in self._spread.values() if s.dof]
        total = sum(s.dof for s in seen)
        if not total:
            return [1.0] * len(prompts)
        pooled = math.sqrt(sum(s.sigma ** 2 * s.dof for s in seen) / total)
        log_n = math.log(max(total, 2))
        out: list[float | None] = []
        for p in prompts:
            s = self._spread.get(p)
            out.append(s.sigma + self.c * pooled * math.sqrt(log_n / s.dof) if s and s.dof else None)
        top = max((b for b in out if b is not None), default=1.0)
        return [top if b is None else b for b in out]

    def plan(self, prompts, budget: int) -> list[int]:
        """Candidates per prompt (each >= the group), summing to ``budget``."""
        prompts = list(prompts)
        if self.rule == "uniform":
            return uniform_split(len(prompts), budget, self.group)
        return greedy_split(self.bounds(prompts), budget, self.group)
