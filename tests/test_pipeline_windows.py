"""Long-video windows: the plan, the blend weights and the streaming blender (property-based)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ditsp.models.seedvr2.pipeline.windows import (
    StreamingBlender,
    blend_windows,
    frame_weights,
    plan_windows,
    ramp_down,
)


@st.composite
def plans(draw):
    window = 4 * draw(st.integers(0, 12)) + 1
    overlap = draw(st.integers(0, window - 1))
    frames = draw(st.integers(1, 200))
    seed = draw(st.integers(0, 2**40))
    return plan_windows(frames, window, overlap, seed)


@settings(max_examples=300, deadline=None)
@given(plans())
def test_plan_covers_every_frame(plan):
    ws = plan.windows
    assert ws[0].start == 0 and ws[-1].stop == plan.frames
    for w in ws:
        assert 0 <= w.start < w.stop <= plan.frames
        assert w.length == min(plan.window, plan.frames)
    for a, b in zip(ws, ws[1:]):
        assert a.start < b.start and a.stop < b.stop
        assert a.stop - b.start >= plan.overlap  # at least the requested overlap, no gaps
    # the fewest windows that can keep the requested overlap
    if plan.frames > plan.window:
        step = plan.window - plan.overlap
        assert len(ws) == 1 + -(-(plan.frames - plan.window) // step)
    # deterministic, and seeds differ between windows
    again = plan_windows(plan.frames, plan.window, plan.overlap, ws[0].seed)
    assert again == plan
    assert len({w.seed for w in ws}) == len(ws)


@settings(max_examples=300, deadline=None)
@given(plans())
def test_weights_sum_to_one_and_never_switch_hard(plan):
    m = frame_weights(plan)
    assert torch.allclose(m.sum(0), torch.ones(plan.frames, dtype=torch.float64), atol=1e-12)
    for w in plan.windows:
        wt = plan.weights(w.index)
        assert (wt > 0).all() and (wt <= 1).all()
    # inside each overlap both windows contribute, so a frame is never a hard cut
    for a, b in zip(plan.windows, plan.windows[1:]):
        shared = range(b.start, a.stop)
        for f in shared:
            assert 0 < m[a.index, f] < 1 and 0 < m[b.index, f] < 1


@settings(max_examples=200, deadline=None)
@given(plans(), st.sampled_from([torch.float32, torch.uint8]))
def test_streaming_blender_emits_each_frame_once_in_order(plan, dtype):
    # Every window reports the global frame index, so the blend must give it back.
    clip = torch.arange(plan.frames, dtype=torch.float32).reshape(-1, 1, 1)
    if dtype == torch.uint8:
        clip = clip % 256
    b = StreamingBlender(plan)
    got = []
    for w in plan.windows:
        out = b.push(w.index, clip[w.start : w.stop].to(dtype))
        assert out.dtype == dtype
        got.append(out)
        # only the frames shared with the next window are held
        if w.index + 1 < len(plan):
            assert b.held_frames == w.stop - plan[w.index + 1].start
            assert b.emitted == plan[w.index + 1].start
    b.flush()
    assert b.held_frames == 0 and b.emitted == plan.frames
    out = torch.cat(got)
    assert out.shape[0] == plan.frames
    assert torch.allclose(out.float(), clip, atol=1e-3 if dtype.is_floating_point else 0)


def test_blend_mixes_overlaps_smoothly():
    plan = plan_windows(17, 9, 1)  # windows [0,9) [8,17): one shared frame -> 50/50
    assert [(w.start, w.stop) for w in plan] == [(0, 9), (8, 17)]
    a, b = torch.zeros(9, 1), torch.ones(9, 1)
    out = blend_windows(plan, [a, b])
    assert out[8].item() == pytest.approx(0.5) and out[:8].eq(0).all() and out[9:].eq(1).all()
    r = ramp_down(4)
    assert torch.allclose(r + r.flip(0), torch.ones(4, dtype=torch.float64))
    assert (r[:-1] > r[1:]).all()


def test_single_window_and_errors():
    plan = plan_windows(3, 21, 4, seed=9)
    assert len(plan) == 1 and plan[0].length == 3 and plan[0].seed == 9
    with pytest.raises(ValueError, match="4n\\+1"):
        plan_windows(10, 8, 2)
    with pytest.raises(ValueError, match="overlap"):
        plan_windows(10, 9, 9)
    with pytest.raises(ValueError, match="at least one frame"):
        plan_windows(0, 9, 2)
    b = StreamingBlender(plan_windows(30, 9, 4))
    with pytest.raises(ValueError, match="in order"):
        b.push(1, torch.zeros(9, 1))
    with pytest.raises(ValueError, match="covers 9 frames"):
        b.push(0, torch.zeros(5, 1))
    with pytest.raises(RuntimeError, match="windows were pushed"):
        b.flush()


@settings(max_examples=200, deadline=None)
@given(plans(), st.sampled_from(["cosine", "hann"]))
def test_every_pixel_stitch_weighs_each_frame_to_one(plan, stitch):
    from dataclasses import replace

    m = frame_weights(replace(plan, stitch=stitch))
    assert torch.allclose(m.sum(0), torch.ones(plan.frames, dtype=torch.float64))
    assert (m >= 0).all()


def test_hann_is_the_normalised_overlap_add_of_whole_window_hann_weights():
    """Two windows of 9 frames sharing 4: in the overlap, the earlier window weighs its Hann value over the sum."""
    plan = plan_windows(14, 9, 4, stitch="hann")
    assert [(w.start, w.stop) for w in plan] == [(0, 9), (5, 14)]
    w0 = plan.weights(0)
    for k in range(4):  # frame 5 + k: the earlier window's frame 5 + k, the later one's frame k
        a, b = math.sin(math.pi * (5 + k + 0.5) / 9) ** 2, math.sin(math.pi * (k + 0.5) / 9) ** 2
        assert w0[5 + k].item() == pytest.approx(a / (a + b))
    assert (w0[:5] == 1).all()  # a frame only one window covers takes it whole
    cos = plan_windows(14, 9, 4).weights(0)
    assert w0[5] > cos[5] and w0[8] < cos[8]  # flatter at the ends of the overlap than the raised cosine
    assert not torch.equal(w0, cos)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 3), st.integers(1, 8), st.integers(0, 40), st.integers(1, 200))
def test_latent_stitch_windows_start_on_the_time_factor(logk, n, overlap, frames):
    k = (1, 2, 4)[logk - 1]
    window = k * n + 1
    overlap = min(overlap, window - 1)
    if (window - overlap) // k < 1 and frames > window:
        with pytest.raises(ValueError, match="multiples of"):
            plan_windows(frames, window, overlap, temporal_factor=k, stitch="latent")
        return
    plan = plan_windows(frames, window, overlap, temporal_factor=k, stitch="latent")
    ws = plan.windows
    assert ws[0].start == 0 and ws[-1].stop == frames and plan.stitch == "latent"
    for w in ws:
        assert w.start % k == 0 and w.length <= min(window, frames)
        assert w.length > min(window, frames) - k  # padded to the same kn+1 as the others
    for a, b in zip(ws, ws[1:]):
        assert a.start < b.start and a.stop - b.start >= overlap
        assert k == 1 or a.stop > b.start  # the later window's first latent frame is covered by the earlier one


def test_the_pixel_blender_refuses_the_latent_stitch():
    with pytest.raises(ValueError, match="latent"):
        StreamingBlender(plan_windows(30, 9, 4, stitch="latent"))
    with pytest.raises(ValueError, match="unknown stitch"):
        plan_windows(30, 9, 4, stitch="feather")
