"""Ranks of unequal capacity (ditsp/windows/capacity.py): the values and their checks, cuts in proportion to
speed, and the window planners balancing modelled time (tokens / speed) under each rank's token cap; equal
capacities give exactly the even plans (pure, no ranks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ditsp.models.seedvr2.vae.layouts import SlabLayout, even_split
from ditsp.sp.halo_slab import plan_halo, slab_ranges
from ditsp.windows.capacity import GiB, Capacities, Shares, parse_list, proportional_split, speed_from_memory
from ditsp.windows.geometry import window_layout
from ditsp.windows.planners import plan_layouts
from ditsp.windows.planners.locality import locality_assign
from ditsp.windows.planners.lpt import lpt_assign, lpt_shares, packed_shares
from ditsp.windows.schedule import plan_schedule

METHODS = ("720pwin_by_size_bysize", "720pswin_by_size_bysize")
speeds = st.lists(st.floats(0.05, 4.0, allow_nan=False), min_size=1, max_size=6)


# -- the values ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda: Capacities.of(2, memory=[32 * GiB]), "1 value.*SP degree 2"),
    (lambda: Capacities.of(3, speed=[1, 0.5]), "2 value.*SP degree 3"),
    (lambda: Capacities((1.0, float("nan"))), "finite number > 0"),
    (lambda: Capacities((1.0, 0.0)), "finite number > 0"),
    (lambda: Capacities((1.0, 1.0), (GiB, -1)), "finite number > 0"),
    (lambda: Capacities((1.0, float("inf"))), "finite number > 0"),
    (lambda: parse_list("32,,24", "--rank-memory"), "comma-separated"),
    (lambda: parse_list("32,big", "--rank-memory"), "'big' is not a number"),
    (lambda: parse_list("32,-1", "--rank-memory"), "finite number > 0"),
])
def test_bad_capacities_are_one_line_errors(make, match):
    with pytest.raises(ValueError, match=match) as e:
        make()
    assert "\n" not in str(e.value)


def test_capacities_of_what_is_known():
    assert parse_list(" 32, 24 ", "x") == (32.0, 24.0)
    assert Capacities.of(2) == Capacities.uniform(2) and Capacities.uniform(2).even
    c = Capacities.of(2, memory=[32 * GiB, 24 * GiB])  # no speed given: from memory, to 0.01
    assert c.speed == (1.0, 0.75) and c.memory == (32 * GiB, 24 * GiB) and not c.even
    assert Capacities.of(2, memory=[32 * GiB, 24 * GiB], speed=[1, 0.55]).speed == (1.0, 0.55)
    # a few MiB of free memory between equal cards change nothing
    assert speed_from_memory([80 * GiB, 80 * GiB - 5 * 2**20]) == (1.0, 1.0)
    assert c.fractions() == pytest.approx((4 / 7, 3 / 7))
    assert "rank 1: 24.0 GiB, speed 0.75" in c.describe()


# -- cuts in proportion ------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), st.integers(1, 9), st.floats(0.1, 5))
def test_equal_weights_split_exactly_evenly(n, parts, w):
    assert proportional_split(n, [w] * parts) == [b - a for a, b in even_split(n, parts)]
    assert proportional_split(n, None, parts) == [b - a for a, b in even_split(n, parts)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 500), speeds, st.integers(0, 3))
def test_a_split_is_whole_in_proportion_and_keeps_its_minimum(n, weights, minimum):
    sizes = proportional_split(n, weights, minimum=minimum)
    assert sum(sizes) == n and all(s >= 0 for s in sizes)
    total = sum(weights)
    if n >= len(weights) * max(1, minimum):
        assert min(sizes) >= minimum
        if minimum == 0 and len(set(weights)) > 1:  # largest remainders: within one of the exact share
            assert all(abs(s - n * w / total) < 1 for s, w in zip(sizes, weights))
    else:  # too few items for every part: the equal split, empty parts last
        assert sizes == [b - a for a, b in even_split(n, len(weights))]


def test_vae_slabs_follow_speed_in_whole_latent_rows():
    even = SlabLayout(5, 67, 120, 536, 960, 2)
    assert SlabLayout(5, 67, 120, 536, 960, 2, (0.7, 0.7)).rows == even.rows  # equal speeds: even slabs
    lay = SlabLayout(5, 67, 120, 536, 960, 2, (1.0, 0.55))
    assert lay.rows == [(0, 43), (43, 67)]  # 67 x 1/1.55 = 43.2
    assert lay.pixel_rows() == [(0, 344), (344, 536)]
    # a slow rank still holds one latent row (its neighbours' conv halos come from it)
    assert SlabLayout(1, 3, 4, 24, 32, 3, (1.0, 0.01, 1.0)).rows == [(0, 1), (1, 2), (2, 3)]


def test_halo_slabs_follow_speed():
    assert slab_ranges((21, 67, 120), 1, 2, (2.0, 2.0)) == slab_ranges((21, 67, 120), 1, 2)
    assert slab_ranges((21, 67, 120), 1, 2, (1.0, 0.5)) == [(0, 21, 0, 45), (0, 21, 45, 67)]
    # a 2 x 2 rank grid: time blocks by each row's summed speed, rows inside each block by speed
    r = slab_ranges((20, 60, 8), 2, 2, (1.0, 1.0, 0.5, 0.5))
    assert [(t1 - t0) for t0, t1, _, _ in r[::2]] == [13, 7] and r[0][2:] == (0, 30)
    hp = plan_halo((21, 67, 120), METHODS, 2, speeds=(1.0, 0.5))
    assert hp.slabs.rank_rows.tolist() == [21 * 45 * 120, 21 * 22 * 120]
    assert plan_halo((21, 67, 120), METHODS, 2, speeds=(1.0, 1.0)) is plan_halo((21, 67, 120), METHODS, 2)


# -- planners -----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=0, max_size=60), st.integers(1, 6), st.floats(0.1, 3))
def test_lpt_of_equal_speeds_is_the_plain_lpt(counts, p, s):
    assert lpt_shares(counts, Shares((s,) * p)) == lpt_assign(counts, p)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=80), speeds)
def test_lpt_shares_balances_modelled_time(counts, sp):
    """LPT on ranks of unequal speed: no rank's tokens / speed exceeds the ideal by more than one window on
    the slowest rank (the list-scheduling bound), and the packing never makes it worse."""
    shares = Shares(tuple(sp))
    ideal = sum(counts) / sum(sp)
    bound = ideal + max(counts) / min(sp) + 1e-9
    for bins in (lpt_shares(counts, shares), packed_shares(counts, shares)):
        assert sorted(i for b in bins for i in b) == list(range(len(counts)))
        times = [sum(counts[i] for i in b) / s for b, s in zip(bins, sp)]
        assert max(times) <= bound
    t_lpt = max(sum(counts[i] for i in b) / s for b, s in zip(lpt_shares(counts, shares), sp))
    t_pack = max(sum(counts[i] for i in b) / s for b, s in zip(packed_shares(counts, shares), sp))
    assert t_pack <= t_lpt + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 400), min_size=1, max_size=60), speeds, st.data())
def test_lpt_shares_keeps_every_rank_under_its_cap_when_a_window_fits(counts, sp, data):
    """A cap no rank's windows can break: with room for the largest window on every rank past its share,
    LPT places every window under the caps."""
    p, n, big = len(sp), sum(counts), max(counts)
    caps = [data.draw(st.integers(big, n + big)) for _ in range(p)]
    if sum(caps) < n + p * big:  # room enough that a greedy fit exists
        caps[0] += n + p * big - sum(caps)
    bins = lpt_shares(counts, Shares(tuple(sp), tuple(caps)))
    assert all(sum(counts[i] for i in b) <= c for b, c in zip(bins, caps))


@pytest.mark.parametrize("planner", ["lpt", "locality"])
def test_equal_capacities_give_the_even_plans(planner):
    lays = [window_layout((21, 45, 80), m) for m in METHODS]
    plain = plan_layouts(lays, 3, planner)
    assert plan_layouts(lays, 3, planner, Shares((0.8,) * 3)) is plain  # equal speeds: the same cached plans
    roomy = Shares((1.0,) * 3, (10**6,) * 3)  # caps that do not bind: still the even plans
    assert plan_layouts(lays, 3, planner, roomy) is plain
    sch = plan_schedule((21, 45, 80), METHODS, 3, planner, shares=Shares((2.0,) * 3))
    assert [p.rank_windows for p in sch.plans.values()] == [p.rank_windows for p in plain] and sch.shares is None


@pytest.mark.parametrize("planner", ["lpt", "locality"])
@pytest.mark.parametrize("sp", [(1.0, 0.55), (1.0, 1.0, 0.3, 0.3), (0.5, 1.0, 2.0)])
def test_planners_give_tokens_in_proportion_to_speed(planner, sp):
    grid = (21, 67, 120)  # 1080p, 81 frames
    lays = [window_layout(grid, m) for m in METHODS]
    shares = Shares(sp)
    n = lays[0].num_tokens
    for plan in plan_layouts(lays, len(sp), planner, shares):
        times = np.array(shares.times(plan.rank_tokens))
        ideal = n / sum(sp)
        assert times.max() <= 1.04 * ideal + max(lays[0].token_counts) / min(sp)
        if planner == "locality":  # the locality planner's balance cap: 1.03 x each rank's target
            assert all(t <= 1.03 * g + 1 for t, g in zip(plan.rank_tokens, shares.targets(n)))


@pytest.mark.parametrize("planner", ["lpt", "locality"])
def test_token_caps_hold_and_move_work_to_the_ranks_with_room(planner):
    grid = (21, 67, 120)
    lays = [window_layout(grid, m) for m in METHODS]
    n = lays[0].num_tokens
    shares = Shares((1.0, 1.0), (n, 60_000))  # equal speeds, rank 1 holds at most 60k tokens
    for plan in plan_layouts(lays, 2, planner, shares):
        assert plan.rank_tokens[1] <= 60_000 and plan.rank_tokens.sum() == n
    assert shares.targets(n) == (n - 60_000, 60_000)
    with pytest.raises(ValueError, match="holds 100,000 tokens in all.*fewer than the 168,840") as e:
        plan_layouts(lays, 2, planner, Shares((1.0, 1.0), (50_000, 50_000)))
    assert "\n" not in str(e.value)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=2, max_size=5), st.integers(1, 10**6))
def test_targets_fill_caps_in_proportion_to_speed(caps, total):
    sp = tuple(float(1 + i % 3) for i in range(len(caps)))
    shares = Shares(sp, tuple(caps))
    if sum(caps) < total:
        with pytest.raises(ValueError, match="fewer than"):
            shares.targets(total)
        return
    t = shares.targets(total)
    assert sum(t) == pytest.approx(total) and all(x <= c + 1e-6 for x, c in zip(t, caps))
    free = [x / s for x, c, s in zip(t, caps, sp) if x < c - 1e-6]  # uncapped ranks share one modelled time
    assert max(free, default=0) - min(free, default=0) <= 1e-6 * max(1, max(free, default=0))


def test_locality_with_shares_is_deterministic():
    lays = [window_layout((21, 45, 80), m) for m in METHODS]
    shares = Shares((1.0, 0.6, 0.6))
    assert locality_assign(lays, 3, shares) == locality_assign(lays, 3, shares)


# -- ditsp plan --------------------------------------------------------------------------------------------


def _plan_json(capsys, *args):
    import json

    from ditsp.cli import main

    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_for_a_32_and_a_24_gib_card(capsys):
    """The issue's case: 1080p, 81 frames, SP 2 on 32 + 24 GiB: unequal tokens and memory, each within its
    rank's memory, a shorter modelled forward than the equal split's."""
    out = _plan_json(capsys, "--resolution", "1920x1080", "--frames", "81", "--sp", "2", "--rank-memory", "32,24")
    assert out["capacities"] == {"speed": [1.0, 0.75], "memory_gib": [32.0, 24.0]}
    r0, r1 = out["per_rank"]["ranks"]
    assert r0["tokens"] > r1["tokens"] and r0["memory"] > r1["memory"]
    assert r0["fits"] and r1["fits"] and r0["memory"] <= 32 * GiB and r1["memory"] <= 24 * GiB
    assert r0["tokens"] / r1["tokens"] == pytest.approx(1 / 0.75, rel=0.02)  # in proportion to speed
    assert out["per_rank"]["modelled_time"] < out["equal_split"]["modelled_time"]
    assert out["layouts"]["regular"]["rank_tokens"][0] > out["layouts"]["regular"]["rank_tokens"][1]


def test_plan_moves_tokens_off_a_rank_whose_memory_is_short(capsys):
    """Equal speeds, but rank 1's 10 GiB holds fewer tokens than an equal share: it gets what it holds."""
    out = _plan_json(capsys, "--resolution", "1920x1080", "--frames", "81", "--sp", "2", "--rank-memory", "32,10",
                     "--rank-speed", "1,1", "--planner", "locality")
    eq, pr = out["equal_split"], out["per_rank"]
    assert eq["fits"] is False and eq["ranks"][1]["fits"] is False
    assert pr["fits"] is True and pr["ranks"][1]["memory"] <= 10 * GiB < eq["ranks"][1]["memory"]
    from ditsp.cli import main

    assert main(["plan", "--resolution", "1920x1080", "--frames", "81", "--sp", "2", "--rank-memory", "32,10",
                 "--rank-speed", "1,1"]) == 0
    text_out = capsys.readouterr().out
    assert "every rank fits (equal split:" in text_out and "does not fit)" in text_out


def test_plan_without_capacities_is_unchanged(capsys):
    out = _plan_json(capsys, "--resolution", "1920x1080", "--frames", "81", "--sp", "2")
    assert "per_rank" not in out and "capacities" not in out
    same = _plan_json(capsys, "--resolution", "1920x1080", "--frames", "81", "--sp", "2", "--rank-memory", "24,24")
    assert same["layouts"] == out["layouts"] and same["per_rank"]["modelled_time"] == same["equal_split"]["modelled_time"]
