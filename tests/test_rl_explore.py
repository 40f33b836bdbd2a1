"""Seed exploration's pieces (ditsp.rl.explore, timeline, published, spot_config): the highest-contrast
choice, Spearman's correlation and the modelled timeline against hand-computed values, published weights
read back bit for bit, and settings refused in one line."""

from __future__ import annotations

import pytest
import torch

from ditsp.rl.explore import candidate_seeds, contrast_choice, spearman
from ditsp.rl.loop import default_seeds
from ditsp.rl.published import Published, digest, read
from ditsp.rl.scheduler import Unit
from ditsp.rl.spot_config import SpotConfig
from ditsp.rl.timeline import modelled_steps, request_id, spans


def test_candidates_extend_the_default_seeds():
    assert candidate_seeds(0, 3, 1, 5)[:2] == default_seeds(0, 3, 1, 2)
    assert len(set(candidate_seeds(0, 3, 1, 8))) == 8


def test_the_choice_keeps_the_top_and_the_bottom_in_candidate_order():
    r = {10: 0.5, 11: 0.9, 12: 0.1, 13: 0.7, 14: 0.3}
    assert contrast_choice(r, [10, 11, 12, 13, 14], 2) == [11, 12]  # best and worst
    assert contrast_choice(r, [10, 11, 12, 13, 14], 3) == [11, 12, 13]  # two best, one worst
    assert contrast_choice(r, [10, 11, 12, 13, 14], 4) == [11, 12, 13, 14]
    assert contrast_choice({1: 0.0, 2: 0.0, 3: 0.0}, [1, 2, 3], 2) == [1, 3]  # ties: candidate order
    assert contrast_choice(r, [12, 10], 2) == [12, 10]  # as many as needed: all, unchanged
    with pytest.raises(ValueError, match="1 candidate seed"):
        contrast_choice(r, [10], 2)


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3) against (1, 3, 2): 1 - 6 * (0 + 1 + 1) / (3 * 8) = 0.5
    assert spearman([0.1, 0.2, 0.3], [5.0, 9.0, 7.0]) == pytest.approx(0.5)
    # a tie shares its mean rank: (1.5, 1.5, 3) against (1, 2, 3) -> Pearson of the ranks = sqrt(3)/2
    assert spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(3 ** 0.5 / 2)
    assert spearman([1, 1, 1], [1, 2, 3]) is None and spearman([1, 2], [2, 1]) is None
    with pytest.raises(ValueError):
        spearman([1, 2, 3], [1, 2])


def _u(step, kind, worker, cpu, seed=1):
    return Unit(request_id(step, kind, 0), seed, worker, 0.0, cpu)


def test_the_timeline_by_hand():
    units = [_u(0, "explore", "a", 1.0), _u(0, "explore", "b", 0.5), _u(0, "rollout", "a", 0.4),
             _u(0, "rollout", "b", 0.6), _u(1, "explore", "a", 2.0), _u(1, "explore", "b", 0.2, seed=None),
             _u(1, "rollout", "a", 0.3), _u(1, "audit", "a", 9.0), Unit("other", 1, "a", 0.0, 5.0)]
    assert spans(units) == {(0, "explore"): 1.0, (0, "rollout"): 0.6, (1, "explore"): 2.0, (1, "rollout"): 0.3,
                            (1, "audit"): 9.0}
    cpu = {0: 1.5, 1: 1.0}
    # step 0: its own exploration 1.0 (waited), rollouts 0.6, then max(update 1.5, next exploration 2.0)
    # step 1: rollouts 0.3, then the update 1.0 (nothing to explore after the last step); audits not counted
    assert modelled_steps("stale", cpu, units, 0, 2) == {0: 1.0 + 0.6 + 2.0, 1: 0.3 + 1.0}
    assert modelled_steps("fresh", cpu, units, 0, 2) == cpu


def test_published_weights_read_back_bit_for_bit_and_old_versions_go(tmp_path):
    pub = Published(str(tmp_path / "w"))
    states = [{"a": torch.randn(3, 4), "b": torch.arange(5.0)} for _ in range(5)]
    for v, st in enumerate(states):
        assert pub.publish(v, st) == digest(st)
    back = read(pub.folder, 4)
    assert digest(back) == digest(states[4]) and torch.equal(back["a"], states[4]["a"])
    with pytest.raises(FileNotFoundError, match="version 0 is no longer published"):
        read(pub.folder, 0)
    assert digest({"a": torch.zeros(2)}) != digest({"a": torch.zeros(2).neg()})  # -0.0: other bits
    pub.close()
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("kw, sp, message", [
    (dict(explore="greedy"), 1, "--explore must be one of none, fresh, stale"),
    (dict(explore="fresh", candidates=2), 1, "--candidates 2 is below --group-size 4"),
    (dict(explore="fresh", trace="t.txt"), 1, "--trace and --audit-premise need --explore stale"),
    (dict(explore="stale"), 2, "--explore stale trains at --sp 1"),
    (dict(explore="stale", spot_fraction=0.0), 1, "--spot-fraction must be in (0, 1]"),
    (dict(explore="stale", trace="/nonexistent/t.txt"), 1, "/nonexistent/t.txt: cannot read the trace"),
])
def test_settings_that_cannot_run_are_one_line(kw, sp, message):
    with pytest.raises(ValueError) as e:
        SpotConfig(**kw).check(group_size=4, sp=sp)
    assert message in str(e.value) and "\n" not in str(e.value)
