"""The seam measure (pipeline/seams.py): each window join's frame-to-frame change against the median inside windows."""

from __future__ import annotations

import pytest
import torch

from ditsp.models.seedvr2.pipeline.seams import SeamMeter, format_seams, seam_measure, seam_report
from ditsp.models.seedvr2.pipeline.windows import plan_windows


def ramp(frames: int) -> torch.Tensor:
    """A clip whose every frame is one level brighter than the one before (every step changes by 1)."""
    return torch.arange(frames, dtype=torch.float32).reshape(frames, 1, 1, 1).expand(frames, 4, 4, 3).clone()


def test_a_hard_cut_at_one_join_stands_out_and_the_other_does_not():
    plan = plan_windows(30, 9, 2)
    seams = plan.seams()
    assert len(seams) == len(plan) - 1 == 3 and all(0 < a < b <= 30 for a, b in seams)
    assert all(b <= c for (_, b), (c, _) in zip(seams, seams[1:]))  # apart: a step counts for one join
    t = ramp(30)
    a, b = seams[1]
    t[a:] += 50  # a jump into the second join's first frame: one step of 51 among its b - a steps
    m = seam_measure(t, seams)
    assert m["inside_median"] == pytest.approx(1)
    assert m["each"][0]["ratio"] == pytest.approx(1) and m["each"][2]["ratio"] == pytest.approx(1)
    assert m["each"][1]["change"] == pytest.approx((51 + (b - a - 1)) / (b - a))  # hand-computed
    assert m["each"][1]["frames"] == [a - 1, b - 1]
    steps = sum(b_ - a_ for a_, b_ in seams)
    assert m["change"] == pytest.approx((steps + 50) / steps) and m["ratio"] == pytest.approx(m["change"])


def test_the_median_inside_is_not_moved_by_one_fast_moment():
    t = ramp(30)
    t[20:] += 500  # a fast moment inside a window, far from the seam at frames 10-11
    m = seam_measure(t, [(11, 12)])
    assert m["inside_median"] == pytest.approx(1) and m["ratio"] == pytest.approx(1)


def test_the_meter_fed_in_chunks_equals_the_whole_clip():
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (23, 6, 5, 3), generator=g, dtype=torch.uint8)
    spans = plan_windows(23, 9, 4).seams()
    meter = SeamMeter(spans)
    for a, b in ((0, 1), (1, 7), (7, 7), (7, 23)):
        meter.add(frames[a:b])
    assert meter.report() == seam_measure(frames, spans)
    assert "window join(s)" in format_seams(meter.report()) and "per join" in format_seams(meter.report())
    many = seam_measure(ramp(60), plan_windows(60, 9, 4).seams())
    assert len(many["each"]) > 6 and "the most of" in format_seams(many)


def test_no_seam_no_report_and_undefined_ratios_are_none():
    assert SeamMeter([]).report() is None
    assert seam_report([1.0, 2.0], [(5, 7)]) is None  # the span lies past the clip
    still = seam_report([0.0, 0.0, 0.0, 3.0], [(4, 5)])  # nothing moves inside windows
    assert still["inside_median"] == 0 and still["ratio"] is None and still["each"][0]["ratio"] is None
    assert "n/a" in format_seams(still)
    with pytest.raises(ValueError, match="two frames"):
        seam_measure(torch.zeros(1, 2, 2, 3), [(1, 2)])
