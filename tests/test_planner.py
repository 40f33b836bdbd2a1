"""LPT planner, plan cache and layout-change accounting (pure, no ranks)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ditsp.windows.geometry import window_layout
from ditsp.windows.plan import PLAN_CACHE, transition
from ditsp.windows.planners import plan_cache_key, plan_layout, plan_layouts
from ditsp.windows.planners.lpt import lpt_assign
from ditsp.windows.schedule import plan_schedule


def test_lpt_tie_breaking():
    # sorted by (-tokens, id): 9(id1), 5(id0), 5(id3), 3(id2), 1(id4)
    # 9 -> r0; 5 -> r1; 5 -> r2; 3 -> r1 (5 < 5? tie on load 5: r1 < r2); 1 -> r2
    assert lpt_assign([5, 9, 3, 5, 1], 3) == ((1,), (0, 2), (3, 4))
    # equal loads pick the lowest rank; ranks may stay empty
    assert lpt_assign([4, 4], 4) == ((0,), (1,), (), ())
    assert lpt_assign([], 2) == ((), ())


def test_plan_values_and_ids():
    lay = window_layout((5, 20, 36), "regular")
    plan = plan_layout(lay, 3)
    assert plan.rank_tokens.sum() == lay.num_tokens
    assert all(list(ws) == sorted(ws) for ws in plan.rank_windows)
    ids = np.concatenate([plan.rank_token_ids(r) for r in range(3)])
    assert np.array_equal(np.sort(ids), np.arange(lay.num_tokens))
    for r in range(3):
        want = np.concatenate([lay.window_token_ids(i) for i in plan.rank_windows[r]])
        assert np.array_equal(plan.rank_token_ids(r), want)
    assert plan.imbalance == pytest.approx(plan.rank_tokens.max() / plan.rank_tokens.mean())


def test_deterministic_and_cached():
    lay = window_layout((21, 45, 80), "shifted")
    a = plan_layout(lay, 4)
    assert plan_layout(lay, 4) is a
    PLAN_CACHE.clear()
    b = plan_layout(lay, 4)
    assert b is not a and b.rank_windows == a.rank_windows


def test_cache_key_separates_world_size_and_planner():
    reg = window_layout((21, 45, 80), "regular")
    sh = window_layout((21, 45, 80), "shifted")
    keys = {plan_cache_key([reg], 4, "lpt"), plan_cache_key([reg], 8, "lpt"), plan_cache_key([sh], 4, "lpt"),
            plan_cache_key([reg, sh], 4, "lpt")}
    assert len(keys) == 4
    grid, fps, version, world, planner, pver = plan_cache_key([reg], 4, "lpt")
    assert (grid, world, planner) == ((21, 45, 80), 4, "lpt") and fps == (reg.fingerprint,)
    assert plan_layout(reg, 4).world_size == 4 and plan_layout(reg, 8).world_size == 8
    with pytest.raises(ValueError, match="unknown planner"):
        plan_layout(reg, 4, "magic")
    with pytest.raises(ValueError, match="one grid"):
        plan_layouts([reg, window_layout((21, 45, 81), "regular")], 2)
    with pytest.raises(ValueError, match="world_size"):
        plan_layout(reg, 0)


def test_4k_sp8_acceptance():
    s = plan_schedule((21, 135, 240), ["regular", "shifted"] * 16, 8)
    assert len(s.plans["720pwin_by_size_bysize"].layout) == 324
    assert len(s.plans["720pswin_by_size_bysize"].layout) == 400
    assert all(p.imbalance <= 1.01 for p in s.plans.values())
    assert len(s.transitions()) == 31


def test_schedule_transitions_follow_the_schedule():
    s = plan_schedule((5, 20, 36), ["regular", "regular", "shifted", "shifted", "regular"], 2)
    assert [layer for layer, _ in s.transitions()] == [2, 4]
    assert len(plan_schedule((5, 20, 36), ["shifted"] * 3, 2).transitions()) == 0


@settings(max_examples=60, deadline=None)
@given(grid=st.tuples(st.integers(1, 12), st.integers(1, 40), st.integers(1, 40)), world=st.integers(1, 7))
def test_count_matrix_and_indices(grid, world):
    s = plan_schedule(grid, ["regular", "shifted"], world)
    src, dst = s.plans.values()
    t = transition(src, dst)
    c = t.counts
    assert c.sum() == src.layout.num_tokens
    assert np.array_equal(c.sum(1), src.rank_tokens) and np.array_equal(c.sum(0), dst.rank_tokens)
    assert t.tokens_moved == int(t.rank_send.sum()) == int(t.rank_recv.sum())
    # simulate the exchange with canonical ids as payload: every token lands once, in dst order
    sent = [src.rank_token_ids(r)[t.send_index(r)] for r in range(world)]
    for d in range(world):
        received = np.concatenate(
            [sent[r][int(c[r, :d].sum()) : int(c[r, : d + 1].sum())] for r in range(world)]
        )
        assert np.array_equal(received[t.recv_order(d)], dst.rank_token_ids(d))
    assert t.exchange_required == (t.tokens_moved > 0)
