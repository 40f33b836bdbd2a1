"""`ditsp bench capacities`: the modelled tables (the capacity split fits where the equal one does not and
balances modelled time) and, at the smallest size, the measured run on two ranks made unequal."""

import json
import os

import pytest

from ditsp.bench.capacities import modelled, rank_measure
from ditsp.cli import main

pytestmark = pytest.mark.timeout(600)


def test_modelled_capacity_split_fits_and_balances():
    """4K on 80 + 80 + 24 + 24 GiB with speeds from memory: the equal split does not fit the 24 GiB ranks, the
    capacity split does and takes under half the equal split's modelled DiT step."""
    out = modelled("4K", (80, 80, 24, 24), (1.0, 1.0, 0.3, 0.3))
    eq, cap = out["equal"], out["capacity"]
    assert not eq["fits"] and [r["fits"] for r in eq["ranks"]] == [True, True, False, False]
    assert cap["fits"] and cap["dit_step"] < 0.5 * eq["dit_step"]
    assert sum(r["tokens"] for r in cap["ranks"]) >= 21 * 135 * 240 // 2  # the most over layouts, per rank
    assert cap["ranks"][0]["tokens"] > 3 * cap["ranks"][2]["tokens"]


def test_modelled_tables_are_written(tmp_path):
    assert main(["bench", "capacities", "--no-measure", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "capacities.md").read_text()
    assert md.startswith("# Ranks of unequal capacity") and "Machine: " in md and "Date: " in md and "What: " in md
    assert "| 1080p, 81 frames | 32 + 24 GiB | from memory (default) (1:0.75) | capacity |" in md
    data = json.loads((tmp_path / "capacities.json").read_text())
    assert len(data["modelled"]) == 8 and data["measured"] is None


def test_measured_run_on_two_unequal_ranks(clusters):
    """The smallest measured run: both splits time a forward, the capacity split follows the probed speeds,
    and each rank's core affinity is its own again afterwards (the spinner ended with it)."""
    before = clusters(2).run(_affinity)
    ranks = clusters(2).run(rank_measure, "tiny", (3, 10, 18), 1)
    assert clusters(2).run(_affinity) == before
    speed = ranks[0]["speed"]
    assert speed == ranks[1]["speed"] and max(speed) == 1.0 and min(speed) > 0
    for name in ("equal", "capacity"):
        per_layer = [sum(r["tokens"][name][i] for r in ranks) for i in range(len(ranks[0]["tokens"][name]))]
        assert set(per_layer) == {3 * 10 * 18}
        assert all(r["wall"][name] > 0 and r["cpu"][name] > 0 for r in ranks)
    if ranks[0]["pinned"] and speed[1] < speed[0]:  # the slower rank holds fewer tokens under the capacity split
        assert sum(ranks[1]["tokens"]["capacity"]) <= sum(ranks[1]["tokens"]["equal"])


def _affinity(ctx):
    return sorted(os.sched_getaffinity(0))
