"""`ditsp bench rl-spot`'s summary (ditsp.bench.rl_spot) on made-up run reports: the target, steps, modelled
time and cost to it, a setting that never reaches it, and the exactly-once column."""

from __future__ import annotations

import pytest

from ditsp.bench.rl_spot import format_md, summarize


def _report(evals, modelled, spot_s=0.0, wall=10.0, requests=None, splits=None, premise=None):
    rep = {"eval": [{"step": i, "reward": r} for i, r in enumerate(evals)], "eval_before": evals[0],
           "eval_after": evals[-1], "modelled_s": {str(i): s for i, s in enumerate(modelled)}, "wall_s": wall,
           "cost": {"spot_fraction": 0.3, "spot_s": spot_s}, "cost_in_run": {"spot_s": spot_s},
           "splits": splits or {}, "checkpoint_consistent": True, "premise": premise}
    if requests is not None:
        rep["spot"] = {"requests": requests, "wasted_cpu_s": 0.5, "events": [{"event": "leave"}]}
    return rep


def test_the_summary_by_hand():
    ok = {"requests": 4, "finished": 4, "units": 20, "units_kept": 20, "returned_units": 3}
    lost = {**ok, "finished": 3}
    r = {"steps": 3, "candidates": 8, "trace": "0 join spot0", "load": 1.0, "date": "today", "reports": {
        "none": _report([0.0, 0.1, 0.2, 0.3], [1.0, 1.0, 1.0]),
        "stale": _report([0.0, 0.2, 0.35, 0.4], [0.5, 0.5, 0.5], spot_s=20.0, requests=ok, splits={1: [6, 4]},
                         premise={"mean": 0.8, "median": 0.9, "measured": 4}),
        "preempted": _report([0.0, 0.0, 0.1, 0.2], [0.5, 0.5, 0.5], spot_s=10.0, requests=lost)}}
    rows = {x["setting"]: x for x in summarize(r)}
    assert rows["none"]["target"] == 0.3 and rows["none"]["steps_to_target"] == 3
    assert rows["none"]["time_to_target_s"] == 3.0 and rows["none"]["cost_to_target"] == 3.0
    # two steps to 0.35 >= 0.3, 1 s of modelled time; 2 spot workers held on average at 0.3x
    assert rows["stale"]["steps_to_target"] == 2 and rows["stale"]["time_to_target_s"] == 1.0
    assert rows["stale"]["cost_to_target"] == pytest.approx(1.0 * (1 + 0.3 * 2.0))
    assert rows["stale"]["candidates"] == 5.0 and rows["stale"]["exactly_once"]
    assert rows["preempted"]["steps_to_target"] is None and rows["preempted"]["exactly_once"] is False
    text = format_md(r, list(rows.values()), "rl-spot.png")
    assert "| preempted | - | not reached | not reached |" in text
    assert "| NO |" in text and "yes (4/4, 20/20 units)" in text
    assert "mean 0.800, median 0.900 over 4" in text and "![held-out reward" in text
