"""Colour: sRGB <-> L*a*b* (pipeline/lab.py), the lab colour transfer (color_fix.py) and the colour drift figures
(color_drift.py), against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ditsp.models.seedvr2.pipeline.color_drift import ColorDrift, color_drift, format_color_drift
from ditsp.models.seedvr2.pipeline.color_fix import apply_color_fix
from ditsp.models.seedvr2.pipeline.lab import lab_to_rgb, rgb_to_lab


def const(rgb, t=2, h=6, w=5, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(rgb, dtype=dtype).reshape(1, 3, 1, 1).expand(t, 3, h, w).clone()


@pytest.mark.parametrize("rgb, lab", [
    ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0)),
    ((1.0, 1.0, 1.0), (100.0, 0.0, 0.0)),
    ((0.5, 0.5, 0.5), (53.389, 0.0, 0.0)),  # 116 * (((0.5 + 0.055) / 1.055) ** 2.4) ** (1 / 3) - 16
    ((1.0, 0.0, 0.0), (53.241, 80.092, 67.203)),
    ((0.0, 0.0, 1.0), (32.296, 79.186, -107.857)),
])
def test_lab_of_known_colours(rgb, lab):
    got = rgb_to_lab(const(rgb))[0, :, 0, 0]
    assert got.tolist() == pytest.approx(lab, abs=6e-3)


def test_lab_matches_scikit_image_and_comes_back():
    from skimage.color import rgb2lab

    x = torch.rand(2, 3, 9, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = rgb2lab(x.permute(0, 2, 3, 1).numpy())
    assert np.abs(rgb_to_lab(x).permute(0, 2, 3, 1).numpy() - ref).max() < 1e-3
    assert (lab_to_rgb(rgb_to_lab(x)) - x).abs().max() < 1e-9
    assert (lab_to_rgb(rgb_to_lab(x.float())) - x.float()).abs().max() < 1e-5


def test_lab_transfer_of_a_constant_frame_takes_the_input_colour():
    content, style = const((0.9, 0.1, 0.1), dtype=torch.float32) * 2 - 1, const((0.4, 0.5, 0.6), dtype=torch.float32) * 2 - 1
    out = apply_color_fix(content, style, "lab")
    assert out.dtype == torch.float32 and (out - style).abs().max() < 1e-4


def _smooth(seed=2, t=3, h=8, w=10) -> torch.Tensor:
    """In-gamut sRGB frames in [0.3, 0.7] (a shift or scale of their Lab values stays in the gamut)."""
    return 0.3 + 0.4 * torch.rand(t, 3, h, w, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_lab_transfer_undoes_a_known_shift_and_stretch():
    style = _smooth()
    lab = rgb_to_lab(style)
    mean = lab.mean(dim=(2, 3), keepdim=True)
    moved = mean + (lab - mean) * torch.tensor([1.0, 1.3, 1.3], dtype=lab.dtype).reshape(3, 1, 1) \
        + torch.tensor([4.0, 3.0, -2.0], dtype=lab.dtype).reshape(3, 1, 1)  # +30% chroma spread, shifted
    content = lab_to_rgb(moved)
    assert (content - style).abs().max() > 0.02
    out = apply_color_fix(content * 2 - 1, style * 2 - 1, "lab")
    assert (out - (style * 2 - 1)).abs().max() < 1e-4
    # and the other transfers leave more behind
    assert (apply_color_fix(content * 2 - 1, style * 2 - 1, "adain") - (style * 2 - 1)).abs().max() > 1e-3


def _u8(rgb01: torch.Tensor) -> torch.Tensor:
    return rgb01.mul(255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def test_drift_is_zero_for_the_input_itself():
    ref = _u8(_smooth())
    d = color_drift(ref, ref)
    assert d == {"saturation_shift": 0.0, "hue_shift_deg": 0.0, "lightness_shift": 0.0}


def test_drift_of_a_known_saturation_and_hue_change():
    """Chroma x1.3 and hue turned by +10 degrees in the a*b* plane, lightness +2: the figures say so."""
    style = _smooth(t=2, h=24, w=24)
    lab = rgb_to_lab(style)
    a, b = lab[:, 1], lab[:, 2]
    c, s = math.cos(math.radians(10)), math.sin(math.radians(10))
    turned = torch.stack([lab[:, 0] + 2, 1.3 * (c * a - s * b), 1.3 * (s * a + c * b)], 1)
    out, ref = _u8(lab_to_rgb(turned)), _u8(style)
    d = color_drift(out, ref)
    assert d["saturation_shift"] == pytest.approx(0.3, abs=0.01)  # within the uint8 rounding
    assert d["hue_shift_deg"] == pytest.approx(10, abs=0.3)
    assert d["lightness_shift"] == pytest.approx(2, abs=0.1)


def test_drift_per_window_and_overall():
    ref = _u8(_smooth(t=4))
    grey = _u8(_smooth(t=4).mean(1, keepdim=True).expand(4, 3, 8, 10))
    meter = ColorDrift()
    meter.add(0, ref[:2], ref[:2])
    meter.add(1, grey[2:], ref[2:])  # window 2 lost its colour: -100% saturation, no hue to compare
    meter.add(1, ref[:0], ref[:0])
    r = meter.report()
    assert [w["frames"] for w in r["windows"]] == [2, 2]
    assert r["windows"][0]["saturation_shift"] == 0.0
    assert r["windows"][1]["saturation_shift"] == pytest.approx(-1, abs=0.02)
    assert -1 < r["saturation_shift"] < 0 and "L*a*b*" in r["space"]
    assert "saturation" in format_color_drift(r) and "per window" in format_color_drift(r)
    for i in range(2, 8):
        meter.add(i, ref[:1], ref[:1])
    assert "the most saturation drift of 8 windows: 2: -" in format_color_drift(meter.report())
    with pytest.raises(ValueError, match="equal"):
        color_drift(ref, ref[:, :4])


def test_a_large_frame_is_measured_on_a_subgrid():
    big = _u8(_smooth(t=1, h=300, w=400))  # 120,000 pixels: every second row and column
    assert color_drift(big, big)["saturation_shift"] == 0.0
