"""The exploration planner (ditsp.rl.bandit): the expected range it maximises, its split checked by hand and
against every split, its confidence bounds, and a seeded synthetic run where it beats the uniform split."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ditsp.rl.bandit import SeedPlanner, expected_contrast, expected_range, greedy_split, uniform_split


def test_expected_range_is_the_tabulated_one():
    # d(2) = 2/sqrt(pi) and d(3) = 3/sqrt(pi) exactly; d(4), d(5) the d2 constants of range charts
    assert expected_range(0) == expected_range(1) == 0.0
    assert expected_range(2) == pytest.approx(2 / math.sqrt(math.pi), abs=1e-9)
    assert expected_range(3) == pytest.approx(3 / math.sqrt(math.pi), abs=1e-9)
    assert expected_range(4) == pytest.approx(2.0588, abs=1e-4)
    assert expected_range(5) == pytest.approx(2.3259, abs=1e-4)
    steps = np.diff([expected_range(m) for m in range(1, 30)])
    assert (steps > 0).all() and (np.diff(steps) < 0).all()  # increasing and concave: greedy is optimal


def test_small_splits_by_hand():
    # sigma (2, 1), 2 each, 3 more: gains 2*0.564 > 1*0.564 -> p0; 2*0.366 > 0.564 -> p0; 2*0.267 < 0.564 -> p1
    assert greedy_split([2.0, 1.0], 7, 2) == [4, 3]
    assert greedy_split([1.0, 0.0], 6, 2) == [4, 2]  # no spread: no candidate beyond the group
    assert greedy_split([1.0, 1.0], 6, 2) == [3, 3]
    assert greedy_split([1.0, 1.0, 1.0], 6, 2) == [2, 2, 2]  # the budget only covers the rollouts
    assert uniform_split(3, 10, 2) == [4, 3, 3]
    with pytest.raises(ValueError, match="below 3 prompts x 2 rollouts"):
        greedy_split([1, 1, 1], 5, 2)


@pytest.mark.parametrize("sigmas", [(0.3, 1.0, 2.5), (1.0, 1.0, 0.1), (0.0, 0.5, 0.6)])
def test_the_greedy_split_is_the_best_of_every_split(sigmas):
    budget, group = 11, 2
    best = max(expected_contrast(sigmas, a) for a in itertools.product(range(group, budget + 1), repeat=3)
               if sum(a) == budget)
    assert expected_contrast(sigmas, greedy_split(sigmas, budget, group)) == pytest.approx(best, abs=1e-12)
    assert best >= expected_contrast(sigmas, uniform_split(3, budget, group))


def test_bounds_are_optimistic_for_prompts_seen_little():
    p = SeedPlanner(group=2, c=1.0)
    assert p.bounds([0, 1]) == [1.0, 1.0]  # nothing seen: every prompt alike
    p.observe(0, [0.0, 1.0, 2.0, 3.0])
    p.observe(1, [0.0, 0.1])
    b0, b1, b2 = p.bounds([0, 1, 2])
    assert b2 == max(b0, b1)  # never seen: the largest bound of those seen
    assert p.sigma(0) == pytest.approx(np.std([0, 1, 2, 3], ddof=1))
    for _ in range(50):
        p.observe(1, [0.0, 0.1])
    assert p.bounds([1])[0] < b1  # more observations, a tighter bound


def test_spread_is_pooled_within_steps_not_across_them():
    p = SeedPlanner(group=2)
    p.observe(0, [0.0, 1.0])
    p.observe(0, [100.0, 101.0])  # the policy moved the mean; the seeds' spread is unchanged
    assert p.sigma(0) == pytest.approx(math.sqrt(0.5))


def test_a_planner_refuses_a_rule_it_does_not_have():
    with pytest.raises(ValueError, match="bandit, uniform"):
        SeedPlanner(group=2, rule="thompson")


SIGMAS = (0.02, 0.05, 0.1, 0.2, 0.4, 0.8, 1.2, 2.0)


def _synthetic(rule: str, seed: int, rounds: int = 30, per_prompt: int = 4, group: int = 2) -> tuple[float, list]:
    """Prompts whose seeds' rewards are N(mu_i, sigma_i^2): the contrast (max - min of each prompt's candidates)
    summed over the run, and the split of every round."""
    rng = np.random.default_rng(seed)
    mus = rng.normal(0, 3, len(SIGMAS))
    planner = SeedPlanner(group=group, rule=rule)
    prompts = list(range(len(SIGMAS)))
    total, splits = 0.0, []
    for _ in range(rounds):
        split = planner.plan(prompts, per_prompt * len(prompts))
        splits.append(split)
        for p, m in zip(prompts, split):
            r = rng.normal(mus[p], SIGMAS[p], m)
            total += float(r.max() - r.min())
            planner.observe(p, r)
    return total, splits


def test_on_synthetic_prompts_the_bandit_gives_spread_prompts_more_and_beats_uniform():
    bandit = [_synthetic("bandit", s) for s in range(20)]
    uniform = [_synthetic("uniform", s) for s in range(20)]
    later = np.mean([np.mean(splits[10:], axis=0) for _, splits in bandit], axis=0)  # after it has learned
    assert later[-1] > later[0] and later[-1] > 4 and later[0] < 4
    assert np.corrcoef(later, SIGMAS)[0, 1] > 0.8
    gain = [b for b, _ in bandit]
    base = [u for u, _ in uniform]
    assert np.mean(gain) > np.mean(base)
    assert sum(b > u for b, u in zip(gain, base)) >= 15  # seed by seed too, not only on average
