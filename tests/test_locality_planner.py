"""The locality-aware planner: balance, exact coverage, determinism, 3B targets, exact optimum."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ditsp.cli import main
from ditsp.windows.planners import locality
from ditsp.windows.planners.lpt import packed_assign
from ditsp.windows.geometry import window_layout
from ditsp.windows.plan import PLAN_CACHE, transition
from ditsp.windows.planners import plan_cache_key, plan_layouts, planner_names
from ditsp.windows.schedule import plan_schedule

ALTERNATING = ["regular", "shifted"] * 16
BALANCE = 1.03 + 1e-12


def layouts(grid):
    return [window_layout(grid, "regular"), window_layout(grid, "shifted")]


def best_packing(layout, world_size):
    """max/mean of the balance-only packing search (LPT + moves/swaps): never worse than LPT."""
    counts = layout.token_counts
    bins = packed_assign(counts, world_size)
    return max(int(counts[b].sum()) if b else 0 for b in bins) / (layout.num_tokens / world_size)


def check_plans(plans, world_size):
    """Every window exactly once; balance within 1.03, or the best packing where 1.03 is out of reach."""
    lpt = plan_layouts([pl.layout for pl in plans], world_size, "lpt")
    for pl, ref in zip(plans, lpt):
        assert len(pl.rank_windows) == world_size
        flat = sorted(i for ws in pl.rank_windows for i in ws)
        assert flat == list(range(len(pl.layout)))
        assert int(pl.rank_tokens.sum()) == pl.layout.num_tokens
        limit = max(BALANCE, best_packing(pl.layout, world_size) + 1e-12)
        assert pl.imbalance <= limit, (pl.layout.grid, world_size, pl.layout.name)
        assert pl.imbalance <= max(BALANCE, ref.imbalance + 1e-12)


def moved(grid, p, planner="locality"):
    sched = plan_schedule(grid, ALTERNATING, p, planner)
    return sched, sched.transition_between("regular", "shifted")


# ------------------------------------------------------------------ properties


@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 13),
    h=st.integers(1, 48),
    w=st.integers(1, 90),
    p=st.integers(1, 9),
)
def test_property_balance_and_coverage(t, h, w, p):
    plans = plan_layouts(layouts((t, h, w)), p, "locality")
    check_plans(plans, p)


@pytest.mark.parametrize("grid", [(21, 45, 80), (21, 67, 120), (21, 90, 160), (13, 45, 80), (31, 67, 120)])
@pytest.mark.parametrize("p", [3, 5, 6, 7])
def test_balance_on_real_grids_odd_world_sizes(grid, p):
    check_plans(plan_layouts(layouts(grid), p, "locality"), p)


def test_103_can_be_infeasible_and_then_matches_the_best_packing():
    # 720p regular at SP=6: window sizes are 54/52/27/26 x 45 tokens; no 6-way split stays
    # within 1.03 (checked exactly with an ILP), so the cap is the packing search's 1.0357
    (plan, _) = plan_layouts(layouts((21, 45, 80)), 6, "locality")
    assert plan.imbalance == pytest.approx(best_packing(plan.layout, 6)) == pytest.approx(1.0357142857)


@pytest.mark.parametrize("grid", [(21, 45, 80), (21, 67, 120), (21, 90, 160), (21, 135, 240)])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_balance_within_103_at_3b_resolutions(grid, p):
    plans = plan_layouts(layouts(grid), p, "locality")
    check_plans(plans, p)
    for pl in plans:
        assert pl.imbalance <= BALANCE


@pytest.mark.parametrize("grid,p,target", [((21, 135, 240), 8, 0.25), ((21, 135, 240), 4, 0.15), ((21, 67, 120), 4, 0.25)])
def test_3b_targets(grid, p, target):
    sched, t = moved(grid, p)
    assert t.fraction_moved <= target
    for pl in sched.plans.values():
        assert pl.imbalance <= BALANCE
    _, ref = moved(grid, p, "lpt")
    # both objectives beat LPT by a wide margin: the per-rank peak and the total
    assert (t.rank_send + t.rank_recv).max() < 0.5 * (ref.rank_send + ref.rank_recv).max()
    assert t.tokens_moved < 0.4 * ref.tokens_moved
    # the reverse transition moves the same tokens
    assert sched.transition_between("shifted", "regular").tokens_moved == t.tokens_moved


def test_4k_plans_cold():
    from ditsp.windows.geometry import _layout

    PLAN_CACHE.clear()
    _layout.cache_clear()
    sched = plan_schedule((21, 135, 240), ALTERNATING, 8, "locality")  # how fast: ditsp bench planners
    assert sched.world_size == 8


# ------------------------------------------------------------------ determinism and edge cases


def test_deterministic():
    lays = layouts((21, 67, 120))
    a = locality.locality_assign(lays, 6)
    b = locality.locality_assign(lays, 6)
    assert a == b
    PLAN_CACHE.clear()
    first = [pl.rank_windows for pl in plan_layouts(lays, 6, "locality")]
    PLAN_CACHE.clear()
    second = [pl.rank_windows for pl in plan_layouts(lays, 6, "locality")]
    assert first == second


def test_deterministic_across_processes():
    code = (
        "from ditsp.windows.geometry import window_layout as w;"
        "from ditsp.windows.planners.locality import locality_assign as f;"
        "print(hash(f([w((21,45,80),'regular'), w((21,45,80),'shifted')], 5)))"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(seed)}).stdout
        for seed in (1, 2)
    }
    assert len(outs) == 1


def test_more_ranks_than_windows():
    grid = (5, 20, 36)  # 12 regular and 12 shifted windows
    plans = plan_layouts(layouts(grid), 16, "locality")
    check_plans(plans, 16)
    assert sum(1 for ws in plans[0].rank_windows if not ws) >= 4
    t = transition(plans[0], plans[1])
    assert t.counts.sum() == 3600


def test_world_size_one_keeps_everything_local():
    sched, t = moved((21, 45, 80), 1)
    assert t.tokens_moved == 0 and not t.exchange_required


@pytest.mark.parametrize("p", [1, 3, 8])
def test_single_layout_schedule(p):
    sched = plan_schedule((21, 67, 120), ["regular"] * 4, p, "locality")
    (plan,) = sched.plans.values()
    check_plans([plan], p)
    assert plan.imbalance <= BALANCE and sched.transitions() == []


def test_one_layout_directly():
    (rw,) = locality.locality_assign([window_layout((21, 90, 160), "shifted")], 7)
    assert sorted(i for ws in rw for i in ws) == list(range(196))


def test_cache_key_includes_planner_name_and_version():
    lays = layouts((21, 45, 80))
    k_loc = plan_cache_key(lays, 4, "locality")
    k_lpt = plan_cache_key(lays, 4, "lpt")
    assert k_loc != k_lpt
    assert k_loc[-2:] == ("locality", locality.VERSION)
    a = plan_layouts(lays, 4, "locality")
    b = plan_layouts(lays, 4, "lpt")
    assert a[0].planner == "locality" and b[0].planner == "lpt"
    assert a[0].rank_windows != b[0].rank_windows
    assert plan_layouts(lays, 4, "locality") is a  # cached


def test_registered_explicitly_on_plain_planner_import():
    code = "import ditsp.windows.planners as p; assert p.planner_names() == ['locality', 'lpt'], p.planner_names()"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert "locality" in planner_names()


def test_cli_planner_all(capsys):
    import json

    assert main(["plan", "--grid", "21,67,120", "--sp", "4", "--planner", "all", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"lpt", "locality"} <= set(out)
    loc = out["locality"]["transition"]["regular->shifted"]["fraction_moved"]
    lpt = out["lpt"]["transition"]["regular->shifted"]["fraction_moved"]
    assert loc <= 0.25 < lpt


# ------------------------------------------------------------------ exact optimum (brute force)


def _brute_force_sp2(grid):
    """Exact minimum tokens moved at SP=2 under the locality caps, by enumeration (pure numpy)."""
    reg, sh = layouts(grid)
    caps = locality.layout_caps([reg, sh], 2)
    ia, ib, w = locality.overlap_pairs(reg, sh)
    ov = np.zeros((len(reg), len(sh)), dtype=np.int64)
    ov[ia, ib] = w
    nr, ns = len(reg), len(sh)
    # regular window 0 on rank 0 (rank symmetry); bit i of a mask: window i on rank 1
    rmask = np.arange(1 << (nr - 1), dtype=np.int64) << 1
    rbits = (rmask[:, None] >> np.arange(nr)) & 1
    rload1 = rbits @ reg.token_counts
    rmask, rbits = rmask[(rload1 <= caps[0]) & (reg.num_tokens - rload1 <= caps[0])], None
    rbits = (rmask[:, None] >> np.arange(nr)) & 1
    smask = np.arange(1 << ns, dtype=np.int64)
    sbits = (smask[:, None] >> np.arange(ns)) & 1
    sload1 = sbits @ sh.token_counts
    sbits = sbits[(sload1 <= caps[1]) & (sh.num_tokens - sload1 <= caps[1])]
    on1 = rbits @ ov  # per regular mask, per shifted window: its tokens held by rank 1
    on0 = ov.sum(axis=0)[None, :] - on1
    # shifted window on rank 1 moves its rank-0 tokens, on rank 0 its rank-1 tokens
    cost = on1.sum(axis=1)[:, None] + (on0 - on1) @ sbits.T
    return int(cost.min())


@pytest.mark.parametrize("grid", [(5, 20, 36), (3, 16, 30)])
def test_sp2_matches_exact_optimum_on_tiny_grids(grid):
    optimum = _brute_force_sp2(grid)
    _, t = moved(grid, 2)
    assert optimum <= t.tokens_moved <= optimum * 1.05 + 1
