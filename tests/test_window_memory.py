"""The per-rank memory estimate of `ditsp plan` against measured peaks (small configs), and the
rows feed (each rank only its shard of the latent, in and out) against one device, bit for bit."""

from dataclasses import replace

import pytest
import torch

from ditsp.distributed.launcher import LocalCluster, RankContext
from ditsp.models.seedvr2.job.forward import RunSpec, rank_forward
from ditsp.models.seedvr2.nadit.config import get_config
from ditsp.models.seedvr2.job.plan_report import memory_estimate, plan_request

GRID = (5, 20, 36)
SPEC = RunSpec("small", GRID, 1, layers=2, warmup=1, repeats=1, exact_memory=True, deterministic=True)
TOLERANCE = 0.15


def _estimate(sp: int, feed: str) -> int:
    cfg = get_config("small", 2)
    return memory_estimate(plan_request(GRID, cfg, sp), cfg, dtype_bytes=4, feed=feed)["peak_added"]


@pytest.fixture(scope="module")
def measured():
    """Peaks and outputs: one device, and SP=2 with both feeds (a fresh cluster: the exact-peak
    allocator setting stays in its processes)."""
    out = {}
    torch.set_num_threads(1)
    one = rank_forward(RankContext(0, 1, None, torch.device("cpu")), replace(SPEC, exact_memory=False))
    out["single"] = one
    with LocalCluster(2, timeout_s=300, threads=1) as cluster:
        for feed in ("canonical", "rows"):
            out[feed] = cluster.run(rank_forward, replace(SPEC, sp=2, feed=feed), timeout_s=300)
    return out


@pytest.mark.parametrize("feed", ["canonical", "rows"])
def test_estimate_within_tolerance_of_measured_peak(measured, feed):
    peak = max(r["peak_bytes"] for r in measured[feed])
    est = _estimate(2, feed)
    assert abs(est - peak) / peak <= TOLERANCE, (feed, est, peak)


@pytest.mark.bitwise
@pytest.mark.parametrize("feed", ["canonical", "rows"])
def test_rows_feed_is_one_device_bits(measured, feed):
    assert torch.equal(measured[feed][0]["output"], measured["single"]["output"])


def test_rows_feed_moves_no_whole_output(measured):
    """The rows feed hands the output back as shards: no output all-gather inside the forward."""
    assert "output_gather" in measured["canonical"][0]["collectives"]
    assert "output_gather" not in measured["rows"][0]["collectives"]
    assert "result_gather" not in measured["rows"][0]["collectives"]  # after the measured region


def test_estimate_parts_and_feed_checked():
    cfg = get_config("seedvr2-3b")
    m = memory_estimate(plan_request((21, 45, 80), cfg, 4), cfg)
    assert m["peak_added"] == max(m["mlp"], m["attention"], m["exchange"], m["output"])
    assert m["total"] == m["weights"] + m["input"] + m["peak_added"]
    assert m["weights"] == cfg.param_count() * 2
    with pytest.raises(ValueError):
        memory_estimate(plan_request((21, 45, 80), cfg, 4), cfg, feed="whole")
