"""Issue #13 item 1: the planner refuses requests too large to plan (estimated before anything is
allocated), and thin grids that used to divide by zero plan."""

import math

import pytest

from ditsp.cli import main
from ditsp.windows.geometry import make_windows, window_counts, window_layout, window_size
from ditsp.windows.schedule import (ENV_MAX_GIB, GiB, PlanTooLargeError, current_limits, estimate_plan, plan_limits,
                                    plan_schedule)

ALT = ["regular", "shifted"] * 4


def test_thin_grid_plans_instead_of_dividing_by_zero():
    # 1 x 14400 rounded the 720p-normalised height to 0 tokens: ZeroDivisionError before
    assert window_size((1, 1, 14400)) == (1, 1, 2400)
    s = plan_schedule((1, 1, 14400), ALT, 2)
    for plan in s.plans.values():
        assert int(plan.rank_tokens.sum()) == 14400


def test_cli_plans_thin_grid(capsys):
    assert main(["plan", "--grid", "1,1,14400", "--sp", "2", "--json"]) == 0
    assert '"tokens": 14400' in capsys.readouterr().out


@pytest.mark.parametrize("grid", [(21, 45, 80), (5, 20, 36), (1, 1, 14400), (33, 7, 13), (2, 3, 100), (17, 91, 5)])
@pytest.mark.parametrize("method", ["regular", "shifted"])
def test_window_counts_match_the_layout(grid, method):
    assert math.prod(window_counts(grid, method)) == len(make_windows(grid, method))


@pytest.mark.parametrize("grid,sp", [((21, 6249, 6249), 2), ((10000, 10000, 10000), 2), ((21, 45, 80), 10**8)])
def test_absurd_requests_refused_before_allocating(grid, sp):
    # each of these reached 5-19 GiB before; the estimate is arithmetic, so the refusal is instant
    with pytest.raises(PlanTooLargeError, match=r"GiB.*the limit is 4\.00 GiB"):
        plan_schedule(grid, ALT, sp)
    assert issubclass(PlanTooLargeError, ValueError)


def test_estimate_is_close_to_normal_requests():
    e = estimate_plan((21, 135, 240), ALT, 8)
    assert e.tokens == 680_400 and e.windows == 724 and e.layouts == 2 and e.transitions == 2
    assert 0.02 * GiB < e.bytes < 0.5 * GiB and e.seconds < 10
    assert estimate_plan((21, 45, 80), ALT, 64, "locality").bytes > estimate_plan((21, 45, 80), ALT, 64).bytes


def test_limit_is_overridable_by_argument_and_environment(monkeypatch):
    grid = (9, 45, 80)
    with pytest.raises(PlanTooLargeError, match="limit is 0.00 GiB"):
        plan_schedule(grid, ALT, 2, max_bytes=1000)
    with pytest.raises(PlanTooLargeError, match="limit is 0.0 s"):
        plan_schedule(grid, ALT, 2, max_seconds=1e-9)
    with plan_limits(max_gib=1e-6):
        assert current_limits()[0] == int(1e-6 * GiB)
        with pytest.raises(PlanTooLargeError):
            plan_schedule(grid, ALT, 3)
    assert ENV_MAX_GIB not in __import__("os").environ  # restored
    assert plan_schedule(grid, ALT, 3).world_size == 3
    monkeypatch.setenv(ENV_MAX_GIB, "nope")
    with pytest.raises(ValueError, match=ENV_MAX_GIB):
        plan_schedule(grid, ALT, 2)


@pytest.mark.parametrize("args", [
    ["--resolution", "99999x99999", "--frames", "81", "--sp", "2"],
    ["--grid", "10000,10000,10000", "--sp", "2"],
    ["--grid", "21,45,80", "--sp", "100000000"],
    ["--grid", "21,45,80", "--sp", "2", "--max-plan-memory", "0.000001"],
    ["--grid", "21,45,80", "--sp", "2", "--max-plan-seconds", "0.000001"],
])
def test_cli_refuses_with_the_estimate_and_the_limit(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "request too large to plan" in err and "the limit is" in err and "needs about" in err


def test_cli_raised_limit_lets_a_large_degree_plan(capsys):
    # 4096 ranks' count matrices in the JSON report exceed a 0.5 GiB limit, and fit a raised one
    with pytest.raises(SystemExit):
        main(["plan", "--grid", "5,20,36", "--sp", "4096", "--max-plan-memory", "0.5", "--json", "--compact"])
    capsys.readouterr()
    assert main(["plan", "--grid", "5,20,36", "--sp", "1024", "--max-plan-memory", "8", "--json", "--compact"]) == 0
    assert '"world_size": 1024' in capsys.readouterr().out


def test_more_ranks_than_windows_is_still_valid():
    lay = window_layout((5, 20, 36), "regular")
    s = plan_schedule((5, 20, 36), ALT, 3 * len(lay))
    assert sum(1 for w in s.plans[lay.method].rank_windows if not w) == 2 * len(lay)
